//! The postgres store: one reservation's latency (p50/p95/p99 over 2,000 calls); the same with
//! 0, 10 and 1,000 requests waiting on other instances; reservations per second on one
//! destination with 1, 4 and 16 concurrent reservers, and over 64 destinations; batched pacing
//! at rate 50,000 on one destination through 1, 2 and 4 pacers (slots/s, statements per slot);
//! then the
//! Python reference design on the same database for comparison.
//!
//! Run: `cargo bench --bench store_postgres`. It uses `PACEGATE_TEST_DATABASE_URL` when set,
//! else starts a throwaway cluster from the local PostgreSQL binaries. Under `cargo test` it
//! runs a short smoke version. Figures are recorded in docs/benchmarks.md.

#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "measures real time, across processes and threads of its own; clippy.toml's rules are the library's"
)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use pacegate::budget::{Ask, ClassQueue, Rule, Store};
use pacegate::class::{Class, Classes};
use pacegate::config::Statements;
use pacegate::destination::{Destination, Pace};
use pacegate::metrics::Metrics;
use pacegate::pacing::{Asking, Pacer};
use pacegate::store::postgres::PostgresStore;

fn rule() -> Rule {
    // Far faster than any reservation: the slot is always "now", nobody waits.
    Rule {
        interval: Duration::from_nanos(1000),
        cost: 1,
        metered: false,
        burst: 1,
        backoff_factor: 2.0,
        backoff_max: 64.0,
        decay_after: 100,
        retry_after_max: Duration::from_secs(3600),
        shares: Arc::from(vec![0.0]),
        quota: Vec::new(),
        window: None,
        largest: 0,
        reserve: 0,
        vendor_pace: pacegate::destination::VendorPace::Burst,
        block: None,
    }
}

