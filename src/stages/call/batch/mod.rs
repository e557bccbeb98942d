//! Batch mode: the call stage's requests through the provider's batch interface, at half
//! the price, with the synchronous path's guarantees.
//!
//! # Behavior
//! - The requests come from the same todo plan as synchronous calls (cases unnested into
//!   samples, anti-joined with committed calls), streamed into chunks of at most 50,000
//!   requests and 200 MB (`[model] batch_max_requests` lowers the request bound). Each line's
//!   `custom_id` is the call id and its body the synchronous request.
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
//! - Anthropic's Message Batches carry no metadata: chunks are created one at a time
//!   (journal, mark the create as sent, create, record), so at most one chunk is ever
//!   created but unrecorded; a session adopts for it the oldest listed batch created after
//!   the mark (less a minute of clock skew), of its size, that no chunk recorded and that
//!   is not in `known-batches.txt`. When its results arrive their custom ids are checked:
//!   a batch holding another call is marked known and the chunk is created again.
//! - A create that fails in a way a retry can fix is looked for (as after a crash) before
//!   it is sent again, so a lost answer never makes two batches.
//! - `EVALFLOW_CRASH_AT=before_upload|after_upload` (OpenAI), `before_create` (Anthropic),
//!   `after_create|polling|during_commit` aborts the process at that point (the crash tests'
//!   hook; generate adds `after_rephrase`, once the rephrase calls are answered).

pub mod anthropic;
pub mod api;
pub mod journal;
pub mod openai;

/// The chunks of `store`'s batch journal that have a state: submitted (or being
/// submitted) and not yet collected, what `status`, `validate` and the other stages report
/// of a run whose batch call was killed or stopped with `--no-wait`. Read only: a chunk
/// without a state (being written) is left to the call that writes or resumes it.
pub fn open_chunks(store: &crate::storage::RunStore) -> Vec<journal::ChunkState> {
    let Some(dir) =
        super::journal::dir_for(store).and_then(|d| d.parent().map(|p| p.join("batches")))
    else {
        return Vec::new();
    };
    let mut out: Vec<journal::ChunkState> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".state.json"))
        // A chunk's state is one small JSON object (ids, status, counts): read whole.
        .filter_map(|e| serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok())
        .collect();
    out.sort_by(|a, b| a.key.cmp(&b.key));
    out
}

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::arrow::array::{RecordBatch, StringArray};
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
    #[error("model.batch: provider `{0}` has no batch interface (openai and anthropic do)")]
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

/// Most requests in one batch (OpenAI's limit; Anthropic's is [`anthropic::MAX_REQUESTS`]).
pub const MAX_REQUESTS: u64 = 50_000;
/// Most bytes in one batch input file (OpenAI's limit; Anthropic's is
/// [`anthropic::MAX_BYTES`] for a create's body).
pub const MAX_BYTES: u64 = 200 * 1024 * 1024;
/// How much earlier than the local mark of its create a server may date a batch (clock
/// skew), when an unrecorded Anthropic batch is looked for.
const SKEW_US: i64 = 60_000_000;
/// Names the point where the process aborts (crash tests).
pub const CRASH_ENV: &str = "EVALFLOW_CRASH_AT";
/// Rows per `calls` part of a collected batch. A part is encoded from memory, so parts of a
/// chunk's size (up to 100,000 answers) held that many rows at once: at 16,384 rows the peak
/// RSS of 200,000 requests is 1.14x that of 20,000, where it was 1.5x (docs/batch.md).
const PART_ROWS: usize = 16_384;
/// The metadata key naming the chunk.
pub const CHUNK_KEY: &str = "evalflow_chunk";

/// Aborts the process when [`CRASH_ENV`] names `point`.
pub fn crash_at(point: &str) {
    if std::env::var(CRASH_ENV).as_deref() == Ok(point) {
        crate::progress::errln!("{CRASH_ENV}={point}: aborting");
        std::process::abort();
    }
}

