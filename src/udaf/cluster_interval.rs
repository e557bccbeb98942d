//! Intervals for the mean of clustered data that keep their coverage with few clusters.
//!
//! Eval cases come from templates, and cases of one template are not independent. The
//! classic clustered standard errors (Miller's, CR1) are biased down when there are few
//! clusters, and a normal quantile on top of them makes a nominal 95% interval cover 90% or
//! less with 10-20 templates. This module holds the remedies from the few-clusters literature
//! (Cameron, Gelbach and Miller 2008; Imbens and Kolesar 2016; MacKinnon and Webb 2017;
//! Pustejovsky and Tipton 2018), specialised to the intercept-only model (the mean), where all
//! of them need only the per-cluster moments `(n_g, mean_g, m2_g)`:
//!
//! - [`Method::Miller`]: Miller's SE with a normal quantile (evalflow's original interval).
//! - [`Method::Cr1T`]: CR1 (`G/(G-1)` small-sample factor) with a t(G-1) quantile.
//! - [`Method::Cr2`]: the Bell-McCaffrey bias-reduced variance with Satterthwaite degrees of
//!   freedom and a t quantile. With `N` rows, `p_g = n_g / N` and cluster residual sums
//!   `S_g = n_g (mean_g - mean)`: `V = sum_g S_g^2 / (1 - p_g) / N^2` and
//!   `df = 1 / (sum_g p_g^2 (1 - 2 p_g) / (1 - p_g)^2 + (sum_g p_g^2 / (1 - p_g))^2)`, which is
//!   `G - 1` for equal clusters. Both are checked against a direct matrix implementation in
//!   `scripts/cr2_reference.py`.
//! - [`Method::Cr2Wilson`]: for proportions (x in [0, 1]): a Wilson score interval at the
//!   effective size `p (1 - p) / V_CR2` with the CR2 t quantile; it stays inside [0, 1] and is
//!   skewed the right way near 0 and 1.
//! - [`Method::Cr2Score`]: for pass/fail rates, the clustered score interval
//!   ([`clustered_score_quantiles`]), with the t quantile toward 1/2 and, away from it, the
//!   quantile of a floored variance ([`floored_t_quantile`]).
//! - [`Method::Cr2Ri`]: CR2 with its variance floored at the random-intercept model's
//!   ([`random_intercept_var`]), for paired differences of graded scores.
//! - For paired differences of pass/fail pairs, [`Method::Cr2Score`] is Tango's score interval
//!   with design effects ([`paired_score`], through [`paired_interval`]).
//! - [`Method::WildBootstrap`]: the wild cluster bootstrap-t (Rademacher weights, Webb's
//!   six-point weights below 12 clusters), studentized by the CR2 SE; the interval is the
//!   symmetric percentile-t one, the p-value imposes the null (WCR).
//!
//! The bootstrap runs at evaluate time over the merged per-cluster moments, with clusters put
//! in a canonical order (by size, then mean) before weights are drawn, so a given seed gives
//! the same interval however the rows were partitioned and merged.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use statrs::distribution::{ChiSquared, ContinuousCDF, StudentsT};
use statrs::function::erf::erfc;
use statrs::function::gamma::ln_gamma;

use super::cluster_summary::ClusterSummary;
use super::common::{Moments, finite, normal_z, two_sided_p};

/// Which method to use when, one row per method, with the coverage of `benches/coverage.rs`;
/// rendered under `clustered_mean_ci` in docs/functions.md. The derivations and every
/// simulation table are in docs/intervals.md.
pub const METHOD_GUIDE: &str = r#"**Which method when** (coverage of a nominal 95% interval and the
widest mean width against the oracle's, from 20 templates or more: rare pass/fail rates near
0.05 and paired pass/fail differences, 2,000 simulated evals per design; derivations and
every table in [intervals.md](intervals.md))

| method | when to use it | rate near 0.05 | paired pass/fail | width / oracle |
|---|---|---|---|---|
| `auto` | the default: `cr2_score` for 0/1 scores, `cr2` for other means, `cr2_ri` for paired graded scores | 94.0-95.8% | 94.2-96.3% | 1.16, 1.19 |
| `cr2_score` | pass/fail rates and paired pass/fail pairs (a clustered score interval; Tango's for pairs) | 94.0-95.8% | 94.2-96.3% | 1.16, 1.19 |
| `cr2_ri` | paired differences of graded scores (`cr2` floored at the random-intercept variance) | 90.5-95.7% | 93.5-96.2% | 1.11, 1.16 |
| `cr2` | means of graded scores (judge scores, averaged samples) | 88.0-95.5% | 93.5-95.8% | 1.08, 1.11 |
| `cr2_wilson` | an earlier default: Wilson at the CR2 effective size | 92.8-95.8% | | 1.08 |
| `wild_bootstrap` | a cross-check of `cr2`; costs `reps` x G work per group | 87.5-95.3% | 93.2-95.9% | 1.12, 1.13 |
| `cr1_t` | to match statsmodels and Inspect AI (with the t(G-1) quantile they omit) | 87.2-95.5% | 93.2-95.5% | 1.08, 1.10 |
| `miller` | Miller's clustered SE with a normal quantile, for comparison | 84.9-94.5% | 90.8-95.0% | 1.01, 1.02 |

Rare rates that a few large templates carry with strong template effects (latent ICC 0.3 or
more) can still fall short of 95%: see [intervals.md](intervals.md), "Rare failures that a few
templates carry".
"#;

/// An interval method for a clustered mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    /// Miller's clustered SE, normal quantile.
    Miller,
    /// CR1 SE, t(G - 1) quantile.
    Cr1T,
    /// CR2 (Bell-McCaffrey) SE, Satterthwaite df, t quantile.
    Cr2,
    /// Wilson score interval at the CR2 effective sample size, t quantile (proportions).
    Cr2Wilson,
    /// Clustered score interval (proportions): the CR2 variance split into a binomial and a
    /// between-template part that grows toward 1/2, inverted with the CR2 t quantile toward 1/2
    /// and a floored-variance quantile (between z and t) away from it. For a difference of
    /// pass/fail pairs, Tango's score interval with design effects ([`paired_score`]).
    Cr2Score,
    /// Wild cluster bootstrap-t, seeded.
    WildBootstrap,
    /// CR2 with its variance floored at the random-intercept model's (the larger of the two),
    /// Satterthwaite df, t quantile: the default for paired differences of graded scores.
    Cr2Ri,
    /// The default: [`Method::Cr2Score`] when every row is 0 or 1 (a pass/fail score),
    /// [`Method::Cr2`] otherwise; for paired differences ([`paired_interval`]) `Cr2Score` for
    /// pass/fail pairs, [`Method::Cr2Ri`] otherwise. Results name the method that was used.
    Auto,
}

