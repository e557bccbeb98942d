//! Score: turns valid answers into verdicts, one row per call per scorer version.
//!
//! An invalid row is never scored: its score is NULL and it keeps its validity, so a
//! class of failed calls can never pad a label. Every row carries the scorer, its version
//! and the response hash, so any number can be traced to the rules that made it.
//! Re-scoring writes `scores/<scorer>@<version>/` beside older versions, never over them.

pub mod checklist;
pub mod coverage;
pub mod cue;
pub mod judge;
pub mod sql_check;
pub mod user;

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, BooleanBuilder, Float64Array, Int32Array, ListBuilder,
    RecordBatch, StringArray,
};
use futures::{StreamExt, TryStreamExt};
use sha2::{Digest, Sha256};

use crate::query::{QueryError, new_context, register_run};
use crate::schema::Table;
use crate::storage::{PipelinedEncoder, RunStore, StorageError};
use checklist::{Answer, normalise_label};

pub use crate::config::ScorerId;

/// What a scorer's scores measure, and so what `aggregate` reports of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// `passed` is the verdict (checklist): the failure rate.
    PassFail,
    /// `label` is the verdict (cue): the rate of each label.
    Label,
    /// `score` is the measurement (judge): the mean score.
    Numeric,
}

impl MetricKind {
    /// The kind of the scorer named `name` (scores tables name their scorer, so a run of any
    /// age is aggregated by the kind of its scorer). Unknown names are numeric: the mean of
    /// `score` is defined for any scorer.
    pub fn of(name: &str) -> MetricKind {
        match name {
            "checklist" => MetricKind::PassFail,
            "cue" => MetricKind::Label,
            _ => MetricKind::Numeric,
        }
    }

    /// The `metric` column of `results`.
    pub fn metric(self) -> &'static str {
        match self {
            MetricKind::PassFail => "failure_rate",
            MetricKind::Label => "label_rate",
            MetricKind::Numeric => "mean_score",
        }
    }

    /// The kind whose [`MetricKind::metric`] is `m`.
    pub fn from_metric(m: &str) -> MetricKind {
        match m {
            "failure_rate" => MetricKind::PassFail,
            "label_rate" => MetricKind::Label,
            _ => MetricKind::Numeric,
        }
    }
}

/// Whether the scorer named `name` scores a perturbed case against its base case, so that
/// a valid perturbed answer is left unscored when the base answer is invalid.
pub fn compares_to_base(name: &str) -> bool {
    name == "checklist"
}

/// The answer languages the scorer named `name` reads (`validate` marks answers in other
/// languages `unscorable_language`). The cue scorer has cue lists for English and Chinese;
/// the checklist's label matching and the judge's questions are English.
pub fn languages_of(name: &str) -> &'static [&'static str] {
    builtin_languages(name).unwrap_or(&["en"])
}

/// The languages a built-in scorer reads; `None` for any other name (a user scorer reads
/// whatever validate accepted: its author chose the languages).
pub fn builtin_languages(name: &str) -> Option<&'static [&'static str]> {
    match name {
        "cue" => Some(&["en", "zh"]),
        "checklist" | "judge" => Some(&["en"]),
        _ => None,
    }
}

/// Whether a scorer reading `languages` reads an answer tagged `language`: one of them,
/// `und` (no letters, or accepted as such by validate), or `mixed` Chinese and English
/// when it reads both.
pub fn reads_language(languages: &[&str], language: &str) -> bool {
    languages.contains(&language)
        || language == "und"
        || (language == "mixed" && languages.contains(&"en") && languages.contains(&"zh"))
}

/// Whether `scorer` scores a valid answer in `language`.
fn readable(scorer: &dyn Scorer, language: Option<&str>) -> bool {
    match (scorer.languages(), language) {
        (Some(langs), Some(l)) => reads_language(langs, l),
        _ => true,
    }
}

/// Every language some built-in scorer reads: the default of `import`, whose scorers are
/// chosen later.
pub const ALL_LANGUAGES: &[&str] = &["en", "zh"];

/// The verdicts a judge scorer adds to the validator's six: its answer could not be parsed,
/// or its own call failed.
pub const JUDGE_VERDICTS: [&str; 2] = ["judge_unparseable", "judge_error"];

/// What a scorer sees of one valid call.
#[derive(Debug, Clone, Copy)]
pub struct ScoreInput<'a> {
    pub call_id: &'a str,
    pub input: &'a str,
    pub response: &'a str,
    pub response_score: Option<f64>,
    pub language: &'a str,
    pub test_type: &'a str,
    pub role: &'a str,
    pub expected: Option<&'a str>,
    pub expectation: Option<&'a str>,
    pub tolerance: Option<f64>,
}

/// A scorer's verdict on one valid call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    pub score: Option<f64>,
    pub label: Option<String>,
    pub prob: Option<f64>,
    pub passed: Option<bool>,
    pub detail: serde_json::Value,
    pub answers: Option<Vec<bool>>,
    /// Set when the answer cannot be scored after all (e.g. an unparseable judge answer):
    /// the row gets this validity and a NULL score, never a default verdict.
    pub invalid: Option<&'static str>,
}

/// The base answer of a perturbed case's group, or why there is none.
pub type BaseAnswer = Result<Answer, String>;

