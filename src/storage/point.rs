//! Point lookups by key over one table's parts, for the viewer: which row groups may hold a
//! key is told by a bloom filter per row group, kept in memory (the part's own Parquet
//! filter, or one built here from the column for parts written without, at 1% false
//! positives); a lookup reads only those row groups, decoding the key column under a row
//! filter and the other columns only at the matching rows (the page index skips their
//! other pages).
//!
//! Why not DataFusion: `WHERE call_id IN (...)` opens every part's footer and bloom filter
//! on every query (it caches neither), about 25 MB read per lookup over 100 parts, and
//! parts without a filter are scanned whole; a page of answers at 10M took 2 s. Parts are
//! immutable, so what is learnt of one is kept until it disappears from the listing.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use datafusion::arrow::array::{AsArray, BooleanArray, RecordBatch};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::DataType;
use datafusion::parquet::arrow::arrow_reader::{
    ArrowPredicateFn, ArrowReaderMetadata, ArrowReaderOptions, RowFilter,
};
#[allow(deprecated)]
use datafusion::parquet::arrow::async_reader::ParquetObjectReader;
use datafusion::parquet::arrow::{ParquetRecordBatchStreamBuilder, ProjectionMask};
use datafusion::parquet::bloom_filter::Sbbf;
use datafusion::parquet::errors::ParquetError;
use datafusion::parquet::file::metadata::PageIndexPolicy;
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectMeta;

use super::{Bloom, RunStore, StorageError, bloom_hash};

/// False-positive rate of the filters built here for parts written without one.
const BUILT_FPP: f64 = 0.01;
/// Parts read at once, by a lookup or while learning new parts.
const CONCURRENCY: usize = 8;

/// The parts of one folder of a run, indexed on one string column.
pub struct KeyIndex {
    store: RunStore,
    dir: String,
    column: String,
    /// What is known of each part, by location.
    parts: Mutex<HashMap<String, Arc<IndexedPart>>>,
}

struct IndexedPart {
    meta: ObjectMeta,
    footer: ArrowReaderMetadata,
    /// One filter per row group; empty when the part has no such column (it holds no key).
    filters: Vec<Bloom>,
}

impl KeyIndex {
    /// An index of `store`'s folder `dir` on `column` (nothing is read until it is used).
    pub fn new(store: RunStore, dir: &str, column: &str) -> Self {
        KeyIndex {
            store,
            dir: dir.to_string(),
            column: column.to_string(),
            parts: Mutex::new(HashMap::new()),
        }
    }

    /// Bytes held by the filters learnt so far.
    pub fn filter_bytes(&self) -> usize {
        let parts = self.parts.lock().expect("index lock");
        parts
            .values()
            .map(|p| p.filters.iter().map(Bloom::bytes).sum::<usize>())
            .sum()
    }

    /// Learns the parts not yet known (a lookup would, on its first use).
    pub async fn warm(&self) -> Result<(), StorageError> {
        self.refresh().await.map(|_| ())
    }

    /// The folder's parts now, learning the new ones (their footer, page index and
    /// filters) and forgetting those gone (compacted away).
    async fn refresh(&self) -> Result<Vec<Arc<IndexedPart>>, StorageError> {
        let listed = self.store.list_parts(&self.dir).await?;
        let known = self.parts.lock().expect("index lock").clone();
        let new: Vec<ObjectMeta> = listed
            .iter()
            .filter(|m| {
                known
                    .get(m.location.as_ref())
                    .is_none_or(|p| p.meta.size != m.size)
            })
            .cloned()
            .collect();
        let learnt: Vec<IndexedPart> = futures::stream::iter(new)
            .map(|m| self.learn(m))
            .buffer_unordered(CONCURRENCY)
            .try_collect()
            .await?;
        let mut parts = self.parts.lock().expect("index lock");
        for p in learnt {
            parts.insert(p.meta.location.to_string(), Arc::new(p));
        }
        let names: HashSet<&str> = listed.iter().map(|m| m.location.as_ref()).collect();
        parts.retain(|k, _| names.contains(k.as_str()));
        Ok(listed
            .iter()
            .filter_map(|m| parts.get(m.location.as_ref()).cloned())
            .collect())
    }

    #[allow(deprecated)]
    fn reader(&self, meta: &ObjectMeta) -> ParquetObjectReader {
        ParquetObjectReader::new(self.store.object_store(), meta.location.clone())
            .with_file_size(meta.size)
    }

