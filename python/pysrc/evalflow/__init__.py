"""evalflow from Python: the statistics in any DataFusion session, runs as DataFrames.

- ``register(ctx)`` puts every evalflow SQL function (``clustered_mean_ci``,
  ``paired_diff_clustered``, ``rogan_gladen_ci``, ``validity_verdict``, ...) into a
  ``datafusion.SessionContext``; the functions run in Rust, in the user's own session.
- ``open_run(root)`` gives a context with a run's tables (``cases``, ``calls``, ``validity``,
  ``scores`` with every scorer version, ``results``) and the functions registered, for a
  local path or ``s3://bucket/prefix`` (credentials from the ``AWS_*`` environment, as the
  CLI reads them).
- The verbs are functions (``run``, ``import_``, ``validate``, ``score``, ``aggregate``,
  ``rescore``, ``compare``, ``report``): each runs the CLI's own code in this process, with
  its messages and progress bars, and returns a :class:`Run` (or a :class:`Comparison`).
  Errors raise :class:`BadInputError` (exit code 2: the message names the file, line and
  field) or :class:`StageError` (a stage failed); Ctrl-C raises ``KeyboardInterrupt`` with
  the run left resumable.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from . import _native

__all__ = [
    "register",
    "functions",
    "open_run",
    "Run",
    "Comparison",
    "run",
    "import_",
    "generate",
    "call",
    "validate",
    "score",
    "aggregate",
    "rescore",
    "compare",
    "report",
    "view",
    "Viewer",
    "cli",
    "EvalflowError",
    "BadInputError",
    "StageError",
    "GateFailed",
    "DataFusionVersionError",
]

__version__ = _native.__evalflow_version__

EXIT_GATE = 1
EXIT_BAD_INPUT = 2


class EvalflowError(Exception):
    """An evalflow command failed; ``exit_code`` is what the CLI would exit with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class BadInputError(EvalflowError, ValueError):
    """Bad input or usage (exit code 2): the message names the file, line and field."""


class StageError(EvalflowError, RuntimeError):
    """A stage or an I/O operation failed (exit code 3 or more)."""


class GateFailed(EvalflowError):
    """A quality gate failed (exit code 1): invalid-rate drift, a holdout regression."""


class DataFusionVersionError(ImportError):
    """The installed ``datafusion`` package is of another major than evalflow's build."""


def _raise_for(code: int, message: str) -> None:
    if code == 0:
        return
    if code == EXIT_BAD_INPUT:
        raise BadInputError(message, code)
    if code == EXIT_GATE:
        raise GateFailed(message, code)
    raise StageError(message, code)


def _datafusion():
    """The ``datafusion`` module, refused when its major differs from this build's: a
    mismatched FFI would crash the interpreter at the first call instead."""
    major, ffi_major = _native.datafusion_major()
    try:
        import datafusion
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise DataFusionVersionError(
            f"evalflow needs the `datafusion` Python package {major}.x "
            f"(pip install 'datafusion>={major},<{major + 1}'): {e}"
        ) from e
    version = getattr(datafusion, "__version__", "unknown")
    try:
        got = int(str(version).split(".")[0])
    except ValueError:
        got = -1
    if got != major or got != ffi_major:
        raise DataFusionVersionError(
            f"evalflow was built against DataFusion {major} (datafusion-ffi {ffi_major}), "
            f"but the installed `datafusion` Python package is {version}: its functions "
            f"cannot cross between majors. Install a matching one: "
            f"pip install 'datafusion>={major},<{major + 1}'"
        )
    return datafusion


def functions() -> list[str]:
    """The SQL names of every function :func:`register` adds."""
    return [f.name for f in _native.aggregates()] + [f.name for f in _native.scalars()]


def register(ctx):
    """Register every evalflow SQL function into ``ctx`` (a ``datafusion.SessionContext``).

    The aggregates (``mean_se``, ``clustered_se``, ``clustered_se_cr1``,
    ``clustered_se_cr2``, ``mean_ci``, ``clustered_mean_ci``, ``paired_diff``,
    ``paired_diff_clustered``, ``variance_components``, ``confusion``,
    ``conformal_quantile``, ``self_consistency``) and the scalars (``sample_size``, ``mde``,
    ``rogan_gladen``, ``rogan_gladen_ci``, ``validity_verdict``) run in evalflow's Rust code
    through ``datafusion-ffi``. Returns ``ctx``.

    Raises :class:`DataFusionVersionError` when the ``datafusion`` package is of another
    major version than evalflow's build.
    """
    df = _datafusion()
    for f in _native.aggregates():
        ctx.register_udaf(df.udaf(f))
    for f in _native.scalars():
        ctx.register_udf(df.udf(f))
    return ctx


