//! `evalflow judge`: learned aggregation of checklist judges (see `crate::judge`).

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use super::CliError;
use crate::judge::{JudgeError, JudgeModel, apply, data, model, split, synth};

/// The `judge` verbs.
#[derive(Debug, Subcommand)]
pub enum JudgeCmd {
    /// Write a synthetic data set with a known ground truth (scores + labels.csv).
    Synth(SynthArgs),
    /// Train the GBDT aggregator, its scale model and conformal intervals.
    Train(TrainArgs),
    /// Write predictions with intervals and top contributing questions (Parquet).
    Predict(PredictArgs),
    /// Render the SHAP waterfall chart of one unit (SVG; also PNG with the `png` feature).
    Explain(ExplainArgs),
    /// Print RMSE, agreement, held-out-judge agreement and self-consistency on the test split.
    Eval(EvalArgs),
    /// Write a labels CSV for one axis of a SummEval-style annotation file (JSONL).
    Labels(LabelsArgs),
}

#[derive(Debug, Args)]
pub struct SynthArgs {
    /// Output folder: scores/part-00000.parquet, labels.csv, truth.json.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 400)]
    pub units: usize,
    /// Checklist size d.
    #[arg(long, default_value_t = 12)]
    pub questions: usize,
    #[arg(long, default_value_t = 4)]
    pub judges: usize,
    /// Trials T per unit and judge.
    #[arg(long, default_value_t = 5)]
    pub trials: usize,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

/// Where the judge answers come from.
#[derive(Debug, Args)]
pub struct ScoresArg {
    /// A run root (its `scores` table) or a Parquet file / folder shaped like `scores`, with
    /// an `answers` list<bool> column; the unit is `unit` if present, else `case_id`.
    #[arg(long)]
    pub scores: String,
    /// Only this judge scorer (`name` or `name@version`).
    #[arg(long)]
    pub scorer: Option<String>,
    /// SQL expression for the unit (default: `unit` if present, else `case_id`); in a run
    /// judged by the `judge` scorer: `concat(case_id, '/', model)`.
    #[arg(long)]
    pub unit_col: Option<String>,
    /// SQL expression for the judge (default: `model`); in a run judged by several judge
    /// models: `scoring_version`.
    #[arg(long)]
    pub judge_col: Option<String>,
}

#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub scores: ScoresArg,
    /// CSV with `unit` and `label` columns (numbers: regression; true/false: classification).
    #[arg(long)]
    pub labels: PathBuf,
    /// Model folder to write (meta.json, mean.json, scale.json).
    #[arg(long)]
    pub out: PathBuf,
    /// Train:conformal:test fractions by unit.
    #[arg(long, default_value = "50:10:40")]
    pub split: String,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Interval coverage level.
    #[arg(long, default_value_t = 0.9)]
    pub coverage: f64,
    /// Hyperparameter grid: `paper` (appendix A.3, 576 points) or `small` (24 points).
    #[arg(long, default_value = "paper")]
    pub grid: String,
    /// Cross-validation folds (by unit).
    #[arg(long, default_value_t = 3)]
    pub folds: usize,
    /// Leave this judge out of training and calibration (held-out-judge mode).
    #[arg(long)]
    pub exclude_judge: Option<String>,
}

#[derive(Debug, Args)]
pub struct PredictArgs {
    /// Model folder written by `judge train`.
    #[arg(long)]
    pub model: PathBuf,
    #[command(flatten)]
    pub scores: ScoresArg,
    /// Labels to copy into the output beside each prediction.
    #[arg(long)]
    pub labels: Option<PathBuf>,
    /// Output Parquet file.
    #[arg(long)]
    pub out: PathBuf,
    /// How many top contributing questions to keep per row.
    #[arg(long, default_value_t = 3)]
    pub top: usize,
}

#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// The unit to explain.
    pub unit: String,
    #[arg(long)]
    pub model: PathBuf,
    #[command(flatten)]
    pub scores: ScoresArg,
    /// Output path without extension: writes <out>.svg (and <out>.png with the `png` feature).
    #[arg(long)]
    pub out: PathBuf,
    /// Only this judge's rows (default: the mean over all rows of the unit).
    #[arg(long)]
    pub judge: Option<String>,
    /// Only this trial.
    #[arg(long)]
    pub trial: Option<i32>,
    /// Bars shown before the rest are folded into one.
    #[arg(long, default_value_t = 10)]
    pub max_bars: usize,
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    #[arg(long)]
    pub model: PathBuf,
    #[command(flatten)]
    pub scores: ScoresArg,
    #[arg(long)]
    pub labels: PathBuf,
    /// Also retrain without each judge in turn and report its agreement with the rest.
    #[arg(long)]
    pub held_out_judge: bool,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct LabelsArgs {
    /// SummEval `model_annotations.aligned.jsonl` or a file of the same shape.
    #[arg(long)]
    pub summeval: PathBuf,
    /// coherence, consistency, fluency or relevance.
    #[arg(long)]
    pub axis: String,
    /// Labels CSV to write (unit,label).
    #[arg(long)]
    pub out: PathBuf,
}

fn err(e: JudgeError) -> CliError {
    match e {
        JudgeError::BadInput(_) | JudgeError::Query(_) => CliError::BadInput(e.to_string()),
        _ => CliError::Internal(e.to_string()),
    }
}

async fn scores(a: &ScoresArg) -> Result<data::Dataset, CliError> {
    let columns = data::Columns {
        unit: a.unit_col.clone(),
        judge: a.judge_col.clone(),
    };
    data::read_scores(&a.scores, a.scorer.as_deref(), &columns)
        .await
        .map_err(err)
}

