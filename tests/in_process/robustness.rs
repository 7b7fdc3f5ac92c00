//! Hostile and broken clients: each gets a clear answer or a closed connection within the
//! configured limits, and pacegate keeps serving everyone else.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls_pki_types::ServerName;
use support::config::{Dest, Setup};
use support::{
    admin_client, client, raw_exchange, read_head, read_until_close, Alpn, FakeUpstream, TestProxy,
};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// A forwarding proxy for localhost and 127.0.0.1, its `[proxy.limits]` to be added.
fn local(upstream: &FakeUpstream) -> Setup {
    TestProxy::with(upstream).destination(Dest::forwarding(&["localhost", "127.0.0.1"]))
}

async fn still_serves(proxy: &TestProxy, upstream: &FakeUpstream) {
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let resp = via
        .get(format!("{}/", upstream.https_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "pacegate still serves other clients");
}

#[tokio::test]
async fn garbage_gets_a_400_and_the_connection_closed() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream).start().await;
    let answer = raw_exchange(
        proxy.addr,
        b"\x16\x03\x01garbage\x00\xff\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer:?}");
    still_serves(&proxy, &upstream).await;
}

#[tokio::test]
async fn a_stalled_client_is_disconnected_after_the_header_timeout() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream)
        .limit("header_read_timeout", "300ms")
        .start()
        .await;
    let started = Instant::now();
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(b"GET http://localhost/ HTTP/1.1\r\nHost: loc")
        .await
        .unwrap();
    let rest = read_until_close(&mut stream, Duration::from_secs(10)).await;
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(250),
        "closed too early: {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(5),
        "the stalled connection was held for {waited:?}"
    );
    assert!(!rest.contains("200"), "{rest}");
    // Counted as a head that did not come, not as an idle connection.
    let head = "pacegate_connections_expired_total{reason=\"head\"}";
    support::eventually(Duration::from_secs(5), "the head counted", || async {
        (proxy.metric(head).await == 1.0).then_some(())
    })
    .await;
    still_serves(&proxy, &upstream).await;
}

#[tokio::test]
async fn an_oversized_header_is_refused() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream)
        .limit("max_header_bytes", 8192)
        .start()
        .await;
    let big = "a".repeat(20_000);
    let req = format!(
        "GET http://localhost:{}/ HTTP/1.1\r\nHost: localhost\r\nX-Big: {big}\r\n\r\n",
        upstream.http.port()
    );
    let answer = raw_exchange(proxy.addr, req.as_bytes(), Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:.200}");
    assert!(upstream.recorded().is_empty());
    still_serves(&proxy, &upstream).await;
}

#[tokio::test]
async fn failed_tls_handshakes_are_counted_and_harmless() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream)
        .limit("handshake_timeout", "500ms")
        .start()
        .await;
    // Bytes that are neither a ClientHello nor HTTP: the tunnel's HTTP server answers 400.
    // (Plain HTTP in a tunnel is served: clients that tunnel http:// send it.)
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let connect = format!(
        "CONNECT localhost:{} HTTP/1.1\r\n\r\n",
        upstream.https.port()
    );
    stream.write_all(connect.as_bytes()).await.unwrap();
    assert!(read_head(&mut stream).await.starts_with("HTTP/1.1 200"));
    stream
        .write_all(b"\x00\x01 not a request\r\n\r\n")
        .await
        .unwrap();
    let answer = read_until_close(&mut stream, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    // A client that does not trust pacegate's CA.
    let untrusting = client(Some(&proxy.url()), &[&upstream.ca.cert_path], Alpn::Http1);
    assert!(untrusting
        .get(format!("{}/", upstream.https_url("localhost")))
        .send()
        .await
        .is_err());
    // A client that never starts the handshake.
    let mut silent = TcpStream::connect(proxy.addr).await.unwrap();
    silent.write_all(connect.as_bytes()).await.unwrap();
    assert!(read_head(&mut silent).await.starts_with("HTTP/1.1 200"));
    let held = Instant::now();
    read_until_close(&mut silent, Duration::from_secs(10)).await;
    assert!(
        held.elapsed() < Duration::from_secs(5),
        "the silent session was held {:?}",
        held.elapsed()
    );
    support::eventually(
        Duration::from_secs(5),
        "two handshake failures counted: the untrusting client's and the silent one's",
        || async {
            (proxy.metric("pacegate_tls_handshake_failures_total").await == 2.0).then_some(())
        },
    )
    .await;
    assert!(upstream.recorded().is_empty());
    still_serves(&proxy, &upstream).await;
}

