#!/usr/bin/env python3
"""Reference values for the CR2 interval methods (tests/intervals.rs).

CR2 and its Satterthwaite degrees of freedom are computed the way clubSandwich defines them
(Pustejovsky and Tipton 2018) with dense matrices, for OLS on a constant (working model
Phi = I): A_g = (I - H_gg)^(-1/2) by eigendecomposition, V = M sum_g X_g' A_g e_g e_g' A_g X_g M,
p_g = (I - H)_g' A_g X_g M, df = (sum_g p_g'p_g)^2 / sum_{g,h} (p_g'p_h)^2. Nothing here uses
evalflow's closed forms, which these numbers check. Also the closed form of the working-model
df against the matrices, the t quantiles, and the clustered score interval (`cr2_score`, the
default for 0/1 scores, with the one-way ANOVA between variance weighted in on the side toward 1/2) solved by a fine grid and brentq rather than evalflow's scan and
bisection, with its hand example and the zero-failure case; and the paired score interval
(`paired_diff_clustered`'s default for 0/1 pairs) with Tango's restricted maximum likelihood
found numerically, not by its closed form.

    python3 scripts/cr2_reference.py
"""
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import integrate, optimize, stats

FIX = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "stats" / "scores.csv"


def inv_sqrt(m):
    w, v = np.linalg.eigh(m)
    return v @ np.diag(w ** -0.5) @ v.T


def cr2(x, cl):
    x = np.asarray(x, float)
    cl = np.asarray(cl)
    n = len(x)
    X = np.ones((n, 1))
    M = np.linalg.inv(X.T @ X)
    H = X @ M @ X.T
    e = x - x.mean()
    ih = np.eye(n) - H
    V = np.zeros((1, 1))
    ps = []
    for g in pd.unique(cl):
        idx = np.where(cl == g)[0]
        A = inv_sqrt(np.eye(len(idx)) - H[np.ix_(idx, idx)])
        u = M @ X[idx].T @ A @ e[idx]
        V += np.outer(u, u)
        ps.append((ih[idx, :].T @ A @ X[idx] @ M)[:, 0])
    P = np.array(ps)
    G = P @ P.T
    df = np.trace(G) ** 2 / np.sum(G ** 2)
    return float(x.mean()), math.sqrt(V[0, 0]), float(df)


def wilson(p, neff, z):
    den = 1 + z * z / neff
    c = (p + z * z / (2 * neff)) / den
    h = z * math.sqrt(p * (1 - p) / neff + z * z / (4 * neff ** 2)) / den
    return max(0.0, c - h), min(1.0, c + h)


def anova_between(x, cl):
    """The random-intercept (one-way ANOVA) between-template part of the variance of the pooled
    mean, by its textbook definition with pandas group sums: (MSB - MSW) / n0 * (sum n_g^2 / N^2
    - 1 / N). None without a cluster of 2 rows."""
    d = pd.DataFrame({"x": np.asarray(x, float), "c": np.asarray(cl)})
    g = d.groupby("c")["x"]
    ng, mg = g.size().to_numpy(float), g.mean().to_numpy()
    N, G, m = float(len(d)), len(ng), d.x.mean()
    if G < 2 or N <= G:
        return None
    msb = np.sum(ng * (mg - m) ** 2) / (G - 1)
    msw = np.sum((d.x - g.transform("mean")) ** 2) / (N - G)
    n0 = (N - np.sum(ng ** 2) / N) / (G - 1)
    return float((msb - msw) / n0 * (np.sum(ng ** 2) / N ** 2 - 1 / N))


