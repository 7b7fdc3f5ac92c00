//! Budgets shaped like the vendor's, across real OS processes: two `pacegate serve` instances
//! on one Postgres share each group's budget, so the search bucket keeps its slow pace over
//! both while core requests go at the destination's rate. The control paces the destination
//! as one budget at the search bucket's rate, the only way to respect it without groups:
//! core then waits behind search.

use crate::support;

use std::time::{Duration, Instant};

use support::fleet::{alone, arrivals_of, postgres_store, Fleet};
use support::{busiest, FakeUpstream};

/// Through each instance at once: 2 searches and 5 core requests. Returns the arrivals of
/// each kind, over both instances.
async fn searches_and_core(fleet: &Fleet, upstream: &FakeUpstream) -> (Vec<Instant>, Vec<Instant>) {
    let base = upstream.http_url("localhost");
    let mut tasks = Vec::new();
    for i in 0..2 {
        let urls = (0..2)
            .map(|k| format!("{base}/search/issues?i={i}&k={k}"))
            .chain((0..5).map(|k| format!("{base}/core/repos?i={i}&k={k}")));
        for url in urls {
            let via = fleet.client(i);
            tasks.push(tokio::spawn(async move {
                via.get(url).send().await.unwrap().status()
            }));
        }
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    (
        arrivals_of(upstream, "search"),
        arrivals_of(upstream, "core"),
    )
}

fn span(at: &[Instant]) -> Duration {
    *at.last().unwrap() - at[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_each_group_s_budget_and_core_keeps_its_rate() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = Fleet::start_n(
        2,
        &postgres_store().await,
        "rate = 50\n[destinations.local.groups.search]\npaths = [\"/search/\"]\nrate = 2",
    )
    .await;
    let (search, core) = searches_and_core(&fleet, &upstream).await;
    // One search budget over both instances: 4 searches at 2/s, a slot every 500 ms.
    assert!(
        busiest(&search, Duration::from_secs(1)) <= 3,
        "{}",
        fleet.explain(&upstream)
    );
    assert!(
        span(&search) >= Duration::from_millis(1350),
        "{:?}",
        span(&search)
    );
    // Core at 50/s: 10 requests in about 0.2 s, not behind the searches.
    assert!(
        span(&core) < Duration::from_secs(1),
        "core took {:?}; {}",
        span(&core),
        fleet.explain(&upstream)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_one_budget_at_the_search_rate_stalls_core() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = Fleet::start_n(2, &postgres_store().await, "rate = 2").await;
    let (_, core) = searches_and_core(&fleet, &upstream).await;
    assert!(
        span(&core) >= Duration::from_secs(2),
        "core took only {:?} on the search rate",
        span(&core)
    );
}
