//! `evalflow import`: turns a recorded corpus into `cases` + `calls`, so archived runs
//! flow into validate and score with no model calls.
//!
//! # Behavior
//! - JSONL: one `{"request": {...}, "response": {...}}` pair per line in the OpenAI chat
//!   format; optional `sample_idx`, `expected`, `http_status`, `error`, `latency_ms`.
//! - Parquet: a table with an `input` column plus any calls columns (`response`,
//!   `model`, `sample_idx`, `finish_reason`, token counts, `http_status`, `error`, ...).
//! - One case per distinct user prompt (the last user message), test and capability
//!   `imported`, test type `MFT`, role `single` unless given. A sample index not in the
//!   file is the order of repeats of the same (case, model).
//! - Writes `<root>/import.toml`, a pipeline naming the imported model, and a manifest
//!   with `generate` and `call` complete: `evalflow validate <root>/import.toml --out <root>`
//!   and `evalflow score ...` then run as on any run.
//!
//! # Errors
//! A bad row is exit 2, naming `file:line` (the row number for Parquet) and the field.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Float64Type, Int64Type};
use serde_json::{Value, json};

use super::CliError;
use crate::import_sink::{CaseDefaults, ImportError, ImportSink, ImportedCall};
use crate::pipeline::Pipeline;
use crate::stages::call::CallResult;
use crate::storage::{Manifest, RunStore, manifest_now};

#[derive(Debug, clap::Args)]
pub struct ImportArgs {
    /// The recorded corpus: `.jsonl` request/response pairs or a `.parquet` calls table.
    pub file: PathBuf,
    /// The run root to create.
    #[arg(long)]
    pub out: String,
    /// The model name for every row (default: each request's `model`).
    #[arg(long)]
    pub model: Option<String>,
    /// Test name of the imported cases.
    #[arg(long, default_value = "imported")]
    pub test: String,
    /// Capability of the imported cases.
    #[arg(long, default_value = "imported")]
    pub capability: String,
    /// Test type of the imported cases (MFT, INV, DIR).
    #[arg(long, default_value = "MFT")]
    pub test_type: String,
    /// Role of the imported cases.
    #[arg(long, default_value = "single")]
    pub role: String,
    /// Answer languages validate accepts, comma-separated (default: every language a
    /// built-in scorer reads, `en,zh`, since an imported run's scorers are chosen later).
    #[arg(long, value_delimiter = ',')]
    pub languages: Option<Vec<String>>,
}

/// What the file recorded about a call beyond the request and response. What it did not
/// record stays NULL: an import never invents a provider, a start time or an attempt count.
#[derive(Debug, Clone, Default)]
struct Facts {
    provider: Option<String>,
    attempts: Option<i32>,
    latency_ms: Option<f64>,
    started_at_us: Option<i64>,
}

/// One imported call before case ids are assigned.
struct Record {
    model: String,
    system: Option<String>,
    input: String,
    expected: Option<String>,
    sample_idx: Option<i32>,
    request_key: String,
    max_tokens: Option<u32>,
    temperature: Option<f64>,
    result: CallResult,
    facts: Facts,
}

impl Record {
    /// The record as the import core takes it, with its line (or row) number.
    fn imported(self, line: usize) -> ImportedCall {
        ImportedCall {
            line: line as u64,
            model: self.model,
            system: self.system,
            input: self.input,
            expected: self.expected,
            sample_idx: self.sample_idx,
            request_key: self.request_key,
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            result: self.result,
            provider: self.facts.provider,
            attempts: self.facts.attempts,
            latency_ms: self.facts.latency_ms,
            started_at_us: self.facts.started_at_us,
        }
    }
}

fn bad(file: &Path, line: usize, field: &str, msg: impl std::fmt::Display) -> CliError {
    CliError::BadInput(format!("{}:{line}: field `{field}`: {msg}", file.display()))
}

