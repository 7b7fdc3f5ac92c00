//! The postgres store with a way down: what happens while the database is unreachable.
//!
//! Never fail open. A reservation waits at most `timeout` for the database; a slow answer
//! only delays that slot, since pacing locally beside instances that still reach the store
//! could exceed the ceiling. A connection error, or no answer within a heartbeat (1 s) to any
//! other call, marks the store *degraded* (one ERROR log, `pacegate_store_degraded` = 1), and
//! until the database answers again:
//! - `divide`: this instance paces on a local budget at `rate / n`, where `n` is the number
//!   of live instances last seen (heartbeats), or `instances_hint` if it never saw one, so the
//!   aggregate ceiling still holds. The local budget starts from the last known shared one,
//!   lockouts included.
//! - `refuse`: reservations fail with "pacing store unavailable".
//!
//! Lockouts taken meanwhile are kept and written to the database when it returns, so none is
//! lost. A supervisor heartbeats every second, counts the live instances, and probes the
//! database while degraded, so the instance is back on the shared budget within seconds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::IntGauge;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::memory::MemoryStore;
use super::postgres::{Instance, PostgresStore};
use super::{
    Ask, BudgetView, ClassQueue, ClassWaiting, Event, Grant, InstanceStatus, Lockout, ReserveError,
    Rule, Store, StoreError, StoreFuture,
};
use crate::destination::Quota;

/// How often the supervisor heartbeats (and probes while degraded).
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// The first probe after the store stopped answering, doubling up to [`PROBE_MAX`].
const PROBE_FIRST: Duration = Duration::from_millis(250);
/// The longest interval between probes of an unreachable store.
const PROBE_MAX: Duration = Duration::from_secs(2);
/// An instance whose last heartbeat is older than this no longer counts as live.
pub const LIVE_WITHIN: Duration = Duration::from_secs(5);

/// `[store] on_unavailable`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnUnavailable {
    /// Pace locally at `rate / n`.
    #[default]
    Divide,
    /// Refuse requests until the store is back.
    Refuse,
}

/// The postgres store, degrading per `OnUnavailable` while it is unreachable.
pub struct Failover {
    primary: PostgresStore,
    /// A connection of its own for heartbeats and probes, so that they are never starved by
    /// reservations holding every pooled connection.
    control: PostgresStore,
    local: MemoryStore,
    mode: OnUnavailable,
    timeout: Duration,
    me: Instance,
    degraded: AtomicBool,
    /// Live instances last seen (at least 1).
    live: AtomicUsize,
    /// The last budget read from the database, per destination, to seed the local one.
    last_known: Mutex<HashMap<String, BudgetView>>,
    /// The end of the last interval this instance reserved, per destination: where the local
    /// schedule continues when the store goes away.
    last_slot_end: Mutex<HashMap<String, Instant>>,
    /// Lockouts taken while degraded, to be written back.
    pending: Mutex<Vec<(String, Rule, Lockout)>>,
    degraded_gauge: IntGauge,
    instances_gauge: IntGauge,
}

