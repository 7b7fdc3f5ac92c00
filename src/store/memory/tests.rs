//! The memory store: the contract, and what survives a restart in its state file.

use super::*;
use crate::budget::contract;
use crate::budget::model::{self, Modelled, Row};
use crate::budget::PauseCause;
use tokio_util::sync::CancellationToken;

/// The memory store in the model test, on paused time: the test moves its instant clock, and
/// its wall clock follows.
struct OnPausedTime {
    store: MemoryStore,
    /// The model's now that the store's clock stands at.
    at: Mutex<Duration>,
}

impl OnPausedTime {
    /// A store whose clock stands at the model's start.
    fn open() -> Self {
        let mut store = MemoryStore::ephemeral().with_instance("model");
        store.wall = Wall::Follows {
            at_epoch: model::wall(model::START),
        };
        Self {
            store,
            at: Mutex::new(model::START),
        }
    }
}

#[async_trait::async_trait]
impl Modelled for OnPausedTime {
    fn store(&self) -> &dyn Store {
        &self.store
    }

    async fn set_now(&self, now: Duration) {
        let step = now - std::mem::replace(&mut *self.at.lock(), now);
        tokio::time::advance(step).await
    }

    async fn row(&self, destination: &str, now: Duration) -> Option<Row> {
        // The store's timeline runs `shift` ahead of the model's; "long ago" (zero) stays.
        let shift = self.store.now() - now;
        let back = |t: &mut Duration| *t = t.saturating_sub(shift);
        let row = self
            .store
            .budgets
            .lock()
            .get(destination)
            .cloned()
            .map(|mut b| {
                back(&mut b.next_at);
                back(&mut b.paused_until);
                if let Some(v) = &mut b.vendor {
                    back(&mut v.observed);
                    back(&mut v.reset);
                }
                model::model_row(&b, now)
            });
        row
    }
}

#[test]
fn computes_what_the_schedule_computes() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    model::check_store(&rt, |_| (Box::new(OnPausedTime::open()), "d".to_owned()));
}

#[tokio::test(start_paused = true)]
async fn passes_the_store_contract() {
    contract::run_all(|| async { MemoryStore::ephemeral() }, Duration::ZERO).await;
    contract::run_shared(|| async {
        let a = MemoryStore::ephemeral();
        let b = a.instance("b");
        (a, b)
    })
    .await;
}

#[tokio::test]
async fn quota_windows_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    let rule = Rule {
        quota: vec![crate::destination::Quota {
            limit: 2,
            per: Duration::from_secs(10),
        }],
        ..contract::rule(100.0)
    };
    let first = {
        let store = Arc::new(MemoryStore::open(&path).unwrap());
        let stop = CancellationToken::new();
        let keeper = tokio::spawn(store.clone().keep_state(stop.clone()));
        let first = contract::take(&*store, "q", &rule, None).await.unwrap();
        contract::take(&*store, "q", &rule, None).await.unwrap();
        stop.cancel();
        keeper.await.unwrap();
        first.at
    };
    // A new process: the window is still full until the first slot leaves it.
    let store = MemoryStore::open(&path).unwrap();
    let third = contract::take(&store, "q", &rule, None).await.unwrap();
    let expected = first + Duration::from_secs(10) + rule.quota_margin();
    let off = if third.at > expected {
        third.at - expected
    } else {
        expected - third.at
    };
    assert!(off < Duration::from_millis(50), "off by {off:?}");
}

#[tokio::test]
async fn a_meter_s_quota_windows_survive_a_restart_in_its_units() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    let rule = Rule {
        quota: vec![crate::destination::Quota {
            limit: 1000,
            per: Duration::from_secs(10),
        }],
        ..contract::rule(100_000.0)
    };
    let queues = [contract::waiting(crate::class::Class(0), 1, 0)];
    let ask = |cost| crate::budget::Ask {
        queues: &queues,
        not_after: None,
        most: 1,
        cost,
    };
    let first = {
        let store = Arc::new(MemoryStore::open(&path).unwrap());
        let stop = CancellationToken::new();
        let keeper = tokio::spawn(store.clone().keep_state(stop.clone()));
        let first = store.reserve("m", &rule, ask(600)).await.unwrap().slot.at;
        store.reserve("m", &rule, ask(300)).await.unwrap();
        stop.cancel();
        keeper.await.unwrap();
        first
    };
    // A new process: 900 of the window's 1,000 units are still in it, so a request of 200
    // waits for the first send (600) to leave; counted as two sends of a unit each, it
    // would go at once.
    let store = MemoryStore::open(&path).unwrap();
    let third = store.reserve("m", &rule, ask(200)).await.unwrap().slot.at;
    let expected = first + Duration::from_secs(10) + rule.quota_margin();
    let off = if third > expected {
        third - expected
    } else {
        expected - third
    };
    assert!(off < Duration::from_millis(50), "off by {off:?}");
}

