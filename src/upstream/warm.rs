//! Connections opened ahead of their request. A paced request waits for its slot; if it then
//! had to open a connection (TCP, then TLS), it would reach the upstream that much after its
//! slot, and bunch with the next one. So a request that starts waiting says so
//! ([`Warm::expect`]), and when the upstream's connections do not cover those in use and those
//! waiting (a few at most), one is opened at once into a small stash. The pool asks for a
//! connection ([`Warm::connection`]) only when it has none idle; it then gets a stashed one,
//! already through its handshakes, and the stash is topped up for whoever still waits.
//!
//! This is also where a paced request's send check ends: the pool asks for a connection only
//! when it has none idle, and a request that would wait for one past the latest instant its
//! slot allows (the `by` it is given) is refused with [`NoConnectionInTime`] rather than
//! sent late. The connection it waited for goes on opening, into the stash. Opening, TCP and
//! TLS together, is bounded by the connect timeout.
//!
//! Connections are counted from the handshake to their drop (pooled, in use or stashed), per
//! scheme, host and port. An upstream that speaks h2 multiplexes one connection: none is opened
//! ahead for it. A stashed connection is used within `pool_idle_timeout` or dropped, and one the
//! upstream has closed meanwhile is dropped rather than handed out.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::uri::Authority;
use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::Connection;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tower_service::Service;

use super::{ConnectError, Connector};
use crate::upstream::BoxError;

/// The most connections opened ahead for requests waiting on one upstream.
const AHEAD: usize = 4;

type Stream = MaybeHttpsStream<TokioIo<TcpStream>>;

/// An upstream as the pool keeps its connections: whether https, and the authority with its
/// port. Compared and hashed as the bytes it is written in, in one piece: pacegate writes
/// every upstream's host normalised (see `proxy::forward::prepare`), and the pool looks up
/// the authority the request names. (`Authority`'s own hash lowercases it a byte
/// at a time, on every lookup.)
#[derive(Clone, Debug)]
pub(super) struct Key {
    https: bool,
    authority: Authority,
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.https == other.https && self.authority.as_str() == other.authority.as_str()
    }
}

impl Eq for Key {}

impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.https.hash(state);
        self.authority.as_str().hash(state);
    }
}

pub(super) fn key_of(uri: &Uri) -> Option<Key> {
    let https = uri.scheme() == Some(&http::uri::Scheme::HTTPS);
    let authority = uri.authority()?;
    if has_port(authority.as_str()) {
        // Shares the URI's bytes: no copy on the request path, where the port is always
        // given (and written as pacegate writes it, see `proxy::forward::prepare`).
        return Some(Key {
            https,
            authority: authority.clone(),
        });
    }
    let port = if https { 443 } else { 80 };
    let authority = format!("{}:{port}", authority.host()).parse().ok()?;
    Some(Key { https, authority })
}

/// Whether an authority ends in `:` and digits, which `Authority::port_u16` would read as a
/// port: looked at from the end, where `port_u16` searches the whole text for a colon (a few
/// hundred instructions, on every request). `[::1]` has none; `[::1]:443` has one.
fn has_port(authority: &str) -> bool {
    let digits = authority
        .bytes()
        .rev()
        .take_while(u8::is_ascii_digit)
        .count();
    let (rest, port) = authority.split_at(authority.len() - digits);
    rest.ends_with(':') && port.parse::<u16>().is_ok()
}

/// No connection could be handed out by the latest instant the request's slot allows (given
/// to [`crate::upstream::Upstream::send`]): sent later, it would not go on its slot. The connection being opened for it goes on into the stash.
#[derive(Debug, thiserror::Error)]
#[error("no upstream connection by the latest instant the request's slot allows")]
pub struct NoConnectionInTime;

/// The requests on one upstream, counted by their guards ([`Expecting`], [`Busy`]) without
/// the hosts' lock: a request would otherwise take that lock, which every request on every
/// worker shares, three times (waiting, sent, answered), where it now takes it once. A request
/// counts as busy before it stops counting as waiting, so that one on its way never looks
/// like none; the entry can go only once both are zero (looked at under the lock).
#[derive(Default)]
struct Requests {
    /// Being sent (from the send to the response head).
    busy: AtomicUsize,
    /// Waiting for a slot.
    waiting: AtomicUsize,
}

