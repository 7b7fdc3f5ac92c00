//! One request's exchange with its destination, start to end: the connection opened while it
//! waits, its slot, the check that the slot is still good to send on, the send, the verdict
//! read from the response (its body too, when a lockout status may be a throttle in
//! disguise), the verdict applied to the budget, and a throttled idempotent request retried
//! through a fresh slot. The proxy hands [`Pacer::exchange`] a request and the upstream client
//! and gets a response or a refusal: lateness, retries and verdicts are decided here only.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::Response;
use http_body_util::{BodyExt, Either, Full};
use tokio::time::Instant;
use tokio_util::either::Either as Step;

use super::advertise::Paced;
use super::observe::{written, Writes};
use super::outgoing::{BodyError, Outgoing};
use super::verdict::{self, Reading, Verdict};
use super::{sniff, Admission, Asking, PaceError, Pacer, Route};
use crate::class::Class;
use crate::destination::{Mode, Pace};
use crate::metrics::labels;
use crate::signals;
use crate::upstream::{ProxyBody, Upstream, UpstreamError};

/// An upstream response's body: as it came, or boxed once read into (see [`sniff`]).
type Answer = Either<hyper::body::Incoming, ProxyBody>;

/// An [`Answer`] as the client side serves a body.
fn boxed(answer: Answer) -> ProxyBody {
    match answer {
        Either::Left(incoming) => crate::upstream::boxed(incoming),
        Either::Right(body) => body,
    }
}

/// A throttled response kept while its request is retried is read into memory up to this size;
/// a larger one is handed to the client instead of retrying.
const KEPT_BODY_LIMIT: usize = 64 * 1024;

/// The longest a throttled response's body is read to be kept for a retry.
const KEEP_WITHIN: Duration = Duration::from_secs(3);

/// What an exchange adds to the canonical log line.
#[derive(Debug, Default, Clone)]
pub struct Note {
    /// How long the request waited for its slots, every attempt together.
    pub waited: Option<Duration>,
    /// The last response's verdict, as the log names it.
    pub verdict: Option<verdict::Named>,
    /// How many times a throttled response was retried.
    pub retries: u32,
    /// The class the request waited in.
    pub class: Option<Class>,
    /// The budget it was paced on (a group's, where its path or method picked one; a key's,
    /// where it is split by key): where its outcome is counted, and what its response tells
    /// the client.
    pub paced: Option<Paced>,
    /// When its last attempt was sent upstream: the upstream's time to its head counts
    /// from it (`Server-Timing`).
    pub sent: Option<Instant>,
}

