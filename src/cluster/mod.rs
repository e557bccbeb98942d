//! The same plans on a Ballista cluster (the `ballista` cargo feature).
//!
//! A corpus that outgrows one machine runs on Apache DataFusion Ballista, DataFusion's own
//! distributed engine, not on a home-made one. One binary plays every role:
//! `evalflow scheduler` and `evalflow executor` start Ballista's processes with every evalflow
//! function registered ([`function_registry`]) and the object stores evalflow knows
//! ([`EnvObjectStores`]: local paths, and `s3://` / `gs://` / `az://` configured from the
//! environment of each process, never from a file or a plan), and `--cluster df://HOST:PORT`
//! makes [`crate::query::new_context`] hand out a session whose plans are submitted to the
//! scheduler ([`remote_context`]).
//!
//! Functions travel by name: the client sends a logical plan that names `clustered_se`, the
//! scheduler and the executors resolve the name in their own registry, so they must be this
//! binary. Anything the cluster cannot run (an in-memory table of the client, a function only
//! the client knows, a `memory://` root) is refused before submission by [`CheckedPlanner`]
//! with a message naming it: never a silent local fallback.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use ballista_core::extension::{SessionConfigExt, SessionStateExt};
use ballista_core::registry::BallistaFunctionRegistry;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::datasource::listing::ListingTable;
use datafusion::datasource::{ViewTable, source_as_provider};
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::SessionStateBuilder;
use datafusion::execution::context::{QueryPlanner, SessionState};
use datafusion::execution::disk_manager::DiskManagerBuilder;
use datafusion::execution::object_store::{DefaultObjectStoreRegistry, ObjectStoreRegistry};
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::logical_expr::{Expr, LogicalPlan};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{SessionConfig, SessionContext};
use object_store::ObjectStore;
use url::Url;

use crate::storage::RunStore;

/// Errors of the cluster roles and of submitting plans.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// `--cluster`, `--scheduler` or `--bind` is not a usable address (exit 2).
    #[error("{flag} `{value}`: {msg}")]
    BadAddress {
        flag: &'static str,
        value: String,
        msg: String,
    },
    /// The scheduler or an executor could not start or stopped with an error.
    #[error("{role}: {msg}")]
    Process { role: &'static str, msg: String },
}

impl ClusterError {
    /// Whether the user can fix this by changing an argument (exit 2).
    pub fn is_bad_input(&self) -> bool {
        matches!(self, ClusterError::BadAddress { .. })
    }
}

/// The start of the message of a plan refused by `--cluster` (a table or function the
/// cluster lacks): bad input, exit 2 ([`crate::query::QueryError::is_bad_input`]).
pub const NOT_ON_CLUSTER: &str = "cannot run on the cluster";

/// A scheduler address as given to `--cluster`: `df://HOST:PORT` (the port defaults to
/// Ballista's 50050).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterUrl {
    /// The host name or address of the scheduler.
    pub host: String,
    /// The scheduler's gRPC port.
    pub port: u16,
}

impl ClusterUrl {
    /// Parses `df://HOST[:PORT]`.
    ///
    /// # Errors
    /// [`ClusterError::BadAddress`] for another scheme or no host.
    pub fn parse(flag: &'static str, s: &str) -> Result<ClusterUrl, ClusterError> {
        let bad = |msg: &str| ClusterError::BadAddress {
            flag,
            value: s.to_string(),
            msg: msg.to_string(),
        };
        let url = Url::parse(s).map_err(|e| bad(&format!("{e} (expected df://HOST:PORT)")))?;
        if url.scheme() != "df" {
            return Err(bad("expected df://HOST:PORT (a Ballista scheduler)"));
        }
        let host = url
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| bad("no host (expected df://HOST:PORT)"))?;
        Ok(ClusterUrl {
            host: host.to_string(),
            port: url.port().unwrap_or(50050),
        })
    }

    /// Checks that something listens at the scheduler's address.
    ///
    /// # Errors
    /// [`ClusterError::Process`] naming the address when no connection can be made within
    /// `timeout`.
    pub fn reachable(&self, timeout: std::time::Duration) -> Result<(), ClusterError> {
        use std::net::ToSocketAddrs;
        let fail = |msg: String| ClusterError::Process {
            role: "scheduler",
            msg: format!("cannot reach the scheduler at {self}: {msg}"),
        };
        let addrs = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| fail(e.to_string()))?;
        let mut last = String::from("the host name resolves to no address");
        for a in addrs {
            match std::net::TcpStream::connect_timeout(&a, timeout) {
                Ok(_) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
        }
        Err(fail(last))
    }

    /// The URL Ballista's client connects to.
    pub fn df_url(&self) -> String {
        format!("df://{}:{}", self.host, self.port)
    }
}

