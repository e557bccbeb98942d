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
//!   ([`random_intercept_var`], its template variance clamped at 0) and at the iid variance
//!   `var_samp(x) / N` ([`floored_var`]): the default for means and paired differences of
//!   graded scores, whose templates' means can agree by chance and leave CR2 at 0.
//! - For paired differences of pass/fail pairs, [`Method::Cr2Score`] is Tango's score interval
//!   with design effects ([`paired_score`], through [`paired_interval`]).
//! - [`Method::WildBootstrap`]: the wild cluster bootstrap-t (Rademacher weights, Webb's
//!   six-point weights below 12 clusters), studentized by the CR2 SE; the interval is the
//!   symmetric percentile-t one, the p-value imposes the null (WCR).
//!
//! The bootstrap runs at evaluate time over the merged per-cluster moments, with clusters put
//! in a canonical order (by size, then mean) before weights are drawn, so a given seed gives
//! the same interval however the rows were partitioned and merged.

mod bootstrap;
mod cr2;
pub mod logit_normal;
mod score;

use bootstrap::*;
pub use cr2::*;
pub use score::*;

use super::cluster_summary::ClusterSummary;
use super::common::{Moments, finite};

/// Which method to use when, one row per method, with the coverage of `benches/coverage.rs`;
/// rendered under `clustered_mean_ci` in docs/functions.md. The derivations and every
/// simulation table are in docs/intervals.md.
pub const METHOD_GUIDE: &str = r#"**Which method when** (coverage of a nominal 95% interval and the
widest mean width against the oracle's, from 20 templates or more: rare pass/fail rates near
0.05 and paired pass/fail differences, 2,000 simulated evals per design; derivations and
every table in [intervals.md](intervals.md))

| method | when to use it | rate near 0.05 | paired pass/fail | width / oracle |
|---|---|---|---|---|
| `auto` | the default: `cr2_score` for 0/1 scores, `cr2_ri` for graded scores (means and paired) | 94.0-95.8% | 94.2-96.3% | 1.16, 1.19 |
| `cr2_score` | pass/fail rates and paired pass/fail pairs (a clustered score interval; Tango's for pairs) | 94.0-95.8% | 94.2-96.3% | 1.16, 1.19 |
| `cr2_ri` | graded scores: `cr2` floored at the random-intercept and iid variances | 90.5-95.7% | 93.5-96.2% | 1.11, 1.16 |
| `cr2` | plain CR2, to match clubSandwich; 0 when the templates' means agree | 88.0-95.5% | 93.5-95.8% | 1.08, 1.11 |
| `cr2_wilson` | an earlier default: Wilson at the CR2 effective size | 92.8-95.8% | | 1.08 |
| `wild_bootstrap` | a cross-check of `cr2`; costs `reps` x G work per group | 87.5-95.3% | 93.2-95.9% | 1.12, 1.13 |
| `cr1_t` | to match statsmodels and Inspect AI (with the t(G-1) quantile they omit) | 87.2-95.5% | 93.2-95.5% | 1.08, 1.10 |
| `miller` | Miller's clustered SE with a normal quantile, for comparison | 84.9-94.5% | 90.8-95.0% | 1.01, 1.02 |

| `logit_normal` | a check, not a default: profile likelihood; fails when few templates fail | 62.8-96.7% | | 0.48-1.28 |

Rare rates that a few large templates carry with strong template effects (latent ICC 0.3 or
more) can still fall short of 95%: see [intervals.md](intervals.md), "Rare failures that a few
templates carry". **State the templates' latent ICC** (`'auto; icc=0.3'`, `[aggregate] icc`,
`--icc`) when a rate is under 5% (or over 95%) and the templates are fewer than 50: the interval
then also covers the exact interval of the failure count at that ICC, 95.7-97.0% from 20
templates at 1.11-1.25x the oracle's width when the effects are logit-normal and the ICC is the
truth (up to 4.2x when twice the truth). Take the ICC from a larger past run
(`logit_normal_icc(x, template_id)`) or state 0.05 / 0.3 / 0.5 for weak / strong / a few
templates carrying most failures; where a few templates carry them at ICC 0.5 a higher stated
ICC (0.6-0.8) is needed ([intervals.md](intervals.md), "A stated ICC for rare rates").
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
    /// CR2 with its variance floored at the random-intercept model's and the iid one (the
    /// largest of the three, [`floored_var`]), Satterthwaite df, t quantile: the default for
    /// means and paired differences of graded scores.
    Cr2Ri,
    /// The logit-normal profile-likelihood interval of a pass/fail rate
    /// ([`logit_normal::profile_interval`]): assumes the template effects' logit-normal tail;
    /// a named method, never the default.
    LogitNormal,
    /// The default: [`Method::Cr2Score`] when every row is 0 or 1 (a pass/fail score),
    /// [`Method::Cr2Ri`] otherwise; for paired differences ([`paired_interval`]) `Cr2Score` for
    /// pass/fail pairs, [`Method::Cr2Ri`] otherwise. Results name the method that was used.
    Auto,
}

