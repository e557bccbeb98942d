//! `confusion(pred, truth)`: the confusion matrix of a binary scorer against labels.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef};
use datafusion::arrow::datatypes::{DataType, Field, FieldRef, Fields};
use datafusion::common::cast::{as_boolean_array, as_uint64_array};
use datafusion::common::{Result, ScalarValue, plan_err};
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::utils::format_state_name;
use datafusion::logical_expr::{Accumulator, AggregateUDF};

use super::common::{
    FunctionDoc, check_arity, f64_col, f64_field, i64_col, i64_field, struct_array,
};
use super::spec::{AggSpec, StatUdaf};

/// The `confusion` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct Confusion;

/// Result fields: `tp, fp, tn, fn, sensitivity, specificity`.
pub fn fields() -> Fields {
    Fields::from(vec![
        i64_field("tp"),
        i64_field("fp"),
        i64_field("tn"),
        i64_field("fn"),
        f64_field("sensitivity"),
        f64_field("specificity"),
    ])
}

/// Counts `[tp, fp, tn, fn]`.
#[derive(Debug, Default)]
struct ConfusionAccumulator {
    counts: [u64; 4],
}

fn ratio(a: u64, b: u64) -> Option<f64> {
    (a + b > 0).then(|| a as f64 / (a + b) as f64)
}

impl Accumulator for ConfusionAccumulator {
    fn update_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        let pred = as_boolean_array(&values[0])?;
        let truth = as_boolean_array(&values[1])?;
        for i in 0..pred.len() {
            if pred.is_null(i) || truth.is_null(i) {
                continue;
            }
            let slot = match (pred.value(i), truth.value(i)) {
                (true, true) => 0,
                (true, false) => 1,
                (false, false) => 2,
                (false, true) => 3,
            };
            self.counts[slot] += 1;
        }
        Ok(())
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> Result<()> {
        for (slot, s) in states.iter().enumerate() {
            let a = as_uint64_array(s)?;
            self.counts[slot] += a.iter().flatten().sum::<u64>();
        }
        Ok(())
    }

    fn state(&mut self) -> Result<Vec<ScalarValue>> {
        Ok(self
            .counts
            .iter()
            .map(|c| ScalarValue::UInt64(Some(*c)))
            .collect())
    }

    fn evaluate(&mut self) -> Result<ScalarValue> {
        let [tp, fp, tn, fn_] = self.counts;
        let arr = struct_array(
            &fields(),
            vec![
                i64_col([Some(tp as i64)]),
                i64_col([Some(fp as i64)]),
                i64_col([Some(tn as i64)]),
                i64_col([Some(fn_ as i64)]),
                f64_col([ratio(tp, fn_)]),
                f64_col([ratio(tn, fp)]),
            ],
        )?;
        ScalarValue::try_from_array(&arr, 0)
    }

    fn size(&self) -> usize {
        size_of::<Self>()
    }
}

impl AggSpec for Confusion {
    const DOC: FunctionDoc = FunctionDoc {
        name: "confusion",
        syntax: "confusion(pred, truth)",
        returns: "Struct{tp: Int64, fp: Int64, tn: Int64, fn: Int64, sensitivity: Float64, specificity: Float64}",
        summary: "Confusion matrix of a binary prediction against a label, with sensitivity = \
                  tp / (tp + fn) and specificity = tn / (tn + fp). Feed the counts to \
                  `rogan_gladen_ci` to correct a prevalence measured by an imperfect scorer.",
        behavior: "Rows where either argument is NULL are ignored. Integers are read as booleans \
                   (non-zero is true). The counts are 0 on empty input; `sensitivity` is NULL when \
                   tp + fn = 0 and `specificity` when tn + fp = 0.",
        arguments: &[
            (
                "pred",
                "Boolean prediction (e.g. the scorer said positive).",
            ),
            ("truth", "Boolean label from a hand-labelled sample."),
        ],
        example: "SELECT confusion(p, t) AS m \
                  FROM (VALUES (true, true), (false, true), (false, false), (true, false), (true, true)) AS v(p, t)",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        check_arity(Self::DOC.name, t, 2, 2)?;
        t.iter()
            .zip(["pred", "truth"])
            .map(|(t, a)| {
                if t.is_integer() || matches!(t, DataType::Boolean | DataType::Null) {
                    Ok(DataType::Boolean)
                } else {
                    plan_err!("confusion: {a} must be boolean or integer, got {t}")
                }
            })
            .collect()
    }

    fn return_type(&self) -> DataType {
        DataType::Struct(fields())
    }

    fn state_fields(&self, args: &StateFieldsArgs) -> Result<Vec<FieldRef>> {
        Ok(["tp", "fp", "tn", "fn"]
            .iter()
            .map(|n| {
                Arc::new(Field::new(
                    format_state_name(args.name, n),
                    DataType::UInt64,
                    true,
                ))
            })
            .collect())
    }

    fn accumulator(&self, _args: &AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        Ok(Box::<ConfusionAccumulator>::default())
    }
}

/// The registered function.
pub fn udaf() -> AggregateUDF {
    StatUdaf::udaf(Confusion)
}
