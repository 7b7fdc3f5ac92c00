//! A meter's slots: each as long as its request's cost, and settled once the cost is known.

use std::time::Duration;

use tokio::time::Instant;

use super::{apart, due, rule, waiting, Reading};
use crate::budget::{Ask, Store};
use crate::class::Class;

/// Reserves a slot of `cost` units on `d` at 1,000 units a second, and reads it.
async fn weighed(store: &impl Store, d: &str, cost: u32) -> Reading {
    let queues = [waiting(Class(1), 1, 0)];
    let ask = Ask {
        queues: &queues,
        not_after: None,
        most: 1,
        cost,
    };
    let sent = Instant::now();
    let grant = store.reserve(d, &rule(1000.0), ask).await.unwrap();
    Reading {
        at: grant.slot.at,
        sent,
        arrived: Instant::now(),
    }
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
