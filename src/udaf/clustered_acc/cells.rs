//! The per-(group, cluster) cells: a dense matrix while it fits, a hash map of cells beyond.

use crate::udaf::cluster_keys::prefetch;
use crate::udaf::common::Moments;

use super::*;

/// Cells of at most this many (group, cluster) pairs stay a dense matrix (32 MB); above it,
/// only while at least half of them are used.
pub(super) const DENSE_MAX_CELLS: usize = 1 << 20;

/// One cell of the dense matrix: [`Moments`] padded to 32 bytes, so no cell straddles two
/// cache lines (24-byte cells did one time in four, and a row then waited for two misses).
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(32))]
pub(super) struct Cell(Moments);

impl std::ops::Deref for Cell {
    type Target = Moments;
    #[inline(always)]
    fn deref(&self) -> &Moments {
        &self.0
    }
}

impl std::ops::DerefMut for Cell {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut Moments {
        &mut self.0
    }
}

/// Asks Linux to back `v`'s allocation with 2 MiB pages, once its cells are written: rows
/// hit the matrix at random, and at 20 models x 20,000 templates (13 MB per partition) nearly
/// every row's cell was also a TLB miss with 4 KiB pages, which the prefetch a few rows ahead
/// does not hide. `MADV_HUGEPAGE` covers pages touched later; `MADV_COLLAPSE` (Linux 6.1)
/// turns the pages already there (the allocator's reused ones, the cells just written) into
/// huge pages at once. Either may be refused (no THP in the kernel): the matrix is then as
/// it was.
fn huge_pages(v: &mut Vec<Cell>) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const PAGE: usize = 4096;
        let bytes = v.capacity() * std::mem::size_of::<Cell>();
        if bytes < 2 << 20 {
            return;
        }
        let start = v.as_mut_ptr() as usize;
        let (lo, hi) = (
            (start + PAGE - 1) & !(PAGE - 1),
            (start + bytes) & !(PAGE - 1),
        );
        if hi > lo {
            for advice in [libc::MADV_HUGEPAGE, libc::MADV_COLLAPSE] {
                // SAFETY: [lo, hi) lies inside `v`'s own allocation; the advice changes how
                // the kernel backs those pages, never their contents or their mapping.
                unsafe {
                    libc::madvise(lo as *mut libc::c_void, hi - lo, advice);
                }
            }
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = v;
}

/// A batch's rows as the cells take them: cluster ids, values, and which rows count.
pub(super) struct Rows<'a> {
    pub(super) ids: &'a [u32],
    pub(super) xs: &'a [f64],
    /// The values' validity, when some are NULL.
    pub(super) valid: Option<&'a NullBuffer>,
    pub(super) filter: Option<&'a BooleanArray>,
}

impl Rows<'_> {
    /// Whether row `i` is used: a cluster, a value that is not NULL or NaN, the filter.
    #[inline(always)]
    pub(super) fn keep(&self, i: usize) -> bool {
        self.ids[i] != NULL_ID
            && !self.xs[i].is_nan()
            && self.valid.is_none_or(|v| v.is_valid(i))
            && filter_ok(self.filter, i)
    }
}

/// Moments per (group, cluster): a dense matrix while groups x clusters is small (GROUP BY
/// model over thousands of templates, or no GROUP BY), else a hash map of the pairs seen
/// (GROUP BY model, test: each template falls in one test, so most pairs never occur).
#[derive(Debug, Clone)]
pub(super) enum Cells {
    /// `m[cluster * stride + group]`, room for `m.len() / stride` clusters.
    Dense {
        stride: usize,
        m: Vec<Cell>,
        used: usize,
    },
    Sparse(CellMap),
}

impl Default for Cells {
    fn default() -> Self {
        Cells::Dense {
            stride: 0,
            m: Vec::new(),
            used: 0,
        }
    }
}

impl Cells {
    /// Makes room for `groups` groups and `clusters` clusters, of which about `incoming`
    /// more (group, cluster) pairs are about to be filled: a merge of whole group states
    /// fills a fresh matrix at once, and judged by its empty cells alone it would turn
    /// sparse (twice the bytes of a full matrix) before its first cell.
    pub(super) fn reserve(&mut self, groups: usize, clusters: usize, incoming: usize) {
        let Cells::Dense { stride, m, used } = self else {
            return;
        };
        let cap = m.len().checked_div(*stride).unwrap_or(0);
        if groups <= *stride && clusters <= cap {
            return;
        }
        let new_stride = if groups <= *stride {
            *stride
        } else {
            groups.max(*stride + *stride / 2)
        };
        let new_cap = if clusters <= cap {
            cap
        } else {
            clusters.max(cap + cap / 2).max(64)
        };
        let cells = new_stride * new_cap;
        let filled = *used + incoming;
        if cells > DENSE_MAX_CELLS && cells > 2 * filled {
            let mut map = CellMap::with_capacity(filled * 2);
            for (i, c) in m.iter().enumerate().filter(|(_, c)| c.n > 0) {
                map.entry(cell_key(i % *stride, (i / *stride) as u32))
                    .merge(c);
            }
            *self = Cells::Sparse(map);
        } else if new_stride == *stride {
            // Exactly: the capacity follows the 1.5x growth above, not `Vec`'s doubling,
            // which could leave twice the matrix allocated (hundreds of MB at 10M rows).
            m.reserve_exact(cells - m.len());
            m.resize(cells, Cell::default());
            huge_pages(m);
        } else {
            let mut grown = vec![Cell::default(); cells];
            for (i, c) in m.iter().enumerate().filter(|(_, c)| c.n > 0) {
                grown[(i / *stride) * new_stride + i % *stride] = *c;
            }
            huge_pages(&mut grown);
            *m = grown;
            *stride = new_stride;
        }
    }

