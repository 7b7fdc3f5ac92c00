//! What a vendor says about its budget in response headers: requests remaining, the limit,
//! and when the window resets. Each header family reads differently (see
//! `docs/vendor-signals.md`); all are reduced to one [`Signal`]. A field
//! that does not parse is ignored, never an error: vendors' headers are input from outside.
//! What a vendor says of a budget in tokens or points, for a meter, is read apart
//! ([`tokens`]), and so is a bot-management product's challenge ([`walls`]).

use std::fmt;
use std::time::{Duration, SystemTime};

use http::header::{HeaderMap, HeaderName, AGE};
use std::convert::Infallible;

use sfv::visitor::{
    EntryVisitor, Ignored, InnerListVisitor, ItemVisitor, ListVisitor, ParameterVisitor,
};
use sfv::{BareItemFromInput, KeyRef, Parser};

/// A family of rate-limit headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// The IETF `RateLimit` and `RateLimit-Policy` structured fields.
    Ietf,
    /// `x-ratelimit-*`: GitHub (reset in Unix seconds), Reddit (remaining as a float, reset in
    /// seconds left), Discord (`reset-after` in fractional seconds).
    XRateLimit,
    /// `x-rate-limit-*`: X (Twitter), reset in Unix seconds.
    XRateLimitHyphen,
    /// `x-ratelimit-*-requests`: OpenAI-style APIs, reset as a Go duration (`6m0s`, `12ms`).
    Requests,
    /// `x-shopify-shop-api-call-limit: used/limit`, a leaky bucket with no reset.
    Shopify,
    /// A meter's budget in tokens or points (see [`tokens`]): never read for a request
    /// budget, so not among [`Family::ALL`], nor a name config takes.
    Tokens,
}

impl Family {
    /// Every family, in the order they are read.
    pub const ALL: [Family; 5] = [
        Family::Ietf,
        Family::XRateLimit,
        Family::XRateLimitHyphen,
        Family::Requests,
        Family::Shopify,
    ];

    /// The name used in config, status and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Ietf => "ietf",
            Family::XRateLimit => "x-ratelimit",
            Family::XRateLimitHyphen => "x-rate-limit",
            Family::Requests => "x-ratelimit-requests",
            Family::Shopify => "shopify",
            Family::Tokens => "tokens",
        }
    }

    /// The family called `name` in config.
    pub fn from_name(name: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.as_str() == name)
    }

    /// The family a store kept as `name`: one of config's, or a meter's [`Family::Tokens`].
    pub fn stored(name: &str) -> Option<Family> {
        Family::from_name(name).or((name == Family::Tokens.as_str()).then_some(Family::Tokens))
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The families a destination reads (`signals` in config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Families(u8);

impl Families {
    /// Every family (`signals = "auto"`).
    pub const ALL: Families = Families(0b1_1111);
    /// None (`signals = "none"`).
    pub const NONE: Families = Families(0);

    /// Just these.
    pub fn of(list: &[Family]) -> Families {
        Families(list.iter().fold(0, |bits, f| bits | f.bit()))
    }

    /// Whether `family` is read.
    pub fn reads(self, family: Family) -> bool {
        self.0 & family.bit() != 0
    }

    /// Whether nothing is read.
    pub fn is_none(self) -> bool {
        self.0 == 0
    }
}

impl serde::Serialize for Families {
    /// As written in config: `"auto"`, `"none"`, or the list of family names.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            Families::ALL => s.serialize_str("auto"),
            Families::NONE => s.serialize_str("none"),
            _ => s.collect_seq(
                Family::ALL
                    .iter()
                    .filter(|f| self.reads(**f))
                    .map(|f| f.as_str()),
            ),
        }
    }
}

/// When a vendor's window resets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reset {
    /// This long after the response.
    In(Duration),
    /// At this instant of the vendor's wall clock (a Unix timestamp in a header).
    At(SystemTime),
}

impl Reset {
    /// How long after `now` it comes; `None` for one in the past.
    pub fn after(self, now: SystemTime) -> Option<Duration> {
        match self {
            Reset::In(d) => Some(d),
            Reset::At(at) => at.duration_since(now).ok(),
        }
    }
}

/// What one response says about the vendor's budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signal {
    /// The family it was read from.
    pub family: Family,
    /// Requests left in the window.
    pub remaining: u64,
    /// The window's limit, where the family gives it.
    pub limit: Option<u64>,
    /// When the window resets, where the family gives it.
    pub reset: Option<Reset>,
}

