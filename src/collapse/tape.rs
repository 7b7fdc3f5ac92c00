//! A shared response: its head, and its body on a tape that every reader follows from its
//! start as the bytes arrive (the leader's client, its waiters, the requests a kept response
//! answers), recorded by a task of its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{HeaderMap, AUTHORIZATION, COOKIE};
use http::request::Parts;
use http::{Response, StatusCode, Version};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::{says_shared, vary_names};
use crate::upstream::{BoxError, ProxyBody};

/// The leader's response as the waiters share it: its head, the leader's request headers
/// (for `Vary`), and its body on a tape.
pub(super) struct Shared {
    pub(super) status: StatusCode,
    pub(super) version: Version,
    pub(super) headers: HeaderMap,
    pub(super) request: HeaderMap,
    /// Shared with the entry it refreshes, where a 304 brought new headers.
    pub(super) tape: Arc<Tape>,
    pub(super) held: Arc<AtomicUsize>,
}

/// A body as it arrives, kept for every reader from its start.
#[derive(Default)]
pub(super) struct Tape {
    pub(super) state: Mutex<Recorded>,
    pub(super) grew: Notify,
}

#[derive(Default)]
pub(super) struct Recorded {
    pub(super) chunks: Vec<Bytes>,
    pub(super) bytes: usize,
    pub(super) trailers: Option<HeaderMap>,
    /// The body ended: `Ok` whole, `Err` cut with this error.
    pub(super) end: Option<Result<(), String>>,
}

impl Shared {
    /// The body's bytes recorded so far.
    pub(super) fn bytes(&self) -> usize {
        self.tape.state.lock().bytes
    }

    /// Reads `body` onto the tape, to its end or its error.
    pub(super) async fn record(&self, mut body: ProxyBody) {
        loop {
            let frame = body.frame().await;
            let mut state = self.tape.state.lock();
            match frame {
                None => state.end = Some(Ok(())),
                Some(Err(e)) => state.end = Some(Err(e.to_string())),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        state.bytes += data.len();
                        self.held.fetch_add(data.len(), Ordering::Relaxed);
                        state.chunks.push(data);
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            state.trailers = Some(trailers);
                        }
                    }
                },
            }
            let done = state.end.is_some();
            let bytes = state.bytes;
            drop(state);
            self.tape.grew.notify_waiters();
            if done {
                // Recorded: what it holds now counts against the kept responses' memory, if
                // it is kept, not against the responses in flight.
                self.held.fetch_sub(bytes, Ordering::Relaxed);
                return;
            }
        }
    }

    /// Whether a waiter's `request` may have this response: the same values of the headers
    /// its `Vary` names, and, where it sends credentials or cookies, a response that says it
    /// may be shared.
    pub(super) fn serves(&self, request: &Parts) -> bool {
        let same = |name: &str| {
            request
                .headers
                .get_all(name)
                .iter()
                .eq(self.request.get_all(name).iter())
        };
        let varies = vary_names(&self.headers).all(|name| same(&name));
        if !varies {
            return false;
        }
        let personal =
            request.headers.contains_key(AUTHORIZATION) || request.headers.contains_key(COOKIE);
        !personal || says_shared(&self.headers)
    }

    /// The response again, for one more reader.
    pub(super) fn response(self: &Arc<Self>) -> Response<ProxyBody> {
        let mut response = Response::new(self.reader());
        *response.status_mut() = self.status;
        *response.version_mut() = self.version;
        *response.headers_mut() = self.headers.clone();
        response
    }

    pub(super) fn reader(self: &Arc<Self>) -> ProxyBody {
        Reader {
            shared: self.clone(),
            next: 0,
            trailers_sent: false,
            waiting: None,
        }
        .boxed()
    }
}

/// One reader of a tape: its chunks from the first, as they arrive.
struct Reader {
    shared: Arc<Shared>,
    next: usize,
    trailers_sent: bool,
    waiting: Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + Sync>>>,
}

impl Body for Reader {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            // Registered before the tape is looked at, so that a chunk recorded in between
            // still wakes this reader.
            if self.waiting.is_none() {
                let shared = self.shared.clone();
                self.waiting = Some(Box::pin(async move { shared.tape.grew.notified().await }));
            }
            if let Some(waiting) = self.waiting.as_mut() {
                // Polled once to register; a wake-up before the look below is kept.
                if waiting.as_mut().poll(cx).is_ready() {
                    self.waiting = None;
                    continue;
                }
            }
            let state = self.shared.tape.state.lock();
            if let Some(chunk) = state.chunks.get(self.next).cloned() {
                drop(state);
                self.next += 1;
                return Poll::Ready(Some(Ok(Frame::data(chunk))));
            }
            match &state.end {
                None => return Poll::Pending,
                Some(Err(e)) => {
                    let e = e.clone();
                    drop(state);
                    return Poll::Ready(Some(Err(e.into())));
                }
                Some(Ok(())) => {
                    let trailers = state.trailers.clone();
                    drop(state);
                    if !self.trailers_sent {
                        self.trailers_sent = true;
                        if let Some(t) = trailers {
                            return Poll::Ready(Some(Ok(Frame::trailers(t))));
                        }
                    }
                    return Poll::Ready(None);
                }
            }
        }
    }
}
