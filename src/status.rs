//! What `/status`, `pacegate status` and the metrics show: the status types, and their
//! rendering as tables. A leaf: it imports nothing else of pacegate, so the pacer, the
//! metrics, the admin listener and the command line can all use it.

use serde::{Deserialize, Serialize};

/// One destination's state for `/status` and `pacegate status`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DestinationStatus {
    /// Destination name.
    pub destination: String,
    /// A meter's budget (`NAME~UNIT`): its unit, in which `rate` and `effective_rate` are
    /// counted a second (the achieved rates count its slots, one a request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    /// Configured `rate` (requests per second; a meter's units per second).
    pub rate: f64,
    /// `rate / backoff`.
    pub effective_rate: f64,
    /// Interval multiplier.
    pub backoff: f64,
    /// Sends per second over the last 10 s.
    pub achieved_rate_10s: f64,
    /// Sends per second over the last 60 s.
    pub achieved_rate_60s: f64,
    /// Clean responses in a row.
    pub clean_streak: u32,
    /// Seconds left in a pause (0 when none); `pace_limited_by` says which.
    pub paused_for_seconds: f64,
    /// When the pause ends (RFC 3339), if paused.
    pub paused_until: Option<String>,
    /// The lockout, when locked.
    pub lock: Option<LockStatus>,
    /// Requests waiting for a slot.
    pub waiting: usize,
    /// Requests admitted and not finished.
    pub in_flight: usize,
    /// Seconds the oldest waiting request has waited.
    pub oldest_wait_seconds: f64,
    /// Per class, most urgent first.
    #[serde(default)]
    pub classes: Vec<ClassStatus>,
    /// Quota windows, as configured.
    #[serde(default)]
    pub quota: Vec<QuotaStatus>,
    /// Why the pace is what it is: `configured`, `backoff`, `vendor budget`,
    /// `paused: retry-after`, `paused: block`, `paused: exhausted` or `locked`.
    #[serde(default)]
    pub pace_limited_by: String,
    /// Throttles in a row that blocked the destination.
    #[serde(default)]
    pub block_streak: u32,
    /// What the vendor last said about its budget, while its window lasts.
    #[serde(default)]
    pub vendor: Option<VendorStatus>,
    /// Live instances whose rule for this destination differs from this one's: until the
    /// configs agree, the stricter of each key governs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub config_mismatch: Vec<String>,
    /// The destination's `max_wait`, in seconds.
    #[serde(default)]
    pub max_wait_seconds: f64,
    /// `shadow` while the destination's pace is only computed and counted, else `enforce`.
    #[serde(default = "enforce")]
    pub mode: String,
    /// A budget split by key: how many keys this instance keeps now, and the most limited
    /// of them (see [`KeysStatus`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<KeysStatus>,
    /// Bot walls' challenges on this instance, where any came (see [`ChallengeStatus`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub challenges: Option<ChallengeStatus>,
    /// What `[cache]` saved this destination on this instance, where it looked any request
    /// up (see [`CacheStatus`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheStatus>,
}

/// A destination's kept and collapsed responses on this instance, since it started.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CacheStatus {
    /// GET and HEAD requests that looked for a kept response.
    pub requests: u64,
    /// Answered from a fresh kept response.
    pub hits: u64,
    /// Given the response of an identical request in flight.
    pub collapsed: u64,
    /// Requests that took no slot: `hits` and `collapsed`.
    pub slots_saved: u64,
    /// `slots_saved` of `requests`, from 0 to 1.
    pub hit_ratio: f64,
}

/// A budget's bot-wall challenges on this instance.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChallengeStatus {
    /// Challenges over the last 5 minutes.
    pub last_5m: u32,
    /// Responses over the last 5 minutes, the challenges among them.
    pub responses_5m: u32,
    /// Challenges since the start, by product (`cloudflare`, `aws-waf`, ...).
    pub by_vendor: std::collections::BTreeMap<String, u64>,
}

/// The keys of a budget split by key, on this instance.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct KeysStatus {
    /// `host`, `proxy-user` or `header:NAME`.
    pub key: String,
    /// Keys kept now.
    pub live: usize,
    /// The `max_keys` bound.
    pub max_keys: usize,
    /// The [`TOP_KEYS`] most limited keys: the longest waits first, then the most waiting,
    /// then the widest backoff, then the latest used.
    pub top: Vec<KeyStatus>,
}

/// How many keys status shows of a budget split by key.
pub const TOP_KEYS: usize = 20;

/// One key of a budget split by key. A key taken from a credential shows as its keyed hash.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct KeyStatus {
    /// The key: a host, or 16 hex digits of a credential's keyed hash.
    pub key: String,
    /// Requests waiting for a slot here.
    pub waiting: usize,
    /// Seconds the oldest of them has waited.
    pub oldest_wait_seconds: f64,
    /// Its backoff, as last seen.
    pub backoff: f64,
    /// Seconds left in its pause (0 when none).
    pub paused_for_seconds: f64,
    /// Seconds since a request last took it.
    pub idle_seconds: f64,
}

