//! What a meter adds to a request: the same chat completion sent through pacegate with a
//! token meter and without one, answered as JSON and as a server-sent-event stream of about
//! 1 MiB (whose every byte the settlement reads as it passes); for JSON also with a meter of
//! a fixed cost, whose slot is all it adds (no body read, no estimate, no settlement), so
//! that what reading the request and the answer costs is seen apart; and the time to a stream's
//! first byte, direct and through a meter. Then the resident set while a 100 MiB stream
//! passes through a meter, printed.
//!
//! Run: `cargo bench --bench meters`. Figures are recorded in docs/benchmarks.md.

#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "measures real time, across processes and threads of its own; clippy.toml's rules are the library's"
)]

#[path = "../tests/support/mod.rs"]
mod support;

use criterion::{criterion_group, criterion_main, Criterion};
use support::llm::FakeLlm;
use support::{client, Alpn, FakeUpstream, TestProxy};

/// A pacegate for `localhost` at a rate that never waits, with a token meter that never
/// waits either where `cost` is set: `openai` (the body read, estimated, and the answer
/// settled as it passes) or a number (the meter's slot alone).
async fn proxy(ca: &FakeUpstream, cost: Option<&str>) -> TestProxy {
    let mut config = "[destinations.llm]\nhosts = [\"localhost\"]\nrate = 100000\n".to_owned();
    if let Some(cost) = cost {
        config.push_str(&format!(
            "[destinations.llm.meters.tokens]\nper_minute = 1000000000\ncost = \"{cost}\"\n"
        ));
    }
    TestProxy::start(&ca.ca.cert_path, "", &config).await
}

/// A chat request; streamed in `chunks` chunks of 1 KiB where `chunks` is set.
fn chat(chunks: Option<u64>) -> String {
    let mut body = serde_json::json!({
        "model": "m",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "x".repeat(1024)}],
    });
    if let Some(n) = chunks {
        body["stream"] = true.into();
        body["stream_options"] = serde_json::json!({"include_usage": true});
        body["chunks"] = n.into();
        body["chunk_bytes"] = 1024.into();
    }
    body.to_string()
}

/// The resident set of this process, in KiB.
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

fn meters(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (vendor, ca, plain, metered, slot_only) = rt.block_on(async {
        let vendor = FakeLlm::start(1e12, 1e12).await;
        let ca = FakeUpstream::start().await;
        let plain = proxy(&ca, None).await;
        let metered = proxy(&ca, Some("openai")).await;
        let slot_only = proxy(&ca, Some("466")).await;
        (vendor, ca, plain, metered, slot_only)
    });
    let url = vendor.url();
    let direct = client(None, &[], Alpn::Http1);
    let via_plain = client(Some(&plain.url()), &[&plain.ca_path()], Alpn::Http1);
    let via_meter = client(Some(&metered.url()), &[&metered.ca_path()], Alpn::Http1);
    let via_slot = client(Some(&slot_only.url()), &[&slot_only.ca_path()], Alpn::Http1);
    let send = |client: &reqwest::Client, body: String| {
        client
            .post(url.as_str())
            .header("content-type", "application/json")
            .body(body)
            .send()
    };

    let mut group = c.benchmark_group("chat");
    for (name, client, chunks) in [
        ("json_no_meter", &via_plain, None),
        ("json_meter_slot_only", &via_slot, None),
        ("json_meter", &via_meter, None),
        ("sse_1MiB_no_meter", &via_plain, Some(1024)),
        ("sse_1MiB_meter", &via_meter, Some(1024)),
    ] {
        let body = chat(chunks);
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| async {
                let resp = send(client, body.clone()).await.unwrap();
                assert_eq!(resp.status(), 200);
                resp.bytes().await.unwrap();
            })
        });
    }
    for (name, client) in [
        ("first_byte_direct", &direct),
        ("first_byte_no_meter", &via_plain),
        ("first_byte_meter", &via_meter),
    ] {
        let body = chat(Some(64));
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| async {
                let mut resp = send(client, body.clone()).await.unwrap();
                assert!(resp.chunk().await.unwrap().is_some());
            })
        });
    }
    group.finish();

    // 100 MiB through the meter: what the settlement keeps is a line, and what the strip
    // keeps an event, so the resident set does not grow with the stream. Under `cargo
    // test`, which only sees that the bench runs, 1 MiB.
    let full = std::env::args().any(|a| a == "--bench");
    rt.block_on(async {
        let body = chat(Some(if full { 100 * 1024 } else { 1024 }));
        let before = rss_kib();
        let mut resp = send(&via_meter, body).await.unwrap();
        let mut read = 0u64;
        let mut peak = before;
        let mut chunks = 0u64;
        while let Some(chunk) = resp.chunk().await.unwrap() {
            read += chunk.len() as u64;
            chunks += 1;
            if chunks % 256 == 0 {
                peak = peak.max(rss_kib());
            }
        }
        println!(
            "a stream through a meter: {} MiB read; resident set {before} KiB before, at most {peak} KiB while it passed (+{} KiB)",
            read / (1024 * 1024),
            peak - before
        );
    });
    drop((plain, metered, slot_only, ca, vendor));
}

criterion_group!(benches, meters);
criterion_main!(benches);
