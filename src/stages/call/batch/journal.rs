//! The batch journal: what was sent in which chunk, and how far each chunk got.
//!
//! A batch is paid when it runs, so a chunk's requests must never go into two batches and a
//! finished batch's answers must never be lost. Each chunk is a set of files in
//! `<root>/_journal/batches/` (beside the call journal; an object-store root keeps it in the
//! local state folder): `<key>.input.jsonl` (the batch input file, byte for byte as it is
//! uploaded), `<key>.reqs.jsonl` (the requests, to build the rows) and `<key>.state.json`
//! (the uploaded file's id, then the batch's id and state). Both line files are fsynced
//! before the state file is first written, and the state file is replaced by rename, so a
//! crash leaves either no state (the chunk was never uploaded: its files are deleted) or a
//! state that says what happened last. A chunk's files are deleted once its rows are
//! committed. `attempts.json` holds the batch attempts spent on calls that are to be sent
//! again, and the chunks whose attempts it counts, so a collection done twice counts once.
//! `known-batches.txt` lists every batch id a chunk recorded (and those found to belong to
//! no chunk), so a batch looked for by its creation time and size is never one of them.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::super::CallRequest;

/// How far a chunk got.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChunkState {
    /// `<session>-<seq>`: names the chunk's files and goes into the batch's metadata.
    pub key: String,
    pub requests: u64,
    pub bytes: u64,
    /// The uploaded input file, once the upload returned.
    pub file_id: Option<String>,
    /// The batch, once its create returned (or the list endpoint found it).
    pub batch_id: Option<String>,
    /// The batch's last known status (`validating`, `in_progress`, `completed`, ...).
    pub status: Option<String>,
    /// When the chunk was written, microseconds since the epoch (the rows' `started_at`).
    pub written_at_us: i64,
    /// When a create of its batch was last sent (Anthropic: no metadata names the chunk, so
    /// a batch created after this time is looked for when the create's answer was lost).
    #[serde(default)]
    pub creating_at_us: Option<i64>,
}

/// The retry attempts spent in earlier batches on calls not yet committed.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Attempts {
    /// Chunks whose retryable lines are counted here.
    pub applied: BTreeSet<String>,
    pub spent: BTreeMap<String, u32>,
}

/// The journal folder.
#[derive(Debug, Clone)]
pub struct BatchJournal {
    dir: PathBuf,
}

fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Writes `bytes` to `path` by a fsynced temporary file and a rename.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Some(d) = path.parent() {
        sync_dir(d);
    }
    Ok(())
}

/// A chunk being written: its input and request lines.
pub struct ChunkWriter {
    pub key: String,
    input: std::io::BufWriter<std::fs::File>,
    reqs: std::io::BufWriter<std::fs::File>,
    pub requests: u64,
    pub bytes: u64,
}

impl ChunkWriter {
    /// Appends one request and its batch input line (without the newline).
    pub fn push(&mut self, req: &CallRequest, line: &[u8]) -> std::io::Result<()> {
        self.input.write_all(line)?;
        self.input.write_all(b"\n")?;
        serde_json::to_writer(&mut self.reqs, req).map_err(std::io::Error::other)?;
        self.reqs.write_all(b"\n")?;
        self.requests += 1;
        self.bytes += line.len() as u64 + 1;
        Ok(())
    }
}

