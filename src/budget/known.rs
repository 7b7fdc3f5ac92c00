//! What this instance knows of each budget: one record, fed by the shared store's answers.
//!
//! Two kinds of loss read it, and both want the same high-water marks.
//! - The store is lost: the failover's local fallback starts each budget from what this
//!   instance last knew of it (a lockout, a pause, the backoff, the slots taken, full quota
//!   windows), so that pacing alone neither forgets a halt nor bursts (`fleet::failover`).
//! - The store fails over to a server that lost commits: the store puts what this instance
//!   knew back into the new server before a request is paced on it (`store::postgres`'s
//!   re-assertion).
//!
//! Status reads it too, for the budget as this instance knows it.
//!
//! The store that answers feeds it, once per answer ([`Known::reserved`], [`Known::learned`],
//! and the rest), so that neither reader keeps a copy of its own.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::{halted_by, BudgetView, Grant, Lockout, ReserveError, Rule};

/// What this instance knows of one budget.
#[derive(Debug, Default, Clone)]
pub struct Mark {
    /// The earliest the budget's next slot may be: an interval after the latest slot granted
    /// here, or the slot the store last said comes next, whichever is later.
    pub next: Option<Instant>,
    /// The latest slot granted here, and the interval it was granted at.
    pub last: Option<(Instant, Duration)>,
    /// The budget as last read from the store, and when.
    pub view: Option<(Instant, BudgetView)>,
    /// When the question `view` answers was asked: an answer to one asked earlier is older
    /// news, however late it arrives (two questions on two connections, answered out of
    /// order), and does not replace it.
    asked: Option<Instant>,
    /// The latest slots granted here, and charges settled here, each with the units it
    /// weighed, for a budget with quota windows: enough to hold its largest window's units.
    pub sends: VecDeque<(Instant, u32)>,
    /// The largest quota window's limit, in units; 0 without windows. A meter's own window
    /// (`budget::Rule::window`) is not one: its rate, put back by itself, bounds it, and
    /// taking it to be full at a loss would hold a meter of `per_minute` for a minute.
    pub window: u32,
}

impl Mark {
    /// Whether forgetting it could lift a halt: a lockout or a pause still in force.
    fn halts(&self, now: Instant) -> bool {
        self.view.as_ref().is_some_and(|(read, v)| {
            v.lock.is_some() || (!v.paused_for.is_zero() && *read + v.paused_for > now)
        })
    }

    /// The budget as the store last answered it, with its times (a pause, the vendor's
    /// reset) counted from now rather than from when it answered.
    pub fn view_now(&self) -> Option<BudgetView> {
        let (read, mut view) = self.view.clone()?;
        let since = read.elapsed();
        view.paused_for = view.paused_for.saturating_sub(since);
        if view.paused_for.is_zero() {
            view.paused_by = None;
        }
        view.vendor = view.vendor.and_then(|mut v| {
            v.reset_in = v.reset_in.checked_sub(since)?;
            Some(v)
        });
        Some(view)
    }

    fn granted(&mut self, first: Instant, more: &[Instant], interval: Duration, cost: u32) {
        let last = more.iter().copied().fold(first, Instant::max);
        self.not_before(last + interval);
        self.last = Some(match self.last {
            Some((at, i)) if at > last => (at, i),
            _ => (last, interval),
        });
        if self.window > 0 {
            self.sends.push_back((first, cost));
            self.sends.extend(more.iter().map(|at| (*at, cost)));
            self.keep_window();
        }
    }

    /// Forgets the sends no window reaches: those before the largest window's units.
    fn keep_window(&mut self) {
        let mut units: u64 = self.sends.iter().map(|(_, u)| u64::from(*u)).sum();
        while let Some((_, first)) = self.sends.front() {
            let rest = units - u64::from(*first);
            if rest < u64::from(self.window) {
                break;
            }
            units = rest;
            self.sends.pop_front();
        }
    }

    fn not_before(&mut self, at: Instant) {
        self.next = Some(self.next.map_or(at, |n| n.max(at)));
    }
}

/// The high-water marks of every budget this instance has seen (see the module's notes).
#[derive(Debug, Default)]
pub struct Known {
    marks: Mutex<HashMap<String, Mark>>,
}

impl Known {
    fn with_mark(&self, budget: &str, f: impl FnOnce(&mut Mark)) {
        let mut marks = self.marks.lock();
        match marks.get_mut(budget) {
            Some(mark) => f(mark),
            None => f(marks.entry(budget.to_owned()).or_default()),
        }
    }