def random_intercept_var(x, cl):
    """The variance of the mean under the random-intercept model, one-way ANOVA estimates:
    MSW / N + sigma_b^2 sum n_g^2 / N^2, sigma_b^2 = max(0, (MSB - MSW) / n0) (`cr2_ri` takes the
    largest of this, CR2's and the iid variance var_samp(x) / N: issue 61)."""
    d = pd.DataFrame({"x": np.asarray(x, float), "c": np.asarray(cl)})
    g = d.groupby("c")["x"]
    ng, mg = g.size().to_numpy(float), g.mean().to_numpy()
    N, G, m = float(len(d)), len(ng), d.x.mean()
    if G < 2 or N <= G:
        return None
    msb = np.sum(ng * (mg - m) ** 2) / (G - 1)
    msw = np.sum((d.x - g.transform("mean")) ** 2) / (N - G)
    n0 = (N - np.sum(ng ** 2) / N) / (G - 1)
    return float(msw / N + max(0.0, (msb - msw) / n0) * np.sum(ng ** 2) / N ** 2)


def iid_var(x):
    """var_samp(x) / N, the square of mean_se(x), by the statistics module."""
    import statistics
    xs = [float(v) for v in x]
    return statistics.variance(xs) / len(xs)


def floored_t_quantile(level, df, kappa):
    """The two-sided `level` quantile of Z / sqrt(max(kappa, U)), U = chi^2_df / df, at least the
    normal one: the multiplier of a variance estimate floored at the known share kappa of the
    truth. Tail P(|Z| > c sqrt(max(kappa, U))) by scipy quad on u (evalflow: Simpson on log u),
    root by brentq (evalflow: bisection)."""
    z = stats.norm.ppf(1 - (1 - level) / 2)
    t = stats.t.ppf(1 - (1 - level) / 2, df)
    a = 1 - level

    def tail(c):
        below = stats.chi2.cdf(df * kappa, df) * 2 * stats.norm.sf(c * math.sqrt(kappa))
        f = lambda u: 2 * stats.norm.sf(c * math.sqrt(u)) * df * stats.chi2.pdf(df * u, df)
        mid = max(kappa, 1) + 1
        up = integrate.quad(f, kappa, mid, epsabs=1e-14, epsrel=1e-13, limit=500)[0]
        return below + up + integrate.quad(f, mid, 60, epsabs=1e-14, epsrel=1e-13, limit=500)[0]

    if tail(z) <= a:
        return float(z)
    return float(optimize.brentq(lambda c: tail(c) - a, z, t, xtol=1e-15, rtol=1e-15))


def score(p, n, var, t, k=1.25, var_half=None, t_away=None):
    """The clustered score interval: each bound is the outermost p0 on its side of p with
    (p - p0)^2 <= t^2 V(p0), V(p0) = p0 (1 - p0) / n + B max(r, r^k), r = p0 (1 - p0) / (p (1 - p)),
    B = var - p (1 - p) / n away from 1/2 and var_half - p (1 - p) / n toward 1/2 (the upper side
    when p <= 1/2); with B <= 0 the side toward 1/2 gets Wilson's bound at n and the side away
    from it Wilson's at n / deff, deff = 1 - |1 - 2p| (1 - max(var / naive, 1/2)). The multiplier
    is t toward 1/2 and t_away (default t) away from it. Solved here by a fine grid and brentq
    (evalflow scans 512 points and bisects)."""
    naive = p * (1 - p) / n
    var_half = var if var_half is None else var_half
    t_away = t if t_away is None else t_away
    t_half = t
    if p <= 0.5:
        (b_lo, t_lo), (b_hi, t_hi) = (var - naive, t_away), (var_half - naive, t_half)
    else:
        (b_lo, t_lo), (b_hi, t_hi) = (var_half - naive, t_half), (var - naive, t_away)
    wl, wh = wilson(p, n, t_lo)[0], wilson(p, n, t_hi)[1]
    if naive > 0 and var < naive:
        deff = 1 - abs(1 - 2 * p) * (1 - max(var / naive, 0.5))
        if p <= 0.5:
            wl = wilson(p, n / deff, t_lo)[0]
        else:
            wh = wilson(p, n / deff, t_hi)[1]

    def outer(edge, b, t, fallback):
        if not (naive > 0 and b > 0):
            return fallback

        def gap(p0):
            w = p0 * (1 - p0)
            r = w / (p * (1 - p))
            return t * t * (w / n + b * max(r, r ** k)) - (p - p0) ** 2

        if gap(edge) >= 0:
            return edge
        grid = np.linspace(edge, p, 200_001)
        ok = np.array([gap(g) >= 0 for g in grid])
        j = int(np.argmax(ok))  # first accepted point scanning from the edge
        return optimize.brentq(gap, grid[j - 1], grid[j], xtol=1e-16, rtol=4 * np.finfo(float).eps)

    return outer(0.0, b_lo, t_lo, wl), outer(1.0, b_hi, t_hi, wh)


