"""Every evalflow SQL function, registered into a plain `datafusion.SessionContext` through
`evalflow.register`, gives what `evalflow sql` gives on the same Parquet file (written by
pyarrow, with NULLs and NaNs), grouped and ungrouped, to 1e-12; and the headline formulas
equal hand computations."""

from __future__ import annotations

import math
import re
from pathlib import Path

import datafusion
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import evalflow
from conftest import REPO, cli_sql

N = 3000


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    rng = np.random.default_rng(2026)
    tpl = rng.integers(0, 40, N)
    x = rng.normal(0.6, 0.3, N) + tpl * 0.005
    x[rng.random(N) < 0.05] = np.nan
    xs = pa.array([None if i % 97 == 0 else v for i, v in enumerate(x)], pa.float64())
    y = pa.array(rng.normal(0.5, 0.3, N) + tpl * 0.004)
    p = (rng.random(N) < 0.15 + tpl * 0.005).astype(float)
    q = (rng.random(N) < 0.25).astype(float)
    statuses = [200] * (N - 30) + [429] * 20 + [500] * 10
    rng.shuffle(statuses)
    texts = ["The food was great.", "", "不建议强行上付费版", "Es muy bueno, gracias.", None]
    table = pa.table(
        {
            "g": pa.array([f"model-{i % 3}" for i in range(N)]),
            "x": xs,
            "y": y,
            "p": pa.array([None if i % 211 == 0 else v for i, v in enumerate(p)], pa.float64()),
            "q": pa.array(q),
            "c_str": pa.array([f"tpl-{t}" for t in tpl]),
            "c_int": pa.array(tpl.astype(np.int64)),
            "case_id": pa.array([f"case-{i // 3}" for i in range(N)]),
            "pred": pa.array(rng.random(N) < 0.4),
            "truth": pa.array([None if i % 50 == 0 else bool(v) for i, v in enumerate(rng.random(N) < 0.35)]),
            "resp": pa.array([texts[i % len(texts)] for i in range(N)]),
            "fr": pa.array(["stop" if i % 7 else "length" for i in range(N)]),
            "status": pa.array(statuses, pa.int32()),
            "k": pa.array(rng.integers(10, 500, N).astype(np.int64)),
            "v": pa.array(rng.random(N) * 0.3 + 0.01),
        }
    )
    path = tmp_path_factory.mktemp("fn") / "t.parquet"
    pq.write_table(table, path, row_group_size=1000)
    return path


@pytest.fixture(scope="module")
def ctx(data_file):
    c = datafusion.SessionContext()
    evalflow.register(c)
    c.register_parquet("t", str(data_file))
    return c


AGGREGATES = {
    "mean_se": "mean_se(x)",
    "clustered_se_str": "clustered_se(x, c_str)",
    "clustered_se_int": "clustered_se(x, c_int)",
    "clustered_se_cr1": "clustered_se_cr1(x, c_str)",
    "clustered_se_cr2": "clustered_se_cr2(x, c_int)",
    "mean_ci": "mean_ci(x)",
    "mean_ci_90": "mean_ci(x, 0.9)",
    "clustered_mean_ci_auto": "clustered_mean_ci(x, c_str)",
    "clustered_mean_ci_pass_fail": "clustered_mean_ci(p, c_str)",
    **{
        f"clustered_mean_ci_{m}": f"clustered_mean_ci(p, c_str, 0.95, '{m}')"
        for m in ["miller", "cr1_t", "cr2", "cr2_wilson", "cr2_score", "cr2_ri"]
    },
    "clustered_mean_ci_wild_bootstrap": "clustered_mean_ci(x, c_str, 0.95, 'wild_bootstrap', 199, 7)",
    "paired_diff": "paired_diff(x, y)",
    "paired_diff_clustered": "paired_diff_clustered(x, y, c_str)",
    "paired_diff_clustered_binary": "paired_diff_clustered(p, q, c_int)",
    "clustered_mean_ci_logit_normal": "clustered_mean_ci(p, c_str, 0.95, 'logit_normal')",
    "clustered_mean_ci_stated_icc": "clustered_mean_ci(p, c_str, 0.95, 'auto; icc=0.3')",
    "variance_components": "variance_components(x, case_id)",
    "logit_normal_icc": "logit_normal_icc(p, c_str)",
    "confusion": "confusion(pred, truth)",
    "conformal_quantile": "conformal_quantile(x, 0.1)",
    "self_consistency": "self_consistency(p)",
}

SCALARS = {
    "sample_size": "sample_size(0.05, v)",
    "sample_size_alpha_power": "sample_size(0.05, v, 0.01, 0.9)",
    "mde": "mde(k, v)",
    "rogan_gladen": "rogan_gladen(v, 0.9, 0.95)",
    "rogan_gladen_ci": "rogan_gladen_ci(k, k + 100, 80, 20, 90, 10)",
    "validity_verdict": "validity_verdict(resp, fr, status, NULL, NULL, NULL, 512, 'en')",
}


def flat(t: pa.Table) -> pa.Table:
    """Struct columns as `col.field` columns."""
    while any(pa.types.is_struct(f.type) for f in t.schema):
        t = t.flatten()
    return t


