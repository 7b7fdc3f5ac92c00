//! A meter's slots: each as long as its request's cost, and settled once the cost is known.

use std::time::Duration;

use tokio::time::Instant;

use super::{apart, due, rule, snapshot, waiting, Reading};
use crate::budget::{Ask, Event, Pause, Reservation, Rule, Store};
use crate::class::Class;
use crate::destination::Quota;

/// `n` milliseconds.
fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A meter's rule at 1,000 units a second whose own window is too short to hold a slot and
/// too large to fill: its sends are counted, and only their order bears on a slot.
fn counting_sends() -> Rule {
    Rule {
        window: Some(Quota {
            limit: 1_000_000,
            per: Duration::from_millis(1),
        }),
        ..rule(1000.0)
    }
}

/// Reserves a slot of `cost` units on `d` at 1,000 units a second, and reads it.
async fn weighed(store: &impl Store, d: &str, cost: u32) -> Reading {
    weighed_by(store, d, &rule(1000.0), cost).await
}

/// Reserves a slot of `cost` units on `d` by `r`, and reads it.
async fn weighed_by(store: &impl Store, d: &str, r: &Rule, cost: u32) -> Reading {
    reserved_by(store, d, r, cost).await.0
}

/// Reserves a slot of `cost` units on `d` by `r`: its reading, and the slot with its mark.
async fn reserved_by(
    store: &impl Store,
    d: &str,
    r: &Rule,
    cost: u32,
) -> (Reading, (Reservation, Option<u64>)) {
    let queues = [waiting(Class(1), 1, 0)];
    let ask = Ask {
        queues: &queues,
        not_after: None,
        most: 1,
        cost,
    };
    let sent = Instant::now();
    let grant = store.reserve(d, r, ask).await.unwrap();
    let reading = Reading {
        at: grant.slot.at,
        sent,
        arrived: Instant::now(),
    };
    (reading, (grant.slot, grant.sent.first().copied()))
}

/// A slot of 200 units at 1,000 a second holds the next one 200 ms back; one of a single
/// unit, 1 ms.
pub(super) async fn a_slot_is_as_long_as_its_cost(store: &impl Store, tol: Duration) {
    let first = weighed(store, "m", 200).await;
    due(first, tol, "the first slot");
    let second = weighed(store, "m", 1).await;
    apart(
        first,
        second,
        Duration::from_millis(200),
        tol,
        "after 200 units",
    );
    let third = weighed(store, "m", 1).await;
    apart(second, third, Duration::from_millis(1), tol, "after 1 unit");
}

/// A request that cost less than its slot gives the rest back to the requests after it; one
/// that cost more holds them back by the difference.
pub(super) async fn a_settlement_moves_the_next_slot(store: &impl Store, tol: Duration) {
    let r = rule(1000.0);
    let first = weighed(store, "m", 300).await;
    store.settle("m", &r, -200).await.unwrap();
    let second = weighed(store, "m", 100).await;
    apart(
        first,
        second,
        Duration::from_millis(100),
        tol,
        "after a refund of 200 of 300",
    );
    store.settle("m", &r, 150).await.unwrap();
    let third = weighed(store, "m", 1).await;
    apart(
        second,
        third,
        Duration::from_millis(250),
        tol,
        "after a charge of 150 on 100",
    );
}

/// A refund never reaches into time already past: after an idle spell, the slot it frees is
/// now, not a burst of the slots the refund would have made room for.
pub(super) async fn a_refund_gives_back_no_time_already_past(store: &impl Store, tol: Duration) {
    let r = rule(1000.0);
    let first = weighed(store, "m", 50).await;
    tokio::time::sleep_until(first.at + Duration::from_millis(80)).await;
    store.settle("m", &r, -50).await.unwrap();
    let second = weighed(store, "m", 100).await;
    due(second, tol, "the slot after an idle spell");
    store.settle("m", &r, -100).await.unwrap();
    // The refund of a slot not yet over ends it now: the next is due at once, and the one
    // after it is a whole cost later, not at the same instant.
    let third = weighed(store, "m", 100).await;
    due(third, tol, "the slot after a full refund");
    let fourth = weighed(store, "m", 1).await;
    apart(
        third,
        fourth,
        Duration::from_millis(100),
        tol,
        "after 100 units",
    );
}

