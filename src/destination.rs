//! Destinations: named groups of host patterns, and the routing of a request's target to one.
//!
//! A pattern is an exact host (`img.example.com`, `203.0.113.7`, `[2001:db8::1]`) or a suffix
//! wildcard (`*.example.net`, which matches any name below `example.net` but not `example.net`
//! itself), optionally followed by `:port`. Without a port a pattern matches every port.
//! Matching is case-insensitive and ignores a trailing dot.

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

/// What joins a group's budget name to its destination's: `DESTINATION/GROUP`. Names in the
/// config cannot hold it.
pub const GROUP_MARK: char = '/';

/// What joins a keyed budget's name to its key: `PARENT#KEY`, where `PARENT` is the budget
/// (a destination's, or `DESTINATION/GROUP`) split by key. Names in the config cannot hold it.
pub const KEY_MARK: char = '#';

/// What joins a destination's name to a meter's unit in the meter's budget name
/// (`openai~tokens`): a character no destination or unit name may hold.
pub const METER_MARK: char = '~';

use serde::Serialize;

use crate::meter::Cost;
use crate::signals::walls::Walls;
use crate::signals::Families;

mod host;
pub mod path;

pub use host::{normalise_host, split_host_port};

impl Pace {
    /// The pacing keys at `rate` with every other key at its default.
    pub fn new(rate: f64) -> Self {
        Self {
            rate,
            burst: 1,
            max_concurrency: 0,
            max_wait: Duration::from_secs(300),
            throttle_statuses: vec![429, 503],
            lockout_statuses: vec![403],
            backoff_factor: 2.0,
            backoff_max: 64.0,
            decay_after: 100,
            retry_after_max: Duration::from_secs(3600),
            retry_throttled: 3,
            intercept: true,
            advertise: true,
            mode: Mode::Enforce,
            quota: Vec::new(),
            window: None,
            signals: Families::ALL,
            reserve: 0,
            vendor_pace: VendorPace::Burst,
            throttle_block: None,
            throttle_body: vec!["rate limit".into(), "too many requests".into()],
            challenges: Walls::default(),
            challenge_share: 0.2,
            cache: false,
            key: None,
            max_keys: 10_000,
            max_keys_per_client: 5_000,
            key_idle: Duration::from_secs(600),
            total_rate: None,
        }
    }
}

/// What splits a budget into one budget per distinct value (`key`): the request's host, the
/// proxy user, or a request header. A request without the value takes the budget of the
/// empty value, one more key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyFrom {
    /// `host`: the target host, as routed (lower case).
    Host,
    /// `proxy-user`: the user name of the client's `Proxy-Authorization`.
    ProxyUser,
    /// `header:NAME`: a request header's value (the first, if repeated).
    Header(http::HeaderName),
    /// `json:FIELD`: a top-level field of a JSON request body (an LLM API's `model`).
    Json(String),
}

impl KeyFrom {
    /// Parses `host`, `proxy-user` or `header:NAME`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "host" => Ok(Self::Host),
            "proxy-user" => Ok(Self::ProxyUser),
            _ if text.starts_with("json:") => {
                let field = &text["json:".len()..];
                if field.is_empty() || field.len() > 128 || field.chars().any(char::is_whitespace) {
                    return Err(format!("`{field}` is not a JSON field name: write \"json:FIELD\", e.g. \"json:model\""));
                }
                Ok(Self::Json(field.to_owned()))
            }
            _ => match text.strip_prefix("header:") {
                Some(name) => match http::HeaderName::try_from(name) {
                    Err(_) => Err(format!("`{name}` is not a header name")),
                    Ok(name) if name == http::header::PROXY_AUTHORIZATION => Err(
                        "`proxy-authorization` is taken off every request before it is keyed, so every request would take the same empty key: to key by the proxy credential, write \"proxy-user\"".into(),
                    ),
                    Ok(name) if crate::headers::taken_off(&name) => Err(format!(
                        "`{name}` is taken off every request before it is keyed (a hop-by-hop or pacegate's own header), so every request would take the same empty key: key on a header that reaches the upstream, or on \"proxy-user\" or \"host\""
                    )),
                    Ok(name) => Ok(Self::Header(name)),
                },
                None => Err(format!(
                    "`{text}` is not a key: write \"host\", \"proxy-user\", \"header:NAME\" or \"json:FIELD\""
                )),
            },
        }
    }

    /// Whether the value may be a credential (a user name, a header such as
    /// `Authorization`): kept only as a keyed hash, never as it came. A JSON field's value
    /// (a model's name) is kept as it came where it is short and plain, else hashed too.
    pub fn is_credential(&self) -> bool {
        !matches!(self, Self::Host | Self::Json(_))
    }
}

