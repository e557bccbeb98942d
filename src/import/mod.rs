//! Readers for recorded runs: every source format maps to one [`Record`] per call, yielded
//! one at a time, so `evalflow import` (src/cli/import.rs) has a single core whatever tool
//! wrote the file.
//!
//! # Behavior
//! - One file per format: [`pairs`] (evalflow's JSONL request/response pairs), [`parquet`]
//!   (a calls-like table), [`openai_batch`] (OpenAI Batch API output, joined with its
//!   input), [`inspect`] (Inspect AI `.eval` and `.json` logs), [`lm_eval`]
//!   (lm-evaluation-harness `samples_*.jsonl`) and [`promptfoo`] (`results.json`).
//! - [`open`] returns a [`RecordIter`]: JSONL is read line by line, Parquet batch by batch,
//!   an `.eval` zip entry by entry and an Inspect `.json` log sample by sample; only
//!   promptfoo's `results.json` is parsed whole (it is one JSON document with no record
//!   boundary a reader could stream on; see [`promptfoo`]).
//! - [`detect`] picks the format from the content (the first line of JSONL, the zip or
//!   Parquet magic, the top-level keys of JSON), never from the name alone.
//! - What a format does not record stays `None` (NULL): a reader never invents a provider,
//!   a start time, an HTTP status or an attempt count.
//! - A bad row is an `Err` in its place and the reader goes on with the next row (a file
//!   error ends it), so the import can name every bad row or skip them.
//!
//! # Errors
//! [`ImportError`]: every variant names the file, and a bad row names its line (or row,
//! or zip entry) and field. The CLI maps them all to exit code 2.

mod fast_hash;
pub mod inspect;
pub mod lm_eval;
mod numbering;
pub mod openai_batch;
pub mod pairs;
pub mod parquet;
pub mod promptfoo;
pub mod sink;
pub mod zip;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use serde_json::Value;

/// A failure to read a source file.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// A row (line, Parquet row or zip entry) has a missing or mistyped field.
    #[error("{file}:{at}: field `{field}`: {msg}")]
    Field {
        file: String,
        at: String,
        field: String,
        msg: String,
        /// The row's source text (a JSONL line), for `--skip-bad-lines`.
        raw: Option<String>,
    },
    /// The file as a whole is unreadable or not of the format asked for.
    #[error("{file}: {msg}")]
    File { file: String, msg: String },
}

/// Builds an [`ImportError::Field`] for `file` at `at` (a line number or an entry name).
pub(crate) fn bad(
    file: &Path,
    at: impl std::fmt::Display,
    field: &str,
    msg: impl std::fmt::Display,
) -> ImportError {
    ImportError::Field {
        file: file.display().to_string(),
        at: at.to_string(),
        field: field.to_string(),
        msg: msg.to_string(),
        raw: None,
    }
}

impl ImportError {
    /// The error with the source text of its row attached (a no-op for a file error).
    pub(crate) fn with_raw(mut self, line: &str) -> Self {
        if let ImportError::Field { raw, .. } = &mut self {
            *raw = Some(line.to_string());
        }
        self
    }

    /// The same error as one that ends the file (the rows after it cannot be read), with
    /// the same text.
    pub(crate) fn fatal(self) -> Self {
        match self {
            ImportError::Field {
                file,
                at,
                field,
                msg,
                ..
            } => ImportError::File {
                file: format!("{file}:{at}: field `{field}`"),
                msg,
            },
            e => e,
        }
    }

    /// Whether the error is one row's (the rows after it can still be read), not the
    /// file's.
    pub fn is_row(&self) -> bool {
        matches!(self, ImportError::Field { .. })
    }

    /// The error as one JSON line of a `--skip-bad-lines` file: the file, the row, the
    /// field, the message and the row's source text when it has one.
    pub fn to_json(&self) -> Value {
        match self {
            ImportError::Field {
                file,
                at,
                field,
                msg,
                raw,
            } => serde_json::json!({
                "file": file, "at": at, "field": field, "error": msg, "line": raw,
            }),
            ImportError::File { file, msg } => serde_json::json!({"file": file, "error": msg}),
        }
    }
}

/// Builds an [`ImportError::File`].
pub(crate) fn bad_file(file: &Path, msg: impl std::fmt::Display) -> ImportError {
    ImportError::File {
        file: file.display().to_string(),
        msg: msg.to_string(),
    }
}

