//! `mean_se(x)`: the standard error of the mean, sqrt(var_samp(x) / n).

use std::sync::Arc;

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::{DataType, FieldRef};
use datafusion::common::Result;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{Accumulator, AggregateUDF, GroupsAccumulator};

use super::common::{FunctionDoc, Moments, check_arity, coerce_score, f64_col};
use super::moments_acc::{self, Input, MomentsGroups};
use super::single_group::SingleGroup;
use super::spec::{AggSpec, StatUdaf};

/// The `mean_se` aggregate.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct MeanSe;

/// Final step: the SE of each group's mean.
pub fn finish(m: &[Moments]) -> Result<ArrayRef> {
    Ok(f64_col(m.iter().map(Moments::mean_se)))
}

fn groups() -> MomentsGroups {
    MomentsGroups::new(Input::Single, Arc::new(finish))
}

impl AggSpec for MeanSe {
    const DOC: FunctionDoc = FunctionDoc {
        name: "mean_se",
        syntax: "mean_se(x)",
        returns: "Float64",
        summary: "Standard error of the mean of `x`: sqrt(var_samp(x) / n). For pass/fail scores \
                  with pass rate p this is sqrt(p(1 - p) / (n - 1)), close to sqrt(p(1 - p) / n).",
        behavior: "NULL and NaN values are ignored. Fewer than two values give NULL. \
                   Boolean input is read as 1.0 / 0.0.",
        arguments: &[("x", "Numeric or boolean score column.")],
        example: "SELECT mean_se(x) AS se FROM (VALUES (1.0), (0.0), (1.0), (1.0), (NULL)) AS t(x)",
    };

    fn coerce(&self, t: &[DataType]) -> Result<Vec<DataType>> {
        check_arity(Self::DOC.name, t, 1, 1)?;
        Ok(vec![coerce_score(Self::DOC.name, "x", &t[0])?])
    }

    fn return_type(&self) -> DataType {
        DataType::Float64
    }

    fn state_fields(&self, args: &StateFieldsArgs) -> Result<Vec<FieldRef>> {
        Ok(moments_acc::state_fields(args.name))
    }

    fn accumulator(&self, _args: &AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        Ok(Box::new(SingleGroup::new(groups())))
    }

    fn groups_accumulator(
        &self,
        _args: &AccumulatorArgs,
    ) -> Option<Result<Box<dyn GroupsAccumulator>>> {
        Some(Ok(Box::new(groups())))
    }
}

/// The registered function.
pub fn udaf() -> AggregateUDF {
    StatUdaf::udaf(MeanSe)
}
