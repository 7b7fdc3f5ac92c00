//! The postgres store against a fresh database per test.

use super::*;
use crate::budget::contract;
use crate::fleet::{Membership, Report, Written, QUIET_AFTER};

async fn store() -> PostgresStore {
    let store = PostgresStore::new(&testdb::fresh().await, 8).unwrap();
    assert_eq!(
        store.migrate().await.unwrap(),
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    );
    store
}

fn instance(id: &str) -> Instance {
    Instance {
        id: id.into(),
        host: "test".into(),
        pid: 1,
        version: "0".into(),
    }
}

const REPORT: Report = Report {
    divisor: 2,
    alone_for: Duration::from_secs(60),
};

/// Two live instances on one fresh store.
async fn pair() -> (PostgresStore, PostgresStore) {
    let url = testdb::fresh().await;
    let a = PostgresStore::new(&url, 4).unwrap().with_instance("a");
    a.migrate().await.unwrap();
    let b = PostgresStore::new(&url, 4).unwrap().with_instance("b");
    a.heartbeat(&instance("a"), REPORT).await.unwrap();
    b.heartbeat(&instance("b"), REPORT).await.unwrap();
    (a, b)
}

#[tokio::test]
async fn passes_the_store_contract() {
    contract::run_all(store, Duration::from_millis(2)).await;
    contract::run_shared(pair).await;
}

#[tokio::test]
async fn an_unchanged_wait_list_is_not_rewritten() {
    let (a, _b) = pair().await;
    let r = contract::rule(100.0);
    let three = [contract::waiting(contract::BACKFILL, 3, 100)];
    assert_eq!(
        contract::ask(&a, &r, &three).await.unwrap(),
        contract::BACKFILL
    );
    // What the pacer hands over next: two left, the second oldest now the oldest.
    let two = [ClassQueue {
        count: 2,
        oldest: three[0].next.unwrap(),
        ..three[0]
    }];
    // Rows changed behind the store's back show whether it wrote them again.
    let db = a.client().await.unwrap();
    db.execute("UPDATE pacegate_waiting SET count = 10", &[])
        .await
        .unwrap();
    assert_eq!(
        contract::ask(&a, &r, &two).await.unwrap(),
        contract::BACKFILL
    );
    let left = contract::waiting_in(&a, "d").await;
    assert_eq!((left[0].0, left[0].1), (contract::BACKFILL, 9), "{left:?}");
    // A list that changed is written.
    let five = [contract::waiting(contract::BACKFILL, 5, 50)];
    assert_eq!(
        contract::ask(&a, &r, &five).await.unwrap(),
        contract::BACKFILL
    );
    let left = contract::waiting_in(&a, "d").await;
    assert_eq!((left[0].0, left[0].1), (contract::BACKFILL, 4), "{left:?}");
    // So is one told without a reservation, and an unchanged one is not.
    a.wait_list("d", &five).await.unwrap();
    db.execute("UPDATE pacegate_waiting SET count = 10", &[])
        .await
        .unwrap();
    a.wait_list("d", &five).await.unwrap();
    assert_eq!(contract::waiting_in(&a, "d").await[0].1, 10);
}

#[tokio::test]
async fn after_a_yield_the_wait_list_is_told_again() {
    let (a, b) = pair().await;
    let r = contract::rule(100.0);
    let backfill = [contract::waiting(contract::BACKFILL, 2, 100)];
    b.wait_list("d", &[contract::waiting(Class(0), 1, 10)])
        .await
        .unwrap();
    assert!(matches!(
        contract::ask(&a, &r, &backfill).await,
        Err(ReserveError::Yield(_))
    ));
    // a's rows vanish (a lease that ran out while it stalled), and b's request leaves.
    a.client()
        .await
        .unwrap()
        .execute("DELETE FROM pacegate_waiting", &[])
        .await
        .unwrap();
    b.wait_list("d", &[]).await.unwrap();
    assert_eq!(
        contract::ask(&a, &r, &backfill).await.unwrap(),
        contract::BACKFILL
    );
}

