//! What the pacer shows: each destination's status and gauges, from what this instance
//! knows (the budget as the shared store's record has it, or as last seen here; its queues,
//! its sends) and the store's last snapshot of
//! what only the store knows (every instance's waiting requests, quota windows, a budget
//! changed by another instance). A scrape of `/metrics` reads no store; status takes a
//! snapshot at most once a second, one statement for every destination.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::lane::StoreSaid;
use super::lane::{self, Lane};
use super::Pacer;
use crate::budget::{BudgetView, PauseCause, Rule, KEY_MARK};
use crate::destination::VendorPace;
use crate::metrics::labels;
use crate::status::{
    ChallengeStatus, ClassStatus, DestinationStatus, KeyStatus, KeysStatus, LockStatus,
    QuotaStatus, VendorStatus, TOP_KEYS,
};

/// The oldest snapshot of the store that status shows: at most one statement a second,
/// whatever the number of destinations and of readers.
pub(super) const SNAPSHOT_FRESH: Duration = Duration::from_secs(1);

/// How often the snapshot the gauges read is renewed while nobody reads status.
pub(super) const SNAPSHOT_EVERY: Duration = Duration::from_secs(5);

impl Pacer {
    /// Each destination's effective rate and achieved rate (last 10 s) as this instance last
    /// saw them, without asking the store: cheap enough to sample on a timer.
    pub fn paces(&self) -> Vec<(String, f64, f64)> {
        let now = Instant::now();
        self.lanes()
            .iter()
            .map(|lane| {
                let backoff = lane.seen.lock().backoff;
                let achieved = lane.tally.sends.lock().all.rate(now, 10);
                (
                    lane.name.to_string(),
                    lane.keys().pace.rate / backoff,
                    achieved,
                )
            })
            .collect()
    }

    /// Every destination's status, from what this instance knows and the store's snapshot
    /// of at most a second ago (one statement for every destination), refreshing
    /// the per-destination gauges on the way.
    pub async fn status(&self) -> Vec<DestinationStatus> {
        self.refresh(SNAPSHOT_FRESH).await;
        self.statuses()
    }

    /// Sets every per-destination gauge from what this instance knows and the store's last
    /// snapshot, without asking the store: what a scrape of `/metrics` does.
    pub fn gauges(&self) {
        self.statuses();
    }

    /// Takes the store's snapshot of every destination, unless the last one is younger than
    /// `fresh`: one statement, whatever the number of destinations. Callers at once share
    /// one. A store that cannot say leaves each destination's own view, and this instance's
    /// waiting requests stand for every instance's.
    pub(super) async fn refresh(&self, fresh: Duration) {
        let mut taken = self.snapshot_taken.lock().await;
        if taken.is_some_and(|t| t.elapsed() < fresh) {
            return;
        }
        let lanes = self.lanes();
        let keys: Vec<_> = lanes.iter().map(|l| l.keys()).collect();
        let asked: Vec<(&str, &Rule)> = lanes
            .iter()
            .zip(&keys)
            .map(|(l, k)| (&*l.name, &k.rule))
            .collect();
        match self.store.snapshot(&asked).await {
            Ok(snapshots) => {
                for (lane, s) in lanes.iter().zip(snapshots) {
                    lane.note(s.view);
                    *lane.store_said().lock() = StoreSaid {
                        waiting: Some(s.waiting),
                        quota_used: s.quota_used,
                    };
                }
            }
            Err(e) => {
                tracing::debug!("store snapshot for status: {e}");
                for lane in &lanes {
                    lane.store_said().lock().waiting = None;
                }
            }
        }
        *taken = Some(Instant::now());
    }

