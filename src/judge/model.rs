//! Training, saving and applying the judge model: a GBDT mean model, a GBDT scale model for
//! residual-normalised conformal intervals, and exact TreeSHAP contributions.

use std::collections::BTreeMap;
use std::path::Path;

use forust_ml::gradientbooster::ContributionsMethod;
use forust_ml::objective::ObjectiveType;
use forust_ml::{GradientBooster, Matrix};

use super::JudgeError;
use super::conformal::{self, Calibration};
use super::data::{Dataset, LabelKind, Labels, Obs};
use super::metrics;
use super::split::{self, Fractions, Split};

/// One GBDT configuration, named as in the paper's appendix (LightGBM's names).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Params {
    /// `n_estimators`: number of trees.
    pub n_estimators: usize,
    pub learning_rate: f32,
    pub max_depth: usize,
    /// `min_child_samples`: forust's `min_leaf_weight` (the hessian sum in a leaf, which is
    /// the row count under squared loss).
    pub min_child_samples: usize,
    /// `reg_lambda`: forust's `l2`.
    pub reg_lambda: f32,
}

/// A hyperparameter grid.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Grid {
    pub n_estimators: Vec<usize>,
    pub learning_rate: Vec<f32>,
    pub max_depth: Vec<usize>,
    pub min_child_samples: Vec<usize>,
    pub reg_lambda: Vec<f32>,
}

impl Grid {
    /// The paper's appendix A.3 search space (576 points).
    pub fn paper() -> Self {
        Grid {
            n_estimators: vec![20, 50, 100, 200],
            learning_rate: vec![0.001, 0.01, 0.1, 1.0],
            max_depth: vec![3, 5, 10],
            min_child_samples: vec![5, 10, 20, 40],
            reg_lambda: vec![0.0, 1.0, 5.0],
        }
    }

    /// A 16-point subset of the paper's grid for quick runs and tests: the learning rates
    /// that can converge within 200 trees, shallow and medium depth, two leaf sizes.
    pub fn small() -> Self {
        Grid {
            n_estimators: vec![50, 100, 200],
            learning_rate: vec![0.1],
            max_depth: vec![3, 5],
            min_child_samples: vec![10, 40],
            reg_lambda: vec![1.0, 5.0],
        }
    }

    /// By name: `paper` or `small`.
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "paper" => Some(Self::paper()),
            "small" => Some(Self::small()),
            _ => None,
        }
    }

    /// Number of grid points.
    pub fn len(&self) -> usize {
        self.n_estimators.len()
            * self.learning_rate.len()
            * self.max_depth.len()
            * self.min_child_samples.len()
            * self.reg_lambda.len()
    }

    /// Whether the grid has no point.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One cross-validated grid point.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CvScore {
    pub params: Params,
    /// Cross-validated RMSE (of the probability, for binary labels).
    pub rmse: f64,
}

/// Training options.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    pub fractions: Fractions,
    pub seed: u64,
    /// Target miscoverage of the intervals (0.1 for 90%).
    pub alpha: f64,
    pub grid: Grid,
    /// Cross-validation folds (by unit) over the train split.
    pub folds: usize,
    /// Held-out-judge mode: leave this judge's rows out of training and calibration.
    pub exclude_judge: Option<String>,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            fractions: Fractions::default(),
            seed: 42,
            alpha: 0.1,
            grid: Grid::paper(),
            folds: 3,
            exclude_judge: None,
        }
    }
}

/// Everything saved beside the trees.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Meta {
    /// `evalflow-judge/1`.
    pub format: String,
    pub evalflow_version: String,
    pub created_at: String,
    /// `scorer@scoring_version` of the checklist the model reads.
    pub checklist: String,
    pub questions: Vec<String>,
    pub kind: LabelKind,
    pub label_range: (f64, f64),
    pub judges: Vec<String>,
    pub excluded_judge: Option<String>,
    pub seed: u64,
    pub fractions: Fractions,
    pub grid: Grid,
    pub folds: usize,
    pub params: Params,
    /// The five best grid points, best first.
    pub cv_top: Vec<CvScore>,
    /// The scale model's fixed configuration.
    pub scale_params: Params,
    /// Floor on the scale prediction, so no interval has zero width.
    pub sigma_floor: f64,
    pub calibration: Calibration,
    /// The split of every unit.
    pub splits: BTreeMap<String, Split>,
    pub rows: BTreeMap<String, usize>,
    /// Figures on the test split, measured at training time.
    pub test: TestFigures,
}

