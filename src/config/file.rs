//! The file model: every key optional, so that defaults are applied (and shown) in one place,
//! and each section deserialised on its own so that every unknown key is reported.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::{Backend, ConfigProblem, OnUnavailable, Unmatched};
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

/// Deserialises one section, recording its unknown keys and its first type error as problems.
pub(super) fn section<T: DeserializeOwned + Default>(
    value: Option<toml::Value>,
    path: &str,
    problems: &mut Vec<ConfigProblem>,
) -> Option<T> {
    let Some(value) = value else {
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
    let mut record = |p: serde_ignored::Path<'_>| unknown.push(p.to_string());
    let de = serde_ignored::Deserializer::new(value, &mut record);
    let result: Result<T, _> = serde_path_to_error::deserialize(de);
    for key in unknown {
        // An empty key (`"" = 1`) is a key all the same, not the section itself.
        let key = if key.is_empty() { key_name("") } else { key };
        problems.push(problem(&join(&key), "unknown key"));
    }
    match result {
        Ok(v) => Some(v),
        Err(e) => {
            problems.push(problem(&join(&e.path().to_string()), e.inner().to_string()));
            None
        }
    }
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RawProxy {
    pub(super) listen: Option<String>,
    pub(super) unmatched: Option<Unmatched>,
    pub(super) allow_private_upstreams: Option<bool>,
    #[serde(default, with = "humantime_serde")]
    pub(super) shutdown_grace: Option<Duration>,
    pub(super) threads: Option<usize>,
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
    pub(super) max_header_bytes: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    pub(super) header_read_timeout: Option<Duration>,
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
    pub(super) ca_file: Option<PathBuf>,
    pub(super) migrate: Option<bool>,
    pub(super) on_unavailable: Option<OnUnavailable>,
    pub(super) instances_hint: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    pub(super) divide_for: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) timeout: Option<Duration>,
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

#[derive(Debug, Default, Deserialize)]
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
    pub(super) mode: Option<crate::destination::Mode>,
    pub(super) quota: Option<Vec<Quota>>,
    pub(super) ports: Option<Vec<u16>>,
    pub(super) signals: Option<RawSignals>,
    pub(super) reserve: Option<u32>,
    pub(super) throttle_block: Option<RawBlock>,
    pub(super) throttle_body: Option<Vec<String>>,
}

/// `signals = "auto"`, `"none"`, or a list of family names.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum RawSignals {
    One(String),
    List(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
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
