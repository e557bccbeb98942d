//! `evalflow rescore RUN --scorer NAME[@VERSION]` or `--scorer-file S.toml`: re-scores
//! archived calls + validity with no model call, writes a new `scores/<name>@<version>/`
//! beside the old ones (never over them), and prints what changed against the previous
//! version of the same scorer: label changes by class, pass/fail changes by test, and the
//! paired difference of the metric with its interval clustered by template.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;
use futures::StreamExt;
use serde_json::json;

use super::{CliError, internal};
use crate::query::{QueryError, id_slices, new_context, open_run, text_rows};
use crate::stages::aggregate::render_table;
use crate::stages::score::{self, MetricKind, Scorer, ScorerId, user};
use crate::storage::RunStore;
use crate::udaf::cluster_interval::{ClusterInterval, IntervalSpec, paired_summary_interval};
use crate::udaf::cluster_summary::ClusterSummary;
use crate::udaf::common::Moments;

#[derive(Debug, clap::Args)]
pub struct RescoreArgs {
    /// The run root.
    pub run: String,
    /// The scorer, as NAME or NAME@VERSION (the version must be this build's): a built-in
    /// scorer, a `[[scorer]]` of the run's pipeline, or one of `--scorer-file`.
    #[arg(long, required_unless_present = "scorer_file")]
    pub scorer: Option<String>,
    /// A scorer file (TOML `[[scorer]]` tables, see docs/scorers.md); with
    /// several scorers in it, `--scorer NAME` picks one.
    #[arg(long)]
    pub scorer_file: Option<PathBuf>,
    /// Replacement cue lists for the cue scorer (changes its version).
    #[arg(long)]
    pub cues: Option<PathBuf>,
    /// The version to diff against (default: the newest other version of the same scorer;
    /// none when it has no earlier version).
    #[arg(long)]
    pub against: Option<String>,
    /// Send a judge scorer's calls through its provider's batch interface, at half the
    /// price (docs/batch.md); the scores are the same as synchronously.
    #[arg(long)]
    pub batch: bool,
    #[command(flatten)]
    pub cluster: super::ClusterArg,
}

/// The run's pipeline with every judge model (`[judge]`, a `[[scorer]]`'s `model`) in batch
/// mode (`--batch`).
fn batch_pipeline(pipeline: &serde_json::Value) -> serde_json::Value {
    let mut p = pipeline.clone();
    if let Some(j) = p.get_mut("judge").and_then(|j| j.as_object_mut()) {
        j.insert("batch".into(), json!(true));
    }
    for s in p
        .get_mut("scorer")
        .and_then(|s| s.as_array_mut())
        .into_iter()
        .flatten()
    {
        if let Some(m) = s.get_mut("model").and_then(|m| m.as_object_mut()) {
            m.insert("batch".into(), json!(true));
        }
    }
    p
}

/// The user scorer of `--scorer-file` that `--scorer` names (or the file's only one).
fn from_file(a: &RescoreArgs, file: &std::path::Path) -> Result<user::ScorerDef, CliError> {
    let defs = user::parse_file(file)
        .and_then(|d| score::sql_check::check_defs(&d).map(|()| d))
        .map_err(|e| CliError::BadInput(crate::stages::score::def_message(&e)))?;
    let names: Vec<&str> = defs.iter().map(|d| d.name.as_str()).collect();
    match &a.scorer {
        Some(spec) => {
            let name = spec.split('@').next().unwrap_or(spec);
            defs.iter()
                .find(|d| d.name == name)
                .cloned()
                .ok_or_else(|| {
                    CliError::BadInput(format!(
                        "--scorer {spec}: {} defines no scorer named `{name}` (it defines {})",
                        file.display(),
                        names.join(", ")
                    ))
                })
        }
        None if defs.len() == 1 => Ok(defs[0].clone()),
        None => Err(CliError::BadInput(format!(
            "{} defines {} scorers ({}): choose one with --scorer NAME",
            file.display(),
            defs.len(),
            names.join(", ")
        ))),
    }
}

