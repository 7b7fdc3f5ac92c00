//! The contract's checks of budgets split by key (`PARENT#KEY`): the parent's lockout halts
//! every key, however new, and keys gone idle are forgotten, no others.

use std::time::Duration;

use super::{rule, take, waiting};
use crate::budget::{Event, Lockout, Pause, ReserveError, Store};

pub(super) async fn a_parent_lockout_halts_every_key(store: &impl Store) {
    let r = rule(10.0);
    take(store, "d#k1", &r, None).await.unwrap();
    let lock = Lockout::new(403, "GET https://d/x".into(), "instance-a".into());
    store
        .record("d", &r, Event::Lockout(lock.clone()), None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    for key in ["d#k1", "d#never-seen"] {
        match take(store, key, &r, None).await {
            Err(ReserveError::Locked(l)) => {
                assert_eq!((l.status, &l.request), (403, &lock.request), "{key}")
            }
            other => panic!("{key}: expected Locked by its parent, got {other:?}"),
        }
    }
    assert!(
        take(store, "e#k1", &r, None).await.is_ok(),
        "another budget's key is not halted"
    );
    store.unlock("d").await.unwrap();
    assert!(take(store, "d#k1", &r, None).await.is_ok(), "unlocked");
}

pub(super) async fn idle_keys_are_forgotten_and_no_others(store: &impl Store) {
    let r = rule(10.0);
    let idle = Duration::from_secs(1);
    for name in ["d#idle", "d#paused", "d#waits", "dx#idle", "d"] {
        take(store, name, &r, None).await.unwrap();
    }
    let pause = Event::Throttled {
        generation: 0,
        retry_after: Some(Pause::For(Duration::from_secs(30))),
        reset: None,
        spread: 0.0,
    };
    store.record("d#paused", &r, pause, None).await.unwrap();
    store.record("d#idle", &r, throttled(), None).await.unwrap();
    tokio::time::sleep(idle + Duration::from_millis(500)).await;
    store
        .wait_list("d#waits", &[waiting(super::INTERACTIVE, 1, 0)])
        .await
        .unwrap();
    assert_eq!(
        store.forget_keys("d", idle).await.unwrap(),
        1,
        "only d#idle"
    );
    assert_eq!(
        store.view("d#idle").await.unwrap().backoff,
        1.0,
        "forgotten"
    );
    assert!(!store.view("d#paused").await.unwrap().paused_for.is_zero());
    assert_eq!(
        store.forget_keys("d", idle).await.unwrap(),
        0,
        "nothing left"
    );
    assert_eq!(
        store.forget_keys("dx", idle).await.unwrap(),
        1,
        "dx's key, which d's sweep left alone"
    );
}

fn throttled() -> Event {
    Event::Throttled {
        generation: 0,
        retry_after: None,
        reset: None,
        spread: 0.0,
    }
}
