//! A request's meters (see [`crate::meter`]): its cost to each estimated from the request
//! before it waits, a slot of each taken before the request's own (as long as the cost, and
//! good to send on for a moment only), and the cost settled from the response as its bytes
//! pass to the client, or given back where the vendor charged nothing.
//!
//! The order is the point. A meter's slot comes first because it is the one that binds (a
//! vendor's tokens a minute run out long before its requests a second), and a request sent
//! long after its meter's slot would bunch with the requests after it; so the request's own
//! slot must follow it within [`METER_LATE`], or both go back and the request waits again.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

use super::lane::{Grant, Lane};
use super::outgoing::{BodyError, Outgoing};
use super::{Admission, PaceError, Pacer, Route};
use crate::budget::{Event, Observation, Pause, Reservation, Store, METER_LATE};
use crate::class::Class;
use crate::destination::KeyFrom;
use crate::meter::{usage, Bucket, Cost, Query, Settle, Settled};
use crate::metrics::{labels, labels_and, Metrics};
use crate::signals::{tokens, Family};

/// The `burst` a meter that does not bind lends a request (see [`lend_early`]): with 2, a
/// second of the binding meter's slots close behind the first still found the other meter's
/// slot a large estimate later, and one request in ten or more had its binding slot given
/// back; with 4, hardly one in fifty.
const LENT_BURST: u32 = 4;

/// How many times a request's meters' slots are taken again when one went stale waiting for
/// another's (see [`Pacer::take_meters`]).
const METER_ROUNDS: usize = 4;

/// One meter of a request: its lane, what the request is estimated to cost, and the slot
/// taken for it.
struct Taken {
    lane: Arc<Lane>,
    cost: Cost,
    estimate: u64,
    /// The slot its meter granted: with what it was reserved for (the cost the dispatcher
    /// asked it for, which may be another waiter's: settled against all the same), and its
    /// mark in the meter's windows, where its store gave one.
    slot: Option<Grant>,
    /// Where its cost is its query's: the query, whose settled cost is recalled for the next.
    query: Option<Query>,
}

/// A request's meters, in the destination's order.
pub(super) struct Metering {
    taken: Vec<Taken>,
    /// A stream was asked for its usage on the client's behalf (see [`usage`]): what that
    /// added is taken out of the answer.
    asked_usage: bool,
    /// Slots given back whose store calls may not have landed yet: the request's next
    /// slots are taken only once they have, or a quota window would still count the ones
    /// given back and place the new ones a window later.
    returning: Vec<tokio::task::JoinHandle<()>>,
}

impl Metering {
    /// Waits for the give-backs still under way (bounded by the store's own timeout, as
    /// every call of it is): the request's next slots are taken only once they landed.
    async fn given_back(&mut self) {
        for returning in self.returning.drain(..) {
            let _ = returning.await;
        }
    }

    /// Whether the request takes no meter (its body was read for a `json:FIELD` key alone).
    pub(super) fn is_empty(&self) -> bool {
        self.taken.is_empty()
    }
}

impl Taken {
    /// The estimate as a slot's units: at most the meter's size, which config holds to 32
    /// bits.
    fn units(&self) -> u32 {
        u32::try_from(self.estimate).unwrap_or(u32::MAX)
    }

    /// Gives its slot back whole, if it holds one: the store's call, under way.
    fn give_back(&mut self, store: &Arc<dyn Store>) -> Option<tokio::task::JoinHandle<()>> {
        let held = self.slot.take()?;
        let units = held.cost;
        give_back(store, &self.lane, held, units)
    }
}

impl Route {
    /// Whether a request's body may be read before its slot: the meters its budget takes
    /// read it, or a `json:FIELD` key may (see `Lanes::reads_body`). A destination with
    /// neither anywhere answers with one load; one whose groups differ looks at this
    /// route's meters, so that a request that takes none reads nothing.
    pub(super) fn reads_body(&self) -> bool {
        self.lanes.reads_body && (self.lanes.keyed_by_body || !self.meters().list.is_empty())
    }
}

