//! The supervisor: heartbeats this instance into the fleet's [`Membership`], keeps its
//! [`Standing`] current, and tells the failover ([`Health`]) when the store is lost and when
//! it answers again.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::standing::Standing;
use super::{Instance, Membership, HEARTBEAT};
use crate::budget::StoreError;

/// The first probe after the store stopped answering, doubling up to [`PROBE_MAX`].
const PROBE_FIRST: Duration = Duration::from_millis(250);
/// The longest interval between probes of an unreachable store.
const PROBE_MAX: Duration = Duration::from_secs(1);

/// What the supervisor tells about the store.
pub trait Health: Send + Sync {
    /// The store is gone.
    fn lost(&self, why: &StoreError);
    /// Whether the store is taken to be gone now.
    fn is_lost(&self) -> bool;
    /// The store is probed while it is taken to be gone, before the heartbeat: puts back
    /// what was done without it; `Err` if it is still gone, or not ready to be used again
    /// (it did not take what was put back). The heartbeat follows only on `Ok`.
    fn answered(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// The store answered a heartbeat: time for what is done once a heartbeat.
    fn heard(&self) -> impl Future<Output = ()> + Send;
}

/// How long the supervisor waits after `failures` heartbeats in a row went unanswered: a
/// heartbeat's interval while the store answers; while it is away, probes at growing
/// intervals (250 ms, 500 ms, then every second), so that pacing is back on the shared
/// budget within about a second of its return.
fn pause_after(failures: u32) -> Duration {
    if failures == 0 {
        HEARTBEAT
    } else {
        (PROBE_FIRST * 2u32.saturating_pow(failures - 1)).min(PROBE_MAX)
    }
}

/// Heartbeats `me` into `fleet` every [`HEARTBEAT`] until `stop`, keeps `standing` current,
/// and tells `health` when the store is lost (a heartbeat unanswered, or refused for want of
/// a connection) and when it answers again. Removes `me` from the fleet on stop.
pub async fn supervise<M: Membership, H: Health>(
    fleet: &M,
    me: &Instance,
    standing: &Standing,
    health: &H,
    stop: CancellationToken,
) {
    let mut failures = 0u32;
    loop {
        // Back from an outage, this instance first puts into the store what it did alone
        // (lockouts, the slots it handed out), and only then heartbeats: the others hold its
        // share back until they hear it again, so by then its slots alone are in the shared
        // schedule, whatever the order or timing in which instances come back.
        let back = if health.is_lost() {
            health.answered().await
        } else {
            Ok(())
        };
        let report = standing.report();
        let asked = Instant::now();
        // The heartbeat is off the request path: it gets more time than a reservation before
        // it declares the store unreachable.
        let beat = match back {
            Ok(()) => tokio::time::timeout(HEARTBEAT, fleet.heartbeat(me, report))
                .await
                .unwrap_or(Err(StoreError::Timeout(HEARTBEAT))),
            Err(e) => Err(e),
        };
        // The count changed: tell the others at once rather than in a second.
        let mut again = false;
        match beat {
            Ok(peers) => {
                failures = 0;
                again = standing.answered(asked, report, peers);
                health.heard().await;
            }
            // An unanswered heartbeat is a lost store: nothing else tells a partition apart.
            Err(e @ (StoreError::Unreachable(_) | StoreError::Timeout(_))) => {
                failures += 1;
                health.lost(&e);
            }
            // The store answers, but refused the heartbeat or what is put back on return
            // (a lockout's write): the next heartbeat tries again.
            Err(e) => tracing::warn!("heartbeat refused: {e}"),
        }
        let pause = if again {
            Duration::ZERO
        } else {
            pause_after(failures)
        };
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = stop.cancelled() => break,
        }
    }
    let _ = tokio::time::timeout(HEARTBEAT, fleet.forget(me)).await;
}