/// A versioned scorer.
pub trait Scorer: Send + Sync {
    fn id(&self) -> ScorerId;
    /// The text its behaviour depends on (its source and cue lists), hashed into the
    /// version lock so a logic change without a version bump fails a test.
    fn logic(&self) -> Vec<String>;
    /// Whether perturbed cases are compared with their base case (INV / DIR).
    fn compares_to_base(&self) -> bool {
        false
    }
    fn score(&self, row: &ScoreInput, base: Option<&BaseAnswer>) -> Outcome;
    /// Scores the valid answers of a joined batch (the rows where `valid` is true) at once,
    /// one outcome per valid row in order (a SQL scorer evaluates its expressions as
    /// vectors); `None` scores row by row with [`Scorer::score`]. `Err` names what failed.
    fn score_valid(
        &self,
        _batch: &RecordBatch,
        _valid: &BooleanArray,
    ) -> Option<Result<Vec<Outcome>, String>> {
        None
    }
    /// Whether [`Scorer::score_valid`] scores batches (so the valid rows are gathered for
    /// it; a row-by-row scorer pays nothing for this).
    fn scores_batches(&self) -> bool {
        false
    }
    /// What its scores measure: a built-in scorer's kind follows its name, a user scorer
    /// declares it.
    fn metric_kind(&self) -> MetricKind {
        MetricKind::of(&self.id().name)
    }
    /// A user scorer's definition, recorded beside its scores as `scorer.json` (so the
    /// scores of any age are aggregated by their declared metric).
    fn definition(&self) -> Option<serde_json::Value> {
        None
    }
    /// The answer languages it reads (`None`: every language validate accepted). A valid
    /// answer in another language is `unscorable_language` for this scorer, never a
    /// failure: validate accepts the union of the run's scorers' languages, so the cue
    /// scorer's Chinese answers are not the checklist's failures.
    fn languages(&self) -> Option<&'static [&'static str]> {
        builtin_languages(&self.id().name)
    }
    /// The scorer of one calls `part` of `run`, for a scorer whose inputs are read part by
    /// part rather than held for the whole run (a judge's replies: those of the part's
    /// calls only). The driver asks before it scores the part, and scores the part with the
    /// answer; `None` (the default) scores it with `self`.
    ///
    /// # Errors
    /// A query or storage failure reading the part's inputs.
    fn for_part<'a>(
        &'a self,
        _run: &'a RunStore,
        _part: &'a object_store::ObjectMeta,
    ) -> PartScorer<'a> {
        Box::pin(futures::future::ready(Ok(None)))
    }
}

/// What [`Scorer::for_part`] answers: the scorer of one calls part, or `None` for the
/// scorer itself.
pub type PartScorer<'a> =
    futures::future::BoxFuture<'a, Result<Option<Box<dyn Scorer>>, QueryError>>;

/// A stable hash of a scorer's logic.
pub fn logic_hash(s: &dyn Scorer) -> String {
    let mut h = Sha256::new();
    for part in s.logic() {
        h.update(part.as_bytes());
        h.update([0u8]);
    }
    hex::encode(h.finalize())[..16].to_string()
}

/// The part of a source file that is logic (everything before its unit tests).
pub fn source_logic(src: &str) -> String {
    src.split("#[cfg(test)]").next().unwrap_or(src).to_string()
}

/// A user scorer's [`DefError`](user::DefError) as a message that
/// names only what is known: no `:0` line, no "scorer `?`" or "field `?`" (the scorer
/// engine's own Display is part of its versioned logic, so the wording is made here).
pub fn def_message(e: &user::DefError) -> String {
    let named = |what: &str, name: &str| {
        if name.is_empty() || name == "?" {
            String::new()
        } else {
            format!("{what} `{name}`: ")
        }
    };
    format!(
        "{}: {}{}{}",
        crate::config::at(&e.file, e.line),
        named("scorer", &e.scorer),
        named("field", &e.field),
        e.msg
    )
}

/// Errors choosing or configuring a scorer.
#[derive(Debug, thiserror::Error)]
pub enum ScorerError {
    #[error("unknown scorer `{0}` (known: {1})")]
    Unknown(String, String),
    #[error(
        "scorer `{spec}`: this build has version {have}; a scores folder of another version can be read but not re-made"
    )]
    Version { spec: String, have: String },
    #[error("{file}: {msg}")]
    Cues { file: String, msg: String },
    #[error("scorer `{spec}`: {msg}")]
    Judge { spec: String, msg: String },
    /// A user scorer's definition is bad (names file, line and field).
    #[error("{}", def_message(.0))]
    Definition(Box<user::DefError>),
    /// The judge's own calls failed while preparing its answers: bad input only when the
    /// cause is (its model cannot be built, a query over the memory limit).
    #[error("scorer `{spec}`: preparing the judge's answers: {msg}")]
    JudgeCalls {
        spec: String,
        msg: String,
        bad_input: bool,
    },
}

impl ScorerError {
    /// The judge's preparation failed with `e`.
    pub fn judge_calls(spec: &str, e: &crate::stages::call::CallError) -> Self {
        ScorerError::JudgeCalls {
            spec: spec.to_string(),
            msg: e.to_string(),
            bad_input: e.is_bad_input(),
        }
    }
}

impl From<user::DefError> for ScorerError {
    fn from(e: user::DefError) -> Self {
        ScorerError::Definition(Box::new(e))
    }
}

impl ScorerError {
    /// Whether the error is the user's input (exit 2) rather than a failure (exit 3).
    pub fn is_bad_input(&self) -> bool {
        match self {
            ScorerError::JudgeCalls { bad_input, .. } => *bad_input,
            _ => true,
        }
    }
}

/// The file beside a user scorer's parts that holds its definition and metric.
pub const DEFINITION_FILE: &str = "scorer.json";

/// The definition recorded beside the scores of `id` (user scorers only).
pub async fn recorded_definition(
    store: &RunStore,
    id: &ScorerId,
) -> Result<Option<serde_json::Value>, crate::storage::StorageError> {
    let Some(bytes) = store
        .get(&format!("{}/{DEFINITION_FILE}", id.dir()))
        .await?
    else {
        return Ok(None);
    };
    Ok(serde_json::from_slice(&bytes).ok())
}

