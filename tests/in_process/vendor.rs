//! What the vendor says, through the real proxy: throttles that arrive as a 403 (a spent
//! budget, a marker in a plain or gzip-encoded body) are throttles, not lockouts, and the
//! client still gets the vendor's answer byte for byte.

use crate::support;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::upstream::gzip;
use support::{busiest, client, Alpn, FakeUpstream, TestProxy};

async fn start(upstream: &FakeUpstream, keys: &str) -> TestProxy {
    let config = format!("[destinations.local]\nhosts = [\"localhost\"]\n{keys}\n");
    TestProxy::start(&upstream.ca.cert_path, "", &config).await
}

#[tokio::test]
async fn a_github_style_spent_budget_pauses_until_the_reset_and_locks_nothing() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 100\nretry_throttled = 0").await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    // GitHub's primary limit, spent: a 403, remaining 0, the reset in Unix seconds at least
    // 3 s ahead.
    let reset = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 4;
    let spent = format!(
        "{}/status/403?h=x-ratelimit-limit:5000&h=x-ratelimit-remaining:0&h=x-ratelimit-reset:{reset}&body=API%20rate%20limit%20exceeded",
        upstream.https_url("localhost")
    );
    let resp = via.get(&spent).send().await.unwrap();
    assert_eq!(resp.status(), 403, "the client gets the vendor's answer");
    assert!(resp.headers().get("proxy-status").is_none());
    assert_eq!(resp.text().await.unwrap(), "API rate limit exceeded");
    let s = proxy.destination("local").await;
    assert_eq!(
        s["lock"],
        serde_json::Value::Null,
        "a throttle locks nothing: {s}"
    );
    assert!(s["paused_for_seconds"].as_f64().unwrap() > 2.0, "{s}");

    let fine = via
        .get(format!("{}/fine", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(fine.status(), 200, "served after the reset, not refused");
    let at = upstream.arrivals();
    let waited = at[1] - at[0];
    let until_reset = UNIX_EPOCH + Duration::from_secs(reset);
    assert!(
        SystemTime::now() >= until_reset - Duration::from_millis(50),
        "the next request went {waited:?} later, before the reset"
    );
    assert!(waited < Duration::from_secs(6), "{waited:?}");
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains(
            "pacegate_verdicts_total{destination=\"local\",group=\"\",reason=\"exhausted\",verdict=\"throttled\"} 1"
        ),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_gzip_encoded_marker_is_a_throttle_and_reaches_the_client_unchanged() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 100\nretry_throttled = 0").await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let text = "You have exceeded a secondary rate limit. Please wait a few minutes.";
    let url = format!(
        "{}/status/403?gzip=1&body={}",
        upstream.https_url("localhost"),
        text.replace(' ', "%20")
    );
    let resp = via.get(&url).send().await.unwrap();
    assert_eq!(resp.status(), 403);
    assert_eq!(resp.headers()["content-encoding"], "gzip");
    let received = resp.bytes().await.unwrap();
    assert_eq!(&received[..], &gzip(text.as_bytes())[..], "byte for byte");
    let s = proxy.destination("local").await;
    assert_eq!(s["lock"], serde_json::Value::Null, "{s}");
    assert_eq!(s["backoff"], 2.0, "a throttle widens: {s}");
    let fine = via
        .get(format!("{}/fine", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(fine.status(), 200);
    assert!(proxy.metrics().await.contains(
        "pacegate_verdicts_total{destination=\"local\",group=\"\",reason=\"body\",verdict=\"throttled\"} 1"
    ));
}

#[tokio::test]
async fn a_403_without_a_marker_still_locks_out() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 100").await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    // A remaining budget and a body that is not about rate limits: a real refusal.
    let url = format!(
        "{}/status/403?h=x-ratelimit-remaining:4000&body=Resource%20not%20accessible",
        upstream.https_url("localhost")
    );
    assert_eq!(via.get(&url).send().await.unwrap().status(), 403);
    let refused = via
        .get(format!("{}/fine", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    assert!(
        refused.headers().contains_key("proxy-status"),
        "refused by pacegate"
    );
    assert_eq!(proxy.destination("local").await["lock"]["status"], 403);
    assert_eq!(upstream.recorded().len(), 1);
}

/// `n` GETs of `url` at once through the proxy (`i=` tells them apart); their statuses.
async fn burst(proxy: &TestProxy, url: &str, n: usize) -> Vec<u16> {
    let and = if url.contains('?') { '&' } else { '?' };
    support::burst_of(proxy, (0..n).map(|i| format!("{url}{and}i={i}")).collect()).await
}

#[tokio::test]
async fn the_vendors_ratelimit_fields_hold_its_window_and_without_signals_nothing_does() {
    // 8 requests per 4 s window at the vendor; rate = 50 would send 40 in under a second.
    let upstream = FakeUpstream::start().await;
    // 429s are not throttles here: what is tested is the fields, not the reaction to a 429.
    let keys = "rate = 50\nreserve = 1\nthrottle_statuses = []\nmax_wait = \"60s\"";
    let proxy = start(&upstream, keys).await;
    let url = format!("{}/window/8/4", upstream.http_url("localhost"));
    let statuses = burst(&proxy, &url, 14).await;
    assert!(
        statuses.iter().all(|s| *s == 200),
        "never a 429: {statuses:?}"
    );
    let at = upstream.arrivals();
    assert!(
        busiest(&at, Duration::from_secs(4)) <= 8,
        "a 4 s window held {} of 14",
        busiest(&at, Duration::from_secs(4))
    );
    let s = proxy.destination("local").await;
    assert_eq!(s["vendor"]["family"], "ietf", "{s}");

    // The control: the same load without signals runs into the vendor's limit.
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, &format!("{keys}\nsignals = \"none\"")).await;
    let url = format!("{}/window/8/4", upstream.http_url("localhost"));
    let started = Instant::now();
    let statuses = burst(&proxy, &url, 40).await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(
        statuses.iter().filter(|s| **s == 429).count() >= 30,
        "{statuses:?}"
    );
    assert_eq!(
        proxy.destination("local").await["vendor"],
        serde_json::Value::Null
    );
}

/// GitHub's 5,000 an hour with 4,000 left and the reset an hour away, as every answer says.
fn plenty_left(upstream: &FakeUpstream) -> String {
    let reset = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    format!(
        "{}/status/200?h=x-ratelimit-limit:5000&h=x-ratelimit-remaining:4000&h=x-ratelimit-reset:{reset}",
        upstream.http_url("localhost")
    )
}

#[tokio::test]
async fn a_vendor_budget_with_plenty_left_goes_at_the_rate_unless_told_to_spread() {
    // Burst, the default: 40 requests at rate 50 take what the rate takes (0.8 s).
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 50").await;
    let url = plenty_left(&upstream);
    let started = Instant::now();
    let statuses = burst(&proxy, &url, 40).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "40 requests with four fifths of the budget left took {:?}",
        started.elapsed()
    );
    let s = proxy.destination("local").await;
    assert_eq!(s["vendor"]["family"], "x-ratelimit", "{s}");

    // Spread: 4,000 over the hour is one every 0.9 s from the view (40 would take 36 s; the
    // first four show the beat). The first request teaches the view.
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 50\nvendor_pace = \"spread\"").await;
    let url = plenty_left(&upstream);
    assert_eq!(burst(&proxy, &url, 1).await, [200]);
    let statuses = burst(&proxy, &url, 4).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let at = upstream.arrivals();
    for (k, gap) in at.windows(2).map(|w| w[1] - w[0]).enumerate() {
        assert!(
            gap >= Duration::from_millis(800),
            "request {} went {gap:?} after the one before, not the 0.9 s of a spread budget",
            k + 2
        );
    }
}

#[tokio::test]
async fn requests_in_flight_when_the_vendor_answered_are_not_spent_twice() {
    // 10 a window of 4 s, each answer 100 ms after its request: at rate 50, five more are on
    // their way when the first says 9 are left. Spent at the rate, those five count against
    // it, so the window is not overrun.
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "rate = 50\nthrottle_statuses = []").await;
    let url = format!("{}/window/10/4?delay=100", upstream.http_url("localhost"));
    let statuses = burst(&proxy, &url, 12).await;
    assert!(
        statuses.iter().all(|s| *s == 200),
        "the vendor refused {} of 12: {statuses:?}",
        statuses.iter().filter(|s| **s == 429).count()
    );
}

