//! Forwarding scenarios: each runs through pacegate and direct, and the client must not be able
//! to tell the difference.

use crate::support;

use std::time::Duration;

use support::{client, Alpn, FakeUpstream, Seen, TestProxy};

fn destinations(upstream: &FakeUpstream) -> String {
    let _ = upstream;
    "[destinations.local]\nhosts = [\"localhost\"]\nrate = 100000\n# Forwarding scenarios: no verdicts, so every status passes through untouched.\nthrottle_statuses = []\nlockout_statuses = []\n".to_owned()
}

async fn proxy_for(upstream: &FakeUpstream) -> TestProxy {
    TestProxy::start(&upstream.ca.cert_path, "", &destinations(upstream)).await
}

#[tokio::test]
async fn http_forward_looks_like_direct() {
    let upstream = FakeUpstream::start().await;
    let proxy = proxy_for(&upstream).await;
    let via = client(Some(&proxy.url()), &[], Alpn::Http1);
    let direct = client(None, &[], Alpn::Http1);
    for path in ["/", "/status/201?h=X-Custom:yes", "/bytes/1000"] {
        let url = format!("{}{path}", upstream.http_url("localhost"));
        let proxied = Seen::of(via.get(&url).send().await.unwrap()).await;
        let plain = Seen::of(direct.get(&url).send().await.unwrap()).await;
        assert_eq!(proxied, plain, "{path}");
    }
    let seen = upstream.recorded();
    assert_eq!(seen.len(), 6);
    assert!(seen.iter().all(|r| !r.tls));
    assert_eq!(
        proxy
            .metric(
                "pacegate_requests_total{destination=\"local\",group=\"\",outcome=\"forwarded\"}"
            )
            .await,
        3.0
    );
    assert_eq!(
        proxy
            .metric("pacegate_upstream_responses_total{destination=\"local\",group=\"\",status=\"201\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn https_is_intercepted_over_http1_and_h2() {
    let upstream = FakeUpstream::start().await;
    let proxy = proxy_for(&upstream).await;
    let url = format!(
        "{}/status/200?h=X-Upstream:1",
        upstream.https_url("localhost")
    );
    for alpn in [Alpn::Http1, Alpn::H2] {
        upstream.clear();
        let via = client(Some(&proxy.url()), &[&proxy.ca_path()], alpn);
        let direct = client(None, &[&upstream.ca.cert_path], alpn);
        let resp = via.get(&url).send().await.unwrap();
        let expected_version = if alpn == Alpn::H2 {
            http::Version::HTTP_2
        } else {
            http::Version::HTTP_11
        };
        assert_eq!(
            resp.version(),
            expected_version,
            "client side of the intercepted session"
        );
        let proxied = Seen::of(resp).await;
        let plain = Seen::of(direct.get(&url).send().await.unwrap()).await;
        assert_eq!(proxied, plain, "{alpn:?}");
        let seen = upstream.recorded();
        assert!(seen[0].tls, "pacegate reached the upstream over TLS");
        // The upstream offers h2, so pacegate uses it whatever the client spoke.
        assert_eq!(seen[0].version, http::Version::HTTP_2);
    }
    // The client trusted only pacegate's CA, so the session was intercepted, not tunnelled.
    assert!(
        proxy
            .metric("pacegate_tunnels_total{kind=\"intercept\"}")
            .await
            >= 2.0
    );
    assert_eq!(
        proxy
            .metric("pacegate_cert_cache_total{result=\"miss\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn requests_share_the_upstreams_h2_connection_and_reuse_its_http1_ones() {
    let upstream = FakeUpstream::start().await;
    let proxy = proxy_for(&upstream).await;
    // Each request on a connection of its own to pacegate (over https, an intercepted
    // session each): what they share is pacegate's doing.
    let fresh = || client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let get = |url: String| {
        let via = fresh();
        async move { via.get(&url).send().await.unwrap().status() }
    };
    // Over TLS the upstream offers h2: one connection, then eight requests at once on it.
    let slow = format!("{}/sleep/100", upstream.https_url("localhost"));
    assert_eq!(get(slow.clone()).await, 200);
    let at_once = futures_util::future::join_all((0..8).map(|_| get(slow.clone()))).await;
    assert!(at_once.iter().all(|s| *s == 200), "{at_once:?}");
    assert_eq!(upstream.connections(), 1, "one h2 connection for all");
    // Plain http speaks HTTP/1.1: requests in turn take the connection the last one used.
    for _ in 0..4 {
        assert_eq!(get(upstream.http_url("localhost")).await, 200);
    }
    assert_eq!(upstream.connections(), 2, "one more, used in turn");
}

/// hyper-util's pool holds a connecting lock for an h2 upstream; pacegate's must too: a burst
/// to an upstream never seen must not open a connection per request (or per request opened
/// ahead) before it learns the upstream multiplexes one. Paced, the requests wait for the
/// first connection opened ahead; in shadow mode they are sent at once, each asking the pool.
#[tokio::test]
async fn sixteen_requests_at_once_to_a_cold_h2_upstream_open_one_connection() {
    for mode in ["", "mode = \"shadow\""] {
        let upstream = FakeUpstream::start().await;
        let proxy = TestProxy::start(
            &upstream.ca.cert_path,
            "",
            &format!("[destinations.local]\nhosts = [\"localhost\"]\nrate = 100000\n{mode}\n"),
        )
        .await;
        let slow = format!("{}/sleep/100", upstream.https_url("localhost"));
        let at_once = futures_util::future::join_all((0..16).map(|_| {
            let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
            let url = slow.clone();
            async move { via.get(&url).send().await.unwrap().status() }
        }))
        .await;
        assert!(at_once.iter().all(|s| *s == 200), "{mode}: {at_once:?}");
        assert_eq!(
            upstream.connections(),
            1,
            "{mode}: one h2 connection from cold"
        );
    }
}

#[tokio::test]
async fn h2_client_reaches_an_http1_only_upstream() {
    let upstream = FakeUpstream::start_with(false).await;
    let proxy = proxy_for(&upstream).await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::H2);
    let resp = via
        .get(format!("{}/", upstream.https_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    assert_eq!(upstream.recorded()[0].version, http::Version::HTTP_11);
}

#[tokio::test]
async fn statuses_and_retry_after_reach_the_client_unchanged() {
    let upstream = FakeUpstream::start().await;
    let proxy = proxy_for(&upstream).await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let direct = client(None, &[&upstream.ca.cert_path], Alpn::Http1);
    for (code, retry_after) in [
        (200, None),
        (403, None),
        (429, Some("7")),
        (503, Some("Wed,%2021%20Oct%202015%2007:28:00%20GMT")),
    ] {
        let mut path = format!("/status/{code}");
        if let Some(ra) = retry_after {
            path.push_str(&format!("?h=Retry-After:{ra}"));
        }
        for base in [
            upstream.http_url("localhost"),
            upstream.https_url("localhost"),
        ] {
            let url = format!("{base}{path}");
            let proxied = Seen::of(via.get(&url).send().await.unwrap()).await;
            let plain = Seen::of(direct.get(&url).send().await.unwrap()).await;
            assert_eq!(proxied.status, code);
            assert_eq!(
                proxied.header("retry-after"),
                retry_after.map(|r| r.replace("%20", " ")).as_deref()
            );
            assert_eq!(
                proxied.header("proxy-status"),
                None,
                "upstream answers are not pacegate's"
            );
            assert_eq!(proxied, plain, "{url}");
        }
    }
}

#[tokio::test]
async fn hop_by_hop_headers_are_removed_both_ways() {
    let upstream = FakeUpstream::start().await;
    let proxy = proxy_for(&upstream).await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    for base in [
        upstream.http_url("localhost"),
        upstream.https_url("localhost"),
    ] {
        upstream.clear();
        let url = format!("{base}/status/200?h=Connection:x-reply-secret&h=X-Reply-Secret:1&h=Keep-Alive:timeout=9&h=X-Reply-Kept:1&h=Proxy-Authenticate:Basic");
        let resp = via
            .get(&url)
            .header("Connection", "x-request-secret")
            .header("X-Request-Secret", "1")
            .header("Keep-Alive", "timeout=5")
            .header("Proxy-Connection", "keep-alive")
            .header("TE", "gzip")
            .header("X-Request-Kept", "1")
            .send()
            .await
            .unwrap();
        let recorded = upstream.recorded().pop().unwrap();
        let got = recorded.headers;
        for gone in [
            "x-request-secret",
            "keep-alive",
            "proxy-connection",
            "te",
            "proxy-authorization",
        ] {
            assert!(
                !got.contains_key(gone),
                "{gone} reached the upstream via {base}"
            );
        }
        assert_eq!(got["x-request-kept"], "1");
        assert_eq!(
            recorded.authority,
            format!(
                "localhost:{}",
                url.split(':').nth(2).unwrap().split('/').next().unwrap()
            )
        );
        for gone in ["x-reply-secret", "keep-alive", "proxy-authenticate"] {
            assert!(
                !resp.headers().contains_key(gone),
                "{gone} reached the client via {base}"
            );
        }
        assert_eq!(resp.headers()["x-reply-kept"], "1");
    }
}

#[tokio::test]
async fn inner_host_header_cannot_redirect_an_intercepted_session() {
    let upstream = FakeUpstream::start().await;
    let proxy = proxy_for(&upstream).await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let resp = via
        .get(format!("{}/", upstream.https_url("localhost")))
        .header("Host", "elsewhere.example:1")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        upstream.recorded()[0].authority,
        format!("localhost:{}", upstream.https.port())
    );
}

#[tokio::test]
async fn a_host_header_other_than_the_target_is_replaced_and_the_target_s_own_is_sent() {
    let upstream = FakeUpstream::start().await;
    let proxy = proxy_for(&upstream).await;
    let via = client(Some(&proxy.url()), &[], Alpn::Http1);
    let routed = format!("localhost:{}", upstream.http.port());
    for (given, why) in [
        ("elsewhere.example:1", "another host"),
        ("LOCALHOST", "another spelling, without the port"),
        (routed.as_str(), "the target itself, kept as it is"),
    ] {
        let resp = via
            .get(format!("{}/", upstream.http_url("localhost")))
            .header("Host", given)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{why}");
        let seen = upstream.recorded().pop().unwrap();
        assert_eq!(seen.authority, routed, "{why}");
    }
}

#[tokio::test]
async fn blind_tunnel_passes_the_upstream_certificate_through() {
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::start(
        &upstream.ca.cert_path,
        "unmatched = \"tunnel\"",
        &destinations(&upstream),
    )
    .await;
    // 127.0.0.1 matches no destination; the client trusts only the upstream's own CA, so the
    // request succeeds only if pacegate does not intercept.
    let via = client(Some(&proxy.url()), &[&upstream.ca.cert_path], Alpn::H2);
    let url = format!(
        "{}/status/200?h=X-Upstream:1",
        upstream.https_url("127.0.0.1")
    );
    let proxied = Seen::of(via.get(&url).send().await.unwrap()).await;
    let direct = client(None, &[&upstream.ca.cert_path], Alpn::H2);
    assert_eq!(
        proxied,
        Seen::of(direct.get(&url).send().await.unwrap()).await
    );
    assert_eq!(
        proxy.metric("pacegate_tunnels_total{kind=\"blind\"}").await,
        1.0
    );
    assert_eq!(
        proxy
            .metric("pacegate_requests_total{destination=\"unmatched\",group=\"\",outcome=\"tunneled\"}")
            .await,
        1.0
    );
    // Unmatched http:// is forwarded unpaced.
    let resp = via
        .get(format!("{}/", upstream.http_url("127.0.0.1")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn large_bodies_stream_both_ways() {
    const SIZE: u64 = 32 * 1024 * 1024;
    let upstream = FakeUpstream::start().await;
    let proxy = proxy_for(&upstream).await;
    for alpn in [Alpn::Http1, Alpn::H2] {
        let via = client(Some(&proxy.url()), &[&proxy.ca_path()], alpn);
        for base in [
            upstream.http_url("localhost"),
            upstream.https_url("localhost"),
        ] {
            // Download: the upstream sends its first chunk and waits; the client must get that
            // chunk before the rest exists, which fails if pacegate buffers the whole body.
            let mut resp = via
                .get(format!("{base}/gated/{SIZE}"))
                .send()
                .await
                .unwrap();
            let first = tokio::time::timeout(Duration::from_secs(10), resp.chunk())
                .await
                .expect("first chunk arrives before the body is complete")
                .unwrap()
                .unwrap();
            upstream.release();
            let mut total = first.len() as u64;
            let mut ok = first
                .iter()
                .enumerate()
                .all(|(i, b)| *b == support::upstream::pattern(i as u64));
            while let Some(chunk) = resp.chunk().await.unwrap() {
                ok &= chunk
                    .iter()
                    .enumerate()
                    .all(|(i, b)| *b == support::upstream::pattern(total + i as u64));
                total += chunk.len() as u64;
            }
            assert_eq!(total, SIZE);
            assert!(ok, "body content intact");

            // Upload: the client sends one chunk, and sends the rest only once the upstream
            // has received it.
            upstream.clear();
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(2);
            let body = reqwest::Body::wrap_stream(futures_util::stream::poll_fn({
                let mut rx = rx;
                move |cx| rx.poll_recv(cx)
            }));
            // The echo comes back while the upload goes on, so read it concurrently.
            let request = via.post(format!("{base}/echo")).body(body).send();
            let echo = tokio::spawn(async move {
                let mut resp = request.await.unwrap();
                let mut n = 0u64;
                while let Some(chunk) = resp.chunk().await.unwrap() {
                    n += chunk.len() as u64;
                }
                n
            });
            let chunk = bytes::Bytes::from(vec![7u8; 1024 * 1024]);
            tx.send(Ok(chunk.clone())).await.unwrap();
            support::eventually(
                Duration::from_secs(10),
                "the first upload chunk at the upstream",
                || async { (upstream.received_bytes() >= 1024 * 1024).then_some(()) },
            )
            .await;
            for _ in 1..32 {
                tx.send(Ok(chunk.clone())).await.unwrap();
            }
            drop(tx);
            assert_eq!(echo.await.unwrap(), 32 * 1024 * 1024);
            assert_eq!(upstream.received_bytes(), 32 * 1024 * 1024);
        }
    }
}