/// The source formats `import` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Detect each file's format from its content.
    Auto,
    /// evalflow's JSONL `{"request": ..., "response": ...}` pairs.
    Pairs,
    /// A Parquet table with an `input` column and any calls columns.
    Parquet,
    /// OpenAI Batch API output JSONL (`custom_id`, `response`, `error`).
    OpenaiBatch,
    /// Inspect AI logs: `.eval` (zip) or the older `.json`.
    Inspect,
    /// lm-evaluation-harness `samples_*.jsonl` from `--log_samples`.
    LmEval,
    /// promptfoo `results.json` from `promptfoo eval -o`.
    Promptfoo,
}

impl Format {
    /// The name written to the `source_format` column and used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Format::Auto => "auto",
            Format::Pairs => "pairs",
            Format::Parquet => "parquet",
            Format::OpenaiBatch => "openai-batch",
            Format::Inspect => "inspect",
            Format::LmEval => "lm-eval",
            Format::Promptfoo => "promptfoo",
        }
    }
}

/// One of the tool's own verdicts on a call, imported as a scores version
/// `<tool>-<scorer>@imported`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ImportedScore {
    /// The scorer (metric) name in the tool, e.g. Inspect's `match`, lm-eval's
    /// `exact_match`, promptfoo's `assert`.
    pub scorer: String,
    /// The value as a number (Inspect's `C` is 1, `I` 0, `P` 0.5; a boolean is 1 or 0).
    pub score: Option<f64>,
    /// The value as the tool wrote it when it is not a number (`C`, `I`, a label).
    pub label: Option<String>,
    /// Pass or fail, when the tool's verdict is one.
    pub passed: Option<bool>,
    /// The tool's explanation or reason (JSON text), when it gives one.
    pub detail: Option<String>,
}

/// Where a record came from: every imported call row carries it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Provenance {
    /// The [`Format::name`] of the reader.
    pub format: &'static str,
    /// The file as given on the command line (or found in a folder), shared by its records.
    pub file: Arc<str>,
    /// The source's own id of the row (Inspect sample id, batch `custom_id`, lm-eval
    /// `doc_id`, promptfoo result id), `None` when it has none.
    pub id: Option<String>,
}

/// What a recorded call asked: its model, prompt and parameters, and the keys computed
/// from them.
///
/// A record holds it as one `Arc`, which every record of one request shares where the
/// reader knows them to be the same (the OpenAI-pairs reader parses each distinct request
/// once): a record then writes one reference count, not one per field. With a count per
/// field, a log that repeats its requests on both cores passed a dozen cache lines between
/// them per record (the model's and the test's counts were written by every record).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Request {
    pub model: Arc<str>,
    /// The model the source itself named (before `--model`), to refuse a `--model` that
    /// would merge distinct models into one.
    pub source_model: Option<Arc<str>>,
    pub system: Option<Arc<str>>,
    pub input: Arc<str>,
    /// What identifies the case when the source has its own case id (an Inspect sample
    /// id, an lm-eval doc id) or recorded no prompt (a batch output line with no input
    /// line): used in place of (system, input).
    pub case_key: Option<Arc<str>>,
    /// Text identifying the request (its parameters); hashed into `request_hash`.
    pub request_key: String,
    /// `request_key`'s hash when the reader computed it (once per distinct request, not
    /// per record); `request_key` may then be empty.
    pub request_hash: Option<Arc<str>>,
    /// The test a reader assumed and the [`case_id`] it computed for it, once per distinct
    /// request; the sink uses it when the record's test is that one.
    pub case_id: Option<(Arc<str>, Arc<str>)>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
}