    fn corrupt(&self, meta: &ObjectMeta, what: &str) -> impl Fn(ParquetError) -> StorageError {
        let (location, what) = (self.store.location(&meta.location), what.to_string());
        move |source| StorageError::CorruptPart {
            location: location.clone(),
            what: what.clone(),
            source,
        }
    }

    /// Reads one part's footer with its page index, and its filters on the column.
    async fn learn(&self, meta: ObjectMeta) -> Result<IndexedPart, StorageError> {
        let mut reader = self.reader(&meta);
        let options = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional);
        let footer = ArrowReaderMetadata::load_async(&mut reader, options)
            .await
            .map_err(self.corrupt(&meta, "footer"))?;
        let md = footer.metadata().clone();
        let Some(col) = md
            .file_metadata()
            .schema_descr()
            .columns()
            .iter()
            .position(|c| c.path().string() == self.column)
        else {
            return Ok(IndexedPart {
                meta,
                footer,
                filters: Vec::new(),
            });
        };
        let mut b = ParquetRecordBatchStreamBuilder::new_with_metadata(reader, footer.clone());
        let mut filters = Vec::with_capacity(md.num_row_groups());
        for rg in 0..md.num_row_groups() {
            let what = format!("bloom filter of `{}`", self.column);
            match b
                .get_row_group_column_bloom_filter(rg, col)
                .await
                .map_err(self.corrupt(&meta, &what))?
            {
                Some(f) => filters.push(Bloom::from_sbbf(&f)),
                None => filters.push(self.build_filter(&meta, &footer, rg).await?),
            }
        }
        Ok(IndexedPart {
            meta,
            footer,
            filters,
        })
    }

    /// A filter for a row group written without one: its key column read once.
    async fn build_filter(
        &self,
        meta: &ObjectMeta,
        footer: &ArrowReaderMetadata,
        rg: usize,
    ) -> Result<Bloom, StorageError> {
        let rows = footer.metadata().row_group(rg).num_rows().max(1) as u64;
        let what = format!("column `{}`", self.column);
        let mut sbbf =
            Sbbf::new_with_ndv_fpp(rows, BUILT_FPP).map_err(self.corrupt(meta, &what))?;
        let b =
            ParquetRecordBatchStreamBuilder::new_with_metadata(self.reader(meta), footer.clone());
        let mask = ProjectionMask::columns(b.parquet_schema(), [self.column.as_str()]);
        let mut stream = b
            .with_row_groups(vec![rg])
            .with_projection(mask)
            .with_batch_size(16_384)
            .build()
            .map_err(self.corrupt(meta, &what))?;
        while let Some(batch) = stream.next().await {
            let batch = batch.map_err(self.corrupt(meta, &what))?;
            let col = cast(batch.column(0), &DataType::Utf8)
                .map_err(|e| self.corrupt(meta, &what)(ParquetError::ArrowError(e.to_string())))?;
            for v in col.as_string::<i32>().iter().flatten() {
                sbbf.insert(v);
            }
        }
        Ok(Bloom::from_sbbf(&sbbf))
    }

    /// The rows whose key is one of `values`, with `columns` (all when `None`; a column a
    /// part lacks is left out of its batches). Rows come in no particular order.
    ///
    /// # Errors
    /// [`StorageError::CorruptPart`] naming a part that cannot be read.
    pub async fn get(
        &self,
        values: &[String],
        columns: Option<&[&str]>,
    ) -> Result<Vec<RecordBatch>, StorageError> {
        if values.is_empty() {
            return Ok(Vec::new());
        }
        let hashed: Vec<(u64, &String)> = values
            .iter()
            .map(|v| (bloom_hash(v.as_bytes()), v))
            .collect();
        let mut reads = Vec::new();
        for part in self.refresh().await? {
            let mut rgs = Vec::new();
            let mut wanted: HashSet<String> = HashSet::new();
            for (rg, f) in part.filters.iter().enumerate() {
                let mut hit = false;
                for (h, v) in &hashed {
                    if f.check_hash(*h) {
                        wanted.insert((*v).clone());
                        hit = true;
                    }
                }
                if hit {
                    rgs.push(rg);
                }
            }
            if !rgs.is_empty() {
                reads.push((part, rgs, wanted));
            }
        }
        let batches: Vec<Vec<RecordBatch>> = futures::stream::iter(reads)
            .map(|(part, rgs, wanted)| self.read(part, rgs, wanted, columns))
            .buffer_unordered(CONCURRENCY)
            .try_collect()
            .await?;
        Ok(batches.into_iter().flatten().collect())
    }

    /// The rows of some row groups of one part whose key is in `wanted`.
    async fn read(
        &self,
        part: Arc<IndexedPart>,
        rgs: Vec<usize>,
        wanted: HashSet<String>,
        columns: Option<&[&str]>,
    ) -> Result<Vec<RecordBatch>, StorageError> {
        let what = format!("rows by `{}`", self.column);
        let corrupt = self.corrupt(&part.meta, &what);
        let b = ParquetRecordBatchStreamBuilder::new_with_metadata(
            self.reader(&part.meta),
            part.footer.clone(),
        );
        let schema = b.parquet_schema();
        let key = ProjectionMask::columns(schema, [self.column.as_str()]);
        let projection = match columns {
            Some(c) => ProjectionMask::columns(schema, c.iter().copied()),
            None => ProjectionMask::all(),
        };
        let predicate = ArrowPredicateFn::new(key, move |batch: RecordBatch| {
            let col = cast(batch.column(0), &DataType::Utf8)?;
            Ok(col
                .as_string::<i32>()
                .iter()
                .map(|v| Some(v.is_some_and(|v| wanted.contains(v))))
                .collect::<BooleanArray>())
        });
        let stream = b
            .with_row_groups(rgs)
            .with_projection(projection)
            .with_row_filter(RowFilter::new(vec![Box::new(predicate)]))
            .with_batch_size(1024)
            .build()
            .map_err(&corrupt)?;
        stream.try_collect().await.map_err(corrupt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{ArrayRef, Int64Array, StringArray};
    use datafusion::arrow::datatypes::{Field, Schema};

    fn batch(ids: &[String], offset: i64) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("call_id", DataType::Utf8, false),
            Field::new("n", DataType::Int64, false),
        ]));
        let n: Int64Array = (0..ids.len() as i64).map(|i| i + offset).collect();
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringArray::from(ids.to_vec())) as ArrayRef,
                Arc::new(n),
            ],
        )
        .unwrap()
    }

    /// A lookup finds every row of its keys, in parts written with a Parquet bloom filter
    /// and in parts written without one (whose filter is built from the column), and
    /// nothing else; a part added later is found, a part removed is forgotten.
    #[tokio::test]
    async fn finds_exactly_the_rows_of_its_keys_with_or_without_written_filters() {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path().to_str().unwrap()).unwrap();
        let ids = |p: usize| -> Vec<String> { (0..3000).map(|i| format!("{p}-{i:05}")).collect() };
        // Part 0 with a Parquet bloom filter on the key, part 1 without.
        let write = |b: RecordBatch, bloom: bool| {
            let props = datafusion::parquet::file::properties::WriterProperties::builder()
                .set_bloom_filter_enabled(bloom)
                .set_max_row_group_row_count(Some(1000))
                .build();
            let mut buf = Vec::new();
            let mut w =
                datafusion::parquet::arrow::ArrowWriter::try_new(&mut buf, b.schema(), Some(props))
                    .unwrap();
            w.write(&b).unwrap();
            w.close().unwrap();
            buf
        };
        let with = write(batch(&ids(0), 0), true);
        let without = write(batch(&ids(1), 10_000), false);
        store.put("calls/part-0.parquet", with).await.unwrap();
        store.put("calls/part-1.parquet", without).await.unwrap();
        let index = KeyIndex::new(store.clone(), "calls", "call_id");
        let want: Vec<String> = vec!["0-00007".into(), "1-02999".into(), "nowhere".into()];
        let got = index.get(&want, Some(&["n"])).await.unwrap();
        let mut n: Vec<i64> = got
            .iter()
            .flat_map(|b| {
                b.column(0)
                    .as_primitive::<datafusion::arrow::datatypes::Int64Type>()
                    .values()
                    .to_vec()
            })
            .collect();
        n.sort();
        assert_eq!(n, vec![7, 12_999]);
        assert!(index.filter_bytes() > 0);
        // Removed, then added: the listing decides.
        store.delete("calls/part-0.parquet").await.unwrap();
        let got = index.get(&want, None).await.unwrap();
        assert_eq!(got.iter().map(RecordBatch::num_rows).sum::<usize>(), 1);
        assert_eq!(got[0].num_columns(), 2);
    }
}
