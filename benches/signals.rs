//! Reading one response: status, `Retry-After`, and every vendor rate-limit header family
//! present at once (the worst case), and a response that carries none (the common case).
//!
//! Run: `cargo bench --bench signals`. Figures are recorded in docs/benchmarks.md.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use http::{HeaderMap, HeaderName, HeaderValue};
use pacegate::destination::Pace;
use pacegate::pacing::verdict::classify;

fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
    }
    h
}

fn bench(c: &mut Criterion) {
    let pace = Pace::new(10.0);
    let every_family = headers(&[
        ("date", "Wed, 09 Aug 2023 14:00:00 GMT"),
        ("content-type", "application/json; charset=utf-8"),
        (
            "ratelimit-policy",
            "\"permin\";q=50;w=60, \"perday\";q=1000;w=86400",
        ),
        (
            "ratelimit",
            "\"permin\";r=12;t=30, \"perday\";r=900;t=80000",
        ),
        ("x-ratelimit-limit", "5000"),
        ("x-ratelimit-remaining", "4999"),
        ("x-ratelimit-used", "1"),
        ("x-ratelimit-reset", "1691591363"),
        ("x-ratelimit-reset-after", "64.57"),
        ("x-rate-limit-limit", "900"),
        ("x-rate-limit-remaining", "847"),
        ("x-rate-limit-reset", "1691591363"),
        ("x-ratelimit-limit-requests", "60"),
        ("x-ratelimit-remaining-requests", "59"),
        ("x-ratelimit-reset-requests", "6m0s"),
        ("x-shopify-shop-api-call-limit", "32/40"),
    ]);
    let none = headers(&[
        ("date", "Wed, 09 Aug 2023 14:00:00 GMT"),
        ("content-type", "text/html"),
        ("content-length", "1234"),
        ("cache-control", "max-age=60"),
    ]);
    let mut g = c.benchmark_group("read_response");
    g.bench_function("every_family", |b| {
        b.iter(|| classify(black_box(200), black_box(&every_family), &pace))
    });
    g.bench_function("no_signals", |b| {
        b.iter(|| classify(black_box(200), black_box(&none), &pace))
    });
    let ietf = headers(&[
        (
            "ratelimit-policy",
            "\"permin\";q=50;w=60, \"perday\";q=1000;w=86400",
        ),
        (
            "ratelimit",
            "\"permin\";r=12;t=30, \"perday\";r=900;t=80000",
        ),
    ]);
    g.bench_function("ietf_only", |b| {
        b.iter(|| classify(black_box(200), black_box(&ietf), &pace))
    });
    let x = headers(&[
        ("x-ratelimit-limit", "5000"),
        ("x-ratelimit-remaining", "4999"),
        ("x-ratelimit-reset", "1691591363"),
    ]);
    g.bench_function("x_only", |b| {
        b.iter(|| classify(black_box(200), black_box(&x), &pace))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
