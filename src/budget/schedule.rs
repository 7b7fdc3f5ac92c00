//! The budget's arithmetic: one destination's state and the rules that change it. Pure: time is
//! an argument, as an offset from the store's own epoch, so both stores (and tests on paused
//! time) compute exactly the same thing.

use std::time::Duration;

use super::{Event, Lockout, Rule};

/// One destination's budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    /// The earliest instant the next request may go (beat keeping).
    pub next_at: Duration,
    /// Nothing is sent before this (Retry-After).
    pub paused_until: Duration,
    /// Interval multiplier, 1 to `backoff_max`.
    pub backoff: f64,
    /// Bumped on every widening; a throttle widens only if reserved under the current one.
    pub generation: u64,
    /// Clean responses in a row.
    pub clean_streak: u32,
    /// Set by a lockout verdict, cleared only by an operator.
    pub lock: Option<Lockout>,
}

impl Default for Budget {
    fn default() -> Self {
        Self {
            next_at: Duration::ZERO,
            paused_until: Duration::ZERO,
            backoff: 1.0,
            generation: 0,
            clean_streak: 0,
            lock: None,
        }
    }
}

/// Why a slot was not reserved.
#[derive(Debug, Clone, PartialEq)]
pub enum NoSlot {
    /// The destination is locked out.
    Locked(Lockout),
    /// The first free slot is later than the caller can wait; nothing was taken.
    TooLate {
        /// When the slot would have been.
        slot: Duration,
    },
}

impl Budget {
    /// The interval between slots now: `backoff / rate`.
    pub fn interval(&self, rule: &Rule) -> Duration {
        rule.interval.mul_f64(self.backoff)
    }

    /// Reserves one slot at or after `now`, unless it would fall after `not_after`:
    ///
    /// ```text
    /// slot    = max(now, next_at - tolerance, paused_until)
    /// next_at = max(next_at, slot) + T        T = interval * backoff, tolerance = (burst - 1) T
    /// ```
    ///
    /// Because `next_at` advances from the schedule, not from when a request actually went out,
    /// timer lateness never accumulates; after an idle spell longer than the tolerance, the
    /// schedule restarts from `now`.
    pub fn reserve(
        &mut self,
        rule: &Rule,
        now: Duration,
        not_after: Option<Duration>,
    ) -> Result<(Duration, u64), NoSlot> {
        if let Some(lock) = &self.lock {
            return Err(NoSlot::Locked(lock.clone()));
        }
        let t = self.interval(rule);
        let tolerance = t * (rule.burst - 1);
        let slot = now
            .max(self.next_at.saturating_sub(tolerance))
            .max(self.paused_until);
        if not_after.is_some_and(|limit| slot > limit) {
            return Err(NoSlot::TooLate { slot });
        }
        self.next_at = self.next_at.max(slot) + t;
        Ok((slot, self.generation))
    }