#[tokio::test]
async fn the_leaf_is_for_the_connect_host_whatever_the_sni() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream).start().await;
    let tls = Arc::new(support::client_tls(&[&proxy.ca_path()], Alpn::Http1));
    for (sni, ok) in [("localhost", true), ("evil.example", false)] {
        let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
        let connect = format!(
            "CONNECT localhost:{} HTTP/1.1\r\n\r\n",
            upstream.https.port()
        );
        stream.write_all(connect.as_bytes()).await.unwrap();
        assert!(read_head(&mut stream).await.starts_with("HTTP/1.1 200"));
        let name = ServerName::try_from(sni.to_owned()).unwrap();
        let result = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, stream)
            .await;
        assert_eq!(result.is_ok(), ok, "SNI {sni}: {:?}", result.err());
    }
}

#[tokio::test]
async fn connections_beyond_the_limit_get_a_503() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream).limit("max_connections", 2).start().await;
    let held_a = TcpStream::connect(proxy.addr).await.unwrap();
    let held_b = TcpStream::connect(proxy.addr).await.unwrap();
    support::eventually(Duration::from_secs(5), "two connections open", || async {
        (proxy.metric("pacegate_connections_open").await == 2.0).then_some(())
    })
    .await;
    let answer = raw_exchange(
        proxy.addr,
        b"GET http://localhost/ HTTP/1.1\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("proxy-status: pacegate; error=connection_limit_reached"),
        "{answer}"
    );
    assert!(answer.contains("max_connections"), "{answer}");
    drop((held_a, held_b));
    support::eventually(Duration::from_secs(5), "a slot to free up", || async {
        let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
        let resp = via
            .get(format!("{}/", upstream.http_url("localhost")))
            .send()
            .await
            .ok()?;
        (resp.status() == 200).then_some(())
    })
    .await;
    assert_eq!(
        proxy.metric("pacegate_connections_rejected_total").await,
        1.0
    );
}

async fn expect_continue(addr: std::net::SocketAddr, target: &str) -> (String, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {target} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let interim = read_head(&mut stream).await;
    stream.write_all(b"hello").await.unwrap();
    let rest = read_until_close(&mut stream, Duration::from_secs(5)).await;
    (interim, rest)
}

#[tokio::test]
async fn expect_100_continue_works_like_direct() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream).start().await;
    // `/status/201` reads the whole body before answering.
    let target = format!("{}/status/201", upstream.http_url("localhost"));
    let (interim, rest) = expect_continue(proxy.addr, &target).await;
    assert_eq!(upstream.received_bytes(), 5);
    let (direct_interim, direct_rest) = expect_continue(upstream.http, "/status/201").await;
    assert_eq!(upstream.received_bytes(), 10);
    assert!(interim.starts_with("HTTP/1.1 100 Continue"), "{interim}");
    assert!(
        direct_interim.starts_with("HTTP/1.1 100 Continue"),
        "{direct_interim}"
    );
    assert!(rest.starts_with("HTTP/1.1 201"), "{rest}");
    assert!(direct_rest.starts_with("HTTP/1.1 201"), "{direct_rest}");
}

#[tokio::test]
async fn admin_endpoints_answer() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream).start().await;
    let admin = reqwest::Client::builder().no_proxy().build().unwrap();
    for (path, status) in [
        ("/healthz", 200),
        ("/readyz", 200),
        ("/metrics", 200),
        ("/nope", 404),
    ] {
        let resp = admin
            .get(format!("http://{}{path}", proxy.admin))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), status, "{path}");
    }
    let metrics = proxy.metrics().await;
    for family in [
        "pacegate_connections_open",
        "pacegate_connections_total",
        "pacegate_cert_cache_entries",
        "pacegate_request_duration_seconds_bucket{destination=\"local\",group=\"\"",
    ] {
        assert!(metrics.contains(family), "{family} missing from /metrics");
    }
}

#[tokio::test]
async fn malformed_admin_paths_get_404_and_the_admin_listener_keeps_answering() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream).start().await;
    let admin = admin_client();
    for path in [
        "/destinations/unlock",
        "/destinations//unlock",
        "/destinations/a/b/unlock",
        "/destinations/",
    ] {
        let resp = admin
            .post(format!("http://{}{path}", proxy.admin))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 404, "{path}");
    }
    let health = admin
        .get(format!("http://{}/healthz", proxy.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200, "still answering");
}
