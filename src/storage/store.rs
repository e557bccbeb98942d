//! The object-store backed run root and its part files.

use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
// ParquetObjectReader is deprecated in parquet 59 in favour of a hand-written
// AsyncFileReader; it is still the simplest correct reader over object_store.
#[allow(deprecated)]
use datafusion::parquet::arrow::async_reader::ParquetObjectReader;
use datafusion::parquet::arrow::{ArrowWriter, ParquetRecordBatchStreamBuilder};
use datafusion::parquet::basic::Compression;
use datafusion::parquet::file::properties::WriterProperties;
use datafusion::prelude::SessionContext;
use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt, PutPayload};
use url::Url;

use super::StorageError;
use crate::schema::{Table, check_compatible};

/// Rows per Parquet part: large enough for fast scans, small enough that a writer holds
/// only a bounded buffer.
pub const PART_ROWS: usize = 100_000;

/// A run root: an object store plus the prefix the run lives under.
#[derive(Debug, Clone)]
pub struct RunStore {
    store: Arc<dyn ObjectStore>,
    /// Base URL the store is registered under in DataFusion (`file:///`, `memory://`, `s3://bucket`).
    base_url: Url,
    /// Prefix of the run inside the store.
    root: Path,
    /// What the user typed, for messages.
    display: String,
}

impl RunStore {
    /// Opens (creating if needed) a run root: a local path, `memory://NAME`, or an object
    /// store URL (`s3://bucket/prefix`, `gs://`, `az://`) configured from the environment.
    ///
    /// # Errors
    /// [`StorageError::BadRoot`] for an unusable path or URL.
    pub fn open(root: &str) -> Result<Self, StorageError> {
        let bad = |msg: String| StorageError::BadRoot {
            root: root.to_string(),
            msg,
        };
        if !root.contains("://") || root.starts_with("file://") {
            let path = root.strip_prefix("file://").unwrap_or(root);
            std::fs::create_dir_all(path).map_err(|e| bad(e.to_string()))?;
            let abs = std::fs::canonicalize(path).map_err(|e| bad(e.to_string()))?;
            let prefix = Path::from_absolute_path(&abs).map_err(|e| bad(e.to_string()))?;
            return Ok(Self {
                store: Arc::new(object_store::local::LocalFileSystem::new()),
                base_url: Url::parse("file:///").unwrap(),
                root: prefix,
                display: abs.display().to_string(),
            });
        }
        let url = Url::parse(root).map_err(|e| bad(e.to_string()))?;
        let base_url = Url::parse(&format!(
            "{}://{}",
            url.scheme(),
            url.host_str().unwrap_or("")
        ))
        .map_err(|e| bad(e.to_string()))?;
        let store: Arc<dyn ObjectStore> = match url.scheme() {
            "memory" => memory_store(url.host_str().unwrap_or("")),
            "s3" | "s3a" => Arc::new(
                object_store::aws::AmazonS3Builder::from_env()
                    .with_url(root)
                    .build()
                    .map_err(|e| bad(e.to_string()))?,
            ),
            other => {
                let opts: Vec<(String, String)> = std::env::vars()
                    .filter(|(k, _)| k.starts_with("GOOGLE_") || k.starts_with("AZURE_"))
                    .map(|(k, v)| (k.to_ascii_lowercase(), v))
                    .collect();
                let (s, _) = object_store::parse_url_opts(&url, opts)
                    .map_err(|e| bad(format!("scheme `{other}`: {e}")))?;
                Arc::from(s)
            }
        };
        let root_path = Path::from(url.path().trim_matches('/'));
        Ok(Self {
            store,
            base_url,
            root: root_path,
            display: root.to_string(),
        })
    }

    /// A run root nested under this one (the judge's own calls live in one).
    pub fn child(&self, rel: &str) -> RunStore {
        RunStore {
            store: self.store.clone(),
            base_url: self.base_url.clone(),
            root: self.path(rel),
            display: format!("{}/{}", self.display.trim_end_matches('/'), rel),
        }
    }

    /// The root as the user named it (an absolute path for local roots).
    pub fn display(&self) -> &str {
        &self.display
    }

    /// The underlying object store.
    pub fn object_store(&self) -> Arc<dyn ObjectStore> {
        self.store.clone()
    }

