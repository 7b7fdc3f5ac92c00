//! The budget arithmetic on fixed cases, named as behaviours.

use super::*;
use crate::budget::Pause;

fn rule(rate: f64, burst: u32) -> Rule {
    Rule {
        interval: Duration::from_secs_f64(1.0 / rate),
        cost: 1,
        metered: false,
        burst,
        backoff_factor: 2.0,
        backoff_max: 8.0,
        decay_after: 3,
        retry_after_max: Duration::from_secs(60),
        shares: std::sync::Arc::from(vec![0.0; 3]),
        quota: Vec::new(),
        window: None,
        largest: 0,
        reserve: 0,
        vendor_pace: VendorPace::Burst,
        block: None,
    }
}

const INTERACTIVE: Class = Class(0);
const SCHEDULED: Class = Class(1);
const BACKFILL: Class = Class(2);

/// Grants `n` slots with every class in `waiting` always waiting; returns who got each.
fn run(shares: &[f64], waiting: &[Class], n: usize) -> Vec<Class> {
    let mut credits = Vec::new();
    (0..n)
        .map(|_| {
            let (c, next) = choose(&credits, shares, waiting).unwrap();
            credits = next;
            c
        })
        .collect()
}

#[test]
fn the_most_urgent_waiting_class_goes_first() {
    assert_eq!(
        run(&[0.0; 3], &[BACKFILL, INTERACTIVE], 5),
        [INTERACTIVE; 5]
    );
    assert_eq!(run(&[0.0; 3], &[BACKFILL, SCHEDULED], 2), [SCHEDULED; 2]);
    assert_eq!(choose(&[], &[0.0; 3], &[]), None);
}

#[test]
fn a_share_is_honoured_while_its_class_waits() {
    let got = run(&[0.0, 0.0, 0.2], &[INTERACTIVE, BACKFILL], 100);
    let backfill = got.iter().filter(|c| **c == BACKFILL).count();
    assert_eq!(backfill, 20, "{got:?}");
    // Spread out, not bunched: every run of five slots holds exactly one.
    for five in got.chunks(5) {
        assert_eq!(five.iter().filter(|c| **c == BACKFILL).count(), 1);
    }
    // Two shared classes and an urgent one.
    let got = run(&[0.0, 0.25, 0.1], &[INTERACTIVE, SCHEDULED, BACKFILL], 200);
    let count = |k| got.iter().filter(|c| **c == k).count();
    // Each gets its share, to within one slot.
    assert!(count(SCHEDULED).abs_diff(50) <= 1, "{got:?}");
    assert!(count(BACKFILL).abs_diff(20) <= 1, "{got:?}");
}

#[test]
fn a_share_is_lent_when_its_class_is_idle_and_not_saved_up() {
    // Backfill alone gets every slot; interactive alone too, whatever backfill's share.
    assert_eq!(run(&[0.0, 0.0, 0.2], &[BACKFILL], 10), [BACKFILL; 10]);
    assert_eq!(run(&[0.0, 0.0, 0.2], &[INTERACTIVE], 10), [INTERACTIVE; 10]);
    // A long idle spell earns no credit: when backfill comes back it gets its share, not
    // a burst of what it missed.
    let (_, credits) = choose(&[], &[0.0, 0.0, 0.2], &[INTERACTIVE]).unwrap();
    assert_eq!(credits, [0.0; 3]);
    let (first, _) = choose(&credits, &[0.0, 0.0, 0.2], &[INTERACTIVE, BACKFILL]).unwrap();
    assert_eq!(first, INTERACTIVE);
}

/// What the tests below call now.
const NOW: Duration = Duration::from_secs(10);

/// `count` requests of `class`, the oldest waiting `oldest_ms` and the next `next_ms` at
/// [`NOW`].
fn queue(class: Class, count: u32, oldest_ms: u64, next_ms: Option<u64>) -> Waiting {
    Waiting {
        class,
        count,
        since: NOW - Duration::from_millis(oldest_ms),
        next_since: next_ms.map(|n| NOW - Duration::from_millis(n)),
    }
}

