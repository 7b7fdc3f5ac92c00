//! A failover that loses commits, and what this instance puts back.
//!
//! A standby promoted after the primary's last commits never reached it starts from less than
//! the fleet knew: a lockout taken after the standby was cut off is gone, and so are a pause,
//! a block streak, the backoff, the vendor's view and the latest slots. Every store handle
//! keeps the high-water marks of what it learned of each budget ([`Known`], from its own
//! grants and verdicts, and from the shared state read back once a heartbeat), and notices a
//! new server by its system identifier and timeline. The first connection to a new server merges every mark into it
//! (`pacegate_reassert`) before the pool hands that connection, or any other, to a request;
//! the merge only ever tightens a budget, so instances that put back the same knowledge, in
//! any order, leave it as the strictest of them knew it.
//!
//! Behind a pooler the server can change under a connection that stays open, so the server is
//! also checked once a heartbeat. Between a failover and that check, reservations on the new
//! server see what it holds.
//!
//! Times are put back as seconds from now on this instance's clock, each read as late as it
//! can be, so a new server with another clock places them no earlier than they were.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;

use super::rows::Row;
use crate::budget::Known;

/// The server this pool paces on: its system identifier and timeline, as
/// `IDENTIFIER:TIMELINE`. `NULL` from a standby, which is never paced from.
const SQL_SERVER: &str = "SELECT CASE WHEN NOT pg_is_in_recovery() THEN
        (SELECT system_identifier::text FROM pg_control_system()) || ':'
        || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) END";

/// The server by its timeline alone, where `pg_control_system()` is not granted (some managed
/// services): a promotion still starts a new timeline.
const SQL_TIMELINE: &str = "SELECT CASE WHEN NOT pg_is_in_recovery() THEN
        substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) END";

const SQL_REASSERT: &str = "SELECT pacegate_reassert_units($1, $2, $3, $4, $5, $6, $7, $8, $9,
    $10, $11, $12, $13, $14, $15, $16, $17, $18, $19)";

/// The server a store handle paces on, and what is put back into a new one.
pub(super) struct Reassert {
    /// Off: a new server is trusted as it is (`[store] reassert = false`).
    on: AtomicBool,
    /// What is put back: the store handle's record of its answers.
    known: Arc<Known>,
    /// The server last paced on; held while a new one is merged into, so that no connection
    /// to it serves a request before then.
    server: tokio::sync::Mutex<Option<String>>,
    /// The store's record of its wait lists' rows: a new server holds none of them.
    written: Arc<Mutex<HashMap<String, Option<Vec<Row>>>>>,
    /// Said once: the server cannot be told apart, so a failover goes unnoticed.
    blind: AtomicBool,
}

impl Reassert {
    pub(super) fn new(
        known: Arc<Known>,
        written: Arc<Mutex<HashMap<String, Option<Vec<Row>>>>>,
    ) -> Self {
        Self {
            on: AtomicBool::new(true),
            known,
            server: tokio::sync::Mutex::new(None),
            written,
            blind: AtomicBool::new(false),
        }
    }

