//! `pacegate demo`: the promise shown on one machine, offline. A local vendor that throttles
//! past its limit, three pacegate instances sharing one destination, and a load of three times
//! the ceiling through them: first on one shared budget, then (the control) each instance
//! pacing alone. A line per second while it runs; at the end each run's worst 1 s window and
//! the throttles it drew.
//!
//! The instances share a throwaway PostgreSQL ([`cluster`]) when the server binaries are
//! there, as three processes of this binary; otherwise three pacers in this process share one
//! embedded store. Everything the demo starts is stopped, and every file it writes is removed,
//! also on Ctrl-C; only `--out` is left.

pub mod cluster;
mod instances;
mod load;
mod report;
mod vendor;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use self::cluster::{Cluster, ClusterError};
use self::instances::{Instances, Store};
use self::load::Outcomes;
use self::report::Run;
use self::vendor::{Arrival, Vendor};
use crate::status::DestinationStatus;

/// Instances in the demo's fleet.
const INSTANCES: usize = 3;
/// The destination's rate: the ceiling the fleet shares.
const RATE: u32 = 10;
/// The vendor's limit per 1 s window: a little above the rate, as an operator sets a rate a
/// little under a vendor's published limit.
const VENDOR_LIMIT: u32 = RATE + 2;
/// How long a request may wait for a slot before pacegate refuses it.
const MAX_WAIT: Duration = Duration::from_secs(2);

/// Which store the shared run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreChoice {
    /// A throwaway PostgreSQL when the server binaries are there, else the embedded store.
    Auto,
    /// A throwaway PostgreSQL, or an error.
    Postgres,
    /// Three pacers in one process on the embedded store.
    Memory,
}

/// What the demo is asked to do.
#[derive(Debug, Clone)]
pub struct Options {
    /// Seconds of load in each run.
    pub seconds: u64,
    /// Where to write the arrivals (CSV) and the chart (SVG).
    pub out: Option<PathBuf>,
    pub store: StoreChoice,
    /// The command line that reproduces this run, for the summary.
    pub command: String,
}

/// How a demo ended: each run's worst 1 s window.
#[derive(Debug)]
pub struct Outcome {
    pub ceiling: u32,
    pub shared_worst: usize,
    pub alone_worst: usize,
}

impl Outcome {
    /// Whether the shared run kept the promise: at most the rate plus one in any 1 s window.
    pub fn held(&self) -> bool {
        self.shared_worst <= usize::try_from(self.ceiling).unwrap_or(usize::MAX) + 1
    }
}

/// Why a demo stopped early.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start an instance: {0}")]
    Start(String),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error("cannot draw the chart: {0}")]
    Chart(String),
    #[error("interrupted")]
    Interrupted,
}

