//! One fetch for many, counted at the upstream: identical GETs in flight share the first
//! one's response and take no slot; an answer that cannot be shared sends each on its own and
//! is not collapsed again for a while; a leader whose client goes away still serves the
//! others; a slow leader is replaced; `Vary` and credentials keep responses apart. A response
//! kept whole is answered from memory while fresh, fetched again once stale, and what is kept
//! stays within `[cache] memory`.

use crate::support;

use std::time::{Duration, Instant};

use support::{client, Alpn, FakeUpstream, TestProxy};

async fn start(upstream: &FakeUpstream, cache: bool, section: &str) -> TestProxy {
    let config = format!(
        "{section}\n[destinations.images]\nhosts = [\"localhost\"]\nrate = 20\ncache = {cache}\n"
    );
    TestProxy::start(&upstream.ca.cert_path, "", &config).await
}

/// `n` GETs of `url` at once, each with `headers`; their statuses, `Cache-Status` and bodies.
async fn at_once(
    proxy: &TestProxy,
    url: &str,
    n: usize,
    headers: &[(&'static str, &'static str)],
) -> Vec<(u16, String, String)> {
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (via, url) = (via.clone(), url.to_owned());
            let headers = headers.to_vec();
            tokio::spawn(async move {
                let mut req = via.get(url);
                for (k, v) in headers {
                    req = req.header(k, v);
                }
                let r = req.send().await.unwrap();
                let status = r.status().as_u16();
                let cache = r
                    .headers()
                    .get("cache-status")
                    .map(|v| v.to_str().unwrap().to_owned())
                    .unwrap_or_default();
                (status, cache, r.text().await.unwrap())
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

const SECTION: &str = "[cache]\nmemory = \"16MiB\"";

/// Waits until `n` responses were kept: a task of its own keeps one once its body is whole.
async fn kept(proxy: &TestProxy, n: f64) {
    support::eventually(Duration::from_secs(5), "responses kept", || async {
        let stored = proxy
            .metric("pacegate_cache_total{destination=\"images\",result=\"stored\"}")
            .await;
        (stored == n).then_some(())
    })
    .await;
}

#[tokio::test]
async fn identical_gets_in_flight_share_one_fetch_and_without_cache_each_takes_a_slot() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, true, SECTION).await;
    let url = format!(
        "{}/status/200?h=cache-control:max-age=60&delay=300&body=card%20image",
        upstream.http_url("localhost")
    );
    let started = Instant::now();
    let got = at_once(&proxy, &url, 8, &[]).await;
    assert_eq!(upstream.recorded().len(), 1, "one fetch for eight");
    assert!(
        got.iter().all(|(s, _, b)| *s == 200 && b == "card image"),
        "{got:?}"
    );
    let collapsed = got
        .iter()
        .filter(|(_, c, _)| c.ends_with("collapsed"))
        .count();
    assert_eq!(collapsed, 7, "{got:?}");
    assert!(
        got.iter()
            .all(|(_, c, _)| c.starts_with("pacegate; fwd=uri-miss")),
        "{got:?}"
    );
    // Seven slots at 20 a second would have taken 350 ms more than the one fetch.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        proxy
            .metric("pacegate_collapsed_total{destination=\"images\",outcome=\"served\"}")
            .await,
        7.0
    );

    // The control: the same load where responses are not shared.
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, false, SECTION).await;
    let url = format!(
        "{}/status/200?h=cache-control:max-age=60&delay=300",
        upstream.http_url("localhost")
    );
    at_once(&proxy, &url, 8, &[]).await;
    assert_eq!(upstream.recorded().len(), 8);
}

#[tokio::test]
async fn an_answer_that_cannot_be_shared_sends_each_on_its_own_and_is_not_collapsed_again() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, true, SECTION).await;
    let url = format!(
        "{}/status/200?h=cache-control:no-store&delay=200",
        upstream.http_url("localhost")
    );
    let got = at_once(&proxy, &url, 5, &[]).await;
    assert_eq!(upstream.recorded().len(), 5, "each through its own slot");
    assert!(got.iter().all(|(s, _, _)| *s == 200), "{got:?}");
    assert_eq!(
        proxy
            .metric("pacegate_collapsed_total{destination=\"images\",outcome=\"released\"}")
            .await,
        1.0
    );
    // The next burst is not held behind a leader at all: nobody waits for another.
    let got = at_once(&proxy, &url, 3, &[]).await;
    assert_eq!(upstream.recorded().len(), 8);
    assert!(
        got.iter().all(|(_, c, _)| c == "pacegate; fwd=uri-miss"),
        "fetched, none released: {got:?}"
    );
}

