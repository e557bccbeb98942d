//! The HTML report: one self-contained page per run (no network, scripts and styles inline,
//! plots as inline SVG), written by `evalflow report RUN` and at the end of `evalflow run`.
//!
//! The page exists because people judge an eval by looking at it. Its headline numbers are
//! the [`ResultRow`]s of [`aggregate::compute`], the same rows the text table prints, so the
//! page and the terminal cannot disagree; each row also carries its values as `data-*`
//! attributes for machines. [`gather`] reads what else the page shows from the run (validity
//! of all calls, failure examples, answer lengths, latencies, finish reasons); the caller
//! adds what needs more than one run or a file (comparison, holdout, baseline gate), and
//! [`html::render`] makes the page.

pub mod html;
pub mod plots;

use crate::query::{QueryError, new_context, register_run, text_rows};
use crate::stages::aggregate::{ALL_VERDICTS, ResultRow};
use crate::stages::score::{MetricKind, ScorerId};
use crate::storage::{Manifest, RunStore, StageStatus, StorageError};

/// One class's raw and corrected prevalence (the holdout section of the report and
/// `evalflow report --holdout`).
#[derive(Debug, Clone)]
pub struct Prevalence {
    pub class: String,
    pub pos: u64,
    pub n: u64,
    pub tp: u64,
    pub fn_: u64,
    pub tn: u64,
    pub fp: u64,
    /// `[estimate, se, lo, hi]` from `rogan_gladen_ci`; None when sens + spec <= 1.
    pub corrected: Option<[f64; 4]>,
}

