//! evalflow's own JSONL request/response pairs, read line by line.
//!
//! # Behavior
//! One `{"request": {...}, "response": {...}}` pair per line in the OpenAI chat format;
//! optional `sample_idx`, `expected`, `http_status`, `error` (text, or an object such as
//! `{"code", "message"}`), `latency_ms`, `provider`, `attempts`, `started_at` (RFC 3339
//! text or Unix seconds), `test` and `capability`; the `--cluster` field is a top-level
//! field or one of `metadata`. The input is the last user message, the system the last
//! system (or developer) message; the case is the whole request (every message and the
//! parameters, see [`super::request_case_key`]). A response that is an error body
//! (`{"error": {...}}`, with the line's `http_status`) is a provider error. `source_id` is
//! the line number (the pairs format has no id of its own).
//!
//! # Errors
//! A bad line names `file:line` and the field; a mistyped optional field is an error,
//! never a silent NULL or a value wrapped through `as u32`.

mod blocks;
mod cache;
#[cfg(test)]
mod tests;
mod typed_request;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde_json::Value;
use serde_json::value::RawValue;

use super::{ImportError, Options, Provenance, Record, RecordIter, Request, bad, bad_file};
use crate::stages::call::openai;

use blocks::*;
use cache::*;

/// Opens a pairs file: one record per non-empty line, in file order.
///
/// One thread cuts the file into blocks of whole lines (windows mapped into memory,
/// [`map_blocks`], or for a pipe buffers read, [`read_blocks`]) and counts their lines;
/// another hands each block to rayon's pool (sized by `--threads`), which splits it into
/// lines and parses them, and queues the block's result in file order. Two blocks are
/// parsed at once, so the pool never waits for the end of a block (or for the consumer)
/// before it starts the next. Counting the next block's lines (which faults its pages
/// in) overlaps the parse, so a file that is not in the page cache costs its disk time
/// beside the parsing rather than before it; bounded channels keep at most a few blocks
/// and parsed blocks in memory. Lines are split and checked for UTF-8 in the parse, on
/// every core, not one line at a time on the reader.
///
/// # Errors
/// The file cannot be opened.
pub fn open(path: &Path, opts: &Options) -> Result<RecordIter, ImportError> {
    type Parsed = Vec<Vec<Result<Record, ImportError>>>;
    let f = std::fs::File::open(path).map_err(|e| bad_file(path, e))?;
    let file = std::sync::Arc::new(path.to_path_buf());
    let model = std::sync::Arc::new(opts.model.as_deref().map(Arc::<str>::from));
    let cluster = std::sync::Arc::new(opts.cluster.clone());
    let cache = std::sync::Arc::new(RequestCache::new(
        opts.test.as_deref().unwrap_or("imported"),
    ));
    let (btx, brx) = std::sync::mpsc::sync_channel::<std::io::Result<Block>>(2);
    std::thread::spawn(move || match f.metadata() {
        Ok(m) if m.is_file() => map_blocks(&f, m.len(), &btx),
        _ => read_blocks(f, &btx),
    });
    // Each block's parse, in file order: the consumer waits on the first.
    let (tx, rx) = std::sync::mpsc::sync_channel::<std::sync::mpsc::Receiver<Parsed>>(1);
    std::thread::spawn(move || {
        let mut next_line = 1;
        for block in brx {
            let block = match block {
                Ok(b) => b,
                Err(e) => {
                    let (etx, erx) = std::sync::mpsc::sync_channel(1);
                    let _ = etx.send(vec![vec![Err(bad(&file, next_line, "(line)", e).fatal())]]);
                    let _ = tx.send(erx);
                    return;
                }
            };
            next_line = block.first_line + block.lines;
            let (ptx, prx) = std::sync::mpsc::sync_channel(1);
            // The consumer was dropped (it stops at the first error): read no further.
            if tx.send(prx).is_err() {
                return;
            }
            let (file, model, cluster) = (file.clone(), model.clone(), cluster.clone());
            let cache = cache.clone();
            rayon::spawn(move || {
                let _ = ptx.send(parse_block(&file, &model, &cluster, &cache, &block));
            });
        }
    });
    // A parse job cannot drop its sender without sending: a panic in a `rayon::spawn` job
    // aborts the process (rayon's default), so no block is skipped silently here.
    let parsed = rx.into_iter().map_while(|p| p.recv().ok());
    // Every line, bad ones as errors: the caller reports them all (or skips them) and
    // stops reading when it wants.
    Ok(Box::new(parsed.flatten().flatten()))
}

