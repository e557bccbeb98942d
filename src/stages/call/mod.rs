//! Call: runs the pipeline's `[model]` on every case, K samples each, and writes `calls`.
//!
//! Exactly once by construction: `call_id` is a stable hash of the case, model, sample
//! index and request; every completed call is fsynced to a journal before it counts as
//! done ([`journal`]); journaled calls are committed as Parquet parts every few seconds;
//! a restarted stage first folds any journal left by a crash into a part, then skips
//! every committed `call_id`. A SIGKILL at any moment therefore re-sends at most the
//! calls in flight (never more than `concurrency`), loses no answered call, and writes
//! no duplicate row. A response cache ([`cache`]) makes re-running the same requests in
//! a new run root free.

pub mod anthropic;
pub mod batch;
pub mod cache;
pub mod deadline;
pub mod failures;
pub mod http;
pub mod journal;
pub mod limits;
pub mod openai;
pub mod progress;
pub mod retry;
mod todo;
pub mod vader;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::config::ModelConfig;
use crate::schema::Table;
use crate::storage::{PartWriter, RunStore, StorageError};
use todo::todo_stream;

/// The providers a `[model]` may name (declared with the pipeline format).
pub use crate::config::KNOWN_PROVIDERS;

/// Errors of the call stage (per-call failures are rows, not errors).
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The plan that lists the requests still to send failed.
    #[error(transparent)]
    Query(#[from] crate::query::QueryError),
    #[error("model.provider: `{0}` cannot be built: {1}")]
    Provider(String, String),
    /// Batch mode failed (stages/call/batch/).
    #[error(transparent)]
    Batch(#[from] batch::BatchError),
    /// The call journal could not be written or read.
    #[error("{path}: call journal: {source}")]
    Journal {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The provider answered [`failures::STOP_AFTER`] requests in a row with HTTP 403 (out
    /// of credit, or a key without access): the stage stopped sending, since every further
    /// request would be refused too. The answered calls are committed; the stage is left
    /// unfinished for a later command to resume.
    #[error(
        "call: stopped sending after {} HTTP 403 answers in a row (out of credit or forbidden: every further request would be refused \
         too); {rows} of {suite} calls are recorded, the rest were not sent.\n{summary}\nadd credit (or fix the key's access), then run \
         the same command to send the rest (--retry-errors sends the refused calls again too)",
        failures::STOP_AFTER
    )]
    Refused {
        /// Rows committed.
        rows: u64,
        /// Calls of the suite (cases x samples).
        suite: u64,
        /// [`failures::Failures::render`] of the committed rows.
        summary: String,
    },
    /// Every committed call ended in an error: there is nothing to validate or score.
    #[error(
        "call: no call succeeded: all {rows} calls ended in an error, by kind:\n{summary}\nfix the cause, then run the same command with \
         --retry-errors to send them again"
    )]
    NothingAnswered {
        rows: u64,
        /// [`failures::Failures::render`] of the committed rows.
        summary: String,
        /// Every failure says the request is wrong (HTTP 400, 401, 404): the model name,
        /// key or URL of the pipeline.
        bad_request: bool,
    },
}

impl CallError {
    /// Whether the user can fix it (exit 2): a provider that cannot be built, a plan over
    /// the memory limit, a bad root; a journal or I/O failure is not.
    pub fn is_bad_input(&self) -> bool {
        match self {
            CallError::Provider(..) => true,
            CallError::Query(e) => e.is_bad_input(),
            CallError::Storage(e) => e.is_bad_input(),
            CallError::Batch(e) => e.is_bad_input(),
            CallError::Journal { .. } | CallError::Refused { .. } => false,
            CallError::NothingAnswered { bad_request, .. } => *bad_request,
        }
    }
}

/// What a 2xx body says, in provider-neutral terms (shared by the
/// provider modules, `openai.rs` and `anthropic.rs`, and the HTTP client that calls them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub finish_reason: Option<String>,
    pub prompt_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
    pub reasoning_tokens: Option<i64>,
    pub reasoning_chars: Option<i64>,
}

/// One request to a model: what the provider needs to answer a case once.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CallRequest {
    pub call_id: String,
    pub case_id: String,
    /// The case's raw input text.
    pub input: String,
    /// The user message after `prompt_template` (equal to `input` when none).
    pub prompt: String,
    pub system: Option<String>,
    pub sample_idx: i32,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub request_hash: String,
    /// Attempts already spent on this call by the error row a retry replaces (0 otherwise):
    /// the new row's `attempts` counts them too.
    #[serde(default)]
    pub prior_attempts: i32,
}

