//! The one place where failures become responses.
//!
//! Every response pacegate makes itself carries `Proxy-Status` (RFC 9209) naming `pacegate`,
//! with an error token and a `details` string that says what happened and what to do.

use std::fmt;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, PROXY_AUTHENTICATE};
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Full};

use crate::class::UnknownClass;
use crate::pacing::{BodyError, ExchangeError, PaceError};
use crate::server::Refused;
use crate::upstream::{ConnectError, ProxyBody, UpstreamError};

/// How a request ended, for the `outcome` metric label and the canonical log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Forwarded upstream and answered with the upstream's response.
    Forwarded,
    /// A CONNECT answered 200 and intercepted.
    Intercepted,
    /// A CONNECT answered 200 as a blind tunnel.
    Tunneled,
    /// Refused by policy: no destination matches.
    Denied,
    /// Refused: the upstream address is private or otherwise forbidden.
    ForbiddenAddress,
    /// Refused: proxy authentication missing or wrong.
    AuthRequired,
    /// The client's request was malformed.
    BadRequest,
    /// Refused: the request body is larger than the destination reads to estimate its cost.
    TooLarge,
    /// A protocol upgrade that pacegate does not relay.
    UpgradeRefused,
    /// The upstream could not be reached or failed mid-exchange.
    UpstreamError,
    /// The upstream did not connect or answer in time.
    UpstreamTimeout,
    /// pacegate itself failed.
    Internal,
    /// Refused: the destination is locked out.
    Locked,
    /// Refused: no slot within `max_wait`.
    Deadline,
    /// Refused: the request's key would be one more than `max_keys`.
    TooManyKeys,
    /// Refused: the pacing store is unavailable, or pacegate is shutting down.
    Unavailable,
    /// Refused: `max_requests` requests were in flight already.
    Busy,
}

impl Outcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Forwarded => "forwarded",
            Self::Intercepted => "intercepted",
            Self::Tunneled => "tunneled",
            Self::TooManyKeys => "too_many_keys",
            Self::Denied => "denied",
            Self::ForbiddenAddress => "forbidden_address",
            Self::AuthRequired => "auth_required",
            Self::BadRequest => "bad_request",
            Self::TooLarge => "too_large",
            Self::UpgradeRefused => "upgrade_refused",
            Self::UpstreamError => "upstream_error",
            Self::UpstreamTimeout => "upstream_timeout",
            Self::Internal => "internal_error",
            Self::Locked => "locked",
            Self::Deadline => "deadline",
            Self::Unavailable => "unavailable",
            Self::Busy => "busy",
        }
    }

    /// Whether the request went where it was meant to (forwarded, intercepted or tunnelled)
    /// rather than being refused or failing.
    pub fn is_success(self) -> bool {
        matches!(self, Self::Forwarded | Self::Intercepted | Self::Tunneled)
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why pacegate answered a request itself.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The request is malformed or not something a forward proxy serves.
    #[error("{0}")]
    BadRequest(String),
    /// Proxy authentication is on and the request has no valid credentials.
    #[error(
        "proxy authentication required: send Proxy-Authorization (Basic) with a configured user"
    )]
    AuthRequired {
        /// The realm for `Proxy-Authenticate`.
        realm: String,
    },
    /// No destination matches and `[proxy] unmatched = "deny"`.
    #[error("{target} matches no configured destination; add it to the hosts of a [destinations.NAME] section, or set [proxy] unmatched = \"tunnel\" to pass unconfigured hosts unpaced")]
    Unmatched {
        /// `host:port` as requested.
        target: String,
    },
    /// A configured destination's host on a port other than the scheme's default and the
    /// destination's `ports`.
    #[error("port {port} is not allowed for destination `{destination}`: only the default ports (80 for http; 443 and 80 for CONNECT) are, unless [destinations.{destination}] or [proxy] lists it in `ports` (ranges like \"8000-8999\" too)")]
    PortRefused {
        /// The destination whose host it is.
        destination: String,
        /// The port asked for.
        port: u16,
    },
    /// An unmatched host on a port other than the scheme's default and `[proxy] ports`.
    #[error("port {port} is not allowed for hosts in no destination: only the default ports (80 for http; 443 and 80 for CONNECT) are, unless [proxy] ports lists it")]
    UnmatchedPortRefused {
        /// The port asked for.
        port: u16,
    },
    /// The authenticated user may not use the class the request asks for.
    #[error("user `{user}` may not use class `{class}`; its classes are: {allowed}")]
    ClassNotAllowed {
        /// The proxy user.
        user: String,
        /// The class asked for.
        class: String,
        /// The classes the user may use.
        allowed: String,
    },
    /// A protocol upgrade (WebSocket, h2c) that pacegate does not relay.
    #[error("pacegate does not relay `{protocol}` upgrades on paced destinations; open the connection without the proxy or through an unmatched tunnel")]
    UpgradeUnsupported {
        /// The `Upgrade` header's value.
        protocol: String,
    },
    /// The upstream exchange failed.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// Something inside pacegate failed (a certificate could not be minted).
    #[error("{0}")]
    Internal(String),
    /// The pacer gave no slot.
    #[error("{}", paced_details(.0))]
    Paced(PaceError),
    /// As many requests as `proxy.limits.max_requests` allows were in flight already.
    #[error("pacegate has {limit} requests in flight (proxy.limits.max_requests); retry shortly or raise the limit")]
    Busy {
        /// The limit.
        limit: usize,
    },
    /// The client's address is outside `[proxy] clients`: refused before anything is read.
    #[error("this client address is outside [proxy] clients; ask pacegate's operator to add your network")]
    ClientRefused,
    /// As many client connections as `proxy.limits.max_connections` allows were open
    /// already: refused before anything is read.
    #[error("pacegate has {limit} client connections open (proxy.limits.max_connections); retry shortly or raise the limit")]
    TooManyConnections {
        /// The limit.
        limit: usize,
    },
    /// The request body is larger than the destination's `max_body`, which its meters read
    /// to estimate the request's cost.
    #[error("{0}; send a smaller body, or raise max_body for this destination")]
    TooLarge(String),
    /// The request names a class that is not configured.
    #[error("{0}: name one of them in the Pacegate-Class header or the proxy URL's user name (http://CLASS@host:port), or none for the default")]
    UnknownClass(UnknownClass),
}

