//! `evalflow._native`: the Rust half of the Python package.
//!
//! Three things cross into Python, each as plain data so the package depends on no Arrow or
//! DataFusion Python binding at build time:
//! - every SQL function of evalflow as a `datafusion-ffi` PyCapsule
//!   (`__datafusion_aggregate_udf__` / `__datafusion_scalar_udf__`), which the `datafusion`
//!   Python package of the same major (55) loads into its own session: the work runs in this
//!   library's Rust code;
//! - a run's table layout (the folders and schema of every table, as the CLI registers them),
//!   which the Python side registers as listing tables in a `datafusion.SessionContext`;
//! - the CLI itself, run in process on a worker thread with the GIL released, so the verbs
//!   are functions with the CLI's messages, progress bars and exit codes, and Ctrl-C cancels
//!   the command as a SIGINT ends the binary (committed parts stay; the run resumes).

use std::sync::Arc;
use std::sync::mpsc::{RecvTimeoutError, channel};
use std::time::Duration;

use clap::Parser;
use datafusion::arrow::datatypes::Schema;
use datafusion::arrow::ipc::writer::StreamWriter;
use datafusion::datasource::listing::ListingTable;
use datafusion::logical_expr::{AggregateUDF, ScalarUDF};
use datafusion_ffi::udaf::FFI_AggregateUDF;
use datafusion_ffi::udf::FFI_ScalarUDF;
use evalflow::cli::{self, Cli, CliError};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCapsule};

/// The DataFusion major this library was built against (the FFI is stable within a major only).
const DATAFUSION_MAJOR: u64 = 55;

/// One evalflow aggregate, loadable by `datafusion.udaf(...)`.
#[pyclass(module = "evalflow._native", frozen)]
struct AggregateFunction {
    inner: Arc<AggregateUDF>,
}

#[pymethods]
impl AggregateFunction {
    /// The SQL name.
    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn __datafusion_aggregate_udf__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let ffi = FFI_AggregateUDF::from(self.inner.clone());
        PyCapsule::new(py, ffi, Some(c"datafusion_aggregate_udf".to_owned()))
    }

    fn __repr__(&self) -> String {
        format!("<evalflow aggregate {}>", self.inner.name())
    }
}

/// One evalflow scalar function, loadable by `datafusion.udf(...)`.
#[pyclass(module = "evalflow._native", frozen)]
struct ScalarFunction {
    inner: Arc<ScalarUDF>,
}

#[pymethods]
impl ScalarFunction {
    /// The SQL name.
    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn __datafusion_scalar_udf__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        let ffi = FFI_ScalarUDF::from(self.inner.clone());
        PyCapsule::new(py, ffi, Some(c"datafusion_scalar_udf".to_owned()))
    }

    fn __repr__(&self) -> String {
        format!("<evalflow scalar {}>", self.inner.name())
    }
}

/// Every aggregate of docs/functions.md.
#[pyfunction]
fn aggregates() -> Vec<AggregateFunction> {
    evalflow::udaf::aggregates()
        .into_iter()
        .map(|f| AggregateFunction { inner: Arc::new(f) })
        .collect()
}

/// Every scalar function of docs/functions.md (`validity_verdict` included).
#[pyfunction]
fn scalars() -> Vec<ScalarFunction> {
    evalflow::udaf::scalars()
        .into_iter()
        .map(|f| ScalarFunction { inner: Arc::new(f) })
        .collect()
}

/// The DataFusion major of this build and of its FFI.
#[pyfunction]
fn datafusion_major() -> (u64, u64) {
    (DATAFUSION_MAJOR, datafusion_ffi::version())
}

fn runtime() -> PyResult<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start the runtime: {e}")))
}

/// An error at the boundary, as (exit code, message) for the Python side to raise.
fn failure(e: &CliError) -> (u8, String) {
    (e.exit_code(), e.to_string())
}

/// The manifest of the run at `root` as JSON text: (0, "", json), or the CLI's
/// (exit code, message, None).
#[pyfunction]
fn manifest(py: Python<'_>, root: String) -> PyResult<(u8, String, Option<String>)> {
    let rt = runtime()?;
    let got: Result<String, (u8, String)> = py.detach(|| {
        rt.block_on(async {
            let (_, _, m) = evalflow::query::open_run(&root)
                .await
                .map_err(|e| query_failure(&e))?;
            serde_json::to_string(&m).map_err(|e| (cli::EXIT_INTERNAL, e.to_string()))
        })
    });
    Ok(match got {
        Ok(j) => (0, String::new(), Some(j)),
        Err((c, m)) => (c, m, None),
    })
}

fn query_failure(e: &evalflow::query::QueryError) -> (u8, String) {
    let code = if e.is_bad_input() {
        cli::EXIT_BAD_INPUT
    } else {
        cli::EXIT_INTERNAL
    };
    (code, e.to_string())
}

