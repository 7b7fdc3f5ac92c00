//! One fetch for many: while a GET or HEAD to a destination with `cache = true` is on its
//! way, an identical one waits for it and takes no slot. Identical: the same method and
//! absolute URI, the same budget key, and, once the first response says which, the same
//! values of the headers its `Vary` names.
//!
//! What can happen to a request that finds one in flight is named, as a cache lock should
//! name it (so that no waiter hangs, and an uncacheable answer never serialises a burst):
//!
//! - the leader's response head is shareable (storable in a shared cache, by RFC 9111 as
//!   `http-cache-semantics` reads it, with no `Set-Cookie`, within `[cache] memory`): the
//!   waiter gets it, its body streamed as it arrives (a [`Tape`] every reader follows);
//! - it is not: the waiters go on their own, each through its own slot, and the URI is not
//!   collapsed for [`NOT_COLLAPSED_FOR`], so that the next burst is not serialised either;
//! - the leader failed (no response, a refusal) or its request was sent and no head came
//!   within `[cache] lead_timeout`: one waiter becomes the leader, the others wait for it.
//!
//! A verdict on the leader's response is applied once, by the leader's exchange: the waiters
//! get the response as it came, or go through the pacer themselves.
//!
//! A shared response whose body came whole, within `max_object`, is kept (in memory, within
//! `[cache] memory`, the least used evicted first): while it is fresh by RFC 9111, a request
//! for it is answered from memory and takes no slot. A stale one is asked for again on its
//! validators: a 304 refreshes it, anything else replaces it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{HeaderMap, CACHE_CONTROL, SET_COOKIE, VARY};
use http::request::Parts;
use http::{Method, Response, StatusCode};
use http_body_util::BodyExt;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;

mod disk;
mod tape;

use crate::config::CacheConfig;
use crate::metrics::Metrics;
use crate::pacing::{Departure, Exchanged, Outgoing, Route};
use crate::upstream::ProxyBody;
pub use disk::DiskError;
use disk::{Disk, Stored};
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
    /// The destinations whose requests were looked up.
    looking: parking_lot::RwLock<std::collections::HashSet<Arc<str>>>,
    /// The headers a key's responses last said they vary by (`Vary`): a request is looked up,
    /// and collapsed, with its own values of them, so that each variant is kept apart.
    varies: quick_cache::sync::Cache<Arc<str>, Arc<[String]>>,
    metrics: Arc<Metrics>,
}

/// A response kept whole: what may be served from it, and when (its RFC 9111 policy).
struct Entry {
    policy: http_cache_semantics::CachePolicy,
    /// The destination it came from (for a purge by destination).
    destination: Arc<str>,
    /// Its body; its headers are the policy's (served from it), and of the request it
    /// answered, those the response varies by.
    shared: Arc<Shared>,
    /// What it holds in memory, in bytes, its bookkeeping included ([`ENTRY_OVERHEAD`]).
    weight: u64,
}

/// What an entry holds in memory besides its key, headers and body: its policy's parsed
/// directives, the maps its headers are in, one allocation per value, the tape, the cache's
/// own bookkeeping (measured: `docs/benchmarks.md`, "The memory tier's resident set").
/// Weighed with the entry, so that `[cache] memory` bounds what the process holds.
const ENTRY_OVERHEAD: u64 = 4096;

