//! Budgets in tokens across real OS processes: three instances on one Postgres, twelve
//! workers sending chat completions of random sizes (half of them streamed) to a vendor that
//! keeps a token bucket and answers 429 when it is overrun. With a token meter the vendor
//! never has to; without one (the control) it does, at once. The same of GraphQL queries to
//! a shop whose bucket holds points, each query's cost settled from its answer.

use crate::support;

use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use support::fleet::{alone, postgres_store, Fleet, INSTANCES};
use support::llm::{busiest_by, busiest_tokens, post_json, Charge, FakeLlm};

/// The vendor's tokens a second, and the meter's.
const TOKENS: f64 = 2000.0;

/// Workers per instance.
const WORKERS: usize = 4;

/// How long the workers send.
const RUN: Duration = Duration::from_secs(8);

/// A fleet pacing `local` at 50 requests a second and, with `meter`, 2,000 tokens a second
/// estimated and settled as OpenAI's.
async fn fleet(meter: bool) -> Fleet {
    metered(meter.then(|| {
        format!("[destinations.local.meters.tokens]\nrate = {TOKENS}\ncost = \"openai\"\n")
    }))
    .await
}

/// A fleet pacing `local` at 50 requests a second, never retrying a throttle, with `meter`'s
/// table where one is given.
async fn metered(meter: Option<String>) -> Fleet {
    let keys = format!(
        "rate = 50\nretry_throttled = 0\n{}",
        meter.unwrap_or_default()
    );
    Fleet::start(&postgres_store().await, &keys).await
}

