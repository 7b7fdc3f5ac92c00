//! The client-facing listener: an accept loop on an already-bound listener, one task per
//! connection, a bound on open connections and on requests in flight, every connection's
//! deadlines ([`watch`]), and the drain on shutdown.

pub mod watch;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus::IntGauge;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::either::Either;

use crate::config::Limits;
use crate::metrics::Metrics;
use crate::shutdown::Shutdown;
use crate::upstream::{BoxError, ProxyBody};
use watch::{InFlight, Watch};

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// What serves each request of a client connection (the proxy).
pub trait Handler: Clone + Send + Sync + 'static {
    /// Answers one request, with a clone of the handler made for it. The future lives in
    /// its connection's task, which hyper keeps from one request to the next: a request
    /// allocates no room of its own for it.
    fn serve_request(
        self,
        req: Request<Incoming>,
    ) -> impl std::future::Future<Output = Response<ProxyBody>> + Send + 'static;
    /// Answers, at once, a request that finds `max_requests` in flight already.
    fn refuse_busy(&self, req: Request<Incoming>) -> Response<ProxyBody>;
    /// The answer, as bytes that close the connection, to a connection refused before
    /// anything is read from it.
    fn refuse_connection(&self, why: Refused) -> Vec<u8>;
    /// The handler for the requests of a connection from `peer`.
    fn for_peer(&self, _peer: std::net::SocketAddr) -> Self {
        self.clone()
    }
}

/// Why a connection is refused before anything is read from it.
#[derive(Debug, Clone, Copy)]
pub enum Refused {
    /// Its address is outside `[proxy] clients`.
    Client,
    /// `max_connections` client connections are open already.
    Connections {
        /// The limit.
        limit: usize,
    },
}

/// The requests in flight over every connection and intercepted session (`max_requests`):
/// HTTP/2 multiplies requests per connection, so `max_connections` alone does not bound them.
// A count, not a semaphore: nothing waits at the gate (a request past it is refused at once),
// and a semaphore takes the lock of its waiters' list whenever a permit is given back, a lock
// that every request on every worker thread would then contend for.
#[derive(Clone)]
pub struct Gate {
    count: Arc<GateCount>,
}

struct GateCount {
    in_flight: AtomicUsize,
    max: usize,
}

impl Gate {
    /// A gate for `limits.max_requests`.
    pub fn new(limits: &Limits) -> Self {
        Self {
            count: Arc::new(GateCount {
                in_flight: AtomicUsize::new(0),
                max: limits.max_requests,
            }),
        }
    }

    /// A place for one more request, or none while `max_requests` are in flight.
    fn enter(&self) -> Option<Pass> {
        let count = &self.count;
        count
            .in_flight
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |n| {
                (n < count.max).then_some(n + 1)
            })
            .ok()?;
        Some(Pass(count.clone()))
    }
}

/// One request's place at the [`Gate`], given back when it drops.
struct Pass(Arc<GateCount>);

impl Drop for Pass {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Release);
    }
}

/// What a request in flight holds until its response body has been written or dropped.
struct Held {
    _pass: Pass,
    _in_flight: InFlight,
}

/// A response body that holds its request's place until it ends (none for a request
/// refused for want of one). Served as it is, not boxed again.
struct Holding {
    body: ProxyBody,
    _held: Option<Held>,
}

impl Body for Holding {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// How a served connection ended.
pub enum Ended {
    /// The client closed it, or the drain did.
    Closed,
    /// It failed: a protocol error, a reset, a write the client did not take in time.
    Failed(BoxError),
    /// A deadline of its watch passed.
    Expired(watch::Expired),
}

/// Serves one connection, a client's or an intercepted session's, with every deadline it has
/// (see [`watch`]): HTTP/2 pings (hyper's), the watch's first-byte, head, idle and write
/// deadlines, and the drain. `slot` goes with each request, for what outlives it.
pub async fn serve_connection<I, H>(
    io: I,
    handler: H,
    gate: Gate,
    limits: &Limits,
    metrics: &Metrics,
    shutdown: &Shutdown,
    slot: Option<ConnectionSlot>,
) -> Ended
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Handler,
{
    let watch = Watch::new(limits);
    let io = TokioIo::new(watch.io(io));
    let service = {
        let watch = watch.clone();
        service_fn(move |mut req: Request<Incoming>| {
            // Only a tunnel outlives its request and needs the slot: every other request
            // goes without an extensions map of its own.
            if let Some(slot) = slot
                .as_ref()
                .filter(|_| req.method() == http::Method::CONNECT)
            {
                req.extensions_mut().insert(slot.clone());
            }
            // The request's future is made here, not in an `async` block that would hold the
            // request beside it: it is moved into the connection's slot for every request.
            match gate.enter() {
                Some(pass) => {
                    let held = Held {
                        _pass: pass,
                        _in_flight: watch.request(),
                    };
                    Either::Left(handler.clone().serve_request(req).map(move |response| {
                        Ok::<_, Infallible>(response.map(|body| Holding {
                            body,
                            _held: Some(held),
                        }))
                    }))
                }
                None => {
                    let response = handler.refuse_busy(req);
                    Either::Right(std::future::ready(Ok(
                        response.map(|body| Holding { body, _held: None })
                    )))
                }
            }
        })
    };
    let builder = connection_builder(limits);
    let conn = builder.serve_connection_with_upgrades(io, service);
    // Boxing proves `Send` here, with concrete types; inside the spawned future the compiler
    // cannot (rust-lang/rust#102211).
    let driven: BoxFuture<'_, Result<(), _>> = Box::pin(shutdown.drive(Box::pin(conn)));
    // In order, as the drain's (see `Shutdown::drive`): no draw at every wake.
    tokio::select! {
        biased;
        ended = driven => match ended {
            Ok(()) => Ended::Closed,
            Err(e) => {
                if is_write_timeout(&*e) {
                    metrics.connections_expired.with_label_values(&["write_timeout"]).inc();
                }
                Ended::Failed(e)
            }
        },
        why = watch.expired() => {
            metrics.connections_expired.with_label_values(&[why.as_str()]).inc();
            Ended::Expired(why)
        }
    }
}

/// Whether a connection failed because the client did not read (see [`watch::Watched`]).
fn is_write_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return io.kind() == std::io::ErrorKind::TimedOut;
        }
        cause = e.source();
    }
    false
}