/// Test-split figures.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TestFigures {
    pub rows: usize,
    pub units: usize,
    pub rmse_gbdt: f64,
    pub rmse_baseline: f64,
    pub coverage: f64,
    pub mean_width: f64,
}

/// A trained judge model.
pub struct JudgeModel {
    pub meta: Meta,
    pub mean: GradientBooster,
    pub scale: GradientBooster,
}

impl std::fmt::Debug for JudgeModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JudgeModel")
            .field("meta", &self.meta)
            .finish_non_exhaustive()
    }
}

/// A prediction with its interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// The score (the probability of `true` for binary labels).
    pub mean: f64,
    /// The scale model's expected |residual|.
    pub sigma: f64,
    pub lo: f64,
    pub hi: f64,
}

impl Prediction {
    pub fn width(&self) -> f64 {
        self.hi - self.lo
    }
}

/// Rows as forust's column-major matrix data.
pub fn column_major(rows: &[Vec<f64>], d: usize) -> Vec<f64> {
    let mut data = vec![0.0; rows.len() * d];
    for (r, row) in rows.iter().enumerate() {
        for (c, v) in row.iter().enumerate() {
            data[c * rows.len() + r] = *v;
        }
    }
    data
}

fn booster(kind: LabelKind, p: &Params, seed: u64) -> GradientBooster {
    let objective = match kind {
        LabelKind::Regression => ObjectiveType::SquaredLoss,
        LabelKind::Binary => ObjectiveType::LogLoss,
    };
    GradientBooster::default()
        .set_objective_type(objective)
        .set_iterations(p.n_estimators)
        .set_learning_rate(p.learning_rate)
        .set_max_depth(p.max_depth)
        .set_min_leaf_weight(p.min_child_samples as f32)
        .set_l2(p.reg_lambda)
        .set_initialize_base_score(true)
        .set_seed(seed)
}

/// Fits a booster on `x` (rows of d features) and `y`.
pub fn fit(
    kind: LabelKind,
    p: &Params,
    seed: u64,
    x: &[Vec<f64>],
    y: &[f64],
) -> Result<GradientBooster, JudgeError> {
    let d = x.first().map_or(0, Vec::len);
    let data = column_major(x, d);
    let m = Matrix::new(&data, x.len(), d);
    let mut b = booster(kind, p, seed);
    b.fit_unweighted(&m, y, None)
        .map_err(|e| JudgeError::Gbdt(e.to_string()))?;
    Ok(b)
}

/// Raw predictions (log-odds for binary models).
pub fn predict_raw(b: &GradientBooster, x: &[Vec<f64>]) -> Vec<f64> {
    let d = x.first().map_or(0, Vec::len);
    let data = column_major(x, d);
    b.predict(&Matrix::new(&data, x.len(), d), true)
}

fn link(kind: LabelKind, raw: f64) -> f64 {
    match kind {
        LabelKind::Regression => raw,
        LabelKind::Binary => 1.0 / (1.0 + (-raw).exp()),
    }
}

/// Exact Shapley contributions: one row of d + 1 values per input row, the last being the
/// expected value (bias), so each row sums to the raw prediction.
pub fn shapley(b: &GradientBooster, x: &[Vec<f64>]) -> Vec<Vec<f64>> {
    let d = x.first().map_or(0, Vec::len);
    let data = column_major(x, d);
    let flat = b.predict_contributions(
        &Matrix::new(&data, x.len(), d),
        ContributionsMethod::Shapley,
        true,
    );
    flat.chunks(d + 1).map(<[f64]>::to_vec).collect()
}