    /// The store's answer to a reservation of `budget` under `rule`.
    pub fn reserved(&self, budget: &str, rule: &Rule, answer: &Result<Grant, ReserveError>) {
        match answer {
            Ok(grant) => self.with_mark(budget, |mark| {
                mark.window = rule.quota.iter().map(|q| q.limit).max().unwrap_or(0);
                mark.granted(grant.slot.at, &grant.more, rule.interval, rule.cost);
            }),
            // The schedule's next slot (a pause, a block, a vendor's reset).
            Err(ReserveError::TooLate { slot }) => {
                self.with_mark(budget, |mark| mark.not_before(*slot));
            }
            // Kept on the budget that holds it: a key's parent.
            Err(ReserveError::Locked(lock)) => self.locked(budget, lock),
            Err(_) => {}
        }
    }

    fn locked(&self, budget: &str, lock: &Lockout) {
        let holder = halted_by(budget).unwrap_or(budget);
        let now = Instant::now();
        self.with_mark(holder, |mark| {
            let (_, view) = mark
                .view
                .get_or_insert_with(|| (now, BudgetView::default()));
            view.lock = Some(lock.clone());
        });
    }

    /// The budget as the store answered a question asked at `asked`, unless a later
    /// question's answer is in already. A read's answer counts from when it was sent, a
    /// write's from when it arrived: a write's own state sticks until a read sent after it.
    pub fn learned(&self, budget: &str, view: &BudgetView, asked: Instant) {
        let now = Instant::now();
        self.with_mark(budget, |mark| {
            if mark.asked.is_some_and(|latest| latest > asked) {
                return;
            }
            mark.asked = Some(asked);
            mark.view = Some((now, view.clone()));
        });
    }

    /// A settlement that charged `units` more than a request reserved, at `at`: in a budget
    /// with quota windows, a send of those units (see `budget::schedule::Budget::settle`).
    pub fn charged(&self, budget: &str, units: u32, at: Instant) {
        self.with_mark(budget, |mark| {
            if mark.window > 0 && units > 0 {
                let latest = mark.sends.back().map_or(at, |(t, _)| at.max(*t));
                mark.sends.push_back((latest, units));
                mark.keep_window();
            }
        });
    }

    /// `units` of a slot granted here at `at` for `reserved`, given back (see
    /// `budget::Store::give_back`): the send weighs that many fewer, or is gone.
    pub fn given_back(&self, budget: &str, at: Instant, reserved: u32, units: u32) {
        self.with_mark(budget, |mark| {
            if let Some(i) = mark.sends.iter().rposition(|s| *s == (at, reserved)) {
                if units >= reserved {
                    mark.sends.remove(i);
                } else {
                    mark.sends[i].1 = reserved - units;
                }
            }
        });
    }

    /// Slots handed out without the store, put into its schedules: part of what this
    /// instance knows from now on.
    pub fn continued(&self, marks: &[(String, Instant)]) {
        for (budget, at) in marks {
            self.with_mark(budget, |mark| mark.not_before(*at));
        }
    }

    /// An operator cleared `destination`'s lockout, which its keys held too: an answer to a
    /// question asked before now, arriving after, does not bring it back.
    pub fn unlocked(&self, destination: &str) {
        let now = Instant::now();
        for (name, mark) in self.marks.lock().iter_mut() {
            if name == destination || halted_by(name) == Some(destination) {
                if let Some((_, view)) = mark.view.as_mut() {
                    view.lock = None;
                }
                mark.asked = Some(now);
            }
        }
    }

    /// Forgets an idle budget, unless that would lift a lockout or a pause still in force.
    pub fn forget(&self, budget: &str) {
        let mut marks = self.marks.lock();
        if marks.get(budget).is_some_and(|m| !m.halts(Instant::now())) {
            marks.remove(budget);
        }
    }

    /// `budget` as the store last answered it (see [`Mark::view_now`]).
    pub fn view(&self, budget: &str) -> Option<BudgetView> {
        self.marks.lock().get(budget)?.view_now()
    }

    /// Where `budget`'s next slot may be, if this instance knows.
    pub fn next(&self, budget: &str) -> Option<Instant> {
        self.marks.lock().get(budget).and_then(|m| m.next)
    }

