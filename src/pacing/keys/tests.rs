//! Budgets split by key, on paused time with the memory store.

use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use prometheus::Registry;
use tokio::time::Instant;

use super::*;
use crate::budget::{Event, Lockout, Store};
use crate::class::{Class, Classes};
use crate::destination::{Destination, Pace};
use crate::metrics::Metrics;
use crate::pacing::tests::grants_of;
use crate::store::memory::MemoryStore;

const ONE: Class = Class(0);

fn split(rate: f64, key: &str) -> Pace {
    Pace {
        key: Some(KeyFrom::parse(key).unwrap()),
        key_idle: Duration::from_secs(10),
        ..Pace::new(rate)
    }
}

/// Destination `d` with `groups`.
fn destination(pace: Pace, groups: Vec<crate::destination::Group>) -> Destination {
    Destination {
        name: "d".into(),
        hosts: vec![],
        pace,
        ports: Default::default(),
        allow_private_upstreams: None,
        groups,
        meters: Vec::new(),
        max_body: crate::destination::DEFAULT_MAX_BODY,
    }
}

async fn pacer(pace: Pace, store: Arc<dyn Store>) -> Arc<Pacer> {
    pacer_of(destination(pace, Vec::new()), store).await
}

async fn pacer_of(dest: Destination, store: Arc<dyn Store>) -> Arc<Pacer> {
    let metrics = Arc::new(Metrics::new(Registry::new()).unwrap());
    let p = Arc::new(Pacer::new(
        &[dest],
        Classes::default(),
        store,
        metrics,
        "test".into(),
    ));
    p.start().await.unwrap();
    p
}

fn token(value: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("authorization", value.parse().unwrap());
    h
}

/// The route of a request to host `host` with `headers`.
async fn route(p: &Pacer, host: &str, headers: &HeaderMap) -> Result<Route, PaceError> {
    let asking = Asking {
        host,
        user: None,
        headers,
        client: None,
        body: None,
    };
    p.keyed(p.destination("d").unwrap(), &asking).await
}

#[tokio::test(start_paused = true)]
async fn each_key_keeps_its_own_pace_and_none_waits_for_another() {
    let p = pacer(
        split(2.0, "header:authorization"),
        Arc::new(MemoryStore::ephemeral()),
    )
    .await;
    let start = Instant::now();
    let t1 = route(&p, "h", &token("Bearer one")).await.unwrap();
    let t2 = route(&p, "h", &token("Bearer two")).await.unwrap();
    assert_ne!(t1.name(), t2.name());
    let (a, b) = tokio::join!(grants_of(&p, &t1, 4, start), grants_of(&p, &t2, 4, start));
    let ms = |v: &[u64]| {
        v.iter()
            .map(|m| Duration::from_millis(*m))
            .collect::<Vec<_>>()
    };
    assert_eq!(a, ms(&[0, 500, 1000, 1500]), "token one at 2/s");
    assert_eq!(
        b,
        ms(&[0, 500, 1000, 1500]),
        "token two beside it, not behind it"
    );
    let again = route(&p, "h", &token("Bearer one")).await.unwrap();
    assert_eq!(
        again.name(),
        t1.name(),
        "the same credential, the same budget"
    );
}

