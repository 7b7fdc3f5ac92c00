//! A destination's lane: its rule, the queue of requests waiting for a slot ([`queue`]: one
//! FIFO per class, and the hand-out of a slot to a waiter), and what was last seen of its
//! budget.

mod queue;

pub(super) use queue::{Grant, Queue, Waiter};

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tokio::sync::{oneshot, watch, Notify, Semaphore};
use tokio::time::Instant;

use super::rate::Sends;
use super::walls::Challenges;
use super::PaceError;
use crate::budget::{
    BudgetView, ClassWaiting, Lockout, Reservation, Rule, Store, GROUP_MARK, KEY_MARK, METER_MARK,
};
use crate::class::{Class, Classes};
use crate::destination::{Destination, Group, Meter, Pace};
use crate::meter::Recall;
use crate::metrics::{BudgetSeries, Metrics};

/// One budget's lane: a destination's own, one of its groups', or one of their keys'.
pub(crate) struct Lane {
    /// The budget's name: the destination's, `DESTINATION/GROUP` for a group's, and
    /// `PARENT#KEY` for a key's.
    pub(super) name: Arc<str>,
    /// A key's lane: the lane of the budget split by key, whose lockout halts it.
    pub(super) parent: Option<Arc<Lane>>,
    /// A key's lane: the client that made it (`max_keys_per_client`), by proxy user or address.
    maker: Option<Arc<str>>,
    /// What only a budget's own lane holds; none for a key's, whose every byte counts a
    /// hundred thousand times.
    whole: Option<Box<Whole>>,
    /// When a request last took this lane, in milliseconds from [`epoch`] (a key's lane is
    /// forgotten after `key_idle`).
    last_used: AtomicU64,
    /// What status counts: a key's lane counts into its parent's.
    pub(super) tally: Arc<Tally>,
    /// The destination's keys: swapped whole by a reload, read whole by each use.
    keys: ArcSwap<Keys>,
    pub(super) classes: Arc<Classes>,
    pub(super) queue: Mutex<Queue>,
    /// Wakes the dispatcher: a request arrived or left.
    pub(super) work: Notify,
    /// Whether a dispatcher runs for the lane. A budget's runs from the start; a key's only
    /// while someone waits (its task would cost an idle key more than the rest of it): it
    /// ends when its queue is empty, and the next request to queue starts another.
    pub(super) dispatching: AtomicBool,
    /// Removed from the config by a reload: its dispatcher serves who still waits, then ends.
    retired: AtomicBool,
    /// The lockout as last seen; the dispatcher watches it to refuse its waiters at once.
    /// A key's lane shares its parent's: a lockout is the whole budget's, and one channel
    /// (with its wakers) per key would cost an idle key more than the rest of it.
    pub(super) locked: Arc<watch::Sender<Option<Lockout>>>,
    /// The budget as last seen, for status and metrics between store reads.
    pub(super) seen: Mutex<BudgetView>,
    /// Bumped whenever the budget seen turns stricter (a widening, a pause): the rest of a
    /// batch reserved before it is not used.
    pub(super) turns: AtomicU64,
}

/// What a budget's own lane holds beside what every lane does.
struct Whole {
    /// The destination's name: what a lockout halts and an operator unlocks.
    destination: Arc<str>,
    /// A budget split by key: its keys' lanes, by key, made on first use (`pacing::keys`).
    children: Mutex<HashSet<ByKey>>,
    /// How many of its keys each client made (`max_keys_per_client`). Taken after
    /// `children`, never before.
    makers: Mutex<HashMap<Arc<str>, usize>>,
    /// The keys its keys' lanes share (see [`Lane::key_keys`]).
    key_keys: Mutex<Option<Arc<Keys>>>,
    /// What only the store knows, as its last snapshot said (see `pacing::status`).
    store_said: Mutex<StoreSaid>,
    /// When its lockout was last read for a dispatcher's poll, in milliseconds from
    /// [`epoch`]: its keys share one poll (see [`Lane::poll_lock`]).
    lock_polled: AtomicU64,
    /// Its series in every family a request counts into, found on first use.
    series: OnceLock<Arc<BudgetSeries>>,
    /// A meter's lane: the meter's unit (`tokens`, `points`), in which its slots are
    /// weighted by what each request costs. `None`: a request budget's, one slot a request.
    unit: Option<Arc<str>>,
    /// A meter's lane: what each query cost when last settled, its next estimate, where
    /// the meter's cost is its query's (GraphQL).
    recall: Option<Recall>,
    /// Its bot walls' challenges, counted against its responses.
    challenges: Challenges,
}