/// What came back (or failed) for one request. Everything a calls row records beyond
/// the request itself.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CallResult {
    pub response: Option<String>,
    pub response_score: Option<f64>,
    pub finish_reason: Option<String>,
    pub prompt_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
    pub reasoning_tokens: Option<i64>,
    pub reasoning_chars: Option<i64>,
    pub http_status: Option<i32>,
    pub error: Option<String>,
    pub attempts: i32,
    /// Set when an empty `length` answer was retried once at double max_tokens.
    pub retried_for_budget: Option<bool>,
    /// The max_tokens of the attempt that produced this result, when it differs.
    pub max_tokens_used: Option<u32>,
}

/// A model under test. Implementations never panic or return errors: every failure is a
/// [`CallResult`] with `error` set, so it becomes a row that validate marks `provider_error`.
#[async_trait::async_trait]
pub trait Provider: Send + Sync {
    async fn complete(&self, req: &CallRequest) -> CallResult;
}

/// Builds the provider named in `[model]`.
pub fn build_provider(model: &ModelConfig) -> Result<Arc<dyn Provider>, CallError> {
    match model.provider.as_str() {
        "builtin:vader" => Ok(Arc::new(vader::Vader)),
        "openai" => Ok(Arc::new(http::HttpProvider::build(
            http::Wire::OpenAi,
            model,
        )?)),
        "anthropic" => Ok(Arc::new(http::HttpProvider::build(
            http::Wire::Anthropic,
            model,
        )?)),
        other => Err(CallError::Provider(
            other.to_string(),
            "this provider is not available in this build".into(),
        )),
    }
}

/// The first `chars` (even, at most 64) hex digits of the SHA-256 of `parts`, each part
/// followed by a NUL byte (so `["ab", "c"]` and `["a", "bc"]` differ).
pub(crate) fn sha_prefix(parts: &[&str], chars: usize) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0u8]);
    }
    let digest = h.finalize();
    let mut out = [0u8; 64];
    hex::encode_to_slice(&digest[..chars / 2], &mut out[..chars]).expect("64 hex digits fit");
    String::from_utf8(out[..chars].to_vec()).expect("hex digits are ASCII")
}

/// The hash of everything the server sees, apart from the sample index.
pub fn request_hash(model: &ModelConfig, system: Option<&str>, prompt: &str) -> String {
    let params = serde_json::json!({
        "provider": model.provider,
        "model": model.name,
        "system": system,
        "prompt": prompt,
        "max_tokens": model.max_tokens,
        "temperature": model.temperature,
        "params": model.params,
    });
    sha_prefix(&[&params.to_string()], 32)
}

/// `call_id`: stable across runs for the same case, model, sample and request.
pub fn call_id(case_id: &str, model: &str, sample_idx: i32, request_hash: &str) -> String {
    sha_prefix(&[case_id, model, &sample_idx.to_string(), request_hash], 24)
}

/// A hash of the answer, so re-scoring can prove it scored the same text.
pub fn response_hash(response: Option<&str>) -> Option<String> {
    response.map(|r| sha_prefix(&[r], 24))
}

/// The requests of one batch of the plan [`todo_stream`] returns: `case_id`, `input` and
/// the sample index `k` of each request still to send.
pub fn requests_for(model: &ModelConfig, todo: &RecordBatch) -> Vec<CallRequest> {
    let ids = str_col(todo, "case_id");
    let inputs = str_col(todo, "input");
    let ks = todo
        .column_by_name("k")
        .and_then(|c| c.as_any().downcast_ref::<Int32Array>())
        .expect("the todo plan has an int32 `k`");
    let prior = todo
        .column_by_name("prior_attempts")
        .and_then(|c| c.as_any().downcast_ref::<Int32Array>());
    (0..todo.num_rows())
        .map(|i| {
            let input = inputs.value(i).to_string();
            let prompt = prompt_of(model, &input);
            let rh = request_hash(model, model.system_prompt.as_deref(), &prompt);
            let k = ks.value(i);
            CallRequest {
                call_id: call_id(ids.value(i), &model.name, k, &rh),
                case_id: ids.value(i).to_string(),
                input,
                prompt,
                system: model.system_prompt.clone(),
                sample_idx: k,
                max_tokens: model.max_tokens,
                temperature: model.temperature,
                request_hash: rh,
                prior_attempts: prior.filter(|p| p.is_valid(i)).map_or(0, |p| p.value(i)),
            }
        })
        .collect()
}

