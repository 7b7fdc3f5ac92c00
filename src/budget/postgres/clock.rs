//! The database clock read on this instance's monotonic clock.
//!
//! A slot comes back as an instant of the database clock, with `clock_timestamp()` read
//! during the statement. That reading happened somewhere between sending the statement and
//! its answer's arrival, so `arrived - db_now` bounds the offset between the clocks from
//! above: placing a slot with it can only make the slot later, never earlier. But each answer
//! alone is late by its own way back (the database writing, this process being scheduled to
//! read), which varies from answer to answer, so instances sharing a beat would place
//! neighbouring slots each with its own error, milliseconds apart on a loaded machine.
//!
//! So every answer tightens one bound: the least `arrived - db_now` seen, loosened over time
//! by the most the two clocks may drift apart ([`MAX_DRIFT`]). It stays an upper bound (a slot
//! is still never placed early), and it is as tight as the quickest answer, tens of
//! microseconds on one host. An answer whose lower bound (`sent - db_now`) is above it shows
//! that the database's clock stepped back; the bound starts again from that answer.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use tokio::time::Instant;

/// How fast the two clocks may drift apart: NTP slews a clock by at most 500 ppm, and both may
/// be slewed, in opposite directions.
pub(super) const MAX_DRIFT: f64 = 1000e-6;

/// The offset between this instance's monotonic clock and the database's, bounded from above.
pub(super) struct DbClock {
    /// What local instants are measured from.
    base: Instant,
    bound: Mutex<Option<Bound>>,
}

#[derive(Clone, Copy)]
struct Bound {
    /// Local nanoseconds since `base` minus database nanoseconds since the epoch, at most.
    offset: i128,
    /// When it was last tightened.
    at: Instant,
}

/// One answer's reading of the database clock: turns the answer's instants into local ones.
#[derive(Debug, Clone, Copy)]
pub(super) struct Reading {
    base: Instant,
    offset: i128,
}

impl DbClock {
    pub(super) fn new() -> Self {
        Self {
            base: Instant::now(),
            bound: Mutex::new(None),
        }
    }

    /// Takes in an answer sent at `sent` that read `db_now` and arrived at `arrived`.
    pub(super) fn read(&self, sent: Instant, arrived: Instant, db_now: SystemTime) -> Reading {
        let db = db_nanos(db_now);
        let upper = self.local_nanos(arrived) - db;
        let lower = self.local_nanos(sent) - db;
        let mut bound = self.bound.lock();
        let offset = match *bound {
            Some(b) => {
                let since = arrived.saturating_duration_since(b.at).as_nanos() as f64;
                let loosened = b.offset + (since * MAX_DRIFT).ceil() as i128;
                if loosened < lower {
                    upper
                } else {
                    loosened.min(upper)
                }
            }
            None => upper,
        };
        *bound = Some(Bound {
            offset,
            at: arrived,
        });
        Reading {
            base: self.base,
            offset,
        }
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

    /// A database clock that reads `skew` ahead of the local one (as wall time at `base`).
    fn db_at(base: Instant, wall: SystemTime, t: Instant) -> SystemTime {
        wall + (t - base)
    }

    #[tokio::test(start_paused = true)]
    async fn the_quickest_answer_places_every_later_slot() {
        let clock = DbClock::new();
        let base = Instant::now();
        let wall = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        // The statement ran at base + 1 ms; its answer took 0.1 ms to come back.
        let quick = clock.read(base, base + MS + MS / 10, db_at(base, wall, base + MS));
        // A later answer that came back 3 ms after the database read its clock.
        let t = base + 20 * MS;
        let slow = clock.read(t, t + 4 * MS, db_at(base, wall, t + MS));
        let slot = db_at(base, wall, base + 40 * MS);
        let off = |at: Instant| at.saturating_duration_since(base + 40 * MS);
        assert!(off(quick.local(slot)) <= MS / 10);
        // Placed from its own answer alone, the slot would be 3 ms late.
        assert!(
            off(slow.local(slot)) < MS / 5,
            "{:?} late",
            off(slow.local(slot))
        );
        // Never early.
        assert!(slow.local(slot) >= base + 40 * MS);
    }

    #[tokio::test(start_paused = true)]
    async fn the_bound_loosens_with_time_and_restarts_when_the_database_clock_steps_back() {
        let clock = DbClock::new();
        let base = Instant::now();
        let wall = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        clock.read(base, base, db_at(base, wall, base));
        // Ten seconds later, the database clock has fallen 5 ms behind (500 ppm): the old bound
        // would place its slots 5 ms early; loosened by up to 10 ms, it does not.
        let t = base + Duration::from_secs(10);
        let behind = wall - 5 * MS;
        let r = clock.read(t, t + MS / 10, db_at(base, behind, t));
        let slot = db_at(base, behind, t + 50 * MS);
        assert!(r.local(slot) >= t + 50 * MS);
        assert!(r.local(slot) <= t + 50 * MS + MS / 10);
        // The database clock steps back by a second: no bound survives it.
        let t = t + MS;
        let stepped = behind - Duration::from_secs(1);
        let r = clock.read(t, t + MS / 10, db_at(base, stepped, t));
        assert!(r.local(db_at(base, stepped, t + 20 * MS)) >= t + 20 * MS);
    }
}
