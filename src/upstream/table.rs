//! Every upstream's connections in one table, under one lock, on tokio's clock: per upstream
//! (scheme, host and port), the connections being opened, those opened ahead and not yet
//! taken (the stash), the idle HTTP/1.1 ones and the shared h2 one, the requests waiting and
//! being sent, whether it speaks h2, and the line of requests opening its first connection.
//! [`super::warm`] opens connections into it, [`super::pool`] takes and hands back the ones
//! requests are sent on; one expiry ([`Host::expired`]) closes what sat unused for
//! `pool_idle_timeout`, stashed or idle.
//!
//! A connection is counted as alive from its handshake to its drop ([`Counted`]), which takes
//! the table's lock: a connection taken out under the lock is dropped after it.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hyper::client::conn::{http1, http2};
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_rustls::MaybeHttpsStream;
use hyper_util::client::legacy::connect::Connection;
use hyper_util::rt::TokioIo;
use parking_lot::{Mutex, MutexGuard};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::key::Key;
use super::{BoxError, ProxyBody};

/// The most connections opened ahead for requests waiting on one upstream.
const AHEAD: usize = 4;

/// The shortest period between two looks for expired connections.
const MIN_REAP: Duration = Duration::from_millis(100);

/// A connection as opened: TCP, then TLS for an https upstream.
pub(super) type Stream = MaybeHttpsStream<TokioIo<TcpStream>>;

/// A connection to send one request on.
pub(super) enum Conn {
    /// An HTTP/1.1 connection, held alone until the response is read.
    H1(http1::SendRequest<ProxyBody>),
    /// A handle on the upstream's h2 connection, shared.
    H2(http2::SendRequest<ProxyBody>),
}

/// The requests on one upstream, counted by their guards (`warm::Expecting`, `warm::Busy`)
/// without the table's lock: a request would otherwise take that lock, which every request on
/// every worker shares, three times (waiting, sent, answered), where it now takes it once. A
/// request counts as busy before it stops counting as waiting, so that one on its way never
/// looks like none; the entry can go only once both are zero (looked at under the lock).
#[derive(Default)]
pub(super) struct Requests {
    /// Being sent (from the send to the response head).
    pub(super) busy: AtomicUsize,
    /// Waiting for a slot.
    pub(super) waiting: AtomicUsize,
}

/// One upstream's connections.
#[derive(Default)]
pub(super) struct Host {
    /// Open: idle, in use or stashed.
    pub(super) alive: usize,
    /// Being opened ahead.
    pub(super) opening: usize,
    /// The requests on this upstream, waiting and being sent.
    pub(super) requests: Arc<Requests>,
    /// The upstream spoke h2: one connection serves every request.
    pub(super) h2: bool,
    /// Opened ahead, through their TCP and TLS handshakes, with the instant each landed.
    pub(super) stash: Vec<(Instant, Counted)>,
    /// Idle HTTP/1.1 connections, each with the instant it was handed back; the latest last.
    pub(super) idle: Vec<(Instant, http1::SendRequest<ProxyBody>)>,
    /// The upstream's h2 connection, with the instant a request last took it.
    pub(super) shared: Option<(Instant, http2::SendRequest<ProxyBody>)>,
    /// Told when a connection opened ahead lands in the stash, or fails.
    pub(super) landed: Arc<tokio::sync::Notify>,
    /// Why the last connection opened ahead failed, until one lands.
    pub(super) failed: Option<Arc<BoxError>>,
    /// The line of requests opening a connection to an upstream that may speak h2 (see
    /// [`Line`]).
    line: Option<Arc<tokio::sync::Mutex<()>>>,
}

/// Connections taken out of the table under its lock, to be dropped after it.
#[derive(Default)]
pub(super) struct Expired {
    stashed: Vec<Counted>,
    conns: Vec<Conn>,
}

impl Expired {
    fn len(&self) -> usize {
        self.stashed.len() + self.conns.len()
    }
}

