//! The ceiling under an operator's bad day, across real processes: three `pacegate serve`
//! instances on one Postgres, kept busy from cold connections for 22 s, through a stalled row
//! lock, one instance cut off from the database, a full outage, a flapping link and wall
//! clocks a minute apart. Every arrival at the upstream counts, warm-ups and tails included:
//! no 1 s window may hold more than R + 1 (burst 1), and the fleet must still achieve 70% of R.

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::fleet::{address_of, alone, postgres_store, store_via, Fleet, INSTANCES};
use support::pg::Cluster;
use support::relay::Relay;
use support::{busiest, eventually, testdb, FakeUpstream};

const RATE: f64 = 20.0;
/// R + 1: the burst of one a 1 s window may see where two slots straddle its edges.
const CEILING: usize = 21;
/// The length of each scenario's load where it goes through a fault and back.
const RUN: Duration = Duration::from_secs(22);
/// The length of a scenario's load under a condition that holds throughout (a row lock taken
/// every 2.5 s, clocks apart): each of its seconds is like the others.
const STEADY: Duration = Duration::from_secs(11);
/// Workers per instance, each sending back to back: enough to keep every queue busy.
const WORKERS: usize = 4;

/// Workers sending through every instance until stopped, each from its own fresh client.
struct Load {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicUsize>,
    refused: Arc<AtomicUsize>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    started: Instant,
}

impl Load {
    fn start(fleet: &Fleet, upstream: &FakeUpstream) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicUsize::new(0));
        let refused = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..fleet.instances.len() {
            for w in 0..WORKERS {
                let via = fleet.client(i);
                let base = upstream.http_url("localhost");
                let (stop, answered, refused) = (stop.clone(), answered.clone(), refused.clone());
                tasks.push(tokio::spawn(async move {
                    let mut n = 0;
                    while !stop.load(Ordering::SeqCst) {
                        let url = format!("{base}/?i={i}&w={w}&n={n}");
                        n += 1;
                        match via.get(url).send().await {
                            Ok(r) if r.status() == 200 => answered.fetch_add(1, Ordering::SeqCst),
                            // A refusal (a deadline, a store gone too long) is an answer too;
                            // the counts say how many.
                            _ => refused.fetch_add(1, Ordering::SeqCst),
                        };
                    }
                }));
            }
        }
        Self {
            stop,
            answered,
            refused,
            tasks,
            started: Instant::now(),
        }
    }

    /// Runs until [`RUN`] after the start, then stops the workers and lets the requests in
    /// flight finish (they count).
    async fn finish(self) -> (usize, usize, Duration) {
        self.finish_at(RUN).await
    }

    /// [`Load::finish`] at `run` after the start.
    async fn finish_at(self, run: Duration) -> (usize, usize, Duration) {
        tokio::time::sleep_until((self.started + run).into()).await;
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(20), t).await;
        }
        (
            self.answered.load(Ordering::SeqCst),
            self.refused.load(Ordering::SeqCst),
            run,
        )
    }

    /// Sleeps until `at` after the start.
    async fn at(&self, at: Duration) {
        tokio::time::sleep_until((self.started + at).into()).await;
    }
}

/// The checks every scenario ends with: every arrival, every 1 s window, and the rate the
/// fleet achieved over the run (`answers`: answered, refused, and the run's length).
fn holds(what: &str, fleet: &Fleet, upstream: &FakeUpstream, answers: (usize, usize, Duration)) {
    let at = upstream.arrivals();
    let most = busiest(&at, Duration::from_secs(1));
    assert!(
        most <= CEILING,
        "{what}: {most} arrivals within one second at rate {RATE}; {}",
        fleet.explain(upstream)
    );
    let achieved = at.len() as f64 / answers.2.as_secs_f64();
    assert!(
        achieved >= 0.7 * RATE,
        "{what}: achieved {achieved:.1}/s, under 70% of {RATE}/s ({} answered, {} refused); {}",
        answers.0,
        answers.1,
        fleet.explain(upstream)
    );
    eprintln!(
        "{what}: busiest second {most}, achieved {achieved:.1}/s, {} answered, {} refused",
        answers.0, answers.1
    );
}

