//! One fetch for many: while a GET or HEAD to a destination with `cache = true` is on its
//! way, an identical one waits for it and takes no slot. Identical: the same method and
//! absolute URI, the same budget key, and, once the first response says which, the same
//! values of the headers its `Vary` names.
//!
//! What can happen to a request that finds one in flight is named, as a cache lock should
//! name it (so that no waiter hangs, and an uncacheable answer never serialises a burst):
//!
//! - the leader's response head is shareable (storable in a shared cache, by RFC 9111 as
//!   `http-cache-semantics` reads it, with no `Set-Cookie`): the waiter gets it, its body
//!   streamed as it arrives (a [`Tape`] every reader follows; past `max_object`, one that
//!   lets go of what every reader has had, and is not kept);
//! - it is not: the waiters go on their own, each through its own slot, and the URI is not
//!   collapsed for [`NOT_COLLAPSED_FOR`], so that the next burst is not serialised either;
//! - the leader failed (no response, a refusal) or its request was sent and no head came
//!   within `[cache] lead_timeout`: one waiter becomes the leader, the others wait for it.
//!
//! A verdict on the leader's response is applied once, by the leader's exchange: the waiters
//! get the response as it came, or go through the pacer themselves.
//!
//! The leader's fetch records the body ([`Recording`]): one the vendor cuts short is asked
//! for again, through a slot, and goes on where it was cut, for an entity its validators
//! name. A shared response whose body came whole, within `max_object`, is kept (`kept`: in
//! memory, within `[cache] memory`, the least used evicted first, and on disk with `[cache]
//! dir`): while it is fresh by RFC 9111, a request for it is answered from there and takes
//! no slot. A stale one is asked for again on its validators: a 304 refreshes it, anything
//! else replaces it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{HeaderMap, CACHE_CONTROL, SET_COOKIE, VARY};
use http::request::Parts;
use http::{Method, Response, StatusCode};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;

mod disk;
mod kept;
mod recording;
mod tape;

use crate::config::CacheConfig;
use crate::metrics::Metrics;
use crate::pacing::{Departure, Exchanged, Outgoing, Route};
use crate::upstream::ProxyBody;
use disk::Disk;
pub use disk::DiskError;
use kept::{ByBytes, Entry, Evictions};
pub use recording::{Cut, Recording};
use tape::{Shared, Tape};

/// How long a URI whose response could not be shared is not collapsed.
pub const NOT_COLLAPSED_FOR: Duration = Duration::from_secs(120);

/// The most URIs remembered as not collapsed at once; past it, the oldest are forgotten.
const NOT_COLLAPSED_MAX: usize = 10_000;

/// The `Cache-Status` (RFC 9211) pacegate adds to a collapsing destination's responses.
pub mod status {
    /// The leader's, or a request fetched on its own: no entry was found.
    pub const FETCHED: &str = "pacegate; fwd=uri-miss";
    /// The leader's, shared and kept once its body is whole.
    pub const STORED: &str = "pacegate; fwd=uri-miss; stored";
    /// The leader's where a stale entry was fetched again, and kept in its place.
    pub const REFRESHED: &str = "pacegate; fwd=stale; stored";
    /// Answered from a fresh entry: no slot, nothing sent.
    pub const HIT: &str = "pacegate; hit";
    /// A stale entry the vendor said, through a slot, had not changed: served from memory.
    pub const REVALIDATED: &str = "pacegate; fwd=stale; fwd-status=304";
    /// A waiter given the leader's response.
    pub const COLLAPSED: &str = "pacegate; fwd=uri-miss; collapsed";
    /// A waiter released to fetch on its own: the response could not be shared.
    pub const RELEASED: &str = "pacegate; fwd=uri-miss; detail=uncacheable";
    /// A request of a method that is not collapsed.
    pub const METHOD: &str = "pacegate; fwd=method";

