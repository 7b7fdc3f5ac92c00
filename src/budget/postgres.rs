//! The shared store: one Postgres row per destination holds the whole budget, so every
//! instance on every host that points at the same database shares one ceiling.
//!
//! Each operation is one statement calling a function from `migrations/` (`pacegate_reserve`,
//! `pacegate_record`), run on an autocommit pooled connection that is returned before the
//! caller waits for its slot. The database clock is the only clock compared: a reservation
//! returns the slot and `clock_timestamp()`, and the instance turns their difference into a
//! local monotonic deadline measured from when the answer arrived, which can only make it
//! later, never earlier.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_postgres_rustls::MakeRustlsConnect;

use tokio_postgres::types::ToSql;

use super::{
    Ask, BudgetView, ClassQueue, ClassWaiting, Event, Grant, InstanceStatus, Lockout, Reservation,
    ReserveError, Rule, Store, StoreError, StoreFuture, WAITER_LEASE,
};
use crate::class::Class;

/// The schema's migrations, in order, embedded in the binary.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "budgets",
        include_str!("../../migrations/0001_budgets.sql"),
    ),
    (
        2,
        "instances",
        include_str!("../../migrations/0002_instances.sql"),
    ),
    (
        3,
        "classes",
        include_str!("../../migrations/0003_classes.sql"),
    ),
];

/// Serialises migrations of every instance that starts at once (`pg_advisory_xact_lock` key).
const MIGRATION_LOCK: i64 = 0x7061_6365_6761_7465; // "pacegate"

const CREATE_MIGRATIONS_TABLE: &str = "CREATE TABLE IF NOT EXISTS pacegate_schema_migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now())";
/// The common case of a reservation, as one UPDATE: one request waits here and none anywhere
/// else (so it deserves the slot, and no share is owed), the destination has no quota
/// window, the row exists, is not locked, and the slot is within the limit. `t` is `$2 * backoff` seconds and the burst tolerance
/// `($3 - 1) * t`; the slot is returned from the new row as `GREATEST(now, next_at - t -
/// tolerance, paused_until)`, which equals the slot the SET computed from the old row.
/// When no row comes back (missing row, lockout, slot too late), `SQL_RESERVE` runs and says
/// which. `c.now` is read once, before any wait for the row lock, so a contended reservation
/// computes its slot from a slightly earlier "now": the slot can only be earlier on the beat,
/// never closer to another slot. The database time returned is read again after the update,
/// so that waiting for the lock does not make the local deadline late.
const SQL_RESERVE_FAST: &str = "UPDATE pacegate_budgets AS b
    SET next_at = GREATEST(b.next_at,
            GREATEST(c.now, b.next_at - make_interval(secs => $2 * b.backoff * ($3 - 1)), b.paused_until))
        + make_interval(secs => $2 * b.backoff)
    FROM (SELECT clock_timestamp() AS now) AS c
    WHERE b.destination = $1
      AND b.lock_status IS NULL
      AND b.credits = '{}'
      AND NOT EXISTS (SELECT 1 FROM pacegate_waiting AS w WHERE w.destination = $1)
      AND ($4::float8 IS NULL OR
           GREATEST(c.now, b.next_at - make_interval(secs => $2 * b.backoff * ($3 - 1)), b.paused_until)
               <= c.now + make_interval(secs => $4::float8))
    RETURNING GREATEST(c.now, b.next_at - make_interval(secs => $2 * b.backoff * $3), b.paused_until),
        clock_timestamp(), b.generation, c.now";
const SQL_RESERVE_FOR: &str =
    "SELECT outcome, slot, db_now, generation, class, backoff, lock_since, lock_status, lock_request, lock_instance
    FROM pacegate_reserve_for($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)";
const SQL_TELL: &str = "SELECT pacegate_tell($1, $2, clock_timestamp(), $3, $4, $5, $6)";
/// Every live instance's waiting requests of a destination, by class.
const SQL_WAITING: &str = "SELECT w.class, sum(w.count)::bigint,
        extract(epoch FROM clock_timestamp() - min(w.since))::double precision
    FROM pacegate_waiting AS w LEFT JOIN pacegate_instances AS l ON l.id = w.instance
    WHERE w.destination = $1
      AND (w.instance = $2 OR l.last_seen > clock_timestamp() - make_interval(secs => $3))
    GROUP BY w.class ORDER BY w.class";