impl From<Refused> for ProxyError {
    fn from(why: Refused) -> Self {
        match why {
            Refused::Client => Self::ClientRefused,
            Refused::Connections { limit } => Self::TooManyConnections { limit },
        }
    }
}

impl From<ExchangeError> for ProxyError {
    fn from(e: ExchangeError) -> Self {
        match e {
            ExchangeError::Paced(p) => Self::Paced(p),
            ExchangeError::Upstream(u) => Self::Upstream(u),
            ExchangeError::Body(b @ BodyError::TooLarge { .. }) => Self::TooLarge(b.to_string()),
            ExchangeError::Body(b @ BodyError::Failed(_)) => Self::BadRequest(b.to_string()),
        }
    }
}

fn paced_details(e: &PaceError) -> String {
    match e {
        PaceError::Locked { destination, lock } => format!(
            "destination `{destination}` is locked out since {}: the upstream answered {} to `{}` (seen by {}); pacegate sends nothing to it until an operator runs `pacegate unlock {destination} --config FILE` or POSTs /destinations/{destination}/unlock on the admin listener",
            humantime::format_rfc3339_seconds(lock.since),
            lock.status,
            lock.request,
            lock.instance
        ),
        PaceError::Deadline { destination, class, max_wait, retry_after } => format!(
            "no slot for destination `{destination}` within max_wait ({}, class `{class}`); the destination is busy or paused, retry in about {}s",
            humantime::format_duration(*max_wait),
            retry_after_secs(*retry_after)
        ),
        PaceError::TooManyKeys { budget, max_keys, key_idle } => format!(
            "budget `{budget}` is split by key and keeps {max_keys} keys already (max_keys); a request with a new key is refused, never sent unpaced. A key idle for {} (key_idle) makes room: retry later, or raise max_keys",
            humantime::format_duration(*key_idle)
        ),
        PaceError::ClientKeys { budget, client, limit, key_idle } => format!(
            "budget `{budget}` is split by key, and {client} made {limit} of its keys already (max_keys_per_client): one client may not take every key's place. A request with a new key from it is refused until one of its keys is idle for {} (key_idle): retry later, or raise max_keys_per_client",
            humantime::format_duration(*key_idle)
        ),
        PaceError::Store(e) => format!("pacing store unavailable: {e}"),
        PaceError::ShuttingDown => "pacegate is shutting down; retry on another instance or after the restart".into(),
    }
}

/// Whole seconds for `Retry-After`, rounded up, at least 1.
fn retry_after_secs(d: std::time::Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0).max(u64::from(d.is_zero()))
}