#[tokio::test]
async fn a_leader_whose_client_goes_away_still_serves_the_others() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, true, SECTION).await;
    let url = format!(
        "{}/status/200?h=cache-control:max-age=60&delay=800&body=shared",
        upstream.http_url("localhost")
    );
    let impatient = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(proxy.url()).unwrap())
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let leader = {
        let url = url.clone();
        tokio::spawn(async move { impatient.get(url).send().await })
    };
    // The waiter comes once the leader is on its way.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let got = at_once(&proxy, &url, 1, &[]).await;
    assert!(
        leader.await.unwrap().is_err(),
        "the leader's client gave up"
    );
    assert_eq!(got[0].0, 200);
    assert_eq!(got[0].2, "shared");
    assert_eq!(
        upstream.recorded().len(),
        1,
        "the leader's fetch went on for the waiter"
    );
}

#[tokio::test]
async fn a_leader_with_no_answer_within_the_bound_is_replaced_by_a_waiter() {
    let upstream = FakeUpstream::start().await;
    let section = "[cache]\nmemory = \"16MiB\"\nlead_timeout = \"400ms\"";
    let proxy = start(&upstream, true, section).await;
    let url = format!(
        "{}/status/200?h=cache-control:max-age=60&delay=1500",
        upstream.http_url("localhost")
    );
    let got = at_once(&proxy, &url, 2, &[]).await;
    assert!(got.iter().all(|(s, _, _)| *s == 200), "{got:?}");
    assert_eq!(
        upstream.recorded().len(),
        2,
        "the waiter went in the slow leader's place"
    );
    assert_eq!(
        proxy
            .metric("pacegate_collapsed_total{destination=\"images\",outcome=\"took_over\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn vary_and_credentials_keep_responses_apart() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, true, SECTION).await;
    let base = upstream.http_url("localhost");
    // Varies by language: only the requests in the leader's language share its answer.
    let url =
        format!("{base}/status/200?h=cache-control:max-age=60&h=vary:accept-language&delay=300");
    let (en, de) = tokio::join!(
        at_once(&proxy, &url, 3, &[("accept-language", "en")]),
        async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            at_once(&proxy, &url, 2, &[("accept-language", "de")]).await
        }
    );
    assert!(en.iter().chain(&de).all(|(s, _, _)| *s == 200));
    assert_eq!(
        upstream.recorded().len(),
        3,
        "one for the English three, one for each German request: {en:?} {de:?}"
    );
    // With credentials, only an answer that says it may be shared is shared.
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, true, SECTION).await;
    let private = format!(
        "{}/status/200?h=cache-control:max-age=60&delay=300",
        upstream.http_url("localhost")
    );
    at_once(&proxy, &private, 3, &[("authorization", "Bearer a")]).await;
    assert_eq!(
        upstream.recorded().len(),
        3,
        "max-age alone is not for others"
    );
    let public = format!(
        "{}/status/200?h=cache-control:public,%20max-age=60&delay=300",
        upstream.http_url("localhost")
    );
    at_once(&proxy, &public, 3, &[("authorization", "Bearer a")]).await;
    assert_eq!(upstream.recorded().len(), 4, "public: one fetch for three");
}