#[tokio::test(start_paused = true)]
async fn a_credential_is_named_by_its_keyed_hash_the_same_for_every_instance() {
    let store = MemoryStore::ephemeral();
    let other = Arc::new(store.instance("other"));
    let p = pacer(split(2.0, "header:authorization"), Arc::new(store)).await;
    let q = pacer(split(2.0, "header:authorization"), other).await;
    let secret = "Bearer s3cr3t-token";
    let r = route(&p, "h", &token(secret)).await.unwrap();
    let name = r.name().to_string();
    let key = name.strip_prefix("d#").expect("PARENT#KEY");
    assert_eq!(key.len(), 16, "{name}");
    assert!(key.bytes().all(|b| b.is_ascii_hexdigit()), "{name}");
    assert!(!name.contains("s3cr3t"), "{name}");
    assert_eq!(
        route(&q, "h", &token(secret))
            .await
            .unwrap()
            .name()
            .to_string(),
        name,
        "another instance on the store names it alike"
    );
    let status = serde_json::to_string(&p.status().await).unwrap();
    assert!(
        status.contains(key) && !status.contains("s3cr3t"),
        "{status}"
    );
    let table = crate::status::status_table(&p.status().await);
    assert!(
        table.contains("split by header:authorization: 1 of at most 10000 keys")
            && table.contains(key)
            && !table.contains("s3cr3t"),
        "{table}"
    );
    // A host is no secret: it names its key as it is.
    let hosts = pacer(split(2.0, "host"), Arc::new(MemoryStore::ephemeral())).await;
    let r = route(&hosts, "API.example.com", &HeaderMap::new())
        .await
        .unwrap();
    assert_eq!(&**r.name(), "d#api.example.com");
}

#[tokio::test(start_paused = true)]
async fn a_new_key_past_max_keys_is_refused_until_one_idles_out() {
    let p = pacer(
        Pace {
            max_keys: 2,
            ..split(10.0, "host")
        },
        Arc::new(MemoryStore::ephemeral()),
    )
    .await;
    tokio::spawn(p.clone().keep_keys());
    let none = HeaderMap::new();
    let a = route(&p, "a", &none).await.unwrap();
    route(&p, "b", &none).await.unwrap();
    match route(&p, "c", &none).await {
        Err(PaceError::TooManyKeys {
            budget, max_keys, ..
        }) => {
            assert_eq!((budget.as_str(), max_keys), ("d", 2))
        }
        other => panic!("expected TooManyKeys, got {other:?}"),
    }
    assert!(route(&p, "a", &none).await.is_ok(), "a kept key still goes");
    assert_eq!(
        p.metrics.keys_refused.with_label_values(&["d", ""]).get(),
        1
    );
    // `b` idles out after key_idle (10 s); `a`, held by a route, does not.
    tokio::time::sleep(Duration::from_secs(13)).await;
    let c = route(&p, "c", &none).await.expect("room made by b");
    assert_eq!(&**c.name(), "d#c");
    let live: Vec<String> = {
        let lane = &p.destination("d").unwrap().lane;
        let mut keys: Vec<String> = lane
            .children()
            .unwrap()
            .lock()
            .iter()
            .map(|k| k.0.key_name().unwrap().to_owned())
            .collect();
        keys.sort();
        keys
    };
    assert_eq!(live, ["a", "c"], "b forgotten, a held");
    drop(a);
}

#[tokio::test(start_paused = true)]
async fn a_lockout_on_one_key_halts_every_key_even_new_ones() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::ephemeral());
    let p = pacer(split(10.0, "host"), store.clone()).await;
    let none = HeaderMap::new();
    let a = route(&p, "a", &none).await.unwrap();
    let b = route(&p, "b", &none).await.unwrap();
    let far = Instant::now() + Duration::from_secs(3600);
    let admission = p.admit(&a, ONE, far).await.unwrap();
    let reading = p.read(&admission, 403, &HeaderMap::new());
    p.observed(&admission, reading, 403, None, || "GET http://a/".into())
        .await;
    drop(admission);
    for r in [&a, &b, &route(&p, "new", &none).await.unwrap()] {
        match p.admit(r, ONE, far).await {
            Err(PaceError::Locked { destination, lock }) => {
                assert_eq!((destination.as_str(), lock.status), ("d", 403), "{r:?}")
            }
            Ok(_) => panic!("{r:?} was admitted while locked"),
            Err(e) => panic!("{r:?}: {e}"),
        }
    }
    assert!(
        store.view("d").await.unwrap().lock.is_some(),
        "kept on the parent"
    );
    assert!(
        store.view("d#a").await.unwrap().lock.is_none(),
        "not on the key"
    );
    p.unlock("d").await.unwrap();
    assert!(
        p.admit(&b, ONE, far).await.is_ok(),
        "unlocked: every key goes again"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lockout_taken_elsewhere_halts_a_key_at_its_next_reservation() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::ephemeral());
    let p = pacer(split(10.0, "host"), store.clone()).await;
    let a = route(&p, "a", &HeaderMap::new()).await.unwrap();
    let lock = Lockout::new(403, "GET http://b/".into(), "another".into());
    let rule = p.destination("d").unwrap().lane.keys().rule.clone();
    store
        .record("d", &rule, Event::Lockout(lock), None)
        .await
        .unwrap();
    let far = Instant::now() + Duration::from_secs(3600);
    assert!(matches!(
        p.admit(&a, ONE, far).await,
        Err(PaceError::Locked { .. })
    ));
}

