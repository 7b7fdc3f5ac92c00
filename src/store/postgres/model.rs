//! The model test (`budget::model`) on the postgres store: the SQL under test is the
//! production SQL, unchanged.
//!
//! The database's clock is replaced for the test: the store's connection puts a schema of the
//! test's own first on its `search_path`, whose `clock_timestamp()` reads the instant the test
//! set.

use super::*;
use crate::budget::model::{self, Modelled, Row, T0_US};

const SQL_ROW: &str = "SELECT
        CASE WHEN isfinite(next_at) THEN (extract(epoch FROM next_at) * 1000000)::bigint - $2 END,
        CASE WHEN isfinite(paused_until) THEN (extract(epoch FROM paused_until) * 1000000)::bigint - $2 END,
        backoff, generation, clean_streak, lock_status IS NOT NULL, paused_by, block_streak,
        vendor_remaining, vendor_taken,
        (extract(epoch FROM vendor_observed) * 1000000)::bigint - $2,
        (extract(epoch FROM vendor_reset) * 1000000)::bigint - $2,
        vendor_reset > (SELECT t FROM fakeclock.now_t)
    FROM pacegate_budgets WHERE destination = $1";

/// The test's own database: the schema migrated, and a clock the test sets.
struct Db {
    store: PostgresStore,
    control: tokio_postgres::Client,
}

impl Db {
    async fn open() -> Self {
        let url = testdb::fresh().await;
        PostgresStore::new(&url, 1)
            .unwrap()
            .migrate()
            .await
            .unwrap();
        let (control, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        control
            .batch_execute(
                "CREATE SCHEMA fakeclock;
                 CREATE TABLE fakeclock.now_t (t timestamptz NOT NULL);
                 INSERT INTO fakeclock.now_t VALUES (now());
                 CREATE FUNCTION fakeclock.clock_timestamp() RETURNS timestamptz
                     LANGUAGE sql VOLATILE AS 'SELECT t FROM fakeclock.now_t';",
            )
            .await
            .unwrap();
        let clocked = format!("{url}?options=-c%20search_path%3Dfakeclock%2Cpublic%2Cpg_catalog");
        let store = PostgresStore::new(&clocked, 1)
            .unwrap()
            .with_instance("model")
            .without_lead();
        Self { store, control }
    }
}

#[async_trait::async_trait]
impl Modelled for Db {
    fn store(&self) -> &dyn Store {
        &self.store
    }

    async fn set_now(&self, now: Duration) {
        let us = T0_US + now.as_micros() as i64;
        self.control
            .execute(
                "UPDATE fakeclock.now_t SET t = to_timestamp($1::float8 / 1000000)",
                &[&(us as f64)],
            )
            .await
            .unwrap();
        // to_timestamp goes through float8: check that it landed on the µs.
        let back: i64 = self
            .control
            .query_one(
                "SELECT (extract(epoch FROM t) * 1000000)::bigint FROM fakeclock.now_t",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(back, us, "the fake clock is exact");
    }

    async fn row(&self, destination: &str, _now: Duration) -> Option<Row> {
        self.control
            .query_opt(SQL_ROW, &[&destination, &T0_US])
            .await
            .unwrap()
            .map(|r| Row {
                beat: (r.get(0), r.get(1), r.get(3), r.get(4), r.get(5)),
                backoff: r.get(2),
                paused_by: r.get(6),
                block_streak: r.get(7),
                vendor: r
                    .get::<_, Option<bool>>(12)
                    .unwrap_or(false)
                    .then(|| (r.get(8), r.get(9), r.get(10), r.get(11))),
            })
    }
}

#[test]
fn the_sql_computes_what_the_schedule_computes() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // One database for every case, each on a destination of its own.
    let db = std::sync::Arc::new(rt.block_on(Db::open()));
    model::check_store(&rt, |case| (db.clone(), format!("d{case}")));
}
