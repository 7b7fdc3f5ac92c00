//! The budget seam: where destinations' budgets live ([`Store`]), and the types every store
//! shares.
//!
//! A budget is one destination's shared pacing state (next slot, backoff, generation, clean
//! streak, pause, lockout). Its arithmetic is in [`schedule`], pure and shared; a store (the
//! `store` module's) holds budgets and applies that arithmetic atomically: `memory` for one
//! instance, `postgres` for every instance at once. The contract suite (`contract`, in tests)
//! is what every store must pass. Nothing here knows HTTP, how responses are classified, or
//! which instances share a store (that is the `fleet`'s).

pub mod known;
pub mod schedule;

#[cfg(test)]
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod model;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::class::Class;
use crate::destination::{Block, Quota, VendorPace};
use crate::signals::Family;
use crate::status::LockStatus;

pub use crate::destination::{GROUP_MARK, KEY_MARK, METER_MARK};
pub use known::Known;

/// The budget whose lockout halts `budget` too: a key's parent (`PARENT` of `PARENT#KEY`). A
/// lockout is the IP's, so it is kept on the parent alone, and every key, on any instance and
/// however new, is halted by it.
pub fn halted_by(budget: &str) -> Option<&str> {
    budget.split_once(KEY_MARK).map(|(parent, _)| parent)
}

/// A destination's pacing rule, from its config.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// `1 / rate`: the interval a slot of [`Rule::cost`] units takes.
    pub interval: Duration,
    /// The units a slot stands for: 1 for a request, a meter request's estimate in a rule
    /// from [`Rule::weighted`]. Quota windows count them.
    pub cost: u32,
    /// A meter's rule: its slots may be used up to [`METER_LATE`] late (see
    /// [`Rule::max_late`]).
    pub metered: bool,
    /// Slots that may be taken at once after an idle spell (at least 1).
    pub burst: u32,
    /// Backoff multiplier per widening, and divisor per decay (> 1).
    pub backoff_factor: f64,
    /// The largest backoff.
    pub backoff_max: f64,
    /// Clean responses in a row before the backoff decays once.
    pub decay_after: u32,
    /// The longest pause a Retry-After can impose.
    pub retry_after_max: Duration,
    /// Each class's guaranteed share of the slots while it has waiters, by rank (0: none).
    pub shares: Arc<[f64]>,
    /// Quota windows on top of the rate.
    pub quota: Vec<Quota>,
    /// A meter's own window: its size over its length (a minute's units for `per_minute`,
    /// a second's for `rate`), which no window of that length may hold more of than the
    /// request that fills it (see [`Rule::windows`]); `None` for a request budget.
    pub window: Option<Quota>,
    /// The largest estimate a meter has reserved here: its own window holds its limit and
    /// as much more (or the slot's own units, where more), one request's worth. 0 for a
    /// request budget.
    pub largest: u32,
    /// The vendor's remaining requests left unused.
    pub reserve: u32,
    /// How the vendor's remaining requests are spent: at the rate, or spread to the reset.
    pub vendor_pace: VendorPace,
    /// The escalating block after a throttle without a pause; `None`: widen only.
    pub block: Option<Block>,
}

