#!/usr/bin/env python3
"""An independent numpy re-simulation of benches/coverage.rs's designs for the pass-rate
interval (`cr2_score` now, and `cr2_score_prev`, before its bound away from 1/2 took a design
effect below 1) and the paired difference (`cr2`, `cr2_ri`, and `cr2_score`, the clustered
Tango score interval for pass/fail pairs), used to choose between variants at more
replications than the bench runs (the figures in parentheses in docs/functions.md: 20,000
replications for rates, 10,000 for paired differences, seeds 2026 and 9090). Rates run the
bench's three designs: 0.5, exactly 0.05, and drawn per replication from [0.04, 0.06].
Nothing here calls evalflow; the formulas are written out again.

    python3 scripts/coverage_sim.py [reps [seed]]          # pass rates
    python3 scripts/coverage_sim.py --paired [reps [seed]] # paired differences (memory: reps x 250 MB / 1000)
    python3 scripts/coverage_sim.py --pooled [reps [runs]]  # the widest cells, runs x reps pooled
"""
import sys

import numpy as np
from scipy import optimize, stats
from scipy.interpolate import RegularGridInterpolator

Z = 1.959963984540054
GX, GW = np.polynomial.hermite_e.hermegauss(120)
GW = GW / GW.sum()


def expit(x):
    return 1 / (1 + np.exp(-x))


def lnmean(a, s):
    return (GW * expit(a + s * GX)).sum()


def intercept(mu, s):
    return optimize.brentq(lambda a: lnmean(a, s) - mu, -30, 30)


def sigma(rho):
    return np.sqrt(rho / (1 - rho) * np.pi ** 2 / 3)


def sizes(rng, R, G, uneq):
    return (rng.integers(1, 51, size=(R, G)) if uneq else np.full((R, G), 10)).astype(float)


def cr2(n, x):
    """Rows = replications; n, x: per-cluster sizes and sums. CR2 variance, df, the mean."""
    N = n.sum(1)
    m = x.sum(1) / N
    S = x - n * m[:, None]
    pg = n / N[:, None]
    V = (S ** 2 / (1 - pg)).sum(1) / N ** 2
    a = (pg ** 2 * (1 - 2 * pg) / (1 - pg) ** 2).sum(1)
    b = (pg ** 2 / (1 - pg)).sum(1)
    return N, m, V, 1 / (a + b * b)


def anova(n, x, ss):
    """One-way ANOVA per row: (MSW, sigma_b^2, sum n^2); ss = per-cluster sum of squares."""
    N = n.sum(1)
    G = (n > 0).sum(1)
    m = x.sum(1) / N
    mg = x / np.maximum(n, 1)
    msb = (n * (mg - m[:, None]) ** 2).sum(1) / (G - 1)
    msw = (ss - n * mg ** 2).sum(1) / np.maximum(N - G, 1)
    sq = (n ** 2).sum(1)
    n0 = (N - sq / N) / (G - 1)
    ok = N > G
    return np.where(ok, msw, np.nan), np.where(ok, (msb - msw) / n0, np.nan), sq


def wilson(p, n, z):
    z2 = z * z
    d = 1 + z2 / n
    c = (p + z2 / (2 * n)) / d
    h = z * np.sqrt(np.maximum(p * (1 - p) / n, 0) + z2 / (4 * n ** 2)) / d
    return np.maximum(c - h, 0), np.minimum(c + h, 1)


def outer(p, inside, edge, grid=256, iters=60):
    """Per row, the accepted point of [edge, p] farthest from p: scan from the edge, bisect."""
    R = len(p)
    X = edge + (p[:, None] - edge) * np.linspace(0, 1, grid + 1)[None, :-1]
    ok = inside(X)
    j = np.where(ok.any(1), ok.argmax(1), grid)
    inn = np.where(j < grid, X[np.arange(R), np.minimum(j, grid - 1)], p)
    out = np.where(j > 0, X[np.arange(R), np.maximum(j - 1, 0)], edge)
    for _ in range(iters):
        mid = 0.5 * (inn + out)
        o = inside(mid[:, None])[:, 0]
        inn, out = np.where(o, mid, inn), np.where(o, out, mid)
    return np.where(ok[:, 0], edge, inn)


