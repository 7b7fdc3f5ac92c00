//! A request's meters (see [`crate::meter`]): its cost to each estimated from the request
//! before it waits, a slot of each taken before the request's own (as long as the cost, and
//! good to send on for a moment only), and the cost settled from the response as its bytes
//! pass to the client, or given back where the vendor charged nothing.
//!
//! The order is the point. A meter's slot comes first because it is the one that binds (a
//! vendor's tokens a minute run out long before its requests a second), and a request sent
//! long after its meter's slot would bunch with the requests after it; so the request's own
//! slot must follow it within [`METER_LATE`], or both go back and the request waits again.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

use super::lane::Lane;
use super::outgoing::{BodyError, Outgoing};
use super::{PaceError, Pacer, Route};
use crate::budget::{Reservation, Store};
use crate::class::Class;
use crate::meter::{Cost, Settle, Settled};
use crate::metrics::{labels, labels_and, Metrics};

/// The longest a meter's slot may be used after it: the request's own slot is taken after
/// it, and must come within this. A request sent this late lets at most this much of the
/// meter's rate bunch into a window: 75 tokens of 90,000 a minute. A request slot is one
/// store round trip away where its budget has room, so this is rarely reached.
const METER_LATE: Duration = Duration::from_millis(50);

/// One meter of a request: its lane, what the request is estimated to cost, and the slot
/// taken for it.
struct Taken {
    lane: Arc<Lane>,
    cost: Cost,
    estimate: u64,
    /// The slot, and what it was reserved for (the cost the dispatcher asked it for, which
    /// may be another waiter's: settled against all the same).
    slot: Option<(Reservation, u32)>,
}

/// A request's meters, in the destination's order.
pub(super) struct Metering {
    taken: Vec<Taken>,
}

impl Pacer {
    /// Meters `outgoing` on `route`'s meters, where it has any: its cost to each estimated,
    /// its body read first (up to the destination's `max_body`) where an estimate reads it,
    /// and a header that states the cost taken off.
    pub(super) async fn meter(
        &self,
        route: &Route,
        outgoing: &mut Outgoing,
    ) -> Result<(), BodyError> {
        let lanes = &route.lanes;
        let reads_body = lanes
            .meters
            .iter()
            .any(|(m, _)| !matches!(m.cost, Cost::Header(_) | Cost::Fixed(_)));
        let body = match reads_body {
            true => Some(outgoing.read_body(lanes.max_body).await?),
            false => None,
        };
        let read = body.as_deref().unwrap_or_default();
        let taken = lanes
            .meters
            .iter()
            .map(|(m, lane)| Taken {
                lane: lane.clone(),
                cost: m.cost.clone(),
                estimate: m.cost.estimate(read, outgoing.headers(), m.default, m.size),
                slot: None,
            })
            .collect();
        for (m, _) in &lanes.meters {
            if let Cost::Header(name) = &m.cost {
                outgoing.remove_header(name);
            }
        }
        outgoing.metered(body, Metering { taken });
        Ok(())
    }

