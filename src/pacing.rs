//! The pacer: every request to a destination waits for a slot, and every response adjusts the
//! pace.
//!
//! Each destination has a *lane*: a queue of waiting requests and one dispatcher task. The
//! dispatcher reserves the next slot from the store only when someone is waiting, sleeps
//! until it (holding no lock and no store connection), and hands it to the request at the
//! head of the queue. Slots are thus handed to requests rather than reserved by each request
//! on arrival, so the order in which waiting requests are served is the queue's to decide
//! (first come first served today; priority classes later).
//!
//! Knows nothing of HTTP beyond the status and headers the verdict is read from.

pub mod verdict;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use http::HeaderMap;
use serde::Serialize;
use tokio::sync::{oneshot, watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::budget::{
    Ask, BudgetView, ClassQueue, Event, InstanceStatus, Lockout, ReserveError, Rule, Store,
    StoreError,
};
use crate::class::{Class, Classes};
use crate::destination::{Destination, Pace};
use crate::metrics::Metrics;
use verdict::Verdict;

/// Why a request got no slot.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PaceError {
    /// The destination is locked out.
    #[error("destination `{destination}` is locked out")]
    Locked {
        /// The destination.
        destination: String,
        /// What locked it.
        lock: Lockout,
    },
    /// No slot within `max_wait`.
    #[error("no slot for destination `{destination}` within max_wait")]
    Deadline {
        /// The destination.
        destination: String,
        /// The request's class.
        class: String,
        /// The configured `max_wait`.
        max_wait: Duration,
        /// A hint for the client: when a slot is likely to be free.
        retry_after: Duration,
    },
    /// The store failed.
    #[error("{0}")]
    Store(#[from] StoreError),
    /// pacegate is shutting down.
    #[error("pacegate is shutting down")]
    ShuttingDown,
}

/// A granted slot. Holding it holds the destination's concurrency permit and counts the
/// request as in flight; drop it when the exchange is over.
pub struct Admission {
    lane: Arc<Lane>,
    /// The class the slot was granted to.
    pub class: Class,
    generation: u64,
    /// How long the request waited for its slot.
    pub waited: Duration,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.lane.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Admission {
    /// The destination's pacing keys.
    pub fn pace(&self) -> &Pace {
        &self.lane.pace
    }
}

struct Grant {
    generation: u64,
    class: Class,
}

struct Waiter {
    id: u64,
    class: Class,
    since: Instant,
    deadline: Instant,
    tx: oneshot::Sender<Result<Grant, PaceError>>,
}

/// The waiting requests of a lane: one FIFO per class, most urgent first.
struct Queue {
    next_id: u64,
    classes: Vec<VecDeque<Waiter>>,
}

/// What the store was last told of one class's waiting requests: enough to see when it
/// must be told again (the ages of the oldest follow from their ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Told {
    class: Class,
    count: usize,
    oldest: u64,
}

impl Queue {
    fn new(classes: usize) -> Self {
        Self {
            next_id: 0,
            classes: (0..classes.max(1)).map(|_| VecDeque::new()).collect(),
        }
    }

    fn len(&self) -> usize {
        self.classes.iter().map(VecDeque::len).sum()
    }

    fn iter(&self) -> impl Iterator<Item = &Waiter> {
        self.classes.iter().flatten()
    }

    fn retain(&mut self, mut keep: impl FnMut(&Waiter) -> bool) {
        for q in &mut self.classes {
            q.retain(&mut keep);
        }
    }

    fn drain(&mut self) -> Vec<Waiter> {
        self.classes.iter_mut().flat_map(|q| q.drain(..)).collect()
    }

    fn classes(&self) -> impl Iterator<Item = (Class, &VecDeque<Waiter>)> {
        self.classes
            .iter()
            .enumerate()
            .filter(|(_, q)| !q.is_empty())
            .map(|(i, q)| (Class(u16::try_from(i).unwrap_or(u16::MAX)), q))
    }

    /// The wait list as the store takes it.
    fn wait_list(&self, now: Instant) -> Vec<ClassQueue> {
        self.classes()
            .map(|(class, q)| ClassQueue {
                class,
                count: u32::try_from(q.len()).unwrap_or(u32::MAX),
                oldest: now - q[0].since,
                next: q.get(1).map(|w| now - w.since),
            })
            .collect()
    }

    fn told(&self) -> Vec<Told> {
        self.classes()
            .map(|(class, q)| Told {
                class,
                count: q.len(),
                oldest: q[0].id,
            })
            .collect()
    }
}

/// What the store knows after granting a slot to `class`'s oldest request: that request gone.
fn after_grant(told: &[Told], queue: &Queue, class: Class) -> Vec<Told> {
    told.iter()
        .filter_map(|t| {
            if t.class != class {
                return Some(*t);
            }
            let next = queue.classes[usize::from(class.0)].get(1)?;
            Some(Told {
                count: t.count - 1,
                oldest: next.id,
                ..*t
            })
        })
        .collect()
}

/// Sends per second over the last 64 seconds, for the achieved rate.
struct SendLog {
    epoch: Instant,
    seconds: [u64; 64],
    counts: [u32; 64],
}

impl SendLog {
    fn new() -> Self {
        Self {
            epoch: Instant::now(),
            seconds: [u64::MAX; 64],
            counts: [0; 64],
        }
    }

    fn record(&mut self, at: Instant) {
        let sec = (at - self.epoch).as_secs();
        let i = (sec % 64) as usize;
        if self.seconds[i] != sec {
            self.seconds[i] = sec;
            self.counts[i] = 0;
        }
        self.counts[i] += 1;
    }

    /// Sends over the last `window` whole seconds, the current one included.
    fn count(&self, now: Instant, window: u64) -> u64 {
        let current = (now - self.epoch).as_secs();
        let first = current.saturating_sub(window - 1);
        (0..64)
            .filter(|&i| (first..=current).contains(&self.seconds[i]))
            .map(|i| u64::from(self.counts[i]))
            .sum()
    }

    /// Sends per second over the last `window` whole seconds, the current one included.
    fn rate(&self, now: Instant, window: u64) -> f64 {
        let sent = self.count(now, window);
        let elapsed = (now - self.epoch).as_secs_f64().min(window as f64).max(1.0);
        sent as f64 / elapsed
    }
}

struct Lane {
    name: Arc<str>,
    rule: Rule,
    pace: Pace,
    classes: Arc<Classes>,
    queue: Mutex<Queue>,
    work: Notify,
    concurrency: Option<Arc<Semaphore>>,
    /// The lockout as last seen; the dispatcher watches it to refuse its waiters at once.
    locked: watch::Sender<Option<Lockout>>,
    /// The budget as last seen, for status and metrics between store reads.
    seen: Mutex<BudgetView>,
    /// Requests between admission and the end of their exchange.
    in_flight: AtomicUsize,
    /// Requests in `admit`: waiting for a concurrency permit or a slot.
    admitting: AtomicUsize,
    sends: Mutex<SendLog>,
    /// Slots granted per class, for status.
    granted: Mutex<Vec<SendLog>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section here is a few field updates; a panic cannot leave them torn.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Lane {
    fn new(d: &Destination, classes: Arc<Classes>) -> Self {
        let pace = d.pace.clone();
        Self {
            name: Arc::from(d.name.as_str()),
            rule: rule_of(&pace, &classes),
            concurrency: (pace.max_concurrency > 0)
                .then(|| Arc::new(Semaphore::new(pace.max_concurrency))),
            pace,
            queue: Mutex::new(Queue::new(classes.len())),
            granted: Mutex::new(classes.all().map(|_| SendLog::new()).collect()),
            classes,
            work: Notify::new(),
            locked: watch::channel(None).0,
            seen: Mutex::new(BudgetView::default()),
            in_flight: AtomicUsize::new(0),
            admitting: AtomicUsize::new(0),
            sends: Mutex::new(SendLog::new()),
        }
    }

    fn locked_error(&self, lock: Lockout) -> PaceError {
        PaceError::Locked {
            destination: self.name.to_string(),
            lock,
        }
    }

    fn deadline_error(&self, class: Class, retry_after: Duration) -> PaceError {
        PaceError::Deadline {
            destination: self.name.to_string(),
            class: self.classes.name(class).to_owned(),
            max_wait: self.max_wait(class),
            retry_after,
        }
    }

    /// How long a request of `class` may wait for a slot.
    fn max_wait(&self, class: Class) -> Duration {
        self.classes.max_wait(class).unwrap_or(self.pace.max_wait)
    }

    /// A guess at when a slot will be free for a new request: the queue ahead of it at the
    /// current interval.
    fn estimated_wait(&self) -> Duration {
        let backoff = lock(&self.seen).backoff;
        let ahead = lock(&self.queue).len() as u32 + 1;
        (self.rule.interval.mul_f64(backoff) * ahead).max(lock(&self.seen).paused_for)
    }

    fn note(&self, view: BudgetView) {
        let lock_now = view.lock.clone();
        *lock(&self.seen) = view;
        self.locked.send_if_modified(|current| {
            let changed = *current != lock_now;
            *current = lock_now;
            changed
        });
    }

    fn refuse_all(&self, error: &PaceError) {
        let waiters: Vec<Waiter> = lock(&self.queue).drain();
        for w in waiters {
            let _ = w.tx.send(Err(error.clone()));
        }
    }

    /// Hands a slot due at `at` to the oldest waiter of `class` that can still use it, or,
    /// if that class has none left, to the oldest of the most urgent class that has one.
    /// Waiters whose deadline falls before the slot are refused; they could not have been
    /// served in time.
    fn hand_out(&self, class: Class, at: Instant, generation: u64) -> bool {
        let mut queue = lock(&self.queue);
        let first = usize::from(class.0).min(queue.classes.len() - 1);
        let order = std::iter::once(first).chain((0..queue.classes.len()).filter(|i| *i != first));
        for i in order {
            while let Some(w) = queue.classes[i].pop_front() {
                if w.tx.is_closed() {
                    continue;
                }
                let class = Class(u16::try_from(i).unwrap_or(u16::MAX));
                if w.deadline < at {
                    let _ =
                        w.tx.send(Err(self.deadline_error(class, self.rule.interval)));
                    continue;
                }
                if w.tx.send(Ok(Grant { generation, class })).is_ok() {
                    return true;
                }
            }
        }
        false
    }
}

fn rule_of(pace: &Pace, classes: &Classes) -> Rule {
    Rule {
        shares: Arc::from(classes.shares()),
        quota: pace.quota.clone(),
        interval: Duration::from_secs_f64(1.0 / pace.rate),
        burst: pace.burst,
        backoff_factor: pace.backoff_factor,
        backoff_max: pace.backoff_max,
        decay_after: pace.decay_after,
        retry_after_max: pace.retry_after_max,
    }
}

/// Removes a waiter from its queue when its request gives up (client gone, deadline).
struct QueueSeat<'a> {
    lane: &'a Lane,
    id: u64,
}

impl Drop for QueueSeat<'_> {
    fn drop(&mut self) {
        let left = {
            let mut queue = lock(&self.lane.queue);
            let before = queue.len();
            queue.retain(|w| w.id != self.id);
            queue.len() < before
        };
        // A request that gave up while still queued: the dispatcher tells the store that it no
        // longer waits. (One that got its slot was already taken off the queue.)
        if left {
            self.lane.work.notify_one();
        }
    }
}

