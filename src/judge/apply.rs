//! Applying a trained model: prediction tables, per-unit explanations and the paper's
//! evaluation (accuracy, agreement, held-out-judge agreement, self-consistency).

use std::sync::Arc;

use datafusion::arrow::array::{
    ArrayRef, Float64Array, Float64Builder, Int32Array, ListBuilder, StringArray, StringBuilder,
};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;

use super::JudgeError;
use super::data::{Dataset, Labels, Obs};
use super::metrics::{self, Scored};
use super::model::{Grid, JudgeModel, TrainOptions};
use super::split::Split;
use super::waterfall::{Bar, Waterfall};

/// The schema of `judge predict` output.
pub fn predictions_schema() -> SchemaRef {
    let list = |name: &str, t: DataType| {
        Field::new(
            name,
            DataType::List(Arc::new(Field::new_list_field(t, true))),
            true,
        )
    };
    Arc::new(Schema::new(vec![
        Field::new("unit", DataType::Utf8, false),
        Field::new("judge", DataType::Utf8, false),
        Field::new("trial", DataType::Int32, false),
        Field::new("split", DataType::Utf8, false),
        Field::new("prediction", DataType::Float64, false),
        Field::new("lo", DataType::Float64, false),
        Field::new("hi", DataType::Float64, false),
        Field::new("width", DataType::Float64, false),
        Field::new("sigma", DataType::Float64, false),
        Field::new("coverage_level", DataType::Float64, false),
        Field::new("fraction_yes", DataType::Float64, false),
        Field::new("baseline", DataType::Float64, false),
        Field::new("expected_value", DataType::Float64, false),
        list("top_questions", DataType::Utf8),
        list("top_contributions", DataType::Float64),
        Field::new("label", DataType::Float64, true),
    ]))
}

fn split_name(model: &JudgeModel, unit: &str) -> &'static str {
    model.meta.splits.get(unit).map_or("unseen", |s| s.as_str())
}

/// Checks that the data's checklist matches the model's (same question count).
pub fn check_compatible(model: &JudgeModel, ds: &Dataset) -> Result<(), JudgeError> {
    let d = model.meta.questions.len();
    match ds.obs.first() {
        Some(o) if o.answers.len() != d => Err(JudgeError::BadInput(format!(
            "the answers have {} questions but the model was trained on {d} ({})",
            o.answers.len(),
            model.meta.checklist
        ))),
        _ => Ok(()),
    }
}

/// One row per observation: prediction, interval and the `top` contributing questions.
pub fn predictions_batch(
    model: &JudgeModel,
    ds: &Dataset,
    labels: Option<&Labels>,
    top: usize,
) -> Result<RecordBatch, JudgeError> {
    check_compatible(model, ds)?;
    let x: Vec<Vec<f64>> = ds.obs.iter().map(Obs::features).collect();
    let preds = model.predict(&x);
    let contrib = model.contributions(&x);
    let mut tq = ListBuilder::new(StringBuilder::new());
    let mut tc = ListBuilder::new(Float64Builder::new());
    for c in &contrib {
        for (q, v) in model.top_questions(c, top) {
            tq.values().append_value(q);
            tc.values().append_value(v);
        }
        tq.append(true);
        tc.append(true);
    }
    let range = model.meta.label_range;
    let f = |v: Vec<f64>| -> ArrayRef { Arc::new(Float64Array::from(v)) };
    let cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from_iter_values(
            ds.obs.iter().map(|o| &o.unit),
        )),
        Arc::new(StringArray::from_iter_values(
            ds.obs.iter().map(|o| &o.judge),
        )),
        Arc::new(Int32Array::from_iter_values(ds.obs.iter().map(|o| o.trial))),
        Arc::new(StringArray::from_iter_values(
            ds.obs.iter().map(|o| split_name(model, &o.unit)),
        )),
        f(preds.iter().map(|p| p.mean).collect()),
        f(preds.iter().map(|p| p.lo).collect()),
        f(preds.iter().map(|p| p.hi).collect()),
        f(preds.iter().map(|p| p.width()).collect()),
        f(preds.iter().map(|p| p.sigma).collect()),
        f(vec![1.0 - model.meta.calibration.alpha; preds.len()]),
        f(ds.obs.iter().map(Obs::fraction_yes).collect()),
        f(ds.obs
            .iter()
            .map(|o| metrics::baseline_score(o.fraction_yes(), range))
            .collect()),
        f(contrib.iter().map(|c| *c.last().unwrap_or(&0.0)).collect()),
        Arc::new(tq.finish()),
        Arc::new(tc.finish()),
        Arc::new(
            ds.obs
                .iter()
                .map(|o| labels.and_then(|l| l.values.get(&o.unit).copied()))
                .collect::<Float64Array>(),
        ),
    ];
    RecordBatch::try_new(predictions_schema(), cols)
        .map_err(|e| JudgeError::Encode(format!("predictions batch: {e}")))
}

