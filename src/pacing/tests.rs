//! The pacer on paused time with the memory store.

use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use prometheus::Registry;
use tokio::time::Instant;

use super::*;
use crate::budget::{Event, ReserveError};
use crate::destination::{Destination, Group, Pace};
use crate::pacing::verdict::Verdict;
use crate::store::memory::MemoryStore;

fn pace(rate: f64) -> Pace {
    Pace::new(rate)
}

async fn pacer(pace: Pace) -> Arc<Pacer> {
    pacer_with(pace, Classes::default()).await
}

/// The one class of a config without `[classes]`.
const ONE: Class = Class(0);

/// The destination every test here paces.
fn d(p: &Pacer) -> Route {
    p.destination("d").expect("destination d")
}

impl Pacer {
    /// Reads a response by status and headers and applies its verdict, as the proxy does
    /// for a response whose body needs no look.
    async fn answer(&self, a: &Admission, status: u16, h: &HeaderMap, request: &str) -> Verdict {
        let reading = self.read(a, status, h);
        let resource = crate::signals::resource(h);
        self.observed(a, reading, status, resource.as_deref(), || {
            request.to_owned()
        })
        .await
    }

    /// [`Pacer::observe`], its writes done.
    pub(super) async fn observed(
        &self,
        a: &Admission,
        reading: verdict::Reading,
        status: u16,
        resource: Option<&str>,
        request: impl FnOnce() -> String,
    ) -> Verdict {
        let (verdict, writes) = self.observe(a, reading, status, resource, request);
        super::observe::written(writes).await;
        verdict
    }
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(3600)
}

pub(super) fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    h
}

/// Admits `n` requests at once and returns when each was granted, relative to the start.
async fn grant_times(p: &Arc<Pacer>, n: usize) -> Vec<Duration> {
    grants_of(p, &d(p), n, Instant::now()).await
}

