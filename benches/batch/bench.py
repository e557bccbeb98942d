#!/usr/bin/env python3
"""The batch bench: N requests through the batch path against the mock's Batch API.

Usage: python3 benches/batch/bench.py [--sizes 20000,200000] [--bin /work/rel-target/release/evalflow]
       [--work /tmp/evalflow-batch] [--batch-secs 2] [--provider openai|anthropic]

For each size N: a suite of N cases (one sample each) is generated, then `evalflow call --batch`
sends them as batches of at most 50,000 requests (Anthropic's Message Batches: 100,000) to `evalflow mock-server --batch-secs S`
(each batch is final S seconds after its creation). Prints, per size, the call's wall time,
CPU time and peak RSS, and the mock's own serving time: from the first batch's creation to
the last batch's end, read from the mock's request log (`batch_final` lines). Ratios: peak RSS
at the largest size over the smallest (flat memory: near 1), and the call's wall time over the
mock's serving time (the target: at most 1.5).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def timed(cmd):
    """Runs cmd under GNU time; returns (wall s, cpu s, peak RSS bytes, stdout, stderr)."""
    t = time.time()
    p = subprocess.run(["/usr/bin/time", "-f", "__time %e %U %S %M"] + cmd,
                       capture_output=True, text=True)
    wall = time.time() - t
    line = [l for l in p.stderr.splitlines() if l.startswith("__time")]
    if p.returncode != 0 or not line:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
    _, e, u, s, m = line[-1].split()
    return wall, float(u) + float(s), int(m) * 1024, p.stdout, p.stderr


def pipeline(path, base_url, n, provider="openai"):
    items = n // 5
    lex = ", ".join(f'"{i}"' for i in range(items))
    with open(path, "w") as f:
        f.write(f"""[model]
provider = "{provider}"
base_url = "{base_url}"
name = "mock-model"
max_tokens = 16
temperature = 0.0
batch = true

[suite]
name = "batchbench"
seed = 1
max_cases_per_test = 100000000

[lexicons]
n = [{lex}]
adj = ["good", "bad", "fine", "awful", "great"]

[[test]]
name = "items"
capability = "Vocabulary"
type = "MFT"
templates = ["Item {{n}} is {{adj}}."]
expected = "positive|negative|neutral"
""")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="20000,200000")
    ap.add_argument("--bin", default="/work/rel-target/release/evalflow")
    ap.add_argument("--work", default="/tmp/evalflow-batch")
    ap.add_argument("--batch-secs", default="2")
    ap.add_argument("--provider", default="openai", choices=["openai", "anthropic"])
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    results = []
    for n in [int(s) for s in a.sizes.split(",")]:
        log = os.path.join(a.work, f"mock-{n}.jsonl")
        mock = subprocess.Popen([a.bin, "mock-server", "--addr", "127.0.0.1:0", "--answer", "vader",
                                 "--batch-secs", a.batch_secs, "--request-log", log],
                                stdout=subprocess.PIPE, text=True)
        try:
            first = mock.stdout.readline().strip()
            base = first.split("listening on ")[1] + "/v1"
            p = os.path.join(a.work, f"p{n}.toml")
            pipeline(p, base, n, a.provider)
            root = os.path.join(a.work, f"run-{n}")
            subprocess.run([a.bin, "generate", p, "--out", root], check=True,
                           capture_output=True)
            wall, cpu, rss, out, err = timed([a.bin, "call", p, "--out", root, "--batch"])
        finally:
            mock.terminate()
            mock.wait()
        created, final, lines, batches = [], [], 0, 0
        with open(log) as f:
            for line in f:
                v = json.loads(line)
                if v.get("path") == "batch_final":
                    created.append(v["created"])
                    final.append(v["final"])
                    lines += v["lines"]
                    batches += 1
        serve = max(final) - min(created)
        rows = out.strip().splitlines()[-1] if out.strip() else ""
        print(f"n={n}: {batches} batches, {lines} lines; call wall {wall:.2f} s, cpu {cpu:.2f} s, "
              f"peak RSS {rss / 2**20:.1f} MiB; mock serving {serve:.2f} s; "
              f"wall / serving {wall / serve:.2f}\n  {rows}")
        if lines != n:
            sys.exit(f"expected {n} lines in the mock's batches, saw {lines}")
        results.append((n, wall, rss, serve))
    if len(results) > 1:
        (n0, _, r0, _), (n1, w1, r1, s1) = results[0], results[-1]
        print(f"peak RSS {n1} / {n0}: {r1 / r0:.2f}")
        print(f"wall / mock serving at {n1}: {w1 / s1:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
