//! The shared accumulator of the clustered statistics: per group, the overall [`Moments`] and
//! one [`Moments`] per cluster.
//!
//! `clustered_se`, `clustered_se_cr1`, `clustered_mean_ci`, `paired_diff_clustered` and
//! `variance_components` all need, per group, per-cluster counts and means; they differ in
//! how a row becomes a value ([`Input`]) and in the `finish` function.
//!
//! State: four lists aligned by cluster: `keys` (Int64 or Utf8), `counts` (UInt64), `means`
//! and `m2s` (Float64). The group's overall moments are the merge of its clusters' moments,
//! computed once when a group is emitted, so the per-row loop updates one cell only.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, Float64Array, ListArray, UInt64Array,
};
use datafusion::arrow::buffer::OffsetBuffer;
use datafusion::arrow::compute::{cast, filter};
use datafusion::arrow::datatypes::{DataType, Field, FieldRef};
use datafusion::common::cast::{as_float64_array, as_list_array, as_uint64_array};
use datafusion::common::{HashMap, Result, ScalarValue, plan_datafusion_err, plan_err};
use datafusion::logical_expr::function::AccumulatorArgs;
use datafusion::logical_expr::utils::format_state_name;
use datafusion::logical_expr::{EmitTo, GroupsAccumulator};

use super::cluster_interval::{
    Bootstrap, DEFAULT_REPS, DEFAULT_SEED, IntervalError, IntervalSpec, Method,
};
use super::cluster_keys::{Cell, ClusterTable, KeyKind, NO_GROUP, NULL_KEY};
use super::common::{Moments, f64_array, filter_ok};
use super::moments_acc::Input;
use super::single_group::Grow;

/// One group's partial sums: overall moments and per-cluster moments.
#[derive(Debug, Clone, Default)]
pub struct GroupCells {
    /// Moments over every row of the group (filled when the group is emitted).
    pub total: Moments,
    /// `(cluster id, moments of that cluster)`.
    pub cells: Vec<(u32, Moments)>,
}

impl GroupCells {
    /// Number of clusters.
    pub fn n_clusters(&self) -> usize {
        self.cells.len()
    }

    /// `sum over clusters of (sum over i in the cluster of (x_i - mean))^2`.
    pub fn cluster_score_sq(&self) -> f64 {
        let m = self.total.mean;
        self.cells
            .iter()
            .map(|(_, c)| {
                let s = c.n as f64 * (c.mean - m);
                s * s
            })
            .sum()
    }

    /// Miller's clustered SE: sqrt(mean_se^2 + (1/n^2) sum_c sum_{i != j in c} (x_i - m)(x_j - m)).
    ///
    /// With `A = sum_c (sum_{i in c} (x_i - m))^2` the cross terms are `A - m2`, so
    /// `SE^2 = m2 / (n (n - 1)) + (A - m2) / n^2 = A / n^2 + m2 / (n^2 (n - 1))`, which has no
    /// cancellation and is never negative. `None` below two rows or two clusters.
    pub fn miller_se(&self) -> Option<f64> {
        let n = self.total.n;
        if n < 2 || self.n_clusters() < 2 {
            return None;
        }
        let nf = n as f64;
        let var =
            self.cluster_score_sq() / (nf * nf) + self.total.m2.max(0.0) / (nf * nf * (nf - 1.0));
        super::common::finite(var.sqrt())
    }

    /// The per-cluster moments, without the cluster ids.
    pub fn moments(&self) -> Vec<Moments> {
        self.cells.iter().map(|(_, m)| *m).collect()
    }

    /// The mean with its interval by `spec` (see [`super::cluster_interval::cluster_interval`]).
    pub fn interval(&self, spec: &IntervalSpec) -> super::cluster_interval::ClusterInterval {
        super::cluster_interval::cluster_interval(&self.moments(), spec)
    }

    /// CR1 cluster-robust SE: sqrt(G / (G - 1) * A) / n. `None` below two clusters.
    pub fn cr1_se(&self) -> Option<f64> {
        let g = self.n_clusters();
        if g < 2 {
            return None;
        }
        let gf = g as f64;
        super::common::finite(
            (gf / (gf - 1.0) * self.cluster_score_sq()).sqrt() / self.total.n as f64,
        )
    }
}

/// Turns final per-group cells into the result column.
pub type ClusterFinish = Arc<dyn Fn(&[GroupCells]) -> Result<ArrayRef> + Send + Sync>;

fn list_of(t: DataType) -> DataType {
    DataType::List(Arc::new(Field::new_list_field(t, true)))
}

