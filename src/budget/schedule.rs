//! The budget's arithmetic: one destination's state and the rules that change it. Pure: time is
//! an argument, as an offset from the store's own epoch, so both stores (and tests on paused
//! time) compute exactly the same thing.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, SystemTime};

use super::{Event, Lockout, Observation, PauseCause, Rule, BATCH_HORIZON};
use crate::class::Class;
use crate::destination::VendorPace;
use crate::signals::Family;

/// Two resets this close are one window: a reset given in whole seconds left moves by up to a
/// second from one response to the next.
pub const SAME_WINDOW: Duration = Duration::from_secs(2);

/// The most a spent vendor budget's pause runs past the reset (see [`Observation::spread`]).
pub const RESET_JITTER: Duration = Duration::from_secs(1);

/// What the vendor last said about its budget, on the store's timeline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Vendor {
    /// The header family it was read from.
    pub family: Family,
    /// Requests left in the window when it was said.
    pub remaining: u64,
    /// The window's limit, where given.
    pub limit: Option<u64>,
    /// When it was said.
    pub observed: Duration,
    /// When the window resets.
    pub reset: Duration,
    /// Slots taken since it was said.
    pub taken: u64,
}

/// A send counted in a budget's quota windows: when it was, and the units sent up to and
/// including it. Counting in a running total lets a window find the send that holds a given
/// unit by a search, whatever each send weighed: one slot of a request budget, or a meter's
/// request of thousands of tokens, or a settlement's charge after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sent {
    /// When it was sent (its slot), or, for a charge, when the charge was known.
    pub at: Duration,
    /// Units sent on the budget up to and including this send.
    pub through: u64,
}

/// One instance's waiting requests of one class, in store time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Waiting {
    /// The class.
    pub class: Class,
    /// How many wait.
    pub count: u32,
    /// When the oldest started waiting.
    pub since: Duration,
    /// When the second oldest started waiting.
    pub next_since: Option<Duration>,
}

/// One destination's budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    /// The earliest instant the next request may go (beat keeping).
    pub next_at: Duration,
    /// The latest slot granted: a refund gives back no time before it (see
    /// [`Budget::settle`]).
    pub last_slot: Duration,
    /// Nothing is sent before this (Retry-After, a block, a spent vendor budget).
    pub paused_until: Duration,
    /// What set `paused_until`.
    pub paused_by: Option<PauseCause>,
    /// Throttles in a row that blocked the destination (see [`crate::destination::Block`]).
    pub block_streak: u32,
    /// What the vendor last said; ignored once its window has reset.
    /// Boxed, as the lockout is: most budgets have neither, and a budget split by key has
    /// one per key.
    pub vendor: Option<Box<Vendor>>,
    /// Interval multiplier, 1 to `backoff_max`.
    pub backoff: f64,
    /// Bumped on every widening; a throttle widens only if reserved under the current one.
    pub generation: u64,
    /// Clean responses in a row.
    pub clean_streak: u32,
    /// Set by a lockout verdict, cleared only by an operator.
    pub lock: Option<Box<Lockout>>,
    /// Each class's credit towards its share, by rank (see [`choose`]).
    pub credits: Vec<f64>,
    /// The latest sends, enough to hold the largest quota limit's units (none without a
    /// quota).
    pub sends: VecDeque<Sent>,
    /// Each instance's waiting requests, by instance id.
    pub waiting: BTreeMap<String, Vec<Waiting>>,
}

impl Default for Budget {
    fn default() -> Self {
        Self {
            next_at: Duration::ZERO,
            last_slot: Duration::ZERO,
            paused_until: Duration::ZERO,
            paused_by: None,
            block_streak: 0,
            vendor: None,
            backoff: 1.0,
            generation: 0,
            clean_streak: 0,
            lock: None,
            credits: Vec::new(),
            sends: VecDeque::new(),
            waiting: BTreeMap::new(),
        }
    }
}

