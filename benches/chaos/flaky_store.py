#!/usr/bin/env python3
"""What a flaky object store costs: the default pipeline (`evalflow run pipelines/
sentiment.toml`) on an `s3://` root on moto, through tests/fault_proxy.py at fault rates 0 and
--rate (default 0.05: 503 SlowDown, 500, resets, slow answers, answers lost after commit),
alternating, --reps times each. Prints each run's wall time and the median ratio flaky/steady
(issue 60's target: at most 1.5x at 5%), the faults injected and whether each run's tables
equal the first steady run's.

Usage: flaky_store.py [--bin PATH] [--rate R] [--reps N]   (needs moto[server])
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUERIES = [
    "SELECT * FROM cases ORDER BY case_id",
    "SELECT * EXCLUDE (latency_ms, started_at) FROM calls ORDER BY call_id",
    "SELECT * FROM validity ORDER BY call_id",
    "SELECT * FROM scores ORDER BY call_id",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port):
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on {port}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(REPO / "target/release/evalflow"))
    ap.add_argument("--rate", type=float, default=0.05)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    mport = free_port()
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(mport)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [moto]
    try:
        wait_port(mport)
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{mport}/bench",
                                                      method="PUT")).read()
        proxies = {}
        for rate in (0.0, a.rate):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, str(REPO / "tests/fault_proxy.py"), "--upstream",
                 f"http://127.0.0.1:{mport}", "--port", str(port), "--rate", str(rate)],
                stderr=subprocess.DEVNULL))
            wait_port(port)
            proxies[rate] = port
        times = {0.0: [], a.rate: []}
        reference = None
        for rep in range(a.reps):
            for rate in (0.0, a.rate):
                env = dict(os.environ, AWS_ACCESS_KEY_ID="t", AWS_SECRET_ACCESS_KEY="t",
                           AWS_REGION="us-east-1", AWS_ALLOW_HTTP="true",
                           AWS_ENDPOINT=f"http://127.0.0.1:{proxies[rate]}")
                root = f"s3://bench/r{rep}-{rate}"
                t0 = time.time()
                r = subprocess.run([a.bin, "run", "pipelines/sentiment.toml", "--out", root],
                                   cwd=REPO, env=env, capture_output=True, text=True)
                dt = time.time() - t0
                if r.returncode != 0:
                    sys.exit(f"run failed at rate {rate}: {r.stderr[-2000:]}")
                tables = [subprocess.run([a.bin, "sql", "--format", "json", "--run", root, q],
                                         cwd=REPO, env=env, capture_output=True, text=True,
                                         check=True).stdout for q in QUERIES]
                reference = reference or tables
                times[rate].append(dt)
                print(f"rate {rate}: {dt:.2f} s, tables {'equal' if tables == reference else 'DIFFER'}")
        steady, flaky = statistics.median(times[0.0]), statistics.median(times[a.rate])
        faults = json.load(urllib.request.urlopen(f"http://127.0.0.1:{proxies[a.rate]}/__faults"))
        print(f"median steady {steady:.2f} s, flaky {flaky:.2f} s: ratio {flaky / steady:.2f}x")
        print(f"faults injected at {a.rate}: {faults}")
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    main()
