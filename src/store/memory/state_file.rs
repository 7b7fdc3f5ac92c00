//! The memory store's state file: what survives a restart, written with only what changed.
//!
//! Two files: a snapshot (`state_file`: every budget, written atomically: a temp file of its
//! own, mode 0600, fsync, rename) and a journal beside it (`state_file` + `.log`): one JSON
//! line for each budget that changed, its whole persisted state (or that it is gone), each
//! with a sequence number. Loading reads the snapshot, then the journal's lines past the
//! snapshot's sequence, the latest line of a budget winning. A write is one budget's line, not
//! the whole map, so its cost does not grow with the number of budgets (each key is one).
//!
//! - A lockout set or cleared, a pause begun, a block, the backoff widened: the budget's line is
//!   appended and synced before the response that caused it is answered ([`MemoryStore::write_now`]).
//! - The frequent changes (the vendor's remaining count, a clean streak, quota windows' latest
//!   slots, a key forgotten): the budget is marked, and its line written off the response path
//!   at most every second ([`MemoryStore::keep_state`]). `kill -9` loses at most that second.
//! - Once the journal outgrows the snapshot, the keeper writes a new snapshot and starts an
//!   empty journal (compaction); loading does the same.
//!
//! A crash can leave a torn last line in the journal, never a torn snapshot: a line that does
//! not parse is skipped. Times are wall-clock times. The beat itself (`next_at`) is not kept:
//! after a restart the schedule starts from now, which is what an idle destination does anyway.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::MemoryStore;
use crate::budget::schedule::{Budget, Sent, Vendor};
use crate::budget::{Lockout, PauseCause, StoreError};
use crate::signals::Family;

/// The file format of the snapshot.
#[derive(Debug, Default, Serialize, Deserialize)]
struct StateFile {
    version: u32,
    /// The journal's last line this snapshot holds: loading skips those up to it.
    #[serde(default)]
    seq: u64,
    destinations: BTreeMap<String, Persisted>,
    /// The secret that keys credentials' hashes, in hex (see `Store::key_secret`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    key_secret: Option<String>,
}

/// One line of the journal: a budget as it is now, or gone (`state` absent).
#[derive(Debug, Serialize, Deserialize)]
struct Line {
    seq: u64,
    budget: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    state: Option<Persisted>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Persisted {
    backoff: f64,
    generation: u64,
    clean_streak: u32,
    lock: Option<Lockout>,
    /// The quota windows' latest slots, as Unix times in seconds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    sends: Vec<f64>,
    /// The units sent up to and including each of `sends` (a meter's slots weigh their
    /// cost); absent, each weighed one, as a file written before meters had windows says.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    through: Vec<u64>,
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct PersistedVendor {
    family: String,
    remaining: u64,
    limit: Option<u64>,
    observed: f64,
    reset: f64,
    taken: u64,
}

/// How often the frequent changes are written.
const SAVE_EVERY: Duration = Duration::from_secs(1);
/// The journal is folded into a new snapshot once it is this large and larger than the
/// snapshot itself: compaction costs about the snapshot's size, once for every snapshot's
/// worth of lines.
const COMPACT_FROM: u64 = 256 * 1024;

/// The journal as this process appends to it.
pub(super) struct Journal {
    path: PathBuf,
    file: std::fs::File,
    /// Its size, and the snapshot's, in bytes.
    bytes: u64,
    snapshot: u64,
    /// The last line's sequence number.
    seq: u64,
}

/// What a change to a budget asks of the state file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Durability {
    /// Nothing kept changed.
    None,
    /// Kept before the response goes: a lockout, a pause, a block, the backoff.
    Now,
    /// Kept within a second.
    Soon,
}

impl Durability {
    /// What the change from `before` to `after` (a budget's kept state) asks.
    fn of(before: &Persisted, after: &Persisted) -> Self {
        if before == after {
            Self::None
        } else if before.lock != after.lock
            || before.paused_until != after.paused_until
            || before.block_streak != after.block_streak
            || before.backoff != after.backoff
            || before.generation != after.generation
        {
            Self::Now
        } else {
            Self::Soon
        }
    }
}

/// The journal beside `state_file`.
fn journal_path(state_file: &Path) -> PathBuf {
    let mut name = state_file.as_os_str().to_owned();
    name.push(".log");
    PathBuf::from(name)
}

impl MemoryStore {
    /// Opens a store persisted at `state_file`, loading what a previous run left there (the
    /// snapshot, then the journal), and starts a fresh snapshot and journal from it.
    pub fn open(state_file: &Path) -> Result<Self, StoreError> {
        let (store, seq) = Self::load(state_file)?;
        let journal = store.compact_now(seq)?;
        *store.journal.lock() = Some(journal);
        Ok(store)
    }

    /// What the state file at `state_file` holds now, as a store that writes nothing: what
    /// a restart would find.
    #[cfg(test)]
    pub(super) fn open_read_only(state_file: &Path) -> Self {
        let (mut store, _) = Self::load(state_file).unwrap();
        store.state_file = None;
        store
    }

