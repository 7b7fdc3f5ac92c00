//! Budgets in tokens: a meter holds each request for what it is estimated to cost before it
//! is sent, and the response, as it passes, settles what it cost; a response that says
//! nothing, or is cut off, keeps the estimate. A body larger than a meter reads is refused.

use crate::support;

use std::time::Duration;

use support::llm::{post_json, FakeLlm};
use support::{client, timing, Alpn, FakeUpstream, TestProxy};

/// `llm` on localhost at 100 requests a second, with a meter of 1,000 tokens a second
/// (60,000 a minute) estimated and settled as OpenAI's.
async fn llm(upstream: &FakeUpstream, more: &str) -> TestProxy {
    let config = format!(
        "[destinations.llm]\nhosts = [\"localhost\"]\nrate = 100\n{more}\n\
         [destinations.llm.meters.tokens]\nper_minute = 60000\ncost = \"openai\"\n"
    );
    TestProxy::start(&upstream.ca.cert_path, "", &config).await
}

/// A chat request estimated at 210 tokens: 44 bytes / 4, and `max_tokens` 199.
const CHAT: &str = r#"{"model":"m","max_tokens":199,"messages":[]}"#;

/// Sends `n` chat requests to `path` at once; returns the bodies the client read.
async fn chats(proxy: &TestProxy, upstream: &FakeUpstream, path: &str, n: usize) -> Vec<String> {
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let url = format!("{}{path}", upstream.http_url("localhost"));
    let sends: Vec<_> = (0..n)
        .map(|_| {
            let (via, url) = (via.clone(), url.clone());
            tokio::spawn(async move {
                let resp = via.post(url).body(CHAT).send().await.unwrap();
                assert_eq!(resp.status(), 200);
                resp.text().await.unwrap_or_default()
            })
        })
        .collect();
    let mut bodies = Vec::new();
    for s in sends {
        bodies.push(s.await.unwrap());
    }
    bodies
}

/// How long the upstream's arrivals spread over.
fn spread(upstream: &FakeUpstream) -> Duration {
    let at = upstream.arrivals();
    *at.last().unwrap() - at[0]
}

#[tokio::test]
async fn a_meter_waits_for_the_estimate_and_gives_back_what_the_response_did_not_cost() {
    let upstream = FakeUpstream::start().await;
    let proxy = llm(&upstream, "").await;
    // Each reserves 210 tokens (0.21 s of the meter) and costs 10: settled, the ten go
    // about 10 ms apart once the first has answered.
    chats(&proxy, &upstream, "/usage/10", 10).await;
    let settled = spread(&upstream);
    assert!(
        settled < Duration::from_millis(1200),
        "ten requests of 10 tokens took {settled:?} at 1,000 tokens a second"
    );
    assert_eq!(
        proxy
            .metric("pacegate_meter_units_total{destination=\"llm~tokens\",group=\"\"}")
            .await,
        100.0
    );
    // Control: a response that says nothing of its cost keeps the estimate, 210 tokens
    // each, reserved before it goes: the schedule puts nine of them 0.21 s apart after the
    // first, though each answer takes longer than that to come. (What the refunds above
    // carried past their last slot, at most about a slot's worth, is spent by the slots
    // after it unless as long passes unused: it has, once 300 ms have.)
    upstream.clear();
    tokio::time::sleep(Duration::from_millis(300)).await;
    chats(&proxy, &upstream, "/status/200?delay=400", 10).await;
    let unsettled = spread(&upstream);
    assert!(
        unsettled >= Duration::from_millis(9 * 210 - 20),
        "ten requests of 210 tokens went within {unsettled:?}"
    );
    assert_eq!(
        proxy
            .metric("pacegate_meter_unsettled_total{destination=\"llm~tokens\",group=\"\",reason=\"no_usage\"}")
            .await,
        10.0
    );
}

#[tokio::test]
async fn a_request_s_wait_for_its_meter_is_told_as_its_wait() {
    let upstream = FakeUpstream::start().await;
    let proxy = llm(&upstream, "").await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    // Chats of 210 tokens at 1,000 a second, one after the other, none settled: each after
    // the first waits about 0.21 s for the meter, where the request budget (100 a second)
    // would hold it 10 ms. What the client is told (and the log line says) is that wait,
    // also for a request to an upstream not yet connected to (https here), whose wait for
    // its first connection is left out, and once only.
    let mut waits = Vec::new();
    for url in [
        upstream.http_url("localhost"),
        upstream.http_url("localhost"),
        upstream.https_url("localhost"),
    ] {
        let resp = via
            .post(format!("{url}/status/200"))
            .body(CHAT)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        waits.push(timing(&resp, "pacegate-wait").expect("a wait told"));
    }
    assert!(waits[0] < 100.0, "the first waited {} ms", waits[0]);
    for (i, wait) in waits.iter().enumerate().skip(1) {
        assert!(
            (150.0..300.0).contains(wait),
            "request {i} waited {wait} ms for 210 tokens"
        );
    }
}