/// A key's lane in its parent's set, found by its key: the key is read from the lane's name,
/// not kept a second time.
pub(super) struct ByKey(pub(super) Arc<Lane>);

impl ByKey {
    fn key(&self) -> &str {
        self.0.key_name().unwrap_or_default()
    }
}

impl std::borrow::Borrow<str> for ByKey {
    fn borrow(&self) -> &str {
        self.key()
    }
}

impl std::hash::Hash for ByKey {
    /// As the key's `str` hashes, so that the set is searched by `&str`.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

impl PartialEq for ByKey {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for ByKey {}

/// The instant lanes date their last use from.
fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Now, in milliseconds from [`epoch`].
pub(super) fn now_ms() -> u64 {
    u64::try_from(
        Instant::now()
            .saturating_duration_since(epoch())
            .as_millis(),
    )
    .unwrap_or(u64::MAX)
}

/// What status counts of a budget. A key's lane counts into its parent's, so that a budget
/// split by key shows as one, whatever its number of keys.
pub(super) struct Tally {
    /// Requests between admission and the end of their exchange.
    pub(super) in_flight: AtomicUsize,
    /// Requests in `admit`: waiting for a concurrency permit or a slot.
    pub(super) admitting: AtomicUsize,
    /// Requests sent upstream whose response head has not come yet (see [`Unanswered`]).
    pub(super) unanswered: AtomicUsize,
    /// Slots used, all and by class.
    pub(super) sends: Mutex<Sends>,
}

impl Tally {
    fn new(classes: &Classes) -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            admitting: AtomicUsize::new(0),
            unanswered: AtomicUsize::new(0),
            sends: Mutex::new(Sends::new(classes.all().count())),
        }
    }

    /// Counts a request sent upstream until its response head comes (or its send fails):
    /// what a vendor says in answer to another may not count it yet.
    pub(super) fn unanswered(&self) -> Unanswered<'_> {
        self.unanswered.fetch_add(1, Ordering::Relaxed);
        Unanswered(self)
    }
}

/// A request counted in [`Tally::unanswered`], until dropped.
pub(super) struct Unanswered<'a>(&'a Tally);

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        self.0.unanswered.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What only the store knows of a destination, for status and metrics.
#[derive(Debug, Clone, Default)]
pub(super) struct StoreSaid {
    /// Every live instance's waiting requests by class; `None` when the store could not say.
    pub(super) waiting: Option<Vec<ClassWaiting>>,
    /// Slots taken in each quota window, over every instance.
    pub(super) quota_used: Vec<u32>,
}

/// A destination's keys as the lane uses them.
pub(crate) struct Keys {
    pub(crate) pace: Pace,
    pub(super) rule: Rule,
    /// `max_concurrency` permits; none when unbounded.
    pub(super) concurrency: Option<Arc<Semaphore>>,
}

impl Keys {
    /// The keys of a lane by `pace`; `of_key` for a key's lane. The lane of a budget split
    /// by key paces the keys' total: at `total_rate`, where one is set.
    fn new(
        pace: &Pace,
        classes: &Classes,
        before: Option<&Keys>,
        of_key: bool,
        metered: bool,
    ) -> Self {
        // The same semaphore while the bound is the same, so that the permits held count.
        let concurrency = match before {
            Some(k) if k.pace.max_concurrency == pace.max_concurrency => k.concurrency.clone(),
            _ => (pace.max_concurrency > 0).then(|| Arc::new(Semaphore::new(pace.max_concurrency))),
        };
        Self {
            rule: Rule {
                metered,
                ..rule_of(pace, classes, of_key)
            },
            pace: pace.clone(),
            concurrency,
        }
    }
}