pub async fn run(a: RescoreArgs) -> Result<(), CliError> {
    let (_, store, _) = open_run(&a.run)
        .await
        .map_err(|e| CliError::BadInput(e.to_string()))?;
    let _lease = super::lease(&store).await?;
    // Read again under the lease: the writer it waited for may have changed it.
    let (_, store, mut manifest) = open_run(&a.run)
        .await
        .map_err(|e| CliError::BadInput(e.to_string()))?;
    let scorer_err = |e: score::ScorerError| {
        if e.is_bad_input() {
            CliError::BadInput(format!("--scorer: {e}"))
        } else {
            CliError::Internal(e.to_string())
        }
    };
    // The definition read from --scorer-file, for naming its lines should it fail.
    let mut file_def = None;
    // A judge scorer's endpoint, recorded beside its scores.
    let mut endpoint: Option<String> = None;
    let scorer: Box<dyn Scorer> = match &a.scorer_file {
        Some(file) => {
            let mut def = from_file(&a, file)?;
            if let Some(m) = def.model.as_mut() {
                m.batch |= a.batch;
            }
            file_def = Some(def.clone());
            // Checked in full (and its version known) before a judge is asked anything.
            let version = def.version();
            if let Some(v) = a
                .scorer
                .as_deref()
                .and_then(|s| s.split_once('@'))
                .map(|x| x.1)
                && v != version
            {
                return Err(CliError::BadInput(format!(
                    "--scorer {}: {} defines version {version}",
                    a.scorer.as_deref().unwrap_or_default(),
                    file.display()
                )));
            }
            let judge: Option<crate::pipeline::ModelConfig> = manifest
                .pipeline
                .get("judge")
                .filter(|v| !v.is_null())
                .and_then(|v| serde_json::from_value(v.clone()).ok())
                .map(|mut j: crate::pipeline::ModelConfig| {
                    j.batch |= a.batch;
                    j
                });
            // A judge's endpoint is not in its version (the same model, another base_url):
            // recorded beside its scores, and named when it is what changed.
            if def.kind == crate::config::scorer::Kind::Judge {
                endpoint = def.model.as_ref().or(judge.as_ref()).map(|m| {
                    m.base_url
                        .clone()
                        .unwrap_or_else(|| format!("{} default", m.provider))
                });
            }
            let id = ScorerId {
                name: def.name.clone(),
                version,
            };
            if let (Some(now), Some(then)) = (
                &endpoint,
                manifest
                    .stages
                    .get(&format!("score:{}", id.tag()))
                    .and_then(|s| s.details.get("endpoint"))
                    .and_then(|v| v.as_str()),
            ) && now != then
            {
                return Err(CliError::BadInput(format!(
                    "{} was scored by the judge at {then}; {} points it at {now}, which its \
                     version does not show: add `version = \"...\"` to the [[scorer]] table to \
                     score a new version",
                    id.tag(),
                    file.display()
                )));
            }
            refuse_existing(&store, &id).await?;
            user::prepare(&def, &store, judge.as_ref())
                .await
                .map_err(scorer_err)?
        }
        None => {
            let spec = a.scorer.as_deref().unwrap_or_default();
            let pipeline = if a.batch {
                batch_pipeline(&manifest.pipeline)
            } else {
                manifest.pipeline.clone()
            };
            score::build_for_run(spec, a.cues.as_deref(), &store, &pipeline)
                .await
                .map_err(scorer_err)?
        }
    };
    let id = scorer.id();
    refuse_existing(&store, &id).await?;
    let against =
        match &a.against {
            Some(t) => Some(ScorerId::parse(t).ok_or_else(|| {
                CliError::BadInput(format!("--against {t}: expected NAME@VERSION"))
            })?),
            None => manifest
                .scorer_versions
                .iter()
                .rev()
                .filter_map(|t| ScorerId::parse(t))
                // The previous version of the same scorer only: a diff against another
                // scorer changes every row and says nothing about the new version.
                .find(|s| s.name == id.name),
        };
    let rows = tokio::select! {
        r = score::run(&store, scorer.as_ref()) => r.map_err(|e| {
            match score::sql_check::ScorerFailed::of(&e) {
                Some(f) => {
                    let def = file_def.clone().or_else(|| {
                        user::defs_of_pipeline(&manifest.pipeline)
                            .into_iter()
                            .find(|d| d.name == f.scorer.name)
                    });
                    CliError::BadInput(f.located(def.as_ref(), &manifest.pipeline_path).to_string())
                }
                None if e.is_bad_input() => CliError::BadInput(e.to_string()),
                None => internal(e),
            }
        })?,
        signal = interrupted() => {
            // The stage was dropped mid-write: what it wrote of the new version goes.
            let _ = store.delete_scratch(&id.dir()).await;
            return Err(CliError::Internal(format!(
                "rescore {}: interrupted by {signal}; nothing of {} was kept",
                id.tag(),
                id.dir()
            )));
        }
    };
    manifest.scorer_versions.push(id.tag());
    let stage = format!("score:{}", id.tag());
    let mut details = BTreeMap::from([
        (
            "logic_hash".into(),
            json!(score::logic_hash(scorer.as_ref())),
        ),
        ("rescored".into(), json!(true)),
        ("metric".into(), json!(scorer.metric_kind().metric())),
    ]);
    if let Some(d) = scorer.definition() {
        details.insert("definition".into(), d);
    }
    if let Some(e) = endpoint {
        details.insert("endpoint".into(), json!(e));
    }
    manifest.complete(&stage, &id.dir(), rows, details);
    manifest.save(&store).await.map_err(internal)?;
    if let Some(w) = score::coverage::judge_replies(&store, &id)
        .await
        .map_err(internal)?
    {
        crate::progress::errln!("{w}");
    }
    crate::progress::outln!(
        "rescored {rows} rows with {} into {}/{}",
        id.tag(),
        store.display(),
        id.dir()
    );
    if scorer.metric_kind() == MetricKind::PassFail && scorer.definition().is_none() {
        // A built-in label match that never matched says so (see `score::coverage`).
        let coverage = score::coverage::label_coverage(&store, &id)
            .await
            .map_err(internal)?;
        if let Some(w) = coverage.warning(&id) {
            crate::progress::errln!("{w}");
        }
    }

    let Some(old) = against else {
        crate::progress::outln!(
            "no earlier version of `{}` to compare with (--against NAME@VERSION diffs against another scorer)",
            id.name
        );
        return Ok(());
    };
    let ctx = new_context();
    crate::query::for_template_slices(&ctx);
    crate::query::register_scores_of(&ctx, &store, &[&old, &id])
        .await
        .map_err(internal)?;
    let diff = match register_pairs(&ctx, &store, &old, &id, rows).await {
        Ok(()) => print_diff(&ctx, &old, &id, scorer.metric_kind()).await,
        Err(e) => Err(e),
    };
    // The pairs are scratch whether or not the diff could be printed.
    let _ = store.delete_scratch(PAIRS_ROOT).await;
    // A diff that does not fit the memory limit is exit 2, as for any query.
    diff.map_err(|e| {
        if e.is_bad_input() {
            CliError::BadInput(e.to_string())
        } else {
            internal(e)
        }
    })
}

