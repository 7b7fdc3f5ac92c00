//! The admin listener: a write needs intent (the token, or loopback with this listener's
//! `Host` and no foreign `Origin`), reads may need a token of their own, nothing derived from
//! a password is shown, and the listener holds a bounded number of connections.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use support::config::Dest;
use support::{raw_exchange, FakeUpstream, TestProxy};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// `METHOD path` on `admin` with these extra header lines; the answer's status and text.
async fn ask(admin: SocketAddr, method: &str, path: &str, headers: &[&str]) -> (u16, String) {
    let mut request =
        format!("{method} {path} HTTP/1.1\r\nContent-Length: 0\r\nConnection: close\r\n");
    if !headers
        .iter()
        .any(|h| h.to_ascii_lowercase().starts_with("host:"))
    {
        request.push_str(&format!("Host: {admin}\r\n"));
    }
    for h in headers {
        request.push_str(&format!("{h}\r\n"));
    }
    request.push_str("\r\n");
    let answer = raw_exchange(admin, request.as_bytes(), Duration::from_secs(10)).await;
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, answer)
}

async fn reloads(proxy: &TestProxy) -> f64 {
    proxy
        .metric("pacegate_config_reloads_total{result=\"ok\"}")
        .await
}

#[tokio::test]
async fn without_a_token_a_write_needs_this_listeners_host_and_no_foreign_origin() {
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::with(&upstream)
        .destination(Dest::forwarding(&["localhost"]))
        .start()
        .await;
    let admin = proxy.admin;
    let port = admin.port();
    let refused: [&[&str]; 4] = [
        &["Origin: http://evil.example"],
        &["Host: evil.example"],
        &[&format!("Host: evil.example:{port}")],
        &["Sec-Fetch-Site: cross-site"],
    ];
    for headers in refused {
        for path in ["/reload", "/destinations/local/unlock"] {
            let (status, answer) = ask(admin, "POST", path, headers).await;
            assert_eq!(status, 403, "{headers:?} {path}: {answer}");
        }
    }
    assert_eq!(
        reloads(&proxy).await,
        0.0,
        "no refused write was carried out"
    );
    // The listener's own address, by number or as localhost, from a script or its own page.
    let allowed: [&[&str]; 4] = [
        &[],
        &[&format!("Host: localhost:{port}")],
        &[&format!("Origin: http://{admin}")],
        &["Sec-Fetch-Site: same-origin"],
    ];
    for headers in allowed {
        let (status, answer) = ask(admin, "POST", "/reload", headers).await;
        assert_eq!(status, 200, "{headers:?}: {answer}");
    }
    assert_eq!(reloads(&proxy).await, 4.0);
    let (status, _) = ask(admin, "POST", "/destinations/local/unlock", &[]).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn without_a_read_token_a_read_by_a_foreign_name_is_refused() {
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::with(&upstream)
        .destination(Dest::forwarding(&["localhost"]))
        .start()
        .await;
    let admin = proxy.admin;
    let port = admin.port();
    // A page on another site whose name now resolves here (DNS rebinding).
    for path in ["/config", "/status", "/metrics", "/destinations/local"] {
        for host in [
            format!("Host: evil.example:{port}"),
            "Host: evil.example".into(),
        ] {
            let (status, answer) = ask(admin, "GET", path, &[&host]).await;
            assert_eq!(status, 403, "{host} {path}: {answer}");
            assert!(answer.contains("read_token_env"), "{answer}");
            assert!(
                !answer.contains("[destinations") && !answer.contains("pacegate_"),
                "{answer}"
            );
        }
    }
    // By address (any: a scraper reaches a listener on 0.0.0.0 by the host's own) or as
    // localhost, and the probes by any name.
    for host in [
        format!("Host: {admin}"),
        format!("Host: localhost:{port}"),
        format!("Host: 10.1.2.3:{port}"),
        format!("Host: [::1]:{port}"),
    ] {
        let (status, answer) = ask(admin, "GET", "/metrics", &[&host]).await;
        assert_eq!(status, 200, "{host}: {answer}");
    }
    for path in ["/healthz", "/readyz"] {
        let (status, _) = ask(admin, "GET", path, &["Host: evil.example"]).await;
        assert_eq!(status, 200, "{path}");
    }
}

#[tokio::test]
async fn with_tokens_writes_need_the_token_and_reads_the_read_token() {
    std::env::set_var("PACEGATE_TEST_ADMIN_WRITE", "write-secret");
    std::env::set_var("PACEGATE_TEST_ADMIN_READ", "read-secret");
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::with(&upstream)
        .destination(Dest::forwarding(&["localhost"]))
        .admin("token_env", "PACEGATE_TEST_ADMIN_WRITE")
        .admin("read_token_env", "PACEGATE_TEST_ADMIN_READ")
        .start()
        .await;
    let admin = proxy.admin;
    let write = "Authorization: Bearer write-secret";
    let read = "Authorization: Bearer read-secret";
    assert_eq!(ask(admin, "POST", "/reload", &[]).await.0, 401);
    assert_eq!(
        ask(admin, "POST", "/reload", &[read]).await.0,
        401,
        "the read token writes nothing"
    );
    // The token is the intent: from anywhere, any page.
    assert_eq!(
        ask(
            admin,
            "POST",
            "/reload",
            &[write, "Origin: http://evil.example"]
        )
        .await
        .0,
        200
    );
    for path in ["/status", "/metrics", "/config", "/instances"] {
        assert_eq!(ask(admin, "GET", path, &[]).await.0, 401, "{path}");
        assert_eq!(ask(admin, "GET", path, &[read]).await.0, 200, "{path}");
        assert_eq!(ask(admin, "GET", path, &[write]).await.0, 200, "{path}");
    }
    for path in ["/healthz", "/readyz", "/"] {
        assert_eq!(
            ask(admin, "GET", path, &[]).await.0,
            200,
            "{path} needs no token"
        );
    }
}

#[tokio::test]
async fn the_running_config_shows_nothing_derived_from_a_password() {
    let digest = "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8";
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::with(&upstream)
        .destination(Dest::forwarding(&["localhost"]))
        .section(&format!(
            "[proxy.auth]\nusers = [{{ name = \"worker\", password_sha256 = \"{digest}\" }}]"
        ))
        .start()
        .await;
    let (status, config) = ask(proxy.admin, "GET", "/config", &[]).await;
    assert_eq!(status, 200, "{config}");
    assert!(config.contains("name = \"worker\""), "{config}");
    assert!(config.contains("password = \"(set)\""), "{config}");
    // No run of hex that could be (part of) a digest of the password.
    let longest_hex = config
        .split(|c: char| !c.is_ascii_hexdigit())
        .map(str::len)
        .max()
        .unwrap_or(0);
    assert!(longest_hex < 8, "a hex run of {longest_hex} in:\n{config}");
}

#[tokio::test]
async fn the_admin_listener_holds_a_bounded_number_of_connections() {
    let upstream = FakeUpstream::start().await;
    let proxy = TestProxy::with(&upstream)
        .destination(Dest::forwarding(&["localhost"]))
        .start()
        .await;
    let mut held = Vec::new();
    for _ in 0..pacegate::admin::MAX_CONNECTIONS {
        held.push(TcpStream::connect(proxy.admin).await.unwrap());
    }
    // Each accepted before the next is opened: the listener has taken them all.
    support::eventually(
        Duration::from_secs(5),
        "one more closed at once",
        || async {
            let mut extra = TcpStream::connect(proxy.admin).await.ok()?;
            let started = Instant::now();
            let mut byte = [0u8; 1];
            let n = tokio::time::timeout(Duration::from_secs(2), extra.read(&mut byte))
                .await
                .ok()?
                .ok()?;
            (n == 0 && started.elapsed() < Duration::from_secs(2)).then_some(())
        },
    )
    .await;
    drop(held);
    support::eventually(
        Duration::from_secs(5),
        "the listener answers again",
        || async { (ask(proxy.admin, "GET", "/healthz", &[]).await.0 == 200).then_some(()) },
    )
    .await;
}
