//! Per request: authenticate, route to a destination, then forward, intercept, tunnel or refuse.
//!
//! This module decides; the submodules act. No socket is opened here: upstream connections come
//! from [`crate::upstream`], and client connections are served by [`crate::server`].

pub mod auth;
mod connect;
mod forward;
mod peek;
pub mod respond;

use std::sync::Arc;
use tokio::time::Instant;

use http::{Method, Request, Response};
use hyper::body::Incoming;

use crate::class::{Class, CLASS_HEADER};
use crate::config::{AuthConfig, Limits, RequestLog, Unmatched};
use crate::destination::{normalise_host, split_host_port, Routed, CONNECT, HTTP};
use crate::headers::Found;
use crate::log::{self, RequestLine};
use crate::metrics::{labels, labels_and, Metrics, UNMATCHED};
use crate::pacing::{Note, Pacer};
use crate::shutdown::Shutdown;
use crate::tls::Authority;
use crate::upstream::stall::Stall;
use crate::upstream::{ProxyBody, Upstream};
pub use forward::Target;
use respond::{Outcome, ProxyError};

use arc_swap::ArcSwap;

/// What a reload may change in how the proxy treats clients.
#[derive(Debug, Clone)]
pub struct ClientPolicy {
    /// ClientPolicy for unmatched hosts.
    pub unmatched: Unmatched,
    /// `[proxy] ports`: the ports every destination, and unmatched traffic, may go to besides
    /// the defaults.
    pub ports: crate::destination::Ports,
    /// Proxy authentication, if on.
    pub auth: Option<AuthConfig>,
    /// Which requests get the request log line.
    pub log_requests: RequestLog,
}

impl ClientPolicy {
    /// The policy a config gives.
    pub fn of(config: &crate::config::Config) -> Self {
        Self {
            unmatched: config.proxy.unmatched,
            ports: config.proxy.ports.clone(),
            auth: config.proxy.auth.clone(),
            log_requests: config.log.requests,
        }
    }
}

/// What the proxy needs, assembled by the app.
pub struct ProxyParts {
    /// Swapped whole by a reload; each request reads it once.
    pub policy: ArcSwap<ClientPolicy>,
    /// Client-side limits.
    pub limits: Limits,
    /// The local CA.
    pub authority: Arc<Authority>,
    /// The outbound client.
    pub upstream: Upstream,
    /// The pacer every destination's requests wait in.
    pub pacer: Arc<Pacer>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Shutdown handle (intercepted sessions and tunnels are tracked by it).
    pub shutdown: Shutdown,
    /// The requests in flight, shared with the listener.
    pub gate: crate::server::Gate,
    /// Identical requests in flight sharing one fetch; `None` without a `[cache]` section.
    pub collapse: Option<Arc<crate::collapse::Collapser>>,
}

/// The proxy service; cheap to clone.
#[derive(Clone)]
pub struct Proxy {
    inner: Arc<Inner>,
    /// The address of the client connection whose requests this clone serves.
    client: Option<std::net::IpAddr>,
}

/// The proxy's parts, and what it makes of them once.
struct Inner {
    parts: ProxyParts,
    /// `body_timeout` on the clients' request bodies (on responses: `Upstream::body`).
    client_stall: Arc<Stall>,
}

impl std::ops::Deref for Inner {
    type Target = ProxyParts;

    fn deref(&self) -> &ProxyParts {
        &self.parts
    }
}

impl crate::server::Handler for Proxy {
    fn serve_request(
        self,
        req: Request<Incoming>,
    ) -> impl std::future::Future<Output = Response<ProxyBody>> + Send + 'static {
        self.handle(req)
    }

    fn refuse_busy(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        self.refuse_busy(&req)
    }

    fn refuse_connection(&self, why: crate::server::Refused) -> Vec<u8> {
        ProxyError::from(why).to_closing_bytes()
    }

    fn for_peer(&self, peer: std::net::SocketAddr) -> Self {
        Self {
            inner: self.inner.clone(),
            client: Some(peer.ip().to_canonical()),
        }
    }
}

/// What the log line names as a request's target (`host:port`), written out only with the
/// line.
enum Aimed {
    /// As the request named it, for a refusal before its target was known.
    Text(String),
    /// A target as routed: its host (IPv6 without brackets) and port.
    At(String, u16),
}

