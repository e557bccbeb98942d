"""Runs from Python: `open_run` gives the CLI's rows (local and on moto's S3), the verbs give
the CLI's tables and messages, results round-trip through pandas and polars."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import evalflow
from conftest import REPO, cli, cli_sql, tree

TABLES = ["cases", "calls", "validity", "scores", "results"]


def sorted_rows(t: pa.Table, key: list[str]) -> list[dict]:
    # Timestamps and floats compare as values; the order of rows is not part of a table.
    return sorted(t.to_pylist(), key=lambda r: tuple(str(r[k]) for k in key))


KEYS = {
    "cases": ["case_id"],
    "calls": ["call_id"],
    "validity": ["call_id"],
    "scores": ["scoring_version", "call_id"],
    "results": None,
}


def assert_tables_match_cli(ctx, root: str, tmp: Path, env=None):
    for name in TABLES:
        want = cli_sql(f"SELECT * FROM {name}", runs=[root], env=env, tmp=tmp)
        got = ctx.sql(f"SELECT * FROM {name}").to_arrow_table()
        assert got.num_rows == want.num_rows, name
        assert got.num_rows > 0, name
        assert set(got.column_names) == set(want.column_names), name
        got = got.select(want.column_names)
        key = KEYS[name] or want.column_names
        assert sorted_rows(got, key) == sorted_rows(want, key), name


def test_open_run_has_the_cli_rows(sentiment_run, tmp_path):
    ctx = evalflow.open_run(sentiment_run)
    assert_tables_match_cli(ctx, str(sentiment_run), tmp_path)
    # The functions are registered in the same context.
    row = ctx.sql(
        "SELECT clustered_mean_ci(1 - score, template_id) AS ci FROM scores "
        "WHERE role <> 'base' AND score IS NOT NULL"
    ).to_pylist()[0]["ci"]
    want = cli_sql(
        "SELECT clustered_mean_ci(1 - score, template_id) AS ci FROM scores "
        "WHERE role <> 'base' AND score IS NOT NULL",
        runs=[str(sentiment_run)],
        tmp=tmp_path,
    ).to_pylist()[0]["ci"]
    assert row["n"] == want["n"] and row["n"] > 100
    assert row["lo"] == pytest.approx(want["lo"], rel=1e-12)
    assert row["hi"] == pytest.approx(want["hi"], rel=1e-12)


def test_open_run_on_s3_has_the_cli_rows(s3_env, tmp_path, monkeypatch):
    root = "s3://evalflow-py/runs/sentiment"
    cli("run", "pipelines/sentiment.toml", "--out", root, env=s3_env)
    for k, v in s3_env.items():
        monkeypatch.setenv(k, v)
    ctx = evalflow.open_run(root)
    assert_tables_match_cli(ctx, root, tmp_path, env=s3_env)
    run = evalflow.Run(root)
    assert run.manifest["stages"]["aggregate"]["status"] == "complete"


def test_run_object_and_results_round_trips(sentiment_run, tmp_path):
    run = evalflow.Run(sentiment_run)
    m = run.manifest
    assert run.run_id == m["run_id"] and m["row_counts"]["cases"] > 0
    results = run.results()
    want = cli_sql("SELECT * FROM results", runs=[str(sentiment_run)], tmp=tmp_path)
    assert results.num_rows == want.num_rows > 0
    import pandas as pd
    import polars as pl

    frame = results.to_pandas()
    assert isinstance(frame, pd.DataFrame) and len(frame) == want.num_rows
    back = pa.Table.from_pandas(frame, preserve_index=False)
    assert back.column_names == results.column_names
    assert back.column("n").to_pylist() == results.column("n").to_pylist()
    pf = pl.from_arrow(results)
    assert pf.height == want.num_rows
    assert pf.to_arrow().column("n").to_pylist() == results.column("n").to_pylist()
    # The same through datafusion's own conversions.
    df = run.sql("SELECT test, n FROM results ORDER BY test, n")
    assert len(df.to_pandas()) == len(df.to_polars()) == want.num_rows


def test_run_verb_returns_the_run_it_made(tmp_path):
    out = tmp_path / "r"
    run = evalflow.run(REPO / "pipelines" / "sentiment.toml", out)
    assert Path(run.root) == out
    assert run.manifest["stages"]["aggregate"]["status"] == "complete"
    want = cli_sql("SELECT count(*) AS n FROM results", runs=[str(out)], tmp=tmp_path)
    assert run.results().num_rows == want.column("n")[0].as_py() > 0
    # Re-running resumes: nothing is redone, the tables keep their rows.
    before = run.manifest["row_counts"]
    again = evalflow.run(REPO / "pipelines" / "sentiment.toml", out)
    assert again.manifest["row_counts"] == before


SQL_SCORER = {
    "name": "says_positive",
    "kind": "sql",
    "metric": "pass_fail",
    "passed": "regexp_like(response, '(?i)positive')",
}


def test_rescore_with_a_dict_gives_the_cli_scores(sentiment_run, tmp_path):
    py_root, cli_root = tmp_path / "py", tmp_path / "cli"
    shutil.copytree(sentiment_run, py_root)
    shutil.copytree(sentiment_run, cli_root)
    evalflow.rescore(py_root, SQL_SCORER)
    scorer_file = tmp_path / "says_positive.toml"
    scorer_file.write_text(
        textwrap.dedent(
            """\
            [[scorer]]
            name = "says_positive"
            kind = "sql"
            metric = "pass_fail"
            passed = "regexp_like(response, '(?i)positive')"
            """
        )
    )
    cli("rescore", cli_root, "--scorer-file", scorer_file)
    q = (
        "SELECT call_id, scoring_version, validity, score, passed FROM scores "
        "WHERE scorer = 'says_positive' ORDER BY call_id"
    )
    got = evalflow.open_run(py_root).sql(q).to_arrow_table()
    want = cli_sql(q, runs=[str(cli_root)], tmp=tmp_path)
    assert got.num_rows == want.num_rows > 0
    assert got.to_pylist() == want.to_pylist()
    assert got.column("passed").to_pylist().count(True) > 0


def test_bad_scorer_raises_the_cli_message_and_writes_nothing(sentiment_run, tmp_path):
    root = tmp_path / "bad"
    shutil.copytree(sentiment_run, root)
    before = tree(root)
    bad = {**SQL_SCORER, "passed": "regexp_like(respons, 'x')"}
    with pytest.raises(evalflow.BadInputError) as e:
        evalflow.rescore(root, bad)
    assert e.value.exit_code == 2
    assert tree(root) == before
    # The CLI on the same definition, in a file of the same name: the same message.
    d = tmp_path / "defs"
    d.mkdir()
    f = d / "says_positive.toml"
    f.write_text(evalflow._native.scorer_toml(__import__("json").dumps({"scorer": [bad]})))
    p = cli("rescore", root, "--scorer-file", f, check=False)
    assert p.returncode == 2
    cli_msg = p.stderr.strip().removeprefix("error: ").replace(str(f), "FILE")
    py_msg = str(e.value)
    py_msg = py_msg.replace(py_msg.split(":")[0], "FILE", 1) if py_msg.startswith("/") else py_msg
    assert "respons" in py_msg and "says_positive.toml" in str(e.value)
    assert py_msg == cli_msg
    assert tree(root) == before


def test_errors_say_bad_input_versus_failed_stage(tmp_path):
    with pytest.raises(evalflow.BadInputError, match="no such run root|not an evalflow run|nope"):
        evalflow.open_run(tmp_path / "nope")
    with pytest.raises(evalflow.BadInputError) as e:
        evalflow.validate(tmp_path / "missing.toml", tmp_path / "out")
    assert "missing.toml" in str(e.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(evalflow.BadInputError, match="unexpected argument|--nope"):
        evalflow.cli(["sql", "SELECT 1", "--nope"])


def _tolerance_pipeline(tmp_path: Path, tolerance: float) -> Path:
    d = tmp_path / f"pipelines-{tolerance}"
    shutil.copytree(REPO / "pipelines", d)
    p = d / "sentiment.toml"
    p.write_text(p.read_text().replace("tolerance = 0.1 ", f"tolerance = {tolerance} ", 1))
    return p


def test_compare_gives_the_cli_table_and_verdict(sentiment_run, tmp_path):
    b = tmp_path / "b"
    cli("run", _tolerance_pipeline(tmp_path, 0.02), "--out", b)
    c = evalflow.compare(sentiment_run, b)
    out = tmp_path / "cmp.json"
    cli("compare", sentiment_run, b, "--format", "json", "--output", out)
    import json

    want = json.loads(out.read_text())
    assert c.table.num_rows == len(want) > 0
    # Two processes may sum the same rows in another order: floats agree to 1e-12.
    key = lambda r: (str(r.get("level")), str(r.get("capability")), str(r.get("test")))
    got_rows = sorted(c.table.to_pylist(), key=key)
    want_rows = sorted(pa.Table.from_pylist(want).to_pylist(), key=key)
    for g, w in zip(got_rows, want_rows):
        assert g.keys() == w.keys()
        for k in g:
            if isinstance(g[k], float) and isinstance(w[k], float):
                assert g[k] == pytest.approx(w[k], rel=1e-12, abs=1e-15), (k, g, w)
            else:
                assert g[k] == w[k], (k, g, w)
    overall = [r for r in want if str(r.get("level")).lower() == "overall"]
    assert len(overall) == 1 and c.verdict == overall[0]["verdict"] != ""
    # The gate: exit 1 on the CLI is passed=False here, with the same verdict, with or
    # without require_improvement=True.
    gated = evalflow.compare(sentiment_run, b, require_improvement=True)
    p = cli("compare", sentiment_run, b, "--require-improvement", check=False)
    assert gated.passed == (p.returncode == 0) == c.passed == (c.verdict == "B better")
    assert gated.verdict == c.verdict


def test_compare_passed_is_the_gates_exit_code_with_or_without_require_improvement(sentiment_run):
    """Issue 61, item 6: `passed` is `compare --require-improvement`'s exit code (0 only when
    B is significantly better), not `compare`'s, which is 0 whatever the verdict: a run
    compared with itself is no improvement, so it must not pass."""
    plain = cli("compare", sentiment_run, sentiment_run, check=False)
    gate = cli("compare", sentiment_run, sentiment_run, "--require-improvement", check=False)
    assert (plain.returncode, gate.returncode) == (0, 1)
    assert "overall: no difference (identical on every paired case)" in plain.stdout
    same = evalflow.compare(sentiment_run, sentiment_run)
    assert same.verdict == "no difference (identical on every paired case)"
    assert same.passed is False
    assert "--require-improvement: B is not significantly better than A (no difference" in same.message
    gated = evalflow.compare(sentiment_run, sentiment_run, require_improvement=True)
    assert (gated.passed, gated.verdict, gated.message) == (False, same.verdict, same.message)


def test_the_command_is_installed():
    exe = shutil.which("evalflow")
    assert exe is not None
    p = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("evalflow ")
    p = subprocess.run([exe, "sql", "SELEC 1"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("error: SQL")
    p = subprocess.run([exe, "sql", "SELECT sample_size(0.1, 0.25) AS n", "--format", "csv"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.split() == ["n", "197"]


def test_another_datafusion_major_is_refused_not_a_crash(tmp_path):
    other = os.environ.get("EVALFLOW_OTHER_DATAFUSION")
    if not other:
        other = str(tmp_path / "df54")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", other, "datafusion==54.1.0"],
            check=True,
        )
    code = textwrap.dedent(
        """
        import datafusion, evalflow
        assert datafusion.__version__.startswith("54."), datafusion.__version__
        try:
            evalflow.register(datafusion.SessionContext())
        except evalflow.DataFusionVersionError as e:
            print("REFUSED:", e)
        else:
            print("REGISTERED")
        """
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": other},
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("REFUSED:"), p.stdout
    assert "DataFusion 55" in p.stdout and "54.1.0" in p.stdout


def corpus_of(tmp_path: Path, n: int) -> Path:
    """A recorded corpus of `n` OpenAI pairs from the corpus bench's generator."""
    corpus = tmp_path / "corpus.jsonl"
    gen = REPO / "benches" / "corpus" / "gen_corpus.py"
    subprocess.run([sys.executable, str(gen), str(n), corpus, "--jobs", "2"], check=True)
    return corpus


