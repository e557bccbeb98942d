#!/usr/bin/env python3
"""Import speed per format (rows/s) and peak RSS, beside Inspect's own reader.

Scales each fixture under tests/fixtures/import/ up to N rows by repeating its records with
fresh ids (an Inspect log through Inspect's own `read_eval_log` / `write_eval_log`, so the
`.eval` is one Inspect wrote), then times `evalflow import` on each (peak RSS from
`/usr/bin/time -v`) and Inspect's `read_eval_log` on the same `.eval` log.

Usage: python3 scripts/import_bench.py [N]   (default 3000; PYTHON must have inspect-ai)
    EVALFLOW   the evalflow binary (default: target/debug/evalflow)
"""

import copy
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "import")


def scale_jsonl(src, dst, n, key):
    lines = [json.loads(l) for l in open(src) if l.strip()]
    with open(dst, "w") as f:
        for i in range(n):
            l = copy.deepcopy(lines[i % len(lines)])
            key(l, i)
            f.write(json.dumps(l) + "\n")


def lm_key(l, i):
    l["doc_id"] = i
    # A distinct prompt per row, so every row is its own case.
    ctx = l["arguments"]["gen_args_0"]["arg_0"]
    ctx[0] = ctx[0].replace('"}]', f' #{i}"}}]')


def batch_key(l, i):
    l["custom_id"] = f"r{i}"


def batch_in_key(l, i):
    l["custom_id"] = f"r{i}"
    l["body"]["messages"][-1]["content"] += f" #{i}"


def measure(cmd):
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True)
    secs = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"{cmd}: {r.stdout}{r.stderr}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    return secs, rss / 1024


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    evalflow = os.environ.get("EVALFLOW", os.path.join(ROOT, "target", "debug", "evalflow"))
    python = os.environ.get("PYTHON", sys.executable)
    work = tempfile.mkdtemp(prefix="import-bench-")
    files = {}
    # Inspect: the fixture log's samples repeated with new ids, written by Inspect itself.
    big_eval = os.path.join(work, "big.eval")
    subprocess.run([python, "-c", f"""
import copy
from inspect_ai.log import read_eval_log, write_eval_log
log = read_eval_log({os.path.join(FIX, 'inspect', 'sentiment.eval')!r})
base = log.samples
out = []
for i in range({n}):
    s = copy.deepcopy(base[i % len(base)])
    s.id = f"{{s.id}}-{{i}}"
    out.append(s)
log.samples = out
write_eval_log(log, {big_eval!r})
"""], check=True)
    files["inspect (.eval)"] = [big_eval, "--cluster", "template"]
    lm_dir = os.path.join(work, "lm")
    os.makedirs(lm_dir)
    for f in os.listdir(os.path.join(FIX, "lm-eval")):
        src = os.path.join(FIX, "lm-eval", f)
        if f.startswith("samples_"):
            scale_jsonl(src, os.path.join(lm_dir, f), n, lm_key)
        elif f.startswith("results_"):
            open(os.path.join(lm_dir, f), "w").write(open(src).read())
    files["lm-eval"] = [lm_dir]
    bo, bi = os.path.join(work, "batch_output.jsonl"), os.path.join(work, "batch_input.jsonl")
    scale_jsonl(os.path.join(FIX, "openai-batch", "batch_output.jsonl"), bo, n, batch_key)
    scale_jsonl(os.path.join(FIX, "openai-batch", "batch_input.jsonl"), bi, n, batch_in_key)
    files["openai-batch"] = [bo, "--batch-input", bi]
    pf = json.load(open(os.path.join(FIX, "promptfoo", "results.json")))
    rs = pf["results"]["results"]
    big = []
    for i in range(n):
        r = copy.deepcopy(rs[i % len(rs)])
        r["id"] = f"r{i}"
        r["prompt"]["raw"] = r["prompt"]["raw"].replace('"}]', f' #{i}"}}]')
        big.append(r)
    pf["results"]["results"] = big
    pfile = os.path.join(work, "results.json")
    json.dump(pf, open(pfile, "w"))
    files["promptfoo"] = [pfile, "--cluster", "template"]

    print(f"{n} rows per format; evalflow = {evalflow}")
    print(f"{'format':<16} {'seconds':>8} {'rows/s':>9} {'peak RSS MiB':>13}")
    for name, args in files.items():
        out = os.path.join(work, "run-" + re.sub(r"\W", "", name))
        secs, rss = measure([evalflow, "import", *args, "--out", out])
        print(f"{name:<16} {secs:8.2f} {n / secs:9.0f} {rss:13.1f}")
    # Inspect's own reader on the same log.
    r = subprocess.run([python, "-c", f"""
import time, resource
t = time.perf_counter()
from inspect_ai.log import read_eval_log
t0 = time.perf_counter()
log = read_eval_log({big_eval!r})
t1 = time.perf_counter()
print(t1 - t0, len(log.samples), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""], capture_output=True, text=True, check=True)
    secs, k, rss = r.stdout.split()
    secs, k, rss = float(secs), int(k), float(rss)
    print(f"{'inspect read_eval_log':<22} {secs:.2f} s, {k / secs:.0f} samples/s, peak RSS {rss:.1f} MiB (import of inspect_ai itself included)")
    print(f"work dir {work}")


if __name__ == "__main__":
    main()