    /// Keeps the store's snapshot at most 5 s old while nobody asks for status, until the
    /// pacer stops. The gauges are set from it when they are scraped, not here.
    pub(super) async fn keep_current(self: Arc<Self>) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(SNAPSHOT_EVERY) => {}
                () = self.stop.cancelled() => return,
            }
            self.refresh(SNAPSHOT_EVERY).await;
        }
    }

    /// Every destination's status from what this instance knows and the store said last.
    fn statuses(&self) -> Vec<DestinationStatus> {
        let mut out = Vec::new();
        let now = Instant::now();
        for lane in self.lanes() {
            let seen = self.known(&lane);
            let said = lane.store_said().lock().clone();
            // Every instance's waiting requests; this instance's own when the store cannot
            // say (it is unreachable).
            let everywhere = said.waiting;
            let here = lane.waiting_here(now);
            let classes: Vec<ClassStatus> = {
                let sends = lane.tally.sends.lock();
                self.classes
                    .all()
                    .zip(&here)
                    .map(|(class, &(waiting_here, oldest_here))| {
                        let all = everywhere
                            .as_ref()
                            .and_then(|e| e.iter().find(|w| w.0 == class));
                        ClassStatus {
                            class: self.classes.name(class).to_owned(),
                            waiting_here,
                            waiting: all.map_or(waiting_here, |w| w.1 as usize),
                            oldest_wait_seconds: all
                                .map_or(oldest_here, |w| w.2.max(oldest_here))
                                .as_secs_f64(),
                            granted_last_minute: sends
                                .by_class
                                .get(usize::from(class.0))
                                .map_or(0, |g| g.count(now, 60)),
                        }
                    })
                    .collect()
            };
            let waiting: usize = here.iter().map(|h| h.0).sum();
            let oldest = here.iter().map(|h| h.1).max().unwrap_or_default();
            let keys = lane.keys();
            let used = said.quota_used;
            let quota = keys
                .rule
                .quota
                .iter()
                .enumerate()
                .map(|(i, q)| QuotaStatus {
                    window: humantime::format_duration(q.per).to_string(),
                    limit: q.limit,
                    used: used.get(i).copied().unwrap_or(0),
                })
                .collect();
            let (rate_10, rate_60) = {
                let sends = lane.tally.sends.lock();
                (sends.all.rate(now, 10), sends.all.rate(now, 60))
            };
            let mut s = DestinationStatus {
                destination: lane.name.to_string(),
                unit: lane.unit().map(ToString::to_string),
                rate: keys.pace.rate,
                effective_rate: keys.pace.rate / seen.backoff,
                backoff: seen.backoff,
                achieved_rate_10s: rate_10,
                achieved_rate_60s: rate_60,
                clean_streak: seen.clean_streak,
                paused_for_seconds: seen.paused_for.as_secs_f64(),
                paused_until: (!seen.paused_for.is_zero()).then(|| {
                    humantime::format_rfc3339_seconds(SystemTime::now() + seen.paused_for)
                        .to_string()
                }),
                lock: seen.lock.as_ref().map(LockStatus::from),
                waiting: lane.tally.admitting.load(Ordering::Relaxed).max(waiting),
                in_flight: lane.tally.in_flight.load(Ordering::Relaxed),
                oldest_wait_seconds: oldest.as_secs_f64(),
                classes,
                quota,
                pace_limited_by: limited_by(&seen, &keys.rule).to_owned(),
                block_streak: seen.block_streak,
                vendor: seen.vendor.map(|v| VendorStatus {
                    family: v.family.as_str().to_owned(),
                    remaining: v.remaining,
                    limit: v.limit,
                    reset_in_seconds: v.reset_in.as_secs_f64(),
                }),
                config_mismatch: self.mismatched(&lane),
                mode: keys.pace.mode.as_str().to_owned(),
                max_wait_seconds: keys.pace.max_wait.as_secs_f64(),
                keys: self.keys_status(&lane, now),
                challenges: challenge_status(&lane),
                // What the cache saved is the proxy's to say (`collapse::Collapser::status`).
                cache: None,
            };
            // A split budget's requests wait in its keys' queues.
            if let Some(top) = s.keys.as_ref().and_then(|k| k.top.first()) {
                s.oldest_wait_seconds = s.oldest_wait_seconds.max(top.oldest_wait_seconds);
            }
            self.metrics.set_destination(&s, seen.paused_for);
            out.push(s);
        }
        out.sort_by(|a, b| a.destination.cmp(&b.destination));
        out
    }
}

impl Pacer {
    /// `lane`'s budget as this instance knows it: the shared store's record of its answers
    /// ([`crate::budget::Known`], which the heartbeat's read-back keeps current even for a
    /// budget this instance has not paced on lately), where the store keeps one; else the
    /// lane's own view, which a store of this instance alone answers at once.
    fn known(&self, lane: &Lane) -> BudgetView {
        self.store
            .known()
            .and_then(|known| known.view(&lane.name))
            .unwrap_or_else(|| lane.seen.lock().clone())
    }

