//! A shared response: its head, and its body on a tape that every reader follows from its
//! start as the bytes arrive (the leader's client, its waiters, the requests a kept response
//! answers), recorded by a task of its own.
//!
//! A tape that is kept holds every chunk. One that is not ("streamed": past `max_object`, or
//! past what `[cache] memory` has left) lets go of each chunk once every reader has had it,
//! and its recording waits for the slowest reader while more than [`WINDOW`] bytes are
//! unread: its memory does not grow with the body, and the readers share its one fetch.

use std::collections::{HashMap, VecDeque};
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

/// The most bytes a streamed tape holds that some reader has not had yet.
pub(super) const WINDOW: usize = 1 << 20;

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

/// A body as it arrives, kept for every reader from its start (or, streamed, until every
/// reader has had it).
#[derive(Default)]
pub(super) struct Tape {
    state: Mutex<Recorded>,
    /// The waiters that will read it and have no reader yet: a streamed tape lets go of
    /// nothing while there are any.
    joining: Arc<AtomicUsize>,
    /// A chunk was recorded, or the body ended.
    grew: Notify,
    /// A reader of a streamed tape had a chunk, or went away.
    read: Notify,
}

#[derive(Default)]
struct Recorded {
    /// The chunks held, the first of them the `gone`-th of the body.
    chunks: VecDeque<Bytes>,
    /// How many chunks a streamed tape let go of.
    gone: usize,
    /// The body's bytes recorded so far, and how many of them are held.
    bytes: usize,
    buffered: usize,
    trailers: Option<HeaderMap>,
    /// The body ended: `Ok` whole, `Err` cut with this error.
    end: Option<Result<(), String>>,
    /// Chunks every reader has had are let go of.
    streamed: bool,
    /// The next chunk of each reader, by its number.
    readers: HashMap<u64, usize>,
    numbered: u64,
}

impl Tape {
    /// A tape the waiters counted by `joining` will read.
    pub(super) fn joined_by(joining: Arc<AtomicUsize>) -> Self {
        Self {
            joining,
            ..Self::default()
        }
    }

    /// A waiter went away without reading: what only it held back may go.
    pub(super) fn left(&self, held: &AtomicUsize) {
        self.state.lock().let_go(held, &self.joining);
        self.read.notify_waiters();
    }
}

impl Recorded {
    /// Lets go of the chunks every reader has had, where the tape is streamed and no waiter
    /// is still to make its reader.
    fn let_go(&mut self, held: &AtomicUsize, joining: &AtomicUsize) {
        if !self.streamed || joining.load(Ordering::Acquire) > 0 {
            return;
        }
        let slowest = self.readers.values().copied().min().unwrap_or(usize::MAX);
        while self.gone < slowest {
            let Some(chunk) = self.chunks.pop_front() else {
                break;
            };
            self.gone += 1;
            self.buffered -= chunk.len();
            held.fetch_sub(chunk.len(), Ordering::Relaxed);
        }
    }
}

impl Shared {
    /// The body's bytes recorded so far.
    pub(super) fn bytes(&self) -> usize {
        self.tape.state.lock().bytes
    }

    /// The body's bytes held, in one piece of its own: a chunk as it came may be a slice
    /// of a larger buffer the connection read into, held as long as the slice is.
    pub(super) fn body(&self) -> Bytes {
        let state = self.tape.state.lock();
        let mut body = bytes::BytesMut::with_capacity(state.buffered);
        for chunk in &state.chunks {
            body.extend_from_slice(chunk);
        }
        body.freeze()
    }

    /// Whether the body came whole, every chunk of it held.
    pub(super) fn whole(&self) -> bool {
        let state = self.tape.state.lock();
        matches!(state.end, Some(Ok(()))) && !state.streamed
    }

    /// Records a chunk of the body.
    pub(super) fn push(&self, data: Bytes) {
        let mut state = self.tape.state.lock();
        state.bytes += data.len();
        state.buffered += data.len();
        self.held.fetch_add(data.len(), Ordering::Relaxed);
        state.chunks.push_back(data);
        drop(state);
        self.tape.grew.notify_waiters();
    }

    /// Records the body's trailers.
    pub(super) fn trailers(&self, trailers: HeaderMap) {
        self.tape.state.lock().trailers = Some(trailers);
    }

    /// Ends the body: whole, or cut with an error every reader gets where the body would
    /// have gone on.
    pub(super) fn end(&self, end: Result<(), String>) {
        let mut state = self.tape.state.lock();
        state.end = Some(end);
        // Recorded: what it holds now counts against the kept responses' memory, if it is
        // kept, not against the responses in flight.
        self.held.fetch_sub(state.buffered, Ordering::Relaxed);
        drop(state);
        self.tape.grew.notify_waiters();
    }

    /// The tape is not kept: from now on it holds only what some reader has not had.
    pub(super) fn stream(&self) {
        let mut state = self.tape.state.lock();
        state.streamed = true;
        state.let_go(&self.held, &self.tape.joining);
    }

