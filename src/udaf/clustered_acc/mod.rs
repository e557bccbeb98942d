//! The shared accumulator of the clustered statistics: per group, the overall [`Moments`] and
//! one [`Moments`] per cluster.
//!
//! `clustered_se`, `clustered_se_cr1`, `clustered_mean_ci`, `paired_diff_clustered` and
//! `variance_components` all need, per group, per-cluster counts and means; they differ in
//! how a row becomes a value ([`Input`]) and in the `finish` function.
//!
//! State: four lists aligned by cluster: `keys` (Int64 or Utf8), `counts` (UInt64), `means`
//! and `m2s` (Float64); for a difference ([`Input::Diff`]) also `pairs_binary` (Boolean), whether
//! every pair of the group was 0/1, which per-cluster moments of `a - b` cannot tell. The
//! group's overall moments are the merge of its clusters' moments, computed once when a group
//! is emitted, so the per-row loop updates one cell only.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, Float64Array, ListArray, UInt64Array,
};
use datafusion::arrow::buffer::{NullBuffer, OffsetBuffer};
use datafusion::arrow::compute::{cast, concat, filter};
use datafusion::arrow::datatypes::Field;
use datafusion::common::Result;
use datafusion::common::cast::{
    as_boolean_array, as_float64_array, as_list_array, as_uint64_array,
};
use datafusion::logical_expr::{EmitTo, GroupsAccumulator};

mod args;
mod cells;

pub use args::*;
use cells::*;

use super::cluster_interval::IntervalSpec;
use super::cluster_keys::{ClusterTable, KeyKind, NULL_ID};
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
    /// [`Input::Diff`] only: every pair `(a, b)` of the group was 0 or 1 (pass/fail pairs).
    pub pairs_binary: bool,
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

    /// The mean difference with its interval by `spec` (see
    /// [`super::cluster_interval::paired_interval`]).
    pub fn paired_interval(&self, spec: &IntervalSpec) -> super::cluster_interval::ClusterInterval {
        super::cluster_interval::paired_interval(&self.moments(), spec, self.pairs_binary)
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

/// Per-group, per-cluster moments.
#[derive(Clone)]
pub struct ClusteredGroups {
    input: Input,
    /// Cluster keys to dense cluster ids.
    table: ClusterTable,
    cells: Cells,
    n_groups: usize,
    /// [`Input::Diff`] only: per group, every pair so far was 0/1 (see [`GroupCells::pairs_binary`]).
    pairs_binary: Vec<bool>,
    /// Per-batch scratch: each row's cluster id.
    ids: Vec<u32>,
    /// Per-batch scratch of [`Input::Diff`]: each row's `a - b`.
    diff: Vec<f64>,
    finish: ClusterFinish,
}

impl fmt::Debug for ClusteredGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusteredGroups")
            .field("input", &self.input)
            .field("groups", &self.n_groups)
            .field("clusters", &self.table.len())
            .finish()
    }
}

impl ClusteredGroups {
    /// A new accumulator for cluster keys of `kind`.
    pub fn new(input: Input, kind: KeyKind, finish: ClusterFinish) -> Self {
        Self {
            input,
            table: ClusterTable::new(kind),
            cells: Cells::default(),
            n_groups: 0,
            pairs_binary: Vec::new(),
            ids: Vec::new(),
            diff: Vec::new(),
            finish,
        }
    }

    /// Takes the groups `emit_to` names, with their totals; later groups move down. The
    /// cluster table is kept (the caller may still need keys of the emitted cells).
    ///
    /// The groups kept are rebuilt into cells sized for the cells they hold, so a full matrix
    /// stays dense: rebuilt from an empty map, the merge after a spill (an ordered final
    /// aggregate emitting group by group) made a 10M-row `GROUP BY model` with 1.25M
    /// templates take 57 s instead of 5. Emitting no group leaves the cells untouched.
    fn take(&mut self, emit_to: EmitTo) -> Vec<GroupCells> {
        if matches!(emit_to, EmitTo::First(0)) || self.n_groups == 0 {
            return Vec::new();
        }
        let mut groups = vec![GroupCells::default(); self.n_groups];
        for (g, c, m) in self.cells.drain() {
            groups[g].cells.push((c, m));
        }
        if self.input == Input::Diff {
            for (g, b) in groups.iter_mut().zip(&self.pairs_binary) {
                g.pairs_binary = *b;
            }
            emit_to.take_needed(&mut self.pairs_binary);
        }
        let out = emit_to.take_needed(&mut groups);
        self.n_groups = groups.len();
        if !groups.is_empty() {
            let kept: usize = groups.iter().map(|g| g.cells.len()).sum();
            self.cells.reserve(self.n_groups, self.table.len(), kept);
            for (g, gc) in groups.iter().enumerate() {
                for (c, m) in &gc.cells {
                    self.cells.get(g, *c).merge(m);
                }
            }
        }
        out.into_iter()
            .map(|mut g| {
                g.cells.sort_unstable_by_key(|(c, _)| *c);
                g.total = Moments::default();
                for (_, m) in &g.cells {
                    g.total.merge(m);
                }
                g
            })
            .collect()
    }

