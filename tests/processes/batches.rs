//! Batched grants across real OS processes: three `pacegate serve` instances on one Postgres,
//! at a rate where each reservation grants a batch of slots, keep the ceiling, a quota window
//! and class priority, measured at the upstream, every arrival counted.

use crate::support;

use std::time::{Duration, Instant};

use support::fleet::{alone, arrivals_of, postgres_store, queue_up, Fleet, CLASSES, INSTANCES};
use support::{busiest, eventually, FakeUpstream};

/// 2.5 ms a slot: a 50 ms batch holds up to 21.
const RATE: f64 = 400.0;

/// Slots reserved (granted to a request, or dropped as too late to use) per round trip to the
/// store, over every instance.
async fn slots_per_reservation(fleet: &Fleet) -> f64 {
    let (mut slots, mut trips) = (0.0, 0.0);
    for i in 0..INSTANCES {
        for class in ["default", "interactive", "scheduled", "backfill"] {
            let series = format!(
                "pacegate_granted_total{{class=\"{class}\",destination=\"local\",group=\"\"}}"
            );
            slots += fleet.metric(i, &series).await;
        }
        slots += fleet
            .metric(
                i,
                "pacegate_slots_dropped_total{destination=\"local\",group=\"\"}",
            )
            .await;
        trips += fleet
            .metric(i, "pacegate_reservation_seconds_count{store=\"postgres\"}")
            .await;
    }
    slots / trips
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_keep_one_ceiling_over_three_processes() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = Fleet::start(&postgres_store().await, &format!("rate = {RATE}")).await;
    // 600 requests at once, 200 through each instance: 1.5 s of slots.
    let at = fleet.load(&upstream, 200).await;
    assert_eq!(
        at.len(),
        INSTANCES + 600,
        "every request reached the upstream once"
    );
    let second = busiest(&at, Duration::from_secs(1));
    assert!(
        second <= RATE as usize + 1,
        "{second} requests reached the upstream within one second at rate {RATE}; {}",
        fleet.explain(&upstream)
    );
    // A batch is handed out slot by slot, not at once: most arrivals are a slot apart.
    let gaps: Vec<Duration> = at[INSTANCES..].windows(2).map(|w| w[1] - w[0]).collect();
    let bunched = gaps
        .iter()
        .filter(|g| **g < Duration::from_millis(1))
        .count();
    assert!(
        bunched * 5 <= gaps.len(),
        "{bunched} of {} arrivals came within 1 ms of the one before at rate {RATE}; {}",
        gaps.len(),
        fleet.explain(&upstream)
    );
    let batched = slots_per_reservation(&fleet).await;
    assert!(
        batched >= 3.0,
        "{batched:.2} slots per store round trip: the reservations were not batched"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_never_crowd_a_quota_window() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = Fleet::start(
        &postgres_store().await,
        &format!("rate = {RATE}\nquota = [{{ limit = 100, per = \"1s\" }}]"),
    )
    .await;
    // The warm-ups and 60 through each instance: 183, nearly two windows' worth.
    let at = fleet.load(&upstream, 60).await;
    assert_eq!(at.len(), INSTANCES + 180);
    let most = busiest(&at, Duration::from_secs(1));
    assert!(
        most <= 100,
        "{most} requests reached the upstream within 1 s under a quota of 100; {}",
        fleet.explain(&upstream)
    );
    // The quota, not the rate, set the pace: the second hundred waited for the window.
    assert!(at[182] - at[0] >= Duration::from_secs(1));
    let batched = slots_per_reservation(&fleet).await;
    assert!(batched >= 1.5, "{batched:.2} slots per store round trip");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interactive_requests_overtake_batches_of_backfill_on_other_instances() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let store = format!("{}{CLASSES}", postgres_store().await);
    let fleet = Fleet::start(&store, &format!("rate = {RATE}")).await;
    for i in 0..INSTANCES {
        let warm = format!("{}/warm-up", upstream.http_url("localhost"));
        assert_eq!(
            fleet.client(i).get(warm).send().await.unwrap().status(),
            200
        );
    }
    // Backfill through two instances: 600 requests, 1.5 s of slots, granted in batches.
    queue_up(&fleet, &upstream, 0, "backfill", 300);
    queue_up(&fleet, &upstream, 1, "backfill", 300);
    fleet.store_holds_waiting(&store, "backfill", 300).await;
    let sent = Instant::now();
    let interactive: Vec<_> = (0..20)
        .map(|k| {
            let via = fleet.client(2);
            let url = format!("{}/interactive/{k}", upstream.http_url("localhost"));
            tokio::spawn(async move {
                via.get(url)
                    .header("Pacegate-Class", "interactive")
                    .send()
                    .await
                    .unwrap()
                    .status()
            })
        })
        .collect();
    for t in interactive {
        assert_eq!(t.await.unwrap(), 200);
    }
    let last = *arrivals_of(&upstream, "interactive").last().unwrap();
    let after = eventually(
        Duration::from_secs(5),
        "backfill after the interactive",
        || async {
            let after = arrivals_of(&upstream, "backfill")
                .iter()
                .filter(|t| **t > last)
                .count();
            (after > 0).then_some(after)
        },
    )
    .await;
    let backfill = arrivals_of(&upstream, "backfill");
    let meanwhile = backfill.iter().filter(|t| **t > sent && **t < last).count();
    // Behind the queue, the interactive requests would have waited for the 500-odd backfill
    // requests still waiting. Ahead of it, they wait for their own slots, and for batches of
    // backfill granted before the store heard of them: 50 ms each, at most a few while the
    // 20 requests reach the instance one by one.
    assert!(
        meanwhile <= 150,
        "{meanwhile} backfill requests went while the interactive ones waited, {after} after; {}",
        fleet.explain(&upstream)
    );
}