/// The user message of a case: its input through `prompt_template`.
fn prompt_of(model: &ModelConfig, input: &str) -> String {
    match &model.prompt_template {
        Some(t) => t.replace("{input}", input),
        None => input.to_string(),
    }
}

fn str_col<'a>(b: &'a RecordBatch, name: &str) -> &'a StringArray {
    b.column_by_name(name)
        .and_then(|c| c.as_any().downcast_ref::<StringArray>())
        .unwrap_or_else(|| panic!("column {name} is utf8 (checked against the schema on read)"))
}

/// A finished call: request, result and timing.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CallRow {
    pub req: CallRequest,
    pub res: CallResult,
    pub latency_ms: f64,
    pub started_at_us: i64,
}

/// Builds a `calls` record batch.
pub fn to_batch(model: &ModelConfig, rows: &[CallRow]) -> RecordBatch {
    let s = |f: &dyn Fn(&CallRow) -> String| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
    };
    let os = |f: &dyn Fn(&CallRow) -> Option<String>| -> ArrayRef {
        Arc::new(rows.iter().map(f).collect::<StringArray>())
    };
    let i64c = |f: &dyn Fn(&CallRow) -> Option<i64>| -> ArrayRef {
        Arc::new(rows.iter().map(f).collect::<Int64Array>())
    };
    let cols: Vec<ArrayRef> = vec![
        s(&|r| r.req.call_id.clone()),
        s(&|r| r.req.case_id.clone()),
        s(&|_| model.name.clone()),
        s(&|_| model.provider.clone()),
        Arc::new(Int32Array::from_iter_values(
            rows.iter().map(|r| r.req.sample_idx),
        )),
        s(&|r| r.req.request_hash.clone()),
        os(&|r| r.res.response.clone()),
        Arc::new(
            rows.iter()
                .map(|r| r.res.response_score)
                .collect::<Float64Array>(),
        ),
        os(&|r| response_hash(r.res.response.as_deref())),
        os(&|r| r.res.finish_reason.clone()),
        i64c(&|r| r.res.prompt_tokens),
        i64c(&|r| r.res.completion_tokens),
        i64c(&|r| r.res.reasoning_tokens),
        i64c(&|r| r.res.reasoning_chars),
        Arc::new(
            rows.iter()
                .map(|r| r.res.http_status)
                .collect::<Int32Array>(),
        ),
        os(&|r| r.res.error.clone()),
        Arc::new(Int32Array::from_iter_values(
            rows.iter().map(|r| r.res.attempts + r.req.prior_attempts),
        )),
        Arc::new(Float64Array::from_iter_values(
            rows.iter().map(|r| r.latency_ms),
        )),
        Arc::new(
            rows.iter()
                .map(|r| r.res.max_tokens_used.or(r.req.max_tokens).map(|m| m as i32))
                .collect::<Int32Array>(),
        ),
        Arc::new(
            rows.iter()
                .map(|r| r.req.temperature)
                .collect::<Float64Array>(),
        ),
        Arc::new(
            TimestampMicrosecondArray::from_iter_values(rows.iter().map(|r| r.started_at_us))
                .with_timezone("UTC"),
        ),
        Arc::new(
            rows.iter()
                .map(|r| r.res.retried_for_budget)
                .collect::<BooleanArray>(),
        ),
        // `batch_id`: set by the batch path (stages/call/batch/).
        datafusion::arrow::array::new_null_array(
            &datafusion::arrow::datatypes::DataType::Utf8,
            rows.len(),
        ),
    ];
    RecordBatch::try_new(Table::Calls.schema(), cols)
        .expect("calls batch matches schemas/calls.json")
}

