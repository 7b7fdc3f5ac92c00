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

use serde::{Deserialize, Serialize};

use crate::class::Classes;
use crate::destination::{Destination, HostPattern, Pace};

mod file;
mod validate;

use file::{
    problem, section, RawAdmin, RawCache, RawClasses, RawDestination, RawLog, RawProxy, RawStore,
    RawTls, RawUpstream,
};
use validate::Validator;

/// The largest quota `limit`: every instance keeps up to this many send times per window.
const MAX_QUOTA_LIMIT: u32 = 1_000_000;
/// The slowest `rate`: one request in about 17 minutes. Slower, an interval is past what the
/// arithmetic keeps exact.
const MIN_RATE: f64 = 0.001;
/// The largest `backoff_max`.
const MAX_BACKOFF: f64 = 10_000.0;
/// The longest pause anything may impose (`retry_after_max`, a block's `max`): 7 days.
const MAX_PAUSE: Duration = Duration::from_secs(7 * 24 * 3600);
/// The longest `[store] divide_for`: the others hold a lost instance's share back that long.
pub const MAX_DIVIDE_FOR: Duration = Duration::from_secs(3600);
/// The shortest `[store] divide_for`: an instance stops pacing alone a second before its lease
/// runs out (`fleet::WINDOW`), so a shorter one would never pace alone.
pub const MIN_DIVIDE_FOR: Duration = Duration::from_secs(2);
/// `[store] divide_for` by default. The lease is 6 s more (`fleet::ALONE_AFTER`): a cut-off
/// instance paces alone from 6 s to 15 s after its last heartbeat, through a failover of about
/// 10 s, and a killed instance's share is back about 16 s after the kill.
pub const DEFAULT_DIVIDE_FOR: Duration = Duration::from_secs(10);
/// The longest `throttle_body` marker: markers are looked for in the first 8 KiB of a body.
const MAX_MARKER_BYTES: usize = 256;

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

/// `[store] on_unavailable`: what an instance does while the shared store is unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnUnavailable {
    /// Pace locally at `rate / n`.
    #[default]
    Divide,
    /// Refuse requests until the store is back.
    Refuse,
}

/// `[store] statements`: how the postgres store sends its statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Statements {
    /// Each prepared once per connection, then only bound and executed: the least work for
    /// the database. A pooler in transaction mode cannot run them (it may execute a statement
    /// on a server connection that never prepared it).
    #[default]
    Prepared,
    /// Each sent unnamed with its parameters' types, in one round trip, and parsed and
    /// planned anew every time: what PgBouncer in transaction mode needs. It costs the
    /// database more work per reservation (see `docs/benchmarks.md`).
    Unnamed,
}

/// `[log] requests`: which requests get the request log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RequestLog {
    /// Every request (the default).
    #[default]
    All,
    /// Requests that were not answered 1xx-3xx: pacegate's refusals and failures, and the
    /// upstream's 4xx and 5xx.
    Errors,
    /// None: for sites that log requests elsewhere. Startup, verdict and store lines stay.
    None,
}

/// `[cache]`: what identical requests in flight may share (collapsed forwarding, for the
/// destinations with `cache = true`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CacheConfig {
    /// The most bytes of shared responses held in memory at once: a response that would pass
    /// it is not shared. Default 256 MiB.
    pub memory: u64,
    /// The largest response kept; a larger one is shared only with the requests that wait
    /// for it as it streams by. Default 32 MiB.
    pub max_object: u64,
    /// How long after the leader's request was sent its waiters wait for its response head
    /// before one of them goes in its place. Default 5 s.
    #[serde(with = "humantime_serde")]
    pub lead_timeout: Duration,
    /// The disk tier's directory: kept responses are written there too, and survive a
    /// restart. `None`: memory only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<std::path::PathBuf>,
    /// The most bytes the disk tier holds: 10 GiB unless set, with `dir`; `None` without.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk: Option<u64>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            memory: 256 * 1024 * 1024,
            max_object: 32 * 1024 * 1024,
            lead_timeout: Duration::from_secs(5),
            dir: None,
            disk: None,
        }
    }
}