impl fmt::Display for KeyFrom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Host => f.write_str("host"),
            Self::ProxyUser => f.write_str("proxy-user"),
            Self::Header(name) => write!(f, "header:{name}"),
            Self::Json(field) => write!(f, "json:{field}"),
        }
    }
}

impl Serialize for KeyFrom {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// The escalating block after a throttle without `Retry-After`: the destination pauses for
/// `min × 2^streak`, at most `max`, give or take `jitter` of it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Block {
    /// The first block.
    #[serde(with = "humantime_serde")]
    pub min: Duration,
    /// The longest block.
    #[serde(with = "humantime_serde")]
    pub max: Duration,
    /// The fraction a block may be longer or shorter by, 0 to below 1.
    pub jitter: f64,
}

impl Block {
    /// The block after `streak` throttles in a row, with `spread` (from -1 to 1) of the
    /// jitter applied. In whole microseconds, as the postgres store computes it.
    pub fn after(&self, streak: u32, spread: f64) -> Duration {
        let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let capped = us(self.min)
            .saturating_mul(1 << streak.min(40))
            .min(us(self.max));
        let jittered = capped as f64 * (1.0 + self.jitter * spread.clamp(-1.0, 1.0));
        Duration::from_micros(jittered.floor() as u64)
    }
}

/// A quota window: no `per` may hold more than `limit` sends, over every instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Quota {
    /// Sends allowed in any window.
    pub limit: u32,
    /// The window's length.
    #[serde(with = "humantime_serde")]
    pub per: Duration,
}

/// The host part of a pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostMatch {
    /// One exact, normalised host name or IP literal (IPv6 without brackets).
    Exact(String),
    /// Any name ending in this suffix, which starts with a dot (`.example.net`).
    Suffix(String),
}

/// One entry of a destination's `hosts` list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPattern {
    host: HostMatch,
    port: Option<u16>,
}

impl HostPattern {
    /// Parses `host`, `*.suffix`, either with `:port`, or `[v6]` / `[v6]:port`.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.contains('/') {
            return Err(format!("`{text}` is not a host pattern: write the host alone (`api.example.com`), not a URL"));
        }
        let (host, port) = split_host_port(text)
            .ok_or_else(|| format!("`{text}` is not a host pattern (expected `name`, `*.suffix`, optionally with `:port`)"))?;
        let port =
            match port {
                Some(p) => Some(p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
                    format!("`{text}`: port `{p}` is not a number from 1 to 65535")
                })?),
                None => None,
            };
        let host = if let Some(suffix) = host.strip_prefix("*.") {
            let suffix = normalise_host(suffix)
                .filter(|s| s.parse::<IpAddr>().is_err())
                .ok_or_else(|| format!("`{text}`: `{suffix}` is not a valid DNS name"))?;
            HostMatch::Suffix(format!(".{suffix}"))
        } else {
            let exact = normalise_host(host).ok_or_else(|| {
                format!("`{text}`: `{host}` is not a valid host name or IP address")
            })?;
            HostMatch::Exact(exact)
        };
        Ok(Self { host, port })
    }

    /// Whether a normalised host (see [`normalise_host`]) and port match this pattern.
    pub fn matches(&self, host: &str, port: u16) -> bool {
        if self.port.is_some_and(|p| p != port) {
            return false;
        }
        match &self.host {
            HostMatch::Exact(h) => h == host,
            HostMatch::Suffix(s) => host.len() > s.len() && host.ends_with(s.as_str()),
        }
    }

    /// The name a CA's name constraints permit for this pattern: the host, or the suffix of a
    /// `*.suffix` pattern (name constraints cannot keep the suffix itself out).
    pub fn ca_name(&self) -> &str {
        match &self.host {
            HostMatch::Exact(h) => h,
            HostMatch::Suffix(s) => s.trim_start_matches('.'),
        }
    }

    /// Whether some host and port would match both patterns.
    pub fn overlaps(&self, other: &Self) -> bool {
        if let (Some(a), Some(b)) = (self.port, other.port) {
            if a != b {
                return false;
            }
        }
        match (&self.host, &other.host) {
            (HostMatch::Exact(a), HostMatch::Exact(b)) => a == b,
            (HostMatch::Exact(h), HostMatch::Suffix(s))
            | (HostMatch::Suffix(s), HostMatch::Exact(h)) => {
                h.len() > s.len() && h.ends_with(s.as_str())
            }
            (HostMatch::Suffix(a), HostMatch::Suffix(b)) => {
                a.ends_with(b.as_str()) || b.ends_with(a.as_str())
            }
        }
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            HostMatch::Exact(h) if h.contains(':') => write!(f, "[{h}]")?,
            HostMatch::Exact(h) => f.write_str(h)?,
            HostMatch::Suffix(s) => write!(f, "*{s}")?,
        }
        if let Some(p) = self.port {
            write!(f, ":{p}")?;
        }
        Ok(())
    }
}

