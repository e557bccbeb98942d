//! A synthetic checklist-judge data set with a known ground truth, for tests and demos.
//!
//! Each unit has a latent quality `z` in [0, 1]. Its human label is the mean of three raters'
//! integer scores `round(1 + 4 z + N(0, RATER_SD))` clipped to 1..5, as in SummEval. Question
//! `j` is a 2-parameter item-response item: a judge answers YES with probability
//! `sigmoid(a_j (z + bias_l + e - t_j))`, where `a_j` is the question's informativeness (0 for
//! a question that carries no signal), `t_j` its difficulty, `bias_l` the judge's leniency and
//! `e ~ N(0, sd_l)` a per-trial perturbation; the answer is then flipped with the judge's flip
//! rate. So judges differ in noise and bias, trials differ by chance, and the fraction of YES
//! is a biased, nonlinear proxy of the label, while the answer pattern carries more.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use datafusion::arrow::array::{
    ArrayRef, BooleanArray, BooleanBuilder, Float64Array, Int32Array, ListBuilder, StringArray,
};
use datafusion::arrow::record_batch::RecordBatch;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::JudgeError;
use super::data::{Dataset, Obs};
use crate::schema::Table;

/// One synthetic question.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Question {
    pub id: String,
    /// Discrimination: how sharply the answer follows the latent quality (0 = no signal).
    pub informativeness: f64,
    /// The quality at which YES becomes likely.
    pub difficulty: f64,
}

/// One synthetic judge.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Judge {
    pub name: String,
    /// Added to the latent quality before answering (> 0 lenient, < 0 harsh).
    pub bias: f64,
    /// Per-trial standard deviation of the perceived quality.
    pub trial_sd: f64,
    /// Probability that any single answer is flipped.
    pub flip_rate: f64,
}

/// Generator settings.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SynthConfig {
    pub units: usize,
    pub questions: usize,
    pub judges: usize,
    pub trials: usize,
    pub seed: u64,
}

impl Default for SynthConfig {
    fn default() -> Self {
        SynthConfig {
            units: 400,
            questions: 12,
            judges: 4,
            trials: 5,
            seed: 42,
        }
    }
}

/// The generated data with its ground truth.
#[derive(Debug, Clone)]
pub struct Synth {
    pub data: Dataset,
    /// The human label (mean of three raters, 1..5) by unit.
    pub labels: BTreeMap<String, f64>,
    /// The latent quality by unit.
    pub quality: BTreeMap<String, f64>,
    pub questions: Vec<Question>,
    pub judges: Vec<Judge>,
}