/// One recorded call in the normalized shape every format maps to.
///
/// # Behavior
/// `None` means the source did not record the value. The case of a record is its
/// (test, `case_key`) when it has one (the source's case id, or the whole conversation
/// and its parameters: [`request_case_key`]), else its (test, system, input); `cluster`
/// becomes the case's `template_id` when present.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Record {
    /// What the call asked, shared by the records of one request ([`Request`]).
    pub request: Arc<Request>,
    pub provider: Option<String>,
    pub expected: Option<String>,
    /// The test the tool ran (Inspect task, lm-eval task, promptfoo description).
    pub test: Option<String>,
    pub capability: Option<String>,
    /// The cluster (template) of the case, from the field named by `--cluster`.
    pub cluster: Option<String>,
    /// The repeat index (Inspect epoch - 1, promptfoo repeat index).
    pub sample_idx: Option<i32>,
    pub response: Option<String>,
    pub finish_reason: Option<String>,
    pub prompt_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
    pub reasoning_tokens: Option<i64>,
    pub reasoning_chars: Option<i64>,
    pub http_status: Option<i32>,
    pub error: Option<String>,
    pub attempts: Option<i32>,
    pub latency_ms: Option<f64>,
    /// Microseconds since the Unix epoch.
    pub started_at_us: Option<i64>,
    pub source: Provenance,
    /// The tool's own scores of this call.
    pub scores: Vec<ImportedScore>,
}

impl Record {
    /// Takes an OpenAI response's answer, finish reason and token counts.
    pub(crate) fn set_response(&mut self, p: crate::stages::call::http::Parsed) {
        self.response = Some(p.content);
        self.finish_reason = p.finish_reason;
        self.prompt_tokens = p.prompt_tokens;
        self.completion_tokens = p.completion_tokens;
        self.reasoning_tokens = p.reasoning_tokens;
        self.reasoning_chars = p.reasoning_chars;
    }
}

/// The case id of a record of `test`: one case per (test, the source's case id, `case_key`)
/// where the source has one, else per (test, system, input).
pub(crate) fn case_id(
    test: &str,
    case_key: Option<&str>,
    system: Option<&str>,
    input: &str,
) -> String {
    use crate::stages::call::sha_prefix;
    match case_key {
        Some(k) => sha_prefix(&["imported", test, &format!("\u{0}{k}"), ""], 24),
        None => sha_prefix(&["imported", test, system.unwrap_or(""), input], 24),
    }
}

/// Records of one source, one at a time.
pub type RecordIter = Box<dyn Iterator<Item = Result<Record, ImportError>> + Send>;

/// What the readers need besides the file.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The model of every record (`--model`), over what the file names.
    pub model: Option<String>,
    /// A sample metadata (Inspect), doc (lm-eval) or vars (promptfoo) field holding the
    /// cluster of each case (`--cluster`).
    pub cluster: Option<String>,
    /// The field holding each case's expected answer in an OpenAI Batch import
    /// (`--expected-field`).
    pub expected_field: Option<String>,
    /// OpenAI Batch API input files, joined with output files by `custom_id`.
    pub batch_inputs: Vec<PathBuf>,
    /// The test of every record (`--test`), over the file's own: a reader that computes
    /// case ids ([`Record::case_id`]) computes them for it.
    pub test: Option<String>,
}

/// The tool name in imported scores versions (`<tool>-<scorer>@imported`).
pub fn tool_of(format: &str) -> &str {
    match format {
        "openai-batch" => "openai",
        f => f,
    }
}

/// The provenance columns an imported `calls` table adds after the declared ones.
///
/// # Behavior
/// They are not in `schemas/calls.json`: the call stage builds its batches positionally
/// from that schema, and a run it writes has no source. Readers accept extra columns
/// (`schema::check_compatible`), so an imported run's calls are the declared schema plus
/// `source_format`, `source_file` and `source_id` (all utf8; `source_id` nullable).
pub fn calls_schema() -> SchemaRef {
    let base = crate::schema::Table::Calls.schema();
    let mut fields: Vec<Field> = base.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new("source_format", DataType::Utf8, false));
    fields.push(Field::new("source_file", DataType::Utf8, false));
    fields.push(Field::new("source_id", DataType::Utf8, true));
    Arc::new(Schema::new(fields))
}

/// Opens `path` as `format` (detected from the content when [`Format::Auto`]).
///
/// # Errors
/// An unreadable file, or one whose content fits no format.
pub fn open(path: &Path, format: Format, opts: &Options) -> Result<RecordIter, ImportError> {
    let format = match format {
        Format::Auto => detect(path)?.ok_or_else(|| {
            bad_file(
                path,
                "not a format import reads (evalflow pairs, Parquet, OpenAI batch output, Inspect log, lm-eval samples, promptfoo results); \
                 name one with --format",
            )
        })?,
        f => f,
    };
    match format {
        Format::Pairs => pairs::open(path, opts),
        Format::Parquet => parquet::open(path, opts),
        Format::OpenaiBatch => openai_batch::open(path, opts),
        Format::Inspect => inspect::open(path, opts),
        Format::LmEval => lm_eval::open(path, opts),
        Format::Promptfoo => promptfoo::open(path, opts),
        Format::Auto => unreachable!("resolved above"),
    }
}