    /// A path under the run root.
    pub fn path(&self, rel: &str) -> Path {
        let mut p = self.root.clone();
        for part in rel.split('/').filter(|s| !s.is_empty()) {
            p = p.clone().join(part);
        }
        p
    }

    /// The URL of a folder under the run, for DataFusion listing tables.
    pub fn table_url(&self, rel: &str) -> String {
        let base = self.base_url.as_str().trim_end_matches('/');
        let root = self.root.as_ref();
        if root.is_empty() {
            format!("{base}/{rel}/")
        } else {
            format!("{base}/{root}/{rel}/")
        }
    }

    /// Makes this store reachable from `ctx` under its base URL.
    pub fn register_with(&self, ctx: &SessionContext) {
        if self.base_url.scheme() != "file" {
            ctx.register_object_store(&self.base_url, self.store.clone());
        }
    }

    /// Lists the committed Parquet parts under `rel` (recursively), sorted by name.
    pub async fn list_parts(&self, rel: &str) -> Result<Vec<ObjectMeta>, StorageError> {
        let prefix = self.path(rel);
        let mut parts: Vec<ObjectMeta> = self
            .store
            .list(Some(&prefix))
            .try_filter(|m| futures::future::ready(m.location.as_ref().ends_with(".parquet")))
            .try_collect()
            .await
            .map_err(|source| StorageError::Store {
                location: self.location(&prefix),
                source,
            })?;
        parts.sort_by(|a, b| a.location.cmp(&b.location));
        Ok(parts)
    }

    /// Whether a part (or any object) exists at `rel`.
    pub async fn exists(&self, rel: &str) -> Result<bool, StorageError> {
        Ok(self.head(rel).await?.is_some())
    }

    /// The metadata of the object at `rel`, if it exists.
    pub async fn head(&self, rel: &str) -> Result<Option<ObjectMeta>, StorageError> {
        let p = self.path(rel);
        match self.store.head(&p).await {
            Ok(m) => Ok(Some(m)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(source) => Err(StorageError::Store {
                location: self.location(&p),
                source,
            }),
        }
    }

    /// Deletes every object under `rel` (used to restart a stage that never committed).
    pub async fn delete_dir(&self, rel: &str) -> Result<(), StorageError> {
        let prefix = self.path(rel);
        let metas: Vec<ObjectMeta> =
            self.store
                .list(Some(&prefix))
                .try_collect()
                .await
                .map_err(|source| StorageError::Store {
                    location: self.location(&prefix),
                    source,
                })?;
        for m in metas {
            self.store
                .delete(&m.location)
                .await
                .map_err(|source| StorageError::Store {
                    location: self.location(&m.location),
                    source,
                })?;
        }
        Ok(())
    }

    /// Writes `bytes` to `rel` atomically.
    pub async fn put(&self, rel: &str, bytes: Vec<u8>) -> Result<(), StorageError> {
        let p = self.path(rel);
        self.store
            .put(&p, PutPayload::from(bytes))
            .await
            .map_err(|source| StorageError::Store {
                location: self.location(&p),
                source,
            })?;
        Ok(())
    }

    /// Reads a whole small object (the manifest).
    pub async fn get(&self, rel: &str) -> Result<Option<Vec<u8>>, StorageError> {
        let p = self.path(rel);
        match self.store.get(&p).await {
            Ok(r) => Ok(Some(
                r.bytes()
                    .await
                    .map_err(|source| StorageError::Store {
                        location: self.location(&p),
                        source,
                    })?
                    .to_vec(),
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(source) => Err(StorageError::Store {
                location: self.location(&p),
                source,
            }),
        }
    }

    /// A human-readable location for messages.
    pub fn location(&self, p: &Path) -> String {
        if self.base_url.scheme() == "file" {
            format!("/{p}")
        } else {
            format!("{}{}", self.base_url, p)
        }
    }

    /// Streams the record batches of one part, checking its schema against `table`.
    #[allow(deprecated)]
    pub async fn read_part(
        &self,
        meta: &ObjectMeta,
        table: Table,
    ) -> Result<BoxStream<'static, Result<RecordBatch, StorageError>>, StorageError> {
        let location = self.location(&meta.location);
        let reader = ParquetObjectReader::new(self.store.clone(), meta.location.clone())
            .with_file_size(meta.size);
        let builder = ParquetRecordBatchStreamBuilder::new(reader)
            .await
            .map_err(|source| StorageError::Parquet {
                location: location.clone(),
                source,
            })?;
        check_compatible(table, builder.schema(), &location)?;
        let stream =
            builder
                .with_batch_size(8192)
                .build()
                .map_err(|source| StorageError::Parquet {
                    location: location.clone(),
                    source,
                })?;
        Ok(stream
            .map_err(move |source| StorageError::Parquet {
                location: location.clone(),
                source,
            })
            .boxed())
    }

    /// Streams every part of a table folder in name order, one part at a time.
    pub async fn read_table(
        &self,
        rel: &str,
        table: Table,
    ) -> Result<BoxStream<'static, Result<RecordBatch, StorageError>>, StorageError> {
        let parts = self.list_parts(rel).await?;
        let this = self.clone();
        let s = futures::stream::iter(parts)
            .then(move |m| {
                let this = this.clone();
                async move { this.read_part(&m, table).await }
            })
            .try_flatten();
        Ok(s.boxed())
    }

    /// A writer for one table folder whose parts are named `<prefix>-NNNNN.parquet`.
    pub fn part_writer(&self, rel: &str, schema: SchemaRef, prefix: &str) -> PartWriter {
        PartWriter {
            store: self.clone(),
            dir: rel.to_string(),
            prefix: prefix.to_string(),
            schema,
            pending: Vec::new(),
            pending_rows: 0,
            next_seq: 0,
            written_rows: 0,
            parts: Vec::new(),
        }
    }
}

/// Process-wide in-memory stores, so every stage of one process sees the same `memory://NAME`.
fn memory_store(name: &str) -> Arc<dyn ObjectStore> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static STORES: OnceLock<Mutex<HashMap<String, Arc<InMemory>>>> = OnceLock::new();
    let mut map = STORES.get_or_init(Default::default).lock().unwrap();
    map.entry(name.to_string())
        .or_insert_with(|| Arc::new(InMemory::new()))
        .clone()
}