/// Slots reserved by [`Budget::reserve_for`], on the store's timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct Granted {
    /// The first slot.
    pub slot: Duration,
    /// The batch's later slots, in order (see [`Budget::reserve_for`]).
    pub more: Vec<Duration>,
    /// The generation they were reserved under.
    pub generation: u64,
    /// The class they are for.
    pub class: Class,
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
    /// A request waiting on another instance deserves the next slot.
    Yield,
}

/// Which class deserves the next slot, given the classes that have requests waiting (on any
/// instance), and the credits after that slot.
///
/// A class with a share earns that share of every slot granted while it has waiters; once it
/// has earned a whole slot it takes the next one, before more urgent classes. Otherwise the
/// most urgent waiting class takes it. A class with nothing waiting earns nothing and keeps
/// no credit: its share is lent to the others. So a class with share `s` and waiters gets at
/// least `s` of the slots, to within one slot.
pub fn choose(credits: &[f64], shares: &[f64], waiting: &[Class]) -> Option<(Class, Vec<f64>)> {
    let mut next = vec![0.0; shares.len()];
    for c in waiting {
        let i = usize::from(c.0);
        if shares.get(i).is_some_and(|s| *s > 0.0) {
            next[i] = credits.get(i).copied().unwrap_or(0.0) + shares[i];
        }
    }
    // Shares are decimal fractions; credits are compared with room for their rounding.
    let owed = |c: &&Class| next.get(usize::from(c.0)).is_some_and(|v| *v >= 1.0 - 1e-9);
    let chosen = waiting
        .iter()
        .filter(owed)
        .min()
        .or_else(|| waiting.iter().min())
        .copied()?;
    if let Some(v) = next.get_mut(usize::from(chosen.0)) {
        *v = (*v - 1.0).max(0.0);
    }
    Some((chosen, next))
}

impl Budget {
    /// Whether nothing has happened on the budget for `idle` by `now`: its next slot, its
    /// latest quota window's send and any pause lie that far back, and nobody waits for it.
    pub fn idle_for(&self, now: Duration, idle: Duration) -> bool {
        let last = [
            self.next_at,
            self.paused_until,
            self.sends.back().map(|s| s.at).unwrap_or_default(),
        ]
        .into_iter()
        .max()
        .unwrap_or_default();
        self.waiting.values().all(Vec::is_empty) && last + idle <= now
    }

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
    /// A budget that counts its sends also puts no slot before its latest send, nor less than
    /// half an interval after it where the beat lies that close (a refund took the beat back,
    /// or a window held that send). What holds a slot past the beat (a window, the latest
    /// send) does not move the beat: `next_at` advances from where it stood, at most an
    /// interval behind the slot (or the lag it already had). Where it lags behind the latest
    /// send (a refund carried past it, see [`Budget::give_back`]), the slots after it go half
    /// an interval apart, each spending half its interval of the lag: spread, never bunched.
    /// The lag is lost as time passes unused beyond the latest send.
    ///
    /// Because `next_at` advances from the schedule, not from when a request actually went out,
    /// timer lateness never accumulates; after an idle spell longer than the tolerance, the
    /// schedule restarts from `now`.
    ///
    /// With quota windows, a slot also waits until the window has room for its units
    /// ([`Rule::cost`]: one for a request, a meter's estimate for a weighted slot), plus
    /// [`Rule::quota_margin`] so that a slot used late, or slow to reach the upstream, still
    /// cannot crowd a window there (see [`Budget::window_floor`]).
    ///
    /// With a vendor view, the k-th slot since it was said waits for its share of the window:
    /// `observed + k × (reset − observed) / (remaining − reserve)`, and past the last share,
    /// for the reset. So the vendor's remaining requests, less the reserve, are spread evenly
    /// until the reset, whatever the configured rate.
    pub fn reserve(
        &mut self,
        rule: &Rule,
        now: Duration,
        not_after: Option<Duration>,
    ) -> Result<(Duration, u64), NoSlot> {
        if let Some(lock) = &self.lock {
            return Err(NoSlot::Locked(Lockout::clone(lock)));
        }
        let t = self.interval(rule);
        let tolerance = t * (rule.burst - 1);
        let (order, windows) = self.window_floor(rule);
        let mut beat = now
            .max(self.next_at.saturating_sub(tolerance))
            .max(self.paused_until);
        if self.vendor.as_ref().is_some_and(|v| v.reset <= now) {
            self.vendor = None;
        }
        if let Some(floor) = self.vendor_floor(rule) {
            beat = beat.max(floor);
        }
        // Where the beat is within half an interval of the latest send (a refund took it
        // back, or a window held that send), the slot keeps half an interval from it.
        let spaced = match self.sends.back() {
            Some(_) if self.next_at < order + half(t) => order + half(t),
            _ => order,
        };
        let slot = beat.max(windows).max(spaced);
        if not_after.is_some_and(|limit| slot > limit) {
            return Err(NoSlot::TooLate { slot });
        }
        if let Some(v) = &mut self.vendor {
            v.taken += 1;
        }
        // The beat goes on from where it stood, not from where a window or the latest send
        // put the slot. Where it lags behind the latest send (a refund carried past it), the
        // slots after it go half an interval apart, each spending half its interval of the
        // lag, which is lost only as time passes unused beyond that send. A window's hold
        // leaves the beat at most an interval behind the slot, or the lag it had.
        let lag = match self.next_at.is_zero() {
            // Never reserved: no beat to lag behind.
            true => Duration::ZERO,
            false => order.saturating_sub(self.next_at),
        };
        let idle = beat.saturating_sub(order);
        let from = if lag > idle {
            self.next_at + idle
        } else {
            self.next_at.max(beat)
        };
        let behind = lag.saturating_sub(idle).max(t);
        self.next_at = (from + t).max(slot.saturating_sub(behind));
        self.last_slot = self.last_slot.max(slot);
        self.sent(rule, slot, u64::from(rule.cost));
        Ok((slot, self.generation))
    }

