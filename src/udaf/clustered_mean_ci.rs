//! `clustered_mean_ci(x, cluster [, level])`: the mean with an interval from Miller's clustered SE.

use std::sync::Arc;

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::{DataType, FieldRef, Fields};
use datafusion::common::Result;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{Accumulator, AggregateUDF, GroupsAccumulator};

use super::clustered_acc::{self, ClusteredGroups, GroupCells, coerce_args, key_kind};
use super::common::{
    FunctionDoc, f64_col, f64_field, i64_col, i64_field, interval_cols, struct_array, z_arg,
};
use super::moments_acc::Input;
use super::single_group::SingleGroup;
use super::spec::{AggSpec, StatUdaf};

/// The `clustered_mean_ci` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct ClusteredMeanCi;

/// Result fields: `n, n_clusters, mean, se, lo, hi`.
pub fn fields() -> Fields {
    Fields::from(vec![
        i64_field("n"),
        i64_field("n_clusters"),
        f64_field("mean"),
        f64_field("se"),
        f64_field("lo"),
        f64_field("hi"),
    ])
}

fn finish(g: &[GroupCells], z: f64) -> Result<ArrayRef> {
    let means: Vec<_> = g.iter().map(|g| g.total.mean()).collect();
    let ses: Vec<_> = g.iter().map(GroupCells::miller_se).collect();
    let (lo, hi) = interval_cols(&means, &ses, z);
    struct_array(
        &fields(),
        vec![
            i64_col(g.iter().map(|g| Some(g.total.n as i64))),
            i64_col(g.iter().map(|g| Some(g.n_clusters() as i64))),
            f64_col(means),
            f64_col(ses),
            lo,
            hi,
        ],
    )
}

fn groups(args: &AccumulatorArgs) -> Result<ClusteredGroups> {
    let z = z_arg(args, 2, ClusteredMeanCi::DOC.name)?;
    Ok(ClusteredGroups::new(
        Input::Single,
        key_kind(args.expr_fields, 1),
        Arc::new(move |g: &[GroupCells]| finish(g, z)),
    ))
}

impl AggSpec for ClusteredMeanCi {
    const DOC: FunctionDoc = FunctionDoc {
        name: "clustered_mean_ci",
        syntax: "clustered_mean_ci(x, cluster [, level])",
        returns: "Struct{n: Int64, n_clusters: Int64, mean: Float64, se: Float64, lo: Float64, hi: Float64}",
        summary: "The mean of `x` with Miller's clustered standard error (as `clustered_se`) and the \
                  normal interval mean -/+ z * se at `level` (default 0.95).",
        behavior: "Rows where `x` or `cluster` is NULL, or `x` is NaN, are ignored. The struct is never \
                   NULL: `n` and `n_clusters` count what was used; `mean` is NULL when n = 0; `se`, \
                   `lo`, `hi` are NULL with fewer than two rows or two clusters.",
        arguments: &[
            ("x", "Numeric or boolean score column."),
            (
                "cluster",
                "Cluster id (e.g. `template_id`): any integer or string column.",
            ),
            ("level", "Optional constant confidence level, default 0.95."),
        ],
        example: "SELECT clustered_mean_ci(x, c) AS ci \
                  FROM (VALUES (1.0, 'a'), (1.0, 'a'), (0.0, 'b'), (0.0, 'b'), (1.0, 'c'), (0.0, 'c')) AS t(x, c)",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        coerce_args(Self::DOC.name, t, &["x", "cluster", "level"], 1)
    }

    fn return_type(&self) -> DataType {
        DataType::Struct(fields())
    }

    fn state_fields(&self, args: &StateFieldsArgs) -> Result<Vec<FieldRef>> {
        Ok(clustered_acc::state_fields(
            args.name,
            key_kind(args.input_fields, 1),
        ))
    }

    fn accumulator(&self, args: &AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        Ok(Box::new(SingleGroup::new(groups(args)?)))
    }

    fn groups_accumulator(
        &self,
        args: &AccumulatorArgs,
    ) -> Option<Result<Box<dyn GroupsAccumulator>>> {
        Some(groups(args).map(|g| Box::new(g) as _))
    }
}

/// The registered function.
pub fn udaf() -> AggregateUDF {
    StatUdaf::udaf(ClusteredMeanCi)
}