/// `[log]`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LogConfig {
    /// Which requests are logged. Default `all`.
    pub requests: RequestLog,
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
    /// `[log]`.
    pub log: LogConfig,
    /// `[cache]`; `None`: nothing is shared between requests.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheConfig>,
    /// `[classes]`: priority classes, most urgent first. Not printed when absent, so that the
    /// normalised config means the same as the file.
    #[serde(skip_serializing_if = "Classes::is_implicit")]
    pub classes: Classes,
    /// `[destinations.NAME]`, in name order.
    #[serde(serialize_with = "ser_destinations")]
    pub destinations: Vec<Destination>,
    /// The file it was read from, which a reload reads again; none for text parsed directly.
    #[serde(skip)]
    pub file: Option<PathBuf>,
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
    /// Threads serving requests. Default: one per core. Fewer leaves cores to other work on
    /// the same host, at the price of a lower peak.
    pub threads: usize,
    /// The source networks allowed to connect; `None`: any that can reach `listen` (which is
    /// then loopback, or `auth` is set). Others are refused at once.
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "ser_nets")]
    pub clients: Option<Vec<ipnet::IpNet>>,
    /// Ports, besides 80 for http and 443 (and 80) for CONNECT, that every destination's
    /// port-less patterns, and unmatched traffic (`unmatched = "tunnel"`), may go to.
    #[serde(skip_serializing_if = "crate::destination::Ports::is_empty")]
    pub ports: crate::destination::Ports,
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
    /// The classes this user may use; `None`: every class.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub classes: Option<Vec<String>>,
}

impl User {
    /// The SHA-256 digest of a password, as kept and compared.
    pub fn digest(password: &[u8]) -> [u8; 32] {
        let digest = ring::digest::digest(&ring::digest::SHA256, password);
        let mut out = [0u8; 32];
        out.copy_from_slice(digest.as_ref());
        out
    }
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
    /// Requests in flight at once over every connection and intercepted session, HTTP/2
    /// streams included; more are answered 503. Default 4096.
    pub max_requests: usize,
    /// Concurrent streams one HTTP/2 connection may open. Default 100.
    pub max_streams: u32,
    /// Largest request head (request line and headers) in bytes; at least 8192. Default 65536.
    pub max_header_bytes: usize,
    /// Time a client has to send its first byte and then a complete request head; also the
    /// idle time allowed between requests on a kept-alive HTTP/1 connection. Default 30 s.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Time a connection of either protocol may sit with no request in flight before it is
    /// closed, counted from the end of its last request (or its first byte). Bytes that are
    /// no request (HTTP/2 pings, settings, window updates) do not keep it open. Default 60 s.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// How long an HTTP/2 connection may go without a frame from the client before pacegate
    /// pings it. Default 30 s.
    #[serde(with = "humantime_serde")]
    pub ping_interval: Duration,
    /// Time the client has to answer a ping; an unanswered ping closes the connection, with
    /// the requests still on it (a client gone without a word). Default 20 s.
    #[serde(with = "humantime_serde")]
    pub ping_timeout: Duration,
    /// Time a response write may wait for a client that does not read; then the connection
    /// is closed and its upstream connection and permits are given back. Default 60 s.
    #[serde(with = "humantime_serde")]
    pub write_timeout: Duration,
    /// Time a body may keep its reader waiting for its next bytes, either way (an upstream's
    /// response to the client, a client's request to the upstream); then its stream is cut
    /// and what it held (a concurrency permit, an upstream connection) given back. Default
    /// 30 s.
    #[serde(with = "humantime_serde")]
    pub body_timeout: Duration,
    /// Time a client has to complete the TLS handshake of an intercepted CONNECT. Default 10 s.
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
    /// Time a blind tunnel may carry no bytes in either direction (or, once one side has
    /// closed, in the direction still open) before it is closed. Default 5 min.
    #[serde(with = "humantime_serde")]
    pub tunnel_idle_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_requests: 4096,
            max_streams: 100,
            max_header_bytes: 64 * 1024,
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            ping_interval: Duration::from_secs(30),
            ping_timeout: Duration::from_secs(20),
            write_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
            tunnel_idle_timeout: Duration::from_secs(300),
        }
    }
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
    /// Idle connections kept per upstream host. Default 256: a burst of many clients needs as
    /// many, and opening them again for the next burst costs more than keeping them 4 s.
    pub pool_max_idle_per_host: usize,
    /// A parent proxy every upstream connection goes through (HTTP CONNECT), but those to
    /// `no_proxy` hosts. Default none: connections go direct.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ParentProxy>,
    /// Host patterns reached directly although `proxy` is set.
    #[serde(skip_serializing_if = "Vec::is_empty", serialize_with = "ser_patterns")]
    pub no_proxy: Vec<HostPattern>,
}