    /// What pacegate's `Cache-Status` item says, in a word, for the request log: `hit`,
    /// `collapsed`, `stored`, `refreshed`, `revalidated`, `uncacheable`, `miss` or `method`;
    /// `None` for another cache's item.
    pub fn word(item: &[u8]) -> Option<&'static str> {
        Some(match item {
            b if b == HIT.as_bytes() => "hit",
            b if b == COLLAPSED.as_bytes() => "collapsed",
            b if b == STORED.as_bytes() => "stored",
            b if b == REFRESHED.as_bytes() => "refreshed",
            b if b == REVALIDATED.as_bytes() => "revalidated",
            b if b == RELEASED.as_bytes() => "uncacheable",
            b if b == FETCHED.as_bytes() => "miss",
            b if b == METHOD.as_bytes() => "method",
            _ => return None,
        })
    }
}

/// The requests in flight that others may wait for, and the URIs that are not collapsed.
pub struct Collapser {
    /// `[cache]` as it is now: a reload changes it in place ([`Collapser::reconfigure`]).
    config: arc_swap::ArcSwap<CacheConfig>,
    flights: Mutex<HashMap<Arc<str>, Arc<Flight>>>,
    not_collapsed: Mutex<HashMap<Arc<str>, Instant>>,
    /// Bytes held in the tapes of responses still being read, against `[cache] memory`.
    held: Arc<AtomicUsize>,
    /// Responses kept whole, by key and the values of the headers they vary by, weighed in
    /// bytes against `[cache] memory`.
    kept: quick_cache::sync::Cache<
        Arc<str>,
        Arc<Entry>,
        ByBytes,
        quick_cache::DefaultHashBuilder,
        Evictions,
    >,
    /// The disk tier, where `[cache] dir` is set.
    disk: arc_swap::ArcSwapOption<Disk>,
    /// `pacegate_cache_bytes{tier="flight"}`, set as each chunk is recorded: looked up once.
    flight_bytes: prometheus::IntGauge,
    /// The destinations whose requests were looked up.
    looking: parking_lot::RwLock<std::collections::HashSet<Arc<str>>>,
    /// The headers a key's responses last said they vary by (`Vary`): a request is looked up,
    /// and collapsed, with its own values of them, so that each variant is kept apart.
    varies: quick_cache::sync::Cache<Arc<str>, Arc<[String]>>,
    metrics: Arc<Metrics>,
}

/// One request in flight, and what became of it.
struct Flight {
    phase: watch::Sender<Phase>,
    /// When the leader's request left for the upstream (stamped by its exchange).
    departure: Arc<Departure>,
    /// The waiters that have not yet made their reader of its tape.
    waiting: Arc<AtomicUsize>,
}

impl Flight {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            phase: watch::channel(Phase::Waiting).0,
            departure: Arc::new(Departure::default()),
            waiting: Arc::default(),
        })
    }
}

#[derive(Clone)]
enum Phase {
    /// No head yet.
    Waiting,
    /// The head, to share, and its body on a tape.
    Head(Arc<Shared>),
    /// Not shareable: every waiter goes on its own.
    Released,
    /// The leader failed or gave up: one waiter takes over.
    Failed,
}

/// What a request to a collapsing destination is, before it is sent.
pub enum Joined {
    /// Answered from a fresh entry.
    Hit(Response<ProxyBody>),
    /// Not collapsed (a method other than GET and HEAD, a body, a URI lately unshareable).
    Alone,
    /// The first: it goes, and others may wait for it.
    Lead(Lead),
    /// Another is in flight: wait for it.
    Wait(Wait),
}

/// A request that leads a flight: its exchange's answer is shared by [`Lead::answer`]. Dropped
/// without answering (its client gone), the flight fails, and a waiter takes over.
pub struct Lead {
    collapser: Arc<Collapser>,
    /// The request's key without the values of the headers its responses vary by.
    base: Arc<str>,
    key: Arc<str>,
    flight: Arc<Flight>,
    answered: bool,
    /// An entry was kept, but stale: this fetch replaces it, or, answered 304 to the
    /// conditions it asks with ([`Lead::conditions`]), refreshes it.
    stale: Option<Arc<Entry>>,
}