const SQL_QUOTA_USED: &str = "SELECT count(*) FROM pacegate_sends
    WHERE destination = $1 AND at > clock_timestamp() - make_interval(secs => $2)";
/// Waiting requests of instances whose lease ran out: they no longer count, and would keep
/// reservations off the one-statement path.
const SQL_EXPIRE_WAITING: &str = "DELETE FROM pacegate_waiting AS w
    WHERE NOT EXISTS (SELECT 1 FROM pacegate_instances AS l
        WHERE l.id = w.instance AND l.last_seen > clock_timestamp() - make_interval(secs => $1))";
const SQL_FORGET_WAITING: &str = "DELETE FROM pacegate_waiting WHERE instance = $1";
const SQL_RECORD: &str = "SELECT backoff, generation, clean_streak, paused_for, lock_since, lock_status, lock_request, lock_instance
    FROM pacegate_record($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";
const SQL_UNLOCK: &str = "WITH old AS (
        SELECT destination, lock_since, lock_status, lock_request, lock_instance
        FROM pacegate_budgets WHERE destination = $1 AND lock_status IS NOT NULL FOR UPDATE)
    UPDATE pacegate_budgets AS b
    SET lock_since = NULL, lock_status = NULL, lock_request = NULL, lock_instance = NULL
    FROM old WHERE b.destination = old.destination
    RETURNING old.lock_since, old.lock_status, old.lock_request, old.lock_instance";
const SQL_HEARTBEAT: &str =
    "INSERT INTO pacegate_instances (id, host, pid, version, started_at, last_seen)
        VALUES ($1, $2, $3, $4, clock_timestamp(), clock_timestamp())
    ON CONFLICT (id) DO UPDATE SET last_seen = clock_timestamp()";
const SQL_LIVE: &str = "SELECT id, host, pid, version, started_at, last_seen,
        extract(epoch FROM clock_timestamp() - last_seen)::double precision
    FROM pacegate_instances
    WHERE last_seen > clock_timestamp() - make_interval(secs => $1)
    ORDER BY started_at";
const SQL_FORGET: &str = "DELETE FROM pacegate_instances WHERE id = $1";
/// The columns `view_of` reads, in its order.
macro_rules! view_columns {
    () => {
        "backoff, generation, clean_streak,
        CASE WHEN paused_until > clock_timestamp()
            THEN extract(epoch FROM paused_until - clock_timestamp())::double precision ELSE 0 END,
        lock_since, lock_status, lock_request, lock_instance"
    };
}
const SQL_BUDGETS: &str = concat!(
    "SELECT ",
    view_columns!(),
    ", destination FROM pacegate_budgets ORDER BY destination"
);
const SQL_VIEW: &str = concat!(
    "SELECT ",
    view_columns!(),
    " FROM pacegate_budgets WHERE destination = $1"
);

/// The whole cause chain: tokio-postgres' own message is only "db error".
fn db(e: impl std::error::Error) -> StoreError {
    let mut msg = format!("postgres: {e}");
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    StoreError(msg)
}

/// A wait list as the arrays `pacegate_tell` takes: classes, counts, and the ages in seconds
/// of the oldest and second oldest, now.
#[allow(clippy::type_complexity)]
fn columns(queues: &[ClassQueue]) -> (Vec<i32>, Vec<i32>, Vec<f64>, Vec<Option<f64>>) {
    let now = Instant::now();
    let age = |since: Instant| now.saturating_duration_since(since).as_secs_f64();
    (
        queues.iter().map(|q| i32::from(q.class.0)).collect(),
        queues
            .iter()
            .map(|q| i32::try_from(q.count).unwrap_or(i32::MAX))
            .collect(),
        queues.iter().map(|q| age(q.oldest)).collect(),
        queues.iter().map(|q| q.next.map(age)).collect(),
    )
}

