//! Failover on paused time, against a fake shared store: a memory store that can be switched
//! off (every call then fails as a lost store would) or made to answer oddly.

use std::sync::atomic::AtomicU8;

use super::*;
use crate::budget::contract;

const UP: u8 = 0;
const DOWN: u8 = 1;
const ODD: u8 = 2;

/// A shared store that plays `live` instances, and fails on demand.
#[derive(Clone)]
struct Fake {
    inner: Arc<MemoryStore>,
    state: Arc<AtomicU8>,
    /// When each heartbeat was sent.
    beats: Arc<Mutex<Vec<Instant>>>,
    live: usize,
}

impl Fake {
    fn new(live: usize) -> Self {
        Self {
            inner: Arc::new(MemoryStore::ephemeral()),
            state: Arc::new(AtomicU8::new(UP)),
            beats: Arc::default(),
            live,
        }
    }

    fn set(&self, state: u8) {
        self.state.store(state, Ordering::SeqCst);
    }

    fn check(&self) -> Result<(), StoreError> {
        match self.state.load(Ordering::SeqCst) {
            DOWN => Err(StoreError::Unreachable("connection refused".into())),
            ODD => Err(StoreError::Refused("an odd answer".into())),
            _ => Ok(()),
        }
    }

    fn answer<'a, T: Send + 'a>(
        &'a self,
        call: StoreFuture<'a, Result<T, StoreError>>,
    ) -> StoreFuture<'a, Result<T, StoreError>> {
        Box::pin(async move {
            self.check()?;
            call.await
        })
    }
}

impl Store for Fake {
    fn kind(&self) -> &'static str {
        "fake"
    }

    fn reserve<'a>(
        &'a self,
        destination: &'a str,
        rule: &'a Rule,
        ask: Ask<'a>,
    ) -> StoreFuture<'a, Result<Grant, ReserveError>> {
        Box::pin(async move {
            self.check()?;
            self.inner.reserve(destination, rule, ask).await
        })
    }

    fn wait_list<'a>(
        &'a self,
        destination: &'a str,
        queues: &'a [ClassQueue],
    ) -> StoreFuture<'a, Result<(), StoreError>> {
        self.answer(self.inner.wait_list(destination, queues))
    }

    fn waiting<'a>(
        &'a self,
        destination: &'a str,
    ) -> StoreFuture<'a, Result<Vec<ClassWaiting>, StoreError>> {
        self.answer(self.inner.waiting(destination))
    }

    fn quota_used<'a>(
        &'a self,
        destination: &'a str,
        rule: &'a Rule,
    ) -> StoreFuture<'a, Result<Vec<u32>, StoreError>> {
        self.answer(self.inner.quota_used(destination, rule))
    }

    fn record<'a>(
        &'a self,
        destination: &'a str,
        rule: &'a Rule,
        event: Event,
        vendor: Option<Observation>,
    ) -> StoreFuture<'a, Result<BudgetView, StoreError>> {
        self.answer(self.inner.record(destination, rule, event, vendor))
    }

    fn unlock<'a>(
        &'a self,
        destination: &'a str,
    ) -> StoreFuture<'a, Result<Option<Lockout>, StoreError>> {
        self.answer(self.inner.unlock(destination))
    }

    fn view<'a>(&'a self, destination: &'a str) -> StoreFuture<'a, Result<BudgetView, StoreError>> {
        self.answer(self.inner.view(destination))
    }
}

impl Fleet for Fake {
    fn heartbeat<'a>(&'a self, _me: &'a Instance) -> StoreFuture<'a, Result<(), StoreError>> {
        self.beats.lock().push(Instant::now());
        Box::pin(std::future::ready(self.check()))
    }

