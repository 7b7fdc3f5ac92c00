//! The store behind PgBouncer in transaction mode, as operators run it: two `pacegate serve`
//! instances with `[store] statements = "unnamed"` reach Postgres only through the pooler,
//! which holds fewer server connections than they open, and keep one ceiling, one backoff and
//! one lockout. The control shows that the pooler does what makes this hard: a
//! statement prepared under a name on one server connection is gone on the next.

use crate::support;

use std::time::Duration;

use support::bouncer::Bouncer;
use support::fleet::{alone, Fleet};
use support::{busiest, status_of, FakeUpstream};

const RATE: f64 = 20.0;

fn store(url: &str, statements: &str) -> String {
    format!(
        "[store]\nbackend = \"postgres\"\nurl = \"{url}\"\nconnections = 4\nstatements = \"{statements}\"\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_pgbouncer_in_transaction_mode_two_instances_keep_one_ceiling_backoff_and_lockout()
{
    let _alone = alone().await;
    // Two server connections for the 8 client connections the two instances may open.
    let bouncer = Bouncer::start(2).await;
    let upstream = FakeUpstream::start().await;
    let url = |p: &str| format!("{}/{p}", upstream.http_url("localhost"));
    // Migrations, heartbeats and every reservation go through the pooler.
    let fleet = Fleet::start_n(
        2,
        &store(&bouncer.fresh().await, "unnamed"),
        &format!("rate = {RATE}\nretry_throttled = 0"),
    )
    .await;

    // One ceiling: 80 requests at once, 4 s of slots.
    let at = fleet.load(&upstream, 40).await;
    let most = busiest(&at, Duration::from_secs(1));
    assert!(
        most <= RATE as usize + 1,
        "{most} requests reached the upstream within one second at rate {RATE}; {}\npgbouncer: {}",
        fleet.explain(&upstream),
        bouncer.log()
    );
    let achieved = (at.len() - 1) as f64 / (*at.last().unwrap() - at[0]).as_secs_f64();
    assert!(
        achieved >= 0.9 * RATE,
        "achieved only {achieved:.2}/s; {}",
        fleet.explain(&upstream)
    );
    assert_eq!(fleet.errors(), vec![0, 0], "store errors per instance");

    // One backoff: a 429 seen by instance 0 widens instance 1's interval.
    assert_eq!(status_of(&fleet.client(0), url("status/429")).await, 429);
    assert_eq!(fleet.status(1).await["backoff"], 2.0);

    // One lockout: a 403 seen by instance 1 refuses instance 0's next request.
    assert_eq!(status_of(&fleet.client(1), url("status/403")).await, 403);
    let before = upstream.recorded().len();
    let refused = fleet.client(0).get(url("fine")).send().await.unwrap();
    assert_eq!(refused.status(), 403);
    assert!(refused.headers()["proxy-status"]
        .to_str()
        .unwrap()
        .contains("locked out"));
    assert_eq!(
        upstream.recorded().len(),
        before,
        "the lockout let one through"
    );
    // And one unlock, through the other instance.
    assert_eq!(fleet.unlock(1).await, 200);
    assert_eq!(status_of(&fleet.client(0), url("again")).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_a_named_statement_does_not_survive_the_pooler() {
    let _alone = alone().await;
    let bouncer = Bouncer::start(2).await;
    let url = bouncer.fresh().await;
    let connect = || async {
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        client
    };
    let (a, mut b) = (connect().await, connect().await);
    // Client a prepares a named statement on the first server connection...
    let statement = a.prepare("SELECT 1").await.unwrap();
    // ...which client b then holds in a transaction, so a's next statement runs on another.
    let held = b.transaction().await.unwrap();
    held.execute("SELECT 2", &[]).await.unwrap();
    let err = a
        .query(&statement, &[])
        .await
        .expect_err("a named statement ran on a server connection that never prepared it");
    let err = format!("{:?}", err.as_db_error().map(|e| e.message()));
    assert!(err.contains("prepared statement"), "{err}");
    // The same statement unnamed, with its types, runs on whichever connection it gets.
    let row = a.query_typed_one("SELECT 1", &[]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 1);
    held.rollback().await.unwrap();
}