/// The most instants of `at` (sorted) within any `window`.
fn busiest(at: &[Duration], window: Duration) -> usize {
    (0..at.len())
        .map(|i| at[i..].iter().take_while(|t| **t - at[i] < window).count())
        .max()
        .unwrap_or(0)
}

#[tokio::test(start_paused = true)]
async fn with_total_rate_each_request_takes_a_slot_of_its_key_and_of_the_total() {
    let p = pacer(
        Pace {
            total_rate: Some(3.0),
            ..split(2.0, "host")
        },
        Arc::new(MemoryStore::ephemeral()),
    )
    .await;
    let start = Instant::now();
    let none = HeaderMap::new();
    let mut keys = Vec::new();
    for host in ["a", "b", "c"] {
        keys.push(route(&p, host, &none).await.unwrap());
    }
    let (a, b, c) = tokio::join!(
        grants_of(&p, &keys[0], 3, start),
        grants_of(&p, &keys[1], 3, start),
        grants_of(&p, &keys[2], 3, start)
    );
    let second = Duration::from_secs(1);
    for (key, at) in [("a", &a), ("b", &b), ("c", &c)] {
        assert!(busiest(at, second) <= 3, "key {key} at 2/s: {at:?}");
    }
    let mut all = [a, b, c].concat();
    all.sort();
    // 9 requests at a total of 3/s: a slot every 333 ms, the last after 2.67 s.
    assert!(busiest(&all, second) <= 4, "{all:?}");
    assert!(all[8] >= Duration::from_millis(2660), "{all:?}");
    // Without the total, the three keys would be done in 1 s.
}

#[tokio::test(start_paused = true)]
async fn a_vendor_view_goes_to_the_named_group_s_budget_of_the_same_key() {
    use crate::destination::Group;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::ephemeral());
    let pace = split(20.0, "header:authorization");
    let search = Group {
        name: "search".into(),
        paths: vec!["/search/".into()],
        methods: vec![],
        resource: Some("search".into()),
        pace: Pace {
            rate: 0.5,
            ..pace.clone()
        },
        meters: Vec::new(),
    };
    let p = pacer_of(destination(pace, vec![search]), store.clone()).await;
    let headers = token("Bearer one");
    let asking = Asking {
        host: "h",
        user: None,
        headers: &headers,
        client: None,
        body: None,
    };
    let core = p
        .destination("d")
        .unwrap()
        .pick("GET", "/core/repos")
        .into_owned();
    let core = p.keyed(core, &asking).await.unwrap();
    let key = core.name().strip_prefix("d#").unwrap().to_owned();
    let far = Instant::now() + Duration::from_secs(3600);
    let admission = p.admit(&core, ONE, far).await.unwrap();
    let reset = (std::time::SystemTime::now() + Duration::from_secs(30))
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        .to_string();
    let mut said = HeaderMap::new();
    for (name, value) in [
        ("x-ratelimit-resource", "search"),
        ("x-ratelimit-limit", "30"),
        ("x-ratelimit-remaining", "0"),
        ("x-ratelimit-reset", reset.as_str()),
    ] {
        said.insert(name, value.parse().unwrap());
    }
    let reading = p.read(&admission, 200, &said);
    p.observed(&admission, reading, 200, Some("search"), String::new)
        .await;
    let search = store.view(&format!("d/search#{key}")).await.unwrap();
    assert_eq!(
        search.vendor.map(|v| v.remaining),
        Some(0),
        "the same key's search budget"
    );
    assert!(
        store.view(core.name()).await.unwrap().vendor.is_none(),
        "not core's"
    );
}

