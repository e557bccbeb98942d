#!/usr/bin/env python3
"""Clustered statistics on files evalflow did not write, whole process against DuckDB.

Usage: python3 benches/foreign/clustered.py [--bin target/release/evalflow] [--rows 20000000]
       [--work /tmp/evalflow-foreign] [--reps 3]

Writes one table of `--rows` rows in random order (20 models x 20,000 templates shared by all,
keys `model-N` / `tpl-N`, a 0/1 `score` and a paired `score_b`) in several layouts:
pyarrow with default options (1M-row row groups), pyarrow with 100k-row row groups, DuckDB's
`COPY`, pyarrow with long keys (`sentiment/negation_test/tpl-N`), pyarrow with 64k-row
groups (`rg64k`), polars' writer (zstd, large strings) and DataFusion's (zstd), both Python
packages with their defaults (`--layouts` picks some). On each it times, as a user runs them
(a new process each, best of `--reps`):

- `evalflow sql` with `clustered_se`, `clustered_mean_ci` and `paired_diff_clustered` GROUP BY
  model;
- evalflow's scan floor on the same file (`max(length(template_id)), sum(score)` GROUP BY model);
- DuckDB (Python package, 2 threads) computing the clustered SE with two-level SQL (per
  template sums, then per model), the same number (checked to 1e-9).

Prints each time, evalflow / DuckDB and evalflow / floor. Targets (issue 38): clustered_se at
most 0.75x DuckDB and at most 2x the floor on the pyarrow default layout.
"""
import argparse
import os
import subprocess
import sys
import time

DUCK = r"""
import sys, time, duckdb
t = time.time()
con = duckdb.connect()
con.execute("SET threads TO 2")
# A query past two seconds (a file read cold) would print a progress bar into the output.
con.execute("SET enable_progress_bar = false")
r = con.execute('''WITH c AS (SELECT model, template_id, count(*) AS n, sum(score) AS s,
      sum(score * score) AS ss FROM read_parquet(?) GROUP BY model, template_id),
  g AS (SELECT model, sum(n) AS n, sum(s) / sum(n) AS m, sum(ss) AS ss FROM c GROUP BY model)
SELECT c.model,
  sqrt(sum((c.s - c.n * g.m) * (c.s - c.n * g.m)) / (any_value(g.n) * any_value(g.n))
     + (any_value(g.ss) - any_value(g.n) * any_value(g.m) * any_value(g.m))
       / (any_value(g.n) * any_value(g.n) * (any_value(g.n) - 1))) AS se
FROM c JOIN g USING (model) GROUP BY c.model ORDER BY c.model''', [sys.argv[1]]).fetchall()
print(time.time() - t)
for m, se in r:
    print(m, repr(se))
"""

QUERIES = {
    "clustered_se": "SELECT model, clustered_se(score, template_id) AS se FROM t GROUP BY model ORDER BY model",
    "clustered_mean_ci": "SELECT model, clustered_mean_ci(score, template_id)['hi'] AS hi FROM t GROUP BY model ORDER BY model",
    "paired_diff_clustered": "SELECT model, paired_diff_clustered(score, score_b, template_id)['se'] AS se FROM t GROUP BY model ORDER BY model",
    "floor": "SELECT model, max(length(template_id)) AS l, sum(score) AS s FROM t GROUP BY model ORDER BY model",
}


def write(path, rows, layout):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(38)
    m = rng.integers(0, 20, rows)
    t = rng.integers(0, 20000, rows)
    prefix = "sentiment/negation_test/tpl-" if layout == "long_keys" else "tpl-"
    models = np.array([f"model-{i}" for i in range(20)], dtype=object)
    tpls = np.array([f"{prefix}{i}" for i in range(20000)], dtype=object)
    p_t = rng.beta(1, 3, 20000)
    score = (rng.random(rows) < p_t[t]).astype(np.float64)
    score_b = (rng.random(rows) < np.clip(p_t[t] + 0.05, 0, 1)).astype(np.float64)
    tbl = pa.table({"model": pa.array(models[m], pa.string()),
                    "template_id": pa.array(tpls[t], pa.string()),
                    "score": score, "score_b": score_b})
    if layout == "duckdb":
        import duckdb
        tmp = path + ".arrow.parquet"
        pq.write_table(tbl, tmp)
        con = duckdb.connect()
        con.execute(f"COPY (SELECT * FROM read_parquet('{tmp}')) TO '{path}' (FORMAT parquet)")
        os.remove(tmp)
    elif layout == "polars":
        # polars' own writer, its defaults (zstd, large strings).
        import polars as pl
        pl.from_arrow(tbl).write_parquet(path)
    elif layout == "datafusion":
        # DataFusion's (Python package) writer, its defaults.
        import datafusion
        ctx = datafusion.SessionContext()
        tmp = path + ".dir"
        ctx.from_arrow(tbl).write_parquet(tmp)
        parts = sorted(os.listdir(tmp)) if os.path.isdir(tmp) else []
        if parts:
            # One file, as a user would hand it over: a directory of one part is moved out.
            assert len(parts) == 1, parts
            os.rename(os.path.join(tmp, parts[0]), path)
            os.rmdir(tmp)
        else:
            os.rename(tmp, path)
    else:
        groups = {"rg100k": 100_000, "rg64k": 65_536}.get(layout, 1_000_000)
        pq.write_table(tbl, path, row_group_size=groups)


def best(cmd, reps):
    out, times = None, []
    for _ in range(reps):
        t = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True)
        times.append(time.time() - t)
        if p.returncode != 0:
            sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr[-2000:]}")
        out = p.stdout
    return min(times), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/evalflow")
    ap.add_argument("--rows", type=int, default=20_000_000)
    ap.add_argument("--work", default="/tmp/evalflow-foreign")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layouts", default="pyarrow,rg100k,rg64k,duckdb,polars,datafusion,long_keys")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    ev = os.path.abspath(a.bin)
    print("| file | duckdb s | clustered_se s | / duckdb | / floor | clustered_mean_ci s | paired_diff_clustered s | floor s |")
    print("|---|---|---|---|---|---|---|---|")
    for layout in a.layouts.split(","):
        path = os.path.join(a.work, f"{layout}-{a.rows}.parquet")
        if not os.path.exists(path):
            print(f"writing {path} ...", file=sys.stderr)
            write(path + ".tmp", a.rows, layout)
            os.rename(path + ".tmp", path)
        d, dout = best([sys.executable, "-c", DUCK, path], a.reps)
        times = {}
        for name, q in QUERIES.items():
            times[name], out = best([ev, "sql", q, "--table", f"t={path}", "--format", "csv"], a.reps)
            if name == "clustered_se":
                ours = [l.split(",") for l in out.strip().splitlines()[1:]]
                theirs = [l.split() for l in dout.strip().splitlines()[1:]]
                for (m1, s1), (m2, s2) in zip(ours, theirs):
                    assert m1 == m2 and abs(float(s1) - float(s2)) < 1e-9 * max(1, abs(float(s2))), (m1, s1, m2, s2)
        se = times["clustered_se"]
        print(f"| {layout} | {d:.2f} | {se:.2f} | {se / d:.2f} | {se / times['floor']:.2f} | "
              f"{times['clustered_mean_ci']:.2f} | {times['paired_diff_clustered']:.2f} | {times['floor']:.2f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
