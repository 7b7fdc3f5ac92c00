//! The embedded store: budgets in process memory, for a single instance. What survives a
//! restart is written to a state file (`store::memory::state_file`).

mod state_file;

use state_file::Durability;

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::budget::schedule::{Budget, NoSlot, Sent, Waiting};
use crate::budget::{
    halted_by, Ask, BudgetView, ClassQueue, ClassWaiting, Event, Grant, Lockout, Observation,
    Reservation, ReserveError, Rule, Snapshot, Store, StoreError, VendorView,
};
use crate::fleet::failover::Fallback;
use crate::fleet::Instance;

/// What the store's time 0 is before its epoch: far enough that slots taken before the store
/// started (a quota window's sends from the state file, a request that waited before it)
/// still have a place on its timeline.
const ORIGIN: Duration = Duration::from_secs(1 << 32);

/// How far ahead a slot may be and still be taken at once ([`Store::take_now`]), and never
/// more than one interval: the request spins on the clock until it, which costs little CPU
/// for so short a wait, and never goes before it.
pub const NEAR: Duration = Duration::from_micros(10);

/// Where the store reads the wall clock, which places pauses, vendor resets and the state
/// file's times.
#[derive(Debug, Clone, Copy)]
enum Wall {
    /// The system's.
    System,
    /// One that moves with the store's instant clock from `at_epoch`, so that a test on paused
    /// time sets both at once (the model test).
    #[cfg(test)]
    Follows { at_epoch: SystemTime },
}

/// Every budget by name. Looked up on every request that takes its slot at once, so hashed
/// with aHash (keyed at random per process, as SipHash is), several times faster on a short
/// name.
type Budgets = HashMap<String, Budget, ahash::RandomState>;

/// Budgets in memory, optionally persisted to a state file.
pub struct MemoryStore {
    epoch: Instant,
    wall: Wall,
    budgets: Arc<Mutex<Budgets>>,
    state_file: Option<PathBuf>,
    /// Serialises writes of the state file, so that its journal's lines are in order.
    writer: tokio::sync::Mutex<()>,
    /// The state file's journal, once open.
    journal: Arc<Mutex<Option<state_file::Journal>>>,
    /// Budgets whose frequent changes are to be written (within a second).
    dirty: Mutex<HashSet<String>>,
    /// Whose waiting requests this handle reports: one process is one instance, but tests
    /// open several handles on one store to play several instances.
    instance: String,
    /// Keys the hash of credentials taken as keys ([`Store::key_secret`]); kept in the state
    /// file, so that a key's budget keeps its name over a restart.
    key_secret: Arc<[u8; 32]>,
}

impl MemoryStore {
    /// A store with no state file (tests, benchmarks).
    pub fn ephemeral() -> Self {
        Self {
            epoch: Instant::now(),
            wall: Wall::System,
            budgets: Arc::default(),
            state_file: None,
            writer: tokio::sync::Mutex::new(()),
            journal: Arc::default(),
            dirty: Mutex::default(),
            instance: Instance::new().id,
            key_secret: Arc::new(rand::random()),
        }
    }

    /// Names lockouts and wait lists after `instance`: this instance's id (by default an id
    /// of the store's own).
    pub fn with_instance(mut self, instance: &str) -> Self {
        self.instance = instance.to_owned();
        self
    }

    /// Another handle on the same budgets, reporting the waiting requests of `instance` (for
    /// tests that play several instances on one store; it writes no state file).
    pub fn instance(&self, instance: &str) -> Self {
        Self {
            epoch: self.epoch,
            wall: self.wall,
            budgets: self.budgets.clone(),
            state_file: None,
            writer: tokio::sync::Mutex::new(()),
            journal: Arc::default(),
            dirty: Mutex::default(),
            instance: instance.to_owned(),
            key_secret: self.key_secret.clone(),
        }
    }

    /// Now on the store's timeline.
    fn now(&self) -> Duration {
        self.offset(Instant::now())
    }

    /// Now on the wall clock.
    fn wall_now(&self) -> SystemTime {
        match self.wall {
            Wall::System => SystemTime::now(),
            #[cfg(test)]
            Wall::Follows { at_epoch } => at_epoch + (Instant::now() - self.epoch),
        }
    }

