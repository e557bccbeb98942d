//! Base cases from an unlabelled dataset (CSV with a header row, JSONL, or Parquet): INV and
//! DIR tests need no labels, so real traffic can be tested, as CheckList did with airline
//! tweets. Rows are read one batch at a time; empty and null texts are skipped.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::compute::cast;
use datafusion::arrow::csv;
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::parquet::arrow::ProjectionMask;
use datafusion::parquet::arrow::arrow_reader::{
    ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder,
};

use crate::pipeline::{PipelineError, SourceSpec};

/// A dataset's format.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Format {
    Csv,
    Jsonl,
    Parquet,
}

impl Format {
    /// From `format`, else from the file extension.
    ///
    /// # Errors
    /// A message naming the accepted formats.
    pub fn of(src: &SourceSpec) -> Result<Format, String> {
        let f = src.format.clone().unwrap_or_else(|| {
            Path::new(&src.file)
                .extension()
                .map(|e| e.to_string_lossy().to_lowercase())
                .unwrap_or_default()
        });
        match f.as_str() {
            "csv" => Ok(Format::Csv),
            "jsonl" | "ndjson" | "json" => Ok(Format::Jsonl),
            "parquet" | "pq" => Ok(Format::Parquet),
            other => Err(format!(
                "`{}`: unknown dataset format `{other}` (csv, jsonl or parquet; set `format`)",
                src.file
            )),
        }
    }
}

enum Inner {
    Batches {
        reader: Box<dyn Iterator<Item = Result<RecordBatch, datafusion::arrow::error::ArrowError>>>,
        batch: Option<RecordBatch>,
        pos: usize,
        /// Rows before the first data row (the CSV header), for row numbers.
        offset: u64,
    },
    Jsonl(std::io::Lines<BufReader<File>>),
}

/// Reads the text column of a dataset row by row.
pub struct TextReader {
    inner: Inner,
    file: String,
    column: String,
    /// 1-based number of the last row (line for CSV / JSONL) read.
    row: u64,
}

impl TextReader {
    /// Opens `path` and checks that the column exists.
    ///
    /// # Errors
    /// [`PipelineError::Invalid`] naming the data file, the row and the column.
    pub fn open(path: &Path, src: &SourceSpec) -> Result<TextReader, PipelineError> {
        let file = path.display().to_string();
        let err = |line: u64, msg: String| PipelineError::Invalid {
            file: file.clone(),
            line: line as usize,
            field: src.column.clone(),
            msg,
        };
        let format = Format::of(src).map_err(|m| err(0, m))?;
        let f = File::open(path).map_err(|e| err(0, format!("cannot read: {e}")))?;
        let inner = match format {
            Format::Jsonl => Inner::Jsonl(BufReader::new(f).lines()),
            Format::Csv => {
                let mut header = String::new();
                BufReader::new(File::open(path).map_err(|e| err(0, e.to_string()))?)
                    .read_line(&mut header)
                    .map_err(|e| err(1, e.to_string()))?;
                let (schema, _) = csv::reader::Format::default()
                    .with_header(true)
                    .infer_schema(header.as_bytes(), Some(0))
                    .map_err(|e| err(1, format!("bad CSV header: {e}")))?;
                let names: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
                let idx = names.iter().position(|n| *n == src.column).ok_or_else(|| {
                    err(
                        1,
                        format!(
                            "no column `{}` in the header (columns: {})",
                            src.column,
                            names.join(", ")
                        ),
                    )
                })?;
                let all_text = Schema::new(
                    names
                        .iter()
                        .map(|n| Field::new(n, DataType::Utf8, true))
                        .collect::<Vec<_>>(),
                );
                let reader = csv::ReaderBuilder::new(Arc::new(all_text))
                    .with_header(true)
                    .with_projection(vec![idx])
                    .with_batch_size(4096)
                    .build(f)
                    .map_err(|e| err(1, e.to_string()))?;
                Inner::Batches {
                    reader: Box::new(reader),
                    batch: None,
                    pos: 0,
                    offset: 1,
                }
            }
            Format::Parquet => {
                let b = ParquetRecordBatchReaderBuilder::try_new(f)
                    .map_err(|e| err(0, format!("not a Parquet file: {e}")))?;
                let schema = b.schema().clone();
                let idx = schema.index_of(&src.column).map_err(|_| {
                    let names: Vec<&str> =
                        schema.fields().iter().map(|f| f.name().as_str()).collect();
                    err(
                        0,
                        format!("no column `{}` (columns: {})", src.column, names.join(", ")),
                    )
                })?;
                let mask = ProjectionMask::roots(b.parquet_schema(), [idx]);
                let reader: ParquetRecordBatchReader = b
                    .with_projection(mask)
                    .with_batch_size(4096)
                    .build()
                    .map_err(|e| err(0, e.to_string()))?;
                Inner::Batches {
                    reader: Box::new(reader),
                    batch: None,
                    pos: 0,
                    offset: 0,
                }
            }
        };
        Ok(TextReader {
            inner,
            file,
            column: src.column.clone(),
            row: 0,
        })
    }

