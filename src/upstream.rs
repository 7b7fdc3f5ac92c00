//! The outbound side: the client requests are sent through ([`Upstream`]), over a pool of
//! HTTP/1.1 and h2 connections to upstreams over rustls (`pool`) and connections opened
//! ahead for paced requests ([`Warm`]), both kept in one table per upstream (`table`), which
//! a guarded TCP connector opens (`connector`: the address policy of `address`, the connect
//! timeout, a parent proxy).

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri, Version};
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::config::UpstreamConfig;
use crate::headers::strip_hop_by_hop;

mod address;
mod connector;
mod key;
mod pool;
pub mod stall;
mod table;
mod warm;

pub use address::{is_forbidden, AddressPolicy};
use connector::clone_connect_error;
pub use connector::{ConnectError, Connector};
pub use warm::{Busy, Expecting, NoConnectionInTime, Warm};

/// Errors of bodies flowing through pacegate.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body type of requests sent upstream and responses sent to clients.
pub type ProxyBody = BoxBody<Bytes, BoxError>;

/// Why an upstream exchange failed, classified for the client's answer.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The TCP connection could not be opened.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The TLS handshake with the upstream failed.
    #[error("TLS with upstream failed: {reason}")]
    Tls {
        /// rustls' description.
        reason: String,
        /// Whether the upstream's certificate was the problem (untrusted, wrong name, expired).
        certificate: bool,
    },
    /// No response head within the response timeout.
    #[error("no response from upstream within {}", humantime::format_duration(*.0))]
    Timeout(Duration),
    /// The connection broke or the upstream spoke invalid HTTP.
    #[error("upstream exchange failed: {0}")]
    Protocol(String),
    /// A paced request had no connection by the latest instant its slot allows; nothing was
    /// sent. It waits for another slot ([`NoConnectionInTime`]).
    #[error(transparent)]
    Late(#[from] NoConnectionInTime),
}

/// The outbound HTTP client: the pool, and what opens its connections.
#[derive(Clone)]
pub struct Upstream {
    pool: pool::Pool,
    warm: Warm,
    connector: Connector,
    response_timeout: Duration,
    /// `[proxy.limits] body_timeout` on response bodies, once set.
    stall: Option<stall::Stall>,
}

impl Upstream {
    /// Builds the client. `tls` must carry no ALPN; the connector offers h2 and HTTP/1.1.
    pub fn new(cfg: &UpstreamConfig, policy: AddressPolicy, tls: rustls::ClientConfig) -> Self {
        let mut connector = Connector::with_policy(policy, cfg.connect_timeout);
        if let Some(parent) = &cfg.proxy {
            connector = connector.through(parent.clone(), cfg.no_proxy.clone());
        }
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(connector.clone());
        let table = table::Table::new(cfg.pool_idle_timeout, cfg.pool_max_idle_per_host);
        let warm = Warm::new(https, table.clone(), cfg.connect_timeout);
        Self {
            pool: pool::Pool::new(table),
            warm,
            connector,
            response_timeout: cfg.response_timeout,
            stall: None,
        }
    }

    /// Cuts a response body that keeps its reader waiting as `stall` says.
    pub fn with_stall(mut self, stall: stall::Stall) -> Self {
        self.stall = Some(stall);
        self
    }

