//! Opening a TCP connection to an upstream: under the address policy ([`super::address`])
//! and the connect timeout, directly or through a parent proxy ([`parent`]).

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::address::{is_forbidden, AddressPolicy};
use crate::config::ParentProxy;
use crate::destination::HostPattern;

mod parent;

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

/// `ConnectError` is not `Clone` (it holds `io::Error`); rebuild it from the borrowed chain.
pub(super) fn clone_connect_error(e: &ConnectError) -> ConnectError {
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
