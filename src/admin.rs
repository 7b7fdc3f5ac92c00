//! The admin listener: `GET /metrics`, `GET /status`, `GET /healthz`, `GET /readyz` and
//! `POST /destinations/NAME/unlock` (with the bearer token, when one is configured).

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
use crate::pacing::{Pacer, UnlockError};
use crate::reload::Reloader;
use history::History;

mod history;
use crate::shutdown::Shutdown;

/// What the admin endpoints read and act on.
#[derive(Clone)]
pub struct Admin {
    metrics: Arc<Metrics>,
    pacer: Arc<Pacer>,
    shutdown: Shutdown,
    token: Option<Arc<str>>,
    /// Present when the config came from a file that can be read again.
    reloader: Option<Arc<Reloader>>,
    /// The last ten minutes of each destination's pace, for the status page.
    history: Arc<History>,
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Full::new(body.into()))
        .expect("static response parts are valid")
}

/// The status page: one self-contained HTML document, its script and style inline, that
/// reads `/status`, `/history`, `/instances`, `/store` and `/reload` from this listener.
fn page() -> Response<Full<Bytes>> {
    Response::builder()
        .header(header::CONTENT_TYPE, "text/html; charset=utf-8")
        // Nothing but this listener: no external asset, no frame around it.
        .header(
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:; frame-ancestors 'none'",
        )
        .header(header::CACHE_CONTROL, "no-store")
        .body(Full::new(Bytes::from_static(PAGE.as_bytes())))
        .expect("static response parts are valid")
}

const PAGE: &str = include_str!("admin/page.html");

fn json(status: StatusCode, value: &impl serde::Serialize) -> Response<Full<Bytes>> {
    let body = serde_json::to_vec_pretty(value).unwrap_or_default();
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}

impl Admin {
    /// `shutdown` tells readiness (not ready once draining); `token`, when set, must be sent
    /// as `Authorization: Bearer TOKEN` on every POST.
    pub fn new(
        metrics: Arc<Metrics>,
        pacer: Arc<Pacer>,
        shutdown: Shutdown,
        token: Option<String>,
        reloader: Option<Arc<Reloader>>,
    ) -> Self {
        Self {
            metrics,
            pacer,
            shutdown,
            token: token.map(Arc::from),
            reloader,
            history: Arc::default(),
        }
    }