/// The waterfall of one unit: the mean contributions over the unit's rows (optionally one
/// judge and/or trial). Shapley values are linear, so the mean contributions explain the mean
/// prediction exactly.
pub fn explain_unit(
    model: &JudgeModel,
    ds: &Dataset,
    unit: &str,
    judge: Option<&str>,
    trial: Option<i32>,
    max_bars: usize,
) -> Result<Waterfall, JudgeError> {
    check_compatible(model, ds)?;
    let rows: Vec<&Obs> = ds
        .obs
        .iter()
        .filter(|o| {
            o.unit == unit
                && judge.is_none_or(|j| o.judge == j)
                && trial.is_none_or(|t| o.trial == t)
        })
        .collect();
    if rows.is_empty() {
        return Err(JudgeError::BadInput(format!(
            "unit `{unit}`{}{}: no rows with answers",
            judge.map(|j| format!(", judge `{j}`")).unwrap_or_default(),
            trial.map(|t| format!(", trial {t}")).unwrap_or_default()
        )));
    }
    let x: Vec<Vec<f64>> = rows.iter().map(|o| o.features()).collect();
    let contrib = model.contributions(&x);
    let d = model.meta.questions.len();
    let n = rows.len() as f64;
    let mean_c: Vec<f64> = (0..=d)
        .map(|j| contrib.iter().map(|c| c[j]).sum::<f64>() / n)
        .collect();
    let yes: Vec<f64> = (0..d)
        .map(|j| x.iter().map(|r| r[j]).sum::<f64>() / n)
        .collect();
    let bars = (0..d)
        .map(|j| Bar {
            label: if rows.len() == 1 {
                format!(
                    "{} = {}",
                    model.meta.questions[j],
                    if yes[j] > 0.5 { "YES" } else { "NO" }
                )
            } else {
                format!("{} ({:.0}% YES)", model.meta.questions[j], 100.0 * yes[j])
            },
            value: mean_c[j],
        })
        .collect();
    let what = match (judge, trial) {
        (Some(j), Some(t)) => format!("{j}, trial {t}"),
        (Some(j), None) => format!("{j}, mean of {} trials", rows.len()),
        (None, Some(t)) => format!("trial {t}, mean of {} judges", rows.len()),
        (None, None) => format!("mean of {} judge x trial rows", rows.len()),
    };
    let space = match model.meta.kind {
        super::LabelKind::Regression => "score",
        super::LabelKind::Binary => "log-odds",
    };
    Ok(Waterfall {
        title: format!("unit {unit} ({what}); SHAP, {space}"),
        base: mean_c[d],
        bars,
        max_bars,
    })
}

/// The paper's figures on the test split.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Evaluation {
    pub test_units: usize,
    pub test_rows: usize,
    pub rmse_baseline: f64,
    pub rmse_gbdt: f64,
    pub coverage: f64,
    pub coverage_level: f64,
    pub mean_width: f64,
    pub judges: Vec<String>,
    /// Judge x judge agreement of the fraction of YES (diagonal: self-consistency).
    pub agreement_baseline: Vec<Vec<Option<f64>>>,
    /// The same for the GBDT's scores mapped to [0, 1].
    pub agreement_gbdt: Vec<Vec<Option<f64>>>,
    /// Row J: agreement of judge J with each other judge, by a model trained without J.
    pub agreement_held_out: Option<Vec<Vec<Option<f64>>>>,
    pub self_consistency_baseline: Vec<Option<f64>>,
    pub self_consistency_gbdt: Vec<Option<f64>>,
}