/// What a file holds, judged from its first bytes.
///
/// # Behavior
/// Parquet and zip (`.eval`) by magic number; JSON by its top-level keys (Inspect logs
/// start with `version`, `status`, `eval`; promptfoo has `evalId` or `results.prompts`);
/// JSONL by the keys of its first line (`request` pairs, `custom_id` with `response` or
/// `error` batch output, `doc_id` with `resps` lm-eval samples). OpenAI batch *input*
/// (`custom_id` with `body`) is [`Detected::BatchInput`]: it is joined, not imported.
pub fn detect_kind(path: &Path) -> Result<Detected, ImportError> {
    let mut f = std::fs::File::open(path).map_err(|e| bad_file(path, e))?;
    let mut head = vec![0u8; 64 * 1024];
    let mut n = 0;
    while n < head.len() {
        let k = f.read(&mut head[n..]).map_err(|e| bad_file(path, e))?;
        if k == 0 {
            break;
        }
        n += k;
    }
    head.truncate(n);
    if head.starts_with(b"PAR1") {
        return Ok(Detected::Format(Format::Parquet));
    }
    if head.starts_with(b"PK\x03\x04") {
        return Ok(Detected::Format(Format::Inspect));
    }
    let text = String::from_utf8_lossy(&head);
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    if let Ok(Value::Object(m)) = serde_json::from_str::<Value>(first) {
        // A JSONL file (or a one-line JSON document).
        if m.contains_key("request") {
            return Ok(Detected::Format(Format::Pairs));
        }
        if m.contains_key("custom_id") {
            if m.contains_key("response") || m.contains_key("error") {
                return Ok(Detected::Format(Format::OpenaiBatch));
            }
            if m.contains_key("body") {
                return Ok(Detected::BatchInput);
            }
        }
        if m.contains_key("doc_id") && (m.contains_key("resps") || m.contains_key("doc")) {
            return Ok(Detected::Format(Format::LmEval));
        }
        if m.contains_key("eval") && m.contains_key("status") {
            return Ok(Detected::Format(Format::Inspect));
        }
        if m.contains_key("evalId") || m.get("results").is_some_and(|r| r.get("prompts").is_some())
        {
            return Ok(Detected::Format(Format::Promptfoo));
        }
        return Ok(Detected::Unknown);
    }
    // A first line longer than what was read, or a pretty-printed JSON document: look at
    // the keys near the start.
    let t = text.trim_start();
    if t.starts_with('{') && !t.bytes().take(4096).any(|b| b == b'\n') {
        if t.starts_with("{\"request\"") {
            return Ok(Detected::Format(Format::Pairs));
        }
        if t.contains("\"doc_id\"") && t.contains("\"arguments\"") {
            return Ok(Detected::Format(Format::LmEval));
        }
        if t.contains("\"custom_id\"") && t.contains("\"body\"") && !t.contains("\"response\"") {
            return Ok(Detected::BatchInput);
        }
    }
    if t.starts_with('{') {
        let key = |k: &str| t.contains(&format!("\"{k}\":")) || t.contains(&format!("\"{k}\" :"));
        if key("evalId") || (key("results") && key("prompts") && !key("eval")) {
            return Ok(Detected::Format(Format::Promptfoo));
        }
        if key("eval") && key("status") {
            return Ok(Detected::Format(Format::Inspect));
        }
    }
    Ok(Detected::Unknown)
}

/// The outcome of [`detect_kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detected {
    Format(Format),
    /// OpenAI Batch API input: requests to join with output by `custom_id`.
    BatchInput,
    Unknown,
}

/// The format of `path`, `None` when it is none that `import` reads.
///
/// # Errors
/// The file cannot be read.
pub fn detect(path: &Path) -> Result<Option<Format>, ImportError> {
    Ok(match detect_kind(path)? {
        Detected::Format(f) => Some(f),
        _ => None,
    })
}

/// Text of a chat message `content`: a string, or the `text` of its parts.
pub(crate) fn text_of(c: Option<&Value>) -> Option<String> {
    match c? {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => Some(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect(),
        ),
        _ => None,
    }
}

