//! A request as an exchange holds it: kept as parts, so that a body-less request can be sent
//! again after a throttle, and with its body lent to each attempt, so that one given up before
//! it reached a connection leaves the body whole for the next.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{Method, Request};
use http_body::Body as _;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use parking_lot::Mutex;

use super::meters::Metering;
use crate::upstream::stall::Stall;
use crate::upstream::{BoxError, ProxyBody};

/// A request ready for the upstream client, kept as parts so that a body-less request can be
/// sent again.
pub struct Outgoing {
    parts: Parts,
    body: Option<Incoming>,
    /// The body lent to the attempt under way ([`Outgoing::lend`]).
    lent: Option<Arc<Mutex<Option<Incoming>>>>,
    /// A metered request: its body, read whole before the slot where a meter estimates its
    /// cost from it, and sent from memory by every attempt; and its meters' slots. Boxed: a
    /// request's future holds its `Outgoing`, and most requests have no meter.
    metered: Option<Box<Metered>>,
    /// Who sends it: a key (`key = "proxy-user"`), and who made a new key
    /// (`max_keys_per_client`).
    sender: Sender,
    /// How long the body may keep the upstream waiting for its next bytes (shared: a
    /// request's future holds its `Outgoing`, and every byte of it is moved with it).
    stall: Option<Arc<Stall>>,
    /// Where a collapsed request's leader says when it left, for those waiting for it.
    departure: Option<Arc<Departure>>,
}

/// When a request last left for the upstream, for those that wait for its answer: in
/// milliseconds from the lanes' clock (`lane::now_ms`), plus one (0: not yet).
#[derive(Debug, Default)]
pub struct Departure(std::sync::atomic::AtomicU64);

impl Departure {
    /// The request leaves now.
    pub fn stamp(&self) {
        let now = super::lane::now_ms().min(u64::MAX - 1);
        self.0.store(now + 1, std::sync::atomic::Ordering::Relaxed);
    }

    /// How long ago it last left, if it has.
    pub fn since(&self) -> Option<std::time::Duration> {
        let at = self
            .0
            .load(std::sync::atomic::Ordering::Relaxed)
            .checked_sub(1)?;
        Some(std::time::Duration::from_millis(
            super::lane::now_ms().saturating_sub(at),
        ))
    }
}

impl Outgoing {
    /// A request rewritten for the upstream (absolute URI, HTTP/1.1, hop-by-hop headers
    /// removed) with its body.
    pub fn new(parts: Parts, body: Incoming) -> Self {
        Self {
            parts,
            // A body that is already over is sent as none: nothing to lend, or to take back.
            body: Some(body).filter(|b| !b.is_end_stream()),
            lent: None,
            metered: None,
            sender: Sender::Unknown,
            stall: None,
            departure: None,
        }
    }

    /// Tells `departure` when the request leaves.
    pub fn tell_departures(&mut self, departure: Arc<Departure>) {
        self.departure = Some(departure);
    }

    /// The request leaves for the upstream now: whoever waits for its answer is told.
    pub(super) fn depart(&self) {
        if let Some(d) = &self.departure {
            d.stamp();
        }
    }

    /// Adds a header to what goes upstream (a condition on a kept response's validators).
    pub fn add_header(&mut self, name: http::HeaderName, value: http::HeaderValue) {
        self.parts.headers.insert(name, value);
    }

    /// Its method, URI and headers, as they go upstream.
    pub fn head(&self) -> &Parts {
        &self.parts
    }

    /// Whether it has a body to send.
    pub fn has_body(&self) -> bool {
        self.body.is_some() || self.metered.as_ref().is_some_and(|m| m.body.is_some())
    }

    /// The request, sent for the client at `client` (unless a proxy user sends it).
    pub fn with_client(mut self, client: Option<std::net::IpAddr>) -> Self {
        if let (Sender::Unknown, Some(ip)) = (&self.sender, client) {
            self.sender = Sender::Address(ip);
        }
        self
    }

    /// The client's address, where no proxy user sends the request.
    pub(super) fn client(&self) -> Option<std::net::IpAddr> {
        match self.sender {
            Sender::Address(ip) => Some(ip),
            _ => None,
        }
    }

    /// The request, its body cut once it keeps the upstream waiting as `stall` says.
    pub fn with_stall(mut self, stall: &Arc<Stall>) -> Self {
        if self.body.is_some() {
            self.stall = Some(stall.clone());
        }
        self
    }

    /// The request, sent on behalf of proxy user `user`.
    pub fn with_user(mut self, user: Option<Arc<str>>) -> Self {
        if let Some(user) = user {
            self.sender = Sender::User(user);
        }
        self
    }

    /// The proxy user the request is sent for.
    pub fn user(&self) -> Option<&str> {
        match &self.sender {
            Sender::User(user) => Some(user),
            _ => None,
        }
    }