    /// Settles a request that cost `units` more than the slot reserved for it (fewer where
    /// negative), at `now`: a charge moves the next slot later by that many intervals; a
    /// refund moves it earlier, but never before `now`. Time already past is not given back:
    /// a refund makes room for the requests still to come, never a burst. Nor does a later
    /// request go before one granted already: without sends counted, the next slot goes no
    /// earlier than the latest granted, and what reaches further is lost; with them (a
    /// meter's), the latest send holds the next slot in order, and the refund is carried to
    /// the slots after it (see [`Budget::reserve`]). The window that starts at that slot may
    /// then hold the refund's worth more than the rate's share; a meter's own window
    /// ([`Rule::windows`]) bounds it.
    ///
    /// In the windows a charge counts as a send of its units when it is known (no earlier
    /// than the latest slot, so that the sends stay in time order). A refund is taken out of
    /// them where the request's send is known, by [`Budget::unsend`]: the windows then count
    /// what the request cost.
    pub fn settle(&mut self, rule: &Rule, units: i64, now: Duration) {
        if units > 0 {
            self.sent(rule, now.max(self.last_slot), units.unsigned_abs());
        }
        let shift = self.span(rule, units.unsigned_abs());
        self.next_at = if units >= 0 {
            self.next_at + shift
        } else {
            let floor = refund_floor(rule, now, self.last_slot);
            self.next_at
                .saturating_sub(shift)
                .max(self.next_at.min(floor))
        };
    }

    /// Gives back `units` of a slot reserved for `reserved` at `now` (see
    /// [`crate::budget::Store::give_back`]; the windows' part is [`Budget::unsend`]): a refund
    /// as [`Budget::settle`]'s, but where the budget counts its sends it may reach back past
    /// now, as far as the slot's own interval behind the latest slot. A refund usually comes
    /// after the next slot was granted (a meter's is asked for as the last one comes), often
    /// once that one's time has passed: what reaches past the latest send is carried, and lost
    /// as time passes unused beyond that send (see [`Budget::reserve`]). No refund makes the
    /// beat lag by more than its own slot's length, so refunds that come together (many
    /// requests in flight) cannot pile up into a burst.
    pub fn give_back(&mut self, rule: &Rule, units: u64, reserved: u64, now: Duration) {
        if !rule.counts_sends() {
            return self.settle(rule, -i64::try_from(units).unwrap_or(i64::MAX), now);
        }
        let floor = now.min(self.last_slot.saturating_sub(self.span(rule, reserved)));
        self.next_at = self
            .next_at
            .saturating_sub(self.span(rule, units))
            .max(self.next_at.min(floor));
    }

