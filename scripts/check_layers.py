"""The layer rule of docs/architecture.md, checked over the library's `use` lines.

1. No import circles between source files: each file under src/ is a module (src/a/b.rs and
   src/a/b/mod.rs are crate::a::b); every `crate::...`, `super::...` and `self::...` path
   named in a file (use lines and inline paths; comments and unit tests skipped) is an edge
   to the longest module prefix that is a file. (The circle finder is the project's shared
   `check_circles.py`, copied here so that CI, which sees only this repository, runs it.)
2. Layers point down: a top-level module may use its own layer or lower ones, never a
   higher one (a submodule may always use its parent).

Prints every circle and every upward edge; exits 1 when there is any.
Usage: python3 scripts/check_layers.py [src]   (from the project root; tests/layers.rs runs it)
"""
import os, re, sys

src = sys.argv[1] if len(sys.argv) > 1 else "src"
mods = {}
for d, _, fs in os.walk(src):
    for f in fs:
        if not f.endswith(".rs"):
            continue
        p = os.path.join(d, f)
        rel = os.path.relpath(p, src)[:-3].split(os.sep)
        if rel[-1] in ("mod", "lib", "main"):
            rel = rel[:-1]
        mods[tuple(rel)] = p


def strip(text):
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    # unit tests are not part of the structure
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
    return text[: m.start()] if m else text


def expand(prefix, body):
    """`a::{b, c::{d, e}}` -> [a::b, a::c::d, a::c::e] (good enough for use trees)."""
    out, depth, cur = [], 0, ""
    for ch in body + ",":
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            item = cur.strip()
            cur = ""
            if not item:
                continue
            m = re.match(r"^([\w:]*?)::\{(.*)\}$", item, re.S)
            if m:
                out += expand(prefix + [s for s in m[1].split("::") if s], m[2])
            else:
                out.append(prefix + [s for s in item.split(" as ")[0].split("::") if s])
        else:
            cur += ch
    return out


edges = {}
for mod, path in mods.items():
    text = strip(open(path, encoding="utf-8", errors="replace").read())
    is_dir_mod = path.endswith(("mod.rs", "lib.rs", "main.rs"))
    paths = []
    for m in re.finditer(r"\buse\s+((?:crate|super|self)\b[^;]*);", text, re.S):
        u = m[1].strip()
        mm = re.match(r"^([\w:]*?)::\{(.*)\}$", u, re.S)
        paths += expand([s for s in mm[1].split("::") if s], mm[2]) if mm else [u.split(" as ")[0].split("::")]
    paths += [p.split("::") for p in re.findall(r"(?<![\w:])((?:crate|super)(?:::\w+)+)", text)]
    for p in paths:
        p = [s.strip() for s in p if s.strip()]
        if not p:
            continue
        if p[0] == "crate":
            base, rest = [], p[1:]
        elif p[0] in ("super", "self"):
            base = list(mod) if is_dir_mod else list(mod[:-1])
            rest = p[1:]
            if p[0] == "super":
                while rest and rest[0] == "super":
                    base, rest = base[:-1], rest[1:]
                base = base[:-1] if is_dir_mod else base
                base = base if not is_dir_mod else base
            elif not is_dir_mod:
                base = list(mod)
        else:
            continue
        full = base + rest
        for k in range(len(full), -1, -1):
            t = tuple(full[:k])
            if t in mods:
                if t != mod and t != ():
                    edges.setdefault(mod, set()).add(t)
                break


# The layers, top first (docs/architecture.md). A module may use its layer and those below.
LAYERS = [
    ["cli", "main"],
    ["runner", "report", "mock", "view", "verify"],
    ["stages", "import", "judge", "pipeline"],
    ["query", "cluster", "storage"],
    ["udaf", "validity", "schema", "config", "vader", "progress", "lib"],
]
RANK = {m: i for i, layer in enumerate(LAYERS) for m in layer}
upward = []
for a, bs in sorted(edges.items()):
    ta = a[0] if a else "lib"
    for b in sorted(bs):
        tb = b[0] if b else "lib"
        if ta == tb or ta not in RANK or tb not in RANK:
            continue
        if RANK[tb] < RANK[ta]:
            upward.append((a, b))
unknown = sorted({m[0] for m in mods if m and m[0] not in RANK})

# Tarjan's strongly connected components
index, low, stack, on, comps, i = {}, {}, [], set(), [], [0]
sys.setrecursionlimit(10000)


def visit(v):
    index[v] = low[v] = i[0]; i[0] += 1; stack.append(v); on.add(v)
    for w in edges.get(v, ()):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            comps.append(comp)


for v in mods:
    if v not in index:
        visit(v)
name = lambda m: os.path.relpath(mods[m], ".")
for c in comps:
    cs = set(c)
    print(f"circle of {len(c)} files: " + ", ".join(sorted(name(m) for m in c)))
    for a in sorted(c):
        for b in sorted(edges.get(a, ())):
            if b in cs:
                print(f"  {name(a)} -> {name(b)}")
for a, b in upward:
    print(f"upward: {name(a)} -> {name(b)}")
for m in unknown:
    print(f"unknown: src/{m} is in no layer of LAYERS (add it)")
print(
    f"{len(comps)} import circles, {len(upward)} upward edges among {len(mods)} source files"
)
sys.exit(1 if comps or upward or unknown else 0)
