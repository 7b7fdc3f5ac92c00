//! A shared store with a way down: what happens while it is unreachable.
//!
//! Never fail open. A reservation waits at most `timeout` for the store; a slow answer only
//! delays that slot, since pacing locally beside instances that still reach the store could
//! exceed the ceiling. Other calls get a heartbeat's time. Only a lost store (a connection
//! error, or a heartbeat unanswered, see [`super::heartbeat`]) marks it *degraded* (one ERROR
//! log, `pacegate_store_degraded` = 1); an odd answer or a slow one is an error of that call
//! alone. Until the store answers again:
//! - `divide`: this instance paces alone by its [`Standing`]: nothing for [`ALONE_AFTER`]
//!   after its last answered heartbeat, then on a local budget at the share it reported
//!   (`rate / n`, `n` the instances it counted, less a request a second) until the lease its
//!   last answered heartbeat stamped in the store runs out (`divide_for` after that wait),
//!   then it refuses.
//!   The instances that still reach the store hold that share back meanwhile, so the
//!   aggregate ceiling holds through a full outage and a partial one alike. The local budget
//!   starts from the last known shared one: lockouts, pauses and the last slot taken, with
//!   quota windows taken to be full.
//! - `refuse`: reservations fail with "pacing store unavailable".
//!
//! While the store answers, reservations on the shared schedule use the share of each rate
//! that instances which may be pacing alone leave ([`Standing::shared`]).
//!
//! Lockouts taken meanwhile are kept and written to the store when it returns, so none is
//! lost. A lockout whose write fails while the store answers (its row held elsewhere, say)
//! halts the destination here at once and is written again each heartbeat until it is in.
//!
//! Once a heartbeat, the budgets' shared state (lockouts, unlocks, pauses) is read back for
//! every destination, so that an instance that then loses the store paces from what every
//! instance last knew, not from what it happened to see itself.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus::{Gauge, IntGauge, IntGaugeVec};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::drift::Agreement;
use super::heartbeat::{self, Health};
use super::standing::{Alone, Split, Standing, StandingGauges};
use super::{Fleet, Instance, Membership, ALONE_AFTER, HEARTBEAT, LIVE_WITHIN};
use crate::budget::{
    Ask, BudgetView, ClassQueue, Event, Grant, Known, Lockout, Observation, Reservation,
    ReserveError, Rule, Snapshot, Store, StoreError,
};
use crate::config::OnUnavailable;
use crate::destination::Quota;
use crate::status::InstanceStatus;

/// How soon a reservation that may not be made yet (no fresh view of the fleet, or waiting
/// before pacing alone) is asked again.
const RECHECK: Duration = Duration::from_millis(250);

/// How a [`Failover`] behaves, from `[store]`.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Divide or refuse while the store is away.
    pub on_unavailable: OnUnavailable,
    /// Live instances to assume before a heartbeat has counted them.
    pub instances_hint: usize,
    /// The longest this instance paces alone once the store is lost.
    pub divide_for: Duration,
    /// Longest wait for a reservation's answer.
    pub timeout: Duration,
    /// Whether the shared schedule holds back the part of instances that may be pacing
    /// alone: always, but where a test of the binary turns it off
    /// ([`Standing::without_hold_back`], debug builds only) to show the ceiling breaks.
    pub hold_back: bool,
}

/// The gauges a [`Failover`] keeps.
pub struct Gauges {
    /// `pacegate_store_degraded`.
    pub degraded: IntGauge,
    /// `pacegate_store_instances`.
    pub instances: IntGauge,
    /// `pacegate_store_share_held`.
    pub held: Gauge,
    /// `pacegate_store_share_alone`.
    pub alone: Gauge,
    /// `pacegate_config_mismatch{destination}`.
    pub mismatch: IntGaugeVec,
}

#[cfg(test)]
impl Gauges {
    /// Gauges of no registry, for a test that reads none of them.
    pub(crate) fn unregistered() -> Self {
        let gauge = |name: &str| IntGauge::new(name, "test").unwrap();
        Self {
            degraded: gauge("degraded"),
            instances: gauge("instances"),
            held: Gauge::new("held", "test").unwrap(),
            alone: Gauge::new("alone", "test").unwrap(),
            mismatch: IntGaugeVec::new(prometheus::Opts::new("mismatch", "test"), &["destination"])
                .unwrap(),
        }
    }
}