/// A configured destination: a name (used in metrics, logs and status), its host patterns and
/// how it is paced.
#[derive(Debug, Clone)]
pub struct Destination {
    /// The `NAME` of `[destinations.NAME]`.
    pub name: String,
    /// Patterns; no pattern of one destination overlaps one of another (checked by config).
    pub hosts: Vec<HostPattern>,
    /// The pacing keys.
    pub pace: Pace,
    /// Ports, besides the scheme's default, that its port-less patterns allow.
    pub ports: Ports,
    /// Whether its upstreams may be at private or loopback addresses; `None`: as
    /// `[proxy] allow_private_upstreams` says.
    pub allow_private_upstreams: Option<bool>,
    /// Groups of its requests, each with a budget of its own (see [`group_of`]); a request
    /// of none of them takes the destination's own budget.
    pub groups: Vec<Group>,
    /// Budgets in other units than requests (tokens, points), each request taking a slot of
    /// every one weighted by its cost: every request of its own budget, and of a group with
    /// no meters of its own.
    pub meters: Vec<Meter>,
    /// The most of a request body read before its slot, to estimate its cost to the meters
    /// (a larger one is refused with a 413). Read only where a meter needs the body.
    pub max_body: usize,
}

/// A request body read to estimate its cost is read up to this much by default (`max_body`).
pub const DEFAULT_MAX_BODY: usize = 4 * 1024 * 1024;

/// `[destinations.NAME.meters.UNIT]`: a budget in another unit than requests (tokens,
/// points), shared as a request budget is. A request takes a slot of it weighted by what it
/// is estimated to cost before it is sent, and the difference is settled once the response
/// says what it cost. Its budget is named `NAME~UNIT` (see [`METER_MARK`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Meter {
    /// The `UNIT` of the table's name.
    pub name: String,
    /// How a request's cost is estimated and settled.
    pub cost: Cost,
    /// What stands for what a request does not say (the output it may take, a query's
    /// points, a header not sent).
    pub default: u64,
    /// The most one request is estimated at: what the meter allows in a minute.
    pub size: u64,
    /// Its pacing keys, in its unit: `rate` units a second, a slot `burst` 1; the backoff,
    /// waits, signals and mode are the destination's.
    pub pace: Pace,
}

/// `[destinations.NAME.groups.GROUP]`: requests of a destination, picked by path prefix and
/// method, that have a budget of their own, as a vendor's separate buckets do (GitHub's
/// `search` beside its `core`). The budget is named `NAME/GROUP` in the store, in metrics and
/// in status.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// The `GROUP` of the table's name.
    pub name: String,
    /// Path prefixes (each starting with `/`); empty: any path.
    pub paths: Vec<String>,
    /// Methods, upper case; empty: any method.
    pub methods: Vec<String>,
    /// The vendor's name for this bucket (`x-ratelimit-resource`, or the IETF `pk`): a response that names it
    /// tells this group's budget what the vendor says, whichever budget sent the request.
    pub resource: Option<String>,
    /// Its pacing keys: its own, else the destination's.
    pub pace: Pace,
    /// Its meters (`[NAME.groups.GROUP.meters.UNIT]`), budgets named `NAME/GROUP~UNIT`: its
    /// requests take these instead of the destination's. None: the destination's.
    pub meters: Vec<Meter>,
}