/// One class's waiting requests as this instance's rows in `pacegate_waiting` hold them:
/// enough to see whether a wait list would change them. (The second oldest is not compared:
/// the rows lose it when a slot is granted, and only the oldest decides who goes first.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Row {
    class: Class,
    count: u32,
    oldest: Instant,
}

fn rows_of(queues: &[ClassQueue]) -> Vec<Row> {
    queues
        .iter()
        .map(|q| Row {
            class: q.class,
            count: q.count,
            oldest: q.oldest,
        })
        .collect()
}

/// What this instance's rows hold after `pacegate_reserve_for` granted a slot to the oldest
/// request of `class` from `queues`: that request gone, the second oldest the oldest.
fn after_grant(queues: &[ClassQueue], class: Class) -> Vec<Row> {
    queues
        .iter()
        .filter_map(|q| {
            if q.class != class {
                return Some(Row {
                    class: q.class,
                    count: q.count,
                    oldest: q.oldest,
                });
            }
            Some(Row {
                class,
                count: q.count - 1,
                oldest: q.next?,
            })
        })
        .collect()
}

/// Budgets in Postgres.
pub struct PostgresStore {
    pool: Pool,
    /// The usual reservation round trip in µs: a minimum that drifts slowly upwards, so that
    /// a store on another host (a long but steady round trip) is not mistaken for a stall.
    usual_rtt_us: AtomicU64,
    /// The instance whose waiting requests this handle reports (its heartbeat is its lease).
    instance: String,
    /// What this instance's rows in `pacegate_waiting` hold, per destination, where known:
    /// a busy destination's reservation then need not rewrite an unchanged wait list. Unknown
    /// (absent) from before a statement is sent until its answer arrives, and after a yield,
    /// so that an answer that never came, or rows another instance expired, are written again.
    written: Mutex<HashMap<String, Vec<Row>>>,
}