impl Host {
    /// Nothing open, opening, sent, waiting or in line: the entry can go (a wildcard
    /// destination meets hosts without end).
    fn is_idle(&self) -> bool {
        self.alive == 0
            && self.opening == 0
            && self.requests.busy.load(Ordering::SeqCst) == 0
            && self.requests.waiting.load(Ordering::SeqCst) == 0
            && self.stash.is_empty()
            && self.idle.is_empty()
            && self.shared.is_none()
            && self.line.is_none()
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

    /// The one expiry: takes out what sat unused for `ttl` (stashed, idle, or the h2
    /// connection no request has taken for as long), and what the upstream closed; the
    /// caller drops them once the lock is released. A stashed connection the upstream closed
    /// is found, and dropped, when it is taken: this runs for every paced request, and a look
    /// at a socket costs a system call.
    fn expired(&mut self, ttl: Duration) -> Expired {
        let mut out = Expired::default();
        // Most hosts a paced request asks about have nothing unused: no clock for them.
        if self.stash.is_empty() && self.idle.is_empty() && self.shared.is_none() {
            return out;
        }
        let now = Instant::now();
        let fresh = |at: &Instant| now - *at < ttl;
        out.stashed = take_out(&mut self.stash, |at, _| fresh(at));
        if self
            .shared
            .as_ref()
            .is_some_and(|(used, h2)| !fresh(used) || h2.is_closed())
        {
            out.conns
                .extend(self.shared.take().map(|(_, h2)| Conn::H2(h2)));
        }
        let idle = take_out(&mut self.idle, |at, sender| {
            fresh(at) && !sender.is_closed()
        });
        out.conns.extend(idle.into_iter().map(Conn::H1));
        out
    }
}

/// Takes the entries of `list` that `keep` refuses out of it, in one pass where it keeps all.
fn take_out<T>(list: &mut Vec<(Instant, T)>, keep: impl Fn(&Instant, &T) -> bool) -> Vec<T> {
    if list.iter().all(|(at, t)| keep(at, t)) {
        return Vec::new();
    }
    let (kept, gone): (Vec<_>, Vec<_>) = std::mem::take(list)
        .into_iter()
        .partition(|(at, t)| keep(at, t));
    *list = kept;
    gone.into_iter().map(|(_, t)| t).collect()
}

/// The latest entry of `list` younger than `ttl` at `now` that is `usable`; those popped on
/// the way, too old or unusable, go to `dropped`.
fn pop_fresh<T>(
    list: &mut Vec<(Instant, T)>,
    now: Instant,
    ttl: Duration,
    usable: impl Fn(&T) -> bool,
    dropped: &mut Vec<T>,
) -> Option<T> {
    while let Some((at, t)) = list.pop() {
        if now - at < ttl && usable(&t) {
            return Some(t);
        }
        dropped.push(t);
    }
    None
}

/// Every upstream's entry. Looked up a few times a request, so hashed with aHash (keyed at
/// random per process, as SipHash is) rather than SipHash, several times faster on a short
/// key.
pub(super) type Map = HashMap<Key, Host, ahash::RandomState>;

/// `key`'s entry, made if it is new (the key is copied only then).
pub(super) fn host_of<'a>(all: &'a mut Map, key: &Key) -> &'a mut Host {
    if !all.contains_key(key) {
        all.insert(key.clone(), Host::default());
    }
    all.get_mut(key).expect("inserted above")
}

/// The table; shared by the pool, the connections opened ahead, and every connection counted.
pub(super) struct Table {
    hosts: Mutex<Map>,
    /// How long a connection may sit unused, stashed or idle: `pool_idle_timeout`, below
    /// the usual upstream keep-alive.
    pub(super) ttl: Duration,
    /// The most idle HTTP/1.1 connections kept for one upstream.
    max_idle: usize,
    /// Whether the task that closes expired connections runs (started with the first
    /// connection kept: the table may be made outside a runtime).
    reaping: AtomicBool,
}