/// The metric kind of the scores of `id`: the one its definition declares when one is
/// recorded beside them (user scorers), else the built-in scorer's ([`MetricKind::of`]).
pub async fn metric_kind(
    store: &RunStore,
    id: &ScorerId,
) -> Result<MetricKind, crate::storage::StorageError> {
    Ok(recorded_definition(store, id)
        .await?
        .and_then(|d| {
            d.get("metric")
                .and_then(|m| m.as_str())
                .map(MetricKind::from_metric)
        })
        .unwrap_or_else(|| MetricKind::of(&id.name)))
}

/// Names of every registered scorer (`judge` needs a run: see [`build_for_run`]).
pub const NAMES: &[&str] = &["checklist", "cue", "judge"];

/// Builds a scorer by `name` or `name@version`. `cues` optionally replaces the cue
/// scorer's lists (its version then carries the lists' hash).
pub fn build(spec: &str, cues: Option<&std::path::Path>) -> Result<Box<dyn Scorer>, ScorerError> {
    let (name, version) = spec
        .split_once('@')
        .map_or((spec, None), |(n, v)| (n, Some(v)));
    let scorer: Box<dyn Scorer> = match name {
        "checklist" => Box::new(checklist::ChecklistScorer),
        "cue" => Box::new(match cues {
            Some(f) => cue::CueScorer::from_file(f)?,
            None => cue::CueScorer::default(),
        }),
        "judge" => {
            return Err(ScorerError::Judge {
                spec: spec.to_string(),
                msg: "the judge scorer is built from a run's [judge] model and [score.judge] questions".into(),
            });
        }
        _ => return Err(ScorerError::Unknown(spec.to_string(), NAMES.join(", "))),
    };
    check_version(spec, version, scorer)
}

fn check_version(
    spec: &str,
    version: Option<&str>,
    scorer: Box<dyn Scorer>,
) -> Result<Box<dyn Scorer>, ScorerError> {
    if let Some(v) = version
        && v != scorer.id().version
    {
        return Err(ScorerError::Version {
            spec: spec.to_string(),
            have: scorer.id().tag(),
        });
    }
    Ok(scorer)
}

/// Builds a scorer by `name` or `name@version` for an existing run: the built-in scorers as
/// [`build`] does, and the judge scorer from the `[judge]` model and `[score.judge]`
/// questions recorded in the run's manifest (`pipeline`), with its judge answers prepared
/// under the run root (resumable and cached, so a judge that already answered is not paid
/// again).
pub async fn build_for_run(
    spec: &str,
    cues: Option<&std::path::Path>,
    store: &RunStore,
    pipeline: &serde_json::Value,
) -> Result<Box<dyn Scorer>, ScorerError> {
    let (name, version) = spec
        .split_once('@')
        .map_or((spec, None), |(n, v)| (n, Some(v)));
    if !NAMES.contains(&name)
        && let Some(def) = user::defs_of_pipeline(pipeline)
            .into_iter()
            .find(|d| d.name == name)
    {
        let judge_model: Option<crate::config::ModelConfig> = pipeline
            .get("judge")
            .filter(|v| !v.is_null())
            .and_then(|v| serde_json::from_value(v.clone()).ok());
        let s = user::prepare(&def, store, judge_model.as_ref()).await?;
        return check_version(spec, version, s);
    }
    if name != "judge" {
        return build(spec, cues);
    }
    let bad = |msg: String| ScorerError::Judge {
        spec: spec.to_string(),
        msg,
    };
    let model: crate::config::ModelConfig = pipeline
        .get("judge")
        .filter(|v| !v.is_null())
        .ok_or_else(|| bad("the run's pipeline has no [judge] model".into()))
        .and_then(|v| {
            serde_json::from_value(v.clone()).map_err(|e| bad(format!("[judge]: {e}")))
        })?;
    let checklist: crate::config::JudgeChecklist = pipeline
        .get("score")
        .and_then(|s| s.get("judge"))
        .filter(|v| !v.is_null())
        .ok_or_else(|| bad("the run's pipeline has no [score.judge] questions".into()))
        .and_then(|v| {
            serde_json::from_value(v.clone()).map_err(|e| bad(format!("[score.judge]: {e}")))
        })?;
    if let Some(v) = version
        && v != judge::version(&checklist, &model)
    {
        return Err(ScorerError::Version {
            spec: spec.to_string(),
            have: format!("judge@{}", judge::version(&checklist, &model)),
        });
    }
    let provider = crate::stages::call::build_provider(&model).map_err(|e| bad(e.to_string()))?;
    let s = judge::JudgeScorer::prepare(store, &checklist, &model, provider)
        .await
        .map_err(|e| ScorerError::judge_calls(spec, &e))?;
    Ok(Box::new(s))
}

/// The columns of the joined row every scorer sees (and a SQL scorer's expressions name):
/// `(table alias, column)`, the alias `k` for calls, `v` for validity, `c` for cases.
const JOINED: &[(&str, &str)] = &[
    ("k", "call_id"),
    ("k", "case_id"),
    ("k", "model"),
    ("k", "sample_idx"),
    ("k", "response"),
    ("k", "response_score"),
    ("k", "response_hash"),
    ("k", "finish_reason"),
    ("k", "prompt_tokens"),
    ("k", "completion_tokens"),
    ("k", "reasoning_tokens"),
    ("k", "latency_ms"),
    ("v", "validity"),
    ("v", "language"),
    ("v", "answer_chars"),
    ("c", "suite"),
    ("c", "input"),
    ("c", "test"),
    ("c", "capability"),
    ("c", "test_type"),
    ("c", "role"),
    ("c", "template_id"),
    ("c", "group_id"),
    ("c", "expected"),
    ("c", "expectation"),
    ("c", "tolerance"),
];

