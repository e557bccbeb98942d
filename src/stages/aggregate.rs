//! Aggregate: the headline metric per test and per capability x test type, each with an
//! honest 95% interval and the validity distribution beside it.
//!
//! The metric follows the scorer's kind ([`MetricKind`], DESIGN.md "results"):
//! - pass/fail scorers (checklist) give the failure rate;
//! - label scorers (cue) give the rate of each label, one row per label;
//! - numeric scorers (judge) give the mean score.
//!
//! Every interval is `clustered_mean_ci`'s default (clusters = templates), the method whose
//! coverage holds best at few templates (`benches/coverage.rs`, docs/functions.md): for a
//! rate, the clustered score interval `cr2_score` (it stays inside [0, 1] and is not
//! degenerate at 0 failures); for a mean, CR2 with Satterthwaite
//! degrees of freedom. `ci_method` names the method used. With one template nothing can be
//! clustered: the interval then treats cases as independent (Wilson for a rate, normal for a
//! mean) and the row says so (`clustered = false` and a note), never silently.

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, Float64Array, Int64Array, RecordBatch, StringArray,
};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::DataType;

use crate::query::{Batches, QueryError, new_context, text_rows};
use crate::schema::Table;
use crate::stages::score::{JUDGE_VERDICTS, MetricKind, ScorerId};
use crate::storage::RunStore;
use crate::udaf::cluster_interval::{IntervalSpec, summary_interval};
use crate::udaf::cluster_summary::ClusterSummary;
use crate::udaf::common::Moments;
use crate::validity::VERDICTS;

/// Every verdict a scores row can carry, in the order of the results columns: the
/// validator's six, then the judge scorer's two.
pub const ALL_VERDICTS: [&str; 8] = [
    VERDICTS[0],
    VERDICTS[1],
    VERDICTS[2],
    VERDICTS[3],
    VERDICTS[4],
    VERDICTS[5],
    JUDGE_VERDICTS[0],
    JUDGE_VERDICTS[1],
];

/// The note stored and printed beside an interval that could not be clustered.
pub const UNCLUSTERED_NOTE: &str = "1 template: interval assumes independent cases";

/// Templates below which a clustered interval is marked as wide for want of templates: its t
/// quantile has at most `templates - 1` degrees of freedom (2.78 at 4 df, 12.7 at 1, where a
/// normal's is 1.96).
pub const FEW_TEMPLATES: i64 = 5;

/// The note of a clustered interval over [`FEW_TEMPLATES`] or fewer templates: why it is
/// wide and what narrows it.
pub fn few_templates_note(templates: i64) -> String {
    format!(
        "{templates} templates: a clustered interval has at most {} degree(s) of freedom \
         (templates - 1), so it is wide; more templates narrow it (`evalflow plan` says how many)",
        templates - 1
    )
}

/// A rate this close to 0 or 1 from fewer than [`RARE_FEW_TEMPLATES`] templates is flagged:
/// there `auto` covers 91-93% when a few templates carry the failures (docs/intervals.md).
pub const RARE_RATE: f64 = 0.05;
/// See [`RARE_RATE`].
pub const RARE_FEW_TEMPLATES: i64 = 50;

/// The note of a rare rate's interval over few templates: whether it honours a stated ICC.
pub fn rare_rate_note(templates: i64, method: &str) -> String {
    match method.split_once("icc=") {
        Some((_, r)) => format!(
            "rare rate from {templates} templates: the interval honours the stated latent ICC {r}"
        ),
        None => format!(
            "rare rate from {templates} templates: the interval holds 95% only if they show \
             their heterogeneity; stating the templates' ICC ([aggregate] icc, --icc) keeps it \
             when a few templates carry the failures (docs/intervals.md)"
        ),
    }
}

pub const Z95: f64 = 1.959963984540054;

