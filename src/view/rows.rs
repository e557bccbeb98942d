//! Small query results as JSON, for the API's answers.

use datafusion::arrow::array::RecordBatch;
use datafusion::prelude::SessionContext;
use serde_json::{Value, json};

use super::ViewError;

/// A SQL string literal.
pub fn lit(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// Runs `sql` and returns its rows as JSON objects (for small results only: a page, an
/// answer, a table of results).
pub async fn json_rows(ctx: &SessionContext, sql: &str) -> Result<Value, ViewError> {
    batches_json(&collect(ctx, sql).await?)
}

/// Runs `sql` and collects its batches (for bounded results only).
pub async fn collect(ctx: &SessionContext, sql: &str) -> Result<Vec<RecordBatch>, ViewError> {
    let df = || crate::query::QueryError::df(sql.to_string());
    Ok(ctx
        .sql(sql)
        .await
        .map_err(df())?
        .collect()
        .await
        .map_err(df())?)
}

/// Record batches as one JSON array of row objects, NULL as `null`.
pub fn batches_json(batches: &[RecordBatch]) -> Result<Value, ViewError> {
    let mut w = datafusion::arrow::json::WriterBuilder::new()
        .with_explicit_nulls(true)
        .build::<_, datafusion::arrow::json::writer::JsonArray>(Vec::new());
    let refs: Vec<&RecordBatch> = batches.iter().collect();
    w.write_batches(&refs)
        .map_err(|e| ViewError::BadRequest(format!("rendering rows as JSON: {e}")))?;
    w.finish()
        .map_err(|e| ViewError::BadRequest(format!("rendering rows as JSON: {e}")))?;
    let bytes = w.into_inner();
    if bytes.is_empty() {
        return Ok(json!([]));
    }
    serde_json::from_slice(&bytes).map_err(|e| ViewError::BadRequest(e.to_string()))
}