/// A block's records, parsed slice by slice on rayon's pool (each slice's records written
/// in place, not gathered into one vector).
fn parse_block(
    file: &Path,
    model: &Option<Arc<str>>,
    cluster: &Option<String>,
    cache: &RequestCache,
    block: &Block,
) -> Vec<Vec<Result<Record, ImportError>>> {
    use rayon::prelude::*;
    // Each record's `source_file`, written out once per block.
    let block_file: String = file.display().to_string();
    // Slices in order, each remembering its last request: the samples and models of a
    // case usually sit together and send the same request text.
    split_lines(block)
        .par_chunks(SLICE_LINES)
        .map(|slice| {
            // A copy per slice: one `Arc` shared by the whole block had its count written
            // by every record on both cores (a cache line passed back and forth per record).
            let file_text: Arc<str> = Arc::from(block_file.as_str());
            let mut seen = Seen::new(cache);
            slice
                .iter()
                .filter_map(|&(n, line)| match utf8(line) {
                    Err(e) => Some(Err(bad(file, n, "(line)", format!("invalid UTF-8: {e}")))),
                    Ok(l) if l.trim().is_empty() => None,
                    Ok(l) => Some(
                        record(file, &file_text, n, l, model, cluster, &mut seen)
                            .map_err(|e| e.with_raw(l)),
                    ),
                })
                .fold(Vec::with_capacity(slice.len()), |mut out, r| {
                    out.push(r);
                    out
                })
        })
        .collect()
}

/// A line as text: checked with SIMD (`simdutf8`, already built for arrow-json), about four
/// times the standard library's speed on these lines; a line that fails is checked again by
/// the standard library for the error's position.
fn utf8(line: &[u8]) -> Result<&str, std::str::Utf8Error> {
    match simdutf8::basic::from_utf8(line) {
        Ok(s) => Ok(s),
        Err(_) => std::str::from_utf8(line),
    }
}

/// What a line's `request` gives its record.
#[derive(Clone, Debug, PartialEq)]
struct ParsedRequest {
    system: Option<Arc<str>>,
    input: Arc<str>,
    model: Option<Arc<str>>,
    /// The hash of the request as `Value::to_string()` writes it (keys sorted), so it
    /// does not change with how the file spaced or ordered it: computed once per
    /// distinct request, shared by its records.
    hash: Arc<str>,
    max_tokens: Option<u32>,
    temperature: Option<f64>,
    /// The whole conversation and its parameters when they say more than (system,
    /// input): see [`super::request_case_key`].
    case_key: Option<Arc<str>>,
    /// The case id for the file's test ([`RequestCache::test`]), once per request.
    case_id: Arc<str>,
}

/// Reads a line's `request` object; its case id is computed for `test`.
fn request(file: &Path, n: usize, req: &Value, test: &str) -> Result<ParsedRequest, ImportError> {
    check_request_fields(file, n, req)?;
    let msgs = req
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| bad(file, n, "request.messages", "missing or not an array"))?;
    if let Some(i) = msgs
        .iter()
        .position(|m| m.get("role").and_then(Value::as_str).is_none())
    {
        return Err(bad(
            file,
            n,
            &format!("request.messages[{i}].role"),
            "missing",
        ));
    }
    let (system, input) = super::chat_prompt(msgs);
    let input = input.ok_or_else(|| {
        bad(
            file,
            n,
            "request.messages",
            "no user message with text content",
        )
    })?;
    let (key, case_key) = super::request_keys(req);
    let case_id = super::case_id(test, case_key.as_deref(), system.as_deref(), &input).into();
    Ok(ParsedRequest {
        system: system.map(Into::into),
        input: input.into(),
        model: req.get("model").and_then(Value::as_str).map(Arc::from),
        hash: crate::stages::call::sha_prefix(&[&key], 32).into(),
        max_tokens: req
            .get("max_tokens")
            .and_then(Value::as_u64)
            .map(|m| m as u32),
        temperature: req.get("temperature").and_then(Value::as_f64),
        case_key: case_key.map(Into::into),
        case_id,
    })
}

