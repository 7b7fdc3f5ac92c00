//! Builders for integration scenarios: a fake upstream that records what arrives, a pacegate
//! started in-process on port 0, real clients (reqwest, raw TCP), and bounded waits.
#![allow(dead_code, unreachable_pub)]

pub mod bouncer;
pub mod config;
pub mod fleet;
pub mod llm;
pub mod pg;
pub mod process;
pub mod relay;
pub mod stamped;
pub mod testdb;
pub mod upstream;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Once};
use std::time::Duration;

use pacegate::app::{self, Running};
use pacegate::config::Config;
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[allow(unused_imports)]
pub use upstream::FakeUpstream;

/// Installs the crypto provider and a test log subscriber, once per test binary.
pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("PACEGATE_TEST_LOG")
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_test_writer()
            .try_init();
    });
}

/// Waits for `check` to return `Some`, polling every 20 ms, failing after `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A pacegate running in-process, with its temp dir (CA files, config and state file live
/// there).
pub struct TestProxy {
    pub running: Option<Running>,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub dir: tempfile::TempDir,
}

/// Config file name inside a [`TestProxy`]'s dir.
pub const CONFIG_FILE: &str = "pacegate.toml";

impl TestProxy {
    /// Starts pacegate with `extra` TOML appended to a test base config: listeners on port 0,
    /// a CA generated in a temp dir, loopback upstreams allowed, and the fake upstream's CA
    /// trusted. `extra` may add `[destinations.*]` and any other section except `[proxy]`,
    /// `[admin]` and `[tls]`, whose keys go in `proxy_extra`.
    pub async fn start(upstream_ca: &Path, proxy_extra: &str, extra: &str) -> Self {
        Self::start_with(upstream_ca, proxy_extra, "", extra).await
    }

    /// Like [`TestProxy::start`], with `admin_extra` keys in `[admin]`.
    pub async fn start_with(
        upstream_ca: &Path,
        proxy_extra: &str,
        admin_extra: &str,
        extra: &str,
    ) -> Self {
        init();
        let dir = tempfile::tempdir().unwrap();
        let text = process::config_text(proxy_extra, admin_extra, Some(upstream_ca), extra);
        std::fs::write(dir.path().join(CONFIG_FILE), &text).unwrap();
        Self::start_in(dir).await
    }

    /// Starts pacegate on the config a previous [`TestProxy`] left in `dir`.
    pub async fn start_in(dir: tempfile::TempDir) -> Self {
        let config = Config::load(&dir.path().join(CONFIG_FILE))
            .unwrap_or_else(|e| panic!("test config invalid: {e}"));
        let running = app::start(config).await.expect("pacegate starts");
        Self {
            addr: running.proxy_addr,
            admin: running.admin_addr,
            running: Some(running),
            dir,
        }
    }

    /// The proxy's CA certificate path.
    pub fn ca_path(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Runs the graceful shutdown sequence.
    pub async fn stop(&mut self) -> usize {
        self.running.take().expect("running").stop().await
    }

    /// Stops and starts again on the same config and state file (new ports).
    pub async fn restart(mut self) -> Self {
        self.stop().await;
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap());
        Self::start_in(dir).await
    }

    /// `GET /status` from the admin listener.
    pub async fn status(&self) -> serde_json::Value {
        let text = admin_client()
            .get(format!("http://{}/status", self.admin))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        serde_json::from_str(&text).unwrap()
    }

    /// One destination's entry in `/status`.
    pub async fn destination(&self, name: &str) -> serde_json::Value {
        let all = self.status().await;
        all.as_array()
            .unwrap()
            .iter()
            .find(|d| d["destination"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name} missing from /status: {all}"))
    }

    /// The admin listener's `/metrics` text.
    pub async fn metrics(&self) -> String {
        admin_get(self.admin, "/metrics").await
    }

    /// The value of one sample in `/metrics`, e.g. `pacegate_requests_total{destination="a",outcome="forwarded"}`.
    pub async fn metric(&self, series: &str) -> f64 {
        metric_value(&self.metrics().await, series)
    }
}

impl Drop for TestProxy {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            r.begin_shutdown();
        }
    }
}