/// One result row.
#[derive(Debug, Clone, Default)]
pub struct ResultRow {
    pub level: String,
    pub capability: String,
    pub test_type: String,
    pub test: Option<String>,
    pub model: String,
    /// `failure_rate`, `label_rate` or `mean_score`.
    pub metric: String,
    /// The label whose rate this row gives (label scorers only).
    pub label: Option<String>,
    /// Rows that enter the metric (valid, scored, not a base row).
    pub n: i64,
    /// Rows counted by a rate (failures, or rows with the label); None for a mean.
    pub hits: Option<i64>,
    pub value: Option<f64>,
    pub se: Option<f64>,
    pub ci_lo: Option<f64>,
    pub ci_hi: Option<f64>,
    /// How the interval was made: `clustered_mean_ci`'s method (`cr2_score`, `cr2`, ...), or
    /// `wilson` / `normal` when it could not be clustered.
    pub ci_method: String,
    pub n_templates: i64,
    /// False when the interval treats cases as independent (fewer than two templates).
    pub clustered: bool,
    pub note: Option<String>,
    pub n_rows: i64,
    /// Counts per verdict, in [`ALL_VERDICTS`] order.
    pub validity: [i64; 8],
    /// Rows whose verdict is none of [`ALL_VERDICTS`] (counted, never dropped).
    pub validity_other: i64,
    /// Valid perturbed answers of a scorer that compares with the base case, left unscored
    /// because the base case's answer is invalid.
    pub not_comparable: i64,
    /// Other valid answers left unscored (nothing to score against, e.g. no expected entity).
    pub unscored: i64,
}

impl ResultRow {
    /// The failure count of a pass/fail row.
    pub fn failures(&self) -> Option<i64> {
        (self.metric == MetricKind::PassFail.metric()).then_some(self.hits.unwrap_or(0))
    }

