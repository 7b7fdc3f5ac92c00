//! The outbound side: a guarded TCP connector (address policy, connect timeout), connections
//! opened ahead for paced requests ([`Warm`]), and the pool of HTTP/1.1 and h2 connections to
//! upstreams over rustls that requests are sent on.
//!
//! The address policy is applied to the very address a socket is opened to, after DNS
//! resolution, so a name that resolves to a private address (DNS rebinding included) is refused
//! the same as a private IP literal.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri, Version};
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::config::{ParentProxy, UpstreamConfig};
use crate::destination::HostPattern;
use crate::headers::strip_hop_by_hop;

mod parent;
mod pool;
pub mod stall;
mod warm;

pub use warm::{Busy, Expecting, NoConnectionInTime, Warm};

/// Errors of bodies flowing through pacegate.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body type of requests sent upstream and responses sent to clients.
pub type ProxyBody = BoxBody<Bytes, BoxError>;

/// Why a TCP connection to an upstream could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The name did not resolve.
    #[error("cannot resolve {host}: {source}")]
    Dns {
        /// The upstream host.
        host: String,
        /// The resolver's error.
        source: std::io::Error,
    },
    /// Every resolved address is one the policy forbids.
    #[error("{host} resolves to {addr}, a loopback, private, link-local, multicast, reserved or unspecified address, which is refused unless allow_private_upstreams = true ([proxy], or the destination's)")]
    Forbidden {
        /// The upstream host.
        host: String,
        /// The first forbidden address.
        addr: IpAddr,
    },
    /// The address is one of pacegate's own listeners.
    #[error("{host} is {addr}, one of pacegate's own listeners: a request through pacegate never goes to pacegate itself")]
    Own {
        /// The upstream host.
        host: String,
        /// Its address.
        addr: SocketAddr,
    },
    /// Connecting failed (refused, unreachable, reset).
    #[error("cannot connect to {host} ({addr}): {source}")]
    Refused {
        /// The upstream host.
        host: String,
        /// The last address tried.
        addr: SocketAddr,
        /// The socket error.
        source: std::io::Error,
    },
    /// No connection within the connect timeout.
    #[error("no connection to {host} within {}", humantime::format_duration(*after))]
    Timeout {
        /// The upstream host.
        host: String,
        /// The configured timeout.
        after: Duration,
    },
    /// The URI handed to the connector has no host.
    #[error("upstream URI has no host")]
    NoHost,
    /// The parent proxy refused or failed the tunnel.
    #[error("parent proxy {parent} could not open a tunnel to {target}: {reason}")]
    Parent {
        /// The parent, without its password.
        parent: String,
        /// The destination asked for.
        target: String,
        /// What went wrong.
        reason: String,
    },
}

/// Whether an address is loopback, private, shared (CGNAT), link-local, multicast, broadcast,
/// unspecified, reserved or otherwise not a public unicast destination. An IPv6 address that
/// carries an IPv4 one (mapped, compatible, NAT64, 6to4, Teredo) is judged by the IPv4 rules
/// as well, since a gateway on the path delivers it there.
pub fn is_forbidden(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_forbidden_v4(v4),
        IpAddr::V6(v6) => {
            let s = v6.segments();
            let first = s[0];
            let own = v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                // Site-local (deprecated, still routed by some), and the discard prefix.
                || (first & 0xffc0) == 0xfec0
                || s[..4] == [0x100, 0, 0, 0]
                // NAT64 for local use (RFC 8215): whatever it embeds is a local network's.
                || s[..3] == [0x64, 0xff9b, 1];
            own || embedded_v4(v6).iter().any(|v4| is_forbidden_v4(*v4))
        }
    }
}

