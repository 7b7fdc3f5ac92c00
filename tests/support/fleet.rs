//! Several `pacegate serve` processes as one fleet: their configs, clients, metrics and logs.

use std::path::Path;
use std::time::{Duration, Instant};

use super::process::{spawn_binary_with, Instance};
use super::{admin_client, client, eventually, metric_value, testdb, Alpn, FakeUpstream};

/// Instances in a fleet unless a scenario says otherwise.
pub const INSTANCES: usize = 3;

/// Turns in the processes binary. Its timing scenarios measure arrivals across processes on a
/// 2-core machine, so each runs [`alone`]; the single-process scenarios run [`beside`] each
/// other, never beside a timing one.
static TURNS: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Waits until no other scenario of this binary runs, and keeps it so while held.
pub async fn alone() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    TURNS.write().await
}

/// Waits until no timing scenario runs, and keeps it so while held.
pub async fn beside() -> tokio::sync::RwLockReadGuard<'static, ()> {
    TURNS.read().await
}

/// Writes a config for one instance into `dir` and starts it.
fn instance(dir: &Path, store: &str, keys: &str, env: &[(&str, &str)]) -> Instance {
    let config = dir.join("pacegate.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[proxy]
listen = "127.0.0.1:0"
allow_private_upstreams = true
ports = ["1024-65535"]
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
    spawn_binary_with(&config, env)
}

pub struct Fleet {
    pub instances: Vec<Instance>,
    _dirs: Vec<tempfile::TempDir>,
}

/// How long a stopping instance may take to drain and exit.
const EXIT_WITHIN: Duration = Duration::from_secs(20);

impl Fleet {
    pub async fn start(store: &str, keys: &str) -> Self {
        Self::start_n(INSTANCES, store, keys).await
    }

    /// One instance per entry of `stores` (its `[store]` section), each with its entry of
    /// `keys` (the destination's keys; the last entry for the rest) and of `env`.
    pub async fn start_each(stores: &[String], keys: &[&str], env: &[&[(&str, &str)]]) -> Self {
        let dirs: Vec<_> = stores
            .iter()
            .map(|_| tempfile::tempdir().unwrap())
            .collect();
        let instances = dirs
            .iter()
            .zip(stores)
            .enumerate()
            .map(|(i, (d, store))| {
                let keys = keys.get(i).or(keys.last()).copied().unwrap_or_default();
                instance(
                    d.path(),
                    store,
                    keys,
                    env.get(i).copied().unwrap_or_default(),
                )
            })
            .collect();
        Self {
            instances,
            _dirs: dirs,
        }
    }

    pub async fn start_n(n: usize, store: &str, keys: &str) -> Self {
        let dirs: Vec<_> = (0..n).map(|_| tempfile::tempdir().unwrap()).collect();
        let instances = dirs
            .iter()
            .map(|d| instance(d.path(), store, keys, &[]))
            .collect();
        Self {
            instances,
            _dirs: dirs,
        }
    }

    pub fn client(&self, i: usize) -> reqwest::Client {
        client(
            Some(&format!("http://{}", self.instances[i].proxy)),
            &[],
            Alpn::Http1,
        )
    }

    /// The ERROR lines each instance logged so far.
    pub fn errors(&self) -> Vec<usize> {
        self.instances
            .iter()
            .map(|i| {
                i.logs
                    .json()
                    .iter()
                    .filter(|l| l["level"] == "ERROR")
                    .count()
            })
            .collect()
    }

    /// For a failed timing assertion: the store errors each instance logged, and every
    /// arrival (ms after the first, and the request).
    pub fn explain(&self, upstream: &FakeUpstream) -> String {
        let errors = self.errors();
        let mut seen = upstream.recorded();
        seen.sort_by_key(|r| r.at);
        let first = seen.first().map(|r| r.at);
        let arrivals: Vec<String> = seen
            .iter()
            .map(|r| {
                format!(
                    "{:.1}ms {}",
                    (r.at - first.unwrap()).as_secs_f64() * 1000.0,
                    r.path
                )
            })
            .collect();
        let dropped: Vec<usize> = self
            .instances
            .iter()
            .map(|i| {
                let lines = i.logs.json();
                lines
                    .iter()
                    .filter(|l| {
                        let m = l["message"].as_str().unwrap_or_default();
                        // Dropped by the dispatcher, at the send, or for want of a connection.
                        m == "slot too late to use; reserving another"
                            || m.starts_with("a request held up past its slot")
                            || m.starts_with("a request without an upstream connection in time")
                    })
                    .count()
            })
            .collect();
        format!(
            "store errors per instance {errors:?}; slots dropped per instance {dropped:?}; arrivals: {}",
            arrivals.join(", ")
        )
    }

    /// Sends `per_instance` requests through every instance at once; returns every arrival,
    /// the warm-ups included, once every request was answered 200.
    ///
    /// One request per instance goes first, so that each has an upstream connection when the
    /// burst comes (the scenarios of `tests/processes/faults.rs` start from cold connections).
    pub async fn load(&self, upstream: &FakeUpstream, per_instance: usize) -> Vec<Instant> {
        let n = self.instances.len();
        for i in 0..n {
            let url = format!("{}/warm-up", upstream.http_url("localhost"));
            assert_eq!(self.client(i).get(url).send().await.unwrap().status(), 200);
        }
        let mut tasks = Vec::new();
        for i in 0..n {
            let via = self.client(i);
            for k in 0..per_instance {
                let via = via.clone();
                let url = format!("{}/?i={i}&n={k}", upstream.http_url("localhost"));
                tasks.push(tokio::spawn(async move {
                    via.get(url).send().await.unwrap().status()
                }));
            }
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), 200);
        }
        upstream.arrivals()
    }

    pub async fn metric(&self, i: usize, series: &str) -> f64 {
        let text = admin_client()
            .get(format!("http://{}/metrics", self.instances[i].admin))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        metric_value(&text, series)
    }

    /// Waits until the store (at `store`'s `url`) holds at least `n` requests of `class`
    /// (of [`CLASSES`]) waiting over every instance: what a reservation on any instance
    /// weighs. Read from the database itself, since an instance's own view of it is a
    /// snapshot of up to seconds ago.
    pub async fn store_holds_waiting(&self, store: &str, class: &str, n: usize) {
        let url = store
            .split_once("url = \"")
            .and_then(|(_, rest)| rest.split_once('"'))
            .map(|(url, _)| url.to_owned())
            .expect("a [store] section with a url");
        let rank = ["interactive", "scheduled", "backfill"]
            .iter()
            .position(|c| *c == class)
            .expect("a class of CLASSES") as i32;
        let (db, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        let what = format!("{n} {class} requests waiting in the store");
        eventually(Duration::from_secs(10), &what, || async {
            let row = db
                .query_one(
                    "SELECT coalesce(sum(count), 0)::bigint FROM pacegate_waiting
                     WHERE destination = 'local' AND class = $1",
                    &[&rank],
                )
                .await
                .ok()?;
            (row.get::<_, i64>(0) >= n as i64).then_some(())
        })
        .await;
    }

    /// Stops instance `i` with SIGTERM, waits for it to exit, and starts it again from the
    /// same config (on new ports). Returns when it was signalled and when it listened again.
    pub async fn restart(&mut self, i: usize) -> (Instant, Instant) {
        let config = self._dirs[i].path().join("pacegate.toml");
        let stopping = self.instances.remove(i);
        let signalled = Instant::now();
        assert!(std::process::Command::new("kill")
            .args(["-TERM", &stopping.child.id().to_string()])
            .status()
            .unwrap()
            .success());
        let exited = tokio::task::spawn_blocking(move || stopping.child.wait());
        let status = tokio::time::timeout(EXIT_WITHIN, exited)
            .await
            .expect("the instance exits within its grace after SIGTERM")
            .unwrap();
        assert!(status.success(), "instance {i} exited with {status}");
        self.instances.insert(i, spawn_binary_with(&config, &[]));
        (signalled, Instant::now())
    }

    /// Kills instance `i` with SIGKILL (no goodbye to the store); returns when.
    pub fn kill_9(&mut self, i: usize) -> Instant {
        let victim = self.instances.remove(i);
        assert!(std::process::Command::new("kill")
            .args(["-9", &victim.child.id().to_string()])
            .status()
            .unwrap()
            .success());
        Instant::now()
    }

    /// Waits until every instance would pace alone at `1 / n` of each rate were it to lose
    /// the store: the instances have counted each other, and told each other so.
    pub async fn see_shares(&self, n: usize) {
        for i in 0..self.instances.len() {
            eventually(
                Duration::from_secs(15),
                "the share each would pace alone at",
                || async {
                    let share = self.metric(i, "pacegate_store_share_alone").await;
                    ((share - 1.0 / n as f64).abs() < 1e-9).then_some(())
                },
            )
            .await;
        }
    }

    /// Waits until every instance sees `n` live instances.
    pub async fn see_live(&self, n: usize) {
        for i in 0..self.instances.len() {
            eventually(
                Duration::from_secs(15),
                "the live instance count",
                || async {
                    (self.metric(i, "pacegate_store_instances").await == n as f64).then_some(())
                },
            )
            .await;
        }
    }

    /// Clears destination `local`'s lockout through instance `i`'s admin listener; returns
    /// the answer's status.
    pub async fn unlock(&self, i: usize) -> u16 {
        admin_client()
            .post(format!(
                "http://{}/destinations/local/unlock",
                self.instances[i].admin
            ))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    }

    pub async fn status(&self, i: usize) -> serde_json::Value {
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

/// Three classes, most urgent first; requests that name none are `scheduled`.
pub const CLASSES: &str = r#"
[classes]
order = ["interactive", "scheduled", "backfill"]
default = "scheduled"
"#;

/// Sends `n` requests of `class` through instance `i` in the background; each path is
/// `/{class}/{k}`. Their outcomes are not awaited.
pub fn queue_up(fleet: &Fleet, upstream: &FakeUpstream, i: usize, class: &'static str, n: usize) {
    let via = fleet.client(i);
    for k in 0..n {
        let (via, url) = (
            via.clone(),
            format!("{}/{class}/{k}", upstream.http_url("localhost")),
        );
        tokio::spawn(async move {
            let _ = via.get(url).header("Pacegate-Class", class).send().await;
        });
    }
}

/// Arrivals at the upstream of requests whose path starts with `/{class}/`, in order.
pub fn arrivals_of(upstream: &FakeUpstream, class: &str) -> Vec<Instant> {
    let prefix = format!("/{class}/");
    let mut at: Vec<Instant> = upstream
        .recorded()
        .iter()
        .filter(|r| r.path.starts_with(&prefix))
        .map(|r| r.at)
        .collect();
    at.sort();
    at
}

/// The address a postgres URL names.
pub fn address_of(url: &str) -> std::net::SocketAddr {
    let config: tokio_postgres::Config = url.parse().unwrap();
    match (config.get_hosts().first(), config.get_ports().first()) {
        (Some(tokio_postgres::config::Host::Tcp(h)), Some(p)) => {
            format!("{h}:{p}").parse().unwrap()
        }
        _ => panic!("{url} names no TCP address"),
    }
}

/// A `[store]` section for `url`, through `via` instead of the database's own address.
pub fn store_via(url: &str, via: Option<std::net::SocketAddr>) -> String {
    let url = match via {
        Some(relay) => url.replace(&address_of(url).to_string(), &relay.to_string()),
        None => url.to_owned(),
    };
    format!("[store]\nbackend = \"postgres\"\nurl = \"{url}\"\n")
}

/// A `[store]` section on a fresh database.
pub async fn postgres_store() -> String {
    format!(
        "[store]\nbackend = \"postgres\"\nurl = \"{}\"\n",
        testdb::fresh().await
    )
}
