//! Sample indices for records that name none, in memory bounded by a bucket of cases, with
//! no sort of the answers.
//!
//! A record without `sample_idx` takes the number of earlier records of its (case, model):
//! an order statistic over the whole corpus. The SQL way (`row_number()` over the staged
//! records partitioned by case and model) sorts, and spills, every answer's text: on a
//! corpus of 1M records repeated 50 times it was most of an import's 7.4-8.1 s. Here:
//!
//! 1. While records stream in, each staged record's narrow keys (`seq`, case, model,
//!    fingerprint, file) go to one of [`BUCKETS`] scratch tables by the first hex digit of
//!    its case id ([`NarrowWriter`]); the answers go to the staging table in corpus order as
//!    before.
//! 2. [`number_buckets`] reads one bucket at a time, in `seq` order, and numbers its
//!    records with a map of that bucket's (case, model) pairs only, about 1/16 of the keys:
//!    the map's memory is that of a bucket, not of the corpus. A record of a later file
//!    that copies one of an earlier file (the k-th copy of a fingerprint within its file
//!    when an earlier file has k of them, the SQL plan's rule) gets no number and is
//!    dropped. It writes (`seq`, `sample_idx`) per bucket, still in `seq` order.
//! 3. [`SampleMerge`] merges the 16 numbered buckets by `seq` (a heap of 16 heads), so the
//!    staging table is read once, in corpus order, and each batch gets its column of sample
//!    indices: the calls keep the corpus order, and a calls part's cases stay together for
//!    score's join.
//!
//! Written here rather than as a plan: DataFusion has no streaming "number by key within
//! a hash partition" operator, and its window sorts the whole input per partition.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, Int32Array, Int32Builder, RecordBatch, UInt64Builder,
};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, UInt32Type, UInt64Type};
use futures::StreamExt;
use futures::stream::BoxStream;

use crate::storage::{PartWriter, RunStore, StorageError};

/// Errors of the numbering: storage, or a batch not of the shape the sink wrote.
#[derive(Debug, thiserror::Error)]
pub enum NumberingError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("numbering samples: {0}")]
    Shape(String),
}

/// Buckets of case ids: a bucket's map holds about 1/16 of the (case, model) pairs.
pub const BUCKETS: usize = 16;

/// Rows per part of a bucket's narrow writer (16 writers buffer about 16 MB in all).
const PART_ROWS: usize = 16_384;

/// Narrow keys of the staged records, by bucket.
pub const NARROW: &str = "_import/narrow";
/// (`seq`, `sample_idx`) of the staged records, by bucket.
pub const NUMBERED: &str = "_import/numbered";

/// The narrow keys of a staged record.
fn narrow_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::UInt64, false),
        Field::new("case_id", DataType::Utf8, false),
        Field::new("model", DataType::Utf8, false),
        Field::new("fp", DataType::Utf8, false),
        Field::new("file_idx", DataType::UInt32, false),
    ]))
}

/// A staged record's sample index; NULL when it is dropped as a copy of an earlier file's.
fn numbered_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::UInt64, false),
        Field::new("sample_idx", DataType::Int32, true),
    ]))
}

/// The bucket of a case id: its first hex digit.
fn bucket(case_id: &str) -> usize {
    case_id
        .chars()
        .next()
        .and_then(|c| c.to_digit(16))
        .unwrap_or(0) as usize
}

/// A 96-bit hex digest (a case id or a fingerprint) as an integer: exact, and a fifth of a
/// `String`'s memory in a map.
fn digest(hex: &str) -> Result<u128, NumberingError> {
    u128::from_str_radix(hex, 16)
        .map_err(|_| NumberingError::Shape(format!("`{hex}` is not a digest")))
}

/// Writes the narrow keys of staged batches into their buckets.
pub struct NarrowWriter {
    writers: Vec<PartWriter>,
}