def _local_path(url: str) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        return urllib.request.url2pathname(parsed.path)
    return url


def _register_store(ctx, url: str, done: set) -> None:
    """Registers the object store of an ``s3://`` URL with the CLI's environment."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme in ("", "file"):
        return
    key = (parsed.scheme, parsed.netloc)
    if key in done:
        return
    done.add(key)
    if parsed.scheme != "s3":
        raise BadInputError(
            f"{url}: open_run reads local and s3:// runs (this scheme is not supported from Python)",
            EXIT_BAD_INPUT,
        )
    from datafusion.object_store import AmazonS3

    env = os.environ
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or env.get("AWS_ENDPOINT")
    allow_http = env.get("AWS_ALLOW_HTTP", "").lower() == "true" or (
        endpoint is not None and endpoint.startswith("http://")
    )
    store = AmazonS3(
        bucket_name=parsed.netloc,
        region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
        access_key_id=env.get("AWS_ACCESS_KEY_ID"),
        secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
        session_token=env.get("AWS_SESSION_TOKEN"),
        endpoint=endpoint,
        allow_http=allow_http,
    )
    ctx.register_object_store("s3://", store, parsed.netloc)


def open_run(root: str | os.PathLike, ctx=None):
    """A ``datafusion.SessionContext`` with the run's tables and every function registered.

    ``root`` is a run root: a local path or ``s3://bucket/prefix``. The tables are those of
    ``evalflow sql --run ROOT``: ``cases``, ``calls``, ``validity``, ``scores`` (every scorer
    version; filter on ``scoring_version``) and ``results``; each part is checked against its
    declared schema first. Pass ``ctx`` to add them to a session of your own.
    Any query's result converts as ``datafusion`` offers: ``.to_pandas()``,
    ``.to_polars()``, ``.to_arrow_table()``.
    """
    import pyarrow as pa

    root = os.fspath(root)
    code, message, got = _native.layout(root)
    _raise_for(code, message)
    df = _datafusion()
    if ctx is None:
        ctx = df.SessionContext()
    register(ctx)
    stores: set = set()
    for name, urls, schema_ipc in got:
        schema = pa.ipc.open_stream(pa.py_buffer(schema_ipc)).schema
        if not urls:
            ctx.register_record_batches(name, [[pa.RecordBatch.from_pylist([], schema=schema)]])
            continue
        for u in urls:
            _register_store(ctx, u, stores)
        if len(urls) == 1:
            ctx.register_listing_table(
                name, _local_path(urls[0]), file_extension=".parquet", schema=schema
            )
            continue
        # `scores` keeps one folder per scorer version: one table over all of them.
        frame = None
        for u in urls:
            part = ctx.read_parquet(_local_path(u), file_extension=".parquet", schema=schema)
            frame = part if frame is None else frame.union(part)
        ctx.register_view(name, frame)
    return ctx


class Run:
    """A run root: where a verb wrote, with its manifest and tables."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.fspath(root)
        self._manifest: dict | None = None

    @property
    def manifest(self) -> dict:
        """``manifest.json`` as a dict (run id, pipeline, per-stage status, row counts)."""
        if self._manifest is None:
            code, message, text = _native.manifest(self.root)
            _raise_for(code, message)
            self._manifest = json.loads(text)
        return self._manifest

    @property
    def run_id(self) -> str:
        """The run id of the manifest."""
        return self.manifest["run_id"]

    def context(self):
        """A ``datafusion.SessionContext`` over this run (see :func:`open_run`)."""
        return open_run(self.root)

    def sql(self, query: str):
        """Runs ``query`` over this run's tables; a ``datafusion.DataFrame``."""
        return self.context().sql(query)

    def results(self):
        """The ``results`` table as a ``pyarrow.Table``."""
        return self.sql("SELECT * FROM results").to_arrow_table()

    def refresh(self) -> "Run":
        """Forgets the cached manifest (after another verb wrote the run)."""
        self._manifest = None
        return self

    def __repr__(self) -> str:
        try:
            rid = self.run_id
        except EvalflowError:
            rid = "?"
        return f"Run(root={self.root!r}, run_id={rid!r})"