/// A request waiting for another's answer.
pub struct Wait {
    collapser: Arc<Collapser>,
    base: Arc<str>,
    key: Arc<str>,
    flight: Arc<Flight>,
}

/// What a waiter got.
pub enum Waited {
    /// The leader's response, shared.
    Served(Response<ProxyBody>),
    /// The leader's response could not be shared: fetch on your own.
    OnItsOwn,
    /// The leader failed: lead in its place.
    Lead(Lead),
}

impl Collapser {
    /// A collapser by `config`, counting into `metrics`; its disk tier opened where
    /// `[cache] dir` is set (`Err` where it cannot be written).
    pub fn new(config: CacheConfig, metrics: Arc<Metrics>) -> Result<Arc<Self>, DiskError> {
        let disk = Disk::of(&config)?;
        // Each shard holds a share of `memory`: no more shards than leave room in each for
        // the largest object kept.
        let shards = (config.memory / config.max_object.max(1)).clamp(1, 16) as usize;
        let evictions = Evictions(metrics.cache_evictions.with_label_values(&["memory"]));
        let options = quick_cache::OptionsBuilder::new()
            .estimated_items_capacity(usize::try_from(config.memory / 16_384).unwrap_or(1).max(64))
            .weight_capacity(config.memory)
            .shards(shards)
            .build()
            // Every number above is set: only a shard count of 0 could fail, and it is 1 at
            // least.
            .unwrap_or_else(|_| unreachable!("the options are complete"));
        let kept = quick_cache::sync::Cache::with_options(
            options,
            ByBytes,
            quick_cache::DefaultHashBuilder::default(),
            evictions,
        );
        let collapser = Arc::new(Self {
            config: arc_swap::ArcSwap::from_pointee(config),
            flights: Mutex::default(),
            not_collapsed: Mutex::default(),
            held: Arc::new(AtomicUsize::new(0)),
            kept,
            disk: arc_swap::ArcSwapOption::new(disk),
            flight_bytes: metrics.cache_bytes.with_label_values(&["flight"]),
            looking: Default::default(),
            varies: quick_cache::sync::Cache::new(NOT_COLLAPSED_MAX),
            metrics,
        });
        if let Some(disk) = collapser.disk.load_full() {
            collapser.learn_varies(&disk);
        }
        collapser.weighed();
        Ok(collapser)
    }

    /// What `request` to `route` is: alone, a leader, or a waiter. Only a body-less GET or
    /// HEAD of a destination with `cache = true` is collapsed.
    pub async fn join(self: &Arc<Self>, route: &Route, request: &Outgoing) -> Joined {
        let head = request.head();
        if !(head.method == Method::GET || head.method == Method::HEAD) || request.has_body() {
            return Joined::Alone;
        }
        let base: Arc<str> = Arc::from(key_of(route, request));
        let key: Arc<str> = match self.varies.get(&*base) {
            Some(names) => Arc::from(varied(&base, &names, &head.headers)),
            None => base.clone(),
        };
        let mut stale = None;
        let mut found = self.kept.get(&key);
        if found.is_none() {
            found = self.on_disk(&key).await;
        }
        if let Some(entry) = found {
            match entry.policy.before_request(head, SystemTime::now()) {
                http_cache_semantics::BeforeRequest::Fresh(parts) => {
                    self.looked_up(route, "hit");
                    self.saved(route);
                    let response = Response::from_parts(parts, entry.shared.reader());
                    return Joined::Hit(with_status(response, status::HIT));
                }
                // Fetched again, through a slot; what it brings replaces the entry.
                http_cache_semantics::BeforeRequest::Stale { matches, .. } => {
                    stale = matches.then(|| entry.clone());
                    self.looked_up(route, if matches { "stale" } else { "miss" });
                }
            }
        } else {
            self.looked_up(route, "miss");
        }
        if self.lately_unshareable(&key) {
            return Joined::Alone;
        }
        let mut flights = self.flights.lock();
        match flights.get(&key) {
            Some(flight) => Joined::Wait(Wait::new(self.clone(), base, key, flight.clone())),
            None => {
                let flight = Flight::new();
                flights.insert(key.clone(), flight.clone());
                Joined::Lead(Lead {
                    collapser: self.clone(),
                    base,
                    key,
                    flight,
                    answered: false,
                    stale,
                })
            }
        }
    }

