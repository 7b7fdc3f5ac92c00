//! The shared store: one Postgres row per destination holds the whole budget, so every
//! instance on every host that points at the same database shares one ceiling.
//!
//! Each operation is one statement calling a function from `migrations/` (`pacegate_reserve`,
//! `pacegate_record_said`), run on an autocommit pooled connection that is returned before the
//! caller waits for its slot. The database clock is the only clock compared: a reservation
//! returns the slot and `clock_timestamp()`, and the instance places the slot on its own
//! monotonic clock by a bound that can only make it later, never earlier, and counts how
//! much later it may be (`clock`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use deadpool_postgres::{HookError, Manager, ManagerConfig, Pool, PoolError, RecyclingMethod};
use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_postgres_rustls::MakeRustlsConnect;

mod clock;
mod membership;
mod migrations;
mod reassert;
mod rows;
mod sql;
mod typed;

pub use migrations::MIGRATIONS;
use rows::{
    after, columns, db, lockout, pause_args, rows_of, sent_mark, snapshot_of, view_of, Row,
};
use sql::*;

use clock::DbClock;
use reassert::Reassert;
use typed::{no_row, Conn, Param};

use crate::budget::after_grant;
use crate::budget::{
    Ask, BudgetView, ClassQueue, Event, Grant, Known, Lockout, Observation, Reservation,
    ReserveError, Rule, Snapshot, Store, StoreError, BATCH_HORIZON,
};
use crate::class::Class;
use crate::config::Statements;
use crate::destination::VendorPace;
use crate::fleet::{Instance, WAITER_LEASE};

/// How long after a budget's row is found lost (missing where this instance paced) its
/// schedule starts at the least: past the slots any instance still holds from it. An
/// instance busy on it holds slots a batch's reach plus its ask-ahead beyond now (a few
/// hundred milliseconds, with a store 100 ms away), so a second covers them. The instance
/// that finds the row missing starts it after its own slots, should they reach further.
const LOST_ROW_HOLD: Duration = Duration::from_secs(1);

/// Budgets in Postgres.
pub struct PostgresStore {
    pool: Pool,
    /// The database clock as read here: where its slots fall on the local clock.
    clock: DbClock,
    /// The instance whose waiting requests this handle reports (its heartbeat is its lease).
    instance: String,
    /// What this instance's rows in `pacegate_waiting` hold, per destination, where known:
    /// a busy destination's reservation then need not rewrite an unchanged wait list. Unknown
    /// (`None`) from before a statement is sent until its answer arrives, and after a yield,
    /// so that an answer that never came, or rows another instance expired, are written again.
    /// A failover clears it: the new server holds none of these rows.
    written: Arc<Mutex<HashMap<String, Option<Vec<Row>>>>>,
    /// What this instance knows of each budget, from this handle's answers: the failover's
    /// local fallback starts from it, and [`reassert`] puts it back into a new server.
    known: Arc<Known>,
    /// The server paced on, and what a new one gets.
    reassert: Arc<Reassert>,
    /// Round trips sent to the database, for benches and tests that count what a request
    /// costs it (one per operation, two when a reservation leaves the one-statement path).
    statements: AtomicU64,
    /// Whether statements are prepared (`[store] statements`), or sent unnamed: shared with
    /// the pool's hook, which prepares a reservation's statements on every new connection.
    prepared: Arc<AtomicBool>,
    /// Whether slots are asked for [`DbClock::lead`] after the database's "now" (off only
    /// where a test freezes the database clock, which makes the lead meaningless).
    lead: bool,
}

/// Prepares the statements a reservation sends, in one round trip, so that no request pays
/// for a statement's preparing on a connection new to it (a round trip more, with a store far
/// away). Best effort: a statement the schema cannot take yet (before the first connection
/// migrates it) is prepared when first sent instead.
async fn prepare_reservations(client: &deadpool_postgres::ClientWrapper) {
    let _ = tokio::join!(
        client.prepare_cached(SQL_NOW),
        client.prepare_cached(SQL_RESERVE_FAST),
        client.prepare_cached(SQL_RESERVE_MANY),
    );
}

impl PostgresStore {
    /// Reports waiting requests as `instance`'s: this instance's id, which its heartbeats
    /// renew (by default an id of the store's own; tests play several instances).
    pub fn with_instance(mut self, instance: &str) -> Self {
        self.instance = instance.to_owned();
        self
    }