    /// Every group's result from the dense matrix, a chunk of groups at a time: only one
    /// chunk's cells are ever copied out of the matrix (with hundreds of thousands of
    /// clusters per group, a copy of every group's cells would double the peak).
    fn evaluate_dense(&mut self) -> Result<ArrayRef> {
        // Small under test, so the unit tests' few hundred cells take several chunks.
        const CHUNK_CELLS: usize = if cfg!(test) { 64 } else { 1 << 20 };
        let mut parts = Vec::new();
        let mut chunk: Vec<GroupCells> = Vec::new();
        let mut in_chunk = 0;
        for g in 0..self.n_groups {
            let mut gc = self.cells.group(g);
            gc.pairs_binary = self.pairs_binary.get(g).copied().unwrap_or(false);
            in_chunk += gc.cells.len();
            chunk.push(gc);
            if in_chunk >= CHUNK_CELLS {
                parts.push((self.finish)(&std::mem::take(&mut chunk))?);
                in_chunk = 0;
            }
        }
        if !chunk.is_empty() || parts.is_empty() {
            parts.push((self.finish)(&chunk)?);
        }
        self.cells = Cells::default();
        self.n_groups = 0;
        self.pairs_binary.clear();
        self.forget_clusters_if_empty();
        if parts.len() == 1 {
            return Ok(parts.pop().expect("one part"));
        }
        let refs: Vec<&dyn Array> = parts.iter().map(|a| a.as_ref()).collect();
        Ok(concat(&refs)?)
    }

    fn forget_clusters_if_empty(&mut self) {
        if self.n_groups == 0 {
            self.table.clear();
        }
    }
}