fn join_sql() -> String {
    let cols: Vec<String> = JOINED.iter().map(|(t, c)| format!("{t}.{c}")).collect();
    format!(
        "SELECT {} FROM calls k JOIN validity v ON k.call_id = v.call_id JOIN cases c ON k.case_id = c.case_id",
        cols.join(", ")
    )
}

/// The schema of the joined rows (strings as plain Utf8, every column nullable), from the
/// declared table schemas: what a SQL scorer is compiled against before any row is read.
pub fn joined_schema() -> datafusion::arrow::datatypes::SchemaRef {
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    let fields: Vec<Field> = JOINED
        .iter()
        .map(|(t, c)| {
            let table = match *t {
                "k" => Table::Calls,
                "v" => Table::Validity,
                _ => Table::Cases,
            };
            let schema = table.schema();
            let dt = schema
                .field_with_name(c)
                .map(|f| f.data_type().clone())
                .unwrap_or_else(|_| panic!("schemas/{}.json declares `{c}`", table.name()));
            let dt = match dt {
                DataType::Utf8View | DataType::LargeUtf8 => DataType::Utf8,
                other => other,
            };
            Field::new(*c, dt, true)
        })
        .collect();
    Arc::new(Schema::new(fields))
}

/// A scorer's result on one joined row: its outcome, and the validity the row ends with
/// when the scorer found a valid answer unscorable after all (`None`: the call's own).
#[derive(Debug, Clone, Default)]
struct Scored {
    invalid: Option<&'static str>,
    out: Outcome,
}

/// Typed access to a joined batch (string columns already cast to plain Utf8).
struct Cols<'a> {
    b: &'a RecordBatch,
}

impl<'a> Cols<'a> {
    fn col<T: 'static>(&self, name: &str) -> &'a T {
        self.b
            .column_by_name(name)
            .and_then(|c| c.as_any().downcast_ref::<T>())
            .unwrap_or_else(|| panic!("joined column `{name}` has its declared type"))
    }
    fn s(&self, name: &str, i: usize) -> Option<&'a str> {
        let a = self.col::<StringArray>(name);
        a.is_valid(i).then(|| a.value(i))
    }
    fn f(&self, name: &str, i: usize) -> Option<f64> {
        let a = self.col::<Float64Array>(name);
        a.is_valid(i).then(|| a.value(i))
    }
    fn i(&self, name: &str, i: usize) -> Option<i32> {
        let a = self.col::<Int32Array>(name);
        a.is_valid(i).then(|| a.value(i))
    }
}

type BaseKey = (String, String, i32);

async fn stream(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
) -> Result<datafusion::physical_plan::SendableRecordBatchStream, QueryError> {
    ctx.sql(sql)
        .await
        .map_err(QueryError::df("score: joining calls, validity and cases"))?
        .execute_stream()
        .await
        .map_err(QueryError::df("score: joining calls, validity and cases"))
}

/// Scores every call of the run with `scorer`, replacing `scores/<name>@<version>/`
/// (score pays for no model call, so an interrupted attempt is simply redone). Returns
/// rows written.
pub async fn run(store: &RunStore, scorer: &dyn Scorer) -> Result<u64, QueryError> {
    let ctx = new_context();
    // Each part's join probes the parts of `cases` that may hold its cases (`CaseParts`),
    // and the join's dynamic filter is evaluated while Parquet is decoded, so a case the
    // part does not name costs its `case_id` only, not its input text.
    ctx.state_ref()
        .write()
        .config_mut()
        .options_mut()
        .execution
        .parquet
        .pushdown_filters = true;
    // Calls and validity are read part by part (each checked as it is read): of the run's
    // tables only `cases` is queried whole.
    crate::query::register_tables(&ctx, store, "", &[Table::Cases]).await?;
    let bases = if scorer.compares_to_base() {
        load_bases(&ctx, store, scorer).await?
    } else {
        HashMap::new()
    };
    let id = scorer.id();
    store.delete_dir(&id.dir()).await?;
    let written = write_scores(store, scorer, &ctx, &bases, &id).await;
    if written.is_err() {
        // Half a version is no version: the folder goes (a scorer's failure, a full disk),
        // and the next attempt starts from nothing, as it would anyway.
        let _ = store.delete_scratch(&id.dir()).await;
    }
    written
}