#[tokio::test(start_paused = true)]
async fn a_reload_that_adds_or_removes_a_key_keeps_the_budget_and_its_keys() {
    let p = pacer(Pace::new(100.0), Arc::new(MemoryStore::ephemeral())).await;
    let far = Instant::now() + Duration::from_secs(3600);
    let a = p
        .admit(&p.destination("d").unwrap(), ONE, far)
        .await
        .unwrap();
    let reading = p.read(&a, 429, &HeaderMap::new());
    p.observed(&a, reading, 429, None, || "GET /".into()).await;
    drop(a);
    let dest = |pace: Pace| destination(pace, Vec::new());
    let changes = p.reconfigure(&[dest(split(100.0, "host"))]).await.unwrap();
    assert_eq!(changes.changed, ["d"]);
    let none = HeaderMap::new();
    let key = route(&p, "a", &none).await.unwrap();
    assert_eq!(&**key.name(), "d#a", "split from now on");
    assert_eq!(
        p.status().await[0].backoff,
        2.0,
        "the budget keeps its backoff"
    );
    // Without the key again, requests take the budget itself; its keys are kept until idle.
    p.reconfigure(&[dest(Pace::new(100.0))]).await.unwrap();
    assert_eq!(&**route(&p, "a", &none).await.unwrap().name(), "d");
    assert_eq!(p.status().await[0].keys.as_ref().map(|k| k.live), Some(1));
}

#[tokio::test(start_paused = true)]
async fn a_key_forgotten_here_while_paused_keeps_its_pause() {
    let p = pacer(split(10.0, "host"), Arc::new(MemoryStore::ephemeral())).await;
    tokio::spawn(p.clone().keep_keys());
    let none = HeaderMap::new();
    let far = Instant::now() + Duration::from_secs(3600);
    let a = p
        .admit(&route(&p, "a", &none).await.unwrap(), ONE, far)
        .await
        .unwrap();
    let said = crate::pacing::tests::headers(&[("retry-after", "60")]);
    let reading = p.read(&a, 429, &said);
    p.observed(&a, reading, 429, None, || "GET /".into()).await;
    drop(a);
    // Idle past key_idle (10 s): its lane goes, its paused budget stays.
    tokio::time::sleep(Duration::from_secs(13)).await;
    let lane = p.destination("d").unwrap().lane;
    assert_eq!(lane.key_lanes().len(), 0, "the lane is forgotten");
    let again = route(&p, "a", &none).await.unwrap();
    let soon = Instant::now() + Duration::from_secs(5);
    assert!(
        matches!(
            p.admit(&again, ONE, soon).await,
            Err(PaceError::Deadline { .. })
        ),
        "the 60 s pause still holds"
    );
}

#[tokio::test(start_paused = true)]
async fn in_shadow_mode_a_key_past_max_keys_is_counted_not_refused() {
    let p = pacer(
        Pace {
            max_keys: 1,
            mode: crate::destination::Mode::Shadow,
            ..split(10.0, "host")
        },
        Arc::new(MemoryStore::ephemeral()),
    )
    .await;
    let none = HeaderMap::new();
    route(&p, "a", &none).await.unwrap();
    let b = route(&p, "b", &none)
        .await
        .expect("shadow mode refuses nothing");
    assert_eq!(&**b.name(), "d");
    let counted = p
        .metrics
        .shadow_refusals
        .with_label_values(&["d", "", "max_keys"]);
    assert_eq!(counted.get(), 1);
}

/// The route of a request with `authorization` from `client`, or as proxy user `user`.
async fn route_from(
    p: &Pacer,
    authorization: &str,
    client: &str,
    user: Option<&str>,
) -> Result<Route, PaceError> {
    let headers = token(authorization);
    let asking = Asking {
        host: "h",
        user,
        headers: &headers,
        client: Some(client.parse().unwrap()),
        body: None,
    };
    p.keyed(p.destination("d").unwrap(), &asking).await
}