    /// An instant on the store's timeline.
    fn offset(&self, at: Instant) -> Duration {
        if at >= self.epoch {
            ORIGIN + (at - self.epoch)
        } else {
            ORIGIN.saturating_sub(self.epoch - at)
        }
    }

    /// A time on the store's timeline as an instant (never before the epoch: only slots, which
    /// are never in the past, are converted).
    fn instant(&self, t: Duration) -> Instant {
        self.epoch + t.saturating_sub(ORIGIN)
    }

    /// One class's waiting requests on the store's timeline.
    fn waiting_of(&self, q: &ClassQueue) -> Waiting {
        Waiting {
            class: q.class,
            count: q.count,
            since: self.offset(q.oldest),
            next_since: q.next.map(|n| self.offset(n)),
        }
    }

    /// A Unix time as a time on the store's timeline, past (a quota window's send) or future
    /// (a pause, a vendor's reset).
    fn at_unix(&self, secs: f64) -> Duration {
        let wall =
            SystemTime::UNIX_EPOCH + Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or_default();
        match self.wall_now().duration_since(wall) {
            Ok(ago) => self.now().saturating_sub(ago),
            Err(ahead) => self.now() + ahead.duration(),
        }
    }

    fn unix_of(&self, t: Duration) -> f64 {
        let now = self.now();
        let wall = if t <= now {
            self.wall_now() - (now - t)
        } else {
            self.wall_now() + (t - now)
        };
        wall.duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    }

    fn view_of(&self, budget: &Budget, now: Duration) -> BudgetView {
        let paused_for = budget.paused_until.saturating_sub(now);
        BudgetView {
            backoff: budget.backoff,
            generation: budget.generation,
            clean_streak: budget.clean_streak,
            paused_for,
            paused_by: budget.paused_by.filter(|_| !paused_for.is_zero()),
            lock: budget.lock.as_deref().cloned(),
            block_streak: budget.block_streak,
            vendor: budget.vendor_at(now).map(|v| VendorView {
                family: v.family,
                remaining: v.remaining.saturating_sub(v.taken),
                limit: v.limit,
                reset_in: v.reset - now,
            }),
        }
    }

    /// Every instance's waiting requests of `destination` by class.
    fn waiting_now(&self, destination: &str) -> Vec<ClassWaiting> {
        let now = self.now();
        self.budgets
            .lock()
            .get(destination)
            .map_or_else(Vec::new, |b| b.waiting_at(now))
    }

    /// The slots taken in each of `rule`'s quota windows that ends now.
    fn quota_used_now(&self, destination: &str, rule: &Rule) -> Vec<u32> {
        let now = self.now();
        let budgets = self.budgets.lock();
        rule.quota
            .iter()
            .map(|q| {
                budgets.get(destination).map_or(0, |b| {
                    u32::try_from(b.sent_within(q.per, now))
                        .unwrap_or(u32::MAX)
                        .min(q.limit)
                })
            })
            .collect()
    }
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn reserve(
        &self,
        destination: &str,
        rule: &Rule,
        ask: Ask<'_>,
    ) -> Result<Grant, ReserveError> {
        let rule = &*rule.weighted(ask.cost);
        let result = {
            let now = self.now();
            let limit = ask.not_after.map(|t| self.offset(t));
            // A request waiting alone, the common case, needs no allocation.
            let (one, many): ([Waiting; 1], Vec<Waiting>);
            let list: &[Waiting] = match ask.queues {
                [q] => {
                    one = [self.waiting_of(q)];
                    &one
                }
                queues => {
                    many = queues.iter().map(|q| self.waiting_of(q)).collect();
                    &many
                }
            };
            let mut budgets = self.budgets.lock();
            if let Some(lock) = parent_lock(&budgets, destination) {
                return Err(ReserveError::Locked(lock));
            }
            let budget = budgets.entry(destination.to_owned()).or_default();
            match budget.reserve_for(rule, now, &self.instance, list, limit, ask.most) {
                Ok(granted) => {
                    if rule.counts_sends() {
                        self.mark(destination);
                    }
                    Ok(Grant {
                        slot: Reservation {
                            at: self.instant(granted.slot),
                            generation: granted.generation,
                            unseen_late: Duration::ZERO,
                        },
                        class: granted.class,
                        more: granted.more.iter().map(|t| self.instant(*t)).collect(),
                        // A slot's instant names its send exactly here.
                        sent: Vec::new(),
                    })
                }
                Err(NoSlot::Locked(lock)) => Err(ReserveError::Locked(lock)),
                Err(NoSlot::TooLate { slot }) => Err(ReserveError::TooLate {
                    slot: self.instant(slot),
                }),
                Err(NoSlot::Yield) => {
                    let free_in = budget.free_at(rule, now).saturating_sub(now);
                    Err(ReserveError::Yield(rule.yield_for(budget.backoff, free_in)))
                }
            }
        };
        result
    }