/// Writes `scores/<id>/` part by part; see [`run`].
async fn write_scores(
    store: &RunStore,
    scorer: &dyn Scorer,
    ctx: &datafusion::prelude::SessionContext,
    bases: &HashMap<BaseKey, BaseAnswer>,
    id: &ScorerId,
) -> Result<u64, QueryError> {
    if let Some(def) = scorer.definition() {
        // Written before the parts: scores are never found without their definition.
        let text = serde_json::to_vec_pretty(&def).unwrap_or_default();
        store
            .put(&format!("{}/{DEFINITION_FILE}", id.dir()), text)
            .await?;
    }
    let case_parts = CaseParts::load(store).await?;
    let parts = store.list_parts("calls").await?;
    let progress =
        crate::progress::Progress::new(&format!("score {}", id.tag()), parts.len() as u64, "parts");
    // Each calls part is joined, scored and encoded as it streams, into the scores part of
    // the same name (as validate writes validity): memory is `--threads` parts' joins and
    // their encoders, with no part's rows waiting for an earlier part to be written. The
    // table is the same whatever the thread count.
    let (progress, case_parts) = (&progress, &case_parts);
    let mut scored = futures::stream::iter(parts.into_iter().enumerate())
        .map(|(k, part)| async move {
            let name = part
                .location
                .filename()
                .unwrap_or("part.parquet")
                .to_string();
            // DESIGN.md names every part `part-*.parquet`, whatever a calls part is called.
            let target = match name.starts_with("part-") {
                true => format!("{}/{name}", id.dir()),
                false => format!("{}/part-{name}", id.dir()),
            };
            let encode_err = |source| StorageError::Parquet {
                location: target.clone(),
                source,
            };
            let mut part_out =
                PipelinedEncoder::new(&Table::Scores.schema()).map_err(encode_err)?;
            // A judge's replies to this part's calls, read for this part only.
            let own = scorer.for_part(store, &part).await?;
            let scorer = own.as_deref().unwrap_or(scorer);
            let mut s = part_stream(ctx, store, case_parts, &part, "", k).await?;
            while let Some(b) = s.next().await {
                let b = crate::schema::plain_strings(
                    b.map_err(QueryError::df("score: reading joined rows"))?,
                );
                // Scoring is CPU work on rayon: let tokio move its other tasks away.
                let out = cpu_work(|| score_parallel(&b, scorer, bases, id))?;
                part_out.write(out).await.map_err(encode_err)?;
            }
            let (rows, bytes) = part_out.finish().await.map_err(encode_err)?;
            let rows = rows as u64;
            if rows > 0 {
                store.put(&target, bytes).await?;
            }
            progress.inc(1, rows);
            Ok::<_, QueryError>(rows)
        })
        .buffer_unordered(if crate::query::on_cluster() {
            // One job at a time on a cluster: its executors split the part already.
            1
        } else {
            crate::query::resources().threads.max(1)
        });
    let mut rows = 0u64;
    while let Some(r) = scored.next().await {
        // An error stops the stage: parts already put are whole, and the next attempt
        // replaces the folder.
        rows += r?;
    }
    progress.finish();
    Ok(rows)
}

/// Runs CPU-bound work from async code: on a multi-threaded runtime tokio first moves this
/// worker's other tasks away (so the plans' own tasks keep running); a current-thread
/// runtime (a unit test) just runs it.
fn cpu_work<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Scores one joined batch on every core: slices of the batch go to rayon's pool (sized by
/// `--threads`), each scored and turned into a scores batch, in the batch's row order.
fn score_parallel(
    b: &RecordBatch,
    scorer: &dyn Scorer,
    bases: &HashMap<BaseKey, BaseAnswer>,
    id: &ScorerId,
) -> Result<Vec<RecordBatch>, QueryError> {
    use rayon::prelude::*;
    const SLICE: usize = 1024;
    let n = b.num_rows();
    (0..n.div_ceil(SLICE))
        .into_par_iter()
        .map(|k| {
            let part = b.slice(k * SLICE, SLICE.min(n - k * SLICE));
            Ok(to_batch(id, &part, &score_batch(&part, scorer, bases)?))
        })
        .collect()
}

/// The parts of `cases` with their footers, read once per stage.
///
/// A calls part's join reads only the parts of `cases` whose bloom filters on `case_id`
/// (written by `storage::parquet_props`) may hold one of the part's case ids. Import writes
/// `cases` in corpus order and the calls of a case sit together, so an imported calls part
/// of 100k rows finds its 13k cases in one or two parts of `cases` (and joins two to four of
/// the 17 at 10M calls, with the filters' false positives): the run's calls parts together
/// read `cases` about once, rather than each all of it (O(parts x cases)).
struct CaseParts(Vec<crate::storage::PartFooter>);

impl CaseParts {
    async fn load(store: &RunStore) -> Result<Self, QueryError> {
        let parts = store.list_parts("cases").await?;
        let footers = futures::future::try_join_all(parts.iter().map(|p| store.footer(p)));
        Ok(CaseParts(footers.await?))
    }

    /// The locations of the parts that may hold one of `ids`.
    async fn holding(&self, store: &RunStore, ids: &[&str]) -> Result<Vec<String>, QueryError> {
        // Each answer is a small read (a filter per row group): several at once.
        let held: Vec<bool> = futures::stream::iter(&self.0)
            .map(|part| store.may_hold(part, "case_id", ids))
            .buffered(8)
            .try_collect()
            .await?;
        Ok((self.0.iter().zip(held))
            .filter(|(_, held)| *held)
            .map(|(part, _)| store.location(&part.meta().location))
            .collect())
    }
}

