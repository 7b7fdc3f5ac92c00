//! Refusals: everything pacegate answers itself says why, with `Proxy-Status`, and nothing
//! reaches an upstream it should not.

use crate::support;

use std::time::Duration;

use base64::Engine;
use support::config::{Dest, Setup};
use support::{client, client_with, raw_exchange, read_head, Alpn, FakeUpstream, TestProxy};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// A forwarding proxy for localhost.
fn local(upstream: &FakeUpstream) -> Setup {
    TestProxy::with(upstream).destination(Dest::forwarding(&["localhost"]))
}

fn proxy_status(resp: &reqwest::Response) -> String {
    resp.headers()
        .get("proxy-status")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

#[tokio::test]
async fn unconfigured_hosts_are_denied_by_default() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream).start().await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let resp = via
        .get(format!("{}/", upstream.http_url("127.0.0.1")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    let ps = proxy_status(&resp);
    assert!(
        ps.starts_with("pacegate; error=http_request_denied"),
        "{ps}"
    );
    assert!(ps.contains("matches no configured destination"), "{ps}");
    let connect = format!(
        "CONNECT 127.0.0.1:{0} HTTP/1.1\r\nHost: 127.0.0.1:{0}\r\n\r\n",
        upstream.https.port()
    );
    let answer = raw_exchange(proxy.addr, connect.as_bytes(), Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(
        answer
            .to_lowercase()
            .contains("proxy-status: pacegate; error=http_request_denied"),
        "{answer}"
    );
    assert!(
        upstream.recorded().is_empty(),
        "nothing may reach an unconfigured upstream"
    );
    assert_eq!(
        proxy
            .metric(
                "pacegate_requests_total{destination=\"unmatched\",group=\"\",outcome=\"denied\"}"
            )
            .await,
        2.0
    );
}

#[tokio::test]
async fn private_upstreams_are_refused_by_resolved_address() {
    let upstream = FakeUpstream::start().await;
    let dest = Dest::forwarding(&["localhost", "127.0.0.1"]);
    let proxy = TestProxy::with(&upstream)
        .proxy("allow_private_upstreams", false)
        .destination(dest.clone())
        .start()
        .await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    // An IP literal, a name that resolves to loopback, and the same through interception.
    for url in [
        upstream.http_url("127.0.0.1"),
        upstream.http_url("localhost"),
        upstream.https_url("localhost"),
    ] {
        let resp = via.get(format!("{url}/")).send().await.unwrap();
        assert_eq!(resp.status(), 403, "{url}");
        let ps = proxy_status(&resp);
        assert!(
            ps.starts_with("pacegate; error=destination_ip_prohibited"),
            "{ps}"
        );
        assert!(
            ps.contains("allow_private_upstreams"),
            "the refusal says how to allow it: {ps}"
        );
    }
    assert!(upstream.recorded().is_empty());
    // Unmatched tunnels obey the same policy, before answering the CONNECT.
    let tunnel = TestProxy::with(&upstream)
        .proxy("allow_private_upstreams", false)
        .proxy("unmatched", "tunnel")
        .destination(dest)
        .start()
        .await;
    let connect = format!(
        "CONNECT [::1]:{0} HTTP/1.1\r\nHost: [::1]:{0}\r\n\r\n",
        upstream.https.port()
    );
    let answer = raw_exchange(tunnel.addr, connect.as_bytes(), Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(answer.contains("destination_ip_prohibited"), "{answer}");
    // IPv6 forms that carry a private IPv4 address, and reserved IPv4 ranges: refused before
    // anything is dialled (else an unroutable address would be a 502).
    for host in [
        "[::127.0.0.1]",
        "[64:ff9b::7f00:1]",
        "[2002:7f00:1::1]",
        "[2001:0:4136:e378:8000:63bf:80ff:fffe]",
        "198.18.0.1",
        "240.0.0.1",
        "100.64.0.1",
    ] {
        let connect = format!("CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n");
        let answer = raw_exchange(tunnel.addr, connect.as_bytes(), Duration::from_secs(5)).await;
        assert!(answer.starts_with("HTTP/1.1 403"), "{host}: {answer}");
        assert!(
            answer.contains("destination_ip_prohibited"),
            "{host}: {answer}"
        );
    }
}

#[tokio::test]
async fn proxy_authentication() {
    std::env::set_var("PACEGATE_TEST_AUTH_PW", "correct horse");
    let upstream = FakeUpstream::start().await;
    let auth =
        "[proxy.auth]\nusers = [{ name = \"worker\", password_env = \"PACEGATE_TEST_AUTH_PW\" }]";
    let proxy = local(&upstream).section(auth).start().await;
    let http_url = format!("{}/headers", upstream.http_url("localhost"));
    let https_url = format!("{}/headers", upstream.https_url("localhost"));

    let anonymous = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let resp = anonymous.get(&http_url).send().await.unwrap();
    assert_eq!(resp.status(), 407);
    assert_eq!(
        resp.headers()["proxy-authenticate"],
        "Basic realm=\"pacegate\""
    );
    assert!(proxy_status(&resp).contains("error=http_request_denied"));
    assert!(
        anonymous.get(&https_url).send().await.is_err(),
        "CONNECT without credentials fails"
    );

    for (password, ok) in [("wrong", false), ("correct horse", true)] {
        let c = client_with(None, &[&proxy.ca_path()], Alpn::Http1, |b| {
            b.proxy(
                reqwest::Proxy::all(proxy.url())
                    .unwrap()
                    .basic_auth("worker", password),
            )
        });
        let http = c.get(&http_url).send().await.unwrap();
        assert_eq!(http.status() == 200, ok, "http with {password}");
        let https = c.get(&https_url).send().await;
        assert_eq!(
            https.is_ok_and(|r| r.status() == 200),
            ok,
            "https with {password}"
        );
    }
    // The credentials are pacegate's, never the upstream's.
    let seen = upstream.recorded();
    assert_eq!(seen.len(), 2);
    assert!(seen
        .iter()
        .all(|r| !r.headers.contains_key("proxy-authorization")));
    let connect = format!(
        "CONNECT localhost:{0} HTTP/1.1\r\nProxy-Authorization: Basic {1}\r\n\r\n",
        upstream.https.port(),
        base64::engine::general_purpose::STANDARD.encode("worker:nope")
    );
    let answer = raw_exchange(proxy.addr, connect.as_bytes(), Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 407"), "{answer}");
}

#[tokio::test]
async fn unreachable_upstream_is_a_502() {
    let upstream = FakeUpstream::start().await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let proxy = local(&upstream).start().await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    for url in [
        format!("http://localhost:{port}/"),
        format!("https://localhost:{port}/"),
    ] {
        let resp = via.get(&url).send().await.unwrap();
        assert_eq!(resp.status(), 502, "{url}");
        let ps = proxy_status(&resp);
        assert!(ps.starts_with("pacegate; error=connection_refused"), "{ps}");
    }
    assert_eq!(
        proxy
            .metric("pacegate_requests_total{destination=\"local\",group=\"\",outcome=\"upstream_error\"}")
            .await,
        2.0
    );
}

#[tokio::test]
async fn slow_upstream_is_a_504() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream)
        .section("[upstream]\nresponse_timeout = \"300ms\"")
        .start()
        .await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    for base in [
        upstream.http_url("localhost"),
        upstream.https_url("localhost"),
    ] {
        let resp = via.get(format!("{base}/sleep/3000")).send().await.unwrap();
        assert_eq!(resp.status(), 504);
        assert!(proxy_status(&resp).starts_with("pacegate; error=http_response_timeout"));
    }
}

#[tokio::test]
async fn upgrade_requests_get_a_clear_refusal() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream).start().await;
    let req = format!(
        "GET http://localhost:{0}/ws HTTP/1.1\r\nHost: localhost:{0}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        upstream.http.port()
    );
    let started = std::time::Instant::now();
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stream, req.as_bytes())
        .await
        .unwrap();
    let head = support::read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 501"), "{head}");
    assert!(head.contains("error=http_upgrade_failed"), "{head}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused promptly, no hang"
    );
    assert!(upstream.recorded().is_empty());
}

