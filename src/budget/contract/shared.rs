//! The contract's checks that need two instances on one store: who deserves the next slot
//! over every instance, and what each is told of the others' waiting requests.

use std::future::Future;
use std::time::Duration;

use super::{ask, batch, rule, waiting, BACKFILL, INTERACTIVE};
use crate::budget::{Ask, ClassQueue, ReserveError, Store};

/// The checks that need two instances on one store; `pair` opens two handles on one fresh
/// store that report their waiting requests as different, live instances.
pub(crate) async fn run_shared<S, F, Fut>(pair: F)
where
    S: Store,
    F: Fn() -> Fut,
    Fut: Future<Output = (S, S)>,
{
    the_most_urgent_request_anywhere_goes_first(pair().await).await;
    first_come_first_served_within_a_class_anywhere(pair().await).await;
    waiting_counts_every_instance(pair().await).await;
    batch::a_batch_stops_for_a_more_urgent_class_or_an_owed_share(pair().await).await;
    the_key_secret_is_one_for_every_instance(pair().await).await;
    a_meter_s_waiter_elsewhere_asks_again_when_a_refund_may_have_come(pair().await).await;
}

/// Asks for a slot of `cost` units on `m` at 1,000 a second for `queues`: how long to
/// yield, if the store says to.
async fn yields_for(store: &impl Store, cost: u32, queues: &[ClassQueue]) -> Option<Duration> {
    let ask = Ask {
        queues,
        not_after: None,
        most: 1,
        cost,
    };
    match store.reserve("m", &rule(1000.0), ask).await {
        Err(ReserveError::Yield(after)) => Some(after),
        _ => None,
    }
}

/// A meter's waiter on another instance is told to ask again when the latest slot granted
/// comes, not when the next is free by the beat: a refund of the request on that slot then
/// finds the next reserved already, instead of bringing the beat back while nobody asks.
/// Where no slot is granted ahead, it asks again half-way to the free slot, as a refund
/// meanwhile may bring that slot forward. At 1,000 a second, slots of 100 units.
async fn a_meter_s_waiter_elsewhere_asks_again_when_a_refund_may_have_come<S: Store>(
    (a, b): (S, S),
) {
    let older = [waiting(BACKFILL, 50, 5_000)];
    let younger = [waiting(BACKFILL, 1, 1_000)];
    a.wait_list("m", &older).await.unwrap();
    // One slot now: none granted ahead, the beat free in 100 ms.
    assert_eq!(yields_for(&a, 100, &older).await, None, "a's first slot");
    let after = yields_for(&b, 100, &younger).await.expect("a yield");
    assert!(
        after <= Duration::from_millis(55),
        "{after:?}: half-way to the beat's 100 ms, less the margin"
    );
    // Two more granted ahead, the latest 200 ms ahead: the next is free by the beat in 300.
    for which in ["a's second slot", "a's third slot"] {
        assert_eq!(yields_for(&a, 100, &older).await, None, "{which}");
    }
    let after = yields_for(&b, 100, &younger).await.expect("a yield");
    assert!(
        after >= Duration::from_millis(170) && after <= Duration::from_millis(195),
        "{after:?}: until the slot granted 200 ms ahead, less the margin"
    );
}

async fn the_key_secret_is_one_for_every_instance<S: Store>((a, b): (S, S)) {
    let secret = a.key_secret().await.unwrap();
    assert!(secret.len() >= 16, "{} bytes", secret.len());
    assert_eq!(b.key_secret().await.unwrap(), secret, "another instance's");
    assert_eq!(a.key_secret().await.unwrap(), secret, "asked again");
}

async fn the_most_urgent_request_anywhere_goes_first<S: Store>((a, b): (S, S)) {
    let r = rule(100.0);
    a.wait_list("d", &[waiting(BACKFILL, 50, 5_000)])
        .await
        .unwrap();
    b.wait_list("d", &[waiting(INTERACTIVE, 1, 1)])
        .await
        .unwrap();
    // a's backfill, however old, yields to b's interactive request.
    match ask(&a, &r, &[waiting(BACKFILL, 50, 5_000)]).await {
        Err(ReserveError::Yield(after)) => assert!(after <= Duration::from_millis(250)),
        other => panic!("expected a yield, got {other:?}"),
    }
    assert_eq!(
        ask(&b, &r, &[waiting(INTERACTIVE, 1, 1)]).await.unwrap(),
        INTERACTIVE
    );
    // Served, b's request no longer counts: a goes next.
    assert_eq!(
        ask(&a, &r, &[waiting(BACKFILL, 50, 5_000)]).await.unwrap(),
        BACKFILL
    );
}

async fn first_come_first_served_within_a_class_anywhere<S: Store>((a, b): (S, S)) {
    let r = rule(100.0);
    a.wait_list("d", &[waiting(BACKFILL, 1, 5_000)])
        .await
        .unwrap();
    assert!(matches!(
        ask(&b, &r, &[waiting(BACKFILL, 1, 1_000)]).await,
        Err(ReserveError::Yield(_))
    ));
    assert_eq!(
        ask(&a, &r, &[waiting(BACKFILL, 1, 5_000)]).await.unwrap(),
        BACKFILL
    );
    assert_eq!(
        ask(&b, &r, &[waiting(BACKFILL, 1, 1_000)]).await.unwrap(),
        BACKFILL
    );
    // A request that left is forgotten at once.
    a.wait_list("d", &[waiting(INTERACTIVE, 1, 9_000)])
        .await
        .unwrap();
    a.wait_list("d", &[]).await.unwrap();
    assert_eq!(
        ask(&b, &r, &[waiting(BACKFILL, 1, 1)]).await.unwrap(),
        BACKFILL
    );
}

async fn waiting_counts_every_instance<S: Store>((a, b): (S, S)) {
    a.wait_list("d", &[waiting(BACKFILL, 3, 2_000)])
        .await
        .unwrap();
    b.wait_list(
        "d",
        &[waiting(INTERACTIVE, 1, 10), waiting(BACKFILL, 2, 500)],
    )
    .await
    .unwrap();
    let list = super::waiting_in(&a, "d").await;
    assert_eq!(list.len(), 2, "{list:?}");
    assert_eq!((list[0].0, list[0].1), (INTERACTIVE, 1));
    assert_eq!((list[1].0, list[1].1), (BACKFILL, 5));
    assert!(list[1].2 >= Duration::from_millis(1_900), "{list:?}");
    b.wait_list("d", &[]).await.unwrap();
    assert_eq!(super::waiting_in(&b, "d").await[0].1, 3);
}
