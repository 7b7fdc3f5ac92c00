//! The behaviour every store must have. Each store's tests call [`run_all`] with a factory of
//! fresh stores. Time is read through `tokio::time`, so the memory store runs this on paused
//! time and a database-backed store on real time.
//!
//! A store may keep its slots on its own clock and convert one to a local instant when its
//! answer arrives. Such a reading is never early, and it is late by at most the round trip it
//! was read in. A slot that is already due reads as the answer's arrival. Each check allows a
//! reading exactly its own round trip, plus the small tolerance the store's tests give (zero
//! for memory). So the checks hold however loaded the machine is, without wide margins.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{
    Ask, BudgetView, ClassQueue, ClassWaiting, Event, Lockout, Pause, Reservation, ReserveError,
    Rule, Snapshot, Store,
};
use crate::class::Class;
use crate::destination::Quota;

mod batch;
mod keys;
mod shared;
mod vendor;
mod weighted;

pub(crate) use shared::run_shared;

/// A rule at `rate` per second: burst 1, factor 2, max 8, decay after 3, Retry-After cap 60 s.
pub(crate) fn rule(rate: f64) -> Rule {
    Rule {
        interval: Duration::from_secs_f64(1.0 / rate),
        cost: 1,
        metered: false,
        burst: 1,
        backoff_factor: 2.0,
        backoff_max: 8.0,
        decay_after: 3,
        retry_after_max: Duration::from_secs(60),
        shares: Arc::from(vec![0.0; 3]),
        quota: Vec::new(),
        window: None,
        largest: 0,
        reserve: 0,
        vendor_pace: crate::destination::VendorPace::Burst,
        block: None,
    }
}

pub(crate) const INTERACTIVE: Class = Class(0);
pub(crate) const BACKFILL: Class = Class(2);

/// `count` requests of `class`, the oldest waiting for `oldest_ms` and the next for half that.
pub(crate) fn waiting(class: Class, count: u32, oldest_ms: u64) -> ClassQueue {
    let now = Instant::now();
    ClassQueue {
        class,
        count,
        oldest: now - Duration::from_millis(oldest_ms),
        next: (count > 1).then(|| now - Duration::from_millis(oldest_ms / 2)),
    }
}

/// Reserves a slot for one request of the default class waiting alone.
/// What the store holds of `destination` ([`Store::snapshot`] of one), `rule` giving its quota
/// windows.
pub(crate) async fn snapshot(store: &impl Store, destination: &str, rule: &Rule) -> Snapshot {
    store
        .snapshot(&[(destination, rule)])
        .await
        .unwrap()
        .remove(0)
}

/// Every live instance's waiting requests of `destination`, by class: `(class, count, oldest
/// wait)`.
pub(crate) async fn waiting_in(store: &impl Store, destination: &str) -> Vec<ClassWaiting> {
    snapshot(store, destination, &rule(1.0)).await.waiting
}

pub(crate) async fn take(
    store: &impl Store,
    destination: &str,
    rule: &Rule,
    not_after: Option<Instant>,
) -> Result<Reservation, ReserveError> {
    let queues = [waiting(Class(1), 1, 0)];
    let ask = Ask {
        queues: &queues,
        not_after,
        most: 1,
        cost: 1,
    };
    store
        .reserve(destination, rule, ask)
        .await
        .map(|grant| grant.slot)
}

/// Reserves for the given wait list; returns the class granted.
pub(crate) async fn ask(
    store: &impl Store,
    rule: &Rule,
    queues: &[ClassQueue],
) -> Result<Class, ReserveError> {
    let ask = Ask {
        queues,
        not_after: None,
        most: 1,
        cost: 1,
    };
    store.reserve("d", rule, ask).await.map(|g| g.class)
}

/// A slot as read here, and the round trip it was read in.
#[derive(Debug, Clone, Copy)]
struct Reading {
    at: Instant,
    sent: Instant,
    arrived: Instant,
}

impl Reading {
    /// How late the reading may be.
    fn trip(&self) -> Duration {
        self.arrived - self.sent
    }
}

/// Reserves as [`take`] does, and times it.
async fn timed(
    store: &impl Store,
    destination: &str,
    rule: &Rule,
    not_after: Option<Instant>,
) -> (Result<Reservation, ReserveError>, Instant, Instant) {
    let sent = Instant::now();
    let answer = take(store, destination, rule, not_after).await;
    (answer, sent, Instant::now())
}

