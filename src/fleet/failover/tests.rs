//! Failover on paused time, against a fake shared store: a memory store that can be switched
//! off (every call then fails as a lost store would) or made to answer oddly.

use std::sync::atomic::AtomicU8;

use super::*;
use crate::budget::contract;
use crate::fleet::{Peer, Report, Theirs, Written, STALE_AFTER};
use crate::store::memory::MemoryStore;

const UP: u8 = 0;
const DOWN: u8 = 1;
const ODD: u8 = 2;
/// Heartbeats are refused (an odd answer); every other call is answered.
const DEAF: u8 = 3;

/// Another instance the fake store plays: it heartbeats with every heartbeat of this one,
/// until it is silenced.
struct FakePeer {
    last_seen: Instant,
    silent: bool,
    report: Report,
}

/// A shared store that plays `live` instances, and fails on demand.
#[derive(Clone)]
struct Fake {
    inner: Arc<MemoryStore>,
    /// What the answers taught, as a shared store keeps it.
    known: Arc<Known>,
    state: Arc<AtomicU8>,
    /// When each heartbeat was sent.
    beats: Arc<Mutex<Vec<Instant>>>,
    /// What this instance reported with each heartbeat.
    reports: Arc<Mutex<Vec<Report>>>,
    /// When each call was refused as by a lost store: the probes, while it is away.
    refused: Arc<Mutex<Vec<Instant>>>,
    peers: Arc<Mutex<Vec<FakePeer>>>,
    /// Other instances' rules that differ, as the store would answer them.
    theirs: Arc<Mutex<Vec<Theirs>>>,
    /// Instances that heartbeat through clones of this store: each one's last heartbeat and
    /// report, answered to the others as peers.
    table: Arc<Mutex<HashMap<String, (Instant, Report)>>>,
    live: usize,
}

impl Fake {
    fn new(live: usize) -> Self {
        let peers = (1..live)
            .map(|_| FakePeer {
                last_seen: Instant::now(),
                silent: false,
                report: Report {
                    divisor: u32::try_from(live).unwrap(),
                    alone_for: Duration::from_secs(60),
                },
            })
            .collect();
        Self {
            inner: Arc::new(MemoryStore::ephemeral()),
            known: Arc::default(),
            state: Arc::new(AtomicU8::new(UP)),
            beats: Arc::default(),
            reports: Arc::default(),
            refused: Arc::default(),
            peers: Arc::new(Mutex::new(peers)),
            theirs: Arc::default(),
            table: Arc::default(),
            live,
        }
    }

    /// Peer `i` stops heartbeating (it lost the store, or was killed).
    fn silence(&self, i: usize) {
        self.peers.lock()[i].silent = true;
    }

    /// Peer `i` heartbeats again.
    fn revive(&self, i: usize) {
        self.peers.lock()[i].silent = false;
    }

    fn set(&self, state: u8) {
        self.state.store(state, Ordering::SeqCst);
    }

    fn check(&self) -> Result<(), StoreError> {
        match self.state.load(Ordering::SeqCst) {
            DOWN => {
                self.refused.lock().push(Instant::now());
                Err(StoreError::Unreachable("connection refused".into()))
            }
            ODD => Err(StoreError::Refused("an odd answer".into())),
            _ => Ok(()),
        }
    }

    async fn answer<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.check()?;
        call.await
    }
}

