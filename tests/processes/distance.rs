//! A store a network hop away, as operators deploy it: three `pacegate serve` instances reach
//! PostgreSQL through a relay that delays every chunk by half a round trip. Distance may cost
//! a request latency, never the destination its rate: at three times the load, every 1 s
//! window holds at most R + 1 arrivals at the upstream and the fleet achieves 95% of R.

use crate::support;

use std::time::{Duration, Instant};

use support::fleet::{address_of, alone, store_via, Fleet, INSTANCES};
use support::relay::Relay;
use support::{busiest, testdb, FakeUpstream};

/// Three instances on a fresh database, each through one relay `round_trip` away.
async fn far_fleet(round_trip: Duration, keys: &str) -> (Fleet, Relay) {
    let url = testdb::fresh().await;
    let relay = Relay::far(address_of(&url), round_trip / 2).await;
    let store = store_via(&url, Some(relay.addr()));
    let fleet = Fleet::start_each(&vec![store; INSTANCES], &[keys], &[]).await;
    fleet.see_live(INSTANCES).await;
    (fleet, relay)
}

/// `seconds` of slots at the ceiling asked for at once, through three instances whose store
/// is `round_trip` away: no 1 s window over R + 1, and `share` of R achieved over the burst.
async fn keeps_rate_and_ceiling(rate: f64, round_trip: Duration, seconds: f64, share: f64) {
    let _alone = alone().await;
    let upstream = FakeUpstream::start().await;
    let (fleet, _relay) = far_fleet(round_trip, &format!("rate = {rate}")).await;
    let per_instance = (rate * seconds / INSTANCES as f64) as usize;
    let at = fleet.load(&upstream, per_instance).await;
    let what = format!("rate {rate} with the store {round_trip:?} away");
    let most = busiest(&at, Duration::from_secs(1));
    assert!(
        most <= rate as usize + 1,
        "{what}: {most} arrivals within one second; {}",
        fleet.explain(&upstream)
    );
    // The warm-ups go one by one before the burst: the rate is the burst's.
    let burst = &at[INSTANCES..];
    let achieved = (burst.len() - 1) as f64 / (*burst.last().unwrap() - burst[0]).as_secs_f64();
    eprintln!("{what}: busiest second {most}, achieved {achieved:.1}/s");
    assert!(
        achieved >= share * rate,
        "{what}: achieved {achieved:.1}/s, under {:.0}%; {}",
        share * 100.0,
        fleet.explain(&upstream)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_10ms_away_keeps_rate_50() {
    keeps_rate_and_ceiling(50.0, Duration::from_millis(10), 4.0, 0.95).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_2ms_away_keeps_rate_200() {
    keeps_rate_and_ceiling(200.0, Duration::from_micros(2500), 4.0, 0.95).await;
}

/// At 1,000 a second the whole load (2,000 requests through three proxies at once) costs this
/// 2-core machine more than the pacing: with no delay at all, or straight to the database,
/// the same run achieved 766 to 914 a second, and this one 613 to 905 over eight runs. So it
/// asks for half, which a far store's slots too late to use (none sent, before the lead)
/// would not reach; the ceiling holds either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_2ms_away_keeps_rate_1000() {
    keeps_rate_and_ceiling(1000.0, Duration::from_micros(2500), 2.0, 0.5).await;
}

/// Over 9 s: at rate 10, one stall of a few hundred milliseconds on a 2-core machine (three
/// instances, the relay and PostgreSQL at once) drops three slots as late, 7% of 4.5 s but
/// under 4% of 9 s (seen once in CI: one instance, at 1.2 s). A loss that comes with the
/// distance itself recurs every second, and fails either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_50ms_away_keeps_rate_10() {
    keeps_rate_and_ceiling(10.0, Duration::from_millis(50), 9.0, 0.95).await;
}

/// The control: the relay itself, with no delay, changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_a_relay_without_delay_keeps_rate_50() {
    keeps_rate_and_ceiling(50.0, Duration::ZERO, 4.0, 0.95).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_request_waits_about_one_round_trip_for_a_store_50ms_away() {
    let _alone = alone().await;
    let round_trip = Duration::from_millis(50);
    let upstream = FakeUpstream::start().await;
    let (fleet, _relay) = far_fleet(round_trip, "rate = 10").await;
    let via = fleet.client(0);
    let url = format!("{}/lone", upstream.http_url("localhost"));
    // The first opens the upstream connection; the rest go each after an idle interval.
    assert_eq!(via.get(&url).send().await.unwrap().status(), 200);
    let mut took = Vec::new();
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        assert_eq!(via.get(&url).send().await.unwrap().status(), 200);
        took.push(started.elapsed());
    }
    took.sort();
    let median = took[took.len() / 2];
    eprintln!("a lone request through a store {round_trip:?} away: {took:?}");
    // One round trip to reserve its slot, the slot placed for when its answer arrives; the
    // rest is the way through on loopback (a few milliseconds, as next to the store).
    assert!(
        median <= round_trip + Duration::from_millis(15),
        "a lone request took {median:?} (all: {took:?}) with the store {round_trip:?} away; {}",
        fleet.explain(&upstream)
    );
    // And none two: a reservation that met no idle connection (a heartbeat's chores had it)
    // or one that had not prepared its statement (the one that migrated) paid a round trip
    // or three more (see `PostgresStore::warm`).
    let slowest = took[took.len() - 1];
    assert!(
        slowest < round_trip * 2 - Duration::from_millis(10),
        "a lone request took {slowest:?} (all: {took:?}) with the store {round_trip:?} away: two round trips; {}",
        fleet.explain(&upstream)
    );
}
