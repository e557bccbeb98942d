"""The Rust extension module (see python/src/lib.rs)."""

__evalflow_version__: str

class AggregateFunction:
    """One evalflow aggregate; ``datafusion.udaf(f)`` loads it through its PyCapsule."""

    @property
    def name(self) -> str:
        """The SQL name."""
    def __datafusion_aggregate_udf__(self) -> object:
        """The ``datafusion-ffi`` capsule of the function."""

class ScalarFunction:
    """One evalflow scalar function; ``datafusion.udf(f)`` loads it through its PyCapsule."""

    @property
    def name(self) -> str:
        """The SQL name."""
    def __datafusion_scalar_udf__(self) -> object:
        """The ``datafusion-ffi`` capsule of the function."""

def aggregates() -> list[AggregateFunction]:
    """Every aggregate of docs/functions.md."""

def scalars() -> list[ScalarFunction]:
    """Every scalar function of docs/functions.md (``validity_verdict`` included)."""

def datafusion_major() -> tuple[int, int]:
    """The DataFusion major of this build and of its FFI."""

def manifest(root: str) -> tuple[int, str, str | None]:
    """(0, "", manifest JSON) or the CLI's (exit code, message, None)."""

def layout(root: str) -> tuple[int, str, list[tuple[str, list[str], bytes]]]:
    """Every table of a run: (name, listing URLs, schema as Arrow IPC), or the CLI's error."""

def invoke(argv: list[str]) -> tuple[int, str, str | None]:
    """Runs the CLI in process: (exit code, message, run root); Ctrl-C raises KeyboardInterrupt."""

def scorer_toml(json: str) -> str:
    """A scorer definition given as JSON as TOML text."""
def view_start(root: str, addr: str, token: str | None = None) -> tuple[int, str, str | None]: ...
def view_stop(url: str) -> bool: ...
