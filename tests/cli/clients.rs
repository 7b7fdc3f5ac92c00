//! Real clients as operators run them: curl, Python requests, Node (undici's
//! `EnvHttpProxyAgent`) and Go (`net/http`), configured only through their usual proxy
//! settings and a CA bundle: through interception, through a blind tunnel, and picking their
//! class by proxy user name. And the official `openai` SDK, reading a metered stream.

use crate::support;

use std::path::{Path, PathBuf};

use support::{metric_value, FakeUpstream, TestProxy};
use tokio::process::Command;

const LOCAL: &str = "[destinations.local]\nhosts = [\"localhost\"]\nrate = 100000\n# Forwarding scenarios: no verdicts, so every status passes through untouched.\nthrottle_statuses = []\nlockout_statuses = []\n";

fn require(tool: &str, probe: &[&str]) {
    let ok = std::process::Command::new(tool)
        .args(probe)
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(ok, "`{tool}` is required by this test; scripts/test installs it (apt-get install curl python3-requests)");
}

#[tokio::test]
async fn curl_through_the_proxy() {
    require("curl", &["--version"]);
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::start(&upstream.ca.cert_path, "", LOCAL).await;
    let ca = proxy.ca_path();
    for (url, extra, expect) in [
        (
            format!("{}/status/201?h=X-Up:1", upstream.http_url("localhost")),
            None,
            "201 1.1",
        ),
        (
            format!("{}/status/201?h=X-Up:1", upstream.https_url("localhost")),
            Some("--http1.1"),
            "201 1.1",
        ),
        (
            format!("{}/status/201?h=X-Up:1", upstream.https_url("localhost")),
            Some("--http2"),
            "201 2",
        ),
    ] {
        let mut cmd = Command::new("curl");
        cmd.args(["-sS", "--noproxy", "", "-x", &proxy.url(), "--cacert"])
            .arg(&ca)
            .args([
                "-D",
                "-",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code} %{http_version}\n",
            ]);
        if let Some(e) = extra {
            cmd.arg(e);
        }
        let out = cmd.arg(&url).output().await.unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "curl {url}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.trim_end().ends_with(expect),
            "curl {url} {extra:?}: {stdout}"
        );
        assert!(stdout.to_lowercase().contains("x-up: 1"), "{stdout}");
    }
    // Expect: 100-continue with a body, as curl sends for large uploads.
    let body = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(body.path(), vec![b'x'; 2 * 1024 * 1024]).unwrap();
    let out = Command::new("curl")
        .args([
            "-sS",
            "--noproxy",
            "",
            "-x",
            &proxy.url(),
            "-H",
            "Expect: 100-continue",
            "--data-binary",
        ])
        .arg(format!("@{}", body.path().display()))
        .args(["-o", "/dev/null", "-w", "%{http_code}"])
        .arg(format!("{}/status/200", upstream.http_url("localhost")))
        .output()
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    assert_eq!(upstream.received_bytes(), 2 * 1024 * 1024);
}

#[tokio::test]
async fn python_requests_through_the_proxy() {
    require("python3", &["-c", "import requests"]);
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::start(&upstream.ca.cert_path, "", LOCAL).await;
    let script = r#"
import os, requests
r = requests.get(os.environ["TARGET"], timeout=20)
print(r.status_code, r.headers.get("X-Up"), r.headers.get("Retry-After"))
"#;
    for url in [
        upstream.http_url("localhost"),
        upstream.https_url("localhost"),
    ] {
        let out = Command::new("python3")
            .args(["-c", script])
            .env(
                "TARGET",
                format!("{url}/status/429?h=X-Up:1&h=Retry-After:3"),
            )
            .env("HTTP_PROXY", proxy.url())
            .env("HTTPS_PROXY", proxy.url())
            .env("NO_PROXY", "")
            .env("no_proxy", "")
            .env("REQUESTS_CA_BUNDLE", proxy.ca_path())
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "429 1 3",
            "{url}"
        );
    }
    assert_eq!(upstream.recorded().len(), 2);
    assert_eq!(
        proxy
            .metric(
                "pacegate_requests_total{destination=\"local\",group=\"\",outcome=\"forwarded\"}"
            )
            .await,
        2.0,
        "both requests went through pacegate"
    );
}

