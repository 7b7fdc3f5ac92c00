//! Budgets split by key, at scale.
//!
//! - Memory: what an idle key costs, 100,000 keys made by one request each and left idle
//!   (goal: at most 1 KiB a key), read from the process's resident set.
//! - Reading them: `/metrics` (the gauges set, then rendered), `/status` (as JSON) and the
//!   status table, at 10,000 live keys (goal: each under 50 ms).
//! - The keyed path: what finding a request's key (a credential's keyed hash, then its lane)
//!   adds to a request, against a budget not split (goal: at most 2 µs).
//! - The fleet: 1,000 keys at 1/s each over 3 `pacegate serve` instances on one Postgres, about
//!   1,000 requests a second: every key's busiest 1 s window, the store's transactions per
//!   request, the reservation time (p50, p99), and the instances' CPU.
//!
//! Run: `cargo bench --bench keys`. Uses `PACEGATE_TEST_DATABASE_URL` when set, else a
//! throwaway cluster. Under `cargo test` it runs a short smoke version of each part.

#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "measures real time, across processes and threads of its own; clippy.toml's rules are the library's"
)]

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
        keyed_path(if full { 200_000 } else { 2_000 }).await;
        fleet(full).await;
    });
}

/// A pacer over one destination split by host, on the memory store.
async fn pacer() -> (Arc<Pacer>, Arc<Metrics>) {
    pacer_keyed("key = \"host\"\nmax_keys = 1000000").await
}