    /// A store over a pool of at most `connections` connections to `url`. Connects lazily.
    pub fn new(url: &str, connections: usize) -> Result<Self, StoreError> {
        let roots =
            crate::tls::upstream_roots(&[]).map_err(|e| StoreError::Settings(e.to_string()))?;
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
            .map_err(|e| StoreError::Settings(format!("store URL: {e}")))?;
        let tls = crate::tls::upstream_client_config(roots)
            .map_err(|e| StoreError::Settings(e.to_string()))?;
        let manager = Manager::from_config(
            config,
            MakeRustlsConnect::new(tls),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let written = Arc::new(Mutex::new(HashMap::new()));
        let known = Arc::new(Known::default());
        let reassert = Arc::new(Reassert::new(known.clone(), written.clone()));
        let checks = reassert.clone();
        let prepared = Arc::new(AtomicBool::new(
            Statements::default() == Statements::Prepared,
        ));
        let prepares = prepared.clone();
        // Every new connection finds out which server it reached, and a new one (a failover)
        // gets what this instance knew before any request is paced on it. Then it prepares the
        // statements a reservation sends, in one round trip, so that no request pays for a
        // statement's preparing on a connection new to it (a round trip more, with a store
        // far away).
        let check = deadpool_postgres::Hook::async_fn(move |client, _| {
            let checks = checks.clone();
            let prepare = prepares.load(Ordering::Relaxed);
            Box::pin(async move {
                checks.check(client).await.map_err(HookError::Backend)?;
                if prepare {
                    prepare_reservations(client).await;
                }
                Ok(())
            })
        });
        let pool = Pool::builder(manager)
            .max_size(connections)
            .post_create(check)
            .build()
            .map_err(|e| StoreError::Settings(format!("store pool: {e}")))?;
        Ok(Self {
            pool,
            clock: DbClock::new(),
            instance: Instance::new().id,
            written,
            known,
            reassert,
            statements: AtomicU64::new(0),
            prepared,
            lead: true,
        })
    }

    /// Narrows the database clock's span with a read-only round trip, which has no commit
    /// to flush, when it has grown too wide to place slots closely (see [`clock`]).
    async fn probe_clock(&self, client: &Conn) -> Result<(), StoreError> {
        if !self.clock.probe_due(Instant::now()) {
            return Ok(());
        }
        self.statements.fetch_add(1, Ordering::Relaxed);
        let answer = client.timed(SQL_NOW, &[]).await?;
        let row = answer.row.ok_or_else(|| no_row(SQL_NOW))?;
        self.clock.read(answer.sent, answer.arrived, row.get(0));
        Ok(())
    }

    /// Whether this instance's rows already hold `rows`. Either way they count as unknown
    /// from now until [`PostgresStore::wrote`] records what the statement about to be sent
    /// left there.
    fn unchanged(&self, destination: &str, rows: &[Row]) -> bool {
        self.written
            .lock()
            .get_mut(destination)
            .and_then(Option::take)
            .is_some_and(|known| known == rows)
    }

    fn wrote(&self, destination: &str, rows: Vec<Row>) {
        let mut written = self.written.lock();
        match written.get_mut(destination) {
            Some(known) => *known = Some(rows),
            // The destination's first statement: the only time its name is copied.
            None => {
                written.insert(destination.to_owned(), Some(rows));
            }
        }
    }

    /// Round trips sent to the database so far: one per operation, two when a reservation
    /// leaves the one-statement path.
    pub fn statements(&self) -> u64 {
        self.statements.load(Ordering::Relaxed)
    }

    async fn client(&self) -> Result<Conn, StoreError> {
        self.statements.fetch_add(1, Ordering::Relaxed);
        let client = self.pool.get().await.map_err(|e| match e {
            PoolError::Backend(e) | PoolError::PostCreateHook(HookError::Backend(e)) => db(e),
            other => StoreError::Unreachable(format!("postgres pool: {other}")),
        })?;
        let mode = if self.prepared.load(Ordering::Relaxed) {
            Statements::Prepared
        } else {
            Statements::Unnamed
        };
        Ok(Conn::new(client, mode))
    }

    /// Opens `n` of the pool's connections at once (at most its size), each through the pool's
    /// hook (the server checked, a reservation's statements prepared), and keeps them idle.
    /// A pool grows only as it is asked: a lone request whose reservation found every
    /// connection busy with a heartbeat's chores opened one then, four round trips before its
    /// slot (277 ms with the store 50 ms away, where one round trip is due).
    /// The connection that migrated the schema could not prepare them when it opened: they
    /// are prepared here on every connection (a connection that has them asks nothing).
    pub async fn warm(&self, n: usize) -> Result<(), StoreError> {
        let n = n.min(self.pool.status().max_size);
        let opened = futures_util::future::join_all((0..n).map(|_| self.pool.get())).await;
        let mut clients = Vec::with_capacity(n);
        for conn in opened {
            clients.push(conn.map_err(|e| StoreError::Unreachable(format!("postgres pool: {e}")))?);
        }
        if self.prepared.load(Ordering::Relaxed) {
            futures_util::future::join_all(clients.iter().map(|c| prepare_reservations(c))).await;
        }
        Ok(())
    }

    /// Whether a failover's new server gets what this instance knew (see [`reassert`]); on by
    /// default.
    pub fn with_reassert(self, on: bool) -> Self {
        self.reassert.set_on(on);
        self
    }

    /// Asks for slots from the database's bare "now", with no lead: for a test whose
    /// database clock stands still, where no answer's way back can be measured.
    #[cfg(test)]
    pub(crate) fn without_lead(mut self) -> Self {
        self.lead = false;
        self
    }

    /// How far one batch of slots may reach ([`crate::budget::Ask::most`]):
    /// [`BATCH_HORIZON`], or two of the store's quickest round trips where that is longer, so
    /// that a far store's next answer is back before a batch runs out.
    fn horizon(&self) -> Duration {
        BATCH_HORIZON.max(2 * self.clock.quickest())
    }

    /// The lead a reservation asks for, in seconds (see [`DbClock::lead`]).
    fn lead(&self) -> f64 {
        if self.lead {
            self.clock.lead().as_secs_f64()
        } else {
            0.0
        }
    }

    /// Sends statements as `mode` says (see [`typed`]); prepared by default.
    pub fn with_statements(self, mode: Statements) -> Self {
        self.prepared
            .store(mode == Statements::Prepared, Ordering::Relaxed);
        self
    }

    /// A reservation as [`Store::reserve`] asks it, on the server.
    async fn reserve_on_server(
        &self,
        destination: &str,
        rule: &Rule,
        ask: Ask<'_>,
    ) -> Result<Grant, ReserveError> {
        let client = self.client().await?;
        self.probe_clock(&client).await?;
        let limit = ask
            .not_after
            .map(|t| t.saturating_duration_since(Instant::now()).as_secs_f64());
        let burst = i32::try_from(rule.burst).unwrap_or(i32::MAX);
        let interval = rule.interval.as_secs_f64();
        let lead = self.lead();
        if let [only] = ask.queues {
            if only.count == 1 && !rule.counts_sends() {
                let params: [&dyn Param; 5] = [&destination, &interval, &burst, &limit, &lead];
                let answer = client.timed(SQL_RESERVE_FAST, &params).await?;
                if let Some(row) = answer.row {
                    let (sent, arrived) = (answer.sent, answer.arrived);
                    drop(client);
                    let (slot, db_now): (SystemTime, SystemTime) = (row.get(0), row.get(1));
                    let clock = self.clock.read(sent, arrived, db_now);
                    // The fast path runs only while no instance has rows for the
                    // destination.
                    self.wrote(destination, Vec::new());
                    let at = clock.local(slot);
                    return Ok(Grant {
                        slot: Reservation {
                            at,
                            generation: u64::try_from(row.get::<_, i64>(2)).unwrap_or(0),
                            unseen_late: clock.unseen_late,
                        },
                        class: only.class,
                        more: Vec::new(),
                        sent: Vec::new(),
                    });
                }
            }
        }
        if matches!(ask.queues, [only] if only.count == 1) && !rule.counts_sends() {
            // The one-statement path answered nothing: a second statement follows.
            self.statements.fetch_add(1, Ordering::Relaxed);
        }
        let rows = rows_of(ask.queues);
        let tell = !self.unchanged(destination, &rows);
        let (classes, counts, oldest, next) = columns(ask.queues);
        let (limits, pers): (Vec<i64>, Vec<f64>) = rule
            .windows()
            .map(|(limit, per)| (i64::try_from(limit).unwrap_or(i64::MAX), per.as_secs_f64()))
            .unzip();
        let most = i32::try_from(ask.most.max(1)).unwrap_or(i32::MAX);
        let paced = self.reassert.is_on().then(|| self.known.next(destination));
        let lost_hold = paced.flatten().map_or(0.0, |next| {
            LOST_ROW_HOLD
                .max(next.saturating_duration_since(Instant::now()))
                .as_secs_f64()
        });
        let answer = client
            .timed(
                SQL_RESERVE_MANY,
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
                    &rule.quota_margin().as_secs_f64(),
                    &classes,
                    &counts,
                    &oldest,
                    &next,
                    &tell,
                    &i64::from(rule.reserve),
                    &most,
                    &self.horizon().as_secs_f64(),
                    &lead,
                    &lost_hold,
                    &(rule.vendor_pace == VendorPace::Spread),
                    &i64::from(rule.cost),
                ],
            )
            .await?;
        let (sent, arrived) = (answer.sent, answer.arrived);
        let row = answer.row.ok_or_else(|| no_row(SQL_RESERVE_MANY))?;
        drop(client);
        let outcome: &str = row.get(0);
        let slot: Option<SystemTime> = row.get(1);
        let db_now: SystemTime = row.get(2);
        let clock = self.clock.read(sent, arrived, db_now);
        let generation = u64::try_from(row.get::<_, i64>(3)).unwrap_or(0);
        let at = |slot: Option<SystemTime>| {
            slot.map(|s| clock.local(s)).ok_or_else(|| {
                StoreError::Refused("pacegate_reserve_paced returned no slot".into())
            })
        };
        match outcome {
            "granted" => {
                let class = Class(u16::try_from(row.get::<_, i32>(4)).unwrap_or(0));
                let more_at = row
                    .get::<_, Option<Vec<SystemTime>>>(10)
                    .unwrap_or_default();
                let more: Vec<Instant> = more_at.iter().map(|s| clock.local(*s)).collect();
                let sent = match rule.counts_sends() {
                    false => Vec::new(),
                    true => slot.iter().chain(&more_at).map(|s| sent_mark(*s)).collect(),
                };
                let n = u32::try_from(more.len() + 1).unwrap_or(u32::MAX);
                self.wrote(destination, rows_of(&after_grant(ask.queues, class, n)));
                let first = at(slot)?;
                Ok(Grant {
                    slot: Reservation {
                        at: first,
                        generation,
                        unseen_late: clock.unseen_late,
                    },
                    class,
                    more,
                    sent,
                })
            }
            // Another instance's request goes first: tell the list again next time, in
            // case the store dropped these rows (a lease that ran out while this process
            // stalled), or this instance would yield for ever.
            "yield" => {
                let free_in = slot.map_or(Duration::ZERO, |s| after(s, db_now));
                Err(ReserveError::Yield(rule.yield_for(row.get(5), free_in)))
            }
            "too_late" => {
                self.wrote(destination, rows);
                Err(ReserveError::TooLate { slot: at(slot)? })
            }
            "locked" => {
                self.wrote(destination, rows);
                match lockout(row.get(6), row.get(7), row.get(8), row.get(9)) {
                    Some(lock) => Err(ReserveError::Locked(lock)),
                    None => Err(ReserveError::Store(StoreError::Refused(
                        "a lockout without a status".into(),
                    ))),
                }
            }
            other => Err(ReserveError::Store(StoreError::Refused(format!(
                "pacegate_reserve_paced answered `{other}`"
            )))),
        }
    }

