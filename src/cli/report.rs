//! `evalflow report RUN`: the results table with its validity distribution and, given a
//! hand-labelled holdout, each class's rate corrected for the scorer's measured error
//! (Rogan-Gladen, with a delta-method 95% interval from `rogan_gladen_ci`).
//!
//! You are never claiming the scorer is right, only quantifying how wrong it is: the
//! labelled sample sizes the error estimate, not the corpus.
//!
//! It also writes the run's HTML page (`crate::report`): by default `<run>/report.html`,
//! with `--compare RUN_B` the paired comparison of `compare RUN RUN_B` and with
//! `--baseline F` the invalid-rate gate of `check --baseline F`.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

use super::{CliError, internal};
use crate::query::{open_run, text_rows};
use crate::report::Prevalence;
use crate::stages::aggregate::{self, render_table};
use crate::stages::score::{self, ScorerId};
use crate::storage::RunStore;

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// The run root.
    pub run: String,
    /// A hand-labelled holdout (CSV `call_id,label`) for the Rogan-Gladen correction.
    #[arg(long)]
    pub holdout: Option<PathBuf>,
    /// The scorer version reported (its results, the page, the holdout's corrected labels):
    /// NAME@VERSION or NAME (the run's newest version of it), any version scored in the run,
    /// such as a user scorer added by `rescore`; default: the run's first.
    #[arg(long, value_name = "NAME[@VERSION]")]
    pub scorer: Option<String>,
    /// Replacement cue lists for the cue scorer.
    #[arg(long)]
    pub cues: Option<PathBuf>,
    /// Where to write the HTML page (default <run>/report.html).
    #[arg(long)]
    pub html: Option<PathBuf>,
    /// A second run on the same cases: the page adds the paired comparison B - A with
    /// B = this run (as `evalflow compare RUN RUN_B`).
    #[arg(long, value_name = "RUN_B")]
    pub compare: Option<String>,
    /// A baseline file of `evalflow check --write-baseline`: the page shows the invalid-rate
    /// gate, with a red banner when it fails.
    #[arg(long)]
    pub baseline: Option<PathBuf>,
    /// A stated latent ICC of the templates in [0, 1), as `evalflow aggregate --icc`: each
    /// failure rate's interval also covers the exact one under a logit-normal template model.
    #[arg(long, value_name = "RHO", value_parser = super::parse_icc)]
    pub icc: Option<f64>,
    /// Largest drift of the invalid fraction, in percentage points, before the gate fails.
    #[arg(long, default_value_t = 5.0)]
    pub max_drift_pp: f64,
    /// A judge model from `evalflow judge train`: the page adds its predictions with conformal
    /// intervals over the run's judge answers, and a SHAP waterfall.
    #[arg(long)]
    pub judge_model: Option<PathBuf>,
    /// The judge scorer whose answers the model reads (NAME or NAME@VERSION).
    #[arg(long, default_value = "judge")]
    pub judge_scorer: String,
    /// The unit whose waterfall is drawn (default: the first predicted unit).
    #[arg(long)]
    pub judge_unit: Option<String>,
    #[command(flatten)]
    pub cluster: super::ClusterArg,
}

