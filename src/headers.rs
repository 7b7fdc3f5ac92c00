//! Header hygiene at both of the proxy's boundaries: hop-by-hop headers never cross them, in
//! either direction (the proxy strips requests, the upstream client responses).

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Headers that describe one connection, not the message (RFC 9110 section 7.6.1), plus the
/// proxy's own credentials and challenges.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    header::TE, // TE_BIT
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// `TE`'s bit in the set of [`HOP_BY_HOP`] names present.
const TE_BIT: u16 = 1 << 5;

/// Removes every hop-by-hop header and every header that `Connection` names. A `TE: trailers`
/// request header is kept, since h2 upstreams (gRPC) rely on it and it is valid end to end.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names finds which of these are there (bit i for `HOP_BY_HOP[i]`):
    // none for most requests, only `Connection` for most responses. Only those are removed.
    let present = headers.keys().fold(0u16, |bits, name| {
        bits | HOP_BY_HOP
            .iter()
            .position(|h| h == name)
            .map_or(0, |i| 1 << i)
    });
    if present == 0 {
        // Every header that `Connection` names is removed with it: nothing to strip.
        return;
    }
    // `keep-alive` and `close`, by far the most common, name no other header.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !t.eq_ignore_ascii_case("keep-alive") && !t.eq_ignore_ascii_case("close"))
        .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
        .collect();
    let te_trailers = present & TE_BIT != 0
        && headers
            .get_all(header::TE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("trailers"));
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(name);
        }
    }
    for name in &named {
        headers.remove(name);
    }
    if te_trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
}

/// The protocol a request asks to upgrade to (`Connection: upgrade` plus `Upgrade: X`).
pub fn upgrade_protocol(headers: &HeaderMap) -> Option<String> {
    let asks = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    let proto = headers.get(header::UPGRADE)?;
    asks.then(|| String::from_utf8_lossy(proto.as_bytes()).into_owned())
}

/// Joins repeated `Cookie` headers (legal in h2) into one, as HTTP/1.1 requires.
pub fn join_cookies(headers: &mut HeaderMap) {
    if headers.get_all(header::COOKIE).iter().nth(1).is_none() {
        return;
    }
    let joined: Vec<u8> = headers
        .get_all(header::COOKIE)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect::<Vec<_>>()
        .join(&b"; "[..]);
    if let Ok(v) = HeaderValue::from_bytes(&joined) {
        headers.insert(header::COOKIE, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn removes_hop_by_hop_and_connection_listed_headers() {
        let mut h = map(&[
            ("connection", "keep-alive, x-secret"),
            ("keep-alive", "timeout=5"),
            ("x-secret", "1"),
            ("proxy-authorization", "Basic abc"),
            ("proxy-connection", "keep-alive"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("te", "gzip"),
            ("x-kept", "yes"),
            ("content-type", "text/plain"),
        ]);
        strip_hop_by_hop(&mut h);
        // The order of differently named fields carries no meaning (RFC 9110 section 5.3).
        let mut names: Vec<_> = h.keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["content-type", "x-kept"]);
    }

    #[test]
    fn a_message_without_hop_by_hop_headers_is_left_as_it_is() {
        let mut h = map(&[("x-a", "1"), ("x-b", "2"), ("x-a", "3")]);
        let before = h.clone();
        strip_hop_by_hop(&mut h);
        assert_eq!(h, before);
    }

    #[test]
    fn keeps_te_trailers() {
        let mut h = map(&[("te", "trailers, deflate")]);
        strip_hop_by_hop(&mut h);
        assert_eq!(h.get("te").unwrap(), "trailers");
    }

    #[test]
    fn detects_upgrade_requests() {
        assert_eq!(
            upgrade_protocol(&map(&[("connection", "Upgrade"), ("upgrade", "websocket")]))
                .as_deref(),
            Some("websocket")
        );
        assert_eq!(upgrade_protocol(&map(&[("upgrade", "websocket")])), None);
    }

    #[test]
    fn joins_repeated_cookies() {
        let mut h = map(&[("cookie", "a=1"), ("cookie", "b=2")]);
        join_cookies(&mut h);
        assert_eq!(h.get_all("cookie").iter().count(), 1);
        assert_eq!(h.get("cookie").unwrap(), "a=1; b=2");
    }
}