/// The joined rows of one calls part: the part and the validity part of the same name
/// (validate writes them 1:1) are registered as Parquet tables and joined with the parts of
/// `cases` that may hold the part's cases ([`CaseParts`]), so the join builds its hash table
/// on one part and streams those cases past it. Memory grows with a part, never with the
/// corpus. `filter` is appended to the query.
///
/// The parts are read by the plan itself, not first into in-memory tables: the join's build
/// side would hold a second copy of the part (10M calls: 355 MB against 373 MB, in 14.3 s
/// against 16.8 s), and a cluster's executors read them the same way.
async fn part_stream(
    ctx: &datafusion::prelude::SessionContext,
    store: &RunStore,
    case_parts: &CaseParts,
    part: &object_store::ObjectMeta,
    filter: &str,
    k: usize,
) -> Result<datafusion::physical_plan::SendableRecordBatchStream, QueryError> {
    let name = part.location.filename().unwrap_or_default().to_string();
    let vrel = format!("validity/{name}");
    let vmeta = store.head(&vrel).await?.ok_or_else(|| {
        QueryError::Storage(crate::storage::StorageError::MissingTable {
            root: store.display().to_string(),
            table: vrel.clone(),
            stage: "validate".into(),
        })
    })?;
    let (calls, validity, cases) = (
        format!("part_calls_{k}"),
        format!("part_validity_{k}"),
        format!("part_cases_{k}"),
    );
    for (table, meta, t) in [
        (calls.as_str(), part, Table::Calls),
        (validity.as_str(), &vmeta, Table::Validity),
    ] {
        store.check_part(meta, t).await?;
        ctx.deregister_table(table)
            .map_err(QueryError::df("score"))?;
        crate::query::register_parquet(ctx, table, &store.location(&meta.location)).await?;
    }
    let ids =
        crate::query::text_rows(ctx, &format!("SELECT DISTINCT case_id FROM {calls}")).await?;
    let ids: Vec<&str> = ids.iter().filter_map(|r| r[0].as_deref()).collect();
    let case_urls = case_parts.holding(store, &ids).await?;
    tracing::debug!(part = %name, cases = ids.len(), parts = case_urls.len(), of = case_parts.0.len(), "score: parts of cases joined");
    ctx.deregister_table(cases.as_str())
        .map_err(QueryError::df("score"))?;
    let cases = if case_urls.is_empty() {
        // No part may hold them (or `cases` has none): the caller's whole `cases`, whose
        // join finds no case either.
        "cases".to_string()
    } else {
        crate::query::register_parquet_paths(ctx, &cases, &case_urls).await?;
        cases
    };
    let sql = join_sql()
        .replace(
            "FROM calls k JOIN validity v",
            &format!("FROM {calls} k JOIN {validity} v"),
        )
        .replace("JOIN cases c", &format!("JOIN {cases} c"));
    let s = stream(ctx, &format!("{sql} {filter}")).await;
    if !crate::query::on_cluster() {
        // The plan holds the part's files; the names are free for the next part. (A
        // cluster job resolves its tables when first polled: they stay registered.)
        for table in [&calls, &validity, &cases] {
            if table == "cases" {
                continue;
            }
            ctx.deregister_table(table.as_str())
                .map_err(QueryError::df("score"))?;
        }
    }
    s
}

/// Scores the joined rows of the given call ids in memory (used by the holdout gate).
pub async fn score_calls(
    store: &RunStore,
    scorer: &dyn Scorer,
    call_ids: &[String],
) -> Result<HashMap<String, (String, Outcome)>, QueryError> {
    let ctx = new_context();
    register_run(&ctx, store, "").await?;
    let bases = if scorer.compares_to_base() {
        load_bases(&ctx, store, scorer).await?
    } else {
        HashMap::new()
    };
    let wanted: std::collections::HashSet<&str> = call_ids.iter().map(String::as_str).collect();
    let mut out = HashMap::new();
    let case_parts = CaseParts::load(store).await?;
    for part in store.list_parts("calls").await? {
        let own = scorer.for_part(store, &part).await?;
        let scorer = own.as_deref().unwrap_or(scorer);
        let mut s = part_stream(&ctx, store, &case_parts, &part, "", 0).await?;
        while let Some(b) = s.next().await {
            let b = crate::schema::plain_strings(
                b.map_err(QueryError::df("score: reading joined rows"))?,
            );
            let c = Cols { b: &b };
            for (i, r) in score_batch(&b, scorer, &bases)?.into_iter().enumerate() {
                let call_id = c.s("call_id", i).unwrap_or_default();
                if wanted.contains(call_id) {
                    let validity = r
                        .invalid
                        .map(String::from)
                        .unwrap_or_else(|| c.s("validity", i).unwrap_or_default().to_string());
                    out.insert(call_id.to_string(), (validity, r.out));
                }
            }
        }
    }
    Ok(out)
}

/// Base answers by (group, model, sample) of the groups that have a perturbed case: memory
/// grows with perturbation groups, never with rows (a run of base cases only, such as an
/// imported corpus, loads nothing).
async fn load_bases(
    ctx: &datafusion::prelude::SessionContext,
    store: &RunStore,
    scorer: &dyn Scorer,
) -> Result<HashMap<BaseKey, BaseAnswer>, QueryError> {
    let mut bases = HashMap::new();
    let perturbed = ctx
        .sql("SELECT 1 FROM cases WHERE role = 'perturbed' LIMIT 1")
        .await
        .map_err(QueryError::df("score: looking for perturbed cases"))?
        .count()
        .await
        .map_err(QueryError::df("score: looking for perturbed cases"))?;
    if perturbed == 0 {
        return Ok(bases);
    }
    // Ballista's executors cannot run the subquery (the job never finishes): on a cluster
    // every base row is loaded, as before.
    let only = if crate::query::on_cluster() {
        "WHERE c.role = 'base'"
    } else {
        "WHERE c.role = 'base' AND c.group_id IN \
         (SELECT group_id FROM cases WHERE role = 'perturbed')"
    };
    let case_parts = CaseParts::load(store).await?;
    for part in store.list_parts("calls").await? {
        let mut s = part_stream(ctx, store, &case_parts, &part, only, 0).await?;
        while let Some(b) = s.next().await {
            let b = crate::schema::plain_strings(
                b.map_err(QueryError::df("score: reading base cases"))?,
            );
            let c = Cols { b: &b };
            for i in 0..b.num_rows() {
                let key = (
                    c.s("group_id", i).unwrap_or_default().to_string(),
                    c.s("model", i).unwrap_or_default().to_string(),
                    c.i("sample_idx", i).unwrap_or(0),
                );
                let validity = c.s("validity", i).unwrap_or_default();
                let v = if validity == "valid_answer" && !readable(scorer, c.s("language", i)) {
                    // A base the scorer cannot read is no base to compare with.
                    Err("unscorable_language".to_string())
                } else if validity == "valid_answer" {
                    Ok(Answer {
                        label: normalise_label(c.s("response", i).unwrap_or_default()),
                        score: c.f("response_score", i),
                    })
                } else {
                    Err(validity.to_string())
                };
                bases.insert(key, v);
            }
        }
    }
    Ok(bases)
}

