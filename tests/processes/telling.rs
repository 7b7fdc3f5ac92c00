//! What a response tells its client, across processes: two instances on one Postgres pace
//! five requests at two a second, and each answer says how long its request waited
//! (`Server-Timing`) as the client measured it, and where the budget stands (`RateLimit`),
//! after the origin's own items, which reach the client unchanged.

use crate::support;

use std::time::{Duration, Instant};

use support::fleet::{alone, postgres_store, Fleet};
use support::FakeUpstream;

/// pacegate's item of a RateLimit field, or a `Server-Timing` metric's `dur`: `name`'s value.
fn ours(field: &str, item: &str, name: &str) -> Option<f64> {
    field
        .split(", ")
        .find_map(|i| i.strip_prefix(item))?
        .split(';')
        .find_map(|p| p.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_requests_over_two_instances_are_each_told_their_wait_and_the_budget_s_standing() {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let fleet = Fleet::start_n(2, &postgres_store().await, "rate = 2\n").await;
    let url = format!(
        "{}/status/200?h=ratelimit:origin;r=9;t=4&h=server-timing:origin;dur=3",
        upstream.http_url("localhost")
    );
    let sends: Vec<_> = (0..5)
        .map(|i| {
            let (via, url) = (fleet.client(i % 2), url.clone());
            tokio::spawn(async move {
                let sent = Instant::now();
                let resp = via.get(url).send().await.unwrap();
                let took = sent.elapsed();
                assert_eq!(resp.status(), 200);
                let h = |name: &str| resp.headers()[name].to_str().unwrap().to_owned();
                (i % 2, took, h("server-timing"), h("ratelimit"))
            })
        })
        .collect();
    let mut answers = Vec::new();
    for s in sends {
        answers.push(s.await.unwrap());
    }
    answers.sort_by_key(|(_, took, _, _)| *took);
    for (instance, took, timing, ratelimit) in &answers {
        // The origin's items first, as they came.
        assert!(timing.starts_with("origin;dur=3, "), "{timing}");
        assert!(ratelimit.starts_with("origin;r=9;t=4, "), "{ratelimit}");
        // The wait pacegate says is the client's, less the upstream's time and the hops.
        let waited = ours(timing, "pacegate-wait;", "dur").unwrap();
        let upstream_ms = ours(timing, "pacegate-upstream;", "dur").unwrap();
        let rest = took.as_secs_f64() * 1000.0 - waited - upstream_ms;
        assert!(
            (-5.0..50.0).contains(&rest),
            "instance {instance}: the client waited {took:?}, Server-Timing says {waited} ms for the slot and {upstream_ms} ms upstream"
        );
        let r = ours(ratelimit, "\"pacegate\";", "r").unwrap();
        let t = ours(ratelimit, "\"pacegate\";", "t").unwrap();
        assert!(r <= 10.0 && t >= 0.0, "{ratelimit}");
        // A budget that still had requests waiting here says so: fewer slots left, a wait.
        assert_eq!(r == 10.0, t == 0.0, "{ratelimit}");
    }
    // The slots were two a second over both instances: the last waited about two seconds.
    let (_, last, ..) = answers.last().unwrap();
    assert!(
        *last >= Duration::from_millis(1900),
        "five requests at two a second took {last:?}"
    );
    // The first answered on each instance came while its others waited there.
    for instance in 0..2 {
        let (_, _, _, ratelimit) = answers.iter().find(|a| a.0 == instance).unwrap();
        assert!(
            ours(ratelimit, "\"pacegate\";", "t").unwrap() >= 1.0,
            "instance {instance}'s first answer, with requests waiting behind it: {ratelimit}"
        );
    }
}
