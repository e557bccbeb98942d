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
    /// Boxed: the decoder's buffers make it much larger than the other readers.
    Csv(Box<CsvRecords>),
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
                let records = CsvRecords::open(path, &[src.column.as_str()])
                    .map_err(|e| err(e.line, e.msg))?;
                Inner::Csv(Box::new(records))
            }
            Format::Parquet => {
                let b = ParquetRecordBatchReaderBuilder::try_new(f)
                    .map_err(|e| err(0, format!("footer: not a Parquet file: {e}")))?;
                let schema = b.schema().clone();
                let idx = schema.index_of(&src.column).map_err(|_| {
                    let names: Vec<&str> =
                        schema.fields().iter().map(|f| f.name().as_str()).collect();
                    err(
                        1,
                        format!("no column `{}` (columns: {})", src.column, names.join(", ")),
                    )
                })?;
                if !matches!(
                    schema.field(idx).data_type(),
                    DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
                ) {
                    return Err(err(
                        1,
                        format!(
                            "has type {}, expected text (utf8)",
                            schema.field(idx).data_type()
                        ),
                    ));
                }
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
                Inner::Csv(records) => {
                    let Some((line, b)) =
                        records.next_record().map_err(|e| PipelineError::Invalid {
                            file: self.file.clone(),
                            line: e.line as usize,
                            field: self.column.clone(),
                            msg: e.msg,
                        })?
                    else {
                        return Ok(None);
                    };
                    self.row = line;
                    let col = b.column(0).as_string::<i32>();
                    if col.is_null(0) || col.value(0).trim().is_empty() {
                        continue;
                    }
                    return Ok(Some((line, col.value(0).to_string())));
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

/// Reads every source dataset as far as generate will (the test's case budget of
/// non-empty rows), so a bad row fails before the run records that generate started.
///
/// # Errors
/// [`PipelineError::Invalid`] naming the data file, the row (line) and the column.
pub fn check_sources(p: &crate::pipeline::Pipeline) -> Result<(), PipelineError> {
    for test in &p.tests {
        let Some(src) = &test.source else { continue };
        let budget = test.max_cases.unwrap_or(p.suite.max_cases_per_test);
        let mut reader = TextReader::open(&p.resolve(&src.file), src)?;
        for _ in 0..budget {
            if reader.next()?.is_none() {
                break;
            }
        }
    }
    Ok(())
}

/// An error reading a CSV file: the line of the record it concerns and what went wrong.
#[derive(Debug)]
pub struct CsvError {
    pub line: u64,
    pub msg: String,
}

/// A CSV file with a header row, read one record at a time with the line each record
/// starts on.
///
/// # Behavior
/// Parsing is arrow's CSV decoder (RFC 4180 quoting: a quoted field may hold commas, quotes
/// and newlines). Fed one record at a time, the bytes it consumes tell where each record
/// starts, so a row number is the record's real first line even after multi-line records,
/// and an error names the line of the record that failed, not the start of a batch. Every
/// column is read as text; blank lines are skipped.
///
/// # Errors
/// [`CsvError`] for an unreadable file, invalid UTF-8, a record with the wrong number of
/// fields, or a requested column the header lacks (line 1).
pub struct CsvRecords {
    reader: BufReader<File>,
    decoder: csv::reader::Decoder,
    /// The header's column names.
    pub names: Vec<String>,
    /// The line of the next byte not yet given to the decoder.
    line: u64,
    /// Whether the decoder is inside a record, which started on `start`.
    in_record: bool,
    start: u64,
    eof: bool,
    header_done: bool,
}

impl CsvRecords {
    /// Opens `path` and selects `columns` (by header name), in that order.
    pub fn open(path: &Path, columns: &[&str]) -> Result<CsvRecords, CsvError> {
        let at = |line: u64, msg: String| CsvError { line, msg };
        let f = File::open(path).map_err(|e| at(0, format!("cannot read: {e}")))?;
        let (schema, _) = csv::reader::Format::default()
            .with_header(true)
            .infer_schema(BufReader::new(f), Some(0))
            .map_err(|e| at(1, format!("bad CSV header: {}", clean_csv_message(&e))))?;
        let names: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
        let projection = columns
            .iter()
            .map(|c| {
                names.iter().position(|n| n == c).ok_or_else(|| {
                    at(
                        1,
                        format!(
                            "no column `{c}` in the header (columns: {})",
                            names.join(", ")
                        ),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let all_text = Schema::new(
            names
                .iter()
                .map(|n| Field::new(n, DataType::Utf8, true))
                .collect::<Vec<_>>(),
        );
        // One record per batch: the decoder stops after each record, so the bytes it
        // consumed locate the next one.
        let decoder = csv::ReaderBuilder::new(Arc::new(all_text))
            .with_header(false)
            .with_projection(projection)
            .with_batch_size(1)
            .build_decoder();
        let f = File::open(path).map_err(|e| at(0, format!("cannot read: {e}")))?;
        Ok(CsvRecords {
            reader: BufReader::new(f),
            decoder,
            names,
            line: 1,
            in_record: false,
            start: 1,
            eof: false,
            header_done: false,
        })
    }

    /// The next data record (the selected columns, one row) and the line it starts on.
    pub fn next_record(&mut self) -> Result<Option<(u64, RecordBatch)>, CsvError> {
        loop {
            if self.decoder.capacity() == 0 {
                let start = self.start;
                self.in_record = false;
                let b = self
                    .decoder
                    .flush()
                    .map_err(|e| CsvError {
                        line: start,
                        msg: clean_csv_message(&e),
                    })?
                    .ok_or_else(|| CsvError {
                        line: start,
                        msg: "record lost by the CSV decoder".into(),
                    })?;
                if !self.header_done {
                    self.header_done = true;
                    continue;
                }
                return Ok(Some((start, b)));
            }
            if self.eof {
                return Ok(None);
            }
            let line = self.line;
            let buf = self.reader.fill_buf().map_err(|e| CsvError {
                line,
                msg: e.to_string(),
            })?;
            if buf.is_empty() {
                self.eof = true;
                let start = if self.in_record { self.start } else { line };
                self.decoder.decode(&[]).map_err(|e| CsvError {
                    line: start,
                    msg: clean_csv_message(&e),
                })?;
                continue;
            }
            let n = match self.decoder.decode(buf) {
                Ok(n) => n,
                Err(e) => {
                    // The failing record is the one in progress, or the first in `buf`.
                    let line = if self.in_record {
                        self.start
                    } else {
                        first_record_line(buf, line)
                    };
                    return Err(CsvError {
                        line,
                        msg: clean_csv_message(&e),
                    });
                }
            };
            for &byte in &buf[..n] {
                if !self.in_record && byte != b'\n' && byte != b'\r' {
                    self.in_record = true;
                    self.start = self.line;
                }
                if byte == b'\n' {
                    self.line += 1;
                }
            }
            self.reader.consume(n);
        }
    }
}

/// The line of the first byte of `buf` that is not a line break, `buf` starting on `line`.
fn first_record_line(buf: &[u8], mut line: u64) -> u64 {
    for &b in buf {
        match b {
            b'\n' => line += 1,
            b'\r' => {}
            _ => break,
        }
    }
    line
}

/// Arrow's CSV messages count records as "lines" ("incorrect number of fields for line 3");
/// the caller names the real line, so that count is dropped rather than contradict it.
fn clean_csv_message(e: &datafusion::arrow::error::ArrowError) -> String {
    let msg = e.to_string();
    let msg = msg.strip_prefix("Csv error: ").unwrap_or(&msg).to_string();
    let mut out = String::new();
    let mut rest = msg.as_str();
    while let Some(i) = rest.find(" for line ") {
        out.push_str(&rest[..i]);
        let tail = &rest[i + " for line ".len()..];
        let digits = tail.chars().take_while(char::is_ascii_digit).count();
        rest = &tail[digits..];
    }
    out.push_str(rest);
    out.replace("data and field", "data in field")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(text: &str) -> Vec<Result<(u64, String), (u64, String)>> {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.csv");
        std::fs::write(&p, text).unwrap();
        let mut r = match CsvRecords::open(&p, &["text"]) {
            Ok(r) => r,
            Err(e) => return vec![Err((e.line, e.msg))],
        };
        let mut out = Vec::new();
        loop {
            match r.next_record() {
                Ok(Some((line, b))) => {
                    let c = b.column(0).as_string::<i32>();
                    out.push(Ok((line, c.value(0).to_string())));
                }
                Ok(None) => break,
                Err(e) => {
                    out.push(Err((e.line, e.msg)));
                    break;
                }
            }
        }
        out
    }

    #[test]
    fn multi_line_records_keep_their_real_starting_line() {
        let got = records("id,text\n1,\"two\nlines\"\n\n2,\"a, b\"\n3,\"say \"\"hi\"\"\"\n4,last");
        assert_eq!(
            got,
            vec![
                Ok((2, "two\nlines".to_string())),
                Ok((5, "a, b".to_string())),
                Ok((6, "say \"hi\"".to_string())),
                Ok((7, "last".to_string())),
            ]
        );
    }

    #[test]
    fn errors_name_the_failing_record_line() {
        // The bad record (one field short) starts on line 5, after a 3-line record.
        let got = records("id,text\n1,\"a\nb\nc\"\n2\n3,ok\n");
        assert_eq!(got[0], Ok((2, "a\nb\nc".to_string())));
        let (line, msg) = got[1].clone().unwrap_err();
        assert_eq!(line, 5, "{msg}");
        assert!(
            msg.contains("incorrect number of fields") && !msg.contains("for line"),
            "{msg}"
        );
        // Invalid UTF-8 in the record starting on line 3.
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.csv");
        std::fs::write(&p, b"id,text\n1,ok\n2,\"bad \xff\nbyte\"\n").unwrap();
        let mut r = CsvRecords::open(&p, &["text"]).unwrap();
        assert_eq!(r.next_record().unwrap().unwrap().0, 2);
        let e = r.next_record().unwrap_err();
        assert_eq!(e.line, 3, "{}", e.msg);
        assert!(e.msg.contains("UTF-8"), "{}", e.msg);
    }

    #[test]
    fn missing_column_is_line_one() {
        let got = records("id,body\n1,x\n");
        let (line, msg) = got[0].clone().unwrap_err();
        assert_eq!(line, 1);
        assert!(msg.contains("no column `text`"), "{msg}");
    }
}
