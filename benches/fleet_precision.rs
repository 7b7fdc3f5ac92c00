//! Pacing precision across processes: three `pacegate serve` instances on one Postgres share
//! `rate = 50`; 150 requests are sent through them at once. How late does each reach the
//! upstream relative to its slot on the beat (`origin + n / rate`, the origin taken from the
//! least late request)?
//!
//! Run: `cargo bench --bench fleet_precision`. Uses `PACEGATE_TEST_DATABASE_URL` when set,
//! else a throwaway cluster. Under `cargo test` it runs a short smoke version.

#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "measures real time, across processes and threads of its own; clippy.toml's rules are the library's"
)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use support::process::spawn_binary;
use support::{client, Alpn, FakeUpstream};

const RATE: f64 = 50.0;
/// Arrivals left out of the measure, while the clients connect.
const RAMP_UP: usize = 10;
const INSTANCES: usize = 3;

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let per_instance = if full { 50 } else { 5 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (_cluster, url) = support::database().await;
        let upstream = FakeUpstream::start().await;
        let dirs: Vec<_> = (0..INSTANCES).map(|_| tempfile::tempdir().unwrap()).collect();
        let fleet: Vec<_> = dirs
            .iter()
            .map(|d| {
                let config = d.path().join("pacegate.toml");
                std::fs::write(
                    &config,
                    format!(
                        "[proxy]\nlisten = \"127.0.0.1:0\"\nallow_private_upstreams = true\nports = [\"1024-65535\"]\n[admin]\nlisten = \"127.0.0.1:0\"\n[tls]\ngenerate_ca = true\n[store]\nbackend = \"postgres\"\nurl = \"{url}\"\n[destinations.local]\nhosts = [\"localhost\"]\nrate = {RATE}\n"
                    ),
                )
                .unwrap();
                spawn_binary(&config)
            })
            .collect();
        let clients: Vec<_> = fleet
            .iter()
            .map(|i| client(Some(&format!("http://{}", i.proxy)), &[], Alpn::Http1))
            .collect();
        // Warm every connection, then let the schedule go idle.
        for c in &clients {
            c.get(format!("{}/", upstream.http_url("localhost"))).send().await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        upstream.clear();
        let mut tasks = Vec::new();
        for (i, c) in clients.iter().enumerate() {
            for n in 0..per_instance {
                let c = c.clone();
                let u = format!("{}/?i={i}&n={n}", upstream.http_url("localhost"));
                tasks.push(tokio::spawn(async move { c.get(u).send().await.unwrap().status() }));
            }
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), 200);
        }
        let mut at: Vec<Instant> = upstream.recorded().iter().map(|r| r.at).collect();
        at.sort();
        // The first arrivals come while the clients are still connecting, when demand is not
        // yet continuous and the schedule may restart from "now": measure after them.
        let late = support::lateness_ms(&at[RAMP_UP..], RATE);
        let pct = |p: f64| support::percentile(&late, p);
        let span = (*at.last().unwrap() - at[0]).as_secs_f64();
        println!(
            "fleet_precision: {INSTANCES} instances, {} requests at {RATE}/s over {span:.3} s; lateness at the upstream vs the beat: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
            at.len(),
            pct(0.5),
            pct(0.99),
            late.last().unwrap()
        );
        drop(fleet);
    });
}