class Comparison:
    """A paired comparison of two runs (or two models of one run): its rows and verdict."""

    def __init__(self, table, verdict: str, passed: bool, message: str) -> None:
        #: the comparison as a ``pyarrow.Table`` (one row per test, capability and overall)
        self.table = table
        #: the overall verdict, as the CLI prints it
        self.verdict = verdict
        #: whether B may ship: True exactly when ``evalflow compare A B --require-improvement``
        #: exits 0 (B significantly better than A overall), whether or not the gate was asked
        self.passed = passed
        #: the gate's message when it failed (the CLI's exit code 1 message), else ""
        self.message = message

    def to_pandas(self):
        """The rows as a pandas DataFrame."""
        return self.table.to_pandas()

    def __repr__(self) -> str:
        return f"Comparison(verdict={self.verdict!r}, rows={self.table.num_rows}, passed={self.passed})"


def _flags(options: Mapping[str, Any]) -> list[str]:
    """CLI flags from keyword arguments: ``memory_limit="512MB"`` is ``--memory-limit 512MB``,
    ``True`` a bare flag, ``None``/``False`` nothing, a list one flag per item."""
    out: list[str] = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + key.rstrip("_").replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                out += [flag, os.fspath(v) if isinstance(v, os.PathLike) else str(v)]
        else:
            out += [flag, os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
    return out


def cli(args: Sequence[str | os.PathLike]) -> None:
    """Runs any evalflow command in this process (``cli(["check", "runs/x"])``).

    Raises :class:`BadInputError`, :class:`GateFailed` or :class:`StageError` with the CLI's
    message when it would exit non-zero.
    """
    _invoke([os.fspath(a) for a in args])


def _invoke(argv: list[str]) -> str | None:
    code, message, root = _native.invoke(argv)
    _raise_for(code, message)
    return root


def _stage(verb: str, pipeline, out, options) -> Run:
    argv = [verb, os.fspath(pipeline)]
    if out is not None:
        argv += ["--out", os.fspath(out)]
    root = _invoke(argv + _flags(options))
    return Run(out if out is not None else root)


def run(pipeline: str | os.PathLike, out: str | os.PathLike | None = None, **options) -> Run:
    """Runs all five stages of ``pipeline`` (``evalflow run``) into ``out`` (default
    ``runs/<run_id>``); a re-run on the same root resumes. Returns the :class:`Run`."""
    return _stage("run", pipeline, out, options)


def generate(pipeline: str | os.PathLike, out: str | os.PathLike, **options) -> Run:
    """The generate stage alone (``evalflow generate PIPELINE --out OUT``)."""
    return _stage("generate", pipeline, out, options)


def call(pipeline: str | os.PathLike, out: str | os.PathLike, **options) -> Run:
    """The call stage alone (``evalflow call PIPELINE --out OUT``); resumes without re-paying.
    ``retry_errors=True`` sends the calls that ended as provider errors again, in place."""
    return _stage("call", pipeline, out, options)


def validate(pipeline: str | os.PathLike, out: str | os.PathLike, **options) -> Run:
    """The validate stage alone (``evalflow validate PIPELINE --out OUT``)."""
    return _stage("validate", pipeline, out, options)


def score(pipeline: str | os.PathLike, out: str | os.PathLike, **options) -> Run:
    """The score stage alone, every scorer of ``[score] scorers``."""
    return _stage("score", pipeline, out, options)


def aggregate(pipeline: str | os.PathLike, out: str | os.PathLike, **options) -> Run:
    """The aggregate stage alone; ``Run.results()`` then reads what it wrote."""
    return _stage("aggregate", pipeline, out, options)


def import_(
    files: str | os.PathLike | Iterable[str | os.PathLike],
    out: str | os.PathLike,
    *,
    format: str | None = None,
    cluster: str | None = None,
    model: str | None = None,
    **options,
) -> Run:
    """Imports recorded runs (evalflow JSONL pairs, Parquet, OpenAI Batch output, Inspect AI
    logs, lm-eval samples, promptfoo results) into ``out`` (``evalflow import``)."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    argv = ["import", *[os.fspath(f) for f in files], "--out", os.fspath(out)]
    argv += _flags({"format": format, "cluster": cluster, "model": model, **options})
    _invoke(argv)
    return Run(out)


def rescore(
    run: str | os.PathLike | Run,
    scorer: str | Mapping[str, Any] | None = None,
    *,
    scorer_file: str | os.PathLike | None = None,
    **options,
) -> Run:
    """Re-scores a run's archived calls under a new scorer version, with no model call.

    ``scorer`` is a built-in name (``"cue"``, ``"checklist@2"``), or a scorer definition as a
    dict (the keys of one ``[[scorer]]`` table: ``{"name": ..., "kind": "sql", ...}``, or
    ``{"scorer": [...]}`` for several); ``scorer_file`` is a TOML scorer file (then
    ``scorer`` may name one of its scorers).
    """
    root = run.root if isinstance(run, Run) else os.fspath(run)
    argv = ["rescore", root]
    if isinstance(scorer, Mapping):
        if scorer_file is not None:
            raise BadInputError(
                "rescore: give a scorer definition or a scorer_file, not both", EXIT_BAD_INPUT
            )
        definition = dict(scorer)
        if "scorer" not in definition:
            definition = {"scorer": [definition]}
        text = _native.scorer_toml(json.dumps(definition))
        names = [s.get("name", "scorer") for s in definition["scorer"]]
        with tempfile.TemporaryDirectory(prefix="evalflow-scorer-") as d:
            path = Path(d) / f"{names[0]}.toml"
            path.write_text(text)
            _invoke(argv + ["--scorer-file", str(path)] + _flags(options))
        return Run(root)
    if scorer is not None:
        argv += ["--scorer", scorer]
    if scorer_file is not None:
        argv += ["--scorer-file", os.fspath(scorer_file)]
    _invoke(argv + _flags(options))
    return Run(root)


def compare(
    run_a: str | os.PathLike | Run,
    run_b: str | os.PathLike | Run | None = None,
    *,
    scorer: str | None = None,
    require_improvement: bool = False,
    **options,
) -> Comparison:
    """The paired, template-clustered difference B - A per test, capability and overall
    (``evalflow compare``), as a :class:`Comparison` (a pyarrow table and the verdict).

    ``passed`` is the gate of ``evalflow compare --require-improvement``: True exactly when
    that command exits 0 (B significantly better than A overall, the verdict ``B better``),
    False where it exits 1 (A better, no difference, could not tell), with its message in
    ``message``. It is the same with or without ``require_improvement=True``: a failed gate
    is ``passed=False``, never an exception. Two models of one run:
    ``compare(run, model_a="a", model_b="b")``.
    """
    import pyarrow as pa

    def root_of(r):
        return r.root if isinstance(r, Run) else os.fspath(r)

    argv = ["compare", root_of(run_a)]
    if run_b is not None:
        argv.append(root_of(run_b))
    with tempfile.TemporaryDirectory(prefix="evalflow-compare-") as d:
        out = Path(d) / "compare.json"
        argv += _flags(
            {
                "scorer": scorer,
                # Always asked: `passed` is the gate's exit code (a `compare` without it
                # exits 0 whatever the verdict, so its code says nothing about B).
                "require_improvement": True,
                "format": "json",
                "output": out,
                **options,
            }
        )
        code, message, _ = _native.invoke(argv)
        if code not in (0, EXIT_GATE) or (code == EXIT_GATE and not out.exists()):
            _raise_for(code, message)
        rows = json.loads(out.read_text())
    table = pa.Table.from_pylist(rows)
    verdict = ""
    for r in rows:
        if str(r.get("level", "")).lower() == "overall":
            verdict = str(r.get("verdict", ""))
    return Comparison(table, verdict, code == 0, message)


def report(run: str | os.PathLike | Run, *, html: str | os.PathLike | None = None, **options) -> Run:
    """Prints the run's results and writes its HTML page (``evalflow report``; default
    ``<run>/report.html``). Options: ``compare=RUN_B``, ``holdout=LABELS_CSV``,
    ``baseline=FILE``."""
    root = run.root if isinstance(run, Run) else os.fspath(run)
    _invoke(["report", root] + _flags({"html": html, **options}))
    return Run(root)


class Viewer:
    """A running ``evalflow view`` server in this process: ``url`` to open, ``stop()`` to end."""

    def __init__(self, url: str, root: str):
        self.url = url
        self.root = root

    def stop(self) -> bool:
        """Stops serving; True when it was running."""
        return _native.view_stop(self.url)

    def __repr__(self) -> str:
        return f"Viewer({self.url!r}, root={self.root!r})"

    def _repr_html_(self) -> str:
        return f'<a href="{self.url}" target="_blank">evalflow view: {self.root}</a>'


def view(root: str | os.PathLike | Run, *, addr: str = "127.0.0.1:0", token: str | None = None) -> Viewer:
    """Serves the read-only viewer of ``root`` (a folder of runs, one run or an ``s3://``
    prefix) from this process, in the background, and returns it: ``viewer.url`` opens in a
    browser (port 0 picks a free port). Another interface than loopback needs ``token``."""
    target = root.root if isinstance(root, Run) else os.fspath(root)
    code, message, url = _native.view_start(target, addr, token)
    if code != 0:
        _raise_for(code, message)
    return Viewer(url, target)

