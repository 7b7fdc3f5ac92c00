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
mod dispatch;
mod exchange;
mod lane;
mod outgoing;
mod rate;
mod sniff;
mod status;
pub mod verdict;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use arc_swap::ArcSwap;

use crate::budget::{Lockout, Reservation, Rule, Store, StoreError};
use crate::class::{Class, Classes};
use crate::destination::{Destination, Pace, Routed, Routes};
use crate::fleet::{Fleet, Solo};
use crate::metrics::Metrics;
use crate::status::InstanceStatus;
pub use exchange::{ExchangeError, Exchanged, Note};
use lane::Lane;
pub use outgoing::Outgoing;

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

/// A routed destination: a handle to its lane, carried with the request. Cheap to clone.
#[derive(Clone)]
pub struct Route(Arc<Lane>);

impl Route {
    /// The destination's name.
    pub fn name(&self) -> &Arc<str> {
        &self.0.name
    }

    /// The destination's pacing keys as they are now (a reload may change them).
    pub fn pace(&self) -> PaceKeys {
        PaceKeys(self.0.keys())
    }

    /// How long a request of `class` may wait for a slot: the class's `max_wait` if it has
    /// one, else the destination's.
    pub fn max_wait(&self, class: Class) -> Duration {
        self.0.max_wait(class)
    }
}

/// A destination's keys as one reload left them; reads as its [`Pace`].
pub struct PaceKeys(Arc<lane::Keys>);

impl std::ops::Deref for PaceKeys {
    type Target = Pace;

    fn deref(&self) -> &Pace {
        &self.0.pace
    }
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Route").field(&self.0.name).finish()
    }
}

/// A granted slot. Holding it holds the destination's concurrency permit and counts the
/// request as in flight; drop it when the exchange is over.
pub struct Admission {
    lane: Arc<Lane>,
    /// The class the slot was granted to.
    pub class: Class,
    /// The slot it was granted, and the backoff generation it was reserved under.
    slot: Reservation,
    /// How long the request waited for its slot.
    pub waited: Duration,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.lane.in_flight.fetch_sub(1, Ordering::Relaxed);
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
        let routes = destinations
            .iter()
            .map(|d| {
                let lane = Route(Arc::new(Lane::new(d, classes.clone())));
                (d.hosts.clone(), d.ports.clone(), lane)
            })
            .collect();
        Self {
            routes: ArcSwap::from_pointee(routes),
            classes,
            store,
            fleet: Arc::new(Solo),
            metrics,
            instance,
            snapshot_taken: tokio::sync::Mutex::new(None),
            stop: CancellationToken::new(),
        }
    }

    /// Paces as one of `fleet` (a shared store's instances) rather than alone.
    pub fn with_fleet(mut self, fleet: Arc<dyn Fleet>) -> Self {
        self.fleet = fleet;
        self
    }

    fn lanes(&self) -> Vec<Arc<Lane>> {
        self.routes.load().all().map(|r| r.0.clone()).collect()
    }

    /// Loads each budget (a lockout from before a restart applies at once) and spawns one
    /// dispatcher per destination.
    pub async fn start(&self) -> Result<(), StoreError> {
        self.announce();
        for lane in self.lanes() {
            self.open_lane(&lane).await?;
        }
        Ok(())
    }

    /// Tells the store every destination's rule (instances compare them).
    fn announce(&self) {
        let rules: Vec<(String, Rule)> = self
            .lanes()
            .iter()
            .map(|l| (l.name.to_string(), l.keys().rule.clone()))
            .collect();
        self.fleet.announce(&rules);
    }

    async fn open_lane(&self, lane: &Arc<Lane>) -> Result<(), StoreError> {
        lane.note(self.store.view(&lane.name).await?);
        tokio::spawn(dispatch::dispatch(
            lane.clone(),
            self.store.clone(),
            self.metrics.clone(),
            self.stop.clone(),
        ));
        Ok(())
    }

    /// Takes a reloaded config's destinations: new ones get a lane, removed ones stop taking
    /// requests (those waiting are still served), changed ones take their new keys for the
    /// next slot. Every budget (backoff, streaks, pauses, lockouts, quota windows) lives in
    /// the store under the destination's name and is kept; so are the queues and the
    /// requests in flight. Classes are not reloaded.
    pub async fn reconfigure(&self, destinations: &[Destination]) -> Result<Changes, StoreError> {
        let before = self.routes.load_full();
        let mut changes = Changes::default();
        let mut routes = Vec::with_capacity(destinations.len());
        for d in destinations {
            let existing = before.all().find(|r| *r.0.name == *d.name).cloned();
            let route = match existing {
                Some(route) => {
                    if route.0.keys().pace != d.pace {
                        route.0.reconfigure(&d.pace);
                        changes.changed.push(d.name.clone());
                    }
                    route
                }
                None => {
                    let route = Route(Arc::new(Lane::new(d, self.classes.clone())));
                    self.metrics
                        .init_destinations(std::iter::once(d.name.as_str()));
                    self.open_lane(&route.0).await?;
                    changes.added.push(d.name.clone());
                    route
                }
            };
            routes.push((d.hosts.clone(), d.ports.clone(), route));
        }
        self.routes.store(Arc::new(routes.into_iter().collect()));
        for gone in before
            .all()
            .filter(|r| !destinations.iter().any(|d| *d.name == *r.0.name))
        {
            gone.0.retire();
            changes.removed.push(gone.0.name.to_string());
        }
        self.announce();
        Ok(changes)
    }

    /// Refuses every waiting request and stops the dispatchers.
    pub fn stop(&self) {
        self.stop.cancel();
        for lane in self.lanes() {
            lane.refuse_all(&PaceError::ShuttingDown);
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
            .find(|r| *r.0.name == *name)
            .cloned()
    }

    /// The priority classes.
    pub fn classes(&self) -> &Classes {
        &self.classes
    }

    /// Clears a lockout. Returns the lockout cleared, or `None` if the destination was not
    /// locked.
    pub async fn unlock(&self, destination: &str) -> Result<Option<Lockout>, UnlockError> {
        let route = self
            .destination(destination)
            .ok_or_else(|| UnlockError::Unknown(destination.to_owned()))?;
        let cleared = self.store.unlock(destination).await?;
        route.0.note(self.store.view(destination).await?);
        if let Some(l) = &cleared {
            tracing::warn!(destination, was = %l.request, status = l.status, "lockout cleared by an operator");
        }
        Ok(cleared)
    }

    /// The live instances sharing the store (empty for a store of one instance).
    pub async fn instances(&self) -> Result<Vec<InstanceStatus>, StoreError> {
        self.fleet.instances().await
    }
}

#[cfg(test)]
mod any_config;
#[cfg(test)]
mod tests;
