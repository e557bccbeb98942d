//! `evalflow sql`: ad-hoc SQL over run tables and Parquet files.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::util::pretty::pretty_format_batches;

use super::CliError;
use crate::query::{QueryError, register_parquet, register_run, sql_context, without_views};
use crate::storage::RunStore;

#[derive(Debug, clap::Args)]
pub struct SqlArgs {
    /// The query (or use --file).
    pub query: Option<String>,
    /// A run root whose tables are registered (`cases`, `calls`, ...; with a second run,
    /// `a_scores`, `b_scores`, ...). Repeatable.
    #[arg(long = "run")]
    pub runs: Vec<String>,
    /// Register a Parquet file or folder as NAME (NAME=URL). Repeatable.
    #[arg(long = "table")]
    pub tables: Vec<String>,
    /// Read the query from a file.
    #[arg(long)]
    pub file: Option<std::path::PathBuf>,
    /// Output format. `csv` has a header row and flattens a struct column into `col.field`
    /// columns (a list or map column is refused: use json or parquet); `json` is one array
    /// of row objects keyed by column name, structs nested.
    #[arg(long, default_value = "table", value_parser = ["table", "csv", "json", "parquet"])]
    pub format: String,
    /// Write the rows to this file instead of stdout (any format; needed for parquet). It
    /// is written under FILE.tmp and renamed when complete, so a failed query leaves no
    /// half-written FILE.
    #[arg(long)]
    pub output: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub cluster: super::ClusterArg,
}

fn bad(e: QueryError) -> CliError {
    match &e {
        QueryError::DataFusion { .. } | QueryError::Memory { .. } => {
            CliError::BadInput(e.to_string())
        }
        QueryError::Storage(s) if s.is_bad_input() => CliError::BadInput(e.to_string()),
        QueryError::Storage(_) => CliError::Internal(e.to_string()),
    }
}