/// A fresh postgres store's `[store]` section, and its database's URL, for a scenario that
/// reaches into the database beside the instances.
async fn store_and_url() -> (String, String) {
    let store = postgres_store().await;
    let url = store
        .lines()
        .find_map(|l| l.strip_prefix("url = "))
        .unwrap()
        .trim_matches('"')
        .to_owned();
    (store, url)
}

/// The budget's row lost under load (`TRUNCATE pacegate_budgets`), twice: the instances
/// still hold slots handed out from it, so the row comes back with its schedule after them,
/// and pacing goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_s_row_lost_under_load() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let (store, url) = store_and_url().await;
    let fleet = Fleet::start(&store, &format!("rate = {RATE}")).await;
    fleet.see_shares(INSTANCES).await;
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let run = Duration::from_secs(9);
    let load = Load::start(&fleet, &upstream);
    let mut lost = Vec::new();
    for at in [3, 6] {
        load.at(Duration::from_secs(at)).await;
        db.batch_execute("TRUNCATE pacegate_budgets").await.unwrap();
        lost.push(Instant::now());
    }
    let answers = load.finish_at(run).await;
    let at = upstream.arrivals();
    let most = busiest(&at, Duration::from_secs(1));
    assert!(
        most <= CEILING,
        "{most} arrivals within one second at rate {RATE}, the row lost at {lost:?}; {}",
        fleet.explain(&upstream)
    );
    // Pacing goes on: from a second and a half after the last loss to the end, 80% of R.
    let from = lost[1] + Duration::from_millis(1_500);
    let after = at.iter().filter(|t| **t >= from).count() as f64;
    let span = (load_end(&at) - from).as_secs_f64();
    assert!(
        after >= 0.8 * RATE * span,
        "{after} arrivals in the {span:.1} s after the last loss; {}",
        fleet.explain(&upstream)
    );
    eprintln!(
        "row lost twice: busiest second {most}, {after} arrivals in {span:.1} s after, {} answered, {} refused",
        answers.0, answers.1
    );
}

/// The last arrival.
fn load_end(at: &[Instant]) -> Instant {
    at.iter().copied().max().unwrap()
}

