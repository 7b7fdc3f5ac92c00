//! The admin listener: `GET /metrics`, `GET /status`, `GET /healthz`, `GET /readyz` and the
//! writes, `POST /reload`, `POST /destinations/NAME/unlock` and `POST /cache/purge`.
//!
//! A write needs intent. With `[admin] token_env`, the bearer token. Without one (the listener
//! is then on loopback), a request from loopback whose `Host` is this listener's address and
//! whose `Origin`, if it sends one, is this listener: a web page open in the operator's browser
//! can send a POST to 127.0.0.1, and DNS rebinding can make it same-origin by name, but neither
//! makes those headers match. With `[admin] read_token_env`, reads but the probes need a token
//! too. The listener holds at most [`MAX_CONNECTIONS`], each under deadlines of its own.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{AdminConfig, Limits};
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::pacing::{Pacer, UnlockError};
use crate::reload::Reloader;
use crate::server::watch::Watch;
use crate::shutdown::Shutdown;
use history::History;

mod history;

/// Admin connections open at once; more are closed at once. Scrapes, `pacegate status` and
/// a status page or two need a handful.
pub const MAX_CONNECTIONS: usize = 64;

/// The admin listener's deadlines: short, since its clients are scripts and one page.
fn limits() -> Limits {
    Limits {
        header_read_timeout: std::time::Duration::from_secs(10),
        idle_timeout: std::time::Duration::from_secs(30),
        write_timeout: std::time::Duration::from_secs(10),
        ..Limits::default()
    }
}

/// What the admin endpoints read and act on.
#[derive(Clone)]
pub struct Admin {
    metrics: Arc<Metrics>,
    pacer: Arc<Pacer>,
    /// This instance among the others sharing the store: the live instances it lists.
    fleet: Arc<dyn Fleet>,
    shutdown: Shutdown,
    token: Option<Arc<str>>,
    read_token: Option<Arc<str>>,
    /// Present when the config came from a file that can be read again.
    reloader: Option<Arc<Reloader>>,
    /// The last ten minutes of each destination's pace, for the status page.
    history: Arc<History>,
    /// The kept responses, where there is a `[cache]`.
    collapse: Option<Arc<crate::collapse::Collapser>>,
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
    /// `shutdown` tells readiness (not ready once draining); the config's tokens, when set,
    /// must be sent as `Authorization: Bearer TOKEN` (see the module's doc).
    pub fn new(
        metrics: Arc<Metrics>,
        pacer: Arc<Pacer>,
        fleet: Arc<dyn Fleet>,
        shutdown: Shutdown,
        config: &AdminConfig,
        reloader: Option<Arc<Reloader>>,
        collapse: Option<Arc<crate::collapse::Collapser>>,
    ) -> Self {
        Self {
            metrics,
            pacer,
            fleet,
            shutdown,
            token: config.token.as_deref().map(Arc::from),
            read_token: config.read_token.as_deref().map(Arc::from),
            reloader,
            history: Arc::default(),
            collapse,
        }
    }

    /// Whether the request carries `token` as its bearer token.
    fn bears(req: &Request<Incoming>, token: &str) -> bool {
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

    /// Whether a write is meant (see the module's doc); `Err` says why not.
    fn write_allowed(&self, req: &Request<Incoming>, at: &Peers) -> Result<(), &'static str> {
        if let Some(token) = &self.token {
            return if Self::bears(req, token) {
                Ok(())
            } else {
                Err("send Authorization: Bearer TOKEN (the value of [admin] token_env)")
            };
        }
        if !at.peer.ip().is_loopback() {
            return Err("writes without [admin] token_env come from loopback only");
        }
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        if !at.names_listener(host) {
            return Err("the Host header does not name this admin listener (a page on another site, or DNS rebinding); send it to the listen address, or set [admin] token_env");
        }
        let foreign = req
            .headers()
            .get(header::ORIGIN)
            .is_some_and(|o| o.as_bytes() != format!("http://{host}").as_bytes());
        let cross_site = req
            .headers()
            .get("sec-fetch-site")
            .is_some_and(|s| s != "same-origin" && s != "none");
        if foreign || cross_site {
            return Err("a write from another site's page is refused; set [admin] token_env to write from elsewhere");
        }
        Ok(())
    }