/// The committed rows of `ids` under `calls/`, as (started_at, answered) per id: the
/// `call_id` column streams past the set, so memory holds `ids` (a journal's worth), not
/// the committed table.
async fn committed_among(
    store: &RunStore,
    ids: &HashSet<String>,
    named: Option<&str>,
) -> Result<HashMap<String, Vec<(i64, bool)>>, StorageError> {
    let mut found: HashMap<String, Vec<(i64, bool)>> = HashMap::new();
    if ids.is_empty() {
        return Ok(found);
    }
    const COLUMNS: &[&str] = &["call_id", "error", "started_at"];
    let mut parts = store.list_parts("calls").await?;
    if let Some(prefix) = named {
        parts.retain(|m| m.location.filename().is_some_and(|f| f.starts_with(prefix)));
    }
    let this = store.clone();
    let mut s = futures::stream::iter(parts)
        .then(move |m| {
            let this = this.clone();
            async move { this.read_part_columns(&m, Table::Calls, COLUMNS).await }
        })
        .try_flatten()
        .boxed();
    while let Some(b) = s.next().await {
        let b = crate::schema::plain_strings(b?);
        let c = str_col(&b, "call_id");
        let errors = b.column_by_name("error").expect("calls have `error`");
        let started = b
            .column_by_name("started_at")
            .and_then(|c| c.as_any().downcast_ref::<TimestampMicrosecondArray>());
        for i in 0..c.len() {
            if ids.contains(c.value(i)) {
                let at = started
                    .filter(|s| s.is_valid(i))
                    .map_or(i64::MIN, |s| s.value(i));
                found
                    .entry(c.value(i).to_string())
                    .or_default()
                    .push((at, errors.is_null(i)));
            }
        }
    }
    Ok(found)
}

/// Counters reported by the call stage. Token totals and row counts are computed from
/// the committed table, never from a session counter, so they stay exact across restarts.
#[derive(Debug, Default, Clone)]
pub struct CallStats {
    /// Requests answered (or failed) by the provider in this session.
    pub sent: u64,
    /// Calls already committed when the session started.
    pub skipped: u64,
    /// Calls of this session that ended with an error.
    pub errors: u64,
    /// Calls recovered from a crashed session's journal.
    pub recovered: u64,
    /// Calls of this session served from the response cache.
    pub cache_hits: u64,
    /// Error rows replaced by a retry (`--retry-errors`), this session or a killed one.
    pub retried: u64,
    /// Rows in the committed table.
    pub rows_total: u64,
    /// Committed rows with an error.
    pub error_rows: u64,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub reasoning_tokens: i64,
    /// Batch mode: batches created in this session.
    pub batches_created: u64,
    /// Batch mode: batches whose results were committed in this session.
    pub batches_collected: u64,
    /// Batch mode: lines of this session's batches to be sent again in a later batch.
    pub batch_retries: u64,
    /// Batch mode: the batches not yet collected (`--no-wait`).
    pub open_batches: Vec<batch::OpenBatch>,
    /// Committed tokens of rows that came through a batch (billed at half price).
    pub batch_prompt_tokens: i64,
    pub batch_completion_tokens: i64,
    /// The committed rows' cost in dollars under `[model] price`, with the batch discount,
    /// and what it would have cost without it.
    pub cost: Option<(f64, f64)>,
    /// The committed error rows by kind, with the first message of each.
    pub failures: failures::Failures,
}

impl CallStats {
    /// The facts recorded in the manifest's `call` stage details.
    pub fn details(&self) -> BTreeMap<String, serde_json::Value> {
        use serde_json::json;
        BTreeMap::from([
            ("sent_this_session".into(), json!(self.sent)),
            ("already_committed".into(), json!(self.skipped)),
            ("errors_this_session".into(), json!(self.errors)),
            ("recovered_from_journal".into(), json!(self.recovered)),
            ("cache_hits_this_session".into(), json!(self.cache_hits)),
            ("errors_retried".into(), json!(self.retried)),
            ("error_rows".into(), json!(self.error_rows)),
            ("prompt_tokens".into(), json!(self.prompt_tokens)),
            ("completion_tokens".into(), json!(self.completion_tokens)),
            ("reasoning_tokens".into(), json!(self.reasoning_tokens)),
            ("batches_created".into(), json!(self.batches_created)),
            ("batches_collected".into(), json!(self.batches_collected)),
            ("batch_lines_to_resend".into(), json!(self.batch_retries)),
            ("open_batches".into(), json!(self.open_batches)),
            (
                "batch_prompt_tokens".into(),
                json!(self.batch_prompt_tokens),
            ),
            (
                "batch_completion_tokens".into(),
                json!(self.batch_completion_tokens),
            ),
            ("cost_usd".into(), json!(self.cost.map(|c| c.0))),
            (
                "cost_usd_without_batch_discount".into(),
                json!(self.cost.map(|c| c.1)),
            ),
        ])
    }