impl NarrowWriter {
    pub fn new(store: &RunStore) -> Self {
        NarrowWriter {
            writers: (0..BUCKETS)
                .map(|b| {
                    store
                        .part_writer(NARROW, narrow_schema(), &format!("stage-b{b:x}"))
                        .scratch()
                        .with_part_rows(PART_ROWS)
                })
                .collect(),
        }
    }

    /// Splits a staging batch's keys by bucket, rows in order.
    pub async fn write(&mut self, staged: &RecordBatch) -> Result<(), NumberingError> {
        let col = |n: &str| -> Result<ArrayRef, NumberingError> {
            staged
                .column_by_name(n)
                .cloned()
                .ok_or_else(|| NumberingError::Shape(format!("staging batch without `{n}`")))
        };
        let narrow = RecordBatch::try_new(
            narrow_schema(),
            vec![
                col("seq")?,
                col("case_id")?,
                col("model")?,
                col("fp")?,
                col("file_idx")?,
            ],
        )
        .map_err(|e| NumberingError::Shape(format!("narrow keys: {e}")))?;
        let cases = narrow.column(1).as_string::<i32>();
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); BUCKETS];
        for (i, c) in cases.iter().enumerate() {
            rows[bucket(c.unwrap_or(""))].push(i as u32);
        }
        for (b, r) in rows.into_iter().enumerate() {
            if r.is_empty() {
                continue;
            }
            let taken = datafusion::arrow::compute::take_record_batch(
                &narrow,
                &datafusion::arrow::array::UInt32Array::from(r),
            )
            .map_err(|e| NumberingError::Shape(format!("narrow keys: {e}")))?;
            self.writers[b].write(taken).await?;
        }
        Ok(())
    }

    pub async fn finish(self) -> Result<(), NumberingError> {
        for w in self.writers {
            w.finish().await?;
        }
        Ok(())
    }
}

/// The parts of one bucket's folder (`stage-b<digit>-NNNNN`), in write order.
async fn bucket_parts(
    store: &RunStore,
    dir: &str,
    b: usize,
) -> Result<Vec<object_store::ObjectMeta>, StorageError> {
    let prefix = format!("stage-b{b:x}-");
    let mut parts: Vec<_> = store
        .list_parts(dir)
        .await?
        .into_iter()
        .filter(|p| {
            p.location
                .filename()
                .is_some_and(|f| f.starts_with(&prefix))
        })
        .collect();
    parts.sort_by(|x, y| x.location.cmp(&y.location));
    Ok(parts)
}

/// Every part of a bucket as one stream of batches, in order.
async fn bucket_stream(
    store: &RunStore,
    dir: &str,
    b: usize,
) -> Result<BoxStream<'static, Result<RecordBatch, StorageError>>, StorageError> {
    let parts = bucket_parts(store, dir, b).await?;
    let store = store.clone();
    Ok(futures::stream::iter(parts)
        .then(move |m| {
            let store = store.clone();
            async move { store.read_scratch(&m).await }
        })
        .try_flatten()
        .boxed())
}

use futures::TryStreamExt;