fn is_forbidden_v4(v4: Ipv4Addr) -> bool {
    let o = v4.octets();
    v4.is_loopback()
        || v4.is_private()
        || v4.is_link_local()
        || v4.is_multicast()
        || v4.is_unspecified()
        || v4.is_broadcast()
        || o[0] == 0
        // Shared address space (CGNAT), 100.64.0.0/10.
        || (o[0] == 100 && (o[1] & 0xc0) == 64)
        // IETF protocol assignments, 192.0.0.0/24.
        || (o[0] == 192 && o[1] == 0 && o[2] == 0)
        // Benchmarking, 198.18.0.0/15.
        || (o[0] == 198 && (o[1] & 0xfe) == 18)
        // Reserved for future use, 240.0.0.0/4.
        || o[0] >= 240
}

/// The IPv4 addresses an IPv6 address carries: IPv4-mapped (`::ffff:a.b.c.d`), IPv4-compatible
/// (`::a.b.c.d`), NAT64 (`64:ff9b::/96`), 6to4 (`2002::/16`) and Teredo (`2001::/32`: its
/// server, and its client, stored inverted).
fn embedded_v4(v6: Ipv6Addr) -> Vec<Ipv4Addr> {
    let s = v6.segments();
    let v4 = |hi: u16, lo: u16| Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
    if let Some(v4) = v6.to_ipv4_mapped() {
        return vec![v4];
    }
    if s[..6] == [0; 6] {
        return vec![v4(s[6], s[7])];
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return vec![v4(s[6], s[7])];
    }
    if s[0] == 0x2002 {
        return vec![v4(s[1], s[2])];
    }
    if s[..2] == [0x2001, 0] {
        return vec![v4(s[2], s[3]), v4(!s[6], !s[7])];
    }
    Vec::new()
}

/// Where upstreams may be: which hosts may resolve to private or loopback addresses, and
/// the addresses nothing may reach (pacegate's own listeners).
#[derive(Debug, Clone, Default)]
pub struct AddressPolicy {
    /// `[proxy] allow_private_upstreams`.
    pub allow_private: bool,
    /// Destinations' own `allow_private_upstreams`: their host patterns and what they say.
    pub hosts: Vec<(HostPattern, bool)>,
    /// pacegate's own listeners: never a destination, whatever the rest allows.
    pub own: Vec<SocketAddr>,
}

impl AddressPolicy {
    /// The policy a config gives, with pacegate's own listeners at `own`.
    pub fn of(config: &crate::config::Config, own: Vec<SocketAddr>) -> Self {
        Self {
            allow_private: config.proxy.allow_private_upstreams,
            hosts: Self::hosts_of(&config.destinations),
            own,
        }
    }

    /// The destinations' own `allow_private_upstreams`, by host pattern.
    pub fn hosts_of(destinations: &[crate::destination::Destination]) -> Vec<(HostPattern, bool)> {
        destinations
            .iter()
            .filter_map(|d| d.allow_private_upstreams.map(|allow| (d, allow)))
            .flat_map(|(d, allow)| d.hosts.iter().map(move |h| (h.clone(), allow)))
            .collect()
    }

    fn allows_private(&self, host: &str, port: u16) -> bool {
        self.hosts
            .iter()
            .find(|(p, _)| p.matches(host, port))
            .map_or(self.allow_private, |(_, allow)| *allow)
    }

    /// Whether `addr` is one of pacegate's own listeners: the same port on the same address
    /// (mapped or not), or on any loopback one when the listener is on the unspecified
    /// address, or on the unspecified address (`0.0.0.0`, `::`, mapped or not), which a
    /// connect on Linux takes to mean this host, whatever address the listener is on. A
    /// listener on 127.0.0.1 is not reached through 127.0.0.2: an upstream may listen there
    /// on the same port.
    fn is_own(&self, addr: SocketAddr) -> bool {
        let ip = addr.ip().to_canonical();
        self.own.iter().any(|own| {
            let mine = own.ip().to_canonical();
            own.port() == addr.port()
                && (mine == ip
                    || ip.is_unspecified()
                    || (mine.is_unspecified() && ip.is_loopback()))
        })
    }
}

