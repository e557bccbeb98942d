#!/usr/bin/env python3
"""The corpus bench: a recorded corpus through every stage, against DuckDB, in one run.

Usage: python3 benches/corpus/bench.py [--sizes 1000000,10000000] [--bin target/release/evalflow]
       [--work /tmp/evalflow-corpus] [--memory-limit 1GiB] [--threads 2]
       [--shapes indexed,repeated,plain] [--stages import,validate,score,aggregate,rescore]

For each size N it generates N OpenAI request/response pairs (gen_corpus.py, cached in
--work), then times `evalflow import`, `validate`, `score` (checklist), `aggregate` and
`rescore --scorer cue` (a new cue version) on it, and DuckDB (Python package, 2 threads)
converting the same JSONL to Parquet. Prints rows/s, peak RSS and cpu/wall per stage, and
import's ratio to DuckDB. Build the binary first: `cargo build --release`. `--shapes` picks the
corpora: `indexed` (records carry `sample_idx` and response ids) and `repeated` (neither, each
request 50 times, shuffled: gen_corpus.py's docstring) and `plain` (the indexed corpus without
sample indices or ids: few repeats, none numbered).

Both conversions start with the JSONL in the page cache (it is read once, untimed, just
before each): at 10M the file is 7.5 GB, a cold read of it costs about 15 s on this machine's
disk, and whichever tool ran first used to pay it alone.
"""
import argparse
import os
import resource
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

DUCKDB = r"""
import sys, time, duckdb, resource
src, dst = sys.argv[1], sys.argv[2]
t = time.time()
con = duckdb.connect()
con.execute("SET threads TO 2")
con.execute(f'''COPY (SELECT request.messages[1].content AS input,
    response.choices[1].message.content AS response,
    response.choices[1].finish_reason AS finish_reason,
    response.usage.prompt_tokens AS prompt_tokens,
    response.usage.completion_tokens AS completion_tokens
  FROM read_json('{src}', format='newline_delimited', maximum_object_size=100000000))
  TO '{dst}' (FORMAT parquet)''')
print(time.time() - t)
"""

def new_cues():
    """The built-in cue lists with one more rejecting cue: a new cue version to rescore with."""
    with open(os.path.join(HERE, "..", "..", "src", "stages", "score", "cues.toml")) as f:
        text = f.read()
    return text.replace("reject = [", 'reject = ["stale", ', 1)


def warm(path):
    """Reads `path` once, so the timed tool finds it in the page cache."""
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


def timed(cmd, env=None):
    """Runs cmd under GNU time; returns (wall s, cpu s, peak RSS bytes, stdout)."""
    t = time.time()
    p = subprocess.run(
        ["/usr/bin/time", "-f", "__time %e %U %S %M"] + cmd,
        capture_output=True, text=True, env=env)
    wall = time.time() - t
    line = [l for l in p.stderr.splitlines() if l.startswith("__time")]
    if p.returncode != 0 or not line:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
    _, e, u, s, m = line[-1].split()
    return float(e), float(u) + float(s), int(m) * 1024, p.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000000,10000000")
    ap.add_argument("--bin", default="target/release/evalflow")
    ap.add_argument("--work", default="/tmp/evalflow-corpus")
    ap.add_argument("--memory-limit", default="1GiB")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--shapes", default="indexed,repeated,plain")
    ap.add_argument("--stages", default="import,validate,score,aggregate,rescore",
                    help="the stages to time (import always runs)")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    ev = os.path.abspath(a.bin)
    flags = ["--memory-limit", a.memory_limit, "--threads", a.threads]
    rows = []
    runs = [(int(x), shape) for x in a.sizes.split(",") for shape in a.shapes.split(",")]
    for n, shape in runs:
        tag = "" if shape == "indexed" else f"-{shape}"
        src = os.path.join(a.work, f"corpus-{n}{tag}.jsonl")
        if not os.path.exists(src):
            print(f"generating {src} ...", file=sys.stderr)
            subprocess.run([sys.executable, os.path.join(HERE, "gen_corpus.py"), str(n), src + ".tmp",
                            "--shape", shape], check=True)
            os.rename(src + ".tmp", src)
        mb = os.path.getsize(src) / 1e6
        root = os.path.join(a.work, f"run-{n}{tag}")
        shutil.rmtree(root, ignore_errors=True)
        cues = os.path.join(a.work, "cues-v2.toml")
        with open(cues, "w") as f:
            f.write(new_cues())
        pipe = os.path.join(root, "import.toml")
        stages = [
            ("import", [ev, "import", src, "--out", root] + flags),
            ("validate", [ev, "validate", pipe, "--out", root] + flags),
            ("score", [ev, "score", pipe, "--out", root] + flags),
            ("aggregate", [ev, "aggregate", pipe, "--out", root] + flags),
            ("rescore", [ev, "rescore", root, "--scorer", "cue", "--cues", cues] + flags),
        ]
        results = {}
        wanted = set(a.stages.split(",")) | {"import"}
        for name, cmd in [(n_, c) for n_, c in stages if n_ in wanted]:
            print(f"N={n}: {name} ...", file=sys.stderr)
            if name == "import":
                warm(src)
            results[name] = timed(cmd)
            wall, cpu, rss, _ = results[name]
            print(f"N={n}: {name}: {wall:.1f} s, {n / wall:,.0f} rows/s, "
                  f"{rss / 2**20:,.0f} MiB, cpu/wall {cpu / wall:.2f}", file=sys.stderr)
        dst = os.path.join(a.work, f"duck-{n}{tag}.parquet")
        warm(src)
        wall, cpu, rss, out = timed([sys.executable, "-c", DUCKDB, src, dst])
        results["duckdb (JSONL->Parquet)"] = (wall, cpu, rss, out)
        for name, (wall, cpu, rss, _) in results.items():
            rows.append((n, shape, name, wall, n / wall, rss / 2**20, cpu / wall))
        ratio = (n / results["import"][0]) / (n / results["duckdb (JSONL->Parquet)"][0])
        rows.append((n, shape, "import / duckdb rate", None, ratio, None, None))
        print(f"N={n}: {mb:.0f} MB of JSONL", file=sys.stderr)
    print("| N | shape | step | wall s | rows/s | peak RSS MiB | cpu/wall |")
    print("|---|---|---|---|---|---|---|")
    for n, shape, name, wall, rate, rss, cw in rows:
        if wall is None:
            print(f"| {n:,} | {shape} | {name} | | {rate:.2f}x | | |")
        else:
            print(f"| {n:,} | {shape} | {name} | {wall:.1f} | {rate:,.0f} | {rss:,.0f} | {cw:.2f} |")


if __name__ == "__main__":
    main()