/// One upstream's connections.
#[derive(Default)]
struct Host {
    /// Open: pooled, in use or stashed.
    alive: usize,
    /// Being opened ahead.
    opening: usize,
    /// The requests on this upstream, waiting and being sent.
    requests: Arc<Requests>,
    /// The upstream spoke h2: one connection serves every request.
    h2: bool,
    stash: Vec<(Instant, Counted)>,
    /// Told when a connection opened ahead lands in the stash, or fails.
    landed: Arc<tokio::sync::Notify>,
    /// Why the last connection opened ahead failed, until one lands.
    failed: Option<Arc<BoxError>>,
}

impl Host {
    /// Nothing open, opening, sent or waiting: the entry can go (a wildcard destination meets
    /// hosts without end).
    fn is_idle(&self) -> bool {
        self.alive == 0
            && self.opening == 0
            && self.requests.busy.load(Ordering::SeqCst) == 0
            && self.requests.waiting.load(Ordering::SeqCst) == 0
            && self.stash.is_empty()
    }

    /// Connections to open now for the requests in use and waiting, once `gone` of those
    /// open are dropped. One at most while an https upstream has none open: it may answer
    /// in h2, and then one connection serves every request.
    fn short_after(&self, gone: usize, https: bool) -> usize {
        if self.h2 {
            return 0;
        }
        let alive = self.alive.saturating_sub(gone);
        let want = self.requests.busy.load(Ordering::SeqCst)
            + self.requests.waiting.load(Ordering::SeqCst).min(AHEAD);
        let want = if https && alive == 0 {
            want.min(1)
        } else {
            want
        };
        want.saturating_sub(alive + self.opening)
    }

    /// Takes the stashed connections too old to use out of the stash; the caller drops them
    /// once the lock is released. By age alone: this runs for every paced request, and one
    /// the upstream closed is found, and dropped, when it is taken.
    fn drain_stale(&mut self, ttl: Duration) -> Vec<Counted> {
        // Most hosts have nothing stashed (their pooled connections serve): no clock for them.
        if self.stash.is_empty() {
            return Vec::new();
        }
        let now = Instant::now();
        let fresh = |at: &Instant| now - *at < ttl;
        if self.stash.iter().all(|(at, _)| fresh(at)) {
            return Vec::new();
        }
        let (keep, stale): (Vec<_>, Vec<_>) = std::mem::take(&mut self.stash)
            .into_iter()
            .partition(|(at, _)| fresh(at));
        self.stash = keep;
        stale.into_iter().map(|(_, conn)| conn).collect()
    }
}

/// A connection opened ahead is through its handshakes, or failed: it goes into the stash,
/// and whoever waits for one is told.
fn land(hosts: &Hosts, key: &Key, opened: Result<Stream, BoxError>) {
    let mut all = hosts.lock();
    let host = host_of(&mut all, key);
    host.opening -= 1;
    match opened {
        Ok(stream) => {
            let counted = Counted::new(stream, hosts, key.clone(), host);
            host.stash.push((Instant::now(), counted));
            host.failed = None;
        }
        Err(e) => {
            tracing::debug!("opening a connection ahead failed: {e}");
            host.failed = Some(Arc::new(e));
        }
    }
    host.landed.notify_waiters();
    if host.is_idle() {
        all.remove(key);
    }
}

/// `key`'s entry, made if it is new (the key is copied only then).
fn host_of<'a>(all: &'a mut Map, key: &Key) -> &'a mut Host {
    if !all.contains_key(key) {
        all.insert(key.clone(), Host::default());
    }
    all.get_mut(key).expect("inserted above")
}

/// Every upstream's counts. Looked up three times a request, so hashed with aHash
/// (keyed at random per process, as SipHash is) rather than SipHash, several times faster on
/// a short key.
type Map = HashMap<Key, Host, ahash::RandomState>;

type Hosts = Arc<Mutex<Map>>;

/// Applies `change` to `key`'s counts, and forgets the host once nothing is left of it.
fn release(hosts: &Hosts, key: &Key, change: impl FnOnce(&mut Host)) {
    let mut all = hosts.lock();
    if let Some(host) = all.get_mut(key) {
        change(host);
        if host.is_idle() {
            all.remove(key);
        }
    }
}

/// The connector with a stash of connections opened ahead.
// One reference to what it holds: a connection being opened holds a clone of it for as long
// as it takes, opened ahead or not.
#[derive(Clone)]
pub struct Warm {
    shared: Arc<Shared>,
}