/// Opens TCP connections to upstreams under the address policy and connect timeout.
#[derive(Debug, Clone)]
pub struct Connector {
    policy: Arc<arc_swap::ArcSwap<AddressPolicy>>,
    timeout: Duration,
    /// The parent proxy, and the hosts reached without it.
    parent: Option<Arc<(ParentProxy, Vec<HostPattern>)>>,
}

impl Connector {
    /// A connector; `allow_private` lifts the address policy.
    pub fn new(allow_private: bool, timeout: Duration) -> Self {
        Self::with_policy(
            AddressPolicy {
                allow_private,
                ..AddressPolicy::default()
            },
            timeout,
        )
    }

    /// A connector under `policy`.
    pub fn with_policy(policy: AddressPolicy, timeout: Duration) -> Self {
        Self {
            policy: Arc::new(arc_swap::ArcSwap::from_pointee(policy)),
            timeout,
            parent: None,
        }
    }

    /// Takes the destinations' own `allow_private_upstreams` anew (a reload's): connections
    /// opened from now on follow them.
    pub fn set_hosts(&self, hosts: Vec<(HostPattern, bool)>) {
        let current = self.policy.load();
        self.policy.store(Arc::new(AddressPolicy {
            hosts,
            ..AddressPolicy::clone(&current)
        }));
    }

    /// The same connector, going through `parent` to every host but the `direct` ones.
    pub fn through(mut self, parent: ParentProxy, direct: Vec<HostPattern>) -> Self {
        self.parent = Some(Arc::new((parent, direct)));
        self
    }

    /// Connects to `host:port` (through the parent proxy, if one is set and `host` is not
    /// one of its exceptions) within the connect timeout. The address policy applies to the
    /// final destination either way.
    pub async fn connect(&self, host: &str, port: u16) -> Result<TcpStream, ConnectError> {
        let timed_out = || ConnectError::Timeout {
            host: host.to_owned(),
            after: self.timeout,
        };
        let parent = self
            .parent
            .as_deref()
            .filter(|(_, direct)| !direct.iter().any(|p| p.matches(host, port)));
        let connected = async {
            match parent {
                Some((parent, _)) => {
                    self.check_policy(host, port).await?;
                    parent::tunnel(parent, host, port).await
                }
                None => self.connect_inner(host, port).await,
            }
        };
        tokio::time::timeout(self.timeout, connected)
            .await
            .unwrap_or_else(|_| Err(timed_out()))
    }

    /// Refuses a destination the parent proxy would reach on an address the policy forbids:
    /// an address literal, or a name that resolves here to one. A name that does not resolve
    /// here is the parent's to resolve.
    async fn check_policy(&self, host: &str, port: u16) -> Result<(), ConnectError> {
        if self.policy.load().allows_private(host, port) {
            return Ok(());
        }
        let forbidden = match host.parse::<IpAddr>() {
            Ok(ip) => is_forbidden(ip).then_some(ip),
            Err(_) => tokio::net::lookup_host((host, port))
                .await
                .ok()
                .and_then(|mut addrs| addrs.find(|a| is_forbidden(a.ip())))
                .map(|a| a.ip()),
        };
        match forbidden {
            Some(addr) => Err(ConnectError::Forbidden {
                host: host.to_owned(),
                addr,
            }),
            None => Ok(()),
        }
    }