#[test]
fn the_oldest_request_of_the_class_wins_over_every_instance() {
    let r = rule(10.0, 1);
    let mut b = Budget::default();
    let now = NOW;
    // Instance a has backfill waiting for 5 s; b has an interactive request of 1 ms.
    let ask_b = [queue(INTERACTIVE, 1, 1, None)];
    b.tell("b", &ask_b);
    assert_eq!(
        b.reserve_for(
            &r,
            now,
            "a",
            &[queue(BACKFILL, 50, 5000, Some(4000))],
            None,
            1
        ),
        Err(NoSlot::Yield)
    );
    let class = b.reserve_for(&r, now, "b", &ask_b, None, 1).unwrap().class;
    assert_eq!(class, INTERACTIVE);
    // b's request was served and left the list; a goes next.
    assert!(!b.waiting.contains_key("b"));
    let class = b
        .reserve_for(
            &r,
            now,
            "a",
            &[queue(BACKFILL, 50, 5000, Some(4000))],
            None,
            1,
        )
        .unwrap()
        .class;
    assert_eq!(class, BACKFILL);
    assert_eq!(b.waiting["a"][0].count, 49);
    assert_eq!(b.waiting_at(now)[0], (BACKFILL, 49, Duration::from_secs(4)));
    // Within a class, the older head wins, whichever instance asks.
    b.tell("c", &[queue(BACKFILL, 1, 4500, None)]);
    assert_eq!(
        b.reserve_for(&r, now, "a", &[queue(BACKFILL, 49, 4000, None)], None, 1),
        Err(NoSlot::Yield)
    );
    assert!(b
        .reserve_for(&r, now, "c", &[queue(BACKFILL, 1, 4500, None)], None, 1)
        .is_ok());
}

/// Takes `n` slots for `instance` one answer at a time, as `n` asks of one slot each would.
fn one_by_one(b: &mut Budget, r: &Rule, now: Duration, list: Waiting, n: usize) -> Vec<Duration> {
    let mut list = list;
    (0..n)
        .map_while(|_| {
            let g = b.reserve_for(r, now, "a", &[list], None, 1).ok()?;
            list.count -= 1;
            list.since = list.next_since.unwrap_or(list.since);
            list.next_since = None;
            Some(g.slot)
        })
        .collect()
}

#[test]
fn a_batch_is_the_slots_one_by_one_would_take_within_the_horizon() {
    let mut r = rule(1000.0, 1);
    let many = queue(BACKFILL, 100, 30, Some(20));
    let mut b = Budget::default();
    let g = b.reserve_for(&r, NOW, "a", &[many], None, 100).unwrap();
    let all: Vec<Duration> = std::iter::once(g.slot).chain(g.more.clone()).collect();
    // 1 ms apart, from now to the horizon.
    assert_eq!(all.len(), 51, "{all:?}");
    assert_eq!(all[0], NOW);
    assert_eq!(*all.last().unwrap(), NOW + BATCH_HORIZON);
    assert!(all.windows(2).all(|w| w[1] - w[0] == ms(1)));
    assert_eq!(
        b.waiting["a"][0].count, 49,
        "the batch's requests left the list"
    );
    // The same slots, and the same budget after them, as 51 answers of one slot each.
    let mut single = Budget::default();
    assert_eq!(one_by_one(&mut single, &r, NOW, many, 51), all);
    assert_eq!(single.next_at, b.next_at);
    // With quota windows and a vendor's budget, slot by slot too.
    r.quota = vec![crate::destination::Quota {
        limit: 7,
        per: Duration::from_millis(20),
    }];
    let vendor = Vendor {
        family: crate::signals::Family::Ietf,
        remaining: 30,
        limit: Some(30),
        observed: NOW,
        reset: NOW + ms(60),
        taken: 0,
    };
    let mut b = Budget {
        vendor: Some(Box::new(vendor)),
        ..Budget::default()
    };
    let mut single = b.clone();
    let g = b.reserve_for(&r, NOW, "a", &[many], None, 100).unwrap();
    let all: Vec<Duration> = std::iter::once(g.slot).chain(g.more).collect();
    assert!(all.len() > 1 && all.len() < 51, "{all:?}");
    assert!(*all.last().unwrap() <= all[0] + BATCH_HORIZON);
    assert_eq!(one_by_one(&mut single, &r, NOW, many, all.len()), all);
    assert_eq!((single.next_at, &single.sends), (b.next_at, &b.sends));
    assert_eq!(single.vendor, b.vendor);
    // No 20 ms window holds more than 7.
    for (i, s) in all.iter().enumerate() {
        assert!(all[i..].iter().filter(|t| **t < *s + ms(20)).count() <= 7);
    }
}

