//! Whether every case's fields were staged on one row: then `cases` is the case staging
//! projected, not found by the plans' aggregate and join.
//!
//! A case's fields are staged when its record follows another case's (and the case was
//! not staged lately with the same `expected` and cluster), or when its `expected`
//! changes. When no case id is staged twice, each staged row is its case's first record,
//! with the only `expected` and cluster the plans would see: the aggregate's first row,
//! first or last `expected` and `bool_or(cluster IS NOT NULL)` are that row's own, and no
//! case can hold two `expected`. The usual corpus (a case's records together, or a few
//! thousand cases shuffled) stages each case once; the plans it skips were about a
//! fifteenth of a 1M-record import, run after the stream on one core.
//!
//! `EVALFLOW_IMPORT_CASES_BY_PLAN` (set to anything) always takes the plans, so tests can
//! compare both ways on one corpus.

use crate::import::fast_hash::FastHash;

/// The case ids staged so far (as [`super::Keys::case_num`]), while none repeats.
pub(super) struct DistinctCases {
    staged: std::collections::HashSet<u128, FastHash>,
    cap: usize,
    /// Staged rows that name a cluster.
    clustered: u64,
}

impl DistinctCases {
    /// Within a sixteenth of the memory limit: a 16-byte key and a control byte per case,
    /// at most 7/8 of a table's slots used and two tables while it doubles, so at worst
    /// about 48 bytes a case (1.4M cases at 1 GiB).
    /// `None` when `EVALFLOW_IMPORT_CASES_BY_PLAN` is set.
    pub(super) fn new(memory_limit: usize) -> Option<Self> {
        if std::env::var_os("EVALFLOW_IMPORT_CASES_BY_PLAN").is_some() {
            return None;
        }
        Some(Self::bounded(memory_limit))
    }

    fn bounded(memory_limit: usize) -> Self {
        DistinctCases {
            staged: Default::default(),
            cap: (memory_limit / 16 / 48).max(1024),
            clustered: 0,
        }
    }

    /// Notes a staged case row; `false` when its case was staged before, its id is not a
    /// digest (`None`), or the cases outgrow their bound: the caller then drops `self`
    /// and the plans find each case's first record.
    pub(super) fn add(&mut self, case_num: Option<u128>, clustered: bool) -> bool {
        let Some(n) = case_num else {
            return false;
        };
        if self.staged.len() >= self.cap || !self.staged.insert(n) {
            return false;
        }
        self.clustered += u64::from(clustered);
        true
    }

    /// Cases whose row names a cluster.
    pub(super) fn clustered(&self) -> u64 {
        self.clustered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A case staged twice, a case id that is not a digest, or one case past the bound
    /// ends the distinct path; until then the clustered rows are counted.
    #[test]
    fn a_case_staged_twice_or_past_the_bound_ends_it() {
        let mut d = DistinctCases::bounded(0);
        assert_eq!(d.cap, 1024);
        assert!(d.add(Some(1), true));
        assert!(d.add(Some(2), false));
        assert_eq!(d.clustered(), 1);
        assert!(!d.add(Some(1), false));
        assert!(!DistinctCases::bounded(0).add(None, false));
        let mut full = DistinctCases::bounded(0);
        for n in 0..1024 {
            assert!(full.add(Some(n), n % 2 == 0));
        }
        assert_eq!(full.clustered(), 512);
        assert!(!full.add(Some(5000), false));
    }
}
