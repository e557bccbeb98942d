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
}

fn bad(e: QueryError) -> CliError {
    match &e {
        QueryError::DataFusion { .. } => CliError::BadInput(e.to_string()),
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
    let mut batches: Vec<RecordBatch> = Vec::new();
    for stmt in split_statements(&query) {
        let df = ctx
            .sql(&stmt)
            .await
            .map_err(|e| CliError::BadInput(format!("SQL: {e}")))?;
        batches = match df.collect().await {
            Ok(b) => b,
            Err(e) => {
                // A part that fails to decode is named (file and rows), not just the query.
                if e.to_string().contains("Parquet") {
                    for store in &stores {
                        if let Some(s) = crate::query::locate_unreadable_part(store).await {
                            return Err(CliError::BadInput(s.to_string()));
                        }
                    }
                }
                return Err(CliError::BadInput(format!("SQL: {e}")));
            }
        };
    }
    print(&a, &batches)
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

fn print(a: &SqlArgs, batches: &[RecordBatch]) -> Result<(), CliError> {
    let internal = |e: &dyn std::fmt::Display| CliError::Internal(e.to_string());
    match a.format.as_str() {
        "table" => println!(
            "{}",
            pretty_format_batches(batches).map_err(|e| internal(&e))?
        ),
        "csv" => {
            let mut w = datafusion::arrow::csv::WriterBuilder::new()
                .with_header(true)
                .build(std::io::stdout());
            for b in batches {
                w.write(b).map_err(|e| internal(&e))?;
            }
        }
        "json" => {
            let mut buf = Vec::new();
            {
                // Every column is kept, NULL as `null` (DESIGN: rows keyed by column name).
                let mut w = datafusion::arrow::json::WriterBuilder::new()
                    .with_explicit_nulls(true)
                    .build::<_, datafusion::arrow::json::writer::JsonArray>(&mut buf);
                let refs: Vec<&RecordBatch> = batches.iter().collect();
                w.write_batches(&refs).map_err(|e| internal(&e))?;
                w.finish().map_err(|e| internal(&e))?;
            }
            if buf.is_empty() {
                buf = b"[]".to_vec();
            }
            println!("{}", String::from_utf8_lossy(&buf));
        }
        "parquet" => {
            let out = a
                .output
                .as_ref()
                .ok_or_else(|| CliError::BadInput("--format parquet needs --output FILE".into()))?;
            let schema = batches.first().map(|b| b.schema()).unwrap_or_else(|| {
                std::sync::Arc::new(datafusion::arrow::datatypes::Schema::empty())
            });
            let bytes =
                crate::storage::encode_parquet(&schema, batches).map_err(|e| internal(&e))?;
            let tmp = out.with_extension("parquet.tmp");
            std::fs::write(&tmp, bytes).map_err(|e| internal(&e))?;
            std::fs::rename(&tmp, out).map_err(|e| internal(&e))?;
        }
        _ => unreachable!("clap restricts --format"),
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
