#!/usr/bin/env python3
"""Writes a realistic recorded corpus of OpenAI request/response pairs as evalflow JSONL.

Usage: gen_corpus.py N OUT.jsonl [--seed S] [--jobs J] [--shape indexed|repeated|plain]

N calls over several models, K = 1..3 samples per case, 90%+ distinct responses, answer
lengths from empty to 2,000 characters with a long tail, 2% empty with finish_reason
`length`, 1% refusals, 1% non-English (half of them Chinese), 1% provider errors.

`--shape plain` is the indexed corpus without `sample_idx` or ids (1-3 samples per case and model,
in order): few repeats, none numbered.

`--shape repeated` is a log as users bring it: no record carries `sample_idx` or an id, each
request is repeated 50 times (5 models x 10 samples), and a block's lines are shuffled (logs
concatenated from several runs), so the import must number the samples itself.

Cases are made in blocks of BLOCK cases, each from its own seeded generator, on J processes
(default: all cores), and written in block order: the file depends on N and the seed only.
A 10M-record corpus (7 GB) takes minutes, not hours.
"""
import json
import multiprocessing
import os
import random
import sys

BLOCK = 5000

MODELS = ["gpt-4o-mini", "gpt-4.1", "claude-haiku", "llama-3-70b"]
REPEATED_MODELS = MODELS + ["qwen-2.5-72b"]
WORDS = (
    "the food was great service slow waiter friendly price fair room clean noisy view "
    "staff helpful breakfast cold coffee hot bed soft location perfect parking hard "
    "experience would recommend again never disappointing amazing terrible average decent "
    "value money quality fresh stale portion small large menu varied limited ambience cozy "
    "and but with for this that very quite really not it they we you our their from about"
).split()
LABELS = ["positive", "negative", "neutral"]
ES = "la comida estaba muy buena pero el servicio fue lento y caro no lo recomiendo".split()
ZH = "之前推荐的一些品牌基本都超了不建议强行上付费版服务很好价格公道环境干净"
REFUSAL = "I'm sorry, but I can't help with that request."


def sentence(rng, n_words):
    return " ".join(rng.choices(WORDS, k=n_words))


def answer(rng, label):
    # Long tail: most answers short, some up to 2,000 characters.
    length = min(2000, int(rng.lognormvariate(4.0, 1.1)))
    if length < 24:
        # A short answer is the bare label now and then, else the label and a few words:
        # cut at any length, most short answers would repeat each other.
        if rng.random() < 0.2:
            return label.capitalize()
        length = 24
    text = label.capitalize() + ". "
    while len(text) < length:
        text += sentence(rng, rng.randint(5, 14)).capitalize() + ". "
    return text[:max(length, len(label))]


def block(args):
    """The JSONL lines of cases `first+1 .. first+BLOCK` (at most `limit` lines)."""
    seed, b, limit, shape = args
    repeated = shape == "repeated"
    # `plain`: the indexed corpus (1-3 samples per case and model, in order) without
    # `sample_idx` or response ids: few repeats, none numbered.
    indexed = shape == "indexed"
    rng = random.Random(seed * 1_000_003 + b)
    lines = []
    written = 0
    for case in range(b * BLOCK + 1, (b + 1) * BLOCK + 1):
        if written >= limit:
            break
        label = rng.choice(LABELS)
        review = f"Review {case}: " + sentence(rng, rng.randint(8, 30))
        prompt = f"Classify the sentiment of this review as positive, negative or neutral.\n{review}"
        k = 10 if repeated else rng.randint(1, 3)
        for model in REPEATED_MODELS if repeated else MODELS:
            for s in range(k):
                if written >= limit:
                    break
                written += 1
                req = {
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 512,
                    "temperature": 1.0,
                }
                rec = {"request": req, "expected": label}
                if indexed:
                    rec["sample_idx"] = s
                u = rng.random()
                finish = "stop"
                reasoning = 0
                if u < 0.01:
                    rec["response"] = None
                    rec["http_status"] = rng.choice([500, 503, 429])
                    rec["error"] = "upstream error: the server had an error processing your request"
                    lines.append(json.dumps(rec, ensure_ascii=False))
                    continue
                elif u < 0.03:
                    content, finish, reasoning = "", "length", 512
                elif u < 0.04:
                    content = REFUSAL
                elif u < 0.045:
                    content = "".join(rng.choices(ZH, k=rng.randint(10, 200)))
                elif u < 0.05:
                    content = " ".join(rng.choices(ES, k=rng.randint(10, 60)))
                else:
                    content = answer(rng, label if rng.random() < 0.8 else rng.choice(LABELS))
                usage = {
                    "prompt_tokens": len(prompt) // 4,
                    "completion_tokens": max(len(content) // 4, reasoning),
                    "total_tokens": len(prompt) // 4 + max(len(content) // 4, reasoning),
                }
                if reasoning:
                    usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
                rec["response"] = {
                    "object": "chat.completion",
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": content},
                            "finish_reason": finish,
                        }
                    ],
                    "usage": usage,
                }
                if indexed:
                    rec["response"]["id"] = f"chatcmpl-{case}-{model}-{s}"
                lines.append(json.dumps(rec, ensure_ascii=False))
    if repeated:
        rng.shuffle(lines)
    return lines


def main():
    n = int(sys.argv[1])
    out = sys.argv[2]
    seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 7
    jobs = int(sys.argv[sys.argv.index("--jobs") + 1]) if "--jobs" in sys.argv else os.cpu_count()
    shape = sys.argv[sys.argv.index("--shape") + 1] if "--shape" in sys.argv else "indexed"
    assert shape in ("indexed", "repeated", "plain"), shape
    # A case has at most 4 models x 3 samples = 12 lines (50 repeated); ask each block for at most what is
    # still missing, in order, so the file ends after exactly n lines.
    written = 0
    with open(out, "w", encoding="utf-8") as f, multiprocessing.Pool(jobs) as pool:
        blocks = (n // (BLOCK * (50 if shape == "repeated" else 4))) + 2
        for b0 in range(0, 10**9, blocks):
            work = [(seed, b, n, shape) for b in range(b0, b0 + blocks)]
            for lines in pool.imap(block, work, chunksize=1):
                take = lines[: n - written]
                if take:
                    f.write("\n".join(take) + "\n")
                written += len(take)
                if written >= n:
                    return


if __name__ == "__main__":
    main()