    /// Loads the snapshot and the journal after it; the journal's last sequence number.
    fn load(state_file: &Path) -> Result<(Self, u64), StoreError> {
        let mut store = Self {
            state_file: Some(state_file.to_owned()),
            ..Self::ephemeral()
        };
        let text = match std::fs::read_to_string(state_file) {
            Ok(t) => Some(t),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                return Err(StoreError::File(format!(
                    "cannot read state file {}: {e}",
                    state_file.display()
                )))
            }
        };
        let file: StateFile = match text {
            Some(text) => serde_json::from_str(&text).map_err(|e| {
                StoreError::File(format!(
                    "state file {} is not valid ({e}); move it aside to start afresh (lockouts in it would be lost)",
                    state_file.display()
                ))
            })?,
            None => StateFile::default(),
        };
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
        let mut kept: BTreeMap<String, Persisted> = file.destinations;
        let seq = replay(&journal_path(state_file), file.seq, &mut kept)?;
        {
            let mut budgets = store.budgets.lock();
            for (name, p) in kept {
                let budget = store.budget_of(&p);
                budgets.insert(name, budget);
            }
        }
        Ok((store, seq))
    }

    /// A budget as `p` keeps it.
    fn budget_of(&self, p: &Persisted) -> Budget {
        Budget {
            backoff: p.backoff.max(1.0),
            generation: p.generation,
            clean_streak: p.clean_streak,
            lock: p.lock.clone().map(Box::new),
            sends: p
                .sends
                .iter()
                .enumerate()
                .map(|(i, t)| Sent {
                    at: self.at_unix(*t),
                    through: p.through.get(i).copied().unwrap_or(i as u64 + 1),
                })
                .collect(),
            block_streak: p.block_streak,
            paused_until: p
                .paused_until
                .map_or(Duration::ZERO, |(t, _)| self.at_unix(t)),
            paused_by: p.paused_until.map(|(_, by)| by),
            vendor: p
                .vendor
                .as_ref()
                .and_then(|v| {
                    Some(Vendor {
                        family: Family::stored(&v.family)?,
                        remaining: v.remaining,
                        limit: v.limit,
                        observed: self.at_unix(v.observed),
                        reset: self.at_unix(v.reset),
                        taken: v.taken,
                    })
                })
                .map(Box::new),
            ..Budget::default()
        }
    }

    /// What of `b` the state file keeps, as of now.
    fn persisted(&self, b: &Budget) -> Persisted {
        let now = self.now();
        Persisted {
            backoff: b.backoff,
            generation: b.generation,
            clean_streak: b.clean_streak,
            lock: b.lock.as_deref().cloned(),
            sends: b.sends.iter().map(|s| self.unix_of(s.at)).collect(),
            through: if b.sends.iter().zip(1..).all(|(s, i)| s.through == i) {
                Vec::new()
            } else {
                b.sends.iter().map(|s| s.through).collect()
            },
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
        }
    }

    /// What the change of a budget from `before` to `after` asks of the state file: their kept
    /// states compared. `None` without a state file.
    pub(super) fn kept_change(&self, before: &Budget, after: &Budget) -> Durability {
        if self.state_file.is_none() {
            return Durability::None;
        }
        Durability::of(&self.persisted(before), &self.persisted(after))
    }

    /// Marks `budget` to be written within a second.
    pub(super) fn mark(&self, budget: &str) {
        if self.state_file.is_some() {
            let mut dirty = self.dirty.lock();
            if !dirty.contains(budget) {
                dirty.insert(budget.to_owned());
            }
        }
    }

    /// Appends `budgets`' lines to the journal and syncs it: durable when this returns.
    pub(super) async fn write_now(&self, budgets: &[&str]) -> Result<(), StoreError> {
        if self.state_file.is_none() {
            return Ok(());
        }
        let _writing = self.writer.lock().await;
        self.append(budgets.iter().map(|b| (*b).to_owned()).collect())
            .await
    }

    /// Appends the lines of `budgets` (gone ones as gone), synced. The caller holds `writer`.
    async fn append(&self, budgets: Vec<String>) -> Result<(), StoreError> {
        let journal = self.journal.clone();
        let lines: Vec<(String, Option<Persisted>)> = {
            let map = self.budgets.lock();
            budgets
                .into_iter()
                .map(|name| {
                    let state = map.get(&name).map(|b| self.persisted(b));
                    (name, state)
                })
                .collect()
        };
        tokio::task::spawn_blocking(move || {
            let mut guard = journal.lock();
            let Some(j) = guard.as_mut() else {
                return Ok(());
            };
            let mut data = Vec::new();
            for (budget, state) in lines {
                j.seq += 1;
                let line = Line {
                    seq: j.seq,
                    budget,
                    state,
                };
                serde_json::to_writer(&mut data, &line)
                    .map_err(|e| StoreError::File(e.to_string()))?;
                data.push(b'\n');
            }
            let fail = |e: std::io::Error| {
                StoreError::File(format!(
                    "cannot write state journal {}: {e}",
                    j.path.display()
                ))
            };
            j.file.write_all(&data).map_err(fail)?;
            j.file.sync_data().map_err(fail)?;
            j.bytes += data.len() as u64;
            Ok(())
        })
        .await
        .map_err(|e| StoreError::File(format!("state file writer failed: {e}")))?
    }

