//! Pacing precision through the proxy: at 50 requests/s with more demand than that, how late
//! each request reaches the upstream relative to its slot on the beat (`origin + n / rate`,
//! the origin taken from the least late request).
//!
//! Run: `cargo bench --bench pacing_precision` (250 requests). Under `cargo test` it runs a
//! short smoke version. Figures are recorded in docs/benchmarks.md.

#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "measures real time, across processes and threads of its own; clippy.toml's rules are the library's"
)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::Duration;

use support::{client, Alpn, FakeUpstream, TestProxy};

const RATE: f64 = 50.0;
/// Arrivals left out of the measure, while the clients connect.
const RAMP_UP: usize = 10;

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let n = if full { 250 } else { 20 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let upstream = FakeUpstream::start().await;
        let dest = format!("[destinations.local]\nhosts = [\"localhost\"]\nrate = {RATE}\n");
        let proxy = TestProxy::start(&upstream.ca.cert_path, "", &dest).await;
        let via = client(Some(&proxy.url()), &[], Alpn::Http1);
        // Warm the connections, then let the schedule go idle so the run starts on a fresh beat.
        via.get(format!("{}/", upstream.http_url("localhost"))).send().await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        upstream.clear();
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let via = via.clone();
                let url = format!("{}/?{i}", upstream.http_url("localhost"));
                tokio::spawn(async move { via.get(url).send().await.unwrap().status() })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap(), 200);
        }
        let mut at: Vec<_> = upstream.recorded().iter().map(|r| r.at).collect();
        at.sort();
        // The first arrivals come while the clients are still connecting, when demand is not
        // yet continuous and the schedule may restart from "now": measure after them.
        let late = support::lateness_ms(&at[RAMP_UP..], RATE);
        let pct = |p: f64| support::percentile(&late, p);
        let span = (*at.last().unwrap() - at[0]).as_secs_f64();
        println!(
            "pacing_precision: {n} requests at {RATE}/s over {span:.3} s; lateness at the upstream vs the beat: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
            pct(0.5),
            pct(0.99),
            late.last().unwrap()
        );
        assert!(span >= (n - 1) as f64 / RATE * 0.98, "the ceiling held");
    });
}