    async fn connect_inner(&self, host: &str, port: u16) -> Result<TcpStream, ConnectError> {
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
            .await
            .map_err(|source| ConnectError::Dns {
                host: host.to_owned(),
                source,
            })?
            .collect();
        let mut last = None;
        let mut forbidden = None;
        let policy = self.policy.load();
        let allow_private = policy.allows_private(host, port);
        for addr in addrs {
            if policy.is_own(addr) {
                return Err(ConnectError::Own {
                    host: host.to_owned(),
                    addr,
                });
            }
            if !allow_private && is_forbidden(addr.ip()) {
                forbidden.get_or_insert(addr.ip());
                continue;
            }
            match TcpStream::connect(addr).await {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    return Ok(stream);
                }
                Err(source) => last = Some((addr, source)),
            }
        }
        Err(match (last, forbidden) {
            (Some((addr, source)), _) => ConnectError::Refused {
                host: host.to_owned(),
                addr,
                source,
            },
            (None, Some(addr)) => ConnectError::Forbidden {
                host: host.to_owned(),
                addr,
            },
            (None, None) => ConnectError::Dns {
                host: host.to_owned(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no address"),
            },
        })
    }
}

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<TcpStream>;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let host = uri.host().ok_or(ConnectError::NoHost)?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let https = uri.scheme() == Some(&http::uri::Scheme::HTTPS);
            let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
            this.connect(host, port).await.map(TokioIo::new)
        })
    }
}

/// Why an upstream exchange failed, classified for the client's answer.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The TCP connection could not be opened.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The TLS handshake with the upstream failed.
    #[error("TLS with upstream failed: {reason}")]
    Tls {
        /// rustls' description.
        reason: String,
        /// Whether the upstream's certificate was the problem (untrusted, wrong name, expired).
        certificate: bool,
    },
    /// No response head within the response timeout.
    #[error("no response from upstream within {}", humantime::format_duration(*.0))]
    Timeout(Duration),
    /// The connection broke or the upstream spoke invalid HTTP.
    #[error("upstream exchange failed: {0}")]
    Protocol(String),
    /// A paced request had no connection by the latest instant its slot allows; nothing was
    /// sent. It waits for another slot ([`NoConnectionInTime`]).
    #[error(transparent)]
    Late(#[from] NoConnectionInTime),
}

/// The outbound HTTP client: the pool, and what opens its connections.
#[derive(Clone)]
pub struct Upstream {
    pool: pool::Pool,
    warm: Warm,
    connector: Connector,
    response_timeout: Duration,
    /// `[proxy.limits] body_timeout` on response bodies, once set.
    stall: Option<stall::Stall>,
}

impl Upstream {
    /// Builds the client. `tls` must carry no ALPN; the connector offers h2 and HTTP/1.1.
    pub fn new(cfg: &UpstreamConfig, policy: AddressPolicy, tls: rustls::ClientConfig) -> Self {
        let mut connector = Connector::with_policy(policy, cfg.connect_timeout);
        if let Some(parent) = &cfg.proxy {
            connector = connector.through(parent.clone(), cfg.no_proxy.clone());
        }
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(connector.clone());
        let warm = Warm::new(https, cfg.pool_idle_timeout, cfg.connect_timeout);
        Self {
            pool: pool::Pool::new(cfg.pool_idle_timeout, cfg.pool_max_idle_per_host),
            warm,
            connector,
            response_timeout: cfg.response_timeout,
            stall: None,
        }
    }

    /// Cuts a response body that keeps its reader waiting as `stall` says.
    pub fn with_stall(mut self, stall: stall::Stall) -> Self {
        self.stall = Some(stall);
        self
    }