impl Pacer {
    /// Meters `outgoing` on `route`'s meters, where it has any: its cost to each estimated,
    /// its body read first (up to the destination's `max_body`) where an estimate or the
    /// key reads it, and a header that states the cost taken off.
    pub(super) async fn meter(
        &self,
        route: &Route,
        outgoing: &mut Outgoing,
    ) -> Result<(), BodyError> {
        let meters = &route.meters().list;
        let reads_body = matches!(route.lane.keys().pace.key, Some(KeyFrom::Json(_)))
            || meters
                .iter()
                .any(|(m, _)| !matches!(m.cost, Cost::Header(_) | Cost::Fixed(_)));
        let body = match reads_body {
            true => Some(outgoing.read_body(route.lanes.max_body).await?),
            false => None,
        };
        let read = body.as_deref().unwrap_or_default();
        let query = meters
            .iter()
            .any(|(m, _)| m.cost.by_query())
            .then(|| Query::of(read))
            .flatten();
        let taken = meters
            .iter()
            .map(|(m, lane)| {
                let query = query.filter(|_| m.cost.by_query());
                // A query settled before is estimated at what it cost then.
                let default = query
                    .zip(lane.recall())
                    .and_then(|(q, recall)| recall.cost_of(q))
                    .unwrap_or(m.default);
                Taken {
                    lane: lane.clone(),
                    cost: m.cost.clone(),
                    estimate: m.cost.estimate(read, outgoing.headers(), default, m.size),
                    slot: None,
                    query,
                }
            })
            .collect();
        for (m, _) in meters {
            if let Cost::Header(name) = &m.cost {
                outgoing.remove_header(name);
            }
        }
        // An OpenAI chat stream settles only where it ends with its usage: one that did not
        // ask for it is sent asking.
        let chat = ["/chat/completions", "/completions"]
            .iter()
            .any(|p| outgoing.uri().path().ends_with(p));
        let openai = meters.iter().any(|(m, _)| m.cost == Cost::OpenAi);
        let asked = (chat && openai)
            .then(|| body.as_deref().and_then(usage::ask))
            .flatten();
        let asked_usage = asked.is_some();
        outgoing.metered(
            asked.or(body),
            Metering {
                taken,
                asked_usage,
                returning: Vec::new(),
            },
        );
        Ok(())
    }

    /// Splits `outgoing`'s meters by the key `keyed` took: a meter of a destination split by
    /// key is split by the same key (a model's tokens apart from another's). A new key's
    /// meter lane is made as the key's own is, within `max_keys`.
    pub(super) fn key_meters(
        &self,
        keyed: &Route,
        outgoing: &mut Outgoing,
    ) -> Result<(), PaceError> {
        let Some(key) = keyed.lane.key_name() else {
            return Ok(());
        };
        let maker = super::keys::maker_of(outgoing.user(), outgoing.client());
        let Some(metering) = outgoing.meters() else {
            return Ok(());
        };
        for t in &mut metering.taken {
            if t.lane.is_split() {
                t.lane = self.key_lane(&t.lane, key, || maker.clone())?;
            }
        }
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
        // The meter that binds (the one whose slots are longest) is waited for first, so
        // that the others' slots, taken after it, are fresh. A slot taken before it has gone
        // stale meanwhile: it is given back and taken again, at once where that meter has
        // room. A few rounds at most.
        let n = metering.taken.len();
        let lengths = metering
            .taken
            .iter()
            .map(|t| t.lane.keys().rule.interval.saturating_mul(t.units()));
        let binding = route.meters().binding(lengths).min(n - 1);
        lend_early(metering, binding);
        let mut wanted: Vec<usize> = std::iter::once(binding)
            .chain((0..n).filter(|i| *i != binding))
            .collect();
        for _ in 0..METER_ROUNDS {
            metering.given_back().await;
            for &i in &wanted {
                let waited = self.meter_slot(&metering.taken[i], class, deadline).await;
                match waited {
                    Ok((granted, _)) => {
                        metering.taken[i].slot = Some(granted);
                    }
                    Err(e) => {
                        self.give_back(metering);
                        return Err(e);
                    }
                }
            }
            let now = Instant::now();
            wanted = metering
                .taken
                .iter()
                .enumerate()
                .filter(|(_, t)| {
                    t.slot
                        .as_ref()
                        .is_some_and(|g| g.slot.lateness(now) > METER_LATE / 2)
                })
                .map(|(i, _)| i)
                .collect();
            if wanted.is_empty() {
                break;
            }
            for &i in &wanted {
                self.retaken(&metering.taken[i]);
                let returning = metering.taken[i].give_back(&self.store);
                metering.returning.extend(returning);
            }
        }
        // Still stale after every round: the send's own check gives them all back.
        Ok(())
    }