impl ProxyError {
    /// The status code, RFC 9209 error token and outcome of this error.
    fn classify(&self) -> (StatusCode, &'static str, Outcome) {
        use StatusCode as S;
        match self {
            Self::BadRequest(_) | Self::UnknownClass(_) => {
                (S::BAD_REQUEST, "http_request_error", Outcome::BadRequest)
            }
            Self::TooLarge(_) => (
                S::PAYLOAD_TOO_LARGE,
                "http_request_denied",
                Outcome::TooLarge,
            ),
            Self::AuthRequired { .. } => (
                S::PROXY_AUTHENTICATION_REQUIRED,
                "http_request_denied",
                Outcome::AuthRequired,
            ),
            Self::Unmatched { .. }
            | Self::PortRefused { .. }
            | Self::UnmatchedPortRefused { .. }
            | Self::ClassNotAllowed { .. }
            | Self::ClientRefused => (S::FORBIDDEN, "http_request_denied", Outcome::Denied),
            Self::UpgradeUnsupported { .. } => (
                S::NOT_IMPLEMENTED,
                "http_upgrade_failed",
                Outcome::UpgradeRefused,
            ),
            Self::Busy { .. } | Self::TooManyConnections { .. } => (
                S::SERVICE_UNAVAILABLE,
                "connection_limit_reached",
                Outcome::Busy,
            ),
            Self::Internal(_) => (
                S::INTERNAL_SERVER_ERROR,
                "proxy_internal_error",
                Outcome::Internal,
            ),
            Self::Paced(p) => match p {
                PaceError::Locked { .. } => {
                    (S::FORBIDDEN, "destination_unavailable", Outcome::Locked)
                }
                PaceError::Deadline { .. } => (
                    S::SERVICE_UNAVAILABLE,
                    "destination_unavailable",
                    Outcome::Deadline,
                ),
                PaceError::TooManyKeys { .. } | PaceError::ClientKeys { .. } => (
                    S::SERVICE_UNAVAILABLE,
                    "destination_unavailable",
                    Outcome::TooManyKeys,
                ),
                PaceError::Store(_) => (
                    S::SERVICE_UNAVAILABLE,
                    "proxy_internal_error",
                    Outcome::Unavailable,
                ),
                PaceError::ShuttingDown => (
                    S::SERVICE_UNAVAILABLE,
                    "proxy_internal_response",
                    Outcome::Unavailable,
                ),
            },
            Self::Upstream(e) => match e {
                UpstreamError::Connect(c) => match c {
                    ConnectError::Forbidden { .. } | ConnectError::Own { .. } => (
                        S::FORBIDDEN,
                        "destination_ip_prohibited",
                        Outcome::ForbiddenAddress,
                    ),
                    ConnectError::Dns { .. } => {
                        (S::BAD_GATEWAY, "dns_error", Outcome::UpstreamError)
                    }
                    ConnectError::Refused { .. } => {
                        (S::BAD_GATEWAY, "connection_refused", Outcome::UpstreamError)
                    }
                    ConnectError::Timeout { .. } => (
                        S::GATEWAY_TIMEOUT,
                        "connection_timeout",
                        Outcome::UpstreamTimeout,
                    ),
                    ConnectError::NoHost => {
                        (S::BAD_REQUEST, "http_request_error", Outcome::BadRequest)
                    }
                    // The next hop refused or failed: RFC 9209 has no closer type.
                    ConnectError::Parent { .. } => (
                        S::BAD_GATEWAY,
                        "proxy_internal_error",
                        Outcome::UpstreamError,
                    ),
                },
                UpstreamError::Tls {
                    certificate: true, ..
                } => (
                    S::BAD_GATEWAY,
                    "tls_certificate_error",
                    Outcome::UpstreamError,
                ),
                UpstreamError::Tls { .. } => {
                    (S::BAD_GATEWAY, "tls_protocol_error", Outcome::UpstreamError)
                }
                UpstreamError::Timeout(_) => (
                    S::GATEWAY_TIMEOUT,
                    "http_response_timeout",
                    Outcome::UpstreamTimeout,
                ),
                UpstreamError::Protocol(_) => (
                    S::BAD_GATEWAY,
                    "http_protocol_error",
                    Outcome::UpstreamError,
                ),
                // The request waits for another slot instead; this is for a caller that
                // gave a deadline and did not.
                UpstreamError::Late(_) => (
                    S::SERVICE_UNAVAILABLE,
                    "proxy_internal_error",
                    Outcome::Unavailable,
                ),
            },
        }
    }