#[tokio::test]
async fn at_the_reserve_a_vendor_budget_waits_for_its_reset_at_either_pace() {
    // 5 a window of 3 s at the vendor, 2 kept in reserve: 3 go, the 4th waits for the reset.
    for pace in ["burst", "spread"] {
        let upstream = FakeUpstream::start().await;
        let keys = format!("rate = 50\nreserve = 2\nvendor_pace = \"{pace}\"");
        let proxy = start(&upstream, &keys).await;
        let url = format!("{}/window/5/3", upstream.http_url("localhost"));
        let statuses = burst(&proxy, &url, 4).await;
        assert!(statuses.iter().all(|s| *s == 200), "{pace}: {statuses:?}");
        let at = upstream.arrivals();
        let after = |i: usize| at[i] - at[0];
        assert!(
            after(3) >= Duration::from_millis(2900),
            "{pace}: the 4th went {:?} after the 1st, before the reset",
            after(3)
        );
        if pace == "burst" {
            assert!(
                after(2) < Duration::from_secs(1),
                "burst: the 3rd went {:?} after the 1st, not at the rate",
                after(2)
            );
        }
    }
}

#[tokio::test]
async fn a_secondary_limit_blocks_for_longer_each_time_across_a_restart_until_a_success() {
    let upstream = FakeUpstream::start().await;
    let keys = "rate = 100\nretry_throttled = 0\nthrottle_block = { min = \"1s\", max = \"8s\", jitter = 0 }";
    let proxy = start(&upstream, keys).await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let secondary = format!(
        "{}/status/403?body=You%20have%20exceeded%20a%20secondary%20rate%20limit",
        upstream.http_url("localhost")
    );
    let fine = format!("{}/fine", upstream.http_url("localhost"));
    // Sends `url` and returns how long after the previous arrival it reached the upstream.
    async fn gap(via: &reqwest::Client, upstream: &FakeUpstream, url: &str, want: u16) -> Duration {
        assert_eq!(via.get(url).send().await.unwrap().status(), want);
        let at = upstream.arrivals();
        at[at.len() - 1] - at[at.len() - 2]
    }
    assert_eq!(via.get(&secondary).send().await.unwrap().status(), 403);
    let first = gap(&via, &upstream, &secondary, 403).await;
    assert!(
        first >= Duration::from_millis(950),
        "first block: {first:?}"
    );
    let s = proxy.destination("local").await;
    assert_eq!(s["block_streak"], 2, "{s}");
    assert_eq!(s["pace_limited_by"], "paused: block", "{s}");
    assert!(proxy
        .metrics()
        .await
        .contains("pacegate_block_streak{destination=\"local\",group=\"\"} 2"));

    // A restart keeps the streak, and the block in force.
    let proxy = proxy.restart().await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    assert_eq!(proxy.destination("local").await["block_streak"], 2);
    let second = gap(&via, &upstream, &fine, 200).await;
    assert!(
        second >= Duration::from_millis(1950),
        "second block: {second:?}"
    );
    // That success ended the streak: the next block is `min` again.
    assert_eq!(proxy.destination("local").await["block_streak"], 0);
    assert_eq!(via.get(&secondary).send().await.unwrap().status(), 403);
    let again = gap(&via, &upstream, &fine, 200).await;
    assert!(
        again >= Duration::from_millis(950) && again < Duration::from_millis(1900),
        "after a success: {again:?}"
    );
    assert_eq!(
        proxy.destination("local").await["lock"],
        serde_json::Value::Null,
        "blocks, never a lockout"
    );
}