    pub(super) fn set_on(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    pub(super) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Reads which server `client` is on; if it is not the one paced on so far, puts every
    /// mark into it first. Runs on each new connection, and once a heartbeat.
    pub(super) async fn check(&self, client: &Client) -> Result<(), tokio_postgres::Error> {
        // A server that answers with an error (a function not granted) is still paced on:
        // noticing a failover must never cost the store itself.
        let row = match client.query_typed(SQL_SERVER, &[]).await {
            Err(e) if e.code().is_some() => match client.query_typed(SQL_TIMELINE, &[]).await {
                Err(e) if e.code().is_some() => {
                    if !self.blind.swap(true, Ordering::Relaxed) {
                        tracing::warn!("cannot tell which server the store is ({e}); a failover that loses commits will not be noticed, and what it lost not put back");
                    }
                    return Ok(());
                }
                answer => answer?,
            },
            answer => answer?,
        };
        let Some(server) = row.first().and_then(|r| r.get::<_, Option<String>>(0)) else {
            // A standby: nothing is paced from it, so nothing is put back into it.
            return Ok(());
        };
        let mut known = self.server.lock().await;
        let Some(was) = known.as_deref() else {
            *known = Some(server);
            return Ok(());
        };
        if was == server {
            return Ok(());
        }
        self.written.lock().clear();
        if self.is_on() {
            let (budgets, tightened) = self.merge(client).await?;
            if budgets == 0 {
                // A handle that paces nothing (heartbeats): nothing to say.
                tracing::debug!(was, now = %server, "the store is a new server");
                *known = Some(server);
                return Ok(());
            }
            tracing::warn!(
                was,
                now = %server,
                budgets,
                tightened,
                "the store is a new server (a failover); what this instance knew of its budgets is put back before pacing on it"
            );
        } else {
            tracing::warn!(
                was,
                now = %server,
                "the store is a new server (a failover); reassert = false, so what it lost stays lost"
            );
        }
        *known = Some(server);
        Ok(())
    }

    /// Merges every mark into the server `client` is on; the marks sent, and how many
    /// budgets that tightened.
    async fn merge(&self, client: &Client) -> Result<(usize, i32), tokio_postgres::Error> {
        let now = Instant::now();
        let ahead = |at: Instant| at.saturating_duration_since(now).as_secs_f64();
        let mut m = Merge::default();
        for (budget, mark) in self.known.marks() {
            m.budgets.push(budget);
            m.next_in.push(mark.next.filter(|n| *n > now).map(ahead));
            let view = mark.view.as_ref();
            let paused = view
                .map(|(read, v)| (*read + v.paused_for, v))
                .filter(|(until, v)| *until > now && !v.paused_for.is_zero());
            m.paused_in.push(paused.map(|(until, _)| ahead(until)));
            m.paused_by.push(
                paused
                    .and_then(|(_, v)| v.paused_by)
                    .map(|c| c.as_str().to_owned()),
            );
            let v = view.map(|(_, v)| v);
            m.backoff.push(v.map(|v| v.backoff));
            m.generation
                .push(v.map(|v| i64::try_from(v.generation).unwrap_or(i64::MAX)));
            m.clean_streak
                .push(v.map(|v| i32::try_from(v.clean_streak).unwrap_or(i32::MAX)));
            m.block_streak
                .push(v.map(|v| i32::try_from(v.block_streak).unwrap_or(i32::MAX)));
            let lock = v.and_then(|v| v.lock.as_ref());
            m.lock_since.push(lock.map(|l| l.since));
            m.lock_status.push(lock.map(|l| i32::from(l.status)));
            m.lock_request.push(lock.map(|l| l.request.clone()));
            m.lock_instance.push(lock.map(|l| l.instance.clone()));
            let vendor = view.and_then(|(read, v)| Some((*read + v.vendor?.reset_in, v.vendor?)));
            let vendor = vendor.filter(|(reset, _)| *reset > now);
            m.vendor_family
                .push(vendor.map(|(_, v)| v.family.as_str().to_owned()));
            m.vendor_remaining
                .push(vendor.map(|(_, v)| i64::try_from(v.remaining).unwrap_or(i64::MAX)));
            m.vendor_limit.push(
                vendor
                    .and_then(|(_, v)| v.limit)
                    .map(|l| i64::try_from(l).unwrap_or(i64::MAX)),
            );
            m.vendor_reset_in
                .push(vendor.map(|(reset, _)| ahead(reset)));
            m.sends
                .push(i32::try_from(mark.sends.len()).unwrap_or(i32::MAX));
            m.send_units
                .extend(mark.sends.iter().map(|(_, units)| i64::from(*units)));
            m.send_in.extend(mark.sends.iter().map(|(at, _)| {
                // A slot already past is put back as past, by as little as can be.
                if *at >= now {
                    ahead(*at)
                } else {
                    -now.duration_since(*at).as_secs_f64()
                }
            }));
        }
        let sent = m.budgets.len();
        let params: [(&(dyn ToSql + Sync), Type); 19] = [
            (&m.budgets, Type::TEXT_ARRAY),
            (&m.next_in, Type::FLOAT8_ARRAY),
            (&m.paused_in, Type::FLOAT8_ARRAY),
            (&m.paused_by, Type::TEXT_ARRAY),
            (&m.backoff, Type::FLOAT8_ARRAY),
            (&m.generation, Type::INT8_ARRAY),
            (&m.clean_streak, Type::INT4_ARRAY),
            (&m.block_streak, Type::INT4_ARRAY),
            (&m.lock_since, Type::TIMESTAMPTZ_ARRAY),
            (&m.lock_status, Type::INT4_ARRAY),
            (&m.lock_request, Type::TEXT_ARRAY),
            (&m.lock_instance, Type::TEXT_ARRAY),
            (&m.vendor_family, Type::TEXT_ARRAY),
            (&m.vendor_remaining, Type::INT8_ARRAY),
            (&m.vendor_limit, Type::INT8_ARRAY),
            (&m.vendor_reset_in, Type::FLOAT8_ARRAY),
            (&m.sends, Type::INT4_ARRAY),
            (&m.send_in, Type::FLOAT8_ARRAY),
            (&m.send_units, Type::INT8_ARRAY),
        ];
        let rows = client.query_typed(SQL_REASSERT, &params).await?;
        let tightened = rows.first().map_or(0, |r| r.get::<_, i32>(0));
        Ok((sent, tightened))
    }
}

/// The marks as `pacegate_reassert` takes them: one element per budget in each array, and
/// the sends of all of them in one.
#[derive(Default)]
struct Merge {
    budgets: Vec<String>,
    next_in: Vec<Option<f64>>,
    paused_in: Vec<Option<f64>>,
    paused_by: Vec<Option<String>>,
    backoff: Vec<Option<f64>>,
    generation: Vec<Option<i64>>,
    clean_streak: Vec<Option<i32>>,
    block_streak: Vec<Option<i32>>,
    lock_since: Vec<Option<SystemTime>>,
    lock_status: Vec<Option<i32>>,
    lock_request: Vec<Option<String>>,
    lock_instance: Vec<Option<String>>,
    vendor_family: Vec<Option<String>>,
    vendor_remaining: Vec<Option<i64>>,
    vendor_limit: Vec<Option<i64>>,
    vendor_reset_in: Vec<Option<f64>>,
    sends: Vec<i32>,
    send_in: Vec<f64>,
    send_units: Vec<i64>,
}

#[cfg(test)]
mod tests;