/// Encodes record batches as one Parquet file in memory.
pub fn encode_parquet(
    schema: &SchemaRef,
    batches: &[RecordBatch],
) -> Result<Vec<u8>, datafusion::parquet::errors::ParquetError> {
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_max_row_group_row_count(Some(PART_ROWS))
        .build();
    let mut w = ArrowWriter::try_new(Vec::new(), schema.clone(), Some(props))?;
    for b in batches {
        w.write(b)?;
    }
    w.into_inner()
}

/// Buffers batches and commits them as atomic parts of about [`PART_ROWS`] rows.
pub struct PartWriter {
    store: RunStore,
    dir: String,
    prefix: String,
    schema: SchemaRef,
    pending: Vec<RecordBatch>,
    pending_rows: usize,
    next_seq: usize,
    written_rows: usize,
    parts: Vec<String>,
}

impl PartWriter {
    /// Starts numbering parts at `seq` (used when resuming a folder that has parts).
    pub fn with_start_seq(mut self, seq: usize) -> Self {
        self.next_seq = seq;
        self
    }

    /// Adds a batch; commits a part when enough rows are buffered.
    pub async fn write(&mut self, batch: RecordBatch) -> Result<(), StorageError> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        self.pending_rows += batch.num_rows();
        self.pending.push(batch);
        if self.pending_rows >= PART_ROWS {
            self.flush().await?;
        }
        Ok(())
    }

    /// Commits whatever is buffered as one part.
    pub async fn flush(&mut self) -> Result<(), StorageError> {
        if self.pending_rows == 0 {
            return Ok(());
        }
        let name = format!("{}/{}-{:05}.parquet", self.dir, self.prefix, self.next_seq);
        let bytes = encode_parquet(&self.schema, &self.pending).map_err(|source| {
            StorageError::Parquet {
                location: name.clone(),
                source,
            }
        })?;
        self.store.put(&name, bytes).await?;
        self.next_seq += 1;
        self.written_rows += self.pending_rows;
        self.parts.push(name);
        self.pending.clear();
        self.pending_rows = 0;
        Ok(())
    }

    /// Commits the remainder and returns (rows written, part names).
    pub async fn finish(mut self) -> Result<(usize, Vec<String>), StorageError> {
        self.flush().await?;
        Ok((self.written_rows, self.parts))
    }
}
