//! The streaming core of `evalflow import`: records of any source format in, `cases` and
//! `calls` out, in memory bounded by a batch and the query memory pool.
//!
//! # How
//! 1. [`ImportSink::push_many`] takes records in file order, computes each one's case id,
//!    request and response hashes and, when the record names its sample, its call id (on
//!    rayon's pool), then routes it:
//!    - **direct**: a record with its sample index and no imported scores is already a
//!      `calls` row. Its batch goes to one of `--threads` writer tasks that encode the
//!      final, compressed parts under `_import/calls/`, and its (`seq`, `call_id`) to a
//!      small scratch table for the duplicate check. A corpus of such records (the common
//!      case) is parsed and encoded once, with no staging of its answers.
//!    - **staged**: a record without a sample index (its index depends on the repeats of
//!      its case and model across the whole corpus) or with imported scores (which must
//!      find their call) is appended to a scratch staging table under
//!      `_import/staging/`, for the plans of step 2.
//!
//!    Every record whose case differs from the record before it also appends its case's
//!    fields to `_import/cases/` (records of one case usually sit together, so this holds
//!    about one row per case, not per record).
//! 2. [`ImportSink::finish`] runs DataFusion plans over the scratch tables, so what needs
//!    the whole corpus is a hash aggregation, join or window that spills under
//!    `--memory-limit`, never a map:
//!    - staged `calls`: sample indices from the file, else the order of repeats of the same
//!      (case, model) after the highest given index (`row_number()` over the records that
//!      lack one), and the call id as a SQL function of (case, model, sample, request hash);
//!    - a record of a later file identical to one of an earlier file ([`Keys::fp`], the
//!      k-th copy within a file matching the k-th of another) is dropped before samples are
//!      numbered (the same file twice, a copy of it);
//!    - a duplicate call id (two records of the same case, model and sample) is refused
//!      (exit 2) when the records differ, and kept once when they are copies, before
//!      anything reaches `calls/`; a refusal leaves the run root no table;
//!    - two `expected` of one case are refused (or one wins: `--on-conflicting-expected`);
//!    - `cases`: each case's first record (lowest `seq`), in corpus order, with its
//!      `expected` (the first non-NULL, or the last).
//! 3. The calls parts are renamed (direct) or written (staged, without `seq`) into `calls/`,
//!    and `_import/` is deleted.

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

use super::{Record, numbering};
use crate::query::{QueryError, id_slices, new_context};
use crate::schema::Table;
use crate::stages::call;
use crate::storage::{PartWriter, RunStore, StorageError};

/// Chunks pushed whose keys are still being computed before a push waits for the oldest:
/// enough that the pool, busy parsing a block of the source, gets to them before the
/// sink needs them.
const KEYED_AHEAD: usize = 4;

/// Rows per staging batch (and so the memory of the streaming phase).
pub const STAGE_ROWS: usize = 8192;

/// Errors of the import core.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error(transparent)]
    Query(#[from] QueryError),
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// Numbering the samples of records that name none.
    #[error(transparent)]
    Numbering(#[from] numbering::NumberingError),
    /// A record the sources reader could not read.
    #[error(transparent)]
    Source(#[from] super::ImportError),
    /// Two records of the same case, model and sample: the input is ambiguous.
    #[error(
        "{source_name}: two different records for case `{input}` model `{model}` sample {sample_idx} (records {first} and {second} of the \
         import): give distinct sample_idx"
    )]
    Duplicate {
        source_name: String,
        input: String,
        model: String,
        sample_idx: i32,
        first: u64,
        second: u64,
    },
    /// Two records of one case (the same test and request) with different `expected`.
    #[error(
        "{first_at} and {second_at}: one case (the same test and request, input `{input}`) with two expected answers, `{first}` and \
         `{second}`: pass --on-conflicting-expected first|last to say which wins"
    )]
    ConflictingExpected {
        first_at: String,
        second_at: String,
        input: String,
        first: String,
        second: String,
    },
    /// `--cluster FIELD` named a field no record has.
    #[error(
        "--cluster `{field}`: no record has this field (a pairs line's top-level or `metadata` field, a batch line's or its request's \
         `metadata`, a Parquet column, an Inspect sample's metadata, an lm-eval doc field, a promptfoo var)"
    )]
    NoCluster { field: String },
    /// A direct calls writer task panicked or was cancelled.
    #[error("import: a calls writer stopped: {0}")]
    Writer(String),
}

impl ImportError {
    /// Whether the error is the user's input (exit 2).
    pub fn is_bad_input(&self) -> bool {
        match self {
            ImportError::Query(e) => e.is_bad_input(),
            ImportError::Storage(e) => e.is_bad_input(),
            ImportError::Source(_)
            | ImportError::Duplicate { .. }
            | ImportError::ConflictingExpected { .. }
            | ImportError::NoCluster { .. } => true,
            ImportError::Writer(_) | ImportError::Numbering(_) => false,
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

/// Which of two `expected` answers of one case wins (`--on-conflicting-expected`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OnConflict {
    /// Refuse the import (exit 2) naming both records.
    #[default]
    Refuse,
    /// The first record's (in import order).
    First,
    /// The last record's.
    Last,
}

/// How the sink treats duplicates, conflicts and the cluster field.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    pub on_conflicting_expected: OnConflict,
    /// Keep records identical to one of an earlier file as more samples
    /// (`--keep-duplicates`) instead of dropping them.
    pub keep_duplicates: bool,
    /// `--cluster FIELD`: an import where no record has it is refused.
    pub cluster: Option<String>,
}

/// What an import wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportSummary {
    pub cases: u64,
    /// Cases whose record named a cluster (`--cluster`).
    pub clustered: u64,
    pub calls: u64,
    pub models: Vec<String>,
    /// Records dropped as exact copies of another (the same file twice, two copies of it).
    pub duplicates: u64,
    /// Imported scores versions: (`<tool>-<scorer>@imported`, folder, rows).
    pub scores: Vec<(String, String, u64)>,
}

/// The calls-side columns of a record, known at parse time, and its order (`seq`): the
/// staging table's schema, and the batch a direct record's `calls` row is cut from.
fn staging_schema() -> SchemaRef {
    let s = |n: &str, null: bool| Field::new(n, DataType::Utf8, null);
    let i64f = |n: &str| Field::new(n, DataType::Int64, true);
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::UInt64, false),
        s("case_id", false),
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
        s("source_format", false),
        s("source_file", false),
        s("source_id", true),
        s("fp", false),
        Field::new("file_idx", DataType::UInt32, false),
    ]))
}

/// The staged case fields: one row for each record whose case differs from the record
/// before it.
fn case_staging_schema() -> SchemaRef {
    let s = |n: &str, null: bool| Field::new(n, DataType::Utf8, null);
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::UInt64, false),
        s("case_id", false),
        s("test", false),
        s("capability", false),
        s("cluster", true),
        s("input", false),
        s("expected", true),
        s("source_file", false),
        s("source_id", true),
    ]))
}

/// The (`seq`, `call_id`) of each direct record, for the duplicate check.
fn ids_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::UInt64, false),
        Field::new("call_id", DataType::Utf8, false),
        Field::new("fp", DataType::Utf8, false),
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

/// Buffers one batch of calls-side columns ([`staging_schema`]).
#[derive(Default)]
struct Builders {
    seq: UInt64Builder,
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
    source_format: StringBuilder,
    source_file: StringBuilder,
    source_id: StringBuilder,
    fp: StringBuilder,
    file_idx: datafusion::arrow::array::UInt32Builder,
    rows: usize,
}

impl Builders {
    /// Builders sized for `rows` rows and `response_bytes` of answers, so a batch fills
    /// without regrowing (each regrowth copies the column and touches fresh pages).
    fn with_capacity(rows: usize, response_bytes: usize) -> Self {
        let text = || StringBuilder::with_capacity(rows, rows * 32);
        Builders {
            seq: UInt64Builder::with_capacity(rows),
            case_id: text(),
            model: text(),
            provider: text(),
            sample_idx: Int32Builder::with_capacity(rows),
            request_hash: text(),
            response: StringBuilder::with_capacity(rows, response_bytes),
            response_hash: text(),
            finish_reason: text(),
            prompt_tokens: Int64Builder::with_capacity(rows),
            completion_tokens: Int64Builder::with_capacity(rows),
            reasoning_tokens: Int64Builder::with_capacity(rows),
            reasoning_chars: Int64Builder::with_capacity(rows),
            http_status: Int32Builder::with_capacity(rows),
            error: text(),
            attempts: Int32Builder::with_capacity(rows),
            latency_ms: Float64Builder::with_capacity(rows),
            max_tokens: Int32Builder::with_capacity(rows),
            temperature: Float64Builder::with_capacity(rows),
            started_at: TimestampMicrosecondBuilder::with_capacity(rows),
            source_format: text(),
            source_file: text(),
            source_id: text(),
            fp: text(),
            file_idx: datafusion::arrow::array::UInt32Builder::with_capacity(rows),
            rows: 0,
        }
    }