/// Resolves on the first SIGINT (Ctrl-C) or SIGTERM, naming it; never on a platform or
/// process where the signals cannot be watched.
async fn interrupted() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) {
            (Ok(mut int), Ok(mut term)) => tokio::select! {
                _ = int.recv() => "SIGINT",
                _ = term.recv() => "SIGTERM",
            },
            _ => std::future::pending().await,
        }
    }
    #[cfg(not(unix))]
    {
        match tokio::signal::ctrl_c().await {
            Ok(()) => "Ctrl-C",
            Err(_) => std::future::pending().await,
        }
    }
}

/// Where a diff's pairs are written (see [`register_pairs`]); deleted after the diff.
const PAIRS_ROOT: &str = "_rescore";
const PAIRS: &str = "_rescore/pairs";

/// Rows of the new version one slice of [`register_pairs`] joins at most: a tenth of the
/// memory limit at about 100 bytes of hash table a row (1.07M rows at 1 GiB), the same at
/// any run size. A quarter (2.7M rows) made the pairing the peak of a 10M rescore: 674 MB
/// against 582 MB for scoring, 45 s against 50 s. `EVALFLOW_RESCORE_SLICE_ROWS` sets
/// another (tests use a small one to pair in many slices).
fn pair_slice_rows() -> usize {
    crate::config::env_count("EVALFLOW_RESCORE_SLICE_ROWS")
        .map(|n| n as usize)
        .unwrap_or_else(|| (crate::query::resources().memory_limit / 1000).max(100_000))
}