/// Reserves a slot that must be granted, and reads it.
async fn read(store: &impl Store, destination: &str, rule: &Rule) -> (Reading, Reservation) {
    let (answer, sent, arrived) = timed(store, destination, rule, None).await;
    let slot = answer.unwrap();
    let reading = Reading {
        at: slot.at,
        sent,
        arrived,
    };
    (reading, slot)
}

/// `r` is a slot that was due when granted: it fell inside its own round trip.
fn due(r: Reading, tol: Duration, what: &str) {
    assert!(
        r.at + tol >= r.sent && r.at <= r.arrived + tol,
        "{what}: read {:?}, asked at {:?}, answered at {:?}",
        r.at,
        r.sent,
        r.arrived
    );
}

/// `b` lies `gap` after `a` on the store's clock: read here, `b - a` is `gap`, less as much
/// as `a` may be late, plus as much as `b` may be late. A store grants no slot in the past,
/// so when `b` was asked for only after `a + gap` (a round trip longer than the gap, on a
/// loaded machine), it is due at once: inside its own round trip.
fn apart(a: Reading, b: Reading, gap: Duration, tol: Duration, what: &str) {
    let expected = (a.at + gap).max(b.sent);
    assert!(
        b.at + a.trip() + tol >= a.at + gap && b.at <= expected + b.trip() + tol,
        "{what}: {:?} after {:?}, the schedule {gap:?} (round trips {:?} and {:?})",
        b.at.saturating_duration_since(a.at),
        a.at,
        a.trip(),
        b.trip()
    );
}

/// A beat followed through successive readings, each `n` slots after the first: it lies as
/// many intervals after the reading it is checked against (see [`apart`]). A reading asked
/// for when its place in the schedule may already have passed (a round trip on a loaded
/// machine longer than the interval) may have restarted the beat at "now"; the beat goes on
/// from it. Asked in time, every reading is checked against the same one, so lateness cannot
/// add up unseen.
struct Beat {
    from: Reading,
    /// The slot number of `from`.
    at_slot: u32,
}

impl Beat {
    fn new(first: Reading) -> Self {
        Self {
            from: first,
            at_slot: 0,
        }
    }

    /// Checks the reading of slot `n`, `interval` apart on the beat.
    fn next(&mut self, n: u32, b: Reading, interval: Duration, tol: Duration, what: &str) {
        let gap = interval * (n - self.at_slot);
        apart(self.from, b, gap, tol, what);
        if b.sent + self.from.trip() > self.from.at + gap {
            *self = Self {
                from: b,
                at_slot: n,
            };
        }
    }
}