    fn append(&mut self, seq: u64, r: &Record, k: &Keys, file_idx: u32) {
        self.seq.append_value(seq);
        self.case_id.append_value(&k.case_id);
        self.model.append_value(&r.model);
        self.provider.append_option(r.provider.as_deref());
        self.sample_idx.append_option(r.sample_idx);
        self.request_hash.append_value(&k.request_hash);
        self.response_hash.append_option(k.response_hash.as_deref());
        self.response.append_option(r.response.as_deref());
        self.finish_reason.append_option(r.finish_reason.as_deref());
        self.prompt_tokens.append_option(r.prompt_tokens);
        self.completion_tokens.append_option(r.completion_tokens);
        self.reasoning_tokens.append_option(r.reasoning_tokens);
        self.reasoning_chars.append_option(r.reasoning_chars);
        self.http_status.append_option(r.http_status);
        self.error.append_option(r.error.as_deref());
        self.attempts.append_option(r.attempts);
        self.latency_ms.append_option(r.latency_ms);
        self.max_tokens
            .append_option(r.max_tokens.map(|m| i32::try_from(m).unwrap_or(i32::MAX)));
        self.temperature.append_option(r.temperature);
        self.started_at.append_option(r.started_at_us);
        self.source_format.append_value(r.source.format);
        self.source_file.append_value(&r.source.file);
        self.source_id.append_option(r.source.id.as_deref());
        self.fp.append_value(&k.fp);
        self.file_idx.append_value(file_idx);
        self.rows += 1;
    }

    fn finish(&mut self) -> RecordBatch {
        let cols: Vec<ArrayRef> = vec![
            Arc::new(self.seq.finish()),
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
            Arc::new(self.source_format.finish()),
            Arc::new(self.source_file.finish()),
            Arc::new(self.source_id.finish()),
            Arc::new(self.fp.finish()),
            Arc::new(self.file_idx.finish()),
        ];
        // The next batch is sized like this one (with room to spare for its answers).
        let response_bytes = cols[6].as_string::<i32>().value_data().len();
        *self = Builders::with_capacity(STAGE_ROWS, response_bytes + response_bytes / 4);
        RecordBatch::try_new(staging_schema(), cols).expect("staging batch matches its schema")
    }
}

/// Buffers staged case fields ([`case_staging_schema`]).
#[derive(Default)]
struct CaseBuilders {
    seq: UInt64Builder,
    case_id: StringBuilder,
    test: StringBuilder,
    capability: StringBuilder,
    cluster: StringBuilder,
    input: StringBuilder,
    expected: StringBuilder,
    source_file: StringBuilder,
    source_id: StringBuilder,
    rows: usize,
}

