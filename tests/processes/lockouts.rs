//! Lockouts and unlocks travel with the heartbeat, across real processes on one Postgres: an
//! instance that loses the store paces from what every instance last knew, and a lockout
//! whose write is held up halts its destination at once and reaches every instance once
//! written.

use crate::support;

use std::time::Duration;

use support::fleet::{beside, Fleet};
use support::pg::Cluster;
use support::{eventually, testdb, FakeUpstream};

/// The status a GET of `path` through instance `i` gets.
async fn status_via(fleet: &Fleet, i: usize, upstream: &FakeUpstream, path: &str) -> u16 {
    fleet
        .client(i)
        .get(format!("{}{path}", upstream.http_url("localhost")))
        .send()
        .await
        .map_or(0, |r| r.status().as_u16())
}

/// Whether instance `i` refuses the destination as locked out.
async fn locked_via(fleet: &Fleet, i: usize, upstream: &FakeUpstream) -> bool {
    let resp = fleet
        .client(i)
        .get(format!("{}/status/200", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    resp.status() == 403
        && resp
            .headers()
            .get("proxy-status")
            .is_some_and(|v| v.to_str().unwrap_or("").contains("locked out"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlock_on_one_instance_reaches_the_other_before_the_store_goes() {
    let _beside = beside().await;
    let cluster = Cluster::start();
    let upstream = FakeUpstream::start().await;
    let store = format!(
        "[store]\nbackend = \"postgres\"\nurl = \"{}\"\non_unavailable = \"divide\"\n",
        cluster.url()
    );
    let fleet = Fleet::start_n(2, &store, "rate = 20").await;
    fleet.see_live(2).await;
    // A plain 403 through instance 0 locks the destination; instance 1 meets the lockout.
    assert_eq!(status_via(&fleet, 0, &upstream, "/status/403").await, 403);
    eventually(
        Duration::from_secs(5),
        "instance 1 refuses as locked",
        || async { locked_via(&fleet, 1, &upstream).await.then_some(()) },
    )
    .await;
    // Cleared through instance 0; the database stops 2 s later.
    assert_eq!(fleet.unlock(0).await, 200);
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.down();
    // Instance 1 never sent a request after the unlock; pacing alone, it serves.
    eventually(
        Duration::from_secs(20),
        "instance 1 serving while it paces alone",
        || async { (status_via(&fleet, 1, &upstream, "/status/200").await == 200).then_some(()) },
    )
    .await;
    assert_eq!(
        fleet.metric(1, "pacegate_store_degraded").await,
        1.0,
        "it was pacing alone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockout_taken_while_its_row_is_held_halts_every_instance() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let url = testdb::fresh().await;
    let store = format!("[store]\nbackend = \"postgres\"\nurl = \"{url}\"\n");
    let fleet = Fleet::start_n(2, &store, "rate = 20").await;
    fleet.see_live(2).await;
    // A request whose 403 comes back a second after it was sent...
    let lockout = {
        let client = fleet.client(0);
        let url = format!("{}/status/403?delay=1000", upstream.http_url("localhost"));
        tokio::spawn(async move { client.get(url).send().await.unwrap().status().as_u16() })
    };
    eventually(Duration::from_secs(5), "the request upstream", || async {
        (!upstream.recorded().is_empty()).then_some(())
    })
    .await;
    // ...while another connection holds the destination's row for 4 s.
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let held = tokio::spawn(async move {
        db.batch_execute(
            "BEGIN; SELECT 1 FROM pacegate_budgets WHERE destination = 'local' FOR UPDATE; SELECT pg_sleep(4); COMMIT",
        )
        .await
    });
    assert_eq!(lockout.await.unwrap(), 403);
    // Instance 0 halts the destination at once, before its write can land.
    assert!(
        locked_via(&fleet, 0, &upstream).await,
        "instance 0 still forwards to a destination it saw locked out"
    );
    held.await.unwrap().unwrap();
    // Written once the row is free, the lockout halts instance 1 too.
    eventually(
        Duration::from_secs(10),
        "instance 1 refuses as locked",
        || async { locked_via(&fleet, 1, &upstream).await.then_some(()) },
    )
    .await;
    let sent = upstream
        .recorded()
        .iter()
        .filter(|r| r.path.starts_with("/status/200"))
        .count();
    assert_eq!(sent, 0, "nothing reached the locked destination");
}