/// `INSTANCES * WORKERS` workers, spread over the fleet's instances, send chat completions
/// to `vendor` one after the other until `run` is over: prompts of 200 to 2,000 bytes,
/// `max_tokens` 100 to 600, every other one streamed with usage asked for. Returns the
/// statuses the workers saw.
async fn work(fleet: &Fleet, vendor: &FakeLlm, run: Duration) -> Vec<u16> {
    // Every worker's first request goes at once: a burst far past the vendor's bucket,
    // unless each waits for what the ones before it were estimated at.
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(INSTANCES * WORKERS));
    let until = Instant::now() + run;
    let mut tasks = Vec::new();
    for i in 0..INSTANCES {
        for w in 0..WORKERS {
            let via = fleet.client(i % fleet.instances.len());
            let url = vendor.url();
            let start = start.clone();
            let mut rng = rand::rngs::StdRng::seed_from_u64((i * WORKERS + w) as u64);
            tasks.push(tokio::spawn(async move {
                let mut statuses = Vec::new();
                let mut n = 0;
                start.wait().await;
                while Instant::now() < until {
                    let prompt = "x".repeat(rng.random_range(200..2000));
                    let max_tokens: u64 = rng.random_range(100..600);
                    let stream = n % 2 == 1;
                    let mut body = serde_json::json!({
                        "model": "gpt-test",
                        "max_tokens": max_tokens,
                        "messages": [{"role": "user", "content": prompt}],
                    });
                    if stream {
                        body["stream"] = true.into();
                        body["stream_options"] = serde_json::json!({"include_usage": true});
                    }
                    let resp = post_json(&via, &url, &body).await;
                    statuses.push(resp.status().as_u16());
                    let _ = resp.bytes().await;
                    n += 1;
                }
                statuses
            }));
        }
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// What the vendor counted, once it is seen to have refused nothing, and the workers to
/// have been answered 200 every time.
fn none_refused(vendor: &FakeLlm, statuses: &[u16]) -> Vec<Charge> {
    let charges = vendor.charges();
    let refused = charges.iter().filter(|c| c.status == 429).count();
    assert_eq!(
        refused,
        0,
        "the vendor refused {refused} of {}",
        charges.len()
    );
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    charges
}

/// Tokens a second the vendor counted, first arrival to last.
fn achieved(charges: &[Charge]) -> f64 {
    let total: u64 = charges.iter().map(|c| c.tokens).sum();
    let span = charges.last().unwrap().at - charges[0].at;
    total as f64 / span.as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_keep_one_token_ceiling_and_settle_what_each_request_cost() {
    let _alone = alone().await;
    // A bucket of one second's tokens: a burst past the rate by more than a second's worth
    // is refused.
    let vendor = FakeLlm::start(TOKENS, TOKENS).await;
    let fleet = fleet(true).await;
    let statuses = work(&fleet, &vendor, RUN).await;
    let charges = none_refused(&vendor, &statuses);
    // A window of the meter's length (a second, for a `rate`) holds at most its rate's
    // worth plus one request.
    let largest = charges.iter().map(|c| c.estimate).max().unwrap();
    let busiest = busiest_tokens(&charges, Duration::from_secs(1));
    assert!(
        busiest <= TOKENS as u64 + largest,
        "{busiest} tokens within one second at {TOKENS} a second (largest estimate {largest})"
    );
    let rate = achieved(&charges);
    assert!(
        rate >= 0.85 * TOKENS,
        "achieved {rate:.0} tokens a second of {TOKENS}, over {} requests",
        charges.len()
    );
    assert!(
        charges.iter().filter(|c| c.stream).count() * 3 >= charges.len(),
        "streams were sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_meter_the_same_load_is_refused_by_the_vendor() {
    let _alone = alone().await;
    let vendor = FakeLlm::start(TOKENS, TOKENS).await;
    let fleet = fleet(false).await;
    work(&fleet, &vendor, Duration::from_secs(2)).await;
    let charges = vendor.charges();
    let refused = charges.iter().filter(|c| c.status == 429).count();
    assert!(
        refused >= 5,
        "only {refused} of {} refused at 50 requests a second with no token meter",
        charges.len()
    );
}

/// A token quota of fixed windows, made short: 12,000 tokens in each 2 s.
const QUOTA: f64 = 12_000.0;
const QUOTA_PER: Duration = Duration::from_secs(2);

/// A fleet with a token meter far faster than the quota allows (100,000 tokens a second)
/// and the quota's windows on it, or (the control) with no meter at all.
async fn quota_fleet(windows: bool) -> Fleet {
    metered(windows.then(|| {
        format!(
            "[destinations.local.meters.tokens]\nrate = 100000\ncost = \"openai\"\n\
             quota = [{{ limit = {QUOTA}, per = \"{}s\" }}]\n",
            QUOTA_PER.as_secs()
        )
    }))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_quota_of_fixed_windows_is_never_overrun_by_three_processes() {
    let _alone = alone().await;
    let vendor = FakeLlm::quota(QUOTA, QUOTA_PER).await;
    let fleet = quota_fleet(true).await;
    let statuses = work(&fleet, &vendor, 3 * QUOTA_PER).await;
    let charges = none_refused(&vendor, &statuses);
    // A quota is a hard ceiling: a window counts each request at its estimate, and a charge
    // past it when the usage says so, so that what the vendor counts never passes the limit
    // in any window, sliding or fixed.
    let busiest = busiest_tokens(&charges, QUOTA_PER);
    assert!(
        busiest <= QUOTA as u64,
        "{busiest} tokens within {QUOTA_PER:?} for a quota of {QUOTA}"
    );
    // The windows count each request at its estimate (about 1.5 times what it costs here):
    // the three instances fill one to its limit that way, and neither stall nor starve it.
    let filled = busiest_by(&charges, QUOTA_PER, |c| c.estimate);
    assert!(
        filled as f64 >= 0.85 * QUOTA,
        "the fullest window held requests estimated at {filled} of {QUOTA}"
    );
    let total: u64 = charges.iter().map(|c| c.tokens).sum();
    assert!(
        total as f64 >= 3.0 * 0.35 * QUOTA,
        "{total} tokens in three windows of {QUOTA}, over {} requests",
        charges.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_quota_the_same_load_overruns_the_vendor_s_quota() {
    let _alone = alone().await;
    let vendor = FakeLlm::quota(QUOTA, QUOTA_PER).await;
    let fleet = quota_fleet(false).await;
    work(&fleet, &vendor, QUOTA_PER).await;
    let charges = vendor.charges();
    let refused = charges.iter().filter(|c| c.status == 429).count();
    assert!(
        refused >= 5,
        "only {refused} of {} refused past a quota of {QUOTA} tokens with no token meter",
        charges.len()
    );
}

/// Anthropic's input and output tokens a second: the output binds. A meter's window of its
/// own length (here a second) counts each request at its estimate until it is settled and
/// keeps room for a slot used late, so what a test can reach depends on how large a request
/// is against that window: estimates of up to 600 output tokens are a tenth of a second's
/// here, as they are a thirteenth of a minute's at 8,000 output tokens a minute. (At 1,000
/// a second, where one is up to 60% of a second's, three instances reach 78 to 85%.)
const INPUT: f64 = 18_000.0;
const OUTPUT: f64 = 6000.0;

/// The Anthropic load through `instances` instances on `store`, with an input and an output
/// meter at the vendor's rates: no 429, and each meter's busiest second within its bound.
/// Returns the output tokens a second achieved, how many of the output meter's slots were
/// given back and taken again, and how many requests went.
async fn anthropic(instances: usize, store: &str) -> (f64, f64, usize) {
    let vendor = FakeLlm::anthropic(INPUT, OUTPUT).await;
    let keys = format!(
        "rate = 100\nretry_throttled = 0\n\
         [destinations.local.meters.input]\nrate = {INPUT}\ncost = \"anthropic-input\"\n\
         [destinations.local.meters.output]\nrate = {OUTPUT}\ncost = \"anthropic-output\"\n"
    );
    let fleet = Fleet::start_n(instances, store, &keys).await;
    let statuses = work(&fleet, &vendor, Duration::from_secs(12)).await;
    let charges = none_refused(&vendor, &statuses);
    // Each meter's window of a second holds at most its rate and one request's estimate in
    // its unit. The input is estimated at the body's bytes / 4, the output at max_tokens.
    for (what, rate, busiest, estimate) in [
        (
            "input",
            INPUT,
            busiest_by(&charges, Duration::from_secs(1), |c| c.input),
            charges
                .iter()
                .map(|c| c.estimate - c.output * 2)
                .max()
                .unwrap(),
        ),
        (
            "output",
            OUTPUT,
            busiest_by(&charges, Duration::from_secs(1), |c| c.output),
            charges.iter().map(|c| c.output * 2).max().unwrap(),
        ),
    ] {
        assert!(
            busiest <= rate as u64 + estimate,
            "{busiest} {what} tokens within one second at {rate} a second (largest estimate {estimate})"
        );
    }
    let output: u64 = charges.iter().map(|c| c.output).sum();
    let span = charges.last().unwrap().at - charges[0].at;
    let mut retaken = 0.0;
    for i in 0..instances {
        retaken += fleet
            .metric(
                i,
                "pacegate_meter_retaken_total{destination=\"local~output\",group=\"\"}",
            )
            .await;
    }
    (output as f64 / span.as_secs_f64(), retaken, charges.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_input_and_output_meters_each_keep_their_own_ceiling() {
    let _alone = alone().await;
    let (rate, retaken, requests) = anthropic(INSTANCES, &postgres_store().await).await;
    // The output's estimate (max_tokens) is twice what it costs, and a request waits for two
    // meters and for its turn among three instances (about 32 requests a second, the request
    // budget's 100 not binding): 90 to 93% measured over 12 s; 76 to 79% with the schedule
    // that lost the refunds coming once the next slot was granted (docs/benchmarks.md).
    assert!(
        rate >= 0.85 * OUTPUT,
        "achieved {rate:.0} output tokens a second of {OUTPUT}"
    );
    // Nor hold each other up: the input, which does not bind, lends a request early slots,
    // so that the output's slot is rarely given back while the input's comes (0 to 5 of
    // about 380 requests).
    assert!(
        retaken <= 0.1 * requests as f64,
        "{retaken} of the output meter's slots given back and taken again, over {requests} requests"
    );
}

/// Shopify's points a second and its bucket's size; the meter's rate is the vendor's.
const POINTS: f64 = 200.0;
const BUCKET: f64 = 400.0;

/// Twenty GraphQL queries at once from four workers spread over the instances, five each
/// one after the other: five query texts, each of a cost drawn once (10 to 60 points, as a
/// query's cost follows its text), each sent four times. Returns the statuses the workers
/// saw.
async fn queries(fleet: &Fleet, vendor: &FakeLlm) -> Vec<u16> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(47);
    let texts: Vec<String> = (0..5)
        .map(|i| {
            let cost: u64 = rng.random_range(10..=60);
            format!("query Q{i} {{ products(first: {cost}) {{ edges {{ node {{ id }} }} }} }}")
        })
        .collect();
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(4));
    let mut tasks = Vec::new();
    for w in 0..4 {
        let via = fleet.client(w % INSTANCES);
        let (url, start) = (vendor.url(), start.clone());
        let mine: Vec<String> = (0..5).map(|j| texts[(w + j) % 5].clone()).collect();
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let mut statuses = Vec::new();
            for query in mine {
                let resp = post_json(&via, &url, &serde_json::json!({ "query": query })).await;
                statuses.push(resp.status().as_u16());
                let _ = resp.bytes().await;
            }
            statuses
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// A fleet pacing `local` at 50 queries a second and, with `meter`, at Shopify's points a
/// second, each query estimated at 60 until it has been settled once.
async fn shop(meter: bool) -> Fleet {
    metered(meter.then(|| {
        format!("[destinations.local.meters.points]\nrate = {POINTS}\ncost = \"shopify-graphql\"\ndefault = 60\n")
    }))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graphql_queries_of_random_cost_stay_within_the_points_rate() {
    let _alone = alone().await;
    let vendor = FakeLlm::shopify(POINTS, BUCKET).await;
    let fleet = shop(true).await;
    let statuses = queries(&fleet, &vendor).await;
    let charges = none_refused(&vendor, &statuses);
    assert_eq!(charges.len(), 20);
    // As docs/configuration.md bounds it: the rate's worth a second, one query's estimate
    // (the default, 60, before a text's first settlement), what one query was estimated
    // above its cost, and 50 ms of the rate.
    let cheapest = charges.iter().map(|c| c.tokens).min().unwrap();
    let bound = POINTS as u64 + 60 + (60 - cheapest) + POINTS as u64 / 20;
    let busiest = busiest_tokens(&charges, Duration::from_secs(1));
    assert!(
        busiest <= bound,
        "{busiest} points within one second at {POINTS} a second (at most {bound})"
    );
    // How soon they went is not asserted here: each instance learns each query's cost on
    // its own, and a loaded machine stretches the first ones (2.97 to 4.81 s for these 556
    // points at 200 a second, against 6 s at the default). The in-process scenario
    // `meters::a_query_settled_once_is_estimated_at_what_it_cost_the_next_time` shows the
    // recall alone.
    let total: u64 = charges.iter().map(|c| c.tokens).sum();
    let span = charges.last().unwrap().at - charges[0].at;
    eprintln!("{total} points in {span:?} at {POINTS} a second, the busiest second {busiest}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_points_meter_the_same_queries_are_throttled() {
    let _alone = alone().await;
    let vendor = FakeLlm::shopify(POINTS, BUCKET).await;
    let fleet = shop(false).await;
    queries(&fleet, &vendor).await;
    let charges = vendor.charges();
    let throttled = charges.iter().filter(|c| c.status == 429).count();
    assert!(
        throttled >= 2,
        "only {throttled} of {} throttled at 50 queries a second with no points meter",
        charges.len()
    );
}