impl Lane {
    /// The lane of `d`'s own budget.
    pub(super) fn new(d: &Destination, classes: Arc<Classes>) -> Self {
        Self::of(&d.name, &d.name, &d.pace, classes, false)
    }

    /// The lane of `d`'s group `g`.
    pub(super) fn group(d: &Destination, g: &Group, classes: Arc<Classes>) -> Self {
        Self::of(
            &format!("{}{GROUP_MARK}{}", d.name, g.name),
            &d.name,
            &g.pace,
            classes,
            false,
        )
    }

    /// The lane of meter `m` of `d`, or of its group `g`: named `DESTINATION~UNIT`, or
    /// `DESTINATION/GROUP~UNIT` (see [`crate::budget::METER_MARK`]), its slots weighted by
    /// what each request costs.
    pub(super) fn meter(
        d: &Destination,
        g: Option<&Group>,
        m: &Meter,
        classes: Arc<Classes>,
    ) -> Self {
        let budget = match g {
            Some(g) => format!("{}{GROUP_MARK}{}", d.name, g.name),
            None => d.name.clone(),
        };
        let mut lane = Self::of(
            &format!("{budget}{METER_MARK}{}", m.name),
            &d.name,
            &m.pace,
            classes,
            true,
        );
        if let Some(whole) = &mut lane.whole {
            whole.unit = Some(Arc::from(m.name.as_str()));
            // Every meter's, used where its cost is its query's: a reload may make it so.
            whole.recall = Some(Recall::default());
        }
        lane
    }

    /// A meter's lane: the costs its queries were settled at, where its cost is its
    /// query's. A key's lane shares its parent's.
    pub(super) fn recall(&self) -> Option<&Recall> {
        self.parent
            .as_deref()
            .unwrap_or(self)
            .whole
            .as_ref()
            .and_then(|w| w.recall.as_ref())
    }

    /// A meter's lane: its unit (see [`Lane::meter`]).
    pub(super) fn unit(&self) -> Option<&Arc<str>> {
        self.parent
            .as_deref()
            .unwrap_or(self)
            .whole
            .as_ref()
            .and_then(|w| w.unit.as_ref())
    }

    fn of(
        name: &str,
        destination: &str,
        pace: &Pace,
        classes: Arc<Classes>,
        metered: bool,
    ) -> Self {
        Self {
            name: Arc::from(name),
            parent: None,
            maker: None,
            whole: Some(Box::new(Whole {
                destination: Arc::from(destination),
                children: Mutex::default(),
                makers: Mutex::default(),
                key_keys: Mutex::default(),
                store_said: Mutex::default(),
                lock_polled: AtomicU64::new(0),
                series: OnceLock::new(),
                unit: None,
                recall: None,
                challenges: Challenges::default(),
            })),
            last_used: AtomicU64::new(now_ms()),
            tally: Arc::new(Tally::new(&classes)),
            keys: ArcSwap::from_pointee(Keys::new(pace, &classes, None, false, metered)),
            retired: AtomicBool::new(false),
            queue: Mutex::new(Queue::new(classes.len())),
            classes,
            work: Notify::new(),
            dispatching: AtomicBool::new(true),
            locked: Arc::new(watch::channel(None).0),
            seen: Mutex::new(BudgetView::default()),
            turns: AtomicU64::new(0),
        }
    }

    /// The lane of `parent`'s key `key` (see [`crate::budget::KEY_MARK`]): its rule, its
    /// counts and its lockout are the parent's; its schedule, backoff, pauses and quota
    /// windows its own. It starts halted if the parent is.
    pub(super) fn key(parent: &Arc<Lane>, key: &str, maker: Option<Arc<str>>) -> Self {
        let classes = parent.classes.clone();
        Self {
            name: Arc::from(format!("{}{KEY_MARK}{key}", parent.name)),
            parent: Some(parent.clone()),
            maker,
            whole: None,
            last_used: AtomicU64::new(now_ms()),
            tally: parent.tally.clone(),
            keys: ArcSwap::new(parent.key_keys()),
            retired: AtomicBool::new(false),
            queue: Mutex::new(Queue::new(classes.len())),
            classes,
            work: Notify::new(),
            dispatching: AtomicBool::new(false),
            locked: parent.locked.clone(),
            seen: Mutex::new(BudgetView::default()),
            turns: AtomicU64::new(0),
        }
    }

