//! The arguments of the clustered aggregates: their coercion, the interval options, the key
//! kind of the cluster column, and the state fields.

use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Field, FieldRef};
use datafusion::common::{Result, ScalarValue, plan_datafusion_err, plan_err};
use datafusion::logical_expr::function::AccumulatorArgs;
use datafusion::logical_expr::utils::format_state_name;

use crate::udaf::cluster_interval::{
    Bootstrap, DEFAULT_REPS, DEFAULT_SEED, IntervalError, IntervalSpec, Method, split_icc,
};
use crate::udaf::cluster_keys::KeyKind;
use crate::udaf::moments_acc::Input;

fn list_of(t: DataType) -> DataType {
    DataType::List(Arc::new(Field::new_list_field(t, true)))
}

/// State fields of the clustered accumulator for cluster keys of `kind` and rows read as
/// `input`.
pub fn state_fields(name: &str, kind: KeyKind, input: Input) -> Vec<FieldRef> {
    let f = |n: &str, t: DataType| Arc::new(Field::new(format_state_name(name, n), t, true));
    let mut fields = vec![
        f("cluster_keys", list_of(kind.state_type())),
        f("cluster_counts", list_of(DataType::UInt64)),
        f("cluster_means", list_of(DataType::Float64)),
        f("cluster_m2s", list_of(DataType::Float64)),
    ];
    if input == Input::Diff {
        fields.push(f("pairs_binary", DataType::Boolean));
    }
    fields
}

/// Whether a score is a pass/fail value.
#[inline(always)]
pub(super) fn is_01(v: f64) -> bool {
    v == 0.0 || v == 1.0
}

/// Coerces `(scores..., cluster [, level])`: `names` names every argument in order, the
/// cluster sits at `cluster_idx`, and arguments after it are numeric constants.
pub fn coerce_args(
    fname: &str,
    types: &[DataType],
    names: &[&str],
    cluster_idx: usize,
) -> Result<Vec<DataType>> {
    crate::udaf::common::check_arity(fname, types, cluster_idx + 1, names.len())?;
    types
        .iter()
        .zip(names)
        .enumerate()
        .map(|(i, (t, a))| {
            if i == cluster_idx {
                crate::udaf::common::coerce_cluster(fname, a, t)
            } else {
                crate::udaf::common::coerce_score(fname, a, t)
            }
        })
        .collect()
}

/// Coerces `(scores..., cluster [, level [, method [, reps [, seed]]]])`: as [`coerce_args`]
/// for the data and `level`; `method` must be a string, `reps` and `seed` numbers.
pub fn coerce_interval_args(
    fname: &str,
    types: &[DataType],
    data_names: &[&str],
    cluster_idx: usize,
) -> Result<Vec<DataType>> {
    let mut names: Vec<&str> = data_names.to_vec();
    names.extend(["level", "method", "reps", "seed"]);
    crate::udaf::common::check_arity(fname, types, cluster_idx + 1, names.len())?;
    let method_idx = cluster_idx + 2;
    types
        .iter()
        .zip(&names)
        .enumerate()
        .map(|(i, (t, a))| {
            if i == cluster_idx {
                crate::udaf::common::coerce_cluster(fname, a, t)
            } else if i == method_idx {
                match t {
                    DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => Ok(t.clone()),
                    other => datafusion::common::plan_err!(
                        "{fname}: method must be a string, one of {}, got {other}",
                        crate::udaf::cluster_interval::Method::accepted()
                    ),
                }
            } else {
                crate::udaf::common::coerce_score(fname, a, t)
            }
        })
        .collect()
}

/// Reads the constant `level, method, reps, seed` arguments starting at `level_idx`.
///
/// `allowed` lists the methods this function accepts; `default` is used when `method` is
/// absent. Errors are plan errors naming the function and the accepted values.
pub fn interval_spec_arg(
    args: &AccumulatorArgs,
    level_idx: usize,
    fname: &str,
    allowed: &[Method],
    default: Method,
) -> Result<IntervalSpec> {
    use crate::udaf::common::{constant_arg, constant_f64};
    let err = |e: IntervalError| plan_datafusion_err!("{fname}: {e}");
    let level = constant_f64(args, level_idx, fname, "level", 0.95)?;
    let mut icc = None;
    let method = match constant_arg(args, level_idx + 1, fname, "method")? {
        None => default,
        Some(
            ScalarValue::Utf8(Some(s))
            | ScalarValue::Utf8View(Some(s))
            | ScalarValue::LargeUtf8(Some(s)),
        ) => {
            let (name, stated) = split_icc(&s).map_err(err)?;
            if stated.is_some() && !allowed.contains(&Method::LogitNormal) {
                return plan_err!(
                    "{fname}: a stated ICC ('; icc=R') applies to the rate of clustered_mean_ci, \
                     not to a paired difference"
                );
            }
            icc = stated;
            Method::parse(name).map_err(err)?
        }
        Some(other) => {
            return plan_err!(
                "{fname}: method must be a non-NULL string, one of {}, got {other}",
                Method::accepted()
            );
        }
    };
    if !allowed.contains(&method) {
        let names: Vec<String> = allowed.iter().map(|m| format!("'{}'", m.name())).collect();
        return Err(err(IntervalError::MethodNotApplicable(
            method.name(),
            names.join(", "),
        )));
    }
    let reps = constant_f64(args, level_idx + 2, fname, "reps", DEFAULT_REPS as f64)?;
    let seed = constant_f64(args, level_idx + 3, fname, "seed", DEFAULT_SEED as f64)?;
    let bootstrap = Bootstrap::new(reps, seed).map_err(err)?;
    IntervalSpec::new(method, level, bootstrap)
        .and_then(|s| s.with_icc(icc))
        .map_err(err)
}

/// The key kind of the (coerced) cluster argument at `idx`.
pub fn key_kind(fields: &[FieldRef], idx: usize) -> KeyKind {
    fields
        .get(idx)
        .map_or(KeyKind::Str, |f| KeyKind::of(f.data_type()))
}
