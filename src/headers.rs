//! Header hygiene at both of the proxy's boundaries: hop-by-hop headers never cross them, in
//! either direction (the proxy strips requests, the upstream client responses). Which of the
//! names acted on a message holds is found in one pass over its names ([`Found`]).

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Headers that describe one connection, not the message (RFC 9110 section 7.6.1), plus the
/// proxy's own credentials and challenges. A `static`: a `const` array of names would be
/// made and dropped again wherever it is used, once for every name looked at.
static HOP_BY_HOP: [HeaderName; 9] = [
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

/// `Connection`'s, `Proxy-Authorization`'s, `TE`'s and `Upgrade`'s bits in the set of
/// [`HOP_BY_HOP`] names present.
const CONNECTION_BIT: u16 = 1 << 0;
const PROXY_AUTHORIZATION_BIT: u16 = 1 << 3;
const TE_BIT: u16 = 1 << 5;
const UPGRADE_BIT: u16 = 1 << 8;
/// Bits past [`HOP_BY_HOP`]'s: the other names a request's rewrite acts on.
const CLASS_BIT: u16 = 1 << 9;
const EXPECT_BIT: u16 = 1 << 10;

/// Which of the names pacegate acts on a message holds, found in one pass over its names
/// (each lookup of a name that is not there costs a hash and a probe; most requests hold
/// none of them, most responses only `Connection`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found(u16);

impl Found {
    pub fn in_headers(headers: &HeaderMap) -> Found {
        Found(headers.keys().fold(0u16, |bits, name| bits | bit_of(name)))
    }

    /// A `Proxy-Authorization` header.
    pub fn proxy_authorization(self) -> bool {
        self.0 & PROXY_AUTHORIZATION_BIT != 0
    }

    /// A `Pacegate-Class` header.
    pub fn class(self) -> bool {
        self.0 & CLASS_BIT != 0
    }

    /// An `Expect` header.
    pub fn expect(self) -> bool {
        self.0 & EXPECT_BIT != 0
    }

    fn hop_by_hop(self) -> u16 {
        self.0 & ((1 << HOP_BY_HOP.len()) - 1)
    }
}

/// Removes every hop-by-hop header and every header that `Connection` names. A `TE: trailers`
/// request header is kept, since h2 upstreams (gRPC) rely on it and it is valid end to end.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    strip_found(headers, Found::in_headers(headers));
}

