//! The call ids of direct records held while they fit: an import whose ids are all distinct
//! (the usual case) needs no scratch ids table and no duplicate check plan.
//!
//! Memory holds the first 8 bytes of each id, appended in chunks as they come (no hash
//! table: an insert at random into a table of a million ids waited on memory twice, 5% of
//! an import's CPU; no doubling vector either: it held three times its ids while it grew),
//! sorted chunk by chunk at the end and merged. The whole rows (id, fingerprint, `seq`) go
//! to an unnamed temporary file, 32 bytes each, read back only when two prefixes are equal.
//! So 10M ids cost 80 MB of memory, and a 1 GiB limit holds 16M (the rows in memory, 32
//! bytes an id in a doubling vector, held 1.4M: past them a 10M-record import wrote every
//! id to the ids table and ran the plan's duplicate check, 3.6 s).
//!
//! When two prefixes are equal, or once the ids outgrow their bound, the sink writes
//! everything held to the ids table and the plan decides as before
//! ([`ImportSink::check_duplicates`]): which records are copies, which differ, and the
//! error naming them. So the in-memory path changes no outcome.

use std::io::{BufReader, BufWriter, Read, Write};

use super::*;

/// A direct record's call id and fingerprint (24 hex digits each, as 12 bytes) and `seq`.
#[derive(Clone, Copy)]
pub(super) struct SeenId {
    id: [u8; 12],
    fp: [u8; 12],
    seq: u64,
}

/// Bytes of a [`SeenId`] in the rows file.
const ROW: usize = 32;

/// Prefixes per chunk (8 MB; 4 in tests, so their ids span chunks and the merge).
const CHUNK: usize = if cfg!(test) { 4 } else { 1 << 20 };

