//! One destination's dispatcher: whenever someone waits, it hands the store this instance's
//! wait list and asks for the next slot. The store grants it to the request that deserves it
//! over every instance (by class, then age); when that request is one of ours the dispatcher
//! sleeps until the slot and hands it out, otherwise it yields and asks again shortly. Where
//! the interval is short ([`crate::budget::Rule::batches`]) it asks for as many slots as it
//! has requests waiting, and one answer may grant a batch of them. The dispatcher is the only
//! writer of this instance's wait list in the store, so its updates arrive in order.
//!
//! Where more requests wait than the slots granted serve, the next reservation is asked
//! [`ASK_AHEAD`] before the last slot granted, not after it: a store that stalls for less than
//! that (a commit waiting on its log flush, a busy host) then grants the next slot before it
//! is due, and the beat goes on. Otherwise a stall longer than the interval grants a slot
//! already past, and the schedule restarts from "now". Where the interval is shorter than
//! [`ASK_AHEAD`], the answer may come while earlier slots are still to hand out, and the next
//! is asked at once: reservations are asked one after another (the store hears this
//! instance's wait list in order), and their answers are acted on in turn.
//!
//! A store a network hop away answers a round trip later ([`Dispatcher::trip`], smoothed
//! from the reservations' own times): where the interval is shorter than two of those, slots
//! go in batches whatever the interval, and the next reservation is asked at least two round
//! trips before the last slot granted, so that the next answer is back before the slots run
//! out. Otherwise an instance far from its store could be served at most one slot per round
//! trip, and a destination faster than that would run at the store's pace, not its rate.
//!
//! Each turn of the loop is named steps: [`Dispatcher::wait_for_waiters`], then
//! [`Dispatcher::serve`], which for each slot granted runs [`Dispatcher::sleep_to_slot`] and
//! [`Dispatcher::settle`] (or [`Dispatcher::refused`] when the store granted nothing).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{Histogram, IntCounter};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::lane::{Keys, Lane, Queue};
use super::PaceError;
use crate::budget::{
    after_grant, Ask, ClassQueue, Grant, Lockout, Reservation, ReserveError, Store,
};
use crate::class::Class;
use crate::metrics::labels;
use crate::metrics::Metrics;

/// One tick of tokio's timer wheel.
const TIMER_TICK: Duration = Duration::from_millis(1);
/// Yields before falling back to the timer (bounds the spin, and lets paused-clock tests
/// advance).
const MAX_SPINS: u32 = 20_000;
/// Lanes whose interval is at least this long yield through the last tick before a slot.
const SPIN_FROM: Duration = Duration::from_millis(20);
/// How often a dispatcher waiting for a distant slot checks the budget for a lockout taken by
/// another instance.
const LOCK_POLL: Duration = Duration::from_millis(500);
/// How long a dispatcher whose store failed waits before asking again.
const AFTER_FAILURE: Duration = Duration::from_millis(100);
/// The most slots one reservation asks for (see [`crate::budget::Ask::most`]).
const MAX_BATCH: usize = 4096;
/// How long before the last slot granted the next reservation is asked, where more requests
/// wait: the longest store stall that costs no slot. It is also how much longer a request on
/// another instance may wait behind slots already granted here.
const ASK_AHEAD: Duration = Duration::from_millis(50);
/// How much of each new reservation's time the smoothed round trip takes in.
const TRIP_SMOOTHING: f64 = 0.125;

