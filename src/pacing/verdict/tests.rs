//! Retry-After in both forms, verdicts by status, and throttles that arrive as a lockout
//! status.

use super::*;
use http::{HeaderName, HeaderValue};
use proptest::prelude::*;

const MAX: Duration = Duration::from_secs(3600);

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

fn at(date: &str) -> SystemTime {
    httpdate::parse_http_date(date).unwrap()
}

fn pace() -> Pace {
    Pace {
        retry_after_max: MAX,
        ..Pace::new(1.0)
    }
}

/// The pause a response asks for, as a store whose wall clock reads `now` resolves it.
fn paused(h: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let date = h
        .get(DATE)
        .and_then(|d| d.to_str().ok())
        .and_then(|d| httpdate::parse_http_date(d).ok());
    retry_after(h, date)?.resolve(now, MAX)
}

mod retry_after {
    use super::*;

    #[test]
    fn parses_delta_seconds() {
        let h = headers(&[("retry-after", "120")]);
        assert_eq!(
            retry_after(&h, None),
            Some(Pause::For(Duration::from_secs(120)))
        );
    }

    #[test]
    fn parses_http_date_against_the_date_header() {
        let h = headers(&[
            ("retry-after", "Wed, 21 Oct 2015 07:28:30 GMT"),
            ("date", "Wed, 21 Oct 2015 07:28:00 GMT"),
        ]);
        // The local clock is years off; the response's own Date is the reference.
        assert_eq!(paused(&h, SystemTime::now()), Some(Duration::from_secs(30)));
    }

    #[test]
    fn without_a_date_header_an_http_date_is_left_to_the_store_clock() {
        let h = headers(&[("retry-after", "Wed, 21 Oct 2015 07:28:30 GMT")]);
        assert_eq!(
            retry_after(&h, None),
            Some(Pause::Until(at("Wed, 21 Oct 2015 07:28:30 GMT")))
        );
        let store_now = at("Wed, 21 Oct 2015 07:28:10 GMT");
        assert_eq!(paused(&h, store_now), Some(Duration::from_secs(20)));
    }

