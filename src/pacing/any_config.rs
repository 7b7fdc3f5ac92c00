//! No config that passes validation panics the pacer: not at start, not on any verdict.
//!
//! Destination keys are drawn from their edges (zero, the limits validation enforces and one
//! past them, the largest numbers TOML can write) and from their ordinary ranges. A config
//! that `Config::parse` accepts (one destination per kind of answer, all with the drawn
//! keys) starts a pacer on the memory store, on paused time; each destination then takes its
//! answer twice, after clean ones: a throttle with the longest Retry-After or a vendor's reset
//! far away, a spent vendor budget, huge vendor numbers, a throttle dressed as a lockout, a
//! lockout.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use prometheus::Registry;
use proptest::prelude::*;
use tokio::time::Instant;

use super::tests::headers;
use super::*;
use crate::config::Config;
use crate::store::memory::MemoryStore;

/// Floats as TOML writes them, edges first.
fn float(edges: &[f64], range: std::ops::Range<f64>) -> impl Strategy<Value = String> {
    prop_oneof![
        1 => prop::sample::select(edges.to_vec()),
        5 => range,
    ]
    .prop_map(|f| format!("{f:e}"))
}

fn int(edges: &[u64]) -> impl Strategy<Value = String> {
    int_in(edges, 1..10_000)
}

fn int_in(edges: &[u64], range: std::ops::Range<u64>) -> impl Strategy<Value = String> {
    prop_oneof![1 => prop::sample::select(edges.to_vec()), 5 => range].prop_map(|n| n.to_string())
}

fn duration() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "0s", "1ns", "1ms", "250ms", "1s", "59s", "1h", "1day", "25h", "7days", "8days", "100years",
    ])
    .prop_map(|d| format!("\"{d}\""))
}

fn statuses() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "[]",
        "[429]",
        "[403, 429]",
        "[0]",
        "[200]",
        "[1000]",
        "[503, 403]",
    ])
    .prop_map(str::to_owned)
}

/// One optional `key = value` line.
fn key(name: &'static str, value: impl Strategy<Value = String>) -> impl Strategy<Value = String> {
    prop::option::weighted(0.3, value)
        .prop_map(move |v| v.map_or_else(String::new, |v| format!("{name} = {v}\n")))
}

prop_compose! {
    fn destination()(
        rate in float(&[0.0, 1e-20, 0.0009, 0.001, 1.0, 20.0, 1e9, 1e300, f64::MAX, -1.0], 0.001..1e6),
        burst in key("burst", int(&[0, 1, 100_000, 100_001, u64::from(u32::MAX)])),
        factor in key("backoff_factor", float(&[0.5, 1.0, 1.0000001, 1e300], 1.0..100.0)),
        max in key("backoff_max", float(&[0.0, 1.0, 10_000.0, 10_001.0, 1e300], 1.0..10_000.0)),
        decay in key("decay_after", int(&[0, 1, u64::from(u32::MAX)])),
        retry_max in key("retry_after_max", duration()),
        max_wait in key("max_wait", duration()),
        reserve in key("reserve", int(&[0, 1, u64::from(u32::MAX)])),
        throttle in key("throttle_statuses", statuses()),
        lockout in key("lockout_statuses", statuses()),
        retries in key("retry_throttled", int_in(&[0, 1, 10, 11, u64::from(u32::MAX)], 0..11)),
        signals in key("signals", prop::sample::select(vec!["\"auto\"", "\"none\"", "[\"ietf\"]"]).prop_map(str::to_owned)),
        body in key("throttle_body", prop::sample::select(vec!["[]", "[\"\"]", "[\"rate limit\"]"]).prop_map(str::to_owned)),
        mode in key("mode", prop::sample::select(vec!["\"enforce\"", "\"shadow\"", "\"off\""]).prop_map(str::to_owned)),
        quota in prop::option::weighted(0.3, (int(&[0, 1, 1_000_000, 1_000_001, u64::from(u32::MAX)]), duration())),
        block in prop::option::weighted(0.3, (duration(), duration(), float(&[0.0, 0.5, 0.99, 1.0, -0.5], 0.0..1.0))),
    ) -> String {
        let mut text = format!("rate = {rate}\n{burst}{factor}{max}{decay}{retry_max}{max_wait}{reserve}{throttle}{lockout}{retries}{signals}{body}{mode}");
        if let Some((limit, per)) = quota {
            text.push_str(&format!("quota = [{{ limit = {limit}, per = {per} }}]\n"));
        }
        if let Some((min, max, jitter)) = block {
            text.push_str(&format!("throttle_block = {{ min = {min}, max = {max}, jitter = {jitter} }}\n"));
        }
        text
    }
}