/// A refund of a request in flight while a later slot is granted already gives back no time
/// before that slot: the next request goes no earlier than it.
pub(super) async fn a_refund_does_not_reach_before_a_slot_granted_since(
    store: &impl Store,
    tol: Duration,
) {
    let r = rule(1000.0);
    let first = weighed(store, "m", 300).await;
    let second = weighed(store, "m", 100).await;
    apart(
        first,
        second,
        Duration::from_millis(300),
        tol,
        "after 300 units",
    );
    // The first cost nothing in the end: its 300 ms would reach back before the second.
    store.settle("m", &r, -300).await.unwrap();
    let third = weighed(store, "m", 1).await;
    apart(
        second,
        third,
        Duration::ZERO,
        tol,
        "after a refund behind a slot granted",
    );
}

/// A meter's quota window counts units, not slots: two slots of 400 fill 800 of a window of
/// 1,000, and the third waits until the first has left it (plus the quota margin). A charge
/// settled after the third counts as a send of its units: the fourth then waits for the third
/// to leave the window, where without the charge it would go on the beat.
pub(super) async fn a_quota_window_counts_units_and_charges(store: &impl Store, tol: Duration) {
    let per = Duration::from_millis(300);
    let r = Rule {
        quota: vec![Quota { limit: 1000, per }],
        ..rule(100_000.0)
    };
    let first = weighed_by(store, "m", &r, 400).await;
    let second = weighed_by(store, "m", &r, 400).await;
    apart(
        first,
        second,
        Duration::from_millis(4),
        tol,
        "400 units at 100,000 a second",
    );
    let third = weighed_by(store, "m", &r, 400).await;
    apart(
        first,
        third,
        per + r.quota_margin(),
        tol,
        "1,200 units in a window of 1,000",
    );
    assert_eq!(
        snapshot(store, "m", &r).await.quota_used,
        [1000],
        "the window is full (its 1,200 units capped at the limit)"
    );
    // The third cost 700 more than it reserved: 1,900 units, the last 1,000 reach into it.
    store.settle("m", &r, 700).await.unwrap();
    let fourth = weighed_by(store, "m", &r, 100).await;
    apart(
        third,
        fourth,
        per + r.quota_margin(),
        tol,
        "a charge of 700 counted in the window",
    );
}

/// A slot given back unused leaves the quota window as if never taken, and the sends after
/// it count its units fewer: after 400, 400 and 200 fill a window of 1,000, the second given
/// back makes room for another 400 half its interval after the latest slot (2 ms: its
/// refund takes the beat back past that slot); the next unit waits for the first to leave
/// the window.
pub(super) async fn a_slot_given_back_leaves_the_quota_window(store: &impl Store, tol: Duration) {
    let per = Duration::from_millis(300);
    let r = Rule {
        quota: vec![Quota { limit: 1000, per }],
        ..rule(100_000.0)
    };
    let (first, _) = reserved_by(store, "m", &r, 400).await;
    let (_, second) = reserved_by(store, "m", &r, 400).await;
    let (third, _) = reserved_by(store, "m", &r, 200).await;
    let (slot, sent) = second;
    store
        .give_back("m", &r, &slot, sent, 400, 400)
        .await
        .unwrap();
    let fourth = weighed_by(store, "m", &r, 400).await;
    apart(
        third,
        fourth,
        Duration::from_millis(2),
        tol,
        "400 units given back",
    );
    let fifth = weighed_by(store, "m", &r, 1).await;
    apart(
        first,
        fifth,
        per + r.quota_margin(),
        tol,
        "a unit past a full window",
    );
}