/// `[upstream] proxy`: an HTTP proxy that upstream connections are tunnelled through.
#[derive(Clone, PartialEq, Eq)]
pub struct ParentProxy {
    /// Its host name or address.
    pub host: String,
    /// Its port (80 when the URL names none).
    pub port: u16,
    /// The user name from the URL, if any.
    pub user: Option<String>,
    /// `Proxy-Authorization` for every CONNECT (Basic), when the URL carries credentials.
    pub authorization: Option<String>,
}

impl ParentProxy {
    /// The URL without its password.
    fn shown(&self) -> String {
        let user = self
            .user
            .as_ref()
            .map_or(String::new(), |u| format!("{u}:****@"));
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        format!("http://{user}{host}:{}", self.port)
    }
}

impl fmt::Debug for ParentProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown())
    }
}

impl fmt::Display for ParentProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown())
    }
}

impl Serialize for ParentProxy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.shown())
    }
}

fn ser_nets<S: serde::Serializer>(
    nets: &Option<Vec<ipnet::IpNet>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    let shown: Vec<String> = nets.iter().flatten().map(ToString::to_string).collect();
    shown.serialize(s)
}

fn ser_patterns<S: serde::Serializer>(patterns: &[HostPattern], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(patterns.iter().map(ToString::to_string))
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
    /// The environment variable holding a bearer token every read but the probes and the
    /// status page's HTML must carry (or the write token); none means reads are open to
    /// whoever reaches the listener.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_token_env: Option<String>,
    /// The read token itself, read from `read_token_env` at load.
    #[serde(skip)]
    pub read_token: Option<String>,
}

impl fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field("token_env", &self.token_env)
            .field("read_token_env", &self.read_token_env)
            .finish_non_exhaustive()
    }
}

/// Which store holds the budgets: `[store] backend`, as the file says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// In process memory, persisted to `state_file`: one instance.
    #[default]
    Memory,
    /// Postgres, shared by every instance that points at the same database.
    Postgres,
}

/// `[store]`: one variant per backend, each with its own keys only.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "backend", rename_all = "lowercase")]
pub enum StoreConfig {
    /// In process memory, persisted to a state file: one instance.
    Memory(MemoryConfig),
    /// Postgres, shared by every instance that points at the same database.
    Postgres(PostgresConfig),
}

/// `[store] backend = "memory"`.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryConfig {
    /// Where the memory store keeps lockouts and backoff across restarts. Default
    /// `pacegate-state.json` beside the config file.
    pub state_file: PathBuf,
}

/// `[store] backend = "postgres"`.
#[derive(Clone, Serialize)]
pub struct PostgresConfig {
    /// The URL, from `url` or else `PACEGATE_STORE_URL` (kept out of the normalised config:
    /// it may hold a password).
    #[serde(skip)]
    pub url: String,
    /// Connections the store may open. Default 8.
    pub connections: usize,
    /// How statements are sent: `prepared` (default) or `unnamed`, for a pooler in
    /// transaction mode.
    pub statements: Statements,
    /// PEM roots trusted for the store's TLS certificate, beside the system roots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// Apply the embedded migrations at start (under an advisory lock). Default true.
    pub migrate: bool,
    /// After a failover to a server that lost commits, put back what this instance knew of
    /// each budget (lockouts, pauses, backoff, the latest slots). Default true.
    pub reassert: bool,
    /// What to do while the store is unreachable. Default `divide`.
    pub on_unavailable: OnUnavailable,
    /// Live instances to assume for `divide` before any heartbeat was seen. Default 1.
    pub instances_hint: usize,
    /// With `divide`, the longest an instance that lost the store paces alone (beginning six
    /// seconds after its last heartbeat) before it refuses; the other instances hold its
    /// share of every rate back for as long. Default 60 s, at most 1 h.
    #[serde(with = "humantime_serde")]
    pub divide_for: Duration,
    /// Longest wait for a reservation's answer; a slower one delays that slot (the store
    /// counts as unreachable only on a connection error or a missed heartbeat). A reservation
    /// given up may still take its slot in the database, which only slows the destination.
    /// Default 1 s.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
}