    #[test]
    fn ignores_dates_in_the_past() {
        let h = headers(&[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")]);
        assert_eq!(paused(&h, SystemTime::now()), None);
    }

    #[test]
    fn ignores_garbage_zero_and_negatives() {
        for v in ["soon", "-5", "0", "", "1.5", "12 34", "0x10"] {
            let h = headers(&[("retry-after", v)]);
            assert_eq!(paused(&h, SystemTime::now()), None, "{v:?}");
        }
        assert_eq!(paused(&HeaderMap::new(), SystemTime::now()), None);
    }

    #[test]
    fn caps_huge_values() {
        for v in [
            "99999999999",
            "999999999999999999999999999999",
            "Fri, 31 Dec 9999 23:59:59 GMT",
        ] {
            let h = headers(&[("retry-after", v)]);
            assert_eq!(paused(&h, SystemTime::now()), Some(MAX), "{v:?}");
        }
    }

    proptest! {
        #[test]
        fn never_panics_and_never_exceeds_the_cap(value in "\\PC{0,40}", date in proptest::option::of("\\PC{0,40}"), now_secs in 0u64..10_000_000_000) {
            let mut h = HeaderMap::new();
            if let Ok(v) = HeaderValue::from_str(&value) {
                h.insert(RETRY_AFTER, v);
            }
            if let Some(Ok(d)) = date.map(|d| HeaderValue::from_str(&d)) {
                h.insert(DATE, d);
            }
            let now = SystemTime::UNIX_EPOCH + Duration::from_secs(now_secs);
            if let Some(p) = paused(&h, now) {
                prop_assert!(p <= MAX && !p.is_zero());
            }
        }

        #[test]
        fn any_number_of_seconds_is_honoured_up_to_the_cap(n in 1u64..u64::MAX) {
            let h = headers(&[("retry-after", &n.to_string())]);
            prop_assert_eq!(paused(&h, SystemTime::now()), Some(Duration::from_secs(n).min(MAX)));
        }
    }
}

mod classify {
    use super::*;

    fn verdict(status: u16, h: &HeaderMap) -> Verdict {
        classify(status, h, &pace()).verdict
    }

    fn throttled(why: Why, retry_after: Option<Pause>, reset: Option<Pause>) -> Verdict {
        Verdict::Throttled {
            retry_after,
            reset,
            why,
        }
    }

    fn secs(n: u64) -> Option<Pause> {
        Some(Pause::For(Duration::from_secs(n)))
    }

    #[test]
    fn statuses_map_to_verdicts_as_the_spec_says() {
        let h = HeaderMap::new();
        for (status, want) in [
            (200, Verdict::Clean),
            (204, Verdict::Clean),
            (304, Verdict::Clean),
            (404, Verdict::Clean),
            (429, throttled(Why::Status, None, None)),
            (503, throttled(Why::Status, None, None)),
            (403, Verdict::Lockout),
            (500, Verdict::None),
            (502, Verdict::None),
        ] {
            assert_eq!(verdict(status, &h), want, "{status}");
        }
    }

    #[test]
    fn lists_are_configurable() {
        let p = Pace {
            throttle_statuses: vec![420],
            lockout_statuses: vec![451],
            ..pace()
        };
        let h = headers(&[("retry-after", "9")]);
        assert_eq!(
            classify(420, &h, &p).verdict,
            throttled(Why::Status, secs(9), None)
        );
        assert_eq!(
            classify(451, &HeaderMap::new(), &p).verdict,
            Verdict::Lockout
        );
        assert_eq!(classify(403, &h, &p).verdict, Verdict::Clean);
        assert_eq!(classify(429, &h, &p).verdict, Verdict::Clean);
    }

    #[test]
    fn a_lockout_status_with_retry_after_is_a_throttle() {
        let h = headers(&[("retry-after", "60")]);
        assert_eq!(verdict(403, &h), throttled(Why::RetryAfter, secs(60), None));
        // Present but unreadable, it is still the vendor saying "later", not "never".
        let h = headers(&[("retry-after", "soon")]);
        assert_eq!(verdict(403, &h), throttled(Why::RetryAfter, None, None));
    }

    #[test]
    fn github_primary_exhaustion_pauses_until_the_reset() {
        let h = headers(&[
            ("date", "Wed, 09 Aug 2023 14:00:00 GMT"),
            ("x-ratelimit-limit", "5000"),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "1691589630"),
        ]);
        // 14:00:30 GMT on that day: the reset is read against the response's own Date.
        let r = classify(403, &h, &pace());
        assert_eq!(r.verdict, throttled(Why::Exhausted, None, secs(30)));
        assert_eq!(r.signal.unwrap().0.remaining, 0);
        // Without a Date, the reset instant is left to the store's clock.
        let h = headers(&[
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "1691589630"),
        ]);
        let until = SystemTime::UNIX_EPOCH + Duration::from_secs(1_691_589_630);
        assert_eq!(
            verdict(403, &h),
            throttled(Why::Exhausted, None, Some(Pause::Until(until)))
        );
    }

    #[test]
    fn a_throttle_status_pauses_until_a_spent_budget_resets_unless_retry_after_says_otherwise() {
        let h = headers(&[("ratelimit", "\"default\";r=0;t=5")]);
        assert_eq!(verdict(429, &h), throttled(Why::Status, None, secs(5)));
        let h = headers(&[("ratelimit", "\"default\";r=0;t=5"), ("retry-after", "7")]);
        assert_eq!(
            verdict(429, &h),
            throttled(Why::Status, secs(7), secs(5)),
            "both go to the store, which obeys Retry-After first"
        );
    }

    #[test]
    fn a_remaining_budget_does_not_excuse_a_lockout() {
        let h = headers(&[("x-ratelimit-remaining", "12"), ("x-ratelimit-reset", "30")]);
        let r = classify(403, &h, &pace());
        assert_eq!(r.verdict, Verdict::Lockout);
        assert!(r.needs_body(&pace()));
        assert_eq!(r.marked_by_body().verdict, throttled(Why::Body, None, None));
        // With signals off, remaining 0 is no marker.
        let off = Pace {
            signals: crate::signals::Families::NONE,
            ..pace()
        };
        let h = headers(&[("x-ratelimit-remaining", "0")]);
        assert_eq!(classify(403, &h, &off).verdict, Verdict::Lockout);
        assert_eq!(classify(403, &h, &off).signal, None);
    }

