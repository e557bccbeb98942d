//! OpenAI Batch API output, joined with the batch input by `custom_id`.
//!
//! # Behavior
//! - Each output line is `{"id", "custom_id", "response": {"status_code", "request_id",
//!   "body"} | null, "error": {"code", "message"} | null}`, in any order. A 200 body is a
//!   chat completion: answer, finish reason and token usage land in the call. Any other
//!   status becomes a provider error with that `http_status` and the body's
//!   `error.message`; a line with `error` (expired, cancelled) becomes a provider error
//!   with no status: failed requests are rows, never missing.
//! - The input lines (`{"custom_id", "method", "url", "body"}`, given with `--batch-input`
//!   or found in the same folder) give the prompt (last user message), system message,
//!   model, `max_tokens` (or `max_completion_tokens`) and `temperature`. The input files
//!   are read into a map from `custom_id` to request before the output streams: they are
//!   bounded by the API's batch size (50,000 requests), not by the archive.
//! - The case is the whole request (every message and the parameters, not the `seed` that
//!   tells samples apart). `test`, `capability` and the `--cluster` field come from the
//!   output line, its input line, or the request's `metadata`, and so does the expected
//!   answer when `--expected-field` names its field (Batch output carries none: without it
//!   every case has no expected answer, which the checklist leaves unscored). A 200 whose
//!   body is an `error` object is a provider error too.
//! - Without an input line a record keeps an empty input and is its own case (keyed by
//!   `custom_id`); the model then comes from the response body or `--model`.
//! - `provider` is `openai`, `source_id` the `custom_id`.
//! - A `custom_id` is unique in one batch's output, so a line that repeats the `custom_id`
//!   of an earlier line of the same file is a copy (a download appended twice, files
//!   concatenated): it is dropped, not imported as one more sample, and counted in
//!   [`Repeats`] for the import to report. Two output files may reuse ids (two batches).
//!
//! # Errors
//! A line that is not JSON or lacks `custom_id` names `file:line` and the field. A line that
//! repeats a `custom_id` with a different content (not a copy: which answer is the call's
//! cannot be told) names both lines.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;

use super::{ImportError, Options, Provenance, Record, RecordIter, Request, bad, bad_file};

/// Requests of a batch input, by `custom_id`: the whole input line (its `body` is the
/// request).
pub type Requests = HashMap<String, Value>;

/// Reads batch input files into a map from `custom_id` to the input line.
///
/// # Errors
/// A line that is not JSON or has no `custom_id` / `body`.
pub fn read_inputs(files: &[PathBuf]) -> Result<Requests, ImportError> {
    let mut out = HashMap::new();
    for file in files {
        let f = std::fs::File::open(file).map_err(|e| bad_file(file, e))?;
        for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
            let n = i + 1;
            let line = line.map_err(|e| bad(file, n, "(line)", e))?;
            if line.trim().is_empty() {
                continue;
            }
            let v: Value = serde_json::from_str(&line)
                .map_err(|e| bad(file, n, "(line)", format!("not JSON: {e}")))?;
            let id = v
                .get("custom_id")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(file, n, "custom_id", "missing or not a string"))?
                .to_string();
            if !v.get("body").is_some_and(Value::is_object) {
                return Err(bad(file, n, "body", "missing or not an object"));
            }
            out.insert(id, v);
        }
    }
    Ok(out)
}

/// Output lines dropped as copies of an earlier line with the same `custom_id`, counted
/// over every file opened with it (clones share the count).
#[derive(Debug, Clone, Default)]
pub struct Repeats(Arc<AtomicU64>);

impl Repeats {
    /// The lines dropped so far.
    pub fn count(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Opens a batch output file, joined with the inputs named in `opts`.
///
/// # Errors
/// The output or an input file cannot be read.
pub fn open(path: &Path, opts: &Options) -> Result<RecordIter, ImportError> {
    let inputs = Arc::new(read_inputs(&opts.batch_inputs)?);
    open_joined(path, opts, inputs, Repeats::default())
}

/// Opens a batch output file joined with `inputs` already read; the lines it drops as
/// copies of an earlier line (the same `custom_id`) are counted in `repeats`.
///
/// # Errors
/// The file cannot be opened.
pub fn open_joined(
    path: &Path,
    opts: &Options,
    inputs: Arc<Requests>,
    repeats: Repeats,
) -> Result<RecordIter, ImportError> {
    let f = std::fs::File::open(path).map_err(|e| bad_file(path, e))?;
    let file = path.to_path_buf();
    let opts = opts.clone();
    let lines = std::io::BufReader::new(f).lines().enumerate();
    // Each custom_id read in this file: the hash of its line's JSON and the line number.
    // Bounded by the batch size (50,000 requests), as the inputs are.
    let mut seen: HashMap<String, (u64, usize)> = HashMap::new();
    Ok(Box::new(lines.filter_map(move |(i, line)| {
        let n = i + 1;
        let l = match line {
            Err(e) => return Some(Err(bad(&file, n, "(line)", e))),
            Ok(l) if l.trim().is_empty() => return None,
            Ok(l) => l,
        };
        let v: Value = match serde_json::from_str(&l) {
            Ok(v) => v,
            Err(e) => {
                return Some(Err(
                    bad(&file, n, "(line)", format!("not JSON: {e}")).with_raw(&l)
                ));
            }
        };
        match repeat_of(&mut seen, &file, n, &v) {
            Ok(true) => {
                repeats.0.fetch_add(1, Ordering::Relaxed);
                None
            }
            Ok(false) => Some(record(&file, n, &v, &opts, &inputs).map_err(|e| e.with_raw(&l))),
            Err(e) => Some(Err(e.with_raw(&l))),
        }
    })))
}

/// Whether line `n` is a copy of an earlier line with its `custom_id` (else it is recorded
/// as the first). A line without a `custom_id` is no repeat: [`record`] names what is
/// wrong with it.
///
/// # Errors
/// The `custom_id` was read before with a different content.
fn repeat_of(
    seen: &mut HashMap<String, (u64, usize)>,
    file: &Path,
    n: usize,
    v: &Value,
) -> Result<bool, ImportError> {
    let Some(id) = v.get("custom_id").and_then(Value::as_str) else {
        return Ok(false);
    };
    // The parsed value, so a copy written with other spacing is still a copy.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.to_string().hash(&mut h);
    let hash = h.finish();
    match seen.get(id) {
        None => {
            seen.insert(id.to_string(), (hash, n));
            Ok(false)
        }
        Some(&(first, _)) if first == hash => Ok(true),
        Some(&(_, at)) => Err(bad(
            file,
            n,
            "custom_id",
            format!(
                "`{id}` was read at line {at} with a different content; a custom_id is unique in batch output, so which line is the \
                 call's answer cannot be told"
            ),
        )),
    }
}

/// A field of a record: on the output line, on its input line, or in the request's
/// `metadata`.
fn field_of(out: &Value, input: Option<&Value>, field: &str) -> Option<String> {
    fn get<'a>(v: Option<&'a Value>, field: &str) -> Option<&'a Value> {
        v.and_then(|v| v.get(field)).filter(|x| !x.is_null())
    }
    get(Some(out), field)
        .or_else(|| get(input, field))
        .or_else(|| get(input.and_then(|i| i.pointer("/body/metadata")), field))
        .and_then(super::as_text)
}

