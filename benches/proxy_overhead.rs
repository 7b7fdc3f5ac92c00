//! What pacegate adds to one request: the same 1 KiB GET sent direct, through http forwarding
//! (with the RateLimit fields pacegate adds, and without: `advertise = false`) and through
//! https interception, on warm (pooled) connections, in one criterion group.
//!
//! Run: `cargo bench --bench proxy_overhead`. Figures are recorded in docs/benchmarks.md.

#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "measures real time, across processes and threads of its own; clippy.toml's rules are the library's"
)]

#[path = "../tests/support/mod.rs"]
mod support;

use criterion::{criterion_group, criterion_main, Criterion};
use support::{client, Alpn, FakeUpstream, TestProxy};

fn proxy_overhead(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    const LOCAL: &str = "[destinations.local]\nhosts = [\"localhost\"]\nrate = 100000\n# Forwarding scenarios: no verdicts, so every status passes through untouched.\nthrottle_statuses = []\nlockout_statuses = []\n";
    let (upstream, proxy, quiet) = rt.block_on(async {
        let upstream = FakeUpstream::start().await;
        let proxy = TestProxy::start(&upstream.ca.cert_path, "", LOCAL).await;
        // The same without the RateLimit fields (`advertise = false`), to see what they cost.
        let quiet = TestProxy::start(
            &upstream.ca.cert_path,
            "",
            &format!("{LOCAL}advertise = false\n"),
        )
        .await;
        (upstream, proxy, quiet)
    });
    let http = format!("{}/bytes/1024", upstream.http_url("localhost"));
    let https = format!("{}/bytes/1024", upstream.https_url("localhost"));
    let direct = client(None, &[&upstream.ca.cert_path], Alpn::Http1);
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let via_quiet = client(Some(&quiet.url()), &[&quiet.ca_path()], Alpn::Http1);

    let mut group = c.benchmark_group("get_1KiB");
    let cases = [
        ("direct_http", &direct, &http),
        ("via_http_forward", &via, &http),
        ("via_http_forward_no_ratelimit", &via_quiet, &http),
        ("direct_https", &direct, &https),
        ("via_https_intercept", &via, &https),
    ];
    for (name, client, url) in cases {
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| async {
                let body = client
                    .get(url.as_str())
                    .send()
                    .await
                    .unwrap()
                    .bytes()
                    .await
                    .unwrap();
                assert_eq!(body.len(), 1024);
            })
        });
    }
    group.finish();
    drop((proxy, quiet));
    drop(upstream);
}

criterion_group!(benches, proxy_overhead);
criterion_main!(benches);
