//! Cluster keys and the table of per-cluster partial sums behind the clustered statistics.
//!
//! Every key becomes a `u128`: an Int64 key is itself; a string of at most 12 bytes is its
//! Arrow "view" (length in the low 32 bits, the bytes after it), which a Utf8View column
//! already holds, so those keys cost no hashing of string bytes; a longer string is interned
//! once and becomes its intern id tagged with an impossible length.
//!
//! The table is open addressing with linear probing, one 64-byte slot per cluster holding the
//! key, a dense cluster id and the cluster's inline partial sums ([`Cell`]). It is written by
//! hand because the hot loop of `clustered_se` is one random access per row into tens of
//! thousands of clusters (rows arrive in no cluster order): the loop hashes the key a few
//! rows ahead and prefetches that slot, so the probe finds it in cache, and key and sums
//! share one cache line. hashbrown offers no way to prefetch a probe, and an interner plus a
//! separate array of sums touch two or three cache lines per row. Slots are 64 bytes, so the
//! load factor is kept at 3/8 or less: each extra linear probe is another cache line.

use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, GenericStringArray, Int64Array, OffsetSizeTrait, StringViewArray,
};
use datafusion::arrow::datatypes::{DataType, Int64Type};
use datafusion::common::{HashMap, Result, exec_err};

use super::common::Moments;

/// The key of a NULL cluster id (no real key has all bits set: see [`long_key`]).
pub const NULL_KEY: u128 = u128::MAX;

/// Marks the low 32 bits (the "length") of an interned long string's key.
const LONG_TAG: u128 = 0xFFFF_FFFF;

/// Whether keys are integers or strings; fixes the state's list element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyKind {
    /// Int64 keys.
    Int,
    /// String keys (Utf8 in state; Utf8, LargeUtf8 or Utf8View on input).
    Str,
}

impl KeyKind {
    /// The kind for a coerced cluster argument type.
    pub fn of(t: &DataType) -> KeyKind {
        if matches!(t, DataType::Int64) {
            KeyKind::Int
        } else {
            KeyKind::Str
        }
    }

    /// The Arrow type keys have in the partial state.
    pub fn state_type(self) -> DataType {
        match self {
            KeyKind::Int => DataType::Int64,
            KeyKind::Str => DataType::Utf8,
        }
    }
}

/// The group no group is: marks an empty [`Cell`].
pub const NO_GROUP: u32 = u32::MAX;

/// A cluster's inline partial sums and the group they belong to.
///
/// Sums are of `x - shift`, `shift` being the cell's first value (the shifted-data algorithm):
/// no division per row, and stable because the shift lies within the data.
#[derive(Debug, Clone, Copy)]
pub struct Cell {
    /// The group accumulating this cluster inline, [`NO_GROUP`] when empty.
    pub group: u32,
    /// Rows added.
    pub n: u32,
    shift: f64,
    s1: f64,
    s2: f64,
}

impl Cell {
    /// No rows.
    pub const EMPTY: Cell = Cell {
        group: NO_GROUP,
        n: 0,
        shift: 0.0,
        s1: 0.0,
        s2: 0.0,
    };

    /// A cell of `group` holding one value.
    #[inline]
    pub fn start(group: usize, x: f64) -> Self {
        Cell {
            group: group as u32,
            n: 1,
            shift: x,
            s1: 0.0,
            s2: 0.0,
        }
    }

    /// Adds one value.
    #[inline]
    pub fn push(&mut self, x: f64) {
        let d = x - self.shift;
        self.n += 1;
        self.s1 += d;
        self.s2 += d * d;
    }

    /// Count, mean and squared deviations of the values added.
    pub fn moments(&self) -> Moments {
        let n = self.n as f64;
        Moments {
            n: self.n as u64,
            mean: self.shift + self.s1 / n,
            m2: (self.s2 - self.s1 * self.s1 / n).max(0.0),
        }
    }
}

const EMPTY_ID: u32 = u32::MAX;

/// One cluster: key, dense id and inline sums, on one cache line.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub struct Slot {
    key: u128,
    /// Dense cluster id, `0..len()` in order of first sight; [`EMPTY_ID`] for a free slot.
    pub id: u32,
    /// The cluster's inline sums.
    pub cell: Cell,
}

const FREE: Slot = Slot {
    key: 0,
    id: EMPTY_ID,
    cell: Cell::EMPTY,
};

const MIN_SLOTS: usize = 1024;