impl Rule {
    /// The rule a slot of `cost` units is reserved by: `cost` intervals long, so that the
    /// requests after it wait for what it takes of the budget. Every store reserves a weighted
    /// slot by this rule, as it reserves a request's slot by the rule itself.
    pub fn weighted(&self, cost: u32) -> std::borrow::Cow<'_, Rule> {
        if cost <= 1 {
            return std::borrow::Cow::Borrowed(self);
        }
        std::borrow::Cow::Owned(Rule {
            interval: self.interval.saturating_mul(cost),
            cost: self.cost.saturating_mul(cost),
            ..self.clone()
        })
    }

    /// Every window a slot of [`Rule::cost`] units must fit, as (units, length): each quota
    /// window's limit, and a meter's own window's limit plus one request's worth (the
    /// largest estimate it has reserved, [`Rule::largest`], or the slot's own units where
    /// more). So a meter's window never holds more than its limit and the largest request,
    /// each counted at its estimate until its cost is known and at the cost after: the
    /// rate alone would let a refund given after later slots were granted crowd the window
    /// that starts there.
    pub fn windows(&self) -> impl Iterator<Item = (u64, Duration)> + '_ {
        let over = self.cost.max(self.largest);
        let own = self
            .window
            .map(|w| (u64::from(w.limit) + u64::from(over), w.per));
        self.quota
            .iter()
            .map(|q| (u64::from(q.limit), q.per))
            .chain(own)
    }

    /// Whether the budget counts its sends: it has a quota window, or is a meter's.
    pub fn counts_sends(&self) -> bool {
        !self.quota.is_empty() || self.window.is_some()
    }

    /// How late a slot may still be used: half an interval (at backoff 1), and never less than
    /// 2 ms; a meter's, [`METER_LATE`]. A later slot is dropped by the pacer; quota windows
    /// keep this much more room, so that a slot used late cannot put one send too many in a
    /// window at the upstream.
    pub fn max_late(&self) -> Duration {
        if self.metered {
            return METER_LATE;
        }
        (self.interval / 2).max(Duration::from_millis(2))
    }

    /// How much longer than its `per` a quota window is kept: [`Rule::max_late`], the lateness
    /// the pacer still sends on, plus [`QUOTA_TRANSIT`], the way from the send to the
    /// upstream's count. A quota is a hard ceiling with no slack, so a window's first request
    /// must have reached the upstream before the request that would overfill it is sent.
    pub fn quota_margin(&self) -> Duration {
        self.max_late() + QUOTA_TRANSIT
    }

    /// Whether slots are reserved in batches at `backoff` (see [`Ask::most`]): only where
    /// the interval is shorter than [`BATCH_BELOW`]. Slower, a reservation per slot costs the
    /// store little, and each slot keeps a clock conversion of its own: one answer delayed in
    /// transit makes one slot late, not a batch of them.
    pub fn batches(&self, backoff: f64) -> bool {
        self.interval.mul_f64(backoff) < BATCH_BELOW
    }

    /// How long an instance whose waiter deserves no slot waits before asking again: half an
    /// interval, within 5 to 250 ms. Where slots go in batches, until just before the next
    /// slot is free (in `free_in`), since another instance may hold a batch until then. A
    /// meter's slot (a weighted rule) is as long as the asking request's estimate, which
    /// says nothing of when the next one is free (a refund brings it forward): until just
    /// before the time the store gave (`Budget::free_at`: the latest slot granted, or
    /// half-way to the free one).
    pub fn yield_for(&self, backoff: f64, free_in: Duration) -> Duration {
        let half = self.interval.mul_f64(backoff) / 2;
        let wait = if self.batches(backoff) {
            half.max(free_in.saturating_sub(YIELD_MARGIN))
        } else if self.cost > 1 {
            free_in.saturating_sub(YIELD_MARGIN)
        } else {
            half
        };
        wait.clamp(Duration::from_millis(5), Duration::from_millis(250))
    }
}

/// This instance's waiting requests of one class, as a reservation tells the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassQueue {
    /// The class.
    pub class: Class,
    /// How many wait (at least 1).
    pub count: u32,
    /// When the oldest started waiting.
    pub oldest: Instant,
    /// When the second oldest started waiting: it is the oldest once the oldest is served.
    pub next: Option<Instant>,
}

/// How long before the next free slot an instance that yielded asks again: room for the round
/// trip, so that a slot it deserves is granted on the beat, not late.
const YIELD_MARGIN: Duration = Duration::from_millis(10);

/// How late a meter's slot may still be used. A meter's slot is taken before the request's
/// own, which must follow it within this (see `pacing::meters`), and its interval is a unit's
/// (a millisecond at 1,000 tokens a second): half of one would drop most slots on a busy
/// host. A request sent this late lets at most this much of the meter's rate bunch into a
/// window (75 tokens of 90,000 a minute), and a meter's quota windows keep this much room.
pub const METER_LATE: Duration = Duration::from_millis(50);

/// What a quota window allows for the time between a request's send and its count at the
/// upstream (the socket write, the kernel, the network), which no lateness check sees. On a
/// loaded host, requests of three instances on one quota reached a loopback upstream up to
/// 3 ms after their slots; 10 ms keeps the window's edge clear of that and costs a 1 s window
/// 1% of its throughput.
pub const QUOTA_TRANSIT: Duration = Duration::from_millis(10);

/// Slots go in batches where the interval is shorter than this (200 requests/s and faster at
/// backoff 1); see [`Rule::batches`].
pub const BATCH_BELOW: Duration = Duration::from_millis(5);

/// The longest span of one batch of slots (see [`Ask::most`]): it bounds how long another
/// instance's request of the same class may wait behind a batch, and how far ahead of the
/// store's latest word (a throttle, a pause taken elsewhere) an instance's slots may reach.
pub const BATCH_HORIZON: Duration = Duration::from_millis(50);