/// The vendor's budget as the store holds it, for status.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct VendorStatus {
    /// The header family it was read from.
    pub family: String,
    /// Requests left (less the slots taken since it was said).
    pub remaining: u64,
    /// The window's limit, where given.
    pub limit: Option<u64>,
    /// Seconds until the window resets.
    pub reset_in_seconds: f64,
}

/// Every value of [`DestinationStatus::pace_limited_by`].
pub const PACE_LIMITS: [&str; 7] = [
    "configured",
    "backoff",
    "vendor budget",
    "paused: retry-after",
    "paused: block",
    "paused: exhausted",
    "locked",
];

/// One class of one destination, for status.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClassStatus {
    /// Class name.
    pub class: String,
    /// Requests of this class waiting on every instance (this one's when the store cannot
    /// say).
    pub waiting: usize,
    /// Requests of this class waiting on this instance.
    pub waiting_here: usize,
    /// Seconds the oldest of them has waited, on any instance.
    pub oldest_wait_seconds: f64,
    /// Slots this instance granted to the class over the last minute.
    pub granted_last_minute: u64,
}

/// One quota window of one destination, for status.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct QuotaStatus {
    /// The window's length (`1m`, `1day`).
    pub window: String,
    /// Sends allowed in it (a meter's: units).
    pub limit: u32,
    /// Slots taken in the last window, over every instance (a meter's: units).
    pub used: u32,
}

/// A lockout as status shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LockStatus {
    /// When (RFC 3339).
    pub since: String,
    /// The upstream status.
    pub status: u16,
    /// The request that caused it.
    pub request: String,
    /// The instance that saw it.
    pub instance: String,
}

/// A live instance sharing the store, as `pacegate status` lists it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct InstanceStatus {
    /// Unique per process start.
    pub id: String,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: i32,
    /// pacegate version.
    pub version: String,
    /// When it started (RFC 3339).
    pub started: String,
    /// Seconds since its last heartbeat.
    pub last_seen_seconds_ago: f64,
}

/// One budget as the shared store holds it, for `pacegate status --store URL`.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetStatus {
    /// Destination name.
    pub destination: String,
    /// Interval multiplier.
    pub backoff: f64,
    /// Clean responses in a row.
    pub clean_streak: u32,
    /// Seconds left in a pause (0 when none).
    pub paused_for_seconds: f64,
    /// The lockout, when locked.
    pub lock: Option<LockStatus>,
}

/// The live instances as a table.
pub fn instances_table(rows: &[InstanceStatus]) -> String {
    let mut out = format!(
        "{:<40}  {:<20}  {:>7}  {:<8}  {:<20}  {}\n",
        "INSTANCE", "HOST", "PID", "VERSION", "STARTED", "LAST SEEN"
    );
    for i in rows {
        out.push_str(&format!(
            "{:<40}  {:<20}  {:>7}  {:<8}  {:<20}  {:.1}s ago\n",
            i.id, i.host, i.pid, i.version, i.started, i.last_seen_seconds_ago
        ));
    }
    out
}

/// `pacegate status` as a table: one line per destination, then (with more than one class)
/// one per destination and class.
fn enforce() -> String {
    "enforce".into()
}

/// A meter's unit as a rate shows it (` tokens`), nothing for requests.
fn unit_of(r: &DestinationStatus) -> String {
    r.unit
        .as_ref()
        .map_or_else(String::new, |u| format!(" {u}"))
}