/// Runs every contract check, each on a fresh store, allowing each reading its round trip and
/// `tol`.
pub(crate) async fn run_all<S, F, Fut>(fresh: F, tol: Duration)
where
    S: Store,
    F: Fn() -> Fut,
    Fut: Future<Output = S>,
{
    slots_keep_the_beat(&fresh().await, tol).await;
    a_new_destination_starts_now(&fresh().await, tol).await;
    slots_handed_out_elsewhere_come_first(&fresh().await, tol).await;
    burst_then_spacing(&fresh().await, tol).await;
    too_late_takes_nothing(&fresh().await, tol).await;
    throttles_widen_once_per_generation(&fresh().await, tol).await;
    retry_after_pauses_the_destination(&fresh().await, tol).await;
    clean_streak_decays_backoff(&fresh().await).await;
    lockout_until_unlocked(&fresh().await).await;
    destinations_are_independent(&fresh().await, tol).await;
    concurrent_reservations_are_strictly_increasing(Arc::new(fresh().await), tol).await;
    shares_are_honoured_and_lent(&fresh().await).await;
    quota_windows_hold(&fresh().await, tol).await;
    vendor::a_vendor_view_spreads_what_is_left_until_the_reset(&fresh().await, tol).await;
    vendor::requests_unanswered_when_the_vendor_said_count_against_its_view(&fresh().await).await;
    vendor::a_vendor_view_with_some_left_is_spent_at_the_rate_then_waits_for_the_reset(
        &fresh().await,
        tol,
    )
    .await;
    vendor::views_race_by_window_and_the_lower_remaining_wins(&fresh().await).await;
    vendor::at_the_reserve_the_destination_pauses_until_the_reset(&fresh().await).await;
    vendor::blocks_escalate_and_one_success_ends_them(&fresh().await).await;
    vendor::a_date_is_read_on_the_store_clock(&fresh().await).await;
    batch::a_batch_keeps_the_beat_within_the_horizon(&fresh().await, tol).await;
    batch::a_batch_keeps_quota_windows_limits_and_pauses(&fresh().await, tol).await;
    a_snapshot_says_what_each_call_says(&fresh().await).await;
    keys::a_parent_lockout_halts_every_key(&fresh().await).await;
    keys::idle_keys_are_forgotten_and_no_others(&fresh().await).await;
    weighted::a_slot_is_as_long_as_its_cost(&fresh().await, tol).await;
    weighted::a_settlement_moves_the_next_slot(&fresh().await, tol).await;
    weighted::a_refund_gives_back_no_time_already_past(&fresh().await, tol).await;
    weighted::a_refund_does_not_reach_before_a_slot_granted_since(&fresh().await, tol).await;
    weighted::a_quota_window_counts_units_and_charges(&fresh().await, tol).await;
    weighted::a_slot_given_back_leaves_the_quota_window(&fresh().await, tol).await;
    weighted::a_meter_s_own_window_holds_its_limit_and_one_request(&fresh().await, tol).await;
    weighted::a_refund_leaves_a_meter_s_own_window(&fresh().await, tol).await;
    weighted::a_refund_past_a_slot_granted_since_is_carried_where_sends_are_counted(
        &fresh().await,
        tol,
    )
    .await;
    weighted::refunds_after_the_latest_slot_are_carried_at_most_a_slot_s_length(
        &fresh().await,
        tol,
    )
    .await;
    weighted::a_window_s_hold_leaves_the_beat_where_it_stood(&fresh().await, tol).await;
    weighted::a_refund_leaves_the_send_it_names_among_sends_of_one_instant(&fresh().await, tol)
        .await;
}

/// One snapshot of several destinations (one with quota windows, waiting requests and a
/// pause, one locked out, one never used) says what `view` says of each, but for the time
/// that passes between the calls, and what was told and taken: the wait list by class, each
/// window's slots.
async fn a_snapshot_says_what_each_call_says(store: &impl Store) {
    let windows = Rule {
        quota: vec![
            Quota {
                limit: 5,
                per: Duration::from_secs(1),
            },
            Quota {
                limit: 2,
                per: Duration::from_secs(60),
            },
        ],
        ..rule(1000.0)
    };
    let plain = rule(10.0);
    for _ in 0..2 {
        take(store, "a", &windows, None).await.unwrap();
    }
    let generation = take(store, "a", &windows, None).await.unwrap().generation;
    let throttle = Event::Throttled {
        generation,
        retry_after: Some(Pause::For(Duration::from_secs(30))),
        reset: None,
        spread: 0.0,
    };
    store.record("a", &windows, throttle, None).await.unwrap();
    let lock = Lockout::new(403, "GET http://b/".into(), "test".into());
    store
        .record("b", &plain, Event::Lockout(lock), None)
        .await
        .unwrap();
    let queues = [waiting(INTERACTIVE, 3, 40), waiting(BACKFILL, 1, 10)];
    store.wait_list("a", &queues).await.unwrap();

    let asked = [("a", &windows), ("b", &plain), ("never", &plain)];
    let started = Instant::now();
    let snapshots = store.snapshot(&asked).await.unwrap();
    let mut views = Vec::new();
    for (destination, _) in asked {
        views.push(store.view(destination).await.unwrap());
    }
    let passed = started.elapsed();
    assert_eq!(
        snapshots.len(),
        asked.len(),
        "one snapshot per destination asked"
    );
    for ((destination, _), (s, view)) in asked.iter().zip(snapshots.iter().zip(views)) {
        let close = |a: Duration, b: Duration| a.abs_diff(b) <= passed;
        assert!(
            close(s.view.paused_for, view.paused_for),
            "{destination}: the snapshot's pause {:?}, the view's {:?}",
            s.view.paused_for,
            view.paused_for
        );
        let timeless = |v: &BudgetView| BudgetView {
            paused_for: Duration::ZERO,
            ..v.clone()
        };
        assert_eq!(
            timeless(&s.view),
            timeless(&view),
            "{destination}: the budget"
        );
    }
    let [a, b, never] = &snapshots[..] else {
        unreachable!()
    };
    assert!(
        a.view.paused_for > Duration::from_secs(29),
        "a is paused: {a:?}"
    );
    assert_eq!(
        a.quota_used,
        [3, 2],
        "a's windows: the slots taken, at most each limit"
    );
    // The wait list as told, by class, its oldest wait as old as it was then, and older.
    let classes: Vec<(Class, u32)> = a.waiting.iter().map(|w| (w.0, w.1)).collect();
    assert_eq!(
        classes,
        [(INTERACTIVE, 3), (BACKFILL, 1)],
        "a's waiting classes: {a:?}"
    );
    for (w, told) in a.waiting.iter().zip([40, 10]) {
        let told = Duration::from_millis(told);
        assert!(
            w.2 >= told && w.2 <= told + passed + Duration::from_millis(50),
            "the oldest wait of {:?}: {:?}, told {told:?}",
            w.0,
            w.2
        );
    }
    assert!(b.view.lock.is_some(), "b is locked: {b:?}");
    assert_eq!(
        *never,
        Snapshot::default(),
        "a destination never used is a fresh budget"
    );
}