/// Grid search with `k`-fold cross-validation grouped by `fold` (one fold id per row).
///
/// Each (learning rate, depth, leaf size, lambda) point is fitted once per fold with the
/// largest `n_estimators`; smaller ensembles are its prefixes (forust's
/// `prediction_iteration`), which is what fitting them separately would give.
pub fn cross_validate(
    kind: LabelKind,
    grid: &Grid,
    x: &[Vec<f64>],
    y: &[f64],
    fold: &[usize],
    k: usize,
    seed: u64,
) -> Result<Vec<CvScore>, JudgeError> {
    let max_trees = grid.n_estimators.iter().copied().max().unwrap_or(100);
    let mut out = Vec::new();
    for &lr in &grid.learning_rate {
        for &depth in &grid.max_depth {
            for &mcs in &grid.min_child_samples {
                for &lambda in &grid.reg_lambda {
                    let p = Params {
                        n_estimators: max_trees,
                        learning_rate: lr,
                        max_depth: depth,
                        min_child_samples: mcs,
                        reg_lambda: lambda,
                    };
                    let mut sse = vec![0.0; grid.n_estimators.len()];
                    let mut n = 0usize;
                    for f in 0..k {
                        let (mut xt, mut yt, mut xv, mut yv) = (vec![], vec![], vec![], vec![]);
                        for i in 0..x.len() {
                            if fold[i] == f {
                                xv.push(x[i].clone());
                                yv.push(y[i]);
                            } else {
                                xt.push(x[i].clone());
                                yt.push(y[i]);
                            }
                        }
                        if xt.is_empty() || xv.is_empty() {
                            continue;
                        }
                        let mut b = fit(kind, &p, seed, &xt, &yt)?;
                        n += yv.len();
                        for (s, &trees) in sse.iter_mut().zip(&grid.n_estimators) {
                            b.prediction_iteration = Some(trees.min(b.trees.len()));
                            let pred = predict_raw(&b, &xv);
                            *s += pred
                                .iter()
                                .zip(&yv)
                                .map(|(r, y)| (link(kind, *r) - y).powi(2))
                                .sum::<f64>();
                        }
                    }
                    for (s, &trees) in sse.iter().zip(&grid.n_estimators) {
                        out.push(CvScore {
                            params: Params {
                                n_estimators: trees,
                                ..p
                            },
                            rmse: (s / n.max(1) as f64).sqrt(),
                        });
                    }
                }
            }
        }
    }
    out.sort_by(|a, b| a.rmse.total_cmp(&b.rmse));
    Ok(out)
}

/// The scale model's configuration: small and smooth, since it fits noisy |residuals|.
pub const SCALE_PARAMS: Params = Params {
    n_estimators: 100,
    learning_rate: 0.05,
    max_depth: 3,
    min_child_samples: 20,
    reg_lambda: 1.0,
};

/// The labelled rows of a data set: (observation, label).
fn labelled<'a>(ds: &'a Dataset, labels: &Labels) -> Vec<(&'a Obs, f64)> {
    ds.obs
        .iter()
        .filter_map(|o| Some((o, *labels.values.get(&o.unit)?)))
        .collect()
}