/// A reservation request: this instance's waiting requests, every class that has any, most
/// urgent first. The store gives the next slot to the oldest waiting request of the class
/// that deserves it (the most urgent, unless a class with a share is owed one) over every
/// instance; when that request is this instance's, the slot is granted, otherwise the caller
/// yields. The caller hands its whole wait list every time; a store that can skip rewriting
/// an unchanged one does so on its own.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// This instance's waiting requests by class; not empty.
    pub queues: &'a [ClassQueue],
    /// Take no slot later than this.
    pub not_after: Option<Instant>,
    /// How many slots one answer may grant (at least 1): when this instance's oldest request
    /// deserves the next slot, its next requests of the same class may take the slots after
    /// it, as long as no other class is owed or more urgent anywhere, each slot still within
    /// every rule (beat, pause, quota windows, the vendor's budget, `not_after`), and the
    /// last at most [`BATCH_HORIZON`] after the first. One store round trip then serves a
    /// batch rather than one request.
    pub most: u32,
    /// What the request the slot is for costs in the budget's unit (a meter's tokens or
    /// points; 1 for a request budget): its slot is `cost` intervals long (see
    /// [`Rule::weighted`]). Above 1 only with `most = 1`: the requests after it cost what
    /// they cost.
    pub cost: u32,
}

/// The wait list `queues` as a store holds it once it granted `n` slots to the oldest
/// requests of `class`: those requests gone, the second oldest the oldest (the store knows
/// no later one), a class with none left gone.
pub fn after_grant(queues: &[ClassQueue], class: Class, n: u32) -> Vec<ClassQueue> {
    queues
        .iter()
        .filter_map(|q| {
            if q.class != class {
                return Some(*q);
            }
            let count = q.count.checked_sub(n).filter(|c| *c > 0)?;
            Some(ClassQueue {
                class,
                count,
                oldest: q.next.unwrap_or(q.oldest),
                next: None,
            })
        })
        .collect()
}

/// Requests of one class waiting over every instance: `(class, count, oldest wait)`.
pub type ClassWaiting = (Class, u32, Duration);

/// Slots granted to this instance's waiting requests of one class, oldest request first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The first slot.
    pub slot: Reservation,
    /// The class whose oldest requests they are for.
    pub class: Class,
    /// The batch's later slots, in order, under the same generation (empty for one slot):
    /// `slot.at` and these, converted alike, for the class's next requests.
    pub more: Vec<Instant>,
    /// Where the budget keeps quota windows and its store's timeline is not the local clock
    /// (postgres), each slot's mark in them, `slot` then `more`: its send's time as the store
    /// holds it, to take the send out by should the slot be given back unused (see
    /// [`Store::give_back`]). Empty elsewhere.
    pub sent: Vec<u64>,
}

/// A lockout: what halted a destination.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lockout {
    /// When it was taken (wall clock).
    #[serde(with = "humantime_serde")]
    pub since: SystemTime,
    /// The upstream status that caused it.
    pub status: u16,
    /// The request line that caused it (`GET https://host/path`).
    pub request: String,
    /// Which pacegate instance saw it.
    pub instance: String,
}

impl Lockout {
    /// A lockout taken now.
    pub fn new(status: u16, request: String, instance: String) -> Self {
        Self {
            since: SystemTime::now(),
            status,
            request,
            instance,
        }
    }
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

/// A pause a response asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pause {
    /// This long from now.
    For(Duration),
    /// Until this wall-clock instant: a date with no `Date` header to read it against, read
    /// against the store's clock (shared by every instance), not this one's.
    Until(SystemTime),
}

impl Pause {
    /// How long from `now` (the store's wall clock), at most `max`; `None` for an instant
    /// already past, or zero.
    pub fn resolve(self, now: SystemTime, max: Duration) -> Option<Duration> {
        let d = match self {
            Self::For(d) => d,
            Self::Until(t) => t.duration_since(now).ok()?,
        };
        (!d.is_zero()).then(|| d.min(max))
    }
}

/// Why a destination is paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PauseCause {
    /// A `Retry-After`.
    RetryAfter,
    /// The escalating block after a throttle without one.
    Block,
    /// The vendor's budget is spent (or down to the reserve) until its reset.
    Exhausted,
}