    /// The lanes of this budget's keys, as they are now.
    pub(super) fn key_lanes(&self) -> Vec<Arc<Lane>> {
        self.children()
            .map_or_else(Vec::new, |c| c.lock().iter().map(|k| k.0.clone()).collect())
    }

    /// The destination's name: what a lockout halts and an operator unlocks.
    pub(super) fn destination(&self) -> &str {
        match (&self.parent, &self.whole) {
            (Some(parent), _) => parent.destination(),
            (None, Some(whole)) => &whole.destination,
            (None, None) => &self.name,
        }
    }

    /// The budget's name as metrics and status know it: a key's lane counts as its parent,
    /// so that keys add no label values.
    pub(super) fn label(&self) -> &Arc<str> {
        self.parent.as_ref().map_or(&self.name, |p| &p.name)
    }

    /// The budget's series in `metrics`, found once: a key counts into its parent's. Lent,
    /// not cloned: a reference count written by every request would be one more cache line
    /// that requests on other cores take turns with.
    pub(super) fn series(&self, metrics: &Metrics) -> &Arc<BudgetSeries> {
        let own = self.parent.as_deref().unwrap_or(self);
        own.whole
            .as_ref()
            // A lane is a budget's own (with its whole) or a key's (whose parent is one).
            .expect("a budget's own lane")
            .series
            .get_or_init(|| Arc::new(BudgetSeries::new(metrics, &own.name)))
    }

    /// A budget's own lane: its keys' lanes, by key (none for a key's lane).
    pub(super) fn children(&self) -> Option<&Mutex<HashSet<ByKey>>> {
        self.whole.as_ref().map(|w| &w.children)
    }

    /// A budget's own lane: how many of its keys each client made.
    pub(super) fn makers(&self) -> Option<&Mutex<HashMap<Arc<str>, usize>>> {
        self.whole.as_ref().map(|w| &w.makers)
    }

    /// A key's lane: who made it.
    pub(super) fn maker(&self) -> Option<&Arc<str>> {
        self.maker.as_ref()
    }

    /// What only the store knows of the budget, as its last snapshot said. Status reads
    /// budgets' own lanes only, never a key's.
    pub(super) fn store_said(&self) -> &Mutex<StoreSaid> {
        &self
            .whole
            .as_ref()
            .expect("status reads no key's lane")
            .store_said
    }

    /// Counts a request taking the lane now.
    pub(super) fn touch(&self) {
        self.last_used.store(now_ms(), Ordering::Relaxed);
    }