/// Sets the `batch_id` column (declared in `schemas/calls.json`, NULL for a synchronous
/// call) of a calls batch.
fn with_batch_id(b: RecordBatch, batch_id: &str) -> RecordBatch {
    let schema = b.schema();
    let i = schema
        .index_of("batch_id")
        .expect("schemas/calls.json declares batch_id");
    let mut cols = b.columns().to_vec();
    cols[i] = Arc::new(StringArray::from_iter_values(std::iter::repeat_n(
        batch_id,
        b.num_rows(),
    )));
    RecordBatch::try_new(schema, cols).expect("calls columns")
}

/// The batch interface of the model's provider.
enum Client {
    OpenAi(openai::Client),
    Anthropic(anthropic::Client),
}

/// A batch as its API describes it.
#[derive(Debug, Clone)]
enum Remote {
    OpenAi(openai::Batch),
    Anthropic(anthropic::Batch),
}

impl Remote {
    fn id(&self) -> &str {
        match self {
            Remote::OpenAi(b) => &b.id,
            Remote::Anthropic(b) => &b.id,
        }
    }

    fn status(&self) -> &str {
        match self {
            Remote::OpenAi(b) => &b.status,
            Remote::Anthropic(b) => &b.processing_status,
        }
    }

    fn is_final(&self) -> bool {
        match self {
            Remote::OpenAi(b) => b.is_final(),
            Remote::Anthropic(b) => b.is_final(),
        }
    }

    /// Requests that ended.
    fn done(&self) -> u64 {
        match self {
            Remote::OpenAi(b) => b.request_counts.map_or(0, |c| c.completed + c.failed),
            Remote::Anthropic(b) => b.done(),
        }
    }
}

