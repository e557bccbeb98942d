//! `evalflow compare RUN_A RUN_B`: is B better than A on the same cases?
//!
//! Runs `sql/paired_comparison.sql` (embedded, so the verb and the report query cannot drift):
//! K samples averaged per case, runs paired on case_id, d = B - A, SE clustered by template,
//! per test, per capability and overall, with the MDE and a verdict.

use datafusion::arrow::array::{Array, AsArray, RecordBatch};

use super::CliError;
use crate::query::{new_context, register_run};
use crate::stages::score::ScorerId;
use crate::storage::RunStore;

pub use crate::report::{PAIRED_COMPARISON_SQL, with_scorer};

/// `compare`'s help after the options: the row fields, which `--format json` keeps stable for
/// scripts and the Python package.
const FIELDS_HELP: &str = "\
Rows (one per test, per capability and overall; the same fields in every format):
  level        test | capability | overall
  capability   the capability, '(all)' on the overall row
  test         the test, '(all)' on capability and overall rows
  n_pairs      cases scored in both A and B (every number below comes from these pairs)
  n_unpaired   cases scored in one run only (a provider error, a case missing from the
               other run): counted here, left out of every other number
  mean_a       mean score of A over the pairs (K samples averaged per case first)
  mean_b       mean score of B over the same pairs
  diff         mean_b - mean_a
  se           clustered SE of the paired difference (by template)
  lo, hi       its 95% interval
  templates    templates among the pairs (never more than n_pairs)
  mde          smallest difference detectable with 80% power at alpha 0.05, from the SE the
               interval implies, (hi - lo) / (2 * 1.96)
  method       the interval's method (paired_diff_clustered)
  verdict      B better | A better | no difference (...) | could not tell (...) | cannot tell: ...
  z, p_value   the test of diff = 0
--format json prints one JSON array of these row objects (NULL as null).";

#[derive(Debug, clap::Args)]
#[command(after_long_help = FIELDS_HELP)]
pub struct CompareArgs {
    /// Run A (the baseline) root.
    pub run_a: String,
    /// Run B (the candidate) root; omit it with --model-a and --model-b to compare two
    /// models of run A.
    pub run_b: Option<String>,
    /// Compare only this model's calls of run A (with --model-b and no RUN_B: two models of
    /// one run or one imported corpus, paired on their shared cases).
    #[arg(long, value_name = "MODEL")]
    pub model_a: Option<String>,
    /// Compare only this model's calls of run B (or of run A when RUN_B is omitted).
    #[arg(long, value_name = "MODEL")]
    pub model_b: Option<String>,
    /// Exit 1 unless B is significantly better than A overall (95% interval above zero).
    #[arg(long)]
    pub require_improvement: bool,
    /// The scorer compared, NAME or NAME@VERSION (default: run A's first scorer; without a
    /// version each run's newest version of it).
    #[arg(long)]
    pub scorer: Option<String>,
    /// `table` (for reading), `csv` (a header row) or `json` (one array of row objects); the
    /// fields are listed under --help.
    #[arg(long, default_value = "table", value_parser = ["table", "csv", "json"])]
    pub format: String,
    /// Write the output to this file instead of stdout (written under FILE.tmp and renamed
    /// when complete).
    #[arg(long, value_name = "FILE")]
    pub output: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub cluster: super::ClusterArg,
}

/// The scorer a comparison of `runs` is about: `--scorer`, else the first scorer of the
/// first run's manifest. Errors when a run has no scores of that name.
pub(crate) async fn chosen_scorer(runs: &[&str], scorer: Option<&str>) -> Result<String, CliError> {
    let mut manifests = Vec::new();
    for run in runs {
        let store = RunStore::open(run).map_err(|e| CliError::BadInput(format!("{run}: {e}")))?;
        let m = crate::storage::Manifest::load(&store)
            .await
            .map_err(|e| CliError::BadInput(format!("{run}: {e}")))?
            .ok_or_else(|| {
                CliError::BadInput(format!("{run}: not an evalflow run (no manifest.json)"))
            })?;
        manifests.push((run, m));
    }
    let spec = match scorer {
        Some(s) => s.to_string(),
        None => manifests
            .first()
            .and_then(|(_, m)| m.scorer_versions.first())
            .and_then(|t| ScorerId::parse(t))
            .map(|id| id.name)
            .ok_or_else(|| CliError::BadInput(format!("{}: the run has no scores yet", runs[0])))?,
    };
    let name = spec.split('@').next().unwrap_or(&spec);
    for (run, m) in &manifests {
        let has = m.scorer_versions.iter().any(|t| {
            ScorerId::parse(t)
                .is_some_and(|id| id.name == name && (!spec.contains('@') || id.tag() == spec))
        });
        if !has {
            return Err(CliError::BadInput(format!(
                "{run}: no scores of `{spec}` (the run has: {})",
                m.scorer_versions.join(", ")
            )));
        }
    }
    Ok(spec)
}

