//! Score: turns valid answers into verdicts, one row per call per scorer version.
//!
//! An invalid row is never scored: its score is NULL and it keeps its validity, so a
//! class of failed calls can never pad a label. Every row carries the scorer, its version
//! and the response hash, so any number can be traced to the rules that made it.
//! Re-scoring writes `scores/<scorer>@<version>/` beside older versions, never over them.

pub mod checklist;
pub mod coverage;
pub mod cue;
mod driver;
pub mod judge;
pub mod sql_check;
pub mod user;

use datafusion::arrow::array::{BooleanArray, RecordBatch};
use sha2::{Digest, Sha256};

use crate::query::QueryError;
use crate::storage::RunStore;
use checklist::Answer;

pub use crate::config::ScorerId;
pub use driver::*;

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
                version: None,
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
        let hash = hex::encode(Sha256::digest(user::engine_logic()))[..16].to_string();
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
        assert!(build("checklist@2", None).is_ok());
        // An earlier version's logic is not kept: its scores stay, it cannot score anew.
        assert!(matches!(
            build("checklist@1", None),
            Err(ScorerError::Version { .. })
        ));
        assert!(matches!(
            build("checklist@0", None),
            Err(ScorerError::Version { .. })
        ));
        assert!(matches!(build("nope", None), Err(ScorerError::Unknown(..))));
    }
}
