//! A failover that loses commits, as operators meet it: three instances on a primary with a
//! streaming standby (a multi-host URL with `target_session_attrs=read-write`), the standby
//! cut off from the primary's WAL, a lockout and a `Retry-After` pause taken after the cut,
//! the primary killed and the standby promoted. The lockout and the pause are what the new
//! primary never saw; every instance must still honour both, the ceiling must hold through
//! the switch, and the fleet must pace on the shared budget again afterwards. The control
//! runs the same failover with the instances told not to put back what they knew.

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::fleet::{alone, Fleet};
use support::pg::Cluster;
use support::{admin_client, busiest, eventually, status_of, FakeUpstream};

const RATE: f64 = 10.0;
const INSTANCES: usize = 3;

/// The paced load on `local`, the pause on its group `paused` (429s alone), and the lockout
/// on `locked` (the upstream reached as 127.0.0.1).
const DESTINATIONS: &str = r#"rate = 10
[destinations.local.groups.paused]
paths = ["/status/429"]
retry_throttled = 0
max_wait = "2s"
[destinations.locked]
hosts = ["127.0.0.1"]
rate = 10
"#;

/// Whether `budget` is locked (`lock`) or paused (`pause`) in instance `i`'s status.
async fn knows(fleet: &Fleet, i: usize, budget: &str, what: &str) -> bool {
    let text = admin_client()
        .get(format!("http://{}/status", fleet.instances[i].admin))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let all: serde_json::Value = serde_json::from_str(&text).unwrap();
    all.as_array()
        .unwrap()
        .iter()
        .find(|d| d["destination"] == budget)
        .is_some_and(|d| match what {
            "lock" => !d["lock"].is_null(),
            _ => d["paused_for_seconds"].as_f64().unwrap_or(0.0) > 30.0,
        })
}

/// Sends requests to `local` through every instance, four at a time each, until `stop`.
fn keep_loading(fleet: &Fleet, upstream: &FakeUpstream, stop: &Arc<AtomicBool>) {
    for i in 0..fleet.instances.len() {
        for lane in 0..4 {
            let (via, stop) = (fleet.client(i), stop.clone());
            let base = upstream.http_url("localhost");
            tokio::spawn(async move {
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) {
                    // Refusals while the store switches are expected; the ceiling is what
                    // counts, at the upstream.
                    let _ = via.get(format!("{base}/load/{i}/{lane}/{k}")).send().await;
                    k += 1;
                }
            });
        }
    }
}

/// Arrivals of the load, in order.
fn load_arrivals(upstream: &FakeUpstream) -> Vec<Instant> {
    let mut at: Vec<Instant> = upstream
        .recorded()
        .iter()
        .filter(|r| r.path.starts_with("/load/"))
        .map(|r| r.at)
        .collect();
    at.sort();
    at
}

/// Requests the upstream saw whose path starts with `prefix`, on `host` (`localhost` or
/// `127.0.0.1`).
fn seen(upstream: &FakeUpstream, host: &str, prefix: &str) -> usize {
    upstream
        .recorded()
        .iter()
        .filter(|r| r.authority.starts_with(host) && r.path.starts_with(prefix))
        .count()
}

/// What the fleet did after the failover.
struct After {
    /// Requests to the locked destination the upstream saw after the lockout.
    locked_through: usize,
    /// Requests to the paused group the upstream saw after the pause.
    paused_through: usize,
    fleet: Fleet,
    upstream: FakeUpstream,
    /// When the standby was promoted.
    promoted: Instant,
}

