//! Runs a [`GroupsAccumulator`] as a plain [`Accumulator`] with one group.
//!
//! DataFusion uses `Accumulator` without GROUP BY and `GroupsAccumulator` with it. Writing the
//! math once, in the groups form, and wrapping it here keeps the two paths identical.

use std::fmt::Debug;

use datafusion::arrow::array::ArrayRef;
use datafusion::common::{Result, ScalarValue};
use datafusion::logical_expr::{Accumulator, EmitTo, GroupsAccumulator};

/// A groups accumulator that can pre-size itself and update group 0 alone.
pub trait Grow: GroupsAccumulator + Clone + Debug + Sync + 'static {
    /// Makes sure groups `0..total_num_groups` exist.
    fn grow(&mut self, total_num_groups: usize);

    /// Adds a batch to group 0 (override for a faster path).
    fn update_single(&mut self, values: &[ArrayRef]) -> Result<()> {
        let zeros = vec![0usize; values.first().map_or(0, |v| v.len())];
        self.update_batch(values, &zeros, None, 1)
    }
}

/// The single-group adapter.
#[derive(Debug)]
pub struct SingleGroup<G: Grow> {
    inner: G,
}

impl<G: Grow> SingleGroup<G> {
    /// Wraps `inner`, creating its one group.
    pub fn new(mut inner: G) -> Self {
        inner.grow(1);
        Self { inner }
    }
}

impl<G: Grow> Accumulator for SingleGroup<G> {
    fn update_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        self.inner.update_single(values)
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> Result<()> {
        let zeros = vec![0usize; states.first().map_or(0, |v| v.len())];
        self.inner.merge_batch(states, &zeros, 1)
    }

    fn state(&mut self) -> Result<Vec<ScalarValue>> {
        // `state` and `evaluate` consume groups; work on a copy so either may be called again.
        let arrays = self.inner.clone().state(EmitTo::All)?;
        arrays
            .iter()
            .map(|a| ScalarValue::try_from_array(a, 0))
            .collect()
    }

    fn evaluate(&mut self) -> Result<ScalarValue> {
        let a = self.inner.clone().evaluate(EmitTo::All)?;
        ScalarValue::try_from_array(&a, 0)
    }

    fn size(&self) -> usize {
        size_of::<Self>() + self.inner.size()
    }
}