    /// How long since a request last took the lane.
    pub(super) fn unused_for(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.last_used.load(Ordering::Relaxed)))
    }

    /// The budget a lockout seen on this lane is kept on: a key's parent, else its own.
    pub(super) fn lock_holder(&self) -> &Lane {
        self.parent.as_deref().unwrap_or(self)
    }

    /// Its bot walls' challenges: a key's lane counts into its parent's.
    pub(super) fn challenges(&self) -> Option<&Challenges> {
        self.lock_holder().whole.as_deref().map(|w| &w.challenges)
    }

    /// [`Lane::lock_holder`], as a handle.
    pub(super) fn lock_holder_arc(self: &Arc<Self>) -> Arc<Lane> {
        self.parent.clone().unwrap_or_else(|| self.clone())
    }

    /// A key's lane whose parent paces the keys' total (`total_rate`): that parent, in which
    /// each request takes a slot too.
    pub(super) fn total(&self) -> Option<&Arc<Lane>> {
        self.parent
            .as_ref()
            .filter(|p| p.keys_now().pace.total_rate.is_some())
    }

    /// A key's lane: its key.
    pub(super) fn key_name(&self) -> Option<&str> {
        self.parent.as_ref()?;
        self.name.split_once(KEY_MARK).map(|(_, key)| key)
    }

    /// The keys now in force.
    pub(crate) fn keys(&self) -> Arc<Keys> {
        self.keys.load_full()
    }

    /// The keys as they are now, for a look that ends before the next await: no reference
    /// count is written, so requests on other cores do not take turns with its cache line.
    pub(crate) fn keys_now(&self) -> arc_swap::Guard<Arc<Keys>> {
        self.keys.load()
    }

    /// Whether the budget is split by key now. Asked of every request: it reads the keys
    /// without taking a reference to them.
    pub(super) fn is_split(&self) -> bool {
        self.keys.load().pace.key.is_some()
    }

    /// How late a request sent now on `slot` would be, where that is later than the rule
    /// allows ([`crate::budget::Rule::max_late`]): a slot is an instant, not a licence, and
    /// used that late it would bunch with the next ones and could crowd a quota window.
    pub(super) fn too_late(&self, slot: &Reservation) -> Option<Duration> {
        let late = slot.lateness(Instant::now());
        (late > self.keys.load().rule.max_late()).then_some(late)
    }

    /// Sets a meter lane's `burst` (see `pacing::meters`, where the meters that do not bind
    /// lend a request an early slot), unless it is that already. Made on the keys as they
    /// are when it lands, so that a reload meanwhile is not undone; a reload sets it back to
    /// the config's, until the next request lends it again.
    pub(super) fn lend_burst(&self, burst: u32) {
        if self.keys().pace.burst == burst {
            return;
        }
        self.keys.rcu(|k| Keys {
            pace: Pace {
                burst,
                ..k.pace.clone()
            },
            rule: Rule {
                burst,
                ..k.rule.clone()
            },
            concurrency: k.concurrency.clone(),
        });
        self.work.notify_one();
    }

    /// Raises a meter lane's [`Rule::largest`] to `estimate`, where that is larger: its own
    /// window holds one request's worth over its limit (see [`Rule::windows`]). Made on the
    /// keys as they are, as [`Lane::lend_burst`] is; a reload starts it again.
    pub(super) fn raise_largest(&self, estimate: u32) {
        if self.keys().rule.largest >= estimate {
            return;
        }
        self.keys.rcu(|k| Keys {
            pace: k.pace.clone(),
            rule: Rule {
                largest: k.rule.largest.max(estimate),
                ..k.rule.clone()
            },
            concurrency: k.concurrency.clone(),
        });
    }

    /// Takes a destination's new keys (a reload): the next slot is reserved by them; the
    /// budget, the queue and the requests in flight are kept. A changed `max_concurrency`
    /// takes a fresh semaphore: requests in flight keep the permits of the old one.
    pub(super) fn reconfigure(&self, pace: &Pace) {
        let before = self.keys();
        self.keys.store(Arc::new(Keys::new(
            pace,
            &self.classes,
            Some(&before),
            self.parent.is_some(),
            before.rule.metered,
        )));
        // A dispatcher sleeping on the old interval re-reads the rule.
        self.work.notify_one();
        let key_keys = self.key_keys();
        for key in self.key_lanes() {
            key.keys.store(key_keys.clone());
            key.work.notify_one();
        }
    }

    /// The keys every key's lane of this budget uses, one copy for them all (its
    /// `max_concurrency` bounds them together).
    pub(super) fn key_keys(&self) -> Arc<Keys> {
        let Some(whole) = &self.whole else {
            return self.keys();
        };
        let mut made = whole.key_keys.lock();
        let pace = &self.keys.load().pace;
        match &*made {
            Some(k) if k.pace == *pace => k.clone(),
            _ => {
                let metered = self.keys.load().rule.metered;
                let k = Arc::new(Keys::new(
                    pace,
                    &self.classes,
                    made.as_deref(),
                    true,
                    metered,
                ));
                *made = Some(k.clone());
                k
            }
        }
    }

    /// Takes the lane out of service (a reload removed its destination): no new request is
    /// routed to it, and its dispatcher ends once nobody waits.
    pub(super) fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
        self.work.notify_one();
        // The keys go with their budget; taking them out of the map breaks their link back.
        if let Some(children) = self.children() {
            for key in std::mem::take(&mut *children.lock()) {
                key.0.retire();
            }
        }
        if let Some(makers) = self.makers() {
            makers.lock().clear();
        }
    }

    pub(super) fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    pub(super) fn locked_error(&self, lock: Lockout) -> PaceError {
        PaceError::Locked {
            destination: self.destination().to_owned(),
            lock,
        }
    }

    pub(super) fn deadline_error(&self, class: Class, retry_after: Duration) -> PaceError {
        PaceError::Deadline {
            destination: self.name.to_string(),
            class: self.classes.name(class).to_owned(),
            max_wait: self.max_wait(class),
            retry_after,
        }
    }

    /// How long a request of `class` may wait for a slot.
    pub(super) fn max_wait(&self, class: Class) -> Duration {
        self.max_wait_by(class, &self.keys.load())
    }

    /// [`Lane::max_wait`] by `keys`, this lane's as a request found them.
    pub(super) fn max_wait_by(&self, class: Class, keys: &Keys) -> Duration {
        self.classes.max_wait(class).unwrap_or(keys.pace.max_wait)
    }

    /// The interval between slots at the backoff last seen.
    pub(super) fn interval(&self) -> Duration {
        self.keys
            .load()
            .rule
            .interval
            .mul_f64(self.seen.lock().backoff)
    }

    /// A guess at when a slot will be free for a new request: the queue ahead of it at the
    /// current interval.
    pub(super) fn estimated_wait(&self) -> Duration {
        let ahead = self.queue.lock().len() as u32 + 1;
        let seen = self.seen.lock();
        let interval = self.keys.load().rule.interval;
        (interval.mul_f64(seen.backoff) * ahead).max(seen.paused_for)
    }

    /// Whether the budget last seen is at rest for a slot reserved under `generation`: no
    /// backoff, no block streak, and no widening seen since the slot was reserved or between
    /// its reservation and the view.
    pub(super) fn at_rest(&self, generation: u64) -> bool {
        let seen = self.seen.lock();
        seen.backoff <= 1.0 && seen.block_streak == 0 && seen.generation == generation
    }

    /// Takes in a budget read from the store; a lockout taken or cleared wakes the dispatcher.
    /// A widening or a pause seen here counts as a turn (see [`Lane::turns`]).
    pub(super) fn note(&self, view: BudgetView) {
        // A key's budget holds no lockout: its parent's, whose channel it shares, halts it.
        let lock_now = self.parent.is_none().then(|| view.lock.clone());
        {
            let mut seen = self.seen.lock();
            let paused = |v: &BudgetView| !v.paused_for.is_zero();
            if view.generation != seen.generation || (paused(&view) && !paused(&seen)) {
                self.turns.fetch_add(1, Ordering::Relaxed);
            }
            *seen = view;
        }
        if let Some(lock) = lock_now {
            self.locked.send_if_modified(|current| {
                let changed = *current != lock;
                *current = lock;
                changed
            });
        }
    }

    /// What a dispatcher waiting for a distant slot does every `every`: reads the lockout
    /// that halts the lane ([`Lane::read_lock`]). A key's lane shares its lockout channel
    /// with its parent's and every other key's, so one read every `every` serves them all: a
    /// thousand keys waiting make two reads a second, not two thousand.
    pub(super) async fn poll_lock(&self, store: &dyn Store, every: Duration) {
        if let Some(whole) = self.lock_holder().whole.as_ref() {
            let now = now_ms();
            let last = whole.lock_polled.load(Ordering::Relaxed);
            // A little short of `every`: a lane's own poll, due after `every` by its timer,
            // is never skipped for its last read.
            let every = u64::try_from(every.mul_f64(0.9).as_millis()).unwrap_or(u64::MAX);
            if now.saturating_sub(last) < every
                || whole
                    .lock_polled
                    .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                    .is_err()
            {
                return;
            }
        }
        self.read_lock(store).await;
    }

    /// Reads the lockout that halts this lane from `store`: its own budget's, or for a key's
    /// lane its parent's.
    pub(super) async fn read_lock(&self, store: &dyn Store) {
        let holder = self.lock_holder();
        if let Ok(view) = store.view(&holder.name).await {
            holder.note(view);
        }
    }

    /// Takes in a lockout met while reserving: the budget's that holds it, and with it every
    /// lane that shares its channel.
    pub(super) fn note_lock(&self, lock: Lockout) {
        let holder = self.lock_holder();
        let seen = holder.seen.lock().clone();
        holder.note(BudgetView {
            lock: Some(lock),
            ..seen
        });
    }

    pub(super) fn refuse_all(&self, error: &PaceError) {
        let waiters: Vec<Waiter> = self.queue.lock().drain();
        for w in waiters {
            w.refuse(error.clone());
        }
    }

    /// Queues a request of `class` that started waiting at `since`; it leaves the queue when
    /// the returned seat is dropped.
    pub(super) fn enqueue(
        &self,
        class: Class,
        since: Instant,
        deadline: Instant,
        cost: u32,
    ) -> (QueueSeat<'_>, oneshot::Receiver<Result<Grant, PaceError>>) {
        let (tx, rx) = oneshot::channel();
        let id = self.queue.lock().join(class, since, deadline, cost, tx);
        self.work.notify_one();
        (QueueSeat { lane: self, id }, rx)
    }

    /// Hands `slot` to the waiter it is for (see [`Queue::hand_out`]).
    pub(super) fn hand_out(
        &self,
        class: Class,
        slot: (Reservation, Option<u64>),
        cost: u32,
    ) -> bool {
        self.queue.lock().hand_out(class, slot, cost, |class| {
            self.deadline_error(class, self.keys.load().rule.interval)
        })
    }

    /// Waiting here per class and the oldest wait, for status: `(count, oldest wait)` by rank.
    pub(super) fn waiting_here(&self, now: Instant) -> Vec<(usize, Duration)> {
        let q = self.queue.lock();
        self.classes
            .all()
            .map(|class| q.waiting(class, now))
            .collect()
    }

    /// Counts a request as admitting until the returned guard is dropped.
    pub(super) fn admitting(&self) -> Admitting<'_> {
        self.tally.admitting.fetch_add(1, Ordering::Relaxed);
        Admitting(self)
    }
}

