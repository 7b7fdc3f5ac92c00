//! A destination's pacing keys: rate and backoff, statuses, quota windows, and what the
//! vendor says (signals, reserve, the escalating block, body markers).

use std::time::Duration;

use super::super::file::{RawBlock, RawDestination, RawSignals};
use super::super::{MAX_BACKOFF, MAX_MARKER_BYTES, MAX_PAUSE, MAX_QUOTA_LIMIT, MIN_RATE};
use super::{Validator, DAY};
use crate::destination::{Block, KeyFrom, Pace, Quota};
use crate::signals::walls::Walls;
use crate::signals::{Families, Family};

/// The longest a request may wait for its slot.
const MAX_WAIT: Duration = DAY;
/// The most keys a budget may be split into, per instance.
const MAX_KEYS: usize = 1_000_000;
/// The longest a key's idle budget may be kept.
const MAX_KEY_IDLE: Duration = Duration::from_secs(30 * 24 * 3600);
/// The longest quota window: a year, leap day included.
const MAX_QUOTA_WINDOW: Duration = Duration::from_secs(366 * 24 * 3600);

impl Validator<'_> {
    /// `quota`: each window's limit (1 to `max`, in the budget's unit) and length.
    pub(super) fn quotas(&mut self, path: &str, quota: &[Quota], max: u32) {
        for (i, q) in quota.iter().enumerate() {
            if !(1..=max).contains(&q.limit) {
                self.push(
                    &format!("{path}.quota[{i}].limit"),
                    format!("must be 1 to {max}"),
                );
            }
            if q.per < Duration::from_millis(1) || q.per > MAX_QUOTA_WINDOW {
                self.push(
                    &format!("{path}.quota[{i}].per"),
                    "must be from 1ms to 366d (write it like \"1m\" or \"1d\")",
                );
            }
        }
    }

    pub(super) fn pace(&mut self, path: &str, d: &RawDestination) -> Pace {
        let rate = d.rate.unwrap_or_else(|| {
            self.push(
                &format!("{path}.rate"),
                "is required: requests per second over every instance, e.g. 5 or 0.5",
            );
            1.0
        });
        if !(rate.is_finite() && (MIN_RATE..=1_000_000.0).contains(&rate)) {
            self.push(
                &format!("{path}.rate"),
                format!(
                    "must be a number from {MIN_RATE} (one request in about 17 minutes) to 1000000"
                ),
            );
        }
        let default = Pace::new(rate);
        let mut pace = Pace {
            burst: self.count(
                &format!("{path}.burst"),
                d.burst,
                default.burst,
                1..=100_000,
            ),
            max_concurrency: self.count(
                &format!("{path}.max_concurrency"),
                d.max_concurrency,
                default.max_concurrency,
                0..=1_000_000,
            ),
            max_wait: self.duration(
                &format!("{path}.max_wait"),
                d.max_wait,
                default.max_wait,
                MAX_WAIT,
            ),
            throttle_statuses: d
                .throttle_statuses
                .clone()
                .unwrap_or(default.throttle_statuses.clone()),
            lockout_statuses: d
                .lockout_statuses
                .clone()
                .unwrap_or(default.lockout_statuses.clone()),
            backoff_factor: d.backoff_factor.unwrap_or(default.backoff_factor),
            backoff_max: d.backoff_max.unwrap_or(default.backoff_max),
            decay_after: self.count(
                &format!("{path}.decay_after"),
                d.decay_after,
                default.decay_after,
                1..=1_000_000,
            ),
            retry_after_max: self.duration(
                &format!("{path}.retry_after_max"),
                d.retry_after_max,
                default.retry_after_max,
                MAX_PAUSE,
            ),
            retry_throttled: self.count(
                &format!("{path}.retry_throttled"),
                d.retry_throttled,
                default.retry_throttled,
                0..=10,
            ),
            intercept: d.intercept.unwrap_or(default.intercept),
            advertise: d.advertise.unwrap_or(default.advertise),
            mode: d.mode.unwrap_or(default.mode),
            quota: d.quota.clone().unwrap_or_default(),
            window: None,
            signals: self.signals(path, d.signals.as_ref()),
            reserve: self.count(
                &format!("{path}.reserve"),
                d.reserve,
                default.reserve,
                0..=MAX_QUOTA_LIMIT,
            ),
            vendor_pace: d.vendor_pace.unwrap_or(default.vendor_pace),
            throttle_block: d.throttle_block.as_ref().map(|b| self.block(path, b)),
            throttle_body: self.markers(path, d.throttle_body.as_deref(), default.throttle_body),
            challenges: self.walls(path, d.challenges.as_deref()),
            challenge_share: self.share(path, d.challenge_share, default.challenge_share),
            cache: d.cache.unwrap_or(default.cache),
            key: d.key.as_deref().and_then(|text| {
                KeyFrom::parse(text)
                    .map_err(|e| self.push(&format!("{path}.key"), e))
                    .ok()
            }),
            max_keys: self.count(
                &format!("{path}.max_keys"),
                d.max_keys,
                default.max_keys,
                1..=MAX_KEYS,
            ),
            // Set below, once max_keys is known.
            max_keys_per_client: 0,
            key_idle: self.duration(
                &format!("{path}.key_idle"),
                d.key_idle,
                default.key_idle,
                MAX_KEY_IDLE,
            ),
            total_rate: d.total_rate,
            rate,
        };
        pace.max_keys_per_client = match d.max_keys_per_client {
            // Half, but never under 100 (or all of them, where fewer): a budget of few keys
            // is one client's as often as not.
            None => (pace.max_keys / 2).max(pace.max_keys.min(100)),
            Some(n) if (1..=pace.max_keys).contains(&n) => n,
            Some(n) => {
                self.push(
                    &format!("{path}.max_keys_per_client"),
                    format!("{n}: must be from 1 to max_keys ({})", pace.max_keys),
                );
                pace.max_keys
            }
        };
        if let Some(total) = pace.total_rate {
            if pace.key.is_none() {
                self.push(
                    &format!("{path}.total_rate"),
                    "applies only with `key`: without it, `rate` is the one ceiling",
                );
            } else if !(total.is_finite() && (MIN_RATE..=1_000_000.0).contains(&total)) {
                self.push(
                    &format!("{path}.total_rate"),
                    format!("must be a number from {MIN_RATE} to 1000000"),
                );
            }
        }
        // A key's budget forgotten sooner than its interval or a quota window would let the
        // key start afresh while its last slots still count.
        let longest = pace
            .quota
            .iter()
            .map(|q| q.per)
            .chain([Duration::from_secs_f64(1.0 / rate.max(MIN_RATE))])
            .max()
            .unwrap_or_default();
        if pace.key.is_some() && pace.key_idle < longest {
            self.push(
                &format!("{path}.key_idle"),
                format!(
                    "must be at least the interval and every quota window ({}): a key forgotten sooner would start afresh while its last slots still count",
                    humantime::format_duration(longest)
                ),
            );
        }
        self.quotas(path, &pace.quota, MAX_QUOTA_LIMIT);
        if !(pace.backoff_factor.is_finite() && pace.backoff_factor > 1.0) {
            self.push(&format!("{path}.backoff_factor"), "must be above 1");
        }
        if !(pace.backoff_max.is_finite() && (1.0..=MAX_BACKOFF).contains(&pace.backoff_max)) {
            self.push(
                &format!("{path}.backoff_max"),
                format!("must be from 1 to {MAX_BACKOFF}"),
            );
        }
        for (key, list) in [
            ("throttle_statuses", &pace.throttle_statuses),
            ("lockout_statuses", &pace.lockout_statuses),
        ] {
            for (i, s) in list.iter().enumerate() {
                if !(100..=599).contains(s) {
                    self.push(
                        &format!("{path}.{key}[{i}]"),
                        format!("{s} is not an HTTP status (100 to 599)"),
                    );
                } else if !(400..=599).contains(s) {
                    // A success or a redirect as a verdict would throttle or lock out a
                    // destination that answers well.
                    self.push(
                        &format!("{path}.{key}[{i}]"),
                        format!(
                            "{s} is not an error status: a verdict is taken on 4xx and 5xx only"
                        ),
                    );
                }
            }
        }
        if let Some(both) = pace
            .throttle_statuses
            .iter()
            .find(|s| pace.lockout_statuses.contains(s))
        {
            self.push(
                &format!("{path}.lockout_statuses"),
                format!("{both} is also a throttle status; a status has one verdict"),
            );
        }
        pace
    }

    /// `challenges`: the bot walls told from lockouts.
    fn walls(&mut self, path: &str, raw: Option<&[String]>) -> Walls {
        let Some(entries) = raw else {
            return Walls::default();
        };
        let mut walls = Walls::NONE;
        for (i, entry) in entries.iter().enumerate() {
            if let Err(e) = walls.add(entry) {
                self.push(&format!("{path}.challenges[{i}]"), e);
            }
        }
        walls
    }

    /// `challenge_share`: a fraction of responses, above 0 and at most 1.
    fn share(&mut self, path: &str, raw: Option<f64>, default: f64) -> f64 {
        match raw {
            None => default,
            Some(x) if x > 0.0 && x <= 1.0 => x,
            Some(x) => {
                self.push(
                    &format!("{path}.challenge_share"),
                    format!("{x}: must be above 0 and at most 1 (a share of responses; 1: challenges never widen the pace)"),
                );
                default
            }
        }
    }

    fn signals(&mut self, path: &str, raw: Option<&RawSignals>) -> Families {
        let known = || {
            let names: Vec<&str> = Family::ALL.iter().map(|f| f.as_str()).collect();
            format!("\"auto\", \"none\", or a list of: {}", names.join(", "))
        };
        match raw {
            None => Families::ALL,
            Some(RawSignals::One(s)) if s == "auto" => Families::ALL,
            Some(RawSignals::One(s)) if s == "none" => Families::NONE,
            Some(RawSignals::One(s)) => {
                self.push(
                    &format!("{path}.signals"),
                    format!("`{s}`: expected {}", known()),
                );
                Families::ALL
            }
            Some(RawSignals::List(names)) => {
                let mut families = Vec::new();
                for (i, name) in names.iter().enumerate() {
                    match Family::from_name(name) {
                        Some(f) => families.push(f),
                        None => self.push(
                            &format!("{path}.signals[{i}]"),
                            format!("`{name}` is not a header family: expected {}", known()),
                        ),
                    }
                }
                Families::of(&families)
            }
        }
    }

    fn block(&mut self, path: &str, raw: &RawBlock) -> Block {
        let path = format!("{path}.throttle_block");
        let min = raw.min.unwrap_or_else(|| {
            self.push(
                &format!("{path}.min"),
                "is required: the first block, e.g. \"60s\"",
            );
            Duration::from_secs(60)
        });
        let max = raw.max.unwrap_or(Duration::from_secs(3600));
        let jitter = raw.jitter.unwrap_or(0.2);
        if min.is_zero() {
            self.push(&format!("{path}.min"), "must be above 0");
        }
        if max < min {
            self.push(&format!("{path}.max"), "must be at least `min`");
        }
        if max > MAX_PAUSE {
            self.push(&format!("{path}.max"), "must be at most 7 days");
        }
        if !(jitter.is_finite() && (0.0..1.0).contains(&jitter)) {
            self.push(
                &format!("{path}.jitter"),
                "must be from 0 to below 1 (0.2: 20% either way)",
            );
        }
        Block { min, max, jitter }
    }

    fn markers(&mut self, path: &str, raw: Option<&[String]>, default: Vec<String>) -> Vec<String> {
        let Some(raw) = raw else {
            return default;
        };
        for (i, m) in raw.iter().enumerate() {
            if m.trim().is_empty() || m.len() > MAX_MARKER_BYTES {
                self.push(
                    &format!("{path}.throttle_body[{i}]"),
                    format!("must be 1 to {MAX_MARKER_BYTES} bytes of text"),
                );
            }
        }
        raw.iter().map(|m| m.to_lowercase()).collect()
    }
}