#[tokio::test]
async fn a_stream_is_settled_from_its_last_event_and_one_cut_off_keeps_its_estimate() {
    let upstream = FakeUpstream::start().await;
    let proxy = llm(&upstream, "").await;
    let bodies = chats(&proxy, &upstream, "/usage-stream/10", 10).await;
    // The client reads the stream as the vendor wrote it, usage and all.
    for body in &bodies {
        assert!(body.starts_with("data: {\"choices\":[{\"delta\""), "{body}");
        assert!(
            body.ends_with("\"total_tokens\":10}}\n\ndata: [DONE]\n\n"),
            "{body}"
        );
    }
    let settled = spread(&upstream);
    assert!(
        settled < Duration::from_millis(1200),
        "ten streams of 10 tokens took {settled:?} at 1,000 tokens a second"
    );
    // A stream cut off before its usage: the estimate stands, and it is counted.
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let url = format!("{}/cut-stream/10", upstream.http_url("localhost"));
    let resp = via.post(url).body(CHAT).send().await.unwrap();
    let text = resp.text().await;
    assert!(
        text.is_err(),
        "the client sees the stream cut off: {text:?}"
    );
    support::eventually(Duration::from_secs(5), "the cut stream counted", || async {
        let cut = proxy
            .metric("pacegate_meter_unsettled_total{destination=\"llm~tokens\",group=\"\",reason=\"cut\"}")
            .await;
        (cut == 1.0).then_some(())
    })
    .await;
    assert_eq!(
        proxy
            .metric("pacegate_meter_units_total{destination=\"llm~tokens\",group=\"\"}")
            .await,
        100.0 + 210.0
    );
}

#[tokio::test]
async fn in_shadow_mode_every_request_goes_at_once_and_its_meter_counts_what_it_would_have_waited()
{
    let upstream = FakeUpstream::start().await;
    let proxy = llm(&upstream, "mode = \"shadow\"").await;
    // Five requests of 210 estimated tokens at 1,000 a second, estimates standing (the
    // answers say nothing of their cost): enforcing would have put them 0.21 s apart.
    chats(&proxy, &upstream, "/status/200", 5).await;
    let span = spread(&upstream);
    assert!(
        span < Duration::from_millis(200),
        "five requests in shadow mode went over {span:?}"
    );
    let waits = "pacegate_shadow_wait_seconds_count{destination=\"llm~tokens\",group=\"\"}";
    support::eventually(
        Duration::from_secs(5),
        "each meter's stand-in counted",
        || async { (proxy.metric(waits).await == 5.0).then_some(()) },
    )
    .await;
    // 0 + 0.21 + 0.42 + 0.63 + 0.84 s.
    let waited = proxy
        .metric("pacegate_shadow_wait_seconds_sum{destination=\"llm~tokens\",group=\"\"}")
        .await;
    assert!(
        waited >= 1.9,
        "the meter's stand-ins would have waited {waited:.2} s in all"
    );
}

#[tokio::test]
async fn a_body_larger_than_a_meter_reads_is_refused_whole_before_it_waits() {
    let upstream = FakeUpstream::start().await;
    let proxy = llm(&upstream, "max_body = 100").await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let url = format!("{}/usage/10", upstream.http_url("localhost"));
    let resp = via.post(&url).body("x".repeat(101)).send().await.unwrap();
    assert_eq!(resp.status(), 413);
    let status = resp.headers()["proxy-status"].to_str().unwrap().to_owned();
    assert!(status.contains("max_body"), "{status}");
    assert!(upstream.recorded().is_empty(), "nothing went upstream");
    // One within the bound goes, its body whole.
    let resp = via.post(&url).body("x".repeat(100)).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(upstream.received_bytes(), 100);
}

