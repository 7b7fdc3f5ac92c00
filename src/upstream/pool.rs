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
//! requests instead). What it keeps is in the one table of every upstream's connections
//! ([`super::table`]): a request takes its lock once to check out and once to hand back, and
//! hashes its key (with aHash) at each.

use std::sync::Arc;

use http::header::{HeaderValue, HOST};
use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::connector::ConnectError;
use super::key::Key;
use super::table::{Conn, Line, Table};
use super::warm::{NoConnectionInTime, Warm};
use super::{BoxError, ProxyBody};

/// The pool: requests' side of the table of every upstream's connections.
#[derive(Clone)]
pub(super) struct Pool {
    table: Arc<Table>,
}

impl Pool {
    pub(super) fn new(table: Arc<Table>) -> Self {
        Self { table }
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
            let (conn, reused) = match self.table.checkout(&key) {
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
        if self.table.speaks_h2(key) == Some(false) {
            return Ok((self.connect(warm, key, uri, by).await?, false));
        }
        let line = Line::join(&self.table, key);
        let held = match by {
            Some(by) => tokio::time::timeout_at(by, line.lock.clone().lock_owned())
                .await
                .map_err(|_| NoConnectionInTime)?,
            None => line.lock.clone().lock_owned().await,
        };
        if let Some(conn) = self.table.checkout(key) {
            return Ok((conn, true));
        }
        if self.table.speaks_h2(key) == Some(false) {
            // Learned meanwhile: the next in line need not wait for this one's handshakes.
            drop(held);
            drop(line);
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
            self.table.share(key, sender.clone());
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
            self.table.put(key, sender);
            return;
        }
        let table = Arc::downgrade(&self.table);
        // Owned by the response's body: ends when the body is read to its end (the
        // connection is then ready) or dropped (an error).
        tokio::spawn(async move {
            // An error: the upstream closed it, or the response was not read to its end.
            if sender.ready().await.is_ok() {
                if let Some(table) = table.upgrade() {
                    table.put(key, sender);
                }
            }
        });
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