#[async_trait::async_trait]
impl Store for Fake {
    fn kind(&self) -> &'static str {
        "fake"
    }

    fn known(&self) -> Option<&Known> {
        Some(&self.known)
    }

    async fn reserve(
        &self,
        destination: &str,
        rule: &Rule,
        ask: Ask<'_>,
    ) -> Result<Grant, ReserveError> {
        self.check()?;
        let answer = self.inner.reserve(destination, rule, ask).await;
        self.known.reserved(destination, rule, &answer);
        answer
    }

    async fn wait_list(&self, destination: &str, queues: &[ClassQueue]) -> Result<(), StoreError> {
        self.answer(self.inner.wait_list(destination, queues)).await
    }

    async fn settle(&self, budget: &str, rule: &Rule, units: i64) -> Result<(), StoreError> {
        self.answer(self.inner.settle(budget, rule, units)).await
    }

    async fn give_back(
        &self,
        budget: &str,
        rule: &Rule,
        slot: &Reservation,
        sent: Option<u64>,
        reserved: u32,
        units: u32,
    ) -> Result<(), StoreError> {
        self.answer(
            self.inner
                .give_back(budget, rule, slot, sent, reserved, units),
        )
        .await
    }

    async fn key_secret(&self) -> Result<Vec<u8>, StoreError> {
        self.answer(self.inner.key_secret()).await
    }

    async fn forget_keys(&self, parent: &str, idle: Duration) -> Result<u64, StoreError> {
        self.answer(self.inner.forget_keys(parent, idle)).await
    }

    async fn record(
        &self,
        destination: &str,
        rule: &Rule,
        event: Event,
        vendor: Option<Observation>,
    ) -> Result<BudgetView, StoreError> {
        let view = self
            .answer(self.inner.record(destination, rule, event, vendor))
            .await?;
        self.known.learned(destination, &view, Instant::now());
        Ok(view)
    }

    async fn unlock(&self, destination: &str) -> Result<Option<Lockout>, StoreError> {
        let cleared = self.answer(self.inner.unlock(destination)).await?;
        self.known.unlocked(destination);
        Ok(cleared)
    }

    async fn continue_after(&self, marks: &[(String, Instant)]) -> Result<(), StoreError> {
        self.answer(self.inner.continue_after(marks)).await?;
        self.known.continued(marks);
        Ok(())
    }

    async fn view(&self, destination: &str) -> Result<BudgetView, StoreError> {
        let asked = Instant::now();
        let view = self.answer(self.inner.view(destination)).await?;
        self.known.learned(destination, &view, asked);
        Ok(view)
    }

    async fn snapshot(&self, destinations: &[(&str, &Rule)]) -> Result<Vec<Snapshot>, StoreError> {
        let asked = Instant::now();
        let snapshots = self.answer(self.inner.snapshot(destinations)).await?;
        for ((destination, _), s) in destinations.iter().zip(&snapshots) {
            self.known.learned(destination, &s.view, asked);
        }
        Ok(snapshots)
    }

    fn forget_budget(&self, budget: &str) {
        self.inner.forget_budget(budget);
        self.known.forget(budget);
    }
}

impl Membership for Fake {
    async fn heartbeat(&self, me: &Instance, report: Report) -> Result<Vec<Peer>, StoreError> {
        let now = Instant::now();
        self.beats.lock().push(now);
        self.reports.lock().push(report);
        let refused = match self.state.load(Ordering::SeqCst) {
            DEAF => Err(StoreError::Refused("an odd answer".into())),
            _ => self.check(),
        };
        let answer = refused.map(|()| {
            let mut table = self.table.lock();
            table.insert(me.id.clone(), (now, report));
            let sharing = table
                .iter()
                .filter(|(id, _)| **id != me.id)
                .map(|(id, (last_seen, report))| Peer {
                    id: id.clone(),
                    instances: 1,
                    age: now - *last_seen,
                    report: *report,
                    lease: (*last_seen + report.lease()).saturating_duration_since(now),
                })
                .collect::<Vec<_>>();
            let mut peers = self.peers.lock();
            peers
                .iter_mut()
                .enumerate()
                .map(|(i, p)| {
                    if !p.silent {
                        p.last_seen = now;
                    }
                    Peer {
                        id: format!("fake-{i}"),
                        instances: 1,
                        age: now - p.last_seen,
                        report: p.report,
                        lease: (p.last_seen + p.report.lease()).saturating_duration_since(now),
                    }
                })
                .chain(sharing)
                .collect()
        });
        answer
    }

    async fn live_instances(&self, _within: Duration) -> Result<Vec<InstanceStatus>, StoreError> {
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
        self.check().map(|()| live)
    }

    async fn forget(&self, _me: &Instance) -> Result<(), StoreError> {
        Ok(())
    }

    async fn compare_rules(
        &self,
        _me: &Instance,
        _mine: &[Written],
        _write: bool,
    ) -> Result<Vec<Theirs>, StoreError> {
        let theirs = self.theirs.lock().clone();
        self.check().map(|()| theirs)
    }
}

