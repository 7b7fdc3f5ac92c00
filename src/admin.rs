//! The admin listener: `GET /metrics`, `GET /healthz`, `GET /readyz`.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::shutdown::Shutdown;

/// What the admin endpoints read.
#[derive(Clone)]
pub struct Admin {
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
}

impl Admin {
    /// `shutdown` tells readiness: not ready once the drain has started.
    pub fn new(metrics: Arc<Metrics>, shutdown: Shutdown) -> Self {
        Self { metrics, shutdown }
    }

    fn route(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        let text = |status: StatusCode, body: String| {
            Response::builder()
                .status(status)
                .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
                .body(Full::new(Bytes::from(body)))
                .expect("static response parts are valid")
        };
        match (req.method(), req.uri().path()) {
            (&Method::GET, "/metrics") => {
                let mut resp = text(StatusCode::OK, self.metrics.render());
                resp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                resp
            }
            (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n".into()),
            (&Method::GET, "/readyz") if self.shutdown.is_draining() => {
                text(StatusCode::SERVICE_UNAVAILABLE, "draining\n".into())
            }
            (&Method::GET, "/readyz") => text(StatusCode::OK, "ready\n".into()),
            (_, "/metrics" | "/healthz" | "/readyz") => {
                text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n".into())
            }
            _ => text(
                StatusCode::NOT_FOUND,
                "endpoints: /metrics /healthz /readyz\n".into(),
            ),
        }
    }

    /// Serves until `stop` is cancelled.
    pub async fn serve(self, listener: TcpListener, stop: CancellationToken) {
        loop {
            let stream = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        tracing::warn!("admin accept failed: {e}");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = stop.cancelled() => return,
            };
            let admin = self.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let resp = admin.route(&req);
                    async move { Ok::<_, Infallible>(resp) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(std::time::Duration::from_secs(10))
                    .serve_connection(TokioIo::new(stream), service);
                tokio::select! {
                    _ = conn => {}
                    () = stop.cancelled() => {}
                }
            });
        }
    }
}