impl PauseCause {
    /// As status shows it, and as the postgres store keeps it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RetryAfter => "retry-after",
            Self::Block => "block",
            Self::Exhausted => "exhausted",
        }
    }

    /// The cause written as [`PauseCause::as_str`].
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::RetryAfter, Self::Block, Self::Exhausted]
            .into_iter()
            .find(|c| c.as_str() == name)
    }
}

/// What a vendor said about its budget, as a response carries it to the store.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    /// The header family it was read from.
    pub family: Family,
    /// Requests left in the window.
    pub remaining: u64,
    /// The window's limit, where given.
    pub limit: Option<u64>,
    /// When the window resets.
    pub reset: Pause,
    /// From 0 to 1: how much of a second past the reset a spent budget's pause lasts, so
    /// that the first request of the new window does not race the vendor's own clock.
    pub spread: f64,
    /// Requests of the budget sent and not yet answered when it was said (on the instance
    /// that read it): the vendor's `remaining` may not count them yet, so they count as
    /// taken from it, and are not spent twice. 0 for a view said of no request in flight.
    pub unanswered: u64,
}

impl Observation {
    /// How long a spent budget's pause runs past the reset: `spread` of
    /// [`schedule::RESET_JITTER`], in whole microseconds.
    pub fn jitter(&self) -> Duration {
        let us = schedule::RESET_JITTER.as_micros() as f64 * self.spread.clamp(0.0, 1.0);
        Duration::from_micros(us.floor() as u64)
    }
}

/// A verdict, as the budget sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A clean response; `success` (2xx, 3xx) also ends a block streak.
    Clean {
        /// A 2xx or 3xx (not, say, a 404).
        success: bool,
        /// The generation the request was reserved under: only the current one counts
        /// towards decay.
        generation: u64,
    },
    /// A throttle; `generation` is the one the request was reserved under.
    Throttled {
        /// The reservation's generation.
        generation: u64,
        /// The pause a `Retry-After` asks for: obeyed (up to `retry_after_max`), and the
        /// block streak does not advance.
        retry_after: Option<Pause>,
        /// A spent vendor budget's reset: paused until then, and the streak does not advance.
        reset: Option<Pause>,
        /// From -1 to 1: where in `[-jitter, +jitter]` a block falls.
        spread: f64,
    },
    /// A lockout.
    Lockout(Lockout),
    /// No verdict (another 5xx): only what the vendor said, if anything.
    None,
}

/// A reserved slot, as a local monotonic deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// Send no earlier than this.
    pub at: Instant,
    /// The backoff generation the slot was reserved under.
    pub generation: u64,
    /// How late `at` may already be, unseen: a store whose clock is converted (postgres)
    /// places the slot by the latest the database's instant may be on the local clock, and
    /// this is how much earlier it may truly be. Counted as lateness. Zero for the memory
    /// store.
    pub unseen_late: Duration,
}

impl Reservation {
    /// How late a request sent at `now` on this slot is, counting what the store could not
    /// see.
    pub fn lateness(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.at) + self.unseen_late
    }

    /// The latest instant a request may be sent on this slot where a slot may be used
    /// `max_late` late ([`Rule::max_late`]).
    pub fn send_by(&self, max_late: Duration) -> Instant {
        self.at + max_late.saturating_sub(self.unseen_late)
    }
}

/// What went wrong with a store. Only [`StoreError::Unreachable`] means the store is gone
/// (see [`StoreError::is_lost`]); the others are answers, or their absence, from a store that
/// is still there.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store cannot be reached: connection refused, reset or closed, or the server is
    /// shutting down.
    #[error("pacing store unreachable: {0}")]
    Unreachable(String),
    /// The store did not answer within this bound; it may still be there.
    #[error("pacing store did not answer within {}", humantime::format_duration(*.0))]
    Timeout(Duration),
    /// The store's schema is not the one this binary knows.
    #[error("pacing store schema: {0}")]
    Schema(String),
    /// The store answered, but refused the statement or answered something unexpected.
    #[error("pacing store refused: {0}")]
    Refused(String),
    /// The store cannot be set up as configured (its URL, its TLS settings).
    #[error("pacing store settings: {0}")]
    Settings(String),
    /// The store's own file (the memory store's state file) cannot be read or written.
    #[error("pacing store: {0}")]
    File(String),
    /// The store is away and `on_unavailable = "refuse"`: paced requests are refused until
    /// it is back.
    #[error("pacing store unavailable (on_unavailable = refuse); retry when it is back")]
    Unavailable,
    /// The store has been unreachable for this long, past `divide_for`: pacing alone is over
    /// and paced requests are refused until it is back.
    #[error("pacing store unreachable for {}, longer than this instance may pace alone (store.divide_for); retry when it is back", humantime::format_duration(Duration::from_secs(.0.as_secs())))]
    LongGone(Duration),
}

