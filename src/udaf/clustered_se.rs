//! `clustered_se(x, cluster)`: Miller's clustered standard error of the mean.

use std::sync::Arc;

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::{DataType, FieldRef};
use datafusion::common::Result;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{Accumulator, AggregateUDF, GroupsAccumulator};

use super::clustered_acc::{self, ClusteredGroups, GroupCells, coerce_args, key_kind};
use super::common::{FunctionDoc, f64_col};
use super::moments_acc::Input;
use super::single_group::SingleGroup;
use super::spec::{AggSpec, StatUdaf};

/// The `clustered_se` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct ClusteredSe;

/// Final step: the SE of each group's mean.
pub fn finish(g: &[GroupCells]) -> Result<ArrayRef> {
    Ok(f64_col(g.iter().map(GroupCells::miller_se)))
}

fn groups(args: &AccumulatorArgs) -> ClusteredGroups {
    ClusteredGroups::new(
        Input::Single,
        key_kind(args.expr_fields, 1),
        Arc::new(finish),
    )
}

impl AggSpec for ClusteredSe {
    const DOC: FunctionDoc = FunctionDoc {
        name: "clustered_se",
        syntax: "clustered_se(x, cluster)",
        returns: "Float64",
        summary: "Miller's clustered standard error of the mean (Adding Error Bars to Evals, 2024): \
                  sqrt(mean_se(x)^2 + (1/n^2) * sum over clusters of sum over i != j in the cluster \
                  of (x_i - mean)(x_j - mean)). Equals `mean_se` when every cluster has one row. \
                  It has no G/(G-1) small-sample factor; use `clustered_se_cr1` to compare with \
                  statsmodels or Inspect AI.",
        behavior: "Rows where `x` or `cluster` is NULL, or `x` is NaN, are ignored. NULL when fewer than \
                   two rows or fewer than two clusters remain (one cluster carries no information \
                   about between-cluster variation).",
        arguments: &[
            ("x", "Numeric or boolean score column."),
            (
                "cluster",
                "Cluster id (e.g. `template_id`): any integer or string column.",
            ),
        ],
        example: "SELECT clustered_se(x, c) AS se, mean_se(x) AS naive \
                  FROM (VALUES (1.0, 'a'), (1.0, 'a'), (0.0, 'b'), (0.0, 'b'), (1.0, 'c'), (0.0, 'c')) AS t(x, c)",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        coerce_args(Self::DOC.name, t, &["x", "cluster"], 1)
    }

    fn return_type(&self) -> DataType {
        DataType::Float64
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
    StatUdaf::udaf(ClusteredSe)
}