/// One table of a run as the CLI registers it: (name, listing URLs, schema as an Arrow IPC
/// stream with no batches). No URL means the table has no parts yet (empty, of that schema).
type TableLayout = (String, Vec<String>, Vec<u8>);

fn ipc_schema(schema: &Schema) -> Result<Vec<u8>, (u8, String)> {
    let mut buf = Vec::new();
    let mut w = StreamWriter::try_new(&mut buf, schema).map_err(|e| (3, e.to_string()))?;
    w.finish().map_err(|e| (3, e.to_string()))?;
    drop(w);
    Ok(buf)
}

/// Every table of the run at `root` (cases, calls, validity, scores with every scorer
/// version, results), each part checked against its declared schema as the CLI does:
/// (0, "", tables), or the CLI's (exit code, message, []).
#[pyfunction]
#[allow(clippy::type_complexity)]
fn layout(
    py: Python<'_>,
    root: String,
) -> PyResult<(u8, String, Vec<(String, Vec<String>, Py<PyBytes>)>)> {
    let rt = runtime()?;
    let got: Result<Vec<TableLayout>, (u8, String)> = py.detach(|| {
        rt.block_on(async {
            let (ctx, _, _) = evalflow::query::open_run(&root)
                .await
                .map_err(|e| query_failure(&e))?;
            let mut out = Vec::new();
            for t in evalflow::schema::Table::ALL {
                let name = t.name();
                let provider = ctx
                    .table_provider(name)
                    .await
                    .map_err(|e| (cli::EXIT_INTERNAL, format!("table `{name}`: {e}")))?;
                let schema = provider.schema();
                let urls = match provider.downcast_ref::<ListingTable>() {
                    Some(l) => l
                        .table_paths()
                        .iter()
                        .map(|u| u.as_str().to_string())
                        .collect(),
                    None => Vec::new(),
                };
                out.push((name.to_string(), urls, ipc_schema(&schema)?));
            }
            Ok(out)
        })
    });
    Ok(match got {
        Ok(v) => (
            0,
            String::new(),
            v.into_iter()
                .map(|(n, u, ipc): TableLayout| (n, u, PyBytes::new(py, &ipc).unbind()))
                .collect(),
        ),
        Err((c, m)) => (c, m, Vec::new()),
    })
}

/// What a command ended with: its exit code, the error message (empty on success) and the
/// run root it wrote, where the command made one.
type Ended = (u8, String, Option<String>);

/// Runs the CLI with `argv` (without the program name) in this process and returns
/// (exit code, message, root). The command runs on a worker thread with the GIL released;
/// every 100 ms this thread checks Python's signals, and a pending `KeyboardInterrupt`
/// cancels the command (its future is dropped at the next await, as a SIGINT kills the
/// binary between commits: committed parts stay and the next call resumes) and is raised.
#[pyfunction]
fn invoke(py: Python<'_>, argv: Vec<String>) -> PyResult<Ended> {
    let args = std::iter::once("evalflow".to_string()).chain(argv);
    let cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() {
                cli::EXIT_BAD_INPUT
            } else {
                0
            };
            let text = e.render().to_string();
            if code == 0 {
                // --help and --version: printed, as the binary does.
                println!("{text}");
                return Ok((0, String::new(), None));
            }
            let text = text.trim_end();
            let text = text.strip_prefix("error: ").unwrap_or(text);
            return Ok((code, text.to_string(), None));
        }
    };
    cli::set_embedded();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(t) = cli.threads {
        builder.worker_threads(t as usize);
    }
    let rt = builder
        .enable_all()
        .build()
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start the runtime: {e}")))?;
    let (cancel_tx, cancel_rx) = tokio::sync::oneshot::channel::<()>();
    let (done_tx, done_rx) = channel::<Done>();
    // A Receiver is not Sync: the Mutex lets the GIL-free closures below borrow it.
    let done_rx = std::sync::Mutex::new(done_rx);
    let worker = std::thread::spawn(move || {
        let res = rt.block_on(async {
            tokio::select! {
                r = cli::run(cli) => Some(r),
                _ = cancel_rx => None,
            }
        });
        // Cancelled: blocking tasks (a part being encoded) get a moment to end, then the
        // runtime goes; a temporary part left behind is never read as committed.
        rt.shutdown_timeout(Duration::from_secs(5));
        cli::run_deferred();
        let _ = done_tx.send(res);
    });
    let mut cancel = Some(cancel_tx);
    loop {
        match py.detach(|| recv(&done_rx, Some(Duration::from_millis(100)))) {
            Ok(Some(Ok(()))) => {
                let _ = worker.join();
                return Ok((0, String::new(), cli::take_last_root()));
            }
            Ok(Some(Err(e))) => {
                let _ = worker.join();
                let (code, msg) = failure(&e);
                return Ok((code, msg, cli::take_last_root()));
            }
            Ok(None) => {
                let _ = worker.join();
                return Err(pyo3::exceptions::PyKeyboardInterrupt::new_err(()));
            }
            Err(RecvTimeoutError::Timeout) => {
                if let Err(e) = py.check_signals() {
                    // A command that cleans up on SIGINT (import) is asked to stop and
                    // given time to; any other is dropped at its next await.
                    let watched = cli::request_interrupt();
                    let ended = watched
                        && py
                            .detach(|| recv(&done_rx, Some(Duration::from_secs(30))))
                            .is_ok();
                    if !ended {
                        if let Some(tx) = cancel.take() {
                            let _ = tx.send(());
                        }
                        let _ = py.detach(|| recv(&done_rx, None));
                    }
                    let _ = worker.join();
                    return Err(e);
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                let _ = worker.join();
                return Ok((
                    cli::EXIT_INTERNAL,
                    "the command's thread panicked (see stderr)".to_string(),
                    None,
                ));
            }
        }
    }
}

