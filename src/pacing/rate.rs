//! The achieved rate: how many slots were used, per second, over the last minute.

use tokio::time::Instant;

use crate::class::Class;

/// A budget's slots used: all of them (the achieved rate) and by class (status), kept under
/// one lock, which a request takes once.
pub(super) struct Sends {
    pub(super) all: SendLog,
    pub(super) by_class: Vec<SendLog>,
}

impl Sends {
    pub(super) fn new(classes: usize) -> Self {
        Self {
            all: SendLog::new(),
            by_class: (0..classes).map(|_| SendLog::new()).collect(),
        }
    }

    /// A slot of `class` used at `at`.
    pub(super) fn record(&mut self, class: Class, at: Instant) {
        self.all.record(at);
        if let Some(log) = self.by_class.get_mut(usize::from(class.0)) {
            log.record(at);
        }
    }
}

/// Sends per second over the last 64 seconds, for the achieved rate.
pub(super) struct SendLog {
    epoch: Instant,
    seconds: [u64; 64],
    counts: [u32; 64],
}

impl SendLog {
    pub(super) fn new() -> Self {
        Self {
            epoch: Instant::now(),
            seconds: [u64::MAX; 64],
            counts: [0; 64],
        }
    }

    pub(super) fn record(&mut self, at: Instant) {
        let sec = (at - self.epoch).as_secs();
        let i = (sec % 64) as usize;
        if self.seconds[i] != sec {
            self.seconds[i] = sec;
            self.counts[i] = 0;
        }
        self.counts[i] += 1;
    }

    /// Sends over the last `window` whole seconds, the current one included.
    pub(super) fn count(&self, now: Instant, window: u64) -> u64 {
        let current = (now - self.epoch).as_secs();
        let first = current.saturating_sub(window - 1);
        (0..64)
            .filter(|&i| (first..=current).contains(&self.seconds[i]))
            .map(|i| u64::from(self.counts[i]))
            .sum()
    }

    /// Sends per second over the last `window` whole seconds, the current one included.
    pub(super) fn rate(&self, now: Instant, window: u64) -> f64 {
        let sent = self.count(now, window);
        let elapsed = (now - self.epoch).as_secs_f64().min(window as f64).max(1.0);
        sent as f64 / elapsed
    }
}
