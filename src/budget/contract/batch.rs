//! The contract's checks of batched grants (see [`crate::budget::Ask::most`]): a batch is the
//! slots one-by-one reservations would take, within the horizon, and never past a quota
//! window, a limit, a pause, a lockout, a more urgent class or an owed share.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{apart, read, rule, waiting, Reading, BACKFILL, INTERACTIVE};
use crate::budget::{
    Ask, ClassQueue, Event, Grant, Lockout, Pause, ReserveError, Rule, Store, BATCH_HORIZON,
};
use crate::destination::Quota;

/// Asks for up to `most` slots of destination `d` for `queues`, and times the answer.
async fn batch_of(
    store: &impl Store,
    d: &str,
    r: &Rule,
    queues: &[ClassQueue],
    most: u32,
    not_after: Option<Instant>,
) -> (Result<Grant, ReserveError>, Instant, Instant) {
    let sent = Instant::now();
    let ask = Ask {
        queues,
        not_after,
        most,
        cost: 1,
    };
    let answer = store.reserve(d, r, ask).await;
    (answer, sent, Instant::now())
}

/// [`batch_of`] destination `d`.
async fn batch(
    store: &impl Store,
    r: &Rule,
    queues: &[ClassQueue],
    most: u32,
    not_after: Option<Instant>,
) -> (Result<Grant, ReserveError>, Instant, Instant) {
    batch_of(store, "d", r, queues, most, not_after).await
}

/// The slots of a grant that must have come, read as converted together.
fn slots(answer: Result<Grant, ReserveError>) -> (Grant, Vec<Instant>) {
    let grant = answer.unwrap();
    let all = std::iter::once(grant.slot.at)
        .chain(grant.more.iter().copied())
        .collect();
    (grant, all)
}

pub(super) async fn a_batch_keeps_the_beat_within_the_horizon(store: &impl Store, tol: Duration) {
    let r = rule(1000.0);
    let hundred = [waiting(BACKFILL, 100, 10)];
    let (answer, sent, arrived) = batch(store, &r, &hundred, 100, None).await;
    let (grant, all) = slots(answer);
    assert_eq!(grant.class, BACKFILL);
    // One slot a millisecond from the first to the horizon: 51, not 100.
    assert_eq!(all.len(), 51, "{all:?}");
    for pair in all.windows(2) {
        assert_eq!(pair[1] - pair[0], r.interval, "{all:?}");
    }
    assert_eq!(*all.last().unwrap() - all[0], BATCH_HORIZON);
    let first = Reading {
        at: all[0],
        sent,
        arrived,
    };
    // The requests served left the list, and the next slot follows the batch on the beat.
    let left = super::waiting_in(store, "d").await;
    assert_eq!((left[0].0, left[0].1), (BACKFILL, 49), "{left:?}");
    let (next, _) = read(store, "d", &r).await;
    apart(first, next, r.interval * 51, tol, "the slot after a batch");
    // No more than asked for, nor than wait.
    let (answer, ..) = batch(store, &r, &[waiting(BACKFILL, 3, 10)], 100, None).await;
    assert_eq!(slots(answer).1.len(), 3);
    let (answer, ..) = batch(store, &r, &hundred, 4, None).await;
    assert_eq!(slots(answer).1.len(), 4);
}

pub(super) async fn a_batch_keeps_quota_windows_limits_and_pauses(
    store: &impl Store,
    tol: Duration,
) {
    // 5 per 100 ms: the sixth slot is 100 ms and the lateness allowance after the first,
    // past the horizon.
    let r = Rule {
        quota: vec![Quota {
            limit: 5,
            per: Duration::from_millis(100),
        }],
        ..rule(1000.0)
    };
    let hundred = [waiting(BACKFILL, 100, 10)];
    let (answer, sent, arrived) = batch(store, &r, &hundred, 100, None).await;
    let (_, all) = slots(answer);
    assert_eq!(all.len(), 5, "{all:?}");
    let first = Reading {
        at: all[0],
        sent,
        arrived,
    };
    let (sixth, _) = read(store, "d", &r).await;
    apart(
        first,
        sixth,
        Duration::from_millis(100) + r.quota_margin(),
        tol,
        "the slot after a batch that filled the window",
    );
    // A limit (the waiters' deadlines) bounds every slot.
    let r = rule(1000.0);
    let limit = Instant::now() + Duration::from_millis(10);
    let (answer, sent, arrived) = batch_of(store, "e", &r, &hundred, 100, Some(limit)).await;
    let (_, all) = slots(answer);
    assert!(all.len() >= 2, "{all:?}");
    // Read here, a slot may be late by the round trip it was read in.
    assert!(
        *all.last().unwrap() <= limit + (arrived - sent) + tol,
        "a slot past the limit: {all:?}, limit {limit:?}, round trip {:?}",
        arrived - sent
    );
    // A pause: the batch starts after it.
    let pause = Duration::from_millis(200);
    let view = store.view("f").await.unwrap();
    let sent = Instant::now();
    let event = Event::Throttled {
        generation: view.generation,
        retry_after: Some(Pause::For(pause)),
        reset: None,
        spread: 0.0,
    };
    store.record("f", &r, event, None).await.unwrap();
    let (answer, ..) = batch_of(store, "f", &r, &hundred, 100, None).await;
    let (grant, all) = slots(answer);
    assert!(all[0] + tol >= sent + pause, "a batch inside a pause");
    assert_eq!(grant.slot.generation, view.generation + 1);
    // A lockout grants nothing.
    let lock = Lockout::new(403, "GET /".into(), "contract".into());
    store
        .record("f", &r, Event::Lockout(lock), None)
        .await
        .unwrap();
    let (answer, ..) = batch_of(store, "f", &r, &hundred, 100, None).await;
    assert!(matches!(answer, Err(ReserveError::Locked(_))), "{answer:?}");
}

pub(super) async fn a_batch_stops_for_a_more_urgent_class_or_an_owed_share<S: Store>(
    (a, b): (S, S),
) {
    // b's backfill has a 20% share: it is owed the fifth slot, so a's batch of interactive
    // requests ends at four, and b's request goes next.
    let r = Rule {
        shares: Arc::from(vec![0.0, 0.0, 0.2]),
        ..rule(1000.0)
    };
    let backfill = [waiting(BACKFILL, 1, 1)];
    b.wait_list("d", &backfill).await.unwrap();
    let (answer, ..) = batch(&a, &r, &[waiting(INTERACTIVE, 100, 10)], 100, None).await;
    let (grant, all) = slots(answer);
    assert_eq!((grant.class, all.len()), (INTERACTIVE, 4));
    let (answer, ..) = batch(&a, &r, &[waiting(INTERACTIVE, 96, 5)], 100, None).await;
    assert!(matches!(answer, Err(ReserveError::Yield(_))), "{answer:?}");
    let (answer, ..) = batch(&b, &r, &backfill, 100, None).await;
    assert_eq!(slots(answer).0.class, BACKFILL);
    // A more urgent request anywhere: no batch of a less urgent class starts.
    b.wait_list("d", &[waiting(INTERACTIVE, 1, 1)])
        .await
        .unwrap();
    let (answer, ..) = batch(&a, &r, &[waiting(BACKFILL, 100, 5_000)], 100, None).await;
    assert!(matches!(answer, Err(ReserveError::Yield(_))), "{answer:?}");
}