    /// Whether a read may be answered; `Err` says why not. With a read token, it (or the
    /// write token) must be carried. Without one, the request must name the listener by an
    /// address (`10.0.0.7:9464`, `[::1]:9464`) or as `localhost`: a page on another site that
    /// rebinds its own name to this address reaches it under that name, and must not read
    /// the config, the status or the metrics. The probes and the page itself need neither.
    fn read_allowed(&self, req: &Request<Incoming>, at: &Peers) -> Result<(), &'static str> {
        if matches!(req.uri().path(), "/healthz" | "/readyz" | "/") {
            return Ok(());
        }
        match &self.read_token {
            Some(read) => {
                if Self::bears(req, read)
                    || self.token.as_deref().is_some_and(|t| Self::bears(req, t))
                {
                    Ok(())
                } else {
                    Err("send Authorization: Bearer TOKEN (the value of [admin] read_token_env)")
                }
            }
            None => {
                let host = req
                    .headers()
                    .get(header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .unwrap_or("");
                if host.is_empty() || at.names_listener(host) || by_address(host) {
                    Ok(())
                } else {
                    Err("the Host header names this admin listener by a name (a page on another site, or DNS rebinding, reaches it so): read it by its address or as localhost, or set [admin] read_token_env to read it by any name")
                }
            }
        }
    }