#[tokio::test]
async fn a_fresh_response_is_answered_from_memory_and_takes_no_slot() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, true, SECTION).await;
    let url = format!(
        "{}/status/200?h=cache-control:max-age=60&body=card%20image",
        upstream.http_url("localhost")
    );
    let first = at_once(&proxy, &url, 1, &[]).await;
    assert_eq!(first[0].1, "pacegate; fwd=uri-miss; stored");
    // Kept once its body is whole (a task of its own finishes it): the next ones are hits.
    kept(&proxy, 1.0).await;
    let started = Instant::now();
    let again = at_once(&proxy, &url, 6, &[]).await;
    assert!(
        again
            .iter()
            .all(|(s, c, b)| *s == 200 && c == "pacegate; hit" && b == "card image"),
        "{again:?}"
    );
    assert_eq!(
        upstream.recorded().len(),
        1,
        "nothing more reached the vendor"
    );
    // Six slots at 20 a second would take 250 ms at the least.
    assert!(
        started.elapsed() < Duration::from_millis(250),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        proxy
            .metric("pacegate_cache_total{destination=\"images\",result=\"hit\"}")
            .await,
        6.0
    );

    // The control: an answer that may not be kept is fetched every time.
    let url = format!(
        "{}/status/200?h=cache-control:no-store",
        upstream.http_url("localhost")
    );
    for _ in 0..3 {
        at_once(&proxy, &url, 1, &[]).await;
    }
    assert_eq!(upstream.recorded().len(), 4);
}

#[tokio::test]
async fn a_stale_response_is_fetched_again_and_kept_in_its_place() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, true, SECTION).await;
    let url = format!(
        "{}/status/200?h=cache-control:max-age=1",
        upstream.http_url("localhost")
    );
    at_once(&proxy, &url, 1, &[]).await;
    // max-age is in whole seconds: past it, the entry is stale.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let stale = at_once(&proxy, &url, 1, &[]).await;
    assert_eq!(stale[0].1, "pacegate; fwd=stale; stored", "{stale:?}");
    assert_eq!(upstream.recorded().len(), 2);
    support::eventually(
        Duration::from_secs(5),
        "a hit on the fresh copy",
        || async { (at_once(&proxy, &url, 1, &[]).await[0].1 == "pacegate; hit").then_some(()) },
    )
    .await;
    assert_eq!(upstream.recorded().len(), 2, "the fresh copy answered");
}

#[tokio::test]
async fn what_is_kept_stays_within_memory_and_a_response_asked_for_often_stays_kept() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, true, "[cache]\nmemory = \"32KiB\"").await;
    let url = |i: usize| {
        format!(
            "{}/bytes/3000?h=cache-control:max-age=60&i={i}",
            upstream.http_url("localhost")
        )
    };
    // The hot one: fetched once, then asked for again and again.
    at_once(&proxy, &url(0), 1, &[]).await;
    kept(&proxy, 1.0).await;
    for _ in 0..3 {
        assert_eq!(at_once(&proxy, &url(0), 1, &[]).await[0].1, "pacegate; hit");
    }
    // Seven more of 3 KB each (7 KiB with what an entry holds besides): 32 KiB cannot
    // hold them all.
    for i in 1..8 {
        at_once(&proxy, &url(i), 1, &[]).await;
    }
    kept(&proxy, 8.0).await;
    let bytes = proxy.metric("pacegate_cache_bytes{tier=\"memory\"}").await;
    assert!(bytes > 0.0 && bytes <= 32768.0, "{bytes} bytes kept");
    assert_eq!(
        at_once(&proxy, &url(0), 1, &[]).await[0].1,
        "pacegate; hit",
        "the response asked for often was kept"
    );
    assert_eq!(upstream.recorded().len(), 8);
    for i in 1..8 {
        at_once(&proxy, &url(i), 1, &[]).await;
    }
    assert!(
        upstream.recorded().len() > 8,
        "the others did not all fit: some were evicted and fetched again"
    );
}

