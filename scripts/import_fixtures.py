#!/usr/bin/env python3
"""Regenerates tests/fixtures/import/: logs written by the real tools against `evalflow mock-server`.

Each tool is run on the same small sentiment set (4 prompt templates x 4 fillers, so the
template is a cluster) against the mock server answering with VADER's label of the prompt
and failing a few requests with 403 (out of credit), so every log holds right answers,
wrong answers and provider errors. Next to each log the script writes `expected.json` with
the tool's OWN summary numbers (read back with the tool's own reader or summary file), which
tests/import_formats.rs checks evalflow's import against. CI reads the committed files only.

Usage (from the repository root, tools on PATH or named by the variables below):
    python3 scripts/import_fixtures.py [--only inspect,promptfoo,lm-eval,openai-batch]

    EVALFLOW   the evalflow binary (default: target/debug/evalflow, built with `cargo build`)
    PYTHON     a Python with `inspect-ai` and `lm-eval` installed (default: this one)
    PROMPTFOO  the promptfoo command (default: `npx promptfoo`, run in $PROMPTFOO_DIR)

Versions used for the committed fixtures: inspect-ai 0.3.285, lm-eval 0.4.13, promptfoo
(see tests/fixtures/import/promptfoo/expected.json, "tool_version").
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "import")
SYSTEM = "Classify the sentiment of the text. Answer with one word: positive, negative or neutral."

TEMPLATES = [
    ("love", "I really love this {x}, it is wonderful."),
    ("hate", "I hate this {x}, it is awful and broken."),
    ("plain", "The {x} arrived on Tuesday."),
    ("mixed", "The {x} is good but the support was terrible."),
]
FILLERS = ["phone", "laptop", "chair", "kettle"]
# The labels a human gave: the mock (VADER) disagrees on some, so accuracy is below 1.
GOLD = {"love": "positive", "hate": "negative", "plain": "neutral", "mixed": "negative"}


def dataset():
    rows = []
    for t, (name, tmpl) in enumerate(TEMPLATES):
        for f, x in enumerate(FILLERS):
            rows.append(
                {
                    "id": f"s{t}{f}",
                    "input": tmpl.format(x=x),
                    "target": GOLD[name] if not (name == "plain" and f == 3) else "positive",
                    "template": name,
                }
            )
    return rows


def start_mock(evalflow, fault, log):
    p = subprocess.Popen(
        [
            evalflow,
            "mock-server",
            "--addr",
            "127.0.0.1:0",
            "--answer",
            "vader",
            *(["--fault", fault] if fault else []),
            "--seed",
            "7",
            "--request-log",
            log,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = p.stdout.readline()
    m = re.search(r"http://(\S+)", line)
    if not m:
        p.kill()
        sys.exit(f"mock-server did not start: {line!r}")
    return p, f"http://{m.group(1)}"


def run(cmd, **kw):
    print("+", " ".join(cmd), file=sys.stderr)
    r = subprocess.run(cmd, **kw)
    if r.returncode != 0:
        sys.exit(f"{cmd[0]} failed with {r.returncode}")
    return r


# ---------------------------------------------------------------------------- Inspect AI
INSPECT_TASK = '''
from inspect_ai import Task, task
from inspect_ai.dataset import json_dataset, FieldSpec
from inspect_ai.scorer import match
from inspect_ai.solver import generate, system_message


@task
def sentiment():
    return Task(
        dataset=json_dataset(
            "dataset.jsonl",
            FieldSpec(input="input", target="target", id="id", metadata=["template"]),
        ),
        solver=[system_message(SYSTEM), generate()],
        scorer=match(location="any"),
    )
'''


def inspect_fixture(python, base, work):
    out = os.path.join(OUT, "inspect")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(work, "dataset.jsonl"), "w") as f:
        for r in dataset():
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(work, "task.py"), "w") as f:
        f.write(f"SYSTEM = {SYSTEM!r}\n" + INSPECT_TASK)
    env = dict(os.environ, MOCK_BASE_URL=base + "/v1", MOCK_API_KEY="unused",
               INSPECT_LOG_DIR=os.path.join(work, "logs"), INSPECT_DISPLAY="none")
    run(
        [python, "-m", "inspect_ai", "eval", "task.py", "--model", "openai-api/mock/mock-sentiment",
         "--epochs", "2", "--max-tokens", "16", "--temperature", "0.7",
         "--no-fail-on-error", "--max-retries", "0", "--log-format", "eval"],
        cwd=work, env=env,
    )
    [log] = glob.glob(os.path.join(work, "logs", "*.eval"))
    shutil.copy(log, os.path.join(out, "sentiment.eval"))
    # The older JSON log format, written by Inspect itself: a second, smaller run (its
    # samples carry the full event transcript, so 32 of them would not fit the 1 MB budget).
    run(
        [python, "-m", "inspect_ai", "eval", "task.py", "--model", "openai-api/mock/mock-sentiment",
         "--limit", "6", "--max-tokens", "16", "--no-fail-on-error", "--max-retries", "0",
         "--log-format", "json", "--log-dir", os.path.join(work, "json")],
        cwd=work, env=env,
    )
    [jlog] = glob.glob(os.path.join(work, "json", "*.json"))
    shutil.copy(jlog, os.path.join(out, "sentiment.json"))
    summary = subprocess.run(
        [python, "-c", INSPECT_SUMMARY, jlog], capture_output=True, text=True, check=True
    ).stdout
    with open(os.path.join(out, "expected_json_log.json"), "w") as f:
        f.write(summary)
    summary = subprocess.run(
        [python, "-c", INSPECT_SUMMARY, log], capture_output=True, text=True, check=True
    ).stdout
    with open(os.path.join(out, "expected.json"), "w") as f:
        f.write(summary)


# Inspect's own reader: the numbers a user of Inspect sees for this log.
INSPECT_SUMMARY = r'''
import json, sys, time
from inspect_ai.log import read_eval_log
import inspect_ai
t = time.perf_counter()
log = read_eval_log(sys.argv[1])
secs = time.perf_counter() - t
samples = log.samples
usage = {m: {"input_tokens": u.input_tokens, "output_tokens": u.output_tokens}
         for m, u in log.stats.model_usage.items()}
scores = {}
for s in log.results.scores:
    scores[s.name] = {k: m.value for k, m in s.metrics.items()}
per_sample = []
for s in samples:
    v = None
    if s.scores:
        v = {k: sc.value for k, sc in s.scores.items()}
    per_sample.append({
        "id": s.id, "epoch": s.epoch, "target": s.target,
        "template": (s.metadata or {}).get("template"),
        "error": s.error.message if s.error else None,
        "input_tokens": sum(u.input_tokens for u in s.model_usage.values()),
        "output_tokens": sum(u.output_tokens for u in s.model_usage.values()),
        "scores": v,
    })
print(json.dumps({
    "tool": "inspect-ai", "tool_version": inspect_ai.__version__,
    "model": log.eval.model, "task": log.eval.task,
    "epochs": log.eval.config.epochs,
    "total_samples": log.results.total_samples,
    "completed_samples": log.results.completed_samples,
    "samples_in_log": len(samples),
    "errors": sum(1 for s in samples if s.error),
    "model_usage": usage,
    "scores": scores,
    "read_eval_log_seconds": secs,
    "samples": per_sample,
}, indent=1))
'''


# ---------------------------------------------------------------------------- lm-eval
LM_EVAL_TASK = """task: sentiment_chat
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{input}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


