//! CONNECT: intercepted sessions (TLS terminated with a minted leaf, inner requests forwarded)
//! and blind byte tunnels.
//!
//! The 200 is returned at once and the upgraded connection is taken over in a tracked task:
//! awaiting the upgrade inside the service would deadlock, since hyper only completes it after
//! the response has been written.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use super::peek::Peeked;
use super::respond::{Outcome, ProxyError};
use super::{Handled, Proxy, Target};
use crate::pacing::{Admission, Asking, Note};
use crate::server::{self, ConnectionSlot, Ended, Handler};
use crate::tls::LeafSource;
use crate::upstream::ProxyBody;

const INTERCEPT: &str = "intercept";
const BLIND: &str = "blind";

fn established() -> Response<ProxyBody> {
    Response::new(Empty::new().map_err(|never| match never {}).boxed())
}

impl Proxy {
    /// Answers a CONNECT whose target was already authorised and routed.
    pub(super) async fn connect(&self, req: Request<Incoming>, target: Target) -> Handled {
        let Some(route) = target.destination.clone() else {
            return self.tunnel(req, target, None).await;
        };
        if route.pace().intercept {
            return self.intercept(req, target);
        }
        // `intercept = false`: the tunnel takes one slot (of its key's budget, by what the
        // CONNECT shows) and sees no verdicts.
        let asking = Asking {
            host: &target.host,
            user: target.user.as_deref(),
            headers: req.headers(),
            client: target.client,
            body: None,
        };
        match self.inner.pacer.tunnel(route, &asking, target.class).await {
            Ok(admission) => self.tunnel(req, target, Some(admission)).await,
            Err(e) => Handled::refused(ProxyError::Paced(e), target.name(), target.authority()),
        }
    }

    fn intercept(&self, req: Request<Incoming>, target: Target) -> Handled {
        let metrics = &self.inner.metrics;
        // The leaf is for the CONNECT host, whatever SNI the client sends later.
        let config = match self.inner.authority.server_config(&target.host) {
            Ok((config, source)) => {
                let result = if source == LeafSource::Cached {
                    "hit"
                } else {
                    "miss"
                };
                metrics.cert_cache.with_label_values(&[result]).inc();
                metrics
                    .cert_cache_entries
                    .set(self.inner.authority.cached_leaves() as i64);
                config
            }
            Err(e) => {
                return Handled::refused(
                    ProxyError::Internal(format!(
                        "cannot mint a certificate for {}: {e}",
                        target.host
                    )),
                    target.name(),
                    target.authority(),
                )
            }
        };
        let handled = Handled {
            response: established(),
            outcome: Outcome::Intercepted,
            destination: target.name(),
            target: target.authority().into(),
            reason: None,
            pace: Note::default(),
        };
        let proxy = self.clone();
        // The session counts against max_connections for as long as it lives.
        let slot = req.extensions().get::<ConnectionSlot>().cloned();
        self.inner.shutdown.spawn(async move {
            proxy.run_intercepted(req, target, config).await;
            drop(slot);
        });
        handled
    }

