#!/usr/bin/env python3
"""The soak of issue 60 (item 5): a whole pipeline, SIGKILLed K times across its five stages
against a faulty model, must end with the tables of an uninterrupted run, each call paid once
but for those in flight at a kill.

Usage: soak.py [--calls N] [--kills K] [--seed S] [--roots local,s3] [--bin PATH]
               [--concurrency C] [--store-fault-rate R] [--keep]

What it does, per root (`local`: a directory; `s3`: `s3://soak/<run>` on moto's S3 server
behind tests/fault_proxy.py at --store-fault-rate, default 2%: 503 SlowDown, 500, resets,
0.5 s delays, answers lost after commit):

1. The pipeline: the one-template suite of benches/chaos/s3_kill.py with N cases (default
   1,000,000), `concurrency = C` (default 256) in `[model]`, against `evalflow mock-server
   --latency-ms 5 --answer vader` with 10% faults: 4% 429 (Retry-After 1 s), 3% 5xx, 1%
   malformed bodies, 1% connection resets, 1% hung requests. The response cache is off
   (EVALFLOW_CACHE_DIR=off) and every root has its own state folder, so no run reads
   another's answers.
2. The reference: one uninterrupted `evalflow run` on a fresh local root, with its own mock
   (same seed). Its manifest gives each stage's duration.
3. The soak: `evalflow run PIPELINE --out ROOT` started K + 1 times; the first K sessions are
   SIGKILLed. The kills are spread over the stages: each stage gets max(1, K // 10) kills and
   the rest go to the stages in proportion to their reference durations. A kill aimed at a
   stage waits (polling the root's manifest) until that stage is the first unfinished one,
   then a random delay, uniform in [0, max(0.05 s, d * min(1, 1.5 / n))] for a stage of
   reference duration d aimed at by n kills, then SIGKILL; when the aimed-at stage (or a later one) is already
   the first unfinished one at the spawn, the delay runs from the spawn, so it includes the
   session's start (lease, manifest, journal) and the stages `run` re-enters on every
   session (call, validate and score pick up what is left, finding nothing to do). The
   stage each kill really hit (the first unfinished stage in the manifest right after it)
   is printed. A session that ends by itself before its kill ends the kills when it exits
   0 (the run is complete); one that fails on its own (non-zero exit) is recorded with its
   last stderr line, and its kill goes to the next session. The last session runs to the end.
4. Checks: `evalflow verify ROOT` (exit 0 expected); per table, rows, duplicated ids
   (0 expected) and equality with the reference as sets of rows keyed by id (cases by
   case_id; calls by call_id; validity by call_id; scores by call_id, scorer and version;
   results by their group columns, floats to 9 decimals). Calls are compared without
   `latency_ms` and `started_at` (timing) and `attempts` (a request in flight at a kill, a
   hung request or a retried fault adds attempts: the mock draws a fault from its per-request
   attempt counter, so the killed run meets other faults than the reference). A call whose
   outcome depends on those draws (an error row, the retry budget exhausted, in either run)
   may legitimately differ, and so may its verdict and scores: such differences are counted
   apart as "explained"; any other difference is a bug.
5. From the soak mock's request log: answered requests (no fault) against distinct
   (request hash, sample index) answered: re-paid = answered - distinct, against the bound
   kills x concurrency. The reference's own re-paid figure (answers abandoned by the adaptive
   deadline, when the machine is slow) is printed as the baseline.

Output: a line per session while it runs, then one summary table per root: kills delivered
(and the stages they hit), wall time of the reference and of the soak (all sessions), calls,
sessions that failed on their own (0 expected), duplicated rows per table (0 expected), tables
equal to the reference (yes/no, with the count of differing rows: unexplained, explained),
error rows in `calls`, re-paid answers and the bound, verify's exit code and, on the s3 root,
the store faults the proxy injected. Exit 1 when a session failed on its own, a table has
duplicated rows or an unexplained difference, re-paid answers pass the bound (plus the
reference's own), or verify or the last session fails. --keep keeps the work folder: the
roots, each session's stderr (`<root>-session-NN.stderr`) and the mock's request logs.

Needs moto[server] (`python3 -m moto.server`); use the release binary.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chaos"))
from s3_kill import REPO, free_port, pipeline, wait_port  # noqa: E402

STAGES = ["generate", "call", "validate", "score", "aggregate"]
FAULTS = ["rate_limit=0.04", "server_error=0.03", "malformed_json=0.01", "reset=0.01", "hang=0.01"]
SCHEMAS = REPO / "schemas"
# id columns of each table, and the columns left out of the comparison
KEYS = {
    "cases": ["case_id"],
    "calls": ["call_id"],
    "validity": ["call_id"],
    "scores": ["call_id", "scorer", "scoring_version"],
    "results": ["level", "capability", "test_type", "test", "model", "scorer", "scoring_version",
                "metric", "label"],
}
EXCLUDED = {"calls": ["latency_ms", "started_at", "attempts"]}


def log(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------------------- processes


def start_mock(binary, port, reqlog, seed):
    args = [binary, "mock-server", "--addr", f"127.0.0.1:{port}", "--latency-ms", "5",
            "--answer", "vader", "--seed", str(seed), "--request-log", str(reqlog)]
    for f in FAULTS:
        args += ["--fault", f]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return p


def stop(p):
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Root:
    """A run root and how to reach it: its URL, env, and cheap reads of its manifest."""

    def __init__(self, kind, url, env, moto=None):
        self.kind, self.url, self.env, self.s3 = kind, url, env, None
        if moto:  # the manifest is read straight from moto, not through the fault proxy
            import boto3

            self.s3 = boto3.client("s3", endpoint_url=moto, aws_access_key_id="t",
                                   aws_secret_access_key="t", region_name="us-east-1")
            self.bucket, _, prefix = url.removeprefix("s3://").partition("/")
            self.key = f"{prefix}/manifest.json"

    def signature(self):
        """Changes whenever the manifest is rewritten (every stage's start saves it)."""
        try:
            if self.s3:
                return self.s3.head_object(Bucket=self.bucket, Key=self.key)["ETag"]
            st = (Path(self.url) / "manifest.json").stat()
            return (st.st_mtime_ns, st.st_ino, st.st_size)
        except Exception:
            return None

    def manifest(self):
        try:
            if self.s3:
                raw = self.s3.get_object(Bucket=self.bucket, Key=self.key)["Body"].read().decode()
            else:
                raw = (Path(self.url) / "manifest.json").read_text()
        except Exception:  # absent, or being replaced
            return None
        # only `stages` is needed: skip the pipeline (its lexicon holds every case's item)
        i = raw.rfind('"stages"')
        try:
            if i < 0:
                return json.loads(raw)
            j = raw.index(":", i) + 1
            while raw[j].isspace():
                j += 1
            stages, _ = json.JSONDecoder().raw_decode(raw, j)
            return {"stages": stages}
        except ValueError:
            return None


def stage_done(m, stage):
    if not m:
        return False
    recs = [r for k, r in m.get("stages", {}).items() if k == stage or k.startswith(stage + ":")]
    return bool(recs) and all(r.get("status") == "complete" for r in recs)


def current_stage(m):
    """Index of the first stage not complete (len(STAGES) when all are)."""
    for i, s in enumerate(STAGES):
        if not stage_done(m, s):
            return i
    return len(STAGES)


def stage_durations(m):
    from datetime import datetime

    def ts(s):
        return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()

    out = {}
    for s in STAGES:
        recs = [r for k, r in m["stages"].items() if k == s] or \
            [r for k, r in m["stages"].items() if k.startswith(s + ":")]
        out[s] = sum(ts(r["finished_at"]) - ts(r["started_at"]) for r in recs)
    return out


def run_cmd(binary, args, env, **kw):
    return subprocess.run([binary, *args], env=env, capture_output=True, text=True, **kw)


# ---------------------------------------------------------------------------- the runs


def plan_kills(k, durations, rng):
    """Kills per stage: max(1, k // 10) each, the rest by reference duration (largest remainder)."""
    if k == 0:
        return []
    base = max(1, k // 10) if k >= len(STAGES) else 0
    n = {s: base for s in STAGES}
    rest = k - base * len(STAGES)
    total = sum(durations.values()) or 1.0
    shares = {s: rest * durations[s] / total for s in STAGES}
    for s in STAGES:
        n[s] += int(shares[s])
    left = k - sum(n.values())
    for s in sorted(STAGES, key=lambda s: shares[s] - int(shares[s]), reverse=True)[:left]:
        n[s] += 1
    return [(s, n[s]) for s in STAGES for _ in range(n[s])]


def soak(a, binary, p, root: Root, durations, rng, outdir: Path):
    plan = plan_kills(a.kills, durations, rng)
    counts = {s: sum(1 for t, _ in plan if t == s) for s in STAGES}
    log(f"[{root.kind}] kill plan: " + ", ".join(f"{s} {counts[s]}" for s in STAGES))
    hits, t0, failed = [], time.time(), []
    poll = 0.03 if root.s3 else 0.01
    todo, i = list(plan), -1
    while todo and len(failed) <= len(plan):
        # a session that failed on its own keeps its kill for the next one
        target, n = todo[0]
        i += 1
        ti = STAGES.index(target)
        errf = open(outdir / f"{root.kind}-session-{i:02d}.stderr", "w")
        sig0 = root.signature()
        cur0 = current_stage(root.manifest()) if sig0 is not None else 0
        child = subprocess.Popen([binary, "run", str(p), "--out", root.url], env=root.env,
                                 stdout=subprocess.DEVNULL, stderr=errf)
        ts = time.time()
        # A stage the last kill left unfinished is resumed by this session: the delay runs
        # from the spawn (a store's ETag is a hash of the content, so a manifest rewritten
        # unchanged cannot be seen). Else wait until this session has started the aimed-at
        # stage or a later one: the manifest rewritten, that stage the first unfinished one.
        sig, cur = sig0, cur0
        while cur0 < ti and child.poll() is None:
            s_ = root.signature()
            if s_ != sig and s_ != sig0:
                m = root.manifest()
                if m is not None:  # else read it again at the next poll
                    sig, cur = s_, current_stage(m)
                    if cur >= ti:
                        break
            time.sleep(poll)
        if child.poll() is not None:
            errf.close()
            if self_ended(root, i, child.returncode, outdir, failed):
                break
            continue
        tstage = time.time()
        delay = rng.uniform(0, max(0.05, durations[target] * min(1.0, 1.5 / n)))
        end = tstage + delay
        while child.poll() is None and time.time() < end:
            time.sleep(min(0.01, max(0.0, end - time.time())))
        if child.poll() is not None:
            errf.close()
            if self_ended(root, i, child.returncode, outdir, failed):
                break
            continue
        child.send_signal(signal.SIGKILL)
        child.wait()
        errf.close()
        todo.pop(0)
        hit = current_stage(root.manifest())
        hit_name = STAGES[hit] if hit < len(STAGES) else "after aggregate"
        hits.append(hit_name)
        log(f"[{root.kind}] kill {len(hits):2d}: aimed at {target}, {STAGES[cur] if cur < len(STAGES) else 'end'} "
            f"started {tstage - ts:5.2f} s after the spawn, killed {delay:5.2f} s later; hit {hit_name}")
    tf = time.time()
    r = run_cmd(binary, ["run", str(p), "--out", root.url], root.env)
    (outdir / f"{root.kind}-final.stderr").write_text(r.stderr)
    wall = time.time() - t0
    log(f"[{root.kind}] final session: exit {r.returncode} in {time.time() - tf:.1f} s; soak wall {wall:.1f} s")
    if r.returncode != 0:
        log(r.stderr[-3000:])
    return hits, wall, r, failed


def self_ended(root, i, code, outdir, failed):
    """A session that ended before its kill: the run is done (exit 0: no more kills), or the
    session failed on its own (recorded, and the kills go on)."""
    err = (outdir / f"{root.kind}-session-{i:02d}.stderr").read_text()
    log(f"[{root.kind}] session {i + 1}: ended by itself (exit {code}) before its kill")
    if code == 0:
        return True
    failed.append((i + 1, code, err.strip().splitlines()[-1] if err.strip() else ""))
    log(f"[{root.kind}]   its stderr: {err.strip()[-1500:]}")
    return False


# ---------------------------------------------------------------------------- checks


def columns(table):
    fields = json.loads((SCHEMAS / f"{table}.json").read_text())["fields"]
    return [f for f in fields if f["name"] not in EXCLUDED.get(table, [])]


def col_expr(f, table):
    name = f'"{f["name"]}"'
    if f["type"].startswith("list"):
        return f"array_to_string({name}, ',', '<null>') AS {name}"
    if f["type"].startswith("float") and table == "results":
        return f"round({name}, 9) AS {name}"
    return name


def sql(binary, ref: Root, root: Root, q, env):
    r = run_cmd(binary, ["sql", "--format", "json", "--run", ref.url, "--run", root.url, q], env)
    if r.returncode != 0:
        raise RuntimeError(f"sql failed: {q}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout or "[]")


def compare(binary, ref: Root, root: Root, env):
    """Per table: rows in each, duplicated ids in each, rows differing (unexplained, explained)."""
    out = {}
    err_ids = ("(SELECT call_id FROM a_calls WHERE error IS NOT NULL UNION "
               "SELECT call_id FROM b_calls WHERE error IS NOT NULL)")
    for t, key in KEYS.items():
        cols = columns(t)
        sel = ", ".join(col_expr(f, t) for f in cols)
        keyx = " || '|' || ".join(f"coalesce(CAST(\"{k}\" AS VARCHAR), '<null>')" for k in key)
        q = f"""
        WITH a AS (SELECT {sel} FROM a_{t}), b AS (SELECT {sel} FROM b_{t}),
             ab AS (SELECT * FROM a EXCEPT SELECT * FROM b),
             ba AS (SELECT * FROM b EXCEPT SELECT * FROM a)
        SELECT
          (SELECT count(*) FROM a_{t}) AS rows_ref,
          (SELECT count(*) FROM b_{t}) AS rows,
          (SELECT count(*) - count(DISTINCT {keyx}) FROM a_{t}) AS dup_ref,
          (SELECT count(*) - count(DISTINCT {keyx}) FROM b_{t}) AS dup,
          (SELECT count(*) FROM ab) AS only_ref,
          (SELECT count(*) FROM ba) AS only_soak
        """
        row = sql(binary, ref, root, q, env)[0]
        row["explained"] = 0
        if "call_id" in key and (row["only_ref"] or row["only_soak"]):
            qe = f"""
            WITH a AS (SELECT {sel} FROM a_{t}), b AS (SELECT {sel} FROM b_{t}),
                 d AS ((SELECT * FROM a EXCEPT SELECT * FROM b) UNION ALL
                       (SELECT * FROM b EXCEPT SELECT * FROM a))
            SELECT count(*) AS n FROM d WHERE call_id IN {err_ids}
            """
            row["explained"] = sql(binary, ref, root, qe, env)[0]["n"]
            qs = f"""
            WITH a AS (SELECT {sel} FROM a_{t}), b AS (SELECT {sel} FROM b_{t}),
                 d AS (SELECT 'ref' AS side, * FROM (SELECT * FROM a EXCEPT SELECT * FROM b)
                       UNION ALL
                       SELECT 'soak' AS side, * FROM (SELECT * FROM b EXCEPT SELECT * FROM a))
            SELECT * FROM d WHERE call_id NOT IN {err_ids} ORDER BY call_id, side LIMIT 6
            """
            row["examples"] = sql(binary, ref, root, qs, env)
        elif row["only_ref"] or row["only_soak"]:
            if t == "results":
                # aggregates legitimately differ when the error rows do (other fault draws)
                qx = ("SELECT count(*) AS n FROM ((SELECT call_id FROM a_calls WHERE error IS NOT NULL "
                      "EXCEPT SELECT call_id FROM b_calls WHERE error IS NOT NULL) UNION ALL "
                      "(SELECT call_id FROM b_calls WHERE error IS NOT NULL EXCEPT "
                      "SELECT call_id FROM a_calls WHERE error IS NOT NULL))")
                if sql(binary, ref, root, qx, env)[0]["n"]:
                    row["explained"] = row["only_ref"] + row["only_soak"]
            qs = f"""
            WITH a AS (SELECT {sel} FROM a_{t}), b AS (SELECT {sel} FROM b_{t})
            SELECT 'ref' AS side, * FROM (SELECT * FROM a EXCEPT SELECT * FROM b)
            UNION ALL SELECT 'soak' AS side, * FROM (SELECT * FROM b EXCEPT SELECT * FROM a)
            LIMIT 6
            """
            row["examples"] = sql(binary, ref, root, qs, env)
        out[t] = row
    errors = sql(binary, ref, root,
                 "SELECT (SELECT count(*) FROM a_calls WHERE error IS NOT NULL) AS ref, "
                 "(SELECT count(*) FROM b_calls WHERE error IS NOT NULL) AS soak", env)[0]
    return out, errors


def repaid(reqlog: Path):
    answered, keys, faults = 0, set(), {}
    with reqlog.open() as f:
        for line in f:
            r = json.loads(line)
            fault = r.get("fault")
            faults[fault] = faults.get(fault, 0) + 1
            if fault is None:
                answered += 1
                keys.add((r["request_hash"], r["sample_idx"]))
    return answered, len(keys), faults


# ---------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=str(REPO / "target/release/evalflow"))
    ap.add_argument("--calls", type=int, default=1_000_000)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=60)
    ap.add_argument("--roots", default="local,s3")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--store-fault-rate", type=float, default=0.02)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (roots, logs)")
    a = ap.parse_args()
    roots = [r for r in a.roots.split(",") if r]
    binary = str(Path(a.bin).resolve())
    rng = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="evalflow-soak-"))
    log(f"soak: {a.calls:,} calls, {a.kills} kills, concurrency {a.concurrency}, seed {a.seed}, "
        f"roots {','.join(roots)}; work folder {tmp}")
    base_env = {**os.environ, "EVALFLOW_CACHE_DIR": "off"}
    for k in ("AWS_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        base_env.pop(k, None)
    procs, ok = [], True
    try:
        # ------------------------------------------------------------ reference
        mport = free_port()
        ref_log = tmp / "requests-reference.jsonl"
        mock = start_mock(binary, mport, ref_log, a.seed)
        procs.append(mock)
        p = pipeline(tmp, f"http://127.0.0.1:{mport}/v1", a.calls, a.concurrency)
        ref = Root("reference", str(tmp / "reference"),
                   {**base_env, "EVALFLOW_STATE_DIR": str(tmp / "state-reference")})
        t = time.time()
        r = run_cmd(binary, ["run", str(p), "--out", ref.url], ref.env)
        ref_wall = time.time() - t
        stop(mock)
        (tmp / "reference.stderr").write_text(r.stderr)
        if r.returncode != 0:
            sys.exit(f"the reference run failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        durations = stage_durations(ref.manifest())
        ref_answered, ref_distinct, ref_faults = repaid(ref_log)
        log(f"reference: {ref_wall:.1f} s; stages " +
            ", ".join(f"{s} {durations[s]:.1f} s" for s in STAGES) +
            f"; {sum(ref_faults.values()):,} requests, faults {dict(sorted((str(k), v) for k, v in ref_faults.items()))}")
        ref_verify = run_cmd(binary, ["verify", ref.url], ref.env).returncode
        log(f"reference: verify exit {ref_verify}")

        # ------------------------------------------------------------ moto + proxy
        proxy_port = moto_port = None
        if "s3" in roots:
            moto_port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wait_port(moto_port)
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{moto_port}/soak", method="PUT")).read()
            proxy_port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, str(REPO / "tests/fault_proxy.py"), "--upstream",
                 f"http://127.0.0.1:{moto_port}", "--port", str(proxy_port),
                 "--rate", str(a.store_fault_rate), "--seed", str(a.seed)],
                stderr=subprocess.DEVNULL))
            wait_port(proxy_port)

        summaries = []
        for kind in roots:
            mport = free_port()
            reqlog = tmp / f"requests-{kind}.jsonl"
            mock = start_mock(binary, mport, reqlog, a.seed)
            procs.append(mock)
            # same pipeline text but for the mock's port: the request hashes do not include
            # the base URL (checked below: the ids must match the reference's)
            d = tmp / kind
            d.mkdir()
            pk = pipeline(d, f"http://127.0.0.1:{mport}/v1", a.calls, a.concurrency)
            env = {**base_env, "EVALFLOW_STATE_DIR": str(tmp / f"state-{kind}")}
            if kind == "local":
                root = Root(kind, str(tmp / "soak-local"), env)
            else:
                env.update(AWS_ACCESS_KEY_ID="t", AWS_SECRET_ACCESS_KEY="t", AWS_REGION="us-east-1",
                           AWS_ALLOW_HTTP="true", AWS_ENDPOINT=f"http://127.0.0.1:{proxy_port}")
                root = Root(kind, "s3://soak/run", env, moto=f"http://127.0.0.1:{moto_port}")
            hits, wall, final, failed = soak(a, binary, pk, root, durations, rng, tmp)
            stop(mock)
            vr = run_cmd(binary, ["verify", root.url], env)
            (tmp / f"{kind}-verify.out").write_text(vr.stdout + vr.stderr)
            log(f"[{kind}] verify exit {vr.returncode}" + (f": {(vr.stdout + vr.stderr)[-2000:]}" if vr.returncode else ""))
            cenv = dict(env)  # reads both roots: the reference is local, needs no AWS_*
            tables, errors = compare(binary, ref, root, cenv)
            answered, distinct, faults = repaid(reqlog)
            store_faults = None
            if kind == "s3":
                with urllib.request.urlopen(f"http://127.0.0.1:{proxy_port}/__faults") as r_:
                    store_faults = json.loads(r_.read())
            summaries.append(dict(kind=kind, hits=hits, wall=wall, final=final.returncode, failed=failed,
                                  verify=vr.returncode, tables=tables, errors=errors,
                                  answered=answered, distinct=distinct, faults=faults,
                                  store_faults=store_faults))

        # ------------------------------------------------------------ summary
        log("")
        log(f"reference (uninterrupted, local root): {ref_wall:.1f} s, {ref_answered:,} answered requests, "
            f"{ref_distinct:,} distinct, re-paid {ref_answered - ref_distinct:,} (no kills: answers the "
            f"adaptive deadline abandoned); verify exit {ref_verify}")
        for s in summaries:
            hit_counts = {h: s["hits"].count(h) for h in dict.fromkeys(s["hits"])}
            t = s["tables"]
            calls = t["calls"]["rows"]
            log("")
            log(f"### root: {s['kind']}" + (" (s3:// on moto behind tests/fault_proxy.py)" if s["kind"] == "s3" else ""))
            log("")
            log("| measure | value |")
            log("|---|---|")
            log(f"| calls (rows in `calls` / reference) | {calls:,} / {t['calls']['rows_ref']:,} (asked: {a.calls:,}) |")
            log(f"| kills delivered | {len(s['hits'])} of {a.kills} (" +
                ", ".join(f"{k} {v}" for k, v in hit_counts.items()) + ") |")
            log(f"| wall time, soak (all sessions) | {s['wall']:.1f} s (reference {ref_wall:.1f} s) |")
            log(f"| sessions that failed on their own (not killed) | {len(s['failed'])}" +
                "".join(f"; session {n}: exit {c}: `{e[:300]}`" for n, c, e in s["failed"]) + " |")
            log(f"| final session exit / `verify` exit | {s['final']} / {s['verify']} |")
            for name, row in t.items():
                eq = row["only_ref"] == 0 and row["only_soak"] == 0
                unexpl = row["only_ref"] + row["only_soak"] - row["explained"]
                verdict = "yes" if eq else (
                    f"no: {row['only_ref']} ref-only / {row['only_soak']} soak-only rows, "
                    f"{row['explained']} explained, {unexpl} unexplained")
                log(f"| `{name}`: rows, duplicated ids, equal to reference | {row['rows']:,}, "
                    f"{row['dup']} (ref {row['dup_ref']}), {verdict} |")
            log(f"| error rows in `calls` (soak / ref) | {s['errors']['soak']} / {s['errors']['ref']} |")
            log(f"| answered requests / distinct (hash, sample) | {s['answered']:,} / {s['distinct']:,} |")
            log(f"| re-paid answers / bound (kills x concurrency) | {s['answered'] - s['distinct']:,} / "
                f"{len(s['hits']) * a.concurrency:,} |")
            log(f"| model faults in the mock's log | " + ", ".join(
                f"{k} {v:,}" for k, v in sorted(s["faults"].items(), key=lambda kv: str(kv[0])) if k) + " |")
            if s["store_faults"] is not None:
                sf = s["store_faults"]
                inj = sum(v for k, v in sf.items() if k != "requests")
                log(f"| store faults injected | {inj:,} of {sf['requests']:,} requests (" +
                    ", ".join(f"{k} {v}" for k, v in sf.items() if k != "requests") +
                    "; counts include the reads of the checks) |")
            bad = (s["verify"] != 0 or s["final"] != 0 or s["failed"] or
                   any(r["dup"] for r in t.values()) or
                   any(r["only_ref"] + r["only_soak"] - r["explained"] for r in t.values()) or
                   s["answered"] - s["distinct"] > len(s["hits"]) * a.concurrency + (ref_answered - ref_distinct))
            for name, row in t.items():
                for ex in row.get("examples", []):
                    log(f"  differing `{name}` row: {json.dumps(ex)[:600]}")
            ok &= not bad
        log("")
        log(f"excluded from the `calls` comparison: {', '.join(EXCLUDED['calls'])}; rows of calls that "
            "ended as errors in either run (and their verdicts and scores) are counted as explained.")
    finally:
        for pr in procs:
            stop(pr)
        if a.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
