//! The floor under pacegate's cost per request: a forward proxy for plain http built from the
//! same hyper server, hyper-util pooled client and tokio runtime, doing nothing else (no
//! routing, address policy, pacing, verdicts, metrics or request log). What pacegate spends
//! above this is its own; what this spends above nginx is the stack's.
//!
//!     cargo run --release --example hyper_floor -- 127.0.0.1:3129
//!
//! Used by `benches/peers.sh` (loopback only). Not a proxy to use: it forwards to any host.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

type Body = BoxBody<Bytes, hyper::Error>;

#[tokio::main]
async fn main() {
    let listen = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3129".into());
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .expect("cannot bind");
    serve(listener).await;
}

/// Forwards every request arriving on `listener` (`benches/allocations.rs` runs it
/// in-process).
pub(crate) async fn serve(listener: tokio::net::TcpListener) {
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
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