def assert_same(got: pa.Table, want: pa.Table, what: str):
    got, want = flat(got), flat(want)
    assert got.column_names == want.column_names, what
    assert got.num_rows == want.num_rows, what
    for name in got.column_names:
        a, b = got.column(name).to_pylist(), want.column(name).to_pylist()
        for i, (u, v) in enumerate(zip(a, b)):
            if isinstance(u, float) or isinstance(v, float):
                assert (u is None) == (v is None), f"{what} {name}[{i}]: {u} vs {v}"
                if u is None or (math.isnan(u) and math.isnan(v)):
                    continue
                if math.isinf(u) or math.isinf(v):
                    assert u == v, f"{what} {name}[{i}]: {u} vs {v}"
                    continue
                assert abs(u - v) <= 1e-12 * max(1.0, abs(u), abs(v)), f"{what} {name}[{i}]: {u} vs {v}"
            else:
                assert u == v, f"{what} {name}[{i}]: {u!r} vs {v!r}"


def test_every_function_of_the_reference_is_registered():
    documented = re.findall(r"^## (\w+)$", (REPO / "docs" / "functions.md").read_text(), re.M)
    assert sorted(evalflow.functions()) == sorted(documented)
    assert len(documented) == 18


@pytest.mark.parametrize("name", sorted(AGGREGATES))
@pytest.mark.parametrize("grouped", [False, True], ids=["ungrouped", "grouped"])
def test_aggregate_equals_evalflow_sql(name, grouped, ctx, data_file, tmp_path):
    expr = AGGREGATES[name]
    if grouped:
        query = f"SELECT g, {expr} AS v FROM t GROUP BY g ORDER BY g"
    else:
        query = f"SELECT {expr} AS v FROM t"
    got = ctx.sql(query).to_arrow_table()
    want = cli_sql(query, tables=[f"t={data_file}"], tmp=tmp_path)
    assert got.num_rows == (3 if grouped else 1)
    assert_same(got, want, query)


@pytest.mark.parametrize("name", sorted(SCALARS))
def test_scalar_equals_evalflow_sql(name, ctx, data_file, tmp_path):
    query = f"SELECT c_int, {SCALARS[name]} AS v FROM t ORDER BY case_id, c_int, g"
    got = ctx.sql(query).to_arrow_table()
    want = cli_sql(query, tables=[f"t={data_file}"], tmp=tmp_path)
    assert got.num_rows == N
    assert_same(got, want, query)


def test_headline_formulas_equal_hand_computation(ctx, data_file):
    """mean_se, Miller's clustered SE, CR1 and the paired difference from numpy."""
    t = pq.read_table(data_file).to_pandas()
    sub = t[t.x.notna() & ~np.isnan(t.x.astype(float))]
    x = sub.x.to_numpy(float)
    n = len(x)
    mean = x.mean()
    se = math.sqrt(x.var(ddof=1) / n)
    miller = se**2
    cr1 = 0.0
    groups = sub.groupby("c_str").x
    for _, xs in groups:
        r = xs.to_numpy(float) - mean
        miller += (r.sum() ** 2 - (r**2).sum()) / n**2
        cr1 += r.sum() ** 2
    g = groups.ngroups
    cr1 = math.sqrt(g / (g - 1) * cr1) / n
    row = ctx.sql(
        "SELECT mean_se(x) AS a, clustered_se(x, c_str) AS b, clustered_se_cr1(x, c_str) AS c, "
        "paired_diff(x, y) AS d FROM t"
    ).to_pylist()[0]
    assert row["a"] == pytest.approx(se, rel=1e-12)
    assert row["b"] == pytest.approx(math.sqrt(miller), rel=1e-12)
    assert row["c"] == pytest.approx(cr1, rel=1e-12)
    d = (sub.x - sub.y).to_numpy(float)
    assert row["d"]["n"] == len(d)
    assert row["d"]["mean_diff"] == pytest.approx(d.mean(), rel=1e-12)
    assert row["d"]["se"] == pytest.approx(math.sqrt(d.var(ddof=1) / len(d)), rel=1e-12)


def test_functions_run_in_a_datafusion_dataframe(ctx):
    """The registered functions are usable from the DataFrame API too, not only SQL."""
    f = datafusion.udaf(next(a for a in evalflow._native.aggregates() if a.name == "clustered_se"))
    df = ctx.table("t").aggregate([datafusion.col("g")], [f(datafusion.col("x"), datafusion.col("c_str")).alias("se")])
    got = {r["g"]: r["se"] for r in df.to_pylist()}
    want = {r["g"]: r["se"] for r in ctx.sql("SELECT g, clustered_se(x, c_str) AS se FROM t GROUP BY g").to_pylist()}
    assert got.keys() == {"model-0", "model-1", "model-2"}
    for k in got:
        assert got[k] == pytest.approx(want[k], rel=1e-12)


def test_every_public_function_has_a_typed_docstring_in_the_stubs():
    """The .pyi stubs a notebook completes from: every name of `__all__` is there, documented."""
    import ast

    stub = ast.parse((Path(evalflow.__file__).with_suffix(".pyi")).read_text())
    documented = {
        n.name
        for n in stub.body
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(n)
    }
    missing = [name for name in evalflow.__all__ if name not in documented]
    assert missing == []
    for cls in (n for n in stub.body if isinstance(n, ast.ClassDef) and n.name in ("Run", "Comparison")):
        for f in cls.body:
            if isinstance(f, ast.FunctionDef) and not f.name.startswith("_"):
                assert ast.get_docstring(f), f"{cls.name}.{f.name}"