/// The budget arithmetic's rule for a destination's pacing keys and the classes' shares:
/// `of_key` for a key's budget; else, for a budget split by key, the keys' total.
fn rule_of(pace: &Pace, classes: &Classes, of_key: bool) -> Rule {
    let rate = match pace.total_rate {
        Some(total) if !of_key && pace.key.is_some() => total,
        _ => pace.rate,
    };
    Rule {
        shares: Arc::from(classes.shares()),
        quota: pace.quota.clone(),
        window: pace.window,
        largest: 0,
        interval: Duration::from_secs_f64(1.0 / rate),
        cost: 1,
        metered: false,
        burst: pace.burst,
        backoff_factor: pace.backoff_factor,
        backoff_max: pace.backoff_max,
        decay_after: pace.decay_after,
        retry_after_max: pace.retry_after_max,
        reserve: pace.reserve,
        vendor_pace: pace.vendor_pace,
        block: pace.throttle_block,
    }
}

/// Removes a waiter from its queue when its request gives up (client gone, deadline).
pub(super) struct QueueSeat<'a> {
    lane: &'a Lane,
    id: u64,
}

impl Drop for QueueSeat<'_> {
    fn drop(&mut self) {
        let left = self.lane.queue.lock().leave(self.id);
        // A request that gave up while still queued: the dispatcher tells the store that it no
        // longer waits. (One that got its slot was already taken off the queue.)
        if left {
            self.lane.work.notify_one();
        }
    }
}

/// Counts a request in `admit` for status.
pub(super) struct Admitting<'a>(&'a Lane);

impl Drop for Admitting<'_> {
    fn drop(&mut self) {
        self.0.tally.admitting.fetch_sub(1, Ordering::Relaxed);
    }
}
