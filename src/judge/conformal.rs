//! Residual-normalised split conformal intervals (Lei et al. 2018, section 5.2).
//!
//! With a mean model `mu` and a scale model `sigma` (fitted for |residual| on the training
//! split), the nonconformity score of a calibration row is `|y - mu(x)| / sigma(x)`; the
//! threshold is its conformal quantile (the k-th smallest, k = ceil((n + 1)(1 - alpha)),
//! exactly as the `conformal_quantile` SQL function computes it), and a new row's interval is
//! `mu(x) ± q sigma(x)`: wide where the scale model expects large errors.

use crate::udaf::conformal_quantile::{conformal_k, conformal_quantile};

/// The fitted threshold.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Calibration {
    /// Miscoverage: intervals aim to cover with probability at least 1 - alpha.
    pub alpha: f64,
    /// The threshold on normalised residuals (+inf when there are too few calibration rows).
    pub q: f64,
    /// Calibration rows.
    pub n: usize,
    /// The rank of `q` among the calibration scores.
    pub k: u64,
}

/// Calibrates on rows with label `y`, mean prediction `mu` and scale `sigma` (> 0).
///
/// # Behavior
/// Rows with a non-finite score are skipped. No rows gives `q = +inf`.
pub fn calibrate(y: &[f64], mu: &[f64], sigma: &[f64], alpha: f64) -> Calibration {
    let mut scores: Vec<f64> = y
        .iter()
        .zip(mu)
        .zip(sigma)
        .map(|((y, m), s)| (y - m).abs() / s)
        .filter(|r| r.is_finite())
        .collect();
    let n = scores.len();
    let q = conformal_quantile(&mut scores, alpha).unwrap_or(f64::INFINITY);
    Calibration {
        alpha,
        q,
        n,
        k: conformal_k(n as u64, alpha),
    }
}

impl Calibration {
    /// The interval `mu ± q sigma`.
    pub fn interval(&self, mu: f64, sigma: f64) -> (f64, f64) {
        (mu - self.q * sigma, mu + self.q * sigma)
    }
}

/// The fraction of `y` inside `[lo, hi]`; NaN when empty.
pub fn coverage(y: &[f64], lo: &[f64], hi: &[f64]) -> f64 {
    let n = y.len();
    let hit = y
        .iter()
        .zip(lo.iter().zip(hi))
        .filter(|(y, (l, h))| *l <= *y && *y <= *h)
        .count();
    hit as f64 / n as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_rank_and_interval() {
        // 99 calibration rows with scores 1..=99, alpha 0.1: k = 90, q = 90.
        let y: Vec<f64> = (1..=99).map(f64::from).collect();
        let c = calibrate(&y, &vec![0.0; 99], &vec![1.0; 99], 0.1);
        assert_eq!((c.k, c.q, c.n), (90, 90.0, 99));
        assert_eq!(c.interval(1.0, 0.5), (-44.0, 46.0));
        // Too few rows for the level: unbounded.
        let c = calibrate(&[1.0, 2.0], &[0.0, 0.0], &[1.0, 1.0], 0.1);
        assert!(c.q.is_infinite());
        assert_eq!(coverage(&[1.0, 5.0], &[0.0, 0.0], &[2.0, 2.0]), 0.5);
    }
}