impl From<String> for Aimed {
    fn from(text: String) -> Self {
        Self::Text(text)
    }
}

impl Aimed {
    /// As the request line names it.
    fn logged(&self) -> log::Aimed<'_> {
        match self {
            Self::Text(text) => log::Aimed::Named(text),
            Self::At(host, port) => log::Aimed::Routed(host, *port),
        }
    }
}

/// When a request arrived and what it asked, kept for its log line, with which requests the
/// policy at its arrival logs (a reload meanwhile governs the next request).
struct Begun {
    started: Instant,
    method: Method,
    log: RequestLog,
}

impl Begun {
    fn now<B>(req: &Request<B>, policy: &ClientPolicy) -> Self {
        Self {
            started: Instant::now(),
            method: req.method().clone(),
            log: policy.log_requests,
        }
    }
}

/// What one request turned into, for the canonical log line and metrics.
struct Handled {
    response: Response<ProxyBody>,
    outcome: Outcome,
    destination: Option<Arc<str>>,
    target: Aimed,
    reason: Option<String>,
    pace: Note,
}

impl Handled {
    fn refused(err: ProxyError, destination: Option<Arc<str>>, target: impl Into<Aimed>) -> Self {
        Self {
            response: err.to_response(),
            outcome: err.outcome(),
            destination,
            target: target.into(),
            reason: Some(err.to_string()),
            pace: Note::default(),
        }
    }
}

impl Proxy {
    /// Builds the service.
    pub fn new(parts: ProxyParts) -> Self {
        let client_stall = Arc::new(Stall {
            after: parts.limits.body_timeout,
            cut: parts.metrics.bodies_cut.with_label_values(&["client"]),
            what: "client request",
        });
        Self {
            inner: Arc::new(Inner {
                parts,
                client_stall,
            }),
            client: None,
        }
    }

    /// The kept responses and the requests in flight they share, where there is a `[cache]`.
    pub fn collapser(&self) -> Option<Arc<crate::collapse::Collapser>> {
        self.inner.collapse.clone()
    }

    /// Takes a reloaded policy: requests that arrive from now on follow it.
    pub fn set_policy(&self, policy: ClientPolicy) {
        self.inner.policy.store(Arc::new(policy));
    }

    /// Takes a reloaded set of destinations' `allow_private_upstreams`.
    pub fn set_private_hosts(&self, destinations: &[crate::destination::Destination]) {
        self.inner
            .upstream
            .connector()
            .set_hosts(crate::upstream::AddressPolicy::hosts_of(destinations));
    }

