#!/usr/bin/env python3
"""Independent reference values for evalflow's statistics functions (tests/stats.rs).

Writes tests/fixtures/stats/scores.csv (the data) and tests/fixtures/stats/expected.json (the
values numpy / scipy / statsmodels compute on it). Miller's clustered SE is computed term by term
(O(n^2) over pairs), CR1 by statsmodels OLS on a constant with cov_type='cluster'.

    pip install numpy scipy statsmodels pandas
    python3 scripts/stats_reference.py
"""
import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pandas as pd
import statsmodels.api as sm
from scipy import stats

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "stats"
rng = np.random.default_rng(20260703)


def make_data():
    rows = []
    case = 0
    for grp, n_clusters in [("A", 23), ("B", 31), ("C", 17)]:
        for c in range(n_clusters):
            size = int(rng.integers(1, 9))  # clusters of 1..8 cases, some singletons
            p_c = float(np.clip(rng.normal(0.7, 0.2), 0.02, 0.98))  # cluster effect
            for _ in range(size):
                k = 3  # K samples per case
                p_case = float(np.clip(p_c + rng.normal(0, 0.1), 0.0, 1.0))
                for s in range(k):
                    x = float(rng.random() < p_case)
                    a = round(float(np.clip(p_case + rng.normal(0, 0.15), 0, 1)), 4)
                    b = round(float(np.clip(p_case - 0.05 + rng.normal(0, 0.15), 0, 1)), 4)
                    truth = bool(rng.random() < 0.4)
                    pred = bool(rng.random() < (0.7 if truth else 0.1))
                    rows.append(dict(grp=grp, cluster_int=c * 10 + {"A": 1, "B": 2, "C": 3}[grp],
                                     cluster_str=f"{grp}-t{c:03d}", case_id=f"case{case:04d}",
                                     sample=s, x=x, a=a, b=b, pred=pred, truth=truth))
                case += 1
    df = pd.DataFrame(rows)
    # Sprinkle NULLs (ignored by every function).
    null_x = rng.random(len(df)) < 0.03
    df.loc[null_x, "x"] = np.nan
    null_b = rng.random(len(df)) < 0.03
    df.loc[null_b, "b"] = np.nan
    return df


def miller_se(x, cl):
    x = np.asarray(x, float)
    cl = np.asarray(cl)
    n = len(x)
    m = x.mean()
    var = x.var(ddof=1)
    cross = 0.0
    dev = x - m
    for c in np.unique(cl):
        d = dev[cl == c]
        for i in range(len(d)):
            for j in range(len(d)):
                if i != j:
                    cross += d[i] * d[j]
    return math.sqrt(var / n + cross / n**2)


def cr1_se(x, cl):
    x = np.asarray(x, float)
    groups = pd.factorize(np.asarray(cl))[0]
    fit = sm.OLS(x, np.ones(len(x))).fit(cov_type="cluster", cov_kwds={"groups": groups})
    return float(fit.bse[0])


def conformal(x, alpha):
    s = np.sort(np.asarray(x, float))
    n = len(s)
    k = math.ceil((n + 1) * (1 - Fraction(str(alpha))))
    return float("inf") if k > n else float(s[k - 1])


def self_consistency(x):
    x = np.asarray(x, float)
    n = len(x)
    tot = sum(abs(x[i] - x[j]) for i in range(n) for j in range(i + 1, n))
    return 1 - tot / (n * (n - 1) / 2)


def stats_for(df):
    z = stats.norm.ppf(0.975)
    out = {}
    xd = df[df.x.notna()]
    x = xd.x.to_numpy()
    n = len(x)
    out["n"] = n
    out["mean"] = float(x.mean())
    out["mean_se"] = float(x.std(ddof=1) / math.sqrt(n))
    out["clustered_se"] = miller_se(x, xd.cluster_str)
    out["clustered_se_cr1"] = cr1_se(x, xd.cluster_str)
    out["n_clusters"] = int(xd.cluster_str.nunique())
    out["mean_ci_lo"] = out["mean"] - z * out["mean_se"]
    out["mean_ci_hi"] = out["mean"] + z * out["mean_se"]
    out["mean_ci90_lo"] = out["mean"] - stats.norm.ppf(0.95) * out["mean_se"]
    out["clustered_ci_lo"] = out["mean"] - z * out["clustered_se"]
    out["clustered_ci_hi"] = out["mean"] + z * out["clustered_se"]

    pd_ = df[df.a.notna() & df.b.notna()]
    d = (pd_.a - pd_.b).to_numpy()
    se_d = d.std(ddof=1) / math.sqrt(len(d))
    out["paired_n"] = len(d)
    out["paired_mean_diff"] = float(d.mean())
    out["paired_se"] = float(se_d)
    out["paired_z"] = float(d.mean() / se_d)
    out["paired_p"] = float(2 * stats.norm.sf(abs(d.mean() / se_d)))
    out["paired_clustered_se"] = miller_se(d, pd_.cluster_str)
    zc = d.mean() / out["paired_clustered_se"]
    out["paired_clustered_p"] = float(2 * stats.norm.sf(abs(zc)))

    per_case = xd.groupby("case_id").x
    means = per_case.mean()
    k_mean = n / len(means)
    within = float(per_case.var(ddof=1).dropna().mean())
    out["vc_n_cases"] = int(len(means))
    out["vc_k_mean"] = k_mean
    out["vc_within_var"] = within
    out["vc_between_var"] = max(0.0, float(means.var(ddof=1)) - within / k_mean)

    tp = int((df.pred & df.truth).sum())
    fp = int((df.pred & ~df.truth).sum())
    tn = int((~df.pred & ~df.truth).sum())
    fn = int((~df.pred & df.truth).sum())
    out["confusion"] = [tp, fp, tn, fn]

    out["conformal_a10"] = conformal(pd_.a, 0.1)
    out["conformal_a05"] = conformal(pd_.a, 0.05)
    out["self_consistency_a"] = self_consistency(pd_.a.to_numpy())
    return out


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    df = make_data()
    df.to_csv(OUT / "scores.csv", index=False, na_rep="")
    expected = {"overall": stats_for(df), "by_grp": {g: stats_for(d) for g, d in df.groupby("grp")}}
    # Hand-checkable worked numbers from the seeds.
    expected["seed"] = {
        "sample_size_0_03_1_9": math.ceil((stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) ** 2 * (1 / 9) / 0.03**2),
        "mean_se_80_of_400": math.sqrt(0.8 * 0.2 / 399),
        "mde_969": (stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) * math.sqrt((1 / 9) / 969),
    }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(df)} rows to {OUT}")


if __name__ == "__main__":
    main()