    /// A response body as the client side serves it, boxed once: cut as the stall bound
    /// says, where one is set.
    pub fn body<B>(&self, body: B) -> ProxyBody
    where
        B: http_body::Body<Data = Bytes> + Unpin + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        match &self.stall {
            Some(stall) => stall.bound(body),
            None => body.map_err(Into::into).boxed(),
        }
    }

    /// Waits while a connection to `uri`'s upstream is being opened and none is ready; see
    /// [`Warm::opened`].
    pub async fn opened(&self, uri: &Uri) -> Result<(), UpstreamError> {
        self.warm
            .opened(uri)
            .await
            .map_err(|e| classify_chain(&**e))
    }

    /// Waits while `uri`'s upstream has no connection and its first is being opened; see
    /// [`Warm::first`].
    pub async fn first_connection(&self, uri: &Uri) -> Result<(), UpstreamError> {
        self.warm.first(uri).await.map_err(|e| classify_chain(&**e))
    }

    /// The guarded connector, for blind tunnels.
    pub fn connector(&self) -> &Connector {
        &self.connector
    }

    /// A request to `uri` starts waiting for its slot: a connection is opened ahead for it
    /// if those open do not cover it (see [`Warm`]). Hand the guard to [`Upstream::send`].
    pub fn expect(&self, uri: &Uri) -> Expecting<'_> {
        self.warm.expect(uri)
    }

    /// Sends a request (absolute URI, HTTP/1.1 version) and waits for the response head. A
    /// paced request gives `by`, the latest instant its slot allows: without a connection by
    /// then, nothing is sent ([`UpstreamError::Late`]). The response comes back as the client
    /// is to see it: hop-by-hop headers removed, HTTP/1.1 (the client side's version).
    /// `expected` is the guard of a request that waited for its slot ([`Upstream::expect`]):
    /// it now counts as sent. The body comes as it arrives, not boxed: the caller boxes it
    /// once, with what it holds until the body ends ([`boxed`]).
    // Not an `async fn`: the request is handed to the pool before the future is made, so the
    // future holds the pool's (boxed) exchange and the guard, not the request and the guard it
    // was given beside them (about 600 bytes of a request's future, which is moved whole into
    // its connection's slot).
    pub fn send<'a>(
        &'a self,
        req: Request<ProxyBody>,
        by: Option<tokio::time::Instant>,
        expected: Option<Expecting<'a>>,
    ) -> impl Future<Output = Result<Response<Incoming>, UpstreamError>> + Send + 'a {
        let busy = match expected {
            Some(expecting) => expecting.sending(),
            None => self.warm.sending(req.uri()),
        };
        let key = busy.key().cloned();
        let exchange = Box::pin(self.pool.send(&self.warm, key, req, by));
        async move {
            let _busy = busy;
            match tokio::time::timeout(self.response_timeout, exchange).await {
                Err(_) => Err(UpstreamError::Timeout(self.response_timeout)),
                // pacegate never asks for an upgrade, and an interim answer is no answer: a
                // 1xx relayed as final leaves an HTTP/1.1 client a bare head on a dead
                // connection, and breaks an h2 client's whole connection.
                Ok(Ok(resp)) if resp.status().is_informational() => {
                    Err(UpstreamError::Protocol(format!(
                        "the upstream answered {} as a final response, which pacegate never asks for",
                        resp.status()
                    )))
                }
                Ok(Ok(mut resp)) => {
                    strip_hop_by_hop(resp.headers_mut());
                    *resp.version_mut() = Version::HTTP_11;
                    Ok(resp)
                }
                Ok(Err(e)) => Err(classify_chain(&*e)),
            }
        }
    }
}

/// An upstream response's body as the client side serves a body.
pub fn boxed(body: Incoming) -> ProxyBody {
    body.map_err(BoxError::from).boxed()
}

/// The most specific cause in `err`'s source chain.
fn classify_chain(err: &(dyn std::error::Error + 'static)) -> UpstreamError {
    let mut source = Some(err);
    let mut deepest = err.to_string();
    while let Some(e) = source {
        if let Some(c) = e.downcast_ref::<ConnectError>() {
            return UpstreamError::Connect(clone_connect_error(c));
        }
        if e.is::<NoConnectionInTime>() {
            return UpstreamError::Late(NoConnectionInTime);
        }
        // `io::Error::source` skips the error it wraps, so look inside explicitly.
        let inner = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|inner| inner as &(dyn std::error::Error + 'static));
        if let Some(t) = inner.unwrap_or(e).downcast_ref::<rustls::Error>() {
            return UpstreamError::Tls {
                reason: t.to_string(),
                certificate: matches!(t, rustls::Error::InvalidCertificate(_)),
            };
        }
        deepest = e.to_string();
        source = e.source();
    }
    UpstreamError::Protocol(deepest)
}
