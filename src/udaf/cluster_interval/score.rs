//! Score intervals: Wilson at an effective size, the clustered score interval for pass/fail
//! rates with its floored-variance quantile, and Tango's score interval for paired
//! proportions with design effects.

use statrs::distribution::{ChiSquared, ContinuousCDF};
use statrs::function::erf::erfc;
use statrs::function::gamma::ln_gamma;

use super::*;
use crate::udaf::common::finite;

/// The Wilson score interval for a proportion `p` at effective size `n_eff` and multiplier `z`.
pub fn wilson(p: f64, n_eff: f64, z: f64) -> (f64, f64) {
    if n_eff <= 0.0 || !n_eff.is_finite() {
        return (0.0, 1.0);
    }
    let z2 = z * z;
    let denom = 1.0 + z2 / n_eff;
    let centre = (p + z2 / (2.0 * n_eff)) / denom;
    let half = z * ((p * (1.0 - p) / n_eff).max(0.0) + z2 / (4.0 * n_eff * n_eff)).sqrt() / denom;
    // At p = 0 (1) the bound is 0 (1) exactly; the difference can round to a speck above it.
    let lo = if p <= 0.0 {
        0.0
    } else {
        (centre - half).max(0.0)
    };
    let hi = if p >= 1.0 {
        1.0
    } else {
        (centre + half).min(1.0)
    };
    (lo, hi)
}

/// The clustered Wilson interval: Wilson at `n_eff = N / deff`, `deff = V / (p (1 - p) / N)`
/// for a cluster-robust variance `V` of the proportion `p`, with multiplier `t`. When `p` is 0
/// or 1, or `V` is 0, the design effect is unknown and taken as 1.
pub fn clustered_wilson(p: f64, n: f64, var: f64, t: f64) -> (f64, f64) {
    let naive = p * (1.0 - p) / n;
    let deff = if naive > 0.0 && var > 0.0 {
        var / naive
    } else {
        1.0
    };
    wilson(p, n / deff, t)
}

/// How fast the between-template variance of a pass rate grows toward 1/2 in
/// [`clustered_score`]: as `r^1.25` in `r = p0 (1 - p0) / (p (1 - p))`. A constant ICC on the
/// observed scale (beta-binomial, Wilson) gives `r`; a constant template variance on the logit
/// scale gives about `r^2` (delta method; `r^1.6` to `r^1.7` for rare rates at latent ICC 0.3).
/// With the size-weighted between variance on that side (see [`clustered_score_sided`]), 1.25
/// held coverage at 94% or more from 20 templates in 12,000- and 10,000-replication numpy
/// simulations of `benches/coverage.rs`'s designs, at the width 1.5 gave without it; 1.5 with
/// it was 1.25x the oracle at 20 templates.
pub const SCORE_EXPONENT: f64 = 1.25;

/// The smallest design effect the bound away from 1/2 takes in [`clustered_score`] when the
/// cluster-robust variance comes out below the binomial one (it is weighed in by the skewness
/// `|1 - 2p|`, so at a rate of 1/2 the design effect stays 1). Only a guard against a zero
/// width: when every template has the same rate the CR2 variance is 0. Coverage in
/// `scripts/coverage_sim.py` did not move by 0.1 point between 1/2 and no floor at all.
pub const NEAR_DEFF_FLOOR: f64 = 0.5;

/// Grid points per side scanned before bisection in [`clustered_score`].
pub(super) const SCORE_GRID: usize = 512;

/// The clustered score interval for a proportion `p` of `n` rows with cluster-robust variance
/// `var` and multiplier `t`, the same variance on both sides: see [`clustered_score_sided`].
///
/// # Example
/// ```
/// use evalflow::udaf::cluster_interval::{clustered_score, clustered_wilson};
/// // 20 failures in 200 rows, a CR2 variance 3x the binomial one, t = 2.1.
/// let var = 3.0 * 0.1 * 0.9 / 200.0;
/// let (lo, hi) = clustered_score(0.1, 200.0, var, 2.1);
/// let (wlo, whi) = clustered_wilson(0.1, 200.0, var, 2.1);
/// assert!((lo - wlo).abs() < 1e-12 && hi > whi + 0.005);
/// ```
pub fn clustered_score(p: f64, n: f64, var: f64, t: f64) -> (f64, f64) {
    clustered_score_sided(p, n, var, var, t)
}

