//! Shadow mode, on the real binary: a destination with `mode = "shadow"` forwards every
//! request at once, while the pacer computes when each would have gone and counts what it
//! would have refused.

use crate::support;
use crate::support::fleet::beside;

use std::time::Duration;

use support::process::Served;
use support::{client, eventually, metric_value, Alpn, FakeUpstream};

/// The destination's rate in the comparison.
const RATE: u32 = 20;
/// Requests in the comparison, sent open-loop at twice the rate.
const REQUESTS: u32 = 40;

/// A real `pacegate serve` with one destination, `local` (localhost), and `keys`.
fn start(keys: &str) -> Served {
    Served::start(
        "",
        None,
        &format!("[destinations.local]\nhosts = [\"localhost\"]\nmax_wait = \"30s\"\n{keys}"),
    )
}

/// Sends [`REQUESTS`] requests through `proxy` on a fixed beat of twice the rate, whatever
/// the answers (independent workers do), and waits for every answer.
async fn open_loop(proxy: &Served, upstream: &FakeUpstream) {
    let via = client(Some(&proxy.url()), &[], Alpn::Http1);
    let beat = Duration::from_secs(1) / (2 * RATE);
    let start = tokio::time::Instant::now();
    let requests: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let (via, url) = (
                via.clone(),
                format!("{}/?{i}", upstream.http_url("localhost")),
            );
            tokio::spawn(async move {
                tokio::time::sleep_until(start + beat * i).await;
                via.get(url).send().await.unwrap().status()
            })
        })
        .collect();
    for r in requests {
        assert_eq!(r.await.unwrap(), 200);
    }
}

/// The mean of a histogram of the `local` destination, once it holds `count` observations.
async fn mean_of(proxy: &Served, histogram: &str, count: u32) -> f64 {
    let series = |part: &str| format!("{histogram}_{part}{{destination=\"local\",group=\"\"}}");
    eventually(Duration::from_secs(15), histogram, || async {
        let text = proxy.metrics().await;
        (metric_value(&text, &series("count")) == f64::from(count))
            .then(|| metric_value(&text, &series("sum")) / f64::from(count))
    })
    .await
}

// Several threads: the forty requests in flight at once in shadow mode (clients and
// upstream in this process) are answered without delaying the beat of the load.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shadow_mode_sends_at_once_and_counts_the_waits_enforcing_makes() {
    let _beside = beside().await;
    // Enforced: the requests wait, and the upstream sees the rate.
    let upstream = FakeUpstream::start().await;
    let enforcing = start(&format!("rate = {RATE}"));
    open_loop(&enforcing, &upstream).await;
    let at = upstream.arrivals();
    let enforced_span = *at.last().unwrap() - at[0];
    assert!(
        enforced_span >= Duration::from_millis(1900),
        "{enforced_span:?}"
    );
    let enforced = mean_of(&enforcing, "pacegate_wait_seconds", REQUESTS).await;

    // Shadow: the same load reaches the upstream as it is sent; the would-be waits match.
    let upstream = FakeUpstream::start().await;
    let shadow = start(&format!("rate = {RATE}\nmode = \"shadow\""));
    open_loop(&shadow, &upstream).await;
    let at = upstream.arrivals();
    let shadow_span = *at.last().unwrap() - at[0];
    // The load itself spans 975 ms.
    assert!(
        shadow_span < Duration::from_millis(1500),
        "shadow mode made requests wait: {shadow_span:?}"
    );
    let would = mean_of(&shadow, "pacegate_shadow_wait_seconds", REQUESTS).await;
    eprintln!("mean wait: enforced {enforced:.3}s, would-be {would:.3}s");
    assert!(
        (would - enforced).abs() <= 0.1 * enforced,
        "would-be mean wait {would:.3}s against {enforced:.3}s enforced"
    );
    let text = shadow.metrics().await;
    assert_eq!(
        metric_value(
            &text,
            "pacegate_wait_seconds_count{destination=\"local\",group=\"\"}"
        ),
        0.0,
        "nothing waited"
    );
}

#[tokio::test]
async fn in_shadow_mode_verdicts_are_learned_and_a_lockout_refuses_nothing() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let proxy = start("rate = 1000\nmode = \"shadow\"");
    let via = client(Some(&proxy.url()), &[], Alpn::Http1);
    let base = upstream.http_url("localhost");

    // A throttle widens the interval, and is not retried: the client sees what it would
    // without pacegate.
    let throttled = via.get(format!("{base}/status/429")).send().await.unwrap();
    assert_eq!(throttled.status(), 429);
    assert_eq!(
        upstream.arrivals().len(),
        1,
        "a throttle in shadow mode is not retried"
    );

    let locked = via.get(format!("{base}/status/403")).send().await.unwrap();
    assert_eq!(locked.status(), 403);
    let after = via.get(format!("{base}/status/200")).send().await.unwrap();
    assert_eq!(
        after.status(),
        200,
        "a lockout in shadow mode refuses nothing"
    );

    let status: serde_json::Value =
        serde_json::from_str(&proxy.instance.admin_get("/status").await).unwrap();
    let local = &status[0];
    assert_eq!(local["mode"], "shadow");
    assert_eq!(local["backoff"], 2.0, "the throttle was learned");
    assert_eq!(local["lock"]["status"], 403, "the lockout was recorded");
    // The request after the lockout would have been refused.
    eventually(Duration::from_secs(5), "a counted refusal", || async {
        let text = proxy.metrics().await;
        (metric_value(
            &text,
            "pacegate_shadow_refusals_total{destination=\"local\",group=\"\",reason=\"locked\"}",
        ) >= 1.0)
            .then_some(())
    })
    .await;
}
