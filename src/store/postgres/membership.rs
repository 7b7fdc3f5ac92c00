//! The postgres store as the fleet's membership: heartbeats, the other instances' ages and shares, and the
//! instances' rules compared.

use std::time::{Duration, SystemTime};

use super::sql::*;
use super::PostgresStore;
use crate::budget::StoreError;
use crate::fleet::{
    Instance, Membership, Peer, Report, Theirs, Written, ALONE_AFTER, HEARTBEAT, LIVE_WITHIN,
    PEERS_WITHIN, QUIET_AFTER, VIEW_FRESH,
};

/// How long after its lease ran out an instance's row is deleted: past the freshest view any
/// instance paces on, so that none still reads it as held.
const GONE_AFTER: Duration = VIEW_FRESH;

/// What the release before counts past an instance's last heartbeat and `alone_for`: the
/// lease of a row it wrote (it stamps none).
const OLDER_LEASE: Duration =
    Duration::from_secs(ALONE_AFTER.as_secs() + HEARTBEAT.as_secs() + VIEW_FRESH.as_secs());
use crate::status::InstanceStatus;

impl Membership for PostgresStore {
    async fn heartbeat(&self, me: &Instance, report: Report) -> Result<Vec<Peer>, StoreError> {
        let client = self.client().await?;
        let divisor = i32::try_from(report.divisor).unwrap_or(i32::MAX);
        let alone_ms = i64::try_from(report.alone_for.as_millis()).unwrap_or(i64::MAX);
        let old_lease = OLDER_LEASE.as_secs_f64();
        let rows = client
            .rows(
                SQL_HEARTBEAT,
                &[
                    &me.id,
                    &me.host,
                    &me.pid,
                    &me.version,
                    &divisor,
                    &alone_ms,
                    &report.lease().as_secs_f64(),
                    &GONE_AFTER.as_secs_f64(),
                    &old_lease,
                    &PEERS_WITHIN.as_secs_f64(),
                    &QUIET_AFTER.as_secs_f64(),
                ],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| {
                let instances = u32::try_from(r.get::<_, i64>(5)).unwrap_or(u32::MAX);
                let report = Report {
                    divisor: u32::try_from(r.get::<_, i32>(2)).unwrap_or(1).max(1),
                    alone_for: Duration::from_millis(
                        u64::try_from(r.get::<_, i64>(3)).unwrap_or(0),
                    ),
                };
                Peer {
                    id: r.get::<_, Option<String>>(0).unwrap_or_else(|| {
                        format!("{instances} instances counting {}", report.divisor)
                    }),
                    instances,
                    age: Duration::from_secs_f64(r.get::<_, f64>(1).max(0.0)),
                    report,
                    lease: Duration::from_secs_f64(r.get::<_, f64>(4).max(0.0)),
                }
            })
            .collect())
    }

    async fn live_instances(&self, within: Duration) -> Result<Vec<InstanceStatus>, StoreError> {
        let client = self.client().await?;
        let rows = client.rows(SQL_LIVE, &[&within.as_secs_f64()]).await?;
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

    async fn compare_rules(
        &self,
        me: &Instance,
        mine: &[Written],
        write: bool,
    ) -> Result<Vec<Theirs>, StoreError> {
        let client = self.client().await?;
        let destinations: Vec<&str> = mine.iter().map(|w| w.destination.as_str()).collect();
        let fingerprints: Vec<&str> = mine.iter().map(|w| w.fingerprint.as_str()).collect();
        if write {
            let rules: Vec<&str> = mine.iter().map(|w| w.rule.as_str()).collect();
            client
                .rows(
                    SQL_WRITE_RULES,
                    &[&me.id, &destinations, &fingerprints, &rules],
                )
                .await?;
        }
        let rows = client
            .rows(
                SQL_OTHER_RULES,
                &[
                    &me.id,
                    &destinations,
                    &fingerprints,
                    &LIVE_WITHIN.as_secs_f64(),
                ],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| Theirs {
                destination: r.get(0),
                instance: r.get(1),
                fingerprint: r.get(2),
                rule: r.get(3),
            })
            .collect())
    }

    async fn forget(&self, me: &Instance) -> Result<(), StoreError> {
        let client = self.client().await?;
        client.rows(SQL_FORGET, &[&me.id]).await?;
        client.rows(SQL_FORGET_RULES, &[&me.id]).await?;
        Ok(())
    }
}