#[tokio::test]
async fn fifty_workers_fetching_ten_images_five_times_each_cost_ten_slots() {
    /// Ten image URLs, five requests each, all at once, over two keep-alive pools: each
    /// request's URL index and the body it got.
    async fn fifty(proxy: &TestProxy, base: &str) -> Vec<(usize, String)> {
        let pools = [
            client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1),
            client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1),
        ];
        let tasks: Vec<_> = (0..50)
            .map(|n| {
                let (via, i) = (pools[n % 2].clone(), n % 10);
                let url = format!(
                    "{base}/status/200?h=cache-control:max-age=60&delay=200&body=image%20{i}"
                );
                tokio::spawn(async move {
                    (i, via.get(url).send().await.unwrap().text().await.unwrap())
                })
            })
            .collect();
        let mut got = Vec::new();
        for t in tasks {
            got.push(t.await.unwrap());
        }
        got
    }
    let granted = "pacegate_granted_total{class=\"default\",destination=\"images\",group=\"\"}";
    let upstream = FakeUpstream::start().await;
    let config = "[cache]\nmemory = \"16MiB\"\n[destinations.images]\nhosts = [\"localhost\"]\nrate = 7\ncache = true\n";
    let proxy = TestProxy::start(&upstream.ca.cert_path, "", config).await;
    let got = fifty(&proxy, &upstream.http_url("localhost")).await;
    assert!(
        got.iter().all(|(i, body)| *body == format!("image {i}")),
        "every client the right bytes"
    );
    assert_eq!(upstream.recorded().len(), 10, "one fetch per image");
    assert_eq!(proxy.metric(granted).await, 10.0, "ten slots");
    // The same again while fresh: answered from memory, nothing reaches the vendor.
    kept(&proxy, 10.0).await;
    let again = fifty(&proxy, &upstream.http_url("localhost")).await;
    assert!(again.iter().all(|(i, body)| *body == format!("image {i}")));
    assert_eq!(upstream.recorded().len(), 10, "no arrival while fresh");
    // What status says it saved: forty of the first fifty, all of the next.
    let cache = proxy.destination("images").await["cache"].clone();
    assert_eq!(cache["requests"], 100, "{cache}");
    assert_eq!(cache["slots_saved"], 90, "{cache}");
    assert_eq!(cache["hits"], 50, "{cache}");
    assert_eq!(cache["collapsed"], 40, "{cache}");
    assert!((cache["hit_ratio"].as_f64().unwrap() - 0.9).abs() < 1e-9);
    assert_eq!(
        proxy
            .metric("pacegate_slots_saved_total{destination=\"images\"}")
            .await,
        90.0
    );
    let rows: Vec<pacegate::status::DestinationStatus> =
        serde_json::from_value(proxy.status().await).unwrap();
    let table = pacegate::status::status_table(&rows);
    assert!(
        table.contains(
            "images: CACHE: 90% of 100 requests took no slot (90 saved: 50 hits, 40 collapsed)"
        ),
        "{table}"
    );

    // The control: without `cache`, fifty arrivals.
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::start(
        &upstream.ca.cert_path,
        "",
        &config.replace("cache = true", "cache = false"),
    )
    .await;
    fifty(&proxy, &upstream.http_url("localhost")).await;
    assert_eq!(upstream.recorded().len(), 50);
    assert_eq!(
        proxy.destination("images").await["cache"],
        serde_json::Value::Null,
        "nothing looked up, nothing said"
    );
}