impl Group {
    /// Whether a request fits, and how closely: the length of the path prefix that matched
    /// (0 without `paths`), then whether a listed method matched.
    fn fits(&self, method: &str, path: &str) -> Option<(usize, bool)> {
        if !self.methods.is_empty() && !self.methods.iter().any(|m| m == method) {
            return None;
        }
        let prefix = if self.paths.is_empty() {
            0
        } else {
            self.paths
                .iter()
                .filter(|p| path.starts_with(p.as_str()))
                .map(String::len)
                .max()?
        };
        Some((prefix, !self.methods.is_empty()))
    }
}

/// The group of `groups` a request belongs to: of those it fits, the one with the longest
/// matching path prefix, then one that lists its method over one that lists none, then the
/// first by name. `None`: the destination's own budget. The path is matched as the vendor
/// reads it ([`path::normalise`]), never as written: `//search/x` is in `/search/`'s group.
pub fn group_of(groups: &[Group], method: &str, path: &str) -> Option<usize> {
    if groups.is_empty() {
        return None;
    }
    let path = path::normalise(path);
    let path = path.as_ref();
    groups
        .iter()
        .enumerate()
        .filter_map(|(i, g)| g.fits(method, path).map(|fit| (fit, std::cmp::Reverse(i))))
        .max()
        .map(|(_, std::cmp::Reverse(i))| i)
}

/// Ports and port ranges (`[443, "8000-8999"]`), as `ports` keys list them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ports(Vec<std::ops::RangeInclusive<u16>>);

impl Ports {
    /// Parses one entry: a port (`8443`) or a range (`"8000-8999"`), each from 1 to 65535.
    pub fn parse_one(text: &str) -> Result<std::ops::RangeInclusive<u16>, String> {
        let port = |t: &str| {
            t.trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| {
                    format!("`{text}` is not a port from 1 to 65535 or a range like \"8000-8999\"")
                })
        };
        match text.split_once('-') {
            None => port(text).map(|p| p..=p),
            Some((from, to)) => {
                let (from, to) = (port(from)?, port(to)?);
                if from > to {
                    return Err(format!("`{text}`: the range ends before it starts"));
                }
                Ok(from..=to)
            }
        }
    }

    /// The ports of these ranges.
    pub fn of(ranges: Vec<std::ops::RangeInclusive<u16>>) -> Self {
        Self(ranges)
    }

    /// Whether `port` is listed.
    pub fn contains(&self, port: u16) -> bool {
        self.0.iter().any(|r| r.contains(&port))
    }

    /// Whether none is listed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for Ports {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let shown: Vec<String> = self
            .0
            .iter()
            .map(|r| {
                if r.start() == r.end() {
                    r.start().to_string()
                } else {
                    format!("{}-{}", r.start(), r.end())
                }
            })
            .collect();
        shown.serialize(s)
    }
}

/// The names the local CA signs for: every host pattern of the destinations that intercept
/// (see [`HostPattern::ca_name`]), once each.
pub fn ca_names(destinations: &[Destination]) -> Vec<&str> {
    let mut names: Vec<&str> = destinations
        .iter()
        .filter(|d| d.pace.intercept)
        .flat_map(|d| d.hosts.iter().map(HostPattern::ca_name))
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// How a vendor's view of its budget paces the requests while it has some left.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VendorPace {
    /// At the configured rate until `remaining` is down to `reserve`, then a pause until the
    /// reset: what octokit and go-github do. A budget with plenty left is not a drip.
    #[default]
    Burst,
    /// `remaining − reserve` spread evenly until the reset (and never faster than the rate):
    /// the budget lasts its window whatever the load, as prawcore paces.
    Spread,
}

impl VendorPace {
    /// The name used in config and status.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Burst => "burst",
            Self::Spread => "spread",
        }
    }
}

/// Whether a destination's pace is enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Requests wait for their slot, and refusals refuse.
    #[default]
    Enforce,
    /// Requests are forwarded at once while the pacer computes when each would have gone
    /// and counts what it would have refused. Verdicts are still recorded, so backoff,
    /// pauses and the vendor's signals are learned; a lockout refuses nothing.
    Shadow,
}

impl Mode {
    /// The name used in config and status.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
        }
    }
}

