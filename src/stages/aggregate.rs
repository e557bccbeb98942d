//! Aggregate: failure rates per test and per capability x test type, each with an honest
//! 95% interval and the validity distribution beside it.
//!
//! The interval is a Wilson score interval at the effective sample size n / deff, where
//! deff is Miller's clustered variance (clusters = templates) over the naive variance,
//! floored at 1. Wilson rather than Wald so that 0 failures in 20 cases does not print as
//! the interval [0, 0]; the design effect so that cases sharing a template are not counted
//! as independent evidence.

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};

use crate::query::{QueryError, new_context, register_run, text_rows};
use crate::schema::Table;
use crate::stages::score::ScorerId;
use crate::stages::validate::VERDICTS;
use crate::storage::RunStore;

/// One result row.
#[derive(Debug, Clone, Default)]
pub struct ResultRow {
    pub level: String,
    pub capability: String,
    pub test_type: String,
    pub test: Option<String>,
    pub model: String,
    pub n: i64,
    pub failures: i64,
    pub failure_rate: Option<f64>,
    pub se: Option<f64>,
    pub ci_lo: Option<f64>,
    pub ci_hi: Option<f64>,
    pub n_templates: i64,
    pub n_rows: i64,
    /// Counts per validity verdict, in [`VERDICTS`] order.
    pub validity: [i64; 6],
    pub not_comparable: i64,
}