    /// The request's headers, as they go upstream.
    pub(super) fn headers(&self) -> &http::HeaderMap {
        &self.parts.headers
    }

    /// Reads the body whole, up to `max` bytes, before the request waits for its slot (a
    /// meter estimates the request's cost from it); it is then the caller's to give back
    /// ([`Outgoing::metered`]). Nothing of the body is lost: a body past `max` is refused
    /// whole.
    pub(super) async fn read_body(&mut self, max: usize) -> Result<Bytes, BodyError> {
        let Some(body) = self.body.take() else {
            return Ok(Bytes::new());
        };
        match http_body_util::Limited::new(body, max).collect().await {
            Ok(collected) => Ok(collected.to_bytes()),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                Err(BodyError::TooLarge { max })
            }
            Err(e) => Err(BodyError::Failed(e.to_string())),
        }
    }

    /// The request, metered by `meters`: `body`, where it was read, is what it sends (as
    /// read, or rewritten), its `Content-Length` set to it.
    pub(super) fn metered(&mut self, body: Option<Bytes>, meters: Metering) {
        if let Some(body) = &body {
            self.parts.headers.insert(
                http::header::CONTENT_LENGTH,
                http::HeaderValue::from(body.len()),
            );
        }
        self.metered = Some(Box::new(Metered { body, meters }));
    }

    /// The body as read before the slot, where it was (see [`Outgoing::read_body`]).
    pub(super) fn body_read(&self) -> Option<&[u8]> {
        self.metered.as_deref().and_then(|m| m.body.as_deref())
    }

    /// A metered request's meters, to read.
    pub(super) fn metering(&self) -> Option<&Metering> {
        self.metered.as_deref().map(|m| &m.meters)
    }

    /// A metered request's meters.
    pub(super) fn meters(&mut self) -> Option<&mut Metering> {
        self.metered.as_deref_mut().map(|m| &mut m.meters)
    }

    /// A metered request's meters, taken for its response to settle.
    pub(super) fn take_meters(&mut self) -> Option<Metering> {
        self.metered.take().map(|m| m.meters)
    }

    /// Removes a header before the request goes upstream (one a meter reads and the vendor
    /// must not see, or a condition a collapsed fetch asked before and does not again).
    pub fn remove_header(&mut self, name: &http::HeaderName) {
        self.parts.headers.remove(name);
    }

    /// The request as it is, sent once: for a request that is not paced. Its parts are
    /// moved, not copied.
    pub fn into_request(self) -> Request<ProxyBody> {
        if let Some(body) = self.metered.and_then(|m| m.body) {
            return Request::from_parts(self.parts, full(body));
        }
        let body = match (self.body, &self.stall) {
            (Some(body), Some(stall)) => stall.bound(body),
            (Some(body), None) => body.map_err(BoxError::from).boxed(),
            (None, _) => Empty::new().map_err(|never| match never {}).boxed(),
        };
        Request::from_parts(self.parts, body)
    }

    /// The upstream URI.
    pub(super) fn uri(&self) -> &http::Uri {
        &self.parts.uri
    }

    /// The method.
    pub(super) fn method(&self) -> &http::Method {
        &self.parts.method
    }

    /// A body-less request for one attempt (see [`Outgoing::attempt_parts`]).
    pub(super) fn attempt(&mut self) -> Request<ProxyBody> {
        let body = Empty::new().map_err(|never| match never {}).boxed();
        Request::from_parts(self.attempt_parts(), body)
    }

    /// The request for one attempt, with the original body lent to it: until the upstream
    /// connection reads from it, it can be taken back ([`Outgoing::take_back`]).
    pub(super) fn lend(&mut self) -> Request<ProxyBody> {
        let mut req = self.attempt();
        if let Some(body) = self.metered.as_ref().and_then(|m| m.body.as_ref()) {
            *req.body_mut() = full(body.clone());
            return req;
        }
        if let Some(body) = self.body.take() {
            let cell = Arc::new(Mutex::new(Some(body)));
            self.lent = Some(cell.clone());
            let lent = Lent { cell, body: None };
            *req.body_mut() = match &self.stall {
                Some(stall) => stall.bound(lent),
                None => lent.boxed(),
            };
        }
        req
    }

    /// The parts an attempt sends: the request's own, while a copy of them stays for the
    /// next attempt. hyper parses the response into the header map of the request it has
    /// written, and hands that map on to the client connection, which parses the next
    /// request into it: the request's own map has room for a response already, where a copy
    /// would be made for each request, with room or grown, and freed on another thread.
    fn attempt_parts(&mut self) -> Parts {
        let (mut kept, ()) = Request::new(()).into_parts();
        kept.method = self.parts.method.clone();
        kept.uri = self.parts.uri.clone();
        kept.version = self.parts.version;
        // A clone, not a map filled again: no name is hashed and placed anew.
        kept.headers = self.parts.headers.clone();
        std::mem::replace(&mut self.parts, kept)
    }

    /// Takes back the body lent to an attempt that never reached a connection. False when
    /// the attempt began to send it: the request cannot be sent again.
    pub(super) fn take_back(&mut self) -> bool {
        if let Some(cell) = self.lent.take() {
            self.body = cell.lock().take();
            return self.body.is_some();
        }
        true
    }

    /// GET, HEAD and OPTIONS with no body may be sent again after a throttle.
    pub(super) fn retryable(&self) -> bool {
        matches!(
            self.parts.method,
            Method::GET | Method::HEAD | Method::OPTIONS
        ) && self.body.as_ref().is_none_or(|b| b.is_end_stream())
    }

    /// The request line kept with a lockout: no query string, which may carry secrets.
    pub(super) fn request_line(&self) -> String {
        let uri = &self.parts.uri;
        let scheme = uri.scheme_str().unwrap_or("http");
        let authority = uri.authority().map_or("", |a| a.as_str());
        format!("{} {scheme}://{authority}{}", self.parts.method, uri.path())
    }
}

