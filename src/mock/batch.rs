//! The mock's OpenAI Batch API: files, batches, their output and error files.
//!
//! # Behavior
//! - `POST /v1/files` (multipart, `purpose` and `file`), `GET /v1/files/{id}` and
//!   `GET /v1/files/{id}/content`; `POST /v1/batches` (`input_file_id`, `endpoint`,
//!   `completion_window`, `metadata`), `GET /v1/batches/{id}`, `GET /v1/batches` (newest
//!   first, `after` and `limit`) and `POST /v1/batches/{id}/cancel`.
//! - A batch is `validating` for the first tenth of `--batch-secs`, `in_progress` until
//!   `--batch-secs` after its creation, then final. Its lines are answered when it becomes
//!   final (or is cancelled), each exactly as the synchronous endpoint would answer it: same
//!   answer mode, same `--fault` draws (a transport fault is a 500 line), each line logged
//!   in the request log as a request (`path` = `batch:/v1/chat/completions`, `call_id` = the
//!   line's `custom_id`, request hash = the body's hash). The create itself is logged as
//!   `{"path": "/v1/batches", "batch_id", "custom_ids", "metadata"}`, its end as
//!   `{"path": "batch_final", "batch_id", "status", "created", "final", "lines"}`.
//! - Answered lines with status 200 go to the output file, the others (and the lines an
//!   expiry or a cancel left unanswered, `batch_expired` / `batch_cancelled`) to the error
//!   file, in OpenAI's line format `{"id", "custom_id", "response": {"status_code",
//!   "request_id", "body"}, "error"}`.
//! - Batch faults (`--batch-fault KIND=RATE`, drawn per batch or per poll from the seed):
//!   `invalid` (the batch fails validation), `expire` (it expires with its first half
//!   answered), `poll_error` (a retrieve answers 500), `cut_results` (the first download of
//!   each of its result files stops mid-line).

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::{Fault, Incoming, MockState, error, openai_json, uniform};

/// A fault of the batch interface (not of a line: per-line faults are `--fault`'s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchFault {
    /// The batch fails validation: no line is answered.
    Invalid,
    /// The batch expires with the first half of its lines answered.
    Expire,
    /// A retrieve of the batch answers 500.
    PollError,
    /// The first download of each of the batch's result files is cut short mid-line.
    CutResults,
}

impl BatchFault {
    pub const ALL: [BatchFault; 4] = [
        BatchFault::Invalid,
        BatchFault::Expire,
        BatchFault::PollError,
        BatchFault::CutResults,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BatchFault::Invalid => "invalid",
            BatchFault::Expire => "expire",
            BatchFault::PollError => "poll_error",
            BatchFault::CutResults => "cut_results",
        }
    }
}

/// Parses `--batch-fault KIND=RATE`.
///
/// # Errors
/// A message naming the bad part.
pub fn parse_batch_fault(s: &str) -> Result<(BatchFault, f64), String> {
    let (k, r) = s
        .split_once('=')
        .ok_or_else(|| format!("--batch-fault `{s}`: expected KIND=RATE, e.g. expire=0.5"))?;
    let fault = BatchFault::ALL
        .into_iter()
        .find(|f| f.name() == k.trim())
        .ok_or_else(|| {
            format!(
                "--batch-fault `{s}`: unknown kind `{k}` (known: {})",
                BatchFault::ALL.map(BatchFault::name).join(", ")
            )
        })?;
    let rate: f64 = r
        .trim()
        .parse()
        .map_err(|_| format!("--batch-fault `{s}`: rate `{r}` is not a number"))?;
    if !(0.0..=1.0).contains(&rate) {
        return Err(format!("--batch-fault `{s}`: rate must be in [0, 1]"));
    }
    Ok((fault, rate))
}

/// The batch interfaces' time scale and faults.
#[derive(Debug, Clone)]
pub struct BatchConfig {
    /// How long after its creation a batch is final (the real APIs: up to 24 hours).
    pub complete_after: Duration,
    /// Batch faults and their rates, each drawn on its own.
    pub faults: Vec<(BatchFault, f64)>,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            complete_after: Duration::from_secs(1),
            faults: vec![],
        }
    }
}

impl BatchConfig {
    pub(super) fn check(&self) -> std::io::Result<()> {
        match self.faults.iter().find(|f| !(0.0..=1.0).contains(&f.1)) {
            Some((f, r)) => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("batch fault {} rate {r} is not in [0, 1]", f.name()),
            )),
            None => Ok(()),
        }
    }

    pub(super) fn rate(&self, f: BatchFault) -> f64 {
        self.faults
            .iter()
            .filter(|(k, _)| *k == f)
            .map(|(_, r)| r)
            .sum()
    }
}