/// Numbers each bucket's records in `seq` order (see the module documentation). With
/// `drop_copies`, a record of a later file whose fingerprint an earlier file has as many
/// times as this record's copy index gets no number (the caller checked that files come
/// in order). Returns the records dropped.
pub async fn number_buckets(store: &RunStore, drop_copies: bool) -> Result<u64, NumberingError> {
    let mut dropped = 0u64;
    for b in 0..BUCKETS {
        let mut next: HashMap<(u128, u32), i32> = HashMap::new();
        let mut models: HashMap<String, u32> = HashMap::new();
        // Per fingerprint: its current file, its copies there, the most of an earlier file.
        let mut copies: HashMap<u128, (u32, u32, u32)> = HashMap::new();
        let mut out = store
            .part_writer(NUMBERED, numbered_schema(), &format!("stage-b{b:x}"))
            .scratch()
            .with_part_rows(1 << 20);
        let mut s = bucket_stream(store, NARROW, b).await?;
        while let Some(batch) = s.next().await {
            let batch = batch?;
            let seq = batch.column(0).as_primitive::<UInt64Type>();
            let case = batch.column(1).as_string::<i32>();
            let model = batch.column(2).as_string::<i32>();
            let fp = batch.column(3).as_string::<i32>();
            let file = batch.column(4).as_primitive::<UInt32Type>();
            let mut seqs = UInt64Builder::with_capacity(batch.num_rows());
            let mut samples = Int32Builder::with_capacity(batch.num_rows());
            for i in 0..batch.num_rows() {
                let keep = !drop_copies || {
                    let f = file.value(i);
                    let st = copies.entry(digest(fp.value(i))?).or_insert((f, 0, 0));
                    if st.0 != f {
                        *st = (f, 0, st.1.max(st.2));
                    }
                    st.1 += 1;
                    st.1 > st.2
                };
                seqs.append_value(seq.value(i));
                if !keep {
                    samples.append_null();
                    dropped += 1;
                    continue;
                }
                let m = match models.get(model.value(i)) {
                    Some(m) => *m,
                    None => {
                        let m = models.len() as u32;
                        models.insert(model.value(i).to_string(), m);
                        m
                    }
                };
                let n = next.entry((digest(case.value(i))?, m)).or_insert(0);
                samples.append_value(*n);
                *n += 1;
            }
            let numbered = RecordBatch::try_new(
                numbered_schema(),
                vec![Arc::new(seqs.finish()), Arc::new(samples.finish())],
            )
            .map_err(|e| NumberingError::Shape(format!("numbered samples: {e}")))?;
            out.write(numbered).await?;
        }
        out.finish().await?;
    }
    Ok(dropped)
}

/// The numbered buckets merged by `seq`: the sample indices of the staged records in
/// corpus order.
pub struct SampleMerge {
    streams: Vec<BoxStream<'static, Result<RecordBatch, StorageError>>>,
    /// Each bucket's current batch and its next row.
    heads: Vec<Option<(RecordBatch, usize)>>,
    /// (next `seq`, bucket) of every bucket with rows left.
    heap: BinaryHeap<Reverse<(u64, usize)>>,
}

impl SampleMerge {
    pub async fn open(store: &RunStore) -> Result<Self, NumberingError> {
        let mut m = SampleMerge {
            streams: Vec::with_capacity(BUCKETS),
            heads: vec![None; BUCKETS],
            heap: BinaryHeap::new(),
        };
        for b in 0..BUCKETS {
            m.streams.push(bucket_stream(store, NUMBERED, b).await?);
            m.advance(b).await?;
        }
        Ok(m)
    }

    /// Loads bucket `b`'s next batch when its current one is used up, and puts its next
    /// `seq` on the heap.
    async fn advance(&mut self, b: usize) -> Result<(), NumberingError> {
        let used_up = match &self.heads[b] {
            Some((batch, i)) => *i >= batch.num_rows(),
            None => true,
        };
        if used_up {
            self.heads[b] = None;
            while let Some(batch) = self.streams[b].next().await {
                let batch = batch?;
                if batch.num_rows() > 0 {
                    self.heads[b] = Some((batch, 0));
                    break;
                }
            }
        }
        if let Some((batch, i)) = &self.heads[b] {
            let seq = batch.column(0).as_primitive::<UInt64Type>().value(*i);
            self.heap.push(Reverse((seq, b)));
        }
        Ok(())
    }

