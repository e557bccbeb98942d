//! `evalflow compare RUN_A RUN_B`: is B better than A on the same cases?
//!
//! Runs `sql/paired_comparison.sql` (embedded, so the verb and the report query cannot drift):
//! K samples averaged per case, runs paired on case_id, d = B - A, SE clustered by template,
//! per test, per capability and overall, with the MDE and a verdict.

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::util::pretty::pretty_format_batches;

use super::CliError;
use crate::query::{new_context, register_run};
use crate::stages::score::ScorerId;
use crate::storage::RunStore;

/// The report query behind `compare`.
pub const PAIRED_COMPARISON_SQL: &str = include_str!("../../sql/paired_comparison.sql");

#[derive(Debug, clap::Args)]
pub struct CompareArgs {
    /// Run A (the baseline) root.
    pub run_a: String,
    /// Run B (the candidate) root.
    pub run_b: String,
    /// Exit 1 unless B is significantly better than A overall (95% interval above zero).
    #[arg(long)]
    pub require_improvement: bool,
    /// The scorer compared, NAME or NAME@VERSION (default: run A's first scorer; without a
    /// version each run's newest version of it).
    #[arg(long)]
    pub scorer: Option<String>,
    #[command(flatten)]
    pub cluster: super::ClusterArg,
}

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

/// The verdict of the `overall` row, if any.
fn overall_verdict(batches: &[RecordBatch]) -> Option<String> {
    for b in batches {
        let scope = b.column_by_name("scope")?.as_string_opt::<i32>()?;
        let verdict = b.column_by_name("verdict")?.as_string_opt::<i32>()?;
        for i in 0..b.num_rows() {
            if scope.value(i) == "overall" && verdict.is_valid(i) {
                return Some(verdict.value(i).to_string());
            }
        }
    }
    None
}

pub async fn run(a: CompareArgs) -> Result<(), CliError> {
    let ctx = session_with_runs(&[&a.run_a, &a.run_b]).await?;
    let spec = chosen_scorer(&[&a.run_a, &a.run_b], a.scorer.as_deref()).await?;
    let batches = collect(&ctx, "compare", &with_scorer(PAIRED_COMPARISON_SQL, &spec)).await?;
    let n: usize = batches.iter().map(RecordBatch::num_rows).sum();
    if n == 0 {
        return Err(CliError::BadInput(format!(
            "compare: {} and {} share no cases scored by `{spec}` (joined on case_id)",
            a.run_a, a.run_b
        )));
    }
    let table = pretty_format_batches(&batches).map_err(|e| CliError::Internal(e.to_string()))?;
    println!(
        "A = {}\nB = {}\nscorer: {spec} (score of B minus score of A)\n{table}",
        a.run_a, a.run_b
    );
    let verdict = overall_verdict(&batches).unwrap_or_else(|| "could not tell".into());
    println!("overall: {verdict}");
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
