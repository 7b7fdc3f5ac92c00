//! Forwarding one request upstream and streaming the response back; for a destination, through
//! the pacer: wait for a slot, send, read the verdict, and retry a throttled idempotent request
//! through a fresh slot.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{EXPECT, HOST};
use http::request::Parts;
use http::uri::Scheme;
use http::{Method, Request, Response, Uri, Version};
use http_body::Body as _;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use parking_lot::Mutex;
use tokio::time::Instant;

use super::respond::{Outcome, ProxyError};
use super::{headers, sniff, Handled, Proxy};
use crate::class::{Class, CLASS_HEADER};
use crate::destination::Mode;
use crate::metrics::UNMATCHED;
use crate::pacing::verdict::Verdict;
use crate::pacing::Route;
use crate::upstream::{BoxError, ProxyBody, UpstreamError};

/// A throttled response kept while its request is retried is read into memory up to this size;
/// a larger one is handed to the client instead of retrying.
const KEPT_BODY_LIMIT: usize = 64 * 1024;

/// Where a request goes: always derived from the absolute-form URI or the CONNECT authority,
/// never from an inner `Host` header or SNI, so a client cannot reach a host it was not routed
/// to.
#[derive(Debug, Clone)]
pub struct Target {
    /// `http` for absolute-form requests, `https` inside intercepted sessions.
    pub scheme: Scheme,
    /// Normalised host (IPv6 without brackets).
    pub host: String,
    /// Port.
    pub port: u16,
    /// The matched destination, `None` for unmatched hosts.
    pub destination: Option<Route>,
    /// The class the client asked for on the proxy connection (CONNECT or absolute-form
    /// request); a request inside an intercepted session may name another with the header.
    pub class: Class,
    /// The classes the authenticated user may use, when its config lists them.
    pub allowed: Option<Arc<[Class]>>,
}

impl Target {
    /// The matched destination's name, for logs and metrics.
    pub fn name(&self) -> Option<Arc<str>> {
        self.destination.as_ref().map(|d| d.name().clone())
    }

    /// `host:port`, with IPv6 hosts bracketed.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// A request ready for the upstream client, kept as parts so that a body-less request can be
/// sent again.
struct Outgoing {
    parts: Parts,
    body: Option<Incoming>,
    /// The body lent to the attempt under way ([`Outgoing::lend`]).
    lent: Option<Arc<Mutex<Option<Incoming>>>>,
}

impl Outgoing {
    /// Another copy of a body-less request.
    fn copy(&self) -> Request<ProxyBody> {
        let mut req = Request::new(Empty::new().map_err(|never| match never {}).boxed());
        *req.method_mut() = self.parts.method.clone();
        *req.uri_mut() = self.parts.uri.clone();
        *req.version_mut() = self.parts.version;
        *req.headers_mut() = self.parts.headers.clone();
        req
    }

    /// The request, sending the original body.
    fn take(&mut self) -> Request<ProxyBody> {
        let mut req = self.copy();
        if let Some(body) = self.body.take() {
            *req.body_mut() = body.map_err(BoxError::from).boxed();
        }
        req
    }

    /// The request, with the original body lent to it: until the upstream connection reads
    /// from it, it can be taken back ([`Outgoing::take_back`]).
    fn lend(&mut self) -> Request<ProxyBody> {
        let mut req = self.copy();
        if let Some(body) = self.body.take() {
            let cell = Arc::new(Mutex::new(Some(body)));
            self.lent = Some(cell.clone());
            *req.body_mut() = Lent { cell, body: None }.boxed();
        }
        req
    }

    /// Takes back the body lent to an attempt that never reached a connection. False when
    /// the attempt began to send it: the request cannot be sent again.
    fn take_back(&mut self) -> bool {
        if let Some(cell) = self.lent.take() {
            self.body = cell.lock().take();
            return self.body.is_some();
        }
        true
    }

    /// GET, HEAD and OPTIONS with no body may be sent again after a throttle.
    fn retryable(&self) -> bool {
        matches!(
            self.parts.method,
            Method::GET | Method::HEAD | Method::OPTIONS
        ) && self.body.as_ref().is_none_or(|b| b.is_end_stream())
    }

