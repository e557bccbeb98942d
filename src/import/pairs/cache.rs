//! The requests read lately, shared by every parse thread of a file, so a log that sends
//! each request many times parses each distinct request about once.
//!
//! Request texts are known by their XXH3-128 ([`text_hash`]), not compared byte for byte:
//! a lookup then reads a 16-byte key in the table instead of chasing the text it holds (a
//! cache miss and a compare of a few hundred bytes per line, a twelfth of the import's CPU
//! on a shuffled log). Two distinct texts share a 128-bit hash with a chance of about
//! n^2 / 2^129: below 10^-20 for a billion distinct requests. XXH3 is not a cryptographic
//! hash, so a file built to collide could alias two requests of its own; the keys written
//! to the tables are SHA-256 digests computed from the parsed request as before.

use super::*;
use crate::import::fast_hash::FastHash;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// Lines a parse task takes in order (and so the reach of the last-request reuse).
pub(super) const SLICE_LINES: usize = 256;

/// Distinct request texts a [`RequestCache`] generation holds at most (about 40 MB of
/// requests and what they gave at the bench's sizes; the cache holds two generations):
/// more than the requests of a shuffled block of a log that repeats each request (5,000
/// cases x 5 models in the bench's repeated corpus).
pub(super) const CACHED_REQUESTS: usize = 32_768;

/// Shards of a [`RequestCache`], so the parse threads rarely wait on one lock.
pub(super) const CACHE_SHARDS: usize = 16;

/// What the requests read lately gave, by their text's hash, shared by every parse
/// thread of a file: a log that sends each request many times (samples, models, retries),
/// in any order, parses each distinct request (and writes its keys) about once, not once
/// per line. [`request`] is a function of the text alone, so a cached request is the one
/// a parse would give. Each shard holds two generations: when the newer fills, it becomes
/// the older and the older is dropped, and a request found in the older moves to the newer.
/// So memory stays bounded whatever the corpus, and the requests still in use survive a
/// turnover (a shard emptied at once lost them all: a third more parses on the bench's
/// shuffled corpus).
///
/// A cache that rarely hits costs more than it saves (a request kept is a copy of its
/// text, an insertion, and later a drop, about a third of what parsing it again costs):
/// a log whose repeats sit on neighbouring lines (samples in a row) finds them in
/// [`Seen::last`], not here. So every [`STATS_WINDOW`] lookups the cache measures its hit
/// rate, and after [`COLD_AFTER`] windows in a row below [`COLD_HIT_RATE`] it goes cold: it
/// keeps and looks up only one request in [`COLD_SAMPLE`] (by hash, so a request is always
/// or never sampled), which measures on, and warms up again when those hit. Several
/// windows, so a log that repeats its requests a pass later (epochs of up to 64k lines)
/// finds them held when the second pass starts.
#[derive(Default)]
pub(super) struct RequestCache {
    /// The test the requests' case ids are computed for (`--test`, else "imported").
    pub(super) test: Arc<str>,
    pub(super) shards: [Shard; CACHE_SHARDS],
    pub(super) lookups: AtomicU32,
    pub(super) hits: AtomicU32,
    /// Windows in a row below the hit rate.
    low: AtomicU32,
    cold: AtomicBool,
    /// The models the file's requests name, each as one `Arc` ([`RequestCache::shared_model`]).
    models: Mutex<Vec<Arc<str>>>,
}

/// Models a [`RequestCache`] shares at most (a log names a handful).
pub(super) const SHARED_MODELS: usize = 64;

impl RequestCache {
    /// `model` as the one `Arc` every request of the file naming it shares (the first
    /// [`SHARED_MODELS`] models): the sink then tells a record's model by its pointer
    /// (`sink::staging::Models`) instead of reading its text, which the parse thread wrote
    /// and the sink's thread has not read (a cache miss per record, 3% of an import).
    /// Called once per distinct request.
    pub(super) fn shared_model(&self, model: Arc<str>) -> Arc<str> {
        let mut models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = models.iter().find(|m| ***m == *model) {
            return m.clone();
        }
        if models.len() < SHARED_MODELS {
            models.push(model.clone());
        }
        model
    }
}

/// Lookups per measure of the hit rate.
pub(super) const STATS_WINDOW: u32 = 16_384;

/// Below this share of lookups that hit (one in four), the cache goes cold.
pub(super) const COLD_HIT_RATE: (u32, u32) = (1, 4);

/// Windows in a row below [`COLD_HIT_RATE`] before the cache goes cold.
pub(super) const COLD_AFTER: u32 = 4;

/// A cold cache still serves one request in this many.
pub(super) const COLD_SAMPLE: u64 = 16;

/// A [`RequestCache`] shard: request text to what it gave, newer and older generation.
pub(super) type Shard = Mutex<[Generation; 2]>;

/// Request texts' hashes to what they gave.
pub(super) type Generation = HashMap<u128, Arc<Request>, FastHash>;