    /// Whether `key`'s response could not be shared within [`NOT_COLLAPSED_FOR`].
    fn lately_unshareable(&self, key: &str) -> bool {
        let mut marks = self.not_collapsed.lock();
        match marks.get(key) {
            Some(until) if *until > Instant::now() => true,
            Some(_) => {
                marks.remove(key);
                false
            }
            None => false,
        }
    }

    fn mark_unshareable(&self, key: &Arc<str>) {
        let mut marks = self.not_collapsed.lock();
        let now = Instant::now();
        if marks.len() >= NOT_COLLAPSED_MAX {
            marks.retain(|_, until| *until > now);
            if marks.len() >= NOT_COLLAPSED_MAX {
                // Still full of live marks: the one that ends first goes.
                if let Some(first) = marks
                    .iter()
                    .min_by_key(|(_, u)| **u)
                    .map(|(k, _)| k.clone())
                {
                    marks.remove(&first);
                }
            }
        }
        marks.insert(key.clone(), now + NOT_COLLAPSED_FOR);
    }

    /// Takes `flight` out of the table, if it is still the one there.
    fn land(&self, key: &str, flight: &Arc<Flight>) {
        let mut flights = self.flights.lock();
        if flights.get(key).is_some_and(|f| Arc::ptr_eq(f, flight)) {
            flights.remove(key);
        }
    }

    fn looked_up(&self, route: &Route, result: &str) {
        if !self.looking.read().contains(route.label()) {
            self.looking.write().insert(route.label().clone());
        }
        self.metrics
            .cache
            .with_label_values(&[route.label(), result])
            .inc();
    }

    /// A request answered without a slot: from a kept response, or another's in flight.
    fn saved(&self, route: &Route) {
        self.metrics
            .slots_saved
            .with_label_values(&[route.label()])
            .inc();
    }

    fn count(&self, route: &Route, what: &str) {
        self.metrics
            .collapsed
            .with_label_values(&[route.label(), what])
            .inc();
    }
}

impl Lead {
    /// The clock the leader's exchange stamps when its request leaves.
    pub fn departure(&self) -> Arc<Departure> {
        self.flight.departure.clone()
    }

    /// The headers that make the leader's request conditional on a stale entry's validators
    /// (`If-None-Match`, `If-Modified-Since`), where it refreshes one.
    pub fn conditions(&self, request: &Parts) -> Vec<(http::HeaderName, http::HeaderValue)> {
        let Some(entry) = &self.stale else {
            return Vec::new();
        };
        match entry.policy.before_request(request, SystemTime::now()) {
            http_cache_semantics::BeforeRequest::Stale { request: asked, .. } => {
                [http::header::IF_NONE_MATCH, http::header::IF_MODIFIED_SINCE]
                    .into_iter()
                    .filter(|name| !request.headers.contains_key(name))
                    .filter_map(|name| {
                        let value = asked.headers.get(&name)?.clone();
                        Some((name, value))
                    })
                    .collect()
            }
            http_cache_semantics::BeforeRequest::Fresh(_) => Vec::new(),
        }
    }