    /// The request line kept with a lockout: no query string, which may carry secrets.
    fn request_line(&self) -> String {
        let uri = &self.parts.uri;
        let scheme = uri.scheme_str().unwrap_or("http");
        let authority = uri.authority().map_or("", |a| a.as_str());
        format!("{} {scheme}://{authority}{}", self.parts.method, uri.path())
    }
}

/// A request body lent to one attempt at sending ([`Outgoing::lend`]). It stays in the
/// shared cell until the upstream connection first asks for a frame, so an attempt given up
/// before it had a connection leaves the body whole for the next.
struct Lent {
    cell: Arc<Mutex<Option<Incoming>>>,
    body: Option<Incoming>,
}

impl http_body::Body for Lent {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.body.is_none() {
            this.body = this.cell.lock().take();
        }
        match &mut this.body {
            Some(body) => std::pin::Pin::new(body).poll_frame(cx).map_err(Into::into),
            None => std::task::Poll::Ready(Some(Err("the request body was taken back".into()))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.body {
            Some(body) => body.is_end_stream(),
            None => self.cell.lock().as_ref().is_none_or(|b| b.is_end_stream()),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match &self.body {
            Some(body) => body.size_hint(),
            None => self
                .cell
                .lock()
                .as_ref()
                .map_or_else(http_body::SizeHint::default, |b| b.size_hint()),
        }
    }
}

/// What a paced exchange adds to the canonical log line.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct PaceNote {
    pub(super) waited: Option<std::time::Duration>,
    pub(super) verdict: Option<Verdict>,
    pub(super) retries: u32,
    pub(super) class: Option<Class>,
}

impl Proxy {
    /// Forwards a request to `target` and streams the response back. Bodies are streamed both
    /// ways, never buffered whole.
    pub(super) async fn forward(&self, req: Request<Incoming>, target: Target) -> Handled {
        let destination = target.name();
        let authority = target.authority();
        let mut note = PaceNote::default();
        let result = match prepare(req, &target, &authority) {
            Err(e) => Err(e),
            Ok(mut outgoing) => match &target.destination {
                Some(route) => self.paced(outgoing, route, target.class, &mut note).await,
                None => self.send(outgoing.take(), UNMATCHED, None).await,
            },
        };
        match result {
            Ok(response) => Handled {
                response,
                outcome: Outcome::Forwarded,
                destination,
                target: authority,
                reason: None,
                pace: note,
            },
            Err(err) => Handled {
                pace: note,
                ..Handled::refused(err, destination, authority)
            },
        }
    }

    /// Sends one request and returns the response with hop-by-hop headers removed; `by` as
    /// in [`crate::upstream::Upstream::send`].
    async fn send(
        &self,
        req: Request<ProxyBody>,
        label: &str,
        by: Option<Instant>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let response = self.inner.upstream.send(req, by).await?;
        self.inner
            .metrics
            .upstream_responses
            .with_label_values(&[label, response.status().as_str()])
            .inc();
        let (mut parts, body) = response.into_parts();
        headers::strip_hop_by_hop(&mut parts.headers);
        parts.version = Version::HTTP_11;
        Ok(Response::from_parts(
            parts,
            body.map_err(BoxError::from).boxed(),
        ))
    }