/// Trains the mean and scale models, calibrates the intervals and measures the test split.
///
/// # Errors
/// No unit with both answers and a label, too few units for the split, or a GBDT failure.
pub fn train(ds: &Dataset, labels: &Labels, opts: &TrainOptions) -> Result<JudgeModel, JudgeError> {
    let rows = labelled(ds, labels);
    if rows.is_empty() {
        return Err(JudgeError::BadInput(
            "no unit has both judge answers and a label (do the unit ids match?)".into(),
        ));
    }
    let units: Vec<String> = {
        let mut u: Vec<String> = rows.iter().map(|(o, _)| o.unit.clone()).collect();
        u.sort();
        u.dedup();
        u
    };
    if units.len() < 10 {
        return Err(JudgeError::BadInput(format!(
            "only {} labelled units: too few to split into train / conformal / test",
            units.len()
        )));
    }
    let splits = split::split_units(&units, opts.fractions, opts.seed);
    let kept = |o: &Obs| opts.exclude_judge.as_deref() != Some(o.judge.as_str());
    let part = |s: Split, keep_all: bool| -> Vec<(&Obs, f64)> {
        rows.iter()
            .filter(|(o, _)| splits[&o.unit] == s && (keep_all || kept(o)))
            .copied()
            .collect()
    };
    let (train_rows, conf_rows, test_rows) = (
        part(Split::Train, false),
        part(Split::Conformal, false),
        part(Split::Test, true),
    );
    if train_rows.is_empty() || conf_rows.is_empty() {
        return Err(JudgeError::BadInput(
            "the train or conformal split has no rows (judge excluded everywhere?)".into(),
        ));
    }
    let xy = |r: &[(&Obs, f64)]| -> (Vec<Vec<f64>>, Vec<f64>) {
        (
            r.iter().map(|(o, _)| o.features()).collect(),
            r.iter().map(|(_, y)| *y).collect(),
        )
    };
    let (xt, yt) = xy(&train_rows);
    let k = opts.folds.max(2);
    let folds = split::unit_folds(&units, k, opts.seed);
    let fold: Vec<usize> = train_rows.iter().map(|(o, _)| folds[&o.unit]).collect();
    let cv = cross_validate(labels.kind, &opts.grid, &xt, &yt, &fold, k, opts.seed)?;
    let best = cv
        .first()
        .ok_or_else(|| JudgeError::BadInput("empty hyperparameter grid".into()))?
        .params;
    let mean = fit(labels.kind, &best, opts.seed, &xt, &yt)?;

    // Out-of-fold |residuals| of the chosen configuration on the train split: in-sample
    // residuals of a boosted model are optimistic, most where it overfits.
    let mut abs_res = vec![0.0; xt.len()];
    for f in 0..k {
        let idx: Vec<usize> = (0..xt.len()).filter(|&i| fold[i] != f).collect();
        let held: Vec<usize> = (0..xt.len()).filter(|&i| fold[i] == f).collect();
        if idx.is_empty() || held.is_empty() {
            continue;
        }
        let sub_x: Vec<Vec<f64>> = idx.iter().map(|&i| xt[i].clone()).collect();
        let sub_y: Vec<f64> = idx.iter().map(|&i| yt[i]).collect();
        let b = fit(labels.kind, &best, opts.seed, &sub_x, &sub_y)?;
        let hx: Vec<Vec<f64>> = held.iter().map(|&i| xt[i].clone()).collect();
        for (&i, r) in held.iter().zip(predict_raw(&b, &hx)) {
            abs_res[i] = (yt[i] - link(labels.kind, r)).abs();
        }
    }
    let scale = fit(
        LabelKind::Regression,
        &SCALE_PARAMS,
        opts.seed,
        &xt,
        &abs_res,
    )?;
    let mean_abs = abs_res.iter().sum::<f64>() / abs_res.len() as f64;
    let sigma_floor = (0.05 * mean_abs).max(1e-9);

    let mut model = JudgeModel {
        meta: Meta {
            format: "evalflow-judge/1".into(),
            evalflow_version: env!("CARGO_PKG_VERSION").into(),
            created_at: crate::storage::manifest_now(),
            checklist: ds.checklist.clone(),
            questions: ds.questions.clone(),
            kind: labels.kind,
            label_range: labels.range(),
            judges: ds
                .judges()
                .into_iter()
                .filter(|j| opts.exclude_judge.as_ref() != Some(j))
                .collect(),
            excluded_judge: opts.exclude_judge.clone(),
            seed: opts.seed,
            fractions: opts.fractions,
            grid: opts.grid.clone(),
            folds: k,
            params: best,
            cv_top: cv.iter().take(5).copied().collect(),
            scale_params: SCALE_PARAMS,
            sigma_floor,
            calibration: Calibration {
                alpha: opts.alpha,
                q: f64::INFINITY,
                n: 0,
                k: 0,
            },
            splits,
            rows: BTreeMap::from([
                ("train".into(), train_rows.len()),
                ("conformal".into(), conf_rows.len()),
                ("test".into(), test_rows.len()),
            ]),
            test: TestFigures {
                rows: 0,
                units: 0,
                rmse_gbdt: f64::NAN,
                rmse_baseline: f64::NAN,
                coverage: f64::NAN,
                mean_width: f64::NAN,
            },
        },
        mean,
        scale,
    };
    let (xc, yc) = xy(&conf_rows);
    let (mu, sigma) = model.mean_and_scale(&xc);
    model.meta.calibration = conformal::calibrate(&yc, &mu, &sigma, opts.alpha);

    let (xs, ys) = xy(&test_rows);
    let preds = model.predict(&xs);
    let base: Vec<f64> = test_rows
        .iter()
        .map(|(o, _)| metrics::baseline_score(o.fraction_yes(), model.meta.label_range))
        .collect();
    let mean_pred: Vec<f64> = preds.iter().map(|p| p.mean).collect();
    let lo: Vec<f64> = preds.iter().map(|p| p.lo).collect();
    let hi: Vec<f64> = preds.iter().map(|p| p.hi).collect();
    let mut test_units: Vec<&str> = test_rows.iter().map(|(o, _)| o.unit.as_str()).collect();
    test_units.dedup();
    model.meta.test = TestFigures {
        rows: ys.len(),
        units: test_units.len(),
        rmse_gbdt: metrics::rmse(&mean_pred, &ys),
        rmse_baseline: metrics::rmse(&base, &ys),
        coverage: conformal::coverage(&ys, &lo, &hi),
        mean_width: preds.iter().map(Prediction::width).sum::<f64>() / preds.len().max(1) as f64,
    };
    Ok(model)
}

