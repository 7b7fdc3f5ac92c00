//! The fleet: every pacegate instance sharing a store, and this one among them.
//!
//! This module owns this instance's identity (made once per process start), the heartbeat
//! that keeps it counted as live and keeps its waiting requests' lease, the leases
//! themselves, this instance's [`Standing`] (the share of each rate it may use: on the
//! shared schedule beside instances that may be pacing alone, or alone itself), and the
//! supervisor that heartbeats and tells the failover when the store is lost and when it
//! answers again.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus::{Gauge, IntGauge};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::drift::{Theirs, Written};
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
const PROBE_MAX: Duration = Duration::from_secs(1);

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
/// The longest `[store] divide_for`.
pub const MAX_ALONE: Duration = crate::config::MAX_DIVIDE_FOR;
/// Heartbeat rows older than this concern nobody: no instance paces alone that long after.
pub const PEERS_WITHIN: Duration =
    Duration::from_secs(ALONE_AFTER.as_secs() + MAX_ALONE.as_secs() + 2 * VIEW_FRESH.as_secs());

/// What an instance writes of itself with each heartbeat: should it lose the store, it paces
/// alone at no more than `1 / divisor` of each rate, for at most `alone_for`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// The instances it counts, itself included.
    pub divisor: u32,
    /// `[store] divide_for`.
    pub alone_for: Duration,
}

/// Another instance, as a heartbeat's answer tells it.
#[derive(Debug, Clone, PartialEq)]
pub struct Peer {
    /// Its [`Instance::id`].
    pub id: String,
    /// How long before the answer its last heartbeat was.
    pub age: Duration,
    /// What it last reported of itself.
    pub report: Report,
}

impl Peer {
    /// How long after its last heartbeat its share stays held back. It paces alone for at
    /// most `alone_for` from [`ALONE_AFTER`] after its last *answered* heartbeat, which the
    /// store stamped up to a heartbeat's time (the longest wait for an answer) earlier; and
    /// ages read here may run ahead of the store's by up to [`VIEW_FRESH`] (a heartbeat of it
    /// newer than the view).
    fn held_until(&self) -> Duration {
        ALONE_AFTER + self.report.alone_for + HEARTBEAT + VIEW_FRESH
    }
}

/// A store that several instances share: they heartbeat into it and see each other.
pub trait Fleet: Send + Sync + 'static {
    /// Records that `me` is alive now, with its `report` (renewing its waiters' lease), and
    /// drops the waiting requests of instances whose lease ran out. Answers the other
    /// instances whose heartbeat is younger than [`PEERS_WITHIN`].
    fn heartbeat<'a>(
        &'a self,
        me: &'a Instance,
        report: Report,
    ) -> StoreFuture<'a, Result<Vec<Peer>, StoreError>>;

    /// Instances whose last heartbeat is younger than `within`.
    fn live_instances(
        &self,
        within: Duration,
    ) -> StoreFuture<'_, Result<Vec<InstanceStatus>, StoreError>>;

    /// Removes `me` from the live instances and its waiting requests (a clean shutdown).
    fn forget<'a>(&'a self, me: &'a Instance) -> StoreFuture<'a, Result<(), StoreError>>;

    /// Writes `mine` (when `write`: this instance's rules, one per destination) and answers
    /// the live instances' rules that differ from them (see [`super::drift`]).
    fn compare_rules<'a>(
        &'a self,
        me: &'a Instance,
        mine: &'a [Written],
        write: bool,
    ) -> StoreFuture<'a, Result<Vec<Theirs>, StoreError>>;
}

/// The fleet as this instance's last answered heartbeat saw it.
#[derive(Debug, Clone)]
struct View {
    /// When that heartbeat was sent. A peer's age now is at most its age in the answer plus
    /// the time since: reckoning from the sending errs towards holding a share back.
    asked: Instant,
    /// When it was answered: this instance's last heartbeat in the store is no later.
    answered: Instant,
    peers: Vec<Peer>,
}

impl View {
    fn age(&self, peer: &Peer, now: Instant) -> Duration {
        peer.age + now.saturating_duration_since(self.asked)
    }

    /// Peers that may be pacing alone now: their share is held back.
    fn held(&self, now: Instant) -> impl Iterator<Item = &Peer> {
        self.peers.iter().filter(move |p| {
            let age = self.age(p, now);
            age >= STALE_AFTER && age < p.held_until()
        })
    }

    /// Peers that were still counted when the store answered: fresh, or held back.
    fn counted(&self) -> impl Iterator<Item = &Peer> {
        self.peers.iter().filter(|p| p.age < p.held_until())
    }

