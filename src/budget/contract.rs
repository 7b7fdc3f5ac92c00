//! The behaviour every store must have. Each store's tests call [`run_all`] with a factory of
//! fresh stores. Time is read through `tokio::time`, so the memory store runs this on paused
//! time and a database-backed store on real time; comparisons allow the tolerance the store's
//! tests give (zero for memory, the clock conversion's jitter for a database).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{Event, Lockout, ReserveError, Rule, Store};

/// A rule at `rate` per second: burst 1, factor 2, max 8, decay after 3, Retry-After cap 60 s.
pub(crate) fn rule(rate: f64) -> Rule {
    Rule {
        interval: Duration::from_secs_f64(1.0 / rate),
        burst: 1,
        backoff_factor: 2.0,
        backoff_max: 8.0,
        decay_after: 3,
        retry_after_max: Duration::from_secs(60),
    }
}

fn close(a: Instant, b: Instant, tol: Duration, what: &str) {
    let diff = if a > b { a - b } else { b - a };
    assert!(diff <= tol, "{what}: {a:?} vs {b:?} differ by {diff:?}");
}

/// Runs every contract check, each on a fresh store, comparing instants within `tol`.
pub(crate) async fn run_all<S, F, Fut>(fresh: F, tol: Duration)
where
    S: Store,
    F: Fn() -> Fut,
    Fut: Future<Output = S>,
{
    slots_keep_the_beat(&fresh().await, tol).await;
    a_new_destination_starts_now(&fresh().await, tol).await;
    burst_then_spacing(&fresh().await, tol).await;
    too_late_takes_nothing(&fresh().await, tol).await;
    throttles_widen_once_per_generation(&fresh().await, tol).await;
    retry_after_pauses_the_destination(&fresh().await, tol).await;
    clean_streak_decays_backoff(&fresh().await).await;
    lockout_until_unlocked(&fresh().await).await;
    destinations_are_independent(&fresh().await, tol).await;
    concurrent_reservations_are_strictly_increasing(Arc::new(fresh().await), tol).await;
}

async fn slots_keep_the_beat(store: &impl Store, tol: Duration) {
    let r = rule(10.0);
    let first = store.reserve("d", &r, None).await.unwrap();
    assert_eq!(first.generation, 0);
    for n in 1..10u32 {
        // Reserving late must not shift the beat.
        tokio::time::sleep(Duration::from_millis(7)).await;
        let slot = store.reserve("d", &r, None).await.unwrap();
        close(
            slot.at,
            first.at + r.interval * n,
            tol,
            "n-th slot is start + n / rate",
        );
    }
}

async fn a_new_destination_starts_now(store: &impl Store, tol: Duration) {
    let now = Instant::now();
    let slot = store.reserve("fresh", &rule(1.0), None).await.unwrap();
    close(slot.at, now, tol, "first slot of a new destination");
    let view = store.view("never-used").await.unwrap();
    assert_eq!(
        (view.backoff, view.generation, view.clean_streak),
        (1.0, 0, 0)
    );
    assert!(view.lock.is_none());
}

async fn burst_then_spacing(store: &impl Store, tol: Duration) {
    let r = Rule {
        burst: 3,
        ..rule(10.0)
    };
    let now = Instant::now();
    for _ in 0..3 {
        close(
            store.reserve("d", &r, None).await.unwrap().at,
            now,
            tol,
            "burst slots are immediate",
        );
    }
    close(
        store.reserve("d", &r, None).await.unwrap().at,
        now + r.interval,
        tol,
        "then spaced",
    );
}

async fn too_late_takes_nothing(store: &impl Store, tol: Duration) {
    let r = rule(1.0);
    let first = store.reserve("d", &r, None).await.unwrap();
    let limit = Instant::now() + Duration::from_millis(100);
    match store.reserve("d", &r, Some(limit)).await {
        Err(ReserveError::TooLate { slot }) => close(
            slot,
            first.at + r.interval,
            tol,
            "the slot it would have been",
        ),
        other => panic!("expected TooLate, got {other:?}"),
    }
    let next = store.reserve("d", &r, None).await.unwrap();
    close(
        next.at,
        first.at + r.interval,
        tol,
        "the refused attempt took no slot",
    );
}

async fn throttles_widen_once_per_generation(store: &impl Store, tol: Duration) {
    let r = rule(10.0);
    let reserved = store.reserve("d", &r, None).await.unwrap();
    for _ in 0..10 {
        let event = Event::Throttled {
            generation: reserved.generation,
            retry_after: None,
        };
        store.record("d", &r, event).await.unwrap();
    }
    let view = store.view("d").await.unwrap();
    assert_eq!(
        (view.backoff, view.generation),
        (2.0, 1),
        "ten throttles of one generation widen once"
    );
    let a = store.reserve("d", &r, None).await.unwrap();
    assert_eq!(a.generation, 1);
    let b = store.reserve("d", &r, None).await.unwrap();
    close(b.at, a.at + r.interval * 2, tol, "the interval doubled");
}

