#!/usr/bin/env python3
"""DuckDB's side of `cargo bench --bench clustered`: the same queries on the same files.

Usage: bench_duckdb.py DIR [THREADS]

Reads DIR/*.parquet as table t with DuckDB (THREADS threads, default 2) and prints one JSON
object: query name -> best of 3 in-process seconds, and "clustered_se check" -> the two-level
SQL's clustered SE per model (so the bench can check both engines agree). Needs
`pip install duckdb`.
"""

import json
import sys
import time

import duckdb

TWO_LEVEL_MODEL = """
WITH c AS (SELECT model, template_id, sum(score) AS s, count(score) AS k FROM t
           WHERE score IS NOT NULL GROUP BY model, template_id),
     g AS (SELECT model, avg(score) AS m, count(score) AS n, var_samp(score) AS v FROM t
           GROUP BY model)
SELECT c.model, sqrt(sum((c.s - c.k * g.m) * (c.s - c.k * g.m)) / (max(g.n) * max(g.n))
                     + max(g.v) / (max(g.n) * max(g.n))) AS se
FROM c JOIN g ON c.model = g.model GROUP BY c.model ORDER BY c.model
"""

TWO_LEVEL = """
WITH c AS (SELECT template_id, sum(score) AS s, count(score) AS k FROM t
           WHERE score IS NOT NULL GROUP BY template_id),
     g AS (SELECT avg(score) AS m, count(score) AS n, var_samp(score) AS v FROM t)
SELECT sqrt(sum((c.s - c.k * g.m) * (c.s - c.k * g.m)) / (max(g.n) * max(g.n))
            + max(g.v) / (max(g.n) * max(g.n))) AS se
FROM c CROSS JOIN g
"""

QUERIES = {
    "model: scan floor": "SELECT model, max(length(template_id)), sum(score) FROM t GROUP BY model",
    "model: avg+stddev": "SELECT model, avg(score), stddev(score) FROM t GROUP BY model",
    "model: two-level SQL": TWO_LEVEL_MODEL,
    "two-level SQL": TWO_LEVEL,
}


def main() -> None:
    folder = sys.argv[1]
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    con = duckdb.connect()
    con.execute(f"SET threads = {threads}")
    con.execute(f"CREATE VIEW t AS SELECT * FROM read_parquet('{folder}/*.parquet')")
    out = {}
    for name, sql in QUERIES.items():
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            con.execute(sql).fetchall()
            best = min(best, time.perf_counter() - start)
        out[name] = best
    out["clustered_se check"] = {m: se for m, se in con.execute(TWO_LEVEL_MODEL).fetchall()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
