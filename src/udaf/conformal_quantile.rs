//! `conformal_quantile(score, alpha)`: the split-conformal quantile of nonconformity scores.

use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, FieldRef};
use datafusion::common::{Result, plan_err};
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{Accumulator, AggregateUDF};

use super::common::{FunctionDoc, check_arity, coerce_score, constant_arg, scalar_f64};
use super::spec::{AggSpec, StatUdaf};
use super::values_acc::{self, ValuesAccumulator};

/// The `conformal_quantile` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct ConformalQuantile;

/// `x` as an exact fraction `num / den` of its shortest decimal representation (the literal the
/// user typed: `0.1` gives `1 / 10`, not the binary double `0.1000000000000000055...`).
pub fn decimal_fraction(x: f64) -> Option<(u128, u128)> {
    if !(x.is_finite() && x >= 0.0) {
        return None;
    }
    // Rust prints the shortest string that round-trips, never in exponent form.
    let s = format!("{x}");
    let (int, frac) = s.split_once('.').unwrap_or((&s, ""));
    if frac.len() > 36 {
        return None;
    }
    let den = 10u128.checked_pow(frac.len() as u32)?;
    let num = format!("{int}{frac}").parse::<u128>().ok()?;
    Some((num, den))
}

/// The conformal rank k = ceil((n + 1)(1 - alpha)), in exact integer arithmetic.
///
/// n = 99, alpha = 0.1 gives 90. No float quantile level is involved (k / n = 90 / 99 fed to a
/// `higher` quantile picks index ceil(0.909 * 98) = 90, the 91st smallest).
pub fn conformal_k(n: u64, alpha: f64) -> u64 {
    if let Some((num, den)) = decimal_fraction(alpha)
        && num <= den
        && let Some(a) = (n as u128 + 1).checked_mul(den - num)
    {
        return a.div_ceil(den) as u64;
    }
    ((n as f64 + 1.0) * (1.0 - alpha)).ceil() as u64
}

/// The k-th smallest value, +inf when k > n, `None` when empty.
pub fn conformal_quantile(values: &mut [f64], alpha: f64) -> Option<f64> {
    let n = values.len();
    if n == 0 {
        return None;
    }
    let k = conformal_k(n as u64, alpha) as usize;
    if k > n {
        return Some(f64::INFINITY);
    }
    let k = k.max(1);
    let (_, v, _) = values.select_nth_unstable_by(k - 1, f64::total_cmp);
    Some(*v)
}

impl AggSpec for ConformalQuantile {
    const DOC: FunctionDoc = FunctionDoc {
        name: "conformal_quantile",
        syntax: "conformal_quantile(score, alpha)",
        returns: "Float64",
        summary: "Split-conformal threshold: the k-th smallest `score` with k = ceil((n + 1)(1 - alpha)), \
                  computed exactly from alpha's decimal value (n = 99, alpha = 0.1 gives k = 90). \
                  Intervals built from it cover a new case with probability at least 1 - alpha.",
        behavior: "NULL and NaN scores are ignored. No scores gives NULL. When k > n (too few scores \
                   for this alpha) the result is +inf: the honest interval is unbounded. `alpha` must \
                   be a constant strictly between 0 and 1.",
        arguments: &[
            (
                "score",
                "Nonconformity score of each calibration case (e.g. abs(y - prediction)).",
            ),
            (
                "alpha",
                "Constant miscoverage rate, e.g. 0.1 for 90% coverage.",
            ),
        ],
        example: "SELECT conformal_quantile(s, 0.1) AS q90, conformal_quantile(s, 0.01) AS q99 \
                  FROM (SELECT CAST(value AS DOUBLE) AS s FROM generate_series(1, 99)) AS t",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        check_arity(Self::DOC.name, t, 2, 2)?;
        t.iter()
            .zip(["score", "alpha"])
            .map(|(t, a)| coerce_score(Self::DOC.name, a, t))
            .collect()
    }

    fn return_type(&self) -> DataType {
        DataType::Float64
    }

    fn state_fields(&self, args: &StateFieldsArgs) -> Result<Vec<FieldRef>> {
        Ok(values_acc::state_fields(args.name))
    }

    fn accumulator(&self, args: &AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        let name = Self::DOC.name;
        let alpha = constant_arg(args, 1, name, "alpha")?
            .as_ref()
            .and_then(scalar_f64);
        let Some(alpha) = alpha.filter(|a| *a > 0.0 && *a < 1.0) else {
            return plan_err!("{name}: alpha must be a constant strictly between 0 and 1");
        };
        Ok(Box::new(ValuesAccumulator::new(Arc::new(
            move |v: &mut [f64]| conformal_quantile(v, alpha),
        ))))
    }
}

/// The registered function.
pub fn udaf() -> AggregateUDF {
    StatUdaf::udaf(ConformalQuantile)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_k() {
        assert_eq!(conformal_k(99, 0.1), 90);
        assert_eq!(conformal_k(9, 0.1), 9);
        assert_eq!(conformal_k(19, 0.05), 19);
        assert_eq!(conformal_k(999, 0.001), 999);
        assert_eq!(conformal_k(10, 0.1), 10);
        assert_eq!(conformal_k(8, 0.1), 9);
        // The trap of going through a float quantile level: q = k / n = 90 / 99, then a
        // "higher" quantile at index q * (n - 1) = 89.09 -> 90 (0-based) is the 91st smallest.
        assert_eq!(((90.0f64 / 99.0) * 98.0).ceil(), 90.0);
    }

    #[test]
    fn quantile_picks_kth_smallest() {
        let mut v: Vec<f64> = (1..=99).rev().map(f64::from).collect();
        assert_eq!(conformal_quantile(&mut v, 0.1), Some(90.0));
        let mut v = vec![1.0, 2.0];
        assert_eq!(conformal_quantile(&mut v, 0.1), Some(f64::INFINITY));
        assert_eq!(conformal_quantile(&mut [], 0.1), None);
    }
}
