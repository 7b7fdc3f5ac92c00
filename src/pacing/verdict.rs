//! What a response tells the pacer: clean, throttled, a bot wall's challenge, lockout or no
//! verdict, why, how long it asks to pause, and what the vendor says about its budget.

use std::fmt;
use std::time::{Duration, SystemTime};

use http::header::{HeaderMap, DATE, RETRY_AFTER};

pub use crate::budget::Pause;
use crate::destination::Pace;
use crate::signals::walls::Wall;
use crate::signals::{self, Reset, Signal};

/// How much of a lockout-status body is looked at for a throttle marker.
pub const BODY_SNIFF_BYTES: usize = 8 * 1024;

/// The verdict on one upstream response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Any other completed response (2xx, 3xx, 4xx not listed).
    Clean,
    /// A throttle: a status in `throttle_statuses`, or a lockout status carrying a
    /// rate-limit marker.
    Throttled {
        /// The pause its `Retry-After` asks for.
        retry_after: Option<Pause>,
        /// A spent vendor budget's reset (`Retry-After` wins over it).
        reset: Option<Pause>,
        /// What made it a throttle.
        why: Why,
    },
    /// A bot-management product's challenge (see [`crate::signals::walls`]), whatever its
    /// status: neither a throttle nor a lockout.
    Challenge(Wall),
    /// A status in `lockout_statuses` with no rate-limit marker.
    Lockout,
    /// Nothing to learn: other 5xx, or no response at all.
    None,
}

/// What made a response a throttle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// Its status is a throttle status.
    Status,
    /// A lockout status with a `Retry-After`.
    RetryAfter,
    /// A lockout status with a vendor remaining of 0.
    Exhausted,
    /// A lockout status whose body carries a `throttle_body` marker.
    Body,
}

impl Why {
    /// The `reason` metric label and log field.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Status => "status",
            Self::RetryAfter => "retry-after",
            Self::Exhausted => "exhausted",
            Self::Body => "body",
        }
    }
}

impl Verdict {
    /// The `verdict` metric label.
    pub fn as_str(self) -> &'static str {
        self.named().as_str()
    }

    /// The `reason` metric label: what decided the verdict.
    pub fn reason(self) -> &'static str {
        self.named().reason()
    }

    /// What the request log says of it.
    pub fn named(self) -> Named {
        match self {
            Self::Clean => Named::Clean,
            Self::Throttled { why, .. } => Named::Throttled(why),
            Self::Challenge(wall) => Named::Challenge(wall),
            Self::Lockout => Named::Lockout,
            Self::None => Named::None,
        }
    }
}

/// A verdict as the request log and the metrics name it, without the pauses it carries: what
/// a request's note keeps, two bytes rather than the verdict's fifty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Named {
    Clean,
    Throttled(Why),
    Challenge(Wall),
    Lockout,
    None,
}

impl Named {
    /// The `verdict` metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Clean => "clean",
            Self::Throttled(_) => "throttled",
            Self::Challenge(_) => "challenge",
            Self::Lockout => "lockout",
            Self::None => "none",
        }
    }

    /// The `reason` metric label: what decided the verdict.
    pub fn reason(self) -> &'static str {
        match self {
            Self::Throttled(why) => why.as_str(),
            Self::Challenge(wall) => wall.as_str(),
            _ => "status",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A response read: its verdict, and the vendor's signal if it carried one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    /// The verdict.
    pub verdict: Verdict,
    /// The strictest vendor signal among the families the destination reads, and its reset
    /// as a pause (a Unix-time reset read against the response's `Date` when it has one).
    pub signal: Option<(Signal, Option<Pause>)>,
    /// Whether its body may say it is a bot wall's challenge (a 403 where one is recognised
    /// by its page: see [`crate::signals::walls::Walls::body_may_tell`]).
    pub wall_in_body: bool,
}

impl Reading {
    /// Whether the body must be looked at: a lockout is a throttle if its body carries a
    /// marker, and a challenge if its body is a bot wall's page.
    pub fn needs_body(&self, pace: &Pace) -> bool {
        self.verdict == Verdict::Lockout && (!pace.throttle_body.is_empty() || self.wall_in_body)
    }

