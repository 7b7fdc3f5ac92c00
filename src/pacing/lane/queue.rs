//! The requests waiting on a lane for a slot: one FIFO per class, most urgent first, and the
//! hand-out of a slot to the waiter it is for.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::budget::{ClassQueue, Reservation};
use crate::class::Class;
use crate::pacing::PaceError;

/// What a waiter is handed: a slot, for `class`.
pub(in crate::pacing) struct Grant {
    pub(in crate::pacing) class: Class,
    /// The request goes no earlier, and not much later.
    pub(in crate::pacing) slot: Reservation,
    /// What the slot was reserved for in the budget's unit: 1 for a request budget; for a
    /// meter, the cost of the request it was asked for, which the request's own settles
    /// against.
    pub(in crate::pacing) cost: u32,
    /// The slot's mark in a quota window, where its store gave one (see
    /// [`crate::budget::Grant::sent`]).
    pub(in crate::pacing) sent: Option<u64>,
}

/// One request waiting for a slot.
pub(in crate::pacing) struct Waiter {
    id: u64,
    pub(in crate::pacing) class: Class,
    since: Instant,
    pub(in crate::pacing) deadline: Instant,
    /// Its cost in the budget's unit (1 but in a meter's lane).
    cost: u32,
    tx: oneshot::Sender<Result<Grant, PaceError>>,
}

impl Waiter {
    /// Whether the request gave up (its client left, or its deadline passed).
    pub(in crate::pacing) fn gone(&self) -> bool {
        self.tx.is_closed()
    }

    /// Tells the request it will get no slot.
    pub(in crate::pacing) fn refuse(self, error: PaceError) {
        let _ = self.tx.send(Err(error));
    }
}

/// The waiting requests of a lane: one FIFO per class, most urgent first.
pub(in crate::pacing) struct Queue {
    next_id: u64,
    classes: Vec<VecDeque<Waiter>>,
}

impl Queue {
    pub(in crate::pacing) fn new(classes: usize) -> Self {
        Self {
            next_id: 0,
            classes: (0..classes.max(1)).map(|_| VecDeque::new()).collect(),
        }
    }

    pub(in crate::pacing) fn len(&self) -> usize {
        self.classes.iter().map(VecDeque::len).sum()
    }

    pub(in crate::pacing) fn iter(&self) -> impl Iterator<Item = &Waiter> {
        self.classes.iter().flatten()
    }

    /// The class's waiters, oldest first.
    fn class(&self, class: Class) -> &VecDeque<Waiter> {
        &self.classes[usize::from(class.0).min(self.classes.len() - 1)]
    }

    /// How many of `class` wait, and the oldest's wait at `now`.
    pub(in crate::pacing) fn waiting(&self, class: Class, now: Instant) -> (usize, Duration) {
        let here = self.class(class);
        let oldest = here.front().map_or(Duration::ZERO, |w| now - w.since);
        (here.len(), oldest)
    }

    fn retain(&mut self, mut keep: impl FnMut(&Waiter) -> bool) {
        for q in &mut self.classes {
            q.retain(&mut keep);
        }
    }