#[tokio::test]
async fn waiters_keep_their_place_only_while_their_instance_keeps_asking() {
    let (a, b) = pair().await;
    let r = contract::rule(100.0);
    let older = [contract::waiting(contract::BACKFILL, 3, 1000)];
    let newer = [contract::waiting(contract::BACKFILL, 3, 10)];
    assert_eq!(
        contract::ask(&a, &r, &older).await.unwrap(),
        contract::BACKFILL
    );
    assert!(
        matches!(
            contract::ask(&b, &r, &newer).await,
            Err(ReserveError::Yield(_))
        ),
        "a's older request goes first while a asks"
    );
    // a stops asking (cut off from the database, its heartbeat still fresh): within half a
    // second of its slot its requests no longer hold b's back.
    tokio::time::sleep(Duration::from_millis(600)).await;
    b.heartbeat(&instance("b"), REPORT).await.unwrap();
    assert_eq!(
        contract::ask(&b, &r, &newer).await.unwrap(),
        contract::BACKFILL
    );
    // Asking again, a has its place back.
    let left = [contract::waiting(contract::BACKFILL, 2, 1000)];
    assert_eq!(
        contract::ask(&a, &r, &left).await.unwrap(),
        contract::BACKFILL
    );
    let newer = [contract::waiting(contract::BACKFILL, 3, 10)];
    assert!(matches!(
        contract::ask(&b, &r, &newer).await,
        Err(ReserveError::Yield(_))
    ));
}