/// Corrects each class's rate among the run's valid scored rows of `scorer` using the
/// holdout's one-vs-rest confusion matrices.
pub async fn prevalence(
    store: &RunStore,
    scorer: &dyn score::Scorer,
    labels: &[(String, String)],
) -> Result<Vec<Prevalence>, CliError> {
    let ids: Vec<String> = labels.iter().map(|(i, _)| i.clone()).collect();
    let scored = score::score_calls(store, scorer, &ids)
        .await
        .map_err(internal)?;
    let pairs: Vec<(&str, &str)> = labels
        .iter()
        .filter_map(|(id, truth)| {
            let (v, o) = scored.get(id)?;
            (v == "valid_answer").then_some((truth.as_str(), o.label.as_deref()?))
        })
        .collect();
    if pairs.len() < labels.len() {
        return Err(CliError::BadInput(format!(
            "enumeration drift: {} of {} holdout labels point at calls that are missing or not scorable",
            labels.len() - pairs.len(),
            labels.len()
        )));
    }
    let id = scorer.id();
    let ctx = crate::query::new_context();
    crate::query::register_run(&ctx, store, "")
        .await
        .map_err(internal)?;
    let counts = text_rows(
        &ctx,
        &format!(
            "SELECT label, count(*) FROM scores WHERE scorer = '{}' AND scoring_version = '{}' \
             AND validity = 'valid_answer' AND label IS NOT NULL GROUP BY label",
            id.name, id.version
        ),
    )
    .await
    .map_err(|e| CliError::BadInput(format!("{e} (score the run with {} first)", id.tag())))?;
    let by_label: HashMap<String, u64> = counts
        .iter()
        .map(|r| {
            (
                r[0].clone().unwrap_or_default(),
                r[1].as_deref().and_then(|x| x.parse().ok()).unwrap_or(0),
            )
        })
        .collect();
    let n: u64 = by_label.values().sum();
    let classes: BTreeSet<&str> = pairs.iter().flat_map(|(t, p)| [*t, *p]).collect();
    let mut out = Vec::new();
    for c in classes {
        let count = |f: &dyn Fn(bool, bool) -> bool| {
            pairs.iter().filter(|(t, p)| f(*t == c, *p == c)).count() as u64
        };
        let (tp, fn_, tn, fp) = (
            count(&|t, p| t && p),
            count(&|t, p| t && !p),
            count(&|t, p| !t && !p),
            count(&|t, p| !t && p),
        );
        let pos = by_label.get(c).copied().unwrap_or(0);
        let r = text_rows(
            &ctx,
            &format!(
                "SELECT x.estimate, x.se, x.lo, x.hi FROM (SELECT rogan_gladen_ci({pos}, {n}, {tp}, {fn_}, {tn}, {fp}) AS x)"
            ),
        )
        .await
        .map_err(internal)?;
        let vals: Option<Vec<f64>> = r[0]
            .iter()
            .map(|v| v.as_deref().and_then(|s| s.parse().ok()))
            .collect();
        out.push(Prevalence {
            class: c.to_string(),
            pos,
            n,
            tp,
            fn_,
            tn,
            fp,
            corrected: vals.map(|v| [v[0], v[1], v[2], v[3]]),
        });
    }
    Ok(out)
}

/// Renders the prevalence table.
pub fn render_prevalence(rows: &[Prevalence], labelled: usize) -> String {
    let pct = |x: f64| format!("{:.1}%", x * 100.0);
    let t: Vec<Vec<String>> = rows
        .iter()
        .map(|p| {
            let sens = p.tp as f64 / (p.tp + p.fn_).max(1) as f64;
            let spec = p.tn as f64 / (p.tn + p.fp).max(1) as f64;
            vec![
                p.class.clone(),
                format!("{} / {}", p.pos, p.n),
                pct(p.pos as f64 / p.n.max(1) as f64),
                p.corrected
                    .map(|c| pct(c[0]))
                    .unwrap_or_else(|| "- (sens + spec <= 1)".into()),
                p.corrected
                    .map(|c| format!("[{}, {}]", pct(c[2]), pct(c[3])))
                    .unwrap_or_else(|| "-".into()),
                format!("{:.0}% / {:.0}%", sens * 100.0, spec * 100.0),
            ]
        })
        .collect();
    format!(
        "Prevalence per class, corrected for the scorer's error on {labelled} hand-labelled calls (Rogan-Gladen)\n{}",
        render_table(
            &[
                "class",
                "rows",
                "raw rate",
                "corrected",
                "95% CI",
                "sens / spec"
            ],
            &t
        )
    )
}