    async fn paced(
        &self,
        mut outgoing: Outgoing,
        route: &Route,
        class: Class,
        note: &mut PaceNote,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let pacer = &self.inner.pacer;
        let destination: &str = route.name();
        // The keys as they are now; a reload meanwhile governs the next request.
        let pace = route.pace();
        let retry_throttled = pace.retry_throttled;
        note.class = Some(class);
        // One deadline for the request and its retries; each retry waits in the same class.
        let deadline = Instant::now() + route.max_wait(class);
        let retryable = outgoing.retryable();
        let mut last_throttled: Option<Response<ProxyBody>> = None;
        // Shadow mode sends at once and never retries: clients see what they would without
        // pacegate, while the pacer counts what it would have done.
        let shadow = pace.mode == Mode::Shadow;
        loop {
            // The connection is opened while the request waits, not after its slot; to a
            // cold upstream, before the slot is asked for.
            let expecting = self.inner.upstream.expect(&outgoing.parts.uri);
            if !shadow && expecting.cold() {
                landed(
                    deadline,
                    self.inner.upstream.first_connection(&outgoing.parts.uri),
                )
                .await?;
            }
            let admission = match pacer.enter(route, class, deadline).await {
                Ok(a) => a,
                // Out of time for another retry: the client gets the last throttled answer.
                Err(_) if last_throttled.is_some() => {
                    return Ok(last_throttled.take().expect("checked"))
                }
                Err(e) => return Err(ProxyError::Paced(e)),
            };
            drop(expecting);
            *note.waited.get_or_insert_default() += admission.waited;
            if !shadow && pacer.too_late(&admission) {
                continue;
            }
            let req = if retryable {
                outgoing.copy()
            } else {
                outgoing.lend()
            };
            // The same check where the client hands out the connection: a request that would
            // wait for one past its slot is not sent on it.
            let by = (!shadow).then(|| pacer.send_by(&admission));
            let mut response = match self.send(req, destination, by).await {
                Err(ProxyError::Upstream(UpstreamError::Late(late))) => {
                    pacer.no_connection_in_time(&admission);
                    if !outgoing.take_back() {
                        return Err(ProxyError::Upstream(UpstreamError::Late(late)));
                    }
                    // The next slot, once the connection opened for this one is there.
                    landed(deadline, self.inner.upstream.opened(&outgoing.parts.uri)).await?;
                    continue;
                }
                sent => sent?,
            };
            let status = response.status().as_u16();
            let mut reading = pacer.read(&admission, status, response.headers());
            if reading.needs_body(&pace) {
                let (whole, marked) = sniff::sniff(response, &pace.throttle_body).await;
                response = whole;
                if marked {
                    reading = reading.marked_by_body();
                }
            }
            let verdict = pacer
                .observe(&admission, reading, status, || outgoing.request_line())
                .await;
            note.verdict = Some(verdict);
            let throttled = matches!(verdict, Verdict::Throttled { .. });
            if throttled && retryable && !shadow && note.retries < retry_throttled {
                if let Some(kept) = keep(response).await {
                    note.retries += 1;
                    self.inner
                        .metrics
                        .retries
                        .with_label_values(&[destination])
                        .inc();
                    last_throttled = Some(kept);
                    continue;
                }
                return Err(ProxyError::Upstream(UpstreamError::Protocol(
                    "the throttled response's body failed while it was read".into(),
                )));
            }
            // The slot's concurrency permit and in-flight count last until the body is done.
            let (parts, body) = response.into_parts();
            let body = body.map_frame(move |frame| {
                let _held = &admission;
                frame
            });
            return Ok(Response::from_parts(parts, body.boxed()));
        }
    }
}

/// Reads a throttled response into memory so that its connection is free while the request
/// is retried. `None` when the body fails or is larger than [`KEPT_BODY_LIMIT`]: it cannot be
/// kept, so the caller must not retry.
async fn keep(response: Response<ProxyBody>) -> Option<Response<ProxyBody>> {
    let (parts, mut body) = response.into_parts();
    let mut kept = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame.ok()?.data_ref() {
            if kept.len() + data.len() > KEPT_BODY_LIMIT {
                return None;
            }
            kept.extend_from_slice(data);
        }
    }
    let body = Full::new(Bytes::from(kept))
        .map_err(|never| match never {})
        .boxed();
    Some(Response::from_parts(parts, body))
}

/// Rewrites a client request for the upstream: URI from the target (`authority` is its
/// [`Target::authority`]), HTTP/1.1 version, hop-by-hop headers removed.
fn prepare(
    req: Request<Incoming>,
    target: &Target,
    authority: &str,
) -> Result<Outgoing, ProxyError> {
    let (mut parts, body) = req.into_parts();
    if let Some(protocol) = headers::upgrade_protocol(&parts.headers) {
        return Err(ProxyError::UpgradeUnsupported { protocol });
    }
    // An absolute-form URI that already names the target as it is routed is sent as it came.
    let as_routed = parts.uri.scheme() == Some(&target.scheme)
        && parts.uri.authority().map(|a| a.as_str()) == Some(authority);
    if !as_routed {
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = format!("{}://{authority}{path}", target.scheme)
            .parse::<Uri>()
            .map_err(|e| ProxyError::BadRequest(format!("cannot build the upstream URI: {e}")))?;
    }
    if parts.version == Version::HTTP_2 {
        headers::join_cookies(&mut parts.headers);
    }
    // The client connection picks HTTP/1.1 or h2 upstream by ALPN; the request itself must
    // say HTTP/1.1 or an h1-only upstream refuses it.
    parts.version = Version::HTTP_11;
    headers::strip_hop_by_hop(&mut parts.headers);
    // The class is for pacegate, not for the upstream.
    parts.headers.remove(CLASS_HEADER);
    // The client derives Host from the URI. `Expect` was answered on this side: hyper sends
    // the 100 when the body is first read.
    parts.headers.remove(HOST);
    parts.headers.remove(EXPECT);
    parts.extensions = http::Extensions::new();
    Ok(Outgoing {
        parts,
        body: Some(body),
        lent: None,
    })
}

/// Waits until `deadline` for the connection `landing` awaits: its failure is the request's
/// (a 502, or a 504 at the connect timeout). Out of time, the pacer's own deadline refuses
/// the request when it asks for its slot.
async fn landed(
    deadline: Instant,
    landing: impl std::future::Future<Output = Result<(), UpstreamError>>,
) -> Result<(), ProxyError> {
    match tokio::time::timeout_at(deadline, landing).await {
        Ok(Err(unreachable)) => Err(ProxyError::Upstream(unreachable)),
        _ => Ok(()),
    }
}
