//! The pool of upstream connections: hyper's client connections, HTTP/1.1 or h2 as the
//! upstream's TLS handshake chose, kept per upstream (scheme, host and port) between requests.
//!
//! A request takes an idle HTTP/1.1 connection (the one handed back last), or shares its
//! upstream's h2 connection, or has [`Warm`] open one (or hand over one it opened ahead). An
//! HTTP/1.1 connection goes back to the pool once it can take the next request, that is once
//! the response has been read off it; one the upstream closed meanwhile is dropped on the way
//! out. A request whose reused connection turned out closed before it was written is sent
//! again on another: the upstream never saw it. An HTTP/1.1 connection idle for
//! `pool_idle_timeout` is closed, and so is an h2 one no request has taken for as long; an
//! upstream keeps at most `pool_max_idle_per_host` idle HTTP/1.1 ones.
//!
//! Written here rather than taken from hyper-util's pooled client, which did all this and
//! more for about 8,700 instructions a request, more than pacegate's own work
//! (`docs/benchmarks.md`, "Eleventh pass" and "Twelfth pass"). What it leaves out: racing a
//! new connection against one handed back meanwhile (`Warm` opens connections ahead for paced
//! requests instead). A request takes the pool's lock once to check out and once to hand
//! back, and hashes its key (with aHash, as `Warm` does) at each.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use http::header::{HeaderValue, HOST};
use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use parking_lot::Mutex;
use tokio::time::Instant;

use super::warm::{Key, NoConnectionInTime, Warm};
use super::{BoxError, ConnectError, ProxyBody};

/// The shortest period between two looks for expired idle connections.
const MIN_REAP: Duration = Duration::from_millis(100);

/// A connection to send one request on.
enum Conn {
    /// An HTTP/1.1 connection, held alone until the response is read.
    H1(http1::SendRequest<ProxyBody>),
    /// A handle on the upstream's h2 connection, shared.
    H2(http2::SendRequest<ProxyBody>),
}

/// One upstream's connections between requests.
#[derive(Default)]
struct Idle {
    /// HTTP/1.1 connections, each with the instant it was handed back; the latest last.
    h1: Vec<(Instant, http1::SendRequest<ProxyBody>)>,
    /// The upstream's h2 connection, with the instant a request last took it.
    h2: Option<(Instant, http2::SendRequest<ProxyBody>)>,
}

/// The pool; a clone shares it.
#[derive(Clone)]
pub(super) struct Pool {
    shared: Arc<Shared>,
}

/// What the pool and its reaper share.
struct Shared {
    /// Every upstream's idle connections. A lock held for a push or a pop.
    idle: Mutex<HashMap<Key, Idle, ahash::RandomState>>,
    /// How long a connection may sit idle.
    idle_timeout: Duration,
    /// The most idle HTTP/1.1 connections kept for one upstream.
    max_idle: usize,
    /// The line of requests opening a connection, per upstream that may speak h2.
    connecting: Mutex<HashMap<Key, Arc<tokio::sync::Mutex<()>>, ahash::RandomState>>,
    /// Whether the task that closes expired idle connections runs (started with the first
    /// connection handed back: the pool may be made outside a runtime).
    reaping: AtomicBool,
}

impl Pool {
    pub(super) fn new(idle_timeout: Duration, max_idle: usize) -> Self {
        Self {
            shared: Arc::new(Shared {
                idle: Mutex::default(),
                connecting: Mutex::default(),
                idle_timeout,
                max_idle,
                reaping: AtomicBool::new(false),
            }),
        }
    }

    /// Sends `req` (absolute URI) to the upstream `key` names on a pooled connection or on
    /// one `warm` hands out, and waits for the response head. `by`, for a paced request, is
    /// the latest instant it may still take a new connection (see [`Warm::connection`]).
    pub(super) async fn send(
        &self,
        warm: &Warm,
        key: Option<Key>,
        mut req: Request<ProxyBody>,
        by: Option<tokio::time::Instant>,
    ) -> Result<Response<Incoming>, BoxError> {
        let key = key.ok_or(ConnectError::NoHost)?;
        let uri = req.uri().clone();
        loop {
            let (conn, reused) = match self.checkout(&key) {
                Some(conn) => (conn, true),
                // Boxed: a new connection's handshakes are a large future, and rare.
                None => Box::pin(self.connect_one(warm, &key, uri.clone(), by)).await?,
            };
            let sent = match conn {
                Conn::H1(mut sender) => {
                    // h2 names the authority in the request itself (`:authority`).
                    set_host(&mut req);
                    origin_form(req.uri_mut());
                    let sent = sender.try_send_request(req).await;
                    if let Ok(response) = sent {
                        self.hand_back(key, sender);
                        return Ok(response);
                    }
                    sent
                }
                Conn::H2(mut sender) => sender.try_send_request(req).await,
            };
            match sent {
                Ok(response) => return Ok(response),
                Err(mut e) => match e.take_message() {
                    // Not written: a connection the upstream closed while it was idle.
                    Some(back) if reused => {
                        tracing::debug!("a pooled connection was closed; sending again");
                        req = back;
                        *req.uri_mut() = uri.clone();
                    }
                    _ => return Err(e.into_error().into()),
                },
            }
        }
    }