/// Errors while building or writing a report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A query over the run's tables failed.
    #[error(transparent)]
    Query(#[from] QueryError),
    /// Writing the page into the run root failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// plotters could not draw a plot.
    #[error("plot: {0}")]
    Plot(String),
    /// Writing the page to a local file failed.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The stages a complete run has finished, in order.
pub const STAGES: [&str; 5] = ["generate", "call", "validate", "score", "aggregate"];

/// Examples shown per test and model (one on a page with more than
/// [`html::OPEN_LIMIT`] test rows, to keep its size in check).
pub const EXAMPLES_PER_TEST: usize = 3;

/// Longest input or response shown in an example, in characters.
pub const EXAMPLE_CHARS: usize = 400;

/// One example of a scored call (a failure for pass/fail scorers).
#[derive(Debug, Clone, Default)]
pub struct Example {
    pub model: String,
    pub test: String,
    pub test_type: String,
    pub validity: String,
    pub passed: Option<String>,
    pub label: Option<String>,
    pub score: Option<String>,
    pub input: String,
    pub response: Option<String>,
    pub response_score: Option<String>,
    pub expected: Option<String>,
    pub expectation: Option<String>,
    /// The base case of an INV/DIR perturbation.
    pub base_input: Option<String>,
    pub base_response: Option<String>,
    pub base_response_score: Option<String>,
}

/// The invalid-rate gate of `evalflow check --baseline`, evaluated for this run.
#[derive(Debug, Clone)]
pub struct Gate {
    pub baseline_file: String,
    pub baseline_run: String,
    pub baseline_invalid: f64,
    pub invalid: f64,
    pub max_drift_pp: f64,
}

impl Gate {
    /// The drift of the invalid fraction in percentage points.
    pub fn drift_pp(&self) -> f64 {
        (self.invalid - self.baseline_invalid) * 100.0
    }

    /// Whether the drift exceeds the gate.
    pub fn failed(&self) -> bool {
        self.drift_pp().abs() > self.max_drift_pp
    }
}

/// One row of `sql/paired_comparison.sql`.
#[derive(Debug, Clone, Default)]
pub struct CompareRow {
    pub scope: String,
    pub capability: String,
    pub test: String,
    pub n_cases: Option<i64>,
    pub n_templates: Option<i64>,
    /// Cases scored in one run only, left out of every other number of the row.
    pub n_unpaired: Option<i64>,
    pub mean_a: Option<f64>,
    pub mean_b: Option<f64>,
    pub diff: Option<f64>,
    pub se: Option<f64>,
    pub lo: Option<f64>,
    pub hi: Option<f64>,
    pub p_value: Option<f64>,
    pub mde: Option<f64>,
    pub verdict: String,
}

/// A paired comparison of this run (B) with another (A), as `evalflow compare` makes it.
#[derive(Debug, Clone)]
pub struct Comparison {
    pub run_a: String,
    pub run_b: String,
    pub scorer: String,
    pub rows: Vec<CompareRow>,
}

/// Raw and Rogan-Gladen corrected class rates from a hand-labelled holdout.
#[derive(Debug, Clone)]
pub struct Holdout {
    pub file: String,
    pub labelled: usize,
    pub rows: Vec<Prevalence>,
}

/// One judge observation's GBDT prediction with its conformal interval.
#[derive(Debug, Clone)]
pub struct JudgePrediction {
    pub unit: String,
    pub judge: String,
    pub trial: i32,
    /// `train`, `calibration`, `test` or `unseen` (not in the model's data).
    pub split: String,
    pub prediction: f64,
    pub lo: f64,
    pub hi: f64,
}

/// The learned aggregation of a judge checklist (`evalflow judge train`) applied to the run:
/// predictions with conformal intervals, and the SHAP waterfall of one unit.
#[derive(Debug, Clone)]
pub struct JudgeSection {
    pub model_file: String,
    pub checklist: String,
    pub coverage_level: f64,
    /// Observations in the run (all of them are predicted; the page lists the first ones).
    pub n_obs: usize,
    pub predictions: Vec<JudgePrediction>,
    pub unit: String,
    /// The waterfall chart of `unit`, an SVG element.
    pub waterfall_svg: String,
}

/// Predicts every judge observation of the run at `root` (scores of `scorer`) with the GBDT
/// `model` and explains `unit` (default: the first predicted unit), reusing the `judge`
/// verbs' own functions, so the page and `evalflow judge predict|explain` agree.
///
/// # Errors
/// The scores hold no judge answers, the model does not fit them, or the unit is unknown.
pub async fn judge_section(
    root: &str,
    scorer: &str,
    model: &std::path::Path,
    unit: Option<&str>,
    max_rows: usize,
) -> Result<JudgeSection, crate::judge::JudgeError> {
    use datafusion::arrow::array::{AsArray, Float64Array};
    use datafusion::arrow::datatypes::Int32Type;
    let ds = crate::judge::data::read_scores(root, Some(scorer), &Default::default()).await?;
    let m = crate::judge::JudgeModel::load(model)?;
    let b = crate::judge::apply::predictions_batch(&m, &ds, None, 3)?;
    let col = |n: &str| b.column_by_name(n).expect("predictions schema");
    let s = |n: &str| col(n).as_string::<i32>().clone();
    let f = |n: &str| -> Float64Array { col(n).as_primitive().clone() };
    let (units, judges, splits) = (s("unit"), s("judge"), s("split"));
    let trials = col("trial").as_primitive::<Int32Type>().clone();
    let (pred, lo, hi, level) = (f("prediction"), f("lo"), f("hi"), f("coverage_level"));
    let predictions: Vec<JudgePrediction> = (0..b.num_rows().min(max_rows))
        .map(|i| JudgePrediction {
            unit: units.value(i).to_string(),
            judge: judges.value(i).to_string(),
            trial: trials.value(i),
            split: splits.value(i).to_string(),
            prediction: pred.value(i),
            lo: lo.value(i),
            hi: hi.value(i),
        })
        .collect();
    let unit = match unit {
        Some(u) => u.to_string(),
        None => predictions
            .first()
            .map(|p| p.unit.clone())
            .unwrap_or_default(),
    };
    let w = crate::judge::apply::explain_unit(&m, &ds, &unit, None, None, 10)?;
    Ok(JudgeSection {
        model_file: model.display().to_string(),
        checklist: m.meta.checklist.clone(),
        coverage_level: if b.num_rows() > 0 {
            level.value(0)
        } else {
            f64::NAN
        },
        n_obs: b.num_rows(),
        predictions,
        unit,
        waterfall_svg: w.svg(),
    })
}

/// Everything the page shows.
#[derive(Debug, Clone)]
pub struct Report {
    pub root: String,
    pub manifest: Manifest,
    pub scorer: ScorerId,
    pub kind: MetricKind,
    /// The rows of [`aggregate::compute`](crate::stages::aggregate::compute).
    pub rows: Vec<ResultRow>,
    pub n_cases: i64,
    /// Calls per model.
    pub models: Vec<(String, i64)>,
    /// Verdicts of all calls (the `validity` table), in [`ALL_VERDICTS`] order, then others.
    pub validity: Vec<(String, i64)>,
    /// Why the run is not complete (empty when it is).
    pub incomplete: Vec<String>,
    pub examples: Vec<Example>,
    /// Per model: answer length bins (characters) and latency bins (ms).
    pub answer_chars: Vec<(String, Vec<(String, i64)>)>,
    pub latency: Vec<(String, Vec<(String, i64)>)>,
    /// `(model, finish_reason, calls)`.
    pub finish_reasons: Vec<(String, String, i64)>,
    pub gate: Option<Gate>,
    pub comparison: Option<Comparison>,
    pub holdout: Option<Holdout>,
    pub judge: Option<JudgeSection>,
}

impl Report {
    /// Calls in the run.
    pub fn n_calls(&self) -> i64 {
        self.models.iter().map(|m| m.1).sum()
    }

    /// The invalid fraction of all calls.
    pub fn invalid_fraction(&self) -> f64 {
        let total: i64 = self.validity.iter().map(|v| v.1).sum();
        let valid: i64 = self
            .validity
            .iter()
            .filter(|v| v.0 == "valid_answer")
            .map(|v| v.1)
            .sum();
        if total == 0 {
            0.0
        } else {
            1.0 - valid as f64 / total as f64
        }
    }
}

/// A SQL string literal.
fn lit(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

fn int(v: &Option<String>) -> i64 {
    v.as_deref().and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// Answer-length bins: `(lower bound in characters, label)`.
const CHAR_BINS: [(f64, &str); 7] = [
    (0.0, "0"),
    (1.0, "1-9"),
    (10.0, "10-49"),
    (50.0, "50-199"),
    (200.0, "200-999"),
    (1000.0, "1k-5k"),
    (5000.0, "5k+"),
];

/// Latency bins: `(lower bound in milliseconds, label)`.
const LATENCY_BINS: [(f64, &str); 7] = [
    (0.0, "<1 ms"),
    (1.0, "1-9 ms"),
    (10.0, "10-99 ms"),
    (100.0, "0.1-1 s"),
    (1000.0, "1-10 s"),
    (10000.0, "10-60 s"),
    (60000.0, "60 s+"),
];

/// A `CASE` giving the index of the bin of `expr`.
fn bin_case(expr: &str, bins: &[(f64, &str)]) -> String {
    let mut s = String::from("CASE");
    for (i, (lower, _)) in bins.iter().enumerate().rev() {
        s.push_str(&format!(" WHEN {expr} >= {lower:?} THEN {i}"));
    }
    s.push_str(" END");
    s
}

async fn binned(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
    bins: &[(f64, &str)],
    models: &[(String, i64)],
) -> Result<Vec<(String, Vec<(String, i64)>)>, QueryError> {
    let rows = text_rows(ctx, sql).await?;
    Ok(models
        .iter()
        .map(|(m, _)| {
            let counts = bins
                .iter()
                .enumerate()
                .map(|(i, (_, label))| {
                    let n = rows
                        .iter()
                        .filter(|r| {
                            r[0].as_deref() == Some(m.as_str())
                                && r[1].as_deref() == Some(&i.to_string())
                        })
                        .map(|r| int(&r[2]))
                        .sum();
                    (label.to_string(), n)
                })
                .collect();
            (m.clone(), counts)
        })
        .collect())
}

/// Why `manifest` does not describe a complete run (empty when it does).
pub fn incomplete_reasons(manifest: &Manifest) -> Vec<String> {
    STAGES
        .iter()
        .filter_map(|s| match manifest.stages.get(*s).map(|r| r.status) {
            Some(StageStatus::Complete) => None,
            Some(StageStatus::Running) => Some(format!("stage `{s}` did not finish")),
            Some(StageStatus::Failed) => Some(format!("stage `{s}` failed")),
            None => Some(format!("stage `{s}` never ran")),
        })
        .collect()
}

/// Reads what the page shows besides `rows` from the run at `store`.
///
/// # Errors
/// A query over the run's tables fails.
pub async fn gather(
    store: &RunStore,
    manifest: &Manifest,
    scorer: &ScorerId,
    rows: Vec<ResultRow>,
) -> Result<Report, ReportError> {
    let ctx = new_context();
    register_run(&ctx, store, "").await?;
    let n_cases = int(&text_rows(&ctx, "SELECT count(*) FROM cases").await?[0][0]);
    let models: Vec<(String, i64)> = text_rows(
        &ctx,
        "SELECT model, count(*) FROM calls GROUP BY model ORDER BY model",
    )
    .await?
    .iter()
    .map(|r| (r[0].clone().unwrap_or_default(), int(&r[1])))
    .collect();
    let v = text_rows(
        &ctx,
        "SELECT validity, count(*) FROM validity GROUP BY validity ORDER BY validity",
    )
    .await?;
    let mut validity: Vec<(String, i64)> = ALL_VERDICTS
        .iter()
        .map(|name| {
            let n = v
                .iter()
                .filter(|r| r[0].as_deref() == Some(name))
                .map(|r| int(&r[1]))
                .sum();
            (name.to_string(), n)
        })
        .collect();
    for r in &v {
        let name = r[0].clone().unwrap_or_else(|| "NULL".into());
        if !ALL_VERDICTS.contains(&name.as_str()) {
            validity.push((name, int(&r[1])));
        }
    }
    let answer_chars = binned(
        &ctx,
        &format!(
            "SELECT k.model, {} AS bin, count(*) FROM calls k JOIN validity v ON k.call_id = v.call_id \
             WHERE v.answer_chars IS NOT NULL GROUP BY 1, 2",
            bin_case("v.answer_chars", &CHAR_BINS)
        ),
        &CHAR_BINS,
        &models,
    )
    .await?;
    let latency = binned(
        &ctx,
        &format!(
            "SELECT model, {} AS bin, count(*) FROM calls WHERE latency_ms IS NOT NULL GROUP BY 1, 2",
            bin_case("latency_ms", &LATENCY_BINS)
        ),
        &LATENCY_BINS,
        &models,
    )
    .await?;
    let finish_reasons = text_rows(
        &ctx,
        "SELECT model, coalesce(finish_reason, 'NULL'), count(*) FROM calls GROUP BY 1, 2 ORDER BY 1, 3 DESC, 2",
    )
    .await?
    .iter()
    .map(|r| {
        (
            r[0].clone().unwrap_or_default(),
            r[1].clone().unwrap_or_default(),
            int(&r[2]),
        )
    })
    .collect();
    let kind = crate::stages::score::metric_kind(store, scorer).await?;
    let large = rows.iter().filter(|r| r.level == "test").count() > html::OPEN_LIMIT;
    let per_test = if large { 1 } else { EXAMPLES_PER_TEST };
    let examples = examples(&ctx, scorer, kind, per_test).await?;
    Ok(Report {
        root: store.display().to_string(),
        manifest: manifest.clone(),
        scorer: scorer.clone(),
        kind,
        rows,
        n_cases,
        models,
        validity,
        incomplete: incomplete_reasons(manifest),
        examples,
        answer_chars,
        latency,
        finish_reasons,
        gate: None,
        comparison: None,
        holdout: None,
        judge: None,
    })
}

/// Up to `per_test` examples per test and model: failures for pass/fail scorers,
/// the lowest scores for numeric ones, labelled answers for label scorers; each with its base
/// case when it is a perturbation.
async fn examples(
    ctx: &datafusion::prelude::SessionContext,
    scorer: &ScorerId,
    kind: MetricKind,
    per_test: usize,
) -> Result<Vec<Example>, QueryError> {
    let (filter, order) = match kind {
        MetricKind::PassFail => ("s.passed = false", "s.case_id, s.sample_idx"),
        MetricKind::Numeric => ("s.score IS NOT NULL", "s.score, s.case_id, s.sample_idx"),
        MetricKind::Label => ("s.label IS NOT NULL", "s.case_id, s.sample_idx"),
    };
    let sql = format!(
        "WITH f AS (
           SELECT s.model, s.test, s.case_id, s.call_id, s.sample_idx, s.validity, s.passed, s.label, s.score,
                  row_number() OVER (PARTITION BY s.model, s.test ORDER BY {order}) AS k
           FROM scores s
           WHERE s.scorer = {} AND s.scoring_version = {} AND s.role <> 'base' AND {filter})
         SELECT f.model, f.test, c.test_type, f.validity, CAST(f.passed AS VARCHAR), f.label, CAST(f.score AS VARCHAR),
                substr(c.input, 1, {n}), substr(k.response, 1, {n}), CAST(k.response_score AS VARCHAR),
                c.expected, c.expectation,
                substr(bc.input, 1, {n}), substr(bk.response, 1, {n}), CAST(bk.response_score AS VARCHAR)
         FROM f JOIN cases c ON f.case_id = c.case_id
         JOIN calls k ON f.call_id = k.call_id
         LEFT JOIN cases bc ON bc.group_id = c.group_id AND bc.role = 'base' AND c.role = 'perturbed'
         LEFT JOIN calls bk ON bk.case_id = bc.case_id AND bk.model = k.model AND bk.sample_idx = k.sample_idx
         WHERE f.k <= {per_test}
         ORDER BY f.model, f.test, f.k",
        lit(&scorer.name),
        lit(&scorer.version),
        n = EXAMPLE_CHARS + 1,
    );
    Ok(text_rows(ctx, &sql)
        .await?
        .into_iter()
        .map(|mut r| {
            let mut take = |i: usize| r[i].take();
            Example {
                model: take(0).unwrap_or_default(),
                test: take(1).unwrap_or_default(),
                test_type: take(2).unwrap_or_default(),
                validity: take(3).unwrap_or_default(),
                passed: take(4),
                label: take(5),
                score: take(6),
                input: take(7).unwrap_or_default(),
                response: take(8),
                response_score: take(9),
                expected: take(10),
                expectation: take(11),
                base_input: take(12),
                base_response: take(13),
                base_response_score: take(14),
            }
        })
        .collect())
}

/// Writes `page` to `html` (a local file) or, without one, to `<run>/report.html`; returns
/// where it went.
///
/// # Errors
/// The file or the run root cannot be written.
pub async fn write(
    store: &RunStore,
    html: Option<&std::path::Path>,
    page: String,
) -> Result<String, ReportError> {
    match html {
        Some(p) => {
            let io = |source| ReportError::Io {
                path: p.display().to_string(),
                source,
            };
            let tmp = p.with_extension("html.tmp");
            std::fs::write(&tmp, page).map_err(io)?;
            std::fs::rename(&tmp, p).map_err(io)?;
            Ok(p.display().to_string())
        }
        None => {
            store.put("report.html", page.into_bytes()).await?;
            Ok(format!("{}/report.html", store.display()))
        }
    }
}

/// Builds the page of a run whose `rows` are already computed and writes it to
/// `<run>/report.html` (the end of `evalflow run`).
///
/// # Errors
/// As [`gather`] and [`write`].
pub async fn write_for_run(
    store: &RunStore,
    manifest: &Manifest,
    scorer: &ScorerId,
    rows: Vec<ResultRow>,
) -> Result<String, ReportError> {
    let report = gather(store, manifest, scorer, rows).await?;
    write(store, None, html::render(&report)?).await
}

/// The report query behind `compare` (the verb, the report's comparison and the viewer run
/// the same SQL, so they cannot drift).
pub const PAIRED_COMPARISON_SQL: &str = include_str!("../../sql/paired_comparison.sql");

/// Points a report query written for the checklist scorer at `spec` (NAME or NAME@VERSION):
/// its `'checklist'` literals become the name, and with a version, the "newest version"
/// subqueries become that version.
pub fn with_scorer(sql: &str, spec: &str) -> String {
    let (name, version) = spec
        .split_once('@')
        .map_or((spec, None), |(n, v)| (n, Some(v)));
    let lit = |s: &str| format!("'{}'", s.replace('\'', "''"));
    let mut out = sql.to_string();
    if let Some(v) = version {
        for t in ["a_scores", "b_scores", "scores"] {
            out = out.replace(
                &format!("(SELECT max(scoring_version) FROM {t} WHERE scorer = 'checklist')"),
                &lit(v),
            );
        }
    }
    out.replace("'checklist'", &lit(name))
}

/// [`PAIRED_COMPARISON_SQL`] about the scorer `spec` (`NAME` or `NAME@VERSION`).
pub fn paired_comparison_sql(spec: &str) -> String {
    with_scorer(PAIRED_COMPARISON_SQL, spec)
}