impl BatchJournal {
    /// The journal in `dir` (created when missing).
    pub fn open(dir: PathBuf) -> std::io::Result<Self> {
        std::fs::create_dir_all(&dir)?;
        Ok(Self { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn file(&self, key: &str, what: &str) -> PathBuf {
        self.dir.join(format!("{key}.{what}"))
    }

    /// The input file of a chunk.
    pub fn input_path(&self, key: &str) -> PathBuf {
        self.file(key, "input.jsonl")
    }

    /// Starts a chunk's files.
    pub fn begin(&self, key: &str) -> std::io::Result<ChunkWriter> {
        let open = |p: PathBuf| -> std::io::Result<_> {
            Ok(std::io::BufWriter::with_capacity(
                1 << 20,
                std::fs::File::create(p)?,
            ))
        };
        Ok(ChunkWriter {
            key: key.to_string(),
            input: open(self.input_path(key))?,
            reqs: open(self.file(key, "reqs.jsonl"))?,
            requests: 0,
            bytes: 0,
        })
    }

    /// Makes a written chunk durable and records its first state (nothing uploaded).
    pub fn seal(&self, w: ChunkWriter) -> std::io::Result<ChunkState> {
        for f in [w.input, w.reqs] {
            let f = f.into_inner().map_err(|e| e.into_error())?;
            f.sync_all()?;
        }
        let st = ChunkState {
            key: w.key,
            requests: w.requests,
            bytes: w.bytes,
            file_id: None,
            batch_id: None,
            status: None,
            written_at_us: chrono::Utc::now().timestamp_micros(),
            creating_at_us: None,
        };
        self.save(&st)?;
        Ok(st)
    }

    /// Records a chunk's state.
    pub fn save(&self, st: &ChunkState) -> std::io::Result<()> {
        let bytes = serde_json::to_vec_pretty(st).map_err(std::io::Error::other)?;
        write_atomic(&self.file(&st.key, "state.json"), &bytes)
    }

    /// Every chunk with a state, in key order; the files of chunks without one (killed
    /// while being written, never uploaded) are deleted.
    pub fn chunks(&self) -> std::io::Result<Vec<ChunkState>> {
        let mut states = Vec::new();
        let mut keys = HashSet::new();
        let mut all = Vec::new();
        for e in std::fs::read_dir(&self.dir)? {
            let p = e?.path();
            let name = p
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("")
                .to_string();
            if let Some(k) = name.strip_suffix(".state.json") {
                let st: ChunkState = serde_json::from_slice(&std::fs::read(&p)?)
                    .map_err(|e| std::io::Error::other(format!("{}: {e}", p.display())))?;
                keys.insert(k.to_string());
                states.push(st);
            } else if let Some(k) = [
                ".input.jsonl",
                ".reqs.jsonl",
                ".results-0.jsonl",
                ".results-1.jsonl",
                ".download.tmp",
            ]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            {
                all.push((k.to_string(), p));
            }
        }
        for (k, p) in all {
            if !keys.contains(&k) {
                std::fs::remove_file(p)?;
            }
        }
        states.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(states)
    }

    /// The requests of a chunk, read one at a time, in line order.
    pub fn requests(
        &self,
        key: &str,
    ) -> std::io::Result<impl Iterator<Item = std::io::Result<CallRequest>> + use<>> {
        let f = std::io::BufReader::new(std::fs::File::open(self.file(key, "reqs.jsonl"))?);
        Ok(f.lines()
            .map(|line| serde_json::from_str(&line?).map_err(std::io::Error::other)))
    }

    /// The call ids of a chunk, in line order (the rest of each request is not kept).
    pub fn request_ids(&self, key: &str) -> std::io::Result<Vec<String>> {
        #[derive(Deserialize)]
        struct Id {
            call_id: String,
        }
        let f = std::io::BufReader::new(std::fs::File::open(self.file(key, "reqs.jsonl"))?);
        f.lines()
            .map(|line| {
                let id: Id = serde_json::from_str(&line?).map_err(std::io::Error::other)?;
                Ok(id.call_id)
            })
            .collect()
    }

    /// Where a final batch's result file `slot` is downloaded (OpenAI: 0 the output file, 1
    /// the error file; Anthropic: 0 the results), kept until the chunk is removed.
    pub fn results_path(&self, key: &str, slot: usize) -> PathBuf {
        self.file(key, &format!("results-{slot}.jsonl"))
    }

    /// Deletes a collected chunk (its rows are committed).
    pub fn remove(&self, key: &str) -> std::io::Result<()> {
        // The state goes first: a chunk without state is never looked at again.
        for what in [
            "state.json",
            "input.jsonl",
            "reqs.jsonl",
            "results-0.jsonl",
            "results-1.jsonl",
            "download.tmp",
        ] {
            match std::fs::remove_file(self.file(key, what)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        sync_dir(&self.dir);
        Ok(())
    }

    fn known_path(&self) -> PathBuf {
        self.dir.join("known-batches.txt")
    }

    /// Records a batch id as known to this root (ours, or found not to be), fsynced: a batch
    /// id in this file is never adopted for an unrecorded chunk.
    pub fn record_known(&self, batch_id: &str) -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.known_path())?;
        writeln!(f, "{batch_id}")?;
        f.sync_all()
    }

    /// Every batch id recorded by [`Self::record_known`]: one short line per batch the root
    /// has seen (a 10M-request run has about 200), so the file is read whole.
    pub fn known(&self) -> std::io::Result<HashSet<String>> {
        match std::fs::read_to_string(self.known_path()) {
            Ok(s) => Ok(s.lines().map(String::from).collect()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(HashSet::new()),
            Err(e) => Err(e),
        }
    }

    fn attempts_path(&self) -> PathBuf {
        self.dir.join("attempts.json")
    }

    pub fn attempts(&self) -> std::io::Result<Attempts> {
        match std::fs::read(self.attempts_path()) {
            Ok(b) => serde_json::from_slice(&b).map_err(std::io::Error::other),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Attempts::default()),
            Err(e) => Err(e),
        }
    }

    pub fn save_attempts(&self, a: &Attempts) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(a).map_err(std::io::Error::other)?;
        write_atomic(&self.attempts_path(), &bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: &str) -> CallRequest {
        CallRequest {
            call_id: id.into(),
            case_id: "c".into(),
            input: "i".into(),
            prompt: "p".into(),
            system: None,
            sample_idx: 0,
            max_tokens: None,
            temperature: None,
            request_hash: "h".into(),
            prior_attempts: 0,
        }
    }

    #[test]
    fn a_chunk_without_state_is_dropped_and_a_sealed_one_is_kept() {
        let d = tempfile::tempdir().unwrap();
        let j = BatchJournal::open(d.path().join("b")).unwrap();
        let mut w = j.begin("s-00000").unwrap();
        w.push(&req("a"), b"{\"custom_id\":\"a\"}").unwrap();
        w.push(&req("b"), b"{\"custom_id\":\"b\"}").unwrap();
        let st = j.seal(w).unwrap();
        assert_eq!((st.requests, st.bytes), (2, 36));
        let mut torn = j.begin("s-00001").unwrap();
        torn.push(&req("c"), b"{}").unwrap();
        drop(torn);
        let chunks = j.chunks().unwrap();
        assert_eq!(chunks, vec![st]);
        assert!(!j.input_path("s-00001").exists());
        let ids: Vec<String> = j
            .requests("s-00000")
            .unwrap()
            .map(|r| r.unwrap().call_id)
            .collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(j.request_ids("s-00000").unwrap(), ["a", "b"]);
        assert_eq!(
            std::fs::read(j.input_path("s-00000")).unwrap(),
            b"{\"custom_id\":\"a\"}\n{\"custom_id\":\"b\"}\n"
        );
        j.remove("s-00000").unwrap();
        assert!(j.chunks().unwrap().is_empty());
    }
}
