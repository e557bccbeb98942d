#!/usr/bin/env python3
"""Hung requests against the adaptive deadline: a call stage with and without 2% hangs.

Usage: hangs.py [--bin PATH] [--cases N] [--concurrency C] [--extra TOML]

N cases (default 20,000) called at concurrency C (default 256) against `evalflow mock-server
--latency-ms 50` with 3% rate limits, 3% 5xx and 2% malformed answers, then the same with 2%
hangs added; prints both wall times, their ratio (target at most 1.5), the calls/s against
Little's bound (C / 50 ms) and, from the request log, how long hung attempts waited before
their retry arrived. `--extra` adds `[model]` keys (for example `hang_factor = 0`, the
deadline off, to see what it saves).
"""

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from s3_kill import REPO, free_port, pipeline, wait_port  # noqa: E402


def one(binary, a, tmp: Path, hangs: bool):
    log = tmp / f"log-{hangs}.jsonl"
    port = free_port()
    faults = ["rate_limit=0.03", "server_error=0.03", "malformed_json=0.02"] + (["hang=0.02"] if hangs else [])
    args = [binary, "mock-server", "--addr", f"127.0.0.1:{port}", "--latency-ms", "50", "--request-log", str(log)]
    for f in faults:
        args += ["--fault", f]
    mock = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    d = tmp / f"p-{hangs}"
    d.mkdir()
    p = pipeline(d, f"http://127.0.0.1:{port}/v1", a.cases, a.concurrency)
    if a.extra:
        p.write_text(p.read_text().replace("[suite]", a.extra + "\n\n[suite]", 1))
    root = tmp / f"run-{hangs}"
    env = {"EVALFLOW_CACHE_DIR": "off", "PATH": "/usr/bin:/bin"}
    subprocess.run([binary, "generate", str(p), "--out", str(root)], env=env, check=True, stdout=subprocess.DEVNULL)
    t = time.perf_counter()
    subprocess.run([binary, "call", str(p), "--out", str(root)], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    mock.terminate()
    mock.wait()
    reqs = [json.loads(l) for l in log.read_text().splitlines()]
    by = {}
    for r in reqs:
        by.setdefault(r["call_id"], []).append(r)
    waits = sorted(b["t"] - a_["t"] for rs in by.values() for a_, b in zip(rs, rs[1:]) if a_["fault"] == "hang")
    return wall, len(reqs), waits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(REPO / "target/release/evalflow"))
    ap.add_argument("--cases", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--extra", default="")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="evalflow-hangs-"))
    base, n0, _ = one(a.bin, a, tmp, False)
    hung, n1, waits = one(a.bin, a, tmp, True)
    bound = a.concurrency / 0.05
    print(f"{a.cases:,} calls, concurrency {a.concurrency}: without hangs {base:.1f} s ({a.cases / base:,.0f} calls/s, "
          f"{a.cases / base / bound:.0%} of Little's bound {bound:,.0f}/s, {n0:,} requests); "
          f"with 2% hangs {hung:.1f} s ({n1:,} requests); ratio {hung / base:.2f} (target <= 1.5)")
    if waits:
        med = waits[len(waits) // 2]
        print(f"hung attempts: {len(waits)}, retry after a median {med:.2f} s, at most {waits[-1]:.2f} s")


if __name__ == "__main__":
    main()
