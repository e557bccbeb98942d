#!/usr/bin/env python3
"""Issue 43: rare failure rates that a few templates carry. A numpy re-simulation of today's
`cr2_score` (the formulas of scripts/coverage_sim.py, mirrored from Rust) on the extended grid:
rates 0.01-0.05, 20 and 100 templates of 50 to 200 cases (equal, or drawn uniformly from
[n/5, 2n - n/5]), template effects normal on the logit scale at latent ICC 0.05 to 0.5, the
population rate the mean over the template distribution. Each cell: coverage of the nominal
95% interval, the truth above and below it (each side's miss, 2.5% promised), their Monte
Carlo SEs, and the mean width over the oracle's (2 x 1.96 x the true SD of the estimate).

`--candidates` adds the variant tried for the bound toward 1/2 (see `het_add`): the F-test
upper confidence bound of the template variance, as an additive between part grown as r^e.

    python3 scripts/coverage_rare.py [reps [seed]] [--candidates]
"""
import sys

import numpy as np
from scipy import stats

from coverage_sim import Z, anova, cr2, expit, intercept, outer, score, sigma


def draw(rng, R, G, nbar, uneq, rho, rate):
    """R evals of G templates of `nbar` cases (or drawn from [nbar/5, 2 nbar - nbar/5])."""
    s = sigma(rho)
    a = intercept(rate, s)
    if uneq:
        n = rng.integers(nbar // 5, 2 * nbar - nbar // 5 + 1, size=(R, G)).astype(float)
    else:
        n = np.full((R, G), float(nbar))
    k = rng.binomial(n.astype(int), expit(a + s * rng.standard_normal((R, G)))).astype(float)
    return n, k


def het_add(n, k, gamma=0.05, e=2.0):
    """cr2_score with, toward 1/2, the between part plus |1 - 2p| A max(r, r^e), A the part of
    the one-way ANOVA's upper gamma-confidence bound of the variance ratio that a homogeneous
    sample would show ((1 / F_gamma(G-1, N-G) - 1) / n0, times MSW (sum n_g^2 / N^2 - 1 / N)):
    a heterogeneity the sample cannot rule out, for samples that drew few failing templates."""
    lo, hi = score(n, k)
    N, p, V, df = cr2(n, k)
    G = (n > 0).sum(1)
    msw, sb, sq = anova(n, k, k)
    n0 = (N - sq / N) / (G - 1)
    c = 1 / stats.f.ppf(gamma, G - 1, N - G) - 1
    A = np.nan_to_num(c / n0 * msw * (sq / N ** 2 - 1 / N))
    q = np.where(p * (1 - p) > 0, p * (1 - p), 1)
    t = stats.t.ppf(0.975, df)
    naive = p * (1 - p) / N
    B = V - naive
    Ba = sb * (sq / N ** 2 - 1 / N)
    Bh = np.where(np.isnan(Ba), B, B + np.abs(1 - 2 * p) * np.maximum(np.nan_to_num(Ba) - B, 0))
    s_ = np.abs(1 - 2 * p)

    def inside(P):
        w = P * (1 - P)
        r = w / q[:, None]
        v = (w / N[:, None] + np.maximum(Bh, 0)[:, None] * np.maximum(r, r ** 1.25)
             + (s_ * A)[:, None] * np.maximum(r, r ** e))
        return (p[:, None] - P) ** 2 <= (t * t)[:, None] * v

    h2 = outer(p, inside, 1.0)
    ok = (naive > 0) & (p <= 0.5)
    return lo, np.where(ok, np.maximum(hi, h2), hi)


def stat(lo, hi, truth, est):
    R = len(est)
    orc = 2 * Z * (est - truth).std(ddof=1)
    cov = np.mean((lo <= truth) & (truth <= hi))
    above, below = np.mean(hi < truth), np.mean(lo > truth)
    se = lambda x: 100 * np.sqrt(x * (1 - x) / R)
    return 100 * cov, se(cov), 100 * above, se(above), 100 * below, se(below), np.mean(hi - lo) / orc


def main(R, seed, candidates):
    rng = np.random.default_rng(seed)
    methods = [("cr2_score", score)] + ([("het_add g0.05 e2", het_add)] if candidates else [])
    print(f"{R} replications per cell, seed {seed}; coverage (SE) | above (SE) | below (SE) | width/oracle")
    print("| rate | ICC | G x sizes | " + " | ".join(m for m, _ in methods) + " |")
    print("|---|---|---|" + "---|" * len(methods))
    for rate in (0.01, 0.02, 0.05):
        for rho in (0.05, 0.3, 0.5):
            for G, nbar, uneq in ((20, 50, False), (20, 200, False), (20, 100, True),
                                  (100, 50, False), (100, 200, False), (100, 100, True)):
                n, k = draw(rng, R, G, nbar, uneq, rho, rate)
                est = k.sum(1) / n.sum(1)
                cells = []
                for _, f in methods:
                    c, cs, a, as_, b, bs, w = stat(*f(n, k), rate, est)
                    cells.append(f"{c:.1f}% ({cs:.1f}), above {a:.1f}% ({as_:.1f}), below {b:.1f}% ({bs:.1f}), {w:.2f}x")
                sz = f"{nbar // 5}-{2 * nbar - nbar // 5}" if uneq else str(nbar)
                print(f"| {rate} | {rho} | {G} x {sz} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(int(args[0]) if args else 10000, int(args[1]) if len(args) > 1 else 43,
         "--candidates" in sys.argv)