    /// An idle connection to `key`'s upstream that can take a request, if any: its h2
    /// connection, or the HTTP/1.1 one handed back last. Those expired or closed are dropped
    /// (after the lock: a connection's drop takes `Warm`'s).
    fn checkout(&self, key: &Key) -> Option<Conn> {
        let mut dropped = Vec::new();
        let found = {
            let mut all = self.shared.idle.lock();
            let idle = all.get_mut(key)?;
            let now = Instant::now();
            let found = match &mut idle.h2 {
                Some((used, h2)) if !h2.is_closed() => {
                    *used = now;
                    Some(Conn::H2(h2.clone()))
                }
                _ => {
                    dropped.extend(idle.h2.take().map(|(_, h2)| Conn::H2(h2)));
                    let mut found = None;
                    while let Some((at, sender)) = idle.h1.pop() {
                        if now - at < self.shared.idle_timeout && sender.is_ready() {
                            found = Some(Conn::H1(sender));
                            break;
                        }
                        dropped.push(Conn::H1(sender));
                    }
                    found
                }
            };
            if idle.h1.is_empty() && idle.h2.is_none() {
                all.remove(key);
            }
            found
        };
        drop(dropped);
        found
    }

    /// A connection for a request that found none idle, and whether it was taken from the
    /// pool after all. To an upstream that speaks h2, or may (https, none open), connections
    /// are opened one at a time: a request that comes meanwhile waits for the one being
    /// opened and shares it if it is h2 (hyper-util's pool holds the same lock), rather
    /// than open one of its own. Once the upstream is known to speak HTTP/1.1 no one waits.
    async fn connect_one(
        &self,
        warm: &Warm,
        key: &Key,
        uri: Uri,
        by: Option<tokio::time::Instant>,
    ) -> Result<(Conn, bool), BoxError> {
        if warm.speaks_h2(key) == Some(false) {
            return Ok((self.connect(warm, key, uri, by).await?, false));
        }
        let turn = Turn::take(&self.shared, key);
        let held = match by {
            Some(by) => tokio::time::timeout_at(by, turn.lock.clone().lock_owned())
                .await
                .map_err(|_| NoConnectionInTime)?,
            None => turn.lock.clone().lock_owned().await,
        };
        if let Some(conn) = self.checkout(key) {
            return Ok((conn, true));
        }
        if warm.speaks_h2(key) == Some(false) {
            // Learned meanwhile: the next in line need not wait for this one's handshakes.
            drop(held);
            drop(turn);
        }
        Ok((self.connect(warm, key, uri, by).await?, false))
    }

    /// Opens a connection (see [`Warm::connection`]) and speaks HTTP/1.1 or h2 on it, as its
    /// TLS handshake chose; an h2 one is kept for every request to its upstream.
    async fn connect(
        &self,
        warm: &Warm,
        key: &Key,
        uri: Uri,
        by: Option<tokio::time::Instant>,
    ) -> Result<Conn, BoxError> {
        let io = warm.connection(key.clone(), uri, by).await?;
        if io.is_h2() {
            let (mut sender, conn) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .handshake(io)
                .await?;
            // Drives the connection; owned by its senders (the pool's and the requests'), it
            // ends once the last is dropped and its streams are done, or the upstream closes.
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!("upstream h2 connection ended: {e}");
                }
            });
            sender.ready().await?;
            // Replaces one opened at the same time: requests on it finish, then it closes.
            let replaced = self
                .shared
                .idle
                .lock()
                .entry(key.clone())
                .or_default()
                .h2
                .replace((Instant::now(), sender.clone()));
            drop(replaced);
            self.shared.reap_from_now();
            Ok(Conn::H2(sender))
        } else {
            let (mut sender, conn) = http1::Builder::new().handshake(io).await?;
            // Drives the connection; ends when its sender is dropped (by the request, the
            // pool's bound or the reaper) or the upstream closes it.
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!("upstream connection ended: {e}");
                }
            });
            sender.ready().await?;
            Ok(Conn::H1(sender))
        }
    }

    /// Puts an HTTP/1.1 connection back once it can take the next request: at once where
    /// the response was read with its head (most answers), else when it has been.
    fn hand_back(&self, key: Key, mut sender: http1::SendRequest<ProxyBody>) {
        if sender.is_ready() {
            self.shared.put(key, sender);
            return;
        }
        let shared = Arc::downgrade(&self.shared);
        // Owned by the response's body: ends when the body is read to its end (the
        // connection is then ready) or dropped (an error).
        tokio::spawn(async move {
            // An error: the upstream closed it, or the response was not read to its end.
            if sender.ready().await.is_ok() {
                if let Some(shared) = shared.upgrade() {
                    shared.put(key, sender);
                }
            }
        });
    }
}