/// A destination's pacing keys, validated. The names are the config's and the spec's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Pace {
    /// Requests per second, over every instance; > 0, fractional allowed.
    pub rate: f64,
    /// Slots that may be taken at once after an idle spell. Default 1.
    pub burst: u32,
    /// Requests in flight per instance; 0 means unbounded. Default 0.
    pub max_concurrency: usize,
    /// Longest wait for a slot before a 503. Default 5 min.
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// Statuses that widen the interval. Default 429, 503.
    pub throttle_statuses: Vec<u16>,
    /// Statuses that lock the destination out. Default 403.
    pub lockout_statuses: Vec<u16>,
    /// Backoff multiplier per throttle (and divisor per decay); > 1. Default 2.
    pub backoff_factor: f64,
    /// Largest backoff; >= 1. Default 64.
    pub backoff_max: f64,
    /// Clean responses in a row before the backoff decays once; >= 1. Default 100.
    pub decay_after: u32,
    /// Longest pause a Retry-After can impose. Default 1 h.
    #[serde(with = "humantime_serde")]
    pub retry_after_max: Duration,
    /// In-proxy retries of throttled idempotent, body-less requests. Default 3.
    pub retry_throttled: u32,
    /// Intercept CONNECT (default); false makes it a blind tunnel that takes one slot and
    /// sees no verdicts.
    pub intercept: bool,
    /// Tell clients of the budget in the RateLimit fields of its responses (default).
    pub advertise: bool,
    /// Enforce the pace (default), or only compute and count it.
    pub mode: Mode,
    /// Quota windows on top of the rate. Default none.
    pub quota: Vec<Quota>,
    /// A meter's own window, its size over its length (see `budget::Rule::window`); none
    /// for a request budget.
    pub window: Option<Quota>,
    /// The vendor rate-limit header families read. Default all.
    pub signals: Families,
    /// The vendor's remaining requests left unused. Default 0.
    pub reserve: u32,
    /// How the vendor's remaining requests are spent until its reset. Default burst.
    pub vendor_pace: VendorPace,
    /// The escalating block after a throttle without `Retry-After`. Default none: a
    /// throttle only widens the interval.
    pub throttle_block: Option<Block>,
    /// Lower-case markers that make a lockout-status body a throttle. Default "rate limit",
    /// "too many requests".
    pub throttle_body: Vec<String>,
    /// The bot walls whose challenges are told from lockouts. Default every product known.
    pub challenges: Walls,
    /// The share of responses over 5 minutes past which challenges widen the pace, as a
    /// throttle does. Default 0.2.
    pub challenge_share: f64,
    /// Identical GET and HEAD requests in flight share one fetch (collapsed forwarding; needs
    /// a `[cache]` section). Default false.
    pub cache: bool,
    /// One budget per distinct value of this, each with every key above; default none: one
    /// budget.
    pub key: Option<KeyFrom>,
    /// The most keys this instance keeps a budget for at once; a request with a new key past
    /// it is refused. Default 10,000.
    pub max_keys: usize,
    /// The most of those keys one client (its proxy user, else its address) may have made:
    /// one client minting keys cannot take every place and refuse every new tenant. Default
    /// half of `max_keys`, and never under 100 (or `max_keys`, where that is less).
    pub max_keys_per_client: usize,
    /// How long a key's budget is kept after its last request. Default 10 min.
    #[serde(with = "humantime_serde")]
    pub key_idle: Duration,
    /// With `key`: a ceiling over every key together (requests per second); each request
    /// takes a slot in its key's budget and one in the total. Default none.
    pub total_rate: Option<f64>,
}

/// The ports an `http://` request may go to without a `ports` entry. As squid's `Safe_ports`
/// and `SSL_ports` do, a host pattern without a port matches only its scheme's default ports
/// and the destination's `ports`: a paced host is not a way to reach its SSH, SMTP or admin
/// port.
pub const HTTP: &[u16] = &[80];
/// The ports a CONNECT may go to without a `ports` entry: 443, and 80 for clients that tunnel
/// their `http://` requests too (undici's `ProxyAgent`, which Node's `EnvHttpProxyAgent` uses);
/// port 80 of such a host is reachable by plain http anyway.
pub const CONNECT: &[u16] = &[443, 80];

/// The routing table: which destination, if any, a target host and port belong to. `T` is
/// what routing yields for a destination (the pacer's handle to its lane).
#[derive(Debug, Clone)]
pub struct Routes<T> {
    entries: Vec<(Vec<HostPattern>, Ports, T)>,
}