impl SeenId {
    fn to_bytes(self) -> [u8; ROW] {
        let mut b = [0u8; ROW];
        b[..12].copy_from_slice(&self.id);
        b[12..24].copy_from_slice(&self.fp);
        b[24..].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    fn from_bytes(b: &[u8; ROW]) -> SeenId {
        let mut s = SeenId {
            id: [0; 12],
            fp: [0; 12],
            seq: u64::from_le_bytes(b[24..].try_into().expect("8 bytes")),
        };
        s.id.copy_from_slice(&b[..12]);
        s.fp.copy_from_slice(&b[12..24]);
        s
    }

    /// 8 bytes of the id, equal for equal ids: its first 8 bytes with its last 4 mixed in
    /// (a bijection of them), so ids that differ only at their end (numbered ones) differ
    /// here too.
    fn prefix(&self) -> u64 {
        let head = u64::from_be_bytes(self.id[..8].try_into().expect("8 bytes"));
        let tail = u32::from_be_bytes(self.id[8..].try_into().expect("4 bytes"));
        head ^ u64::from(tail).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }
}

/// The direct records' ids seen so far, at most `cap` of them.
pub(super) struct SeenIds {
    /// Each id's [`SeenId::prefix`], in chunks of at most [`CHUNK`].
    prefixes: Vec<Vec<u64>>,
    len: usize,
    /// Every row held, in order; created with the first.
    rows: Option<BufWriter<std::fs::File>>,
    cap: usize,
}

/// The value of each byte as a hex digit (either case), 0xFF for any other byte.
const HEX_DIGIT: [u8; 256] = {
    let mut t = [0xFF; 256];
    let mut i = 0;
    while i < 10 {
        t[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        t[b'a' as usize + i] = 10 + i as u8;
        t[b'A' as usize + i] = 10 + i as u8;
        i += 1;
    }
    t
};

/// `text` (24 hex digits, either case) as 12 bytes; `false` for any other text. As
/// `hex::decode_to_slice`, by a table: that crate's digit by digit match was a quarter of
/// the sink's serial time on a corpus whose records give their sample indices.
fn hex12(text: &str, out: &mut [u8; 12]) -> bool {
    let b = text.as_bytes();
    if b.len() != 24 {
        return false;
    }
    let mut bad = 0u8;
    for (o, pair) in out.iter_mut().zip(b.chunks_exact(2)) {
        let (hi, lo) = (HEX_DIGIT[pair[0] as usize], HEX_DIGIT[pair[1] as usize]);
        bad |= hi | lo;
        *o = (hi << 4) | (lo & 0x0F);
    }
    bad & 0xF0 == 0
}

impl SeenIds {
    /// Within an eighth of the memory limit: 8 bytes an id (16M ids at 1 GiB).
    pub(super) fn new(memory_limit: usize) -> Self {
        SeenIds {
            prefixes: Vec::new(),
            len: 0,
            rows: None,
            cap: (memory_limit / 8 / 8).max(1024),
        }
    }

    /// Adds an ids batch ([`ids_schema`]). `false`, with the ids as they were before the
    /// call, when an id or fingerprint is not 24 hex digits or the ids would pass their
    /// bound.
    pub(super) fn add(&mut self, batch: &RecordBatch) -> std::io::Result<bool> {
        if self.len + batch.num_rows() > self.cap {
            return Ok(false);
        }
        let seqs = batch
            .column(0)
            .as_primitive::<datafusion::arrow::datatypes::UInt64Type>();
        let (ids, fps) = (
            batch.column(1).as_string::<i32>(),
            batch.column(2).as_string::<i32>(),
        );
        let mut rows = Vec::with_capacity(batch.num_rows());
        for i in 0..batch.num_rows() {
            let mut s = SeenId {
                id: [0; 12],
                fp: [0; 12],
                seq: seqs.value(i),
            };
            let parsed = ids.is_valid(i)
                && fps.is_valid(i)
                && hex12(ids.value(i), &mut s.id)
                && hex12(fps.value(i), &mut s.fp);
            if !parsed {
                return Ok(false);
            }
            rows.push(s);
        }
        let file = match self.rows.as_mut() {
            Some(f) => f,
            None => self
                .rows
                .insert(BufWriter::with_capacity(1 << 16, tempfile::tempfile()?)),
        };
        for s in &rows {
            file.write_all(&s.to_bytes())?;
            match self.prefixes.last_mut() {
                Some(c) if c.len() < CHUNK => c.push(s.prefix()),
                _ => {
                    let mut c = Vec::with_capacity(CHUNK);
                    c.push(s.prefix());
                    self.prefixes.push(c);
                }
            }
        }
        self.len += rows.len();
        Ok(true)
    }

    /// Whether no two ids held are equal: each chunk sorted on rayon's pool, then merged.
    /// `false` may also mean two ids whose prefixes are equal (about once in
    /// 400,000 imports of 10M ids): the plan then finds them distinct.
    pub(super) fn all_distinct(&mut self) -> bool {
        use rayon::prelude::*;
        self.prefixes.par_iter_mut().for_each(|c| c.sort_unstable());
        if self
            .prefixes
            .iter()
            .any(|c| c.windows(2).any(|w| w[0] == w[1]))
        {
            return false;
        }
        // The smallest unread prefix of each chunk, smallest first.
        let mut heads: std::collections::BinaryHeap<std::cmp::Reverse<(u64, usize)>> = self
            .prefixes
            .iter()
            .enumerate()
            .filter_map(|(k, c)| c.first().map(|&p| std::cmp::Reverse((p, k))))
            .collect();
        let mut next = vec![1usize; self.prefixes.len()];
        let mut last = None;
        while let Some(std::cmp::Reverse((p, k))) = heads.pop() {
            if last == Some(p) {
                return false;
            }
            last = Some(p);
            if let Some(&q) = self.prefixes[k].get(next[k]) {
                next[k] += 1;
                heads.push(std::cmp::Reverse((q, k)));
            }
        }
        true
    }

    /// The ids held, in the order they came, as ids batches of at most [`STAGE_ROWS`] rows,
    /// for the ids table.
    pub(super) fn into_batches(
        self,
    ) -> std::io::Result<impl Iterator<Item = std::io::Result<RecordBatch>>> {
        let (mut left, file) = (self.len, self.rows);
        drop(self.prefixes);
        let mut file = match file {
            Some(f) => {
                let mut f = f.into_inner().map_err(|e| e.into_error())?;
                std::io::Seek::rewind(&mut f)?;
                Some(BufReader::with_capacity(1 << 16, f))
            }
            None => None,
        };
        Ok(std::iter::from_fn(move || {
            let f = file.as_mut().filter(|_| left > 0)?;
            let n = left.min(STAGE_ROWS);
            let (mut seq, mut id, mut fp) = (
                UInt64Builder::with_capacity(n),
                StringBuilder::with_capacity(n, n * 24),
                StringBuilder::with_capacity(n, n * 24),
            );
            let mut b = [0u8; ROW];
            for _ in 0..n {
                if let Err(e) = f.read_exact(&mut b) {
                    left = 0;
                    return Some(Err(e));
                }
                let s = SeenId::from_bytes(&b);
                seq.append_value(s.seq);
                id.append_value(hex::encode(s.id));
                fp.append_value(hex::encode(s.fp));
            }
            left -= n;
            let cols: Vec<ArrayRef> = vec![
                Arc::new(seq.finish()),
                Arc::new(id.finish()),
                Arc::new(fp.finish()),
            ];
            Some(Ok(
                RecordBatch::try_new(ids_schema(), cols).expect("ids batch matches its schema")
            ))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table decodes as the `hex` crate does: every digit of either case, and any
    /// other byte or length refused.
    #[test]
    fn hex12_decodes_as_the_hex_crate() {
        let mut got = [0u8; 12];
        for text in [
            "0123456789abcdefABCDEF00",
            "ffffffffffffffffffffffff",
            "000000000000000000000000",
            "a1B2c3D4e5F6a7B8c9D0e1F2",
        ] {
            let mut want = [0u8; 12];
            hex::decode_to_slice(text, &mut want).unwrap();
            assert!(hex12(text, &mut got), "{text}");
            assert_eq!(got, want, "{text}");
        }
        for text in [
            "0123456789abcdefABCDEF0g",
            "g123456789abcdefABCDEF00",
            "0123456789abcdefABCDEF0",
            "0123456789abcdefABCDEF000",
            "0123456789abcdef ABCDEF0",
            "0123456789abcdefABCDE\u{e9}0",
        ] {
            assert!(!hex12(text, &mut got), "{text}");
            assert!(hex::decode_to_slice(text, &mut got).is_err(), "{text}");
        }
    }

    impl SeenIds {
        fn add_ok(&mut self, batch: &RecordBatch) -> bool {
            self.add(batch).unwrap()
        }
    }

    fn ids(rows: &[(u64, &str, &str)]) -> RecordBatch {
        RecordBatch::try_new(
            ids_schema(),
            vec![
                Arc::new(datafusion::arrow::array::UInt64Array::from_iter_values(
                    rows.iter().map(|r| r.0),
                )),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.1))),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.2))),
            ],
        )
        .unwrap()
    }

