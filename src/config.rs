//! Configuration: the TOML file model, its validation, and the typed [`Config`] the rest of
//! pacegate trusts.
//!
//! Loading never stops at the first mistake. Each section is deserialised on its own and every
//! unknown key is collected (rather than `deny_unknown_fields`, which reports only the first),
//! then the values are validated together; the result is either a `Config` or the complete list
//! of problems, each with its key path.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::budget::failover::OnUnavailable;
use crate::class::Classes;
use crate::destination::{Destination, HostPattern, Pace, Quota};

/// The largest quota `limit`: every instance keeps up to this many send times per window.
const MAX_QUOTA_LIMIT: u32 = 1_000_000;

/// One thing wrong with a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    /// Dotted key path, e.g. `proxy.limits.max_connections` or `destinations.img.hosts[1]`.
    pub path: String,
    /// What is wrong and, where it helps, what would be right.
    pub message: String,
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read at all.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file was read but is not a valid config; every problem is listed.
    #[error("{} has {} problem(s):\n{}", path.display(), problems.len(), list(problems))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every problem found.
        problems: Vec<ConfigProblem>,
    },
}

fn list(problems: &[ConfigProblem]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// What to do with a request whose host matches no destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Unmatched {
    /// Refuse it with 403 and `Proxy-Status` (the default: pacegate is not an open proxy).
    #[default]
    Deny,
    /// CONNECT becomes a blind byte tunnel and `http://` is forwarded, both unpaced.
    Tunnel,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// The validated configuration.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    /// `[proxy]`.
    pub proxy: ProxyConfig,
    /// `[upstream]`.
    pub upstream: UpstreamConfig,
    /// `[admin]`.
    pub admin: AdminConfig,
    /// `[tls]`.
    pub tls: TlsConfig,
    /// `[store]`.
    pub store: StoreConfig,
    /// `[classes]`: priority classes, most urgent first. Not printed when absent, so that the
    /// normalised config means the same as the file.
    #[serde(skip_serializing_if = "Classes::is_implicit")]
    pub classes: Classes,
    /// `[destinations.NAME]`, in name order.
    #[serde(serialize_with = "ser_destinations")]
    pub destinations: Vec<Destination>,
}

/// `[proxy]`: the client-facing listener.
#[derive(Debug, Clone, Serialize)]
pub struct ProxyConfig {
    /// Where clients connect. Default `127.0.0.1:3128`.
    pub listen: SocketAddr,
    /// Policy for hosts that match no destination. Default `deny`.
    pub unmatched: Unmatched,
    /// Allow upstream addresses that are loopback, private, link-local, multicast or
    /// unspecified. Default false.
    pub allow_private_upstreams: bool,
    /// Time given to requests and tunnels to finish after SIGINT/SIGTERM. Default 30 s.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// `[proxy.auth]`; `None` means no proxy authentication.
    pub auth: Option<AuthConfig>,
    /// `[proxy.limits]`.
    pub limits: Limits,
}

/// `[proxy.auth]`: Basic proxy authentication.
#[derive(Debug, Clone, Serialize)]
pub struct AuthConfig {
    /// The realm sent in `Proxy-Authenticate`. Default `pacegate`.
    pub realm: String,
    /// Accepted users.
    pub users: Vec<User>,
}

/// One proxy user. The password itself is never kept, only its SHA-256 digest.
#[derive(Clone, Serialize)]
pub struct User {
    /// User name.
    pub name: String,
    /// The environment variable the password was read from, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password_env: Option<String>,
    /// The configured hex digest, if the password was given that way.
    #[serde(rename = "password_sha256", skip_serializing_if = "Option::is_none")]
    pub password_sha256_hex: Option<String>,
    /// SHA-256 of the password.
    #[serde(skip)]
    pub password_sha256: [u8; 32],
}

impl fmt::Debug for User {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("User")
            .field("name", &self.name)
            .field("password_env", &self.password_env)
            .finish_non_exhaustive()
    }
}

/// `[proxy.limits]`: bounds that keep slow or hostile clients from holding resources.
#[derive(Debug, Clone, Serialize)]
pub struct Limits {
    /// Client connections open at once; more are answered 503 and closed. Default 1024.
    pub max_connections: usize,
    /// Largest request head (request line and headers) in bytes; at least 8192. Default 65536.
    pub max_header_bytes: usize,
    /// Time a client has to send a complete request head, also the idle time allowed between
    /// requests on a kept-alive HTTP/1 connection. Default 30 s.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Time a client has to complete the TLS handshake of an intercepted CONNECT. Default 10 s.
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
    /// Time a blind tunnel may carry no bytes in either direction before it is closed.
    /// Default 5 min.
    #[serde(with = "humantime_serde")]
    pub tunnel_idle_timeout: Duration,
}

