//! The database clock read on this instance's monotonic clock.
//!
//! A slot comes back as an instant of the database clock, with `clock_timestamp()` read
//! during the statement. That reading happened somewhere between sending the statement and
//! its answer's arrival, so the offset between the clocks lies between `sent - db_now` and
//! `arrived - db_now`. Every answer narrows one span, each end loosened over time by the most
//! the two clocks may drift apart ([`MAX_DRIFT`]), and a read-only probe (`SELECT
//! clock_timestamp()`, no commit to flush) narrows it to one quick round trip whenever it has
//! grown wider than [`PROBE_ABOVE`]. An answer outside the span shows that the database's
//! clock stepped; the span starts again from that answer.
//!
//! A slot is placed by the middle of the span, as NTP reads a clock: a network path takes
//! about as long each way. A store a network hop away cannot be read closer than its
//! quickest round trip, and placing by the span's upper end, counted as lateness, would make
//! every slot of an interval under about twice that round trip too late to use (distance
//! would cost the destination its rate). What the span is wider than the quickest round trip
//! (drift since the last probe, only slow answers seen) is how far a slot may be off unseen,
//! half of it each way, which the lateness check counts
//! ([`crate::budget::Reservation::unseen_late`]). Every instance reads the same database clock
//! this way, so their slots keep the beat against each other to within the difference of
//! their paths' asymmetries.
//!
//! The store places a slot no earlier than its "now" plus [`DbClock::lead`]: the time its
//! answers take from the database's reading of the clock to their arrival here, smoothed,
//! plus twice how far they stray from that (a commit's log flush that stalls now and then). A
//! slot at the database's bare "now" would reach the instance half a
//! round trip old, and a store farther away than the interval would grant only slots too late
//! to use. Under load the slots lie ahead anyway; the lead costs a lone request that time.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use tokio::time::Instant;

/// How fast the two clocks may drift apart: NTP slews a clock by at most 500 ppm, and both may
/// be slewed, in opposite directions.
const MAX_DRIFT: f64 = 1000e-6;

/// A span wider than this is worth a probe: it is lateness a slot carries unseen. A store
/// whose quickest round trip is slower (on another host, say) is probed only once the span is
/// twice that wide, since no probe can make it much narrower.
pub(super) const PROBE_ABOVE: Duration = Duration::from_micros(500);

/// The least time between two probes.
pub(super) const PROBE_EVERY: Duration = Duration::from_millis(50);

/// The offset between this instance's monotonic clock and the database's, bounded from both
/// sides.
pub(super) struct DbClock {
    /// What local instants are measured from.
    base: Instant,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    span: Option<Span>,
    /// The quickest round trip seen: about as narrow as a probe can make the span.
    quickest: Option<Duration>,
    /// When the last probe was started.
    probed: Option<Instant>,
    /// How long answers take from the database's clock reading to their arrival here,
    /// smoothed, in nanoseconds.
    back: Option<f64>,
    /// How far answers' ways back stray from `back`, smoothed, in nanoseconds.
    stray: f64,
}

/// How much of each new answer's way back the smoothed one takes in (as TCP smooths its
/// round trip, RFC 6298).
const SMOOTHING: f64 = 0.125;

/// How much of each new answer's stray from the smoothed way back the smoothed stray takes in
/// (RFC 6298's β).
const STRAY_SMOOTHING: f64 = 0.25;

/// How many smoothed strays the lead adds to the smoothed way back: a commit that stalls on
/// its log flush now and then (a busy disk) would otherwise bring its slot late beyond
/// `max_late`, and a dropped slot costs the destination its rate.
const STRAYS: f64 = 2.0;

/// The longest lead asked for: a store this far away is not one to pace on.
pub(super) const MAX_LEAD: Duration = Duration::from_secs(1);

/// Local nanoseconds since `base` minus database nanoseconds since the epoch, as of `at`.
#[derive(Clone, Copy)]
struct Span {
    lower: i128,
    upper: i128,
    at: Instant,
}

