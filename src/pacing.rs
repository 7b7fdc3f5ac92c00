//! The pacer: every request to a destination waits for a slot, and every response adjusts the
//! pace.
//!
//! Each destination has a *lane* (`pacing::lane`): a queue of waiting requests (one FIFO per
//! class) and one dispatcher task (`pacing::dispatch`). The dispatcher asks the store for the next
//! slot only when someone is waiting, sleeps until it (holding no lock and no store
//! connection), and hands it to the request the store granted it for. Slots are thus handed
//! to requests rather than reserved by each request on arrival, so the order in which
//! waiting requests are served over every instance is the store's to decide.
//!
//! Routing yields a [`Route`], a handle to the destination's lane that travels with the
//! request: nothing looks a destination up by name after that.
//!
//! The proxy hands the pacer a request and the upstream client ([`Pacer::exchange`]) and gets
//! a response or a refusal: the slot, the checks that it is still good to send on, the verdict
//! and the retry of a throttled request are decided here only. Parses no client request and
//! opens no socket.

mod admit;
mod advertise;
mod dispatch;
mod exchange;
mod keys;
mod lane;
mod meters;
mod observe;
mod outgoing;
mod rate;
mod sniff;
mod status;
pub mod verdict;
mod walls;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use arc_swap::ArcSwap;

use crate::budget::{Lockout, Reservation, Rule, Store, StoreError, KEY_MARK};
use crate::class::{Class, Classes};
use crate::destination::{group_of, Destination, Group, KeyFrom, Meter, Pace, Routed, Routes};
use crate::fleet::{Fleet, Solo};
use crate::metrics::Metrics;
pub use advertise::{Advertised, Paced};
pub use exchange::{ExchangeError, Exchanged, Note};
pub use keys::Asking;
use lane::Lane;
pub use outgoing::{BodyError, Departure, Outgoing};

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
    /// A new key past the budget's `max_keys`.
    #[error("budget `{budget}` keeps {max_keys} keys already")]
    TooManyKeys {
        /// The budget split by key.
        budget: String,
        /// Its `max_keys`.
        max_keys: usize,
        /// Its `key_idle`: how long until an idle key makes room.
        key_idle: Duration,
    },
    /// A new key past the `max_keys_per_client` of the client that would make it.
    #[error("budget `{budget}` keeps {limit} keys made by {client} already")]
    ClientKeys {
        /// The budget split by key.
        budget: String,
        /// Who: `proxy user NAME` or `client ADDRESS`.
        client: String,
        /// Its `max_keys_per_client`.
        limit: usize,
        /// Its `key_idle`: how long until an idle key makes room.
        key_idle: Duration,
    },
    /// The store failed.
    #[error("{0}")]
    Store(#[from] StoreError),
    /// pacegate is shutting down.
    #[error("pacegate is shutting down")]
    ShuttingDown,
}

/// Why a lockout could not be cleared.
#[derive(Debug, thiserror::Error)]
pub enum UnlockError {
    /// No destination has this name.
    #[error("no destination named `{0}`")]
    Unknown(String),
    /// The store could not clear it.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What a reload changed, by destination name.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Changes {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub changed: Vec<String>,
}

/// A routed destination: a handle to the lane of the budget a request takes (the
/// destination's own until [`Route::pick`] finds its group), carried with the request. Cheap
/// to clone.
#[derive(Clone)]
pub struct Route {
    lane: Arc<Lane>,
    lanes: Arc<Lanes>,
}

/// A destination's lanes: its own budget's, one per group, and one per meter.
pub(crate) struct Lanes {
    own: Arc<Lane>,
    groups: Vec<Group>,
    /// `groups[i]`'s lane.
    group_lanes: Vec<Arc<Lane>>,
    /// The destination's meters: what a request of its own budget takes, or of a group with
    /// none of its own.
    meters: Meters,
    /// `groups[i]`'s meters, where it has its own.
    group_meters: Vec<Meters>,
    /// What a meter may read of a request body to estimate its cost.
    max_body: usize,
    /// Whether a request's body may be read before its slot: the destination or a group has
    /// a meter, or either is keyed by a field of the body (`json:FIELD`). A reload makes new
    /// `Lanes`, so this follows the config.
    reads_body: bool,
    /// Whether the destination or a group is keyed by a field of the body.
    keyed_by_body: bool,
}