    /// Waits, on a streamed tape, until no more than [`WINDOW`] bytes are unread; `false`
    /// where no reader is left to read them (a reader made late, the body gone on without
    /// it, is cut rather than given its rest).
    pub(super) async fn drained(&self) -> bool {
        loop {
            // Registered before the look, so that a read in between still wakes it.
            let read = self.tape.read.notified();
            {
                let state = self.tape.state.lock();
                if !state.streamed {
                    return true;
                }
                if state.buffered <= WINDOW {
                    return true;
                }
                // No reader left, none to come, and a window's worth unread: nobody will
                // read the rest.
                if state.readers.is_empty() && self.tape.joining.load(Ordering::Acquire) == 0 {
                    return false;
                }
            }
            read.await;
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
        let number = {
            let mut state = self.tape.state.lock();
            state.numbered += 1;
            let number = state.numbered;
            state.readers.insert(number, 0);
            number
        };
        Reader {
            shared: self.clone(),
            number,
            next: 0,
            trailers_sent: false,
            waiting: None,
        }
        .boxed()
    }
}

#[cfg(test)]
impl Shared {
    /// A 200 with no headers and nothing on its tape yet, counting into a `held` of its own.
    pub(super) fn empty() -> Arc<Self> {
        Arc::new(Self {
            status: StatusCode::OK,
            version: Version::HTTP_11,
            headers: HeaderMap::new(),
            request: HeaderMap::new(),
            tape: Arc::default(),
            held: Arc::new(AtomicUsize::new(0)),
        })
    }
}

/// One reader of a tape: its chunks from the first, as they arrive.
struct Reader {
    shared: Arc<Shared>,
    number: u64,
    next: usize,
    trailers_sent: bool,
    waiting: Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + Sync>>>,
}

impl Drop for Reader {
    fn drop(&mut self) {
        let mut state = self.shared.tape.state.lock();
        state.readers.remove(&self.number);
        state.let_go(&self.shared.held, &self.shared.tape.joining);
        drop(state);
        self.shared.tape.read.notify_waiters();
    }
}

impl Body for Reader {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        // A reader is `Unpin`: its fields are borrowed apart, the tape without a clone.
        let this = self.get_mut();
        loop {
            // Registered before the tape is looked at, so that a chunk recorded in between
            // still wakes this reader.
            if this.waiting.is_none() {
                let shared = this.shared.clone();
                this.waiting = Some(Box::pin(async move { shared.tape.grew.notified().await }));
            }
            if let Some(waiting) = this.waiting.as_mut() {
                // Polled once to register; a wake-up before the look below is kept.
                if waiting.as_mut().poll(cx).is_ready() {
                    this.waiting = None;
                    continue;
                }
            }
            let shared = &this.shared;
            let mut state = shared.tape.state.lock();
            if this.next < state.gone {
                // Made after a streamed body let go of its start: never handed a body
                // without its start as if it were whole.
                return Poll::Ready(Some(Err(
                    "the shared body went on without this reader".into()
                )));
            }
            let at = this.next - state.gone;
            if let Some(chunk) = state.chunks.get(at).cloned() {
                this.next += 1;
                // Where a kept tape turns streamed, a reader's place is known from its next
                // chunk on: until then it holds the chunks from the one it had last.
                let streamed = state.streamed;
                if streamed {
                    let next = this.next;
                    state.readers.insert(this.number, next);
                    state.let_go(&shared.held, &shared.tape.joining);
                }
                drop(state);
                if streamed {
                    shared.tape.read.notify_waiters();
                }
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
                    if !this.trailers_sent {
                        this.trailers_sent = true;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn every_reader_gets_each_chunk_as_it_arrives_from_the_first() {
        let tape = Shared::empty();
        let mut early = tape.reader();
        tape.push(Bytes::from_static(b"first "));
        // The early reader has the first chunk before the body is over.
        let first = early.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "first ");
        assert_eq!(
            tape.held.load(Ordering::Relaxed),
            6,
            "held while it is read"
        );
        let pending = tokio::spawn(async move { early.collect().await.unwrap().to_bytes() });
        tape.push(Bytes::from_static(b"second"));
        tape.end(Ok(()));
        // A reader made later reads it all from the start.
        let late = tape.reader().collect().await.unwrap().to_bytes();
        assert_eq!(late, "first second");
        assert_eq!(pending.await.unwrap(), "second");
        assert!(tape.whole());
        assert_eq!(
            tape.held.load(Ordering::Relaxed),
            0,
            "counted against the memory for responses in flight only while it is read"
        );
    }

    #[tokio::test]
    async fn a_body_cut_short_is_cut_short_for_every_reader() {
        let tape = Shared::empty();
        tape.push(Bytes::from_static(b"part"));
        tape.end(Err("upstream reset".into()));
        let mut reader = tape.reader();
        assert_eq!(
            reader.frame().await.unwrap().unwrap().into_data().unwrap(),
            "part"
        );
        assert!(reader.frame().await.unwrap().is_err());
        assert!(!tape.whole());
    }

    #[tokio::test]
    async fn a_streamed_tape_holds_only_what_its_slowest_reader_has_not_had() {
        let tape = Shared::empty();
        let (mut fast, mut slow) = (tape.reader(), tape.reader());
        tape.stream();
        let chunk = Bytes::from(vec![7u8; WINDOW / 2]);
        for _ in 0..2 {
            tape.push(chunk.clone());
        }
        assert!(
            tape.drained().await,
            "a window's worth may wait for its readers"
        );
        tape.push(chunk.clone());
        for _ in 0..3 {
            fast.frame().await.unwrap().unwrap();
        }
        // The slow reader holds all three: the recording waits for it.
        let waited = tokio::time::timeout(Duration::from_millis(50), tape.drained()).await;
        assert!(waited.is_err(), "past the window, the recording waits");
        slow.frame().await.unwrap().unwrap();
        assert!(tape.drained().await);
        assert_eq!(
            tape.held.load(Ordering::Relaxed),
            chunk.len() * 2,
            "the chunk both had is let go of"
        );
        // A reader made now would miss the start: it is cut, never given the rest as whole.
        let mut late = tape.reader();
        assert!(late.frame().await.unwrap().is_err());
        drop(late);
        // With no reader left, nothing waits for one.
        drop((fast, slow));
        assert_eq!(tape.held.load(Ordering::Relaxed), 0);
        tape.push(chunk.clone());
        tape.push(chunk.clone());
        tape.push(chunk);
        assert!(!tape.drained().await, "no reader is left to read the rest");
    }
}