    /// Handles one request arriving on a client connection (absolute-form or CONNECT): its
    /// checks at once, then its tunnel or its forward, each of which ends in `finish`.
    // Not an `async` block around the steps: it would hold the request beside the future it
    // was handed on to. A request's future is moved into its connection's slot, about 50
    // cache lines that are cold when hundreds of connections take turns.
    pub fn handle(
        self,
        req: Request<Incoming>,
    ) -> impl std::future::Future<Output = Response<ProxyBody>> + Send + 'static {
        use tokio_util::either::Either;
        // One look at the policy for the request's checks and its log line: a look that
        // takes no reference (a count every request on every core would write).
        let policy = self.inner.policy.load();
        let begun = Begun::now(&req, &policy);
        // The names acted on, found in one pass: the checks and the rewrite look up only
        // those that are there.
        let found = Found::in_headers(req.headers());
        match self.checked(req, &policy, found) {
            Err(refused) => Either::Left(std::future::ready(self.finish(begun, refused))),
            // Boxed: a tunnel is made once for many requests, and its future is the larger.
            Ok((req, target)) if req.method() == Method::CONNECT => {
                Either::Right(Either::Left(Box::pin(async move {
                    let handled = self.connect(req, target).await;
                    self.finish(begun, handled)
                })))
            }
            Ok((req, target)) => {
                Either::Right(Either::Right(self.forward(req, target, begun, found)))
            }
        }
    }

    /// Answers a request that finds `max_requests` in flight, logged and counted like any.
    fn refuse_busy(&self, req: &Request<Incoming>) -> Response<ProxyBody> {
        let err = ProxyError::Busy {
            limit: self.inner.limits.max_requests,
        };
        let target = req
            .uri()
            .authority()
            .map(ToString::to_string)
            .unwrap_or_default();
        let begun = Begun::now(req, &self.inner.policy.load());
        self.finish(begun, Handled::refused(err, None, target))
    }

    /// Handles one request inside an intercepted session; `target` is the CONNECT target.
    fn handle_inner(
        self,
        req: Request<Incoming>,
        target: Target,
    ) -> impl std::future::Future<Output = Response<ProxyBody>> + Send + 'static {
        use tokio_util::either::Either;
        let policy = self.inner.policy.load();
        let begun = Begun::now(&req, &policy);
        let found = Found::in_headers(req.headers());
        let refused = if begun.method == Method::CONNECT {
            Handled::refused(
                ProxyError::BadRequest(
                    "CONNECT inside an intercepted session is not allowed".into(),
                ),
                target.name(),
                target.authority(),
            )
        } else if let Err(e) = one_host(req.headers()) {
            Handled::refused(e, target.name(), target.authority())
        } else {
            // An inner request may name its own class with the header; else it keeps the
            // CONNECT's.
            let allowed = target.allowed.as_deref();
            match self.class_of(&req, found, &policy, None, target.class, allowed) {
                Ok(class) => {
                    let target = Target { class, ..target };
                    return Either::Right(self.forward(req, target, begun, found));
                }
                Err(e) => Handled::refused(e, target.name(), target.authority()),
            }
        };
        Either::Left(std::future::ready(self.finish(begun, refused)))
    }

    /// The request with its target, or the refusal: authentication, routing, class and the
    /// policy for an unmatched host.
    // The refusal is as large as the request it answers, and made once: not boxed.
    #[allow(clippy::result_large_err)]
    fn checked(
        &self,
        req: Request<Incoming>,
        policy: &ClientPolicy,
        found: Found,
    ) -> Result<(Request<Incoming>, Target), Handled> {
        // Written only for a refusal before the target is known.
        let target_text = || {
            req.uri()
                .authority()
                .map(ToString::to_string)
                .unwrap_or_default()
        };
        // Decoded once, for the check and the user name.
        let credentials = found
            .proxy_authorization()
            .then(|| auth::basic_credentials(req.headers()))
            .flatten();
        if let Some(auth) = &policy.auth {
            if !auth::authorized(auth, credentials.as_ref()) {
                let err = ProxyError::AuthRequired {
                    realm: auth.realm.clone(),
                };
                return Err(Handled::refused(err, None, target_text()));
            }
        }
        if let Err(err) = one_host(req.headers()) {
            return Err(Handled::refused(err, None, target_text()));
        }
        let mut target = match self.target_of(&req, policy) {
            Ok(t) => t,
            Err(err) => return Err(Handled::refused(err, None, target_text())),
        };
        // The class named on the proxy connection: header, else the proxy user name.
        let user = credentials.and_then(auth::user_name);
        target.user = user.as_deref().map(Arc::from);
        target.allowed = allowed_classes(policy, &self.inner.pacer, user.as_deref());
        match self.class_of(
            &req,
            found,
            policy,
            user.as_deref(),
            target.class,
            target.allowed.as_deref(),
        ) {
            Ok(class) => target.class = class,
            Err(e) => return Err(Handled::refused(e, target.name(), target.authority())),
        }
        if target.destination.is_none() && policy.unmatched == Unmatched::Deny {
            let err = ProxyError::Unmatched {
                target: target.authority(),
            };
            return Err(Handled::refused(err, None, target.authority()));
        }
        let defaults = if req.method() == Method::CONNECT {
            CONNECT
        } else {
            HTTP
        };
        if target.destination.is_none()
            && !defaults.contains(&target.port)
            && !policy.ports.contains(target.port)
        {
            let err = ProxyError::UnmatchedPortRefused { port: target.port };
            return Err(Handled::refused(err, None, target.authority()));
        }
        Ok((req, target))
    }

    /// The class a request asks for: its `Pacegate-Class` header, else the proxy `user` name,
    /// else `fallback` (see [`crate::class::Classes::of_request`]). With `allowed` (the
    /// authenticated user's classes), a class outside it is refused; asking for none gets
    /// `fallback` if allowed, else the user's first class.
    fn class_of(
        &self,
        req: &Request<Incoming>,
        found: Found,
        policy: &ClientPolicy,
        user: Option<&str>,
        fallback: Class,
        allowed: Option<&[Class]>,
    ) -> Result<Class, ProxyError> {
        let classes = self.inner.pacer.classes();
        let asked = found
            .class()
            .then(|| req.headers().get(CLASS_HEADER))
            .flatten();
        let fallback = match allowed {
            Some(list) if !list.contains(&fallback) => list.first().copied().unwrap_or(fallback),
            _ => fallback,
        };
        let class = classes
            .of_request(asked, user, policy.auth.is_some(), fallback)
            .map_err(ProxyError::UnknownClass)?;
        match allowed {
            Some(list) if !list.contains(&class) => Err(ProxyError::ClassNotAllowed {
                user: user.unwrap_or_default().to_owned(),
                class: classes.name(class).to_owned(),
                allowed: list
                    .iter()
                    .map(|c| classes.name(*c))
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
            _ => Ok(class),
        }
    }

    /// Where a client request is going: the CONNECT authority or the absolute-form URI.
    fn target_of(
        &self,
        req: &Request<Incoming>,
        policy: &ClientPolicy,
    ) -> Result<Target, ProxyError> {
        let connect = req.method() == Method::CONNECT;
        let (scheme, host, port) = parse_target(connect, req.uri())?;
        let everywhere = &policy.ports;
        let destination =
            match self
                .inner
                .pacer
                .route(&host, port, if connect { CONNECT } else { HTTP })
            {
                Routed::To(route) => Some(route),
                Routed::Nowhere => None,
                Routed::PortRefused(route) if everywhere.contains(port) => Some(route),
                Routed::PortRefused(route) => {
                    return Err(ProxyError::PortRefused {
                        destination: route.name().to_string(),
                        port,
                    })
                }
            };
        Ok(Target {
            scheme,
            host,
            port,
            destination,
            class: self.inner.pacer.classes().default_class(),
            allowed: None,
            user: None,
            client: self.client,
        })
    }

    fn finish(&self, begun: Begun, mut handled: Handled) -> Response<ProxyBody> {
        tell_the_client(&mut handled);
        let metrics = &self.inner.metrics;
        let destination = handled.destination.as_deref().unwrap_or(UNMATCHED);
        let status = handled.response.status().as_u16();
        let elapsed = begun.started.elapsed();
        // Counted under the budget that paced it (a group's, where one did), in the series
        // it found once; a request refused before it reached a budget looks its up.
        match handled.pace.paced.as_ref().map(|p| p.series(metrics)) {
            Some(series) => {
                series.requests(handled.outcome.as_str()).inc();
                series.duration.observe(elapsed.as_secs_f64());
            }
            None => {
                metrics
                    .requests
                    .with_label_values(&labels_and(destination, handled.outcome.as_str()))
                    .inc();
                metrics
                    .request_duration
                    .with_label_values(&labels(destination))
                    .observe(elapsed.as_secs_f64());
            }
        }
        let logged = match begun.log {
            RequestLog::All => true,
            RequestLog::Errors => status >= 400 || !handled.outcome.is_success(),
            RequestLog::None => false,
        };
        if !logged {
            return handled.response;
        }
        RequestLine {
            destination,
            method: begun.method.as_str(),
            host: handled.target.logged(),
            outcome: handled.outcome.as_str(),
            status,
            duration: elapsed,
            waited: handled.pace.waited,
            verdict: handled.pace.verdict.map_or("", |v| v.as_str()),
            verdict_reason: handled.pace.verdict.map_or("", |v| v.reason()),
            retries: handled.pace.retries,
            class: handled
                .pace
                .class
                .map_or("", |c| self.inner.pacer.classes().name(c)),
            cache: cache_word(handled.response.headers()),
            reason: handled.reason.as_deref().unwrap_or(""),
        }
        .log();
        handled.response
    }
}

/// What pacegate's `Cache-Status` item on a response says, in a word (empty where it has
/// none: a destination without `cache = true`). Its item is the last, after the origin's.
fn cache_word(headers: &http::HeaderMap) -> &'static str {
    headers
        .get_all("cache-status")
        .iter()
        .next_back()
        .and_then(|v| {
            let last = v.as_bytes().rsplit(|&b| b == b',').next()?;
            crate::collapse::status::word(last.trim_ascii())
        })
        .unwrap_or("")
}

