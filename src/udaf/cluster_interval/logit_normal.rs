//! The logit-normal template model of a pass/fail rate: the interval at a user-stated latent
//! ICC (issue 63) and the profile-likelihood interval ([`Method::LogitNormal`]).
//!
//! The model: the rows of template g are Bernoulli(expit(a + sigma u_g)) given u_g ~ N(0, 1),
//! with sigma^2 = rho / (1 - rho) pi^2 / 3 for a latent (logit-scale) ICC rho, and the estimand is
//! the marginal rate mu(a) = E[expit(a + sigma u)]. What a sample cannot tell is rho: with 20
//! templates and a rare rate, the samples that miss look like homogeneous evals. Cluster-
//! randomised trials state an ICC from earlier studies; [`stated_interval`] honours a stated one
//! with the exact mid-p (Neyman) interval of the total count T = sum_g k_g under the model, which
//! depends on the data only through T and the template sizes. [`profile_interval`] estimates rho
//! instead (capped at [`PROFILE_ICC_CAP`]); it assumes the logit-normal tail and is a named
//! method, not a default (docs/intervals.md has its coverage, including where it fails).
//!
//! Quadrature: a uniform trapezoid grid in u on [-8.5, 8.5], step 0.5 / (sigma sqrt(n)) for a
//! template of n rows, between 0.002 and 0.05, fine enough to resolve the binomial's width in u
//! (the trapezoid rule is spectrally accurate for such smooth integrands). Mirrored by
//! `scripts/stated_icc.py`, which also checks it against adaptive integration.
//!
//! Written here rather than taken from a crate: no maintained Rust crate computes mixed-
//! binomial count distributions or a random-intercept logit model's profile likelihood.
//!
//! [`Method::LogitNormal`]: super::Method::LogitNormal

use std::collections::BTreeMap;
use std::f64::consts::PI;

use statrs::distribution::{ChiSquared, ContinuousCDF, Normal};
use statrs::function::gamma::ln_gamma;

/// The largest latent ICC the profile likelihood considers: above it the sample alone cannot
/// tell a heterogeneous eval from a homogeneous one, and the interval would only widen.
pub const PROFILE_ICC_CAP: f64 = 0.45;
/// Half-width of the quadrature range in u.
const U_MAX: f64 = 8.5;
/// The coarsest and finest quadrature steps.
const H_MAX: f64 = 0.05;
const H_MIN: f64 = 0.002;
/// Above this binomial variance a node's count is taken normal (with the grid's spread).
const NORMAL_ABOVE: f64 = 100.0;
/// Multiply-adds of one count distribution beyond which T is taken normal with its skewness
/// (an Edgeworth expansion): many templates, where the sum is close to normal anyway.
const EXACT_WORK: f64 = 3e7;
/// Mass below which a count's probability is dropped: far below any tail an interval at a
/// level up to 1 - 1e-10 reads, and it keeps T's support to about +-10 SD.
const TINY: f64 = 1e-25;

/// sigma of a latent ICC rho in [0, 1).
pub fn sigma_of_icc(rho: f64) -> f64 {
    (rho / (1.0 - rho) * PI * PI / 3.0).sqrt()
}

