//! Learned judge aggregation: a gradient-boosted tree model over checklist answers.
//!
//! Implements the pipeline of "Towards a Reliable and Practical Eval Pipeline": a judge answers
//! a checklist of `d` YES/NO questions, giving `x` in {0,1}^d per unit x judge x trial; a GBDT
//! trained against human labels aggregates `x` into a score; TreeSHAP explains each score;
//! residual-normalised split conformal prediction gives it an interval; agreement across judges
//! and self-consistency across trials are measured on the held-out units.
//!
//! # Why forust-ml
//! forust-ml 0.8 builds on stable Rust, serialises a model to JSON, and computes exact
//! Shapley contributions per prediction (`ContributionsMethod::Shapley`, the TreeSHAP
//! algorithm of Lundberg et al. 2019 with cover = hessian sums). perpetual 2.x needs nightly;
//! the LightGBM / XGBoost bindings need a C++ toolchain and a native library.
//!
//! # Layout
//! - [`data`]: the observations (scores rows with `answers`), labels, and a SummEval loader.
//! - [`synth`]: a generator with a known ground truth, for tests and demos.
//! - [`split`]: the seeded train / conformal / test split by unit.
//! - [`model`]: hyperparameter search over the paper's grid, training, saving, SHAP.
//! - [`conformal`]: residual-normalised split conformal intervals.
//! - [`metrics`]: RMSE, inter-judge agreement and self-consistency.
//! - [`apply`]: prediction tables, explanations, the evaluation and the bit-flip check.
//! - [`waterfall`]: the SHAP waterfall chart (SVG, PNG).

pub mod apply;
pub mod conformal;
pub mod data;
pub mod metrics;
pub mod model;
pub mod split;
pub mod synth;
pub mod waterfall;

pub use data::{Dataset, LabelKind, Labels, Obs};
pub use model::JudgeModel;

/// Errors of the judge module; each names the file, row or field at fault.
#[derive(Debug, thiserror::Error)]
pub enum JudgeError {
    /// An input file or table is malformed or inconsistent.
    #[error("{0}")]
    BadInput(String),
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A query over the scores table failed.
    #[error(transparent)]
    Query(#[from] crate::query::QueryError),
    /// The GBDT library reported an error.
    #[error("gbdt: {0}")]
    Gbdt(String),
    /// Encoding or decoding Parquet / Arrow / JSON failed.
    #[error("{0}")]
    Encode(String),
}

impl JudgeError {
    pub(crate) fn io(path: impl AsRef<std::path::Path>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.as_ref().display().to_string();
        move |source| JudgeError::Io { path, source }
    }
}