/// The store a [`Failover`] paces on while the shared one is lost: this instance's budgets
/// alone (the memory store is one), started from the last shared ones.
pub trait Fallback: Store {
    /// Starts `destination`'s budget from `view` (backoff, pause, lockout, streaks), its
    /// schedule continuing after `next_at`.
    fn seed(&self, destination: &str, view: &BudgetView, next_at: Option<Instant>);

    /// Takes `destination`'s quota windows to be full now, with `units` sent in each (a
    /// request budget's slots, a meter's units).
    fn fill_windows(&self, destination: &str, units: u32);
}

/// A shared store, degrading per [`OnUnavailable`] while it is unreachable.
pub struct Failover<B, M, L> {
    primary: B,
    /// Where this instance heartbeats: a connection of its own, so that heartbeats and
    /// probes are never starved by reservations holding every pooled connection.
    control: M,
    local: L,
    /// This instance.
    me: Instance,
    policy: Policy,
    degraded: AtomicBool,
    standing: Standing,
    /// Lockouts not yet in the shared store (taken while degraded, or whose write failed), to
    /// be written back; each halts its destination here meanwhile.
    pending: Mutex<Vec<(String, Rule, Lockout)>>,
    degraded_gauge: IntGauge,
    /// Where each destination's schedule continues after the slots this instance handed out
    /// alone: put into the shared store before it paces there again ([`Failover::recover`]).
    alone_ends: Mutex<HashMap<String, Instant>>,
    /// Held shared by every slot handed out alone, and whole while the store's return is put
    /// in: no slot alone is handed out that the return does not put back.
    alone_gate: tokio::sync::RwLock<()>,
    /// This instance's rules beside the other instances'.
    agreement: Agreement,
}

impl<B: Store, M: Membership, L: Fallback> Failover<B, M, L> {
    /// Wraps `primary` for `me`; `control` carries the heartbeats, and `local` (empty)
    /// paces while `primary` is lost.
    pub fn new(
        primary: B,
        control: M,
        local: L,
        me: Instance,
        policy: Policy,
        gauges: Gauges,
    ) -> Self {
        let standing = Standing::new(
            policy.instances_hint,
            policy.divide_for,
            StandingGauges {
                instances: gauges.instances,
                held: gauges.held,
                alone: gauges.alone,
            },
        );
        Self {
            primary,
            control,
            local,
            me,
            standing: if policy.hold_back {
                standing
            } else {
                standing.without_hold_back()
            },
            policy,
            degraded: AtomicBool::new(false),
            pending: Mutex::new(Vec::new()),
            degraded_gauge: gauges.degraded,
            alone_ends: Mutex::new(HashMap::new()),
            alone_gate: tokio::sync::RwLock::new(()),
            agreement: Agreement::new(gauges.mismatch),
        }
    }

    /// The shared store, for a test that plays a failover of its server under this one.
    #[cfg(test)]
    pub(crate) fn primary(&self) -> &B {
        &self.primary
    }

    /// Whether the store is degraded now.
    pub fn is_degraded(&self) -> bool {
        self.degraded.load(Ordering::SeqCst)
    }

    /// Heartbeats this instance until `stop` (see [`heartbeat::supervise`]).
    pub async fn supervise(self: Arc<Self>, stop: CancellationToken) {
        heartbeat::supervise(&self.control, &self.me, &self.standing, &*self, stop).await;
        let _ = tokio::time::timeout(HEARTBEAT, self.primary.forget_waiting()).await;
    }

