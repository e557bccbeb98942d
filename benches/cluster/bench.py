#!/usr/bin/env python3
"""The cluster bench: clustered statistics per model over a scores table, locally and on a
1-scheduler / 2-executor Ballista cluster on loopback, in the same run.

Usage: python3 benches/cluster/bench.py [--rows 100000000] [--bin target/debug/evalflow]
       [--work /tmp/evalflow-cluster-bench] [--files 20] [--threads 2] [--slots 1]

Builds nothing: build the binary with the feature first (`cargo build --features ballista`).
Generates a scores-shaped Parquet table of --rows rows in --files files (cached in --work):
`model` (8 models), `template_id` (20,000 templates, the cluster), `score` and
`score_b` (a second scorer version, for the paired difference). Then runs

    SELECT model, clustered_se(score, template_id), paired_diff_clustered(score, score_b,
           template_id) FROM scores GROUP BY model

with `evalflow sql` on this machine (--threads cores) and with `--cluster` against a scheduler
and two executors started here (--slots task slots each), checks that both give the same
numbers (1e-12 relative), and prints wall time, the cluster's overhead ratio (cluster wall /
local wall) and rows/s per executor. On 2 cores a cluster cannot be faster than one process:
the figure to watch is the overhead ratio.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

QUERY = (
    "SELECT model, clustered_se(score, template_id) AS se, "
    "paired_diff_clustered(score, score_b, template_id) AS diff "
    "FROM scores GROUP BY model ORDER BY model"
)


def gen_sql(lo, hi, path):
    # A deterministic scores table: per-template effects make the clustering matter.
    return (
        f"COPY (SELECT 'model-' || CAST(i % 8 AS VARCHAR) AS model, "
        f"'t' || CAST((i / 8) % 20000 AS VARCHAR) AS template_id, "
        f"CAST(((i * 2654435761) % 1000) / 1000.0 + ((i / 8) % 20000) / 40000.0 AS DOUBLE) AS score, "
        f"CAST(((i * 40503) % 997) / 997.0 + ((i / 8) % 20000) / 40000.0 AS DOUBLE) AS score_b "
        f"FROM unnest(range({lo}, {hi})) AS t(i)) TO '{path}' STORED AS PARQUET"
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, what):
    start = time.time()
    while time.time() - start < 60:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None:
                sys.exit(f"{what} exited with {proc.returncode} before listening on {port}")
            time.sleep(0.1)
    sys.exit(f"{what} did not listen on {port}")


def timed(cmd):
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
    return wall, json.loads(r.stdout)


def max_rel_diff(a, b, at="result"):
    """The largest relative difference between two results of the same shape: sums added in
    another order differ in the last bits, and a p-value amplifies that through z."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return (abs(a - b) / max(abs(a), abs(b), 1e-300), at)
    if isinstance(a, list):
        assert len(a) == len(b), at
        return max([max_rel_diff(x, y, f"{at}[{i}]") for i, (x, y) in enumerate(zip(a, b))] + [(0.0, at)])
    if isinstance(a, dict):
        assert a.keys() == b.keys(), at
        return max([max_rel_diff(a[k], b[k], f"{at}.{k}") for k in a] + [(0.0, at)])
    if a != b:
        sys.exit(f"{at}: local {a} vs cluster {b}")
    return (0.0, at)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000_000)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--bin", default="target/debug/evalflow")
    ap.add_argument("--work", default="/tmp/evalflow-cluster-bench")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    binary = os.path.abspath(a.bin)
    data = os.path.join(a.work, f"scores-{a.rows}")
    if not os.path.exists(os.path.join(data, "done")):
        os.makedirs(data, exist_ok=True)
        t = time.time()
        per = -(-a.rows // a.files)
        for k in range(a.files):
            lo, hi = k * per, min(a.rows, (k + 1) * per)
            if lo >= hi:
                break
            out = os.path.join(data, f"part-{k:03}.parquet")
            r = subprocess.run([binary, "sql", gen_sql(lo, hi, out)], capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(r.stderr)
        open(os.path.join(data, "done"), "w").close()
        print(f"generated {a.rows:,} rows in {time.time() - t:.1f} s", flush=True)
    size = sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data))
    print(f"scores table: {a.rows:,} rows, {size / 2**20:.0f} MiB in {data}", flush=True)
    table = ["--table", f"scores={data}/"]

    env = dict(os.environ, RUST_LOG="error")
    procs = []
    try:
        sp = free_port()
        url = f"df://127.0.0.1:{sp}"
        s = subprocess.Popen([binary, "scheduler", "--bind", f"127.0.0.1:{sp}"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(s)
        wait_port(sp, s, "scheduler")
        for i in range(2):
            f, g = free_port(), free_port()
            e = subprocess.Popen(
                [binary, "executor", "--scheduler", url, "--bind", f"127.0.0.1:{f}",
                 "--grpc-bind", f"127.0.0.1:{g}", "--slots", str(a.slots),
                 "--work-dir", os.path.join(a.work, f"executor-{i}")],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(e)
            wait_port(f, e, "executor")
            wait_port(g, e, "executor")
        # Wait until both executors are registered (a first small query answers).
        for _ in range(120):
            r = subprocess.run([binary, "sql", "SELECT 1 AS one", "--cluster", url, "--format", "json"],
                               capture_output=True, text=True)
            if r.returncode == 0:
                break
            time.sleep(0.5)
        local_cmd = [binary, "sql", QUERY, *table, "--format", "json", "--threads", str(a.threads)]
        cluster_cmd = [binary, "sql", QUERY, *table, "--format", "json", "--cluster", url]
        local_walls, cluster_walls, diff = [], [], (0.0, "")
        for _ in range(a.repeat):
            w, local = timed(local_cmd)
            local_walls.append(w)
            w, remote = timed(cluster_cmd)
            cluster_walls.append(w)
            diff = max(diff, max_rel_diff(local, remote))
        if diff[0] > 1e-9:
            sys.exit(f"local and cluster results differ by {diff[0]:.1e} relative at {diff[1]}")
        lw, cw = min(local_walls), min(cluster_walls)
        print(f"query: clustered_se and paired_diff_clustered per model ({len(local)} models); "
              f"largest relative difference local vs cluster: {diff[0]:.1e} ({diff[1]})")
        print(f"{'where':<34} {'wall s':>8} {'rows/s':>14} {'rows/s per executor':>20}")
        print(f"{'local, ' + str(a.threads) + ' threads':<34} {lw:>8.2f} {a.rows / lw:>14,.0f} {'':>20}")
        print(f"{'cluster, 2 executors x ' + str(a.slots) + ' slot(s)':<34} {cw:>8.2f} "
              f"{a.rows / cw:>14,.0f} {a.rows / cw / 2:>20,.0f}")
        print(f"cluster overhead ratio (cluster wall / local wall): {cw / lw:.2f}x "
              f"(best of {a.repeat}; all local {['%.2f' % x for x in local_walls]}, "
              f"cluster {['%.2f' % x for x in cluster_walls]})")
    finally:
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