/// The outcomes of a scorer that scores whole batches ([`Scorer::score_valid`]), for the
/// valid rows of `b` in order; `None` for a row-by-row scorer.
fn batch_outcomes(
    b: &RecordBatch,
    scorer: &dyn Scorer,
) -> Result<Option<std::vec::IntoIter<Outcome>>, QueryError> {
    if !scorer.scores_batches() {
        return Ok(None);
    }
    let validity = b
        .column_by_name("validity")
        .and_then(|c| c.as_any().downcast_ref::<StringArray>())
        .expect("joined column `validity` is Utf8");
    let language = b
        .column_by_name("language")
        .and_then(|c| c.as_any().downcast_ref::<StringArray>())
        .expect("joined column `language` is Utf8");
    let valid: BooleanArray = validity
        .iter()
        .zip(language.iter())
        .map(|(v, l)| Some(v == Some("valid_answer") && readable(scorer, l)))
        .collect();
    match scorer.score_valid(b, &valid) {
        None => Ok(None),
        Some(Ok(v)) => Ok(Some(v.into_iter())),
        Some(Err(msg)) => Err(QueryError::DataFusion {
            context: format!("scorer {}", scorer.id().tag()),
            source: datafusion::error::DataFusionError::External(Box::new(
                sql_check::ScorerFailed::new(scorer.id(), msg),
            )),
        }),
    }
}

fn score_batch(
    b: &RecordBatch,
    scorer: &dyn Scorer,
    bases: &HashMap<BaseKey, BaseAnswer>,
) -> Result<Vec<Scored>, QueryError> {
    let c = Cols { b };
    let mut batch = batch_outcomes(b, scorer)?;
    // Columns are looked up once per batch: by name per row, the lookups were a fifth of
    // the stage's CPU.
    let text = |name| c.col::<StringArray>(name);
    let (validity, test_type, role, call_id, input, response, language) = (
        text("validity"),
        text("test_type"),
        text("role"),
        text("call_id"),
        text("input"),
        text("response"),
        text("language"),
    );
    let (expected, expectation, group_id, model) = (
        text("expected"),
        text("expectation"),
        text("group_id"),
        text("model"),
    );
    let (response_score, tolerance) = (
        c.col::<Float64Array>("response_score"),
        c.col::<Float64Array>("tolerance"),
    );
    let sample_idx = c.col::<Int32Array>("sample_idx");
    fn get(a: &StringArray, i: usize) -> Option<&str> {
        a.is_valid(i).then(|| a.value(i))
    }
    fn num(a: &Float64Array, i: usize) -> Option<f64> {
        a.is_valid(i).then(|| a.value(i))
    }
    Ok((0..b.num_rows())
        .map(|i| {
            if get(validity, i) != Some("valid_answer") {
                // Never scored: the validity and its reason are the whole story (the
                // detail says so, written by `to_batch`).
                return Scored::default();
            }
            if !readable(scorer, get(language, i)) {
                return unreadable(scorer, get(language, i));
            }
            let test_type = get(test_type, i).unwrap_or_default();
            let role = get(role, i).unwrap_or_default();
            let input = ScoreInput {
                call_id: get(call_id, i).unwrap_or_default(),
                input: get(input, i).unwrap_or_default(),
                response: get(response, i).unwrap_or_default(),
                response_score: num(response_score, i),
                language: get(language, i).unwrap_or_default(),
                test_type,
                role,
                expected: get(expected, i),
                expectation: get(expectation, i),
                tolerance: num(tolerance, i),
            };
            let base = (scorer.compares_to_base() && role == "perturbed").then(|| {
                let key = (
                    get(group_id, i).unwrap_or_default().to_string(),
                    get(model, i).unwrap_or_default().to_string(),
                    if sample_idx.is_valid(i) {
                        sample_idx.value(i)
                    } else {
                        0
                    },
                );
                bases
                    .get(&key)
                    .cloned()
                    .unwrap_or_else(|| Err("missing (the base case has no call)".into()))
            });
            let mut out = match batch.as_mut().and_then(Iterator::next) {
                Some(o) => o,
                None => scorer.score(&input, base.as_ref()),
            };
            if out.invalid.is_some() {
                out.score = None;
                out.passed = None;
            }
            Scored {
                invalid: out.invalid,
                out,
            }
        })
        .collect())
}

/// A valid answer in a language `scorer` does not read: `unscorable_language` for this
/// scorer, with the languages it reads.
fn unreadable(scorer: &dyn Scorer, language: Option<&str>) -> Scored {
    let reads = scorer.languages().unwrap_or_default().join(", ");
    Scored {
        invalid: Some("unscorable_language"),
        out: Outcome {
            detail: serde_json::json!({
                "unscored": "unscorable_language",
                "reason": format!(
                    "{} reads {reads}; the answer is `{}`",
                    scorer.id().name,
                    language.unwrap_or("und")
                ),
            }),
            invalid: Some("unscorable_language"),
            ..Outcome::default()
        },
    }
}