INTERRUPT = textwrap.dedent(
    """
    import os, signal, sys, threading, time, evalflow
    pipeline, out = sys.argv[1], sys.argv[2]
    started = time.monotonic()
    threading.Timer(float(sys.argv[3]), lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        evalflow.validate(pipeline, out)
    except KeyboardInterrupt:
        print("INTERRUPTED after %.1f s" % (time.monotonic() - started))
    else:
        print("FINISHED after %.1f s" % (time.monotonic() - started))
    """
)


def test_keyboard_interrupt_during_validate_leaves_a_resumable_run(tmp_path):
    corpus = corpus_of(tmp_path, 200000)
    root = tmp_path / "run"
    cli("import", corpus, "--out", root)
    pipeline = root / "import.toml"
    p = subprocess.run(
        [sys.executable, "-c", INTERRUPT, pipeline, root, "1.0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.stdout.startswith("INTERRUPTED"), (p.stdout, p.stderr[-2000:])
    run = evalflow.Run(root)
    assert run.manifest["stages"]["validate"]["status"] != "complete"
    evalflow.validate(pipeline, root)
    run.refresh()
    assert run.manifest["stages"]["validate"]["status"] == "complete"
    counts = evalflow.open_run(root).sql(
        "SELECT (SELECT count(*) FROM calls) AS calls, count(*) AS n, count(DISTINCT call_id) AS ids FROM validity"
    ).to_pylist()[0]
    assert counts["calls"] == counts["n"] == counts["ids"] == 200000


INTERRUPT_IMPORT = textwrap.dedent(
    """
    import os, signal, sys, threading, evalflow
    threading.Timer(float(sys.argv[3]), lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        evalflow.import_(sys.argv[1], sys.argv[2])
    except KeyboardInterrupt:
        print("INTERRUPTED")
    else:
        print("FINISHED")
    print("ALIVE")
    """
)


def test_keyboard_interrupt_during_import_leaves_nothing_and_the_interpreter_alive(tmp_path):
    corpus = corpus_of(tmp_path, 300000)
    root = tmp_path / "imported"
    p = subprocess.run(
        [sys.executable, "-c", INTERRUPT_IMPORT, corpus, root, "0.5"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.stdout.split() == ["INTERRUPTED", "ALIVE"], (p.stdout, p.stderr[-2000:])
    # Nothing the import wrote is left (an empty root folder may be: see the closing note of
    # session 20, a Ctrl-C before the import watches for it drops it before its clean-up).
    assert not root.exists() or not any(root.rglob("*")), sorted(str(x) for x in root.rglob("*"))


def test_view_serves_the_run_from_this_process_and_stops(sentiment_run, tmp_path):
    import json
    import urllib.error
    import urllib.request

    viewer = evalflow.view(sentiment_run)
    try:
        assert viewer.url.startswith("http://127.0.0.1:")
        runs = json.load(urllib.request.urlopen(viewer.url + "/api/runs", timeout=10))
        assert len(runs) == 1
        calls = cli_sql("SELECT count(*) AS n FROM calls", runs=[str(sentiment_run)], tmp=tmp_path)
        assert runs[0]["answers"] == calls.to_pylist()[0]["n"] > 100
        run_id = runs[0]["run_id"]
        page = json.load(
            urllib.request.urlopen(f"{viewer.url}/api/runs/{run_id}/answers?limit=7", timeout=10)
        )
        assert len(page["rows"]) == 7 and page["next"]
        html = urllib.request.urlopen(viewer.url + "/", timeout=10).read().decode()
        assert "/assets/app.js" in html
    finally:
        assert viewer.stop()
    assert not viewer.stop()
    # Off loopback without a token it is refused, as the CLI refuses it.
    with pytest.raises(evalflow.BadInputError, match="--token"):
        evalflow.view(sentiment_run, addr="0.0.0.0:0")