/// Pairs each call's row of `old` with its row of `new` once, into scratch Parquet
/// registered as `rescore_pairs`: struct columns `o` and `n` holding the fields the diff
/// reads, so each of its queries reads `o.label`, `n.passed`, ... with no join of its own,
/// and `template_id` (the new row's) as a column of its own: the diff reads the pairs by
/// template slices, and a slice's filter on a plain column is applied while Parquet is
/// decoded, before the struct columns are.
///
/// The join runs slice by slice of the call ids ([`crate::query::id_slices`]), one slice
/// per [`pair_slice_rows`] rescored rows: a hash join holds its whole build side and
/// DataFusion 55 cannot spill one, so joining the two versions whole failed at 10M calls
/// with a 1 GiB limit.
async fn register_pairs(
    ctx: &SessionContext,
    store: &RunStore,
    old: &ScorerId,
    new: &ScorerId,
    rows: u64,
) -> Result<(), QueryError> {
    const WHAT: &str = "rescore: pairing the two versions";
    store.delete_dir(PAIRS_ROOT).await?;
    let version = |t: &str, s: &ScorerId| {
        format!(
            "{t}.scorer = {} AND {t}.scoring_version = {}",
            lit(&s.name),
            lit(&s.version)
        )
    };
    let passes = (rows as usize).div_ceil(pair_slice_rows());
    let mut writer: Option<crate::storage::PartWriter> = None;
    let mut schema = None;
    for (os, ns) in id_slices("o.call_id", passes)
        .iter()
        .zip(id_slices("n.call_id", passes))
    {
        let sql = format!(
            "SELECT named_struct('label', o.label, 'passed', o.passed, 'score', o.score) AS o, \
             named_struct('label', n.label, 'passed', n.passed, 'score', n.score, \
             'template_id', n.template_id, 'test', n.test, 'role', n.role) AS n, \
             n.template_id AS template_id \
             FROM scores o JOIN scores n ON o.call_id = n.call_id \
             WHERE {} AND {} AND {os} AND {ns}",
            version("o", old),
            version("n", new)
        );
        let df = ctx.sql(&sql).await.map_err(QueryError::df(WHAT))?;
        let s: SchemaRef = Arc::new(df.schema().as_arrow().clone());
        let mut stream = df.execute_stream().await.map_err(QueryError::df(WHAT))?;
        // Compressed and dictionary-encoded (labels, roles and tests repeat): every query of
        // the diff reads these parts again.
        let w = writer.get_or_insert_with(|| {
            store
                .part_writer(PAIRS, s.clone(), "pairs")
                .pipelined(crate::query::resources().threads.max(1))
        });
        schema = Some(s);
        while let Some(b) = stream.next().await {
            w.write(b.map_err(QueryError::df(WHAT))?).await?;
        }
    }
    let (written, _) = match writer {
        Some(w) => w.finish().await?,
        None => (0, vec![]),
    };
    if written > 0 {
        return crate::query::register_parquet(ctx, "rescore_pairs", &store.table_url(PAIRS)).await;
    }
    // Nothing pairs: an empty table of the same columns.
    let schema = schema.expect("at least one slice was planned");
    let empty = MemTable::try_new(schema, vec![vec![]]).map_err(QueryError::df(WHAT))?;
    ctx.register_table("rescore_pairs", Arc::new(empty))
        .map_err(QueryError::df(WHAT))?;
    Ok(())
}

/// Refuses a version already scored: rescoring never overwrites (exit 2).
async fn refuse_existing(store: &crate::storage::RunStore, id: &ScorerId) -> Result<(), CliError> {
    if store
        .list_parts(&id.dir())
        .await
        .map_err(internal)?
        .is_empty()
    {
        return Ok(());
    }
    Err(CliError::BadInput(format!(
        "{} is already scored ({}/{} exists): rescoring never overwrites a scores version \
         (change the scorer's definition, add `version = \"...\"` to its [[scorer]] table, \
         or use other cues)",
        id.tag(),
        store.display(),
        id.dir()
    )))
}