impl Table {
    pub(super) fn new(ttl: Duration, max_idle: usize) -> Arc<Self> {
        Arc::new(Self {
            hosts: Mutex::default(),
            ttl,
            max_idle,
            reaping: AtomicBool::new(false),
        })
    }

    /// The table under its lock.
    pub(super) fn lock(&self) -> MutexGuard<'_, Map> {
        self.hosts.lock()
    }

    /// Applies `change` to `key`'s entry, and forgets it once nothing is left of it.
    pub(super) fn release(&self, key: &Key, change: impl FnOnce(&mut Host)) {
        let mut all = self.hosts.lock();
        if let Some(host) = all.get_mut(key) {
            change(host);
            if host.is_idle() {
                all.remove(key);
            }
        }
    }

    /// Applies `change` to `key`'s entry, and takes its expired connections out: they count
    /// as gone in the number of connections it is short of for its requests, which is
    /// counted as being opened. Says how many to open, and whether the upstream has no
    /// connection open (a cold one).
    pub(super) fn short(&self, key: &Key, change: impl FnOnce(&mut Host)) -> (usize, bool) {
        let (expired, short, cold) = {
            let mut all = self.hosts.lock();
            let host = host_of(&mut all, key);
            change(host);
            let expired = host.expired(self.ttl);
            // They still count as alive until they are dropped, after the lock.
            let short = host.short_after(expired.len(), key.https);
            host.opening += short;
            (expired, short, host.alive == 0)
        };
        drop(expired);
        (short, cold)
    }

    /// Whether `key`'s upstream speaks h2, as its open connections' handshakes chose; `None`
    /// for an https one with no connection open, whose handshake has yet to say.
    pub(super) fn speaks_h2(&self, key: &Key) -> Option<bool> {
        if !key.https {
            return Some(false);
        }
        let all = self.hosts.lock();
        all.get(key).filter(|h| h.alive > 0).map(|h| h.h2)
    }

    /// A connection opened ahead landed, or failed: it goes into the stash, and whoever
    /// waits for one is told.
    pub(super) fn land(self: &Arc<Self>, key: &Key, opened: Result<Stream, BoxError>) {
        let mut all = self.hosts.lock();
        let host = host_of(&mut all, key);
        host.opening -= 1;
        let stashed = match opened {
            Ok(stream) => {
                let counted = Counted::new(stream, self, key.clone(), host);
                host.stash.push((Instant::now(), counted));
                host.failed = None;
                true
            }
            Err(e) => {
                tracing::debug!("opening a connection ahead failed: {e}");
                host.failed = Some(Arc::new(e));
                false
            }
        };
        host.landed.notify_waiters();
        if host.is_idle() {
            all.remove(key);
        }
        drop(all);
        if stashed {
            self.reap_from_now();
        }
    }

    /// A stashed connection to `key` that is young and still open, if any.
    pub(super) fn take_stashed(&self, key: &Key) -> Option<Counted> {
        let mut stale = Vec::new();
        let found = {
            let mut all = self.hosts.lock();
            let host = all.get_mut(key)?;
            pop_fresh(
                &mut host.stash,
                Instant::now(),
                self.ttl,
                Counted::is_open,
                &mut stale,
            )
        };
        drop(stale);
        found
    }

    /// An idle connection to `key`'s upstream that can take a request, if any: its h2
    /// connection, or the HTTP/1.1 one handed back last. Those expired or closed are taken
    /// out on the way, and dropped after the lock.
    pub(super) fn checkout(&self, key: &Key) -> Option<Conn> {
        let mut dropped = Vec::new();
        let (found, closed) = {
            let mut all = self.hosts.lock();
            let host = all.get_mut(key)?;
            match &mut host.shared {
                Some((used, h2)) if !h2.is_closed() => {
                    *used = Instant::now();
                    return Some(Conn::H2(h2.clone()));
                }
                _ => {}
            }
            if host.idle.is_empty() && host.shared.is_none() {
                return None;
            }
            let closed = host.shared.take();
            let found = pop_fresh(
                &mut host.idle,
                Instant::now(),
                self.ttl,
                http1::SendRequest::is_ready,
                &mut dropped,
            );
            (found.map(Conn::H1), closed)
        };
        drop((dropped, closed));
        found
    }

    /// Keeps `sender` as `key`'s latest idle connection, unless the upstream has as many as
    /// it may keep.
    pub(super) fn put(self: &Arc<Self>, key: Key, sender: http1::SendRequest<ProxyBody>) {
        let mut all = self.hosts.lock();
        let host = host_of(&mut all, &key);
        if host.idle.len() >= self.max_idle {
            drop(all);
            drop(sender);
            return;
        }
        host.idle.push((Instant::now(), sender));
        drop(all);
        self.reap_from_now();
    }

    /// Keeps `sender` as `key`'s h2 connection, for every request to its upstream; one opened
    /// at the same time is replaced (requests on it finish, then it closes).
    pub(super) fn share(self: &Arc<Self>, key: &Key, sender: http2::SendRequest<ProxyBody>) {
        let replaced = host_of(&mut self.hosts.lock(), key)
            .shared
            .replace((Instant::now(), sender));
        drop(replaced);
        self.reap_from_now();
    }

    /// Starts the task that closes connections as they expire, once.
    fn reap_from_now(self: &Arc<Self>) {
        if self.reaping.load(Ordering::Relaxed) || self.reaping.swap(true, Ordering::Relaxed) {
            return;
        }
        let every = self.ttl.max(MIN_REAP);
        // Owned by the table: ends at the first tick after the table is dropped.
        tokio::spawn(reap(Arc::downgrade(self), every));
    }

    /// Takes every upstream's expired connections out of the table.
    fn expire_all(&self) -> Vec<Expired> {
        let mut out = Vec::new();
        self.hosts.lock().retain(|_, host| {
            let expired = host.expired(self.ttl);
            if expired.len() > 0 {
                out.push(expired);
            }
            !host.is_idle()
        });
        out
    }
}

