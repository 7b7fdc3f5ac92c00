//! The contract's checks that need two instances on one store: who deserves the next slot
//! over every instance, and what each is told of the others' waiting requests.

use std::future::Future;
use std::time::Duration;

use super::{ask, batch, rule, waiting, BACKFILL, INTERACTIVE};
use crate::budget::{ReserveError, Store};

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