impl Entry {
    /// An entry read from the disk tier: its policy as it was when it was received (so that
    /// its age goes on from then), its body on a tape of its own.
    fn from_stored(stored: Stored, held: &Arc<AtomicUsize>) -> Option<Self> {
        let mut words = stored.key.split(' ');
        let method = Method::from_bytes(words.next()?.as_bytes()).ok()?;
        let uri: http::Uri = words.next()?.parse().ok()?;
        // Of the request, only what a later one is matched on: its `Host`, and the headers
        // the response varies by.
        let mut varying = HeaderMap::new();
        let host = std::iter::once(http::header::HOST.as_str().to_owned());
        for name in host.chain(vary_names(&stored.headers)) {
            let Ok(name) = http::HeaderName::from_bytes(name.as_bytes()) else {
                continue;
            };
            for value in stored.request.get_all(&name) {
                varying.append(name.clone(), value.clone());
            }
        }
        let headers: usize = stored
            .headers
            .iter()
            .chain(&varying)
            .map(|(k, v)| k.as_str().len() + v.len())
            .sum();
        let weight = (stored.key.len() + headers + stored.body.len()) as u64 + ENTRY_OVERHEAD;
        let mut request = http::Request::new(());
        *request.method_mut() = method;
        *request.uri_mut() = uri;
        *request.headers_mut() = varying.clone();
        let mut response = Response::new(());
        *response.status_mut() = stored.status;
        *response.headers_mut() = stored.headers;
        let policy = http_cache_semantics::CachePolicy::new_options(
            &request,
            &response,
            stored.received,
            http_cache_semantics::CacheOptions::default(),
        );
        let shared = Arc::new(Shared {
            status: stored.status,
            version: http::Version::HTTP_11,
            headers: HeaderMap::new(),
            request: varying,
            tape: Arc::default(),
            held: held.clone(),
        });
        shared.push(stored.body);
        shared.end(Ok(()));
        Some(Self {
            policy,
            destination: stored.destination,
            shared,
            weight,
        })
    }
}

/// Counts the kept responses memory lets go of (they stay on disk, where there is one).
#[derive(Clone)]
struct Evictions(prometheus::IntCounter);

impl quick_cache::Lifecycle<Arc<str>, Arc<Entry>> for Evictions {
    type RequestState = ();

    fn begin_request(&self) -> Self::RequestState {}

    fn on_evict(&self, _: &mut Self::RequestState, _: Arc<str>, _: Arc<Entry>) {
        self.0.inc();
    }
}

/// An entry's weight: what it holds in memory, in bytes ([`Entry::weight`]).
#[derive(Clone)]
struct ByBytes;

impl quick_cache::Weighter<Arc<str>, Arc<Entry>> for ByBytes {
    fn weight(&self, _: &Arc<str>, entry: &Arc<Entry>) -> u64 {
        entry.weight
    }
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
        let disk = match (&config.dir, config.disk) {
            (Some(dir), Some(bytes)) => Some(Arc::new(Disk::open(dir, bytes)?)),
            _ => None,
        };
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

    /// What each key on `disk` varies by: its own key says.
    fn learn_varies(&self, disk: &Disk) {
        {
            for key in disk.keys() {
                if let Some((base, rest)) = key.split_once('\n') {
                    let names: Arc<[String]> = rest
                        .split('\n')
                        .map(|line| line.split(':').next().unwrap_or_default().to_owned())
                        .collect();
                    self.varies.insert(Arc::from(base), names);
                }
            }
        }
    }

