//! Call: runs the pipeline's `[model]` on every case, K samples each, and writes `calls`.
//!
//! Resumable by construction: `call_id` is a stable hash of the case, model, sample index
//! and request, completed calls are committed as Parquet parts every few seconds, and a
//! restarted stage skips every `call_id` already committed, so no completed call is paid
//! for twice and no row is duplicated.

pub mod vader;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use futures::StreamExt;
use sha2::{Digest, Sha256};

use crate::pipeline::ModelConfig;
use crate::schema::Table;
use crate::storage::{RunStore, StorageError};

/// Provider names accepted in `[model] provider`.
pub const KNOWN_PROVIDERS: &[&str] = &["builtin:vader", "openai", "anthropic"];

/// Errors of the call stage (per-call failures are rows, not errors).
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("model.provider: `{0}` cannot be built: {1}")]
    Provider(String, String),
}

/// One request to a model: what the provider needs to answer a case once.
#[derive(Debug, Clone)]
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
}

/// What came back (or failed) for one request. Everything a calls row records beyond
/// the request itself.
#[derive(Debug, Clone, Default)]
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
        other => Err(CallError::Provider(
            other.to_string(),
            "this provider is not available in this build".into(),
        )),
    }
}

fn sha_hex(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0u8]);
    }
    hex::encode(h.finalize())
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
    sha_hex(&[&params.to_string()])[..32].to_string()
}

/// `call_id`: stable across runs for the same case, model, sample and request.
pub fn call_id(case_id: &str, model: &str, sample_idx: i32, request_hash: &str) -> String {
    sha_hex(&[case_id, model, &sample_idx.to_string(), request_hash])[..24].to_string()
}

/// A hash of the answer, so re-scoring can prove it scored the same text.
pub fn response_hash(response: Option<&str>) -> Option<String> {
    response.map(|r| sha_hex(&[r])[..24].to_string())
}

/// Builds the requests for one batch of cases (all K samples each).
pub fn requests_for(model: &ModelConfig, cases: &RecordBatch) -> Vec<CallRequest> {
    let ids = str_col(cases, "case_id");
    let inputs = str_col(cases, "input");
    let mut out = Vec::with_capacity(cases.num_rows() * model.samples as usize);
    for i in 0..cases.num_rows() {
        let input = inputs.value(i).to_string();
        let prompt = match &model.prompt_template {
            Some(t) => t.replace("{input}", &input),
            None => input.clone(),
        };
        let rh = request_hash(model, model.system_prompt.as_deref(), &prompt);
        for k in 0..model.samples as i32 {
            out.push(CallRequest {
                call_id: call_id(ids.value(i), &model.name, k, &rh),
                case_id: ids.value(i).to_string(),
                input: input.clone(),
                prompt: prompt.clone(),
                system: model.system_prompt.clone(),
                sample_idx: k,
                max_tokens: model.max_tokens,
                temperature: model.temperature,
                request_hash: rh.clone(),
            });
        }
    }
    out
}

fn str_col<'a>(b: &'a RecordBatch, name: &str) -> &'a StringArray {
    b.column_by_name(name)
        .and_then(|c| c.as_any().downcast_ref::<StringArray>())
        .unwrap_or_else(|| panic!("column {name} is utf8 (checked against the schema on read)"))
}

/// A finished call: request, result and timing.
#[derive(Debug, Clone)]
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
            rows.iter().map(|r| r.res.attempts),
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
    ];
    RecordBatch::try_new(Table::Calls.schema(), cols)
        .expect("calls batch matches schemas/calls.json")
}

/// Reads the call ids already committed under `calls/`.
pub async fn committed_call_ids(store: &RunStore) -> Result<HashSet<String>, StorageError> {
    let mut ids = HashSet::new();
    let mut s = store.read_table("calls", Table::Calls).await?;
    while let Some(b) = s.next().await {
        let b = crate::schema::plain_strings(b?);
        let c = str_col(&b, "call_id");
        for i in 0..c.len() {
            ids.insert(c.value(i).to_string());
        }
    }
    Ok(ids)
}

/// Counters reported by the call stage.
#[derive(Debug, Default, Clone)]
pub struct CallStats {
    pub sent: u64,
    pub skipped: u64,
    pub errors: u64,
    pub rows_total: u64,
}

/// How often completed calls are committed, bounding what a crash can lose to the calls
/// in flight plus those finished within this window.
const COMMIT_EVERY: Duration = Duration::from_secs(2);
const COMMIT_ROWS: usize = 2000;

/// Runs the call stage: every case in `cases/` times K samples, skipping committed calls.
pub async fn run(
    store: &RunStore,
    model: &ModelConfig,
    provider: Arc<dyn Provider>,
) -> Result<CallStats, CallError> {
    let done = committed_call_ids(store).await?;
    let mut stats = CallStats {
        skipped: 0,
        ..Default::default()
    };
    let mut todo = Vec::new();
    let mut cases = store.read_table("cases", Table::Cases).await?;
    while let Some(b) = cases.next().await {
        for r in requests_for(model, &crate::schema::plain_strings(b?)) {
            if done.contains(&r.call_id) {
                stats.skipped += 1;
            } else {
                todo.push(r);
            }
        }
    }
    // Parts of this session sort after earlier sessions' parts.
    let session = chrono::Utc::now().format("%Y%m%dT%H%M%S%3f").to_string();
    let mut writer = store.part_writer("calls", Table::Calls.schema(), &format!("part-{session}"));
    let mut results = futures::stream::iter(todo.into_iter().map(|req| {
        let provider = provider.clone();
        async move {
            let started = chrono::Utc::now();
            let t0 = Instant::now();
            let res = provider.complete(&req).await;
            CallRow {
                latency_ms: t0.elapsed().as_secs_f64() * 1000.0,
                started_at_us: started.timestamp_micros(),
                req,
                res,
            }
        }
    }))
    .buffer_unordered(model.concurrency);
    let mut pending: Vec<CallRow> = Vec::new();
    let mut last_commit = Instant::now();
    while let Some(row) = results.next().await {
        stats.sent += 1;
        if row.res.error.is_some() {
            stats.errors += 1;
        }
        pending.push(row);
        if pending.len() >= COMMIT_ROWS || last_commit.elapsed() >= COMMIT_EVERY {
            writer.write(to_batch(model, &pending)).await?;
            writer.flush().await?;
            pending.clear();
            last_commit = Instant::now();
        }
    }
    if !pending.is_empty() {
        writer.write(to_batch(model, &pending)).await?;
    }
    writer.finish().await?;
    stats.rows_total = done.len() as u64 + stats.sent;
    Ok(stats)
}