/// The Wilson score interval for a proportion `p` at effective size `n_eff` and `z`.
pub fn wilson(p: f64, n_eff: f64, z: f64) -> (f64, f64) {
    if n_eff <= 0.0 {
        return (0.0, 1.0);
    }
    let z2 = z * z;
    let denom = 1.0 + z2 / n_eff;
    let centre = (p + z2 / (2.0 * n_eff)) / denom;
    let half = z * ((p * (1.0 - p) / n_eff) + z2 / (4.0 * n_eff * n_eff)).sqrt() / denom;
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

impl ResultRow {
    /// Fills the rate and its interval from n, failures and the two standard errors.
    fn finish(&mut self, se: Option<f64>, naive_se: Option<f64>) {
        self.se = se;
        if self.n == 0 {
            return;
        }
        let p = self.failures as f64 / self.n as f64;
        self.failure_rate = Some(p);
        let deff = match (se, naive_se) {
            (Some(s), Some(n)) if n > 0.0 => (s * s / (n * n)).max(1.0),
            _ => 1.0,
        };
        let (lo, hi) = wilson(p, self.n as f64 / deff, 1.959963984540054);
        self.ci_lo = Some(lo);
        self.ci_hi = Some(hi);
    }
}

/// Per group: counts, the failure indicator's clustered (Miller) and naive standard errors
/// from the statistics functions, and the validity distribution. `{keys}` is the grouping.
const SQL: &str = "WITH s AS (SELECT *, \
        CASE WHEN role <> 'base' AND score IS NOT NULL THEN CASE WHEN passed THEN 0.0 ELSE 1.0 END END AS fail \
        FROM scores WHERE scorer = '{name}' AND scoring_version = '{version}') \
    SELECT {keys}, count(*) AS n_rows, count(fail) AS n, CAST(coalesce(sum(fail), 0) AS BIGINT) AS failures, \
        count(DISTINCT CASE WHEN fail IS NOT NULL THEN template_id END) AS n_templates, \
        clustered_se(fail, template_id) AS se, mean_se(fail) AS naive_se, \
        {verdicts}, \
        sum(CASE WHEN role <> 'base' AND validity = 'valid_answer' AND score IS NULL THEN 1 ELSE 0 END) AS not_comparable \
    FROM s GROUP BY {keys} ORDER BY {keys}";

/// Computes the results of one scorer version: test-level rows, then capability x test type.
pub async fn compute(store: &RunStore, scorer: &ScorerId) -> Result<Vec<ResultRow>, QueryError> {
    let ctx = new_context();
    register_run(&ctx, store, "").await?;
    let verdicts: Vec<String> = VERDICTS
        .iter()
        .map(|v| format!("sum(CASE WHEN validity = '{v}' THEN 1 ELSE 0 END) AS {v}"))
        .collect();
    let mut out = Vec::new();
    for (level, keys) in [
        ("test", "model, capability, test_type, test"),
        ("capability", "model, capability, test_type"),
    ] {
        let sql = SQL
            .replace("{name}", &scorer.name)
            .replace("{version}", &scorer.version)
            .replace("{keys}", keys)
            .replace("{verdicts}", &verdicts.join(", "));
        for r in text_rows(&ctx, &sql).await? {
            let txt = |i: usize| r[i].clone().unwrap_or_default();
            let int = |i: usize| {
                r[i].as_deref()
                    .and_then(|v| v.parse::<i64>().ok())
                    .unwrap_or(0)
            };
            let flt = |i: usize| r[i].as_deref().and_then(|v| v.parse::<f64>().ok());
            let k = keys.split(", ").count();
            let mut row = ResultRow {
                level: level.into(),
                model: txt(0),
                capability: txt(1),
                test_type: txt(2),
                test: (level == "test").then(|| txt(3)),
                n_rows: int(k),
                n: int(k + 1),
                failures: int(k + 2),
                n_templates: int(k + 3),
                not_comparable: int(k + 6 + VERDICTS.len()),
                ..Default::default()
            };
            for (j, v) in row.validity.iter_mut().enumerate() {
                *v = int(k + 6 + j);
            }
            row.finish(flt(k + 4), flt(k + 5));
            out.push(row);
        }
    }
    Ok(out)
}

/// Builds a `results` batch.
pub fn to_batch(scorer: &ScorerId, rows: &[ResultRow]) -> RecordBatch {
    let s = |f: &dyn Fn(&ResultRow) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
    };
    let i = |f: &dyn Fn(&ResultRow) -> i64| -> ArrayRef {
        Arc::new(Int64Array::from_iter_values(rows.iter().map(f)))
    };
    let f = |f: &dyn Fn(&ResultRow) -> Option<f64>| -> ArrayRef {
        Arc::new(rows.iter().map(f).collect::<Float64Array>())
    };
    let mut cols: Vec<ArrayRef> = vec![
        s(&|r| &r.level),
        s(&|r| &r.capability),
        s(&|r| &r.test_type),
        Arc::new(
            rows.iter()
                .map(|r| r.test.as_deref())
                .collect::<StringArray>(),
        ),
        s(&|r| &r.model),
        Arc::new(StringArray::from_iter_values(std::iter::repeat_n(
            scorer.name.as_str(),
            rows.len(),
        ))),
        Arc::new(StringArray::from_iter_values(std::iter::repeat_n(
            scorer.version.as_str(),
            rows.len(),
        ))),
        i(&|r| r.n),
        i(&|r| r.failures),
        f(&|r| r.failure_rate),
        f(&|r| r.se),
        f(&|r| r.ci_lo),
        f(&|r| r.ci_hi),
        i(&|r| r.n_templates),
        i(&|r| r.n_rows),
    ];
    for k in 0..VERDICTS.len() {
        cols.push(i(&|r| r.validity[k]));
    }
    cols.push(i(&|r| r.not_comparable));
    RecordBatch::try_new(Table::Results.schema(), cols)
        .expect("results batch matches schemas/results.json")
}

/// Computes and writes `results/` (replacing an earlier aggregate of this run).
pub async fn run(store: &RunStore, scorer: &ScorerId) -> Result<Vec<ResultRow>, QueryError> {
    let rows = compute(store, scorer).await?;
    store.delete_dir("results").await?;
    let mut w = store.part_writer("results", Table::Results.schema(), "part");
    w.write(to_batch(scorer, &rows)).await?;
    w.finish().await?;
    Ok(rows)
}