struct Admitting<'a>(&'a Lane);

impl Drop for Admitting<'_> {
    fn drop(&mut self) {
        self.0.admitting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One destination's state for `/status` and `pacegate status`.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct DestinationStatus {
    /// Destination name.
    pub destination: String,
    /// Configured `rate` (requests per second).
    pub rate: f64,
    /// `rate / backoff`.
    pub effective_rate: f64,
    /// Interval multiplier.
    pub backoff: f64,
    /// Sends per second over the last 10 s.
    pub achieved_rate_10s: f64,
    /// Sends per second over the last 60 s.
    pub achieved_rate_60s: f64,
    /// Clean responses in a row.
    pub clean_streak: u32,
    /// Seconds left in a Retry-After pause (0 when none).
    pub paused_for_seconds: f64,
    /// When the pause ends (RFC 3339), if paused.
    pub paused_until: Option<String>,
    /// The lockout, when locked.
    pub lock: Option<LockStatus>,
    /// Requests waiting for a slot.
    pub waiting: usize,
    /// Requests admitted and not finished.
    pub in_flight: usize,
    /// Seconds the oldest waiting request has waited.
    pub oldest_wait_seconds: f64,
    /// Per class, most urgent first.
    #[serde(default)]
    pub classes: Vec<ClassStatus>,
    /// Quota windows, as configured.
    #[serde(default)]
    pub quota: Vec<QuotaStatus>,
}