pub fn status_table(rows: &[DestinationStatus]) -> String {
    let mut lines = vec![[
        "DESTINATION",
        "RATE",
        "EFFECTIVE",
        "BACKOFF",
        "ACHIEVED 10s/60s",
        "STREAK",
        "PAUSED",
        "WAITING",
        "IN FLIGHT",
        "OLDEST WAIT",
        "QUOTA USED",
        "VENDOR",
        "LIMITED BY",
        "LOCKOUT",
    ]
    .map(String::from)
    .to_vec()];
    for r in rows {
        let quota: Vec<String> = r
            .quota
            .iter()
            .map(|q| format!("{}/{}{} per {}", q.used, q.limit, unit_of(r), q.window))
            .collect();
        lines.push(vec![
            if r.mode == "shadow" {
                format!("{} (shadow)", r.destination)
            } else {
                r.destination.clone()
            },
            format!("{}{}/s", r.rate, unit_of(r)),
            format!("{:.3}{}/s", r.effective_rate, unit_of(r)),
            format!("x{}", r.backoff),
            format!("{:.2} / {:.2}", r.achieved_rate_10s, r.achieved_rate_60s),
            r.clean_streak.to_string(),
            if r.paused_for_seconds > 0.0 {
                format!("{:.1}s", r.paused_for_seconds)
            } else {
                "-".into()
            },
            r.waiting.to_string(),
            r.in_flight.to_string(),
            format!("{:.1}s", r.oldest_wait_seconds),
            if quota.is_empty() {
                "-".into()
            } else {
                quota.join(", ")
            },
            r.vendor.as_ref().map_or_else(
                || "-".into(),
                |v| {
                    let limit = v.limit.map_or(String::new(), |l| format!("/{l}"));
                    format!(
                        "{}{limit} left, reset in {:.0}s ({})",
                        v.remaining, v.reset_in_seconds, v.family
                    )
                },
            ),
            if r.block_streak > 0 {
                format!("{} (block streak {})", r.pace_limited_by, r.block_streak)
            } else {
                r.pace_limited_by.clone()
            },
            lock_cell(r.lock.as_ref(), &r.destination),
        ]);
    }
    let mut out = aligned(&lines);
    for r in rows.iter().filter(|r| r.mode == "shadow") {
        out.push_str(&format!(
            "{}: SHADOW MODE: requests go at once; what pacing would do is counted (pacegate_shadow_*)\n",
            r.destination
        ));
    }
    for r in rows {
        let Some(c) = &r.challenges else { continue };
        let by: Vec<String> = c
            .by_vendor
            .iter()
            .map(|(v, n)| format!("{v} {n}"))
            .collect();
        out.push_str(&format!(
            "{}: BOT WALL: {} of {} responses in 5 min were challenges ({} since the start): the vendor sees pacegate's TLS fingerprint; set intercept = false for it, or have the egress IP allow-listed\n",
            r.destination,
            c.last_5m,
            c.responses_5m,
            by.join(", ")
        ));
    }
    for r in rows {
        let Some(c) = &r.cache else { continue };
        out.push_str(&format!(
            "{}: CACHE: {:.0}% of {} requests took no slot ({} saved: {} hits, {} collapsed)\n",
            r.destination,
            c.hit_ratio * 100.0,
            c.requests,
            c.slots_saved,
            c.hits,
            c.collapsed
        ));
    }
    for r in rows.iter().filter(|r| !r.config_mismatch.is_empty()) {
        out.push_str(&format!(
            "{}: CONFIG MISMATCH with {}: the stricter rule governs until the configs agree\n",
            r.destination,
            r.config_mismatch.join(", ")
        ));
    }
    if rows.iter().any(|r| r.keys.is_some()) {
        let mut lines = vec![[
            "DESTINATION",
            "KEY",
            "WAITING",
            "OLDEST WAIT",
            "BACKOFF",
            "PAUSED",
            "IDLE",
        ]
        .map(String::from)
        .to_vec()];
        for r in rows {
            let Some(keys) = &r.keys else { continue };
            out.push_str(&format!(
                "{}: split by {}: {} of at most {} keys here; the most limited:\n",
                r.destination, keys.key, keys.live, keys.max_keys
            ));
            for k in &keys.top {
                lines.push(vec![
                    r.destination.clone(),
                    k.key.clone(),
                    k.waiting.to_string(),
                    format!("{:.1}s", k.oldest_wait_seconds),
                    format!("x{}", k.backoff),
                    format!("{:.1}s", k.paused_for_seconds),
                    format!("{:.0}s", k.idle_seconds),
                ]);
            }
        }
        out.push('\n');
        out.push_str(&aligned(&lines));
    }
    if rows.iter().any(|r| r.classes.len() > 1) {
        let mut lines = vec![[
            "DESTINATION",
            "CLASS",
            "WAITING ALL/HERE",
            "OLDEST WAIT",
            "GRANTED LAST MIN (HERE)",
        ]
        .map(String::from)
        .to_vec()];
        for r in rows {
            for c in &r.classes {
                lines.push(vec![
                    r.destination.clone(),
                    c.class.clone(),
                    format!("{} / {}", c.waiting, c.waiting_here),
                    format!("{:.1}s", c.oldest_wait_seconds),
                    c.granted_last_minute.to_string(),
                ]);
            }
        }
        out.push('\n');
        out.push_str(&aligned(&lines));
    }
    out
}

/// Rows of cells as left-aligned columns.
fn aligned(lines: &[Vec<String>]) -> String {
    let columns = lines.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..columns)
        .map(|c| lines.iter().map(|l| l[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for l in lines {
        let cells: Vec<String> = l
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// The shared store's budgets as a table (`pacegate status --store URL`).
pub fn budgets_table(rows: &[BudgetStatus]) -> String {
    let mut out = format!(
        "{:<24}  {:>8}  {:>6}  {:>8}  LOCKOUT\n",
        "DESTINATION", "BACKOFF", "STREAK", "PAUSED"
    );
    for b in rows {
        let paused = if b.paused_for_seconds > 0.0 {
            format!("{:.1}s", b.paused_for_seconds)
        } else {
            "-".to_owned()
        };
        out.push_str(&format!(
            "{:<24}  {:>8}  {:>6}  {paused:>8}  {}\n",
            b.destination,
            format!("x{}", b.backoff),
            b.clean_streak,
            lock_cell(b.lock.as_ref(), &b.destination),
        ));
    }
    out
}

/// A lockout in a table cell, with the command that clears it.
fn lock_cell(lock: Option<&LockStatus>, destination: &str) -> String {
    lock.map_or("-".into(), |l| {
        format!(
            "LOCKED since {} by {} to {} (pacegate unlock {destination})",
            l.since, l.status, l.request
        )
    })
}
