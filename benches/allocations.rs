//! Heap allocations per request: the same 1 KiB GET over plain http on a kept-alive
//! connection, sent direct to the upstream, through the floor (`examples/hyper_floor.rs`: the
//! hyper server, hyper-util client and tokio runtime pacegate is built on, doing nothing
//! else) and through pacegate as shipped (a destination at `rate = 1000000`, the request log
//! on). Everything runs in this process under a counting allocator, so each figure holds the
//! client's and the upstream's allocations too; they are the same in every case, and the
//! differences are the proxy's: floor − direct is the stack's, pacegate − floor pacegate's own.
//!
//! Run: `cargo bench --bench allocations 2>/dev/null` (the request log goes to stderr).
//! Figures are recorded in docs/benchmarks.md.

#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "measures real time, across processes and threads of its own; clippy.toml's rules are the library's"
)]

#[path = "../tests/support/mod.rs"]
mod support;

#[allow(dead_code)]
#[path = "../examples/hyper_floor.rs"]
mod floor;

use std::alloc::System;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::rt::TokioIo;
use stats_alloc::{StatsAlloc, INSTRUMENTED_SYSTEM};
use support::{FakeUpstream, TestProxy};

/// The system allocator, counting what it is asked for.
#[global_allocator]
static COUNTING: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const WARM: usize = 500;
const MEASURED: usize = 5000;

/// Sends `n` GETs of `uri` one after another on one kept-alive connection to `to`.
async fn send(to: std::net::SocketAddr, uri: &str, host: &str, n: usize) {
    let stream = tokio::net::TcpStream::connect(to).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    for _ in 0..n {
        let req = Request::get(uri)
            .header("host", host)
            .body(Empty::<Bytes>::new())
            .unwrap();
        sender.ready().await.unwrap();
        let resp = sender.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body.len(), 1024);
    }
}

/// Allocations and bytes asked for per request, over [`MEASURED`] requests after [`WARM`]
/// (under `cargo test`, which only sees that the bench runs, a hundredth of each).
async fn per_request(to: std::net::SocketAddr, uri: &str, host: &str, full: bool) -> (f64, f64) {
    let (warm, measured) = match full {
        true => (WARM, MEASURED),
        false => (WARM / 100, MEASURED / 100),
    };
    send(to, uri, host, warm).await;
    let before = COUNTING.stats();
    send(to, uri, host, measured).await;
    let after = COUNTING.stats();
    let n = measured as f64;
    let asked = |s: &stats_alloc::Stats| s.allocations + s.reallocations;
    (
        (asked(&after) - asked(&before)) as f64 / n,
        (after.bytes_allocated - before.bytes_allocated) as f64 / n,
    )
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let _ = rustls::crypto::ring::default_provider().install_default();
    // The request log as shipped: text, at info, to stderr through the buffered writer.
    let _log = pacegate::cli::init_tracing(pacegate::config::LogFormat::Text, "info");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let upstream = FakeUpstream::start().await;
        let proxy = TestProxy::start(
            &upstream.ca.cert_path,
            "",
            "[destinations.local]\nhosts = [\"localhost\"]\nrate = 1000000\n",
        )
        .await;
        let floor_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let floor_at = floor_listener.local_addr().unwrap();
        tokio::spawn(floor::serve(floor_listener, false));

        let host = format!("localhost:{}", upstream.http.port());
        let absolute = format!("http://{host}/bytes/1024");
        let proxy_at = proxy.addr;
        println!("allocations and bytes asked for per request (client and upstream included)");
        for round in 1..=(if full { 3 } else { 1 }) {
            let direct = per_request(upstream.http, "/bytes/1024", &host, full).await;
            let floor = per_request(floor_at, &absolute, &host, full).await;
            let pacegate = per_request(proxy_at, &absolute, &host, full).await;
            println!(
                "round {round}: direct {:.1} ({:.0} B), floor {:.1} ({:.0} B), pacegate {:.1} ({:.0} B); the stack's own {:.1}, pacegate's own {:.1}",
                direct.0,
                direct.1,
                floor.0,
                floor.1,
                pacegate.0,
                pacegate.1,
                floor.0 - direct.0,
                pacegate.0 - floor.0
            );
        }
        drop(proxy);
        drop(upstream);
    });
}