/// The last user message and the system (or developer) message of a chat message list.
pub(crate) fn chat_prompt(msgs: &[Value]) -> (Option<String>, Option<String>) {
    let mut input = None;
    let mut system = None;
    for m in msgs {
        let text = text_of(m.get("content"));
        match m.get("role").and_then(Value::as_str) {
            Some("user") => input = text,
            Some("system") | Some("developer") => system = text,
            _ => {}
        }
    }
    (system, input)
}

/// Request keys that are not part of a case: the model is the call's; `seed` (and `n`)
/// tell one sample of a case from another (the request hash keeps them); the rest is
/// transport or bookkeeping that does not change the answer.
const NOT_THE_CASE: &[&str] = &[
    "model",
    "seed",
    "n",
    "stream",
    "stream_options",
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
];

/// What identifies the case of a chat request beyond (system, last user message): the
/// whole conversation and every parameter that changes the answer (temperature,
/// `max_tokens`, tools, ...), as canonical JSON (keys sorted), or `None` for a plain
/// request (at most one system message and one user message, both text, and no such
/// parameter), whose case stays keyed by (system, input) as before.
///
/// Two conversations that end in the same user turn ("Are you sure?") but differ before
/// it are two cases, never samples of one.
pub(crate) fn request_case_key(req: &Value) -> Option<String> {
    let obj = req.as_object()?;
    let msgs = obj
        .get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let params = CaseParams(obj);
    key_of(msgs, params.is_empty(), &params)
}

/// The parameters of a request that are part of its case, borrowed from it in its own
/// order (the order a `Map` collected from them iterates in, with or without serde_json's
/// `preserve_order`), serialized as that `Map` would be: no copy of the request per record.
struct CaseParams<'a>(&'a serde_json::Map<String, Value>);

impl CaseParams<'_> {
    fn iter(&self) -> impl Iterator<Item = (&String, &Value)> {
        self.0.iter().filter(|(k, v)| {
            k.as_str() != "messages" && !NOT_THE_CASE.contains(&k.as_str()) && !v.is_null()
        })
    }

    fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }
}

impl serde::Serialize for CaseParams<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

/// [`request_case_key`] of a conversation and its parameters.
pub(crate) fn conversation_key(
    msgs: &[Value],
    params: serde_json::Map<String, Value>,
) -> Option<String> {
    key_of(msgs, params.is_empty(), &params)
}

/// [`conversation_key`] with the parameters as anything that serializes as their `Map`:
/// `request:` and `{"messages": msgs, "params": params}` as `Value::to_string` writes it,
/// written straight into one buffer (not through `json!`'s copy and `fmt`'s adapter).
fn key_of<P: serde::Serialize>(msgs: &[Value], no_params: bool, params: &P) -> Option<String> {
    if is_plain(msgs, no_params) {
        return None;
    }
    /// The keys `json!` sorts (or keeps in this order): "messages" before "params".
    #[derive(serde::Serialize)]
    struct Key<'a, P> {
        messages: &'a [Value],
        params: &'a P,
    }
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"request:");
    serde_json::to_writer(
        &mut out,
        &Key {
            messages: msgs,
            params,
        },
    )
    .expect("a Value serializes");
    Some(String::from_utf8(out).expect("serde_json writes UTF-8"))
}

/// Whether a conversation keeps its case keyed by (system, input): no case parameter, and
/// at most one system (or developer) message and one user message, both plain text.
fn is_plain(msgs: &[Value], no_params: bool) -> bool {
    let plain_msg = |m: &Value, roles: &[&str]| {
        m.as_object().is_some_and(|o| {
            o.len() == 2
                && o.get("content").is_some_and(Value::is_string)
                && o.get("role")
                    .and_then(Value::as_str)
                    .is_some_and(|r| roles.contains(&r))
        })
    };
    no_params
        && match msgs {
            [u] => plain_msg(u, &["user"]),
            [s, u] => plain_msg(s, &["system", "developer"]) && plain_msg(u, &["user"]),
            _ => false,
        }
}

