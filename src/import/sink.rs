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
    Array, ArrayRef, AsArray, BooleanBuilder, Float64Builder, Int32Builder, Int64Builder,
    RecordBatch, StringArray, StringBuilder, TimestampMicrosecondBuilder, UInt64Builder,
    new_null_array,
};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Field, Int32Type, Schema, SchemaRef, TimeUnit};
use datafusion::logical_expr::{ColumnarValue, ScalarUDF, Volatility, create_udf};
use datafusion::prelude::SessionContext;
use futures::StreamExt;
use object_store::ObjectStoreExt;

use super::Record;
use crate::query::{QueryError, new_context};
use crate::schema::Table;
use crate::stages::call;
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
    /// A record the sources reader could not read.
    #[error(transparent)]
    Source(#[from] super::ImportError),
    /// Two records of the same case, model and sample: the input is ambiguous.
    #[error(
        "{source_name}: two records for case `{input}` model `{model}` sample {sample_idx} (records {first} and {second} of the import): give distinct sample_idx"
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
            ImportError::Source(_) | ImportError::Duplicate { .. } => true,
        }
    }
}

/// What every imported case shares unless its record says otherwise.
#[derive(Debug, Clone)]
pub struct CaseDefaults {
    /// `--test`: over the record's own test when given.
    pub test: Option<String>,
    pub capability: String,
    pub test_type: String,
    pub role: String,
}

/// What an import wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportSummary {
    pub cases: u64,
    /// Cases whose record named a cluster (`--cluster`).
    pub clustered: u64,
    pub calls: u64,
    pub models: Vec<String>,
    /// Imported scores versions: (`<tool>-<scorer>@imported`, folder, rows).
    pub scores: Vec<(String, String, u64)>,
}

/// The staging table's schema: the calls columns known at parse time, the record's order
/// (`seq`), its case's fields and its provenance.
fn staging_schema() -> SchemaRef {
    let s = |n: &str, null: bool| Field::new(n, DataType::Utf8, null);
    let i64f = |n: &str| Field::new(n, DataType::Int64, true);
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::UInt64, false),
        s("case_id", false),
        s("test", false),
        s("capability", false),
        s("cluster", true),
        s("model", false),
        s("provider", true),
        Field::new("given_sample_idx", DataType::Int32, true),
        s("request_hash", false),
        s("response", true),
        s("response_hash", true),
        s("finish_reason", true),
        i64f("prompt_tokens"),
        i64f("completion_tokens"),
        i64f("reasoning_tokens"),
        i64f("reasoning_chars"),
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
        s("source_format", false),
        s("source_file", false),
        s("source_id", true),
    ]))
}

/// The staged imported scores: one row per (record, tool scorer).
fn scores_staging_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::UInt64, false),
        Field::new("scorer", DataType::Utf8, false),
        Field::new("score", DataType::Float64, true),
        Field::new("label", DataType::Utf8, true),
        Field::new("passed", DataType::Boolean, true),
        Field::new("detail", DataType::Utf8, true),
    ]))
}

/// Buffers one staging batch.
#[derive(Default)]
struct Builders {
    seq: UInt64Builder,
    case_id: StringBuilder,
    test: StringBuilder,
    capability: StringBuilder,
    cluster: StringBuilder,
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
    source_format: StringBuilder,
    source_file: StringBuilder,
    source_id: StringBuilder,
    rows: usize,
}

impl Builders {
    fn finish(&mut self) -> RecordBatch {
        let cols: Vec<ArrayRef> = vec![
            Arc::new(self.seq.finish()),
            Arc::new(self.case_id.finish()),
            Arc::new(self.test.finish()),
            Arc::new(self.capability.finish()),
            Arc::new(self.cluster.finish()),
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
            Arc::new(self.source_format.finish()),
            Arc::new(self.source_file.finish()),
            Arc::new(self.source_id.finish()),
        ];
        self.rows = 0;
        RecordBatch::try_new(staging_schema(), cols).expect("staging batch matches its schema")
    }
}