/// What a response of a destination's budget tells its client of pacegate: where its time
/// went (`Server-Timing`) and the budget's policy and standing (the RateLimit fields), on an
/// answer forwarded from the upstream; the RateLimit fields, and a `Retry-After` no sooner
/// than they say, on pacegate's own 503.
fn tell_the_client(handled: &mut Handled) {
    let Some(paced) = &handled.pace.paced else {
        return;
    };
    let refused = handled.response.status() == http::StatusCode::SERVICE_UNAVAILABLE
        && handled.outcome != Outcome::Forwarded;
    if handled.outcome != Outcome::Forwarded && !refused {
        return;
    }
    let headers = handled.response.headers_mut();
    // One buffer for every field pacegate adds: room for all three, so one allocation.
    let mut buf = bytes::BytesMut::with_capacity(160);
    if let (false, Some(waited)) = (refused, handled.pace.waited) {
        let upstream = handled.pace.sent.map(|s| s.elapsed());
        crate::headers::add_server_timing(headers, &mut buf, waited, upstream);
    }
    let Some(told) = paced.advertised() else {
        return;
    };
    told.write(headers, &mut buf);
    if refused {
        let said = headers
            .get(http::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if said.is_none_or(|s| s < told.reset) {
            headers.insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from(told.reset.max(1)),
            );
        }
    }
}

