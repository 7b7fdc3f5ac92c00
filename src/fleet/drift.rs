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
//! | `vendor_pace` | `spread` over `burst` |
//! | `block` | present over absent; the longer `min` and `max`, the smaller `jitter` |
//!
//! Class shares and order are not merged: they order requests, they do not pace them. They
//! are part of no fingerprint.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus::IntGaugeVec;
use serde::{Deserialize, Serialize};

use super::{Instance, Membership, Theirs, Written, HEARTBEAT};
use crate::budget::{Rule, KEY_MARK};
use crate::destination::{Block, Quota, VendorPace};

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
    /// `vendor_pace = "spread"`; left out at the default, so that a rule written by a
    /// binary that knew only one way to pace a vendor's budget reads the same where it is
    /// the same.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    vendor_spread: bool,
    /// A meter's own window (limit, seconds); left out where there is none, as above.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    window: Option<(u32, f64)>,
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
            vendor_spread: r.vendor_pace == VendorPace::Spread,
            window: r.window.map(|w| (w.limit, w.per.as_secs_f64())),
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
        if other.vendor_spread {
            rule.vendor_pace = VendorPace::Spread;
        }
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
        if let (Some(w), Some((limit, per))) = (&mut rule.window, other.window) {
            if w.per == secs(per) {
                w.limit = w.limit.min(limit.max(1));
            }
        }
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

/// This instance's side of the comparison: its rules as announced, whether the store holds
/// them, and the destinations whose rule differs on other live instances.
pub struct Agreement {
    mine: Mutex<Arc<Mine>>,
    /// Whether the store holds `mine` (since the last loss of the store).
    written: AtomicBool,
    drifting: Mutex<HashMap<String, Drifting>>,
    /// `pacegate_config_mismatch{destination}`.
    pub(super) gauge: IntGaugeVec,
}

/// This instance's rules, and the same written down, in one order.
#[derive(Default)]
struct Mine {
    rules: Vec<Rule>,
    written: Vec<Written>,
}

/// A destination whose rule differs on other live instances.
struct Drifting {
    /// The stricter rule, which governs this instance's calls to the store.
    governing: Arc<Rule>,
    /// The instances whose rule differs, and their fingerprints.
    theirs: Vec<(String, String)>,
}

impl Agreement {
    /// Nothing announced yet; `gauge` is `pacegate_config_mismatch`.
    pub fn new(gauge: IntGaugeVec) -> Self {
        Self {
            mine: Mutex::default(),
            written: AtomicBool::new(false),
            drifting: Mutex::default(),
            gauge,
        }
    }

    /// This instance's rule for every destination, to be written at the next comparison.
    pub fn announce(&self, rules: &[(String, Rule)]) {
        let mut mine = Mine::default();
        for (dest, rule) in rules {
            self.gauge.with_label_values(&[dest]).set(0);
            mine.written.push(Written::of(dest, rule));
            mine.rules.push(rule.clone());
        }
        *self.mine.lock() = Arc::new(mine);
        self.written.store(false, Ordering::SeqCst);
    }

    /// Every destination announced, with this instance's rule for it.
    pub fn announced(&self) -> Vec<(String, Rule)> {
        let mine = self.mine.lock().clone();
        mine.written
            .iter()
            .map(|w| w.destination.clone())
            .zip(mine.rules.iter().cloned())
            .collect()
    }

    /// The store may no longer hold this instance's rules (it was lost): write them again.
    pub fn unwritten(&self) {
        self.written.store(false, Ordering::SeqCst);
    }

    /// The rule that governs `destination` here: the stricter one while other instances'
    /// configs differ; `None` while they agree. A key's budget (`PARENT#KEY`) is governed by
    /// its parent's keys' rule, announced as `PARENT#`.
    pub fn governing(&self, destination: &str) -> Option<Arc<Rule>> {
        let name = match destination.find(KEY_MARK) {
            Some(i) => &destination[..=i],
            None => destination,
        };
        self.drifting.lock().get(name).map(|d| d.governing.clone())
    }