impl StoreError {
    /// Whether the store is gone (rather than slow, or odd): only then does an instance
    /// stop pacing on it.
    pub fn is_lost(&self) -> bool {
        matches!(self, Self::Unreachable(_))
    }
}

/// Why no slot was reserved.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReserveError {
    /// The destination is locked out.
    #[error("locked out")]
    Locked(Lockout),
    /// The first free slot is after the caller's limit; nothing was taken.
    #[error("no slot before the limit")]
    TooLate {
        /// When the first free slot is.
        slot: Instant,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The store did not answer within this bound; it may still be there. Try again.
    #[error("the store did not answer within {0:?}")]
    Busy(Duration),
    /// A request waiting on another instance deserves the next slot; nothing was taken. Ask
    /// again after this long, or sooner if this instance's waiting requests change.
    #[error("a request on another instance goes first")]
    Yield(Duration),
}

/// A budget as shown by status and metrics. The default is a fresh budget (backoff 1).
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetView {
    /// Interval multiplier.
    pub backoff: f64,
    /// Backoff generation.
    pub generation: u64,
    /// Clean responses in a row.
    pub clean_streak: u32,
    /// Time left in a pause.
    pub paused_for: Duration,
    /// Why it is paused (while `paused_for` is not zero).
    pub paused_by: Option<PauseCause>,
    /// The lockout, if locked.
    pub lock: Option<Lockout>,
    /// Throttles in a row that blocked the destination; the next block is `min × 2^this`.
    pub block_streak: u32,
    /// What the vendor last said, while its window lasts.
    pub vendor: Option<VendorView>,
}

/// The vendor's budget as the store holds it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VendorView {
    /// The header family it was read from.
    pub family: Family,
    /// Requests left, less the slots taken since it was said.
    pub remaining: u64,
    /// The window's limit, where given.
    pub limit: Option<u64>,
    /// Time left until the window resets.
    pub reset_in: Duration,
}

impl Default for BudgetView {
    fn default() -> Self {
        Self {
            backoff: 1.0,
            generation: 0,
            clean_streak: 0,
            paused_for: Duration::ZERO,
            paused_by: None,
            lock: None,
            block_streak: 0,
            vendor: None,
        }
    }
}

