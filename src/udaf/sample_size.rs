//! `sample_size(delta, var_d [, alpha, power])`: cases needed to detect a paired difference.

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, Int64Array};
use datafusion::arrow::datatypes::DataType;
use datafusion::common::Result;
use datafusion::logical_expr::ScalarUDF;

use super::common::{FunctionDoc, coerce_all_f64, f64_array, finite, normal_z, opt_f64};
use super::spec::{ScalarSpec, StatUdf};

/// The `sample_size` function.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct SampleSize;

/// `z_{alpha/2} + z_{1-power}` (upper-tail points), `None` outside (0, 1).
pub fn z_sum(alpha: f64, power: f64) -> Option<f64> {
    if !(alpha > 0.0 && alpha < 1.0 && power > 0.0 && power < 1.0) {
        return None;
    }
    finite(normal_z(alpha / 2.0) + normal_z(1.0 - power))
}

/// ceil((z_{alpha/2} + z_{1-power})^2 * var_d / delta^2).
///
/// A relative 1e-12 slack keeps rounding noise from pushing an exact integer to the next one.
pub fn sample_size(delta: f64, var_d: f64, alpha: f64, power: f64) -> Option<i64> {
    let z = z_sum(alpha, power)?;
    if !(delta.is_finite() && delta != 0.0 && var_d.is_finite() && var_d >= 0.0) {
        return None;
    }
    let n = finite(z * z * var_d / (delta * delta))?;
    if n >= 9.0e18 {
        return None;
    }
    Some((n * (1.0 - 1e-12)).ceil() as i64)
}

impl ScalarSpec for SampleSize {
    const DOC: FunctionDoc = FunctionDoc {
        name: "sample_size",
        syntax: "sample_size(delta, var_d [, alpha, power])",
        returns: "Int64",
        summary: "Cases needed for a paired comparison to detect a mean difference `delta` (Miller \
                  2024): ceil((z_{alpha/2} + z_{1-power})^2 * var_d / delta^2), where `var_d` is the \
                  variance of per-case differences (from a pilot: var_samp(a - b) over cases). \
                  Defaults alpha = 0.05, power = 0.80. With K samples per case use \
                  var_d = omega^2 + (sigma_a^2 + sigma_b^2) / K.",
        behavior: "NULL when any argument is NULL or NaN, delta is 0, var_d is negative, or alpha / \
                   power are outside (0, 1). A scalar function: it works row by row and on constants.",
        arguments: &[
            (
                "delta",
                "Smallest difference worth detecting, on the score scale (e.g. 0.03).",
            ),
            ("var_d", "Variance of the per-case difference d = a - b."),
            (
                "alpha",
                "Optional two-sided significance level, default 0.05.",
            ),
            ("power", "Optional power, default 0.80."),
        ],
        example: "SELECT sample_size(0.03, 1.0 / 9) AS n, sample_size(0.03, 1.0 / 9, 0.05, 0.9) AS n_power90",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        coerce_all_f64(Self::DOC.name, t, &["delta", "var_d", "alpha", "power"], 2)
    }

    fn return_type(&self) -> DataType {
        DataType::Int64
    }

    fn invoke(&self, args: &[ArrayRef], n_rows: usize) -> Result<ArrayRef> {
        let a: Vec<_> = args.iter().map(f64_array).collect::<Result<_>>()?;
        let out: Int64Array = (0..n_rows)
            .map(|i| {
                let alpha = a.get(2).map_or(Some(0.05), |x| opt_f64(x, i))?;
                let power = a.get(3).map_or(Some(0.8), |x| opt_f64(x, i))?;
                sample_size(opt_f64(a[0], i)?, opt_f64(a[1], i)?, alpha, power)
            })
            .collect();
        Ok(Arc::new(out))
    }
}

/// The registered function.
pub fn udf() -> ScalarUDF {
    StatUdf::udf(SampleSize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millers_example() {
        assert_eq!(sample_size(0.03, 1.0 / 9.0, 0.05, 0.8), Some(969));
        assert_eq!(sample_size(0.0, 1.0, 0.05, 0.8), None);
        assert_eq!(sample_size(0.03, 1.0 / 9.0, 1.5, 0.8), None);
    }
}
