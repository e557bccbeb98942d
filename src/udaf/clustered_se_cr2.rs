//! `clustered_se_cr2(x, cluster)`: the CR2 (Bell-McCaffrey) bias-reduced clustered standard
//! error of the mean, the SE behind `clustered_mean_ci`'s default interval.

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

/// The `clustered_se_cr2` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct ClusteredSeCr2;

/// Final step: the SE of each group's mean.
pub fn finish(g: &[GroupCells]) -> Result<ArrayRef> {
    Ok(f64_col(
        g.iter()
            .map(|g| super::cluster_interval::cr2_se(&g.moments())),
    ))
}

fn groups(args: &AccumulatorArgs) -> ClusteredGroups {
    ClusteredGroups::new(
        Input::Single,
        key_kind(args.expr_fields, 1),
        Arc::new(finish),
    )
}

impl AggSpec for ClusteredSeCr2 {
    const DOC: FunctionDoc = FunctionDoc {
        name: "clustered_se_cr2",
        syntax: "clustered_se_cr2(x, cluster)",
        returns: "Float64",
        summary: "The CR2 (Bell and McCaffrey 2002) bias-reduced cluster-robust standard error of the \
                  mean: sqrt(sum over clusters of S_g^2 / (1 - n_g / n)) / n, S_g = sum over i in \
                  cluster g of (x_i - mean). Unbiased when rows are independent, and far less \
                  biased than CR1 with few or unequal clusters; equals `clustered_se_cr1` when \
                  every cluster has the same size. It is the SE of `clustered_mean_ci`'s default \
                  method, which pairs it with a t quantile at the Satterthwaite degrees of \
                  freedom (the `df` field).",
        behavior: "Rows where `x` or `cluster` is NULL, or `x` is NaN, are ignored. NULL when fewer than \
                   two clusters remain.",
        arguments: &[
            ("x", "Numeric or boolean score column."),
            (
                "cluster",
                "Cluster id (e.g. `template_id`): any integer or string column.",
            ),
        ],
        example: "SELECT clustered_se_cr2(x, c) AS se_cr2, clustered_se_cr1(x, c) AS se_cr1 \
                  FROM (VALUES (1.0, 1), (1.0, 1), (0.0, 2), (0.0, 2), (1.0, 3), (0.0, 3)) AS t(x, c)",
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
    StatUdaf::udaf(ClusteredSeCr2)
}