struct Ctx<'a> {
    store: &'a RunStore,
    model: &'a ModelConfig,
    opts: Options,
    client: Client,
    journal: BatchJournal,
    session: String,
    seq: u32,
    run_name: String,
    max_requests: u64,
    max_bytes: u64,
    wait: bool,
    /// The batch ids the open chunks recorded.
    taken: std::sync::Mutex<HashSet<String>>,
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
    let (client, limit, max_bytes) = match model.provider.as_str() {
        "openai" => (
            Client::OpenAi(openai::Client::build(model)?),
            MAX_REQUESTS,
            MAX_BYTES,
        ),
        // The create's body wraps the lines: `{"requests":[`, commas, `]}`.
        "anthropic" => (
            Client::Anthropic(anthropic::Client::build(model)?),
            anthropic::MAX_REQUESTS,
            anthropic::MAX_BYTES - 64,
        ),
        other => return Err(BatchError::Unsupported(other.to_string()).into()),
    };
    let dir = super::journal::dir_for(store)
        .and_then(|d| d.parent().map(|p| p.join("batches")))
        .ok_or_else(|| BatchError::NoLocalState(store.display().to_string()))?;
    let journal = BatchJournal::open(dir.clone()).map_err(jerr(&dir))?;
    let max_requests = model
        .batch_max_requests
        .filter(|n| *n > 0)
        .map_or(limit, |n| n.min(limit));
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
        client,
        journal,
        session: session.to_string(),
        seq: 0,
        run_name,
        max_requests,
        max_bytes,
        wait: !model.batch_no_wait,
        taken: std::sync::Mutex::new(HashSet::new()),
    };
    stats.skipped = store.table_rows("calls").await?;
    let mut chunks = cx.journal.chunks().map_err(jerr(&dir))?;
    cx.taken
        .lock()
        .expect("not poisoned")
        .extend(chunks.iter().filter_map(|c| c.batch_id.clone()));
    cx.resolve(&mut chunks).await?;
    for c in chunks.iter_mut().filter(|c| c.batch_id.is_none()) {
        cx.submit(c, stats).await?;
    }
    loop {
        cx.drive(&mut chunks, stats).await?;
        let mut exclude = HashSet::new();
        for c in &chunks {
            exclude.extend(cx.journal.request_ids(&c.key).map_err(jerr(&dir))?);
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

    /// Whether a chunk's create may have been sent without its answer being recorded.
    fn maybe_created(&self, c: &ChunkState) -> bool {
        c.batch_id.is_none()
            && match self.client {
                Client::OpenAi(_) => c.file_id.is_some(),
                Client::Anthropic(_) => c.creating_at_us.is_some(),
            }
    }

    /// Records the batch a chunk's create made (or the list endpoint found).
    fn record(&self, c: &mut ChunkState, b: &Remote) -> Result<(), CallError> {
        c.batch_id = Some(b.id().to_string());
        c.status = Some(b.status().to_string());
        self.journal.save(c).map_err(self.jerr())?;
        self.taken
            .lock()
            .expect("not poisoned")
            .insert(b.id().to_string());
        Ok(())
    }

    /// Finds the batches of chunks whose create may have happened without its answer
    /// being recorded (OpenAI: by their metadata; Anthropic: by time and size).
    async fn resolve(&self, chunks: &mut [ChunkState]) -> Result<(), CallError> {
        let wanted: HashSet<String> = chunks
            .iter()
            .filter(|c| self.maybe_created(c))
            .map(|c| c.key.clone())
            .collect();
        if wanted.is_empty() {
            return Ok(());
        }
        if let Client::OpenAi(client) = &self.client {
            let found = client.find(CHUNK_KEY, &wanted, 100_000).await?;
            for (key, b) in found {
                if let Some(c) = chunks
                    .iter_mut()
                    .find(|c| c.key == key && c.batch_id.is_none())
                {
                    crate::progress::errln!("batch {}: found by its metadata (chunk {key})", b.id);
                    self.record(c, &Remote::OpenAi(b))?;
                }
            }
            return Ok(());
        }
        for c in chunks.iter_mut().filter(|c| wanted.contains(&c.key)) {
            if let Some(b) = self.find_created(c).await? {
                crate::progress::errln!(
                    "batch {}: found by its creation time and size (chunk {})",
                    b.id(),
                    c.key
                );
                self.record(c, &b)?;
            }
        }
        Ok(())
    }

    /// The batch a chunk's create made, if the API lists one.
    async fn find_created(&self, c: &ChunkState) -> Result<Option<Remote>, CallError> {
        match &self.client {
            Client::OpenAi(client) => {
                let wanted = HashSet::from([c.key.clone()]);
                let found = client.find(CHUNK_KEY, &wanted, 100_000).await?;
                Ok(found.into_iter().next().map(|(_, b)| Remote::OpenAi(b)))
            }
            Client::Anthropic(client) => {
                let Some(mark) = c.creating_at_us else {
                    return Ok(None);
                };
                let since = mark - SKEW_US;
                let mut known = self.journal.known().map_err(self.jerr())?;
                known.extend(self.taken.lock().expect("not poisoned").iter().cloned());
                let mut oldest = None;
                client
                    .list(self.model, |b| {
                        let Some(at) = b.created_at_us() else {
                            return true;
                        };
                        if at < since {
                            return false;
                        }
                        if !known.contains(&b.id) && b.total() == c.requests {
                            oldest = Some(b.clone());
                        }
                        true
                    })
                    .await?;
                Ok(oldest.map(Remote::Anthropic))
            }
        }
    }

    /// Uploads (OpenAI, unless uploaded) and creates a chunk's batch, recording each step.
    ///
    /// The chunk's input file is streamed from the journal into the request body (at most
    /// 200 MB for OpenAI, 256 MB for Anthropic), never read whole.
    async fn submit(&self, c: &mut ChunkState, stats: &mut CallStats) -> Result<(), CallError> {
        let path = self.journal.input_path(&c.key);
        let len = std::fs::metadata(&path).map_err(jerr(&path))?.len();
        match &self.client {
            Client::OpenAi(client) => {
                if c.file_id.is_none() {
                    crash_at("before_upload");
                    let name = format!("evalflow-{}.jsonl", c.key);
                    let id = client.upload(&name, &path, len).await?;
                    c.file_id = Some(id);
                    self.journal.save(c).map_err(self.jerr())?;
                    crash_at("after_upload");
                }
            }
            Client::Anthropic(_) => {
                c.creating_at_us = Some(chrono::Utc::now().timestamp_micros());
                self.journal.save(c).map_err(self.jerr())?;
                crash_at("before_create");
            }
        }
        let metadata = json!({
            "evalflow_run": self.run_name,
            "evalflow_chunk": c.key,
            "evalflow_requests": c.requests.to_string(),
        });
        let mut tries = 0u32;
        let b = loop {
            let made = match &self.client {
                Client::OpenAi(client) => client
                    .create(c.file_id.as_deref().unwrap_or_default(), &metadata)
                    .await
                    .map(Remote::OpenAi),
                Client::Anthropic(client) => client
                    .create(self.model, &path, len)
                    .await
                    .map(Remote::Anthropic),
            };
            match made {
                Ok(b) => break b,
                Err((e, retry)) => {
                    if !retry || tries >= 8 {
                        return Err(e.into());
                    }
                    tries += 1;
                    crate::progress::errln!(
                        "batch create (chunk {}): {e}; looking for it, then again",
                        c.key
                    );
                    tokio::time::sleep(
                        super::limits::backoff(tries, None).min(Duration::from_secs(30)),
                    )
                    .await;
                    if let Some(b) = self.find_created(c).await? {
                        break b;
                    }
                }
            }
        };
        crash_at("after_create");
        crate::progress::errln!(
            "batch {} (chunk {}): {} requests, {}",
            b.id(),
            c.key,
            c.requests,
            b.status()
        );
        self.record(c, &b)?;
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
                let line = match self.client {
                    Client::OpenAi(_) => openai::line(self.model, &req),
                    Client::Anthropic(_) => anthropic::line(self.model, &req),
                };
                if let Some(cw) = &w
                    && (cw.requests + 1 > self.max_requests
                        || cw.bytes + line.len() as u64 + 1 > self.max_bytes)
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
                let b = match &self.client {
                    Client::OpenAi(client) => Remote::OpenAi(client.retrieve(&id).await?),
                    Client::Anthropic(client) => {
                        Remote::Anthropic(client.retrieve(self.model, &id).await?)
                    }
                };
                if chunks[i].status.as_deref() != Some(b.status()) {
                    crate::progress::errln!(
                        "batch {id} (chunk {}): {} {}/{}",
                        chunks[i].key,
                        b.status(),
                        b.done(),
                        chunks[i].requests
                    );
                    chunks[i].status = Some(b.status().to_string());
                    self.journal.save(&chunks[i]).map_err(self.jerr())?;
                }
                if b.is_final() {
                    let c = chunks.remove(i);
                    if let Some(mut again) = self.collect(c, &b, stats).await? {
                        self.submit(&mut again, stats).await?;
                        chunks.push(again);
                    }
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

    /// Downloads a result file (OpenAI: the file `file_id`; Anthropic: the batch's results)
    /// into the journal as result file `slot` and indexes its lines into `index`; downloaded
    /// again (up to 4 times) while it holds fewer lines that parse than the batch's counts
    /// say (a download cut short), keeping the most complete copy.
    async fn download(
        &self,
        key: &str,
        b: &Remote,
        file_id: Option<&str>,
        expected: u64,
        slot: usize,
        index: &mut ResultIndex,
    ) -> Result<(), CallError> {
        let batch_id = b.id();
        let tmp = self.journal.dir().join(format!("{key}.download.tmp"));
        let path = self.journal.results_path(key, slot);
        let mut best: Option<(HashMap<String, Line>, usize)> = None;
        for attempt in 0..4 {
            match (&self.client, b) {
                (Client::OpenAi(client), _) => {
                    client.content(file_id.unwrap_or_default(), &tmp).await?;
                }
                (Client::Anthropic(client), Remote::Anthropic(ab)) => {
                    client.results(self.model, ab, &tmp).await?;
                }
                (Client::Anthropic(_), Remote::OpenAi(_)) => unreachable!("one provider a run"),
            }
            let (lines, parsed) =
                index_lines(&tmp, slot, |l| self.parse(batch_id, l)).map_err(jerr(&tmp))?;
            let complete = parsed as u64 >= expected;
            if best.as_ref().is_none_or(|b| parsed > b.1) {
                std::fs::rename(&tmp, &path).map_err(jerr(&path))?;
                best = Some((lines, parsed));
            }
            if complete {
                break;
            }
            crate::progress::errln!(
                "batch {batch_id}: results hold {} of {expected} lines; downloading them again",
                best.as_ref().map_or(0, |b| b.1)
            );
            tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
        }
        index
            .add(&path, best.map(|b| b.0).unwrap_or_default())
            .map_err(jerr(&path))?;
        Ok(())
    }

    fn parse(&self, batch_id: &str, line: &[u8]) -> Option<(String, CallResult, bool)> {
        match self.client {
            Client::OpenAi(_) => openai::parse_line(batch_id, line),
            Client::Anthropic(_) => anthropic::parse_line(batch_id, line),
        }
    }

    /// Commits a final batch's results and drops its chunk; the chunk back, to be created
    /// again, when the batch turns out to hold other calls (an Anthropic batch adopted by
    /// its time and size).
    ///
    /// The result files are downloaded into the journal and indexed by call id (an offset
    /// per line); the chunk's requests are then read one at a time and their rows written
    /// 8,192 at a time, so memory holds the chunk's call ids, never its answers.
    async fn collect(
        &self,
        mut c: ChunkState,
        b: &Remote,
        stats: &mut CallStats,
    ) -> Result<Option<ChunkState>, CallError> {
        let batch_id = b.id().to_string();
        let ids = self.journal.request_ids(&c.key).map_err(self.jerr())?;
        let mut index = ResultIndex::default();
        let mut failed_all = None;
        match b {
            Remote::OpenAi(ob) if ob.status == "failed" => {
                failed_all = Some(format!(
                    "batch {batch_id} failed validation: {}",
                    ob.error_text()
                ));
            }
            Remote::OpenAi(ob) => {
                let counts = ob.request_counts.unwrap_or_default();
                for (slot, (file, expected)) in [
                    (&ob.output_file_id, counts.completed),
                    (&ob.error_file_id, counts.failed),
                ]
                .into_iter()
                .enumerate()
                {
                    if let Some(f) = file {
                        self.download(&c.key, b, Some(f), expected, slot, &mut index)
                            .await?;
                    }
                }
            }
            Remote::Anthropic(ab) => {
                self.download(&c.key, b, None, ab.done(), 0, &mut index)
                    .await?;
                let ours: HashSet<&str> = ids.iter().map(String::as_str).collect();
                if ab.total() != c.requests
                    || index.lines.keys().any(|k| !ours.contains(k.as_str()))
                {
                    crate::progress::errln!(
                        "batch {batch_id}: holds calls of no chunk of this run; chunk {} is \
                         created again",
                        c.key
                    );
                    self.journal.record_known(&batch_id).map_err(self.jerr())?;
                    self.taken.lock().expect("not poisoned").remove(&batch_id);
                    c.batch_id = None;
                    c.status = None;
                    c.creating_at_us = None;
                    self.journal.save(&c).map_err(self.jerr())?;
                    return Ok(Some(c));
                }
            }
        }
        let mut attempts = self.journal.attempts().map_err(self.jerr())?;
        let applied = attempts.applied.contains(&c.key);
        // Only this chunk's own parts can hold its calls: they were anti-joined with the
        // committed calls when it was made, and one writer holds the root. Its cost grows
        // with the chunk, not with the calls committed before it.
        let committed = super::committed_among(
            self.store,
            &ids.into_iter().collect(),
            Some(&format!("part-batch-{}-", c.key)),
        )
        .await?;
        let latency_ms =
            ((chrono::Utc::now().timestamp_micros() - c.written_at_us) as f64 / 1000.0).max(0.0);
        let mut rows = Vec::new();
        let mut written = 0usize;
        let mut writer = None;
        let mut retry_ids = Vec::new();
        let mut final_ids = Vec::new();
        for req in self.journal.requests(&c.key).map_err(self.jerr())? {
            let req = req.map_err(self.jerr())?;
            let found = match &failed_all {
                Some(msg) => Some((openai::failed(None, msg.clone()), false)),
                None => index
                    .take(&req.call_id, |l| self.parse(&batch_id, l))
                    .map_err(self.jerr())?,
            };
            let (mut res, retryable) = found.unwrap_or_else(|| {
                (
                    openai::failed(
                        None,
                        format!(
                            "batch {batch_id} ({}): no result line for this request",
                            b.status()
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
            // Only a call with attempts spent in earlier batches has anything to forget.
            if attempts.spent.contains_key(&req.call_id) {
                final_ids.push(req.call_id.clone());
            }
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
            if rows.len() == 8192 {
                self.write_rows(&mut writer, &c.key, &batch_id, &mut rows)
                    .await?;
                written += 8192;
            }
        }
        written += rows.len();
        self.write_rows(&mut writer, &c.key, &batch_id, &mut rows)
            .await?;
        if let Some(w) = writer {
            w.finish().await?;
        }
        crash_at("during_commit");
        // Known before its chunk goes: never adopted for another chunk.
        self.journal.record_known(&batch_id).map_err(self.jerr())?;
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
        self.taken.lock().expect("not poisoned").remove(&batch_id);
        stats.batches_collected += 1;
        stats.batch_retries += retry_ids.len() as u64;
        crate::progress::errln!(
            "batch {batch_id} (chunk {}): {} rows committed, {} to send again",
            c.key,
            written,
            retry_ids.len()
        );
        Ok(None)
    }
}

impl Ctx<'_> {
    /// Writes `rows` (emptied) into the chunk's calls part, started on the first rows.
    async fn write_rows(
        &self,
        writer: &mut Option<crate::storage::PartWriter>,
        key: &str,
        batch_id: &str,
        rows: &mut Vec<CallRow>,
    ) -> Result<(), CallError> {
        if rows.is_empty() {
            return Ok(());
        }
        let w = writer.get_or_insert_with(|| {
            self.store
                .part_writer("calls", Table::Calls.schema(), &format!("part-batch-{key}"))
                .with_part_rows(PART_ROWS)
        });
        w.write(with_batch_id(super::to_batch(self.model, rows), batch_id))
            .await?;
        rows.clear();
        Ok(())
    }
}

/// Where a result line is: its file (an index into [`ResultIndex::files`]), offset and
/// length.
#[derive(Debug, Clone, Copy)]
struct Line {
    file: usize,
    at: u64,
    len: usize,
}

/// The result lines of a final batch by call id, read back one at a time from the files
/// they were downloaded to. A later line for the same call id wins (OpenAI's error file
/// after its output file).
#[derive(Default)]
struct ResultIndex {
    files: Vec<std::fs::File>,
    lines: HashMap<String, Line>,
}

impl ResultIndex {
    fn add(&mut self, path: &std::path::Path, lines: HashMap<String, Line>) -> std::io::Result<()> {
        let file = self.files.len();
        self.files.push(std::fs::File::open(path)?);
        self.lines
            .extend(lines.into_iter().map(|(id, l)| (id, Line { file, ..l })));
        Ok(())
    }

    /// The parsed result line of `call_id`, taken out of the index (a request that
    /// appears twice finds it once).
    fn take<T>(
        &mut self,
        call_id: &str,
        parse: impl Fn(&[u8]) -> Option<(String, T, bool)>,
    ) -> std::io::Result<Option<(T, bool)>> {
        use std::io::{Read, Seek, SeekFrom};
        let Some(l) = self.lines.remove(call_id) else {
            return Ok(None);
        };
        let f = &mut self.files[l.file];
        f.seek(SeekFrom::Start(l.at))?;
        let mut buf = vec![0u8; l.len];
        f.read_exact(&mut buf)?;
        Ok(parse(&buf).map(|(_, r, retry)| (r, retry)))
    }
}

/// The lines of a downloaded result file that parse, by call id, and how many parsed: each
/// line is parsed once here (to count it and find its id) and once more when its row is
/// built.
fn index_lines<T>(
    path: &std::path::Path,
    file: usize,
    parse: impl Fn(&[u8]) -> Option<(String, T, bool)>,
) -> std::io::Result<(HashMap<String, Line>, usize)> {
    use std::io::BufRead;
    let mut r = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(path)?);
    let mut out = HashMap::new();
    let mut buf = Vec::new();
    let mut at = 0u64;
    let mut parsed = 0;
    loop {
        buf.clear();
        let n = r.read_until(b'\n', &mut buf)?;
        if n == 0 {
            return Ok((out, parsed));
        }
        let line = buf.strip_suffix(b"\n").unwrap_or(&buf);
        if !line.is_empty()
            && let Some((id, _, _)) = parse(line)
        {
            parsed += 1;
            out.insert(
                id,
                Line {
                    file,
                    at,
                    len: line.len(),
                },
            );
        }
        at += n as u64;
    }
}