fn load(p: &Path) -> Result<JudgeModel, CliError> {
    JudgeModel::load(p).map_err(err)
}

/// Runs one `judge` verb.
pub async fn run(cmd: JudgeCmd) -> Result<(), CliError> {
    match cmd {
        JudgeCmd::Synth(a) => {
            let c = synth::SynthConfig {
                units: a.units,
                questions: a.questions,
                judges: a.judges,
                trials: a.trials,
                seed: a.seed,
            };
            let s = synth::generate(&c);
            synth::write(&s, &c, &a.out).map_err(err)?;
            println!(
                "synth: {} units x {} judges x {} trials, {} questions in {}",
                c.units,
                c.judges,
                c.trials,
                c.questions,
                a.out.display()
            );
            Ok(())
        }
        JudgeCmd::Train(a) => {
            let ds = scores(&a.scores).await?;
            let labels = data::read_labels(&a.labels).map_err(err)?;
            if !(a.coverage > 0.0 && a.coverage < 1.0) {
                return Err(CliError::BadInput(format!(
                    "--coverage {}: must be strictly between 0 and 1",
                    a.coverage
                )));
            }
            let grid = model::Grid::named(&a.grid).ok_or_else(|| {
                CliError::BadInput(format!("--grid `{}`: use `paper` or `small`", a.grid))
            })?;
            let opts = model::TrainOptions {
                fractions: split::Fractions::parse(&a.split).map_err(CliError::BadInput)?,
                seed: a.seed,
                // 1 - coverage, rounded to the decimal the user typed (0.9 -> 0.1 exactly).
                alpha: format!("{:.12}", 1.0 - a.coverage).parse().unwrap_or(0.1),
                grid,
                folds: a.folds,
                exclude_judge: a.exclude_judge,
            };
            eprintln!(
                "training on {} rows, {} questions; {}-point grid x {} folds",
                ds.obs.len(),
                ds.questions.len(),
                opts.grid.len(),
                opts.folds
            );
            let m = model::train(&ds, &labels, &opts).map_err(err)?;
            m.save(&a.out).map_err(err)?;
            let t = &m.meta.test;
            println!(
                "model: {} ({})\nbest: {:?} (cv rmse {:.4})\ntest: {} units, {} rows; rmse GBDT {:.4} vs baseline {:.4}; \
                 coverage {:.3} at {:.2} (q = {:.4}, k = {} of {}), mean width {:.3}",
                a.out.display(),
                m.meta.checklist,
                m.meta.params,
                m.meta.cv_top.first().map_or(f64::NAN, |c| c.rmse),
                t.units,
                t.rows,
                t.rmse_gbdt,
                t.rmse_baseline,
                t.coverage,
                1.0 - m.meta.calibration.alpha,
                m.meta.calibration.q,
                m.meta.calibration.k,
                m.meta.calibration.n,
                t.mean_width
            );
            Ok(())
        }
        JudgeCmd::Predict(a) => {
            let m = load(&a.model)?;
            let ds = scores(&a.scores).await?;
            let labels = match &a.labels {
                Some(p) => Some(data::read_labels(p).map_err(err)?),
                None => None,
            };
            let batch = apply::predictions_batch(&m, &ds, labels.as_ref(), a.top).map_err(err)?;
            let bytes = crate::storage::encode_parquet(&batch.schema(), &[batch])
                .map_err(|e| CliError::Internal(format!("encoding predictions: {e}")))?;
            std::fs::write(&a.out, bytes)
                .map_err(|e| CliError::Internal(format!("{}: {e}", a.out.display())))?;
            println!("predictions: {} rows in {}", ds.obs.len(), a.out.display());
            Ok(())
        }
        JudgeCmd::Explain(a) => {
            let m = load(&a.model)?;
            let ds = scores(&a.scores).await?;
            let w = apply::explain_unit(&m, &ds, &a.unit, a.judge.as_deref(), a.trial, a.max_bars)
                .map_err(err)?;
            if let Some(parent) = a.out.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .map_err(|e| CliError::Internal(format!("{}: {e}", parent.display())))?;
            }
            let written = w.write(&a.out).map_err(err)?;
            println!("E[f(X)] = {:.4}, f(x) = {:.4}", w.base, w.prediction());
            for p in written {
                println!("{}", p.display());
            }
            Ok(())
        }
        JudgeCmd::Eval(a) => {
            let m = load(&a.model)?;
            let ds = scores(&a.scores).await?;
            let labels = data::read_labels(&a.labels).map_err(err)?;
            let e = apply::evaluate(&m, &ds, &labels, a.held_out_judge).map_err(err)?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&e).unwrap_or_default());
            } else {
                print!("{}", apply::render(&e));
            }
            Ok(())
        }
        JudgeCmd::Labels(a) => {
            let l = data::load_summeval(&a.summeval, &a.axis).map_err(err)?;
            data::write_labels(&a.out, &l).map_err(err)?;
            println!(
                "labels: {} units ({}) in {}",
                l.len(),
                a.axis,
                a.out.display()
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::cli::{Cli, Command};

    #[test]
    fn parses_train_defaults() {
        let c = Cli::try_parse_from([
            "evalflow", "judge", "train", "--scores", "s", "--labels", "l.csv", "--out", "m",
        ])
        .unwrap();
        let Command::Judge(super::JudgeCmd::Train(a)) = c.command else {
            panic!("not judge train");
        };
        assert_eq!(
            (a.split.as_str(), a.coverage, a.grid.as_str()),
            ("50:10:40", 0.9, "paper")
        );
    }
}
