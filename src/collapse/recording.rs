//! The shared body of a leader's response, read onto its tape by the leader's fetch: kept
//! once whole, streamed by past `max_object`, and, cut short by the vendor, asked for again
//! and gone on from where it was cut.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::SystemTime;

use http::header::HeaderMap;
use http::Response;
use http_body_util::BodyExt;

use super::tape::Shared;
use super::{Collapser, Flight};
use crate::pacing::{Exchanged, Route};
use crate::upstream::ProxyBody;

/// How many times a shared body cut short is asked for again.
const RESUMES: u8 = 2;

/// The shared body of a leader's response, read onto its tape by the leader's fetch, a task
/// of its own (a leader whose client goes away leaves it to the waiters).
pub struct Recording {
    pub(super) collapser: Arc<Collapser>,
    pub(super) route: Route,
    pub(super) base: Arc<str>,
    pub(super) key: Arc<str>,
    pub(super) flight: Arc<Flight>,
    pub(super) shared: Arc<Shared>,
    pub(super) received: SystemTime,
    pub(super) body: Option<ProxyBody>,
    /// Bytes of the body on the tape already, from a fetch cut short: left out of this one.
    pub(super) skip: usize,
    /// Kept once whole; else streamed by.
    pub(super) kept: bool,
    pub(super) resumed: u8,
}

/// A shared body cut short: the fetch asks for it again, through a slot, and goes on
/// ([`Cut::resume`]).
pub struct Cut(Recording);

impl Recording {
    /// Reads the body onto the tape, to its end: `Some` where it was cut short and may be
    /// asked for again (its entity named by a validator, so that the rest of another
    /// fetch of it is the rest of this one). Else the readers are cut as it was: a body
    /// cut short is never given as whole.
    pub async fn record(mut self) -> Option<Cut> {
        let Some(mut body) = self.body.take() else {
            self.finish(Err("no body to record".into()));
            return None;
        };
        loop {
            match body.frame().await {
                None => {
                    self.finish(Ok(()));
                    return None;
                }
                Some(Err(e)) => {
                    if self.resumed < RESUMES && validated(&self.shared.headers) {
                        self.resumed += 1;
                        self.skip = self.shared.bytes();
                        self.collapser.count(&self.route, "cut");
                        return Some(Cut(self));
                    }
                    self.finish(Err(e.to_string()));
                    return None;
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        let had = self.skip.min(data.len());
                        self.skip -= had;
                        if had < data.len() {
                            self.shared.push(data.slice(had..));
                            self.collapser.in_flight();
                        }
                        if !self.room() {
                            // Past max_object, or what memory has left: not kept after all.
                            self.kept = false;
                            self.shared.stream();
                            self.collapser.land(&self.key, &self.flight);
                            self.collapser.count(&self.route, "streamed");
                        }
                        if !self.kept && !self.shared.drained().await {
                            self.finish(Err("no reader is left".into()));
                            return None;
                        }
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            self.shared.trailers(trailers);
                        }
                    }
                },
            }
        }
    }

    /// Whether a kept body still fits: within `max_object`, and the bodies in flight within
    /// `[cache] memory`.
    fn room(&self) -> bool {
        let config = self.collapser.config.load();
        !self.kept
            || (self.shared.bytes() as u64 <= config.max_object
                && self.collapser.held.load(Ordering::Relaxed) as u64 <= config.memory)
    }

    /// Ends the tape, keeps a body that came whole, and lands the flight.
    fn finish(self, end: Result<(), String>) {
        self.shared.end(end);
        self.collapser.in_flight();
        if self.kept && self.shared.whole() {
            self.collapser
                .keep(&self.route, &self.base, self.received, &self.shared);
        }
        self.collapser.land(&self.key, &self.flight);
    }
}

impl Cut {
    /// Goes on with `exchanged`, the same request sent again: its body, past what the tape
    /// has, where it is the same entity (the same status and validators); else the readers
    /// are cut.
    pub fn resume(self, exchanged: Exchanged) -> Option<Recording> {
        let mut recording = self.0;
        match exchanged.response {
            Ok(response) if same_entity(&recording.shared, &response) => {
                recording.body = Some(response.into_body());
                recording.collapser.count(&recording.route, "resumed");
                Some(recording)
            }
            Ok(response) => {
                recording.finish(Err(format!(
                    "the body was cut short, and asked for again, the vendor answered {} with another entity",
                    response.status()
                )));
                None
            }
            Err(e) => {
                recording.finish(Err(format!(
                    "the body was cut short, and asking for it again failed: {e}"
                )));
                None
            }
        }
    }
}

/// Whether a response names its entity so that another fetch of it can be told apart: a
/// strong `ETag`, or a `Last-Modified` with a `Content-Length`.
fn validated(headers: &HeaderMap) -> bool {
    let strong = headers
        .get(http::header::ETAG)
        .is_some_and(|v| !v.as_bytes().starts_with(b"W/"));
    strong
        || (headers.contains_key(http::header::LAST_MODIFIED)
            && headers.contains_key(http::header::CONTENT_LENGTH))
}

/// Whether `response` is the entity `shared` began: the same status, and the same strong
/// `ETag`, or the same `Last-Modified` and `Content-Length`.
fn same_entity<B>(shared: &Shared, response: &Response<B>) -> bool {
    let same = |name: http::HeaderName| {
        let (a, b) = (shared.headers.get(&name), response.headers().get(&name));
        a.is_some() && a == b
    };
    response.status() == shared.status
        && if shared
            .headers
            .get(http::header::ETAG)
            .is_some_and(|v| !v.as_bytes().starts_with(b"W/"))
        {
            same(http::header::ETAG)
        } else {
            same(http::header::LAST_MODIFIED) && same(http::header::CONTENT_LENGTH)
        }
}