    /// Shares the leader's exchange with the waiters where its response can be shared, and
    /// returns what the leader's own client gets, and the shared body for the leader's fetch
    /// to record ([`Recording::record`]). `request` is as it was sent, conditions included.
    pub fn answer(
        mut self,
        route: &Route,
        request: &Parts,
        exchanged: Exchanged,
    ) -> (Exchanged, Option<Recording>) {
        self.answered = true;
        let Exchanged { response, note } = exchanged;
        let response = match response {
            Err(e) => {
                self.fail();
                let exchanged = Exchanged {
                    response: Err(e),
                    note,
                };
                return (exchanged, None);
            }
            Ok(response) => response,
        };
        if response.status() == StatusCode::NOT_MODIFIED {
            if let Some(refreshed) = self.refreshed(route, request, &response) {
                let exchanged = Exchanged {
                    response: Ok(refreshed),
                    note,
                };
                return (exchanged, None);
            }
        }
        let collapser = self.collapser.clone();
        let received = SystemTime::now();
        if !shareable(request, &response, received) {
            collapser.mark_unshareable(&self.key);
            collapser.land(&self.key, &self.flight);
            self.flight.phase.send_replace(Phase::Released);
            collapser.count(route, "released");
            let exchanged = Exchanged {
                response: Ok(with_status(response, status::FETCHED)),
                note,
            };
            return (exchanged, None);
        }
        let kept = fits(&response, &collapser.config.load(), &collapser.held);
        let (parts, body) = response.into_parts();
        let shared = Arc::new(Shared {
            status: parts.status,
            version: parts.version,
            headers: parts.headers.clone(),
            request: request.headers.clone(),
            tape: Arc::new(Tape::joined_by(self.flight.waiting.clone())),
            held: collapser.held.clone(),
        });
        let mine = Response::from_parts(parts, shared.reader());
        self.flight.phase.send_replace(Phase::Head(shared.clone()));
        let item = if !kept {
            // Too large to keep: shared as it streams by, with those waiting now; a request
            // that comes later fetches it again.
            shared.stream();
            collapser.land(&self.key, &self.flight);
            collapser.count(route, "streamed");
            status::FETCHED
        } else if self.stale.is_some() {
            status::REFRESHED
        } else {
            status::STORED
        };
        let recording = Recording {
            collapser,
            route: route.clone(),
            base: self.base.clone(),
            key: self.key.clone(),
            flight: self.flight.clone(),
            shared,
            received,
            body: Some(body),
            skip: 0,
            kept,
            resumed: 0,
        };
        let exchanged = Exchanged {
            response: Ok(with_status(mine, item)),
            note,
        };
        (exchanged, Some(recording))
    }

    /// A 304 to a stale entry's conditions: the entry refreshed with the headers it brings,
    /// kept again, and served to the leader and its waiters from memory. `None` where the
    /// entry cannot be used (no entry, or validators that do not match).
    fn refreshed<B>(
        &self,
        route: &Route,
        request: &Parts,
        response: &Response<B>,
    ) -> Option<Response<ProxyBody>> {
        let entry = self.stale.as_ref()?;
        let received = SystemTime::now();
        // The new policy is made again from what is kept (`Entry::from_stored`).
        let http_cache_semantics::AfterResponse::NotModified(_, parts) =
            entry.policy.after_response(request, response, received)
        else {
            return None;
        };
        let shared = Arc::new(Shared {
            status: parts.status,
            version: parts.version,
            headers: parts.headers,
            request: entry.shared.request.clone(),
            tape: entry.shared.tape.clone(),
            held: entry.shared.held.clone(),
        });
        self.flight.phase.send_replace(Phase::Head(shared.clone()));
        self.collapser.land(&self.key, &self.flight);
        self.collapser.keep(route, &self.base, received, &shared);
        self.collapser.looked_up(route, "revalidated");
        Some(with_status(shared.response(), status::REVALIDATED))
    }

    /// The flight fails: out of the table, and one waiter takes over.
    fn fail(&self) {
        self.collapser.land(&self.key, &self.flight);
        self.flight.phase.send_replace(Phase::Failed);
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        if !self.answered {
            self.fail();
        }
    }
}

impl Wait {
    fn new(collapser: Arc<Collapser>, base: Arc<str>, key: Arc<str>, flight: Arc<Flight>) -> Self {
        flight.waiting.fetch_add(1, Ordering::AcqRel);
        Self {
            collapser,
            base,
            key,
            flight,
        }
    }