fn expit(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// Trapezoid nodes and normalised N(0, 1) weights.
struct Grid {
    u: Vec<f64>,
    w: Vec<f64>,
    h: f64,
}

impl Grid {
    fn with_step(h: f64, sigma: f64) -> Grid {
        if sigma == 0.0 {
            return Grid {
                u: vec![0.0],
                w: vec![1.0],
                h: 0.0,
            };
        }
        let k = (U_MAX / h).ceil() as i64;
        let h = U_MAX / k as f64;
        let u: Vec<f64> = (-k..=k).map(|j| j as f64 * h).collect();
        let mut w: Vec<f64> = u.iter().map(|u| (-0.5 * u * u).exp()).collect();
        let s: f64 = w.iter().sum();
        w.iter_mut().for_each(|w| *w /= s);
        Grid { u, w, h }
    }

    /// The grid for a template of `n` rows.
    fn for_size(n: u64, sigma: f64) -> Grid {
        let h = if sigma > 0.0 {
            (0.5 / (sigma * (n.max(1) as f64).sqrt())).clamp(H_MIN, H_MAX)
        } else {
            H_MAX
        };
        Grid::with_step(h, sigma)
    }
}

/// mu(a) = E[expit(a + sigma u)].
pub fn marginal_mean(a: f64, sigma: f64) -> f64 {
    let g = Grid::with_step(H_MAX, sigma);
    g.u.iter()
        .zip(&g.w)
        .map(|(u, w)| w * expit(a + sigma * u))
        .sum()
}

/// The root of an increasing `f` in [lo, hi] (Illinois regula falsi, bracket kept).
fn increasing_root(f: impl Fn(f64) -> f64, mut lo: f64, mut hi: f64, tol: f64) -> f64 {
    let (mut flo, mut fhi) = (f(lo), f(hi));
    if flo >= 0.0 {
        return lo;
    }
    if fhi <= 0.0 {
        return hi;
    }
    let mut side = 0;
    for _ in 0..200 {
        if hi - lo <= tol {
            break;
        }
        let mut x = (lo * fhi - hi * flo) / (fhi - flo);
        if !(x > lo && x < hi) {
            x = 0.5 * (lo + hi);
        }
        let fx = f(x);
        if fx == 0.0 {
            return x;
        }
        if fx < 0.0 {
            (lo, flo) = (x, fx);
            if side == -1 {
                fhi /= 2.0;
            }
            side = -1;
        } else {
            (hi, fhi) = (x, fx);
            if side == 1 {
                flo /= 2.0;
            }
            side = 1;
        }
    }
    0.5 * (lo + hi)
}

/// The intercept a with mu(a) = mu.
pub fn intercept(mu: f64, sigma: f64) -> f64 {
    if sigma == 0.0 {
        return (mu / (1.0 - mu)).ln();
    }
    increasing_root(|a| marginal_mean(a, sigma) - mu, -40.0, 40.0, 1e-12)
}

/// P(K = k), k = 0..=n, for one template of `n` rows at intercept `a`.
fn template_pmf(n: u64, a: f64, sigma: f64, g: &Grid) -> Vec<f64> {
    let nf = n as f64;
    let mut pmf = vec![0.0; n as usize + 1];
    let std_normal = Normal::standard();
    for (u, w) in g.u.iter().zip(&g.w) {
        let p = expit(a + sigma * u);
        let q = 1.0 - p;
        let v = nf * p * q;
        if v > NORMAL_ABOVE {
            // The node stands for a slice of width h in u: its spread in counts counts too.
            let spread = nf * p * q * sigma * g.h;
            let sd = (v + spread * spread / 12.0).sqrt();
            let m = nf * p;
            // Beyond 12 SD the normal's mass is below 1e-32, under `TINY`.
            let k0 = (m - 12.0 * sd).floor().max(0.0) as usize;
            let k1 = ((m + 12.0 * sd).ceil() as usize).min(n as usize);
            let cdf = |x: f64| std_normal.cdf((x - m) / sd);
            let mut below = if k0 == 0 { 0.0 } else { cdf(k0 as f64 - 0.5) };
            for (k, slot) in pmf.iter_mut().enumerate().take(k1 + 1).skip(k0) {
                let above = if k == n as usize {
                    1.0
                } else {
                    cdf(k as f64 + 0.5)
                };
                *slot += w * (above - below);
                below = above;
            }
            continue;
        }
        if p == 0.0 || q == 0.0 {
            pmf[if p == 0.0 { 0 } else { n as usize }] += w;
            continue;
        }
        // From the mode outwards by the ratio pmf(k + 1) / pmf(k) = (n - k) p / ((k + 1) q).
        let mode = (((nf + 1.0) * p).floor() as u64).min(n);
        let mf = mode as f64;
        let at_mode = (ln_gamma(nf + 1.0) - ln_gamma(mf + 1.0) - ln_gamma(nf - mf + 1.0)
            + mf * p.ln()
            + (nf - mf) * q.ln())
        .exp();
        let floor = at_mode * 1e-18;
        let r = p / q;
        let mut x = at_mode;
        let mut k = mode;
        loop {
            pmf[k as usize] += w * x;
            if k == n || x < floor {
                break;
            }
            x *= (nf - k as f64) / (k as f64 + 1.0) * r;
            k += 1;
        }
        let (mut x, mut k) = (at_mode, mode);
        while k > 0 && x >= floor {
            x *= k as f64 / ((nf - k as f64 + 1.0) * r);
            k -= 1;
            pmf[k as usize] += w * x;
        }
    }
    pmf
}

/// A distribution over counts offset..offset + p.len().
struct Counts {
    offset: usize,
    p: Vec<f64>,
}

impl Counts {
    fn trimmed(offset: usize, mut p: Vec<f64>) -> Counts {
        let end = p.iter().rposition(|&x| x > TINY).map_or(0, |i| i + 1);
        p.truncate(end);
        let start = p.iter().position(|&x| x > TINY).unwrap_or(p.len());
        Counts {
            offset: offset + start,
            p: p.split_off(start),
        }
    }

    fn convolve(&self, o: &Counts) -> Counts {
        if self.p.is_empty() || o.p.is_empty() {
            return Counts {
                offset: self.offset + o.offset,
                p: Vec::new(),
            };
        }
        let mut out = vec![0.0; self.p.len() + o.p.len() - 1];
        for (i, x) in self.p.iter().enumerate() {
            if *x == 0.0 {
                continue;
            }
            for (slot, y) in out[i..].iter_mut().zip(&o.p) {
                *slot += x * y;
            }
        }
        Counts::trimmed(self.offset + o.offset, out)
    }

    /// (P(T < t), P(T = t)).
    fn at(&self, t: usize) -> (f64, f64) {
        let i = t as i64 - self.offset as i64;
        let below: f64 = self.p[..(i.max(0) as usize).min(self.p.len())].iter().sum();
        let eq = usize::try_from(i)
            .ok()
            .and_then(|i| self.p.get(i))
            .copied()
            .unwrap_or(0.0);
        (below, eq)
    }
}

/// The distribution of the sum of the templates' counts on a lattice of step `b` (each
/// template's count binned to `floor(k / b)`), or `None` past [`EXACT_WORK`].
fn convolve_all(pmfs: &[Counts], sizes: &[(u64, u64)], b: usize) -> Option<Counts> {
    let binned: Vec<Counts> = pmfs
        .iter()
        .map(|c| {
            if b == 1 {
                return Counts {
                    offset: c.offset,
                    p: c.p.clone(),
                };
            }
            let first = c.offset / b;
            let mut p = vec![0.0; (c.offset + c.p.len() - 1) / b - first + 1];
            for (i, x) in c.p.iter().enumerate() {
                p[(c.offset + i) / b - first] += x;
            }
            Counts { offset: first, p }
        })
        .collect();
    let mut work = 0.0;
    let mut total = Counts {
        offset: 0,
        p: vec![1.0],
    };
    for (c, &(_, count)) in binned.iter().zip(sizes) {
        for _ in 0..count {
            work += (total.p.len() * c.p.len()) as f64;
            if work > EXACT_WORK {
                return None;
            }
            total = total.convolve(c);
        }
    }
    Some(total)
}

/// The mid-p tails (P(T < t) + P(T = t) / 2, P(T > t) + P(T = t) / 2) of the total count at
/// intercept `a`: exactly by convolution while that costs under [`EXACT_WORK`]; else on a
/// coarser lattice (few large templates, whose binning noise is small beside T's spread);
/// else by an Edgeworth expansion (many templates, where T is near normal).
fn mid_p_tails(sizes: &[(u64, u64)], t: u64, a: f64, sigma: f64) -> (f64, f64) {
    let pmfs: Vec<Counts> = sizes
        .iter()
        .map(|&(n, _)| Counts::trimmed(0, template_pmf(n, a, sigma, &Grid::for_size(n, sigma))))
        .collect();
    if let Some(total) = convolve_all(&pmfs, sizes, 1) {
        let (below, eq) = total.at(t as usize);
        let mass: f64 = total.p.iter().sum();
        let lower = below + 0.5 * eq;
        return (lower, (mass - lower).max(0.0));
    }
    // The step whose convolution fits the budget (the work falls as its square), if the
    // rounding it adds (variance g b^2 / 12 over g templates) stays below 1% of T's.
    let g: u64 = sizes.iter().map(|(_, c)| c).sum();
    let len: f64 = pmfs
        .iter()
        .zip(sizes)
        .map(|(c, (_, k))| (c.p.len() as f64) * *k as f64)
        .sum();
    let b = ((len * len / 2.0 / EXACT_WORK).sqrt().ceil() as usize).max(2);
    let (_, var, _) = cumulants(sizes, a, sigma);
    let binned = (g as f64 * (b * b) as f64 / 12.0 <= 0.01 * var)
        .then(|| convolve_all(&pmfs, sizes, b))
        .flatten();
    let Some(total) = binned else {
        return edgeworth_tails(sizes, t, a, sigma);
    };
    // Bucket s holds sums whose remainders add about g (b - 1) / 2: each bucket's mass is
    // spread over one step around b s + g (b - 1) / 2.
    let x = (t as f64 - g as f64 * (b - 1) as f64 / 2.0) / b as f64;
    let lower: f64 = total
        .p
        .iter()
        .enumerate()
        .map(|(i, m)| m * (x - (total.offset + i) as f64 + 0.5).clamp(0.0, 1.0))
        .sum();
    let mass: f64 = total.p.iter().sum();
    (lower, (mass - lower).max(0.0))
}

/// T's mean, variance and third cumulant under the model at intercept `a`.
fn cumulants(sizes: &[(u64, u64)], a: f64, sigma: f64) -> (f64, f64, f64) {
    let g = Grid::with_step(H_MAX, sigma);
    let (mut mean, mut var, mut k3) = (0.0, 0.0, 0.0);
    for &(n, count) in sizes {
        let nf = n as f64;
        let ps: Vec<f64> = g.u.iter().map(|u| expit(a + sigma * u)).collect();
        let m: f64 = ps.iter().zip(&g.w).map(|(p, w)| w * nf * p).sum();
        let (mut v, mut c3) = (0.0, 0.0);
        for (p, w) in ps.iter().zip(&g.w) {
            let d = nf * p - m;
            let bv = nf * p * (1.0 - p);
            v += w * (bv + d * d);
            c3 += w * (bv * (1.0 - 2.0 * p) + 3.0 * bv * d + d * d * d);
        }
        let c = count as f64;
        (mean, var, k3) = (mean + c * m, var + c * v, k3 + c * c3);
    }
    (mean, var, k3)
}

/// The tails of [`mid_p_tails`] from T's mean, variance and third cumulant under the model.
fn edgeworth_tails(sizes: &[(u64, u64)], t: u64, a: f64, sigma: f64) -> (f64, f64) {
    let (mean, var, k3) = cumulants(sizes, a, sigma);
    if var <= 0.0 {
        let below = if (t as f64) > mean { 1.0 } else { 0.0 };
        return (below, 1.0 - below);
    }
    let sd = var.sqrt();
    let z = (t as f64 - mean) / sd;
    let skew = k3 / (var * sd);
    let n01 = Normal::standard();
    let phi = (-0.5 * z * z).exp() / (2.0 * PI).sqrt();
    let lower = (n01.cdf(z) - phi * skew / 6.0 * (z * z - 1.0)).clamp(0.0, 1.0);
    (lower, 1.0 - lower)
}

/// The exact mid-p interval of the rate at a stated latent ICC `rho`, from the template sizes
/// `(rows, templates of that size)` and the total count `t` of ones.
///
/// Each bound is the marginal rate whose model puts alpha / 2 of the mid-p mass beyond `t`:
/// `P(T > t) + P(T = t) / 2 = alpha / 2` for the lower, `P(T < t) + P(T = t) / 2` for the upper;
/// 0 (1) when `t` is 0 (every row). Evaluated exactly by convolving the templates' count
/// distributions while that costs under 3e7 multiply-adds, else by an Edgeworth expansion
/// (hundreds of templates, where T is near normal).
pub fn stated_interval(sizes: &[(u64, u64)], t: u64, rho: f64, level: f64) -> (f64, f64) {
    let sigma = sigma_of_icc(rho);
    let n: u64 = sizes.iter().map(|(k, c)| k * c).sum();
    let half = (1.0 - level) / 2.0;
    let lo = if t == 0 {
        0.0
    } else {
        let a = increasing_root(
            |a| mid_p_tails(sizes, t, a, sigma).1 - half,
            -40.0,
            40.0,
            1e-10,
        );
        marginal_mean(a, sigma)
    };
    let hi = if t >= n {
        1.0
    } else {
        let a = increasing_root(
            |a| half - mid_p_tails(sizes, t, a, sigma).0,
            -40.0,
            40.0,
            1e-10,
        );
        marginal_mean(a, sigma)
    };
    (lo, hi)
}

/// Templates grouped by (rows, ones), with their count, for the likelihood.
fn cell_classes(cells: &[(u64, u64)]) -> Vec<((u64, u64), f64)> {
    let mut m: BTreeMap<(u64, u64), f64> = BTreeMap::new();
    for &c in cells {
        if c.0 > 0 {
            *m.entry(c).or_default() += 1.0;
        }
    }
    m.into_iter().collect()
}

/// The marginal log-likelihood sum_g log E_u[Binom(k_g; n_g, expit(a + sigma u))].
fn log_lik(classes: &[((u64, u64), f64)], a: f64, sigma: f64) -> f64 {
    let mut grids: BTreeMap<u64, Grid> = BTreeMap::new();
    let mut total = 0.0;
    for &((n, k), count) in classes {
        let g = grids.entry(n).or_insert_with(|| Grid::for_size(n, sigma));
        let (nf, kf) = (n as f64, k as f64);
        let choose = ln_gamma(nf + 1.0) - ln_gamma(kf + 1.0) - ln_gamma(nf - kf + 1.0);
        let terms: Vec<f64> =
            g.u.iter()
                .zip(&g.w)
                .map(|(u, w)| {
                    let x = a + sigma * u;
                    // ln p = -ln(1 + e^-x), ln q = -ln(1 + e^x), stable in both tails.
                    let lp = -softplus(-x);
                    let lq = -softplus(x);
                    w.ln() + kf * lp + (nf - kf) * lq
                })
                .collect();
        let top = terms.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = terms.iter().map(|t| (t - top).exp()).sum();
        total += count * (choose + top + s.ln());
    }
    total
}

fn softplus(x: f64) -> f64 {
    if x > 0.0 {
        x + (-x).exp().ln_1p()
    } else {
        x.exp().ln_1p()
    }
}

/// The maximum over x in [lo, hi] of a function that is unimodal there (golden section).
fn golden_max(f: impl Fn(f64) -> f64, mut lo: f64, mut hi: f64, tol: f64) -> (f64, f64) {
    let r = (5f64.sqrt() - 1.0) / 2.0;
    let mut x1 = hi - r * (hi - lo);
    let mut x2 = lo + r * (hi - lo);
    let (mut f1, mut f2) = (f(x1), f(x2));
    while hi - lo > tol {
        if f1 < f2 {
            lo = x1;
            (x1, f1) = (x2, f2);
            x2 = lo + r * (hi - lo);
            f2 = f(x2);
        } else {
            hi = x2;
            (x2, f2) = (x1, f1);
            x1 = hi - r * (hi - lo);
            f1 = f(x1);
        }
    }
    if f1 >= f2 { (x1, f1) } else { (x2, f2) }
}

/// The profile log-likelihood of the marginal rate `mu` and the sigma that attains it: the
/// largest over sigma in [0, sigma(`cap`)] (a scan of 12 values, then golden section beside
/// the best).
fn profile_at(classes: &[((u64, u64), f64)], mu: f64, cap: f64) -> (f64, f64) {
    let cap = sigma_of_icc(cap);
    let at = |s: f64| log_lik(classes, intercept(mu, s), s);
    let scan: Vec<(f64, f64)> = (0..12)
        .map(|i| {
            let s = cap * i as f64 / 11.0;
            (s, at(s))
        })
        .collect();
    let best = (0..scan.len())
        .max_by(|&i, &j| scan[i].1.total_cmp(&scan[j].1))
        .unwrap_or(0);
    let lo = scan[best.saturating_sub(1)].0;
    let hi = scan[(best + 1).min(scan.len() - 1)].0;
    let (s, f) = golden_max(at, lo, hi, 1e-4);
    if f >= scan[best].1 {
        (f, s)
    } else {
        (scan[best].1, scan[best].0)
    }
}

fn profile(classes: &[((u64, u64), f64)], mu: f64) -> f64 {
    profile_at(classes, mu, PROFILE_ICC_CAP).0
}

/// The maximum-likelihood fit of the logit-normal template model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fit {
    /// The marginal rate.
    pub mu: f64,
    /// The template effects' SD on the logit scale.
    pub sigma: f64,
    /// The latent ICC, sigma^2 / (sigma^2 + pi^2 / 3).
    pub icc: f64,
}