#[tokio::test(start_paused = true)]
async fn the_state_file_is_private_and_written_through_a_name_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    // Someone else's file where a fixed temporary name would be: left alone, not followed.
    let planted = dir.path().join("state.json.tmp");
    std::fs::write(&planted, b"someone else's").unwrap();
    let store = MemoryStore::open(&path).unwrap();
    let lock = Lockout::new(403, "GET https://a/x".into(), "test".into());
    let rule = contract::rule(10.0);
    store
        .record("a", &rule, Event::Lockout(lock), None)
        .await
        .unwrap();
    #[cfg(unix)]
    for file in [path.clone(), dir.path().join("state.json.log")] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        assert_eq!(
            mode,
            0o600,
            "{} is readable by others: {mode:o}",
            file.display()
        );
    }
    assert_eq!(std::fs::read(&planted).unwrap(), b"someone else's");
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec!["state.json", "state.json.log", "state.json.tmp"],
        "no temporary file left"
    );
    assert!(MemoryStore::open(&path)
        .unwrap()
        .view("a")
        .await
        .unwrap()
        .lock
        .is_some());
}

#[tokio::test(start_paused = true)]
async fn lockout_and_backoff_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    let rule = contract::rule(10.0);
    {
        let store = MemoryStore::open(&path).unwrap();
        store
            .record(
                "a",
                &rule,
                Event::Throttled {
                    generation: 0,
                    retry_after: None,
                    reset: None,
                    spread: 0.0,
                },
                None,
            )
            .await
            .unwrap();
        let lock = Lockout::new(403, "GET https://a/x".into(), "test".into());
        store
            .record("b", &rule, Event::Lockout(lock), None)
            .await
            .unwrap();
    }
    let store = MemoryStore::open(&path).unwrap();
    assert_eq!(store.view("a").await.unwrap().backoff, 2.0);
    let lock = store.view("b").await.unwrap().lock.expect("still locked");
    assert_eq!(
        (lock.status, lock.request.as_str()),
        (403, "GET https://a/x")
    );
    assert!(matches!(
        contract::take(&store, "b", &rule, None).await,
        Err(ReserveError::Locked(_))
    ));
    store.unlock("b").await.unwrap();
    let store = MemoryStore::open(&path).unwrap();
    assert!(
        contract::take(&store, "b", &rule, None).await.is_ok(),
        "the unlock was persisted too"
    );
}

#[tokio::test]
async fn a_block_its_streak_and_the_vendor_view_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    let rule = Rule {
        block: Some(crate::destination::Block {
            min: Duration::from_secs(30),
            max: Duration::from_secs(60),
            jitter: 0.0,
        }),
        ..contract::rule(10.0)
    };
    {
        let store = MemoryStore::open(&path).unwrap();
        let throttle = Event::Throttled {
            generation: 0,
            retry_after: None,
            reset: None,
            spread: 0.0,
        };
        let seen = Observation {
            family: crate::signals::Family::XRateLimit,
            remaining: 7,
            limit: Some(60),
            reset: crate::budget::Pause::For(Duration::from_secs(40)),
            spread: 0.0,
            unanswered: 0,
        };
        store
            .record("a", &rule, throttle, Some(seen))
            .await
            .unwrap();
    }
    let view = MemoryStore::open(&path).unwrap().view("a").await.unwrap();
    assert_eq!(view.block_streak, 1);
    assert_eq!(view.paused_by, Some(PauseCause::Block));
    assert!(view.paused_for > Duration::from_secs(29), "{view:?}");
    let vendor = view.vendor.expect("the vendor's window has not reset");
    assert_eq!((vendor.remaining, vendor.limit), (7, Some(60)));
    assert!(vendor.reset_in > Duration::from_secs(39), "{vendor:?}");
}

#[test]
fn a_corrupt_state_file_is_refused_with_advice() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    std::fs::write(&path, "{not json").unwrap();
    let err = MemoryStore::open(&path).err().unwrap();
    assert!(err.to_string().contains("move it aside"), "{err}");
}

/// A vendor's observation with `remaining` left.
fn vendor_saw(remaining: u64) -> Observation {
    Observation {
        family: crate::signals::Family::XRateLimit,
        remaining,
        limit: Some(5000),
        reset: crate::budget::Pause::For(Duration::from_secs(3600)),
        spread: 0.0,
        unanswered: 0,
    }
}

