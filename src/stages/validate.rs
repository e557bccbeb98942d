//! Validate: decides, before any scoring, exactly one validity verdict per call.
//!
//! The rule itself lives below the stages (`crate::validity`, and the SQL function
//! `validity_verdict` that runs it); this stage runs that function over each calls part and
//! writes the `validity` part of the same name.

use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::error::DataFusionError;
use datafusion::prelude::SessionContext;
use futures::StreamExt;

pub use crate::udaf::validity_verdict::{ValidityVerdict, validity_udf};
pub use crate::validity::{
    CallView, FILTERED, VALIDATOR_VERSION, VERDICTS, Verdict, decide, language,
};

use crate::query::{QueryError, new_context};
use crate::schema::Table;
use crate::storage::{RunStore, StorageError};

/// The plan validate runs over one calls part registered as `table`.
pub fn validity_sql(table: &str, languages: &[String]) -> String {
    let langs = languages.join(",").replace('\'', "''");
    format!(
        "SELECT call_id, v['validity'] AS validity, v['validity_reason'] AS validity_reason, \
         v['language'] AS language, v['answer_chars'] AS answer_chars, \
         '{VALIDATOR_VERSION}' AS validator_version FROM (SELECT call_id, \
         validity_verdict(response, finish_reason, http_status, error, reasoning_tokens, \
         reasoning_chars, max_tokens, '{langs}') AS v FROM {table})"
    )
}

/// Runs validate: each `calls` part gets a `validity` part of the same name, so a
/// restarted stage skips parts already validated and never writes a row twice. Each part
/// is one plan (`validity_verdict` over the part, its file split across partitions), and
/// as many parts run at once as `--threads`; memory is one part's verdicts per plan.
pub async fn run(store: &RunStore, languages: &[String]) -> Result<u64, QueryError> {
    let parts = store.list_parts("calls").await?;
    let threads = crate::query::resources().threads.max(1);
    let progress = crate::progress::Progress::new("validate", parts.len() as u64, "parts");
    let ctx = new_context();
    store.register_with(&ctx);
    let languages: Arc<[String]> = languages.into();
    let jobs = parts.into_iter().enumerate().map(|(i, part)| {
        let (ctx, store, languages) = (ctx.clone(), store.clone(), languages.clone());
        let progress = progress.clone();
        // A task per part, so parts are validated on every core even when one part is a
        // single partition.
        tokio::spawn(async move {
            let rows = validate_part(&ctx, &store, &part, i, &languages).await?;
            progress.inc(1, rows);
            Ok::<u64, QueryError>(rows)
        })
    });
    let mut done = futures::stream::iter(jobs).buffer_unordered(threads);
    let mut rows = 0u64;
    while let Some(r) = done.next().await {
        rows +=
            r.map_err(|e| QueryError::df("validate")(DataFusionError::External(Box::new(e))))??;
    }
    progress.finish();
    Ok(rows)
}

async fn validate_part(
    ctx: &SessionContext,
    store: &RunStore,
    part: &object_store::ObjectMeta,
    i: usize,
    languages: &[String],
) -> Result<u64, QueryError> {
    let name = part
        .location
        .filename()
        .unwrap_or("part.parquet")
        .to_string();
    let target = format!("validity/{name}");
    if let Some(done) = store.head(&target).await? {
        return Ok(store.part_rows(&done).await?);
    }
    let table = format!("validate_part_{i}");
    let url = store.location(&part.location);
    crate::query::register_parquet(ctx, &table, &url).await?;
    let what = format!("validate: {url}");
    let batches = ctx
        .sql(&validity_sql(&table, languages))
        .await
        .map_err(QueryError::df(what.clone()))?
        .collect()
        .await
        .map_err(QueryError::df(what.clone()));
    let _ = ctx.deregister_table(&table);
    let batches: Vec<RecordBatch> = batches?
        .into_iter()
        .map(|b| RecordBatch::try_new(Table::Validity.schema(), b.columns().to_vec()))
        .collect::<Result<_, _>>()
        .map_err(|e| QueryError::df(what.clone())(e.into()))?;
    let rows = batches.iter().map(|b| b.num_rows() as u64).sum();
    let bytes =
        crate::storage::encode_parquet(&Table::Validity.schema(), &batches).map_err(|source| {
            StorageError::Parquet {
                location: target.clone(),
                source,
            }
        })?;
    store.put(&target, bytes).await?;
    Ok(rows)
}
