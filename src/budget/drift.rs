//! Config drift: instances sharing a destination with different rules.
//!
//! Every instance writes each destination's rule to the store, in a canonical form, with a
//! fingerprint. Where a live instance's rule differs from this one's, the *stricter* of the
//! two governs this instance's calls to the store, key by key, until the configs agree, so
//! that the fastest config never sets the real ceiling:
//!
//! | key | stricter |
//! |---|---|
//! | `rate` | the lower |
//! | `burst` | the smaller |
//! | `backoff_factor`, `backoff_max` | the larger |
//! | `decay_after` | the larger (decays later) |
//! | `retry_after_max` | the longer |
//! | `quota` | every window of either; for the same `per`, the smaller `limit` |
//! | `reserve` | the larger |
//! | `block` | present over absent; the longer `min` and `max`, the smaller `jitter` |
//!
//! Class shares and order are not merged: they order requests, they do not pace them. They
//! are part of no fingerprint.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Rule;
use crate::destination::{Block, Quota};

/// A rule as instances compare it: canonical JSON, and its fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The destination.
    pub destination: String,
    /// The first 12 hex digits of the SHA-256 of `rule`.
    pub fingerprint: String,
    /// The canonical JSON of the rule's pacing keys.
    pub rule: String,
}

impl Written {
    /// `rule` of `destination`, written down.
    pub fn of(destination: &str, rule: &Rule) -> Self {
        let rule = serde_json::to_string(&Keys::from(rule)).unwrap_or_default();
        let digest = ring::digest::digest(&ring::digest::SHA256, rule.as_bytes());
        let fingerprint = digest.as_ref()[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Self {
            destination: destination.to_owned(),
            fingerprint,
            rule,
        }
    }
}

/// Another live instance's rule for a destination, where it differs from this one's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Theirs {
    /// The destination.
    pub destination: String,
    /// The instance.
    pub instance: String,
    /// Its fingerprint.
    pub fingerprint: String,
    /// Its canonical JSON (see [`Written`]).
    pub rule: String,
}

/// The pacing keys of a rule, in the canonical form instances write and compare. Seconds as
/// floats, so that every binary writes the same text for the same config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Keys {
    interval: f64,
    burst: u32,
    backoff_factor: f64,
    backoff_max: f64,
    decay_after: u32,
    retry_after_max: f64,
    quota: Vec<(u32, f64)>,
    reserve: u32,
    block: Option<(f64, f64, f64)>,
}

impl From<&Rule> for Keys {
    fn from(r: &Rule) -> Self {
        Self {
            interval: r.interval.as_secs_f64(),
            burst: r.burst,
            backoff_factor: r.backoff_factor,
            backoff_max: r.backoff_max,
            decay_after: r.decay_after,
            retry_after_max: r.retry_after_max.as_secs_f64(),
            quota: r
                .quota
                .iter()
                .map(|q| (q.limit, q.per.as_secs_f64()))
                .collect(),
            reserve: r.reserve,
            block: r
                .block
                .as_ref()
                .map(|b| (b.min.as_secs_f64(), b.max.as_secs_f64(), b.jitter)),
        }
    }
}

/// Seconds read back from another instance's rule, within what any valid config holds.
fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
}

/// `mine` made at least as strict as every rule in `theirs` (canonical JSON), key by key
/// (see the module's table). A rule that cannot be read is skipped: a newer binary's form.
pub fn stricter<'a>(mine: &Rule, theirs: impl IntoIterator<Item = &'a str>) -> Rule {
    let mut rule = mine.clone();
    for text in theirs {
        let Ok(other) = serde_json::from_str::<Keys>(text) else {
            continue;
        };
        rule.interval = rule.interval.max(secs(other.interval));
        rule.burst = rule.burst.min(other.burst.max(1));
        rule.backoff_factor = rule.backoff_factor.max(other.backoff_factor);
        rule.backoff_max = rule.backoff_max.max(other.backoff_max);
        rule.decay_after = rule.decay_after.max(other.decay_after);
        rule.retry_after_max = rule.retry_after_max.max(secs(other.retry_after_max));
        rule.reserve = rule.reserve.max(other.reserve);
        let mut windows: BTreeMap<Duration, u32> =
            rule.quota.iter().map(|q| (q.per, q.limit)).collect();
        for (limit, per) in other.quota {
            let limit = limit.max(1);
            windows
                .entry(secs(per))
                .and_modify(|l| *l = (*l).min(limit))
                .or_insert(limit);
        }
        rule.quota = windows
            .into_iter()
            .map(|(per, limit)| Quota { limit, per })
            .collect();
        rule.block = match (rule.block.take(), other.block) {
            (None, None) => None,
            (Some(b), None) => Some(b),
            (None, Some((min, max, jitter))) => Some(Block {
                min: secs(min),
                max: secs(max),
                jitter,
            }),
            (Some(b), Some((min, max, jitter))) => Some(Block {
                min: b.min.max(secs(min)),
                max: b.max.max(secs(max)),
                jitter: b.jitter.min(jitter),
            }),
        };
    }
    rule
}

