//! Writing parts: Parquet properties per table, encoders (inline or pipelined on rayon), and
//! the part writer that lands each part atomically under the run root.

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::{Schema, SchemaRef};
// ParquetObjectReader is deprecated in parquet 59 in favour of a hand-written
// AsyncFileReader; it is still the simplest correct reader over object_store.
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::basic::Compression;
use datafusion::parquet::file::properties::WriterProperties;
use datafusion::parquet::schema::types::ColumnPath;

use super::{PartFile, StorageError};
use crate::schema::Table;

type ParquetError = datafusion::parquet::errors::ParquetError;
use super::store::*;

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
    let is = |t: Table| {
        let of = t.schema();
        schema.fields().len() == of.fields().len()
            && schema
                .fields()
                .iter()
                .zip(of.fields())
                .all(|(a, b)| a.name() == b.name())
    };
    let bloom =
        |b: datafusion::parquet::file::properties::WriterPropertiesBuilder, col: &str, fpp: f64| {
            let key = ColumnPath::from(col);
            b.set_column_bloom_filter_enabled(key.clone(), true)
                .set_column_bloom_filter_fpp(key.clone(), fpp)
                .set_column_bloom_filter_max_ndv(key, PART_ROWS as u64)
        };
    if is(Table::Cases) {
        return bloom(b, "case_id", 1e-6).build();
    }
    // The viewer finds one answer, and a page's texts, by `call_id` (its samples by
    // `case_id`): a filter lets a lookup read the one part that holds the id instead of the
    // key column of every part (a 10M-answer run: 100 parts). At 1e-3 a lookup reads about
    // one part in a thousand for nothing; a filter is 128-256 KiB per 100k rows.
    if is(Table::Calls) {
        b = bloom(bloom(b, "call_id", 1e-3), "case_id", 1e-3);
    } else if is(Table::Validity) || is(Table::Scores) {
        b = bloom(b, "call_id", 1e-3);
    }
    b.build()
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

/// The most [`encode_with`] reserves for a file up front.
const PRESIZE_MAX: usize = 256 << 20;

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
    // Room for the batches' own bytes (of their slices, not of buffers they share): the
    // file is rarely larger, and a buffer grown by doubling copied each part about once more
    // and faulted in fresh pages to do it (10% of an import's page faults). Pages not
    // written to are never touched; the cap keeps an odd estimate from reserving much.
    let size = batches
        .iter()
        .flat_map(|b| b.columns())
        .map(|c| c.to_data().get_slice_memory_size().unwrap_or(0))
        .sum::<usize>();
    encode_to(
        schema,
        batches,
        props,
        Vec::with_capacity(size.min(PRESIZE_MAX)),
    )
}

/// Encodes record batches as one Parquet file written to `out`, and gives `out` back.
fn encode_to<W: std::io::Write + Send>(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    props: WriterProperties,
    out: W,
) -> Result<W, datafusion::parquet::errors::ParquetError> {
    let mut w = ArrowWriter::try_new(out, schema.clone(), Some(props))?;
    for b in batches {
        w.write(b)?;
    }
    w.into_inner()
}

/// One Parquet part encoded batch by batch as it is produced: the writer holds the open row
/// group's encoded pages, not the batches, so a part costs its open row group in memory
/// (all of its compressed size where the part is not a local file, [`PartFile`]).
/// [`PartEncoder::finish`] gives the part back, for [`PartFile::commit`] (atomic).
pub(super) struct PartEncoder {
    writer: ArrowWriter<PartFile>,
    rows: usize,
}

impl PartEncoder {
    pub(super) fn new(schema: &SchemaRef, out: PartFile) -> Result<Self, ParquetError> {
        Ok(PartEncoder {
            writer: ArrowWriter::try_new(out, schema.clone(), Some(parquet_props(schema)))?,
            rows: 0,
        })
    }

    pub(super) fn write(&mut self, batch: &RecordBatch) -> Result<(), ParquetError> {
        self.rows += batch.num_rows();
        self.writer.write(batch)
    }

