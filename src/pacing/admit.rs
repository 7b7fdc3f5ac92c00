//! How a request gets its slot: waited for in its lane's queue, or in shadow mode taken by a
//! stand-in while the request goes at once; [`Pacer::enter`] decides which by the
//! destination's mode. A forwarded request enters from its exchange, a blind tunnel through
//! [`Pacer::tunnel`].

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::either::Either;

use super::lane::{self, Keys, Lane};
use super::{Admission, Asking, PaceError, PaceKeys, Pacer, Route};
use crate::budget::{Reservation, Rule};
use crate::class::Class;
use crate::destination::Mode;
use crate::metrics::{labels, labels_and};

impl Pacer {
    /// The one slot a blind tunnel to `route` takes (`intercept = false`): of its key's
    /// budget, by what the CONNECT shows (`asking`), waited for up to the class's `max_wait`.
    /// The tunnel sees no response, so nothing is observed after it.
    pub async fn tunnel(
        self: &Arc<Self>,
        route: Route,
        asking: &Asking<'_>,
        class: Class,
    ) -> Result<Admission, PaceError> {
        let route = self.keyed(route, asking).await?;
        let pace = route.pace();
        let started = Instant::now();
        let deadline = started + route.max_wait(class, &pace);
        self.enter(&route, &pace, class, started, deadline).await
    }

