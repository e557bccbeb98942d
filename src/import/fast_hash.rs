//! A cheap hasher for the import's per-record tables.

/// A hash of texts and digests eight bytes at a time, for the import's tables looked up once
/// per record (the request cache, the sink's counts and recent cases): a table's keys are
/// compared in full, so it only needs to spread them, and SipHash over every request of a
/// corpus costs about as much as the SHA-256 of it.
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHash;

impl std::hash::BuildHasher for FastHash {
    type Hasher = FastHasher;
    fn build_hasher(&self) -> FastHasher {
        FastHasher(0x243f_6a88_85a3_08d3)
    }
}

pub(crate) struct FastHasher(u64);

impl std::hash::Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(K);
        }
        let mut tail = [0u8; 8];
        tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
        self.0 =
            (self.0.rotate_left(5) ^ u64::from_le_bytes(tail) ^ bytes.len() as u64).wrapping_mul(K);
    }

    fn finish(&self) -> u64 {
        // Mix the high bits down: the table uses the low ones, the shard the top four.
        let x = self.0 ^ (self.0 >> 29);
        x.wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ (x >> 32)
    }
}