impl Method {
    /// Every method, in documentation order.
    pub const ALL: [Method; 9] = [
        Method::Auto,
        Method::Miller,
        Method::Cr1T,
        Method::Cr2,
        Method::Cr2Wilson,
        Method::Cr2Score,
        Method::WildBootstrap,
        Method::Cr2Ri,
        Method::LogitNormal,
    ];

    /// The method used when none is given: the one whose coverage holds best at few clusters
    /// in `benches/coverage.rs` (cr2_score for pass/fail scores, cr2_ri for other scores and
    /// for `paired_diff_clustered` of graded pairs); see docs/functions.md.
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
            Method::LogitNormal => "logit_normal",
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
    /// A stated ICC outside [0, 1) or a malformed `; icc=` suffix.
    #[error("a stated ICC is written '<method>; icc=R' with R in [0, 1), got '{0}'")]
    BadIcc(String),
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
    /// A stated latent ICC for pass/fail rates: the interval becomes the union of the
    /// method's with [`logit_normal::stated_interval`] (issue 63). `None`: no change.
    pub icc: Option<f64>,
}

impl Default for IntervalSpec {
    fn default() -> Self {
        IntervalSpec {
            method: Method::DEFAULT,
            level: 0.95,
            bootstrap: Bootstrap::default(),
            icc: None,
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
            icc: None,
        })
    }

    /// The spec with a stated latent ICC.
    ///
    /// # Errors
    /// [`IntervalError::BadIcc`] unless `icc` is in [0, 1).
    pub fn with_icc(self, icc: Option<f64>) -> Result<IntervalSpec, IntervalError> {
        match icc {
            Some(r) if !(0.0..1.0).contains(&r) => Err(IntervalError::BadIcc(r.to_string())),
            icc => Ok(IntervalSpec { icc, ..self }),
        }
    }
}

/// Splits a SQL method string `'<method>[; icc=R]'` (or `'icc=R'`, the default method) into
/// the method name and the stated ICC.
///
/// # Errors
/// [`IntervalError::BadIcc`] for a malformed suffix or an ICC outside [0, 1).
pub fn split_icc(s: &str) -> Result<(&str, Option<f64>), IntervalError> {
    let (method, rest) = match s.split_once(';') {
        Some((m, r)) => (m, Some(r)),
        None if s.trim().to_ascii_lowercase().starts_with("icc") => ("auto", Some(s)),
        None => (s, None),
    };
    let Some(rest) = rest else {
        return Ok((method, None));
    };
    let bad = || IntervalError::BadIcc(s.trim().to_string());
    let (key, value) = rest.split_once('=').ok_or_else(bad)?;
    if !key.trim().eq_ignore_ascii_case("icc") {
        return Err(bad());
    }
    let r: f64 = value.trim().parse().map_err(|_| bad())?;
    if !(0.0..1.0).contains(&r) {
        return Err(bad());
    }
    Ok((method, Some(r)))
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
    /// The stated latent ICC the interval honours, if one was stated and applied (pass/fail
    /// rates only).
    pub icc: Option<f64>,
}

impl ClusterInterval {
    /// The method's name as results show it: `cr2_score`, or `cr2_score; icc=0.3` when a
    /// stated ICC widened the interval's rule.
    pub fn method_label(&self) -> String {
        match self.icc {
            Some(r) => format!("{}; icc={r}", self.method.name()),
            None => self.method.name().to_string(),
        }
    }
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
    let mut out = method_interval(s, spec, cells);
    let (Some(rho), Some(lo), Some(hi), true) = (spec.icc, out.lo, out.hi, s.all_binary()) else {
        return out;
    };
    let sizes: Vec<(u64, u64)> = s.sizes().map(|(k, c)| (k as u64, c as u64)).collect();
    let t = (s.total.n as f64 * s.total.mean).round().max(0.0) as u64;
    let (slo, shi) = logit_normal::stated_interval(&sizes, t, rho, spec.level);
    out.lo = Some(lo.min(slo));
    out.hi = Some(hi.max(shi));
    out.icc = Some(rho);
    out
}

