//! Real clients as operators run them: curl and Python requests, configured only through their
//! usual proxy settings and a CA bundle.

mod support;

use support::{FakeUpstream, TestProxy};
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
            .metric("pacegate_requests_total{destination=\"local\",outcome=\"forwarded\"}")
            .await,
        2.0,
        "both requests went through pacegate"
    );
}