    /// Takes a slot of each of `outgoing`'s meters in turn for the request of `class` to
    /// `route`, waited for up to `deadline`; on a refusal, gives back those taken.
    pub(super) async fn take_meters(
        &self,
        outgoing: &mut Outgoing,
        route: &Route,
        class: Class,
        deadline: Instant,
    ) -> Result<(), PaceError> {
        let Some(metering) = outgoing.meters() else {
            return Ok(());
        };
        // A destination locked out (or pacegate stopping) refuses before the meters' wait,
        // not after it.
        self.open(&route.lane).await?;
        for i in 0..metering.taken.len() {
            let t = &metering.taken[i];
            let lane = t.lane.clone();
            let keys = lane.keys();
            // An estimate is at most the meter's size, which config holds to 32 bits.
            let cost = u32::try_from(t.estimate).unwrap_or(u32::MAX);
            let waited = self
                .slot(&lane, &keys.rule, class, (Instant::now(), deadline), cost)
                .await;
            match waited {
                Ok((granted, _)) => metering.taken[i].slot = Some((granted.slot, granted.cost)),
                Err(e) => {
                    self.give_back(metering);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Whether a meter's slot is too late at `now` to send on (see [`METER_LATE`]): then
    /// every meter's slot is given back, and the request waits for new ones.
    pub(super) fn meters_too_late(&self, metering: &mut Metering, now: Instant) -> bool {
        let late = metering.taken.iter().find_map(|t| {
            let (slot, _) = t.slot?;
            let late = slot.lateness(now);
            (late > METER_LATE).then_some((t, late))
        });
        let Some((t, late)) = late else {
            return false;
        };
        t.lane.series(&self.metrics).slots_dropped.inc();
        tracing::info!(
            destination = %t.lane.name,
            late_ms = late.as_secs_f64() * 1000.0,
            "a request whose own slot came too long after its meter's waits for both again"
        );
        self.give_back(metering);
        true
    }

    /// Gives every meter's slot back whole: the request did not go, or the vendor charged
    /// nothing for it.
    pub(super) fn give_back(&self, metering: &mut Metering) {
        for t in &mut metering.taken {
            if let Some((_, reserved)) = t.slot.take() {
                settle(&self.store, &t.lane, -i64::from(reserved));
            }
        }
    }

    /// Forgets the meters' slots of an attempt that went: what it cost stands (a throttled
    /// request's estimate, charged as the vendor counts it), and a retry takes new ones.
    pub(super) fn spent(&self, metering: &mut Metering) {
        for t in &mut metering.taken {
            if let Some((_, reserved)) = t.slot.take() {
                self.metrics
                    .meter_units
                    .with_label_values(&labels(&t.lane.name))
                    .inc_by(u64::from(reserved));
            }
        }
    }

    /// `body`, the response's, with its cost to each meter read as it passes to the client
    /// and settled when it ends (`headers` say whether it is a server-sent-event stream).
    pub(super) fn settling<B>(
        &self,
        metering: Metering,
        headers: &HeaderMap,
        body: B,
    ) -> Settling<B> {
        let stream = headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
        let reads = metering
            .taken
            .into_iter()
            .filter_map(|t| {
                let (_, reserved) = t.slot?;
                Some(Reading {
                    settle: t.cost.settle(stream),
                    lane: t.lane,
                    estimate: t.estimate,
                    reserved,
                })
            })
            .collect();
        Settling {
            body,
            reads,
            store: self.store.clone(),
            metrics: self.metrics.clone(),
            done: false,
        }
    }
}

/// A count of units as a signed difference.
fn signed(units: u64) -> i64 {
    i64::try_from(units).unwrap_or(i64::MAX)
}

/// Moves `lane`'s meter by `units` (see [`Store::settle`]), off the request's way: a
/// failed settlement leaves the estimate standing, which only slows the meter.
fn settle(store: &Arc<dyn Store>, lane: &Arc<Lane>, units: i64) {
    if units == 0 {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (store, lane) = (store.clone(), lane.clone());
    // Owned by nothing: it ends with the store's answer, bounded by the store's own timeout.
    runtime.spawn(async move {
        let rule = lane.keys().rule.clone();
        if let Err(e) = store.settle(&lane.name, &rule, units).await {
            tracing::warn!(destination = %lane.name, units, "cannot settle a request's cost ({e}); its estimate stands");
        }
    });
}

/// One meter's reading of a response.
struct Reading {
    lane: Arc<Lane>,
    /// What the request was estimated to cost.
    estimate: u64,
    /// What its slot was reserved for.
    reserved: u32,
    /// How the response says the cost; `None` where it does not (a header's or a fixed
    /// cost: the estimate is the cost).
    settle: Option<Settle>,
}

/// A response body whose cost to the request's meters is read as it passes, never held
/// back, and settled when it ends, or when the client leaves before it does.
pub(super) struct Settling<B> {
    body: B,
    reads: Vec<Reading>,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    done: bool,
}

impl<B> Settling<B> {
    /// The body ended (`complete`), or was cut off: each meter is settled at what the
    /// response said, or keeps the estimate.
    fn finish(&mut self, complete: bool) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        for r in std::mem::take(&mut self.reads) {
            let cost = match r.settle.map(|s| s.finish(complete)) {
                None => r.estimate,
                Some(Settled::Cost(cost)) => cost,
                Some(Settled::Unsettled(why)) => {
                    self.metrics
                        .meter_unsettled
                        .with_label_values(&labels_and(&r.lane.name, why.as_str()))
                        .inc();
                    r.estimate
                }
            };
            self.metrics
                .meter_units
                .with_label_values(&labels(&r.lane.name))
                .inc_by(cost);
            settle(&self.store, &r.lane, signed(cost) - i64::from(r.reserved));
        }
    }
}

impl<B> Drop for Settling<B> {
    fn drop(&mut self) {
        self.finish(false);
    }
}

impl<B> Body for Settling<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        let polled = std::pin::Pin::new(&mut this.body).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    for r in &mut this.reads {
                        if let Some(s) = &mut r.settle {
                            s.feed(data);
                        }
                    }
                }
                // A body of known length ends with its last frame: it may never be polled
                // again.
                if this.body.is_end_stream() {
                    this.finish(true);
                }
            }
            Poll::Ready(Some(Err(_))) => this.finish(false),
            Poll::Ready(None) => this.finish(true),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