impl CaseBuilders {
    fn finish(&mut self) -> RecordBatch {
        let cols: Vec<ArrayRef> = vec![
            Arc::new(self.seq.finish()),
            Arc::new(self.case_id.finish()),
            Arc::new(self.test.finish()),
            Arc::new(self.capability.finish()),
            Arc::new(self.cluster.finish()),
            Arc::new(self.input.finish()),
            Arc::new(self.expected.finish()),
            Arc::new(self.source_file.finish()),
            Arc::new(self.source_id.finish()),
        ];
        self.rows = 0;
        RecordBatch::try_new(case_staging_schema(), cols).expect("case batch matches its schema")
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

/// Cases staged lately: at most this many, the oldest forgotten first.
const RECENT_CASES: usize = 8192;

/// The last [`RECENT_CASES`] cases whose fields were staged, each with the `expected` and
/// cluster of its last staged row: a record of one of them that says the same is not
/// staged again. Bounded, so memory does not grow with the corpus; a case forgotten is
/// only staged once more.
#[derive(Default)]
struct RecentCases {
    fields: std::collections::HashMap<Arc<str>, (Option<String>, Option<String>)>,
    order: std::collections::VecDeque<Arc<str>>,
}

impl RecentCases {
    fn seen(&self, case_id: &str, expected: Option<&str>, cluster: Option<&str>) -> bool {
        self.fields
            .get(case_id)
            .is_some_and(|(e, c)| e.as_deref() == expected && c.as_deref() == cluster)
    }

    fn remember(&mut self, case_id: &Arc<str>, expected: Option<&str>, cluster: Option<&str>) {
        let fields = (expected.map(str::to_string), cluster.map(str::to_string));
        if self.fields.insert(case_id.clone(), fields).is_none() {
            self.order.push_back(case_id.clone());
            if self.order.len() > RECENT_CASES
                && let Some(old) = self.order.pop_front()
            {
                self.fields.remove(&old);
            }
        }
    }
}

/// What staging computes of a record before appending it. What the records of one case
/// or request share is counted, not copied: a record whose case or request is the one
/// before it takes its neighbour's.
struct Keys {
    test: Arc<str>,
    case_id: Arc<str>,
    request_hash: Arc<str>,
    response_hash: Option<String>,
    /// The call id of a direct record (see the module documentation), `None` for a staged
    /// one.
    call_id: Option<String>,
    /// A digest of everything the record says but where it came from: two records with
    /// the same are copies of one (the same file imported twice).
    fp: String,
}

/// A direct batch ([`staging_schema`]) as `calls` rows: the columns by name, the call ids,
/// and NULL for what an import never knows.
fn direct_calls(
    b: &RecordBatch,
    call_ids: &ArrayRef,
) -> Result<RecordBatch, datafusion::arrow::error::ArrowError> {
    let schema = super::calls_schema();
    let cols = schema
        .fields()
        .iter()
        .map(|f| match f.name().as_str() {
            "call_id" => call_ids.clone(),
            "sample_idx" => b.column(4).clone(),
            name => b
                .column_by_name(name)
                .cloned()
                .unwrap_or_else(|| new_null_array(f.data_type(), b.num_rows())),
        })
        .collect();
    RecordBatch::try_new(schema, cols)
}

/// A chunk of records and, once rayon has computed them, their keys ([`chunk_keys`]).
type Keyed = tokio::sync::oneshot::Receiver<(Vec<Record>, Vec<Vec<Keys>>)>;

/// What a direct calls writer task is sent.
enum ToWriter {
    Batch(RecordBatch),
    /// Commit what is buffered: the import's records are all in.
    Finish,
}

/// One task encoding direct `calls` parts; its handle returns the rows it committed.
struct DirectWriter {
    tx: tokio::sync::mpsc::Sender<ToWriter>,
    task: tokio::task::JoinHandle<Result<u64, ImportError>>,
}

impl DirectWriter {
    fn spawn(store: &RunStore, k: usize) -> Self {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<ToWriter>(2);
        let mut w = store.part_writer(
            STAGED_CALLS,
            super::calls_schema(),
            &format!("part-imported-{k:03}"),
        );
        let task = tokio::spawn(async move {
            let mut rows = 0u64;
            while let Some(m) = rx.recv().await {
                match m {
                    ToWriter::Batch(b) => {
                        rows += b.num_rows() as u64;
                        w.write(b).await?;
                    }
                    ToWriter::Finish => {
                        w.finish().await?;
                        return Ok(rows);
                    }
                }
            }
            // Dropped without `Finish`: the import failed; commit nothing more.
            Ok(0)
        });
        DirectWriter { tx, task }
    }

    /// The task's outcome once its channel is closed.
    async fn join(self) -> Result<u64, ImportError> {
        drop(self.tx);
        self.task
            .await
            .map_err(|e| ImportError::Writer(e.to_string()))?
    }
}

/// Receives imported records in file order; see the module documentation.
pub struct ImportSink {
    store: RunStore,
    defaults: CaseDefaults,
    policy: Policy,
    /// The source files seen, in order (a record's `file_idx` is its position).
    files: Vec<String>,
    /// The `expected` of the last record pushed: a change within a case is staged too,
    /// for the conflict check.
    last_expected: Option<String>,
    /// Direct records of the batch being built, and their call ids.
    direct: Builders,
    direct_ids: StringBuilder,
    staged: Builders,
    cases: CaseBuilders,
    /// The case of the last record pushed.
    last_case: Option<Arc<str>>,
    sb: ScoreBuilders,
    writers: Vec<DirectWriter>,
    next_writer: usize,
    /// The ids scratch table's writers, one per [`ID_BUCKETS`] bucket.
    ids: Vec<PartWriter>,
    staging: Option<PartWriter>,
    case_staging: Option<PartWriter>,
    score_staging: Option<PartWriter>,
    /// The last chunks pushed, oldest first, whose keys rayon computes while the chunks
    /// before them are staged: a push stages the oldest once [`KEYED_AHEAD`] wait,
    /// [`Self::finish`] stages them all.
    pending: std::collections::VecDeque<Keyed>,
    /// Records pushed (staged or pending).
    pushed: u64,
    /// Records staged, so the next one's `seq`.
    next_seq: u64,
    /// Rows of the staged case fields.
    case_rows: u64,
    direct_rows: u64,
    staged_rows: u64,
    missing_samples: u64,
    /// Staged records' narrow keys, by bucket ([`numbering`]).
    narrow: Option<numbering::NarrowWriter>,
    /// Whether every file's records came after the previous file's (files read one after
    /// another), so a copy of an earlier file's record is one of a lower `seq`.
    files_in_order: bool,
    /// Records of a later file dropped as copies while numbering.
    copies_dropped: u64,
    /// The cases whose fields were staged lately ([`RecentCases`]).
    recent_cases: RecentCases,
    models: BTreeSet<String>,
    /// (tool, `<tool>-<scorer>`) of every imported score seen.
    tool_scorers: BTreeSet<(String, String)>,
}

const STAGING: &str = "_import/staging";
const CASE_STAGING: &str = "_import/cases";
const IDS: &str = "_import/ids";
const SCORE_STAGING: &str = "_import/scores";
/// Direct calls parts, renamed into `calls/` at the end.
const STAGED_CALLS: &str = "_import/calls";
/// Calls of staged records, with their `seq`.
const PLANNED_CALLS: &str = "_import/planned_calls";
/// Each case's first `seq` ([`firsts_schema`]).
const FIRSTS: &str = "_import/firsts";
/// Direct calls without their exact copies, when there were copies.
const DEDUP_CALLS: &str = "_import/dedup_calls";
/// Staged calls without their exact copies, when there were copies.
const DEDUP_PLANNED: &str = "_import/dedup_planned";

impl ImportSink {
    /// Starts an import into `store` (which must hold no run yet).
    pub async fn new(
        store: &RunStore,
        defaults: CaseDefaults,
        policy: Policy,
    ) -> Result<Self, ImportError> {
        // A crashed earlier attempt left staging behind: start clean.
        store.delete_dir("_import").await?;
        let scratch =
            |dir: &str, schema: SchemaRef| Some(store.part_writer(dir, schema, "stage").scratch());
        Ok(ImportSink {
            store: store.clone(),
            defaults,
            policy,
            files: Vec::new(),
            last_expected: None,
            direct: Builders::default(),
            direct_ids: StringBuilder::new(),
            staged: Builders::default(),
            cases: CaseBuilders::default(),
            last_case: None,
            sb: ScoreBuilders::default(),
            writers: (0..rayon::current_num_threads().max(1))
                .map(|k| DirectWriter::spawn(store, k))
                .collect(),
            next_writer: 0,
            ids: (0..ID_BUCKETS)
                .map(|b| {
                    store
                        .part_writer(IDS, ids_schema(), &format!("stage-b{b:x}"))
                        .scratch()
                        .with_part_rows(ID_BUCKET_PART_ROWS)
                })
                .collect(),
            staging: scratch(STAGING, staging_schema()),
            case_staging: scratch(CASE_STAGING, case_staging_schema()),
            score_staging: scratch(SCORE_STAGING, scores_staging_schema()),
            pending: Default::default(),
            pushed: 0,
            next_seq: 0,
            case_rows: 0,
            direct_rows: 0,
            staged_rows: 0,
            missing_samples: 0,
            narrow: Some(numbering::NarrowWriter::new(store)),
            files_in_order: true,
            copies_dropped: 0,
            recent_cases: RecentCases::default(),
            models: BTreeSet::new(),
            tool_scorers: BTreeSet::new(),
        })
    }

    /// Rows pushed so far.
    pub fn rows(&self) -> u64 {
        self.pushed
    }

    /// Adds records in their order. Their hashes (case id, request and response hash, call
    /// id: the costly part of staging) are computed on rayon's pool while the chunk pushed
    /// before them is staged, so the caller never waits for the pool: a caller that waited
    /// held back the parse feeding it, and both cores idled about a fifth of an import.
    pub async fn push_many(&mut self, records: Vec<Record>) -> Result<(), ImportError> {
        self.pushed += records.len() as u64;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let test = self.defaults.test.clone();
        rayon::spawn(move || {
            let keys = chunk_keys(&test, &records);
            let _ = tx.send((records, keys));
        });
        self.pending.push_back(rx);
        if self.pending.len() > KEYED_AHEAD {
            let oldest = self.pending.pop_front().expect("more than one pending");
            self.stage_pending(oldest).await?;
        }
        Ok(())
    }

    /// Stages a chunk once rayon has its keys.
    async fn stage_pending(&mut self, chunk: Keyed) -> Result<(), ImportError> {
        let (records, keys) = chunk.await.map_err(|_| {
            ImportError::Writer("the job hashing a chunk of records stopped".into())
        })?;
        for (r, k) in records.iter().zip(keys.iter().flatten()) {
            self.stage(r, k).await?;
        }
        Ok(())
    }

    /// Appends one record, with its keys, to the direct or staged batch (and its case's
    /// fields when its case is not the last record's); commits full batches.
    async fn stage(&mut self, r: &Record, k: &Keys) -> Result<(), ImportError> {
        let seq = self.next_seq;
        self.next_seq += 1;
        if !self.models.contains(&r.model) {
            self.models.insert(r.model.clone());
        }
        let file_idx = match self.files.iter().rposition(|f| *f == r.source.file) {
            Some(i) => i as u32,
            None => {
                self.files.push(r.source.file.clone());
                (self.files.len() - 1) as u32
            }
        };
        if (file_idx as usize) + 1 < self.files.len() {
            self.files_in_order = false;
        }
        let new_case = self.last_case.as_deref() != Some(&*k.case_id);
        // A case staged lately with the same `expected` and cluster adds nothing the
        // plans read (each case's first record, its expected answers, whether it names a
        // cluster): a log whose records of one case are spread over the file (shuffled
        // runs) would otherwise stage a case row, its input text included, per record.
        let seen = new_case
            && self
                .recent_cases
                .seen(&k.case_id, r.expected.as_deref(), r.cluster.as_deref());
        if seen {
            self.last_expected.clone_from(&r.expected);
            self.last_case = Some(k.case_id.clone());
        } else if new_case || r.expected != self.last_expected {
            self.last_expected.clone_from(&r.expected);
            self.recent_cases
                .remember(&k.case_id, r.expected.as_deref(), r.cluster.as_deref());
            let c = &mut self.cases;
            c.seq.append_value(seq);
            c.case_id.append_value(&k.case_id);
            c.test.append_value(&k.test);
            c.capability
                .append_value(r.capability.as_deref().unwrap_or(&self.defaults.capability));
            c.cluster.append_option(r.cluster.as_deref());
            c.input.append_value(&r.input);
            c.expected.append_option(r.expected.as_deref());
            c.source_file.append_value(&r.source.file);
            c.source_id.append_option(r.source.id.as_deref());
            c.rows += 1;
            self.case_rows += 1;
            self.last_case = Some(k.case_id.clone());
            if c.rows >= STAGE_ROWS {
                let batch = c.finish();
                if let Some(w) = self.case_staging.as_mut() {
                    w.write(batch).await?;
                }
            }
        }
        if let Some(id) = &k.call_id {
            self.direct.append(seq, r, k, file_idx);
            self.direct_ids.append_value(id);
            self.direct_rows += 1;
            if self.direct.rows >= STAGE_ROWS {
                self.send_direct().await?;
            }
            return Ok(());
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
        self.staged.append(seq, r, k, file_idx);
        self.staged_rows += 1;
        if r.sample_idx.is_none() {
            self.missing_samples += 1;
        }
        if self.staged.rows >= STAGE_ROWS {
            let batch = self.staged.finish();
            self.write_staged(batch).await?;
        }
        if self.sb.rows >= STAGE_ROWS {
            let batch = self.sb.finish();
            if let Some(w) = self.score_staging.as_mut() {
                w.write(batch).await?;
            }
        }
        Ok(())
    }

    /// Appends a staged batch to the staging table and its keys to the numbering buckets.
    async fn write_staged(&mut self, batch: RecordBatch) -> Result<(), ImportError> {
        if let Some(n) = self.narrow.as_mut() {
            n.write(&batch).await?;
        }
        if let Some(w) = self.staging.as_mut() {
            w.write(batch).await?;
        }
        Ok(())
    }

    /// Whether the staged records are numbered by [`numbering`] and become direct calls:
    /// every record lacks its sample index (none is given to count after) and has no
    /// imported score to join, and, when copies of an earlier file are to be dropped, the
    /// files came one after another.
    fn numbers_staged(&self) -> bool {
        self.staged_rows > 0
            && self.direct_rows == 0
            && self.tool_scorers.is_empty()
            && self.missing_samples == self.staged_rows
            && (self.files.len() <= 1 || self.policy.keep_duplicates || self.files_in_order)
    }

    /// Numbers the staged records ([`numbering`]) and sends them, in corpus order, to the
    /// direct writers with their call ids; see [`Self::numbers_staged`].
    async fn number_staged(&mut self) -> Result<(), ImportError> {
        use rayon::prelude::*;
        let drop_copies = self.files.len() > 1 && !self.policy.keep_duplicates;
        let t = std::time::Instant::now();
        self.copies_dropped = numbering::number_buckets(&self.store, drop_copies).await?;
        tracing::debug!(secs = t.elapsed().as_secs_f64(), "import: samples numbered");
        let mut merge = numbering::SampleMerge::open(&self.store).await?;
        let mut parts = self.store.list_parts(STAGING).await?;
        parts.sort_by(|x, y| x.location.cmp(&y.location));
        let mut sent = 0u64;
        for part in parts {
            let mut s = self.store.read_scratch(&part).await?;
            while let Some(b) = s.next().await {
                let b = b?;
                let seqs = b
                    .column(0)
                    .as_primitive::<datafusion::arrow::datatypes::UInt64Type>();
                let samples = merge.take(seqs.values()).await?;
                let arrow_err = |e: datafusion::arrow::error::ArrowError| {
                    ImportError::Writer(format!("numbering samples: {e}"))
                };
                let mut cols = b.columns().to_vec();
                cols[4] = Arc::new(samples.clone());
                let b = RecordBatch::try_new(b.schema(), cols).map_err(arrow_err)?;
                // A copy of an earlier file's record has no number: it is not a call.
                let b = if samples.null_count() > 0 {
                    let kept =
                        datafusion::arrow::compute::is_not_null(&samples).map_err(arrow_err)?;
                    datafusion::arrow::compute::filter_record_batch(&b, &kept).map_err(arrow_err)?
                } else {
                    b
                };
                let (case, model, sample, req) = (
                    b.column(1).as_string::<i32>(),
                    b.column(2).as_string::<i32>(),
                    b.column(4).as_primitive::<Int32Type>(),
                    b.column(5).as_string::<i32>(),
                );
                let ids: Vec<String> = (0..b.num_rows())
                    .into_par_iter()
                    .map(|i| {
                        call::call_id(case.value(i), model.value(i), sample.value(i), req.value(i))
                    })
                    .collect();
                let ids: ArrayRef = Arc::new(StringArray::from(ids));
                sent += b.num_rows() as u64;
                self.send_calls(b, ids).await?;
            }
        }
        debug_assert_eq!(sent + self.copies_dropped, self.staged_rows);
        // They are direct calls now: the plans see no staged record.
        self.direct_rows = sent;
        self.staged_rows = 0;
        self.missing_samples = 0;
        self.store.delete_scratch(numbering::NARROW).await?;
        self.store.delete_scratch(numbering::NUMBERED).await?;
        tracing::debug!(
            secs = t.elapsed().as_secs_f64(),
            calls = sent,
            "import: staged records numbered"
        );
        Ok(())
    }

    /// Hands the direct batch to the next writer task and stages its ids.
    async fn send_direct(&mut self) -> Result<(), ImportError> {
        let batch = self.direct.finish();
        let ids: ArrayRef = Arc::new(self.direct_ids.finish());
        self.send_calls(batch, ids).await
    }

    /// Hands a batch of numbered records ([`staging_schema`], with their call ids) to the
    /// next writer task and stages its ids.
    async fn send_calls(&mut self, batch: RecordBatch, ids: ArrayRef) -> Result<(), ImportError> {
        let calls = direct_calls(&batch, &ids)
            .map_err(|e| QueryError::df("import: direct calls batch")(e.into()))?;
        let fps = batch
            .column_by_name("fp")
            .expect("the staging schema has fp")
            .clone();
        let id_batch = RecordBatch::try_new(ids_schema(), vec![batch.column(0).clone(), ids, fps])
            .expect("ids batch matches its schema");
        for (b, rows) in id_buckets(&id_batch) {
            self.ids[b].write(rows).await?;
        }
        let k = self.next_writer;
        self.next_writer = (k + 1) % self.writers.len();
        if self.writers[k]
            .tx
            .send(ToWriter::Batch(calls))
            .await
            .is_err()
        {
            // The task stopped on an error: report it.
            let w = self.writers.remove(k);
            w.join().await?;
            return Err(ImportError::Writer("a calls writer stopped early".into()));
        }
        Ok(())
    }

    /// Stops the writer tasks without committing what they hold: the import failed and
    /// `_import/` is about to be deleted.
    pub async fn abort(self) {
        for w in self.writers {
            let _ = w.join().await;
        }
    }

    /// Runs the plans and commits `cases`, `calls` and the imported scores; see the
    /// module documentation.
    pub async fn finish(mut self) -> Result<ImportSummary, ImportError> {
        let t = std::time::Instant::now();
        let committed = self.commit_scratch().await;
        tracing::debug!(
            secs = t.elapsed().as_secs_f64(),
            "import: scratch committed"
        );
        let result = match committed {
            Ok(()) => self.plan().await,
            Err(e) => Err(e),
        };
        // Staging is scratch either way; a failed import leaves no table behind.
        let cleanup = self.store.delete_scratch("_import").await;
        if result.is_err() {
            self.store.delete_dir("cases").await?;
            self.store.delete_dir("calls").await?;
            self.store.delete_dir("scores").await?;
        }
        let summary = result?;
        cleanup?;
        Ok(summary)
    }

    /// Commits every buffered batch and waits for the writer tasks.
    async fn commit_scratch(&mut self) -> Result<(), ImportError> {
        let mut failed = None;
        while let Some(chunk) = self.pending.pop_front() {
            if let Err(e) = self.stage_pending(chunk).await {
                failed = Some(e);
                break;
            }
        }
        if failed.is_none() && self.direct.rows > 0 {
            failed = self.send_direct().await.err();
        }
        // The staging table and the numbering buckets are whole before they are read.
        if failed.is_none() && self.staged.rows > 0 {
            let batch = self.staged.finish();
            failed = self.write_staged(batch).await.err();
        }
        if failed.is_none() {
            failed = self.finish_staging().await.err();
        }
        if failed.is_none() && self.numbers_staged() {
            failed = self.number_staged().await.err();
        }
        // Every writer is joined, even after an error, so none puts a part once `_import/`
        // is deleted; after an error they are not told to commit what they hold.
        let mut written = 0;
        for w in std::mem::take(&mut self.writers) {
            if failed.is_none() {
                // A closed channel means the task stopped on an error, which `join` returns.
                let _ = w.tx.send(ToWriter::Finish).await;
            }
            match w.join().await {
                Ok(n) => written += n,
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        debug_assert_eq!(written, self.direct_rows);
        let batches = [
            (self.cases.rows > 0).then(|| self.cases.finish()),
            (self.sb.rows > 0).then(|| self.sb.finish()),
        ];
        let writers = [self.case_staging.take(), self.score_staging.take()];
        for (batch, w) in batches.into_iter().zip(writers) {
            if let Some(mut w) = w {
                if let Some(b) = batch {
                    w.write(b).await?;
                }
                w.finish().await?;
            }
        }
        for w in std::mem::take(&mut self.ids) {
            w.finish().await?;
        }
        Ok(())
    }

    /// Commits the staging table and the numbering buckets.
    async fn finish_staging(&mut self) -> Result<(), ImportError> {
        if let Some(w) = self.staging.take() {
            w.finish().await?;
        }
        if let Some(n) = self.narrow.take() {
            n.finish().await?;
        }
        Ok(())
    }

    async fn plan(&self) -> Result<ImportSummary, ImportError> {
        let ctx = new_context();
        self.store.register_with(&ctx);
        ctx.register_udf(call_id_udf());
        crate::query::register_parquet(&ctx, "cs", &self.store.table_url(CASE_STAGING)).await?;
        let (direct, staged) = (self.direct_rows > 0, self.staged_rows > 0);
        if direct {
            crate::query::register_parquet(&ctx, "direct", &self.store.table_url(STAGED_CALLS))
                .await?;
            crate::query::register_parquet(&ctx, "ids", &self.store.table_url(IDS)).await?;
        }
        let has_scores = !self.tool_scorers.is_empty();
        // Staged records' calls first, then the duplicate check on every call id, then
        // the commit.
        let mut calls = self.direct_rows;
        if staged {
            crate::query::register_parquet(&ctx, "st", &self.store.table_url(STAGING)).await?;
            calls += write_partitioned(
                &ctx,
                &self.calls_sql(direct),
                &self.store,
                PLANNED_CALLS,
                "part-imported-planned",
                staged_calls_schema(),
            )
            .await?;
            crate::query::register_parquet(
                &ctx,
                "staged_calls",
                &self.store.table_url(PLANNED_CALLS),
            )
            .await?;
        }
        // Records a cross-file copy check dropped before they were numbered.
        let mut duplicates = self.staged_rows + self.direct_rows - calls + self.copies_dropped;
        let t = std::time::Instant::now();
        let (direct_dups, staged_dups) = self.check_duplicates(&ctx, direct, staged).await?;
        tracing::debug!(secs = t.elapsed().as_secs_f64(), "import: duplicate check");
        // Exact copies of one call (the same record twice): keep one, in place of the
        // parts written, by a window that sorts (and spills) only on this path.
        duplicates += direct_dups + staged_dups;
        calls -= direct_dups + staged_dups;
        let cols: Vec<String> = super::calls_schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        let one_of_each = |table: &str, order: &str| {
            format!(
                "SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY call_id ORDER BY {order})                  AS evalflow_copy FROM \
                 {table}) WHERE evalflow_copy = 1"
            )
        };
        let direct_parts = if direct_dups > 0 {
            write_partitioned(
                &ctx,
                &format!(
                    "SELECT {} FROM ({})",
                    cols.join(", "),
                    one_of_each("direct", "source_file, source_id")
                ),
                &self.store,
                DEDUP_CALLS,
                "part-imported",
                super::calls_schema(),
            )
            .await?;
            ctx.deregister_table("direct")
                .map_err(QueryError::df("import: dropping copies"))?;
            crate::query::register_parquet(&ctx, "direct", &self.store.table_url(DEDUP_CALLS))
                .await?;
            DEDUP_CALLS
        } else {
            STAGED_CALLS
        };
        if staged_dups > 0 {
            let mut staged_cols = cols.clone();
            staged_cols.push("seq".into());
            staged_cols.push("fp".into());
            write_partitioned(
                &ctx,
                &format!(
                    "SELECT {} FROM ({})",
                    staged_cols.join(", "),
                    one_of_each("staged_calls", "seq")
                ),
                &self.store,
                DEDUP_PLANNED,
                "part-imported-planned",
                staged_calls_schema(),
            )
            .await?;
            ctx.deregister_table("staged_calls")
                .map_err(QueryError::df("import: dropping copies"))?;
            crate::query::register_parquet(
                &ctx,
                "staged_calls",
                &self.store.table_url(DEDUP_PLANNED),
            )
            .await?;
        }
        if self.policy.on_conflicting_expected == OnConflict::Refuse {
            self.check_expected(&ctx).await?;
        }
        let t = std::time::Instant::now();
        // Each case's first record, found slice by slice of the case ids (see
        // `query::id_slices`) so no aggregation holds every case.
        let passes = (self.case_rows as usize).div_ceil(pass_rows());
        let mut n_cases = 0;
        for (i, range) in id_slices("case_id", passes).iter().enumerate() {
            n_cases += write_partitioned(
                &ctx,
                &format!(
                    "SELECT min(seq) AS first_seq, bool_or(cluster IS NOT NULL) AS clustered, \
                     {expected} AS expected FROM cs WHERE {range} GROUP BY case_id",
                    expected = match self.policy.on_conflicting_expected {
                        OnConflict::Last => "last_value(expected ORDER BY CASE WHEN expected IS NULL THEN 0 ELSE 1 END, seq)",
                        _ => "first_value(expected ORDER BY CASE WHEN expected IS NULL THEN 1 ELSE 0 END, seq)",
                    }
                ),
                &self.store,
                FIRSTS,
                &format!("slice-{i:02}"),
                firsts_schema(),
            )
            .await?;
        }
        crate::query::register_parquet(&ctx, "firsts", &self.store.table_url(FIRSTS)).await?;
        let clustered: u64 =
            crate::query::text_rows(&ctx, "SELECT count(*) FROM firsts WHERE clustered")
                .await?
                .first()
                .and_then(|r| r[0].as_deref().and_then(|v| v.parse().ok()))
                .unwrap_or(0);
        if clustered == 0
            && let Some(field) = &self.policy.cluster
        {
            return Err(ImportError::NoCluster {
                field: field.clone(),
            });
        }
        // The join's build side is `firsts`: taken by ranges of `seq` (corpus order, so the
        // parts keep it), half a pass's ids at a time, it holds that many cases, not every
        // case (about 75 MB at 10M records, 1.25M cases).
        let passes = (n_cases as usize).div_ceil((pass_rows() / 2).max(1)).max(1) as u64;
        let step = self.next_seq.div_ceil(passes).max(1);
        let mut cases = 0;
        for i in 0..passes {
            cases += write_partitioned(
                &ctx,
                &self.cases_sql(i * step, (i + 1) * step),
                &self.store,
                "cases",
                &format!("part-imported-{i:02}"),
                Table::Cases.schema(),
            )
            .await?;
        }
        tracing::debug!(secs = t.elapsed().as_secs_f64(), "import: cases");
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
                    &scores_sql(tool, scorer, direct),
                    &self.store,
                    &dir,
                    "part-imported",
                    Table::Scores.schema(),
                )
                .await?;
                scores.push((format!("{scorer}@imported"), dir, n));
            }
        }
        if staged {
            // The staged records' calls without `seq`, in the declared columns.
            write_partitioned(
                &ctx,
                &format!("SELECT {} FROM staged_calls", cols.join(", ")),
                &self.store,
                "calls",
                "part-imported-planned",
                super::calls_schema(),
            )
            .await?;
        }
        let os = self.store.object_store();
        for p in self.store.list_parts(direct_parts).await? {
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
            clustered,
            calls,
            duplicates,
            models: self.models.iter().cloned().collect(),
            scores,
        })
    }

    /// The cases: each case's first record (the one with its lowest `seq`).
    ///
    /// Found by joining the staged case fields with each case's first `seq` (`firsts`,
    /// computed slice by slice of the case ids), not by a `GROUP BY case_id` of
    /// `first_value`s: the aggregate would hold every case's input text until its end
    /// (about 0.7 GB at 10M records); the join holds one integer per case whose first
    /// record is in `[from_seq, to_seq)`. The staging streams past the join in `seq` order,
    /// so each part
    /// lists its cases in the order the corpus names them, the order of the calls parts:
    /// a calls part's cases sit in a few Parquet pages of `cases`, and the score stage's
    /// join (which filters `cases` by the part's case ids while decoding) skips the rest.
    fn cases_sql(&self, from_seq: u64, to_seq: u64) -> String {
        let lit = |s: &str| format!("'{}'", s.replace('\'', "''"));
        let d = &self.defaults;
        format!(
            "SELECT cs.case_id, 'imported' AS suite, cs.test, cs.capability, {tt} AS test_type, \
             COALESCE(cs.cluster, cs.case_id) AS template_id, \
             cs.case_id AS group_id, {role} AS role, cs.input, f.expected, \
             CAST(NULL AS VARCHAR) AS expectation, CAST(NULL AS DOUBLE) AS tolerance, \
             CAST(NULL AS VARCHAR) AS perturbation \
             FROM firsts f JOIN cs ON cs.seq = f.first_seq \
             WHERE f.first_seq >= {from_seq} AND f.first_seq < {to_seq} \
             AND cs.seq >= {from_seq} AND cs.seq < {to_seq}",
            tt = lit(&d.test_type),
            role = lit(&d.role),
        )
    }

    /// The staged records' calls, with their `seq`. A record without a sample index takes
    /// the next after the highest index given for its (case, model), direct or staged.
    fn calls_sql(&self, with_direct: bool) -> String {
        // A record of a later file identical to one of an earlier file (the same file
        // twice, two copies of it) is dropped before the samples are numbered: the k-th
        // copy of a record in one file matches the k-th in another, so records repeated
        // within one file (samples that gave the same answer) stay. Only with files to
        // compare and records to number (the others are copies by call id).
        let st = if self.files.len() > 1 && self.missing_samples > 0 && !self.policy.keep_duplicates
        {
            "(SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY fp, evalflow_k ORDER BY \
             file_idx, seq) AS evalflow_first FROM (SELECT *, CASE WHEN given_sample_idx IS NULL \
             THEN row_number() OVER (PARTITION BY file_idx, fp ORDER BY seq) ELSE 0 END AS \
             evalflow_k FROM st)) WHERE evalflow_first = 1)"
        } else {
            "st"
        };
        // Without missing sample indices no window (and no sort) is needed.
        let source = if self.missing_samples == 0 {
            format!("SELECT *, given_sample_idx AS sample_idx FROM {st}")
        } else {
            let given = if with_direct {
                "SELECT case_id, model, sample_idx AS s FROM direct UNION ALL "
            } else {
                ""
            };
            format!(
                "SELECT st.*, COALESCE(st.given_sample_idx, CAST(COALESCE(g.base, 0) + \
                 row_number() OVER (PARTITION BY st.case_id, st.model, st.given_sample_idx IS NULL \
                 ORDER BY st.seq) - 1 AS INT)) AS sample_idx FROM {st} st LEFT JOIN \
                 (SELECT case_id, model, max(s) + 1 AS base FROM ({given}SELECT case_id, model, \
                  given_sample_idx AS s FROM st WHERE given_sample_idx IS NOT NULL) \
                  GROUP BY case_id, model) g \
                 ON st.case_id = g.case_id AND st.model = g.model"
            )
        };
        format!(
            "SELECT evalflow_call_id(case_id, model, sample_idx, request_hash) AS call_id, \
             case_id, model, provider, sample_idx, request_hash, response, \
             CAST(NULL AS DOUBLE) AS response_score, response_hash, finish_reason, \
             prompt_tokens, completion_tokens, reasoning_tokens, reasoning_chars, http_status, \
             error, attempts, latency_ms, max_tokens, temperature, started_at, \
             CAST(NULL AS BOOLEAN) AS retried_for_budget, CAST(NULL AS VARCHAR) AS batch_id, \
             source_format, source_file, source_id, seq, fp FROM ({source})"
        )
    }

    /// Fails on the first call id that two different records share, and counts the
    /// exact copies (records whose call id and [`Keys::fp`] are another's) of the direct
    /// and of the staged calls, which the caller drops.
    ///
    /// Call ids are hex digests, so their first two digits split them into 256 even slices; the
    /// check runs one `GROUP BY call_id` per range of slices, each over at most about
    /// [`pass_rows`] ids, so its hash table stays the same size whatever the
    /// corpus (one pass over all 10M ids held about 0.6 GB) for one more read of the
    /// ids per pass.
    async fn check_duplicates(
        &self,
        ctx: &SessionContext,
        direct: bool,
        staged: bool,
    ) -> Result<(u64, u64), ImportError> {
        let union = |cols: &str| {
            let mut from = Vec::new();
            if direct {
                from.push(format!(
                    "SELECT {cols} FROM {}",
                    if cols.contains("seq") {
                        "ids"
                    } else {
                        "direct"
                    }
                ));
            }
            if staged {
                from.push(format!("SELECT {cols} FROM staged_calls"));
            }
            from.join(" UNION ALL ")
        };
        let ids = union("call_id, seq, fp");
        let passes = (self.rows() as usize).div_ceil(pass_rows());
        let mut id = None;
        let (mut direct_dups, mut staged_dups) = (0u64, 0u64);
        // Each call id's records (of the direct and of the staged calls) and whether their
        // fingerprints differ, in one scan per slice. `min(fp) <> max(fp)`, not
        // `count(DISTINCT fp) > 1`: DataFusion's grouped distinct count keeps a hash set per
        // group, row by row (1M ids: 22 s and 1.1 GB, against under a second).
        let mut tagged = Vec::new();
        if direct {
            tagged.push("SELECT call_id, fp, 1 AS d FROM ids");
        }
        if staged {
            tagged.push("SELECT call_id, fp, 0 AS d FROM staged_calls");
        }
        let tagged = tagged.join(" UNION ALL ");
        for range in id_slices("call_id", passes) {
            let sql = format!(
                "SELECT max(CASE WHEN n > 1 AND differ THEN call_id END), \
                 sum(CASE WHEN nd > 1 THEN nd - 1 ELSE 0 END), \
                 sum(CASE WHEN n - nd > 1 THEN n - nd - 1 ELSE 0 END) \
                 FROM (SELECT call_id, count(*) AS n, min(fp) <> max(fp) AS differ, sum(d) AS nd \
                 FROM ({tagged}) WHERE {range} GROUP BY call_id HAVING count(*) > 1)"
            );
            let rows = crate::query::text_rows(ctx, &sql).await?;
            let cell = |c: usize| -> u64 {
                rows.first()
                    .and_then(|r| r[c].as_deref())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            id = rows.first().and_then(|r| r[0].clone());
            if id.is_some() {
                break;
            }
            direct_dups += cell(1);
            staged_dups += cell(2);
        }
        let Some(id) = id else {
            return Ok((direct_dups, staged_dups));
        };
        // Name the two records: a failure path, so more scans are fine.
        let seqs = crate::query::text_rows(
            ctx,
            &format!("SELECT seq FROM ({ids}) WHERE call_id = '{id}' ORDER BY seq"),
        )
        .await?;
        let call = crate::query::text_rows(
            ctx,
            &format!(
                "SELECT k.model, k.sample_idx, k.source_file, cs.input FROM ({}) k \
                 JOIN cs ON k.case_id = cs.case_id WHERE k.call_id = '{id}' LIMIT 1",
                union("call_id, case_id, model, sample_idx, source_file")
            ),
        )
        .await?;
        let get = |c: usize| call.first().and_then(|r| r[c].clone()).unwrap_or_default();
        let seq = |r: Option<&Vec<Option<String>>>| {
            r.and_then(|r| r[0].as_deref())
                .and_then(|s| s.parse::<u64>().ok())
                .map_or(0, |s| s + 1)
        };
        Err(ImportError::Duplicate {
            source_name: get(2),
            input: get(3),
            model: get(0),
            sample_idx: get(1).parse().unwrap_or(0),
            first: seq(seqs.first()),
            second: seq(seqs.last()),
        })
    }

    /// Fails on the first case whose records give two different `expected` answers,
    /// naming both records (`file:line`), slice by slice of the case ids as the first
    /// record search does.
    async fn check_expected(&self, ctx: &SessionContext) -> Result<(), ImportError> {
        let passes = (self.case_rows as usize).div_ceil(pass_rows());
        for range in id_slices("case_id", passes) {
            let rows = crate::query::text_rows(
                ctx,
                &format!(
                    "SELECT case_id FROM cs WHERE {range} AND expected IS NOT NULL \
                     GROUP BY case_id HAVING min(expected) <> max(expected) LIMIT 1"
                ),
            )
            .await?;
            let Some(id) = rows.first().and_then(|r| r[0].clone()) else {
                continue;
            };
            let recs = crate::query::text_rows(
                ctx,
                &format!(
                    "SELECT source_file, source_id, expected, input FROM cs \
                     WHERE case_id = '{id}' AND expected IS NOT NULL ORDER BY seq"
                ),
            )
            .await?;
            let at = |r: &Vec<Option<String>>| {
                format!(
                    "{}:{}",
                    r[0].as_deref().unwrap_or(""),
                    r[1].as_deref().unwrap_or("?")
                )
            };
            let first = &recs[0];
            let second = recs
                .iter()
                .find(|r| r[2] != first[2])
                .expect("two distinct expected answers");
            return Err(ImportError::ConflictingExpected {
                first_at: at(first),
                second_at: at(second),
                input: first[3].clone().unwrap_or_default(),
                first: first[2].clone().unwrap_or_default(),
                second: second[2].clone().unwrap_or_default(),
            });
        }
        Ok(())
    }
}

/// The keys of a chunk's records, in order, by slices of 256 records (each slice's keys
/// written in place, not gathered into one vector). Records of one case (its samples, its
/// models) usually sit together: each slice reuses the previous record's hashes when its
/// case or request is the same.
fn chunk_keys(test: &Option<String>, records: &[Record]) -> Vec<Vec<Keys>> {
    use rayon::prelude::*;
    records
        .par_chunks(256)
        .map(|chunk| {
            let mut out: Vec<Keys> = Vec::with_capacity(chunk.len());
            for (i, r) in chunk.iter().enumerate() {
                let k = match i.checked_sub(1) {
                    Some(p) => keys_after(test, r, &chunk[p], &out[p]),
                    None => keys(test, r),
                };
                out.push(k);
            }
            out
        })
        .collect()
}

/// [`keys`] of `r`, reusing those of the record before it (`p`, whose keys are `pk`) where
/// the inputs are the same.
fn keys_after(test: &Option<String>, r: &Record, p: &Record, pk: &Keys) -> Keys {
    let same_case =
        r.test == p.test && r.case_key == p.case_key && r.system == p.system && r.input == p.input;
    if !same_case {
        return keys(test, r);
    }
    let request_hash = if r.request_key == p.request_key {
        pk.request_hash.clone()
    } else {
        call::sha_prefix(&[&r.request_key], 32).into()
    };
    let response_hash = call::response_hash(r.response.as_deref());
    Keys {
        test: pk.test.clone(),
        call_id: direct_call_id(r, &pk.case_id, &request_hash),
        fp: fingerprint(r, &pk.case_id, &request_hash, response_hash.as_deref()),
        case_id: pk.case_id.clone(),
        request_hash,
        response_hash,
    }
}

/// [`Keys::fp`]: the case, model, request and answer of a record and every fact recorded
/// about its call, but not its provenance (file, line).
///
/// The digest of [`call::sha_prefix`] over the parts and the facts' `Debug` text
/// ([`fingerprint_reference`]), with that text written straight into the hasher: the same
/// bytes, no `String` formatted per record.
fn fingerprint(
    r: &Record,
    case_id: &str,
    request_hash: &str,
    response_hash: Option<&str>,
) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for p in [case_id, &r.model, request_hash, response_hash.unwrap_or("")] {
        h.update(p.as_bytes());
        h.update([0u8]);
    }
    let mut w = DebugInto(&mut h);
    w.raw("(");
    w.int(r.sample_idx.map(i64::from));
    w.raw(", ");
    w.text(r.finish_reason.as_deref());
    for x in [
        r.prompt_tokens,
        r.completion_tokens,
        r.reasoning_tokens,
        r.reasoning_chars,
        r.http_status.map(i64::from),
    ] {
        w.raw(", ");
        w.int(x);
    }
    w.raw(", ");
    w.text(r.error.as_deref());
    w.raw(")|(");
    w.int(r.attempts.map(i64::from));
    w.raw(", ");
    w.debug(&r.latency_ms);
    w.raw(", ");
    w.int(r.started_at_us);
    w.raw(", ");
    w.text(r.expected.as_deref());
    w.raw(", ");
    w.text(r.provider.as_deref());
    w.raw(", ");
    if r.scores.is_empty() {
        w.raw("[]");
    } else {
        w.debug(&r.scores);
    }
    w.raw(if response_hash.is_some() {
        ", true)"
    } else {
        ", false)"
    });
    h.update([0u8]);
    let digest = h.finalize();
    let mut out = [0u8; 24];
    hex::encode_to_slice(&digest[..12], &mut out).expect("24 hex digits fit");
    String::from_utf8(out.to_vec()).expect("hex digits are ASCII")
}

/// Writes `Debug` text of the fingerprint's facts into a hasher: integers and plain text
/// by hand, anything else through `fmt`.
struct DebugInto<'a>(&'a mut sha2::Sha256);