/// A fresh instance id for a handle that is not given one.
fn anonymous_instance() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!(
        "anonymous-{}-{nanos:x}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

impl PostgresStore {
    /// Reports waiting requests as `instance`'s (the id this process heartbeats with).
    pub fn with_instance(mut self, instance: &str) -> Self {
        self.instance = instance.to_owned();
        self
    }

    /// A store over a pool of at most `connections` connections to `url`. Connects lazily.
    pub fn new(url: &str, connections: usize) -> Result<Self, StoreError> {
        let roots = crate::tls::upstream_roots(&[]).map_err(|e| StoreError(e.to_string()))?;
        Self::with_roots(url, connections, roots)
    }

    /// Like [`PostgresStore::new`], trusting `roots` for a store reached over TLS. TLS follows
    /// the URL's `sslmode` (`disable`, `prefer` (the default), `require`); when it is used the
    /// server's certificate is always verified against `roots` and the host name, as libpq's
    /// `verify-full` does.
    pub fn with_roots(
        url: &str,
        connections: usize,
        roots: rustls::RootCertStore,
    ) -> Result<Self, StoreError> {
        let config: tokio_postgres::Config = url
            .parse()
            .map_err(|e| StoreError(format!("store URL: {e}")))?;
        let tls =
            crate::tls::upstream_client_config(roots).map_err(|e| StoreError(e.to_string()))?;
        let manager = Manager::from_config(
            config,
            MakeRustlsConnect::new(tls),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(connections)
            .build()
            .map_err(|e| StoreError(format!("store pool: {e}")))?;
        Ok(Self {
            pool,
            usual_rtt_us: AtomicU64::new(u64::MAX),
            instance: anonymous_instance(),
            written: Mutex::new(HashMap::new()),
        })
    }

    /// How much longer than usual a reservation's round trip took; updates the usual one.
    fn excess(&self, rtt: Duration) -> Duration {
        let rtt_us = u64::try_from(rtt.as_micros()).unwrap_or(u64::MAX);
        let usual = self.usual_rtt_us.load(Ordering::Relaxed);
        let updated = if rtt_us < usual {
            rtt_us
        } else {
            usual + (rtt_us - usual) / 256
        };
        self.usual_rtt_us.store(updated, Ordering::Relaxed);
        Duration::from_micros(rtt_us.saturating_sub(usual.min(rtt_us)))
    }

    /// Whether this instance's rows already hold `rows`; either way they count as unknown
    /// until [`PostgresStore::wrote`] says what the statement about to be sent left there.
    fn unchanged(&self, destination: &str, rows: &[Row]) -> bool {
        self.written
            .lock()
            .remove(destination)
            .is_some_and(|w| w == rows)
    }

    fn wrote(&self, destination: &str, rows: Vec<Row>) {
        self.written.lock().insert(destination.to_owned(), rows);
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(db)
    }

    /// Applies the embedded migrations that the database lacks, under an advisory lock, in
    /// one transaction. Refuses a database whose schema is newer than this binary. Returns
    /// the versions applied.
    pub async fn migrate(&self) -> Result<Vec<i32>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(db)?;
        tx.batch_execute(CREATE_MIGRATIONS_TABLE)
            .await
            .map_err(db)?;
        let applied: Vec<i32> = tx
            .query("SELECT version FROM pacegate_schema_migrations", &[])
            .await
            .map_err(db)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        check_not_newer(&applied)?;
        let mut done = Vec::new();
        for (version, name, sql) in MIGRATIONS {
            if applied.contains(version) {
                continue;
            }
            tx.batch_execute(sql)
                .await
                .map_err(|e| StoreError(format!("migration {version} ({name}) failed: {e}")))?;
            tx.execute(
                "INSERT INTO pacegate_schema_migrations (version, name) VALUES ($1, $2)",
                &[version, name],
            )
            .await
            .map_err(db)?;
            done.push(*version);
        }
        tx.commit().await.map_err(db)?;
        Ok(done)
    }

    /// Every budget in the store, by destination name.
    pub async fn budgets(&self) -> Result<Vec<(String, BudgetView)>, StoreError> {
        let client = self.client().await?;
        let rows = client.query(SQL_BUDGETS, &[]).await.map_err(db)?;
        Ok(rows.iter().map(|r| (r.get(8), view_of(r))).collect())
    }

    /// Records that `me` is alive now (renewing its waiters' lease), and drops the waiting
    /// requests of instances whose lease ran out.
    pub async fn heartbeat(&self, me: &Instance) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .execute(SQL_HEARTBEAT, &[&me.id, &me.host, &me.pid, &me.version])
            .await
            .map_err(db)?;
        client
            .execute(SQL_EXPIRE_WAITING, &[&WAITER_LEASE.as_secs_f64()])
            .await
            .map_err(db)?;
        Ok(())
    }

    /// Instances whose last heartbeat is younger than `within`.
    pub async fn live_instances(
        &self,
        within: Duration,
    ) -> Result<Vec<InstanceStatus>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(SQL_LIVE, &[&within.as_secs_f64()])
            .await
            .map_err(db)?;
        Ok(rows
            .iter()
            .map(|r| InstanceStatus {
                id: r.get(0),
                host: r.get(1),
                pid: r.get(2),
                version: r.get(3),
                started: humantime::format_rfc3339_seconds(r.get::<_, SystemTime>(4)).to_string(),
                last_seen_seconds_ago: r.get(6),
            })
            .collect())
    }

    /// Removes `me` from the live instances (a clean shutdown).
    pub async fn forget(&self, me: &Instance) -> Result<(), StoreError> {
        let client = self.client().await?;
        client.execute(SQL_FORGET, &[&me.id]).await.map_err(db)?;
        client
            .execute(SQL_FORGET_WAITING, &[&me.id])
            .await
            .map_err(db)?;
        Ok(())
    }

    /// Checks that the schema is exactly the one this binary knows (for `migrate = false`).
    pub async fn check_schema(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        let applied: Vec<i32> = match client
            .query("SELECT version FROM pacegate_schema_migrations", &[])
            .await
        {
            Ok(rows) => rows.iter().map(|r| r.get(0)).collect(),
            Err(_) => Vec::new(),
        };
        check_not_newer(&applied)?;
        if let Some((missing, _, _)) = MIGRATIONS.iter().find(|(v, _, _)| !applied.contains(v)) {
            return Err(StoreError(format!(
                "the store's schema lacks migration {missing}: run `pacegate migrate --store URL` or set [store] migrate = true"
            )));
        }
        Ok(())
    }
}

