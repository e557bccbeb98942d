//! Batch mode: the call stage's requests through the provider's batch interface, at half
//! the price, with the synchronous path's guarantees.
//!
//! # Behavior
//! - The requests come from the same todo plan as synchronous calls (cases unnested into
//!   samples, anti-joined with committed calls), streamed into chunks of at most 50,000
//!   requests and 200 MB (`[model] batch_max_requests` lowers the request bound). Each line's `custom_id` is the call id and its body the synchronous request.
//! - Exactly once: a chunk is journaled ([`journal`]) before it is uploaded, its file id is
//!   recorded when the upload returns and its batch id when the create returns. A session
//!   first finds, through the list endpoint and the batches' `evalflow_chunk` metadata, the
//!   batch of every chunk that was uploaded but whose create did not return, before it
//!   creates anything; it then polls the batches it has, and sends no request that is in an
//!   open chunk. Results are committed as ordinary `calls` rows plus a `batch_id` column,
//!   skipping call ids already committed by this chunk, so a crash during the commit
//!   neither loses nor duplicates a row.
//! - A line that failed in a way a retry can fix (429, 5xx, a malformed body, expired or
//!   cancelled before it ran, missing from a results file cut short) is sent again in a
//!   later batch while the call has spent at most `max_retries` batches; then its error is
//!   a row. Other line errors and a batch that failed validation are error rows at once.
//! - `--no-wait`: polls each open batch once, collects the finished ones, submits what is
//!   left to send, and returns the open batches (recorded in the manifest).
//! - `EVALFLOW_CRASH_AT=before_upload|after_upload|after_create|polling|during_commit`
//!   aborts the process at that point (the crash tests' hook).

pub mod journal;
pub mod openai;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::arrow::array::{ArrayRef, RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::json;

use self::journal::{BatchJournal, ChunkState, ChunkWriter};
use super::{CallError, CallResult, CallRow, CallStats, Options};
use crate::config::ModelConfig;
use crate::schema::Table;
use crate::storage::RunStore;

/// Errors of batch mode.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// The model cannot be used in batch mode (missing URL or key, bad header).
    #[error("model: {0}")]
    Config(String),
    /// The provider does not offer a batch interface evalflow speaks.
    #[error("model.batch: provider `{0}` has no batch interface (openai does)")]
    Unsupported(String),
    /// A memory:// root: no journal can outlive a crash, and batches outlive the process.
    #[error(
        "{0}: batch mode needs a root on disk or on an object store (its batches outlive the process)"
    )]
    NoLocalState(String),
    /// An API call failed after its retries.
    #[error("batch API {what}: {msg}")]
    Api {
        what: String,
        status: Option<u16>,
        msg: String,
    },
    /// The batch journal could not be written or read.
    #[error("{path}: batch journal: {source}")]
    Journal {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl BatchError {
    /// Whether the user can fix it (exit 2).
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            BatchError::Config(_) | BatchError::Unsupported(_) | BatchError::NoLocalState(_)
        ) || matches!(self, BatchError::Api { status: Some(s), .. } if (400..500).contains(s) && *s != 429)
    }
}

/// A batch not yet collected, as the manifest and `status` show it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OpenBatch {
    pub batch_id: Option<String>,
    pub chunk: String,
    pub status: Option<String>,
    pub requests: u64,
}

/// Most requests in one batch (OpenAI's limit).
pub const MAX_REQUESTS: u64 = 50_000;
/// Most bytes in one batch input file (OpenAI's limit).
pub const MAX_BYTES: u64 = 200 * 1024 * 1024;
/// Names the point where the process aborts (crash tests).
pub const CRASH_ENV: &str = "EVALFLOW_CRASH_AT";
/// The metadata key naming the chunk.
pub const CHUNK_KEY: &str = "evalflow_chunk";

fn crash_at(point: &str) {
    if std::env::var(CRASH_ENV).as_deref() == Ok(point) {
        eprintln!("{CRASH_ENV}={point}: aborting");
        std::process::abort();
    }
}

/// The `calls` schema of rows that came through a batch: the declared columns, then
/// `batch_id` (readers accept extra columns; a synchronous part simply lacks it).
pub fn calls_schema() -> SchemaRef {
    let base = Table::Calls.schema();
    let mut fields: Vec<Field> = base.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new("batch_id", DataType::Utf8, true));
    Arc::new(Schema::new(fields))
}

fn with_batch_id(b: RecordBatch, batch_id: &str) -> RecordBatch {
    let mut cols = b.columns().to_vec();
    let ids: ArrayRef = Arc::new(StringArray::from_iter_values(std::iter::repeat_n(
        batch_id,
        b.num_rows(),
    )));
    cols.push(ids);
    RecordBatch::try_new(calls_schema(), cols).expect("calls columns and batch_id")
}