/// Registers `n` instances `{prefix}1` to `{prefix}n`, live for the whole run (their last
/// heartbeat is an hour ahead); returns the connection that did it.
async fn live_instances(url: &str, prefix: &str, n: usize) -> tokio_postgres::Client {
    let (raw, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    raw.execute(
        "INSERT INTO pacegate_instances (id, host, pid, version, started_at, last_seen)
         SELECT $1 || g, 'bench', 0, '0', now(), now() + interval '1 hour'
         FROM generate_series(1, $2::int) AS g",
        &[&prefix, &(n as i32)],
    )
    .await
    .unwrap();
    raw
}

/// One reservation for one request waiting alone: the common case.
async fn reserve(store: &PostgresStore, destination: &str, rule: &Rule) {
    let queues = [ClassQueue {
        class: Class(0),
        count: 1,
        oldest: tokio::time::Instant::now(),
        next: None,
    }];
    let ask = Ask {
        queues: &queues,
        not_after: None,
        most: 1,
        cost: 1,
    };
    store.reserve(destination, rule, ask).await.unwrap();
}

async fn latency(store: &PostgresStore, calls: usize) -> Vec<f64> {
    let rule = rule();
    for _ in 0..100 {
        reserve(store, "latency", &rule).await;
    }
    let mut samples = Vec::with_capacity(calls);
    for _ in 0..calls {
        let started = Instant::now();
        reserve(store, "latency", &rule).await;
        samples.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    samples
}

/// One reservation's latency (ms, sorted) on a destination where `instances` other live
/// instances each have `per_instance` backfill requests waiting, for a caller with many
/// interactive requests waiting (so always granted, and never on the one-statement path):
/// with its wait list unchanged, then rewritten on every call.
async fn latency_among_waiters(
    url: &str,
    instances: usize,
    per_instance: usize,
    calls: usize,
) -> (Vec<f64>, Vec<f64>) {
    let destination = format!("crowd-{instances}-{per_instance}");
    let raw = live_instances(url, &destination, instances).await;
    raw.execute(
        "INSERT INTO pacegate_waiting (destination, instance, class, count, since)
         SELECT $1, $1 || g, 2, $3::int, now() FROM generate_series(1, $2::int) AS g",
        &[&destination, &(instances as i32), &(per_instance as i32)],
    )
    .await
    .unwrap();
    let store = store_at(url, 2).with_instance("bench");
    let rule = rule();
    // A long queue here, so that it never runs dry: request k arrived k µs before `start`.
    let start = tokio::time::Instant::now();
    let arrived = |k: u32| start - Duration::from_micros(u64::from(k));
    const QUEUED: u32 = 1_000_000;
    // `served` requests have had their slot and `joined` more have joined the queue's tail.
    let (mut served, mut joined) = (0u32, 0u32);
    let mut reserve = async |new_arrival: bool| {
        joined += u32::from(new_arrival);
        let head = QUEUED - served;
        let list = [ClassQueue {
            class: Class(0),
            count: QUEUED - served + joined,
            oldest: arrived(head),
            next: Some(arrived(head - 1)),
        }];
        let ask = Ask {
            queues: &list,
            not_after: None,
            most: 1,
            cost: 1,
        };
        let grant = store.reserve(&destination, &rule, ask).await.unwrap();
        served += 1;
        grant
    };
    for _ in 0..100 {
        reserve(true).await;
    }
    let sorted = |samples: &mut Vec<f64>| {
        samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
        std::mem::take(samples)
    };
    let mut samples = Vec::with_capacity(calls);
    let mut measured = Vec::new();
    // The usual case of a busy destination: the wait list is as the store last saw it, less
    // the requests it granted; then a new request on every reservation (rewritten).
    for changed in [false, true] {
        for _ in 0..calls {
            let started = Instant::now();
            let grant = reserve(changed).await;
            samples.push(started.elapsed().as_secs_f64() * 1000.0);
            assert_eq!(grant.class, Class(0));
        }
        measured.push(sorted(&mut samples));
    }
    let rewritten = measured.pop().unwrap();
    (measured.pop().unwrap(), rewritten)
}

async fn throughput(url: &str, reservers: usize, destinations: usize, run: Duration) -> f64 {
    let store = Arc::new(store_at(url, reservers));
    let rule = Arc::new(rule());
    let stop_at = Instant::now() + run;
    let tasks: Vec<_> = (0..reservers)
        .map(|r| {
            let (store, rule) = (store.clone(), rule.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < stop_at {
                    let dest = format!("d{}", (r + n as usize) % destinations);
                    reserve(&store, &dest, &rule).await;
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total as f64 / run.as_secs_f64()
}

/// What [`paced`] measured.
struct Paced {
    slots_per_second: f64,
    statements_per_slot: f64,
    /// The most slots handed out in any 100 ms, against the rate's 100 ms worth.
    busiest_100ms: usize,
}

/// `instances` pacers, each on its own store handle reporting as its own live instance, share
/// one destination at `rate`; `per_instance` tasks on each take slots back to back for `run`.
/// Counts the slots handed out, the database round trips they cost (heartbeats aside: the
/// pacers here run none), and the busiest 100 ms.
async fn paced(
    url: &str,
    instances: usize,
    per_instance: usize,
    rate: f64,
    run: Duration,
) -> Paced {
    let destination = format!("paced-{instances}");
    let _raw = live_instances(url, &destination, instances).await;
    let mut stores = Vec::new();
    let mut pacers = Vec::new();
    for i in 1..=instances {
        let store = Arc::new(store_at(url, 4).with_instance(&format!("{destination}{i}")));
        let d = Destination {
            name: destination.clone(),
            hosts: vec![],
            // Each slot is waited for up to 5 s.
            pace: Pace {
                max_wait: Duration::from_secs(5),
                ..Pace::new(rate)
            },
            ports: Default::default(),
            allow_private_upstreams: None,
            groups: Vec::new(),
            meters: Vec::new(),
            max_body: pacegate::destination::DEFAULT_MAX_BODY,
        };
        let metrics = Arc::new(Metrics::new(prometheus::Registry::new()).unwrap());
        let pacer = Arc::new(Pacer::new(
            &[d],
            Classes::default(),
            store.clone(),
            metrics,
            format!("{destination}{i}"),
        ));
        pacer.start().await.unwrap();
        stores.push(store);
        pacers.push(pacer);
    }
    let before: u64 = stores.iter().map(|s| s.statements()).sum();
    let started = tokio::time::Instant::now();
    let stop_at = started + run;
    let mut tasks = Vec::new();
    for pacer in &pacers {
        for _ in 0..per_instance {
            let pacer = pacer.clone();
            let name = destination.clone();
            tasks.push(tokio::spawn(async move {
                let route = pacer.destination(&name).unwrap();
                let headers = http::HeaderMap::new();
                let asking = Asking {
                    host: &name,
                    user: None,
                    headers: &headers,
                    client: None,
                    body: None,
                };
                let mut times = Vec::new();
                while tokio::time::Instant::now() < stop_at {
                    if pacer.tunnel(route.clone(), &asking, Class(0)).await.is_ok() {
                        times.push(tokio::time::Instant::now() - started);
                    }
                }
                times
            }));
        }
    }
    let mut times = Vec::new();
    for t in tasks {
        times.extend(t.await.unwrap());
    }
    let elapsed = started.elapsed();
    let after: u64 = stores.iter().map(|s| s.statements()).sum();
    for pacer in &pacers {
        pacer.stop();
    }
    times.sort();
    let window = Duration::from_millis(100);
    let mut busiest = 0;
    let mut lo = 0;
    for hi in 0..times.len() {
        while times[hi] - times[lo] >= window {
            lo += 1;
        }
        busiest = busiest.max(hi - lo + 1);
    }
    Paced {
        slots_per_second: times.len() as f64 / elapsed.as_secs_f64(),
        statements_per_slot: (after - before) as f64 / times.len().max(1) as f64,
        busiest_100ms: busiest,
    }
}

/// A store over `connections` connections to `url`, sending its statements as
/// `PACEGATE_BENCH_STATEMENTS` says (`prepared`, the default, or `unnamed`).
fn store_at(url: &str, connections: usize) -> PostgresStore {
    let mode = match std::env::var("PACEGATE_BENCH_STATEMENTS").as_deref() {
        Ok("unnamed") => Statements::Unnamed,
        _ => Statements::Prepared,
    };
    PostgresStore::new(url, connections)
        .unwrap()
        .with_statements(mode)
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (_cluster, url) = support::database().await;
        let store = store_at(&url, 2);
        store.migrate().await.unwrap();
        let calls = if full { 2000 } else { 50 };
        let s = latency(&store, calls).await;
        println!(
            "store_postgres: one reservation, {calls} calls: p50 {:.3} ms, p95 {:.3} ms, p99 {:.3} ms",
            support::percentile(&s, 0.5),
            support::percentile(&s, 0.95),
            support::percentile(&s, 0.99)
        );
        let crowds: &[(usize, usize)] = if full {
            &[(0, 0), (10, 1), (1, 1000), (1000, 1)]
        } else {
            &[(0, 0), (10, 1)]
        };
        for &(instances, per_instance) in crowds {
            let (unchanged, rewritten) =
                latency_among_waiters(&url, instances, per_instance, calls).await;
            println!(
                "store_postgres: reservation with {} waiters on {instances} other instances, {calls} calls: wait list unchanged p50 {:.3} ms, p99 {:.3} ms; rewritten p50 {:.3} ms, p99 {:.3} ms",
                instances * per_instance,
                support::percentile(&unchanged, 0.5),
                support::percentile(&unchanged, 0.99),
                support::percentile(&rewritten, 0.5),
                support::percentile(&rewritten, 0.99)
            );
        }
        let run = if full { Duration::from_secs(3) } else { Duration::from_millis(200) };
        for reservers in [1, 4, 16] {
            let rate = throughput(&url, reservers, 1, run).await;
            println!("store_postgres: one destination, {reservers} reservers: {rate:.0} reservations/s");
        }
        let rate = throughput(&url, 16, 64, run).await;
        println!("store_postgres: 64 destinations, 16 reservers: {rate:.0} reservations/s");
        let rate = 50_000.0;
        for instances in [1, 2, 4] {
            let p = paced(&url, instances, 256, rate, run).await;
            println!(
                "store_postgres: paced at rate {rate}, {instances} instances x 256 takers, batched: {:.0} slots/s, {:.3} statements per slot, busiest 100 ms {} (the rate allows {})",
                p.slots_per_second,
                p.statements_per_slot,
                p.busiest_100ms,
                rate / 10.0
            );
        }
        if full {
            let out = std::process::Command::new("python3")
                .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/benches/reference_reserve.py"))
                .arg(&url)
                .arg(calls.to_string())
                .output();
            match out {
                Ok(o) if o.status.success() => print!("{}", String::from_utf8_lossy(&o.stdout)),
                _ => println!("reference not run: it needs python3 with psycopg (pip install 'psycopg[binary]')"),
            }
        }
    });
}