fn record(
    file: &Path,
    n: usize,
    v: &Value,
    opts: &Options,
    inputs: &Requests,
) -> Result<Record, ImportError> {
    let model = &opts.model;
    let id = v
        .get("custom_id")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(file, n, "custom_id", "missing or not a string"))?;
    let input = inputs.get(id);
    let req = input.and_then(|i| i.get("body"));
    let resp = v.get("response").filter(|r| r.is_object());
    let body = resp.and_then(|r| r.get("body"));
    let mut r = Record {
        provider: Some("openai".into()),
        source: Provenance {
            format: "openai-batch",
            file: file.display().to_string().into(),
            id: Some(id.to_string()),
        },
        test: field_of(v, input, "test"),
        capability: field_of(v, input, "capability"),
        cluster: opts.cluster.as_deref().and_then(|f| field_of(v, input, f)),
        expected: opts
            .expected_field
            .as_deref()
            .and_then(|f| field_of(v, input, f)),
        ..Record::default()
    };
    // What the call asked: its request line's body, else what the output line says.
    let mut asked = Request::default();
    match req {
        Some(req) => {
            let msgs = req
                .get("messages")
                .and_then(Value::as_array)
                .ok_or_else(|| {
                    bad(
                        file,
                        n,
                        "body.messages",
                        format!("the input of `{id}` has no messages"),
                    )
                })?;
            let (system, input) = super::chat_prompt(msgs);
            asked.system = system.map(Into::into);
            asked.input = input.map(Into::into).ok_or_else(|| {
                bad(
                    file,
                    n,
                    "body.messages",
                    format!("the input of `{id}` has no user message"),
                )
            })?;
            asked.request_key = req.to_string();
            asked.case_key = super::request_case_key(req).map(Into::into);
            asked.max_tokens = req
                .get("max_tokens")
                .or_else(|| req.get("max_completion_tokens"))
                .and_then(Value::as_u64)
                .and_then(|m| u32::try_from(m).ok());
            asked.temperature = req.get("temperature").and_then(Value::as_f64);
        }
        None => {
            asked.case_key = Some(id.into());
            asked.request_key = id.to_string();
        }
    }
    asked.source_model = req
        .and_then(|q| q.get("model"))
        .and_then(Value::as_str)
        .map(Arc::from)
        .or_else(|| {
            body.and_then(|b| b.get("model"))
                .and_then(Value::as_str)
                .map(Arc::from)
        });
    asked.model = model
        .as_deref()
        .map(Arc::from)
        .or_else(|| asked.source_model.clone())
        .ok_or_else(|| {
            bad(
                file,
                n,
                "response.body.model",
                "missing (pass --batch-input or --model)",
            )
        })?;
    r.request = asked.into();
    if let Some(resp) = resp {
        let status = resp
            .get("status_code")
            .and_then(Value::as_i64)
            .filter(|s| (100..=599).contains(s))
            .ok_or_else(|| {
                bad(
                    file,
                    n,
                    "response.status_code",
                    "missing or not an HTTP status",
                )
            })? as i32;
        r.http_status = Some(status);
        let error_body = body
            .filter(|b| b.get("choices").is_none())
            .and_then(|b| b.get("error"))
            .and_then(super::error_text);
        if let Some(e) = error_body {
            // A 200 whose body is an error, not a completion.
            r.error = Some(format!("HTTP {status}: {e}"));
        } else if status == 200 {
            let body = body.ok_or_else(|| bad(file, n, "response.body", "missing"))?;
            let p = crate::stages::call::openai::parse_value(body)
                .map_err(|e| bad(file, n, "response.body", e))?;
            r.set_response(p);
        } else {
            let msg = body
                .and_then(|b| b.pointer("/error/message"))
                .and_then(Value::as_str)
                .map(String::from)
                .or_else(|| body.map(|b| b.to_string()))
                .unwrap_or_default();
            r.error = Some(format!("HTTP {status}: {msg}"));
        }
    }
    if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
        r.error = super::error_text(e);
    } else if resp.is_none() {
        return Err(bad(file, n, "response", "neither a response nor an error"));
    }
    Ok(r)
}