def lm_eval_fixture(python, base, work):
    out = os.path.join(OUT, "lm-eval")
    os.makedirs(out, exist_ok=True)
    data = os.path.join(work, "lm_dataset.jsonl")
    with open(data, "w") as f:
        for r in dataset():
            f.write(json.dumps(r) + "\n")
    tasks = os.path.join(work, "lm_tasks")
    os.makedirs(tasks, exist_ok=True)
    with open(os.path.join(tasks, "sentiment_chat.yaml"), "w") as f:
        f.write(LM_EVAL_TASK.format(data=data))
    env = dict(os.environ, OPENAI_API_KEY="unused", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    run(
        [python, "-m", "lm_eval", "run", "--model", "local-chat-completions", "--model_args",
         f"model=mock-sentiment,base_url={base}/v1/chat/completions,num_concurrent=1,max_retries=1,tokenized_requests=False",
         "--tasks", "sentiment_chat", "--include_path", tasks, "--apply_chat_template",
         "--log_samples", "--output_path", os.path.join(work, "lm_out")],
        cwd=work, env=env,
    )
    [samples] = glob.glob(os.path.join(work, "lm_out", "**", "samples_*.jsonl"), recursive=True)
    [results] = glob.glob(os.path.join(work, "lm_out", "**", "results_*.json"), recursive=True)
    for old in glob.glob(os.path.join(out, "samples_*.jsonl")) + glob.glob(os.path.join(out, "results_*.json")):
        os.remove(old)
    # Both under lm-eval's own names: the importer reads the model from the results file.
    shutil.copy(samples, out)
    shutil.copy(results, out)
    res = json.load(open(results))
    import lm_eval
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"tool": "lm-eval", "tool_version": lm_eval.__version__,
                   "results": res["results"], "n-samples": res.get("n-samples"),
                   "model_name": res.get("model_name")}, f, indent=1)