/// `[upstream]`: the outbound client.
#[derive(Debug, Clone, Serialize)]
pub struct UpstreamConfig {
    /// Time allowed to open a TCP connection to an upstream. Default 10 s (then 504).
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Time allowed from sending a request to receiving the response head. Default 60 s
    /// (then 504).
    #[serde(with = "humantime_serde")]
    pub response_timeout: Duration,
    /// How long an idle pooled connection is kept; below the usual 5 s upstream keep-alive.
    /// Default 4 s.
    #[serde(with = "humantime_serde")]
    pub pool_idle_timeout: Duration,
    /// Idle connections kept per upstream host. Default 32.
    pub pool_max_idle_per_host: usize,
}

/// `[admin]`: the operator listener (metrics, status, health, unlock).
#[derive(Clone, Serialize)]
pub struct AdminConfig {
    /// Default `127.0.0.1:9464`.
    pub listen: SocketAddr,
    /// The environment variable holding the bearer token POSTs must carry; none means POSTs
    /// are open to whoever reaches the admin listener.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_env: Option<String>,
    /// The token itself, read from `token_env` at load.
    #[serde(skip)]
    pub token: Option<String>,
}

impl fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field("token_env", &self.token_env)
            .finish_non_exhaustive()
    }
}

/// Which store holds the budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// In process memory, persisted to `state_file`: one instance.
    #[default]
    Memory,
    /// Postgres, shared by every instance that points at the same database.
    Postgres,
}

/// `[store]`.
#[derive(Clone, Serialize)]
pub struct StoreConfig {
    /// Default `memory`.
    pub backend: Backend,
    /// Where the memory store keeps lockouts and backoff across restarts. Default
    /// `pacegate-state.json` beside the config file.
    pub state_file: PathBuf,
    /// The postgres store's URL, from `url` or else `PACEGATE_STORE_URL` (kept out of the
    /// normalised config: it may hold a password).
    #[serde(skip)]
    pub url: Option<String>,
    /// Connections the postgres store may open. Default 8.
    pub connections: usize,
    /// PEM roots trusted for the store's TLS certificate, beside the system roots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// Apply the embedded migrations at start (under an advisory lock). Default true.
    pub migrate: bool,
    /// What to do while the postgres store is unreachable. Default `divide`.
    pub on_unavailable: OnUnavailable,
    /// Live instances to assume for `divide` before any heartbeat was seen. Default 1.
    pub instances_hint: usize,
    /// Longest wait for a reservation's answer from the postgres store; a slower one delays
    /// that slot (the store counts as unreachable only on a connection error or a missed
    /// heartbeat). Default 100 ms.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
}

impl fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreConfig")
            .field("backend", &self.backend)
            .field("state_file", &self.state_file)
            .field("connections", &self.connections)
            .field("migrate", &self.migrate)
            .field("on_unavailable", &self.on_unavailable)
            .field("instances_hint", &self.instances_hint)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// `[tls]`: the local CA that intercepted sessions are signed by, and upstream trust.
#[derive(Debug, Clone, Serialize)]
pub struct TlsConfig {
    /// CA certificate (PEM). Relative paths are resolved against the config file's directory.
    pub ca_cert: PathBuf,
    /// CA private key (PEM, mode 0600).
    pub ca_key: PathBuf,
    /// Create the CA at `ca_cert` / `ca_key` on first start when both are missing.
    pub generate_ca: bool,
    /// Extra PEM files of roots trusted for upstream servers, beside the system roots.
    pub extra_upstream_roots: Vec<PathBuf>,
    /// Validity of minted leaf certificates. Default 24 h.
    #[serde(with = "humantime_serde")]
    pub leaf_validity: Duration,
}