/// The key of a string of at most 12 bytes: its inline Arrow view.
#[inline]
fn short_key(s: &[u8]) -> u128 {
    debug_assert!(s.len() <= 12);
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&(s.len() as u32).to_le_bytes());
    b[4..4 + s.len()].copy_from_slice(s);
    u128::from_le_bytes(b)
}

/// The key of the interned long string with id `id` (never [`NULL_KEY`]: the high 64 bits
/// of an id-derived key are zero).
#[inline]
fn long_key(id: u32) -> u128 {
    ((id as u128) << 32) | LONG_TAG
}

/// A folded multiply (as in foldhash): cheap and mixes both halves into the low bits.
#[inline(always)]
fn hash(key: u128) -> usize {
    let lo = (key as u64) ^ 0x243F_6A88_85A3_08D3;
    let hi = ((key >> 64) as u64) ^ 0x1319_8A2E_0370_7344;
    let p = (lo as u128).wrapping_mul(hi as u128);
    let h = (p as u64) ^ ((p >> 64) as u64);
    let q = (h as u128).wrapping_mul(0xA409_3822_299F_31D0);
    ((q as u64) ^ ((q >> 64) as u64)) as usize
}

/// Hints the CPU to load `p`'s cache line; never dereferences (any address is fine).
#[inline(always)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint; it cannot fault, even for an invalid address.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Clusters by key: dense ids, inline sums, and the way back from id to key.
#[derive(Debug, Clone)]
pub struct ClusterTable {
    kind: KeyKind,
    slots: Vec<Slot>,
    /// Key of each dense id.
    keys: Vec<u128>,
    long_ids: HashMap<Box<str>, u32>,
    long_strs: Vec<Box<str>>,
    long_bytes: usize,
}

impl ClusterTable {
    /// An empty table for keys of `kind`.
    pub fn new(kind: KeyKind) -> Self {
        Self {
            kind,
            slots: Vec::new(),
            keys: Vec::new(),
            long_ids: HashMap::default(),
            long_strs: Vec::new(),
            long_bytes: 0,
        }
    }

    /// The key kind.
    pub fn kind(&self) -> KeyKind {
        self.kind
    }

    /// Number of distinct clusters seen.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no cluster was seen.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Forgets every cluster.
    pub fn clear(&mut self) {
        *self = Self::new(self.kind);
    }

    /// Empties every inline cell, keeping keys and ids.
    pub fn reset_cells(&mut self) {
        self.slots.iter_mut().for_each(|s| s.cell = Cell::EMPTY);
    }

    /// Approximate heap bytes.
    pub fn size(&self) -> usize {
        self.slots.capacity() * size_of::<Slot>()
            + self.keys.capacity() * 16
            + self.long_ids.capacity() * 24
            + self.long_strs.capacity() * 16
            + 2 * self.long_bytes
    }

    fn intern_long(&mut self, s: &str) -> u128 {
        if let Some(&id) = self.long_ids.get(s) {
            return long_key(id);
        }
        let id = self.long_strs.len() as u32;
        self.long_ids.insert(s.into(), id);
        self.long_bytes += s.len();
        self.long_strs.push(s.into());
        long_key(id)
    }

    /// Writes the key of every row of `keys` into `out` ([`NULL_KEY`] for NULL).
    pub fn keys_of(&mut self, keys: &ArrayRef, out: &mut Vec<u128>) -> Result<()> {
        out.clear();
        out.reserve(keys.len());
        match (self.kind, keys.data_type()) {
            (KeyKind::Int, DataType::Int64) => {
                let a = keys.as_primitive::<Int64Type>();
                out.extend(a.iter().map(|k| k.map_or(NULL_KEY, |k| k as u64 as u128)));
            }
            (KeyKind::Str, DataType::Utf8) => self.str_keys(keys.as_string::<i32>(), out),
            (KeyKind::Str, DataType::LargeUtf8) => self.str_keys(keys.as_string::<i64>(), out),
            (KeyKind::Str, DataType::Utf8View) => self.view_keys(keys.as_string_view(), out),
            (kind, t) => {
                return exec_err!("cluster keys of type {t} do not match the {kind:?} key kind");
            }
        }
        Ok(())
    }