def _floored_table(M=1500):
    """The 0.95 quantile of Z / sqrt(max(kappa, U)), U = chi^2_df / df, on a grid of (log df,
    kappa), by a midpoint rule over U's quantiles; interpolated below (good to about 1e-3, enough
    for coverage; scripts/cr2_reference.py has the exact one)."""
    ks = np.linspace(0, 1, 51)
    lnu = np.linspace(np.log(1.01), np.log(3000), 45)
    T = np.zeros((len(lnu), len(ks)))
    for i, l in enumerate(lnu):
        u = stats.chi2.ppf((np.arange(M) + 0.5) / M, np.exp(l)) / np.exp(l)
        for j, kap in enumerate(ks):
            s = np.sqrt(np.maximum(kap, u))
            T[i, j] = optimize.brentq(lambda c: 2 * stats.norm.sf(c * s).mean() - 0.05, 0.5, 400)
    return RegularGridInterpolator((lnu, ks), T), lnu


_FLOORED = None


def floored_quantile(kappa, df):
    """Vectorized floored-variance multiplier, at least the normal quantile."""
    global _FLOORED
    if _FLOORED is None:
        _FLOORED = _floored_table()
    f, lnu = _FLOORED
    x = np.stack([np.clip(np.log(df), lnu[0], lnu[-1]), np.clip(kappa, 0, 1)], -1)
    return np.maximum(f(x), Z)


def score(n, k, k_exp=1.25, size_weighted=True, floored=True, below=True):
    """cr2_score. below=False is the version before session 18 (the bound away from 1/2 at a
    design effect of at least 1); with also floored=False the one before; with also
    size_weighted=False, k_exp=1.5 the one before that."""
    N, p, V, df = cr2(n, k)
    t = stats.t.ppf(0.975, df)
    q = np.where(p * (1 - p) > 0, p * (1 - p), 1)
    naive = p * (1 - p) / N
    B = V - naive
    Bh = B
    if size_weighted:
        _, sb, sq = anova(n, k, k)  # 0/1 rows: sum of squares = sum
        Ba = sb * (sq / N ** 2 - 1 / N)
        Bh = np.where(np.isnan(Ba), B, B + np.abs(1 - 2 * p) * np.maximum(np.nan_to_num(Ba) - B, 0))
    b_lo, b_hi = np.where(p <= 0.5, B, Bh), np.where(p <= 0.5, Bh, B)
    # Away from 1/2: the floored-variance multiplier, weighed in by the skewness |1 - 2p|.
    t_away = t
    if floored:
        s = np.abs(1 - 2 * p)
        kappa = np.where(naive > 0, naive / np.where(V > naive, V, np.where(naive > 0, naive, 1)), 1.0)
        t_away = s * floored_quantile(kappa, df) + (1 - s) * t
    t_lo, t_hi = np.where(p <= 0.5, t_away, t), np.where(p <= 0.5, t, t_away)
    wl, wh = wilson(p, N, t_lo)[0], wilson(p, N, t_hi)[1]
    if below:
        # Away from 1/2 a CR2 variance below the binomial part counts, weighed by |1 - 2p|,
        # the design effect floored at 1/2 (NEAR_DEFF_FLOOR).
        s_ = np.abs(1 - 2 * p)
        de = np.clip(V / np.where(naive > 0, naive, 1), 0.5, 1)
        Ne = N / (1 - s_ * (1 - de))
        wl = np.where(p <= 0.5, wilson(p, Ne, t_lo)[0], wl)
        wh = np.where(p > 0.5, wilson(p, Ne, t_hi)[1], wh)

    def side(Bs, t):
        def inside(P):
            w = P * (1 - P)
            r = w / q[:, None]
            v = w / N[:, None] + np.maximum(Bs, 0)[:, None] * np.maximum(r, r ** k_exp)
            return (p[:, None] - P) ** 2 <= (t * t)[:, None] * v
        return inside

    lo, hi = outer(p, side(b_lo, t_lo), 0.0), outer(p, side(b_hi, t_hi), 1.0)
    ok = naive > 0
    return np.where(ok & (b_lo > 0), lo, wl), np.where(ok & (b_hi > 0), hi, wh)


def diff_interval(n, x, ss, floor):
    N, d, V, df = cr2(n, x)
    if floor:
        msw, sb, sq = anova(n, x, ss)
        V = np.maximum(V, np.nan_to_num(msw / N + sb * sq / N ** 2, nan=-np.inf))
    h = stats.t.ppf(0.975, df) * np.sqrt(V)
    return d - h, d + h