impl std::fmt::Display for ClusterUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.df_url())
    }
}

/// Parses `HOST:PORT` for `--bind`.
///
/// # Errors
/// [`ClusterError::BadAddress`] when it is not `IP:PORT`.
pub fn parse_bind(flag: &'static str, s: &str) -> Result<SocketAddr, ClusterError> {
    s.parse().map_err(|e| ClusterError::BadAddress {
        flag,
        value: s.to_string(),
        msg: format!("{e} (expected IP:PORT, for example 127.0.0.1:50050)"),
    })
}

/// Every function a node of the cluster resolves by name: DataFusion's defaults (as
/// Ballista's default registry has them) and every evalflow function (statistics UDAFs,
/// `validity_verdict` and the other scalar functions of [`crate::udaf::scalars`]).
pub fn function_registry() -> BallistaFunctionRegistry {
    let mut r = BallistaFunctionRegistry::default();
    for f in crate::udaf::aggregates() {
        r.aggregate_functions
            .insert(f.name().to_string(), Arc::new(f));
    }
    for f in crate::udaf::scalars() {
        r.scalar_functions.insert(f.name().to_string(), Arc::new(f));
    }
    r
}

/// Registers every evalflow function on a session state (the scheduler's sessions).
fn register_functions(state: &mut SessionState) -> DfResult<()> {
    use datafusion::execution::FunctionRegistry;
    for f in crate::udaf::aggregates() {
        state.register_udaf(Arc::new(f))?;
    }
    for f in crate::udaf::scalars() {
        state.register_udf(Arc::new(f))?;
    }
    Ok(())
}

/// The object stores of a cluster node: stores registered explicitly first, then, for a URL
/// no one registered, a store built on demand from this process's environment exactly as a
/// run root's is (`s3://bucket` from `AWS_*`, ...). `memory://` stores live inside one
/// process, so a node refuses them with a message instead of reading an empty store.
#[derive(Debug, Default)]
pub struct EnvObjectStores {
    inner: DefaultObjectStoreRegistry,
}

impl ObjectStoreRegistry for EnvObjectStores {
    fn register_store(
        &self,
        url: &Url,
        store: Arc<dyn ObjectStore>,
    ) -> Option<Arc<dyn ObjectStore>> {
        self.inner.register_store(url, store)
    }

    fn get_store(&self, url: &Url) -> DfResult<Arc<dyn ObjectStore>> {
        if let Ok(s) = self.inner.get_store(url) {
            return Ok(s);
        }
        match url.scheme() {
            "memory" => Err(DataFusionError::Configuration(format!(
                "{NOT_ON_CLUSTER}: `{url}` is a memory:// store, which lives inside one process; \
                 put the run on a local path every node sees or on s3://"
            ))),
            "s3" | "s3a" | "gs" | "az" | "azure" => {
                let base = format!("{}://{}", url.scheme(), url.host_str().unwrap_or(""));
                let store = RunStore::open(&base)
                    .map_err(|e| DataFusionError::Configuration(e.to_string()))?
                    .object_store();
                let base_url =
                    Url::parse(&base).map_err(|e| DataFusionError::Configuration(e.to_string()))?;
                self.inner.register_store(&base_url, store.clone());
                Ok(store)
            }
            _ => self.inner.get_store(url),
        }
    }
}