impl Signal {
    /// Whether the vendor's budget is spent.
    pub fn exhausted(&self) -> bool {
        self.remaining == 0
    }

    /// How long until the reset, read against `now` (the response's own date or this clock);
    /// `None` without a reset, or for one in the past.
    pub fn reset_in(&self, now: SystemTime) -> Option<Duration> {
        self.reset?.after(now)
    }
}

/// Reads every family in `families` from `headers` and returns the strictest signal: a spent
/// budget first (the one that resets last), else the one that leaves the fewest requests per
/// second until its reset. `now` places resets given as Unix time; the caller passes the
/// response's `Date` when it has one.
pub fn read(headers: &HeaderMap, families: Families, now: SystemTime) -> Option<Signal> {
    if families.is_none() || !may_carry(headers) {
        return None;
    }
    let mut best: Option<(Signal, (bool, f64))> = None;
    for family in Family::ALL {
        if !families.reads(family) {
            continue;
        }
        let Some(signal) = read_family(headers, family) else {
            continue;
        };
        let key = strictness(&signal, now);
        if best.as_ref().is_none_or(|(_, k)| stricter(key, *k)) {
            best = Some((signal, key));
        }
    }
    best.map(|(s, _)| s)
}

/// The vendor's name for the bucket a response's figures are about: GitHub's
/// `x-ratelimit-resource` (`core`, `search`, `graphql`), else the partition key (`pk`, a byte
/// sequence read as UTF-8) of the first IETF `RateLimit` item that has one. A destination's
/// group whose `resource` is this name gets what the response says.
pub fn resource(headers: &HeaderMap) -> Option<std::borrow::Cow<'_, str>> {
    if let Some(named) = text(headers, "x-ratelimit-resource").filter(|r| !r.is_empty()) {
        return Some(std::borrow::Cow::Borrowed(named));
    }
    let value = headers.get(HeaderName::from_static("ratelimit"))?;
    let mut limits = Members::default();
    Parser::new(value.as_bytes())
        .parse_list_with_visitor(&mut limits)
        .ok()?;
    let pk = limits.0.into_iter().find_map(|m| m.pk)?;
    String::from_utf8(pk)
        .ok()
        .filter(|r| !r.is_empty())
        .map(std::borrow::Cow::Owned)
}

/// Whether any header could be a family's: every family's names start with one of these.
/// One pass over the names, with no lookups, settles it for the many responses that carry
/// none, before [`read`] looks up each family's names in turn.
pub fn may_carry(headers: &HeaderMap) -> bool {
    const PREFIXES: [&str; 4] = ["ratelimit", "x-ratelimit", "x-rate-limit", "x-shopify-"];
    headers.keys().any(|name| {
        let name = name.as_str();
        // Each prefix starts with `r` or `x`: most names are ruled out by their first letter.
        matches!(name.as_bytes().first(), Some(b'r' | b'x'))
            && PREFIXES.iter().any(|p| name.starts_with(p))
    })
}

/// `(spent, seconds per remaining request)`: larger is stricter.
fn strictness(signal: &Signal, now: SystemTime) -> (bool, f64) {
    // A signal without a reset says only how many are left: count it as a one-second window.
    let window = signal
        .reset_in(now)
        .map_or(1.0, |d| d.as_secs_f64().max(1e-3));
    (
        signal.exhausted(),
        window / (signal.remaining.max(1) as f64),
    )
}

fn stricter(a: (bool, f64), b: (bool, f64)) -> bool {
    a.0 && !b.0 || a.0 == b.0 && a.1 > b.1
}

/// One family's signal, if its headers are there and parse.
pub fn read_family(headers: &HeaderMap, family: Family) -> Option<Signal> {
    match family {
        Family::Ietf => ietf(headers),
        Family::XRateLimit => x_ratelimit(headers),
        Family::XRateLimitHyphen => x_rate_limit(headers),
        Family::Requests => requests(headers),
        Family::Shopify => shopify(headers),
        Family::Tokens => None,
    }
}

fn text<'a>(headers: &'a HeaderMap, name: &'static str) -> Option<&'a str> {
    headers
        .get(HeaderName::from_static(name))?
        .to_str()
        .ok()
        .map(str::trim)
}

