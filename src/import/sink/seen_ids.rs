//! The call ids of direct records held in memory while they fit: an import whose ids are
//! all distinct (the usual case) needs no scratch ids table and no duplicate check plan.
//!
//! The ids are appended as they come (no hash table: an insert at random into a table of
//! a million ids waited on memory twice, 5% of an import's CPU) and sorted once at the end.
//! When two are equal, or once they outgrow their bound, the sink writes everything held
//! to the ids table and the plan decides as before ([`ImportSink::check_duplicates`]):
//! which records are copies, which differ, and the error naming them. So the in-memory
//! path changes no outcome.

use super::*;

/// A direct record's call id and fingerprint (24 hex digits each, as 12 bytes) and `seq`.
#[derive(Clone, Copy)]
pub(super) struct SeenId {
    id: [u8; 12],
    fp: [u8; 12],
    seq: u64,
}

/// The direct records' ids seen so far, at most `cap` of them.
pub(super) struct SeenIds {
    rows: Vec<SeenId>,
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
    /// Within an eighth of the memory limit: 32 bytes an id, in a vector that doubles
    /// (both live while it grows): at worst 96 bytes an id, 1.4M ids at 1 GiB.
    pub(super) fn new(memory_limit: usize) -> Self {
        SeenIds {
            rows: Vec::new(),
            cap: (memory_limit / 8 / 96).max(1024),
        }
    }

    /// Adds an ids batch ([`ids_schema`]). `false`, with the ids as they were before the
    /// call, when an id or fingerprint is not 24 hex digits or the ids would pass their
    /// bound.
    pub(super) fn add(&mut self, batch: &RecordBatch) -> bool {
        if self.rows.len() + batch.num_rows() > self.cap {
            return false;
        }
        let seqs = batch
            .column(0)
            .as_primitive::<datafusion::arrow::datatypes::UInt64Type>();
        let (ids, fps) = (
            batch.column(1).as_string::<i32>(),
            batch.column(2).as_string::<i32>(),
        );
        let before = self.rows.len();
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
                self.rows.truncate(before);
                return false;
            }
            self.rows.push(s);
        }
        true
    }

    /// Whether no two ids held are equal (sorting them by id, on rayon's pool).
    pub(super) fn all_distinct(&mut self) -> bool {
        use rayon::slice::ParallelSliceMut;
        self.rows.par_sort_unstable_by(|a, b| a.id.cmp(&b.id));
        self.rows.windows(2).all(|w| w[0].id != w[1].id)
    }

    /// The ids held, as ids batches of at most [`STAGE_ROWS`] rows, for the ids table.
    pub(super) fn into_batches(self) -> impl Iterator<Item = RecordBatch> {
        let mut rows = self.rows.into_iter().peekable();
        std::iter::from_fn(move || {
            rows.peek()?;
            let (mut seq, mut id, mut fp) = (
                UInt64Builder::with_capacity(STAGE_ROWS),
                StringBuilder::with_capacity(STAGE_ROWS, STAGE_ROWS * 24),
                StringBuilder::with_capacity(STAGE_ROWS, STAGE_ROWS * 24),
            );
            for s in rows.by_ref().take(STAGE_ROWS) {
                seq.append_value(s.seq);
                id.append_value(hex::encode(s.id));
                fp.append_value(hex::encode(s.fp));
            }
            let cols: Vec<ArrayRef> = vec![
                Arc::new(seq.finish()),
                Arc::new(id.finish()),
                Arc::new(fp.finish()),
            ];
            Some(RecordBatch::try_new(ids_schema(), cols).expect("ids batch matches its schema"))
        })
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
            .flat_map(|b| {
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
        assert!(s.add(&ids(&[(0, A, F1), (1, B, F2)])));
        assert!(!s.add(&ids(&[(6, C, F1), (7, "xyz", F1)])));
        assert!(!s.add(&ids(&[(8, C, "short")])));
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
                assert!(s.add(&ids(r)));
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
        assert!(s.add(&ids(&rows[..1000])));
        assert!(!s.add(&ids(&rows[1000..])));
        assert!(s.add(&ids(&rows[1000..1024])));
        assert!(s.all_distinct());
        let got = held(s);
        assert_eq!(got.len(), 1024);
        assert_eq!(got[1023], (1023, format!("{:024x}", 1023), F1.to_string()));
    }
}