fn guard<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Failover {
    /// Wraps `primary`; `control` (one connection) carries the heartbeats. `instances_hint` is
    /// the live count assumed until a heartbeat is seen.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        primary: PostgresStore,
        control: PostgresStore,
        mode: OnUnavailable,
        instances_hint: usize,
        timeout: Duration,
        me: Instance,
        degraded_gauge: IntGauge,
        instances_gauge: IntGauge,
    ) -> Self {
        Self {
            primary,
            control,
            local: MemoryStore::ephemeral(),
            mode,
            timeout,
            me,
            degraded: AtomicBool::new(false),
            live: AtomicUsize::new(instances_hint.max(1)),
            last_known: Mutex::new(HashMap::new()),
            last_slot_end: Mutex::new(HashMap::new()),
            pending: Mutex::new(Vec::new()),
            degraded_gauge,
            instances_gauge,
        }
    }

    /// Whether the store is degraded now.
    pub fn is_degraded(&self) -> bool {
        self.degraded.load(Ordering::SeqCst)
    }

    /// Calls other than reservations (verdicts, views, unlocks, write-backs) are off the
    /// hot path of pacing: they get a heartbeat's time before the store counts as gone.
    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let bound = self.timeout.max(HEARTBEAT);
        tokio::time::timeout(bound, call).await.unwrap_or_else(|_| {
            Err(StoreError(format!(
                "no answer within {}",
                humantime::format_duration(bound)
            )))
        })
    }

    /// The shared store's answer (within [`Failover::bounded`]), unless the store is, or now
    /// turns out to be, unreachable: then `local`'s.
    async fn shared_or_local<T, L, LF>(
        &self,
        shared: impl std::future::Future<Output = Result<T, StoreError>>,
        local: L,
    ) -> Result<T, StoreError>
    where
        L: FnOnce() -> LF,
        LF: std::future::Future<Output = Result<T, StoreError>>,
    {
        if !self.is_degraded() {
            match self.bounded(shared).await {
                Ok(answer) => return Ok(answer),
                Err(e) => self.degrade(&e),
            }
        }
        local().await
    }

    fn degrade(&self, why: &StoreError) {
        if self.degraded.swap(true, Ordering::SeqCst) {
            return;
        }
        // Start the local budgets from the last shared ones: a lockout must not be forgotten,
        // and the local schedule continues after the last slot taken, without a burst.
        let ends = guard(&self.last_slot_end).clone();
        for (dest, view) in guard(&self.last_known).iter() {
            self.local.seed(dest, view, ends.get(dest).copied());
        }
        self.degraded_gauge.set(1);
        let live = self.live.load(Ordering::SeqCst);
        match self.mode {
            OnUnavailable::Divide => tracing::error!(
                "pacing store unavailable ({why}); pacing locally at rate / {live} (live instances last seen) until it returns"
            ),
            OnUnavailable::Refuse => {
                tracing::error!("pacing store unavailable ({why}); refusing paced requests until it returns (on_unavailable = refuse)")
            }
        }
    }

    async fn recover(&self) -> Result<(), StoreError> {
        let pending: Vec<_> = std::mem::take(&mut *guard(&self.pending));
        for (i, (dest, rule, lock)) in pending.iter().enumerate() {
            if let Err(e) = self
                .bounded(
                    self.primary
                        .record(dest, rule, Event::Lockout(lock.clone())),
                )
                .await
            {
                guard(&self.pending).extend(pending[i..].iter().cloned());
                return Err(e);
            }
        }
        if self.degraded.swap(false, Ordering::SeqCst) {
            self.degraded_gauge.set(0);
            tracing::error!(
                lockouts_written = pending.len(),
                "pacing store is back; pacing on the shared budget again"
            );
        }
        Ok(())
    }

    /// Heartbeats every [`HEARTBEAT`] until `stop`, keeps the live count, and while degraded
    /// probes the database and recovers when it answers. Removes this instance's row on stop.
    pub async fn supervise(self: Arc<Self>, stop: CancellationToken) {
        let mut failures = 0u32;
        loop {
            // The heartbeat is off the request path: it gets more time than a reservation
            // before it declares the store unreachable.
            let beat = tokio::time::timeout(HEARTBEAT, self.control.heartbeat(&self.me)).await;
            match beat
                .unwrap_or_else(|_| Err(StoreError("heartbeat got no answer within 1s".into())))
            {
                Ok(()) => {
                    failures = 0;
                    if self.is_degraded() {
                        if let Err(e) = self.recover().await {
                            tracing::debug!(
                                "store answered a heartbeat but not the lockout write-back: {e}"
                            );
                        }
                    }
                    if let Ok(Ok(live)) =
                        tokio::time::timeout(HEARTBEAT, self.control.live_instances(LIVE_WITHIN))
                            .await
                    {
                        self.live.store(live.len().max(1), Ordering::SeqCst);
                        self.instances_gauge.set(live.len() as i64);
                    }
                }
                Err(e) => {
                    failures += 1;
                    self.degrade(&e);
                }
            }
            // While the store is away, probe it with a growing interval (250 ms, 500 ms, 1 s,
            // then every 2 s), so that pacing is back on the shared budget within about two
            // seconds of its return.
            let pause = if failures == 0 {
                HEARTBEAT
            } else {
                (PROBE_FIRST * 2u32.saturating_pow(failures - 1)).min(PROBE_MAX)
            };
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = stop.cancelled() => break,
            }
        }
        let _ = self.bounded(self.control.forget(&self.me)).await;
    }

    fn divided(&self, rule: &Rule) -> Rule {
        let n = u32::try_from(self.live.load(Ordering::SeqCst))
            .unwrap_or(u32::MAX)
            .max(1);
        // Quota windows are divided too. The local store has not seen the shared window's
        // history, so this bounds each instance's own sends, not the window as a whole.
        let quota = rule
            .quota
            .iter()
            .map(|q| Quota {
                limit: (q.limit / n).max(1),
                per: q.per,
            })
            .collect();
        Rule {
            interval: rule.interval * n,
            quota,
            ..rule.clone()
        }
    }

    fn unavailable() -> StoreError {
        StoreError(
            "pacing store unavailable (on_unavailable = refuse); retry when it is back".into(),
        )
    }

    fn remember(&self, destination: &str, view: &BudgetView) {
        guard(&self.last_known).insert(destination.to_owned(), view.clone());
    }
}