    /// Applies a reloaded `[cache]`, keeping what it can: the kept responses stay (the least
    /// used let go of where `memory` shrank), and a new `dir` is opened (what the old one
    /// holds stays there). `Err` where the new `dir` cannot be written: nothing changes.
    pub fn reconfigure(&self, new: &CacheConfig) -> Result<(), DiskError> {
        let old = self.config.load_full();
        if new.dir != old.dir {
            let disk = match (&new.dir, new.disk) {
                (Some(dir), Some(bytes)) => Some(Arc::new(Disk::open(dir, bytes)?)),
                _ => None,
            };
            if let Some(disk) = &disk {
                self.learn_varies(disk);
            }
            self.disk.store(disk);
        } else if let (Some(disk), Some(bytes)) = (self.disk.load_full(), new.disk) {
            let evicted = disk.resize(bytes);
            self.metrics
                .cache_evictions
                .with_label_values(&["disk"])
                .inc_by(evicted as u64);
        }
        if new.memory != old.memory {
            self.kept.set_capacity(new.memory);
        }
        self.config.store(Arc::new(new.clone()));
        self.weighed();
        Ok(())
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

    /// What the cache saved `destination` on this instance; `None` where it looked none of
    /// its requests up.
    pub fn status(&self, destination: &str) -> Option<crate::status::CacheStatus> {
        if !self.looking.read().contains(destination) {
            return None;
        }
        let looked = |result: &str| {
            self.metrics
                .cache
                .with_label_values(&[destination, result])
                .get()
        };
        let hits = looked("hit");
        let requests = hits + looked("stale") + looked("miss");
        let collapsed = self
            .metrics
            .collapsed
            .with_label_values(&[destination, "served"])
            .get();
        let slots_saved = hits + collapsed;
        Some(crate::status::CacheStatus {
            requests,
            hits,
            collapsed,
            slots_saved,
            hit_ratio: if requests == 0 {
                0.0
            } else {
                slots_saved as f64 / requests as f64
            },
        })
    }

    /// Keeps a response whose body came whole, within `max_object`, for the request whose
    /// key is `base`: under it and the request's values of the headers the response varies
    /// by, which are remembered for `base`.
    fn keep(&self, route: &Route, base: &str, received: SystemTime, shared: &Shared) {
        if !shared.whole() || shared.bytes() as u64 > self.config.load().max_object {
            return;
        }
        let names: Arc<[String]> = vary_names(&shared.headers).collect();
        let key: Arc<str> = Arc::from(varied(base, &names, &shared.request));
        self.varies.insert(Arc::from(base), names);
        // Kept in pieces of its own, apart from the tape its readers in flight follow: the
        // headers and body as they came are slices of the buffers the connections read
        // into, which they would hold as long as the entry lives.
        let stored = Stored {
            key: key.clone(),
            destination: route.name().clone(),
            received,
            status: shared.status,
            headers: {
                let mut headers = owned(&shared.headers);
                crate::headers::strip_hop_by_hop(&mut headers);
                headers
            },
            request: owned(&shared.request),
            body: shared.body(),
        };
        let Some(entry) = Entry::from_stored(stored.clone(), &self.held) else {
            return;
        };
        let entry = Arc::new(entry);
        self.kept.insert(key, entry);
        self.looked_up(route, "stored");
        if let Some(disk) = self.disk.load_full() {
            let metrics = self.metrics.clone();
            let route = route.clone();
            // Written beside the requests, not before their answers: they were served.
            tokio::task::spawn_blocking(move || {
                match disk.write(&stored) {
                    Ok(evicted) => metrics
                        .cache_evictions
                        .with_label_values(&["disk"])
                        .inc_by(evicted as u64),
                    Err(e) => {
                        metrics
                            .cache
                            .with_label_values(&[route.label(), "unwritten"])
                            .inc();
                        tracing::warn!(
                            destination = %route.name(),
                            error = %e,
                            "a response kept in memory could not be written to cache.dir: it is not on disk"
                        );
                    }
                }
                metrics
                    .cache_bytes
                    .with_label_values(&["disk"])
                    .set(i64::try_from(disk.bytes()).unwrap_or(i64::MAX));
            });
        }
        self.weighed();
    }

    /// The entry for `key` from the disk tier, kept in memory again; `None` where there is
    /// none, or it is not whole.
    async fn on_disk(&self, key: &Arc<str>) -> Option<Arc<Entry>> {
        let disk = self.disk.load_full()?;
        if !disk.has(key) {
            return None;
        }
        let wanted = key.clone();
        let stored = tokio::task::spawn_blocking(move || disk.read(&wanted))
            .await
            .ok()
            .flatten()?;
        let entry = Arc::new(Entry::from_stored(stored, &self.held)?);
        self.kept.insert(key.clone(), entry.clone());
        self.weighed();
        Some(entry)
    }

    /// Sets the gauge of the bodies being read.
    fn in_flight(&self) {
        let held = self.held.load(Ordering::Relaxed);
        self.metrics
            .cache_bytes
            .with_label_values(&["flight"])
            .set(i64::try_from(held).unwrap_or(i64::MAX));
    }

    /// Sets the bytes gauges from what is held.
    fn weighed(&self) {
        let gauge = |tier: &str, bytes: u64| {
            self.metrics
                .cache_bytes
                .with_label_values(&[tier])
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        };
        gauge("memory", self.kept.weight());
        gauge("flight", self.held.load(Ordering::Relaxed) as u64);
        if let Some(disk) = self.disk.load_full() {
            gauge("disk", disk.bytes());
        }
    }

    /// Removes the kept responses to `url` (any method, any variant), or all of
    /// `destination`'s, from memory and disk; how many.
    pub fn purge(&self, url: Option<&str>, destination: Option<&str>) -> usize {
        let url = match url.map(resource) {
            Some(None) => return 0,
            Some(Some(url)) => Some(url),
            None => None,
        };
        let matches = |key: &str, from: &str| {
            let uri = key.split(' ').nth(1).unwrap_or_default();
            url.as_ref()
                .is_none_or(|u| resource(uri).as_ref() == Some(u))
                && destination.is_none_or(|d| from == d)
        };
        // Collected first, then removed: the cache's shards are locked while it is walked.
        let purged = Mutex::new(Vec::new());
        self.kept.retain(|key, entry| {
            if matches(key, &entry.destination) {
                purged.lock().push(key.clone());
            }
            true
        });
        let purged = purged.into_inner();
        for key in &purged {
            self.kept.remove(key);
        }
        let mut gone = purged.len();
        if let Some(disk) = self.disk.load_full() {
            // What is on disk and not in memory too, counted once.
            let in_memory: std::collections::HashSet<&str> = purged.iter().map(|k| &**k).collect();
            let in_memory = |key: &str| in_memory.contains(key);
            gone += disk.purge(|key, from| matches(key, from) && !in_memory(key));
            disk.purge(|key, _| in_memory(key));
        }
        self.weighed();
        gone
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

/// How many times a shared body cut short is asked for again.
const RESUMES: u8 = 2;

/// The shared body of a leader's response, read onto its tape by the leader's fetch, a task
/// of its own (a leader whose client goes away leaves it to the waiters).
pub struct Recording {
    collapser: Arc<Collapser>,
    route: Route,
    base: Arc<str>,
    key: Arc<str>,
    flight: Arc<Flight>,
    shared: Arc<Shared>,
    received: SystemTime,
    body: Option<ProxyBody>,
    /// Bytes of the body on the tape already, from a fetch cut short: left out of this one.
    skip: usize,
    /// Kept once whole; else streamed by.
    kept: bool,
    resumed: u8,
}

/// A shared body cut short: the fetch asks for it again, through a slot, and goes on
/// ([`Cut::resume`]).
pub struct Cut(Recording);

impl Recording {
    /// Reads the body onto the tape, to its end: `Some` where it was cut short and may be
    /// asked for again (its entity named by a validator, so that the rest of another
    /// fetch of it is the rest of this one). Else the readers are cut as it was: a body
    /// cut short is never given as whole.
    pub async fn record(mut self) -> Option<Cut> {
        let Some(mut body) = self.body.take() else {
            self.finish(Err("no body to record".into()));
            return None;
        };
        loop {
            match body.frame().await {
                None => {
                    self.finish(Ok(()));
                    return None;
                }
                Some(Err(e)) => {
                    if self.resumed < RESUMES && validated(&self.shared.headers) {
                        self.resumed += 1;
                        self.skip = self.shared.bytes();
                        self.collapser.count(&self.route, "cut");
                        return Some(Cut(self));
                    }
                    self.finish(Err(e.to_string()));
                    return None;
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        let had = self.skip.min(data.len());
                        self.skip -= had;
                        if had < data.len() {
                            self.shared.push(data.slice(had..));
                            self.collapser.in_flight();
                        }
                        if !self.room() {
                            // Past max_object, or what memory has left: not kept after all.
                            self.kept = false;
                            self.shared.stream();
                            self.collapser.land(&self.key, &self.flight);
                            self.collapser.count(&self.route, "streamed");
                        }
                        if !self.kept && !self.shared.drained().await {
                            self.finish(Err("no reader is left".into()));
                            return None;
                        }
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            self.shared.trailers(trailers);
                        }
                    }
                },
            }
        }
    }

    /// Whether a kept body still fits: within `max_object`, and the bodies in flight within
    /// `[cache] memory`.
    fn room(&self) -> bool {
        let config = self.collapser.config.load();
        !self.kept
            || (self.shared.bytes() as u64 <= config.max_object
                && self.collapser.held.load(Ordering::Relaxed) as u64 <= config.memory)
    }

    /// Ends the tape, keeps a body that came whole, and lands the flight.
    fn finish(self, end: Result<(), String>) {
        self.shared.end(end);
        self.collapser.in_flight();
        if self.kept && self.shared.whole() {
            self.collapser
                .keep(&self.route, &self.base, self.received, &self.shared);
        }
        self.collapser.land(&self.key, &self.flight);
    }
}

impl Cut {
    /// Goes on with `exchanged`, the same request sent again: its body, past what the tape
    /// has, where it is the same entity (the same status and validators); else the readers
    /// are cut.
    pub fn resume(self, exchanged: Exchanged) -> Option<Recording> {
        let mut recording = self.0;
        match exchanged.response {
            Ok(response) if same_entity(&recording.shared, &response) => {
                recording.body = Some(response.into_body());
                recording.collapser.count(&recording.route, "resumed");
                Some(recording)
            }
            Ok(response) => {
                recording.finish(Err(format!(
                    "the body was cut short, and asked for again, the vendor answered {} with another entity",
                    response.status()
                )));
                None
            }
            Err(e) => {
                recording.finish(Err(format!(
                    "the body was cut short, and asking for it again failed: {e}"
                )));
                None
            }
        }
    }
}

/// Whether a response names its entity so that another fetch of it can be told apart: a
/// strong `ETag`, or a `Last-Modified` with a `Content-Length`.
fn validated(headers: &HeaderMap) -> bool {
    let strong = headers
        .get(http::header::ETAG)
        .is_some_and(|v| !v.as_bytes().starts_with(b"W/"));
    strong
        || (headers.contains_key(http::header::LAST_MODIFIED)
            && headers.contains_key(http::header::CONTENT_LENGTH))
}

/// Whether `response` is the entity `shared` began: the same status, and the same strong
/// `ETag`, or the same `Last-Modified` and `Content-Length`.
fn same_entity<B>(shared: &Shared, response: &Response<B>) -> bool {
    let same = |name: http::HeaderName| {
        let (a, b) = (shared.headers.get(&name), response.headers().get(&name));
        a.is_some() && a == b
    };
    response.status() == shared.status
        && if shared
            .headers
            .get(http::header::ETAG)
            .is_some_and(|v| !v.as_bytes().starts_with(b"W/"))
        {
            same(http::header::ETAG)
        } else {
            same(http::header::LAST_MODIFIED) && same(http::header::CONTENT_LENGTH)
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

/// What a URL names, however it is written: its scheme, host (lower case), port (the
/// scheme's where none is written) and path with query (`/` where none is written).
fn resource(url: &str) -> Option<(String, String, u16, String)> {
    let uri: http::Uri = url.parse().ok()?;
    let scheme = uri.scheme_str()?.to_ascii_lowercase();
    let port = uri.port_u16().or(match scheme.as_str() {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    })?;
    let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    Some((scheme, uri.host()?.to_ascii_lowercase(), port, path))
}

/// `headers` copied, each name and value in an allocation of its own.
fn owned(headers: &HeaderMap) -> HeaderMap {
    let mut copy = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name.as_str().as_bytes()),
            http::HeaderValue::from_bytes(value.as_bytes()),
        ) {
            copy.append(name, value);
        }
    }
    copy
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
    use http::Version;
    use http_body_util::BodyExt;

