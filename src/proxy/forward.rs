//! Forwarding one request upstream and streaming the response back: the request rewritten for
//! the upstream, then handed to the pacer's exchange for a destination, or sent at once for an
//! unmatched host.

use std::sync::Arc;

use http::header::{EXPECT, HOST};
use http::uri::Scheme;
use http::{Request, Response, Uri, Version};
use hyper::body::Incoming;

use super::respond::{Outcome, ProxyError};
use super::{Aimed, Begun, Handled, Proxy};
use crate::class::{Class, CLASS_HEADER};
use crate::collapse::{self, Collapser, Joined, Waited};
use crate::headers::{self, Found};
use crate::metrics::UNMATCHED;
use crate::pacing::{Exchanged, Note, Outgoing, Route};
use crate::upstream::ProxyBody;

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
    /// The proxy user named on the proxy connection (CONNECT or absolute-form request).
    pub user: Option<Arc<str>>,
    /// The address of the client connection.
    pub client: Option<std::net::IpAddr>,
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

impl Proxy {
    /// Forwards a request to `target` and streams the response back (logged and counted by
    /// [`Proxy::finish`]): to a destination, as
    /// an exchange paced by its budget ([`crate::pacing::Pacer::exchange`]); elsewhere, at
    /// once. Bodies are streamed both ways, never buffered whole.
    // A function that returns its future, not an `async fn`: the request is rewritten before
    // the future is made, so the future holds it once, as it goes upstream, where an
    // argument is held for the whole of the future beside what it was turned into.
    pub(super) fn forward(
        self,
        req: Request<Incoming>,
        target: Target,
        begun: Begun,
        found: Found,
    ) -> impl std::future::Future<Output = Response<ProxyBody>> + Send + 'static {
        let mut prepared =
            prepare(req, &target, found).map(|o| o.with_stall(&self.inner.client_stall));
        async move {
            let destination = target.name();
            let collapse = match (&self.inner.collapse, &target.destination) {
                (Some(c), Some(route)) if route.collapses() && prepared.is_ok() => Some(c),
                _ => None,
            };
            let (result, pace) = match (&mut prepared, &target.destination) {
                (Ok(_), Some(route)) if collapse.is_some() => {
                    let inner = &self.inner;
                    // Boxed: rare beside the plain exchange, and larger. The request is taken
                    // whole, for the leader's fetch, which outlives its client.
                    let exchanged = Box::pin(collapsed(
                        inner,
                        collapse,
                        route,
                        target.class,
                        &mut prepared,
                    ))
                    .await;
                    (exchanged.response.map_err(ProxyError::from), exchanged.note)
                }
                (Ok(request), Some(route)) => {
                    let inner = &self.inner;
                    let exchanged = inner
                        .pacer
                        .exchange(&inner.upstream, route, target.class, request)
                        .await;
                    (exchanged.response.map_err(ProxyError::from), exchanged.note)
                }
                // Refused, or to a host no destination paces: sent once, as it is.
                _ => match prepared {
                    Err(e) => (Err(e), Note::default()),
                    Ok(request) => (self.unpaced(request).await, Note::default()),
                },
            };
            let aimed = Aimed::At(target.host, target.port);
            let handled = match result {
                Ok(response) => Handled {
                    response,
                    outcome: Outcome::Forwarded,
                    destination,
                    target: aimed,
                    reason: None,
                    pace,
                },
                Err(err) => Handled {
                    pace,
                    ..Handled::refused(err, destination, aimed)
                },
            };
            self.finish(begun, handled)
        }
    }

    /// Sends a request to an unmatched host (`unmatched = "tunnel"`) as it is, once.
    async fn unpaced(&self, outgoing: Outgoing) -> Result<Response<ProxyBody>, ProxyError> {
        let response = self
            .inner
            .upstream
            .send(outgoing.into_request(), None, None)
            .await?;
        // Boxed once, and cut should it stall (`body_timeout`).
        let response = response.map(|body| self.inner.upstream.body(body));
        self.inner
            .metrics
            .upstream_response(UNMATCHED, response.status());
        Ok(response)
    }
}