# ---------------------------------------------------------------------------- promptfoo
def promptfoo_fixture(base, work):
    out = os.path.join(OUT, "promptfoo")
    os.makedirs(out, exist_ok=True)
    tests = "\n".join(
        f"""  - description: {r['id']}
    vars:
      text: "{r['input']}"
      template: {r['template']}
    assert:
      - type: icontains
        value: {r['target']}
"""
        for r in dataset()
    )
    cfg = f"""description: sentiment
prompts:
  - id: sentiment
    raw: '[{{"role": "system", "content": "{SYSTEM}"}}, {{"role": "user", "content": "{{{{text}}}}"}}]'
providers:
  - id: openai:chat:mock-sentiment
    config:
      apiBaseUrl: {base}/v1
      apiKey: unused
      max_tokens: 16
      temperature: 0.7
tests:
{tests}"""
    with open(os.path.join(work, "promptfooconfig.yaml"), "w") as f:
        f.write(cfg)
    cmd = os.environ.get("PROMPTFOO", "npx promptfoo").split()
    env = dict(os.environ, PROMPTFOO_DISABLE_TELEMETRY="1", PROMPTFOO_DISABLE_UPDATE="1",
               PROMPTFOO_CACHE_ENABLED="false", PROMPTFOO_CONFIG_DIR=os.path.join(work, "pf"),
               OPENAI_API_KEY="unused")
    r = subprocess.run(cmd + ["eval", "-c", os.path.join(work, "promptfooconfig.yaml"),
                              "--repeat", "2", "--no-cache", "--no-table", "--no-write", "--no-progress-bar",
                              "-j", "1", "-o", os.path.join(out, "results.json")],
                       cwd=os.environ.get("PROMPTFOO_DIR", work), env=env)
    # promptfoo exits 100 when an assertion failed: that is the point of the fixture.
    if r.returncode not in (0, 100):
        sys.exit(f"promptfoo failed with {r.returncode}")
    res = json.load(open(os.path.join(out, "results.json")))
    ver = subprocess.run(cmd + ["--version"], capture_output=True, text=True,
                         cwd=os.environ.get("PROMPTFOO_DIR", work), env=env).stdout.strip()
    stats = res["results"]["stats"]
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"tool": "promptfoo", "tool_version": ver, "stats": stats,
                   "n_results": len(res["results"]["results"])}, f, indent=1)