type Done = Option<Result<(), CliError>>;

/// Waits for the command's end, at most `timeout` (None: until it ends).
fn recv(
    rx: &std::sync::Mutex<std::sync::mpsc::Receiver<Done>>,
    timeout: Option<Duration>,
) -> Result<Done, RecvTimeoutError> {
    let rx = rx.lock().map_err(|_| RecvTimeoutError::Disconnected)?;
    match timeout {
        Some(t) => rx.recv_timeout(t),
        None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
    }
}

/// Viewers started by [`view_start`], by URL: each keeps its own runtime alive until
/// [`view_stop`] (or the interpreter's exit).
static VIEWERS: std::sync::Mutex<Vec<(String, tokio::runtime::Runtime)>> =
    std::sync::Mutex::new(Vec::new());

/// Starts `evalflow view ROOT` in the background of this process and returns (0, "", URL),
/// or the CLI's (exit code, message, None).
#[pyfunction]
#[pyo3(signature = (root, addr, token=None))]
fn view_start(
    py: Python<'_>,
    root: String,
    addr: String,
    token: Option<String>,
) -> PyResult<(u8, String, Option<String>)> {
    let addr: std::net::SocketAddr = match addr.parse() {
        Ok(a) => a,
        Err(e) => return Ok((cli::EXIT_BAD_INPUT, format!("addr `{addr}`: {e}"), None)),
    };
    let rt = runtime()?;
    let cfg = evalflow::view::ViewConfig { root, addr, token };
    let started = py.detach(|| rt.block_on(evalflow::view::start(cfg)));
    match started {
        Ok(server) => {
            let url = format!("http://{}", server.addr);
            if let Ok(mut v) = VIEWERS.lock() {
                v.push((url.clone(), rt));
            }
            Ok((0, String::new(), Some(url)))
        }
        Err(e) => {
            let code = match &e {
                evalflow::view::ViewError::Storage(s) if !s.is_bad_input() => cli::EXIT_INTERNAL,
                _ => cli::EXIT_BAD_INPUT,
            };
            Ok((code, e.to_string(), None))
        }
    }
}

/// Stops the viewer serving `url`; true when one was running.
#[pyfunction]
fn view_stop(url: &str) -> bool {
    let found = VIEWERS.lock().ok().and_then(|mut v| {
        let i = v.iter().position(|(u, _)| u == url)?;
        Some(v.remove(i))
    });
    match found {
        Some((_, rt)) => {
            rt.shutdown_background();
            true
        }
        None => false,
    }
}

/// A scorer definition given as JSON (a Python dict) as TOML text, the form
/// `rescore --scorer-file` reads.
#[pyfunction]
fn scorer_toml(json: &str) -> PyResult<String> {
    let bad =
        |e: String| pyo3::exceptions::PyValueError::new_err(format!("scorer definition: {e}"));
    let v: toml::Value = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
    toml::to_string(&v).map_err(|e| bad(e.to_string()))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<AggregateFunction>()?;
    m.add_class::<ScalarFunction>()?;
    m.add_function(wrap_pyfunction!(aggregates, m)?)?;
    m.add_function(wrap_pyfunction!(scalars, m)?)?;
    m.add_function(wrap_pyfunction!(datafusion_major, m)?)?;
    m.add_function(wrap_pyfunction!(manifest, m)?)?;
    m.add_function(wrap_pyfunction!(layout, m)?)?;
    m.add_function(wrap_pyfunction!(invoke, m)?)?;
    m.add_function(wrap_pyfunction!(scorer_toml, m)?)?;
    m.add_function(wrap_pyfunction!(view_start, m)?)?;
    m.add_function(wrap_pyfunction!(view_stop, m)?)?;
    m.add("__evalflow_version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
