//! Point lookups by key over one table's parts, for the viewer: a bloom filter per segment
//! of 4,096 rows of each part, built from the key column when the part is first seen and kept
//! in memory (16 bits a row, about 0.1% false positives: 20 MB for 10M keys), says which
//! segments may hold a key; a lookup reads only those, the key column under a row filter and
//! the other columns at the matching rows (the page index skips every other page).
//!
//! Why not DataFusion: `WHERE call_id IN (...)` opens every part's footer and bloom filter
//! on every query (it caches neither), about 25 MB read per lookup over 100 parts, and
//! parts without a filter are scanned whole; a page of answers at 10M took 2 s. Why not the
//! parts' own filters: they cover a row group (100k rows), so a hit still decodes 100k keys;
//! a segment is 25 times smaller. Parts are immutable, so what is learnt of one is kept until
//! it disappears from the listing.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use datafusion::arrow::array::{Array, AsArray, BooleanArray, RecordBatch};
use datafusion::arrow::buffer::BooleanBuffer;
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::DataType;
use datafusion::parquet::arrow::arrow_reader::{
    ArrowPredicateFn, ArrowReaderMetadata, ArrowReaderOptions, RowFilter, RowSelection,
    RowSelectionPolicy, RowSelector,
};
#[allow(deprecated)]
use datafusion::parquet::arrow::async_reader::ParquetObjectReader;
use datafusion::parquet::arrow::{ParquetRecordBatchStreamBuilder, ProjectionMask};
use datafusion::parquet::errors::ParquetError;
use datafusion::parquet::file::metadata::PageIndexPolicy;
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectMeta;

use super::{Bloom, RunStore, StorageError, bloom_hash};

/// Rows a filter covers.
const SEGMENT_ROWS: usize = 4096;
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
    /// The segments of each row group, in order; none when the part has no such column (it
    /// holds no key).
    segments: Vec<Segment>,
}

/// The next `rows` rows of row group `rg` (its segments are in order), and a filter of
/// their keys.
struct Segment {
    rg: usize,
    rows: usize,
    filter: Bloom,
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
            .map(|p| p.segments.iter().map(|s| s.filter.bytes()).sum::<usize>())
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

