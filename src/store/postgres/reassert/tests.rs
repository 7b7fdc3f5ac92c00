//! A failover that loses commits, on real servers: a primary, a standby cut off from its WAL,
//! and the store handle that paced on the primary going on on the promoted standby. Every
//! kind of knowledge is written after the cut, on a budget of its own: a lockout, a pause
//! and the backoff it brought, a full quota window, the vendor's view, a block streak, and
//! the next slot.

use std::time::Duration;

use tokio::time::Instant;

use super::super::PostgresStore;
use crate::budget::contract::{rule, take};
use crate::budget::{
    Event, Lockout, Observation, Pause, Reservation, ReserveError, Rule, Store, StoreError,
};
use crate::config::OnUnavailable;
use crate::demo::cluster::Cluster;
use crate::destination::{Block, Quota, VendorPace};
use crate::fleet::failover::{Failover, Gauges, Policy};
use crate::fleet::heartbeat::Health;
use crate::fleet::Instance;
use crate::signals::Family;
use crate::store::memory::MemoryStore;

/// What the promoted standby answered for each budget written after the cut.
struct After {
    locked: Result<Reservation, ReserveError>,
    paused: Result<Reservation, ReserveError>,
    backoff: f64,
    quota: Result<Reservation, ReserveError>,
    /// A budget the vendor said has two requests left for a minute: the first goes in 30 s.
    vendor: Result<Reservation, ReserveError>,
    /// The block streak of a budget blocked once.
    block_streak: u32,
    /// The slot `beat` got on the new server, and the latest it got on the old one.
    beat: (Instant, Instant),
}

fn blocking() -> Rule {
    Rule {
        block: Some(Block {
            min: Duration::from_secs(1),
            max: Duration::from_secs(60),
            jitter: 0.0,
        }),
        ..rule(100.0)
    }
}

/// A vendor's remaining requests spread until its reset: two in a minute go 30 s apart.
fn spreading() -> Rule {
    Rule {
        vendor_pace: VendorPace::Spread,
        ..rule(100.0)
    }
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
    let said = Observation {
        family: Family::Ietf,
        remaining: 2,
        limit: Some(100),
        reset: Pause::For(Duration::from_secs(60)),
        spread: 0.0,
        unanswered: 0,
    };
    store
        .record("vendor", &spreading(), Event::None, Some(said))
        .await
        .unwrap();
    let block = Event::Throttled {
        generation: 0,
        retry_after: None,
        reset: None,
        spread: 0.0,
    };
    store
        .record("blocked", &blocking(), block, None)
        .await
        .unwrap();

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
        vendor: take(&store, "vendor", &spreading(), soon()).await,
        block_streak: store.view("blocked").await.unwrap().block_streak,
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
    assert!(
        matches!(after.vendor, Err(ReserveError::TooLate { .. })),
        "the vendor's view was lost: {:?}",
        after.vendor
    );
    assert_eq!(after.block_streak, 1, "the block streak");
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
    assert!(
        after.vendor.is_ok(),
        "the vendor's view: {:?}",
        after.vendor
    );
    assert_eq!(after.block_streak, 0, "the block streak");
    let (beat, before) = after.beat;
    assert!(
        beat < before + Duration::from_millis(1900),
        "the next slot: {:?} after the last one on the old server",
        beat.saturating_duration_since(before)
    );
}

/// Plays a new server that lost `budget`'s row on the one `store` paces on: the row goes, and
/// the server is taken for another at the heartbeat's check.
async fn lose_row_on_a_new_server(store: &PostgresStore, budget: &str) {
    let client = store.client().await.unwrap();
    client
        .execute(
            "DELETE FROM pacegate_budgets WHERE destination = $1",
            &[&budget],
        )
        .await
        .unwrap();
    drop(client);
    *store.reassert.server.lock().await = Some("the server before".into());
    store.keep_waiting().await.unwrap();
}

/// Behind a pooler the server can change while this handle's connections stay open, so no
/// new connection would find it: the heartbeat's check does. Played on one server, which
/// loses a budget's row and is taken for another.
#[tokio::test]
async fn a_new_server_behind_an_open_connection_is_found_at_the_heartbeat() {
    let store = PostgresStore::new(&super::super::testdb::fresh().await, 2).unwrap();
    store.migrate().await.unwrap();
    let slow = rule(0.5);
    let lock = Lockout::new(403, "GET https://locked/x".into(), "instance-a".into());
    store
        .record("locked", &slow, Event::Lockout(lock), None)
        .await
        .unwrap();
    lose_row_on_a_new_server(&store, "locked").await;
    let after = take(&store, "locked", &slow, None).await;
    assert!(
        matches!(after, Err(ReserveError::Locked(_))),
        "the lockout: {after:?}"
    );
}

/// A server that does not grant `pg_control_system()` (some managed services do not) is paced
/// on all the same, and told apart by its timeline alone.
#[tokio::test]
async fn a_server_that_keeps_its_identifier_to_itself_is_still_paced_on() {
    let cluster = Cluster::start().unwrap();
    for sql in [
        "CREATE ROLE plain LOGIN",
        "GRANT CREATE ON SCHEMA public TO plain",
        "REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC",
    ] {
        cluster.psql(sql).unwrap();
    }
    let url = format!("postgres://plain@127.0.0.1:{}/postgres", cluster.port);
    let store = PostgresStore::new(&url, 2).unwrap();
    store.migrate().await.unwrap();
    take(&store, "d", &rule(10.0), None).await.unwrap();
    let server = store.reassert.server.lock().await.clone();
    assert_eq!(
        server.as_deref(),
        Some("00000001"),
        "the server as told apart"
    );
}

/// What this instance knows of a budget is one record, fed by the store's answers: the local
/// fallback (the store lost) and the re-assertion (a new server) both read it. A lockout
/// written through the failover reaches both: a new server that lost its row gets it back,
/// and a local budget paced on once the store is gone starts with it.
#[tokio::test]
async fn the_fallback_and_the_reassertion_read_one_record() {
    let url = super::super::testdb::fresh().await;
    let store = PostgresStore::new(&url, 2).unwrap();
    store.migrate().await.unwrap();
    let control = PostgresStore::new(&url, 1).unwrap();
    let failover = Failover::new(
        store,
        control,
        MemoryStore::ephemeral(),
        Instance::new(),
        Policy {
            on_unavailable: OnUnavailable::Refuse,
            instances_hint: 1,
            divide_for: Duration::from_secs(30),
            timeout: Duration::from_secs(5),
            hold_back: true,
        },
        Gauges::unregistered(),
    );
    let slow = rule(0.5);
    let lock = Lockout::new(403, "GET https://locked/x".into(), "instance-a".into());
    failover
        .record("locked", &slow, Event::Lockout(lock), None)
        .await
        .unwrap();

    // A new server that lost the row.
    let store = failover.primary();
    lose_row_on_a_new_server(store, "locked").await;
    let reasserted = take(store, "locked", &slow, None).await;

    // The store lost: this instance paces on its own (here: refuses, saying why).
    failover.lost(&StoreError::Unreachable("connection refused".into()));
    let alone = take(&failover, "locked", &slow, None).await;

    assert!(
        matches!(reasserted, Err(ReserveError::Locked(_))),
        "the new server after the re-assertion: {reasserted:?}"
    );
    assert!(
        matches!(alone, Err(ReserveError::Locked(_))),
        "the local fallback: {alone:?}"
    );
}