impl std::fmt::Write for DebugInto<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        sha2::Digest::update(self.0, s.as_bytes());
        Ok(())
    }
}

impl DebugInto<'_> {
    fn raw(&mut self, s: &str) {
        sha2::Digest::update(self.0, s.as_bytes());
    }

    fn debug<T: std::fmt::Debug>(&mut self, x: &T) {
        use std::fmt::Write;
        write!(self, "{x:?}").expect("a hasher takes any text");
    }

    /// `Some(n)` or `None`, as `Option<i32>` and `Option<i64>` print.
    fn int(&mut self, x: Option<i64>) {
        match x {
            None => self.raw("None"),
            Some(n) => {
                let mut buf = [0u8; 20];
                let mut i = buf.len();
                let mut m = n.unsigned_abs();
                loop {
                    i -= 1;
                    buf[i] = b'0' + (m % 10) as u8;
                    m /= 10;
                    if m == 0 {
                        break;
                    }
                }
                self.raw("Some(");
                if n < 0 {
                    self.raw("-");
                }
                sha2::Digest::update(self.0, &buf[i..]);
                self.raw(")");
            }
        }
    }

    /// `Some("...")` or `None`, as `Option<String>` prints: text of printable ASCII with no
    /// quote or backslash as it is, anything else escaped by `fmt`.
    fn text(&mut self, x: Option<&str>) {
        match x {
            None => self.raw("None"),
            Some(s)
                if s.bytes()
                    .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\') =>
            {
                self.raw("Some(\"");
                self.raw(s);
                self.raw("\")");
            }
            Some(s) => {
                self.raw("Some(");
                self.debug(&s);
                self.raw(")");
            }
        }
    }
}

