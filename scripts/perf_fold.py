#!/usr/bin/env python3
"""Inclusive CPU shares from a `perf script` dump of a call-graph recording.

Usage:
  perf record -F 400 --call-graph dwarf,16384 -o perf.data -- target/release/evalflow ...
  perf script --no-inline -i perf.data > stacks.txt   # --no-inline: seconds, not minutes
  python3 scripts/perf_fold.py stacks.txt [PATTERN]          # symbols by inclusive share
  python3 scripts/perf_fold.py stacks.txt --callees SYMBOL   # what SYMBOL's share is spent in

A symbol counts once per sample that has it anywhere on its stack, so shares overlap (a
caller's includes its callees'). Rayon's work stealing nests unrelated jobs under a waiting
one: read a job's own callees (`--callees`), not its ancestors.
"""
import collections
import re
import sys


def samples(path):
    """Each sample's stack, leaf first, as symbol names without offsets or hashes."""
    stack = []
    for line in open(path, errors="replace"):
        if not line.strip():
            if stack:
                yield stack
            stack = []
        elif line[0] in " \t":
            parts = line.strip().split(" ", 1)
            if len(parts) == 2:
                sym = re.sub(r"\+0x[0-9a-f]+", "", parts[1].rsplit(" (", 1)[0])
                stack.append(re.sub(r"::h[0-9a-f]{16}$", "", sym))
    if stack:
        yield stack


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    path = args[0]
    if len(args) >= 3 and args[1] == "--callees":
        target, total, kids = args[2], 0, collections.Counter()
        for st in samples(path):
            total += 1
            at = [i for i, s in enumerate(st) if s == target]
            if at:
                i = max(at)  # the outermost occurrence
                kids[st[i - 1] if i > 0 else "(self)"] += 1
        print(f"{target}: {100 * sum(kids.values()) / max(total, 1):.2f}% of {total} samples")
        for s, c in kids.most_common(25):
            print(f"  {100 * c / total:6.2f}% {s[:140]}")
        return
    pattern = args[1] if len(args) > 1 else ""
    total, incl = 0, collections.Counter()
    for st in samples(path):
        total += 1
        incl.update(set(st))
    for s, c in incl.most_common():
        if pattern in s:
            print(f"{100 * c / total:6.2f}% {s[:150]}")
            if c * 200 < total:  # below 0.5%
                break


if __name__ == "__main__":
    main()