    fn shared() -> Arc<Shared> {
        Arc::new(Shared {
            status: StatusCode::OK,
            version: Version::HTTP_11,
            headers: HeaderMap::new(),
            request: HeaderMap::new(),
            tape: Arc::default(),
            held: Arc::new(AtomicUsize::new(0)),
        })
    }

    #[tokio::test]
    async fn every_reader_gets_each_chunk_as_it_arrives_from_the_first() {
        let tape = shared();
        let mut early = tape.reader();
        tape.push(Bytes::from_static(b"first "));
        // The early reader has the first chunk before the body is over.
        let first = early.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "first ");
        assert_eq!(
            tape.held.load(Ordering::Relaxed),
            6,
            "held while it is read"
        );
        let pending = tokio::spawn(async move { early.collect().await.unwrap().to_bytes() });
        tape.push(Bytes::from_static(b"second"));
        tape.end(Ok(()));
        // A reader made later reads it all from the start.
        let late = tape.reader().collect().await.unwrap().to_bytes();
        assert_eq!(late, "first second");
        assert_eq!(pending.await.unwrap(), "second");
        assert!(tape.whole());
        assert_eq!(
            tape.held.load(Ordering::Relaxed),
            0,
            "counted against the memory for responses in flight only while it is read"
        );
    }

    #[tokio::test]
    async fn a_body_cut_short_is_cut_short_for_every_reader() {
        let tape = shared();
        tape.push(Bytes::from_static(b"part"));
        tape.end(Err("upstream reset".into()));
        let mut reader = tape.reader();
        assert_eq!(
            reader.frame().await.unwrap().unwrap().into_data().unwrap(),
            "part"
        );
        assert!(reader.frame().await.unwrap().is_err());
        assert!(!tape.whole());
    }

    #[tokio::test]
    async fn a_streamed_tape_holds_only_what_its_slowest_reader_has_not_had() {
        let tape = shared();
        let (mut fast, mut slow) = (tape.reader(), tape.reader());
        tape.stream();
        let chunk = Bytes::from(vec![7u8; tape::WINDOW / 2]);
        for _ in 0..2 {
            tape.push(chunk.clone());
        }
        assert!(
            tape.drained().await,
            "a window's worth may wait for its readers"
        );
        tape.push(chunk.clone());
        for _ in 0..3 {
            fast.frame().await.unwrap().unwrap();
        }
        // The slow reader holds all three: the recording waits for it.
        let waited = tokio::time::timeout(Duration::from_millis(50), tape.drained()).await;
        assert!(waited.is_err(), "past the window, the recording waits");
        slow.frame().await.unwrap().unwrap();
        assert!(tape.drained().await);
        assert_eq!(
            tape.held.load(Ordering::Relaxed),
            chunk.len() * 2,
            "the chunk both had is let go of"
        );
        // A reader made now would miss the start: it is cut, never given the rest as whole.
        let mut late = tape.reader();
        assert!(late.frame().await.unwrap().is_err());
        drop(late);
        // With no reader left, nothing waits for one.
        drop((fast, slow));
        assert_eq!(tape.held.load(Ordering::Relaxed), 0);
        tape.push(chunk.clone());
        tape.push(chunk.clone());
        tape.push(chunk);
        assert!(!tape.drained().await, "no reader is left to read the rest");
    }

    #[test]
    fn what_is_kept_holds_none_of_the_buffer_it_was_read_into() {
        // A connection's read buffer: the head and the body are slices of it.
        let buffer = Bytes::from(vec![b'x'; 64 * 1024]);
        let within = |p: *const u8| {
            let start = buffer.as_ptr() as usize;
            (start..start + buffer.len()).contains(&(p as usize))
        };
        let mut headers = HeaderMap::new();
        headers.insert(
            "etag",
            http::HeaderValue::from_maybe_shared(buffer.slice(0..8)).unwrap(),
        );
        let copy = owned(&headers);
        assert_eq!(copy["etag"], headers["etag"]);
        assert!(within(headers["etag"].as_bytes().as_ptr()));
        assert!(!within(copy["etag"].as_bytes().as_ptr()));
        let tape = shared();
        tape.push(buffer.slice(100..16_484));
        tape.end(Ok(()));
        let body = tape.body();
        assert_eq!(body.len(), 16_384);
        assert!(!within(body.as_ptr()), "the body is copied out of it");
    }

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