/// Runs one destination's dispatcher until `stop`.
pub(super) async fn dispatch(
    lane: Arc<Lane>,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    let mut d = Dispatcher {
        locked: lane.locked.subscribe(),
        reservation_seconds: metrics
            .reservation_seconds
            .with_label_values(&[store.kind()]),
        slots_dropped: metrics
            .slots_dropped
            .with_label_values(&labels(lane.label())),
        lane,
        store,
        stop,
        ahead: None,
        answered: VecDeque::new(),
        trip: Duration::ZERO,
    };
    while let Some(latest) = d.wait_for_waiters().await {
        let next = match d.answered.pop_front() {
            Some(answered) => Some(answered),
            None => match d.ahead.take() {
                Some(ahead) => Some(ahead.answer().await),
                None => None,
            },
        };
        if let Some(Answered { reply, asked }) = next {
            // Asked while earlier slots were handed out. A yield still stands for the rest of
            // its time; anything else is old news by now (a deadline, a failure): ask again.
            let carry_on = match reply {
                Some(Ok(grant)) => d.serve(grant, &asked, true).await,
                Some(Err(ReserveError::Yield(after))) if asked.at + after > Instant::now() => {
                    let left = asked.at + after - Instant::now();
                    d.refused(ReserveError::Yield(left), &asked.list).await
                }
                _ => true,
            };
            if !carry_on {
                return;
            }
            continue;
        }
        let started = Instant::now();
        let (wait_list, waiting, cost) = {
            let queue = d.lane.queue.lock();
            (queue.wait_list(), queue.len(), d.cost_of(&queue, &[]))
        };
        let keys = d.lane.keys();
        let most = d.most(&keys, waiting);
        let turns = d.lane.turns.load(Ordering::Relaxed);
        let ask = Ask {
            queues: &wait_list,
            not_after: Some(latest),
            most,
            cost,
        };
        let reserved = d.store.reserve(&d.lane.name, &keys.rule, ask).await;
        d.reservation_seconds
            .observe(started.elapsed().as_secs_f64());
        d.took(started.elapsed());
        let carry_on = match reserved {
            Ok(grant) => {
                let asked = Asked {
                    list: wait_list,
                    turns,
                    at: started,
                    cost,
                };
                d.serve(grant, &asked, false).await
            }
            Err(no) => d.refused(no, &wait_list).await,
        };
        if !carry_on {
            return;
        }
    }
}

/// The classes waiting and their oldest requests: what other instances' reservations are
/// decided by.
fn heads(list: &[ClassQueue]) -> Vec<(Class, Instant)> {
    list.iter().map(|q| (q.class, q.oldest)).collect()
}

/// How a reservation asked ahead was asked.
struct Asked {
    /// The wait list it told.
    list: Vec<ClassQueue>,
    /// [`Lane::turns`] when it was asked.
    turns: u64,
    /// When it was asked.
    at: Instant,
    /// What each slot was asked for in the budget's unit (see [`Ask::cost`]).
    cost: u32,
}

/// A reservation asked before the slots it follows were all handed out (see [`ASK_AHEAD`]),
/// not answered yet.
struct Ahead {
    reply: tokio::task::JoinHandle<Result<Grant, ReserveError>>,
    asked: Asked,
}

impl Ahead {
    async fn answer(self) -> Answered {
        Answered {
            reply: self.reply.await.ok(),
            asked: self.asked,
        }
    }
}

/// A reservation asked ahead and answered, to act on once the slots before it are handed out.
struct Answered {
    /// `None` if the task asking failed.
    reply: Option<Result<Grant, ReserveError>>,
    asked: Asked,
}

impl Answered {
    /// The grant's class and how many slots it holds for it, if it granted any.
    fn promised(&self) -> Option<(Class, usize)> {
        match &self.reply {
            Some(Ok(grant)) => Some((grant.class, grant.more.len() + 1)),
            _ => None,
        }
    }
}

/// The answer of the reservation asked ahead, if any; never ready without one.
async fn answer_of(ahead: &mut Option<Ahead>) -> Option<Result<Grant, ReserveError>> {
    match ahead {
        Some(a) => (&mut a.reply).await.ok(),
        None => std::future::pending().await,
    }
}

/// How a sleep to a slot ended (`None`: pacegate is stopping).
enum Slept {
    /// The slot has come.
    OnTime,
    /// The destination was locked out meanwhile; the slot must not be used.
    Locked(Lockout),
}

