//! `evalflow plan --delta D [--pilot RUN_A RUN_B | --var-d V] [--k K]`: cases needed.
//!
//! Miller (2024): n = (z_{alpha/2} + z_{1-power})^2 * var_d / delta^2. With a pilot pair, var_d
//! is split into omega^2 (true per-case differences) and the runs' sampling noise, so the
//! K-samples term var_d(K) = omega^2 + (sigma_A^2 + sigma_B^2) / K is computed for the K asked;
//! this runs `sql/power_plan.sql` (embedded) with the requested delta and K.

use datafusion::arrow::util::pretty::pretty_format_batches;

use super::CliError;
use super::compare::{chosen_scorer, collect, session_with_runs, with_scorer};
use crate::udaf::mde::mde;
use crate::udaf::sample_size::sample_size;

/// The report query behind `plan --pilot`.
pub const POWER_PLAN_SQL: &str = include_str!("../../sql/power_plan.sql");
const DELTAS: &str = "(VALUES (0.01), (0.02), (0.03), (0.05), (0.10)) AS t(delta)";
const KS: &str = "(VALUES (1), (2), (4), (8)) AS k(k)";

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Smallest difference worth detecting, on the score scale (e.g. 0.03).
    #[arg(long)]
    pub delta: f64,
    /// A pilot pair of runs (A then B) to estimate the variance of per-case differences.
    #[arg(long, num_args = 2, value_names = ["RUN_A", "RUN_B"], conflicts_with = "var_d")]
    pub pilot: Option<Vec<String>>,
    /// The variance of per-case differences, if known (Miller's example: 1/9 = 0.1111).
    #[arg(long)]
    pub var_d: Option<f64>,
    /// Samples per case planned (default 1; with --pilot the sampling-noise term shrinks as 1/K).
    #[arg(long, default_value_t = 1)]
    pub k: u32,
    /// Two-sided significance level.
    #[arg(long, default_value_t = 0.05)]
    pub alpha: f64,
    /// Power.
    #[arg(long, default_value_t = 0.8)]
    pub power: f64,
    /// With --pilot: the scorer, NAME or NAME@VERSION (default: pilot A's first scorer).
    #[arg(long)]
    pub scorer: Option<String>,
}

/// The pilot query for one delta and one K.
pub fn pilot_sql(delta: f64, k: u32) -> String {
    debug_assert!(POWER_PLAN_SQL.contains(DELTAS) && POWER_PLAN_SQL.contains(KS));
    POWER_PLAN_SQL
        .replace(
            DELTAS,
            &format!("(VALUES (CAST({delta:?} AS DOUBLE))) AS t(delta)"),
        )
        .replace(KS, &format!("(VALUES ({k})) AS k(k)"))
}

pub async fn run(a: PlanArgs) -> Result<(), CliError> {
    if !(a.delta.is_finite() && a.delta != 0.0) {
        return Err(CliError::BadInput(format!(
            "--delta {}: must be a non-zero number",
            a.delta
        )));
    }
    if !(a.alpha > 0.0 && a.alpha < 1.0 && a.power > 0.0 && a.power < 1.0) {
        return Err(CliError::BadInput(
            "--alpha and --power must be between 0 and 1".into(),
        ));
    }
    if a.k == 0 {
        return Err(CliError::BadInput("--k must be at least 1".into()));
    }
    match (&a.pilot, a.var_d) {
        (None, Some(v)) => {
            let n = sample_size(a.delta, v, a.alpha, a.power).ok_or_else(|| {
                CliError::BadInput(format!("--var-d {v}: must be a non-negative number"))
            })?;
            println!(
                "cases needed: {n}  (delta {}, var_d {v}, alpha {}, power {})",
                a.delta, a.alpha, a.power
            );
            if let Some(m) = mde(n as f64, v, a.alpha, a.power) {
                println!("minimum detectable effect at n = {n}: {m:.4}");
            }
            Ok(())
        }
        (Some(p), None) => {
            let ctx = session_with_runs(&[&p[0], &p[1]]).await?;
            if a.alpha != 0.05 || a.power != 0.8 {
                return Err(CliError::BadInput(
                    "--alpha/--power other than 0.05/0.8 need --var-d (the pilot report uses the defaults)".into(),
                ));
            }
            let spec = chosen_scorer(&[&p[0], &p[1]], a.scorer.as_deref()).await?;
            let sql = with_scorer(&pilot_sql(a.delta, a.k), &spec);
            let batches = collect(&ctx, "plan", &sql).await?;
            let table =
                pretty_format_batches(&batches).map_err(|e| CliError::Internal(e.to_string()))?;
            println!(
                "pilot A = {}\npilot B = {}\nscorer: {spec}\n{table}",
                p[0], p[1]
            );
            Ok(())
        }
        _ => Err(CliError::BadInput(
            "plan needs --pilot RUN_A RUN_B or --var-d V".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pilot_sql_substitutes_delta_and_k() {
        let sql = pilot_sql(0.03, 4);
        assert!(!sql.contains(DELTAS) && !sql.contains(KS));
        assert!(sql.contains("CAST(0.03 AS DOUBLE)") && sql.contains("(VALUES (4)) AS k(k)"));
    }
}
