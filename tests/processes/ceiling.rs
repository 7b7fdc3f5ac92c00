//! The central promise, across real OS processes: several `pacegate serve` instances on one
//! Postgres keep one ceiling, measured at the upstream. The same run with each instance on its
//! own memory store is the control: it must exceed the ceiling, which shows the test can see
//! the defect pacegate exists to remove.

use crate::support;

use std::time::{Duration, Instant};

use support::fleet::{alone, arrivals_of, postgres_store, queue_up, Fleet, CLASSES, INSTANCES};
use support::pg::Cluster;
use support::testdb;
use support::{busiest, eventually, status_of, FakeUpstream};

const RATE: f64 = 20.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_on_one_postgres_keep_one_ceiling() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = Fleet::start(&postgres_store().await, &format!("rate = {RATE}")).await;
    // 150 requests at once: far more than three times the ceiling, and a run long enough
    // (7.5 s) that one scheduling hiccup of a loaded machine, which costs the slots it made
    // too late to use, does not decide the achieved rate.
    let at = fleet.load(&upstream, 50).await;
    let most = busiest(&at, Duration::from_secs(1));
    assert!(
        most <= 21,
        "{most} requests reached the upstream within one second at rate {RATE}; {}",
        fleet.explain(&upstream)
    );
    let achieved = (at.len() - 1) as f64 / (*at.last().unwrap() - at[0]).as_secs_f64();
    assert!(
        achieved >= 0.95 * RATE,
        "achieved only {achieved:.2}/s; {}",
        fleet.explain(&upstream)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_whose_configs_differ_keep_the_stricter_rule_and_say_so() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let store = postgres_store().await;
    // The third instance was deployed with twice the rate.
    let fast = format!("rate = {}", RATE * 2.0);
    let fleet = Fleet::start_each(
        &vec![store; INSTANCES],
        &[&format!("rate = {RATE}"), &format!("rate = {RATE}"), &fast],
        &[],
    )
    .await;
    let series = "pacegate_config_mismatch{destination=\"local\"}";
    for i in 0..INSTANCES {
        eventually(Duration::from_secs(10), "the mismatch seen", || async {
            (fleet.metric(i, series).await == 1.0).then_some(())
        })
        .await;
    }
    let at = fleet.load(&upstream, 30).await;
    let most = busiest(&at, Duration::from_secs(1));
    assert!(
        most <= 21,
        "{most} requests within one second: the faster config set the pace; {}",
        fleet.explain(&upstream)
    );
    // Said in the log, and in status, by the instance that runs the faster config too.
    let said = fleet.instances[2].logs.json().iter().any(|l| {
        l["level"] == "ERROR"
            && l["message"]
                .as_str()
                .unwrap_or("")
                .contains("config mismatch")
    });
    assert!(said, "no ERROR line about the mismatch");
    let status = fleet.status(2).await;
    assert_eq!(
        status["config_mismatch"].as_array().unwrap().len(),
        2,
        "{status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_one_memory_store_per_process_exceeds_the_ceiling() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = Fleet::start("", &format!("rate = {RATE}")).await;
    let at = fleet.load(&upstream, 30).await;
    let most = busiest(&at, Duration::from_secs(1));
    assert!(
        most > 40,
        "without a shared store each process paces alone, yet only {most} arrived in a second"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verdicts_seen_by_one_instance_apply_to_all() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = Fleet::start(
        &postgres_store().await,
        "rate = 50\nretry_throttled = 0\ndecay_after = 4",
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
    assert_eq!(status_of(&fleet.client(2), url("after-pause")).await, 200);
    assert!(
        throttled_at.elapsed() >= Duration::from_millis(1800),
        "instance 2 was not paused"
    );

    // A second throttle, seen by instance 1 under the new generation, widens again; the
    // clean streak starts from zero.
    let resp = fleet.client(1).get(url("status/429")).send().await.unwrap();
    assert_eq!(resp.status(), 429);
    assert_eq!(fleet.status(2).await["backoff"], 4.0);

    // A 403 seen by instance 1 locks out every instance.
    assert_eq!(status_of(&fleet.client(1), url("status/403")).await, 403);
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
    assert_eq!(fleet.unlock(2).await, 200);
    for i in 0..INSTANCES {
        assert_eq!(
            status_of(&fleet.client(i), url("again")).await,
            200,
            "instance {i}"
        );
    }
    assert_eq!(upstream.recorded().len(), before + INSTANCES);
    // Those three clean responses, one per instance, count towards one shared streak: N
    // instances do not decay N times faster. The fourth decays the backoff once, 4 to 2.
    assert_eq!(fleet.status(0).await["backoff"], 4.0);
    assert_eq!(fleet.status(0).await["clean_streak"], 3);
    assert_eq!(status_of(&fleet.client(1), url("fourth")).await, 200);
    // Status shows the store as its snapshot of at most a second ago saw it.
    for i in 0..INSTANCES {
        let what = format!("instance {i} to show backoff 2 and a streak of 0");
        eventually(Duration::from_secs(3), &what, || async {
            let s = fleet.status(i).await;
            ((s["backoff"].as_f64(), s["clean_streak"].as_u64()) == (Some(2.0), Some(0)))
                .then_some(())
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instance_leaves_the_others_on_the_ceiling_and_the_live_count() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let mut fleet = Fleet::start(&postgres_store().await, &format!("rate = {RATE}")).await;
    fleet.see_live(INSTANCES).await;
    let load = {
        let fleet = &fleet;
        let upstream = &upstream;
        async move {
            let mut tasks = Vec::new();
            for i in 0..INSTANCES {
                let via = fleet.client(i);
                for n in 0..25 {
                    let via = via.clone();
                    let url = format!("{}/?i={i}&n={n}", upstream.http_url("localhost"));
                    // Requests through the killed instance fail; the others must not.
                    tasks.push(tokio::spawn(async move {
                        (i, via.get(url).send().await.map(|r| r.status()))
                    }));
                }
            }
            tasks
        }
    };
    let tasks = load.await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let killed_at = fleet.kill_9(0);
    for t in tasks {
        let (i, result) = t.await.unwrap();
        if i != 0 {
            assert_eq!(result.unwrap(), 200);
        }
    }
    let at = upstream.arrivals();
    let most = busiest(&at, Duration::from_secs(1));
    let degraded: usize = fleet.errors().iter().sum();
    assert!(
        most <= 21,
        "{most} requests within one second after a kill -9 ({degraded} store errors logged)"
    );
    // The survivors see the dead instance leave the live count within a heartbeat timeout.
    eventually(
        Duration::from_secs(10),
        "the dead instance to leave the live count",
        || async {
            (fleet.metric(0, "pacegate_store_instances").await == (INSTANCES - 1) as f64)
                .then_some(())
        },
    )
    .await;
    assert!(
        killed_at.elapsed() < Duration::from_secs(8),
        "took {:?}",
        killed_at.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_divides_the_rate_and_keeps_lockouts() {
    let _alone = alone().await;
    let cluster = Cluster::start();
    let upstream = FakeUpstream::start().await;
    let store = format!(
        "[store]\nbackend = \"postgres\"\nurl = \"{}\"\n",
        cluster.url()
    );
    let fleet = Fleet::start_n(2, &store, &format!("rate = {RATE}\nretry_throttled = 0")).await;
    fleet.see_live(2).await;
    fleet.see_shares(2).await;
    let url = |p: &str| format!("{}/{p}", upstream.http_url("localhost"));

    cluster.down();
    // The outage is noticed at the next reservation or heartbeat, within about a second.
    for i in 0..2 {
        fleet.client(i).get(url("probe")).send().await.unwrap();
        eventually(Duration::from_secs(5), "the degraded flag", || async {
            (fleet.metric(i, "pacegate_store_degraded").await == 1.0).then_some(())
        })
        .await;
    }
    upstream.clear();
    // Each paces alone at about rate / 2 (six seconds after its last heartbeat): the
    // aggregate still holds the ceiling.
    let mut tasks = Vec::new();
    for i in 0..2 {
        for n in 0..30 {
            let via = fleet.client(i);
            let u = url(&format!("?i={i}&n={n}"));
            tasks.push(tokio::spawn(async move {
                via.get(u).send().await.unwrap().status()
            }));
        }
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let at = upstream.arrivals();
    let most = busiest(&at, Duration::from_secs(1));
    assert!(
        most <= 21,
        "{most} requests within one second while the store was down"
    );

    // A lockout taken during the outage locks that instance now and the store afterwards.
    assert_eq!(status_of(&fleet.client(0), url("status/403")).await, 403);
    assert_eq!(status_of(&fleet.client(0), url("fine")).await, 403);
    cluster.up();
    for i in 0..2 {
        eventually(
            Duration::from_secs(5),
            "recovery without a restart",
            || async { (fleet.metric(i, "pacegate_store_degraded").await == 0.0).then_some(()) },
        )
        .await;
    }
    let resp = fleet.client(1).get(url("fine")).send().await.unwrap();
    assert_eq!(
        resp.status(),
        403,
        "the lockout reached the store and so the other instance"
    );
    let (client, conn) = tokio_postgres::connect(&cluster.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let row = client
        .query_one(
            "SELECT lock_status FROM pacegate_budgets WHERE destination = 'local'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Option<i32>>(0), Some(403));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_with_refuse_gets_a_clear_refusal() {
    let _alone = alone().await;
    let cluster = Cluster::start();
    let upstream = FakeUpstream::start().await;
    let store = format!(
        "[store]\nbackend = \"postgres\"\nurl = \"{}\"\non_unavailable = \"refuse\"\n",
        cluster.url()
    );
    let fleet = Fleet::start_n(1, &store, "rate = 50").await;
    let url = format!("{}/", upstream.http_url("localhost"));
    assert_eq!(status_of(&fleet.client(0), &url).await, 200);
    cluster.down();
    let started = Instant::now();
    let resp = fleet.client(0).get(&url).send().await.unwrap();
    assert_eq!(resp.status(), 503);
    let ps = resp.headers()["proxy-status"].to_str().unwrap().to_owned();
    assert!(ps.contains("pacing store unavailable"), "{ps}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "refused after {:?}",
        started.elapsed()
    );
    cluster.up();
    eventually(
        Duration::from_secs(6),
        "service after the store's return",
        || async {
            let resp = fleet.client(0).get(&url).send().await.ok()?;
            (resp.status() == 200).then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_and_status_work_against_the_store_directly() {
    let _alone = alone().await;
    let url = testdb::fresh().await;
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_pacegate"))
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["migrate", "--store", &url]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "applied migrations [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]"
    );
    let out = run(&["migrate", "--store", &url]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "the store's schema is up to date"
    );

    let upstream = FakeUpstream::start().await;
    let store = format!("[store]\nbackend = \"postgres\"\nurl = \"{url}\"\nmigrate = false\n");
    let fleet = Fleet::start_n(2, &store, "rate = 50").await;
    fleet.see_live(2).await;
    let resp = fleet
        .client(0)
        .get(format!("{}/status/403", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    let out = run(&["status", "--store", &url]);
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = table
        .lines()
        .find(|l| l.starts_with("local"))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(row.contains("LOCKED") && row.contains("403"), "{row}");
    assert_eq!(
        table
            .lines()
            .filter(|l| l.contains(&format!("/{}/", fleet.instances[0].child.id())))
            .count(),
        1,
        "{table}"
    );
    assert!(table.contains("INSTANCE"), "{table}");
    let live = table
        .lines()
        .skip_while(|l| !l.starts_with("INSTANCE"))
        .skip(1)
        .count();
    assert_eq!(live, 2, "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_can_be_reached_over_verified_tls() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    // The upstream's test CA also signs the database's certificate (for 127.0.0.1).
    let cluster = Cluster::start_tls(&upstream.ca.leaf_pem, &upstream.ca.key_pem);
    let url = format!("{}?sslmode=require", cluster.url());
    let trusted = format!(
        "[store]\nbackend = \"postgres\"\nurl = \"{url}\"\nca_file = \"{}\"\n",
        upstream.ca.cert_path.display()
    );
    let fleet = Fleet::start_n(1, &trusted, "rate = 50").await;
    let resp = fleet
        .client(0)
        .get(format!("{}/", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(fleet.metric(0, "pacegate_store_degraded").await, 0.0);
    let (client, conn) = tokio_postgres::connect(&cluster.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let tls_sessions: i64 = client
        .query_one("SELECT count(*) FROM pg_stat_ssl WHERE ssl", &[])
        .await
        .unwrap()
        .get(0);
    assert!(tls_sessions >= 1, "pacegate's connections use TLS");

    // Without the CA the certificate is not trusted, and pacegate refuses to start.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("pacegate.toml");
    std::fs::write(
        &config,
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[tls]\ngenerate_ca = true\n[store]\nbackend = \"postgres\"\nurl = \"{url}\"\n[destinations.local]\nhosts = [\"localhost\"]\nrate = 1\n"
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pacegate"))
        .args(["serve", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.to_lowercase().contains("certificate"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_other_instances_are_refused_within_a_second_of_a_lockout() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let db = testdb::fresh().await;
    let store = format!("[store]\nbackend = \"postgres\"\nurl = \"{db}\"\n");
    let fleet = Fleet::start_n(1, &store, "rate = 0.1").await;
    let url = |p: &str| format!("{}/{p}", upstream.http_url("localhost"));
    // The instance sends one request, then holds a second for the slot 10 s later.
    assert_eq!(status_of(&fleet.client(0), url("first")).await, 200);
    let waiting = {
        let via = fleet.client(0);
        let u = url("waiting");
        tokio::spawn(async move { via.get(u).send().await.unwrap() })
    };
    eventually(
        Duration::from_secs(5),
        "a request waiting for its slot",
        || async { (fleet.status(0).await["waiting"] == 1).then_some(()) },
    )
    .await;
    // Another instance takes a lockout: its verdict lands in the shared row.
    let (client, conn) = tokio_postgres::connect(&db, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .execute(
            "UPDATE pacegate_budgets SET lock_since = clock_timestamp(), lock_status = 403,
                 lock_request = 'GET http://elsewhere/', lock_instance = 'other-instance'
             WHERE destination = 'local'",
            &[],
        )
        .await
        .unwrap();
    let locked_at = Instant::now();
    let resp = waiting.await.unwrap();
    let refused_after = locked_at.elapsed();
    assert_eq!(resp.status(), 403);
    assert!(resp.headers()["proxy-status"]
        .to_str()
        .unwrap()
        .contains("other-instance"));
    assert!(
        refused_after < Duration::from_millis(1500),
        "refused {refused_after:?} after the lockout"
    );
    assert_eq!(
        upstream.recorded().len(),
        1,
        "the waiting request was never sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interactive_request_goes_before_backfill_queued_on_another_instance() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let store = format!("{}{CLASSES}", postgres_store().await);
    let fleet = Fleet::start_n(2, &store, "rate = 4").await;
    let interval = Duration::from_millis(250);
    queue_up(&fleet, &upstream, 0, "backfill", 50);
    // The store holds instance 0's queue, which instance 1's reservations weigh.
    fleet.store_holds_waiting(&store, "backfill", 40).await;
    let sent = Instant::now();
    let resp = fleet
        .client(1)
        .get(format!("{}/interactive/0", upstream.http_url("localhost")))
        .header("Pacegate-Class", "interactive")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let arrived = arrivals_of(&upstream, "interactive")[0];
    let backfill_meanwhile = arrivals_of(&upstream, "backfill")
        .iter()
        .filter(|t| **t > sent && **t < arrived)
        .count();
    assert!(
        arrived - sent <= interval * 2 + Duration::from_millis(100),
        "the interactive request waited {:?} behind {backfill_meanwhile} backfill requests; {}",
        arrived - sent,
        fleet.explain(&upstream)
    );
    assert!(backfill_meanwhile <= 2, "{}", fleet.explain(&upstream));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_instance_that_holds_waiters_frees_their_precedence() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let store = format!("{}{CLASSES}", postgres_store().await);
    let mut fleet = Fleet::start_n(2, &store, "rate = 2").await;
    fleet.see_live(2).await;
    // Instance 0 holds far more interactive requests than it can send; instance 1's backfill
    // must wait behind them.
    queue_up(&fleet, &upstream, 0, "interactive", 40);
    fleet.store_holds_waiting(&store, "interactive", 30).await;
    queue_up(&fleet, &upstream, 1, "backfill", 5);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        arrivals_of(&upstream, "backfill").is_empty(),
        "backfill went before waiting interactive requests; {}",
        fleet.explain(&upstream)
    );
    let killed_at = fleet.kill_9(0);
    let first = eventually(Duration::from_secs(15), "a backfill arrival", || async {
        arrivals_of(&upstream, "backfill").first().copied()
    })
    .await;
    // One lease (3 s) plus the yield and a slot at 2/s.
    assert!(
        first - killed_at <= pacegate::fleet::WAITER_LEASE + Duration::from_millis(1500),
        "backfill waited {:?} after the kill",
        first - killed_at
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_window_holds_over_every_instance() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = Fleet::start(
        &postgres_store().await,
        "rate = 10\nquota = [{ limit = 30, per = \"10s\" }]",
    )
    .await;
    // A warm-up and 19 through each of three instances: two full windows' worth.
    let at = fleet.load(&upstream, 19).await;
    assert_eq!(at.len(), 60);
    let most = busiest(&at, Duration::from_secs(10));
    assert!(
        most <= 30,
        "{most} requests reached the upstream within 10 s under a quota of 30; {}",
        fleet.explain(&upstream)
    );
    // The quota, not the rate, set the pace: the second 30 waited for the window.
    assert!(at[59] - at[0] >= Duration::from_secs(10));
}

/// Keeps `concurrency` requests of `class` in flight through instance `i` until `stop` is
/// set; each path is `/{class}/{task}-{n}`.
fn saturate(
    fleet: &Fleet,
    upstream: &FakeUpstream,
    i: usize,
    class: &'static str,
    concurrency: usize,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    let via = fleet.client(i);
    let base = upstream.http_url("localhost");
    for task in 0..concurrency {
        let (via, base, stop) = (via.clone(), base.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let url = format!("{base}/{class}/{task}-{n}");
                let _ = via.get(url).header("Pacegate-Class", class).send().await;
                n += 1;
            }
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_holds_across_instances_and_is_lent_when_idle() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let store = format!(
        "{}{CLASSES}[classes.share]\nbackfill = 0.2\n",
        postgres_store().await
    );
    let fleet = Fleet::start_n(2, &store, "rate = 20").await;
    fleet.see_live(2).await;
    let interactive_stop = Arc::new(AtomicBool::new(false));
    let backfill_stop = Arc::new(AtomicBool::new(false));
    // Interactive demand saturates the destination through one instance, backfill through
    // the other.
    saturate(&fleet, &upstream, 0, "interactive", 20, &interactive_stop);
    saturate(&fleet, &upstream, 1, "backfill", 20, &backfill_stop);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let from = Instant::now();
    tokio::time::sleep(Duration::from_secs(15)).await;
    let to = Instant::now();
    let count = |class: &str, from: Instant, to: Instant| {
        arrivals_of(&upstream, class)
            .iter()
            .filter(|t| **t >= from && **t < to)
            .count()
    };
    let (interactive, backfill) = (count("interactive", from, to), count("backfill", from, to));
    let fraction = backfill as f64 / (interactive + backfill) as f64;
    println!(
        "with share 0.2: backfill {backfill}, interactive {interactive} in 15 s ({:.1} %)",
        fraction * 100.0
    );
    assert!(
        (0.18..=0.25).contains(&fraction),
        "backfill got {backfill} of {} slots over 15 s ({:.1} %) with share 0.2",
        interactive + backfill,
        fraction * 100.0
    );
    // No interactive demand: backfill gets every slot, at the full rate.
    interactive_stop.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let from = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let to = Instant::now();
    backfill_stop.store(true, Ordering::Relaxed);
    let (interactive, backfill) = (count("interactive", from, to), count("backfill", from, to));
    println!("alone: backfill {backfill} in 3 s");
    assert_eq!(interactive, 0);
    assert!(
        backfill >= 51,
        "alone, backfill got only {backfill} slots in 3 s at rate 20"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_vendor_says_to_one_instance_paces_every_instance() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = Fleet::start_n(
        2,
        &postgres_store().await,
        "rate = 50\nretry_throttled = 0\nthrottle_block = { min = \"1s\", max = \"8s\", jitter = 0 }",
    )
    .await;
    let url = |p: &str| format!("{}/{p}", upstream.http_url("localhost"));
    let gap = || {
        let at = upstream.arrivals();
        at[at.len() - 1] - at[at.len() - 2]
    };

    // A GitHub-style spent budget seen by instance 0: a 403 with remaining 0 and a reset
    // 3 s ahead (Unix seconds). The client gets the 403; nothing is locked; instance 1 waits
    // for the reset.
    let reset = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3;
    let spent = url(&format!(
        "status/403?h=x-ratelimit-remaining:0&h=x-ratelimit-reset:{reset}"
    ));
    assert_eq!(status_of(&fleet.client(0), spent).await, 403);
    let s = fleet.status(1).await;
    assert_eq!(s["lock"], serde_json::Value::Null, "{s}");
    assert_eq!(s["pace_limited_by"], "paused: exhausted", "{s}");
    assert_eq!(status_of(&fleet.client(1), url("after-reset")).await, 200);
    assert!(
        std::time::SystemTime::now()
            >= std::time::UNIX_EPOCH + Duration::from_secs(reset) - Duration::from_millis(50),
        "instance 1 went {:?} after the 403, before the reset",
        gap()
    );

    // A secondary limit seen by instance 1 blocks instance 0 for 1 s; a second one, seen
    // by instance 0, for 2 s: the streak is the row's, not an instance's.
    let secondary = url("status/403?body=You%20have%20exceeded%20a%20secondary%20rate%20limit");
    assert_eq!(status_of(&fleet.client(1), secondary.clone()).await, 403);
    assert_eq!(status_of(&fleet.client(0), secondary).await, 403);
    assert!(
        gap() >= Duration::from_millis(950),
        "first block: {:?}",
        gap()
    );
    assert_eq!(fleet.status(1).await["block_streak"], 2);
    assert_eq!(status_of(&fleet.client(1), url("after-block")).await, 200);
    assert!(
        gap() >= Duration::from_millis(1950),
        "second block: {:?}",
        gap()
    );
    assert_eq!(
        fleet.status(0).await["block_streak"],
        0,
        "one success ends it"
    );

    // A plain 403 still locks out both.
    assert_eq!(status_of(&fleet.client(0), url("status/403")).await, 403);
    let resp = fleet.client(1).get(url("fine")).send().await.unwrap();
    assert_eq!(resp.status(), 403);
    assert!(
        resp.headers().contains_key("proxy-status"),
        "refused by pacegate"
    );
}
