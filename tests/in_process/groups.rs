//! Budgets shaped like the vendor's: a destination's groups (by path prefix or method) each
//! pace on a budget of their own, so one bucket's slow pace or pause does not stall the
//! others; what the vendor says of a bucket goes to the budget it names; a lockout halts
//! every budget of the destination, and one unlock clears them all.

use crate::support;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::config::Dest;
use support::fleet::arrivals_of;
use support::{admin_client, burst_of, busiest, status_of, FakeUpstream, TestProxy};

/// `github` on localhost at 50/s, with `search` (`/search/`, 2/s, the vendor's `search`
/// bucket) and `writes` (POST, 10/s).
async fn github(upstream: &FakeUpstream) -> TestProxy {
    TestProxy::with(upstream)
        .destination(
            Dest::new("github", &["localhost"])
                .rate(50.0)
                .key("retry_throttled", 0),
        )
        .section(
            "[destinations.github.groups.search]\npaths = [\"/search/\"]\nresource = \"search\"\nrate = 2\n\
             [destinations.github.groups.writes]\nmethods = [\"POST\"]\nrate = 10\n",
        )
        .start()
        .await
}

/// [`github`], and a client through it.
async fn github_via(upstream: &FakeUpstream) -> (TestProxy, reqwest::Client) {
    let proxy = github(upstream).await;
    let via = support::client(
        Some(&proxy.url()),
        &[&proxy.ca_path()],
        support::Alpn::Http1,
    );
    (proxy, via)
}

#[tokio::test]
async fn the_search_bucket_paces_itself_and_core_keeps_its_own_rate() {
    let upstream = FakeUpstream::start().await;
    let proxy = github(&upstream).await;
    let base = upstream.http_url("localhost");
    // 5 searches and 20 core requests at once.
    let mut urls: Vec<String> = (0..5)
        .map(|i| format!("{base}/search/issues?i={i}"))
        .collect();
    urls.extend((0..20).map(|i| format!("{base}/core/repos?i={i}")));
    let started = Instant::now();
    let statuses = burst_of(&proxy, urls).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let (search, core) = (
        arrivals_of(&upstream, "search"),
        arrivals_of(&upstream, "core"),
    );
    // Core at 50/s: 20 requests in about 0.4 s, not behind the searches' 2 s.
    let core_took = *core.last().unwrap() - core[0];
    assert!(
        core_took < Duration::from_millis(1500),
        "core took {core_took:?} behind the search bucket"
    );
    assert!(busiest(&core, Duration::from_secs(1)) <= 51);
    // Search at 2/s: a slot every 500 ms, whatever core does.
    for pair in search.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(gap >= Duration::from_millis(450), "searches {gap:?} apart");
    }
    assert!(started.elapsed() >= Duration::from_millis(1900));
    // Each budget is shown on its own.
    let s = proxy.destination("github/search").await;
    assert_eq!(s["rate"], 2.0, "{s}");
    assert_eq!(proxy.destination("github").await["rate"], 50.0);
    // And labelled by destination and group in metrics.
    for (series, value) in [
        (
            "pacegate_configured_rate{destination=\"github\",group=\"search\"}",
            2.0,
        ),
        (
            "pacegate_configured_rate{destination=\"github\",group=\"\"}",
            50.0,
        ),
        (
            "pacegate_granted_total{class=\"default\",destination=\"github\",group=\"search\"}",
            5.0,
        ),
        (
            "pacegate_granted_total{class=\"default\",destination=\"github\",group=\"\"}",
            20.0,
        ),
        (
            "pacegate_requests_total{destination=\"github\",group=\"search\",outcome=\"forwarded\"}",
            5.0,
        ),
    ] {
        assert_eq!(proxy.metric(series).await, value, "{series}");
    }
}