    /// Every mark, as it is now.
    pub fn marks(&self) -> Vec<(String, Mark)> {
        self.marks
            .lock()
            .iter()
            .map(|(name, mark)| (name.clone(), mark.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::contract::rule;
    use crate::budget::Reservation;
    use crate::class::Class;
    use crate::destination::Quota;

    fn grant(at: Instant, more: Vec<Instant>) -> Result<Grant, ReserveError> {
        Ok(Grant {
            slot: Reservation {
                at,
                generation: 0,
                unseen_late: Duration::ZERO,
            },
            class: Class(0),
            more,
            sent: Vec::new(),
        })
    }

    #[tokio::test(start_paused = true)]
    async fn marks_only_rise() {
        let known = Known::default();
        let now = Instant::now();
        let r = rule(10.0);
        known.reserved("a", &r, &grant(now + Duration::from_secs(2), vec![]));
        known.reserved("a", &r, &grant(now, vec![]));
        assert_eq!(known.next("a"), Some(now + Duration::from_millis(2100)));
        let later = now + Duration::from_secs(5);
        known.reserved("a", &r, &Err(ReserveError::TooLate { slot: later }));
        assert_eq!(known.next("a"), Some(later));
        let (_, mark) = known.marks().pop().unwrap();
        assert_eq!(mark.last, Some((now + Duration::from_secs(2), r.interval)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_meets_its_parents_lockout_and_an_unlock_clears_it() {
        let known = Known::default();
        let lock = Lockout::new(403, "GET https://a/".into(), "i".into());
        known.reserved("a#k", &rule(1.0), &Err(ReserveError::Locked(lock)));
        let held = |k: &Known| {
            k.marks()
                .into_iter()
                .any(|(n, m)| n == "a" && m.view.is_some_and(|(_, v)| v.lock.is_some()))
        };
        assert!(held(&known), "the lockout is kept on the parent");
        known.forget("a");
        assert!(held(&known), "forgetting must not lift a lockout");
        known.unlocked("a");
        assert!(!held(&known));
        known.forget("a");
        assert!(known.marks().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_to_an_older_question_does_not_replace_a_newer_one() {
        let known = Known::default();
        let streak = |n| BudgetView {
            block_streak: n,
            ..BudgetView::default()
        };
        let first = Instant::now();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let second = Instant::now();
        known.learned("a", &streak(0), second);
        // Asked first, arrived last: older news.
        known.learned("a", &streak(2), first);
        assert_eq!(known.view("a").unwrap().block_streak, 0);
        let lock = Lockout::new(403, "GET https://a/".into(), "i".into());
        known.learned(
            "a",
            &BudgetView {
                lock: Some(lock.clone()),
                ..BudgetView::default()
            },
            Instant::now(),
        );
        let asked = Instant::now();
        tokio::time::sleep(Duration::from_millis(5)).await;
        known.unlocked("a");
        // A read asked before the unlock, arriving after it, does not bring the lock back.
        known.learned(
            "a",
            &BudgetView {
                lock: Some(lock),
                ..BudgetView::default()
            },
            asked,
        );
        assert!(known.view("a").unwrap().lock.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_windowed_budget_keeps_as_many_sends_as_its_window_holds() {
        let known = Known::default();
        let r = Rule {
            quota: vec![Quota {
                limit: 2,
                per: Duration::from_secs(60),
            }],
            ..rule(10.0)
        };
        let now = Instant::now();
        let at = |ms| now + Duration::from_millis(ms);
        known.reserved("q", &r, &grant(at(0), vec![at(100), at(200)]));
        let (_, mark) = known.marks().pop().unwrap();
        assert_eq!(mark.window, 2);
        assert_eq!(Vec::from(mark.sends), vec![(at(100), 1), (at(200), 1)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_meter_s_window_keeps_enough_sends_for_its_units_charges_included() {
        let known = Known::default();
        let r = Rule {
            quota: vec![Quota {
                limit: 1000,
                per: Duration::from_secs(60),
            }],
            ..rule(10.0)
        };
        let now = Instant::now();
        let at = |ms| now + Duration::from_millis(ms);
        known.reserved("m", &r.weighted(400), &grant(at(0), vec![at(100), at(200)]));
        // 1,200 units: the window's 1,000 reach into the first send, which stays.
        let (_, mark) = known.marks().pop().unwrap();
        assert_eq!(
            Vec::from(mark.sends),
            vec![(at(0), 400), (at(100), 400), (at(200), 400)]
        );
        // A charge of 300 known before the latest slot counts at that slot; the first send
        // is then out of the window's reach.
        known.charged("m", 300, at(150));
        let (_, mark) = known.marks().pop().unwrap();
        assert_eq!(
            Vec::from(mark.sends),
            vec![(at(100), 400), (at(200), 400), (at(200), 300)]
        );
        // The request at 100 cost 150 less than its estimate: its send weighs 250; the one
        // at 200 is given back whole and leaves.
        known.given_back("m", at(100), 400, 150);
        known.given_back("m", at(200), 400, 400);
        let (_, mark) = known.marks().pop().unwrap();
        assert_eq!(Vec::from(mark.sends), vec![(at(100), 250), (at(200), 300)]);
    }
}
