#!/usr/bin/env python3
"""What a SIGKILL costs on an `s3://` root: calls paid twice across killed sessions.

Usage: s3_kill.py [--bin PATH] [--cases N] [--kills K] [--concurrency C] [--seed S]

A one-template suite of N cases (default 20,000) is called into `s3://chaos/<run>` on moto's
S3 server, against `evalflow mock-server` at 50 ms with 4% rate limits, 4% 5xx and 2%
malformed answers; K sessions (default 5) are SIGKILLed at random times 1-4 s in, then one
session runs to the end. From the mock's request log: answered requests (no fault), distinct
(request hash, sample), paid twice = answered - distinct, against the bound kills x
concurrency. Run once with the response cache off and once at its default (the state
folder's `responses/`). Needs `moto[server]`; use the release binary.
"""

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    sys.exit(f"nothing listens on {port}")


def pipeline(d: Path, base_url: str, cases: int, concurrency: int) -> Path:
    items = ", ".join(f'"{i}"' for i in range(cases))
    p = d / "chaos.toml"
    p.write_text(
        f"""[model]
provider = "openai"
base_url = "{base_url}"
name = "mock-model"
max_tokens = 16
concurrency = {concurrency}

[suite]
name = "chaos"
seed = 1
max_cases_per_test = {cases}

[lexicons]
n = [{items}]

[[test]]
name = "items"
capability = "Vocabulary"
type = "MFT"
templates = ["Item {{n}} is fine."]
expected = "positive|negative|neutral"
"""
    )
    return p


def one(binary, cache: bool, a, tmp: Path, s3_env: dict, bucket_url: str):
    log = tmp / f"requests-{cache}.jsonl"
    port = free_port()
    mock = subprocess.Popen(
        [binary, "mock-server", "--addr", f"127.0.0.1:{port}", "--latency-ms", "50",
         "--fault", "rate_limit=0.04", "--fault", "server_error=0.04", "--fault", "malformed_json=0.02",
         "--seed", str(a.seed), "--request-log", str(log)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wait_port(port)
    state = tmp / f"state-{cache}"
    env = {**os.environ, **s3_env, "EVALFLOW_STATE_DIR": str(state)}
    if cache:
        env.pop("EVALFLOW_CACHE_DIR", None)
    else:
        env["EVALFLOW_CACHE_DIR"] = "off"
    p = pipeline(tmp, f"http://127.0.0.1:{port}/v1", a.cases, a.concurrency)
    root = f"{bucket_url}/cache-{cache}"
    subprocess.run([binary, "generate", str(p), "--out", root], env=env, check=True, stdout=subprocess.DEVNULL)
    rng = random.Random(a.seed + int(cache))
    for _ in range(a.kills):
        child = subprocess.Popen([binary, "call", str(p), "--out", root], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(1.0, 4.0))
        child.send_signal(signal.SIGKILL)
        child.wait()
    t = time.time()
    subprocess.run([binary, "call", str(p), "--out", root], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    final_s = time.time() - t
    mock.terminate()
    mock.wait()
    answered, keys = 0, set()
    for line in log.read_text().splitlines():
        r = json.loads(line)
        if r.get("fault") is None:
            answered += 1
            keys.add((r["request_hash"], r["sample_idx"]))
    out = subprocess.run(
        [binary, "sql", "SELECT count(*) AS n, count(DISTINCT call_id) AS d FROM calls", "--run", root, "--format", "json"],
        env=env, check=True, capture_output=True, text=True,
    ).stdout
    rows = json.loads(out)[0]
    return answered, len(keys), answered - len(keys), rows, final_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(REPO / "target/release/evalflow"))
    ap.add_argument("--cases", type=int, default=20000)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=42)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="evalflow-chaos-"))
    port = free_port()
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        endpoint = f"http://127.0.0.1:{port}"
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/chaos", method="PUT")).read()
        s3_env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                  "AWS_ENDPOINT": endpoint, "AWS_ALLOW_HTTP": "true"}
        print(f"| root | answered requests the mock served | distinct | paid twice | bound (kills x concurrency) | calls rows / distinct |")
        print("|---|---|---|---|---|---|")
        for cache in (False, True):
            answered, distinct, twice, rows, _ = one(a.bin, cache, a, tmp, s3_env, "s3://chaos/runs")
            label = "`s3://`, cache at its default" if cache else "`s3://`, cache off"
            print(f"| {label} | {answered:,} | {distinct:,} | {twice:,} | {a.kills * a.concurrency} | {rows['n']:,} / {rows['d']:,} |")
    finally:
        moto.terminate()
        moto.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