struct Dispatcher {
    lane: Arc<Lane>,
    store: Arc<dyn Store>,
    stop: CancellationToken,
    locked: watch::Receiver<Option<Lockout>>,
    reservation_seconds: Histogram,
    slots_dropped: IntCounter,
    /// The next reservation, asked ahead.
    ahead: Option<Ahead>,
    /// Reservations asked ahead and answered, in the order they were asked.
    answered: VecDeque<Answered>,
    /// How long a reservation takes, smoothed: the store's round trip as seen from here.
    trip: Duration,
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        self.forget_ahead();
    }
}

impl Dispatcher {
    /// Takes in how long a reservation took.
    fn took(&mut self, took: Duration) {
        self.trip = if self.trip.is_zero() {
            took
        } else {
            self.trip.mul_f64(1.0 - TRIP_SMOOTHING) + took.mul_f64(TRIP_SMOOTHING)
        };
    }

    /// How many slots to ask for with `waiting` requests waiting (see [`Ask::most`]): a
    /// batch where the rule asks for one, or where the interval is shorter than two round
    /// trips to the store.
    fn most(&self, keys: &Keys, waiting: usize) -> u32 {
        // A meter's slots are each its request's cost long: one at a time.
        if self.lane.unit().is_some() {
            return 1;
        }
        let backoff = self.lane.seen.lock().backoff;
        let far = keys.rule.interval.mul_f64(backoff) < 2 * self.trip;
        if far || keys.rule.batches(backoff) {
            u32::try_from(waiting.min(MAX_BATCH)).unwrap_or(1)
        } else {
            1
        }
    }

    /// What the next slot is asked for in the lane's unit, the `promised` oldest requests
    /// served already: 1 but in a meter's lane (see [`Queue::next_cost`]).
    fn cost_of(&self, queue: &Queue, promised: &[(Class, usize)]) -> u32 {
        if self.lane.unit().is_some() {
            queue.next_cost(promised)
        } else {
            1
        }
    }

    /// Drops what was asked ahead: the reservation still out, and the slots answered.
    fn forget_ahead(&mut self) {
        if let Some(ahead) = self.ahead.take() {
            ahead.reply.abort();
        }
        self.answered.clear();
    }

    /// The requests that slots already granted are for: the `promised` oldest of `class` (the
    /// grant being handed out), then those of every grant answered since.
    fn promised(&self, class: Class, promised: usize) -> Vec<(Class, usize)> {
        std::iter::once((class, promised))
            .chain(self.answered.iter().filter_map(Answered::promised))
            .collect()
    }

    /// When to ask ahead again while the grant being handed out ends at `last`: unless a
    /// reservation is out, [`ASK_AHEAD`] (or two round trips, if longer) before the last slot
    /// granted. `None` while one is out, or once one granted nothing (that answer is acted on
    /// first).
    fn ask_at(&self, last: Instant) -> Option<Instant> {
        // A meter's next slot is asked for the request that will wait for it then.
        if self.ahead.is_some() || self.lane.unit().is_some() {
            return None;
        }
        let mut last = last;
        for a in &self.answered {
            match &a.reply {
                Some(Ok(grant)) => last = *grant.more.last().unwrap_or(&grant.slot.at),
                _ => return None,
            }
        }
        let ahead = ASK_AHEAD.max(2 * self.trip);
        Some(last.checked_sub(ahead).unwrap_or(last))
    }

