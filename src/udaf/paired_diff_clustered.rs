//! `paired_diff_clustered(a, b, cluster [, level [, method [, reps [, seed]]]])`: `paired_diff`
//! with a clustered interval and test of d = a - b (see [`super::cluster_interval`]).

use std::sync::Arc;

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::{DataType, Field, FieldRef, Fields};
use datafusion::common::Result;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{Accumulator, AggregateUDF, GroupsAccumulator};

use super::cluster_interval::{ClusterInterval, IntervalSpec, Method};
use super::clustered_acc::{
    self, ClusteredGroups, GroupCells, coerce_interval_args, interval_spec_arg, key_kind,
};
use super::clustered_mean_ci::method_col;
use super::common::{FunctionDoc, f64_col, f64_field, i64_col, struct_array};
use super::moments_acc::Input;
use super::single_group::SingleGroup;
use super::spec::{AggSpec, StatUdaf};

/// The `paired_diff_clustered` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct PairedDiffClustered;

/// The methods that apply to a difference (`cr2_wilson` needs a proportion).
pub const METHODS: [Method; 7] = [
    Method::Auto,
    Method::Cr2Score,
    Method::Miller,
    Method::Cr1T,
    Method::Cr2,
    Method::WildBootstrap,
    Method::Cr2Ri,
];

/// Result fields: `paired_diff`'s `n, mean_diff, se, z, p_value, lo, hi`, then `method, df`.
pub fn fields() -> Fields {
    let mut f: Vec<Field> = super::paired_diff::fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    f.push(Field::new("method", DataType::Utf8, true));
    f.push(f64_field("df"));
    Fields::from(f)
}

fn finish(g: &[GroupCells], spec: &IntervalSpec) -> Result<ArrayRef> {
    let rows: Vec<ClusterInterval> = g.iter().map(|g| g.paired_interval(spec)).collect();
    struct_array(
        &fields(),
        vec![
            i64_col(rows.iter().map(|r| Some(r.n as i64))),
            f64_col(rows.iter().map(|r| r.mean)),
            f64_col(rows.iter().map(|r| r.se)),
            f64_col(rows.iter().map(|r| r.stat)),
            f64_col(rows.iter().map(|r| r.p_value)),
            f64_col(rows.iter().map(|r| r.lo)),
            f64_col(rows.iter().map(|r| r.hi)),
            method_col(&rows),
            f64_col(rows.iter().map(|r| r.df)),
        ],
    )
}

fn groups(args: &AccumulatorArgs) -> Result<ClusteredGroups> {
    let spec = interval_spec_arg(
        args,
        3,
        PairedDiffClustered::DOC.name,
        &METHODS,
        Method::Auto,
    )?;
    Ok(ClusteredGroups::new(
        Input::Diff,
        key_kind(args.expr_fields, 2),
        Arc::new(move |g: &[GroupCells]| finish(g, &spec)),
    ))
}

impl AggSpec for PairedDiffClustered {
    const DOC: FunctionDoc = FunctionDoc {
        name: "paired_diff_clustered",
        syntax: "paired_diff_clustered(a, b, cluster [, level [, method [, reps [, seed]]]])",
        returns: "Struct{n: Int64, mean_diff: Float64, se: Float64, z: Float64, p_value: Float64, \
                  lo: Float64, hi: Float64, method: Utf8, df: Float64}",
        summary: "As `paired_diff`, but for cases that share a template: the interval and the test of \
                  mean(d) = 0, d = a - b, account for the pairs' `cluster`. The default `method` \
                  `'auto'` is `'cr2_score'` (Tango's score interval for paired proportions with \
                  the template variance carried by design effects; `z` and `p_value` are the \
                  clustered McNemar test and `se` the `'cr2_ri'` SE) when every a and b is 0 or \
                  1, and `'cr2_ri'` (CR2 with the variance at least the random-intercept \
                  model's) otherwise; the other methods are those of `clustered_mean_ci` \
                  (see its table). `z` is mean_diff / se for the others; `df` is the t degrees of \
                  freedom used. What each method computes: docs/intervals.md.",
        behavior: "Only rows where `a`, `b` and `cluster` are non-NULL (and d is not NaN) are used. The \
                   struct is never NULL: `n` counts the pairs; `mean_diff` is NULL when n = 0; `se`, \
                   `lo`, `hi` are NULL with fewer than two rows or two clusters; `z` and `p_value` \
                   are NULL when se is NULL or 0, except for `'cr2_score'`, whose test does not \
                   divide by se: there they are NULL when no pair differs. With no template \
                   variance seen (se 0), `'cr2_score'` takes a design effect of 1, never a \
                   zero width. \
                   `'cr2_score'` asked for pairs that are not all 0/1 gives NULL `lo`, `hi`, `z` \
                   and `p_value`; `'cr2_wilson'` does not apply to a difference and is an error, \
                   as is an unknown method.",
        arguments: &[
            ("a", "Score of version A (numeric or boolean)."),
            ("b", "Score of version B on the same case."),
            (
                "cluster",
                "Cluster id (e.g. `template_id`): any integer or string column.",
            ),
            ("level", "Optional constant confidence level, default 0.95."),
            (
                "method",
                "Optional constant string: 'auto' (default: 'cr2_score' for 0/1 pairs, else \
                 'cr2_ri'), 'cr2_score', 'cr2_ri', 'cr2', 'miller', 'cr1_t' or 'wild_bootstrap'. \
                 The result's `method` field names the method used.",
            ),
            (
                "reps",
                "Optional constant: bootstrap replications, 19 to 1000000, default 999.",
            ),
            (
                "seed",
                "Optional constant: bootstrap seed, a non-negative integer, default 20160101.",
            ),
        ],
        example: "SELECT paired_diff_clustered(a, b, c) AS d \
                  FROM (VALUES (1.0, 0.0, 1), (1.0, 1.0, 1), (0.0, 0.0, 2), (1.0, 0.0, 2), (1.0, 1.0, 3), (1.0, 0.0, 3)) AS t(a, b, c)",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        coerce_interval_args(Self::DOC.name, t, &["a", "b", "cluster"], 2)
    }

    fn return_type(&self) -> DataType {
        DataType::Struct(fields())
    }

    fn state_fields(&self, args: &StateFieldsArgs) -> Result<Vec<FieldRef>> {
        Ok(clustered_acc::state_fields(
            args.name,
            key_kind(args.input_fields, 2),
            Input::Diff,
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
