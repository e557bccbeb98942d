//! The adaptive deadline: a request far slower than the healthy ones is abandoned early.
//!
//! A hung request (a server that accepted the connection and never answers) otherwise holds
//! its concurrency slot for the whole `timeout_secs`: with 2% of requests hanging and a 60 s
//! timeout, every slot fills with hung requests within seconds and the run stalls (20k judge
//! calls took 189 s instead of 5). Each provider keeps the latencies of its recent completed
//! requests, per size (the request's `max_tokens`, in powers of two: a long generation is
//! legitimately slower), and a request in flight is abandoned once it has waited
//! `hang_factor` times the 95th percentile of its size's latencies (never less than
//! `hang_floor_secs`, never more than `timeout_secs`), then retried as any timeout is,
//! counted in the row's attempts. The deadline is re-read while a request waits, so the
//! requests sent before any latency was known are also abandoned once it is.
//!
//! Written here rather than taken from a crate: what is needed is a windowed percentile per
//! bucket, read often and updated on every completion, about sixty lines.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// Completions a size must have before its deadline adapts.
const MIN_SAMPLES: usize = 32;
/// Latencies kept per size (the most recent).
const WINDOW: usize = 512;
/// The percentile recomputed after this many completions of a size.
const REFRESH: usize = 16;

#[derive(Debug, Default)]
struct Bucket {
    recent: Vec<f64>,
    next: usize,
    seen: usize,
    p95: Option<f64>,
}

/// The latencies of one provider's completed requests, and the deadline they give.
#[derive(Debug)]
pub struct Deadlines {
    factor: f64,
    floor: Duration,
    timeout: Duration,
    buckets: Mutex<HashMap<u32, Bucket>>,
}

/// The size bucket of a request: its `max_tokens` rounded up to a power of two.
pub fn bucket(max_tokens: Option<u32>) -> u32 {
    max_tokens.unwrap_or(0).next_power_of_two()
}

impl Deadlines {
    /// `factor` 0 disables the adaptive deadline (every request gets `timeout`).
    pub fn new(factor: f64, floor: Duration, timeout: Duration) -> Self {
        Deadlines {
            factor,
            floor,
            timeout,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Records a completed request's latency.
    pub fn record(&self, bucket: u32, latency: Duration) {
        if self.factor <= 0.0 {
            return;
        }
        let mut map = self.buckets.lock().expect("deadline lock");
        let b = map.entry(bucket).or_default();
        let secs = latency.as_secs_f64();
        if b.recent.len() < WINDOW {
            b.recent.push(secs);
        } else {
            b.recent[b.next] = secs;
        }
        b.next = (b.next + 1) % WINDOW;
        b.seen += 1;
        if b.seen >= MIN_SAMPLES && (b.p95.is_none() || b.seen.is_multiple_of(REFRESH)) {
            let mut v = b.recent.clone();
            v.sort_by(f64::total_cmp);
            b.p95 = Some(v[((v.len() as f64 * 0.95).ceil() as usize).clamp(1, v.len()) - 1]);
        }
    }

    /// How long a request of `bucket` may wait now, and the percentile it came from (None
    /// while the size has too few completions, or when the deadline is off).
    pub fn limit(&self, bucket: u32) -> (Duration, Option<f64>) {
        if self.factor <= 0.0 {
            return (self.timeout, None);
        }
        let p95 = self
            .buckets
            .lock()
            .expect("deadline lock")
            .get(&bucket)
            .and_then(|b| b.p95);
        match p95 {
            Some(p) => {
                let d = Duration::from_secs_f64(p * self.factor).max(self.floor);
                (d.min(self.timeout), Some(p))
            }
            None => (self.timeout, None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The deadline is `timeout` until 32 completions, then factor x p95 (floored, capped),
    /// per size.
    #[test]
    fn the_deadline_follows_the_95th_percentile_of_its_size() {
        let d = Deadlines::new(8.0, Duration::from_millis(200), Duration::from_secs(60));
        for i in 0..31 {
            d.record(bucket(Some(16)), Duration::from_millis(50 + i % 2));
        }
        assert_eq!(d.limit(bucket(Some(16))), (Duration::from_secs(60), None));
        // 96 latencies 1..=96 ms (the percentile is refreshed every 16 completions): the
        // 95th percentile is the 92nd smallest, 92 ms, and the deadline 8 x 92 ms.
        let d = Deadlines::new(8.0, Duration::from_millis(200), Duration::from_secs(60));
        for ms in 1..=96u64 {
            d.record(bucket(Some(16)), Duration::from_millis(ms));
        }
        let (limit, p) = d.limit(bucket(Some(10)));
        assert!((p.unwrap() - 0.092).abs() < 1e-12, "{p:?}");
        assert!((limit.as_secs_f64() - 0.736).abs() < 1e-9, "{limit:?}");
        // Another size has its own latencies; the floor and the timeout bound the deadline.
        assert_eq!(d.limit(bucket(Some(1024))).0, Duration::from_secs(60));
        let fast = Deadlines::new(2.0, Duration::from_millis(300), Duration::from_secs(60));
        let slow = Deadlines::new(8.0, Duration::from_millis(300), Duration::from_secs(1));
        for _ in 0..40 {
            fast.record(0, Duration::from_millis(10));
            slow.record(0, Duration::from_millis(900));
        }
        assert_eq!(fast.limit(0).0, Duration::from_millis(300));
        assert_eq!(slow.limit(0).0, Duration::from_secs(1));
        let off = Deadlines::new(0.0, Duration::from_millis(300), Duration::from_secs(7));
        off.record(0, Duration::from_millis(10));
        assert_eq!(off.limit(0), (Duration::from_secs(7), None));
    }
}