/// The largest latent ICC [`fit`] considers.
pub const FIT_ICC_CAP: f64 = 0.95;

/// Fits the model to per-template `(rows, ones)` by maximum likelihood (the latent ICC in
/// [0, [`FIT_ICC_CAP`]]): the estimate of a past run's ICC to state for a new one. `None`
/// without rows, or when every row is 0 (or every row 1), which says nothing of the ICC.
pub fn fit(cells: &[(u64, u64)]) -> Option<Fit> {
    let classes = cell_classes(cells);
    let n: f64 = classes.iter().map(|((n, _), c)| *n as f64 * c).sum();
    let t: f64 = classes.iter().map(|((_, k), c)| *k as f64 * c).sum();
    if n == 0.0 || t == 0.0 || t == n {
        return None;
    }
    let x0 = (t / (n - t)).ln();
    let (x, _) = golden_max(
        |x| profile_at(&classes, expit(x), FIT_ICC_CAP).0,
        x0 - 2.0,
        x0 + 2.0,
        1e-7,
    );
    let mu = expit(x);
    let (_, sigma) = profile_at(&classes, mu, FIT_ICC_CAP);
    let s2 = sigma * sigma;
    Some(Fit {
        mu,
        sigma,
        icc: s2 / (s2 + PI * PI / 3.0),
    })
}