/// Every kind of answer a destination can get, by status and headers.
fn answers() -> Vec<(u16, HeaderMap)> {
    vec![
        (200, HeaderMap::new()),
        (429, headers(&[("retry-after", "18446744073709551615")])),
        (
            429,
            headers(&[("retry-after", "Fri, 31 Dec 9999 23:59:59 GMT")]),
        ),
        (
            503,
            headers(&[
                ("x-ratelimit-remaining", "0"),
                ("x-ratelimit-reset", "99999999999"),
            ]),
        ),
        (200, headers(&[("ratelimit", "\"p\";r=0;t=4294967295")])),
        (
            200,
            headers(&[
                ("x-ratelimit-remaining", "18446744073709551615"),
                ("x-ratelimit-limit", "18446744073709551615"),
                ("x-ratelimit-reset-after", "1e300"),
            ]),
        ),
        (403, headers(&[("retry-after", "604800")])),
        (403, HeaderMap::new()),
        (200, HeaderMap::new()),
    ]
}

/// Starts a pacer on `config`, whose destinations are one per kind of answer (in order), and
/// gives each its answer twice, each time after a clean one.
async fn exercise(config: &Config) {
    let metrics = Arc::new(Metrics::new(Registry::new()).unwrap());
    let pacer = Arc::new(Pacer::new(
        &config.destinations,
        config.classes.clone(),
        Arc::new(MemoryStore::ephemeral()),
        metrics,
        "test".into(),
    ));
    pacer.start().await.unwrap();
    for (i, (status, h)) in answers().into_iter().enumerate() {
        let route = pacer.destination(&format!("d{i}")).unwrap();
        for (status, h) in [(200, HeaderMap::new()), (status, h)]
            .iter()
            .cycle()
            .take(4)
        {
            // A pause or a lockout refuses the next ones: their verdicts were applied.
            let now = Instant::now();
            let deadline = now + Duration::from_secs(60);
            let Ok(a) = pacer
                .enter(&route, &route.pace(), Class(0), now, deadline)
                .await
            else {
                break;
            };
            let reading = pacer.read(&a, *status, h);
            pacer
                .observed(&a, reading, *status, None, || "GET https://d/".to_owned())
                .await;
        }
    }
    let _ = pacer.status().await;
    pacer.stop();
}

#[test]
fn no_valid_config_panics_at_start_or_on_any_verdict() {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(256));
    let valid = std::cell::Cell::new(0);
    let cases = std::cell::Cell::new(0);
    runner
        .run(&destination(), |a| {
            cases.set(cases.get() + 1);
            let mut text = String::from("[tls]\ngenerate_ca = true\n");
            for i in 0..answers().len() {
                text.push_str(&format!(
                    "[destinations.d{i}]\nhosts = [\"d{i}.example\"]\n{a}\n"
                ));
            }
            let Ok(config) = Config::parse(&text, Path::new("/nonexistent")) else {
                return Ok(());
            };
            valid.set(valid.get() + 1);
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap();
            runtime.block_on(exercise(&config));
            Ok(())
        })
        .unwrap();
    // Drawn from the edges, most configs are refused; enough must pass to mean something.
    // About a fifth pass (42 to 64 of 256 over runs): a tenth is four and a half standard
    // deviations under that, so a random draw does not fail the suite.
    let (valid, cases) = (valid.get(), cases.get());
    assert!(
        valid * 10 >= cases,
        "only {valid} of {cases} configs were valid"
    );
    eprintln!("{valid} of {cases} configs were valid");
}