def score_sql(x, cl, var, t, df, level):
    """`cr2_score` as clustered_mean_ci computes it:
    var_half = var + |1 - 2p| max(0, naive + B_anova - var) toward 1/2, and away from 1/2 the
    multiplier t_away = |1 - 2p| c + (1 - |1 - 2p|) t, c the floored-variance quantile at
    kappa = naive / max(var, naive)."""
    x = np.asarray(x, float)
    p, n = float(x.mean()), len(x)
    b = anova_between(x, cl)
    naive = p * (1 - p) / n
    var_half = var if b is None else var + abs(1 - 2 * p) * max(0.0, naive + b - var)
    kappa = naive / max(var, naive) if naive > 0 else 1.0
    s = abs(1 - 2 * p)
    t_away = s * floored_t_quantile(level, df, kappa) + (1 - s) * t
    return score(p, n, var, t, var_half=var_half, t_away=t_away)


def tango_var_mle(d0, pos, neg, n):
    """Var of the mean difference of n trinomial pairs under d0, at the restricted MLE of the
    share q of d = -1 pairs (share of d = +1 is q + d0), maximised numerically."""
    lo, hi = max(0.0, -d0), (1 - d0) / 2
    if hi - lo < 1e-15:
        q = lo
    else:
        def nll(q):
            ll = 0.0
            for k, pr in ((pos, q + d0), (neg, q), (n - pos - neg, 1 - 2 * q - d0)):
                if k > 0:
                    ll += k * math.log(max(pr, 1e-300))
            return -ll
        # The likelihood is concave in q: its maximum is the root of the score equation
        # (brentq to full precision), or an end of the range when the score keeps its sign.
        def score_eq(q):
            z = n - pos - neg
            return ((pos / (q + d0) if pos else 0.0) + (neg / q if neg else 0.0)
                    - (2 * z / (1 - 2 * q - d0) if z else 0.0))
        eps = (hi - lo) * 1e-13
        a, b = float(lo + eps), float(hi - eps)
        with np.errstate(divide="ignore", invalid="ignore"):
            if score_eq(a) > 0 and score_eq(b) < 0:
                q = optimize.brentq(score_eq, a, b, xtol=1e-300, rtol=4 * np.finfo(float).eps,
                                    maxiter=500)
            else:
                q = min([lo, hi], key=nll)
    return (2 * q + d0 * (1 - d0)) / n


