//! Where upstreams may be: the address policy. It is applied to the very address a socket is
//! opened to, after DNS resolution, so a name that resolves to a private address (DNS
//! rebinding included) is refused the same as a private IP literal; and pacegate's own
//! listeners are never a destination, whatever the rest allows.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::destination::HostPattern;

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

    pub(super) fn allows_private(&self, host: &str, port: u16) -> bool {
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
    pub(super) fn is_own(&self, addr: SocketAddr) -> bool {
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
}
