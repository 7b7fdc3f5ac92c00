//! The demo's upstream: a local vendor that allows `limit` requests in each 1 s window (fixed
//! windows from its start), records every arrival, and answers like a real API. Within the
//! limit, 200 with the `x-ratelimit-*` family (Discord's form: `limit`, `remaining`,
//! `reset-after` in fractional seconds). Past it, 429 with `Retry-After` and a remaining of 0.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The request header the load generator tags each request with: which instance it went
/// through (pacegate forwards it like any other header).
pub(super) const INSTANCE_HEADER: &str = "x-demo-instance";

/// One request that reached the vendor.
#[derive(Debug, Clone, Copy)]
pub(super) struct Arrival {
    /// Since the vendor started.
    pub(super) at: Duration,
    /// The instance it went through (0-based).
    pub(super) instance: usize,
    /// What the vendor answered.
    pub(super) status: u16,
}

#[derive(Default)]
struct Tally {
    arrivals: Vec<Arrival>,
    window: u64,
    used: u32,
}

/// A running vendor; it stops when dropped.
pub(super) struct Vendor {
    /// Where it listens.
    pub(super) addr: SocketAddr,
    tally: Arc<Mutex<Tally>>,
    stop: CancellationToken,
}

impl Vendor {
    /// Starts a vendor allowing `limit` requests per 1 s window.
    pub(super) async fn start(limit: u32) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let tally = Arc::new(Mutex::new(Tally::default()));
        let stop = CancellationToken::new();
        let started = Instant::now();
        let (shared, stopped) = (tally.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    () = stopped.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                };
                let tally = shared.clone();
                let service = service_fn(move |req| {
                    let answer = answer(&tally, started, limit, &req);
                    async move { Ok::<_, Infallible>(answer) }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service);
                let stopped = stopped.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        _ = connection => {}
                        () = stopped.cancelled() => {}
                    }
                });
            }
        });
        Ok(Self { addr, tally, stop })
    }

    /// Every arrival so far, in order.
    pub(super) fn arrivals(&self) -> Vec<Arrival> {
        self.tally.lock().arrivals.clone()
    }
}

impl Drop for Vendor {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn answer(
    tally: &Mutex<Tally>,
    started: Instant,
    limit: u32,
    req: &Request<hyper::body::Incoming>,
) -> Response<Full<Bytes>> {
    let at = started.elapsed();
    let instance = req
        .headers()
        .get(INSTANCE_HEADER)
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(0);
    let window = at.as_secs();
    let reset_after = 1.0 - f64::from(at.subsec_nanos()) / 1e9;
    let mut tally = tally.lock();
    if tally.window != window {
        tally.window = window;
        tally.used = 0;
    }
    tally.used += 1;
    let allowed = tally.used <= limit;
    let status = if allowed {
        StatusCode::OK
    } else {
        StatusCode::TOO_MANY_REQUESTS
    };
    tally.arrivals.push(Arrival {
        at,
        instance,
        status: status.as_u16(),
    });
    let remaining = limit.saturating_sub(tally.used);
    drop(tally);
    let mut response = Response::builder()
        .status(status)
        .header("x-ratelimit-limit", limit)
        .header("x-ratelimit-remaining", remaining)
        .header("x-ratelimit-reset-after", format!("{reset_after:.3}"));
    if !allowed {
        response = response.header(http::header::RETRY_AFTER, 1);
    }
    let body = if allowed { "ok\n" } else { "slow down\n" };
    response
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap_or_default()
}