#[tokio::test]
async fn wait_lists_count_only_while_their_lease_runs() {
    let (a, b) = pair().await;
    let r = contract::rule(100.0);
    let interactive = [contract::waiting(Class(0), 5, 1000)];
    let backfill = [contract::waiting(Class(2), 5, 1000)];
    let ask = |queues| Ask {
        queues,
        not_after: None,
        most: 1,
        cost: 1,
    };
    a.wait_list("d", &interactive).await.unwrap();
    let control = a.client().await.unwrap();
    // a's requests keep their claim throughout (it would ask again meanwhile): only the lease
    // is under test here.
    control
        .execute(
            "UPDATE pacegate_waiting SET claimed_until = clock_timestamp() + interval '1 minute' WHERE instance = 'a'",
            &[],
        )
        .await
        .unwrap();
    let lapse = || {
        control.execute(
            "UPDATE pacegate_waiting SET live_until = clock_timestamp() - interval '1 millisecond' WHERE instance = 'a'",
            &[],
        )
    };
    assert!(matches!(
        b.reserve("d", &r, ask(&backfill)).await,
        Err(ReserveError::Yield(_))
    ));
    // Renewed once a heartbeat, a lease that was about to lapse runs again.
    lapse().await.unwrap();
    a.keep_waiting().await.unwrap();
    assert!(matches!(
        b.reserve("d", &r, ask(&backfill)).await,
        Err(ReserveError::Yield(_))
    ));
    assert_eq!(contract::waiting_in(&b, "d").await[0].0, Class(0));
    // Not renewed, it no longer counts, whatever the instances' table says.
    lapse().await.unwrap();
    assert_eq!(
        b.reserve("d", &r, ask(&backfill)).await.unwrap().class,
        Class(2)
    );
    assert_eq!(contract::waiting_in(&b, "d").await[0].0, Class(2));
    // Its rows are dropped at the next renewal of anyone's.
    b.keep_waiting().await.unwrap();
    let left: i64 = control
        .query_one(
            "SELECT count(*) FROM pacegate_waiting WHERE instance = 'a'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
    // A clean shutdown drops an instance's own.
    b.forget_waiting().await.unwrap();
    assert!(contract::waiting_in(&b, "d").await.is_empty());
}

#[tokio::test]
async fn a_heartbeat_answers_the_others_with_their_age_and_report() {
    let (a, b) = pair().await;
    let three = Report {
        divisor: 3,
        alone_for: Duration::from_millis(1500),
    };
    let peers = b.heartbeat(&instance("b"), three).await.unwrap();
    assert_eq!(peers.len(), 1, "{peers:?}");
    // Heard just now: one of a group of those that reported the same.
    assert_eq!((peers[0].instances, peers[0].report), (1, REPORT));
    assert!(peers[0].age < Duration::from_secs(1), "{peers:?}");
    // A stale heartbeat reads as old as it is, by the store's clock.
    a.client()
        .await
        .unwrap()
        .execute(
            "UPDATE pacegate_instances SET last_seen = last_seen - interval '10 seconds' WHERE id = 'b'",
            &[],
        )
        .await
        .unwrap();
    let peers = a.heartbeat(&instance("a"), REPORT).await.unwrap();
    // Quiet: one by one, by name.
    assert_eq!(
        (peers[0].id.as_str(), peers[0].instances, peers[0].report),
        ("b", 1, three)
    );
    assert!(
        (10.0..11.0).contains(&peers[0].age.as_secs_f64()),
        "{peers:?}"
    );
}

#[tokio::test]
async fn a_heartbeat_answers_a_fleet_at_work_in_one_row_a_report_and_the_quiet_one_by_one() {
    let store = store().await;
    let counting = |divisor| Report {
        divisor,
        alone_for: Duration::from_secs(10),
    };
    // Fifty instances: forty counting 50, seven still counting 49, three gone quiet.
    for i in 0..50 {
        let report = counting(if (40..47).contains(&i) { 49 } else { 50 });
        store
            .heartbeat(&instance(&format!("i{i:02}")), report)
            .await
            .unwrap();
    }
    store
        .client()
        .await
        .unwrap()
        .execute(
            "UPDATE pacegate_instances SET last_seen = last_seen - interval '4 seconds',
                lease_until = lease_until - interval '4 seconds' WHERE id >= 'i47'",
            &[],
        )
        .await
        .unwrap();
    let mut peers = store
        .heartbeat(&instance("i00"), counting(50))
        .await
        .unwrap();
    peers.sort_by_key(|p| (p.instances, p.id.clone()));
    let seen: Vec<(String, u32, u32)> = peers
        .iter()
        .map(|p| (p.id.clone(), p.instances, p.report.divisor))
        .collect();
    assert_eq!(
        seen,
        [
            ("i47".to_string(), 1, 50),
            ("i48".to_string(), 1, 50),
            ("i49".to_string(), 1, 50),
            ("7 instances counting 49".to_string(), 7, 49),
            ("39 instances counting 50".to_string(), 39, 50),
        ]
    );
    for p in &peers[..3] {
        assert!(p.age >= Duration::from_secs(4), "{p:?}");
        assert!(
            p.lease < counting(50).lease() - Duration::from_secs(3),
            "{p:?}"
        );
    }
    let group = &peers[4];
    assert!(group.age < QUIET_AFTER, "{group:?}");
    assert!(
        group.lease > counting(50).lease() - Duration::from_secs(2),
        "{group:?}"
    );
}

#[tokio::test]
async fn migrations_apply_once_and_concurrently() {
    let url = testdb::fresh().await;
    let stores: Vec<_> = (0..10)
        .map(|_| PostgresStore::new(&url, 2).unwrap())
        .collect();
    let results = futures_util::future::join_all(stores.iter().map(|s| s.migrate())).await;
    let applied: Vec<Vec<i32>> = results.into_iter().map(Result::unwrap).collect();
    assert_eq!(
        applied.iter().filter(|a| !a.is_empty()).count(),
        1,
        "{applied:?}"
    );
    stores[0].check_schema().await.unwrap();
}

#[test]
fn every_function_is_defined_once_and_only_in_functions_sql() {
    let defines = |sql: &str| {
        sql.matches("CREATE OR REPLACE FUNCTION").count() + sql.matches("CREATE FUNCTION").count()
    };
    for (version, name, sql) in migrations::MIGRATIONS {
        assert_eq!(
            defines(sql),
            0,
            "migration {version} ({name}) defines a function"
        );
    }
    let functions = include_str!("../../../migrations/functions.sql");
    let mut names: Vec<&str> = functions
        .split("CREATE OR REPLACE FUNCTION ")
        .skip(1)
        .map(|rest| rest.split('(').next().unwrap_or_default())
        .collect();
    let n = names.len();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), n, "a function defined twice: {names:?}");
    assert_eq!(
        defines(functions),
        n,
        "every definition is CREATE OR REPLACE"
    );
}

