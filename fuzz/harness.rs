//! What each fuzz target feeds to pacegate, shared by the libFuzzer targets
//! (`fuzz/fuzz_targets/*.rs`) and the short run in the test suite (`tests/fuzz.rs`). Each
//! function takes arbitrary bytes and must not panic; it checks what must hold of any answer.

// Each fuzz target uses one of these.
#![allow(dead_code)]

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue, Uri};
use pacegate::config::Config;
use pacegate::pacing::verdict;
use pacegate::signals::{self, Families};

/// The request target of a CONNECT and of an absolute-form request, parsed as hyper hands it
/// over (an `http::Uri`): a target is refused with a reason, or names a host and a port.
pub(crate) fn request_target(data: &[u8]) {
    let Ok(uri) = Uri::try_from(data) else {
        return;
    };
    for connect in [true, false] {
        if let Ok((_, host, port)) = pacegate::proxy::parse_target(connect, &uri) {
            assert!(!host.is_empty() && port != 0, "{uri} gave {host}:{port}");
        }
    }
}

/// Splits `data` into header values, one per name, at NUL bytes.
fn headers(names: &[&'static str], data: &[u8]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in names.iter().zip(data.split(|b| *b == 0)) {
        if let Ok(v) = HeaderValue::from_bytes(value) {
            h.append(HeaderName::from_static(name), v);
        }
    }
    h
}

/// The first eight bytes as a time within about 300 years of the epoch: "now".
fn now(data: &[u8]) -> SystemTime {
    let mut secs = [0u8; 8];
    let n = data.len().min(8);
    secs[..n].copy_from_slice(&data[..n]);
    UNIX_EPOCH + Duration::from_secs(u64::from_le_bytes(secs) % 10_000_000_000)
}

/// `Retry-After` (seconds or an HTTP date) beside a `Date`: a pause, if any, resolves to a
/// positive time within the cap.
pub(crate) fn retry_after(data: &[u8]) {
    let h = headers(&["retry-after", "date"], data);
    let cap = Duration::from_secs(7 * 24 * 3600);
    if let Some(pause) = verdict::retry_after(&h, None) {
        if let Some(left) = pause.resolve(now(data), cap) {
            assert!(
                !left.is_zero() && left <= cap,
                "{pause:?} resolved to {left:?}"
            );
        }
    }
}

/// Every rate-limit header family pacegate reads, with garbage in each.
pub(crate) fn rate_limit_headers(data: &[u8]) {
    let names = [
        "ratelimit",
        "ratelimit-policy",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "x-ratelimit-reset-after",
        "x-rate-limit-limit",
        "x-rate-limit-remaining",
        "x-rate-limit-reset",
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
        "x-shopify-shop-api-call-limit",
        "age",
        "retry-after",
        "date",
    ];
    let h = headers(&names, data);
    if let Some(signal) = signals::read(&h, Families::ALL, now(data)) {
        let _ = signal.reset_in(now(data));
    }
    for status in [200, 403, 429, 503] {
        let _ = verdict::classify(status, &h, &pacegate::destination::Pace::new(10.0));
    }
}

/// `Proxy-Authorization`, as any bytes a client may send.
pub(crate) fn proxy_authorization(data: &[u8]) {
    let mut h = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_bytes(data) {
        h.insert(http::header::PROXY_AUTHORIZATION, v);
    }
    if let Some((name, _)) = pacegate::proxy::auth::basic_credentials(&h) {
        assert!(!name.contains(&b':'), "a user name holds no colon");
    }
}

/// The config loader, on any text: a config, or problems that each name a key path.
pub(crate) fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(problems) = Config::parse(text, Path::new("/nonexistent")) {
        assert!(!problems.is_empty());
        assert!(problems.iter().all(|p| !p.path.is_empty()), "{problems:?}");
    }
}
