//! The memory store's state file: what survives a restart. Whenever backoff, a lockout, a
//! block streak, a pause or the vendor's view changes, every budget's are written atomically
//! (a temp file of its own, mode 0600, fsync, rename), times as wall-clock times; quota windows' latest slots at most
//! every second ([`MemoryStore::keep_sends`]). The beat itself (`next_at`) is not kept: after a
//! restart the schedule starts from now, which is what an idle destination does anyway.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::MemoryStore;
use crate::budget::schedule::{Budget, Vendor};
use crate::budget::{Lockout, PauseCause, StoreError};
use crate::signals::Family;

/// The file format of the state file.
#[derive(Debug, Default, Serialize, Deserialize)]
struct StateFile {
    version: u32,
    destinations: BTreeMap<String, Persisted>,
    /// The secret that keys credentials' hashes, in hex (see `Store::key_secret`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    key_secret: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Persisted {
    backoff: f64,
    generation: u64,
    clean_streak: u32,
    lock: Option<Lockout>,
    /// The quota windows' latest slots, as Unix times in seconds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    sends: Vec<f64>,
    #[serde(default, skip_serializing_if = "is_zero")]
    block_streak: u32,
    /// A pause still in force, as a Unix time in seconds, and its cause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    paused_until: Option<(f64, PauseCause)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    vendor: Option<PersistedVendor>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A vendor view, its times as Unix times in seconds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PersistedVendor {
    family: String,
    remaining: u64,
    limit: Option<u64>,
    observed: f64,
    reset: f64,
    taken: u64,
}

/// How often changed quota windows are written to the state file.
const SAVE_SENDS_EVERY: Duration = Duration::from_secs(1);

impl MemoryStore {
    /// Opens a store persisted at `state_file`, loading what a previous run left there.
    pub fn open(state_file: &Path) -> Result<Self, StoreError> {
        let mut store = Self {
            state_file: Some(state_file.to_owned()),
            ..Self::ephemeral()
        };
        let text = match std::fs::read_to_string(state_file) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(store),
            Err(e) => {
                return Err(StoreError::File(format!(
                    "cannot read state file {}: {e}",
                    state_file.display()
                )))
            }
        };
        let file: StateFile = serde_json::from_str(&text).map_err(|e| {
            StoreError::File(format!(
                "state file {} is not valid ({e}); move it aside to start afresh (lockouts in it would be lost)",
                state_file.display()
            ))
        })?;
        if let Some(secret) = &file.key_secret {
            let bytes: [u8; 32] = hex::decode(secret)
                .ok()
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| {
                    StoreError::File(format!(
                        "state file {}: key_secret is not 32 bytes in hex; move the file aside to start afresh",
                        state_file.display()
                    ))
                })?;
            store.key_secret = Arc::new(bytes);
        }
        let mut budgets = store.budgets.lock();
        for (name, p) in file.destinations {
            budgets.insert(
                name,
                Budget {
                    backoff: p.backoff.max(1.0),
                    generation: p.generation,
                    clean_streak: p.clean_streak,
                    lock: p.lock.map(Box::new),
                    sends: p.sends.iter().map(|t| store.at_unix(*t)).collect(),
                    block_streak: p.block_streak,
                    paused_until: p
                        .paused_until
                        .map_or(Duration::ZERO, |(t, _)| store.at_unix(t)),
                    paused_by: p.paused_until.map(|(_, by)| by),
                    vendor: p
                        .vendor
                        .and_then(|v| {
                            Some(Vendor {
                                family: Family::from_name(&v.family)?,
                                remaining: v.remaining,
                                limit: v.limit,
                                observed: store.at_unix(v.observed),
                                reset: store.at_unix(v.reset),
                                taken: v.taken,
                            })
                        })
                        .map(Box::new),
                    ..Budget::default()
                },
            );
        }
        drop(budgets);
        Ok(store)
    }

    /// Writes the state file whenever a quota window took a slot, at most every second, and
    /// once more when `stop` is cancelled. A crash loses at most the last second of them.
    pub async fn keep_sends(self: Arc<Self>, stop: CancellationToken) {
        loop {
            let stopping = tokio::select! {
                () = tokio::time::sleep(SAVE_SENDS_EVERY) => false,
                () = stop.cancelled() => true,
            };
            if self.sends_changed.swap(false, Ordering::Relaxed) {
                if let Err(e) = self.persist().await {
                    self.sends_changed.store(true, Ordering::Relaxed);
                    tracing::error!("cannot save quota windows: {e}");
                }
            }
            if stopping {
                return;
            }
        }
    }

    /// Writes every budget to the state file, if the store has one.
    pub(super) async fn persist(&self) -> Result<(), StoreError> {
        let Some(path) = self.state_file.clone() else {
            return Ok(());
        };
        let _writing = self.writer.lock().await;
        let file = StateFile {
            version: 1,
            key_secret: Some(hex::encode(*self.key_secret)),
            destinations: self
                .budgets
                .lock()
                .iter()
                .map(|(name, b)| {
                    let now = self.now();
                    let p = Persisted {
                        backoff: b.backoff,
                        generation: b.generation,
                        clean_streak: b.clean_streak,
                        lock: b.lock.as_deref().cloned(),
                        sends: b.sends.iter().map(|t| self.unix_of(*t)).collect(),
                        block_streak: b.block_streak,
                        paused_until: b
                            .paused_by
                            .filter(|_| b.paused_until > now)
                            .map(|by| (self.unix_of(b.paused_until), by)),
                        vendor: b.vendor_at(now).map(|v| PersistedVendor {
                            family: v.family.as_str().to_owned(),
                            remaining: v.remaining,
                            limit: v.limit,
                            observed: self.unix_of(v.observed),
                            reset: self.unix_of(v.reset),
                            taken: v.taken,
                        }),
                    };
                    (name.clone(), p)
                })
                .collect(),
        };
        let json = serde_json::to_vec_pretty(&file).map_err(|e| StoreError::File(e.to_string()))?;
        tokio::task::spawn_blocking(move || write_atomically(&path, &json))
            .await
            .map_err(|e| StoreError::File(format!("state file writer failed: {e}")))?
    }
}

/// Writes `data` to `path` so that a reader sees the old file or the new one, never a part:
/// through a temporary file of a unique name beside it (a fixed one could be a link planted
/// by someone else, or raced by a second instance), readable by the owner alone (lockouts and
/// the requests that caused them are in it), synced, then renamed over `path`.
fn write_atomically(path: &Path, data: &[u8]) -> Result<(), StoreError> {
    use std::io::Write;
    let fail = |what: &str, e: std::io::Error| {
        StoreError::File(format!("cannot {what} state file {}: {e}", path.display()))
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    // tempfile creates it with mode 0600 and a random name, failing rather than following
    // anything already there.
    let mut tmp = tempfile::Builder::new()
        .prefix(".pacegate-state.")
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| fail("create a temporary file for", e))?;
    tmp.write_all(data).map_err(|e| fail("write", e))?;
    tmp.as_file().sync_all().map_err(|e| fail("sync", e))?;
    tmp.persist(path).map_err(|e| fail("replace", e.error))?;
    // Make the rename itself durable.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}
