//! Each family from its vendor's documented examples, then garbage.

use super::*;
use http::HeaderValue;
use proptest::prelude::*;

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

fn unix(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
}

fn secs(s: f64) -> Option<Reset> {
    Some(Reset::In(Duration::from_secs_f64(s)))
}

#[test]
fn github_primary_limit() {
    // docs.github.com, "Rate limits for the REST API".
    let h = headers(&[
        ("x-ratelimit-limit", "5000"),
        ("x-ratelimit-remaining", "4999"),
        ("x-ratelimit-used", "1"),
        ("x-ratelimit-reset", "1691591363"),
        ("x-ratelimit-resource", "core"),
    ]);
    let s = read(&h, Families::ALL, unix(1_691_590_000)).unwrap();
    assert_eq!(
        s,
        Signal {
            family: Family::XRateLimit,
            remaining: 4999,
            limit: Some(5000),
            reset: Some(Reset::At(unix(1_691_591_363))),
        }
    );
    assert_eq!(
        s.reset_in(unix(1_691_590_000)),
        Some(Duration::from_secs(1363))
    );
    assert!(!s.exhausted());
}

#[test]
fn x_twitter_uses_the_hyphenated_names() {
    let h = headers(&[
        ("x-rate-limit-limit", "900"),
        ("x-rate-limit-remaining", "0"),
        ("x-rate-limit-reset", "1705420717"),
    ]);
    let s = read(&h, Families::ALL, unix(1_705_420_000)).unwrap();
    assert_eq!(s.family, Family::XRateLimitHyphen);
    assert!(s.exhausted());
    assert_eq!(s.reset, Some(Reset::At(unix(1_705_420_717))));
}

#[test]
fn reddit_counts_in_floats_and_resets_in_seconds_left() {
    let h = headers(&[
        ("x-ratelimit-used", "2"),
        ("x-ratelimit-remaining", "598.0"),
        ("x-ratelimit-reset", "540"),
    ]);
    let s = read(&h, Families::ALL, SystemTime::now()).unwrap();
    assert_eq!((s.remaining, s.limit, s.reset), (598, None, secs(540.0)));
}

#[test]
fn discord_reset_after_is_fractional_and_wins_over_the_timestamp() {
    // discord.com/developers/docs/topics/rate-limits
    let h = headers(&[
        ("x-ratelimit-limit", "5"),
        ("x-ratelimit-remaining", "0"),
        ("x-ratelimit-reset", "1470173023.123"),
        ("x-ratelimit-reset-after", "64.57"),
        ("x-ratelimit-bucket", "abcd1234"),
    ]);
    let s = read(&h, Families::ALL, SystemTime::now()).unwrap();
    assert_eq!((s.remaining, s.limit, s.reset), (0, Some(5), secs(64.57)));
}

#[test]
fn openai_reads_the_requests_family_and_go_durations() {
    // platform.openai.com, "Rate limits": the tokens family limits another resource.
    let h = headers(&[
        ("x-ratelimit-limit-requests", "60"),
        ("x-ratelimit-limit-tokens", "150000"),
        ("x-ratelimit-remaining-requests", "59"),
        ("x-ratelimit-remaining-tokens", "149984"),
        ("x-ratelimit-reset-requests", "1s"),
        ("x-ratelimit-reset-tokens", "6m0s"),
    ]);
    let s = read(&h, Families::ALL, SystemTime::now()).unwrap();
    assert_eq!(
        (s.family, s.remaining, s.limit, s.reset),
        (Family::Requests, 59, Some(60), secs(1.0))
    );
    for (text, want) in [
        ("6m0s", 360.0),
        ("12ms", 0.012),
        ("1h2m3.5s", 3723.5),
        ("17", 17.0),
        ("250us", 0.00025),
    ] {
        assert_eq!(
            go_duration(text),
            Some(Duration::from_secs_f64(want)),
            "{text}"
        );
    }
    for bad in ["", "s", "6x", "1.2.3s", "m5", "-1s", "5 s"] {
        assert_eq!(go_duration(bad), None, "{bad:?}");
    }
}

