//! The file model: every key optional, so that defaults are applied (and shown) in one place,
//! and each section deserialised on its own so that every unknown key is reported.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::{Backend, ConfigProblem, OnUnavailable, Statements, Unmatched};
use crate::destination::Quota;

pub(super) fn problem(path: &str, message: impl Into<String>) -> ConfigProblem {
    ConfigProblem {
        path: path.to_owned(),
        message: message.into(),
    }
}

/// A key as a path shows it: bare when TOML would write it bare, quoted otherwise (an empty
/// key, or one with dots or spaces).
pub(super) fn key_name(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare {
        key.to_owned()
    } else {
        format!("{key:?}")
    }
}

/// Deserialises one section, recording its unknown keys and every type error as problems.
///
/// serde stops at the first error, so a key that fails is recorded, taken out, and the section
/// read again: every key is optional, and one bad value must not hide the others' problems.
/// The keys taken out are added to `unreadable`, so that validation does not report them again
/// (as missing, say). `None` only when the section itself is not a table.
pub(super) fn section<T: DeserializeOwned + Default>(
    value: Option<toml::Value>,
    path: &str,
    problems: &mut Vec<ConfigProblem>,
    unreadable: &mut Vec<String>,
) -> Option<T> {
    let Some(mut value) = value else {
        return Some(T::default());
    };
    let join = |sub: &str| {
        if sub.is_empty() || sub == "." {
            path.to_owned()
        } else {
            format!("{path}.{sub}")
        }
    };
    let mut unknown: Vec<String> = Vec::new();
    loop {
        let mut record = |p: serde_ignored::Path<'_>| {
            let key = match p {
                serde_ignored::Path::Root => ".".to_owned(),
                _ => ignored_key(&p),
            };
            if !unknown.contains(&key) {
                unknown.push(key);
            }
        };
        let de = serde_ignored::Deserializer::new(value.clone(), &mut record);
        let result: Result<T, _> = serde_path_to_error::deserialize(de);
        match result {
            Ok(v) => {
                report_unknown(&unknown, &join, problems);
                return Some(v);
            }
            Err(e) => {
                problems.push(problem(&join(&e.path().to_string()), e.inner().to_string()));
                if let Some(key) = remove(&mut value, e.path()) {
                    unreadable.push(join(&key));
                } else {
                    report_unknown(&unknown, &join, problems);
                    return None;
                }
            }
        }
    }
}

/// An unknown key's path within its section, as config paths are written: table keys and
/// indices joined by dots. serde_ignored writes a `?` for each optional value on the way
/// (a group's table sits in an `Option`), which names no key.
fn ignored_key(path: &serde_ignored::Path<'_>) -> String {
    use serde_ignored::Path;
    let (parent, segment) = match path {
        Path::Root => return String::new(),
        Path::Seq { parent, index } => (parent, index.to_string()),
        Path::Map { parent, key } => (parent, key.clone()),
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => return ignored_key(parent),
    };
    match ignored_key(parent) {
        above if above.is_empty() => segment,
        above => format!("{above}.{segment}"),
    }
}

fn report_unknown(
    unknown: &[String],
    join: &dyn Fn(&str) -> String,
    problems: &mut Vec<ConfigProblem>,
) {
    for key in unknown {
        // An empty key (`"" = 1`) is a key all the same, not the section itself.
        let key = if key.is_empty() {
            key_name("")
        } else {
            key.clone()
        };
        problems.push(problem(&join(&key), "unknown key"));
    }
}

