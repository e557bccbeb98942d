//! A Parquet table of calls, read batch by batch.
//!
//! # Behavior
//! A table with an `input` column plus any calls columns (`response`, `model`, `system`,
//! `expected`, `sample_idx`, `finish_reason`, token counts, `http_status`, `error`,
//! `provider`, `attempts`, `latency_ms`, `max_tokens`, `temperature`, `started_at`).
//! Columns are cast to the calls types; `source_id` is the row number (from 1). `test`,
//! `capability` and the `--cluster` column (which must exist) land in cases; the case is
//! (system, input) with `max_tokens` and `temperature`, keyed as a chat request with them.
//!
//! # Errors
//! A value that does not convert is an error naming `file:row` and the column; a file that
//! is not Parquet names its footer.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Float64Type, Int64Type};
use datafusion::parquet::arrow::arrow_reader::{
    ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder,
};
use serde_json::json;

use super::{ImportError, Options, Provenance, Record, RecordIter, Request, bad, bad_file};

/// Opens a Parquet file; its rows are decoded one batch at a time.
///
/// # Errors
/// The file cannot be opened or has no Parquet footer.
pub fn open(path: &Path, opts: &Options) -> Result<RecordIter, ImportError> {
    let f = std::fs::File::open(path).map_err(|e| bad_file(path, e))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(f)
        .and_then(|b| b.build())
        .map_err(|e| bad_file(path, format!("footer: not a Parquet file: {e}")))?;
    if let Some(f) = &opts.cluster
        && !datafusion::arrow::record_batch::RecordBatchReader::schema(&reader)
            .fields()
            .iter()
            .any(|c| c.name() == f)
    {
        return Err(bad(
            path,
            1,
            f,
            "--cluster names a column this table does not have",
        ));
    }
    Ok(Box::new(Rows {
        file: path.to_path_buf(),
        model: opts.model.clone(),
        cluster: opts.cluster.clone(),
        reader,
        row0: 0,
        pending: VecDeque::new(),
        failed: false,
    }))
}

struct Rows {
    file: PathBuf,
    model: Option<String>,
    cluster: Option<String>,
    reader: ParquetRecordBatchReader,
    row0: usize,
    pending: VecDeque<Result<Record, ImportError>>,
    failed: bool,
}

impl Iterator for Rows {
    type Item = Result<Record, ImportError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(r) = self.pending.pop_front() {
                return Some(r);
            }
            if self.failed {
                return None;
            }
            let b = match self.reader.next()? {
                Ok(b) => b,
                Err(e) => {
                    self.failed = true;
                    return Some(Err(bad(
                        &self.file,
                        self.row0 + 1,
                        "(rows)",
                        format!("cannot decode the rows from here on: {e}"),
                    )
                    .fatal()));
                }
            };
            let mut out = Vec::new();
            let (model, cluster) = (&self.model, &self.cluster);
            if let Err(e) = batch_records(&self.file, self.row0, &b, model, cluster, &mut out) {
                // A column that does not convert: no row of the batch can be read.
                self.failed = true;
                return Some(Err(e.fatal()));
            }
            self.row0 += b.num_rows();
            self.pending.extend(out);
        }
    }
}

/// Converts one batch whose first row is file row `row0 + 1`.
fn batch_records(
    file: &Path,
    row0: usize,
    b: &RecordBatch,
    model: &Option<String>,
    cluster: &Option<String>,
    out: &mut Vec<Result<Record, ImportError>>,
) -> Result<(), ImportError> {
    let col =
        |name: &str, t: &DataType| -> Result<Option<std::sync::Arc<dyn Array>>, ImportError> {
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
    let (test_c, cap_c) = (s("test")?, s("capability")?);
    let cluster_c = match cluster {
        Some(f) => s(f)?,
        None => None,
    };
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
    // One row: an error names it, and the rows after it are still read.
    let row = |r: usize| -> Result<Record, ImportError> {
        let line = row0 + r + 1;
        let inp = gs(&input_s, r).ok_or_else(|| bad(file, line, "input", "null"))?;
        let source_model = gs(&mdl, r);
        let model = model
            .clone()
            .or_else(|| source_model.clone())
            .ok_or_else(|| bad(file, line, "model", "missing (or pass --model)"))?;
        // The conversation and the parameters that change the answer, as a chat request
        // with them would be keyed.
        let system = gs(&sys, r);
        let mut msgs = Vec::new();
        if let Some(s) = &system {
            msgs.push(json!({"role": "system", "content": s}));
        }
        msgs.push(json!({"role": "user", "content": inp}));
        let mut params = serde_json::Map::new();
        if let Some(m) = gi(&mt, r) {
            params.insert("max_tokens".into(), json!(m));
        }
        if let Some(t) = gf(&temp, r) {
            params.insert("temperature".into(), json!(t));
        }
        let case_key = super::conversation_key(&msgs, params);
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
        let request = Request {
            source_model: source_model.map(Into::into),
            case_key: case_key.map(Into::into),
            request_key: json!({"model": model, "system": gs(&sys, r), "input": inp}).to_string(),
            model: model.into(),
            system: gs(&sys, r).map(Into::into),
            input: inp.into(),
            max_tokens: gi(&mt, r).map(|m| m as u32),
            temperature: gf(&temp, r),
            ..Request::default()
        };
        Ok(Record {
            request: request.into(),
            test: gs(&test_c, r),
            capability: gs(&cap_c, r),
            cluster: gs(&cluster_c, r),
            source: Provenance {
                format: "parquet",
                file: file.display().to_string().into(),
                id: Some(line.to_string()),
            },
            expected: gs(&exp, r),
            sample_idx,
            response,
            finish_reason: gs(&fin, r),
            prompt_tokens: gi(&pt, r),
            completion_tokens: gi(&ct, r),
            reasoning_tokens: gi(&rt, r),
            reasoning_chars: gi(&rc, r),
            http_status: gi(&hs, r).map(|h| h as i32),
            error,
            provider: gs(&prov, r),
            attempts: gi(&at, r).map(|a| a as i32),
            latency_ms: gf(&lat, r),
            started_at_us: started.as_ref().filter(|a| a.is_valid(r)).map(|a| {
                a.as_primitive::<datafusion::arrow::datatypes::TimestampMicrosecondType>()
                    .value(r)
            }),
            ..Record::default()
        })
    };
    out.extend((0..b.num_rows()).map(row));
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
) -> Result<(), ImportError> {
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
) -> Result<std::sync::Arc<dyn Array>, ImportError> {
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
