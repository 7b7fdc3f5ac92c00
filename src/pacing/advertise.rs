//! What a paced response tells its client of the budget that paced it: pacegate's own policy
//! and where it stands, in the IETF RateLimit fields (draft-ietf-httpapi-ratelimit-headers),
//! as an intermediary that enforces a policy of its own may add them. The origin's items are
//! kept as they came; pacegate's follow them in the same field, named `"pacegate"`.
//!
//! The draft counts a quota of `q` units in windows of `w` seconds; pacegate spaces its slots
//! evenly, so its policy is written as the slots its pace allows in a window long enough to
//! hold ten of them (a second at 10 a second or more), at the backoff it is paced at now.
//! Where it stands is what this instance knows: `r` is the window's slots not yet spoken for
//! by the requests waiting here (none while the budget is paused), `t` the seconds until those
//! are served, or until the pause ends.

use std::hash::{Hash, Hasher};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use bytes::BytesMut;
use http::{HeaderMap, HeaderName};

use super::lane::Lane;
use crate::metrics::{BudgetSeries, Metrics};

/// `RateLimit-Policy` and `RateLimit`.
static POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The fewest slots a window of the written policy holds: enough that rounding to whole
/// seconds and slots misstates the pace by a tenth at most.
const SLOTS_A_WINDOW: f64 = 10.0;

/// The longest window written: a day.
const LONGEST_WINDOW: f64 = 86_400.0;

/// The budget that paced a request (its group's, or its key's), as its note keeps it: for
/// the metrics it counts into, and what its response tells the client.
#[derive(Clone)]
pub struct Paced(pub(super) Arc<Lane>);

impl std::fmt::Debug for Paced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Paced").field(&self.0.name).finish()
    }
}

/// pacegate's policy and where it stands, as written into a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Advertised {
    /// Slots a window (`q`).
    pub quota: u64,
    /// The window, in seconds (`w`).
    pub window: u64,
    /// Slots of the window not yet spoken for (`r`).
    pub remaining: u64,
    /// Seconds until a new request would get its slot (`t`).
    pub reset: u64,
    /// A budget split by key: a fingerprint of the key (`pk`), never the key.
    partition: Option<u64>,
}

impl Paced {
    /// The budget's series in every family a request counts into.
    pub fn series(&self, metrics: &Metrics) -> &Arc<BudgetSeries> {
        self.0.series(metrics)
    }

    /// What to tell the client of the budget now; nothing where its destination says
    /// `advertise = false`.
    pub fn advertised(&self) -> Option<Advertised> {
        let lane = &self.0;
        let keys = lane.keys_now();
        if !keys.pace.advertise {
            return None;
        }
        let (backoff, paused) = {
            let seen = lane.seen.lock();
            (seen.backoff.max(1.0), seen.paused_for)
        };
        let rate = keys.pace.rate / backoff;
        let window = if rate >= SLOTS_A_WINDOW {
            1.0
        } else {
            (SLOTS_A_WINDOW / rate).ceil().min(LONGEST_WINDOW)
        };
        let quota = ((rate * window).floor() as u64).max(1);
        // Those waiting for a slot here, those whose slot is granted and not yet due with
        // them (a key's lane counts into its budget's).
        let ahead = u32::try_from(lane.tally.admitting.load(Ordering::Relaxed)).unwrap_or(u32::MAX);
        let served = keys.rule.interval.mul_f64(backoff) * ahead;
        let partition = lane.key_name().map(|key| {
            let mut h = std::hash::DefaultHasher::new();
            key.hash(&mut h);
            h.finish()
        });
        Some(Advertised {
            quota,
            window: window as u64,
            remaining: match paused.is_zero() {
                true => quota.saturating_sub(u64::from(ahead)),
                false => 0,
            },
            reset: whole_seconds(served.max(paused)),
            partition,
        })
    }
}

/// `d` in whole seconds, rounded up: a client that waits that long is not early.
fn whole_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

impl Advertised {
    /// Adds pacegate's items to the response's `RateLimit-Policy` and `RateLimit` fields,
    /// after the origin's, written into `buf` (see [`crate::headers::append_to_list`]).
    pub fn write(&self, headers: &mut HeaderMap, buf: &mut BytesMut) {
        use std::fmt::Write;
        let pk = |buf: &mut BytesMut| {
            if let Some(p) = self.partition {
                let key = base64::engine::general_purpose::STANDARD.encode(p.to_be_bytes());
                let _ = write!(buf, ";pk=:{key}:");
            }
        };
        let _ = write!(buf, "\"pacegate\";q={};w={}", self.quota, self.window);
        pk(buf);
        crate::headers::append_to_list(headers, &POLICY, buf.split().freeze());
        let _ = write!(buf, "\"pacegate\";r={};t={}", self.remaining, self.reset);
        pk(buf);
        crate::headers::append_to_list(headers, &RATELIMIT, buf.split().freeze());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pacegate_s_items_follow_the_origin_s_in_one_field_each() {
        let mut h = HeaderMap::new();
        h.insert("ratelimit-policy", "\"burst\";q=100;w=60".parse().unwrap());
        h.insert("ratelimit", "\"burst\";r=12;t=40".parse().unwrap());
        let a = Advertised {
            quota: 10,
            window: 2,
            remaining: 7,
            reset: 1,
            partition: Some(0x0102_0304_0506_0708),
        };
        a.write(&mut h, &mut BytesMut::new());
        assert_eq!(
            h["ratelimit-policy"],
            "\"burst\";q=100;w=60, \"pacegate\";q=10;w=2;pk=:AQIDBAUGBwg=:"
        );
        assert_eq!(
            h["ratelimit"],
            "\"burst\";r=12;t=40, \"pacegate\";r=7;t=1;pk=:AQIDBAUGBwg=:"
        );
        let mut h = HeaderMap::new();
        Advertised {
            partition: None,
            ..a
        }
        .write(&mut h, &mut BytesMut::new());
        assert_eq!(h["ratelimit"], "\"pacegate\";r=7;t=1");
    }

    #[test]
    fn a_wait_is_told_in_whole_seconds_never_short() {
        assert_eq!(whole_seconds(Duration::ZERO), 0);
        assert_eq!(whole_seconds(Duration::from_millis(1)), 1);
        assert_eq!(whole_seconds(Duration::from_secs(2)), 2);
        assert_eq!(whole_seconds(Duration::from_millis(2001)), 3);
    }
}
