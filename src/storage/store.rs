//! The object-store backed run root and its part files.

use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::{Schema, SchemaRef};
use datafusion::parquet::arrow::arrow_reader::ArrowReaderMetadata;
// ParquetObjectReader is deprecated in parquet 59 in favour of a hand-written
// AsyncFileReader; it is still the simplest correct reader over object_store.
#[allow(deprecated)]
use datafusion::parquet::arrow::async_reader::ParquetObjectReader;
use datafusion::parquet::arrow::{ArrowWriter, ParquetRecordBatchStreamBuilder};
use datafusion::parquet::basic::Compression;
use datafusion::parquet::file::properties::WriterProperties;
use datafusion::parquet::schema::types::ColumnPath;
use datafusion::prelude::SessionContext;
use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt, PutPayload};
use url::Url;

use super::StorageError;
use crate::schema::{Table, check_compatible};

type ParquetError = datafusion::parquet::errors::ParquetError;

/// Rows per Parquet part: large enough for fast scans, small enough that a writer holds
/// only a bounded buffer.
pub const PART_ROWS: usize = 100_000;

/// Rows per row group of a scratch part ([`PartWriter::scratch`]).
const SCRATCH_ROW_GROUP_ROWS: usize = 16_384;

/// Rows per committed part of a [`PartWriter`]: [`PART_ROWS`], or `EVALFLOW_PART_ROWS` from
/// the environment (read once; for tests that need many parts, and for tuning).
pub fn part_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("EVALFLOW_PART_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or(PART_ROWS)
    })
}

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
        let store = RootUrl::parse(root)?.object_store(root).map_err(bad)?;
        let root_path = Path::from(url.path().trim_matches('/'));
        Ok(Self {
            store,
            base_url,
            root: root_path,
            display: root.to_string(),
        })
    }

    /// Registers the object store of a table URL (`s3://bucket/t.parquet`, `memory://x/t/`)
    /// with `ctx`, the same way run roots are, so `--table` can name any root evalflow can
    /// write. Local paths and `file://` URLs need nothing.
    ///
    /// # Errors
    /// [`StorageError::BadRoot`] for an unusable URL (unknown scheme, a feature not built in,
    /// no credentials).
    pub fn register_url(ctx: &SessionContext, url: &str) -> Result<(), StorageError> {
        if url.contains("://") && !url.starts_with("file://") {
            RunStore::open(url)?.register_with(ctx);
        }
        Ok(())
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
            .map_err(|source| self.store_err(&prefix, source))?;
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
            Err(source) => Err(self.store_err(&p, source)),
        }
    }

    /// Deletes a scratch folder (`_import/`, `_rescore/`) and, on the local store, the
    /// emptied folders that deleting its files leaves behind.
    pub async fn delete_scratch(&self, rel: &str) -> Result<(), StorageError> {
        let deleted = self.delete_dir(rel).await;
        if self.table_url("x").starts_with("file:") {
            let _ = std::fs::remove_dir_all(std::path::Path::new(self.display()).join(rel));
        }
        deleted
    }

    /// Deletes every object under `rel` (used to restart a stage that never committed).
    pub async fn delete_dir(&self, rel: &str) -> Result<(), StorageError> {
        let prefix = self.path(rel);
        let metas: Vec<ObjectMeta> = self
            .store
            .list(Some(&prefix))
            .try_collect()
            .await
            .map_err(|source| self.store_err(&prefix, source))?;
        for m in metas {
            self.store
                .delete(&m.location)
                .await
                .map_err(|source| self.store_err(&m.location, source))?;
        }
        Ok(())
    }

    /// Deletes the object `rel`; one that is not there is no error.
    pub async fn delete(&self, rel: &str) -> Result<(), StorageError> {
        let p = self.path(rel);
        match self.store.delete(&p).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(source) => Err(self.store_err(&p, source)),
        }
    }

    /// Writes `bytes` to `rel` atomically.
    pub async fn put(&self, rel: &str, bytes: Vec<u8>) -> Result<(), StorageError> {
        let p = self.path(rel);
        self.store
            .put(&p, PutPayload::from(bytes))
            .await
            .map_err(|source| self.store_err(&p, source))?;
        Ok(())
    }

    /// Reads a whole small object (the manifest).
    pub async fn get(&self, rel: &str) -> Result<Option<Vec<u8>>, StorageError> {
        let p = self.path(rel);
        match self.store.get(&p).await {
            Ok(r) => Ok(Some(
                r.bytes()
                    .await
                    .map_err(|source| self.store_err(&p, source))?
                    .to_vec(),
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(source) => Err(self.store_err(&p, source)),
        }
    }

    /// An object-store error at `p`: a refused credential is its own, bad-input, error.
    fn store_err(&self, p: &Path, source: object_store::Error) -> StorageError {
        let location = self.location(p);
        match source {
            object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. } => {
                StorageError::Credentials { location, source }
            }
            source => StorageError::Store { location, source },
        }
    }

    /// A human-readable location for messages.
    pub fn location(&self, p: &Path) -> String {
        if self.base_url.scheme() == "file" {
            format!("/{p}")
        } else {
            format!("{}/{p}", self.base_url.as_str().trim_end_matches('/'))
        }
    }

    /// Streams the record batches of one part, checking its schema against `table`.
    pub async fn read_part(
        &self,
        meta: &ObjectMeta,
        table: Table,
    ) -> Result<BoxStream<'static, Result<RecordBatch, StorageError>>, StorageError> {
        self.read_checked(meta, Some(table)).await
    }

    /// Streams the record batches of a scratch part (an import's staging), whose schema is
    /// the writer's own, not a table's.
    pub async fn read_scratch(
        &self,
        meta: &ObjectMeta,
    ) -> Result<BoxStream<'static, Result<RecordBatch, StorageError>>, StorageError> {
        self.read_checked(meta, None).await
    }

    #[allow(deprecated)]
    async fn read_checked(
        &self,
        meta: &ObjectMeta,
        table: Option<Table>,
    ) -> Result<BoxStream<'static, Result<RecordBatch, StorageError>>, StorageError> {
        let location = self.location(&meta.location);
        let reader = ParquetObjectReader::new(self.store.clone(), meta.location.clone())
            .with_file_size(meta.size);
        let builder = ParquetRecordBatchStreamBuilder::new(reader)
            .await
            .map_err(|source| StorageError::CorruptPart {
                location: location.clone(),
                what: "footer".into(),
                source,
            })?;
        if let Some(table) = table {
            check_compatible(table, builder.schema(), &location)?;
        }
        let stream =
            builder
                .with_batch_size(8192)
                .build()
                .map_err(|source| StorageError::CorruptPart {
                    location: location.clone(),
                    what: "footer".into(),
                    source,
                })?;
        // Count rows so a decoding failure names where it happened.
        let mut rows = 0usize;
        Ok(stream
            .map(move |b| match b {
                Ok(b) => {
                    rows += b.num_rows();
                    Ok(b)
                }
                Err(source) => Err(StorageError::CorruptPart {
                    location: location.clone(),
                    what: format!("rows from {}", rows + 1),
                    source,
                }),
            })
            .boxed())
    }

    /// Checks one part's footer schema against `table` without reading its rows: every
    /// table a query registers is checked this way, so a hand-edited part fails with its
    /// file and column instead of a panic deep inside a stage.
    ///
    /// # Errors
    /// [`StorageError::CorruptPart`] when the footer is unreadable, [`StorageError::Schema`]
    /// naming the part and the first column that does not fit.
    pub async fn check_part(&self, meta: &ObjectMeta, table: Table) -> Result<(), StorageError> {
        let f = self.footer(meta).await?;
        check_compatible(table, f.footer.schema(), &self.location(&meta.location))?;
        Ok(())
    }

    /// Reads a part's footer (once, for [`RunStore::may_hold`] to ask part after part).
    #[allow(deprecated)]
    pub async fn footer(&self, meta: &ObjectMeta) -> Result<PartFooter, StorageError> {
        let mut reader = ParquetObjectReader::new(self.store.clone(), meta.location.clone())
            .with_file_size(meta.size);
        let footer = ArrowReaderMetadata::load_async(&mut reader, Default::default())
            .await
            .map_err(|source| StorageError::CorruptPart {
                location: self.location(&meta.location),
                what: "footer".into(),
                source,
            })?;
        Ok(PartFooter {
            meta: meta.clone(),
            footer,
        })
    }

    /// Whether `part` may hold a row whose `column` is one of `values`: false only when
    /// each of its row groups has a bloom filter on the column and every value misses it (a
    /// bloom filter answers "maybe" or "no", never a false "no"). A part written without
    /// filters (by an older evalflow or another tool) may hold anything.
    #[allow(deprecated)]
    pub async fn may_hold(
        &self,
        part: &PartFooter,
        column: &str,
        values: &[&str],
    ) -> Result<bool, StorageError> {
        let md = part.footer.metadata().clone();
        let Some(col) = md
            .file_metadata()
            .schema_descr()
            .columns()
            .iter()
            .position(|c| c.path().string() == column)
        else {
            return Ok(true);
        };
        let reader = ParquetObjectReader::new(self.store.clone(), part.meta.location.clone())
            .with_file_size(part.meta.size);
        let mut b = ParquetRecordBatchStreamBuilder::new_with_metadata(reader, part.footer.clone());
        for rg in 0..md.num_row_groups() {
            let filter = b
                .get_row_group_column_bloom_filter(rg, col)
                .await
                .map_err(|source| StorageError::CorruptPart {
                    location: self.location(&part.meta.location),
                    what: format!("bloom filter of `{column}`"),
                    source,
                })?;
            match filter {
                Some(f) if !values.iter().any(|v| f.check(*v)) => {}
                _ => return Ok(true),
            }
        }
        Ok(false)
    }

    /// The bloom filters on `column` of a part's row groups ([`super::Bloom`]), or `None`
    /// when the column or a row group has none (the part may then hold anything).
    #[allow(deprecated)]
    pub async fn bloom_filters(
        &self,
        part: &PartFooter,
        column: &str,
    ) -> Result<Option<Vec<super::Bloom>>, StorageError> {
        let md = part.footer.metadata().clone();
        let Some(col) = md
            .file_metadata()
            .schema_descr()
            .columns()
            .iter()
            .position(|c| c.path().string() == column)
        else {
            return Ok(None);
        };
        let reader = ParquetObjectReader::new(self.store.clone(), part.meta.location.clone())
            .with_file_size(part.meta.size);
        let mut b = ParquetRecordBatchStreamBuilder::new_with_metadata(reader, part.footer.clone());
        let mut out = Vec::with_capacity(md.num_row_groups());
        for rg in 0..md.num_row_groups() {
            let filter = b
                .get_row_group_column_bloom_filter(rg, col)
                .await
                .map_err(|source| StorageError::CorruptPart {
                    location: self.location(&part.meta.location),
                    what: format!("bloom filter of `{column}`"),
                    source,
                })?;
            match filter {
                Some(f) => out.push(super::Bloom::from_sbbf(&f)),
                None => return Ok(None),
            }
        }
        Ok(Some(out))
    }

    /// One string column of a part, decoded alone (the other columns are not read).
    #[allow(deprecated)]
    pub async fn string_column(
        &self,
        meta: &ObjectMeta,
        column: &str,
    ) -> Result<Vec<datafusion::arrow::array::ArrayRef>, StorageError> {
        use datafusion::parquet::arrow::ProjectionMask;
        let location = self.location(&meta.location);
        let corrupt = |what: &str| {
            let (location, what) = (location.clone(), what.to_string());
            move |source| StorageError::CorruptPart {
                location,
                what,
                source,
            }
        };
        let reader = ParquetObjectReader::new(self.store.clone(), meta.location.clone())
            .with_file_size(meta.size);
        let builder = ParquetRecordBatchStreamBuilder::new(reader)
            .await
            .map_err(corrupt("footer"))?;
        let mask = ProjectionMask::columns(builder.parquet_schema(), [column]);
        let mut stream = builder
            .with_projection(mask)
            .with_batch_size(8192)
            .build()
            .map_err(corrupt("footer"))?;
        let mut out = Vec::new();
        while let Some(b) = stream.next().await {
            let b = b.map_err(corrupt(&format!("column `{column}`")))?;
            let c = b.column_by_name(column).cloned().ok_or_else(|| {
                StorageError::Schema(crate::schema::SchemaError::Mismatch {
                    file: location.clone(),
                    field: column.to_string(),
                    msg: "missing".into(),
                })
            })?;
            out.push(c);
        }
        Ok(out)
    }

    /// The number of rows of a table (0 when it has no part), from its parts' footers.
    pub async fn table_rows(&self, table: &str) -> Result<u64, StorageError> {
        let mut rows = 0;
        for p in self.list_parts(table).await? {
            rows += self.part_rows(&p).await?;
        }
        Ok(rows)
    }

    /// The number of rows of one part, from its footer.
    pub async fn part_rows(&self, meta: &ObjectMeta) -> Result<u64, StorageError> {
        Ok(self.part_rows_and_schema(meta).await?.0)
    }

    /// The number of rows of one part and a fingerprint of its Arrow schema, from its footer.
    pub async fn part_rows_and_schema(
        &self,
        meta: &ObjectMeta,
    ) -> Result<(u64, String), StorageError> {
        let f = self.footer(meta).await?;
        let rows = f.footer.metadata().file_metadata().num_rows().max(0) as u64;
        Ok((rows, format!("{:?}", f.footer.schema().fields())))
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
            scratch: false,
            inflight: Default::default(),
            max_inflight: 0,
            rows_per_part: None,
        }
    }
}