def paired_score_ref(a, b, cl, level=0.95):
    """paired_diff_clustered's default for 0/1 pairs: d0 inside when (d - d0)^2 <= t^2 deff
    V_T(d0); deff = V_cr2ri / V_T(d) on the side where V_T grows faster (V_T(d + h) against
    V_T(d - h), h = sqrt(V_T(d))), V_cr2 / V_T(d) on the other."""
    d = np.asarray(a, float) - np.asarray(b, float)
    n = len(d)
    m, se, df = cr2(d, cl)
    ri = random_intercept_var(d, cl)
    iid = iid_var(d)
    v_r = max(se ** 2, iid) if ri is None else max(se ** 2, ri, iid)
    pos, neg = int((d == 1).sum()), int((d == -1).sum())
    naive = tango_var_mle(m, pos, neg, n)
    # Both sides' variances floored at the iid one (issue 61).
    up, down = v_r / naive, max(se ** 2, iid) / naive
    t = stats.t.ppf(1 - (1 - level) / 2, df)

    h = math.sqrt(naive)
    upper_faster = (tango_var_mle(min(m + h, 1.0), pos, neg, n)
                    >= tango_var_mle(max(m - h, -1.0), pos, neg, n))
    d_lo, d_hi = (down, up) if upper_faster else (up, down)

    def var(d0):
        return tango_var_mle(d0, pos, neg, n) * (d_lo if d0 < m else d_hi)

    def gap(d0):
        return (m - d0) ** 2 - t * t * var(d0)

    def bound(edge):
        xs = np.linspace(edge, m, 4001)
        g = np.array([gap(x) for x in xs])
        if g[0] <= 0:
            return edge
        j = int(np.argmax(g <= 0))
        return optimize.brentq(gap, xs[j - 1], xs[j], xtol=1e-15, rtol=1e-15)

    lo, hi = bound(-1.0), bound(1.0)
    stat = m / math.sqrt(var(0.0))
    return dict(n=n, mean=m, se=math.sqrt(v_r), df=df, pos=pos, neg=neg, lo=lo, hi=hi,
                stat=stat, p=float(2 * stats.t.sf(abs(stat), df)))


def report(name, x, cl, level=0.95):
    m, se, df = cr2(x, cl)
    t = stats.t.ppf(1 - (1 - level) / 2, df)
    g = len(pd.unique(np.asarray(cl)))
    n = len(x)
    # CR1 by its definition.
    xs = np.asarray(x, float)
    s = pd.Series(xs - xs.mean()).groupby(np.asarray(cl)).sum().to_numpy()
    cr1 = math.sqrt(g / (g - 1) * np.sum(s ** 2)) / n
    t1 = stats.t.ppf(1 - (1 - level) / 2, g - 1)
    out = dict(n=n, g=g, mean=m, cr2_se=se, cr2_df=df, cr2_lo=m - t * se, cr2_hi=m + t * se,
               cr2_p=float(2 * stats.t.sf(abs(m / se), df)),
               cr1t_lo=m - t1 * cr1, cr1t_hi=m + t1 * cr1)
    ri = random_intercept_var(x, cl)
    v_ri = max(se ** 2, iid_var(x)) if ri is None else max(se ** 2, ri, iid_var(x))
    out["ri_var"] = ri
    out["cr2ri_se"] = math.sqrt(v_ri)
    out["cr2ri_lo"], out["cr2ri_hi"] = m - t * math.sqrt(v_ri), m + t * math.sqrt(v_ri)
    out["cr2ri_p"] = float(2 * stats.t.sf(abs(m / math.sqrt(v_ri)), df))
    if 0 <= m <= 1:
        naive = m * (1 - m) / n
        deff = se ** 2 / naive if naive > 0 and se > 0 else 1.0
        out["wilson_lo"], out["wilson_hi"] = wilson(m, n / deff, t)
        out["anova_between"] = anova_between(x, cl)
        out["score_lo"], out["score_hi"] = score_sql(x, cl, se ** 2, t, df, level)
    print(f"// {name}")
    for k, v in out.items():
        print(f"    {k}: {v!r}")
    return out