    fn authorized(&self, req: &Request<Incoming>) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        let offered = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        // Digests first, so that the comparison does not depend on the lengths either.
        let offered = crate::config::User::digest(offered.as_bytes());
        let token = crate::config::User::digest(token.as_bytes());
        bool::from(subtle::ConstantTimeEq::ct_eq(&offered[..], &token[..]))
    }

    async fn route(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let path = req.uri().path().to_owned();
        match (req.method(), path.as_str()) {
            (&Method::GET, "/metrics") => {
                // Per-destination gauges are refreshed at scrape time, from what this instance
                // knows: a scrape makes no store round trip.
                self.pacer.gauges();
                let mut resp = text(StatusCode::OK, self.metrics.render());
                resp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                resp
            }
            (&Method::GET, "/") => page(),
            (&Method::GET, "/history") => json(StatusCode::OK, &self.history.samples()),
            // The store's health as the supervisor last set it: no store round trip.
            (&Method::GET, "/store") => json(
                StatusCode::OK,
                &serde_json::json!({
                    "degraded": self.metrics.store_degraded.get() == 1,
                    "instances": self.metrics.store_instances.get(),
                }),
            ),
            (&Method::GET, "/status") => json(StatusCode::OK, &self.pacer.status().await),
            (&Method::GET, "/instances") => match self.pacer.instances().await {
                Ok(list) => json(StatusCode::OK, &list),
                Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")),
            },
            (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
            (&Method::GET, "/readyz") if self.shutdown.is_draining() => text(StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
            (&Method::GET, "/readyz") => text(StatusCode::OK, "ready\n"),
            (&Method::GET, "/reload") => match self.reloader.as_ref().map(|r| r.last()) {
                None => text(StatusCode::NOT_FOUND, "this instance's config was not read from a file: it cannot be reloaded\n"),
                Some(None) => json(StatusCode::OK, &serde_json::json!({ "result": "none" })),
                Some(Some(last)) => json(StatusCode::OK, &last),
            },
            (&Method::GET, "/config") => match &self.reloader {
                None => text(StatusCode::NOT_FOUND, "this instance's config was not read from a file\n"),
                Some(r) => text(StatusCode::OK, r.running().await),
            },
            (&Method::POST, p) if !self.authorized(&req) && (p == "/reload" || unlock_target(p).is_some()) => {
                let mut resp = text(StatusCode::UNAUTHORIZED, "send Authorization: Bearer TOKEN (the value of [admin] token_env)\n");
                resp.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
                resp
            }
            (&Method::POST, "/reload") => match &self.reloader {
                None => text(StatusCode::NOT_FOUND, "this instance's config was not read from a file: it cannot be reloaded\n"),
                Some(r) => {
                    let status = r.reload().await;
                    let code = if status.result == "ok" { StatusCode::OK } else { StatusCode::UNPROCESSABLE_ENTITY };
                    json(code, &status)
                }
            },
            (&Method::POST, p) if unlock_target(p).is_some() => {
                let name = unlock_target(p).unwrap_or_default();
                self.unlock(name).await
            }
            (_, "/" | "/history" | "/store" | "/metrics" | "/status" | "/instances" | "/healthz" | "/readyz" | "/config") => {
                text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n")
            }
            _ => text(
                StatusCode::NOT_FOUND,
                "endpoints: GET / (the status page) /metrics /status /history /store /instances /healthz /readyz /config /reload, POST /reload /destinations/NAME/unlock\n",
            ),
        }
    }

    async fn unlock(&self, name: &str) -> Response<Full<Bytes>> {
        #[derive(serde::Serialize)]
        struct Unlocked<'a> {
            destination: &'a str,
            was_locked: bool,
            lock: Option<crate::status::LockStatus>,
        }
        match self.pacer.unlock(name).await {
            Ok(cleared) => json(
                StatusCode::OK,
                &Unlocked {
                    destination: name,
                    was_locked: cleared.is_some(),
                    lock: cleared.as_ref().map(Into::into),
                },
            ),
            Err(e @ UnlockError::Unknown(_)) => text(StatusCode::NOT_FOUND, format!("{e}\n")),
            Err(e @ UnlockError::Store(_)) => {
                text(StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n"))
            }
        }
    }

    /// Serves until `stop` is cancelled.
    pub async fn serve(self, listener: TcpListener, stop: CancellationToken) {
        tokio::spawn(self.history.clone().keep(self.pacer.clone(), stop.clone()));
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
                    let admin = admin.clone();
                    async move { Ok::<_, Infallible>(admin.route(req).await) }
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

/// Why a command could not talk to the admin listener.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The URL is not `http://host:port`.
    #[error("`{0}` is not an admin URL like http://127.0.0.1:9464")]
    BadUrl(String),
    /// Nothing answered.
    #[error("cannot reach the admin listener at {url}: {source} (is pacegate running? pass --admin URL if it listens elsewhere)")]
    Unreachable {
        /// The admin URL.
        url: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The exchange failed.
    #[error("admin request to {url} failed: {reason}")]
    Http {
        /// The admin URL.
        url: String,
        /// The cause.
        reason: String,
    },
}

/// The admin base URL a config implies: its listen address, with an unspecified IP replaced by
/// loopback.
pub fn url_for(listen: std::net::SocketAddr) -> String {
    let ip = match listen.ip() {
        std::net::IpAddr::V4(v4) if v4.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(v6) if v6.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    format!("http://{}", std::net::SocketAddr::new(ip, listen.port()))
}

/// One request to an admin listener at `base` (`http://host:port`); returns status and body.
pub async fn call(
    base: &str,
    method: Method,
    path: &str,
    token: Option<&str>,
) -> Result<(StatusCode, String), CallError> {
    use http_body_util::{BodyExt, Empty};
    let authority = base
        .strip_prefix("http://")
        .map(|rest| rest.trim_end_matches('/'))
        .filter(|a| !a.is_empty() && !a.contains('/'))
        .ok_or_else(|| CallError::BadUrl(base.to_owned()))?;
    let http = |reason: String| CallError::Http {
        url: base.to_owned(),
        reason,
    };
    let stream = tokio::net::TcpStream::connect(authority)
        .await
        .map_err(|source| CallError::Unreachable {
            url: base.to_owned(),
            source,
        })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| http(e.to_string()))?;
    tokio::spawn(conn);
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, authority);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let req = req
        .body(Empty::<Bytes>::new())
        .map_err(|e| http(e.to_string()))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| http(e.to_string()))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| http(e.to_string()))?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// The destination named by `/destinations/NAME/unlock`; `None` for any other path (an empty
/// name, one with a slash, or no name at all: `/destinations/unlock`).
fn unlock_target(path: &str) -> Option<&str> {
    let name = path
        .strip_prefix("/destinations/")?
        .strip_suffix("/unlock")?;
    (!name.is_empty() && !name.contains('/')).then_some(name)
}

#[cfg(test)]
mod path_tests {
    use super::unlock_target;

    #[test]
    fn only_a_named_destination_is_an_unlock_target() {
        assert_eq!(unlock_target("/destinations/api/unlock"), Some("api"));
        for path in [
            "/destinations/unlock",
            "/destinations//unlock",
            "/destinations/a/b/unlock",
            "/destinations/api/unlock/",
            "/destinations/api",
            "/unlock",
            "/destinations/",
        ] {
            assert_eq!(unlock_target(path), None, "{path}");
        }
    }
}