/// The meters a request of one budget takes, each with its lane.
pub(crate) struct Meters {
    list: Vec<(Meter, Arc<Lane>)>,
    /// Each meter's slot length for its requests (estimate times interval), in µs, as a
    /// moving average: the meter with the longest binds (see `Pacer::take_meters`).
    lengths: Vec<std::sync::atomic::AtomicU64>,
    /// The request's own budget bound the latest request: its meters' slots, taken before
    /// its own, went stale waiting for it. The next request takes its meters at its own
    /// slot instead (see `Pacer::retake_meters`), until a meter binds again.
    own_binds: std::sync::atomic::AtomicBool,
}

impl Meters {
    /// The meter that binds, after a request whose slot of meter `i` is `lengths[i]` long:
    /// the one whose slots are longest on average (an eighth for each request), as it takes
    /// the largest share of its rate. A request waits for its slot first.
    fn binding(&self, lengths: impl Iterator<Item = Duration>) -> usize {
        let mut longest = (0, 0);
        for (i, (average, length)) in self.lengths.iter().zip(lengths).enumerate() {
            let us = u64::try_from(length.as_micros()).unwrap_or(u64::MAX);
            let before = average.load(Ordering::Relaxed);
            let now = match before {
                0 => us,
                _ => before - before / 8 + us / 8,
            };
            average.store(now, Ordering::Relaxed);
            if now > longest.1 {
                longest = (i, now);
            }
        }
        longest.0
    }

    /// Each meter's lane.
    fn lanes(&self) -> impl Iterator<Item = &Arc<Lane>> {
        self.list.iter().map(|(_, lane)| lane)
    }