    /// Reads one part's footer with its page index, and its key column once, building
    /// the filters of its segments.
    async fn learn(&self, meta: ObjectMeta) -> Result<IndexedPart, StorageError> {
        let mut reader = self.reader(&meta);
        let options = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional);
        let footer = ArrowReaderMetadata::load_async(&mut reader, options)
            .await
            .map_err(self.corrupt(&meta, "footer"))?;
        let md = footer.metadata().clone();
        let mut segments = Vec::new();
        let has_column = md
            .file_metadata()
            .schema_descr()
            .columns()
            .iter()
            .any(|c| c.path().string() == self.column);
        if !has_column {
            return Ok(IndexedPart {
                meta,
                footer,
                segments,
            });
        }
        let what = format!("column `{}`", self.column);
        let b = ParquetRecordBatchStreamBuilder::new_with_metadata(reader, footer.clone());
        let mask = ProjectionMask::columns(b.parquet_schema(), [self.column.as_str()]);
        let mut stream = b
            .with_projection(mask)
            .with_batch_size(SEGMENT_ROWS)
            .build()
            .map_err(self.corrupt(&meta, &what))?;
        // Batches never span row groups; `at` is the row within the current one.
        let (mut rg, mut at) = (0usize, 0usize);
        while let Some(batch) = stream.next().await {
            let batch = batch.map_err(self.corrupt(&meta, &what))?;
            while rg < md.num_row_groups() && at >= md.row_group(rg).num_rows() as usize {
                (rg, at) = (rg + 1, 0);
            }
            let col = cast(batch.column(0), &DataType::Utf8)
                .map_err(|e| self.corrupt(&meta, &what)(ParquetError::ArrowError(e.to_string())))?;
            let keys = col.as_string::<i32>();
            let mut filter = Bloom::for_values(keys.len());
            for k in keys.iter().flatten() {
                filter.insert_hash(bloom_hash(k.as_bytes()));
            }
            segments.push(Segment {
                rg,
                rows: keys.len(),
                filter,
            });
            at += keys.len();
        }
        Ok(IndexedPart {
            meta,
            footer,
            segments,
        })
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
            let mut wanted: Vec<String> = Vec::new();
            let hits: Vec<bool> = part
                .segments
                .iter()
                .map(|seg| {
                    let mut hit = false;
                    for (h, v) in &hashed {
                        if seg.filter.check_hash(*h) {
                            hit = true;
                            if !wanted.contains(v) {
                                wanted.push((*v).clone());
                            }
                        }
                    }
                    hit
                })
                .collect();
            if hits.iter().any(|h| *h) {
                wanted.sort();
                reads.push((part, hits, wanted));
            }
        }
        let batches: Vec<Vec<RecordBatch>> = futures::stream::iter(reads)
            .map(|(part, hits, wanted)| self.read(part, hits, wanted, columns))
            .buffer_unordered(CONCURRENCY)
            .try_collect()
            .await?;
        Ok(batches.into_iter().flatten().collect())
    }

    /// The rows of one part's segments marked in `hits` whose key is in `wanted` (sorted).
    async fn read(
        &self,
        part: Arc<IndexedPart>,
        hits: Vec<bool>,
        wanted: Vec<String>,
        columns: Option<&[&str]>,
    ) -> Result<Vec<RecordBatch>, StorageError> {
        let what = format!("rows by `{}`", self.column);
        let corrupt = self.corrupt(&part.meta, &what);
        // The row groups with a hit, and within them (counted across them, in order) the
        // segments to read.
        let mut rgs: Vec<usize> = Vec::new();
        for (seg, hit) in part.segments.iter().zip(&hits) {
            if *hit && rgs.last() != Some(&seg.rg) {
                rgs.push(seg.rg);
            }
        }
        let selectors: Vec<RowSelector> = part
            .segments
            .iter()
            .zip(&hits)
            .filter(|(seg, _)| rgs.contains(&seg.rg))
            .map(|(seg, hit)| match hit {
                true => RowSelector::select(seg.rows),
                false => RowSelector::skip(seg.rows),
            })
            .collect();
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
            let keys = col.as_string::<i32>();
            let found = BooleanBuffer::collect_bool(keys.len(), |i| {
                keys.is_valid(i)
                    && wanted
                        .binary_search_by(|w| w.as_str().cmp(keys.value(i)))
                        .is_ok()
            });
            Ok(BooleanArray::new(found, None))
        });
        let stream = b
            .with_row_groups(rgs)
            .with_row_selection(RowSelection::from(selectors))
            .with_row_selection_policy(RowSelectionPolicy::Selectors)
            .with_projection(projection)
            .with_row_filter(RowFilter::new(vec![Box::new(predicate)]))
            .with_batch_size(SEGMENT_ROWS)
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

    /// A lookup finds every row of its keys and nothing else, in parts of several row groups
    /// (of several segments each, the last one short), written with or without a Parquet
    /// bloom filter; a part removed is forgotten.
    #[tokio::test]
    async fn finds_exactly_the_rows_of_its_keys_with_or_without_written_filters() {
        let dir = tempfile::tempdir().unwrap();
        let store = RunStore::open(dir.path().to_str().unwrap()).unwrap();
        let ids =
            |p: usize| -> Vec<String> { (0..25_000).map(|i| format!("{p}-{i:05}")).collect() };
        // Part 0 with a Parquet bloom filter on the key, part 1 without.
        let write = |b: RecordBatch, bloom: bool| {
            let props = datafusion::parquet::file::properties::WriterProperties::builder()
                .set_bloom_filter_enabled(bloom)
                .set_max_row_group_row_count(Some(10_000))
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
        // Keys at the first row, at a segment's edges, in the short last segment of a row
        // group (rows 8,192..10,000) and of the part.
        let want: Vec<String> = [
            "0-00000", "0-04095", "0-04096", "0-09999", "1-10000", "1-24999", "nowhere",
        ]
        .map(String::from)
        .to_vec();
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
        assert_eq!(n, vec![0, 4095, 4096, 9999, 20_000, 34_999]);
        assert!(index.filter_bytes() > 0);
        // Removed, then added: the listing decides.
        store.delete("calls/part-0.parquet").await.unwrap();
        let got = index.get(&want, None).await.unwrap();
        assert_eq!(got.iter().map(RecordBatch::num_rows).sum::<usize>(), 2);
        assert_eq!(got[0].num_columns(), 2);
    }
}
