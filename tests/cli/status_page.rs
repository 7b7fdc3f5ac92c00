//! The status page (`GET /` on the admin listener) in headless Chromium: a locked, a paced
//! and a shadow destination as an operator on a phone sees them, an unlock through the
//! page's button (which asks for the admin token), and a screenshot kept as an artifact.

use crate::support;

use std::path::Path;

use support::{client, Alpn, FakeUpstream, TestProxy};

const TOKEN_ENV: &str = "PACEGATE_STATUS_PAGE_TOKEN";
const TOKEN: &str = "page-token";

#[tokio::test]
async fn the_page_shows_each_destination_and_unlocks_through_its_button() {
    let clients = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients");
    assert!(
        clients.join("node_modules/puppeteer-core").is_dir(),
        "puppeteer-core is required by this test; scripts/test installs it (npm ci --prefix tests/clients)"
    );
    assert!(
        Path::new("/usr/bin/chromium").is_file() || std::env::var_os("CHROMIUM").is_some(),
        "Chromium is required by this test; scripts/test installs it (apt-get install chromium), or set CHROMIUM"
    );
    // Only this test reads it; the config names it.
    std::env::set_var(TOKEN_ENV, TOKEN);
    let upstream = FakeUpstream::start().await;
    let (http, https) = (upstream.http.port(), upstream.https.port());
    let destinations = format!(
        r#"
[classes]
order = ["interactive", "backfill"]
default = "interactive"
[cache]
memory = "16MiB"
[destinations.locked]
hosts = ["localhost:{http}"]
rate = 100
cache = true
[destinations.paced]
hosts = ["localhost:{https}"]
rate = 2
retry_throttled = 0
[destinations.shadow]
hosts = ["127.0.0.1:{http}"]
rate = 5
mode = "shadow"
"#
    );
    let proxy = TestProxy::start_with(
        &upstream.ca.cert_path,
        "",
        &format!("token_env = \"{TOKEN_ENV}\""),
        &destinations,
    )
    .await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let locked = via
        .get(format!("{}/status/403", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(locked.status(), 403);
    // The vendor throttles `paced` and says how much is left.
    let paced = via
        .get(format!(
            "{}/status/429?h=Retry-After:600&h=X-RateLimit-Limit:100&h=X-RateLimit-Remaining:0&h=X-RateLimit-Reset-After:600",
            upstream.https_url("localhost")
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(paced.status(), 429);
    let shadow = via
        .get(format!("{}/status/200", upstream.http_url("127.0.0.1")))
        .send()
        .await
        .unwrap();
    assert_eq!(shadow.status(), 200);
    // A bot wall challenges `shadow` once: the card says so, and what to do.
    let challenged = via
        .get(format!(
            "{}/status/403?h=cf-mitigated:challenge",
            upstream.http_url("127.0.0.1")
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(challenged.status(), 403);

    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page.png");
    let out = tokio::process::Command::new("node")
        .arg(clients.join("status_page.js"))
        .arg(format!("http://{}", proxy.admin))
        .arg(&shot)
        .arg(TOKEN)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let found: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    eprintln!("screenshot: {}", shot.display());

    assert_eq!(found["errors"], serde_json::json!([]), "no script error");
    assert_eq!(
        found["outside"],
        serde_json::json!([]),
        "no request beyond the admin listener"
    );
    assert!(found["contentType"]
        .as_str()
        .unwrap()
        .starts_with("text/html"));
    assert!(found["csp"]
        .as_str()
        .unwrap()
        .contains("default-src 'none'"));
    assert_eq!(
        found["overflowsPhone"], false,
        "readable on a phone: no sideways scrolling"
    );
    assert_eq!(found["store"], "ok");
    let card = |when: &str, name: &str| {
        found[when]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no card for {name} {when}: {found}"))
            .clone()
    };
    let locked = card("before", "locked");
    assert_eq!(locked["locked"], true);
    assert_eq!(locked["unlockButton"], true);
    assert!(locked["lock"].as_str().unwrap().contains("403"), "{locked}");
    let paced = card("before", "paced");
    assert_eq!(paced["locked"], false);
    assert_eq!(paced["backoff"], "×2");
    assert!(
        paced["pause"]
            .as_str()
            .unwrap()
            .contains("min left (paused"),
        "{paced}"
    );
    assert!(
        paced["rates"]
            .as_str()
            .unwrap()
            .starts_with("configured 2.00/s"),
        "{paced}"
    );
    assert!(
        paced["vendor"].as_str().unwrap().contains("0/100 left"),
        "{paced}"
    );
    assert_eq!(
        paced["classes"],
        serde_json::json!(["interactive", "backfill"])
    );
    assert!(paced["sparklineSamples"].as_u64().unwrap() >= 1, "{paced}");
    let shadow = card("before", "shadow");
    assert_eq!(shadow["mode"], "shadow");
    assert_eq!(shadow["shadowBadge"], true);
    let wall = shadow["challenges"].as_str().unwrap_or_default();
    assert!(
        wall.contains("1 of 2 responses")
            && wall.contains("cloudflare 1")
            && wall.contains("intercept = false"),
        "{shadow}"
    );
    assert_eq!(paced["challenges"], serde_json::Value::Null, "{paced}");
    // What the cache saved, on the card of the destination that has one.
    let cache = card("before", "locked")["cache"].clone();
    assert!(
        cache
            .as_str()
            .is_some_and(|c| c.contains("0% of 1 requests took no slot")),
        "{cache}"
    );
    assert_eq!(paced["cache"], serde_json::Value::Null, "{paced}");

    // The unlock went through the page: it asked for the token, and the lock is gone.
    assert_eq!(found["prompts"].as_array().unwrap().len(), 1, "{found}");
    assert_eq!(found["message"], "unlocked locked");
    assert_eq!(card("after", "locked")["locked"], false);
    assert_eq!(card("after", "locked")["unlockButton"], false);
    let status = proxy
        .metric("pacegate_locked{destination=\"locked\",group=\"\"}")
        .await;
    assert_eq!(status, 0.0, "unlocked in the pacer, not only on the page");
    assert!(
        std::fs::metadata(&shot).unwrap().len() > 10_000,
        "a screenshot was kept"
    );
}