/// Buffers staged imported scores.
#[derive(Default)]
struct ScoreBuilders {
    seq: UInt64Builder,
    scorer: StringBuilder,
    score: Float64Builder,
    label: StringBuilder,
    passed: BooleanBuilder,
    detail: StringBuilder,
    rows: usize,
}

impl ScoreBuilders {
    fn finish(&mut self) -> RecordBatch {
        let cols: Vec<ArrayRef> = vec![
            Arc::new(self.seq.finish()),
            Arc::new(self.scorer.finish()),
            Arc::new(self.score.finish()),
            Arc::new(self.label.finish()),
            Arc::new(self.passed.finish()),
            Arc::new(self.detail.finish()),
        ];
        self.rows = 0;
        RecordBatch::try_new(scores_staging_schema(), cols).expect("scores staging batch")
    }
}

/// What staging computes of a record before appending it.
#[derive(Clone)]
struct Keys {
    test: String,
    case_id: String,
    request_hash: String,
    response_hash: Option<String>,
}

/// Receives imported records one at a time; see the module documentation.
pub struct ImportSink {
    store: RunStore,
    defaults: CaseDefaults,
    b: Builders,
    sb: ScoreBuilders,
    staging: Option<crate::storage::PartWriter>,
    score_staging: Option<crate::storage::PartWriter>,
    rows: u64,
    missing_samples: u64,
    models: BTreeSet<String>,
    /// (tool, `<tool>-<scorer>`) of every imported score seen.
    tool_scorers: BTreeSet<(String, String)>,
}

const STAGING: &str = "_import/staging";
const SCORE_STAGING: &str = "_import/scores";
const STAGED_CALLS: &str = "_import/calls";

impl ImportSink {
    /// Starts an import into `store` (which must hold no run yet).
    pub async fn new(store: &RunStore, defaults: CaseDefaults) -> Result<Self, ImportError> {
        // A crashed earlier attempt left staging behind: start clean.
        store.delete_dir("_import").await?;
        Ok(ImportSink {
            store: store.clone(),
            defaults,
            b: Builders::default(),
            sb: ScoreBuilders::default(),
            staging: Some(
                store
                    .part_writer(STAGING, staging_schema(), "stage")
                    .scratch(),
            ),
            score_staging: Some(
                store
                    .part_writer(SCORE_STAGING, scores_staging_schema(), "stage")
                    .scratch(),
            ),
            rows: 0,
            missing_samples: 0,
            models: BTreeSet::new(),
            tool_scorers: BTreeSet::new(),
        })
    }

    /// Rows pushed so far.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Adds one record.
    pub async fn push(&mut self, r: Record) -> Result<(), ImportError> {
        let k = self.keys(&r);
        self.stage(r, k).await
    }

