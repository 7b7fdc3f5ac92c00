//! Budgets split by key, across real OS processes: two `pacegate serve` instances on one
//! Postgres keep one budget per token or per host, each shared by both, so that no key waits
//! for another; a lockout still halts every key, a throttle only its own; `max_keys` refuses
//! a new key and `key_idle` makes room again, here and in the store; no credential is kept,
//! shown or logged as it came. Each control is the destination as one budget.

use crate::support;

use std::time::{Duration, Instant};

use support::fleet::{alone, arrivals_of, Fleet};
use support::{admin_get, busiest, eventually, testdb, FakeUpstream};

/// The tokens: what follows `Bearer ` must never show outside the requests.
const TOKENS: [&str; 2] = ["tok-one-SECRETVALUE", "tok-two-SECRETVALUE"];

/// Two instances on a fresh database, destination `local` with `keys`.
async fn two_instances(keys: &str) -> Fleet {
    Fleet::start_n(2, &postgres(&testdb::fresh().await), keys).await
}

fn postgres(url: &str) -> String {
    format!("[store]\nbackend = \"postgres\"\nurl = \"{url}\"\n")
}

/// Through each instance at once: `per` requests with each of [`TOKENS`], to `/tN/...`.
/// Returns each token's arrivals.
async fn with_tokens(fleet: &Fleet, upstream: &FakeUpstream, per: usize) -> Vec<Vec<Instant>> {
    let base = upstream.http_url("localhost");
    let mut tasks = Vec::new();
    for i in 0..2 {
        for (t, token) in TOKENS.iter().enumerate() {
            for k in 0..per {
                let (via, url) = (fleet.client(i), format!("{base}/t{t}/{i}/{k}"));
                let bearer = format!("Bearer {token}");
                tasks.push(tokio::spawn(async move {
                    via.get(url)
                        .header("authorization", bearer)
                        .send()
                        .await
                        .unwrap()
                        .status()
                }));
            }
        }
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    (0..TOKENS.len())
        .map(|t| arrivals_of(upstream, &format!("t{t}")))
        .collect()
}

fn span(at: &[Instant]) -> Duration {
    *at.iter().max().unwrap() - *at.iter().min().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tokens_each_keep_their_own_budget_over_both_instances_and_stay_secret() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = two_instances("rate = 2\nkey = \"header:authorization\"").await;
    let tokens = with_tokens(&fleet, &upstream, 3).await;
    for (t, at) in tokens.iter().enumerate() {
        // 6 requests per token at 2/s over both instances: a slot every 500 ms, 2.5 s.
        assert!(
            busiest(at, Duration::from_secs(1)) <= 3,
            "token {t}: {}",
            fleet.explain(&upstream)
        );
        assert!(
            span(at) >= Duration::from_millis(2200),
            "token {t}: {:?}",
            span(at)
        );
    }
    // Side by side, not one after the other (which takes 5.5 s, as the control shows).
    let all: Vec<Instant> = tokens.concat();
    assert!(
        span(&all) < Duration::from_millis(4500),
        "both tokens took {:?}; {}",
        span(&all),
        fleet.explain(&upstream)
    );
    // No instance keeps, shows or logs a token: only its keyed hash, the same on both.
    let mut shown = Vec::new();
    for (i, instance) in fleet.instances.iter().enumerate() {
        let status = fleet.status(i).await;
        assert_eq!(status["keys"]["live"], 2, "instance {i}: {status}");
        let mut keys: Vec<String> = status["keys"]["top"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["key"].as_str().unwrap().to_owned())
            .collect();
        keys.sort();
        shown.push(keys);
        let everything = [
            admin_get(instance.admin, "/metrics").await,
            admin_get(instance.admin, "/status").await,
            admin_get(instance.admin, "/").await,
            serde_json::to_string(&instance.logs.json()).unwrap(),
        ];
        for text in everything {
            assert!(
                !text.contains("SECRETVALUE"),
                "instance {i} shows a token: {text}"
            );
        }
    }
    assert_eq!(shown[0], shown[1], "both instances name the keys alike");
    assert!(shown[0].iter().all(|k| k.len() == 16), "{shown:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_without_keys_the_second_token_waits_for_the_first() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = two_instances("rate = 2").await;
    let all = with_tokens(&fleet, &upstream, 3).await.concat();
    assert!(
        span(&all) >= Duration::from_secs(5),
        "12 requests on one budget at 2/s took only {:?}",
        span(&all)
    );
}

/// Three upstreams on three loopback addresses, one destination over all three.
async fn three_hosts(keys: &str) -> (Fleet, Vec<FakeUpstream>) {
    let mut upstreams = Vec::new();
    for ip in ["127.0.0.1", "127.0.0.2", "127.0.0.3"] {
        upstreams.push(FakeUpstream::start_on(ip, true).await);
    }
    let fleet = two_instances(&format!(
        "rate = 1\n[destinations.hosts]\nhosts = [\"127.0.0.1\", \"127.0.0.2\", \"127.0.0.3\"]\nrate = 4\n{keys}"
    ))
    .await;
    (fleet, upstreams)
}

/// Through each instance at once: 3 requests to each host. Returns every host's arrivals.
async fn to_each_host(fleet: &Fleet, upstreams: &[FakeUpstream]) -> Vec<Vec<Instant>> {
    let mut tasks = Vec::new();
    for i in 0..2 {
        for (h, upstream) in upstreams.iter().enumerate() {
            let ip = upstream.http.ip().to_string();
            for k in 0..3 {
                let (via, url) = (
                    fleet.client(i),
                    format!("{}/h{h}/{i}/{k}", upstream.http_url(&ip)),
                );
                tasks.push(tokio::spawn(async move {
                    via.get(url).send().await.unwrap().status()
                }));
            }
        }
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    upstreams
        .iter()
        .map(|u| {
            let mut at = u.arrivals();
            at.sort();
            at
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_each_keep_their_own_pace() {
    let _alone = alone().await;
    let (fleet, upstreams) = three_hosts("key = \"host\"").await;
    let hosts = to_each_host(&fleet, &upstreams).await;
    for (h, at) in hosts.iter().enumerate() {
        assert_eq!(at.len(), 6);
        // 6 requests per host at 4/s over both instances: 1.25 s.
        assert!(busiest(at, Duration::from_secs(1)) <= 5, "host {h}: {at:?}");
        assert!(
            span(at) >= Duration::from_millis(1000),
            "host {h}: {:?}",
            span(at)
        );
    }
    let all = hosts.concat();
    assert!(
        span(&all) < Duration::from_secs(3),
        "three hosts took {:?} (one budget takes 4.25 s)",
        span(&all)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_without_keys_three_hosts_wait_for_each_other() {
    let _alone = alone().await;
    let (fleet, upstreams) = three_hosts("").await;
    let all = to_each_host(&fleet, &upstreams).await.concat();
    assert!(
        span(&all) >= Duration::from_millis(3500),
        "18 requests on one budget at 4/s took only {:?}",
        span(&all)
    );
}

/// A GET of `path` with token `token` through instance `i`: its status and `Proxy-Status`.
async fn get(
    fleet: &Fleet,
    upstream: &FakeUpstream,
    i: usize,
    token: &str,
    path: &str,
) -> (u16, String) {
    let resp = fleet
        .client(i)
        .get(format!("{}/{path}", upstream.http_url("localhost")))
        .header("authorization", format!("Bearer {token}"))
        .send()
        .await
        .unwrap();
    let proxy_status = resp
        .headers()
        .get("proxy-status")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (resp.status().as_u16(), proxy_status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockout_halts_every_key_on_every_instance_and_a_throttle_only_its_own() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet =
        two_instances("rate = 20\nkey = \"header:authorization\"\nretry_throttled = 0").await;
    // The control first: a throttle with a long Retry-After pauses its own key only.
    let (status, _) = get(&fleet, &upstream, 0, "a", "status/429?h=Retry-After:30").await;
    assert_eq!(status, 429);
    assert_eq!(
        get(&fleet, &upstream, 1, "b", "b-goes").await.0,
        200,
        "b is not paused"
    );
    let waiting_a = {
        let via = fleet.client(1);
        let url = format!("{}/a-paused", upstream.http_url("localhost"));
        tokio::spawn(async move {
            via.get(url)
                .header("authorization", "Bearer a")
                .timeout(Duration::from_millis(1500))
                .send()
                .await
        })
    };
    assert!(waiting_a.await.unwrap().is_err(), "a waits out its pause");
    assert!(arrivals_of(&upstream, "a-paused").is_empty());

    // A 403 to one key locks the destination out: every key, on every instance, however new.
    assert_eq!(get(&fleet, &upstream, 0, "b", "status/403").await.0, 403);
    let before = upstream.recorded().len();
    for (i, token) in [(0, "b"), (1, "b"), (1, "c-new"), (0, "d-new")] {
        let (status, proxy_status) = get(&fleet, &upstream, i, token, "halted").await;
        assert_eq!(status, 403, "instance {i}, token {token}");
        assert!(proxy_status.contains("locked out"), "{proxy_status}");
    }
    assert_eq!(
        upstream.recorded().len(),
        before,
        "nothing reached the upstream"
    );

    // One unlock frees every key.
    assert_eq!(fleet.unlock(1).await, 200);
    for (i, token) in [(0, "c-new"), (1, "d-new")] {
        eventually(Duration::from_secs(5), "unlocked", || async {
            (get(&fleet, &upstream, i, token, "again").await.0 == 200).then_some(())
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_keys_refuses_a_new_key_until_idle_ones_are_forgotten_here_and_in_the_store() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let db = testdb::fresh().await;
    let fleet = Fleet::start_n(
        2,
        &postgres(&db),
        "rate = 5\nkey = \"header:authorization\"\nmax_keys = 2\nkey_idle = \"2s\"",
    )
    .await;
    for token in ["a", "b"] {
        assert_eq!(get(&fleet, &upstream, 0, token, "in").await.0, 200);
    }
    let status = fleet.status(0).await;
    let idle: Vec<String> = status["keys"]["top"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| format!("local#{}", k["key"].as_str().unwrap()))
        .collect();
    assert_eq!(idle.len(), 2, "{status}");
    // A third key is refused, never sent unpaced; the other instance has room of its own.
    let (status, proxy_status) = get(&fleet, &upstream, 0, "c", "refused").await;
    assert_eq!(status, 503);
    assert!(proxy_status.contains("max_keys"), "{proxy_status}");
    assert!(arrivals_of(&upstream, "refused").is_empty());
    assert_eq!(
        fleet
            .metric(
                0,
                "pacegate_keys_refused_total{destination=\"local\",group=\"\"}"
            )
            .await,
        1.0
    );
    // Once a and b idle out (2 s, swept every second), c goes, and their budgets are gone
    // from the store too.
    eventually(Duration::from_secs(15), "room for a new key", || async {
        (get(&fleet, &upstream, 0, "c", "later").await.0 == 200).then_some(())
    })
    .await;
    let (client, conn) = tokio_postgres::connect(&db, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    eventually(
        Duration::from_secs(10),
        "idle keys deleted from the store",
        || async {
            let left = client
                .query_one(
                    "SELECT count(*) FROM pacegate_budgets WHERE destination = ANY($1)",
                    &[&idle],
                )
                .await
                .unwrap()
                .get::<_, i64>(0);
            (left == 0).then_some(())
        },
    )
    .await;
}

/// Through each instance at once: 2 requests with each of three tokens, to `/total/...`.
/// Returns every arrival, and each token's.
async fn three_tokens(fleet: &Fleet, upstream: &FakeUpstream) -> (Vec<Instant>, Vec<Vec<Instant>>) {
    let base = upstream.http_url("localhost");
    let mut tasks = Vec::new();
    for i in 0..2 {
        for t in 0..3 {
            for k in 0..2 {
                let (via, url) = (fleet.client(i), format!("{base}/total/t{t}/{i}/{k}"));
                tasks.push(tokio::spawn(async move {
                    via.get(url)
                        .header("authorization", format!("Bearer {t}"))
                        .send()
                        .await
                        .unwrap()
                        .status()
                }));
            }
        }
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let each = (0..3)
        .map(|t| arrivals_of(upstream, &format!("total/t{t}")))
        .collect();
    (arrivals_of(upstream, "total"), each)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn total_rate_holds_over_every_key_and_each_key_keeps_its_own() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = two_instances("rate = 5\nkey = \"header:authorization\"\ntotal_rate = 3").await;
    let (all, each) = three_tokens(&fleet, &upstream).await;
    // 12 requests at a total of 3/s over both instances: 3.67 s, at most 4 in any second.
    assert!(
        busiest(&all, Duration::from_secs(1)) <= 4,
        "{}",
        fleet.explain(&upstream)
    );
    assert!(
        span(&all) >= Duration::from_millis(3300),
        "{:?}",
        span(&all)
    );
    for (t, at) in each.iter().enumerate() {
        assert!(
            busiest(at, Duration::from_secs(1)) <= 6,
            "token {t}: {at:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_without_total_rate_the_keys_together_go_past_it() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = two_instances("rate = 5\nkey = \"header:authorization\"").await;
    let (all, _) = three_tokens(&fleet, &upstream).await;
    assert!(
        busiest(&all, Duration::from_secs(1)) > 4,
        "three keys at 5/s each stayed within 4 a second: {}",
        fleet.explain(&upstream)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_whose_key_rules_differ_keep_the_stricter_for_every_key() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let store = postgres(&testdb::fresh().await);
    // The second instance was deployed with three times the keys' rate.
    let fleet = Fleet::start_each(
        &[store.clone(), store],
        &[
            "rate = 2\nkey = \"header:authorization\"",
            "rate = 6\nkey = \"header:authorization\"",
        ],
        &[],
    )
    .await;
    let series = "pacegate_config_mismatch{destination=\"local#\"}";
    for i in 0..2 {
        eventually(
            Duration::from_secs(10),
            "the keys' mismatch seen",
            || async { (fleet.metric(i, series).await == 1.0).then_some(()) },
        )
        .await;
    }
    let tokens = with_tokens(&fleet, &upstream, 3).await;
    for (t, at) in tokens.iter().enumerate() {
        // 6 requests per token at the stricter 2/s: 2.5 s, at most 3 in any second.
        assert!(
            busiest(at, Duration::from_secs(1)) <= 3,
            "token {t}: the faster rule set the pace; {}",
            fleet.explain(&upstream)
        );
    }
    let status = fleet.status(1).await;
    assert_eq!(
        status["config_mismatch"].as_array().unwrap().len(),
        1,
        "{status}"
    );
}