    /// A response body as the client side serves it, boxed once: cut as the stall bound
    /// says, where one is set.
    pub fn body<B>(&self, body: B) -> ProxyBody
    where
        B: http_body::Body<Data = Bytes> + Unpin + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        match &self.stall {
            Some(stall) => stall.bound(body),
            None => body.map_err(Into::into).boxed(),
        }
    }

    /// Waits while a connection to `uri`'s upstream is being opened and none is ready; see
    /// [`Warm::opened`].
    pub async fn opened(&self, uri: &Uri) -> Result<(), UpstreamError> {
        self.warm
            .opened(uri)
            .await
            .map_err(|e| classify_chain(&**e))
    }

    /// Waits while `uri`'s upstream has no connection and its first is being opened; see
    /// [`Warm::first`].
    pub async fn first_connection(&self, uri: &Uri) -> Result<(), UpstreamError> {
        self.warm.first(uri).await.map_err(|e| classify_chain(&**e))
    }

    /// The guarded connector, for blind tunnels.
    pub fn connector(&self) -> &Connector {
        &self.connector
    }

    /// A request to `uri` starts waiting for its slot: a connection is opened ahead for it
    /// if those open do not cover it (see [`Warm`]). Hand the guard to [`Upstream::send`].
    pub fn expect(&self, uri: &Uri) -> Expecting<'_> {
        self.warm.expect(uri)
    }

    /// Sends a request (absolute URI, HTTP/1.1 version) and waits for the response head. A
    /// paced request gives `by`, the latest instant its slot allows: without a connection by
    /// then, nothing is sent ([`UpstreamError::Late`]). The response comes back as the client
    /// is to see it: hop-by-hop headers removed, HTTP/1.1 (the client side's version).
    /// `expected` is the guard of a request that waited for its slot ([`Upstream::expect`]):
    /// it now counts as sent. The body comes as it arrives, not boxed: the caller boxes it
    /// once, with what it holds until the body ends ([`boxed`]).
    // Not an `async fn`: the request is handed to the pool before the future is made, so the
    // future holds the pool's (boxed) exchange and the guard, not the request and the guard it
    // was given beside them (about 600 bytes of a request's future, which is moved whole into
    // its connection's slot).
    pub fn send<'a>(
        &'a self,
        req: Request<ProxyBody>,
        by: Option<tokio::time::Instant>,
        expected: Option<Expecting<'a>>,
    ) -> impl Future<Output = Result<Response<Incoming>, UpstreamError>> + Send + 'a {
        let busy = match expected {
            Some(expecting) => expecting.sending(),
            None => self.warm.sending(req.uri()),
        };
        let key = busy.key().cloned();
        let exchange = Box::pin(self.pool.send(&self.warm, key, req, by));
        async move {
            let _busy = busy;
            match tokio::time::timeout(self.response_timeout, exchange).await {
                Err(_) => Err(UpstreamError::Timeout(self.response_timeout)),
                // pacegate never asks for an upgrade, and an interim answer is no answer: a
                // 1xx relayed as final leaves an HTTP/1.1 client a bare head on a dead
                // connection, and breaks an h2 client's whole connection.
                Ok(Ok(resp)) if resp.status().is_informational() => {
                    Err(UpstreamError::Protocol(format!(
                        "the upstream answered {} as a final response, which pacegate never asks for",
                        resp.status()
                    )))
                }
                Ok(Ok(mut resp)) => {
                    strip_hop_by_hop(resp.headers_mut());
                    *resp.version_mut() = Version::HTTP_11;
                    Ok(resp)
                }
                Ok(Err(e)) => Err(classify_chain(&*e)),
            }
        }
    }
}

/// An upstream response's body as the client side serves a body.
pub fn boxed(body: Incoming) -> ProxyBody {
    body.map_err(BoxError::from).boxed()
}