#[tokio::test]
async fn a_stale_entry_the_vendor_says_has_not_changed_is_served_from_memory() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, true, SECTION).await;
    // An entity fresh for a second, tagged: asked with its tag, the vendor answers 304.
    let url = format!("{}/etag/v1", upstream.http_url("localhost"));
    let first = at_once(&proxy, &url, 1, &[]).await;
    assert_eq!(first[0].2, "entity v1\n");
    kept(&proxy, 1.0).await;
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let again = at_once(&proxy, &url, 1, &[]).await;
    assert_eq!(
        again[0].0, 200,
        "the client asked for the entity, not a 304"
    );
    assert_eq!(
        again[0].1, "pacegate; fwd=stale; fwd-status=304",
        "{again:?}"
    );
    assert_eq!(again[0].2, "entity v1\n", "the kept body");
    let asked = upstream.recorded();
    assert_eq!(asked.len(), 2, "revalidated through a slot");
    assert_eq!(
        asked[1]
            .headers
            .get("if-none-match")
            .map(|v| v.to_str().unwrap()),
        Some("\"v1\""),
        "asked on its tag"
    );
    // Refreshed: fresh again for a second.
    assert_eq!(at_once(&proxy, &url, 1, &[]).await[0].1, "pacegate; hit");
    assert_eq!(upstream.recorded().len(), 2);
    assert_eq!(
        proxy
            .metric("pacegate_cache_total{destination=\"images\",result=\"revalidated\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn each_variant_a_response_varies_by_is_kept_apart() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, true, SECTION).await;
    let url = format!(
        "{}/status/200?h=cache-control:max-age=60&h=vary:accept-encoding",
        upstream.http_url("localhost")
    );
    let gzip = [("accept-encoding", "gzip")];
    let identity = [("accept-encoding", "identity")];
    at_once(&proxy, &url, 1, &gzip).await;
    kept(&proxy, 1.0).await;
    assert_ne!(
        at_once(&proxy, &url, 1, &identity).await[0].1,
        "pacegate; hit"
    );
    kept(&proxy, 2.0).await;
    // Both kept: each client's next request is answered from memory.
    assert_eq!(at_once(&proxy, &url, 1, &gzip).await[0].1, "pacegate; hit");
    assert_eq!(
        at_once(&proxy, &url, 1, &identity).await[0].1,
        "pacegate; hit"
    );
    assert_eq!(upstream.recorded().len(), 2, "one fetch per variant");
}

/// `n` cacheable URLs (fresh for ten minutes), each answering `image {i}`.
fn images(upstream: &FakeUpstream, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            format!(
                "{}/status/200?body=image%20{i}&h=cache-control:max-age=600",
                upstream.http_url("localhost")
            )
        })
        .collect()
}

/// The entry files in a disk tier's directory.
fn files_in(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|f| f.as_ref().unwrap().file_type().unwrap().is_file())
        .count()
}

/// A `[cache]` of 16 MiB in memory, with a disk tier in `dir`.
fn with_disk(dir: &std::path::Path) -> String {
    format!("[cache]\nmemory = \"16MiB\"\ndir = \"{}\"", dir.display())
}