#[test]
fn a_batch_keeps_to_pauses_limits_and_lockouts() {
    let r = rule(1000.0, 1);
    let many = queue(BACKFILL, 100, 30, Some(20));
    // Paused for 20 ms: the batch starts after the pause.
    let mut b = Budget {
        paused_until: NOW + ms(20),
        ..Budget::default()
    };
    let g = b.reserve_for(&r, NOW, "a", &[many], None, 100).unwrap();
    assert_eq!(g.slot, NOW + ms(20));
    assert_eq!(g.more.len(), 50);
    // `not_after` bounds every slot of it: the waiters' deadlines.
    let mut b = Budget::default();
    let g = b
        .reserve_for(&r, NOW, "a", &[many], Some(NOW + ms(10)), 100)
        .unwrap();
    assert_eq!(g.more.last(), Some(&(NOW + ms(10))));
    assert_eq!(b.next_at, NOW + ms(11), "nothing taken past the limit");
    // No more than the requests waiting, nor than asked.
    let mut b = Budget::default();
    let few = queue(BACKFILL, 3, 30, Some(20));
    assert_eq!(
        b.reserve_for(&r, NOW, "a", &[few], None, 100)
            .unwrap()
            .more
            .len(),
        2
    );
    assert!(!b.waiting.contains_key("a"));
    let g = Budget::default().reserve_for(&r, NOW, "a", &[many], None, 4);
    assert_eq!(g.unwrap().more.len(), 3);
    // A lockout grants nothing.
    let mut b = Budget {
        lock: Some(Box::new(Lockout::new(403, "GET /".into(), "b".into()))),
        ..Budget::default()
    };
    assert!(matches!(
        b.reserve_for(&r, NOW, "a", &[many], None, 100),
        Err(NoSlot::Locked(_))
    ));
}

#[test]
fn a_batch_stops_where_another_class_is_owed_or_more_urgent() {
    let mut r = rule(1000.0, 1);
    r.shares = std::sync::Arc::from(vec![0.0, 0.0, 0.2]);
    // b's backfill has a 20% share: it is owed the fifth slot, so a's batch of interactive
    // requests ends at four, and b's request goes next.
    let mut b = Budget::default();
    b.tell("b", &[queue(BACKFILL, 1, 1, None)]);
    let interactive = queue(INTERACTIVE, 100, 30, Some(20));
    let g = b
        .reserve_for(&r, NOW, "a", &[interactive], None, 100)
        .unwrap();
    assert_eq!((g.class, g.more.len()), (INTERACTIVE, 3));
    let after = queue(INTERACTIVE, 96, 20, None);
    assert_eq!(
        b.reserve_for(&r, NOW, "a", &[after], None, 100),
        Err(NoSlot::Yield)
    );
    let g = b
        .reserve_for(&r, NOW, "b", &[queue(BACKFILL, 1, 1, None)], None, 100)
        .unwrap();
    assert_eq!((g.class, g.more.len()), (BACKFILL, 0));
    // A more urgent class waiting anywhere takes the next slot: no batch of a less urgent
    // one starts.
    let mut b = Budget::default();
    b.tell("b", &[queue(INTERACTIVE, 1, 1, None)]);
    assert_eq!(
        b.reserve_for(
            &r,
            NOW,
            "a",
            &[queue(BACKFILL, 100, 30, Some(20))],
            None,
            100
        ),
        Err(NoSlot::Yield)
    );
}