    /// The share of every rate this instance may pace alone at, having written `divisor`:
    /// never more than the others hold back for it, and where the divisors disagree (an
    /// instance that had not yet counted this one), never more than they leave.
    fn alone_share(&self, divisor: u32) -> f64 {
        let others: f64 = self
            .counted()
            .map(|p| 1.0 / f64::from(p.report.divisor))
            .sum();
        (1.0 / f64::from(divisor)).min(1.0 - others)
    }
}

/// A part of every destination's rate: `share` of it, less `less` requests a second.
///
/// Schedules kept apart (the shared one, and each instance pacing alone) each may put one
/// request of slack into a 1 s window. The promise allows the fleet one, so every schedule
/// beside the first gives up a request a second: the shared schedule one for each instance
/// that may be pacing alone, and `n` instances all pacing alone `(n - 1) / n` each.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Split {
    /// The fraction of the rate.
    pub share: f64,
    /// Requests a second given up beside it.
    pub less: f64,
}

impl Split {
    /// The whole rate.
    pub const WHOLE: Split = Split {
        share: 1.0,
        less: 0.0,
    };

    /// The interval at this part of the rate whose interval is `interval`; `None` when
    /// nothing is left.
    pub fn interval(&self, interval: Duration) -> Option<Duration> {
        if *self == Self::WHOLE {
            return Some(interval);
        }
        let rate = self.share / interval.as_secs_f64() - self.less;
        (rate > 0.0).then(|| Duration::from_secs_f64(1.0 / rate))
    }
}

/// How an instance that lost the store may pace.
#[derive(Debug, Clone)]
pub enum Alone {
    /// Not yet: the others may not hold its share back yet.
    Wait(Duration),
    /// At this part of each rate.
    Pace(Split),
    /// Not at all.
    Refuse(StoreError),
}

/// This instance's standing in the fleet: what it reports of itself, what it last saw of the
/// others, and so what share of each rate it may use, on the shared schedule or alone.
///
/// One rule covers a full outage, a partial partition, a killed instance and recovery: an
/// instance that loses the store waits [`ALONE_AFTER`], then paces alone at no more than the
/// share it reported (1 / the instances it counted), for at most `alone_for`, then refuses.
/// The instances that keep the store leave the share of every instance whose heartbeat is
/// stale unused on the shared schedule for as long as that one may pace alone. Ages come
/// from the store's clock and this process's monotonic one, never from another machine's.
pub struct Standing {
    alone_for: Duration,
    hint: u32,
    state: Mutex<StandingState>,
    gauges: StandingGauges,
}

struct StandingState {
    view: Option<View>,
    /// The largest divisor written since the last answered heartbeat: a heartbeat may be
    /// taken by the store without its answer arriving, and pacing alone must not take more
    /// than the share the others hold back.
    reported: u32,
    /// The peers held back at the last answer, to log each change once.
    held: Vec<String>,
}

/// The gauges a [`Standing`] keeps.
pub struct StandingGauges {
    /// `pacegate_store_instances`.
    pub instances: IntGauge,
    /// `pacegate_store_share_held`.
    pub held: Gauge,
    /// `pacegate_store_share_alone`.
    pub alone: Gauge,
}

impl Standing {
    /// Counts `hint` instances until a heartbeat has counted them; paces alone for at most
    /// `alone_for`.
    pub fn new(hint: usize, alone_for: Duration, gauges: StandingGauges) -> Self {
        let hint = u32::try_from(hint.max(1)).unwrap_or(u32::MAX);
        gauges.instances.set(i64::from(hint));
        gauges.alone.set(1.0 / f64::from(hint));
        Self {
            alone_for,
            hint,
            state: Mutex::new(StandingState {
                view: None,
                reported: hint,
                held: Vec::new(),
            }),
            gauges,
        }
    }

    /// What the next heartbeat writes: the instances counted at the last answer, this one
    /// included. Remembered as written before it is sent.
    pub fn report(&self) -> Report {
        let mut state = self.state.lock();
        let divisor = state.view.as_ref().map_or(self.hint, |v| {
            1 + u32::try_from(v.counted().count()).unwrap_or(u32::MAX - 1)
        });
        state.reported = state.reported.max(divisor);
        Report {
            divisor,
            alone_for: self.alone_for,
        }
    }