    fn held(s: SeenIds) -> Vec<(u64, String, String)> {
        let mut out: Vec<(u64, String, String)> = s
            .into_batches()
            .unwrap()
            .flat_map(|b| {
                let b = b.unwrap();
                let seq = b
                    .column(0)
                    .as_primitive::<datafusion::arrow::datatypes::UInt64Type>()
                    .clone();
                let id = b.column(1).as_string::<i32>().clone();
                let fp = b.column(2).as_string::<i32>().clone();
                (0..b.num_rows())
                    .map(|i| {
                        (
                            seq.value(i),
                            id.value(i).to_string(),
                            fp.value(i).to_string(),
                        )
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        out.sort();
        out
    }

    const A: &str = "0123456789abcdef01234567";
    const B: &str = "fedcba9876543210fedcba98";
    const C: &str = "00000000000000000000000c";
    const F1: &str = "aaaaaaaaaaaaaaaaaaaaaaaa";
    const F2: &str = "bbbbbbbbbbbbbbbbbbbbbbbb";

    /// Ids are given back as they came (seq, id, fingerprint); a batch with one that is
    /// not a 24-digit hex digest is refused whole and leaves the ids as they were.
    #[test]
    fn a_refused_batch_leaves_the_ids_as_they_were() {
        let mut s = SeenIds::new(1 << 30);
        assert!(s.add_ok(&ids(&[(0, A, F1), (1, B, F2)])));
        assert!(!s.add_ok(&ids(&[(6, C, F1), (7, "xyz", F1)])));
        assert!(!s.add_ok(&ids(&[(8, C, "short")])));
        assert!(s.all_distinct());
        assert_eq!(
            held(s),
            vec![
                (0, A.to_string(), F1.to_string()),
                (1, B.to_string(), F2.to_string())
            ]
        );
    }

    /// An id held twice, in two batches or in one, with the same fingerprint or not, is
    /// found; both rows are given back for the plan.
    #[test]
    fn an_id_held_twice_is_found() {
        for rows in [
            vec![vec![(0, A, F1), (1, B, F2)], vec![(2, C, F1), (3, A, F1)]],
            vec![vec![(0, C, F1), (1, C, F2)]],
        ] {
            let mut s = SeenIds::new(1 << 30);
            for r in &rows {
                assert!(s.add_ok(&ids(r)));
            }
            assert!(!s.all_distinct());
            assert_eq!(held(s).len(), rows.iter().map(Vec::len).sum::<usize>());
        }
    }

    /// The bound refuses a batch that would pass it, whole.
    #[test]
    fn a_batch_past_the_bound_is_refused() {
        let mut s = SeenIds::new(0);
        assert_eq!(s.cap, 1024);
        let texts: Vec<String> = (0..1025u32).map(|i| format!("{i:024x}")).collect();
        let rows: Vec<(u64, &str, &str)> = texts
            .iter()
            .enumerate()
            .map(|(i, t)| (i as u64, t.as_str(), F1))
            .collect();
        assert!(s.add_ok(&ids(&rows[..1000])));
        assert!(!s.add_ok(&ids(&rows[1000..])));
        assert!(s.add_ok(&ids(&rows[1000..1024])));
        assert!(s.all_distinct());
        let got = held(s);
        assert_eq!(got.len(), 1024);
        assert_eq!(got[1023], (1023, format!("{:024x}", 1023), F1.to_string()));
    }

    /// Ids equal in their first 16 digits, or in their last 8, are told apart; an id held
    /// twice is found in any two chunks, first and last included.
    #[test]
    fn ids_alike_at_one_end_are_distinct_and_a_repeat_anywhere_is_found() {
        let texts: Vec<String> = (0..40u64)
            .map(|i| {
                if i % 2 == 0 {
                    format!("{:016x}{:08x}", 7, i)
                } else {
                    format!("{:016x}{:08x}", i << 40, 9)
                }
            })
            .collect();
        let rows: Vec<(u64, &str, &str)> = texts
            .iter()
            .enumerate()
            .map(|(i, t)| (i as u64, t.as_str(), F1))
            .collect();
        let mut s = SeenIds::new(1 << 30);
        assert!(s.add_ok(&ids(&rows)));
        assert!(s.prefixes.len() > 2, "the ids span chunks");
        assert!(s.all_distinct());
        for (first, second) in [(0, 39), (5, 22), (38, 39), (0, 1)] {
            let mut s = SeenIds::new(1 << 30);
            let mut again = rows.clone();
            again[second].1 = rows[first].1;
            assert!(s.add_ok(&ids(&again)));
            assert!(!s.all_distinct(), "{first} and {second}");
            let back = held(s);
            assert_eq!(back.len(), 40);
            assert_eq!(
                back[second],
                (second as u64, texts[first].clone(), F1.to_string())
            );
        }
    }
}
