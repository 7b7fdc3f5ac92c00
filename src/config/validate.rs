//! Validation: the file model in, the typed config out, and every problem found on the way
//! with its key path.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::file::*;
use super::*;
use crate::class::Classes;
use crate::destination::{Destination, HostPattern, Ports};

/// `[cache] disk` where `dir` is set and `disk` is not: 10 GiB.
const DEFAULT_DISK: u64 = 10 * 1024 * 1024 * 1024;

mod groups;
mod meters;
mod pace;

const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);
/// The shortest `[proxy.limits]` duration.
const MIN_LIMIT: Duration = Duration::from_millis(100);
/// The most client connections, requests in flight or pooled connections a key may ask for:
/// far above what one process's file descriptors allow.
const MAX_CLIENTS: usize = 1_000_000;

pub(super) struct Validator<'a> {
    pub(super) problems: Vec<ConfigProblem>,
    /// Keys whose values could not be read (already reported): nothing more is said of them.
    pub(super) unreadable: Vec<String>,
    pub(super) base: &'a Path,
    /// Whether the CA files must exist (not while a CA is being made for this config).
    pub(super) ca_must_exist: bool,
}

impl Validator<'_> {
    fn push(&mut self, path: &str, message: impl Into<String>) {
        let within = |key: &String| {
            path == key
                || path
                    .strip_prefix(key.as_str())
                    .is_some_and(|rest| rest.starts_with(['.', '[']))
        };
        if !self.unreadable.iter().any(within) {
            self.problems.push(problem(path, message));
        }
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

    /// `[store] divide_for`: 10 s by default, at least [`MIN_DIVIDE_FOR`], at most
    /// [`MAX_DIVIDE_FOR`].
    fn divide_for(&mut self, value: Option<Duration>) -> Duration {
        let d = value.unwrap_or(DEFAULT_DIVIDE_FOR);
        if d < MIN_DIVIDE_FOR || d > MAX_DIVIDE_FOR {
            self.push(
                "store.divide_for",
                format!(
                    "must be between 2s and {} (the other instances hold a lost instance's share back that long, and it stops pacing alone a second before)",
                    humantime::format_duration(MAX_DIVIDE_FOR)
                ),
            );
        }
        d
    }

    /// A duration key: longer than zero and at most `max`, so that no deadline computed from
    /// it can overflow. A bad value is reported and the default kept in its place.
    fn duration(
        &mut self,
        path: &str,
        value: Option<Duration>,
        default: Duration,
        max: Duration,
    ) -> Duration {
        let d = value.unwrap_or(default);
        if d.is_zero() || d > max {
            self.push(
                path,
                format!(
                    "must be longer than zero and at most {} (write it like \"250ms\" or \"30s\")",
                    humantime::format_duration(max)
                ),
            );
            return default;
        }
        d
    }

    /// A `[proxy.limits]` duration: within `max`, and no shorter than [`MIN_LIMIT`], below
    /// which a connection's timer would fire before any client or upstream could answer.
    fn limit_duration(
        &mut self,
        path: &str,
        value: Option<Duration>,
        default: Duration,
        max: Duration,
    ) -> Duration {
        match value {
            Some(d) if !d.is_zero() && d < MIN_LIMIT => {
                self.push(
                    path,
                    format!(
                        "must be at least {} (shorter, no client or upstream could answer in time)",
                        humantime::format_duration(MIN_LIMIT)
                    ),
                );
                default
            }
            _ => self.duration(path, value, default, max),
        }
    }

    /// A count key within `range`. A bad value is reported and the default kept in its place.
    fn count<T>(&mut self, path: &str, value: Option<T>, default: T, range: RangeInclusive<T>) -> T
    where
        T: PartialOrd + fmt::Display + Copy,
    {
        let n = value.unwrap_or(default);
        if !range.contains(&n) {
            self.push(
                path,
                format!("must be from {} to {}", range.start(), range.end()),
            );
            return default;
        }
        n
    }

    fn path(&self, p: PathBuf) -> PathBuf {
        if p.is_absolute() {
            p
        } else {
            self.base.join(p)
        }
    }

    pub(super) fn proxy(&mut self, raw: RawProxy) -> ProxyConfig {
        let limits = raw.limits.unwrap_or_default();
        let d = Limits::default();
        let threads = raw.threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        });
        let shutdown_grace = raw.shutdown_grace.unwrap_or(Duration::from_secs(30));
        if shutdown_grace > HOUR {
            self.push("proxy.shutdown_grace", "must be at most 1h");
        }
        let p = "proxy.limits";
        let listen = self.addr("proxy.listen", raw.listen, "127.0.0.1:3128");
        let clients = raw.clients.map(|list| self.clients(&list));
        // Beyond loopback, anyone who reaches the port could use pacegate as their proxy.
        if !listen.ip().is_loopback() && raw.auth.is_none() && clients.is_none() {
            self.push(
                "proxy.listen",
                format!(
                    "{listen} is beyond loopback, and without [proxy.auth] or [proxy] clients anyone who reaches it may use pacegate: list the networks allowed (clients = [\"10.0.0.0/8\"]), turn on [proxy.auth], or listen on 127.0.0.1"
                ),
            );
        }
        ProxyConfig {
            listen,
            clients,
            ports: self.ports("proxy.ports", raw.ports.as_deref()),
            unmatched: raw.unmatched.unwrap_or_default(),
            allow_private_upstreams: raw.allow_private_upstreams.unwrap_or(false),
            shutdown_grace: shutdown_grace.min(HOUR),
            threads: self.count("proxy.threads", Some(threads), 1, 1..=1024),
            auth: raw.auth.map(|a| self.auth(a)),
            limits: Limits {
                max_connections: self.count(
                    &format!("{p}.max_connections"),
                    limits.max_connections,
                    d.max_connections,
                    1..=MAX_CLIENTS,
                ),
                max_requests: self.count(
                    &format!("{p}.max_requests"),
                    limits.max_requests,
                    d.max_requests,
                    1..=MAX_CLIENTS,
                ),
                max_streams: self.count(
                    &format!("{p}.max_streams"),
                    limits.max_streams,
                    d.max_streams,
                    1..=10_000,
                ),
                max_header_bytes: self.count(
                    &format!("{p}.max_header_bytes"),
                    limits.max_header_bytes,
                    d.max_header_bytes,
                    8192..=1024 * 1024,
                ),
                header_read_timeout: self.limit_duration(
                    &format!("{p}.header_read_timeout"),
                    limits.header_read_timeout,
                    d.header_read_timeout,
                    HOUR,
                ),
                idle_timeout: self.limit_duration(
                    &format!("{p}.idle_timeout"),
                    limits.idle_timeout,
                    d.idle_timeout,
                    DAY,
                ),
                ping_interval: self.limit_duration(
                    &format!("{p}.ping_interval"),
                    limits.ping_interval,
                    d.ping_interval,
                    HOUR,
                ),
                ping_timeout: self.limit_duration(
                    &format!("{p}.ping_timeout"),
                    limits.ping_timeout,
                    d.ping_timeout,
                    HOUR,
                ),
                write_timeout: self.limit_duration(
                    &format!("{p}.write_timeout"),
                    limits.write_timeout,
                    d.write_timeout,
                    DAY,
                ),
                body_timeout: self.limit_duration(
                    &format!("{p}.body_timeout"),
                    limits.body_timeout,
                    d.body_timeout,
                    DAY,
                ),
                handshake_timeout: self.limit_duration(
                    &format!("{p}.handshake_timeout"),
                    limits.handshake_timeout,
                    d.handshake_timeout,
                    HOUR,
                ),
                tunnel_idle_timeout: self.limit_duration(
                    &format!("{p}.tunnel_idle_timeout"),
                    limits.tunnel_idle_timeout,
                    d.tunnel_idle_timeout,
                    7 * DAY,
                ),
            },
        }
    }

    /// A `ports` key: ports and ranges.
    pub(super) fn ports(&mut self, path: &str, raw: Option<&[RawPort]>) -> Ports {
        let mut ranges = Vec::new();
        for (i, p) in raw.unwrap_or_default().iter().enumerate() {
            let text = match p {
                RawPort::Number(n) => n.to_string(),
                RawPort::Text(t) => t.clone(),
            };
            match Ports::parse_one(&text) {
                Ok(r) => ranges.push(r),
                Err(e) => self.push(&format!("{path}[{i}]"), e),
            }
        }
        Ports::of(ranges)
    }

    /// `[proxy] clients`: networks (`10.0.0.0/8`, `fd00::/8`) or single addresses.
    fn clients(&mut self, list: &[String]) -> Vec<ipnet::IpNet> {
        let mut nets = Vec::new();
        for (i, text) in list.iter().enumerate() {
            let parsed = text
                .parse::<ipnet::IpNet>()
                .or_else(|_| text.parse::<std::net::IpAddr>().map(ipnet::IpNet::from));
            match parsed {
                // `10.1.2.3/8` is taken as the network it names, `10.0.0.0/8`.
                Ok(net) => nets.push(net.trunc()),
                Err(_) => self.push(
                    &format!("proxy.clients[{i}]"),
                    format!("`{text}` is not a network like \"10.0.0.0/8\" or an address"),
                ),
            }
        }
        if list.is_empty() {
            self.push(
                "proxy.clients",
                "lists no network: no client could connect; remove it to allow any that reaches proxy.listen",
            );
        }
        nets
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
                    Ok(pw) if !pw.is_empty() => Some(User::digest(pw.as_bytes())),
                    _ => {
                        self.push(
                            &format!("{path}.password_env"),
                            format!("environment variable `{var}` is not set or empty"),
                        );
                        None
                    }
                },
                (None, Some(hex)) => match decode_hex32(hex) {
                    Ok(d) => Some(d),
                    Err(_) => {
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
                    classes: u.classes,
                });
            }
        }
        AuthConfig {
            realm: raw.realm.unwrap_or_else(|| "pacegate".into()),
            users,
        }
    }

    pub(super) fn upstream(&mut self, raw: RawUpstream) -> UpstreamConfig {
        UpstreamConfig {
            connect_timeout: self.duration(
                "upstream.connect_timeout",
                raw.connect_timeout,
                Duration::from_secs(10),
                HOUR,
            ),
            response_timeout: self.duration(
                "upstream.response_timeout",
                raw.response_timeout,
                Duration::from_secs(60),
                DAY,
            ),
            pool_idle_timeout: self.duration(
                "upstream.pool_idle_timeout",
                raw.pool_idle_timeout,
                Duration::from_secs(4),
                HOUR,
            ),
            pool_max_idle_per_host: self.count(
                "upstream.pool_max_idle_per_host",
                raw.pool_max_idle_per_host,
                256,
                0..=MAX_CLIENTS,
            ),
            proxy: raw.proxy.as_deref().and_then(|url| self.parent_proxy(url)),
            no_proxy: self.no_proxy(raw.proxy.is_some(), raw.no_proxy.unwrap_or_default()),
        }
    }

    /// `upstream.proxy`: `http://[user[:password]@]host[:port]`.
    fn parent_proxy(&mut self, url: &str) -> Option<ParentProxy> {
        const KEY: &str = "upstream.proxy";
        let uri: http::Uri = match url.parse() {
            Ok(u) => u,
            Err(e) => {
                self.push(KEY, format!("`{url}` is not a URL: {e}"));
                return None;
            }
        };
        if uri.scheme_str() != Some("http") {
            self.push(KEY, "must be an http:// URL (the parent proxy is spoken to in plain HTTP, with CONNECT)");
            return None;
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            self.push(
                KEY,
                "must name only the proxy: http://[user:password@]host:port",
            );
            return None;
        }
        let authority = uri.authority()?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        if host.is_empty() {
            self.push(KEY, "names no host");
            return None;
        }
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map(|c| c.into_owned())
        };
        let credentials = authority.as_str().rsplit_once('@').map(|(userinfo, _)| {
            let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
            (decode(user), decode(password))
        });
        let (user, authorization) = match credentials {
            None => (None, None),
            Some((Ok(user), Ok(password))) => {
                use base64::Engine;
                let basic =
                    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
                (Some(user), Some(format!("Basic {basic}")))
            }
            Some(_) => {
                self.push(
                    KEY,
                    "its user name or password is not valid percent-encoded UTF-8",
                );
                return None;
            }
        };
        Some(ParentProxy {
            host: host.to_owned(),
            port: uri.port_u16().unwrap_or(80),
            user,
            authorization,
        })
    }

    /// `upstream.no_proxy`: host patterns, meaningful only with a proxy.
    fn no_proxy(&mut self, with_proxy: bool, raw: Vec<String>) -> Vec<HostPattern> {
        if !raw.is_empty() && !with_proxy {
            self.push("upstream.no_proxy", "has no effect without upstream.proxy");
        }
        let mut patterns = Vec::new();
        for (i, text) in raw.iter().enumerate() {
            match HostPattern::parse(text) {
                Ok(p) => patterns.push(p),
                Err(e) => self.push(&format!("upstream.no_proxy[{i}]"), e),
            }
        }
        patterns
    }

    pub(super) fn admin(&mut self, raw: RawAdmin) -> AdminConfig {
        let token = self.secret("admin.token_env", raw.token_env.as_deref());
        let read_token = self.secret("admin.read_token_env", raw.read_token_env.as_deref());
        let listen = self.addr("admin.listen", raw.listen, "127.0.0.1:9464");
        // Unlock changes what every instance does: beyond this machine, only with a token.
        if raw.token_env.is_none() && !listen.ip().is_loopback() {
            self.push(
                "admin.listen",
                format!(
                    "{listen} is beyond loopback, and without a token anyone who reaches it can unlock a destination: set admin.token_env, or listen on 127.0.0.1"
                ),
            );
        }
        AdminConfig {
            listen,
            token_env: raw.token_env,
            token,
            read_token_env: raw.read_token_env,
            read_token,
        }
    }

    /// A secret named by an environment variable key: the variable must be set and not empty.
    fn secret(&mut self, path: &str, var: Option<&str>) -> Option<String> {
        let var = var?;
        match std::env::var(var) {
            Ok(t) if !t.is_empty() => Some(t),
            _ => {
                self.push(
                    path,
                    format!("environment variable `{var}` is not set or empty"),
                );
                None
            }
        }
    }

    /// `[store]`: the backend's variant with its own keys. The postgres keys are checked
    /// whatever the backend (a wrong value is wrong before the switch too), and otherwise left
    /// unused, except `url`: a database named under `backend = "memory"` is a shared budget
    /// that never was, every instance pacing alone.
    pub(super) fn store(&mut self, mut raw: RawStore) -> StoreConfig {
        let backend = raw.backend.unwrap_or_default();
        let state_file = raw.state_file.take();
        if backend == Backend::Memory && raw.url.is_some() {
            self.push(
                "store.url",
                "names a database, but backend is \"memory\": every instance would pace alone on its own budget; set backend = \"postgres\", or remove url",
            );
        }
        let postgres = self.postgres(raw, backend == Backend::Postgres);
        match backend {
            Backend::Memory => StoreConfig::Memory(MemoryConfig {
                state_file: self.path(state_file.unwrap_or_else(|| "pacegate-state.json".into())),
            }),
            Backend::Postgres => StoreConfig::Postgres(postgres),
        }
    }

    /// The postgres keys; `chosen` when it is the backend (only then is a URL required).
    fn postgres(&mut self, raw: RawStore, chosen: bool) -> PostgresConfig {
        // The environment names the database of the backend chosen only.
        let url = raw.url.or_else(|| {
            chosen
                .then(|| std::env::var("PACEGATE_STORE_URL").ok())
                .flatten()
                .filter(|u| !u.is_empty())
        });
        let url = match url {
            None if !chosen => String::new(),
            None => {
                self.push(
                    "store.url",
                    "is required with backend = \"postgres\" (or set PACEGATE_STORE_URL, which keeps the password out of the file)",
                );
                String::new()
            }
            Some(u) => {
                if u.parse::<tokio_postgres::Config>().is_err() {
                    self.push(
                        "store.url",
                        "is not a postgres URL like postgres://user@host:5432/db",
                    );
                }
                u
            }
        };
        let connections = raw.connections.unwrap_or(8);
        if !(2..=1000).contains(&connections) {
            // One connection is kept for heartbeats and probes, so that lockouts and the live
            // count stay current while reservations hold every other one.
            self.push(
                "store.connections",
                "must be from 2 to 1000: one is kept for heartbeats, the rest serve reservations",
            );
        }
        PostgresConfig {
            url,
            connections,
            statements: raw.statements.unwrap_or_default(),
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
            reassert: raw.reassert.unwrap_or(true),
            on_unavailable: raw.on_unavailable.unwrap_or_default(),
            instances_hint: self.count("store.instances_hint", raw.instances_hint, 1, 1..=10_000),
            divide_for: self.divide_for(raw.divide_for),
            timeout: self.duration(
                "store.timeout",
                raw.timeout,
                Duration::from_secs(1),
                Duration::from_secs(600),
            ),
        }
    }

    /// `[cache]` (its disk tier's directory is opened, and found writable or not, at start).
    pub(super) fn cache(&mut self, raw: RawCache) -> CacheConfig {
        let default = CacheConfig::default();
        if raw.disk.is_some() && raw.dir.is_none() {
            self.push(
                "cache.disk",
                "bounds the disk tier, which needs cache.dir: set dir = \"/var/cache/pacegate\" (a directory pacegate can write), or leave disk out",
            );
        }
        if raw.dir.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
            self.push(
                "cache.dir",
                "is empty: name the directory of the disk tier, or leave dir out to keep responses in memory only",
            );
        }
        let mut size = |key: &str, raw: Option<&RawSize>, default: u64| -> u64 {
            let Some(raw) = raw else { return default };
            let n = match raw {
                RawSize::Bytes(n) => Some(*n),
                RawSize::Text(text) => text.parse::<bytesize::ByteSize>().ok().map(|b| b.as_u64()),
            };
            match n.filter(|n| (1024..=1 << 40).contains(n)) {
                Some(n) => n,
                None => {
                    self.push(
                        &format!("cache.{key}"),
                        "must be a size from 1KiB to 1TiB: a number of bytes, or a string such as \"256MiB\"",
                    );
                    default
                }
            }
        };
        let memory = size("memory", raw.memory.as_ref(), default.memory);
        // Within `memory` where it is not set: a small memory bounds the objects too.
        let max_object = size(
            "max_object",
            raw.max_object.as_ref(),
            default.max_object.min(memory),
        );
        let disk = size("disk", raw.disk.as_ref(), DEFAULT_DISK);
        if max_object > memory {
            self.push(
                "cache.max_object",
                format!("{max_object} bytes is more than cache.memory ({memory}): no response that large could be held"),
            );
        }
        if raw.dir.is_some() && max_object > disk {
            self.push(
                "cache.max_object",
                format!("{max_object} bytes is more than cache.disk ({disk}): no response that large could be written"),
            );
        }
        CacheConfig {
            memory,
            max_object,
            disk: raw.dir.is_some().then_some(disk),
            dir: raw.dir.filter(|d| !d.as_os_str().is_empty()),
            lead_timeout: self.duration(
                "cache.lead_timeout",
                raw.lead_timeout,
                default.lead_timeout,
                Duration::from_secs(600),
            ),
        }
    }

    /// A destination (or group) with `cache = true` has a `[cache]` section to share by.
    pub(super) fn cache_needed(&mut self, config: &Config) {
        if config.cache.is_some() {
            return;
        }
        for d in &config.destinations {
            let groups = d
                .groups
                .iter()
                .map(|g| (format!(".groups.{}", g.name), &g.pace));
            for (within, pace) in std::iter::once((String::new(), &d.pace)).chain(groups) {
                if pace.cache {
                    self.push(
                        &format!("destinations.{}{within}.cache", d.name),
                        "needs a [cache] section (e.g. `[cache]` with `memory = \"256MiB\"`): it bounds what identical requests in flight share",
                    );
                }
            }
        }
    }

    /// Each user's `classes` names configured classes.
    pub(super) fn user_classes(&mut self, config: &Config) {
        let Some(auth) = &config.proxy.auth else {
            return;
        };
        for (i, user) in auth.users.iter().enumerate() {
            for (j, name) in user.classes.iter().flatten().enumerate() {
                if config.classes.lookup(name).is_none() {
                    self.push(
                        &format!("proxy.auth.users[{i}].classes[{j}]"),
                        format!(
                            "`{name}` is not a class: expected one of {}",
                            config.classes.order.join(", ")
                        ),
                    );
                }
            }
        }
    }

    pub(super) fn tls(&mut self, raw: RawTls) -> TlsConfig {
        let mut leaf_validity = raw.leaf_validity.unwrap_or(DAY);
        if !(HOUR..=90 * DAY).contains(&leaf_validity) {
            self.push("tls.leaf_validity", "must be between 1h and 90d");
            leaf_validity = DAY;
        }
        let generate_ca = raw.generate_ca.unwrap_or(false);
        let ca_cert = self.path(raw.ca_cert.unwrap_or_else(|| "ca.pem".into()));
        let ca_key = self.path(raw.ca_key.unwrap_or_else(|| "ca-key.pem".into()));
        if !generate_ca && self.ca_must_exist {
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

    pub(super) fn classes(&mut self, raw: RawClasses) -> Classes {
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
            max_wait.insert(name, self.duration(&path, Some(d), d.min(DAY), DAY));
        }
        Classes {
            order,
            default,
            share,
            max_wait,
            configured: true,
        }
    }

    pub(super) fn destinations(
        &mut self,
        raw: BTreeMap<String, RawDestination>,
    ) -> Vec<Destination> {
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
            let ports = self.ports(&format!("{path}.ports"), d.ports.as_deref());
            for (key, set) in [
                ("paths", d.paths.is_some()),
                ("methods", d.methods.is_some()),
                ("resource", d.resource.is_some()),
            ] {
                if set {
                    self.push(
                        &format!("{path}.{key}"),
                        format!("belongs to a group: [{path}.groups.GROUP] {key} = ..."),
                    );
                }
            }
            let groups = self.groups(&path, &d, &pace);
            let meters = self.meters(&path, &d, &pace);
            let max_body = self.max_body(&path, &d);
            out.push(Destination {
                name,
                hosts: hosts.into_iter().map(|(_, p)| p).collect(),
                pace,
                ports,
                allow_private_upstreams: d.allow_private_upstreams,
                groups,
                meters,
                max_body,
            });
        }
        out
    }
}

/// A name of letters, digits, `_` and `-`: safe in metric labels, URLs, user names and headers.
pub(super) fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A SHA-256 digest written as 64 hex digits.
fn decode_hex32(text: &str) -> Result<[u8; 32], hex::FromHexError> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(text.trim(), &mut out)?;
    Ok(out)
}
