//! Shared math and Arrow glue for the statistics functions.
//!
//! The math is plain functions over numbers ([`Moments`], [`normal_z`]); the glue turns
//! literal arguments into numbers, coerces argument types and builds struct results.
//!
//! Input conventions shared by every function in this module tree:
//! - NULL values are ignored; a row is used only when every data argument is non-NULL.
//! - NaN is treated as missing, exactly like NULL (a NaN score is a scorer bug, not a score).
//! - A result that would be NaN or infinite is returned as NULL instead.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, Float64Array, RecordBatch, RecordBatchOptions};
use datafusion::arrow::datatypes::{DataType, Field, Fields, Schema};
use datafusion::common::{Result, ScalarValue, plan_datafusion_err, plan_err};
use datafusion::logical_expr::ColumnarValue;
use datafusion::logical_expr::function::AccumulatorArgs;
use datafusion::logical_expr::{DocSection, Documentation};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::utils::collect_columns;
use statrs::distribution::{ContinuousCDF, Normal};

/// The documentation section every evalflow statistics function belongs to.
pub const DOC_SECTION: DocSection = DocSection {
    include: true,
    label: "evalflow statistics",
    description: Some("Error bars, paired comparisons, power and bias correction for evals."),
};

/// One function's user documentation, kept as data so `docs/functions.md` is generated.
#[derive(Debug, Clone, Copy)]
pub struct FunctionDoc {
    /// SQL name.
    pub name: &'static str,
    /// Call syntax, optional arguments in brackets.
    pub syntax: &'static str,
    /// Arrow return type as the user sees it.
    pub returns: &'static str,
    /// One-paragraph summary of what the function computes.
    pub summary: &'static str,
    /// Behaviour on NULL, NaN, empty and too-small input.
    pub behavior: &'static str,
    /// `(name, description)` for every argument.
    pub arguments: &'static [(&'static str, &'static str)],
    /// A runnable SQL example (self-contained: it uses `VALUES`).
    pub example: &'static str,
}

impl FunctionDoc {
    /// Converts to DataFusion's [`Documentation`] (shown by `information_schema` tooling).
    pub fn to_documentation(&self) -> Documentation {
        let mut b = Documentation::builder(
            DOC_SECTION,
            format!("{}\n\n{}", self.summary, self.behavior),
            self.syntax,
        )
        .with_sql_example(self.example);
        for (name, desc) in self.arguments {
            b = b.with_argument(*name, *desc);
        }
        b.build()
    }
}

/// The moments of `xs` (a test's cluster, written out).
#[cfg(test)]
pub(crate) fn moments_of(xs: &[f64]) -> Moments {
    let mut m = Moments::default();
    xs.iter().for_each(|&x| m.push(x));
    m
}

/// Count, mean and sum of squared deviations (Welford), mergeable (Chan et al.).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Moments {
    /// Number of values.
    pub n: u64,
    /// Their mean (0 when `n == 0`).
    pub mean: f64,
    /// Sum of squared deviations from `mean`.
    pub m2: f64,
}

impl Moments {
    /// Adds one value.
    #[inline]
    pub fn push(&mut self, x: f64) {
        self.n += 1;
        let d = x - self.mean;
        self.mean += d / self.n as f64;
        self.m2 += d * (x - self.mean);
    }

    /// Merges another partial state into this one.
    #[inline]
    pub fn merge(&mut self, o: &Moments) {
        if o.n == 0 {
            return;
        }
        if self.n == 0 {
            *self = *o;
            return;
        }
        let n = self.n + o.n;
        let nf = n as f64;
        let d = o.mean - self.mean;
        self.mean += d * (o.n as f64 / nf);
        self.m2 += o.m2 + d * d * (self.n as f64) * (o.n as f64) / nf;
        self.n = n;
    }

    /// Sample variance, `None` below two values.
    pub fn var_samp(&self) -> Option<f64> {
        if self.n < 2 {
            return None;
        }
        finite(self.m2.max(0.0) / (self.n - 1) as f64)
    }

    /// Standard error of the mean, sqrt(var_samp / n), `None` below two values.
    pub fn mean_se(&self) -> Option<f64> {
        finite((self.var_samp()? / self.n as f64).sqrt())
    }

    /// The mean, `None` when empty.
    pub fn mean(&self) -> Option<f64> {
        if self.n == 0 { None } else { finite(self.mean) }
    }
}

