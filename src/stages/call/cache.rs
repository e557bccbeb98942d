//! The response cache: re-running the same requests (in a new run root) costs nothing.
//!
//! The key is `sha256(base_url, request_hash, sample_idx)`: the sample index is part of it
//! so K samples of one prompt never collapse into one answer. Only successful answers are
//! cached (an error is a fact about that attempt, not about the request).
//!
//! Layout: append-only log files `<dir>/<session>-<pid>.log`, one record per line,
//! `<40 hex key> <json length> <json entry>\n`. A file per entry cost one inode per call,
//! which on ext4 took more CPU than the call itself; appending costs one `write` per group
//! of calls. When a stage opens the cache it scans every log's headers (not the JSON) into
//! an in-memory index of key -> (file, offset, length), so a lookup is a hash probe and one
//! positioned read. A record whose length or JSON does not check out (a torn write) is a
//! miss: losing a cache entry only costs a call, so logs are not fsynced. Entries written
//! during a session are seen by the next session, not by the one writing them.
//!
//! The default folder is `.evalflow-cache` beside a local run root, and `responses` in this
//! machine's state folder ([`super::journal::local_state_dir`]) for an object-store root, so
//! the same requests into a new `s3://` root cost nothing either; the `EVALFLOW_CACHE_DIR`
//! variable names another folder, and `EVALFLOW_CACHE_DIR=off` disables it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{CallRequest, CallResult};
use crate::storage::RunStore;

/// The variable naming the cache folder (`off` disables the cache).
pub const CACHE_ENV: &str = "EVALFLOW_CACHE_DIR";

const KEY_HEX: usize = 40;

type Key = [u8; KEY_HEX];

/// Where a record's JSON lies.
#[derive(Debug, Clone, Copy)]
struct Loc {
    file: u32,
    offset: u64,
    len: u32,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    base_url: String,
    files: Vec<File>,
    index: HashMap<Key, Loc>,
    /// This session's log, opened on the first write.
    log: Mutex<Option<File>>,
    log_name: String,
}

/// A cache folder, opened: cheap to clone, shared by the call tasks.
#[derive(Debug, Clone)]
pub struct Cache(Arc<Inner>);

/// What a cache entry holds.
#[derive(Debug, Serialize, Deserialize)]
pub struct Entry {
    pub result: CallResult,
    pub latency_ms: f64,
}

/// The folder the cache of a run root lives in, if any.
pub fn dir_for_root(store: &RunStore) -> Option<PathBuf> {
    match std::env::var(CACHE_ENV) {
        Ok(v) if v == "off" || v.is_empty() => None,
        Ok(v) => Some(PathBuf::from(v)),
        Err(_) => {
            let url = store.table_url("calls");
            if url.starts_with("memory:") {
                return None;
            }
            if !url.starts_with("file:") {
                return Some(super::journal::local_state_dir().join("responses"));
            }
            Some(Path::new(store.display()).parent()?.join(".evalflow-cache"))
        }
    }
}

/// Parses a record header `<key> <len> `; returns the key, the JSON length and where the
/// JSON starts in `line`.
fn header(line: &[u8]) -> Option<(Key, usize, usize)> {
    let key: Key = line.get(..KEY_HEX)?.try_into().ok()?;
    if line.get(KEY_HEX) != Some(&b' ') {
        return None;
    }
    let rest = &line[KEY_HEX + 1..];
    let sp = rest.iter().position(|&b| b == b' ')?;
    let len: usize = std::str::from_utf8(&rest[..sp]).ok()?.parse().ok()?;
    Some((key, len, KEY_HEX + 1 + sp + 1))
}

/// Adds the records of one log to `index`.
fn scan(file: &File, file_no: u32, index: &mut HashMap<Key, Loc>) -> std::io::Result<()> {
    let mut r = BufReader::with_capacity(1 << 16, file);
    let mut line = Vec::new();
    let mut pos = 0u64;
    loop {
        line.clear();
        let n = r.read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(());
        }
        // A record is whole when its stated length runs exactly to the newline.
        if let Some((key, len, start)) = header(&line)
            && line.last() == Some(&b'\n')
            && start + len + 1 == n
        {
            index.insert(
                key,
                Loc {
                    file: file_no,
                    offset: pos + start as u64,
                    len: len as u32,
                },
            );
        }
        pos += n as u64;
    }
}