/// A runtime with [`EnvObjectStores`]; spills go to `work_dir` (an executor's) or the OS
/// temp folder.
fn runtime_env(work_dir: Option<PathBuf>) -> DfResult<Arc<RuntimeEnv>> {
    let mut b =
        RuntimeEnvBuilder::new().with_object_store_registry(Arc::new(EnvObjectStores::default()));
    b = match work_dir {
        Some(d) => b.with_temp_file_path(d),
        None => b.with_disk_manager_builder(DiskManagerBuilder::default()),
    };
    b.build_arc()
}

/// The scheduler's sessions: Ballista's defaults, evalflow's functions and object stores.
fn scheduler_session(config: SessionConfig) -> DfResult<SessionState> {
    let base = ballista_core::utils::default_session_builder(config)?;
    let mut state = SessionStateBuilder::new_from_existing(base)
        .with_runtime_env(runtime_env(None)?)
        .build();
    register_functions(&mut state)?;
    Ok(state)
}

/// Options of `evalflow scheduler`.
#[derive(Debug, Clone)]
pub struct SchedulerOptions {
    /// Address the scheduler's gRPC service binds.
    pub bind: SocketAddr,
    /// Host name executors and clients use to reach it (default: the bind address).
    pub external_host: Option<String>,
    /// Seconds without a heartbeat before an executor is declared dead.
    pub executor_timeout_seconds: u64,
}

/// Runs a Ballista scheduler until it fails or the process is stopped.
///
/// # Errors
/// [`ClusterError::Process`] when it cannot bind or stops with an error.
pub async fn run_scheduler(o: SchedulerOptions) -> Result<(), ClusterError> {
    use ballista_scheduler::cluster::BallistaCluster;
    use ballista_scheduler::config::SchedulerConfig;
    use ballista_scheduler::scheduler_process::start_server;
    let err = |e: ballista_core::error::BallistaError| ClusterError::Process {
        role: "scheduler",
        msg: e.to_string(),
    };
    let config = SchedulerConfig {
        bind_host: o.bind.ip().to_string(),
        bind_port: o.bind.port(),
        external_host: o
            .external_host
            .clone()
            .unwrap_or_else(|| o.bind.ip().to_string()),
        executor_timeout_seconds: o.executor_timeout_seconds,
        no_executors_grace_period_seconds: o.executor_timeout_seconds,
        expire_dead_executor_interval_seconds: (o.executor_timeout_seconds / 3).max(1),
        override_session_builder: Some(Arc::new(scheduler_session)),
        ..Default::default()
    };
    let cluster = BallistaCluster::new_from_config(&config)
        .await
        .map_err(err)?;
    eprintln!(
        "scheduler listening on df://{} (evalflow {}, {} functions)",
        o.bind,
        env!("CARGO_PKG_VERSION"),
        crate::udaf::function_names().len()
    );
    start_server(cluster, o.bind, Arc::new(config))
        .await
        .map_err(err)
}

/// Options of `evalflow executor`.
#[derive(Debug, Clone)]
pub struct ExecutorOptions {
    /// The scheduler.
    pub scheduler: ClusterUrl,
    /// Address of the executor's Arrow Flight service (shuffle reads, results).
    pub bind: SocketAddr,
    /// Address of the executor's gRPC service (default: the bind port + 1).
    pub grpc_bind: Option<SocketAddr>,
    /// Host name the scheduler and clients use to reach it (default: the bind address).
    pub external_host: Option<String>,
    /// Tasks run at once (default: all cores).
    pub slots: usize,
    /// Memory pool of the executor, split across its slots (`--memory-limit`).
    pub memory_limit: usize,
    /// Folder for shuffle files and spills (default: a new temporary folder).
    pub work_dir: Option<PathBuf>,
    /// Seconds between heartbeats to the scheduler.
    pub heartbeat_seconds: u64,
}

