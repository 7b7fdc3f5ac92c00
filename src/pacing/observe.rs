//! A response's verdict applied to the budget: what the store is told (the verdict's event,
//! and what the vendor said, to the budget of the group the response names), the lockout
//! spread to every budget of the destination, and the log lines a lockout is due.

use std::sync::atomic::Ordering;
use std::sync::Arc;

#[cfg(test)]
use http::HeaderMap;
use tokio_util::either::Either as Step;

use super::lane::{self, Lane};
#[cfg(test)]
use super::verdict;
use super::verdict::{Reading, Verdict};
use super::{Admission, Pacer};
use crate::budget::{Event, Lockout, Observation};
use crate::destination::Mode;

/// The store writes a verdict makes, boxed (see [`Pacer::observe`]).
pub(super) type Writes<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>>;

/// What [`Pacer::observe`] left to wait for, done: its writes, or nothing.
pub(super) fn written(writes: Option<Writes<'_>>) -> Step<Writes<'_>, std::future::Ready<()>> {
    match writes {
        Some(writes) => Step::Left(writes),
        None => Step::Right(std::future::ready(())),
    }
}

impl Pacer {
    /// Reads a response to an admitted request by status and headers, by the keys of its
    /// lane now (an exchange reads by the keys it found at its start).
    #[cfg(test)]
    pub(super) fn read(&self, admission: &Admission, status: u16, headers: &HeaderMap) -> Reading {
        verdict::classify(status, headers, &admission.lane.keys_now().pace)
    }

    /// The verdict of a response to an admitted request, with the store writes that apply it
    /// to the budget, to be awaited (none where nothing changes). `status` and
    /// the request line, which `request` writes only for a lockout, are kept with a lockout,
    /// which halts every budget of the destination. What the vendor says goes to the budget
    /// of the group whose `resource` the response names (`resource`), else to this one.
    // Decided at once; what is left to wait for is only the store's writes, where there are
    // any (none for a clean response to a budget at rest, most responses), boxed: they would
    // otherwise sit in every request's future, which is moved whole into its connection's
    // slot (see `Pacer::enter`).
    pub(super) fn observe<'a>(
        &'a self,
        admission: &'a Admission,
        reading: Reading,
        status: u16,
        resource: Option<&str>,
        request: impl FnOnce() -> String,
    ) -> (Verdict, Option<Writes<'a>>) {
        let verdict = reading.verdict;
        // Written only when a lockout keeps it: a clean response costs no formatting.
        let request = if verdict == Verdict::Lockout {
            request()
        } else {
            String::new()
        };
        // Jitter is drawn here, so that the budget's arithmetic stays a pure function.
        let mut vendor = reading.signal.and_then(|(s, reset)| {
            Some(Observation {
                family: s.family,
                remaining: s.remaining,
                limit: s.limit,
                reset: reset?,
                spread: rand::random::<f64>(),
                unanswered: admission.lane.tally.unanswered.load(Ordering::Relaxed) as u64,
            })
        });
        // The named group's budget for this request's key, where both are split by key:
        // what the vendor said is its, not this budget's.
        let named = resource
            .and_then(|r| admission.lanes.named(r))
            .and_then(|l| match admission.lane.key_name() {
                // Made for the client that made the admission's key.
                Some(key) if l.is_split() => {
                    let maker = admission.lane.maker().map(ToString::to_string);
                    self.key_lane(l, key, || maker.unwrap_or_default()).ok()
                }
                _ => Some(l.clone()),
            })
            .filter(|l| !Arc::ptr_eq(l, &admission.lane));
        let to_named = named.and_then(|other| Some((other, vendor.take()?)));
        // A lockout is kept on the budget split by key, which halts every key. Any other
        // verdict borrows the admission's lane: no reference count written on a lane every
        // request shares.
        let holder = (verdict == Verdict::Lockout).then(|| admission.lane.lock_holder_arc());
        let lane = holder.as_ref().unwrap_or(&admission.lane);
        // A clean response to a budget at rest changes nothing the store keeps: the backoff
        // is 1 already (the slot was reserved under the generation seen at 1, so no throttle
        // came between) and no block streak is left to clear. Not writing it halves the
        // transactions on the destination's row, each of which holds the row through its
        // commit while other instances' reservations queue behind it. Were the view stale,
        // only a decay or a streak reset is missed: pacing can only be slower.
        let nothing_to_write = verdict == Verdict::Clean
            && vendor.is_none()
            && lane.at_rest(admission.slot.generation);
        let widen = self.count_challenge(admission, verdict, status);
        let event = match verdict {
            Verdict::Clean => Some(Event::Clean {
                success: (200..400).contains(&status),
                generation: admission.slot.generation,
            }),
            Verdict::Throttled {
                retry_after, reset, ..
            } => Some(Event::Throttled {
                generation: admission.slot.generation,
                retry_after,
                reset,
                spread: rand::random::<f64>() * 2.0 - 1.0,
            }),
            Verdict::Lockout => Some(Event::Lockout(Lockout::new(
                status,
                request.clone(),
                self.instance.clone(),
            ))),
            // Past the destination's share of challenges, the pace widens as for a throttle.
            Verdict::Challenge(_) if widen => Some(Event::Throttled {
                generation: admission.slot.generation,
                retry_after: None,
                reset: None,
                spread: rand::random::<f64>() * 2.0 - 1.0,
            }),
            Verdict::None | Verdict::Challenge(_) if vendor.is_none() => None,
            Verdict::None | Verdict::Challenge(_) => Some(Event::None),
        };
        if verdict != Verdict::None {
            lane.series(&self.metrics)
                .verdict(verdict.as_str(), verdict.reason())
                .inc();
        }
        let event = event.filter(|_| !nothing_to_write);
        if to_named.is_none() && event.is_none() {
            return (verdict, None);
        }
        // Boxed: what it holds is larger than the rest of a request's reading, and a
        // response with something to write costs a store's write anyway.
        let writes = Box::pin(async move {
            if let Some((other, said)) = to_named {
                self.tell(&other, Event::None, Some(said)).await;
            }
            let Some(event) = event else {
                return;
            };
            let lane = holder.as_ref().unwrap_or(&admission.lane);
            let keys = admission.lane.keys();
            match self
                .store
                .record(&lane.name, &keys.rule, event, vendor)
                .await
            {
                Ok(view) => {
                    if verdict == Verdict::Lockout && keys.pace.mode == Mode::Shadow {
                        tracing::warn!(
                            destination = %lane.name,
                            status,
                            request = request.as_str(),
                            "destination would be locked out (shadow mode: nothing is refused); `pacegate unlock {}` clears it",
                            lane.name
                        );
                    } else if verdict == Verdict::Lockout {
                        tracing::error!(
                            destination = %lane.name,
                            status,
                            request = request.as_str(),
                            "destination locked out: nothing more is sent until `pacegate unlock {}`",
                            lane.name
                        );
                    }
                    lane.note(view);
                }
                Err(e) => {
                    tracing::error!(destination = %lane.name, "cannot record a {verdict} verdict: {e}")
                }
            }
            if verdict == Verdict::Lockout {
                // A lockout is the IP's, not one bucket's: every budget of the destination
                // halts, and with each its keys, which share its lockout channel (elsewhere,
                // at their next reservation).
                for other in admission.lanes.others(lane) {
                    let lock = Lockout::new(status, request.clone(), self.instance.clone());
                    self.tell(other, Event::Lockout(lock), None).await;
                }
            }
        });
        (verdict, Some(writes))
    }

    /// Counts a response against its budget's bot-wall challenges, and a challenge in the
    /// metrics and (once a minute) the log; whether challenges are past the destination's
    /// share, so that the pace widens.
    fn count_challenge(&self, admission: &Admission, verdict: Verdict, status: u16) -> bool {
        let Some(challenges) = admission.lane.challenges() else {
            return false;
        };
        let keys = admission.lane.keys();
        if keys.pace.challenges.is_none() {
            return false;
        }
        let now = lane::now_ms();
        let wall = match verdict {
            Verdict::Challenge(wall) => wall,
            Verdict::None => return false,
            _ => {
                challenges.answered(now);
                return false;
            }
        };
        let share = challenges.challenged(wall, now, keys.pace.challenge_share);
        let destination = admission.lane.destination();
        self.metrics
            .challenges
            .with_label_values(&[destination, wall.as_str()])
            .inc();
        if share.log {
            tracing::warn!(
                destination,
                vendor = wall.as_str(),
                status,
                challenges_5m = share.challenges,
                responses_5m = share.responses,
                widens = share.widens,
                "a bot wall challenged a request, which passes to the client as it came (nothing is locked or retried): pacegate intercepts TLS, so the vendor sees pacegate's TLS fingerprint, not the client's. Set `intercept = false` for {destination} (a blind tunnel: the client's own TLS, no verdicts), or ask the vendor to allow-list this egress IP",
            );
        }
        share.widens
    }

    /// Records `event` and what the vendor said on `lane`'s budget, other than the one that
    /// sent the request.
    async fn tell(&self, lane: &Arc<Lane>, event: Event, vendor: Option<Observation>) {
        let keys = lane.keys();
        match self
            .store
            .record(&lane.name, &keys.rule, event, vendor)
            .await
        {
            Ok(view) => lane.note(view),
            Err(e) => {
                tracing::error!(destination = %lane.name, "cannot record what another budget's response said: {e}")
            }
        }
    }
}
