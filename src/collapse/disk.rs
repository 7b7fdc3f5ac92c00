//! The disk tier (`[cache] dir`): each kept response written to a file of its own, so that it
//! survives a restart, within `[cache] disk` bytes, the least lately used removed first.
//!
//! A file is written whole under `tmp/` and renamed into place, so that a file in place is
//! never half written by pacegate; what a crash or a disk does to it anyway is caught by its
//! digest, and such a file is a miss (and removed), never an error to the client. A write
//! that fails (the disk full) drops the entry: the client had its response from memory.
//!
//! A file: `pacegate-cache 1\n`, then length-prefixed fields (the key, the destination, when
//! the response was received, its status, its headers, the headers of the request it
//! answered, its body), then the SHA-256 of all that came before.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::StatusCode;
use parking_lot::Mutex;

const MAGIC: &[u8] = b"pacegate-cache 1\n";
const DIGEST: usize = 32;

/// A kept response as a file holds it.
#[derive(Clone)]
pub(super) struct Stored {
    pub(super) key: Arc<str>,
    pub(super) destination: Arc<str>,
    pub(super) received: SystemTime,
    pub(super) status: StatusCode,
    pub(super) headers: HeaderMap,
    pub(super) request: HeaderMap,
    pub(super) body: Bytes,
}

/// The files of the disk tier, and which was used last.
pub(super) struct Disk {
    dir: PathBuf,
    /// The most bytes it holds (`[cache] disk`; a reload may change it).
    capacity: std::sync::atomic::AtomicU64,
    index: Mutex<Index>,
}

#[derive(Default)]
struct Index {
    files: HashMap<String, OnDisk>,
    /// File names by their last use, the least lately used first.
    order: BTreeMap<u64, String>,
    tick: u64,
    bytes: u64,
}

struct OnDisk {
    key: Arc<str>,
    destination: Arc<str>,
    size: u64,
    used: u64,
}

impl Index {
    fn touch(&mut self, name: &str) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(file) = self.files.get_mut(name) {
            self.order.remove(&file.used);
            file.used = tick;
            self.order.insert(tick, name.to_owned());
        }
    }

    fn insert(&mut self, name: String, file: OnDisk) {
        self.forget(&name);
        self.tick += 1;
        let file = OnDisk {
            used: self.tick,
            ..file
        };
        self.bytes += file.size;
        self.order.insert(file.used, name.clone());
        self.files.insert(name, file);
    }

    fn forget(&mut self, name: &str) -> Option<OnDisk> {
        let file = self.files.remove(name)?;
        self.order.remove(&file.used);
        self.bytes -= file.size;
        Some(file)
    }
}

/// Why the disk tier could not be opened: its path, and what the system said.
#[derive(Debug, thiserror::Error)]
#[error("cache.dir {path}: {source}; pacegate keeps its disk tier there, so it must be a directory it can write")]
pub struct DiskError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

impl Disk {
    /// The disk tier `config` names (`dir` and `disk`), opened; `None` without one.
    pub(super) fn of(config: &crate::config::CacheConfig) -> Result<Option<Arc<Self>>, DiskError> {
        match (&config.dir, config.disk) {
            (Some(dir), Some(bytes)) => Ok(Some(Arc::new(Self::open(dir, bytes)?))),
            _ => Ok(None),
        }
    }