/// Runs a Ballista executor until it fails or the process is stopped.
///
/// # Errors
/// [`ClusterError::Process`] when it cannot bind or reach the scheduler.
pub async fn run_executor(o: ExecutorOptions) -> Result<(), ClusterError> {
    use ballista_executor::executor_process::{ExecutorProcessConfig, start_executor_process};
    let grpc = o.grpc_bind.unwrap_or_else(|| {
        let mut a = o.bind;
        a.set_port(o.bind.port().wrapping_add(1));
        a
    });
    let work_dir = match &o.work_dir {
        Some(d) => d.clone(),
        // Shuffle files of finished jobs are removed when the scheduler says so (5 minutes
        // after a job ends); the folder itself outlives a killed executor.
        None => std::env::temp_dir().join(format!("evalflow-executor-{}", uuid::Uuid::new_v4())),
    };
    std::fs::create_dir_all(&work_dir).map_err(|e| ClusterError::Process {
        role: "executor",
        msg: format!("work dir {}: {e}", work_dir.display()),
    })?;
    let spill_dir = work_dir.clone();
    let config = ExecutorProcessConfig {
        bind_host: o.bind.ip().to_string(),
        external_host: Some(
            o.external_host
                .clone()
                .unwrap_or_else(|| o.bind.ip().to_string()),
        ),
        port: o.bind.port(),
        grpc_port: grpc.port(),
        scheduler_host: o.scheduler.host.clone(),
        scheduler_port: o.scheduler.port,
        scheduler_connect_timeout_seconds: 10,
        vcores: o.slots.max(1),
        work_dir: Some(work_dir.display().to_string()),
        executor_heartbeat_interval_seconds: o.heartbeat_seconds.max(1),
        memory_pool_size: Some(o.memory_limit as u64),
        override_function_registry: Some(Arc::new(function_registry())),
        override_runtime_producer: Some(Arc::new(move |_: &SessionConfig| {
            runtime_env(Some(spill_dir.clone()))
        })),
        ..Default::default()
    };
    eprintln!(
        "executor listening on {} (flight) and {} (grpc), scheduler {}",
        o.bind, grpc, o.scheduler
    );
    start_executor_process(Arc::new(config))
        .await
        .map_err(|e| ClusterError::Process {
            role: "executor",
            msg: e.to_string(),
        })
}

/// A session whose plans run on the cluster at `url`: `local`'s configuration, runtime
/// (object stores registered by the client) and functions, upgraded for Ballista, with
/// every plan checked by [`CheckedPlanner`] before it is submitted.
///
/// No connection is made here: the first query connects (and fails naming the scheduler if
/// it is not there).
pub fn remote_context(url: &ClusterUrl, local: SessionContext) -> DfResult<SessionContext> {
    let state = local.state();
    let config = state
        .config()
        .clone()
        .with_ballista_job_name("evalflow")
        // Results are fetched from the executors over Arrow Flight; the gRPC default of 16 MiB
        // is too small for one partition's result of a wide query.
        .with_ballista_grpc_client_max_message_size(256 << 20)
        // Ballista 55's adaptive planner hangs a job whose executor dies mid-stage (the
        // rolled-back stage never takes the other executors' task updates: "Can't find active
        // stage"); the static planner reruns the lost tasks on the other executors.
        .with_ballista_adaptive_query_planner(false);
    let state = SessionStateBuilder::new_from_existing(state)
        .with_config(config)
        .build()
        .upgrade_for_ballista(format!("http://{}:{}", url.host, url.port))?;
    let inner = state.query_planner().clone();
    let state = SessionStateBuilder::new_from_existing(state)
        .with_query_planner(Arc::new(CheckedPlanner {
            inner,
            scheduler: url.df_url(),
        }))
        .build();
    let ctx = SessionContext::new_with_state(state);
    // The upgrade resets the function list to Ballista's: register ours again.
    crate::udaf::register_all(&ctx);
    Ok(ctx)
}

/// Ballista's query planner behind a check that every table and function of the plan can
/// run on the cluster.
#[derive(Debug)]
pub struct CheckedPlanner {
    inner: Arc<dyn QueryPlanner + Send + Sync>,
    scheduler: String,
}

#[async_trait::async_trait]
impl QueryPlanner for CheckedPlanner {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session_state: &dyn datafusion::catalog::Session,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        check_plan(logical_plan, &cluster_function_names()).map_err(|m| {
            DataFusionError::Plan(format!("{NOT_ON_CLUSTER} {}: {m}", self.scheduler))
        })?;
        let plan = inline_scalar_subqueries(logical_plan, session_state).await?;
        self.inner.create_physical_plan(&plan, session_state).await
    }
}

