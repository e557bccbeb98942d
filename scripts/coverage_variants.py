#!/usr/bin/env python3
"""Variants of `cr2_score` tried for issue 16 on the rare-rate designs of benches/coverage.rs,
beside the interval evalflow ships (`scripts/coverage_sim.py`'s `score`), so that the claims
in docs/functions.md about what does not work can be re-run. Nothing here calls evalflow.

    python3 scripts/coverage_variants.py [reps [seed]]              # about 2 min at 20,000
    python3 scripts/coverage_variants.py --profile [reps [seed]]    # + logit-normal profile
                                                                    #   likelihood (slow: 1,000)
    python3 scripts/coverage_variants.py --frontier [reps]          # the widest cell, seeds 31, 32

Per cell: coverage, mean width over the oracle's, and the share of samples with the truth
above the interval. The variants (each changes the shipped interval in one place):
- `floor1`: the bound away from 1/2 at a design effect of at least 1 (before session 18).
- `exp1.2`, `exp1.15`: a smaller growth exponent of the between part toward 1/2 (1.25 ships).
- `fshrink`: the between part toward 1/2 shrunk by (1 - 1/F)+, F the one-way ANOVA F
  statistic, weighed in by |1 - 2p|.
- `zhalf`: the bound toward 1/2 at the normal quantile when no between part is seen.
- `exp_icc`: growth exponent 1.25 + 3 ICC (the ANOVA ICC on the observed scale).
- `anova2`: twice the size-weighted (ANOVA) term toward 1/2.
- `kurt_df`: the t toward 1/2 at min(df, 3 (sum u)^2 / sum u^2), u the CR2 cluster terms.
- `edgeworth`: the bound toward 1/2 at least p + se (t + (2 t^2 + 1) / 6 g), g the skewness
  of the cluster residuals (Hall's correction of a studentized mean).
- `logit`: the bound toward 1/2 at least the logit-scale Wald bound with the same variance.
- `profile` (with --profile): the likelihood-ratio interval of the population mean of a
  logit-normal random-intercept model (the simulation's own model), by tables over grids.
Session 18 (20,000 replications, seeds 2026 and 9090): `floor1` leaves the weak-effect cells
at up to 96.6%; `exp1.2`, `exp1.15`, `fshrink`, `zhalf` trade the strong-effect unequal cells'
coverage (94.0-94.3% at 20 templates) for width about one for one; `anova2`, `kurt_df`,
`exp_icc` lift it by 0.2-0.6 points at 1.2-1.4x the oracle's width; `edgeworth` and `logit`
leave coverage where it is (their bounds seldom reach past the score bound); `profile` covers
90-94% in the unequal-size cells from 20 templates (1,000 replications).
"""
import sys

import numpy as np
from scipy import special, stats

from coverage_sim import Z, anova, cr2, draw_rates, expit, floored_quantile, outer, score, wilson


