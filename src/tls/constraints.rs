//! X.509 name constraints on the local CA: it may sign only for the configured destinations'
//! hosts, so that a stolen CA key cannot impersonate any other site to the clients that trust
//! it.
//!
//! A host `api.example.com` permits that name and the names below it (name constraints
//! cannot say "this name alone"); `*.example.net` permits `example.net` and the names below
//! it. An IP address permits that address alone. Without an IP address among the hosts, every
//! address is excluded, since a constraint on DNS names alone leaves addresses unconstrained.

use std::net::IpAddr;

use rcgen::{CidrSubnet, GeneralSubtree, NameConstraints};
use x509_parser::extensions::{GeneralName, NameConstraints as Parsed};

/// The name constraints that permit `names` (hosts or suffixes, without ports) and nothing
/// else.
pub(super) fn permitting(names: &[&str]) -> NameConstraints {
    let mut permitted = Vec::new();
    let mut any_ip = false;
    for name in names {
        match name.trim_matches(['[', ']']).parse::<IpAddr>() {
            Ok(ip) => {
                any_ip = true;
                let bits = if ip.is_ipv4() { 32 } else { 128 };
                permitted.push(GeneralSubtree::IpAddress(CidrSubnet::from_addr_prefix(
                    ip, bits,
                )));
            }
            Err(_) => permitted.push(GeneralSubtree::DnsName(name.to_ascii_lowercase())),
        }
    }
    permitted.dedup();
    let excluded = if any_ip {
        Vec::new()
    } else {
        vec![
            GeneralSubtree::IpAddress(CidrSubnet::from_v4_prefix([0; 4], 0)),
            GeneralSubtree::IpAddress(CidrSubnet::from_v6_prefix([0; 16], 0)),
        ]
    };
    NameConstraints {
        permitted_subtrees: permitted,
        excluded_subtrees: excluded,
    }
}

/// Whether a CA with `constraints` may sign for `host` (a name or an address).
pub(super) fn permits(constraints: &Parsed<'_>, host: &str) -> bool {
    let host = host.trim_matches(['[', ']']).to_ascii_lowercase();
    let ip = host.parse::<IpAddr>().ok();
    let matches = |general: &GeneralName<'_>| match (general, ip) {
        (GeneralName::DNSName(c), None) => dns_within(&host, c),
        (GeneralName::IPAddress(net), Some(ip)) => ip_within(ip, net),
        _ => false,
    };
    let same_kind = |general: &GeneralName<'_>| {
        matches!(
            (general, ip),
            (GeneralName::DNSName(_), None) | (GeneralName::IPAddress(_), Some(_))
        )
    };
    if let Some(excluded) = &constraints.excluded_subtrees {
        if excluded.iter().any(|s| matches(&s.base)) {
            return false;
        }
    }
    match &constraints.permitted_subtrees {
        // Permitted subtrees of this kind of name: it must be in one.
        Some(permitted) if permitted.iter().any(|s| same_kind(&s.base)) => {
            permitted.iter().any(|s| matches(&s.base))
        }
        _ => true,
    }
}

/// RFC 5280: a DNS constraint permits the name itself and every name below it; one that
/// starts with a dot only the names below it.
fn dns_within(host: &str, constraint: &str) -> bool {
    let c = constraint.to_ascii_lowercase();
    if let Some(below) = c.strip_prefix('.') {
        return host.ends_with(&format!(".{below}"));
    }
    c.is_empty() || host == c || host.ends_with(&format!(".{c}"))
}

/// An address within an encoded subnet: the address then the mask, 8 or 32 bytes.
fn ip_within(ip: IpAddr, net: &[u8]) -> bool {
    let addr = match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    if net.len() != addr.len() * 2 {
        return false;
    }
    let (base, mask) = net.split_at(addr.len());
    addr.iter()
        .zip(base)
        .zip(mask)
        .all(|((a, b), m)| a & m == b & m)
}
