//! The hop-by-hop strip, run on every request and every response: a request that carries no
//! hop-by-hop header (what most clients send) and nginx's answer (`Connection: keep-alive`
//! among seven ordinary headers).
//!
//! Run: `cargo bench --bench headers`. Figures are recorded in docs/benchmarks.md.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use http::{HeaderMap, HeaderName, HeaderValue};
use pacegate::headers::strip_hop_by_hop;

fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
    }
    h
}

fn bench(c: &mut Criterion) {
    let request = headers(&[
        ("host", "api.example.com"),
        ("user-agent", "python-requests/2.31.0"),
        ("accept-encoding", "gzip, deflate"),
        ("accept", "*/*"),
    ]);
    let answer = headers(&[
        ("server", "nginx/1.22.1"),
        ("date", "Tue, 01 Dec 2026 19:00:00 GMT"),
        ("content-type", "application/octet-stream"),
        ("content-length", "1024"),
        ("last-modified", "Tue, 01 Dec 2026 17:00:00 GMT"),
        ("connection", "keep-alive"),
        ("etag", "\"6929d6a0-400\""),
        ("accept-ranges", "bytes"),
    ]);
    let mut g = c.benchmark_group("strip_hop_by_hop");
    for (name, map) in [("request_without_any", &request), ("nginx_answer", &answer)] {
        g.bench_function(name, |b| {
            b.iter_batched_ref(
                || map.clone(),
                |h| strip_hop_by_hop(black_box(h)),
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
