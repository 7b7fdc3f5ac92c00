//! What a response tells the pacer: clean, throttled, lockout or no verdict, and how long a
//! `Retry-After` asks to wait.

use std::fmt;
use std::time::{Duration, SystemTime};

use http::header::{HeaderMap, DATE, RETRY_AFTER};

use crate::destination::Pace;

/// The verdict on one upstream response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Any other completed response (2xx, 3xx, 4xx not listed).
    Clean,
    /// A status in `throttle_statuses`; `retry_after` is the pause it asks for, capped.
    Throttled {
        /// The pause asked for, already capped by `retry_after_max`.
        retry_after: Option<Duration>,
    },
    /// A status in `lockout_statuses`.
    Lockout,
    /// Nothing to learn: other 5xx, or no response at all.
    None,
}

impl Verdict {
    /// The `verdict` metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Clean => "clean",
            Self::Throttled { .. } => "throttled",
            Self::Lockout => "lockout",
            Self::None => "none",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Classifies a response by status, per the destination's lists. `now` is the clock a
/// Retry-After date is read against when the response has no `Date` header.
pub fn classify(status: u16, headers: &HeaderMap, pace: &Pace, now: SystemTime) -> Verdict {
    if pace.throttle_statuses.contains(&status) {
        Verdict::Throttled {
            retry_after: retry_after(headers, now, pace.retry_after_max),
        }
    } else if pace.lockout_statuses.contains(&status) {
        Verdict::Lockout
    } else if status >= 500 {
        Verdict::None
    } else {
        Verdict::Clean
    }
}

/// The pause a `Retry-After` header asks for, at most `max`. Delta-seconds and HTTP-dates are
/// understood; an HTTP-date is read against the response's own `Date` when it has one, else
/// against `now`. A date in the past, zero, a negative or unparsable value means none.
pub fn retry_after(headers: &HeaderMap, now: SystemTime, max: Duration) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    let pause = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Too many digits for u64 is still "very long": cap it rather than ignore it.
        Duration::from_secs(value.parse::<u64>().unwrap_or(u64::MAX))
    } else {
        let until = httpdate::parse_http_date(value).ok()?;
        let reference = headers
            .get(DATE)
            .and_then(|d| d.to_str().ok())
            .and_then(|d| httpdate::parse_http_date(d.trim()).ok())
            .unwrap_or(now);
        until.duration_since(reference).ok()?
    };
    (!pause.is_zero()).then(|| pause.min(max))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    const MAX: Duration = Duration::from_secs(3600);

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn at(date: &str) -> SystemTime {
        httpdate::parse_http_date(date).unwrap()
    }

    mod retry_after {
        use super::*;

        #[test]
        fn parses_delta_seconds() {
            let h = headers(&[("retry-after", "120")]);
            assert_eq!(
                retry_after(&h, SystemTime::now(), MAX),
                Some(Duration::from_secs(120))
            );
        }

        #[test]
        fn parses_http_date_against_the_date_header() {
            let h = headers(&[
                ("retry-after", "Wed, 21 Oct 2015 07:28:30 GMT"),
                ("date", "Wed, 21 Oct 2015 07:28:00 GMT"),
            ]);
            // The local clock is years off; the response's own Date is the reference.
            assert_eq!(
                retry_after(&h, SystemTime::now(), MAX),
                Some(Duration::from_secs(30))
            );
        }

        #[test]
        fn parses_http_date_against_now_without_date_header() {
            let h = headers(&[("retry-after", "Wed, 21 Oct 2015 07:28:30 GMT")]);
            let now = at("Wed, 21 Oct 2015 07:28:10 GMT");
            assert_eq!(retry_after(&h, now, MAX), Some(Duration::from_secs(20)));
        }

        #[test]
        fn ignores_dates_in_the_past() {
            let h = headers(&[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")]);
            assert_eq!(retry_after(&h, SystemTime::now(), MAX), None);
        }

        #[test]
        fn ignores_garbage_zero_and_negatives() {
            for v in ["soon", "-5", "0", "", "1.5", "12 34", "0x10"] {
                let h = headers(&[("retry-after", v)]);
                assert_eq!(retry_after(&h, SystemTime::now(), MAX), None, "{v:?}");
            }
            assert_eq!(retry_after(&HeaderMap::new(), SystemTime::now(), MAX), None);
        }

        #[test]
        fn caps_huge_values() {
            for v in [
                "99999999999",
                "999999999999999999999999999999",
                "Fri, 31 Dec 9999 23:59:59 GMT",
            ] {
                let h = headers(&[("retry-after", v)]);
                assert_eq!(retry_after(&h, SystemTime::now(), MAX), Some(MAX), "{v:?}");
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
                if let Some(p) = retry_after(&h, now, MAX) {
                    prop_assert!(p <= MAX && !p.is_zero());
                }
            }

            #[test]
            fn any_number_of_seconds_is_honoured_up_to_the_cap(n in 1u64..u64::MAX) {
                let h = headers(&[("retry-after", &n.to_string())]);
                prop_assert_eq!(retry_after(&h, SystemTime::now(), MAX), Some(Duration::from_secs(n).min(MAX)));
            }
        }
    }

    mod classify {
        use super::*;

        fn pace() -> Pace {
            Pace {
                retry_after_max: MAX,
                ..Pace::new(1.0)
            }
        }

        #[test]
        fn statuses_map_to_verdicts_as_the_spec_says() {
            let now = SystemTime::now();
            let h = HeaderMap::new();
            for (status, verdict) in [
                (200, Verdict::Clean),
                (204, Verdict::Clean),
                (304, Verdict::Clean),
                (404, Verdict::Clean),
                (429, Verdict::Throttled { retry_after: None }),
                (503, Verdict::Throttled { retry_after: None }),
                (403, Verdict::Lockout),
                (500, Verdict::None),
                (502, Verdict::None),
            ] {
                assert_eq!(classify(status, &h, &pace(), now), verdict, "{status}");
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
            let now = SystemTime::now();
            assert_eq!(
                classify(420, &h, &p, now),
                Verdict::Throttled {
                    retry_after: Some(Duration::from_secs(9))
                }
            );
            assert_eq!(classify(451, &h, &p, now), Verdict::Lockout);
            assert_eq!(classify(403, &h, &p, now), Verdict::Clean);
            assert_eq!(classify(429, &h, &p, now), Verdict::Clean);
        }
    }
}