#[tokio::test]
async fn malformed_targets_are_bad_requests() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream).start().await;
    for (request, why) in [
        ("GET / HTTP/1.1\r\nHost: x\r\n\r\n", "forward proxy"),
        (
            "CONNECT exa..mple.com:443 HTTP/1.1\r\n\r\n",
            "not a valid host",
        ),
        ("CONNECT localhost HTTP/1.1\r\n\r\n", "no port"),
        ("CONNECT localhost:0 HTTP/1.1\r\n\r\n", "port 0"),
        (
            "CONNECT localhost:65536 HTTP/1.1\r\n\r\n",
            "port 65536 is not a port",
        ),
        (
            "GET http://localhost:65536/ HTTP/1.1\r\nHost: localhost\r\n\r\n",
            "port 65536 is not a port",
        ),
        (
            "GET http://[::1]:99999/ HTTP/1.1\r\nHost: localhost\r\n\r\n",
            "port 99999 is not a port",
        ),
        (
            "GET https://localhost/ HTTP/1.1\r\nHost: localhost\r\n\r\n",
            "through CONNECT",
        ),
    ] {
        let answer = raw_exchange(proxy.addr, request.as_bytes(), Duration::from_secs(2)).await;
        assert!(
            answer.starts_with("HTTP/1.1 400"),
            "{request:?} -> {answer}"
        );
        assert!(
            answer.contains("proxy-status: pacegate; error=http_request_error"),
            "{answer}"
        );
        assert!(answer.contains(why), "{request:?} -> {answer}");
    }
    assert!(upstream.recorded().is_empty());
}