    /// The moments of `(group, cluster)` (room made by [`Cells::reserve`]).
    #[inline]
    pub(super) fn get(&mut self, group: usize, cluster: u32) -> &mut Moments {
        match self {
            Cells::Dense { stride, m, used } => {
                let c = &mut m[cluster as usize * *stride + group];
                *used += usize::from(c.n == 0);
                c
            }
            Cells::Sparse(map) => map.entry(cell_key(group, cluster)),
        }
    }

    /// Adds `x[i]` to the cell of `(groups[i], ids[i])` for every row [`Rows::keep`] accepts.
    #[inline]
    pub(super) fn push_rows(&mut self, groups: &[usize], rows: &Rows) {
        // Rows arrive in no cluster order and the cells do not fit in L2: prefetch the cell
        // of the row a few rows ahead.
        const AHEAD: usize = 16;
        let (ids, x) = (rows.ids, rows.xs);
        match self {
            Cells::Dense { stride, m, used } => {
                let stride = *stride;
                let base = m.as_ptr();
                let mut new_cells = 0;
                for i in 0..x.len() {
                    if let (Some(&g), Some(&c)) = (groups.get(i + AHEAD), ids.get(i + AHEAD)) {
                        prefetch(base.wrapping_add((c as usize).wrapping_mul(stride) + g));
                    }
                    if rows.keep(i) {
                        let c = &mut m[ids[i] as usize * stride + groups[i]];
                        new_cells += usize::from(c.n == 0);
                        c.push(x[i]);
                    }
                }
                *used += new_cells;
            }
            Cells::Sparse(map) => {
                for i in 0..x.len() {
                    if let (Some(&g), Some(&c)) = (groups.get(i + AHEAD), ids.get(i + AHEAD)) {
                        map.prefetch(cell_key(g, c));
                    }
                    if rows.keep(i) {
                        map.entry(cell_key(groups[i], ids[i])).push(x[i]);
                    }
                }
            }
        }
    }

    /// One group's non-empty cells in cluster order, with its total (dense cells only; a
    /// sparse map gives an empty group).
    pub(super) fn group(&self, g: usize) -> GroupCells {
        let mut out = GroupCells::default();
        if let Cells::Dense { stride, m, .. } = self
            && g < *stride
        {
            for (c, cell) in m.iter().skip(g).step_by(*stride).enumerate() {
                if cell.n > 0 {
                    out.cells.push((c as u32, cell.0));
                    out.total.merge(cell);
                }
            }
        }
        out
    }

    /// Every non-empty cell as `(group, cluster, moments)`.
    pub(super) fn drain(&mut self) -> Vec<(usize, u32, Moments)> {
        let out = match self {
            Cells::Dense { stride, m, .. } => m
                .iter()
                .enumerate()
                .filter(|(_, c)| c.n > 0)
                .map(|(i, c)| (i % *stride, (i / *stride) as u32, c.0))
                .collect(),
            Cells::Sparse(map) => map
                .slots
                .iter()
                .filter(|s| s.key != EMPTY_CELL)
                .map(|s| ((s.key >> 32) as usize, s.key as u32, s.m))
                .collect(),
        };
        *self = Cells::default();
        out
    }

    pub(super) fn size(&self) -> usize {
        match self {
            Cells::Dense { m, .. } => m.capacity() * size_of::<Cell>(),
            Cells::Sparse(map) => map.slots.capacity() * size_of::<CellSlot>(),
        }
    }
}

#[inline(always)]
pub(super) fn cell_key(group: usize, cluster: u32) -> u64 {
    ((group as u64) << 32) | cluster as u64
}

pub(super) const EMPTY_CELL: u64 = u64::MAX;

/// One (group, cluster) pair and its moments: two per cache line.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(32))]
pub(super) struct CellSlot {
    pub(super) key: u64,
    pub(super) m: Moments,
}

/// Open addressing with linear probing on `cell_key`, load factor at most 1/2.
#[derive(Debug, Clone)]
pub(super) struct CellMap {
    pub(super) slots: Vec<CellSlot>,
    pub(super) len: usize,
    pub(super) shift: u32,
}

impl CellMap {
    pub(super) fn with_capacity(n: usize) -> Self {
        let slots = (2 * n).next_power_of_two().max(1024);
        Self {
            slots: vec![
                CellSlot {
                    key: EMPTY_CELL,
                    m: Moments::default(),
                };
                slots
            ],
            len: 0,
            shift: 64 - slots.trailing_zeros(),
        }
    }

    /// Fibonacci hashing: the top bits of the key times 2^64 / phi.
    #[inline(always)]
    pub(super) fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    #[inline(always)]
    pub(super) fn prefetch(&self, key: u64) {
        prefetch(self.slots.as_ptr().wrapping_add(self.home(key)));
    }

    #[inline]
    pub(super) fn entry(&mut self, key: u64) -> &mut Moments {
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let k = self.slots[i].key;
            if k == key {
                return &mut self.slots[i].m;
            }
            if k == EMPTY_CELL {
                if (self.len + 1) * 2 > self.slots.len() {
                    self.grow();
                    return self.entry(key);
                }
                self.len += 1;
                self.slots[i].key = key;
                return &mut self.slots[i].m;
            }
            i = (i + 1) & mask;
        }
    }

    #[cold]
    pub(super) fn grow(&mut self) {
        let old = std::mem::replace(self, CellMap::with_capacity(self.slots.len()));
        for s in old.slots.into_iter().filter(|s| s.key != EMPTY_CELL) {
            *self.entry(s.key) = s.m;
        }
    }
}