fn ser_destinations<S: serde::Serializer>(dests: &[Destination], s: S) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Out<'a> {
        hosts: Vec<String>,
        #[serde(flatten)]
        pace: &'a Pace,
    }
    let map: BTreeMap<&str, Out> = dests
        .iter()
        .map(|d| {
            (
                d.name.as_str(),
                Out {
                    hosts: d.hosts.iter().map(ToString::to_string).collect(),
                    pace: &d.pace,
                },
            )
        })
        .collect();
    map.serialize(s)
}

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        // Absolute, so that the normalised config printed by check-config means the same
        // wherever it is read from.
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let base = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
        Self::parse(&text, &base).map_err(|problems| ConfigError::Invalid {
            path: path.to_owned(),
            problems,
        })
    }

    /// Parses and validates config text; relative paths are resolved against `base`.
    /// Environment variables named by the config (`password_env`) are read here.
    pub fn parse(text: &str, base: &Path) -> Result<Self, Vec<ConfigProblem>> {
        let mut problems = Vec::new();
        let mut table: toml::Table = match toml::from_str(text) {
            Ok(t) => t,
            Err(e) => {
                return Err(vec![ConfigProblem {
                    path: "(file)".into(),
                    message: format!("not valid TOML: {}", e.to_string().trim_end()),
                }])
            }
        };
        let proxy: Option<RawProxy> = section(table.remove("proxy"), "proxy", &mut problems);
        let upstream: Option<RawUpstream> =
            section(table.remove("upstream"), "upstream", &mut problems);
        let admin: Option<RawAdmin> = section(table.remove("admin"), "admin", &mut problems);
        let tls: Option<RawTls> = section(table.remove("tls"), "tls", &mut problems);
        let store: Option<RawStore> = section(table.remove("store"), "store", &mut problems);
        let classes: Option<Option<RawClasses>> = match table.remove("classes") {
            None => Some(None),
            some => section::<RawClasses>(some, "classes", &mut problems).map(Some),
        };
        let mut raw_dests = BTreeMap::new();
        match table.remove("destinations") {
            None => {}
            Some(toml::Value::Table(t)) => {
                for (name, value) in t {
                    let path = format!("destinations.{name}");
                    if let Some(d) = section::<RawDestination>(Some(value), &path, &mut problems) {
                        raw_dests.insert(name, d);
                    }
                }
            }
            Some(_) => problems.push(problem(
                "destinations",
                "must be a table of [destinations.NAME] sections",
            )),
        }
        for key in table.keys() {
            problems.push(problem(key, "unknown section"));
        }

        let mut v = Validator { problems, base };
        let config = Config {
            proxy: v.proxy(proxy.unwrap_or_default()),
            upstream: v.upstream(upstream.unwrap_or_default()),
            admin: v.admin(admin.unwrap_or_default()),
            tls: v.tls(tls.unwrap_or_default()),
            store: v.store(store.unwrap_or_default()),
            classes: classes
                .flatten()
                .map_or_else(Classes::default, |c| v.classes(c)),
            destinations: v.destinations(raw_dests),
        };
        if v.problems.is_empty() {
            Ok(config)
        } else {
            Err(v.problems)
        }
    }

    /// The normalised config as TOML, every default filled in and no secret included.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }
}

fn problem(path: &str, message: impl Into<String>) -> ConfigProblem {
    ConfigProblem {
        path: path.to_owned(),
        message: message.into(),
    }
}

