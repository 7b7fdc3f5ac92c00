//! The floor (`examples/hyper_floor.rs`) with hyper-util's pooled client replaced by the least
//! a pool can be: hyper's HTTP/1 client connections, kept in one list and handed back when a
//! response's body has been read. What the pooled client costs a request is what this saves
//! against the floor (`docs/benchmarks.md`, "Eleventh pass"): the yardstick for a pool of
//! pacegate's own.
//!
//!     cargo run --release --example own_pool_floor -- 127.0.0.1:3129
//!
//! `CONTROL=target/release/examples/own_pool_floor benches/alternate.sh BINARY` measures it
//! beside the floor. Not a proxy to use: it forwards to any host, keeps one list for every
//! upstream, speaks HTTP/1 upstream only and never closes an idle connection. Loopback only.

#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "measures real time, across processes and threads of its own; clippy.toml's rules are the library's"
)]

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::SendRequest;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;

type Body = BoxBody<Bytes, hyper::Error>;
type Idle = Arc<Mutex<Vec<SendRequest<Body>>>>;

#[tokio::main]
async fn main() {
    let listen = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3129".into());
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .expect("cannot bind");
    let idle: Idle = Arc::default();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let idle = idle.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let idle = idle.clone();
                async move { Ok::<_, Infallible>(forward(req, idle).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Sends `req` on an idle connection, or a new one to its authority, in origin form.
async fn forward(req: Request<Incoming>, idle: Idle) -> Response<Body> {
    let popped = idle.lock().pop();
    let sender = match popped {
        Some(sender) => Some(sender),
        None => connect(req.uri().authority().map_or("", |a| a.as_str())).await,
    };
    let Some(mut sender) = sender else {
        return bad_gateway();
    };
    // A connection handed back as its last body ended may not have taken up the next
    // request yet.
    if sender.ready().await.is_err() {
        return bad_gateway();
    }
    let (mut parts, body) = req.into_parts();
    parts.uri = match parts.uri.path_and_query() {
        Some(p) => p.as_str().parse().unwrap_or_default(),
        None => "/".parse().unwrap_or_default(),
    };
    match sender
        .send_request(Request::from_parts(parts, body.boxed()))
        .await
    {
        Ok(response) => response.map(|inner| {
            HandsBack {
                inner,
                sender: Some(sender),
                idle,
            }
            .boxed()
        }),
        Err(_) => bad_gateway(),
    }
}

async fn connect(authority: &str) -> Option<SendRequest<Body>> {
    let stream = tokio::net::TcpStream::connect(authority).await.ok()?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::spawn(conn);
    Some(sender)
}

fn bad_gateway() -> Response<Body> {
    let mut r = Response::new(http_body_util::Empty::new().map_err(|n| match n {}).boxed());
    *r.status_mut() = StatusCode::BAD_GATEWAY;
    r
}

/// A response body that hands its connection back to the idle list once read to its end.
struct HandsBack {
    inner: Incoming,
    sender: Option<SendRequest<Body>>,
    idle: Idle,
}

impl HandsBack {
    fn hand_back(&mut self) {
        if let Some(sender) = self.sender.take() {
            self.idle.lock().push(sender);
        }
    }
}

impl HttpBody for HandsBack {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.hand_back();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for HandsBack {
    fn drop(&mut self) {
        // A body dropped before its end leaves its connection mid-response: not reused.
        if self.inner.is_end_stream() {
            self.hand_back();
        }
    }
}