    /// A slot for a request of `class` to `route` that began to wait at `started`, by `pace`
    /// (the route's keys as the request found them) and its mode: waited for
    /// (`Pacer::admit_by`), or in shadow mode counted while the request goes at once.
    // Not an `async fn`: its future is the wait's own, not the wait's beside the arguments
    // it was made from (so too the steps below; a request's whole future is moved into its
    // connection's slot, and every byte of it is a cold write there).
    pub(super) fn enter<'a>(
        self: &'a Arc<Self>,
        route: &'a Route,
        pace: &'a PaceKeys,
        class: Class,
        started: Instant,
        deadline: Instant,
    ) -> impl Future<Output = Result<Admission, PaceError>> + Send + 'a {
        let keys = pace.keys();
        match keys.pace.mode {
            Mode::Enforce => Either::Left(self.admit_by(route, keys, class, started, deadline)),
            Mode::Shadow => Either::Right(std::future::ready(Ok(
                self.shadow(route, keys, class, deadline)
            ))),
        }
    }

    /// Waits for a slot of `route` for a request of `class`, up to `deadline`: the pacer's
    /// tests take slots so, by the route's keys as they are now.
    /// Cancel-safe: dropping the future leaves the queue at once.
    #[cfg(test)]
    pub(super) async fn admit(
        &self,
        route: &Route,
        class: Class,
        deadline: Instant,
    ) -> Result<Admission, PaceError> {
        self.admit_by(route, &route.lane.keys(), class, Instant::now(), deadline)
            .await
    }

    /// A slot of `route` for a request of `class` that began waiting at `started`, up to
    /// `deadline`, by `keys`: the lane's as the exchange found them (one look at them for the
    /// whole request: each look is a load every request on every core makes).
    // Not an `async fn`: see `Pacer::enter`.
    #[allow(clippy::manual_async_fn)]
    fn admit_by<'a>(
        &'a self,
        route: &'a Route,
        keys: &'a Keys,
        class: Class,
        started: Instant,
        deadline: Instant,
    ) -> impl Future<Output = Result<Admission, PaceError>> + Send + 'a {
        async move {
            let lane = &route.lane;
            self.open(lane).await?;
            let _admitting = lane.admitting();
            let permit = match &keys.concurrency {
                None => None,
                // Boxed: only where `max_concurrency` is set (see `Pacer::enter`).
                Some(sem) => {
                    let acquiring = tokio::time::timeout_at(deadline, sem.clone().acquire_owned());
                    match Box::pin(acquiring).await {
                        Ok(p) => p.ok(),
                        Err(_) => return Err(lane.deadline_error(class, lane.estimated_wait())),
                    }
                }
            };
            // The clock as it was read once the slot was due: the send, the wait and the
            // lateness are counted from that one reading.
            let (granted, now) = self
                .both_slots(lane, &keys.rule, class, started, deadline)
                .await?;
            let waited = now.saturating_duration_since(started);
            lane.series(&self.metrics)
                .wait
                .observe(waited.as_secs_f64());
            Ok(self.sent(route, keys, granted, now, waited, permit))
        }
    }

    /// A slot of `lane`, and where its parent paces the keys' total (`total_rate`), one of
    /// the total too, taken while the key's slot can still be used
    /// ([`Reservation::send_by`]): the request goes on both or on neither. A key's slot the
    /// total had no room for by then is dropped (counted with the slots dropped), and the
    /// request waits for another.
    // Not an `async fn`: see `Pacer::enter`.
    #[allow(clippy::manual_async_fn)]
    fn both_slots<'a>(
        &'a self,
        lane: &'a Arc<Lane>,
        rule: &'a Rule,
        class: Class,
        started: Instant,
        deadline: Instant,
    ) -> impl Future<Output = Result<(lane::Grant, Instant), PaceError>> + Send + 'a {
        async move {
            loop {
                let (granted, now) = self.slot(lane, rule, class, (started, deadline), 1).await?;
                let Some(total) = lane.total() else {
                    return Ok((granted, now));
                };
                let by = granted.slot.send_by(rule.max_late()).min(deadline);
                let of_total = total.keys();
                match self
                    .slot(total, &of_total.rule, class, (started, by), 1)
                    .await
                {
                    Ok((_, now)) => return Ok((granted, now)),
                    Err(PaceError::Deadline { .. }) if Instant::now() < deadline => {
                        lane.series(&self.metrics).slots_dropped.inc();
                    }
                    Err(PaceError::Deadline { .. }) => {
                        return Err(lane.deadline_error(class, lane.estimated_wait()))
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }

    /// Shadow mode: lets the request go at once, while a stand-in waits for the slot the
    /// request would have had (taking it, so that the schedule is the one enforcing would
    /// have made) and counts how long it would have waited, or why it would have been
    /// refused. `max_concurrency` is not applied.
    fn shadow(
        self: &Arc<Self>,
        route: &Route,
        keys: &Keys,
        class: Class,
        deadline: Instant,
    ) -> Admission {
        let lane = route.lane.clone();
        self.stand_in(lane.clone(), class, deadline, 1);
        // A throttle widens once per generation: the request counts as reserved under the
        // generation last seen.
        let granted = lane::Grant {
            class,
            slot: Reservation {
                at: Instant::now(),
                generation: lane.seen.lock().generation,
                unseen_late: Duration::ZERO,
            },
            cost: 1,
            sent: None,
        };
        self.sent(route, keys, granted, Instant::now(), Duration::ZERO, None)
    }

    /// Shadow mode's stand-in for a request that went at once: it waits in `stand_in`'s
    /// queue for the slot of `cost` the request would have had, takes it, and counts how
    /// long it waited or why it would have been refused. Owned by nothing: it ends with its
    /// slot, or at `deadline`.
    pub(super) fn stand_in(
        self: &Arc<Self>,
        stand_in: Arc<Lane>,
        class: Class,
        deadline: Instant,
        cost: u32,
    ) {
        let pacer = self.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let name = stand_in.label();
            let waited = async {
                pacer.open(&stand_in).await?;
                let _admitting = stand_in.admitting();
                let keys = stand_in.keys();
                pacer
                    .slot(&stand_in, &keys.rule, class, (started, deadline), cost)
                    .await
                    .map(|(granted, _)| granted)
            };
            match waited.await {
                Ok(_) => pacer
                    .metrics
                    .shadow_wait
                    .with_label_values(&labels(name))
                    .observe(started.elapsed().as_secs_f64()),
                Err(PaceError::ShuttingDown) => {}
                Err(e) => {
                    let reason = match e {
                        PaceError::Locked { .. } => "locked",
                        PaceError::Deadline { .. } => "max_wait",
                        _ => "store",
                    };
                    pacer
                        .metrics
                        .shadow_refusals
                        .with_label_values(&labels_and(name, reason))
                        .inc();
                }
            }
        });
    }

    /// Refuses at once while pacegate stops or the destination is locked.
    pub(super) async fn open(&self, lane: &Lane) -> Result<(), PaceError> {
        if self.stopped.load(Ordering::Acquire) {
            return Err(PaceError::ShuttingDown);
        }
        if lane.locked.borrow().is_some() {
            // Confirm with the store: another instance may have unlocked it.
            lane.read_lock(&*self.store).await;
            if let Some(lock) = lane.locked.borrow().clone() {
                return Err(lane.locked_error(lock));
            }
        }
        Ok(())
    }

    /// Waits in `lane`'s queue for a slot, up to `deadline`, and reads the clock once the
    /// slot is due. When nobody waits here and the store can hand out a slot that is due now
    /// ([`crate::budget::Store::take_now`]), the request takes it at once: no wake-up of the
    /// dispatcher and back, and a slot due already costs no other reading of the clock.
    // Not an `async fn`: see `Pacer::enter`.
    #[allow(clippy::manual_async_fn)]
    pub(super) fn slot<'a>(
        &'a self,
        lane: &'a Arc<Lane>,
        rule: &'a Rule,
        class: Class,
        (started, deadline): (Instant, Instant),
        cost: u32,
    ) -> impl Future<Output = Result<(lane::Grant, Instant), PaceError>> + Send + 'a {
        async move {
            let now = Instant::now();
            let taken = {
                // Held while the store is asked, so that no request queues meanwhile: one that
                // waits here goes first. A meter's slot is as long as its request's cost.
                let queue = lane.queue.lock();
                (queue.len() == 0 && !lane.is_retired())
                    .then(|| self.store.take_now(&lane.name, &rule.weighted(cost), now))
                    .flatten()
            };
            if let Some(slot) = taken {
                let now = until(slot.at, now).await;
                // A slot taken at once is the memory store's: its instant names its send.
                let sent = None;
                return Ok((
                    lane::Grant {
                        class,
                        slot,
                        cost,
                        sent,
                    },
                    now,
                ));
            }
            // Boxed: a request that waits in the queue waits for its slot anyway, and the wait
            // is most of what this future would hold in every request's (see `Pacer::enter`).
            let granted = Box::pin(async {
                let (_seat, rx) = lane.enqueue(class, started, deadline, cost);
                // A key's dispatcher runs only while someone waits (see `Lane::dispatching`).
                if !lane.dispatching.swap(true, Ordering::SeqCst) {
                    self.dispatch(lane);
                }
                tokio::select! {
                    g = rx => g.unwrap_or(Err(PaceError::ShuttingDown)),
                    () = tokio::time::sleep_until(deadline) => Err(lane.deadline_error(class, lane.estimated_wait())),
                }
            })
            .await?;
            Ok((granted, Instant::now()))
        }
    }

    /// Counts a request sent `now` on `granted` and makes its admission.
    fn sent(
        &self,
        route: &Route,
        keys: &Keys,
        granted: lane::Grant,
        now: Instant,
        waited: Duration,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Admission {
        let lane = &route.lane;
        lane.tally.sends.lock().record(granted.class, now);
        lane.series(&self.metrics)
            .granted(self.classes.name(granted.class))
            .inc();
        lane.tally.in_flight.fetch_add(1, Ordering::Relaxed);
        Admission {
            lane: lane.clone(),
            lanes: route.lanes.clone(),
            class: granted.class,
            slot: granted.slot,
            max_late: keys.rule.max_late(),
            waited,
            sent: now,
            _permit: permit,
        }
    }
}