/// A request's key (the request as `Value::to_string()` writes it, keys sorted) and its
/// [`request_case_key`], byte for byte, with each top-level entry written once for both:
/// the messages, most of either text, are serialized once, not twice.
pub(crate) fn request_keys(req: &Value) -> (String, Option<String>) {
    let Some(obj) = req.as_object() else {
        return (req.to_string(), request_case_key(req));
    };
    // Each entry as `"key":value`, in the map's order (sorted, as both keys are).
    let mut buf = Vec::with_capacity(512);
    let mut entries = Vec::with_capacity(obj.len());
    for (k, v) in obj {
        let start = buf.len();
        serde_json::to_writer(&mut buf, k).expect("a string serializes");
        buf.push(b':');
        let value = buf.len();
        serde_json::to_writer(&mut buf, v).expect("a Value serializes");
        entries.push((k.as_str(), v, start, value, buf.len()));
    }
    let mut key = Vec::with_capacity(buf.len() + entries.len() + 1);
    key.push(b'{');
    for (i, &(_, _, start, _, end)) in entries.iter().enumerate() {
        if i > 0 {
            key.push(b',');
        }
        key.extend_from_slice(&buf[start..end]);
    }
    key.push(b'}');
    let key = String::from_utf8(key).expect("serde_json writes UTF-8");
    let msgs = obj
        .get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    if is_plain(msgs, CaseParams(obj).is_empty()) {
        return (key, None);
    }
    // `request:{"messages":[...],"params":{...}}`, as [`key_of`] writes it.
    let mut case = Vec::with_capacity(buf.len() + 32);
    case.extend_from_slice(b"request:{\"messages\":");
    match entries.iter().find(|e| e.0 == "messages" && e.1.is_array()) {
        Some(&(_, _, _, value, end)) => case.extend_from_slice(&buf[value..end]),
        None => case.extend_from_slice(b"[]"),
    }
    case.extend_from_slice(b",\"params\":{");
    let params = entries
        .iter()
        .filter(|(k, v, ..)| *k != "messages" && !NOT_THE_CASE.contains(k) && !v.is_null());
    for (i, &(_, _, start, _, end)) in params.enumerate() {
        if i > 0 {
            case.push(b',');
        }
        case.extend_from_slice(&buf[start..end]);
    }
    case.extend_from_slice(b"}}");
    (
        key,
        Some(String::from_utf8(case).expect("serde_json writes UTF-8")),
    )
}