impl Store for Failover {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn instances(&self) -> StoreFuture<'_, Result<Vec<InstanceStatus>, StoreError>> {
        Box::pin(self.bounded(self.control.live_instances(LIVE_WITHIN)))
    }

    fn degraded(&self) -> bool {
        self.is_degraded()
    }

    fn reserve<'a>(
        &'a self,
        destination: &'a str,
        rule: &'a Rule,
        ask: Ask<'a>,
    ) -> StoreFuture<'a, Result<Grant, ReserveError>> {
        Box::pin(async move {
            if !self.is_degraded() {
                match tokio::time::timeout(
                    self.timeout,
                    self.primary.reserve(destination, rule, ask),
                )
                .await
                {
                    Ok(Err(ReserveError::Store(e))) => self.degrade(&e),
                    Ok(Ok(grant)) => {
                        // Slots are spaced at least `interval * n` apart while dividing.
                        let end = grant.slot.at + self.divided(rule).interval;
                        guard(&self.last_slot_end).insert(destination.to_owned(), end);
                        return Ok(grant);
                    }
                    Ok(result) => return result,
                    // Slow is not gone: pacing locally beside instances that still reach the
                    // store could exceed the ceiling, so a slow answer only delays this slot.
                    // The store counts as unreachable on a connection error, or when the
                    // supervisor's heartbeat gets no answer.
                    Err(_) => return Err(ReserveError::Busy(self.timeout)),
                }
            }
            match self.mode {
                OnUnavailable::Refuse => Err(ReserveError::Store(Self::unavailable())),
                OnUnavailable::Divide => {
                    let divided = self.divided(rule);
                    self.local.reserve(destination, &divided, ask).await
                }
            }
        })
    }

    fn wait_list<'a>(
        &'a self,
        destination: &'a str,
        queues: &'a [ClassQueue],
    ) -> StoreFuture<'a, Result<(), StoreError>> {
        Box::pin(
            self.shared_or_local(self.primary.wait_list(destination, queues), || {
                self.local.wait_list(destination, queues)
            }),
        )
    }

    fn waiting<'a>(
        &'a self,
        destination: &'a str,
    ) -> StoreFuture<'a, Result<Vec<ClassWaiting>, StoreError>> {
        Box::pin(self.shared_or_local(self.primary.waiting(destination), || {
            self.local.waiting(destination)
        }))
    }

    fn quota_used<'a>(
        &'a self,
        destination: &'a str,
        rule: &'a Rule,
    ) -> StoreFuture<'a, Result<Vec<u32>, StoreError>> {
        Box::pin(
            self.shared_or_local(self.primary.quota_used(destination, rule), || {
                self.local.quota_used(destination, rule)
            }),
        )
    }

    fn record<'a>(
        &'a self,
        destination: &'a str,
        rule: &'a Rule,
        event: Event,
    ) -> StoreFuture<'a, Result<BudgetView, StoreError>> {
        let to_share = event.clone();
        let shared = async move {
            let view = self.primary.record(destination, rule, to_share).await?;
            self.remember(destination, &view);
            Ok(view)
        };
        Box::pin(self.shared_or_local(shared, move || {
            // Written to the shared store when it is back, so that no lockout is lost.
            if let Event::Lockout(lock) = &event {
                guard(&self.pending).push((destination.to_owned(), rule.clone(), lock.clone()));
            }
            self.local.record(destination, rule, event)
        }))
    }

    fn unlock<'a>(
        &'a self,
        destination: &'a str,
    ) -> StoreFuture<'a, Result<Option<Lockout>, StoreError>> {
        Box::pin(async move {
            if self.is_degraded() {
                return Err(StoreError(
                    "the pacing store is unreachable; a lockout can only be cleared in the shared store, retry when it is back".into(),
                ));
            }
            let cleared = self.bounded(self.primary.unlock(destination)).await?;
            if let Some(view) = guard(&self.last_known).get_mut(destination) {
                view.lock = None;
            }
            Ok(cleared)
        })
    }

    fn view<'a>(&'a self, destination: &'a str) -> StoreFuture<'a, Result<BudgetView, StoreError>> {
        let shared = async {
            let view = self.primary.view(destination).await?;
            self.remember(destination, &view);
            Ok(view)
        };
        Box::pin(self.shared_or_local(shared, || self.local.view(destination)))
    }
}
