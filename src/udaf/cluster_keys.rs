//! Interning of cluster / case ids into dense `u32` ids.
//!
//! Clustered statistics keep per-cluster partial sums; the cluster id column may be any integer
//! or string type (coerced to Int64, Utf8 or Utf8View). Interning turns each key into a dense
//! id once per row, so the per-(group, cluster) lookup hashes one `u64` instead of a string.
//! Consecutive equal keys (rows of one template usually arrive together) skip the hash.

use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, Int64Array, StringArray, StringViewArray,
};
use datafusion::arrow::datatypes::{DataType, Int64Type};
use datafusion::common::{HashMap, Result, exec_err};

/// Marks a NULL key in the id vector.
pub const NULL_ID: u32 = u32::MAX;

/// Whether keys are integers or strings; fixes the state's list element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyKind {
    /// Int64 keys.
    Int,
    /// String keys (Utf8 in state; Utf8 or Utf8View on input).
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

/// Maps keys to dense ids `0..len()` and back.
#[derive(Debug, Clone)]
pub struct Interner {
    kind: KeyKind,
    ints: HashMap<i64, u32>,
    int_keys: Vec<i64>,
    strs: HashMap<Box<str>, u32>,
    str_keys: Vec<Box<str>>,
    str_bytes: usize,
    /// Cache for Utf8View strings of at most 12 bytes: the 16-byte view holds the whole string
    /// (zero padded), so equal views are equal strings and need no string hashing.
    inline_views: HashMap<u128, u32>,
}

impl Interner {
    /// An empty interner for keys of `kind`.
    pub fn new(kind: KeyKind) -> Self {
        Self {
            kind,
            ints: HashMap::default(),
            int_keys: Vec::new(),
            strs: HashMap::default(),
            str_keys: Vec::new(),
            str_bytes: 0,
            inline_views: HashMap::default(),
        }
    }

    /// The key kind.
    pub fn kind(&self) -> KeyKind {
        self.kind
    }

    /// Number of distinct keys seen.
    pub fn len(&self) -> usize {
        self.int_keys.len() + self.str_keys.len()
    }

    /// Whether no key was seen.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every key.
    pub fn clear(&mut self) {
        *self = Self::new(self.kind);
    }

    /// Approximate heap bytes.
    pub fn size(&self) -> usize {
        self.ints.capacity() * 16
            + self.int_keys.capacity() * 8
            + self.strs.capacity() * 24
            + self.str_keys.capacity() * 16
            + 2 * self.str_bytes
            + self.inline_views.capacity() * 24
    }

    #[inline]
    fn int_id(&mut self, k: i64) -> u32 {
        let next = self.int_keys.len() as u32;
        let id = *self.ints.entry(k).or_insert(next);
        if id == next {
            self.int_keys.push(k);
        }
        id
    }

    #[inline]
    fn str_id(&mut self, k: &str) -> u32 {
        if let Some(&id) = self.strs.get(k) {
            return id;
        }
        let id = self.str_keys.len() as u32;
        self.strs.insert(k.into(), id);
        self.str_bytes += k.len();
        self.str_keys.push(k.into());
        id
    }

    /// Writes the id of every row of `keys` into `out` ([`NULL_ID`] for NULL).
    pub fn ids(&mut self, keys: &ArrayRef, out: &mut Vec<u32>) -> Result<()> {
        out.clear();
        out.reserve(keys.len());
        match (self.kind, keys.data_type()) {
            (KeyKind::Int, DataType::Int64) => {
                let a = keys.as_primitive::<Int64Type>();
                let mut prev: Option<(i64, u32)> = None;
                for i in 0..a.len() {
                    if a.is_null(i) {
                        out.push(NULL_ID);
                        continue;
                    }
                    let k = a.value(i);
                    let id = match prev {
                        Some((pk, pid)) if pk == k => pid,
                        _ => self.int_id(k),
                    };
                    prev = Some((k, id));
                    out.push(id);
                }
            }
            (KeyKind::Str, DataType::Utf8) => self.str_ids(keys.as_string::<i32>().iter(), out),
            (KeyKind::Str, DataType::LargeUtf8) => {
                self.str_ids(keys.as_string::<i64>().iter(), out)
            }
            (KeyKind::Str, DataType::Utf8View) => self.view_ids(keys.as_string_view(), out),
            (kind, t) => {
                return exec_err!("cluster keys of type {t} do not match the {kind:?} key kind");
            }
        }
        Ok(())
    }

