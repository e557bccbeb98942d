//! `logit_normal_icc(x, cluster)`: the latent ICC of pass/fail scores under the logit-normal
//! template model, fitted by maximum likelihood: the ICC of a larger past run to state for a
//! new one (`clustered_mean_ci(x, c, 0.95, 'auto; icc=R')`, `[aggregate] icc`).

use std::sync::Arc;

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::{DataType, FieldRef, Fields};
use datafusion::common::Result;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{Accumulator, AggregateUDF, GroupsAccumulator};

use super::cluster_interval::logit_normal::{Fit, fit};
use super::cluster_summary::is_binary;
use super::clustered_acc::{self, ClusteredGroups, GroupCells, coerce_args, key_kind};
use super::common::{FunctionDoc, f64_col, f64_field, i64_col, i64_field, struct_array};
use super::moments_acc::Input;
use super::single_group::SingleGroup;
use super::spec::{AggSpec, StatUdaf};

/// The `logit_normal_icc` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct LogitNormalIcc;

/// Result fields: `n, n_clusters, mean, mu, sigma, icc`.
pub fn fields() -> Fields {
    Fields::from(vec![
        i64_field("n"),
        i64_field("n_clusters"),
        f64_field("mean"),
        f64_field("mu"),
        f64_field("sigma"),
        f64_field("icc"),
    ])
}

/// The fit of one group: `None` unless every score is 0 or 1 and both occur.
pub fn group_fit(g: &GroupCells) -> Option<Fit> {
    let cells = g.moments();
    if !cells.iter().all(is_binary) {
        return None;
    }
    let counts: Vec<(u64, u64)> = cells
        .iter()
        .filter(|c| c.n > 0)
        .map(|c| (c.n, (c.n as f64 * c.mean).round() as u64))
        .collect();
    fit(&counts)
}

fn finish(g: &[GroupCells]) -> Result<ArrayRef> {
    let fits: Vec<Option<Fit>> = g.iter().map(group_fit).collect();
    struct_array(
        &fields(),
        vec![
            i64_col(g.iter().map(|g| Some(g.total.n as i64))),
            i64_col(g.iter().map(|g| Some(g.cells.len() as i64))),
            f64_col(g.iter().map(|g| g.total.mean())),
            f64_col(fits.iter().map(|f| f.map(|f| f.mu))),
            f64_col(fits.iter().map(|f| f.map(|f| f.sigma))),
            f64_col(fits.iter().map(|f| f.map(|f| f.icc))),
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

impl AggSpec for LogitNormalIcc {
    const DOC: FunctionDoc = FunctionDoc {
        name: "logit_normal_icc",
        syntax: "logit_normal_icc(x, cluster)",
        returns: "Struct{n: Int64, n_clusters: Int64, mean: Float64, mu: Float64, sigma: Float64, \
                  icc: Float64}",
        summary: "Fits the logit-normal template model to pass/fail scores by maximum likelihood: \
                  the rows of a cluster (a template) are Bernoulli(expit(a + sigma u)), u standard \
                  normal per cluster; `mu` is the marginal rate E[expit(a + sigma u)], `sigma` the \
                  template effects' SD on the logit scale and `icc` the latent ICC sigma^2 / \
                  (sigma^2 + pi^2 / 3), searched in [0, 0.95]. Run over a larger past run of a \
                  suite, `icc` is the value to state for a new run of it \
                  (`clustered_mean_ci(x, c, 0.95, 'auto; icc=R')`, `[aggregate] icc`); \
                  docs/intervals.md says when to state one.",
        behavior: "Rows where `x` or `cluster` is NULL, or `x` is NaN, are ignored. The struct is \
                   never NULL: `n` and `n_clusters` count what was used, `mean` is NULL when n = 0; \
                   `mu`, `sigma` and `icc` are NULL unless every `x` is 0 or 1 and both occur (all \
                   passes or all failures say nothing of the ICC). With few clusters the estimate \
                   is rough: its interval is wide (docs/intervals.md, `logit_normal`).",
        arguments: &[
            ("x", "0/1 or boolean score column."),
            (
                "cluster",
                "Cluster id (e.g. `template_id`): any integer or string column.",
            ),
        ],
        example: "SELECT round(f['icc'], 3) AS icc, round(f['mu'], 4) AS mu, f['n_clusters'] AS templates FROM (\
                  SELECT logit_normal_icc(x, c) AS f FROM (VALUES (1.0, 'a'), (1.0, 'a'), (1.0, 'a'), \
                  (0.0, 'a'), (0.0, 'b'), (0.0, 'b'), (0.0, 'b'), (0.0, 'b'), (0.0, 'c'), (1.0, 'c'), \
                  (0.0, 'c'), (0.0, 'c'), (0.0, 'd'), (0.0, 'd'), (0.0, 'd'), (0.0, 'd')) AS t(x, c))",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        coerce_args(Self::DOC.name, t, &["x", "cluster"], 1)
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
    StatUdaf::udaf(LogitNormalIcc)
}
