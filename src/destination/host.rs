//! A host as a request or a pattern writes it: normalised (lower case, no trailing dot, IPv6
//! without brackets) and checked, and `host:port` split.

use std::net::IpAddr;

/// Lower-cases a host, strips one trailing dot and IPv6 brackets, and checks that it is an IP
/// literal or a syntactically valid DNS name. `None` when it is neither.
pub fn normalise_host(host: &str) -> Option<String> {
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    // A name starts with a letter (or `_`): only what could be an address is parsed as one
    // (an IPv6 address may start with a letter too, and has colons).
    if host
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
    {
        if let Some(name) = dns_name(host) {
            return Some(name);
        }
        if !host.contains(':') {
            return None;
        }
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Some(ip.to_string());
    }
    dns_name(host)
}

/// A syntactically valid DNS name, lower-cased, one trailing dot stripped: labels of 1 to 63
/// letters, digits, `-` and `_`, none starting or ending with `-`; 253 bytes at most. Checked
/// in one pass over the bytes, since every request's host is.
fn dns_name(host: &str) -> Option<String> {
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.is_empty() || host.len() > 253 {
        return None;
    }
    let (mut label, mut last) = (0usize, b'.');
    for b in host.bytes() {
        match b {
            b'.' if label == 0 || last == b'-' => return None,
            b'.' => label = 0,
            b'-' if label == 0 => return None,
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' if label < 63 => label += 1,
            _ => return None,
        }
        last = b;
    }
    (label > 0 && last != b'-').then(|| host.to_ascii_lowercase())
}

/// Splits `host:port`, `[v6]:port`, `[v6]` or `host`. The port is returned unparsed.
pub fn split_host_port(text: &str) -> Option<(&str, Option<&str>)> {
    if let Some(rest) = text.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        return match after {
            "" => Some((v6, None)),
            _ => Some((v6, Some(after.strip_prefix(':')?))),
        };
    }
    match text.rsplit_once(':') {
        // A bare IPv6 literal has several colons and no port.
        Some((h, _)) if h.contains(':') => Some((text, None)),
        Some((h, p)) => Some((h, Some(p))),
        None => Some((text, None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_an_address_or_a_name_normalised() {
        let long_label = "a".repeat(63);
        let b = "b".repeat(63);
        let name_253 = format!("{}.{b}.{b}.{b}", "a".repeat(63));
        assert_eq!(name_253.len(), 255);
        for (host, normal) in [
            ("Example.COM", Some("example.com")),
            ("example.com.", Some("example.com")),
            ("_dmarc.x-y.example", Some("_dmarc.x-y.example")),
            ("1password.com", Some("1password.com")),
            ("127.0.0.1", Some("127.0.0.1")),
            ("[::1]", Some("::1")),
            ("FE80::1", Some("fe80::1")),
            ("abcd::0:1", Some("abcd::1")),
            ("localhost", Some("localhost")),
            (&long_label, Some(&*long_label)),
            (&format!("{long_label}a"), None),
            (&name_253[2..], Some(&name_253[2..])),
            (&name_253[1..], None),
            ("", None),
            (".", None),
            ("a..b", None),
            ("a.", Some("a")),
            ("a..", None),
            ("-a.com", None),
            ("a-.com", None),
            ("a.-b", None),
            ("exa mple.com", None),
            ("abc:def", None),
            ("h\u{e9}te", None),
            ("1.2.3.4.5", Some("1.2.3.4.5")),
        ] {
            assert_eq!(normalise_host(host).as_deref(), normal, "{host}");
        }
    }
}