/// The record's [`Request`] of a parsed request, as the one `Arc` its file's records share:
/// its model is `--model`, else the request's own as [`RequestCache::shared_model`] gives
/// it; `None` when neither names one.
fn shared(
    rq: ParsedRequest,
    model: &Option<Arc<str>>,
    cache: &RequestCache,
) -> Option<Arc<Request>> {
    let source_model = rq.model.map(|m| cache.shared_model(m));
    Some(Arc::new(Request {
        model: model.clone().or(source_model.clone())?,
        source_model,
        system: rq.system,
        input: rq.input,
        case_key: rq.case_key,
        request_key: String::new(),
        request_hash: Some(rq.hash),
        case_id: Some((cache.test.clone(), rq.case_id)),
        max_tokens: rq.max_tokens,
        temperature: rq.temperature,
    }))
}

/// A line's fields, as raw text borrowed from the line but for the response, which is
/// `R`: types read in the same pass ([`TypedBody`]) or raw text too. A JSON `null` is
/// `None` as an absent field is; fields of other names are ignored.
#[derive(serde::Deserialize)]
struct Line<'a, R> {
    #[serde(borrow)]
    request: Option<&'a RawValue>,
    response: Option<R>,
    #[serde(borrow)]
    sample_idx: Option<&'a RawValue>,
    #[serde(borrow)]
    expected: Option<&'a RawValue>,
    #[serde(borrow)]
    http_status: Option<&'a RawValue>,
    #[serde(borrow)]
    error: Option<&'a RawValue>,
    #[serde(borrow)]
    latency_ms: Option<&'a RawValue>,
    #[serde(borrow)]
    provider: Option<&'a RawValue>,
    #[serde(borrow)]
    attempts: Option<&'a RawValue>,
    #[serde(borrow)]
    started_at: Option<&'a RawValue>,
    #[serde(borrow)]
    test: Option<&'a RawValue>,
    #[serde(borrow)]
    capability: Option<&'a RawValue>,
}

/// A response read as types while its line is split.
type TypedBody = openai::MapOnly<openai::TypedResponse>;

/// A line's response: read with the line, or raw text for [`openai::parse`].
enum Response<'a> {
    Parsed(crate::stages::call::http::Parsed),
    Raw(&'a RawValue),
}

/// A line's optional scalar fields, each read on its own from its raw text (`null` kept
/// as `Value::Null`, an absent field `None`): no map of them is built per line.
struct Scalars {
    sample_idx: Option<Value>,
    expected: Option<Value>,
    http_status: Option<Value>,
    error: Option<Value>,
    latency_ms: Option<Value>,
    provider: Option<Value>,
    attempts: Option<Value>,
    started_at: Option<Value>,
    test: Option<Value>,
    capability: Option<Value>,
}

impl Scalars {
    fn of<R>(line: &Line<R>) -> Self {
        let read = |raw: Option<&RawValue>| raw.map(|r| scalar(r.get()));
        Scalars {
            sample_idx: read(line.sample_idx),
            expected: read(line.expected),
            http_status: read(line.http_status),
            error: read(line.error),
            latency_ms: read(line.latency_ms),
            provider: read(line.provider),
            attempts: read(line.attempts),
            started_at: read(line.started_at),
            test: read(line.test),
            capability: read(line.capability),
        }
    }
}

