//! `rogan_gladen(observed, sensitivity, specificity)`: prevalence corrected for scorer error.

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, Float64Array};
use datafusion::arrow::datatypes::DataType;
use datafusion::common::Result;
use datafusion::logical_expr::ScalarUDF;

use super::common::{FunctionDoc, coerce_all_f64, f64_array, finite, opt_f64};
use super::spec::{ScalarSpec, StatUdf};

/// The `rogan_gladen` function.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct RoganGladen;

/// (observed + spec - 1) / (sens + spec - 1) clipped to [0, 1]; `None` when sens + spec <= 1.
pub fn rogan_gladen(observed: f64, sens: f64, spec: f64) -> Option<f64> {
    let j = sens + spec - 1.0;
    if j.is_nan() || j <= 0.0 {
        return None;
    }
    finite(((observed + spec - 1.0) / j).clamp(0.0, 1.0))
}

impl ScalarSpec for RoganGladen {
    const DOC: FunctionDoc = FunctionDoc {
        name: "rogan_gladen",
        syntax: "rogan_gladen(observed, sensitivity, specificity)",
        returns: "Float64",
        summary: "Rogan-Gladen (1978) correction of a rate measured by an imperfect scorer: \
                  (observed + specificity - 1) / (sensitivity + specificity - 1), clipped to [0, 1]. \
                  Sensitivity and specificity come from a hand-labelled sample (see `confusion`).",
        behavior: "NULL when any argument is NULL or NaN, or when sensitivity + specificity <= 1 (the \
                   scorer is no better than chance and the rate cannot be corrected).",
        arguments: &[
            (
                "observed",
                "Rate the scorer reports over the corpus, in [0, 1].",
            ),
            ("sensitivity", "P(scorer positive | truly positive)."),
            ("specificity", "P(scorer negative | truly negative)."),
        ],
        example: "SELECT rogan_gladen(13.0 / 36, 13.0 / 29, 1.0) AS corrected, rogan_gladen(0.3, 0.4, 0.5) AS no_signal",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        coerce_all_f64(
            Self::DOC.name,
            t,
            &["observed", "sensitivity", "specificity"],
            3,
        )
    }

    fn return_type(&self) -> DataType {
        DataType::Float64
    }

    fn invoke(&self, args: &[ArrayRef], n_rows: usize) -> Result<ArrayRef> {
        let a: Vec<_> = args.iter().map(f64_array).collect::<Result<_>>()?;
        let out: Float64Array = (0..n_rows)
            .map(|i| rogan_gladen(opt_f64(a[0], i)?, opt_f64(a[1], i)?, opt_f64(a[2], i)?))
            .collect();
        Ok(Arc::new(out))
    }
}

/// The registered function.
pub fn udf() -> ScalarUDF {
    StatUdf::udf(RoganGladen)
}
