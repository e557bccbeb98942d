//! evalflow's own JSONL request/response pairs, read line by line.
//!
//! # Behavior
//! One `{"request": {...}, "response": {...}}` pair per line in the OpenAI chat format;
//! optional `sample_idx`, `expected`, `http_status`, `error`, `latency_ms`, `provider`,
//! `attempts` and `started_at` (RFC 3339 text or Unix seconds). The input is the last user
//! message, the system the last system (or developer) message. `source_id` is the line
//! number (the pairs format has no id of its own).
//!
//! # Errors
//! A bad line names `file:line` and the field; a mistyped optional field is an error,
//! never a silent NULL or a value wrapped through `as u32`.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{ImportError, Options, Provenance, Record, RecordIter, bad, bad_file};

/// Lines parsed per chunk: enough to keep every core busy, small enough that memory holds
/// a few chunks, never the file.
const CHUNK_LINES: usize = 4096;

/// Opens a pairs file: one record per non-empty line, in file order.
///
/// A reader thread takes the file in chunks of lines and parses each chunk's lines on
/// rayon's pool (sized by `--threads`), so JSON parsing uses every core while the import
/// sink stages the previous chunk; a bounded channel keeps at most a few chunks in memory.
///
/// # Errors
/// The file cannot be opened.
pub fn open(path: &Path, opts: &Options) -> Result<RecordIter, ImportError> {
    use rayon::prelude::*;
    let f = std::fs::File::open(path).map_err(|e| bad_file(path, e))?;
    let file: PathBuf = path.to_path_buf();
    let model = opts.model.clone();
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<Result<Record, ImportError>>>(2);
    std::thread::spawn(move || {
        let mut lines = std::io::BufReader::new(f).lines();
        let mut n = 0usize;
        loop {
            let mut chunk: Vec<(usize, std::io::Result<String>)> = Vec::with_capacity(CHUNK_LINES);
            for l in lines.by_ref().take(CHUNK_LINES) {
                n += 1;
                chunk.push((n, l));
            }
            if chunk.is_empty() {
                return;
            }
            let failed = chunk.iter().any(|(_, l)| l.is_err());
            let records: Vec<Result<Record, ImportError>> = chunk
                .into_par_iter()
                .filter_map(|(n, line)| match line {
                    Err(e) => Some(Err(bad(&file, n, "(line)", e))),
                    Ok(l) if l.trim().is_empty() => None,
                    Ok(l) => Some(record(&file, n, &l, &model)),
                })
                .collect();
            let stop = failed || records.iter().any(Result::is_err);
            // The receiver stops at the first error (or was dropped): read no further.
            if tx.send(records).is_err() || stop {
                return;
            }
        }
    });
    Ok(Box::new(rx.into_iter().flatten()))
}

fn record(
    file: &Path,
    n: usize,
    line: &str,
    model: &Option<String>,
) -> Result<Record, ImportError> {
    let v: Value =
        serde_json::from_str(line).map_err(|e| bad(file, n, "(line)", format!("not JSON: {e}")))?;
    let req = v
        .get("request")
        .filter(|r| r.is_object())
        .ok_or_else(|| bad(file, n, "request", "missing or not an object"))?;
    check_optional_fields(file, n, &v, req)?;
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
    let model = model
        .clone()
        .or_else(|| req.get("model").and_then(Value::as_str).map(String::from))
        .ok_or_else(|| bad(file, n, "request.model", "missing (or pass --model)"))?;
    let status = v
        .get("http_status")
        .and_then(Value::as_i64)
        .map(|s| s as i32);
    let error = v.get("error").and_then(Value::as_str).map(String::from);
    let mut r = Record {
        model,
        system,
        input,
        expected: v.get("expected").and_then(Value::as_str).map(String::from),
        request_key: req.to_string(),
        max_tokens: req
            .get("max_tokens")
            .and_then(Value::as_u64)
            .map(|m| m as u32),
        temperature: req.get("temperature").and_then(Value::as_f64),
        http_status: status,
        source: Provenance {
            format: "pairs",
            file: file.display().to_string(),
            id: Some(n.to_string()),
        },
        ..Record::default()
    };
    match v.get("response") {
        Some(Value::Null) | None if error.is_some() => {}
        Some(resp) if resp.is_object() => {
            let p = crate::stages::call::openai::parse_value(resp)
                .map_err(|e| bad(file, n, "response", e))?;
            r.response = Some(p.content);
            r.finish_reason = p.finish_reason;
            r.prompt_tokens = p.prompt_tokens;
            r.completion_tokens = p.completion_tokens;
            r.reasoning_tokens = p.reasoning_tokens;
            r.reasoning_chars = p.reasoning_chars;
            r.http_status = status.or(Some(200));
        }
        _ => return Err(bad(file, n, "response", "missing or not an object")),
    }
    r.error = error;
    r.sample_idx = match v.get("sample_idx") {
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
fn facts(file: &Path, n: usize, v: &Value, r: &mut Record) -> Result<(), ImportError> {
    let field = |k: &str| v.get(k).filter(|x| !x.is_null());
    if let Some(p) = field("provider") {
        r.provider = Some(
            p.as_str()
                .ok_or_else(|| bad(file, n, "provider", "not a string"))?
                .to_string(),
        );
    }
    if let Some(a) = field("attempts") {
        r.attempts = Some(
            a.as_i64()
                .filter(|k| (0..=i32::MAX as i64).contains(k))
                .ok_or_else(|| bad(file, n, "attempts", "not a non-negative integer"))?
                as i32,
        );
    }
    if let Some(l) = field("latency_ms") {
        r.latency_ms = Some(
            l.as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| bad(file, n, "latency_ms", "not a non-negative number"))?,
        );
    }
    r.started_at_us = match field("started_at") {
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

/// Optional fields must have their type when present.
fn check_optional_fields(file: &Path, n: usize, v: &Value, req: &Value) -> Result<(), ImportError> {
    let int = |x: &Value, field: &str, lo: i64, hi: i64| match x {
        Value::Null => Ok(()),
        x => match x.as_i64() {
            Some(k) if (lo..=hi).contains(&k) => Ok(()),
            _ => Err(bad(
                file,
                n,
                field,
                format!("`{x}` is not an integer in {lo}..={hi}"),
            )),
        },
    };
    let typed = |x: Option<&Value>, field: &str, ok: fn(&Value) -> bool, what: &str| match x {
        Some(x) if !x.is_null() && !ok(x) => {
            Err(bad(file, n, field, format!("`{x}` is not {what}")))
        }
        _ => Ok(()),
    };
    if let Some(x) = req.get("max_tokens") {
        int(x, "request.max_tokens", 0, i32::MAX as i64)?;
    }
    if let Some(x) = v.get("http_status") {
        int(x, "http_status", 100, 599)?;
    }
    typed(
        req.get("temperature"),
        "request.temperature",
        Value::is_number,
        "a number",
    )?;
    typed(
        v.get("latency_ms"),
        "latency_ms",
        Value::is_number,
        "a number",
    )?;
    typed(v.get("expected"), "expected", Value::is_string, "a string")?;
    typed(v.get("error"), "error", Value::is_string, "a string")?;
    Ok(())
}