#[test]
fn shopify_bucket_room_is_limit_less_used() {
    let h = headers(&[("x-shopify-shop-api-call-limit", "32/40")]);
    let s = read(&h, Families::ALL, SystemTime::now()).unwrap();
    assert_eq!(
        (s.family, s.remaining, s.limit, s.reset),
        (Family::Shopify, 8, Some(40), secs(1.0))
    );
    let full = headers(&[("x-shopify-shop-api-call-limit", "40/40")]);
    assert!(read(&full, Families::ALL, SystemTime::now())
        .unwrap()
        .exhausted());
}

#[test]
fn ietf_fields_pair_each_limit_with_its_policy() {
    // draft-ietf-httpapi-ratelimit-headers.
    let h = headers(&[
        ("ratelimit-policy", "\"hour\";q=5000;w=3600"),
        ("ratelimit", "\"hour\";r=42;t=1800"),
    ]);
    let s = read(&h, Families::ALL, SystemTime::now()).unwrap();
    assert_eq!(
        (s.family, s.remaining, s.limit, s.reset),
        (Family::Ietf, 42, Some(5000), secs(1800.0))
    );
}

#[test]
fn ietf_keeps_the_strictest_policy_and_skips_other_units() {
    let h = headers(&[
        (
            "ratelimit-policy",
            "\"permin\";q=50;w=60, \"perday\";q=1000;w=86400, \"bytes\";q=9;w=1;qu=\"content-bytes\"",
        ),
        ("ratelimit", "\"permin\";r=12;t=30, \"perday\";r=900;t=80000, \"bytes\";r=0;t=1"),
    ]);
    let s = read(&h, Families::ALL, SystemTime::now()).unwrap();
    // 12 in 30 s is 2.5 s a request; 900 in 80,000 s is 89 s a request: the day is stricter.
    // The byte quota is spent, but it counts bytes, not requests.
    assert_eq!(
        (s.remaining, s.limit, s.reset),
        (900, Some(1000), secs(80000.0))
    );
}

#[test]
fn ietf_fields_on_a_cached_response_are_ignored() {
    let h = headers(&[("ratelimit", "\"default\";r=0;t=30"), ("age", "12")]);
    assert_eq!(read(&h, Families::ALL, SystemTime::now()), None);
    let fresh = headers(&[("ratelimit", "\"default\";r=0;t=30"), ("age", "0")]);
    assert!(read(&fresh, Families::ALL, SystemTime::now()).is_some());
}

#[test]
fn a_spent_budget_is_the_strictest_signal() {
    let h = headers(&[
        ("ratelimit", "\"default\";r=1;t=3600"),
        ("x-ratelimit-remaining", "0"),
        ("x-ratelimit-reset", "2"),
    ]);
    let s = read(&h, Families::ALL, SystemTime::now()).unwrap();
    assert_eq!((s.family, s.remaining), (Family::XRateLimit, 0));
}

#[test]
fn only_the_configured_families_are_read() {
    let h = headers(&[
        ("ratelimit", "\"default\";r=5;t=10"),
        ("x-ratelimit-remaining", "0"),
    ]);
    let ietf = Families::of(&[Family::Ietf]);
    assert_eq!(
        read(&h, ietf, SystemTime::now()).unwrap().family,
        Family::Ietf
    );
    assert_eq!(read(&h, Families::NONE, SystemTime::now()), None);
    assert_eq!(
        Family::from_name("x-rate-limit"),
        Some(Family::XRateLimitHyphen)
    );
    assert_eq!(Family::from_name("github"), None);
}

#[test]
fn a_bare_reset_number_is_unix_time_only_above_a_billion() {
    assert_eq!(bare_reset("1000000000"), secs(1e9));
    assert_eq!(
        bare_reset("1000000001"),
        Some(Reset::At(unix(1_000_000_001)))
    );
    assert_eq!(bare_reset("0.5"), secs(0.5));
}