def tango_var(D, pos, neg, N):
    """Tango's variance of the mean difference at hypothesised differences D (rows x points)."""
    b, c, n = pos[:, None], neg[:, None], N[:, None]
    W = -b - c + (2 * n - b + c) * D
    q = (np.sqrt(np.maximum(W * W + 8 * n * c * D * (1 - D), 0)) - W) / (4 * n)
    return np.maximum(2 * q + D * (1 - D), 0) / n


def paired_score(n, x, ss):
    """`cr2_score` for pass/fail pairs: Tango's score interval times the design effect of the
    CR2-RI variance on the side where Tango's variance grows faster (judged one naive SE either
    side of the estimate), of the CR2 variance on the other."""
    N, d, Vc, df = cr2(n, x)
    msw, sb, sq = anova(n, x, ss)
    Vr = np.maximum(Vc, np.nan_to_num(msw / N + sb * sq / N ** 2, nan=-np.inf))
    S1, S2 = x.sum(1), ss.sum(1)
    pos, neg = (S2 + S1) / 2, (S2 - S1) / 2
    naive = (S2 / N - d * d) / N
    t = stats.t.ppf(0.975, df)
    nz = np.where(naive > 0, naive, 1)
    up = np.where(naive > 0, np.where(Vr > 0, Vr / nz, 1), 1)
    down = np.where(naive > 0, np.where(Vc > 0, Vc / nz, up), 1)

    h = np.sqrt(naive)
    upper_faster = (tango_var(np.minimum(d + h, 1)[:, None], pos, neg, N)[:, 0]
                    >= tango_var(np.maximum(d - h, -1)[:, None], pos, neg, N)[:, 0])
    d_lo, d_hi = np.where(upper_faster, down, up), np.where(upper_faster, up, down)

    def side(dd):
        def inside(D):
            v = tango_var(D, pos, neg, N) * dd[:, None]
            return (d[:, None] - D) ** 2 <= (t * t)[:, None] * v
        return inside
    return outer(d, side(d_lo), -1.0), outer(d, side(d_hi), 1.0)


def table(rows, names):
    print("design".ljust(22), " ".join(f"{m:>20}" for m in names))
    summ = {m: [99, 0, 99, 0, 0] for m in names}
    for label, G, cells in rows:
        print(label.ljust(22), " ".join(f"{c:5.1f}({w:.2f},{lm:.1f})".rjust(20) for c, w, lm in cells))
        for m, (c, w, _) in zip(names, cells):
            s = summ[m]
            if G >= 20:
                s[0], s[1], s[4] = min(s[0], c), max(s[1], c), max(s[4], w)
            if G == 10:
                s[2], s[3] = min(s[2], c), max(s[3], w)
    for m in names:
        print(f"{m:>14}", "G>=20 %.1f-%.1f  G=10 %.1f  width G=10 %.3f, G>=20 %.3f" % tuple(summ[m]))


def cell(lo, hi, truth, est):
    orc = 2 * Z * (est - truth).std(ddof=1)
    return (100 * np.mean((lo <= truth) & (truth <= hi)), np.mean(hi - lo) / orc,
            100 * np.mean(hi < truth))


JITTERED = np.linspace(0.04, 0.06, 201)  # "0.04-0.06": a rate drawn per replication, as the bench


def draw_rates(rng, R, G, uneq, rho, rate):
    """R evals of G templates (10 cases or 1 to 50): sizes, failures per template, and the true
    rate per eval (`rate`, or drawn from JITTERED when it is "0.04-0.06")."""
    s = sigma(rho)
    if rate == "0.04-0.06":
        idx = rng.integers(0, len(JITTERED), R)
        mu = JITTERED[idx]
        a = np.array([intercept(m, s) for m in JITTERED])[idx][:, None]
    else:
        mu, a = np.full(R, rate), intercept(rate, s)
    n = sizes(rng, R, G, uneq)
    k = rng.binomial(n.astype(int), expit(a + s * rng.standard_normal((R, G)))).astype(float)
    return n, k, mu


def main_rates(R, seed):
    rng = np.random.default_rng(seed)
    methods = {"cr2_score_prev": lambda n, k: score(n, k, below=False), "cr2_score": score}
    rows = []
    for rate in (0.5, 0.05, "0.04-0.06"):
        for uneq in (False, True):
            for rho in (0.05, 0.3):
                for G in (5, 10, 20, 40, 100):
                    n, k, mu = draw_rates(rng, R, G, uneq, rho, rate)
                    est = k.sum(1) / n.sum(1)
                    rows.append((f'{G:3d} {"1-50" if uneq else "10  "} {rho:4} {rate}', G,
                                 [cell(*f(n, k), mu, est) for f in methods.values()]))
    table(rows, list(methods))