    /// Shadow mode: the request goes at once, while each meter's stand-in waits for the
    /// slot its estimate would have taken (see `Pacer::stand_in`), so that the meter's
    /// schedule is the one enforcing would have made and its waits are counted; the
    /// response settles the difference as it would.
    pub(super) fn shadow_meters(
        self: &Arc<Self>,
        metering: &mut Metering,
        class: Class,
        deadline: Instant,
    ) {
        let now = Instant::now();
        for t in metering.taken.iter_mut().filter(|t| t.slot.is_none()) {
            let cost = t.units();
            t.lane.raise_largest(cost);
            self.stand_in(t.lane.clone(), class, deadline, cost);
            let slot = Reservation {
                at: now,
                generation: t.lane.seen.lock().generation,
                unseen_late: Duration::ZERO,
            };
            t.slot = Some(Grant {
                class,
                slot,
                cost,
                sent: None,
            });
        }
    }

    /// Waits for a slot of `t`'s meter, as long as its estimate, up to `by`. The meter's
    /// largest estimate is raised first: its own window holds one request's worth over its
    /// limit (see [`crate::budget::Rule::windows`]).
    async fn meter_slot(
        &self,
        t: &Taken,
        class: Class,
        by: Instant,
    ) -> Result<(Grant, Instant), PaceError> {
        let cost = t.units();
        t.lane.raise_largest(cost);
        let keys = t.lane.keys();
        self.slot(&t.lane, &keys.rule, class, (Instant::now(), by), cost)
            .await
    }

    /// Counts `t`'s slot as given back to be taken again.
    fn retaken(&self, t: &Taken) {
        self.metrics
            .meter_retaken
            .with_label_values(&labels(&t.lane.name))
            .inc();
    }

    /// Whether a meter's slot is too late at `now` to send on (see [`METER_LATE`]): then
    /// every meter's slot is given back, to be taken again (see [`Pacer::retake_meters`]).
    pub(super) fn meters_too_late(&self, metering: &mut Metering, now: Instant) -> bool {
        let late = metering.taken.iter().any(|t| {
            t.slot
                .as_ref()
                .is_some_and(|g| g.slot.lateness(now) > METER_LATE)
        });
        if late {
            for t in &metering.taken {
                self.retaken(t);
            }
            self.give_back(metering);
        }
        late
    }

    /// Whether `outgoing`'s meters are to be taken at its own slot, sent at `sent`: none
    /// was taken before it (its own budget binds), or those taken went stale waiting for it
    /// (and are given back, see [`Pacer::meters_too_late`]).
    pub(super) fn meters_due_at_slot(&self, outgoing: &mut Outgoing, sent: Instant) -> bool {
        outgoing.meters().is_some_and(|m| {
            m.taken.iter().any(|t| t.slot.is_none()) || self.meters_too_late(m, sent)
        })
    }