    /// The live instances whose rule for the budget differs, or for its keys (`NAME#`).
    fn mismatched(&self, lane: &Lane) -> Vec<String> {
        let mut theirs = self.fleet.drift(&lane.name);
        for id in self.fleet.drift(&format!("{}{KEY_MARK}", lane.name)) {
            if !theirs.contains(&id) {
                theirs.push(id);
            }
        }
        theirs
    }

    /// A budget split by key: its keys here, the most limited first, and their gauges.
    fn keys_status(&self, lane: &Lane, now: Instant) -> Option<KeysStatus> {
        let keys = lane.keys();
        let key_lanes = lane.key_lanes();
        if keys.pace.key.is_none() && key_lanes.is_empty() {
            return None;
        }
        let mut top: Vec<KeyStatus> = key_lanes
            .iter()
            .map(|k| {
                let here = k.waiting_here(now);
                let seen = k.seen.lock();
                KeyStatus {
                    key: k.key_name().unwrap_or_default().to_owned(),
                    waiting: here.iter().map(|h| h.0).sum(),
                    oldest_wait_seconds: here
                        .iter()
                        .map(|h| h.1)
                        .max()
                        .unwrap_or_default()
                        .as_secs_f64(),
                    backoff: seen.backoff,
                    paused_for_seconds: seen.paused_for.as_secs_f64(),
                    idle_seconds: k.unused_for().as_secs_f64(),
                }
            })
            .collect();
        let label = labels(lane.label());
        self.metrics
            .keys
            .with_label_values(&label)
            .set(top.len() as f64);
        let longest = top
            .iter()
            .map(|k| k.oldest_wait_seconds)
            .fold(0.0, f64::max);
        self.metrics
            .key_wait_max
            .with_label_values(&label)
            .set(longest);
        let rank = |k: &KeyStatus| {
            (
                std::cmp::Reverse(ordered(k.oldest_wait_seconds)),
                std::cmp::Reverse(k.waiting),
                std::cmp::Reverse(ordered(k.backoff + k.paused_for_seconds)),
                ordered(k.idle_seconds),
            )
        };
        let cut = TOP_KEYS.min(top.len());
        if cut > 0 {
            top.select_nth_unstable_by_key(cut - 1, rank);
            top.truncate(cut);
            top.sort_by_key(rank);
        }
        Some(KeysStatus {
            key: keys
                .pace
                .key
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            live: key_lanes.len(),
            max_keys: keys.pace.max_keys,
            top,
        })
    }
}

/// A budget's challenges, where any came since the start.
fn challenge_status(lane: &Lane) -> Option<ChallengeStatus> {
    let c = lane.challenges()?;
    let by_vendor: std::collections::BTreeMap<String, u64> = c
        .by_wall()
        .into_iter()
        .map(|(w, n)| (w.as_str().to_owned(), n))
        .collect();
    if by_vendor.is_empty() {
        return None;
    }
    let (responses_5m, last_5m) = c.window(lane::now_ms());
    Some(ChallengeStatus {
        last_5m,
        responses_5m,
        by_vendor,
    })
}

/// A non-negative, finite `f64` as a key that sorts like it (in microseconds).
fn ordered(x: f64) -> u64 {
    (x * 1e6) as u64
}

/// Why a destination's pace is what it is (see [`DestinationStatus::pace_limited_by`]).
fn limited_by(seen: &BudgetView, rule: &Rule) -> &'static str {
    if seen.lock.is_some() {
        return "locked";
    }
    if !seen.paused_for.is_zero() {
        return match seen.paused_by {
            Some(PauseCause::Block) => "paused: block",
            Some(PauseCause::Exhausted) => "paused: exhausted",
            _ => "paused: retry-after",
        };
    }
    let configured = rule.interval.mul_f64(seen.backoff);
    if let Some(v) = seen.vendor {
        // Spent at the rate, what is left sets the pace only once it is spent.
        let usable = v.remaining.saturating_sub(u64::from(rule.reserve));
        let spread = rule.vendor_pace == VendorPace::Spread
            && v.reset_in / u32::try_from(usable).unwrap_or(u32::MAX) > configured;
        if usable == 0 || spread {
            return "vendor budget";
        }
    }
    if seen.backoff > 1.0 {
        "backoff"
    } else {
        "configured"
    }
}