    /// How much of the schedule `units` take: that many intervals, at the backoff.
    fn span(&self, rule: &Rule, units: u64) -> Duration {
        self.interval(rule)
            .saturating_mul(u32::try_from(units).unwrap_or(u32::MAX))
    }

    /// The latest send, before which no slot goes (the sends stay in time order), and the
    /// earliest a slot of [`Rule::cost`] units fits every window: for each window of `limit`
    /// units, the send that holds unit `through + cost - limit` (the first that must have
    /// left the window for the slot's units to fit) must be a window and its margin past. A
    /// slot costing more than a window's limit waits for the whole window to empty.
    fn window_floor(&self, rule: &Rule) -> (Duration, Duration) {
        let Some(last) = self.sends.back() else {
            return (Duration::ZERO, Duration::ZERO);
        };
        let mut floor = Duration::ZERO;
        for (limit, per) in rule.windows() {
            let want = (last.through + u64::from(rule.cost).min(limit)).saturating_sub(limit);
            if want == 0 {
                continue;
            }
            let i = self.sends.partition_point(|s| s.through < want);
            if let Some(holder) = self.sends.get(i) {
                floor = floor.max(holder.at + per + rule.quota_margin());
            }
        }
        (last.at, floor)
    }

    /// Counts a send of `units` at `at` in the quota windows, and forgets the sends no
    /// window can reach: those wholly before the largest limit's units.
    fn sent(&mut self, rule: &Rule, at: Duration, units: u64) {
        let Some(keep) = rule.windows().map(|(limit, _)| limit).max() else {
            return;
        };
        let through = self.sends.back().map_or(0, |s| s.through) + units;
        self.sends.push_back(Sent { at, through });
        while self
            .sends
            .front()
            .is_some_and(|s| s.through + keep <= through)
        {
            self.sends.pop_front();
        }
    }

    /// Takes `units` of the send at `at`, reserved for `reserved`, out of the windows: a
    /// slot given back unused, or the part of its estimate a request did not cost (see
    /// [`crate::budget::Store::give_back`]). The send weighs that many units fewer, or is
    /// gone where all of them are given back, and the sends after it count that many fewer.
    /// A send no longer kept, or not of `reserved` units, is left alone.
    pub fn unsend(&mut self, at: Duration, reserved: u64, units: u64) {
        let units = units.min(reserved);
        let Some(i) = (0..self.sends.len()).rev().find(|i| {
            let s = self.sends[*i];
            let own = match i.checked_sub(1) {
                Some(p) => s.through - self.sends[p].through,
                None => reserved.min(s.through),
            };
            s.at == at && own == reserved
        }) else {
            return;
        };
        if units == reserved {
            self.sends.remove(i);
        }
        for s in self.sends.iter_mut().skip(i) {
            s.through -= units;
        }
    }

    /// The units sent within `per` before `now`. Where no send kept lies before the window,
    /// every unit counted is taken to be in it: the sends forgotten held at least the largest
    /// limit, so the caller's cap at the limit is then exact.
    pub fn sent_within(&self, per: Duration, now: Duration) -> u64 {
        let Some(last) = self.sends.back() else {
            return 0;
        };
        let before = now
            .checked_sub(per)
            .and_then(|from| self.sends.partition_point(|s| s.at <= from).checked_sub(1))
            .map_or(0, |i| self.sends[i].through);
        last.through - before
    }

