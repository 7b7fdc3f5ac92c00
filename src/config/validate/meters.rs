//! A destination's meters: budgets in other units than requests (tokens, points), and the
//! most of a request body read to estimate a request's cost to them.

use std::str::FromStr;
use std::time::Duration;

use super::super::file::{RawCost, RawDestination, RawMeter, RawSize};
use super::{is_plain_name, Validator};
use crate::destination::{Meter, Pace, Quota, DEFAULT_MAX_BODY};
use crate::meter::Cost;

/// The most meters one destination may have: each is a budget every request of it waits for.
const MAX_METERS: usize = 8;

/// The most a meter may allow in a minute: a request's cost is a slot that many intervals
/// long, counted in 32 bits.
const MAX_PER_MINUTE: f64 = 1e9;

/// The largest `max_body`: a body is held in memory while its request waits.
const MAX_BODY: u64 = 256 * 1024 * 1024;

/// What stands for what a request does not say of its cost, where `default` is not set: an
/// output of 1,024 tokens, or one point.
fn default_of(cost: &Cost) -> u64 {
    match cost {
        Cost::OpenAi | Cost::AnthropicInput | Cost::AnthropicOutput => 1024,
        Cost::GithubGraphql | Cost::ShopifyGraphql | Cost::Header(_) | Cost::Fixed(_) => 1,
    }
}

impl Validator<'_> {
    /// `[NAME.meters.UNIT]`: each a budget of its own, paced in its unit with the
    /// destination's backoff, waits, signals and mode.
    pub(super) fn meters(&mut self, path: &str, d: &RawDestination, pace: &Pace) -> Vec<Meter> {
        let raw = d.meters.clone().unwrap_or_default();
        if raw.len() > MAX_METERS {
            self.push(
                &format!("{path}.meters"),
                format!("at most {MAX_METERS} meters per destination or group"),
            );
        }
        raw.into_iter()
            .filter_map(|(name, m)| self.meter(&format!("{path}.meters.{name}"), name, &m, pace))
            .collect()
    }

    fn meter(&mut self, path: &str, name: String, m: &RawMeter, pace: &Pace) -> Option<Meter> {
        if !is_plain_name(&name) {
            self.push(
                path,
                "meter names (the unit) may hold only letters, digits, `_` and `-`",
            );
        }
        let per_minute = match (m.per_minute, m.rate) {
            (Some(n), None) => Some((n, "per_minute")),
            (None, Some(r)) => Some((r * 60.0, "rate")),
            (Some(_), Some(_)) => {
                self.push(path, "set `per_minute` or `rate` (per second), not both");
                None
            }
            (None, None) => {
                self.push(
                    path,
                    "needs `per_minute` (units a minute, over every instance) or `rate` (units a second)",
                );
                None
            }
        };
        let per_minute = per_minute.and_then(|(n, key)| {
            let ok = n.is_finite() && (1.0..=MAX_PER_MINUTE).contains(&n);
            if !ok {
                self.push(
                    &format!("{path}.{key}"),
                    "must allow from 1 unit a minute to 1000000000 (rate: 1/60 to 16666666 a second)",
                );
            }
            ok.then_some(n)
        });
        let cost = match &m.cost {
            None => {
                self.push(
                    &format!("{path}.cost"),
                    "is required: how a request's cost is estimated and settled, e.g. \"openai\"",
                );
                None
            }
            Some(given) => match Cost::from_str(&match given {
                RawCost::Number(n) => n.to_string(),
                RawCost::Text(text) => text.clone(),
            }) {
                Ok(cost) => Some(cost),
                Err(e) => {
                    self.push(&format!("{path}.cost"), e.to_string());
                    None
                }
            },
        };
        let quota = m.quota.clone().unwrap_or_default();
        self.quotas(path, &quota, u32::MAX);
        // A key's meter forgotten sooner than its window would start afresh while the
        // window still counts its units.
        let longest = quota.iter().map(|q| q.per).max().unwrap_or_default();
        if pace.key.is_some() && pace.key_idle < longest {
            self.push(
                &format!("{path}.quota"),
                format!(
                    "a window is longer than the destination's `key_idle` ({}): raise `key_idle` to at least {}, or a key's meter would be forgotten while its window still counts",
                    humantime::format_duration(pace.key_idle),
                    humantime::format_duration(longest)
                ),
            );
        }
        if m.default == Some(0) {
            self.push(
                &format!("{path}.default"),
                "must be at least 1: a request that costs nothing would never wait",
            );
        }
        let (per_minute, cost) = (per_minute?, cost?);
        // No estimate is larger than a minute's worth, nor than a quota window holds: a
        // request costing more could never fit.
        let size = quota
            .iter()
            .map(|q| u64::from(q.limit))
            .fold(per_minute.floor() as u64, u64::min);
        let default = m
            .default
            .unwrap_or_else(|| default_of(&cost))
            .clamp(1, size.max(1));
        // The meter's own window is as long as it was given: a minute for `per_minute`, a
        // second for a `rate` of a unit a second or more (a slower one is a minute's).
        let window = if m.per_minute.is_none() && per_minute >= 60.0 {
            Quota {
                limit: (per_minute / 60.0).floor() as u32,
                per: Duration::from_secs(1),
            }
        } else {
            Quota {
                limit: per_minute.floor() as u32,
                per: Duration::from_secs(60),
            }
        };
        Some(Meter {
            name,
            cost,
            default,
            size,
            pace: Pace {
                rate: per_minute / 60.0,
                // A slot is a request's cost: a burst of several would let them go at once.
                burst: 1,
                quota,
                window: Some(window),
                reserve: 0,
                // Split by the destination's key: a key's meter is the key's own.
                total_rate: None,
                ..pace.clone()
            },
        })
    }

    /// `max_body`: what a meter may read of a request body before its slot.
    pub(super) fn max_body(&mut self, path: &str, d: &RawDestination) -> usize {
        let size = match &d.max_body {
            None => return DEFAULT_MAX_BODY,
            Some(RawSize::Bytes(n)) => Some(*n),
            Some(RawSize::Text(text)) => {
                text.parse::<bytesize::ByteSize>().ok().map(|b| b.as_u64())
            }
        };
        match size.filter(|n| (1..=MAX_BODY).contains(n)) {
            Some(n) => usize::try_from(n).unwrap_or(DEFAULT_MAX_BODY),
            None => {
                self.push(
                    &format!("{path}.max_body"),
                    "must be a size from 1 byte to 256MiB: a number of bytes, or a string such as \"4MiB\" or \"512KiB\"",
                );
                DEFAULT_MAX_BODY
            }
        }
    }
}