/// Sends a GET through `client` and returns the response's status.
pub async fn status_of(client: &reqwest::Client, url: impl reqwest::IntoUrl) -> u16 {
    client.get(url).send().await.unwrap().status().as_u16()
}

/// A PostgreSQL for a bench or test: a fresh database in the server
/// `PACEGATE_TEST_DATABASE_URL` names, or else a throwaway cluster of its own, which must be
/// kept alive as long as the URL is used.
pub async fn database() -> (Option<pg::Cluster>, String) {
    if std::env::var("PACEGATE_TEST_DATABASE_URL").is_ok() {
        (None, testdb::fresh().await)
    } else {
        let cluster = pg::Cluster::start();
        let url = cluster.url();
        (Some(cluster), url)
    }
}

/// How late each arrival is against the beat (instants `origin + k / rate`), in milliseconds,
/// sorted. Each arrival is matched to the beat position before it, so a slot that was never
/// used (dropped, or nobody waiting) does not count as lateness for the ones after; the
/// origin is the phase of the least late arrival. Meaningful while lateness stays under one
/// interval.
pub fn lateness_ms(arrivals: &[std::time::Instant], rate: f64) -> Vec<f64> {
    let interval = 1000.0 / rate;
    let first = arrivals[0];
    let phase: Vec<f64> = arrivals
        .iter()
        .map(|t| ((*t - first).as_secs_f64() * 1000.0).rem_euclid(interval))
        .collect();
    // The phases may straddle the wrap (a beat just before `first`): measure from the phase
    // that leaves the largest empty arc before it.
    let mut sorted = phase.clone();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let gaps = sorted.windows(2).map(|w| (w[1] - w[0], w[1]));
    let wrap = (sorted[0] + interval - sorted[sorted.len() - 1], sorted[0]);
    let origin = gaps
        .chain(std::iter::once(wrap))
        .fold(
            (f64::MIN, 0.0),
            |best, g| if g.0 > best.0 { g } else { best },
        )
        .1;
    let mut late: Vec<f64> = phase
        .iter()
        .map(|p| (p - origin).rem_euclid(interval))
        .collect();
    late.sort_by(|a, b| a.partial_cmp(b).unwrap());
    late
}