/// State fields of the clustered accumulator for cluster keys of `kind`.
pub fn state_fields(name: &str, kind: KeyKind) -> Vec<FieldRef> {
    let f = |n: &str, t: DataType| Arc::new(Field::new(format_state_name(name, n), t, true));
    vec![
        f("cluster_keys", list_of(kind.state_type())),
        f("cluster_counts", list_of(DataType::UInt64)),
        f("cluster_means", list_of(DataType::Float64)),
        f("cluster_m2s", list_of(DataType::Float64)),
    ]
}

/// Coerces `(scores..., cluster [, level])`: `names` names every argument in order, the
/// cluster sits at `cluster_idx`, and arguments after it are numeric constants.
pub fn coerce_args(
    fname: &str,
    types: &[DataType],
    names: &[&str],
    cluster_idx: usize,
) -> Result<Vec<DataType>> {
    super::common::check_arity(fname, types, cluster_idx + 1, names.len())?;
    types
        .iter()
        .zip(names)
        .enumerate()
        .map(|(i, (t, a))| {
            if i == cluster_idx {
                super::common::coerce_cluster(fname, a, t)
            } else {
                super::common::coerce_score(fname, a, t)
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
    super::common::check_arity(fname, types, cluster_idx + 1, names.len())?;
    let method_idx = cluster_idx + 2;
    types
        .iter()
        .zip(&names)
        .enumerate()
        .map(|(i, (t, a))| {
            if i == cluster_idx {
                super::common::coerce_cluster(fname, a, t)
            } else if i == method_idx {
                match t {
                    DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => Ok(t.clone()),
                    other => datafusion::common::plan_err!(
                        "{fname}: method must be a string, one of {}, got {other}",
                        super::cluster_interval::Method::accepted()
                    ),
                }
            } else {
                super::common::coerce_score(fname, a, t)
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
    use super::common::{constant_arg, constant_f64};
    let err = |e: IntervalError| plan_datafusion_err!("{fname}: {e}");
    let level = constant_f64(args, level_idx, fname, "level", 0.95)?;
    let method = match constant_arg(args, level_idx + 1, fname, "method")? {
        None => default,
        Some(
            ScalarValue::Utf8(Some(s))
            | ScalarValue::Utf8View(Some(s))
            | ScalarValue::LargeUtf8(Some(s)),
        ) => Method::parse(&s).map_err(err)?,
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
    IntervalSpec::new(method, level, bootstrap).map_err(err)
}

/// The key kind of the (coerced) cluster argument at `idx`.
pub fn key_kind(fields: &[FieldRef], idx: usize) -> KeyKind {
    fields
        .get(idx)
        .map_or(KeyKind::Str, |f| KeyKind::of(f.data_type()))
}

#[inline]
fn slot_key(group: usize, cluster: u32) -> u64 {
    ((group as u64) << 32) | cluster as u64
}

/// Per-group, per-cluster moments.
#[derive(Clone)]
pub struct ClusteredGroups {
    input: Input,
    /// Per cluster: its key, dense id, and the group accumulating it inline with its sums.
    /// Rows of a cluster usually fall in one group (a template belongs to one test; without
    /// GROUP BY there is one group), so a row costs one (prefetched) slot access; a row of
    /// another group spills the inline sums into that group's `cells` (a hash lookup) and
    /// takes the slot over.
    table: ClusterTable,
    groups: Vec<GroupCells>,
    /// (group, cluster id) -> position in that group's `cells`.
    index: HashMap<u64, u32>,
    n_cells: usize,
    keys: Vec<u128>,
    finish: ClusterFinish,
}

impl fmt::Debug for ClusteredGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusteredGroups")
            .field("input", &self.input)
            .field("groups", &self.groups.len())
            .field("cells", &self.n_cells)
            .finish()
    }
}

impl ClusteredGroups {
    /// A new accumulator for cluster keys of `kind`.
    pub fn new(input: Input, kind: KeyKind, finish: ClusterFinish) -> Self {
        Self {
            input,
            table: ClusterTable::new(kind),
            groups: Vec::new(),
            index: HashMap::default(),
            n_cells: 0,
            keys: Vec::new(),
            finish,
        }
    }

    /// Folds the inline sums in slot `s` into their group's cells.
    fn spill(&mut self, s: usize) {
        let slot = *self.table.at(s);
        if slot.cell.group != NO_GROUP {
            let g = slot.cell.group as usize;
            let p = self.slot_slow(g, slot.id);
            self.groups[g].cells[p].1.merge(&slot.cell.moments());
            self.table.at(s).cell = Cell::EMPTY;
        }
    }

    /// Spills every inline cell, so `groups` holds all partial sums.
    fn spill_all(&mut self) {
        let occupied: Vec<usize> = self.table.occupied().collect();
        for s in occupied {
            self.spill(s);
        }
    }

    fn slot_slow(&mut self, group: usize, cid: u32) -> usize {
        let groups = &mut self.groups;
        let n_cells = &mut self.n_cells;
        *self.index.entry(slot_key(group, cid)).or_insert_with(|| {
            let cells = &mut groups[group].cells;
            cells.push((cid, Moments::default()));
            *n_cells += 1;
            (cells.len() - 1) as u32
        }) as usize
    }

    fn take(&mut self, emit_to: EmitTo) -> Vec<GroupCells> {
        self.spill_all();
        let mut out = emit_to.take_needed(&mut self.groups);
        for g in &mut out {
            let mut total = Moments::default();
            g.cells.iter().for_each(|(_, m)| total.merge(m));
            g.total = total;
        }
        self.index.clear();
        self.table.reset_cells();
        match emit_to {
            EmitTo::All => {
                self.table.clear();
                self.n_cells = 0;
            }
            EmitTo::First(_) => {
                self.n_cells = 0;
                for (g, gc) in self.groups.iter().enumerate() {
                    for (p, (cid, _)) in gc.cells.iter().enumerate() {
                        self.index.insert(slot_key(g, *cid), p as u32);
                    }
                    self.n_cells += gc.cells.len();
                }
            }
        }
        out
    }
}

impl Grow for ClusteredGroups {
    fn grow(&mut self, total_num_groups: usize) {
        if self.groups.len() < total_num_groups {
            self.groups
                .resize_with(total_num_groups, GroupCells::default);
        }
    }
}

impl GroupsAccumulator for ClusteredGroups {
    fn update_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        opt_filter: Option<&BooleanArray>,
        total_num_groups: usize,
    ) -> Result<()> {
        self.grow(total_num_groups);
        let x = self.input.values(values)?;
        let x = f64_array(&x)?;
        let mut keys = std::mem::take(&mut self.keys);
        self.table
            .keys_of(&values[self.input.cluster_idx()], &mut keys)?;
        let dense_input = x.null_count() == 0 && opt_filter.is_none();
        // Keys are known ahead: prefetch a slot a few rows early, since with tens of
        // thousands of clusters the table does not fit in L2.
        const AHEAD: usize = 16;
        for (i, (&g, &v)) in group_indices.iter().zip(x.values().iter()).enumerate() {
            if let Some(&ahead) = keys.get(i + AHEAD) {
                self.table.prefetch(ahead);
            }
            let key = keys[i];
            if key == NULL_KEY
                || v.is_nan()
                || !(dense_input || (x.is_valid(i) && filter_ok(opt_filter, i)))
            {
                continue;
            }
            let s = self.table.slot(key);
            let cell = &mut self.table.at(s).cell;
            // The u32 count spills before it could overflow.
            if cell.group as usize == g && cell.n < u32::MAX {
                cell.push(v);
            } else {
                self.spill(s);
                self.table.at(s).cell = Cell::start(g, v);
            }
        }
        self.keys = keys;
        Ok(())
    }

    fn merge_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        total_num_groups: usize,
    ) -> Result<()> {
        self.grow(total_num_groups);
        let keys = as_list_array(&values[0])?;
        let counts = as_list_array(&values[1])?;
        let means = as_list_array(&values[2])?;
        let m2s = as_list_array(&values[3])?;
        let (ko, co, mo, m2o) = (
            keys.value_offsets(),
            counts.value_offsets(),
            means.value_offsets(),
            m2s.value_offsets(),
        );
        let cv = as_uint64_array(counts.values())?;
        let mv = as_float64_array(means.values())?;
        let m2v = as_float64_array(m2s.values())?;
        let start = ko[0] as usize;
        let end = ko[keys.len()] as usize;
        let mut ids = std::mem::take(&mut self.keys);
        self.table
            .keys_of(&keys.values().slice(start, end - start), &mut ids)?;
        for (i, &g) in group_indices.iter().enumerate() {
            if keys.is_null(i) {
                continue;
            }
            let len = (ko[i + 1] - ko[i]) as usize;
            for j in 0..len {
                let key = ids[ko[i] as usize - start + j];
                if key == NULL_KEY {
                    continue;
                }
                let s = self.table.slot(key);
                let cid = self.table.at(s).id;
                let cell = Moments {
                    n: cv.value(co[i] as usize + j),
                    mean: mv.value(mo[i] as usize + j),
                    m2: m2v.value(m2o[i] as usize + j),
                };
                let p = self.slot_slow(g, cid);
                self.groups[g].cells[p].1.merge(&cell);
            }
        }
        self.keys = ids;
        Ok(())
    }

    fn evaluate(&mut self, emit_to: EmitTo) -> Result<ArrayRef> {
        let groups = self.take(emit_to);
        (self.finish)(&groups)
    }

    fn state(&mut self, emit_to: EmitTo) -> Result<Vec<ArrayRef>> {
        self.spill_all();
        // Keys must be resolved before `take` may clear the table.
        let n_emit = match emit_to {
            EmitTo::All => self.groups.len(),
            EmitTo::First(k) => k,
        };
        let emitted = &self.groups[..n_emit];
        let offsets = OffsetBuffer::<i32>::from_lengths(emitted.iter().map(|g| g.cells.len()));
        let cells = || emitted.iter().flat_map(|g| g.cells.iter());
        let keys = self.table.keys_array(cells().map(|(cid, _)| *cid));
        let counts: ArrayRef = Arc::new(UInt64Array::from_iter_values(cells().map(|(_, m)| m.n)));
        let means: ArrayRef =
            Arc::new(Float64Array::from_iter_values(cells().map(|(_, m)| m.mean)));
        let m2s: ArrayRef = Arc::new(Float64Array::from_iter_values(cells().map(|(_, m)| m.m2)));
        let list = |v: ArrayRef| -> ArrayRef {
            let field = Arc::new(Field::new_list_field(v.data_type().clone(), true));
            Arc::new(ListArray::new(field, offsets.clone(), v, None))
        };
        let out = vec![list(keys), list(counts), list(means), list(m2s)];
        self.take(emit_to);
        Ok(out)
    }

    fn convert_to_state(
        &self,
        values: &[ArrayRef],
        opt_filter: Option<&BooleanArray>,
    ) -> Result<Vec<ArrayRef>> {
        let x = self.input.values(values)?;
        let x = f64_array(&x)?;
        let cluster = &values[self.input.cluster_idx()];
        let len = x.len();
        let mask: BooleanArray = (0..len)
            .map(|i| {
                Some(
                    x.is_valid(i)
                        && !x.value(i).is_nan()
                        && cluster.is_valid(i)
                        && filter_ok(opt_filter, i),
                )
            })
            .collect();
        let keys = filter(&cast(cluster, &self.table.kind().state_type())?, &mask)?;
        let kept = keys.len();
        let offsets = OffsetBuffer::<i32>::from_lengths(mask.values().iter().map(usize::from));
        let list = |v: ArrayRef| -> ArrayRef {
            let field = Arc::new(Field::new_list_field(v.data_type().clone(), true));
            Arc::new(ListArray::new(field, offsets.clone(), v, None))
        };
        let xs = filter(x, &mask)?;
        Ok(vec![
            list(keys),
            list(Arc::new(UInt64Array::from(vec![1u64; kept]))),
            list(xs),
            list(Arc::new(Float64Array::from(vec![0.0; kept]))),
        ])
    }

    fn size(&self) -> usize {
        self.groups.capacity() * size_of::<GroupCells>()
            + self.n_cells * (size_of::<(u32, Moments)>() + 16)
            + self.index.capacity() * 16
            + self.table.size()
            + self.keys.capacity() * 16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cells(rows: &[(u32, f64)]) -> GroupCells {
        let mut g = GroupCells::default();
        for &(c, x) in rows {
            g.total.push(x);
            match g.cells.iter_mut().find(|(id, _)| *id == c) {
                Some((_, m)) => m.push(x),
                None => {
                    let mut m = Moments::default();
                    m.push(x);
                    g.cells.push((c, m));
                }
            }
        }
        g
    }

    /// Miller's formula term by term, O(n^2).
    fn miller_brute(rows: &[(u32, f64)]) -> f64 {
        let n = rows.len() as f64;
        let m = rows.iter().map(|r| r.1).sum::<f64>() / n;
        let var = rows.iter().map(|r| (r.1 - m).powi(2)).sum::<f64>() / (n - 1.0);
        let mut cross = 0.0;
        for (i, a) in rows.iter().enumerate() {
            for (j, b) in rows.iter().enumerate() {
                if i != j && a.0 == b.0 {
                    cross += (a.1 - m) * (b.1 - m);
                }
            }
        }
        (var / n + cross / (n * n)).sqrt()
    }

    #[test]
    fn miller_matches_brute_force() {
        let rows: Vec<(u32, f64)> = (0..60)
            .map(|i| ((i % 7) as u32, (((i * 31) % 11) as f64) / 10.0))
            .collect();
        let g = cells(&rows);
        assert!((g.miller_se().unwrap() - miller_brute(&rows)).abs() < 1e-12);
        let singles: Vec<(u32, f64)> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| (i as u32, r.1))
            .collect();
        let g = cells(&singles);
        assert!((g.miller_se().unwrap() - g.total.mean_se().unwrap()).abs() < 1e-12);
    }
}