    /// Adds records in their order; their hashes (case id, request and response hash, the
    /// costly part of staging) are computed on rayon's pool first.
    pub async fn push_many(&mut self, records: Vec<Record>) -> Result<(), ImportError> {
        use rayon::prelude::*;
        // Records of one case (its samples, its models) usually sit together: each slice
        // reuses the previous record's hashes when its case or request is the same.
        let keys: Vec<Keys> = records
            .par_chunks(256)
            .flat_map_iter(|chunk| {
                let mut prev: Option<(&Record, Keys)> = None;
                chunk
                    .iter()
                    .map(|r| {
                        let k = match &prev {
                            Some((p, pk)) => self.keys_after(r, p, pk),
                            None => self.keys(r),
                        };
                        prev = Some((r, k.clone()));
                        k
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        for (r, k) in records.into_iter().zip(keys) {
            self.stage(r, k).await?;
        }
        Ok(())
    }

    /// [`Self::keys`] of `r`, reusing those of the record before it (`p`, whose keys are
    /// `pk`) where the inputs are the same.
    fn keys_after(&self, r: &Record, p: &Record, pk: &Keys) -> Keys {
        let same_case = r.test == p.test
            && r.case_key == p.case_key
            && r.system == p.system
            && r.input == p.input;
        if !same_case {
            return self.keys(r);
        }
        Keys {
            test: pk.test.clone(),
            case_id: pk.case_id.clone(),
            request_hash: if r.request_key == p.request_key {
                pk.request_hash.clone()
            } else {
                call::sha_hex(&[&r.request_key])[..32].to_string()
            },
            response_hash: call::response_hash(r.response.as_deref()),
        }
    }

    /// A record's test, case id and hashes.
    fn keys(&self, r: &Record) -> Keys {
        let test = self
            .defaults
            .test
            .clone()
            .or_else(|| r.test.clone())
            .unwrap_or_else(|| "imported".into());
        // One case per (test, the source's case id) where the source has one, else per
        // (test, system, input).
        let case_id = match &r.case_key {
            Some(k) => call::sha_hex(&["imported", &test, &format!("\u{0}{k}"), ""]),
            None => call::sha_hex(&[
                "imported",
                &test,
                r.system.as_deref().unwrap_or(""),
                &r.input,
            ]),
        }[..24]
            .to_string();
        Keys {
            request_hash: call::sha_hex(&[&r.request_key])[..32].to_string(),
            response_hash: call::response_hash(r.response.as_deref()),
            test,
            case_id,
        }
    }

    /// Appends one record, with its keys, to the staging batches.
    async fn stage(&mut self, r: Record, k: Keys) -> Result<(), ImportError> {
        let seq = self.rows;
        let Keys {
            test,
            case_id,
            request_hash,
            response_hash,
        } = k;
        if !self.models.contains(&r.model) {
            self.models.insert(r.model.clone());
        }
        let failed = r.error.is_some() || r.http_status.is_some_and(|s| !(200..300).contains(&s));
        let tool = super::tool_of(r.source.format).to_string();
        for sc in &r.scores {
            let name = format!("{tool}-{}", sc.scorer);
            if !self.tool_scorers.contains(&(tool.clone(), name.clone())) {
                self.tool_scorers.insert((tool.clone(), name.clone()));
            }
            let sb = &mut self.sb;
            sb.seq.append_value(seq);
            sb.scorer.append_value(&name);
            // DESIGN: score is NULL whenever the call is not a valid answer.
            sb.score.append_option(if failed { None } else { sc.score });
            sb.label.append_option(sc.label.as_deref());
            sb.passed
                .append_option(if failed { None } else { sc.passed });
            sb.detail.append_option(sc.detail.as_deref());
            sb.rows += 1;
        }
        let b = &mut self.b;
        b.seq.append_value(seq);
        b.case_id.append_value(&case_id);
        b.test.append_value(&test);
        b.capability
            .append_value(r.capability.as_deref().unwrap_or(&self.defaults.capability));
        b.cluster.append_option(r.cluster.as_deref());
        b.model.append_value(&r.model);
        b.provider.append_option(r.provider.as_deref());
        b.sample_idx.append_option(r.sample_idx);
        b.request_hash.append_value(&request_hash);
        b.response_hash.append_option(response_hash);
        b.response.append_option(r.response.as_deref());
        b.finish_reason.append_option(r.finish_reason.as_deref());
        b.prompt_tokens.append_option(r.prompt_tokens);
        b.completion_tokens.append_option(r.completion_tokens);
        b.reasoning_tokens.append_option(r.reasoning_tokens);
        b.reasoning_chars.append_option(r.reasoning_chars);
        b.http_status.append_option(r.http_status);
        b.error.append_option(r.error.as_deref());
        b.attempts.append_option(r.attempts);
        b.latency_ms.append_option(r.latency_ms);
        b.max_tokens
            .append_option(r.max_tokens.map(|m| i32::try_from(m).unwrap_or(i32::MAX)));
        b.temperature.append_option(r.temperature);
        b.started_at.append_option(r.started_at_us);
        b.input.append_value(&r.input);
        b.expected.append_option(r.expected.as_deref());
        b.source_format.append_value(r.source.format);
        b.source_file.append_value(&r.source.file);
        b.source_id.append_option(r.source.id.as_deref());
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
        if self.sb.rows >= STAGE_ROWS {
            let batch = self.sb.finish();
            if let Some(w) = self.score_staging.as_mut() {
                w.write(batch).await?;
            }
        }
        Ok(())
    }

    /// Runs the plans and commits `cases`, `calls` and the imported scores; see the
    /// module documentation.
    pub async fn finish(mut self) -> Result<ImportSummary, ImportError> {
        if let Some(mut w) = self.staging.take() {
            if self.b.rows > 0 {
                w.write(self.b.finish()).await?;
            }
            w.finish().await?;
        }
        if let Some(mut w) = self.score_staging.take() {
            if self.sb.rows > 0 {
                w.write(self.sb.finish()).await?;
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
            self.store.delete_dir("scores").await?;
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
        let has_scores = !self.tool_scorers.is_empty();
        // Staged calls first (with `seq` when imported scores must find their call), then
        // the duplicate check on their ids, then the commit.
        let calls = write_partitioned(
            &ctx,
            &self.calls_sql(has_scores),
            &self.store,
            STAGED_CALLS,
            if has_scores {
                staged_calls_schema()
            } else {
                super::calls_schema()
            },
        )
        .await?;
        crate::query::register_parquet(&ctx, "staged_calls", &self.store.table_url(STAGED_CALLS))
            .await?;
        self.check_duplicates(&ctx).await?;
        let cases = write_partitioned(
            &ctx,
            &self.cases_sql(),
            &self.store,
            "cases",
            Table::Cases.schema(),
        )
        .await?;
        let clustered = crate::query::text_rows(
            &ctx,
            "SELECT count(DISTINCT case_id) FROM st WHERE cluster IS NOT NULL",
        )
        .await?
        .first()
        .and_then(|r| r[0].as_deref().and_then(|v| v.parse().ok()))
        .unwrap_or(0);
        let mut scores = Vec::new();
        if has_scores {
            crate::query::register_parquet(&ctx, "ss", &self.store.table_url(SCORE_STAGING))
                .await?;
            crate::query::register_parquet(&ctx, "imported_cases", &self.store.table_url("cases"))
                .await?;
            for (tool, scorer) in &self.tool_scorers {
                let dir = format!("scores/{scorer}@imported");
                let n = write_partitioned(
                    &ctx,
                    &scores_sql(tool, scorer),
                    &self.store,
                    &dir,
                    Table::Scores.schema(),
                )
                .await?;
                scores.push((format!("{scorer}@imported"), dir, n));
            }
            // The calls without `seq`, in the declared columns.
            let cols: Vec<String> = super::calls_schema()
                .fields()
                .iter()
                .map(|f| f.name().clone())
                .collect();
            write_partitioned(
                &ctx,
                &format!("SELECT {} FROM staged_calls", cols.join(", ")),
                &self.store,
                "calls",
                super::calls_schema(),
            )
            .await?;
        } else {
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
        }
        Ok(ImportSummary {
            cases,
            clustered,
            calls,
            models: self.models.iter().cloned().collect(),
            scores,
        })
    }

    /// The cases: each case's first record (the one with its lowest `seq`).
    ///
    /// Found by joining the staging with each case's first `seq`, not by a `GROUP BY
    /// case_id` of `first_value`s: the aggregate would hold every case's input text until
    /// its end (about 0.7 GB at 10M records); the join holds two integers and an id per
    /// case. The staging streams past the join in `seq` order, so each part lists its
    /// cases in the order the corpus names them, the order of the calls parts: a calls
    /// part's cases sit in a few Parquet pages of `cases`, and the score stage's join
    /// (which filters `cases` by the part's case ids while decoding) skips the rest.
    fn cases_sql(&self) -> String {
        let lit = |s: &str| format!("'{}'", s.replace('\'', "''"));
        let d = &self.defaults;
        format!(
            "SELECT st.case_id, 'imported' AS suite, st.test, st.capability, {tt} AS test_type, \
             COALESCE(st.cluster, st.case_id) AS template_id, \
             st.case_id AS group_id, {role} AS role, st.input, st.expected, \
             CAST(NULL AS VARCHAR) AS expectation, CAST(NULL AS DOUBLE) AS tolerance, \
             CAST(NULL AS VARCHAR) AS perturbation \
             FROM (SELECT min(seq) AS first_seq FROM st GROUP BY case_id) f \
             JOIN st ON st.seq = f.first_seq",
            tt = lit(&d.test_type),
            role = lit(&d.role),
        )
    }

    fn calls_sql(&self, with_seq: bool) -> String {
        // Without missing sample indices no window (and no sort) is needed.
        let source = if self.missing_samples == 0 {
            "SELECT *, given_sample_idx AS sample_idx FROM st".to_string()
        } else {
            "SELECT st.*, COALESCE(st.given_sample_idx, CAST(COALESCE(g.base, 0) + \
             row_number() OVER (PARTITION BY st.case_id, st.model, st.given_sample_idx IS NULL \
             ORDER BY st.seq) - 1 AS INT)) AS sample_idx FROM st LEFT JOIN \
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
             CAST(NULL AS BOOLEAN) AS retried_for_budget, source_format, source_file, \
             source_id{seq} FROM ({source})",
            seq = if with_seq { ", seq" } else { "" }
        )
    }

    /// Fails on the first call id that two records share.
    ///
    /// Call ids are hex digests, so their first digit splits them into 16 even slices; the
    /// check runs one `GROUP BY call_id` per range of slices, each over at most about
    /// [`DUPLICATE_PASS_ROWS`] ids, so its hash table stays the same size whatever the
    /// corpus (one pass over all 10M ids held about 0.6 GB) for one more read of the
    /// `call_id` column per pass.
    async fn check_duplicates(&self, ctx: &SessionContext) -> Result<(), ImportError> {
        let passes = (self.rows() as usize).div_ceil(DUPLICATE_PASS_ROWS);
        let mut id = None;
        for range in id_ranges(passes) {
            let sql = format!(
                "SELECT call_id FROM staged_calls {range} GROUP BY call_id HAVING count(*) > 1 LIMIT 1"
            );
            let rows = crate::query::text_rows(ctx, &sql).await?;
            id = rows.first().and_then(|r| r[0].clone());
            if id.is_some() {
                break;
            }
        }
        let Some(id) = id else {
            return Ok(());
        };
        // Name the two records: a failure path, so a second scan is fine.
        let sql = format!(
            "SELECT st.input, k.model, k.sample_idx, st.seq, st.source_file FROM staged_calls k \
             JOIN st ON k.case_id = st.case_id AND k.model = st.model \
             AND k.request_hash = st.request_hash \
             WHERE k.call_id = '{id}' ORDER BY st.seq"
        );
        let rows = crate::query::text_rows(ctx, &sql).await?;
        let get = |i: usize, c: usize| rows.get(i).and_then(|r| r[c].clone()).unwrap_or_default();
        let seq = |i: usize| get(i, 3).parse::<u64>().map_or(0, |s| s + 1);
        Err(ImportError::Duplicate {
            source_name: get(0, 4),
            input: get(0, 0),
            model: get(0, 1),
            sample_idx: get(0, 2).parse().unwrap_or(0),
            first: seq(0),
            second: seq(rows.len().saturating_sub(1)),
        })
    }
}

/// `passes` (1 to 16) `WHERE` clauses over `call_id` by its first hex digit: together they
/// take every id exactly once (the first and last are open-ended, so even an id that is
/// not hex falls in one).
fn id_ranges(passes: usize) -> Vec<String> {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let passes = passes.clamp(1, DIGITS.len());
    (0..passes)
        .map(|p| {
            let (lo, hi) = (p * 16 / passes, (p + 1) * 16 / passes);
            let mut bounds = Vec::new();
            if lo > 0 {
                bounds.push(format!("call_id >= '{}'", DIGITS[lo] as char));
            }
            if hi < DIGITS.len() {
                bounds.push(format!("call_id < '{}'", DIGITS[hi] as char));
            }
            if bounds.is_empty() {
                String::new()
            } else {
                format!("WHERE {}", bounds.join(" AND "))
            }
        })
        .collect()
}

/// Call ids one pass of the duplicate check holds at most (about 150 MB of hash table).
const DUPLICATE_PASS_ROWS: usize = 2_500_000;

/// The staged calls: an imported calls table plus the record's `seq`.
fn staged_calls_schema() -> SchemaRef {
    let mut fields: Vec<Field> = super::calls_schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    fields.push(Field::new("seq", DataType::UInt64, false));
    Arc::new(Schema::new(fields))
}

/// One imported scores version: a row for every call of the tool (NULL where the tool did
/// not score it), with the case's fields as the scores table carries them.
fn scores_sql(tool: &str, scorer: &str) -> String {
    let lit = |s: &str| format!("'{}'", s.replace('\'', "''"));
    format!(
        "SELECT k.call_id, k.case_id, k.model, k.sample_idx, {scorer} AS scorer, \
         'imported' AS scoring_version, k.response_hash, \
         CASE WHEN k.error IS NOT NULL OR (k.http_status IS NOT NULL AND \
         (k.http_status < 200 OR k.http_status > 299)) THEN 'provider_error' \
         ELSE 'valid_answer' END AS validity, \
         s.score, s.label, CAST(NULL AS DOUBLE) AS prob, s.passed, s.detail, NULL AS answers, \
         c.test, c.capability, c.test_type, c.role, c.template_id \
         FROM staged_calls k JOIN imported_cases c ON k.case_id = c.case_id \
         LEFT JOIN (SELECT * FROM ss WHERE scorer = {scorer}) s ON k.seq = s.seq \
         WHERE (CASE k.source_format WHEN 'openai-batch' THEN 'openai' ELSE k.source_format END) = {tool}",
        scorer = lit(scorer),
        tool = lit(tool),
    )
}

/// Runs `sql` and writes each output partition through its own part writer under `dir`, in
/// parallel (Parquet encoding is the costly part); returns the rows written.
async fn write_partitioned(
    ctx: &SessionContext,
    sql: &str,
    store: &RunStore,
    dir: &str,
    schema: SchemaRef,
) -> Result<u64, ImportError> {
    let what = format!("import: writing {dir}");
    let streams = ctx
        .sql(sql)
        .await
        .map_err(QueryError::df(what.clone()))?
        .execute_stream_partitioned()
        .await
        .map_err(QueryError::df(what.clone()))?;
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

/// Casts a plan's batch to a table's schema (same column order; an all-NULL column of no
/// type becomes NULLs of the declared type).
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
            } else if c.data_type() == &DataType::Null {
                Ok(new_null_array(f.data_type(), c.len()))
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

#[cfg(test)]
mod tests {
    use super::id_ranges;

    /// Whether `id` satisfies one `id_ranges` clause (`call_id >= 'x'`, `call_id < 'y'`).
    fn takes(clause: &str, id: &str) -> bool {
        clause
            .trim_start_matches("WHERE ")
            .split(" AND ")
            .filter(|c| !c.is_empty())
            .all(|c| {
                let bound = c.rsplit('\'').nth(1).expect("quoted bound");
                if c.contains(">=") {
                    id >= bound
                } else {
                    id < bound
                }
            })
    }

    #[test]
    fn duplicate_check_passes_take_every_id_once() {
        assert_eq!(id_ranges(0), vec![String::new()]);
        assert_eq!(id_ranges(1), vec![String::new()]);
        assert_eq!(
            id_ranges(4)[1],
            "WHERE call_id >= '4' AND call_id < '8'".to_string()
        );
        for passes in [2, 3, 4, 5, 7, 16, 40] {
            let ranges = id_ranges(passes);
            assert_eq!(ranges.len(), passes.min(16));
            for id in [
                "0a", "3f", "4", "7ff", "8", "b0", "f", "ffff", " not hex", "zz",
            ] {
                let n = ranges.iter().filter(|r| takes(r, id)).count();
                assert_eq!(n, 1, "{id} in {n} of {passes} passes: {ranges:?}");
            }
        }
    }
}
