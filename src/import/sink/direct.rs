//! Direct records (a sample index and no imported scores): already `calls` rows, encoded by
//! `--threads` writer tasks, their ids bucketed for the duplicate check.

use super::*;

/// A direct batch ([`staging_schema`]) as `calls` rows: the columns by name, the call ids,
/// and NULL for what an import never knows.
pub(super) fn direct_calls(
    b: &RecordBatch,
    call_ids: &ArrayRef,
) -> Result<RecordBatch, datafusion::arrow::error::ArrowError> {
    let schema = crate::import::calls_schema();
    let cols = schema
        .fields()
        .iter()
        .map(|f| match f.name().as_str() {
            "call_id" => call_ids.clone(),
            "sample_idx" => b.column(4).clone(),
            name => b
                .column_by_name(name)
                .cloned()
                .unwrap_or_else(|| new_null_array(f.data_type(), b.num_rows())),
        })
        .collect();
    RecordBatch::try_new(schema, cols)
}

/// A chunk of records and, once rayon has computed them, their keys ([`chunk_keys`]).
pub(super) type Keyed = tokio::sync::oneshot::Receiver<(Vec<Record>, Vec<Vec<Keys>>)>;

/// What a direct calls writer task is sent.
pub(super) enum ToWriter {
    Batch(RecordBatch),
    /// A direct batch ([`staging_schema`]) of counted records, with their call ids where
    /// known and NULL where the task is to compute them ([`counted_call_ids`]).
    Counted(RecordBatch, ArrayRef),
    /// Commit what is buffered: the import's records are all in.
    Finish,
}

/// One task encoding direct `calls` parts; its handle returns the rows it committed.
pub(super) struct DirectWriter {
    pub(super) tx: tokio::sync::mpsc::Sender<ToWriter>,
    pub(super) task: tokio::task::JoinHandle<Result<u64, ImportError>>,
}

impl DirectWriter {
    pub(super) fn spawn(store: &RunStore, k: usize) -> Self {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<ToWriter>(2);
        let mut w = store
            .part_writer(
                STAGED_CALLS,
                crate::import::calls_schema(),
                &format!("part-imported-{k:03}"),
            )
            .streaming();
        let task = tokio::spawn(async move {
            let mut rows = 0u64;
            while let Some(m) = rx.recv().await {
                match m {
                    ToWriter::Batch(b) => {
                        rows += b.num_rows() as u64;
                        w.write(b).await?;
                    }
                    ToWriter::Counted(b, ids) => {
                        let calls = direct_calls(&b, &counted_call_ids(&b, &ids))
                            .map_err(|e| QueryError::df("import: direct calls batch")(e.into()))?;
                        rows += calls.num_rows() as u64;
                        w.write(calls).await?;
                    }
                    ToWriter::Finish => {
                        w.finish().await?;
                        return Ok(rows);
                    }
                }
            }
            // Dropped without `Finish`: the import failed; commit nothing more.
            Ok(0)
        });
        DirectWriter { tx, task }
    }

    /// The task's outcome once its channel is closed.
    pub(super) async fn join(self) -> Result<u64, ImportError> {
        drop(self.tx);
        self.task
            .await
            .map_err(|e| ImportError::Writer(e.to_string()))?
    }
}

impl ImportSink {
    /// Hands the direct batch to the next writer task and stages its ids. Counted records
    /// ([`SampleCounts`]) are distinct by their numbers: every direct record of an import
    /// that counts is counted, so their ids need no duplicate check.
    pub(super) async fn send_direct(&mut self) -> Result<(), ImportError> {
        let batch = self.direct.finish();
        let ids: ArrayRef = Arc::new(self.direct_ids.finish());
        let numbered = self.counted > 0;
        self.send_calls(batch, ids, numbered).await
    }

    /// Hands a batch of direct records ([`staging_schema`], with their call ids) to the
    /// next writer task, and keeps their ids for the duplicate check unless `numbered`:
    /// their samples were numbered here (counted, or by [`numbering`]), one per (case,
    /// model) and each once, so no two share an id.
    pub(super) async fn send_calls(
        &mut self,
        batch: RecordBatch,
        ids: ArrayRef,
        numbered: bool,
    ) -> Result<(), ImportError> {
        let message = if numbered && ids.null_count() > 0 {
            // Counted records: numbered, their ids computed by the writer task.
            ToWriter::Counted(batch, ids)
        } else {
            // (Ids left NULL are only ever counted ones; computed here all the same, should
            // a batch that is not numbered carry one, so its ids are checked.)
            let ids = if ids.null_count() > 0 {
                counted_call_ids(&batch, &ids)
            } else {
                ids
            };
            let calls = direct_calls(&batch, &ids)
                .map_err(|e| QueryError::df("import: direct calls batch")(e.into()))?;
            if !numbered {
                let fps = batch
                    .column_by_name("fp")
                    .expect("the staging schema has fp")
                    .clone();
                let id_batch =
                    RecordBatch::try_new(ids_schema(), vec![batch.column(0).clone(), ids, fps])
                        .expect("ids batch matches its schema");
                self.keep_ids(id_batch).await?;
            }
            ToWriter::Batch(calls)
        };
        let k = self.next_writer;
        self.next_writer = (k + 1) % self.writers.len();
        if self.writers[k].tx.send(message).await.is_err() {
            // The task stopped on an error: report it.
            let w = self.writers.remove(k);
            w.join().await?;
            return Err(ImportError::Writer("a calls writer stopped early".into()));
        }
        Ok(())
    }