    /// The reading once the start of its body (decoded) was read: a bot wall's page makes a
    /// challenge, else a throttle marker a throttle.
    pub fn by_body(self, pace: &Pace, headers: &HeaderMap, text: &[u8]) -> Self {
        if self.wall_in_body {
            if let Some(wall) = pace.challenges.by_body(headers, text) {
                return Self {
                    verdict: Verdict::Challenge(wall),
                    ..self
                };
            }
        }
        if body_has_marker(text, &pace.throttle_body) {
            self.marked_by_body()
        } else {
            self
        }
    }

    /// The reading once the body was found to carry a throttle marker.
    pub fn marked_by_body(self) -> Self {
        Self {
            verdict: Verdict::Throttled {
                retry_after: None,
                reset: None,
                why: Why::Body,
            },
            ..self
        }
    }
}

/// Reads a response by status and headers, per the destination's lists and signals. A
/// lockout status is a throttle when it carries a rate-limit marker: a `Retry-After`, or a
/// vendor remaining of 0 (the body is the caller's: see [`Reading::needs_body`]). Unix-time
/// resets and HTTP-dates are read against the response's `Date` when it has one.
pub fn classify(status: u16, headers: &HeaderMap, pace: &Pace) -> Reading {
    // Read only when a signal or a `Retry-After` needs it: most responses carry neither.
    let date = std::cell::OnceCell::new();
    let date = || {
        *date.get_or_init(|| {
            headers
                .get(DATE)
                .and_then(|d| d.to_str().ok())
                .and_then(|d| httpdate::parse_http_date(d.trim()).ok())
        })
    };
    let signal = if signals::may_carry(headers) {
        signals::read(
            headers,
            pace.signals,
            date().unwrap_or_else(SystemTime::now),
        )
    } else {
        None
    };
    let retry_after = if headers.contains_key(RETRY_AFTER) {
        retry_after(headers, date())
    } else {
        None
    };
    let reset = signal.and_then(|s| match s.reset? {
        Reset::In(d) => Some(Pause::For(d)),
        Reset::At(t) => Some(match date() {
            Some(date) => Pause::For(t.duration_since(date).ok()?),
            None => Pause::Until(t),
        }),
    });
    let exhausted = signal.is_some_and(|s| s.exhausted());
    // A primary exhaustion pauses until its reset.
    let spent = reset.filter(|_| exhausted);
    // A challenge comes first: a bot wall may answer with any status, a throttle's included.
    let wall = pace.challenges.by_headers(headers);
    let verdict = if let Some(wall) = wall {
        Verdict::Challenge(wall)
    } else if pace.throttle_statuses.contains(&status) {
        Verdict::Throttled {
            retry_after,
            reset: spent,
            why: Why::Status,
        }
    } else if pace.lockout_statuses.contains(&status) {
        if headers.contains_key(RETRY_AFTER) {
            Verdict::Throttled {
                retry_after,
                reset: spent,
                why: Why::RetryAfter,
            }
        } else if exhausted {
            Verdict::Throttled {
                retry_after: None,
                reset: spent,
                why: Why::Exhausted,
            }
        } else {
            Verdict::Lockout
        }
    } else if status >= 500 {
        Verdict::None
    } else {
        Verdict::Clean
    };
    Reading {
        verdict,
        signal: signal.map(|s| (s, reset)),
        wall_in_body: verdict == Verdict::Lockout && pace.challenges.body_may_tell(status, headers),
    }
}

/// Whether the start of a body (decoded) carries one of the lower-case `markers`,
/// case-insensitively.
pub fn body_has_marker(body: &[u8], markers: &[String]) -> bool {
    let text = String::from_utf8_lossy(body).to_lowercase();
    markers.iter().any(|m| text.contains(m.as_str()))
}

/// The pause a `Retry-After` header asks for. Delta-seconds and HTTP-dates are understood;
/// an HTTP-date is read against `date` (the response's own `Date`) when there is one, else
/// left as an instant for the store's clock. A date in the past, zero, a negative or
/// unparsable value means none.
pub fn retry_after(headers: &HeaderMap, date: Option<SystemTime>) -> Option<Pause> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    let pause = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Too many digits for u64 is still "very long": cap it rather than ignore it.
        Pause::For(Duration::from_secs(
            value.parse::<u64>().unwrap_or(u64::MAX),
        ))
    } else {
        let until = httpdate::parse_http_date(value).ok()?;
        match date {
            Some(date) => Pause::For(until.duration_since(date).ok()?),
            None => Pause::Until(until),
        }
    };
    (pause != Pause::For(Duration::ZERO)).then_some(pause)
}

#[cfg(test)]
mod tests;