/// One class of one destination, for status.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct ClassStatus {
    /// Class name.
    pub class: String,
    /// Requests of this class waiting on every instance (this one's when the store cannot
    /// say).
    pub waiting: usize,
    /// Requests of this class waiting on this instance.
    pub waiting_here: usize,
    /// Seconds the oldest of them has waited, on any instance.
    pub oldest_wait_seconds: f64,
    /// Slots this instance granted to the class over the last minute.
    pub granted_last_minute: u64,
}

/// One quota window of one destination, for status.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct QuotaStatus {
    /// The window's length (`1m`, `1day`).
    pub window: String,
    /// Sends allowed in it.
    pub limit: u32,
    /// Slots taken in the last window, over every instance.
    pub used: u32,
}

/// A lockout as status shows it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct LockStatus {
    /// When (RFC 3339).
    pub since: String,
    /// The upstream status.
    pub status: u16,
    /// The request that caused it.
    pub request: String,
    /// The instance that saw it.
    pub instance: String,
}

impl From<&Lockout> for LockStatus {
    fn from(l: &Lockout) -> Self {
        Self {
            since: humantime::format_rfc3339_seconds(l.since).to_string(),
            status: l.status,
            request: l.request.clone(),
            instance: l.instance.clone(),
        }
    }
}