    /// Calls other than reservations (verdicts, views, unlocks, write-backs) are off the
    /// hot path of pacing: they get a heartbeat's time.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let bound = self.policy.timeout.max(HEARTBEAT);
        tokio::time::timeout(bound, call)
            .await
            .unwrap_or(Err(StoreError::Timeout(bound)))
    }

    /// The shared store's answer (within [`Failover::bounded`]), unless the store is, or now
    /// turns out to be, lost: then `local`'s.
    async fn shared_or_local<T, F, LF>(
        &self,
        shared: impl Future<Output = Result<T, StoreError>>,
        local: F,
    ) -> Result<T, StoreError>
    where
        F: FnOnce() -> LF,
        LF: Future<Output = Result<T, StoreError>>,
    {
        if !self.is_degraded() {
            match self.bounded(shared).await {
                Err(e) if e.is_lost() => self.degrade(&e),
                answer => return answer,
            }
        }
        local().await
    }

    fn degrade(&self, why: &StoreError) {
        if self.degraded.swap(true, Ordering::SeqCst) {
            return;
        }
        self.agreement.unwritten();
        let n = self.standing.divisor();
        self.seed_local(n);
        self.degraded_gauge.set(1);
        match self.policy.on_unavailable {
            OnUnavailable::Divide => tracing::error!(
                "pacing store unavailable ({why}); pacing alone at no more than rate / {n} (the instances last counted) less a request a second, from {} after the last heartbeat until its lease in the store runs out ({} after it), then refusing until it returns",
                humantime::format_duration(ALONE_AFTER),
                humantime::format_duration(ALONE_AFTER + self.policy.divide_for),
            ),
            OnUnavailable::Refuse => {
                tracing::error!("pacing store unavailable ({why}); refusing paced requests until it returns (on_unavailable = refuse)")
            }
        }
    }

    /// Starts the local budgets from what this instance knew of the shared ones (the
    /// primary's [`Known`]): a lockout must not be forgotten, and the local schedule continues
    /// after the last slot taken, without a burst. Pacing alone, slots are spaced at least
    /// `n` intervals apart, so the schedule continues `n` intervals after the last one.
    fn seed_local(&self, n: u32) {
        let mut unwritten: HashMap<String, Lockout> = self
            .pending
            .lock()
            .iter()
            .map(|(dest, _, lock)| (dest.clone(), lock.clone()))
            .collect();
        let marks = self.primary.known().map(Known::marks).unwrap_or_default();
        for (dest, mark) in marks {
            let mut view = mark.view_now().unwrap_or_default();
            if let Some(lock) = unwritten.remove(&dest) {
                view.lock = Some(lock);
            }
            let next = mark
                .last
                .map(|(at, interval)| at + interval * n)
                .max(mark.next);
            self.local.seed(&dest, &view, next);
            // How full the shared quota windows are cannot be known from here: assume them
            // full at the moment of loss, so that pacing alone cannot overfill one.
            if mark.window > 0 {
                self.local.fill_windows(&dest, mark.window);
            }
        }
        for (dest, lock) in unwritten {
            let view = BudgetView {
                lock: Some(lock),
                ..BudgetView::default()
            };
            self.local.seed(&dest, &view, None);
        }
    }

    /// The store answers again: the lockouts taken meanwhile are written, and the slots
    /// handed out alone are put into the shared schedules (`Store::continue_after`), so that
    /// the shared beat starts after them, before this instance takes a shared slot or tells
    /// the others it is back (the supervisor heartbeats after this). Each instance puts back
    /// its own, in one statement that only tightens, so the order and timing in which
    /// instances come back make no difference. `Err` leaves the instance degraded.
    async fn recover(&self) -> Result<(), StoreError> {
        let written = self.write_back().await?;
        let _alone = self.alone_gate.write().await;
        let now = Instant::now();
        let marks: Vec<(String, Instant)> = self
            .alone_ends
            .lock()
            .iter()
            .filter(|(_, at)| **at > now)
            .map(|(d, at)| (d.clone(), *at))
            .collect();
        self.bounded(self.primary.continue_after(&marks)).await?;
        self.alone_ends.lock().clear();
        if self.degraded.swap(false, Ordering::SeqCst) {
            self.degraded_gauge.set(0);
            // A recovery is no alarm: WARN, so that an alert on errors does not page on it.
            tracing::warn!(
                lockouts_written = written,
                schedules_continued = marks.len(),
                "pacing store is back; the slots handed out alone come first, then the shared schedule"
            );
        }
        Ok(())
    }

    /// Writes the lockouts not yet in the shared store; how many it wrote. Those left keep
    /// their place for the next try.
    async fn write_back(&self) -> Result<usize, StoreError> {
        let pending: Vec<_> = std::mem::take(&mut *self.pending.lock());
        for (i, (dest, rule, lock)) in pending.iter().enumerate() {
            let event = Event::Lockout(lock.clone());
            match self
                .bounded(self.primary.record(dest, rule, event, None))
                .await
            {
                Ok(_) => {}
                Err(e) => {
                    self.pending.lock().extend(pending[i..].iter().cloned());
                    return Err(e);
                }
            }
        }
        Ok(pending.len())
    }

    /// The lockout of `destination` not yet in the shared store, if any.
    fn unwritten_lock(&self, destination: &str) -> Option<Lockout> {
        self.pending
            .lock()
            .iter()
            .find(|(dest, _, _)| dest == destination)
            .map(|(_, _, lock)| lock.clone())
    }

    /// Reads back every destination's shared state (lockouts, unlocks, pauses) as the store
    /// holds it now, for pacing alone should the store go.
    async fn refresh_known(&self) -> Result<(), StoreError> {
        let announced = self.agreement.announced();
        if announced.is_empty() {
            return Ok(());
        }
        let asked: Vec<(&str, &Rule)> = announced.iter().map(|(d, r)| (d.as_str(), r)).collect();
        // The answer feeds what this instance knows (the primary's `Known`).
        self.bounded(self.primary.snapshot(&asked)).await?;
        Ok(())
    }

    /// `rule` at `part` of its rate, for pacing alone; `None` when nothing is left of it.
    /// Quota windows are shared out too: the local store has not seen the shared window's
    /// history (and takes it to be full at the loss), so this bounds this instance's own
    /// sends, not the window as a whole.
    fn alone_rule(rule: &Rule, part: Split) -> Option<Rule> {
        let share = |q: &Quota| Quota {
            limit: ((f64::from(q.limit) * part.share).floor() as u32).max(1),
            per: q.per,
        };
        Some(Rule {
            interval: part.interval(rule.interval)?,
            quota: rule.quota.iter().map(share).collect(),
            window: rule.window.as_ref().map(share),
            ..rule.clone()
        })
    }

    /// A reservation on the shared schedule, at the share of the rate that instances which
    /// may be pacing alone leave.
    async fn shared(
        &self,
        destination: &str,
        rule: &Rule,
        ask: Ask<'_>,
    ) -> Result<Grant, ReserveError> {
        let Some(held) = self.standing.shared(Instant::now()) else {
            // The heartbeats have not been answered lately: an instance may have gone stale
            // unseen, so nothing is sent until a fresh view says whose share to hold back.
            return Err(ReserveError::Yield(RECHECK));
        };
        // Instances that may be pacing alone take all of it.
        let Some(interval) = held.interval(rule.interval) else {
            return Err(ReserveError::Yield(RECHECK));
        };
        let scaled;
        let rule = if interval == rule.interval {
            rule
        } else {
            scaled = Rule {
                interval,
                ..rule.clone()
            };
            &scaled
        };
        let timeout = self.policy.timeout;
        match tokio::time::timeout(timeout, self.primary.reserve(destination, rule, ask)).await {
            Ok(answer) => answer,
            // Slow is not gone: pacing locally beside instances that still reach the store
            // could exceed the ceiling, so a slow answer only delays this slot.
            Err(_) => Err(ReserveError::Busy(timeout)),
        }
    }

    /// A slot handed out alone, on `alone` (`rule` at this instance's part of it), none
    /// after `until`: remembered for the store's return, where the shared schedule continues
    /// one interval of `rule` after it.
    async fn alone(
        &self,
        destination: &str,
        rule: &Rule,
        alone: &Rule,
        ask: Ask<'_>,
        until: Instant,
    ) -> Result<Grant, ReserveError> {
        let _alone = self.alone_gate.read().await;
        if !self.is_degraded() {
            // The store came back meanwhile: ask again, on the shared schedule.
            return Err(ReserveError::Yield(Duration::ZERO));
        }
        let capped = ask.not_after.is_none_or(|t| t > until);
        let ask = Ask {
            queues: ask.queues,
            not_after: Some(ask.not_after.map_or(until, |t| t.min(until))),
            ..ask
        };
        match self.local.reserve(destination, alone, ask).await {
            Ok(grant) => {
                let last = grant.more.last().copied().unwrap_or(grant.slot.at);
                let end = last + rule.weighted(ask.cost).interval;
                let mut ends = self.alone_ends.lock();
                let at = ends.entry(destination.to_owned()).or_insert(end);
                *at = (*at).max(end);
                Ok(grant)
            }
            Err(ReserveError::TooLate { .. }) if capped => {
                Err(ReserveError::Store(StoreError::Unreachable(
                    "this instance's time to pace alone ends before the next slot; it refuses until the store is back".into(),
                )))
            }
            Err(e) => Err(e),
        }
    }
}