/// Through a proxy, by the client named: `Ok` with the status line when the TLS handshake
/// with the proxy's leaf succeeded, `Err` with the client's complaint when it did not.
async fn fetch(client: &str, proxy: &TestProxy, url: &str) -> Result<String, String> {
    let ca = proxy.ca_path();
    let out = match client {
        "curl" => Command::new("curl")
            .args(["-sS", "--noproxy", "", "-x", &proxy.url(), "--cacert"])
            .arg(&ca)
            .args(["-o", "/dev/null", "-w", "%{http_code}", url])
            .output()
            .await
            .unwrap(),
        "python" => Command::new("python3")
            .args(["-c", "import os, requests\nprint(requests.get(os.environ['TARGET'], timeout=20).status_code)"])
            .env("TARGET", url)
            .env("HTTPS_PROXY", proxy.url())
            .env("NO_PROXY", "")
            .env("no_proxy", "")
            .env("REQUESTS_CA_BUNDLE", &ca)
            .output()
            .await
            .unwrap(),
        _ => Command::new("node")
            .args(["-e", NODE_THROUGH_PROXY])
            .env("TARGET", url)
            .env("PROXY", proxy.addr.to_string())
            .env("CA", &ca)
            .output()
            .await
            .unwrap(),
    };
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(said)
    } else {
        Err(said)
    }
}

/// Node's own CONNECT and TLS, trusting only the CA in `CA`.
const NODE_THROUGH_PROXY: &str = r"
const http = require('http'), tls = require('tls'), net = require('net'), fs = require('fs');
const [host, port] = process.env.PROXY.split(':');
const target = new URL(process.env.TARGET);
const req = http.request({ host, port: +port, method: 'CONNECT', path: `${target.hostname}:${target.port}` });
req.on('connect', (res, socket) => {
  if (res.statusCode !== 200) { console.log(`CONNECT ${res.statusCode}`); process.exit(2); }
  const ip = net.isIP(target.hostname) !== 0;
  const s = tls.connect({ socket, host: target.hostname, servername: ip ? undefined : target.hostname,
                          ca: fs.readFileSync(process.env.CA) }, () => {
    s.write(`GET ${target.pathname} HTTP/1.1\r\nHost: ${target.host}\r\nConnection: close\r\n\r\n`);
  });
  let data = '';
  s.on('data', (d) => { data += d; });
  s.on('end', () => { console.log(data.split('\r\n')[0]); process.exit(0); });
  s.on('error', (e) => { console.log(`TLS ${e.code} ${e.message}`); process.exit(1); });
});
req.on('error', (e) => { console.log(`proxy ${e.message}`); process.exit(3); });
req.end();
";

#[tokio::test]
async fn clients_refuse_a_constrained_ca_s_leaf_for_a_host_outside_it() {
    require("curl", &["--version"]);
    require("python3", &["-c", "import requests"]);
    require("node", &["--version"]);
    let upstream = FakeUpstream::start().await;
    let ip = "[destinations.ip]\nhosts = [\"127.0.0.1\"]\nrate = 100000\nthrottle_statuses = []\nlockout_statuses = []\n";
    let mut proxy = TestProxy::start(&upstream.ca.cert_path, "", &format!("{LOCAL}{ip}")).await;
    let inside = format!("{}/status/200", upstream.https_url("localhost"));
    let outside = format!("{}/status/200", upstream.https_url("127.0.0.1"));
    // The CA made at start has no constraints: every client takes its leaf for the address.
    for client in ["curl", "python", "node"] {
        let got = fetch(client, &proxy, &outside).await;
        assert!(got.is_ok(), "{client}, unconstrained CA: {got:?}");
    }
    // A CA constrained to localhost: the address is outside it.
    proxy.stop().await;
    let dir = std::mem::replace(&mut proxy.dir, tempfile::tempdir().unwrap());
    let (cert, key) = (dir.path().join("ca.pem"), dir.path().join("ca-key.pem"));
    std::fs::remove_file(&cert).unwrap();
    std::fs::remove_file(&key).unwrap();
    pacegate::tls::write_new_ca_for(&cert, &key, Some(&["localhost"])).unwrap();
    let proxy = TestProxy::start_in(dir).await;
    for client in ["curl", "python", "node"] {
        let got = fetch(client, &proxy, &inside).await;
        assert!(
            got.as_deref().is_ok_and(|s| s.contains("200")),
            "{client}, inside: {got:?}"
        );
        let refused = fetch(client, &proxy, &outside).await.unwrap_err();
        assert!(
            refused.to_lowercase().contains("subtree"),
            "{client} refused the leaf outside the constraints, but not for them: {refused}"
        );
    }
}

/// `tests/clients`: the Node script and its `node_modules` (undici, installed by
/// scripts/test), and the Go program.
fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients")
}

/// The Go client, built once per test run.
fn go_client() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pacegate-go-client");
            let built = std::process::Command::new("go")
                .args(["build", "-o"])
                .arg(&out)
                .arg(".")
                .current_dir(clients_dir().join("go"))
                .output()
                .unwrap_or_else(|e| panic!("`go` is required by this test ({e}); scripts/test installs it (apt-get install golang-go)"));
            assert!(
                built.status.success(),
                "go build: {}",
                String::from_utf8_lossy(&built.stderr)
            );
            out
        })
        .clone()
}

