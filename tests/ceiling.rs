//! The central promise, across real OS processes: several `pacegate serve` instances on one
//! Postgres keep one ceiling, measured at the upstream. The same run with each instance on its
//! own memory store is the control: it must exceed the ceiling, which shows the test can see
//! the defect pacegate exists to remove.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use pacegate::budget::postgres::testdb;
use support::process::{spawn_binary, Instance};
use support::{admin_client, client, Alpn, FakeUpstream};

const RATE: f64 = 20.0;
const INSTANCES: usize = 3;

/// These scenarios measure timing across processes on a 2-core machine: one at a time, so
/// that they do not measure each other.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Writes a config for one instance into `dir` and starts it.
fn instance(dir: &Path, store: &str, keys: &str) -> Instance {
    let config = dir.join("pacegate.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[proxy]
listen = "127.0.0.1:0"
allow_private_upstreams = true
[admin]
listen = "127.0.0.1:0"
[tls]
generate_ca = true
{store}
[destinations.local]
hosts = ["localhost"]
{keys}
"#
        ),
    )
    .unwrap();
    spawn_binary(&config)
}

struct Fleet {
    instances: Vec<Instance>,
    _dirs: Vec<tempfile::TempDir>,
}

impl Fleet {
    async fn start(store: &str, keys: &str) -> Self {
        let dirs: Vec<_> = (0..INSTANCES)
            .map(|_| tempfile::tempdir().unwrap())
            .collect();
        let instances = dirs
            .iter()
            .map(|d| instance(d.path(), store, keys))
            .collect();
        Self {
            instances,
            _dirs: dirs,
        }
    }

    fn client(&self, i: usize) -> reqwest::Client {
        client(
            Some(&format!("http://{}", self.instances[i].proxy)),
            &[],
            Alpn::Http1,
        )
    }

    async fn status(&self, i: usize) -> serde_json::Value {
        let text = admin_client()
            .get(format!("http://{}/status", self.instances[i].admin))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap()[0].clone()
    }
}

async fn postgres_store() -> String {
    format!(
        "[store]\nbackend = \"postgres\"\nurl = \"{}\"\n",
        testdb::fresh().await
    )
}

/// Sends `per_instance` requests through every instance at once; returns the arrivals.
async fn load(fleet: &Fleet, upstream: &FakeUpstream, per_instance: usize) -> Vec<Instant> {
    let mut tasks = Vec::new();
    for i in 0..INSTANCES {
        let via = fleet.client(i);
        for n in 0..per_instance {
            let via = via.clone();
            let url = format!("{}/?i={i}&n={n}", upstream.http_url("localhost"));
            tasks.push(tokio::spawn(async move {
                via.get(url).send().await.unwrap().status()
            }));
        }
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let mut at: Vec<Instant> = upstream.recorded().iter().map(|r| r.at).collect();
    at.sort();
    at
}

fn busiest(at: &[Instant], window: Duration) -> usize {
    (0..at.len())
        .map(|i| at[i..].iter().take_while(|t| **t - at[i] < window).count())
        .max()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_on_one_postgres_keep_one_ceiling() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let upstream = FakeUpstream::start().await;
    let fleet = Fleet::start(&postgres_store().await, &format!("rate = {RATE}")).await;
    // 90 requests at once: far more than three times the ceiling.
    let at = load(&fleet, &upstream, 30).await;
    let most = busiest(&at, Duration::from_secs(1));
    assert!(
        most <= 21,
        "{most} requests reached the upstream within one second at rate {RATE}"
    );
    let achieved = (at.len() - 1) as f64 / (*at.last().unwrap() - at[0]).as_secs_f64();
    assert!(achieved >= 0.95 * RATE, "achieved only {achieved:.2}/s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_one_memory_store_per_process_exceeds_the_ceiling() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let upstream = FakeUpstream::start().await;
    let fleet = Fleet::start("", &format!("rate = {RATE}")).await;
    let at = load(&fleet, &upstream, 30).await;
    let most = busiest(&at, Duration::from_secs(1));
    assert!(
        most > 40,
        "without a shared store each process paces alone, yet only {most} arrived in a second"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verdicts_seen_by_one_instance_apply_to_all() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let upstream = FakeUpstream::start().await;
    let fleet = Fleet::start(
        &postgres_store().await,
        "rate = 50\nretry_throttled = 0\ndecay_after = 1000",
    )
    .await;
    let url = |p: &str| format!("{}/{p}", upstream.http_url("localhost"));

    // A 429 with Retry-After seen by instance 0 widens and pauses instances 1 and 2.
    let resp = fleet
        .client(0)
        .get(url("status/429?h=Retry-After:2"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    let throttled_at = Instant::now();
    for i in 1..INSTANCES {
        let s = fleet.status(i).await;
        assert_eq!(s["backoff"], 2.0, "instance {i}: {s}");
    }
    assert_eq!(
        fleet
            .client(2)
            .get(url("after-pause"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert!(
        throttled_at.elapsed() >= Duration::from_millis(1800),
        "instance 2 was not paused"
    );

    // A 403 seen by instance 1 locks out every instance.
    assert_eq!(
        fleet
            .client(1)
            .get(url("status/403"))
            .send()
            .await
            .unwrap()
            .status(),
        403
    );
    for i in [0, 2] {
        let resp = fleet.client(i).get(url("fine")).send().await.unwrap();
        assert_eq!(resp.status(), 403, "instance {i}");
        assert!(resp.headers()["proxy-status"]
            .to_str()
            .unwrap()
            .contains("locked out"));
    }
    let before = upstream.recorded().len();

    // Unlock through instance 2 restores all.
    let unlock = format!(
        "http://{}/destinations/local/unlock",
        fleet.instances[2].admin
    );
    assert_eq!(
        admin_client().post(unlock).send().await.unwrap().status(),
        200
    );
    for i in 0..INSTANCES {
        assert_eq!(
            fleet
                .client(i)
                .get(url("again"))
                .send()
                .await
                .unwrap()
                .status(),
            200,
            "instance {i}"
        );
    }
    assert_eq!(upstream.recorded().len(), before + INSTANCES);
}
