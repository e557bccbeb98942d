//! `mde(n, var_d [, alpha, power])`: the minimum detectable paired difference for n cases.

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, Float64Array};
use datafusion::arrow::datatypes::DataType;
use datafusion::common::Result;
use datafusion::logical_expr::ScalarUDF;

use super::common::{FunctionDoc, coerce_all_f64, f64_array, finite, opt_f64};
use super::sample_size::z_sum;
use super::spec::{ScalarSpec, StatUdf};

/// The `mde` function.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct Mde;

/// (z_{alpha/2} + z_{1-power}) * sqrt(var_d / n): `sample_size` solved for delta.
pub fn mde(n: f64, var_d: f64, alpha: f64, power: f64) -> Option<f64> {
    let z = z_sum(alpha, power)?;
    if !(n > 0.0 && var_d.is_finite() && var_d >= 0.0) {
        return None;
    }
    finite(z * (var_d / n).sqrt())
}

impl ScalarSpec for Mde {
    const DOC: FunctionDoc = FunctionDoc {
        name: "mde",
        syntax: "mde(n, var_d [, alpha, power])",
        returns: "Float64",
        summary: "Minimum detectable effect of a paired comparison on `n` cases: \
                  (z_{alpha/2} + z_{1-power}) * sqrt(var_d / n), the inverse of `sample_size`. A \
                  measured difference below it is not evidence of no change: the test could not tell.",
        behavior: "NULL when any argument is NULL or NaN, n <= 0, var_d is negative, or alpha / power \
                   are outside (0, 1). Defaults alpha = 0.05, power = 0.80.",
        arguments: &[
            ("n", "Number of cases (pairs)."),
            ("var_d", "Variance of the per-case difference d = a - b."),
            (
                "alpha",
                "Optional two-sided significance level, default 0.05.",
            ),
            ("power", "Optional power, default 0.80."),
        ],
        example: "SELECT mde(969, 1.0 / 9) AS mde_969, mde(100, 0.25) AS mde_100",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        coerce_all_f64(Self::DOC.name, t, &["n", "var_d", "alpha", "power"], 2)
    }

    fn return_type(&self) -> DataType {
        DataType::Float64
    }

    fn invoke(&self, args: &[ArrayRef], n_rows: usize) -> Result<ArrayRef> {
        let a: Vec<_> = args.iter().map(f64_array).collect::<Result<_>>()?;
        let out: Float64Array = (0..n_rows)
            .map(|i| {
                let alpha = a.get(2).map_or(Some(0.05), |x| opt_f64(x, i))?;
                let power = a.get(3).map_or(Some(0.8), |x| opt_f64(x, i))?;
                mde(opt_f64(a[0], i)?, opt_f64(a[1], i)?, alpha, power)
            })
            .collect();
        Ok(Arc::new(out))
    }
}

/// The registered function.
pub fn udf() -> ScalarUDF {
    StatUdf::udf(Mde)
}
