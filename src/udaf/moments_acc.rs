//! The shared accumulator of `mean_se`, `mean_ci` and `paired_diff`: per-group [`Moments`].
//!
//! The three functions differ only in how a row becomes a value ([`Input`]) and how the final
//! moments become a result (a `finish` function each file supplies). The state is
//! `(n: UInt64, mean: Float64, m2: Float64)`.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, BooleanArray, Float64Array, UInt64Array};
use datafusion::arrow::compute::kernels::numeric::sub;
use datafusion::arrow::datatypes::{DataType, Field, FieldRef};
use datafusion::common::Result;
use datafusion::common::cast::{as_float64_array, as_uint64_array};
use datafusion::logical_expr::utils::format_state_name;
use datafusion::logical_expr::{EmitTo, GroupsAccumulator};

use super::common::{Moments, f64_array, filter_ok};
use super::single_group::Grow;

/// How a row's arguments become the value that is averaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Input {
    /// `x` is argument 0.
    Single,
    /// `a - b` from arguments 0 and 1 (NULL when either is NULL).
    Diff,
}

impl Input {
    /// The per-row values (Float64) for `args`.
    pub fn values(self, args: &[ArrayRef]) -> Result<ArrayRef> {
        match self {
            Input::Single => Ok(Arc::clone(&args[0])),
            Input::Diff => Ok(sub(&args[0], &args[1])?),
        }
    }

    /// Index of the cluster argument for the clustered variants.
    pub fn cluster_idx(self) -> usize {
        match self {
            Input::Single => 1,
            Input::Diff => 2,
        }
    }
}

/// Turns final per-group moments into the result column.
pub type MomentsFinish = Arc<dyn Fn(&[Moments]) -> Result<ArrayRef> + Send + Sync>;

/// State fields of the moments accumulator.
pub fn state_fields(name: &str) -> Vec<FieldRef> {
    vec![
        Arc::new(Field::new(
            format_state_name(name, "n"),
            DataType::UInt64,
            true,
        )),
        Arc::new(Field::new(
            format_state_name(name, "mean"),
            DataType::Float64,
            true,
        )),
        Arc::new(Field::new(
            format_state_name(name, "m2"),
            DataType::Float64,
            true,
        )),
    ]
}

/// Per-group moments with a pluggable input and finish.
#[derive(Clone)]
pub struct MomentsGroups {
    input: Input,
    moments: Vec<Moments>,
    finish: MomentsFinish,
}

impl fmt::Debug for MomentsGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MomentsGroups")
            .field("input", &self.input)
            .field("groups", &self.moments.len())
            .finish()
    }
}

impl MomentsGroups {
    /// A new accumulator.
    pub fn new(input: Input, finish: MomentsFinish) -> Self {
        Self {
            input,
            moments: Vec::new(),
            finish,
        }
    }
}

impl Grow for MomentsGroups {
    fn grow(&mut self, total_num_groups: usize) {
        if self.moments.len() < total_num_groups {
            self.moments.resize(total_num_groups, Moments::default());
        }
    }

    /// Fast path for a single group (no GROUP BY): two passes per batch, then one merge.
    fn update_single(&mut self, values: &[ArrayRef]) -> Result<()> {
        self.grow(1);
        let x = self.input.values(values)?;
        let m = batch_moments(f64_array(&x)?);
        self.moments[0].merge(&m);
        Ok(())
    }
}

/// Adds the valid, non-NaN values of `x` to their groups.
fn accumulate(
    moments: &mut [Moments],
    x: &Float64Array,
    group_indices: &[usize],
    filter: Option<&BooleanArray>,
) {
    if x.null_count() == 0 && filter.is_none() {
        for (&g, &v) in group_indices.iter().zip(x.values().iter()) {
            if !v.is_nan() {
                moments[g].push(v);
            }
        }
    } else {
        for (i, &g) in group_indices.iter().enumerate() {
            if x.is_valid(i) && filter_ok(filter, i) {
                let v = x.value(i);
                if !v.is_nan() {
                    moments[g].push(v);
                }
            }
        }
    }
}

/// Moments of a whole batch in two passes (no per-row division), for the single-group path.
pub fn batch_moments(x: &Float64Array) -> Moments {
    let (mut n, mut sum) = (0u64, 0.0f64);
    let ok = |i: usize, v: f64| x.is_valid(i) && !v.is_nan();
    for (i, &v) in x.values().iter().enumerate() {
        if ok(i, v) {
            n += 1;
            sum += v;
        }
    }
    if n == 0 {
        return Moments::default();
    }
    let mean = sum / n as f64;
    let mut m2 = 0.0;
    for (i, &v) in x.values().iter().enumerate() {
        if ok(i, v) {
            m2 += (v - mean) * (v - mean);
        }
    }
    Moments { n, mean, m2 }
}

impl GroupsAccumulator for MomentsGroups {
    fn update_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        opt_filter: Option<&BooleanArray>,
        total_num_groups: usize,
    ) -> Result<()> {
        self.grow(total_num_groups);
        let x = self.input.values(values)?;
        accumulate(&mut self.moments, f64_array(&x)?, group_indices, opt_filter);
        Ok(())
    }

    fn merge_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        total_num_groups: usize,
    ) -> Result<()> {
        self.grow(total_num_groups);
        let n = as_uint64_array(&values[0])?;
        let mean = as_float64_array(&values[1])?;
        let m2 = as_float64_array(&values[2])?;
        for (i, &g) in group_indices.iter().enumerate() {
            if n.is_valid(i) && n.value(i) > 0 {
                self.moments[g].merge(&Moments {
                    n: n.value(i),
                    mean: mean.value(i),
                    m2: m2.value(i),
                });
            }
        }
        Ok(())
    }

    fn evaluate(&mut self, emit_to: EmitTo) -> Result<ArrayRef> {
        let m = emit_to.take_needed(&mut self.moments);
        (self.finish)(&m)
    }

    fn state(&mut self, emit_to: EmitTo) -> Result<Vec<ArrayRef>> {
        let m = emit_to.take_needed(&mut self.moments);
        Ok(vec![
            Arc::new(
                m.iter()
                    .map(|m| m.n)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .collect::<UInt64Array>(),
            ),
            Arc::new(Float64Array::from_iter_values(m.iter().map(|m| m.mean))),
            Arc::new(Float64Array::from_iter_values(m.iter().map(|m| m.m2))),
        ])
    }

    fn convert_to_state(
        &self,
        values: &[ArrayRef],
        opt_filter: Option<&BooleanArray>,
    ) -> Result<Vec<ArrayRef>> {
        let x = self.input.values(values)?;
        let x = f64_array(&x)?;
        let len = x.len();
        let mut n = Vec::with_capacity(len);
        let mut mean = Vec::with_capacity(len);
        for i in 0..len {
            let v = x.value(i);
            if x.is_valid(i) && !v.is_nan() && filter_ok(opt_filter, i) {
                n.push(1u64);
                mean.push(v);
            } else {
                n.push(0);
                mean.push(0.0);
            }
        }
        Ok(vec![
            Arc::new(UInt64Array::from(n)),
            Arc::new(Float64Array::from(mean)),
            Arc::new(Float64Array::from(vec![0.0; len])),
        ])
    }

    fn size(&self) -> usize {
        self.moments.capacity() * size_of::<Moments>()
    }
}