/// Runs each uncorrelated scalar subquery of `plan` (`(SELECT max(v) FROM t)` used as a
/// value) as its own job on the cluster and puts its value in the plan as a literal.
///
/// Ballista 55's executors cannot decode a plan that evaluates a scalar subquery inside a
/// stage ("ScalarSubqueryExpr can only be deserialized as part of a surrounding
/// ScalarSubqueryExec"); the report and comparison queries pick the newest scorer version
/// that way. Correlated subqueries were turned into joins by the optimizer already.
///
/// # Errors
/// The subquery's own failure, or a subquery returning more than one row.
async fn inline_scalar_subqueries(
    plan: &LogicalPlan,
    session: &dyn datafusion::catalog::Session,
) -> DfResult<LogicalPlan> {
    use datafusion::common::ScalarValue;
    use datafusion::common::tree_node::Transformed;
    use datafusion::logical_expr::Subquery;
    let mut found: Vec<Subquery> = Vec::new();
    plan.apply(|node| {
        node.apply_expressions(|e| {
            e.apply(|e| {
                if let Expr::ScalarSubquery(sq) = e
                    && sq.outer_ref_columns.is_empty()
                    && !found.contains(sq)
                {
                    found.push(sq.clone());
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })
    })?;
    if found.is_empty() {
        return Ok(plan.clone());
    }
    let Some(state) = session.as_any().downcast_ref::<SessionState>() else {
        return Ok(plan.clone());
    };
    let mut values = Vec::with_capacity(found.len());
    for sq in &found {
        let df = datafusion::dataframe::DataFrame::new(state.clone(), sq.subquery.as_ref().clone());
        let field = sq.subquery.schema().field(0).clone();
        // Two rows are enough to tell a scalar from an error: never collect a whole table.
        let batches = df.limit(0, Some(2))?.collect().await?;
        let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
        let value = match batches.iter().find(|b| b.num_rows() > 0) {
            None => ScalarValue::try_from(field.data_type())?,
            Some(b) if rows == 1 => ScalarValue::try_from_array(b.column(0), 0)?,
            Some(_) => {
                return Err(DataFusionError::Execution(
                    "a scalar subquery returned more than one row (at most one is allowed)".into(),
                ));
            }
        };
        values.push(value);
    }
    let out = plan.clone().transform_up(|node| {
        node.map_expressions(|e| {
            e.transform(|e| {
                let i = match &e {
                    Expr::ScalarSubquery(sq) => found.iter().position(|f| f == sq),
                    _ => None,
                };
                Ok(match i {
                    Some(i) => Transformed::yes(Expr::Literal(values[i].clone(), None)),
                    None => Transformed::no(e),
                })
            })
        })
    })?;
    Ok(out.data)
}

/// The names the executors resolve (see [`function_registry`]).
pub fn cluster_function_names() -> HashSet<String> {
    let r = function_registry();
    r.scalar_functions
        .keys()
        .chain(r.aggregate_functions.keys())
        .chain(r.window_functions.keys())
        .chain(r.higher_order_functions.keys())
        .cloned()
        .collect()
}

/// Finds the first table or function of `plan` (subqueries and views included) that the
/// cluster cannot run, and says what it is.
///
/// # Errors
/// A message naming the table (an in-memory or other non-file table of this process) or
/// the function (one the executors do not have).
pub fn check_plan(plan: &LogicalPlan, functions: &HashSet<String>) -> Result<(), String> {
    let mut problem: Option<String> = None;
    let mut views: Vec<LogicalPlan> = Vec::new();
    let _ = plan.apply_with_subqueries(|node| {
        if let LogicalPlan::TableScan(scan) = node {
            let name = scan.table_name.to_string();
            if scan.table_name.schema() == Some("information_schema") {
                return Ok(TreeNodeRecursion::Continue);
            }
            match source_as_provider(&scan.source) {
                Ok(p) if p.is::<ListingTable>() => {}
                Ok(p) => {
                    if let Some(v) = p.downcast_ref::<ViewTable>() {
                        views.push(v.logical_plan().clone());
                    } else {
                        problem = Some(format!(
                            "table `{name}` is held in this process ({:?}), so executors cannot \
                             read it; only Parquet tables on paths every node sees or on an object \
                             store run there",
                            p.table_type()
                        ));
                        return Ok(TreeNodeRecursion::Stop);
                    }
                }
                Err(_) => {
                    problem = Some(format!(
                        "table `{name}` has no provider that can be shipped"
                    ));
                    return Ok(TreeNodeRecursion::Stop);
                }
            }
        }
        node.apply_expressions(|e| {
            e.apply(|e| {
                let f = match e {
                    Expr::ScalarFunction(f) => Some(f.name().to_string()),
                    Expr::AggregateFunction(f) => Some(f.func.name().to_string()),
                    Expr::WindowFunction(f) => Some(f.fun.name().to_string()),
                    _ => None,
                };
                if let Some(f) = f
                    && !functions.contains(&f)
                {
                    problem = Some(format!(
                        "function `{f}` is defined in this process only; the executors do not \
                         have it (only DataFusion's and evalflow's registered functions run there)"
                    ));
                    return Ok(TreeNodeRecursion::Stop);
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })
    });
    if let Some(p) = problem {
        return Err(p);
    }
    for v in views {
        check_plan(&v, functions)?;
    }
    Ok(())
}

/// Whether `ctx` submits its plans to a cluster.
pub fn is_remote(ctx: &SessionContext) -> bool {
    ctx.state()
        .config()
        .options()
        .extensions
        .get::<ballista_core::config::BallistaConfig>()
        .is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The optimized logical plan of `sql`.
    async fn optimized(ctx: &SessionContext, sql: &str) -> LogicalPlan {
        ctx.sql(sql).await.unwrap().into_optimized_plan().unwrap()
    }

    #[test]
    fn cluster_urls() {
        let u = ClusterUrl::parse("--cluster", "df://127.0.0.1:50051").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("127.0.0.1", 50051));
        assert_eq!(
            ClusterUrl::parse("--cluster", "df://h").unwrap().port,
            50050
        );
        let e = ClusterUrl::parse("--cluster", "http://h:1").unwrap_err();
        assert!(e.to_string().contains("df://HOST:PORT"), "{e}");
        assert!(e.is_bad_input());
        assert!(parse_bind("--bind", "localhost").is_err());
    }

    #[test]
    fn every_evalflow_function_is_on_the_executors() {
        let names = cluster_function_names();
        for f in crate::udaf::function_names() {
            assert!(
                names.contains(f),
                "{f} missing from the executors' registry"
            );
        }
        assert!(names.contains("sum") && names.contains("abs"));
    }

    #[tokio::test]
    async fn in_memory_tables_and_local_functions_are_refused_by_name() {
        use datafusion::arrow::datatypes::{DataType, Field, Schema};
        use datafusion::datasource::MemTable;
        use datafusion::logical_expr::{ColumnarValue, Volatility, create_udf};
        let ctx = SessionContext::new();
        crate::udaf::register_all(&ctx);
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Float64, true)]));
        ctx.register_table(
            "mem",
            Arc::new(MemTable::try_new(schema, vec![vec![]]).unwrap()),
        )
        .unwrap();
        let names = cluster_function_names();
        let plan = optimized(&ctx, "SELECT mean_se(x) FROM mem").await;
        let e = check_plan(&plan, &names).unwrap_err();
        assert!(e.contains("table `mem`"), "{e}");
        ctx.register_udf(create_udf(
            "only_here",
            vec![DataType::Float64],
            DataType::Float64,
            Volatility::Immutable,
            Arc::new(|a: &[ColumnarValue]| Ok(a[0].clone())),
        ));
        let plan = optimized(&ctx, "SELECT only_here(x) FROM (VALUES (1.0)) t(x)").await;
        let e = check_plan(&plan, &names).unwrap_err();
        assert!(e.contains("function `only_here`"), "{e}");
        let plan = optimized(&ctx, "SELECT clustered_se(x, 1) FROM (VALUES (1.0)) t(x)").await;
        check_plan(&plan, &names).unwrap();
    }
}
