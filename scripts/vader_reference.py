#!/usr/bin/env python3
"""Writes tests/fixtures/vader/sentiment_compound.jsonl: the compound score that the
reference VADER (vaderSentiment 3.3.2 on PyPI) gives every sentence of the sentiment suite.

tests/generate.rs checks that evalflow's `builtin:vader` gives exactly these scores and that
the fixture covers every input the current pipelines/sentiment.toml expands to, so a suite
change without re-running this script fails the tests.

Usage (from the repository root):
    pip install vaderSentiment==3.3.2 pyarrow
    python3 scripts/vader_reference.py [--evalflow PATH] [--pipeline pipelines/sentiment.toml]

It runs `evalflow generate PIPELINE --out TMP` (default binary: `cargo run --quiet --`),
reads TMP/cases/*.parquet with pyarrow, and scores each distinct `input`. A few extra
sentences exercising VADER's rules (capitals, boosters, "but", emoticons, emojis, "least",
"no") are added so the fixture checks the port beyond the suite's vocabulary.
"""

import argparse
import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile

import pyarrow.parquet as pq
import vaderSentiment
from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

VERSION = "3.3.2"

EXTRA = [
    "VADER is smart, handsome, and funny.",
    "VADER is VERY SMART, uber handsome, and FRIGGIN FUNNY!!!",
    "VADER is not smart, handsome, nor funny.",
    "At least it isn't a horrible book.",
    "The book was only kind of good.",
    "The plot was good, but the characters are uncompelling and the dialog is not great.",
    "Today only kinda sux! But I'll get by, lol",
    "Make sure you :) or :D today!",
    "Catch utf-8 emoji such as 💘 and 💋 and 😁",
    "Not bad at all",
    "good good but good bad bad",
    "No good, no way, no problem.",
    "This is the shit! Kiss of death for them though???",
    "I never so loved a flight... without doubt the best",
    "It was at least not the worst, very least I can say",
    "not the least bit happy, sort of sad",
    "WOW!!!! this is NOT good ?? ??",
    "\u00a0padded\u2003text\x1cwith odd spaces\u3000great",
]


def find_installed_version() -> str:
    try:
        from importlib.metadata import version

        return version("vaderSentiment")
    except Exception:  # pragma: no cover
        return getattr(vaderSentiment, "__version__", "unknown")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--evalflow", default="cargo run --quiet --",
                    help="command that runs evalflow (default: cargo run --quiet --)")
    ap.add_argument("--pipeline", default="pipelines/sentiment.toml")
    ap.add_argument("--out", default="tests/fixtures/vader/sentiment_compound.jsonl")
    args = ap.parse_args()

    got = find_installed_version()
    if got != VERSION:
        print(f"vaderSentiment {got} is installed; the reference is {VERSION}", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "run")
        cmd = shlex.split(args.evalflow) + ["generate", args.pipeline, "--out", root]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        texts = set()
        for part in sorted(glob.glob(os.path.join(root, "cases", "*.parquet"))):
            texts.update(pq.read_table(part, columns=["input"]).column("input").to_pylist())
    if not texts:
        print(f"{args.pipeline}: generate wrote no cases", file=sys.stderr)
        return 1
    texts.update(EXTRA)

    analyzer = SentimentIntensityAnalyzer()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for text in sorted(texts):
            compound = analyzer.polarity_scores(text)["compound"]
            f.write(json.dumps({"text": text, "compound": compound}, ensure_ascii=False) + "\n")
    print(f"{args.out}: {len(texts)} sentences scored by vaderSentiment {VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
