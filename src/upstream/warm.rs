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
//! What it counts and stashes is kept in the one table of every upstream's connections
//! ([`super::table`]). An upstream that speaks h2 multiplexes one connection: none is opened
//! ahead for it. A stashed connection is used within `pool_idle_timeout` or dropped, and one
//! the upstream has closed meanwhile is dropped rather than handed out.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::Uri;
use hyper_rustls::HttpsConnector;
use tower_service::Service;

use super::connector::{ConnectError, Connector};
use super::key::{key_of, Key};
use super::table::{host_of, Counted, Host, Map, Requests, Stream, Table};
use super::BoxError;

/// No connection could be handed out by the latest instant the request's slot allows (given
/// to [`crate::upstream::Upstream::send`]): sent later, it would not go on its slot. The
/// connection being opened for it goes on into the stash.
#[derive(Debug, thiserror::Error)]
#[error("no upstream connection by the latest instant the request's slot allows")]
pub struct NoConnectionInTime;

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
    /// Every upstream's connections and requests.
    table: Arc<Table>,
    /// The connect timeout, over TCP and TLS together.
    open_timeout: Duration,
    /// Connections opened ahead, for tests and benches.
    opened_ahead: std::sync::atomic::AtomicU64,
}

impl Warm {
    /// Opens connections with `inner` into `table`, each within `open_timeout`.
    pub(super) fn new(
        inner: HttpsConnector<Connector>,
        table: Arc<Table>,
        open_timeout: Duration,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                inner,
                table,
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
            table: &self.shared.table,
            counted: key.zip(requests),
        }
    }

    /// A request to `uri` is being sent: counted as busy until the guard drops.
    pub fn sending(&self, uri: &Uri) -> Busy<'_> {
        let counted = key_of(uri).map(|key| {
            // Counted under the lock: a host seen with nothing left may be forgotten.
            let mut all = self.shared.table.lock();
            let requests = host_of(&mut all, &key).requests.clone();
            requests.busy.fetch_add(1, Ordering::SeqCst);
            (key, requests)
        });
        Busy {
            table: &self.shared.table,
            counted,
        }
    }

    /// Applies `change` to `key`'s counts, then opens as many connections into the stash as
    /// it is short of (see [`Table::short`]). Says whether the upstream has no connection
    /// open (a cold one).
    fn top_up(&self, key: &Key, uri: &Uri, change: impl FnOnce(&mut Host)) -> bool {
        let (short, cold) = self.shared.table.short(key, change);
        for _ in 0..short {
            let (opening, table, key) = (
                self.open(uri.clone()),
                self.shared.table.clone(),
                key.clone(),
            );
            self.shared
                .opened_ahead
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // Owned by the host's count (`opening`): ends within the connect timeout.
            tokio::spawn(async move { table.land(&key, opening.await) });
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
        let landed = |all: &Map| {
            all.get(&key)
                .filter(|h| pending(h))
                .map(|h| h.landed.clone())
        };
        let mut waited = false;
        loop {
            let Some(next) = landed(&self.shared.table.lock()) else {
                break;
            };
            let notified = next.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if landed(&self.shared.table.lock()).is_none() {
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
            .table
            .lock()
            .get(&key)
            .filter(|h| waited && h.alive == 0 && h.opening == 0)
            .and_then(|h| h.failed.clone());
        failed.map_or(Ok(()), Err)
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
                    let all = this.shared.table.lock();
                    let host = all.get(&key);
                    match host {
                        Some(h) if h.opening > 0 || !h.stash.is_empty() => Some(h.landed.clone()),
                        _ => None,
                    }
                };
                let Some(landed) = landed else { break };
                let notified = landed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if let Some(conn) = this.shared.table.take_stashed(&key) {
                    // Whoever still waits gets the next one opened now.
                    this.top_up(&key, &uri, |_| {});
                    return Ok(conn);
                }
                if this
                    .shared
                    .table
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
                        host_of(&mut this.shared.table.lock(), &key).opening += 1;
                        let table = this.shared.table.clone();
                        // As one opened ahead: ends within the connect timeout.
                        tokio::spawn(async move { table.land(&key, connecting.await) });
                        return Err(NoConnectionInTime.into());
                    }
                },
            };
            let stream = opened?;
            let mut all = this.shared.table.lock();
            let host = host_of(&mut all, &key);
            Ok(Counted::new(stream, &this.shared.table, key, host))
        }
    }
}

/// Counts a request waiting for its slot (see [`Warm::expect`]), in its upstream's
/// `Requests`: the line its reference count sits on is the one the counts write anyway.
pub struct Expecting<'a> {
    table: &'a Table,
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
            table: self.table,
            counted,
        }
    }
}

impl Drop for Expecting<'_> {
    fn drop(&mut self) {
        if let Some((key, requests)) = &self.counted {
            requests.waiting.fetch_sub(1, Ordering::SeqCst);
            self.table.release(key, |_| {});
        }
    }
}

/// Counts a request being sent (see [`Warm::sending`]).
pub struct Busy<'a> {
    table: &'a Table,
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
                self.table.release(key, |_| {});
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests;