    /// Writes the marked budgets' lines every second, and once more when `stop` is cancelled;
    /// folds the journal into a new snapshot once it outgrows it. A crash loses at most the
    /// last second of the frequent changes.
    pub async fn keep_state(self: Arc<Self>, stop: CancellationToken) {
        loop {
            let stopping = tokio::select! {
                () = tokio::time::sleep(SAVE_EVERY) => false,
                () = stop.cancelled() => true,
            };
            if let Err(e) = self.save_marked().await {
                tracing::error!("cannot save the state file: {e}");
            }
            if stopping {
                return;
            }
        }
    }

    /// Writes the marked budgets, then compacts if the journal outgrew the snapshot.
    pub(super) async fn save_marked(&self) -> Result<(), StoreError> {
        let marked: Vec<String> = self.dirty.lock().drain().collect();
        let _writing = self.writer.lock().await;
        if !marked.is_empty() {
            if let Err(e) = self.append(marked.clone()).await {
                self.dirty.lock().extend(marked);
                return Err(e);
            }
        }
        let due = self
            .journal
            .lock()
            .as_ref()
            .is_some_and(|j| j.bytes >= COMPACT_FROM && j.bytes > j.snapshot);
        if due {
            let seq = self.journal.lock().as_ref().map_or(0, |j| j.seq);
            let json = self.snapshot_json(seq)?;
            let Some(path) = self.state_file.clone() else {
                return Ok(());
            };
            let journal = tokio::task::spawn_blocking(move || write_snapshot(&path, &json, seq))
                .await
                .map_err(|e| StoreError::File(format!("state file writer failed: {e}")))??;
            *self.journal.lock() = Some(journal);
        }
        Ok(())
    }

    /// A new snapshot and an empty journal after it, at once (loading).
    fn compact_now(&self, seq: u64) -> Result<Journal, StoreError> {
        let Some(path) = self.state_file.clone() else {
            return Err(StoreError::File("no state file".into()));
        };
        write_snapshot(&path, &self.snapshot_json(seq)?, seq)
    }

    /// Every budget, as a snapshot as of journal line `seq`.
    fn snapshot_json(&self, seq: u64) -> Result<Vec<u8>, StoreError> {
        let file = StateFile {
            version: 1,
            seq,
            key_secret: Some(hex::encode(*self.key_secret)),
            destinations: self
                .budgets
                .lock()
                .iter()
                .map(|(name, b)| (name.clone(), self.persisted(b)))
                .collect(),
        };
        serde_json::to_vec_pretty(&file).map_err(|e| StoreError::File(e.to_string()))
    }
}

/// Writes `json` (a snapshot as of journal line `seq`) to `path`, then an empty journal after
/// it; returns the journal to append to.
fn write_snapshot(path: &Path, json: &[u8], seq: u64) -> Result<Journal, StoreError> {
    // The snapshot first: a crash between the two leaves it with the old journal, whose lines
    // up to `seq` loading skips.
    write_atomically(path, json)?;
    let journal = journal_path(path);
    write_atomically(&journal, b"")?;
    let file = std::fs::OpenOptions::new()
        .append(true)
        .open(&journal)
        .map_err(|e| {
            StoreError::File(format!(
                "cannot open state journal {}: {e}",
                journal.display()
            ))
        })?;
    Ok(Journal {
        path: journal,
        file,
        bytes: 0,
        snapshot: json.len() as u64,
        seq,
    })
}

/// Applies the journal at `path` to `kept`: its lines past `from`, a budget's latest line
/// winning. A line that does not parse (a crash tore the last one) is skipped. Returns the
/// last sequence number seen.
fn replay(
    path: &Path,
    from: u64,
    kept: &mut BTreeMap<String, Persisted>,
) -> Result<u64, StoreError> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(from),
        Err(e) => {
            return Err(StoreError::File(format!(
                "cannot read state journal {}: {e}",
                path.display()
            )))
        }
    };
    let mut last = from;
    let mut applied: HashMap<String, u64> = HashMap::new();
    for (i, line) in std::io::BufReader::new(file).split(b'\n').enumerate() {
        let line = line.map_err(|e| {
            StoreError::File(format!("cannot read state journal {}: {e}", path.display()))
        })?;
        if line.is_empty() {
            continue;
        }
        let Ok(line) = serde_json::from_slice::<Line>(&line) else {
            tracing::warn!(
                journal = %path.display(),
                line = i + 1,
                "skipped a line of the state journal that does not parse (torn by a crash?)"
            );
            continue;
        };
        last = last.max(line.seq);
        if line.seq <= from || applied.get(&line.budget).is_some_and(|s| *s > line.seq) {
            continue;
        }
        applied.insert(line.budget.clone(), line.seq);
        match line.state {
            Some(state) => kept.insert(line.budget, state),
            None => kept.remove(&line.budget),
        };
    }
    Ok(last)
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