/// This process, as it heartbeats into the store.
#[derive(Debug, Clone)]
pub struct Instance {
    /// Unique per process start.
    pub id: String,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: i32,
    /// pacegate version.
    pub version: String,
}

fn check_not_newer(applied: &[i32]) -> Result<(), StoreError> {
    let known = MIGRATIONS.last().map_or(0, |m| m.0);
    match applied.iter().max() {
        Some(newest) if *newest > known => Err(StoreError(format!(
            "the store's schema is at version {newest}, newer than this pacegate binary knows ({known}); upgrade pacegate"
        ))),
        _ => Ok(()),
    }
}

fn lockout(
    since: Option<SystemTime>,
    status: Option<i32>,
    request: Option<String>,
    instance: Option<String>,
) -> Option<Lockout> {
    Some(Lockout {
        since: since?,
        status: u16::try_from(status?).unwrap_or(0),
        request: request.unwrap_or_default(),
        instance: instance.unwrap_or_default(),
    })
}

fn view_of(row: &tokio_postgres::Row) -> BudgetView {
    BudgetView {
        backoff: row.get(0),
        generation: u64::try_from(row.get::<_, i64>(1)).unwrap_or(0),
        clean_streak: u32::try_from(row.get::<_, i32>(2)).unwrap_or(0),
        paused_for: Duration::from_secs_f64(row.get::<_, f64>(3).max(0.0)),
        lock: lockout(row.get(4), row.get(5), row.get(6), row.get(7)),
    }
}

/// `later - earlier` on the database clock, zero when negative.
fn after(later: SystemTime, earlier: SystemTime) -> Duration {
    later.duration_since(earlier).unwrap_or_default()
}