fn text_of(c: Option<&Value>) -> Option<String> {
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

fn jsonl_record(
    file: &Path,
    n: usize,
    line: &str,
    model: &Option<String>,
) -> Result<Record, CliError> {
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
    let mut input = None;
    let mut system = None;
    for (i, m) in msgs.iter().enumerate() {
        let text = text_of(m.get("content"));
        match m.get("role").and_then(Value::as_str) {
            Some("user") => input = text,
            Some("system") | Some("developer") => system = text,
            Some(_) => {}
            None => {
                return Err(bad(
                    file,
                    n,
                    &format!("request.messages[{i}].role"),
                    "missing",
                ));
            }
        }
    }
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
    let result = match v.get("response") {
        Some(Value::Null) | None if error.is_some() => CallResult {
            http_status: status,
            error,
            ..CallResult::default()
        },
        Some(resp) if resp.is_object() => {
            let p = crate::stages::call::openai::parse(resp.to_string().as_bytes())
                .map_err(|e| bad(file, n, "response", e))?;
            CallResult {
                response: Some(p.content),
                finish_reason: p.finish_reason,
                prompt_tokens: p.prompt_tokens,
                completion_tokens: p.completion_tokens,
                reasoning_tokens: p.reasoning_tokens,
                reasoning_chars: p.reasoning_chars,
                http_status: status.or(Some(200)),
                error,
                ..CallResult::default()
            }
        }
        _ => return Err(bad(file, n, "response", "missing or not an object")),
    };
    let sample_idx = match v.get("sample_idx") {
        None | Some(Value::Null) => None,
        Some(s) => Some(
            s.as_i64()
                .filter(|k| (0..=i32::MAX as i64).contains(k))
                .ok_or_else(|| bad(file, n, "sample_idx", "not a non-negative integer"))?
                as i32,
        ),
    };
    Ok(Record {
        model,
        system,
        input,
        expected: v.get("expected").and_then(Value::as_str).map(String::from),
        sample_idx,
        request_key: req.to_string(),
        max_tokens: req
            .get("max_tokens")
            .and_then(Value::as_u64)
            .map(|m| m as u32),
        temperature: req.get("temperature").and_then(Value::as_f64),
        result,
        facts: jsonl_facts(file, n, &v)?,
    })
}

/// The optional `provider`, `attempts`, `latency_ms` and `started_at` (RFC 3339 text or
/// Unix seconds) of a JSONL record.
fn jsonl_facts(file: &Path, n: usize, v: &Value) -> Result<Facts, CliError> {
    let field = |k: &str| v.get(k).filter(|x| !x.is_null());
    let provider = match field("provider") {
        None => None,
        Some(p) => Some(
            p.as_str()
                .ok_or_else(|| bad(file, n, "provider", "not a string"))?
                .to_string(),
        ),
    };
    let attempts = match field("attempts") {
        None => None,
        Some(a) => Some(
            a.as_i64()
                .filter(|k| (0..=i32::MAX as i64).contains(k))
                .ok_or_else(|| bad(file, n, "attempts", "not a non-negative integer"))?
                as i32,
        ),
    };
    let latency_ms = match field("latency_ms") {
        None => None,
        Some(l) => Some(
            l.as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| bad(file, n, "latency_ms", "not a non-negative number"))?,
        ),
    };
    let started_at_us = match field("started_at") {
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
    Ok(Facts {
        provider,
        attempts,
        latency_ms,
        started_at_us,
    })
}

/// Optional fields of a JSONL record must have their type when present: a mistyped
/// `max_tokens` or `http_status` is an error naming the line and field, never a silent NULL
/// or a value wrapped through `as u32`.
fn check_optional_fields(file: &Path, n: usize, v: &Value, req: &Value) -> Result<(), CliError> {
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

/// Fails unless `v` (when present) lies in `lo..=hi`.
fn in_range(
    file: &Path,
    line: usize,
    field: &str,
    v: Option<i64>,
    lo: i64,
    hi: i64,
) -> Result<(), CliError> {
    match v {
        Some(k) if !(lo..=hi).contains(&k) => Err(bad(
            file,
            line,
            field,
            format!("{k} is out of range ({lo}..={hi})"),
        )),
        _ => Ok(()),
    }
}

/// Casts column `name` of a batch whose first row is file row `row0 + 1` to `t`.
///
/// # Errors
/// A value that does not convert (a string where a number belongs, an overflow, a
/// fraction in an integer column, a number in a text column) is an error naming its row
/// and the column: never a silent NULL.
fn checked_cast(
    file: &Path,
    row0: usize,
    name: &str,
    c: &std::sync::Arc<dyn Array>,
    t: &DataType,
) -> Result<std::sync::Arc<dyn Array>, CliError> {
    use datafusion::arrow::util::display::array_value_to_string;
    let first_valid = (0..c.len()).find(|&r| c.is_valid(r)).unwrap_or(0);
    let is_text = |d: &DataType| {
        matches!(d, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
            || matches!(d, DataType::Dictionary(_, v) if matches!(v.as_ref(), DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View))
    };
    if *t == DataType::Utf8 && !is_text(c.data_type()) && c.null_count() < c.len() {
        return Err(bad(
            file,
            row0 + first_valid + 1,
            name,
            format!("has type {}, expected text", c.data_type()),
        ));
    }
    let out = cast(c, t).map_err(|e| {
        bad(
            file,
            row0 + first_valid + 1,
            name,
            format!("has type {}, cannot be read as {t}: {e}", c.data_type()),
        )
    })?;
    let fraction = t.is_integer() && c.data_type().is_floating();
    let as_f64 = if fraction {
        Some(cast(c, &DataType::Float64).map_err(|e| bad(file, row0 + 1, name, e))?)
    } else {
        None
    };
    for r in 0..c.len() {
        if !c.is_valid(r) {
            continue;
        }
        let whole = as_f64
            .as_ref()
            .is_none_or(|f| f.as_primitive::<Float64Type>().value(r).fract() == 0.0);
        if out.is_null(r) || !whole {
            let v = array_value_to_string(c, r).unwrap_or_default();
            return Err(bad(
                file,
                row0 + r + 1,
                name,
                format!("`{v}` is not a valid {t}"),
            ));
        }
    }
    Ok(out)
}

fn parquet_records(file: &Path, model: &Option<String>) -> Result<Vec<Record>, CliError> {
    use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let f = std::fs::File::open(file)
        .map_err(|e| CliError::BadInput(format!("{}: {e}", file.display())))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(f)
        .and_then(|b| b.build())
        .map_err(|e| {
            CliError::BadInput(format!(
                "{}: footer: not a Parquet file: {e}",
                file.display()
            ))
        })?;
    let mut out = Vec::new();
    let mut row0 = 0usize;
    for b in reader {
        let b: RecordBatch = b.map_err(|e| {
            bad(
                file,
                row0 + 1,
                "(rows)",
                format!("cannot decode the rows from here on: {e}"),
            )
        })?;
        let col =
            |name: &str, t: &DataType| -> Result<Option<std::sync::Arc<dyn Array>>, CliError> {
                match b.column_by_name(name) {
                    None => Ok(None),
                    Some(c) => checked_cast(file, row0, name, c, t).map(Some),
                }
            };
        let s = |name: &str| col(name, &DataType::Utf8);
        let i = |name: &str| col(name, &DataType::Int64);
        let input = s("input")?
            .ok_or_else(|| bad(file, 1, "input", "the Parquet table needs an input column"))?;
        let (resp, mdl, fin, err, exp, sys) = (
            s("response")?,
            s("model")?,
            s("finish_reason")?,
            s("error")?,
            s("expected")?,
            s("system")?,
        );
        let (pt, ct, rt, rc, hs, si, at, mt) = (
            i("prompt_tokens")?,
            i("completion_tokens")?,
            i("reasoning_tokens")?,
            i("reasoning_chars")?,
            i("http_status")?,
            i("sample_idx")?,
            i("attempts")?,
            i("max_tokens")?,
        );
        let (temp, lat) = (
            col("temperature", &DataType::Float64)?,
            col("latency_ms", &DataType::Float64)?,
        );
        let (prov, started) = (
            s("provider")?,
            col(
                "started_at",
                &DataType::Timestamp(
                    datafusion::arrow::datatypes::TimeUnit::Microsecond,
                    Some("UTC".into()),
                ),
            )?,
        );
        let gs = |a: &Option<std::sync::Arc<dyn Array>>, r: usize| -> Option<String> {
            a.as_ref()
                .filter(|a| a.is_valid(r))
                .map(|a| a.as_string::<i32>().value(r).to_string())
        };
        let gi = |a: &Option<std::sync::Arc<dyn Array>>, r: usize| -> Option<i64> {
            a.as_ref()
                .filter(|a| a.is_valid(r))
                .map(|a| a.as_primitive::<Int64Type>().value(r))
        };
        let gf = |a: &Option<std::sync::Arc<dyn Array>>, r: usize| -> Option<f64> {
            a.as_ref()
                .filter(|a| a.is_valid(r))
                .map(|a| a.as_primitive::<Float64Type>().value(r))
        };
        let input_s = Some(input);
        for r in 0..b.num_rows() {
            let line = row0 + r + 1;
            let inp = gs(&input_s, r).ok_or_else(|| bad(file, line, "input", "null"))?;
            let model = model
                .clone()
                .or_else(|| gs(&mdl, r))
                .ok_or_else(|| bad(file, line, "model", "missing (or pass --model)"))?;
            let response = gs(&resp, r);
            let error = gs(&err, r);
            if response.is_none() && error.is_none() {
                return Err(bad(file, line, "response", "null with no error"));
            }
            // Values that would wrap through `as u32` / `as i32` below.
            in_range(file, line, "max_tokens", gi(&mt, r), 0, i32::MAX as i64)?;
            in_range(file, line, "http_status", gi(&hs, r), 100, 599)?;
            for (name, a) in [
                ("prompt_tokens", &pt),
                ("completion_tokens", &ct),
                ("reasoning_tokens", &rt),
                ("reasoning_chars", &rc),
            ] {
                in_range(file, line, name, gi(a, r), 0, i64::MAX)?;
            }
            let sample_idx = match gi(&si, r) {
                Some(k) if !(0..=i32::MAX as i64).contains(&k) => {
                    return Err(bad(file, line, "sample_idx", "not a non-negative integer"));
                }
                k => k.map(|k| k as i32),
            };
            out.push(Record {
                request_key: json!({"model": model, "system": gs(&sys, r), "input": inp})
                    .to_string(),
                model,
                system: gs(&sys, r),
                input: inp,
                expected: gs(&exp, r),
                sample_idx,
                max_tokens: gi(&mt, r).map(|m| m as u32),
                temperature: gf(&temp, r),
                result: CallResult {
                    response,
                    finish_reason: gs(&fin, r),
                    prompt_tokens: gi(&pt, r),
                    completion_tokens: gi(&ct, r),
                    reasoning_tokens: gi(&rt, r),
                    reasoning_chars: gi(&rc, r),
                    http_status: gi(&hs, r).map(|h| h as i32),
                    error,
                    ..CallResult::default()
                },
                facts: Facts {
                    provider: gs(&prov, r),
                    attempts: gi(&at, r).map(|a| a as i32),
                    latency_ms: gf(&lat, r),
                    started_at_us: started.as_ref().filter(|a| a.is_valid(r)).map(|a| {
                        a.as_primitive::<datafusion::arrow::datatypes::TimestampMicrosecondType>()
                            .value(r)
                    }),
                },
            });
        }
        row0 += b.num_rows();
    }
    Ok(out)
}

/// Runs the import.
pub async fn run(a: ImportArgs) -> Result<(), CliError> {
    if !crate::pipeline::TEST_TYPES.contains(&a.test_type.as_str()) {
        return Err(CliError::BadInput(format!(
            "--test-type `{}`: not one of MFT, INV, DIR",
            a.test_type
        )));
    }
    // A local root this import creates is removed again if the import fails.
    let created_dir =
        (!a.out.contains("://") && !Path::new(&a.out).exists()).then(|| PathBuf::from(&a.out));
    let result = import_into(a).await;
    if result.is_err()
        && let Some(d) = created_dir
    {
        let _ = std::fs::remove_dir_all(d);
    }
    result
}

async fn import_into(a: ImportArgs) -> Result<(), CliError> {
    let store = RunStore::open(&a.out).map_err(|e| CliError::BadInput(e.to_string()))?;
    if Manifest::load(&store)
        .await
        .map_err(|e| CliError::Internal(e.to_string()))?
        .is_some()
    {
        return Err(CliError::BadInput(format!(
            "{}: already a run; import into a new --out",
            store.display()
        )));
    }
    let languages: Vec<String> = a.languages.clone().unwrap_or_else(|| {
        crate::stages::score::ALL_LANGUAGES
            .iter()
            .map(|l| l.to_string())
            .collect()
    });
    if let Some(l) = languages.iter().find(|l| l.trim().is_empty()) {
        return Err(CliError::BadInput(format!(
            "--languages: empty language `{l}`"
        )));
    }
    let sink_err = |e: ImportError| {
        if e.is_bad_input() {
            CliError::BadInput(e.to_string())
        } else {
            CliError::Internal(e.to_string())
        }
    };
    let mut sink = ImportSink::new(
        &store,
        CaseDefaults {
            test: a.test.clone(),
            capability: a.capability.clone(),
            test_type: a.test_type.clone(),
            role: a.role.clone(),
        },
        a.file.display().to_string(),
    )
    .await
    .map_err(sink_err)?;
    let is_parquet = a.file.extension().and_then(|e| e.to_str()) == Some("parquet");
    let pushed: Result<(), CliError> = async {
        if is_parquet {
            for (i, r) in parquet_records(&a.file, &a.model)?.into_iter().enumerate() {
                sink.push(r.imported(i + 1)).await.map_err(sink_err)?;
            }
        } else {
            let f = std::fs::File::open(&a.file)
                .map_err(|e| CliError::BadInput(format!("{}: {e}", a.file.display())))?;
            // Line by line: memory holds one staging batch, not the file.
            for (i, line) in std::io::BufReader::with_capacity(1 << 20, f)
                .lines()
                .enumerate()
            {
                let line = line.map_err(|e| bad(&a.file, i + 1, "(line)", e))?;
                if line.trim().is_empty() {
                    continue;
                }
                sink.push(jsonl_record(&a.file, i + 1, &line, &a.model)?.imported(i + 1))
                    .await
                    .map_err(sink_err)?;
            }
        }
        Ok(())
    }
    .await;
    if let Err(e) = pushed {
        // A bad row: nothing of the import stays.
        let _ = store.delete_dir("_import").await;
        return Err(e);
    }
    if sink.rows() == 0 {
        let _ = store.delete_dir("_import").await;
        return Err(CliError::BadInput(format!(
            "{}: no records",
            a.file.display()
        )));
    }
    let summary = sink.finish().await.map_err(sink_err)?;
    let models = summary.models.clone();
    let pipeline_text = format!(
        "# Written by `evalflow import {}`: the pipeline of an imported run (no model is called;\n# the provider below only satisfies the pipeline format: the calls table records NULL\n# where the file named no provider).\n\n[model]\nprovider = \"openai\"\nname = {}\n\n[suite]\nname = \"imported\"\n\n[validate]\nlanguages = {}\n",
        a.file.display(),
        json!(models[0]),
        json!(languages)
    );
    let ppath = Path::new(store.display()).join("import.toml");
    let pipeline =
        Pipeline::parse(&pipeline_text, &ppath).map_err(|e| CliError::Internal(e.to_string()))?;
    let io = |e: crate::storage::StorageError| CliError::Internal(e.to_string());
    if store.table_url("x").starts_with("file:") {
        std::fs::write(&ppath, &pipeline_text)
            .map_err(|e| CliError::Internal(format!("{}: {e}", ppath.display())))?;
    }
    let mut manifest = Manifest {
        run_id: a
            .out
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or("import")
            .to_string(),
        evalflow_version: env!("CARGO_PKG_VERSION").to_string(),
        pipeline_path: ppath.display().to_string(),
        pipeline_hash: pipeline.hash(),
        pipeline: serde_json::to_value(&pipeline).unwrap_or(Value::Null),
        created_at: manifest_now(),
        finished_at: None,
        stages: BTreeMap::new(),
        row_counts: BTreeMap::new(),
        scorer_versions: vec![],
        validator_version: None,
    };
    manifest.complete(
        "generate",
        "cases",
        summary.cases,
        BTreeMap::from([("imported_from".into(), json!(a.file.display().to_string()))]),
    );
    manifest.complete(
        "call",
        "calls",
        summary.calls,
        BTreeMap::from([
            ("imported_from".into(), json!(a.file.display().to_string())),
            ("models".into(), json!(models)),
        ]),
    );
    manifest.save(&store).await.map_err(io)?;
    println!(
        "imported {} calls over {} cases into {} (next: evalflow validate {} --out {})",
        summary.calls,
        summary.cases,
        store.display(),
        ppath.display(),
        store.display()
    );
    Ok(())
}
