#!/usr/bin/env python3
"""The viewer bench: `evalflow view` over a large run, whole process, as a browser would ask.

Usage: python3 benches/view/bench.py [--sizes 1000000,10000000] [--bin target/release/evalflow]
       [--work /tmp/evalflow-view] [--reps 20] [--shape indexed]

For each size N it builds a run from the corpus bench's recorded pairs (benches/corpus/
gen_corpus.py, cached in --work): `import`, `validate`, `score` (checklist), then two versions
of a user scorer (`rescore --scorer-file`, mode normalised then exact) so the scorer-diff view
has two versions of one scorer. Then it starts `evalflow view WORK/runs --addr 127.0.0.1:0`
and times, over loopback, each request the page makes (wall time of the whole request; the
first of each kind is reported apart as `cold`, the rest as p50/p95):

  runs index           GET /api/runs until the headline is ready (startup: first answer)
  run page             GET /api/runs/{id} + /results
  answers page         GET /answers?limit=50, then 20 pages deep by `next`
  filtered page        GET /answers?test=T&passed=false, and ?validity=..., ?model=...
  one answer           GET /answers/{call_id} for call ids from the pages
  scorer diff          GET /scorer-diff?a=&b= (the full disagreement count and a page)
  text search          GET /answers?q=WORD (first hits) and q=a string that is nowhere (full scan)
  SQL box              POST /sql, a GROUP BY over scores

It samples the server's RSS (VmHWM, its peak) and prints the page weight (gzipped JS + CSS).
Build the binary first: `cargo build --release`.
"""
import argparse
import gzip
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))

SCORER = """[[scorer]]
name = "label_match"
description = "The answer equals an expected label ({mode})."
kind = "match"
metric = "pass_fail"
mode = "{mode}"
"""


def sh(cmd, **kw):
    t = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, **kw)
    return time.time() - t


def build_run(a, n):
    corpus = os.path.join(a.work, f"corpus-{a.shape}-{n}.jsonl")
    if not os.path.exists(corpus):
        print(f"generating {n} records ...", flush=True)
        sh([sys.executable, os.path.join(REPO, "benches", "corpus", "gen_corpus.py"), str(n),
            corpus, "--shape", a.shape])
    root = os.path.join(a.work, "runs", f"run-{n}")
    scores = os.path.join(root, "scores")
    if os.path.exists(os.path.join(root, "results")) or (
            os.path.isdir(scores) and any(d.startswith("checklist@") for d in os.listdir(scores))):
        return root
    os.makedirs(os.path.dirname(root), exist_ok=True)
    pipe = os.path.join(root, "import.toml")
    for name, cmd in [("import", [a.bin, "import", corpus, "--out", root]),
                      ("validate", [a.bin, "validate", pipe, "--out", root]),
                      ("score", [a.bin, "score", pipe, "--out", root])]:
        print(f"  {name}: {sh(cmd):.1f} s", flush=True)
    for mode in ["normalised", "exact"]:
        f = os.path.join(a.work, f"label_match-{mode}.toml")
        with open(f, "w") as fh:
            fh.write(SCORER.format(mode=mode))
        print(f"  rescore {mode}: {sh([a.bin, 'rescore', root, '--scorer-file', f]):.1f} s",
              flush=True)
    return root