    /// Asks for the next slots while the requests `promised` still wait for slots already
    /// granted, if any other request waits; says whether it asked.
    fn ask_ahead(&mut self, promised: &[(Class, usize)]) -> bool {
        let lane = &self.lane;
        let held: usize = promised.iter().map(|(_, n)| n).sum();
        let (asked, waiting, latest, cost) = {
            let mut queue = lane.queue.lock();
            let latest = queue.prune();
            let asked = queue.wait_list_less(promised);
            let cost = self.cost_of(&queue, promised);
            (asked, queue.len().saturating_sub(held), latest, cost)
        };
        let Some(latest) = latest.filter(|_| !asked.is_empty()) else {
            return false;
        };
        let keys = lane.keys();
        let most = self.most(&keys, waiting);
        let turns = lane.turns.load(Ordering::Relaxed);
        let (store, name, list) = (self.store.clone(), lane.name.clone(), asked.clone());
        let histogram = self.reservation_seconds.clone();
        // Owned by the dispatcher (`ahead`): ends with the store's answer, or is aborted
        // when the dispatcher forgets it (`forget_ahead`, its drop included).
        let reply = tokio::spawn(async move {
            let started = Instant::now();
            let ask = Ask {
                queues: &list,
                not_after: Some(latest),
                most,
                cost,
            };
            let reserved = store.reserve(&name, &keys.rule, ask).await;
            histogram.observe(started.elapsed().as_secs_f64());
            reserved
        });
        self.ahead = Some(Ahead {
            reply,
            asked: Asked {
                list: asked,
                turns,
                at: Instant::now(),
                cost,
            },
        });
        true
    }

    /// Hands out a grant's slots, each when it comes, to the oldest waiters of its class.
    /// The rest of a batch is dropped (never sent late, never past what the budget learnt
    /// since) when the destination is locked, or the budget seen here turns stricter (a
    /// throttle widened it, a pause began) after `turns`, when it was asked; a grant asked
    /// ahead is dropped whole. `asked` is how the grant was asked: its wait list, turns and
    /// cost. Returns false when pacegate stops.
    async fn serve(&mut self, grant: Grant, asked: &Asked, ahead: bool) -> bool {
        let (turns, cost) = (asked.turns, asked.cost);
        let asked = &asked.list[..];
        let count = grant.more.len() + 1;
        let granted = u32::try_from(count).unwrap_or(u32::MAX);
        let mut told = heads(&after_grant(asked, grant.class, granted));
        let last = *grant.more.last().unwrap_or(&grant.slot.at);
        let slots = std::iter::once(grant.slot.at).chain(grant.more.iter().copied());
        for (i, at) in slots.enumerate() {
            let slot = Reservation { at, ..grant.slot };
            let sent = grant.sent.get(i).copied();
            match self
                .sleep_to_slot(slot, grant.class, count - i, last, &mut told)
                .await
            {
                // The budget turned stricter after the batch was granted (the first slot
                // was granted knowing it all, unless it was asked ahead).
                Some(Slept::OnTime)
                    if (i > 0 || ahead) && self.lane.turns.load(Ordering::Relaxed) != turns =>
                {
                    let left = count - i;
                    self.slots_dropped.inc_by(left as u64);
                    tracing::debug!(destination = %self.lane.name, left, "the budget turned stricter; the rest of the batch is dropped");
                    return true;
                }
                Some(Slept::OnTime) => self.settle((slot, sent), grant.class, cost),
                Some(Slept::Locked(lock)) => {
                    self.forget_ahead();
                    self.lane.refuse_all(&self.lane.locked_error(lock));
                    return true;
                }
                None => return false,
            }
        }
        true
    }

    /// Waits until a request waits; returns the latest deadline among the waiters, or `None`
    /// when pacegate stops or the lane is retired and empty. A dispatcher with nothing left to wait for tells the store so.
    async fn wait_for_waiters(&mut self) -> Option<Instant> {
        loop {
            let latest = self.lane.queue.lock().prune();
            if latest.is_some() {
                return latest;
            }
            // Removed by a reload, and nobody left waiting: no request is routed here again.
            if self.lane.is_retired() {
                return None;
            }
            // A reservation asked ahead lands first, so that the empty list is the last word;
            // the slots asked ahead go unused.
            if let Some(ahead) = self.ahead.take() {
                let _ = ahead.reply.await;
            }
            self.answered.clear();
            // Whether the store already knows is its own business: an unchanged list costs
            // it nothing.
            if let Err(e) = self.store.wait_list(&self.lane.name, &[]).await {
                tracing::debug!(destination = %self.lane.name, "cannot clear the wait list: {e}");
            }
            // A key's dispatcher ends here; the next request to queue starts another. One
            // that queued meanwhile either sees the flag down and starts it, or is seen here.
            if self.lane.parent.is_some() {
                self.lane.dispatching.store(false, Ordering::SeqCst);
                if self.lane.queue.lock().len() == 0
                    || self.lane.dispatching.swap(true, Ordering::SeqCst)
                {
                    return None;
                }
                continue;
            }
            // `notify_one` keeps a permit, so a waiter that arrives between the check and the
            // wait is not missed.
            tokio::select! {
                () = self.lane.work.notified() => {}
                () = self.stop.cancelled() => return None,
            }
        }
    }