    fn take_now(&self, destination: &str, rule: &Rule, now: Instant) -> Option<Reservation> {
        let now = self.offset(now);
        let mut budgets = self.budgets.lock();
        if parent_lock(&budgets, destination).is_some() {
            return None;
        }
        let budget = budgets.get_mut(destination)?;
        if !budget.waiting.is_empty() || budget.credits.iter().any(|c| *c != 0.0) {
            return None;
        }
        // A slot a moment ahead (two requests within one interval of a fast budget) is taken
        // too: the request waits the moment out itself (see `pacing::admit`), where the
        // dispatcher would wait at least a tick of the timer, and hold up every request that
        // queues behind it meanwhile.
        let (slot, generation) = budget
            .reserve(rule, now, Some(now + rule.interval.min(NEAR)))
            .ok()?;
        if rule.counts_sends() {
            self.mark(destination);
        }
        Some(Reservation {
            at: self.instant(slot),
            generation,
            unseen_late: Duration::ZERO,
        })
    }

    async fn wait_list(&self, destination: &str, queues: &[ClassQueue]) -> Result<(), StoreError> {
        let list: Vec<Waiting> = queues.iter().map(|q| self.waiting_of(q)).collect();
        let mut budgets = self.budgets.lock();
        match budgets.get_mut(destination) {
            Some(budget) => budget.tell(&self.instance, &list),
            // An empty list for a destination never seen creates no budget.
            None if list.is_empty() => {}
            None => budgets
                .entry(destination.to_owned())
                .or_default()
                .tell(&self.instance, &list),
        }
        Ok(())
    }

    async fn record(
        &self,
        destination: &str,
        rule: &Rule,
        event: Event,
        vendor: Option<Observation>,
    ) -> Result<BudgetView, StoreError> {
        let (kept, view) = {
            let (now, wall) = (self.now(), self.wall_now());
            let mut budgets = self.budgets.lock();
            let budget = budgets.entry(destination.to_owned()).or_default();
            let before = self.state_file.is_some().then(|| budget.clone());
            let seen = vendor.is_some_and(|v| budget.observe(rule, &v, now, wall));
            let changed = budget.apply(rule, &event, now, wall);
            let kept = match before {
                Some(before) if changed || seen => self.kept_change(&before, budget),
                _ => Durability::None,
            };
            (kept, self.view_of(budget, now))
        };
        match kept {
            // A lockout, a pause, a block, the backoff: kept before the response goes.
            Durability::Now => self.write_now(&[destination]).await?,
            // The vendor's count and the like: within a second, off the response's way.
            Durability::Soon => self.mark(destination),
            Durability::None => {}
        }
        Ok(view)
    }

    async fn settle(&self, budget: &str, rule: &Rule, units: i64) -> Result<(), StoreError> {
        let now = self.now();
        if let Some(b) = self.budgets.lock().get_mut(budget) {
            b.settle(rule, units, now);
            if units > 0 && rule.counts_sends() {
                self.mark(budget);
            }
        }
        Ok(())
    }

    async fn give_back(
        &self,
        budget: &str,
        rule: &Rule,
        slot: &Reservation,
        _sent: Option<u64>,
        reserved: u32,
        units: u32,
    ) -> Result<(), StoreError> {
        let now = self.now();
        if let Some(b) = self.budgets.lock().get_mut(budget) {
            if rule.counts_sends() {
                b.unsend(self.offset(slot.at), u64::from(reserved), u64::from(units));
                self.mark(budget);
            }
            b.give_back(rule, u64::from(units), u64::from(reserved), now);
        }
        Ok(())
    }