/// What every clone of a [`Warm`] shares.
struct Shared {
    /// Opens a connection: TCP under the address policy (through the parent proxy where one
    /// is set), then TLS for an https URI.
    inner: HttpsConnector<Connector>,
    /// Each upstream's connections opened ahead and its requests' counts.
    hosts: Hosts,
    /// How long a stashed connection may wait for its request: as long as an idle pooled
    /// one (`pool_idle_timeout`), below the usual upstream keep-alive.
    ttl: Duration,
    /// The connect timeout, over TCP and TLS together.
    open_timeout: Duration,
    /// Connections opened ahead, for tests and benches.
    opened_ahead: std::sync::atomic::AtomicU64,
}

impl Warm {
    pub fn new(inner: HttpsConnector<Connector>, ttl: Duration, open_timeout: Duration) -> Self {
        Self {
            shared: Arc::new(Shared {
                inner,
                hosts: Arc::default(),
                ttl,
                open_timeout,
                opened_ahead: Default::default(),
            }),
        }
    }

    /// Opens a connection to `uri`, TCP and TLS, within the connect timeout. The connector
    /// bounds the TCP connect alone; a handshake the upstream never answers would otherwise
    /// hold a connection being opened, and every request waiting for it, for ever.
    fn open(&self, uri: Uri) -> impl Future<Output = Result<Stream, BoxError>> + Send + 'static {
        let mut inner = self.shared.inner.clone();
        let after = self.shared.open_timeout;
        async move {
            let host = uri.host().unwrap_or_default().to_owned();
            match tokio::time::timeout(after, inner.call(uri)).await {
                Ok(opened) => opened,
                Err(_) => Err(Box::new(ConnectError::Timeout { host, after }) as BoxError),
            }
        }
    }

    /// Whether `key`'s upstream speaks h2, as its open connections' handshakes chose; `None`
    /// for an https one with no connection open, whose handshake has yet to say.
    pub(super) fn speaks_h2(&self, key: &Key) -> Option<bool> {
        if !key.https {
            return Some(false);
        }
        let hosts = self.shared.hosts.lock();
        hosts.get(key).filter(|h| h.alive > 0).map(|h| h.h2)
    }

    /// Connections opened ahead so far.
    pub fn opened_ahead(&self) -> u64 {
        self.shared
            .opened_ahead
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A request to `uri` starts waiting for its slot: opens a connection ahead if those open
    /// do not cover it. The returned guard counts it until it is sent or gives up.
    pub fn expect(&self, uri: &Uri) -> Expecting<'_> {
        let key = key_of(uri);
        let mut requests = None;
        let cold = key.as_ref().is_some_and(|key| {
            self.top_up(key, uri, |host| {
                host.requests.waiting.fetch_add(1, Ordering::SeqCst);
                requests = Some(host.requests.clone());
            })
        });
        Expecting {
            cold,
            hosts: &self.shared.hosts,
            counted: key.zip(requests),
        }
    }

    /// A request to `uri` is being sent: counted as busy until the guard drops.
    pub fn sending(&self, uri: &Uri) -> Busy<'_> {
        let counted = key_of(uri).map(|key| {
            // Counted under the lock: a host seen with nothing left may be forgotten.
            let mut all = self.shared.hosts.lock();
            let requests = host_of(&mut all, &key).requests.clone();
            requests.busy.fetch_add(1, Ordering::SeqCst);
            (key, requests)
        });
        Busy {
            hosts: &self.shared.hosts,
            counted,
        }
    }

    /// Applies `change` to `key`'s counts, then opens as many connections into the stash as
    /// it is short of, under one lock. Stashed connections too old to use count for nothing:
    /// they are dropped first.
    /// Says whether the upstream has no connection open (a cold one).
    fn top_up(&self, key: &Key, uri: &Uri, change: impl FnOnce(&mut Host)) -> bool {
        let (stale, short, cold) = {
            let mut hosts = self.shared.hosts.lock();
            let host = host_of(&mut hosts, key);
            change(host);
            let stale = host.drain_stale(self.shared.ttl);
            // They still count as alive until they are dropped, after the lock.
            let short = host.short_after(stale.len(), key.https);
            host.opening += short;
            (stale, short, host.alive == 0)
        };
        drop(stale);
        for _ in 0..short {
            let (opening, hosts, key) = (
                self.open(uri.clone()),
                self.shared.hosts.clone(),
                key.clone(),
            );
            self.shared
                .opened_ahead
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // Owned by the host's count (`opening`): ends within the connect timeout.
            tokio::spawn(async move { land(&hosts, &key, opening.await) });
        }
        cold
    }

    /// Waits, while `uri`'s upstream has no connection at all and one is being opened (by
    /// [`Warm::expect`]), for it to land: a request to a cold upstream takes its connection
    /// before its slot. The pool has nothing to hand it, and a slot due at once would be past
    /// by the time the handshakes are done. Fails as that connection failed: a slot is not
    /// spent on an upstream that cannot be reached.
    pub async fn first(&self, uri: &Uri) -> Result<(), Arc<BoxError>> {
        self.landing(uri, |h| h.alive == 0 && h.opening > 0, false)
            .await
    }

    /// Waits, while connections to `uri`'s upstream are being opened and none is stashed,
    /// for the next one to land: a request that had [`NoConnectionInTime`] asks for its next
    /// slot once the connection opened for it is there, rather than spend slots while it
    /// opens. Once only: where requests keep taking connections as they land, another wait
    /// could last as long as they do. Fails as [`Warm::first`] does.
    pub async fn opened(&self, uri: &Uri) -> Result<(), Arc<BoxError>> {
        self.landing(uri, |h| h.opening > 0 && h.stash.is_empty(), true)
            .await
    }

    /// Waits for connections to `uri`'s upstream to land while `pending` holds of its
    /// counts; after the first landing if `once`. After a wait, with no connection open and
    /// none opening, the last one's failure.
    async fn landing(
        &self,
        uri: &Uri,
        pending: impl Fn(&Host) -> bool,
        once: bool,
    ) -> Result<(), Arc<BoxError>> {
        let Some(key) = key_of(uri) else {
            return Ok(());
        };
        let landed = |hosts: &Map| {
            hosts
                .get(&key)
                .filter(|h| pending(h))
                .map(|h| h.landed.clone())
        };
        let mut waited = false;
        loop {
            let Some(next) = landed(&self.shared.hosts.lock()) else {
                break;
            };
            let notified = next.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if landed(&self.shared.hosts.lock()).is_none() {
                break;
            }
            notified.await;
            waited = true;
            if once {
                break;
            }
        }
        let failed = self
            .shared
            .hosts
            .lock()
            .get(&key)
            .filter(|h| waited && h.alive == 0 && h.opening == 0)
            .and_then(|h| h.failed.clone());
        failed.map_or(Ok(()), Err)
    }

    /// A stashed connection to `key` that is young and still open, if any.
    fn take(&self, key: &Key) -> Option<Counted> {
        // A connection's drop takes the lock: the stale ones are dropped after it.
        let mut stale = Vec::new();
        let found = {
            let mut hosts = self.shared.hosts.lock();
            let host = hosts.get_mut(key)?;
            let now = Instant::now();
            let mut found = None;
            while let Some((at, conn)) = host.stash.pop() {
                if now - at < self.shared.ttl && conn.is_open() {
                    found = Some(conn);
                    break;
                }
                stale.push(conn);
            }
            found
        };
        drop(stale);
        found
    }

    /// A connection to `uri`'s upstream (`key`) for the pool, which has none idle: one
    /// opened ahead, or one being opened for a request that waited, or a new one. `by`, for
    /// a paced request, is the latest instant its slot allows: without a connection by then,
    /// it is refused with [`NoConnectionInTime`], and the connection it waited for goes on
    /// opening, into the stash.
    pub(super) fn connection(
        &self,
        key: Key,
        uri: Uri,
        by: Option<tokio::time::Instant>,
    ) -> impl Future<Output = Result<Counted, BoxError>> + Send + 'static {
        let this = self.clone();
        async move {
            // A connection opened ahead, or one on its way: a request that did not wait for
            // its slot takes the one opened for it rather than open a second.
            loop {
                let landed = {
                    let hosts = this.shared.hosts.lock();
                    let host = hosts.get(&key);
                    match host {
                        Some(h) if h.opening > 0 || !h.stash.is_empty() => Some(h.landed.clone()),
                        _ => None,
                    }
                };
                let Some(landed) = landed else { break };
                let notified = landed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if let Some(conn) = this.take(&key) {
                    // Whoever still waits gets the next one opened now.
                    this.top_up(&key, &uri, |_| {});
                    return Ok(conn);
                }
                if this
                    .shared
                    .hosts
                    .lock()
                    .get(&key)
                    .is_none_or(|h| h.opening == 0)
                {
                    break;
                }
                match by {
                    Some(by) => {
                        if tokio::time::timeout_at(by, notified).await.is_err() {
                            return Err(NoConnectionInTime.into());
                        }
                    }
                    None => notified.await,
                }
            }
            let mut connecting = Box::pin(this.open(uri));
            let opened = match by {
                None => connecting.await,
                Some(by) => match tokio::time::timeout_at(by, &mut connecting).await {
                    Ok(opened) => opened,
                    Err(_) => {
                        // Not wasted: it goes on opening, into the stash, for the next slot.
                        host_of(&mut this.shared.hosts.lock(), &key).opening += 1;
                        let hosts = this.shared.hosts.clone();
                        // As one opened ahead: ends within the connect timeout.
                        tokio::spawn(async move { land(&hosts, &key, connecting.await) });
                        return Err(NoConnectionInTime.into());
                    }
                },
            };
            let stream = opened?;
            let mut all = this.shared.hosts.lock();
            let host = host_of(&mut all, &key);
            Ok(Counted::new(stream, &this.shared.hosts, key, host))
        }
    }
}