/// The batch endpoint's files and batches.
#[derive(Default)]
pub(super) struct Store {
    files: HashMap<String, MockFile>,
    /// In creation order.
    batches: Vec<MockBatch>,
    next_file: u64,
    polls: HashMap<String, u64>,
    /// Result files whose next download is cut short.
    cut_pending: HashSet<String>,
}

struct MockFile {
    bytes: Arc<Vec<u8>>,
    filename: String,
    purpose: String,
    created_at: u64,
}

#[derive(Clone)]
struct MockBatch {
    id: String,
    input_file_id: String,
    endpoint: String,
    completion_window: String,
    metadata: Value,
    created_at: u64,
    /// Seconds since the epoch, for the log.
    created_f: f64,
    t0: Instant,
    total: usize,
    /// Validation errors (the batch fails) as `{code, message, line}`.
    invalid: Vec<Value>,
    expire: bool,
    cut: bool,
    cancel_requested: Option<u64>,
    /// Set when final: status, completed, failed, output and error file ids, when.
    fin: Option<Final>,
}

#[derive(Clone)]
struct Final {
    status: &'static str,
    completed: usize,
    failed: usize,
    output_file_id: Option<String>,
    error_file_id: Option<String>,
    at: u64,
}

fn unix_f() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(super) fn routes() -> Router<Arc<MockState>> {
    Router::new()
        .route("/v1/files", post(upload))
        .route("/v1/files/{id}", get(file_info))
        .route("/v1/files/{id}/content", get(file_content))
        .route("/v1/batches", post(create).get(list))
        .route("/v1/batches/{id}", get(retrieve))
        .route("/v1/batches/{id}/cancel", post(cancel))
        // Input files of up to 200 MB (axum's default limit is 2 MB).
        .layer(axum::extract::DefaultBodyLimit::max(210 * 1024 * 1024))
}

fn bad(msg: &str) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", msg)
}

fn not_found(what: &str) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        &format!("No such {what}"),
    )
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    let first = needle[0];
    let mut i = from;
    while i + needle.len() <= hay.len() {
        match hay[i..hay.len() - needle.len() + 1]
            .iter()
            .position(|&b| b == first)
        {
            None => return None,
            Some(p) => {
                i += p;
                if &hay[i..i + needle.len()] == needle {
                    return Some(i);
                }
                i += 1;
            }
        }
    }
    None
}

/// One part of a multipart body: its name, file name and content.
type Part = (String, Option<String>, Vec<u8>);

/// The parts of a `multipart/form-data` body.
fn multipart(headers: &HeaderMap, body: &[u8]) -> Result<Vec<Part>, String> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let boundary = ct
        .split(';')
        .find_map(|p| p.trim().strip_prefix("boundary="))
        .map(|b| b.trim_matches('"').to_string())
        .ok_or("Content-Type: multipart/form-data with a boundary is required")?;
    let delim = format!("--{boundary}").into_bytes();
    let mut parts = Vec::new();
    let mut pos = find(body, &delim, 0).ok_or("no multipart boundary in the body")? + delim.len();
    loop {
        if body[pos..].starts_with(b"--") {
            break;
        }
        pos += 2; // CRLF after the boundary
        let head_end = find(body, b"\r\n\r\n", pos).ok_or("a part without headers")?;
        let head = String::from_utf8_lossy(&body[pos..head_end]).to_string();
        let start = head_end + 4;
        let mut next_delim = b"\r\n".to_vec();
        next_delim.extend_from_slice(&delim);
        let end = find(body, &next_delim, start).ok_or("a part without its closing boundary")?;
        let attr = |k: &str| {
            head.split([';', '\r', '\n']).find_map(|p| {
                p.trim()
                    .strip_prefix(&format!("{k}="))
                    .map(|v| v.trim_matches('"').to_string())
            })
        };
        let name = attr("name").ok_or("a part without a name")?;
        parts.push((name, attr("filename"), body[start..end].to_vec()));
        pos = end + next_delim.len();
    }
    Ok(parts)
}

fn file_json(id: &str, f: &MockFile) -> Value {
    json!({"id": id, "object": "file", "bytes": f.bytes.len(), "created_at": f.created_at,
           "filename": f.filename, "purpose": f.purpose})
}

