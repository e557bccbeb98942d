//! An accumulator that keeps every value, for order statistics (`conformal_quantile`) and
//! all-pairs statistics (`self_consistency`). State: one `List<Float64>`.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, Float64Array, ListArray};
use datafusion::arrow::buffer::OffsetBuffer;
use datafusion::arrow::datatypes::{DataType, Field, FieldRef};
use datafusion::common::cast::{as_float64_array, as_list_array};
use datafusion::common::{Result, ScalarValue};
use datafusion::logical_expr::Accumulator;
use datafusion::logical_expr::utils::format_state_name;

/// Computes the result from all values (in any order; may reorder them).
pub type ValuesFinish = Arc<dyn Fn(&mut [f64]) -> Option<f64> + Send + Sync>;

/// State fields: the list of values.
pub fn state_fields(name: &str) -> Vec<FieldRef> {
    let item = Arc::new(Field::new_list_field(DataType::Float64, true));
    vec![Arc::new(Field::new(
        format_state_name(name, "values"),
        DataType::List(item),
        true,
    ))]
}

/// Keeps the valid, non-NaN values of argument 0.
pub struct ValuesAccumulator {
    values: Vec<f64>,
    finish: ValuesFinish,
}

impl fmt::Debug for ValuesAccumulator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ValuesAccumulator")
            .field("n", &self.values.len())
            .finish()
    }
}

impl ValuesAccumulator {
    /// A new accumulator.
    pub fn new(finish: ValuesFinish) -> Self {
        Self {
            values: Vec::new(),
            finish,
        }
    }

    fn extend(&mut self, a: &Float64Array) {
        self.values
            .extend(a.iter().flatten().filter(|v| !v.is_nan()));
    }
}

impl Accumulator for ValuesAccumulator {
    fn update_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        self.extend(as_float64_array(&values[0])?);
        Ok(())
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> Result<()> {
        let list = as_list_array(&states[0])?;
        let o = list.value_offsets();
        let (start, end) = (o[0] as usize, o[list.len()] as usize);
        let vals = list.values().slice(start, end - start);
        self.extend(as_float64_array(&vals)?);
        Ok(())
    }

    fn state(&mut self) -> Result<Vec<ScalarValue>> {
        let item = Arc::new(Field::new_list_field(DataType::Float64, true));
        let values = Arc::new(Float64Array::from(self.values.clone()));
        let list = ListArray::new(
            item,
            OffsetBuffer::from_lengths([self.values.len()]),
            values,
            None,
        );
        Ok(vec![ScalarValue::List(Arc::new(list))])
    }

    fn evaluate(&mut self) -> Result<ScalarValue> {
        Ok(ScalarValue::Float64((self.finish)(&mut self.values)))
    }

    fn size(&self) -> usize {
        size_of::<Self>() + self.values.capacity() * 8
    }
}