/// The clustered score interval: each bound is the outermost `p0` on its side of `p` with
/// `(p - p0)^2 <= t^2 V(p0)`, `V(p0) = p0 (1 - p0) / n + B max(r, r^SCORE_EXPONENT)`,
/// `r = p0 (1 - p0) / (p (1 - p))`, where `B = var - p (1 - p) / n` (the between-template part
/// of the cluster-robust variance `var`) for the bound away from 1/2, and
/// `B = var_half - p (1 - p) / n` for the bound toward 1/2 (the upper bound when `p <= 1/2`).
///
/// Why: the Wilson interval at `n / deff` assumes the design effect is the same at every
/// candidate `p0`. For rare outcomes with strong template effects the between-template
/// variance grows faster than `p0 (1 - p0)` toward 1/2 (as its square on the logit scale),
/// and the samples whose rate came out low are those that drew few failing templates, so
/// their variance came out low too: upper bounds were too low (92-93% coverage at 20-100
/// templates). Away from 1/2 (`r <= 1`) `V` is Wilson's, so that bound is the Wilson bound at
/// `n / deff`.
///
/// When `B` is not positive the bound toward 1/2 is Wilson's at `n`: template effects are not
/// assumed to cancel noise there, since a rate that came out low came with a variance that
/// came out low. The bound away from 1/2 is Wilson's at `n / deff` with the design effect
/// `deff = var / (p (1 - p) / n)` taken below 1 as well, weighed in by the skewness:
/// `1 - |1 - 2p| (1 - max(deff, NEAR_DEFF_FLOOR))`. The same skewness works for it there: a
/// rate that came out far above the truth came with a variance that came out high, so a
/// variance below the binomial part is seen with rates near or below the truth, whose bound
/// away from 1/2 is not the one at risk. Flooring it at the binomial part instead made rare
/// rates with weak template effects cover up to 96.6% from 20 templates (at exactly 0.05 with
/// 20 templates of 10 even Wilson at `n` covers 96.7% of binomial counts, a peak of the
/// lattice); taking it as estimated brings them to 95.0-96.0% and leaves strong template
/// effects, where such a variance comes with rates far below the truth, within 0.2 points
/// (20,000 replications, two seeds, `scripts/coverage_sim.py`). A rate of 0 or 1 gets Wilson
/// at `n` on both sides, never a zero width.
///
/// [`cluster_interval`] passes (to [`clustered_score_quantiles`])
/// `var_half = var + |1 - 2p| max(0, B_anova - B)`, with `B_anova`
/// from [`anova_between_var`]: CR2 weighs a template's deviation by `n_g^2`, so with unequal
/// sizes a few large templates set both the rate and its variance, and a rate that came out
/// low came with a variance that came out low; the one-way ANOVA estimate weighs by `n_g`.
/// It counts in proportion to the skewness of a rate's estimate, `|1 - 2p|` (nothing at 1/2),
/// and only upward, which keeps CR2's robustness when rates vary with size.
///
/// # Example
/// ```
/// use evalflow::udaf::cluster_interval::{clustered_score, clustered_score_sided};
/// let var = 3.0 * 0.1 * 0.9 / 200.0;
/// let (lo, hi) = clustered_score(0.1, 200.0, var, 2.1);
/// let (lo2, hi2) = clustered_score_sided(0.1, 200.0, var, 2.0 * var, 2.1);
/// assert!(lo2 == lo && hi2 > hi);
/// ```
pub fn clustered_score_sided(p: f64, n: f64, var: f64, var_half: f64, t: f64) -> (f64, f64) {
    clustered_score_quantiles(p, n, var, var_half, t, t)
}