def main():
    df = pd.read_csv(FIX)
    x = df[df.x.notna()]
    report("x by cluster_str, all rows", x.x.to_numpy(), x.cluster_str.to_numpy())
    report("x by cluster_str, grp B, level 0.9", x[x.grp == "B"].x.to_numpy(),
           x[x.grp == "B"].cluster_str.to_numpy(), level=0.9)
    p = df[df.a.notna() & df.b.notna()]
    report("a - b by cluster_str", (p.a - p.b).to_numpy(), p.cluster_str.to_numpy())
    # The hand-derived example: clusters {1,1,1}, {0,0}, {1}: se^2 = 2/15, df = 5/3.
    r = report("hand example", [1, 1, 1, 0, 0, 1], ["a", "a", "a", "b", "b", "c"])
    assert abs(r["cr2_se"] ** 2 - 2 / 15) < 1e-12 and abs(r["cr2_df"] - 5 / 3) < 1e-12
    print("t(5/3) 0.975 quantile", stats.t.ppf(0.975, 5 / 3))
    # The score interval's hand example: clusters {1,0,0,0}, {0,0,0,0}, {1,1,0,0}, {0,0,0,0}:
    # p = 3/16, V = 11/768, naive 39/4096, B = 59/12288, df = 3.
    r = report("score hand example", [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0],
               list("aaaabbbbccccdddd"))
    assert abs(r["cr2_se"] ** 2 - 11 / 768) < 1e-15 and abs(r["cr2_df"] - 3) < 1e-12
    print("t(3) 0.975 quantile", stats.t.ppf(0.975, 3))
    # Unequal sizes, where the size-weighted (ANOVA) between variance sets the upper side:
    # clusters of 12, 2 and 2 zeros and {1, 0}: p = 1/18, V = 1/144, naive 17/5832,
    # B_anova = 85/2352 * 23/54 = 1955/127008.
    x = [0] * 16 + [1, 0]
    cl = ["a"] * 12 + ["b"] * 2 + ["c"] * 2 + ["d"] * 2
    r = report("score unequal-size example", x, cl)
    assert abs(r["cr2_se"] ** 2 - 1 / 144) < 1e-15
    assert abs(r["anova_between"] - 1955 / 127008) < 1e-15
    t = stats.t.ppf(0.975, r["cr2_df"])
    print("    t:", repr(float(t)), " symmetric score:", score(1 / 18, 18, 1 / 144, t))
    # A CR2 variance below the binomial one (tests/stats.rs cr2_score_variance_below_binomial):
    # {0,0,0,0,0}, {1,0,0,0,0}, {1,1,0,0,0}, {1,1,0,0,0}: p = 1/4, V = 11/1200, naive 3/320,
    # deff 44/45; away from 1/2 Wilson at 20 / (1 - (1/2)(1/45)) = 1800/89, toward 1/2 at 20.
    x = [0] * 5 + [1, 0, 0, 0, 0] + [1, 1, 0, 0, 0] * 2
    r = report("score under-dispersed example", x, list("aaaaabbbbbcccccddddd"))
    assert abs(r["cr2_se"] ** 2 - 11 / 1200) < 1e-15
    # The floored-variance quantile (unit test in src/udaf/cluster_interval.rs).
    for level, df, kappa in [(0.95, 9, 0.5), (0.95, 3, 117 / 176), (0.95, 19, 0.8), (0.9, 2.5, 0.3)]:
        print(f"floored_t_quantile({level}, {df}, {kappa}):", repr(floored_t_quantile(level, df, kappa)))
    # Zero failures in 120 rows from 3 templates: Wilson at n = 120 with t(2), never zero width.
    z = [0] * 120
    print("0 of 120, 3 templates:", score(0.0, 120, 0.0, stats.t.ppf(0.975, 2)))
    # The paired score interval (tests/stats.rs paired_score_matches_reference): d = truth -
    # pred on the fixture (0/1 pairs), all rows and group C at level 0.9, and a hand example of
    # unequal templates where the random-intercept variance is the larger (the side rule).
    f = pd.read_csv(FIX)
    for name, q, level in [("truth - pred", f, 0.95), ("truth - pred, grp C, 0.9", f[f.grp == "C"], 0.9)]:
        r = paired_score_ref(q.truth.astype(float), q.pred.astype(float), q.cluster_str.to_numpy(), level)
        print(f"// paired score: {name}")
        for k, v in r.items():
            print(f"    {k}: {v!r}")
    a = [1, 0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0, 1]
    b = [0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0]
    cl = list("aabccccccccdd")
    r = paired_score_ref(a, b, cl)
    d = np.array(a, float) - np.array(b, float)
    print("    cr2 var:", cr2(d, cl)[1] ** 2, " random-intercept var:", random_intercept_var(d, cl))
    print("// paired score: hand example")
    for k, v in r.items():
        print(f"    {k}: {v!r}")


if __name__ == "__main__":
    main()