    /// Rows written so far.
    fn rows(&self) -> usize {
        self.rows
    }

    /// The encoded part, to commit.
    pub(super) fn finish(self) -> Result<PartFile, ParquetError> {
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
    /// An encoder of the part `out` ([`RunStore::part_file`]).
    pub fn new(schema: &SchemaRef, out: PartFile) -> Result<Self, ParquetError> {
        Ok(PipelinedEncoder {
            idle: Some(PartEncoder::new(schema, out)?),
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

    /// Rows and the encoded part (to commit), once every write is done.
    pub async fn finish(mut self) -> Result<(usize, PartFile), ParquetError> {
        let encoder = self.ready().await?;
        let rows = encoder.rows();
        let (tx, rx) = tokio::sync::oneshot::channel();
        rayon::spawn(move || {
            let _ = tx.send(encoder.finish());
        });
        let part = rx
            .await
            .map_err(|_| ParquetError::General("the encoding task stopped".into()))??;
        Ok((rows, part))
    }
}

impl RunStore {
    /// A writer for one table folder whose parts are named `<prefix>-NNNNN.parquet`.
    pub fn part_writer(&self, rel: &str, schema: SchemaRef, prefix: &str) -> PartWriter {
        PartWriter::new(self.clone(), rel, schema, prefix)
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
    /// A [`PartWriter::streaming`] writer's open part, encoded as its batches come.
    encoder: Option<PipelinedEncoder>,
    streaming: bool,
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
    /// A writer for the folder `rel` of `store` ([`RunStore::part_writer`]).
    fn new(store: RunStore, rel: &str, schema: SchemaRef, prefix: &str) -> Self {
        PartWriter {
            store,
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
            encoder: None,
            streaming: false,
        }
    }

    /// Encodes each batch on rayon's pool as it comes ([`PipelinedEncoder`]) instead of
    /// buffering a part's batches and encoding them when it is cut: the open part costs its
    /// encoded pages in memory, not its Arrow batches (a third as much for `calls`). For a
    /// writer of much data, whose fresh pages are a fifth of an import's CPU (the kernel
    /// zeroing what the heap grows to). Parts are cut at the same rows, with
    /// [`parquet_props`]: not for a [`PartWriter::scratch`] writer.
    pub fn streaming(mut self) -> Self {
        self.streaming = true;
        self
    }

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
        if self.streaming {
            debug_assert!(
                !self.scratch,
                "a streaming writer encodes with parquet_props"
            );
            if self.encoder.is_none() {
                let out = self.store.part_file(&self.part_name())?;
                let e =
                    PipelinedEncoder::new(&self.schema, out).map_err(|e| self.parquet_err(e))?;
                self.encoder = Some(e);
            }
            let encoder = self.encoder.as_mut().expect("set above");
            let written = encoder.write(vec![batch]).await;
            written.map_err(|e| self.parquet_err(e))?;
        } else {
            self.pending.push(batch);
        }
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
        let name = self.part_name();
        if let Some(encoder) = self.encoder.take() {
            let (rows, part) = encoder
                .finish()
                .await
                .map_err(|source| StorageError::Parquet {
                    location: self.writing(&name),
                    source,
                })?;
            self.next_seq += 1;
            self.written_rows += rows;
            self.pending_rows = 0;
            self.parts.push(name.clone());
            return part.commit().await;
        }
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
        let out = self.store.part_file(&name)?;
        let schema = self.schema.clone();
        let encode = move |location: String| {
            encode_to(&schema, &batches, props, out)
                .map_err(|source| StorageError::Parquet { location, source })
        };
        if self.max_inflight == 0 {
            return encode(self.writing(&name))?.commit().await;
        }
        let location = self.writing(&name);
        // Encoded on rayon's pool (sized by `--threads`): a thread of tokio's blocking
        // pool would be one more malloc arena holding freed buffers.
        let (tx, rx) = tokio::sync::oneshot::channel();
        rayon::spawn(move || {
            let _ = tx.send(encode(location));
        });
        let task = tokio::spawn(async move {
            let part = rx.await.map_err(|e| StorageError::Task {
                location: name.clone(),
                msg: e.to_string(),
            })??;
            part.commit().await
        });
        self.inflight
            .push_back((self.parts[self.parts.len() - 1].clone(), task));
        while self.inflight.len() > self.max_inflight {
            self.land_oldest().await?;
        }
        Ok(())
    }

    /// The name of the part being written.
    fn part_name(&self) -> String {
        format!("{}/{}-{:05}.parquet", self.dir, self.prefix, self.next_seq)
    }

    /// Where a part is being written, for errors (a full disk names the file).
    fn writing(&self, name: &str) -> String {
        format!(
            "{} (writing a part)",
            self.store.location(&self.store.path(name))
        )
    }

    /// An encoding error of the part being written.
    fn parquet_err(&self, source: ParquetError) -> StorageError {
        StorageError::Parquet {
            location: self.writing(&self.part_name()),
            source,
        }
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
    use std::sync::Arc;

    use object_store::ObjectStoreExt;

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

    /// A streaming writer cuts the parts a buffering one cuts (at the same rows, under the
    /// same names), and each part is the same file, byte for byte, the last short one too,
    /// whether written to memory and put or to a local file and renamed (and the local
    /// folder holds nothing else).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn streaming_parts_are_the_buffered_parts() {
        use datafusion::arrow::array::{Int64Array, StringArray};
        use datafusion::arrow::datatypes::{DataType, Field, Schema};
        let schema = Arc::new(Schema::new(vec![
            Field::new("x", DataType::Int64, false),
            Field::new("response", DataType::Utf8, true),
        ]));
        let mut files = Vec::new();
        let local = tempfile::tempdir().unwrap();
        let ways = [(false, false), (true, false), (false, true), (true, true)];
        for (k, (streaming, on_disk)) in ways.into_iter().enumerate() {
            let root = local.path().join(format!("run-{k}"));
            let store = match on_disk {
                true => RunStore::open(root.to_str().unwrap()).unwrap(),
                false => RunStore::open(&format!("memory://streaming-{k}/run")).unwrap(),
            };
            let w = store
                .part_writer("t", schema.clone(), "part")
                .with_part_rows(10_000);
            let mut w = if streaming { w.streaming() } else { w };
            for b in 0..11i64 {
                let xs = Int64Array::from_iter_values(b * 3000..(b + 1) * 3000);
                let rs: StringArray = (b * 3000..(b + 1) * 3000)
                    .map(|i| {
                        (i % 7 != 0).then(|| format!("answer {i} {}", "x".repeat(i as usize % 50)))
                    })
                    .collect();
                let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(xs), Arc::new(rs)]);
                w.write(batch.unwrap()).await.unwrap();
            }
            let (written, parts) = w.finish().await.unwrap();
            assert_eq!(
                (written, parts.len()),
                (33_000, 3),
                "streaming: {streaming}"
            );
            let mut got = Vec::new();
            for m in store.list_parts("t").await.unwrap() {
                let bytes = store.object_store().get(&m.location).await.unwrap();
                let bytes = bytes.bytes().await.unwrap();
                got.push((m.location.filename().unwrap().to_string(), bytes));
            }
            if on_disk {
                assert_eq!(std::fs::read_dir(root.join("t")).unwrap().count(), 3);
            }
            files.push(got);
        }
        assert_eq!(files[0].len(), 3);
        for other in &files[1..] {
            assert_eq!(&files[0], other);
        }
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
        let d = tempfile::tempdir().unwrap();
        let store = RunStore::open(d.path().to_str().unwrap()).unwrap();
        let out = store.part_file("t/part.parquet").unwrap();
        let mut enc = PipelinedEncoder::new(&schema, out).unwrap();
        for w in writes.clone() {
            enc.write(w).await.unwrap();
        }
        let (rows, part) = enc.finish().await.unwrap();
        part.commit().await.unwrap();
        let bytes = std::fs::read(d.path().join("t/part.parquet")).unwrap();
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
}
