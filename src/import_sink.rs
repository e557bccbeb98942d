//! The streaming core of `evalflow import`: records of any source format in, `cases` and
//! `calls` out, in memory bounded by a batch and the query memory pool.
//!
//! # How
//! 1. [`ImportSink::push`] takes one record at a time (the readers parse line by line),
//!    computes its case id and request hash, and appends it to a staging batch; every
//!    [`STAGE_ROWS`] rows the batch is committed under `<root>/_import/staging/`.
//! 2. [`ImportSink::finish`] runs DataFusion plans over the staging table, so the parts
//!    that need the whole corpus (one case per distinct prompt, sample indices of repeats,
//!    duplicate detection) are hash aggregations and windows that spill under
//!    `--memory-limit`, not maps:
//!    - `cases`: `GROUP BY case_id`, the first record's expected answer;
//!    - `calls`: sample indices from the file, else the order of repeats of the same (case,
//!      model) (`row_number()` over the records that lack one), and the call id as a SQL
//!      function of (case, model, sample, request hash); written partition by partition
//!      under `_import/calls/`;
//!    - a duplicate call id (two records of the same case, model and sample) is refused
//!      (exit 2) before anything reaches `calls/`, and the run root keeps no table.
//! 3. The staged calls parts are renamed into `calls/`, and `_import/` is deleted.

use std::collections::BTreeSet;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, Float64Builder, Int32Builder, Int64Builder, RecordBatch, StringArray,
    StringBuilder, TimestampMicrosecondBuilder, UInt64Builder,
};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Field, Int32Type, Schema, SchemaRef, TimeUnit};
use datafusion::logical_expr::{ColumnarValue, ScalarUDF, Volatility, create_udf};
use datafusion::prelude::SessionContext;
use futures::StreamExt;
use object_store::ObjectStoreExt;

use crate::query::{QueryError, new_context};
use crate::schema::Table;
use crate::stages::call::{self, CallResult};
use crate::storage::{RunStore, StorageError};

/// Rows per staging batch (and so the memory of the streaming phase).
pub const STAGE_ROWS: usize = 8192;

/// Errors of the import core.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error(transparent)]
    Query(#[from] QueryError),
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// Two records of the same case, model and sample: the input is ambiguous.
    #[error(
        "{source_name}: two records for case `{input}` model `{model}` sample {sample_idx} (lines {first} and {second}): give distinct sample_idx"
    )]
    Duplicate {
        source_name: String,
        input: String,
        model: String,
        sample_idx: i32,
        first: u64,
        second: u64,
    },
}

impl ImportError {
    /// Whether the error is the user's input (exit 2).
    pub fn is_bad_input(&self) -> bool {
        match self {
            ImportError::Query(e) => e.is_bad_input(),
            ImportError::Storage(e) => e.is_bad_input(),
            ImportError::Duplicate { .. } => true,
        }
    }
}

/// One recorded call as every source format gives it.
#[derive(Debug, Clone, Default)]
pub struct ImportedCall {
    /// Where it came from (line number, or row number for Parquet), for ordering repeats
    /// and for messages.
    pub line: u64,
    pub model: String,
    pub system: Option<String>,
    pub input: String,
    pub expected: Option<String>,
    pub sample_idx: Option<i32>,
    /// The request as recorded (hashed into `request_hash`).
    pub request_key: String,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub result: CallResult,
    pub provider: Option<String>,
    pub attempts: Option<i32>,
    pub latency_ms: Option<f64>,
    pub started_at_us: Option<i64>,
}

/// What every imported case shares.
#[derive(Debug, Clone)]
pub struct CaseDefaults {
    pub test: String,
    pub capability: String,
    pub test_type: String,
    pub role: String,
}

/// What an import wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportSummary {
    pub cases: u64,
    pub calls: u64,
    pub models: Vec<String>,
}

