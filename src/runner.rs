//! Runs stages against a run root, keeping `manifest.json` honest about what finished.
//!
//! Re-running on the same root resumes: completed stages are kept, the call stage skips
//! committed calls, validate skips validated parts, and score / aggregate (which pay for
//! nothing) are recomputed from scratch when their inputs changed.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::json;

use crate::pipeline::{Pipeline, PipelineError};
use crate::query::QueryError;
use crate::stages::aggregate::ResultRow;
use crate::stages::call::CallError;
use crate::stages::score::{self as score_stage, Scorer, ScorerError, ScorerId};
use crate::stages::{aggregate, call, generate, validate};
use crate::storage::{Manifest, RunStore, StageStatus, StorageError, manifest_now};

/// Errors of a run. `is_bad_input` decides exit code 2.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error(transparent)]
    Query(#[from] QueryError),
    #[error(transparent)]
    Call(#[from] CallError),
    #[error(transparent)]
    Generate(#[from] generate::GenerateError),
    #[error("{root}: {msg}")]
    Root { root: String, msg: String },
    #[error("{file}: [score] scorers: {source}")]
    Scorer {
        file: String,
        #[source]
        source: ScorerError,
    },
    /// A user scorer failed on the run's rows (a division by zero, a failed CAST): names
    /// its definition's file, line and field.
    #[error(transparent)]
    ScorerFailed(Box<crate::stages::score::user::DefError>),
}

impl RunError {
    /// Whether the user can fix this by changing their input (exit code 2).
    pub fn is_bad_input(&self) -> bool {
        match self {
            RunError::Pipeline(_)
            | RunError::Root { .. }
            | RunError::Scorer { .. }
            | RunError::ScorerFailed(_) => true,
            RunError::Query(e) => e.is_bad_input(),
            RunError::Storage(e) => e.is_bad_input(),
            RunError::Call(e) => e.is_bad_input(),
            RunError::Generate(generate::GenerateError::Rephrase { .. }) => false,
            RunError::Generate(generate::GenerateError::Call(e)) => e.is_bad_input(),
            RunError::Generate(generate::GenerateError::Storage(e)) => e.is_bad_input(),
            RunError::Generate(_) => true,
        }
    }
}

/// A pipeline bound to a run root.
pub struct Runner {
    pub pipeline: Pipeline,
    pub store: RunStore,
    pub manifest: Manifest,
    /// `--languages`: the answer languages validate accepts, instead of those the run was
    /// validated with (or the pipeline's); a change re-decides every verdict.
    pub languages: Option<Vec<String>>,
    /// `--retry-errors`: the call stage sends the calls that ended as errors again.
    pub retry_errors: bool,
    /// `--batch`: the model's calls go through its provider's batch interface.
    pub batch: bool,
    /// `--no-wait`: a batch-mode call submits its batches and returns.
    pub no_wait: bool,
    /// The root's lease: one writer per root while this runner lives.
    _lease: crate::storage::Lease,
}

/// The default run id: the run name and the current UTC time.
pub fn default_run_id(p: &Pipeline) -> String {
    let name = p.run.name.clone().unwrap_or_else(|| p.suite.name.clone());
    format!("{}-{}", name, chrono::Utc::now().format("%Y%m%d-%H%M%S"))
}

/// The model tables `verb` sends requests to, and whether it runs the judge scorers with
/// models of their own: generate asks the rephrase models, call the model under test, score
/// the judges; `run` does all three.
fn key_tables(p: &Pipeline, verb: &str) -> (Vec<&'static str>, bool) {
    let mut tables = Vec::new();
    if matches!(verb, "run" | "generate") {
        tables.extend(generate::rephrase_models(p).into_iter().map(|(t, _)| t));
    }
    if matches!(verb, "run" | "call") {
        tables.push("model");
    }
    let scores = matches!(verb, "run" | "score");
    let judge_scorer = p
        .score
        .scorers
        .iter()
        .any(|n| n == "judge" || n.starts_with("judge@"))
        || p.user_scorers
            .iter()
            .any(|d| d.model.is_none() && d.kind.as_str() == "judge");
    if scores && judge_scorer {
        tables.push("judge");
    }
    (tables, scores)
}

impl Runner {
    /// Loads the pipeline and opens (or creates) the run at `out`, default `runs/<run_id>`.
    pub async fn open(pipeline_path: &Path, out: Option<&str>) -> Result<Self, RunError> {
        let pipeline = Pipeline::load(pipeline_path)?;
        // Before the root is opened: a command that sends requests fails on an unset key
        // variable now, not after generate has written the run.
        let (tables, scorers) = key_tables(&pipeline, crate::storage::lease::verb());
        pipeline.check_keys(&tables, scorers)?;
        if let Ok(Some(limit)) = pipeline.run.memory_limit_bytes()
            && !crate::query::MEMORY_LIMIT_GIVEN.load(std::sync::atomic::Ordering::Relaxed)
        {
            crate::query::set_resources(crate::query::Resources {
                memory_limit: limit,
                ..crate::query::resources()
            });
        }
        let root = match out {
            Some(o) => o.to_string(),
            None => format!("runs/{}", default_run_id(&pipeline)),
        };
        let store = RunStore::open(&root)?;
        // Before the manifest is read: a second writer must not act on what the first is
        // about to change.
        let lease = crate::storage::Lease::acquire(&store, crate::storage::lease::verb()).await?;
        // A run none of whose stages committed (generate failed on a typo, a missing source
        // file, Ctrl-C) holds nothing paid for: the fixed pipeline takes it over.
        let existing = Manifest::load(&store)
            .await?
            .filter(|m| m.stages.values().any(|r| r.status == StageStatus::Complete));
        let manifest = match existing {
            Some(m) if m.pipeline_hash != pipeline.hash() => {
                return Err(RunError::Root {
                    root: store.display().to_string(),
                    msg: format!(
                        "this run was made by another pipeline (hash {} from {}; {} hashes to {}): use a new --out",
                        m.pipeline_hash,
                        m.pipeline_path,
                        pipeline_path.display(),
                        pipeline.hash()
                    ),
                });
            }
            Some(m) => m,
            None => {
                let run_id = root
                    .trim_end_matches('/')
                    .rsplit('/')
                    .next()
                    .unwrap_or("run")
                    .to_string();
                let m = Manifest {
                    run_id,
                    evalflow_version: env!("CARGO_PKG_VERSION").to_string(),
                    pipeline_path: pipeline_path.display().to_string(),
                    pipeline_hash: pipeline.hash(),
                    pipeline: serde_json::to_value(&pipeline).unwrap_or(json!(null)),
                    created_at: manifest_now(),
                    finished_at: None,
                    stages: BTreeMap::new(),
                    row_counts: BTreeMap::new(),
                    scorer_versions: vec![],
                    validator_version: None,
                };
                // Not saved here: the first stage to start records it (generate, after
                // every check of the suite has passed), so bad input writes nothing.
                m
            }
        };
        Ok(Self {
            pipeline,
            store,
            manifest,
            languages: None,
            retry_errors: false,
            batch: false,
            no_wait: false,
            _lease: lease,
        })
    }

    fn require(&self, stage: &str, before: &str) -> Result<(), RunError> {
        if self.manifest.is_complete(before) {
            return Ok(());
        }
        let open = if before == "call" {
            call::batch::open_chunks(&self.store).len()
        } else {
            0
        };
        if open > 0 {
            return Err(RunError::Root {
                root: self.store.display().to_string(),
                msg: format!(
                    "`{stage}` needs the `call` stage to have completed: it has {open} batch(es) \
                     open (submitted, not collected): `evalflow call {} --out {}` collects them",
                    self.pipeline.path.display(),
                    self.store.display()
                ),
            });
        }
        Err(RunError::Root {
            root: self.store.display().to_string(),
            msg: format!(
                "`{stage}` needs the `{before}` stage to have completed: run `evalflow {before}` first"
            ),
        })
    }

    /// Expands the suite into `cases/` (skipped when already complete).
    pub async fn generate(&mut self) -> Result<u64, RunError> {
        if self.manifest.is_complete("generate") {
            return Ok(self.manifest.row_counts.get("cases").copied().unwrap_or(0));
        }
        // Everything that can be checked is checked before the manifest records a start,
        // so bad input leaves the run root as it was.
        let mut cases = generate::CaseStream::new(&self.pipeline)?;
        generate::source::check_sources(&self.pipeline)?;
        let models = generate::rephrase_models(&self.pipeline);
        if let Some((_, first)) = models.first() {
            // Its calls are a nested run under the root (`rephrase/`): resumed, not paid twice.
            cases = cases
                .with_rephraser(call::build_provider(first)?, &self.store)
                .with_batch(self.batch);
            // Tests that name other models send to those models' servers.
            for (table, m) in &models[1..] {
                cases = cases.with_rephraser_for(table, call::build_provider(m)?);
            }
        }
        self.manifest.start("generate");
        self.manifest.save(&self.store).await?;
        let rows = match self.write_cases(cases).await {
            Ok(rows) => rows,
            Err(e) => {
                // Nothing committed: leave the root as bad input found before the start
                // would have (a run no stage committed is taken over by the next pipeline
                // anyway, should this cleanup itself fail).
                if !self
                    .manifest
                    .stages
                    .values()
                    .any(|r| r.status == StageStatus::Complete)
                {
                    let _ = self.store.delete_scratch("cases").await;
                    let _ = self.store.delete("manifest.json").await;
                }
                return Err(e);
            }
        };
        let tests = self.pipeline.tests.len();
        self.manifest.complete(
            "generate",
            "cases",
            rows as u64,
            BTreeMap::from([("tests".into(), json!(tests))]),
        );
        self.manifest.save(&self.store).await?;
        Ok(rows as u64)
    }

    /// Streams the suite's cases into a fresh `cases/`, a batch at a time (never all held).
    async fn write_cases(&self, mut cases: generate::CaseStream<'_>) -> Result<usize, RunError> {
        self.store.delete_dir("cases").await?;
        let mut w = self
            .store
            .part_writer("cases", crate::schema::Table::Cases.schema(), "part");
        while let Some(batch) = cases.next_batch(8192).await? {
            w.write(generate::to_batch(&batch)).await?;
        }
        Ok(w.finish().await?.0)
    }

    /// Calls the model under test for every case x sample not yet committed.
    pub async fn call(&mut self) -> Result<call::CallStats, RunError> {
        self.require("call", "generate")?;
        let provider = call::build_provider(&self.pipeline.model)?;
        crate::query::check_tables(&self.store).await?;
        self.manifest.start("call");
        self.manifest.save(&self.store).await?;
        let opts = call::Options {
            retry_errors: self.retry_errors,
        };
        let mut model = self.pipeline.model.clone();
        model.batch |= self.batch;
        model.batch_no_wait = self.no_wait;
        let stats = call::run_with(&self.store, &model, provider, opts).await?;
        if !stats.open_batches.is_empty() {
            // Submitted, not yet answered (`--no-wait`): the stage stays running, with its
            // open batches in the manifest, until a later command collects them.
            if let Some(rec) = self.manifest.stages.get_mut("call") {
                rec.rows = stats.rows_total;
                rec.details = stats.details();
            }
            self.manifest.save(&self.store).await?;
            return Ok(stats);
        }
        // The stage committed a part every couple of seconds: merge them now, while no
        // other stage reads the run.
        crate::storage::compact::compact_calls(&self.store).await?;
        self.manifest.complete(
            "call",
            "calls",
            stats.rows_total,
            stats
                .details()
                .into_iter()
                .chain([
                    ("model".into(), json!(self.pipeline.model.name)),
                    ("provider".into(), json!(self.pipeline.model.provider)),
                ])
                .collect(),
        );
        if stats.error_rows > 0 && stats.error_rows < stats.rows_total {
            // Failed calls are rows: say which kinds, or the run looks whole. (Every call
            // failed: the caller's error says it, see `CallStats::some_answered`.)
            crate::progress::errln!("{}", stats.failures.summary(stats.rows_total));
        }
        if stats.retried > 0 {
            // Rows were replaced: their verdicts are to decide, and every score and result
            // was made from the old rows. Validate keeps its record (its languages) but must
            // run again before score.
            if let Some(v) = self.manifest.stages.get_mut("validate") {
                v.status = StageStatus::Running;
            }
            self.manifest.stages.remove("score");
            self.manifest.stages.remove("aggregate");
        }
        self.manifest.save(&self.store).await?;
        Ok(stats)
    }

    /// The languages the run's validity was (or is being) decided under: recorded with the
    /// stage, else the pipeline's (a run validated before they were recorded).
    fn validated_languages(&self) -> Option<Vec<String>> {
        let rec = self.manifest.stages.get("validate")?;
        Some(
            rec.details
                .get("languages")
                .and_then(|v| serde_json::from_value(v.clone()).ok())
                .unwrap_or_else(|| self.pipeline.languages()),
        )
    }

    /// Decides validity for every committed call not yet validated, under `--languages`,
    /// else the languages the run was validated with, else the pipeline's. Other languages
    /// than the run's re-decide every verdict (an imported run re-validated without a new
    /// import), and the scores made under the old verdicts must be made again.
    pub async fn validate(&mut self) -> Result<u64, RunError> {
        self.require("validate", "call")?;
        crate::query::check_tables(&self.store).await?;
        let previous = self.validated_languages();
        let languages = self
            .languages
            .clone()
            .or_else(|| previous.clone())
            .unwrap_or_else(|| self.pipeline.languages());
        if languages.is_empty() || languages.iter().any(|l| l.trim().is_empty()) {
            return Err(RunError::Root {
                root: self.store.display().to_string(),
                msg: format!(
                    "--languages `{}`: name at least one language, none empty (e.g. en,es)",
                    languages.join(",")
                ),
            });
        }
        let sorted = |l: &[String]| {
            let mut v: Vec<String> = l.iter().map(|x| x.trim().to_string()).collect();
            v.sort();
            v.dedup();
            v
        };
        let languages = sorted(&languages);
        let redo = previous.as_deref().is_some_and(|p| sorted(p) != languages);
        self.manifest.start("validate");
        if let Some(rec) = self.manifest.stages.get_mut("validate") {
            // Recorded at the start, so an interrupted re-validation resumes under them.
            rec.details.insert("languages".into(), json!(languages));
        }
        if redo {
            // The scores and results were made from the old verdicts.
            self.manifest.stages.remove("score");
            self.manifest.stages.remove("aggregate");
        }
        self.manifest.save(&self.store).await?;
        if redo {
            self.store.delete_dir("validity").await?;
            crate::progress::errln!(
                "validate: answer languages {} (were {}): every verdict is decided again;                  score the run again before aggregating",
                languages.join(", "),
                previous.unwrap_or_default().join(", ")
            );
        }
        let rows = validate::run(&self.store, &languages).await?;
        self.manifest.validator_version = Some(validate::VALIDATOR_VERSION.to_string());
        self.manifest.complete(
            "validate",
            "validity",
            rows,
            BTreeMap::from([("languages".into(), json!(languages))]),
        );
        self.manifest.save(&self.store).await?;
        Ok(rows)
    }

    /// The scorers named in `[score] scorers`, in order; a judge scorer first runs its
    /// judge over the run's valid answers (through the call stage, resumable).
    pub async fn prepared_scorers(&self) -> Result<Vec<Box<dyn Scorer>>, RunError> {
        let mut out = Vec::new();
        // `--retry-errors` reaches the judges: their failed calls are sent again too.
        let retry = |m: &crate::config::ModelConfig| crate::config::ModelConfig {
            retry_errors: self.retry_errors,
            // `--batch` too: the judges' calls go through their batch interface.
            batch: m.batch || self.batch,
            ..m.clone()
        };
        let run_judge = self.pipeline.judge.as_ref().map(retry);
        let run_judge = &run_judge;
        let user = |def: &score_stage::user::ScorerDef| {
            let mut def = def.clone();
            def.model = def.model.as_ref().map(retry);
            async move {
                score_stage::user::prepare(&def, &self.store, run_judge.as_ref())
                    .await
                    .map_err(|source| RunError::Scorer {
                        file: self.pipeline.path.display().to_string(),
                        source,
                    })
            }
        };
        for name in &self.pipeline.score.scorers {
            if let Some(def) = self.pipeline.user_scorer(name) {
                out.push(user(def).await?);
            } else if name == "judge" || name.starts_with("judge@") {
                let bad = |msg: &str| RunError::Root {
                    root: self.pipeline.path.display().to_string(),
                    msg: msg.to_string(),
                };
                let checklist = self.pipeline.score.judge.as_ref().ok_or_else(|| {
                    bad("the judge scorer needs a [score.judge] checklist of questions")
                })?;
                let model = run_judge
                    .as_ref()
                    .ok_or_else(|| bad("the judge scorer needs a [judge] model"))?;
                let provider = call::build_provider(model)?;
                let s = score_stage::judge::JudgeScorer::prepare(
                    &self.store,
                    checklist,
                    model,
                    provider,
                )
                .await?;
                out.push(Box::new(s) as Box<dyn Scorer>);
            } else {
                out.extend(self.scorers_named(std::slice::from_ref(name))?);
            }
        }
        // User scorers (`[[scorer]]`) not named in `[score] scorers` come after them.
        for def in &self.pipeline.user_scorers {
            if !self.pipeline.score.scorers.contains(&def.name) {
                out.push(user(def).await?);
            }
        }
        Ok(out)
    }

    /// The scorers named in `[score] scorers`, in order (without preparing a judge).
    pub fn scorers(&self) -> Result<Vec<Box<dyn Scorer>>, RunError> {
        let names: Vec<String> = self
            .pipeline
            .score
            .scorers
            .iter()
            .filter(|n| !n.starts_with("judge"))
            .cloned()
            .collect();
        self.scorers_named(&names)
    }

    fn scorers_named(&self, names: &[String]) -> Result<Vec<Box<dyn Scorer>>, RunError> {
        let cues = self.pipeline.score.cues.as_ref().map(|c| {
            self.pipeline
                .path
                .parent()
                .unwrap_or(Path::new("."))
                .join(c)
        });
        names
            .iter()
            .map(|s| {
                score_stage::build(s, cues.as_deref()).map_err(|source| RunError::Scorer {
                    file: self.pipeline.path.display().to_string(),
                    source,
                })
            })
            .collect()
    }

    /// Scores with `scorer`, replacing an incomplete earlier attempt of the same version.
    pub async fn score(&mut self, scorer: &dyn Scorer) -> Result<u64, RunError> {
        self.require("score", "validate")?;
        crate::query::check_tables(&self.store).await?;
        let id = scorer.id();
        let stage = format!("score:{}", id.tag());
        let before = self.manifest.stages.get(&stage).cloned();
        // The judge's endpoint is not part of its version (the same model behind another
        // `base_url`): recorded beside its scores.
        let endpoint = (id.name == "judge")
            .then_some(self.pipeline.judge.as_ref())
            .flatten()
            .map(|m| {
                m.base_url
                    .clone()
                    .unwrap_or_else(|| format!("{} default", m.provider))
            });
        self.manifest.start(&stage);
        self.manifest.save(&self.store).await?;
        let rows = match score_stage::run(&self.store, scorer).await {
            Ok(rows) => rows,
            Err(e) => {
                // The stage removed its folder: the manifest no more claims it started.
                match before {
                    Some(b) => self.manifest.stages.insert(stage.clone(), b),
                    None => self.manifest.stages.remove(&stage),
                };
                let _ = self.manifest.save(&self.store).await;
                if let Some(f) = score_stage::sql_check::ScorerFailed::of(&e) {
                    let def = self.pipeline.user_scorer(&f.scorer.name);
                    let file = self.pipeline.path.display().to_string();
                    return Err(RunError::ScorerFailed(Box::new(f.located(def, &file))));
                }
                return Err(crate::query::explain_read_error(&self.store, e)
                    .await
                    .into());
            }
        };
        if !self.manifest.scorer_versions.contains(&id.tag()) {
            self.manifest.scorer_versions.push(id.tag());
        }
        let mut details =
            BTreeMap::from([("logic_hash".into(), json!(score_stage::logic_hash(scorer)))]);
        if let Some(e) = endpoint {
            details.insert("endpoint".into(), json!(e));
        }
        self.manifest.complete(&stage, &id.dir(), rows, details);
        self.manifest
            .stages
            .insert("score".into(), self.manifest.stages[&stage].clone());
        self.manifest.save(&self.store).await?;
        if let Some(w) = score_stage::coverage::judge_replies(&self.store, &id).await? {
            crate::progress::errln!("{w}");
        }
        Ok(rows)
    }

    /// Aggregates the scores of `scorer` into `results/`.
    pub async fn aggregate(&mut self, scorer: &ScorerId) -> Result<Vec<ResultRow>, RunError> {
        self.require("aggregate", "score")?;
        crate::query::check_tables(&self.store).await?;
        self.manifest.start("aggregate");
        let rows = match aggregate::run(&self.store, scorer, self.pipeline.aggregate.icc).await {
            Ok(rows) => rows,
            Err(e) => {
                return Err(crate::query::explain_read_error(&self.store, e)
                    .await
                    .into());
            }
        };
        // The stated ICC the results honour: `report` makes its intervals the same way.
        let details = self
            .pipeline
            .aggregate
            .icc
            .map(|r| ("icc".to_string(), json!(r)))
            .into_iter()
            .collect();
        self.manifest
            .complete("aggregate", "results", rows.len() as u64, details);
        self.manifest.finished_at = Some(manifest_now());
        self.manifest.save(&self.store).await?;
        if scorer.name == "checklist" {
            // Beside the failure rates it explains: the built-in label match that never
            // matched says so, with the shares behind it.
            if let Some(w) = score_stage::coverage::label_coverage(&self.store, scorer)
                .await?
                .warning(scorer)
            {
                crate::progress::errln!("{w}");
            }
        }
        Ok(rows)
    }

    /// All five stages in order.
    pub async fn run_all(&mut self) -> Result<Vec<ResultRow>, RunError> {
        self.generate().await?;
        // A run none of whose calls succeeded has nothing to validate or score: it ends here,
        // saying why (the call stage stays complete; `--retry-errors` sends them again).
        self.call().await?.some_answered()?;
        self.validate().await?;
        self.require("score", "validate")?;
        let scorers = self.prepared_scorers().await?;
        for s in &scorers {
            self.score(s.as_ref()).await?;
        }
        // `Pipeline::check` refuses an empty `[score] scorers`; never index blindly.
        let primary = scorers
            .first()
            .map(|s| s.id())
            .ok_or_else(|| RunError::Root {
                root: self.pipeline.path.display().to_string(),
                msg: "[score] scorers is empty".into(),
            })?;
        self.aggregate(&primary).await
    }
}