    /// The sample indices of the staging rows with these `seq`s (ascending, every staged
    /// record's once): NULL for a record dropped as a copy.
    pub async fn take(&mut self, seqs: &[u64]) -> Result<Int32Array, NumberingError> {
        let mut out = Int32Builder::with_capacity(seqs.len());
        for &want in seqs {
            let Some(Reverse((seq, b))) = self.heap.pop() else {
                return Err(NumberingError::Shape(format!(
                    "numbering samples: no number for record {want}"
                )));
            };
            if seq != want {
                return Err(NumberingError::Shape(format!(
                    "numbering samples: record {want} met the number of record {seq}"
                )));
            }
            let (batch, i) = self.heads[b]
                .as_mut()
                .expect("a bucket on the heap has a head");
            let s = batch
                .column(1)
                .as_primitive::<datafusion::arrow::datatypes::Int32Type>();
            out.append_option(s.is_valid(*i).then(|| s.value(*i)));
            *i += 1;
            self.advance(b).await?;
        }
        Ok(out.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn staged(rows: &[(u64, &str, &str, &str, u32)]) -> RecordBatch {
        use datafusion::arrow::array::{StringArray, UInt32Array, UInt64Array};
        RecordBatch::try_new(
            narrow_schema(),
            vec![
                Arc::new(UInt64Array::from_iter_values(rows.iter().map(|r| r.0))),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.1))),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.2))),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.3))),
                Arc::new(UInt32Array::from_iter_values(rows.iter().map(|r| r.4))),
            ],
        )
        .unwrap()
    }

    async fn numbers(rows: &[(u64, &str, &str, &str, u32)], drop_copies: bool) -> Vec<Option<i32>> {
        static RUN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let k = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let store = RunStore::open(&format!("memory://numbering-{k}")).unwrap();
        let mut w = NarrowWriter::new(&store);
        w.write(&staged(rows)).await.unwrap();
        w.finish().await.unwrap();
        number_buckets(&store, drop_copies).await.unwrap();
        let mut m = SampleMerge::open(&store).await.unwrap();
        let seqs: Vec<u64> = rows.iter().map(|r| r.0).collect();
        let got = m.take(&seqs).await.unwrap();
        assert!(m.take(&[999]).await.is_err(), "every number was taken");
        got.iter().collect()
    }

    /// Samples count the earlier records of the same case and model, in corpus order,
    /// across buckets (case ids starting `a` and `0` sit in different buckets).
    #[tokio::test]
    async fn samples_number_repeats_of_a_case_and_model_in_corpus_order() {
        let (a, z) = ("a00000000000000000000001", "000000000000000000000002");
        let rows = [
            (0, a, "m1", "000000000000000000000011", 0),
            (1, z, "m1", "000000000000000000000012", 0),
            (2, a, "m2", "000000000000000000000013", 0),
            (3, a, "m1", "000000000000000000000011", 0),
            (4, z, "m1", "000000000000000000000014", 0),
            (5, a, "m1", "000000000000000000000015", 0),
        ];
        let got = numbers(&rows, false).await;
        assert_eq!(got, [0, 0, 0, 1, 1, 2].map(Some).to_vec());
    }

    /// A later file's k-th copy of a fingerprint is dropped when an earlier file has k of
    /// them; copies beyond an earlier file's count are kept and numbered after.
    #[tokio::test]
    async fn a_later_files_copies_are_dropped_up_to_the_earlier_files_count() {
        let a = "a00000000000000000000001";
        let (f1, f2) = ("b00000000000000000000001", "b00000000000000000000002");
        let rows = [
            (0, a, "m", f1, 0),
            (1, a, "m", f1, 0),
            (2, a, "m", f2, 0),
            // File 1 repeats f1 three times: the third is new, f2 once: a copy.
            (3, a, "m", f1, 1),
            (4, a, "m", f1, 1),
            (5, a, "m", f1, 1),
            (6, a, "m", f2, 1),
        ];
        let got = numbers(&rows, true).await;
        assert_eq!(
            got,
            vec![Some(0), Some(1), Some(2), None, None, Some(3), None]
        );
        // Without the copy rule every record is a sample.
        let all = numbers(&rows, false).await;
        assert_eq!(all, (0..7).map(Some).collect::<Vec<_>>());
    }
}