fn scored<'a>(rows: &[&'a Obs], scores: &[f64]) -> Vec<Scored<'a>> {
    rows.iter()
        .zip(scores)
        .map(|(o, s)| Scored {
            unit: &o.unit,
            judge: &o.judge,
            score: *s,
        })
        .collect()
}

/// Evaluates `model` on its test split. With `held_out`, also retrains once per judge J
/// without J's rows (same split, seed and hyperparameters as `model`) and measures the
/// agreement of J with the other judges.
pub fn evaluate(
    model: &JudgeModel,
    ds: &Dataset,
    labels: &Labels,
    held_out: bool,
) -> Result<Evaluation, JudgeError> {
    check_compatible(model, ds)?;
    let test: Vec<&Obs> = ds
        .obs
        .iter()
        .filter(|o| model.meta.splits.get(&o.unit) == Some(&Split::Test))
        .collect();
    if test.is_empty() {
        return Err(JudgeError::BadInput(
            "no rows of the model's test units in these scores".into(),
        ));
    }
    let range = model.meta.label_range;
    let x: Vec<Vec<f64>> = test.iter().map(|o| o.features()).collect();
    let preds = model.predict(&x);
    let (mut y, mut p, mut b, mut lo, mut hi) = (vec![], vec![], vec![], vec![], vec![]);
    for (o, pr) in test.iter().zip(&preds) {
        if let Some(l) = labels.values.get(&o.unit) {
            y.push(*l);
            p.push(pr.mean);
            b.push(metrics::baseline_score(o.fraction_yes(), range));
            lo.push(pr.lo);
            hi.push(pr.hi);
        }
    }
    let judges = ds.judges();
    let fy: Vec<f64> = test.iter().map(|o| o.fraction_yes()).collect();
    let gb: Vec<f64> = preds
        .iter()
        .map(|p| metrics::to_unit(p.mean, range))
        .collect();
    let (sb, sg) = (scored(&test, &fy), scored(&test, &gb));
    let sc = |rows: &[Scored]| {
        let m = metrics::self_consistency(rows);
        judges.iter().map(|j| m.get(j.as_str()).copied()).collect()
    };
    let agreement_held_out = if held_out {
        let mut table = Vec::new();
        for j in &judges {
            let opts = TrainOptions {
                fractions: model.meta.fractions,
                seed: model.meta.seed,
                alpha: model.meta.calibration.alpha,
                grid: Grid {
                    n_estimators: vec![model.meta.params.n_estimators],
                    learning_rate: vec![model.meta.params.learning_rate],
                    max_depth: vec![model.meta.params.max_depth],
                    min_child_samples: vec![model.meta.params.min_child_samples],
                    reg_lambda: vec![model.meta.params.reg_lambda],
                },
                folds: model.meta.folds,
                exclude_judge: Some(j.clone()),
            };
            let m = super::model::train(ds, labels, &opts)?;
            let s: Vec<f64> = m
                .predict(&x)
                .iter()
                .map(|p| metrics::to_unit(p.mean, range))
                .collect();
            let t = metrics::agreement_table(&scored(&test, &s), &judges);
            let row = judges.iter().position(|x| x == j).unwrap_or(0);
            let mut r = t[row].clone();
            r[row] = None;
            table.push(r);
        }
        Some(table)
    } else {
        None
    };
    let mut units: Vec<&str> = test.iter().map(|o| o.unit.as_str()).collect();
    units.sort_unstable();
    units.dedup();
    Ok(Evaluation {
        test_units: units.len(),
        test_rows: y.len(),
        rmse_baseline: metrics::rmse(&b, &y),
        rmse_gbdt: metrics::rmse(&p, &y),
        coverage: super::conformal::coverage(&y, &lo, &hi),
        coverage_level: 1.0 - model.meta.calibration.alpha,
        mean_width: preds.iter().map(|p| p.width()).sum::<f64>() / preds.len() as f64,
        agreement_baseline: metrics::agreement_table(&sb, &judges),
        agreement_gbdt: metrics::agreement_table(&sg, &judges),
        self_consistency_baseline: sc(&sb),
        self_consistency_gbdt: sc(&sg),
        agreement_held_out,
        judges,
    })
}