    /// Keeps direct ids for the duplicate check: in memory while they fit ([`SeenIds`]),
    /// else (from then on, with those held) in the ids table.
    async fn keep_ids(&mut self, batch: RecordBatch) -> Result<(), ImportError> {
        if let Some(seen) = self.seen_ids.as_mut() {
            if seen.add(&batch).map_err(ImportError::IdsFile)? {
                return Ok(());
            }
            self.spill_seen_ids().await?;
        }
        self.write_ids(&batch).await
    }

    /// Writes the ids held in memory to the ids table, and holds no more: the plans check
    /// them with the rest.
    pub(super) async fn spill_seen_ids(&mut self) -> Result<(), ImportError> {
        if let Some(seen) = self.seen_ids.take() {
            for b in seen.into_batches().map_err(ImportError::IdsFile)? {
                self.write_ids(&b.map_err(ImportError::IdsFile)?).await?;
            }
        }
        Ok(())
    }

    async fn write_ids(&mut self, batch: &RecordBatch) -> Result<(), ImportError> {
        self.ids_rows += batch.num_rows() as u64;
        for (b, rows) in id_buckets(batch) {
            self.ids[b].write(rows).await?;
        }
        Ok(())
    }
}

/// The call ids of a batch of counted records ([`staging_schema`]): those given, and for
/// each NULL the id of its case, model, counted sample (`given_sample_idx`: the number
/// counted for it) and request ([`call::call_id`]).
pub(super) fn counted_call_ids(b: &RecordBatch, ids: &ArrayRef) -> ArrayRef {
    let text = |name: &str| {
        b.column_by_name(name)
            .expect("the staging schema names it")
            .as_string::<i32>()
    };
    let (case, model, request) = (text("case_id"), text("model"), text("request_hash"));
    let samples = b
        .column_by_name("given_sample_idx")
        .expect("the staging schema has given_sample_idx")
        .as_primitive::<datafusion::arrow::datatypes::Int32Type>();
    let given = ids.as_string::<i32>();
    let filled: StringArray = (0..b.num_rows())
        .map(|i| {
            Some(if given.is_valid(i) {
                given.value(i).to_string()
            } else {
                call::call_id(
                    case.value(i),
                    model.value(i),
                    samples.value(i),
                    request.value(i),
                )
            })
        })
        .collect();
    Arc::new(filled)
}

/// Buckets of the ids scratch table, by the first hex digit of the call id. Each part
/// holds one bucket, so its row groups' statistics span 1/16 of the ids, and a pass of the
/// duplicate check (a range of ids, [`id_slices`]) reads the one or two buckets it
/// overlaps, not every id: at 10M records its 20 passes read about twice the ids in all,
/// not 20 times.
pub(super) const ID_BUCKETS: usize = 16;

/// Rows per part of a bucket's writer: the 16 writers buffer about 23 MB in all.
pub(super) const ID_BUCKET_PART_ROWS: usize = 32_768;

/// An ids batch ([`ids_schema`]) split by [`ID_BUCKETS`] bucket, rows in order.
pub(super) fn id_buckets(batch: &RecordBatch) -> Vec<(usize, RecordBatch)> {
    let ids = batch.column(1).as_string::<i32>();
    let mut rows: Vec<Vec<u32>> = vec![Vec::new(); ID_BUCKETS];
    for (i, id) in ids.iter().enumerate() {
        let first = id.and_then(|s| s.chars().next());
        let b = first.and_then(|c| c.to_digit(16)).unwrap_or(0) as usize;
        rows[b].push(i as u32);
    }
    rows.into_iter()
        .enumerate()
        .filter(|(_, r)| !r.is_empty())
        .map(|(b, r)| {
            let taken = datafusion::arrow::compute::take_record_batch(
                batch,
                &datafusion::arrow::array::UInt32Array::from(r),
            )
            .expect("indices within the batch");
            (b, taken)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A counted record's id is filled in as `call::call_id` of its case, model, counted
    /// sample and request; an id already given is kept as it is.
    #[test]
    fn counted_call_ids_fill_only_the_missing_ids() {
        let text = |v: [&str; 2]| -> ArrayRef { Arc::new(StringArray::from(v.to_vec())) };
        let b = RecordBatch::try_from_iter(vec![
            ("case_id", text(["c1", "c2"])),
            ("model", text(["m", "n"])),
            (
                "given_sample_idx",
                Arc::new(datafusion::arrow::array::Int32Array::from(vec![3, 0])) as ArrayRef,
            ),
            ("request_hash", text(["r1", "r2"])),
        ])
        .unwrap();
        let ids: ArrayRef = Arc::new(StringArray::from(vec![None, Some("given")]));
        let filled = counted_call_ids(&b, &ids);
        let filled = filled.as_string::<i32>();
        assert_eq!(filled.value(0), call::call_id("c1", "m", 3, "r1"));
        assert_eq!(filled.value(1), "given");
        assert_eq!(filled.null_count(), 0);
    }
}