pub async fn run(a: SqlArgs) -> Result<(), CliError> {
    let query = match (&a.query, &a.file) {
        (Some(q), None) => q.clone(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .map_err(|e| CliError::BadInput(format!("{}: {e}", f.display())))?,
        _ => {
            return Err(CliError::BadInput(
                "give a query or --file, not both".into(),
            ));
        }
    };
    let ctx = sql_context();
    let mut stores = Vec::new();
    for (i, run) in a.runs.iter().enumerate() {
        if !run.contains("://") && !std::path::Path::new(run).exists() {
            return Err(CliError::BadInput(format!("--run {run}: no such run root")));
        }
        let store = RunStore::open(run).map_err(|e| CliError::BadInput(e.to_string()))?;
        let manifest = crate::storage::Manifest::load(&store)
            .await
            .map_err(|e| CliError::BadInput(e.to_string()))?;
        if manifest.is_none() {
            return Err(CliError::BadInput(format!(
                "--run {run}: not an evalflow run (no manifest.json); use --table NAME=URL for plain Parquet"
            )));
        }
        let prefix = if a.runs.len() == 1 {
            String::new()
        } else {
            format!("{}_", (b'a' + i as u8) as char)
        };
        register_run(&ctx, &store, &prefix).await.map_err(bad)?;
        stores.push(store);
    }
    for t in &a.tables {
        let (name, url) = t
            .split_once('=')
            .ok_or_else(|| CliError::BadInput(format!("--table {t}: expected NAME=URL")))?;
        let url = if url.contains("://") {
            url.to_string()
        } else {
            let p = std::fs::canonicalize(url)
                .map_err(|e| CliError::BadInput(format!("--table {name}={url}: {e}")))?;
            let mut s = format!("file://{}", p.display());
            if p.is_dir() {
                s.push('/');
            }
            s
        };
        register_parquet(&ctx, name, &url).await.map_err(bad)?;
    }
    let stmts = split_statements(&query);
    let Some((last, first)) = stmts.split_last() else {
        return Err(CliError::BadInput("SQL: no statement".into()));
    };
    if a.format == "parquet" && a.output.is_none() {
        return Err(CliError::BadInput(
            "--format parquet needs --output FILE".into(),
        ));
    }
    // Earlier statements run for their effect (CREATE VIEW, SET, ...): their rows are
    // drained batch by batch, never held.
    for stmt in first {
        use futures::StreamExt;
        let df = ctx
            .sql(stmt)
            .await
            .map_err(|e| CliError::BadInput(format!("SQL: {e}")))?;
        let mut s = match df.execute_stream().await {
            Ok(s) => s,
            Err(e) => return Err(query_failed(e, &stores).await),
        };
        while let Some(b) = s.next().await {
            if let Err(e) = b {
                return Err(query_failed(e, &stores).await);
            }
        }
    }
    let df = ctx
        .sql(last)
        .await
        .and_then(without_views)
        .map_err(|e| CliError::BadInput(format!("SQL: {e}")))?;
    if a.format == "table" {
        // An aligned table needs every row first: it is for reading on a terminal; the
        // other formats stream.
        let batches = match df.collect().await {
            Ok(b) => b,
            Err(e) => return Err(query_failed(e, &stores).await),
        };
        let (target, mut w) = Target::open(a.output.as_deref())?;
        write_table(&batches, &mut w)?;
        return target.commit(w);
    }
    // csv, json and parquet stream: memory holds one batch, not the result.
    let schema = std::sync::Arc::new(df.schema().as_arrow().clone());
    // A shape CSV cannot hold is refused before the query runs and anything is printed.
    if a.format == "csv" {
        csv_schema(&schema).map_err(CliError::BadInput)?;
    }
    let stream = match df.execute_stream().await {
        Ok(s) => s,
        Err(e) => return Err(query_failed(e, &stores).await),
    };
    write_stream(&a, schema, stream, &stores).await
}

/// A failed query as an error: a part that fails to decode is named (file and rows), not
/// just the query.
async fn query_failed(e: datafusion::error::DataFusionError, stores: &[RunStore]) -> CliError {
    if matches!(
        e.find_root(),
        datafusion::error::DataFusionError::ResourcesExhausted(_)
    ) {
        return bad(QueryError::df("SQL")(e));
    }
    if e.to_string().contains("Parquet") {
        for store in stores {
            if let Some(s) = crate::query::locate_unreadable_part(store).await {
                return CliError::BadInput(s.to_string());
            }
        }
    }
    CliError::BadInput(format!("SQL: {e}"))
}

/// Splits a script on `;` outside quotes and `--` comments; the last statement's rows are
/// printed.
fn split_statements(q: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote = None;
    let mut chars = q.chars().peekable();
    while let Some(ch) = chars.next() {
        match (ch, quote) {
            ('-', None) if chars.peek() == Some(&'-') => {
                // A comment runs to the end of the line; keep it out of the statement.
                for c in chars.by_ref() {
                    if c == '\n' {
                        cur.push('\n');
                        break;
                    }
                }
                continue;
            }
            ('\'' | '"', None) => quote = Some(ch),
            (c, Some(o)) if c == o => quote = None,
            (';', None) => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    out.push(cur);
    out.into_iter().filter(|s| !s.trim().is_empty()).collect()
}

/// Where a verb's rows go: stdout, or `--output FILE` written under a temporary name beside
/// it and renamed when complete, so a failed query never leaves a half-written file (the
/// temporary one is removed when the target is dropped uncommitted).
pub(crate) struct Target {
    dest: Option<PathBuf>,
    tmp: Option<PathBuf>,
    committed: bool,
}

/// The writer of a [`Target`].
pub(crate) type Out = Box<dyn Write + Send>;

impl Target {
    /// Opens stdout (`None`) or the temporary file of `dest`.
    ///
    /// # Errors
    /// [`CliError::BadInput`] naming `dest` when its temporary file cannot be created.
    pub(crate) fn open(dest: Option<&Path>) -> Result<(Target, Out), CliError> {
        let Some(dest) = dest else {
            let t = Target {
                dest: None,
                tmp: None,
                committed: false,
            };
            return Ok((t, Box::new(std::io::BufWriter::new(std::io::stdout()))));
        };
        let name = dest.file_name().ok_or_else(|| {
            CliError::BadInput(format!("--output {}: not a file name", dest.display()))
        })?;
        let tmp = dest.with_file_name(format!("{}.tmp", name.to_string_lossy()));
        let f = std::fs::File::create(&tmp)
            .map_err(|e| CliError::BadInput(format!("--output {}: {e}", dest.display())))?;
        let t = Target {
            dest: Some(dest.to_path_buf()),
            tmp: Some(tmp),
            committed: false,
        };
        Ok((t, Box::new(std::io::BufWriter::new(f))))
    }

    /// Flushes `w` and, for a file, renames the temporary file to its name.
    ///
    /// # Errors
    /// [`CliError::Internal`] when the flush or the rename fails.
    pub(crate) fn commit(mut self, mut w: Out) -> Result<(), CliError> {
        w.flush().map_err(write_failed)?;
        drop(w);
        if let (Some(tmp), Some(dest)) = (&self.tmp, &self.dest) {
            std::fs::rename(tmp, dest)
                .map_err(|e| CliError::Internal(format!("{}: {e}", dest.display())))?;
        }
        self.committed = true;
        Ok(())
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let (false, Some(tmp)) = (self.committed, &self.tmp) {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

fn internal(e: impl std::fmt::Display) -> CliError {
    CliError::Internal(e.to_string())
}

/// A failed write of the output: a closed pipe (`evalflow sql ... | head`) is not an error
/// and exits quietly, as the binary's panic hook does for `println!`.
pub(crate) fn write_failed(e: std::io::Error) -> CliError {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    internal(e)
}

/// [`write_failed`] for the Arrow writers, which wrap the I/O error.
fn arrow_write_failed(e: datafusion::arrow::error::ArrowError) -> CliError {
    match e {
        datafusion::arrow::error::ArrowError::IoError(_, io) => write_failed(io),
        e => internal(e),
    }
}

/// A streaming writer of `--format csv|json|parquet` (`table` needs every row first and is
/// written by [`write_table`]).
pub(crate) enum Sink {
    /// Struct columns flattened into `col.field` columns ([`csv_schema`]).
    Csv {
        w: Box<datafusion::arrow::csv::Writer<Out>>,
        schema: SchemaRef,
        rows: usize,
    },
    Json(datafusion::arrow::json::Writer<Out, datafusion::arrow::json::writer::JsonArray>),
    Parquet(Box<datafusion::parquet::arrow::ArrowWriter<Out>>),
}

impl Sink {
    /// A sink of `format` for rows of `schema`, writing to `w`.
    ///
    /// # Errors
    /// [`CliError::BadInput`] for a `csv` of a column no CSV cell can hold (see
    /// [`csv_schema`]), before anything is written.
    pub(crate) fn new(format: &str, schema: &SchemaRef, w: Out) -> Result<Sink, CliError> {
        Ok(match format {
            "csv" => Sink::Csv {
                schema: csv_schema(schema).map_err(CliError::BadInput)?,
                w: Box::new(
                    datafusion::arrow::csv::WriterBuilder::new()
                        .with_header(true)
                        .build(w),
                ),
                rows: 0,
            },
            // Every column is kept, NULL as `null` (DESIGN: rows keyed by column name).
            "json" => Sink::Json(
                datafusion::arrow::json::WriterBuilder::new()
                    .with_explicit_nulls(true)
                    .build::<_, datafusion::arrow::json::writer::JsonArray>(w),
            ),
            "parquet" => Sink::Parquet(Box::new(
                datafusion::parquet::arrow::ArrowWriter::try_new(
                    w,
                    schema.clone(),
                    Some(crate::storage::parquet_props(schema)),
                )
                .map_err(internal)?,
            )),
            f => {
                return Err(CliError::BadInput(format!(
                    "--format {f}: not a streaming format"
                )));
            }
        })
    }

    /// Writes one batch.
    pub(crate) fn write(&mut self, b: &RecordBatch) -> Result<(), CliError> {
        match self {
            Sink::Csv { w, schema, rows } => {
                *rows += b.num_rows();
                w.write(&flatten(b, schema)?).map_err(arrow_write_failed)
            }
            Sink::Json(w) => w.write(b).map_err(arrow_write_failed),
            Sink::Parquet(w) => w.write(b).map_err(internal),
        }
    }

    /// Ends the output (the CSV header even for no rows, `[]` for an empty JSON result, the
    /// Parquet footer) and returns the writer.
    pub(crate) fn finish(self) -> Result<Out, CliError> {
        match self {
            Sink::Csv { w, schema, rows } => {
                let mut w = *w;
                if rows == 0 {
                    w.write(&RecordBatch::new_empty(schema))
                        .map_err(arrow_write_failed)?;
                }
                Ok(w.into_inner())
            }
            Sink::Json(mut w) => {
                w.finish().map_err(arrow_write_failed)?;
                let mut out = w.into_inner();
                out.write_all(b"\n").map_err(write_failed)?;
                Ok(out)
            }
            Sink::Parquet(w) => w.into_inner().map_err(internal),
        }
    }
}

/// The CSV columns of `schema`: a struct column becomes one column per field, named
/// `col.field` (nested structs recursively), since a CSV cell holds one value.
///
/// # Errors
/// The column and its type, for a list, map or union column (or struct field): no flat
/// form keeps them, so they are refused before anything is written.
pub(crate) fn csv_schema(schema: &Schema) -> Result<SchemaRef, String> {
    fn add(prefix: &str, f: &Field, out: &mut Vec<Field>) -> Result<(), String> {
        let name = format!("{prefix}{}", f.name());
        match f.data_type() {
            DataType::Struct(children) => {
                for c in children {
                    add(&format!("{name}."), c, out)?;
                }
                Ok(())
            }
            t if t.is_nested() => Err(format!(
                "--format csv: column `{name}` is {t}, which a CSV cell cannot hold; use \
                 --format json or parquet, or turn it into text in the query (e.g. \
                 array_to_string({name}, ';'))"
            )),
            _ => {
                out.push(Field::new(name, f.data_type().clone(), true));
                Ok(())
            }
        }
    }
    let mut out = Vec::new();
    for f in schema.fields() {
        add("", f, &mut out)?;
    }
    Ok(Arc::new(Schema::new(out)))
}

/// `b` with its struct columns flattened as [`csv_schema`] names them; a field of a NULL
/// struct is NULL.
fn flatten(b: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch, CliError> {
    fn add(col: &ArrayRef, out: &mut Vec<ArrayRef>) -> Result<(), CliError> {
        let Some(s) = col.as_struct_opt() else {
            out.push(col.clone());
            return Ok(());
        };
        let parent_null = datafusion::arrow::compute::is_null(s).map_err(internal)?;
        for c in s.columns() {
            let c = if s.null_count() > 0 {
                datafusion::arrow::compute::nullif(c.as_ref(), &parent_null).map_err(internal)?
            } else {
                c.clone()
            };
            add(&c, out)?;
        }
        Ok(())
    }
    if !b
        .columns()
        .iter()
        .any(|c| matches!(c.data_type(), DataType::Struct(_)))
    {
        return Ok(b.clone());
    }
    let mut cols = Vec::new();
    for c in b.columns() {
        add(c, &mut cols)?;
    }
    RecordBatch::try_new(schema.clone(), cols).map_err(internal)
}

/// Writes `batches` as an aligned table (for reading on a terminal) to `w`.
pub(crate) fn write_table(batches: &[RecordBatch], w: &mut Out) -> Result<(), CliError> {
    let t = pretty_format_batches(batches).map_err(internal)?;
    writeln!(w, "{t}").map_err(write_failed)
}

/// Writes the result batch by batch to stdout or `--output` (committed by rename).
async fn write_stream(
    a: &SqlArgs,
    schema: SchemaRef,
    mut stream: datafusion::physical_plan::SendableRecordBatchStream,
    stores: &[RunStore],
) -> Result<(), CliError> {
    use futures::StreamExt;
    let (target, w) = Target::open(a.output.as_deref())?;
    let mut sink = Sink::new(&a.format, &schema, w)?;
    while let Some(b) = stream.next().await {
        let b = match b {
            Ok(b) => b,
            Err(e) => return Err(query_failed(e, stores).await),
        };
        sink.write(&b)?;
    }
    target.commit(sink.finish()?)
}

#[cfg(test)]
mod tests {
    use super::split_statements;

    #[test]
    fn splits_outside_quotes_and_comments() {
        let s = split_statements(
            "-- a; comment\nSELECT ';' AS x; -- trailing; note\nSELECT 2;\n-- end",
        );
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].trim(), "SELECT ';' AS x");
        assert_eq!(s[1].trim(), "SELECT 2");
    }
}
