//! `paired_diff(a, b [, level])`: the paired difference of two scores on the same cases.

use std::sync::Arc;

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::{DataType, FieldRef, Fields};
use datafusion::common::Result;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{Accumulator, AggregateUDF, GroupsAccumulator};

use super::common::{
    FunctionDoc, Moments, check_arity, coerce_score, f64_col, f64_field, finite, i64_col,
    i64_field, interval_cols, struct_array, two_sided_p, z_arg,
};
use super::moments_acc::{self, Input, MomentsGroups};
use super::single_group::SingleGroup;
use super::spec::{AggSpec, StatUdaf};

/// The `paired_diff` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct PairedDiff;

/// Result fields: `n, mean_diff, se, z, p_value, lo, hi` (shared with `paired_diff_clustered`).
pub fn fields() -> Fields {
    Fields::from(vec![
        i64_field("n"),
        f64_field("mean_diff"),
        f64_field("se"),
        f64_field("z"),
        f64_field("p_value"),
        f64_field("lo"),
        f64_field("hi"),
    ])
}

/// Builds the result from per-group `(n, mean_diff, se)`; `zcrit` is the interval multiplier.
///
/// `z` and `p_value` are NULL when `se` is NULL or 0 (every difference equal).
pub fn finish_rows(rows: &[(u64, Option<f64>, Option<f64>)], zcrit: f64) -> Result<ArrayRef> {
    let means: Vec<_> = rows.iter().map(|r| r.1).collect();
    let ses: Vec<_> = rows.iter().map(|r| r.2).collect();
    let z: Vec<Option<f64>> = rows
        .iter()
        .map(|r| match (r.1, r.2) {
            (Some(m), Some(s)) if s > 0.0 => finite(m / s),
            _ => None,
        })
        .collect();
    let p = z.iter().map(|z| z.map(two_sided_p));
    let (lo, hi) = interval_cols(&means, &ses, zcrit);
    struct_array(
        &fields(),
        vec![
            i64_col(rows.iter().map(|r| Some(r.0 as i64))),
            f64_col(means),
            f64_col(ses),
            f64_col(z.clone()),
            f64_col(p),
            lo,
            hi,
        ],
    )
}

fn groups(args: &AccumulatorArgs) -> Result<MomentsGroups> {
    let zcrit = z_arg(args, 2, PairedDiff::DOC.name)?;
    Ok(MomentsGroups::new(
        Input::Diff,
        Arc::new(move |m: &[Moments]| {
            let rows: Vec<_> = m.iter().map(|m| (m.n, m.mean(), m.mean_se())).collect();
            finish_rows(&rows, zcrit)
        }),
    ))
}

impl AggSpec for PairedDiff {
    const DOC: FunctionDoc = FunctionDoc {
        name: "paired_diff",
        syntax: "paired_diff(a, b [, level])",
        returns: "Struct{n: Int64, mean_diff: Float64, se: Float64, z: Float64, p_value: Float64, lo: Float64, hi: Float64}",
        summary: "Paired comparison of two scores on the same cases: d = a - b per row, \
                  mean_diff = mean(d), se = sqrt(var_samp(d) / n), z = mean_diff / se, a two-sided \
                  normal p-value and the interval mean_diff -/+ z_(level) * se. With K samples \
                  per case, average them per case first (one row per case).",
        behavior: "Only rows where both `a` and `b` are non-NULL and not NaN are used. The struct is \
                   never NULL: `n` counts the pairs; `mean_diff` is NULL when n = 0; `se`, `lo`, \
                   `hi` are NULL when n < 2; `z` and `p_value` are NULL when se is NULL or 0.",
        arguments: &[
            ("a", "Score of version A (numeric or boolean)."),
            ("b", "Score of version B on the same case."),
            ("level", "Optional constant confidence level, default 0.95."),
        ],
        example: "SELECT paired_diff(a, b) AS d \
                  FROM (VALUES (1.0, 0.0), (1.0, 1.0), (0.0, 0.0), (1.0, 0.0), (1.0, 1.0)) AS t(a, b)",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        check_arity(Self::DOC.name, t, 2, 3)?;
        t.iter()
            .zip(["a", "b", "level"])
            .map(|(t, a)| coerce_score(Self::DOC.name, a, t))
            .collect()
    }

    fn return_type(&self) -> DataType {
        DataType::Struct(fields())
    }

    fn state_fields(&self, args: &StateFieldsArgs) -> Result<Vec<FieldRef>> {
        Ok(moments_acc::state_fields(args.name))
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
    StatUdaf::udaf(PairedDiff)
}