    /// Opens the disk tier in `dir`, made if it is not there: a file that is not a whole
    /// entry is removed, the others are indexed (their last use their modification time).
    /// `Err` where the directory cannot be made, read or written.
    pub(super) fn open(dir: &Path, capacity: u64) -> Result<Self, DiskError> {
        let failed = |path: &Path| {
            let path = path.to_owned();
            move |source| DiskError { path, source }
        };
        let tmp = dir.join("tmp");
        // Made for pacegate alone (what it keeps is the vendors' answers to its clients).
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&tmp)
            .map_err(failed(&tmp))?;
        // What a write cut short by a crash left.
        for leftover in std::fs::read_dir(&tmp).map_err(failed(&tmp))?.flatten() {
            let _ = std::fs::remove_file(leftover.path());
        }
        let probe = tmp.join("probe");
        std::fs::write(&probe, b"pacegate").map_err(failed(&tmp))?;
        std::fs::remove_file(&probe).map_err(failed(&tmp))?;
        let mut found = Vec::new();
        for file in std::fs::read_dir(dir).map_err(failed(dir))?.flatten() {
            let name = file.file_name().to_string_lossy().into_owned();
            if !is_entry_name(&name) {
                continue;
            }
            let path = file.path();
            match (head_of(&path), file.metadata()) {
                (Some((key, destination)), Ok(meta)) if name == name_of(&key) => {
                    let modified = meta.modified().unwrap_or(UNIX_EPOCH);
                    found.push((modified, name, key, destination, meta.len()));
                }
                _ => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        found.sort_by_key(|f| f.0);
        let mut index = Index::default();
        for (_, name, key, destination, size) in found {
            index.insert(
                name,
                OnDisk {
                    key,
                    destination,
                    size,
                    used: 0,
                },
            );
        }
        let disk = Self {
            dir: dir.to_owned(),
            capacity: capacity.into(),
            index: Mutex::new(index),
        };
        // A smaller `disk` than the last run's: the least lately used go.
        disk.evict();
        Ok(disk)
    }

    /// The keys of the entries on disk (to know, after a restart, what each key varies by).
    pub(super) fn keys(&self) -> Vec<Arc<str>> {
        self.index
            .lock()
            .files
            .values()
            .map(|f| f.key.clone())
            .collect()
    }

    /// The bytes of the entries on disk.
    pub(super) fn bytes(&self) -> u64 {
        self.index.lock().bytes
    }

    /// Whether an entry for `key` is on disk.
    pub(super) fn has(&self, key: &str) -> bool {
        self.index.lock().files.contains_key(&name_of(key))
    }

    /// The entry kept for `key`, read from its file; `None` where there is none, or its file
    /// is not whole (then it is removed).
    pub(super) fn read(&self, key: &str) -> Option<Stored> {
        let name = name_of(key);
        if !self.index.lock().files.contains_key(&name) {
            return None;
        }
        let path = self.dir.join(&name);
        let stored = std::fs::read(&path)
            .ok()
            .and_then(|bytes| decode(&bytes))
            .filter(|s| &*s.key == key);
        let mut index = self.index.lock();
        match stored {
            Some(stored) => {
                index.touch(&name);
                Some(stored)
            }
            None => {
                index.forget(&name);
                drop(index);
                let _ = std::fs::remove_file(&path);
                None
            }
        }
    }

    /// Writes `stored` to its file, replacing what was kept for its key; the least lately
    /// used entries go while the tier is past its bytes (how many: `Ok`). `Err` where it
    /// could not be written whole: the entry is not on disk then (not even as it was before).
    pub(super) fn write(&self, stored: &Stored) -> std::io::Result<usize> {
        let name = name_of(&stored.key);
        let bytes = encode(stored);
        let tmp = self.dir.join("tmp").join(format!(
            "{name}.{}",
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or(Duration::ZERO)
                .as_nanos()
        ));
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(&bytes))
            .and_then(|()| std::fs::rename(&tmp, self.dir.join(&name)));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            self.remove(&name);
            return Err(e);
        }
        self.index.lock().insert(
            name,
            OnDisk {
                key: stored.key.clone(),
                destination: stored.destination.clone(),
                size: bytes.len() as u64,
                used: 0,
            },
        );
        Ok(self.evict())
    }

    /// Removes the entries `matches` names by key and destination; how many.
    pub(super) fn purge(&self, matches: impl Fn(&str, &str) -> bool) -> usize {
        let names: Vec<String> = self
            .index
            .lock()
            .files
            .iter()
            .filter(|(_, f)| matches(&f.key, &f.destination))
            .map(|(name, _)| name.clone())
            .collect();
        for name in &names {
            self.remove(name);
        }
        names.len()
    }

    /// Holds at most `capacity` bytes from now on; how many entries went to make it so.
    pub(super) fn resize(&self, capacity: u64) -> usize {
        self.capacity
            .store(capacity, std::sync::atomic::Ordering::Relaxed);
        self.evict()
    }

    /// Removes the least lately used entries while the tier is past its bytes; how many.
    pub(super) fn evict(&self) -> usize {
        let mut gone = 0;
        loop {
            let mut index = self.index.lock();
            if index.bytes <= self.capacity.load(std::sync::atomic::Ordering::Relaxed) {
                return gone;
            }
            let Some((_, name)) = index.order.pop_first() else {
                return gone;
            };
            if let Some(file) = index.files.remove(&name) {
                index.bytes -= file.size;
            }
            drop(index);
            let _ = std::fs::remove_file(self.dir.join(&name));
            gone += 1;
        }
    }

    fn remove(&self, name: &str) {
        self.index.lock().forget(name);
        let _ = std::fs::remove_file(self.dir.join(name));
    }
}