    /// The live instances whose rule for `destination` differs.
    pub fn differing(&self, destination: &str) -> Vec<String> {
        self.drifting
            .lock()
            .get(destination)
            .map_or_else(Vec::new, |d| {
                d.theirs.iter().map(|(id, _)| id.clone()).collect()
            })
    }

    /// Writes this instance's rules through `fleet` (once per connection to the store) and
    /// reads the live instances' rules that differ: the stricter governs until the configs
    /// agree. A failed comparison is tried again at the next heartbeat; what is known stands.
    pub async fn compare<M: Membership>(&self, fleet: &M, me: &Instance) {
        let mine = self.mine.lock().clone();
        if mine.written.is_empty() {
            return;
        }
        let write = !self.written.load(Ordering::SeqCst);
        let call = fleet.compare_rules(me, &mine.written, write);
        let theirs = match tokio::time::timeout(HEARTBEAT, call).await {
            Ok(Ok(theirs)) => theirs,
            Ok(Err(e)) => {
                return tracing::debug!("cannot compare rules with the other instances: {e}")
            }
            Err(_) => return,
        };
        self.written.store(true, Ordering::SeqCst);
        let mut drifting = self.drifting.lock();
        for (rule, w) in mine.rules.iter().zip(&mine.written) {
            let dest = w.destination.as_str();
            let here: Vec<&Theirs> = theirs.iter().filter(|t| t.destination == dest).collect();
            if here.is_empty() {
                if drifting.remove(dest).is_some() {
                    self.gauge.with_label_values(&[dest]).set(0);
                    tracing::info!(destination = dest, "the instances' rules agree again");
                }
                continue;
            }
            let ids: Vec<(String, String)> = here
                .iter()
                .map(|t| (t.instance.clone(), t.fingerprint.clone()))
                .collect();
            if drifting.get(dest).is_some_and(|d| d.theirs == ids) {
                continue;
            }
            for t in &here {
                tracing::error!(
                    destination = dest,
                    instance = %t.instance,
                    "config mismatch: another instance paces this destination by another rule (fingerprint {} here, {} there; differs in {}): the stricter of each key governs until the configs agree",
                    w.fingerprint,
                    t.fingerprint,
                    differences(rule, &t.rule).join(", "),
                );
            }
            self.gauge.with_label_values(&[dest]).set(1);
            let governing = Arc::new(stricter(rule, here.iter().map(|t| t.rule.as_str())));
            drifting.insert(
                dest.to_owned(),
                Drifting {
                    governing,
                    theirs: ids,
                },
            );
        }
    }
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
        ("vendor_pace", mine.vendor_spread != other.vendor_spread),
        ("window", mine.window != other.window),
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
            window: Some(Quota {
                limit: 20,
                per: Duration::from_secs(1),
            }),
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
            vendor_pace: VendorPace::Spread,
            window: Some(Quota {
                limit: 15,
                per: Duration::from_secs(1),
            }),
            block: Some(Block {
                min: Duration::from_secs(10),
                max: Duration::from_secs(600),
                jitter: 0.1,
            }),
            ..contract::rule(40.0)
        };
        // The default pace is not written: a rule reads as a binary that knew no other wrote it.
        assert!(!Written::of("d", &mine).rule.contains("vendor"));
        let written = Written::of("d", &theirs);
        let rule = stricter(&mine, [written.rule.as_str()]);
        assert_eq!(rule.interval, mine.interval, "the lower rate");
        assert_eq!(rule.burst, 1);
        assert_eq!(rule.backoff_max, theirs.backoff_max);
        assert_eq!(rule.decay_after, theirs.decay_after);
        assert_eq!(rule.reserve, 7);
        assert_eq!(rule.vendor_pace, VendorPace::Spread);
        assert_eq!(rule.block, theirs.block);
        assert_eq!(
            rule.quota
                .iter()
                .map(|q| (q.limit, q.per.as_secs()))
                .collect::<Vec<_>>(),
            [(50, 60), (1000, 3600)]
        );
        assert_eq!(rule.window.map(|w| w.limit), Some(15), "the smaller window");
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
