//! `mean_ci(x [, level])`: the mean with a normal confidence interval.

use std::sync::Arc;

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::{DataType, FieldRef, Fields};
use datafusion::common::Result;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{Accumulator, AggregateUDF, GroupsAccumulator};

use super::common::{
    FunctionDoc, Moments, check_arity, coerce_score, f64_col, f64_field, i64_col, i64_field,
    interval_cols, struct_array, z_arg,
};
use super::moments_acc::{self, Input, MomentsGroups};
use super::single_group::SingleGroup;
use super::spec::{AggSpec, StatUdaf};

/// The `mean_ci` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct MeanCi;

/// Result fields: `n, mean, se, lo, hi`.
pub fn fields() -> Fields {
    Fields::from(vec![
        i64_field("n"),
        f64_field("mean"),
        f64_field("se"),
        f64_field("lo"),
        f64_field("hi"),
    ])
}

fn finish(m: &[Moments], z: f64) -> Result<ArrayRef> {
    let means: Vec<_> = m.iter().map(Moments::mean).collect();
    let ses: Vec<_> = m.iter().map(Moments::mean_se).collect();
    let (lo, hi) = interval_cols(&means, &ses, z);
    struct_array(
        &fields(),
        vec![
            i64_col(m.iter().map(|m| Some(m.n as i64))),
            f64_col(means),
            f64_col(ses),
            lo,
            hi,
        ],
    )
}

fn groups(args: &AccumulatorArgs) -> Result<MomentsGroups> {
    let z = z_arg(args, 1, MeanCi::DOC.name)?;
    Ok(MomentsGroups::new(
        Input::Single,
        Arc::new(move |m: &[Moments]| finish(m, z)),
    ))
}

impl AggSpec for MeanCi {
    const DOC: FunctionDoc = FunctionDoc {
        name: "mean_ci",
        syntax: "mean_ci(x [, level])",
        returns: "Struct{n: Int64, mean: Float64, se: Float64, lo: Float64, hi: Float64}",
        summary: "The mean of `x` with its standard error (as `mean_se`) and the normal interval \
                  mean -/+ z * se at `level` (default 0.95, z = 1.96).",
        behavior: "NULL and NaN values are ignored. The struct itself is never NULL: `n` counts the \
                   values used; `mean` is NULL when n = 0; `se`, `lo` and `hi` are NULL when n < 2. \
                   `level` must be a constant strictly between 0 and 1.",
        arguments: &[
            ("x", "Numeric or boolean score column."),
            ("level", "Optional constant confidence level, default 0.95."),
        ],
        example: "SELECT mean_ci(x) AS ci, mean_ci(x, 0.9)['lo'] AS lo90 \
                  FROM (VALUES (1.0), (0.0), (1.0), (1.0)) AS t(x)",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        check_arity(Self::DOC.name, t, 1, 2)?;
        t.iter()
            .zip(["x", "level"])
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
    StatUdaf::udaf(MeanCi)
}