/// The pacer of every configured destination.
pub struct Pacer {
    lanes: HashMap<Arc<str>, Arc<Lane>>,
    classes: Arc<Classes>,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    instance: String,
    stop: CancellationToken,
}

impl Pacer {
    /// A pacer over `store`; `instance` names this process in lockout records. Call
    /// [`Pacer::start`] to run the dispatchers.
    pub fn new(
        destinations: &[Destination],
        classes: Classes,
        store: Arc<dyn Store>,
        metrics: Arc<Metrics>,
        instance: String,
    ) -> Self {
        let classes = Arc::new(classes);
        let lanes = destinations
            .iter()
            .map(|d| {
                (
                    Arc::from(d.name.as_str()),
                    Arc::new(Lane::new(d, classes.clone())),
                )
            })
            .collect();
        Self {
            lanes,
            classes,
            store,
            metrics,
            instance,
            stop: CancellationToken::new(),
        }
    }

    /// Loads each budget (a lockout from before a restart applies at once) and spawns one
    /// dispatcher per destination.
    pub async fn start(&self) -> Result<(), StoreError> {
        for lane in self.lanes.values() {
            lane.note(self.store.view(&lane.name).await?);
            tokio::spawn(dispatch(
                lane.clone(),
                self.store.clone(),
                self.metrics.clone(),
                self.stop.clone(),
            ));
        }
        Ok(())
    }

    /// Refuses every waiting request and stops the dispatchers.
    pub fn stop(&self) {
        self.stop.cancel();
        for lane in self.lanes.values() {
            lane.refuse_all(&PaceError::ShuttingDown);
        }
    }

    fn lane(&self, destination: &str) -> &Arc<Lane> {
        self.lanes
            .get(destination)
            .unwrap_or_else(|| panic!("destination `{destination}` routed but not paced"))
    }

    /// The pacing keys of a destination.
    pub fn pace(&self, destination: &str) -> &Pace {
        &self.lane(destination).pace
    }

    /// The priority classes.
    pub fn classes(&self) -> &Classes {
        &self.classes
    }

    /// How long a request of `class` may wait for a slot of `destination`: the class's
    /// `max_wait` if it has one, else the destination's.
    pub fn max_wait(&self, destination: &str, class: Class) -> Duration {
        self.lane(destination).max_wait(class)
    }