/// A run root (or table) URL, parsed once: which object store it needs and where in it.
///
/// # Behavior
/// A path without a scheme (or `file://`) is local; `memory://NAME/...` is a process-wide
/// in-memory store; `s3://` / `s3a://`, `gs://` and `az://` / `azure://` name a bucket
/// (container) and a prefix. `gs://` and `az://` need the `gcp` / `azure` cargo features;
/// without them the root is refused with a message naming the feature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootUrl {
    Local(String),
    Memory { name: String, prefix: String },
    S3 { bucket: String, prefix: String },
    Gcs { bucket: String, prefix: String },
    Azure { container: String, prefix: String },
}

impl RootUrl {
    /// Parses a root or table location.
    ///
    /// # Errors
    /// [`StorageError::BadRoot`] for an unparseable URL, an unknown scheme or a missing
    /// bucket.
    pub fn parse(root: &str) -> Result<RootUrl, StorageError> {
        let bad = |msg: String| StorageError::BadRoot {
            root: root.to_string(),
            msg,
        };
        if !root.contains("://") || root.starts_with("file://") {
            return Ok(RootUrl::Local(
                root.strip_prefix("file://").unwrap_or(root).to_string(),
            ));
        }
        let url = Url::parse(root).map_err(|e| bad(e.to_string()))?;
        let host = url.host_str().unwrap_or("").to_string();
        let prefix = url.path().trim_matches('/').to_string();
        let scheme = url.scheme();
        if host.is_empty() && scheme != "memory" {
            return Err(bad(format!("no bucket in the `{scheme}://` URL")));
        }
        Ok(match scheme {
            "memory" => RootUrl::Memory { name: host, prefix },
            "s3" | "s3a" => RootUrl::S3 {
                bucket: host,
                prefix,
            },
            "gs" => RootUrl::Gcs {
                bucket: host,
                prefix,
            },
            "az" | "azure" => RootUrl::Azure {
                container: host,
                prefix,
            },
            other => {
                return Err(bad(format!(
                    "unsupported scheme `{other}://` (a local path, memory://, s3://, gs:// or az://)"
                )));
            }
        })
    }