# ---------------------------------------------------------------------------- OpenAI Batch
def openai_batch_fixture(base, work):
    """The Batch API's documented input and output shapes, with bodies the mock answered.

    https://platform.openai.com/docs/guides/batch: each output line is {"id", "custom_id",
    "response": {"status_code", "request_id", "body"} | null, "error": {"code", "message"} | null}.
    A 403 from the mock becomes a non-200 line (its body holds the error); every seventh
    request is written as an expired request (`error`, no response), as the API does when a
    batch's window closes.
    """
    out = os.path.join(OUT, "openai-batch")
    os.makedirs(out, exist_ok=True)
    inp, outp = [], []
    for i, r in enumerate(dataset()):
        for k in range(2):
            body = {
                "model": "mock-sentiment",
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": r["input"]},
                ],
                "max_tokens": 16,
                "temperature": 0.7,
                "seed": k,
            }
            cid = f"{r['id']}-{k}"
            inp.append({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})
            if (i * 2 + k) % 7 == 6:
                outp.append({"id": f"batch_req_{i}_{k}", "custom_id": cid, "response": None,
                             "error": {"code": "batch_expired", "message": "This request could not be executed before the completion window expired."}})
                continue
            req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req) as resp:
                    status, payload = resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as e:
                status, payload = e.code, json.loads(e.read() or b"{}")
            outp.append({"id": f"batch_req_{i}_{k}", "custom_id": cid,
                         "response": {"status_code": status, "request_id": f"req_{i}_{k}", "body": payload},
                         "error": None})
    # The API writes output lines in no particular order: shuffle deterministically.
    outp = outp[1::2] + outp[0::2]
    with open(os.path.join(out, "batch_input.jsonl"), "w") as f:
        for l in inp:
            f.write(json.dumps(l) + "\n")
    with open(os.path.join(out, "batch_output.jsonl"), "w") as f:
        for l in outp:
            f.write(json.dumps(l) + "\n")
    completed = sum(1 for l in outp if l["response"] and l["response"]["status_code"] == 200)
    usage = [l["response"]["body"].get("usage", {}) for l in outp
             if l["response"] and l["response"]["status_code"] == 200]
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"tool": "openai-batch", "request_counts": {
            "total": len(inp), "completed": completed, "failed": len(inp) - completed},
            "prompt_tokens": sum(u.get("prompt_tokens", 0) for u in usage),
            "completion_tokens": sum(u.get("completion_tokens", 0) for u in usage),
            "correct": sum(1 for l in outp if l["response"] and l["response"]["status_code"] == 200
                           and l["response"]["body"]["choices"][0]["message"]["content"].strip().lower()
                           == next(r["target"] for r in dataset() if l["custom_id"].startswith(r["id"] + "-")))},
                  f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="inspect,promptfoo,lm-eval,openai-batch")
    a = ap.parse_args()
    evalflow = os.environ.get("EVALFLOW", os.path.join(ROOT, "target", "debug", "evalflow"))
    python = os.environ.get("PYTHON", sys.executable)
    work = tempfile.mkdtemp(prefix="import-fixtures-")
    mock, base = start_mock(evalflow, "out_of_credit=0.1", os.path.join(work, "requests.jsonl"))
    mock_ok, base_ok = start_mock(evalflow, None, os.path.join(work, "requests-ok.jsonl"))
    # promptfoo aborts the whole eval at the first 403 ("will not resolve on retry"), so its
    # failures are malformed answers, which it records per result and goes on.
    mock_pf, base_pf = start_mock(evalflow, "malformed_json=0.1", os.path.join(work, "requests-pf.jsonl"))
    try:
        for which in a.only.split(","):
            {"inspect": lambda: inspect_fixture(python, base, work),
             # lm-eval stops the whole run at the first failed request (it keeps no
             # partial log), so it talks to a mock that never fails.
             "lm-eval": lambda: lm_eval_fixture(python, base_ok, work),
             "promptfoo": lambda: promptfoo_fixture(base_pf, work),
             "openai-batch": lambda: openai_batch_fixture(base, work)}[which]()
    finally:
        mock.terminate()
        mock_ok.terminate()
        mock_pf.terminate()
    print(f"fixtures written under {OUT} (work dir {work})", file=sys.stderr)


if __name__ == "__main__":
    main()
