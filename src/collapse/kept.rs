//! The kept responses: what an entry holds (its own copies, weighed with its bookkeeping),
//! keeping one and reading it back from the disk tier, what the cache saved a destination,
//! a purge, and a reload's new `[cache]`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use http::header::HeaderMap;
use http::{Method, Response};
use parking_lot::Mutex;

use super::disk::{Disk, DiskError, Stored};
use super::tape::Shared;
use super::{varied, vary_names, Collapser};
use crate::config::CacheConfig;
use crate::pacing::Route;

/// A response kept whole: what may be served from it, and when (its RFC 9111 policy).
pub(super) struct Entry {
    pub(super) policy: http_cache_semantics::CachePolicy,
    /// The destination it came from (for a purge by destination).
    pub(super) destination: Arc<str>,
    /// Its body; its headers are the policy's (served from it), and of the request it
    /// answered, those the response varies by.
    pub(super) shared: Arc<Shared>,
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
pub(super) struct Evictions(pub(super) prometheus::IntCounter);

impl quick_cache::Lifecycle<Arc<str>, Arc<Entry>> for Evictions {
    type RequestState = ();

    fn begin_request(&self) -> Self::RequestState {}

    fn on_evict(&self, _: &mut Self::RequestState, _: Arc<str>, _: Arc<Entry>) {
        self.0.inc();
    }
}

/// An entry's weight: what it holds in memory, in bytes ([`Entry::weight`]).
#[derive(Clone)]
pub(super) struct ByBytes;

impl quick_cache::Weighter<Arc<str>, Arc<Entry>> for ByBytes {
    fn weight(&self, _: &Arc<str>, entry: &Arc<Entry>) -> u64 {
        entry.weight
    }
}

impl Collapser {
    /// What each key on `disk` varies by: its own key says.
    pub(super) fn learn_varies(&self, disk: &Disk) {
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
            let disk = Disk::of(new)?;
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
    pub(super) fn keep(&self, route: &Route, base: &str, received: SystemTime, shared: &Shared) {
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
    pub(super) async fn on_disk(&self, key: &Arc<str>) -> Option<Arc<Entry>> {
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
    pub(super) fn in_flight(&self) {
        let held = self.held.load(Ordering::Relaxed);
        self.flight_bytes
            .set(i64::try_from(held).unwrap_or(i64::MAX));
    }

    /// Sets the bytes gauges from what is held.
    pub(super) fn weighed(&self) {
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
pub(super) fn owned(headers: &HeaderMap) -> HeaderMap {
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

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

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
        let tape = Shared::empty();
        tape.push(buffer.slice(100..16_484));
        tape.end(Ok(()));
        let body = tape.body();
        assert_eq!(body.len(), 16_384);
        assert!(!within(body.as_ptr()), "the body is copied out of it");
    }
}
