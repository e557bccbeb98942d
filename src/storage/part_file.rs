//! A part being written: on a local root, straight into a temporary file beside its place,
//! renamed into place when whole; on any other store, in memory, and put whole (an object
//! store's put is atomic).
//!
//! Encoding into memory and then writing the bytes cost a 1M-record import an eighth of its
//! CPU: the buffer doubled as the part grew, each doubling copied it and the kernel zeroed
//! its fresh pages (`clear_page_erms` under the heap's growth), and `put` copied it once
//! more. A local part now costs one copy, into the page cache.
//!
//! The temporary name ends in `.tmp`, not `.parquet`: readers of a table list only
//! `.parquet` parts, and a folder's deletion (a stage restarting, a failed import) lists
//! and deletes it with the rest. A part dropped before [`PartFile::commit`] removes its file.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{RunStore, StorageError};

/// Temporary files made by this process, so two never share a name.
static TEMPS: AtomicU64 = AtomicU64::new(0);

/// One part's bytes on their way to `rel` under a run root ([`RunStore::part_file`]).
pub struct PartFile {
    store: RunStore,
    rel: String,
    out: Out,
}

enum Out {
    Memory(Vec<u8>),
    Local {
        /// Unbuffered: the Parquet writer buffers its small writes itself, and passes a
        /// page straight through.
        file: std::fs::File,
        temp: PathBuf,
        dest: PathBuf,
    },
    /// Committed or failed: nothing left to remove.
    Done,
}

impl RunStore {
    /// A part to be written at `rel` ([`PartFile`]): a temporary file on a local root,
    /// memory elsewhere.
    ///
    /// # Errors
    /// [`StorageError::Io`] when the local folder or file cannot be created.
    pub fn part_file(&self, rel: &str) -> Result<PartFile, StorageError> {
        let out = match self.local_path(rel) {
            None => Out::Memory(Vec::new()),
            Some(dest) => {
                let io = |source| StorageError::Io {
                    location: dest.display().to_string(),
                    source,
                };
                if let Some(dir) = dest.parent() {
                    std::fs::create_dir_all(dir).map_err(io)?;
                }
                let n = TEMPS.fetch_add(1, Ordering::Relaxed);
                let mut temp = dest.clone().into_os_string();
                temp.push(format!(".{}-{n}.tmp", std::process::id()));
                let temp = PathBuf::from(temp);
                let file = std::fs::File::create(&temp).map_err(io)?;
                Out::Local { file, temp, dest }
            }
        };
        Ok(PartFile {
            store: self.clone(),
            rel: rel.to_string(),
            out,
        })
    }
}

impl PartFile {
    /// Makes the part visible at its place, whole: renamed there (local), else put.
    ///
    /// # Errors
    /// [`StorageError::Io`] for a failed local rename, the store's error for a put.
    pub async fn commit(mut self) -> Result<(), StorageError> {
        match std::mem::replace(&mut self.out, Out::Done) {
            Out::Memory(bytes) => self.store.put(&self.rel, bytes).await,
            Out::Local { file, temp, dest } => {
                let io = |source| StorageError::Io {
                    location: dest.display().to_string(),
                    source,
                };
                drop(file);
                let committed = std::fs::rename(&temp, &dest);
                if committed.is_err() {
                    let _ = std::fs::remove_file(&temp);
                }
                committed.map_err(io)
            }
            Out::Done => Ok(()),
        }
    }

    /// Whether the part goes to a local temporary file.
    #[cfg(test)]
    pub(crate) fn is_local(&self) -> bool {
        matches!(self.out, Out::Local { .. })
    }
}

impl Write for PartFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &mut self.out {
            Out::Memory(v) => v.write(buf),
            Out::Local { file, .. } => file.write(buf),
            Out::Done => Err(std::io::Error::other("the part is already committed")),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match &mut self.out {
            Out::Memory(v) => {
                v.extend_from_slice(buf);
                Ok(())
            }
            Out::Local { file, .. } => file.write_all(buf),
            Out::Done => Err(std::io::Error::other("the part is already committed")),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.out {
            Out::Local { file, .. } => file.flush(),
            _ => Ok(()),
        }
    }
}

impl Drop for PartFile {
    /// A part never committed (its stage failed, or it had no rows) leaves no file.
    fn drop(&mut self) {
        if let Out::Local { temp, .. } = &self.out {
            let _ = std::fs::remove_file(temp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A local part is written under a temporary name no listing of parts shows, lands
    /// whole at its place on commit, and leaves nothing else; a part dropped uncommitted
    /// leaves no file at all.
    #[tokio::test]
    async fn a_local_part_lands_whole_on_commit_and_nowhere_when_dropped() {
        let d = tempfile::tempdir().unwrap();
        let store = RunStore::open(d.path().to_str().unwrap()).unwrap();
        let mut part = store.part_file("calls/part-0.parquet").unwrap();
        assert!(part.is_local());
        part.write_all(b"PAR1 half").unwrap();
        let dir = d.path().join("calls");
        let names = || -> Vec<String> {
            std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(names().len(), 1);
        assert!(names()[0].ends_with(".tmp"), "{:?}", names());
        assert!(store.list_parts("calls").await.unwrap().is_empty());
        part.write_all(b" and the rest").unwrap();
        part.commit().await.unwrap();
        assert_eq!(names(), ["part-0.parquet"]);
        assert_eq!(
            std::fs::read(dir.join("part-0.parquet")).unwrap(),
            b"PAR1 half and the rest"
        );
        let mut dropped = store.part_file("calls/part-1.parquet").unwrap();
        dropped.write_all(b"never committed").unwrap();
        drop(dropped);
        assert_eq!(names(), ["part-0.parquet"]);
    }

    /// On a store that is not local the part is held in memory and put whole on commit.
    #[tokio::test]
    async fn a_part_elsewhere_is_put_on_commit() {
        let store = RunStore::open("memory://part-file-test").unwrap();
        let mut part = store.part_file("t/part-0.parquet").unwrap();
        assert!(!part.is_local());
        part.write_all(b"bytes").unwrap();
        assert!(store.get("t/part-0.parquet").await.unwrap().is_none());
        part.commit().await.unwrap();
        assert_eq!(
            store.get("t/part-0.parquet").await.unwrap().unwrap(),
            b"bytes"
        );
    }
}