#[test]
fn garbage_is_ignored() {
    for (name, value) in [
        ("x-ratelimit-remaining", "many"),
        ("x-ratelimit-remaining", "-1"),
        ("x-ratelimit-remaining", "NaN"),
        ("x-ratelimit-remaining", "inf"),
        ("x-rate-limit-remaining", ""),
        ("x-ratelimit-remaining-requests", "0x10"),
        ("x-shopify-shop-api-call-limit", "40"),
        ("x-shopify-shop-api-call-limit", "a/b"),
        ("ratelimit", "\"default\";r=5,"),
        ("ratelimit", "\"default;r=5"),
        ("ratelimit", "\"default\";r=-5;t=1"),
        ("ratelimit", "\"default\";r=1.5;t=1"),
        ("ratelimit", "\"default\";t=1"),
        ("ratelimit", "(\"a\" \"b\");r=1"),
    ] {
        let h = headers(&[(name, value)]);
        assert_eq!(
            read(&h, Families::ALL, SystemTime::now()),
            None,
            "{name}: {value}"
        );
    }
    // A bad reset leaves the remaining count usable.
    let h = headers(&[
        ("x-ratelimit-remaining", "3"),
        ("x-ratelimit-reset", "soon"),
    ]);
    let s = read(&h, Families::ALL, SystemTime::now()).unwrap();
    assert_eq!((s.remaining, s.reset), (3, None));
}

#[test]
fn absurd_numbers_saturate_rather_than_panic() {
    let h = headers(&[
        ("x-ratelimit-remaining", "1e300"),
        ("x-ratelimit-reset-after", "1e300"),
    ]);
    let s = read(&h, Families::ALL, SystemTime::now()).unwrap();
    assert_eq!(s.remaining, u64::MAX);
    assert_eq!(s.reset, Some(Reset::In(Duration::MAX)));
    let h = headers(&[
        ("x-rate-limit-remaining", "0"),
        ("x-rate-limit-reset", "1e300"),
    ]);
    // Past what the clock can hold: no reset at all, not a panic.
    assert_eq!(
        read(&h, Families::ALL, SystemTime::now()).unwrap().reset,
        None
    );
}

proptest! {
    #[test]
    fn arbitrary_values_never_panic(values in proptest::collection::vec("\\PC{0,30}", 12)) {
        let names = [
            "ratelimit", "ratelimit-policy", "x-ratelimit-remaining", "x-ratelimit-limit",
            "x-ratelimit-reset", "x-ratelimit-reset-after", "x-rate-limit-remaining",
            "x-rate-limit-reset", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
            "x-shopify-shop-api-call-limit", "age",
        ];
        let mut h = HeaderMap::new();
        for (name, value) in names.iter().zip(&values) {
            if let Ok(v) = HeaderValue::from_str(value) {
                h.insert(HeaderName::from_static(name), v);
            }
        }
        let now = SystemTime::now();
        if let Some(s) = read(&h, Families::ALL, now) {
            let _ = s.reset_in(now);
        }
    }

    #[test]
    fn any_count_and_reset_round_trip(remaining in 0u64..u64::MAX, reset in 0u64..1_000_000_000) {
        let h = headers(&[
            ("x-ratelimit-remaining", &remaining.to_string()),
            ("x-ratelimit-reset", &reset.to_string()),
        ]);
        let s = read(&h, Families::ALL, SystemTime::now()).unwrap();
        prop_assert_eq!(s.remaining, remaining);
        prop_assert_eq!(s.reset, Some(Reset::In(Duration::from_secs(reset))));
    }
}

mod resource {
    use super::*;

    #[test]
    fn github_names_its_bucket_in_x_ratelimit_resource() {
        let h = headers(&[
            ("x-ratelimit-resource", "search"),
            ("x-ratelimit-remaining", "9"),
        ]);
        assert_eq!(resource(&h).as_deref(), Some("search"));
    }

    #[test]
    fn the_ietf_fields_name_it_in_the_partition_key() {
        // `pk` is a byte sequence: `c2VhcmNo` is "search".
        let h = headers(&[(
            "ratelimit",
            "\"burst\";r=3;t=10, \"day\";r=40;t=86400;pk=:c2VhcmNo:",
        )]);
        assert_eq!(resource(&h).as_deref(), Some("search"));
    }

    #[test]
    fn no_name_a_blank_one_or_a_malformed_field_names_nothing() {
        assert_eq!(resource(&headers(&[("x-ratelimit-remaining", "9")])), None);
        assert_eq!(resource(&headers(&[("x-ratelimit-resource", " ")])), None);
        assert_eq!(
            resource(&headers(&[("ratelimit", "\"a\";r=3;pk=:not base64")])),
            None
        );
        assert_eq!(resource(&headers(&[("ratelimit", "\"a\";r=3;t=1")])), None);
    }
}