    async fn route(&self, req: Request<Incoming>, at: &Peers) -> Response<Full<Bytes>> {
        let path = req.uri().path().to_owned();
        if req.method() == Method::GET {
            if let Err(why) = self.read_allowed(&req, at) {
                if self.read_token.is_none() {
                    return text(StatusCode::FORBIDDEN, format!("{why}\n"));
                }
                let mut resp = text(StatusCode::UNAUTHORIZED, format!("{why}\n"));
                resp.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    header::HeaderValue::from_static("Bearer"),
                );
                return resp;
            }
        }
        let write = req.method() == Method::POST
            && (path == "/reload" || path == "/cache/purge" || unlock_target(&path).is_some());
        if write {
            if let Err(why) = self.write_allowed(&req, at) {
                let code = if self.token.is_some() {
                    StatusCode::UNAUTHORIZED
                } else {
                    StatusCode::FORBIDDEN
                };
                let mut resp = text(code, format!("{why}\n"));
                if self.token.is_some() {
                    resp.headers_mut().insert(
                        header::WWW_AUTHENTICATE,
                        header::HeaderValue::from_static("Bearer"),
                    );
                }
                return resp;
            }
        }
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
            (&Method::GET, "/status") => {
                let mut statuses = self.pacer.status().await;
                if let Some(collapse) = &self.collapse {
                    for status in &mut statuses {
                        status.cache = collapse.status(&status.destination);
                    }
                }
                json(StatusCode::OK, &statuses)
            }
            (&Method::GET, "/instances") => match self.fleet.instances().await {
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
            (&Method::POST, "/reload") => match &self.reloader {
                None => text(StatusCode::NOT_FOUND, "this instance's config was not read from a file: it cannot be reloaded\n"),
                Some(r) => {
                    let status = r.reload().await;
                    let code = if status.result == "ok" { StatusCode::OK } else { StatusCode::UNPROCESSABLE_ENTITY };
                    json(code, &status)
                }
            },
            (&Method::POST, "/cache/purge") => self.purge(req.uri().query().unwrap_or_default()),
            (&Method::POST, p) if unlock_target(p).is_some() => {
                let name = unlock_target(p).unwrap_or_default();
                self.unlock(name).await
            }
            (_, "/" | "/history" | "/store" | "/metrics" | "/status" | "/instances" | "/healthz" | "/readyz" | "/config") => {
                text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n")
            }
            _ => text(
                StatusCode::NOT_FOUND,
                "endpoints: GET / (the status page) /metrics /status /history /store /instances /healthz /readyz /config /reload, POST /reload /destinations/NAME/unlock /cache/purge?url=URL|destination=NAME\n",
            ),
        }
    }

    /// Removes the kept responses to `url=URL` (percent-encoded), or all of
    /// `destination=NAME`'s, from memory and disk.
    fn purge(&self, query: &str) -> Response<Full<Bytes>> {
        let Some(collapse) = &self.collapse else {
            return text(
                StatusCode::NOT_FOUND,
                "this instance has no [cache]: nothing is kept to purge\n",
            );
        };
        let value = |name: &str| {
            query
                .split('&')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .map(|v| {
                    percent_encoding::percent_decode_str(v)
                        .decode_utf8_lossy()
                        .into_owned()
                })
        };
        let (url, destination) = (value("url"), value("destination"));
        if url.is_none() == destination.is_none() {
            return text(
                StatusCode::BAD_REQUEST,
                "name what to purge: ?url=URL (percent-encoded, as the client asked for it) or ?destination=NAME\n",
            );
        }
        let purged = collapse.purge(url.as_deref(), destination.as_deref());
        json(
            StatusCode::OK,
            &serde_json::json!({ "url": url, "destination": destination, "purged": purged }),
        )
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
        // The status page's history; ends with `stop`.
        tokio::spawn(self.history.clone().keep(self.pacer.clone(), stop.clone()));
        let Ok(local) = listener.local_addr() else {
            tracing::error!("the admin listener has no address");
            return;
        };
        let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        let limits = limits();
        loop {
            let (stream, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(conn) => conn,
                    Err(e) => {
                        tracing::warn!("admin accept failed: {e}");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = stop.cancelled() => return,
            };
            let Ok(slot) = open.clone().try_acquire_owned() else {
                tracing::warn!(%peer, "admin listener: {MAX_CONNECTIONS} connections open, closing another");
                continue;
            };
            let admin = self.clone();
            let stop = stop.clone();
            let at = Arc::new(Peers { peer, local });
            let watch = Watch::new(&limits);
            // One admin connection, owned by its slot: it ends with the connection, which
            // its deadlines (`Watch`) bound and `stop` closes.
            tokio::spawn(async move {
                let _slot = slot;
                let requests = watch.clone();
                let service = service_fn(move |req| {
                    let admin = admin.clone();
                    let at = at.clone();
                    let in_flight = requests.request();
                    async move {
                        let resp = admin.route(req, &at).await;
                        drop(in_flight);
                        Ok::<_, Infallible>(resp)
                    }
                });
                // The head's deadline is the watch's, as on the proxy's connections.
                let conn = hyper::server::conn::http1::Builder::new()
                    .header_read_timeout(None)
                    .serve_connection(TokioIo::new(watch.io(stream)), service);
                tokio::select! {
                    _ = conn => {}
                    _ = watch.expired() => {}
                    () = stop.cancelled() => {}
                }
            });
        }
    }
}

/// The two ends of an admin connection.
struct Peers {
    peer: std::net::SocketAddr,
    local: std::net::SocketAddr,
}

/// Whether `host` (a Host header) names its server by an IP address or as `localhost`, with
/// or without a port: no other site's page can send such a Host.
fn by_address(host: &str) -> bool {
    let name = match host.rsplit_once(':') {
        Some((name, port)) if !name.ends_with(':') && port.bytes().all(|b| b.is_ascii_digit()) => {
            name
        }
        _ => host,
    };
    let name = name.trim_start_matches('[').trim_end_matches(']');
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok()
}

impl Peers {
    /// Whether `host` (a Host header) names this listener: its address, or `localhost`, with
    /// its port.
    fn names_listener(&self, host: &str) -> bool {
        let port = self.local.port();
        host == self.local.to_string()
            || host == format!("localhost:{port}")
            || (self.local.ip().is_loopback()
                && host
                    .parse::<std::net::SocketAddr>()
                    .is_ok_and(|a| a.ip().is_loopback() && a.port() == port))
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
    // The CLI's one connection to an admin listener: ends once the answer is read and the
    // sender dropped.
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