/// [`fingerprint`] as it was first written, which it must equal byte for byte (archived
/// runs' fingerprints decide which records of a later import are copies).
#[cfg(test)]
fn fingerprint_reference(
    r: &Record,
    case_id: &str,
    request_hash: &str,
    response_hash: Option<&str>,
) -> String {
    let facts = format!(
        "{:?}|{:?}",
        (
            r.sample_idx,
            &r.finish_reason,
            r.prompt_tokens,
            r.completion_tokens,
            r.reasoning_tokens,
            r.reasoning_chars,
            r.http_status,
            &r.error,
        ),
        (
            r.attempts,
            r.latency_ms,
            r.started_at_us,
            &r.expected,
            &r.provider,
            &r.scores,
            response_hash.is_some(),
        )
    );
    call::sha_prefix(
        &[
            case_id,
            &r.model,
            request_hash,
            response_hash.unwrap_or(""),
            &facts,
        ],
        24,
    )
}

/// A record's test (`test`, the `--test` default, over the record's own), case id, hashes
/// and (direct records) call id.
fn keys(test: &Option<String>, r: &Record) -> Keys {
    let test: Arc<str> = test
        .as_deref()
        .or(r.test.as_deref())
        .unwrap_or("imported")
        .into();
    // One case per (test, the source's case id) where the source has one, else per
    // (test, system, input).
    let case_id = match &r.case_key {
        Some(k) => call::sha_prefix(&["imported", &test, &format!("\u{0}{k}"), ""], 24),
        None => call::sha_prefix(
            &[
                "imported",
                &test,
                r.system.as_deref().unwrap_or(""),
                &r.input,
            ],
            24,
        ),
    };
    let request_hash: Arc<str> = call::sha_prefix(&[&r.request_key], 32).into();
    let case_id: Arc<str> = case_id.into();
    let response_hash = call::response_hash(r.response.as_deref());
    Keys {
        call_id: direct_call_id(r, &case_id, &request_hash),
        fp: fingerprint(r, &case_id, &request_hash, response_hash.as_deref()),
        response_hash,
        request_hash,
        test,
        case_id,
    }
}