async fn retry_after_pauses_the_destination(store: &impl Store, tol: Duration) {
    let r = rule(100.0);
    store.reserve("d", &r, None).await.unwrap();
    let now = Instant::now();
    let event = Event::Throttled {
        generation: 0,
        retry_after: Some(Duration::from_secs(5)),
    };
    let view = store.record("d", &r, event).await.unwrap();
    assert!(view.paused_for > Duration::from_millis(4900), "{view:?}");
    let slot = store.reserve("d", &r, None).await.unwrap();
    assert!(
        slot.at >= now + Duration::from_secs(5) - tol,
        "no slot inside the pause"
    );
    // A shorter Retry-After never shortens a pause, and a huge one is capped.
    let short = Event::Throttled {
        generation: 99,
        retry_after: Some(Duration::from_secs(1)),
    };
    assert!(store.record("d", &r, short).await.unwrap().paused_for > Duration::from_millis(4800));
    let huge = Event::Throttled {
        generation: 99,
        retry_after: Some(Duration::from_secs(1_000_000)),
    };
    let view = store.record("d", &r, huge).await.unwrap();
    assert!(view.paused_for <= r.retry_after_max, "{view:?}");
}

async fn clean_streak_decays_backoff(store: &impl Store) {
    let r = rule(10.0);
    for generation in 0..2 {
        let event = Event::Throttled {
            generation,
            retry_after: None,
        };
        store.record("d", &r, event).await.unwrap();
    }
    assert_eq!(store.view("d").await.unwrap().backoff, 4.0);
    for i in 1..=3 {
        let view = store.record("d", &r, Event::Clean).await.unwrap();
        assert_eq!(
            view.backoff,
            if i < 3 { 4.0 } else { 2.0 },
            "after {i} clean"
        );
    }
    for _ in 0..20 {
        store.record("d", &r, Event::Clean).await.unwrap();
    }
    assert_eq!(store.view("d").await.unwrap().backoff, 1.0, "never below 1");
}

async fn lockout_until_unlocked(store: &impl Store) {
    let r = rule(10.0);
    let lock = Lockout::new(403, "GET https://d/x".into(), "instance-a".into());
    store
        .record("d", &r, Event::Lockout(lock.clone()))
        .await
        .unwrap();
    match store.reserve("d", &r, None).await {
        Err(ReserveError::Locked(l)) => assert_eq!(
            (l.status, l.request, l.instance),
            (403, lock.request.clone(), lock.instance.clone())
        ),
        other => panic!("expected Locked, got {other:?}"),
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        store.reserve("d", &r, None).await.is_err(),
        "time does not clear a lockout"
    );
    let second = Lockout::new(403, "GET https://d/y".into(), "instance-b".into());
    store.record("d", &r, Event::Lockout(second)).await.unwrap();
    assert_eq!(
        store.view("d").await.unwrap().lock.unwrap().request,
        lock.request,
        "the first lockout is kept"
    );
    assert_eq!(
        store.unlock("d").await.unwrap().map(|l| l.request),
        Some(lock.request)
    );
    assert!(store.reserve("d", &r, None).await.is_ok());
    assert_eq!(store.unlock("d").await.unwrap(), None);
}

async fn destinations_are_independent(store: &impl Store, tol: Duration) {
    let r = rule(1.0);
    let now = Instant::now();
    store.reserve("a", &r, None).await.unwrap();
    close(
        store.reserve("b", &r, None).await.unwrap().at,
        now,
        tol,
        "b is not behind a",
    );
    let event = Event::Throttled {
        generation: 0,
        retry_after: Some(Duration::from_secs(30)),
    };
    store.record("a", &r, event).await.unwrap();
    assert_eq!(store.view("b").await.unwrap().backoff, 1.0);
    assert_eq!(store.view("b").await.unwrap().paused_for, Duration::ZERO);
}

async fn concurrent_reservations_are_strictly_increasing<S: Store>(store: Arc<S>, tol: Duration) {
    let r = Arc::new(rule(10.0));
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let (store, r) = (store.clone(), r.clone());
            tokio::spawn(async move { store.reserve("d", &r, None).await.unwrap().at })
        })
        .collect();
    let mut slots = Vec::new();
    for t in tasks {
        slots.push(t.await.unwrap());
    }
    slots.sort();
    // One strictly increasing sequence on the beat: the whole span is the schedule's. Each
    // local reading carries its own conversion error (up to `tol`), so pairs get twice that.
    let span = *slots.last().unwrap() - slots[0];
    let expected = r.interval * (slots.len() as u32 - 1);
    assert!(
        span + tol >= expected,
        "64 slots span {span:?}, the schedule {expected:?}"
    );
    for pair in slots.windows(2) {
        assert!(
            pair[1] - pair[0] + tol * 2 >= r.interval,
            "slots {:?} and {:?} too close",
            pair[0],
            pair[1]
        );
    }
}