/// Registers `runs` as `a_*`, `b_*`, ... in a fresh session.
pub(crate) async fn session_with_runs(
    runs: &[&str],
) -> Result<datafusion::prelude::SessionContext, CliError> {
    let ctx = new_context();
    for (i, run) in runs.iter().enumerate() {
        if !run.contains("://") && !std::path::Path::new(run).exists() {
            return Err(CliError::BadInput(format!("{run}: no such run root")));
        }
        let store = RunStore::open(run).map_err(|e| CliError::BadInput(format!("{run}: {e}")))?;
        let prefix = format!("{}_", (b'a' + i as u8) as char);
        register_run(&ctx, &store, &prefix)
            .await
            .map_err(|e| CliError::BadInput(format!("{run}: {e}")))?;
    }
    Ok(ctx)
}

/// Runs `sql` and collects its rows; errors name the verb.
pub(crate) async fn collect(
    ctx: &datafusion::prelude::SessionContext,
    verb: &str,
    sql: &str,
) -> Result<Vec<RecordBatch>, CliError> {
    let df = ctx
        .sql(sql)
        .await
        .map_err(|e| CliError::Internal(format!("{verb}: {e}")))?;
    df.collect()
        .await
        .map_err(|e| CliError::Internal(format!("{verb}: {e}")))
}

/// A cell of the `overall` row, as text, if any.
fn overall_cell(batches: &[RecordBatch], col: &str) -> Option<String> {
    use datafusion::arrow::util::display::array_value_to_string;
    for b in batches {
        let level = b.column_by_name("level")?.as_string_opt::<i32>()?;
        let c = b.column_by_name(col)?;
        for i in 0..b.num_rows() {
            if level.value(i) == "overall" && c.is_valid(i) {
                return array_value_to_string(c, i).ok();
            }
        }
    }
    None
}

/// Whether a row with an interval has fewer than [`FEW_TEMPLATES`] templates (2 or more:
/// one template is no clustered interval at all).
///
/// [`FEW_TEMPLATES`]: crate::stages::aggregate::FEW_TEMPLATES
fn few_templates(batches: &[RecordBatch]) -> bool {
    use datafusion::arrow::util::display::array_value_to_string;
    batches.iter().any(|b| {
        let (Some(t), Some(lo)) = (b.column_by_name("templates"), b.column_by_name("lo")) else {
            return false;
        };
        (0..b.num_rows()).any(|i| {
            lo.is_valid(i)
                && array_value_to_string(t, i)
                    .ok()
                    .and_then(|v| v.parse::<i64>().ok())
                    .is_some_and(|n| (2..crate::stages::aggregate::FEW_TEMPLATES).contains(&n))
        })
    })
}

/// The total number of unpaired cases, and the overall row's n_pairs.
fn counts(batches: &[RecordBatch]) -> (i64, i64) {
    let n = |c: &str| overall_cell(batches, c).and_then(|v| v.parse().ok());
    (n("n_unpaired").unwrap_or(0), n("n_pairs").unwrap_or(0))
}

/// Replaces `<side>_scores` with the rows of `model` only, after checking the side has it.
async fn only_model(
    ctx: &datafusion::prelude::SessionContext,
    side: char,
    run: &str,
    model: &str,
) -> Result<(), CliError> {
    use datafusion::arrow::util::display::array_value_to_string;
    let table = format!("{side}_scores");
    let lit = model.replace('\'', "''");
    let models = collect(
        ctx,
        "compare",
        &format!("SELECT DISTINCT model FROM {table} ORDER BY model"),
    )
    .await?;
    let mut have = Vec::new();
    for b in &models {
        for i in 0..b.num_rows() {
            have.push(array_value_to_string(b.column(0), i).map_err(super::internal)?);
        }
    }
    if !have.iter().any(|m| m == model) {
        return Err(CliError::BadInput(format!(
            "--model-{side} {model}: {run} has no scores of that model (it has: {})",
            if have.is_empty() {
                "none".to_string()
            } else {
                have.join(", ")
            }
        )));
    }
    let df = ctx
        .sql(&format!("SELECT * FROM {table} WHERE model = '{lit}'"))
        .await
        .map_err(|e| CliError::Internal(format!("compare: {e}")))?;
    let view = df.into_view();
    ctx.deregister_table(table.as_str())
        .map_err(|e| CliError::Internal(format!("compare: {e}")))?;
    ctx.register_table(table.as_str(), view)
        .map_err(|e| CliError::Internal(format!("compare: {e}")))?;
    Ok(())
}

