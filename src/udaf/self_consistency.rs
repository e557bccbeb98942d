//! `self_consistency(x)`: 1 - mean absolute difference over all pairs of samples.

use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, FieldRef};
use datafusion::common::Result;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{Accumulator, AggregateUDF};

use super::common::{FunctionDoc, check_arity, coerce_score, finite};
use super::spec::{AggSpec, StatUdaf};
use super::values_acc::{self, ValuesAccumulator};

/// The `self_consistency` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct SelfConsistency;

/// 1 - mean over pairs i < j of |x_i - x_j|, in O(n log n): after sorting,
/// sum_{i<j} (x_(j) - x_(i)) = sum_j x_(j) (2j - n + 1) (0-based).
pub fn self_consistency(values: &mut [f64]) -> Option<f64> {
    let n = values.len();
    if n < 2 {
        return None;
    }
    values.sort_unstable_by(f64::total_cmp);
    let nf = n as f64;
    let sum: f64 = values
        .iter()
        .enumerate()
        .map(|(j, x)| x * (2.0 * j as f64 - nf + 1.0))
        .sum();
    let pairs = nf * (nf - 1.0) / 2.0;
    finite(1.0 - sum / pairs)
}

impl AggSpec for SelfConsistency {
    const DOC: FunctionDoc = FunctionDoc {
        name: "self_consistency",
        syntax: "self_consistency(x)",
        returns: "Float64",
        summary: "Self-consistency of repeated scores of one unit (e.g. K samples of a case, scores \
                  in [0, 1]): 1 - the mean of abs(x_i - x_j) over all pairs i < j. 1 means every \
                  sample agreed. Use under GROUP BY case_id, then average.",
        behavior: "NULL and NaN values are ignored. Fewer than two values give NULL.",
        arguments: &[(
            "x",
            "Numeric or boolean score column, normally scaled to [0, 1].",
        )],
        example: "SELECT case_id, self_consistency(x) AS sc \
                  FROM (VALUES ('q1', 1.0), ('q1', 1.0), ('q1', 1.0), ('q2', 1.0), ('q2', 0.0), ('q2', 0.5)) AS t(case_id, x) \
                  GROUP BY case_id ORDER BY case_id",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        check_arity(Self::DOC.name, t, 1, 1)?;
        Ok(vec![coerce_score(Self::DOC.name, "x", &t[0])?])
    }

    fn return_type(&self) -> DataType {
        DataType::Float64
    }

    fn state_fields(&self, args: &StateFieldsArgs) -> Result<Vec<FieldRef>> {
        Ok(values_acc::state_fields(args.name))
    }

    fn accumulator(&self, _args: &AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        Ok(Box::new(ValuesAccumulator::new(Arc::new(self_consistency))))
    }
}

/// The registered function.
pub fn udaf() -> AggregateUDF {
    StatUdaf::udaf(SelfConsistency)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_pairs() {
        let v: [f64; 5] = [0.2, 1.0, 0.5, 0.5, 0.0];
        let (mut total, mut pairs) = (0.0, 0.0);
        for i in 0..v.len() {
            for j in i + 1..v.len() {
                total += (v[i] - v[j]).abs();
                pairs += 1.0;
            }
        }
        let brute = 1.0 - total / pairs;
        assert!((self_consistency(&mut v.clone()).unwrap() - brute).abs() < 1e-12);
        assert_eq!(self_consistency(&mut [1.0]), None);
        assert_eq!(self_consistency(&mut [1.0, 1.0, 1.0]), Some(1.0));
    }
}