/// The staging table's schema: the calls columns known at parse time, plus the line and
/// the case's text.
fn staging_schema() -> SchemaRef {
    let s = |n: &str, null: bool| Field::new(n, DataType::Utf8, null);
    Arc::new(Schema::new(vec![
        Field::new("line", DataType::UInt64, false),
        s("case_id", false),
        s("model", false),
        s("provider", true),
        Field::new("given_sample_idx", DataType::Int32, true),
        s("request_hash", false),
        s("response", true),
        s("response_hash", true),
        s("finish_reason", true),
        Field::new("prompt_tokens", DataType::Int64, true),
        Field::new("completion_tokens", DataType::Int64, true),
        Field::new("reasoning_tokens", DataType::Int64, true),
        Field::new("reasoning_chars", DataType::Int64, true),
        Field::new("http_status", DataType::Int32, true),
        s("error", true),
        Field::new("attempts", DataType::Int32, true),
        Field::new("latency_ms", DataType::Float64, true),
        Field::new("max_tokens", DataType::Int32, true),
        Field::new("temperature", DataType::Float64, true),
        Field::new(
            "started_at",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            true,
        ),
        s("input", false),
        s("expected", true),
    ]))
}

/// Buffers one staging batch.
#[derive(Default)]
struct Builders {
    line: UInt64Builder,
    case_id: StringBuilder,
    model: StringBuilder,
    provider: StringBuilder,
    sample_idx: Int32Builder,
    request_hash: StringBuilder,
    response: StringBuilder,
    response_hash: StringBuilder,
    finish_reason: StringBuilder,
    prompt_tokens: Int64Builder,
    completion_tokens: Int64Builder,
    reasoning_tokens: Int64Builder,
    reasoning_chars: Int64Builder,
    http_status: Int32Builder,
    error: StringBuilder,
    attempts: Int32Builder,
    latency_ms: Float64Builder,
    max_tokens: Int32Builder,
    temperature: Float64Builder,
    started_at: TimestampMicrosecondBuilder,
    input: StringBuilder,
    expected: StringBuilder,
    rows: usize,
}

impl Builders {
    fn finish(&mut self) -> RecordBatch {
        let cols: Vec<ArrayRef> = vec![
            Arc::new(self.line.finish()),
            Arc::new(self.case_id.finish()),
            Arc::new(self.model.finish()),
            Arc::new(self.provider.finish()),
            Arc::new(self.sample_idx.finish()),
            Arc::new(self.request_hash.finish()),
            Arc::new(self.response.finish()),
            Arc::new(self.response_hash.finish()),
            Arc::new(self.finish_reason.finish()),
            Arc::new(self.prompt_tokens.finish()),
            Arc::new(self.completion_tokens.finish()),
            Arc::new(self.reasoning_tokens.finish()),
            Arc::new(self.reasoning_chars.finish()),
            Arc::new(self.http_status.finish()),
            Arc::new(self.error.finish()),
            Arc::new(self.attempts.finish()),
            Arc::new(self.latency_ms.finish()),
            Arc::new(self.max_tokens.finish()),
            Arc::new(self.temperature.finish()),
            Arc::new(self.started_at.finish().with_timezone("UTC")),
            Arc::new(self.input.finish()),
            Arc::new(self.expected.finish()),
        ];
        self.rows = 0;
        RecordBatch::try_new(staging_schema(), cols).expect("staging batch matches its schema")
    }
}

/// Receives imported records one at a time; see the module documentation.
pub struct ImportSink {
    store: RunStore,
    defaults: CaseDefaults,
    /// Names the source in messages (the file, or `N files`).
    source_name: String,
    b: Builders,
    staging: Option<crate::storage::PartWriter>,
    rows: u64,
    missing_samples: u64,
    models: BTreeSet<String>,
}

const STAGING: &str = "_import/staging";
const STAGED_CALLS: &str = "_import/calls";

