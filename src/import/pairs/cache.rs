//! The requests read lately, shared by every parse thread of a file, so a log that sends
//! each request many times parses each distinct request about once.

use super::*;

/// Lines a parse task takes in order (and so the reach of the last-request reuse).
pub(super) const SLICE_LINES: usize = 256;

/// Distinct request texts a [`RequestCache`] holds at most (about 40 MB of requests and
/// what they gave at the bench's sizes): more than the requests of a shuffled block of a
/// log that repeats each request (5,000 cases x 5 models in the bench's repeated corpus).
pub(super) const CACHED_REQUESTS: usize = 32_768;

/// Shards of a [`RequestCache`], so the parse threads rarely wait on one lock.
pub(super) const CACHE_SHARDS: usize = 16;

/// What the requests read lately gave, by their text byte for byte, shared by every parse
/// thread of a file: a log that sends each request many times (samples, models, retries),
/// in any order, parses each distinct request (and writes its keys) about once, not once
/// per line. [`request`] is a function of the text alone, so a cached request is the one
/// a parse would give. A shard that fills is emptied: memory stays bounded whatever the
/// corpus, at the cost of parsing its requests again.
#[derive(Default)]
pub(super) struct RequestCache {
    pub(super) shards: [Shard; CACHE_SHARDS],
}

/// A [`RequestCache`] shard: request text to what it gave.
pub(super) type Shard = Mutex<HashMap<Box<str>, Arc<Request>, FastHash>>;

/// The requests a parse slice has read: the last line's, and the file's cache.
pub(super) struct Seen<'a> {
    pub(super) cache: &'a RequestCache,
    pub(super) last: Option<(String, Arc<Request>)>,
}

impl RequestCache {
    pub(super) fn shard(&self, text: &str) -> &Shard {
        use std::hash::BuildHasher;
        &self.shards[(FastHash.hash_one(text) >> 60) as usize % CACHE_SHARDS]
    }

    pub(super) fn get(&self, text: &str) -> Option<Arc<Request>> {
        let shard = self.shard(text).lock().unwrap_or_else(|e| e.into_inner());
        shard.get(text).cloned()
    }

    pub(super) fn put(&self, text: &str, rq: Arc<Request>) {
        let mut shard = self.shard(text).lock().unwrap_or_else(|e| e.into_inner());
        if shard.len() >= CACHED_REQUESTS / CACHE_SHARDS {
            shard.clear();
        }
        shard.insert(text.into(), rq);
    }
}

/// A hash of request texts eight bytes at a time: a table's keys are compared in full, so
/// it only needs to spread them, and SipHash over every request of a corpus costs about as
/// much as the SHA-256 of it.
#[derive(Default, Clone, Copy)]
pub(super) struct FastHash;

impl std::hash::BuildHasher for FastHash {
    type Hasher = FastHasher;
    fn build_hasher(&self) -> FastHasher {
        FastHasher(0x243f_6a88_85a3_08d3)
    }
}

pub(super) struct FastHasher(u64);

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
