//! Hot reload: the config file is read again (SIGHUP, or `POST /reload` on the admin
//! listener) and what can change in place does, without a restart and without touching a
//! budget, a waiting request or a connection.
//!
//! In place: the destinations (added, removed, changed: see `Pacer::reconfigure`),
//! `[proxy] unmatched`, `[proxy.auth]` and `[log]`. Everything else (listen addresses, the
//! store, TLS, upstream, limits, classes) needs a restart: a reload that changes it says so
//! in the log, key by key, and keeps the running value. An invalid file changes nothing.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::{Config, ConfigError};
use crate::metrics::Metrics;
use crate::pacing::{Changes, Pacer};
use crate::proxy::{ClientPolicy, Proxy};

/// How the last reload went: `GET /reload` on the admin listener.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ReloadStatus {
    /// `ok` or `error`.
    pub result: String,
    /// When (RFC 3339).
    pub at: String,
    /// Why the file was refused, one `key.path: message` each; empty when it was taken.
    #[serde(default)]
    pub problems: Vec<String>,
    /// The keys that changed and were applied.
    #[serde(default)]
    pub applied: Vec<String>,
    /// The keys that changed in the file but need a restart; the running values are kept.
    #[serde(default)]
    pub needs_restart: Vec<String>,
    /// The destinations added, removed and changed.
    #[serde(default)]
    pub destinations: Changes,
}

/// Re-reads one config file and applies it to a running pacegate.
pub struct Reloader {
    path: PathBuf,
    /// The config in force; the lock also keeps two reloads from interleaving.
    running: tokio::sync::Mutex<Config>,
    pacer: Arc<Pacer>,
    proxy: Proxy,
    metrics: Arc<Metrics>,
    last: parking_lot::Mutex<Option<ReloadStatus>>,
}

impl Reloader {
    /// A reloader for `config`, read from `path`, running in `pacer` and `proxy`.
    pub fn new(
        path: PathBuf,
        config: Config,
        pacer: Arc<Pacer>,
        proxy: Proxy,
        metrics: Arc<Metrics>,
    ) -> Self {
        metrics.config_last_reload_successful.set(1);
        Self {
            path,
            running: tokio::sync::Mutex::new(config),
            pacer,
            proxy,
            metrics,
            last: parking_lot::Mutex::new(None),
        }
    }

    /// How the last reload went, if there was one.
    pub fn last(&self) -> Option<ReloadStatus> {
        self.last.lock().clone()
    }

    /// The config in force, normalised, passwords not shown ([`redacted`]).
    pub async fn running(&self) -> String {
        toml::to_string_pretty(&redacted(&*self.running.lock().await)).unwrap_or_default()
    }

    /// Reads the file again and applies what it changes; logs and counts the result.
    pub async fn reload(&self) -> ReloadStatus {
        let status = match Config::load(&self.path) {
            Err(e) => self.refused(e),
            Ok(new) => self.apply(new).await,
        };
        let ok = status.result == "ok";
        self.metrics
            .config_reloads
            .with_label_values(&[if ok { "ok" } else { "error" }])
            .inc();
        self.metrics
            .config_last_reload_successful
            .set(i64::from(ok));
        *self.last.lock() = Some(status.clone());
        status
    }

    fn refused(&self, e: ConfigError) -> ReloadStatus {
        let problems: Vec<String> = match &e {
            ConfigError::Invalid { problems, .. } => {
                problems.iter().map(ToString::to_string).collect()
            }
            ConfigError::Read { .. } => vec![format!("(file): {e}")],
        };
        for p in &problems {
            tracing::error!(file = %self.path.display(), problem = %p, "reload refused; the running config stays in force");
        }
        ReloadStatus {
            result: "error".into(),
            at: now(),
            problems,
            ..ReloadStatus::default()
        }
    }

    async fn apply(&self, new: Config) -> ReloadStatus {
        let mut running = self.running.lock().await;
        let changed = differences(&comparable(&running), &comparable(&new));
        let (applied, needs_restart): (Vec<String>, Vec<String>) =
            changed.into_iter().partition(|k| in_place(k));
        for key in &needs_restart {
            tracing::warn!(key = %key, "changed in the config file, but takes a restart: the running value is kept");
        }
        // The cache first: a new `dir` it cannot write refuses the reload before anything
        // else changes.
        let cache_changed = applied.iter().any(|k| k.starts_with("cache."));
        if let (true, Some(collapse), Some(cache)) =
            (cache_changed, self.proxy.collapser(), &new.cache)
        {
            if let Err(e) = collapse.reconfigure(cache) {
                return refused_at_apply(format!("(cache): {e}"));
            }
            running.cache = new.cache.clone();
        }
        let destinations = match self.pacer.reconfigure(&new.destinations).await {
            Ok(changes) => changes,
            Err(e) => {
                return refused_at_apply(format!(
                    "(store): cannot load a new destination's budget: {e}"
                ));
            }
        };
        // What a restart would take stays as it runs; the rest is the file's.
        running.destinations = new.destinations;
        running.proxy.unmatched = new.proxy.unmatched;
        running.proxy.auth = new.proxy.auth;
        running.log = new.log;
        self.proxy.set_policy(ClientPolicy::of(&running));
        self.proxy.set_private_hosts(&running.destinations);
        tracing::info!(
            applied = ?applied,
            added = ?destinations.added,
            removed = ?destinations.removed,
            changed = ?destinations.changed,
            needs_restart = needs_restart.len(),
            "config reloaded"
        );
        ReloadStatus {
            result: "ok".into(),
            at: now(),
            problems: Vec::new(),
            applied,
            needs_restart,
            destinations,
        }
    }
}

