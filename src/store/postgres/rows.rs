//! Between Rust and the postgres store's rows: errors named by what happened, wait lists as
//! the arrays the SQL functions take, and rows read back into budgets and lockouts.

use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::budget::{
    BudgetView, ClassQueue, Lockout, Pause, PauseCause, Rule, Snapshot, StoreError, VendorView,
};
use crate::class::Class;
use crate::signals::Family;

/// A driver error, named by what happened. tokio-postgres' own message is only "db error",
/// so the whole cause chain is kept.
pub(super) fn db(e: tokio_postgres::Error) -> StoreError {
    let mut msg = format!("postgres: {e}");
    let mut io = e.is_closed();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        io |= s.is::<std::io::Error>();
        source = s.source();
    }
    match e.code().map(|c| c.code()) {
        // Connection exceptions, a server shutting down or not yet accepting connections,
        // too many connections: the store is not there for this instance.
        Some(c) if c.starts_with("08") || c.starts_with("57P") || c.starts_with("53") => {
            StoreError::Unreachable(msg)
        }
        // An undefined table or function: the schema is not this binary's.
        Some("42P01" | "42883") => StoreError::Schema(msg),
        // A prepared statement the server connection does not know, or knows already: a
        // pooler in transaction mode ran it on another server connection.
        Some("26000" | "42P05") => StoreError::Refused(format!(
            "{msg} (is the store behind a pooler in transaction mode, such as PgBouncer? set [store] statements = \"unnamed\")"
        )),
        Some(_) => StoreError::Refused(msg),
        // No answer from the server at all: the connection failed or closed, or its TLS
        // handshake did. (tokio-postgres does not expose its error kinds; an I/O cause, a
        // closed connection and its TLS message tell them apart.)
        None if io || e.to_string().starts_with("error performing TLS") => {
            StoreError::Unreachable(msg)
        }
        // A row or parameter that did not convert, an unexpected message: an odd answer.
        None => StoreError::Refused(msg),
    }
}

/// A wait list as the arrays `pacegate_tell` takes: classes, counts, and the ages in seconds
/// of the oldest and second oldest, now.
#[allow(clippy::type_complexity)]
pub(super) fn columns(queues: &[ClassQueue]) -> (Vec<i32>, Vec<i32>, Vec<f64>, Vec<Option<f64>>) {
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
pub(super) struct Row {
    class: Class,
    count: u32,
    oldest: Instant,
}

pub(super) fn rows_of(queues: &[ClassQueue]) -> Vec<Row> {
    queues
        .iter()
        .map(|q| Row {
            class: q.class,
            count: q.count,
            oldest: q.oldest,
        })
        .collect()
}

pub(super) fn lockout(
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

pub(super) fn view_of(row: &tokio_postgres::Row) -> BudgetView {
    BudgetView {
        backoff: row.get(0),
        generation: u64::try_from(row.get::<_, i64>(1)).unwrap_or(0),
        clean_streak: u32::try_from(row.get::<_, i32>(2)).unwrap_or(0),
        paused_for: Duration::from_secs_f64(row.get::<_, f64>(3).max(0.0)),
        lock: lockout(row.get(4), row.get(5), row.get(6), row.get(7)),
        paused_by: row
            .get::<_, Option<&str>>(8)
            .and_then(PauseCause::from_name),
        block_streak: u32::try_from(row.get::<_, i32>(9)).unwrap_or(0),
        vendor: (|| {
            Some(VendorView {
                family: Family::stored(row.get::<_, Option<&str>>(10)?)?,
                remaining: u64::try_from(row.get::<_, Option<i64>>(11)?).unwrap_or(0),
                limit: row
                    .get::<_, Option<i64>>(12)
                    .and_then(|l| u64::try_from(l).ok()),
                reset_in: Duration::try_from_secs_f64(row.get::<_, Option<f64>>(13)?).ok()?,
            })
        })(),
    }
}

/// A row of `SQL_SNAPSHOT`: the view's columns (a fresh budget where the row is missing),
/// then `known`, the waiting requests' classes, counts and oldest waits, and each of `rule`'s
/// quota windows' count.
pub(super) fn snapshot_of(row: &tokio_postgres::Row, rule: &Rule) -> Snapshot {
    let at = VIEW_COLUMNS;
    let view = if row.get::<_, bool>(at) {
        view_of(row)
    } else {
        BudgetView::default()
    };
    let classes: Vec<i32> = row.get::<_, Option<Vec<i32>>>(at + 1).unwrap_or_default();
    let counts: Vec<i64> = row.get::<_, Option<Vec<i64>>>(at + 2).unwrap_or_default();
    let oldest: Vec<f64> = row.get::<_, Option<Vec<f64>>>(at + 3).unwrap_or_default();
    let used: Vec<i64> = row.get::<_, Option<Vec<i64>>>(at + 4).unwrap_or_default();
    Snapshot {
        view,
        waiting: classes
            .iter()
            .zip(&counts)
            .zip(&oldest)
            .map(|((class, count), oldest)| {
                (
                    Class(u16::try_from(*class).unwrap_or(0)),
                    u32::try_from(*count).unwrap_or(0),
                    Duration::from_secs_f64(oldest.max(0.0)),
                )
            })
            .collect(),
        quota_used: rule
            .quota
            .iter()
            .enumerate()
            .map(|(i, q)| {
                used.get(i)
                    .map_or(0, |n| u32::try_from(*n).map_or(q.limit, |n| n.min(q.limit)))
            })
            .collect(),
    }
}

/// The columns [`view_of`] reads (`view_columns!` in `sql`).
pub(super) const VIEW_COLUMNS: usize = 14;

/// `later - earlier` on the database clock, zero when negative.
pub(super) fn after(later: SystemTime, earlier: SystemTime) -> Duration {
    later.duration_since(earlier).unwrap_or_default()
}

/// A pause as the SQL functions take it: seconds from now, or an instant of the database
/// clock (a date with nothing else to read it against).
pub(super) fn pause_args(pause: Option<Pause>) -> (Option<f64>, Option<SystemTime>) {
    match pause {
        None => (None, None),
        Some(Pause::For(d)) => (Some(d.as_secs_f64()), None),
        Some(Pause::Until(t)) => (None, Some(t)),
    }
}

/// A send's mark in the quota windows (see `budget::Reservation::sent`): its slot on the
/// database's clock, in µs since the Unix epoch, as `pacegate_sends.at` holds it.
pub(super) fn sent_mark(slot: SystemTime) -> u64 {
    slot.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}
