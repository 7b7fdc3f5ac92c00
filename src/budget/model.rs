//! One arithmetic, checked as one, over the store seam: random sequences of reservations,
//! verdicts, pauses, blocks, vendor views, lockouts, unlocks and clock advances go through
//! [`super::schedule`] (the model) and through a store, and both must end every step in the
//! same state: the same slots and outcomes, backoff, generation, streaks, pause and its cause,
//! vendor view and lock.
//!
//! A store takes part through [`Modelled`]: its seam, a clock the test sets (the instant and
//! the wall clock both), and its budget read back whole. Each store's test module implements
//! it and runs [`check_store`]; a new store is checked by the same cases.
//!
//! `PACEGATE_MODEL_CASES` sets the number of sequences (2,000 by default).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tokio::time::Instant;

use super::schedule::{Budget, NoSlot, Waiting};
use super::{Ask, ClassQueue, Event, Lockout, Observation, Pause, ReserveError, Rule, Store};
use crate::class::Class;
use crate::destination::{Block, Quota, VendorPace};
use crate::signals::Family;

/// The model's time 0, as a Unix time in µs; every sequence starts well after it, so that
/// the model's zero and the database's `-infinity` both mean "long ago".
pub(crate) const T0_US: i64 = 1_767_225_600_000_000; // 2026-01-01T00:00:00Z
pub(crate) const START: Duration = Duration::from_secs(1_000);

#[derive(Debug, Clone)]
enum Op {
    /// The clock moves on by this many µs.
    Advance(u64),
    /// A reservation; `busy` tells a wait list of `most + 1` (the general function), asking
    /// for a batch of up to `most` slots, else one request alone (the one-statement path).
    /// `limit`: whether to set a limit, and on which side of the model's slot (then it is 5
    /// to 50 ms off it).
    /// `cost`: the units each slot weighs (a meter's), in the beat and the quota windows.
    Reserve {
        busy: bool,
        limit: Option<(bool, u64)>,
        most: u32,
        cost: u32,
    },
    /// A meter's settlement: this many units more than reserved (fewer where negative).
    Settle(i64),
    /// A clean response, reserved under the current generation (`stale`: the one before).
    Clean {
        success: bool,
        stale: bool,
    },
    /// A throttle reserved under the current generation (`stale`: the one before), with a
    /// Retry-After in ms, and a spent vendor budget's reset in ms.
    Throttled {
        stale: bool,
        retry_after_ms: Option<u64>,
        reset_ms: Option<u64>,
        spread: f64,
    },
    /// A response with no verdict that says what the vendor's budget is: `remaining`, the
    /// reset in ms (`until`: as an instant, not a delta), the jitter's spread, and the
    /// requests still unanswered when it was said.
    Observe {
        remaining: u64,
        reset_ms: u64,
        until: bool,
        spread: f64,
        unanswered: u64,
    },
    Lockout,
    Unlock,
}

/// A spread drawn from a few values whose jittered lengths are exact on both sides.
fn spread() -> impl Strategy<Value = f64> {
    prop::sample::select(vec![-1.0, -0.5, 0.0, 0.25, 0.5, 1.0])
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..400_000).prop_map(Op::Advance),
        5 => (
            any::<bool>(),
            proptest::option::of((any::<bool>(), 5_000u64..50_000)),
            1u32..6,
            prop::sample::select(vec![1u32, 1, 2, 3]),
        )
            .prop_map(|(busy, limit, most, cost)| Op::Reserve {
                busy,
                limit,
                most,
                cost,
            }),
        1 => (-3i64..4).prop_map(Op::Settle),
        3 => (any::<bool>(), proptest::bool::weighted(0.2))
            .prop_map(|(success, stale)| Op::Clean { success, stale }),
        2 => (
            any::<bool>(),
            proptest::option::weighted(0.3, 0u64..5_000),
            proptest::option::weighted(0.2, 0u64..2_000),
            spread(),
        )
            .prop_map(|(stale, retry_after_ms, reset_ms, spread)| Op::Throttled {
                stale,
                retry_after_ms,
                reset_ms,
                spread,
            }),
        2 => (
            0u64..6,
            0u64..3_000,
            any::<bool>(),
            spread(),
            0u64..4,
        )
            .prop_map(|(remaining, reset_ms, until, spread, unanswered)| Op::Observe {
                remaining,
                reset_ms,
                until,
                spread: spread.abs(),
                unanswered,
            }),
        1 => Just(Op::Lockout),
        1 => Just(Op::Unlock),
    ]
}