/// Admits `n` requests of `route` at once; returns when each was granted, from `start`,
/// sorted.
pub(super) async fn grants_of(
    p: &Arc<Pacer>,
    route: &Route,
    n: usize,
    start: Instant,
) -> Vec<Duration> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (p, route) = (p.clone(), route.clone());
            tokio::spawn(async move {
                drop(p.admit(&route, ONE, far()).await.unwrap());
                Instant::now() - start
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out.sort();
    out
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[tokio::test(start_paused = true)]
async fn slots_are_handed_out_at_the_rate() {
    let p = pacer(pace(10.0)).await;
    assert_eq!(
        grant_times(&p, 5).await,
        [ms(0), ms(100), ms(200), ms(300), ms(400)]
    );
}

#[tokio::test(start_paused = true)]
async fn fractional_rates() {
    let p = pacer(pace(0.5)).await;
    assert_eq!(grant_times(&p, 3).await, [ms(0), ms(2000), ms(4000)]);
}

#[tokio::test(start_paused = true)]
async fn burst_then_the_rate() {
    let p = pacer(Pace {
        burst: 3,
        ..pace(10.0)
    })
    .await;
    assert_eq!(
        grant_times(&p, 5).await,
        [ms(0), ms(0), ms(0), ms(100), ms(200)]
    );
}

#[tokio::test(start_paused = true)]
async fn first_come_first_served() {
    let p = pacer(pace(10.0)).await;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..5 {
        let (p, tx) = (p.clone(), tx.clone());
        tokio::spawn(async move {
            let _a = p.admit(&d(&p), ONE, far()).await.unwrap();
            tx.send(i).unwrap();
        });
        // Arrivals 1 ms apart, in order.
        tokio::time::sleep(ms(1)).await;
    }
    drop(tx);
    let mut order = Vec::new();
    while let Some(i) = rx.recv().await {
        order.push(i);
    }
    assert_eq!(order, [0, 1, 2, 3, 4]);
}

#[tokio::test(start_paused = true)]
async fn no_slot_within_max_wait_is_refused_at_once() {
    let p = pacer(pace(1.0)).await;
    let _first = p.admit(&d(&p), ONE, far()).await.unwrap();
    let started = Instant::now();
    match p.admit(&d(&p), ONE, Instant::now() + ms(500)).await {
        Err(PaceError::Deadline { retry_after, .. }) => {
            assert_eq!(
                started.elapsed(),
                Duration::ZERO,
                "refused without waiting for nothing"
            );
            assert_eq!(retry_after, ms(1000));
        }
        other => panic!("expected a deadline refusal, got {:?}", other.err()),
    }
    // The refusal took no slot: the next request gets the slot at 1 s.
    p.admit(&d(&p), ONE, far()).await.unwrap();
    assert_eq!(started.elapsed(), ms(1000));
}

#[tokio::test(start_paused = true)]
async fn a_request_that_gives_up_leaves_the_queue_at_once() {
    let p = pacer(pace(1.0)).await;
    let _first = p.admit(&d(&p), ONE, far()).await.unwrap();
    let p2 = p.clone();
    let abandoned = tokio::spawn(async move { p2.admit(&d(&p2), ONE, far()).await.map(|_| ()) });
    tokio::time::sleep(ms(100)).await;
    assert_eq!(p.status().await[0].waiting, 1);
    abandoned.abort();
    let _ = abandoned.await;
    assert_eq!(
        p.status().await[0].waiting,
        0,
        "the queue forgets it at once"
    );
    // The slot it was to get goes to the next request instead of being lost.
    let started = Instant::now();
    p.admit(&d(&p), ONE, far()).await.unwrap();
    assert_eq!(started.elapsed(), ms(900));
}

#[tokio::test(start_paused = true)]
async fn lockout_refuses_waiting_and_arriving_requests_until_unlocked() {
    let p = pacer(pace(1.0)).await;
    let first = p.admit(&d(&p), ONE, far()).await.unwrap();
    let waiting: Vec<_> = (0..3)
        .map(|_| {
            let p = p.clone();
            tokio::spawn(async move { p.admit(&d(&p), ONE, far()).await.map(|_| ()) })
        })
        .collect();
    tokio::time::sleep(ms(10)).await;
    let verdict = p
        .answer(&first, 403, &HeaderMap::new(), "GET https://d/secret")
        .await;
    assert_eq!(verdict, Verdict::Lockout);
    let refused_at = Instant::now();
    for w in waiting {
        match w.await.unwrap() {
            Err(PaceError::Locked { lock, .. }) => {
                assert_eq!(
                    (lock.status, lock.request.as_str()),
                    (403, "GET https://d/secret")
                );
            }
            other => panic!("expected a lockout refusal, got {other:?}"),
        }
    }
    assert_eq!(
        refused_at.elapsed(),
        Duration::ZERO,
        "waiting requests are refused at once"
    );
    assert!(matches!(
        p.admit(&d(&p), ONE, far()).await,
        Err(PaceError::Locked { .. })
    ));
    tokio::time::sleep(Duration::from_secs(86_400)).await;
    assert!(
        matches!(
            p.admit(&d(&p), ONE, far()).await,
            Err(PaceError::Locked { .. })
        ),
        "time never clears it"
    );
    let status = p.status().await;
    assert_eq!(status[0].lock.as_ref().map(|l| l.status), Some(403));
    assert!(p.unlock("d").await.unwrap().is_some());
    assert!(p.admit(&d(&p), ONE, far()).await.is_ok());
    assert!(matches!(
        p.unlock("nope").await,
        Err(UnlockError::Unknown(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn ten_concurrent_throttles_widen_once() {
    let p = pacer(Pace {
        burst: 10,
        ..pace(100.0)
    })
    .await;
    let mut admitted = Vec::new();
    for _ in 0..10 {
        admitted.push(p.admit(&d(&p), ONE, far()).await.unwrap());
    }
    for a in &admitted {
        p.answer(a, 429, &HeaderMap::new(), "GET /").await;
    }
    let s = &p.status().await[0];
    assert_eq!(s.backoff, 2.0);
    assert_eq!(s.effective_rate, 50.0);
}

#[tokio::test(start_paused = true)]
async fn retry_after_pauses_every_request() {
    let p = pacer(pace(100.0)).await;
    let a = p.admit(&d(&p), ONE, far()).await.unwrap();
    let v = p
        .answer(&a, 429, &headers(&[("retry-after", "3")]), "GET /")
        .await;
    assert_eq!(
        v,
        Verdict::Throttled {
            retry_after: Some(verdict::Pause::For(Duration::from_secs(3))),
            reset: None,
            why: verdict::Why::Status,
        }
    );
    assert!(p.status().await[0].paused_for_seconds > 2.9);
    let started = Instant::now();
    p.admit(&d(&p), ONE, far()).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "waited {:?}",
        started.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_is_counted_sent_when_its_slot_is_due_and_waited_until_then() {
    // 10/s: the first goes at once, the second 100 ms later.
    let p = pacer(pace(10.0)).await;
    let first = p.admit(&d(&p), ONE, far()).await.unwrap();
    assert_eq!(first.waited, Duration::ZERO);
    let started = Instant::now();
    let second = p.admit(&d(&p), ONE, far()).await.unwrap();
    assert_eq!(second.waited, ms(100));
    assert_eq!(second.sent, started + ms(100));
    let waits = p.metrics.wait_seconds.with_label_values(&["d", ""]);
    assert_eq!(waits.get_sample_count(), 2);
    assert!(
        (waits.get_sample_sum() - 0.1).abs() < 1e-6,
        "{}",
        waits.get_sample_sum()
    );
    // Asked at the reading it was counted sent at, its slot is on time.
    assert!(!p.too_late(&second, second.sent));
}

#[tokio::test(start_paused = true)]
async fn a_request_held_up_past_its_slot_is_not_sent_on_it() {
    // 10/s: a slot may be used up to 50 ms late.
    let p = pacer(pace(10.0)).await;
    let a = p.admit(&d(&p), ONE, far()).await.unwrap();
    assert!(!p.too_late(&a, Instant::now()));
    tokio::time::sleep(ms(50)).await;
    assert!(
        !p.too_late(&a, Instant::now()),
        "50 ms late is still on time"
    );
    tokio::time::sleep(ms(1)).await;
    assert!(
        p.too_late(&a, Instant::now()),
        "51 ms late bunches with the next slot"
    );
    assert_eq!(
        p.metrics.slots_dropped.with_label_values(&["d", ""]).get(),
        1
    );
    // The next request waits for a slot of its own, on the beat.
    let started = Instant::now();
    p.admit(&d(&p), ONE, far()).await.unwrap();
    assert_eq!(started.elapsed(), ms(49));
}

#[tokio::test(start_paused = true)]
async fn lateness_the_store_could_not_see_counts() {
    // A slot placed by a span of the database clock 10 ms wide may already be 10 ms late
    // when it comes: at 10/s it may then be used only 40 ms after it, not 50.
    let p = pacer(pace(10.0)).await;
    let mut a = p.admit(&d(&p), ONE, far()).await.unwrap();
    a.slot.unseen_late = ms(10);
    tokio::time::sleep(ms(40)).await;
    assert!(
        !p.too_late(&a, Instant::now()),
        "40 ms and 10 unseen is still on time"
    );
    tokio::time::sleep(ms(1)).await;
    assert!(
        p.too_late(&a, Instant::now()),
        "41 ms and 10 unseen bunches with the next slot"
    );
}

/// Reservations the dispatcher has asked the store for.
fn reservations(p: &Pacer) -> u64 {
    p.metrics
        .reservation_seconds
        .with_label_values(&["memory"])
        .get_sample_count()
}

#[tokio::test(start_paused = true)]
async fn a_request_below_the_rate_takes_its_slot_without_the_dispatcher() {
    let p = pacer(pace(100.0)).await;
    let trips = || reservations(&p);
    for _ in 0..3 {
        p.admit(&d(&p), ONE, far()).await.unwrap();
        tokio::time::sleep(ms(10)).await;
    }
    assert_eq!(trips(), 1, "only the first, which made the budget, queued");
    // Faster than the rate, the slot is not due: they queue, on the beat.
    let times = grant_times(&p, 4).await;
    assert_eq!(times, [ms(0), ms(10), ms(20), ms(30)]);
    assert!(trips() >= 4);
}

#[tokio::test(start_paused = true)]
async fn a_slot_a_moment_ahead_is_taken_at_once_and_waited_out_by_the_request() {
    // 100,000/s: two requests in the same instant, the second's slot 10 us after the first.
    let p = pacer(pace(100_000.0)).await;
    p.admit(&d(&p), ONE, far()).await.unwrap();
    tokio::time::sleep(ms(10)).await;
    let trips = reservations(&p);
    let start = Instant::now();
    let first = p.admit(&d(&p), ONE, far()).await.unwrap();
    let second = p.admit(&d(&p), ONE, far()).await.unwrap();
    assert_eq!(
        reservations(&p),
        trips,
        "neither went through the dispatcher"
    );
    assert_eq!(first.slot.at, start);
    assert_eq!(second.slot.at, start + Duration::from_micros(10));
    // Granted at its slot, never before it (the request spins on the clock until it; on
    // this paused clock, which does not move meanwhile, the timer takes over).
    assert!(Instant::now() >= second.slot.at);
    // Farther ahead than that, a slot is left to the dispatcher, on the beat.
    let p = pacer(pace(10_000.0)).await;
    p.admit(&d(&p), ONE, far()).await.unwrap();
    tokio::time::sleep(ms(10)).await;
    let trips = reservations(&p);
    let times = grant_times(&p, 2).await;
    assert_eq!(times[0], Duration::ZERO);
    assert!(times[1] >= Duration::from_micros(100), "{times:?}");
    assert!(reservations(&p) > trips, "the second queued");
}

#[tokio::test(start_paused = true)]
async fn slots_go_in_batches_only_where_the_interval_is_short() {
    // 200/s and faster: ten waiters take one reservation or a few, slot times unchanged.
    let p = pacer(pace(1000.0)).await;
    let times = grant_times(&p, 10).await;
    assert_eq!(times, (0..10).map(ms).collect::<Vec<_>>());
    let trips = reservations(&p);
    assert!(trips <= 3, "{trips} reservations for 10 slots");
    // Slower, one reservation per slot: each slot keeps a clock conversion of its own.
    let p = pacer(pace(100.0)).await;
    let times = grant_times(&p, 10).await;
    assert_eq!(times, (0..10).map(|n| ms(10 * n)).collect::<Vec<_>>());
    assert_eq!(reservations(&p), 10);
}

#[tokio::test(start_paused = true)]
async fn a_throttle_drops_the_rest_of_a_batch() {
    let p = pacer(pace(1000.0)).await;
    let start = Instant::now();
    // Ten requests wait at once: reservations grant them batches of slots 1 ms apart.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..10 {
        let (p, tx) = (p.clone(), tx.clone());
        tokio::spawn(async move {
            let a = p.admit(&d(&p), ONE, far()).await.unwrap();
            tx.send(a).unwrap();
        });
    }
    let first = rx.recv().await.unwrap();
    // A 429 with Retry-After: the slots the batch still holds must not be used.
    p.answer(&first, 429, &headers(&[("retry-after", "1")]), "GET /")
        .await;
    let mut later = Vec::new();
    for _ in 0..9 {
        rx.recv().await.unwrap();
        later.push(Instant::now() - start);
    }
    assert!(
        later.iter().all(|t| *t >= Duration::from_secs(1)),
        "admitted during the pause: {later:?}"
    );
    let dropped = p.metrics.slots_dropped.with_label_values(&["d", ""]).get();
    assert!(dropped >= 4, "the batch held {dropped} more slots");
}

#[tokio::test(start_paused = true)]
async fn decay_restores_the_rate_after_a_clean_streak() {
    let p = pacer(Pace {
        decay_after: 3,
        ..pace(10.0)
    })
    .await;
    let a = p.admit(&d(&p), ONE, far()).await.unwrap();
    p.answer(&a, 429, &HeaderMap::new(), "GET /").await;
    assert_eq!(p.status().await[0].backoff, 2.0);
    for _ in 0..3 {
        let a = p.admit(&d(&p), ONE, far()).await.unwrap();
        p.answer(&a, 200, &HeaderMap::new(), "GET /").await;
    }
    assert_eq!(p.status().await[0].backoff, 1.0);
}

#[tokio::test(start_paused = true)]
async fn max_concurrency_bounds_requests_in_flight() {
    let p = pacer(Pace {
        max_concurrency: 2,
        ..pace(1000.0)
    })
    .await;
    let a = p.admit(&d(&p), ONE, far()).await.unwrap();
    let b = p.admit(&d(&p), ONE, far()).await.unwrap();
    let p2 = p.clone();
    let third =
        tokio::spawn(async move { p2.admit(&d(&p2), ONE, far()).await.map(|_| Instant::now()) });
    tokio::time::sleep(ms(500)).await;
    assert!(
        !third.is_finished(),
        "a third request must wait while two are in flight"
    );
    assert_eq!(p.status().await[0].in_flight, 2);
    let released = Instant::now();
    drop(a);
    let granted = third.await.unwrap().unwrap();
    assert!(granted - released < ms(5));
    drop(b);
}

#[tokio::test(start_paused = true)]
async fn status_shows_waiting_and_oldest_wait() {
    let p = pacer(pace(1.0)).await;
    let _a = p.admit(&d(&p), ONE, far()).await.unwrap();
    for _ in 0..3 {
        let p = p.clone();
        tokio::spawn(async move { p.admit(&d(&p), ONE, far()).await.map(|_| ()) });
    }
    tokio::time::sleep(ms(400)).await;
    let s = &p.status().await[0];
    assert_eq!((s.waiting, s.in_flight), (3, 1));
    assert!((s.oldest_wait_seconds - 0.4).abs() < 0.01, "{s:?}");
    assert_eq!(s.rate, 1.0);
}

#[tokio::test(start_paused = true)]
async fn stopping_refuses_waiters() {
    let p = pacer(pace(0.1)).await;
    let _a = p.admit(&d(&p), ONE, far()).await.unwrap();
    let p2 = p.clone();
    let waiting = tokio::spawn(async move { p2.admit(&d(&p2), ONE, far()).await.map(|_| ()) });
    tokio::time::sleep(ms(10)).await;
    p.stop();
    assert!(matches!(
        waiting.await.unwrap(),
        Err(PaceError::ShuttingDown)
    ));
    // And one that comes after is refused at once.
    assert!(matches!(
        p.admit(&d(&p), ONE, far()).await.map(|_| ()),
        Err(PaceError::ShuttingDown)
    ));
}

#[tokio::test(start_paused = true)]
async fn a_lockout_taken_elsewhere_refuses_waiters_within_a_second() {
    // Another instance sharing the store locks the destination: this pacer's waiters for a
    // distant slot must not wait for it.
    let store = Arc::new(MemoryStore::ephemeral());
    let dest = Destination {
        name: "d".into(),
        hosts: vec![],
        pace: pace(0.1),
        ports: Default::default(),
        allow_private_upstreams: None,
        groups: Vec::new(),
        meters: Vec::new(),
        max_body: crate::destination::DEFAULT_MAX_BODY,
    };
    let metrics = Arc::new(Metrics::new(Registry::new()).unwrap());
    let p = Arc::new(Pacer::new(
        &[dest],
        Classes::default(),
        store.clone(),
        metrics,
        "here".into(),
    ));
    p.start().await.unwrap();
    let _first = p.admit(&d(&p), ONE, far()).await.unwrap();
    let p2 = p.clone();
    let waiting = tokio::spawn(async move { p2.admit(&d(&p2), ONE, far()).await.map(|_| ()) });
    tokio::time::sleep(ms(100)).await;
    let lock = Lockout::new(403, "GET https://d/".into(), "elsewhere".into());
    store
        .record("d", &d(&p).lane.keys().rule, Event::Lockout(lock), None)
        .await
        .unwrap();
    let started = Instant::now();
    match waiting.await.unwrap() {
        Err(PaceError::Locked { lock, .. }) => assert_eq!(lock.instance, "elsewhere"),
        other => panic!("expected a lockout refusal, got {other:?}"),
    }
    assert!(
        started.elapsed() <= Duration::from_secs(1),
        "refused after {:?}",
        started.elapsed()
    );
    // An unlock elsewhere is seen by the next request.
    store.unlock("d").await.unwrap();
    assert!(p.admit(&d(&p), ONE, far()).await.is_ok());
}

fn classes(backfill_share: f64) -> Classes {
    Classes {
        order: vec!["interactive".into(), "scheduled".into(), "backfill".into()],
        default: "scheduled".into(),
        share: if backfill_share > 0.0 {
            [("backfill".to_owned(), backfill_share)].into()
        } else {
            Default::default()
        },
        max_wait: [("interactive".to_owned(), Duration::from_secs(5))].into(),
        configured: true,
    }
}

async fn pacer_with(pace: Pace, classes: Classes) -> Arc<Pacer> {
    pacer_on(pace, classes, Arc::new(MemoryStore::ephemeral())).await
}

async fn pacer_on(pace: Pace, classes: Classes, store: Arc<dyn Store>) -> Arc<Pacer> {
    let dest = Destination {
        name: "d".into(),
        hosts: vec![],
        pace,
        ports: Default::default(),
        allow_private_upstreams: None,
        groups: Vec::new(),
        meters: Vec::new(),
        max_body: crate::destination::DEFAULT_MAX_BODY,
    };
    let metrics = Arc::new(Metrics::new(Registry::new()).unwrap());
    let p = Arc::new(Pacer::new(&[dest], classes, store, metrics, "test".into()));
    p.start().await.unwrap();
    p
}

const INTERACTIVE: Class = Class(0);
const BACKFILL: Class = Class(2);

/// Queues `requests` (class, label) 1 ms apart and returns the labels in the order granted.
async fn grant_order(p: &Arc<Pacer>, requests: &[(Class, &'static str)]) -> Vec<&'static str> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for (class, label) in requests {
        let (p, tx, class, label) = (p.clone(), tx.clone(), *class, *label);
        tokio::spawn(async move {
            let _a = p.admit(&d(&p), class, far()).await.unwrap();
            tx.send(label).unwrap();
        });
        tokio::time::sleep(ms(1)).await;
    }
    drop(tx);
    let mut order = Vec::new();
    while let Some(label) = rx.recv().await {
        order.push(label);
    }
    order
}

#[tokio::test(start_paused = true)]
async fn the_most_urgent_class_goes_first_and_each_class_in_arrival_order() {
    let p = pacer_with(pace(10.0), classes(0.0)).await;
    let order = grant_order(
        &p,
        &[
            (BACKFILL, "b1"),
            (BACKFILL, "b2"),
            (BACKFILL, "b3"),
            (Class(1), "s1"),
            (INTERACTIVE, "i1"),
            (BACKFILL, "b4"),
            (INTERACTIVE, "i2"),
        ],
    )
    .await;
    // b1 took the first slot at once, and b2 the next one, granted ahead (at 1 ms, for
    // 100 ms) before anything more urgent arrived: a granted slot is kept. From then on,
    // interactive before scheduled before backfill, each in arrival order.
    assert_eq!(order, ["b1", "b2", "i1", "i2", "s1", "b3", "b4"]);
}

#[tokio::test(start_paused = true)]
async fn a_share_is_honoured_and_lent_when_idle() {
    let p = pacer_with(pace(100.0), classes(0.2)).await;
    let mut requests = Vec::new();
    for _ in 0..40 {
        requests.push((INTERACTIVE, "i"));
        requests.push((BACKFILL, "b"));
    }
    let order = grant_order(&p, &requests).await;
    // While both wait (the first 50 slots or so), backfill gets its fifth; once interactive
    // is done, backfill gets every slot.
    let first_20 = &order[10..30];
    assert_eq!(
        first_20.iter().filter(|l| **l == "b").count(),
        4,
        "{order:?}"
    );
    assert!(order[60..].iter().all(|l| *l == "b"), "{order:?}");
}

#[tokio::test(start_paused = true)]
async fn a_class_max_wait_overrides_the_destination() {
    let p = pacer_with(pace(0.1), classes(0.0)).await;
    let _first = p.admit(&d(&p), BACKFILL, far()).await.unwrap();
    let (route, pace) = (d(&p), d(&p).pace());
    assert_eq!(route.max_wait(INTERACTIVE, &pace), Duration::from_secs(5));
    assert_eq!(route.max_wait(BACKFILL, &pace), Duration::from_secs(300));
    let started = Instant::now();
    let deadline = started + route.max_wait(INTERACTIVE, &pace);
    match p.admit(&d(&p), INTERACTIVE, deadline).await {
        Err(PaceError::Deadline {
            class, max_wait, ..
        }) => {
            assert_eq!(
                (class.as_str(), max_wait),
                ("interactive", Duration::from_secs(5))
            );
        }
        other => panic!("expected a deadline refusal, got {:?}", other.map(|_| ())),
    }
    assert!(Instant::now() - started <= Duration::from_secs(5));
}

#[tokio::test(start_paused = true)]
async fn status_shows_each_class_and_quota_window() {
    let p = pacer_with(
        Pace {
            quota: vec![crate::destination::Quota {
                limit: 30,
                per: Duration::from_secs(10),
            }],
            ..pace(10.0)
        },
        classes(0.0),
    )
    .await;
    let _first = p.admit(&d(&p), BACKFILL, far()).await.unwrap();
    let p2 = p.clone();
    let _waiting =
        tokio::spawn(async move { p2.admit(&d(&p2), INTERACTIVE, far()).await.map(|_| ()) });
    tokio::time::sleep(ms(20)).await;
    let status = p.status().await;
    let classes: Vec<(&str, usize, u64)> = status[0]
        .classes
        .iter()
        .map(|c| (c.class.as_str(), c.waiting, c.granted_last_minute))
        .collect();
    assert_eq!(
        classes,
        [
            ("interactive", 1, 0),
            ("scheduled", 0, 0),
            ("backfill", 0, 1)
        ]
    );
    // The interactive request's slot is reserved ahead: two of the window's 30 are taken.
    assert_eq!(status[0].quota[0].used, 2);
    let table = crate::status::status_table(&status);
    assert!(table.contains("2/30 per 10s"), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("d ") && l.contains("interactive") && l.contains("1 / 1")),
        "{table}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_that_gives_up_leaves_the_store_at_once() {
    let dest = Destination {
        name: "d".into(),
        hosts: vec![],
        pace: pace(1.0),
        ports: Default::default(),
        allow_private_upstreams: None,
        groups: Vec::new(),
        meters: Vec::new(),
        max_body: crate::destination::DEFAULT_MAX_BODY,
    };
    let store = MemoryStore::ephemeral();
    // Another instance has an older interactive request waiting, so this one yields.
    let other = store.instance("other");
    let urgent = [crate::budget::ClassQueue {
        class: INTERACTIVE,
        count: 1,
        oldest: Instant::now() - Duration::from_secs(10),
        next: None,
    }];
    other.wait_list("d", &urgent).await.unwrap();
    let metrics = Arc::new(Metrics::new(Registry::new()).unwrap());
    let p = Arc::new(Pacer::new(
        &[dest],
        classes(0.0),
        Arc::new(store),
        metrics,
        "here".into(),
    ));
    p.start().await.unwrap();
    let p2 = p.clone();
    let waiting = tokio::spawn(async move { p2.admit(&d(&p2), BACKFILL, far()).await.map(|_| ()) });
    tokio::time::sleep(ms(1)).await;
    let classes_waiting = |list: Vec<crate::budget::ClassWaiting>| {
        list.iter().map(|w| (w.0, w.1)).collect::<Vec<_>>()
    };
    assert_eq!(
        classes_waiting(crate::budget::contract::waiting_in(&other, "d").await),
        [(INTERACTIVE, 1), (BACKFILL, 1)]
    );
    waiting.abort();
    tokio::time::sleep(ms(1)).await;
    assert_eq!(
        classes_waiting(crate::budget::contract::waiting_in(&other, "d").await),
        [(INTERACTIVE, 1)],
        "the request that gave up still counts"
    );
}

/// The memory store, but its `nth` reservation (from 1) waits `stall` before it is made: a
/// database whose commit waits on its log flush, or a busy host. It counts the verdicts
/// recorded, and the reads that are not reservations (views, waiting, quota windows,
/// snapshots). Like a shared store, it keeps a record of what it knows ([`Known`]), which a
/// test fills as another instance's answers would.
struct Stalling {
    inner: MemoryStore,
    known: crate::budget::Known,
    nth: u64,
    stall: Duration,
    calls: std::sync::atomic::AtomicU64,
    records: std::sync::atomic::AtomicU64,
    reads: std::sync::atomic::AtomicU64,
}

impl Stalling {
    fn read(&self) {
        self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Default for Stalling {
    fn default() -> Self {
        Self {
            inner: MemoryStore::ephemeral(),
            known: Default::default(),
            nth: u64::MAX,
            stall: Duration::ZERO,
            calls: Default::default(),
            records: Default::default(),
            reads: Default::default(),
        }
    }
}

#[async_trait::async_trait]
impl Store for Stalling {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn known(&self) -> Option<&crate::budget::Known> {
        Some(&self.known)
    }

    async fn reserve(
        &self,
        destination: &str,
        rule: &crate::budget::Rule,
        ask: crate::budget::Ask<'_>,
    ) -> Result<crate::budget::Grant, ReserveError> {
        let call = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if call == self.nth {
            tokio::time::sleep(self.stall).await;
        }
        self.inner.reserve(destination, rule, ask).await
    }

    async fn wait_list(
        &self,
        destination: &str,
        queues: &[crate::budget::ClassQueue],
    ) -> Result<(), StoreError> {
        self.inner.wait_list(destination, queues).await
    }

    async fn record(
        &self,
        destination: &str,
        rule: &crate::budget::Rule,
        event: crate::budget::Event,
        vendor: Option<crate::budget::Observation>,
    ) -> Result<crate::budget::BudgetView, StoreError> {
        self.records
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.record(destination, rule, event, vendor).await
    }

    async fn unlock(&self, destination: &str) -> Result<Option<Lockout>, StoreError> {
        self.inner.unlock(destination).await
    }

    async fn continue_after(&self, marks: &[(String, Instant)]) -> Result<(), StoreError> {
        self.inner.continue_after(marks).await
    }

    async fn settle(
        &self,
        budget: &str,
        rule: &crate::budget::Rule,
        units: i64,
    ) -> Result<(), StoreError> {
        self.inner.settle(budget, rule, units).await
    }

    async fn give_back(
        &self,
        budget: &str,
        rule: &crate::budget::Rule,
        slot: &crate::budget::Reservation,
        sent: Option<u64>,
        reserved: u32,
        units: u32,
    ) -> Result<(), StoreError> {
        self.inner
            .give_back(budget, rule, slot, sent, reserved, units)
            .await
    }

    async fn view(&self, destination: &str) -> Result<crate::budget::BudgetView, StoreError> {
        self.read();
        self.inner.view(destination).await
    }

    async fn key_secret(&self) -> Result<Vec<u8>, StoreError> {
        self.inner.key_secret().await
    }

    async fn forget_keys(&self, parent: &str, idle: Duration) -> Result<u64, StoreError> {
        self.inner.forget_keys(parent, idle).await
    }

    async fn snapshot(
        &self,
        destinations: &[(&str, &crate::budget::Rule)],
    ) -> Result<Vec<crate::budget::Snapshot>, StoreError> {
        self.read();
        self.inner.snapshot(destinations).await
    }
}

/// Grants `slots` at 50/s (20 ms apart) while the `nth` reservation takes `stall`, and
/// checks that every slot was on the beat.
async fn the_beat_holds_through_a_stall(nth: u64, stall: Duration, slots: u32) {
    let store = Stalling {
        nth,
        stall,
        ..Default::default()
    };
    let p = pacer_on(pace(50.0), Classes::default(), Arc::new(store)).await;
    let times = grant_times(&p, slots as usize).await;
    let beat: Vec<Duration> = (0..slots).map(|n| ms(20) * n).collect();
    assert_eq!(times, beat);
}

#[tokio::test(start_paused = true)]
async fn a_store_that_stalls_for_longer_than_the_interval_costs_no_slot() {
    // One reservation in the middle of the run takes 30 ms. It was asked ahead, with a slot
    // still to hand out before it, so it is granted before it is due.
    the_beat_holds_through_a_stall(5, ms(30), 10).await;
}

#[tokio::test(start_paused = true)]
async fn a_store_stall_longer_than_two_intervals_but_within_asking_ahead_costs_no_slot() {
    // Asking ahead (50 ms) spans more than two intervals. One reservation takes 45 ms: more
    // than the interval and the slot still to hand out before it, less than the lead asking
    // ahead keeps.
    the_beat_holds_through_a_stall(6, ms(45), 12).await;
}

/// Status shows a budget as the store's record of what this instance knows has it: a lockout
/// another instance took, read back by a heartbeat, shows before a reservation here meets it,
/// and a pause read 2 s ago shows with 2 s less to run.
#[tokio::test(start_paused = true)]
async fn status_reads_what_this_instance_knows_of_the_budget() {
    let store = Arc::new(Stalling::default());
    let p = pacer_on(pace(10.0), Classes::default(), store.clone()).await;
    let lock = Lockout::new(403, "GET https://d.example/x".into(), "elsewhere".into());
    store.known.learned(
        "d",
        &crate::budget::BudgetView {
            lock: Some(lock),
            paused_for: Duration::from_secs(10),
            ..Default::default()
        },
        Instant::now(),
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let status = p.status().await;
    let d = status.iter().find(|s| s.destination == "d").unwrap();
    assert_eq!(
        d.lock.as_ref().map(|l| l.instance.as_str()),
        Some("elsewhere"),
        "the lockout the store's record holds"
    );
    assert_eq!(d.paused_for_seconds, 8.0, "the pause, counted from now");
}

#[tokio::test(start_paused = true)]
async fn a_clean_response_to_a_budget_at_rest_writes_nothing() {
    let store = Arc::new(Stalling::default());
    let p = pacer_on(pace(10.0), Classes::default(), store.clone()).await;
    let records = || store.records.load(std::sync::atomic::Ordering::SeqCst);
    let none = HeaderMap::new();
    let a = p.admit(&d(&p), ONE, far()).await.unwrap();
    assert_eq!(p.answer(&a, 200, &none, "GET /").await, Verdict::Clean);
    assert_eq!(records(), 0, "a clean response at rest was written");
    // A throttle widens the pace: it is written, and so is every clean response after it,
    // which counts towards the decay.
    let a = p.admit(&d(&p), ONE, far()).await.unwrap();
    let throttled = p.answer(&a, 429, &none, "GET /").await;
    assert!(
        matches!(throttled, Verdict::Throttled { .. }),
        "{throttled:?}"
    );
    assert_eq!(records(), 1);
    let a = p.admit(&d(&p), ONE, far()).await.unwrap();
    assert_eq!(p.answer(&a, 200, &none, "GET /").await, Verdict::Clean);
    assert_eq!(
        records(),
        2,
        "a clean response under a backoff was not written"
    );
    assert_eq!(p.status().await[0].clean_streak, 1);
}

/// Ten destinations. A scrape of the gauges reads no store however often it comes; status
/// reads it once a second at most, one snapshot for all ten; what another instance did shows
/// in the gauges once a snapshot saw it.
#[tokio::test(start_paused = true)]
async fn gauges_read_no_store_and_status_one_snapshot_a_second() {
    use std::sync::atomic::Ordering::SeqCst;
    let store = Arc::new(Stalling::default());
    let destinations: Vec<Destination> = (0..10)
        .map(|i| Destination {
            name: format!("d{i}"),
            hosts: vec![],
            pace: pace(10.0),
            ports: Default::default(),
            allow_private_upstreams: None,
            groups: Vec::new(),
            meters: Vec::new(),
            max_body: crate::destination::DEFAULT_MAX_BODY,
        })
        .collect();
    let registry = Registry::new();
    let metrics = Arc::new(Metrics::new(registry.clone()).unwrap());
    let p = Pacer::new(
        &destinations,
        Classes::default(),
        store.clone(),
        metrics.clone(),
        "test".into(),
    );
    p.start().await.unwrap();
    let started = store.reads.load(SeqCst);
    for _ in 0..30 {
        p.gauges();
        tokio::time::sleep(ms(200)).await;
    }
    assert_eq!(
        store.reads.load(SeqCst) - started,
        0,
        "30 scrapes read the store"
    );

    let started = store.reads.load(SeqCst);
    for _ in 0..30 {
        p.status().await;
        tokio::time::sleep(ms(100)).await;
    }
    // 3 s of status read 30 times: a snapshot at 0, 1, 2 s (and perhaps 3 s).
    let reads = store.reads.load(SeqCst) - started;
    assert!(
        (3..=4).contains(&reads),
        "30 status reads over 3 s took {reads} store reads"
    );

    // Another instance locks d3 out: the gauges show it once status has taken a snapshot.
    let lock = Lockout::new(403, "GET https://d3/".into(), "elsewhere".into());
    store
        .inner
        .instance("elsewhere")
        .record("d3", &contract_rule(), Event::Lockout(lock), None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    p.status().await;
    p.gauges();
    let locked = metrics.render();
    assert!(
        locked.contains("pacegate_locked{destination=\"d3\",group=\"\"} 1"),
        "d3's lockout is not in the gauges: {locked}"
    );
}

fn contract_rule() -> Rule {
    crate::budget::contract::rule(10.0)
}

#[tokio::test(start_paused = true)]
async fn a_reload_that_adds_and_removes_a_group_keeps_every_other_budget() {
    let store = Arc::new(MemoryStore::ephemeral());
    let p = pacer_on(pace(100.0), Classes::default(), store).await;
    let a = p.admit(&d(&p), ONE, far()).await.unwrap();
    p.answer(&a, 429, &HeaderMap::new(), "GET /").await;
    drop(a);
    let with_group = |groups: Vec<Group>| Destination {
        name: "d".into(),
        hosts: vec![],
        pace: pace(100.0),
        ports: Default::default(),
        allow_private_upstreams: None,
        groups,
        meters: Vec::new(),
        max_body: crate::destination::DEFAULT_MAX_BODY,
    };
    let search = Group {
        name: "search".into(),
        paths: vec!["/search/".into()],
        methods: Vec::new(),
        resource: None,
        pace: pace(2.0),
        meters: Vec::new(),
    };
    let changes = p.reconfigure(&[with_group(vec![search])]).await.unwrap();
    assert_eq!(changes.added, vec!["d/search"]);
    assert!(changes.changed.is_empty() && changes.removed.is_empty());
    // The destination's own budget kept its backoff; the group's is new.
    let route = d(&p);
    assert_eq!(route.pick("GET", "/search/x").name().as_ref(), "d/search");
    assert_eq!(route.pick("GET", "/core").name().as_ref(), "d");
    let status = p.status().await;
    let of = |name: &str| {
        status
            .iter()
            .find(|s| s.destination == name)
            .unwrap()
            .clone()
    };
    assert_eq!(of("d").backoff, 2.0);
    assert_eq!(of("d/search").backoff, 1.0);
    assert_eq!(of("d/search").rate, 2.0);
    let changes = p.reconfigure(&[with_group(Vec::new())]).await.unwrap();
    assert_eq!(changes.removed, vec!["d/search"]);
    assert_eq!(d(&p).pick("GET", "/search/x").name().as_ref(), "d");
    assert_eq!(p.status().await.len(), 1);
    assert_eq!(p.status().await[0].backoff, 2.0);
}
