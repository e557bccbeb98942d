//! Aggregate: failure rates per test and per capability x test type, each with an honest
//! 95% interval and the validity distribution beside it.
//!
//! The interval is a Wilson score interval at the effective sample size n / deff, where
//! deff is Miller's clustered variance (clusters = templates) over the naive variance,
//! floored at 1. Wilson rather than Wald so that 0 failures in 20 cases does not print as
//! the interval [0, 0]; the design effect so that cases sharing a template are not counted
//! as independent evidence.

use std::collections::BTreeMap;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray,
};
use futures::StreamExt;

use crate::query::{QueryError, new_context, register_run};
use crate::schema::Table;
use crate::stages::score::ScorerId;
use crate::stages::validate::VERDICTS;
use crate::storage::RunStore;

/// Per-template partial sums of the failure indicator.
#[derive(Debug, Default, Clone, Copy)]
struct Cluster {
    n: f64,
    sum: f64,
}

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
    clusters: BTreeMap<String, Cluster>,
}

/// Miller's clustered standard error of a mean of 0/1 indicators from per-cluster (n, sum):
/// sqrt(var_samp/n + (1/n^2) sum_c [ (sum_c - n_c m)^2 - sum_{i in c} (x_i - m)^2 ]).
fn clustered_se(clusters: &BTreeMap<String, Cluster>) -> (Option<f64>, Option<f64>) {
    let n: f64 = clusters.values().map(|c| c.n).sum();
    if n < 2.0 {
        return (None, None);
    }
    let m = clusters.values().map(|c| c.sum).sum::<f64>() / n;
    // For 0/1 data, sum (x_i - m)^2 within a cluster = s(1-m)^2 + (n_c - s) m^2.
    let ss = |c: &Cluster| c.sum * (1.0 - m).powi(2) + (c.n - c.sum) * m * m;
    let total_ss: f64 = clusters.values().map(ss).sum();
    let naive_var = total_ss / (n - 1.0) / n;
    let cross: f64 = clusters
        .values()
        .map(|c| (c.sum - c.n * m).powi(2) - ss(c))
        .sum();
    let var = naive_var + cross / (n * n);
    (Some(var.max(0.0).sqrt()), Some(naive_var.sqrt()))
}

/// The Wilson score interval for `k` of `n` at z, computed at effective size `n_eff`.
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
    fn finish(&mut self) {
        self.n_templates = self.clusters.len() as i64;
        if self.n == 0 {
            return;
        }
        let p = self.failures as f64 / self.n as f64;
        self.failure_rate = Some(p);
        let (se, naive) = clustered_se(&self.clusters);
        self.se = se;
        let deff = match (se, naive) {
            (Some(s), Some(n)) if n > 0.0 => (s * s / (n * n)).max(1.0),
            _ => 1.0,
        };
        let (lo, hi) = wilson(p, self.n as f64 / deff, 1.959963984540054);
        self.ci_lo = Some(lo);
        self.ci_hi = Some(hi);
    }
}

const SQL: &str = "SELECT model, capability, test_type, test, role, template_id, validity, \
    score IS NOT NULL AS scored, passed, count(*) AS rows \
    FROM scores WHERE scorer = '{name}' AND scoring_version = '{version}' \
    GROUP BY model, capability, test_type, test, role, template_id, validity, score IS NOT NULL, passed";