impl Method {
    /// Every method, in documentation order.
    pub const ALL: [Method; 8] = [
        Method::Auto,
        Method::Miller,
        Method::Cr1T,
        Method::Cr2,
        Method::Cr2Wilson,
        Method::Cr2Score,
        Method::WildBootstrap,
        Method::Cr2Ri,
    ];

    /// The method used when none is given: the one whose coverage holds best at few clusters
    /// in `benches/coverage.rs` (cr2_score for pass/fail scores, cr2 for other scores;
    /// `paired_diff_clustered` uses cr2_ri); see docs/functions.md.
    pub const DEFAULT: Method = Method::Auto;

    /// The SQL name.
    pub fn name(self) -> &'static str {
        match self {
            Method::Miller => "miller",
            Method::Cr1T => "cr1_t",
            Method::Cr2 => "cr2",
            Method::Cr2Wilson => "cr2_wilson",
            Method::Cr2Score => "cr2_score",
            Method::WildBootstrap => "wild_bootstrap",
            Method::Cr2Ri => "cr2_ri",
            Method::Auto => "auto",
        }
    }

    /// Parses a SQL name (case-insensitive, surrounding spaces ignored).
    ///
    /// # Errors
    /// [`IntervalError::UnknownMethod`] naming the accepted values.
    pub fn parse(s: &str) -> Result<Method, IntervalError> {
        let t = s.trim().to_ascii_lowercase();
        Method::ALL
            .into_iter()
            .find(|m| m.name() == t)
            .ok_or_else(|| IntervalError::UnknownMethod(s.to_string()))
    }

    /// The accepted names, quoted, comma-separated.
    pub fn accepted() -> String {
        Method::ALL
            .iter()
            .map(|m| format!("'{}'", m.name()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Errors of the interval arguments.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum IntervalError {
    /// The method string is not one of [`Method::ALL`].
    #[error("unknown interval method '{0}': expected one of {accepted}", accepted = Method::accepted())]
    UnknownMethod(String),
    /// The method does not apply to this function (e.g. `cr2_wilson` for a difference).
    #[error("interval method '{0}' does not apply here: expected one of {1}")]
    MethodNotApplicable(&'static str, String),
    /// The confidence level is not in (0, 1).
    #[error("level must be between 0 and 1 (exclusive), got {0}")]
    BadLevel(f64),
    /// The number of bootstrap replications is out of range.
    #[error("reps must be an integer between {min} and {max}, got {0}", min = MIN_REPS, max = MAX_REPS)]
    BadReps(f64),
    /// The seed is not a non-negative integer.
    #[error("seed must be a non-negative integer, got {0}")]
    BadSeed(f64),
}

/// Fewest bootstrap replications accepted.
pub const MIN_REPS: u32 = 19;
/// Most bootstrap replications accepted.
pub const MAX_REPS: u32 = 1_000_000;
/// Default bootstrap replications.
pub const DEFAULT_REPS: u32 = 999;
/// Default bootstrap seed.
pub const DEFAULT_SEED: u64 = 20_160_101;
/// Below this many clusters the bootstrap uses Webb's six-point weights (Rademacher weights
/// allow only 2^G distinct draws).
pub const WEBB_BELOW: usize = 12;

/// Wild bootstrap settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bootstrap {
    /// Replications B.
    pub reps: u32,
    /// RNG seed (`StdRng::seed_from_u64`).
    pub seed: u64,
}

impl Default for Bootstrap {
    fn default() -> Self {
        Bootstrap {
            reps: DEFAULT_REPS,
            seed: DEFAULT_SEED,
        }
    }
}

impl Bootstrap {
    /// Validated settings from SQL numbers.
    ///
    /// # Errors
    /// [`IntervalError::BadReps`] or [`IntervalError::BadSeed`].
    pub fn new(reps: f64, seed: f64) -> Result<Bootstrap, IntervalError> {
        if !(reps.fract() == 0.0 && reps >= MIN_REPS as f64 && reps <= MAX_REPS as f64) {
            return Err(IntervalError::BadReps(reps));
        }
        if !(seed.fract() == 0.0 && (0.0..1.8e19).contains(&seed)) {
            return Err(IntervalError::BadSeed(seed));
        }
        Ok(Bootstrap {
            reps: reps as u32,
            seed: seed as u64,
        })
    }
}

/// What to compute: method, confidence level and bootstrap settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IntervalSpec {
    /// The method.
    pub method: Method,
    /// Confidence level in (0, 1).
    pub level: f64,
    /// Used by [`Method::WildBootstrap`] only.
    pub bootstrap: Bootstrap,
}

impl Default for IntervalSpec {
    fn default() -> Self {
        IntervalSpec {
            method: Method::DEFAULT,
            level: 0.95,
            bootstrap: Bootstrap::default(),
        }
    }
}

impl IntervalSpec {
    /// A validated spec.
    ///
    /// # Errors
    /// [`IntervalError::BadLevel`] when `level` is not in (0, 1).
    pub fn new(
        method: Method,
        level: f64,
        bootstrap: Bootstrap,
    ) -> Result<IntervalSpec, IntervalError> {
        if !(level > 0.0 && level < 1.0) {
            return Err(IntervalError::BadLevel(level));
        }
        Ok(IntervalSpec {
            method,
            level,
            bootstrap,
        })
    }
}

/// A clustered mean with its interval.
///
/// # Behavior
/// `mean` is `None` when `n == 0`; `se`, `lo`, `hi`, `stat` and `p_value` are `None` with
/// fewer than two rows or two clusters; `stat` and `p_value` also when `se` is 0. `df` is the
/// t degrees of freedom, `None` for the normal ([`Method::Miller`]) and bootstrap methods.
/// [`Method::Cr2Wilson`] and [`Method::Cr2Score`] give no interval when the mean is outside
/// [0, 1].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClusterInterval {
    /// Rows.
    pub n: u64,
    /// Clusters with at least one row.
    pub n_clusters: usize,
    /// The mean.
    pub mean: Option<f64>,
    /// Standard error of the mean (CR2 for the Wilson and bootstrap methods).
    pub se: Option<f64>,
    /// Lower bound.
    pub lo: Option<f64>,
    /// Upper bound.
    pub hi: Option<f64>,
    /// Degrees of freedom of the t quantile, if one was used.
    pub df: Option<f64>,
    /// The method used.
    pub method: Method,
    /// `mean / se`, the statistic of the test of mean = 0.
    pub stat: Option<f64>,
    /// Two-sided p-value of the test of mean = 0 (bootstrap: null imposed, WCR).
    pub p_value: Option<f64>,
}

/// Per-cluster moments of a pass/fail column: `successes` ones among `n` rows.
pub fn binary_cell(n: u64, successes: u64) -> Moments {
    if n == 0 {
        return Moments::default();
    }
    let nf = n as f64;
    let mean = successes as f64 / nf;
    Moments {
        n,
        mean,
        m2: nf * mean * (1.0 - mean),
    }
}

/// The two-sided `level` quantile of t(df) (normal when `df` is `None`).
pub fn t_quantile(level: f64, df: Option<f64>) -> Option<f64> {
    let upper = (1.0 - level) / 2.0;
    match df {
        None => finite(normal_z(upper)),
        Some(df) if df > 0.0 && df.is_finite() => {
            let t = StudentsT::new(0.0, 1.0, df).ok()?;
            finite(t.inverse_cdf(1.0 - upper))
        }
        Some(_) => None,
    }
}

/// Two-sided p-value of `stat` under t(df) (normal when `df` is `None`).
pub fn t_p_value(stat: f64, df: Option<f64>) -> Option<f64> {
    match df {
        None => finite(two_sided_p(stat)),
        Some(df) if df > 0.0 && df.is_finite() => {
            let t = StudentsT::new(0.0, 1.0, df).ok()?;
            finite((2.0 * t.sf(stat.abs())).min(1.0))
        }
        Some(_) => None,
    }
}

/// Cluster sizes and residual sums, per cluster: the wild bootstrap draws one weight each.
struct Residuals {
    n: f64,
    mean: f64,
    /// `(n_g, S_g = n_g (mean_g - mean))` per cluster.
    cells: Vec<(f64, f64)>,
}

impl Residuals {
    fn new(cells: &[Moments], total: &Moments) -> Residuals {
        let mean = total.mean;
        Residuals {
            n: total.n as f64,
            mean,
            cells: cells
                .iter()
                .filter(|c| c.n > 0)
                .map(|c| (c.n as f64, c.n as f64 * (c.mean - mean)))
                .collect(),
        }
    }
}

/// CR2 variance of the mean from `(n_g, S_g)`: `sum_g S_g^2 / (1 - n_g / N) / N^2`.
fn cr2_var(n: f64, cells: impl Iterator<Item = (f64, f64)>) -> f64 {
    cells.map(|(ng, s)| s * s / (1.0 - ng / n)).sum::<f64>() / (n * n)
}

/// Bell-McCaffrey / Satterthwaite degrees of freedom of the CR2 variance of a mean, under
/// the working model of independent rows (Pustejovsky and Tipton 2018, eq. 11):
/// `1 / (sum_g p_g^2 (1 - 2 p_g) / (1 - p_g)^2 + (sum_g p_g^2 / (1 - p_g))^2)`, `p_g = n_g / N`.
pub fn cr2_df(sizes: impl IntoIterator<Item = f64>) -> Option<f64> {
    cr2_df_by_size(sizes.into_iter().map(|s| (s, 1.0)))
}

/// [`cr2_df`] from `(size, clusters of that size)`.
pub fn cr2_df_by_size(sizes: impl IntoIterator<Item = (f64, f64)>) -> Option<f64> {
    let sizes: Vec<(f64, f64)> = sizes
        .into_iter()
        .filter(|&(s, c)| s > 0.0 && c > 0.0)
        .collect();
    if sizes.iter().map(|(_, c)| c).sum::<f64>() < 2.0 {
        return None;
    }
    let n: f64 = sizes.iter().map(|(s, c)| s * c).sum();
    let (mut a, mut b) = (0.0, 0.0);
    for (s, c) in sizes {
        let p = s / n;
        let q = 1.0 - p;
        a += c * p * p * (1.0 - 2.0 * p) / (q * q);
        b += c * p * p / q;
    }
    finite(1.0 / (a + b * b)).filter(|d| *d > 0.0)
}

/// The CR2 variance of the mean of a summary: `sum_g S_g^2 / (1 - n_g / N) / N^2`.
fn summary_cr2_var(s: &ClusterSummary) -> f64 {
    let n = s.total.n as f64;
    s.weighted_score_sq(|k| 1.0 / (1.0 - k / n)) / (n * n)
}

/// The CR2 standard error of a mean from per-cluster moments; `None` below two clusters.
pub fn cr2_se(cells: &[Moments]) -> Option<f64> {
    let s = ClusterSummary::of(cells);
    if s.n_clusters() < 2 {
        return None;
    }
    finite(summary_cr2_var(&s).sqrt())
}

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
const SCORE_GRID: usize = 512;

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
const FLOOR_NODES: usize = 1024;

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

/// The between-template part of the variance of the pooled mean under the random-intercept
/// model, from the one-way ANOVA estimate of the template variance:
/// `(MSB - MSW) / n0 * (sum_g n_g^2 / N^2 - 1 / N)` with `MSB = sum_g n_g (mean_g - mean)^2 /
/// (G - 1)`, `MSW = sum_g m2_g / (N - G)`, `n0 = (N - sum_g n_g^2 / N) / (G - 1)`. May be
/// negative; `None` with fewer than 2 clusters or no cluster of 2 rows. Used on the side toward
/// 1/2 in [`clustered_score_sided`].
pub fn anova_between_var(cells: &[Moments]) -> Option<f64> {
    summary_between_var(&ClusterSummary::of(cells))
}

/// [`anova_between_var`] of a summary.
fn summary_between_var(s: &ClusterSummary) -> Option<f64> {
    let a = Anova::new(s)?;
    finite(a.between * (a.sq / (a.n * a.n) - 1.0 / a.n))
}

/// The variance of the pooled mean under the random-intercept model with one-way ANOVA
/// estimates of its two variances: `MSW / N + sigma_b^2 sum_g n_g^2 / N^2`,
/// `sigma_b^2 = (MSB - MSW) / n0` (see [`anova_between_var`]). `None` as there.
///
/// [`Method::Cr2Ri`] takes the larger of this and the CR2 variance, in the spirit of
/// Morel, Bokossa and Neerchal's floor on the sandwich: with unequal template sizes CR2 leans
/// on the few largest templates and comes out low in the samples whose mean is off.
pub fn random_intercept_var(cells: &[Moments]) -> Option<f64> {
    summary_random_intercept_var(&ClusterSummary::of(cells))
}

/// [`random_intercept_var`] of a summary.
fn summary_random_intercept_var(s: &ClusterSummary) -> Option<f64> {
    let a = Anova::new(s)?;
    finite(a.within / a.n + a.between * a.sq / (a.n * a.n))
}

/// One-way ANOVA of per-cluster moments.
struct Anova {
    /// Rows.
    n: f64,
    /// `sum_g n_g^2`.
    sq: f64,
    /// MSW, the pooled within-cluster variance.
    within: f64,
    /// `(MSB - MSW) / n0`, the between-cluster variance (may be negative).
    between: f64,
}

impl Anova {
    fn new(s: &ClusterSummary) -> Option<Anova> {
        let g = s.n_clusters() as f64;
        let n = s.total.n as f64;
        if g < 2.0 || n <= g {
            return None;
        }
        // `n_g (mean_g - mean)^2 = S_g^2 / n_g`.
        let ssb = s.weighted_score_sq(|k| 1.0 / k);
        let ssw = s.within();
        let sq: f64 = s.sizes().map(|(k, c)| c * k * k).sum();
        let n0 = (n - sq / n) / (g - 1.0);
        let within = ssw / (n - g);
        Some(Anova {
            n,
            sq,
            within,
            between: (ssb / (g - 1.0) - within) / n0,
        })
    }
}

/// The point of `[inside_pt, edge]` farthest from `inside_pt` that `inside` accepts: a scan
/// of [`SCORE_GRID`] points from `edge` inward, then bisection between the first accepted
/// point and its outer neighbour. `inside(inside_pt)` must hold.
fn outermost(inside_pt: f64, edge: f64, inside: &impl Fn(f64) -> bool) -> f64 {
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

/// The mean of per-cluster `cells` with its interval by `spec.method`.
///
/// This is the plain-Rust entry point (the SQL functions and the aggregate stage call it).
/// `cells` holds one [`Moments`] per cluster, in any order (use [`binary_cell`] for pass/fail
/// counts); empty cells are ignored. Pure and deterministic: the bootstrap draws from
/// `spec.bootstrap.seed` over the clusters in a canonical order.
///
/// # Behavior
/// See [`ClusterInterval`].
///
/// # Example
/// ```
/// use evalflow::udaf::cluster_interval::{IntervalSpec, Method, binary_cell, cluster_interval};
/// let cells = [binary_cell(10, 9), binary_cell(10, 6), binary_cell(10, 8), binary_cell(10, 4)];
/// let spec = IntervalSpec { method: Method::Cr2, ..IntervalSpec::default() };
/// let ci = cluster_interval(&cells, &spec);
/// assert_eq!(ci.df, Some(3.0));
/// assert!(ci.lo.unwrap() < 0.675 && 0.675 < ci.hi.unwrap());
/// ```
pub fn cluster_interval(cells: &[Moments], spec: &IntervalSpec) -> ClusterInterval {
    interval_of(&ClusterSummary::of(cells), spec, Some(cells))
}

/// [`cluster_interval`] of clusters folded into a [`ClusterSummary`]. Every method but
/// [`Method::WildBootstrap`], which draws per cluster, gives the same interval as from the
/// cells (up to rounding); the bootstrap gives none.
pub fn summary_interval(s: &ClusterSummary, spec: &IntervalSpec) -> ClusterInterval {
    interval_of(s, spec, None)
}

fn interval_of(
    s: &ClusterSummary,
    spec: &IntervalSpec,
    cells: Option<&[Moments]>,
) -> ClusterInterval {
    let spec = &IntervalSpec {
        method: resolve_summary(spec.method, s),
        ..*spec
    };
    let total = s.total;
    let n_clusters = s.n_clusters();
    let mut out = ClusterInterval {
        n: total.n,
        n_clusters,
        mean: total.mean(),
        se: None,
        lo: None,
        hi: None,
        df: None,
        method: spec.method,
        stat: None,
        p_value: None,
    };
    if total.n < 2 || n_clusters < 2 {
        return out;
    }
    let (n, mean) = (total.n as f64, total.mean);
    let g = n_clusters as f64;
    let (se, df) = match spec.method {
        Method::Miller => {
            let var = s.score_sq() / (n * n) + total.m2.max(0.0) / (n * n * (n - 1.0));
            (finite(var.sqrt()), None)
        }
        Method::Cr1T => (
            finite((g / (g - 1.0) * s.score_sq()).sqrt() / n),
            Some(g - 1.0),
        ),
        Method::Cr2
        | Method::Cr2Wilson
        | Method::Cr2Score
        | Method::Cr2Ri
        | Method::WildBootstrap
        | Method::Auto => {
            let mut var = summary_cr2_var(s);
            if spec.method == Method::Cr2Ri {
                var = summary_random_intercept_var(s).map_or(var, |v| var.max(v));
            }
            let se = finite(var.sqrt());
            let df = match spec.method {
                Method::WildBootstrap => None,
                _ => cr2_df_by_size(s.sizes()),
            };
            (se, df)
        }
    };
    let Some(se) = se else { return out };
    out.se = Some(se);
    out.df = df;
    if se > 0.0 {
        out.stat = finite(mean / se);
    }
    match spec.method {
        Method::WildBootstrap => {
            let Some(cells) = cells else { return out };
            let boot = wild_bootstrap(&Residuals::new(cells, &total), se, spec);
            out.lo = finite(mean - boot.crit * se);
            out.hi = finite(mean + boot.crit * se);
            out.p_value = out.stat.and(boot.p_value);
        }
        Method::Cr2Wilson | Method::Cr2Score => {
            let Some(t) = t_quantile(spec.level, df) else {
                return out;
            };
            if (0.0..=1.0).contains(&mean) {
                let (lo, hi) = if spec.method == Method::Cr2Score {
                    let var = se * se;
                    let naive = mean * (1.0 - mean) / n;
                    // The size-weighted variance counts in proportion to the skewness of
                    // a rate's estimate, |1 - 2p|: not at 1/2, almost fully for rare rates.
                    let var_half = summary_between_var(s).map_or(var, |b| {
                        var + (1.0 - 2.0 * mean).abs() * (naive + b - var).max(0.0)
                    });
                    // Away from 1/2 the multiplier of a floored variance (the template
                    // part is never below zero), weighed in by the same skewness: toward
                    // 1/2 a low rate comes with a low variance and the full t is needed.
                    let skew = (1.0 - 2.0 * mean).abs();
                    let kappa = if naive > 0.0 {
                        naive / var.max(naive)
                    } else {
                        1.0
                    };
                    let t_away = if skew > 0.0 {
                        floored_t_quantile(spec.level, df, kappa)
                            .map_or(t, |c| skew * c + (1.0 - skew) * t)
                    } else {
                        t
                    };
                    clustered_score_quantiles(mean, n, var, var_half, t_away, t)
                } else {
                    clustered_wilson(mean, n, se * se, t)
                };
                out.lo = Some(lo);
                out.hi = Some(hi);
            }
            out.p_value = out.stat.and_then(|s| t_p_value(s, df));
        }
        _ => {
            let Some(t) = t_quantile(spec.level, df) else {
                return out;
            };
            out.lo = finite(mean - t * se);
            out.hi = finite(mean + t * se);
            out.p_value = out.stat.and_then(|s| t_p_value(s, df));
        }
    }
    out
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

/// The mean difference of per-cluster moments of `d = a - b` with its interval by
/// `spec.method`, as [`cluster_interval`], for `paired_diff_clustered`.
///
/// `pairs_binary` says every pair was 0/1: then [`Method::Auto`] is [`Method::Cr2Score`], the
/// clustered score interval of [`paired_score`] with the design effect of the
/// [`Method::Cr2Ri`] variance on the side where Tango's variance grows faster and of the CR2
/// variance on the other;
/// otherwise `Auto` is `Cr2Ri`. For `Cr2Score`, `se` is the `Cr2Ri` SE and `stat`, `p_value` are
/// the clustered McNemar test (the score test at 0, the same rule as the interval); on pairs
/// that are not all 0/1 it gives no interval and no test.
pub fn paired_interval(
    cells: &[Moments],
    spec: &IntervalSpec,
    pairs_binary: bool,
) -> ClusterInterval {
    paired_of(&ClusterSummary::of(cells), spec, pairs_binary, Some(cells))
}

/// [`paired_interval`] of clusters folded into a [`ClusterSummary`] (no bootstrap, as
/// [`summary_interval`]).
pub fn paired_summary_interval(
    s: &ClusterSummary,
    spec: &IntervalSpec,
    pairs_binary: bool,
) -> ClusterInterval {
    paired_of(s, spec, pairs_binary, None)
}

fn paired_of(
    s: &ClusterSummary,
    spec: &IntervalSpec,
    pairs_binary: bool,
    cells: Option<&[Moments]>,
) -> ClusterInterval {
    let method = match spec.method {
        Method::Auto if pairs_binary => Method::Cr2Score,
        Method::Auto => Method::Cr2Ri,
        m => m,
    };
    if method != Method::Cr2Score {
        return interval_of(s, &IntervalSpec { method, ..*spec }, cells);
    }
    let mut out = interval_of(
        s,
        &IntervalSpec {
            method: Method::Cr2Ri,
            ..*spec
        },
        cells,
    );
    out.method = Method::Cr2Score;
    (out.lo, out.hi, out.stat, out.p_value) = (None, None, None, None);
    let (Some(se), Some(d), true) = (out.se, out.mean, pairs_binary) else {
        return out;
    };
    let Some(t) = t_quantile(spec.level, out.df) else {
        return out;
    };
    let n = s.total.n as f64;
    // Sums of d and d^2; with 0/1 pairs these count the discordant pairs exactly.
    let s1 = n * d;
    let s2 = s.sum_sq();
    let pos = ((s2 + s1) / 2.0).round().max(0.0);
    let neg = ((s2 - s1) / 2.0).round().max(0.0);
    let var_cr2 = summary_cr2_var(s);
    let (lo, hi, stat) = paired_score(d, n, pos, neg, var_cr2, se * se, t);
    out.lo = Some(lo);
    out.hi = Some(hi);
    out.stat = stat;
    out.p_value = stat.and_then(|s| t_p_value(s, out.df));
    out
}

/// Relative tolerance under which a bootstrap statistic ties the observed one.
const TIE_TOL: f64 = 1e-9;

/// Resolves [`Method::Auto`]: the clustered score interval for 0/1 data, CR2 otherwise.
pub fn resolve(method: Method, cells: &[Moments]) -> Method {
    resolve_summary(method, &ClusterSummary::of(cells))
}

/// [`resolve`] for a summary.
fn resolve_summary(method: Method, s: &ClusterSummary) -> Method {
    match method {
        Method::Auto if s.all_binary() => Method::Cr2Score,
        Method::Auto => Method::Cr2,
        m => m,
    }
}

struct BootResult {
    /// The symmetric percentile-t critical value: the `level` quantile of |t*|.
    crit: f64,
    /// WCR p-value of mean = 0.
    p_value: Option<f64>,
}

/// Draws one weight per cluster: Rademacher, or Webb's six points below [`WEBB_BELOW`].
fn draw_weights(rng: &mut StdRng, w: &mut [f64]) {
    const WEBB: [f64; 6] = [
        -1.224_744_871_391_589, // -sqrt(3/2)
        -1.0,
        -std::f64::consts::FRAC_1_SQRT_2,
        std::f64::consts::FRAC_1_SQRT_2,
        1.0,
        1.224_744_871_391_589,
    ];
    if w.len() < WEBB_BELOW {
        w.iter_mut()
            .for_each(|x| *x = WEBB[rng.gen_range(0..6usize)]);
    } else {
        w.iter_mut()
            .for_each(|x| *x = if rng.gen_bool(0.5) { 1.0 } else { -1.0 });
    }
}

/// Wild cluster bootstrap-t of the mean.
///
/// Unrestricted (for the interval): `y*_i = mean + w_g e_i`, so the bootstrap mean moves by
/// `d = sum_g w_g S_g / N` and the cluster residual sums become `w_g S_g - n_g d`.
/// Restricted (for the p-value of mean = 0): `y*_i = w_g y_i`, cluster sums `T_g = S_g + n_g
/// mean`. Both statistics are studentized by the CR2 SE of the bootstrap sample.
fn wild_bootstrap(r: &Residuals, se: f64, spec: &IntervalSpec) -> BootResult {
    let mut cells = r.cells.clone();
    // Canonical order: the draw does not depend on how partitions were merged.
    cells.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let n = r.n;
    let g = cells.len();
    let reps = spec.bootstrap.reps.max(1) as usize;
    let mut rng = StdRng::seed_from_u64(spec.bootstrap.seed);
    let mut w = vec![0.0; g];
    let mut t_unres = Vec::with_capacity(reps);
    let t_obs = r.mean / se;
    let mut extreme = 0usize;
    let studentized = |w: &[f64], centre: f64, shift: f64| -> f64 {
        // Bootstrap cluster sums w_g (S_g + n_g shift); their mean offset d; CR2 of the
        // residuals about the bootstrap mean.
        let d: f64 = cells
            .iter()
            .zip(w)
            .map(|((ng, s), wg)| wg * (s + ng * shift))
            .sum::<f64>()
            / n;
        let v = cr2_var(
            n,
            cells
                .iter()
                .zip(w)
                .map(|((ng, s), wg)| (*ng, wg * (s + ng * shift) - ng * d)),
        );
        let num = d - centre;
        if v > 0.0 {
            num / v.sqrt()
        } else if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    };
    for _ in 0..reps {
        draw_weights(&mut rng, &mut w);
        t_unres.push(studentized(&w, 0.0, 0.0).abs());
        // Null mean = 0 imposed: y* = w_g y_i, so cluster sums are w_g (S_g + n_g mean) and
        // the bootstrap mean is d itself.
        let t_res = studentized(&w, 0.0, r.mean);
        // Ties count as extreme. Some draws reproduce |t| exactly in exact arithmetic (all
        // weights 1 under the null), so a tolerance keeps rounding (which differs with the
        // merge order of partitions) from deciding them.
        if t_res.abs() + TIE_TOL * (1.0 + t_obs.abs()) >= t_obs.abs() {
            extreme += 1;
        }
    }
    t_unres.sort_by(f64::total_cmp);
    // The ceil(level (B + 1))-th smallest |t*| (950th of 999 at 95%).
    let k = ((spec.level * (reps as f64 + 1.0)).ceil() as usize).clamp(1, reps);
    BootResult {
        crit: t_unres[k - 1],
        p_value: Some(extreme as f64 / reps as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::udaf::common::moments_of as cell;

    #[test]
    fn equal_clusters_give_g_minus_1_df() {
        assert!((cr2_df([10.0; 7]).unwrap() - 6.0).abs() < 1e-12);
        assert!((cr2_df([3.0, 3.0]).unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(cr2_df([5.0]), None);
    }

    #[test]
    fn cr2_equals_cr1_times_sqrt_g_minus_1_over_g_equal_sizes() {
        // Equal sizes: 1 / (1 - 1/G) = G / (G - 1), so CR2 = CR1.
        let cells = [
            cell(&[1.0, 0.0, 1.0]),
            cell(&[0.0, 0.0, 1.0]),
            cell(&[1.0, 1.0, 1.0]),
            cell(&[0.0, 1.0, 0.0]),
        ];
        let spec = |m| IntervalSpec {
            method: m,
            ..IntervalSpec::default()
        };
        let a = cluster_interval(&cells, &spec(Method::Cr2));
        let b = cluster_interval(&cells, &spec(Method::Cr1T));
        assert!((a.se.unwrap() - b.se.unwrap()).abs() < 1e-15);
        assert_eq!(a.df, Some(3.0));
        assert_eq!(b.df, Some(3.0));
    }

    #[test]
    fn method_names_round_trip_and_errors_name_them() {
        for m in Method::ALL {
            assert_eq!(Method::parse(m.name()), Ok(m));
        }
        assert_eq!(Method::parse(" CR2 "), Ok(Method::Cr2));
        let e = Method::parse("cr3").unwrap_err().to_string();
        assert!(e.contains("'cr3'") && e.contains("'wild_bootstrap'"), "{e}");
    }

    #[test]
    fn auto_is_score_for_pass_fail_and_cr2_otherwise() {
        let binary = [binary_cell(4, 1), binary_cell(3, 3), binary_cell(1, 0)];
        assert_eq!(resolve(Method::Auto, &binary), Method::Cr2Score);
        let pushed = [cell(&[1.0, 0.0, 0.0, 1.0]), cell(&[0.0]), cell(&[1.0, 1.0])];
        assert_eq!(resolve(Method::Auto, &pushed), Method::Cr2Score);
        let graded = [cell(&[1.0, 0.5]), cell(&[0.0, 1.0])];
        assert_eq!(resolve(Method::Auto, &graded), Method::Cr2);
        let scale = [cell(&[3.0, 4.0]), cell(&[5.0])];
        assert_eq!(resolve(Method::Auto, &scale), Method::Cr2);
        assert_eq!(resolve(Method::Miller, &binary), Method::Miller);
        let ci = cluster_interval(&binary, &IntervalSpec::default());
        assert_eq!(ci.method, Method::Cr2Score);
    }

    #[test]
    fn score_is_wilson_away_from_half_and_wider_toward_it() {
        // p = 0.1 of 200 rows, design effect 3: below p (r < 1) the bound is Wilson's at
        // n / deff; above it the between part grows as r^1.25, so the bound is higher.
        let (p, n, t) = (0.1, 200.0, 2.1);
        let var = 3.0 * p * (1.0 - p) / n;
        let (lo, hi) = clustered_score(p, n, var, t);
        let (wlo, whi) = clustered_wilson(p, n, var, t);
        assert!((lo - wlo).abs() < 1e-14, "{lo} vs {wlo}");
        assert!(hi > whi + 0.005, "{hi} vs {whi}");
        // hi solves (hi - p)^2 = t^2 V(hi).
        let b = var - p * (1.0 - p) / n;
        let w = hi * (1.0 - hi);
        let v = w / n + b * (w / (p * (1.0 - p))).powf(SCORE_EXPONENT);
        assert!(((hi - p).powi(2) - t * t * v).abs() < 1e-15);
        // Relabelling pass and fail mirrors the interval.
        let (lo2, hi2) = clustered_score(1.0 - p, n, var, t);
        assert!((lo2 - (1.0 - hi)).abs() < 1e-12 && (hi2 - (1.0 - lo)).abs() < 1e-12);
    }

    #[test]
    fn score_takes_a_design_effect_below_one_only_away_from_half() {
        // A CR2 variance below the binomial one: Wilson at n toward 1/2; away from 1/2 Wilson
        // at n / deff, deff = 1 - |1 - 2p| (1 - max(var / naive, 1/2)). Here var / naive =
        // 0.001 / 0.0042, floored at 1/2, and |1 - 2p| = 0.4: deff 0.8, n / deff = 62.5.
        let t = 2.0;
        let (lo, hi) = clustered_score(0.3, 50.0, 0.001, t);
        assert!((lo - 0.1989977715911811).abs() < 1e-14, "{lo}");
        assert!((hi - 0.4404135182060234).abs() < 1e-14, "{hi}");
        assert_eq!(lo, wilson(0.3, 62.5, t).0);
        assert_eq!(hi, wilson(0.3, 50.0, t).1);
        // Mirrored at p = 0.7: the bound away from 1/2 is the upper one.
        let (lo, hi) = clustered_score(0.7, 50.0, 0.001, t);
        assert!((hi - 0.8010022284088187).abs() < 1e-14, "{hi}");
        assert!((lo - 0.5595864817939764).abs() < 1e-14, "{lo}");
        // At 1/2 there is no skewness: Wilson at n on both sides.
        assert_eq!(clustered_score(0.5, 50.0, 0.001, t), wilson(0.5, 50.0, t));
        // A CR2 variance of 0 (every template at the same rate) keeps a width: deff 1/2.
        let (lo, _) = clustered_score(0.25, 40.0, 0.0, t);
        assert_eq!(lo, wilson(0.25, 40.0 / 0.75, t).0);
        // p at 0 or 1: Wilson at n, which still has width.
        assert_eq!(clustered_score(0.0, 50.0, 0.0, t), wilson(0.0, 50.0, t));
        assert!(clustered_score(0.0, 50.0, 0.0, t).1 > 0.05);
        assert_eq!(clustered_score(1.0, 50.0, 0.0, t), wilson(1.0, 50.0, t));
    }

    #[test]
    fn anova_between_matches_hand_values_and_needs_replication() {
        // {1,0,0,0}, {0,0,0,0}, {1,1,0,0}, {0,0,0,0}: template variance 1/48, times 3/16.
        let eq = [
            binary_cell(4, 1),
            binary_cell(4, 0),
            binary_cell(4, 2),
            binary_cell(4, 0),
        ];
        assert!((anova_between_var(&eq).unwrap() - 1.0 / 256.0).abs() < 1e-15);
        // 12, 2, 2 zeros and {1, 0}: 85/2352 x 23/54.
        let uneq = [
            binary_cell(12, 0),
            binary_cell(2, 0),
            binary_cell(2, 0),
            binary_cell(2, 1),
        ];
        let b = anova_between_var(&uneq).unwrap();
        assert!((b - 1955.0 / 127008.0).abs() < 1e-15, "{b}");
        // Singletons only, or one cluster: no within-template variance to subtract.
        assert_eq!(
            anova_between_var(&[binary_cell(1, 1), binary_cell(1, 0)]),
            None
        );
        assert_eq!(anova_between_var(&[binary_cell(5, 1)]), None);
    }

    #[test]
    fn score_sided_widens_only_the_side_toward_half() {
        let (n, t) = (200.0, 2.1);
        for p in [0.1, 0.9] {
            let var = 2.0 * p * (1.0 - p) / n;
            let (lo, hi) = clustered_score(p, n, var, t);
            let (lo2, hi2) = clustered_score_sided(p, n, var, 1.5 * var, t);
            if p < 0.5 {
                assert!(lo2 == lo && hi2 > hi);
            } else {
                assert!(hi2 == hi && lo2 < lo);
            }
        }
        // A negative between part away from 1/2 only: Wilson at n / deff on that side,
        // deff = 1 - 0.8 (1 - 0.9) = 0.92.
        let (p, var) = (0.1, 0.9 * 0.1 * 0.9 / n);
        let (lo, hi) = clustered_score_sided(p, n, var, 3.0 * var, t);
        assert!((lo - 0.06491017087241355).abs() < 1e-14, "{lo}");
        assert!(hi > wilson(p, n, t).1);
    }

    /// scripts/cr2_reference.py (scipy quad and brentq on the same tail probability).
    #[test]
    fn floored_t_quantile_matches_scipy_and_spans_z_to_t() {
        for (level, df, kappa, want) in [
            (0.95, 9.0, 0.5, 2.166736932153212),
            (0.95, 3.0, 117.0 / 176.0, 2.12317930780149),
            (0.95, 19.0, 0.8, 1.984626598849066),
            (0.9, 2.5, 0.3, 2.1356479755530935),
        ] {
            let c = floored_t_quantile(level, Some(df), kappa).unwrap();
            assert!(
                (c - want).abs() < 1e-9,
                "{level} {df} {kappa}: {c} vs {want}"
            );
        }
        let z = t_quantile(0.95, None).unwrap();
        assert_eq!(floored_t_quantile(0.95, Some(40.0), 0.95), Some(z));
        assert_eq!(floored_t_quantile(0.95, None, 0.3), Some(z));
        assert_eq!(floored_t_quantile(0.95, Some(5.0), 0.0), None);
        let t = t_quantile(0.95, Some(4.0)).unwrap();
        let c = floored_t_quantile(0.95, Some(4.0), 1e-9).unwrap();
        assert!((c - t).abs() < 1e-7, "{c} vs {t}");
    }

    #[test]
    fn tango_variance_is_the_sample_one_at_the_estimate_and_mcnemar_at_zero() {
        // 40 pairs: 9 with d = +1, 3 with d = -1.
        let (pos, neg, n) = (9.0, 3.0, 40.0);
        let d = (pos - neg) / n;
        let sample = ((pos + neg) / n - d * d) / n;
        assert!((tango_var(d, pos, neg, n) - sample).abs() < 1e-15);
        assert!((tango_var(0.0, pos, neg, n) - (pos + neg) / (n * n)).abs() < 1e-15);
        // No discordant pair: the variance at d0 > 0 is d0 (1 - d0) / n (all mass on +1, 0).
        assert!((tango_var(0.25, 0.0, 0.0, n) - 0.25 * 0.75 / n).abs() < 1e-15);
        // The score test agrees with the interval: 0 is inside exactly when |stat| <= t.
        for (t, var) in [(2.0, 0.004), (2.6, 0.004), (2.0, 0.02)] {
            let (lo, hi, stat) = paired_score(d, n, pos, neg, var, var, t);
            assert_eq!(
                lo <= 0.0 && 0.0 <= hi,
                stat.unwrap().abs() <= t,
                "t {t}, var {var}"
            );
            assert!(lo < d && d < hi);
        }
    }

    #[test]
    fn wilson_stays_in_unit_interval() {
        let (lo, hi) = clustered_wilson(0.0, 50.0, 0.0, 2.0);
        assert_eq!(lo, 0.0);
        assert!(hi > 0.05 && hi < 0.2);
    }
}