/// The most specific cause in `err`'s source chain.
fn classify_chain(err: &(dyn std::error::Error + 'static)) -> UpstreamError {
    let mut source = Some(err);
    let mut deepest = err.to_string();
    while let Some(e) = source {
        if let Some(c) = e.downcast_ref::<ConnectError>() {
            return UpstreamError::Connect(clone_connect_error(c));
        }
        if e.is::<NoConnectionInTime>() {
            return UpstreamError::Late(NoConnectionInTime);
        }
        // `io::Error::source` skips the error it wraps, so look inside explicitly.
        let inner = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|inner| inner as &(dyn std::error::Error + 'static));
        if let Some(t) = inner.unwrap_or(e).downcast_ref::<rustls::Error>() {
            return UpstreamError::Tls {
                reason: t.to_string(),
                certificate: matches!(t, rustls::Error::InvalidCertificate(_)),
            };
        }
        deepest = e.to_string();
        source = e.source();
    }
    UpstreamError::Protocol(deepest)
}

/// `ConnectError` is not `Clone` (it holds `io::Error`); rebuild it from the borrowed chain.
fn clone_connect_error(e: &ConnectError) -> ConnectError {
    let io = |s: &std::io::Error| std::io::Error::new(s.kind(), s.to_string());
    match e {
        ConnectError::Dns { host, source } => ConnectError::Dns {
            host: host.clone(),
            source: io(source),
        },
        ConnectError::Forbidden { host, addr } => ConnectError::Forbidden {
            host: host.clone(),
            addr: *addr,
        },
        ConnectError::Own { host, addr } => ConnectError::Own {
            host: host.clone(),
            addr: *addr,
        },
        ConnectError::Refused { host, addr, source } => ConnectError::Refused {
            host: host.clone(),
            addr: *addr,
            source: io(source),
        },
        ConnectError::Timeout { host, after } => ConnectError::Timeout {
            host: host.clone(),
            after: *after,
        },
        ConnectError::NoHost => ConnectError::NoHost,
        ConnectError::Parent {
            parent,
            target,
            reason,
        } => ConnectError::Parent {
            parent: parent.clone(),
            target: target.clone(),
            reason: reason.clone(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_listeners_are_the_addresses_that_reach_them_and_no_other() {
        let own = |at: &str| AddressPolicy {
            own: vec![at.parse().unwrap()],
            ..AddressPolicy::default()
        };
        let loopback = own("127.0.0.1:4000");
        for reaching in [
            "127.0.0.1:4000",
            "[::ffff:127.0.0.1]:4000",
            "0.0.0.0:4000",
            "[::]:4000",
        ] {
            assert!(loopback.is_own(reaching.parse().unwrap()), "{reaching}");
        }
        // Another loopback address, or another port, is another socket: an upstream's.
        for elsewhere in ["127.0.0.2:4000", "[::1]:4000", "127.0.0.1:4001"] {
            assert!(!loopback.is_own(elsewhere.parse().unwrap()), "{elsewhere}");
        }
        // A listener on every address is reached through any loopback one.
        let everywhere = own("0.0.0.0:4000");
        for reaching in ["127.0.0.2:4000", "[::1]:4000", "0.0.0.0:4000"] {
            assert!(everywhere.is_own(reaching.parse().unwrap()), "{reaching}");
        }
    }

    #[test]
    fn private_and_special_addresses_are_forbidden() {
        for a in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fe80::1",
            "fd00::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            // IPv4-compatible, NAT64, 6to4, Teredo (client 127.0.0.1, inverted; then server).
            "::127.0.0.1",
            "::10.1.2.3",
            "64:ff9b::127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b:1::808:808",
            "2002:7f00:1::",
            "2002:c0a8:101::1",
            "2001:0:4136:e378:8000:63bf:80ff:fffe",
            "2001:0:a00:1::808:808",
            "fec0::1",
            "100::1",
            // Reserved IPv4 ranges.
            "100.64.0.1",
            "100.127.255.254",
            "192.0.0.8",
            "198.18.0.1",
            "198.19.255.255",
            "240.0.0.1",
            "250.1.2.3",
        ] {
            assert!(is_forbidden(a.parse().unwrap()), "{a} should be forbidden");
        }
        for a in [
            "203.0.113.9",
            "8.8.8.8",
            "2001:db8::1",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:808:808::1",
            "2001:0:4136:e378:8000:63bf:f7f7:f7f7",
            "100.128.0.1",
            "198.20.0.1",
            "223.255.255.1",
            "2606:4700::1111",
        ] {
            assert!(!is_forbidden(a.parse().unwrap()), "{a} should be allowed");
        }
    }

    #[tokio::test]
    async fn connector_refuses_loopback_by_default() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let strict = Connector::new(false, Duration::from_secs(5));
        let err = strict.connect("localhost", port).await.unwrap_err();
        assert!(matches!(err, ConnectError::Forbidden { .. }), "{err}");
        let lax = Connector::new(true, Duration::from_secs(5));
        lax.connect("127.0.0.1", port).await.unwrap();
    }
}