#[derive(Clone, Copy, Debug)]
enum Worker {
    Node,
    Go,
}

/// One GET by `worker` with `proxy` as HTTP_PROXY and HTTPS_PROXY, trusting only `ca`:
/// its status and X-Up header, or what it said when it failed.
async fn worker_get(worker: Worker, proxy: &str, ca: &Path, target: &str) -> String {
    let mut cmd = match worker {
        Worker::Node => {
            assert!(
                clients_dir().join("node_modules/undici").is_dir(),
                "undici is required by this test; scripts/test installs it (npm ci --prefix tests/clients)"
            );
            let mut c = Command::new("node");
            c.arg(clients_dir().join("node.js"))
                .env("NODE_EXTRA_CA_CERTS", ca);
            c
        }
        Worker::Go => {
            let mut c = Command::new(go_client());
            c.env("SSL_CERT_FILE", ca);
            c
        }
    };
    let out = cmd
        .env("TARGET", target)
        .env("HTTP_PROXY", proxy)
        .env("HTTPS_PROXY", proxy)
        .env("NO_PROXY", "")
        .env("no_proxy", "")
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(
        out.status.success(),
        "{worker:?} {target}: {said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    said
}

const CLASSES: &str =
    "[classes]\norder = [\"interactive\", \"backfill\"]\ndefault = \"interactive\"\n";

#[tokio::test]
async fn node_and_go_through_interception_and_a_blind_tunnel() {
    require("node", &["--version"]);
    let intercepted = FakeUpstream::start().await;
    let tunnelled = FakeUpstream::start().await;
    let keys = "rate = 100000\nthrottle_statuses = []\nlockout_statuses = []\n";
    let config = format!(
        "[destinations.local]\nhosts = [\"localhost:{}\", \"localhost:{}\"]\n{keys}\n[destinations.pinned]\nhosts = [\"localhost:{}\"]\nintercept = false\n{keys}",
        intercepted.http.port(),
        intercepted.https.port(),
        tunnelled.https.port()
    );
    let proxy = TestProxy::start(&intercepted.ca.cert_path, "", &config).await;
    // Go sends nothing to a proxy for `localhost` itself; the fully qualified form it does.
    for worker in [Worker::Node, Worker::Go] {
        let plain = format!("{}/status/201?h=X-Up:1", intercepted.http_url("localhost."));
        assert_eq!(
            worker_get(worker, &proxy.url(), &proxy.ca_path(), &plain).await,
            "201 1"
        );
        let https = format!(
            "{}/status/201?h=X-Up:2",
            intercepted.https_url("localhost.")
        );
        assert_eq!(
            worker_get(worker, &proxy.url(), &proxy.ca_path(), &https).await,
            "201 2"
        );
        // A blind tunnel: the client talks TLS with the upstream itself.
        let pinned = format!("{}/status/202?h=X-Up:3", tunnelled.https_url("localhost."));
        assert_eq!(
            worker_get(worker, &proxy.url(), &tunnelled.ca.cert_path, &pinned).await,
            "202 3"
        );
    }
    assert_eq!(
        proxy
            .metric(
                "pacegate_requests_total{destination=\"local\",group=\"\",outcome=\"forwarded\"}"
            )
            .await,
        4.0
    );
    assert_eq!(
        proxy
            .metric(
                "pacegate_requests_total{destination=\"pinned\",group=\"\",outcome=\"tunneled\"}"
            )
            .await,
        2.0
    );
}

#[tokio::test]
async fn every_client_picks_its_class_by_proxy_user_name() {
    require("curl", &["--version"]);
    require("python3", &["-c", "import requests"]);
    require("node", &["--version"]);
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::start(&upstream.ca.cert_path, "", &format!("{CLASSES}{LOCAL}")).await;
    let granted = |class: &'static str| {
        let proxy = &proxy;
        async move {
            metric_value(
                &proxy.metrics().await,
                &format!(
                    "pacegate_granted_total{{class=\"{class}\",destination=\"local\",group=\"\"}}"
                ),
            )
        }
    };
    let target = format!("{}/status/200", upstream.https_url("localhost."));
    let as_backfill = format!("http://backfill:@{}", proxy.addr);
    let ca = proxy.ca_path();
    let curl = Command::new("curl")
        .args(["-sS", "--noproxy", "", "-x", &as_backfill, "--cacert"])
        .arg(&ca)
        .args(["-o", "/dev/null", "-w", "%{http_code}", &target])
        .output()
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&curl.stdout), "200");
    assert_eq!(granted("backfill").await, 1.0, "curl");

    let python = |proxy_url: String| {
        let ca = ca.clone();
        let target = target.clone();
        async move {
            Command::new("python3")
                .args(["-c", "import os, requests\nprint(requests.get(os.environ['TARGET'], timeout=20).status_code)"])
                .env("TARGET", target)
                .env("HTTPS_PROXY", proxy_url)
                .env("NO_PROXY", "")
                .env("no_proxy", "")
                .env("REQUESTS_CA_BUNDLE", ca)
                .output()
                .await
                .unwrap()
        }
    };
    let out = python(as_backfill.clone()).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "200");
    assert_eq!(granted("backfill").await, 2.0, "python, user:@");
    // Python requests drops a user name without a password: the README gives the `user:@`
    // form for it. Without the colon the request goes in the default class.
    let out = python(format!("http://backfill@{}", proxy.addr)).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "200");
    assert_eq!(
        granted("backfill").await,
        2.0,
        "python, user@: no name sent"
    );
    assert_eq!(granted("interactive").await, 1.0);

    // Which proxy URL forms carry the user name, per client: undici sends credentials only
    // when both the name and a password are there, Go with or without either.
    let cases = [
        (Worker::Node, "backfill:-@", true),
        (Worker::Node, "backfill:@", false),
        (Worker::Node, "backfill@", false),
        (Worker::Go, "backfill:@", true),
        (Worker::Go, "backfill@", true),
    ];
    let mut expected = 2.0;
    for (worker, userinfo, sent) in cases {
        let proxy_url = format!("http://{userinfo}{}", proxy.addr);
        let got = worker_get(worker, &proxy_url, &ca, &target).await;
        assert!(got.starts_with("200"), "{worker:?}: {got}");
        if sent {
            expected += 1.0;
        }
        assert_eq!(
            granted("backfill").await,
            expected,
            "{worker:?} {proxy_url}"
        );
    }
}

