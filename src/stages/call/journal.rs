//! The call journal: a crash-safe, append-only log of completed calls.
//!
//! A completed call is paid for; losing it to a crash means paying again. Each group of
//! completed calls is appended to `<root>/_journal/calls/<session>-<gen>.jsonl` and
//! fsynced before the call counts as done (and before its concurrency permit is
//! released, so at most `concurrency` answered calls are ever unrecorded). Parquet parts
//! are committed every few seconds: at each commit the journal rotates to a new file, and
//! the old one is deleted once its rows' part is durable (the commit runs while new rows
//! are journaled). On restart every journal file is folded into a part
//! (skipping call ids already committed) before any new request is sent, so a SIGKILL at
//! any moment loses nothing that was recorded and duplicates nothing that was committed.
//!
//! The journal lives beside `calls/`, not in it, so table listings never see it. It needs
//! a local file (fsync): an object-store root's journal lives on the machine that calls,
//! under [`local_state_dir`] in a folder named by a hash of the root's URL and endpoint, so
//! a session killed on an `s3://` root re-pays only the calls in flight, as on a local root.
//! A session on another machine does not see that journal: it re-pays what the killed one
//! answered since its last commit (a few seconds of calls), and a journal left behind is
//! folded in (committed ids skipped) whenever a session on this machine next runs the root.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use super::CallRow;
use crate::storage::RunStore;

/// The variable naming the folder of the local state of object-store roots.
pub const STATE_ENV: &str = "EVALFLOW_STATE_DIR";

/// The folder of this machine's state for object-store roots (their call journals, and the
/// response cache by default): `$EVALFLOW_STATE_DIR`, else `$XDG_CACHE_HOME/evalflow`, else
/// `~/.cache/evalflow`, else `evalflow-state` in the temporary folder.
pub fn local_state_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var(STATE_ENV)
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("evalflow")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("evalflow")))
        .unwrap_or_else(|| std::env::temp_dir().join("evalflow-state"))
}

/// The journal folder of a run root: `_journal/calls` in a local root; for an object-store
/// root, a folder of [`local_state_dir`] named by the root's URL and the S3 endpoint (two
/// servers may hold buckets of one name); `None` for `memory://` roots, which no crash
/// outlives.
pub fn dir_for(store: &RunStore) -> Option<PathBuf> {
    let url = store.table_url("calls");
    if url.starts_with("file:") {
        return Some(Path::new(store.display()).join("_journal").join("calls"));
    }
    if url.starts_with("memory:") {
        return None;
    }
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(url.as_bytes());
    for k in ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"] {
        h.update(b"\n");
        h.update(std::env::var(k).unwrap_or_default().as_bytes());
    }
    let key = hex::encode(&h.finalize()[..10]);
    let dir = local_state_dir().join("journals").join(key);
    // Which root a folder belongs to, for a person looking at the state folder.
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(dir.join("root.txt"), format!("{}\n", store.display()));
    }
    Some(dir.join("calls"))
}

/// An open journal file.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    session: String,
    generation: u32,
    path: PathBuf,
    file: std::fs::File,
}

/// Reads every journal file in `dir`: the rows it holds and the files read. A torn last
/// line (the crash happened mid-write, before its fsync) is skipped.
pub fn recover(dir: &Path) -> std::io::Result<(Vec<CallRow>, Vec<PathBuf>)> {
    let mut rows = Vec::new();
    let mut files = Vec::new();
    let rd = match std::fs::read_dir(dir) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((rows, files)),
        Err(e) => return Err(e),
    };
    for entry in rd {
        let p = entry?.path();
        if p.extension().and_then(|e| e.to_str()) != Some("jsonl") {
            continue;
        }
        let f = std::io::BufReader::new(std::fs::File::open(&p)?);
        for line in f.lines() {
            let Ok(line) = line else { break };
            match serde_json::from_str::<CallRow>(&line) {
                Ok(r) => rows.push(r),
                // Only a torn final line can fail; stop reading this file there.
                Err(_) => break,
            }
        }
        files.push(p);
    }
    files.sort();
    Ok((rows, files))
}

fn sync_dir(dir: &Path) {
    // Makes the create / unlink durable; best effort (not all platforms allow it).
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

impl Journal {
    /// Opens a new journal file for `session` in `dir`.
    pub fn open(dir: &Path, session: &str) -> std::io::Result<Journal> {
        std::fs::create_dir_all(dir)?;
        let (path, file) = Self::create(dir, session, 0)?;
        Ok(Journal {
            dir: dir.to_path_buf(),
            session: session.to_string(),
            generation: 0,
            path,
            file,
        })
    }

    fn create(
        dir: &Path,
        session: &str,
        generation: u32,
    ) -> std::io::Result<(PathBuf, std::fs::File)> {
        let path = dir.join(format!("{session}-{generation:06}.jsonl"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        sync_dir(dir);
        Ok((path, file))
    }

    /// Encodes rows as journal lines.
    pub fn encode(rows: &[CallRow]) -> Vec<u8> {
        let mut buf = Vec::with_capacity(rows.len() * 512);
        for r in rows {
            serde_json::to_writer(&mut buf, r).expect("call rows serialise");
            buf.push(b'\n');
        }
        buf
    }

    /// Appends encoded lines and fsyncs them.
    pub fn append(&mut self, lines: &[u8]) -> std::io::Result<()> {
        self.file.write_all(lines)?;
        self.file.sync_data()
    }

    /// Starts a new file and deletes the current one: call after every row in it has been
    /// committed to a Parquet part.
    pub fn rotate(&mut self) -> std::io::Result<()> {
        let old = self.next_file()?;
        remove(&[old])
    }

    /// Starts a new file and returns the current one, to be deleted ([`remove`]) once every
    /// row in it is committed: the commit may then run while new rows are journaled.
    pub fn next_file(&mut self) -> std::io::Result<PathBuf> {
        self.generation += 1;
        let (path, file) = Self::create(&self.dir, &self.session, self.generation)?;
        self.file = file;
        Ok(std::mem::replace(&mut self.path, path))
    }

    /// Deletes the current file (every row committed, the stage is done).
    pub fn close(self) -> std::io::Result<()> {
        std::fs::remove_file(&self.path)?;
        sync_dir(&self.dir);
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Deletes journal files once their rows are committed.
pub fn remove(files: &[PathBuf]) -> std::io::Result<()> {
    for f in files {
        match std::fs::remove_file(f) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    if let Some(d) = files.first().and_then(|f| f.parent()) {
        sync_dir(d);
    }
    Ok(())
}