#[tokio::test]
async fn a_paced_host_is_not_a_way_to_its_other_low_ports() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream).start().await;
    // CONNECT to a configured host's SSH port: refused before anything is dialled.
    let connect = b"CONNECT localhost:22 HTTP/1.1\r\nHost: localhost:22\r\n\r\n";
    let answer = raw_exchange(proxy.addr, connect, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    let lower = answer.to_lowercase();
    assert!(lower.contains("error=http_request_denied"), "{answer}");
    assert!(lower.contains("port 22 is not allowed"), "{answer}");
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let resp = via.get("http://localhost:25/").send().await.unwrap();
    assert_eq!(resp.status(), 403);
    assert!(
        proxy_status(&resp).contains("`ports`"),
        "says how to allow it"
    );
    // The upstream's own (high) ports still work.
    let ok = via
        .get(format!("{}/", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);

    // Listed in `ports`, a low port is allowed: the request goes on (and fails to connect,
    // as nothing listens there), rather than being refused by the port rule.
    let proxy = TestProxy::with(&upstream)
        .destination(Dest::forwarding(&["localhost"]).key("ports", vec![25]))
        .start()
        .await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let resp = via.get("http://localhost:25/").send().await.unwrap();
    assert_ne!(resp.status(), 403, "{}", proxy_status(&resp));
}

#[tokio::test]
async fn a_client_outside_the_allowed_networks_is_refused_and_counted() {
    let upstream = FakeUpstream::start().await;
    let elsewhere = local(&upstream)
        .proxy("clients", vec!["10.0.0.0/8", "fd00::/8"])
        .start()
        .await;
    let request = format!(
        "GET {}/ HTTP/1.1\r\nHost: localhost\r\n\r\n",
        upstream.http_url("localhost")
    );
    let answer = raw_exchange(elsewhere.addr, request.as_bytes(), Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("proxy-status: pacegate; error=http_request_denied")
            && answer.contains("[proxy] clients"),
        "{answer}"
    );
    assert_eq!(
        elsewhere.metric("pacegate_clients_refused_total").await,
        1.0
    );
    assert!(
        upstream.recorded().is_empty(),
        "nothing of it went upstream"
    );
    // Loopback listed (as a single address): served.
    let here = local(&upstream)
        .proxy("clients", vec!["127.0.0.1"])
        .start()
        .await;
    let answer = raw_exchange(here.addr, request.as_bytes(), Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(here.metric("pacegate_clients_refused_total").await, 0.0);
}

/// A proxy without the test config's blanket `[proxy] ports`: squid's rule alone.
fn squid_ports(upstream: &FakeUpstream) -> Setup {
    TestProxy::with(upstream).proxy("ports", Vec::<String>::new())
}

#[tokio::test]
async fn ports_are_the_schemes_defaults_and_those_listed_high_ones_included() {
    let upstream = FakeUpstream::start().await;
    let (http, https) = (upstream.http.port(), upstream.https.port());
    let proxy = squid_ports(&upstream)
        .proxy("unmatched", "tunnel")
        .destination(Dest::forwarding(&["localhost"]))
        .start()
        .await;
    // A destination's host on a high port it does not list: refused, CONNECT and http alike.
    let connect = format!("CONNECT localhost:{https} HTTP/1.1\r\nHost: localhost:{https}\r\n\r\n");
    let answer = raw_exchange(proxy.addr, connect.as_bytes(), Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(
        answer.contains(&format!("port {https} is not allowed")),
        "{answer}"
    );
    let get = format!("GET http://localhost:{http}/ HTTP/1.1\r\nHost: localhost\r\n\r\n");
    let answer = raw_exchange(proxy.addr, get.as_bytes(), Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    // Unmatched traffic, the same: only 443 (and 80) for CONNECT, 80 for http.
    let tunnel = format!("CONNECT 127.0.0.1:{https} HTTP/1.1\r\nHost: 127.0.0.1:{https}\r\n\r\n");
    let answer = raw_exchange(proxy.addr, tunnel.as_bytes(), Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(answer.contains("[proxy] ports"), "{answer}");
    assert!(upstream.recorded().is_empty());
    // Listed, by number on the destination or as a range in [proxy]: allowed.
    let listed = TestProxy::with(&upstream)
        .proxy("unmatched", "tunnel")
        .proxy("ports", vec![format!("{}-{}", https, https)])
        .destination(Dest::forwarding(&["localhost"]).key("ports", vec![i64::from(http)]))
        .start()
        .await;
    let answer = raw_exchange(listed.addr, get.as_bytes(), Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let mut stream = TcpStream::connect(listed.addr).await.unwrap();
    stream.write_all(tunnel.as_bytes()).await.unwrap();
    assert!(read_head(&mut stream).await.starts_with("HTTP/1.1 200"));
}

#[tokio::test]
async fn nothing_goes_to_pacegates_own_listeners() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream).proxy("unmatched", "tunnel").start().await;
    // A localhost destination, every high port allowed, loopback allowed: still not the
    // admin listener, nor the proxy itself.
    for (request, port) in [
        (
            format!(
                "GET http://localhost:{0}/config HTTP/1.1\r\nHost: localhost:{0}\r\n\r\n",
                proxy.admin.port()
            ),
            proxy.admin.port(),
        ),
        (
            format!(
                "CONNECT 127.0.0.1:{0} HTTP/1.1\r\nHost: 127.0.0.1:{0}\r\n\r\n",
                proxy.addr.port()
            ),
            proxy.addr.port(),
        ),
        (
            format!(
                "GET http://[::ffff:127.0.0.1]:{0}/ HTTP/1.1\r\nHost: x\r\n\r\n",
                proxy.admin.port()
            ),
            proxy.admin.port(),
        ),
        (
            format!(
                "CONNECT 0.0.0.0:{0} HTTP/1.1\r\nHost: 0.0.0.0:{0}\r\n\r\nPOST /reload HTTP/1.1\r\nHost: 127.0.0.1:{0}\r\nContent-Length: 0\r\n\r\n",
                proxy.admin.port()
            ),
            proxy.admin.port(),
        ),
    ]
    .into_iter()
    // The unspecified address reaches the local host too, in every form.
    .chain(["0.0.0.0", "0", "[::ffff:0.0.0.0]", "[::]"].map(|host| {
        let port = proxy.admin.port();
        let request =
            format!("GET http://{host}:{port}/config HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n");
        (request, port)
    }))
    {
        let answer = raw_exchange(proxy.addr, request.as_bytes(), Duration::from_secs(5)).await;
        assert!(answer.starts_with("HTTP/1.1 403"), "{request}: {answer}");
        assert!(
            answer.contains("destination_ip_prohibited") && answer.contains("own listeners"),
            "{request}: {answer}"
        );
        assert!(
            !answer.contains("[destinations") && !answer.contains("\"result\""),
            "port {port}: the admin answered: {answer}"
        );
    }
    // Through interception the CONNECT is answered, and its inner request refused.
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let inner = via
        .get(format!("https://localhost:{}/config", proxy.admin.port()))
        .send()
        .await
        .unwrap();
    assert_eq!(inner.status(), 403);
    let ps = proxy_status(&inner);
    assert!(
        ps.contains("destination_ip_prohibited") && ps.contains("own listeners"),
        "{ps}"
    );
}

#[tokio::test]
async fn a_destination_may_allow_private_upstreams_for_itself_alone() {
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::with(&upstream)
        .proxy("allow_private_upstreams", false)
        .destination(
            Dest::new("mine", &["localhost"])
                .rate(1000.0)
                .key("allow_private_upstreams", true),
        )
        .destination(Dest::new("other", &["127.0.0.1"]).rate(1000.0))
        .start()
        .await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let mine = via
        .get(format!("{}/", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(mine.status(), 200);
    let other = via
        .get(format!("{}/", upstream.http_url("127.0.0.1")))
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 403);
    assert!(
        proxy_status(&other).contains("destination_ip_prohibited"),
        "{}",
        proxy_status(&other)
    );
    assert_eq!(upstream.recorded().len(), 1);
}

#[tokio::test]
async fn an_unsolicited_switching_protocols_is_a_bad_gateway_over_http1_and_h2() {
    // An HTTP/1.1-only upstream that answers 101 to a request that asked for no upgrade.
    let upstream = FakeUpstream::start_with(false).await;
    let proxy = local(&upstream).start().await;
    for (alpn, url) in [
        (Alpn::Http1, upstream.http_url("localhost")),
        (Alpn::Http1, upstream.https_url("localhost")),
        (Alpn::H2, upstream.https_url("localhost")),
    ] {
        let via = client(Some(&proxy.url()), &[&proxy.ca_path()], alpn);
        let resp = via
            .get(format!("{url}/status/101?h=Upgrade:x&h=Connection:upgrade"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 502, "{alpn:?} {url}");
        let ps = proxy_status(&resp);
        assert!(
            ps.contains("http_protocol_error") && ps.contains("101"),
            "{ps}"
        );
        // The client's connection is still good: the next request on it is answered.
        let next = via.get(format!("{url}/status/200")).send().await.unwrap();
        assert_eq!(next.status(), 200, "{alpn:?} {url}");
    }
}

#[tokio::test]
async fn a_request_with_two_host_headers_is_a_bad_request_and_goes_nowhere() {
    let upstream = FakeUpstream::start().await;
    let proxy = local(&upstream).start().await;
    let port = upstream.http.port();
    let forward = format!(
        "GET http://localhost:{port}/x HTTP/1.1\r\nHost: localhost:{port}\r\nHost: elsewhere.example\r\n\r\n"
    );
    let answer = raw_exchange(proxy.addr, forward.as_bytes(), Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("more than one Host"), "{answer}");
    // Inside an intercepted session too.
    let tls = std::sync::Arc::new(support::client_tls(&[&proxy.ca_path()], Alpn::Http1));
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let https = upstream.https.port();
    let connect = format!("CONNECT localhost:{https} HTTP/1.1\r\n\r\n");
    stream.write_all(connect.as_bytes()).await.unwrap();
    assert!(read_head(&mut stream).await.starts_with("HTTP/1.1 200"));
    let mut session = tokio_rustls::TlsConnector::from(tls)
        .connect(
            rustls_pki_types::ServerName::try_from("localhost").unwrap(),
            stream,
        )
        .await
        .unwrap();
    let inner = "GET /x HTTP/1.1\r\nHost: localhost\r\nHost: elsewhere.example\r\nConnection: close\r\n\r\n";
    session.write_all(inner.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::AsyncReadExt::read_to_end(&mut session, &mut answer),
    )
    .await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(upstream.recorded().is_empty(), "the upstream saw a request");
}