    /// Every budget in the store, by destination name.
    pub async fn budgets(&self) -> Result<Vec<(String, BudgetView)>, StoreError> {
        let client = self.client().await?;
        let rows = client.rows(SQL_BUDGETS, &[]).await?;
        Ok(rows.iter().map(|r| (r.get(14), view_of(r))).collect())
    }
}

#[async_trait::async_trait]
impl Store for PostgresStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn known(&self) -> Option<&Known> {
        Some(&self.known)
    }

    async fn reserve(
        &self,
        destination: &str,
        rule: &Rule,
        ask: Ask<'_>,
    ) -> Result<Grant, ReserveError> {
        let rule = &*rule.weighted(ask.cost);
        let answer = self.reserve_on_server(destination, rule, ask).await;
        self.known.reserved(destination, rule, &answer);
        answer
    }

    async fn wait_list(&self, destination: &str, queues: &[ClassQueue]) -> Result<(), StoreError> {
        let rows = rows_of(queues);
        if self.unchanged(destination, &rows) {
            self.wrote(destination, rows);
            return Ok(());
        }
        let (classes, counts, oldest, next) = columns(queues);
        let client = self.client().await?;
        client
            .rows(
                SQL_TELL,
                &[
                    &destination,
                    &self.instance,
                    &classes,
                    &counts,
                    &oldest,
                    &next,
                ],
            )
            .await?;
        self.wrote(destination, rows);
        Ok(())
    }

    async fn keep_waiting(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .rows(
                SQL_KEEP_WAITING,
                &[&self.instance, &WAITER_LEASE.as_secs_f64()],
            )
            .await?;
        // Behind a pooler the server can change under a connection that stays open.
        self.reassert.check(&client).await.map_err(db)?;
        Ok(())
    }

    async fn forget_waiting(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        client.rows(SQL_FORGET_WAITING, &[&self.instance]).await?;
        Ok(())
    }

    async fn record(
        &self,
        destination: &str,
        rule: &Rule,
        event: Event,
        vendor: Option<Observation>,
    ) -> Result<BudgetView, StoreError> {
        let none = (None, None);
        let (kind, generation, success, retry_after, reset, spread, lock) = match &event {
            Event::Clean {
                success,
                generation,
            } => (
                "clean",
                i64::try_from(*generation).unwrap_or(i64::MAX),
                *success,
                none,
                none,
                0.0,
                None,
            ),
            Event::Throttled {
                generation,
                retry_after,
                reset,
                spread,
            } => (
                "throttled",
                i64::try_from(*generation).unwrap_or(i64::MAX),
                false,
                pause_args(*retry_after),
                pause_args(*reset),
                *spread,
                None,
            ),
            Event::Lockout(l) => ("lockout", 0, false, none, none, 0.0, Some(l)),
            Event::None => ("none", 0, false, none, none, 0.0, None),
        };
        let us = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        let decay_after = i32::try_from(rule.decay_after).unwrap_or(i32::MAX);
        let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let vendor_reset = pause_args(vendor.map(|v| v.reset));
        let client = self.client().await?;
        let row = client
            .one(
                SQL_RECORD,
                &[
                    &destination,
                    &kind,
                    &generation,
                    &success,
                    &retry_after.0,
                    &retry_after.1,
                    &reset.0,
                    &reset.1,
                    &spread,
                    &rule.backoff_factor,
                    &rule.backoff_max,
                    &decay_after,
                    &rule.retry_after_max.as_secs_f64(),
                    &i64::from(rule.reserve),
                    &rule.block.map(|b| us(b.min)),
                    &rule.block.map(|b| us(b.max)),
                    &rule.block.map_or(0.0, |b| b.jitter),
                    &lock.map(|l| i32::from(l.status)),
                    &lock.map(|l| l.request.as_str()),
                    &lock.map(|l| l.instance.as_str()),
                    &vendor.map(|v| v.family.as_str()),
                    &vendor.map(|v| count(v.remaining)),
                    &vendor.and_then(|v| v.limit).map(count),
                    &vendor_reset.0,
                    &vendor_reset.1,
                    &vendor.map_or(0, |v| us(v.jitter())),
                    &vendor.map_or(0, |v| count(v.unanswered)),
                ],
            )
            .await?;
        let view = view_of(&row);
        // A write's answer holds the state as of its commit, which may come long after it
        // was sent (behind another write's row lock): it is taken as news of its arrival,
        // so that only a read sent after it replaces it.
        self.known.learned(destination, &view, Instant::now());
        Ok(view)
    }

    async fn settle(&self, budget: &str, rule: &Rule, units: i64) -> Result<(), StoreError> {
        let client = self.client().await?;
        // Units as seconds of the schedule: at most a meter's size of intervals, exact in f64.
        let secs = rule.interval.as_secs_f64() * units as f64;
        let charged = if rule.counts_sends() { units.max(0) } else { 0 };
        let order = rule.counts_sends();
        client
            .rows(SQL_SETTLE, &[&budget, &secs, &charged, &order])
            .await?;
        let charged = u32::try_from(charged).unwrap_or(u32::MAX);
        self.known.charged(budget, charged, Instant::now());
        Ok(())
    }

    async fn give_back(
        &self,
        budget: &str,
        rule: &Rule,
        slot: &Reservation,
        sent: Option<u64>,
        reserved: u32,
        units: u32,
    ) -> Result<(), StoreError> {
        let client = self.client().await?;
        let units = units.min(reserved);
        let secs = -rule.interval.as_secs_f64() * f64::from(units);
        let at = sent.map(|us| SystemTime::UNIX_EPOCH + Duration::from_micros(us));
        let order = rule.counts_sends();
        let params: [&dyn Param; 6] = [
            &budget,
            &secs,
            &at,
            &i64::from(reserved),
            &i64::from(units),
            &order,
        ];
        client.rows(SQL_GIVE_BACK, &params).await?;
        if at.is_some() {
            self.known.given_back(budget, slot.at, reserved, units);
        }
        Ok(())
    }

    async fn continue_after(&self, marks: &[(String, Instant)]) -> Result<(), StoreError> {
        let client = self.client().await?;
        let budgets: Vec<&str> = marks.iter().map(|(b, _)| b.as_str()).collect();
        // Seconds from now on this clock, read as late as can be: a store whose clock
        // differs places each mark no earlier than it is.
        let now = Instant::now();
        let ahead: Vec<f64> = marks
            .iter()
            .map(|(_, at)| at.saturating_duration_since(now).as_secs_f64())
            .collect();
        client.rows(SQL_CONTINUE_AFTER, &[&budgets, &ahead]).await?;
        self.known.continued(marks);
        Ok(())
    }

    async fn unlock(&self, destination: &str) -> Result<Option<Lockout>, StoreError> {
        let client = self.client().await?;
        let row = client.opt(SQL_UNLOCK, &[&destination]).await?;
        self.known.unlocked(destination);
        Ok(row.and_then(|r| lockout(r.get(0), r.get(1), r.get(2), r.get(3))))
    }

    async fn view(&self, destination: &str) -> Result<BudgetView, StoreError> {
        let asked = Instant::now();
        let client = self.client().await?;
        let row = client.opt(SQL_VIEW, &[&destination]).await?;
        let view = row.map_or(BudgetView::default(), |r| view_of(&r));
        self.known.learned(destination, &view, asked);
        Ok(view)
    }

    fn forget_budget(&self, budget: &str) {
        self.written.lock().remove(budget);
        self.known.forget(budget);
    }

    async fn key_secret(&self) -> Result<Vec<u8>, StoreError> {
        let client = self.client().await?;
        Ok(client.one(SQL_KEY_SECRET, &[]).await?.get(0))
    }

    async fn forget_keys(&self, parent: &str, idle: Duration) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let secs = idle.as_secs_f64();
        let row = client.one(SQL_FORGET_KEYS, &[&parent, &secs]).await?;
        Ok(u64::try_from(row.get::<_, i64>(0)).unwrap_or(0))
    }

    async fn snapshot(&self, destinations: &[(&str, &Rule)]) -> Result<Vec<Snapshot>, StoreError> {
        let asked = Instant::now();
        let names: Vec<&str> = destinations.iter().map(|(d, _)| *d).collect();
        let (windows, pers): (Vec<&str>, Vec<f64>) = destinations
            .iter()
            .flat_map(|(d, rule)| rule.quota.iter().map(move |q| (*d, q.per.as_secs_f64())))
            .unzip();
        let client = self.client().await?;
        let rows = client
            .rows(SQL_SNAPSHOT, &[&names, &windows, &pers, &self.instance])
            .await?;
        let snapshots: Vec<Snapshot> = rows
            .iter()
            .zip(destinations)
            .map(|(r, (_, rule))| snapshot_of(r, rule))
            .collect();
        for ((destination, _), s) in destinations.iter().zip(&snapshots) {
            self.known.learned(destination, &s.view, asked);
        }
        Ok(snapshots)
    }
}

#[cfg(test)]
#[path = "../../tests/support/testdb.rs"]
mod testdb;

#[cfg(test)]
mod model;
#[cfg(test)]
mod tests;