impl Store {
    fn add_file(&mut self, bytes: Vec<u8>, filename: String, purpose: &str) -> String {
        self.next_file += 1;
        let id = format!("file-mock{:08}", self.next_file);
        self.files.insert(
            id.clone(),
            MockFile {
                bytes: Arc::new(bytes),
                filename,
                purpose: purpose.to_string(),
                created_at: unix_now(),
            },
        );
        id
    }
}

async fn upload(State(st): State<Arc<MockState>>, headers: HeaderMap, raw: Bytes) -> Response {
    let parts = match multipart(&headers, &raw) {
        Ok(p) => p,
        Err(e) => return bad(&e),
    };
    let purpose = parts
        .iter()
        .find(|p| p.0 == "purpose")
        .map(|p| String::from_utf8_lossy(&p.2).to_string());
    let Some(file) = parts.iter().find(|p| p.0 == "file") else {
        return bad("missing the `file` part");
    };
    let Some(purpose) = purpose else {
        return bad("missing the `purpose` part");
    };
    let filename = file.1.clone().unwrap_or_else(|| "upload".into());
    let mut s = st.batches.lock().unwrap();
    let id = s.add_file(file.2.clone(), filename, &purpose);
    axum::Json(file_json(&id, &s.files[&id])).into_response()
}

async fn file_info(State(st): State<Arc<MockState>>, Path(id): Path<String>) -> Response {
    let s = st.batches.lock().unwrap();
    match s.files.get(&id) {
        Some(f) => axum::Json(file_json(&id, f)).into_response(),
        None => not_found("file"),
    }
}

async fn file_content(State(st): State<Arc<MockState>>, Path(id): Path<String>) -> Response {
    let (bytes, cut) = {
        let mut s = st.batches.lock().unwrap();
        let Some(f) = s.files.get(&id) else {
            return not_found("file");
        };
        let bytes = f.bytes.clone();
        (bytes, s.cut_pending.remove(&id))
    };
    let body: Vec<u8> = if cut {
        // Mid-line: 60% of the bytes, then one more byte past a line start.
        bytes[..(bytes.len() * 3 / 5).max(1).min(bytes.len())].to_vec()
    } else {
        bytes.to_vec()
    };
    ([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response()
}

/// Checks a batch input file; the validation errors (empty when it is valid).
fn validate(content: &[u8], endpoint: &str) -> (usize, Vec<Value>) {
    let mut errors = Vec::new();
    let mut seen = HashSet::new();
    let mut n = 0;
    for (i, line) in content.split(|&b| b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        n += 1;
        let mut err = |code: &str, msg: String| {
            if errors.len() < 100 {
                errors.push(json!({"code": code, "message": msg, "line": i + 1, "param": null}));
            }
        };
        let v: Value = match serde_json::from_slice(line) {
            Ok(v) => v,
            Err(e) => {
                err("invalid_json_line", format!("line {}: {e}", i + 1));
                continue;
            }
        };
        match v.get("custom_id").and_then(Value::as_str) {
            Some(c) if seen.insert(c.to_string()) => {}
            Some(c) => err(
                "duplicate_custom_id",
                format!("custom_id {c} appears twice"),
            ),
            None => err("missing_required_parameter", "custom_id".into()),
        }
        if v.get("method").and_then(Value::as_str) != Some("POST") {
            err("invalid_method", "method must be POST".into());
        }
        if v.get("url").and_then(Value::as_str) != Some(endpoint) {
            err("mismatched_url", format!("url must be {endpoint}"));
        }
        if !v.get("body").is_some_and(Value::is_object) {
            err("missing_required_parameter", "body".into());
        }
    }
    if n == 0 {
        errors.push(json!({"code": "empty_file", "message": "the input file has no line", "line": null, "param": null}));
    }
    (n, errors)
}

pub(super) fn log_line(st: &MockState, v: Value) {
    if let Some(log) = &st.log {
        let mut w = log.lock().unwrap();
        let _ = writeln!(w, "{v}");
        let _ = w.flush();
    }
}

async fn create(State(st): State<Arc<MockState>>, raw: Bytes) -> Response {
    let req: Value = match serde_json::from_slice(&raw) {
        Ok(v) => v,
        Err(e) => return bad(&format!("request body is not JSON: {e}")),
    };
    let Some(input) = req.get("input_file_id").and_then(Value::as_str) else {
        return bad("input_file_id is required");
    };
    let endpoint = req.get("endpoint").and_then(Value::as_str).unwrap_or("");
    if endpoint != "/v1/chat/completions" {
        return bad("endpoint: this mock serves /v1/chat/completions only");
    }
    let window = req
        .get("completion_window")
        .and_then(Value::as_str)
        .unwrap_or("");
    if window != "24h" {
        return bad("completion_window must be 24h");
    }
    let metadata = req.get("metadata").cloned().unwrap_or(Value::Null);
    let mut s = st.batches.lock().unwrap();
    let Some(file) = s.files.get(input) else {
        return bad(&format!("input_file_id {input}: no such file"));
    };
    let content = file.bytes.clone();
    let (total, mut invalid) = validate(&content, endpoint);
    let id = format!("batch_mock{:08}", s.batches.len() + 1);
    let seed = st.cfg.seed.to_be_bytes();
    let draw = |f: BatchFault| uniform(&[&seed, id.as_bytes(), f.name().as_bytes()]);
    if invalid.is_empty() && draw(BatchFault::Invalid) < st.batch_cfg.rate(BatchFault::Invalid) {
        invalid.push(json!({"code": "invalid_request", "message": "the batch failed validation (mock fault)", "line": null, "param": null}));
    }
    let b = MockBatch {
        id: id.clone(),
        input_file_id: input.to_string(),
        endpoint: endpoint.to_string(),
        completion_window: window.to_string(),
        metadata: metadata.clone(),
        created_at: unix_now(),
        created_f: unix_f(),
        t0: Instant::now(),
        total,
        invalid,
        expire: draw(BatchFault::Expire) < st.batch_cfg.rate(BatchFault::Expire),
        cut: draw(BatchFault::CutResults) < st.batch_cfg.rate(BatchFault::CutResults),
        cancel_requested: None,
        fin: None,
    };
    let custom_ids: Vec<String> = content
        .split(|&c| c == b'\n')
        .filter_map(|l| serde_json::from_slice::<Value>(l).ok())
        .filter_map(|v| v.get("custom_id").and_then(Value::as_str).map(String::from))
        .collect();
    log_line(
        &st,
        json!({"seq": st.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed), "t": unix_now(),
               "path": "/v1/batches", "batch_id": id, "metadata": metadata,
               "custom_ids": custom_ids}),
    );
    let out = batch_json(&st, &b);
    s.batches.push(b);
    axum::Json(out).into_response()
}

/// The status a batch has now, before it is final.
fn live_status(cfg: &BatchConfig, b: &MockBatch) -> &'static str {
    if b.cancel_requested.is_some() {
        return "cancelling";
    }
    if b.t0.elapsed() < cfg.complete_after / 10 {
        "validating"
    } else {
        "in_progress"
    }
}