#[test]
fn quota_windows_are_exact_at_their_edges() {
    let mut r = rule(10.0, 1);
    r.quota = vec![crate::destination::Quota {
        limit: 3,
        per: Duration::from_secs(10),
    }];
    let margin = r.quota_margin();
    let mut b = Budget::default();
    let slots: Vec<Duration> = (0..7)
        .map(|_| b.reserve(&r, Duration::ZERO, None).unwrap().0)
        .collect();
    let ms = |d: Duration| d.as_millis() as u64;
    let m = ms(margin);
    assert_eq!(
        slots.iter().map(|d| ms(*d)).collect::<Vec<_>>(),
        [
            0,
            100,
            200,
            10_000 + m,
            10_100 + m,
            10_200 + m,
            20_000 + 2 * m
        ]
    );
    // No window of 10 s holds more than 3, even with each slot reaching the upstream up to the margin late.
    for (i, s) in slots.iter().enumerate() {
        let late_first = *s + margin;
        let after = |start: Duration| {
            slots[i + 1..]
                .iter()
                .filter(|t| **t < start + Duration::from_secs(10))
                .count()
        };
        assert!(after(*s) < 3, "window from slot {i}");
        assert!(after(late_first) < 3, "window from slot {i}, used late");
    }
    // Two windows: the tighter one at each moment rules.
    r.quota.push(crate::destination::Quota {
        limit: 5,
        per: Duration::from_secs(60),
    });
    let mut b = Budget::default();
    let slots: Vec<u64> = (0..6)
        .map(|_| ms(b.reserve(&r, Duration::ZERO, None).unwrap().0))
        .collect();
    assert_eq!(slots[5], 60_000 + m);
    assert_eq!(b.sends.len(), 5, "keeps only the largest limit's worth");
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn beat_keeping_ignores_lateness() {
    let r = rule(10.0, 1);
    let mut b = Budget::default();
    assert_eq!(b.reserve(&r, ms(0), None).unwrap().0, ms(0));
    // Reserved late (the caller woke up 30 ms after its slot): the beat holds.
    assert_eq!(b.reserve(&r, ms(30), None).unwrap().0, ms(100));
    assert_eq!(b.reserve(&r, ms(140), None).unwrap().0, ms(200));
    // The n-th slot at full demand is start + n / rate.
    for n in 3..20 {
        assert_eq!(
            b.reserve(&r, ms(n * 100 - 50), None).unwrap().0,
            ms(n * 100)
        );
    }
}

#[test]
fn idle_restarts_from_now() {
    let r = rule(10.0, 1);
    let mut b = Budget::default();
    b.reserve(&r, ms(0), None).unwrap();
    assert_eq!(b.reserve(&r, ms(1000), None).unwrap().0, ms(1000));
    assert_eq!(b.reserve(&r, ms(1000), None).unwrap().0, ms(1100));
}

#[test]
fn burst_allows_that_many_at_once_then_spaces() {
    let r = rule(10.0, 3);
    let mut b = Budget::default();
    let slots: Vec<_> = (0..5)
        .map(|_| b.reserve(&r, ms(0), None).unwrap().0)
        .collect();
    assert_eq!(slots, [ms(0), ms(0), ms(0), ms(100), ms(200)]);
}

#[test]
fn pause_holds_every_slot() {
    let r = rule(10.0, 1);
    let mut b = Budget::default();
    b.apply(
        &r,
        &Event::Throttled {
            generation: 0,
            retry_after: Some(Pause::For(ms(5000))),
            reset: None,
            spread: 0.0,
        },
        ms(0),
        SystemTime::UNIX_EPOCH,
    );
    // Backoff is 2 now: 200 ms apart, from the end of the pause.
    assert_eq!(b.reserve(&r, ms(10), None).unwrap().0, ms(5000));
    assert_eq!(b.reserve(&r, ms(10), None).unwrap().0, ms(5200));
}

#[test]
fn pause_is_capped_by_retry_after_max() {
    let r = rule(10.0, 1);
    let mut b = Budget::default();
    b.apply(
        &r,
        &Event::Throttled {
            generation: 0,
            retry_after: Some(Pause::For(Duration::from_secs(86400))),
            reset: None,
            spread: 0.0,
        },
        ms(0),
        SystemTime::UNIX_EPOCH,
    );
    assert_eq!(b.paused_until, Duration::from_secs(60));
}

#[test]
fn too_late_takes_nothing() {
    let r = rule(1.0, 1);
    let mut b = Budget::default();
    b.reserve(&r, ms(0), None).unwrap();
    assert_eq!(
        b.reserve(&r, ms(0), Some(ms(500))),
        Err(NoSlot::TooLate { slot: ms(1000) })
    );
    assert_eq!(b.reserve(&r, ms(0), Some(ms(1000))).unwrap().0, ms(1000));
}

#[test]
fn one_widening_per_generation() {
    let r = rule(10.0, 1);
    let mut b = Budget::default();
    for _ in 0..10 {
        b.apply(
            &r,
            &Event::Throttled {
                generation: 0,
                retry_after: None,
                reset: None,
                spread: 0.0,
            },
            ms(0),
            SystemTime::UNIX_EPOCH,
        );
    }
    assert_eq!(b.backoff, 2.0);
    assert_eq!(b.generation, 1);
    b.apply(
        &r,
        &Event::Throttled {
            generation: 1,
            retry_after: None,
            reset: None,
            spread: 0.0,
        },
        ms(0),
        SystemTime::UNIX_EPOCH,
    );
    assert_eq!(b.backoff, 4.0);
    for g in 2..10 {
        b.apply(
            &r,
            &Event::Throttled {
                generation: g,
                retry_after: None,
                reset: None,
                spread: 0.0,
            },
            ms(0),
            SystemTime::UNIX_EPOCH,
        );
    }
    assert_eq!(b.backoff, 8.0, "capped at backoff_max");
}

/// Applies a clean response of generation 0.
fn clean(b: &mut Budget, r: &Rule) {
    b.apply(
        r,
        &Event::Clean {
            success: true,
            generation: 0,
        },
        ms(0),
        SystemTime::UNIX_EPOCH,
    );
}

#[test]
fn decay_after_a_clean_streak_never_below_one() {
    let r = rule(10.0, 1);
    let mut b = Budget {
        backoff: 4.0,
        ..Budget::default()
    };
    for _ in 0..2 {
        clean(&mut b, &r);
    }
    assert_eq!(b.backoff, 4.0);
    clean(&mut b, &r);
    assert_eq!(b.backoff, 2.0);
    assert_eq!(b.clean_streak, 0);
    b.apply(
        &r,
        &Event::Throttled {
            generation: 99,
            retry_after: None,
            reset: None,
            spread: 0.0,
        },
        ms(0),
        SystemTime::UNIX_EPOCH,
    );
    assert_eq!(
        b.clean_streak, 0,
        "a throttle resets the streak even when it does not widen"
    );
    for _ in 0..30 {
        clean(&mut b, &r);
    }
    assert_eq!(b.backoff, 1.0);
}

#[test]
fn lockout_halts_until_cleared() {
    let r = rule(10.0, 1);
    let mut b = Budget::default();
    let lock = Lockout::new(403, "GET /x".into(), "test".into());
    assert!(b.apply(
        &r,
        &Event::Lockout(lock.clone()),
        ms(0),
        SystemTime::UNIX_EPOCH
    ));
    assert_eq!(b.reserve(&r, ms(0), None), Err(NoSlot::Locked(lock)));
}

/// `n` slots reserved at [`NOW`] under `r` after the vendor said, at `NOW`, that
/// `remaining` are left until a reset `reset` away.
fn after_the_vendor_said(r: &Rule, remaining: u64, reset: Duration, n: usize) -> Vec<Duration> {
    let mut b = Budget::default();
    let seen = Observation {
        family: crate::signals::Family::XRateLimit,
        remaining,
        limit: Some(5000),
        reset: Pause::For(reset),
        spread: 0.0,
        unanswered: 0,
    };
    assert!(b.observe(r, &seen, NOW, SystemTime::UNIX_EPOCH));
    (0..n).map(|_| b.reserve(r, NOW, None).unwrap().0).collect()
}

#[test]
fn a_vendor_budget_with_plenty_left_is_spent_at_the_rate_or_spread_as_configured() {
    // GitHub's 5,000 an hour with 4,000 left and the reset an hour away, at rate 50.
    let hour = Duration::from_secs(3600);
    let burst = Rule {
        retry_after_max: hour,
        ..rule(50.0, 1)
    };
    let slots = after_the_vendor_said(&burst, 4000, hour, 40);
    assert_eq!(slots[39] - NOW, ms(780), "40 requests at 50 a second");
    let spread = Rule {
        vendor_pace: VendorPace::Spread,
        ..burst.clone()
    };
    let slots = after_the_vendor_said(&spread, 4000, hour, 40);
    assert_eq!(slots[39] - NOW, ms(36_000), "4,000 spread over the hour");
    // Five left, two kept: three go (at the rate, or spread over the 3 s), then the reset.
    for (pace, third) in [(VendorPace::Burst, ms(40)), (VendorPace::Spread, ms(3000))] {
        let r = Rule {
            reserve: 2,
            vendor_pace: pace,
            ..burst.clone()
        };
        let slots = after_the_vendor_said(&r, 5, Duration::from_secs(3), 4);
        assert_eq!(slots[2] - NOW, third, "{pace:?}");
        assert!(
            slots[3] - NOW >= Duration::from_secs(3),
            "{pace:?}: {slots:?}"
        );
    }
}

#[test]
fn requests_unanswered_when_the_vendor_said_count_as_taken_from_what_it_says() {
    let r = rule(50.0, 1);
    let said = |remaining, unanswered, reset| Observation {
        family: crate::signals::Family::XRateLimit,
        remaining,
        limit: Some(100),
        reset: Pause::For(Duration::from_secs(reset)),
        spread: 0.0,
        unanswered,
    };
    let mut b = Budget::default();
    // 5 left, 3 on their way that it may not count: 2 more go, then the reset.
    assert!(b.observe(&r, &said(5, 3, 10), NOW, SystemTime::UNIX_EPOCH));
    assert_eq!(b.vendor_at(NOW).unwrap().taken, 3);
    assert!(b.reserve(&r, NOW, None).unwrap().0 < NOW + ms(100));
    assert!(b.reserve(&r, NOW, None).unwrap().0 < NOW + ms(100));
    assert_eq!(
        b.reserve(&r, NOW, None).unwrap().0,
        NOW + Duration::from_secs(10)
    );
    // Within one window, the view that leaves less wins, what is unanswered counted.
    let mut b = Budget::default();
    assert!(b.observe(&r, &said(5, 0, 10), NOW, SystemTime::UNIX_EPOCH));
    assert!(!b.observe(&r, &said(6, 0, 10), NOW, SystemTime::UNIX_EPOCH));
    assert!(b.observe(&r, &said(6, 2, 10), NOW, SystemTime::UNIX_EPOCH));
    assert_eq!(b.vendor_at(NOW).unwrap().taken, 2);
    // All of what is left on its way: paused until the reset.
    let mut b = Budget::default();
    assert!(b.observe(&r, &said(4, 4, 10), NOW, SystemTime::UNIX_EPOCH));
    assert_eq!(b.paused_until, NOW + Duration::from_secs(10));
}
