//! The real binary as a child process.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

/// A child process that is killed if the test ends without reaping it.
pub struct Reaped(Option<std::process::Child>);

impl Reaped {
    pub fn id(&self) -> u32 {
        self.0.as_ref().unwrap().id()
    }

    pub fn wait(mut self) -> std::process::ExitStatus {
        self.0.take().unwrap().wait().unwrap()
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The log lines of a child, read in the background so that its stderr never fills up.
#[derive(Clone, Default)]
pub struct Logs(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Logs {
    /// Every line so far, parsed as JSON (lines that are not JSON are skipped).
    pub fn json(&self) -> Vec<serde_json::Value> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Every line so far, as written.
    pub fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// A started `pacegate serve`: the process, its proxy and admin addresses, its logs.
pub struct Instance {
    pub child: Reaped,
    pub proxy: std::net::SocketAddr,
    pub admin: std::net::SocketAddr,
    pub logs: Logs,
}

/// Starts the real binary with JSON logs and waits until it reports listening.
pub fn spawn_binary(config: &std::path::Path) -> Instance {
    spawn_binary_with(config, &[])
}

/// [`spawn_binary`] with more environment variables.
pub fn spawn_binary_with(config: &std::path::Path, env: &[(&str, &str)]) -> Instance {
    spawn_binary_logging("json", config, env)
}

/// [`spawn_binary_with`], logging in `format` (`text`, as shipped, or `json`).
fn spawn_binary_logging(format: &str, config: &std::path::Path, env: &[(&str, &str)]) -> Instance {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pacegate"))
        .args(["--log-format", format, "serve", "--config"])
        .arg(config)
        .envs(env.iter().copied())
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let child = Reaped(Some(child));
    let logs = Logs::default();
    let (tx, rx) = std::sync::mpsc::channel();
    let sink = logs.clone();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            if let Some(addresses) = listening(&line) {
                let _ = tx.send(addresses);
            }
            sink.0.lock().unwrap().push(line);
        }
    });
    let (proxy, admin) = rx
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| {
            panic!(
                "pacegate did not report listening; its log:\n{}",
                logs.0.lock().unwrap().join("\n")
            )
        });
    Instance {
        child,
        proxy,
        admin,
        logs,
    }
}

/// The proxy and admin addresses a "pacegate listening" line names, in JSON or in text
/// (`... pacegate listening proxy=127.0.0.1:41234 admin=127.0.0.1:40263 ...`).
fn listening(line: &str) -> Option<(std::net::SocketAddr, std::net::SocketAddr)> {
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
        if v["message"] != "pacegate listening" {
            return None;
        }
        return Some((
            v["proxy"].as_str()?.parse().ok()?,
            v["admin"].as_str()?.parse().ok()?,
        ));
    }
    if !line.contains(" pacegate listening ") {
        return None;
    }
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|word| word.strip_prefix(key))?
            .parse()
            .ok()
    };
    Some((field("proxy=")?, field("admin=")?))
}

/// The real binary on a test config in a directory of its own: listeners on port 0, a CA
/// generated beside the config, loopback upstreams allowed (unless `proxy_keys` says
/// otherwise), `roots` trusted upstream, and `rest` (destinations, other sections) after.
pub struct Served {
    pub instance: Instance,
    pub dir: tempfile::TempDir,
}

impl Served {
    pub fn start(proxy_keys: &str, roots: Option<&std::path::Path>, rest: &str) -> Self {
        Self::start_logging("json", &[], proxy_keys, roots, rest)
    }

    /// [`Served::start`], logging in `format` (`text`, as shipped, or `json`), with more
    /// environment variables.
    pub fn start_logging(
        format: &str,
        env: &[(&str, &str)],
        proxy_keys: &str,
        roots: Option<&std::path::Path>,
        rest: &str,
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("pacegate.toml");
        std::fs::write(&config, config_text(proxy_keys, "", roots, rest)).unwrap();
        let instance = spawn_binary_logging(format, &config, env);
        Self { instance, dir }
    }

    /// The proxy URL clients use.
    pub fn url(&self) -> String {
        format!("http://{}", self.instance.proxy)
    }

    /// The CA it generated, which clients of intercepted hosts trust.
    pub fn ca(&self) -> std::path::PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// Its `/metrics`.
    pub async fn metrics(&self) -> String {
        self.instance.admin_get("/metrics").await
    }
}

impl Instance {
    /// The body of a GET on its admin listener.
    pub async fn admin_get(&self, path: &str) -> String {
        super::admin_get(self.admin, path).await
    }
}

/// The test config [`Served::start`] and `TestProxy` write: listeners on port 0, loopback
/// upstreams allowed and a 5 s shutdown grace (each default dropped when `proxy_keys` sets
/// that key), `admin_keys` in `[admin]`, a CA generated beside it, `roots` trusted upstream,
/// then `rest`.
pub fn config_text(
    proxy_keys: &str,
    admin_keys: &str,
    roots: Option<&std::path::Path>,
    rest: &str,
) -> String {
    let defaults: String = [
        ("listen", "\"127.0.0.1:0\""),
        ("allow_private_upstreams", "true"),
        // Test upstreams listen on ephemeral ports.
        ("ports", "[\"1024-65535\"]"),
        ("shutdown_grace", "\"5s\""),
    ]
    .iter()
    .filter(|(key, _)| !proxy_keys.contains(key))
    .map(|(key, value)| format!("{key} = {value}\n"))
    .collect();
    let roots = roots.map_or(String::new(), |r| {
        format!("extra_upstream_roots = [\"{}\"]\n", r.display())
    });
    format!(
        "[proxy]\n{defaults}{proxy_keys}\n[admin]\nlisten = \"127.0.0.1:0\"\n{admin_keys}\n[tls]\ngenerate_ca = true\n{roots}\n{rest}\n"
    )
}
