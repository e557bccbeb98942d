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
            .map(|r| Some(r.method.name()))
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
        returns: "Struct{n: Int64, n_clusters: Int64, mean: Float64, se: Float64, lo: Float64, hi: Float64, method: Utf8, df: Float64}",
        summary: "The mean of `x` with a clustered interval at `level` (default 0.95). `method` \
                  is one of: `'auto'` (the default): `'cr2_score'` when every `x` is 0 or 1 (a \
                  pass/fail score), `'cr2'` otherwise, the choices whose coverage holds best in \
                  the simulation below; `'miller'`: Miller's clustered SE (as \
                  `clustered_se`) and a normal quantile, evalflow's original interval; `'cr1_t'`: \
                  the CR1 SE (as `clustered_se_cr1`) and a t(G-1) quantile; `'cr2'`: the \
                  Bell-McCaffrey bias-reduced SE (as `clustered_se_cr2`) and a t quantile at the \
                  Satterthwaite degrees of freedom 1 / (sum p_g^2 (1 - 2 p_g) / (1 - p_g)^2 + \
                  (sum p_g^2 / (1 - p_g))^2), p_g = n_g / n (G - 1 for equal clusters); \
                  `'cr2_wilson'`: for proportions (x in [0, 1]), a Wilson score interval at the \
                  effective size mean (1 - mean) / se_cr2^2 with the same t quantile, which stays \
                  in [0, 1] and widens towards 0.5 when the rate is near 0 or 1; \
                  `'cr2_score'`: for proportions, the clustered score interval: the p0 with \
                  (mean - p0)^2 <= t^2 V(p0), V(p0) = p0 (1 - p0) / n + B max(r, r^1.25), \
                  r = p0 (1 - p0) / (mean (1 - mean)), B = se_cr2^2 - mean (1 - mean) / n the \
                  between-template part (design effect at least 1 on that side), so the \
                  template variance grows toward 0.5 as it does for rare outcomes; for the bound \
                  toward 0.5, B \
                  becomes B + |1 - 2 mean| max(0, B_anova - B), B_anova the one-way ANOVA \
                  (random-intercept) estimate, which weighs templates by size n_g rather than \
                  n_g^2; towards the nearer bound it is \
                  the Wilson interval at the effective size, with the multiplier |1 - 2 mean| c + \
                  (1 - |1 - 2 mean|) t, c the quantile of a variance floored at its binomial share \
                  (between the normal and the t quantile), and a design effect below 1 counts \
                  there too, as 1 - |1 - 2 mean| (1 - max(deff, 0.5)); at a rate of 0 or 1 \
                  Wilson at n; \
                  `'cr2_ri'`: as `'cr2'` with the variance at least the random-intercept \
                  model's, MSW / n + sigma_b^2 sum n_g^2 / n^2 from the one-way ANOVA (the \
                  default of `paired_diff_clustered` for graded scores); \
                  `'wild_bootstrap'`: the symmetric wild cluster bootstrap-t interval studentized \
                  by the CR2 SE, with `reps` replications (default 999) drawn from `seed` \
                  (default 20160101): Rademacher weights, Webb's six-point weights below 12 \
                  clusters. `df` is the t degrees of freedom used (NULL for the normal and \
                  bootstrap methods); `se` is the method's SE (CR2 for `cr2_wilson`, `cr2_score` and \
                  `wild_bootstrap`).",
        behavior: "Rows where `x` or `cluster` is NULL, or `x` is NaN, are ignored. The struct is never \
                   NULL: `n` and `n_clusters` count what was used; `mean` is NULL when n = 0; `se`, \
                   `lo`, `hi`, `df` are NULL with fewer than two rows or two clusters, and `lo`, `hi` \
                   for `cr2_wilson` and `cr2_score` when the mean is outside [0, 1]. The bootstrap is \
                   reproducible: the same data and seed give the same interval under any \
                   partitioning. An unknown `method` is an error naming the accepted values.",
        arguments: &[
            ("x", "Numeric or boolean score column."),
            (
                "cluster",
                "Cluster id (e.g. `template_id`): any integer or string column.",
            ),
            ("level", "Optional constant confidence level, default 0.95."),
            (
                "method",
                "Optional constant string: 'auto' (default), 'miller', 'cr1_t', 'cr2', 'cr2_wilson', 'cr2_score', 'cr2_ri' or 'wild_bootstrap'. The result's `method` field names the method used ('auto' resolved).",
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
                  clustered_mean_ci(x, c, 0.95, 'wild_bootstrap')]) AS ci \
                  FROM (VALUES (1.0, 'a'), (1.0, 'a'), (0.0, 'b'), (0.0, 'b'), (1.0, 'c'), (0.0, 'c'), (1.0, 'd'), (1.0, 'd'), (1.0, 'd')) AS t(x, c))",
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
