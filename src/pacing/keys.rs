//! Budgets split by key (`key = "host"`, `"proxy-user"`, `"header:NAME"` or `"json:FIELD"`):
//! the key a request takes, its lane made on first use and bounded by `max_keys`, a
//! credential named only by a keyed hash, and the sweep that forgets keys gone idle, here and
//! in the store.
//!
//! A key's lane is a lane like any other (its own dispatcher, schedule, backoff, pauses and
//! quota windows, shared by every instance through the store under `PARENT#KEY`), with its
//! parent's rule, counts and lockout (see [`Lane::key`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use ring::hmac;

use super::lane::{ByKey, Lane};
use super::{PaceError, Pacer, Route};
use crate::destination::{KeyFrom, Mode};
use crate::metrics::{labels, labels_and};

/// How much of a credential's keyed hash names its key: 64 bits, written as 16 hex digits.
/// Among a million keys the chance that two share a name is below one in 30 million.
const KEY_BYTES: usize = 8;

/// The sweep's period: a quarter of the shortest `key_idle`, within these bounds.
const SWEEP_MIN: Duration = Duration::from_secs(1);
const SWEEP_MAX: Duration = Duration::from_secs(60);

/// Who makes a new key, for `max_keys_per_client`: the proxy `user`, else the `client`'s
/// address.
pub(super) fn maker_of(user: Option<&str>, client: Option<std::net::IpAddr>) -> String {
    match (user, client) {
        (Some(user), _) => format!("proxy user {user}"),
        (None, Some(ip)) => format!("client {ip}"),
        (None, None) => String::new(),
    }
}

/// A JSON body's field, as a key takes it.
enum Field {
    /// A short, plain string (a model's name): its own key.
    Plain(String),
    /// Any other value, as JSON: named by its keyed hash, as a credential is.
    Other(Vec<u8>),
    /// No JSON body, or no such field: the empty key.
    None,
}

/// The longest field value kept as its own key.
const PLAIN_FIELD: usize = 64;

/// `field` of `asking`'s body, where its content type says JSON (another costs no parse).
fn json_field(asking: &Asking<'_>, field: &str) -> Field {
    let json = asking
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| {
            let t = t.trim();
            t.eq_ignore_ascii_case("application/json") || t.ends_with("+json")
        });
    let Some(body) = asking.body.filter(|_| json) else {
        return Field::None;
    };
    let Ok(serde_json::Value::Object(mut object)) = serde_json::from_slice(body) else {
        return Field::None;
    };
    match object.remove(field) {
        Some(serde_json::Value::String(s))
            if s.len() <= PLAIN_FIELD
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._:-/".contains(&b)) =>
        {
            Field::Plain(s)
        }
        Some(other) => Field::Other(serde_json::to_vec(&other).unwrap_or_default()),
        None => Field::None,
    }
}

/// What a request offers to be keyed by.
pub struct Asking<'a> {
    /// The target host, as routed.
    pub host: &'a str,
    /// The proxy user the client authenticated as.
    pub user: Option<&'a str>,
    /// The request's headers.
    pub headers: &'a HeaderMap,
    /// The client connection's address.
    pub client: Option<std::net::IpAddr>,
    /// The request body, where it was read before the slot (`json:FIELD` keys read it).
    pub body: Option<&'a [u8]>,
}

impl Asking<'_> {
    /// Who makes a new key, for `max_keys_per_client`: the proxy user, else the client's
    /// address.
    fn maker(&self) -> String {
        maker_of(self.user, self.client)
    }
}

impl Pacer {
    /// The route of the budget `asking`'s key takes in `route`'s budget, its lane made on
    /// first use; `route` itself where the budget is not split by key. A new key past
    /// `max_keys` is refused, never sent unpaced; in shadow mode, which refuses nothing, it
    /// is counted as a refusal (`max_keys`) and takes the budget itself.
    pub async fn keyed(&self, route: Route, asking: &Asking<'_>) -> Result<Route, PaceError> {
        if !route.lane.is_split() {
            return Ok(route);
        }
        let keys = route.lane.keys();
        let Some(from) = &keys.pace.key else {
            return Ok(route);
        };
        let key = self.key_of(from, asking).await?;
        let lane = match self.key_lane(&route.lane, &key, || asking.maker()) {
            Ok(lane) => lane,
            Err(PaceError::TooManyKeys { .. } | PaceError::ClientKeys { .. })
                if keys.pace.mode == Mode::Shadow =>
            {
                self.metrics
                    .shadow_refusals
                    .with_label_values(&labels_and(route.label(), "max_keys"))
                    .inc();
                return Ok(route);
            }
            Err(e) => return Err(e),
        };
        Ok(Route {
            lane,
            lanes: route.lanes,
        })
    }