/// A key's file name: the first 128 bits of its SHA-256, in hex.
fn name_of(key: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    digest.as_ref()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn is_entry_name(name: &str) -> bool {
    name.len() == 32 && name.bytes().all(|b| b.is_ascii_hexdigit())
}

fn put(out: &mut Vec<u8>, field: &[u8]) {
    out.extend_from_slice(&(field.len() as u64).to_le_bytes());
    out.extend_from_slice(field);
}

fn put_headers(out: &mut Vec<u8>, headers: &HeaderMap) {
    out.extend_from_slice(&(headers.len() as u64).to_le_bytes());
    for (name, value) in headers {
        put(out, name.as_str().as_bytes());
        put(out, value.as_bytes());
    }
}

fn encode(stored: &Stored) -> Vec<u8> {
    let mut out = Vec::with_capacity(stored.body.len() + 1024);
    out.extend_from_slice(MAGIC);
    put(&mut out, stored.key.as_bytes());
    put(&mut out, stored.destination.as_bytes());
    let received = stored
        .received
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_millis() as u64;
    out.extend_from_slice(&received.to_le_bytes());
    out.extend_from_slice(&(stored.status.as_u16() as u64).to_le_bytes());
    put_headers(&mut out, &stored.headers);
    put_headers(&mut out, &stored.request);
    put(&mut out, &stored.body);
    let digest = ring::digest::digest(&ring::digest::SHA256, &out);
    out.extend_from_slice(digest.as_ref());
    out
}

/// Reads fields off the front of a file's bytes.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn number(&mut self) -> Option<u64> {
        let (n, rest) = self.0.split_first_chunk::<8>()?;
        self.0 = rest;
        Some(u64::from_le_bytes(*n))
    }

    fn field(&mut self) -> Option<&'a [u8]> {
        let n = usize::try_from(self.number()?).ok()?;
        let (field, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(field)
    }

    fn text(&mut self) -> Option<Arc<str>> {
        std::str::from_utf8(self.field()?).ok().map(Arc::from)
    }

    fn headers(&mut self) -> Option<HeaderMap> {
        let n = self.number()?;
        let mut headers = HeaderMap::new();
        for _ in 0..n {
            let name = HeaderName::from_bytes(self.field()?).ok()?;
            let value = HeaderValue::from_bytes(self.field()?).ok()?;
            headers.append(name, value);
        }
        Some(headers)
    }
}

fn decode(bytes: &[u8]) -> Option<Stored> {
    let (content, digest) = bytes.split_at_checked(bytes.len().checked_sub(DIGEST)?)?;
    if ring::digest::digest(&ring::digest::SHA256, content).as_ref() != digest {
        return None;
    }
    let mut fields = Fields(content.strip_prefix(MAGIC)?);
    let key = fields.text()?;
    let destination = fields.text()?;
    let received = UNIX_EPOCH + Duration::from_millis(fields.number()?);
    let status = StatusCode::from_u16(u16::try_from(fields.number()?).ok()?).ok()?;
    let headers = fields.headers()?;
    let request = fields.headers()?;
    let body = Bytes::copy_from_slice(fields.field()?);
    fields.0.is_empty().then_some(Stored {
        key,
        destination,
        received,
        status,
        headers,
        request,
        body,
    })
}