/// Why an exchange gave the client no upstream response.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    /// No slot: locked out, out of time, the store failed, or shutting down.
    #[error(transparent)]
    Paced(#[from] PaceError),
    /// The upstream could not be reached or did not answer.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// The request body a meter estimates the cost from could not be read.
    #[error(transparent)]
    Body(#[from] BodyError),
}

/// An exchange's end: the response or the refusal, and what the log line says of it.
pub struct Exchanged {
    /// The response to hand on (its body holds the slot's admission until it is done), or
    /// why there is none.
    pub response: Result<Response<ProxyBody>, ExchangeError>,
    /// For the request log.
    pub note: Note,
}

impl Pacer {
    /// Carries `request` of `class` to `route`'s upstream through `upstream`, paced by the
    /// destination's budget, and returns the response to hand on or the refusal.
    // Not `async fn`s, here and in `carry`: their futures hold the arguments once, where an
    // `async fn` keeps each beside its own copy (see `Pacer::enter`).
    #[allow(clippy::manual_async_fn)]
    pub fn exchange<'a>(
        self: &'a Arc<Self>,
        upstream: &'a Upstream,
        route: &'a Route,
        class: Class,
        request: &'a mut Outgoing,
    ) -> impl std::future::Future<Output = Exchanged> + Send + 'a {
        async move {
            let mut note = Note {
                class: Some(class),
                ..Note::default()
            };
            let response = self.carry(upstream, route, class, request, &mut note).await;
            Exchanged { response, note }
        }
    }

    // Not an `async fn`: see `Pacer::enter`.
    #[allow(clippy::manual_async_fn)]
    fn carry<'a>(
        self: &'a Arc<Self>,
        upstream: &'a Upstream,
        route: &'a Route,
        class: Class,
        outgoing: &'a mut Outgoing,
        note: &'a mut Note,
    ) -> impl std::future::Future<Output = Result<Response<ProxyBody>, ExchangeError>> + Send + 'a
    {
        async move {
            // The budget of the group the request belongs to, or the destination's own; within
            // it, its key's.
            let picked = route.pick(outgoing.method().as_str(), outgoing.uri().path());
            // Lent for the counts here; one reference for the log line.
            let series = picked.lane.series(&self.metrics);
            note.paced = Some(Paced(picked.lane.clone()));
            // The request's cost to each of the destination's meters, estimated before it
            // waits: its body is read first where an estimate or a `json:FIELD` key reads it
            // (boxed: rare).
            if picked.reads_body() {
                Box::pin(self.meter(&picked, outgoing)).await?;
            }
            // Only a budget split by key asks what the request offers (its host searched for in
            // the URI again).
            let keyed;
            let route: &Route = if picked.lane.is_split() {
                // Boxed, as the other rare waits here (see `Pacer::enter`): only a budget split
                // by key waits for its key (the store's secret, on first use).
                keyed = Box::pin(async {
                    let asking = Asking {
                        host: outgoing.uri().host().unwrap_or_default(),
                        user: outgoing.user(),
                        headers: outgoing.headers(),
                        client: outgoing.client(),
                        body: outgoing.body_read(),
                    };
                    self.keyed(Route::clone(&picked), &asking).await
                })
                .await?;
                // The meters' budgets are split by the same key.
                self.key_meters(&keyed, outgoing)?;
                note.paced = Some(Paced(keyed.lane.clone()));
                &keyed
            } else {
                &picked
            };
            let destination: &str = route.label();
            // The keys as they are now; a reload meanwhile governs the next request.
            let pace = route.pace();
            // One deadline for the request and its retries; each retry waits in the same class.
            let begun = Instant::now();
            let deadline = begun + route.max_wait(class, &pace);
            // The first wait for a slot begins at the reading the deadline counts from; every
            // later one (a retry, a slot dropped) at its own.
            let mut first_wait = Some(begun);
            let retryable = outgoing.retryable();
            // Boxed: held across every wait of the exchange, and set only for a retry.
            let mut last_throttled: Option<Box<Response<ProxyBody>>> = None;
            // Shadow mode sends at once and never retries: clients see what they would without
            // pacegate, while the pacer counts what it would have done.
            let shadow = pace.mode == Mode::Shadow;
            // The steps of docs/pacing-model.md, once per attempt; an attempt that ends
            // without an answer to hand on (a slot too late, no connection in time, a
            // throttle retried) goes round again for a fresh slot.
            loop {
                // 1. A connection, opened while the request waits, not after its slot; to a
                // cold upstream, before the slot is asked for.
                let expecting = upstream.expect(outgoing.uri());
                let cold = !shadow && expecting.cold();
                // 2. The slot ("Reserving a slot", "Waiting, deadlines, concurrency"): each
                // meter's first, where the destination has meters, then the request's own.
                let metered = outgoing.meters().is_some_and(|m| !m.is_empty());
                if metered && shadow {
                    if let Some(m) = outgoing.meters() {
                        self.shadow_meters(m, class, deadline);
                    }
                }
                // Where the request's own budget binds, its meters are taken at its slot (4).
                let metered =
                    metered && !shadow && !route.meters().own_binds.load(Ordering::Relaxed);
                if cold || metered {
                    // Boxed, as the other rare waits here (see `Pacer::enter`): one wait for
                    // both, since a wait held in the future costs every request its room.
                    let mut for_meters = Duration::ZERO;
                    let waited = Box::pin(async {
                        if cold {
                            landed(deadline, upstream.first_connection(outgoing.uri())).await?;
                        }
                        if metered {
                            let from = Instant::now();
                            let taken = self.take_meters(outgoing, route, class, deadline).await;
                            for_meters = from.elapsed();
                            taken?;
                        }
                        Ok::<_, ExchangeError>(())
                    })
                    .await;
                    match waited {
                        Ok(()) => {}
                        // Out of time for another retry: the client gets the last throttled
                        // answer.
                        Err(ExchangeError::Paced(_)) if last_throttled.is_some() => {
                            return Ok(*last_throttled.take().expect("checked"))
                        }
                        Err(e) => return Err(e),
                    }
                    if cold {
                        first_wait = None;
                    }
                    // A wait counted from the request's start takes the meters' in; one
                    // counted from here (a first connection's wait left out, or a retry's)
                    // does not, and is told it apart.
                    if first_wait.is_none() {
                        *note.waited.get_or_insert_default() += for_meters;
                    }
                }
                let started = first_wait.take().unwrap_or_else(Instant::now);
                let admission = match self.enter(route, &pace, class, started, deadline).await {
                    Ok(a) => a,
                    Err(e) => {
                        if let Some(m) = outgoing.meters() {
                            self.give_back(m);
                        }
                        // Out of time for another retry: the client gets the last throttled
                        // answer.
                        if let Some(kept) = last_throttled.take() {
                            return Ok(*kept);
                        }
                        return Err(e.into());
                    }
                };
                *note.waited.get_or_insert_default() += admission.waited;
                // 3. Still on time: a slot come to too late is dropped, never sent on; so are
                // the meters' slots, which the request's own must follow closely.
                if !shadow && self.too_late(&admission, admission.sent) {
                    if let Some(m) = outgoing.meters() {
                        self.give_back(m);
                    }
                    continue;
                }
                // Its meters' slots, where they are to be taken at its own: boxed, as the
                // other rare waits here.
                if !shadow
                    && self.meters_due_at_slot(outgoing, admission.sent)
                    && !Box::pin(self.meters_at_slot(outgoing, route, class, &admission)).await
                {
                    continue;
                }
                let req = if retryable {
                    outgoing.attempt()
                } else {
                    outgoing.lend()
                };
                // 4. The send, on a connection in time: the same check where the client hands
                // out the connection; a request that would wait for one past its slot is not
                // sent on it.
                let by = (!shadow).then(|| admission.send_by());
                // As it came, until a look at its body or a retry boxes it: the common answer is
                // boxed once, with its admission. Handed to `judge` within one expression, so
                // that the exchange's future keeps no room for it beside the judge's.
                let (verdict, response) = {
                    note.sent = Some(Instant::now());
                    outgoing.depart();
                    let unanswered = admission.lane.tally.unanswered();
                    let sent = upstream.send(req, by, Some(expecting)).await;
                    drop(unanswered);
                    let response = match sent {
                        Err(UpstreamError::Late(late)) => {
                            self.no_connection_in_time(&admission);
                            if let Some(m) = outgoing.meters() {
                                self.give_back(m);
                            }
                            if !outgoing.take_back() {
                                return Err(UpstreamError::Late(late).into());
                            }
                            // The next slot, once the connection opened for this one is there.
                            Box::pin(landed(deadline, upstream.opened(outgoing.uri()))).await?;
                            continue;
                        }
                        Err(e) => {
                            // Never reached the vendor: nothing to charge. Otherwise it may
                            // have, and the estimate stands.
                            if let Some(m) = outgoing.meters() {
                                match e {
                                    UpstreamError::Connect(_) => self.give_back(m),
                                    _ => self.spent(m),
                                }
                            }
                            return Err(e.into());
                        }
                        Ok(response) => response.map(Either::Left),
                    };
                    series.response(response.status()).inc();
                    self.judge(route, &pace, &admission, response, outgoing)
                }
                .await;
                // 5. The verdict ("Verdicts"), applied to the budget in `judge`.
                note.verdict = Some(verdict.named());
                // 6. "Throttle, don't shut down": an idempotent request goes back for a fresh
                // slot, the throttled answer kept for the client should none come in time.
                let throttled = matches!(verdict, Verdict::Throttled { .. });
                if throttled && retryable && !shadow && note.retries < pace.retry_throttled {
                    let kept = match Box::pin(keep(response.map(boxed))).await {
                        Ok(kept) => kept,
                        Err(why) => {
                            return Err(UpstreamError::Protocol(format!(
                                "the throttled response's body {why}, so the request is not retried"
                            ))
                            .into())
                        }
                    };
                    note.retries += 1;
                    if let Some(m) = outgoing.meters() {
                        self.spent(m);
                    }
                    self.metrics
                        .retries
                        .with_label_values(&labels(destination))
                        .inc();
                    last_throttled = Some(Box::new(kept));
                    continue;
                }
                // 7. The answer handed on. The slot's concurrency permit and in-flight count
                // last until the body is done, or cut for stalling (`body_timeout`): boxed
                // once, with both.
                let (parts, body) = response.into_parts();
                let body = body.map_frame(move |frame| {
                    let _held = &admission;
                    frame
                });
                let Some(mut m) = outgoing.take_meters().filter(|m| !m.is_empty()) else {
                    return Ok(Response::from_parts(parts, upstream.body(body)));
                };
                // 8. The meters settled: what the response says the request cost, as its
                // bytes pass; in full where the vendor charges nothing for its answer (a
                // refusal other than a throttle, a failure of its own).
                let status = parts.status.as_u16();
                if (400..600).contains(&status) && status != 429 {
                    self.give_back(&mut m);
                    return Ok(Response::from_parts(parts, upstream.body(body)));
                }
                let body = self.settling(m, &parts.headers, body);
                return Ok(Response::from_parts(parts, upstream.body(body)));
            }
        }
    }

    /// The verdict of `response` to `admission`'s request, applied to the budget, and the
    /// response to hand on (read whole, where its body had to be looked at).
    // Decided at once where the headers say enough (most responses): the future then holds
    // the response, the verdict and the store's writes if there are any (boxed, see
    // `Pacer::observe`), not a reading and a look at the body beside them, in a request's
    // future that is moved whole into its connection's slot (see `Pacer::enter`).
    fn judge<'a>(
        &'a self,
        route: &'a Route,
        pace: &'a Pace,
        admission: &'a Admission,
        response: Response<Answer>,
        outgoing: &'a Outgoing,
    ) -> impl std::future::Future<Output = (Verdict, Response<Answer>)> + Send + 'a {
        let status = response.status().as_u16();
        // Read by status and headers; a lockout may still turn out a throttle by its body
        // (see [`Reading::needs_body`]).
        let mut reading = verdict::classify(status, response.headers(), pace);
        // A throttle the vendor puts down to a meter's spent budget pauses that meter, not
        // the request budget.
        if let Some(m) = outgoing.metering() {
            if self.meters_said(m, response.headers())
                && matches!(reading.verdict, Verdict::Throttled { .. })
            {
                reading.verdict = Verdict::None;
            }
        }
        if reading.needs_body(pace) {
            // Boxed: rare, and larger than the rest of the reading.
            return Step::Right(Box::pin(async move {
                let (whole, text) = sniff::sniff(response.map(boxed)).await;
                let reading = reading.by_body(pace, whole.headers(), &text);
                let response = whole.map(Either::Right);
                let (verdict, writes) =
                    self.observe_on(route, admission, reading, status, &response, outgoing);
                written(writes).await;
                (verdict, response)
            }));
        }
        let (verdict, writes) =
            self.observe_on(route, admission, reading, status, &response, outgoing);
        Step::Left(written(writes).map(move |()| (verdict, response)))
    }

    /// [`Pacer::observe`] on `response` to `outgoing`: the bucket it names is looked up only
    /// where a group names one (it costs every other response nothing).
    fn observe_on<'a>(
        &'a self,
        route: &Route,
        admission: &'a Admission,
        reading: Reading,
        status: u16,
        response: &Response<Answer>,
        outgoing: &Outgoing,
    ) -> (Verdict, Option<Writes<'a>>) {
        let resource = route
            .names_buckets()
            .then(|| signals::resource(response.headers()))
            .flatten();
        self.observe(admission, reading, status, resource.as_deref(), || {
            outgoing.request_line()
        })
    }

    /// Whether `admission`'s slot is too late to send on at `now`: the request was held up
    /// after its slot was handed out (this process descheduled, an upstream connection slow
    /// to come), and sent then it would bunch with the next slots, and could crowd a quota
    /// window, which allows a slot used up to [`crate::budget::Rule::max_late`] late and no
    /// more. Counted as a slot dropped; the caller waits for another. An exchange asks at
    /// once, at the reading its admission was counted sent at.
    pub(super) fn too_late(&self, admission: &Admission, now: Instant) -> bool {
        let Some(late) = admission.too_late_at(now) else {
            return false;
        };
        self.held_up(
            admission,
            late,
            "a request held up past its slot waits for another",
        );
        true
    }

    /// `admission`'s request had no upstream connection by [`Admission::send_by`]: like
    /// [`Pacer::too_late`], its slot is dropped and it waits for another.
    fn no_connection_in_time(&self, admission: &Admission) {
        let late = admission.slot.lateness(Instant::now());
        self.held_up(
            admission,
            late,
            "a request without an upstream connection in time for its slot waits for another",
        );
    }

    fn held_up(&self, admission: &Admission, late: Duration, why: &'static str) {
        let lane = &admission.lane;
        lane.series(&self.metrics).slots_dropped.inc();
        tracing::info!(destination = %lane.name, late_ms = late.as_secs_f64() * 1000.0, "{why}");
    }
}