/// The clustered score interval with its own multiplier per side: `t_away` for the bound away
/// from 1/2 (the lower one when `p <= 1/2`) and `t_half` for the bound toward 1/2; otherwise as
/// [`clustered_score_sided`], which is this with `t_away = t_half = t`.
///
/// [`cluster_interval`] passes `t_half = t`, the CR2 quantile, and for `t_away` the quantile
/// of a floored variance weighed in by the skewness `|1 - 2p|` (see [`floored_t_quantile`]).
///
/// # Example
/// ```
/// use evalflow::udaf::cluster_interval::{clustered_score_sided, clustered_score_quantiles};
/// let var = 3.0 * 0.1 * 0.9 / 200.0;
/// let (lo, hi) = clustered_score_sided(0.1, 200.0, var, var, 2.1);
/// let (lo2, hi2) = clustered_score_quantiles(0.1, 200.0, var, var, 2.0, 2.1);
/// assert!(lo2 > lo && hi2 == hi);
/// ```
pub fn clustered_score_quantiles(
    p: f64,
    n: f64,
    var: f64,
    var_half: f64,
    t_away: f64,
    t_half: f64,
) -> (f64, f64) {
    let q = p * (1.0 - p);
    let naive = q / n;
    // (between part, multiplier) of the lower and the upper side.
    let ((b_lo, t_lo), (b_hi, t_hi)) = if p <= 0.5 {
        ((var - naive, t_away), (var_half - naive, t_half))
    } else {
        ((var_half - naive, t_half), (var - naive, t_away))
    };
    // Away from 1/2 a variance below the binomial part narrows the bound (Wilson at n / deff,
    // deff < 1), in proportion to the skewness |1 - 2p| and never below NEAR_DEFF_FLOOR.
    let deff_away = if naive > 0.0 && var < naive {
        1.0 - (1.0 - 2.0 * p).abs() * (1.0 - (var / naive).max(NEAR_DEFF_FLOOR))
    } else {
        1.0
    };
    let (away_lo, away_hi) = wilson(p, n / deff_away, t_away);
    let (fall_lo, fall_hi) = if p <= 0.5 {
        (away_lo, wilson(p, n, t_hi).1)
    } else {
        (wilson(p, n, t_lo).0, away_hi)
    };
    let bound = |between: f64, t: f64, edge: f64, fallback: f64| {
        // Negated so that NaN goes to the fallback too.
        if !(naive > 0.0 && between > 0.0) {
            return fallback;
        }
        let inside = |p0: f64| {
            let w = p0 * (1.0 - p0);
            let r = w / q;
            let v = w / n + between * r.max(r.powf(SCORE_EXPONENT));
            (p - p0) * (p - p0) <= t * t * v
        };
        outermost(p, edge, &inside)
    };
    (
        bound(b_lo, t_lo, 0.0, fall_lo),
        bound(b_hi, t_hi, 1.0, fall_hi),
    )
}

/// Simpson intervals (even) over log u in [`floored_t_quantile`]'s integral.
pub(super) const FLOOR_NODES: usize = 1024;