    /// When the next slot is free by the beat and a pause (quota windows and the vendor's
    /// view aside): how long an instance that yields may wait before asking again. For a
    /// weighted slot (a meter's), sooner: when the latest slot granted comes, where one is
    /// granted ahead, else half-way to the free slot, since a refund of a request in flight
    /// brings that forward, and an instance asleep until then would lose the time between.
    pub fn free_at(&self, rule: &Rule, now: Duration) -> Duration {
        let t = self.interval(rule);
        let mut beat = self.next_at.saturating_sub(t * (rule.burst - 1));
        if rule.cost > 1 {
            beat = match self.last_slot > now {
                true => beat.min(self.last_slot),
                false if beat > now => now + (beat - now) / 2,
                false => beat,
            };
        }
        now.max(beat).max(self.paused_until)
    }

    /// The earliest the next slot may be by the vendor's view (see [`Budget::reserve`]).
    fn vendor_floor(&self, rule: &Rule) -> Option<Duration> {
        let v = self.vendor.as_ref()?;
        let usable = v.remaining.saturating_sub(u64::from(rule.reserve));
        let k = v.taken + 1;
        if k > usable {
            return Some(v.reset);
        }
        if rule.vendor_pace == VendorPace::Burst {
            return None;
        }
        // In whole microseconds, as the postgres store computes it.
        let window =
            u64::try_from(v.reset.saturating_sub(v.observed).as_micros()).unwrap_or(u64::MAX);
        let share = u128::from(window) * u128::from(k) / u128::from(usable);
        Some(v.observed + Duration::from_micros(u64::try_from(share).unwrap_or(u64::MAX)))
    }

    /// The vendor's view while its window lasts.
    pub fn vendor_at(&self, now: Duration) -> Option<&Vendor> {
        self.vendor.as_deref().filter(|v| v.reset > now)
    }

    /// Pauses until `until` unless a longer pause is already in force.
    fn pause(&mut self, until: Duration, by: PauseCause) -> bool {
        if until <= self.paused_until {
            return false;
        }
        self.paused_until = until;
        self.paused_by = Some(by);
        true
    }

    /// Takes in what the vendor said at `now` (`wall`: the store's wall clock then), and
    /// returns whether the budget changed. Views race between instances: a view of an older
    /// window never replaces one of a newer window, and within one window the lower remaining
    /// (less the slots taken since) wins. At `remaining ≤ reserve` the destination pauses
    /// until the reset, plus up to [`RESET_JITTER`].
    pub fn observe(
        &mut self,
        rule: &Rule,
        seen: &Observation,
        now: Duration,
        wall: SystemTime,
    ) -> bool {
        let Some(left) = seen.reset.resolve(wall, rule.retry_after_max) else {
            return false;
        };
        let new = Vendor {
            family: seen.family,
            remaining: seen.remaining,
            limit: seen.limit,
            observed: now,
            reset: now + left,
            taken: seen.unanswered,
        };
        let left_now = |v: &Vendor| v.remaining.saturating_sub(v.taken);
        let keep = self.vendor_at(now).is_some_and(|old| {
            if new.reset + SAME_WINDOW < old.reset {
                true
            } else if new.reset <= old.reset + SAME_WINDOW {
                left_now(&new) > left_now(old)
            } else {
                false
            }
        });
        if keep {
            return false;
        }
        self.vendor = Some(Box::new(new));
        if left_now(&new) <= u64::from(rule.reserve) {
            self.pause(new.reset + seen.jitter(), PauseCause::Exhausted);
        }
        true
    }

    /// Records `instance`'s waiting requests, replacing what it said before.
    pub fn tell(&mut self, instance: &str, list: &[Waiting]) {
        let list: Vec<Waiting> = list.iter().filter(|w| w.count > 0).copied().collect();
        if list.is_empty() {
            self.waiting.remove(instance);
            if self.waiting.is_empty() {
                // An emptied map keeps its node; a fresh one holds nothing.
                self.waiting = BTreeMap::new();
            }
        } else {
            self.waiting.insert(instance.to_owned(), list);
        }
    }

