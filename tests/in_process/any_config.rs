//! No config that passes validation panics the proxy: every key of `[proxy]`,
//! `[proxy.limits]`, `[upstream]`, `[tls]`, `[classes]` and a destination is drawn from its
//! range and its edges, then each key beyond it in turn (zero, just past the end, up to the
//! largest numbers TOML can write) among keys within. A config that loads is started, sent a plain and an intercepted request, and must have panicked nowhere
//! and still answer on its admin listener. (The destination's pacing keys against every
//! verdict are drawn by the library's own `pacing::any_config`.)

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use support::{client_with, Alpn, FakeUpstream, TestProxy};

/// A key: where it goes, how it is written within its range (its edges included), and beyond
/// it (zero, just past the end, the largest TOML can carry).
struct Key {
    section: &'static str,
    name: &'static str,
    within: BoxedStrategy<String>,
    beyond: BoxedStrategy<String>,
}

fn quoted(list: Vec<&'static str>) -> BoxedStrategy<String> {
    prop::sample::select(list)
        .prop_map(|d| format!("\"{d}\""))
        .boxed()
}

fn duration(
    section: &'static str,
    name: &'static str,
    min: &'static str,
    max: &'static str,
    past: &'static str,
) -> Key {
    Key {
        section,
        name,
        // The middle values sit in every range that starts at 1 ms; a later start is its own.
        within: if min == "1ms" {
            quoted(vec![min, "300ms", "1s", "30s", max])
        } else {
            quoted(vec![min, max])
        },
        // Just short of a minimum above 1 ms is beyond too.
        beyond: if min == "100ms" {
            quoted(vec!["0s", "99ms", past, "300000000000y"])
        } else {
            quoted(vec!["0s", past, "300000000000y"])
        },
    }
}

fn count(section: &'static str, name: &'static str, lo: u64, hi: u64) -> Key {
    Key {
        section,
        name,
        within: prop_oneof![3 => lo..=hi, 1 => prop::sample::select(vec![lo, hi])]
            .prop_map(|n| n.to_string())
            .boxed(),
        beyond: prop::sample::select(vec![lo.saturating_sub(1), hi + 1, i64::MAX as u64])
            .prop_map(|n| n.to_string())
            .boxed(),
    }
}

/// Every key a config may set outside a destination's pacing, and those of its slot.
fn keys() -> Vec<Key> {
    const P: &str = "proxy";
    const L: &str = "proxy.limits";
    const U: &str = "upstream";
    const D: &str = "destinations.local";
    vec![
        duration(P, "shutdown_grace", "1ms", "1h", "61min"),
        count(P, "threads", 1, 1024),
        count(L, "max_connections", 1, 1_000_000),
        count(L, "max_requests", 1, 1_000_000),
        count(L, "max_streams", 1, 10_000),
        count(L, "max_header_bytes", 8192, 1_048_576),
        duration(L, "header_read_timeout", "100ms", "1h", "61min"),
        duration(L, "idle_timeout", "100ms", "1day", "25h"),
        duration(L, "ping_interval", "100ms", "1h", "61min"),
        duration(L, "ping_timeout", "100ms", "1h", "61min"),
        duration(L, "write_timeout", "100ms", "1day", "25h"),
        duration(L, "body_timeout", "100ms", "1day", "25h"),
        duration(L, "handshake_timeout", "100ms", "1h", "61min"),
        duration(L, "tunnel_idle_timeout", "100ms", "7days", "8days"),
        duration(U, "connect_timeout", "1ms", "1h", "61min"),
        duration(U, "response_timeout", "1ms", "1day", "25h"),
        duration(U, "pool_idle_timeout", "1ms", "1h", "61min"),
        count(U, "pool_max_idle_per_host", 0, 1_000_000),
        duration("tls", "leaf_validity", "1h", "90days", "91days"),
        duration("classes.max_wait", "backfill", "1ms", "1day", "25h"),
        Key {
            section: "classes.share",
            name: "backfill",
            within: prop::sample::select(vec!["0.001", "0.5", "0.999"])
                .prop_map(str::to_owned)
                .boxed(),
            beyond: prop::sample::select(vec!["0.0", "1.0", "1e300"])
                .prop_map(str::to_owned)
                .boxed(),
        },
        count(D, "burst", 1, 100_000),
        duration(D, "max_wait", "1ms", "1day", "25h"),
        count(D, "max_concurrency", 0, 1_000_000),
        count(D, "retry_throttled", 0, 10),
        duration(D, "retry_after_max", "1ms", "7days", "8days"),
        count(D, "decay_after", 1, 1_000_000),
        count(D, "max_keys", 1, 1_000_000),
        duration(D, "key_idle", "1ms", "30days", "31days"),
    ]
}

