//! A parent proxy, on real processes: `[upstream] proxy` sends every upstream connection through an HTTP proxy
//! with CONNECT (here a second pacegate in `unmatched = "tunnel"` mode), http and https
//! destinations alike, except the `no_proxy` hosts; the address policy still applies to the
//! final destination, and the parent's credentials go with each CONNECT.

use crate::support;
use crate::support::fleet::beside;

use support::process::Served;
use support::{client, Alpn, FakeUpstream};

const LOCAL: &str = "[destinations.local]\nhosts = [\"localhost\"]\nrate = 1000\n";

/// A parent that tunnels whatever it is asked to, optionally behind `auth`.
fn parent(auth: &str) -> Served {
    Served::start("unmatched = \"tunnel\"", None, auth)
}

/// CONNECTs the parent has tunnelled so far.
async fn tunnelled(parent: &Served) -> f64 {
    support::metric_value(
        &parent.metrics().await,
        "pacegate_requests_total{destination=\"unmatched\",group=\"\",outcome=\"tunneled\"}",
    )
}

/// `[upstream] proxy`, naming `parent`.
fn through(parent: &Served) -> String {
    format!(
        "proxy = \"http://127.0.0.1:{}\"",
        parent.instance.proxy.port()
    )
}

/// A GET of the upstream's `/status/200` for localhost through `child`.
async fn get_local(child: &Served, upstream: &FakeUpstream) -> reqwest::Response {
    client(Some(&child.url()), &[], Alpn::Http1)
        .get(format!("{}/status/200", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap()
}

/// A pacegate whose upstream connections go through `proxy_url`.
fn child(upstream: &FakeUpstream, proxy_keys: &str, upstream_keys: &str) -> Served {
    Served::start(
        proxy_keys,
        Some(&upstream.ca.cert_path),
        &format!("[upstream]\n{upstream_keys}\n{LOCAL}"),
    )
}

#[tokio::test]
async fn http_and_https_destinations_go_through_the_parent() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let parent = parent("");
    let child = child(&upstream, "", &through(&parent));
    let via = client(Some(&child.url()), &[&child.ca()], Alpn::Http1);
    assert_eq!(tunnelled(&parent).await, 0.0);
    for base in [
        upstream.http_url("localhost"),
        upstream.https_url("localhost"),
    ] {
        let answer = via.get(format!("{base}/status/200")).send().await.unwrap();
        assert_eq!(answer.status(), 200, "{base}");
    }
    assert_eq!(upstream.recorded().len(), 2);
    assert_eq!(
        tunnelled(&parent).await,
        2.0,
        "one tunnel per upstream connection, http and https"
    );
}

#[tokio::test]
async fn no_proxy_hosts_go_direct() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let parent = parent("");
    let keys = format!("{}\nno_proxy = [\"localhost\"]", through(&parent));
    let child = child(&upstream, "", &keys);
    assert_eq!(get_local(&child, &upstream).await.status(), 200);
    assert_eq!(tunnelled(&parent).await, 0.0, "the parent was not asked");
}

#[tokio::test]
async fn the_address_policy_applies_to_the_final_destination() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let parent = parent("");
    // The parent is on loopback, and that is allowed: it is the operator's choice. The
    // destination is on loopback too, and that is not.
    let child = child(
        &upstream,
        "allow_private_upstreams = false\n",
        &through(&parent),
    );
    let answer = get_local(&child, &upstream).await;
    assert_eq!(answer.status(), 403);
    let status = answer.headers()["proxy-status"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(status.contains("destination_ip_prohibited"), "{status}");
    assert_eq!(tunnelled(&parent).await, 0.0, "the parent was never asked");
    assert!(upstream.recorded().is_empty());
}

#[tokio::test]
async fn the_parent_s_credentials_go_with_each_connect() {
    let _beside = beside().await;
    let upstream = FakeUpstream::start().await;
    let digest = hex::encode(pacegate::config::User::digest(b"s3cret:x"));
    let auth =
        format!("[proxy.auth]\nusers = [{{ name = \"corp\", password_sha256 = \"{digest}\" }}]\n");
    let parent = parent(&auth);
    let port = parent.instance.proxy.port();
    // The password has a colon: percent-encoded in the URL.
    let right = child(
        &upstream,
        "",
        &format!("proxy = \"http://corp:s3cret%3Ax@127.0.0.1:{port}\""),
    );
    assert_eq!(get_local(&right, &upstream).await.status(), 200);

    let wrong = child(
        &upstream,
        "",
        &format!("proxy = \"http://corp:guess@127.0.0.1:{port}\""),
    );
    let answer = get_local(&wrong, &upstream).await;
    assert_eq!(answer.status(), 502);
    let status = answer.headers()["proxy-status"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(status.contains("proxy_internal_error"), "{status}");
    let body = answer.text().await.unwrap();
    assert!(
        body.contains("407"),
        "says the parent wants credentials: {body}"
    );
    assert!(
        !body.contains("guess"),
        "the password is never shown: {body}"
    );
}
