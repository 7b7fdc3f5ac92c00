//! Bot walls through the real proxy: a product's challenge passes to the client as it came,
//! locks nothing, is not retried and widens nothing on its own; a plain 403 still locks out;
//! past a fifth of the responses, challenges widen the pace.

use crate::support;

use support::{client, Alpn, FakeUpstream, TestProxy};

async fn start(upstream: &FakeUpstream, keys: &str) -> TestProxy {
    let config = format!("[destinations.local]\nhosts = [\"localhost\"]\nrate = 100\n{keys}\n");
    TestProxy::start(&upstream.ca.cert_path, "", &config).await
}

/// A challenge (`path` on the fake upstream, over TLS) then a plain request: the client
/// gets the challenge as it came, the plain request is forwarded, nothing is locked or
/// widened, nothing retried, and the challenge is counted for `vendor`.
async fn a_challenge_is_passed_on_and_locks_nothing(path: &str, status: u16, vendor: &str) {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "").await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let challenge = via
        .get(format!("{}/{path}", upstream.https_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(challenge.status(), status, "{vendor}: the vendor's answer");
    assert!(
        challenge.headers().get("proxy-status").is_none(),
        "{vendor}: not pacegate's"
    );
    let next = via
        .get(format!("{}/fine", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert_eq!(
        next.status(),
        200,
        "{vendor}: the next request is forwarded"
    );
    assert_eq!(
        upstream.recorded().len(),
        2,
        "{vendor}: the challenge is not retried"
    );
    let s = proxy.destination("local").await;
    assert_eq!(s["lock"], serde_json::Value::Null, "{vendor}: {s}");
    assert_eq!(
        s["backoff"], 1.0,
        "{vendor}: one challenge widens nothing: {s}"
    );
    assert_eq!(s["challenges"]["by_vendor"][vendor], 1, "{vendor}: {s}");
    assert_eq!(
        proxy
            .metric(&format!(
                "pacegate_challenges_total{{destination=\"local\",vendor=\"{vendor}\"}}"
            ))
            .await,
        1.0,
        "{vendor}"
    );
}

/// `path` answered with a 403 (over TLS) locks the destination out.
async fn locks_out(path: &str, what: &str) {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "").await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let url = format!("{}/{path}", upstream.https_url("localhost"));
    assert_eq!(via.get(&url).send().await.unwrap().status(), 403);
    let refused = via
        .get(format!("{}/fine", upstream.http_url("localhost")))
        .send()
        .await
        .unwrap();
    assert!(
        refused.headers().contains_key("proxy-status"),
        "{what}: refused by pacegate, locked out"
    );
    assert_eq!(
        proxy.destination("local").await["lock"]["status"],
        403,
        "{what}"
    );
}

#[tokio::test]
async fn a_cloudflare_challenge_locks_nothing_and_the_same_403_without_its_header_locks_out() {
    a_challenge_is_passed_on_and_locks_nothing(
        "status/403?h=cf-mitigated:challenge&body=Just%20a%20moment...",
        403,
        "cloudflare",
    )
    .await;
    locks_out("status/403?body=Just%20a%20moment...", "the control").await;
}

#[tokio::test]
async fn every_other_product_s_challenge_is_told_from_a_lockout() {
    for (path, status, vendor) in [
        ("status/202?h=x-amzn-waf-action:challenge", 202, "aws-waf"),
        ("status/405?h=x-amzn-waf-action:captcha", 405, "aws-waf"),
        (
            "status/403?h=x-datadome:protected&h=x-dd-b:2&h=content-type:text/html",
            403,
            "datadome",
        ),
        (
            "status/403?h=content-type:application/json&body=%7B%22appId%22:%22PXa1b2c3%22,%22jsClientSrc%22:%22/a1b2c3/init.js%22,%22blockScript%22:%22/a1b2c3/captcha/captcha.js%22%7D",
            403,
            "perimeterx",
        ),
        (
            "status/403?h=server:AkamaiGHost&body=%3CHTML%3EAccess%20Denied%20Reference%26%2332;%26%2335;18%26%2346;5c3e4b17%26%2346;1733500000%3C/HTML%3E",
            403,
            "akamai",
        ),
    ] {
        a_challenge_is_passed_on_and_locks_nothing(path, status, vendor).await;
    }
    // A header that merely names a product, and Akamai's page from another server.
    locks_out(
        "status/403?h=content-security-policy:script-src%20https://js.datadome.co%20https://challenges.cloudflare.com",
        "a CSP naming products",
    )
    .await;
    locks_out(
        "status/403?h=server:nginx&body=Reference%20%2318.5c3e4b17",
        "Akamai's reference from nginx",
    )
    .await;
}

#[tokio::test]
async fn challenges_past_a_fifth_of_the_responses_widen_the_pace() {
    let upstream = FakeUpstream::start().await;
    let proxy = start(&upstream, "").await;
    let via = client(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::Http1);
    let fine = format!("{}/fine", upstream.http_url("localhost"));
    let challenge = format!(
        "{}/status/403?h=cf-mitigated:challenge",
        upstream.http_url("localhost")
    );
    for _ in 0..9 {
        assert_eq!(via.get(&fine).send().await.unwrap().status(), 200);
    }
    // 2 of 11: under a fifth.
    for _ in 0..2 {
        assert_eq!(via.get(&challenge).send().await.unwrap().status(), 403);
    }
    let s = proxy.destination("local").await;
    assert_eq!(s["backoff"], 1.0, "2 of 11 widen nothing: {s}");
    // 3 of 12: past it, the pace widens as for a throttle; still nothing is locked.
    assert_eq!(via.get(&challenge).send().await.unwrap().status(), 403);
    let s = proxy.destination("local").await;
    assert_eq!(s["backoff"], 2.0, "3 of 12: {s}");
    assert_eq!(s["lock"], serde_json::Value::Null, "{s}");
    assert_eq!(s["challenges"]["last_5m"], 3, "{s}");
    assert_eq!(s["challenges"]["responses_5m"], 12, "{s}");
    let rows: Vec<pacegate::status::DestinationStatus> =
        serde_json::from_value(proxy.status().await).unwrap();
    let table = pacegate::status::status_table(&rows);
    assert!(
        table.contains("local: BOT WALL: 3 of 12 responses") && table.contains("intercept = false"),
        "{table}"
    );
}