/// `n` GETs of `url` at once; each one's status and body, or the error that cut it.
async fn bodies_at_once(
    proxy: &TestProxy,
    url: &str,
    n: usize,
) -> Vec<Result<(u16, Vec<u8>), String>> {
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (via, url) = (via.clone(), url.to_owned());
            tokio::spawn(async move {
                let r = via.get(url).send().await.map_err(|e| e.to_string())?;
                let status = r.status().as_u16();
                let body = r.bytes().await.map_err(|e| format!("{e:?}"))?;
                Ok((status, body.to_vec()))
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// The fake upstream's bytes 0..n.
fn pattern_bytes(n: u64) -> Vec<u8> {
    (0..n).map(support::upstream::pattern).collect()
}

#[tokio::test]
async fn a_body_cut_mid_way_is_fetched_again_for_every_reader_and_never_given_short() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, true, SECTION).await;
    let n = 300_000;
    let url = format!(
        "{}/cut/{n}/card?h=cache-control:max-age=60",
        upstream.http_url("localhost")
    );
    let got = bodies_at_once(&proxy, &url, 5).await;
    let whole = pattern_bytes(n);
    for result in &got {
        let (status, body) = result.as_ref().unwrap_or_else(|e| panic!("cut: {e}"));
        assert_eq!(*status, 200);
        assert!(body == &whole, "{} bytes, not the entity's", body.len());
    }
    assert_eq!(
        upstream.recorded().len(),
        2,
        "the cut fetch and one more, for all five"
    );
    assert_eq!(
        proxy
            .metric("pacegate_collapsed_total{destination=\"images\",outcome=\"resumed\"}")
            .await,
        1.0
    );
    kept(&proxy, 1.0).await;

    // The control: an entity with no validator cannot be told from another, so it is not
    // pieced together: every reader is cut, none given a short body as whole.
    let url = format!(
        "{}/cut/{n}/plain?h=cache-control:max-age=60&etag=0",
        upstream.http_url("localhost")
    );
    let got = bodies_at_once(&proxy, &url, 5).await;
    assert!(
        got.iter().all(Result::is_err),
        "{:?}",
        got.iter()
            .map(|r| r.as_ref().map(|(s, b)| (*s, b.len())))
            .collect::<Vec<_>>()
    );
    assert_eq!(upstream.recorded().len(), 3);
}

#[tokio::test]
async fn an_object_past_max_object_streams_to_every_waiter_and_is_not_kept() {
    let upstream = FakeUpstream::start().await;
    let section = "[cache]\nmemory = \"4MiB\"\nmax_object = \"256KiB\"";
    let proxy = start(&upstream, true, section).await;
    let n: u64 = 16 << 20;
    let url = format!(
        "{}/gated/{n}?h=cache-control:max-age=60",
        upstream.http_url("localhost")
    );
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let mut responses = Vec::new();
    for _ in 0..4 {
        responses.push(tokio::spawn(via.get(&url).send()));
    }
    // All four are in: the leader's body waits at the gate after its first chunk.
    support::eventually(Duration::from_secs(5), "three waiters", || async {
        let waiting = proxy
            .metric("pacegate_collapsed_total{destination=\"images\",outcome=\"served\"}")
            .await;
        (waiting == 3.0).then_some(())
    })
    .await;
    let mut responses: Vec<reqwest::Response> = {
        let mut out = Vec::new();
        for r in responses {
            out.push(r.await.unwrap().unwrap());
        }
        out
    };
    upstream.release();
    // Three read on; one reads nothing for a while: the body waits for it, not memory.
    let slow = responses.pop().unwrap();
    let readers: Vec<_> = responses
        .into_iter()
        .map(|r| tokio::spawn(async move { r.bytes().await.unwrap() }))
        .collect();
    // Watched for two seconds, long enough for the vendor to send it all.
    let mut most = 0f64;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        most = most.max(proxy.metric("pacegate_cache_bytes{tier=\"flight\"}").await);
    }
    assert!(
        most < (3 << 20) as f64,
        "{most} bytes held in flight for a {n}-byte object"
    );
    assert!(most > 0.0, "the gauge is read while the body is held");
    let whole = pattern_bytes(n);
    let slow = slow.bytes().await.unwrap();
    assert!(slow == whole, "the slow reader got {} bytes", slow.len());
    for r in readers {
        assert!(r.await.unwrap() == whole);
    }
    assert_eq!(upstream.recorded().len(), 1, "one fetch for the four");
    assert_eq!(
        proxy
            .metric("pacegate_cache_total{destination=\"images\",result=\"stored\"}")
            .await,
        0.0,
        "too large to keep"
    );
    // Not kept: the next request fetches it again.
    let again = bodies_at_once(&proxy, &url.replace("gated", "bytes"), 1).await;
    assert_eq!(again[0].as_ref().unwrap().1.len() as u64, n);
    assert_eq!(upstream.recorded().len(), 2);
}

#[tokio::test]
async fn waiters_on_an_answer_that_cannot_be_shared_go_at_its_head_not_its_end() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, true, SECTION).await;
    let url = format!(
        "{}/gated/1000000?h=cache-control:no-store",
        upstream.http_url("localhost")
    );
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let requests: Vec<_> = (0..5).map(|_| tokio::spawn(via.get(&url).send())).collect();
    // Every body waits at the gate after its first chunk: all five reached the vendor while
    // the first one's body was still unfinished.
    support::eventually(Duration::from_secs(5), "five arrivals", || async {
        (upstream.recorded().len() == 5).then_some(())
    })
    .await;
    let arrivals = upstream.arrivals();
    upstream.release();
    for r in requests {
        let r = r.await.unwrap().unwrap();
        assert_eq!(r.bytes().await.unwrap().len(), 1_000_000);
    }
    // Each took its own slot, at 20 a second.
    let mut arrivals = arrivals;
    arrivals.sort();
    let span = *arrivals.last().unwrap() - arrivals[0];
    assert!(span >= Duration::from_millis(150), "paced: {span:?}");
}