pub async fn run(a: ReportArgs) -> Result<(), CliError> {
    let (_, store, manifest) = open_run(&a.run)
        .await
        .map_err(|e| CliError::BadInput(e.to_string()))?;
    let id = match &a.scorer {
        Some(spec) => scorer_of_run(&store, &manifest, spec).await?,
        None => manifest
            .scorer_versions
            .first()
            .and_then(|t| ScorerId::parse(t))
            .ok_or_else(|| {
                CliError::BadInput(format!("{}: the run has no scores yet", store.display()))
            })?,
    };
    println!(
        "run {} ({}), scorer {}\n",
        manifest.run_id,
        store.display(),
        id.tag()
    );
    // Default: the ICC the run's results were aggregated with.
    let icc = a.icc.or_else(|| {
        manifest
            .stages
            .get("aggregate")
            .and_then(|s| s.details.get("icc"))
            .and_then(|v| v.as_f64())
    });
    let rows = aggregate::compute(&store, &id, icc)
        .await
        .map_err(internal)?;
    println!("{}", aggregate::render(&rows));
    // Read the page's inputs before any output, so that bad input fails before writing.
    let gate = match &a.baseline {
        Some(p) => Some(read_gate(p, a.max_drift_pp)?),
        None => None,
    };
    let comparison = match &a.compare {
        Some(b) => Some(comparison(&a.run, b, a.scorer.as_deref()).await?),
        None => None,
    };
    let mut holdout_page = None;
    if let Some(h) = &a.holdout {
        let labels = super::holdout::read_labels(h)?;
        let scorer = score::build_for_run(&id.name, a.cues.as_deref(), &store, &manifest.pipeline)
            .await
            .map_err(|e| {
                if e.is_bad_input() {
                    CliError::BadInput(format!("--scorer: {e}"))
                } else {
                    CliError::Internal(e.to_string())
                }
            })?;
        if scorer.id() != id {
            return Err(CliError::BadInput(format!(
                "the holdout re-scores with {} but the report is of {}: pass --scorer {}",
                scorer.id().tag(),
                id.tag(),
                scorer.id().tag()
            )));
        }
        let p = prevalence(&store, scorer.as_ref(), &labels).await?;
        println!("\n{}", render_prevalence(&p, labels.len()));
        holdout_page = Some(crate::report::Holdout {
            file: h.display().to_string(),
            labelled: labels.len(),
            rows: p,
        });
    }
    let judge_page = match &a.judge_model {
        Some(m) => Some(
            crate::report::judge_section(&a.run, &a.judge_scorer, m, a.judge_unit.as_deref(), 200)
                .await
                .map_err(|e| match e {
                    crate::judge::JudgeError::Gbdt(_) | crate::judge::JudgeError::Encode(_) => {
                        internal(e)
                    }
                    e => CliError::BadInput(format!("--judge-model {}: {e}", m.display())),
                })?,
        ),
        None => None,
    };
    let mut page = crate::report::gather(&store, &manifest, &id, rows)
        .await
        .map_err(internal)?;
    if let Some(mut g) = gate {
        g.invalid = page.invalid_fraction();
        page.gate = Some(g);
    }
    page.comparison = comparison;
    page.holdout = holdout_page;
    page.judge = judge_page;
    let html = crate::report::html::render(&page).map_err(internal)?;
    let at = crate::report::write(&store, a.html.as_deref(), html)
        .await
        .map_err(|e| match e {
            crate::report::ReportError::Io { .. } => CliError::BadInput(e.to_string()),
            e => internal(e),
        })?;
    println!("\nreport: {at}");
    Ok(())
}

/// The invalid-rate gate against the baseline file `p` (this run's fraction filled in later).
fn read_gate(p: &std::path::Path, max_drift_pp: f64) -> Result<crate::report::Gate, CliError> {
    let text = std::fs::read(p).map_err(|e| CliError::BadInput(format!("{}: {e}", p.display())))?;
    let b: super::check::Baseline = serde_json::from_slice(&text)
        .map_err(|e| CliError::BadInput(format!("{}: not a baseline file: {e}", p.display())))?;
    Ok(crate::report::Gate {
        baseline_file: p.display().to_string(),
        baseline_run: b.run_id,
        baseline_invalid: b.invalid_fraction,
        invalid: 0.0,
        max_drift_pp,
    })
}

