//! The fleet: every pacegate instance sharing a store, and this one among them.
//!
//! Two seams: [`Membership`], where instances heartbeat and see each other (the postgres
//! store is one), and [`Fleet`], this instance among the others as pacing, status and the
//! admin listener see it. The runtime beside them:
//! - [`standing`]: this instance's share of each rate, on the shared schedule beside
//!   instances that may be pacing alone, or alone itself;
//! - [`heartbeat`]: the supervisor that heartbeats and tells the failover when the store is
//!   lost and when it answers again;
//! - [`failover`]: what happens while a shared store is lost (divide or refuse, lockout
//!   write-back);
//! - [`drift`]: instances whose rules differ (fingerprints, the stricter rule, and the
//!   `Agreement` that decides which rule governs).
//!
//! This instance's identity ([`Instance`]) is made once, by the caller, and passed in.
//! Nothing here names a store: the failover is handed its shared store, its membership and
//! its local fallback.

pub mod drift;
pub mod failover;
pub mod heartbeat;
pub mod standing;

use std::future::Future;
use std::time::Duration;

use crate::budget::{Rule, StoreError};
use crate::status::InstanceStatus;

/// How often the supervisor heartbeats (and the longest it waits for a heartbeat's answer
/// before the store counts as lost).
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// An instance whose last heartbeat is older than this no longer counts as live.
pub const LIVE_WITHIN: Duration = Duration::from_secs(5);
/// A wait list not renewed for this long (by its instance's reservations, or once a
/// heartbeat: [`crate::budget::Store::keep_waiting`]) no longer holds its places.
pub const WAITER_LEASE: Duration = Duration::from_secs(3);

/// A pacegate process as the fleet knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    /// Unique per process start: `host/pid/random`. Lockout records and wait lists name it.
    pub id: String,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: i32,
    /// pacegate version.
    pub version: String,
}

impl Instance {
    /// This process, with an id of its own: made once at start and passed to whatever names
    /// this instance (stores, lockout records, wait lists).
    pub fn new() -> Self {
        let host = host_name();
        let pid = std::process::id();
        Instance {
            id: format!("{host}/{pid}/{:08x}", rand::random::<u32>()),
            host,
            pid: i32::try_from(pid).unwrap_or(0),
            version: env!("CARGO_PKG_VERSION").into(),
        }
    }
}

impl Default for Instance {
    fn default() -> Self {
        Self::new()
    }
}

/// The machine's host name, as the operating system reports it.
fn host_name() -> String {
    hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// How long an instance may go without a heartbeat before the others hold its share back:
/// from then on it may be pacing alone.
pub const STALE_AFTER: Duration = Duration::from_secs(3);
/// The oldest view of the fleet an instance paces on. An older one could miss an instance
/// that went stale since; the instance then waits for a fresh one instead.
pub const VIEW_FRESH: Duration = Duration::from_secs(3);
/// How long after its last answered heartbeat an instance that lost the store waits before
/// it paces alone: [`STALE_AFTER`] plus [`VIEW_FRESH`], so that by then every instance that
/// still reaches the store has seen it stale and holds its share back.
pub const ALONE_AFTER: Duration = Duration::from_secs(6);
/// The window the promise is kept over. A schedule of its own may put its request of slack
/// anywhere in one, its last request too: an instance pacing alone stops this long before its
/// lease runs out, so that the others still hold its part back over every window its last
/// requests fall in.
pub const WINDOW: Duration = Duration::from_secs(1);
/// The longest `[store] divide_for`.
pub const MAX_ALONE: Duration = crate::config::MAX_DIVIDE_FOR;
/// Heartbeat rows older than this concern nobody: no instance's lease runs that long.
pub const PEERS_WITHIN: Duration =
    Duration::from_secs(ALONE_AFTER.as_secs() + MAX_ALONE.as_secs() + 2 * VIEW_FRESH.as_secs());

/// Peers heard within this come back in a heartbeat's answer as one [`Peer`] for each report
/// they share; quieter ones one by one. Two heartbeats short of [`STALE_AFTER`]: a group held
/// in a view as a whole once its oldest could be stale ([`standing`]) is, while heartbeats
/// keep their beat, replaced by the next view first.
pub const QUIET_AFTER: Duration =
    Duration::from_secs(STALE_AFTER.as_secs() - 2 * HEARTBEAT.as_secs());

/// What an instance writes of itself with each heartbeat: should it lose the store, it paces
/// alone at no more than `1 / divisor` of each rate, until its lease runs out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// The instances it counts, itself included.
    pub divisor: u32,
    /// `[store] divide_for`.
    pub alone_for: Duration,
}