#[tokio::test]
async fn a_lockout_in_one_group_halts_every_budget_and_one_unlock_clears_them_all() {
    let upstream = FakeUpstream::start().await;
    let (proxy, via) = github_via(&upstream).await;
    let base = upstream.http_url("localhost");
    // A write answered with a plain 403: the IP's lockout, not the write bucket's.
    let locked = via.post(format!("{base}/status/403")).send().await.unwrap();
    assert_eq!(locked.status(), 403);
    let seen = upstream.recorded().len();
    for url in [
        format!("{base}/core/repos"),
        format!("{base}/search/issues"),
    ] {
        let refused = via.get(&url).send().await.unwrap();
        assert_eq!(refused.status(), 403, "{url}");
        let why = refused.headers()["proxy-status"]
            .to_str()
            .unwrap()
            .to_owned();
        assert!(
            why.contains("locked out") && why.contains("pacegate unlock github "),
            "{why}"
        );
    }
    assert_eq!(
        upstream.recorded().len(),
        seen,
        "a locked budget sent a request"
    );
    // One unlock of the destination clears every budget.
    let unlock = format!("http://{}/destinations/github/unlock", proxy.admin);
    assert_eq!(
        admin_client().post(unlock).send().await.unwrap().status(),
        200
    );
    for url in [
        format!("{base}/core/repos"),
        format!("{base}/search/issues"),
    ] {
        assert_eq!(status_of(&via, &url).await, 200, "{url}");
    }
    assert_eq!(
        via.post(format!("{base}/core/issues"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

#[tokio::test]
async fn what_the_vendor_says_of_a_bucket_goes_to_the_budget_it_names() {
    let upstream = FakeUpstream::start().await;
    let (proxy, via) = github_via(&upstream).await;
    let base = upstream.http_url("localhost");
    // A core request whose answer says the search bucket is spent until 3 s from now.
    let reset = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3;
    let said = format!(
        "{base}/status/200?h=x-ratelimit-resource:search&h=x-ratelimit-limit:30&h=x-ratelimit-remaining:0&h=x-ratelimit-reset:{reset}"
    );
    assert_eq!(status_of(&via, &said).await, 200);
    // Core is not paused by it...
    let asked = Instant::now();
    assert_eq!(status_of(&via, format!("{base}/core/repos")).await, 200);
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "{:?}",
        asked.elapsed()
    );
    // ...and the search budget waits for the reset.
    assert_eq!(
        proxy.destination("github/search").await["vendor"]["remaining"],
        0
    );
    let asked = Instant::now();
    assert_eq!(status_of(&via, format!("{base}/search/issues")).await, 200);
    assert!(
        asked.elapsed() >= Duration::from_millis(1500),
        "search went {:?} after the vendor said its bucket was spent",
        asked.elapsed()
    );
    assert_eq!(
        proxy.destination("github").await["vendor"],
        serde_json::Value::Null
    );
}

#[tokio::test]
async fn a_path_written_otherwise_is_paced_in_the_group_the_vendor_counts_it_in() {
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::with(&upstream)
        .destination(Dest::new("github", &["localhost"]).rate(1000.0))
        .section("[destinations.github.groups.search]\npaths = [\"/search/\"]\nrate = 5\n")
        .start()
        .await;
    let port = upstream.http.port();
    let written = [
        "/search/x",
        "//search/x",
        "/%73earch/x",
        "/./search/x",
        "/a/../search/x",
        "/%2e/search/x",
    ];
    let started = Instant::now();
    let answers =
        futures_util::future::join_all(
            written.iter().map(|path| {
                let request = format!(
                    "GET http://localhost:{port}{path} HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n"
                );
                let addr = proxy.addr;
                async move {
                    support::raw_exchange(addr, request.as_bytes(), Duration::from_secs(10)).await
                }
            }),
        )
        .await;
    for (path, answer) in written.iter().zip(&answers) {
        assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer}");
    }
    // Six at 5/s, a slot every 200 ms: a second at least, where the destination's own
    // budget would have sent the five that escape at once.
    assert!(
        started.elapsed() >= Duration::from_millis(950),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        proxy
            .metric(
                "pacegate_granted_total{class=\"default\",destination=\"github\",group=\"search\"}"
            )
            .await,
        6.0
    );
    // The upstream got each path as it was written.
    let mut seen: Vec<String> = upstream.recorded().iter().map(|r| r.path.clone()).collect();
    let mut sent: Vec<String> = written.iter().map(|p| (*p).to_owned()).collect();
    seen.sort();
    sent.sort();
    assert_eq!(seen, sent);
}