impl Span {
    /// The span as it may have grown by `now`.
    fn loosened(self, now: Instant) -> Self {
        let drift =
            (now.saturating_duration_since(self.at).as_nanos() as f64 * MAX_DRIFT).ceil() as i128;
        Self {
            lower: self.lower - drift,
            upper: self.upper + drift,
            at: now,
        }
    }

    fn width(&self) -> Duration {
        Duration::from_nanos(u64::try_from(self.upper - self.lower).unwrap_or(u64::MAX))
    }
}

/// One answer's reading of the database clock: turns the answer's instants into local ones.
#[derive(Debug, Clone, Copy)]
pub(super) struct Reading {
    base: Instant,
    offset: i128,
    /// How far a slot placed by this reading may be off, beyond what a path as long each way
    /// as the quickest round trip explains.
    pub(super) unseen_late: Duration,
}

impl DbClock {
    pub(super) fn new() -> Self {
        Self {
            base: Instant::now(),
            state: Mutex::new(State::default()),
        }
    }

    /// Takes in an answer sent at `sent` that read `db_now` and arrived at `arrived`.
    pub(super) fn read(&self, sent: Instant, arrived: Instant, db_now: SystemTime) -> Reading {
        let db = db_nanos(db_now);
        let seen = Span {
            lower: self.local_nanos(sent) - db,
            upper: self.local_nanos(arrived) - db,
            at: arrived,
        };
        let mut state = self.state.lock();
        let trip = arrived.saturating_duration_since(sent);
        let quickest = state.quickest.map_or(trip, |q| q.min(trip));
        state.quickest = Some(quickest);
        let narrowed = match state.span {
            Some(old) => {
                let old = old.loosened(arrived);
                if seen.upper < old.lower || seen.lower > old.upper {
                    // The database clock stepped: nothing before this answer holds.
                    seen
                } else {
                    Span {
                        lower: old.lower.max(seen.lower),
                        upper: old.upper.min(seen.upper),
                        at: arrived,
                    }
                }
            }
            None => seen,
        };
        state.span = Some(narrowed);
        let middle = (narrowed.lower + narrowed.upper) / 2;
        // This answer's way back: from the database's reading, placed by the middle, to here.
        let back = (seen.upper - middle).max(0) as f64;
        if let Some(b) = state.back {
            state.stray += STRAY_SMOOTHING * ((back - b).abs() - state.stray);
        }
        state.back = Some(state.back.map_or(back, |b| b + SMOOTHING * (back - b)));
        Reading {
            base: self.base,
            offset: middle,
            unseen_late: narrowed.width().saturating_sub(quickest) / 2,
        }
    }

    /// How far after its "now" the store places a slot for this instance, so that it arrives
    /// here about when it is due: the time answers take to come back, smoothed, and twice
    /// how far they stray from that (as TCP sets its timeout, RFC 6298), at most
    /// [`MAX_LEAD`]. An answer slower than that arrives late by the difference, which the
    /// lateness check allows up to [`crate::budget::Rule::max_late`], as next to the store.
    /// The margin for strays is at most half the quickest round trip: a lone request waits
    /// for it, and should wait about one round trip to the store, however jittery the path.
    /// Zero before any answer.
    pub(super) fn lead(&self) -> Duration {
        let state = self.state.lock();
        state.back.map_or(Duration::ZERO, |b| {
            let one_way = state.quickest.unwrap_or_default().as_nanos() as f64 / 2.0;
            let margin = (STRAYS * state.stray).min(one_way);
            Duration::from_nanos((b + margin).max(0.0) as u64).min(MAX_LEAD)
        })
    }

    /// The quickest round trip seen (zero before any).
    pub(super) fn quickest(&self) -> Duration {
        self.state.lock().quickest.unwrap_or_default()
    }

    /// Whether a probe should be sent now: the span is unknown or wider than [`PROBE_ABOVE`]
    /// (or twice the quickest round trip, if that is more), and no probe was started within
    /// [`PROBE_EVERY`]. Counts the probe as started.
    pub(super) fn probe_due(&self, now: Instant) -> bool {
        let mut state = self.state.lock();
        let above = PROBE_ABOVE.max(state.quickest.unwrap_or_default() * 2);
        let wide = state.span.is_none_or(|s| s.loosened(now).width() > above);
        let due = wide && state.probed.is_none_or(|at| now >= at + PROBE_EVERY);
        if due {
            state.probed = Some(now);
        }
        due
    }