/// The scores rows of a joined batch: the call's identity and its case's fields are the
/// joined columns themselves (no copy per row); only the scorer's outputs are built.
fn to_batch(id: &ScorerId, b: &RecordBatch, rows: &[Scored]) -> RecordBatch {
    let c = Cols { b };
    let n = rows.len();
    let pass = |name: &str| -> ArrayRef {
        let a = b
            .column_by_name(name)
            .unwrap_or_else(|| panic!("joined column `{name}`"));
        if a.null_count() == 0 {
            return a.clone();
        }
        // The run tables declare these columns non-null; a hand-made table may not hold to
        // that, and scores keeps its own declaration.
        match a.as_any().downcast_ref::<StringArray>() {
            Some(s) => Arc::new(StringArray::from_iter_values(
                s.iter().map(|v| v.unwrap_or_default()),
            )),
            None => Arc::new(Int32Array::from_iter_values(
                c.col::<Int32Array>(name).iter().map(|v| v.unwrap_or(0)),
            )),
        }
    };
    let given = c.col::<StringArray>("validity");
    let given = |i: usize| given.is_valid(i).then(|| given.value(i));
    let validity: Vec<&str> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| r.invalid.unwrap_or_else(|| given(i).unwrap_or_default()))
        .collect();
    let mut answers = ListBuilder::new(BooleanBuilder::new());
    for r in rows {
        match &r.out.answers {
            Some(a) => {
                for x in a {
                    answers.values().append_value(*x);
                }
                answers.append(true);
            }
            None => answers.append(false),
        }
    }
    let details: StringArray = rows
        .iter()
        .zip(&validity)
        .enumerate()
        .map(|(i, (r, v))| {
            if given(i) != Some("valid_answer") {
                Some(format!("{{\"unscored\":{}}}", serde_json::Value::from(*v)))
            } else {
                (!r.out.detail.is_null()).then(|| r.out.detail.to_string())
            }
        })
        .collect();
    let cols: Vec<ArrayRef> = vec![
        pass("call_id"),
        pass("case_id"),
        pass("model"),
        pass("sample_idx"),
        Arc::new(StringArray::from_iter_values(std::iter::repeat_n(
            id.name.as_str(),
            n,
        ))),
        Arc::new(StringArray::from_iter_values(std::iter::repeat_n(
            id.version.as_str(),
            n,
        ))),
        b.column_by_name("response_hash")
            .expect("joined column `response_hash`")
            .clone(),
        Arc::new(StringArray::from_iter_values(validity.iter().copied())),
        Arc::new(rows.iter().map(|r| r.out.score).collect::<Float64Array>()),
        Arc::new(
            rows.iter()
                .map(|r| r.out.label.as_deref())
                .collect::<StringArray>(),
        ),
        Arc::new(rows.iter().map(|r| r.out.prob).collect::<Float64Array>()),
        Arc::new(rows.iter().map(|r| r.out.passed).collect::<BooleanArray>()),
        Arc::new(details),
        Arc::new(answers.finish()),
        pass("test"),
        pass("capability"),
        pass("test_type"),
        pass("role"),
        pass("template_id"),
    ];
    RecordBatch::try_new(Table::Scores.schema(), cols)
        .expect("scores batch matches schemas/scores.json")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The version lock: `versions.lock` records the logic hash of every scorer version.
    /// Changing a scorer's logic or cue lists without bumping its version fails here.
    #[test]
    fn scorer_logic_changes_need_a_version_bump() {
        let lock = include_str!("versions.lock");
        let mut seen = std::collections::HashSet::new();
        for line in lock
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        {
            let f: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(f.len(), 3, "versions.lock line `{line}`: name version hash");
            assert!(
                seen.insert((f[0], f[1])),
                "versions.lock lists {}@{} twice",
                f[0],
                f[1]
            );
        }
        let judge = judge::JudgeScorer::with_replies(
            crate::config::JudgeChecklist {
                questions: vec![],
                instructions: None,
            },
            "1".into(),
            Default::default(),
        );
        let mut all: Vec<Box<dyn Scorer>> = NAMES
            .iter()
            .filter(|n| **n != "judge")
            .map(|n| build(n, None).unwrap())
            .collect();
        all.push(Box::new(judge));
        for s in all {
            let id = s.id();
            let hash = logic_hash(s.as_ref());
            let line = lock
                .lines()
                .find(|l| {
                    l.split_whitespace()
                        .take(2)
                        .eq([id.name.as_str(), id.version.as_str()])
                })
                .unwrap_or_else(|| {
                    panic!(
                        "versions.lock has no line for {} (logic hash {hash}): add `{} {} {hash}`",
                        id.tag(),
                        id.name,
                        id.version
                    )
                });
            assert_eq!(
                line.split_whitespace().nth(2).unwrap(),
                hash,
                "the logic of {} changed without a version bump: bump its version and add a new versions.lock line",
                id.tag()
            );
        }
    }

    /// The user scorer engine is versioned like a scorer: a change of how definitions are
    /// evaluated needs a new `user::ENGINE_VERSION` (which changes every user scorer's
    /// version) and a new `user-engine` line in versions.lock.
    #[test]
    fn user_engine_changes_need_a_version_bump() {
        let hash =
            hex::encode(Sha256::digest(source_logic(include_str!("user.rs"))))[..16].to_string();
        let lock = include_str!("versions.lock");
        let line = lock
            .lines()
            .find(|l| {
                l.split_whitespace()
                    .take(2)
                    .eq(["user-engine", user::ENGINE_VERSION])
            })
            .unwrap_or_else(|| {
                panic!(
                    "versions.lock has no line for user-engine {}: add `user-engine {} {hash}`",
                    user::ENGINE_VERSION,
                    user::ENGINE_VERSION
                )
            });
        assert_eq!(
            line.split_whitespace().nth(2).unwrap(),
            hash,
            "the user scorer engine changed without a bump of user::ENGINE_VERSION"
        );
    }

    #[test]
    fn build_checks_names_and_versions() {
        assert!(build("checklist@1", None).is_ok());
        assert!(matches!(
            build("checklist@0", None),
            Err(ScorerError::Version { .. })
        ));
        assert!(matches!(build("nope", None), Err(ScorerError::Unknown(..))));
    }
}