    /// Waits for a slot of `destination` for a request of `class`, up to `deadline`.
    /// Cancel-safe: dropping the future leaves the queue at once.
    pub async fn admit(
        &self,
        destination: &str,
        class: Class,
        deadline: Instant,
    ) -> Result<Admission, PaceError> {
        let lane = self.lane(destination);
        let started = Instant::now();
        if self.stop.is_cancelled() {
            return Err(PaceError::ShuttingDown);
        }
        if lane.locked.borrow().is_some() {
            // Confirm with the store: another instance may have unlocked it.
            if let Ok(view) = self.store.view(&lane.name).await {
                lane.note(view);
            }
            if let Some(lock) = lane.locked.borrow().clone() {
                return Err(lane.locked_error(lock));
            }
        }
        lane.admitting.fetch_add(1, Ordering::Relaxed);
        let _admitting = Admitting(lane);
        let permit = match &lane.concurrency {
            None => None,
            Some(sem) => tokio::select! {
                p = sem.clone().acquire_owned() => p.ok(),
                () = tokio::time::sleep_until(deadline) => return Err(lane.deadline_error(class, lane.estimated_wait())),
            },
        };
        let (tx, rx) = oneshot::channel();
        let id = {
            let mut queue = lock(&lane.queue);
            queue.next_id += 1;
            let id = queue.next_id;
            let rank = usize::from(class.0).min(queue.classes.len() - 1);
            queue.classes[rank].push_back(Waiter {
                id,
                class,
                since: started,
                deadline,
                tx,
            });
            id
        };
        let _seat = QueueSeat { lane, id };
        lane.work.notify_one();
        let granted = tokio::select! {
            g = rx => g.unwrap_or(Err(PaceError::ShuttingDown)),
            () = tokio::time::sleep_until(deadline) => Err(lane.deadline_error(class, lane.estimated_wait())),
        }?;
        let now = Instant::now();
        lock(&lane.sends).record(now);
        if let Some(log) = lock(&lane.granted).get_mut(usize::from(granted.class.0)) {
            log.record(now);
        }
        self.metrics
            .granted
            .with_label_values(&[&lane.name, self.classes.name(granted.class)])
            .inc();
        lane.in_flight.fetch_add(1, Ordering::Relaxed);
        let waited = now - started;
        self.metrics
            .wait_seconds
            .with_label_values(&[&lane.name])
            .observe(waited.as_secs_f64());
        Ok(Admission {
            lane: lane.clone(),
            class: granted.class,
            generation: granted.generation,
            waited,
            _permit: permit,
        })
    }

    /// Reads the verdict of a response to an admitted request and applies it to the budget.
    /// `request` is the request line, kept with a lockout.
    pub async fn observe(
        &self,
        admission: &Admission,
        status: u16,
        headers: &HeaderMap,
        request: &str,
    ) -> Verdict {
        let lane = &admission.lane;
        let verdict = verdict::classify(status, headers, &lane.pace, SystemTime::now());
        let event = match verdict {
            Verdict::Clean => Event::Clean,
            Verdict::Throttled { retry_after } => Event::Throttled {
                generation: admission.generation,
                retry_after,
            },
            Verdict::Lockout => Event::Lockout(Lockout::new(
                status,
                request.to_owned(),
                self.instance.clone(),
            )),
            Verdict::None => return verdict,
        };
        self.metrics
            .verdicts
            .with_label_values(&[&lane.name, verdict.as_str()])
            .inc();
        match self.store.record(&lane.name, &lane.rule, event).await {
            Ok(view) => {
                if verdict == Verdict::Lockout {
                    tracing::error!(
                        destination = %lane.name,
                        status,
                        request,
                        "destination locked out: nothing more is sent until `pacegate unlock {}`",
                        lane.name
                    );
                }
                lane.note(view);
            }
            Err(e) => {
                tracing::error!(destination = %lane.name, "cannot record a {verdict} verdict: {e}")
            }
        }
        verdict
    }

    /// Clears a lockout. Returns the lockout cleared, or `None` if the destination was not
    /// locked; an unknown destination is `Err(None)`.
    pub async fn unlock(&self, destination: &str) -> Result<Option<Lockout>, Option<StoreError>> {
        let lane = self.lanes.get(destination).ok_or(None)?;
        let cleared = self.store.unlock(destination).await.map_err(Some)?;
        lane.note(self.store.view(destination).await.map_err(Some)?);
        if let Some(l) = &cleared {
            tracing::warn!(destination, was = %l.request, status = l.status, "lockout cleared by an operator");
        }
        Ok(cleared)
    }

    /// The live instances sharing the store (empty for a store of one instance).
    pub async fn instances(&self) -> Result<Vec<InstanceStatus>, StoreError> {
        self.store.instances().await
    }