#[tokio::test]
async fn the_disk_tier_keeps_its_hits_across_a_restart_and_a_damaged_file_is_a_miss() {
    let upstream = FakeUpstream::start().await;
    let cache = tempfile::tempdir().unwrap();
    let proxy = start(&upstream, true, &with_disk(cache.path())).await;
    let urls = images(&upstream, 4);
    for url in &urls {
        at_once(&proxy, url, 1, &[]).await;
    }
    kept(&proxy, 4.0).await;
    support::eventually(Duration::from_secs(5), "four files", || async {
        (files_in(cache.path()) == 4).then_some(())
    })
    .await;
    let proxy = proxy.restart().await;
    for (i, url) in urls.iter().enumerate() {
        let got = at_once(&proxy, url, 1, &[]).await;
        assert_eq!(got[0].1, "pacegate; hit", "{url}");
        assert_eq!(got[0].2, format!("image {i}"));
    }
    assert_eq!(
        upstream.recorded().len(),
        4,
        "every hit survived the restart"
    );

    // A file damaged while pacegate was down: a miss, fetched again, never an error.
    let mut proxy = proxy;
    proxy.stop().await;
    for file in std::fs::read_dir(cache.path()).unwrap() {
        let path = file.unwrap().path();
        if path.is_file() {
            let mut bytes = std::fs::read(&path).unwrap();
            let at = bytes.len() / 2;
            bytes[at] ^= 0x5a;
            std::fs::write(&path, bytes).unwrap();
        }
    }
    let proxy = TestProxy::start_in(std::mem::replace(
        &mut proxy.dir,
        tempfile::tempdir().unwrap(),
    ))
    .await;
    let got = at_once(&proxy, &urls[0], 1, &[]).await;
    assert_eq!(got[0].0, 200);
    assert_eq!(got[0].1, "pacegate; fwd=uri-miss; stored");
    assert_eq!(got[0].2, "image 0");
    assert_eq!(upstream.recorded().len(), 5);
}