/// A non-negative count: an integer, or a float (Reddit's `598.0`), rounded down.
fn count(text: &str) -> Option<u64> {
    if let Ok(n) = text.parse::<u64>() {
        return Some(n);
    }
    let f = text
        .parse::<f64>()
        .ok()
        .filter(|f| f.is_finite() && *f >= 0.0)?;
    // Saturates for absurd values: "very many" is still many.
    Some(f.floor() as u64)
}

/// A non-negative number of seconds, possibly fractional.
fn seconds(text: &str) -> Option<f64> {
    text.parse::<f64>()
        .ok()
        .filter(|f| f.is_finite() && *f >= 0.0)
}

/// Seconds as a duration, saturating instead of panicking on huge values.
fn duration(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
}

/// Above this, a bare reset number is a Unix timestamp; at or below, seconds from now.
const UNIX_SECONDS_FROM: f64 = 1e9;

fn bare_reset(text: &str) -> Option<Reset> {
    let secs = seconds(text)?;
    Some(if secs > UNIX_SECONDS_FROM {
        Reset::At(SystemTime::UNIX_EPOCH.checked_add(duration(secs))?)
    } else {
        Reset::In(duration(secs))
    })
}

fn x_ratelimit(headers: &HeaderMap) -> Option<Signal> {
    let remaining = count(text(headers, "x-ratelimit-remaining")?)?;
    // Discord's `reset-after` is exact (fractional seconds left); its `reset` is the same
    // instant as a timestamp.
    let reset = text(headers, "x-ratelimit-reset-after")
        .and_then(seconds)
        .map(|s| Reset::In(duration(s)))
        .or_else(|| text(headers, "x-ratelimit-reset").and_then(bare_reset));
    Some(Signal {
        family: Family::XRateLimit,
        remaining,
        limit: text(headers, "x-ratelimit-limit").and_then(count),
        reset,
    })
}

fn x_rate_limit(headers: &HeaderMap) -> Option<Signal> {
    Some(Signal {
        family: Family::XRateLimitHyphen,
        remaining: count(text(headers, "x-rate-limit-remaining")?)?,
        limit: text(headers, "x-rate-limit-limit").and_then(count),
        reset: text(headers, "x-rate-limit-reset").and_then(bare_reset),
    })
}

fn requests(headers: &HeaderMap) -> Option<Signal> {
    Some(Signal {
        family: Family::Requests,
        remaining: count(text(headers, "x-ratelimit-remaining-requests")?)?,
        limit: text(headers, "x-ratelimit-limit-requests").and_then(count),
        reset: text(headers, "x-ratelimit-reset-requests")
            .and_then(go_duration)
            .map(Reset::In),
    })
}

/// A Go duration as OpenAI-style APIs write resets: `1s`, `6m0s`, `12ms`, `1h2m3.5s`; a bare
/// number is seconds.
fn go_duration(text: &str) -> Option<Duration> {
    if let Some(s) = seconds(text) {
        return Some(duration(s));
    }
    if text.is_empty() {
        return None;
    }
    let mut total = 0.0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter(|n| *n > 0)?;
        let value: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_len..];
    }
    total.is_finite().then(|| duration(total))
}

/// Shopify's `used/limit` bucket. It has no reset: the bucket leaks (2 requests a second on
/// standard plans), so the room it reports is taken to last one second.
fn shopify(headers: &HeaderMap) -> Option<Signal> {
    let (used, limit) = text(headers, "x-shopify-shop-api-call-limit")?.split_once('/')?;
    let (used, limit) = (count(used.trim())?, count(limit.trim())?);
    Some(Signal {
        family: Family::Shopify,
        remaining: limit.saturating_sub(used),
        limit: Some(limit),
        reset: Some(Reset::In(Duration::from_secs(1))),
    })
}

