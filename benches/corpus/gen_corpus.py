#!/usr/bin/env python3
"""Writes a realistic recorded corpus of OpenAI request/response pairs as evalflow JSONL.

Usage: gen_corpus.py N OUT.jsonl [--seed S]

N calls over several models, K = 1..3 samples per case, 90%+ distinct responses, answer
lengths from empty to 2,000 characters with a long tail, 2% empty with finish_reason
`length`, 1% refusals, 1% non-English (half of them Chinese), 1% provider errors.
"""
import json
import random
import sys

MODELS = ["gpt-4o-mini", "gpt-4.1", "claude-haiku", "llama-3-70b"]
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
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def answer(rng, label):
    # Long tail: most answers short, some up to 2,000 characters.
    length = min(2000, int(rng.lognormvariate(4.0, 1.1)))
    text = label.capitalize() + ". "
    while len(text) < length:
        text += sentence(rng, rng.randint(5, 14)).capitalize() + ". "
    return text[:max(length, len(label))]


def main():
    n = int(sys.argv[1])
    out = sys.argv[2]
    seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 7
    rng = random.Random(seed)
    written = 0
    case = 0
    with open(out, "w", encoding="utf-8") as f:
        while written < n:
            case += 1
            label = rng.choice(LABELS)
            review = f"Review {case}: " + sentence(rng, rng.randint(8, 30))
            prompt = f"Classify the sentiment of this review as positive, negative or neutral.\n{review}"
            k = rng.randint(1, 3)
            for model in MODELS:
                for s in range(k):
                    if written >= n:
                        break
                    written += 1
                    req = {
                        "model": model,
                        "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": 512,
                        "temperature": 1.0,
                    }
                    rec = {"request": req, "sample_idx": s, "expected": label}
                    u = rng.random()
                    finish = "stop"
                    reasoning = 0
                    if u < 0.01:
                        rec["response"] = None
                        rec["http_status"] = rng.choice([500, 503, 429])
                        rec["error"] = "upstream error: the server had an error processing your request"
                        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                        continue
                    elif u < 0.03:
                        content, finish, reasoning = "", "length", 512
                    elif u < 0.04:
                        content = REFUSAL
                    elif u < 0.045:
                        content = "".join(rng.choice(ZH) for _ in range(rng.randint(10, 200)))
                    elif u < 0.05:
                        content = " ".join(rng.choice(ES) for _ in range(rng.randint(10, 60)))
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
                        "id": f"chatcmpl-{written}",
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
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
