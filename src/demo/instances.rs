//! The demo's pacegate instances: real `pacegate serve` processes (this binary) when they
//! share a PostgreSQL store or pace alone, or pacers started in this process when they share
//! one embedded store.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

use super::DemoError;
use crate::config::Config;
use crate::store::memory::MemoryStore;

/// How long an instance may take to say it listens.
const START_WITHIN: Duration = Duration::from_secs(30);

/// Which store the instances pace on.
pub(super) enum Store {
    /// One PostgreSQL database, shared (one process each).
    Postgres(String),
    /// One embedded store, shared (all in this process).
    SharedMemory,
    /// Each its own embedded store, in a process of its own.
    AloneProcesses,
    /// Each its own embedded store, all in this process.
    AloneInProcess,
}

/// The config of instance `i`: the vendor as its one destination, paced at `rate`.
fn config_text(store: &Store, rate: u32, max_wait: Duration) -> String {
    let store = match store {
        Store::Postgres(url) => format!("backend = \"postgres\"\nurl = \"{url}\""),
        _ => "backend = \"memory\"".to_owned(),
    };
    format!(
        r#"[proxy]
listen = "127.0.0.1:0"
# The vendor listens on loopback.
allow_private_upstreams = true

[admin]
listen = "127.0.0.1:0"

[tls]
# Nothing is intercepted; the CA is made because every instance has one.
generate_ca = true

[store]
{store}

[destinations.vendor]
hosts = ["127.0.0.1"]
# The vendor listens on an ephemeral port.
ports = ["1024-65535"]
rate = {rate}
max_wait = "{}ms"
"#,
        max_wait.as_millis()
    )
}

enum Running {
    Processes(Vec<tokio::process::Child>),
    InProcess(Vec<crate::app::Running>),
}

/// Started instances: where each listens, and how to stop them.
pub(super) struct Instances {
    /// Each instance's proxy listener.
    pub(super) proxies: Vec<SocketAddr>,
    /// Each instance's admin listener.
    pub(super) admins: Vec<SocketAddr>,
    running: Running,
}

impl Instances {
    /// Starts `n` instances, each with a directory of its own under `dir` for its config, CA
    /// and state file.
    pub(super) async fn start(
        dir: &Path,
        n: usize,
        store: Store,
        rate: u32,
        max_wait: Duration,
    ) -> Result<Self, DemoError> {
        let text = config_text(&store, rate, max_wait);
        let mut dirs = Vec::with_capacity(n);
        for i in 0..n {
            let d = dir.join(format!("instance-{}", i + 1));
            std::fs::create_dir_all(&d).map_err(|e| DemoError::io(&d, e))?;
            std::fs::write(d.join("pacegate.toml"), &text).map_err(|e| DemoError::io(&d, e))?;
            dirs.push(d);
        }
        match store {
            Store::Postgres(_) | Store::AloneProcesses => Self::processes(&dirs).await,
            Store::SharedMemory => {
                let shared = MemoryStore::ephemeral();
                let stores = (0..n)
                    .map(|i| shared.instance(&format!("demo-{}", i + 1)))
                    .collect();
                Self::in_process(&dirs, &text, stores).await
            }
            Store::AloneInProcess => {
                let stores = (0..n).map(|_| MemoryStore::ephemeral()).collect();
                Self::in_process(&dirs, &text, stores).await
            }
        }
    }

    async fn processes(dirs: &[std::path::PathBuf]) -> Result<Self, DemoError> {
        let exe = std::env::current_exe().map_err(|e| DemoError::io(Path::new("."), e))?;
        let mut instances = Self {
            proxies: Vec::new(),
            admins: Vec::new(),
            running: Running::Processes(Vec::new()),
        };
        for dir in dirs {
            let mut command = tokio::process::Command::new(&exe);
            command
                .args(["--log-format", "json", "serve", "--config"])
                .arg(dir.join("pacegate.toml"))
                .env("PACEGATE_LOG", "info")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .kill_on_drop(true)
                // Ctrl-C reaches the demo alone, which stops its instances in order.
                .process_group(0);
            let mut child = command.spawn().map_err(|e| DemoError::io(&exe, e))?;
            let stderr = child.stderr.take();
            if let Running::Processes(children) = &mut instances.running {
                children.push(child);
            }
            let (proxy, admin) = listening(stderr, dir).await?;
            instances.proxies.push(proxy);
            instances.admins.push(admin);
        }
        Ok(instances)
    }

    async fn in_process(
        dirs: &[std::path::PathBuf],
        text: &str,
        stores: Vec<MemoryStore>,
    ) -> Result<Self, DemoError> {
        let mut running = Vec::with_capacity(dirs.len());
        for (dir, store) in dirs.iter().zip(stores) {
            let config = Config::parse(text, dir).map_err(|problems| {
                DemoError::Start(format!("the demo's config is invalid: {problems:?}"))
            })?;
            let started = crate::app::start_sharing(config, store)
                .await
                .map_err(|e| DemoError::Start(e.to_string()))?;
            running.push(started);
        }
        Ok(Self {
            proxies: running.iter().map(|r| r.proxy_addr).collect(),
            admins: running.iter().map(|r| r.admin_addr).collect(),
            running: Running::InProcess(running),
        })
    }

    /// The instances' process ids (none when they run in this process).
    pub(super) fn pids(&self) -> Vec<u32> {
        match &self.running {
            Running::Processes(children) => children.iter().filter_map(|c| c.id()).collect(),
            Running::InProcess(_) => Vec::new(),
        }
    }

    /// Stops every instance and waits until each is gone.
    pub(super) async fn stop(self) {
        match self.running {
            Running::Processes(children) => {
                for mut child in children {
                    let _ = child.kill().await;
                }
            }
            Running::InProcess(running) => {
                for r in running {
                    r.stop().await;
                }
            }
        }
    }
}

/// Reads a starting instance's JSON log until it says where it listens; keeps reading it in
/// the background so that its pipe never fills.
async fn listening(
    stderr: Option<tokio::process::ChildStderr>,
    dir: &Path,
) -> Result<(SocketAddr, SocketAddr), DemoError> {
    let stderr = stderr.ok_or_else(|| DemoError::Start("no stderr from an instance".into()))?;
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = Vec::new();
    let found = tokio::time::timeout(START_WITHIN, async {
        while let Ok(Some(line)) = lines.next_line().await {
            let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            if v["message"] == "pacegate listening" {
                let addr = |k: &str| v[k].as_str().and_then(|a| a.parse().ok());
                return addr("proxy").zip(addr("admin"));
            }
            seen.push(line);
        }
        None
    })
    .await;
    match found {
        Ok(Some(addrs)) => {
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            Ok(addrs)
        }
        _ => Err(DemoError::Start(format!(
            "the instance in {} did not start; its log:\n{}",
            dir.display(),
            seen.join("\n")
        ))),
    }
}