/// Where a target goes.
#[derive(Debug, PartialEq, Eq)]
pub enum Routed<T> {
    /// To this destination.
    To(T),
    /// A destination's host, on a port it does not allow.
    PortRefused(T),
    /// No destination's.
    Nowhere,
}

impl<T> Routed<&T> {
    /// The same answer, owning what it names.
    pub fn cloned(self) -> Routed<T>
    where
        T: Clone,
    {
        match self {
            Routed::To(t) => Routed::To(t.clone()),
            Routed::PortRefused(t) => Routed::PortRefused(t.clone()),
            Routed::Nowhere => Routed::Nowhere,
        }
    }
}

impl<T> FromIterator<(Vec<HostPattern>, Ports, T)> for Routes<T> {
    /// Builds the table from each destination's patterns and extra `ports`; config
    /// validation guarantees that patterns do not overlap.
    fn from_iter<I: IntoIterator<Item = (Vec<HostPattern>, Ports, T)>>(entries: I) -> Self {
        Self {
            entries: entries.into_iter().collect(),
        }
    }
}

impl<T> Routes<T> {
    /// Where a normalised host and port go, `default_ports` being the request's ([`HTTP`]
    /// or [`CONNECT`]). A pattern with a port matches that port only; one without matches
    /// the default ports and the destination's `ports`.
    pub fn route(&self, host: &str, port: u16, default_ports: &[u16]) -> Routed<&T> {
        for (hosts, ports, to) in &self.entries {
            for p in hosts {
                if p.port.is_some() {
                    if p.matches(host, port) {
                        return Routed::To(to);
                    }
                } else if p.matches(host, port) {
                    let safe = default_ports.contains(&port) || ports.contains(port);
                    return if safe {
                        Routed::To(to)
                    } else {
                        Routed::PortRefused(to)
                    };
                }
            }
        }
        Routed::Nowhere
    }