/// Takes out of `value` the key an error's path ends at: the last table key on it, so an
/// error inside an array takes the whole array. Returns that key's path within the section,
/// or `None` when the path names no key (the section itself is wrong).
fn remove(value: &mut toml::Value, path: &serde_path_to_error::Path) -> Option<String> {
    use serde_path_to_error::Segment;
    let segments: Vec<&Segment> = path.iter().collect();
    let last_key = segments
        .iter()
        .rposition(|s| matches!(s, Segment::Map { .. }))?;
    let mut at = value;
    let mut taken = String::new();
    for segment in &segments[..last_key] {
        at = match segment {
            Segment::Map { key } => at.get_mut(key.as_str())?,
            Segment::Seq { index } => at.get_mut(*index)?,
            _ => return None,
        };
        taken.push_str(&segment.to_string());
    }
    let Segment::Map { key } = segments[last_key] else {
        return None;
    };
    at.as_table_mut()?.remove(key.as_str())?;
    if !taken.is_empty() {
        taken.push('.');
    }
    taken.push_str(&key_name(key));
    Some(taken)
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawProxy {
    pub(super) listen: Option<String>,
    pub(super) unmatched: Option<Unmatched>,
    pub(super) allow_private_upstreams: Option<bool>,
    #[serde(default, with = "humantime_serde")]
    pub(super) shutdown_grace: Option<Duration>,
    pub(super) threads: Option<usize>,
    pub(super) clients: Option<Vec<String>>,
    pub(super) ports: Option<Vec<RawPort>>,
    pub(super) auth: Option<RawAuth>,
    pub(super) limits: Option<RawLimits>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawAuth {
    pub(super) realm: Option<String>,
    #[serde(default)]
    pub(super) users: Vec<RawUser>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawUser {
    pub(super) name: Option<String>,
    pub(super) password_env: Option<String>,
    pub(super) password_sha256: Option<String>,
    pub(super) classes: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawLimits {
    pub(super) max_connections: Option<usize>,
    pub(super) max_requests: Option<usize>,
    pub(super) max_streams: Option<u32>,
    pub(super) max_header_bytes: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    pub(super) header_read_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) idle_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) ping_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) ping_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) write_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) body_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) handshake_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) tunnel_idle_timeout: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawUpstream {
    #[serde(default, with = "humantime_serde")]
    pub(super) connect_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) response_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) pool_idle_timeout: Option<Duration>,
    pub(super) pool_max_idle_per_host: Option<usize>,
    pub(super) proxy: Option<String>,
    pub(super) no_proxy: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawAdmin {
    pub(super) listen: Option<String>,
    pub(super) token_env: Option<String>,
    pub(super) read_token_env: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawLog {
    pub(super) requests: Option<super::RequestLog>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawStore {
    pub(super) backend: Option<Backend>,
    pub(super) state_file: Option<PathBuf>,
    pub(super) url: Option<String>,
    pub(super) connections: Option<usize>,
    pub(super) statements: Option<Statements>,
    pub(super) ca_file: Option<PathBuf>,
    pub(super) migrate: Option<bool>,
    pub(super) reassert: Option<bool>,
    pub(super) on_unavailable: Option<OnUnavailable>,
    pub(super) instances_hint: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    pub(super) divide_for: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) timeout: Option<Duration>,
}

/// `[cache]`.
#[derive(Debug, Default, Deserialize)]
pub(super) struct RawCache {
    pub(super) memory: Option<RawSize>,
    pub(super) max_object: Option<RawSize>,
    #[serde(default, with = "humantime_serde")]
    pub(super) lead_timeout: Option<Duration>,
    pub(super) dir: Option<PathBuf>,
    pub(super) disk: Option<RawSize>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawTls {
    pub(super) ca_cert: Option<PathBuf>,
    pub(super) ca_key: Option<PathBuf>,
    pub(super) generate_ca: Option<bool>,
    #[serde(default)]
    pub(super) extra_upstream_roots: Vec<PathBuf>,
    #[serde(default, with = "humantime_serde")]
    pub(super) leaf_validity: Option<Duration>,
}

/// `[destinations.NAME]`, and `[destinations.NAME.groups.GROUP]`: a group takes the pacing
/// keys, inheriting what it does not set, plus `paths`, `methods` and `resource`.
#[derive(Debug, Default, Clone, Deserialize)]
pub(super) struct RawDestination {
    pub(super) hosts: Option<Vec<String>>,
    pub(super) rate: Option<f64>,
    pub(super) burst: Option<u32>,
    pub(super) max_concurrency: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    pub(super) max_wait: Option<Duration>,
    pub(super) throttle_statuses: Option<Vec<u16>>,
    pub(super) lockout_statuses: Option<Vec<u16>>,
    pub(super) backoff_factor: Option<f64>,
    pub(super) backoff_max: Option<f64>,
    pub(super) decay_after: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    pub(super) retry_after_max: Option<Duration>,
    pub(super) retry_throttled: Option<u32>,
    pub(super) intercept: Option<bool>,
    pub(super) advertise: Option<bool>,
    pub(super) mode: Option<crate::destination::Mode>,
    pub(super) quota: Option<Vec<Quota>>,
    pub(super) ports: Option<Vec<RawPort>>,
    pub(super) allow_private_upstreams: Option<bool>,
    pub(super) signals: Option<RawSignals>,
    pub(super) reserve: Option<u32>,
    pub(super) vendor_pace: Option<crate::destination::VendorPace>,
    pub(super) throttle_block: Option<RawBlock>,
    pub(super) throttle_body: Option<Vec<String>>,
    pub(super) challenges: Option<Vec<String>>,
    pub(super) challenge_share: Option<f64>,
    pub(super) cache: Option<bool>,
    pub(super) key: Option<String>,
    pub(super) max_keys: Option<usize>,
    pub(super) max_keys_per_client: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    pub(super) key_idle: Option<Duration>,
    pub(super) total_rate: Option<f64>,
    pub(super) groups: Option<BTreeMap<String, RawDestination>>,
    pub(super) paths: Option<Vec<String>>,
    pub(super) methods: Option<Vec<String>>,
    pub(super) resource: Option<String>,
    pub(super) meters: Option<BTreeMap<String, RawMeter>>,
    pub(super) max_body: Option<RawSize>,
}

/// A size: a number of bytes, or a string with a unit (`"4MiB"`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum RawSize {
    Bytes(u64),
    Text(String),
}

/// A meter's `cost`: a setting's name, or a number.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum RawCost {
    Number(i64),
    Text(String),
}

