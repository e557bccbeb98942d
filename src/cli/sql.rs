//! `evalflow sql`: ad-hoc SQL over run tables and Parquet files.

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::util::pretty::pretty_format_batches;

use super::CliError;
use crate::query::{QueryError, new_context, register_parquet, register_run};
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
    /// Output format.
    #[arg(long, default_value = "table", value_parser = ["table", "csv", "json", "parquet"])]
    pub format: String,
    /// Output file for `--format parquet` (default: stdout is refused).
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
    let ctx = new_context();
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
        .map_err(|e| CliError::BadInput(format!("SQL: {e}")))?;
    if a.format == "table" {
        // An aligned table needs every row first: it is for reading on a terminal; the
        // other formats stream.
        let batches = match df.collect().await {
            Ok(b) => b,
            Err(e) => return Err(query_failed(e, &stores).await),
        };
        return print_table(&batches);
    }
    // csv, json and parquet stream: memory holds one batch, not the result.
    let schema = std::sync::Arc::new(df.schema().as_arrow().clone());
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

fn print_table(batches: &[RecordBatch]) -> Result<(), CliError> {
    let t = pretty_format_batches(batches).map_err(|e| CliError::Internal(e.to_string()))?;
    println!("{t}");
    Ok(())
}

/// One of the streaming writers of `--format csv|json|parquet`.
enum Sink {
    Csv(Box<datafusion::arrow::csv::Writer<std::io::BufWriter<std::io::Stdout>>>),
    Json(
        datafusion::arrow::json::Writer<
            std::io::BufWriter<std::io::Stdout>,
            datafusion::arrow::json::writer::JsonArray,
        >,
    ),
    Parquet(Box<datafusion::parquet::arrow::ArrowWriter<std::fs::File>>),
}

/// Writes the result batch by batch. A Parquet file is written under a temporary name and
/// renamed when complete, so a failed query never leaves a half-written `--output`.
async fn write_stream(
    a: &SqlArgs,
    schema: datafusion::arrow::datatypes::SchemaRef,
    mut stream: datafusion::physical_plan::SendableRecordBatchStream,
    stores: &[RunStore],
) -> Result<(), CliError> {
    use futures::StreamExt;
    let internal = |e: &dyn std::fmt::Display| CliError::Internal(e.to_string());
    let stdout = || std::io::BufWriter::new(std::io::stdout());
    let tmp = a.output.as_ref().map(|o| o.with_extension("parquet.tmp"));
    let mut sink = match a.format.as_str() {
        "csv" => Sink::Csv(Box::new(
            datafusion::arrow::csv::WriterBuilder::new()
                .with_header(true)
                .build(stdout()),
        )),
        // Every column is kept, NULL as `null` (DESIGN: rows keyed by column name).
        "json" => Sink::Json(
            datafusion::arrow::json::WriterBuilder::new()
                .with_explicit_nulls(true)
                .build::<_, datafusion::arrow::json::writer::JsonArray>(stdout()),
        ),
        "parquet" => {
            let tmp = tmp.as_ref().expect("checked before the query ran");
            let f = std::fs::File::create(tmp)
                .map_err(|e| CliError::BadInput(format!("{}: {e}", tmp.display())))?;
            Sink::Parquet(Box::new(
                datafusion::parquet::arrow::ArrowWriter::try_new(
                    f,
                    schema.clone(),
                    Some(crate::storage::parquet_props(&schema)),
                )
                .map_err(|e| internal(&e))?,
            ))
        }
        _ => unreachable!("clap restricts --format"),
    };
    let mut rows = 0usize;
    while let Some(b) = stream.next().await {
        let b = match b {
            Ok(b) => b,
            Err(e) => {
                if let Some(t) = &tmp {
                    let _ = std::fs::remove_file(t);
                }
                return Err(query_failed(e, stores).await);
            }
        };
        rows += b.num_rows();
        match &mut sink {
            Sink::Csv(w) => w.write(&b).map_err(|e| internal(&e))?,
            Sink::Json(w) => w.write(&b).map_err(|e| internal(&e))?,
            Sink::Parquet(w) => w.write(&b).map_err(|e| internal(&e))?,
        }
    }
    match sink {
        Sink::Csv(w) => {
            if rows == 0 {
                // The header row even for an empty result.
                let mut w = datafusion::arrow::csv::WriterBuilder::new()
                    .with_header(true)
                    .build(w.into_inner());
                w.write(&RecordBatch::new_empty(schema))
                    .map_err(|e| internal(&e))?;
                use std::io::Write;
                w.into_inner().flush().map_err(|e| internal(&e))?;
            } else {
                use std::io::Write;
                w.into_inner().flush().map_err(|e| internal(&e))?;
            }
        }
        Sink::Json(mut w) => {
            // An empty result is `[]` too: the writer opens the array when it finishes.
            w.finish().map_err(|e| internal(&e))?;
            let mut out = w.into_inner();
            use std::io::Write;
            out.write_all(b"\n").map_err(|e| internal(&e))?;
            out.flush().map_err(|e| internal(&e))?;
        }
        Sink::Parquet(w) => {
            w.close().map_err(|e| internal(&e))?;
            let (tmp, out) = (tmp.expect("parquet has a temp file"), a.output.as_ref());
            let out = out.expect("checked before the query ran");
            std::fs::rename(&tmp, out)
                .map_err(|e| CliError::Internal(format!("{}: {e}", out.display())))?;
        }
    }
    Ok(())
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