#[tokio::test]
async fn a_stream_that_did_not_ask_for_usage_is_asked_and_the_client_gets_what_it_would_have() {
    let vendor = FakeLlm::start(1_000_000.0, 1_000_000.0).await;
    let ca = FakeUpstream::start().await;
    let proxy = llm(&ca, "").await;
    let request = r#"{"model":"m","max_tokens":40,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let url = vendor.url();
    let send = |via: reqwest::Client| {
        let url = url.clone();
        async move {
            let resp = via
                .post(url)
                .header("content-type", "application/json")
                .body(request)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            resp.text().await.unwrap()
        }
    };
    let direct = send(client(None, &[], Alpn::Http1)).await;
    let through = send(client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1)).await;
    assert!(!direct.contains("usage"), "{direct}");
    assert_eq!(
        through, direct,
        "the client gets the chunks it would have had"
    );
    let charges = vendor.charges();
    assert!(
        !charges[0].asked_usage && charges[1].asked_usage,
        "{charges:?}"
    );
    // The usage it did not ask for settled the request: the meter counts what it cost.
    support::eventually(Duration::from_secs(5), "the stream settled", || async {
        let units = proxy
            .metric("pacegate_meter_units_total{destination=\"llm~tokens\",group=\"\"}")
            .await;
        (units == charges[1].tokens as f64).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_throttle_the_vendor_puts_down_to_the_token_budget_pauses_that_key_s_meter_only() {
    let upstream = FakeUpstream::start().await;
    let proxy = llm(&upstream, "retry_throttled = 0\nkey = \"json:model\"").await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let base = upstream.http_url("localhost");
    let chat = |model: &str| {
        via.post(format!("{base}/usage/10"))
            .header("content-type", "application/json")
            .body(CHAT.replace("\"m\"", &format!("\"{model}\"")))
    };
    // OpenAI's answer when a model's tokens a minute are spent: a 429, remaining 0, full
    // again in 2 s.
    let spent = format!(
        "{base}/status/429?h=x-ratelimit-remaining-tokens:0&h=x-ratelimit-reset-tokens:2s&h=x-ratelimit-remaining-requests:49"
    );
    let resp = via
        .post(&spent)
        .header("content-type", "application/json")
        .body(CHAT)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429, "the client gets the vendor's answer");
    // The request budget is not widened.
    let requests = proxy.destination("llm").await;
    assert_eq!(requests["backoff"], 1.0, "{requests}");
    assert_eq!(requests["paused_for_seconds"], 0.0, "{requests}");
    // Another model's tokens are its own: its request goes at once.
    let sent = std::time::Instant::now();
    assert_eq!(chat("other").send().await.unwrap().status(), 200);
    let other = sent.elapsed();
    assert!(
        other < Duration::from_millis(1000),
        "another model's request waited {other:?} for the spent model's meter"
    );
    // The spent model's meter pauses for the vendor's 2 s.
    let sent = std::time::Instant::now();
    assert_eq!(chat("m").send().await.unwrap().status(), 200);
    let waited = sent.elapsed();
    assert!(
        waited >= Duration::from_millis(1700) - other,
        "the spent model's next request went {waited:?} after a 2 s reset"
    );
}

#[tokio::test]
async fn a_key_from_the_body_splits_the_requests_and_their_meter_by_model() {
    let upstream = FakeUpstream::start().await;
    let proxy = llm(&upstream, "key = \"json:model\"").await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    // Five requests of 210 tokens for each of two models at once, their estimates standing
    // (the answer says nothing of their cost): each model's meter holds its own five 0.21 s
    // apart, beside the other's.
    let url = format!("{}/status/200?delay=300", upstream.http_url("localhost"));
    let sends: Vec<_> = ["a", "b"]
        .iter()
        .flat_map(|model| std::iter::repeat_n(*model, 5))
        .map(|model| {
            let (via, url) = (via.clone(), url.clone());
            let body = CHAT.replace("\"m\"", &format!("\"{model}\""));
            tokio::spawn(async move {
                let resp = via
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
            })
        })
        .collect();
    for s in sends {
        s.await.unwrap();
    }
    let at = upstream.arrivals();
    let span = *at.last().unwrap() - at[0];
    assert!(
        span >= Duration::from_millis(4 * 210 - 20),
        "five requests of one model's 210 tokens went within {span:?}"
    );
    assert!(
        span < Duration::from_millis(9 * 210 - 100),
        "two models' requests took {span:?}, one after the other, as if they shared a meter"
    );
    let meter = proxy.destination("llm~tokens").await;
    assert_eq!(meter["keys"]["live"], 2, "{meter}");
    assert_eq!(meter["keys"]["key"], "json:model", "{meter}");
}

/// `shop` on localhost at 100 requests a second, with a meter of `points` a second read
/// from Shopify's answers, a query estimated at `default` until it has been settled once.
async fn shop(points: u32, default: u32) -> TestProxy {
    // Its certificate authority is not used: the vendor is plain HTTP.
    let unused = FakeUpstream::start().await;
    let config = format!(
        "[destinations.shop]\nhosts = [\"localhost\"]\nrate = 100\n\
         [destinations.shop.meters.points]\nrate = {points}\ncost = \"shopify-graphql\"\ndefault = {default}\n"
    );
    TestProxy::start(&unused.ca.cert_path, "", &config).await
}

/// Sends `query` to `vendor` through `proxy`, `n` at once; each must be answered 200.
async fn ask(proxy: &TestProxy, vendor: &FakeLlm, query: &str, n: usize) {
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let body = serde_json::json!({ "query": query }).to_string();
    let sends: Vec<_> = (0..n)
        .map(|_| {
            let (via, url, body) = (via.clone(), vendor.url(), body.clone());
            tokio::spawn(async move {
                let resp = via
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                resp.bytes().await.unwrap();
            })
        })
        .collect();
    for s in sends {
        s.await.unwrap();
    }
}

#[tokio::test]
async fn a_query_settled_once_is_estimated_at_what_it_cost_the_next_time() {
    let vendor = FakeLlm::shopify(100_000.0, 100_000.0).await;
    let proxy = shop(100, 100).await;
    const QUERY: &str = "{ products(first: 10) { edges { node { id } } } }";
    // Its first time, the query is estimated at the default, 100 points (a second of the
    // meter), and settled at the 10 it cost.
    ask(&proxy, &vendor, QUERY, 1).await;
    // Five more at once are estimated at 10 each: 0.1 s apart, not a second.
    ask(&proxy, &vendor, QUERY, 5).await;
    let at: Vec<_> = vendor.charges().iter().map(|c| c.at).collect();
    let span = at[5] - at[1];
    assert!(
        span < Duration::from_millis(1000),
        "five queries recalled at 10 points took {span:?} at 100 points a second"
    );
    assert!(
        span >= Duration::from_millis(4 * 100 - 30),
        "five queries of 10 points went within {span:?} at 100 points a second"
    );
}

#[tokio::test]
async fn a_shopify_bucket_said_to_run_low_pauses_the_meter_until_it_refills() {
    // The vendor restores 100 points a second into a bucket of 100; the meter allows ten
    // times that, as a shop's other clients or a wrong rate would leave it.
    let vendor = FakeLlm::shopify(100.0, 100.0).await;
    let proxy = shop(1000, 40).await;
    for _ in 0..6 {
        ask(
            &proxy,
            &vendor,
            "{ products(first: 40) { edges { node { id } } } }",
            1,
        )
        .await;
    }
    let charges = vendor.charges();
    let throttled = charges.iter().filter(|c| c.status == 429).count();
    assert_eq!(
        throttled, 0,
        "the vendor throttled {throttled} of 6 queries: the meter did not wait for its bucket"
    );
    let meter = proxy.destination("shop~points").await;
    assert_eq!(meter["unit"], "points", "{meter}");
}

#[tokio::test]
async fn a_group_s_meter_paces_its_requests_and_no_other() {
    let vendor = FakeLlm::shopify(100_000.0, 100_000.0).await;
    let unused = FakeUpstream::start().await;
    // GitHub's shape: REST calls paced in requests, GraphQL's path in points as well.
    let proxy = TestProxy::start(
        &unused.ca.cert_path,
        "",
        "[destinations.gh]\nhosts = [\"localhost\"]\nrate = 100\n\
         [destinations.gh.groups.graphql]\npaths = [\"/graphql\"]\n\
         [destinations.gh.groups.graphql.meters.points]\nrate = 100\ncost = \"shopify-graphql\"\ndefault = 50\n",
    )
    .await;
    // Three queries of 50 points at once: half a second of the meter each.
    ask(&proxy, &vendor, "{ products(first: 50) { id } }", 3).await;
    let at: Vec<_> = vendor.charges().iter().map(|c| c.at).collect();
    let span = at[2] - at[0];
    assert!(
        span >= Duration::from_millis(2 * 500 - 30),
        "three queries of 50 points went within {span:?} at 100 points a second"
    );
    // Three REST calls at once take no meter's slot: 10 ms apart at 100 a second.
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let rest = vendor.url().replace("/graphql", "/repos/o/r");
    let calls: Vec<_> = (0..3)
        .map(|_| {
            let (via, rest) = (via.clone(), rest.clone());
            tokio::spawn(async move { via.get(rest).send().await.unwrap().status() })
        })
        .collect();
    for c in calls {
        assert_eq!(c.await.unwrap(), 200);
    }
    let at: Vec<_> = vendor.charges().iter().map(|c| c.at).collect();
    let span = at[5] - at[3];
    assert!(
        span < Duration::from_millis(400),
        "three REST calls took {span:?}, as if they waited for the group's meter"
    );
    let meter = proxy.destination("gh/graphql~points").await;
    assert_eq!(meter["unit"], "points", "{meter}");
    assert_eq!(
        proxy
            .metric("pacegate_meter_units_total{destination=\"gh\",group=\"graphql~points\"}")
            .await,
        150.0
    );
}

/// Twelve workers sending chat completions one after the other through `proxy` to `vendor`
/// for `run`; returns how many of the answers were not 200.
async fn twelve_workers(proxy: &TestProxy, vendor: &FakeLlm, run: Duration) -> usize {
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let until = std::time::Instant::now() + run;
    let workers: Vec<_> = (0..12)
        .map(|w| {
            let (via, url) = (via.clone(), vendor.url());
            tokio::spawn(async move {
                let mut failed = 0;
                let body = serde_json::json!({
                    "model": "m",
                    "max_tokens": 300 + w,
                    "messages": [{"role": "user", "content": "x".repeat(1000)}],
                });
                while std::time::Instant::now() < until {
                    let resp = post_json(&via, &url, &body).await;
                    failed += usize::from(resp.status() != 200);
                    resp.bytes().await.unwrap();
                }
                failed
            })
        })
        .collect();
    let mut failed = 0;
    for w in workers {
        failed += w.await.unwrap();
    }
    failed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn where_the_request_rate_binds_a_meter_with_room_never_stalls_the_requests() {
    // Its certificate authority is not used: the vendor is plain HTTP.
    let unused = FakeUpstream::start().await;
    let vendor = FakeLlm::start(1e9, 1e9).await;
    // 50 requests a second bind; the meter's 100,000 tokens a second (about 175 of these
    // requests) never do. Each request's meter slot comes at once, its own up to twelve
    // intervals later: taken first, the meter's would go stale behind the queue each time.
    let config = "[destinations.llm]\nhosts = [\"localhost\"]\nrate = 50\n\
         [destinations.llm.meters.tokens]\nrate = 100000\ncost = \"openai\"\n";
    let proxy = TestProxy::start(&unused.ca.cert_path, "", config).await;
    let run = Duration::from_secs(2);
    let failed = twelve_workers(&proxy, &vendor, run).await;
    assert_eq!(failed, 0);
    let sent = vendor.charges().len();
    // The 2 s at 50 a second, less a margin for a loaded machine.
    assert!(sent >= 70, "{sent} requests went in {run:?} at 50 a second");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_window_in_tokens_is_filled_by_requests_that_wait_for_their_own_rate() {
    let unused = FakeUpstream::start().await;
    let vendor = FakeLlm::quota(12_000.0, Duration::from_secs(2)).await;
    // The quota (about 21 of these requests in 2 s) binds over the window, the request rate
    // within it: a meter slot given back while its request waits leaves the window, or the
    // window fills with slots never used.
    let config = "[destinations.llm]\nhosts = [\"localhost\"]\nrate = 50\n\
         [destinations.llm.meters.tokens]\nrate = 100000\ncost = \"openai\"\n\
         quota = [{ limit = 12000, per = \"2s\" }]\n";
    let proxy = TestProxy::start(&unused.ca.cert_path, "", config).await;
    let failed = twelve_workers(&proxy, &vendor, Duration::from_millis(4500)).await;
    assert_eq!(failed, 0, "the vendor's quota was overrun");
    // Three windows' worth began within the run: at least 15 of each window's 21.
    let sent = vendor.charges().len();
    assert!(sent >= 45, "{sent} requests in three windows of 21");
    // Status counts the window in the meter's unit: the last one holds a few thousand
    // tokens of its 12,000.
    let rows: Vec<pacegate::status::DestinationStatus> =
        serde_json::from_value(proxy.status().await).unwrap();
    let tokens = rows.iter().find(|r| r.destination == "llm~tokens").unwrap();
    let window = &tokens.quota[0];
    assert_eq!((window.window.as_str(), window.limit), ("2s", 12_000));
    assert!(window.used > 1_000, "{window:?}");
    let table = pacegate::status::status_table(&rows);
    assert!(
        table.contains(&format!("{}/12000 tokens per 2s", window.used)),
        "{table}"
    );
}