def variant(n, k, k_exp=1.25, fshrink=False, zhalf=False, icc_beta=0.0, anova_mult=1.0,
            kurt_df=False, edgeworth=False, logit=False):
    """The shipped `cr2_score` with one change switched on (see the module doc)."""
    N, p, V, df = cr2(n, k)
    t = stats.t.ppf(0.975, df)
    q = np.where(p * (1 - p) > 0, p * (1 - p), 1)
    naive = p * (1 - p) / N
    B = V - naive
    msw, sb, sq = anova(n, k, k)
    s = np.abs(1 - 2 * p)
    Ba = sb * (sq / N ** 2 - 1 / N)
    Bh = np.where(np.isnan(Ba), B, B + anova_mult * s * np.maximum(np.nan_to_num(Ba) - B, 0))
    if fshrink:
        n0 = (N - sq / N) / ((n > 0).sum(1) - 1)
        F = (sb * n0 + msw) / np.where(msw > 0, msw, np.nan)
        w = np.nan_to_num(np.clip(1 - 1 / F, 0, 1), nan=1.0)
        Bh = Bh * (1 - s * (1 - w))
    b_lo, b_hi = np.where(p <= 0.5, B, Bh), np.where(p <= 0.5, Bh, B)
    kappa = np.where(naive > 0, naive / np.maximum(V, np.where(naive > 0, naive, 1)), 1.0)
    t_away = s * floored_quantile(kappa, df) + (1 - s) * t
    t_half = t
    if kurt_df:
        u = (k - n * p[:, None]) ** 2 / (1 - n / N[:, None])
        dk = np.maximum(3 * u.sum(1) ** 2 / np.maximum((u ** 2).sum(1), 1e-300), 1.0)
        t_half = s * stats.t.ppf(0.975, np.minimum(df, dk)) + (1 - s) * t
    t_lo, t_hi = np.where(p <= 0.5, t_away, t_half), np.where(p <= 0.5, t_half, t_away)
    # Fallbacks when no between part is seen: toward 1/2 Wilson at n, away from it at n / deff.
    m_half = s * Z + (1 - s) * t if zhalf else t_half
    deff = 1 - s * (1 - np.clip(V / np.where(naive > 0, naive, 1), 0.5, 1))
    wl = np.where(p <= 0.5, wilson(p, N / deff, t_lo)[0], wilson(p, N, m_half)[0])
    wh = np.where(p <= 0.5, wilson(p, N, m_half)[1], wilson(p, N / deff, t_hi)[1])
    rho = np.clip(np.nan_to_num(sb / (sb + msw)), 0, 1)
    kx = (k_exp + icc_beta * rho)[:, None]

    def side(Bs, tt):
        def inside(P):
            r = P * (1 - P) / q[:, None]
            v = P * (1 - P) / N[:, None] + np.maximum(Bs, 0)[:, None] * np.maximum(r, r ** kx)
            return (p[:, None] - P) ** 2 <= (tt * tt)[:, None] * v
        return inside

    ok = naive > 0
    lo = np.where(ok & (b_lo > 0), outer(p, side(b_lo, t_lo), 0.0), wl)
    hi = np.where(ok & (b_hi > 0), outer(p, side(b_hi, t_hi), 1.0), wh)
    half = ok & (p <= 0.5) & (b_hi > 0)
    if logit:
        pp = np.clip(p, 1e-12, 1 - 1e-12)
        lu = expit(np.log(pp / (1 - pp)) + t * np.sqrt(naive + np.maximum(Bh, 0)) / (pp * (1 - pp)))
        hi = np.where(half, np.maximum(hi, lu), hi)
    if edgeworth:
        e = k - n * p[:, None]
        g = (e ** 3).sum(1) / np.maximum((e ** 2 / (1 - n / N[:, None])).sum(1), 1e-300) ** 1.5
        he = p + np.sqrt(np.maximum(V, naive)) * (t + (2 * t * t + 1) / 6 * np.maximum(g, 0))
        hi = np.where(half, np.maximum(hi, np.minimum(he, 1)), hi)
    return lo, hi


class Profile:
    """Likelihood-ratio interval for the population mean E[expit(a + sigma u)] of a logit-normal
    random-intercept model, profiling sigma over a grid; log-likelihood tables over
    (sigma, mean, size, count) are built once (sizes up to 50)."""

    def __init__(self, nmax=50):
        gx, gw = np.polynomial.hermite_e.hermegauss(40)
        gw = gw / gw.sum()
        self.sig = np.concatenate([[0.0], np.geomspace(0.05, 4.0, 39)])
        half = np.geomspace(1e-4, 0.5, 220)
        self.mu = np.concatenate([half, 1 - half[::-1][1:]])
        a = np.zeros((len(self.sig), len(self.mu)))
        for i, s in enumerate(self.sig):  # intercept solving the mean, by bisection
            lo, hi = np.full(len(self.mu), -40.0), np.full(len(self.mu), 40.0)
            for _ in range(80):
                mid = 0.5 * (lo + hi)
                up = (gw * expit(mid[:, None] + s * gx)).sum(1) > self.mu
                hi, lo = np.where(up, mid, hi), np.where(up, lo, mid)
            a[i] = 0.5 * (lo + hi)
        P = np.clip(expit(a[:, :, None] + self.sig[:, None, None] * gx), 1e-300, 1 - 1e-16)
        self.logl = np.full((len(self.sig), len(self.mu), nmax + 1, nmax + 1), -np.inf)
        for m in range(1, nmax + 1):
            y = np.arange(m + 1)
            comb = special.gammaln(m + 1) - special.gammaln(y + 1) - special.gammaln(m - y + 1)
            ll = y * np.log(P)[..., None] + (m - y) * np.log1p(-P)[..., None]
            self.logl[:, :, m, :m + 1] = np.log(np.maximum((gw[:, None] * np.exp(ll)).sum(2), 1e-300)) + comb

    def __call__(self, n, k, crit=stats.chi2.ppf(0.95, 1)):
        lo, hi = np.zeros(len(n)), np.zeros(len(n))
        for r, (nr, kr) in enumerate(zip(n.astype(int), k.astype(int))):
            prof = self.logl[:, :, nr, kr].sum(-1).max(0)
            inside = np.nonzero(2 * (prof.max() - prof) <= crit)[0]
            lo[r], hi[r] = self.mu[inside[0]], self.mu[inside[-1]]
        return lo, hi