async fn shares_are_honoured_and_lent(store: &impl Store) {
    let r = Rule {
        shares: Arc::from(vec![0.0, 0.0, 0.2]),
        ..rule(1000.0)
    };
    let both = [waiting(INTERACTIVE, 100, 10), waiting(BACKFILL, 100, 10)];
    let mut got = Vec::new();
    for _ in 0..20 {
        got.push(ask(store, &r, &both).await.unwrap());
    }
    let backfill = got.iter().filter(|c| **c == BACKFILL).count();
    assert_eq!(backfill, 4, "a share of 0.2 gets 4 of 20: {got:?}");
    // Alone, backfill gets every slot.
    for _ in 0..5 {
        assert_eq!(
            ask(store, &r, &[waiting(BACKFILL, 100, 10)]).await.unwrap(),
            BACKFILL
        );
    }
}

async fn quota_windows_hold(store: &impl Store, tol: Duration) {
    let r = Rule {
        quota: vec![Quota {
            limit: 3,
            per: Duration::from_millis(500),
        }],
        ..rule(100.0)
    };
    let (first, _) = read(store, "d", &r).await;
    let mut beat = Beat::new(first);
    for n in 1..3u32 {
        let (slot, _) = read(store, "d", &r).await;
        beat.next(n, slot, r.interval, tol, "within the quota, the beat");
    }
    // The fourth waits until the first has left the window, plus the quota margin (the
    // lateness a slot may be sent with, and its way to the upstream).
    let (fourth, _) = read(store, "d", &r).await;
    apart(
        first,
        fourth,
        Duration::from_millis(500) + r.quota_margin(),
        tol,
        "the fourth slot of a 3 per 500 ms quota",
    );
    tokio::time::sleep_until(first.at + Duration::from_millis(100)).await;
    let used = snapshot(store, "d", &r).await.quota_used;
    assert_eq!(
        used,
        [3],
        "three slots in the last window (the fourth is ahead)"
    );
}

async fn slots_keep_the_beat(store: &impl Store, tol: Duration) {
    let r = rule(10.0);
    let (first, reservation) = read(store, "d", &r).await;
    assert_eq!(reservation.generation, 0);
    let mut beat = Beat::new(first);
    for n in 1..10u32 {
        // Reserving late must not shift the beat.
        tokio::time::sleep(Duration::from_millis(7)).await;
        let (slot, _) = read(store, "d", &r).await;
        beat.next(n, slot, r.interval, tol, "n-th slot is start + n / rate");
    }
}

async fn a_new_destination_starts_now(store: &impl Store, tol: Duration) {
    let (slot, _) = read(store, "fresh", &rule(1.0)).await;
    due(slot, tol, "first slot of a new destination");
    let view = store.view("never-used").await.unwrap();
    assert_eq!(
        (view.backoff, view.generation, view.clean_streak),
        (1.0, 0, 0)
    );
    assert!(view.lock.is_none());
}