/// Deserialises one section, recording its unknown keys and its first type error as problems.
fn section<T: DeserializeOwned + Default>(
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

// The file model: every key optional, so that defaults are applied (and shown) in one place.

#[derive(Debug, Default, Deserialize)]
struct RawProxy {
    listen: Option<String>,
    unmatched: Option<Unmatched>,
    allow_private_upstreams: Option<bool>,
    #[serde(default, with = "humantime_serde")]
    shutdown_grace: Option<Duration>,
    auth: Option<RawAuth>,
    limits: Option<RawLimits>,
}

#[derive(Debug, Default, Deserialize)]
struct RawAuth {
    realm: Option<String>,
    #[serde(default)]
    users: Vec<RawUser>,
}

#[derive(Debug, Default, Deserialize)]
struct RawUser {
    name: Option<String>,
    password_env: Option<String>,
    password_sha256: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct RawLimits {
    max_connections: Option<usize>,
    max_header_bytes: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    header_read_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    handshake_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    tunnel_idle_timeout: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
struct RawUpstream {
    #[serde(default, with = "humantime_serde")]
    connect_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    response_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pool_idle_timeout: Option<Duration>,
    pool_max_idle_per_host: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
struct RawAdmin {
    listen: Option<String>,
    token_env: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct RawStore {
    backend: Option<Backend>,
    state_file: Option<PathBuf>,
    url: Option<String>,
    connections: Option<usize>,
    ca_file: Option<PathBuf>,
    migrate: Option<bool>,
    on_unavailable: Option<OnUnavailable>,
    instances_hint: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    timeout: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
struct RawTls {
    ca_cert: Option<PathBuf>,
    ca_key: Option<PathBuf>,
    generate_ca: Option<bool>,
    #[serde(default)]
    extra_upstream_roots: Vec<PathBuf>,
    #[serde(default, with = "humantime_serde")]
    leaf_validity: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
struct RawDestination {
    hosts: Option<Vec<String>>,
    rate: Option<f64>,
    burst: Option<u32>,
    max_concurrency: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    max_wait: Option<Duration>,
    throttle_statuses: Option<Vec<u16>>,
    lockout_statuses: Option<Vec<u16>>,
    backoff_factor: Option<f64>,
    backoff_max: Option<f64>,
    decay_after: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    retry_after_max: Option<Duration>,
    retry_throttled: Option<u32>,
    intercept: Option<bool>,
    quota: Option<Vec<Quota>>,
}

#[derive(Debug, Default, Deserialize)]
struct RawClasses {
    order: Option<Vec<String>>,
    default: Option<String>,
    share: Option<BTreeMap<String, f64>>,
    #[serde(default)]
    max_wait: BTreeMap<String, RawDuration>,
}

/// A duration written like `"250ms"`.
#[derive(Debug, Deserialize)]
struct RawDuration(#[serde(with = "humantime_serde")] Duration);

struct Validator<'a> {
    problems: Vec<ConfigProblem>,
    base: &'a Path,
}

impl Validator<'_> {
    fn push(&mut self, path: &str, message: impl Into<String>) {
        self.problems.push(problem(path, message));
    }

    fn addr(&mut self, path: &str, text: Option<String>, default: &str) -> SocketAddr {
        let text = text.unwrap_or_else(|| default.to_owned());
        text.parse().unwrap_or_else(|_| {
            self.push(
                path,
                format!("`{text}` is not an address:port such as `{default}`"),
            );
            default.parse().expect("default address parses")
        })
    }

    fn positive(&mut self, path: &str, value: Option<Duration>, default: Duration) -> Duration {
        let d = value.unwrap_or(default);
        if d.is_zero() {
            self.push(
                path,
                "must be longer than zero (write it like \"250ms\" or \"30s\")",
            );
        }
        d
    }

    fn path(&self, p: PathBuf) -> PathBuf {
        if p.is_absolute() {
            p
        } else {
            self.base.join(p)
        }
    }

    fn proxy(&mut self, raw: RawProxy) -> ProxyConfig {
        let limits = raw.limits.unwrap_or_default();
        let max_connections = limits.max_connections.unwrap_or(1024);
        if max_connections == 0 {
            self.push("proxy.limits.max_connections", "must be at least 1");
        }
        let max_header_bytes = limits.max_header_bytes.unwrap_or(64 * 1024);
        if !(8192..=1024 * 1024).contains(&max_header_bytes) {
            self.push(
                "proxy.limits.max_header_bytes",
                "must be between 8192 and 1048576",
            );
        }
        ProxyConfig {
            listen: self.addr("proxy.listen", raw.listen, "127.0.0.1:3128"),
            unmatched: raw.unmatched.unwrap_or_default(),
            allow_private_upstreams: raw.allow_private_upstreams.unwrap_or(false),
            shutdown_grace: raw.shutdown_grace.unwrap_or(Duration::from_secs(30)),
            auth: raw.auth.map(|a| self.auth(a)),
            limits: Limits {
                max_connections,
                max_header_bytes,
                header_read_timeout: self.positive(
                    "proxy.limits.header_read_timeout",
                    limits.header_read_timeout,
                    Duration::from_secs(30),
                ),
                handshake_timeout: self.positive(
                    "proxy.limits.handshake_timeout",
                    limits.handshake_timeout,
                    Duration::from_secs(10),
                ),
                tunnel_idle_timeout: self.positive(
                    "proxy.limits.tunnel_idle_timeout",
                    limits.tunnel_idle_timeout,
                    Duration::from_secs(300),
                ),
            },
        }
    }

    fn auth(&mut self, raw: RawAuth) -> AuthConfig {
        if raw.users.is_empty() {
            self.push(
                "proxy.auth.users",
                "lists no user: add one, or remove [proxy.auth] to turn authentication off",
            );
        }
        let mut users: Vec<User> = Vec::new();
        for (i, u) in raw.users.into_iter().enumerate() {
            let path = format!("proxy.auth.users[{i}]");
            let name = u.name.unwrap_or_default();
            if name.is_empty() || name.contains(':') {
                self.push(
                    &format!("{path}.name"),
                    "is required and may not contain `:`",
                );
            } else if users.iter().any(|x| x.name == name) {
                self.push(
                    &format!("{path}.name"),
                    format!("user `{name}` is listed twice"),
                );
            }
            let digest = match (&u.password_env, &u.password_sha256) {
                (Some(var), None) => match std::env::var(var) {
                    Ok(pw) if !pw.is_empty() => Some(sha256(pw.as_bytes())),
                    _ => {
                        self.push(
                            &format!("{path}.password_env"),
                            format!("environment variable `{var}` is not set or empty"),
                        );
                        None
                    }
                },
                (None, Some(hex)) => match decode_hex32(hex) {
                    Some(d) => Some(d),
                    None => {
                        self.push(
                            &format!("{path}.password_sha256"),
                            "must be 64 hex digits (sha256 of the password)",
                        );
                        None
                    }
                },
                _ => {
                    self.push(
                        &path,
                        "needs exactly one of `password_env` or `password_sha256`",
                    );
                    None
                }
            };
            if let Some(password_sha256) = digest {
                users.push(User {
                    name,
                    password_env: u.password_env,
                    password_sha256_hex: u.password_sha256,
                    password_sha256,
                });
            }
        }
        AuthConfig {
            realm: raw.realm.unwrap_or_else(|| "pacegate".into()),
            users,
        }
    }

    fn upstream(&mut self, raw: RawUpstream) -> UpstreamConfig {
        UpstreamConfig {
            connect_timeout: self.positive(
                "upstream.connect_timeout",
                raw.connect_timeout,
                Duration::from_secs(10),
            ),
            response_timeout: self.positive(
                "upstream.response_timeout",
                raw.response_timeout,
                Duration::from_secs(60),
            ),
            pool_idle_timeout: self.positive(
                "upstream.pool_idle_timeout",
                raw.pool_idle_timeout,
                Duration::from_secs(4),
            ),
            pool_max_idle_per_host: raw.pool_max_idle_per_host.unwrap_or(32),
        }
    }

    fn admin(&mut self, raw: RawAdmin) -> AdminConfig {
        let token = raw
            .token_env
            .as_ref()
            .and_then(|var| match std::env::var(var) {
                Ok(t) if !t.is_empty() => Some(t),
                _ => {
                    self.push(
                        "admin.token_env",
                        format!("environment variable `{var}` is not set or empty"),
                    );
                    None
                }
            });
        AdminConfig {
            listen: self.addr("admin.listen", raw.listen, "127.0.0.1:9464"),
            token_env: raw.token_env,
            token,
        }
    }

    fn store(&mut self, raw: RawStore) -> StoreConfig {
        let backend = raw.backend.unwrap_or_default();
        let url = raw.url.or_else(|| {
            std::env::var("PACEGATE_STORE_URL")
                .ok()
                .filter(|u| !u.is_empty())
        });
        if backend == Backend::Postgres {
            match &url {
                None => self.push(
                    "store.url",
                    "is required with backend = \"postgres\" (or set PACEGATE_STORE_URL, which keeps the password out of the file)",
                ),
                Some(u) if u.parse::<tokio_postgres::Config>().is_err() => {
                    self.push("store.url", "is not a postgres URL like postgres://user@host:5432/db");
                }
                Some(_) => {}
            }
        }
        let connections = raw.connections.unwrap_or(8);
        if connections < 2 {
            // One connection is kept for heartbeats and probes, so that lockouts and the live
            // count stay current while reservations hold every other one.
            self.push(
                "store.connections",
                "must be at least 2: one is kept for heartbeats, the rest serve reservations",
            );
        }
        StoreConfig {
            backend,
            state_file: self.path(
                raw.state_file
                    .unwrap_or_else(|| "pacegate-state.json".into()),
            ),
            url,
            connections,
            ca_file: raw.ca_file.map(|p| {
                let p = self.path(p);
                if !p.is_file() {
                    self.push(
                        "store.ca_file",
                        format!("{} is not a readable file", p.display()),
                    );
                }
                p
            }),
            migrate: raw.migrate.unwrap_or(true),
            on_unavailable: raw.on_unavailable.unwrap_or_default(),
            instances_hint: raw.instances_hint.unwrap_or(1).max(1),
            timeout: self.positive("store.timeout", raw.timeout, Duration::from_millis(100)),
        }
    }

    fn pace(&mut self, path: &str, d: &RawDestination) -> Pace {
        let rate = d.rate.unwrap_or_else(|| {
            self.push(
                &format!("{path}.rate"),
                "is required: requests per second over every instance, e.g. 5 or 0.5",
            );
            1.0
        });
        if !(rate.is_finite() && rate > 0.0 && rate <= 1_000_000.0) {
            self.push(
                &format!("{path}.rate"),
                "must be a number above 0 and at most 1000000",
            );
        }
        let default = Pace::new(rate);
        let pace = Pace {
            burst: d.burst.unwrap_or(default.burst),
            max_concurrency: d.max_concurrency.unwrap_or(default.max_concurrency),
            max_wait: self.positive(&format!("{path}.max_wait"), d.max_wait, default.max_wait),
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
            decay_after: d.decay_after.unwrap_or(default.decay_after),
            retry_after_max: self.positive(
                &format!("{path}.retry_after_max"),
                d.retry_after_max,
                default.retry_after_max,
            ),
            retry_throttled: d.retry_throttled.unwrap_or(default.retry_throttled),
            intercept: d.intercept.unwrap_or(default.intercept),
            quota: d.quota.clone().unwrap_or_default(),
            rate,
        };
        for (i, q) in pace.quota.iter().enumerate() {
            if !(1..=MAX_QUOTA_LIMIT).contains(&q.limit) {
                self.push(
                    &format!("{path}.quota[{i}].limit"),
                    format!("must be 1 to {MAX_QUOTA_LIMIT}"),
                );
            }
            if q.per < Duration::from_millis(1) {
                self.push(
                    &format!("{path}.quota[{i}].per"),
                    "must be at least 1ms (write it like \"1m\" or \"1d\")",
                );
            }
        }
        if pace.burst == 0 {
            self.push(&format!("{path}.burst"), "must be at least 1");
        }
        if !(pace.backoff_factor.is_finite() && pace.backoff_factor > 1.0) {
            self.push(&format!("{path}.backoff_factor"), "must be above 1");
        }
        if !(pace.backoff_max.is_finite() && pace.backoff_max >= 1.0) {
            self.push(&format!("{path}.backoff_max"), "must be at least 1");
        }
        if pace.decay_after == 0 {
            self.push(&format!("{path}.decay_after"), "must be at least 1");
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

    fn tls(&mut self, raw: RawTls) -> TlsConfig {
        let leaf_validity = self.positive(
            "tls.leaf_validity",
            raw.leaf_validity,
            Duration::from_secs(24 * 3600),
        );
        if leaf_validity < Duration::from_secs(3600)
            || leaf_validity > Duration::from_secs(90 * 24 * 3600)
        {
            self.push("tls.leaf_validity", "must be between 1h and 90d");
        }
        let generate_ca = raw.generate_ca.unwrap_or(false);
        let ca_cert = self.path(raw.ca_cert.unwrap_or_else(|| "ca.pem".into()));
        let ca_key = self.path(raw.ca_key.unwrap_or_else(|| "ca-key.pem".into()));
        if !generate_ca {
            for (key, p) in [("tls.ca_cert", &ca_cert), ("tls.ca_key", &ca_key)] {
                if !p.exists() {
                    self.push(
                        key,
                        format!(
                            "{} does not exist: create a CA with `pacegate ca init --dir DIR` or set tls.generate_ca = true",
                            p.display()
                        ),
                    );
                }
            }
        }
        let mut extra = Vec::new();
        for (i, p) in raw.extra_upstream_roots.into_iter().enumerate() {
            let p = self.path(p);
            if !p.is_file() {
                self.push(
                    &format!("tls.extra_upstream_roots[{i}]"),
                    format!("{} is not a readable file", p.display()),
                );
            }
            extra.push(p);
        }
        TlsConfig {
            ca_cert,
            ca_key,
            generate_ca,
            extra_upstream_roots: extra,
            leaf_validity,
        }
    }

    fn classes(&mut self, raw: RawClasses) -> Classes {
        let order = raw.order.unwrap_or_default();
        if order.is_empty() {
            self.push(
                "classes.order",
                "is required: the class names, most urgent first, e.g. [\"interactive\", \"backfill\"]",
            );
        }
        if order.len() > usize::from(u16::MAX) {
            self.push("classes.order", "lists too many classes");
        }
        for (i, name) in order.iter().enumerate() {
            let path = format!("classes.order[{i}]");
            if !is_plain_name(name) {
                self.push(
                    &path,
                    "class names may hold only letters, digits, `_` and `-` (they travel in proxy user names and headers)",
                );
            }
            if order[..i].contains(name) {
                self.push(&path, format!("`{name}` is listed twice"));
            }
        }
        let listed = |name: &str| order.iter().any(|n| n == name);
        let default = match raw.default {
            Some(d) => {
                if !order.is_empty() && !listed(&d) {
                    self.push("classes.default", format!("`{d}` is not in classes.order"));
                }
                d
            }
            None => {
                if !order.is_empty() {
                    self.push(
                        "classes.default",
                        "is required: the class of a request that names none",
                    );
                }
                order.first().cloned().unwrap_or_default()
            }
        };
        let share = raw.share.unwrap_or_default();
        for (name, s) in &share {
            let path = format!("classes.share.{name}");
            if !listed(name) {
                self.push(&path, "names no class in classes.order");
            }
            if !(s.is_finite() && *s > 0.0 && *s < 1.0) {
                self.push(&path, "must be a fraction above 0 and below 1");
            }
        }
        let total: f64 = share.values().filter(|s| s.is_finite()).sum();
        if total > 1.0 {
            self.push(
                "classes.share",
                format!("the shares add up to {total}, more than every slot"),
            );
        }
        let mut max_wait = BTreeMap::new();
        for (name, RawDuration(d)) in raw.max_wait {
            let path = format!("classes.max_wait.{name}");
            if !listed(&name) {
                self.push(&path, "names no class in classes.order");
            }
            max_wait.insert(name, self.positive(&path, Some(d), d));
        }
        Classes {
            order,
            default,
            share,
            max_wait,
            configured: true,
        }
    }

    fn destinations(&mut self, raw: BTreeMap<String, RawDestination>) -> Vec<Destination> {
        let mut out: Vec<Destination> = Vec::new();
        for (name, d) in raw {
            let path = format!("destinations.{name}");
            if !is_plain_name(&name) {
                self.push(
                    &path,
                    "destination names may hold only letters, digits, `_` and `-`",
                );
            }
            let hosts_raw = d.hosts.clone().unwrap_or_default();
            if hosts_raw.is_empty() {
                self.push(
                    &format!("{path}.hosts"),
                    "is required and must list at least one host pattern",
                );
            }
            let mut hosts = Vec::new();
            for (i, h) in hosts_raw.iter().enumerate() {
                match HostPattern::parse(h) {
                    Ok(p) => hosts.push((i, p)),
                    Err(e) => self.push(&format!("{path}.hosts[{i}]"), e),
                }
            }
            for (i, p) in &hosts {
                for other in &out {
                    if let Some(q) = other.hosts.iter().find(|q| q.overlaps(p)) {
                        self.push(
                            &format!("{path}.hosts[{i}]"),
                            format!("`{p}` overlaps `{q}` of destination `{}`: a host may belong to one destination only", other.name),
                        );
                    }
                }
            }
            let pace = self.pace(&path, &d);
            out.push(Destination {
                name,
                hosts: hosts.into_iter().map(|(_, p)| p).collect(),
                pace,
            });
        }
        out
    }
}

/// A name of letters, digits, `_` and `-`: safe in metric labels, URLs, user names and headers.
fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// SHA-256 of `data`.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, data);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

fn decode_hex32(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, Vec<ConfigProblem>> {
        Config::parse(text, Path::new("/nonexistent"))
    }

    fn paths(problems: &[ConfigProblem]) -> Vec<&str> {
        problems.iter().map(|p| p.path.as_str()).collect()
    }

    const MINIMAL: &str = "[tls]\ngenerate_ca = true\n";

    #[test]
    fn empty_config_gets_safe_defaults() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.proxy.listen.to_string(), "127.0.0.1:3128");
        assert_eq!(c.admin.listen.to_string(), "127.0.0.1:9464");
        assert_eq!(c.proxy.unmatched, Unmatched::Deny);
        assert!(!c.proxy.allow_private_upstreams);
        assert_eq!(c.tls.ca_key, Path::new("/nonexistent/ca-key.pem"));
    }

    #[test]
    fn reports_every_problem_with_its_key_path() {
        let err = parse(
            r#"
            [proxy]
            listen = "nowhere"
            colour = "blue"
            [proxy.limits]
            header_read_timeout = "0s"
            [upstream]
            connect_timeout = "soon"
            [tls]
            generate_ca = true
            [destinations.img]
            hosts = ["img.example.com", "bad host"]
            rate = 5
            quota = [{ limit = 0, per = "1m" }]
            [destinations.cdn]
            hosts = ["*.example.com"]
            [classes]
            order = []
            "#,
        )
        .unwrap_err();
        let p = paths(&err);
        for expected in [
            "proxy.colour",
            "proxy.listen",
            "proxy.limits.header_read_timeout",
            "upstream.connect_timeout",
            "destinations.img.quota[0].limit",
            "destinations.img.hosts[1]",
            "destinations.img.hosts[0]",
            "destinations.cdn.rate",
            "classes.order",
        ] {
            assert!(p.contains(&expected), "missing {expected} in {err:#?}");
        }
    }

    #[test]
    fn classes_and_quotas_are_read() {
        let c = parse(
            r#"
            [tls]
            generate_ca = true
            [classes]
            order = ["interactive", "scheduled", "backfill"]
            default = "scheduled"
            [classes.share]
            backfill = 0.1
            [classes.max_wait]
            interactive = "5s"
            [destinations.api]
            hosts = ["api.example.com"]
            rate = 10
            quota = [{ limit = 600, per = "1m" }, { limit = 20000, per = "1d" }]
            "#,
        )
        .unwrap();
        let interactive = c.classes.lookup("interactive").unwrap();
        assert_eq!(
            c.classes.max_wait(interactive),
            Some(Duration::from_secs(5))
        );
        assert_eq!(c.classes.default_class(), crate::class::Class(1));
        assert_eq!(c.classes.shares(), vec![0.0, 0.0, 0.1]);
        assert_eq!(c.destinations[0].pace.quota[1].limit, 20000);
        assert_eq!(
            c.destinations[0].pace.quota[1].per,
            Duration::from_secs(86400)
        );
        // The normalised output reads back the same.
        let again = Config::parse(&c.to_toml(), Path::new("/nonexistent")).unwrap();
        assert_eq!(again.classes, c.classes);
        assert_eq!(
            again.destinations[0].pace.quota,
            c.destinations[0].pace.quota
        );
        // Without [classes], one class named `default`, and none in the normalised output.
        let minimal = parse(MINIMAL).unwrap();
        assert_eq!(minimal.classes.order, ["default"]);
        assert!(!minimal.to_toml().contains("[classes]"));
    }

    #[test]
    fn durations_must_be_strings_with_units() {
        let err = parse("[upstream]\nconnect_timeout = 5\n[tls]\ngenerate_ca = true").unwrap_err();
        assert_eq!(paths(&err), ["upstream.connect_timeout"]);
        let c =
            parse("[upstream]\nconnect_timeout = \"250ms\"\n[tls]\ngenerate_ca = true").unwrap();
        assert_eq!(c.upstream.connect_timeout, Duration::from_millis(250));
    }

    #[test]
    fn missing_ca_without_generate_ca_is_an_error() {
        let err = parse("").unwrap_err();
        assert_eq!(paths(&err), ["tls.ca_cert", "tls.ca_key"]);
    }

    #[test]
    fn auth_reads_password_from_environment() {
        std::env::set_var("PACEGATE_TEST_CONFIG_PW", "s3cret");
        let c = parse(
            "[proxy.auth]\nusers = [{ name = \"w\", password_env = \"PACEGATE_TEST_CONFIG_PW\" }]\n[tls]\ngenerate_ca = true",
        )
        .unwrap();
        let user = &c.proxy.auth.unwrap().users[0];
        assert_eq!(user.password_sha256, sha256(b"s3cret"));
        assert!(!format!("{user:?}").contains("s3cret"));
        let err = parse("[proxy.auth]\nusers = [{ name = \"w\", password_env = \"PACEGATE_TEST_UNSET_VAR\" }]\n[tls]\ngenerate_ca = true")
            .unwrap_err();
        assert_eq!(paths(&err), ["proxy.auth.users[0].password_env"]);
    }

    #[test]
    fn normalised_output_parses_back() {
        let c = parse(
            "[destinations.a]\nhosts = [\"A.example.com:443\"]\nrate = 0.5\nmax_wait = \"2s\"\n[tls]\ngenerate_ca = true",
        )
        .unwrap();
        let text = c.to_toml();
        assert!(text.contains("a.example.com:443"), "{text}");
        let again = parse(&text).unwrap();
        assert_eq!(again.destinations[0].hosts, c.destinations[0].hosts);
        assert_eq!(again.destinations[0].pace, c.destinations[0].pace);
        assert_eq!(again.destinations[0].pace.max_wait, Duration::from_secs(2));
    }

    #[test]
    fn syntax_errors_are_reported() {
        let err = parse("[proxy\nlisten=").unwrap_err();
        assert_eq!(paths(&err), ["(file)"]);
    }
}
