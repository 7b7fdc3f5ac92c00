//! A failover that loses commits, on real servers: a primary, a standby cut off from its WAL,
//! and the store handle that paced on the primary going on on the promoted standby.

use std::time::Duration;

use tokio::time::Instant;

use super::super::PostgresStore;
use crate::budget::contract::{rule, take};
use crate::budget::{Event, Lockout, Pause, Reservation, ReserveError, Rule, Store};
use crate::demo::cluster::Cluster;
use crate::destination::Quota;

/// What the promoted standby answered for each budget written after the cut.
struct After {
    locked: Result<Reservation, ReserveError>,
    paused: Result<Reservation, ReserveError>,
    backoff: f64,
    quota: Result<Reservation, ReserveError>,
    /// The slot `beat` got on the new server, and the latest it got on the old one.
    beat: (Instant, Instant),
}

fn windowed() -> Rule {
    Rule {
        quota: vec![Quota {
            limit: 3,
            per: Duration::from_secs(60),
        }],
        ..rule(100.0)
    }
}

/// Paces on a primary while its standby is cut off, then fails over to the standby.
async fn fail_over(reassert: bool) -> After {
    let primary = Cluster::start().unwrap();
    let standby = Cluster::standby_of(&primary).unwrap();
    let url = format!(
        "postgres://pacegate@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        primary.port, standby.port
    );
    let store = PostgresStore::new(&url, 4).unwrap().with_reassert(reassert);
    store.migrate().await.unwrap();
    let slow = rule(0.5);
    take(&store, "beat", &slow, None).await.unwrap();
    tokio::task::block_in_place(|| standby.cut_off(&primary)).unwrap();

    // Everything from here on is lost with the primary.
    let before = take(&store, "beat", &slow, None).await.unwrap().at;
    let lock = Lockout::new(403, "GET https://locked/x".into(), "instance-a".into());
    store
        .record("locked", &slow, Event::Lockout(lock), None)
        .await
        .unwrap();
    let throttle = Event::Throttled {
        generation: 0,
        retry_after: Some(Pause::For(Duration::from_secs(60))),
        reset: None,
        spread: 0.0,
    };
    store.record("paused", &slow, throttle, None).await.unwrap();
    for _ in 0..3 {
        take(&store, "quota", &windowed(), None).await.unwrap();
    }

    tokio::task::block_in_place(|| {
        primary.down().unwrap();
        standby.promote().unwrap();
    });
    let soon = || Some(Instant::now() + Duration::from_secs(5));
    // The pool's connections to the old primary fail once each, then it reaches the new one.
    let deadline = Instant::now() + Duration::from_secs(30);
    let beat = loop {
        match take(&store, "beat", &slow, None).await {
            Ok(r) => break r.at,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("not yet on the new server: {e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the store never came back on the standby: {e:?}"),
        }
    };
    After {
        locked: take(&store, "locked", &slow, soon()).await,
        paused: take(&store, "paused", &slow, soon()).await,
        backoff: store.view("paused").await.unwrap().backoff,
        quota: take(&store, "quota", &windowed(), soon()).await,
        beat: (beat, before),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_failover_lost_is_put_back_before_a_slot_is_granted() {
    let after = fail_over(true).await;
    assert!(
        matches!(after.locked, Err(ReserveError::Locked(ref l)) if l.status == 403),
        "the lockout: {:?}",
        after.locked
    );
    match after.paused {
        Err(ReserveError::TooLate { slot }) => assert!(
            slot > Instant::now() + Duration::from_secs(50),
            "the pause ends in {:?}",
            slot - Instant::now()
        ),
        other => panic!("the pause was lifted: {other:?}"),
    }
    assert_eq!(after.backoff, 2.0, "the backoff");
    assert!(
        matches!(after.quota, Err(ReserveError::TooLate { .. })),
        "a full quota window: {:?}",
        after.quota
    );
    let (beat, before) = after.beat;
    assert!(
        beat >= before + Duration::from_millis(1900),
        "the next slot moved back: {:?} after the last one on the old server",
        beat.saturating_duration_since(before)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_without_reassertion_the_failover_loses_them() {
    let after = fail_over(false).await;
    assert!(after.locked.is_ok(), "the lockout: {:?}", after.locked);
    assert!(after.paused.is_ok(), "the pause: {:?}", after.paused);
    assert_eq!(after.backoff, 1.0, "the backoff");
    assert!(after.quota.is_ok(), "the quota window: {:?}", after.quota);
    let (beat, before) = after.beat;
    assert!(
        beat < before + Duration::from_millis(1900),
        "the next slot: {:?} after the last one on the old server",
        beat.saturating_duration_since(before)
    );
}