/// A metered request's body and meters (see [`Outgoing::metered`]).
struct Metered {
    /// The body as read, where a meter read it.
    body: Option<Bytes>,
    meters: Metering,
}

/// Why a request body could not be read before its slot.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// It is larger than the destination's `max_body`.
    #[error("the request body is larger than {max} bytes, the most this destination reads to estimate a request's cost (max_body)")]
    TooLarge {
        /// The destination's `max_body`.
        max: usize,
    },
    /// The client's body failed while it was read.
    #[error("the request body could not be read: {0}")]
    Failed(String),
}

/// A body sent from memory.
fn full(bytes: Bytes) -> ProxyBody {
    http_body_util::Full::new(bytes)
        .map_err(|never| match never {})
        .boxed()
}

/// Who sends a request: its proxy user, else its client's address. One field, not two: a
/// request's future holds it.
enum Sender {
    User(Arc<str>),
    Address(std::net::IpAddr),
    Unknown,
}

/// A request body lent to one attempt at sending ([`Outgoing::lend`]). It stays in the
/// shared cell until the upstream connection first asks for a frame, so an attempt given up
/// before it had a connection leaves the body whole for the next.
struct Lent {
    cell: Arc<Mutex<Option<Incoming>>>,
    body: Option<Incoming>,
}

impl http_body::Body for Lent {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.body.is_none() {
            this.body = this.cell.lock().take();
        }
        match &mut this.body {
            Some(body) => std::pin::Pin::new(body).poll_frame(cx).map_err(Into::into),
            None => std::task::Poll::Ready(Some(Err("the request body was taken back".into()))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.body {
            Some(body) => body.is_end_stream(),
            None => self.cell.lock().as_ref().is_none_or(|b| b.is_end_stream()),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match &self.body {
            Some(body) => body.size_hint(),
            None => self
                .cell
                .lock()
                .as_ref()
                .map_or_else(http_body::SizeHint::default, |b| b.size_hint()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    #[test]
    fn an_attempt_sends_the_request_s_own_map_and_a_copy_of_every_value_stays() {
        let (mut parts, ()) = Request::builder()
            .method("GET")
            .uri("http://localhost:1/a")
            .header("x-a", "1")
            .header("accept", "text/plain")
            .header("x-a", "2")
            .body(())
            .unwrap()
            .into_parts();
        // As a client connection's map comes: with the room the last response needed.
        parts.headers.reserve(24);
        let room = parts.headers.capacity();
        let mut outgoing = Outgoing {
            parts,
            body: None,
            lent: None,
            metered: None,
            sender: Sender::Unknown,
            stall: None,
            departure: None,
        };
        let pairs = |h: &HeaderMap| -> Vec<(String, String)> {
            h.iter()
                .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
                .collect()
        };
        let before = pairs(outgoing.headers());
        let first = outgoing.attempt();
        // The request's own map went, room and all; what stays holds every value in order.
        assert_eq!(first.headers().capacity(), room);
        assert_eq!(pairs(first.headers()), before);
        assert_eq!(pairs(outgoing.headers()), before);
        assert_eq!(
            outgoing.headers().get_all("x-a").iter().collect::<Vec<_>>(),
            ["1", "2"]
        );
        assert_eq!(first.method(), Method::GET);
        assert_eq!(first.uri(), "http://localhost:1/a");
        // A second attempt (after a throttle) sends the same request again.
        let second = outgoing.attempt();
        assert_eq!(pairs(second.headers()), before);
        assert_eq!(second.method(), Method::GET);
        assert_eq!(second.uri(), "http://localhost:1/a");
        assert_eq!(outgoing.uri(), "http://localhost:1/a");
    }
}
