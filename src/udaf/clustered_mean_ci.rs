//! `clustered_mean_ci(x, cluster [, level [, method [, reps [, seed]]]])`: the mean with a
//! clustered interval that keeps its coverage with few clusters (see [`super::cluster_interval`]).

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, FieldRef, Fields};
use datafusion::common::Result;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{Accumulator, AggregateUDF, GroupsAccumulator};

use super::cluster_interval::{ClusterInterval, IntervalSpec, Method};
use super::clustered_acc::{
    self, ClusteredGroups, GroupCells, coerce_interval_args, interval_spec_arg, key_kind,
};
use super::common::{FunctionDoc, f64_col, f64_field, i64_col, i64_field, struct_array};
use super::moments_acc::Input;
use super::single_group::SingleGroup;
use super::spec::{AggSpec, StatUdaf};

/// The `clustered_mean_ci` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct ClusteredMeanCi;

/// Result fields: `n, n_clusters, mean, se, lo, hi, method, df`.
pub fn fields() -> Fields {
    Fields::from(vec![
        i64_field("n"),
        i64_field("n_clusters"),
        f64_field("mean"),
        f64_field("se"),
        f64_field("lo"),
        f64_field("hi"),
        Field::new("method", DataType::Utf8, true),
        f64_field("df"),
    ])
}

/// The method name column.
pub fn method_col(rows: &[ClusterInterval]) -> ArrayRef {
    Arc::new(
        rows.iter()
            .map(|r| Some(r.method_label()))
            .collect::<StringArray>(),
    )
}

fn finish(g: &[GroupCells], spec: &IntervalSpec) -> Result<ArrayRef> {
    let rows: Vec<ClusterInterval> = g.iter().map(|g| g.interval(spec)).collect();
    struct_array(
        &fields(),
        vec![
            i64_col(rows.iter().map(|r| Some(r.n as i64))),
            i64_col(rows.iter().map(|r| Some(r.n_clusters as i64))),
            f64_col(rows.iter().map(|r| r.mean)),
            f64_col(rows.iter().map(|r| r.se)),
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
        2,
        ClusteredMeanCi::DOC.name,
        &Method::ALL,
        Method::DEFAULT,
    )?;
    Ok(ClusteredGroups::new(
        Input::Single,
        key_kind(args.expr_fields, 1),
        Arc::new(move |g: &[GroupCells]| finish(g, &spec)),
    ))
}

impl AggSpec for ClusteredMeanCi {
    const DOC: FunctionDoc = FunctionDoc {
        name: "clustered_mean_ci",
        syntax: "clustered_mean_ci(x, cluster [, level [, method [, reps [, seed]]]])",
        returns: "Struct{n: Int64, n_clusters: Int64, mean: Float64, se: Float64, lo: Float64, \
                  hi: Float64, method: Utf8, df: Float64}",
        summary: "The mean of `x` with an interval at `level` (default 0.95) that accounts for rows \
                  sharing a `cluster` (a template). The default `method` `'auto'` is `'cr2_score'` \
                  (a clustered score interval) when every `x` is 0 or 1 and `'cr2_ri'` (the \
                  bias-reduced CR2 SE with a Satterthwaite t quantile, never below the plain SE \
                  `mean_se(x)` nor the within-template spread's) otherwise; the table below \
                  says when another method fits. A stated latent ICC, `'auto; icc=0.3'` (or \
                  `'icc=0.3'`), widens a pass/fail rate's interval to cover the exact mid-p \
                  interval of the failure count under a logit-normal template model at that ICC \
                  (the interval is the union of both): state one for a rare rate from few \
                  templates, where a sample cannot show the heterogeneity a few failing templates \
                  bring (docs/intervals.md). `se` is the method's SE (CR2 for `cr2_wilson`, \
                  `cr2_score` and `wild_bootstrap`), `df` its t degrees of freedom (NULL for the \
                  normal and bootstrap methods). What each method computes: docs/intervals.md.",
        behavior: "Rows where `x` or `cluster` is NULL, or `x` is NaN, are ignored. The struct is never \
                   NULL: `n` and `n_clusters` count what was used; `mean` is NULL when n = 0; `se`, \
                   `lo`, `hi`, `df` are NULL with fewer than two rows or two clusters, and `lo`, `hi` \
                   for `cr2_wilson` and `cr2_score` when the mean is outside [0, 1]. The bootstrap is \
                   reproducible: the same data and seed give the same interval under any \
                   partitioning. An unknown `method` is an error naming the accepted values. A \
                   stated ICC outside [0, 1) is an error; on scores that are not all 0 or 1 it is \
                   not applied, and `method` then names no ICC. `logit_normal` gives no interval \
                   on such scores.",
        arguments: &[
            ("x", "Numeric or boolean score column."),
            (
                "cluster",
                "Cluster id (e.g. `template_id`): any integer or string column.",
            ),
            ("level", "Optional constant confidence level, default 0.95."),
            (
                "method",
                "Optional constant string: 'auto' (default), 'miller', 'cr1_t', 'cr2', \
                 'cr2_wilson', 'cr2_score', 'cr2_ri', 'wild_bootstrap' or 'logit_normal' (the \
                 logit-normal profile-likelihood interval, latent ICC estimated up to 0.45), \
                 optionally followed by '; icc=R', a stated latent ICC R in [0, 1). The result's \
                 `method` field names the method used ('auto' resolved, '; icc=R' when applied).",
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
        example: "SELECT ci['method'] AS method, ci['lo'] AS lo, ci['hi'] AS hi, ci['df'] AS df FROM (\
                  SELECT unnest([clustered_mean_ci(x, c), clustered_mean_ci(x, c, 0.95, 'miller'), \
                  clustered_mean_ci(x, c, 0.95, 'cr2_wilson'), clustered_mean_ci(x, c, 0.95, 'cr2_score'), \
                  clustered_mean_ci(x, c, 0.95, 'wild_bootstrap'), \
                  clustered_mean_ci(x, c, 0.95, 'logit_normal'), \
                  clustered_mean_ci(x, c, 0.95, 'auto; icc=0.3')]) AS ci \
                  FROM (VALUES (1.0, 'a'), (1.0, 'a'), (0.0, 'b'), (0.0, 'b'), (1.0, 'c'), \
                  (0.0, 'c'), (1.0, 'd'), (1.0, 'd'), (1.0, 'd')) AS t(x, c))",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        coerce_interval_args(Self::DOC.name, t, &["x", "cluster"], 1)
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
