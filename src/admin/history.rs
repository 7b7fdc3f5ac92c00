//! The last ten minutes of each destination's pace, for the status page's sparklines: a
//! sample of the effective and achieved rate every ten seconds.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::pacing::Pacer;

/// Time between samples.
pub(super) const EVERY: Duration = Duration::from_secs(10);
/// Samples kept per destination: ten minutes.
const KEPT: usize = 60;

/// One sample: when (Unix seconds), the effective rate and the achieved rate (10 s).
type Sample = (f64, f64, f64);

/// What `GET /history` answers.
#[derive(Serialize)]
pub(super) struct Samples {
    interval_seconds: u64,
    /// Per destination, oldest first: `[unix_seconds, effective, achieved]`.
    destinations: BTreeMap<String, Vec<Sample>>,
}

#[derive(Default)]
pub(super) struct History(Mutex<BTreeMap<String, VecDeque<Sample>>>);

impl History {
    /// Samples `pacer` now and then every [`EVERY`] until `stop`.
    pub(super) async fn keep(self: Arc<Self>, pacer: Arc<Pacer>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(EVERY);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = stop.cancelled() => return,
            }
            let at = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            // What this instance already knows: no store round trip every ten seconds.
            let paces = pacer.paces();
            let mut kept = self.0.lock();
            // A destination a reload removed has no line to draw.
            kept.retain(|name, _| paces.iter().any(|(d, ..)| d == name));
            for (destination, effective, achieved) in paces {
                let line = kept.entry(destination).or_default();
                line.push_back((at, effective, achieved));
                if line.len() > KEPT {
                    line.pop_front();
                }
            }
        }
    }

    pub(super) fn samples(&self) -> Samples {
        Samples {
            interval_seconds: EVERY.as_secs(),
            destinations: self
                .0
                .lock()
                .iter()
                .map(|(name, line)| (name.clone(), line.iter().copied().collect()))
                .collect(),
        }
    }
}
