//! Pacing through the real proxy, measured where it matters: arrival times at the upstream.

use crate::support;

use std::time::{Duration, Instant};

use support::{admin_client, burst_of, busiest, client, timing, Alpn, FakeUpstream, TestProxy};

/// A destination `local` for localhost with the given pacing keys.
fn local(keys: &str) -> String {
    format!("[destinations.local]\nhosts = [\"localhost\"]\n{keys}\n")
}

async fn start(upstream: &FakeUpstream, keys: &str) -> TestProxy {
    TestProxy::start(&upstream.ca.cert_path, "", &local(keys)).await
}

/// Every scenario here measures arrival times, and the fake upstream shares the machine with
/// what it measures: it dates a request when its head reached the socket, not when its busy
/// task got round to it.
#[test]
fn the_upstream_dates_a_request_when_it_reached_the_socket() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let upstream = FakeUpstream::start().await;
        let mut tcp = tokio::net::TcpStream::connect(upstream.http).await.unwrap();
        for path in ["/first", "/dated"] {
            let head = format!("GET {path} HTTP/1.1\r\nhost: localhost\r\n\r\n");
            tcp.write_all(head.as_bytes()).await.unwrap();
            let sent = Instant::now();
            if path == "/dated" {
                // The upstream's tasks cannot run while this one holds the runtime's thread.
                std::thread::sleep(Duration::from_millis(300));
            }
            // The whole answer (by its Content-Length), so the next starts clean.
            let mut answer = Vec::new();
            let whole = loop {
                let mut chunk = [0u8; 4096];
                let n = tcp.read(&mut chunk).await.unwrap();
                assert!(n > 0, "the upstream closed the connection");
                answer.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&answer).to_lowercase();
                if let Some(end) = text.find("\r\n\r\n") {
                    let length: usize = text
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .map_or(0, |n| n.trim().parse().unwrap());
                    if answer.len() >= end + 4 + length {
                        break text;
                    }
                }
            };
            assert!(whole.starts_with("http/1.1 200"), "{whole}");
            let at = upstream.recorded().last().unwrap().at;
            let after = at.saturating_duration_since(sent);
            assert!(
                after < Duration::from_millis(150),
                "{path} dated {after:?} after it was sent"
            );
        }
    });
}

#[tokio::test]
async fn the_rate_holds_at_the_upstream_for_http_and_https() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 20").await;
    let urls = (0..40)
        .map(|i| {
            if i % 2 == 0 {
                format!("{}/?{i}", upstream.http_url("localhost"))
            } else {
                format!("{}/?{i}", upstream.https_url("localhost"))
            }
        })
        .collect();
    let statuses = burst_of(&proxy, urls).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let at = upstream.arrivals();
    assert_eq!(at.len(), 40);
    let span = *at.last().unwrap() - at[0];
    assert!(
        span >= Duration::from_millis(1900),
        "40 requests at 20/s took only {span:?}"
    );
    let most = busiest(&at, Duration::from_secs(1));
    assert!(
        most <= 21,
        "{most} requests reached the upstream within one second"
    );
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("pacegate_wait_seconds_count{destination=\"local\",group=\"\"} 40"),
        "{metrics}"
    );
    assert!(metrics.contains("pacegate_reservation_seconds_count{store=\"memory\"}"));
}

#[tokio::test]
async fn fractional_rates() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 2.5").await;
    let urls = (0..4)
        .map(|i| format!("{}/?{i}", upstream.http_url("localhost")))
        .collect();
    burst_of(&proxy, urls).await;
    let at = upstream.arrivals();
    for pair in at.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(gap >= Duration::from_millis(380), "gap {gap:?} at 2.5/s");
    }
    let s = proxy.destination("local").await;
    assert_eq!(s["rate"], 2.5);
}

async fn gaps_of_three(proxy: &TestProxy, upstream: &FakeUpstream) -> Vec<Duration> {
    upstream.clear();
    let urls = (0..3)
        .map(|i| format!("{}/?{i}", upstream.http_url("localhost")))
        .collect();
    burst_of(proxy, urls).await;
    upstream
        .arrivals()
        .windows(2)
        .map(|p| p[1] - p[0])
        .collect()
}