/// A valid config that could not be applied: `problem` logged and said, the running config
/// kept.
fn refused_at_apply(problem: String) -> ReloadStatus {
    tracing::error!("reload refused: {problem}");
    ReloadStatus {
        result: "error".into(),
        at: now(),
        problems: vec![problem],
        ..ReloadStatus::default()
    }
}

fn now() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// Whether a reload applies a changed key in place.
pub fn in_place(key: &str) -> bool {
    let under = |section: &str| {
        key == section
            || key
                .strip_prefix(section)
                .is_some_and(|rest| rest.starts_with('.'))
    };
    under("destinations")
        || under("proxy.auth")
        || under("proxy.unmatched")
        || under("proxy.ports")
        || under("log")
        // Each key of a `[cache]` that runs; the section itself, added or removed, takes a
        // restart.
        || under("cache.memory")
        || under("cache.max_object")
        || under("cache.lead_timeout")
        || under("cache.dir")
        || under("cache.disk")
}

/// A config as TOML, each proxy user's password shown as `(set)`.
pub fn redacted(config: &Config) -> toml::Value {
    // Nothing derived from a password: even a short digest lets a weak one be confirmed
    // offline.
    with_passwords(config, |_| toml::Value::String("(set)".into()))
}

/// The config as [`redacted`] shows it, with each user's password digest in place of
/// `(set)`: for telling what a reload changes, never shown.
fn comparable(config: &Config) -> toml::Value {
    with_passwords(config, |u| {
        toml::Value::String(hex::encode(u.password_sha256))
    })
}

fn with_passwords(
    config: &Config,
    shown: impl Fn(&crate::config::User) -> toml::Value,
) -> toml::Value {
    let mut value = toml::Value::try_from(config).unwrap_or(toml::Value::Table(Default::default()));
    let users = value
        .get_mut("proxy")
        .and_then(|p| p.get_mut("auth"))
        .and_then(|a| a.get_mut("users"))
        .and_then(toml::Value::as_array_mut);
    let configured = config.proxy.auth.iter().flat_map(|a| a.users.iter());
    for (user, configured) in users.into_iter().flatten().zip(configured) {
        if let Some(table) = user.as_table_mut() {
            table.remove("password_sha256");
            table.insert("password".into(), shown(configured));
        }
    }
    value
}

/// Every dotted key whose value differs between two configs (as [`redacted`] gives them):
/// tables are compared key by key, anything else whole.
pub fn differences(old: &toml::Value, new: &toml::Value) -> Vec<String> {
    fn walk(
        prefix: &str,
        old: Option<&toml::Value>,
        new: Option<&toml::Value>,
        out: &mut Vec<String>,
    ) {
        match (old, new) {
            (Some(toml::Value::Table(a)), Some(toml::Value::Table(b))) => {
                let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
                keys.sort();
                keys.dedup();
                for k in keys {
                    let path = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&path, a.get(k), b.get(k), out);
                }
            }
            (a, b) if a != b => out.push(prefix.to_owned()),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk("", Some(old), Some(new), &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> Config {
        Config::parse(
            &format!("[tls]\ngenerate_ca = true\n{text}"),
            std::path::Path::new("/tmp"),
        )
        .unwrap()
    }

    #[test]
    fn differences_name_each_changed_key_and_in_place_sorts_them() {
        let old = config("[destinations.a]\nhosts = [\"a.example\"]\nrate = 1\n[destinations.b]\nhosts = [\"b.example\"]\nrate = 1\n");
        let new = config("[proxy]\nlisten = \"127.0.0.1:3129\"\n[destinations.a]\nhosts = [\"a.example\"]\nrate = 2\n[destinations.c]\nhosts = [\"c.example\"]\nrate = 1\n");
        let changed = differences(&redacted(&old), &redacted(&new));
        assert_eq!(
            changed,
            [
                "destinations.a.rate",
                "destinations.b",
                "destinations.c",
                "proxy.listen"
            ]
        );
        let (applied, restart): (Vec<_>, Vec<_>) = changed.iter().partition(|k| in_place(k));
        assert_eq!(applied.len(), 3);
        assert_eq!(restart, [&"proxy.listen".to_owned()]);
        assert!(!in_place("logs"), "a prefix of a name is not its section");
        assert!(in_place("log.requests"));
    }

    #[test]
    fn a_password_is_never_shown_and_a_changed_one_is_still_a_reload() {
        let with = |digest: &str| {
            config(&format!(
                "[[proxy.auth.users]]\nname = \"w\"\npassword_sha256 = \"{digest}\"\n"
            ))
        };
        let a = with(&"a".repeat(64));
        let b = with(&"b".repeat(64));
        let shown = toml::to_string(&redacted(&a)).unwrap();
        assert!(!shown.contains("aaaa"), "{shown}");
        assert!(shown.contains("password = \"(set)\""), "{shown}");
        assert_eq!(
            toml::to_string(&redacted(&b)).unwrap(),
            shown,
            "nothing of it shows"
        );
        assert_eq!(
            differences(&comparable(&a), &comparable(&b)),
            ["proxy.auth.users"]
        );
    }
}
