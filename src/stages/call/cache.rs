//! The response cache: re-running the same requests (in a new run root) costs nothing.
//!
//! One small JSON file per answered call, at `<dir>/<k[..2]>/<k>.json` with
//! `k = sha256(base_url, request_hash, sample_idx)`. The sample index is part of the key
//! so K samples of one prompt never collapse into one answer. Only successful answers are
//! cached (an error is a fact about that attempt, not about the request). Writes are
//! atomic (temporary file then rename) and not fsynced: losing a cache entry only costs a
//! call. The default folder is `.evalflow-cache` beside a local run root; the
//! `EVALFLOW_CACHE_DIR` variable names another, and `EVALFLOW_CACHE_DIR=off` disables it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{CallRequest, CallResult};
use crate::storage::RunStore;

/// The variable naming the cache folder (`off` disables the cache).
pub const CACHE_ENV: &str = "EVALFLOW_CACHE_DIR";

/// A cache folder.
#[derive(Debug, Clone)]
pub struct Cache {
    dir: PathBuf,
    base_url: String,
}

/// What a cache entry holds.
#[derive(Debug, Serialize, Deserialize)]
pub struct Entry {
    pub result: CallResult,
    pub latency_ms: f64,
}

impl Cache {
    /// The cache for a run root, if any.
    pub fn for_root(store: &RunStore, base_url: &str) -> Option<Cache> {
        let dir = match std::env::var(CACHE_ENV) {
            Ok(v) if v == "off" || v.is_empty() => return None,
            Ok(v) => PathBuf::from(v),
            Err(_) => {
                if !store.table_url("calls").starts_with("file:") {
                    return None;
                }
                Path::new(store.display()).parent()?.join(".evalflow-cache")
            }
        };
        Some(Cache {
            dir,
            base_url: base_url.to_string(),
        })
    }

    fn key(&self, req: &CallRequest) -> PathBuf {
        let mut h = Sha256::new();
        h.update(self.base_url.as_bytes());
        h.update([0]);
        h.update(req.request_hash.as_bytes());
        h.update([0]);
        h.update(req.sample_idx.to_string().as_bytes());
        let k = hex::encode(h.finalize());
        self.dir.join(&k[..2]).join(format!("{}.json", &k[..40]))
    }

    /// The cached answer to `req`, if any.
    pub fn get(&self, req: &CallRequest) -> Option<Entry> {
        let bytes = std::fs::read(self.key(req)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Stores a successful answer (errors are not cached).
    pub fn put(&self, req: &CallRequest, result: &CallResult, latency_ms: f64) {
        if result.error.is_some() {
            return;
        }
        let path = self.key(req);
        let Some(parent) = path.parent() else { return };
        let bytes = match serde_json::to_vec(&Entry {
            result: result.clone(),
            latency_ms,
        }) {
            Ok(b) => b,
            Err(_) => return,
        };
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            std::fs::create_dir_all(parent)?;
            std::fs::write(&tmp, &bytes)?;
            std::fs::rename(&tmp, &path)
        };
        if write().is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}