/// The keys on which `theirs` differs from `mine`, for the log line.
pub fn differences(mine: &Rule, theirs: &str) -> Vec<&'static str> {
    let Ok(other) = serde_json::from_str::<Keys>(theirs) else {
        return vec!["(unreadable)"];
    };
    let mine = Keys::from(mine);
    let differs = [
        ("rate", mine.interval != other.interval),
        ("burst", mine.burst != other.burst),
        (
            "backoff_factor",
            mine.backoff_factor != other.backoff_factor,
        ),
        ("backoff_max", mine.backoff_max != other.backoff_max),
        ("decay_after", mine.decay_after != other.decay_after),
        (
            "retry_after_max",
            mine.retry_after_max != other.retry_after_max,
        ),
        ("quota", mine.quota != other.quota),
        ("reserve", mine.reserve != other.reserve),
        ("block", mine.block != other.block),
    ];
    differs
        .into_iter()
        .filter_map(|(key, differs)| differs.then_some(key))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::contract;

    #[test]
    fn the_stricter_rule_takes_the_stricter_value_of_every_key() {
        let mine = Rule {
            burst: 3,
            quota: vec![Quota {
                limit: 100,
                per: Duration::from_secs(60),
            }],
            ..contract::rule(20.0)
        };
        let theirs = Rule {
            burst: 1,
            backoff_max: mine.backoff_max * 2.0,
            decay_after: mine.decay_after + 5,
            quota: vec![
                Quota {
                    limit: 50,
                    per: Duration::from_secs(60),
                },
                Quota {
                    limit: 1000,
                    per: Duration::from_secs(3600),
                },
            ],
            reserve: 7,
            block: Some(Block {
                min: Duration::from_secs(10),
                max: Duration::from_secs(600),
                jitter: 0.1,
            }),
            ..contract::rule(40.0)
        };
        let written = Written::of("d", &theirs);
        let rule = stricter(&mine, [written.rule.as_str()]);
        assert_eq!(rule.interval, mine.interval, "the lower rate");
        assert_eq!(rule.burst, 1);
        assert_eq!(rule.backoff_max, theirs.backoff_max);
        assert_eq!(rule.decay_after, theirs.decay_after);
        assert_eq!(rule.reserve, 7);
        assert_eq!(rule.block, theirs.block);
        assert_eq!(
            rule.quota
                .iter()
                .map(|q| (q.limit, q.per.as_secs()))
                .collect::<Vec<_>>(),
            [(50, 60), (1000, 3600)]
        );
        // And the other way round, the same rule.
        let back = stricter(&theirs, [Written::of("d", &mine).rule.as_str()]);
        assert_eq!(Written::of("d", &back), Written::of("d", &rule));
    }

    #[test]
    fn the_same_rule_has_the_same_fingerprint_and_no_differences() {
        let a = Written::of("d", &contract::rule(20.0));
        let b = Written::of("d", &contract::rule(20.0));
        assert_eq!(a, b);
        assert_eq!(a.fingerprint.len(), 12);
        assert!(differences(&contract::rule(20.0), &b.rule).is_empty());
        assert_eq!(
            differences(
                &contract::rule(20.0),
                &Written::of("d", &contract::rule(5.0)).rule
            ),
            ["rate"]
        );
        let c = Written::of("d", &contract::rule(21.0));
        assert_ne!(a.fingerprint, c.fingerprint);
    }
}