#[tokio::test]
async fn a_429_widens_the_spacing_until_the_clean_streak_decays_it() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 10\ndecay_after = 3\nretry_throttled = 0").await;
    let via = client(Some(&proxy.url()), &[], Alpn::Http1);
    let resp = via
        .get(format!("{}/status/429", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    let s = proxy.destination("local").await;
    assert_eq!(
        (s["backoff"].as_f64(), s["effective_rate"].as_f64()),
        (Some(2.0), Some(5.0))
    );
    // Backoff 2 at rate 10: 200 ms apart.
    for gap in gaps_of_three(&proxy, &upstream).await {
        assert!(
            gap >= Duration::from_millis(190),
            "gap {gap:?} while widened"
        );
    }
    // Those three were clean: the backoff has decayed to 1, so 100 ms apart again.
    assert_eq!(proxy.destination("local").await["backoff"], 1.0);
    for gap in gaps_of_three(&proxy, &upstream).await {
        assert!(
            gap >= Duration::from_millis(90) && gap < Duration::from_millis(190),
            "gap {gap:?} after decay"
        );
    }
    let metrics = proxy.metrics().await;
    assert!(metrics.contains(
        "pacegate_verdicts_total{destination=\"local\",group=\"\",reason=\"status\",verdict=\"throttled\"} 1"
    ));
    assert!(metrics.contains(
        "pacegate_verdicts_total{destination=\"local\",group=\"\",reason=\"status\",verdict=\"clean\"} 6"
    ));
    assert!(metrics.contains("pacegate_backoff_multiplier{destination=\"local\",group=\"\"} 1"));
}

#[tokio::test]
async fn ten_concurrent_429s_widen_once() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 100\nburst = 10\nretry_throttled = 0").await;
    // The upstream holds each answer, so all ten are in flight under one generation.
    let urls = (0..10)
        .map(|i| {
            format!(
                "{}/status/429?delay=300&i={i}",
                upstream.http_url("localhost")
            )
        })
        .collect();
    let statuses = burst_of(&proxy, urls).await;
    assert!(statuses.iter().all(|s| *s == 429));
    let s = proxy.destination("local").await;
    assert_eq!(s["backoff"], 2.0, "{s}");
    assert!(proxy
        .metrics()
        .await
        .contains("pacegate_backoff_multiplier{destination=\"local\",group=\"\"} 2"));
}