/// The venv scripts/test makes for the official `openai` SDK.
fn openai_python() -> PathBuf {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/.venv/bin/python");
    let ok = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "the official openai SDK is required by this test in tests/clients/.venv; scripts/test makes it (python3 -m venv tests/clients/.venv && tests/clients/.venv/bin/pip install -r tests/clients/requirements.txt)"
    );
    python
}

#[tokio::test]
async fn the_openai_sdk_reads_a_stream_asked_for_its_usage_on_its_behalf_as_it_would_directly() {
    let python = openai_python();
    let vendor = support::llm::FakeLlm::start(1e6, 1e6).await;
    let unused = FakeUpstream::start().await;
    let proxy = TestProxy::start(
        &unused.ca.cert_path,
        "",
        "[destinations.local]\nhosts = [\"localhost\"]\nrate = 100\n\
         [destinations.local.meters.tokens]\nper_minute = 600000\ncost = \"openai\"\n",
    )
    .await;
    // A streamed chat completion that does not ask for usage, read chunk by chunk as the
    // SDK's own objects.
    let script = r#"
import json, os, openai
client = openai.OpenAI(base_url=os.environ["BASE"], api_key="sk-test", max_retries=0)
stream = client.chat.completions.create(
    model="gpt-test", max_tokens=40, stream=True,
    messages=[{"role": "user", "content": "hello"}],
)
print(json.dumps([chunk.model_dump(exclude_unset=True) for chunk in stream]))
"#;
    let base = vendor.url().replace("/chat/completions", "");
    let mut read = Vec::new();
    for via in [None, Some(proxy.url())] {
        let mut cmd = Command::new(&python);
        cmd.args(["-c", script])
            .env("BASE", &base)
            .env("NO_PROXY", "")
            .env("no_proxy", "")
            .env_remove("HTTP_PROXY")
            .env_remove("http_proxy");
        if let Some(via) = &via {
            cmd.env("HTTP_PROXY", via);
        }
        let out = cmd.output().await.unwrap();
        assert!(
            out.status.success(),
            "the SDK failed {}: {}",
            if via.is_some() {
                "through pacegate"
            } else {
                "directly"
            },
            String::from_utf8_lossy(&out.stderr)
        );
        let chunks: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        read.push(chunks);
    }
    assert_eq!(
        read[0], read[1],
        "the SDK read other chunks through pacegate than directly"
    );
    assert!(read[1].as_array().unwrap().len() >= 3, "{}", read[1]);
    // pacegate asked the vendor for the usage, and settled from it.
    let charges = vendor.charges();
    assert_eq!(
        charges.iter().map(|c| c.asked_usage).collect::<Vec<_>>(),
        [false, true]
    );
    let units = proxy
        .metric("pacegate_meter_units_total{destination=\"local~tokens\",group=\"\"}")
        .await;
    assert_eq!(units, charges[1].tokens as f64);
}