    /// Takes `outgoing`'s meters at its own slot (see [`Pacer::retake_meters`]); returns
    /// whether it may go on that slot. Its budget binds from then on, for the requests after
    /// it too, until a meter is not to be had by the slot: then that one binds again, and the
    /// request waits for both once more.
    pub(super) async fn meters_at_slot(
        &self,
        outgoing: &mut Outgoing,
        route: &Route,
        class: Class,
        admission: &Admission,
    ) -> bool {
        let Some(m) = outgoing.meters() else {
            return true;
        };
        let own = &route.meters().own_binds;
        own.store(true, Ordering::Relaxed);
        if self.retake_meters(m, class, admission.send_by()).await
            && !self.too_late(admission, Instant::now())
        {
            return true;
        }
        own.store(false, Ordering::Relaxed);
        self.give_back(m);
        false
    }

    /// At the request's own slot, its meters' slots that went stale waiting for it (see
    /// [`Pacer::meters_too_late`], which gave them back) are taken again, each due by `by`
    /// (the latest the request may still go on its own slot). Returns whether every one was:
    /// the request then goes on its own slot, with fresh ones. Where the request's own budget
    /// binds and its meters have room, this is how it goes at all: taken again before its
    /// own slot, as the order otherwise has it, they would go stale again waiting behind
    /// the requests queued there meanwhile, for ever. Where one is not due by then (that
    /// meter binds after all), none is kept and the request waits for both again.
    pub(super) async fn retake_meters(
        &self,
        metering: &mut Metering,
        class: Class,
        by: Instant,
    ) -> bool {
        metering.given_back().await;
        for i in 0..metering.taken.len() {
            let lane = metering.taken[i].lane.clone();
            match self.meter_slot(&metering.taken[i], class, by).await {
                Ok((granted, _)) if granted.slot.at <= by => {
                    metering.taken[i].slot = Some(granted);
                }
                Ok((granted, _)) => {
                    metering.taken[i].slot = Some(granted);
                    self.meters_missed(metering, &lane);
                    return false;
                }
                Err(_) => {
                    self.meters_missed(metering, &lane);
                    return false;
                }
            }
        }
        true
    }

    /// A request's meters could not be had again by its own slot ([`Pacer::retake_meters`]):
    /// `lane`'s binds. Every one is given back, and the request waits for both again.
    fn meters_missed(&self, metering: &mut Metering, lane: &Arc<Lane>) {
        lane.series(&self.metrics).slots_dropped.inc();
        tracing::info!(
            destination = %lane.name,
            "a request whose own slot came too long after its meter's waits for both again"
        );
        self.give_back(metering);
    }

    /// Gives every meter's slot back whole: the request did not go, or the vendor charged
    /// nothing for it.
    pub(super) fn give_back(&self, metering: &mut Metering) {
        for t in &mut metering.taken {
            let returning = t.give_back(&self.store);
            metering.returning.extend(returning);
        }
    }

    /// Forgets the meters' slots of an attempt that went: what it cost stands (a throttled
    /// request's estimate, charged as the vendor counts it), and a retry takes new ones.
    pub(super) fn spent(&self, metering: &mut Metering) {
        for t in &mut metering.taken {
            if let Some(held) = t.slot.take() {
                self.metrics
                    .meter_units
                    .with_label_values(&labels(&t.lane.name))
                    .inc_by(u64::from(held.cost));
            }
        }
    }

