//! `paired_diff_clustered(a, b, cluster [, level])`: `paired_diff` with Miller's clustered SE of d.

use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, FieldRef};
use datafusion::common::Result;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{Accumulator, AggregateUDF, GroupsAccumulator};

use super::clustered_acc::{self, ClusteredGroups, GroupCells, coerce_args, key_kind};
use super::common::{FunctionDoc, z_arg};
use super::moments_acc::Input;
use super::paired_diff::{fields, finish_rows};
use super::single_group::SingleGroup;
use super::spec::{AggSpec, StatUdaf};

/// The `paired_diff_clustered` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct PairedDiffClustered;

fn groups(args: &AccumulatorArgs) -> Result<ClusteredGroups> {
    let zcrit = z_arg(args, 3, PairedDiffClustered::DOC.name)?;
    Ok(ClusteredGroups::new(
        Input::Diff,
        key_kind(args.expr_fields, 2),
        Arc::new(move |g: &[GroupCells]| {
            let rows: Vec<_> = g
                .iter()
                .map(|g| (g.total.n, g.total.mean(), g.miller_se()))
                .collect();
            finish_rows(&rows, zcrit)
        }),
    ))
}

impl AggSpec for PairedDiffClustered {
    const DOC: FunctionDoc = FunctionDoc {
        name: "paired_diff_clustered",
        syntax: "paired_diff_clustered(a, b, cluster [, level])",
        returns: "Struct{n: Int64, mean_diff: Float64, se: Float64, z: Float64, p_value: Float64, lo: Float64, hi: Float64}",
        summary: "As `paired_diff`, but `se` is Miller's clustered standard error of d = a - b \
                  (as `clustered_se(a - b, cluster)`), for cases that share a template.",
        behavior: "Only rows where `a`, `b` and `cluster` are non-NULL (and d is not NaN) are used. The \
                   struct is never NULL: `n` counts the pairs; `mean_diff` is NULL when n = 0; `se`, \
                   `lo`, `hi` are NULL with fewer than two rows or two clusters; `z` and `p_value` \
                   are NULL when se is NULL or 0.",
        arguments: &[
            ("a", "Score of version A (numeric or boolean)."),
            ("b", "Score of version B on the same case."),
            (
                "cluster",
                "Cluster id (e.g. `template_id`): any integer or string column.",
            ),
            ("level", "Optional constant confidence level, default 0.95."),
        ],
        example: "SELECT paired_diff_clustered(a, b, c) AS d \
                  FROM (VALUES (1.0, 0.0, 1), (1.0, 1.0, 1), (0.0, 0.0, 2), (1.0, 0.0, 2), (1.0, 1.0, 3), (1.0, 0.0, 3)) AS t(a, b, c)",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        coerce_args(Self::DOC.name, t, &["a", "b", "cluster", "level"], 2)
    }

    fn return_type(&self) -> DataType {
        DataType::Struct(fields())
    }

    fn state_fields(&self, args: &StateFieldsArgs) -> Result<Vec<FieldRef>> {
        Ok(clustered_acc::state_fields(
            args.name,
            key_kind(args.input_fields, 2),
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
    StatUdaf::udaf(PairedDiffClustered)
}
