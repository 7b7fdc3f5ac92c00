//! Every phase of a connection has a deadline: the first byte, the head, idle time on either
//! protocol (HTTP/2 pings keep nothing open), an HTTP/2 client that stops answering pings, a
//! session inside CONNECT, a response the client does not read, a tunnel after a half-close;
//! and HTTP/2 streams count against the requests in flight.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls_pki_types::ServerName;
use support::config::{Dest, Setup};
use support::{client, read_head, Alpn, FakeUpstream, TestProxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A forwarding proxy for localhost, with short deadlines.
fn quick(upstream: &FakeUpstream) -> Setup {
    TestProxy::with(upstream)
        .destination(Dest::forwarding(&["localhost"]))
        .limit("header_read_timeout", "300ms")
        .limit("idle_timeout", "500ms")
}

async fn served(proxy: &TestProxy, upstream: &FakeUpstream) -> u16 {
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    via.get(format!("{}/", upstream.http_url("localhost")))
        .send()
        .await
        .map_or(0, |r| r.status().as_u16())
}

/// Waits until the peer closes `stream`; how long that took.
async fn closed_after(stream: &mut TcpStream, limit: Duration) -> Duration {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(limit, stream.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return started.elapsed(),
            Ok(Ok(_)) => continue,
            Err(_) => panic!("still open after {limit:?}"),
        }
    }
}

#[tokio::test]
async fn sockets_that_say_nothing_are_closed_and_free_their_slots() {
    let upstream = FakeUpstream::start().await;
    let proxy = quick(&upstream).limit("max_connections", 8).start().await;
    // Six that send nothing, two that send only the HTTP/2 preface: every slot but none.
    let mut silent = Vec::new();
    for _ in 0..6 {
        silent.push(TcpStream::connect(proxy.addr).await.unwrap());
    }
    for _ in 0..2 {
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(H2_PREFACE).await.unwrap();
        silent.push(s);
    }
    for s in &mut silent {
        let held = closed_after(s, Duration::from_secs(10)).await;
        assert!(held < Duration::from_secs(5), "held for {held:?}");
    }
    assert_eq!(
        proxy
            .metric("pacegate_connections_expired_total{reason=\"silent\"}")
            .await,
        6.0
    );
    // The preface is a first byte; with no request after it, the connection is idle.
    assert_eq!(
        proxy
            .metric("pacegate_connections_expired_total{reason=\"idle\"}")
            .await,
        2.0
    );
    support::eventually(Duration::from_secs(5), "every slot back", || async {
        (proxy.metric("pacegate_connections_open").await == 0.0).then_some(())
    })
    .await;
    assert_eq!(served(&proxy, &upstream).await, 200);
}