struct Ctx<'a> {
    store: &'a RunStore,
    model: &'a ModelConfig,
    opts: Options,
    client: openai::Client,
    journal: BatchJournal,
    session: String,
    seq: u32,
    run_name: String,
    max_requests: u64,
    wait: bool,
}

fn jerr(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> CallError + '_ {
    move |source| {
        CallError::Batch(BatchError::Journal {
            path: path.display().to_string(),
            source,
        })
    }
}

/// Runs the call stage in batch mode; the batches left open (`--no-wait`).
///
/// # Errors
/// Journal and storage I/O, an API call that failed after its retries, a model or root
/// batch mode cannot use. Per-request failures are rows.
pub async fn run(
    store: &RunStore,
    model: &ModelConfig,
    opts: Options,
    session: &str,
    stats: &mut CallStats,
) -> Result<Vec<OpenBatch>, CallError> {
    if model.provider != "openai" {
        return Err(BatchError::Unsupported(model.provider.clone()).into());
    }
    let dir = super::journal::dir_for(store)
        .and_then(|d| d.parent().map(|p| p.join("batches")))
        .ok_or_else(|| BatchError::NoLocalState(store.display().to_string()))?;
    let journal = BatchJournal::open(dir.clone()).map_err(jerr(&dir))?;
    let max_requests = model
        .batch_max_requests
        .filter(|n| *n > 0)
        .map_or(MAX_REQUESTS, |n| n.min(MAX_REQUESTS));
    let run_name = store
        .display()
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or("run")
        .chars()
        .take(256)
        .collect();
    let mut cx = Ctx {
        store,
        model,
        opts,
        client: openai::Client::build(model)?,
        journal,
        session: session.to_string(),
        seq: 0,
        run_name,
        max_requests,
        wait: !model.batch_no_wait,
    };
    stats.skipped = store.table_rows("calls").await?;
    let mut chunks = cx.journal.chunks().map_err(jerr(&dir))?;
    cx.resolve(&mut chunks).await?;
    for c in chunks.iter_mut().filter(|c| c.batch_id.is_none()) {
        cx.submit(c, stats).await?;
    }
    loop {
        cx.drive(&mut chunks, stats).await?;
        let mut exclude = HashSet::new();
        for c in &chunks {
            let reqs = cx.journal.requests(&c.key).map_err(jerr(&dir))?;
            exclude.extend(reqs.into_iter().map(|r| r.call_id));
        }
        let before = chunks.len();
        cx.submit_todo(&exclude, &mut chunks, stats).await?;
        // Waiting, `drive` left no open chunk: new ones hold the calls to send again.
        if chunks.len() == before || !cx.wait {
            break;
        }
    }
    Ok(chunks
        .into_iter()
        .map(|c| OpenBatch {
            batch_id: c.batch_id,
            chunk: c.key,
            status: c.status,
            requests: c.requests,
        })
        .collect())
}