#[tokio::test]
async fn a_purge_removes_a_url_or_a_destination_from_memory_and_disk() {
    let upstream = FakeUpstream::start().await;
    let cache = tempfile::tempdir().unwrap();
    let proxy = start(&upstream, true, &with_disk(cache.path())).await;
    let urls = images(&upstream, 3);
    for url in &urls {
        at_once(&proxy, url, 1, &[]).await;
    }
    kept(&proxy, 3.0).await;
    let admin = support::admin_client();
    let purge = |query: String| {
        let admin = admin.clone();
        let at = proxy.admin;
        async move {
            let r = admin
                .post(format!("http://{at}/cache/purge?{query}"))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (
                status,
                serde_json::from_str::<serde_json::Value>(&r.text().await.unwrap()).ok(),
            )
        }
    };
    let encoded: String = urls[0]
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    let (status, body) = purge(format!("url={encoded}")).await;
    assert_eq!(status, 200);
    assert_eq!(body.unwrap()["purged"], 1);
    let got = at_once(&proxy, &urls[0], 1, &[]).await;
    assert_eq!(
        got[0].1, "pacegate; fwd=uri-miss; stored",
        "purged: fetched again"
    );
    let got = at_once(&proxy, &urls[1], 1, &[]).await;
    assert_eq!(got[0].1, "pacegate; hit", "the others stay");
    kept(&proxy, 4.0).await;
    let (status, body) = purge("destination=images".into()).await;
    assert_eq!(status, 200);
    assert_eq!(body.unwrap()["purged"], 3);
    let got = at_once(&proxy, &urls[2], 1, &[]).await;
    assert_eq!(got[0].1, "pacegate; fwd=uri-miss; stored");
    // Not on disk either: a restart brings none back but the one fetched since.
    let proxy = proxy.restart().await;
    let got = at_once(&proxy, &urls[1], 1, &[]).await;
    assert_eq!(got[0].1, "pacegate; fwd=uri-miss; stored");
    // A write from another site's page is refused.
    let r = support::admin_client()
        .post(format!(
            "http://{}/cache/purge?destination=images",
            proxy.admin
        ))
        .header("origin", "https://evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403);
}

#[tokio::test]
async fn a_write_the_disk_refuses_drops_the_entry_from_disk_and_the_client_has_its_response() {
    let upstream = FakeUpstream::start().await;
    let cache = tempfile::tempdir().unwrap();
    let proxy = start(&upstream, true, &with_disk(cache.path())).await;
    // Where each file is written before it is renamed into place: no longer a directory, so
    // every write fails, as on a full disk.
    let tmp = cache.path().join("tmp");
    std::fs::remove_dir_all(&tmp).unwrap();
    std::fs::write(&tmp, b"in the way").unwrap();
    let url = format!(
        "{}/status/200?body=kept%20in%20memory&h=cache-control:max-age=600",
        upstream.http_url("localhost")
    );
    let got = at_once(&proxy, &url, 1, &[]).await;
    assert_eq!((got[0].0, got[0].2.as_str()), (200, "kept in memory"));
    support::eventually(
        Duration::from_secs(5),
        "the failed write counted",
        || async {
            let unwritten = proxy
                .metric("pacegate_cache_total{destination=\"images\",result=\"unwritten\"}")
                .await;
            (unwritten == 1.0).then_some(())
        },
    )
    .await;
    let files: Vec<_> = std::fs::read_dir(cache.path())
        .unwrap()
        .map(|f| f.unwrap().file_name())
        .collect();
    assert_eq!(files, ["tmp"], "no entry on disk");
    // Memory still holds it.
    let again = at_once(&proxy, &url, 1, &[]).await;
    assert_eq!(again[0].1, "pacegate; hit");
    assert_eq!(upstream.recorded().len(), 1);
}

#[tokio::test]
async fn a_reload_that_changes_the_cache_keeps_what_it_can() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, true, "[cache]\nmemory = \"16MiB\"").await;
    let urls = images(&upstream, 3);
    for url in &urls {
        at_once(&proxy, url, 1, &[]).await;
    }
    kept(&proxy, 3.0).await;
    // A disk tier added, and memory halved.
    let cache = tempfile::tempdir().unwrap();
    let file = proxy.dir.path().join(support::CONFIG_FILE);
    let text = std::fs::read_to_string(&file).unwrap().replace(
        "memory = \"16MiB\"",
        &format!("memory = \"8MiB\"\ndir = \"{}\"", cache.path().display()),
    );
    std::fs::write(&file, text).unwrap();
    let reload = |proxy: &TestProxy| {
        let at = proxy.admin;
        async move {
            let r = support::admin_client()
                .post(format!("http://{at}/reload"))
                .send()
                .await
                .unwrap();
            serde_json::from_str::<serde_json::Value>(&r.text().await.unwrap()).unwrap()
        }
    };
    let status = reload(&proxy).await;
    assert_eq!(status["result"], "ok", "{status}");
    let applied = status["applied"].to_string();
    assert!(
        applied.contains("cache.memory") && applied.contains("cache.dir"),
        "{status}"
    );
    assert_eq!(status["needs_restart"], serde_json::json!([]), "{status}");
    // What was kept is still kept.
    for (i, url) in urls.iter().enumerate() {
        let got = at_once(&proxy, url, 1, &[]).await;
        assert_eq!(
            (got[0].1.as_str(), got[0].2.clone()),
            ("pacegate; hit", format!("image {i}"))
        );
    }
    // What is kept from now on is written to the new disk tier too.
    let url = format!(
        "{}/status/200?body=new&h=cache-control:max-age=600",
        upstream.http_url("localhost")
    );
    at_once(&proxy, &url, 1, &[]).await;
    support::eventually(Duration::from_secs(5), "a file in the new dir", || async {
        (files_in(cache.path()) == 1).then_some(())
    })
    .await;
    assert_eq!(upstream.recorded().len(), 4);
    // A dir that cannot be written refuses the reload, and names it.
    let blocker = cache.path().join("a-file");
    std::fs::write(&blocker, b"x").unwrap();
    let text = std::fs::read_to_string(&file).unwrap().replace(
        &cache.path().display().to_string(),
        &blocker.join("cache").display().to_string(),
    );
    std::fs::write(&file, text).unwrap();
    let status = reload(&proxy).await;
    assert_eq!(status["result"], "error", "{status}");
    assert!(
        status["problems"].to_string().contains("a-file"),
        "{status}"
    );
    let got = at_once(&proxy, &urls[0], 1, &[]).await;
    assert_eq!(got[0].1, "pacegate; hit", "the running cache stays");
}