fn batch_json(st: &MockState, b: &MockBatch) -> Value {
    let (status, counts) = match &b.fin {
        Some(f) => (f.status, (f.completed, f.failed)),
        None => (live_status(&st.batch_cfg, b), (0, 0)),
    };
    let at = |s: &str| {
        b.fin
            .as_ref()
            .filter(|f| f.status == s)
            .map(|f| json!(f.at))
            .unwrap_or(Value::Null)
    };
    let errors = if b.invalid.is_empty() {
        Value::Null
    } else {
        json!({"object": "list", "data": b.invalid})
    };
    json!({
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "errors": errors,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": status,
        "output_file_id": b.fin.as_ref().and_then(|f| f.output_file_id.clone()),
        "error_file_id": b.fin.as_ref().and_then(|f| f.error_file_id.clone()),
        "created_at": b.created_at,
        "in_progress_at": (status != "validating" && b.invalid.is_empty()).then_some(b.created_at),
        "expires_at": b.created_at + 24 * 3600,
        "finalizing_at": null,
        "completed_at": at("completed"),
        "failed_at": at("failed"),
        "expired_at": at("expired"),
        "cancelling_at": b.cancel_requested,
        "cancelled_at": at("cancelled"),
        "request_counts": {"total": b.total, "completed": counts.0, "failed": counts.1},
        "metadata": b.metadata,
    })
}