/// An exchange of a destination whose identical requests in flight share one fetch: alone,
/// as the leader others wait for, or as a waiter served the leader's response (or going on
/// its own, or in the leader's place, as [`crate::collapse`] says).
async fn collapsed(
    inner: &super::Inner,
    collapse: Option<&Arc<Collapser>>,
    route: &Route,
    class: Class,
    prepared: &mut Result<Outgoing, ProxyError>,
) -> Exchanged {
    // Taken out of the caller's future, which gives it no other use.
    let taken = std::mem::replace(
        prepared,
        Err(ProxyError::BadRequest(
            "taken by a collapsed exchange".into(),
        )),
    );
    let Ok(mut request) = taken else {
        unreachable!("called with a prepared request")
    };
    let head = request.head().clone();
    let Some(collapse) = collapse else {
        unreachable!("called for a collapsing destination")
    };
    let lead = match collapse.join(route, &request).await {
        Joined::Hit(response) => {
            return Exchanged {
                response: Ok(response),
                note: Note {
                    class: Some(class),
                    ..Note::default()
                },
            }
        }
        Joined::Alone => {
            let status = if head.method == http::Method::GET || head.method == http::Method::HEAD {
                collapse::status::FETCHED
            } else {
                collapse::status::METHOD
            };
            let exchanged = inner
                .pacer
                .exchange(&inner.upstream, route, class, &mut request)
                .await;
            return with_cache_status(exchanged, status);
        }
        Joined::Lead(lead) => lead,
        Joined::Wait(wait) => match wait.answer(route, &head).await {
            Waited::Served(response) => {
                return Exchanged {
                    response: Ok(response),
                    note: Note {
                        class: Some(class),
                        ..Note::default()
                    },
                }
            }
            Waited::OnItsOwn => {
                let exchanged = inner
                    .pacer
                    .exchange(&inner.upstream, route, class, &mut request)
                    .await;
                return with_cache_status(exchanged, collapse::status::RELEASED);
            }
            Waited::Lead(lead) => lead,
        },
    };
    // The leader's fetch is a task of its own: the others wait for it even when its own
    // client goes away.
    request.tell_departures(lead.departure());
    // Conditional on a stale entry's validators, where it refreshes one.
    let mut head = head;
    let conditions = lead.conditions(&head);
    for (name, value) in &conditions {
        request.add_header(name.clone(), value.clone());
        head.headers.insert(name.clone(), value.clone());
    }
    let (pacer, upstream, route) = (inner.pacer.clone(), inner.upstream.clone(), route.clone());
    let (answered, answer) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let exchanged = pacer.exchange(&upstream, &route, class, &mut request).await;
        let (exchanged, mut recording) = lead.answer(&route, &head, exchanged);
        // The leader's client may be gone: the body is recorded for the others all the same.
        let _ = answered.send(exchanged);
        // A body cut short is asked for again, whole and through a slot, and goes on from
        // where it was cut (see `collapse::Recording::record`).
        for (name, _) in &conditions {
            request.remove_header(name);
        }
        while let Some(cut) = match recording {
            Some(recording) => recording.record().await,
            None => None,
        } {
            let again = pacer.exchange(&upstream, &route, class, &mut request).await;
            recording = cut.resume(again);
        }
    });
    match answer.await {
        Ok(exchanged) => exchanged,
        Err(_) => Exchanged {
            response: Err(crate::pacing::ExchangeError::Upstream(
                crate::upstream::UpstreamError::Protocol("the shared fetch ended".into()),
            )),
            note: Note::default(),
        },
    }
}

/// `exchanged`'s response, if any, with pacegate's `Cache-Status` item.
fn with_cache_status(exchanged: Exchanged, item: &'static str) -> Exchanged {
    Exchanged {
        response: exchanged.response.map(|r| collapse::with_status(r, item)),
        note: exchanged.note,
    }
}

/// Rewrites a client request for the upstream: URI from the target, HTTP/1.1 version,
/// hop-by-hop headers removed. `found` says which of the names acted on it holds (a name
/// that is not there is not looked up).
fn prepare(req: Request<Incoming>, target: &Target, found: Found) -> Result<Outgoing, ProxyError> {
    let (mut parts, body) = req.into_parts();
    if let Some(protocol) = headers::upgrade_protocol(&parts.headers, found) {
        return Err(ProxyError::UpgradeUnsupported { protocol });
    }
    // An absolute-form URI that already names the target exactly as it is routed (host
    // normalised, port written) is sent as it came.
    let as_routed = parts.uri.scheme() == Some(&target.scheme)
        && parts
            .uri
            .authority()
            .is_some_and(|a| written_as(a.as_str(), &target.host, Some(target.port)));
    if !as_routed {
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = format!("{}://{}{path}", target.scheme, target.authority())
            .parse::<Uri>()
            .map_err(|e| ProxyError::BadRequest(format!("cannot build the upstream URI: {e}")))?;
    }
    if parts.version == Version::HTTP_2 {
        headers::join_cookies(&mut parts.headers);
    }
    // The client connection picks HTTP/1.1 or h2 upstream by ALPN; the request itself must
    // say HTTP/1.1 or an h1-only upstream refuses it.
    parts.version = Version::HTTP_11;
    headers::strip_found(&mut parts.headers, found);
    // The class is for pacegate, not for the upstream.
    if found.class() {
        parts.headers.remove(CLASS_HEADER);
    }
    // The upstream client derives Host from the URI, unless the request has one. So the
    // client's own stays only where it is exactly what would be derived (no other virtual
    // host than the one routed to): most requests, which spares formatting it again.
    if !host_as_derived(target, &parts.headers) {
        parts.headers.remove(HOST);
    }
    // `Expect` was answered on this side: hyper sends the 100 when the body is first read.
    if found.expect() {
        parts.headers.remove(EXPECT);
    }
    parts.extensions = http::Extensions::new();
    Ok(Outgoing::new(parts, body)
        .with_user(target.user.clone())
        .with_client(target.client))
}