/// A rule whose intervals at every backoff are whole µs, so that both sides compute exactly.
fn rule_strategy() -> impl Strategy<Value = Rule> {
    (
        prop::sample::select(vec![1.0, 2.0, 4.0, 5.0, 10.0, 20.0, 25.0, 50.0]),
        1u32..4,
        prop::sample::select(vec![2.0, 4.0]),
        prop::sample::select(vec![4.0, 8.0, 16.0]),
        1u32..5,
        proptest::option::weighted(0.3, (1u32..4, 200u64..2_000)),
        0u32..3,
        proptest::option::weighted(
            0.5,
            (
                100u64..1_000,
                1u64..8,
                prop::sample::select(vec![0.0, 0.2, 0.5]),
            ),
        ),
        prop::sample::select(vec![VendorPace::Burst, VendorPace::Spread]),
        // A meter's own window, which a slot may run over by its own units.
        proptest::option::weighted(0.3, (1u32..6, 200u64..2_000, 0u32..4)),
    )
        .prop_map(
            |(
                rate,
                burst,
                backoff_factor,
                backoff_max,
                decay_after,
                quota,
                reserve,
                block,
                vendor_pace,
                window,
            )| Rule {
                largest: window.map_or(0, |(_, _, largest)| largest),
                window: window.map(|(limit, per_ms, _)| Quota {
                    limit,
                    per: Duration::from_millis(per_ms),
                }),
                reserve,
                vendor_pace,
                block: block.map(|(min_ms, times, jitter)| Block {
                    min: Duration::from_millis(min_ms),
                    max: Duration::from_millis(min_ms * times),
                    jitter,
                }),
                interval: Duration::from_secs_f64(1.0 / rate),
                cost: 1,
                metered: false,
                burst,
                backoff_factor,
                backoff_max,
                decay_after,
                retry_after_max: Duration::from_secs(3),
                shares: Arc::from(vec![0.0]),
                quota: quota
                    .map(|(limit, per_ms)| {
                        vec![Quota {
                            limit,
                            per: Duration::from_millis(per_ms),
                        }]
                    })
                    .unwrap_or_default(),
            },
        )
}

/// The budget row as the model would write it: next slot and pause in µs since `T0_US`
/// (`None`: long ago), backoff, generation, streak, locked; then what paused it, the block
/// streak, and the vendor view while it lasts (remaining, taken, observed and reset in µs).
#[derive(Debug, PartialEq)]
pub(crate) struct Row {
    pub(crate) beat: (Option<i64>, Option<i64>, i64, i32, bool),
    pub(crate) backoff: f64,
    pub(crate) paused_by: Option<String>,
    pub(crate) block_streak: i32,
    pub(crate) vendor: Option<(i64, i64, i64, i64)>,
}

/// The row a budget of the model's timeline makes (times since [`T0_US`]'s instant, which the
/// model's zero is).
pub(crate) fn model_row(b: &Budget, now: Duration) -> Row {
    let us = |d: Duration| (d > Duration::ZERO).then_some(d.as_micros() as i64);
    Row {
        beat: (
            us(b.next_at),
            us(b.paused_until),
            b.generation as i64,
            b.clean_streak as i32,
            b.lock.is_some(),
        ),
        backoff: b.backoff,
        paused_by: b.paused_by.map(|c| c.as_str().to_owned()),
        block_streak: b.block_streak as i32,
        vendor: b.vendor_at(now).map(|v| {
            (
                v.remaining as i64,
                v.taken as i64,
                v.observed.as_micros() as i64,
                v.reset.as_micros() as i64,
            )
        }),
    }
}