    /// The lane of `parent`'s key `key`, made if it is new (its dispatcher starts with the
    /// first request to queue) for the client `maker` names (empty: nobody in particular),
    /// within `max_keys` and that client's `max_keys_per_client`.
    pub(super) fn key_lane(
        &self,
        parent: &Arc<Lane>,
        key: &str,
        maker: impl FnOnce() -> String,
    ) -> Result<Arc<Lane>, PaceError> {
        let Some(children) = parent.children() else {
            return Ok(parent.clone());
        };
        let lane = {
            let mut children = children.lock();
            match children.get(key) {
                Some(lane) => lane.0.clone(),
                None => {
                    let max_keys = parent.keys().pace.max_keys;
                    if children.len() >= max_keys {
                        self.metrics
                            .keys_refused
                            .with_label_values(&labels(parent.label()))
                            .inc();
                        return Err(PaceError::TooManyKeys {
                            budget: parent.name.to_string(),
                            max_keys,
                            key_idle: parent.keys().pace.key_idle,
                        });
                    }
                    let maker = maker();
                    let mut made_by = None;
                    if !maker.is_empty() {
                        let per_client = parent.keys().pace.max_keys_per_client;
                        let mut makers = parent.makers().expect("a budget's own lane").lock();
                        // One name for all of a client's keys, not one each.
                        let maker: Arc<str> = makers
                            .get_key_value(maker.as_str())
                            .map_or_else(|| Arc::from(maker.as_str()), |(name, _)| name.clone());
                        let made = makers.entry(maker.clone()).or_insert(0);
                        if *made >= per_client {
                            self.metrics
                                .keys_refused_client
                                .with_label_values(&labels(parent.label()))
                                .inc();
                            return Err(PaceError::ClientKeys {
                                budget: parent.name.to_string(),
                                client: maker.to_string(),
                                limit: per_client,
                                key_idle: parent.keys().pace.key_idle,
                            });
                        }
                        *made += 1;
                        made_by = Some(maker);
                    }
                    // Its dispatcher starts with the first request to queue.
                    let lane = Arc::new(Lane::key(parent, key, made_by));
                    children.insert(ByKey(lane.clone()));
                    lane
                }
            }
        };
        lane.touch();
        Ok(lane)
    }

    /// The key `asking` takes by `from`: the host as it is, anything else as its keyed hash.
    async fn key_of(&self, from: &KeyFrom, asking: &Asking<'_>) -> Result<String, PaceError> {
        let other;
        let value: &[u8] = match from {
            KeyFrom::Host => return Ok(asking.host.to_ascii_lowercase()),
            KeyFrom::Json(field) => match json_field(asking, field) {
                Field::Plain(value) => return Ok(value),
                Field::Other(value) => {
                    other = value;
                    &other
                }
                Field::None => b"",
            },
            KeyFrom::ProxyUser => asking.user.unwrap_or_default().as_bytes(),
            KeyFrom::Header(name) => asking.headers.get(name).map_or(&b""[..], |v| v.as_bytes()),
        };
        let secret = self
            .key_secret
            .get_or_try_init(|| async {
                let bytes = self.store.key_secret().await?;
                Ok::<_, PaceError>(hmac::Key::new(hmac::HMAC_SHA256, &bytes))
            })
            .await?;
        Ok(hex::encode(
            &hmac::sign(secret, value).as_ref()[..KEY_BYTES],
        ))
    }

    /// Forgets, every so often, the keys gone idle for their budget's `key_idle`: here, their
    /// lanes (none that a request holds), and in the store, their budgets (every instance's).
    /// Runs until the pacer stops.
    pub(super) async fn keep_keys(self: Arc<Self>) {
        loop {
            let split: Vec<Arc<Lane>> = self
                .lanes()
                .into_iter()
                .filter(|l| l.is_split() || l.children().is_some_and(|c| !c.lock().is_empty()))
                .collect();
            let every = split
                .iter()
                .map(|l| l.keys().pace.key_idle / 4)
                .min()
                .unwrap_or(SWEEP_MAX)
                .clamp(SWEEP_MIN, SWEEP_MAX);
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = self.stop.cancelled() => return,
            }
            for parent in split {
                let idle = parent.keys().pace.key_idle;
                for gone in forget_idle(&parent, idle) {
                    gone.retire();
                    self.store.forget_budget(&gone.name);
                }
                match self.store.forget_keys(&parent.name, idle).await {
                    Ok(0) => {}
                    Ok(n) => tracing::debug!(budget = %parent.name, n, "idle keys forgotten"),
                    Err(e) => {
                        tracing::warn!(budget = %parent.name, "cannot forget idle keys: {e}")
                    }
                }
            }
        }
    }
}

/// Takes the lanes of `parent`'s keys idle for `idle` out of its map: none that a request
/// holds (a route or an admission: only the map, and a dispatcher while one runs, hold an
/// idle lane) or waits in.
fn forget_idle(parent: &Lane, idle: Duration) -> Vec<Arc<Lane>> {
    let mut gone = Vec::new();
    let Some(children) = parent.children() else {
        return gone;
    };
    let mut children = children.lock();
    children.retain(|ByKey(lane)| {
        let held_by_us = 1 + usize::from(lane.dispatching.load(Ordering::SeqCst));
        let idle = Arc::strong_count(lane) <= held_by_us
            && lane.queue.lock().len() == 0
            && lane.unused_for() >= idle;
        if idle {
            gone.push(lane.clone());
        }
        !idle
    });
    // Their makers may make as many again.
    if let Some(makers) = parent.makers() {
        let mut makers = makers.lock();
        for maker in gone.iter().filter_map(|l| l.maker()) {
            if let Some(made) = makers.get_mut(maker) {
                *made = made.saturating_sub(1);
                if *made == 0 {
                    makers.remove(maker);
                }
            }
        }
    }
    drop(children);
    gone
}

#[cfg(test)]
mod tests;