    /// `meters` of `d`, or of its group `g`, each with a new lane.
    fn new(d: &Destination, g: Option<&Group>, meters: &[Meter], classes: &Arc<Classes>) -> Self {
        Self {
            list: meters
                .iter()
                .map(|m| (m.clone(), Arc::new(Lane::meter(d, g, m, classes.clone()))))
                .collect(),
            lengths: meters
                .iter()
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
            own_binds: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

impl Lanes {
    fn new(d: &Destination, classes: &Arc<Classes>) -> Self {
        let keyed_by_body = std::iter::once(&d.pace)
            .chain(d.groups.iter().map(|g| &g.pace))
            .any(|p| matches!(p.key, Some(crate::destination::KeyFrom::Json(_))));
        Self {
            own: Arc::new(Lane::new(d, classes.clone())),
            groups: d.groups.clone(),
            group_lanes: d
                .groups
                .iter()
                .map(|g| Arc::new(Lane::group(d, g, classes.clone())))
                .collect(),
            meters: Meters::new(d, None, &d.meters, classes),
            group_meters: d
                .groups
                .iter()
                .map(|g| Meters::new(d, Some(g), &g.meters, classes))
                .collect(),
            max_body: d.max_body,
            reads_body: keyed_by_body
                || !d.meters.is_empty()
                || d.groups.iter().any(|g| !g.meters.is_empty()),
            keyed_by_body,
        }
    }

    /// Every lane: the destination's own first, then its groups', then its meters' and its
    /// groups' meters'.
    fn all(&self) -> impl Iterator<Item = &Arc<Lane>> {
        std::iter::once(&self.own).chain(&self.group_lanes).chain(
            std::iter::once(&self.meters)
                .chain(&self.group_meters)
                .flat_map(Meters::lanes),
        )
    }

    /// Every lane but `lane`: what a lockout seen on `lane` halts too.
    fn others<'a>(&'a self, lane: &'a Arc<Lane>) -> impl Iterator<Item = &'a Arc<Lane>> {
        self.all().filter(move |l| !Arc::ptr_eq(l, lane))
    }

    /// The lane of the group whose `resource` is `named`, the vendor's name for a bucket.
    fn named(&self, named: &str) -> Option<&Arc<Lane>> {
        self.groups
            .iter()
            .position(|g| g.resource.as_deref() == Some(named))
            .map(|i| &self.group_lanes[i])
    }
}

impl Route {
    fn of(lanes: Arc<Lanes>) -> Self {
        Self {
            lane: lanes.own.clone(),
            lanes,
        }
    }

    /// The budget's name: the destination's, `DESTINATION/GROUP`, or `PARENT#KEY` for a
    /// key's.
    pub fn name(&self) -> &Arc<str> {
        &self.lane.name
    }

    /// The budget's name as metrics know it: a key's counts as its parent's.
    pub fn label(&self) -> &Arc<str> {
        self.lane.label()
    }

    /// The budget's pacing keys as they are now (a reload may change them).
    pub fn pace(&self) -> PaceKeys {
        PaceKeys(self.lane.keys())
    }

    /// How long a request of `class` may wait for a slot by `pace`, this route's keys: the
    /// class's `max_wait` if it has one, else the budget's.
    pub fn max_wait(&self, class: Class, pace: &PaceKeys) -> Duration {
        self.lane.max_wait_by(class, &pace.0)
    }

    /// Whether the destination's identical GET and HEAD requests in flight share one fetch
    /// (`cache = true`: collapsed forwarding, which the proxy does).
    pub fn collapses(&self) -> bool {
        self.lane.keys().pace.cache
    }

    /// What `request`'s budget key is made of where the budget (of its group, if one takes
    /// it) is split by something other than its URI: requests that share one fetch share it.
    pub fn key_material(&self, request: &Outgoing) -> Option<String> {
        let head = request.head();
        let route = self.pick(head.method.as_str(), head.uri.path());
        let keys = route.lane.keys();
        match keys.pace.key.as_ref()? {
            KeyFrom::Host | KeyFrom::Json(_) => None,
            KeyFrom::ProxyUser => request.user().map(ToOwned::to_owned),
            KeyFrom::Header(name) => head
                .headers
                .get(name)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
        }
    }

    /// Whether a group of the destination names a vendor's bucket (`resource`), so that
    /// responses are worth looking at for the bucket they name.
    pub(crate) fn names_buckets(&self) -> bool {
        self.lanes.groups.iter().any(|g| g.resource.is_some())
    }

    /// The meters a request of this route's budget takes (a key's, its parent's): its
    /// group's own, else the destination's.
    pub(crate) fn meters(&self) -> &Meters {
        let lane = self.lane.parent.as_ref().unwrap_or(&self.lane);
        self.lanes
            .group_lanes
            .iter()
            .position(|l| Arc::ptr_eq(l, lane))
            .map(|i| &self.lanes.group_meters[i])
            .filter(|m| !m.list.is_empty())
            .unwrap_or(&self.lanes.meters)
    }

    /// The route of the group a request with `method` and `path` belongs to (see
    /// [`crate::destination::group_of`]), or this one's own budget: this route itself where
    /// it is that already, as routed, so that most requests write no reference count on
    /// lanes every request shares.
    pub fn pick(&self, method: &str, path: &str) -> std::borrow::Cow<'_, Route> {
        use std::borrow::Cow;
        match group_of(&self.lanes.groups, method, path) {
            Some(i) => Cow::Owned(Route {
                lane: self.lanes.group_lanes[i].clone(),
                lanes: self.lanes.clone(),
            }),
            None if Arc::ptr_eq(&self.lane, &self.lanes.own) => Cow::Borrowed(self),
            None => Cow::Owned(Route::of(self.lanes.clone())),
        }
    }
}

/// A destination's keys as one reload left them; reads as its [`Pace`].
pub struct PaceKeys(Arc<lane::Keys>);

impl PaceKeys {
    /// The lane's keys these are.
    pub(crate) fn keys(&self) -> &lane::Keys {
        &self.0
    }
}

impl std::ops::Deref for PaceKeys {
    type Target = Pace;

    fn deref(&self) -> &Pace {
        &self.0.pace
    }
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Route").field(&self.lane.name).finish()
    }
}

/// A granted slot. Holding it holds the destination's concurrency permit and counts the
/// request as in flight; drop it when the exchange is over.
pub struct Admission {
    lane: Arc<Lane>,
    /// Every lane of its destination: a lockout halts them all.
    lanes: Arc<Lanes>,
    /// The class the slot was granted to.
    pub class: Class,
    /// The slot it was granted, and the backoff generation it was reserved under.
    slot: Reservation,
    /// How late the slot may be used ([`crate::budget::Rule::max_late`]), by the keys it was
    /// granted under.
    max_late: Duration,
    /// How long the request waited for its slot.
    pub waited: Duration,
    /// When it was counted sent: the clock as read once its slot was due. An admission is
    /// used at once (sent, or found too late), so its lateness counts from this reading.
    sent: Instant,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Admission {
    /// The latest instant its request may take an upstream connection and still go on its
    /// slot: the deadline the upstream client is given for one.
    fn send_by(&self) -> Instant {
        self.slot.send_by(self.max_late)
    }

    /// How late its slot is at `now`, where later than it may be used: sent then, the
    /// request would bunch with the next slots, and could crowd a quota window, which allows
    /// a slot used up to [`crate::budget::Rule::max_late`] late and no more.
    fn too_late_at(&self, now: Instant) -> Option<Duration> {
        let late = self.slot.lateness(now);
        (late > self.max_late).then_some(late)
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.lane.tally.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The pacer of every configured destination.
pub struct Pacer {
    /// Swapped whole by a reload; a request keeps the route it was given.
    routes: ArcSwap<Routes<Route>>,
    classes: Arc<Classes>,
    store: Arc<dyn Store>,
    /// This instance among the others sharing the store.
    fleet: Arc<dyn Fleet>,
    metrics: Arc<Metrics>,
    instance: String,
    /// When the store's last snapshot for status was taken (see `pacing::status`); held
    /// while one is taken, so that readers at once share it.
    snapshot_taken: tokio::sync::Mutex<Option<Instant>>,
    /// Keys the hash that names a credential's key, read from the store on first need.
    key_secret: tokio::sync::OnceCell<ring::hmac::Key>,
    stop: CancellationToken,
    /// Set before `stop` is cancelled: what every request looks at. A token's
    /// `is_cancelled` takes its lock, one that every request on every worker would share.
    stopped: std::sync::atomic::AtomicBool,
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
        let routes: Routes<Route> = destinations
            .iter()
            .map(|d| {
                let route = Route::of(Arc::new(Lanes::new(d, &classes)));
                (d.hosts.clone(), d.ports.clone(), route)
            })
            .collect();
        metrics.init_destinations(routes.all().flat_map(|r| r.lanes.all()).map(|l| &*l.name));
        Self {
            routes: ArcSwap::from_pointee(routes),
            classes,
            store,
            fleet: Arc::new(Solo),
            metrics,
            instance,
            snapshot_taken: tokio::sync::Mutex::new(None),
            key_secret: tokio::sync::OnceCell::new(),
            stop: CancellationToken::new(),
            stopped: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Paces as one of `fleet` (a shared store's instances) rather than alone.
    pub fn with_fleet(mut self, fleet: Arc<dyn Fleet>) -> Self {
        self.fleet = fleet;
        self
    }

    /// Every budget's lane, groups' included.
    fn lanes(&self) -> Vec<Arc<Lane>> {
        self.routes
            .load()
            .all()
            .flat_map(|r| r.lanes.all().cloned())
            .collect()
    }

    /// Loads each budget (a lockout from before a restart applies at once) and spawns one
    /// dispatcher per budget.
    pub async fn start(&self) -> Result<(), StoreError> {
        self.announce();
        for lane in self.lanes() {
            self.open_lane(&lane).await?;
        }
        Ok(())
    }

    /// Tells the store every destination's rule (instances compare them).
    /// A budget split by key is told twice: its own rule (the keys' total, with
    /// `total_rate`) under its name, and its keys' rule under `NAME#`, which governs every
    /// key (see [`crate::fleet::drift::Agreement::governing`]).
    fn announce(&self) {
        let mut rules: Vec<(String, Rule)> = Vec::new();
        for l in self.lanes() {
            rules.push((l.name.to_string(), l.keys().rule.clone()));
            if l.is_split() {
                rules.push((format!("{}{KEY_MARK}", l.name), l.key_keys().rule.clone()));
            }
        }
        self.fleet.announce(&rules);
    }

    async fn open_lane(&self, lane: &Arc<Lane>) -> Result<(), StoreError> {
        lane.note(self.store.view(&lane.name).await?);
        self.dispatch(lane);
        Ok(())
    }

    /// Starts `lane`'s dispatcher. Owned by the pacer: it ends with the pacer's `stop`.
    fn dispatch(&self, lane: &Arc<Lane>) {
        tokio::spawn(dispatch::dispatch(
            lane.clone(),
            self.store.clone(),
            self.metrics.clone(),
            self.stop.clone(),
        ));
    }

    /// Takes a reloaded config's destinations and their groups: new budgets get a lane,
    /// removed ones stop taking requests (those waiting are still served), changed ones take
    /// their new keys for the next slot. Every budget (backoff, streaks, pauses, lockouts,
    /// quota windows) lives in the store under its name and is kept; so are the queues and
    /// the requests in flight. Classes are not reloaded.
    pub async fn reconfigure(&self, destinations: &[Destination]) -> Result<Changes, StoreError> {
        let old: Vec<Arc<Lane>> = self.lanes();
        let mut changes = Changes::default();
        let mut routes = Vec::with_capacity(destinations.len());
        let mut kept = Vec::new();
        for d in destinations {
            let mut lanes = Lanes::new(d, &self.classes);
            let wanted = std::iter::once((&mut lanes.own, &d.pace))
                .chain(
                    lanes
                        .group_lanes
                        .iter_mut()
                        .zip(d.groups.iter().map(|g| &g.pace)),
                )
                .chain(
                    std::iter::once(&mut lanes.meters)
                        .chain(&mut lanes.group_meters)
                        .flat_map(|m| m.list.iter_mut().map(|(m, lane)| (lane, &m.pace))),
                )
                // Collected: the adapters' closures would be held across the awaits below.
                .collect::<Vec<_>>();
            for (lane, pace) in wanted {
                match old.iter().find(|l| l.name == lane.name) {
                    Some(existing) => {
                        if existing.keys().pace != *pace {
                            existing.reconfigure(pace);
                            changes.changed.push(existing.name.to_string());
                        }
                        *lane = existing.clone();
                    }
                    None => {
                        self.metrics.init_destinations(std::iter::once(&*lane.name));
                        self.open_lane(lane).await?;
                        changes.added.push(lane.name.to_string());
                    }
                }
                kept.push(lane.name.clone());
            }
            routes.push((d.hosts.clone(), d.ports.clone(), Route::of(Arc::new(lanes))));
        }
        self.routes.store(Arc::new(routes.into_iter().collect()));
        for gone in old.iter().filter(|l| !kept.contains(&l.name)) {
            gone.retire();
            changes.removed.push(gone.name.to_string());
        }
        self.announce();
        Ok(changes)
    }

    /// The pacer's chores off the requests' way, until [`Pacer::stop`]: the store's snapshot
    /// kept current for the gauges (what only the store knows: every instance's waiting
    /// requests, quota windows), and keys gone idle forgotten here and in the store.
    pub async fn keep_up(self: Arc<Self>) {
        tokio::join!(self.clone().keep_current(), self.keep_keys());
    }

    /// Refuses every waiting request and stops the dispatchers.
    pub fn stop(&self) {
        self.stopped
            .store(true, std::sync::atomic::Ordering::Release);
        self.stop.cancel();
        for lane in self.lanes() {
            lane.refuse_all(&PaceError::ShuttingDown);
            for key in lane.key_lanes() {
                key.refuse_all(&PaceError::ShuttingDown);
            }
        }
    }

    /// Where a normalised host and port go, `default_ports` being the request's (see
    /// [`Routes::route`]).
    pub fn route(&self, host: &str, port: u16, default_ports: &[u16]) -> Routed<Route> {
        self.routes.load().route(host, port, default_ports).cloned()
    }

    /// The destination named `name` (for operators' commands, which name it).
    pub fn destination(&self, name: &str) -> Option<Route> {
        self.routes
            .load()
            .all()
            .find(|r| *r.lane.name == *name)
            .cloned()
    }

    /// The priority classes.
    pub fn classes(&self) -> &Classes {
        &self.classes
    }

    /// Clears a destination's lockout, on its own budget and every group's (a group's budget
    /// name, `NAME/GROUP`, names its destination). Returns the lockout cleared, or `None` if
    /// the destination was not locked.
    pub async fn unlock(&self, destination: &str) -> Result<Option<Lockout>, UnlockError> {
        let destination = destination.split('/').next().unwrap_or(destination);
        let route = self
            .destination(destination)
            .ok_or_else(|| UnlockError::Unknown(destination.to_owned()))?;
        let mut cleared = None;
        for lane in route.lanes.all() {
            let was = self.store.unlock(&lane.name).await?;
            // Its keys share its lockout channel: this clears theirs too.
            lane.note(self.store.view(&lane.name).await?);
            cleared = cleared.or(was);
        }
        if let Some(l) = &cleared {
            tracing::warn!(destination, was = %l.request, status = l.status, "lockout cleared by an operator");
        }
        Ok(cleared)
    }
}

#[cfg(test)]
mod any_config;
#[cfg(test)]
mod tests;