    /// Every instance's waiting requests by class at `now`: `(class, count, oldest wait)`.
    pub fn waiting_at(&self, now: Duration) -> Vec<(Class, u32, Duration)> {
        self.waiting_by_class()
            .into_iter()
            .map(|(c, n, since)| (c, n, now.saturating_sub(since)))
            .collect()
    }

    /// Every instance's waiting requests by class: `(class, count, oldest since)`.
    fn waiting_by_class(&self) -> Vec<(Class, u32, Duration)> {
        let mut by: BTreeMap<Class, (u32, Duration)> = BTreeMap::new();
        for w in self.waiting.values().flatten() {
            let e = by.entry(w.class).or_insert((0, w.since));
            e.0 += w.count;
            e.1 = e.1.min(w.since);
        }
        by.into_iter().map(|(c, (n, s))| (c, n, s)).collect()
    }

    /// Records `instance`'s waiting requests, then reserves the next slot for the request
    /// that deserves it over every instance ([`choose`] picks the class; the oldest request
    /// of that class, instance ids breaking ties, gets it). When that request is `instance`'s,
    /// the slot is taken and its class returned; otherwise [`NoSlot::Yield`] and nothing
    /// is taken.
    ///
    /// Up to `most` slots are taken at once (see [`crate::budget::Ask::most`]): after the
    /// first, each next slot goes to `instance`'s next request of the same class while it has
    /// one, [`choose`] still picks that class, the slot is within `not_after` and at most
    /// [`BATCH_HORIZON`] after the first. Each is reserved exactly as a slot of its own would
    /// be, so the beat, pauses, quota windows and the vendor's budget hold slot by slot.
    pub fn reserve_for(
        &mut self,
        rule: &Rule,
        now: Duration,
        instance: &str,
        list: &[Waiting],
        not_after: Option<Duration>,
        most: u32,
    ) -> Result<Granted, NoSlot> {
        // The common case in one step: a lone request, nothing waiting anywhere else and no
        // share owed, deserves the slot; there is no list to keep.
        if let [only] = list {
            let alone = only.count == 1
                && self.waiting.keys().all(|k| k == instance)
                && self.credits.iter().all(|c| *c == 0.0);
            if alone {
                if let Ok((slot, generation)) = self.reserve(rule, now, not_after) {
                    self.waiting.remove(instance);
                    return Ok(Granted {
                        slot,
                        more: Vec::new(),
                        generation,
                        class: only.class,
                    });
                }
            }
        }
        self.tell(instance, list);
        if let Some(lock) = &self.lock {
            return Err(NoSlot::Locked(Lockout::clone(lock)));
        }
        let classes: Vec<Class> = self.waiting_by_class().iter().map(|w| w.0).collect();
        let Some((class, credits)) = choose(&self.credits, &rule.shares, &classes) else {
            return Err(NoSlot::Yield);
        };
        let first = self
            .waiting
            .iter()
            .flat_map(|(id, list)| list.iter().map(move |w| (w, id)))
            .filter(|(w, _)| w.class == class)
            .min_by(|a, b| a.0.since.cmp(&b.0.since).then(a.1.cmp(b.1)))
            .map(|(_, id)| id.as_str());
        if first != Some(instance) {
            return Err(NoSlot::Yield);
        }
        let (slot, generation) = self.reserve(rule, now, not_after)?;
        self.credits = credits;
        let mut left = self.served(instance, class);
        let mut more = Vec::new();
        let until = not_after.map_or(slot + BATCH_HORIZON, |n| n.min(slot + BATCH_HORIZON));
        while left > 0 && more.len() + 1 < most as usize {
            // Only this instance's list changed, and it still has the class: the classes
            // waiting are the same, and the credits decide whether another is owed.
            match choose(&self.credits, &rule.shares, &classes) {
                Some((c, credits)) if c == class => match self.reserve(rule, now, Some(until)) {
                    Ok((next, _)) => {
                        more.push(next);
                        self.credits = credits;
                        left = self.served(instance, class);
                    }
                    Err(_) => break,
                },
                _ => break,
            }
        }
        Ok(Granted {
            slot,
            more,
            generation,
            class,
        })
    }