    /// Queues a request of `class` that started waiting at `since`, told its slot on `tx`;
    /// its place, to leave by ([`Queue::leave`]).
    pub(in crate::pacing) fn join(
        &mut self,
        class: Class,
        since: Instant,
        deadline: Instant,
        cost: u32,
        tx: oneshot::Sender<Result<Grant, PaceError>>,
    ) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        let rank = usize::from(class.0).min(self.classes.len() - 1);
        self.classes[rank].push_back(Waiter {
            id,
            class,
            since,
            deadline,
            cost,
            tx,
        });
        id
    }

    /// Takes the waiter at `id` out, if it is still queued.
    pub(in crate::pacing) fn leave(&mut self, id: u64) -> bool {
        let before = self.len();
        self.retain(|w| w.id != id);
        self.len() < before
    }

    /// Hands `slot` to the oldest waiter of `class` that can still use it, or, if that class
    /// has none left, to the oldest of the most urgent class that has one. Waiters whose
    /// deadline falls before the slot are refused (`late` says why, by their class): they
    /// could not have been served in time.
    pub(in crate::pacing) fn hand_out(
        &mut self,
        class: Class,
        (slot, sent): (Reservation, Option<u64>),
        cost: u32,
        late: impl Fn(Class) -> PaceError,
    ) -> bool {
        let first = usize::from(class.0).min(self.classes.len() - 1);
        let order = std::iter::once(first).chain((0..self.classes.len()).filter(|i| *i != first));
        for i in order {
            while let Some(w) = self.classes[i].pop_front() {
                if w.gone() {
                    continue;
                }
                let class = Class(u16::try_from(i).unwrap_or(u16::MAX));
                if w.deadline < slot.at {
                    w.refuse(late(class));
                    continue;
                }
                let grant = Grant {
                    class,
                    slot,
                    cost,
                    sent,
                };
                if w.tx.send(Ok(grant)).is_ok() {
                    return true;
                }
            }
        }
        false
    }

    pub(in crate::pacing) fn drain(&mut self) -> Vec<Waiter> {
        self.classes.iter_mut().flat_map(|q| q.drain(..)).collect()
    }

    /// Takes out the waiters whose deadline comes before `slot`: they cannot wait for it.
    pub(in crate::pacing) fn drain_before(&mut self, slot: Instant) -> Vec<Waiter> {
        let mut out = Vec::new();
        for q in &mut self.classes {
            let (late, keep): (VecDeque<Waiter>, VecDeque<Waiter>) =
                q.drain(..).partition(|w| w.deadline < slot);
            out.extend(late);
            *q = keep;
        }
        out
    }

    /// Forgets the requests that gave up; returns the latest deadline of those left.
    pub(in crate::pacing) fn prune(&mut self) -> Option<Instant> {
        self.retain(|w| !w.gone());
        self.iter().map(|w| w.deadline).max()
    }

    /// What the next slot is asked for in the budget's unit: the largest cost of the oldest
    /// waiter of each class (the store picks the class), less the `promised` (see
    /// [`Queue::wait_list_less`]). A waiter that costs less settles the difference.
    pub(in crate::pacing) fn next_cost(&self, promised: &[(Class, usize)]) -> u32 {
        self.classes
            .iter()
            .enumerate()
            .filter_map(|(i, q)| q.get(self.promised_of(promised, i)).map(|w| w.cost))
            .max()
            .unwrap_or(1)
    }

    /// How many of the class at rank `i` are `promised` slots already.
    fn promised_of(&self, promised: &[(Class, usize)], i: usize) -> usize {
        let last = self.classes.len() - 1;
        promised
            .iter()
            .filter(|(c, _)| usize::from(c.0).min(last) == i)
            .map(|(_, n)| n)
            .sum()
    }

    /// The wait list as the store takes it: per class with waiters, how many and since when
    /// the oldest two wait.
    pub(in crate::pacing) fn wait_list(&self) -> Vec<ClassQueue> {
        self.wait_list_less(&[])
    }

    /// The wait list less the oldest requests of each class that slots already granted and
    /// still to come are for (`promised`: how many of a class, a class possibly more than
    /// once), which the store has already taken off the list.
    pub(in crate::pacing) fn wait_list_less(&self, promised: &[(Class, usize)]) -> Vec<ClassQueue> {
        self.classes
            .iter()
            .enumerate()
            .filter_map(|(i, q)| {
                let skip = self.promised_of(promised, i);
                let count = q.len().checked_sub(skip).filter(|n| *n > 0)?;
                Some(ClassQueue {
                    class: Class(u16::try_from(i).unwrap_or(u16::MAX)),
                    count: u32::try_from(count).unwrap_or(u32::MAX),
                    oldest: q[skip].since,
                    next: q.get(skip + 1).map(|w| w.since),
                })
            })
            .collect()
    }
}