    /// The failure rate of a pass/fail row.
    pub fn failure_rate(&self) -> Option<f64> {
        (self.metric == MetricKind::PassFail.metric())
            .then_some(self.value)
            .flatten()
    }
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

/// The statistics of one indicator in one group, as read from the query.
#[derive(Debug, Clone, Default)]
struct Stats {
    n: i64,
    sum: f64,
    n_templates: i64,
    /// The clustered SE, interval and method name of `clustered_mean_ci` (default method).
    se: Option<f64>,
    lo: Option<f64>,
    hi: Option<f64>,
    method: Option<String>,
    naive_se: Option<f64>,
}

/// Fills value, SE and interval of `row` from `st`.
fn finish(row: &mut ResultRow, kind: MetricKind, st: &Stats) {
    row.n = st.n;
    row.n_templates = st.n_templates;
    row.clustered = st.n_templates >= 2;
    if !row.clustered && st.n > 0 {
        row.note = Some(UNCLUSTERED_NOTE.into());
    }
    if kind != MetricKind::Numeric {
        row.hits = Some(st.sum.round() as i64);
    }
    if st.n == 0 {
        row.ci_method = "none".into();
        return;
    }
    let mean = st.sum / st.n as f64;
    row.value = Some(mean);
    if row.clustered && st.lo.is_some() && st.hi.is_some() {
        let method = st.method.clone().unwrap_or_else(|| "clustered".into());
        if st.n_templates < FEW_TEMPLATES {
            row.note = Some(few_templates_note(st.n_templates));
        } else if kind != MetricKind::Numeric
            && mean.min(1.0 - mean) <= RARE_RATE
            && st.n_templates < RARE_FEW_TEMPLATES
        {
            row.note = Some(rare_rate_note(st.n_templates, &method));
        }
        row.se = st.se;
        row.ci_lo = st.lo;
        row.ci_hi = st.hi;
        row.ci_method = method;
        return;
    }
    // Unclustered (or a clustered interval that could not be computed): cases as independent.
    row.se = st.naive_se;
    match kind {
        MetricKind::PassFail | MetricKind::Label => {
            let (lo, hi) = wilson(mean, st.n as f64, Z95);
            row.ci_lo = Some(lo);
            row.ci_hi = Some(hi);
            row.ci_method = "wilson".into();
        }
        MetricKind::Numeric => match st.naive_se {
            Some(s) => {
                row.ci_lo = Some(mean - Z95 * s);
                row.ci_hi = Some(mean + Z95 * s);
                row.ci_method = "normal".into();
            }
            None => row.ci_method = "none".into(),
        },
    }
    if row.clustered {
        row.note = Some(
            "clustered interval could not be computed: interval assumes independent cases".into(),
        );
    }
}

/// A SQL string literal.
fn lit(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The indicators a scorer's kind aggregates: `(label, SQL value over a scored row)`.
async fn indicators(
    ctx: &datafusion::prelude::SessionContext,
    kind: MetricKind,
    scorer: &ScorerId,
) -> Result<Vec<(Option<String>, String)>, QueryError> {
    Ok(match kind {
        MetricKind::PassFail => vec![(
            None,
            "CASE WHEN passed THEN 0.0 WHEN NOT passed THEN 1.0 END".into(),
        )],
        MetricKind::Numeric => vec![(None, "CAST(score AS DOUBLE)".into())],
        MetricKind::Label => {
            // The most frequent labels, and the rest as one `(other)`: a scorer whose labels
            // are free text would otherwise give a row per distinct text in every group
            // (3,666 lines of report, most of them rates of 0).
            let most = max_labels();
            let counted = text_rows(
                ctx,
                &format!(
                    "SELECT label, count(*) AS n FROM scores WHERE scorer = {} AND \
                     scoring_version = {} AND role <> 'base' AND score IS NOT NULL AND label IS \
                     NOT NULL GROUP BY label ORDER BY n DESC, label LIMIT {}",
                    lit(&scorer.name),
                    lit(&scorer.version),
                    most + 1
                ),
            )
            .await?;
            let mut labels: Vec<String> =
                counted.into_iter().filter_map(|r| r[0].clone()).collect();
            let other = labels.len() > most;
            labels.truncate(most);
            labels.sort();
            if labels.is_empty() {
                // No scored row at all: one row still reports n = 0 and the validity.
                vec![(None, "CAST(NULL AS DOUBLE)".into())]
            } else {
                let mut out: Vec<(Option<String>, String)> = labels
                    .iter()
                    .map(|l| {
                        let e = format!(
                            "CASE WHEN label IS NULL THEN NULL WHEN label = {} THEN 1.0 ELSE 0.0 END",
                            lit(l)
                        );
                        (Some(l.clone()), e)
                    })
                    .collect();
                if other {
                    let listed: Vec<String> = labels.iter().map(|l| lit(l)).collect();
                    out.push((
                        Some(OTHER_LABEL.to_string()),
                        format!(
                            "CASE WHEN label IS NULL THEN NULL WHEN label IN ({}) THEN 0.0 ELSE \
                             1.0 END",
                            listed.join(", ")
                        ),
                    ));
                }
                out
            }
        }
    })
}

/// The label of the rate of every label past the [`max_labels`] most frequent.
pub const OTHER_LABEL: &str = "(other)";

/// Labels of a label scorer that get a rate of their own (the most frequent); 20, or
/// `EVALFLOW_MAX_LABELS`.
pub fn max_labels() -> usize {
    crate::config::env_count("EVALFLOW_MAX_LABELS").map_or(20, |n| n as usize)
}

/// Rows of scores whose templates one pass of [`compute`] holds at most: a larger run is read
/// in slices of its templates ([`crate::query::range_slices`]), each pass holding the
/// per-template sums of its slice only and folding them into per-size sums
/// ([`ClusterSummary`]) when the slice is done, so memory is the same at any run size.
/// Rescore's diff reads its pairs the same way. `EVALFLOW_TEMPLATE_SLICE_ROWS` sets another
/// (tests use a small one to aggregate in many slices).
pub fn slice_rows() -> u64 {
    crate::config::env_count("EVALFLOW_TEMPLATE_SLICE_ROWS").unwrap_or(500_000)
}

/// The test-level group keys, in the order of the results.
const TEST_KEYS: &str = "model, capability, test_type, test";

/// Per test-level group: the row count, the validity distribution and the unscored counts,
/// which need no template (one pass over the scorer's rows, one row per group).
fn counts_sql(filter: &str, compares_to_base: bool) -> String {
    let mut sel = Vec::new();
    for v in ALL_VERDICTS {
        sel.push(format!(
            "sum(CASE WHEN validity = {} THEN 1 ELSE 0 END)",
            lit(v)
        ));
    }
    let known = ALL_VERDICTS
        .iter()
        .map(|v| lit(v))
        .collect::<Vec<_>>()
        .join(", ");
    sel.push(format!(
        "sum(CASE WHEN validity IN ({known}) THEN 0 ELSE 1 END)"
    ));
    let perturbed = if compares_to_base {
        "role = 'perturbed'"
    } else {
        "FALSE"
    };
    sel.push(format!(
        "sum(CASE WHEN role <> 'base' AND validity = 'valid_answer' AND score IS NULL AND {perturbed} THEN 1 ELSE 0 END)"
    ));
    sel.push(format!(
        "sum(CASE WHEN role <> 'base' AND validity = 'valid_answer' AND score IS NULL AND NOT ({perturbed}) THEN 1 ELSE 0 END)"
    ));
    format!(
        "SELECT {TEST_KEYS}, count(*), {} FROM scores WHERE {filter} GROUP BY {TEST_KEYS}",
        sel.join(", ")
    )
}

/// Per test-level group and template of one slice: for each indicator its count, sum and
/// population variance (a template's moments).
fn cells_sql(filter: &str, slice: &str, inds: &[(Option<String>, String)]) -> String {
    let mut vals = Vec::new();
    let mut sel = Vec::new();
    for (i, (_, e)) in inds.iter().enumerate() {
        vals.push(format!(
            "CASE WHEN role <> 'base' AND score IS NOT NULL THEN {e} END AS v{i}"
        ));
        sel.push(format!("count(v{i}), sum(v{i}), var_pop(v{i})"));
    }
    format!(
        "SELECT {TEST_KEYS}, template_id, {} FROM (SELECT {TEST_KEYS}, template_id, {} \
         FROM scores WHERE {filter} AND {slice}) GROUP BY {TEST_KEYS}, template_id",
        sel.join(", "),
        vals.join(", ")
    )
}

/// One indicator of one group: every row's moments, and its templates' [`ClusterSummary`].
#[derive(Debug, Clone, Default)]
struct Indicator {
    /// Over every row with a value (rows without a template too).
    all: Moments,
    /// Sum of the values (the metric is `sum / n`, as `count` and `sum` give it).
    sum: f64,
    /// Over the rows with a template, by template.
    clusters: ClusterSummary,
}

/// One result group: its keys, counts and indicators.
#[derive(Debug, Clone)]
struct Group {
    /// `model, capability, test_type` and, at the test level, `test`.
    keys: Vec<Option<String>>,
    n_rows: i64,
    validity: [i64; 8],
    validity_other: i64,
    not_comparable: i64,
    unscored: i64,
    inds: Vec<Indicator>,
    /// The capability group of a test group.
    parent: usize,
    /// Test groups of a capability group.
    tests: usize,
}

/// Groups by a key string (the keys joined by `\u{1}`, NULL as `\u{2}`).
#[derive(Default)]
struct Groups {
    index: HashMap<String, usize>,
    list: Vec<Group>,
}

impl Groups {
    /// The index of the group of `keys`, created from `init` if new.
    fn get_or_insert(&mut self, key: &str, init: impl FnOnce() -> Group) -> usize {
        if let Some(i) = self.index.get(key) {
            return *i;
        }
        self.list.push(init());
        self.index.insert(key.to_string(), self.list.len() - 1);
        self.list.len() - 1
    }
}

/// Appends `v` (NULL as `\u{2}`) and a separator to a group key.
fn push_key(key: &mut String, v: Option<&str>) {
    key.push_str(v.unwrap_or("\u{2}"));
    key.push('\u{1}');
}

/// Column `i` of `b` as strings.
fn utf8(b: &RecordBatch, i: usize) -> Result<StringArray, QueryError> {
    let c =
        cast(b.column(i), &DataType::Utf8).map_err(|e| QueryError::df("aggregate")(e.into()))?;
    Ok(c.as_any()
        .downcast_ref::<StringArray>()
        .expect("cast to Utf8 gives a StringArray")
        .clone())
}

/// Column `i` of `b` as Float64 (counts are cast).
fn float(b: &RecordBatch, i: usize) -> Result<Float64Array, QueryError> {
    let c =
        cast(b.column(i), &DataType::Float64).map_err(|e| QueryError::df("aggregate")(e.into()))?;
    Ok(c.as_any()
        .downcast_ref::<Float64Array>()
        .expect("cast to Float64 gives a Float64Array")
        .clone())
}

/// Computes the results of one scorer version: test-level rows, then capability x test type.
///
/// The intervals are `clustered_mean_ci`'s default method over templates, computed from each
/// group's [`ClusterSummary`] ([`summary_interval`]): the same numbers as the SQL function
/// (the stage's tests compare them), with the templates read slice by slice.
pub async fn compute(
    store: &RunStore,
    scorer: &ScorerId,
    icc: Option<f64>,
) -> Result<Vec<ResultRow>, QueryError> {
    let ctx = new_context();
    crate::query::for_template_slices(&ctx);
    // Only this version's scores are read: 20 template slices over every version's parts
    // would each list and prune them all.
    crate::query::register_scores_of(&ctx, store, &[scorer]).await?;
    // The kind a user scorer declared (recorded beside its scores), else the built-in's.
    let kind = crate::stages::score::metric_kind(store, scorer).await?;
    let inds = indicators(&ctx, kind, scorer).await?;
    let compares = crate::stages::score::compares_to_base(&scorer.name);
    let filter = format!(
        "scorer = {} AND scoring_version = {}",
        lit(&scorer.name),
        lit(&scorer.version)
    );
    // The groups with their counts: test level, and capability level as their sums.
    let (mut tests, mut caps) = (Groups::default(), Groups::default());
    let mut rows = 0u64;
    let mut key = String::new();
    crate::query::for_each_batch(&ctx, &counts_sql(&filter, compares), |b| {
        let keys = (0..4).map(|i| utf8(b, i)).collect::<Result<Vec<_>, _>>()?;
        let counts = (4..b.num_columns())
            .map(|i| float(b, i))
            .collect::<Result<Vec<_>, _>>()?;
        for r in 0..b.num_rows() {
            let k: Vec<Option<String>> = keys
                .iter()
                .map(|c| c.is_valid(r).then(|| c.value(r).to_string()))
                .collect();
            key.clear();
            k[..3].iter().for_each(|v| push_key(&mut key, v.as_deref()));
            let new_group = |keys: Vec<Option<String>>| Group {
                keys,
                n_rows: 0,
                validity: [0; 8],
                validity_other: 0,
                not_comparable: 0,
                unscored: 0,
                inds: vec![Indicator::default(); inds.len()],
                parent: 0,
                tests: 0,
            };
            let parent = caps.get_or_insert(&key, || new_group(k[..3].to_vec()));
            push_key(&mut key, k[3].as_deref());
            let t = tests.get_or_insert(&key, || new_group(k.clone()));
            let c = |i: usize| counts[i].value(r) as i64;
            for g in [&mut tests.list[t], &mut caps.list[parent]] {
                g.n_rows += c(0);
                for (j, v) in g.validity.iter_mut().enumerate() {
                    *v += c(1 + j);
                }
                g.validity_other += c(9);
                g.not_comparable += c(10);
                g.unscored += c(11);
            }
            tests.list[t].parent = parent;
            caps.list[parent].tests += 1;
            rows += c(0) as u64;
        }
        Ok(())
    })
    .await?;
    // The templates, slice by slice.
    let passes = rows.div_ceil(slice_rows()) as usize;
    let source = format!("scores WHERE {filter}");
    let slices = crate::query::range_slices(&ctx, "template_id", &source, rows, passes).await?;
    tracing::debug!("aggregate: {} template slices ({rows} rows)", slices.len());
    // A capability group of several tests merges each template's cells over its tests
    // before folding them (a template may span tests); of one test, it takes its test's.
    let mut merged: HashMap<String, (usize, Vec<Moments>)> = HashMap::new();
    let spawn = |slice: &String| Batches::spawn(&ctx, cells_sql(&filter, slice, &inds));
    let mut next = slices.first().map(spawn);
    for i in 0..slices.len() {
        let mut cells = next.take().expect("each slice's query is started");
        let mut fold = |b: &RecordBatch| -> Result<(), QueryError> {
            let keys = (0..5).map(|i| utf8(b, i)).collect::<Result<Vec<_>, _>>()?;
            let nums = (5..b.num_columns())
                .map(|i| float(b, i))
                .collect::<Result<Vec<_>, _>>()?;
            for r in 0..b.num_rows() {
                key.clear();
                for c in &keys[..4] {
                    push_key(&mut key, c.is_valid(r).then(|| c.value(r)));
                }
                let Some(&t) = tests.index.get(&key) else {
                    // A row written between the two queries: counted next time.
                    continue;
                };
                let template = keys[4].is_valid(r).then(|| keys[4].value(r));
                let cells: Vec<Moments> = (0..inds.len())
                    .map(|i| {
                        let n = nums[3 * i].value(r) as u64;
                        if n == 0 {
                            return Moments::default();
                        }
                        let sum = nums[3 * i + 1].value(r);
                        Moments {
                            n,
                            mean: sum / n as f64,
                            m2: nums[3 * i + 2].value(r) * n as f64,
                        }
                    })
                    .collect();
                let parent = tests.list[t].parent;
                let shared = caps.list[parent].tests > 1;
                for (i, c) in cells.iter().enumerate() {
                    if c.n == 0 {
                        continue;
                    }
                    let sum = nums[3 * i + 1].value(r);
                    let ind = &mut tests.list[t].inds[i];
                    ind.all.merge(c);
                    ind.sum += sum;
                    let cap = &mut caps.list[parent].inds[i];
                    cap.all.merge(c);
                    cap.sum += sum;
                    if template.is_some() {
                        ind.clusters.add(c);
                        if !shared {
                            cap.clusters.add(c);
                        }
                    }
                }
                if let (Some(template), true) = (template, shared) {
                    key.clear();
                    key.push_str(&parent.to_string());
                    key.push('\u{1}');
                    key.push_str(template);
                    match merged.get_mut(key.as_str()) {
                        Some((_, acc)) => acc.iter_mut().zip(&cells).for_each(|(a, c)| a.merge(c)),
                        None => {
                            merged.insert(key.clone(), (parent, cells));
                        }
                    }
                }
            }
            Ok(())
        };
        // The slice's groups come once its aggregation is done: the next slice's query
        // starts then, and runs on the pool while this thread folds them.
        let first = cells.next().await?;
        next = slices.get(i + 1).map(spawn);
        if let Some(b) = first {
            fold(&b)?;
            while let Some(b) = cells.next().await? {
                fold(&b)?;
            }
        }
        for (_, (parent, cells)) in merged.drain() {
            for (ind, c) in caps.list[parent].inds.iter_mut().zip(&cells) {
                ind.clusters.add(c);
            }
        }
    }
    // Rates only: a stated ICC is a logit-normal model of a pass/fail rate.
    let spec = IntervalSpec {
        icc: icc.filter(|_| kind != MetricKind::Numeric),
        ..IntervalSpec::default()
    };
    let mut out = Vec::new();
    for (level, groups) in [("test", &mut tests), ("capability", &mut caps)] {
        // As `ORDER BY` the keys would: ascending, NULLs last.
        groups.list.sort_by_cached_key(|g| {
            g.keys
                .iter()
                .map(|v| (v.is_none(), v.clone()))
                .collect::<Vec<_>>()
        });
        for g in &groups.list {
            let k = |i: usize| g.keys[i].clone().unwrap_or_default();
            let base = ResultRow {
                level: level.into(),
                model: k(0),
                capability: k(1),
                test_type: k(2),
                test: (level == "test").then(|| k(3)),
                metric: kind.metric().into(),
                n_rows: g.n_rows,
                validity: g.validity,
                validity_other: g.validity_other,
                not_comparable: g.not_comparable,
                unscored: g.unscored,
                ..Default::default()
            };
            for ((label, _), ind) in inds.iter().zip(&g.inds) {
                let ci = summary_interval(&ind.clusters, &spec);
                let st = Stats {
                    n: ind.all.n as i64,
                    sum: ind.sum,
                    n_templates: ci.n_clusters as i64,
                    se: ci.se,
                    lo: ci.lo,
                    hi: ci.hi,
                    method: Some(ci.method_label()),
                    naive_se: ind.all.mean_se(),
                };
                let mut row = ResultRow {
                    label: label.clone(),
                    ..base.clone()
                };
                finish(&mut row, kind, &st);
                out.push(row);
            }
        }
    }
    Ok(out)
}

/// Builds a `results` batch.
pub fn to_batch(scorer: &ScorerId, rows: &[ResultRow]) -> RecordBatch {
    let s = |f: &dyn Fn(&ResultRow) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
    };
    let os = |f: &dyn Fn(&ResultRow) -> Option<&str>| -> ArrayRef {
        Arc::new(rows.iter().map(f).collect::<StringArray>())
    };
    let i = |f: &dyn Fn(&ResultRow) -> i64| -> ArrayRef {
        Arc::new(Int64Array::from_iter_values(rows.iter().map(f)))
    };
    let oi = |f: &dyn Fn(&ResultRow) -> Option<i64>| -> ArrayRef {
        Arc::new(rows.iter().map(f).collect::<Int64Array>())
    };
    let f = |f: &dyn Fn(&ResultRow) -> Option<f64>| -> ArrayRef {
        Arc::new(rows.iter().map(f).collect::<Float64Array>())
    };
    let mut cols: Vec<ArrayRef> = vec![
        s(&|r| &r.level),
        s(&|r| &r.capability),
        s(&|r| &r.test_type),
        os(&|r| r.test.as_deref()),
        s(&|r| &r.model),
        Arc::new(StringArray::from_iter_values(std::iter::repeat_n(
            scorer.name.as_str(),
            rows.len(),
        ))),
        Arc::new(StringArray::from_iter_values(std::iter::repeat_n(
            scorer.version.as_str(),
            rows.len(),
        ))),
        s(&|r| &r.metric),
        os(&|r| r.label.as_deref()),
        i(&|r| r.n),
        oi(&|r| r.failures()),
        f(&|r| r.failure_rate()),
        f(&|r| r.value),
        oi(&|r| r.hits),
        f(&|r| r.se),
        f(&|r| r.ci_lo),
        f(&|r| r.ci_hi),
        s(&|r| &r.ci_method),
        i(&|r| r.n_templates),
        Arc::new(
            rows.iter()
                .map(|r| Some(r.clustered))
                .collect::<BooleanArray>(),
        ),
        os(&|r| r.note.as_deref()),
        i(&|r| r.n_rows),
    ];
    for k in 0..ALL_VERDICTS.len() {
        cols.push(i(&|r| r.validity[k]));
    }
    cols.push(i(&|r| r.validity_other));
    cols.push(i(&|r| r.not_comparable));
    cols.push(i(&|r| r.unscored));
    RecordBatch::try_new(Table::Results.schema(), cols)
        .expect("results batch matches schemas/results.json")
}

/// Computes and writes `results/` (replacing an earlier aggregate of this run).
pub async fn run(
    store: &RunStore,
    scorer: &ScorerId,
    icc: Option<f64>,
) -> Result<Vec<ResultRow>, QueryError> {
    let rows = compute(store, scorer, icc).await?;
    store.delete_dir("results").await?;
    let mut w = store.part_writer("results", Table::Results.schema(), "part");
    w.write(to_batch(scorer, &rows)).await?;
    w.finish().await?;
    Ok(rows)
}

/// A rate as the text table prints it: `12.3%`, or `-`.
pub fn pct(x: Option<f64>) -> String {
    x.map(|v| format!("{:.1}%", v * 100.0))
        .unwrap_or_else(|| "-".into())
}

/// The validity distribution as `valid_answer 19/20 (95.0%), provider_error 1/20 (5.0%)`
/// (non-zero only; `other` counts verdicts outside [`ALL_VERDICTS`]).
pub fn validity_summary(counts: &[i64; 8], other: i64) -> String {
    let total: i64 = counts.iter().sum::<i64>() + other;
    if total == 0 {
        return "no rows".into();
    }
    ALL_VERDICTS
        .iter()
        .zip(counts)
        .chain(std::iter::once((&"other", &other)))
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

/// The interval cell: `[lo, hi]`, marked `*` when it could not be clustered and `+` when
/// few templates make it wide.
pub fn interval_cell(r: &ResultRow, as_pct: bool) -> String {
    let mark = if r.n == 0 {
        ""
    } else if !r.clustered {
        " *"
    } else if few(r) {
        " +"
    } else if rare_unstated(r) {
        " ^"
    } else {
        ""
    };
    match (r.ci_lo, r.ci_hi) {
        (Some(lo), Some(hi)) if as_pct => {
            format!("[{:.1}%, {:.1}%]{mark}", lo * 100.0, hi * 100.0)
        }
        (Some(lo), Some(hi)) => format!("[{lo:.3}, {hi:.3}]{mark}"),
        _ => "-".into(),
    }
}

/// The report printed by `evalflow run`, `evalflow aggregate` and `evalflow report`.
pub fn render(rows: &[ResultRow]) -> String {
    let mut out = String::new();
    let kind = rows
        .first()
        .map(|r| MetricKind::from_metric(&r.metric))
        .unwrap_or(MetricKind::PassFail);
    let (title, headers): (&str, Vec<&str>) = match kind {
        MetricKind::PassFail => (
            "failure rate",
            vec![
                "type",
                "n",
                "fail",
                "fail rate",
                "95% CI",
                "templates",
                "validity",
            ],
        ),
        MetricKind::Label => (
            "rate of each label",
            vec![
                "type",
                "label",
                "n",
                "count",
                "rate",
                "95% CI",
                "templates",
                "validity",
            ],
        ),
        MetricKind::Numeric => (
            "mean score",
            vec!["type", "n", "mean", "95% CI", "templates", "validity"],
        ),
    };
    // The template count sits beside the interval: with one template no clustered interval
    // exists, and the width jumps with the second.
    let fmt_row = |r: &ResultRow, first: Vec<String>| {
        let v = validity_summary(&r.validity, r.validity_other);
        let t = r.n_templates.to_string();
        let mut cells = first;
        cells.push(r.test_type.clone());
        match kind {
            MetricKind::PassFail => cells.extend([
                r.n.to_string(),
                r.hits.unwrap_or(0).to_string(),
                pct(r.value),
                interval_cell(r, true),
                t,
                v,
            ]),
            MetricKind::Label => cells.extend([
                r.label.clone().unwrap_or_else(|| "-".into()),
                r.n.to_string(),
                r.hits.unwrap_or(0).to_string(),
                pct(r.value),
                interval_cell(r, true),
                t,
                v,
            ]),
            MetricKind::Numeric => cells.extend([
                r.n.to_string(),
                r.value
                    .map(|m| format!("{m:.3}"))
                    .unwrap_or_else(|| "-".into()),
                interval_cell(r, false),
                t,
                v,
            ]),
        }
        cells
    };
    let with_first = |first: &[&'static str]| {
        let mut h = first.to_vec();
        h.extend(headers.iter().copied());
        h
    };
    let models: std::collections::BTreeSet<&str> = rows.iter().map(|r| r.model.as_str()).collect();
    for model in models {
        // One validity distribution per group, not one per label row: every group has a
        // row for each label, so the rows of the first label count each group once.
        let first_label = rows.first().and_then(|r| r.label.clone());
        let first_of_group = |r: &&ResultRow| r.label == first_label;
        let caps: Vec<Vec<String>> = rows
            .iter()
            .filter(|r| r.level == "capability" && r.model == model)
            .map(|r| fmt_row(r, vec![r.capability.clone()]))
            .collect();
        out.push_str(&format!(
            "model: {model}\n\nCapability x test type ({title}, 95% interval clustered by template)\n"
        ));
        out.push_str(&render_table(&with_first(&["capability"]), &caps));
        out.push_str("\n\nPer test\n");
        let tests: Vec<Vec<String>> = rows
            .iter()
            .filter(|r| r.level == "test" && r.model == model)
            .map(|r| {
                fmt_row(
                    r,
                    vec![r.test.clone().unwrap_or_default(), r.capability.clone()],
                )
            })
            .collect();
        out.push_str(&render_table(&with_first(&["test", "capability"]), &tests));
        let groups: Vec<&ResultRow> = rows
            .iter()
            .filter(|r| r.level == "capability" && r.model == model)
            .filter(first_of_group)
            .collect();
        let mut total = [0i64; 8];
        let mut other = 0;
        for r in &groups {
            for (t, v) in total.iter_mut().zip(r.validity) {
                *t += v;
            }
            other += r.validity_other;
        }
        let nc: i64 = groups.iter().map(|r| r.not_comparable).sum();
        let unscored: i64 = groups.iter().map(|r| r.unscored).sum();
        out.push_str(&format!(
            "\n\nValidity of all calls: {}\n",
            validity_summary(&total, other)
        ));
        if nc > 0 {
            out.push_str(&format!(
                "Perturbed cases not comparable (base case invalid): {nc}\n"
            ));
        }
        if unscored > 0 {
            out.push_str(&format!(
                "Valid answers not scored (nothing to score against, e.g. no expected entity): {unscored}\n"
            ));
        }
        if rows
            .iter()
            .any(|r| r.model == model && !r.clustered && r.n > 0)
        {
            out.push_str(&format!("* {UNCLUSTERED_NOTE}\n"));
        }
        if rows.iter().any(|r| r.model == model && few(r)) {
            out.push_str(&format!(
                "+ fewer than {FEW_TEMPLATES} templates: a clustered interval has at most \
                 templates - 1 degrees of freedom, so it is wide; more templates narrow it \
                 (`evalflow plan` says how many)\n"
            ));
        }
        if rows.iter().any(|r| r.model == model && rare_unstated(r)) {
            out.push_str(&format!(
                "^ a rate within {RARE_RATE} of 0 or 1 from fewer than {RARE_FEW_TEMPLATES} \
                 templates: the interval holds 95% only if the templates show their \
                 heterogeneity; state their ICC ([aggregate] icc, --icc) when a few may carry \
                 the failures (docs/intervals.md)\n"
            ));
        }
    }
    out
}

/// A rare rate over few templates whose interval honours no stated ICC.
fn rare_unstated(r: &ResultRow) -> bool {
    r.note
        .as_deref()
        .is_some_and(|n| n.starts_with("rare rate"))
        && !r.ci_method.contains("icc=")
}

/// A clustered row over fewer than [`FEW_TEMPLATES`] templates.
fn few(r: &ResultRow) -> bool {
    r.clustered && r.n > 0 && r.ci_lo.is_some() && r.n_templates < FEW_TEMPLATES
}

#[cfg(test)]
mod tests;