#[tokio::test]
async fn a_lockout_is_kept_before_its_answer_and_a_vendor_s_count_within_a_second() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    let rule = contract::rule(10.0);
    let store = Arc::new(MemoryStore::open(&path).unwrap());
    let stop = CancellationToken::new();
    let keeper = tokio::spawn(store.clone().keep_state(stop.clone()));
    let lock = Lockout::new(403, "GET https://a/x".into(), "test".into());
    store
        .record("a", &rule, Event::Lockout(lock), None)
        .await
        .unwrap();
    store
        .record(
            "b",
            &rule,
            Event::Clean {
                success: true,
                generation: 0,
            },
            Some(vendor_saw(4999)),
        )
        .await
        .unwrap();
    // As a `kill -9` would find it now: the lockout is there, the count not yet.
    let now = MemoryStore::open_read_only(&path);
    assert!(now.view("a").await.unwrap().lock.is_some());
    assert!(now.view("b").await.unwrap().vendor.is_none());
    // Within a second, the count too.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let later = MemoryStore::open_read_only(&path);
    let vendor = later
        .view("b")
        .await
        .unwrap()
        .vendor
        .expect("the count was kept");
    assert_eq!(vendor.remaining, 4999);
    stop.cancel();
    keeper.await.unwrap();
}

#[tokio::test]
async fn a_write_is_one_budget_s_line_however_many_budgets_there_are() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    let journal = dir.path().join("state.json.log");
    let rule = contract::rule(10.0);
    let store = Arc::new(MemoryStore::open(&path).unwrap());
    for i in 0..20_000 {
        store
            .record(
                &format!("k#{i:05}"),
                &rule,
                Event::Clean {
                    success: true,
                    generation: 0,
                },
                Some(vendor_saw(100)),
            )
            .await
            .unwrap();
    }
    // Written out by the keeper's next round, then folded into a snapshot.
    store.save_marked().await.unwrap();
    store.save_marked().await.unwrap();
    let size = |p: &std::path::Path| std::fs::metadata(p).unwrap().len();
    let before = size(&journal);
    let lock = Lockout::new(403, "GET https://a/x".into(), "test".into());
    store
        .record("k#00007", &rule, Event::Lockout(lock), None)
        .await
        .unwrap();
    let grew = size(&journal) - before;
    assert!(grew > 0 && grew < 1024, "a lockout wrote {grew} bytes");
    assert!(size(&path) > 1_000_000, "the snapshot holds every budget");
    let reopened = MemoryStore::open_read_only(&path);
    assert!(reopened.view("k#00007").await.unwrap().lock.is_some());
    assert_eq!(
        reopened
            .view("k#19999")
            .await
            .unwrap()
            .vendor
            .unwrap()
            .remaining,
        100
    );
}

#[tokio::test]
async fn a_torn_last_line_is_skipped_and_lines_a_snapshot_holds_are_not_read_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    let journal = dir.path().join("state.json.log");
    let rule = contract::rule(10.0);
    let lock = Lockout::new(403, "GET https://a/x".into(), "test".into());
    let locked_line;
    {
        let store = MemoryStore::open(&path).unwrap();
        store
            .record("a", &rule, Event::Lockout(lock), None)
            .await
            .unwrap();
        locked_line = std::fs::read_to_string(&journal).unwrap();
        store.unlock("a").await.unwrap();
        let lock = Lockout::new(403, "GET https://b/x".into(), "test".into());
        store
            .record("b", &rule, Event::Lockout(lock), None)
            .await
            .unwrap();
    }
    // A crash tore the last line being written.
    let mut torn = std::fs::OpenOptions::new()
        .append(true)
        .open(&journal)
        .unwrap();
    std::io::Write::write_all(&mut torn, b"{\"seq\":99,\"budget\":\"c\",\"sta").unwrap();
    drop(torn);
    let store = MemoryStore::open(&path).unwrap();
    assert!(
        store.view("a").await.unwrap().lock.is_none(),
        "the unlock holds"
    );
    assert!(store.view("b").await.unwrap().lock.is_some());
    drop(store);
    // A crash after a compaction's snapshot, before its new journal: the old journal's
    // lines are older than the snapshot and must not be read over it (the unlock of `a`
    // would be undone by its lockout's line).
    std::fs::write(&journal, locked_line).unwrap();
    let store = MemoryStore::open(&path).unwrap();
    assert!(
        store.view("a").await.unwrap().lock.is_none(),
        "the unlock still holds"
    );
    assert!(store.view("b").await.unwrap().lock.is_some());
}