impl ImportSink {
    /// Starts an import into `store` (which must hold no run yet).
    pub async fn new(
        store: &RunStore,
        defaults: CaseDefaults,
        source_name: impl Into<String>,
    ) -> Result<Self, ImportError> {
        // A crashed earlier attempt left staging behind: start clean.
        store.delete_dir("_import").await?;
        Ok(ImportSink {
            store: store.clone(),
            defaults,
            source_name: source_name.into(),
            b: Builders::default(),
            staging: Some(store.part_writer(STAGING, staging_schema(), "stage")),
            rows: 0,
            missing_samples: 0,
            models: BTreeSet::new(),
        })
    }

    /// Rows pushed so far.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Adds one record.
    pub async fn push(&mut self, r: ImportedCall) -> Result<(), ImportError> {
        let case_id = call::sha_hex(&[
            "imported",
            &self.defaults.test,
            r.system.as_deref().unwrap_or(""),
            &r.input,
        ])[..24]
            .to_string();
        let request_hash = call::sha_hex(&[&r.request_key])[..32].to_string();
        if !self.models.contains(&r.model) {
            self.models.insert(r.model.clone());
        }
        let b = &mut self.b;
        b.line.append_value(r.line);
        b.case_id.append_value(&case_id);
        b.model.append_value(&r.model);
        b.provider.append_option(r.provider.as_deref());
        b.sample_idx.append_option(r.sample_idx);
        b.request_hash.append_value(&request_hash);
        b.response_hash
            .append_option(call::response_hash(r.result.response.as_deref()));
        b.response.append_option(r.result.response.as_deref());
        b.finish_reason
            .append_option(r.result.finish_reason.as_deref());
        b.prompt_tokens.append_option(r.result.prompt_tokens);
        b.completion_tokens
            .append_option(r.result.completion_tokens);
        b.reasoning_tokens.append_option(r.result.reasoning_tokens);
        b.reasoning_chars.append_option(r.result.reasoning_chars);
        b.http_status.append_option(r.result.http_status);
        b.error.append_option(r.result.error.as_deref());
        b.attempts.append_option(r.attempts);
        b.latency_ms.append_option(r.latency_ms);
        b.max_tokens.append_option(
            r.result
                .max_tokens_used
                .or(r.max_tokens)
                .map(|m| i32::try_from(m).unwrap_or(i32::MAX)),
        );
        b.temperature.append_option(r.temperature);
        b.started_at.append_option(r.started_at_us);
        b.input.append_value(&r.input);
        b.expected.append_option(r.expected.as_deref());
        b.rows += 1;
        self.rows += 1;
        if r.sample_idx.is_none() {
            self.missing_samples += 1;
        }
        if b.rows >= STAGE_ROWS {
            let batch = b.finish();
            if let Some(w) = self.staging.as_mut() {
                w.write(batch).await?;
            }
        }
        Ok(())
    }

    /// Runs the plans and commits `cases` and `calls`; see the module documentation.
    pub async fn finish(mut self) -> Result<ImportSummary, ImportError> {
        if let Some(mut w) = self.staging.take() {
            if self.b.rows > 0 {
                w.write(self.b.finish()).await?;
            }
            w.finish().await?;
        }
        let result = self.plan().await;
        // Staging is scratch either way; a failed import leaves no table behind.
        let cleanup = self.store.delete_dir("_import").await;
        if self.store.table_url("x").starts_with("file:") {
            // The local store leaves the emptied folders behind.
            let _ =
                std::fs::remove_dir_all(std::path::Path::new(self.store.display()).join("_import"));
        }
        if result.is_err() {
            self.store.delete_dir("cases").await?;
            self.store.delete_dir("calls").await?;
        }
        let summary = result?;
        cleanup?;
        Ok(summary)
    }

