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

/// A heartbeat's chores under way.
type Chores<'a> = std::pin::Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// Awaits `main` while driving `chores`, if any, beside it; `chores` is `None` once done.
async fn beside<T>(main: impl Future<Output = T>, chores: &mut Option<Chores<'_>>) -> T {
    tokio::pin!(main);
    loop {
        match chores {
            Some(running) => tokio::select! {
                out = &mut main => return out,
                () = running.as_mut() => *chores = None,
            },
            None => return main.await,
        }
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
    // The chores of the last answered heartbeat (`Health::heard`), driven beside the beat
    // rather than before the next one: with a store far away they take round trips, and a
    // beat held up by them would read as a stale instance to the others.
    let mut chores: Option<Chores<'_>> = None;
    loop {
        // Back from an outage, this instance first puts into the store what it did alone
        // (lockouts, the slots it handed out), and only then heartbeats: the others hold its
        // share back until they hear it again, so by then its slots alone are in the shared
        // schedule, whatever the order or timing in which instances come back.
        let back = if health.is_lost() {
            beside(health.answered(), &mut chores).await
        } else {
            Ok(())
        };
        let report = standing.report();
        let asked = Instant::now();
        // The heartbeat is off the request path: it gets more time than a reservation before
        // it declares the store unreachable.
        let beat = match back {
            Ok(()) => beside(
                tokio::time::timeout(HEARTBEAT, fleet.heartbeat(me, report)),
                &mut chores,
            )
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
                // One round of chores at a time: a round still going skips this one.
                if chores.is_none() {
                    chores = Some(Box::pin(health.heard()));
                }
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
        // The beat is kept from the heartbeat's sending, not from the end of what follows it.
        let stopped = beside(
            async {
                tokio::select! {
                    () = tokio::time::sleep_until(asked + pause) => false,
                    () = stop.cancelled() => true,
                }
            },
            &mut chores,
        )
        .await;
        if stopped {
            break;
        }
    }
    let _ = tokio::time::timeout(HEARTBEAT, fleet.forget(me)).await;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use parking_lot::Mutex;
    use prometheus::{Gauge, IntGauge};

    use super::*;
    use crate::fleet::standing::StandingGauges;
    use crate::fleet::{Peer, Report};
    use crate::status::InstanceStatus;

    /// Records when each heartbeat was sent.
    #[derive(Default)]
    struct Beats(Mutex<Vec<Instant>>);

    impl Membership for Beats {
        async fn heartbeat(
            &self,
            _me: &Instance,
            _report: Report,
        ) -> Result<Vec<Peer>, StoreError> {
            self.0.lock().push(Instant::now());
            Ok(Vec::new())
        }

        async fn live_instances(
            &self,
            _within: Duration,
        ) -> Result<Vec<InstanceStatus>, StoreError> {
            Ok(Vec::new())
        }

        async fn forget(&self, _me: &Instance) -> Result<(), StoreError> {
            Ok(())
        }

        async fn compare_rules(
            &self,
            _me: &Instance,
            _mine: &[crate::fleet::Written],
            _write: bool,
        ) -> Result<Vec<crate::fleet::Theirs>, StoreError> {
            Ok(Vec::new())
        }
    }

    /// A store whose once-a-heartbeat chores take 2.5 s (round trips to a store far away,
    /// through a busy pool).
    struct SlowChores(Arc<Mutex<u32>>);

    impl Health for SlowChores {
        fn lost(&self, _why: &StoreError) {}
        fn is_lost(&self) -> bool {
            false
        }
        async fn answered(&self) -> Result<(), StoreError> {
            Ok(())
        }
        async fn heard(&self) {
            tokio::time::sleep(Duration::from_millis(2_500)).await;
            *self.0.lock() += 1;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn slow_chores_do_not_hold_the_beat_up() {
        let beats = Beats::default();
        let done = Arc::new(Mutex::new(0));
        let standing = Standing::new(
            1,
            Duration::from_secs(10),
            StandingGauges {
                instances: IntGauge::new("i", "i").unwrap(),
                held: Gauge::new("h", "h").unwrap(),
                alone: Gauge::new("a", "a").unwrap(),
            },
        );
        let stop = CancellationToken::new();
        let me = Instance::new();
        let health = SlowChores(done.clone());
        let run = supervise(&beats, &me, &standing, &health, stop.clone());
        let stopper = async {
            tokio::time::sleep(Duration::from_millis(10_500)).await;
            stop.cancel();
        };
        tokio::join!(run, stopper);
        let at = beats.0.lock().clone();
        let gaps: Vec<u128> = at.windows(2).map(|w| (w[1] - w[0]).as_millis()).collect();
        // A beat a second, whatever the chores take; one round of them at a time.
        assert_eq!(gaps, vec![1_000; 10], "{gaps:?}");
        assert_eq!(*done.lock(), 3, "rounds of chores done");
    }
}
