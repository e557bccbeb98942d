//! `evalflow scheduler` and `evalflow executor`: the processes of a Ballista cluster, from
//! this binary so that every evalflow function is registered on them (the `ballista`
//! feature; docs/cluster.md).

use std::path::PathBuf;

use super::CliError;
use crate::cluster::{self, ClusterError, ClusterUrl};

#[derive(Debug, clap::Args)]
pub struct SchedulerArgs {
    /// Address the scheduler's gRPC service binds (IP:PORT); clients use
    /// `--cluster df://HOST:PORT` and executors `--scheduler df://HOST:PORT` with it.
    #[arg(long, default_value = "127.0.0.1:50050")]
    pub bind: String,
    /// Host name executors and clients reach the scheduler by, when it differs from the bind
    /// address (behind NAT, or binding 0.0.0.0).
    #[arg(long)]
    pub external_host: Option<String>,
    /// Seconds without a heartbeat before an executor is declared dead and its tasks are
    /// run elsewhere.
    #[arg(long, default_value_t = 30)]
    pub executor_timeout: u64,
}

#[derive(Debug, clap::Args)]
pub struct ExecutorArgs {
    /// The scheduler (df://HOST:PORT).
    #[arg(long)]
    pub scheduler: String,
    /// Address of the executor's Arrow Flight service (IP:PORT): shuffle reads and results.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub bind: String,
    /// Address of the executor's gRPC service (default: the --bind port + 1).
    #[arg(long)]
    pub grpc_bind: Option<String>,
    /// Host name the scheduler and clients reach this executor by, when it differs from the
    /// bind address.
    #[arg(long)]
    pub external_host: Option<String>,
    /// Tasks run at once (default: --threads, else all cores).
    #[arg(long)]
    pub slots: Option<usize>,
    /// Folder for shuffle files and spills (default: a new folder under the OS temp folder).
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Seconds between heartbeats to the scheduler.
    #[arg(long, default_value_t = 5)]
    pub heartbeat: u64,
}

fn cli_error(e: ClusterError) -> CliError {
    if e.is_bad_input() {
        CliError::BadInput(e.to_string())
    } else {
        CliError::Internal(e.to_string())
    }
}

pub async fn scheduler(a: SchedulerArgs) -> Result<(), CliError> {
    let bind = cluster::parse_bind("--bind", &a.bind).map_err(cli_error)?;
    cluster::run_scheduler(cluster::SchedulerOptions {
        bind,
        external_host: a.external_host,
        executor_timeout_seconds: a.executor_timeout.max(2),
    })
    .await
    .map_err(cli_error)
}

pub async fn executor(a: ExecutorArgs) -> Result<(), CliError> {
    let scheduler = ClusterUrl::parse("--scheduler", &a.scheduler).map_err(cli_error)?;
    let bind = cluster::parse_bind("--bind", &a.bind).map_err(cli_error)?;
    let grpc_bind = a
        .grpc_bind
        .as_deref()
        .map(|g| cluster::parse_bind("--grpc-bind", g))
        .transpose()
        .map_err(cli_error)?;
    let r = crate::query::resources();
    cluster::run_executor(cluster::ExecutorOptions {
        scheduler,
        bind,
        grpc_bind,
        external_host: a.external_host,
        slots: a.slots.unwrap_or(r.threads).max(1),
        memory_limit: r.memory_limit,
        work_dir: a.work_dir,
        heartbeat_seconds: a.heartbeat,
    })
    .await
    .map_err(cli_error)
}
