//! The demo's load: requests at a fixed rate through each instance (open loop: a request
//! starts on the beat whether or not earlier ones have been answered, as independent workers'
//! requests do), on keep-alive connections, each tagged with the instance it goes through.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::vendor::INSTANCE_HEADER;

/// What the clients got back, over every instance.
#[derive(Debug, Default)]
pub(super) struct Outcomes {
    /// Requests started.
    pub(super) sent: AtomicU64,
    /// Answered 2xx.
    pub(super) ok: AtomicU64,
    /// Answered 429 by the vendor (pacegate passes a throttle on once its retries are spent).
    pub(super) throttled: AtomicU64,
    /// Answered 503 by pacegate: no slot within `max_wait`.
    pub(super) refused: AtomicU64,
    /// Anything else, or no answer.
    pub(super) failed: AtomicU64,
}

impl Outcomes {
    fn count(&self, status: Option<u16>) {
        let counter = match status {
            Some(200..=299) => &self.ok,
            Some(429) => &self.throttled,
            Some(503) => &self.refused,
            _ => &self.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

type Connection = SendRequest<Empty<Bytes>>;

/// Idle keep-alive connections to one instance's proxy listener.
struct Pool {
    proxy: SocketAddr,
    idle: Mutex<Vec<Connection>>,
}

impl Pool {
    async fn take(&self) -> Option<Connection> {
        let idle = self.idle.lock().pop();
        if let Some(c) = idle.filter(|c| !c.is_closed()) {
            return Some(c);
        }
        let stream = tokio::net::TcpStream::connect(self.proxy).await.ok()?;
        stream.set_nodelay(true).ok()?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .ok()?;
        tokio::spawn(connection);
        Some(sender)
    }

    fn give_back(&self, c: Connection) {
        if !c.is_closed() {
            self.idle.lock().push(c);
        }
    }
}

/// Sends `per_second` requests a second to `target` through each of `proxies` until `stop`,
/// then waits for the answers still due (each is bounded by the instances' `max_wait`).
pub(super) async fn drive(
    proxies: &[SocketAddr],
    target: &str,
    per_second: f64,
    outcomes: Arc<Outcomes>,
    stop: CancellationToken,
) {
    let mut tasks = JoinSet::new();
    for (instance, proxy) in proxies.iter().enumerate() {
        let pool = Arc::new(Pool {
            proxy: *proxy,
            idle: Mutex::new(Vec::new()),
        });
        let (target, outcomes, stop) = (target.to_owned(), outcomes.clone(), stop.clone());
        tasks.spawn(async move {
            let mut beat = tokio::time::interval(Duration::from_secs_f64(1.0 / per_second));
            beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut requests = JoinSet::new();
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = beat.tick() => {}
                }
                outcomes.sent.fetch_add(1, Ordering::Relaxed);
                let (pool, target, outcomes) = (pool.clone(), target.clone(), outcomes.clone());
                requests.spawn(async move {
                    let status = send(&pool, &target, instance).await;
                    outcomes.count(status);
                });
            }
            while requests.join_next().await.is_some() {}
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// One GET through the pool's proxy: the status, or none if it failed.
async fn send(pool: &Pool, target: &str, instance: usize) -> Option<u16> {
    let mut connection = pool.take().await?;
    // An absolute URI: hyper writes it as given, which is the request line a forward proxy
    // expects.
    let authority = target
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default();
    let request = http::Request::get(target)
        .header(http::header::HOST, authority)
        .header(INSTANCE_HEADER, instance)
        .body(Empty::new())
        .ok()?;
    let response = connection.send_request(request).await.ok()?;
    let status = response.status().as_u16();
    response.into_body().collect().await.ok()?;
    pool.give_back(connection);
    Some(status)
}