/// A meter's own window holds at most its limit and the request that fills it: two slots of
/// 600 in a window of 1,000 go on the beat (the second runs over by its own units), and the
/// next waits until the first has left the window (plus the quota margin).
pub(super) async fn a_meter_s_own_window_holds_its_limit_and_one_request(
    store: &impl Store,
    tol: Duration,
) {
    let per = Duration::from_millis(300);
    let r = Rule {
        window: Some(Quota { limit: 1000, per }),
        ..rule(100_000.0)
    };
    let first = weighed_by(store, "m", &r, 600).await;
    let second = weighed_by(store, "m", &r, 600).await;
    apart(
        first,
        second,
        Duration::from_millis(6),
        tol,
        "600 units at 100,000 a second",
    );
    let third = weighed_by(store, "m", &r, 1).await;
    apart(
        first,
        third,
        per + r.quota_margin(),
        tol,
        "a unit past 1,200 in a window of 1,000",
    );
}

/// What a request cost less than its estimate, given back, leaves a meter's own window: of
/// two slots of 600, the first cost 100, so 700 are in the window and another 400 go at
/// once, where 1,200 would have held them until the first left it; the next unit waits for
/// that (1,100 units are in the window).
pub(super) async fn a_refund_leaves_a_meter_s_own_window(store: &impl Store, tol: Duration) {
    let per = Duration::from_millis(300);
    let r = Rule {
        window: Some(Quota { limit: 1000, per }),
        ..rule(100_000.0)
    };
    let (first, (slot, sent)) = reserved_by(store, "m", &r, 600).await;
    weighed_by(store, "m", &r, 600).await;
    store
        .give_back("m", &r, &slot, sent, 600, 500)
        .await
        .unwrap();
    let third = weighed_by(store, "m", &r, 400).await;
    assert!(
        third.at < first.at + per / 2,
        "400 units waited {:?} after the first, whose refund of 500 left the window",
        third.at - first.at
    );
    let fourth = weighed_by(store, "m", &r, 1).await;
    apart(
        first,
        fourth,
        per + r.quota_margin(),
        tol,
        "a unit past 1,100 in a window of 1,000",
    );
}

/// Where a meter counts its sends, a refund that reaches back past a slot granted since is
/// not lost: the latest send keeps the slots in order, and the slots after it go half an
/// interval apart until they have spent what is carried. At 1,000 a second, slots of 300 and
/// 100, then the first's 300 refunded (the beat 200 ms behind the second's slot): the next
/// three of 100 go 50 ms apart, where without the carry each would go a whole interval
/// after the one before (and where only one slot spent it, the third of them would).
pub(super) async fn a_refund_past_a_slot_granted_since_is_carried_where_sends_are_counted(
    store: &impl Store,
    tol: Duration,
) {
    let r = counting_sends();
    let (_, (slot, sent)) = reserved_by(store, "m", &r, 300).await;
    let second = weighed_by(store, "m", &r, 100).await;
    store
        .give_back("m", &r, &slot, sent, 300, 300)
        .await
        .unwrap();
    let mut before = second;
    for what in [
        "the first after a refund carried",
        "the second",
        "the third",
    ] {
        let next = weighed_by(store, "m", &r, 100).await;
        apart(before, next, Duration::from_millis(50), tol, what);
        before = next;
    }
}