/// `Some(x)` when `x` is finite.
#[inline]
pub fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// The standard normal quantile `z` with `P(Z > z) = upper_tail` (so `normal_z(0.025) = 1.96`).
pub fn normal_z(upper_tail: f64) -> f64 {
    let n = Normal::standard();
    n.inverse_cdf(1.0 - upper_tail)
}

/// Two-sided normal p-value for `z`.
pub fn two_sided_p(z: f64) -> f64 {
    let n = Normal::standard();
    (2.0 * n.sf(z.abs())).min(1.0)
}

/// The z multiplier of a two-sided interval at `level` (0.95 gives 1.959964).
pub fn z_for_level(level: f64) -> f64 {
    normal_z((1.0 - level) / 2.0)
}

/// Validates a confidence level.
pub fn check_level(fname: &str, level: f64) -> Result<f64> {
    if level > 0.0 && level < 1.0 {
        Ok(level)
    } else {
        plan_err!("{fname}: level must be between 0 and 1 (exclusive), got {level}")
    }
}

/// Evaluates argument `idx` of an aggregate as a constant (a literal, possibly cast).
///
/// Returns `None` when the argument is absent. Errors when it refers to a column.
pub fn constant_arg(
    args: &AccumulatorArgs,
    idx: usize,
    fname: &str,
    arg: &str,
) -> Result<Option<ScalarValue>> {
    let Some(expr) = args.exprs.get(idx) else {
        return Ok(None);
    };
    constant_value(expr, fname, arg).map(Some)
}

fn constant_value(expr: &Arc<dyn PhysicalExpr>, fname: &str, arg: &str) -> Result<ScalarValue> {
    if !collect_columns(expr).is_empty() {
        return plan_err!("{fname}: {arg} must be a constant, not a column");
    }
    let batch = RecordBatch::try_new_with_options(
        Arc::new(Schema::empty()),
        vec![],
        &RecordBatchOptions::new().with_row_count(Some(1)),
    )?;
    match expr.evaluate(&batch)? {
        ColumnarValue::Scalar(s) => Ok(s),
        ColumnarValue::Array(a) => ScalarValue::try_from_array(&a, 0),
    }
}

/// A constant argument as `f64`, or `default` when absent. NULL or non-numeric is an error.
pub fn constant_f64(
    args: &AccumulatorArgs,
    idx: usize,
    fname: &str,
    arg: &str,
    default: f64,
) -> Result<f64> {
    match constant_arg(args, idx, fname, arg)? {
        None => Ok(default),
        Some(s) => scalar_f64(&s).ok_or_else(|| {
            plan_datafusion_err!("{fname}: {arg} must be a non-NULL number, got {s}")
        }),
    }
}

/// A scalar as `f64` when it is a non-NULL number.
pub fn scalar_f64(s: &ScalarValue) -> Option<f64> {
    match s.cast_to(&DataType::Float64).ok()? {
        ScalarValue::Float64(Some(v)) => Some(v),
        _ => None,
    }
}

/// Whether `t` can be read as a score (numbers and booleans).
pub fn is_score_type(t: &DataType) -> bool {
    t.is_numeric() || matches!(t, DataType::Boolean | DataType::Null)
}

/// Coerces a score argument to Float64.
pub fn coerce_score(fname: &str, arg: &str, t: &DataType) -> Result<DataType> {
    if is_score_type(t) {
        Ok(DataType::Float64)
    } else {
        plan_err!("{fname}: {arg} must be numeric or boolean, got {t}")
    }
}

/// Coerces a cluster / case id argument: integers to Int64, strings to Utf8 (Utf8View kept).
pub fn coerce_cluster(fname: &str, arg: &str, t: &DataType) -> Result<DataType> {
    use DataType::*;
    Ok(match t {
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | Boolean | Null => Int64,
        // UInt64 may not fit Int64; its decimal text is an exact key.
        UInt64 | Utf8 | LargeUtf8 => Utf8,
        Utf8View => Utf8View,
        // A dictionary of strings stays one: clusters are then looked up once per dictionary
        // value, not per row (see `cluster_keys`).
        Dictionary(_, v) if matches!(v.as_ref(), Utf8 | LargeUtf8 | Utf8View) => t.clone(),
        Dictionary(_, v) => return coerce_cluster(fname, arg, v),
        other => {
            return plan_err!("{fname}: {arg} must be an integer or string column, got {other}");
        }
    })
}