/// A request's place in line to open a connection to an upstream that may speak h2 (see
/// [`Pool::connect_one`]). The line's entry goes with the last request in it.
struct Turn<'a> {
    shared: &'a Shared,
    key: &'a Key,
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl<'a> Turn<'a> {
    fn take(shared: &'a Shared, key: &'a Key) -> Self {
        let lock = shared
            .connecting
            .lock()
            .entry(key.clone())
            .or_default()
            .clone();
        Self { shared, key, lock }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut lines = self.shared.connecting.lock();
        // The line's own reference and this one: no one else is in it (a guard on the lock
        // holds a reference too, and is dropped first).
        if Arc::strong_count(&self.lock) == 2 {
            lines.remove(self.key);
        }
    }
}

impl Shared {
    /// Keeps `sender` as `key`'s latest idle connection, unless the upstream has as many as
    /// it may keep.
    fn put(self: &Arc<Self>, key: Key, sender: http1::SendRequest<ProxyBody>) {
        let mut all = self.idle.lock();
        let idle = all.entry(key).or_default();
        if idle.h1.len() >= self.max_idle {
            drop(all);
            drop(sender);
            return;
        }
        idle.h1.push((Instant::now(), sender));
        drop(all);
        self.reap_from_now();
    }

    /// Starts the task that closes idle connections as they expire, once.
    fn reap_from_now(self: &Arc<Self>) {
        if self.reaping.load(Ordering::Relaxed) || self.reaping.swap(true, Ordering::Relaxed) {
            return;
        }
        let every = self.idle_timeout.max(MIN_REAP);
        // Owned by the pool: ends at the first tick after the pool is dropped.
        tokio::spawn(reap(Arc::downgrade(self), every));
    }

    /// Takes the idle connections that have expired, and those closed, out of the pool.
    fn expired(&self) -> Vec<Conn> {
        let now = Instant::now();
        let mut out = Vec::new();
        self.idle.lock().retain(|_, idle| {
            let fresh = |at: &Instant| now - *at < self.idle_timeout;
            if idle
                .h2
                .as_ref()
                .is_some_and(|(used, h2)| !fresh(used) || h2.is_closed())
            {
                out.extend(idle.h2.take().map(|(_, h2)| Conn::H2(h2)));
            }
            let (keep, gone): (Vec<_>, Vec<_>) = std::mem::take(&mut idle.h1)
                .into_iter()
                .partition(|(at, sender)| fresh(at) && !sender.is_closed());
            idle.h1 = keep;
            out.extend(gone.into_iter().map(|(_, sender)| Conn::H1(sender)));
            !idle.h1.is_empty() || idle.h2.is_some()
        });
        out
    }
}

/// Closes expired idle connections every `every`, for as long as the pool lasts.
async fn reap(shared: Weak<Shared>, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        // Dropped after the lock: a connection's drop takes `Warm`'s.
        drop(shared.expired());
    }
}

/// Adds `Host` where the request has none: the URI's host, and its port unless the
/// scheme's own.
fn set_host(req: &mut Request<ProxyBody>) {
    if req.headers().contains_key(HOST) {
        return;
    }
    let uri = req.uri();
    let Some(host) = uri.host() else { return };
    let https = uri.scheme() == Some(&http::uri::Scheme::HTTPS);
    let value = match uri.port_u16() {
        Some(port) if port != if https { 443 } else { 80 } => {
            HeaderValue::from_str(&format!("{host}:{port}"))
        }
        _ => HeaderValue::from_str(host),
    };
    if let Ok(value) = value {
        req.headers_mut().insert(HOST, value);
    }
}

/// An HTTP/1.1 request line names the path and query alone (origin form).
fn origin_form(uri: &mut Uri) {
    *uri = match uri.path_and_query() {
        Some(path) if path.as_str() != "/" => {
            let mut parts = http::uri::Parts::default();
            parts.path_and_query = Some(path.clone());
            Uri::from_parts(parts).unwrap_or_default()
        }
        _ => Uri::default(),
    };
}

#[cfg(test)]
mod tests;
