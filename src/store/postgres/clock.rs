//! The database clock read on this instance's monotonic clock.
//!
//! A slot comes back as an instant of the database clock, with `clock_timestamp()` read
//! during the statement. That reading happened somewhere between sending the statement and
//! its answer's arrival, so the offset between the clocks lies between `sent - db_now` and
//! `arrived - db_now`. Placing a slot by the upper end can only make it later, never earlier.
//! But a reservation's answer comes back only after its commit is flushed to the log, so the
//! upper end of its own span is milliseconds too high, by an amount that differs from answer
//! to answer and from instance to instance: instances sharing a beat would place neighbouring
//! slots each late by its own error, closer together than the beat.
//!
//! So every answer narrows one span, each end loosened over time by the most the two clocks
//! may drift apart ([`MAX_DRIFT`]), and a read-only probe (`SELECT clock_timestamp()`, no
//! commit to flush) narrows it to one quick round trip whenever it has grown wider than
//! [`PROBE_ABOVE`]. A slot is placed by the upper end, so never early; how wide the span was
//! is how late the slot may already be unseen, which the lateness check counts
//! ([`crate::budget::Reservation::unseen_late`]). An answer outside the span shows that the
//! database's clock stepped; the span starts again from that answer.

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
}

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
    /// How much later than the truth a slot placed by this reading may be.
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
        state.quickest = Some(state.quickest.map_or(trip, |q| q.min(trip)));
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
        Reading {
            base: self.base,
            offset: narrowed.upper,
            unseen_late: narrowed.width(),
        }
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
    async fn a_quick_probe_places_the_slots_of_slow_answers_and_says_how_late_they_may_be() {
        let clock = DbClock::new();
        let base = Instant::now();
        let wall = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        // A reservation read the clock at 1 ms and came back after a 4 ms commit flush.
        let alone = clock.read(base, base + 5 * MS, db_at(base, wall, base + MS));
        let slot = db_at(base, wall, base + 40 * MS);
        let late = |r: Reading| r.local(slot).saturating_duration_since(base + 40 * MS);
        assert_eq!(late(alone), 4 * MS);
        assert_eq!(alone.unseen_late, 5 * MS, "its whole round trip is unseen");
        // A probe: read at 10 ms, back 0.1 ms later.
        let t = base + 10 * MS;
        clock.read(t, t + MS / 10, db_at(base, wall, t));
        // A later reservation, as slow as the first, is placed by the probe's span.
        let t = base + 20 * MS;
        let after = clock.read(t, t + 5 * MS, db_at(base, wall, t + MS));
        assert!(late(after) <= MS / 5, "{:?} late", late(after));
        assert!(after.unseen_late <= MS / 5, "{:?}", after.unseen_late);
        assert!(late(after) <= after.unseen_late);
        // Never early.
        assert!(after.local(slot) >= base + 40 * MS);
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_far_away_is_probed_only_when_the_span_has_grown() {
        let clock = DbClock::new();
        let base = Instant::now();
        let wall = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        // Every round trip takes 2 ms, the database reading its clock half way.
        let probe = |t: Instant| clock.read(t, t + 2 * MS, db_at(base, wall, t + MS));
        assert!(clock.probe_due(base));
        assert_eq!(probe(base).unseen_late, 2 * MS);
        // A second after the answer the span has grown by 2 ms (1000 ppm each way) to 4 ms,
        // twice the quickest round trip; before that it is not worth a probe, though far
        // wider than PROBE_ABOVE.
        let t = base + 2 * MS + Duration::from_secs(1);
        assert!(!clock.probe_due(t - MS));
        assert!(clock.probe_due(t + MS));
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