/// Counts a request waiting for its slot (see [`Warm::expect`]), in its upstream's
/// `Requests`: the line its reference count sits on is the one the counts write anyway.
pub struct Expecting<'a> {
    hosts: &'a Hosts,
    counted: Option<(Key, Arc<Requests>)>,
    /// The upstream had no connection open when the request started waiting.
    cold: bool,
}

impl<'a> Expecting<'a> {
    /// Whether the upstream had no connection open: only then is [`Warm::first`] worth a
    /// look (it takes the lock again).
    pub fn cold(&self) -> bool {
        self.cold
    }

    /// The request is being sent: no longer waiting, busy until the guard drops. Counted
    /// without the lock.
    pub fn sending(mut self) -> Busy<'a> {
        let counted = self.counted.take();
        if let Some((_, requests)) = &counted {
            requests.busy.fetch_add(1, Ordering::SeqCst);
            requests.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        Busy {
            hosts: self.hosts,
            counted,
        }
    }
}

impl Drop for Expecting<'_> {
    fn drop(&mut self) {
        if let Some((key, requests)) = &self.counted {
            requests.waiting.fetch_sub(1, Ordering::SeqCst);
            release(self.hosts, key, |_| {});
        }
    }
}

/// Counts a request being sent (see [`Warm::sending`]).
pub struct Busy<'a> {
    hosts: &'a Hosts,
    counted: Option<(Key, Arc<Requests>)>,
}