fn normal(rng: &mut StdRng) -> f64 {
    // Box-Muller; avoids a dependency for one distribution.
    let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
    let u2: f64 = rng.gen_range(0.0..1.0);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Standard deviation of one human rater's score around 1 + 4 z.
pub const RATER_SD: f64 = 0.35;

const JUDGE_NAMES: [&str; 8] = [
    "opus", "sonnet", "sol", "grok", "judge5", "judge6", "judge7", "judge8",
];

/// Generates a data set.
pub fn generate(c: &SynthConfig) -> Synth {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let d = c.questions.max(1);
    // Informativeness cycles through strong, medium and weak items, one reverse-keyed item
    // (YES means worse, like "does the summary repeat itself?") and one item that carries no
    // signal (answered YES 85% of the time whatever the quality). Difficulties are skewed
    // low, so the fraction of YES saturates: it is a biased, nonlinear proxy of quality.
    let questions: Vec<Question> = (0..d)
        .map(|j| {
            let informativeness = [10.0, 8.0, 6.0, -8.0, 0.0, 4.0][j % 6];
            let u = ((j * 7) % d) as f64 / d as f64;
            Question {
                id: format!("q{:02}", j + 1),
                informativeness,
                difficulty: 0.1 + 0.8 * u.powf(1.5),
            }
        })
        .collect();
    let judges: Vec<Judge> = (0..c.judges.max(1))
        .map(|l| Judge {
            name: JUDGE_NAMES
                .get(l)
                .map_or_else(|| format!("judge{}", l + 1), |s| s.to_string()),
            bias: [0.0, -0.08, 0.06, 0.03][l % 4],
            trial_sd: [0.03, 0.05, 0.07, 0.09][l % 4],
            flip_rate: [0.02, 0.05, 0.1, 0.18][l % 4],
        })
        .collect();
    let mut data = Dataset {
        questions: questions.iter().map(|q| q.id.clone()).collect(),
        checklist: "judge-synth@1".into(),
        ..Dataset::default()
    };
    let mut labels = BTreeMap::new();
    let mut quality = BTreeMap::new();
    for i in 0..c.units {
        let unit = format!("u{i:04}");
        let z: f64 = rng.gen_range(0.0..1.0);
        let ratings: f64 = (0..3)
            .map(|_| {
                (1.0 + 4.0 * z + RATER_SD * normal(&mut rng))
                    .round()
                    .clamp(1.0, 5.0)
            })
            .sum();
        labels.insert(unit.clone(), ratings / 3.0);
        quality.insert(unit.clone(), z);
        for j in &judges {
            for t in 0..c.trials {
                let perceived = z + j.bias + j.trial_sd * normal(&mut rng);
                let answers = questions
                    .iter()
                    .map(|q| {
                        let p = if q.informativeness == 0.0 {
                            0.85
                        } else {
                            1.0 / (1.0 + (-q.informativeness * (perceived - q.difficulty)).exp())
                        };
                        let yes = rng.gen_bool(p.clamp(0.0, 1.0));
                        yes ^ rng.gen_bool(j.flip_rate)
                    })
                    .collect();
                data.obs.push(Obs {
                    unit: unit.clone(),
                    judge: j.name.clone(),
                    trial: t as i32,
                    answers,
                });
            }
        }
    }
    Synth {
        data,
        labels,
        quality,
        questions,
        judges,
    }
}

/// The observations as a `scores` table batch (schemas/scores.json), scorer `judge-synth`
/// version 1, with the question ids in `detail.questions` and the fraction of YES as `score`.
pub fn scores_batch(ds: &Dataset) -> Result<RecordBatch, JudgeError> {
    let n = ds.obs.len();
    let (scorer, version) = ds
        .checklist
        .split_once('@')
        .unwrap_or((ds.checklist.as_str(), "1"));
    let rep = |s: &str| -> ArrayRef { Arc::new(StringArray::from_iter_values(vec![s; n])) };
    let detail = serde_json::json!({ "questions": ds.questions }).to_string();
    let mut answers = ListBuilder::new(BooleanBuilder::new());
    for o in &ds.obs {
        for &a in &o.answers {
            answers.values().append_value(a);
        }
        answers.append(true);
    }
    let call_ids = ds
        .obs
        .iter()
        .map(|o| format!("{}:{}:{}", o.unit, o.judge, o.trial));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from_iter_values(call_ids)),
        Arc::new(StringArray::from_iter_values(
            ds.obs.iter().map(|o| o.unit.as_str()),
        )),
        Arc::new(StringArray::from_iter_values(
            ds.obs.iter().map(|o| o.judge.as_str()),
        )),
        Arc::new(Int32Array::from_iter_values(ds.obs.iter().map(|o| o.trial))),
        rep(scorer),
        rep(version),
        Arc::new(StringArray::from(vec![None::<&str>; n])),
        rep("valid_answer"),
        Arc::new(Float64Array::from_iter_values(
            ds.obs.iter().map(Obs::fraction_yes),
        )),
        Arc::new(StringArray::from(vec![None::<&str>; n])),
        Arc::new(Float64Array::from(vec![None; n])),
        Arc::new(BooleanArray::from(vec![None; n])),
        rep(&detail),
        Arc::new(answers.finish()),
        rep("summary_quality"),
        rep("judge"),
        rep("MFT"),
        rep("single"),
        Arc::new(StringArray::from_iter_values(
            ds.obs.iter().map(|o| o.unit.as_str()),
        )),
    ];
    RecordBatch::try_new(Table::Scores.schema(), cols)
        .map_err(|e| JudgeError::Encode(format!("scores batch: {e}")))
}

/// Writes `scores/part-00000.parquet`, `labels.csv` and `truth.json` under `dir`.
pub fn write(s: &Synth, c: &SynthConfig, dir: &Path) -> Result<(), JudgeError> {
    let scores_dir = dir.join("scores");
    std::fs::create_dir_all(&scores_dir).map_err(JudgeError::io(&scores_dir))?;
    let batch = scores_batch(&s.data)?;
    let bytes = crate::storage::encode_parquet(&batch.schema(), &[batch])
        .map_err(|e| JudgeError::Encode(format!("encoding scores: {e}")))?;
    let part = scores_dir.join("part-00000.parquet");
    std::fs::write(&part, bytes).map_err(JudgeError::io(&part))?;
    super::data::write_labels(&dir.join("labels.csv"), &s.labels)?;
    let truth = serde_json::json!({
        "config": c,
        "questions": s.questions,
        "judges": s.judges,
        "quality": s.quality,
    });
    let p = dir.join("truth.json");
    std::fs::write(&p, serde_json::to_string_pretty(&truth).unwrap_or_default())
        .map_err(JudgeError::io(&p))
}
