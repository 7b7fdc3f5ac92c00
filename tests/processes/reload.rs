//! Hot reload on the real binary: SIGHUP (or `POST /reload`) reads the config file again; a
//! rate change governs the next slot under load without failing a request; budgets, lockouts
//! and connections survive; an invalid file changes nothing and says why; what needs a
//! restart is named and kept.

use crate::support;
use crate::support::fleet::beside;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::process::{config_text, spawn_binary, Instance};
use support::{admin_client, busiest, client, eventually, metric_value, Alpn, FakeUpstream};

/// A config for one instance: `keys` for destination `local` (localhost), `more` after it.
fn write_config(
    dir: &Path,
    upstream: &FakeUpstream,
    listen: &str,
    keys: &str,
    more: &str,
) -> PathBuf {
    let path = dir.join("pacegate.toml");
    let text = config_text(
        &format!("listen = \"{listen}\""),
        "",
        Some(&upstream.ca.cert_path),
        &format!(
            "[destinations.local]\nhosts = [\"localhost\"]\nmax_wait = \"30s\"\n{keys}\n{more}"
        ),
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn hang_up(instance: &Instance) {
    assert!(Command::new("kill")
        .args(["-HUP", &instance.child.id().to_string()])
        .status()
        .unwrap()
        .success());
}

/// The last reload's JSON, once there is one with `at_least` reloads counted in all.
async fn reloaded(instance: &Instance, at_least: f64) -> serde_json::Value {
    eventually(Duration::from_secs(10), "the reload", || async {
        let metrics = instance.admin_get("/metrics").await;
        let done = metric_value(&metrics, "pacegate_config_reloads_total{result=\"ok\"}")
            + metric_value(&metrics, "pacegate_config_reloads_total{result=\"error\"}");
        if done < at_least {
            return None;
        }
        serde_json::from_str(&instance.admin_get("/reload").await).ok()
    })
    .await
}

/// Waits for a log line of `instance` that `matches` (lines are written every 100 ms).
async fn logged(instance: &Instance, matches: impl Fn(&serde_json::Value) -> bool) {
    eventually(Duration::from_secs(5), "the log line", || async {
        instance.logs.json().iter().any(&matches).then_some(())
    })
    .await;
}

async fn status_of_local(instance: &Instance) -> serde_json::Value {
    let all: serde_json::Value =
        serde_json::from_str(&instance.admin_get("/status").await).unwrap();
    all.as_array()
        .unwrap()
        .iter()
        .find(|d| d["destination"] == "local")
        .cloned()
        .expect("destination local")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_change_governs_the_next_slot_under_load_and_no_request_fails() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &upstream, "127.0.0.1:0", "rate = 5", "");
    let instance = spawn_binary(&config);
    let via = client(
        Some(&format!("http://{}", instance.proxy)),
        &[&dir.path().join("ca.pem")],
        Alpn::Http1,
    );
    // Eight workers back to back on keep-alive connections, half of them through
    // intercepted CONNECT sessions that stay open across the reload.
    let stop_at = Instant::now() + Duration::from_secs(4);
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let via = via.clone();
            let base = if w % 2 == 0 {
                upstream.http_url("localhost")
            } else {
                upstream.https_url("localhost")
            };
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                while Instant::now() < stop_at {
                    let s = via.get(format!("{base}/?w={w}")).send().await;
                    statuses.push(s.map(|r| r.status().as_u16()).unwrap_or(0));
                }
                statuses
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    write_config(dir.path(), &upstream, "127.0.0.1:0", "rate = 50", "");
    let reload_at = Instant::now();
    hang_up(&instance);
    let mut statuses = Vec::new();
    for w in workers {
        statuses.extend(w.await.unwrap());
    }
    assert!(
        statuses.iter().all(|s| *s == 200),
        "every request succeeded across the reload: {statuses:?}"
    );
    let last = reloaded(&instance, 1.0).await;
    assert_eq!(last["result"], "ok", "{last}");
    assert_eq!(last["destinations"]["changed"][0], "local", "{last}");
    let at = upstream.arrivals();
    let before: Vec<Instant> = at.iter().copied().filter(|t| *t < reload_at).collect();
    assert!(
        busiest(&before, Duration::from_secs(1)) <= 6,
        "5/s before the reload"
    );
    // The slot already reserved at 5/s (200 ms), then 50/s: a second from 400 ms after the
    // signal holds about 50.
    let from = reload_at + Duration::from_millis(400);
    let after = at
        .iter()
        .filter(|t| **t >= from && **t < from + Duration::from_secs(1))
        .count();
    assert!(
        (35..=51).contains(&after),
        "{after} arrivals in the second after the reload, at 50/s"
    );
}

#[tokio::test]
async fn the_backoff_and_a_lockout_survive_a_reload() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let keys = "rate = 100\nretry_throttled = 0";
    let config = write_config(dir.path(), &upstream, "127.0.0.1:0", keys, "");
    let instance = spawn_binary(&config);
    let via = client(
        Some(&format!("http://{}", instance.proxy)),
        &[],
        Alpn::Http1,
    );
    let base = upstream.http_url("localhost");
    assert_eq!(
        via.get(format!("{base}/status/429"))
            .send()
            .await
            .unwrap()
            .status(),
        429
    );
    assert_eq!(
        via.get(format!("{base}/status/403"))
            .send()
            .await
            .unwrap()
            .status(),
        403
    );
    let before = status_of_local(&instance).await;
    assert_eq!(before["backoff"], 2.0);
    assert_eq!(before["lock"]["status"], 403);

    write_config(
        dir.path(),
        &upstream,
        "127.0.0.1:0",
        "rate = 200\nretry_throttled = 0",
        "",
    );
    hang_up(&instance);
    assert_eq!(reloaded(&instance, 1.0).await["result"], "ok");
    let after = status_of_local(&instance).await;
    assert_eq!(after["rate"], 200.0, "the new rate is in force");
    assert_eq!(after["backoff"], 2.0, "the backoff was kept");
    assert_eq!(after["lock"], before["lock"], "the lockout was kept");
    let refused = via.get(format!("{base}/status/200")).send().await.unwrap();
    assert_eq!(refused.status(), 403, "still locked out");
}