/// A field's value from its raw JSON text (which the line's parse checked): the usual
/// shapes, a small integer and a string without escapes, read straight from the text,
/// anything else parsed.
fn scalar(raw: &str) -> Value {
    let b = raw.as_bytes();
    if !b.is_empty()
        && b.len() <= 18
        && b.iter().all(u8::is_ascii_digit)
        && (b[0] != b'0' || b.len() == 1)
    {
        return Value::from(raw.parse::<u64>().expect("at most 18 digits"));
    }
    if b.len() >= 2 && b[0] == b'"' && !b.contains(&b'\\') {
        // Valid JSON: with no escape, the only quotes are the two that delimit it.
        return Value::String(raw[1..raw.len() - 1].to_string());
    }
    serde_json::from_str::<Value>(raw).expect("raw JSON re-parses")
}

/// One line as a record (`file_text` is `file` as `source_file` names it). `last` is the
/// previous line's request text and what it gave, reused when this line's request text is
/// the same (by its hash, [`text_hash`]), as is what `cache` holds for it (both in `seen`).
///
/// The line is split into its fields with `request` left as raw text, parsed only when it
/// differs from the last one, and the response read as types in the same pass (else as raw
/// text, by [`openai::parse`]), so no `Value` tree is built for a well-formed line but its
/// small top-level fields.
fn record(
    file: &Path,
    file_text: &Arc<str>,
    n: usize,
    line: &str,
    model: &Option<Arc<str>>,
    cluster: &Option<String>,
    seen: &mut Seen,
) -> Result<Record, ImportError> {
    // One pass for a well-formed line: its response read as types while the line is split.
    // A line that pass refuses (any stray shape or type, a field named twice) or whose
    // response has no choice is split again with the response as raw text, which gives
    // the same record or the error naming the field.
    let typed = serde_json::from_str::<Line<TypedBody>>(line)
        .ok()
        .and_then(|mut f| {
            let resp = match f.response.take() {
                None => None,
                Some(body) => Some(Response::Parsed(openai::parsed_of(body)?)),
            };
            Some((f.request, Scalars::of(&f), resp))
        });
    let (req, v, resp) = match typed {
        Some(parts) => parts,
        None => {
            let f: Line<&RawValue> = match serde_json::from_str(line) {
                Ok(f) => f,
                Err(e) => {
                    // Not JSON (the parser's own message), JSON that is not an object, or
                    // an object that names a field twice.
                    let v = serde_json::from_str::<Value>(line)
                        .map_err(|e| bad(file, n, "(line)", format!("not JSON: {e}")))?;
                    if v.is_object() {
                        return Err(bad(file, n, "(line)", e));
                    }
                    return Err(bad(file, n, "request", "missing or not an object"));
                }
            };
            (f.request, Scalars::of(&f), f.response.map(Response::Raw))
        }
    };
    let req = req
        .filter(|r| r.get().starts_with('{'))
        .ok_or_else(|| bad(file, n, "request", "missing or not an object"))?;
    let hash = text_hash(req.get());
    let request = match seen.last.as_ref() {
        Some((h, rq)) if *h == hash => rq.clone(),
        _ => {
            let rq = match seen.lookup(hash) {
                Cached::Hit(rq) => rq,
                miss => {
                    let test = &seen.cache.test;
                    let last = seen.last.as_ref().map(|(_, l)| &**l);
                    let parsed = match typed_request::request(req.get(), test, last) {
                        Some(rq) => rq,
                        None => {
                            let parsed: Value =
                                serde_json::from_str(req.get()).expect("raw JSON re-parses");
                            request(file, n, &parsed, test)?
                        }
                    };
                    // A request that names no model (and no `--model`) is an error of
                    // every line that sends it, reported after the line's other fields.
                    let Some(rq) = shared(parsed, model, seen.cache) else {
                        check_optional_fields(file, n, &v)?;
                        return Err(bad(file, n, "request.model", "missing (or pass --model)"));
                    };
                    if let Cached::Miss = miss {
                        seen.cache.put(hash, rq.clone());
                    }
                    rq
                }
            };
            seen.last = Some((hash, rq.clone()));
            rq
        }
    };
    check_optional_fields(file, n, &v)?;
    let status = v
        .http_status
        .as_ref()
        .and_then(Value::as_i64)
        .map(|s| s as i32);
    let mut error = v.error.as_ref().and_then(super::error_text);
    let text = |x: &Option<Value>, field: &str| -> Result<Option<String>, ImportError> {
        match x {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(x) => Err(bad(file, n, field, format!("`{x}` is not a string"))),
        }
    };
    let (test, capability) = (text(&v.test, "test")?, text(&v.capability, "capability")?);
    let cluster = match cluster {
        Some(f) => cluster_of(line, f),
        None => None,
    };
    let mut r = Record {
        request,
        test,
        capability,
        cluster,
        expected: v
            .expected
            .as_ref()
            .and_then(Value::as_str)
            .map(String::from),
        http_status: status,
        source: Provenance {
            format: "pairs",
            file: file_text.clone(),
            id: Some(n.to_string()),
        },
        ..Record::default()
    };
    // An error body in place of a completion (`"response": {"error": {...}}`, as a server
    // answers a 4xx or 5xx) is a provider error, not a bad line.
    let error_body = match &resp {
        Some(Response::Raw(raw)) if raw.get().starts_with('{') => {
            match serde_json::from_str::<Value>(raw.get()) {
                Ok(Value::Object(m)) if m.contains_key("error") && !m.contains_key("choices") => {
                    m.get("error").and_then(super::error_text)
                }
                _ => None,
            }
        }
        _ => None,
    };
    let is_error_body = error_body.is_some();
    if let Some(e) = error_body {
        error.get_or_insert(e);
    }
    let parsed = match resp {
        Some(Response::Parsed(p)) => Some(p),
        _ if is_error_body => None,
        None if error.is_some() => None,
        Some(Response::Raw(raw)) if raw.get() == "null" && error.is_some() => None,
        Some(Response::Raw(raw)) if raw.get().starts_with('{') => {
            let p = openai::parse(raw.get().as_bytes()).map_err(|e| bad(file, n, "response", e))?;
            check_usage(file, n, raw.get())?;
            Some(p)
        }
        _ => return Err(bad(file, n, "response", "missing or not an object")),
    };
    if let Some(p) = parsed {
        r.set_response(p);
        r.http_status = status.or(Some(200));
    }
    r.error = error;
    r.sample_idx = match &v.sample_idx {
        None | Some(Value::Null) => None,
        Some(s) => Some(
            s.as_i64()
                .filter(|k| (0..=i32::MAX as i64).contains(k))
                .ok_or_else(|| bad(file, n, "sample_idx", "not a non-negative integer"))?
                as i32,
        ),
    };
    facts(file, n, &v, &mut r)?;
    Ok(r)
}

