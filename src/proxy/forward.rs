//! Forwarding one request upstream and streaming the response back: the request rewritten for
//! the upstream, then handed to the pacer's exchange for a destination, or sent at once for an
//! unmatched host.

use std::sync::Arc;

use http::header::{EXPECT, HOST};
use http::uri::Scheme;
use http::{Request, Response, Uri, Version};
use hyper::body::Incoming;

use super::respond::{Outcome, ProxyError};
use super::{Aimed, Handled, Proxy};
use crate::class::{Class, CLASS_HEADER};
use crate::headers;
use crate::metrics::UNMATCHED;
use crate::pacing::{Note, Outgoing, Route};
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
    /// Forwards a request to `target` and streams the response back: to a destination, as
    /// an exchange paced by its budget ([`crate::pacing::Pacer::exchange`]); elsewhere, at
    /// once. Bodies are streamed both ways, never buffered whole.
    pub(super) async fn forward(&self, req: Request<Incoming>, target: Target) -> Handled {
        let destination = target.name();
        let (result, pace) = match prepare(req, &target) {
            Err(e) => (Err(e), Note::default()),
            Ok(outgoing) => match &target.destination {
                Some(route) => {
                    let inner = &self.inner;
                    let exchanged = inner
                        .pacer
                        .exchange(&inner.upstream, route, target.class, outgoing)
                        .await;
                    (exchanged.response.map_err(ProxyError::from), exchanged.note)
                }
                None => (self.unpaced(outgoing).await, Note::default()),
            },
        };
        let aimed = Aimed::At(target.host, target.port);
        match result {
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
        }
    }

    /// Sends a request to an unmatched host (`unmatched = "tunnel"`) as it is, once.
    async fn unpaced(&self, outgoing: Outgoing) -> Result<Response<ProxyBody>, ProxyError> {
        let response = self
            .inner
            .upstream
            .send(outgoing.into_request(), None, None)
            .await?;
        self.inner
            .metrics
            .upstream_response(UNMATCHED, response.status());
        Ok(response)
    }
}

/// Rewrites a client request for the upstream: URI from the target, HTTP/1.1 version,
/// hop-by-hop headers removed.
fn prepare(req: Request<Incoming>, target: &Target) -> Result<Outgoing, ProxyError> {
    let (mut parts, body) = req.into_parts();
    if let Some(protocol) = headers::upgrade_protocol(&parts.headers) {
        return Err(ProxyError::UpgradeUnsupported { protocol });
    }
    // An absolute-form URI that already names the target as it is routed is sent as it came.
    let as_routed = parts.uri.scheme() == Some(&target.scheme)
        && parts.uri.authority().is_some_and(|a| {
            a.port_u16() == Some(target.port)
                && a.host().trim_start_matches('[').trim_end_matches(']') == target.host
        });
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
    headers::strip_hop_by_hop(&mut parts.headers);
    // The class is for pacegate, not for the upstream.
    parts.headers.remove(CLASS_HEADER);
    // The upstream client derives Host from the URI, unless the request has one. So the
    // client's own stays only where it is exactly what would be derived (no other virtual
    // host than the one routed to): most requests, which spares formatting it again.
    if !host_as_derived(&parts.uri, &parts.headers) {
        parts.headers.remove(HOST);
    }
    // `Expect` was answered on this side: hyper sends the 100 when the body is first read.
    parts.headers.remove(EXPECT);
    parts.extensions = http::Extensions::new();
    Ok(Outgoing::new(parts, body).with_user(target.user.clone()))
}

/// Whether `headers` hold one `Host`, and it is the one the upstream client would derive
/// from `uri`: its host, and its port unless the scheme's default.
fn host_as_derived(uri: &Uri, headers: &http::HeaderMap) -> bool {
    let mut hosts = headers.get_all(HOST).iter();
    let (Some(given), None) = (hosts.next(), hosts.next()) else {
        return false;
    };
    let Some(authority) = uri.authority() else {
        return false;
    };
    let default = if uri.scheme() == Some(&Scheme::HTTPS) {
        443
    } else {
        80
    };
    let Some(rest) = given.as_bytes().strip_prefix(authority.host().as_bytes()) else {
        return false;
    };
    match authority.port_u16() {
        Some(port) if port != default => rest.strip_prefix(b":").is_some_and(|written| {
            // As written by the client: digits only, no leading zero, the same number.
            written.first().is_some_and(|d| *d != b'0')
                && written.iter().all(u8::is_ascii_digit)
                && std::str::from_utf8(written)
                    .ok()
                    .and_then(|w| w.parse().ok())
                    == Some(port)
        }),
        _ => rest.is_empty(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn derived(uri: &str, given: &[&str]) -> bool {
        let mut headers = http::HeaderMap::new();
        for host in given {
            headers.append(HOST, host.parse().unwrap());
        }
        host_as_derived(&uri.parse().unwrap(), &headers)
    }

    #[test]
    fn only_the_host_the_upstream_client_would_write_is_kept() {
        assert!(derived("http://localhost:8080/a", &["localhost:8080"]));
        assert!(derived("http://localhost/a", &["localhost"]));
        assert!(derived("http://localhost:80/a", &["localhost"]));
        assert!(derived("https://[::1]:8443/", &["[::1]:8443"]));
        for (uri, given) in [
            ("http://localhost:8080/", &["elsewhere:8080"][..]),
            ("http://localhost:8080/", &["localhost"]),
            ("http://localhost:8080/", &["localhost:08080"]),
            (
                "http://localhost:8080/",
                &["localhost:8080", "localhost:8080"],
            ),
            ("http://localhost:80/", &["localhost:80"]),
            ("http://localhost/", &["localhost.evil"]),
            ("http://localhost/", &[]),
        ] {
            assert!(!derived(uri, given), "{uri} with {given:?}");
        }
    }
}