/// Slots handed out without the store (pacing alone) come before its schedule: each budget
/// continues no earlier than its mark, a budget never used included; an earlier mark changes
/// nothing.
async fn slots_handed_out_elsewhere_come_first(store: &impl Store, tol: Duration) {
    let r = rule(10.0);
    let (first, _) = read(store, "d", &r).await;
    due(first, tol, "the first slot");
    let mark = Instant::now() + Duration::from_secs(3);
    let marks = [("d".to_owned(), mark), ("new".to_owned(), mark)];
    store.continue_after(&marks).await.unwrap();
    for budget in ["d", "new"] {
        let (after, _) = read(store, budget, &r).await;
        assert!(
            after.at + tol >= mark,
            "{budget}: {:?} before the mark {mark:?}",
            after.at
        );
        assert!(
            after.at <= mark + tol + (after.arrived - after.sent),
            "{budget}"
        );
    }
    // A mark behind the schedule does not move it back, nor on.
    let (before, _) = read(store, "d", &r).await;
    store
        .continue_after(&[("d".to_owned(), Instant::now())])
        .await
        .unwrap();
    store.continue_after(&[]).await.unwrap();
    let (next, _) = read(store, "d", &r).await;
    let gap = next.at.saturating_duration_since(before.at);
    assert!(
        gap + tol >= r.interval && gap <= r.interval + tol + (next.arrived - next.sent),
        "{gap:?}"
    );
}

async fn burst_then_spacing(store: &impl Store, tol: Duration) {
    let r = Rule {
        burst: 3,
        ..rule(10.0)
    };
    let (first, _) = read(store, "d", &r).await;
    due(first, tol, "burst slots are immediate");
    for _ in 1..3 {
        due(
            read(store, "d", &r).await.0,
            tol,
            "burst slots are immediate",
        );
    }
    let (fourth, _) = read(store, "d", &r).await;
    apart(first, fourth, r.interval, tol, "then spaced");
}

async fn too_late_takes_nothing(store: &impl Store, tol: Duration) {
    let r = rule(1.0);
    let (first, _) = read(store, "d", &r).await;
    let limit = Instant::now() + Duration::from_millis(100);
    match timed(store, "d", &r, Some(limit)).await {
        (Err(ReserveError::TooLate { slot }), sent, arrived) => {
            let refused = Reading {
                at: slot,
                sent,
                arrived,
            };
            apart(
                first,
                refused,
                r.interval,
                tol,
                "the slot it would have been",
            );
        }
        (other, ..) => panic!("expected TooLate, got {other:?}"),
    }
    let (next, _) = read(store, "d", &r).await;
    apart(
        first,
        next,
        r.interval,
        tol,
        "the refused attempt took no slot",
    );
}

async fn throttles_widen_once_per_generation(store: &impl Store, tol: Duration) {
    let r = rule(10.0);
    let reserved = take(store, "d", &r, None).await.unwrap();
    for _ in 0..10 {
        let event = Event::Throttled {
            generation: reserved.generation,
            retry_after: None,
            reset: None,
            spread: 0.0,
        };
        store.record("d", &r, event, None).await.unwrap();
    }
    let view = store.view("d").await.unwrap();
    assert_eq!(
        (view.backoff, view.generation),
        (2.0, 1),
        "ten throttles of one generation widen once"
    );
    let (a, reservation) = read(store, "d", &r).await;
    assert_eq!(reservation.generation, 1);
    let (b, _) = read(store, "d", &r).await;
    apart(a, b, r.interval * 2, tol, "the interval doubled");
}

async fn retry_after_pauses_the_destination(store: &impl Store, tol: Duration) {
    let r = rule(100.0);
    take(store, "d", &r, None).await.unwrap();
    let now = Instant::now();
    let event = Event::Throttled {
        generation: 0,
        retry_after: Some(Pause::For(Duration::from_secs(5))),
        reset: None,
        spread: 0.0,
    };
    let view = store.record("d", &r, event, None).await.unwrap();
    assert!(view.paused_for > Duration::from_millis(4900), "{view:?}");
    let slot = take(store, "d", &r, None).await.unwrap();
    assert!(
        slot.at >= now + Duration::from_secs(5) - tol,
        "no slot inside the pause"
    );
    // A shorter Retry-After never shortens a pause, and a huge one is capped.
    let short = Event::Throttled {
        generation: 99,
        retry_after: Some(Pause::For(Duration::from_secs(1))),
        reset: None,
        spread: 0.0,
    };
    assert!(
        store.record("d", &r, short, None).await.unwrap().paused_for > Duration::from_millis(4800)
    );
    let huge = Event::Throttled {
        generation: 99,
        retry_after: Some(Pause::For(Duration::from_secs(1_000_000))),
        reset: None,
        spread: 0.0,
    };
    let view = store.record("d", &r, huge, None).await.unwrap();
    assert!(view.paused_for <= r.retry_after_max, "{view:?}");
}

