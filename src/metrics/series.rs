//! A budget's series, found once per budget and then only read on the request path.

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use prometheus::{Histogram, IntCounter, IntCounterVec};

use super::{labels, Metrics};

/// The series of one budget's families, each looked up once: a budget's labels are fixed,
/// so a request that counts into them finds its series here rather than hashing every label
/// value again. The last label of a family takes few values (a class, an outcome, a status,
/// a verdict), each found in a [`Tail`] without a lock.
pub struct BudgetSeries {
    /// `pacegate_wait_seconds`.
    pub wait: Histogram,
    /// `pacegate_request_duration_seconds`.
    pub duration: Histogram,
    /// `pacegate_slots_dropped_total`.
    pub slots_dropped: IntCounter,
    requests: Tail<&'static str, IntCounter>,
    responses: Tail<u16, IntCounter>,
    verdicts: Tail<(&'static str, &'static str), IntCounter>,
    /// By class name: a reload may order the classes anew.
    granted: Tail<Box<str>, IntCounter>,
    families: Families,
    labels: [Arc<str>; 2],
}

impl std::fmt::Debug for BudgetSeries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("BudgetSeries").field(&self.labels).finish()
    }
}

/// The families [`BudgetSeries`] finds a new series in.
struct Families {
    requests: IntCounterVec,
    responses: IntCounterVec,
    verdicts: IntCounterVec,
    granted: IntCounterVec,
}

/// Values of a [`Tail`] found without a lock.
const TAIL_SLOTS: usize = 16;

/// Series by the value of one more label. The first values seen each take a slot that is set
/// once and then only read: finding a series there is an atomic load per slot, with no lock
/// and no reference count written, so requests on other cores do not contend for a cache
/// line to find it. Values past the slots (a budget whose upstream answers with more than 16
/// statuses) go to a list under a lock.
struct Tail<K, M> {
    slots: [OnceLock<(K, M)>; TAIL_SLOTS],
    more: Mutex<Vec<(K, M)>>,
}

/// A series found in a [`Tail`]: lent from a slot, or copied from the list past them.
pub enum Found<'a, M> {
    Lent(&'a M),
    Copied(M),
}

impl<M> std::ops::Deref for Found<'_, M> {
    type Target = M;

    fn deref(&self) -> &M {
        match self {
            Self::Lent(m) => m,
            Self::Copied(m) => m,
        }
    }
}

impl<K, M: Clone> Tail<K, M> {
    fn new() -> Self {
        Self {
            slots: std::array::from_fn(|_| OnceLock::new()),
            more: Mutex::new(Vec::new()),
        }
    }

    /// The series for `key` in a slot, if one holds it.
    fn lent<Q>(&self, key: &Q) -> Option<&M>
    where
        K: std::borrow::Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        for slot in &self.slots {
            match slot.get() {
                Some((k, m)) if k.borrow() == key => return Some(m),
                Some(_) => {}
                None => break,
            }
        }
        None
    }

    /// The series for `key`, made by `make` (with the key it is kept under) when it is new.
    fn get<Q>(&self, key: &Q, make: impl FnOnce() -> (K, M)) -> Found<'_, M>
    where
        K: std::borrow::Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        if let Some(m) = self.lent(key) {
            return Found::Lent(m);
        }
        // New here: slots are set under the list's lock, so that a value takes one slot.
        let mut more = self.more.lock();
        if let Some(m) = self.lent(key) {
            return Found::Lent(m);
        }
        if let Some(slot) = self.slots.iter().find(|slot| slot.get().is_none()) {
            let _ = slot.set(make());
            let (_, m) = slot.get().expect("set above, under the lock");
            return Found::Lent(m);
        }
        if let Some((_, m)) = more.iter().find(|(k, _)| k.borrow() == key) {
            return Found::Copied(m.clone());
        }
        let (k, m) = make();
        more.push((k, m.clone()));
        Found::Copied(m)
    }
}

impl BudgetSeries {
    /// The series of `budget` (see [`labels`]) in `metrics`.
    pub fn new(metrics: &Metrics, budget: &str) -> Self {
        let [destination, group] = labels(budget);
        let own = [destination, group];
        Self {
            wait: metrics.wait_seconds.with_label_values(&own),
            duration: metrics.request_duration.with_label_values(&own),
            slots_dropped: metrics.slots_dropped.with_label_values(&own),
            requests: Tail::new(),
            responses: Tail::new(),
            verdicts: Tail::new(),
            granted: Tail::new(),
            families: Families {
                requests: metrics.requests.clone(),
                responses: metrics.upstream_responses.clone(),
                verdicts: metrics.verdicts.clone(),
                granted: metrics.granted.clone(),
            },
            labels: [Arc::from(destination), Arc::from(group)],
        }
    }

    fn own(&self) -> [&str; 2] {
        [&self.labels[0], &self.labels[1]]
    }

    /// `pacegate_requests_total` for `outcome`.
    pub fn requests(&self, outcome: &'static str) -> Found<'_, IntCounter> {
        self.requests.get(&outcome, || {
            let [d, g] = self.own();
            (
                outcome,
                self.families.requests.with_label_values(&[d, g, outcome]),
            )
        })
    }

    /// `pacegate_upstream_responses_total` for `status`.
    pub fn response(&self, status: http::StatusCode) -> Found<'_, IntCounter> {
        self.responses.get(&status.as_u16(), || {
            let [d, g] = self.own();
            let counter = self
                .families
                .responses
                .with_label_values(&[d, g, status.as_str()]);
            (status.as_u16(), counter)
        })
    }

    /// `pacegate_verdicts_total` for a verdict and what decided it.
    pub fn verdict(&self, verdict: &'static str, reason: &'static str) -> Found<'_, IntCounter> {
        self.verdicts.get(&(verdict, reason), || {
            let [d, g] = self.own();
            let counter = self
                .families
                .verdicts
                .with_label_values(&[d, g, verdict, reason]);
            ((verdict, reason), counter)
        })
    }

    /// `pacegate_granted_total` for the class named `class`.
    pub fn granted(&self, class: &str) -> Found<'_, IntCounter> {
        self.granted.get(class, || {
            let [d, g] = self.own();
            (
                class.into(),
                self.families.granted.with_label_values(&[d, g, class]),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Registry;

    #[test]
    fn every_status_finds_its_own_series_in_the_slots_and_past_them() {
        let metrics = Metrics::new(Registry::new()).unwrap();
        let series = BudgetSeries::new(&metrics, "api/search");
        // More statuses than slots: the last ones go to the list past them.
        let statuses: Vec<u16> = (200..200 + 2 * TAIL_SLOTS as u16).collect();
        for (i, status) in statuses.iter().enumerate() {
            let status = http::StatusCode::from_u16(*status).unwrap();
            for _ in 0..=i {
                series.response(status).inc();
            }
        }
        for (i, status) in statuses.iter().enumerate() {
            let counted = metrics
                .upstream_responses
                .with_label_values(&["api", "search", &status.to_string()])
                .get();
            assert_eq!(counted, i as u64 + 1, "status {status}");
        }
        assert!(matches!(
            series.response(http::StatusCode::OK),
            Found::Lent(_)
        ));
        series.granted("interactive").inc_by(2);
        series.granted("interactive").inc();
        let granted = metrics
            .granted
            .with_label_values(&["api", "search", "interactive"]);
        assert_eq!(granted.get(), 3);
    }
}