impl Busy<'_> {
    /// The upstream the request goes to, as the pool keys it (none for a URI with no host).
    pub(super) fn key(&self) -> Option<&Key> {
        self.counted.as_ref().map(|(key, _)| key)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        if let Some((key, requests)) = &self.counted {
            // The last one sent may leave the host with nothing: only then the lock.
            if requests.busy.fetch_sub(1, Ordering::SeqCst) == 1 {
                release(self.hosts, key, |_| {});
            }
        }
    }
}

/// A connection, counted as alive until it drops.
pub(super) struct Counted {
    stream: Stream,
    hosts: Hosts,
    key: Key,
}

impl Counted {
    fn new(stream: Stream, hosts: &Hosts, key: Key, host: &mut Host) -> Self {
        host.alive += 1;
        host.h2 |= stream.connected().is_negotiated_h2();
        Self {
            stream,
            hosts: hosts.clone(),
            key,
        }
    }

    /// Whether the upstream's TLS handshake chose h2.
    pub(super) fn is_h2(&self) -> bool {
        self.stream.connected().is_negotiated_h2()
    }

    /// Whether the upstream has not closed it: no end of stream waiting to be read.
    fn is_open(&self) -> bool {
        let tcp = match &self.stream {
            MaybeHttpsStream::Http(io) => io.inner(),
            MaybeHttpsStream::Https(tls) => tls.inner().get_ref().0.inner().inner(),
        };
        let mut byte = [0u8; 1];
        let mut buf = tokio::io::ReadBuf::new(&mut byte);
        let mut cx = Context::from_waker(Waker::noop());
        !matches!(
            tcp.poll_peek(&mut cx, &mut buf),
            Poll::Ready(Ok(0) | Err(_))
        )
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        release(&self.hosts, &self.key, |h| h.alive -= 1);
    }
}

impl Read for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl Write for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }
}

#[cfg(test)]
pub(super) mod tests;
