//! Thin adapters from a per-function spec to DataFusion's UDAF / UDF traits.
//!
//! Each function file declares a unit struct implementing [`AggSpec`] or [`ScalarSpec`]: its
//! documentation, argument coercion, return type and accumulator. The adapters hold the
//! boilerplate (signature, documentation, wiring) once.

use std::fmt::Debug;
use std::hash::Hash;

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::{DataType, FieldRef};
use datafusion::common::Result;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::{
    Accumulator, AggregateUDF, AggregateUDFImpl, ColumnarValue, Documentation, GroupsAccumulator,
    ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};

use super::common::FunctionDoc;

/// What an aggregate function file provides.
pub trait AggSpec: Debug + PartialEq + Eq + Hash + Send + Sync + 'static {
    /// User documentation; `DOC.name` is the SQL name.
    const DOC: FunctionDoc;
    /// Maps the call's argument types to the types the accumulator reads (or a plan error).
    fn coerce(&self, types: &[DataType]) -> Result<Vec<DataType>>;
    /// The result type.
    fn return_type(&self) -> DataType;
    /// The partial-state fields.
    fn state_fields(&self, args: &StateFieldsArgs) -> Result<Vec<FieldRef>>;
    /// The row-at-a-time accumulator (no GROUP BY, windows).
    fn accumulator(&self, args: &AccumulatorArgs) -> Result<Box<dyn Accumulator>>;
    /// The GROUP BY accumulator, if the function has one.
    fn groups_accumulator(
        &self,
        _args: &AccumulatorArgs,
    ) -> Option<Result<Box<dyn GroupsAccumulator>>> {
        None
    }
}

/// A DataFusion aggregate built from an [`AggSpec`].
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct StatUdaf<S: AggSpec> {
    spec: S,
    signature: Signature,
    doc: Documentation,
}

impl<S: AggSpec> StatUdaf<S> {
    /// Wraps `spec` as an [`AggregateUDF`].
    pub fn udaf(spec: S) -> AggregateUDF {
        AggregateUDF::from(Self {
            spec,
            signature: Signature::user_defined(Volatility::Immutable),
            doc: S::DOC.to_documentation(),
        })
    }
}

impl<S: AggSpec> AggregateUDFImpl for StatUdaf<S> {
    fn name(&self) -> &str {
        S::DOC.name
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.spec.coerce(arg_types)
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(self.spec.return_type())
    }

    fn state_fields(&self, args: StateFieldsArgs) -> Result<Vec<FieldRef>> {
        self.spec.state_fields(&args)
    }

    fn accumulator(&self, acc_args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        self.spec.accumulator(&acc_args)
    }

    fn groups_accumulator_supported(&self, args: AccumulatorArgs) -> bool {
        !args.is_distinct && self.spec.groups_accumulator(&args).is_some()
    }

    fn create_groups_accumulator(
        &self,
        args: AccumulatorArgs,
    ) -> Result<Box<dyn GroupsAccumulator>> {
        match self.spec.groups_accumulator(&args) {
            Some(acc) => acc,
            None => {
                datafusion::common::not_impl_err!("{} has no GROUP BY accumulator", S::DOC.name)
            }
        }
    }

    fn documentation(&self) -> Option<&Documentation> {
        Some(&self.doc)
    }
}

/// What a scalar function file provides.
pub trait ScalarSpec: Debug + PartialEq + Eq + Hash + Send + Sync + 'static {
    /// User documentation; `DOC.name` is the SQL name.
    const DOC: FunctionDoc;
    /// Maps the call's argument types to the types `invoke` reads (or a plan error).
    fn coerce(&self, types: &[DataType]) -> Result<Vec<DataType>>;
    /// The result type.
    fn return_type(&self) -> DataType;
    /// Computes the result for `n_rows` rows from arguments already expanded to arrays.
    fn invoke(&self, args: &[ArrayRef], n_rows: usize) -> Result<ArrayRef>;
}

/// A DataFusion scalar function built from a [`ScalarSpec`].
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct StatUdf<S: ScalarSpec> {
    spec: S,
    signature: Signature,
    doc: Documentation,
}

impl<S: ScalarSpec> StatUdf<S> {
    /// Wraps `spec` as a [`ScalarUDF`].
    pub fn udf(spec: S) -> ScalarUDF {
        ScalarUDF::from(Self {
            spec,
            signature: Signature::user_defined(Volatility::Immutable),
            doc: S::DOC.to_documentation(),
        })
    }
}

impl<S: ScalarSpec> ScalarUDFImpl for StatUdf<S> {
    fn name(&self) -> &str {
        S::DOC.name
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.spec.coerce(arg_types)
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(self.spec.return_type())
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let all_scalar = args
            .args
            .iter()
            .all(|a| matches!(a, ColumnarValue::Scalar(_)));
        let n = if all_scalar { 1 } else { args.number_rows };
        let arrays = ColumnarValue::values_to_arrays(&args.args)?;
        let out = self.spec.invoke(&arrays, n)?;
        if all_scalar {
            Ok(ColumnarValue::Scalar(
                datafusion::common::ScalarValue::try_from_array(&out, 0)?,
            ))
        } else {
            Ok(ColumnarValue::Array(out))
        }
    }

    fn documentation(&self) -> Option<&Documentation> {
        Some(&self.doc)
    }
}
