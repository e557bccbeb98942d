"""Type stubs of the evalflow package (the docstrings are those of the functions)."""

import os
from typing import Any, Iterable, Mapping, Sequence

import datafusion
import pyarrow

__version__: str
EXIT_GATE: int
EXIT_BAD_INPUT: int

_Path = str | os.PathLike[str]

class EvalflowError(Exception):
    """An evalflow command failed; ``exit_code`` is what the CLI would exit with."""

    exit_code: int
    def __init__(self, message: str, exit_code: int) -> None: ...

class BadInputError(EvalflowError, ValueError):
    """Bad input or usage (exit code 2): the message names the file, line and field."""

class StageError(EvalflowError, RuntimeError):
    """A stage or an I/O operation failed (exit code 3 or more)."""

class GateFailed(EvalflowError):
    """A quality gate failed (exit code 1): invalid-rate drift, a holdout regression."""

class DataFusionVersionError(ImportError):
    """The installed ``datafusion`` package is of another major than evalflow's build."""

def functions() -> list[str]:
    """The SQL names of every function :func:`register` adds."""

def register(ctx: datafusion.SessionContext) -> datafusion.SessionContext:
    """Register every evalflow SQL function (the aggregates ``mean_se``, ``clustered_se``,
    ``clustered_se_cr1``, ``clustered_se_cr2``, ``mean_ci``, ``clustered_mean_ci``,
    ``paired_diff``, ``paired_diff_clustered``, ``variance_components``, ``confusion``,
    ``conformal_quantile``, ``self_consistency``; the scalars ``sample_size``, ``mde``,
    ``rogan_gladen``, ``rogan_gladen_ci``, ``validity_verdict``) into ``ctx``; they run in
    Rust through ``datafusion-ffi``. Raises :class:`DataFusionVersionError` for a
    ``datafusion`` package of another major. Returns ``ctx``."""

def open_run(root: _Path, ctx: datafusion.SessionContext | None = None) -> datafusion.SessionContext:
    """A ``datafusion.SessionContext`` with the run's tables (``cases``, ``calls``,
    ``validity``, ``scores`` with every scorer version, ``results``) and every function
    registered; ``root`` is a local path or ``s3://bucket/prefix`` (``AWS_*`` environment).
    Convert results with ``.to_pandas()``, ``.to_polars()`` or ``.to_arrow_table()``."""

class Run:
    """A run root: where a verb wrote, with its manifest and tables."""

    root: str
    def __init__(self, root: _Path) -> None: ...
    @property
    def manifest(self) -> dict[str, Any]:
        """``manifest.json`` as a dict (run id, pipeline, per-stage status, row counts)."""
    @property
    def run_id(self) -> str:
        """The run id of the manifest."""
    def context(self) -> datafusion.SessionContext:
        """A ``datafusion.SessionContext`` over this run (see :func:`open_run`)."""
    def sql(self, query: str) -> datafusion.DataFrame:
        """Runs ``query`` over this run's tables."""
    def results(self) -> pyarrow.Table:
        """The ``results`` table as a ``pyarrow.Table``."""
    def refresh(self) -> Run:
        """Forgets the cached manifest (after another verb wrote the run)."""

class Comparison:
    """A paired comparison of two runs (or two models of one run): its rows and verdict."""

    table: pyarrow.Table
    verdict: str
    passed: bool
    message: str
    def to_pandas(self) -> Any:
        """The rows as a pandas DataFrame."""

def cli(args: Sequence[_Path]) -> None:
    """Runs any evalflow command in this process (``cli(["check", "runs/x"])``); raises
    :class:`BadInputError`, :class:`GateFailed` or :class:`StageError` with the CLI's
    message when it would exit non-zero."""

def run(pipeline: _Path, out: _Path | None = None, **options: Any) -> Run:
    """Runs all five stages of ``pipeline`` (``evalflow run``) into ``out`` (default
    ``runs/<run_id>``); a re-run on the same root resumes. Keyword options are CLI flags
    (``memory_limit="512MB"`` is ``--memory-limit 512MB``)."""

def generate(pipeline: _Path, out: _Path, **options: Any) -> Run:
    """The generate stage alone (``evalflow generate PIPELINE --out OUT``)."""

def call(pipeline: _Path, out: _Path, **options: Any) -> Run:
    """The call stage alone; resumes without re-paying an answered call."""

def validate(pipeline: _Path, out: _Path, **options: Any) -> Run:
    """The validate stage alone (``evalflow validate PIPELINE --out OUT``)."""

def score(pipeline: _Path, out: _Path, **options: Any) -> Run:
    """The score stage alone, every scorer of ``[score] scorers``."""

def aggregate(pipeline: _Path, out: _Path, **options: Any) -> Run:
    """The aggregate stage alone; ``Run.results()`` then reads what it wrote."""

def import_(
    files: _Path | Iterable[_Path],
    out: _Path,
    *,
    format: str | None = None,
    cluster: str | None = None,
    model: str | None = None,
    **options: Any,
) -> Run:
    """Imports recorded runs (evalflow JSONL pairs, Parquet, OpenAI Batch output, Inspect AI
    logs, lm-eval samples, promptfoo results) into ``out`` (``evalflow import``)."""

def rescore(
    run: _Path | Run,
    scorer: str | Mapping[str, Any] | None = None,
    *,
    scorer_file: _Path | None = None,
    **options: Any,
) -> Run:
    """Re-scores a run's archived calls under a new scorer version, with no model call:
    ``scorer`` is a built-in name (``"cue"``), or a definition as a dict (the keys of one
    ``[[scorer]]`` table, or ``{"scorer": [...]}``); ``scorer_file`` a TOML scorer file."""

def compare(
    run_a: _Path | Run,
    run_b: _Path | Run | None = None,
    *,
    scorer: str | None = None,
    require_improvement: bool = False,
    **options: Any,
) -> Comparison:
    """The paired, template-clustered difference B - A per test, capability and overall,
    as a :class:`Comparison` (a pyarrow table and the verdict); ``passed`` is True exactly
    when ``evalflow compare --require-improvement`` exits 0 (B significantly better), with
    or without ``require_improvement=True``; a failed gate is ``passed=False``, not raised."""

def report(run: _Path | Run, *, html: _Path | None = None, **options: Any) -> Run:
    """Prints the run's results and writes its HTML page (default ``<run>/report.html``);
    options ``compare=RUN_B``, ``holdout=LABELS_CSV``, ``baseline=FILE``."""

class Viewer:
    """A running ``evalflow view`` server in this process: ``url`` to open, ``stop()`` to end."""

    url: str
    root: str
    def stop(self) -> bool:
        """Stops serving; True when it was running."""

def view(root: _Path | Run, *, addr: str = "127.0.0.1:0", token: str | None = None) -> Viewer:
    """Serves the read-only viewer of ``root`` in the background of this process; ``.url``."""