impl Grow for ClusteredGroups {
    fn grow(&mut self, total_num_groups: usize) {
        self.n_groups = self.n_groups.max(total_num_groups);
        if self.input == Input::Diff {
            self.pairs_binary.resize(self.n_groups, true);
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
        let mut ids = std::mem::take(&mut self.ids);
        self.table
            .ids_of(&values[self.input.cluster_idx()], &mut ids)?;
        self.cells.reserve(self.n_groups, self.table.len(), 0);
        // A difference is computed into a buffer kept between batches, not a new array
        // per batch; a row is used when both of its scores are.
        let mut diff = std::mem::take(&mut self.diff);
        let (xs, valid): (&[f64], Option<NullBuffer>) = match self.input {
            Input::Single => {
                let x = f64_array(&values[0])?;
                (x.values(), x.nulls().cloned())
            }
            Input::Diff => {
                let (a, b) = (f64_array(&values[0])?, f64_array(&values[1])?);
                diff.clear();
                diff.extend(a.values().iter().zip(b.values()).map(|(a, b)| a - b));
                (&diff, NullBuffer::union(a.nulls(), b.nulls()))
            }
        };
        let rows = Rows {
            ids: &ids,
            xs,
            valid: valid.as_ref().filter(|v| v.null_count() > 0),
            filter: opt_filter,
        };
        self.cells.push_rows(group_indices, &rows);
        if self.input == Input::Diff && self.pairs_binary.contains(&true) {
            let (a, b) = (
                f64_array(&values[0])?.values(),
                f64_array(&values[1])?.values(),
            );
            // Usually every value of the batch is 0 or 1 (used or not), and then no group
            // stops being binary: one pass the compiler vectorizes (no early exit) settles
            // it, instead of a test per row and group.
            let all_01 = |v: &[f64]| v.iter().fold(true, |ok, &x| ok & is_01(x));
            if !(all_01(a) && all_01(b)) {
                for (i, &g) in group_indices.iter().enumerate() {
                    if !(is_01(a[i]) && is_01(b[i])) && self.pairs_binary[g] && rows.keep(i) {
                        self.pairs_binary[g] = false;
                    }
                }
            }
        }
        self.diff = diff;
        self.ids = ids;
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
        let mut ids = std::mem::take(&mut self.ids);
        self.table
            .ids_of(&keys.values().slice(start, end - start), &mut ids)?;
        self.cells
            .reserve(self.n_groups, self.table.len(), end - start);
        for (i, &g) in group_indices.iter().enumerate() {
            if keys.is_null(i) {
                continue;
            }
            let len = (ko[i + 1] - ko[i]) as usize;
            for j in 0..len {
                let id = ids[ko[i] as usize - start + j];
                if id == NULL_ID {
                    continue;
                }
                let cell = Moments {
                    n: cv.value(co[i] as usize + j),
                    mean: mv.value(mo[i] as usize + j),
                    m2: m2v.value(m2o[i] as usize + j),
                };
                self.cells.get(g, id).merge(&cell);
            }
        }
        if self.input == Input::Diff {
            let binary = as_boolean_array(&values[4])?;
            for (i, &g) in group_indices.iter().enumerate() {
                if binary.is_valid(i) && !binary.value(i) {
                    self.pairs_binary[g] = false;
                }
            }
        }
        self.ids = ids;
        Ok(())
    }

    fn evaluate(&mut self, emit_to: EmitTo) -> Result<ArrayRef> {
        if matches!(emit_to, EmitTo::All) && matches!(self.cells, Cells::Dense { .. }) {
            return self.evaluate_dense();
        }
        let groups = self.take(emit_to);
        self.forget_clusters_if_empty();
        (self.finish)(&groups)
    }

    fn state(&mut self, emit_to: EmitTo) -> Result<Vec<ArrayRef>> {
        let emitted = self.take(emit_to);
        let offsets = OffsetBuffer::<i32>::from_lengths(emitted.iter().map(|g| g.cells.len()));
        let cells = || emitted.iter().flat_map(|g| g.cells.iter());
        let keys = self.table.keys_array(cells().map(|(cid, _)| *cid));
        self.forget_clusters_if_empty();
        let counts: ArrayRef = Arc::new(UInt64Array::from_iter_values(cells().map(|(_, m)| m.n)));
        let means: ArrayRef =
            Arc::new(Float64Array::from_iter_values(cells().map(|(_, m)| m.mean)));
        let m2s: ArrayRef = Arc::new(Float64Array::from_iter_values(cells().map(|(_, m)| m.m2)));
        let list = |v: ArrayRef| -> ArrayRef {
            let field = Arc::new(Field::new_list_field(v.data_type().clone(), true));
            Arc::new(ListArray::new(field, offsets.clone(), v, None))
        };
        let mut state = vec![list(keys), list(counts), list(means), list(m2s)];
        if self.input == Input::Diff {
            let binary: BooleanArray = emitted.iter().map(|g| Some(g.pairs_binary)).collect();
            state.push(Arc::new(binary));
        }
        Ok(state)
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
        let mut state = vec![
            list(keys),
            list(Arc::new(UInt64Array::from(vec![1u64; kept]))),
            list(xs),
            list(Arc::new(Float64Array::from(vec![0.0; kept]))),
        ];
        if self.input == Input::Diff {
            let (a, b) = (f64_array(&values[0])?, f64_array(&values[1])?);
            let binary: BooleanArray = (0..len)
                .map(|i| {
                    let used = mask.value(i);
                    Some(!used || (is_01(a.value(i)) && is_01(b.value(i))))
                })
                .collect();
            state.push(Arc::new(binary));
        }
        Ok(state)
    }

    fn size(&self) -> usize {
        self.cells.size() + self.table.size() + self.ids.capacity() * 4
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

    fn miller_finish() -> ClusterFinish {
        Arc::new(|g: &[GroupCells]| {
            Ok(Arc::new(
                g.iter()
                    .map(GroupCells::miller_se)
                    .collect::<Float64Array>(),
            ) as ArrayRef)
        })
    }

    /// Rows `(group, cluster, x)` through `update_batch` in batches, then every group's
    /// Miller SE against the brute-force one; `first` emits the first groups early.
    fn check_groups(n_groups: usize, n_clusters: u64, rows: usize, first: Option<usize>) {
        use datafusion::arrow::array::Int64Array;
        let data: Vec<(usize, i64, f64)> = (0..rows as u64)
            .map(|i| {
                let r = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20;
                let g = (r % n_groups as u64) as usize;
                // Each cluster falls in a few groups only when groups are many.
                let c = ((r >> 24) % n_clusters + g as u64 * 7) % (n_clusters * 3);
                (g, c as i64, ((r >> 8) % 13) as f64 / 4.0)
            })
            .collect();
        let mut acc = ClusteredGroups::new(Input::Single, KeyKind::Int, miller_finish());
        for chunk in data.chunks(4096) {
            let x: ArrayRef = Arc::new(chunk.iter().map(|r| r.2).collect::<Float64Array>());
            let c: ArrayRef = Arc::new(chunk.iter().map(|r| r.1).collect::<Int64Array>());
            let g: Vec<usize> = chunk.iter().map(|r| r.0).collect();
            acc.update_batch(&[x, c], &g, None, n_groups).unwrap();
        }
        let sparse = matches!(acc.cells, Cells::Sparse(_));
        let mut got: Vec<Option<f64>> = Vec::new();
        if let Some(k) = first {
            let a = acc.evaluate(EmitTo::First(k)).unwrap();
            got.extend(a.as_any().downcast_ref::<Float64Array>().unwrap().iter());
        }
        let a = acc.evaluate(EmitTo::All).unwrap();
        got.extend(a.as_any().downcast_ref::<Float64Array>().unwrap().iter());
        assert_eq!(got.len(), n_groups, "sparse {sparse}");
        for (g, se) in got.iter().enumerate() {
            let rows: Vec<(u32, f64)> = data
                .iter()
                .filter(|r| r.0 == g)
                .map(|r| (r.1 as u32, r.2))
                .collect();
            let want = if rows.len() < 2 {
                None
            } else {
                cells(&rows).miller_se()
            };
            match (se, want) {
                (Some(a), Some(b)) => assert!((a - b).abs() < 1e-12, "group {g}: {a} vs {b}"),
                (a, b) => assert_eq!(*a, b, "group {g}"),
            }
        }
    }

    /// A group stays binary while every pair it uses is 0/1: a batch all 0/1 leaves every
    /// group as it was, and in a mixed batch only a used row (not filtered out, not NULL)
    /// with a value other than 0 or 1 makes its group non-binary.
    #[test]
    fn pairs_stay_binary_until_a_used_pair_is_not() {
        use datafusion::arrow::array::Int64Array;
        let finish: ClusterFinish = Arc::new(|g: &[GroupCells]| {
            Ok(Arc::new(
                g.iter()
                    .map(|c| Some(f64::from(u8::from(c.pairs_binary))))
                    .collect::<Float64Array>(),
            ) as ArrayRef)
        });
        let mut acc = ClusteredGroups::new(Input::Diff, KeyKind::Int, finish);
        let batch = |acc: &mut ClusteredGroups,
                     rows: &[(usize, Option<f64>, f64)],
                     filter: Option<&BooleanArray>| {
            let a: ArrayRef = Arc::new(rows.iter().map(|r| r.1).collect::<Float64Array>());
            let b: ArrayRef = Arc::new(rows.iter().map(|r| Some(r.2)).collect::<Float64Array>());
            let c: ArrayRef = Arc::new((0..rows.len() as i64).collect::<Int64Array>());
            let g: Vec<usize> = rows.iter().map(|r| r.0).collect();
            acc.update_batch(&[a, b, c], &g, filter, 4).unwrap();
        };
        batch(
            &mut acc,
            &[
                (0, Some(1.0), 0.0),
                (1, Some(0.0), 1.0),
                (2, Some(1.0), 1.0),
                (3, Some(0.0), 0.0),
            ],
            None,
        );
        let mixed = [
            (0, Some(1.0), 1.0),
            (1, Some(0.5), 1.0),
            (2, Some(0.5), 0.0),
            (3, None, 2.0),
        ];
        let keep = BooleanArray::from(vec![true, true, false, true]);
        batch(&mut acc, &mixed, Some(&keep));
        let got = acc.evaluate(EmitTo::All).unwrap();
        let got: Vec<Option<f64>> = got
            .as_any()
            .downcast_ref::<Float64Array>()
            .unwrap()
            .iter()
            .collect();
        assert_eq!(got, [Some(1.0), Some(0.0), Some(1.0), Some(1.0)]);
    }

    #[test]
    fn dense_and_sparse_cells_match_brute_force() {
        // Few groups: a dense matrix; many groups over many clusters: the hash map.
        check_groups(3, 50, 20_000, None);
        check_groups(3, 50, 20_000, Some(1));
        check_groups(2_000, 1_000, 60_000, None);
        check_groups(2_000, 1_000, 60_000, Some(700));
    }

    /// The same rows as Utf8 keys and as dictionary keys (a new dictionary per batch in
    /// another order, NULL keys, a NULL dictionary value, batches that reuse the previous
    /// dictionary): identical partial states and results.
    #[test]
    fn dictionary_keys_match_utf8_keys() {
        use datafusion::arrow::array::{DictionaryArray, Int32Array, StringArray};
        use datafusion::arrow::datatypes::Int32Type;
        const KEYS: u64 = 700;
        let rows: Vec<(usize, Option<u64>, f64)> = (0..30_000u64)
            .map(|i| {
                let r = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 16;
                let key = (!r.is_multiple_of(31)).then_some((r >> 8) % KEYS);
                ((r % 5) as usize, key, ((r >> 20) % 7) as f64 / 6.0)
            })
            .collect();
        let name = |k: u64| format!("suite/test-{:03}/t{k}", k % 40);
        let mut utf8 = ClusteredGroups::new(Input::Single, KeyKind::Str, miller_finish());
        let mut dict = ClusteredGroups::new(Input::Single, KeyKind::Str, miller_finish());
        // Dictionary values: every key, rotated by `shift`, with a NULL value at `KEYS`.
        let mut values: ArrayRef = Arc::new(StringArray::from(Vec::<&str>::new()));
        let mut shift = 0;
        for (b, chunk) in rows.chunks(3_000).enumerate() {
            let x: ArrayRef = Arc::new(chunk.iter().map(|r| r.2).collect::<Float64Array>());
            let g: Vec<usize> = chunk.iter().map(|r| r.0).collect();
            let plain: ArrayRef =
                Arc::new(chunk.iter().map(|r| r.1.map(name)).collect::<StringArray>());
            utf8.update_batch(&[Arc::clone(&x), plain], &g, None, 5)
                .unwrap();
            if b % 3 != 2 {
                shift = b as u64 * 37 % KEYS;
                let mut v: Vec<Option<String>> =
                    (0..KEYS).map(|j| Some(name((j + shift) % KEYS))).collect();
                v.push(None);
                values = Arc::new(StringArray::from(v));
            }
            let idx: Int32Array = chunk
                .iter()
                .enumerate()
                .map(|(i, r)| match r.1 {
                    Some(k) => Some(((k + KEYS - shift) % KEYS) as i32),
                    // Half the missing keys are NULL keys, half index the NULL value.
                    None => (i % 2 == 1).then_some(KEYS as i32),
                })
                .collect();
            let d: ArrayRef = Arc::new(DictionaryArray::<Int32Type>::new(idx, Arc::clone(&values)));
            dict.update_batch(&[x, d], &g, None, 5).unwrap();
        }
        // Cluster ids follow first sight, which differs (a dictionary is looked up in value
        // order), so the cells are compared by key; each cell saw its rows in the same order.
        let cells_by_key = |acc: &mut ClusteredGroups| {
            let state = acc.clone().state(EmitTo::All).unwrap();
            let lists: Vec<&ListArray> = state.iter().map(|a| as_list_array(a).unwrap()).collect();
            (0..lists[0].len())
                .map(|g| {
                    let keys = lists[0].value(g);
                    let keys = keys.as_any().downcast_ref::<StringArray>().unwrap();
                    let n = lists[1].value(g);
                    let n = as_uint64_array(&n).unwrap();
                    let (mean, m2) = (lists[2].value(g), lists[3].value(g));
                    let (mean, m2) = (
                        as_float64_array(&mean).unwrap(),
                        as_float64_array(&m2).unwrap(),
                    );
                    let mut cells: Vec<(String, u64, u64, u64)> = (0..keys.len())
                        .map(|j| {
                            let key = keys.value(j).to_string();
                            (
                                key,
                                n.value(j),
                                mean.value(j).to_bits(),
                                m2.value(j).to_bits(),
                            )
                        })
                        .collect();
                    cells.sort_unstable();
                    cells
                })
                .collect::<Vec<_>>()
        };
        let (cells_u, cells_d) = (cells_by_key(&mut utf8), cells_by_key(&mut dict));
        assert_eq!(
            cells_u.iter().map(Vec::len).sum::<usize>(),
            5 * KEYS as usize
        );
        assert_eq!(cells_u, cells_d);
        let a = utf8.evaluate(EmitTo::All).unwrap();
        let b = dict.evaluate(EmitTo::All).unwrap();
        let (a, b) = (as_float64_array(&a).unwrap(), as_float64_array(&b).unwrap());
        assert_eq!((a.len(), a.null_count(), b.null_count()), (5, 0, 0));
        for (x, y) in a.values().iter().zip(b.values()) {
            assert!((x - y).abs() <= 1e-13 * x.abs(), "{x} vs {y}");
        }
    }

    #[test]
    fn many_groups_use_the_hash_map() {
        let mut cells = ClusteredGroups::new(Input::Single, KeyKind::Int, miller_finish()).cells;
        cells.reserve(3, 100, 0);
        assert!(matches!(cells, Cells::Dense { .. }));
        cells.get(2, 99).push(1.0);
        cells.reserve(8_000, 20_000, 0);
        assert!(matches!(cells, Cells::Sparse(_)));
        assert_eq!(cells.get(2, 99).n, 1);
    }

    /// Whole group states merged into a fresh accumulator (the final aggregate after a
    /// spill) fill a matrix of more than `DENSE_MAX_CELLS` cells at once: it stays dense, also
    /// while groups are emitted one at a time (with empty `First(0)` calls between, as an
    /// ordered final aggregate asks), and gives every group's SE as the first accumulator does.
    #[test]
    fn merged_states_stay_dense_and_emit_group_by_group() {
        use datafusion::arrow::array::Int64Array;
        const GROUPS: usize = 3;
        // After the first group is emitted, the two left still fill more than
        // `DENSE_MAX_CELLS` cells.
        const CLUSTERS: usize = 600_000;
        let mut acc = ClusteredGroups::new(Input::Single, KeyKind::Int, miller_finish());
        let rows: Vec<(usize, i64, f64)> = (0..GROUPS * CLUSTERS)
            .map(|i| {
                (
                    i % GROUPS,
                    (i / GROUPS) as i64,
                    ((i * 7919) % 13) as f64 / 4.0,
                )
            })
            .collect();
        for chunk in rows.chunks(8192) {
            let x: ArrayRef = Arc::new(chunk.iter().map(|r| r.2).collect::<Float64Array>());
            let c: ArrayRef = Arc::new(chunk.iter().map(|r| r.1).collect::<Int64Array>());
            let g: Vec<usize> = chunk.iter().map(|r| r.0).collect();
            acc.update_batch(&[x, c], &g, None, GROUPS).unwrap();
        }
        let state = acc.clone().state(EmitTo::All).unwrap();
        let want = acc.evaluate(EmitTo::All).unwrap();
        let mut merged = ClusteredGroups::new(Input::Single, KeyKind::Int, miller_finish());
        merged
            .merge_batch(&state, &(0..GROUPS).collect::<Vec<_>>(), GROUPS)
            .unwrap();
        assert!(matches!(merged.cells, Cells::Dense { .. }));
        let mut got = Vec::new();
        for _ in 0..GROUPS {
            assert_eq!(merged.evaluate(EmitTo::First(0)).unwrap().len(), 0);
            let a = merged.evaluate(EmitTo::First(1)).unwrap();
            got.extend(as_float64_array(&a).unwrap().iter());
            assert!(matches!(merged.cells, Cells::Dense { .. }));
        }
        assert_eq!(merged.n_groups, 0);
        let want: Vec<Option<f64>> = as_float64_array(&want).unwrap().iter().collect();
        assert_eq!(want.len(), GROUPS);
        for (a, b) in got.iter().zip(&want) {
            let (a, b) = (a.unwrap(), b.unwrap());
            assert!((a - b).abs() <= 1e-12 * b, "{a} vs {b}");
        }
    }
}