    /// [`CallError::NothingAnswered`] when the committed table has rows and every one is an
    /// error (and no batch is still open).
    ///
    /// # Errors
    /// As said: no call succeeded.
    pub fn some_answered(&self) -> Result<(), CallError> {
        if self.open_batches.is_empty() && self.rows_total > 0 && self.error_rows == self.rows_total
        {
            return Err(CallError::NothingAnswered {
                rows: self.rows_total,
                summary: self.failures.render(),
                bad_request: self.failures.all_bad_requests(),
            });
        }
        Ok(())
    }

    /// Prices the committed tokens under `[model] price`: batch rows at half price.
    pub fn price(&mut self, model: &ModelConfig) {
        self.cost = model.price.map(|p| {
            let at = |inp: i64, out: i64| {
                (inp as f64 * p.input_per_mtok + out as f64 * p.output_per_mtok) / 1e6
            };
            let full = at(self.prompt_tokens, self.completion_tokens);
            let batch = at(self.batch_prompt_tokens, self.batch_completion_tokens);
            (full - batch * BATCH_DISCOUNT, full)
        });
    }
}

/// The share of the price a batch request saves (OpenAI and Anthropic: half).
pub const BATCH_DISCOUNT: f64 = 0.5;

/// How often completed calls are committed, bounding the journal's length.
const COMMIT_EVERY: Duration = Duration::from_secs(2);
const COMMIT_ROWS: usize = 20_000;
/// Most rows journaled with one fsync.
const GROUP_ROWS: usize = 4096;

fn jerr(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> CallError + '_ {
    move |source| CallError::Journal {
        path: path.display().to_string(),
        source,
    }
}

/// Folds journals left by earlier sessions into a part, skipping committed call ids.
async fn recover(
    store: &RunStore,
    model: &ModelConfig,
    dir: &std::path::Path,
    session: &str,
) -> Result<u64, CallError> {
    let (rows, files) = {
        let d = dir.to_path_buf();
        tokio::task::spawn_blocking(move || journal::recover(&d))
            .await
            .expect("journal recovery does not panic")
            .map_err(jerr(dir))?
    };
    if files.is_empty() {
        return Ok(0);
    }
    let ids: HashSet<String> = rows.iter().map(|r| r.req.call_id.clone()).collect();
    let committed = committed_among(store, &ids, None).await?;
    // A journaled row is new unless its call is answered in `calls/` or this very row (same
    // start) was committed; a retry's row beside its committed error row is new, and the
    // error row is dropped when the retry finishes ([`retry`]).
    let mut seen = HashSet::new();
    let fresh: Vec<CallRow> = rows
        .into_iter()
        .filter(|r| {
            let done = committed.get(&r.req.call_id).is_some_and(|v| {
                v.iter()
                    .any(|(at, answered)| *answered || *at == r.started_at_us)
            });
            !done && seen.insert(r.req.call_id.clone())
        })
        .collect();
    if !fresh.is_empty() {
        let mut w = store.part_writer(
            "calls",
            Table::Calls.schema(),
            &format!("part-{session}-recovered"),
        );
        for chunk in fresh.chunks(8192) {
            w.write(to_batch(model, chunk)).await?;
        }
        w.finish().await?;
    }
    journal::remove(&files).map_err(jerr(dir))?;
    Ok(fresh.len() as u64)
}