pub async fn run(a: CompareArgs) -> Result<(), CliError> {
    let run_b = match (&a.run_b, &a.model_a, &a.model_b) {
        (Some(b), _, _) => b.clone(),
        (None, Some(ma), Some(mb)) if ma != mb => a.run_a.clone(),
        (None, Some(_), Some(_)) => {
            return Err(CliError::BadInput(
                "compare: --model-a and --model-b name the same model".into(),
            ));
        }
        (None, _, _) => {
            return Err(CliError::BadInput(
                "compare: give RUN_B, or --model-a A --model-b B to compare two models of one run"
                    .into(),
            ));
        }
    };
    let ctx = session_with_runs(&[&a.run_a, &run_b]).await?;
    let spec = chosen_scorer(&[&a.run_a, &run_b], a.scorer.as_deref()).await?;
    if let Some(m) = &a.model_a {
        only_model(&ctx, 'a', &a.run_a, m).await?;
    }
    if let Some(m) = &a.model_b {
        only_model(&ctx, 'b', &run_b, m).await?;
    }
    let side = |run: &str, model: &Option<String>| match model {
        Some(m) => format!("{run} (model {m})"),
        None => run.to_string(),
    };
    let (name_a, name_b) = (side(&a.run_a, &a.model_a), side(&run_b, &a.model_b));
    let batches = collect(&ctx, "compare", &with_scorer(PAIRED_COMPARISON_SQL, &spec)).await?;
    let (unpaired, pairs) = counts(&batches);
    if pairs == 0 {
        return Err(CliError::BadInput(format!(
            "compare: {name_a} and {name_b} share no cases scored by `{spec}` (joined on case_id; {unpaired} scored in one only)"
        )));
    }
    let verdict = overall_cell(&batches, "verdict").unwrap_or_else(|| "could not tell".into());
    let (target, mut w) = super::sql::Target::open(a.output.as_deref())?;
    if a.format == "table" {
        use std::io::Write;
        let io = super::sql::write_failed;
        writeln!(
            w,
            "A = {name_a}\nB = {name_b}\nscorer: {spec} (score of B minus score of A, over the cases scored in both)"
        )
        .map_err(io)?;
        super::sql::write_table(&batches, &mut w)?;
        if unpaired > 0 {
            writeln!(
                w,
                "unpaired: {unpaired} case{} scored in one run only (n_unpaired), left out of every mean, count and interval",
                if unpaired == 1 { "" } else { "s" }
            )
            .map_err(io)?;
        }
        if few_templates(&batches) {
            writeln!(
                w,
                "few templates: a row over fewer than {} templates (`templates`) has a clustered \
                 interval with at most templates - 1 degrees of freedom, so it is wide; more \
                 templates narrow it (`evalflow plan` says how many)",
                crate::stages::aggregate::FEW_TEMPLATES
            )
            .map_err(io)?;
        }
        writeln!(w, "overall: {verdict}").map_err(io)?;
    } else {
        let schema = batches
            .first()
            .map(RecordBatch::schema)
            .ok_or_else(|| CliError::Internal("compare: no rows".into()))?;
        let mut sink = super::sql::Sink::new(&a.format, &schema, w)?;
        for b in &batches {
            sink.write(b)?;
        }
        w = sink.finish()?;
    }
    target.commit(w)?;
    if a.require_improvement && verdict != "B better" {
        return Err(CliError::Gate(format!(
            "--require-improvement: B is not significantly better than A ({verdict})"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_scorer_names_the_scorer_and_pins_a_version() {
        let sql = with_scorer(PAIRED_COMPARISON_SQL, "cue");
        assert!(!sql.contains("'checklist'") && sql.contains("scorer = 'cue'"));
        assert!(sql.contains("SELECT max(scoring_version) FROM a_scores WHERE scorer = 'cue'"));
        let sql = with_scorer(PAIRED_COMPARISON_SQL, "judge@1");
        assert!(!sql.contains("max(scoring_version)"), "{sql}");
        assert!(sql.contains("scorer = 'judge' AND scoring_version = '1'"));
    }
}