/// The classes `user` may use, when the policy lists them.
fn allowed_classes(
    policy: &ClientPolicy,
    pacer: &Pacer,
    user: Option<&str>,
) -> Option<Arc<[Class]>> {
    let listed = policy
        .auth
        .as_ref()?
        .users
        .iter()
        .find(|u| Some(u.name.as_str()) == user)?
        .classes
        .as_ref()?;
    let classes = pacer.classes();
    Some(listed.iter().filter_map(|n| classes.lookup(n)).collect())
}

/// A request with more than one `Host` is refused (RFC 9112 section 3.2): each hop could
/// judge it by another one.
fn one_host(headers: &http::HeaderMap) -> Result<(), ProxyError> {
    match headers.get_all(http::header::HOST).iter().nth(1) {
        Some(_) => Err(ProxyError::BadRequest(
            "the request has more than one Host header; send exactly one".into(),
        )),
        None => Ok(()),
    }
}

/// The scheme, host (normalised) and port a request goes to: the CONNECT authority, or the
/// absolute-form URI of a plain http request. Everything else is a 400 that says what to send.
pub fn parse_target(
    connect: bool,
    uri: &http::Uri,
) -> Result<(http::uri::Scheme, String, u16), ProxyError> {
    let scheme = if connect {
        http::uri::Scheme::HTTPS
    } else {
        match uri.scheme() {
            Some(s) if *s == http::uri::Scheme::HTTP => http::uri::Scheme::HTTP,
            Some(s) if *s == http::uri::Scheme::HTTPS => {
                return Err(ProxyError::BadRequest(
                    "https:// requests must be sent through CONNECT (set HTTPS_PROXY, not an absolute https URL)".into(),
                ))
            }
            Some(s) => return Err(ProxyError::BadRequest(format!("scheme `{s}` is not supported"))),
            None => {
                return Err(ProxyError::BadRequest(
                    "pacegate is a forward proxy: send absolute-form requests (GET http://host/path) or CONNECT host:port"
                        .into(),
                ))
            }
        }
    };
    let authority = uri
        .authority()
        .ok_or_else(|| ProxyError::BadRequest("the request names no host".into()))?;
    // Split here in one pass: `Authority::host` and `port_u16` each search the text again,
    // and `port_u16` reads a port it cannot parse (`:65536`) as none, not as an error.
    let text = authority.as_str();
    let after_user = text.rfind('@').map_or(text, |at| &text[at + 1..]);
    let invalid_host = || {
        ProxyError::BadRequest(format!(
            "`{authority}` is not a valid host name or IP address"
        ))
    };
    let (written_host, written_port) = split_host_port(after_user).ok_or_else(invalid_host)?;
    let host = normalise_host(written_host).ok_or_else(invalid_host)?;
    let port = match written_port.filter(|p| !p.is_empty()) {
        Some(written) => match port_number(written) {
            Some(0) => {
                return Err(ProxyError::BadRequest(format!(
                    "`{authority}`: port 0 is not valid"
                )))
            }
            Some(p) => p,
            None => {
                return Err(ProxyError::BadRequest(format!(
                    "`{authority}`: port {written} is not a port (1 to 65535)"
                )))
            }
        },
        None if connect => {
            return Err(ProxyError::BadRequest(format!(
                "CONNECT `{authority}` has no port"
            )))
        }
        None => 80,
    };
    Ok((scheme, host, port))
}

