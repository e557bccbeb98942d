"""Shared fixtures: the evalflow binary built from the same tree (the reference the package
is checked against), a sentiment run made by that binary, and moto's S3 server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]


def evalflow_bin() -> str:
    """The CLI binary: $EVALFLOW_BIN, else the tree's debug build."""
    b = os.environ.get("EVALFLOW_BIN") or str(REPO / "target" / "debug" / "evalflow")
    if not Path(b).exists():
        pytest.fail(f"no evalflow binary at {b}: run `cargo build` first or set EVALFLOW_BIN")
    return b


def cli(*args, env=None, check=True, cwd=None) -> subprocess.CompletedProcess:
    """Runs the binary; fails the test with its stderr when `check` and it exits non-zero."""
    p = subprocess.run(
        [evalflow_bin(), *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd or REPO,
    )
    if check and p.returncode != 0:
        pytest.fail(f"evalflow {' '.join(map(str, args))} exited {p.returncode}: {p.stderr}")
    return p


def cli_sql(query: str, *, runs=(), tables=(), env=None, tmp: Path):
    """`evalflow sql QUERY --format parquet`, read back with pyarrow."""
    out = tmp / f"sql-{time.monotonic_ns()}.parquet"
    args = ["sql", query, "--format", "parquet", "--output", out]
    for r in runs:
        args += ["--run", r]
    for t in tables:
        args += ["--table", t]
    cli(*args, env=env)
    return pq.read_table(out)


@pytest.fixture(scope="session")
def sentiment_run(tmp_path_factory) -> Path:
    """The README's first command, into a temporary root, by the binary."""
    root = tmp_path_factory.mktemp("runs") / "sentiment"
    cli("run", "pipelines/sentiment.toml", "--out", root)
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_env():
    """moto's S3 server on loopback, with a bucket, as the `AWS_*` environment."""
    port = _free_port()
    exe = shutil.which("moto_server")
    cmd = [exe] if exe else [sys.executable, "-m", "moto.server"]
    proc = subprocess.Popen(
        cmd + ["-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.2)
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
    }
    import boto3

    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket="evalflow-py")
    yield env
    proc.terminate()
    proc.wait(timeout=10)


def tree(root: Path) -> dict[str, int]:
    """Every file under `root` with its size: what "writes nothing" compares."""
    return {
        str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()
    }