/// The key as it was first written (a `Map` copied from the request, `json!` and
/// `format!`): what [`request_case_key`] must give byte for byte.
#[cfg(test)]
fn request_case_key_reference(req: &Value) -> Option<String> {
    let obj = req.as_object()?;
    let msgs = obj
        .get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let params: serde_json::Map<String, Value> = obj
        .iter()
        .filter(|(k, v)| {
            k.as_str() != "messages" && !NOT_THE_CASE.contains(&k.as_str()) && !v.is_null()
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let plain_msg = |m: &Value, roles: &[&str]| {
        m.as_object().is_some_and(|o| {
            o.len() == 2
                && o.get("content").is_some_and(Value::is_string)
                && o.get("role")
                    .and_then(Value::as_str)
                    .is_some_and(|r| roles.contains(&r))
        })
    };
    let plain = params.is_empty()
        && match msgs {
            [u] => plain_msg(u, &["user"]),
            [s, u] => plain_msg(s, &["system", "developer"]) && plain_msg(u, &["user"]),
            _ => false,
        };
    if plain {
        return None;
    }
    Some(format!(
        "request:{}",
        serde_json::json!({"messages": msgs, "params": params})
    ))
}

/// The text of an error field: a string as it is; an object (`{"code", "message", ...}`,
/// as OpenAI-compatible servers write one) as `code: message`, its message, or its JSON.
pub(crate) fn error_text(e: &Value) -> Option<String> {
    match e {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => {
            let msg = m.get("message").and_then(Value::as_str);
            let code = m.get("code").or_else(|| m.get("type")).and_then(as_text);
            Some(match (code, msg) {
                (Some(c), Some(msg)) => format!("{c}: {msg}"),
                (None, Some(msg)) => msg.to_string(),
                _ => e.to_string(),
            })
        }
        other => Some(other.to_string()),
    }
}

/// A field's value as text for a cluster or id: strings as they are, other JSON as JSON.
pub(crate) fn as_text(v: &Value) -> Option<String> {
    match v {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        v => Some(v.to_string()),
    }
}

/// Parses an RFC 3339 time to microseconds since the epoch.
pub(crate) fn rfc3339_us(s: &str) -> Option<i64> {
    chrono::DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.timestamp_micros())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The case key written straight into a buffer is the one `json!` and `format!` wrote,
    /// byte for byte: multi-turn, parameters (nested, unicode, escapes, numbers), none.
    #[test]
    fn case_keys_are_the_reference_keys() {
        let reqs = [
            r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#,
            r#"{"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "seed": 3, "n": 2}"#,
            r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7, "max_tokens": 512}"#,
            concat!(
                r#"{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},"#,
                r#" {"role": "user", "content": "Are you sure?"}], "model": "m"}"#,
            ),
            concat!(
                r#"{"model": "m", "messages": [{"role": "user", "content": "中文 \"quoted\" \\ back\nline \u0001 é"}],"#,
                r#" "top_p": 1e-7, "stop": ["\n", "終"], "tools": [{"type": "function", "function": {"name": "f","#,
                r#" "parameters": {"z": 1, "a": [true, null]}}}], "user": "u", "metadata": {"k": 1},"#,
                r#" "logit_bias": null}"#,
            ),
            concat!(
                r#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text","#,
                r#" "text": "x"}, {"type": "image_url", "image_url": {"url": "u"}}]}], "zeta": -0.0,"#,
                r#" "alpha": 12345678901234567890}"#,
            ),
            r#"{"model": "m", "messages": []}"#,
            r#"{"model": "m"}"#,
            r#"{"model": "m", "messages": [{"role": "developer", "content": ""}, {"role": "user", "content": ""}]}"#,
            r#"{"model": "m", "messages": [{"role": "user", "content": "hi", "name": "bob"}], "stream": true}"#,
            r#"[1, 2]"#,
        ];
        for r in reqs {
            let v: Value = serde_json::from_str(r).unwrap();
            assert_eq!(request_case_key(&v), request_case_key_reference(&v), "{r}");
            assert_eq!(
                request_keys(&v),
                (v.to_string(), request_case_key_reference(&v)),
                "{r}"
            );
            let msgs = v
                .get("messages")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            let params: serde_json::Map<String, Value> = v
                .as_object()
                .map(|o| {
                    o.iter()
                        .filter(|(k, _)| k.as_str() == "temperature" || k.as_str() == "tools")
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect()
                })
                .unwrap_or_default();
            let reference = {
                let mut req = serde_json::Map::new();
                req.insert("messages".into(), Value::Array(msgs.clone()));
                req.extend(params.clone());
                request_case_key_reference(&Value::Object(req))
            };
            assert_eq!(conversation_key(&msgs, params), reference, "{r}");
        }
        assert!(request_case_key(&serde_json::from_str(reqs[2]).unwrap()).is_some());
        assert!(request_case_key(&serde_json::from_str(reqs[0]).unwrap()).is_none());
    }

    #[test]
    fn detects_jsonl_kinds_from_the_first_line() {
        let d = tempfile::tempdir().unwrap();
        let cases = [
            (
                r#"{"request": {}, "response": {}}"#,
                Detected::Format(Format::Pairs),
            ),
            (
                r#"{"id": "b", "custom_id": "x", "response": null, "error": {}}"#,
                Detected::Format(Format::OpenaiBatch),
            ),
            (
                r#"{"custom_id": "x", "method": "POST", "body": {}}"#,
                Detected::BatchInput,
            ),
            (
                r#"{"doc_id": 0, "doc": {}, "resps": []}"#,
                Detected::Format(Format::LmEval),
            ),
            (
                "{\n  \"evalId\": \"e\",\n  \"results\": {}",
                Detected::Format(Format::Promptfoo),
            ),
            (
                "{\n  \"version\": 2,\n  \"status\": \"success\",\n  \"eval\": {",
                Detected::Format(Format::Inspect),
            ),
            ("a,b\n1,2\n", Detected::Unknown),
        ];
        for (i, (text, want)) in cases.iter().enumerate() {
            let p = d.path().join(format!("f{i}"));
            std::fs::write(&p, text).unwrap();
            assert_eq!(detect_kind(&p).unwrap(), *want, "{text}");
        }
    }

    #[test]
    fn provenance_columns_follow_the_declared_calls_schema() {
        let s = calls_schema();
        let base = crate::schema::Table::Calls.schema();
        assert_eq!(s.fields().len(), base.fields().len() + 3);
        assert!(crate::schema::check_compatible(crate::schema::Table::Calls, &s, "x").is_ok());
    }
}