#[tokio::test]
async fn an_invalid_file_changes_nothing_and_says_why() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &upstream, "127.0.0.1:0", "rate = 7", "");
    let instance = spawn_binary(&config);
    write_config(
        dir.path(),
        &upstream,
        "127.0.0.1:0",
        "rate = -1",
        "[log]\nrequests = \"some\"",
    );
    // Through the admin listener this time.
    let answer = admin_client()
        .post(format!("http://{}/reload", instance.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 422);
    let last: serde_json::Value = serde_json::from_str(&answer.text().await.unwrap()).unwrap();
    assert_eq!(last["result"], "error");
    let problems = last["problems"].to_string();
    for key in ["destinations.local.rate", "log.requests"] {
        assert!(problems.contains(key), "every problem, by key: {problems}");
    }
    assert_eq!(
        status_of_local(&instance).await["rate"],
        7.0,
        "the old config stays"
    );
    let metrics = instance.admin_get("/metrics").await;
    assert_eq!(
        metric_value(&metrics, "pacegate_config_reloads_total{result=\"error\"}"),
        1.0
    );
    assert_eq!(
        metric_value(&metrics, "pacegate_config_last_reload_successful"),
        0.0
    );
    // An ERROR line per problem, with its key.
    logged(&instance, |v| {
        v["level"] == "ERROR"
            && v["problem"]
                .as_str()
                .is_some_and(|p| p.starts_with("destinations.local.rate"))
    })
    .await;
    // `status` reads a config for the admin token: the file being edited is invalid now.
    let readable = dir.path().join("status.toml");
    std::fs::write(&readable, "[tls]\ngenerate_ca = true\n").unwrap();
    let table = Command::new(env!("CARGO_BIN_EXE_pacegate"))
        .args(["status", "--config"])
        .arg(&readable)
        .args(["--admin", &format!("http://{}", instance.admin)])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("LAST RELOAD FAILED"), "{table}");

    write_config(dir.path(), &upstream, "127.0.0.1:0", "rate = 9", "");
    hang_up(&instance);
    assert_eq!(reloaded(&instance, 2.0).await["result"], "ok");
    assert_eq!(status_of_local(&instance).await["rate"], 9.0);
    let metrics = instance.admin_get("/metrics").await;
    assert_eq!(
        metric_value(&metrics, "pacegate_config_last_reload_successful"),
        1.0
    );
}

