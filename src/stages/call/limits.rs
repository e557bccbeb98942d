//! Client-side limits: requests and tokens per minute, and retry backoff.
//!
//! The token bucket is written here rather than taken from a crate: `governor` (the
//! well-kept choice) limits cells of equal weight and would need a second bucket plus a
//! manual refund path for the tokens-per-minute budget, whose cost is only known after
//! the answer arrives. Forty lines of bucket with `debit` / `refund` is simpler than
//! adapting it, and adds no dependency.

use std::time::Duration;

use rand::Rng;
use tokio::sync::Mutex;
use tokio::time::Instant;

/// A token bucket that keeps every 60 s window within a per-minute limit: it holds a burst
/// of one second's worth (`max(1, limit / 60)` units) and refills at
/// `(limit - burst) / 60` units per second, so a window of `w` seconds admits at most
/// `burst + (limit - burst) * w / 60` units, which is the limit at one minute.
///
/// A bucket as deep as the whole minute (the obvious choice) admits a full minute's burst
/// at once *and* a minute's refill after it: twice the limit in the first minute, and a
/// burst providers that enforce their limits over shorter periods refuse with 429s.
#[derive(Debug)]
pub struct Bucket {
    capacity: f64,
    rate_per_sec: f64,
    state: Mutex<(f64, Instant)>,
}

impl Bucket {
    /// A full bucket allowing `per_minute` units in any minute.
    pub fn per_minute(per_minute: u32) -> Self {
        let limit = f64::from(per_minute.max(1));
        let capacity = (limit / 60.0).max(1.0);
        // A limit of 1 a minute has no room for a burst beside its refill; the half-open
        // minute after a take still admits only one more.
        let refill = if limit > capacity {
            limit - capacity
        } else {
            limit
        };
        Self {
            capacity,
            rate_per_sec: refill / 60.0,
            state: Mutex::new((capacity, Instant::now())),
        }
    }

    /// Waits until `units` are available and takes them. A request larger than the whole
    /// bucket waits for a full bucket and then takes all its units, leaving the level
    /// negative, so later requests wait for what it used beyond the bucket.
    pub async fn take(&self, units: f64) {
        let units = units.max(0.0);
        let need = units.min(self.capacity);
        loop {
            let wait = {
                let mut s = self.state.lock().await;
                let now = Instant::now();
                let level = (s.0 + now.duration_since(s.1).as_secs_f64() * self.rate_per_sec)
                    .min(self.capacity);
                if level >= need {
                    *s = (level - units, now);
                    return;
                }
                *s = (level, now);
                Duration::from_secs_f64((need - level) / self.rate_per_sec)
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// Adjusts the level after the true cost is known: positive `units` are taken
    /// (possibly driving the level negative), negative ones refunded.
    pub async fn adjust(&self, units: f64) {
        let mut s = self.state.lock().await;
        s.0 = (s.0 - units).min(self.capacity);
    }
}

/// Requests-per-minute and tokens-per-minute budgets of one provider.
#[derive(Debug, Default)]
pub struct Limits {
    pub requests: Option<Bucket>,
    pub tokens: Option<Bucket>,
}

impl Limits {
    pub fn new(rpm: Option<u32>, tpm: Option<u32>) -> Self {
        Self {
            requests: rpm.map(Bucket::per_minute),
            tokens: tpm.map(Bucket::per_minute),
        }
    }

    /// Waits for one request and `est_tokens` tokens.
    pub async fn acquire(&self, est_tokens: f64) {
        if let Some(r) = &self.requests {
            r.take(1.0).await;
        }
        if let Some(t) = &self.tokens {
            t.take(est_tokens).await;
        }
    }

    /// Settles the token estimate against what the server reported.
    pub async fn settle(&self, est_tokens: f64, actual_tokens: Option<f64>) {
        if let (Some(t), Some(actual)) = (&self.tokens, actual_tokens) {
            t.adjust(actual - est_tokens).await;
        }
    }
}

/// Base and cap of the exponential backoff.
pub const BACKOFF_BASE: Duration = Duration::from_millis(200);
pub const BACKOFF_CAP: Duration = Duration::from_secs(20);

/// The wait before retry number `retry` (1-based): "full jitter" (uniform in
/// `[0, min(cap, base * 2^(retry-1))]`, after the AWS architecture blog), but never less
/// than the server's `Retry-After`.
pub fn backoff(retry: u32, retry_after: Option<Duration>) -> Duration {
    let exp = BACKOFF_BASE.as_secs_f64() * 2f64.powi(retry.saturating_sub(1).min(30) as i32);
    let ceiling = exp.min(BACKOFF_CAP.as_secs_f64());
    let jitter = Duration::from_secs_f64(rand::thread_rng().gen_range(0.0..=ceiling));
    match retry_after {
        Some(ra) => ra.max(jitter),
        None => jitter,
    }
}

/// Parses a `Retry-After` header given in seconds (the HTTP-date form is ignored: the
/// exponential backoff applies instead).
pub fn parse_retry_after(v: &str) -> Option<Duration> {
    let secs: f64 = v.trim().parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(600.0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_bounded_and_honours_retry_after() {
        for r in 1..40 {
            assert!(backoff(r, None) <= BACKOFF_CAP);
        }
        assert!(backoff(1, Some(Duration::from_secs(3))) >= Duration::from_secs(3));
        assert_eq!(parse_retry_after(" 2 "), Some(Duration::from_secs(2)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), None);
    }

    #[tokio::test]
    async fn bucket_paces_after_a_one_second_burst() {
        // 600 per minute: a burst of 10, then 590 a minute (one every ~102 ms).
        let b = Bucket::per_minute(600);
        let t0 = Instant::now();
        for _ in 0..10 {
            b.take(1.0).await;
        }
        assert!(
            t0.elapsed() < Duration::from_millis(50),
            "a full bucket bursts"
        );
        b.take(2.0).await;
        let e = t0.elapsed();
        assert!(
            e >= Duration::from_millis(195) && e < Duration::from_millis(400),
            "{e:?}"
        );
        // A take larger than the bucket runs once the bucket is full and leaves a debt.
        let b = Bucket::per_minute(600);
        b.take(25.0).await;
        let t0 = Instant::now();
        b.take(1.0).await;
        let e = t0.elapsed();
        assert!(e >= Duration::from_millis(1500), "{e:?}");
    }

    #[test]
    fn every_minute_holds_at_most_the_limit() {
        for limit in [1u32, 2, 30, 59, 60, 61, 600, 100_000] {
            let b = Bucket::per_minute(limit);
            // A minute's admissions from a full bucket: the burst plus 60 s of refill. At
            // 1 a minute that is 2 over a closed minute, 1 over any half-open one.
            let admitted = b.capacity + b.rate_per_sec * 60.0;
            let bound = if limit == 1 { 2.0 } else { f64::from(limit) };
            assert!((admitted - bound).abs() < 1e-9, "{limit}: {admitted}");
            assert!(b.capacity >= 1.0 && b.rate_per_sec > 0.0, "{limit}");
        }
    }
}