#[tokio::test]
async fn retry_after_seconds_pauses_every_request() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 100\nretry_throttled = 0").await;
    let via = client(Some(&proxy.url()), &[], Alpn::Http1);
    let resp = via
        .get(format!(
            "{}/status/429?h=Retry-After:2",
            upstream.http_url("localhost")
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.headers()["retry-after"],
        "2",
        "the client sees the upstream's Retry-After"
    );
    let s = proxy.destination("local").await;
    assert!(s["paused_for_seconds"].as_f64().unwrap() > 1.5, "{s}");
    let metrics = proxy.metrics().await;
    assert!(
        !metrics.contains("pacegate_paused_until_seconds{destination=\"local\",group=\"\"} 0\n"),
        "{metrics}"
    );
    // Another request, to another path, waits out the pause.
    let resp = via
        .get(format!("{}/other", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let at = upstream.arrivals();
    assert!(
        at[1] - at[0] >= Duration::from_millis(1950),
        "paused only {:?}",
        at[1] - at[0]
    );
}

#[tokio::test]
async fn retry_after_as_an_http_date_pauses_every_request() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 100\nretry_throttled = 0").await;
    let via = client(Some(&proxy.url()), &[], Alpn::Http1);
    let resp = via
        .get(format!("{}/retry-date/3", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    via.get(format!("{}/other", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    let at = upstream.arrivals();
    // The date is 3 s after the response's Date, which has whole-second precision: the pause
    // from the response is between 2 and 3 s.
    assert!(
        at[1] - at[0] >= Duration::from_millis(1950),
        "paused only {:?}",
        at[1] - at[0]
    );
}

#[tokio::test]
async fn a_403_locks_out_until_an_operator_unlocks_even_across_a_restart() {
    let upstream = FakeUpstream::start().await;
    std::env::set_var("PACEGATE_TEST_ADMIN_TOKEN", "s3cret-token");
    let proxy = TestProxy::start_with(
        &upstream.ca.cert_path,
        "",
        "token_env = \"PACEGATE_TEST_ADMIN_TOKEN\"",
        &local("rate = 100"),
    )
    .await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let locking = format!("{}/status/403?secret=1", upstream.https_url("localhost"));
    let resp = via.get(&locking).send().await.unwrap();
    assert_eq!(resp.status(), 403);
    assert!(
        resp.headers().get("proxy-status").is_none(),
        "the first 403 is the upstream's own"
    );
    let refused = via
        .get(format!("{}/fine", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    let ps = refused.headers()["proxy-status"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        ps.contains("locked out") && ps.contains("pacegate unlock local"),
        "{ps}"
    );
    assert!(!ps.contains("secret=1"), "query strings are not kept: {ps}");
    assert_eq!(
        upstream.recorded().len(),
        1,
        "nothing reaches a locked destination"
    );
    let s = proxy.destination("local").await;
    assert_eq!(s["lock"]["status"], 403);
    assert_eq!(
        s["lock"]["request"],
        format!("GET https://localhost:{}/status/403", upstream.https.port())
    );
    assert!(proxy
        .metrics()
        .await
        .contains("pacegate_locked{destination=\"local\",group=\"\"} 1"));

    let proxy = proxy.restart().await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let refused = via
        .get(format!("{}/fine", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403, "still locked after a restart");
    assert!(refused.headers().contains_key("proxy-status"));

    let admin = admin_client();
    let unlock = format!("http://{}/destinations/local/unlock", proxy.admin);
    assert_eq!(
        admin.post(&unlock).send().await.unwrap().status(),
        401,
        "POSTs need the token"
    );
    let resp = admin
        .post(&unlock)
        .bearer_auth("s3cret-token")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: serde_json::Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(body["was_locked"], true);
    let resp = via
        .get(format!("{}/fine", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "service restored");
    assert_eq!(
        proxy.destination("local").await["lock"],
        serde_json::Value::Null
    );
}

#[tokio::test]
async fn throttled_gets_are_retried_and_posts_are_not() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 100\nretry_throttled = 2").await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let base = upstream.https_url("localhost");
    let resp = via.get(format!("{base}/flaky/2/get")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "finally\n");
    // Even a body-less POST is never retried: it is not idempotent.
    let resp = via
        .post(format!("{base}/flaky/2/post"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429, "POST is never retried");
    // Nor is a GET with a body.
    let resp = via
        .get(format!("{base}/flaky/2/withbody"))
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429, "a request with a body is never retried");
    let resp = via
        .get(format!("{base}/flaky/9/many?h=Retry-After:1"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        429,
        "after retry_throttled retries, the last throttled answer"
    );
    assert_eq!(resp.headers()["retry-after"], "1");
    assert_eq!(resp.text().await.unwrap(), "slow down\n");
    let count = |key: &str| {
        upstream
            .recorded()
            .iter()
            .filter(|r| r.path.contains(key))
            .count()
    };
    assert_eq!(
        (
            count("/get"),
            count("/post"),
            count("/withbody"),
            count("/many")
        ),
        (3, 1, 1, 3)
    );
    assert!(proxy
        .metrics()
        .await
        .contains("pacegate_retries_total{destination=\"local\",group=\"\"} 4"));
}

#[tokio::test]
async fn no_slot_within_max_wait_is_a_503_with_retry_after() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 1\nmax_wait = \"300ms\"").await;
    let via = client(Some(&proxy.url()), &[], Alpn::Http1);
    let started = Instant::now();
    let tasks: Vec<_> = (0..3)
        .map(|i| {
            let via = via.clone();
            let url = format!("{}/?{i}", upstream.http_url("localhost"));
            tokio::spawn(async move { via.get(url).send().await.unwrap() })
        })
        .collect();
    let mut refused = 0;
    for t in tasks {
        let resp = t.await.unwrap();
        if resp.status() == 503 {
            refused += 1;
            assert!(
                resp.headers()["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse::<u64>()
                    .unwrap()
                    >= 1
            );
            let ps = resp.headers()["proxy-status"].to_str().unwrap();
            assert!(
                ps.contains("error=destination_unavailable") && ps.contains("max_wait"),
                "{ps}"
            );
        } else {
            assert_eq!(resp.status(), 200);
        }
    }
    assert_eq!(refused, 2);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "refusals came after {:?}",
        started.elapsed()
    );
    assert_eq!(upstream.recorded().len(), 1);
    assert!(proxy.metrics().await.contains(
        "pacegate_requests_total{destination=\"local\",group=\"\",outcome=\"deadline\"} 2"
    ));
}

#[tokio::test]
async fn a_client_that_gives_up_leaves_the_queue_at_once() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 0.5").await;
    let via = client(Some(&proxy.url()), &[], Alpn::Http1);
    let url = |p: &str| format!("{}/{p}", upstream.http_url("localhost"));
    assert_eq!(via.get(url("first")).send().await.unwrap().status(), 200);
    let impatient = support::client_with(Some(&proxy.url()), &[], Alpn::Http1, |b| {
        b.timeout(Duration::from_millis(300))
    });
    assert!(impatient.get(url("gone")).send().await.is_err());
    support::eventually(Duration::from_secs(2), "the queue to empty", || async {
        (proxy.destination("local").await["waiting"] == 0).then_some(())
    })
    .await;
    let resp = via.get(url("next")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let paths: Vec<String> = upstream.recorded().iter().map(|r| r.path.clone()).collect();
    assert_eq!(
        paths,
        ["/first", "/next"],
        "the abandoned request was never sent"
    );
    let at = upstream.arrivals();
    assert!(
        at[1] - at[0] < Duration::from_millis(2500),
        "its slot was passed on: {:?}",
        at[1] - at[0]
    );
}

#[tokio::test]
async fn max_concurrency_bounds_requests_in_flight() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 1000\nmax_concurrency = 2").await;
    let urls = (0..6)
        .map(|i| format!("{}/sleep/300?{i}", upstream.http_url("localhost")))
        .collect();
    let proxy_ref = &proxy;
    let watcher = async {
        let mut most = 0;
        for _ in 0..20 {
            let s = proxy_ref.destination("local").await;
            most = most.max(s["in_flight"].as_u64().unwrap());
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        most
    };
    let (statuses, most) = tokio::join!(burst_of(&proxy, urls), watcher);
    assert!(statuses.iter().all(|s| *s == 200));
    assert!((1..=2).contains(&most), "in flight peaked at {most}");
    let at = upstream.arrivals();
    // Two at a time, each held 300 ms: the 3rd and 5th arrive a hold time after the 1st and 3rd.
    assert!(
        at[2] - at[0] >= Duration::from_millis(280),
        "{:?}",
        at[2] - at[0]
    );
    assert!(
        at[4] - at[2] >= Duration::from_millis(280),
        "{:?}",
        at[4] - at[2]
    );
}

#[tokio::test]
async fn a_request_is_in_flight_until_its_body_has_been_read() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 1000\nmax_concurrency = 1").await;
    let via = client(Some(&proxy.url()), &[], Alpn::Http1);
    // The upstream sends its head and a first chunk, then holds the rest of the body.
    let mut first = via
        .get(format!(
            "{}/gated/{}",
            upstream.http_url("localhost"),
            1 << 20
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    first.chunk().await.unwrap().expect("a first chunk");
    let in_flight = |s: serde_json::Value| s["in_flight"].as_u64().unwrap();
    assert_eq!(
        in_flight(proxy.destination("local").await),
        1,
        "the response head is out, its body is not: the request still holds its place"
    );
    // The one place is held: the next request waits for it.
    let next = tokio::spawn({
        let via = via.clone();
        let url = format!("{}/?next", upstream.http_url("localhost"));
        async move { via.get(url).send().await.unwrap().status() }
    });
    upstream.release();
    while first.chunk().await.unwrap().is_some() {}
    assert_eq!(
        next.await.unwrap(),
        200,
        "the place is given back with the body's end"
    );
    support::eventually(Duration::from_secs(5), "nothing in flight", || async {
        (in_flight(proxy.destination("local").await) == 0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_blind_tunnel_to_a_destination_takes_a_slot() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 2\nintercept = false").await;
    // The client trusts only the upstream's CA: this works only through a blind tunnel.
    let direct_trust = [upstream.ca.cert_path.as_path()];
    let started = Instant::now();
    for i in 0..3 {
        let c = client(Some(&proxy.url()), &direct_trust, Alpn::Http1);
        let resp = c
            .get(format!("{}/?{i}", upstream.https_url("localhost")))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    }
    assert!(
        started.elapsed() >= Duration::from_millis(950),
        "three tunnels at 2/s took {:?}",
        started.elapsed()
    );
    assert!(proxy.metrics().await.contains(
        "pacegate_requests_total{destination=\"local\",group=\"\",outcome=\"tunneled\"} 3"
    ));
}

#[tokio::test]
async fn status_command_prints_a_table() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 4").await;
    let via = client(Some(&proxy.url()), &[], Alpn::Http1);
    via.get(format!("{}/", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    let config = proxy.dir.path().join(support::CONFIG_FILE);
    let admin = format!("http://{}", proxy.admin);
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pacegate"))
        .args([
            "status",
            "--config",
            config.to_str().unwrap(),
            "--admin",
            &admin,
        ])
        .output()
        .await
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(table.starts_with("DESTINATION"), "{table}");
    let row = table
        .lines()
        .find(|l| l.starts_with("local"))
        .expect("a row for local");
    assert!(row.contains("4/s") && row.contains("x1"), "{row}");
    let unlock = tokio::process::Command::new(env!("CARGO_BIN_EXE_pacegate"))
        .args([
            "unlock",
            "local",
            "--config",
            config.to_str().unwrap(),
            "--admin",
            &admin,
        ])
        .output()
        .await
        .unwrap();
    assert!(unlock.status.success());
    assert_eq!(
        String::from_utf8_lossy(&unlock.stdout).trim(),
        "local was not locked"
    );
}

/// Four requests at once to an upstream whose new connections take 60 ms to be served, with
/// answers slow enough (300 ms) that each request needs a connection of its own. A request
/// first opens one connection (and, for https, mints the certificate), so that the first of
/// the four goes on its slot. Returns each arrival after the first of the four, in order.
async fn arrivals_on_slow_connections(
    proxy: &TestProxy,
    upstream: &FakeUpstream,
    base: &str,
) -> Vec<Duration> {
    let warm = burst_of(proxy, vec![format!("{base}/")]).await;
    assert_eq!(warm, [200]);
    upstream.slow_start(Duration::from_millis(60));
    let urls = (0..4).map(|i| format!("{base}/sleep/300?{i}")).collect();
    let statuses = burst_of(proxy, urls).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let mut at: Vec<Instant> = upstream
        .recorded()
        .iter()
        .filter(|r| r.path.starts_with("/sleep/"))
        .map(|r| r.at)
        .collect();
    at.sort();
    at.iter().map(|t| *t - at[0]).collect()
}

#[tokio::test]
async fn a_request_that_waits_for_its_slot_gets_its_connection_meanwhile() {
    for scheme in ["http", "https"] {
        let upstream = FakeUpstream::start().await;
        // 100 ms apart, and no burst after the warm-up's slot.
        let proxy = start(&upstream, "rate = 10").await;
        let base = if scheme == "http" {
            upstream.http_url("localhost")
        } else {
            upstream.https_url("localhost")
        };
        let at = arrivals_on_slow_connections(&proxy, &upstream, &base).await;
        assert_eq!(at.len(), 4, "{at:?}");
        // The first takes the pooled connection. The others wait 100, 200 and 300 ms for
        // their slots, and each needs a new connection (the ones before are busy): opened
        // while they wait, they reach the upstream on their slots, not 60 ms after.
        for (k, t) in at.iter().enumerate().skip(1) {
            let slot = Duration::from_millis(100 * k as u64);
            assert!(
                *t + Duration::from_millis(10) >= slot && *t < slot + Duration::from_millis(40),
                "{scheme}: request {k} arrived {t:?} after the first, its slot {slot:?} after: {at:?}"
            );
        }
    }
}

/// A request to a cold upstream takes its connection before its slot: a fresh https upstream
/// whose handshakes take 60 ms, at 10/s, where a slot may be used 50 ms late and no more. Its
/// slot, due at once, would be past by the time the connection is there; so it waits for the
/// connection, then takes its slot, and uses the one slot it is granted.
#[tokio::test]
async fn a_request_to_a_cold_upstream_takes_its_connection_before_its_slot() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 10").await;
    upstream.slow_start(Duration::from_millis(60));
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let resp = via
        .get(format!("{}/", upstream.https_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let metrics = proxy.metrics().await;
    let value = |series: &str| support::metric_value(&metrics, series);
    assert_eq!(
        value("pacegate_slots_dropped_total{destination=\"local\",group=\"\"}"),
        0.0,
        "no slot dropped"
    );
    assert_eq!(
        value("pacegate_granted_total{class=\"default\",destination=\"local\",group=\"\"}"),
        1.0,
        "one slot granted"
    );
}

/// A request whose slot comes before its upstream connection can: the upstream's one
/// connection is busy with a slow answer, and a new one takes 250 ms (handshakes included), at
/// 10/s, where a slot may be used 50 ms late and no more. The second request's slot comes
/// 100 ms after the first's, its connection about 250 ms after: it is not sent on that slot
/// (sent then, it would go 150 ms late and bunch with the next) but on another, once the
/// connection opened meanwhile is there. A POST: its body goes whole all the same.
#[tokio::test]
async fn a_request_without_a_connection_in_time_for_its_slot_goes_on_another() {
    // HTTP/1.1 only: over h2 the second request would share the first's connection.
    let upstream = FakeUpstream::start_with(false).await;
    let proxy = start(&upstream, "rate = 10").await;
    upstream.slow_start(Duration::from_millis(250));
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let slow = format!("{}/sleep/600", upstream.https_url("localhost"));
    let busy = tokio::spawn({
        let via = via.clone();
        async move { via.get(slow).send().await.unwrap().status() }
    });
    support::eventually(
        Duration::from_secs(5),
        "the slow request upstream",
        || async { (upstream.arrivals().len() == 1).then_some(()) },
    )
    .await;
    let body = "a body lent to one slot and sent on another".repeat(100);
    let resp = via
        .post(format!("{}/echo", upstream.https_url("localhost")))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), body);
    assert_eq!(busy.await.unwrap(), 200);
    assert_eq!(upstream.arrivals().len(), 2, "each sent once");
    let dropped = proxy
        .metric("pacegate_slots_dropped_total{destination=\"local\",group=\"\"}")
        .await;
    assert!(
        dropped >= 1.0,
        "the slot before the connection is dropped: {dropped}"
    );
}

/// An upstream that accepts and never answers the TLS handshake: the request waits for its
/// first connection no longer than the connect timeout, then gets a 504 that says so, and
/// spends no slot on it.
#[tokio::test]
async fn a_cold_upstream_that_never_answers_costs_no_slot() {
    let upstream = FakeUpstream::start().await;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            kept.push(s);
        }
    });
    let extra = format!(
        "[upstream]\nconnect_timeout = \"300ms\"\n{}",
        local("rate = 10")
    );
    let proxy = TestProxy::start(&upstream.ca.cert_path, "", &extra).await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let started = Instant::now();
    let resp = via
        .get(format!("https://localhost:{port}/"))
        .send()
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(resp.status(), 504);
    let status = resp.headers()["proxy-status"].to_str().unwrap().to_owned();
    assert!(status.contains("connection_timeout"), "{status}");
    assert!(took < Duration::from_secs(3), "answered {took:?} on");
    let granted = proxy
        .metric("pacegate_granted_total{class=\"default\",destination=\"local\",group=\"\"}")
        .await;
    assert_eq!(granted, 0.0, "no slot spent");
    held.abort();
}

#[tokio::test]
async fn one_client_minting_keys_is_refused_past_its_share_and_says_who() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(
        &upstream,
        "rate = 1000\nkey = \"header:x-tenant\"\nmax_keys = 10\nmax_keys_per_client = 2",
    )
    .await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let url = format!("{}/x", upstream.http_url("localhost"));
    let mut statuses = Vec::new();
    let mut last = None;
    for tenant in ["a", "b", "c", "a"] {
        let resp = via
            .get(&url)
            .header("x-tenant", tenant)
            .send()
            .await
            .unwrap();
        statuses.push(resp.status().as_u16());
        if resp.status() == 503 {
            last = Some(resp.headers()["proxy-status"].to_str().unwrap().to_owned());
        }
    }
    // Its third key is refused; a key it made still goes.
    assert_eq!(statuses, [200, 200, 503, 200]);
    let ps = last.unwrap();
    assert!(
        ps.contains("client 127.0.0.1") && ps.contains("max_keys_per_client"),
        "{ps}"
    );
    assert_eq!(
        proxy
            .metric("pacegate_keys_refused_client_total{destination=\"local\",group=\"\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn a_response_tells_the_client_how_long_it_waited_and_how_long_the_upstream_took() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 4").await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    // The origin's own metric first, then pacegate's, in one field.
    let url = format!(
        "{}/status/200?delay=150&h=server-timing:origin;dur=7",
        upstream.http_url("localhost")
    );
    let first = via.get(&url).send().await.unwrap();
    let second = via.get(&url).send().await.unwrap();
    for resp in [&first, &second] {
        let field = resp.headers()["server-timing"].to_str().unwrap();
        assert!(
            field.starts_with("origin;dur=7, pacegate-wait;dur="),
            "{field}"
        );
        assert_eq!(resp.headers().get_all("server-timing").iter().count(), 1);
        let upstream_ms = timing(resp, "pacegate-upstream").unwrap();
        assert!(
            (145.0..2000.0).contains(&upstream_ms),
            "an upstream that answers after 150 ms took {upstream_ms} ms by Server-Timing"
        );
    }
    // The second waited for its slot, a quarter of a second after the first's, less the
    // first's 150 ms at the upstream.
    let waited = timing(&second, "pacegate-wait").unwrap();
    assert!(
        (60.0..250.0).contains(&waited),
        "the second request waited {waited} ms by Server-Timing"
    );
    assert!(timing(&first, "pacegate-wait").unwrap() < 50.0);
}

/// pacegate's item (`"pacegate";…`) of a RateLimit field, as its parameters.
fn pacegate_item(resp: &reqwest::Response, field: &str) -> Option<Vec<(String, String)>> {
    let value = resp.headers().get(field)?.to_str().ok()?;
    let item = value
        .split(", ")
        .find_map(|i| i.strip_prefix("\"pacegate\";"))?;
    Some(
        item.split(';')
            .filter_map(|p| p.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    )
}

fn param(item: &[(String, String)], name: &str) -> Option<u64> {
    item.iter().find(|(k, _)| k == name)?.1.parse().ok()
}

#[tokio::test]
async fn a_paced_response_carries_pacegate_s_ratelimit_items_after_the_origin_s() {
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::start(
        &upstream.ca.cert_path,
        "",
        "[destinations.local]\nhosts = [\"localhost\"]\nrate = 20\n\
         [destinations.tenants]\nhosts = [\"127.0.0.1\"]\nrate = 20\nkey = \"header:x-tenant\"\n",
    )
    .await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    // The origin's own policy and standing are kept, first, in the same field.
    let url = format!(
        "{}/status/200?h=ratelimit-policy:burst;q=100;w=60&h=ratelimit:burst;r=50;t=30",
        upstream.http_url("localhost")
    );
    let resp = via.get(&url).send().await.unwrap();
    assert_eq!(
        resp.headers()["ratelimit-policy"],
        "burst;q=100;w=60, \"pacegate\";q=20;w=1"
    );
    assert_eq!(
        resp.headers()["ratelimit"],
        "burst;r=50;t=30, \"pacegate\";r=20;t=0"
    );
    // A budget split by key names its partition by a fingerprint, never the key.
    let keyed = format!("{}/status/200", upstream.http_url("127.0.0.1"));
    let fingerprints: Vec<String> = ["alice", "bob"]
        .iter()
        .map(|tenant| async {
            let tenant: &str = tenant;
            let resp = via
                .get(&keyed)
                .header("x-tenant", tenant)
                .send()
                .await
                .unwrap();
            let field = resp.headers()["ratelimit"].to_str().unwrap().to_owned();
            assert!(!field.contains(tenant), "{field}");
            let item = pacegate_item(&resp, "ratelimit").unwrap();
            item.iter().find(|(k, _)| k == "pk").unwrap().1.clone()
        })
        .collect::<futures_util::future::JoinAll<_>>()
        .await;
    assert_ne!(fingerprints[0], fingerprints[1]);
    assert!(fingerprints[0].starts_with(':') && fingerprints[0].ends_with(':'));
    // `advertise = false`: no RateLimit item of pacegate's, the Server-Timing still.
    let quiet = start(&upstream, "rate = 20\nadvertise = false").await;
    let via = client(Some(&quiet.url()), &[&quiet.ca_path()], Alpn::Http1);
    let resp = via
        .get(format!("{}/status/200", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("ratelimit").is_none());
    assert!(resp.headers().get("ratelimit-policy").is_none());
    assert!(timing(&resp, "pacegate-wait").is_some());
}

#[tokio::test]
async fn requests_waiting_are_told_in_ratelimit_and_a_refusal_comes_back_no_sooner_than_it_says() {
    let upstream = FakeUpstream::start().await;
    // Two a second: a window of 5 s holds ten slots; a request may wait 1.2 s.
    let proxy = start(&upstream, "rate = 2\nmax_wait = \"1200ms\"").await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let url = format!("{}/status/200?delay=200", upstream.http_url("localhost"));
    let sends: Vec<_> = (0..5)
        .map(|_| {
            let (via, url) = (via.clone(), url.clone());
            tokio::spawn(async move { via.get(url).send().await.unwrap() })
        })
        .collect();
    let mut answers = Vec::new();
    for s in sends {
        answers.push(s.await.unwrap());
    }
    // The first answered came back while the others waited: fewer than ten of the window's
    // slots are left, and a new request would wait at least a second.
    let first = answers
        .iter()
        .filter(|r| r.status() == 200)
        .min_by(|a, b| {
            let t = |r: &reqwest::Response| timing(r, "pacegate-wait").unwrap();
            t(a).total_cmp(&t(b))
        })
        .unwrap();
    let policy = pacegate_item(first, "ratelimit-policy").unwrap();
    assert_eq!(
        (param(&policy, "q"), param(&policy, "w")),
        (Some(10), Some(5))
    );
    let standing = pacegate_item(first, "ratelimit").unwrap();
    assert!(param(&standing, "r").unwrap() < 10, "{standing:?}");
    assert!(param(&standing, "t").unwrap() >= 1, "{standing:?}");
    // Those that could not be served within 1.2 s are refused, each telling when to come
    // back: a Retry-After no sooner than its RateLimit's `t`.
    let refused: Vec<_> = answers.iter().filter(|r| r.status() == 503).collect();
    assert!(
        !refused.is_empty(),
        "five requests at two a second within 1.2 s"
    );
    for r in refused {
        let standing = pacegate_item(r, "ratelimit").unwrap();
        let retry_after: u64 = r.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            retry_after >= param(&standing, "t").unwrap().max(1),
            "{standing:?}"
        );
    }
}