#[tokio::test]
async fn destinations_come_and_go_and_what_needs_a_restart_is_kept_and_named() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &upstream, "127.0.0.1:0", "rate = 100", "");
    let instance = spawn_binary(&config);
    let via = client(
        Some(&format!("http://{}", instance.proxy)),
        &[],
        Alpn::Http1,
    );
    let other = format!("{}/", upstream.http_url("127.0.0.1"));
    assert_eq!(
        via.get(&other).send().await.unwrap().status(),
        403,
        "not configured yet"
    );

    // Add `other`, and ask for another proxy port (a restart's business).
    let added = "[destinations.other]\nhosts = [\"127.0.0.1\"]\nrate = 100";
    write_config(dir.path(), &upstream, "127.0.0.1:1", "rate = 100", added);
    let preview = Command::new(env!("CARGO_BIN_EXE_pacegate"))
        .args(["check-config", "--config"])
        .arg(&config)
        .args(["--admin", &format!("http://{}", instance.admin)])
        .output()
        .unwrap();
    let preview = String::from_utf8_lossy(&preview.stdout);
    assert!(
        preview.contains("reload applies  destinations.other"),
        "{preview}"
    );
    assert!(
        preview.contains("needs restart   proxy.listen"),
        "{preview}"
    );
    hang_up(&instance);
    let last = reloaded(&instance, 1.0).await;
    assert_eq!(last["destinations"]["added"][0], "other", "{last}");
    assert_eq!(last["needs_restart"][0], "proxy.listen", "{last}");
    assert_eq!(
        via.get(&other).send().await.unwrap().status(),
        200,
        "served on the old port"
    );
    logged(&instance, |v| {
        v["level"] == "WARN" && v["key"] == "proxy.listen"
    })
    .await;

    // Remove `local`: its hosts are refused from now on.
    std::fs::write(
        &config,
        std::fs::read_to_string(&config).unwrap().replace(
            "[destinations.local]\nhosts = [\"localhost\"]",
            "[destinations.gone]\nhosts = [\"gone.invalid\"]",
        ),
    )
    .unwrap();
    hang_up(&instance);
    let last = reloaded(&instance, 2.0).await;
    assert_eq!(last["destinations"]["removed"][0], "local", "{last}");
    let local = via
        .get(format!("{}/", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(local.status(), 403, "no destination for localhost any more");
}

#[tokio::test]
async fn proxy_authentication_is_turned_on_by_a_reload() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &upstream, "127.0.0.1:0", "rate = 100", "");
    let instance = spawn_binary(&config);
    let url = format!("{}/status/200", upstream.http_url("localhost"));
    let anyone = client(
        Some(&format!("http://{}", instance.proxy)),
        &[],
        Alpn::Http1,
    );
    assert_eq!(anyone.get(&url).send().await.unwrap().status(), 200);

    let digest = hex::encode(pacegate::config::User::digest(b"pw"));
    let auth =
        format!("[proxy.auth]\nusers = [{{ name = \"worker\", password_sha256 = \"{digest}\" }}]");
    write_config(dir.path(), &upstream, "127.0.0.1:0", "rate = 100", &auth);
    hang_up(&instance);
    let last = reloaded(&instance, 1.0).await;
    assert_eq!(last["applied"], serde_json::json!(["proxy.auth"]), "{last}");
    assert_eq!(anyone.get(&url).send().await.unwrap().status(), 407);
    let worker = client(
        Some(&format!("http://worker:pw@{}", instance.proxy)),
        &[],
        Alpn::Http1,
    );
    assert_eq!(worker.get(&url).send().await.unwrap().status(), 200);
}