/// A line's answer as the synchronous endpoint gives it: (status, body).
fn line_answer(st: &MockState, inc: &Incoming) -> (u16, Value) {
    let err = |kind: &str, msg: &str| json!({"error": {"message": msg, "type": kind}});
    match inc.fault {
        None | Some(Fault::EmptyLength) | Some(Fault::Truncated) => (200, openai_json(st, inc)),
        Some(Fault::RateLimit) => (429, err("rate_limit_error", "Rate limit reached (mock)")),
        Some(Fault::ServerError) if inc.u2 < 0.5 => {
            (500, err("server_error", "internal error (mock)"))
        }
        Some(Fault::ServerError) => (503, err("overloaded_error", "service unavailable (mock)")),
        Some(Fault::OutOfCredit) => (
            403,
            err(
                "insufficient_quota",
                "You exceeded your current quota: out of credit (mock)",
            ),
        ),
        Some(Fault::Reset | Fault::Hang | Fault::MalformedJson) => {
            (500, err("server_error", "internal error (mock)"))
        }
    }
}

/// Answers a batch's lines (all of them, the first half when it expires, those whose time
/// had come when it is cancelled) and makes it final.
fn finish(st: &MockState, s: &mut Store, i: usize, status: &'static str) {
    let b = s.batches[i].clone();
    let content = s.files[&b.input_file_id].bytes.clone();
    let (mut out, mut errs) = (Vec::new(), Vec::new());
    let (mut completed, mut failed) = (0, 0);
    let lines: Vec<Value> = content
        .split(|&c| c == b'\n')
        .filter_map(|l| serde_json::from_slice::<Value>(l).ok())
        .collect();
    let answer = match status {
        "completed" => lines.len(),
        "expired" => lines.len().div_ceil(2),
        _ => {
            // Cancelled: the share of the window that had passed.
            let f =
                b.t0.elapsed().as_secs_f64() / st.batch_cfg.complete_after.as_secs_f64().max(1e-9);
            ((lines.len() as f64 * f.min(1.0)) as usize).min(lines.len())
        }
    };
    for (k, line) in lines.iter().enumerate() {
        let custom_id = line.get("custom_id").and_then(Value::as_str).unwrap_or("");
        let req_id = format!("{}_req_{k}", b.id);
        if k >= answer {
            let (code, msg) = if status == "expired" {
                (
                    "batch_expired",
                    "This request could not be executed before the completion window expired.",
                )
            } else {
                ("batch_cancelled", "This request was cancelled.")
            };
            failed += 1;
            let v = json!({"id": req_id, "custom_id": custom_id, "response": null,
                           "error": {"code": code, "message": msg}});
            serde_json::to_writer(&mut errs, &v).unwrap();
            errs.push(b'\n');
            continue;
        }
        let body = line.get("body").cloned().unwrap_or(Value::Null);
        let hash = hex::encode(Sha256::digest(body.to_string().as_bytes()))[..32].to_string();
        let inc = st.receive_parsed("batch:/v1/chat/completions", hash, 0, Some(custom_id), body);
        let (code, resp) = line_answer(st, &inc);
        let v = json!({"id": req_id, "custom_id": custom_id,
                       "response": {"status_code": code, "request_id": req_id, "body": resp},
                       "error": null});
        let w = if code == 200 {
            completed += 1;
            &mut out
        } else {
            failed += 1;
            &mut errs
        };
        serde_json::to_writer(&mut *w, &v).unwrap();
        w.push(b'\n');
    }
    let mut file = |bytes: Vec<u8>, name: &str| {
        (!bytes.is_empty()).then(|| {
            let id = s.add_file(bytes, format!("{}_{name}.jsonl", b.id), "batch_output");
            if b.cut {
                s.cut_pending.insert(id.clone());
            }
            id
        })
    };
    let output_file_id = file(out, "output");
    let error_file_id = file(errs, "error");
    s.batches[i].fin = Some(Final {
        status,
        completed,
        failed,
        output_file_id,
        error_file_id,
        at: unix_now(),
    });
    log_line(
        st,
        json!({"path": "batch_final", "batch_id": b.id, "status": status,
               "created": b.created_f, "final": unix_f(), "lines": lines.len()}),
    );
}

/// Makes a batch final when its time has come.
fn advance(st: &MockState, s: &mut Store, i: usize) {
    let b = &s.batches[i];
    if b.fin.is_some() {
        return;
    }
    let cfg = &st.batch_cfg;
    if !b.invalid.is_empty() {
        if b.t0.elapsed() >= cfg.complete_after / 10 {
            s.batches[i].fin = Some(Final {
                status: "failed",
                completed: 0,
                failed: 0,
                output_file_id: None,
                error_file_id: None,
                at: unix_now(),
            });
        }
        return;
    }
    let (cancelled, due, expire) = (
        b.cancel_requested.is_some(),
        b.t0.elapsed() >= cfg.complete_after,
        b.expire,
    );
    if cancelled {
        finish(st, s, i, "cancelled");
    } else if due {
        finish(st, s, i, if expire { "expired" } else { "completed" });
    }
}