/// Computes the results of one scorer version: test-level rows, then capability x test type.
pub async fn compute(store: &RunStore, scorer: &ScorerId) -> Result<Vec<ResultRow>, QueryError> {
    let ctx = new_context();
    register_run(&ctx, store, "").await?;
    let sql = SQL
        .replace("{name}", &scorer.name)
        .replace("{version}", &scorer.version);
    let mut s = ctx
        .sql(&sql)
        .await
        .map_err(QueryError::df("aggregate"))?
        .execute_stream()
        .await
        .map_err(QueryError::df("aggregate"))?;
    let mut by_test: BTreeMap<(String, String, String, String), ResultRow> = BTreeMap::new();
    let mut by_cap: BTreeMap<(String, String, String), ResultRow> = BTreeMap::new();
    while let Some(b) = s.next().await {
        let b = b.map_err(QueryError::df("aggregate"))?;
        let col = |n: &str| b.column_by_name(n).unwrap().clone();
        let (model, cap, tt, test, role, tpl, validity) = (
            col("model"),
            col("capability"),
            col("test_type"),
            col("test"),
            col("role"),
            col("template_id"),
            col("validity"),
        );
        let st = |a: &ArrayRef, i: usize| {
            a.as_any()
                .downcast_ref::<StringArray>()
                .unwrap()
                .value(i)
                .to_string()
        };
        let scored = b
            .column_by_name("scored")
            .unwrap()
            .as_any()
            .downcast_ref::<datafusion::arrow::array::BooleanArray>()
            .unwrap()
            .clone();
        let passed = b
            .column_by_name("passed")
            .unwrap()
            .as_any()
            .downcast_ref::<datafusion::arrow::array::BooleanArray>()
            .unwrap()
            .clone();
        let rows = b
            .column_by_name("rows")
            .unwrap()
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap()
            .clone();
        for i in 0..b.num_rows() {
            let (m, c, t, te, r, tp, v) = (
                st(&model, i),
                st(&cap, i),
                st(&tt, i),
                st(&test, i),
                st(&role, i),
                st(&tpl, i),
                st(&validity, i),
            );
            let count = rows.value(i);
            let failed = scored.value(i) && passed.is_valid(i) && !passed.value(i);
            let rt = by_test
                .entry((m.clone(), c.clone(), t.clone(), te.clone()))
                .or_insert_with(|| ResultRow {
                    level: "test".into(),
                    capability: c.clone(),
                    test_type: t.clone(),
                    test: Some(te.clone()),
                    model: m.clone(),
                    ..Default::default()
                });
            let rc = by_cap
                .entry((m.clone(), c.clone(), t.clone()))
                .or_insert_with(|| ResultRow {
                    level: "capability".into(),
                    capability: c.clone(),
                    test_type: t.clone(),
                    test: None,
                    model: m.clone(),
                    ..Default::default()
                });
            for row in [rt, rc] {
                row.n_rows += count;
                if let Some(k) = VERDICTS.iter().position(|x| *x == v) {
                    row.validity[k] += count;
                }
                if r == "base" {
                    continue;
                }
                if scored.value(i) {
                    row.n += count;
                    let cl = row.clusters.entry(tp.clone()).or_default();
                    cl.n += count as f64;
                    if failed {
                        row.failures += count;
                        cl.sum += count as f64;
                    }
                } else if v == "valid_answer" {
                    row.not_comparable += count;
                }
            }
        }
    }
    let mut out: Vec<ResultRow> = by_test.into_values().chain(by_cap.into_values()).collect();
    for r in &mut out {
        r.finish();
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
    fn clustered_se_equals_naive_with_singleton_clusters() {
        // 8 failures in 40 rows, one row per cluster: Miller's SE equals sqrt(p(1-p)/(n-1)... ) naive
        let mut cl = BTreeMap::new();
        for i in 0..40 {
            cl.insert(
                format!("t{i}"),
                Cluster {
                    n: 1.0,
                    sum: if i < 8 { 1.0 } else { 0.0 },
                },
            );
        }
        let (se, naive) = clustered_se(&cl);
        let p: f64 = 0.2;
        let want = (p * (1.0 - p) * 40.0 / 39.0 / 40.0).sqrt();
        assert!((se.unwrap() - want).abs() < 1e-12);
        assert!((naive.unwrap() - want).abs() < 1e-12);
    }

    #[test]
    fn clustered_se_grows_when_failures_share_templates() {
        // Two templates: one fails everywhere, one passes everywhere.
        let mut cl = BTreeMap::new();
        cl.insert("a".to_string(), Cluster { n: 10.0, sum: 10.0 });
        cl.insert("b".to_string(), Cluster { n: 10.0, sum: 0.0 });
        let (se, naive) = clustered_se(&cl);
        // Hand-worked: m = 0.5, each x_i - m = +-0.5; naive var = 20*0.25/19/20;
        // cross per cluster = (10*0.5)^2 - 10*0.25 = 22.5; total 45 / 400.
        let want = (0.25f64 / 19.0 + 45.0 / 400.0).sqrt();
        assert!((se.unwrap() - want).abs() < 1e-12);
        assert!(se.unwrap() > naive.unwrap() * 2.0);
    }

    #[test]
    fn wilson_is_not_degenerate_at_zero() {
        let (lo, hi) = wilson(0.0, 20.0, 1.959963984540054);
        assert_eq!(lo, 0.0);
        assert!((hi - 0.16113).abs() < 1e-4, "{hi}");
    }
}
