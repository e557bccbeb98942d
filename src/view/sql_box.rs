//! The SQL box: a read-only query over one run's tables with every evalflow function.
//!
//! DataFusion's `SQLOptions` refuse DDL, DML and `SET` statements before planning, so a query
//! can neither write nor change the session; rows past [`ROW_CAP`] are not fetched (the plan
//! is stopped), a query is cancelled after [`TIMEOUT`], and it runs in the process's memory
//! pool (`--memory-limit`), spilling as every plan does.

use std::time::Duration;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::execution::context::SQLOptions;
use futures::StreamExt;
use serde_json::{Value, json};

use super::ViewError;
use super::catalog::RunView;

/// Rows a query returns at most.
pub const ROW_CAP: usize = 1000;
/// Rows a query's Parquet download holds at most (the file is built in memory).
pub const DOWNLOAD_CAP: usize = 100_000;
/// How long a query may run.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// `POST /api/runs/{run}/sql`.
pub async fn run(r: &RunView, sql: &str) -> Result<Value, ViewError> {
    let (schema, batches, truncated) = query(r, sql, ROW_CAP).await?;
    let columns: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
    // Rows as arrays in column order (names may repeat in SQL).
    let objects = super::rows::batches_json(&batches)?;
    let rows: Vec<Value> = objects
        .as_array()
        .into_iter()
        .flatten()
        .map(|o| Value::Array(columns.iter().map(|c| o[c].clone()).collect()))
        .collect();
    Ok(json!({"columns": columns, "rows": rows, "truncated": truncated}))
}

/// `POST /api/runs/{run}/sql.parquet`: the query's rows (at most [`DOWNLOAD_CAP`]) as a
/// Parquet file, and whether rows were left out.
pub async fn parquet(r: &RunView, sql: &str) -> Result<(Vec<u8>, bool), ViewError> {
    let (schema, batches, truncated) = query(r, sql, DOWNLOAD_CAP).await?;
    // The batches' own schema (the plan's may differ in nullability).
    let schema = batches.first().map_or(schema, |b| b.schema());
    let bad = |e: datafusion::parquet::errors::ParquetError| {
        ViewError::BadRequest(format!("sql: writing Parquet: {e}"))
    };
    let mut buf = Vec::new();
    let mut w =
        datafusion::parquet::arrow::ArrowWriter::try_new(&mut buf, schema, None).map_err(bad)?;
    for b in &batches {
        w.write(b).map_err(bad)?;
    }
    w.close().map_err(bad)?;
    Ok((buf, truncated))
}

/// Runs a read-only query for at most `cap` rows, within [`TIMEOUT`]: its schema, batches,
/// and whether rows were left out.
async fn query(
    r: &RunView,
    sql: &str,
    cap: usize,
) -> Result<(SchemaRef, Vec<RecordBatch>, bool), ViewError> {
    let opts = SQLOptions::new()
        .with_allow_ddl(false)
        .with_allow_dml(false)
        .with_allow_statements(false);
    let work = async {
        let df = r
            .ctx
            .sql_with_options(sql, opts)
            .await
            .map_err(|e| ViewError::BadRequest(format!("sql: {e}")))?;
        let df = crate::query::without_views(df)
            .map_err(|e| ViewError::BadRequest(format!("sql: {e}")))?;
        let schema: SchemaRef = std::sync::Arc::new(df.schema().as_arrow().clone());
        let mut stream = df
            .execute_stream()
            .await
            .map_err(|e| ViewError::BadRequest(format!("sql: {e}")))?;
        let (mut batches, mut n, mut truncated) = (Vec::new(), 0usize, false);
        while let Some(b) = stream.next().await {
            let b = b.map_err(|e| ViewError::BadRequest(format!("sql: {e}")))?;
            if n + b.num_rows() > cap {
                batches.push(b.slice(0, cap - n));
                truncated = true;
                break;
            }
            n += b.num_rows();
            batches.push(b);
        }
        Ok::<_, ViewError>((schema, batches, truncated))
    };
    match tokio::time::timeout(TIMEOUT, work).await {
        Ok(r) => r,
        Err(_) => Err(ViewError::BadRequest(format!(
            "sql: cancelled after {} s (the SQL box's limit; `evalflow sql` has none)",
            TIMEOUT.as_secs()
        ))),
    }
}