    /// Applies a verdict observed at `now`. Returns whether the backoff or the lock changed,
    /// the state that must survive a restart.
    pub fn apply(&mut self, rule: &Rule, event: &Event, now: Duration) -> bool {
        match event {
            Event::Clean => {
                self.clean_streak += 1;
                if self.clean_streak < rule.decay_after {
                    return false;
                }
                self.clean_streak = 0;
                let before = self.backoff;
                self.backoff = (self.backoff / rule.backoff_factor).max(1.0);
                self.backoff != before
            }
            Event::Throttled {
                generation,
                retry_after,
            } => {
                let before = self.generation;
                self.clean_streak = 0;
                // One widening per generation: ten requests in flight that all come back 429
                // were reserved under the same generation and widen once.
                if *generation == self.generation {
                    self.backoff = (self.backoff * rule.backoff_factor).min(rule.backoff_max);
                    self.generation += 1;
                }
                if let Some(pause) = retry_after {
                    self.paused_until = self
                        .paused_until
                        .max(now + (*pause).min(rule.retry_after_max));
                }
                self.generation != before
            }
            Event::Lockout(lock) => {
                if self.lock.is_some() {
                    return false;
                }
                self.lock = Some(lock.clone());
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(rate: f64, burst: u32) -> Rule {
        Rule {
            interval: Duration::from_secs_f64(1.0 / rate),
            burst,
            backoff_factor: 2.0,
            backoff_max: 8.0,
            decay_after: 3,
            retry_after_max: Duration::from_secs(60),
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn beat_keeping_ignores_lateness() {
        let r = rule(10.0, 1);
        let mut b = Budget::default();
        assert_eq!(b.reserve(&r, ms(0), None).unwrap().0, ms(0));
        // Reserved late (the caller woke up 30 ms after its slot): the beat holds.
        assert_eq!(b.reserve(&r, ms(30), None).unwrap().0, ms(100));
        assert_eq!(b.reserve(&r, ms(140), None).unwrap().0, ms(200));
        // The n-th slot at full demand is start + n / rate.
        for n in 3..20 {
            assert_eq!(
                b.reserve(&r, ms(n * 100 - 50), None).unwrap().0,
                ms(n * 100)
            );
        }
    }

    #[test]
    fn idle_restarts_from_now() {
        let r = rule(10.0, 1);
        let mut b = Budget::default();
        b.reserve(&r, ms(0), None).unwrap();
        assert_eq!(b.reserve(&r, ms(1000), None).unwrap().0, ms(1000));
        assert_eq!(b.reserve(&r, ms(1000), None).unwrap().0, ms(1100));
    }

    #[test]
    fn burst_allows_that_many_at_once_then_spaces() {
        let r = rule(10.0, 3);
        let mut b = Budget::default();
        let slots: Vec<_> = (0..5)
            .map(|_| b.reserve(&r, ms(0), None).unwrap().0)
            .collect();
        assert_eq!(slots, [ms(0), ms(0), ms(0), ms(100), ms(200)]);
    }

    #[test]
    fn pause_holds_every_slot() {
        let r = rule(10.0, 1);
        let mut b = Budget::default();
        b.apply(
            &r,
            &Event::Throttled {
                generation: 0,
                retry_after: Some(ms(5000)),
            },
            ms(0),
        );
        // Backoff is 2 now: 200 ms apart, from the end of the pause.
        assert_eq!(b.reserve(&r, ms(10), None).unwrap().0, ms(5000));
        assert_eq!(b.reserve(&r, ms(10), None).unwrap().0, ms(5200));
    }

    #[test]
    fn pause_is_capped_by_retry_after_max() {
        let r = rule(10.0, 1);
        let mut b = Budget::default();
        b.apply(
            &r,
            &Event::Throttled {
                generation: 0,
                retry_after: Some(Duration::from_secs(86400)),
            },
            ms(0),
        );
        assert_eq!(b.paused_until, Duration::from_secs(60));
    }

    #[test]
    fn too_late_takes_nothing() {
        let r = rule(1.0, 1);
        let mut b = Budget::default();
        b.reserve(&r, ms(0), None).unwrap();
        assert_eq!(
            b.reserve(&r, ms(0), Some(ms(500))),
            Err(NoSlot::TooLate { slot: ms(1000) })
        );
        assert_eq!(b.reserve(&r, ms(0), Some(ms(1000))).unwrap().0, ms(1000));
    }

    #[test]
    fn one_widening_per_generation() {
        let r = rule(10.0, 1);
        let mut b = Budget::default();
        for _ in 0..10 {
            b.apply(
                &r,
                &Event::Throttled {
                    generation: 0,
                    retry_after: None,
                },
                ms(0),
            );
        }
        assert_eq!(b.backoff, 2.0);
        assert_eq!(b.generation, 1);
        b.apply(
            &r,
            &Event::Throttled {
                generation: 1,
                retry_after: None,
            },
            ms(0),
        );
        assert_eq!(b.backoff, 4.0);
        for g in 2..10 {
            b.apply(
                &r,
                &Event::Throttled {
                    generation: g,
                    retry_after: None,
                },
                ms(0),
            );
        }
        assert_eq!(b.backoff, 8.0, "capped at backoff_max");
    }

    #[test]
    fn decay_after_a_clean_streak_never_below_one() {
        let r = rule(10.0, 1);
        let mut b = Budget {
            backoff: 4.0,
            ..Budget::default()
        };
        for _ in 0..2 {
            b.apply(&r, &Event::Clean, ms(0));
        }
        assert_eq!(b.backoff, 4.0);
        b.apply(&r, &Event::Clean, ms(0));
        assert_eq!(b.backoff, 2.0);
        assert_eq!(b.clean_streak, 0);
        b.apply(
            &r,
            &Event::Throttled {
                generation: 99,
                retry_after: None,
            },
            ms(0),
        );
        assert_eq!(
            b.clean_streak, 0,
            "a throttle resets the streak even when it does not widen"
        );
        for _ in 0..30 {
            b.apply(&r, &Event::Clean, ms(0));
        }
        assert_eq!(b.backoff, 1.0);
    }

    #[test]
    fn lockout_halts_until_cleared() {
        let r = rule(10.0, 1);
        let mut b = Budget::default();
        let lock = Lockout::new(403, "GET /x".into(), "test".into());
        assert!(b.apply(&r, &Event::Lockout(lock.clone()), ms(0)));
        assert_eq!(b.reserve(&r, ms(0), None), Err(NoSlot::Locked(lock)));
    }
}
