//! One arithmetic, checked as one: random sequences of reservations, verdicts, pauses,
//! blocks, vendor views, lockouts, unlocks and clock advances go through `budget::schedule`
//! (the model) and through the postgres store's SQL, and both must end every step in the same
//! state: the same slots and outcomes, backoff, generation, streaks, pause and its cause,
//! vendor view and lock.
//!
//! The database's clock is replaced for the test: the store's connection puts a schema of the
//! test's own first on its `search_path`, whose `clock_timestamp()` reads the instant the test
//! set. The SQL under test is the production SQL, unchanged.
//!
//! `PACEGATE_MODEL_CASES` sets the number of sequences (2,000 by default).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use super::*;
use crate::budget::schedule::{Budget, NoSlot, Waiting};
use crate::budget::{Observation, Pause};
use crate::destination::{Block, Quota};
use crate::signals::Family;

/// The model's time 0, as a Unix time in µs; every sequence starts well after it, so that
/// the model's zero and the database's `-infinity` both mean "long ago".
const T0_US: i64 = 1_767_225_600_000_000; // 2026-01-01T00:00:00Z
const START: Duration = Duration::from_secs(1_000);

#[derive(Debug, Clone)]
enum Op {
    /// The clock moves on by this many µs.
    Advance(u64),
    /// A reservation; `busy` tells a wait list of `most + 1` (the general function), asking
    /// for a batch of up to `most` slots, else one request alone (the one-statement path).
    /// `limit`: whether to set a limit, and on which side of the model's slot (then it is 5
    /// to 50 ms off it).
    Reserve {
        busy: bool,
        limit: Option<(bool, u64)>,
        most: u32,
    },
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
    /// reset in ms (`until`: as an instant, not a delta), and the jitter's spread.
    Observe {
        remaining: u64,
        reset_ms: u64,
        until: bool,
        spread: f64,
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
        )
            .prop_map(|(busy, limit, most)| Op::Reserve { busy, limit, most }),
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
        2 => (0u64..6, 0u64..3_000, any::<bool>(), spread())
            .prop_map(|(remaining, reset_ms, until, spread)| Op::Observe {
                remaining,
                reset_ms,
                until,
                spread: spread.abs(),
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
    )
        .prop_map(
            |(rate, burst, backoff_factor, backoff_max, decay_after, quota, reserve, block)| Rule {
                reserve,
                block: block.map(|(min_ms, times, jitter)| Block {
                    min: Duration::from_millis(min_ms),
                    max: Duration::from_millis(min_ms * times),
                    jitter,
                }),
                interval: Duration::from_secs_f64(1.0 / rate),
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
struct Row {
    beat: (Option<i64>, Option<i64>, i64, i32, bool),
    backoff: f64,
    paused_by: Option<String>,
    block_streak: i32,
    vendor: Option<(i64, i64, i64, i64)>,
}

fn model_row(b: &Budget, now: Duration) -> Row {
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

const SQL_ROW: &str = "SELECT
        CASE WHEN isfinite(next_at) THEN (extract(epoch FROM next_at) * 1000000)::bigint - $2 END,
        CASE WHEN isfinite(paused_until) THEN (extract(epoch FROM paused_until) * 1000000)::bigint - $2 END,
        backoff, generation, clean_streak, lock_status IS NOT NULL, paused_by, block_streak,
        vendor_remaining, vendor_taken,
        (extract(epoch FROM vendor_observed) * 1000000)::bigint - $2,
        (extract(epoch FROM vendor_reset) * 1000000)::bigint - $2,
        vendor_reset > (SELECT t FROM fakeclock.now_t)
    FROM pacegate_budgets WHERE destination = $1";

/// The test's own database: the schema migrated, and a clock the test sets.
struct Db {
    store: PostgresStore,
    control: tokio_postgres::Client,
}

impl Db {
    async fn open() -> Self {
        let url = testdb::fresh().await;
        PostgresStore::new(&url, 1)
            .unwrap()
            .migrate()
            .await
            .unwrap();
        let (control, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        control
            .batch_execute(
                "CREATE SCHEMA fakeclock;
                 CREATE TABLE fakeclock.now_t (t timestamptz NOT NULL);
                 INSERT INTO fakeclock.now_t VALUES (now());
                 CREATE FUNCTION fakeclock.clock_timestamp() RETURNS timestamptz
                     LANGUAGE sql VOLATILE AS 'SELECT t FROM fakeclock.now_t';",
            )
            .await
            .unwrap();
        let clocked = format!("{url}?options=-c%20search_path%3Dfakeclock%2Cpublic%2Cpg_catalog");
        let store = PostgresStore::new(&clocked, 1)
            .unwrap()
            .with_instance("model");
        Self { store, control }
    }

    async fn set_now(&self, now: Duration) {
        let us = T0_US + now.as_micros() as i64;
        self.control
            .execute(
                "UPDATE fakeclock.now_t SET t = to_timestamp($1::float8 / 1000000)",
                &[&(us as f64)],
            )
            .await
            .unwrap();
        // to_timestamp goes through float8: check that it landed on the µs.
        let back: i64 = self
            .control
            .query_one(
                "SELECT (extract(epoch FROM t) * 1000000)::bigint FROM fakeclock.now_t",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(back, us, "the fake clock is exact");
    }

    async fn row(&self, destination: &str) -> Option<Row> {
        self.control
            .query_opt(SQL_ROW, &[&destination, &T0_US])
            .await
            .unwrap()
            .map(|r| Row {
                beat: (r.get(0), r.get(1), r.get(3), r.get(4), r.get(5)),
                backoff: r.get(2),
                paused_by: r.get(6),
                block_streak: r.get(7),
                vendor: r
                    .get::<_, Option<bool>>(12)
                    .unwrap_or(false)
                    .then(|| (r.get(8), r.get(9), r.get(10), r.get(11))),
            })
    }
}

/// The database's wall clock at the model's `now`.
fn wall(now: Duration) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_micros(T0_US as u64) + now
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), TestCaseError> {
    if ok {
        Ok(())
    } else {
        Err(TestCaseError::fail(what()))
    }
}

/// Runs one sequence on destination `d` through both; fails at the first difference.
async fn run(db: &Db, d: &str, rule: &Rule, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut model = Budget::default();
    let mut now = START;
    db.set_now(now).await;
    for (step, op) in ops.iter().enumerate() {
        let at = || format!("step {step} ({op:?}) of {ops:?} with {rule:?}");
        match op {
            Op::Advance(us) => {
                now += Duration::from_micros(*us);
                db.set_now(now).await;
            }
            Op::Reserve { busy, limit, most } => {
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
                        .reserve_for(rule, now, "model", &list, None, 1)
                        .map_or(now, |s| s.slot);
                    let off = Duration::from_micros(off_us);
                    if after {
                        slot + off
                    } else {
                        slot.saturating_sub(off).max(now)
                    }
                });
                let expected = model.reserve_for(rule, now, "model", &list, not_after, most);
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
                };
                let got = db.store.reserve(d, rule, ask).await;
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
                let view = db.store.record(d, rule, event, vendor).await.unwrap();
                check(
                    (view.backoff - model.backoff).abs() < 1e-9
                        && view.generation == model.generation
                        && view.clean_streak == model.clean_streak,
                    || format!("{}: {view:?} vs model {model:?}", at()),
                )?;
            }
            Op::Unlock => {
                let cleared = db.store.unlock(d).await.unwrap();
                check(cleared.is_some() == model.lock.is_some(), || {
                    format!("{}: cleared {cleared:?} vs model {:?}", at(), model.lock)
                })?;
                model.lock = None;
            }
        }
        // The whole budget, step by step. A destination never touched has no row yet.
        if let Some(row) = db.row(d).await {
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

#[test]
fn the_sql_computes_what_the_schedule_computes() {
    let cases = std::env::var("PACEGATE_MODEL_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let db = rt.block_on(Db::open());
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let n = std::sync::atomic::AtomicU64::new(0);
    let strategy = (rule_strategy(), prop::collection::vec(op(), 1..16));
    let result = runner.run(&strategy, |(rule, ops)| {
        let d = format!("d{}", n.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        rt.block_on(run(&db, &d, &rule, &ops))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