    fn err(&self, msg: String) -> PipelineError {
        PipelineError::Invalid {
            file: self.file.clone(),
            line: self.row as usize,
            field: self.column.clone(),
            msg,
        }
    }

    /// The next non-empty text with its row number (the line for CSV and JSONL).
    ///
    /// # Errors
    /// Unreadable rows, missing keys and non-text values, naming file, row and column.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<(u64, String)>, PipelineError> {
        loop {
            match &mut self.inner {
                Inner::Jsonl(lines) => {
                    let Some(line) = lines.next() else {
                        return Ok(None);
                    };
                    self.row += 1;
                    let line = line.map_err(|e| self.err(e.to_string()))?;
                    if line.trim().is_empty() {
                        continue;
                    }
                    let v: serde_json::Value = serde_json::from_str(&line)
                        .map_err(|e| self.err(format!("bad JSON: {e}")))?;
                    match v.get(&self.column) {
                        Some(serde_json::Value::String(s)) if !s.trim().is_empty() => {
                            return Ok(Some((self.row, s.clone())));
                        }
                        Some(serde_json::Value::String(_)) | Some(serde_json::Value::Null) => {
                            continue;
                        }
                        Some(other) => {
                            return Err(self.err(format!("expected a string, found {other}")));
                        }
                        None => return Err(self.err(format!("no key `{}`", self.column))),
                    }
                }
                Inner::Batches {
                    reader,
                    batch,
                    pos,
                    offset,
                } => {
                    let need_batch = batch.as_ref().is_none_or(|b| *pos >= b.num_rows());
                    if need_batch {
                        match reader.next() {
                            None => return Ok(None),
                            Some(Err(e)) => {
                                let (f, r, c) = (
                                    self.file.clone(),
                                    self.row + 1 + *offset,
                                    self.column.clone(),
                                );
                                return Err(PipelineError::Invalid {
                                    file: f,
                                    line: r as usize,
                                    field: c,
                                    msg: e.to_string(),
                                });
                            }
                            Some(Ok(b)) => {
                                let col = cast(b.column(0), &DataType::Utf8).map_err(|e| {
                                    PipelineError::Invalid {
                                        file: self.file.clone(),
                                        line: 0,
                                        field: self.column.clone(),
                                        msg: format!("not a text column: {e}"),
                                    }
                                })?;
                                *batch = Some(
                                    RecordBatch::try_from_iter([("text", col)])
                                        .expect("one column"),
                                );
                                *pos = 0;
                            }
                        }
                        continue;
                    }
                    let b = batch.as_ref().expect("checked");
                    let col = b.column(0).as_string::<i32>();
                    let i = *pos;
                    *pos += 1;
                    self.row += 1;
                    if col.is_null(i) || col.value(i).trim().is_empty() {
                        continue;
                    }
                    return Ok(Some((self.row + *offset, col.value(i).to_string())));
                }
            }
        }
    }
}