async fn fail_over(reassert: bool) -> After {
    let primary = Cluster::start();
    let standby = Cluster::standby_of(&primary);
    let upstream = FakeUpstream::start().await;
    let url = format!(
        "postgres://pacegate@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write&connect_timeout=2",
        primary.port(),
        standby.port()
    );
    let store =
        format!("[store]\nbackend = \"postgres\"\nurl = \"{url}\"\nreassert = {reassert}\n");
    let fleet = Fleet::start_n(INSTANCES, &store, DESTINATIONS).await;
    fleet.see_live(INSTANCES).await;
    let stop = Arc::new(AtomicBool::new(false));
    keep_loading(&fleet, &upstream, &stop);
    tokio::task::block_in_place(|| standby.cut_off(&primary));

    // After the cut: a lockout through instance 0, a pause through instance 1.
    let locked = |p: &str| format!("{}/{p}", upstream.http_url("127.0.0.1"));
    let paused = format!(
        "{}/status/429?h=Retry-After:120",
        upstream.http_url("localhost")
    );
    assert_eq!(status_of(&fleet.client(0), locked("status/403")).await, 403);
    assert_eq!(status_of(&fleet.client(1), &paused).await, 429);
    for i in 0..INSTANCES {
        for (budget, what) in [("locked", "lock"), ("local/paused", "pause")] {
            eventually(
                Duration::from_secs(10),
                &format!("instance {i} knows of the {what}"),
                || async { knows(&fleet, i, budget, what).await.then_some(()) },
            )
            .await;
        }
    }

    // The primary dies with what it alone held; the standby takes over.
    let promoted = tokio::task::block_in_place(|| {
        primary.down();
        standby.promote();
        Instant::now()
    });
    for i in 0..INSTANCES {
        eventually(
            Duration::from_secs(30),
            &format!("instance {i} paces on the new primary"),
            || async {
                (fleet.metric(i, "pacegate_store_degraded").await == 0.0
                    && status_of(
                        &fleet.client(i),
                        format!("{}/after/{i}", upstream.http_url("localhost")),
                    )
                    .await
                        == 200)
                    .then_some(())
            },
        )
        .await;
    }
    // Each instance asked for the locked destination and the paused group once more.
    let (locked_before, paused_before) = (
        seen(&upstream, "127.0.0.1", "/"),
        seen(&upstream, "localhost", "/status/429"),
    );
    for i in 0..INSTANCES {
        let _ = status_of(&fleet.client(i), locked("status/200")).await;
        let _ = status_of(&fleet.client(i), &paused).await;
    }
    // Load on, for a few seconds on the shared budget.
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    After {
        locked_through: seen(&upstream, "127.0.0.1", "/") - locked_before,
        paused_through: seen(&upstream, "localhost", "/status/429") - paused_before,
        fleet,
        upstream,
        promoted,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockout_and_a_pause_taken_after_the_standby_was_cut_off_survive_its_promotion() {
    let _alone = alone().await;
    let after = fail_over(true).await;
    assert_eq!(
        after.locked_through, 0,
        "the locked destination was forwarded after the failover"
    );
    assert_eq!(
        after.paused_through, 0,
        "the paused group was forwarded after the failover"
    );
    let at = load_arrivals(&after.upstream);
    let most = busiest(&at, Duration::from_secs(1));
    assert!(
        most <= RATE as usize + 1,
        "{most} requests within one second at rate {RATE}; {}",
        after.fleet.explain(&after.upstream)
    );
    // Back on the shared budget: the last 3 s of load at close to the rate, from every
    // instance.
    let last = *at.last().unwrap();
    let recent = at
        .iter()
        .filter(|t| **t > last - Duration::from_secs(3) && **t > after.promoted)
        .count();
    assert!(
        recent as f64 >= 0.7 * 3.0 * RATE,
        "only {recent} requests in the last 3 s at rate {RATE}; {}",
        after.fleet.explain(&after.upstream)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_without_reassertion_the_failover_forgets_the_lockout_and_the_pause() {
    let _alone = alone().await;
    let after = fail_over(false).await;
    assert_eq!(
        after.locked_through, INSTANCES,
        "every instance forwards to the destination locked before the failover"
    );
    assert!(
        after.paused_through >= 1,
        "the pause before the failover held"
    );
}
