//! The contract's checks of what the vendor says and of blocks: views shared and raced by
//! window, the reserve, the escalating block, and dates read on the store's clock.

use std::time::Duration;

use tokio::time::Instant;

use super::{apart, read, rule, take, Reading};
use crate::budget::{BudgetView, Event, Observation, Pause, PauseCause, Rule, Store};
use crate::destination::{Block, VendorPace};
use crate::signals::Family;

fn seen(remaining: u64, reset: Pause) -> Option<Observation> {
    Some(Observation {
        family: Family::Ietf,
        remaining,
        limit: Some(100),
        reset,
        spread: 0.0,
        unanswered: 0,
    })
}

fn secs(n: u64) -> Pause {
    Pause::For(Duration::from_secs(n))
}

pub(super) async fn a_vendor_view_spreads_what_is_left_until_the_reset(
    store: &impl Store,
    tol: Duration,
) {
    let r = Rule {
        reserve: 1,
        vendor_pace: VendorPace::Spread,
        ..rule(1000.0)
    };
    // 5 left, 1 kept in reserve: 4 spread over the 4 s to the reset, then the reset.
    let sent = Instant::now();
    store
        .record("d", &r, Event::None, seen(5, secs(4)))
        .await
        .unwrap();
    let said = Reading {
        at: Instant::now(),
        sent,
        arrived: Instant::now(),
    };
    for k in 1..=4u32 {
        let (slot, _) = read(store, "d", &r).await;
        // The view was said somewhere within the record's round trip.
        apart(
            Reading {
                at: said.arrived,
                ..said
            },
            slot,
            Duration::from_secs(u64::from(k)),
            tol,
            &format!("slot {k} of a view of 4 usable in 4 s"),
        );
    }
    let (fifth, _) = read(store, "d", &r).await;
    assert!(
        fifth.at + tol >= said.sent + Duration::from_secs(4),
        "past the usable requests, the reset"
    );
    let view = store.view("d").await.unwrap();
    let vendor = view.vendor.expect("the view lasts until its reset");
    assert_eq!(
        (vendor.family, vendor.remaining, vendor.limit),
        (Family::Ietf, 0, Some(100))
    );
    assert!(vendor.reset_in <= Duration::from_secs(4), "{vendor:?}");
}

pub(super) async fn a_vendor_view_with_some_left_is_spent_at_the_rate_then_waits_for_the_reset(
    store: &impl Store,
    tol: Duration,
) {
    let r = Rule {
        reserve: 1,
        ..rule(10.0)
    };
    // 4 left, 1 kept in reserve: 3 at the rate (100 ms apart), then the reset 4 s away.
    let sent = Instant::now();
    store
        .record("d", &r, Event::None, seen(4, secs(4)))
        .await
        .unwrap();
    let (first, _) = read(store, "d", &r).await;
    let mut last = first;
    for k in 2..=3u32 {
        let (slot, _) = read(store, "d", &r).await;
        apart(
            last,
            slot,
            Duration::from_millis(100),
            tol,
            &format!("slot {k} of 3 usable, at the rate"),
        );
        last = slot;
    }
    let (fourth, _) = read(store, "d", &r).await;
    assert!(
        fourth.at + tol >= sent + Duration::from_secs(4),
        "past the usable requests, the reset: {:?} after the view",
        fourth.at - sent
    );
}

pub(super) async fn requests_unanswered_when_the_vendor_said_count_against_its_view(
    store: &impl Store,
) {
    let r = rule(50.0);
    // 5 left, and 5 requests on their way that it may not count: none is.
    let said = Observation {
        unanswered: 5,
        ..seen(5, secs(10)).unwrap()
    };
    let view = store
        .record("d", &r, Event::None, Some(said))
        .await
        .unwrap();
    assert_eq!(view.vendor.map(|v| v.remaining), Some(0), "{view:?}");
    assert_eq!(view.paused_by, Some(PauseCause::Exhausted), "{view:?}");
    // Another window's view, with 2 of its 5 on their way: 3.
    let later = Observation {
        unanswered: 2,
        ..seen(5, secs(20)).unwrap()
    };
    let view = store
        .record("d", &r, Event::None, Some(later))
        .await
        .unwrap();
    assert_eq!(view.vendor.map(|v| v.remaining), Some(3), "{view:?}");
}