/// A SQL string literal.
fn lit(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The paired cells of the diff: `(old value, new value)` of the metric as SQL over the
/// pair `o`, `n`, and what it is called.
fn paired_values(kind: MetricKind) -> (&'static str, &'static str, &'static str) {
    match kind {
        MetricKind::PassFail | MetricKind::Label => (
            "CASE WHEN o.passed THEN 0.0 WHEN NOT o.passed THEN 1.0 END",
            "CASE WHEN n.passed THEN 0.0 WHEN NOT n.passed THEN 1.0 END",
            "failure rate",
        ),
        MetricKind::Numeric => (
            "CAST(o.score AS DOUBLE)",
            "CAST(n.score AS DOUBLE)",
            "mean score",
        ),
    }
}

/// `+1.2 pts [-0.4, +2.8]` for a rate, `+0.012 [-0.004, +0.028]` for a mean.
fn diff_cell(mean: &Option<String>, lo: &Option<String>, hi: &Option<String>, pct: bool) -> String {
    let f = |v: &Option<String>| v.as_deref().and_then(|s| s.parse::<f64>().ok());
    let show = |x: f64| {
        if pct {
            format!("{:+.1}", x * 100.0)
        } else {
            format!("{x:+.3}")
        }
    };
    match (f(mean), f(lo), f(hi)) {
        (Some(m), Some(l), Some(h)) => format!(
            "{}{} [{}, {}]",
            show(m),
            if pct { " pts" } else { "" },
            show(l),
            show(h)
        ),
        (Some(m), _, _) => format!("{}{} [-]", show(m), if pct { " pts" } else { "" }),
        _ => "-".into(),
    }
}

/// `diff_cell` of an interval.
fn interval_cell(p: &ClusterInterval, pct: bool) -> String {
    let s = |x: Option<f64>| x.map(|v| v.to_string());
    diff_cell(&s(p.mean), &s(p.lo), &s(p.hi), pct)
}

/// A test's difference and its interval: the clustered one, or, for a test whose clustered
/// interval cannot be computed (one template), the normal interval of independent pairs as
/// `aggregate` shows it (`false`: not clustered). `None` when there is neither.
fn test_interval(p: &ClusterInterval, d: &Moments) -> Option<(f64, f64, f64, bool)> {
    if let (Some(mean), Some(lo), Some(hi)) = (p.mean, p.lo, p.hi) {
        return Some((mean, lo, hi, true));
    }
    if d.n < 2 {
        return None;
    }
    let se = (d.m2 / (d.n - 1) as f64 / d.n as f64).sqrt();
    let z = crate::stages::aggregate::Z95;
    Some((d.mean, d.mean - z * se, d.mean + z * se, false))
}

/// The most labels whose rates the diff tabulates.
const MAX_LABELS: u64 = 50;

/// The most label changes by class the diff prints (the largest first).
const MAX_CLASSES: usize = 25;

/// The paired differences of a diff: per metric over every pair, and the first metric's
/// per test.
struct Paired {
    /// Per metric: `paired_diff_clustered(nv, ov, n.template_id)`, default interval.
    overall: Vec<ClusterInterval>,
    /// Per metric: pairs with both values, and the sums of the old and the new values.
    rates: Vec<(u64, f64, f64)>,
    /// The first metric per test, tests with a pair only: its clustered interval, and the
    /// moments of its differences (for a test of one template, whose clustered interval
    /// cannot be computed: `aggregate` then shows the interval of independent cases).
    by_test: Vec<(Option<String>, ClusterInterval, Moments)>,
}

/// One metric's cell of a template: moments of `new - old` and whether every pair was 0/1.
#[derive(Debug, Clone, Copy, Default)]
struct PairCell {
    d: Moments,
    binary: bool,
}

/// Every paired difference of the diff in one pass over the pairs per template slice
/// (`slices`, [`crate::query::range_slices`]): a slice's query sums each (test, template)'s
/// differences of every metric (`(nv, ov)` SQL over the pairs, base rows left out), and the
/// finished templates are folded into per-size sums ([`ClusterSummary`]), so the diff holds
/// one slice's templates, not the run's, and reads the pairs once per slice whatever the
/// number of metrics. As `paired_diff_clustered`: a NaN difference and a pair without a
/// template are left out, and the pairs are 0/1 when both of their values are.
async fn paired_pass(
    ctx: &SessionContext,
    metrics: &[(String, String)],
    slices: &[String],
) -> Result<Paired, crate::query::QueryError> {
    use datafusion::arrow::array::{Array, BooleanArray, Float64Array, StringArray};
    let mut inner = vec![
        "CAST(n.test AS VARCHAR) AS g".to_string(),
        "template_id AS t".to_string(),
    ];
    let mut sel = vec!["g".to_string(), "t".to_string()];
    for (m, (nv, ov)) in metrics.iter().enumerate() {
        let both = format!("n.role <> 'base' AND ({nv}) IS NOT NULL AND ({ov}) IS NOT NULL");
        inner.push(format!(
            "CASE WHEN {both} AND NOT isnan(({nv}) - ({ov})) THEN ({nv}) - ({ov}) END AS d{m}"
        ));
        inner.push(format!(
            "CASE WHEN {both} THEN ({nv}) IN (0.0, 1.0) AND ({ov}) IN (0.0, 1.0) END AS b{m}"
        ));
        inner.push(format!(
            "CASE WHEN {both} THEN CAST({ov} AS DOUBLE) END AS o{m}"
        ));
        inner.push(format!(
            "CASE WHEN {both} THEN CAST({nv} AS DOUBLE) END AS n{m}"
        ));
        sel.push(format!(
            "CAST(count(d{m}) AS DOUBLE), sum(d{m}), var_pop(d{m}), bool_and(b{m}), \
             CAST(count(o{m}) AS DOUBLE), sum(o{m}), sum(n{m})"
        ));
    }
    const COLS: usize = 7;
    let k = metrics.len();
    let mut overall = vec![(ClusterSummary::default(), true); k];
    let mut rates = vec![(0u64, 0.0, 0.0); k];
    // Per test (first metric): looked up by the test (NULL as "\u{2}") without a key per row.
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut tests: Vec<(Option<String>, ClusterSummary, bool, Moments)> = Vec::new();
    for slice in slices {
        let sql = format!(
            "SELECT {} FROM (SELECT {} FROM rescore_pairs WHERE {slice}) GROUP BY g, t",
            sel.join(", "),
            inner.join(", ")
        );
        // A template's cells over its tests, merged before they are folded (a template may
        // span tests): one slice's templates at most.
        let mut merged: HashMap<String, Vec<PairCell>> = HashMap::new();
        crate::query::for_each_batch(ctx, &sql, |b| {
            let s = |i: usize| b.column(i).as_any().downcast_ref::<StringArray>();
            let f = |i: usize| {
                b.column(i)
                    .as_any()
                    .downcast_ref::<Float64Array>()
                    .expect("the query casts its numbers to DOUBLE")
            };
            let flag = |i: usize| {
                b.column(i)
                    .as_any()
                    .downcast_ref::<BooleanArray>()
                    .expect("bool_and gives booleans")
            };
            let (Some(g), Some(t)) = (s(0), s(1)) else {
                unreachable!("tests and templates are strings")
            };
            for r in 0..b.num_rows() {
                let template = t.is_valid(r).then(|| t.value(r));
                let cells: Vec<PairCell> = (0..k)
                    .map(|m| {
                        let c = 2 + COLS * m;
                        let (o_n, o_sum, n_sum) = (f(c + 4), f(c + 5), f(c + 6));
                        if o_n.value(r) > 0.0 {
                            rates[m].0 += o_n.value(r) as u64;
                            rates[m].1 += o_sum.value(r);
                            rates[m].2 += n_sum.value(r);
                        }
                        let n = f(c).value(r);
                        if n == 0.0 {
                            return PairCell {
                                d: Moments::default(),
                                binary: true,
                            };
                        }
                        let bin = flag(c + 3);
                        PairCell {
                            d: Moments {
                                n: n as u64,
                                mean: f(c + 1).value(r) / n,
                                m2: f(c + 2).value(r) * n,
                            },
                            binary: !bin.is_valid(r) || bin.value(r),
                        }
                    })
                    .collect();
                let Some(template) = template else { continue };
                if cells[0].d.n > 0 {
                    let key = if g.is_valid(r) { g.value(r) } else { "\u{2}" };
                    let i = match index.get(key) {
                        Some(i) => *i,
                        None => {
                            tests.push((
                                g.is_valid(r).then(|| key.to_string()),
                                ClusterSummary::default(),
                                true,
                                Moments::default(),
                            ));
                            index.insert(key.to_string(), tests.len() - 1);
                            tests.len() - 1
                        }
                    };
                    tests[i].1.add(&cells[0].d);
                    tests[i].2 &= cells[0].binary;
                    tests[i].3.merge(&cells[0].d);
                }
                match merged.get_mut(template) {
                    Some(acc) => {
                        for (a, c) in acc.iter_mut().zip(&cells) {
                            a.d.merge(&c.d);
                            a.binary &= c.binary;
                        }
                    }
                    None => {
                        merged.insert(template.to_string(), cells);
                    }
                }
            }
            Ok(())
        })
        .await?;
        for cells in merged.into_values() {
            for (o, c) in overall.iter_mut().zip(&cells) {
                o.0.add(&c.d);
                o.1 &= c.binary;
            }
        }
    }
    let spec = IntervalSpec::default();
    let mut by_test: Vec<(Option<String>, ClusterInterval, Moments)> = tests
        .into_iter()
        .map(|(g, s, binary, d)| (g, paired_summary_interval(&s, &spec, binary), d))
        .collect();
    by_test.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(Paired {
        overall: overall
            .iter()
            .map(|(s, binary)| paired_summary_interval(s, &spec, *binary))
            .collect(),
        rates,
        by_test,
    })
}

/// Prints the diff of scorer version `new` against `old`.
async fn print_diff(
    ctx: &SessionContext,
    old: &ScorerId,
    new: &ScorerId,
    kind: MetricKind,
) -> Result<(), crate::query::QueryError> {
    // Every query below reads the pairs of `register_pairs` (each `o.x` / `n.x` is a field
    // of its struct column) and appends its own conditions.
    let pair = "FROM rescore_pairs WHERE TRUE";
    let c = |v: &Option<String>| v.clone().unwrap_or_else(|| "0".into());
    let totals = text_rows(
        ctx,
        &format!(
            "SELECT count(*), sum(CASE WHEN o.label IS DISTINCT FROM n.label THEN 1 ELSE 0 END), \
             sum(CASE WHEN o.passed IS DISTINCT FROM n.passed THEN 1 ELSE 0 END) {pair}"
        ),
    )
    .await?;
    let t = &totals[0];
    crate::progress::outln!(
        "\ndiff {} -> {}: {} rows paired, {} changed label, {} changed pass/fail",
        old.tag(),
        new.tag(),
        c(&t[0]),
        c(&t[1]),
        c(&t[2])
    );
    // The paired difference of the metric (new - old) over rows scored by both, its
    // interval clustered by template (cases of one template are not independent).
    let (ov, nv, what) = paired_values(kind);
    let pct = kind != MetricKind::Numeric;
    let pairs: u64 = t[0].as_deref().and_then(|n| n.parse().ok()).unwrap_or(0);
    let slices = crate::query::range_slices(
        ctx,
        "template_id",
        "rescore_pairs",
        pairs,
        // Four aggregate slices a slice: the diff's per-template sums are small next to the
        // pairing join's (about 0.4 s a slice over 10M pairs, 20 slices took 6.5 s more).
        pairs.div_ceil(4 * crate::stages::aggregate::slice_rows()) as usize,
    )
    .await?;
    // The rate of each label, new - old, over rows labelled by both versions.
    // A label scorer has a few labels; a version diffed against another kind of scorer
    // (`--against checklist@2`, whose label is the normalised answer) can have millions,
    // whose rates are no table (and whose `DISTINCT` would not fit): counted first, in
    // constant memory.
    let labelled = format!(
        "(SELECT o.label AS l {pair} AND n.role <> 'base' AND o.score IS NOT NULL \
         UNION ALL SELECT n.label AS l {pair} AND n.role <> 'base' AND n.score IS NOT NULL)"
    );
    let many: u64 = if kind == MetricKind::Label {
        text_rows(ctx, &format!("SELECT approx_distinct(l) FROM {labelled}"))
            .await?
            .first()
            .and_then(|r| r[0].as_deref().and_then(|n| n.parse().ok()))
            .unwrap_or(0)
    } else {
        0
    };
    let labels: Vec<String> = if kind == MetricKind::Label && many <= MAX_LABELS {
        text_rows(
            ctx,
            &format!("SELECT DISTINCT l FROM {labelled} WHERE l IS NOT NULL ORDER BY l"),
        )
        .await?
        .into_iter()
        .filter_map(|r| r[0].clone())
        .collect()
    } else {
        Vec::new()
    };
    let ind = |t: &str, l: &str| {
        format!(
            "CASE WHEN {t}.score IS NULL OR {t}.label IS NULL THEN NULL WHEN {t}.label = {} THEN 1.0 ELSE 0.0 END",
            lit(l)
        )
    };
    let mut metrics = vec![(nv.to_string(), ov.to_string())];
    metrics.extend(labels.iter().map(|l| (ind("n", l), ind("o", l))));
    let paired = paired_pass(ctx, &metrics, &slices).await?;
    let p = &paired.overall[0];
    if p.n > 0 {
        crate::progress::outln!(
            "{what}, new - old: {} over {} paired rows (95% interval clustered by template, {})",
            interval_cell(p, pct),
            p.n,
            p.method.name()
        );
    }
    let by_class = text_rows(
        ctx,
        &format!(
            "SELECT coalesce(o.label, 'NULL'), coalesce(n.label, 'NULL'), count(*) {pair} \
             AND o.label IS DISTINCT FROM n.label GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2 \
             LIMIT {}",
            MAX_CLASSES + 1
        ),
    )
    .await?;
    if !by_class.is_empty() {
        if by_class.len() > MAX_CLASSES {
            crate::progress::outln!("\nlabel changes by class (the {MAX_CLASSES} largest)");
        } else {
            crate::progress::outln!("\nlabel changes by class");
        }
        let by_class = &by_class[..by_class.len().min(MAX_CLASSES)];
        let rows: Vec<Vec<String>> = by_class.iter().map(|r| r.iter().map(c).collect()).collect();
        crate::progress::outln!(
            "{}",
            render_table(&["old label", "new label", "rows"], &rows)
        );
    }
    if kind == MetricKind::Label && many > MAX_LABELS {
        crate::progress::outln!(
            "\nrate of each label: not shown, about {many} distinct labels (more than {MAX_LABELS})"
        );
    }
    if kind == MetricKind::Label {
        let mut rows = Vec::new();
        for (m, l) in labels.iter().enumerate() {
            let (p, (both, o_sum, n_sum)) = (&paired.overall[m + 1], paired.rates[m + 1]);
            let rate =
                |sum: f64| crate::stages::aggregate::pct((both > 0).then(|| sum / both as f64));
            rows.push(vec![
                l.clone(),
                p.n.to_string(),
                rate(o_sum),
                rate(n_sum),
                interval_cell(p, true),
            ]);
        }
        if !rows.is_empty() {
            crate::progress::outln!(
                "\nrate of each label, new - old (95% interval clustered by template)"
            );
            crate::progress::outln!(
                "{}",
                render_table(
                    &[
                        "label",
                        "paired rows",
                        "old rate",
                        "new rate",
                        "new - old [95% CI]"
                    ],
                    &rows
                )
            );
        }
    }
    // The counts over the population of the difference: base rows of INV/DIR tests are
    // left out (their perturbed rows carry the comparison).
    let by_test = text_rows(
        ctx,
        &format!(
            "SELECT n.test, sum(CASE WHEN o.passed AND NOT n.passed THEN 1 ELSE 0 END), \
             sum(CASE WHEN NOT o.passed AND n.passed THEN 1 ELSE 0 END), \
             sum(CASE WHEN (o.passed IS NULL) <> (n.passed IS NULL) THEN 1 ELSE 0 END) \
             {pair} AND n.role <> 'base' GROUP BY 1 \
             HAVING sum(CASE WHEN o.passed IS DISTINCT FROM n.passed THEN 1 ELSE 0 END) > 0 ORDER BY 1"
        ),
    )
    .await?;
    // (`(a IS NULL) <> (b IS NULL)`, not `a IS DISTINCT FROM b AND (a IS NULL OR b IS NULL)`:
    // DataFusion 55.2 simplifies the latter to `a IS DISTINCT FROM false`, true for two trues.)
    if !by_test.is_empty() {
        let mut unclustered = false;
        let mut diff_of = |test: &Option<String>| {
            let Some((_, p, d)) = paired.by_test.iter().find(|(t, _, _)| t == test) else {
                return "-".to_string();
            };
            match test_interval(p, d) {
                Some((mean, lo, hi, clustered)) => {
                    let s = |x: f64| Some(x.to_string());
                    let cell = diff_cell(&s(mean), &s(lo), &s(hi), pct);
                    if clustered {
                        cell
                    } else {
                        unclustered = true;
                        format!("{cell} *")
                    }
                }
                None => interval_cell(p, pct),
            }
        };
        crate::progress::outln!("\npass/fail changes by test");
        let rows: Vec<Vec<String>> = by_test
            .iter()
            .map(|r| vec![c(&r[0]), c(&r[1]), c(&r[2]), c(&r[3]), diff_of(&r[0])])
            .collect();
        let header = format!("{what} new - old [95% CI]");
        crate::progress::outln!(
            "{}",
            render_table(
                &[
                    "test",
                    "pass -> fail",
                    "fail -> pass",
                    "to/from unscored",
                    &header,
                ],
                &rows
            )
        );
        if unclustered {
            crate::progress::outln!("* {}", crate::stages::aggregate::UNCLUSTERED_NOTE);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::udaf::cluster_interval::Method;

    fn interval(lo: Option<f64>, hi: Option<f64>) -> ClusterInterval {
        ClusterInterval {
            n: 4,
            n_clusters: 1,
            mean: Some(0.5),
            se: None,
            lo,
            hi,
            df: None,
            method: Method::Cr2Ri,
            stat: None,
            p_value: None,
            icc: None,
        }
    }

    /// A test of one template has no clustered interval: its cell is the normal interval of
    /// independent pairs, as `aggregate` shows such a test (differences 1, 0, 1, 0: mean
    /// 0.5, sample variance 1/3, se sqrt(1/12)), marked as not clustered.
    #[test]
    fn one_template_gets_the_interval_of_independent_pairs() {
        let mut d = Moments::default();
        for x in [1.0, 0.0, 1.0, 0.0] {
            d.push(x);
        }
        let none = interval(None, None);
        let (mean, lo, hi, clustered) = test_interval(&none, &d).unwrap();
        let se = (1.0f64 / 12.0).sqrt();
        assert!(!clustered);
        assert!((mean - 0.5).abs() < 1e-12);
        assert!((lo - (0.5 - 1.959963984540054 * se)).abs() < 1e-12, "{lo}");
        assert!((hi - (0.5 + 1.959963984540054 * se)).abs() < 1e-12, "{hi}");
        // A clustered interval is kept as it is; one pair has no interval at all.
        let some = interval(Some(0.1), Some(0.9));
        assert_eq!(test_interval(&some, &d), Some((0.5, 0.1, 0.9, true)));
        let mut one = Moments::default();
        one.push(1.0);
        assert_eq!(test_interval(&none, &one), None);
    }
}