    /// A heartbeat sent at `asked` with `report` was answered with `peers`. Returns whether
    /// the next heartbeat reports another divisor (it should go at once: until it does, the
    /// others reckon with the old one).
    pub fn answered(&self, asked: Instant, report: Report, peers: Vec<Peer>) -> bool {
        let now = Instant::now();
        let view = View {
            asked,
            answered: now,
            peers,
        };
        let live = 1 + view.peers.iter().filter(|p| p.age < LIVE_WITHIN).count();
        let held: Vec<&Peer> = view.held(now).collect();
        let share_held: f64 = held.iter().map(|p| 1.0 / f64::from(p.report.divisor)).sum();
        let held_ids: Vec<String> = held.iter().map(|p| p.id.clone()).collect();
        let mut state = self.state.lock();
        for p in &held {
            if !state.held.contains(&p.id) {
                tracing::warn!(
                    instance = %p.id,
                    "an instance sharing the store missed its heartbeats for {:.1}s: holding back 1/{} of every rate while it may pace alone (for up to {})",
                    p.age.as_secs_f64(),
                    p.report.divisor,
                    humantime::format_duration(p.held_until().saturating_sub(p.age)),
                );
            }
        }
        for id in &state.held {
            if !held_ids.contains(id) {
                tracing::info!(instance = %id, "an instance's share is no longer held back: it heartbeats again, or its time to pace alone is over");
            }
        }
        let divisor = 1 + u32::try_from(view.counted().count()).unwrap_or(u32::MAX - 1);
        let alone = view.alone_share(divisor.max(report.divisor));
        state.held = held_ids;
        state.view = Some(view);
        state.reported = report.divisor;
        self.gauges
            .instances
            .set(i64::try_from(live).unwrap_or(i64::MAX));
        self.gauges.held.set(share_held.min(1.0));
        self.gauges.alone.set(alone.max(0.0));
        divisor != report.divisor
    }

    /// The largest share divisor written since the last answer (or the hint).
    pub fn divisor(&self) -> u32 {
        self.state.lock().reported
    }

    /// The live instances last seen, this one included: heartbeats younger than
    /// [`LIVE_WITHIN`].
    pub fn live(&self) -> usize {
        usize::try_from(self.gauges.instances.get())
            .unwrap_or(1)
            .max(1)
    }

    /// The share of every rate held back at the last answer.
    pub fn share_held(&self) -> f64 {
        self.gauges.held.get()
    }

    /// The part of each rate the shared schedule may use now: what the instances that may be
    /// pacing alone leave. `None` while the last view is too old to tell.
    pub fn shared(&self, now: Instant) -> Option<Split> {
        let state = self.state.lock();
        let Some(view) = &state.view else {
            // Not counted yet: no instance holds this one's share, and it holds none; the
            // first heartbeat goes out as the instance starts.
            return Some(Split::WHOLE);
        };
        if now.saturating_duration_since(view.asked) > VIEW_FRESH {
            return None;
        }
        let (mut held, mut apart) = (0.0, 0.0);
        for p in view.held(now) {
            held += 1.0 / f64::from(p.report.divisor);
            apart += 1.0;
        }
        Some(Split {
            share: (1.0 - held).max(0.0),
            less: apart,
        })
    }

    /// How this instance may pace now, having lost the store.
    pub fn alone(&self, now: Instant) -> Alone {
        let state = self.state.lock();
        let Some(view) = &state.view else {
            return Alone::Refuse(StoreError::Unreachable(
                "this instance never reached the store, so no other holds a share for it".into(),
            ));
        };
        let since = now.saturating_duration_since(view.answered);
        if since < ALONE_AFTER {
            return Alone::Wait(ALONE_AFTER - since);
        }
        if since >= ALONE_AFTER + self.alone_for {
            return Alone::Refuse(StoreError::LongGone(since));
        }
        let share = view.alone_share(state.reported);
        let n = f64::from(state.reported);
        if share <= 0.0 {
            return Alone::Refuse(StoreError::Unreachable(
                "the other instances' shares leave this one none to pace alone on".into(),
            ));
        }
        Alone::Pace(Split {
            share,
            less: (n - 1.0) / n,
        })
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
pub async fn supervise<F: Fleet, H: Health>(
    fleet: &F,
    me: &Instance,
    standing: &Standing,
    health: &H,
    stop: CancellationToken,
) {
    let mut failures = 0u32;
    loop {
        let report = standing.report();
        let asked = Instant::now();
        // The heartbeat is off the request path: it gets more time than a reservation before
        // it declares the store unreachable.
        let beat = tokio::time::timeout(HEARTBEAT, fleet.heartbeat(me, report))
            .await
            .unwrap_or(Err(StoreError::Timeout(HEARTBEAT)));
        // The count changed: tell the others at once rather than in a second.
        let mut again = false;
        match beat {
            Ok(peers) => {
                failures = 0;
                again = standing.answered(asked, report, peers);
                if health.is_lost() {
                    if let Err(e) = health.answered().await {
                        tracing::debug!(
                            "store answered a heartbeat but not the lockout write-back: {e}"
                        );
                    }
                }
                health.heard().await;
            }
            // An unanswered heartbeat is a lost store: nothing else tells a partition apart.
            Err(e @ (StoreError::Unreachable(_) | StoreError::Timeout(_))) => {
                failures += 1;
                health.lost(&e);
            }
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