fn failover(fake: &Fake, mode: OnUnavailable) -> Arc<Failover<Fake, Fake, MemoryStore>> {
    Arc::new(Failover::new(
        fake.clone(),
        fake.clone(),
        MemoryStore::ephemeral(),
        Instance::new(),
        Policy {
            on_unavailable: mode,
            instances_hint: 1,
            divide_for: Duration::from_secs(30),
            timeout: Duration::from_millis(100),
            hold_back: true,
        },
        Gauges::unregistered(),
    ))
}

/// Starts the supervisor; returns its stop token.
fn supervise(f: &Arc<Failover<Fake, Fake, MemoryStore>>) -> CancellationToken {
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

/// Takes a slot, asking again whenever told to ask later.
async fn take_patiently(
    f: &Failover<Fake, Fake, MemoryStore>,
    destination: &str,
    rule: &Rule,
    not_after: Option<Instant>,
) -> Result<crate::budget::Reservation, ReserveError> {
    loop {
        match contract::take(f, destination, rule, not_after).await {
            Err(ReserveError::Yield(after)) => tokio::time::sleep(after).await,
            other => return other,
        }
    }
}

/// The gap between two slots taken in a row on the shared schedule.
async fn gap(f: &Failover<Fake, Fake, MemoryStore>, rule: &Rule) -> Duration {
    let a = take_patiently(f, "d", rule, None).await.unwrap();
    let b = take_patiently(f, "d", rule, None).await.unwrap();
    b.at - a.at
}

#[tokio::test(start_paused = true)]
async fn a_lost_store_is_paced_alone_at_the_reported_share_after_a_wait_and_for_a_while() {
    let fake = Fake::new(2);
    let f = failover(&fake, OnUnavailable::Divide);
    let stop = supervise(&f);
    tokio::time::sleep(ms(10)).await;
    assert_eq!(
        f.standing.live(),
        2,
        "the heartbeat counted the live instances"
    );
    let divisors: Vec<u32> = fake.reports.lock().iter().map(|r| r.divisor).collect();
    assert_eq!(divisors, [1, 2], "a new count is told at once");
    let rule = contract::rule(10.0);
    let shared = contract::take(&*f, "d", &rule, None).await.unwrap();
    let last_answer = *fake.beats.lock().last().unwrap();
    fake.set(DOWN);
    assert!(
        matches!(
            contract::take(&*f, "d", &rule, None).await,
            Err(ReserveError::Yield(_))
        ),
        "nothing is sent at once"
    );
    assert!(f.is_degraded());
    assert_eq!(f.degraded_gauge.get(), 1);
    let first = take_patiently(&f, "d", &rule, None).await.unwrap();
    let second = take_patiently(&f, "d", &rule, None).await.unwrap();
    // Alone at about rate / 2, from ALONE_AFTER after the last answered heartbeat, and after
    // the last shared slot: no burst.
    assert!(first.at >= last_answer + ALONE_AFTER, "{first:?}");
    assert!(first.at < last_answer + ALONE_AFTER + ms(300), "{first:?}");
    assert!(first.at >= shared.at + rule.interval * 2);
    // Half the rate, less a request a second: the slack its own schedule may add.
    assert_eq!(
        second.at - first.at,
        Duration::from_secs_f64(1.0 / (5.0 - 1.0))
    );
    // For divide_for (30 s here) after the wait, then refused.
    tokio::time::sleep_until(last_answer + ALONE_AFTER + Duration::from_secs(30)).await;
    let over = contract::take(&*f, "d", &rule, None).await;
    assert!(
        matches!(over, Err(ReserveError::Store(StoreError::LongGone(_)))),
        "{over:?}"
    );
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_stale_instance_s_share_is_held_back_while_it_may_pace_alone() {
    let fake = Fake::new(3);
    let f = failover(&fake, OnUnavailable::Divide);
    let stop = supervise(&f);
    let rule = contract::rule(10.0);
    tokio::time::sleep(ms(10)).await;
    assert_eq!(
        gap(&f, &rule).await,
        rule.interval,
        "the whole rate, shared"
    );
    fake.silence(0);
    tokio::time::sleep(STALE_AFTER + ms(1_000)).await;
    // The stale one reported 1/3: the shared schedule runs at the 2/3 left, no less (its
    // own schedule gives up its slack).
    assert_eq!(
        gap(&f, &rule).await,
        Duration::from_secs_f64(1.0 / (10.0 * 2.0 / 3.0))
    );
    assert!((f.standing.share_held() - 1.0 / 3.0).abs() < 1e-9);
    assert_eq!(
        fake.reports.lock().last().unwrap().divisor,
        3,
        "still counted: it may be pacing alone"
    );
    // Back: the whole rate again at the next heartbeat.
    fake.revive(0);
    tokio::time::sleep(ms(1_100)).await;
    assert_eq!(gap(&f, &rule).await, rule.interval);
    assert_eq!(f.standing.share_held(), 0.0);
    // Gone for good: held back until its lease runs out (ALONE_AFTER + 60 s after its last
    // heartbeat), then no longer counted.
    fake.silence(0);
    let silenced = Instant::now();
    tokio::time::sleep(ALONE_AFTER + Duration::from_secs(58)).await;
    assert!(f.standing.share_held() > 0.0);
    tokio::time::sleep(ms(3_000)).await;
    assert_eq!(
        gap(&f, &rule).await,
        rule.interval,
        "{:?}",
        silenced.elapsed()
    );
    tokio::time::sleep(ms(1_100)).await;
    assert_eq!(fake.reports.lock().last().unwrap().divisor, 2);
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn an_instance_that_would_take_the_whole_rate_leaves_none_to_pace_alone_on() {
    // The other instance has not counted this one yet: alone, it would take all of it.
    let fake = Fake::new(2);
    fake.peers.lock()[0].report.divisor = 1;
    let f = failover(&fake, OnUnavailable::Divide);
    let stop = supervise(&f);
    tokio::time::sleep(ms(10)).await;
    assert_eq!(f.standing.divisor(), 2);
    fake.set(DOWN);
    let alone = take_patiently(&f, "d", &contract::rule(10.0), None).await;
    assert!(
        matches!(&alone, Err(ReserveError::Store(StoreError::Unreachable(why))) if why.contains("shares")),
        "{alone:?}"
    );
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn the_stricter_rule_governs_while_another_instance_s_rule_differs() {
    let fake = Fake::new(2);
    let f = failover(&fake, OnUnavailable::Divide);
    let rule = contract::rule(10.0);
    f.announce(&[("d".to_owned(), rule.clone())]);
    let slower = Written::of("d", &contract::rule(5.0));
    *fake.theirs.lock() = vec![Theirs {
        destination: "d".into(),
        instance: "fake-0".into(),
        fingerprint: slower.fingerprint,
        rule: slower.rule,
    }];
    let stop = supervise(&f);
    tokio::time::sleep(ms(10)).await;
    assert_eq!(f.drift("d"), ["fake-0"]);
    assert_eq!(f.agreement.gauge.with_label_values(&["d"]).get(), 1);
    assert_eq!(
        gap(&f, &rule).await,
        ms(200),
        "the other's slower rate governs"
    );
    // The configs agree again.
    fake.theirs.lock().clear();
    tokio::time::sleep(ms(1_100)).await;
    assert!(f.drift("d").is_empty());
    assert_eq!(f.agreement.gauge.with_label_values(&["d"]).get(), 0);
    assert_eq!(gap(&f, &rule).await, rule.interval);
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn without_a_fresh_view_of_the_fleet_nothing_is_reserved() {
    let fake = Fake::new(2);
    let f = failover(&fake, OnUnavailable::Divide);
    let stop = supervise(&f);
    let rule = contract::rule(10.0);
    tokio::time::sleep(ms(10)).await;
    contract::take(&*f, "d", &rule, None).await.unwrap();
    fake.set(DEAF);
    tokio::time::sleep(crate::fleet::VIEW_FRESH + ms(1_000)).await;
    assert!(
        matches!(
            contract::take(&*f, "d", &rule, None).await,
            Err(ReserveError::Yield(_))
        ),
        "a refused heartbeat leaves the view stale"
    );
    assert!(!f.is_degraded(), "refused is not lost");
    fake.set(UP);
    tokio::time::sleep(ms(1_100)).await;
    contract::take(&*f, "d", &rule, None).await.unwrap();
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn an_instance_that_never_reached_the_store_does_not_pace_alone() {
    let fake = Fake::new(1);
    fake.set(DOWN);
    let f = failover(&fake, OnUnavailable::Divide);
    let stop = supervise(&f);
    tokio::time::sleep(ALONE_AFTER * 2).await;
    assert!(matches!(
        contract::take(&*f, "d", &contract::rule(10.0), None).await,
        Err(ReserveError::Store(StoreError::Unreachable(_)))
    ));
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
    // The heartbeat that found the store gone, then the probes (the return's write-back).
    let probes = fake.refused.lock().clone();
    let gaps: Vec<u128> = probes
        .windows(2)
        .map(|w| (w[1] - w[0]).as_millis())
        .collect();
    assert_eq!(&gaps[..5], [250, 500, 1000, 1000, 1000], "{gaps:?}");
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
    let stop = supervise(&f);
    let rule = contract::rule(10.0);
    tokio::time::sleep(ms(10)).await;
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
    let paused = Instant::now();
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
    let slot = take_patiently(&f, "b", &rule, None).await.unwrap();
    assert!(
        slot.at >= paused + Duration::from_secs(30),
        "the pause is kept: {slot:?}"
    );
    stop.cancel();
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
    let stop = supervise(&f);
    tokio::time::sleep(ms(10)).await;
    contract::take(&*f, "d", &rule, None).await.unwrap();
    fake.set(DOWN);
    let lost = Instant::now();
    let slot = take_patiently(&f, "d", &rule, None).await.unwrap();
    assert!(f.is_degraded());
    assert!(
        slot.at >= lost + Duration::from_secs(10),
        "pacing alone waits for the window it cannot see: {:?} after the loss",
        slot.at - lost
    );
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_lockout_whose_write_fails_halts_here_at_once_and_is_written_within_a_heartbeat() {
    let fake = Fake::new(1);
    let f = failover(&fake, OnUnavailable::Divide);
    let rule = contract::rule(10.0);
    f.announce(&[("d".to_owned(), rule.clone())]);
    // The store answers, but not this write (its row held elsewhere past the bound, say).
    fake.set(ODD);
    let lock = Lockout::new(403, "GET https://d/x".into(), "here".into());
    let view = f
        .record("d", &rule, Event::Lockout(lock.clone()), None)
        .await
        .expect("the lockout stands here");
    assert!(view.lock.is_some());
    fake.set(UP);
    assert!(!f.is_degraded(), "an odd answer is no lost store");
    assert_eq!(
        fake.inner.view("d").await.unwrap().lock,
        None,
        "not written yet"
    );
    assert!(
        matches!(
            contract::take(&*f, "d", &rule, None).await,
            Err(ReserveError::Locked(_))
        ),
        "halted here although the shared store does not know it yet"
    );
    let stop = supervise(&f);
    tokio::time::sleep(HEARTBEAT + ms(100)).await;
    let shared = fake.inner.view("d").await.unwrap();
    assert_eq!(
        shared.lock.map(|l| l.request),
        Some(lock.request),
        "written by a heartbeat"
    );
    assert!(f.pending.lock().is_empty());
    // An unlock clears it for good: no heartbeat writes it again.
    f.unlock("d").await.unwrap();
    tokio::time::sleep(HEARTBEAT * 2).await;
    assert_eq!(fake.inner.view("d").await.unwrap().lock, None);
    assert!(contract::take(&*f, "d", &rule, None).await.is_ok());
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn an_unlock_elsewhere_is_known_within_a_heartbeat_and_outlives_the_store() {
    let fake = Fake::new(1);
    let f = failover(&fake, OnUnavailable::Divide);
    let rule = contract::rule(10.0);
    f.announce(&[("d".to_owned(), rule.clone())]);
    // Another instance locks the destination; this one meets the lockout.
    let lock = Lockout::new(403, "GET https://d/x".into(), "elsewhere".into());
    fake.inner
        .record("d", &rule, Event::Lockout(lock), None)
        .await
        .unwrap();
    assert!(matches!(
        contract::take(&*f, "d", &rule, None).await,
        Err(ReserveError::Locked(_))
    ));
    let stop = supervise(&f);
    // Cleared elsewhere; the store goes a heartbeat and a bit later.
    fake.inner.unlock("d").await.unwrap();
    tokio::time::sleep(HEARTBEAT + ms(100)).await;
    fake.set(DOWN);
    // Paced alone, from the truth: not locked.
    let alone = tokio::time::timeout(
        Duration::from_secs(20),
        take_patiently(&f, "d", &rule, None),
    )
    .await
    .expect("a slot while pacing alone");
    assert!(alone.is_ok(), "{alone:?}");
    assert!(f.is_degraded());
    stop.cancel();
}

/// The busiest 1 s window of `at` (sorted).
fn busiest(at: &[Instant]) -> usize {
    at.iter()
        .enumerate()
        .map(|(i, t)| at[i..].iter().take_while(|u| **u < *t + ms(1_000)).count())
        .max()
        .unwrap_or(0)
}

#[tokio::test(start_paused = true)]
async fn three_instances_back_at_the_same_instant_put_their_slots_alone_first_and_keep_the_ceiling()
{
    // Three instances on one shared store, their heartbeats in step: they lose the store at
    // the same instant, pace alone, and find it back at the same instant, four times, with
    // ten requests each always waiting (three times the rate).
    let fake = Fake::new(1);
    let rule = contract::rule(10.0);
    let fleet: Vec<_> = (0..3)
        .map(|_| failover(&fake, OnUnavailable::Divide))
        .collect();
    let stops: Vec<_> = fleet.iter().map(supervise).collect();
    tokio::time::sleep(ms(2_000)).await;
    assert!(fleet.iter().all(|f| f.standing.divisor() == 3));
    let sent: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let mut load = Vec::new();
    for f in &fleet {
        for _ in 0..10 {
            let (f, rule, sent) = (f.clone(), rule.clone(), sent.clone());
            load.push(tokio::spawn(async move {
                loop {
                    // As a request that may wait half a second for its slot.
                    let deadline = Some(Instant::now() + ms(500));
                    match take_patiently(&f, "d", &rule, deadline).await {
                        Ok(slot) => {
                            tokio::time::sleep_until(slot.at).await;
                            sent.lock().push(slot.at);
                        }
                        Err(_) => tokio::time::sleep(ms(100)).await,
                    }
                }
            }));
        }
    }
    let mut returns = Vec::new();
    for _ in 0..4 {
        tokio::time::sleep(ms(3_300)).await;
        fake.set(DOWN);
        // Long enough to pace alone for a few seconds.
        tokio::time::sleep(ms(9_000)).await;
        fake.set(UP);
        returns.push(Instant::now());
        tokio::time::sleep(ms(1_500)).await;
        assert!(
            fleet.iter().all(|f| !f.is_degraded()),
            "back on the shared store"
        );
    }
    tokio::time::sleep(ms(5_000)).await;
    for task in &load {
        task.abort();
    }
    let mut sent = sent.lock().clone();
    sent.sort();
    let alone = returns.iter().map(|r| {
        sent.iter()
            .filter(|t| **t > *r - ms(3_000) && **t < *r)
            .count()
    });
    assert!(
        alone.clone().all(|n| n >= 10),
        "the instances paced alone before each return: {:?}",
        alone.collect::<Vec<_>>()
    );
    for (i, back) in returns.iter().enumerate() {
        let around: Vec<Instant> = sent
            .iter()
            .copied()
            .filter(|t| *t + ms(3_000) > *back && *t < *back + ms(5_000))
            .collect();
        let most = busiest(&around);
        let offsets: Vec<u128> = around
            .iter()
            .map(|t| (*t + ms(3_000) - *back).as_millis())
            .collect();
        assert!(
            most <= 11,
            "return {i}: {most} slots within one second around it (ms from 3 s before): {offsets:?}"
        );
    }
    assert!(
        busiest(&sent) <= 11,
        "the whole run: {} within one second",
        busiest(&sent)
    );
    // The rate comes back: in the 4 s after the last return's first 1.5 s, at least 90% of it.
    let last = returns[3];
    let after = sent
        .iter()
        .filter(|t| **t >= last + ms(1_500) && **t < last + ms(5_500))
        .count();
    assert!(after >= 36, "{after} in the 4 s after the last return");
    for stop in stops {
        stop.cancel();
    }
}