    /// Waits for the leader's head: served with it where this request may have it, else on
    /// its own, or in the leader's place.
    pub async fn answer(mut self, route: &Route, request: &Parts) -> Waited {
        loop {
            match self.next_phase(route).await {
                Phase::Head(shared) => {
                    if !shared.serves(request) {
                        self.collapser.count(route, "vary");
                        return Waited::OnItsOwn;
                    }
                    self.collapser.count(route, "served");
                    self.collapser.saved(route);
                    return Waited::Served(with_status(shared.response(), status::COLLAPSED));
                }
                Phase::Released => return Waited::OnItsOwn,
                Phase::Failed | Phase::Waiting => match self.take_over(route) {
                    Ok(lead) => return Waited::Lead(lead),
                    Err(wait) => self = wait,
                },
            }
        }
    }

    /// The flight's phase once it is no longer waiting, or `Waiting` when the leader's request
    /// was sent `lead_timeout` ago and no head came.
    async fn next_phase(&self, route: &Route) -> Phase {
        let mut phase = self.flight.phase.subscribe();
        let lead_timeout = self.collapser.config.load().lead_timeout;
        loop {
            let now = phase.borrow_and_update().clone();
            if !matches!(now, Phase::Waiting) {
                return now;
            }
            // Bounded from the leader's send, not its wait for a slot: a leader that waits
            // its turn is not slow, and waiters that went on their own would each take one.
            let wait = match self.flight.departure.since() {
                None => lead_timeout,
                Some(gone) => lead_timeout.saturating_sub(gone),
            };
            let changed = tokio::time::timeout(wait, phase.changed()).await;
            let slow = self
                .flight
                .departure
                .since()
                .is_some_and(|gone| gone >= lead_timeout);
            match changed {
                Ok(Ok(())) => {}
                // The leader's flight is gone without a word: as failed.
                Ok(Err(_)) => return Phase::Failed,
                Err(_) if slow => {
                    self.collapser.count(route, "lead_timeout");
                    return Phase::Waiting;
                }
                Err(_) => {}
            }
        }
    }

    /// Leads in the failed (or slow) leader's place with a new flight, unless another waiter
    /// made one first: then waits for that one.
    fn take_over(self, route: &Route) -> Result<Lead, Wait> {
        let mut flights = self.collapser.flights.lock();
        match flights.get(&self.key).cloned() {
            Some(other) if !Arc::ptr_eq(&other, &self.flight) => Err(Wait::new(
                self.collapser.clone(),
                self.base.clone(),
                self.key.clone(),
                other,
            )),
            _ => {
                let flight = Flight::new();
                flights.insert(self.key.clone(), flight.clone());
                drop(flights);
                self.collapser.count(route, "took_over");
                Ok(Lead {
                    collapser: self.collapser.clone(),
                    base: self.base.clone(),
                    key: self.key.clone(),
                    flight,
                    answered: false,
                    stale: None,
                })
            }
        }
    }
}

impl Drop for Wait {
    fn drop(&mut self) {
        self.flight.waiting.fetch_sub(1, Ordering::AcqRel);
        // Served, its reader is made; else what a streamed tape held for it may go.
        if let Phase::Head(shared) = &*self.flight.phase.borrow() {
            shared.tape.left(&self.collapser.held);
        }
    }
}

/// Whether the leader's `response` to `request` may be shared with the waiters: storable in a
/// shared cache (RFC 9111, as `http-cache-semantics` reads it), with no `Set-Cookie` and a
/// `Vary` that is not `*`.
fn shareable<B>(request: &Parts, response: &Response<B>, received: SystemTime) -> bool {
    let policy = http_cache_semantics::CachePolicy::new_options(
        request,
        response,
        received,
        http_cache_semantics::CacheOptions::default(),
    );
    if !policy.is_storable() || response.headers().contains_key(SET_COOKIE) {
        return false;
    }
    if response.headers().get_all(VARY).iter().any(|v| {
        v.to_str()
            .map_or(true, |v| v.split(',').any(|n| n.trim() == "*"))
    }) {
        return false;
    }
    true
}