async fn retrieve(State(st): State<Arc<MockState>>, Path(id): Path<String>) -> Response {
    let mut s = st.batches.lock().unwrap();
    let Some(i) = s.batches.iter().position(|b| b.id == id) else {
        return not_found("batch");
    };
    let n = {
        let c = s.polls.entry(id.clone()).or_insert(0);
        *c += 1;
        *c
    };
    let seed = st.cfg.seed.to_be_bytes();
    let u = uniform(&[&seed, id.as_bytes(), b"poll", &n.to_be_bytes()]);
    if u < st.batch_cfg.rate(BatchFault::PollError) {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal error on retrieve (mock)",
        );
    }
    advance(&st, &mut s, i);
    axum::Json(batch_json(&st, &s.batches[i])).into_response()
}

async fn cancel(State(st): State<Arc<MockState>>, Path(id): Path<String>) -> Response {
    let mut s = st.batches.lock().unwrap();
    let Some(i) = s.batches.iter().position(|b| b.id == id) else {
        return not_found("batch");
    };
    advance(&st, &mut s, i);
    if s.batches[i].fin.is_none() {
        s.batches[i].cancel_requested = Some(unix_now());
    }
    let out = batch_json(&st, &s.batches[i]);
    axum::Json(out).into_response()
}

async fn list(State(st): State<Arc<MockState>>, uri: Uri) -> Response {
    let mut after = None;
    let mut limit = 20usize;
    for kv in uri.query().unwrap_or("").split('&') {
        match kv.split_once('=') {
            Some(("after", v)) => after = Some(v.to_string()),
            Some(("limit", v)) => limit = v.parse().unwrap_or(20).clamp(1, 100),
            _ => {}
        }
    }
    let mut s = st.batches.lock().unwrap();
    for i in 0..s.batches.len() {
        advance(&st, &mut s, i);
    }
    // Newest first; `after` is the last id of the previous page.
    let newest_first: Vec<&MockBatch> = s.batches.iter().rev().collect();
    let start = match &after {
        Some(a) => match newest_first.iter().position(|b| &b.id == a) {
            Some(p) => p + 1,
            None => return bad(&format!("after: no batch {a}")),
        },
        None => 0,
    };
    let page: Vec<Value> = newest_first
        .iter()
        .skip(start)
        .take(limit)
        .map(|b| batch_json(&st, b))
        .collect();
    let has_more = start + page.len() < newest_first.len();
    let first = page.first().and_then(|b| b.get("id").cloned());
    let last = page.last().and_then(|b| b.get("id").cloned());
    axum::Json(
        json!({"object": "list", "data": page, "first_id": first, "last_id": last,
                      "has_more": has_more}),
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_batch_faults() {
        assert_eq!(
            parse_batch_fault("expire=0.5").unwrap(),
            (BatchFault::Expire, 0.5)
        );
        assert!(parse_batch_fault("nope=1").unwrap_err().contains("known:"));
        assert!(parse_batch_fault("invalid=1.5").is_err());
    }

    #[test]
    fn multipart_parts_are_split_at_their_boundary() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            "multipart/form-data; boundary=XyZ".parse().unwrap(),
        );
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--XyZ\r\nContent-Disposition: form-data; \
            name=\"file\"; filename=\"a.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n{\"a\":1}\n{\"b\":2}\n\r\n--XyZ--\r\n";
        let p = multipart(&h, body).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0], ("purpose".into(), None, b"batch".to_vec()));
        assert_eq!(p[1].1.as_deref(), Some("a.jsonl"));
        assert_eq!(p[1].2, b"{\"a\":1}\n{\"b\":2}\n".to_vec());
    }

    #[test]
    fn validation_names_the_bad_lines() {
        let ok = b"{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{}}\n";
        assert_eq!(validate(ok, "/v1/chat/completions"), (1, vec![]));
        let mut dup = ok.to_vec();
        dup.extend_from_slice(ok);
        dup.extend_from_slice(b"nope\n");
        let (n, errs) = validate(&dup, "/v1/chat/completions");
        assert_eq!(n, 3);
        assert_eq!(errs[0]["code"], "duplicate_custom_id");
        assert_eq!(errs[0]["line"], 2);
        assert_eq!(errs[1]["code"], "invalid_json_line");
    }
}