/// Waits for a slot taken at once that is a moment ahead ([`crate::budget::Store::take_now`]:
/// at most `store::memory::NEAR`, 10 us) by spinning on the clock: the request never goes
/// before its slot. Not by yielding: behind a few hundred ready tasks a yield can take
/// milliseconds, and the slot would be too late to use. Not by the timer either, which waits
/// at least a tick. A clock that does not move while spinning (paused, in tests) hands over
/// to the timer after `SPIN` of real time. Returns the clock as last read, at or after `at`;
/// a slot due already by `now`, the reading it was taken at (most are), is not waited for.
// Not an `async fn`: the spin is done before the future is made, which is then the clock's
// reading, or (rarely) the timer's wait, boxed (see `Pacer::enter`).
#[expect(
    clippy::disallowed_methods,
    reason = "the spin's own bound is real time: a paused clock does not move while it spins"
)]
fn until(at: Instant, now: Instant) -> impl Future<Output = Instant> + Send {
    const SPIN: Duration = Duration::from_micros(100);
    if now >= at {
        return Either::Left(std::future::ready(now));
    }
    let spinning = std::time::Instant::now();
    loop {
        let now = Instant::now();
        if now >= at {
            return Either::Left(std::future::ready(now));
        }
        if spinning.elapsed() > SPIN {
            return Either::Right(Box::pin(async move {
                tokio::time::sleep_until(at).await;
                Instant::now()
            }));
        }
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_slot_due_already_is_not_waited_for() {
        let now = Instant::now();
        assert_eq!(until(now - Duration::from_millis(1), now).await, now);
        assert_eq!(until(now, now).await, now);
    }

    /// The slot a take hands out at most `store::memory::NEAR` ahead: spun for on the real
    /// clock, never returned before it.
    #[tokio::test]
    async fn a_slot_a_moment_ahead_is_spun_for_and_never_returned_early() {
        for _ in 0..100 {
            let now = Instant::now();
            let at = now + Duration::from_micros(10);
            let reading = until(at, now).await;
            assert!(reading >= at, "{:?} before its slot", at - reading);
        }
    }

    /// On a paused clock the spin cannot end: it hands over to the timer after its bound.
    #[tokio::test(start_paused = true)]
    async fn a_clock_that_does_not_move_hands_over_to_the_timer() {
        let now = Instant::now();
        let at = now + Duration::from_millis(3);
        assert_eq!(until(at, now).await, at);
    }
}