#[tokio::test]
async fn functions_that_differ_are_re_applied_and_old_ones_dropped() {
    let store = store().await;
    let client = store.client().await.unwrap();
    // The database as an older binary left it: another digest, another body of a function
    // this binary calls, and an overload of two releases back.
    client
        .batch_execute(
            "UPDATE pacegate_schema_functions SET digest = 'older';
             CREATE OR REPLACE FUNCTION pacegate_pause_secs(
                 p_secs double precision, p_at timestamptz, now_ts timestamptz,
                 p_max double precision)
             RETURNS double precision LANGUAGE sql IMMUTABLE AS $$ SELECT -1.0::double precision $$;
             CREATE FUNCTION pacegate_reserve(text, double precision, integer, double precision)
             RETURNS integer LANGUAGE sql AS $$ SELECT 0 $$;",
        )
        .await
        .unwrap();
    let err = store.check_schema().await.unwrap_err();
    assert!(err.to_string().contains("not this binary's"), "{err}");
    assert_eq!(
        store.migrate().await.unwrap(),
        Vec::<i32>::new(),
        "no numbered migration is new"
    );
    store.check_schema().await.unwrap();
    let pause: f64 = client
        .query_one(
            "SELECT pacegate_pause_secs(5, NULL, clock_timestamp(), 60)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(pause, 5.0, "this binary's function is back");
    let old: Option<String> = client
        .query_one(
            "SELECT to_regprocedure('pacegate_reserve(text, double precision, integer, double precision)')::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(old, None, "the overload of two releases back is dropped");
}

#[tokio::test]
async fn a_newer_schema_is_refused() {
    let store = store().await;
    let client = store.client().await.unwrap();
    client
        .execute(
            "INSERT INTO pacegate_schema_migrations (version, name) VALUES (999, 'future')",
            &[],
        )
        .await
        .unwrap();
    drop(client);
    let err = store.migrate().await.unwrap_err();
    assert!(
        err.to_string().contains("newer than this pacegate binary"),
        "{err}"
    );
    assert!(store.check_schema().await.is_err());
}

#[tokio::test]
async fn heartbeats_count_live_instances() {
    let store = store().await;
    let me = |n: i32| Instance {
        id: format!("host/{n}/x"),
        host: "host".into(),
        pid: n,
        version: "test".into(),
    };
    store.heartbeat(&me(1), REPORT).await.unwrap();
    store.heartbeat(&me(2), REPORT).await.unwrap();
    store.heartbeat(&me(1), REPORT).await.unwrap();
    let live = store.live_instances(Duration::from_secs(5)).await.unwrap();
    assert_eq!(live.iter().map(|i| i.pid).collect::<Vec<_>>(), [1, 2]);
    store.forget(&me(2)).await.unwrap();
    assert_eq!(
        store
            .live_instances(Duration::from_secs(5))
            .await
            .unwrap()
            .len(),
        1
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        store
            .live_instances(Duration::from_millis(200))
            .await
            .unwrap()
            .is_empty(),
        "a silent instance leaves the count"
    );
}

#[tokio::test]
async fn a_heartbeat_stamps_a_lease_and_deletes_the_rows_whose_lease_ran_out() {
    let store = store().await;
    store.heartbeat(&instance("one"), REPORT).await.unwrap();
    let rule = [Written {
        destination: "d".into(),
        fingerprint: "f".into(),
        rule: "{}".into(),
    }];
    store
        .compare_rules(&instance("one"), &rule, true)
        .await
        .unwrap();
    // The lease runs REPORT.lease() from the stamp, on the store's clock.
    let peers = store.heartbeat(&instance("two"), REPORT).await.unwrap();
    let lease = peers[0].lease;
    assert!(
        lease <= REPORT.lease() && lease > REPORT.lease() - Duration::from_secs(1),
        "{lease:?} of a {:?} lease",
        REPORT.lease()
    );
    let db = store.client().await.unwrap();
    let rows = |sql: &'static str| {
        let db = &db;
        async move { db.one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    // Instance 1's lease ran out a while ago (it was killed): the next heartbeat of any
    // instance deletes its row and its rules.
    db.execute(
        "UPDATE pacegate_instances SET lease_until = clock_timestamp() - interval '10 seconds' WHERE id = 'one'",
        &[],
    )
    .await
    .unwrap();
    let peers = store.heartbeat(&instance("two"), REPORT).await.unwrap();
    assert!(peers.is_empty(), "{peers:?}");
    assert_eq!(rows("SELECT count(*) FROM pacegate_instances").await, 1);
    assert_eq!(rows("SELECT count(*) FROM pacegate_rules").await, 0);
    // A lease that ran out only just now is still read (as nothing left), not deleted yet.
    db.execute(
        "UPDATE pacegate_instances SET lease_until = clock_timestamp() WHERE id = 'two'",
        &[],
    )
    .await
    .unwrap();
    let peers = store.heartbeat(&instance("three"), REPORT).await.unwrap();
    assert_eq!(peers.len(), 1);
    assert_eq!(peers[0].lease, Duration::ZERO);
}

#[tokio::test]
async fn a_row_lost_where_this_instance_paced_starts_after_what_it_may_still_hold() {
    let url = testdb::fresh().await;
    let store = PostgresStore::new(&url, 2).unwrap();
    store.migrate().await.unwrap();
    let rule = contract::rule(10.0);
    // "d": one slot taken here; "e": slots held here up to 1.5 s ahead.
    contract::take(&store, "d", &rule, None).await.unwrap();
    let mut last = contract::take(&store, "e", &rule, None).await.unwrap();
    for _ in 0..15 {
        last = contract::take(&store, "e", &rule, None).await.unwrap();
    }
    let db = store.client().await.unwrap();
    db.execute("TRUNCATE pacegate_budgets", &[]).await.unwrap();
    let now = Instant::now();
    let d = contract::take(&store, "d", &rule, None).await.unwrap();
    let e = contract::take(&store, "e", &rule, None).await.unwrap();
    // Not before the hold, for what other instances may hold.
    let hold = d.at.saturating_duration_since(now);
    let ms = Duration::from_millis;
    assert!(
        hold >= LOST_ROW_HOLD - ms(5) && hold < LOST_ROW_HOLD + ms(150),
        "{hold:?}"
    );
    // And after what this instance holds.
    assert!(
        e.at >= last.at + rule.interval - ms(5) && e.at < last.at + ms(300),
        "{:?} against the last slot held, {:?}",
        e.at,
        last.at
    );
    // A budget never paced here, its row missing, is new: it starts now.
    let elsewhere = PostgresStore::new(&url, 2).unwrap();
    db.execute("TRUNCATE pacegate_budgets", &[]).await.unwrap();
    let now = Instant::now();
    let slot = contract::take(&elsewhere, "d", &rule, None).await.unwrap();
    assert!(slot.at.saturating_duration_since(now) < ms(50));
}

#[tokio::test]
async fn a_long_block_streak_stays_at_the_cap() {
    // An hour's block doubled 40 times is far past what a bigint of µs holds.
    let store = store().await;
    let rule = Rule {
        block: Some(crate::destination::Block {
            min: Duration::from_secs(3600),
            max: Duration::from_secs(7200),
            jitter: 0.0,
        }),
        ..contract::rule(10.0)
    };
    store.view("d").await.unwrap();
    contract::take(&store, "d", &rule, None).await.unwrap();
    store
        .client()
        .await
        .unwrap()
        .execute("UPDATE pacegate_budgets SET block_streak = 45", &[])
        .await
        .unwrap();
    let throttle = Event::Throttled {
        generation: 0,
        retry_after: None,
        reset: None,
        spread: 0.0,
    };
    let view = store.record("d", &rule, throttle, None).await.unwrap();
    assert_eq!(view.block_streak, 46);
    assert!(view.paused_for > Duration::from_secs(7199), "{view:?}");
    assert!(view.paused_for <= Duration::from_secs(7200), "{view:?}");
}

#[tokio::test]
async fn slots_are_placed_by_a_probe_of_the_database_clock() {
    let url = testdb::fresh().await;
    let rule = contract::rule(1000.0);
    let first = PostgresStore::new(&url, 1).unwrap();
    first.migrate().await.unwrap();
    // The destination's row exists, so that the reservation is one statement.
    contract::take(&first, "d", &rule, None).await.unwrap();
    // Past the interval, so that the next slot is "now".
    tokio::time::sleep(Duration::from_millis(5)).await;
    let store = PostgresStore::new(&url, 1).unwrap();
    let before = store.statements();
    let sent = Instant::now();
    let slot = contract::take(&store, "d", &rule, None).await.unwrap();
    let round_trip = sent.elapsed();
    // The clock was unknown: a read-only probe went first, then the one-statement
    // reservation, whose own span (its round trip, with the commit's log flush) can only
    // narrow what the probe found.
    assert_eq!(store.statements() - before, 2);
    assert!(
        slot.unseen_late <= round_trip,
        "{:?} unseen in a {round_trip:?} round trip",
        slot.unseen_late
    );
    // The slot is "now" on the database clock plus the lead the probe taught (its way
    // back): placed no earlier than the reservation was sent, and about when its answer came.
    assert!(slot.at >= sent);
    let lead = store.clock.lead();
    assert!(
        lead <= round_trip,
        "a lead of {lead:?} after a {round_trip:?} round trip"
    );
    assert!(slot.at <= sent + round_trip + lead);
}