/// A pacer over one destination with `keys` (its key rule, or none), on the memory store.
async fn pacer_keyed(keys: &str) -> (Arc<Pacer>, Arc<Metrics>) {
    let config = Config::parse(
        &format!("[tls]\ngenerate_ca = true\n[destinations.d]\nhosts = [\"*.example\"]\nrate = 1\n{keys}\n"),
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
    for n in from..to {
        let host = format!("h{n}.example");
        let asking = Asking {
            host: &host,
            user: None,
            headers: &headers,
            client: None,
            body: None,
        };
        let route = p.destination("d").unwrap();
        drop(
            p.tunnel(route, &asking, pacegate::class::Class(0))
                .await
                .unwrap(),
        );
    }
}

/// Times finding a request's budget, `n` times over: its key's lane when split by a
/// credential (the key made already), and the budget itself when not split.
async fn keyed_path(n: usize) {
    let (split, _) = pacer_keyed("key = \"header:authorization\"").await;
    let (plain, _) = pacer_keyed("").await;
    let mut headers = HeaderMap::new();
    headers.insert(
        "authorization",
        "Bearer ghp_0123456789abcdefghijklmnopqrstuvwxyzAB"
            .parse()
            .unwrap(),
    );
    let asking = Asking {
        host: "api.example",
        user: None,
        headers: &headers,
        client: None,
        body: None,
    };
    let route = split.keyed(split.destination("d").unwrap(), &asking).await;
    assert!(
        route.unwrap().name().contains('#'),
        "the request was not keyed"
    );
    let per_request = |p: Arc<Pacer>| {
        let asking = &asking;
        async move {
            let started = Instant::now();
            for _ in 0..n {
                let route = p.destination("d").unwrap();
                std::hint::black_box(p.keyed(route, asking).await.unwrap());
            }
            started.elapsed() / u32::try_from(n).unwrap()
        }
    };
    let mut keyed = Vec::new();
    let mut not_split = Vec::new();
    for _ in 0..3 {
        keyed.push(per_request(split.clone()).await);
        not_split.push(per_request(plain.clone()).await);
    }
    keyed.sort();
    not_split.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "the keyed path (median of 3 rounds of {n}): {:.2} µs a request by a credential's key, {:.2} µs for a budget not split: {:.2} µs added (goal: at most 2)",
        us(keyed[1]),
        us(not_split[1]),
        us(keyed[1]) - us(not_split[1])
    );
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
        assert!(text.contains("pacegate_keys{destination=\"d\",group=\"\"}"));
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

/// Seconds of CPU `pid` has used (user and system).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// The transactions the database has committed so far.
async fn commits(db: &tokio_postgres::Client) -> i64 {
    db.query_one(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// A Prometheus histogram's cumulative buckets, summed over `texts`: `(le, count)`, sorted.
fn histogram(texts: &[String], family: &str) -> Vec<(f64, f64)> {
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for text in texts {
        for line in text
            .lines()
            .filter(|l| l.starts_with(&format!("{family}_bucket")))
        {
            let le = line
                .split("le=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap();
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap()
            };
            let n: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
            match buckets.iter_mut().find(|b| b.0 == le) {
                Some(b) => b.1 += n,
                None => buckets.push((le, n)),
            }
        }
    }
    buckets.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    buckets
}

/// A quantile of the observations between two readings of a histogram, by linear
/// interpolation within its bucket (the buckets are coarse: 0.5, 1, 2, 5 ms).
fn quantile_between(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> f64 {
    let buckets: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, n)| {
            let was = before.iter().find(|b| b.0 == *le).map_or(0.0, |b| b.1);
            (*le, n - was)
        })
        .collect();
    let total = buckets.last().map_or(0.0, |b| b.1);
    let want = q * total;
    let mut below = (0.0, 0.0);
    for (le, n) in buckets {
        if n >= want {
            if le.is_infinite() {
                return below.0;
            }
            return below.0 + (le - below.0) * (want - below.1) / (n - below.1).max(1.0);
        }
        below = (le, n);
    }
    below.0
}

async fn fleet(full: bool) {
    let (keys, secs) = if full { (1000, 10) } else { (12, 3) };
    let (_cluster, url) = support::database().await;
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let upstream = support::FakeUpstream::start().await;
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let fleet: Vec<_> = dirs
        .iter()
        .map(|d| {
            let config = d.path().join("pacegate.toml");
            std::fs::write(
                &config,
                format!(
                    "[proxy]\nlisten = \"127.0.0.1:0\"\nallow_private_upstreams = true\nports = [\"1024-65535\"]\n[proxy.limits]\nmax_connections = 4096\nmax_requests = 4096\n[admin]\nlisten = \"127.0.0.1:0\"\n[tls]\ngenerate_ca = true\n[store]\nbackend = \"postgres\"\nurl = \"{url}\"\n[destinations.local]\nhosts = [\"localhost\"]\nrate = 1\nkey = \"header:x-tenant\"\nmax_wait = \"30s\"\n"
                ),
            )
            .unwrap();
            support::process::spawn_binary(&config)
        })
        .collect();
    let clients: Vec<_> = fleet
        .iter()
        .map(|i| {
            support::client(
                Some(&format!("http://{}", i.proxy)),
                &[],
                support::Alpn::Http1,
            )
        })
        .collect();
    let base = upstream.http_url("localhost");
    let cpu_before: Vec<f64> = fleet.iter().map(|i| cpu_seconds(i.child.id())).collect();
    let own_before = cpu_seconds(std::process::id());
    let commits_before = commits(&db).await;
    let started = Instant::now();
    let until = started + Duration::from_secs(secs);
    // The reservations are read from the 3rd second on: the first second makes every key
    // at once, a burst of new rows that no steady load has.
    let warmed = {
        let admins: Vec<_> = fleet.iter().map(|i| i.admin).collect();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let mut texts = Vec::new();
            for admin in admins {
                texts.push(support::admin_get(admin, "/metrics").await);
            }
            histogram(&texts, "pacegate_reservation_seconds")
        })
    };
    let mut tasks = Vec::new();
    for k in 0..keys {
        let (via, base) = (clients[k % 3].clone(), base.clone());
        tasks.push(tokio::spawn(async move {
            let mut sent = 0;
            while Instant::now() < until {
                let resp = via
                    .get(format!("{base}/k{k}/{sent}"))
                    .header("x-tenant", format!("tenant-{k}"))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                sent += 1;
            }
            sent
        }));
    }
    let mut requests = 0;
    for t in tasks {
        requests += t.await.unwrap();
    }
    let took = started.elapsed();
    let own = cpu_seconds(std::process::id()) - own_before;
    let commits_after = commits(&db).await;
    let cpu: Vec<f64> = fleet
        .iter()
        .zip(&cpu_before)
        .map(|(i, before)| cpu_seconds(i.child.id()) - before)
        .collect();
    let mut metrics = Vec::new();
    for i in &fleet {
        metrics.push(support::admin_get(i.admin, "/metrics").await);
    }
    let mut by_key: std::collections::HashMap<String, Vec<Instant>> = Default::default();
    for r in upstream.recorded() {
        let key = r.path.split('/').nth(1).unwrap_or_default().to_owned();
        by_key.entry(key).or_default().push(r.at);
    }
    let worst = by_key
        .values_mut()
        .map(|at| {
            at.sort();
            support::busiest(at, Duration::from_secs(1))
        })
        .max()
        .unwrap_or(0);
    let (warm, end) = (
        warmed.await.unwrap(),
        histogram(&metrics, "pacegate_reservation_seconds"),
    );
    let p50 = quantile_between(&warm, &end, 0.5) * 1000.0;
    let p99 = quantile_between(&warm, &end, 0.99) * 1000.0;
    println!(
        "fleet: {keys} keys at 1/s over 3 instances, {requests} requests in {:.1} s ({:.0}/s); busiest 1 s window of any key: {worst} (at most 2); {:.2} store transactions per request; reservation (from the 3rd second) p50 {p50:.2} ms, p99 {p99:.2} ms; instances' CPU {:.1} s ({:.0} µs per request), the clients' and upstream's {own:.1} s",
        took.as_secs_f64(),
        requests as f64 / took.as_secs_f64(),
        (commits_after - commits_before) as f64 / requests as f64,
        cpu.iter().sum::<f64>(),
        cpu.iter().sum::<f64>() / requests as f64 * 1e6,
    );
    assert!(worst <= 2, "a key took {worst} slots in one second");
}