    /// Every destination's status, refreshing the per-destination gauges on the way.
    pub async fn status(&self) -> Vec<DestinationStatus> {
        let mut out = Vec::new();
        let now = Instant::now();
        for lane in self.lanes.values() {
            if let Ok(view) = self.store.view(&lane.name).await {
                lane.note(view);
            }
            let seen = lock(&lane.seen).clone();
            // Every instance's waiting requests; this instance's own when the store cannot
            // say (it is unreachable).
            let everywhere = self.store.waiting(&lane.name).await.ok();
            let (classes, waiting, oldest) = {
                let q = lock(&lane.queue);
                let granted = lock(&lane.granted);
                let classes: Vec<ClassStatus> = self
                    .classes
                    .all()
                    .map(|class| {
                        let here = &q.classes[usize::from(class.0)];
                        let all = everywhere
                            .as_ref()
                            .and_then(|e| e.iter().find(|w| w.0 == class));
                        let oldest_here = here.front().map_or(Duration::ZERO, |w| now - w.since);
                        ClassStatus {
                            class: self.classes.name(class).to_owned(),
                            waiting_here: here.len(),
                            waiting: all.map_or(here.len(), |w| w.1 as usize),
                            oldest_wait_seconds: all
                                .map_or(oldest_here, |w| w.2.max(oldest_here))
                                .as_secs_f64(),
                            granted_last_minute: granted
                                .get(usize::from(class.0))
                                .map_or(0, |g| g.count(now, 60)),
                        }
                    })
                    .collect();
                let oldest = q.iter().map(|w| now - w.since).max().unwrap_or_default();
                (classes, q.len(), oldest)
            };
            let used = self
                .store
                .quota_used(&lane.name, &lane.rule)
                .await
                .unwrap_or_default();
            let quota = lane
                .rule
                .quota
                .iter()
                .enumerate()
                .map(|(i, q)| QuotaStatus {
                    window: humantime::format_duration(q.per).to_string(),
                    limit: q.limit,
                    used: used.get(i).copied().unwrap_or(0),
                })
                .collect();
            let (rate_10, rate_60) = {
                let sends = lock(&lane.sends);
                (sends.rate(now, 10), sends.rate(now, 60))
            };
            let s = DestinationStatus {
                destination: lane.name.to_string(),
                rate: lane.pace.rate,
                effective_rate: lane.pace.rate / seen.backoff,
                backoff: seen.backoff,
                achieved_rate_10s: rate_10,
                achieved_rate_60s: rate_60,
                clean_streak: seen.clean_streak,
                paused_for_seconds: seen.paused_for.as_secs_f64(),
                paused_until: (!seen.paused_for.is_zero()).then(|| {
                    humantime::format_rfc3339_seconds(SystemTime::now() + seen.paused_for)
                        .to_string()
                }),
                lock: seen.lock.as_ref().map(LockStatus::from),
                waiting: lane.admitting.load(Ordering::Relaxed).max(waiting),
                in_flight: lane.in_flight.load(Ordering::Relaxed),
                oldest_wait_seconds: oldest.as_secs_f64(),
                classes,
                quota,
            };
            self.metrics.set_destination(&s, seen.paused_for);
            out.push(s);
        }
        out.sort_by(|a, b| a.destination.cmp(&b.destination));
        out
    }
}

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