/// A store under the model test.
#[async_trait::async_trait]
pub(crate) trait Modelled: Sync {
    /// The store, through its seam.
    fn store(&self) -> &dyn Store;

    /// Sets the store's clock to the model's `now`: its instant, and its wall clock to
    /// [`wall`]`(now)`. The local instant that corresponds is [`Instant::now`] afterwards.
    async fn set_now(&self, now: Duration);

    /// The budget of `destination` as the store keeps it, in the model's terms at its `now`;
    /// `None` for a destination never touched.
    async fn row(&self, destination: &str, now: Duration) -> Option<Row>;
}

/// The wall clock at the model's `now`.
pub(crate) fn wall(now: Duration) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_micros(T0_US as u64) + now
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), TestCaseError> {
    if ok {
        Ok(())
    } else {
        Err(TestCaseError::fail(what()))
    }
}

/// Runs one sequence on destination `d` through the model and the store; fails at the first difference.
async fn run(db: &dyn Modelled, d: &str, rule: &Rule, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut model = Budget::default();
    let mut now = START;
    let mut reserved = false;
    db.set_now(now).await;
    for (step, op) in ops.iter().enumerate() {
        let at = || format!("step {step} ({op:?}) of {ops:?} with {rule:?}");
        match op {
            Op::Advance(us) => {
                now += Duration::from_micros(*us);
                db.set_now(now).await;
            }
            // A settlement follows its request's slot: none before the first granted.
            Op::Settle(_) if !reserved => {}
            Op::Settle(units) => {
                model.settle(rule, *units, now);
                db.store().settle(d, rule, *units).await.unwrap();
            }
            Op::Reserve {
                busy,
                limit,
                most,
                cost,
            } => {
                // The model reserves by the weighted rule, as every store does with the cost.
                let weighted = rule.weighted(*cost);
                let (count, most) = if *busy { (*most + 1, *most) } else { (1, 1) };
                let list = [Waiting {
                    class: Class(0),
                    count,
                    since: now,
                    next_since: busy.then_some(now),
                }];
                // The limit is set well to one side of the slot the model would give, so
                // that the µs the real clock moves during the call cannot tip it.
                let not_after = limit.map(|(after, off_us)| {
                    let mut probe = model.clone();
                    let slot = probe
                        .reserve_for(&weighted, now, "model", &list, None, 1)
                        .map_or(now, |s| s.slot);
                    let off = Duration::from_micros(off_us);
                    if after {
                        slot + off
                    } else {
                        slot.saturating_sub(off).max(now)
                    }
                });
                let expected = model.reserve_for(&weighted, now, "model", &list, not_after, most);
                reserved |= expected.is_ok();
                let real_now = Instant::now();
                let queues = [ClassQueue {
                    class: Class(0),
                    count,
                    oldest: real_now,
                    next: busy.then_some(real_now),
                }];
                let ask = Ask {
                    queues: &queues,
                    not_after: not_after.map(|n| real_now + (n - now)),
                    most,
                    cost: *cost,
                };
                let got = db.store().reserve(d, rule, ask).await;
                // The store reads the limit as a time from its own now, after taking its
                // connection (and perhaps probing the clock): a slot of the model's short of
                // the limit by less than the time the call took may be tipped past it by the
                // real clock. A difference then says nothing, nor does the rest of the case.
                let took = real_now.elapsed();
                let tipped = match (&expected, not_after) {
                    (Ok(m), Some(limit)) => std::iter::once(m.slot)
                        .chain(m.more.iter().copied())
                        .any(|slot| slot <= limit && limit - slot <= took),
                    _ => false,
                };
                let same = match (&expected, &got) {
                    (Ok(model), Ok(grant)) => {
                        grant.slot.generation == model.generation
                            && grant.more.len() == model.more.len()
                    }
                    (Err(NoSlot::TooLate { .. }), Err(ReserveError::TooLate { .. }))
                    | (Err(NoSlot::Locked(_)), Err(ReserveError::Locked(_))) => true,
                    _ => false,
                };
                if !same && tipped {
                    return Ok(());
                }
                check(same, || {
                    let got = got.as_ref().map(|g| (g.slot.generation, g.more.len()));
                    format!("{}: {got:?} vs model {expected:?}", at())
                })?;
            }
            Op::Clean { .. } | Op::Throttled { .. } | Op::Lockout | Op::Observe { .. } => {
                let ms = |ms: u64| Pause::For(Duration::from_millis(ms));
                let (event, vendor) = match op {
                    Op::Clean { success, stale } => (
                        Event::Clean {
                            success: *success,
                            generation: if *stale {
                                model.generation.saturating_sub(1)
                            } else {
                                model.generation
                            },
                        },
                        None,
                    ),
                    Op::Throttled {
                        stale,
                        retry_after_ms,
                        reset_ms,
                        spread,
                    } => (
                        Event::Throttled {
                            generation: if *stale {
                                model.generation.saturating_sub(1)
                            } else {
                                model.generation
                            },
                            retry_after: retry_after_ms.map(ms),
                            reset: reset_ms.map(ms),
                            spread: *spread,
                        },
                        None,
                    ),
                    Op::Observe {
                        remaining,
                        reset_ms,
                        until,
                        spread,
                        unanswered,
                    } => {
                        let reset = if *until {
                            Pause::Until(wall(now) + Duration::from_millis(*reset_ms))
                        } else {
                            ms(*reset_ms)
                        };
                        let seen = Observation {
                            family: Family::Ietf,
                            remaining: *remaining,
                            limit: Some(5),
                            reset,
                            spread: *spread,
                            unanswered: *unanswered,
                        };
                        (Event::None, Some(seen))
                    }
                    _ => (
                        Event::Lockout(Lockout::new(403, "GET /".into(), "model".into())),
                        None,
                    ),
                };
                if let Some(seen) = &vendor {
                    model.observe(rule, seen, now, wall(now));
                }
                model.apply(rule, &event, now, wall(now));
                let view = db.store().record(d, rule, event, vendor).await.unwrap();
                check(
                    (view.backoff - model.backoff).abs() < 1e-9
                        && view.generation == model.generation
                        && view.clean_streak == model.clean_streak,
                    || format!("{}: {view:?} vs model {model:?}", at()),
                )?;
            }
            Op::Unlock => {
                let cleared = db.store().unlock(d).await.unwrap();
                check(cleared.is_some() == model.lock.is_some(), || {
                    format!("{}: cleared {cleared:?} vs model {:?}", at(), model.lock)
                })?;
                model.lock = None;
            }
        }
        // The whole budget, step by step. A destination never touched has no row yet.
        if let Some(row) = db.row(d, now).await {
            let expected = model_row(&model, now);
            check(
                row.beat == expected.beat
                    && (row.backoff - expected.backoff).abs() < 1e-9
                    && row.paused_by == expected.paused_by
                    && row.block_streak == expected.block_streak
                    && row.vendor == expected.vendor,
                || format!("{}: row {row:?} vs model {expected:?}", at()),
            )?;
        }
    }
    Ok(())
}

/// Runs [`PACEGATE_MODEL_CASES`](self) random sequences, each on a destination of its own,
/// through the model and the store `open` gives for it (`case` numbers them), on `rt`.
pub(crate) fn check_store<M, S>(rt: &tokio::runtime::Runtime, open: impl Fn(u64) -> (S, String))
where
    M: Modelled,
    S: std::ops::Deref<Target = M>,
{
    let cases = std::env::var("PACEGATE_MODEL_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2_000);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let n = std::cell::Cell::new(0u64);
    let strategy = (rule_strategy(), prop::collection::vec(op(), 1..16));
    let result = runner.run(&strategy, |(rule, ops)| {
        let case = n.get();
        n.set(case + 1);
        rt.block_on(async {
            // Opened on the runtime, so that a store on paused time starts on its clock.
            let (store, destination) = open(case);
            run(&*store, &destination, &rule, &ops).await
        })
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
