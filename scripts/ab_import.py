#!/usr/bin/env python3
"""A/B of `evalflow import` between binaries, alternating them run by run.

Usage: python3 scripts/ab_import.py BIN_A,BIN_B [SHAPES] [REPS]
  SHAPES: comma-separated of indexed,repeated,plain (default these three), and the same
  with `-10m` (10M records); REPS: runs per binary and shape (default 5). Reads the corpora
  of benches/corpus/gen_corpus.py in /tmp/evalflow-corpus (`benches/corpus/bench.py` writes
  them).

The machine's speed drifts by a quarter within the hour, so two binaries timed one after the
other compare the hour, not the code: each repetition runs both, in alternating order, and
the medians of wall and CPU (user + system) time are compared. Copy each binary out of
`target/` first (a build overwrites it).
"""
import os
import shutil
import statistics
import subprocess
import sys

FILES = {
    "indexed": "corpus-1000000.jsonl",
    "repeated": "corpus-1000000-repeated.jsonl",
    "plain": "corpus-1000000-plain.jsonl",
    "indexed-10m": "corpus-10000000.jsonl",
    "repeated-10m": "corpus-10000000-repeated.jsonl",
    "plain-10m": "corpus-10000000-plain.jsonl",
}


def main():
    bins = sys.argv[1].split(",")
    shapes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["indexed", "repeated", "plain"]
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    res = {}
    for shape in shapes:
        src = os.path.join("/tmp/evalflow-corpus", FILES[shape])
        for r in range(reps):
            for b in bins if r % 2 == 0 else bins[::-1]:
                out = "/tmp/ab-import-out"
                shutil.rmtree(out, ignore_errors=True)
                p = subprocess.run(
                    ["/usr/bin/time", "-f", "%e %U %S %M", b, "import", src, "--out", out,
                     "--memory-limit", "1GiB", "--threads", "2"],
                    capture_output=True, text=True)
                if p.returncode:
                    sys.exit(p.stderr[-2000:])
                wall, user, sys_, rss = p.stderr.strip().splitlines()[-1].split()
                res.setdefault((shape, b), []).append((float(wall), float(user) + float(sys_), int(rss)))
    for shape in shapes:
        for b in bins:
            xs = res[(shape, b)]
            print(f"{shape:9s} {os.path.basename(b):16s} wall med {statistics.median(x[0] for x in xs):.2f} "
                  f"[{' '.join(f'{x[0]:.2f}' for x in xs)}]  cpu med {statistics.median(x[1] for x in xs):.2f}  "
                  f"peak RSS max {max(x[2] for x in xs) // 1024} MiB")


if __name__ == "__main__":
    main()