/// The `p` quantile (0 to 1) of sorted samples.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// A plain client for the admin listener.
pub fn admin_client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// The body of a GET on the admin listener at `admin`.
pub async fn admin_get(admin: SocketAddr, path: &str) -> String {
    admin_client()
        .get(format!("http://{admin}{path}"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// A `Server-Timing` metric's duration in a response's field, in milliseconds.
pub fn timing(resp: &reqwest::Response, metric: &str) -> Option<f64> {
    let field = resp.headers().get("server-timing")?.to_str().ok()?;
    field.split(',').find_map(|item| {
        let (name, params) = item.trim().split_once(';')?;
        (name == metric).then(|| params.strip_prefix("dur=")?.parse().ok())?
    })
}

/// The value of `series` in Prometheus text, 0 when absent.
pub fn metric_value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// Roots holding the given PEM files' certificates.
pub fn roots(pems: &[&Path]) -> RootCertStore {
    let mut roots = RootCertStore::empty();
    for p in pems {
        for c in CertificateDer::pem_file_iter(p).unwrap() {
            roots.add(c.unwrap()).unwrap();
        }
    }
    roots
}

/// Which HTTP versions a test client offers over TLS.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Alpn {
    Http1,
    H2,
}

/// A client TLS config trusting exactly the given CA files, offering `alpn`.
pub fn client_tls(trust: &[&Path], alpn: Alpn) -> rustls::ClientConfig {
    let mut tls = rustls::ClientConfig::builder_with_provider(pacegate::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots(trust))
        .with_no_client_auth();
    tls.alpn_protocols = match alpn {
        Alpn::Http1 => vec![b"http/1.1".to_vec()],
        Alpn::H2 => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
    };
    tls
}

/// A reqwest client going through `proxy` (if any), trusting exactly the given CA files.
pub fn client(proxy: Option<&str>, trust: &[&Path], alpn: Alpn) -> reqwest::Client {
    client_with(proxy, trust, alpn, |b| b)
}

/// Like [`client`], with a hook to adjust the builder.
pub fn client_with(
    proxy: Option<&str>,
    trust: &[&Path],
    alpn: Alpn,
    adjust: impl FnOnce(reqwest::ClientBuilder) -> reqwest::ClientBuilder,
) -> reqwest::Client {
    init();
    let mut b = reqwest::Client::builder()
        .tls_backend_preconfigured(client_tls(trust, alpn))
        .timeout(Duration::from_secs(30))
        .no_proxy();
    if alpn == Alpn::Http1 {
        b = b.http1_only();
    }
    if let Some(p) = proxy {
        b = b.proxy(reqwest::Proxy::all(p).unwrap());
    }
    adjust(b).build().unwrap()
}

/// What a client saw of a response, minus headers that differ between any two responses.
#[derive(Debug, PartialEq, Eq)]
pub struct Seen {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Seen {
    pub async fn of(resp: reqwest::Response) -> Self {
        let status = resp.status().as_u16();
        // pacegate's own items are what a proxied answer adds (its `Server-Timing` metrics,
        // its RateLimit items); the origin's are compared as they are.
        let mut headers: Vec<(String, String)> = resp
            .headers()
            .iter()
            .filter(|(k, _)| *k != "date")
            .filter_map(|(k, v)| {
                let mut v = String::from_utf8_lossy(v.as_bytes()).into_owned();
                if ["server-timing", "ratelimit", "ratelimit-policy"].contains(&k.as_str()) {
                    v = v
                        .split(", ")
                        .filter(|m| !m.starts_with("pacegate-") && !m.starts_with("\"pacegate\""))
                        .collect::<Vec<_>>()
                        .join(", ");
                }
                (!v.is_empty()).then(|| (k.to_string(), v))
            })
            .collect();
        headers.sort();
        let body = resp.bytes().await.unwrap().to_vec();
        Self {
            status,
            headers,
            body,
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Sends raw bytes to `addr` and reads one response (head and `Content-Length` body), or
/// whatever arrives before the peer closes or `limit` passes.
pub async fn raw_exchange(addr: SocketAddr, request: &[u8], limit: Duration) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().to_owned())
                })
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0);
            if body.len() >= length {
                return text;
            }
        }
        match tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return text,
        }
    }
}

/// Reads everything until close or `limit`.
pub async fn read_until_close(stream: &mut TcpStream, limit: Duration) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(limit, stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads one response head (up to the blank line) from a raw stream.
pub async fn read_head(stream: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut byte))
            .await
            .expect("response head in time")
            .unwrap();
        assert!(
            n > 0,
            "connection closed inside a response head: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.push(byte[0]);
    }
    String::from_utf8(buf).unwrap()
}

/// A shared handle, for moving test state into spawned tasks.
pub type Shared<T> = Arc<T>;

/// The most arrivals in any window of length `window`; `arrivals` in order.
pub fn busiest(arrivals: &[std::time::Instant], window: std::time::Duration) -> usize {
    (0..arrivals.len())
        .map(|i| {
            arrivals[i..]
                .iter()
                .take_while(|t| **t - arrivals[i] < window)
                .count()
        })
        .max()
        .unwrap_or(0)
}

/// Sends a GET to each of `urls` at once through the proxy; returns the statuses in order.
pub async fn burst_of(proxy: &TestProxy, urls: Vec<String>) -> Vec<u16> {
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let tasks: Vec<_> = urls
        .into_iter()
        .map(|url| {
            let via = via.clone();
            tokio::spawn(async move { via.get(url).send().await.unwrap().status().as_u16() })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}