/// Reads a throttled response into memory so that its connection is free while the request
/// is retried. `Err` says why it cannot be kept (the body failed, is larger than
/// [`KEPT_BODY_LIMIT`], or did not end within [`KEEP_WITHIN`]), so the caller must not retry.
async fn keep(response: Response<ProxyBody>) -> Result<Response<ProxyBody>, String> {
    let (parts, mut body) = response.into_parts();
    let mut kept = Vec::new();
    let read = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("failed while it was read ({e})"))?;
            if let Some(data) = frame.data_ref() {
                if kept.len() + data.len() > KEPT_BODY_LIMIT {
                    return Err(format!("is larger than {} KiB", KEPT_BODY_LIMIT / 1024));
                }
                kept.extend_from_slice(data);
            }
        }
        Ok(())
    };
    // A whole bound, not an idle one: a body that trickles a byte a second holds the client
    // no longer than this.
    tokio::time::timeout(KEEP_WITHIN, read)
        .await
        .map_err(|_| {
            format!(
                "did not end within {}",
                humantime::format_duration(KEEP_WITHIN)
            )
        })??;
    let body = Full::new(Bytes::from(kept))
        .map_err(|never| match never {})
        .boxed();
    Ok(Response::from_parts(parts, body))
}

/// Waits until `deadline` for the connection `landing` awaits: its failure is the request's
/// (a 502, or a 504 at the connect timeout). Out of time, the pacer's own deadline refuses
/// the request when it asks for its slot.
// A combinator, not an `async fn`: the future is the timeout's alone, not the timeout's
// beside the `landing` it was made from.
fn landed(
    deadline: Instant,
    landing: impl std::future::Future<Output = Result<(), UpstreamError>>,
) -> impl std::future::Future<Output = Result<(), UpstreamError>> {
    tokio::time::timeout_at(deadline, landing).map(|landed| match landed {
        Ok(Err(unreachable)) => Err(unreachable),
        _ => Ok(()),
    })
}