/// `[destinations.NAME.meters.UNIT]`.
#[derive(Debug, Default, Clone, Deserialize)]
pub(super) struct RawMeter {
    pub(super) per_minute: Option<f64>,
    pub(super) rate: Option<f64>,
    pub(super) cost: Option<RawCost>,
    pub(super) default: Option<u64>,
    pub(super) quota: Option<Vec<Quota>>,
}

impl RawDestination {
    /// A group's keys: what it sets, else what its destination sets.
    pub(super) fn inherit(&self, destination: &RawDestination) -> RawDestination {
        macro_rules! or {
            ($($key:ident),*) => {
                RawDestination {
                    $($key: self.$key.clone().or_else(|| destination.$key.clone()),)*
                    ..self.clone()
                }
            };
        }
        or!(
            rate,
            burst,
            max_concurrency,
            max_wait,
            throttle_statuses,
            lockout_statuses,
            backoff_factor,
            backoff_max,
            decay_after,
            retry_after_max,
            retry_throttled,
            advertise,
            mode,
            quota,
            signals,
            reserve,
            vendor_pace,
            throttle_block,
            throttle_body,
            challenges,
            challenge_share,
            cache,
            key,
            max_keys,
            max_keys_per_client,
            key_idle,
            total_rate
        )
    }
}

/// A `ports` entry: a port, or a range written `"8000-8999"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum RawPort {
    Number(i64),
    Text(String),
}

/// `signals = "auto"`, `"none"`, or a list of family names.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum RawSignals {
    One(String),
    List(Vec<String>),
}

#[derive(Debug, Default, Clone, Deserialize)]
pub(super) struct RawBlock {
    #[serde(default, with = "humantime_serde")]
    pub(super) min: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) max: Option<Duration>,
    pub(super) jitter: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawClasses {
    pub(super) order: Option<Vec<String>>,
    pub(super) default: Option<String>,
    pub(super) share: Option<BTreeMap<String, f64>>,
    #[serde(default)]
    pub(super) max_wait: BTreeMap<String, RawDuration>,
}

/// A duration written like `"250ms"`.
#[derive(Debug, Deserialize)]
pub(super) struct RawDuration(#[serde(with = "humantime_serde")] pub(super) Duration);
