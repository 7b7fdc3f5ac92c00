//! This instance's standing in the fleet: the share of each rate it may use, on the shared
//! schedule beside instances that may be pacing alone ([`Standing::shared`]), or alone itself
//! once the store is lost ([`Standing::alone`]).

use std::time::Duration;

use parking_lot::Mutex;
use prometheus::{Gauge, IntGauge};
use tokio::time::Instant;

use super::{Peer, Report, ALONE_AFTER, LIVE_WITHIN, STALE_AFTER, VIEW_FRESH, WINDOW};
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

    /// Peers that may be pacing alone now: stale, and their lease still runs. The store read
    /// what was left of a lease before its answer arrived, so counting it from the arrival
    /// ends the hold no earlier than the lease. A group of peers heard recently is held as a
    /// whole once its oldest could be stale: that errs towards holding back.
    fn held(&self, now: Instant) -> impl Iterator<Item = &Peer> {
        self.peers
            .iter()
            .filter(move |p| self.age(p, now) >= STALE_AFTER && now < self.answered + p.lease)
    }

    /// Peers that were still counted when the store answered: their lease ran.
    fn counted(&self) -> impl Iterator<Item = &Peer> {
        self.peers.iter().filter(|p| !p.lease.is_zero())
    }

    /// How many instances the counted peers are.
    fn counted_instances(&self) -> u32 {
        self.counted()
            .fold(0u32, |n, p| n.saturating_add(p.instances))
    }

    /// The share of every rate this instance may pace alone at, having written `divisor`:
    /// never more than the others hold back for it, and where the divisors disagree (an
    /// instance that had not yet counted this one), never more than they leave.
    fn alone_share(&self, divisor: u32) -> f64 {
        let others: f64 = self.counted().map(Peer::share).sum();
        (1.0 / f64::from(divisor)).min(1.0 - others)
    }
}

impl Peer {
    /// The part of every rate these instances may pace alone at, together.
    fn share(&self) -> f64 {
        f64::from(self.instances) / f64::from(self.report.divisor)
    }
}

/// A part of every destination's rate for an instance pacing alone: `share` of it, less
/// `less` requests a second.
///
/// Schedules kept apart (the shared one, and each instance pacing alone) each may put one
/// request of slack into a 1 s window. The promise allows the fleet one, and the shared
/// schedule keeps it, so an instance pacing alone gives up a whole request a second of its
/// share: its schedule then puts at most its share of the rate into any 1 s window, which is
/// what the shared schedule holds back for it ([`Held`]), and no more. An instance whose
/// share is a request a second or less does not pace alone.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Split {
    /// The fraction of the rate.
    pub share: f64,
    /// Requests a second given up beside it.
    pub less: f64,
}

impl Split {
    /// The interval at this part of the rate whose interval is `interval`; `None` when
    /// nothing is left.
    pub fn interval(&self, interval: Duration) -> Option<Duration> {
        let rate = self.share / interval.as_secs_f64() - self.less;
        (rate > 0.0).then(|| Duration::from_secs_f64(1.0 / rate))
    }
}

/// The instances that may be pacing alone, whose part the shared schedule leaves unused.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Held {
    /// The divisor each reported.
    divisors: Vec<u32>,
}

impl Held {
    /// Nobody held back: the whole rate.
    pub const NONE: Held = Held {
        divisors: Vec::new(),
    };

    /// Instances that reported `divisors`, held back.
    pub fn of(divisors: Vec<u32>) -> Self {
        Self { divisors }
    }

    /// The interval the shared schedule keeps of a rule whose interval is `interval` (rate
    /// `R`): `R` less `R / d` for each instance held back that reported `d`, which is the
    /// most its schedule puts into a 1 s window pacing alone ([`Split`]). Counted once for
    /// the fleet, since every instance reserves on the one shared schedule at this interval.
    /// One whose share is a request a second or less (`R <= d`) sends nothing alone and
    /// costs nothing. `None` when nothing is left.
    pub fn interval(&self, interval: Duration) -> Option<Duration> {
        let rate = 1.0 / interval.as_secs_f64();
        let held: f64 = self
            .divisors
            .iter()
            .map(|d| f64::from(*d))
            // The same test as pacing alone makes (`Split::interval` above zero), with room
            // for rounding: held back wherever it might pace.
            .filter(|d| rate > d - 1e-9)
            .map(|d| rate / d)
            .sum();
        if held == 0.0 {
            return Some(interval);
        }
        let left = rate - held;
        (left > 1e-9).then(|| Duration::from_secs_f64(1.0 / left))
    }
}