impl fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("connections", &self.connections)
            .field("statements", &self.statements)
            .field("ca_file", &self.ca_file)
            .field("migrate", &self.migrate)
            .field("reassert", &self.reassert)
            .field("on_unavailable", &self.on_unavailable)
            .field("instances_hint", &self.instances_hint)
            .field("divide_for", &self.divide_for)
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
        #[serde(skip_serializing_if = "BTreeMap::is_empty")]
        meters: BTreeMap<&'a str, MeterOut>,
        /// Read only where a meter needs the body.
        #[serde(skip_serializing_if = "Option::is_none")]
        max_body: Option<usize>,
    }
    #[derive(Serialize)]
    struct MeterOut {
        per_minute: f64,
        cost: String,
        default: u64,
    }
    let map: BTreeMap<&str, Out> = dests
        .iter()
        .map(|d| {
            (
                d.name.as_str(),
                Out {
                    hosts: d.hosts.iter().map(ToString::to_string).collect(),
                    pace: &d.pace,
                    meters: d
                        .meters
                        .iter()
                        .map(|m| {
                            let out = MeterOut {
                                per_minute: m.pace.rate * 60.0,
                                cost: m.cost.to_string(),
                                default: m.default,
                            };
                            (m.name.as_str(), out)
                        })
                        .collect(),
                    max_body: (!d.meters.is_empty()).then_some(d.max_body),
                },
            )
        })
        .collect();
    map.serialize(s)
}

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::load_checking(path, true)
    }

    /// [`Config::load`] for a CA about to be made for this config: its files need not exist.
    pub fn load_before_ca(path: &Path) -> Result<Self, ConfigError> {
        Self::load_checking(path, false)
    }

    fn load_checking(path: &Path, ca_must_exist: bool) -> Result<Self, ConfigError> {
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
        let mut config = Self::parse_checking(&text, &base, ca_must_exist).map_err(|problems| {
            ConfigError::Invalid {
                path: path.to_owned(),
                problems,
            }
        })?;
        config.file = Some(path.to_owned());
        Ok(config)
    }

    /// Parses and validates config text; relative paths are resolved against `base`.
    /// Environment variables named by the config (`password_env`) are read here.
    pub fn parse(text: &str, base: &Path) -> Result<Self, Vec<ConfigProblem>> {
        Self::parse_checking(text, base, true)
    }

    fn parse_checking(
        text: &str,
        base: &Path,
        ca_must_exist: bool,
    ) -> Result<Self, Vec<ConfigProblem>> {
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
        let mut unreadable = Vec::new();
        let (p, u) = (&mut problems, &mut unreadable);
        let proxy: Option<RawProxy> = section(table.remove("proxy"), "proxy", p, u);
        let upstream: Option<RawUpstream> = section(table.remove("upstream"), "upstream", p, u);
        let admin: Option<RawAdmin> = section(table.remove("admin"), "admin", p, u);
        let tls: Option<RawTls> = section(table.remove("tls"), "tls", p, u);
        let store: Option<RawStore> = section(table.remove("store"), "store", p, u);
        let log: Option<RawLog> = section(table.remove("log"), "log", p, u);
        let cache: Option<Option<RawCache>> = match table.remove("cache") {
            None => Some(None),
            some => section::<RawCache>(some, "cache", p, u).map(Some),
        };
        let classes: Option<Option<RawClasses>> = match table.remove("classes") {
            None => Some(None),
            some => section::<RawClasses>(some, "classes", p, u).map(Some),
        };
        let mut raw_dests = BTreeMap::new();
        match table.remove("destinations") {
            None => {}
            Some(toml::Value::Table(t)) => {
                for (name, value) in t {
                    let path = format!("destinations.{name}");
                    let read = section::<RawDestination>(
                        Some(value),
                        &path,
                        &mut problems,
                        &mut unreadable,
                    );
                    if let Some(d) = read {
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
            problems.push(problem(&file::key_name(key), "unknown section"));
        }

        let mut v = Validator {
            problems,
            unreadable,
            base,
            ca_must_exist,
        };
        let config = Config {
            proxy: v.proxy(proxy.unwrap_or_default()),
            upstream: v.upstream(upstream.unwrap_or_default()),
            admin: v.admin(admin.unwrap_or_default()),
            tls: v.tls(tls.unwrap_or_default()),
            store: v.store(store.unwrap_or_default()),
            log: LogConfig {
                requests: log.unwrap_or_default().requests.unwrap_or_default(),
            },
            cache: cache.flatten().map(|c| v.cache(c)),
            classes: classes
                .flatten()
                .map_or_else(Classes::default, |c| v.classes(c)),
            destinations: v.destinations(raw_dests),
            file: None,
        };
        v.user_classes(&config);
        v.cache_needed(&config);
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

#[cfg(test)]
mod tests;