    fn local_nanos(&self, t: Instant) -> i128 {
        if t >= self.base {
            (t - self.base).as_nanos() as i128
        } else {
            -((self.base - t).as_nanos() as i128)
        }
    }
}

impl Reading {
    /// The local instant of `t` on the database clock.
    pub(super) fn local(&self, t: SystemTime) -> Instant {
        let nanos = db_nanos(t) + self.offset;
        match u64::try_from(nanos) {
            Ok(n) => self.base + Duration::from_nanos(n),
            Err(_) if nanos < 0 => {
                let back = Duration::from_nanos(u64::try_from(-nanos).unwrap_or(u64::MAX));
                self.base.checked_sub(back).unwrap_or(self.base)
            }
            // Beyond five centuries from now: as far as the timer can be asked to wait.
            Err(_) => self.base + Duration::from_secs(86_400 * 365 * 30),
        }
    }
}

fn db_nanos(t: SystemTime) -> i128 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// The database clock at local instant `t`, reading `wall` at `base`.
    fn db_at(base: Instant, wall: SystemTime, t: Instant) -> SystemTime {
        wall + (t - base)
    }

    #[tokio::test(start_paused = true)]
    async fn a_quick_probe_places_the_slots_of_slow_answers_and_says_how_far_off_they_may_be() {
        let clock = DbClock::new();
        let base = Instant::now();
        let wall = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        // A reservation read the clock at 1 ms and came back after a 4 ms commit flush: the
        // middle of its span is 1.5 ms after the reading.
        let alone = clock.read(base, base + 5 * MS, db_at(base, wall, base + MS));
        let slot = db_at(base, wall, base + 40 * MS);
        let off = |r: Reading| {
            let at = r.local(slot);
            let truth = base + 40 * MS;
            at.saturating_duration_since(truth)
                .max(truth.saturating_duration_since(at))
        };
        assert_eq!(off(alone), 3 * MS / 2);
        // A probe: read at 10 ms, back 0.1 ms later.
        let t = base + 10 * MS;
        clock.read(t, t + MS / 10, db_at(base, wall, t));
        // A later reservation, as slow as the first, is placed by the probe's span.
        let t = base + 20 * MS;
        let after = clock.read(t, t + 5 * MS, db_at(base, wall, t + MS));
        assert!(off(after) <= MS / 10, "{:?} off", off(after));
        assert!(after.unseen_late <= MS / 10, "{:?}", after.unseen_late);
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_far_away_is_read_by_the_middle_of_its_round_trip_and_probed_only_when_the_span_has_grown(
    ) {
        let clock = DbClock::new();
        let base = Instant::now();
        let wall = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        // Every round trip takes 2 ms, the database reading its clock half way.
        let probe = |t: Instant| clock.read(t, t + 2 * MS, db_at(base, wall, t + MS));
        assert!(clock.probe_due(base));
        let first = probe(base);
        // Two milliseconds wide, as narrow as such a store can be read: nothing unseen, and
        // the slot placed on the truth.
        assert_eq!(first.unseen_late, Duration::ZERO);
        let slot = db_at(base, wall, base + 40 * MS);
        assert_eq!(first.local(slot), base + 40 * MS);
        // A second after the answer the span has grown by 2 ms (1000 ppm each way) to 4 ms,
        // twice the quickest round trip; before that it is not worth a probe, though far
        // wider than PROBE_ABOVE.
        let t = base + 2 * MS + Duration::from_secs(1);
        assert!(!clock.probe_due(t - MS));
        assert!(clock.probe_due(t + MS));
    }

    /// What a store `one_way` away, whose answers leave it `commit` after it read its clock,
    /// looks like to this instance: a probe, then reservations, each slot placed by the
    /// store at its "now" plus the lead the instance asked for. Returns the most any slot
    /// was late on arrival, counting what its reading could not see.
    fn latest_arrival(one_way: Duration, commits: &[Duration]) -> Duration {
        let clock = DbClock::new();
        let base = Instant::now();
        let wall = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let mut t = base;
        let probe_read = t + one_way;
        clock.read(t, probe_read + one_way, db_at(base, wall, probe_read));
        let mut latest = Duration::ZERO;
        for (i, commit) in commits.iter().cycle().take(200).enumerate() {
            t += 7 * MS;
            let lead = clock.lead();
            let read_at = t + one_way;
            let arrived = read_at + *commit + one_way;
            let r = clock.read(t, arrived, db_at(base, wall, read_at));
            let slot = db_at(base, wall, read_at + lead);
            let late = arrived.saturating_duration_since(r.local(slot)) + r.unseen_late;
            // The first answers teach the lead; from the tenth on none may come late.
            if i >= 10 {
                latest = latest.max(late);
            }
        }
        latest
    }

    #[tokio::test(start_paused = true)]
    async fn for_any_distance_to_the_store_no_slot_arrives_more_than_max_late_late() {
        // Rule::max_late is at least 2 ms.
        let max_late = 2 * MS;
        // Commits as a store's log flushes take them: steady, or varying by 2 ms.
        let steady = [MS / 2];
        let jittery = [MS / 3, 3 * MS / 2, MS / 2, 2 * MS, 4 * MS / 5];
        for one_way in [MS / 10, MS, 5 * MS, 25 * MS, 50 * MS, 100 * MS] {
            for commits in [&steady[..], &jittery[..]] {
                let late = latest_arrival(one_way, commits);
                assert!(
                    late <= max_late,
                    "a store {one_way:?} away, commits {commits:?}: a slot arrived {late:?} late"
                );
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_commit_that_stalls_now_and_then_brings_no_slot_late() {
        let max_late = 2 * MS;
        // Every fourth log flush stalls for 4 ms (a busy disk): the smoothed way back alone
        // would bring those slots 2.6 ms late. (A store 1 ms away gets a margin of half a
        // millisecond at most: not enough for stalls of 4 ms.)
        let stalling = [MS / 2, MS / 2, MS / 2, 4 * MS];
        for one_way in [5 * MS, 25 * MS, 50 * MS] {
            let late = latest_arrival(one_way, &stalling);
            assert!(
                late <= max_late,
                "a store {one_way:?} away, commits {stalling:?}: a slot arrived {late:?} late"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_span_loosens_with_time_and_restarts_when_the_database_clock_steps() {
        let clock = DbClock::new();
        let base = Instant::now();
        let wall = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        clock.read(base, base, db_at(base, wall, base));
        assert!(!clock.probe_due(base + MS));
        // Ten seconds later, the database clock has fallen 5 ms behind (500 ppm): the old
        // span would place its slots 5 ms early; loosened by up to 10 ms each way, it does not.
        let t = base + Duration::from_secs(10);
        assert!(clock.probe_due(t), "a span 20 ms wide is worth a probe");
        assert!(
            !clock.probe_due(t + MS),
            "but not two probes within PROBE_EVERY"
        );
        let behind = wall - 5 * MS;
        let r = clock.read(t, t + MS / 10, db_at(base, behind, t));
        let slot = db_at(base, behind, t + 50 * MS);
        assert!(r.local(slot) >= t + 50 * MS);
        assert!(r.local(slot) <= t + 50 * MS + MS / 10);
        // The database clock steps back by a second: no span survives it.
        let t = t + MS;
        let stepped = behind - Duration::from_secs(1);
        let r = clock.read(t, t + MS / 10, db_at(base, stepped, t));
        assert!(r.local(db_at(base, stepped, t + 20 * MS)) >= t + 20 * MS);
        assert!(r.unseen_late <= MS / 10);
        // Nor does a step forward, which would otherwise place slots a second late.
        let t = t + MS;
        let ahead = stepped + Duration::from_secs(2);
        let r = clock.read(t, t + MS / 10, db_at(base, ahead, t));
        let slot = r.local(db_at(base, ahead, t + 20 * MS));
        assert!(slot >= t + 20 * MS && slot <= t + 20 * MS + MS / 10);
    }
}