    /// What `headers`, a response's, say of each of the request's meters: a meter whose
    /// budget the vendor says is spent pauses until the vendor's reset, on every instance.
    /// Returns whether one was: a throttle then is the meter's, not the request budget's.
    pub(super) fn meters_said(&self, metering: &Metering, headers: &HeaderMap) -> bool {
        let now = std::time::SystemTime::now();
        let mut spent = false;
        for t in &metering.taken {
            let Some(said) = t.cost.unit().and_then(|u| tokens::read(headers, u)) else {
                continue;
            };
            let Some(reset) = said.reset_in(now).filter(|_| said.exhausted()) else {
                continue;
            };
            spent = true;
            tracing::info!(destination = %t.lane.name, reset_ms = reset.as_millis() as u64, "the vendor says this meter's budget is spent; it pauses until the reset");
            pause(&self.store, &t.lane, said.limit, reset);
        }
        spent
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
                Some(Reading {
                    held: t.slot?,
                    settle: t.cost.settle(stream),
                    lane: t.lane,
                    query: t.query,
                    estimate: t.estimate,
                })
            })
            .collect();
        Settling {
            body,
            reads,
            strip: (metering.asked_usage && stream).then(usage::Strip::default),
            store: self.store.clone(),
            metrics: self.metrics.clone(),
            done: false,
        }
    }
}

/// Pauses `lane`'s meter for `reset` on every instance, as the vendor said its budget
/// (of `limit`, where said) is spent, off the request's way.
fn pause(store: &Arc<dyn Store>, lane: &Arc<Lane>, limit: Option<u64>, reset: Duration) {
    let seen = Observation {
        family: Family::Tokens,
        remaining: 0,
        limit,
        reset: Pause::For(reset),
        spread: rand::random::<f64>(),
        unanswered: 0,
    };
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (store, lane) = (store.clone(), lane.clone());
    // Owned by nothing: it ends with the store's answer.
    runtime.spawn(async move {
        let rule = lane.keys().rule.clone();
        match store
            .record(&lane.name, &rule, Event::None, Some(seen))
            .await
        {
            Ok(view) => lane.note(view),
            Err(e) => tracing::warn!(destination = %lane.name, "cannot pause a spent meter ({e})"),
        }
    });
}