impl Report {
    /// How long after the store stamps this heartbeat the instance's lease runs: the time
    /// it may still pace alone should this be the last heartbeat the store hears, and so how
    /// long the others hold its share back. The store keeps the expiry ([`Peer::lease`]),
    /// on its own clock, so that both sides reckon from one instant.
    pub fn lease(&self) -> Duration {
        ALONE_AFTER + self.alone_for
    }
}

/// Another instance as a heartbeat's answer tells it, or the instances heard within
/// [`QUIET_AFTER`] that reported the same: an answer's size, and what an instance does with
/// it, does not grow with the fleet.
#[derive(Debug, Clone, PartialEq)]
pub struct Peer {
    /// Its [`Instance::id`], or for a group, how many and what they count.
    pub id: String,
    /// How many instances this stands for.
    pub instances: u32,
    /// How long before the answer its last heartbeat was (the oldest's, for a group).
    pub age: Duration,
    /// What it last reported of itself.
    pub report: Report,
    /// How long its lease still ran when the store answered (zero once it ran out; the
    /// least, for a group): while it runs, the instance may be pacing alone, and its share is
    /// held back.
    pub lease: Duration,
}

/// Where instances that share a store heartbeat and see each other: the membership seam.
pub trait Membership: Send + Sync + 'static {
    /// Records that `me` is alive now, with its `report`. Answers the other instances whose
    /// heartbeat is younger than [`PEERS_WITHIN`]: those heard within [`QUIET_AFTER`] as one
    /// [`Peer`] for each report they share, the others one by one. (Wait lists are the budgets' and keep
    /// their own lease: [`crate::budget::Store::keep_waiting`].)
    fn heartbeat(
        &self,
        me: &Instance,
        report: Report,
    ) -> impl Future<Output = Result<Vec<Peer>, StoreError>> + Send;

    /// Instances whose last heartbeat is younger than `within`.
    fn live_instances(
        &self,
        within: Duration,
    ) -> impl Future<Output = Result<Vec<InstanceStatus>, StoreError>> + Send;

    /// Removes `me` from the live instances and their rules (a clean shutdown).
    fn forget(&self, me: &Instance) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Writes `mine` (when `write`: this instance's rules, one per destination) and answers
    /// the live instances' rules that differ from them (see [`drift`]).
    fn compare_rules(
        &self,
        me: &Instance,
        mine: &[Written],
        write: bool,
    ) -> impl Future<Output = Result<Vec<Theirs>, StoreError>> + Send;
}

/// A rule as instances compare it: canonical JSON, and its fingerprint (made by
/// [`Written::of`], in [`drift`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The destination.
    pub destination: String,
    /// The first 12 hex digits of the SHA-256 of `rule`.
    pub fingerprint: String,
    /// The canonical JSON of the rule's pacing keys.
    pub rule: String,
}

/// Another live instance's rule for a destination, where it differs from this one's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Theirs {
    /// The destination.
    pub destination: String,
    /// The instance.
    pub instance: String,
    /// Its fingerprint.
    pub fingerprint: String,
    /// Its canonical JSON (see [`Written`]).
    pub rule: String,
}

/// This instance among the others, as pacing, status and the admin listener see it.
#[async_trait::async_trait]
pub trait Fleet: Send + Sync + 'static {
    /// The live instances sharing the store; empty where it is not shared.
    async fn instances(&self) -> Result<Vec<InstanceStatus>, StoreError>;

    /// This instance's rule for every destination, to compare with the other instances'
    /// (see [`drift`]).
    fn announce(&self, rules: &[(String, Rule)]);

    /// The live instances whose rule for `destination` differs from this one's (the
    /// stricter governs); empty where they agree.
    fn drift(&self, destination: &str) -> Vec<String>;
}

/// A fleet of one: a store that no other instance shares.
#[derive(Debug, Clone, Copy, Default)]
pub struct Solo;

#[async_trait::async_trait]
impl Fleet for Solo {
    async fn instances(&self) -> Result<Vec<InstanceStatus>, StoreError> {
        Ok(Vec::new())
    }

    fn announce(&self, _rules: &[(String, Rule)]) {}

    fn drift(&self, _destination: &str) -> Vec<String> {
        Vec::new()
    }
}