    async fn plan(&self) -> Result<ImportSummary, ImportError> {
        let ctx = new_context();
        self.store.register_with(&ctx);
        ctx.register_udf(call_id_udf());
        crate::query::register_parquet(&ctx, "st", &self.store.table_url(STAGING)).await?;
        let calls_sql = self.calls_sql();
        // Staged calls first, then the duplicate check on their ids, then the commit.
        let calls =
            write_partitioned(&ctx, &calls_sql, &self.store, STAGED_CALLS, Table::Calls).await?;
        crate::query::register_parquet(&ctx, "staged_calls", &self.store.table_url(STAGED_CALLS))
            .await?;
        self.check_duplicates(&ctx).await?;
        let cases =
            write_partitioned(&ctx, &self.cases_sql(), &self.store, "cases", Table::Cases).await?;
        let os = self.store.object_store();
        for p in self.store.list_parts(STAGED_CALLS).await? {
            let name = p.location.filename().unwrap_or_default().to_string();
            os.rename(&p.location, &self.store.path(&format!("calls/{name}")))
                .await
                .map_err(|source| StorageError::Store {
                    location: format!("calls/{name}"),
                    source,
                })?;
        }
        Ok(ImportSummary {
            cases,
            calls,
            models: self.models.iter().cloned().collect(),
        })
    }

    fn cases_sql(&self) -> String {
        let lit = |s: &str| format!("'{}'", s.replace('\'', "''"));
        let d = &self.defaults;
        format!(
            "SELECT case_id, 'imported' AS suite, {test} AS test, {cap} AS capability, \
             {tt} AS test_type, case_id AS template_id, case_id AS group_id, {role} AS role, \
             first_value(input ORDER BY line) AS input, \
             first_value(expected ORDER BY line) AS expected, \
             CAST(NULL AS VARCHAR) AS expectation, CAST(NULL AS DOUBLE) AS tolerance, \
             CAST(NULL AS VARCHAR) AS perturbation FROM st GROUP BY case_id",
            test = lit(&d.test),
            cap = lit(&d.capability),
            tt = lit(&d.test_type),
            role = lit(&d.role),
        )
    }

    fn calls_sql(&self) -> String {
        // Without missing sample indices no window (and no sort) is needed.
        let source = if self.missing_samples == 0 {
            "SELECT *, given_sample_idx AS sample_idx FROM st".to_string()
        } else {
            "SELECT st.*, COALESCE(st.given_sample_idx, CAST(COALESCE(g.base, 0) + \
             row_number() OVER (PARTITION BY st.case_id, st.model, st.given_sample_idx IS NULL \
             ORDER BY st.line) - 1 AS INT)) AS sample_idx FROM st LEFT JOIN \
             (SELECT case_id, model, max(given_sample_idx) + 1 AS base FROM st \
              WHERE given_sample_idx IS NOT NULL GROUP BY case_id, model) g \
             ON st.case_id = g.case_id AND st.model = g.model"
                .to_string()
        };
        format!(
            "SELECT evalflow_call_id(case_id, model, sample_idx, request_hash) AS call_id, \
             case_id, model, provider, sample_idx, request_hash, response, \
             CAST(NULL AS DOUBLE) AS response_score, response_hash, finish_reason, \
             prompt_tokens, completion_tokens, reasoning_tokens, reasoning_chars, http_status, \
             error, attempts, latency_ms, max_tokens, temperature, started_at, \
             CAST(NULL AS BOOLEAN) AS retried_for_budget FROM ({source})"
        )
    }