    /// Sleeps until `slot`, holding no lock and no store connection. Another instance may
    /// lock the destination meanwhile (a shared store), so a long wait looks at the budget
    /// every [`LOCK_POLL`]: waiters are refused promptly, and the slot is never used.
    /// When the wait list changes in what other instances decide by (`told`: the classes
    /// waiting here and their oldest requests, as the store holds them), it is told to the
    /// store at once, less the `promised` oldest requests of `class` that this slot and the
    /// rest of its batch are for (and those of grants answered ahead); a mere count rides with
    /// the next reservation (and while a reservation asked ahead is out, the list waits for
    /// the next: it must not overtake it). The next slots are asked [`ASK_AHEAD`] before the
    /// last slot granted (the grant's own is `last`), or as soon as another request waits
    /// after that.
    async fn sleep_to_slot(
        &mut self,
        slot: Reservation,
        class: Class,
        promised: usize,
        last: Instant,
        told: &mut Vec<(Class, Instant)>,
    ) -> Option<Slept> {
        self.locked.borrow_and_update();
        let spin = self.lane.interval() >= SPIN_FROM;
        let mut poll_at = Instant::now() + LOCK_POLL;
        // Whether asking ahead waits for another request to arrive: nobody else waited when
        // it was last time to ask.
        let mut ask_on_arrival = false;
        loop {
            let mut ask_at = self.ask_at(last);
            if ask_at.is_some_and(|at| Instant::now() >= at) && !ask_on_arrival {
                ask_on_arrival = !self.ask_ahead(&self.promised(class, promised));
                ask_at = None;
            }
            let lane = &self.lane;
            // The timer wheel rounds a deadline up to the next millisecond: aim one tick
            // early, then yield until the slot (never before it).
            let mut wake = slot
                .at
                .checked_sub(TIMER_TICK)
                .unwrap_or(slot.at)
                .min(poll_at);
            if let Some(at) = ask_at.filter(|at| *at > Instant::now()) {
                wake = wake.min(at);
            }
            let mut arrived = false;
            let mut answer = None;
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                _ = self.locked.changed() => {}
                () = lane.work.notified() => arrived = true,
                reply = answer_of(&mut self.ahead) => answer = Some(reply),
                () = self.stop.cancelled() => return None,
            }
            if let Some(reply) = answer {
                // Answered while earlier slots are still to hand out: kept in order, and the
                // next may be asked at once.
                if let Some(ahead) = self.ahead.take() {
                    self.took(ahead.asked.at.elapsed());
                    self.answered.push_back(Answered {
                        reply,
                        asked: ahead.asked,
                    });
                }
                continue;
            }
            if arrived {
                if ask_on_arrival {
                    ask_on_arrival = false;
                    if self.ahead.is_none() {
                        ask_on_arrival = !self.ask_ahead(&self.promised(class, promised));
                    }
                }
                let lane = &self.lane;
                if self.ahead.is_none() {
                    let wait_list = lane
                        .queue
                        .lock()
                        .wait_list_less(&self.promised(class, promised));
                    let now = heads(&wait_list);
                    if now != *told {
                        if let Err(e) = self.store.wait_list(&lane.name, &wait_list).await {
                            tracing::debug!(destination = %lane.name, "cannot tell the wait list: {e}");
                        }
                        *told = now;
                    }
                }
                continue;
            }
            let lane = &self.lane;
            if let Some(lock) = self.locked.borrow_and_update().clone() {
                return Some(Slept::Locked(lock));
            }
            if Instant::now() + TIMER_TICK >= slot.at {
                // Yielding costs CPU for up to a tick per slot: worth it only where a tick is
                // a small part of the interval.
                let mut spins = if spin { 0 } else { MAX_SPINS };
                while Instant::now() < slot.at && spins < MAX_SPINS {
                    tokio::task::yield_now().await;
                    spins += 1;
                }
                if Instant::now() < slot.at {
                    tokio::time::sleep_until(slot.at).await;
                }
                return Some(Slept::OnTime);
            }
            if Instant::now() >= poll_at {
                poll_at = Instant::now() + LOCK_POLL;
                lane.poll_lock(&*self.store, LOCK_POLL).await;
            }
        }
    }

    /// Hands the slot that has come to the request of `class` it was granted for, unless it
    /// came too late to use.
    fn settle(&self, (slot, sent): (Reservation, Option<u64>), class: Class, cost: u32) {
        let lane = &self.lane;
        // A slot is an instant, not a licence: a request sent well after it (this process was
        // descheduled, or the store's answer was delayed) would bunch with the next ones. Such
        // a slot is dropped, which can only slow the destination.
        if let Some(late) = lane.too_late(&slot) {
            self.slots_dropped.inc();
            tracing::info!(destination = %lane.name, late_ms = late.as_secs_f64() * 1000.0, "slot too late to use; reserving another");
            return;
        }
        if !lane.hand_out(class, (slot, sent), cost) {
            tracing::debug!(destination = %lane.name, "a reserved slot found no waiter (all gave up)");
        }
    }

    /// Acts on a reservation of the wait list `asked` that granted nothing; returns false
    /// when pacegate stops.
    async fn refused(&mut self, no: ReserveError, asked: &[ClassQueue]) -> bool {
        let lane = &self.lane;
        match no {
            ReserveError::Yield(after) => {
                // A request on another instance goes first. Ask again once the next slot is
                // near, or at once if what the store decides by changes here (a class starts
                // or stops waiting, the oldest request leaves): a new request of a class
                // already waiting changes nothing there.
                let until = Instant::now() + after;
                let asked = heads(asked);
                loop {
                    tokio::select! {
                        () = tokio::time::sleep_until(until) => break,
                        () = lane.work.notified() => {
                            if heads(&lane.queue.lock().wait_list()) != asked {
                                break;
                            }
                        }
                        _ = self.locked.changed() => {
                            if let Some(lock) = self.locked.borrow_and_update().clone() {
                                lane.refuse_all(&lane.locked_error(lock));
                            }
                            break;
                        }
                        () = self.stop.cancelled() => return false,
                    }
                }
            }
            ReserveError::Locked(lock) => {
                lane.note_lock(lock.clone());
                lane.refuse_all(&lane.locked_error(lock));
            }
            ReserveError::TooLate { slot } => {
                // Every waiter asked for has a deadline before the first free slot: refuse
                // them now rather than let them wait for nothing. One that came since, with
                // a later deadline (a request's own, behind a meter's quick second try),
                // waits on.
                let retry_after = slot.saturating_duration_since(Instant::now());
                let waiters = lane.queue.lock().drain_before(slot);
                for w in waiters {
                    let error = lane.deadline_error(w.class, retry_after);
                    w.refuse(error);
                }
            }
            ReserveError::Store(e) => {
                tracing::error!(destination = %lane.name, "cannot reserve a slot: {e}");
                lane.refuse_all(&PaceError::Store(e));
                tokio::select! {
                    () = tokio::time::sleep(AFTER_FAILURE) => {}
                    () = self.stop.cancelled() => return false,
                }
            }
            ReserveError::Busy(after) => {
                // The waiters keep waiting, within their own deadlines.
                tracing::warn!(destination = %lane.name, "the store did not answer within {after:?}; trying again");
            }
        }
        true
    }
}