/// Buckets of the ids scratch table, by the first hex digit of the call id. Each part
/// holds one bucket, so its row groups' statistics span 1/16 of the ids, and a pass of the
/// duplicate check (a range of ids, [`id_slices`]) reads the one or two buckets it
/// overlaps, not every id: at 10M records its 20 passes read about twice the ids in all,
/// not 20 times.
const ID_BUCKETS: usize = 16;

/// Rows per part of a bucket's writer: the 16 writers buffer about 23 MB in all.
const ID_BUCKET_PART_ROWS: usize = 32_768;

/// An ids batch ([`ids_schema`]) split by [`ID_BUCKETS`] bucket, rows in order.
fn id_buckets(batch: &RecordBatch) -> Vec<(usize, RecordBatch)> {
    let ids = batch.column(1).as_string::<i32>();
    let mut rows: Vec<Vec<u32>> = vec![Vec::new(); ID_BUCKETS];
    for (i, id) in ids.iter().enumerate() {
        let first = id.and_then(|s| s.chars().next());
        let b = first.and_then(|c| c.to_digit(16)).unwrap_or(0) as usize;
        rows[b].push(i as u32);
    }
    rows.into_iter()
        .enumerate()
        .filter(|(_, r)| !r.is_empty())
        .map(|(b, r)| {
            let taken = datafusion::arrow::compute::take_record_batch(
                batch,
                &datafusion::arrow::array::UInt32Array::from(r),
            )
            .expect("indices within the batch");
            (b, taken)
        })
        .collect()
}