    async fn run_intercepted(
        self,
        req: Request<Incoming>,
        target: Target,
        config: Arc<rustls::ServerConfig>,
    ) {
        let metrics = self.inner.metrics.clone();
        let upgraded = match hyper::upgrade::on(req).await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(target = %target.authority(), "CONNECT upgrade failed: {e}");
                return;
            }
        };
        let limit = self.inner.limits.handshake_timeout;
        let peeked = match tokio::time::timeout(limit, Peeked::read(TokioIo::new(upgraded))).await {
            Ok(Ok(p)) => p,
            // A client that never starts its handshake is the usual case of this.
            _ => {
                metrics.tls_handshake_failures.inc();
                tracing::info!(target = %target.authority(), "client sent nothing in the tunnel in time, not even a TLS handshake");
                return;
            }
        };
        if !peeked.is_tls() {
            // Plain HTTP in the tunnel: served as it is, sent upstream as http://.
            let target = Target {
                scheme: http::uri::Scheme::HTTP,
                ..target
            };
            self.serve_inner(peeked, target, INTERCEPT).await;
            return;
        }
        let handshake = TlsAcceptor::from(config).accept(peeked);
        let tls = match tokio::time::timeout(limit, handshake).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                metrics.tls_handshake_failures.inc();
                tracing::info!(
                    target = %target.authority(),
                    "client TLS handshake failed: {e}; does the client trust pacegate's CA (see `pacegate ca bundle`)?"
                );
                return;
            }
            Err(_) => {
                metrics.tls_handshake_failures.inc();
                tracing::info!(target = %target.authority(), "client did not complete the TLS handshake in time");
                return;
            }
        };
        self.serve_inner(tls, target, INTERCEPT).await;
    }

    /// Serves the HTTP inside a CONNECT tunnel: each request goes through `handle_inner`,
    /// with the deadlines and the request gate of any client connection.
    async fn serve_inner<I>(self, io: I, target: Target, kind: &'static str)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let metrics = self.inner.metrics.clone();
        metrics.tunnels_total.with_label_values(&[kind]).inc();
        let open = metrics.tunnels_open.with_label_values(&[kind]);
        open.inc();
        let shutdown = self.inner.shutdown.clone();
        let limits = self.inner.limits.clone();
        let gate = self.inner.gate.clone();
        let authority = target.authority();
        let session = Session {
            proxy: self,
            target,
        };
        match server::serve_connection(io, session, gate, &limits, &metrics, &shutdown, None).await
        {
            Ended::Closed => {}
            Ended::Failed(e) => {
                tracing::debug!(target = %authority, "intercepted session ended: {e}");
            }
            Ended::Expired(why) => {
                tracing::debug!(target = %authority, "intercepted session closed: {why}");
            }
        }
        open.dec();
    }

    async fn tunnel(
        &self,
        req: Request<Incoming>,
        target: Target,
        admission: Option<Admission>,
    ) -> Handled {
        let pace = Note {
            waited: admission.as_ref().map(|a| a.waited),
            ..Note::default()
        };
        // Connect before answering, so a dead upstream is a 502, not a 200 and a reset.
        let upstream = match self
            .inner
            .upstream
            .connector()
            .connect(&target.host, target.port)
            .await
        {
            Ok(stream) => stream,
            Err(e) => {
                return Handled::refused(ProxyError::Upstream(e.into()), None, target.authority())
            }
        };
        let metrics = self.inner.metrics.clone();
        let idle = self.inner.limits.tunnel_idle_timeout;
        let shutdown = self.inner.shutdown.clone();
        let authority = target.authority();
        let slot = req.extensions().get::<ConnectionSlot>().cloned();
        self.inner.shutdown.spawn(async move {
            // Both live as long as the tunnel: it counts against max_connections and, for a
            // destination, against max_concurrency.
            let _slot = slot;
            let _admission = admission;
            let client = match hyper::upgrade::on(req).await {
                Ok(u) => TokioIo::new(u),
                Err(e) => {
                    tracing::debug!(target = %authority, "CONNECT upgrade failed: {e}");
                    return;
                }
            };
            metrics.tunnels_total.with_label_values(&[BLIND]).inc();
            let open = metrics.tunnels_open.with_label_values(&[BLIND]);
            open.inc();
            let started = Instant::now();
            tokio::select! {
                res = relay(client, upstream, idle) => match res {
                    Ok((up, down)) => tracing::debug!(target = %authority, up, down, "tunnel closed after {:?}", started.elapsed()),
                    Err(e) => tracing::debug!(target = %authority, "tunnel ended: {e}"),
                },
                () = shutdown.forced() => tracing::info!(target = %authority, "tunnel closed at the shutdown deadline"),
            }
            open.dec();
        });
        Handled {
            response: established(),
            outcome: Outcome::Tunneled,
            destination: target.name(),
            target: target.authority().into(),
            reason: None,
            pace,
        }
    }
}

/// Copies bytes both ways until both sides have closed, either side fails, no byte has moved
/// in either direction for `idle`, or a side has not taken a write for `idle`. Returns the bytes sent up and down.
async fn relay<C>(client: C, upstream: TcpStream, idle: Duration) -> std::io::Result<(u64, u64)>
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let start = Instant::now();
    let last = AtomicU64::new(0);
    let (client_r, client_w) = tokio::io::split(client);
    let (upstream_r, upstream_w) = upstream.into_split();
    tokio::try_join!(
        pipe(client_r, upstream_w, start, &last, idle),
        pipe(upstream_r, client_w, start, &last, idle)
    )
}

async fn pipe<R, W>(
    mut from: R,
    mut to: W,
    start: Instant,
    last: &AtomicU64,
    idle: Duration,
) -> std::io::Result<u64>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    let mut total = 0u64;
    loop {
        let n = match tokio::time::timeout(idle, from.read(&mut buf)).await {
            Ok(read) => read?,
            Err(_) => {
                // Quiet this way; the tunnel is idle only if the other way is quiet too.
                let since = start
                    .elapsed()
                    .saturating_sub(Duration::from_millis(last.load(Ordering::Relaxed)));
                if since >= idle {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "tunnel idle timeout",
                    ));
                }
                continue;
            }
        };
        if n == 0 {
            to.shutdown().await?;
            return Ok(total);
        }
        // A side that stops reading stalls this write; after a half-close nothing else would
        // notice, since the other way has ended.
        match tokio::time::timeout(idle, to.write_all(&buf[..n])).await {
            Ok(written) => written?,
            Err(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "tunnel idle timeout: the receiving side read nothing",
                ))
            }
        }
        total += n as u64;
        last.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

/// The requests of one intercepted session, all bound for its CONNECT target.
#[derive(Clone)]
struct Session {
    proxy: Proxy,
    target: Target,
}

impl Handler for Session {
    fn serve_request(
        self,
        req: Request<Incoming>,
    ) -> impl std::future::Future<Output = Response<ProxyBody>> + Send + 'static {
        self.proxy.handle_inner(req, self.target)
    }

    fn refuse_busy(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        self.proxy.refuse_busy(&req)
    }

    fn refuse_connection(&self, why: crate::server::Refused) -> Vec<u8> {
        Handler::refuse_connection(&self.proxy, why)
    }
}