/// The key and destination a file begins with, read without the rest of it.
fn head_of(path: &Path) -> Option<(Arc<str>, Arc<str>)> {
    let mut file = std::fs::File::open(path).ok()?;
    let mut magic = [0u8; MAGIC.len()];
    file.read_exact(&mut magic).ok()?;
    if magic != MAGIC {
        return None;
    }
    let mut text = || -> Option<Arc<str>> {
        let mut n = [0u8; 8];
        file.read_exact(&mut n).ok()?;
        let n = usize::try_from(u64::from_le_bytes(n)).ok()?;
        // A key is a request line and a few header values: a longer one is not a key.
        if n > 1 << 20 {
            return None;
        }
        let mut field = vec![0u8; n];
        file.read_exact(&mut field).ok()?;
        String::from_utf8(field).ok().map(Arc::from)
    };
    Some((text()?, text()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(key: &str, body: &'static [u8]) -> Stored {
        let mut headers = HeaderMap::new();
        headers.insert("cache-control", HeaderValue::from_static("max-age=60"));
        headers.append("x-two", HeaderValue::from_static("a"));
        headers.append("x-two", HeaderValue::from_static("b"));
        Stored {
            key: Arc::from(key),
            destination: Arc::from("images"),
            received: UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            status: StatusCode::OK,
            headers,
            request: HeaderMap::new(),
            body: Bytes::from_static(body),
        }
    }

    #[test]
    fn an_entry_survives_a_reopening_and_a_damaged_file_is_a_miss() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Disk::open(dir.path(), 1 << 20).unwrap();
        disk.write(&stored("GET http://a/1 ", b"one")).unwrap();
        disk.write(&stored("GET http://a/2 ", b"two")).unwrap();
        drop(disk);
        let disk = Disk::open(dir.path(), 1 << 20).unwrap();
        let one = disk.read("GET http://a/1 ").unwrap();
        assert_eq!(one.body, "one");
        assert_eq!(one.headers.get_all("x-two").iter().count(), 2);
        assert_eq!(one.received, stored("k", b"").received);
        // A byte of the body flipped: a miss, and the file is gone.
        let path = dir.path().join(name_of("GET http://a/2 "));
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes.len() - DIGEST - 2;
        bytes[at] ^= 0xff;
        std::fs::write(&path, bytes).unwrap();
        assert!(disk.read("GET http://a/2 ").is_none());
        assert!(!path.exists());
        // Cut short: a miss at the next opening's read, or no entry at all.
        let path = dir.path().join(name_of("GET http://a/1 "));
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let disk = Disk::open(dir.path(), 1 << 20).unwrap();
        assert!(disk.read("GET http://a/1 ").is_none());
    }

    #[test]
    fn what_it_makes_only_pacegate_reads() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let tier = dir.path().join("cache");
        let disk = Disk::open(&tier, 1 << 20).unwrap();
        disk.write(&stored("GET http://a/1 ", b"one")).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&tier), 0o700);
        assert_eq!(mode(&tier.join(name_of("GET http://a/1 "))), 0o600);
    }

    #[test]
    fn the_least_lately_used_go_first_past_the_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let one = encode(&stored("GET http://a/1 ", &[0u8; 1000])).len() as u64;
        let disk = Disk::open(dir.path(), one * 2 + one / 2).unwrap();
        disk.write(&stored("GET http://a/1 ", &[0u8; 1000]))
            .unwrap();
        disk.write(&stored("GET http://a/2 ", &[0u8; 1000]))
            .unwrap();
        assert!(
            disk.read("GET http://a/1 ").is_some(),
            "used: /2 is now the least lately"
        );
        disk.write(&stored("GET http://a/3 ", &[0u8; 1000]))
            .unwrap();
        assert!(disk.has("GET http://a/1 "));
        assert!(!disk.has("GET http://a/2 "));
        assert!(disk.has("GET http://a/3 "));
        assert!(disk.bytes() <= one * 2 + one / 2);
        assert_eq!(disk.purge(|key, _| key.contains("/3")), 1);
        assert!(!disk.has("GET http://a/3 "));
    }

    #[test]
    fn a_directory_that_cannot_be_written_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"not a directory").unwrap();
        let err = Disk::open(&file.join("cache"), 1 << 20).err().unwrap();
        assert!(err.to_string().contains("a-file"), "{err}");
    }
}