/// [`strip_hop_by_hop`], with the names `headers` holds already found.
pub fn strip_found(headers: &mut HeaderMap, found: Found) {
    let present = found.hop_by_hop();
    if present == 0 {
        // Every header that `Connection` names is removed with it: nothing to strip.
        return;
    }
    // `keep-alive` and `close`, by far the most common, name no other header: the list of
    // other names is made only when one is there.
    let mut named: Vec<HeaderName> = Vec::new();
    // `Connection` is read as it is removed: one lookup, where most messages have only it.
    if present & CONNECTION_BIT != 0 {
        if let header::Entry::Occupied(entry) = headers.entry(header::CONNECTION) {
            for value in entry.remove_entry_mult().1 {
                if names_no_header(value.as_bytes()) {
                    continue;
                }
                let listed = value
                    .to_str()
                    .into_iter()
                    .flat_map(|v| v.split(','))
                    .map(str::trim)
                    .filter(|t| !names_no_header(t.as_bytes()))
                    .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok());
                named.extend(listed);
            }
        }
    }
    let te_trailers = present & TE_BIT != 0
        && headers
            .get_all(header::TE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("trailers"));
    // `Connection` is gone already.
    let rest = present & !CONNECTION_BIT;
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if rest & (1 << i) != 0 {
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

/// The bit of a name acted on: its place in [`HOP_BY_HOP`], or past it. Matched as text,
/// where most names are ruled out by their length alone (comparing `HeaderName`s is a
/// comparison for each of a dozen names, for each name a message holds).
fn bit_of(name: &HeaderName) -> u16 {
    match name.as_str() {
        "connection" => CONNECTION_BIT,
        "keep-alive" => 1 << 1,
        "proxy-connection" => 1 << 2,
        "proxy-authorization" => PROXY_AUTHORIZATION_BIT,
        "proxy-authenticate" => 1 << 4,
        "te" => TE_BIT,
        "trailer" => 1 << 6,
        "transfer-encoding" => 1 << 7,
        "upgrade" => UPGRADE_BIT,
        // `class::CLASS_HEADER`.
        "pacegate-class" => CLASS_BIT,
        "expect" => EXPECT_BIT,
        _ => 0,
    }
}

/// Whether pacegate takes `name` off every request before it is keyed and forwarded (a
/// hop-by-hop name, the proxy's credentials, its class header, `Expect`): a key read from
/// it would be empty on every request.
pub fn taken_off(name: &HeaderName) -> bool {
    bit_of(name) != 0
}

/// `keep-alive` or `close`: a `Connection` token that is not a header's name.
fn names_no_header(token: &[u8]) -> bool {
    token.eq_ignore_ascii_case(b"keep-alive") || token.eq_ignore_ascii_case(b"close")
}

/// The protocol a request asks to upgrade to (`Connection: upgrade` plus `Upgrade: X`).
pub fn upgrade_protocol(headers: &HeaderMap, found: Found) -> Option<String> {
    if found.0 & (CONNECTION_BIT | UPGRADE_BIT) != CONNECTION_BIT | UPGRADE_BIT {
        return None;
    }
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

/// `Server-Timing` (W3C Server Timing), the field a client's developer tools show.
static SERVER_TIMING: HeaderName = HeaderName::from_static("server-timing");

/// Tells the client where a forwarded response's time went: `waited` for the slot, and
/// `upstream` from its send to the upstream's head, where known, as `Server-Timing` metrics
/// (`pacegate-wait;dur=12.5, pacegate-upstream;dur=80.1`, milliseconds) after the origin's.
/// Written into `buf`, which a response's other fields of pacegate's share (see
/// [`append_to_list`]).
pub fn add_server_timing(
    headers: &mut HeaderMap,
    buf: &mut BytesMut,
    waited: std::time::Duration,
    upstream: Option<std::time::Duration>,
) {
    use std::fmt::Write;
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
    let _ = write!(buf, "pacegate-wait;dur={:.1}", ms(waited));
    if let Some(up) = upstream {
        let _ = write!(buf, ", pacegate-upstream;dur={:.1}", ms(up));
    }
    append_to_list(headers, &SERVER_TIMING, buf.split().freeze());
}

/// Adds `items` to the list field `name`, after the items it came with, as one field: a list
/// split over several lines is the same list (RFC 9110 section 5.3), but not every client
/// reads past the first line. Where the field did not come, `items` is the value as it is,
/// not copied: the fields pacegate adds to a response are written into one buffer.
pub fn append_to_list(headers: &mut HeaderMap, name: &HeaderName, items: Bytes) {
    let mut joined: Vec<u8> = Vec::new();
    for v in headers.get_all(name).iter().filter(|v| !v.is_empty()) {
        joined.extend_from_slice(v.as_bytes());
        joined.extend_from_slice(b", ");
    }
    let value = if joined.is_empty() {
        HeaderValue::from_maybe_shared(items)
    } else {
        joined.extend_from_slice(&items);
        HeaderValue::from_bytes(&joined)
    };
    if let Ok(v) = value {
        headers.insert(name.clone(), v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::class::CLASS_HEADER;

    /// Whatever the origin sent, what pacegate adds to a response (`Server-Timing`, and the
    /// RateLimit fields through the same [`append_to_list`]) changes no other field, and
    /// keeps the origin's items of these first, as they came.
    #[test]
    fn what_pacegate_adds_leaves_the_origin_s_fields_as_they_came() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, TestRunner};
        let name = prop::sample::select(vec![
            "server-timing",
            "ratelimit",
            "ratelimit-policy",
            "retry-after",
            "content-type",
            "x-custom",
            "set-cookie",
        ]);
        let value = "[ -~]{0,40}";
        let fields = prop::collection::vec((name, value), 0..8);
        TestRunner::new(Config::with_cases(2_000))
            .run(&fields, |fields| {
                let mut h = HeaderMap::new();
                for (n, v) in &fields {
                    if let Ok(v) = HeaderValue::from_str(v) {
                        h.append(*n, v);
                    }
                }
                let before = h.clone();
                let mut buf = BytesMut::new();
                add_server_timing(&mut h, &mut buf, std::time::Duration::from_millis(3), None);
                append_to_list(
                    &mut h,
                    &HeaderName::from_static("ratelimit"),
                    Bytes::from_static(b"\"pacegate\";r=1;t=0"),
                );
                let ours = ["server-timing", "ratelimit"];
                for (n, _) in before.iter().filter(|(n, _)| !ours.contains(&n.as_str())) {
                    prop_assert_eq!(
                        before.get_all(n).iter().collect::<Vec<_>>(),
                        h.get_all(n).iter().collect::<Vec<_>>()
                    );
                }
                prop_assert_eq!(
                    before.len()
                        - ours
                            .iter()
                            .map(|n| before.get_all(*n).iter().count())
                            .sum::<usize>(),
                    h.len()
                        - ours
                            .iter()
                            .map(|n| h.get_all(*n).iter().count())
                            .sum::<usize>()
                );
                for n in ours {
                    let all: Vec<_> = h.get_all(n).iter().collect();
                    prop_assert_eq!(all.len(), 1, "one {} field", n);
                    let origin: Vec<&[u8]> = before
                        .get_all(n)
                        .iter()
                        .map(HeaderValue::as_bytes)
                        .filter(|v| !v.is_empty())
                        .collect();
                    let joined = origin.join(&b", "[..]);
                    prop_assert!(all[0].as_bytes().starts_with(&joined));
                }
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn server_timing_follows_the_origin_s_in_one_field() {
        use std::time::Duration;
        let mut h = map(&[
            ("server-timing", "db;dur=53"),
            ("server-timing", "app;dur=47.2"),
        ]);
        add_server_timing(
            &mut h,
            &mut BytesMut::new(),
            Duration::from_micros(12_345),
            Some(Duration::from_millis(80)),
        );
        let all: Vec<_> = h.get_all("server-timing").iter().collect();
        assert_eq!(
            all,
            ["db;dur=53, app;dur=47.2, pacegate-wait;dur=12.3, pacegate-upstream;dur=80.0"]
        );
        let mut h = HeaderMap::new();
        add_server_timing(&mut h, &mut BytesMut::new(), Duration::ZERO, None);
        assert_eq!(h["server-timing"], "pacegate-wait;dur=0.0");
    }

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
        let upgrade = |h: &HeaderMap| upgrade_protocol(h, Found::in_headers(h));
        assert_eq!(
            upgrade(&map(&[("connection", "Upgrade"), ("upgrade", "websocket")])).as_deref(),
            Some("websocket")
        );
        assert_eq!(upgrade(&map(&[("upgrade", "websocket")])), None);
        assert_eq!(upgrade(&map(&[("connection", "upgrade")])), None);
    }

    #[test]
    fn one_pass_finds_each_name_acted_on_and_no_other() {
        let found = |pairs: &[(&str, &str)]| Found::in_headers(&map(pairs));
        let none = found(&[("host", "a"), ("x-a", "1"), ("accept", "*/*")]);
        assert!(!none.class() && !none.expect() && none.hop_by_hop() == 0);
        let class = found(&[("Pacegate-Class", "bulk"), ("x-a", "1")]);
        assert!(class.class() && !class.expect() && class.hop_by_hop() == 0);
        let expect = found(&[("expect", "100-continue")]);
        assert!(expect.expect() && !expect.class());
        assert_eq!(bit_of(&CLASS_HEADER), CLASS_BIT);
        assert_eq!(bit_of(&header::EXPECT), EXPECT_BIT);
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            let one = found(&[("x-a", "1"), (name.as_str(), "v")]);
            assert_eq!(one.hop_by_hop(), 1 << i, "{name}");
            assert!(!one.class() && !one.expect(), "{name}");
        }
    }

    #[test]
    fn a_connection_of_keep_alive_alone_is_removed_and_nothing_else() {
        let mut h = map(&[("connection", "Keep-Alive"), ("content-length", "3")]);
        strip_hop_by_hop(&mut h);
        let names: Vec<_> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["content-length"]);
    }

    #[test]
    fn joins_repeated_cookies() {
        let mut h = map(&[("cookie", "a=1"), ("cookie", "b=2")]);
        join_cookies(&mut h);
        assert_eq!(h.get_all("cookie").iter().count(), 1);
        assert_eq!(h.get("cookie").unwrap(), "a=1; b=2");
    }
}