impl Store for PostgresStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn reserve<'a>(
        &'a self,
        destination: &'a str,
        rule: &'a Rule,
        ask: Ask<'a>,
    ) -> StoreFuture<'a, Result<Grant, ReserveError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let limit = ask
                .not_after
                .map(|t| t.saturating_duration_since(Instant::now()).as_secs_f64());
            let burst = i32::try_from(rule.burst).unwrap_or(i32::MAX);
            let interval = rule.interval.as_secs_f64();
            let sent = Instant::now();
            if let [only] = ask.queues {
                if only.count == 1 && rule.quota.is_empty() {
                    let params: [&(dyn ToSql + Sync); 4] =
                        [&destination, &interval, &burst, &limit];
                    let fast = client.prepare_cached(SQL_RESERVE_FAST).await.map_err(db)?;
                    if let Some(row) = client.query_opt(&fast, &params).await.map_err(db)? {
                        let arrived = Instant::now();
                        drop(client);
                        let (slot, db_now, started): (SystemTime, SystemTime, SystemTime) =
                            (row.get(0), row.get(1), row.get(3));
                        // The round trip less the time the statement spent inside the
                        // database (waiting for the row lock, mostly): what is left delays the
                        // answer after `db_now`.
                        let transit = (arrived - sent).saturating_sub(after(db_now, started));
                        // The fast path runs only while no instance has rows for the
                        // destination.
                        self.wrote(destination, Vec::new());
                        return Ok(Grant {
                            slot: Reservation {
                                at: arrived + after(slot, db_now),
                                generation: u64::try_from(row.get::<_, i64>(2)).unwrap_or(0),
                                excess_delay: self.excess(transit),
                            },
                            class: only.class,
                        });
                    }
                }
            }
            let tell = !self.unchanged(destination, &rows_of(ask.queues));
            let (classes, counts, oldest, next) = columns(ask.queues);
            let limits: Vec<i64> = rule.quota.iter().map(|q| i64::from(q.limit)).collect();
            let pers: Vec<f64> = rule.quota.iter().map(|q| q.per.as_secs_f64()).collect();
            let statement = client.prepare_cached(SQL_RESERVE_FOR).await.map_err(db)?;
            let row = client
                .query_one(
                    &statement,
                    &[
                        &destination,
                        &interval,
                        &burst,
                        &limit,
                        &self.instance,
                        &WAITER_LEASE.as_secs_f64(),
                        &&*rule.shares,
                        &limits,
                        &pers,
                        &rule.max_late().as_secs_f64(),
                        &classes,
                        &counts,
                        &oldest,
                        &next,
                        &tell,
                    ],
                )
                .await
                .map_err(db)?;
            // Measured from the answer's arrival: the conversion can only delay the slot.
            let arrived = Instant::now();
            drop(client);
            let outcome: &str = row.get(0);
            let slot: Option<SystemTime> = row.get(1);
            let db_now: SystemTime = row.get(2);
            let generation = u64::try_from(row.get::<_, i64>(3)).unwrap_or(0);
            let at = |slot: Option<SystemTime>| {
                slot.map(|s| arrived + after(s, db_now))
                    .ok_or_else(|| StoreError("pacegate_reserve_for returned no slot".into()))
            };
            match outcome {
                "granted" => {
                    let class = Class(u16::try_from(row.get::<_, i32>(4)).unwrap_or(0));
                    self.wrote(destination, after_grant(ask.queues, class));
                    Ok(Grant {
                        slot: Reservation {
                            at: at(slot)?,
                            generation,
                            excess_delay: self.excess(arrived - sent),
                        },
                        class,
                    })
                }
                // Another instance's request goes first: tell the list again next time, in
                // case the store dropped these rows (a lease that ran out while this process
                // stalled), or this instance would yield for ever.
                "yield" => Err(ReserveError::Yield(rule.yield_for(row.get(5)))),
                "too_late" => {
                    self.wrote(destination, rows_of(ask.queues));
                    Err(ReserveError::TooLate { slot: at(slot)? })
                }
                "locked" => {
                    self.wrote(destination, rows_of(ask.queues));
                    Err(
                        lockout(row.get(6), row.get(7), row.get(8), row.get(9)).map_or_else(
                            || ReserveError::Store(StoreError("a lockout without a status".into())),
                            ReserveError::Locked,
                        ),
                    )
                }
                other => Err(ReserveError::Store(StoreError(format!(
                    "pacegate_reserve_for answered `{other}`"
                )))),
            }
        })
    }

    fn wait_list<'a>(
        &'a self,
        destination: &'a str,
        queues: &'a [ClassQueue],
    ) -> StoreFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let rows = rows_of(queues);
            if self.unchanged(destination, &rows) {
                self.wrote(destination, rows);
                return Ok(());
            }
            let (classes, counts, oldest, next) = columns(queues);
            let client = self.client().await?;
            let statement = client.prepare_cached(SQL_TELL).await.map_err(db)?;
            client
                .execute(
                    &statement,
                    &[
                        &destination,
                        &self.instance,
                        &classes,
                        &counts,
                        &oldest,
                        &next,
                    ],
                )
                .await
                .map_err(db)?;
            self.wrote(destination, rows);
            Ok(())
        })
    }

    fn waiting<'a>(
        &'a self,
        destination: &'a str,
    ) -> StoreFuture<'a, Result<Vec<ClassWaiting>, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let rows = client
                .query(
                    SQL_WAITING,
                    &[&destination, &self.instance, &WAITER_LEASE.as_secs_f64()],
                )
                .await
                .map_err(db)?;
            Ok(rows
                .iter()
                .map(|r| {
                    (
                        Class(u16::try_from(r.get::<_, i32>(0)).unwrap_or(0)),
                        u32::try_from(r.get::<_, i64>(1)).unwrap_or(0),
                        Duration::from_secs_f64(r.get::<_, f64>(2).max(0.0)),
                    )
                })
                .collect())
        })
    }

    fn quota_used<'a>(
        &'a self,
        destination: &'a str,
        rule: &'a Rule,
    ) -> StoreFuture<'a, Result<Vec<u32>, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let mut used = Vec::new();
            for q in &rule.quota {
                let row = client
                    .query_one(SQL_QUOTA_USED, &[&destination, &q.per.as_secs_f64()])
                    .await
                    .map_err(db)?;
                used.push(u32::try_from(row.get::<_, i64>(0)).map_or(q.limit, |n| n.min(q.limit)));
            }
            Ok(used)
        })
    }

    fn record<'a>(
        &'a self,
        destination: &'a str,
        rule: &'a Rule,
        event: Event,
    ) -> StoreFuture<'a, Result<BudgetView, StoreError>> {
        Box::pin(async move {
            let (kind, generation, retry_after, lock) = match &event {
                Event::Clean => ("clean", 0i64, None, None),
                Event::Throttled {
                    generation,
                    retry_after,
                } => (
                    "throttled",
                    i64::try_from(*generation).unwrap_or(i64::MAX),
                    retry_after.map(|d| d.as_secs_f64()),
                    None,
                ),
                Event::Lockout(l) => ("lockout", 0, None, Some(l)),
            };
            let decay_after = i32::try_from(rule.decay_after).unwrap_or(i32::MAX);
            let client = self.client().await?;
            let statement = client.prepare_cached(SQL_RECORD).await.map_err(db)?;
            let row = client
                .query_one(
                    &statement,
                    &[
                        &destination,
                        &kind,
                        &generation,
                        &retry_after,
                        &rule.backoff_factor,
                        &rule.backoff_max,
                        &decay_after,
                        &rule.retry_after_max.as_secs_f64(),
                        &lock.map(|l| i32::from(l.status)),
                        &lock.map(|l| l.request.as_str()),
                        &lock.map(|l| l.instance.as_str()),
                    ],
                )
                .await
                .map_err(db)?;
            Ok(view_of(&row))
        })
    }

    fn unlock<'a>(
        &'a self,
        destination: &'a str,
    ) -> StoreFuture<'a, Result<Option<Lockout>, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let row = client
                .query_opt(SQL_UNLOCK, &[&destination])
                .await
                .map_err(db)?;
            Ok(row.and_then(|r| lockout(r.get(0), r.get(1), r.get(2), r.get(3))))
        })
    }

    fn view<'a>(&'a self, destination: &'a str) -> StoreFuture<'a, Result<BudgetView, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let row = client
                .query_opt(SQL_VIEW, &[&destination])
                .await
                .map_err(db)?;
            Ok(row.map_or(BudgetView::default(), |r| view_of(&r)))
        })
    }
}

