//! One slot reservation on the memory store: uncontended, and with 64 tasks contending for one
//! destination.
//!
//! Run: `cargo bench --bench reservation`. Figures are recorded in docs/benchmarks.md.

#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "measures real time, across processes and threads of its own; clippy.toml's rules are the library's"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use futures_util::FutureExt;
use pacegate::budget::{Ask, ClassQueue, Rule, Store};
use pacegate::class::Class;
use pacegate::store::memory::MemoryStore;

fn rule() -> Rule {
    // A fast destination, so that slots stay near "now" over millions of reservations.
    Rule {
        interval: Duration::from_nanos(1),
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

/// One request waiting alone: the common case.
fn alone() -> [ClassQueue; 1] {
    [ClassQueue {
        class: Class(0),
        count: 1,
        oldest: tokio::time::Instant::now(),
        next: None,
    }]
}

fn ask(queues: &[ClassQueue]) -> Ask<'_> {
    Ask {
        queues,
        not_after: None,
        most: 1,
        cost: 1,
    }
}

fn reservation(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = Arc::new(rt.block_on(async { MemoryStore::ephemeral() }));
    let rule = Arc::new(rule());
    let mut group = c.benchmark_group("memory_reservation");
    group.bench_function("uncontended", |b| {
        let _guard = rt.enter();
        let queues = alone();
        b.iter(|| {
            store
                .reserve("d", &rule, ask(&queues))
                .now_or_never()
                .expect("the memory store answers at once")
                .unwrap()
        })
    });
    group.bench_function("64_tasks_one_destination", |b| {
        b.iter_custom(|iters| {
            let per_task = iters.div_ceil(64);
            rt.block_on(async {
                let started = Instant::now();
                let tasks: Vec<_> = (0..64)
                    .map(|_| {
                        let (store, rule) = (store.clone(), rule.clone());
                        tokio::spawn(async move {
                            let queues = alone();
                            for _ in 0..per_task {
                                store.reserve("d", &rule, ask(&queues)).await.unwrap();
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.unwrap();
                }
                // Wall time per reservation, all 64 tasks reserving at once.
                started
                    .elapsed()
                    .mul_f64(iters as f64 / (per_task * 64) as f64)
            })
        })
    });
    group.finish();
}

criterion_group!(benches, reservation);
criterion_main!(benches);