/// A port as written: digits only (leading zeros allowed, as `http` reads them), at most
/// 65535.
fn port_number(written: &str) -> Option<u16> {
    if written.is_empty() || written.len() > 5 || !written.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n = written
        .bytes()
        .fold(0u32, |n, d| n * 10 + u32::from(d - b'0'));
    u16::try_from(n).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_log_says_what_pacegate_s_cache_status_item_says() {
        let word = |values: &[&str]| {
            let mut headers = http::HeaderMap::new();
            for v in values {
                headers.append("cache-status", v.parse().unwrap());
            }
            cache_word(&headers)
        };
        assert_eq!(word(&[crate::collapse::status::HIT]), "hit");
        assert_eq!(
            word(&["OriginCache; hit, pacegate; fwd=uri-miss; collapsed"]),
            "collapsed"
        );
        assert_eq!(
            word(&["OriginCache; fwd=miss", crate::collapse::status::STORED]),
            "stored"
        );
        assert_eq!(word(&["OriginCache; hit"]), "", "another cache's item");
        assert_eq!(word(&[]), "");
    }

    fn target(connect: bool, uri: &str) -> Result<(String, u16), String> {
        let uri: http::Uri = uri.parse().expect("a URI");
        parse_target(connect, &uri)
            .map(|(_, host, port)| (host, port))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_target_is_read_as_written_in_every_spelling() {
        let ok = |host: &str, port| Ok((host.to_string(), port));
        assert_eq!(
            target(false, "http://Example.COM./x"),
            ok("example.com", 80)
        );
        assert_eq!(
            target(false, "http://example.com:/x"),
            ok("example.com", 80)
        );
        assert_eq!(
            target(false, "http://example.com:080/x"),
            ok("example.com", 80)
        );
        assert_eq!(
            target(false, "http://user:pw@example.com:8080/"),
            ok("example.com", 8080)
        );
        assert_eq!(target(false, "http://[::1]:8080/"), ok("::1", 8080));
        assert_eq!(target(false, "http://[::1]/"), ok("::1", 80));
        assert_eq!(
            target(false, "http://127.0.0.1:65535/"),
            ok("127.0.0.1", 65535)
        );
        assert_eq!(target(true, "example.com:443"), ok("example.com", 443));
    }

    /// The size of the future `make` returns, without making one.
    fn future_size<A, F: std::future::Future>(_make: impl FnOnce(A) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    // A request's future is moved whole into its connection's slot, where, with hundreds of
    // connections taking turns, each of its cache lines is a cold write (docs/benchmarks.md,
    // "Tenth pass"). A step written as an `async fn` that keeps its arguments twice, or a
    // rare wait held inline, grows it past this.
    #[test]
    fn a_request_future_stays_within_its_cache_lines() {
        let size = future_size(|(proxy, req): (Proxy, Request<Incoming>)| proxy.handle(req));
        assert!(size <= LINES * 64, "a request's future is {size} bytes");
        let size = future_size(|(proxy, req, target): (Proxy, Request<Incoming>, Target)| {
            proxy.handle_inner(req, target)
        });
        assert!(
            size <= LINES * 64,
            "an intercepted request's future is {size} bytes"
        );
    }

    /// What a request's future may take, in cache lines of 64 bytes.
    const LINES: usize = 24;

    #[test]
    fn a_target_that_is_not_one_says_why() {
        let why = |connect, uri| target(connect, uri).expect_err(uri);
        assert!(why(false, "http://example.com:65536/").contains("port 65536 is not a port"));
        assert!(why(false, "http://[::1]:99999/").contains("port 99999 is not a port"));
        assert!(why(false, "http://example.com:0/").contains("port 0 is not valid"));
        assert!(why(true, "example.com").contains("has no port"));
        assert!(why(false, "http://exa..mple.com/").contains("not a valid host"));
        assert!(why(false, "/just/a/path").contains("forward proxy"));
    }
}
