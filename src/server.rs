//! The client-facing listener: an accept loop on an already-bound listener, one task per
//! connection, a bound on open connections, and the drain on shutdown.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus::IntGauge;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::Limits;
use crate::metrics::Metrics;
use crate::shutdown::Shutdown;
use crate::upstream::ProxyBody;

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// What serves each request of a client connection (the proxy).
pub trait Handler: Clone + Send + Sync + 'static {
    /// Answers one request.
    fn serve_request(&self, req: Request<Incoming>) -> BoxFuture<'static, Response<ProxyBody>>;
}

/// The hyper connection settings shared by client connections and intercepted sessions.
pub fn connection_builder(limits: &Limits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // hyper restarts this timer whenever it waits for a request head, so it also closes
        // kept-alive connections that sit idle.
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        .max_concurrent_streams(256)
        .keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(20));
    builder
}

/// One slot of `max_connections`, held by a client connection and by every intercepted session
/// or tunnel that outlives it. Shared through request extensions.
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
    limits: Limits,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let builder = Arc::new(connection_builder(&limits));
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
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics.connections_rejected.inc();
            tokio::spawn(refuse_overloaded(stream, limits.max_connections));
            continue;
        };
        let _ = stream.set_nodelay(true);
        metrics.connections_total.inc();
        metrics.connections_open.inc();
        let slot = ConnectionSlot(Arc::new(SlotGuard {
            _permit: permit,
            open: metrics.connections_open.clone(),
        }));
        let handler = handler.clone();
        let builder = builder.clone();
        let conn_shutdown = shutdown.clone();
        shutdown.spawn(async move {
            let service = service_fn(move |mut req| {
                req.extensions_mut().insert(slot.clone());
                let response = handler.serve_request(req);
                async move { Ok::<_, Infallible>(response.await) }
            });
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            // Boxing proves `Send` here, with concrete types; inside the spawned future the
            // compiler cannot (rust-lang/rust#102211).
            let driven: BoxFuture<'_, Result<(), _>> = Box::pin(conn_shutdown.drive(conn));
            if let Err(e) = driven.await {
                tracing::debug!(%peer, "client connection ended with an error: {e}");
            }
        });
    }
    tracing::info!("proxy listener closed");
}

async fn refuse_overloaded(mut stream: TcpStream, limit: usize) {
    let details = format!(
        "pacegate has {limit} client connections open (proxy.limits.max_connections); retry shortly or raise the limit"
    );
    let body = format!("pacegate: {details}\n");
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\nProxy-Status: pacegate; error=connection_limit_reached; details=\"{details}\"\r\nRetry-After: 1\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(head.as_bytes())).await;
}