    fn live_instances(
        &self,
        _within: Duration,
    ) -> StoreFuture<'_, Result<Vec<InstanceStatus>, StoreError>> {
        let live = (0..self.live)
            .map(|i| InstanceStatus {
                id: format!("fake-{i}"),
                host: "fake".into(),
                pid: 0,
                version: "0".into(),
                started: String::new(),
                last_seen_seconds_ago: 0.0,
            })
            .collect();
        Box::pin(std::future::ready(self.check().map(|()| live)))
    }

    fn forget<'a>(&'a self, _me: &'a Instance) -> StoreFuture<'a, Result<(), StoreError>> {
        Box::pin(std::future::ready(Ok(())))
    }
}

fn failover(fake: &Fake, mode: OnUnavailable) -> Arc<Failover<Fake>> {
    let gauge = |name: &str| IntGauge::new(name, "test").unwrap();
    Arc::new(Failover::new(
        fake.clone(),
        fake.clone(),
        Policy {
            on_unavailable: mode,
            instances_hint: 1,
            timeout: Duration::from_millis(100),
        },
        Gauges {
            degraded: gauge("degraded"),
            instances: gauge("instances"),
        },
    ))
}

/// Starts the supervisor; returns its stop token.
fn supervise(f: &Arc<Failover<Fake>>) -> CancellationToken {
    let stop = CancellationToken::new();
    tokio::spawn(f.clone().supervise(stop.clone()));
    stop
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[tokio::test(start_paused = true)]
async fn passes_the_store_contract_while_the_store_answers() {
    contract::run_all(
        || async { Arc::into_inner(failover(&Fake::new(1), OnUnavailable::Divide)).unwrap() },
        Duration::ZERO,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_lost_store_divides_the_rate_by_the_live_instances() {
    let fake = Fake::new(2);
    let f = failover(&fake, OnUnavailable::Divide);
    let stop = supervise(&f);
    tokio::time::sleep(ms(10)).await;
    assert_eq!(f.live.get(), 2, "the heartbeat counted the live instances");
    let rule = contract::rule(10.0);
    let shared = contract::take(&*f, "d", &rule, None).await.unwrap();
    fake.set(DOWN);
    let first = contract::take(&*f, "d", &rule, None).await.unwrap();
    assert!(f.is_degraded());
    assert_eq!(f.degraded_gauge.get(), 1);
    let second = contract::take(&*f, "d", &rule, None).await.unwrap();
    // Locally at rate / 2, continuing after the last shared slot: no burst.
    assert!(
        first.at >= shared.at + rule.interval * 2,
        "{first:?} after {shared:?}"
    );
    assert_eq!(second.at - first.at, rule.interval * 2);
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn an_odd_or_slow_answer_does_not_degrade() {
    let fake = Fake::new(1);
    let f = failover(&fake, OnUnavailable::Divide);
    let rule = contract::rule(10.0);
    fake.set(ODD);
    assert!(matches!(
        contract::take(&*f, "d", &rule, None).await,
        Err(ReserveError::Store(StoreError::Refused(_)))
    ));
    assert!(matches!(f.view("d").await, Err(StoreError::Refused(_))));
    assert!(
        !f.is_degraded(),
        "an odd answer is an error of that call alone"
    );
}

#[tokio::test(start_paused = true)]
async fn probes_back_off_while_the_store_is_away_and_recovery_writes_lockouts_back() {
    let fake = Fake::new(1);
    let f = failover(&fake, OnUnavailable::Divide);
    let rule = contract::rule(10.0);
    fake.set(DOWN);
    let stop = supervise(&f);
    tokio::time::sleep(ms(10)).await;
    assert!(f.is_degraded(), "an unanswered heartbeat degrades");
    // A lockout while degraded: kept locally, refused at once, and written back later.
    let lock = Lockout::new(403, "GET https://d/x".into(), "here".into());
    f.record("d", &rule, Event::Lockout(lock.clone()), None)
        .await
        .unwrap();
    assert!(matches!(
        contract::take(&*f, "d", &rule, None).await,
        Err(ReserveError::Locked(_))
    ));
    tokio::time::sleep(ms(6_000)).await;
    let beats = fake.beats.lock().clone();
    let gaps: Vec<u128> = beats
        .windows(2)
        .map(|w| (w[1] - w[0]).as_millis())
        .collect();
    assert_eq!(&gaps[..5], [250, 500, 1000, 2000, 2000], "{gaps:?}");
    assert_eq!(fake.inner.view("d").await.unwrap().lock, None);
    fake.set(UP);
    tokio::time::sleep(ms(2_100)).await;
    assert!(!f.is_degraded(), "back on the shared store");
    assert_eq!(f.degraded_gauge.get(), 0);
    let shared = fake.inner.view("d").await.unwrap();
    assert_eq!(shared.lock.map(|l| l.request), Some(lock.request));
    // Heartbeats are a second apart again.
    let n = fake.beats.lock().len();
    tokio::time::sleep(ms(2_000)).await;
    assert_eq!(fake.beats.lock().len(), n + 2);
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn refuse_mode_refuses_while_the_store_is_away() {
    let fake = Fake::new(1);
    let f = failover(&fake, OnUnavailable::Refuse);
    let rule = contract::rule(10.0);
    fake.set(DOWN);
    assert!(matches!(
        contract::take(&*f, "d", &rule, None).await,
        Err(ReserveError::Store(StoreError::Unavailable))
    ));
    assert!(f.is_degraded());
    assert!(
        f.unlock("d").await.is_err(),
        "unlock needs the shared store"
    );
}

#[tokio::test(start_paused = true)]
async fn what_a_reservation_learned_is_kept_when_the_store_is_lost() {
    let fake = Fake::new(1);
    let f = failover(&fake, OnUnavailable::Divide);
    let rule = contract::rule(10.0);
    // Another instance locks "a" and pauses "b" for 30 s; this one learns of both only
    // through reservations.
    let lock = Lockout::new(403, "GET https://a/x".into(), "elsewhere".into());
    fake.inner
        .record("a", &rule, Event::Lockout(lock), None)
        .await
        .unwrap();
    let pause = Event::Throttled {
        generation: 0,
        retry_after: Some(crate::budget::Pause::For(Duration::from_secs(30))),
        reset: None,
        spread: 0.0,
    };
    fake.inner.record("b", &rule, pause, None).await.unwrap();
    assert!(matches!(
        contract::take(&*f, "a", &rule, None).await,
        Err(ReserveError::Locked(_))
    ));
    let soon = Instant::now() + Duration::from_secs(1);
    assert!(matches!(
        contract::take(&*f, "b", &rule, Some(soon)).await,
        Err(ReserveError::TooLate { .. })
    ));
    fake.set(DOWN);
    assert!(
        matches!(
            contract::take(&*f, "a", &rule, None).await,
            Err(ReserveError::Locked(_))
        ),
        "the lockout is kept"
    );
    assert!(f.is_degraded());
    let slot = contract::take(&*f, "b", &rule, None).await.unwrap();
    assert!(
        slot.at >= Instant::now() + Duration::from_secs(29),
        "the pause is kept: {slot:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_quota_window_is_assumed_full_when_the_store_is_lost() {
    let fake = Fake::new(1);
    let f = failover(&fake, OnUnavailable::Divide);
    let rule = Rule {
        quota: vec![Quota {
            limit: 5,
            per: Duration::from_secs(10),
        }],
        ..contract::rule(100.0)
    };
    contract::take(&*f, "d", &rule, None).await.unwrap();
    fake.set(DOWN);
    let lost = Instant::now();
    let slot = contract::take(&*f, "d", &rule, None).await.unwrap();
    assert!(f.is_degraded());
    assert!(
        slot.at >= lost + Duration::from_secs(10),
        "pacing alone waits for the window it cannot see: {:?} after the loss",
        slot.at - lost
    );
}