fn pct(x: Option<f64>) -> String {
    x.map(|v| format!("{:.1}%", v * 100.0))
        .unwrap_or_else(|| "-".into())
}

/// The validity distribution as `valid_answer 95.0% | provider_error 5.0%` (non-zero only).
pub fn validity_summary(counts: &[i64; 6]) -> String {
    let total: i64 = counts.iter().sum();
    if total == 0 {
        return "no rows".into();
    }
    VERDICTS
        .iter()
        .zip(counts)
        .filter(|(_, c)| **c > 0)
        .map(|(v, c)| {
            format!(
                "{v} {}/{total} ({:.1}%)",
                c,
                *c as f64 * 100.0 / total as f64
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Renders rows as an aligned text table.
pub fn render_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (k, c) in r.iter().enumerate() {
            w[k] = w[k].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .enumerate()
            .map(|(k, c)| format!("{:<width$}", c, width = w[k]))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = line(headers.iter().map(|s| s.to_string()).collect());
    out.push('\n');
    out.push_str(&line(w.iter().map(|n| "-".repeat(*n)).collect()));
    for r in rows {
        out.push('\n');
        out.push_str(&line(r.clone()));
    }
    out
}

/// The report printed by `evalflow run` and `evalflow aggregate`.
pub fn render(rows: &[ResultRow]) -> String {
    let mut out = String::new();
    let fmt_row = |r: &ResultRow, first: String| {
        vec![
            first,
            r.test_type.clone(),
            r.n.to_string(),
            r.failures.to_string(),
            pct(r.failure_rate),
            match (r.ci_lo, r.ci_hi) {
                (Some(lo), Some(hi)) => format!("[{:.1}%, {:.1}%]", lo * 100.0, hi * 100.0),
                _ => "-".into(),
            },
            validity_summary(&r.validity),
        ]
    };
    let models: std::collections::BTreeSet<&str> = rows.iter().map(|r| r.model.as_str()).collect();
    for model in models {
        let caps: Vec<Vec<String>> = rows
            .iter()
            .filter(|r| r.level == "capability" && r.model == model)
            .map(|r| fmt_row(r, r.capability.clone()))
            .collect();
        out.push_str(&format!("model: {model}\n\nCapability x test type (failure rate, 95% interval clustered by template)\n"));
        out.push_str(&render_table(
            &[
                "capability",
                "type",
                "n",
                "fail",
                "fail rate",
                "95% CI",
                "validity",
            ],
            &caps,
        ));
        out.push_str("\n\nPer test\n");
        let tests: Vec<Vec<String>> = rows
            .iter()
            .filter(|r| r.level == "test" && r.model == model)
            .map(|r| fmt_row(r, r.test.clone().unwrap_or_default()))
            .collect();
        out.push_str(&render_table(
            &[
                "test",
                "type",
                "n",
                "fail",
                "fail rate",
                "95% CI",
                "validity",
            ],
            &tests,
        ));
        let mut total = [0i64; 6];
        for r in rows
            .iter()
            .filter(|r| r.level == "capability" && r.model == model)
        {
            for (t, v) in total.iter_mut().zip(r.validity) {
                *t += v;
            }
        }
        let nc: i64 = rows
            .iter()
            .filter(|r| r.level == "capability" && r.model == model)
            .map(|r| r.not_comparable)
            .sum();
        out.push_str(&format!(
            "\n\nValidity of all calls: {}\n",
            validity_summary(&total)
        ));
        if nc > 0 {
            out.push_str(&format!(
                "Perturbed cases not comparable (base case invalid): {nc}\n"
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wilson_is_not_degenerate_at_zero() {
        let (lo, hi) = wilson(0.0, 20.0, 1.959963984540054);
        assert_eq!(lo, 0.0);
        assert!((hi - 0.16113).abs() < 1e-4, "{hi}");
    }
}