/// The call id of a record that can go straight to `calls` (it names its sample and has
/// no imported scores to join), else `None`.
fn direct_call_id(r: &Record, case_id: &str, request_hash: &str) -> Option<String> {
    match r.sample_idx {
        Some(s) if r.scores.is_empty() => Some(call::call_id(case_id, &r.model, s, request_hash)),
        _ => None,
    }
}

/// Ids one pass of a `GROUP BY` over call or case ids (the duplicate check, each case's
/// first record) takes at most, the same at any corpus size. With 1M, the duplicate check
/// of a 10M-record import peaked about 80 MB above a 1M-record one (an import's peak);
/// with 500k it stays under the streaming phase's, for about 1 s more of its 40.
/// `EVALFLOW_IMPORT_PASS_ROWS` sets another (tests use a small one to run many passes).
fn pass_rows() -> usize {
    std::env::var("EVALFLOW_IMPORT_PASS_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(500_000)
}

/// Each case's first `seq`, and whether a record of it named a cluster.
fn firsts_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("first_seq", DataType::UInt64, true),
        Field::new("clustered", DataType::Boolean, true),
        Field::new("expected", DataType::Utf8, true),
    ]))
}

/// The staged calls: an imported calls table plus the record's `seq`.
fn staged_calls_schema() -> SchemaRef {
    let mut fields: Vec<Field> = super::calls_schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    fields.push(Field::new("seq", DataType::UInt64, false));
    fields.push(Field::new("fp", DataType::Utf8, false));
    Arc::new(Schema::new(fields))
}
/// One imported scores version: a row for every call of the tool (NULL where the tool did
/// not score it), with the case's fields as the scores table carries them.
///
/// The tool's records with no score of their own went straight to `calls` (no `seq` to
/// join on): they are in the version with a NULL score.
fn scores_sql(tool: &str, scorer: &str, with_direct: bool) -> String {
    let lit = |s: &str| format!("'{}'", s.replace('\'', "''"));
    let cols = "call_id, case_id, model, sample_idx, response_hash, error, http_status, \
                source_format";
    let calls = if with_direct {
        format!(
            "(SELECT {cols}, seq FROM staged_calls UNION ALL \
             SELECT {cols}, CAST(NULL AS BIGINT UNSIGNED) AS seq FROM direct)"
        )
    } else {
        "staged_calls".to_string()
    };
    format!(
        "SELECT k.call_id, k.case_id, k.model, k.sample_idx, {scorer} AS scorer, \
         'imported' AS scoring_version, k.response_hash, \
         CASE WHEN k.error IS NOT NULL OR (k.http_status IS NOT NULL AND \
         (k.http_status < 200 OR k.http_status > 299)) THEN 'provider_error' \
         ELSE 'valid_answer' END AS validity, \
         s.score, s.label, CAST(NULL AS DOUBLE) AS prob, s.passed, s.detail, NULL AS answers, \
         c.test, c.capability, c.test_type, c.role, c.template_id \
         FROM {calls} k JOIN imported_cases c ON k.case_id = c.case_id \
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
    prefix: &str,
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
        let (store, schema, dir, what, prefix) = (
            store.clone(),
            schema.clone(),
            dir.to_string(),
            what.clone(),
            prefix.to_string(),
        );
        tasks.push(tokio::spawn(async move {
            let mut w = store.part_writer(&dir, schema.clone(), &format!("{prefix}-{k:03}"));
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
    use super::*;
    use datafusion::arrow::array::UInt64Array;

    /// The fingerprint hashed field by field is the `Debug` text's digest, byte for byte:
    /// empty, full, negative and extreme numbers, text with quotes, escapes, control
    /// characters, unicode (printable, combining, bidi, non-printable), imported scores.
    #[test]
    fn fingerprints_are_the_reference_fingerprints() {
        use crate::import::ImportedScore;
        let texts = [
            "",
            "stop",
            "plain text, with: punctuation! ~ {} [] <>",
            "say \"hi\"",
            "back\\slash",
            "line\nbreak\ttab\r",
            "nul \u{0} bell \u{7} del \u{7f}",
            "中文回答",
            "e\u{301} combining",
            "\u{301}starts combining",
            "bidi \u{202e} zero width \u{200b} bom \u{feff}",
            "emoji 😀 and é",
            "'single'",
        ];
        let mut records = vec![Record::default()];
        for (i, t) in texts.iter().enumerate() {
            let some = |k: usize| (!(i + k).is_multiple_of(3)).then(|| t.to_string());
            let num =
                |k: i64| ((i as i64 + k) % 4 != 0).then_some((k - 2) * 10i64.pow(i as u32 % 19));
            records.push(Record {
                model: format!("model-{t}"),
                sample_idx: (i % 2 == 0).then_some(i as i32 * 1000),
                finish_reason: some(0),
                prompt_tokens: num(1),
                completion_tokens: num(2),
                reasoning_tokens: num(3).map(|x| -x),
                reasoning_chars: Some(i64::MIN + i as i64),
                http_status: Some(if i % 2 == 0 { 200 } else { -1 }),
                error: some(1),
                attempts: (i % 3 == 0).then_some(i32::MAX),
                latency_ms: [
                    None,
                    Some(0.0),
                    Some(12.5),
                    Some(1e21),
                    Some(1e-7),
                    Some(-0.0),
                ]
                .get(i % 6)
                .copied()
                .flatten(),
                started_at_us: Some(1_700_000_000_000_000 + i as i64),
                expected: some(2),
                provider: some(0),
                scores: if i % 4 == 1 {
                    vec![ImportedScore {
                        scorer: t.to_string(),
                        score: Some(0.5),
                        label: some(1),
                        passed: Some(true),
                        detail: some(2),
                    }]
                } else {
                    vec![]
                },
                ..Record::default()
            });
        }
        for (i, r) in records.iter().enumerate() {
            for rh in [None, Some("0123456789abcdef01234567")] {
                assert_eq!(
                    fingerprint(r, "case", "req", rh),
                    fingerprint_reference(r, "case", "req", rh),
                    "record {i}"
                );
            }
        }
    }

    #[test]
    fn id_buckets_split_a_batch_by_first_hex_digit_keeping_every_row_in_order() {
        let ids = ["a1", "03", "ff", "a0", "0b", "5c", "a2"];
        let batch = RecordBatch::try_new(
            ids_schema(),
            vec![
                Arc::new(UInt64Array::from_iter_values(0..ids.len() as u64)),
                Arc::new(StringArray::from_iter_values(ids)),
                Arc::new(StringArray::from_iter_values(
                    ids.iter().map(|i| format!("fp{i}")),
                )),
            ],
        )
        .unwrap();
        let got: Vec<(usize, Vec<u64>, Vec<String>)> = id_buckets(&batch)
            .into_iter()
            .map(|(b, rows)| {
                let seq = rows
                    .column(0)
                    .as_primitive::<datafusion::arrow::datatypes::UInt64Type>();
                let id = rows.column(1).as_string::<i32>();
                (
                    b,
                    seq.values().to_vec(),
                    id.iter().map(|s| s.unwrap().to_string()).collect(),
                )
            })
            .collect();
        let want = vec![
            (0, vec![1, 4], vec!["03".to_string(), "0b".into()]),
            (5, vec![5], vec!["5c".into()]),
            (
                10,
                vec![0, 3, 6],
                vec!["a1".into(), "a0".into(), "a2".into()],
            ),
            (15, vec![2], vec!["ff".into()]),
        ];
        assert_eq!(got, want);
    }
}
