#!/usr/bin/env python3
"""The judge at corpus scale: a recorded corpus re-judged by a 3-question judge scorer.

Usage: bench.py [--bin PATH] [--sizes 20000,200000,2000000@256MiB] [--work DIR]
                [--concurrency 256] [--latency-ms 50] [--threads 2]

For each size N (optionally `N@LIMIT`, the `--memory-limit` of that run, default 1GiB;
optionally `N@LIMIT@LATENCY` to lower the mock's latency for a big size) it generates N
recorded answers (../corpus/gen_corpus.py, cached in --work), imports and validates them,
then times `evalflow rescore ROOT --scorer-file judge.toml` (a `kind = "judge"` scorer of 3
questions at concurrency C) against `evalflow mock-server --answer checklist --latency-ms L`
under /usr/bin/time. Prints per size: wall, judge calls (the nested run's rows), judge
calls/s and its share of Little's bound (C / L), peak RSS and the exit code. Targets (issue
41): 2M at 256 MiB exit 0 with peak RSS at most 0.5 GiB; at least 0.9 of the bound from 200k.

Build first: `cargo build --release --target-dir /work/rel-target` (the default --bin).
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "corpus", "gen_corpus.py")

QUESTIONS = [
    ("label", "Does the response name a sentiment label?"),
    ("reason", "Does the response give a reason for its label?"),
    ("polite", "Is the response polite?"),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=20.0):
    t = time.time()
    while time.time() - t < timeout:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"mock server on port {port} did not start")


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return p.stdout


def timed(cmd, env):
    """Runs cmd under GNU time; returns (exit code, wall s, cpu s, peak RSS bytes, stderr)."""
    t = time.time()
    p = subprocess.run(["/usr/bin/time", "-f", "__time %e %U %S %M"] + cmd,
                       capture_output=True, text=True, env=env)
    wall = time.time() - t
    line = [l for l in p.stderr.splitlines() if l.startswith("__time")]
    if not line:
        return p.returncode, wall, 0.0, 0, p.stderr
    _, _e, u, s, m = line[-1].split()
    return p.returncode, wall, float(u) + float(s), int(m) * 1024, p.stderr


def count(ev, table, sql):
    out = run([ev, "sql", sql, "--table", f"calls={table}", "--format", "json"])
    rows = json.loads(out)
    return int(list(rows[0].values())[0]) if rows else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="/work/rel-target/release/evalflow")
    ap.add_argument("--sizes", default="20000,200000,2000000@256MiB")
    ap.add_argument("--work", default="/tmp/evalflow-judge")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--latency-ms", type=int, default=50)
    ap.add_argument("--threads", default="2")
    ap.add_argument("--keep", action="store_true", help="keep the run roots")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    ev = os.path.abspath(a.bin)
    env = {"EVALFLOW_CACHE_DIR": "off", "PATH": "/usr/bin:/bin"}
    rows = []
    for spec in a.sizes.split(","):
        parts = spec.split("@")
        n = int(parts[0])
        limit = parts[1] if len(parts) > 1 else "1GiB"
        latency = int(parts[2]) if len(parts) > 2 else a.latency_ms
        src = os.path.join(a.work, f"corpus-{n}.jsonl")
        if not os.path.exists(src):
            print(f"generating {src} ...", file=sys.stderr)
            subprocess.run([sys.executable, GEN, str(n), src + ".tmp", "--jobs", "2"], check=True)
            os.rename(src + ".tmp", src)
        base = os.path.join(a.work, f"base-{n}")
        if not os.path.exists(os.path.join(base, "validity")):
            print(f"N={n}: import + validate ...", file=sys.stderr)
            shutil.rmtree(base, ignore_errors=True)
            flags = ["--threads", a.threads]
            run([ev] + flags + ["import", src, "--out", base], env=env)
            run([ev] + flags + ["validate", os.path.join(base, "import.toml"), "--out", base], env=env)
        root = os.path.join(a.work, f"run-{n}")
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(base, root)
        port = free_port()
        mock = subprocess.Popen([ev, "mock-server", "--addr", f"127.0.0.1:{port}", "--answer", "checklist",
                                 "--latency-ms", str(latency)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(port)
            scorer = os.path.join(a.work, "judge.toml")
            qs = ", ".join(f'{{ id = "{i}", text = "{t}" }}' for i, t in QUESTIONS)
            with open(scorer, "w") as f:
                f.write('[[scorer]]\nname = "helpful"\nkind = "judge"\nmetric = "numeric"\n'
                        f'model = {{ provider = "openai", base_url = "http://127.0.0.1:{port}/v1", '
                        f'name = "judge-model", temperature = 0.0, concurrency = {a.concurrency} }}\n'
                        f"questions = [{qs}]\n")
            print(f"N={n}: rescore with the judge ({limit}, {latency} ms) ...", file=sys.stderr)
            code, wall, cpu, rss, err = timed(
                [ev, "--memory-limit", limit, "--threads", a.threads, "rescore", root, "--scorer-file", scorer], env)
        finally:
            mock.terminate()
            mock.wait()
        if code != 0:
            print(err[-2000:], file=sys.stderr)
            rows.append((n, limit, latency, code, wall, None, None, None, rss, cpu))
            continue
        versions = os.listdir(os.path.join(root, "judge"))
        judged = count(ev, os.path.join(root, "judge", versions[0], "calls"), "SELECT count(*) AS n FROM calls")
        bound = a.concurrency / (latency / 1000)
        rate = judged / wall
        rows.append((n, limit, latency, code, wall, judged, rate, rate / bound, rss, cpu))
        print(f"N={n}: {wall:.1f} s, {judged:,} judge calls, {rate:,.0f}/s ({rate / bound:.0%} of {bound:,.0f}/s), "
              f"peak RSS {rss / 2**20:,.0f} MiB, cpu {cpu:.0f} s", file=sys.stderr)
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\nconcurrency {a.concurrency}, threads {a.threads}; share = judge calls/s over Little's bound "
          "(concurrency / latency); wall includes building the prompts and writing the scores")
    print("| answers | --memory-limit | latency | exit | wall | judge calls | calls/s | share of bound | peak RSS | cpu |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, limit, lat, code, wall, judged, rate, share, rss, cpu in rows:
        if judged is None:
            print(f"| {n:,} | {limit} | {lat} ms | {code} | {wall:.1f} s | - | - | - | {rss / 2**20:,.0f} MiB | {cpu:.0f} s |")
        else:
            print(f"| {n:,} | {limit} | {lat} ms | {code} | {wall:.1f} s | {judged:,} | {rate:,.0f} | {share:.2f} | "
                  f"{rss / 2**20:,.0f} MiB | {cpu:.0f} s |")


if __name__ == "__main__":
    main()