/// One destination's dispatcher: whenever someone waits, tells the store this instance's wait
/// list and asks for the next slot. The store grants it to the request that deserves it over
/// every instance (by class, then age); when that request is one of ours the dispatcher sleeps
/// until the slot and hands it out, otherwise it yields and asks again shortly. The
/// dispatcher is the only writer of this instance's wait list in the store, so its updates
/// arrive in order.
async fn dispatch(
    lane: Arc<Lane>,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    let mut locked = lane.locked.subscribe();
    let reservation_seconds = metrics
        .reservation_seconds
        .with_label_values(&[store.kind()]);
    let slots_dropped = metrics.slots_dropped.with_label_values(&[&lane.name]);
    // What the store was last told of this instance's waiting requests, and whether to tell
    // it again even if that has not changed.
    let mut told: Vec<Told> = Vec::new();
    let mut tell_again = false;
    loop {
        // Wait for work. `notify_one` keeps a permit, so a waiter that arrives between the
        // check and the wait is not missed.
        let latest = loop {
            let latest = {
                let mut q = lock(&lane.queue);
                q.retain(|w| !w.tx.is_closed());
                q.iter().map(|w| w.deadline).max()
            };
            if let Some(latest) = latest {
                break latest;
            }
            if !told.is_empty() && store.wait_list(&lane.name, &[]).await.is_ok() {
                told.clear();
            }
            tokio::select! {
                () = lane.work.notified() => {}
                () = stop.cancelled() => return,
            }
        };
        let (queues, asked) = {
            let q = lock(&lane.queue);
            (q.wait_list(Instant::now()), q.told())
        };
        let ask = Ask {
            queues: &queues,
            changed: tell_again || asked != told,
            not_after: Some(latest),
        };
        let started = Instant::now();
        let reserved = store.reserve(&lane.name, &lane.rule, ask).await;
        reservation_seconds.observe(started.elapsed().as_secs_f64());
        if matches!(
            reserved,
            Err(ReserveError::Busy(_) | ReserveError::Store(_))
        ) {
            // The store may or may not have taken the list (and granted a slot from it).
            tell_again = true;
        } else {
            told = asked;
            tell_again = false;
        }
        match reserved {
            Ok(grant) => {
                told = after_grant(&told, &lock(&lane.queue), grant.class);
                let slot = grant.slot;
                locked.borrow_and_update();
                // Wait for the slot. Another instance may lock the destination meanwhile
                // (a shared store), so a long wait looks at the budget every LOCK_POLL:
                // waiters are refused promptly, and the slot is never used. Requests that
                // arrive or leave meanwhile are told to the store at once, so that other
                // instances grant their slots knowing them.
                let spin = lane.rule.interval.mul_f64(self::lock(&lane.seen).backoff) >= SPIN_FROM;
                let mut poll_at = Instant::now() + LOCK_POLL;
                let lockout = loop {
                    // The timer wheel rounds a deadline up to the next millisecond: aim one
                    // tick early, then yield until the slot (never before it).
                    let wake = slot
                        .at
                        .checked_sub(TIMER_TICK)
                        .unwrap_or(slot.at)
                        .min(poll_at);
                    tokio::select! {
                        () = tokio::time::sleep_until(wake) => {}
                        _ = locked.changed() => {}
                        () = lane.work.notified() => {
                            let (now_told, queues) = {
                                let q = lock(&lane.queue);
                                (q.told(), q.wait_list(Instant::now()))
                            };
                            if now_told != told && store.wait_list(&lane.name, &queues).await.is_ok() {
                                told = now_told;
                            }
                            continue;
                        }
                        () = stop.cancelled() => return,
                    }
                    if let Some(lock) = locked.borrow_and_update().clone() {
                        break Some(lock);
                    }
                    if Instant::now() + TIMER_TICK >= slot.at {
                        // Yielding costs CPU for up to a tick per slot: worth it only where a
                        // tick is a small part of the interval.
                        let mut spins = if spin { 0 } else { MAX_SPINS };
                        while Instant::now() < slot.at && spins < MAX_SPINS {
                            tokio::task::yield_now().await;
                            spins += 1;
                        }
                        if Instant::now() < slot.at {
                            tokio::time::sleep_until(slot.at).await;
                        }
                        break None;
                    }
                    if Instant::now() >= poll_at {
                        poll_at = Instant::now() + LOCK_POLL;
                        if let Ok(view) = store.view(&lane.name).await {
                            lane.note(view);
                        }
                    }
                };
                if let Some(lock) = lockout {
                    lane.refuse_all(&lane.locked_error(lock));
                    continue;
                }
                // A slot is an instant, not a licence: a request sent well after it (this
                // process was descheduled, or the store's answer was delayed) would bunch with
                // the next ones. Such a slot is dropped, which can only slow the destination.
                let late = Instant::now().saturating_duration_since(slot.at) + slot.excess_delay;
                if late > lane.rule.max_late() {
                    slots_dropped.inc();
                    tracing::info!(destination = %lane.name, late_ms = late.as_secs_f64() * 1000.0, "slot too late to use; reserving another");
                    continue;
                }
                if !lane.hand_out(grant.class, slot.at, slot.generation) {
                    tracing::debug!(destination = %lane.name, "a reserved slot found no waiter (all gave up)");
                }
            }
            Err(ReserveError::Yield(after)) => {
                // A request on another instance goes first. Ask again shortly, or at once if
                // a request arrives or leaves here. The next ask tells the wait list again:
                // should the store have dropped it (a lease that ran out while this process
                // stalled), this instance would otherwise yield for ever.
                tell_again = true;
                tokio::select! {
                    () = tokio::time::sleep(after) => {}
                    () = lane.work.notified() => {}
                    _ = locked.changed() => {
                        if let Some(lock) = locked.borrow_and_update().clone() {
                            lane.refuse_all(&lane.locked_error(lock));
                        }
                    }
                    () = stop.cancelled() => return,
                }
            }
            Err(ReserveError::Locked(lock)) => {
                let seen = self::lock(&lane.seen).clone();
                lane.note(BudgetView {
                    lock: Some(lock.clone()),
                    ..seen
                });
                lane.refuse_all(&lane.locked_error(lock));
            }
            Err(ReserveError::TooLate { slot }) => {
                // Every waiter's deadline is before the first free slot: refuse them all now
                // rather than let them wait for nothing.
                let retry_after = slot.saturating_duration_since(Instant::now());
                let waiters = lock(&lane.queue).drain();
                for w in waiters {
                    let _ = w.tx.send(Err(lane.deadline_error(w.class, retry_after)));
                }
            }
            Err(ReserveError::Store(e)) => {
                tracing::error!(destination = %lane.name, "cannot reserve a slot: {e}");
                lane.refuse_all(&PaceError::Store(e));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(ReserveError::Busy(after)) => {
                // The waiters keep waiting, within their own deadlines.
                tracing::warn!(destination = %lane.name, "the store did not answer within {after:?}; trying again");
            }
        }
    }
}

#[cfg(test)]
mod tests;

/// The live instances as a table.
pub fn instances_table(rows: &[InstanceStatus]) -> String {
    let mut out = format!(
        "{:<40}  {:<20}  {:>7}  {:<8}  {:<20}  {}\n",
        "INSTANCE", "HOST", "PID", "VERSION", "STARTED", "LAST SEEN"
    );
    for i in rows {
        out.push_str(&format!(
            "{:<40}  {:<20}  {:>7}  {:<8}  {:<20}  {:.1}s ago\n",
            i.id, i.host, i.pid, i.version, i.started, i.last_seen_seconds_ago
        ));
    }
    out
}

/// `pacegate status` as a table: one line per destination, then (with more than one class)
/// one per destination and class.
pub fn status_table(rows: &[DestinationStatus]) -> String {
    let mut lines = vec![[
        "DESTINATION",
        "RATE",
        "EFFECTIVE",
        "BACKOFF",
        "ACHIEVED 10s/60s",
        "STREAK",
        "PAUSED",
        "WAITING",
        "IN FLIGHT",
        "OLDEST WAIT",
        "QUOTA USED",
        "LOCKOUT",
    ]
    .map(String::from)
    .to_vec()];
    for r in rows {
        let quota: Vec<String> = r
            .quota
            .iter()
            .map(|q| format!("{}/{} per {}", q.used, q.limit, q.window))
            .collect();
        lines.push(vec![
            r.destination.clone(),
            format!("{}/s", r.rate),
            format!("{:.3}/s", r.effective_rate),
            format!("x{}", r.backoff),
            format!("{:.2} / {:.2}", r.achieved_rate_10s, r.achieved_rate_60s),
            r.clean_streak.to_string(),
            if r.paused_for_seconds > 0.0 {
                format!("{:.1}s", r.paused_for_seconds)
            } else {
                "-".into()
            },
            r.waiting.to_string(),
            r.in_flight.to_string(),
            format!("{:.1}s", r.oldest_wait_seconds),
            if quota.is_empty() {
                "-".into()
            } else {
                quota.join(", ")
            },
            r.lock.as_ref().map_or("-".into(), |l| {
                format!(
                    "LOCKED since {} by {} to {} (pacegate unlock {})",
                    l.since, l.status, l.request, r.destination
                )
            }),
        ]);
    }
    let mut out = aligned(&lines);
    if rows.iter().any(|r| r.classes.len() > 1) {
        let mut lines = vec![[
            "DESTINATION",
            "CLASS",
            "WAITING ALL/HERE",
            "OLDEST WAIT",
            "GRANTED LAST MIN (HERE)",
        ]
        .map(String::from)
        .to_vec()];
        for r in rows {
            for c in &r.classes {
                lines.push(vec![
                    r.destination.clone(),
                    c.class.clone(),
                    format!("{} / {}", c.waiting, c.waiting_here),
                    format!("{:.1}s", c.oldest_wait_seconds),
                    c.granted_last_minute.to_string(),
                ]);
            }
        }
        out.push('\n');
        out.push_str(&aligned(&lines));
    }
    out
}

/// Rows of cells as left-aligned columns.
fn aligned(lines: &[Vec<String>]) -> String {
    let columns = lines.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..columns)
        .map(|c| lines.iter().map(|l| l[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for l in lines {
        let cells: Vec<String> = l
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}