    async fn continue_after(&self, marks: &[(String, Instant)]) -> Result<(), StoreError> {
        let mut budgets = self.budgets.lock();
        for (budget, at) in marks {
            let b = budgets.entry(budget.clone()).or_default();
            b.next_at = b.next_at.max(self.offset(*at));
        }
        Ok(())
    }

    async fn unlock(&self, destination: &str) -> Result<Option<Lockout>, StoreError> {
        let cleared = self
            .budgets
            .lock()
            .get_mut(destination)
            .and_then(|b| b.lock.take())
            .map(|l| *l);
        if cleared.is_some() {
            self.write_now(&[destination]).await?;
        }
        Ok(cleared)
    }

    async fn view(&self, destination: &str) -> Result<BudgetView, StoreError> {
        let now = self.now();
        let view = self
            .budgets
            .lock()
            .get(destination)
            .map(|b| self.view_of(b, now))
            .unwrap_or_else(|| self.view_of(&Budget::default(), now));
        Ok(view)
    }

    async fn key_secret(&self) -> Result<Vec<u8>, StoreError> {
        Ok(self.key_secret.to_vec())
    }

    async fn forget_keys(&self, parent: &str, idle: Duration) -> Result<u64, StoreError> {
        let now = self.now();
        let mut budgets = self.budgets.lock();
        let mut forgotten = Vec::new();
        budgets.retain(|name, b| {
            let keep = halted_by(name) != Some(parent) || !b.idle_for(now, idle);
            if !keep {
                forgotten.push(name.clone());
            }
            keep
        });
        drop(budgets);
        let gone = forgotten.len() as u64;
        // Written as gone within a second, so that a restart does not bring them back.
        for name in &forgotten {
            self.mark(name);
        }
        Ok(gone)
    }

    async fn snapshot(&self, destinations: &[(&str, &Rule)]) -> Result<Vec<Snapshot>, StoreError> {
        let mut out = Vec::with_capacity(destinations.len());
        for (destination, rule) in destinations {
            out.push(Snapshot {
                view: self.view(destination).await?,
                waiting: self.waiting_now(destination),
                quota_used: self.quota_used_now(destination, rule),
            });
        }
        Ok(out)
    }
}

/// The lockout of the budget that halts `destination` too, a key's parent (see
/// [`halted_by`]), if it is locked.
fn parent_lock(budgets: &Budgets, destination: &str) -> Option<Lockout> {
    budgets
        .get(halted_by(destination)?)?
        .lock
        .as_deref()
        .cloned()
}

/// The store a failover paces on while the shared one is lost.
impl Fallback for MemoryStore {
    /// Sets a budget's backoff, generation, streak and lock from a view of another store, so
    /// that pacing taken over from it starts where it was (a lockout above all). `next_at`,
    /// when given, is the earliest the next slot may be: taking over continues the schedule
    /// instead of starting a burst.
    fn seed(&self, destination: &str, view: &BudgetView, next_at: Option<Instant>) {
        let mut budgets = self.budgets.lock();
        let b = budgets.entry(destination.to_owned()).or_default();
        b.backoff = view.backoff.max(1.0);
        b.generation = view.generation;
        b.clean_streak = view.clean_streak;
        b.block_streak = view.block_streak;
        b.lock = view.lock.clone().map(Box::new);
        let until = self.now() + view.paused_for;
        if until > b.paused_until {
            b.paused_until = until;
            b.paused_by = view.paused_by;
        }
        if let Some(at) = next_at {
            b.next_at = b.next_at.max(self.offset(at));
        }
    }

    /// Fills `destination`'s quota windows as of now: `units` sent at this instant. A store
    /// taking over from a lost shared one cannot know how full the shared windows are, so it
    /// assumes them full.
    fn fill_windows(&self, destination: &str, units: u32) {
        let now = self.now();
        let mut budgets = self.budgets.lock();
        let b = budgets.entry(destination.to_owned()).or_default();
        b.sends = VecDeque::from([Sent {
            at: now,
            through: u64::from(units),
        }]);
    }
}

#[cfg(test)]
mod tests;