    /// The request of `instance` and `class` that a slot was granted to leaves the list; the
    /// next oldest of its class is the oldest. Returns how many of the class are left.
    fn served(&mut self, instance: &str, class: Class) -> u32 {
        let Some(list) = self.waiting.get_mut(instance) else {
            return 0;
        };
        let mut left = 0;
        if let Some(w) = list.iter_mut().find(|w| w.class == class) {
            w.count -= 1;
            w.since = w.next_since.unwrap_or(w.since);
            w.next_since = None;
            left = w.count;
        }
        list.retain(|w| w.count > 0);
        if list.is_empty() {
            self.waiting.remove(instance);
        }
        left
    }

    /// Applies a verdict observed at `now` (`wall`: the store's wall clock then, which a
    /// pause given as a date is read against). Returns whether the state that must survive a
    /// restart changed: backoff, lock, block streak, a pause.
    pub fn apply(&mut self, rule: &Rule, event: &Event, now: Duration, wall: SystemTime) -> bool {
        match event {
            Event::Clean {
                success,
                generation,
            } => {
                let streak = self.block_streak;
                if *success {
                    // One clean response ends a run of blocks.
                    self.block_streak = 0;
                }
                // Only a response sent at the current pace says that pace is clean: with
                // `decay_after` requests in flight when a widening lands, their answers would
                // otherwise undo it at once.
                if *generation != self.generation {
                    return self.block_streak != streak;
                }
                self.clean_streak += 1;
                if self.clean_streak < rule.decay_after {
                    return self.block_streak != streak;
                }
                self.clean_streak = 0;
                let before = self.backoff;
                self.backoff = (self.backoff / rule.backoff_factor).max(1.0);
                self.backoff != before || self.block_streak != streak
            }
            Event::Throttled {
                generation,
                retry_after,
                reset,
                spread,
            } => {
                let before = self.generation;
                self.clean_streak = 0;
                // One widening per generation: ten requests in flight that all come back 429
                // were reserved under the same generation and widen once; so does the block
                // streak advance once.
                let current = *generation == self.generation;
                if current {
                    self.backoff = (self.backoff * rule.backoff_factor).min(rule.backoff_max);
                    self.generation += 1;
                }
                let resolve = |p: &Option<super::Pause>| {
                    p.and_then(|p| p.resolve(wall, rule.retry_after_max))
                };
                let paused = if let Some(pause) = resolve(retry_after) {
                    self.pause(now + pause, PauseCause::RetryAfter)
                } else if let Some(pause) = resolve(reset) {
                    self.pause(now + pause, PauseCause::Exhausted)
                } else if let (Some(block), true) = (rule.block, current) {
                    let length = block.after(self.block_streak, *spread);
                    self.block_streak = self.block_streak.saturating_add(1);
                    self.pause(now + length, PauseCause::Block);
                    true
                } else {
                    false
                };
                self.generation != before || paused
            }
            Event::None => false,
            Event::Lockout(lock) => {
                if self.lock.is_some() {
                    return false;
                }
                self.lock = Some(Box::new(lock.clone()));
                true
            }
        }
    }
}

/// Half of `t`, in whole microseconds, as the postgres store computes it.
fn half(t: Duration) -> Duration {
    Duration::from_micros(u64::try_from(t.as_micros() / 2).unwrap_or(u64::MAX))
}

/// The earliest a refund at `now` may bring the next slot: `now`, where the budget counts its
/// sends, whose latest keeps the slots in time order whatever the beat says (a refund past
/// the latest slot is carried, and spent by the slots after it, see [`Budget::reserve`]);
/// else no earlier than the latest slot granted either.
fn refund_floor(rule: &Rule, now: Duration, last_slot: Duration) -> Duration {
    if rule.counts_sends() {
        now
    } else {
        now.max(last_slot)
    }
}

#[cfg(test)]
mod tests;
