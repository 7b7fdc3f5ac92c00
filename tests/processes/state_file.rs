//! The memory store's state file through `kill -9`, as an operator's single instance meets a
//! crash or an OOM kill: a lockout answered is kept, the vendor's count kept a second ago is
//! kept, and the state file loads (never torn).

use crate::support;

use std::time::Duration;

use support::process::spawn_binary;
use support::{admin_get, FakeUpstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockout_answered_and_the_vendor_s_count_outlive_kill_9() {
    let _alone = support::fleet::alone().await;
    let upstream = FakeUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.json");
    let config = dir.path().join("pacegate.toml");
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
ca_cert = "{dir}/ca.pem"
ca_key = "{dir}/ca-key.pem"
[store]
state_file = "{state}"
[destinations.local]
hosts = ["localhost"]
rate = 100
[destinations.other]
hosts = ["127.0.0.1"]
rate = 100
"#,
            dir = dir.path().display(),
            state = state.display()
        ),
    )
    .unwrap();
    let first = spawn_binary(&config);
    let via = |proxy| {
        reqwest::Client::builder()
            .proxy(reqwest::Proxy::http(format!("http://{proxy}")).unwrap())
            .build()
            .unwrap()
    };
    let client = via(first.proxy);
    // The vendor's count, on one destination; then a second for the keeper to write it.
    let reset = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let counted = format!(
        "{}/status/200?h=x-ratelimit-remaining:42&h=x-ratelimit-limit:100&h=x-ratelimit-reset:{reset}",
        upstream.http_url("127.0.0.1")
    );
    assert_eq!(client.get(&counted).send().await.unwrap().status(), 200);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    // A lockout on the other, answered: then killed at once.
    let locked = format!("{}/status/403", upstream.http_url("localhost"));
    assert_eq!(client.get(&locked).send().await.unwrap().status(), 403);
    assert!(std::process::Command::new("kill")
        .args(["-9", &first.child.id().to_string()])
        .status()
        .unwrap()
        .success());
    drop(first);
    // A new process finds both, from a file it can read.
    let second = spawn_binary(&config);
    let status: serde_json::Value =
        serde_json::from_str(&admin_get(second.admin, "/status").await).unwrap();
    let of = |name: &str| {
        status
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["destination"] == name)
            .cloned()
            .unwrap()
    };
    let local = of("local");
    assert_eq!(local["lock"]["status"], 403, "{local}");
    let other = of("other");
    assert_eq!(other["vendor"]["remaining"], 42, "{other}");
    let client = via(second.proxy);
    let refused = client.get(&locked).send().await.unwrap();
    assert_eq!(refused.status(), 403);
    let ps = refused.headers()["proxy-status"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(ps.contains("destination_unavailable"), "{ps}");
    assert_eq!(
        upstream.recorded().len(),
        2,
        "the locked request went nowhere"
    );
}
