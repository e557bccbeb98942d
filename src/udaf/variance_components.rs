//! `variance_components(x, case_id)`: between-case and within-case variance with K samples per case.

use std::sync::Arc;

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::{DataType, FieldRef, Fields};
use datafusion::common::Result;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{Accumulator, AggregateUDF, GroupsAccumulator};

use super::clustered_acc::{self, ClusteredGroups, GroupCells, coerce_args, key_kind};
use super::common::{
    FunctionDoc, Moments, f64_col, f64_field, finite, i64_col, i64_field, struct_array,
};
use super::moments_acc::Input;
use super::single_group::SingleGroup;
use super::spec::{AggSpec, StatUdaf};

/// The `variance_components` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct VarianceComponents;

/// Result fields: `n_cases, k_mean, between_var, within_var`.
pub fn fields() -> Fields {
    Fields::from(vec![
        i64_field("n_cases"),
        f64_field("k_mean"),
        f64_field("between_var"),
        f64_field("within_var"),
    ])
}

/// `(k_mean, between_var, within_var)` of one group.
pub fn components(g: &GroupCells) -> (Option<f64>, Option<f64>, Option<f64>) {
    let n_cases = g.cells.len();
    if n_cases == 0 {
        return (None, None, None);
    }
    let k_mean = g.total.n as f64 / n_cases as f64;
    let (mut sum_within, mut n_within) = (0.0, 0usize);
    let mut case_means = Moments::default();
    for (_, c) in &g.cells {
        if let Some(v) = c.var_samp() {
            sum_within += v;
            n_within += 1;
        }
        case_means.push(c.mean);
    }
    let within = (n_within > 0)
        .then(|| sum_within / n_within as f64)
        .and_then(finite);
    let between = match (case_means.var_samp(), within) {
        (Some(vm), Some(w)) => finite((vm - w / k_mean).max(0.0)),
        _ => None,
    };
    (Some(k_mean), between, within)
}

fn finish(g: &[GroupCells]) -> Result<ArrayRef> {
    let parts: Vec<_> = g.iter().map(components).collect();
    struct_array(
        &fields(),
        vec![
            i64_col(g.iter().map(|g| Some(g.cells.len() as i64))),
            f64_col(parts.iter().map(|p| p.0)),
            f64_col(parts.iter().map(|p| p.1)),
            f64_col(parts.iter().map(|p| p.2)),
        ],
    )
}

fn groups(args: &AccumulatorArgs) -> ClusteredGroups {
    ClusteredGroups::new(
        Input::Single,
        key_kind(args.expr_fields, 1),
        Arc::new(finish),
    )
}

impl AggSpec for VarianceComponents {
    const DOC: FunctionDoc = FunctionDoc {
        name: "variance_components",
        syntax: "variance_components(x, case_id)",
        returns: "Struct{n_cases: Int64, k_mean: Float64, between_var: Float64, within_var: Float64}",
        summary: "Splits score variance when each case is sampled K times: `within_var` is the mean \
                  over cases of each case's var_samp (Miller's sigma^2, the sampling noise), \
                  `between_var` is var_samp of the case means minus within_var / k_mean, floored \
                  at 0 (the variance of true per-case scores), `k_mean` the mean samples per case.",
        behavior: "Rows where `x` or `case_id` is NULL, or `x` is NaN, are ignored. Cases with one \
                   sample count for `between_var` but not `within_var`. The struct is never NULL: \
                   `k_mean` is NULL with no cases; `within_var` is NULL when no case has two \
                   samples; `between_var` is NULL with fewer than two cases or no `within_var`.",
        arguments: &[
            ("x", "Numeric or boolean score column (one row per sample)."),
            ("case_id", "Case id: any integer or string column."),
        ],
        example: "SELECT variance_components(x, case_id) AS vc \
                  FROM (VALUES (1.0, 'q1'), (1.0, 'q1'), (0.0, 'q2'), (1.0, 'q2'), (0.0, 'q3'), (0.0, 'q3')) AS t(x, case_id)",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        coerce_args(Self::DOC.name, t, &["x", "case_id"], 1)
    }

    fn return_type(&self) -> DataType {
        DataType::Struct(fields())
    }

    fn state_fields(&self, args: &StateFieldsArgs) -> Result<Vec<FieldRef>> {
        Ok(clustered_acc::state_fields(
            args.name,
            key_kind(args.input_fields, 1),
            Input::Single,
        ))
    }

    fn accumulator(&self, args: &AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        Ok(Box::new(SingleGroup::new(groups(args))))
    }

    fn groups_accumulator(
        &self,
        args: &AccumulatorArgs,
    ) -> Option<Result<Box<dyn GroupsAccumulator>>> {
        Some(Ok(Box::new(groups(args))))
    }
}

/// The registered function.
pub fn udaf() -> AggregateUDF {
    StatUdaf::udaf(VarianceComponents)
}
