//! The request log: one line per request with the canonical fields, all of them or only the
//! ones that went wrong (`[log] requests`).

use crate::support;
use crate::support::fleet::beside;

use std::time::Duration;

use support::process::{Instance, Logs, Served};
use support::{client, Alpn, FakeUpstream};

/// The real binary with JSON logs and `[log] requests = "{requests}"`.
fn start(requests: &str) -> Served {
    Served::start(
        "",
        None,
        &format!("[log]\nrequests = \"{requests}\"\n[destinations.local]\nhosts = [\"localhost\"]\nrate = 100000\nthrottle_statuses = []\nlockout_statuses = []"),
    )
}

/// Sends a 200, an upstream 404 and a refused request (no destination) through `instance`,
/// stops it, and returns the request lines it logged.
async fn three_requests(upstream: &FakeUpstream, instance: Instance) -> Vec<serde_json::Value> {
    let via = client(
        Some(&format!("http://{}", instance.proxy)),
        &[],
        Alpn::Http1,
    );
    let base = upstream.http_url("localhost");
    for (path, status) in [
        (format!("{base}/status/200"), 200),
        (format!("{base}/status/404"), 404),
        (format!("{}/", upstream.http_url("elsewhere.invalid")), 403),
    ] {
        let response = via.get(&path).send().await.unwrap();
        assert_eq!(response.status(), status, "{path}");
    }
    stopped(instance).await
}

/// Stops `instance` with SIGTERM, sees it exit cleanly, and returns its logs once they hold
/// the last line it writes, "pacegate stopped" (in either format).
async fn terminated(instance: Instance) -> Logs {
    let Instance { child, logs, .. } = instance;
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let exit = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap();
    assert_eq!(exit.code(), Some(0));
    support::eventually(Duration::from_secs(5), "the final log line", || async {
        logs.lines()
            .iter()
            .any(|l| l.contains("pacegate stopped"))
            .then_some(())
    })
    .await;
    logs
}

/// Stops `instance` and returns its request lines, every one of them.
async fn stopped(instance: Instance) -> Vec<serde_json::Value> {
    terminated(instance)
        .await
        .json()
        .into_iter()
        .filter(|v| v["target"] == "pacegate::request")
        .collect()
}

fn statuses(lines: &[serde_json::Value]) -> Vec<u64> {
    lines.iter().filter_map(|v| v["status"].as_u64()).collect()
}

#[tokio::test]
async fn every_request_is_logged_with_its_fields_by_default() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let served = start("all");
    let lines = three_requests(&upstream, served.instance).await;
    assert_eq!(statuses(&lines), [200, 404, 403]);
    // The canonical fields are JSON fields, not text in the message.
    let ok = &lines[0];
    assert_eq!(ok["destination"], "local");
    assert_eq!(ok["method"], "GET");
    assert_eq!(ok["outcome"], "forwarded");
    // Host and port: a path may carry secrets.
    assert_eq!(
        ok["host"].as_str(),
        upstream.http_url("localhost").strip_prefix("http://"),
        "{ok}"
    );
    assert!(ok["duration_ms"].as_f64().is_some(), "{ok}");
    assert!(ok["waited_ms"].as_f64().is_some(), "{ok}");
    assert_eq!(lines[2]["outcome"], "denied");
    assert_eq!(lines[2]["destination"], "unmatched");
}

#[tokio::test]
async fn errors_logs_only_what_was_not_answered_well() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let served = start("errors");
    let lines = three_requests(&upstream, served.instance).await;
    assert_eq!(statuses(&lines), [404, 403], "{lines:?}");
}

#[tokio::test]
async fn none_logs_no_request() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let served = start("none");
    let lines = three_requests(&upstream, served.instance).await;
    assert_eq!(lines, Vec::<serde_json::Value>::new());
}

#[tokio::test]
async fn the_text_log_as_shipped_writes_each_request_line_unless_its_filter_says_not() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    for (filter, shown) in [("info", true), ("info,pacegate::request=off", false)] {
        let rest = "[destinations.local]\nhosts = [\"localhost\"]\nrate = 100000";
        let Served {
            instance,
            dir: _dir,
        } = Served::start_logging("text", &[("PACEGATE_LOG", filter)], "", None, rest);
        let via = client(
            Some(&format!("http://{}", instance.proxy)),
            &[],
            Alpn::Http1,
        );
        let url = format!("{}/status/200", upstream.http_url("localhost"));
        assert_eq!(via.get(&url).send().await.unwrap().status(), 200);
        let lines = terminated(instance).await.lines();
        let requests: Vec<&String> = lines
            .iter()
            .filter(|l| l.contains(" INFO pacegate::request: "))
            .collect();
        if shown {
            assert_eq!(requests.len(), 1, "{filter}: {lines:#?}");
            let host = upstream.http_url("localhost");
            let host = host.strip_prefix("http://").unwrap();
            let expected = format!(
                "destination=\"local\" method=GET host={host} outcome=forwarded status=200 "
            );
            assert!(requests[0].contains(&expected), "{}", requests[0]);
        } else {
            assert_eq!(requests, Vec::<&String>::new(), "{filter}");
        }
    }
}

#[test]
fn a_bad_value_is_a_config_problem_with_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[log]\nrequests = \"some\"\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pacegate"))
        .args(["check-config", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("log.requests"), "{stderr}");
}