/// Whether `headers` hold one `Host`, and it is the one the upstream client would derive
/// from the URI [`prepare`] leaves, which names `target` as routed: its host (bracketed if
/// IPv6), and its port unless the scheme's default.
fn host_as_derived(target: &Target, headers: &http::HeaderMap) -> bool {
    let mut hosts = headers.get_all(HOST).iter();
    let (Some(given), None) = (hosts.next(), hosts.next()) else {
        return false;
    };
    let default = if target.scheme == Scheme::HTTPS {
        443
    } else {
        80
    };
    let port = (target.port != default).then_some(target.port);
    given
        .to_str()
        .is_ok_and(|given| written_as(given, &target.host, port))
}

/// Whether `written` is `host` (bracketed if it is an IPv6 address) followed by `:port` where
/// a port is given, or by nothing where none is, as pacegate writes it: digits only, no
/// leading zero. Compared as bytes, since `host` is normalised (lowercase): another spelling
/// is not as routed.
fn written_as(written: &str, host: &str, port: Option<u16>) -> bool {
    // As bytes throughout: the host is short and plain, and a search for a `char` or a
    // second pass over the digits costs more than the comparison itself.
    let (written, host) = (written.as_bytes(), host.as_bytes());
    let rest = if host.contains(&b':') {
        written
            .strip_prefix(b"[")
            .and_then(|w| w.strip_prefix(host))
            .and_then(|w| w.strip_prefix(b"]"))
    } else {
        written.strip_prefix(host)
    };
    let Some(rest) = rest else {
        return false;
    };
    let Some(port) = port else {
        return rest.is_empty();
    };
    let Some(digits) = rest.strip_prefix(b":") else {
        return false;
    };
    if digits.is_empty() || digits.len() > 5 || digits[0] == b'0' {
        return false;
    }
    let mut n = 0u32;
    for &d in digits {
        if !d.is_ascii_digit() {
            return false;
        }
        n = n * 10 + u32::from(d - b'0');
    }
    n == u32::from(port)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn derived(scheme: Scheme, host: &str, port: u16, given: &[&str]) -> bool {
        let mut headers = http::HeaderMap::new();
        for host in given {
            headers.append(HOST, host.parse().unwrap());
        }
        let target = Target {
            scheme,
            host: host.into(),
            port,
            destination: None,
            class: Class(0),
            allowed: None,
            user: None,
            client: None,
        };
        host_as_derived(&target, &headers)
    }

    #[test]
    fn only_the_host_the_upstream_client_would_write_is_kept() {
        use Scheme as S;
        assert!(derived(S::HTTP, "localhost", 8080, &["localhost:8080"]));
        assert!(derived(S::HTTP, "localhost", 80, &["localhost"]));
        assert!(derived(S::HTTPS, "::1", 8443, &["[::1]:8443"]));
        assert!(derived(S::HTTPS, "::1", 443, &["[::1]"]));
        for (scheme, port, given) in [
            (S::HTTP, 8080, &["elsewhere:8080"][..]),
            (S::HTTP, 8080, &["localhost"]),
            (S::HTTP, 8080, &["localhost:08080"]),
            (S::HTTP, 8080, &["LOCALHOST:8080"]),
            (S::HTTP, 8080, &["localhost:8080x"]),
            (S::HTTP, 8080, &["localhost:80800"]),
            (S::HTTP, 8080, &["localhost:8080", "localhost:8080"]),
            (S::HTTP, 80, &["localhost:80"]),
            (S::HTTP, 80, &["localhost.evil"]),
            (S::HTTP, 80, &[]),
            (S::HTTPS, 443, &["localhost:443"]),
        ] {
            assert!(
                !derived(scheme.clone(), "localhost", port, given),
                "{scheme} {port} {given:?}"
            );
        }
        assert!(!derived(S::HTTPS, "::1", 8443, &["::1:8443"]));
    }

    #[test]
    fn an_authority_is_as_routed_only_as_pacegate_writes_it() {
        assert!(written_as("localhost:8080", "localhost", Some(8080)));
        assert!(written_as("localhost:65535", "localhost", Some(65535)));
        assert!(written_as("[::1]:443", "::1", Some(443)));
        assert!(written_as("localhost", "localhost", None));
        for (written, port) in [
            ("localhost", Some(80)),
            ("localhost:80", None),
            ("user@localhost:8080", Some(8080)),
            ("localhost:08080", Some(8080)),
            ("localhost:8081", Some(8080)),
            ("localhost:99999", Some(34463)),
            ("localhost:", Some(80)),
            ("localhostx:80", Some(80)),
            ("Localhost:80", Some(80)),
        ] {
            assert!(
                !written_as(written, "localhost", port),
                "{written} {port:?}"
            );
        }
        assert!(!written_as("::1:443", "::1", Some(443)));
    }
}