    async fn check_duplicates(&self, ctx: &SessionContext) -> Result<(), ImportError> {
        let sql = "SELECT call_id FROM staged_calls GROUP BY call_id HAVING count(*) > 1 LIMIT 1";
        let rows = crate::query::text_rows(ctx, sql).await?;
        let Some(id) = rows.first().and_then(|r| r[0].clone()) else {
            return Ok(());
        };
        // Name the two records: a failure path, so a second scan is fine.
        let sql = format!(
            "SELECT st.input, k.model, k.sample_idx, st.line FROM staged_calls k JOIN st \
             ON k.case_id = st.case_id AND k.model = st.model AND k.request_hash = st.request_hash \
             WHERE k.call_id = '{id}' ORDER BY st.line"
        );
        let rows = crate::query::text_rows(ctx, &sql).await?;
        let get = |i: usize, c: usize| rows.get(i).and_then(|r| r[c].clone()).unwrap_or_default();
        Err(ImportError::Duplicate {
            source_name: self.source_name.clone(),
            input: get(0, 0),
            model: get(0, 1),
            sample_idx: get(0, 2).parse().unwrap_or(0),
            first: get(0, 3).parse().unwrap_or(0),
            second: get(rows.len().saturating_sub(1), 3).parse().unwrap_or(0),
        })
    }
}

/// Runs `sql` and writes each output partition through its own part writer under `dir`, in
/// parallel (Parquet encoding is the costly part); returns the rows written.
async fn write_partitioned(
    ctx: &SessionContext,
    sql: &str,
    store: &RunStore,
    dir: &str,
    table: Table,
) -> Result<u64, ImportError> {
    let what = format!("import: writing {dir}");
    let streams = ctx
        .sql(sql)
        .await
        .map_err(QueryError::df(what.clone()))?
        .execute_stream_partitioned()
        .await
        .map_err(QueryError::df(what.clone()))?;
    let schema = table.schema();
    let mut tasks = Vec::new();
    for (k, mut s) in streams.into_iter().enumerate() {
        let (store, schema, dir, what) =
            (store.clone(), schema.clone(), dir.to_string(), what.clone());
        tasks.push(tokio::spawn(async move {
            let mut w = store.part_writer(&dir, schema.clone(), &format!("part-imported-{k:03}"));
            let mut rows = 0u64;
            while let Some(b) = s.next().await {
                let b = conform(b.map_err(QueryError::df(what.clone()))?, &schema)
                    .map_err(|e| QueryError::df(what.clone())(e.into()))?;
                rows += b.num_rows() as u64;
                w.write(b).await?;
            }
            w.finish().await?;
            Ok::<u64, ImportError>(rows)
        }));
    }
    let mut rows = 0;
    for t in tasks {
        rows += t.await.map_err(|e| {
            QueryError::df(what.clone())(datafusion::error::DataFusionError::External(Box::new(e)))
        })??;
    }
    Ok(rows)
}

/// Casts a plan's batch to a table's declared schema (same column order).
fn conform(
    b: RecordBatch,
    schema: &SchemaRef,
) -> Result<RecordBatch, datafusion::arrow::error::ArrowError> {
    let cols = b
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(c, f)| {
            if c.data_type() == f.data_type() {
                Ok(c.clone())
            } else {
                cast(c, f.data_type())
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new(schema.clone(), cols)
}

/// `evalflow_call_id(case_id, model, sample_idx, request_hash)`: the call stage's call id, so
/// imported calls get exactly the ids a live run of the same requests would.
fn call_id_udf() -> ScalarUDF {
    create_udf(
        "evalflow_call_id",
        vec![
            DataType::Utf8,
            DataType::Utf8,
            DataType::Int32,
            DataType::Utf8,
        ],
        DataType::Utf8,
        Volatility::Immutable,
        Arc::new(|args: &[ColumnarValue]| {
            let arrays = ColumnarValue::values_to_arrays(args)?;
            let (case, model, sample, req) = (
                arrays[0].as_string::<i32>(),
                arrays[1].as_string::<i32>(),
                arrays[2].as_primitive::<Int32Type>(),
                arrays[3].as_string::<i32>(),
            );
            let out: StringArray = (0..case.len())
                .map(|i| {
                    Some(call::call_id(
                        case.value(i),
                        model.value(i),
                        sample.value(i),
                        req.value(i),
                    ))
                })
                .collect();
            Ok(ColumnarValue::Array(Arc::new(out)))
        }),
    )
}
