//! Graceful shutdown: stop accepting, let requests in flight finish, close tunnels at the grace
//! deadline; and the real binary exits 0 on SIGTERM.

use crate::support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::process::spawn_binary;
use support::{client, read_head, Alpn, FakeUpstream, TestProxy};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const LOCAL: &str = "[destinations.local]\nhosts = [\"localhost\"]\nrate = 100000\n# Forwarding scenarios: no verdicts, so every status passes through untouched.\nthrottle_statuses = []\nlockout_statuses = []\n";

#[tokio::test]
async fn a_request_in_flight_completes_during_shutdown() {
    let upstream = FakeUpstream::start().await;
    let mut proxy = TestProxy::start(&upstream.ca.cert_path, "", LOCAL).await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    for base in [
        upstream.http_url("localhost"),
        upstream.https_url("localhost"),
    ] {
        let request = tokio::spawn(via.get(format!("{base}/sleep/800")).send());
        support::eventually(
            Duration::from_secs(5),
            "the request at the upstream",
            || async {
                upstream
                    .recorded()
                    .iter()
                    .any(|r| r.path == "/sleep/800")
                    .then_some(())
            },
        )
        .await;
        upstream.clear();
        if base.starts_with("https") {
            let forced = proxy.stop().await;
            assert_eq!(forced, 0, "nothing had to be forced");
            let resp = request.await.unwrap().unwrap();
            assert_eq!(resp.status(), 200);
            assert_eq!(resp.text().await.unwrap(), "slept\n");
            assert!(
                TcpStream::connect(proxy.addr).await.is_err(),
                "no longer accepting"
            );
        } else {
            let resp = request.await.unwrap().unwrap();
            assert_eq!(resp.status(), 200);
        }
    }
}

#[tokio::test]
async fn tunnels_are_closed_at_the_grace_deadline() {
    let upstream = FakeUpstream::start().await;
    let mut proxy = TestProxy::start(
        &upstream.ca.cert_path,
        "unmatched = \"tunnel\"\nshutdown_grace = \"300ms\"",
        LOCAL,
    )
    .await;
    // An idle blind tunnel (127.0.0.1 is not a destination).
    let mut tunnel = TcpStream::connect(proxy.addr).await.unwrap();
    let connect = format!(
        "CONNECT 127.0.0.1:{} HTTP/1.1\r\n\r\n",
        upstream.https.port()
    );
    tunnel.write_all(connect.as_bytes()).await.unwrap();
    assert!(read_head(&mut tunnel).await.starts_with("HTTP/1.1 200"));
    let started = Instant::now();
    let forced = proxy.stop().await;
    assert_eq!(forced, 1, "the idle tunnel was still open at the deadline");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "shutdown took {:?}",
        started.elapsed()
    );
    let rest = support::read_until_close(&mut tunnel, Duration::from_secs(5)).await;
    assert!(rest.is_empty());
}

#[tokio::test]
async fn the_binary_drains_and_exits_zero_on_sigterm() {
    let upstream = FakeUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("pacegate.toml");
    std::fs::write(
        &config,
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\nallow_private_upstreams = true\nports = [\"1024-65535\"]\n[admin]\nlisten = \"127.0.0.1:0\"\n[tls]\ngenerate_ca = true\nextra_upstream_roots = [\"{}\"]\n{LOCAL}",
            upstream.ca.cert_path.display()
        ),
    )
    .unwrap();
    let instance = spawn_binary(&config);
    let (child, addr, logs) = (instance.child, instance.proxy, instance.logs);
    let via = client(
        Some(&format!("http://{addr}")),
        &[&dir.path().join("ca.pem")],
        Alpn::Http1,
    );
    let request = tokio::spawn(
        via.get(format!("{}/sleep/800", upstream.https_url("localhost")))
            .send(),
    );
    support::eventually(
        Duration::from_secs(10),
        "the request at the upstream",
        || async { (!upstream.recorded().is_empty()).then_some(()) },
    )
    .await;
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let resp = request.await.unwrap().unwrap();
    assert_eq!(resp.status(), 200, "the request in flight completed");
    let exit = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap();
    assert_eq!(exit.code(), Some(0));
    // One canonical line per request, with the fixed field names. The reader thread has seen
    // everything once the pipe closes with the process.
    let lines = support::eventually(Duration::from_secs(5), "the final log lines", || async {
        let lines = logs.json();
        lines
            .iter()
            .any(|v| v["message"] == "pacegate stopped")
            .then_some(lines)
    })
    .await;
    let request_line = lines
        .iter()
        .find(|v| v["target"] == "pacegate::request" && v["outcome"] == "forwarded")
        .expect("a canonical request line");
    for field in ["destination", "method", "status", "duration_ms", "reason"] {
        assert!(
            !request_line[field].is_null(),
            "{field} missing from {request_line}"
        );
    }
    assert_eq!(request_line["destination"], "local");
    assert!(
        !lines.iter().any(|v| v.to_string().contains("PRIVATE KEY")),
        "the CA key is never logged"
    );
}