#[tokio::test]
async fn an_idle_h2_connection_is_closed_and_a_busy_one_is_not() {
    let upstream = FakeUpstream::start().await;
    // Pinged every 100 ms: the client's answers are bytes, but no request.
    let proxy = quick(&upstream)
        .limit("ping_interval", "100ms")
        .limit("ping_timeout", "5s")
        .start()
        .await;
    // Prior-knowledge HTTP/2 to the proxy: reqwest keeps the connection open while idle.
    let via = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(proxy.url()).unwrap())
        .http2_prior_knowledge()
        .build()
        .unwrap();
    // One request that takes longer than the idle timeout is not cut short.
    let slow = via
        .get(format!(
            "{}/status/200?delay=1200",
            upstream.http_url("localhost")
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(slow.status(), 200);
    assert_eq!(
        proxy
            .metric("pacegate_connections_expired_total{reason=\"idle\"}")
            .await,
        0.0
    );
    support::eventually(
        Duration::from_secs(5),
        "the idle connection closed",
        || async {
            (proxy
                .metric("pacegate_connections_expired_total{reason=\"idle\"}")
                .await
                == 1.0)
                .then_some(())
        },
    )
    .await;
}

/// A client-side HTTP/2 frame: its header, then `payload`.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut frame = vec![len[1], len[2], len[3], kind, flags];
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// An HPACK literal (not indexed) of the static table's name `index`, without Huffman coding.
fn hpack_literal(index: u8, value: &str) -> Vec<u8> {
    let mut out = vec![index, u8::try_from(value.len()).unwrap()];
    out.extend_from_slice(value.as_bytes());
    out
}

#[tokio::test]
async fn an_h2_client_that_stops_answering_pings_is_closed_with_its_request() {
    let upstream = FakeUpstream::start().await;
    let proxy = quick(&upstream)
        .limit("ping_interval", "1s")
        .limit("ping_timeout", "1s")
        .start()
        .await;
    // A raw HTTP/2 client: the preface, its settings, and one GET that the upstream holds for
    // 30 s. Then it reads what comes and answers nothing, not even a ping: a client gone.
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let mut headers = vec![0x82, 0x86]; // :method GET, :scheme http
    headers.extend(hpack_literal(4, "/status/200?delay=30000")); // :path
    let authority = upstream.http_url("localhost");
    headers.extend(hpack_literal(1, authority.trim_start_matches("http://"))); // :authority
    let mut hello = H2_PREFACE.to_vec();
    hello.extend(h2_frame(0x4, 0, 0, &[])); // SETTINGS
    hello.extend(h2_frame(0x1, 0x5, 1, &headers)); // HEADERS, END_STREAM | END_HEADERS
    stream.write_all(&hello).await.unwrap();
    support::eventually(Duration::from_secs(5), "the request upstream", || async {
        (!upstream.arrivals().is_empty()).then_some(())
    })
    .await;
    // A ping after 1 s of silence, 1 s to answer it: closed long before the upstream answers.
    let took = closed_after(&mut stream, Duration::from_secs(10)).await;
    assert!(took < Duration::from_secs(8), "closed after {took:?}");
    // Its request went with it: nothing is in flight to the destination any more.
    support::eventually(Duration::from_secs(5), "no request in flight", || async {
        (proxy
            .metric("pacegate_in_flight{destination=\"local\",group=\"\"}")
            .await
            == 0.0)
            .then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_silent_client_inside_an_intercepted_session_is_closed() {
    let upstream = FakeUpstream::start().await;
    let proxy = quick(&upstream).start().await;
    let tls = Arc::new(support::client_tls(&[&proxy.ca_path()], Alpn::Http1));
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let connect = format!(
        "CONNECT localhost:{} HTTP/1.1\r\n\r\n",
        upstream.https.port()
    );
    stream.write_all(connect.as_bytes()).await.unwrap();
    assert!(read_head(&mut stream).await.starts_with("HTTP/1.1 200"));
    let mut session = tokio_rustls::TlsConnector::from(tls)
        .connect(ServerName::try_from("localhost").unwrap(), stream)
        .await
        .expect("the handshake completes");
    // Handshake done, then nothing: the session is closed at the header timeout.
    let started = Instant::now();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(10), session.read(&mut buf)).await;
    assert!(read.is_ok(), "the session was still open after 10 s");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        proxy
            .metric("pacegate_connections_expired_total{reason=\"silent\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn a_client_that_does_not_read_gives_back_its_upstream_and_its_permit() {
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::with(&upstream)
        .destination(
            Dest::forwarding(&["localhost"])
                .key("max_concurrency", 1)
                .key("max_wait", "2s"),
        )
        .limit("write_timeout", "500ms")
        .start()
        .await;
    // 64 MiB asked for and none of it read: far more than the socket buffers take.
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let request = format!(
        "GET {}/bytes/67108864 HTTP/1.1\r\nHost: localhost\r\n\r\n",
        upstream.http_url("localhost")
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    support::eventually(
        Duration::from_secs(10),
        "the stalled write timed out",
        || async {
            (proxy
                .metric("pacegate_connections_expired_total{reason=\"write_timeout\"}")
                .await
                == 1.0)
                .then_some(())
        },
    )
    .await;
    // The only permit is free again: the next request is served, not refused at max_wait.
    assert_eq!(served(&proxy, &upstream).await, 200);
    drop(stream);
}

#[tokio::test]
async fn requests_past_max_requests_get_a_503_whatever_the_protocol() {
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::with(&upstream)
        .destination(Dest::forwarding(&["localhost"]))
        .limit("max_requests", 2)
        .start()
        .await;
    // One HTTP/2 connection, three streams at once, each held a second at the upstream.
    let via = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(proxy.url()).unwrap())
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let url = format!("{}/status/200?delay=1000", upstream.http_url("localhost"));
    let sent = (0..3).map(|_| {
        let via = via.clone();
        let url = url.clone();
        async move { via.get(&url).send().await.unwrap() }
    });
    let answers = futures_util::future::join_all(sent).await;
    let mut statuses: Vec<u16> = answers.iter().map(|r| r.status().as_u16()).collect();
    statuses.sort_unstable();
    assert_eq!(statuses, vec![200, 200, 503]);
    let busy = answers.iter().find(|r| r.status() == 503).unwrap();
    let proxy_status = busy.headers()["proxy-status"].to_str().unwrap();
    assert!(
        proxy_status.contains("error=connection_limit_reached")
            && proxy_status.contains("max_requests"),
        "{proxy_status}"
    );
    assert_eq!(busy.headers()["retry-after"], "1");
    assert_eq!(
        proxy
            .metric(
                "pacegate_requests_total{destination=\"unmatched\",group=\"\",outcome=\"busy\"}"
            )
            .await,
        1.0
    );
    // Permits come back with the responses.
    assert_eq!(served(&proxy, &upstream).await, 200);
}

#[tokio::test]
async fn a_tunnel_ends_at_its_idle_timeout_after_a_half_close() {
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::with(&upstream)
        .proxy("unmatched", "tunnel")
        .limit("tunnel_idle_timeout", "500ms")
        .start()
        .await;
    // An upstream that sends without end and never closes.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let talker = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let chunk = vec![b'x'; 64 * 1024];
        while s.write_all(&chunk).await.is_ok() {}
    });
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    assert!(read_head(&mut stream).await.starts_with("HTTP/1.1 200"));
    support::eventually(Duration::from_secs(5), "the tunnel open", || async {
        (proxy.metric("pacegate_tunnels_open{kind=\"blind\"}").await == 1.0).then_some(())
    })
    .await;
    // The client says all it has to say, then reads nothing: no byte moves either way.
    stream.write_all(b"hello").await.unwrap();
    stream.shutdown().await.unwrap();
    support::eventually(Duration::from_secs(5), "the tunnel closed", || async {
        (proxy.metric("pacegate_tunnels_open{kind=\"blind\"}").await == 0.0).then_some(())
    })
    .await;
    talker.abort();
}

/// A plain-HTTP upstream on localhost that answers `/stall` with a head, ten bytes of the
/// thousand it announces, then nothing for a minute; `/trickle` with a 429 whose 25-byte
/// body comes a byte a second; anything else with a quick 200.
async fn stalling_upstream() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                loop {
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") {
                        if !matches!(s.read(&mut byte).await, Ok(1)) {
                            return;
                        }
                        head.push(byte[0]);
                    }
                    let head = String::from_utf8_lossy(&head).into_owned();
                    if head.contains(" /stall ") {
                        let _ = s
                            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n0123456789")
                            .await;
                        tokio::time::sleep(Duration::from_secs(60)).await;
                        return;
                    }
                    if head.contains(" /trickle ") {
                        let _ = s
                            .write_all(
                                b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 25\r\n\r\n",
                            )
                            .await;
                        for _ in 0..25 {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            if s.write_all(b"x").await.is_err() {
                                return;
                            }
                        }
                        continue;
                    }
                    if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    port
}

#[tokio::test]
async fn a_stalled_upstream_body_is_cut_at_the_body_timeout_and_gives_its_permit_back() {
    let upstream = FakeUpstream::start().await;
    let port = stalling_upstream().await;
    let proxy = TestProxy::with(&upstream)
        .destination(
            Dest::forwarding(&["localhost"])
                .key("max_concurrency", 1)
                .key("max_wait", "3s"),
        )
        .limit("body_timeout", "1s")
        .start()
        .await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let stall =
        format!("GET http://localhost:{port}/stall HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n");
    stream.write_all(stall.as_bytes()).await.unwrap();
    // The head and the ten bytes come, then the stream is cut: closed without its end.
    let took = closed_after(&mut stream, Duration::from_secs(10)).await;
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(4),
        "{took:?}"
    );
    assert_eq!(
        proxy
            .metric("pacegate_bodies_cut_total{reason=\"upstream\"}")
            .await,
        1.0
    );
    // The one permit is back: the next request is served at once.
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let started = Instant::now();
    let next = via
        .get(format!("http://localhost:{port}/next"))
        .send()
        .await
        .unwrap();
    assert_eq!(next.status(), 200);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_client_request_body_that_stalls_is_cut_at_the_body_timeout() {
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::with(&upstream)
        .destination(Dest::forwarding(&["localhost"]))
        .limit("body_timeout", "1s")
        .start()
        .await;
    let port = upstream.http.port();
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let post = format!(
        "POST http://localhost:{port}/upload HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Length: 1000\r\n\r\n0123456789"
    );
    stream.write_all(post.as_bytes()).await.unwrap();
    let started = Instant::now();
    let answer = support::read_until_close(&mut stream, Duration::from_secs(10)).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
    assert_eq!(
        proxy
            .metric("pacegate_bodies_cut_total{reason=\"client\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn a_throttled_body_that_trickles_holds_the_client_a_few_seconds_at_most() {
    let upstream = FakeUpstream::start().await;
    let port = stalling_upstream().await;
    let proxy = TestProxy::with(&upstream)
        .destination(
            Dest::new("local", &["localhost"])
                .rate(1000.0)
                .key("retry_throttled", 3),
        )
        .start()
        .await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let started = Instant::now();
    let resp = via
        .get(format!("http://localhost:{port}/trickle"))
        .send()
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(resp.status(), 502);
    let ps = resp.headers()["proxy-status"].to_str().unwrap().to_owned();
    assert!(ps.contains("did not end within 3s"), "{ps}");
    assert!(took < Duration::from_secs(6), "{took:?}");
}