    /// The outcome label of this error.
    pub fn outcome(&self) -> Outcome {
        self.classify().2
    }

    /// The response as HTTP/1.1 bytes that close the connection: for a connection refused
    /// before a request is read, written to its socket rather than served by hyper.
    pub fn to_closing_bytes(&self) -> Vec<u8> {
        let resp = self.to_response();
        let body = body(&self.to_string());
        let mut out = format!("HTTP/1.1 {}\r\n", resp.status()).into_bytes();
        for (name, value) in resp.headers() {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(
            format!(
                "content-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            )
            .as_bytes(),
        );
        out.extend_from_slice(body.as_bytes());
        out
    }

    /// The response to send the client.
    pub fn to_response(&self) -> Response<ProxyBody> {
        let (status, token, _) = self.classify();
        let details = self.to_string();
        let mut resp = Response::new(
            Full::new(Bytes::from(body(&details)))
                .map_err(|never| match never {})
                .boxed(),
        );
        *resp.status_mut() = status;
        let headers = resp.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        headers.insert("proxy-status", proxy_status(token, &details));
        let retry_after = match self {
            Self::Paced(PaceError::Deadline { retry_after, .. }) => {
                Some(retry_after_secs(*retry_after))
            }
            Self::Paced(PaceError::Store(_) | PaceError::ShuttingDown)
            | Self::Busy { .. }
            | Self::TooManyConnections { .. } => Some(1),
            // A key makes room once one idles out; the sweep runs at least every minute.
            Self::Paced(
                PaceError::TooManyKeys { key_idle, .. } | PaceError::ClientKeys { key_idle, .. },
            ) => Some(retry_after_secs(
                (*key_idle).min(std::time::Duration::from_secs(60)),
            )),
            _ => None,
        };
        if let Some(secs) = retry_after {
            headers.insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if let Self::AuthRequired { realm } = self {
            let challenge = format!("Basic realm=\"{}\"", quoted_string_body(realm));
            if let Ok(v) = HeaderValue::from_str(&challenge) {
                headers.insert(PROXY_AUTHENTICATE, v);
            }
        }
        resp
    }
}

/// The text of every refusal's body.
fn body(details: &str) -> String {
    format!("pacegate: {details}\n")
}

/// `Proxy-Status: pacegate; error=TOKEN; details="..."`.
///
/// Written by hand rather than with `sfv`: its serialiser writes the canonical form without
/// the spaces after `;` (`pacegate;error=...`), equally valid but not the form documented and
/// matched on by operators since the first release; the only part to get right here is the
/// escaping of one string, which the tests below pin down.
pub fn proxy_status(token: &str, details: &str) -> HeaderValue {
    let value = format!(
        "pacegate; error={token}; details=\"{}\"",
        quoted_string_body(details)
    );
    HeaderValue::from_str(&value)
        .unwrap_or_else(|_| HeaderValue::from_static("pacegate; error=proxy_internal_error"))
}

/// Text as the body of a quoted string (a structured-field string, an HTTP quoted-string):
/// printable ASCII only, `"` and `\` escaped.
fn quoted_string_body(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('?'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_carries_proxy_status() {
        let resp = ProxyError::Unmatched {
            target: "evil.example:443".into(),
        }
        .to_response();
        assert_eq!(resp.status(), StatusCode::FORBIDDEN);
        let ps = resp.headers()["proxy-status"].to_str().unwrap();
        assert!(
            ps.starts_with("pacegate; error=http_request_denied; details=\""),
            "{ps}"
        );
        assert!(ps.contains("evil.example:443"));
    }

    #[test]
    fn details_are_escaped() {
        let v = proxy_status("x", "say \"hi\" \\ caf\u{e9}\n");
        assert_eq!(
            v.to_str().unwrap(),
            "pacegate; error=x; details=\"say \\\"hi\\\" \\\\ caf??\""
        );
    }

    #[test]
    fn auth_failure_challenges() {
        let resp = ProxyError::AuthRequired {
            realm: "pacegate".into(),
        }
        .to_response();
        assert_eq!(resp.status(), StatusCode::PROXY_AUTHENTICATION_REQUIRED);
        assert_eq!(
            resp.headers()["proxy-authenticate"],
            "Basic realm=\"pacegate\""
        );
    }
}