fn cell(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |v| format!("{v:.3}"))
}

fn table(title: &str, judges: &[String], t: &[Vec<Option<f64>>], note: &str) -> String {
    let w = judges.iter().map(String::len).max().unwrap_or(5).max(6);
    let mut s = format!(
        "{title}  (mean off-diagonal {}){note}\n",
        cell(metrics::mean_off_diagonal(t))
    );
    s.push_str(&format!("{:w$}", ""));
    for j in judges {
        s.push_str(&format!("  {j:>w$}"));
    }
    s.push('\n');
    for (j, row) in judges.iter().zip(t) {
        s.push_str(&format!("{j:w$}"));
        for c in row {
            s.push_str(&format!("  {:>w$}", cell(*c)));
        }
        s.push('\n');
    }
    s
}

/// Renders an evaluation as text tables.
pub fn render(e: &Evaluation) -> String {
    let mut s = format!(
        "test split: {} units, {} rows\n\n\
         accuracy (RMSE vs human labels, lower is better)\n  \
         baseline (fraction of YES rescaled)  {:.4}\n  \
         GBDT                                 {:.4}\n\n\
         intervals: empirical coverage {:.3} at level {:.2}, mean width {:.3}\n\n",
        e.test_units,
        e.test_rows,
        e.rmse_baseline,
        e.rmse_gbdt,
        e.coverage,
        e.coverage_level,
        e.mean_width
    );
    let diag = "; diagonal: self-consistency";
    s.push_str(&table(
        "agreement, baseline",
        &e.judges,
        &e.agreement_baseline,
        diag,
    ));
    s.push('\n');
    s.push_str(&table(
        "agreement, GBDT (all judges in train)",
        &e.judges,
        &e.agreement_gbdt,
        diag,
    ));
    if let Some(h) = &e.agreement_held_out {
        s.push('\n');
        s.push_str(&table(
            "agreement, GBDT with the row's judge held out of training",
            &e.judges,
            h,
            "",
        ));
    }
    s.push_str("\nself-consistency (1 - mean |a - b| over T(T-1)/2 trial pairs)\n");
    s.push_str(&format!(
        "{:10}  {:>8}  {:>8}\n",
        "judge", "baseline", "GBDT"
    ));
    for (i, j) in e.judges.iter().enumerate() {
        s.push_str(&format!(
            "{j:10}  {:>8}  {:>8}\n",
            cell(e.self_consistency_baseline[i]),
            cell(e.self_consistency_gbdt[i])
        ));
    }
    s
}

/// Flips a fraction `b` of each row's answer bits (exactly round(b d) distinct bits, seeded):
/// the paper's synthetic out-of-distribution inputs for the interval-width check.
pub fn flip_bits(x: &[Vec<f64>], b: f64, seed: u64) -> Vec<Vec<f64>> {
    use rand::SeedableRng;
    use rand::seq::index::sample;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    x.iter()
        .map(|row| {
            let d = row.len();
            let k = ((b * d as f64).round() as usize).min(d);
            let mut r = row.clone();
            for i in sample(&mut rng, d, k).iter() {
                r[i] = 1.0 - r[i];
            }
            r
        })
        .collect()
}

/// Mean interval width on `x` and on `x` with each fraction of bits flipped.
pub fn widening(
    model: &JudgeModel,
    x: &[Vec<f64>],
    fractions: &[f64],
    seed: u64,
) -> Vec<(f64, f64)> {
    let mean_width = |x: &[Vec<f64>]| {
        let p = model.predict(x);
        p.iter().map(|p| p.width()).sum::<f64>() / p.len().max(1) as f64
    };
    std::iter::once((0.0, mean_width(x)))
        .chain(
            fractions
                .iter()
                .map(|&b| (b, mean_width(&flip_bits(x, b, seed)))),
        )
        .collect()
}