async fn clean_streak_decays_backoff(store: &impl Store) {
    let r = rule(10.0);
    for generation in 0..2 {
        let event = Event::Throttled {
            generation,
            retry_after: None,
            reset: None,
            spread: 0.0,
        };
        store.record("d", &r, event, None).await.unwrap();
    }
    assert_eq!(store.view("d").await.unwrap().backoff, 4.0);
    // Answers to requests sent before the last widening say nothing of the pace now.
    for _ in 0..10 {
        let stale = Event::Clean {
            success: true,
            generation: 1,
        };
        store.record("d", &r, stale, None).await.unwrap();
    }
    let view = store.view("d").await.unwrap();
    assert_eq!(
        (view.backoff, view.clean_streak),
        (4.0, 0),
        "stale cleans: {view:?}"
    );
    let clean = Event::Clean {
        success: true,
        generation: 2,
    };
    for i in 1..=3 {
        let view = store.record("d", &r, clean.clone(), None).await.unwrap();
        assert_eq!(
            view.backoff,
            if i < 3 { 4.0 } else { 2.0 },
            "after {i} clean"
        );
    }
    for _ in 0..20 {
        store.record("d", &r, clean.clone(), None).await.unwrap();
    }
    assert_eq!(store.view("d").await.unwrap().backoff, 1.0, "never below 1");
}

async fn lockout_until_unlocked(store: &impl Store) {
    let r = rule(10.0);
    let lock = Lockout::new(403, "GET https://d/x".into(), "instance-a".into());
    store
        .record("d", &r, Event::Lockout(lock.clone()), None)
        .await
        .unwrap();
    match take(store, "d", &r, None).await {
        Err(ReserveError::Locked(l)) => assert_eq!(
            (l.status, l.request, l.instance),
            (403, lock.request.clone(), lock.instance.clone())
        ),
        other => panic!("expected Locked, got {other:?}"),
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        take(store, "d", &r, None).await.is_err(),
        "time does not clear a lockout"
    );
    let second = Lockout::new(403, "GET https://d/y".into(), "instance-b".into());
    store
        .record("d", &r, Event::Lockout(second), None)
        .await
        .unwrap();
    assert_eq!(
        store.view("d").await.unwrap().lock.unwrap().request,
        lock.request,
        "the first lockout is kept"
    );
    assert_eq!(
        store.unlock("d").await.unwrap().map(|l| l.request),
        Some(lock.request)
    );
    assert!(take(store, "d", &r, None).await.is_ok());
    assert_eq!(store.unlock("d").await.unwrap(), None);
}

async fn destinations_are_independent(store: &impl Store, tol: Duration) {
    let r = rule(1.0);
    take(store, "a", &r, None).await.unwrap();
    due(read(store, "b", &r).await.0, tol, "b is not behind a");
    let event = Event::Throttled {
        generation: 0,
        retry_after: Some(Pause::For(Duration::from_secs(30))),
        reset: None,
        spread: 0.0,
    };
    store.record("a", &r, event, None).await.unwrap();
    assert_eq!(store.view("b").await.unwrap().backoff, 1.0);
    assert_eq!(store.view("b").await.unwrap().paused_for, Duration::ZERO);
}

async fn concurrent_reservations_are_strictly_increasing<S: Store>(store: Arc<S>, tol: Duration) {
    // 64 requests race, from the destination's first reservation on. Nothing waits for its
    // slot, so a second's interval costs no time and puts the readings, however late under
    // load, far from a shared slot (0 apart).
    let r = Arc::new(rule(1.0));
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let (store, r) = (store.clone(), r.clone());
            tokio::spawn(async move { read(&*store, "d", &r).await.0 })
        })
        .collect();
    let mut slots = Vec::new();
    for t in tasks {
        slots.push(t.await.unwrap());
    }
    slots.sort_by_key(|s| s.at);
    for pair in slots.windows(2) {
        assert!(
            pair[1].at - pair[0].at >= r.interval / 2,
            "two requests share a slot: {:?} and {:?}",
            pair[0],
            pair[1]
        );
    }
    // Distinct, and on the beat: the whole span is the schedule's.
    let (first, last) = (slots[0], slots[slots.len() - 1]);
    apart(first, last, r.interval * 63, tol, "64 slots");
}