/// The IETF fields: `RateLimit: "name";r=R;t=T` per policy, with `RateLimit-Policy:
/// "name";q=Q;w=W` giving the quota. Policies counted in another unit than requests
/// (`qu="content-bytes"`) are skipped; of several, the strictest is kept. Ignored on a
/// response served from a cache (`Age` above 0), as the draft asks. A field that is not a
/// valid structured list is ignored whole.
fn ietf(headers: &HeaderMap) -> Option<Signal> {
    let value = headers.get(HeaderName::from_static("ratelimit"))?;
    if headers
        .get(AGE)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.trim() != "0")
    {
        return None;
    }
    let mut limits = Members::default();
    Parser::new(value.as_bytes())
        .parse_list_with_visitor(&mut limits)
        .ok()?;
    let mut policies = Members::default();
    if let Some(p) = headers.get(HeaderName::from_static("ratelimit-policy")) {
        if Parser::new(p.as_bytes())
            .parse_list_with_visitor(&mut policies)
            .is_err()
        {
            policies.0.clear();
        }
    }
    let mut best: Option<(Signal, (bool, f64))> = None;
    for limit in &limits.0 {
        let Some(remaining) = limit.r else {
            continue;
        };
        let policy = policies.0.iter().find(|p| p.name == limit.name);
        if policy.is_some_and(|p| p.other_unit) {
            continue;
        }
        let signal = Signal {
            family: Family::Ietf,
            remaining,
            limit: policy.and_then(|p| p.q),
            reset: limit.t.map(|t| Reset::In(Duration::from_secs(t))),
        };
        // `t` is a delta, so the clock does not matter for comparing.
        let key = strictness(&signal, SystemTime::UNIX_EPOCH);
        if best.as_ref().is_none_or(|(_, k)| stricter(key, *k)) {
            best = Some((signal, key));
        }
    }
    best.map(|(s, _)| s)
}

/// One item of `RateLimit` or `RateLimit-Policy`: its name and the parameters pacegate reads.
/// Read with sfv's visitor, which borrows from the header instead of building maps.
#[derive(Debug, Default)]
struct Member<'de> {
    name: Option<BareItemFromInput<'de>>,
    r: Option<u64>,
    t: Option<u64>,
    q: Option<u64>,
    /// A `qu` other than `requests`.
    other_unit: bool,
    /// The partition key, which names the bucket (see [`resource`]).
    pk: Option<Vec<u8>>,
}

#[derive(Debug, Default)]
struct Members<'de>(Vec<Member<'de>>);

impl<'de> ListVisitor<'de> for &mut Members<'de> {
    type Out = ();
    type Error = Infallible;

    fn entry(&mut self) -> Result<impl EntryVisitor<'de>, Self::Error> {
        Ok(Entry(&mut self.0))
    }

    fn finish(self) -> Result<(), Infallible> {
        Ok(())
    }
}

struct Entry<'a, 'de>(&'a mut Vec<Member<'de>>);

impl<'de> EntryVisitor<'de> for Entry<'_, 'de> {
    type Error = Infallible;

    fn item(self) -> Result<impl ItemVisitor<'de>, Infallible> {
        Ok(Named(self.0))
    }

    /// An inner list is no policy: skipped (it is still checked for syntax).
    fn inner_list(self) -> Result<impl InnerListVisitor<'de>, Infallible> {
        Ok(Ignored)
    }
}

struct Named<'a, 'de>(&'a mut Vec<Member<'de>>);

impl<'de> ItemVisitor<'de> for Named<'_, 'de> {
    type Out = ();
    type Error = Infallible;

    fn bare_item(
        self,
        name: BareItemFromInput<'de>,
    ) -> Result<impl ParameterVisitor<'de, Out = ()>, Infallible> {
        self.0.push(Member {
            name: Some(name),
            ..Member::default()
        });
        Ok(Params(self.0.last_mut().expect("just pushed")))
    }
}

struct Params<'a, 'de>(&'a mut Member<'de>);

impl<'de> ParameterVisitor<'de> for Params<'_, 'de> {
    type Out = ();
    type Error = Infallible;

    /// A later parameter of the same name replaces an earlier one, as RFC 9651 says.
    fn parameter(
        &mut self,
        key: &'de KeyRef,
        value: BareItemFromInput<'de>,
    ) -> Result<(), Infallible> {
        let count = || {
            value
                .as_integer()
                .and_then(|i| u64::try_from(i64::from(i)).ok())
        };
        match key.as_str() {
            "r" => self.0.r = count(),
            "t" => self.0.t = count(),
            "q" => self.0.q = count(),
            "pk" => self.0.pk = value.as_byte_sequence().map(<[u8]>::to_vec),
            "qu" => {
                let unit = value
                    .as_string()
                    .map(|s| s.as_str())
                    .or_else(|| value.as_token().map(|t| t.as_str()));
                self.0.other_unit = unit != Some("requests");
            }
            _ => {}
        }
        Ok(())
    }

    fn finish(self) -> Result<(), Infallible> {
        Ok(())
    }
}

pub mod tokens;
pub mod walls;

#[cfg(test)]
mod tests;
