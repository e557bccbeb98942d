//! The object-store backed run root and its part files.

use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::parquet::arrow::arrow_reader::ArrowReaderMetadata;
// ParquetObjectReader is deprecated in parquet 59 in favour of a hand-written
// AsyncFileReader; it is still the simplest correct reader over object_store.
use datafusion::parquet::arrow::ParquetRecordBatchStreamBuilder;
#[allow(deprecated)]
use datafusion::parquet::arrow::async_reader::ParquetObjectReader;
use datafusion::prelude::SessionContext;
use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt, PutPayload};
use url::Url;

use super::StorageError;
use crate::schema::{Table, check_compatible};

use super::root::*;

/// Rows per Parquet part: large enough for fast scans, small enough that a writer holds
/// only a bounded buffer.
pub const PART_ROWS: usize = 100_000;

/// Rows per row group of a scratch part ([`PartWriter::scratch`]).
pub(super) const SCRATCH_ROW_GROUP_ROWS: usize = 16_384;

/// Rows per committed part of a [`PartWriter`]: [`PART_ROWS`], or `EVALFLOW_PART_ROWS` from
/// the environment (read once; for tests that need many parts, and for tuning).
pub fn part_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        crate::config::env_count("EVALFLOW_PART_ROWS").map_or(PART_ROWS, |n| n as usize)
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
            if std::path::Path::new(path).is_file() {
                return Err(bad(
                    "is a file, not a folder: a run root is a folder (name a new one)".into(),
                ));
            }
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
            super::retry::delete(self.store.as_ref(), &m.location)
                .await
                .map_err(|source| self.store_err(&m.location, source))?;
        }
        Ok(())
    }

    /// Deletes the object `rel`; one that is not there is no error.
    pub async fn delete(&self, rel: &str) -> Result<(), StorageError> {
        let p = self.path(rel);
        super::retry::delete(self.store.as_ref(), &p)
            .await
            .map_err(|source| self.store_err(&p, source))
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
    pub fn store_err(&self, p: &Path, source: object_store::Error) -> StorageError {
        let location = self.location(p);
        match source {
            object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. } => {
                StorageError::Credentials { location, source }
            }
            source => StorageError::Store { location, source },
        }
    }

    /// The file `rel` is on a local root (whose `display` is its absolute path); `None`
    /// for any other store.
    pub(super) fn local_path(&self, rel: &str) -> Option<std::path::PathBuf> {
        (self.base_url.scheme() == "file").then(|| {
            let mut p = std::path::PathBuf::from(&self.display);
            p.extend(rel.split('/').filter(|s| !s.is_empty()));
            p
        })
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

    /// Streams the named columns of one part (those it has, in its order), checking its
    /// schema against `table`: a reader of a few columns does not fetch the others' pages
    /// (a `calls` part's responses are most of its bytes).
    pub async fn read_part_columns(
        &self,
        meta: &ObjectMeta,
        table: Table,
        columns: &[&str],
    ) -> Result<BoxStream<'static, Result<RecordBatch, StorageError>>, StorageError> {
        self.read_projected(meta, Some(table), Some(columns)).await
    }

    /// Streams the record batches of a scratch part (an import's staging), whose schema is
    /// the writer's own, not a table's.
    pub async fn read_scratch(
        &self,
        meta: &ObjectMeta,
    ) -> Result<BoxStream<'static, Result<RecordBatch, StorageError>>, StorageError> {
        self.read_checked(meta, None).await
    }

    async fn read_checked(
        &self,
        meta: &ObjectMeta,
        table: Option<Table>,
    ) -> Result<BoxStream<'static, Result<RecordBatch, StorageError>>, StorageError> {
        self.read_projected(meta, table, None).await
    }

    #[allow(deprecated)]
    async fn read_projected(
        &self,
        meta: &ObjectMeta,
        table: Option<Table>,
        columns: Option<&[&str]>,
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
        let builder = match columns {
            Some(cols) => {
                let mask = datafusion::parquet::arrow::ProjectionMask::columns(
                    builder.parquet_schema(),
                    cols.iter().copied(),
                );
                builder.with_projection(mask)
            }
            None => builder,
        };
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
        self.read_table_columns(rel, table, None).await
    }

    /// [`Self::read_table`] of the named columns only ([`Self::read_part_columns`]), or
    /// of every column.
    pub async fn read_table_columns(
        &self,
        rel: &str,
        table: Table,
        columns: Option<&'static [&'static str]>,
    ) -> Result<BoxStream<'static, Result<RecordBatch, StorageError>>, StorageError> {
        let parts = self.list_parts(rel).await?;
        let this = self.clone();
        let s = futures::stream::iter(parts)
            .then(move |m| {
                let this = this.clone();
                async move { this.read_projected(&m, Some(table), columns).await }
            })
            .try_flatten();
        Ok(s.boxed())
    }
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

    /// The rows its footer records.
    pub fn num_rows(&self) -> u64 {
        self.footer.metadata().file_metadata().num_rows().max(0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::parts::encode_parquet;
    use datafusion::arrow::datatypes::Schema;
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
}