impl Cache {
    /// Opens the cache in `dir` for answers from `base_url`, indexing every log in it.
    /// Unreadable logs are skipped (a cache never fails a run).
    pub fn open(dir: &Path, base_url: &str, session: &str) -> Cache {
        let mut files = Vec::new();
        let mut index = HashMap::new();
        let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("log"))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        for p in names {
            let Ok(f) = File::open(&p) else { continue };
            if scan(&f, files.len() as u32, &mut index).is_ok() {
                files.push(f);
            }
        }
        Cache(Arc::new(Inner {
            dir: dir.to_path_buf(),
            base_url: base_url.to_string(),
            files,
            index,
            log: Mutex::new(None),
            log_name: format!("{session}-{}.log", std::process::id()),
        }))
    }

    /// Number of indexed entries.
    pub fn len(&self) -> usize {
        self.0.index.len()
    }

    /// Whether no entry is indexed.
    pub fn is_empty(&self) -> bool {
        self.0.index.is_empty()
    }

    fn key(&self, req: &CallRequest) -> Key {
        let mut h = Sha256::new();
        h.update(self.0.base_url.as_bytes());
        h.update([0]);
        h.update(req.request_hash.as_bytes());
        h.update([0]);
        h.update(req.sample_idx.to_string().as_bytes());
        let hex = hex::encode(h.finalize());
        hex.as_bytes()[..KEY_HEX]
            .try_into()
            .expect("sha256 hex is 64 chars")
    }

    /// The cached answer to `req`, if any.
    pub fn get(&self, req: &CallRequest) -> Option<Entry> {
        let loc = *self.0.index.get(&self.key(req))?;
        let mut buf = vec![0u8; loc.len as usize];
        self.0.files[loc.file as usize]
            .read_exact_at(&mut buf, loc.offset)
            .ok()?;
        serde_json::from_slice(&buf).ok()
    }

    /// Appends the successful answers among `rows` (errors are not cached) with one write.
    /// Failures are ignored: a missing entry only costs a call.
    pub fn put_all<'a>(
        &self,
        rows: impl IntoIterator<Item = (&'a CallRequest, &'a CallResult, f64)>,
    ) {
        let mut buf = Vec::new();
        for (req, result, latency_ms) in rows {
            if result.error.is_some() {
                continue;
            }
            let Ok(json) = serde_json::to_vec(&Entry {
                result: result.clone(),
                latency_ms,
            }) else {
                continue;
            };
            buf.extend_from_slice(&self.key(req));
            buf.extend_from_slice(format!(" {} ", json.len()).as_bytes());
            buf.extend_from_slice(&json);
            buf.push(b'\n');
        }
        if buf.is_empty() {
            return;
        }
        let mut log = self.0.log.lock().unwrap_or_else(|e| e.into_inner());
        if log.is_none() {
            let _ = std::fs::create_dir_all(&self.0.dir);
            *log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.0.dir.join(&self.0.log_name))
                .ok();
        }
        if let Some(f) = log.as_mut() {
            let _ = f.write_all(&buf);
        }
    }

    /// Stores one answer (see [`Cache::put_all`]).
    pub fn put(&self, req: &CallRequest, result: &CallResult, latency_ms: f64) {
        self.put_all([(req, result, latency_ms)]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(hash: &str, k: i32) -> CallRequest {
        CallRequest {
            call_id: format!("c{k}"),
            case_id: "case".into(),
            input: "in".into(),
            prompt: "in".into(),
            system: None,
            sample_idx: k,
            max_tokens: None,
            temperature: None,
            request_hash: hash.into(),
            prior_attempts: 0,
        }
    }

    fn answer(text: &str) -> CallResult {
        CallResult {
            response: Some(text.into()),
            attempts: 1,
            ..Default::default()
        }
    }

    #[test]
    fn entries_survive_reopen_keep_samples_apart_and_skip_errors_and_torn_records() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::open(dir.path(), "http://a", "s1");
        assert!(c.is_empty());
        let failed = CallResult {
            error: Some("http 500".into()),
            ..Default::default()
        };
        c.put_all([
            (&req("h", 0), &answer("zero"), 1.0),
            (&req("h", 1), &answer("one"), 2.0),
            (&req("x", 0), &failed, 3.0),
        ]);
        assert!(
            c.get(&req("h", 0)).is_none(),
            "a session does not see its own writes"
        );

        let c2 = Cache::open(dir.path(), "http://a", "s2");
        assert_eq!(c2.len(), 2, "errors are not cached");
        let e = c2.get(&req("h", 1)).unwrap();
        assert_eq!(e.result.response.as_deref(), Some("one"));
        assert_eq!(e.latency_ms, 2.0);
        assert_eq!(
            c2.get(&req("h", 0)).unwrap().result.response.as_deref(),
            Some("zero")
        );
        assert!(c2.get(&req("h", 2)).is_none());
        assert!(
            Cache::open(dir.path(), "http://b", "s3")
                .get(&req("h", 0))
                .is_none(),
            "another server's answers are another cache"
        );

        // A torn record (killed mid-write) swallows the next append to its log: that entry
        // is lost, nothing else is, and nothing wrong is served.
        c2.put(&req("h", 3), &answer("three"), 1.0);
        let log = dir.path().join(&c2.0.log_name);
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        f.write_all(b"0123456789012345678901234567890123456789 500 {\"resu")
            .unwrap();
        c2.put(&req("h", 4), &answer("four"), 1.0);
        let c3 = Cache::open(dir.path(), "http://a", "s4");
        assert_eq!(c3.len(), 3);
        assert_eq!(
            c3.get(&req("h", 3)).unwrap().result.response.as_deref(),
            Some("three")
        );
        assert!(c3.get(&req("h", 4)).is_none());
    }
}