/// Three instances on a fresh database, the first through a relay.
async fn with_a_relay() -> (Fleet, Relay) {
    let url = testdb::fresh().await;
    let relay = Relay::start(address_of(&url)).await;
    let stores = [
        store_via(&url, Some(relay.addr())),
        store_via(&url, None),
        store_via(&url, None),
    ];
    let fleet = Fleet::start_each(&stores, &[&format!("rate = {RATE}")], &[]).await;
    fleet.see_shares(INSTANCES).await;
    (fleet, relay)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_lock_held_elsewhere_only_delays_slots() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let (store, url) = store_and_url().await;
    let fleet = Fleet::start(&store, &format!("rate = {RATE}")).await;
    let load = Load::start(&fleet, &upstream);
    // Another connection takes the destination's row for 0.5 s, every 2.5 s.
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let stalls = tokio::spawn(async move {
        let mut held = 0;
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let tx = "BEGIN; SELECT 1 FROM pacegate_budgets WHERE destination = 'local' FOR UPDATE; SELECT pg_sleep(0.5); COMMIT";
            if db.batch_execute(tx).await.is_err() {
                return held;
            }
            held += 1;
        }
    });
    let answers = load.finish_at(STEADY).await;
    stalls.abort();
    holds("stalled row lock", &fleet, &upstream, answers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_cut_off_for_eight_seconds() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let (fleet, relay) = with_a_relay().await;
    let load = Load::start(&fleet, &upstream);
    load.at(Duration::from_secs(6)).await;
    relay.cut();
    let cut = Instant::now();
    // The others hold its third back once its heartbeat is stale.
    load.at(Duration::from_secs(11)).await;
    let held = fleet.metric(1, "pacegate_store_share_held").await;
    assert!((held - 1.0 / 3.0).abs() < 1e-6, "share held {held}");
    load.at(Duration::from_secs(14)).await;
    relay.restore();
    let answers = load.finish().await;
    holds("one instance cut off", &fleet, &upstream, answers);
    // It paced alone before the link came back (six seconds after its last heartbeat),
    // then went back to the shared store.
    let alone = upstream
        .recorded()
        .iter()
        .filter(|r| r.path.starts_with("/?i=0&") && r.at > cut + Duration::from_secs(6))
        .filter(|r| r.at < cut + Duration::from_secs(8))
        .count();
    assert!(alone > 0, "the cut-off instance did not pace alone");
    eventually(
        Duration::from_secs(5),
        "the instance back on the store",
        || async { (fleet.metric(0, "pacegate_store_degraded").await == 0.0).then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_outage_and_its_recovery() {
    let _alone = alone().await;
    let cluster = Cluster::start();
    let upstream = FakeUpstream::start().await;
    let store = format!(
        "[store]\nbackend = \"postgres\"\nurl = \"{}\"\non_unavailable = \"divide\"\n",
        cluster.url()
    );
    let fleet = Fleet::start(&store, &format!("rate = {RATE}")).await;
    fleet.see_live(INSTANCES).await;
    let load = Load::start(&fleet, &upstream);
    load.at(Duration::from_secs(8)).await;
    cluster.down();
    load.at(Duration::from_secs(12)).await;
    cluster.up();
    let answers = load.finish().await;
    holds("full outage", &fleet, &upstream, answers);
    for i in 0..INSTANCES {
        assert_eq!(fleet.metric(i, "pacegate_store_degraded").await, 0.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_s_link_flapping() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let (fleet, relay) = with_a_relay().await;
    let load = Load::start(&fleet, &upstream);
    load.at(Duration::from_secs(5)).await;
    // Cut and restored in turn, 1 to 2 s each, for 12 s.
    let mut t = Duration::from_secs(5);
    let mut cut = false;
    let mut step = 0u64;
    while t < Duration::from_secs(17) {
        cut = !cut;
        if cut {
            relay.cut();
        } else {
            relay.restore();
        }
        step += 1;
        t += Duration::from_millis(1000 + (step * 370) % 1000);
        load.at(t).await;
    }
    relay.restore();
    let answers = load.finish().await;
    holds("flapping link", &fleet, &upstream, answers);
}

/// The path of libfaketime (in /usr/lib or a multiarch directory below it), which
/// scripts/test installs.
fn faketime() -> String {
    let dirs = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .chain([std::path::PathBuf::from("/usr/lib")]);
    dirs.map(|d| d.join("faketime/libfaketime.so.1"))
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!("libfaketime is missing: install it (apt-get install libfaketime), or run the tests through scripts/test, which does")
        })
        .display()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wall_clocks_a_minute_apart() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let url = testdb::fresh().await;
    let lib = faketime();
    let stores = vec![store_via(&url, None); INSTANCES];
    let ahead: &[(&str, &str)] = &[("LD_PRELOAD", &lib), ("FAKETIME", "+30s")];
    let behind: &[(&str, &str)] = &[("LD_PRELOAD", &lib), ("FAKETIME", "-30s")];
    let fleet = Fleet::start_each(&stores, &[&format!("rate = {RATE}")], &[ahead, behind]).await;
    fleet.see_live(INSTANCES).await;
    // The clocks are skewed indeed: the status each instance writes says so.
    let started = |i: usize| {
        let line = fleet.instances[i]
            .logs
            .json()
            .into_iter()
            .find(|l| l["message"] == "pacegate listening")
            .unwrap();
        let stamp = line["timestamp"].as_str().unwrap().to_owned();
        humantime::parse_rfc3339_weak(&stamp[..19]).unwrap()
    };
    let skew = started(0)
        .duration_since(started(1))
        .unwrap_or_default()
        .as_secs();
    assert!((55..=65).contains(&skew), "clocks {skew} s apart");
    let load = Load::start(&fleet, &upstream);
    let answers = load.finish_at(STEADY).await;
    holds("skewed clocks", &fleet, &upstream, answers);
}