/// Checks the argument count is within `min..=max`.
pub fn check_arity(fname: &str, types: &[DataType], min: usize, max: usize) -> Result<()> {
    if types.len() < min || types.len() > max {
        let expect = if min == max {
            format!("{min}")
        } else {
            format!("{min} to {max}")
        };
        return plan_err!("{fname} takes {expect} arguments, got {}", types.len());
    }
    Ok(())
}

/// A nullable Int64 field.
pub fn i64_field(name: &str) -> Field {
    Field::new(name, DataType::Int64, true)
}

/// A nullable Float64 field.
pub fn f64_field(name: &str) -> Field {
    Field::new(name, DataType::Float64, true)
}

/// Builds a struct array (no top-level nulls) from `columns` in `fields` order.
pub fn struct_array(fields: &Fields, columns: Vec<ArrayRef>) -> Result<ArrayRef> {
    Ok(Arc::new(datafusion::arrow::array::StructArray::try_new(
        fields.clone(),
        columns,
        None,
    )?))
}

/// Reads a Float64 array argument.
pub fn f64_array(a: &ArrayRef) -> Result<&Float64Array> {
    datafusion::common::cast::as_float64_array(a)
}

/// The rows of `values` to use: valid, not NaN, passing `filter`.
#[inline]
pub fn filter_ok(filter: Option<&datafusion::arrow::array::BooleanArray>, row: usize) -> bool {
    filter.is_none_or(|f| f.is_valid(row) && f.value(row))
}

/// A column of optional floats.
pub fn f64_col(v: impl IntoIterator<Item = Option<f64>>) -> ArrayRef {
    Arc::new(v.into_iter().collect::<Float64Array>())
}

/// A column of optional integers.
pub fn i64_col(v: impl IntoIterator<Item = Option<i64>>) -> ArrayRef {
    Arc::new(
        v.into_iter()
            .collect::<datafusion::arrow::array::Int64Array>(),
    )
}

/// `(lo, hi)` columns of normal intervals `mean -/+ z * se` (NULL where either is NULL).
pub fn interval_cols(means: &[Option<f64>], ses: &[Option<f64>], z: f64) -> (ArrayRef, ArrayRef) {
    let bound = |sign: f64| {
        f64_col(means.iter().zip(ses).map(|(m, s)| match (m, s) {
            (Some(m), Some(s)) => finite(m + sign * z * s),
            _ => None,
        }))
    };
    (bound(-1.0), bound(1.0))
}

/// The `level` argument at `idx` of an aggregate as the z multiplier (default level 0.95).
pub fn z_arg(args: &AccumulatorArgs, idx: usize, fname: &str) -> Result<f64> {
    let level = check_level(fname, constant_f64(args, idx, fname, "level", 0.95)?)?;
    Ok(z_for_level(level))
}

/// Row `i` of a Float64 argument: `None` when NULL or NaN.
#[inline]
pub fn opt_f64(a: &Float64Array, i: usize) -> Option<f64> {
    if a.is_null(i) {
        return None;
    }
    let v = a.value(i);
    (!v.is_nan()).then_some(v)
}

/// Coerces every argument of a scalar function to Float64, checking the count.
pub fn coerce_all_f64(
    fname: &str,
    types: &[DataType],
    names: &[&str],
    min: usize,
) -> Result<Vec<DataType>> {
    check_arity(fname, types, min, names.len())?;
    types
        .iter()
        .zip(names)
        .map(|(t, a)| coerce_score(fname, a, t))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_equals_one_pass() {
        let xs: Vec<f64> = (0..1000).map(|i| ((i * 7919) % 113) as f64 / 7.0).collect();
        let mut one = Moments::default();
        xs.iter().for_each(|&x| one.push(x));
        let mut parts = [Moments::default(); 7];
        xs.iter()
            .enumerate()
            .for_each(|(i, &x)| parts[i % 7].push(x));
        let mut merged = Moments::default();
        parts.iter().for_each(|p| merged.merge(p));
        assert_eq!(one.n, merged.n);
        assert!((one.mean - merged.mean).abs() < 1e-12);
        assert!((one.m2 - merged.m2).abs() < 1e-9 * one.m2);
    }

    #[test]
    fn z_values() {
        assert!((z_for_level(0.95) - 1.959963984540054).abs() < 1e-9);
        assert!((normal_z(0.2) - 0.8416212335729143).abs() < 1e-9);
        assert!((two_sided_p(1.959963984540054) - 0.05).abs() < 1e-9);
    }
}