/// Sums of the committed table, for the manifest.
async fn committed_totals(store: &RunStore, stats: &mut CallStats) -> Result<(), StorageError> {
    const COLUMNS: &[&str] = &[
        "error",
        "http_status",
        "prompt_tokens",
        "completion_tokens",
        "reasoning_tokens",
        "batch_id",
    ];
    let mut s = store
        .read_table_columns("calls", Table::Calls, Some(COLUMNS))
        .await?;
    let (mut rows, mut errs, mut p, mut c, mut r) = (0u64, 0u64, 0i64, 0i64, 0i64);
    stats.batch_prompt_tokens = 0;
    stats.batch_completion_tokens = 0;
    stats.failures = failures::Failures::default();
    let sum = |b: &RecordBatch, name: &str| -> i64 {
        b.column_by_name(name)
            .and_then(|c| c.as_any().downcast_ref::<Int64Array>())
            .map(|a| a.iter().flatten().sum())
            .unwrap_or(0)
    };
    while let Some(b) = s.next().await {
        let b = b?;
        rows += b.num_rows() as u64;
        errs += b
            .column_by_name("error")
            .map(|c| (c.len() - c.null_count()) as u64)
            .unwrap_or(0);
        let b = crate::schema::plain_strings(b);
        if let (Some(e), Some(st)) = (
            b.column_by_name("error")
                .and_then(|c| c.as_any().downcast_ref::<StringArray>()),
            b.column_by_name("http_status")
                .and_then(|c| c.as_any().downcast_ref::<Int32Array>()),
        ) {
            for i in (0..e.len()).filter(|i| e.is_valid(*i)) {
                stats
                    .failures
                    .add(st.is_valid(i).then(|| st.value(i)), e.value(i));
            }
        }
        p += sum(&b, "prompt_tokens");
        c += sum(&b, "completion_tokens");
        r += sum(&b, "reasoning_tokens");
        // Rows that came through a batch carry its id (stages/call/batch/): their tokens
        // are billed at the batch price.
        if let Some(bid) = b.column_by_name("batch_id") {
            let tok = |name: &str| {
                b.column_by_name(name)
                    .and_then(|c| c.as_any().downcast_ref::<Int64Array>())
                    .cloned()
            };
            let (bp, bc) = (tok("prompt_tokens"), tok("completion_tokens"));
            for i in (0..b.num_rows()).filter(|i| bid.is_valid(*i)) {
                let v = |a: &Option<Int64Array>| {
                    a.as_ref()
                        .filter(|a| a.is_valid(i))
                        .map_or(0, |a| a.value(i))
                };
                stats.batch_prompt_tokens += v(&bp);
                stats.batch_completion_tokens += v(&bc);
            }
        }
    }
    stats.rows_total = rows;
    stats.error_rows = errs;
    stats.prompt_tokens = p;
    stats.completion_tokens = c;
    stats.reasoning_tokens = r;
    Ok(())
}

/// Answers one request, from the cache when it can; the flag says it did.
async fn call_one(
    provider: Arc<dyn Provider>,
    cache: Option<cache::Cache>,
    req: CallRequest,
) -> (CallRow, bool) {
    let started = chrono::Utc::now();
    if let Some(hit) = cache.as_ref().and_then(|c| c.get(&req)) {
        let row = CallRow {
            latency_ms: hit.latency_ms,
            started_at_us: started.timestamp_micros(),
            req,
            res: hit.result,
        };
        return (row, true);
    }
    let t0 = Instant::now();
    let res = provider.complete(&req).await;
    let row = CallRow {
        latency_ms: t0.elapsed().as_secs_f64() * 1000.0,
        started_at_us: started.timestamp_micros(),
        req,
        res,
    };
    (row, false)
}

/// How a call session runs, beyond the model.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Send again the calls whose committed row is an error, replacing that row in place
    /// (`--retry-errors`); answered calls are never sent again.
    pub retry_errors: bool,
}

/// Runs the call stage: every case in `cases/` times K samples, skipping committed calls
/// (and, with the model's `retry_errors`, sending its error rows' calls again).
///
/// # Errors
/// Storage and journal I/O failures only; a failed call is a row, not an error.
pub async fn run(
    store: &RunStore,
    model: &ModelConfig,
    provider: Arc<dyn Provider>,
) -> Result<CallStats, CallError> {
    let opts = Options {
        retry_errors: model.retry_errors,
    };
    run_with(store, model, provider, opts).await
}