/// The optional `provider`, `attempts`, `latency_ms` and `started_at` (RFC 3339 text or
/// Unix seconds) of a line.
fn facts(file: &Path, n: usize, v: &Scalars, r: &mut Record) -> Result<(), ImportError> {
    fn field(x: &Option<Value>) -> Option<&Value> {
        x.as_ref().filter(|x| !x.is_null())
    }
    if let Some(p) = field(&v.provider) {
        r.provider = Some(
            p.as_str()
                .ok_or_else(|| bad(file, n, "provider", "not a string"))?
                .to_string(),
        );
    }
    if let Some(a) = field(&v.attempts) {
        r.attempts = Some(
            a.as_i64()
                .filter(|k| (0..=i32::MAX as i64).contains(k))
                .ok_or_else(|| bad(file, n, "attempts", "not a non-negative integer"))?
                as i32,
        );
    }
    if let Some(l) = field(&v.latency_ms) {
        r.latency_ms = Some(
            l.as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| bad(file, n, "latency_ms", "not a non-negative number"))?,
        );
    }
    r.started_at_us = match field(&v.started_at) {
        None => None,
        Some(Value::String(t)) => Some(
            chrono::DateTime::parse_from_rfc3339(t)
                .map_err(|e| bad(file, n, "started_at", format!("not an RFC 3339 time: {e}")))?
                .timestamp_micros(),
        ),
        Some(x) => Some(
            x.as_f64()
                .filter(|s| s.is_finite())
                .map(|s| (s * 1e6).round() as i64)
                .ok_or_else(|| {
                    bad(
                        file,
                        n,
                        "started_at",
                        "not an RFC 3339 time or Unix seconds",
                    )
                })?,
        ),
    };
    Ok(())
}

