//! The floor under pacegate's cost per request: a forward proxy for plain http built from the
//! same hyper server, hyper-util pooled client and tokio runtime, doing nothing else (no
//! routing, address policy, pacing, verdicts, metrics or request log). What pacegate spends
//! above this is its own; what this spends above nginx is the stack's.
//!
//!     cargo run --release --example hyper_floor -- 127.0.0.1:3129 [served]
//!
//! `served` serves client connections with the settings pacegate serves them with
//! (hyper-util's builder for HTTP/1 and h2 on one listener, hyper's header-read timer): what
//! those settings cost, told apart from what pacegate does. The floor the benches measure
//! against is without them.
//!
//! Used by `benches/peers.sh` (loopback only). Not a proxy to use: it forwards to any host.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;

type Body = BoxBody<Bytes, hyper::Error>;

#[tokio::main]
async fn main() {
    let listen = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3129".into());
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .expect("cannot bind");
    let served = std::env::args().nth(2).as_deref() == Some("served");
    serve(listener, served).await;
}

/// Forwards every request arriving on `listener`, its client connections served as pacegate
/// serves them where `served` (`benches/allocations.rs` runs it in-process, without).
pub(crate) async fn serve(listener: tokio::net::TcpListener, served: bool) {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    // As pacegate keeps them: up to 256 idle upstream connections per host.
    let client: Client<_, Body> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build(connector);
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let client = client.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let client = client.clone();
                async move {
                    let (parts, body) = req.into_parts();
                    let answer = match client
                        .request(Request::from_parts(parts, body.boxed()))
                        .await
                    {
                        Ok(response) => response.map(BodyExt::boxed),
                        Err(_) => {
                            let mut r = Response::new(
                                http_body_util::Empty::new().map_err(|n| match n {}).boxed(),
                            );
                            *r.status_mut() = StatusCode::BAD_GATEWAY;
                            r
                        }
                    };
                    Ok::<_, Infallible>(answer)
                }
            });
            if served {
                let mut builder = auto::Builder::new(TokioExecutor::new());
                builder
                    .http1()
                    .timer(TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(10))
                    .keep_alive(true);
                let _ = builder
                    .serve_connection_with_upgrades(TokioIo::new(stream), service)
                    .await;
            } else {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            }
        });
    }
}