/// [`run`] with [`Options`].
pub async fn run_with(
    store: &RunStore,
    model: &ModelConfig,
    provider: Arc<dyn Provider>,
    opts: Options,
) -> Result<CallStats, CallError> {
    // Parts of this session sort after earlier sessions' parts.
    let session = chrono::Utc::now().format("%Y%m%dT%H%M%S%3f").to_string();
    let mut stats = CallStats::default();
    let jdir = journal::dir_for(store);
    if let Some(d) = &jdir {
        stats.recovered = recover(store, model, d, &session).await?;
    }
    // A killed retry's replaced rows go before anything is counted or sent.
    stats.retried = retry::finish_pending(store).await?;
    if opts.retry_errors {
        retry::begin(store, &session).await?;
    }
    if model.batch {
        let open = batch::run(store, model, opts, &session, &mut stats).await?;
        stats.open_batches = open;
        if opts.retry_errors && stats.open_batches.is_empty() {
            stats.retried += retry::finish_pending(store).await?;
        }
        committed_totals(store, &mut stats).await?;
        stats.price(model);
        return Ok(stats);
    }
    // Every request of the suite, and those committed (an estimate of the work for the
    // progress bar; the exact count of skipped calls is known when the stream ends).
    let suite = store.table_rows("cases").await? * u64::from(model.samples.max(1));
    let committed = store.table_rows("calls").await?;
    let mut todo = todo_stream(store, model, opts.retry_errors).await?;
    let cache = if model.provider.starts_with("builtin:") {
        None
    } else {
        match cache::dir_for_root(store) {
            Some(d) => {
                let (url, session) = (model.base_url.clone().unwrap_or_default(), session.clone());
                Some(
                    tokio::task::spawn_blocking(move || cache::Cache::open(&d, &url, &session))
                        .await
                        .expect("opening the cache does not panic"),
                )
            }
            None => None,
        }
    };
    let total = suite.saturating_sub(committed);
    let mut journal = match &jdir {
        Some(d) => Some(journal::Journal::open(d, &session).map_err(jerr(d))?),
        _ => None,
    };
    let mut writer =
        Some(store.part_writer("calls", Table::Calls.schema(), &format!("part-{session}")));
    let mut committing: Option<tokio::task::JoinHandle<Result<PartWriter, CallError>>> = None;

    // Each call is its own task, so requests progress while this task writes; a permit is
    // held from before the request until the answer is journaled.
    let sem = Arc::new(Semaphore::new(model.concurrency.max(1)));
    let (tx, mut rx) = mpsc::unbounded_channel::<((CallRow, bool), OwnedSemaphorePermit)>();
    // The requests are listed (the plan's next batch, its ids hashed) a batch or two ahead
    // by their own task, so a free slot never waits for the plan.
    let (req_tx, mut req_rx) = mpsc::channel::<Vec<CallRequest>>(2);
    let lister = {
        let model = model.clone();
        tokio::spawn(async move {
            while let Some(b) = todo.next().await {
                let reqs = requests_for(&model, &crate::schema::plain_strings(b?));
                if req_tx.send(reqs).await.is_err() {
                    break;
                }
            }
            Ok::<(), datafusion::error::DataFusionError>(())
        })
    };
    // A run of out-of-credit answers stops the sending (the requests in flight finish).
    let refusals = Arc::new(failures::Refusals::default());
    let producer = {
        let provider = provider.clone();
        let cache = cache.clone();
        let refusals = refusals.clone();
        tokio::spawn(async move {
            let mut queued = 0u64;
            while let Some(reqs) = req_rx.recv().await {
                for req in reqs {
                    if refusals.stopped() {
                        return queued;
                    }
                    let Ok(permit) = sem.clone().acquire_owned().await else {
                        return queued;
                    };
                    // The slot may have come free on the answer that stopped the stage.
                    if refusals.stopped() {
                        return queued;
                    }
                    queued += 1;
                    let tx = tx.clone();
                    let provider = provider.clone();
                    let cache = cache.clone();
                    let refusals = refusals.clone();
                    tokio::spawn(async move {
                        let row = call_one(provider, cache, req).await;
                        if !row.1 {
                            refusals.observe(&row.0.res);
                        }
                        let _ = tx.send((row, permit));
                    });
                }
            }
            queued
        })
    };

    // Cache entries are written by their own thread, after the permits are released: a
    // cache write is an optimisation, so it never holds a request slot.
    let (cache_tx, cache_writer) = match &cache {
        Some(c) => {
            let (tx, mut crx) = mpsc::channel::<Vec<CallRow>>(64);
            let c = c.clone();
            let h = std::thread::spawn(move || {
                while let Some(rows) = crx.blocking_recv() {
                    c.put_all(rows.iter().map(|r| (&r.req, &r.res, r.latency_ms)));
                }
            });
            (Some(tx), Some(h))
        }
        None => (None, None),
    };

    let mut progress = progress::Progress::new(total);
    let mut pending: Vec<CallRow> = Vec::new();
    let mut last_commit = Instant::now();
    let mut group: Vec<((CallRow, bool), OwnedSemaphorePermit)> = Vec::new();
    while rx.recv_many(&mut group, GROUP_ROWS).await > 0 {
        let (rows, permits): (Vec<(CallRow, bool)>, Vec<OwnedSemaphorePermit>) =
            group.drain(..).unzip();
        let mut to_cache = Vec::new();
        for (r, cached) in &rows {
            stats.sent += u64::from(!cached);
            stats.cache_hits += u64::from(*cached);
            if r.res.error.is_some() {
                stats.errors += 1;
            }
            if !cached && r.res.error.is_none() && cache_tx.is_some() {
                to_cache.push(r.clone());
            }
        }
        let rows: Vec<CallRow> = rows.into_iter().map(|(r, _)| r).collect();
        progress.advance(rows.len() as u64, stats.errors);
        if let Some(mut j) = journal.take() {
            let lines = journal::Journal::encode(&rows);
            let (j, res) = tokio::task::spawn_blocking(move || {
                let res = j.append(&lines);
                (j, res)
            })
            .await
            .expect("journal append does not panic");
            res.map_err(jerr(j.path()))?;
            journal = Some(j);
        }
        drop(permits);
        if let Some(tx) = &cache_tx
            && !to_cache.is_empty()
        {
            // The writer only stops when this sender is dropped.
            let _ = tx.send(to_cache).await;
        }
        pending.extend(rows);
        if pending.len() >= COMMIT_ROWS || last_commit.elapsed() >= COMMIT_EVERY {
            // The rows go to a new journal file while the old one's are committed by a task
            // of their own (the loop goes on releasing slots); the old file is deleted once
            // its part is durable. One commit at a time: the last one ended long ago.
            if let Some(h) = committing.take() {
                writer = Some(h.await.expect("a commit does not panic")?);
            }
            let mut w = writer.take().expect("the writer is back");
            let old = match journal.as_mut() {
                Some(j) => Some(j.next_file().map_err(|source| CallError::Journal {
                    path: j.path().display().to_string(),
                    source,
                })?),
                None => None,
            };
            let rows = std::mem::take(&mut pending);
            let model = model.clone();
            committing = Some(tokio::spawn(async move {
                w.write(to_batch(&model, &rows)).await?;
                w.flush().await?;
                if let Some(old) = old {
                    journal::remove(std::slice::from_ref(&old)).map_err(jerr(&old))?;
                }
                Ok::<_, CallError>(w)
            }));
            last_commit = Instant::now();
        }
    }
    let queued = producer.await.expect("the request producer does not panic");
    let listed = lister.await.expect("the request lister does not panic");
    if let Some(h) = committing.take() {
        writer = Some(h.await.expect("a commit does not panic")?);
    }
    let mut writer = writer.expect("the writer is back");
    if !pending.is_empty() {
        writer.write(to_batch(model, &pending)).await?;
    }
    writer.finish().await?;
    if let Some(j) = journal {
        let p = j.path().to_path_buf();
        j.close().map_err(jerr(&p))?;
    }
    drop(cache_tx);
    if let Some(h) = cache_writer {
        let _ = tokio::task::spawn_blocking(move || h.join()).await;
    }
    progress.finish(stats.errors);
    // Committed rows are safe whatever the plan did; its failure is reported after them.
    listed.map_err(crate::query::QueryError::df(
        "call: listing the requests still to send",
    ))?;
    stats.skipped = suite.saturating_sub(queued).saturating_sub(stats.recovered);
    if opts.retry_errors {
        stats.retried += retry::finish_pending(store).await?;
    }
    committed_totals(store, &mut stats).await?;
    stats.price(model);
    if refusals.stopped() {
        return Err(CallError::Refused {
            rows: stats.rows_total,
            suite,
            summary: stats.failures.render(),
        });
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sha_prefix_is_the_digest_of_nul_terminated_parts_cut() {
        // hashlib.sha256(b"a\x00bc\x00").hexdigest()
        assert_eq!(
            super::sha_prefix(&["a", "bc"], 24),
            "aa795aa4bbb6117911ef062e"
        );
        assert_ne!(
            super::sha_prefix(&["ab", "c"], 24),
            super::sha_prefix(&["a", "bc"], 24)
        );
        assert_eq!(super::sha_prefix(&["a", "bc"], 64).len(), 64);
    }
}