/// The scorer version `spec` (NAME@VERSION, or NAME for the run's newest version of it) of
/// a run: one the manifest lists or whose `scores/` folder holds parts.
///
/// # Errors
/// [`CliError::BadInput`] naming the run and the versions it has, when it has no scores of
/// `spec`.
pub(crate) async fn scorer_of_run(
    store: &RunStore,
    manifest: &crate::storage::Manifest,
    spec: &str,
) -> Result<ScorerId, CliError> {
    let mut have: Vec<String> = manifest.scorer_versions.clone();
    for p in store.list_parts("scores").await.map_err(internal)? {
        let tag = p
            .location
            .as_ref()
            .rsplit('/')
            .nth(1)
            .filter(|t| t.contains('@'))
            .map(String::from);
        if let Some(t) = tag
            && !have.contains(&t)
        {
            have.push(t);
        }
    }
    let found = match ScorerId::parse(spec) {
        Some(id) => have.contains(&id.tag()).then_some(id),
        // The manifest lists versions in the order they were scored: the last is the newest.
        None => have
            .iter()
            .rev()
            .filter_map(|t| ScorerId::parse(t))
            .find(|id| id.name == spec),
    };
    found.ok_or_else(|| {
        CliError::BadInput(format!(
            "--scorer {spec}: {} has no scores of it (it has: {})",
            store.display(),
            if have.is_empty() {
                "none".to_string()
            } else {
                have.join(", ")
            }
        ))
    })
}

/// The paired comparison of `compare run_a run_b`, through the same query and scorer choice.
async fn comparison(
    run_a: &str,
    run_b: &str,
    scorer: Option<&str>,
) -> Result<crate::report::Comparison, CliError> {
    use super::compare::{
        PAIRED_COMPARISON_SQL, chosen_scorer, collect, session_with_runs, with_scorer,
    };
    use datafusion::arrow::util::display::array_value_to_string;
    let ctx = session_with_runs(&[run_a, run_b]).await?;
    let spec = chosen_scorer(&[run_a, run_b], scorer).await?;
    let batches = collect(
        &ctx,
        "report --compare",
        &with_scorer(PAIRED_COMPARISON_SQL, &spec),
    )
    .await?;
    let mut rows = Vec::new();
    for b in &batches {
        let cell = |name: &str, i: usize| -> Option<String> {
            let c = b.column_by_name(name)?;
            (!c.is_null(i)).then(|| array_value_to_string(c, i).unwrap_or_default())
        };
        let f = |name: &str, i: usize| {
            cell(name, i)
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|v| v.is_finite())
        };
        let n = |name: &str, i: usize| cell(name, i).and_then(|v| v.parse::<i64>().ok());
        for i in 0..b.num_rows() {
            rows.push(crate::report::CompareRow {
                scope: cell("level", i).unwrap_or_default(),
                capability: cell("capability", i).unwrap_or_default(),
                test: cell("test", i).unwrap_or_default(),
                n_cases: n("n_pairs", i),
                n_templates: n("templates", i),
                n_unpaired: n("n_unpaired", i),
                mean_a: f("mean_a", i),
                mean_b: f("mean_b", i),
                diff: f("diff", i),
                se: f("se", i),
                lo: f("lo", i),
                hi: f("hi", i),
                p_value: f("p_value", i),
                mde: f("mde", i),
                verdict: cell("verdict", i).unwrap_or_default(),
            });
        }
    }
    if rows.is_empty() {
        return Err(CliError::BadInput(format!(
            "report --compare: {run_a} and {run_b} share no cases scored by `{spec}` (joined on case_id)"
        )));
    }
    Ok(crate::report::Comparison {
        run_a: run_a.to_string(),
        run_b: run_b.to_string(),
        scorer: spec,
        rows,
    })
}