/// The hyper connection settings shared by client connections and intercepted sessions.
pub fn connection_builder(limits: &Limits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        // The head's deadline is the connection's watch's (see `watch`): hyper's would arm a
        // timer of its own for every request.
        .header_read_timeout(None)
        .max_buf_size(limits.max_header_bytes)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        .max_concurrent_streams(limits.max_streams)
        .keep_alive_interval(limits.ping_interval)
        .keep_alive_timeout(limits.ping_timeout);
    builder
}

/// One slot of `max_connections`, held by a client connection and by every intercepted session
/// or tunnel that outlives it. Shared through a CONNECT request's extensions.
#[derive(Clone)]
pub struct ConnectionSlot(#[allow(dead_code)] Arc<SlotGuard>);

struct SlotGuard {
    _permit: OwnedSemaphorePermit,
    open: IntGauge,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.open.dec();
    }
}

/// Accepts client connections until the drain starts. Each connection is served in a tracked
/// task; connections beyond `max_connections` get a 503 and are closed.
pub async fn serve<H: Handler>(
    listener: TcpListener,
    handler: H,
    gate: Gate,
    limits: Limits,
    clients: Option<Arc<[ipnet::IpNet]>>,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let limits = Arc::new(limits);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Usually EMFILE: back off instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = shutdown.draining() => break,
        };
        let source = peer.ip().to_canonical();
        if let Some(allowed) = &clients {
            if !allowed.iter().any(|net| net.contains(&source)) {
                metrics.clients_refused.inc();
                tracing::info!(%peer, "refused a client outside [proxy] clients");
                shutdown.spawn(refuse(stream, handler.refuse_connection(Refused::Client)));
                continue;
            }
        }
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics.connections_rejected.inc();
            let answer = handler.refuse_connection(Refused::Connections {
                limit: limits.max_connections,
            });
            shutdown.spawn(refuse(stream, answer));
            continue;
        };
        let _ = stream.set_nodelay(true);
        metrics.connections_total.inc();
        metrics.connections_open.inc();
        let slot = ConnectionSlot(Arc::new(SlotGuard {
            _permit: permit,
            open: metrics.connections_open.clone(),
        }));
        let handler = handler.for_peer(peer);
        let gate = gate.clone();
        let limits = limits.clone();
        let metrics = metrics.clone();
        let conn_shutdown = shutdown.clone();
        shutdown.spawn(async move {
            let ended = serve_connection(
                stream,
                handler,
                gate,
                &limits,
                &metrics,
                &conn_shutdown,
                Some(slot),
            )
            .await;
            match ended {
                Ended::Closed => {}
                Ended::Failed(e) => tracing::debug!(%peer, "client connection ended: {e}"),
                Ended::Expired(why) => tracing::debug!(%peer, "client connection closed: {why}"),
            }
        });
    }
    tracing::info!("proxy listener closed");
}

/// Writes `answer` to a connection refused before anything is read, and closes it.
async fn refuse(mut stream: TcpStream, answer: Vec<u8>) {
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(&answer)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_lets_max_requests_in_and_a_place_given_back_is_taken_again() {
        let gate = Gate {
            count: Arc::new(GateCount {
                in_flight: AtomicUsize::new(0),
                max: 2,
            }),
        };
        let first = gate.enter().expect("a first place");
        let second = gate.enter().expect("a second place");
        assert!(gate.enter().is_none(), "a third request is refused");
        drop(first);
        let third = gate.enter().expect("the place given back");
        assert!(gate.enter().is_none());
        drop((second, third));
        assert_eq!(gate.count.in_flight.load(Ordering::Relaxed), 0);
        // Clones share the one count.
        let other = gate.clone();
        let _a = gate.enter().expect("a place");
        let _b = other.enter().expect("a place");
        assert!(other.enter().is_none() && gate.enter().is_none());
    }
}