def main(R, seed, with_profile):
    variants = {"shipped": score, "floor1": lambda n, k: score(n, k, below=False),
                "exp1.2": lambda n, k: variant(n, k, k_exp=1.2),
                "exp1.15": lambda n, k: variant(n, k, k_exp=1.15),
                "fshrink": lambda n, k: variant(n, k, fshrink=True),
                "zhalf": lambda n, k: variant(n, k, zhalf=True),
                "exp_icc": lambda n, k: variant(n, k, icc_beta=3.0),
                "anova2": lambda n, k: variant(n, k, anova_mult=2.0),
                "kurt_df": lambda n, k: variant(n, k, kurt_df=True),
                "edgeworth": lambda n, k: variant(n, k, edgeworth=True),
                "logit": lambda n, k: variant(n, k, logit=True)}
    if with_profile:
        variants["profile"] = Profile()
    rng = np.random.default_rng(seed)
    print("design".ljust(24), " ".join(f"{v:>17}" for v in variants))
    for rate in (0.05, "0.04-0.06"):
        for uneq in (False, True):
            for rho in (0.05, 0.3):
                for G in (10, 20, 40):
                    n, k, mu = draw_rates(rng, R, G, uneq, rho, rate)
                    orc = 2 * Z * (k.sum(1) / n.sum(1) - mu).std(ddof=1)
                    cells = []
                    for f in variants.values():
                        lo, hi = f(n, k)
                        cells.append(f"{100 * np.mean((lo <= mu) & (mu <= hi)):5.1f} "
                                     f"{np.mean(hi - lo) / orc:4.2f} {100 * np.mean(hi < mu):3.1f}")
                    label = f"{G:3d} {'1-50' if uneq else '10'} {rho} {rate}"
                    print(label.ljust(24), " ".join(f"{c:>17}" for c in cells), flush=True)


def frontier(R):
    """The widest cell (20 templates of 1 to 50, ICC 0.3, rate 0.05) under the two knobs that
    set the bound toward 1/2: the growth exponent and the weight of the size-weighted term.
    Session 19 (60,000 replications): they move along one line of coverage against width."""
    variants = {"shipped": score, "exp1.2": lambda n, k: variant(n, k, k_exp=1.2),
                "exp1.35": lambda n, k: variant(n, k, k_exp=1.35),
                "anova0.5": lambda n, k: variant(n, k, anova_mult=0.5),
                "anova1.5": lambda n, k: variant(n, k, anova_mult=1.5),
                "exp1.2,anova1.5": lambda n, k: variant(n, k, k_exp=1.2, anova_mult=1.5),
                "exp1.35,anova0.5": lambda n, k: variant(n, k, k_exp=1.35, anova_mult=0.5)}
    for seed in (31, 32):
        n, k, mu = draw_rates(np.random.default_rng(seed), R, 20, True, 0.3, 0.05)
        orc = 2 * Z * (k.sum(1) / n.sum(1) - mu).std(ddof=1)
        for name, f in variants.items():
            lo, hi = f(n, k)
            print(seed, name.ljust(17), f"{100 * np.mean((lo <= mu) & (mu <= hi)):6.2f}% "
                  f"{np.mean(hi - lo) / orc:.4f}x above {100 * np.mean(hi < mu):4.2f}%", flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--frontier" in sys.argv:
        frontier(int(args[0]) if args else 60000)
    else:
        main(int(args[0]) if args else 20000, int(args[1]) if len(args) > 1 else 2026,
             "--profile" in sys.argv)