impl<B: Store, M: Membership, L: Fallback> Health for Failover<B, M, L> {
    fn lost(&self, why: &StoreError) {
        self.degrade(why);
    }

    fn is_lost(&self) -> bool {
        self.is_degraded()
    }

    fn answered(&self) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.recover()
    }

    async fn heard(&self) {
        // The wait lists' lease lives with the budgets, renewed once a heartbeat.
        if let Err(e) = self.bounded(self.primary.keep_waiting()).await {
            tracing::debug!("cannot renew this instance's wait lists: {e}");
        }
        if !self.is_degraded() {
            match self.write_back().await {
                Ok(0) => {}
                Ok(n) => tracing::warn!(lockouts_written = n, "lockouts written to the shared store after a failed write"),
                Err(e) => tracing::warn!("a lockout is still not in the shared store ({e}); this instance keeps the destination halted and tries again"),
            }
            if let Err(e) = self.refresh_known().await {
                tracing::debug!("cannot read the budgets' shared state back: {e}");
            }
        }
        self.agreement.compare(&self.control, &self.me).await;
    }
}

#[async_trait::async_trait]
impl<B: Store, M: Membership, L: Fallback> Fleet for Failover<B, M, L> {
    async fn instances(&self) -> Result<Vec<InstanceStatus>, StoreError> {
        self.bounded(self.control.live_instances(LIVE_WITHIN)).await
    }