class Server:
    def __init__(self, a, root):
        self.p = subprocess.Popen([a.bin, "view", root, "--addr", "127.0.0.1:0"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.t0 = time.time()
        line = self.p.stdout.readline()
        assert line.startswith("listening on "), line
        self.base = line.split("listening on ", 1)[1].strip()
        self.listening = time.time() - self.t0

    def get(self, path, data=None):
        req = urllib.request.Request(self.base + path, data=data,
                                     headers={"Content-Type": "application/json"} if data else {})
        t = time.time()
        with urllib.request.urlopen(req, timeout=600) as r:
            body = r.read()
        return time.time() - t, json.loads(body) if body[:1] in (b"{", b"[") else body

    def rss_peak_mb(self):
        with open(f"/proc/{self.p.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self):
        self.p.terminate()
        self.p.wait()


def summary(times):
    if not times:
        return "-"
    cold, warm = times[0], sorted(times[1:]) or [times[0]]
    p95 = warm[min(len(warm) - 1, int(round(0.95 * (len(warm) - 1))))]
    return f"cold {cold*1e3:7.0f} ms | p50 {statistics.median(warm)*1e3:6.0f} ms | p95 {p95*1e3:6.0f} ms"


def bench(a, n, root):
    s = Server(a, root)
    out = {}
    try:
        run_id = os.path.basename(root)
        # Runs index: the first answer, then until the background headline is there.
        t, runs = s.get("/api/runs")
        out["runs index (first answer)"] = [t]
        t0 = time.time()
        while runs[0].get("headline_pending"):
            time.sleep(0.2)
            _, runs = s.get("/api/runs")
        out["headline ready after"] = [time.time() - t0]
        out["runs index"] = [s.get("/api/runs")[0] for _ in range(a.reps)]
        detail = []
        for _ in range(max(3, a.reps // 4)):
            t1, d = s.get(f"/api/runs/{run_id}")
            t2, _ = s.get(f"/api/runs/{run_id}/results")
            detail.append(t1 + t2)
        out["run page (detail + results)"] = detail
        # Pages, 20 deep.
        pages, ids, after = [], [], None
        for _ in range(a.reps):
            q = "limit=50" + (f"&after={urllib.parse.quote(after)}" if after else "")
            t, page = s.get(f"/api/runs/{run_id}/answers?{q}")
            pages.append(t)
            ids += [r["call_id"] for r in page["rows"]]
            after = page["next"]
            if not after:
                break
        out["answers page (50 rows, 20 deep)"] = pages
        tests = d.get("tests") or []
        filt = []
        for i in range(a.reps):
            f = [f"test={urllib.parse.quote(random.Random(i).choice(tests))}&passed=false"
                 if tests else "passed=false",
                 "validity=empty_due_to_budget", "model=" + urllib.parse.quote(
                     (d.get("models") or ["x"])[i % max(1, len(d.get("models") or []))])][i % 3]
            filt.append(s.get(f"/api/runs/{run_id}/answers?limit=50&{f}")[0])
        out["filtered page"] = filt
        rnd = random.Random(7)
        out["one answer"] = [s.get(f"/api/runs/{run_id}/answers/{rnd.choice(ids)}")[0]
                             for _ in range(a.reps)]
        _, scorers = s.get(f"/api/runs/{run_id}/scorers")
        tags = [x["tag"] for x in scorers if x["scorer"] == "label_match"]
        if len(tags) == 2:
            diff = [s.get(f"/api/runs/{run_id}/scorer-diff?a={urllib.parse.quote(tags[0])}"
                          f"&b={urllib.parse.quote(tags[1])}")[0] for _ in range(3)]
            out["scorer diff (count + page)"] = diff
        out["text search, first hits"] = [s.get(f"/api/runs/{run_id}/answers?limit=50&q=waiter")[0]
                                          for _ in range(3)]
        out["text search, full scan"] = [s.get(
            f"/api/runs/{run_id}/answers?limit=50&q=zzqqxnowhere")[0] for _ in range(2)]
        body = json.dumps({"sql": "SELECT model, validity, count(*) AS n, avg(score) AS s FROM "
                                  "scores GROUP BY model, validity"}).encode()
        out["SQL box (GROUP BY over scores)"] = [s.get(f"/api/runs/{run_id}/sql", body)[0]
                                                 for _ in range(3)]
        rss = s.rss_peak_mb()
    finally:
        s.stop()
    return s.listening, out, rss


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1000000")
    p.add_argument("--bin", default=os.path.join(REPO, "target", "release", "evalflow"))
    p.add_argument("--work", default="/tmp/evalflow-view")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--shape", default="indexed")
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    assets = os.path.join(REPO, "src", "view", "assets")
    weight = sum(len(gzip.compress(open(os.path.join(assets, f), "rb").read(), 9))
                 for f in ["app.js", "app.css", "index.html"])
    print(f"page weight: {weight / 1024:.1f} KiB gzipped (JS + CSS + HTML), no wasm")
    for n in [int(x) for x in a.sizes.split(",")]:
        root = build_run(a, n)
        listening, out, rss = bench(a, n, root)
        print(f"\n{n:,} answers ({a.shape}); listening after {listening*1e3:.0f} ms; "
              f"server peak RSS {rss:.0f} MiB")
        for k, v in out.items():
            print(f"  {k:34s} {summary(v)}")


if __name__ == "__main__":
    main()