/// Closes expired connections every `every`, for as long as the table lasts.
async fn reap(table: Weak<Table>, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(table) = table.upgrade() else {
            return;
        };
        // Dropped after the lock: a connection's drop takes it.
        drop(table.expire_all());
    }
}

/// A request's place in line to open a connection to an upstream that may speak h2 (see
/// `Pool::connect_one`): the line is the upstream's, and goes with the last request in it.
pub(super) struct Line<'a> {
    table: &'a Table,
    key: &'a Key,
    pub(super) lock: Arc<tokio::sync::Mutex<()>>,
}

impl<'a> Line<'a> {
    pub(super) fn join(table: &'a Table, key: &'a Key) -> Self {
        let lock = host_of(&mut table.hosts.lock(), key)
            .line
            .get_or_insert_default()
            .clone();
        Self { table, key, lock }
    }
}

impl Drop for Line<'_> {
    fn drop(&mut self) {
        // The entry's own reference and this one: no one else is in line (a guard on the
        // lock holds a reference too, and is dropped first). Looked at under the table's
        // lock, which a request joining the line takes.
        self.table.release(self.key, |host| {
            if Arc::strong_count(&self.lock) == 2 {
                host.line = None;
            }
        });
    }
}

/// A connection, counted as alive until it drops.
pub(super) struct Counted {
    stream: Stream,
    table: Arc<Table>,
    key: Key,
}

impl Counted {
    /// `stream`, counted in `host` (`key`'s entry of `table`, under its lock).
    pub(super) fn new(stream: Stream, table: &Arc<Table>, key: Key, host: &mut Host) -> Self {
        host.alive += 1;
        host.h2 |= stream.connected().is_negotiated_h2();
        Self {
            stream,
            table: table.clone(),
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
        self.table.release(&self.key, |h| h.alive -= 1);
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