    /// The cargo feature this kind of root needs, if any (`gcp`, `azure`).
    pub fn feature(&self) -> Option<&'static str> {
        match self {
            RootUrl::Gcs { .. } => Some("gcp"),
            RootUrl::Azure { .. } => Some("azure"),
            _ => None,
        }
    }

    /// The object store for a non-local root, configured from the environment.
    fn object_store(&self, root: &str) -> Result<Arc<dyn ObjectStore>, String> {
        match self {
            RootUrl::Local(_) => Ok(Arc::new(object_store::local::LocalFileSystem::new())),
            RootUrl::Memory { name, .. } => Ok(memory_store(name)),
            RootUrl::S3 { .. } => s3_store(root),
            RootUrl::Gcs { .. } => gcs_store(root),
            RootUrl::Azure { .. } => azure_store(root),
        }
    }
}

/// The message for a root whose object store was not built in.
#[cfg(not(all(feature = "gcp", feature = "azure")))]
fn feature_off(scheme: &str, feature: &str) -> String {
    format!(
        "{scheme} roots need evalflow built with the `{feature}` cargo feature \
         (cargo build --features {feature}); this binary was built without it"
    )
}

/// An S3 store from the `AWS_*` environment. Credentials must be given (or signing
/// skipped): with none, object_store's default chain probes the instance-metadata address
/// and stalls on a machine that has none, so that is refused up front.
fn s3_store(root: &str) -> Result<Arc<dyn ObjectStore>, String> {
    let set = |k: &str| std::env::var_os(k).is_some_and(|v| !v.is_empty());
    let skip = std::env::var("AWS_SKIP_SIGNATURE").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    let has_credentials = (set("AWS_ACCESS_KEY_ID") && set("AWS_SECRET_ACCESS_KEY"))
        || set("AWS_WEB_IDENTITY_TOKEN_FILE")
        || set("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        || set("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        || set("AWS_METADATA_ENDPOINT");
    if !has_credentials && !skip {
        return Err(
            "no S3 credentials in the environment: set AWS_ACCESS_KEY_ID and \
                    AWS_SECRET_ACCESS_KEY (or AWS_SKIP_SIGNATURE=true for a public bucket, or \
                    AWS_METADATA_ENDPOINT to use instance credentials)"
                .into(),
        );
    }
    object_store::aws::AmazonS3Builder::from_env()
        .with_url(root)
        .build()
        .map(|s| Arc::new(s) as Arc<dyn ObjectStore>)
        .map_err(|e| e.to_string())
}

#[cfg(feature = "gcp")]
fn gcs_store(root: &str) -> Result<Arc<dyn ObjectStore>, String> {
    object_store::gcp::GoogleCloudStorageBuilder::from_env()
        .with_url(root)
        .build()
        .map(|s| Arc::new(s) as Arc<dyn ObjectStore>)
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "gcp"))]
fn gcs_store(_root: &str) -> Result<Arc<dyn ObjectStore>, String> {
    Err(feature_off("gs://", "gcp"))
}