impl JudgeModel {
    /// Mean predictions (probabilities for binary labels) and floored scale predictions.
    pub fn mean_and_scale(&self, x: &[Vec<f64>]) -> (Vec<f64>, Vec<f64>) {
        let mu = predict_raw(&self.mean, x)
            .into_iter()
            .map(|r| link(self.meta.kind, r))
            .collect();
        let sigma = predict_raw(&self.scale, x)
            .into_iter()
            .map(|s| s.max(self.meta.sigma_floor))
            .collect();
        (mu, sigma)
    }

    /// Predictions with conformal intervals (clipped to [0, 1] for binary labels).
    pub fn predict(&self, x: &[Vec<f64>]) -> Vec<Prediction> {
        let (mu, sigma) = self.mean_and_scale(x);
        mu.into_iter()
            .zip(sigma)
            .map(|(mean, sigma)| {
                let (mut lo, mut hi) = self.meta.calibration.interval(mean, sigma);
                if self.meta.kind == LabelKind::Binary {
                    (lo, hi) = (lo.max(0.0), hi.min(1.0));
                }
                Prediction {
                    mean,
                    sigma,
                    lo,
                    hi,
                }
            })
            .collect()
    }

    /// Exact Shapley contributions of the mean model (log-odds for binary labels), d + 1
    /// per row with the expected value last.
    pub fn contributions(&self, x: &[Vec<f64>]) -> Vec<Vec<f64>> {
        shapley(&self.mean, x)
    }

    /// The `top` questions with the largest |contribution|, largest first.
    pub fn top_questions(&self, contrib: &[f64], top: usize) -> Vec<(String, f64)> {
        let d = self.meta.questions.len();
        let mut idx: Vec<usize> = (0..d.min(contrib.len())).collect();
        idx.sort_by(|&a, &b| contrib[b].abs().total_cmp(&contrib[a].abs()));
        idx.into_iter()
            .take(top)
            .map(|i| (self.meta.questions[i].clone(), contrib[i]))
            .collect()
    }

    /// Saves `meta.json`, `mean.json` and `scale.json` (forust's JSON) under `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), JudgeError> {
        std::fs::create_dir_all(dir).map_err(JudgeError::io(dir))?;
        let write = |name: &str, text: String| {
            let p = dir.join(name);
            std::fs::write(&p, text).map_err(JudgeError::io(&p))
        };
        let enc = |e: forust_ml::errors::ForustError| JudgeError::Encode(e.to_string());
        write("mean.json", self.mean.json_dump().map_err(enc)?)?;
        write("scale.json", self.scale.json_dump().map_err(enc)?)?;
        let meta = serde_json::to_string_pretty(&self.meta)
            .map_err(|e| JudgeError::Encode(e.to_string()))?;
        write("meta.json", meta)
    }

    /// Loads a model saved by [`JudgeModel::save`].
    pub fn load(dir: &Path) -> Result<Self, JudgeError> {
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read_to_string(&p).map_err(JudgeError::io(&p))
        };
        let meta: Meta = serde_json::from_str(&read("meta.json")?).map_err(|e| {
            JudgeError::BadInput(format!("{}: {e}", dir.join("meta.json").display()))
        })?;
        if meta.format != "evalflow-judge/1" {
            return Err(JudgeError::BadInput(format!(
                "{}: unknown model format `{}`",
                dir.join("meta.json").display(),
                meta.format
            )));
        }
        let booster = |name: &str| {
            GradientBooster::from_json(&read(name)?)
                .map_err(|e| JudgeError::BadInput(format!("{}: {e}", dir.join(name).display())))
        };
        Ok(JudgeModel {
            mean: booster("mean.json")?,
            scale: booster("scale.json")?,
            meta,
        })
    }
}
