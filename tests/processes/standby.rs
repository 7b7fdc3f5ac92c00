//! A store with a streaming standby, as operators run it: a multi-host URL with
//! `target_session_attrs=read-write` takes pacegate past the standby to the primary, and a
//! standby that answers is never paced from: its refusal is an error, never a slot.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use pacegate::budget::{Ask, ClassQueue, Rule, Store};
use pacegate::class::Class;
use pacegate::store::postgres::PostgresStore;
use support::fleet::{alone, Fleet};
use support::pg::Cluster;
use support::{status_of, FakeUpstream};
use tokio::time::Instant;

fn store(url: &str) -> String {
    format!("[store]\nbackend = \"postgres\"\nurl = \"{url}\"\n")
}

/// The rows of `pacegate_budgets` for `destination` on `cluster`'s `postgres` database.
async fn budget_rows(cluster: &Cluster, destination: &str) -> i64 {
    let (client, conn) = tokio_postgres::connect(&cluster.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .query_one(
            "SELECT count(*) FROM pacegate_budgets WHERE destination = $1",
            &[&destination],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_host_url_passes_the_standby_and_paces_on_the_primary() {
    let _alone = alone().await;
    let primary = Cluster::start();
    let standby = Cluster::standby_of(&primary);
    let upstream = FakeUpstream::start().await;
    // The standby first: a client that took the first host that answers would land on it.
    let url = format!(
        "postgres://pacegate@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        standby.port(),
        primary.port()
    );
    let fleet = Fleet::start_n(1, &store(&url), "rate = 20").await;
    let target = format!("{}/fine", upstream.http_url("localhost"));
    assert_eq!(status_of(&fleet.client(0), &target).await, 200);
    assert_eq!(budget_rows(&primary, "local").await, 1);
    assert_eq!(fleet.errors(), vec![0], "store errors");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_a_standby_reached_without_read_write_refuses_every_slot() {
    let _alone = alone().await;
    let primary = Cluster::start();
    let on_primary = PostgresStore::new(&primary.url(), 2).unwrap();
    on_primary.migrate().await.unwrap();
    let standby = Cluster::standby_of(&primary);
    // The schema came over with the base backup, but nothing is written there: neither a
    // migration...
    let on_standby = PostgresStore::new(&standby.url(), 2).unwrap();
    let err = format!(
        "{:?}",
        on_standby.migrate().await.expect_err("migrated a standby")
    );
    assert!(err.contains("read-only"), "{err}");
    let rule = Rule {
        interval: Duration::from_millis(50),
        cost: 1,
        metered: false,
        burst: 1,
        backoff_factor: 2.0,
        backoff_max: 64.0,
        decay_after: 100,
        retry_after_max: Duration::from_secs(3600),
        shares: Arc::from(vec![0.0]),
        quota: Vec::new(),
        window: None,
        largest: 0,
        reserve: 0,
        vendor_pace: pacegate::destination::VendorPace::Burst,
        block: None,
    };
    let queue = [ClassQueue {
        class: Class(0),
        count: 1,
        oldest: Instant::now(),
        next: None,
    }];
    let ask = Ask {
        queues: &queue,
        not_after: Some(Instant::now() + Duration::from_secs(5)),
        most: 1,
        cost: 1,
    };
    // ...nor a slot.
    let refused = on_standby.reserve("local", &rule, ask).await;
    let Err(err) = refused else {
        panic!("a standby granted a slot");
    };
    let err = format!("{err:?}");
    assert!(err.contains("read-only"), "{err}");
    assert_eq!(budget_rows(&primary, "local").await, 0);
}