/// Refunds come after the next slot was granted (a meter's is asked for as the last one
/// comes), often once it has passed: what they give back is carried past now, as far as each
/// slot's own length behind the latest slot, so that refunds that come together cannot pile
/// up into a burst. At 1,000 a second, five slots of 100 (0 to 400 ms), and 90 of each given
/// back `d` (10 ms and the calls' time) after the last: the beat goes back to 100 ms behind
/// the latest slot (not 350, all of them; nor only to now, as a budget without sends
/// would), `d` of which passed unused, and the slots after it go 50, 50 and 50 ms apart,
/// then 50 + `d` (the beat caught up), then 100.
pub(super) async fn refunds_after_the_latest_slot_are_carried_at_most_a_slot_s_length(
    store: &impl Store,
    tol: Duration,
) {
    let r = counting_sends();
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(reserved_by(store, "m", &r, 100).await);
    }
    let last = held[4].0;
    tokio::time::sleep_until(last.at + Duration::from_millis(10)).await;
    for (_, (slot, sent)) in &held {
        store
            .give_back("m", &r, slot, *sent, 100, 90)
            .await
            .unwrap();
    }
    // The time that passed unused since the latest slot, as the store saw it when the next
    // was asked for (within that ask's round trip): the beat's lag less it is what is spent.
    let first = weighed_by(store, "m", &r, 100).await;
    let idle = first.sent.saturating_duration_since(last.at);
    apart(last, first, ms(50), tol, "the first after the refunds");
    let mut before = first;
    for (gap, what) in [
        (ms(50), "the second, what was carried"),
        (ms(50), "the third, the rest of it"),
        (ms(50) + idle, "the fourth, the beat caught up"),
        (ms(100), "the fifth, on the beat"),
    ] {
        let next = weighed_by(store, "m", &r, 100).await;
        apart(before, next, gap, tol + first.trip(), what);
        before = next;
    }
}

/// A slot a window holds back does not take the beat with it: the beat goes on from where it
/// stood, at most an interval behind the slot, and the slot after it goes half its interval
/// later. At 10,000 units a second with 1,000 in each 200 ms: 600 and 400 fill the window,
/// 300 more waits for the first to leave it; the next 100 goes 5 ms after that, not 30 (the
/// held slot's whole interval).
pub(super) async fn a_window_s_hold_leaves_the_beat_where_it_stood(
    store: &impl Store,
    tol: Duration,
) {
    let r = Rule {
        quota: vec![Quota {
            limit: 1000,
            per: Duration::from_millis(200),
        }],
        ..rule(10_000.0)
    };
    let first = weighed_by(store, "m", &r, 600).await;
    weighed_by(store, "m", &r, 400).await;
    let held = weighed_by(store, "m", &r, 300).await;
    apart(
        first,
        held,
        Duration::from_millis(200) + r.weighted(300).quota_margin(),
        tol,
        "300 units past a full window",
    );
    let next = weighed_by(store, "m", &r, 100).await;
    apart(
        held,
        next,
        Duration::from_millis(5),
        tol,
        "half an interval after the held slot",
    );
}

/// Two slots may share an instant (a pause holds both, the second lent by the burst): a
/// refund is taken out of the send it names, not the other. A quota of 1,000 units in
/// 200 ms, a pause, then slots of 600 and 400 at its end: with 300 of the first's refunded
/// the window holds 700, and another 300 goes at once; counted against the other send (or
/// neither), it would wait for the window to pass.
pub(super) async fn a_refund_leaves_the_send_it_names_among_sends_of_one_instant(
    store: &impl Store,
    tol: Duration,
) {
    let r = Rule {
        quota: vec![Quota {
            limit: 1000,
            per: Duration::from_millis(200),
        }],
        burst: 4,
        ..rule(100_000.0)
    };
    let pause = Event::Throttled {
        generation: 0,
        retry_after: Some(Pause::For(Duration::from_millis(300))),
        reset: None,
        spread: 0.0,
    };
    store.record("m", &r, pause, None).await.unwrap();
    let (first, (slot, sent)) = reserved_by(store, "m", &r, 600).await;
    let second = weighed_by(store, "m", &r, 400).await;
    apart(
        first,
        second,
        Duration::ZERO,
        tol,
        "both at the pause's end",
    );
    store
        .give_back("m", &r, &slot, sent, 600, 300)
        .await
        .unwrap();
    let third = weighed_by(store, "m", &r, 300).await;
    apart(
        second,
        third,
        Duration::ZERO,
        tol,
        "300 of the first refunded",
    );
}
