//! A request as an exchange holds it: kept as parts, so that a body-less request can be sent
//! again after a throttle, and with its body lent to each attempt, so that one given up before
//! it reached a connection leaves the body whole for the next.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Method, Request};
use http_body::Body as _;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use parking_lot::Mutex;

use crate::upstream::{BoxError, ProxyBody};

/// The names a request's copy has room for: as many as most responses carry.
const RESPONSE_ROOM: usize = 16;

/// A request ready for the upstream client, kept as parts so that a body-less request can be
/// sent again.
pub struct Outgoing {
    parts: Parts,
    body: Option<Incoming>,
    /// The body lent to the attempt under way ([`Outgoing::lend`]).
    lent: Option<Arc<Mutex<Option<Incoming>>>>,
    /// The proxy user the client authenticated as, if any: a key (`key = "proxy-user"`).
    user: Option<Arc<str>>,
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
            user: None,
        }
    }

    /// The request, sent on behalf of proxy user `user`.
    pub fn with_user(mut self, user: Option<Arc<str>>) -> Self {
        self.user = user;
        self
    }

    /// The proxy user the request is sent for.
    pub(super) fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// The request's headers, as they go upstream.
    pub(super) fn headers(&self) -> &http::HeaderMap {
        &self.parts.headers
    }

    /// The request as it is, sent once: for a request that is not paced. Its parts are
    /// moved, not copied.
    pub fn into_request(self) -> Request<ProxyBody> {
        let body = match self.body {
            Some(body) => body.map_err(BoxError::from).boxed(),
            None => Empty::new().map_err(|never| match never {}).boxed(),
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

    /// Another copy of a body-less request.
    pub(super) fn copy(&self) -> Request<ProxyBody> {
        let mut req = Request::new(Empty::new().map_err(|never| match never {}).boxed());
        *req.method_mut() = self.parts.method.clone();
        *req.uri_mut() = self.parts.uri.clone();
        *req.version_mut() = self.parts.version;
        // hyper parses the response into the map of the request it has written: made with
        // room for a response's names, it is not grown there (an exact copy was, a few times
        // a response, and what it reallocates was often allocated on another thread, whose
        // allocator arena it then locks).
        let mut headers = HeaderMap::with_capacity(self.parts.headers.len().max(RESPONSE_ROOM));
        headers.extend(
            self.parts
                .headers
                .iter()
                .map(|(name, value)| (name.clone(), value.clone())),
        );
        *req.headers_mut() = headers;
        req
    }

    /// The request, with the original body lent to it: until the upstream connection reads
    /// from it, it can be taken back ([`Outgoing::take_back`]).
    pub(super) fn lend(&mut self) -> Request<ProxyBody> {
        let mut req = self.copy();
        if let Some(body) = self.body.take() {
            let cell = Arc::new(Mutex::new(Some(body)));
            self.lent = Some(cell.clone());
            *req.body_mut() = Lent { cell, body: None }.boxed();
        }
        req
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

    #[test]
    fn a_copy_holds_every_value_in_order_with_room_for_a_response() {
        let (parts, ()) = Request::builder()
            .method("GET")
            .uri("http://localhost:1/a")
            .header("x-a", "1")
            .header("accept", "text/plain")
            .header("x-a", "2")
            .body(())
            .unwrap()
            .into_parts();
        let outgoing = Outgoing {
            parts,
            body: None,
            lent: None,
            user: None,
        };
        let copy = outgoing.copy();
        let pairs = |h: &HeaderMap| -> Vec<(String, String)> {
            h.iter()
                .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
                .collect()
        };
        assert_eq!(pairs(copy.headers()), pairs(outgoing.headers()));
        assert_eq!(
            copy.headers().get_all("x-a").iter().collect::<Vec<_>>(),
            ["1", "2"]
        );
        assert!(copy.headers().capacity() >= RESPONSE_ROOM);
        assert_eq!(copy.method(), Method::GET);
        assert_eq!(copy.uri(), "http://localhost:1/a");
    }
}