    /// Every destination's entry, in config order.
    pub fn all(&self) -> impl Iterator<Item = &T> {
        self.entries.iter().map(|(_, _, t)| t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pat(s: &str) -> HostPattern {
        HostPattern::parse(s).unwrap()
    }

    #[test]
    fn exact_pattern_matches_any_port_case_insensitively() {
        let p = pat("Img.Example.com");
        assert!(p.matches("img.example.com", 443));
        assert!(p.matches("img.example.com", 80));
        assert!(!p.matches("cdn.img.example.com", 443));
    }

    #[test]
    fn wildcard_matches_subdomains_only() {
        let p = pat("*.example.net");
        assert!(p.matches("a.example.net", 443));
        assert!(p.matches("a.b.example.net", 443));
        assert!(!p.matches("example.net", 443));
        assert!(!p.matches("badexample.net", 443));
    }

    #[test]
    fn port_restricts_the_match() {
        let p = pat("api.example.com:8443");
        assert!(p.matches("api.example.com", 8443));
        assert!(!p.matches("api.example.com", 443));
    }

    #[test]
    fn ip_literals_are_normalised() {
        assert!(pat("[::1]:8080").matches("::1", 8080));
        assert!(pat("127.0.0.1").matches("127.0.0.1", 1));
        assert_eq!(normalise_host("[0:0::1]").as_deref(), Some("::1"));
    }

    #[test]
    fn rejects_malformed_patterns() {
        for bad in [
            "",
            "*.",
            "a..b",
            "exa mple.com",
            "host:0",
            "host:99999",
            "*.1.2.3.4",
            "-a.com",
            "[::1",
        ] {
            assert!(HostPattern::parse(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn overlap_detection() {
        assert!(pat("a.example.net").overlaps(&pat("*.example.net")));
        assert!(pat("*.b.example.net").overlaps(&pat("*.example.net")));
        assert!(!pat("a.example.net:80").overlaps(&pat("a.example.net:443")));
        assert!(pat("a.example.net").overlaps(&pat("a.example.net:443")));
        assert!(!pat("example.net").overlaps(&pat("*.example.net")));
    }

    #[test]
    fn ports_are_only_the_default_and_the_listed_ones() {
        let listed = Ports::of(vec![
            Ports::parse_one("8").unwrap(),
            Ports::parse_one("8000-8999").unwrap(),
        ]);
        let routes: Routes<&str> = [
            (
                vec![HostPattern::parse("api.example.com").unwrap()],
                listed,
                "api",
            ),
            (
                vec![HostPattern::parse("ssh.example.com:22").unwrap()],
                Ports::default(),
                "ssh",
            ),
        ]
        .into_iter()
        .collect();
        // The default port given names the request: 443 a CONNECT, 80 a plain http one.
        let route = |host, port, default| {
            routes.route(host, port, if default == 443 { CONNECT } else { HTTP })
        };
        assert_eq!(route("api.example.com", 443, 443), Routed::To(&"api"));
        assert_eq!(route("api.example.com", 80, 80), Routed::To(&"api"));
        assert_eq!(
            route("api.example.com", 8443, 443),
            Routed::To(&"api"),
            "in a range"
        );
        assert_eq!(route("api.example.com", 8000, 80), Routed::To(&"api"));
        assert_eq!(route("api.example.com", 8999, 443), Routed::To(&"api"));
        assert_eq!(
            route("api.example.com", 8, 443),
            Routed::To(&"api"),
            "listed"
        );
        // High ports are no exception: only the default and the listed ones.
        for high in [1024, 7999, 9000, 9464, 65535] {
            assert_eq!(
                route("api.example.com", high, 443),
                Routed::PortRefused(&"api")
            );
            assert_eq!(
                route("api.example.com", high, 80),
                Routed::PortRefused(&"api")
            );
        }
        assert_eq!(
            route("api.example.com", 22, 443),
            Routed::PortRefused(&"api")
        );
        // A CONNECT to port 80: a client that tunnels its http:// requests too.
        assert_eq!(route("api.example.com", 80, 443), Routed::To(&"api"));
        assert_eq!(
            route("api.example.com", 443, 80),
            Routed::PortRefused(&"api")
        );
        // A pattern that names its port allows that port only.
        assert_eq!(route("ssh.example.com", 22, 443), Routed::To(&"ssh"));
        assert_eq!(route("ssh.example.com", 23, 443), Routed::Nowhere);
        assert_eq!(route("other.example.com", 443, 443), Routed::Nowhere);
    }

    #[test]
    fn port_entries_are_ports_or_ranges() {
        assert_eq!(Ports::parse_one("443"), Ok(443..=443));
        assert_eq!(Ports::parse_one("8000-8999"), Ok(8000..=8999));
        assert_eq!(Ports::parse_one(" 1 - 65535 "), Ok(1..=65535));
        for bad in [
            "0",
            "65536",
            "8999-8000",
            "-",
            "80-",
            "a-b",
            "",
            "1-2-3",
            "99999",
        ] {
            assert!(Ports::parse_one(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn display_round_trips() {
        for s in [
            "img.example.com",
            "*.example.net:8443",
            "[::1]:80",
            "10.0.0.1",
        ] {
            assert_eq!(pat(s).to_string(), s);
        }
    }

    fn group(name: &str, paths: &[&str], methods: &[&str]) -> Group {
        Group {
            name: name.into(),
            paths: paths.iter().map(|p| p.to_string()).collect(),
            methods: methods.iter().map(|m| m.to_string()).collect(),
            resource: None,
            pace: Pace::new(1.0),
            meters: Vec::new(),
        }
    }

    #[test]
    fn a_request_takes_the_most_specific_group_it_fits() {
        let groups = [
            group("search", &["/search/"], &[]),
            group("code", &["/search/code"], &[]),
            group("writes", &[], &["POST", "PATCH"]),
            group("search_writes", &["/search/"], &["POST"]),
        ];
        let of = |m: &str, p: &str| group_of(&groups, m, p).map(|i| groups[i].name.as_str());
        assert_eq!(of("GET", "/search/issues?q=x"), Some("search"));
        // The longer prefix wins, whatever the order.
        assert_eq!(of("GET", "/search/code"), Some("code"));
        // At the same prefix, the group that lists the method.
        assert_eq!(of("POST", "/search/issues"), Some("search_writes"));
        // A method alone is the least specific match.
        assert_eq!(of("POST", "/repos/a/b/issues"), Some("writes"));
        // Neither: the destination's own budget.
        assert_eq!(of("GET", "/repos/a/b"), None);
        assert_eq!(of("GET", "/searching"), None);
    }
}