impl DemoError {
    fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

/// What the demo has started and must stop, whichever way it ends.
#[derive(Default)]
struct Started {
    cluster: Option<Cluster>,
    instances: Option<Instances>,
    /// Every process started, for the closing line.
    pids: Vec<u32>,
}

impl Started {
    async fn clean_up(&mut self) {
        if let Some(instances) = self.instances.take() {
            instances.stop().await;
        }
        if let Some(cluster) = self.cluster.take() {
            // Every server process, for the closing line; dropping the cluster waits for
            // pg_ctl and then for each of them to exit.
            for pid in cluster.pids() {
                if !self.pids.contains(&pid) {
                    self.pids.push(pid);
                }
            }
            let _ = tokio::task::spawn_blocking(move || drop(cluster)).await;
        }
    }
}

/// Runs the demo, printing as it goes; stops early on SIGINT or SIGTERM, cleaning up first.
pub async fn run(options: Options) -> Result<Outcome, DemoError> {
    let work = tempfile::Builder::new()
        .prefix("pacegate-demo.")
        .tempdir()
        .map_err(|e| DemoError::io(&std::env::temp_dir(), e))?;
    let mut started = Started::default();
    let result = tokio::select! {
        result = both_runs(&options, work.path(), &mut started) => result,
        () = crate::shutdown::signal() => Err(DemoError::Interrupted),
    };
    started.clean_up().await;
    let dir = work.path().display().to_string();
    drop(work);
    let pids = started
        .pids
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(" ");
    println!(
        "cleaned up: stopped {} processes [{pids}], removed {dir}",
        started.pids.len()
    );
    let (shared, alone) = result?;
    let outcome = Outcome {
        ceiling: RATE,
        shared_worst: report::worst_window(&shared),
        alone_worst: report::worst_window(&alone),
    };
    if let Some(out) = &options.out {
        write_out(out, &shared, &alone)?;
    }
    summary(&options, &outcome, &shared, &alone);
    Ok(outcome)
}

async fn both_runs(
    options: &Options,
    work: &Path,
    started: &mut Started,
) -> Result<(Vec<Arrival>, Vec<Arrival>), DemoError> {
    let try_postgres = match options.store {
        StoreChoice::Memory => false,
        StoreChoice::Postgres => true,
        StoreChoice::Auto => cluster::server_binaries().is_some(),
    };
    let shared_store = if try_postgres {
        match tokio::task::spawn_blocking(Cluster::start).await {
            Ok(Ok(cluster)) => Some(cluster),
            Ok(Err(e)) if options.store == StoreChoice::Postgres => return Err(e.into()),
            Ok(Err(e)) => {
                println!("PostgreSQL would not start ({e}).");
                None
            }
            Err(e) => return Err(DemoError::Start(e.to_string())),
        }
    } else {
        None
    };
    let (shared, alone) = match &shared_store {
        Some(cluster) => {
            started.pids.extend(cluster.pid());
            println!(
                "{INSTANCES} pacegate processes share one budget in a throwaway PostgreSQL on 127.0.0.1:{} (pid {}).",
                cluster.port,
                cluster.pid().map_or("?".into(), |p| p.to_string())
            );
            (Store::Postgres(cluster.url()), Store::AloneProcesses)
        }
        None if options.store == StoreChoice::Memory => {
            println!(
                "{INSTANCES} pacers in this process share one embedded store (--store memory)."
            );
            (Store::SharedMemory, Store::AloneInProcess)
        }
        None => {
            println!("No PostgreSQL here: {INSTANCES} pacers in this process share one embedded store instead (with PostgreSQL's server binaries installed, {INSTANCES} processes share one database).");
            (Store::SharedMemory, Store::AloneInProcess)
        }
    };
    started.cluster = shared_store;
    println!(
        "The vendor allows {VENDOR_LIMIT} requests a second and answers 429 past that; the destination's rate is {RATE}/s, so at most {} in any 1 s window. The load: {RATE} requests a second through each instance, {}/s in all.",
        RATE + 1,
        RATE * INSTANCES as u32,
    );
    let shared = one_run(Run::Shared, shared, options, &work.join("shared"), started).await?;
    println!();
    println!("The control: the same load, each instance pacing alone at {RATE}/s.");
    let alone = one_run(Run::Alone, alone, options, &work.join("alone"), started).await?;
    Ok((shared, alone))
}

/// One run: a fresh vendor and fleet, `options.seconds` of load, a line a second.
async fn one_run(
    run: Run,
    store: Store,
    options: &Options,
    dir: &Path,
    started: &mut Started,
) -> Result<Vec<Arrival>, DemoError> {
    let vendor = Vendor::start(VENDOR_LIMIT)
        .await
        .map_err(|e| DemoError::Start(format!("the vendor: {e}")))?;
    let instances = Instances::start(dir, INSTANCES, store, RATE, MAX_WAIT).await?;
    started.pids.extend(instances.pids());
    let (proxies, admins) = (instances.proxies.clone(), instances.admins.clone());
    started.instances = Some(instances);

    let outcomes = Arc::new(Outcomes::default());
    let stop = CancellationToken::new();
    let target = format!("http://{}/", vendor.addr);
    let load = tokio::spawn({
        let (outcomes, stop) = (outcomes.clone(), stop.clone());
        async move { load::drive(&proxies, &target, f64::from(RATE), outcomes, stop).await }
    });
    println!(
        "{:<6} {:>8} {}  = all   (| marks the ceiling)",
        "run",
        "seconds",
        (1..=INSTANCES)
            .map(|i| format!(" i{i}"))
            .collect::<String>()
    );
    let begun = Instant::now();
    for second in 0..options.seconds {
        tokio::time::sleep_until(begun + Duration::from_secs(second + 1)).await;
        let backoff = highest_backoff(&admins).await;
        println!(
            "{}",
            report::live_line(run, second, &vendor.arrivals(), INSTANCES, RATE, backoff)
        );
    }
    stop.cancel();
    // Requests still waiting are sent or refused within max_wait: every arrival is counted.
    let _ = load.await;
    if let Some(instances) = started.instances.take() {
        instances.stop().await;
    }
    let get = Outcomes::get;
    println!(
        "{:<6} requests: {} sent, {} answered 2xx, {} throttled by the vendor, {} refused by pacegate after waiting {} s, {} failed",
        run.name(),
        get(&outcomes.sent),
        get(&outcomes.ok),
        get(&outcomes.throttled),
        get(&outcomes.refused),
        MAX_WAIT.as_secs(),
        get(&outcomes.failed),
    );
    Ok(vendor.arrivals())
}

/// The highest backoff any instance reports for the destination (1 when none answers).
async fn highest_backoff(admins: &[std::net::SocketAddr]) -> f64 {
    let mut highest: f64 = 1.0;
    for admin in admins {
        let url = crate::admin::url_for(*admin);
        let call = crate::admin::call(&url, http::Method::GET, "/status", None);
        let Ok(Ok((_, body))) = tokio::time::timeout(Duration::from_millis(300), call).await else {
            continue;
        };
        let rows: Vec<DestinationStatus> = serde_json::from_str(&body).unwrap_or_default();
        for row in rows {
            highest = highest.max(row.backoff);
        }
    }
    highest
}

fn write_out(out: &Path, shared: &[Arrival], alone: &[Arrival]) -> Result<(), DemoError> {
    std::fs::create_dir_all(out).map_err(|e| DemoError::io(out, e))?;
    let runs = [(Run::Shared, shared), (Run::Alone, alone)];
    let csv = out.join("arrivals.csv");
    std::fs::write(&csv, report::csv(&runs)).map_err(|e| DemoError::io(&csv, e))?;
    // The chart spans the longest run, tails included.
    let span = shared
        .iter()
        .chain(alone)
        .map(|a| a.at.as_secs() + 1)
        .max()
        .unwrap_or(1);
    let chart = report::svg(&runs, span, RATE).map_err(DemoError::Chart)?;
    let svg = out.join("arrivals.svg");
    std::fs::write(&svg, chart).map_err(|e| DemoError::io(&svg, e))?;
    println!("wrote {} and {}", csv.display(), svg.display());
    Ok(())
}

fn summary(options: &Options, outcome: &Outcome, shared: &[Arrival], alone: &[Arrival]) {
    let throttles = |a: &[Arrival]| a.iter().filter(|a| a.status == 429).count();
    let answered = |a: &[Arrival]| a.iter().filter(|a| a.status == 200).count();
    println!();
    println!(
        "Summary: the ceiling is {RATE} requests a second, the promise at most {} in any 1 s window.",
        RATE + 1
    );
    println!(
        "  shared budget: worst 1 s window {:3}, throttles {:4}, arrivals {} ({} answered 200)",
        outcome.shared_worst,
        throttles(shared),
        shared.len(),
        answered(shared)
    );
    println!(
        "  pacing alone:  worst 1 s window {:3}, throttles {:4}, arrivals {} ({} answered 200)",
        outcome.alone_worst,
        throttles(alone),
        alone.len(),
        answered(alone)
    );
    let over = outcome.alone_worst > usize::try_from(RATE).unwrap_or(usize::MAX) + 1;
    if outcome.held() {
        println!(
            "The shared budget held the ceiling{}",
            if over { "; pacing alone did not." } else { "." }
        );
    } else {
        println!("THE CEILING DID NOT HOLD in the shared run: this is a bug, please report it with the output above.");
    }
    println!("Reproduce: {}", options.command);
}