impl Ctx<'_> {
    fn jerr(&self) -> impl FnOnce(std::io::Error) -> CallError + '_ {
        jerr(self.journal.dir())
    }

    /// Finds the batches of chunks whose create may have happened without its answer
    /// being recorded (uploaded, no batch id), by their metadata.
    async fn resolve(&self, chunks: &mut [ChunkState]) -> Result<(), CallError> {
        let wanted: HashSet<String> = chunks
            .iter()
            .filter(|c| c.file_id.is_some() && c.batch_id.is_none())
            .map(|c| c.key.clone())
            .collect();
        if wanted.is_empty() {
            return Ok(());
        }
        let found = self.client.find(CHUNK_KEY, &wanted, 100_000).await?;
        for (key, b) in found {
            if let Some(c) = chunks
                .iter_mut()
                .find(|c| c.key == key && c.batch_id.is_none())
            {
                eprintln!("batch {}: found by its metadata (chunk {key})", b.id);
                c.batch_id = Some(b.id);
                c.status = Some(b.status);
                self.journal.save(c).map_err(self.jerr())?;
            }
        }
        Ok(())
    }

    /// Uploads (unless uploaded) and creates a chunk's batch, recording each step.
    async fn submit(&self, c: &mut ChunkState, stats: &mut CallStats) -> Result<(), CallError> {
        if c.file_id.is_none() {
            crash_at("before_upload");
            let path = self.journal.input_path(&c.key);
            let content = tokio::fs::read(&path).await.map_err(jerr(&path))?;
            let id = self
                .client
                .upload(&format!("evalflow-{}.jsonl", c.key), &content)
                .await?;
            c.file_id = Some(id);
            self.journal.save(c).map_err(self.jerr())?;
            crash_at("after_upload");
        }
        let metadata = json!({
            "evalflow_run": self.run_name,
            "evalflow_chunk": c.key,
            "evalflow_requests": c.requests.to_string(),
        });
        let b = self
            .client
            .create(c.file_id.as_deref().unwrap_or_default(), &metadata)
            .await?;
        crash_at("after_create");
        eprintln!(
            "batch {} (chunk {}): {} requests, {}",
            b.id, c.key, c.requests, b.status
        );
        c.batch_id = Some(b.id);
        c.status = Some(b.status);
        self.journal.save(c).map_err(self.jerr())?;
        stats.batches_created += 1;
        Ok(())
    }

    /// Streams the requests still to send into chunks and submits each when full.
    async fn submit_todo(
        &mut self,
        exclude: &HashSet<String>,
        chunks: &mut Vec<ChunkState>,
        stats: &mut CallStats,
    ) -> Result<(), CallError> {
        let mut todo = super::todo_stream(self.store, self.model, self.opts.retry_errors).await?;
        let mut w: Option<ChunkWriter> = None;
        while let Some(b) = todo.next().await {
            let b = b.map_err(crate::query::QueryError::df(
                "call: listing the requests still to send",
            ))?;
            for req in super::requests_for(self.model, &crate::schema::plain_strings(b)) {
                if exclude.contains(&req.call_id) {
                    continue;
                }
                let line = openai::line(self.model, &req);
                if let Some(cw) = &w
                    && (cw.requests + 1 > self.max_requests
                        || cw.bytes + line.len() as u64 + 1 > MAX_BYTES)
                {
                    let cw = w.take().expect("checked");
                    chunks.push(self.seal_and_submit(cw, stats).await?);
                }
                if w.is_none() {
                    let key = format!("{}-{:05}", self.session, self.seq);
                    self.seq += 1;
                    w = Some(self.journal.begin(&key).map_err(self.jerr())?);
                }
                let cw = w.as_mut().expect("just set");
                cw.push(&req, &line).map_err(jerr(self.journal.dir()))?;
            }
        }
        if let Some(cw) = w.take() {
            chunks.push(self.seal_and_submit(cw, stats).await?);
        }
        Ok(())
    }

    async fn seal_and_submit(
        &self,
        cw: ChunkWriter,
        stats: &mut CallStats,
    ) -> Result<ChunkState, CallError> {
        let mut st = self.journal.seal(cw).map_err(self.jerr())?;
        self.submit(&mut st, stats).await?;
        Ok(st)
    }

    /// Polls the open batches (until every one is final when waiting, once each
    /// otherwise) and collects the final ones.
    async fn drive(
        &self,
        chunks: &mut Vec<ChunkState>,
        stats: &mut CallStats,
    ) -> Result<(), CallError> {
        let started = Instant::now();
        let mut next: HashMap<String, Instant> = HashMap::new();
        loop {
            let mut i = 0;
            while i < chunks.len() {
                let due = next
                    .get(&chunks[i].key)
                    .is_none_or(|t| *t <= Instant::now());
                if !due {
                    i += 1;
                    continue;
                }
                crash_at("polling");
                let id = chunks[i]
                    .batch_id
                    .clone()
                    .expect("submitted chunks have a batch");
                let b = self.client.retrieve(&id).await?;
                if chunks[i].status.as_deref() != Some(b.status.as_str()) {
                    let c = b.request_counts.unwrap_or_default();
                    eprintln!(
                        "batch {id} (chunk {}): {} {}/{}",
                        chunks[i].key,
                        b.status,
                        c.completed + c.failed,
                        chunks[i].requests
                    );
                    chunks[i].status = Some(b.status.clone());
                    self.journal.save(&chunks[i]).map_err(self.jerr())?;
                }
                if b.is_final() {
                    let c = chunks.remove(i);
                    self.collect(&c, &b, stats).await?;
                    continue;
                }
                // Backoff: a tenth of the time waited so far, 0.2 s to 30 s.
                let waited = started.elapsed().as_secs_f64();
                let wait = Duration::from_secs_f64((waited / 10.0).clamp(0.2, 30.0));
                next.insert(chunks[i].key.clone(), Instant::now() + wait);
                i += 1;
            }
            if chunks.is_empty() || !self.wait {
                return Ok(());
            }
            let soonest = next.values().min().copied().unwrap_or_else(Instant::now);
            tokio::time::sleep_until(soonest.into()).await;
        }
    }

    /// A result file's lines, downloaded again (up to 4 times) while it holds fewer
    /// complete lines than the batch's counts say (a download cut short).
    async fn lines(
        &self,
        batch_id: &str,
        file_id: &str,
        expected: u64,
    ) -> Result<Vec<(String, CallResult, bool)>, CallError> {
        let mut best = Vec::new();
        for attempt in 0..4 {
            let bytes = self.client.content(file_id).await?;
            let parsed: Vec<_> = bytes
                .split(|&b| b == b'\n')
                .filter(|l| !l.is_empty())
                .filter_map(|l| openai::parse_line(batch_id, l))
                .collect();
            let complete = parsed.len() as u64 >= expected;
            if parsed.len() > best.len() {
                best = parsed;
            }
            if complete {
                break;
            }
            eprintln!(
                "batch {batch_id}: file {file_id} has {} of {expected} lines; downloading it again",
                best.len()
            );
            tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
        }
        Ok(best)
    }

    /// Commits a final batch's results and drops its chunk.
    async fn collect(
        &self,
        c: &ChunkState,
        b: &openai::Batch,
        stats: &mut CallStats,
    ) -> Result<(), CallError> {
        let batch_id = b.id.clone();
        let reqs = self.journal.requests(&c.key).map_err(self.jerr())?;
        let mut results: HashMap<String, (CallResult, bool)> = HashMap::new();
        if b.status == "failed" {
            let msg = format!("batch {batch_id} failed validation: {}", b.error_text());
            for r in &reqs {
                results.insert(
                    r.call_id.clone(),
                    (openai::failed(None, msg.clone()), false),
                );
            }
        } else {
            let counts = b.request_counts.unwrap_or_default();
            for (file, expected) in [
                (&b.output_file_id, counts.completed),
                (&b.error_file_id, counts.failed),
            ] {
                if let Some(f) = file {
                    for (id, res, retry) in self.lines(&batch_id, f, expected).await? {
                        results.insert(id, (res, retry));
                    }
                }
            }
        }
        let mut attempts = self.journal.attempts().map_err(self.jerr())?;
        let applied = attempts.applied.contains(&c.key);
        let ids: HashSet<String> = reqs.iter().map(|r| r.call_id.clone()).collect();
        let committed = super::committed_among(self.store, &ids).await?;
        let latency_ms =
            ((chrono::Utc::now().timestamp_micros() - c.written_at_us) as f64 / 1000.0).max(0.0);
        let mut rows = Vec::new();
        let mut retry_ids = Vec::new();
        let mut final_ids = Vec::new();
        for req in reqs {
            let (mut res, retryable) = results.remove(&req.call_id).unwrap_or_else(|| {
                (
                    openai::failed(
                        None,
                        format!(
                            "batch {batch_id} ({}): no result line for this request",
                            b.status
                        ),
                    ),
                    true,
                )
            });
            let earlier = attempts.spent.get(&req.call_id).copied().unwrap_or(0);
            let spent = if applied { earlier } else { earlier + 1 };
            if retryable && spent <= self.model.max_retries {
                retry_ids.push((req.call_id.clone(), spent));
                continue;
            }
            res.attempts = spent.max(1) as i32;
            let done = committed.get(&req.call_id).is_some_and(|v| {
                v.iter()
                    .any(|(at, answered)| *answered || *at == c.written_at_us)
            });
            final_ids.push(req.call_id.clone());
            if done {
                continue;
            }
            stats.sent += 1;
            stats.errors += u64::from(res.error.is_some());
            rows.push(CallRow {
                req,
                res,
                latency_ms,
                started_at_us: c.written_at_us,
            });
        }
        if !rows.is_empty() {
            let mut w =
                self.store
                    .part_writer("calls", calls_schema(), &format!("part-batch-{}", c.key));
            for chunk in rows.chunks(8192) {
                w.write(with_batch_id(super::to_batch(self.model, chunk), &batch_id))
                    .await?;
            }
            w.finish().await?;
        }
        crash_at("during_commit");
        if !applied {
            for (id, spent) in &retry_ids {
                attempts.spent.insert(id.clone(), *spent);
            }
        }
        for id in &final_ids {
            attempts.spent.remove(id);
        }
        attempts.applied.insert(c.key.clone());
        self.journal.save_attempts(&attempts).map_err(self.jerr())?;
        self.journal.remove(&c.key).map_err(self.jerr())?;
        attempts.applied.remove(&c.key);
        self.journal.save_attempts(&attempts).map_err(self.jerr())?;
        stats.batches_collected += 1;
        stats.batch_retries += retry_ids.len() as u64;
        eprintln!(
            "batch {batch_id} (chunk {}): {} rows committed, {} to send again",
            c.key,
            rows.len(),
            retry_ids.len()
        );
        Ok(())
    }
}