#[doc(hidden)]
pub mod testdb {
    //! For tests: a fresh database per test, in the server `PACEGATE_TEST_DATABASE_URL`
    //! names (scripts/test provides one).

    use std::sync::atomic::{AtomicU32, Ordering};

    /// Creates a new empty database and returns its URL. Panics, saying how to get a server,
    /// when `PACEGATE_TEST_DATABASE_URL` is not set.
    pub async fn fresh() -> String {
        let admin = std::env::var("PACEGATE_TEST_DATABASE_URL").unwrap_or_else(|_| {
            panic!(
                "PACEGATE_TEST_DATABASE_URL is not set: run the tests through scripts/test, which starts a throwaway PostgreSQL, or point it at a server where the tests may create databases"
            )
        });
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "pacegate_unit_{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let (client, conn) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to PACEGATE_TEST_DATABASE_URL: {e}"));
        tokio::spawn(conn);
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        let mut config: tokio_postgres::Config = admin.parse().unwrap();
        config.dbname(&name);
        let (host, port) = match (config.get_hosts().first(), config.get_ports().first()) {
            (Some(tokio_postgres::config::Host::Tcp(h)), Some(p)) => (h.clone(), *p),
            _ => panic!("PACEGATE_TEST_DATABASE_URL must name a TCP host and port"),
        };
        let user = config.get_user().unwrap_or("postgres");
        let password = config
            .get_password()
            .map(|p| format!(":{}", String::from_utf8_lossy(p)))
            .unwrap_or_default();
        format!("postgres://{user}{password}@{host}:{port}/{name}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::contract;

    async fn store() -> PostgresStore {
        let store = PostgresStore::new(&testdb::fresh().await, 8).unwrap();
        assert_eq!(store.migrate().await.unwrap(), [1, 2, 3]);
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

    /// Two live instances on one fresh store.
    async fn pair() -> (PostgresStore, PostgresStore) {
        let url = testdb::fresh().await;
        let a = PostgresStore::new(&url, 4).unwrap().with_instance("a");
        a.migrate().await.unwrap();
        let b = PostgresStore::new(&url, 4).unwrap().with_instance("b");
        a.heartbeat(&instance("a")).await.unwrap();
        b.heartbeat(&instance("b")).await.unwrap();
        (a, b)
    }

    #[tokio::test]
    async fn passes_the_store_contract() {
        contract::run_all(store, Duration::from_millis(20)).await;
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
        let left = a.waiting("d").await.unwrap();
        assert_eq!((left[0].0, left[0].1), (contract::BACKFILL, 9), "{left:?}");
        // A list that changed is written.
        let five = [contract::waiting(contract::BACKFILL, 5, 50)];
        assert_eq!(
            contract::ask(&a, &r, &five).await.unwrap(),
            contract::BACKFILL
        );
        let left = a.waiting("d").await.unwrap();
        assert_eq!((left[0].0, left[0].1), (contract::BACKFILL, 4), "{left:?}");
        // So is one told without a reservation, and an unchanged one is not.
        a.wait_list("d", &five).await.unwrap();
        db.execute("UPDATE pacegate_waiting SET count = 10", &[])
            .await
            .unwrap();
        a.wait_list("d", &five).await.unwrap();
        assert_eq!(a.waiting("d").await.unwrap()[0].1, 10);
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
    async fn waiters_count_only_while_their_instance_heartbeats() {
        let (a, b) = pair().await;
        let r = contract::rule(100.0);
        let interactive = [contract::waiting(Class(0), 5, 1000)];
        let backfill = [contract::waiting(Class(2), 5, 1000)];
        let ask = |queues| Ask {
            queues,
            not_after: None,
        };
        a.wait_list("d", &interactive).await.unwrap();
        assert!(matches!(
            b.reserve("d", &r, ask(&backfill)).await,
            Err(ReserveError::Yield(_))
        ));
        // a's lease runs out: its last heartbeat is just older than WAITER_LEASE.
        a.client()
            .await
            .unwrap()
            .execute(
                "UPDATE pacegate_instances SET last_seen = last_seen - make_interval(secs => $1) WHERE id = 'a'",
                &[&(WAITER_LEASE.as_secs_f64() + 0.5)],
            )
            .await
            .unwrap();
        assert_eq!(
            b.reserve("d", &r, ask(&backfill)).await.unwrap().class,
            Class(2)
        );
        // Its rows are dropped at the next heartbeat of anyone.
        b.heartbeat(&instance("b")).await.unwrap();
        assert_eq!(b.waiting("d").await.unwrap()[0].0, Class(2));
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
        assert!(err.0.contains("newer than this pacegate binary"), "{err}");
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
        store.heartbeat(&me(1)).await.unwrap();
        store.heartbeat(&me(2)).await.unwrap();
        store.heartbeat(&me(1)).await.unwrap();
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
    async fn a_missing_row_is_recreated_at_now() {
        let store = store().await;
        let rule = contract::rule(10.0);
        contract::take(&store, "d", &rule, None).await.unwrap();
        store
            .client()
            .await
            .unwrap()
            .execute("TRUNCATE pacegate_budgets", &[])
            .await
            .unwrap();
        let now = Instant::now();
        let slot = contract::take(&store, "d", &rule, None).await.unwrap();
        assert!(slot.at.saturating_duration_since(now) < Duration::from_millis(50));
    }
}
