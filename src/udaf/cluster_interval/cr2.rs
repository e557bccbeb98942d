//! The CR2 (Bell-McCaffrey) variance and its Satterthwaite degrees of freedom, the t
//! quantiles on top of them, and the one-way ANOVA (random-intercept) variance that floors
//! CR2 for paired graded scores.

use statrs::distribution::{ContinuousCDF, StudentsT};

use crate::udaf::cluster_summary::ClusterSummary;
use crate::udaf::common::{Moments, finite, normal_z, two_sided_p};

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
pub(super) struct Residuals {
    pub(super) n: f64,
    pub(super) mean: f64,
    /// `(n_g, S_g = n_g (mean_g - mean))` per cluster.
    pub(super) cells: Vec<(f64, f64)>,
}

impl Residuals {
    pub(super) fn new(cells: &[Moments], total: &Moments) -> Residuals {
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
pub(super) fn cr2_var(n: f64, cells: impl Iterator<Item = (f64, f64)>) -> f64 {
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
pub(super) fn summary_cr2_var(s: &ClusterSummary) -> f64 {
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

/// The between-template part of the variance of the pooled mean under the random-intercept
/// model, from the one-way ANOVA estimate of the template variance:
/// `max(0, (MSB - MSW) / n0) * (sum_g n_g^2 / N^2 - 1 / N)` with `MSB = sum_g n_g (mean_g -
/// mean)^2 / (G - 1)`, `MSW = sum_g m2_g / (N - G)`, `n0 = (N - sum_g n_g^2 / N) / (G - 1)`.
/// Never negative: a variance is not, and templates whose means agree more closely than their
/// rows do say the template variance is 0, not below it (issue 61). `None` with fewer than 2
/// clusters or no cluster of 2 rows. Used on the side toward 1/2 in [`clustered_score_sided`].
pub fn anova_between_var(cells: &[Moments]) -> Option<f64> {
    summary_between_var(&ClusterSummary::of(cells))
}

/// [`anova_between_var`] of a summary.
pub(super) fn summary_between_var(s: &ClusterSummary) -> Option<f64> {
    let a = Anova::new(s)?;
    finite(a.between * (a.sq / (a.n * a.n) - 1.0 / a.n))
}

/// The variance of the pooled mean under the random-intercept model with one-way ANOVA
/// estimates of its two variances: `MSW / N + sigma_b^2 sum_g n_g^2 / N^2`,
/// `sigma_b^2 = max(0, (MSB - MSW) / n0)` (see [`anova_between_var`]). At least `MSW / N`, the
/// variance the rows' spread within their templates allows. `None` as there.
///
/// [`Method::Cr2Ri`] takes the largest of this, the CR2 variance and the iid variance
/// `var_samp(x) / N` ([`floored_var`]), in the spirit of Morel, Bokossa and Neerchal's floor on
/// the sandwich: with unequal template sizes CR2 leans on the few largest templates and comes
/// out low in the samples whose mean is off.
pub fn random_intercept_var(cells: &[Moments]) -> Option<f64> {
    summary_random_intercept_var(&ClusterSummary::of(cells))
}

/// [`random_intercept_var`] of a summary.
pub(super) fn summary_random_intercept_var(s: &ClusterSummary) -> Option<f64> {
    let a = Anova::new(s)?;
    finite(a.within / a.n + a.between * a.sq / (a.n * a.n))
}

/// The variance [`Method::Cr2Ri`] reports: the largest of the CR2 variance, the
/// random-intercept variance ([`random_intercept_var`], template variance clamped at 0) and
/// the iid variance `var_samp(x) / N`.
///
/// Why a floor, and why this one: CR2 is built from the templates' mean deviations alone, so
/// when the templates' means happen to agree (graded scores make this easy: 0/0.5/1 judge
/// scores whose template means are equal) it is 0 however much the rows vary, and the
/// interval has no width (issue 61: `[1.0, 1.0]` over six rows of 0, 1 and 2). Clustering
/// adds the correlation of rows within a template to the iid variance (Miller); in evals that
/// correlation comes from shared wording and is not negative, so a design effect below 1 is
/// estimation noise, not information, and the data's own spread bounds the variance from
/// below. Two estimates of that bound are at hand: `MSW / N` (the random-intercept model with
/// its template variance clamped at 0, as the module docs define `cr2_ri`'s floor) and
/// `var_samp(x) / N` (the plain SE, `mean_se(x)^2`). Neither dominates with unequal sizes, so
/// the floor is the larger: the reported SE is never below `mean_se(x)`, and never below what
/// the within-template spread gives. With equal sizes and `MSB >= MSW` this is CR2's variance
/// (`MSB / N`), so the floor changes nothing where templates differ. `None` below two
/// clusters or two rows.
pub fn floored_var(s: &ClusterSummary) -> Option<f64> {
    if s.n_clusters() < 2 || s.total.n < 2 {
        return None;
    }
    let ri = summary_random_intercept_var(s).unwrap_or(0.0);
    finite(summary_cr2_var(s).max(ri).max(iid_var(s)?))
}

/// `var_samp(x) / N`, the square of `mean_se(x)`: the variance of the mean if rows were
/// independent. `None` below two rows.
pub fn iid_var(s: &ClusterSummary) -> Option<f64> {
    let n = s.total.n as f64;
    (s.total.n >= 2).then(|| s.total.m2.max(0.0) / ((n - 1.0) * n))
}

/// One-way ANOVA of per-cluster moments.
pub(super) struct Anova {
    /// Rows.
    pub(super) n: f64,
    /// `sum_g n_g^2`.
    pub(super) sq: f64,
    /// MSW, the pooled within-cluster variance.
    pub(super) within: f64,
    /// `max(0, (MSB - MSW) / n0)`, the between-cluster variance (clamped at 0: it is a
    /// variance).
    pub(super) between: f64,
}

impl Anova {
    pub(super) fn new(s: &ClusterSummary) -> Option<Anova> {
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
            between: ((ssb / (g - 1.0) - within) / n0).max(0.0),
        })
    }
}
