#!/usr/bin/env python3
"""The Python package against the CLI and pyarrow, whole process against whole process.

Usage: bench.py [--bin PATH] [--rows N] [--calls N] [--repeat R] [--work DIR]

1. `clustered_se(score, template_id)` grouped by model over N rows (default 20M: 20 models x
   20,000 templates shared by all, keys `model-N` / `tpl-N`, rows in random order), one file
   written by pyarrow with default options: `evalflow sql` (the binary) against a Python
   process that imports datafusion and evalflow, registers the functions into a plain
   `datafusion.SessionContext` and runs the same query (Python's start included).
2. `open_run(root).sql("SELECT * FROM scores").to_arrow_table()` on a run of N calls
   (default 1M, imported from benches/corpus/gen_corpus.py's corpus, validated and scored)
   against `pyarrow.parquet.read_table` of the same parts, each in a fresh Python process.

Prints each time (best and median of R runs) and the ratios the issue sets targets on
(at most 1.5). Use release builds of both the binary and the wheel: a dev build's DataFusion
is unoptimised, datafusion-python's never is.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def timed(cmd, env=None):
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    dt = time.perf_counter() - t
    if p.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({p.returncode}): {p.stderr[-2000:]}")
    return dt, p.stdout


def best_median(cmd, repeat, env=None):
    times, out = [], ""
    for _ in range(repeat):
        dt, out = timed(cmd, env)
        times.append(dt)
    return min(times), statistics.median(times), out


def clustered_file(work: Path, rows: int) -> Path:
    path = work / f"clustered-{rows}.parquet"
    if path.exists():
        return path
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(38)
    models = rng.integers(0, 20, rows)
    templates = rng.integers(0, 20_000, rows)
    rate = 0.1 + 0.8 * (templates % 97) / 97
    score = (rng.random(rows) < rate).astype(np.float64)
    table = pa.table(
        {
            "model": pa.array(np.char.add("model-", models.astype(str))),
            "template_id": pa.array(np.char.add("tpl-", templates.astype(str))),
            "score": pa.array(score),
        }
    )
    pq.write_table(table, path)  # pyarrow's defaults: 1M-row row groups, Snappy, dictionaries
    return path


QUERY = "SELECT model, clustered_se(score, template_id) AS se FROM t GROUP BY model ORDER BY model"

PY_CLUSTERED = """
import sys, datafusion, evalflow
ctx = datafusion.SessionContext()
evalflow.register(ctx)
ctx.register_parquet("t", sys.argv[1])
rows = ctx.sql(sys.argv[2]).to_pylist()
print(len(rows), sum(r["se"] for r in rows))
"""

PY_OPEN_RUN = """
import sys, evalflow
t = evalflow.open_run(sys.argv[1]).sql("SELECT * FROM scores").to_arrow_table()
print(t.num_rows)
"""

PY_PYARROW = """
import sys, glob, pyarrow.parquet as pq
parts = sorted(glob.glob(sys.argv[1] + "/scores/*/part-*.parquet"))
t = pq.read_table(parts)
print(t.num_rows)
"""


def scored_run(work: Path, calls: int, binary: str) -> Path:
    root = work / f"run-{calls}"
    if (root / "results").exists():
        return root
    corpus = work / f"corpus-{calls}.jsonl"
    if not corpus.exists():
        subprocess.run([sys.executable, str(REPO / "benches/corpus/gen_corpus.py"), str(calls), str(corpus)], check=True)
    for args in (
        ["import", str(corpus), "--out", str(root)],
        ["validate", str(root / "import.toml"), "--out", str(root)],
        ["score", str(root / "import.toml"), "--out", str(root)],
        ["aggregate", str(root / "import.toml"), "--out", str(root)],
    ):
        subprocess.run([binary, *args], check=True, stdout=subprocess.DEVNULL)
    return root


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(REPO / "target/release/evalflow"))
    ap.add_argument("--rows", type=int, default=20_000_000)
    ap.add_argument("--calls", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default="/tmp/evalflow-python-bench")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    import datafusion
    import evalflow

    print(f"datafusion {datafusion.__version__}, evalflow {evalflow.__version__} ({evalflow._native.__file__})")
    print(f"binary: {a.bin}")

    f = clustered_file(work, a.rows)
    cli_best, cli_med, cli_out = best_median(
        [a.bin, "sql", QUERY.replace("FROM t", f"FROM t"), "--table", f"t={f}", "--format", "csv"], a.repeat
    )
    py_best, py_med, py_out = best_median([sys.executable, "-c", PY_CLUSTERED, str(f), QUERY], a.repeat)
    n_groups = int(py_out.split()[0])
    assert n_groups == len(cli_out.strip().splitlines()) - 1, (py_out, cli_out)
    print(
        f"clustered_se by model, {a.rows:,} rows: evalflow sql {cli_best:.2f} s (median {cli_med:.2f}), "
        f"datafusion-python + register {py_best:.2f} s (median {py_med:.2f}); "
        f"ratio {py_best / cli_best:.2f} (target <= 1.5)"
    )

    root = scored_run(work, a.calls, a.bin)
    or_best, or_med, or_out = best_median([sys.executable, "-c", PY_OPEN_RUN, str(root)], a.repeat)
    pa_best, pa_med, pa_out = best_median([sys.executable, "-c", PY_PYARROW, str(root)], a.repeat)
    assert or_out.strip() == pa_out.strip(), (or_out, pa_out)
    print(
        f"SELECT * FROM scores, {int(pa_out):,} rows: open_run {or_best:.2f} s (median {or_med:.2f}), "
        f"pyarrow.parquet.read_table {pa_best:.2f} s (median {pa_med:.2f}); "
        f"ratio {or_best / pa_best:.2f} (target <= 1.5)"
    )


if __name__ == "__main__":
    main()