/// The two-sided `level` quantile of `Z / sqrt(max(kappa, U))`, `Z` standard normal and
/// `U ~ chi^2_df / df` independent of it, but at least the normal quantile: the multiplier for
/// a variance estimate `V_hat = V U` that is floored at a known part `kappa V` of the true
/// variance `V`. It runs from the normal quantile (`kappa = 1`: nothing estimated) to the
/// t(df) quantile (`kappa = 0`). The normal quantile when `df` is `None`; `None` for a `df`
/// or `kappa` that is not positive and finite, or a `level` outside (0, 1).
///
/// Why: the clustered score interval floors the template variance at zero, so its variance is
/// never below the binomial one `p (1 - p) / n`; applying the whole t quantile to a floored
/// variance counts the uncertainty about a small template variance twice, and made the
/// interval for rare outcomes with weak template effects conservative (96.5-97% coverage
/// at 20 templates). The tail `P(|Z| > c sqrt(max(kappa, U)))` is
/// `F(df kappa) 2 Phi(-c sqrt(kappa)) + int_kappa^inf 2 Phi(-c sqrt(u)) f(u) du`, `F`, `f` the
/// chi-square's, integrated by Simpson's rule over log u, and solved for `c` by Newton's
/// method inside a bisection bracket.
///
/// # Example
/// ```
/// use evalflow::udaf::cluster_interval::{floored_t_quantile, t_quantile};
/// let (z, t) = (t_quantile(0.95, None).unwrap(), t_quantile(0.95, Some(9.0)).unwrap());
/// assert!((floored_t_quantile(0.95, Some(9.0), 1e-12).unwrap() - t).abs() < 1e-6);
/// assert_eq!(floored_t_quantile(0.95, Some(9.0), 1.0), Some(z));
/// let c = floored_t_quantile(0.95, Some(9.0), 0.5).unwrap();
/// assert!(z < c && c < t);
/// ```
pub fn floored_t_quantile(level: f64, df: Option<f64>, kappa: f64) -> Option<f64> {
    let z = t_quantile(level, None)?;
    let Some(df) = df else { return Some(z) };
    let t = t_quantile(level, Some(df))?;
    if !(kappa > 0.0 && kappa.is_finite()) {
        return None;
    }
    let kappa = kappa.min(1.0);
    let alpha = 1.0 - level;
    let chi = ChiSquared::new(df).ok()?;
    // U = chi^2 / df; the range of log u where its density matters: beyond 1e-15 of either
    // tail's mass, and no further up than u = 40 (where 2 Phi(-z sqrt(u)) < 1e-25).
    let cdf_u = |u: f64| chi.cdf(df * u);
    let log_u_at = |prob: f64, upper: bool| {
        let (mut lo, mut hi) = (-745.0f64, 40f64.ln());
        for _ in 0..80 {
            let mid = 0.5 * (lo + hi);
            let c = cdf_u(mid.exp());
            let c = if upper { 1.0 - c } else { c };
            // The lower tail grows with u, the upper one shrinks.
            if (c < prob) != upper {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        0.5 * (lo + hi)
    };
    let s_lo = kappa.ln().max(log_u_at(1e-15, false));
    let s_hi = log_u_at(1e-15, true);
    // Mass below kappa sits at kappa; the sliver between kappa and s_lo (less than 1e-15)
    // is counted at its upper end.
    let (below, sliver) = (cdf_u(kappa), cdf_u(s_lo.exp()) - cdf_u(kappa));
    let sliver_at = s_lo.exp();
    // (sqrt u, weight): the point masses, then Simpson weights times the density of log u.
    let mut nodes = vec![(kappa.sqrt(), below), (sliver_at.sqrt(), sliver)];
    if s_hi > s_lo {
        let h = (s_hi - s_lo) / FLOOR_NODES as f64;
        let half = 0.5 * df;
        let log_norm = half * std::f64::consts::LN_2 + ln_gamma(half);
        nodes.extend((0..=FLOOR_NODES).map(|i| {
            let s = s_lo + h * i as f64;
            let u = s.exp();
            let w = match i {
                0 => 1.0,
                i if i == FLOOR_NODES => 1.0,
                i if i % 2 == 1 => 4.0,
                _ => 2.0,
            };
            // df u f(df u), f the chi-square density, in logs.
            let x = df * u;
            (
                u.sqrt(),
                w * h / 3.0 * (half * x.ln() - 0.5 * x - log_norm).exp(),
            )
        }));
    }
    // The tail probability at c and its derivative in c.
    let tail = |c: f64| {
        nodes.iter().fold((0.0, 0.0), |(p, d), &(r, w)| {
            let x = c * r;
            (
                p + w * erfc(x / std::f64::consts::SQRT_2),
                d - w * r * (2.0 / std::f64::consts::PI).sqrt() * (-0.5 * x * x).exp(),
            )
        })
    };
    // The tail falls with c; it is below t's at every c, so the root is below t.
    if tail(z).0 <= alpha {
        return Some(z);
    }
    // Newton's method kept inside a shrinking bracket [lo, hi] (bisection when it leaves it).
    let (mut lo, mut hi, mut c) = (z, t, z);
    for _ in 0..100 {
        let (p, d) = tail(c);
        if p > alpha {
            lo = c;
        } else {
            hi = c;
        }
        let newton = c - (p - alpha) / d;
        let next = if newton > lo && newton < hi && d < 0.0 {
            newton
        } else {
            0.5 * (lo + hi)
        };
        if (next - c).abs() <= 1e-15 * c || hi - lo <= 1e-15 * c {
            c = next;
            break;
        }
        c = next;
    }
    finite(c)
}

/// The point of `[inside_pt, edge]` farthest from `inside_pt` that `inside` accepts: a scan
/// of [`SCORE_GRID`] points from `edge` inward, then bisection between the first accepted
/// point and its outer neighbour. `inside(inside_pt)` must hold.
pub(super) fn outermost(inside_pt: f64, edge: f64, inside: &impl Fn(f64) -> bool) -> f64 {
    if inside(edge) {
        return edge;
    }
    let step = (inside_pt - edge) / SCORE_GRID as f64;
    let mut out = edge;
    let mut inn = inside_pt;
    for j in 1..SCORE_GRID {
        let x = edge + step * j as f64;
        if inside(x) {
            inn = x;
            break;
        }
        out = x;
    }
    // Bisection to the last representable point.
    for _ in 0..200 {
        let mid = 0.5 * (out + inn);
        if mid == out || mid == inn {
            break;
        }
        if inside(mid) {
            inn = mid;
        } else {
            out = mid;
        }
    }
    inn
}

/// Tango's (1998) variance of the mean difference of `n` pass/fail pairs at a hypothesised
/// difference `d0`: `pos` pairs have d = +1 and `neg` have d = -1, and the share of d = -1
/// pairs is its maximum-likelihood value under `d0` (closed form). At `d0` = the observed
/// difference it is the sample variance of d over `n`; at 0 it is McNemar's, (pos + neg) / n^2.
pub fn tango_var(d0: f64, pos: f64, neg: f64, n: f64) -> f64 {
    let w = -pos - neg + (2.0 * n - pos + neg) * d0;
    let q = ((w * w + 8.0 * n * neg * d0 * (1.0 - d0)).max(0.0).sqrt() - w) / (4.0 * n);
    (2.0 * q + d0 * (1.0 - d0)).max(0.0) / n
}

/// The clustered score interval of a mean difference of pass/fail pairs, and its test of 0.
///
/// Tango's score interval with the template part carried by design effects: a hypothesised
/// difference `d0` is inside when `(d - d0)^2 <= t^2 deff V_T(d0)`, `V_T` from [`tango_var`].
/// `V_T` is smallest near `d` and grows on both sides, faster on one: where a difference that
/// came out low (or high) came with a low variance, the side the truth escapes to. That side
/// (judged by `V_T` one naive SE either side of `d`) takes the design effect
/// `var_fast / V_T(d)`, the other `var_slow / V_T(d)`; with no discordant spread (every pair
/// agrees, or all differ the same way) it is 1, as it is where a variance is 0.
/// Returns `(lo, hi, stat)`, `stat = d / sqrt(deff V_T(0))` the clustered McNemar statistic.
pub fn paired_score(
    d: f64,
    n: f64,
    pos: f64,
    neg: f64,
    var_slow: f64,
    var_fast: f64,
    t: f64,
) -> (f64, f64, Option<f64>) {
    let naive = tango_var(d, pos, neg, n);
    let (fast, slow) = if naive > 0.0 {
        let fast = if var_fast > 0.0 {
            var_fast / naive
        } else {
            1.0
        };
        let slow = if var_slow > 0.0 {
            var_slow / naive
        } else {
            fast
        };
        (fast, slow)
    } else {
        (1.0, 1.0)
    };
    let h = naive.sqrt();
    let upper_faster =
        tango_var((d + h).min(1.0), pos, neg, n) >= tango_var((d - h).max(-1.0), pos, neg, n);
    let (deff_lo, deff_hi) = if upper_faster {
        (slow, fast)
    } else {
        (fast, slow)
    };
    let var = |d0: f64| tango_var(d0, pos, neg, n) * if d0 < d { deff_lo } else { deff_hi };
    let inside = |d0: f64| (d - d0).powi(2) <= t * t * var(d0);
    let lo = outermost(d, -1.0, &inside);
    let hi = outermost(d, 1.0, &inside);
    let v0 = var(0.0);
    let stat = if v0 > 0.0 {
        finite(d / v0.sqrt())
    } else {
        None
    };
    (lo, hi, stat)
}
