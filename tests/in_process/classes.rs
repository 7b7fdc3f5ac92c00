//! Priority classes through the real proxy: how a request names its class, what a wrong name
//! gets, and that the class travels with the request through its retries.

use crate::support;

use support::{client, metric_value, Alpn, FakeUpstream, TestProxy};

const CLASSES: &str = r#"
[classes]
order = ["interactive", "scheduled", "backfill"]
default = "scheduled"
[classes.max_wait]
interactive = "5s"
"#;

async fn start(upstream: &FakeUpstream) -> TestProxy {
    let config = format!(
        "{CLASSES}\n[destinations.local]\nhosts = [\"localhost\"]\nrate = 50\nretry_throttled = 2\n"
    );
    TestProxy::start(&upstream.ca.cert_path, "", &config).await
}

async fn granted(proxy: &TestProxy, class: &str) -> f64 {
    metric_value(
        &proxy.metrics().await,
        &format!("pacegate_granted_total{{class=\"{class}\",destination=\"local\",group=\"\"}}"),
    )
}

#[tokio::test]
async fn the_class_header_picks_the_class_and_never_reaches_the_upstream() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream).await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    for url in [
        format!("{}/headers", upstream.http_url("localhost")),
        format!("{}/headers", upstream.https_url("localhost")),
    ] {
        let resp = via
            .get(&url)
            .header("Pacegate-Class", "backfill")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let seen = resp.text().await.unwrap().to_ascii_lowercase();
        assert!(!seen.contains("pacegate-class"), "{url}: {seen}");
    }
    assert_eq!(granted(&proxy, "backfill").await, 2.0);
    // No header, no user name: the default class.
    let url = format!("{}/", upstream.http_url("localhost"));
    assert_eq!(via.get(&url).send().await.unwrap().status(), 200);
    assert_eq!(granted(&proxy, "scheduled").await, 1.0);
}

#[tokio::test]
async fn the_proxy_user_name_picks_the_class() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream).await;
    let with_user = proxy.url().replace("http://", "http://interactive@");
    let via = client(Some(&with_user), &[&proxy.ca_path()], Alpn::Http1);
    for url in [
        format!("{}/", upstream.http_url("localhost")),
        format!("{}/", upstream.https_url("localhost")),
    ] {
        assert_eq!(via.get(&url).send().await.unwrap().status(), 200, "{url}");
    }
    assert_eq!(granted(&proxy, "interactive").await, 2.0);
}

#[tokio::test]
async fn an_unknown_class_is_a_clear_400_never_a_default() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream).await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let resp = via
        .get(format!("{}/", upstream.http_url("localhost")))
        .header("Pacegate-Class", "urgent")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let status = resp.headers()["proxy-status"].to_str().unwrap().to_owned();
    assert!(
        status.starts_with("pacegate; error=http_request_error"),
        "{status}"
    );
    assert!(status.contains("unknown class `urgent`"), "{status}");
    assert!(
        status.contains("interactive, scheduled, backfill"),
        "{status}"
    );
    // A misspelt user name too, for https as well (the CONNECT is refused).
    let typo = proxy.url().replace("http://", "http://bakfill@");
    let via = client(Some(&typo), &[&proxy.ca_path()], Alpn::Http1);
    let resp = via
        .get(format!("{}/", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert!(via
        .get(format!("{}/", upstream.https_url("localhost")))
        .send()
        .await
        .is_err());
    assert!(
        upstream.recorded().is_empty(),
        "nothing reached the upstream"
    );
}

#[tokio::test]
async fn retries_keep_their_class() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream).await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let resp = via
        .get(format!("{}/flaky/2/k", upstream.https_url("localhost")))
        .header("Pacegate-Class", "backfill")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(upstream.recorded().len(), 3);
    // Three slots, all granted to backfill.
    assert_eq!(granted(&proxy, "backfill").await, 3.0);
    assert_eq!(granted(&proxy, "scheduled").await, 0.0);
}

#[tokio::test]
async fn with_authentication_the_user_picks_a_class_when_it_names_one() {
    // sha256("pw")
    let hash = "30c952fab122c3f9759f02a6d95c3758b246b4fee239957b2d4fee46e26170c4";
    let auth = format!(
        "[proxy.auth]\nusers = [{{ name = \"backfill\", password_sha256 = \"{hash}\" }}, {{ name = \"worker\", password_sha256 = \"{hash}\" }}]"
    );
    let upstream = FakeUpstream::start().await;
    let config = format!("{CLASSES}\n[destinations.local]\nhosts = [\"localhost\"]\nrate = 50\n");
    let proxy = TestProxy::start(&upstream.ca.cert_path, &auth, &config).await;
    let url = format!("{}/", upstream.http_url("localhost"));
    for (user, class) in [("backfill", "backfill"), ("worker", "scheduled")] {
        let with_user = proxy
            .url()
            .replace("http://", &format!("http://{user}:pw@"));
        let via = client(Some(&with_user), &[&proxy.ca_path()], Alpn::Http1);
        assert_eq!(via.get(&url).send().await.unwrap().status(), 200, "{user}");
        assert_eq!(granted(&proxy, class).await, 1.0, "{user}");
    }
    // The class still needs the password.
    let wrong = proxy.url().replace("http://", "http://backfill:nope@");
    let via = client(Some(&wrong), &[&proxy.ca_path()], Alpn::Http1);
    assert_eq!(via.get(&url).send().await.unwrap().status(), 407);
}

#[tokio::test]
async fn a_user_may_use_only_its_classes_by_header_too_and_inside_intercepted_sessions() {
    // sha256("pw")
    let hash = "30c952fab122c3f9759f02a6d95c3758b246b4fee239957b2d4fee46e26170c4";
    let auth = format!(
        "[proxy.auth]\nusers = [{{ name = \"worker\", password_sha256 = \"{hash}\", classes = [\"backfill\"] }}, {{ name = \"ops\", password_sha256 = \"{hash}\" }}]"
    );
    let upstream = FakeUpstream::start().await;
    let config = format!("{CLASSES}\n[destinations.local]\nhosts = [\"localhost\"]\nrate = 50\n");
    let proxy = TestProxy::start(&upstream.ca.cert_path, &auth, &config).await;
    let as_user = |user: &str| {
        let url = proxy
            .url()
            .replace("http://", &format!("http://{user}:pw@"));
        client(
            Some(&url),
            &[&proxy.ca_path(), &upstream.ca.cert_path],
            Alpn::Http1,
        )
    };
    let worker = as_user("worker");
    // Naming no class, the worker gets its own, not the default it may not use.
    let plain = format!("{}/", upstream.http_url("localhost"));
    assert_eq!(worker.get(&plain).send().await.unwrap().status(), 200);
    assert_eq!(granted(&proxy, "backfill").await, 1.0);
    // Claiming the most urgent class, by header, plain and intercepted: refused, and said why.
    for url in [
        plain.clone(),
        format!("{}/", upstream.https_url("localhost")),
    ] {
        let resp = worker
            .get(&url)
            .header("Pacegate-Class", "interactive")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 403, "{url}");
        let ps = resp.headers()["proxy-status"].to_str().unwrap().to_owned();
        assert!(ps.contains("may not use class `interactive`"), "{ps}");
    }
    assert_eq!(granted(&proxy, "interactive").await, 0.0);
    // A user with no list may use any class.
    let ops = as_user("ops");
    let resp = ops
        .get(&plain)
        .header("Pacegate-Class", "interactive")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(granted(&proxy, "interactive").await, 1.0);
}