/// An integer field in `lo..=hi`, when present and not null.
fn check_int(
    file: &Path,
    n: usize,
    x: Option<&Value>,
    field: &str,
    lo: i64,
    hi: i64,
) -> Result<(), ImportError> {
    match x {
        None | Some(Value::Null) => Ok(()),
        Some(x) => match x.as_i64() {
            Some(k) if (lo..=hi).contains(&k) => Ok(()),
            _ => Err(bad(
                file,
                n,
                field,
                format!("`{x}` is not an integer in {lo}..={hi}"),
            )),
        },
    }
}

/// A field of the type `ok` checks, when present and not null.
fn check_typed(
    file: &Path,
    n: usize,
    x: Option<&Value>,
    field: &str,
    ok: fn(&Value) -> bool,
    what: &str,
) -> Result<(), ImportError> {
    match x {
        Some(x) if !x.is_null() && !ok(x) => {
            Err(bad(file, n, field, format!("`{x}` is not {what}")))
        }
        _ => Ok(()),
    }
}

/// The request's optional fields must have their type when present.
fn check_request_fields(file: &Path, n: usize, req: &Value) -> Result<(), ImportError> {
    check_int(
        file,
        n,
        req.get("max_tokens"),
        "request.max_tokens",
        0,
        i32::MAX as i64,
    )?;
    check_typed(
        file,
        n,
        req.get("temperature"),
        "request.temperature",
        Value::is_number,
        "a number",
    )
}

/// A response's optional token counts must be integers when present: `"prompt_tokens":
/// "ten"` is an error naming `response.usage.prompt_tokens`, never a silent NULL. Only a
/// response the one-pass read declined gets here (that read takes integers only).
fn check_usage(file: &Path, n: usize, raw: &str) -> Result<(), ImportError> {
    let v: Value = serde_json::from_str(raw).map_err(|e| bad(file, n, "response", e))?;
    let usage = match v.get("usage") {
        None | Some(Value::Null) => return Ok(()),
        Some(u @ Value::Object(_)) => u,
        Some(u) => {
            return Err(bad(
                file,
                n,
                "response.usage",
                format!("`{u}` is not an object"),
            ));
        }
    };
    let details = usage.get("completion_tokens_details");
    check_typed(
        file,
        n,
        details,
        "response.usage.completion_tokens_details",
        Value::is_object,
        "an object",
    )?;
    let fields = [
        ("prompt_tokens", usage.get("prompt_tokens")),
        ("completion_tokens", usage.get("completion_tokens")),
        (
            "completion_tokens_details.reasoning_tokens",
            details.and_then(|d| d.get("reasoning_tokens")),
        ),
    ];
    for (name, x) in fields {
        let field = format!("response.usage.{name}");
        check_typed(file, n, x, &field, |x| x.as_i64().is_some(), "an integer")?;
    }
    Ok(())
}

/// The line's optional fields must have their type when present.
fn check_optional_fields(file: &Path, n: usize, v: &Scalars) -> Result<(), ImportError> {
    check_int(file, n, v.http_status.as_ref(), "http_status", 100, 599)?;
    check_typed(
        file,
        n,
        v.latency_ms.as_ref(),
        "latency_ms",
        Value::is_number,
        "a number",
    )?;
    check_typed(
        file,
        n,
        v.expected.as_ref(),
        "expected",
        Value::is_string,
        "a string",
    )?;
    check_typed(
        file,
        n,
        v.error.as_ref(),
        "error",
        |x| x.is_string() || x.is_object(),
        "a string or an object",
    )
}

/// The value of the `--cluster` field of a line: a top-level field, else one of its
/// `metadata` object; `None` when the line has neither.
fn cluster_of(line: &str, field: &str) -> Option<String> {
    let v: serde_json::Map<String, Value> = serde_json::from_str(line).ok()?;
    v.get(field)
        .filter(|x| !x.is_null())
        .or_else(|| v.get("metadata").and_then(|m| m.get(field)))
        .and_then(super::as_text)
}
