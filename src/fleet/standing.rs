//! This instance's standing in the fleet: the share of each rate it may use, on the shared
//! schedule beside instances that may be pacing alone ([`Standing::shared`]), or alone itself
//! once the store is lost ([`Standing::alone`]).

use std::time::Duration;

use parking_lot::Mutex;
use prometheus::{Gauge, IntGauge};
use tokio::time::Instant;

use super::{Peer, Report, ALONE_AFTER, LIVE_WITHIN, STALE_AFTER, VIEW_FRESH};
use crate::budget::StoreError;

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