/// The requests a parse slice has read: the last line's (by its text's hash), and the
/// file's cache.
pub(super) struct Seen<'a> {
    pub(super) cache: &'a RequestCache,
    pub(super) last: Option<(u128, Arc<Request>)>,
    /// Lookups and hits of this slice not yet added to the cache's counts.
    uncounted: (u32, u32),
}

/// Lookups a [`Seen`] counts before adding them to its cache's counts: the parse threads
/// then share those counters' cache line once in this many lookups, not on every one (two
/// atomic adds per lookup on a line both cores wrote were half of a lookup's time).
pub(super) const COUNT_BATCH: u32 = 64;

impl<'a> Seen<'a> {
    pub(super) fn new(cache: &'a RequestCache) -> Self {
        Seen {
            cache,
            last: None,
            uncounted: (0, 0),
        }
    }

    /// [`RequestCache::get`], counted toward the cache's hit rate.
    pub(super) fn lookup(&mut self, hash: u128) -> Cached {
        let found = self.cache.get(hash);
        if !matches!(found, Cached::Skipped) {
            self.uncounted.0 += 1;
            self.uncounted.1 += u32::from(matches!(found, Cached::Hit(_)));
            if self.uncounted.0 >= COUNT_BATCH {
                let (lookups, hits) = std::mem::take(&mut self.uncounted);
                self.cache.count(lookups, hits);
            }
        }
        found
    }
}

impl Drop for Seen<'_> {
    fn drop(&mut self) {
        let (lookups, hits) = std::mem::take(&mut self.uncounted);
        if lookups > 0 {
            self.cache.count(lookups, hits);
        }
    }
}

/// A request text's key in [`Seen`] and [`RequestCache`] (see the module documentation).
pub(super) fn text_hash(text: &str) -> u128 {
    twox_hash::XxHash3_128::oneshot(text.as_bytes())
}

/// What a [`RequestCache`] lookup found.
pub(super) enum Cached {
    Hit(Arc<Request>),
    /// Not held: [`RequestCache::put`] it once parsed.
    Miss,
    /// The cache is cold and the text not sampled: parse it, do not keep it.
    Skipped,
}

impl RequestCache {
    pub(super) fn new(test: &str) -> Self {
        RequestCache {
            test: test.into(),
            ..RequestCache::default()
        }
    }

    pub(super) fn shard(&self, hash: u128) -> &Shard {
        &self.shards[(hash >> 124) as usize % CACHE_SHARDS]
    }

    /// The request of the text whose [`text_hash`] is `hash` (not counted toward the hit
    /// rate: [`Seen::lookup`] counts, or [`RequestCache::count`]).
    pub(super) fn get(&self, hash: u128) -> Cached {
        if self.cold.load(Ordering::Relaxed) && !(hash as u64).is_multiple_of(COLD_SAMPLE) {
            return Cached::Skipped;
        }
        let found = {
            let mut shard = self.shard(hash).lock().unwrap_or_else(|e| e.into_inner());
            let [newer, older] = &mut *shard;
            match newer.get(&hash) {
                Some(rq) => Some(rq.clone()),
                None => {
                    let rq = older.get(&hash).cloned();
                    // Moved (not copied) while the newer has room; else it stays older.
                    if rq.is_some()
                        && newer.len() < CACHED_REQUESTS / CACHE_SHARDS
                        && let Some((hash, rq)) = older.remove_entry(&hash)
                    {
                        newer.insert(hash, rq);
                    }
                    rq
                }
            }
        };
        match found {
            Some(rq) => Cached::Hit(rq),
            None => Cached::Miss,
        }
    }

    /// Adds `lookups` lookups of which `hits` hit to the window's counts, and ends the
    /// window when they reach [`STATS_WINDOW`].
    pub(super) fn count(&self, lookups: u32, hits: u32) {
        let hits = self.hits.fetch_add(hits, Ordering::Relaxed) + hits;
        let before = self.lookups.fetch_add(lookups, Ordering::Relaxed);
        let seen = before + lookups;
        if before < STATS_WINDOW && seen >= STATS_WINDOW {
            // The thread whose lookups reach the window ends it (others may count a batch
            // into either).
            let (num, den) = COLD_HIT_RATE;
            if hits * den < seen * num {
                let low = self.low.fetch_add(1, Ordering::Relaxed) + 1;
                self.cold.store(low >= COLD_AFTER, Ordering::Relaxed);
            } else {
                self.low.store(0, Ordering::Relaxed);
                self.cold.store(false, Ordering::Relaxed);
            }
            self.hits.store(0, Ordering::Relaxed);
            self.lookups.store(0, Ordering::Relaxed);
        }
    }

    pub(super) fn put(&self, hash: u128, rq: Arc<Request>) {
        let mut shard = self.shard(hash).lock().unwrap_or_else(|e| e.into_inner());
        let [newer, older] = &mut *shard;
        if newer.len() >= CACHED_REQUESTS / CACHE_SHARDS {
            *older = std::mem::take(newer);
        }
        newer.insert(hash, rq);
    }
}