/// A config's keys, each present or not, within its range.
fn within() -> impl Strategy<Value = Vec<(&'static str, &'static str, String)>> {
    let keys = keys();
    let names: Vec<_> = keys.iter().map(|k| (k.section, k.name)).collect();
    let values: Vec<_> = keys
        .iter()
        .map(|k| prop::option::weighted(0.5, k.within.clone()))
        .collect();
    values.prop_map(move |values| {
        names
            .iter()
            .zip(values)
            .filter_map(|(&(section, name), v)| v.map(|v| (section, name, v)))
            .collect()
    })
}

/// Every value beyond a key's range, one key at a time: `(key index, value)`.
fn beyond(runner: &mut TestRunner) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, key) in keys().iter().enumerate() {
        let mut seen = Vec::new();
        // The beyond lists are short: drawing until each has shown up covers them all.
        for _ in 0..64 {
            let v = key.beyond.new_tree(runner).expect("a value").current();
            if !seen.contains(&v) {
                seen.push(v.clone());
                out.push((i, v));
            }
        }
    }
    out
}

fn config_text(upstream: &FakeUpstream, keys: &[(&str, &str, String)]) -> String {
    let of = |section: &str| -> String {
        keys.iter()
            .filter(|(s, _, _)| *s == section)
            .map(|(_, k, v)| format!("{k} = {v}\n"))
            .collect()
    };
    format!(
        "[proxy]\nlisten = \"127.0.0.1:0\"\nallow_private_upstreams = true\nports = [\"1024-65535\"]\n{}\
         [proxy.limits]\n{}\
         [admin]\nlisten = \"127.0.0.1:0\"\n\
         [tls]\ngenerate_ca = true\nextra_upstream_roots = [\"{roots}\"]\n{}\
         [upstream]\n{}\
         [classes]\norder = [\"interactive\", \"backfill\"]\ndefault = \"interactive\"\n\
         [classes.max_wait]\n{}\
         [classes.share]\n{}\
         [destinations.local]\nhosts = [\"localhost\"]\nrate = 1000\n{}",
        of("proxy"),
        of("proxy.limits"),
        of("tls"),
        of("upstream"),
        of("classes.max_wait"),
        of("classes.share"),
        of("destinations.local"),
        roots = upstream.ca.cert_path.display()
    )
}

thread_local! {
    /// Panics on this thread: a test's current-thread runtime runs every task it spawns here.
    static PANICS: AtomicUsize = const { AtomicUsize::new(0) };
}

#[tokio::test]
async fn no_valid_config_panics_the_proxy() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.with(|p| p.fetch_add(1, Ordering::Relaxed));
        previous(info);
    }));
    let upstream = FakeUpstream::start().await;
    let mut runner = TestRunner::default();
    let names: Vec<_> = keys().iter().map(|k| (k.section, k.name)).collect();
    // A hundred configs within range, then each key beyond its range among keys within.
    let mut configs: Vec<Option<(usize, String)>> = vec![None; 100];
    configs.extend(beyond(&mut runner).into_iter().map(Some));
    let (mut valid, mut cases) = (0, 0);
    for past in configs {
        let mut keys = within()
            .new_tree(&mut runner)
            .expect("a value is drawn")
            .current();
        if let Some((i, value)) = past {
            let (section, name) = names[i];
            keys.retain(|(s, k, _)| (*s, *k) != (section, name));
            keys.push((section, name, value));
        }
        cases += 1;
        let text = config_text(&upstream, &keys);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(support::CONFIG_FILE), &text).unwrap();
        if pacegate::config::Config::load(&dir.path().join(support::CONFIG_FILE)).is_err() {
            continue;
        }
        valid += 1;
        let mut proxy = TestProxy::start_in(dir).await;
        {
            let via = client_with(Some(&proxy.url()), &[&proxy.ca_path()], Alpn::H2, |b| {
                b.timeout(Duration::from_secs(2))
            });
            // What each answers does not matter (a 1 ns deadline refuses); that it answers
            // without a panic does.
            let _ = via
                .get(format!("{}/", upstream.http_url("localhost")))
                .send()
                .await;
            let _ = via
                .get(format!("{}/", upstream.https_url("localhost")))
                .send()
                .await;
        }
        assert_eq!(
            PANICS.with(|p| p.load(Ordering::Relaxed)),
            0,
            "a valid config panicked:\n{text}"
        );
        let ready = support::admin_client()
            .get(format!("http://{}/readyz", proxy.admin))
            .send()
            .await
            .map(|r| r.status().as_u16());
        assert_eq!(
            ready.ok(),
            Some(200),
            "not ready after its requests:\n{text}"
        );
        proxy.stop().await;
    }
    let _ = std::panic::take_hook();
    // The hundred within range start (a share's sum aside); none of those beyond does.
    assert!(valid >= 90, "only {valid} of {cases} configs were valid");
    eprintln!("{valid} of {cases} configs were valid and started");
}