    fn str_keys<O: OffsetSizeTrait>(&mut self, a: &GenericStringArray<O>, out: &mut Vec<u128>) {
        let offsets = a.value_offsets();
        let data = a.value_data();
        // Consecutive equal long strings (rows of one template together) skip the interner.
        let mut prev: Option<(&str, u128)> = None;
        for i in 0..a.len() {
            if a.is_null(i) {
                out.push(NULL_KEY);
                continue;
            }
            let (start, end) = (offsets[i].as_usize(), offsets[i + 1].as_usize());
            let len = end - start;
            let key = if len <= 12 {
                match data.get(start..start + 16) {
                    // One unaligned 16-byte load, masked to the string, instead of a
                    // variable-length copy.
                    Some(b) => {
                        let bytes = u128::from_le_bytes(b.try_into().expect("16 bytes"));
                        let mask = (1u128 << (8 * len)) - 1;
                        ((bytes & mask) << 32) | len as u128
                    }
                    None => short_key(&data[start..end]),
                }
            } else {
                let k = a.value(i);
                match prev {
                    Some((pk, pkey)) if pk == k => pkey,
                    _ => {
                        let key = self.intern_long(k);
                        prev = Some((k, key));
                        key
                    }
                }
            };
            out.push(key);
        }
    }

    fn view_keys(&mut self, a: &StringViewArray, out: &mut Vec<u128>) {
        let views = a.views();
        // A long string's view holds a prefix and a buffer offset: equal views are the same
        // bytes, so consecutive equal views skip the interner.
        let mut prev: Option<(u128, u128)> = None;
        for (i, &v) in views.iter().enumerate() {
            if a.is_null(i) {
                out.push(NULL_KEY);
                continue;
            }
            let len = v as u32;
            let key = if len <= 12 {
                // Writers must zero the padding; mask it anyway so equal strings are equal keys.
                if len < 12 {
                    v & ((1u128 << (32 + 8 * len)) - 1)
                } else {
                    v
                }
            } else {
                match prev {
                    Some((pv, pkey)) if pv == v => pkey,
                    _ => {
                        let key = self.intern_long(a.value(i));
                        prev = Some((v, key));
                        key
                    }
                }
            };
            out.push(key);
        }
    }

    /// Hints the CPU to fetch the slot `key` most likely sits in.
    #[inline(always)]
    pub fn prefetch(&self, key: u128) {
        if !self.slots.is_empty() {
            let i = hash(key) & (self.slots.len() - 1);
            prefetch(self.slots.as_ptr().wrapping_add(i));
        }
    }

    /// The slot of `key`, inserted (with an empty cell and the next id) if new.
    #[inline]
    pub fn slot(&mut self, key: u128) -> usize {
        debug_assert_ne!(key, NULL_KEY);
        if self.slots.is_empty() {
            self.slots = vec![FREE; MIN_SLOTS];
        }
        let mask = self.slots.len() - 1;
        let mut i = hash(key) & mask;
        loop {
            let s = &self.slots[i];
            if s.key == key && s.id != EMPTY_ID {
                return i;
            }
            if s.id == EMPTY_ID {
                return self.insert_at(i, key);
            }
            i = (i + 1) & mask;
        }
    }

    #[cold]
    fn insert_at(&mut self, i: usize, key: u128) -> usize {
        // Load factor at most 3/8: each extra probe is another cache line.
        if (self.keys.len() + 1) * 8 > self.slots.len() * 3 {
            self.grow();
            return self.slot(key);
        }
        self.slots[i] = Slot {
            key,
            id: self.keys.len() as u32,
            cell: Cell::EMPTY,
        };
        self.keys.push(key);
        i
    }

    fn grow(&mut self) {
        let doubled = vec![FREE; self.slots.len() * 2];
        let old = std::mem::replace(&mut self.slots, doubled);
        let mask = self.slots.len() - 1;
        for s in old.into_iter().filter(|s| s.id != EMPTY_ID) {
            let mut i = hash(s.key) & mask;
            while self.slots[i].id != EMPTY_ID {
                i = (i + 1) & mask;
            }
            self.slots[i] = s;
        }
    }

    /// The slot at `i` (from [`ClusterTable::slot`]).
    #[inline]
    pub fn at(&mut self, i: usize) -> &mut Slot {
        &mut self.slots[i]
    }

