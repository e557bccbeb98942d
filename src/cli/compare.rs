//! `evalflow compare RUN_A RUN_B`: is B better than A on the same cases?
//!
//! Runs `sql/paired_comparison.sql` (embedded, so the verb and the report query cannot drift):
//! K samples averaged per case, runs paired on case_id, d = B - A, SE clustered by template,
//! per test, per capability and overall, with the MDE and a verdict.

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::util::pretty::pretty_format_batches;

use super::CliError;
use crate::query::{new_context, register_run};
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
    let batches = collect(&ctx, "compare", PAIRED_COMPARISON_SQL).await?;
    let n: usize = batches.iter().map(RecordBatch::num_rows).sum();
    if n == 0 {
        return Err(CliError::BadInput(format!(
            "compare: {} and {} share no scored cases (joined on case_id)",
            a.run_a, a.run_b
        )));
    }
    let table = pretty_format_batches(&batches).map_err(|e| CliError::Internal(e.to_string()))?;
    println!("A = {}\nB = {}\n{table}", a.run_a, a.run_b);
    let verdict = overall_verdict(&batches).unwrap_or_else(|| "could not tell".into());
    println!("overall: {verdict}");
    if a.require_improvement && verdict != "B better" {
        return Err(CliError::Gate(format!(
            "--require-improvement: B is not significantly better than A ({verdict})"
        )));
    }
    Ok(())
}
