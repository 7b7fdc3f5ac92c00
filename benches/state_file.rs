//! A response's verdict on the memory store with a state file, as the response path pays it:
//! `Store::record` of a clean response that carries the vendor's remaining count, with 1 budget
//! and with 20,000 (each key is one). The state file is written with only what changed, the
//! vendor's count off the response path: the two should cost the same. And a lockout, which
//! is kept before its answer (one line appended and synced), with 1 and with 20,000.
//!
//! Run: `cargo bench --bench state_file`. Figures are recorded in docs/benchmarks.md.

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use pacegate::budget::{Event, Lockout, Observation, Pause, Rule, Store};
use pacegate::signals::Family;
use pacegate::store::memory::MemoryStore;

fn rule() -> Rule {
    Rule {
        interval: Duration::from_millis(10),
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

fn seen(remaining: u64) -> Observation {
    Observation {
        family: Family::XRateLimit,
        remaining,
        limit: Some(1_000_000),
        reset: Pause::For(Duration::from_secs(3600)),
        spread: 0.0,
        unanswered: 0,
    }
}

fn clean() -> Event {
    Event::Clean {
        success: true,
        generation: 0,
    }
}

/// A store with a state file and `budgets` budgets, each with a vendor's view.
fn store(rt: &tokio::runtime::Runtime, dir: &std::path::Path, budgets: usize) -> MemoryStore {
    let store = MemoryStore::open(&dir.join("state.json")).unwrap();
    rt.block_on(async {
        for i in 0..budgets {
            store
                .record(
                    &format!("api#{i:05}"),
                    &rule(),
                    clean(),
                    Some(seen(900_000)),
                )
                .await
                .unwrap();
        }
    });
    store
}

fn verdicts(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let rule = rule();
    for budgets in [1usize, 20_000] {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&rt, dir.path(), budgets);
        let mut remaining = 800_000u64;
        c.bench_function(
            &format!("record a vendor's count, {budgets} budgets"),
            |b| {
                b.iter(|| {
                    remaining -= 1;
                    rt.block_on(store.record("api#00000", &rule, clean(), Some(seen(remaining))))
                        .unwrap()
                })
            },
        );
        let mut n = 0u64;
        c.bench_function(&format!("record a lockout, {budgets} budgets"), |b| {
            b.iter_batched(
                || {
                    n += 1;
                    rt.block_on(store.unlock("api#00000")).unwrap();
                    Lockout::new(403, format!("GET https://api/x{n}"), "bench".into())
                },
                |lock| {
                    rt.block_on(store.record("api#00000", &rule, Event::Lockout(lock), None))
                        .unwrap()
                },
                BatchSize::PerIteration,
            )
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(Duration::from_secs(4));
    targets = verdicts
}
criterion_main!(benches);