pub(super) async fn views_race_by_window_and_the_lower_remaining_wins(store: &impl Store) {
    let r = rule(1.0);
    let remaining = |v: BudgetView| v.vendor.map(|v| v.remaining);
    let record = |n, reset| store.record("d", &r, Event::None, seen(n, reset));
    assert_eq!(remaining(record(10, secs(30)).await.unwrap()), Some(10));
    // The same window, said later by another instance that saw more left: kept at 10.
    assert_eq!(remaining(record(20, secs(30)).await.unwrap()), Some(10));
    assert_eq!(remaining(record(3, secs(31)).await.unwrap()), Some(3));
    // An older window, said late: never replaces the newer one.
    assert_eq!(remaining(record(50, secs(5)).await.unwrap()), Some(3));
    // A newer window replaces it (a reset is capped by `retry_after_max`, 60 s here).
    assert_eq!(remaining(record(50, secs(50)).await.unwrap()), Some(50));
    // A reset in the past says nothing.
    let past = Pause::Until(std::time::SystemTime::now() - Duration::from_secs(1));
    assert_eq!(remaining(record(0, past).await.unwrap()), Some(50));
}

pub(super) async fn at_the_reserve_the_destination_pauses_until_the_reset(store: &impl Store) {
    let r = Rule {
        reserve: 2,
        ..rule(100.0)
    };
    let before = Instant::now();
    let view = store
        .record("d", &r, Event::None, seen(2, secs(3)))
        .await
        .unwrap();
    assert_eq!(view.paused_by, Some(PauseCause::Exhausted), "{view:?}");
    assert!(view.paused_for > Duration::from_millis(2900), "{view:?}");
    let slot = take(store, "d", &r, None).await.unwrap();
    assert!(
        slot.at >= before + Duration::from_secs(3),
        "no slot before the reset"
    );
}

pub(super) async fn blocks_escalate_and_one_success_ends_them(store: &impl Store) {
    let r = Rule {
        block: Some(Block {
            min: Duration::from_secs(1),
            max: Duration::from_secs(4),
            jitter: 0.0,
        }),
        ..rule(100.0)
    };
    let throttle = |generation, retry_after| Event::Throttled {
        generation,
        retry_after,
        reset: None,
        spread: 0.0,
    };
    let record = |e| store.record("d", &r, e, None);
    // A pause of `secs` set after `since`, read now: no longer, and shorter by at most the
    // time since (round trips on a loaded machine included).
    let within = |v: &BudgetView, secs: u64, since: Instant| {
        let pause = Duration::from_secs(secs);
        v.paused_for <= pause && v.paused_for + since.elapsed() >= pause
    };
    let since = Instant::now();
    let v = record(throttle(0, None)).await.unwrap();
    assert!(
        within(&v, 1, since) && v.block_streak == 1,
        "first block: {v:?}"
    );
    assert_eq!(v.paused_by, Some(PauseCause::Block));
    let since = Instant::now();
    let v = record(throttle(1, None)).await.unwrap();
    assert!(
        within(&v, 2, since) && v.block_streak == 2,
        "doubled: {v:?}"
    );
    // A throttle of an older generation (in flight with the first) blocks nothing more.
    let v = record(throttle(1, None)).await.unwrap();
    assert_eq!(v.block_streak, 2, "{v:?}");
    // The server's own Retry-After is obeyed and does not advance the streak.
    let v = record(throttle(2, Some(secs(1)))).await.unwrap();
    assert_eq!(v.block_streak, 2, "{v:?}");
    assert!(
        within(&v, 2, since),
        "a shorter pause never shortens a longer one: {v:?}"
    );
    let since = Instant::now();
    for _ in 0..3 {
        record(throttle(3, None)).await.unwrap();
    }
    let v = store.view("d").await.unwrap();
    assert!(
        within(&v, 4, since) && v.block_streak == 3,
        "capped at max: {v:?}"
    );
    // A clean 404 does not end the streak; one success does.
    let v = record(Event::Clean {
        success: false,
        generation: v.generation,
    })
    .await
    .unwrap();
    assert_eq!(v.block_streak, 3);
    let v = record(Event::Clean {
        success: true,
        generation: v.generation,
    })
    .await
    .unwrap();
    assert_eq!(v.block_streak, 0);
    let v = record(throttle(v.generation, None)).await.unwrap();
    assert_eq!(v.block_streak, 1, "the next block is `min` again: {v:?}");
}

pub(super) async fn a_date_is_read_on_the_store_clock(store: &impl Store) {
    let r = rule(100.0);
    let until = Pause::Until(std::time::SystemTime::now() + Duration::from_secs(5));
    let event = Event::Throttled {
        generation: 0,
        retry_after: Some(until),
        reset: None,
        spread: 0.0,
    };
    let v = store.record("d", &r, event, None).await.unwrap();
    assert!(
        v.paused_for > Duration::from_millis(4800) && v.paused_for <= Duration::from_secs(5),
        "{v:?}"
    );
    assert_eq!(v.paused_by, Some(PauseCause::RetryAfter));
}