#[cfg(feature = "azure")]
fn azure_store(root: &str) -> Result<Arc<dyn ObjectStore>, String> {
    object_store::azure::MicrosoftAzureBuilder::from_env()
        .with_url(root)
        .build()
        .map(|s| Arc::new(s) as Arc<dyn ObjectStore>)
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "azure"))]
fn azure_store(_root: &str) -> Result<Arc<dyn ObjectStore>, String> {
    Err(feature_off("az://", "azure"))
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

/// The Parquet writer properties of every file evalflow writes: Snappy, row groups of
/// [`PART_ROWS`] rows, no dictionary for the columns whose values are unique per row
/// ([`UNIQUE_COLUMNS`]), no compression for the hex hashes ([`HASH_COLUMNS`]), and for
/// `cases` a bloom filter on `case_id`.
///
/// The writer tries a dictionary for a column until its page outgrows the limit, then
/// falls back to plain, so a unique column paid the interning of a megabyte of values per
/// row group for nothing; Snappy saved 11% on a hex hash. Encoding a 106k-row calls part
/// of the corpus bench took 70 ms instead of 108 ms (best of 7, one core), for a file 3.5%
/// larger (13.2 MB instead of 12.7).
///
/// Score joins one calls part at a time with `cases`, and asks each part of `cases` whether
/// its filter may hold one of the calls part's case ids (`stages::score::CaseParts`), so a
/// run's calls parts together read `cases` about once rather than once each. A part is
/// skipped only when every id misses its filter, so the false-positive rate must be small
/// against the thousands of ids a calls part names: 1e-6 (a 512 KiB filter per 100k cases,
/// 4% of the file).
pub fn parquet_props(schema: &Schema) -> WriterProperties {
    let mut b = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_max_row_group_row_count(Some(PART_ROWS));
    for c in UNIQUE_COLUMNS {
        b = b.set_column_dictionary_enabled(ColumnPath::from(c), false);
    }
    for c in HASH_COLUMNS {
        b = b.set_column_compression(ColumnPath::from(c), Compression::UNCOMPRESSED);
    }
    let cases = Table::Cases.schema();
    let is_cases = schema.fields().len() == cases.fields().len()
        && schema
            .fields()
            .iter()
            .zip(cases.fields())
            .all(|(a, b)| a.name() == b.name());
    if !is_cases {
        return b.build();
    }
    let key = ColumnPath::from("case_id");
    b.set_column_bloom_filter_enabled(key.clone(), true)
        .set_column_bloom_filter_fpp(key.clone(), 1e-6)
        .set_column_bloom_filter_max_ndv(key, PART_ROWS as u64)
        .build()
}

/// Columns of the run tables whose values are (nearly) unique per row, written without a
/// dictionary (a name a table lacks is ignored).
const UNIQUE_COLUMNS: [&str; 6] = [
    "call_id",
    "response",
    "response_hash",
    "source_id",
    "latency_ms",
    "started_at",
];

/// Columns of unique hex hashes, written without compression (see [`parquet_props`]).
const HASH_COLUMNS: [&str; 2] = ["call_id", "response_hash"];

/// Encodes record batches as one Parquet file in memory.
pub fn encode_parquet(
    schema: &SchemaRef,
    batches: &[RecordBatch],
) -> Result<Vec<u8>, datafusion::parquet::errors::ParquetError> {
    encode_with(schema, batches, parquet_props(schema))
}

fn encode_with(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    props: WriterProperties,
) -> Result<Vec<u8>, datafusion::parquet::errors::ParquetError> {
    let mut w = ArrowWriter::try_new(Vec::new(), schema.clone(), Some(props))?;
    for b in batches {
        w.write(b)?;
    }
    w.into_inner()
}

/// A part's location and footer ([`RunStore::footer`]).
#[derive(Clone)]
pub struct PartFooter {
    meta: ObjectMeta,
    footer: ArrowReaderMetadata,
}

impl PartFooter {
    /// The part's location and size.
    pub fn meta(&self) -> &ObjectMeta {
        &self.meta
    }
}

/// One Parquet part encoded batch by batch as it is produced: the writer holds the open row
/// group's encoded pages, not the batches, so a part costs its compressed size in memory.
/// [`PartEncoder::finish`] gives the file to [`RunStore::put`] (atomic).
struct PartEncoder {
    writer: ArrowWriter<Vec<u8>>,
    rows: usize,
}

impl PartEncoder {
    fn new(schema: &SchemaRef) -> Result<Self, ParquetError> {
        Ok(PartEncoder {
            writer: ArrowWriter::try_new(Vec::new(), schema.clone(), Some(parquet_props(schema)))?,
            rows: 0,
        })
    }

    fn write(&mut self, batch: &RecordBatch) -> Result<(), ParquetError> {
        self.rows += batch.num_rows();
        self.writer.write(batch)
    }

    /// Rows written so far.
    fn rows(&self) -> usize {
        self.rows
    }

    /// The encoded file.
    fn finish(self) -> Result<Vec<u8>, ParquetError> {
        self.writer.into_inner()
    }
}

/// A [`PartEncoder`] that encodes on rayon's pool while its caller goes on (joining and
/// scoring the next batch): one write in flight at a time, so the part keeps its order. An
/// encoder inline in a stage's task would stall every other part that task polls.
pub struct PipelinedEncoder {
    idle: Option<PartEncoder>,
    busy: Option<tokio::sync::oneshot::Receiver<Result<PartEncoder, ParquetError>>>,
}

impl PipelinedEncoder {
    pub fn new(schema: &SchemaRef) -> Result<Self, ParquetError> {
        Ok(PipelinedEncoder {
            idle: Some(PartEncoder::new(schema)?),
            busy: None,
        })
    }

    /// The encoder, once its write in flight (if any) is done.
    async fn ready(&mut self) -> Result<PartEncoder, ParquetError> {
        match self.busy.take() {
            Some(rx) => rx
                .await
                .map_err(|_| ParquetError::General("the encoding task stopped".into()))?,
            None => Ok(self
                .idle
                .take()
                .expect("an encoder is idle or busy until finish")),
        }
    }

    /// Queues `batches` behind the write in flight and returns without waiting for them.
    pub async fn write(&mut self, batches: Vec<RecordBatch>) -> Result<(), ParquetError> {
        let mut encoder = self.ready().await?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        rayon::spawn(move || {
            let done = batches
                .iter()
                .try_for_each(|b| encoder.write(b))
                .map(|()| encoder);
            let _ = tx.send(done);
        });
        self.busy = Some(rx);
        Ok(())
    }

    /// Rows and the encoded file, once every write is done.
    pub async fn finish(mut self) -> Result<(usize, Vec<u8>), ParquetError> {
        let encoder = self.ready().await?;
        let rows = encoder.rows();
        let (tx, rx) = tokio::sync::oneshot::channel();
        rayon::spawn(move || {
            let _ = tx.send(encoder.finish());
        });
        let bytes = rx
            .await
            .map_err(|_| ParquetError::General("the encoding task stopped".into()))??;
        Ok((rows, bytes))
    }
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
    /// Scratch parts (an import's staging) are written without compression or dictionaries:
    /// read once by the next plan, they are not worth the encoding time.
    scratch: bool,
    /// Parts being encoded and put, oldest first (a [`PartWriter::pipelined`] writer).
    inflight:
        std::collections::VecDeque<(String, tokio::task::JoinHandle<Result<(), StorageError>>)>,
    /// How many parts may be in flight at once; 0 encodes each part inside `flush`.
    max_inflight: usize,
    /// Rows per part when not [`part_rows`].
    rows_per_part: Option<usize>,
}

impl Drop for PartWriter {
    /// A writer dropped before `finish` (its stage failed) stops the parts still in flight
    /// from being put, where they have not started to be.
    fn drop(&mut self) {
        for (_, h) in &self.inflight {
            h.abort();
        }
    }
}

impl PartWriter {
    /// Writes scratch parts: plain encoding, no compression.
    pub fn scratch(mut self) -> Self {
        self.scratch = true;
        self
    }

    /// Encodes up to `parts` parts at once on rayon's pool while the caller
    /// goes on buffering the next: for a stage whose single writer would otherwise encode
    /// every part on one core. Parts are named when cut, so the table is the same whatever
    /// `parts` is; they may land out of order, each atomically.
    pub fn pipelined(mut self, parts: usize) -> Self {
        self.max_inflight = parts;
        self
    }

    /// Commits parts of about `rows` rows: for a writer among many buffering at once.
    pub fn with_part_rows(mut self, rows: usize) -> Self {
        self.rows_per_part = Some(rows.max(1));
        self
    }

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
        if self.pending_rows >= self.rows_per_part.unwrap_or_else(part_rows) {
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
        let props = if self.scratch {
            // Small row groups: a reader holds a whole (uncompressed) row group of every
            // column it reads, and an import reads its staging on every core at once.
            WriterProperties::builder()
                .set_compression(Compression::UNCOMPRESSED)
                .set_dictionary_enabled(false)
                .set_max_row_group_row_count(Some(SCRATCH_ROW_GROUP_ROWS))
                .build()
        } else {
            parquet_props(&self.schema)
        };
        let batches = std::mem::take(&mut self.pending);
        self.next_seq += 1;
        self.written_rows += std::mem::take(&mut self.pending_rows);
        self.parts.push(name.clone());
        let (store, schema) = (self.store.clone(), self.schema.clone());
        let encode = move |location: String| {
            encode_with(&schema, &batches, props)
                .map_err(|source| StorageError::Parquet { location, source })
        };
        if self.max_inflight == 0 {
            let bytes = encode(name.clone())?;
            return store.put(&name, bytes).await;
        }
        let location = name.clone();
        // Encoded on rayon's pool (sized by `--threads`): a thread of tokio's blocking
        // pool would be one more malloc arena holding freed buffers.
        let (tx, rx) = tokio::sync::oneshot::channel();
        rayon::spawn(move || {
            let _ = tx.send(encode(location));
        });
        let task = tokio::spawn(async move {
            let bytes = rx.await.map_err(|e| StorageError::Task {
                location: name.clone(),
                msg: e.to_string(),
            })??;
            store.put(&name, bytes).await
        });
        self.inflight
            .push_back((self.parts[self.parts.len() - 1].clone(), task));
        while self.inflight.len() > self.max_inflight {
            self.land_oldest().await?;
        }
        Ok(())
    }

    /// Waits for the oldest part in flight.
    async fn land_oldest(&mut self) -> Result<(), StorageError> {
        let Some((location, task)) = self.inflight.pop_front() else {
            return Ok(());
        };
        task.await.map_err(|e| StorageError::Task {
            location,
            msg: e.to_string(),
        })?
    }

    /// Commits the remainder and returns (rows written, part names).
    pub async fn finish(mut self) -> Result<(usize, Vec<String>), StorageError> {
        self.flush().await?;
        while !self.inflight.is_empty() {
            self.land_oldest().await?;
        }
        Ok((
            std::mem::take(&mut self.written_rows),
            std::mem::take(&mut self.parts),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unique columns are written plain and hex hashes uncompressed; the other columns
    /// keep their dictionary and Snappy.
    #[test]
    fn unique_columns_skip_the_dictionary_and_hashes_skip_compression() {
        use datafusion::arrow::array::{ArrayRef, StringArray};
        use datafusion::parquet::basic::Encoding;
        use datafusion::parquet::file::reader::{FileReader, SerializedFileReader};
        let col = |f: fn(usize) -> String| -> ArrayRef {
            Arc::new(StringArray::from_iter_values((0..5000).map(f)))
        };
        let batch = RecordBatch::try_from_iter(vec![
            ("call_id", col(|i| format!("{:024x}", i * 7919))),
            ("model", col(|i| format!("model-{}", i % 3))),
            ("response", col(|i| format!("answer {i} of a few words"))),
        ])
        .unwrap();
        let bytes = encode_parquet(&batch.schema(), &[batch]).unwrap();
        let reader = SerializedFileReader::new(bytes::Bytes::from(bytes)).unwrap();
        let rg = reader.metadata().row_group(0).clone();
        let dict = |i: usize| {
            rg.column(i)
                .encodings()
                .any(|e| matches!(e, Encoding::RLE_DICTIONARY | Encoding::PLAIN_DICTIONARY))
        };
        let codec = |i: usize| rg.column(i).compression();
        assert!(!dict(0) && codec(0) == Compression::UNCOMPRESSED, "call_id");
        assert!(dict(1) && codec(1) == Compression::SNAPPY, "model");
        assert!(!dict(2) && codec(2) == Compression::SNAPPY, "response");
    }

    /// `cases` parts carry a bloom filter on `case_id`: a part answers "maybe" for its own
    /// ids and "no" for ids it does not hold, while a part written without filters (any
    /// other table, or an older evalflow) answers "maybe" to everything.
    #[tokio::test]
    async fn bloom_filters_tell_which_cases_part_may_hold_an_id() {
        use crate::schema::{Case, cases_batch};
        let store = RunStore::open("memory://bloom/run").unwrap();
        let case = |id: String| Case {
            case_id: id,
            suite: "s".into(),
            test: "t".into(),
            capability: "c".into(),
            test_type: "MFT".into(),
            template_id: "tpl".into(),
            group_id: "g".into(),
            role: "base".into(),
            input: "x".into(),
            expected: None,
            expectation: None,
            tolerance: None,
            perturbation: None,
        };
        let ids = |part: usize| (0..2000).map(move |i| format!("{part}-{i:08x}"));
        for part in 0..2 {
            let cases: Vec<Case> = ids(part).map(case).collect();
            let bytes = encode_parquet(&Table::Cases.schema(), &[cases_batch(&cases)]).unwrap();
            store
                .put(&format!("cases/part-{part}.parquet"), bytes)
                .await
                .unwrap();
        }
        // The same ids as one plain string column: no filter is written for it.
        let plain = Arc::new(Schema::new(vec![datafusion::arrow::datatypes::Field::new(
            "case_id",
            datafusion::arrow::datatypes::DataType::Utf8,
            false,
        )]));
        let col = datafusion::arrow::array::StringArray::from_iter_values(ids(0));
        let batch = RecordBatch::try_new(plain.clone(), vec![Arc::new(col)]).unwrap();
        store
            .put(
                "other/part-0.parquet",
                encode_parquet(&plain, &[batch]).unwrap(),
            )
            .await
            .unwrap();

        let parts = store.list_parts("cases").await.unwrap();
        let (a, b) = (
            store.footer(&parts[0]).await.unwrap(),
            store.footer(&parts[1]).await.unwrap(),
        );
        let theirs: Vec<String> = ids(0).step_by(7).collect();
        let theirs: Vec<&str> = theirs.iter().map(String::as_str).collect();
        assert!(store.may_hold(&a, "case_id", &theirs).await.unwrap());
        assert!(!store.may_hold(&b, "case_id", &theirs).await.unwrap());
        assert!(!store.may_hold(&a, "case_id", &["nowhere"]).await.unwrap());
        assert!(
            store
                .may_hold(&b, "case_id", &["nowhere", "1-00000005"])
                .await
                .unwrap()
        );
        // A column without a filter, or a column the part lacks: anything may be there.
        assert!(store.may_hold(&a, "input", &["nowhere"]).await.unwrap());
        assert!(store.may_hold(&a, "no_such", &["nowhere"]).await.unwrap());
        let other = store.list_parts("other").await.unwrap();
        let other = store.footer(&other[0]).await.unwrap();
        assert!(
            store
                .may_hold(&other, "case_id", &["nowhere"])
                .await
                .unwrap()
        );
    }

    /// A pipelined writer names parts when it cuts them: the same parts, with the same
    /// rows, as a writer that encodes each inside `flush`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pipelined_parts_are_the_inline_parts() {
        use datafusion::arrow::array::{Int64Array, RecordBatch};
        use datafusion::arrow::datatypes::{DataType, Field, Schema};
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]));
        let rows = part_rows();
        let mut listings = Vec::new();
        for (k, inflight) in [0usize, 2].into_iter().enumerate() {
            let store = RunStore::open(&format!("memory://pipelined-{k}/run")).unwrap();
            let mut w = store
                .part_writer("t", schema.clone(), "part")
                .pipelined(inflight);
            for b in 0..5 {
                let start = (b * rows) as i64;
                let xs = Int64Array::from_iter_values(start..start + rows as i64);
                w.write(RecordBatch::try_new(schema.clone(), vec![Arc::new(xs)]).unwrap())
                    .await
                    .unwrap();
            }
            let (written, parts) = w.finish().await.unwrap();
            assert_eq!((written, parts.len()), (5 * rows, 5));
            let mut firsts = Vec::new();
            for m in store.list_parts("t").await.unwrap() {
                let bytes = store
                    .object_store()
                    .get(&m.location)
                    .await
                    .unwrap()
                    .bytes()
                    .await
                    .unwrap();
                let r =
                    datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReader::try_new(
                        bytes, rows,
                    )
                    .unwrap();
                let b = r.into_iter().next().unwrap().unwrap();
                let xs = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                firsts.push((
                    m.location.filename().unwrap().to_string(),
                    xs.value(0),
                    b.num_rows(),
                ));
            }
            listings.push(firsts);
        }
        assert_eq!(listings[0], listings[1]);
        assert_eq!(listings[0][4].1, (4 * rows) as i64);
    }

    /// A pipelined encoder, written in several calls while the caller goes on, gives the file
    /// that encoding the same batches at once gives: same rows, same order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pipelined_encoder_keeps_the_rows_in_order() {
        use datafusion::arrow::array::{Int64Array, StringArray};
        use datafusion::arrow::datatypes::{DataType, Field, Schema};
        use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
        let schema = Arc::new(Schema::new(vec![
            Field::new("x", DataType::Int64, false),
            Field::new("s", DataType::Utf8, true),
        ]));
        let batch = |start: i64, n: i64| {
            let xs = Int64Array::from_iter_values(start..start + n);
            let ss: StringArray = (start..start + n)
                .map(|i| (i % 7 != 0).then(|| format!("row {i}")))
                .collect();
            RecordBatch::try_new(schema.clone(), vec![Arc::new(xs), Arc::new(ss)]).unwrap()
        };
        // 300k rows in writes of uneven sizes: more than one row group.
        let writes: Vec<Vec<RecordBatch>> = (0..30)
            .map(|w| (0..3).map(|b| batch((w * 3 + b) * 3_333, 3_333)).collect())
            .collect();
        let mut enc = PipelinedEncoder::new(&schema).unwrap();
        for w in writes.clone() {
            enc.write(w).await.unwrap();
        }
        let (rows, bytes) = enc.finish().await.unwrap();
        let all: Vec<RecordBatch> = writes.into_iter().flatten().collect();
        assert_eq!(rows, 90 * 3_333);
        let read = |bytes: Vec<u8>| -> Vec<RecordBatch> {
            ParquetRecordBatchReaderBuilder::try_new(bytes::Bytes::from(bytes))
                .unwrap()
                .build()
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap()
        };
        let (got, want) = (read(bytes), read(encode_parquet(&schema, &all).unwrap()));
        let cat =
            |bs: &[RecordBatch]| datafusion::arrow::compute::concat_batches(&schema, bs).unwrap();
        assert_eq!(cat(&got), cat(&want));
        assert_eq!(cat(&got), cat(&all));
    }

    #[test]
    fn root_urls_parse_into_store_and_prefix() {
        let p = |s: &str| RootUrl::parse(s).unwrap();
        assert_eq!(p("runs/r1"), RootUrl::Local("runs/r1".into()));
        assert_eq!(p("file:///tmp/r"), RootUrl::Local("/tmp/r".into()));
        assert_eq!(
            p("memory://t/a/b"),
            RootUrl::Memory {
                name: "t".into(),
                prefix: "a/b".into()
            }
        );
        assert_eq!(
            p("s3://bucket/runs/r1/"),
            RootUrl::S3 {
                bucket: "bucket".into(),
                prefix: "runs/r1".into()
            }
        );
        assert_eq!(
            p("gs://b/x"),
            RootUrl::Gcs {
                bucket: "b".into(),
                prefix: "x".into()
            }
        );
        assert_eq!(p("gs://b/x").feature(), Some("gcp"));
        assert_eq!(
            p("az://c/x/y"),
            RootUrl::Azure {
                container: "c".into(),
                prefix: "x/y".into()
            }
        );
        assert_eq!(p("azure://c").feature(), Some("azure"));
        assert_eq!(p("s3://b").feature(), None);
        for bad in ["ftp://host/x", "s3:///no-bucket", "gs://"] {
            let e = RootUrl::parse(bad).unwrap_err();
            assert!(matches!(e, StorageError::BadRoot { .. }), "{bad}: {e}");
        }
    }

    #[cfg(not(feature = "gcp"))]
    #[test]
    fn gs_root_without_the_feature_names_it() {
        let e = RunStore::open("gs://bucket/run").unwrap_err();
        assert!(e.is_bad_input());
        let msg = e.to_string();
        assert!(
            msg.contains("gs://bucket/run") && msg.contains("`gcp` cargo feature"),
            "{msg}"
        );
    }

    #[cfg(not(feature = "azure"))]
    #[test]
    fn az_root_without_the_feature_names_it() {
        let e = RunStore::open("az://container/run").unwrap_err();
        assert!(e.is_bad_input());
        assert!(e.to_string().contains("`azure` cargo feature"), "{e}");
    }
}