/// Whether a shared response may be kept whole: a declared length within `max_object` and
/// what `[cache] memory` has left (a body of no declared length is kept until it is past
/// them). Else it is streamed by, to those who wait for it now.
fn fits<B>(response: &Response<B>, config: &CacheConfig, held: &AtomicUsize) -> bool {
    let length = response
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let held = held.load(Ordering::Relaxed) as u64;
    length.is_none_or(|n| n <= config.max_object && held.saturating_add(n) <= config.memory)
}

/// Whether a response says a cache may give it to others than who asked: `public`,
/// `s-maxage` or `must-revalidate` (RFC 9111 §3.5), which is what a request with credentials
/// or cookies must see before it is served another's response.
fn says_shared(headers: &HeaderMap) -> bool {
    headers
        .get_all(CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|d| d.trim().to_ascii_lowercase())
        .any(|d| d == "public" || d.starts_with("s-maxage") || d == "must-revalidate")
}

/// The flight's key: the method, the absolute URI, and what the destination keys its budget
/// by where it is the sender rather than the URI.
fn key_of(route: &Route, request: &Outgoing) -> String {
    let head = request.head();
    format!(
        "{} {} {}",
        head.method,
        head.uri,
        route.key_material(request).unwrap_or_default()
    )
}

/// The header names a response's `Vary` lists, lower case (`*` is never kept).
fn vary_names(headers: &HeaderMap) -> impl Iterator<Item = String> + '_ {
    headers
        .get_all(VARY)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty())
}

/// `base` with `headers`' values of each of `names`: the key of one variant.
fn varied(base: &str, names: &[String], headers: &HeaderMap) -> String {
    let mut key = base.to_owned();
    for name in names {
        key.push('\n');
        key.push_str(name);
        for value in headers.get_all(name.as_str()) {
            key.push(':');
            key.push_str(&String::from_utf8_lossy(value.as_bytes()));
        }
    }
    key
}

/// `response` with pacegate's `Cache-Status` item after the origin's.
pub fn with_status<B>(mut response: Response<B>, item: &'static str) -> Response<B> {
    crate::headers::append_to_list(
        response.headers_mut(),
        &http::header::HeaderName::from_static("cache-status"),
        Bytes::from_static(item.as_bytes()),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_response_a_shared_cache_may_store_is_shared() {
        let request = http::Request::get("http://images.example.com/a.png")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let held = AtomicUsize::new(0);
        let response = |pairs: &[(&str, &str)]| {
            let mut r = Response::builder().status(200);
            for (k, v) in pairs {
                r = r.header(*k, *v);
            }
            r.body(()).unwrap()
        };
        let config = CacheConfig {
            memory: 4096,
            max_object: 1024,
            lead_timeout: Duration::from_secs(5),
            ..CacheConfig::default()
        };
        let ok = response(&[("cache-control", "max-age=60")]);
        assert!(shareable(&request, &ok, SystemTime::now()));
        assert!(fits(&ok, &config, &held));
        for pairs in [
            vec![("cache-control", "no-store")],
            vec![("cache-control", "private, max-age=60")],
            vec![("cache-control", "max-age=60"), ("set-cookie", "s=1")],
            vec![("cache-control", "max-age=60"), ("vary", "*")],
        ] {
            assert!(
                !shareable(&request, &response(&pairs), SystemTime::now()),
                "{pairs:?}"
            );
        }
        // Shared, but past max_object: streamed by, not kept.
        let large = response(&[("cache-control", "max-age=60"), ("content-length", "2048")]);
        assert!(shareable(&request, &large, SystemTime::now()));
        assert!(!fits(&large, &config, &held));
        // Within max_object, but past what memory has left.
        held.store(3500, Ordering::Relaxed);
        let kib = response(&[("cache-control", "max-age=60"), ("content-length", "1000")]);
        assert!(!fits(&kib, &config, &held));
        assert!(says_shared(
            &response(&[("cache-control", "public, max-age=60")])
                .headers()
                .clone()
        ));
        assert!(!says_shared(
            &response(&[("cache-control", "max-age=60")])
                .headers()
                .clone()
        ));
    }
}
