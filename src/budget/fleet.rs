//! The fleet: every pacegate instance sharing a store, and this one among them.
//!
//! This module owns this instance's identity (made once per process start), the heartbeat
//! that keeps it counted as live and keeps its waiting requests' lease, the leases
//! themselves, the live count that `divide` splits the rate by, and the supervisor that
//! heartbeats and tells the failover when the store is lost and when it answers again.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use prometheus::IntGauge;
use tokio_util::sync::CancellationToken;

use super::{StoreError, StoreFuture};
use crate::status::InstanceStatus;

/// How often the supervisor heartbeats (and the longest it waits for a heartbeat's answer
/// before the store counts as lost).
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// An instance whose last heartbeat is older than this no longer counts as live.
pub const LIVE_WITHIN: Duration = Duration::from_secs(5);
/// An instance whose heartbeat is older than this no longer holds its waiters' places.
pub const WAITER_LEASE: Duration = Duration::from_secs(3);
/// The first probe after the store stopped answering, doubling up to [`PROBE_MAX`].
const PROBE_FIRST: Duration = Duration::from_millis(250);
/// The longest interval between probes of an unreachable store.
const PROBE_MAX: Duration = Duration::from_secs(2);

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
    /// This process, made once.
    pub fn this() -> &'static Instance {
        static THIS: OnceLock<Instance> = OnceLock::new();
        THIS.get_or_init(|| {
            let host = host_name();
            let pid = std::process::id();
            Instance {
                id: format!("{host}/{pid}/{:08x}", rand::random::<u32>()),
                host,
                pid: i32::try_from(pid).unwrap_or(0),
                version: env!("CARGO_PKG_VERSION").into(),
            }
        })
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

/// A store that several instances share: they heartbeat into it and see each other.
pub trait Fleet: Send + Sync + 'static {
    /// Records that `me` is alive now (renewing its waiters' lease), and drops the waiting
    /// requests of instances whose lease ran out.
    fn heartbeat<'a>(&'a self, me: &'a Instance) -> StoreFuture<'a, Result<(), StoreError>>;

    /// Instances whose last heartbeat is younger than `within`.
    fn live_instances(
        &self,
        within: Duration,
    ) -> StoreFuture<'_, Result<Vec<InstanceStatus>, StoreError>>;

    /// Removes `me` from the live instances and its waiting requests (a clean shutdown).
    fn forget<'a>(&'a self, me: &'a Instance) -> StoreFuture<'a, Result<(), StoreError>>;
}

/// The live instances last seen (at least 1), and their gauge.
pub struct LiveCount {
    n: AtomicUsize,
    gauge: IntGauge,
}

impl LiveCount {
    /// Assumes `hint` live instances until a heartbeat has counted them.
    pub fn new(hint: usize, gauge: IntGauge) -> Self {
        Self {
            n: AtomicUsize::new(hint.max(1)),
            gauge,
        }
    }

    /// The live instances last seen, at least 1.
    pub fn get(&self) -> usize {
        self.n.load(Ordering::SeqCst)
    }

    fn set(&self, live: usize) {
        self.n.store(live.max(1), Ordering::SeqCst);
        self.gauge.set(i64::try_from(live).unwrap_or(i64::MAX));
    }
}

/// What the supervisor tells about the store.
pub trait Health: Send + Sync {
    /// The store is gone.
    fn lost(&self, why: &StoreError);
    /// Whether the store is taken to be gone now.
    fn is_lost(&self) -> bool;
    /// The store answered a heartbeat while it was taken to be gone; `Err` if it is not
    /// ready to be used again (it did not take the lockouts written back).
    fn answered(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// How long the supervisor waits after `failures` heartbeats in a row went unanswered: a
/// heartbeat's interval while the store answers; while it is away, probes at growing
/// intervals (250 ms, 500 ms, 1 s, then every 2 s), so that pacing is back on the shared
/// budget within about two seconds of its return.
fn pause_after(failures: u32) -> Duration {
    if failures == 0 {
        HEARTBEAT
    } else {
        (PROBE_FIRST * 2u32.saturating_pow(failures - 1)).min(PROBE_MAX)
    }
}

/// Heartbeats `me` into `fleet` every [`HEARTBEAT`] until `stop`, keeps `live` current, and
/// tells `health` when the store is lost (a heartbeat unanswered, or refused for want of a
/// connection) and when it answers again. Removes `me` from the fleet on stop.
pub async fn supervise<F: Fleet, H: Health>(
    fleet: &F,
    me: &Instance,
    live: &LiveCount,
    health: &H,
    stop: CancellationToken,
) {
    let mut failures = 0u32;
    loop {
        // The heartbeat is off the request path: it gets more time than a reservation before
        // it declares the store unreachable.
        let beat = tokio::time::timeout(HEARTBEAT, fleet.heartbeat(me))
            .await
            .unwrap_or(Err(StoreError::Timeout(HEARTBEAT)));
        match beat {
            Ok(()) => {
                failures = 0;
                if health.is_lost() {
                    if let Err(e) = health.answered().await {
                        tracing::debug!(
                            "store answered a heartbeat but not the lockout write-back: {e}"
                        );
                    }
                }
                if let Ok(Ok(seen)) =
                    tokio::time::timeout(HEARTBEAT, fleet.live_instances(LIVE_WITHIN)).await
                {
                    live.set(seen.len());
                }
            }
            // An unanswered heartbeat is a lost store: nothing else tells a partition apart.
            Err(e @ (StoreError::Unreachable(_) | StoreError::Timeout(_))) => {
                failures += 1;
                health.lost(&e);
            }
            Err(e) => tracing::warn!("heartbeat refused: {e}"),
        }
        tokio::select! {
            () = tokio::time::sleep(pause_after(failures)) => {}
            () = stop.cancelled() => break,
        }
    }
    let _ = tokio::time::timeout(HEARTBEAT, fleet.forget(me)).await;
}