    /// Indices of the occupied slots.
    pub fn occupied(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.slots.len()).filter(|&i| self.slots[i].id != EMPTY_ID)
    }

    /// The keys of cluster ids `ids`, as an array of the state key type.
    pub fn keys_array(&self, ids: impl Iterator<Item = u32>) -> ArrayRef {
        match self.kind {
            KeyKind::Int => Arc::new(
                ids.map(|id| self.keys[id as usize] as u64 as i64)
                    .collect::<Int64Array>(),
            ),
            KeyKind::Str => {
                let mut out = datafusion::arrow::array::StringBuilder::new();
                for id in ids {
                    let key = self.keys[id as usize];
                    if key & LONG_TAG == LONG_TAG {
                        out.append_value(&self.long_strs[(key >> 32) as usize]);
                    } else {
                        let b = key.to_le_bytes();
                        let len = key as u32 as usize;
                        // Short keys were built from valid UTF-8 strings.
                        out.append_value(String::from_utf8_lossy(&b[4..4 + len]));
                    }
                }
                Arc::new(out.finish()) as ArrayRef
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::StringArray;

    fn utf8(keys: &[Option<&str>]) -> ArrayRef {
        Arc::new(StringArray::from(keys.to_vec()))
    }

    fn ids(t: &mut ClusterTable, a: &ArrayRef) -> Vec<Option<u32>> {
        let mut keys = Vec::new();
        t.keys_of(a, &mut keys).unwrap();
        keys.into_iter()
            .map(|k| (k != NULL_KEY).then(|| t.slot(k)).map(|s| t.at(s).id))
            .collect()
    }

    #[test]
    fn strings_and_views_share_ids_and_round_trip() {
        let mut t = ClusterTable::new(KeyKind::Str);
        let a = utf8(&[Some("a"), Some("a"), None, Some("b")]);
        assert_eq!(ids(&mut t, &a), vec![Some(0), Some(0), None, Some(1)]);
        let v: ArrayRef = Arc::new(StringViewArray::from(vec!["b", "c"]));
        assert_eq!(ids(&mut t, &v), vec![Some(1), Some(2)]);
        let long: ArrayRef = Arc::new(StringViewArray::from(vec![
            "abcdefghijkl",
            "abcdefghijklm",
            "abcdefghijk",
            "abcdefghijkl",
            "c",
        ]));
        assert_eq!(
            ids(&mut t, &long),
            vec![Some(3), Some(4), Some(5), Some(3), Some(2)]
        );
        let plain = utf8(&[Some("abcdefghijklm"), Some("abcdefghijkl"), Some("")]);
        assert_eq!(ids(&mut t, &plain), vec![Some(4), Some(3), Some(6)]);
        let back = t.keys_array(0..7);
        let back = back.as_string::<i32>();
        let got: Vec<&str> = back.iter().map(|s| s.unwrap()).collect();
        assert_eq!(
            got,
            vec![
                "a",
                "b",
                "c",
                "abcdefghijkl",
                "abcdefghijklm",
                "abcdefghijk",
                ""
            ]
        );
        // Short strings with 16 bytes of buffer after them take the masked-load path.
        let plain = utf8(&[Some("b"), Some("c"), Some("zzzzzzzzzzzzzzzzzzzz"), Some("")]);
        assert_eq!(
            ids(&mut t, &plain),
            vec![Some(1), Some(2), Some(7), Some(6)]
        );
    }

    #[test]
    fn probes_stay_short_for_template_like_keys() {
        let mut t = ClusterTable::new(KeyKind::Str);
        let keys: Vec<u128> = (0..20_000)
            .map(|i| short_key(format!("tpl-{i:06}").as_bytes()))
            .collect();
        for &k in &keys {
            t.slot(k);
        }
        let mask = t.slots.len() - 1;
        let probes: usize = keys
            .iter()
            .map(|&k| {
                let mut i = hash(k) & mask;
                let mut n = 1;
                while t.slots[i].key != k {
                    i = (i + 1) & mask;
                    n += 1;
                }
                n
            })
            .sum();
        // Linear probing at load 0.31 expects (1 + 1 / (1 - 0.31)) / 2 = 1.22 probes.
        let avg = probes as f64 / keys.len() as f64;
        assert!(avg < 1.35, "average probe length {avg}");
    }

    #[test]
    fn growth_keeps_ids_and_cells() {
        let mut t = ClusterTable::new(KeyKind::Int);
        let a: ArrayRef = Arc::new(Int64Array::from_iter_values(0..10_000));
        let first = ids(&mut t, &a);
        for (i, id) in first.iter().enumerate() {
            assert_eq!(*id, Some(i as u32));
        }
        let s = t.slot(42);
        t.at(s).cell = Cell::start(7, 1.5);
        let b: ArrayRef = Arc::new(Int64Array::from_iter_values((0..20_000).rev()));
        let second = ids(&mut t, &b);
        assert_eq!(second[19_999 - 42], Some(42));
        assert_eq!(t.len(), 20_000);
        let s = t.slot(42);
        assert_eq!(t.at(s).cell.group, 7);
        let back = t.keys_array([9_999u32, 10_000].into_iter());
        assert_eq!(
            back.as_primitive::<Int64Type>().values().to_vec(),
            vec![9_999, 19_999]
        );
        assert_eq!(t.occupied().count(), 20_000);
    }
}