/// The logit-normal profile-likelihood interval of a pass/fail rate from per-template
/// `(rows, ones)`: the rates mu with 2 (l_hat - l_p(mu)) at most the chi-square(1) quantile at
/// `level`, the latent ICC estimated in [0, [`PROFILE_ICC_CAP`]]. `None` without rows.
pub fn profile_interval(cells: &[(u64, u64)], level: f64) -> Option<(f64, f64)> {
    let classes = cell_classes(cells);
    let n: f64 = classes.iter().map(|((n, _), c)| *n as f64 * c).sum();
    let t: f64 = classes.iter().map(|((_, k), c)| *k as f64 * c).sum();
    if n == 0.0 {
        return None;
    }
    let crit = ChiSquared::new(1.0).ok()?.inverse_cdf(level);
    let lp = |x: f64| profile(&classes, expit(x));
    let edge = 30.0;
    let p_hat = (t / n).clamp(1e-12, 1.0 - 1e-12);
    let x_hat0 = (p_hat / (1.0 - p_hat)).ln();
    let (x_hat, l_hat) = if t == 0.0 || t == n {
        // The likelihood grows toward the boundary rate: its supremum is at mu = 0 (or 1).
        let x = if t == 0.0 { -edge } else { edge };
        (x, lp(x))
    } else {
        golden_max(lp, x_hat0 - 2.0, x_hat0 + 2.0, 1e-7)
    };
    let outside = |x: f64| 2.0 * (l_hat - lp(x)) - crit;
    let bound = |dir: f64| -> f64 {
        let mut step = 0.5;
        let mut far = x_hat + dir * step;
        while outside(far) < 0.0 {
            if far.abs() >= edge {
                return if dir < 0.0 { 0.0 } else { 1.0 };
            }
            step *= 2.0;
            far = (x_hat + dir * step).clamp(-edge, edge);
        }
        let (a, b) = if dir < 0.0 {
            (far, x_hat)
        } else {
            (x_hat, far)
        };
        let x = increasing_root(|x| dir * outside(x), a, b, 1e-8);
        expit(x)
    };
    let lo = if t == 0.0 { 0.0 } else { bound(-1.0) };
    let hi = if t == n { 1.0 } else { bound(1.0) };
    Some((lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_template_effects_the_stated_interval_is_the_mid_p_binomial_one() {
        // rho = 0: T ~ Binomial(N, mu); 3 of 40: the mid-p exact interval [0.0205, 0.1896]
        // (R: exactci::binom.exact(3, 40, midp = TRUE) gives 0.02053, 0.18961).
        let (lo, hi) = stated_interval(&[(10, 4)], 3, 0.0, 0.95);
        let tails = |p: f64| {
            let b = statrs::distribution::Binomial::new(p, 40).unwrap();
            use statrs::distribution::{Discrete, DiscreteCDF};
            (b.cdf(2) + 0.5 * b.pmf(3), 1.0 - b.cdf(3) + 0.5 * b.pmf(3))
        };
        assert!((tails(lo).1 - 0.025).abs() < 1e-9, "{lo}");
        assert!((tails(hi).0 - 0.025).abs() < 1e-9, "{hi}");
    }

    #[test]
    fn a_mixed_binomial_pmf_sums_to_one_and_has_the_model_mean() {
        let sigma = sigma_of_icc(0.3);
        for n in [1, 7, 100, 5000] {
            let a = intercept(0.05, sigma);
            let p = template_pmf(n, a, sigma, &Grid::for_size(n, sigma));
            let mass: f64 = p.iter().sum();
            let mean: f64 = p.iter().enumerate().map(|(k, x)| k as f64 * x).sum();
            assert!((mass - 1.0).abs() < 1e-9, "n {n}: mass {mass}");
            assert!((mean / n as f64 - 0.05).abs() < 1e-6, "n {n}: mean {mean}");
        }
    }

    #[test]
    fn the_edgeworth_tails_agree_with_the_exact_ones_at_moderate_size() {
        let sizes = [(50, 40)];
        let sigma = sigma_of_icc(0.1);
        let a = intercept(0.2, sigma);
        for t in [330, 400, 470] {
            let (lo, _) = mid_p_tails(&sizes, t, a, sigma);
            let (elo, _) = edgeworth_tails(&sizes, t, a, sigma);
            assert!((lo - elo).abs() < 0.01, "t {t}: {lo} vs {elo}");
        }
    }
}
