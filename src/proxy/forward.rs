//! Forwarding one request upstream and streaming the response back.

use std::sync::Arc;

use http::header::{EXPECT, HOST};
use http::uri::Scheme;
use http::{Request, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::respond::{Outcome, ProxyError};
use super::{headers, Handled, Proxy};
use crate::metrics::UNMATCHED;
use crate::upstream::BoxError;

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
    /// The matched destination's name, `None` for unmatched hosts.
    pub destination: Option<Arc<str>>,
}

impl Target {
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
    /// Forwards a request to `target` and streams the response back. Bodies are streamed both
    /// ways, never buffered whole.
    pub(super) async fn forward(&self, req: Request<Incoming>, target: Target) -> Handled {
        let destination = target.destination.clone();
        let authority = target.authority();
        match self.exchange(req, &target).await {
            Ok(response) => {
                self.inner
                    .metrics
                    .upstream_responses
                    .with_label_values(&[
                        destination.as_deref().unwrap_or(UNMATCHED),
                        response.status().as_str(),
                    ])
                    .inc();
                Handled {
                    response,
                    outcome: Outcome::Forwarded,
                    destination,
                    target: authority,
                    reason: None,
                }
            }
            Err(err) => Handled::refused(err, destination, authority),
        }
    }

    async fn exchange(
        &self,
        req: Request<Incoming>,
        target: &Target,
    ) -> Result<http::Response<crate::upstream::ProxyBody>, ProxyError> {
        let (mut parts, body) = req.into_parts();
        if let Some(protocol) = headers::upgrade_protocol(&parts.headers) {
            return Err(ProxyError::UpgradeUnsupported { protocol });
        }
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = format!("{}://{}{path}", target.scheme, target.authority())
            .parse()
            .map_err(|e| ProxyError::BadRequest(format!("cannot build the upstream URI: {e}")))?;
        if parts.version == Version::HTTP_2 {
            headers::join_cookies(&mut parts.headers);
        }
        // The client connection picks HTTP/1.1 or h2 upstream by ALPN; the request itself must
        // say HTTP/1.1 or an h1-only upstream refuses it.
        parts.version = Version::HTTP_11;
        headers::strip_hop_by_hop(&mut parts.headers);
        // The client derives Host from the URI. `Expect` was answered on this side: hyper sends
        // the 100 when the body is first read.
        parts.headers.remove(HOST);
        parts.headers.remove(EXPECT);
        let body = body.map_err(BoxError::from).boxed();
        let response = self
            .inner
            .upstream
            .send(Request::from_parts(parts, body))
            .await?;
        let (mut parts, body) = response.into_parts();
        headers::strip_hop_by_hop(&mut parts.headers);
        parts.version = Version::HTTP_11;
        Ok(http::Response::from_parts(
            parts,
            body.map_err(BoxError::from).boxed(),
        ))
    }
}