/// The interval of `spec.method` alone (no stated ICC).
fn method_interval(
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
        icc: None,
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
        | Method::LogitNormal
        | Method::Auto => {
            let var = if spec.method == Method::Cr2Ri {
                floored_var(s).unwrap_or_else(|| summary_cr2_var(s))
            } else {
                summary_cr2_var(s)
            };
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
        Method::LogitNormal => {
            let (Some(cells), true) = (cells, s.all_binary()) else {
                return out;
            };
            let counts: Vec<(u64, u64)> = cells
                .iter()
                .filter(|c| c.n > 0)
                .map(|c| (c.n, (c.n as f64 * c.mean).round() as u64))
                .collect();
            if let Some((lo, hi)) = logit_normal::profile_interval(&counts, spec.level) {
                (out.lo, out.hi) = (Some(lo), Some(hi));
            }
            out.p_value = out.stat.and_then(|s| t_p_value(s, df));
        }
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
    // A stated ICC is a rate's (the logit-normal model of one rate); a difference has none.
    let spec = &IntervalSpec { icc: None, ..*spec };
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
    // The slow side's CR2 variance is floored at the iid one, var_samp(d) / n, as the
    // `cr2_ri` variance on the fast side is (see [`floored_var`]): a CR2 variance below it
    // gave a p-value below McNemar's (issue 61).
    let var_cr2 = summary_cr2_var(s).max(iid_var(s).unwrap_or(0.0));
    let (lo, hi, stat) = paired_score(d, n, pos, neg, var_cr2, se * se, t);
    out.lo = Some(lo);
    out.hi = Some(hi);
    out.stat = stat;
    out.p_value = stat.and_then(|s| t_p_value(s, out.df));
    out
}

/// Relative tolerance under which a bootstrap statistic ties the observed one.
const TIE_TOL: f64 = 1e-9;

/// Resolves [`Method::Auto`]: the clustered score interval for 0/1 data, CR2 floored at the
/// random-intercept and iid variances ([`Method::Cr2Ri`]) otherwise.
pub fn resolve(method: Method, cells: &[Moments]) -> Method {
    resolve_summary(method, &ClusterSummary::of(cells))
}

/// [`resolve`] for a summary.
fn resolve_summary(method: Method, s: &ClusterSummary) -> Method {
    match method {
        Method::Auto if s.all_binary() => Method::Cr2Score,
        Method::Auto => Method::Cr2Ri,
        m => m,
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
    fn auto_is_score_for_pass_fail_and_cr2_ri_otherwise() {
        let binary = [binary_cell(4, 1), binary_cell(3, 3), binary_cell(1, 0)];
        assert_eq!(resolve(Method::Auto, &binary), Method::Cr2Score);
        let pushed = [cell(&[1.0, 0.0, 0.0, 1.0]), cell(&[0.0]), cell(&[1.0, 1.0])];
        assert_eq!(resolve(Method::Auto, &pushed), Method::Cr2Score);
        let graded = [cell(&[1.0, 0.5]), cell(&[0.0, 1.0])];
        assert_eq!(resolve(Method::Auto, &graded), Method::Cr2Ri);
        let scale = [cell(&[3.0, 4.0]), cell(&[5.0])];
        assert_eq!(resolve(Method::Auto, &scale), Method::Cr2Ri);
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
        // Templates more alike than their rows, {2, 0}, {1, 1}, {2, 0}: (0 - 4/3) / 2 < 0 is
        // clamped to 0 (issue 61), so the random-intercept variance is MSW / N = 2/9.
        let alike = [cell(&[2.0, 0.0]), cell(&[1.0, 1.0]), cell(&[2.0, 0.0])];
        assert_eq!(anova_between_var(&alike), Some(0.0));
        assert!((random_intercept_var(&alike).unwrap() - 2.0 / 9.0).abs() < 1e-15);
    }

    /// Issue 61: the graded default and the paired defaults never report an SE below
    /// `mean_se` of the rows (the iid SE), over random templates of 1 to 6 rows of 0/0.5/1
    /// scores (graded) or -1/0/1 differences (pass/fail pairs). Before the fix 0 was
    /// reported whenever the templates' means agreed.
    #[test]
    fn defaults_never_fall_below_the_iid_se() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(61);
        for rep in 0..2000 {
            let binary = rep % 2 == 1;
            let g = rng.gen_range(2..8usize);
            let cells: Vec<Moments> = (0..g)
                .map(|_| {
                    let xs: Vec<f64> = (0..rng.gen_range(1..7usize))
                        .map(|_| {
                            let k = rng.gen_range(0..3usize) as f64;
                            if binary { k - 1.0 } else { 0.5 * k }
                        })
                        .collect();
                    cell(&xs)
                })
                .collect();
            let s = ClusterSummary::of(&cells);
            let Some(iid) = iid_var(&s).map(f64::sqrt) else {
                continue;
            };
            let spec = IntervalSpec::default();
            let (ci, what) = if binary {
                (paired_interval(&cells, &spec, true), "paired")
            } else {
                (cluster_interval(&cells, &spec), "graded")
            };
            // Every graded draw 0 or 1: a pass/fail rate, whose clustered score interval
            // handles a CR2 variance below the binomial one itself (score.rs).
            if ci.method == Method::Cr2Score && !binary {
                continue;
            }
            if let Some(se) = ci.se {
                assert!(
                    se >= iid * (1.0 - 1e-12),
                    "{what} {rep}: se {se} < iid {iid}"
                );
            }
            if !binary {
                let (lo, hi) = (ci.lo.unwrap(), ci.hi.unwrap());
                assert!(iid == 0.0 || hi > lo, "{what} {rep}: zero width");
            }
        }
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