/// How an instance that lost the store may pace.
#[derive(Debug, Clone)]
pub enum Alone {
    /// Not yet: the others may not hold its share back yet.
    Wait(Duration),
    /// At this part of each rate, with no slot after the instant given: a [`WINDOW`] before
    /// the lease runs out, when the others stop holding this instance's share back.
    Pace(Split, Instant),
    /// Not at all.
    Refuse(StoreError),
}

/// This instance's standing in the fleet: what it reports of itself, what it last saw of the
/// others, and so what share of each rate it may use, on the shared schedule or alone.
///
/// One rule covers a full outage, a partial partition, a killed instance and recovery: an
/// instance that loses the store waits [`ALONE_AFTER`], then paces alone at no more than the
/// share it reported (1 / the instances it counted) until a [`WINDOW`] before its lease runs
/// out ([`Report::lease`] after its last answered heartbeat was sent), then refuses. The
/// instances that keep the store leave what each stale instance may send alone unused on the
/// shared schedule ([`Held`]) until its lease, as the store stamped it, runs out: one expiry
/// both sides read from the store, not a countdown each keeps. A killed instance and a
/// cut-off one cost the same: their own part, for the lease. Ages and leases come from the
/// store's clock and this process's monotonic one, never from another machine's.
pub struct Standing {
    alone_for: Duration,
    hint: u32,
    /// Whether the shared schedule holds back the part of instances that may be pacing alone:
    /// always, but where a test of the binary turns it off to show the ceiling breaks without
    /// it ([`Standing::without_hold_back`]).
    hold_back: bool,
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
            hold_back: true,
            state: Mutex::new(StandingState {
                view: None,
                reported: hint,
                held: Vec::new(),
            }),
            gauges,
        }
    }

    /// Holds nothing back for instances that may be pacing alone, so that a test can show the
    /// ceiling breaks without it. Honoured only in debug builds: a release never runs so.
    pub fn without_hold_back(mut self) -> Self {
        self.hold_back = !cfg!(debug_assertions);
        self
    }

    /// What the next heartbeat writes: the instances counted at the last answer, this one
    /// included. Remembered as written before it is sent.
    pub fn report(&self) -> Report {
        let mut state = self.state.lock();
        let divisor = state
            .view
            .as_ref()
            .map_or(self.hint, |v| v.counted_instances().saturating_add(1));
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
        let live = view
            .peers
            .iter()
            .filter(|p| p.age < LIVE_WITHIN)
            .fold(1u32, |n, p| n.saturating_add(p.instances));
        let held: Vec<&Peer> = view.held(now).collect();
        let share_held: f64 = held.iter().map(|p| p.share()).sum();
        let held_ids: Vec<String> = held.iter().map(|p| p.id.clone()).collect();
        let mut state = self.state.lock();
        for p in &held {
            if !state.held.contains(&p.id) {
                tracing::warn!(
                    instance = %p.id,
                    "an instance sharing the store missed its heartbeats for {:.1}s: holding back what it may send pacing alone at 1/{} of a rate, until its lease in the store runs out (in {})",
                    p.age.as_secs_f64(),
                    p.report.divisor,
                    humantime::format_duration(Duration::from_secs(p.lease.as_secs())),
                );
            }
        }
        for id in &state.held {
            if !held_ids.contains(id) {
                tracing::info!(instance = %id, "an instance's share is no longer held back: it heartbeats again, or its time to pace alone is over");
            }
        }
        let divisor = view.counted_instances().saturating_add(1);
        let alone = view.alone_share(divisor.max(report.divisor));
        state.held = held_ids;
        state.view = Some(view);
        state.reported = report.divisor;
        self.gauges.instances.set(i64::from(live));
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

    /// The instances whose part the shared schedule leaves unused now: those that may be
    /// pacing alone ([`Held::interval`]). `None` while the last view is too old to tell.
    pub fn shared(&self, now: Instant) -> Option<Held> {
        if !self.hold_back {
            return Some(Held::NONE);
        }
        let state = self.state.lock();
        let Some(view) = &state.view else {
            // Not counted yet: no instance holds this one's share, and it holds none; the
            // first heartbeat goes out as the instance starts.
            return Some(Held::NONE);
        };
        if now.saturating_duration_since(view.asked) > VIEW_FRESH {
            return None;
        }
        Some(Held::of(
            view.held(now)
                .flat_map(|p| std::iter::repeat_n(p.report.divisor, p.instances as usize))
                .collect(),
        ))
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
        // The lease the store stamped with that heartbeat runs out no earlier than its
        // length after it was sent: the others hold this share back at least that long, and
        // for a window after this instance's last request alone.
        let lease = Report {
            divisor: state.reported,
            alone_for: self.alone_for,
        }
        .lease();
        let until = view.asked + lease - WINDOW;
        if now >= until {
            return Alone::Refuse(StoreError::LongGone(since));
        }
        let share = view.alone_share(state.reported);
        if share <= 0.0 {
            return Alone::Refuse(StoreError::Unreachable(
                "the other instances' shares leave this one none to pace alone on".into(),
            ));
        }
        Alone::Pace(Split { share, less: 1.0 }, until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn standing() -> Standing {
        let gauge = |name: &str| Gauge::new(name, name).unwrap();
        Standing::new(
            1,
            Duration::from_secs(10),
            StandingGauges {
                instances: IntGauge::new("instances", "instances").unwrap(),
                held: gauge("held"),
                alone: gauge("alone"),
            },
        )
    }

    /// What an instance counting `n` writes, with `divide_for` 10 s.
    fn report(n: u32) -> Report {
        Report {
            divisor: n,
            alone_for: Duration::from_secs(10),
        }
    }

    /// `n` instances in all, this one included; `silent[i]` is how long ago the i-th silent
    /// one last heartbeat and how long its lease still runs now.
    fn peers(n: u32, silent: &[(Duration, Duration)]) -> Vec<Peer> {
        let report = report(n);
        (1..n)
            .map(|i| {
                let (age, lease) = silent
                    .get(i as usize - 1)
                    .copied()
                    .unwrap_or((Duration::ZERO, report.lease()));
                Peer {
                    id: format!("peer-{i}"),
                    instances: 1,
                    age,
                    report,
                    lease,
                }
            })
            .collect()
    }

    /// The rate the shared schedule keeps of `rate` now.
    fn shared_rate(standing: &Standing, rate: f64) -> f64 {
        let interval = Duration::from_secs_f64(1.0 / rate);
        let held = standing.shared(Instant::now()).expect("a fresh view");
        held.interval(interval)
            .map_or(0.0, |i| 1.0 / i.as_secs_f64())
    }

    #[tokio::test(start_paused = true)]
    async fn the_share_held_back_is_the_sum_of_the_silent_ones_own_and_ends_with_the_last_lease() {
        let standing = standing();
        let me = report(20);
        // Five of twenty silent for 4 s, their leases with 2 to 10 s to run.
        let leases = [2, 4, 6, 8, 10].map(Duration::from_secs);
        let started = Instant::now();
        let mut last = f64::NAN;
        let mut seen = Vec::new();
        for second in 0..12u64 {
            let now = Instant::now();
            let gone = now - started;
            let silent: Vec<(Duration, Duration)> = leases
                .iter()
                .map(|l| (4 * S + gone, l.saturating_sub(gone)))
                .collect();
            standing.answered(now, me, peers(20, &silent));
            // At rate 100 each holds its own 100 / 20.
            let live = silent.iter().filter(|(_, l)| !l.is_zero()).count() as f64;
            let rate = shared_rate(&standing, 100.0);
            assert!(
                (rate - (100.0 - 5.0 * live)).abs() < 1e-4,
                "second {second}: {rate} with {live} leases running"
            );
            if rate != last {
                seen.push(rate.round() as u32);
                last = rate;
            }
            // At rate 5 none of them may pace alone (a share of 1/4 a second): none costs.
            assert!((shared_rate(&standing, 5.0) - 5.0).abs() < 1e-4);
            tokio::time::advance(S).await;
        }
        assert_eq!(
            seen,
            [75, 80, 85, 90, 95, 100],
            "one share back at each lease's end"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_group_counts_as_its_instances_and_is_held_whole_once_its_oldest_could_be_stale() {
        let standing = standing();
        let me = report(20);
        let group = |age: Duration| Peer {
            id: "14 instances counting 20".into(),
            instances: 14,
            age,
            report: me,
            lease: me.lease() - age,
        };
        let mut peers = peers(20, &[(5 * S, 5 * S); 5]);
        peers.truncate(5);
        peers.push(group(S / 2));
        // Twenty in all: five silent one by one, fourteen in a group, and this one.
        assert!(!standing.answered(Instant::now(), me, peers.clone()));
        assert_eq!(standing.report().divisor, 20);
        assert_eq!(standing.live(), 15);
        assert!((standing.share_held() - 0.25).abs() < 1e-9);
        assert!((shared_rate(&standing, 100.0) - 75.0).abs() < 1e-4);
        // Heartbeats late: the group's oldest could be stale by now, and is held whole.
        tokio::time::advance(STALE_AFTER - S / 2).await;
        assert!((shared_rate(&standing, 100.0) - 5.0).abs() < 1e-4);
        // A group that had not yet counted this one (it reports 19) leaves less to pace
        // alone on: never more than the others hold back for it.
        let mut behind = peers.clone();
        behind[5].report = report(19);
        let counted = self::standing();
        counted.answered(Instant::now(), me, behind);
        let left = 1.0 - 5.0 / 20.0 - 14.0 / 19.0;
        assert!((counted.gauges.alone.get() - left).abs() < 1e-9);
        // The same instances one by one count the same.
        let apart: Vec<Peer> = (0..14)
            .map(|i| Peer {
                id: format!("apart-{i}"),
                instances: 1,
                ..group(S / 2)
            })
            .chain(peers[..5].iter().cloned())
            .collect();
        let one_by_one = self::standing();
        one_by_one.answered(Instant::now(), me, apart);
        assert_eq!(one_by_one.report().divisor, 20);
        assert_eq!(one_by_one.live(), 15);
        assert!((shared_rate(&one_by_one, 100.0) - 75.0).abs() < 1e-4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_ends_the_hold_between_heartbeats_by_the_time_it_had_left() {
        let standing = standing();
        let me = report(4);
        standing.answered(Instant::now(), me, peers(4, &[(5 * S, 2 * S)]));
        assert!((shared_rate(&standing, 40.0) - 30.0).abs() < 1e-4);
        tokio::time::advance(2 * S - Duration::from_millis(1)).await;
        assert!((shared_rate(&standing, 40.0) - 30.0).abs() < 1e-4);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!((shared_rate(&standing, 40.0) - 40.0).abs() < 1e-4);
    }

    #[tokio::test(start_paused = true)]
    async fn k_of_n_silent_leave_the_live_fleet_its_shares_and_every_window_within_r_plus_one() {
        for (rate, n, k) in [
            (5.0, 20, 5),
            (5.0, 6, 2),
            (5.0, 3, 1),
            (2.0, 2, 1),
            (30.0, 6, 2),
            (100.0, 20, 5),
            (1000.0, 50, 49),
            (12.0, 4, 3),
        ] {
            let standing = standing();
            let me = report(n);
            let silent = vec![(5 * S, 5 * S); k as usize];
            standing.answered(Instant::now(), me, peers(n, &silent));
            let shared = shared_rate(&standing, rate);
            let due = rate * f64::from(n - k) / f64::from(n);
            assert!(
                shared >= 0.9 * due,
                "rate {rate}, {k} of {n} silent: the live fleet keeps {shared}, due {due}"
            );
            // What each silent one may send alone, were it cut off rather than killed.
            let alone = Split {
                share: 1.0 / f64::from(n),
                less: 1.0,
            }
            .interval(Duration::from_secs_f64(1.0 / rate))
            .map_or(0.0, |i| 1.0 / i.as_secs_f64());
            // A schedule at rate r puts at most floor(r) + 1 into a 1 s window.
            let window = |r: f64| if r > 0.0 { r.floor() + 1.0 } else { 0.0 };
            let most = window(shared) + f64::from(k) * window(alone);
            assert!(
                most <= rate + 1.0 + 1e-9,
                "rate {rate}, {k} of {n} silent: up to {most} in a 1 s window"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn pacing_alone_ends_a_window_before_the_lease_reckoned_from_the_heartbeat_s_sending() {
        let standing = standing();
        let me = report(2);
        let asked = Instant::now();
        // The answer took half a second: the store stamped the lease no earlier than asked.
        tokio::time::advance(S / 2).await;
        standing.answered(asked, me, peers(2, &[]));
        tokio::time::advance(ALONE_AFTER).await;
        assert!(matches!(standing.alone(Instant::now()), Alone::Pace(..)));
        // A window before the lease runs out, the last request alone.
        let end = asked + me.lease() - WINDOW;
        tokio::time::advance(end - Instant::now() - Duration::from_millis(1)).await;
        assert!(matches!(standing.alone(Instant::now()), Alone::Pace(..)));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(matches!(
            standing.alone(Instant::now()),
            Alone::Refuse(StoreError::LongGone(_))
        ));
    }
}