    fn str_ids<'a>(&mut self, it: impl Iterator<Item = Option<&'a str>>, out: &mut Vec<u32>) {
        let mut prev: Option<(&'a str, u32)> = None;
        for k in it {
            let Some(k) = k else {
                out.push(NULL_ID);
                continue;
            };
            let id = match prev {
                Some((pk, pid)) if pk == k => pid,
                _ => self.str_id(k),
            };
            prev = Some((k, id));
            out.push(id);
        }
    }

    fn view_ids(&mut self, a: &StringViewArray, out: &mut Vec<u32>) {
        let views = a.views();
        let mut prev: Option<(u128, u32)> = None;
        for i in 0..a.len() {
            if a.is_null(i) {
                out.push(NULL_ID);
                continue;
            }
            let mut v = views[i];
            let len = v as u32;
            if len < 12 {
                // Writers must zero the padding; mask it anyway so equal strings hash equal.
                v &= (1u128 << (32 + 8 * len)) - 1;
            }
            let id = match prev {
                Some((pv, pid)) if pv == v => pid,
                _ if len <= 12 => match self.inline_views.get(&v) {
                    Some(&id) => id,
                    None => {
                        let id = self.str_id(a.value(i));
                        self.inline_views.insert(v, id);
                        id
                    }
                },
                _ => self.str_id(a.value(i)),
            };
            // Long strings' views hold a prefix and a buffer offset: equal views are the same
            // bytes, so the run cache stays exact for them too.
            prev = Some((v, id));
            out.push(id);
        }
    }

    /// The keys of `ids`, as an array of the state key type.
    pub fn keys_array(&self, ids: impl Iterator<Item = u32>) -> ArrayRef {
        match self.kind {
            KeyKind::Int => Arc::new(
                ids.map(|id| self.int_keys[id as usize])
                    .collect::<Int64Array>(),
            ),
            KeyKind::Str => Arc::new(
                ids.map(|id| Some(&*self.str_keys[id as usize]))
                    .collect::<StringArray>(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_and_views_share_ids() {
        let mut i = Interner::new(KeyKind::Str);
        let a: ArrayRef = Arc::new(StringArray::from(vec![
            Some("a"),
            Some("a"),
            None,
            Some("b"),
        ]));
        let mut out = Vec::new();
        i.ids(&a, &mut out).unwrap();
        assert_eq!(out, vec![0, 0, NULL_ID, 1]);
        let v: ArrayRef = Arc::new(datafusion::arrow::array::StringViewArray::from(vec![
            "b", "c",
        ]));
        i.ids(&v, &mut out).unwrap();
        assert_eq!(out, vec![1, 2]);
        assert_eq!(i.len(), 3);
        let long: ArrayRef = Arc::new(datafusion::arrow::array::StringViewArray::from(vec![
            "abcdefghijkl",
            "abcdefghijklm",
            "abcdefghijk",
            "abcdefghijkl",
            "c",
        ]));
        i.ids(&long, &mut out).unwrap();
        assert_eq!(out, vec![3, 4, 5, 3, 2]);
        let plain: ArrayRef = Arc::new(StringArray::from(vec!["abcdefghijklm", "abcdefghijkl"]));
        i.ids(&plain, &mut out).unwrap();
        assert_eq!(out, vec![4, 3]);
    }
}