/// How long a vendor's leaky bucket of points (Shopify's) needs to refill to hold `need`,
/// where it does not now: the meter pauses that long, so that the next query is not
/// throttled. Nothing where it holds it.
fn refill_for(bucket: Bucket, need: u64) -> Option<Duration> {
    let need = (need as f64).min(bucket.maximum);
    (bucket.available < need)
        .then(|| Duration::from_secs_f64((need - bucket.available) / bucket.restore_rate))
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

/// With several meters, each that does not bind lets a request go up to [`LENT_BURST`] - 1
/// of its own slots early, and the one that binds keeps to its beat (`burst` 1). A request
/// waits for the binding meter's slot first, then takes the others': one of them spaced
/// strictly by each request's estimate would often keep a request the binding meter has let
/// go waiting past `METER_LATE` (two of its slots close together, each with a large
/// estimate in the other), and that slot would be given back, its time lost (Anthropic's
/// input tokens, beside the output that binds). A meter that does not bind has room, and its
/// own window still holds at most its limit and the largest request, early slots or not.
fn lend_early(metering: &Metering, binding: usize) {
    if metering.taken.len() < 2 {
        return;
    }
    for (i, t) in metering.taken.iter().enumerate() {
        t.lane.lend_burst(if i == binding { 1 } else { LENT_BURST });
    }
}

/// Gives `units` of `held`, a slot of `lane`, back to the store (see [`Store::give_back`]):
/// all of a slot unused, or what a request cost less than its estimate. As [`settle`] does
/// a settlement: on a task of its own.
fn give_back(
    store: &Arc<dyn Store>,
    lane: &Arc<Lane>,
    held: Grant,
    units: u32,
) -> Option<tokio::task::JoinHandle<()>> {
    let runtime = tokio::runtime::Handle::try_current().ok()?;
    let (store, lane) = (store.clone(), lane.clone());
    Some(runtime.spawn(async move {
        let rule = lane.keys().rule.clone();
        let Grant {
            slot, cost, sent, ..
        } = held;
        let given = store.give_back(&lane.name, &rule, &slot, sent, cost, units);
        if let Err(e) = given.await {
            tracing::warn!(destination = %lane.name, units, "cannot give a meter's slot back ({e}); its estimate stands");
        }
    }))
}

/// One meter's reading of a response.
struct Reading {
    lane: Arc<Lane>,
    /// Where its cost is its query's: the query, to recall its cost by.
    query: Option<Query>,
    /// What the request was estimated to cost.
    estimate: u64,
    /// Its slot, with what it was reserved for and its mark in the meter's windows: a
    /// refund is taken out of the send it names (see [`Store::give_back`]).
    held: Grant,
    /// How the response says the cost; `None` where it does not (a header's or a fixed
    /// cost: the estimate is the cost).
    settle: Option<Settle>,
}

/// A response body whose cost to the request's meters is read as it passes, never held
/// back, and settled when it ends, or when the client leaves before it does.
pub(super) struct Settling<B> {
    body: B,
    reads: Vec<Reading>,
    /// What asking for usage on the client's behalf added, taken out as the stream passes.
    strip: Option<usage::Strip>,
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
        for mut r in std::mem::take(&mut self.reads) {
            let cost = match r.settle.as_mut().map(|s| s.finish(complete)) {
                None => r.estimate,
                Some(Settled::Cost(cost)) => {
                    if let Some((query, recall)) = r.query.zip(r.lane.recall()) {
                        // A throttled query (cost 0) says nothing of what it costs.
                        if cost > 0 {
                            recall.remember(query, cost);
                        }
                    }
                    cost
                }
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
            let reserved = r.held.cost;
            match u32::try_from(cost).ok().filter(|c| *c < reserved) {
                Some(cost) => {
                    give_back(&self.store, &r.lane, r.held, reserved - cost);
                }
                None => settle(&self.store, &r.lane, signed(cost) - i64::from(reserved)),
            }
            // The vendor's bucket, where it said it: one too low for a query like this one
            // pauses the meter until it has refilled.
            let bucket = r.settle.as_ref().and_then(Settle::bucket);
            if let Some(wait) = bucket.and_then(|b| refill_for(b, r.estimate)) {
                tracing::info!(destination = %r.lane.name, wait_ms = wait.as_millis() as u64, "the vendor's bucket of points is low; the meter pauses while it refills");
                pause(&self.store, &r.lane, bucket.map(|b| b.maximum as u64), wait);
            }
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
        loop {
            let polled = std::pin::Pin::new(&mut this.body).poll_frame(cx);
            let frame = match polled {
                Poll::Ready(Some(Ok(frame))) => frame,
                Poll::Ready(Some(Err(e))) => {
                    this.finish(false);
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    this.finish(true);
                    // What the stream held back to the end goes now.
                    let rest = this.strip.take().map(|mut s| s.finish());
                    return Poll::Ready(rest.filter(|r| !r.is_empty()).map(|r| Ok(Frame::data(r))));
                }
                Poll::Pending => return Poll::Pending,
            };
            let frame = match frame.into_data() {
                Ok(data) => {
                    for r in &mut this.reads {
                        if let Some(s) = &mut r.settle {
                            s.feed(&data);
                        }
                    }
                    match &mut this.strip {
                        Some(strip) => Frame::data(strip.feed(&data)),
                        None => Frame::data(data),
                    }
                }
                Err(trailers) => trailers,
            };
            // A body of known length ends with its last frame: it may never be polled again.
            if this.body.is_end_stream() {
                this.finish(true);
                if let Some(rest) = this.strip.take().map(|mut s| s.finish()) {
                    let mut data = frame.into_data().unwrap_or_default();
                    if !rest.is_empty() {
                        let mut joined = bytes::BytesMut::from(&data[..]);
                        joined.extend_from_slice(&rest);
                        data = joined.freeze();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
            }
            // Nothing left of it to pass on (an event held, or one taken out): the next.
            if frame.data_ref().is_some_and(Bytes::is_empty) && this.strip.is_some() {
                continue;
            }
            return Poll::Ready(Some(Ok(frame)));
        }
    }

    fn is_end_stream(&self) -> bool {
        // Bytes held back by the strip are still to come.
        self.strip.is_none() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