def draw_pairs(rng, R, G, uneq, rho, mu, delta=0.5):
    """R evals of G templates of pass/fail pairs: A at template effect s u (rate `mu`), B at
    a shift `delta` plus its own template effect (half the SD) and, per case, B's draw equal
    to A's half the time. Returns sizes, per-template sums of B - A and of (B - A)^2, and the
    true difference of population rates."""
    s = sigma(rho)
    tau = s / 2
    a = intercept(mu, s)
    truth = lnmean(a + delta, np.sqrt(s * s + tau * tau)) - mu
    n = sizes(rng, R, G, uneq)
    u = rng.standard_normal((R, G))
    pa = expit(a + s * u)
    pb = expit(a + delta + s * u + tau * rng.standard_normal((R, G)))
    m = int(n.max())
    ua = rng.random((R, G, m))
    ub = np.where(rng.random((R, G, m)) < 0.5, ua, rng.random((R, G, m)))
    valid = np.arange(m)[None, None, :] < n[:, :, None]
    A = (ua < pa[:, :, None]) & valid
    Bv = (ub < pb[:, :, None]) & valid
    x = (Bv.sum(2) - A.sum(2)).astype(float)
    ss = (A ^ Bv).sum(2).astype(float)  # sum of d^2 per cluster
    return n, x, ss, truth


def main_paired(R, seed):
    rng = np.random.default_rng(seed)
    names = ["cr2", "cr2_ri", "cr2_score"]
    rows = []
    for mu in (0.5, 0.1):
        for uneq in (False, True):
            for rho in (0.05, 0.3):
                for G in (5, 10, 20, 40, 100):
                    n, x, ss, truth = draw_pairs(rng, R, G, uneq, rho, mu)
                    est = x.sum(1) / n.sum(1)
                    cells = [cell(*diff_interval(n, x, ss, fl), truth, est) for fl in (False, True)]
                    cells.append(cell(*paired_score(n, x, ss), truth, est))
                    rows.append((f'{G:3d} {"1-50" if uneq else "10  "} {rho:4} {mu:4}', G, cells))
    table(rows, names)


def main_pooled(R, seeds):
    """The widest default cells at 20 templates, pooled over `seeds` runs of R replications:
    coverage, the misses above, and mean width over the oracle's with a bootstrap SE (the
    oracle's SD is estimated from the pooled errors, so the SE covers both)."""
    def rates(rate):
        def run(rng):
            n, k, mu = draw_rates(rng, R, 20, True, 0.3, rate)
            return (n, k, mu, *score(n, k))
        return run

    def pairs(rng):
        n, x, ss, truth = draw_pairs(rng, R, 20, True, 0.3, 0.1)
        return (n, x, truth, *paired_score(n, x, ss))

    designs = [("rate 0.05", rates(0.05)), ("rate 0.04-0.06", rates("0.04-0.06")),
               ("paired, rate 0.1", pairs)]
    for label, run in designs:
        widths, errs, covered, above = [], [], [], []
        for seed in seeds:
            n, x, truth, lo, hi = run(np.random.default_rng(seed))
            est = x.sum(1) / n.sum(1)
            widths.append(hi - lo)
            errs.append(est - truth)
            covered.append((lo <= truth) & (truth <= hi))
            above.append(hi < truth)
        w, e = np.concatenate(widths), np.concatenate(errs)
        ratio = lambda i: w[i].mean() / (2 * Z * e[i].std(ddof=1))
        boot = np.random.default_rng(0)
        se = np.std([ratio(boot.integers(0, len(w), len(w))) for _ in range(200)])
        print(f"20 templates of 1-50, ICC 0.3, {label}: {len(w)} replications, coverage "
              f"{100 * np.concatenate(covered).mean():.2f}% (above {100 * np.concatenate(above).mean():.2f}%), "
              f"width {ratio(slice(None)):.4f} +- {se:.4f} x the oracle", flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    R = int(args[0]) if args else 4000
    if "--pooled" in sys.argv:
        main_pooled(R, range(10, 10 + (int(args[1]) if len(args) > 1 else 6)))
    else:
        seed = int(args[1]) if len(args) > 1 else 2026
        (main_paired if "--paired" in sys.argv else main_rates)(R, seed)