    fn announce(&self, rules: &[(String, Rule)]) {
        self.agreement.announce(rules);
    }

    fn drift(&self, destination: &str) -> Vec<String> {
        self.agreement.differing(destination)
    }
}

#[async_trait::async_trait]
impl<B: Store, M: Membership, L: Fallback> Store for Failover<B, M, L> {
    fn kind(&self) -> &'static str {
        self.primary.kind()
    }

    fn known(&self) -> Option<&Known> {
        self.primary.known()
    }

    async fn reserve(
        &self,
        destination: &str,
        rule: &Rule,
        ask: Ask<'_>,
    ) -> Result<Grant, ReserveError> {
        let governing = self.agreement.governing(destination);
        let rule = governing.as_deref().unwrap_or(rule);
        // A lockout not yet written halts its destination here all the same.
        if let Some(lock) = self.unwritten_lock(destination) {
            return Err(ReserveError::Locked(lock));
        }
        if !self.is_degraded() {
            match self.shared(destination, rule, ask).await {
                Err(ReserveError::Store(e)) if e.is_lost() => self.degrade(&e),
                answer => return answer,
            }
        }
        let alone = match self.policy.on_unavailable {
            OnUnavailable::Refuse => Alone::Refuse(StoreError::Unavailable),
            OnUnavailable::Divide => self.standing.alone(Instant::now()),
        };
        let no = match alone {
            Alone::Pace(part, until) => match Self::alone_rule(rule, part) {
                Some(alone) => return self.alone(destination, rule, &alone, ask, until).await,
                None => ReserveError::Store(StoreError::Unreachable(format!(
                    "at rate / {n}, less the request a second of slack a schedule of its own may add, nothing is left of this destination's rate to pace alone on (a share of a request a second or less does not pace alone)",
                    n = self.standing.divisor()
                ))),
            },
            // The others may not hold this instance's share back yet. Ask again shortly:
            // the store may be back by then.
            Alone::Wait(left) => ReserveError::Yield(left.min(RECHECK)),
            Alone::Refuse(why) => ReserveError::Store(why),
        };
        // A lockout known here is the clearer refusal.
        match self.local.view(destination).await.ok().and_then(|v| v.lock) {
            Some(lock) => Err(ReserveError::Locked(lock)),
            None => Err(no),
        }
    }

    async fn wait_list(&self, destination: &str, queues: &[ClassQueue]) -> Result<(), StoreError> {
        self.shared_or_local(self.primary.wait_list(destination, queues), || {
            self.local.wait_list(destination, queues)
        })
        .await
    }

    async fn settle(&self, budget: &str, rule: &Rule, units: i64) -> Result<(), StoreError> {
        let governing = self.agreement.governing(budget);
        let rule = governing.as_deref().unwrap_or(rule);
        self.shared_or_local(self.primary.settle(budget, rule, units), || async move {
            // On the schedule this instance paces alone on: its intervals are the rate's
            // share's.
            let alone = match self.standing.alone(Instant::now()) {
                Alone::Pace(part, _) => Self::alone_rule(rule, part),
                _ => None,
            };
            self.local
                .settle(budget, alone.as_ref().unwrap_or(rule), units)
                .await
        })
        .await
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
        let governing = self.agreement.governing(budget);
        let rule = governing.as_deref().unwrap_or(rule);
        // A slot names a send in the windows of the store that granted it; the other store
        // finds none by it and only refunds.
        self.shared_or_local(
            self.primary
                .give_back(budget, rule, slot, sent, reserved, units),
            || async move {
                let alone = match self.standing.alone(Instant::now()) {
                    Alone::Pace(part, _) => Self::alone_rule(rule, part),
                    _ => None,
                };
                self.local
                    .give_back(
                        budget,
                        alone.as_ref().unwrap_or(rule),
                        slot,
                        sent,
                        reserved,
                        units,
                    )
                    .await
            },
        )
        .await
    }

    async fn continue_after(&self, marks: &[(String, Instant)]) -> Result<(), StoreError> {
        self.bounded(self.primary.continue_after(marks)).await
    }

    async fn record(
        &self,
        destination: &str,
        rule: &Rule,
        event: Event,
        vendor: Option<Observation>,
    ) -> Result<BudgetView, StoreError> {
        let governing = self.agreement.governing(destination);
        let rule = governing.as_deref().unwrap_or(rule);
        let to_share = event.clone();
        let shared = self.primary.record(destination, rule, to_share, vendor);
        let lockout = match &event {
            Event::Lockout(lock) => Some(lock.clone()),
            _ => None,
        };
        let keep = |lock: Lockout| {
            self.pending
                .lock()
                .push((destination.to_owned(), rule.clone(), lock));
        };
        let local_event = event.clone();
        let answer = self
            .shared_or_local(shared, || {
                // Written to the shared store when it is back, so that no lockout is lost.
                if let Some(lock) = lockout.clone() {
                    keep(lock);
                }
                self.local.record(destination, rule, local_event, vendor)
            })
            .await;
        match (answer, lockout) {
            // The store answers but did not take the lockout: this instance halts the
            // destination now and writes it again each heartbeat.
            (Err(e), Some(lock)) => {
                tracing::error!(destination, "cannot write a lockout to the shared store ({e}); the destination is halted here and the write is tried again each heartbeat");
                if self.unwritten_lock(destination).is_none() {
                    keep(lock);
                }
                self.local.record(destination, rule, event, None).await
            }
            (answer, _) => answer,
        }
    }

    async fn unlock(&self, destination: &str) -> Result<Option<Lockout>, StoreError> {
        if self.is_degraded() {
            return Err(StoreError::Unreachable(
                "a lockout can only be cleared in the shared store; retry when it is back".into(),
            ));
        }
        let cleared = self.bounded(self.primary.unlock(destination)).await?;
        // A lockout not yet written is cleared too, not written after the unlock.
        self.pending
            .lock()
            .retain(|(dest, _, _)| dest != destination);
        Ok(cleared)
    }

    async fn view(&self, destination: &str) -> Result<BudgetView, StoreError> {
        self.shared_or_local(self.primary.view(destination), || {
            self.local.view(destination)
        })
        .await
    }

    /// Only the shared store's: a secret of this instance's own would name keys' budgets
    /// apart from the others'.
    async fn key_secret(&self) -> Result<Vec<u8>, StoreError> {
        self.bounded(self.primary.key_secret()).await
    }

    async fn forget_keys(&self, parent: &str, idle: Duration) -> Result<u64, StoreError> {
        let local = self.local.forget_keys(parent, idle).await?;
        if self.is_degraded() {
            return Ok(local);
        }
        self.bounded(self.primary.forget_keys(parent, idle)).await
    }

    /// What seeds the local store is kept while it holds a pause or a lockout (see
    /// [`Known::forget`]): an idle key may still be paused, and losing the shared store must
    /// not lift that.
    fn forget_budget(&self, budget: &str) {
        self.local.forget_budget(budget);
        self.primary.forget_budget(budget);
    }

    async fn snapshot(&self, destinations: &[(&str, &Rule)]) -> Result<Vec<Snapshot>, StoreError> {
        self.shared_or_local(self.primary.snapshot(destinations), || {
            self.local.snapshot(destinations)
        })
        .await
    }
}

#[cfg(test)]
mod tests;