#[tokio::test(start_paused = true)]
async fn one_client_makes_at_most_its_share_of_the_keys_and_leaves_room_for_the_others() {
    let p = pacer(
        Pace {
            max_keys: 4,
            max_keys_per_client: 2,
            ..split(10.0, "header:authorization")
        },
        Arc::new(MemoryStore::ephemeral()),
    )
    .await;
    tokio::spawn(p.clone().keep_keys());
    // One client mints keys: two go, the third is refused, as a client of its own.
    route_from(&p, "t1", "10.0.0.1", None).await.unwrap();
    route_from(&p, "t2", "10.0.0.1", None).await.unwrap();
    match route_from(&p, "t3", "10.0.0.1", None).await {
        Err(PaceError::ClientKeys { client, limit, .. }) => {
            assert_eq!((client.as_str(), limit), ("client 10.0.0.1", 2));
        }
        other => panic!("expected ClientKeys, got {other:?}"),
    }
    assert_eq!(
        p.metrics
            .keys_refused_client
            .with_label_values(&["d", ""])
            .get(),
        1
    );
    // A key it made goes on; a key another made is no new key for it.
    route_from(&p, "t1", "10.0.0.1", None).await.unwrap();
    // Another client, and a proxy user from the same address, each have their own share.
    route_from(&p, "t4", "10.0.0.2", None).await.unwrap();
    route_from(&p, "t5", "10.0.0.1", Some("alice"))
        .await
        .unwrap();
    route_from(&p, "t2", "10.0.0.2", None).await.unwrap();
    // The budget is full (4 keys): max_keys says so, whoever asks.
    assert!(matches!(
        route_from(&p, "t6", "10.0.0.3", None).await,
        Err(PaceError::TooManyKeys { .. })
    ));
    // Once the first client's keys idle out, it may make as many again.
    tokio::time::sleep(Duration::from_secs(13)).await;
    route_from(&p, "t7", "10.0.0.1", None)
        .await
        .expect("room made");
    route_from(&p, "t8", "10.0.0.1", None)
        .await
        .expect("room made");
}

/// A `json:FIELD` key reads the field of a JSON body alone: a short plain value is its own
/// key, any other is hashed, and a body of another content type is not parsed at all.
#[test]
fn a_json_field_is_read_only_from_a_json_body() {
    let with = |content_type: &str, body: &'static [u8]| {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::CONTENT_TYPE, content_type.parse().unwrap());
        let asking = Asking {
            host: "api.example.com",
            user: None,
            headers: &headers,
            client: None,
            body: Some(body),
        };
        match json_field(&asking, "model") {
            Field::Plain(v) => format!("plain {v}"),
            Field::Other(v) => format!("other {}", String::from_utf8(v).unwrap()),
            Field::None => "none".to_owned(),
        }
    };
    let json = "application/json; charset=utf-8";
    assert_eq!(
        with(json, br#"{"model":"gpt-4o-mini","n":1}"#),
        "plain gpt-4o-mini"
    );
    assert_eq!(
        with("application/vnd.api+json", br#"{"model":"m"}"#),
        "plain m"
    );
    assert_eq!(with(json, br#"{"model":{"id":1}}"#), r#"other {"id":1}"#);
    let long = format!("{{\"model\":\"{}\"}}", "x".repeat(PLAIN_FIELD + 1));
    let long: &'static [u8] = Box::leak(long.into_bytes().into_boxed_slice());
    assert!(with(json, long).starts_with("other "));
    assert_eq!(with(json, br#"{"model":"a b"}"#), "other \"a b\"");
    assert_eq!(with(json, br#"{"other":"m"}"#), "none");
    assert_eq!(with(json, b"not json"), "none");
    assert_eq!(with("text/plain", br#"{"model":"m"}"#), "none");
}