/// Where budgets live. Every method is atomic per destination; none holds anything (lock,
/// connection) after it returns, so waiting for a slot holds nothing.
#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// `memory` or `postgres`, for the `store` metric label.
    fn kind(&self) -> &'static str;

    /// What this instance knows of each budget from this store's answers, for a store shared
    /// with other instances (see [`known`]); `None` for a store of this instance alone.
    fn known(&self) -> Option<&Known> {
        None
    }

    /// Tells the store this instance's waiting requests and reserves the next slot of
    /// `destination` for one of them if one deserves it (see [`Ask`]).
    async fn reserve(
        &self,
        destination: &str,
        rule: &Rule,
        ask: Ask<'_>,
    ) -> Result<Grant, ReserveError>;

    /// Takes the next slot of `destination` for a request that has not queued, if it is due
    /// `now` (or a moment ahead, the memory store's `NEAR`, which the request waits out itself)
    /// and nothing waits for it anywhere: the common case of a destination below its rate,
    /// served without a round trip through the dispatcher. `None` takes nothing: the request
    /// queues as usual. Only a store that answers at once (memory) takes it; a store behind
    /// a network leaves every slot to the dispatcher.
    fn take_now(&self, _destination: &str, _rule: &Rule, _now: Instant) -> Option<Reservation> {
        None
    }

    /// Tells the store this instance's waiting requests without reserving: `queues` replaces
    /// what it said before (empty: nothing waits here any more).
    async fn wait_list(&self, destination: &str, queues: &[ClassQueue]) -> Result<(), StoreError>;

    /// Renews the lease of this instance's wait lists (the store keeps them while it runs,
    /// the fleet's `WAITER_LEASE` from the last renewal) and drops the lists whose lease ran
    /// out: an instance gone without a word. Called once a heartbeat. A store of one
    /// instance keeps no lease.
    async fn keep_waiting(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Drops this instance's wait lists (a clean shutdown).
    async fn forget_waiting(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Applies what the vendor said, if anything, then a verdict, and returns the budget
    /// after them.
    async fn record(
        &self,
        destination: &str,
        rule: &Rule,
        event: Event,
        vendor: Option<Observation>,
    ) -> Result<BudgetView, StoreError>;

    /// Puts slots this instance handed out without this store (pacing alone while it was
    /// lost) into its schedules: each budget's next slot comes no earlier than its mark, so
    /// that the shared beat starts after them. Only ever tightens, so instances that put
    /// theirs back in any order leave each schedule after the latest of them. Answered with
    /// a round trip even when there is nothing to put: the failover's proof that the store
    /// is back.
    async fn continue_after(&self, marks: &[(String, Instant)]) -> Result<(), StoreError>;

    /// Settles a request of `budget` (a meter's) that cost `units` more than it reserved
    /// (fewer where negative): its next slot moves by that many intervals at the backoff, later
    /// for a charge, earlier for a refund (see [`schedule::Budget::settle`]). Every instance's
    /// next request waits for what the request took, not for what was reserved for it.
    async fn settle(&self, budget: &str, rule: &Rule, units: i64) -> Result<(), StoreError>;

    /// Gives back `units` of a slot of `budget` (a meter's) reserved for `reserved`: all of
    /// them for a slot never used, or used by a request the vendor charged nothing for; the
    /// part of the estimate a request did not cost, once its cost is known. They are
    /// refunded as a settlement's are (see [`Store::settle`]), and, where the budget counts
    /// its sends in windows, taken out of its send (see [`schedule::Budget::unsend`]): a
    /// window then counts what the request cost, and a slot taken again after it went stale
    /// is not counted twice. `sent` is the slot's mark where its grant had one
    /// ([`Grant::sent`]); a mark or slot of another store's finds no send, and only refunds.
    async fn give_back(
        &self,
        budget: &str,
        rule: &Rule,
        slot: &Reservation,
        sent: Option<u64>,
        reserved: u32,
        units: u32,
    ) -> Result<(), StoreError>;

    /// Clears a lockout; returns the one cleared, if any.
    async fn unlock(&self, destination: &str) -> Result<Option<Lockout>, StoreError>;

    /// The budget as it stands.
    async fn view(&self, destination: &str) -> Result<BudgetView, StoreError>;

    /// The secret that keys the hash of a credential taken as a key: made once, the same for
    /// every instance that shares the store, so that they all name a key's budget alike.
    async fn key_secret(&self) -> Result<Vec<u8>, StoreError>;

    /// Deletes the budgets of `parent`'s keys (see [`KEY_MARK`]) that have been idle for
    /// `idle`: no slot, no quota window's send, no pause and no request waiting anywhere for
    /// that long. Returns how many went. Run by a background sweep, never on a request's way.
    async fn forget_keys(&self, parent: &str, idle: Duration) -> Result<u64, StoreError>;

    /// This instance no longer paces `budget` (a key gone idle): what it holds of it in
    /// memory beside the budget itself (caches) goes. The budget stays until
    /// [`Store::forget_keys`] finds it idle by the store's own measure, a pause included; a
    /// store whose memory is the budget (memory) keeps it until then.
    fn forget_budget(&self, _budget: &str) {}

    /// What status shows of every destination in `destinations`, in their order, in one
    /// round trip whatever their number: each budget ([`Store::view`]), every live
    /// instance's waiting requests by class, and its quota windows' use (the slots taken in
    /// each window that ends now, counting those reserved ahead, so at most the limit).
    async fn snapshot(&self, destinations: &[(&str, &Rule)]) -> Result<Vec<Snapshot>, StoreError>;
}

/// One destination as the store holds it, for status: see [`Store::snapshot`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// The budget.
    pub view: BudgetView,
    /// Every live instance's waiting requests, by class.
    pub waiting: Vec<ClassWaiting>,
    /// Slots taken in each quota window that ends now, in the rule's order.
    pub quota_used: Vec<u32>,
}

#[cfg(test)]
mod names {
    use super::halted_by;
    use crate::metrics::labels;

    #[test]
    fn a_budget_name_gives_its_labels_and_the_budget_that_halts_it() {
        assert_eq!(labels("api"), ["api", ""]);
        assert_eq!(labels("api/search"), ["api", "search"]);
        assert_eq!(labels("api/search#0f3a"), ["api", "search"]);
        assert_eq!(labels("api#example.com"), ["api", ""]);
        assert_eq!(halted_by("api/search#0f3a"), Some("api/search"));
        assert_eq!(halted_by("api/search"), None);
    }
}