    #[test]
    fn only_lockouts_read_the_body_and_only_with_markers_or_walls_to_look_for() {
        let h = HeaderMap::new();
        assert!(!classify(200, &h, &pace()).needs_body(&pace()));
        assert!(!classify(429, &h, &pace()).needs_body(&pace()));
        let none = Pace {
            throttle_body: Vec::new(),
            challenges: crate::signals::walls::Walls::NONE,
            ..pace()
        };
        assert!(!classify(403, &h, &none).needs_body(&none));
        let walls_only = Pace {
            throttle_body: Vec::new(),
            ..pace()
        };
        assert!(classify(403, &h, &walls_only).needs_body(&walls_only));
    }

    #[test]
    fn a_challenge_is_neither_a_throttle_nor_a_lockout_whatever_its_status() {
        let cf = headers(&[("cf-mitigated", "challenge"), ("retry-after", "5")]);
        for status in [403, 429, 503, 200] {
            let r = classify(status, &cf, &pace());
            assert_eq!(r.verdict, Verdict::Challenge(Wall::Cloudflare), "{status}");
            assert!(!r.needs_body(&pace()), "{status}");
        }
        let named = Verdict::Challenge(Wall::Cloudflare).named();
        assert_eq!(
            (named.as_str(), named.reason()),
            ("challenge", "cloudflare")
        );
        // A 403 read whole: a wall's page wins over a throttle marker, which wins over nothing.
        let h = headers(&[("server", "AkamaiGHost")]);
        let r = classify(403, &h, &pace());
        assert_eq!(r.verdict, Verdict::Lockout);
        let page = b"Too many requests? Reference #18.2f1d";
        assert_eq!(
            r.by_body(&pace(), &h, page).verdict,
            Verdict::Challenge(Wall::Akamai)
        );
        assert!(matches!(
            r.by_body(&pace(), &h, b"too many requests").verdict,
            Verdict::Throttled { why: Why::Body, .. }
        ));
        assert_eq!(
            r.by_body(&pace(), &h, b"Forbidden").verdict,
            Verdict::Lockout
        );
    }

    #[test]
    fn body_markers_match_without_case() {
        let markers = pace().throttle_body;
        for body in [
            "You have exceeded a secondary rate limit. Please wait a few minutes.",
            r#"{"error":{"code":403,"message":"Too Many Requests"}}"#,
        ] {
            assert!(body_has_marker(body.as_bytes(), &markers), "{body}");
        }
        assert!(!body_has_marker(
            b"Resource not accessible by integration",
            &markers
        ));
        let google = vec![
            "ratelimitexceeded".to_owned(),
            "userratelimitexceeded".to_owned(),
        ];
        assert!(body_has_marker(
            br#"{"error":{"errors":[{"reason":"userRateLimitExceeded"}]}}"#,
            &google
        ));
    }

    proptest! {
        #[test]
        fn vendor_headers_never_panic_nor_pause_past_the_cap(
            values in proptest::collection::vec("\\PC{0,24}", 8),
            status in prop::sample::select(vec![200u16, 403, 429, 500]),
            now_secs in 0u64..10_000_000_000,
        ) {
            let names = [
                "retry-after", "date", "ratelimit", "x-ratelimit-remaining", "x-ratelimit-reset",
                "x-rate-limit-reset", "x-ratelimit-reset-requests", "x-ratelimit-reset-after",
            ];
            let mut h = HeaderMap::new();
            for (name, value) in names.iter().zip(&values) {
                if let Ok(v) = HeaderValue::from_str(value) {
                    h.insert(HeaderName::from_static(name), v);
                }
            }
            // Forcing a spent budget makes every reset field decide the pause.
            h.insert(HeaderName::from_static("x-rate-limit-remaining"), HeaderValue::from_static("0"));
            let now = SystemTime::UNIX_EPOCH + Duration::from_secs(now_secs);
            if let Verdict::Throttled { retry_after, reset, .. } = classify(status, &h, &pace()).verdict {
                for p in [retry_after, reset].into_iter().flatten() {
                    if let Some(d) = p.resolve(now, MAX) {
                        prop_assert!(d <= MAX && !d.is_zero());
                    }
                }
            }
        }
    }
}
