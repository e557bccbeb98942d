//! The command line: one enum of verbs, dispatched in one `match`.

mod check;
#[cfg(feature = "ballista")]
mod cluster;
mod compare;
pub mod holdout;
mod import;
pub mod judge;
mod mock_server;
mod plan;
pub mod report;
mod rescore;
mod runs;
mod scorers;
mod sql;
mod suggest;
mod view;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::runner::{RunError, Runner};
use crate::stages::aggregate;

/// Exit codes from DESIGN.md.
pub const EXIT_GATE: u8 = 1;
pub const EXIT_BAD_INPUT: u8 = 2;
pub const EXIT_INTERNAL: u8 = 3;

/// An error at the CLI edge, with the exit code it maps to.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Run(#[from] RunError),
    #[error("{0}")]
    BadInput(String),
    #[error("{0}")]
    Gate(String),
    #[error("{0}")]
    Internal(String),
    /// SIGINT or SIGTERM stopped the command after it cleaned up (exit code 130).
    #[error("{0}")]
    Interrupted(String),
}

/// Wraps an I/O or engine failure at the CLI edge (exit code 3).
pub(crate) fn internal(e: impl std::fmt::Display) -> CliError {
    CliError::Internal(e.to_string())
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Run(e) if e.is_bad_input() => EXIT_BAD_INPUT,
            CliError::Run(_) | CliError::Internal(_) => EXIT_INTERNAL,
            CliError::BadInput(_) => EXIT_BAD_INPUT,
            CliError::Gate(_) => EXIT_GATE,
            CliError::Interrupted(_) => 130,
        }
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "evalflow",
    version,
    about = "Evaluate LLM applications with honest error bars"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Memory every query may use before it spills to disk (e.g. 1GiB, 512MB; default
    /// 1GiB, or the pipeline's `[run] memory_limit`). A query that cannot fit even with
    /// spilling fails with exit 2.
    #[arg(long, global = true, value_parser = crate::query::parse_bytes)]
    pub memory_limit: Option<usize>,
    /// Cores to use: partitions of every plan and parts processed at once (default: all).
    #[arg(long, global = true, value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// A verb that writes a run root waits for another writer of that root to finish,
    /// instead of exiting 2 naming it (one writer per root: docs/reliability.md).
    #[arg(long, global = true)]
    pub wait_lock: bool,
}

/// `--cluster df://HOST:PORT` of the query verbs (not global: `import --cluster` names the
/// field holding each case's template).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ClusterArg {
    /// Run this verb's plans on a Ballista cluster (df://HOST:PORT) instead of this machine.
    /// Needs evalflow built with the `ballista` feature; a plan the cluster cannot run fails
    /// naming what it lacks, never falling back to running here.
    #[arg(long = "cluster", value_name = "df://HOST:PORT")]
    pub url: Option<String>,
}

impl Cli {
    /// Sets the process-wide [`crate::query::Resources`] from the flags.
    pub fn apply_resources(&self) {
        crate::storage::lease::set_wait(self.wait_lock);
        crate::storage::lease::set_verb(self.command.verb());
        let mut r = crate::query::resources();
        if let Some(m) = self.memory_limit {
            r.memory_limit = m;
            crate::query::MEMORY_LIMIT_GIVEN.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(t) = self.threads {
            r.threads = t as usize;
            // Scoring runs on rayon's pool: the same number of cores. Fails only when the
            // pool already exists (a second call in one process), which keeps the first size.
            let _ = rayon::ThreadPoolBuilder::new()
                .num_threads(r.threads)
                .build_global();
        }
        crate::query::set_resources(r);
    }

    /// Checks `--cluster` against the verb and the build, and sets where plans run.
    ///
    /// # Errors
    /// [`CliError::BadInput`] for a verb that has no plans to submit, a bad URL, or a binary
    /// built without the `ballista` feature.
    pub fn apply_cluster(&self) -> Result<(), CliError> {
        let (verb, arg) = match &self.command {
            Command::Sql(a) => ("sql", &a.cluster),
            Command::Validate(a) => ("validate", &a.cluster),
            Command::Score(a) => ("score", &a.cluster),
            Command::Aggregate(a) => ("aggregate", &a.stage.cluster),
            Command::Rescore(a) => ("rescore", &a.cluster),
            Command::Compare(a) => ("compare", &a.cluster),
            Command::Report(a) => ("report", &a.cluster),
            Command::Run(a) | Command::Generate(a) | Command::Call(a) => {
                if let Some(url) = &a.cluster.url {
                    return Err(CliError::BadInput(format!(
                        "--cluster {url}: only sql, validate, score, aggregate, rescore, compare \
                         and report submit plans to a cluster"
                    )));
                }
                return Ok(());
            }
            _ => return Ok(()),
        };
        let Some(url) = &arg.url else {
            return Ok(());
        };
        #[cfg(feature = "ballista")]
        {
            let u = crate::cluster::ClusterUrl::parse("--cluster", url)
                .map_err(|e| CliError::BadInput(e.to_string()))?;
            // Said up front, rather than as a gRPC transport error from the first query.
            u.reachable(std::time::Duration::from_secs(10))
                .map_err(|e| CliError::Internal(format!("{verb}: {e}")))?;
            crate::query::set_cluster(Some(u));
            Ok(())
        }
        #[cfg(not(feature = "ballista"))]
        {
            Err(CliError::BadInput(format!(
                "{verb} --cluster {url}: this evalflow was built without the `ballista` cargo \
                 feature (cargo build --features ballista)"
            )))
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run all five stages and print failure rates with 95% intervals.
    Run(StageArgs),
    /// Expand the suite into the `cases` table.
    Generate(StageArgs),
    /// Call the model under test for every case (resumable).
    Call(StageArgs),
    /// Decide a validity verdict for every call.
    Validate(StageArgs),
    /// Score valid answers with the pipeline's scorers (`[score] scorers`, default checklist).
    Score(StageArgs),
    /// Aggregate scores into `results` and print them (`--scorer` picks any scorer version
    /// of the run, such as a user scorer of an imported run).
    Aggregate(AggregateArgs),
    /// Run SQL over run tables and Parquet files, with the statistics functions registered.
    Sql(sql::SqlArgs),
    /// Turn recorded runs (evalflow JSONL pairs, Parquet, OpenAI Batch output, Inspect AI
    /// logs, lm-eval samples, promptfoo results) into cases + calls, streaming.
    Import(import::ImportArgs),
    /// Serve a fault-injecting OpenAI / Anthropic mock for tests and dry runs.
    MockServer(mock_server::MockServerArgs),
    /// The six pre-flight checks, and the invalid-rate gate (--baseline).
    Check(check::CheckArgs),
    /// Re-score archived calls with another scorer version (no model calls) and diff.
    Rescore(rescore::RescoreArgs),
    /// List every scorer version of a run with its kind, metric, rows and definition.
    Scorers(scorers::ScorersArgs),
    /// Print a run's results (with Rogan-Gladen corrected class rates given a holdout) and
    /// write its HTML page.
    Report(report::ReportArgs),
    /// The hand-labelled holdout regression gate.
    #[command(subcommand)]
    Holdout(holdout::HoldoutCmd),
    /// Ask a model for fill-ins of a {mask} slot, to sort into lexicons (CheckList's
    /// masked-LM suggestions).
    Suggest(suggest::SuggestArgs),
    /// Learned judge aggregation: GBDT over checklist answers, SHAP, conformal intervals.
    #[command(subcommand)]
    Judge(judge::JudgeCmd),
    /// Compare two runs on the same cases: paired difference, clustered SE, MDE, verdict.
    Compare(compare::CompareArgs),
    /// Cases needed to detect a difference (Miller's formula, with the K-samples terms).
    Plan(plan::PlanArgs),
    /// Merge a run's small parts (the call stage's frequent commits) into large ones.
    Compact(CompactArgs),
    /// Check a run root against its manifest: every part decoded, row counts, duplicated
    /// ids, orphans, missing verdicts and scores (exit 1 naming each problem); `--repair`
    /// moves damaged parts aside so the next `run` re-does exactly their work.
    Verify(VerifyArgs),
    /// List the runs under a folder (default `runs/`): id, created, stages, scorers, rows.
    Runs(runs::RunsArgs),
    /// A run's stages and the batches a batch-mode call left open (ids, states).
    Status(runs::StatusArgs),
    /// Serve a read-only viewer of the runs under a folder (or one run, or an s3:// prefix):
    /// results with their intervals, every answer, scorer versions and runs side by side.
    View(view::ViewArgs),
    /// Start a Ballista scheduler with every evalflow function (the `ballista` feature).
    #[cfg(feature = "ballista")]
    Scheduler(cluster::SchedulerArgs),
    /// Start a Ballista executor with every evalflow function and object store (the
    /// `ballista` feature).
    #[cfg(feature = "ballista")]
    Executor(cluster::ExecutorArgs),
}

impl Command {
    /// The verb as typed, for the root's lease.
    pub fn verb(&self) -> &'static str {
        match self {
            Command::Run(_) => "run",
            Command::Generate(_) => "generate",
            Command::Call(_) => "call",
            Command::Validate(_) => "validate",
            Command::Score(_) => "score",
            Command::Aggregate(_) => "aggregate",
            Command::Sql(_) => "sql",
            Command::Import(_) => "import",
            Command::MockServer(_) => "mock-server",
            Command::Check(_) => "check",
            Command::Rescore(_) => "rescore",
            Command::Scorers(_) => "scorers",
            Command::Report(_) => "report",
            Command::Holdout(_) => "holdout",
            Command::Suggest(_) => "suggest",
            Command::Judge(_) => "judge",
            Command::Compare(_) => "compare",
            Command::Plan(_) => "plan",
            Command::Compact(_) => "compact",
            Command::Verify(_) => "verify",
            Command::Runs(_) => "runs",
            Command::Status(_) => "status",
            Command::View(_) => "view",
            #[cfg(feature = "ballista")]
            Command::Scheduler(_) => "scheduler",
            #[cfg(feature = "ballista")]
            Command::Executor(_) => "executor",
        }
    }
}

impl Command {
    /// Whether the verb does work beyond its output (writes a run: its stages, an import, a
    /// re-score, a compaction): a closed stdout or stderr must not end it as if it had
    /// finished. Its messages go through [`crate::progress::outln`] and `errln`, which drop a
    /// line on a closed pipe; src/main.rs exits non-zero on a broken pipe left anywhere else.
    /// The other verbs' output is their product: a reader gone (`sql ... | head`) ends them.
    pub fn writes_a_run(&self) -> bool {
        matches!(
            self,
            Command::Run(_)
                | Command::Generate(_)
                | Command::Call(_)
                | Command::Validate(_)
                | Command::Score(_)
                | Command::Aggregate(_)
                | Command::Import(_)
                | Command::Rescore(_)
                | Command::Compact(_)
        )
    }
}

/// Takes the lease of a root a verb writes (see [`crate::storage::lease`]): exit 2 naming
/// the holder when another process writes it.
pub(crate) async fn lease(
    store: &crate::storage::RunStore,
) -> Result<crate::storage::Lease, CliError> {
    crate::storage::Lease::acquire(store, crate::storage::lease::verb())
        .await
        .map_err(|e| {
            if e.is_bad_input() {
                CliError::BadInput(e.to_string())
            } else {
                internal(e)
            }
        })
}

#[derive(Debug, clap::Args)]
pub struct CompactArgs {
    /// The run root.
    pub run: String,
}

#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// The run root.
    pub run: String,
    /// Move damaged parts (and verdict or score parts whose calls are gone, after writing
    /// their other rows back) under `<root>/_damaged/`, never deleting them, and mark the
    /// stages that lost rows as not finished; exit 0 when done.
    #[arg(long)]
    pub repair: bool,
}

#[derive(Debug, clap::Args)]
pub struct StageArgs {
    /// The pipeline file (TOML).
    pub pipeline: PathBuf,
    /// The run root: a local path, memory://NAME or s3://bucket/prefix (default runs/<run_id>).
    #[arg(long)]
    pub out: Option<String>,
    #[command(flatten)]
    pub cluster: ClusterArg,
    /// validate and run: the answer languages validate accepts, comma-separated ISO 639-1
    /// codes (e.g. en,es; `und` accepts text too short to tell). Default: those the run was
    /// validated with, else the pipeline's. Other languages than the run's re-decide every
    /// verdict, without a new call or import.
    #[arg(long, value_delimiter = ',')]
    pub languages: Option<Vec<String>>,
    /// call, score and run: send again the calls that ended as provider errors (rate limits,
    /// 5xx, timeouts, malformed replies), replacing their rows in place as new attempts;
    /// answered calls are never sent again. On call, validate and score run again after it;
    /// on score (and run), a judge scorer's failed judge calls are sent again too.
    #[arg(long)]
    pub retry_errors: bool,
    /// call and run: send the model's requests through its provider's batch interface
    /// (OpenAI's Batch API): half the price, results within 24 hours; the same as
    /// `[model] batch = true` (docs/batch.md).
    #[arg(long)]
    pub batch: bool,
    /// call and run, in batch mode: submit the batches and exit; the next `call` or `run`
    /// on the root collects them (the manifest lists the open batches).
    #[arg(long)]
    pub no_wait: bool,
    /// aggregate and run: a stated latent ICC of the templates in [0, 1), as `[aggregate]
    /// icc`: each failure rate's interval also covers the exact one under a logit-normal
    /// template model at this ICC (docs/intervals.md says when to state one).
    #[arg(long, value_name = "RHO", value_parser = parse_icc)]
    pub icc: Option<f64>,
}

/// `--icc`: a latent ICC in [0, 1).
pub fn parse_icc(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if (0.0..1.0).contains(&r) => Ok(r),
        _ => Err(format!("a latent ICC is a number in [0, 1), got `{s}`")),
    }
}

#[derive(Debug, clap::Args)]
pub struct AggregateArgs {
    #[command(flatten)]
    pub stage: StageArgs,
    /// The scorer version aggregated, NAME@VERSION or NAME (the run's newest version of it);
    /// default: the pipeline's first `[score] scorers`. Any version scored in the run, such
    /// as a user scorer added by `rescore`.
    #[arg(long, value_name = "NAME[@VERSION]")]
    pub scorer: Option<String>,
}

/// Runs one parsed command.
pub async fn run(cli: Cli) -> Result<(), CliError> {
    cli.apply_resources();
    cli.apply_cluster()?;
    // On the heap: the verbs' futures together are large, and a host (the Python package)
    // runs a command on a thread with a small stack.
    let result = Box::pin(dispatch(cli)).await;
    let faults = crate::storage::retry::faults();
    if faults > 0 {
        crate::progress::errln!(
            "object store: {faults} transient fault(s) (5xx, 429, dropped connections) met and \
             retried (bounds: EVALFLOW_STORE_RETRIES, EVALFLOW_STORE_RETRY_SECS)"
        );
    }
    // The command's object-store leases were dropped with it: give them back now, so the
    // next writer need not wait for them to expire.
    crate::storage::lease::release_dropped().await;
    result
}

async fn dispatch(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        #[cfg(feature = "ballista")]
        Command::Scheduler(a) => cluster::scheduler(a).await,
        #[cfg(feature = "ballista")]
        Command::Executor(a) => cluster::executor(a).await,
        Command::Run(a) => {
            let out = match &a.out {
                Some(o) => o.clone(),
                None => match runs::unfinished_batch_root(&a.pipeline) {
                    Some(root) => {
                        crate::progress::errln!(
                            "{root}: this pipeline's run with batches still open: collecting \
                             them there (--out chooses another root)"
                        );
                        root
                    }
                    None => runs::fresh_root(&a.pipeline)?,
                },
            };
            let mut r = Runner::open(&a.pipeline, Some(&out)).await?;
            r.pipeline.aggregate.icc = a.icc.or(r.pipeline.aggregate.icc);
            r.languages = a.languages.clone();
            r.retry_errors = a.retry_errors;
            r.batch = a.batch;
            r.no_wait = a.no_wait;
            crate::progress::errln!("run root: {}", r.store.display());
            remember_root(r.store.display());
            if a.no_wait {
                r.generate().await?;
                let s = r.call().await?;
                if !s.open_batches.is_empty() {
                    let again = format!(
                        "evalflow run {} --batch --out {}",
                        a.pipeline.display(),
                        r.store.display()
                    );
                    print_open_batches(&s, r.store.display(), &again);
                    return Ok(());
                }
            }
            let rows = r.run_all().await?;
            crate::progress::outln!("run {} ({})\n", r.manifest.run_id, r.store.display());
            crate::progress::outln!("{}", aggregate::render(&rows));
            if let Some(h) = &r.pipeline.score.holdout {
                let path = r
                    .pipeline
                    .path
                    .parent()
                    .unwrap_or(std::path::Path::new("."))
                    .join(h);
                let labels = holdout::read_labels(&path)?;
                let scorer = r.prepared_scorers().await?.remove(0);
                let p = report::prevalence(&r.store, scorer.as_ref(), &labels).await?;
                crate::progress::outln!("\n{}", report::render_prevalence(&p, labels.len()));
            }
            let primary = r.prepared_scorers().await?.remove(0).id();
            let at = crate::report::write_for_run(&r.store, &r.manifest, &primary, rows)
                .await
                .map_err(internal)?;
            crate::progress::outln!("\nreport: {at}");
            Ok(())
        }
        Command::Generate(a) => {
            let mut r = open_stage(&a).await?;
            let n = r.generate().await?;
            crate::progress::outln!("cases: {n} rows in {}/cases", r.store.display());
            Ok(())
        }
        Command::Call(mut a) => {
            let retry = std::mem::take(&mut a.retry_errors);
            let (batch, no_wait) = (std::mem::take(&mut a.batch), std::mem::take(&mut a.no_wait));
            let mut r = open_stage(&a).await?;
            r.retry_errors = retry;
            r.batch = batch;
            r.no_wait = no_wait;
            let s = r.call().await?;
            if !s.open_batches.is_empty() {
                let again = format!(
                    "evalflow call {} --batch --out {}",
                    a.pipeline.display(),
                    r.store.display()
                );
                print_open_batches(&s, r.store.display(), &again);
                return Ok(());
            }
            crate::progress::outln!(
                "calls: {} rows in {}/calls ({} sent now, {} already committed, {} errors)",
                s.rows_total,
                r.store.display(),
                s.sent,
                s.skipped,
                s.errors
            );
            s.some_answered().map_err(|e| CliError::Run(e.into()))?;
            if s.retried > 0 {
                crate::progress::outln!(
                    "retried: {} error rows replaced by new attempts ({} still errors); run \
                     validate and score again",
                    s.retried,
                    s.error_rows
                );
            }
            Ok(())
        }
        Command::Validate(mut a) => {
            let languages = a.languages.take();
            let mut r = open_stage(&a).await?;
            r.languages = languages;
            let n = r.validate().await?;
            crate::progress::outln!("validity: {n} rows in {}/validity", r.store.display());
            Ok(())
        }
        Command::Score(mut a) => {
            let retry = std::mem::take(&mut a.retry_errors);
            let mut r = open_stage(&a).await?;
            r.retry_errors = retry;
            for s in r.prepared_scorers().await? {
                let n = r.score(s.as_ref()).await?;
                crate::progress::outln!(
                    "scores: {n} rows in {}/{}",
                    r.store.display(),
                    s.id().dir()
                );
            }
            Ok(())
        }
        Command::Aggregate(mut a) => {
            let icc = a.stage.icc.take();
            let mut r = open_stage(&a.stage).await?;
            r.pipeline.aggregate.icc = icc.or(r.pipeline.aggregate.icc);
            let primary = match &a.scorer {
                Some(spec) => report::scorer_of_run(&r.store, &r.manifest, spec).await?,
                None => r
                    .prepared_scorers()
                    .await?
                    .first()
                    .map(|s| s.id())
                    .ok_or_else(|| {
                        CliError::BadInput(format!(
                            "{}: [score] scorers is empty",
                            a.stage.pipeline.display()
                        ))
                    })?,
            };
            let rows = r.aggregate(&primary).await?;
            crate::progress::outln!("{}", aggregate::render(&rows));
            Ok(())
        }
        Command::Sql(a) => sql::run(a).await,
        Command::MockServer(a) => mock_server::run(a).await,
        Command::Import(a) => import::run(a).await,
        Command::Check(a) => check::run(a).await,
        Command::Rescore(a) => rescore::run(a).await,
        Command::Scorers(a) => scorers::run(a).await,
        Command::Holdout(c) => holdout::run(c).await,
        Command::Report(a) => report::run(a).await,
        Command::Suggest(a) => suggest::run(a).await,
        Command::Judge(c) => judge::run(c).await,
        Command::Compare(a) => compare::run(a).await,
        Command::Plan(a) => plan::run(a).await,
        Command::Runs(a) => runs::run(a).await,
        Command::Status(a) => runs::status(a).await,
        Command::View(a) => view::run(a).await,
        Command::Verify(a) => verify(a).await,
        Command::Compact(a) => {
            let (_, store, _) = crate::query::open_run(&a.run).await.map_err(|e| {
                if e.is_bad_input() {
                    CliError::BadInput(e.to_string())
                } else {
                    internal(e)
                }
            })?;
            let _lease = lease(&store).await?;
            // Read again under the lease: the writer it waited for may have changed it.
            let manifest = crate::storage::Manifest::load(&store)
                .await
                .map_err(internal)?
                .ok_or_else(|| internal(format!("{}: manifest.json is gone", store.display())))?;
            if let Some((stage, _)) = manifest
                .stages
                .iter()
                .find(|(_, r)| r.status == crate::storage::StageStatus::Running)
            {
                return Err(CliError::BadInput(format!(
                    "{}: stage `{stage}` is marked running: compact a run only while no stage writes it (rerun the stage to finish it first)",
                    store.display()
                )));
            }
            for c in crate::storage::compact::compact(&store)
                .await
                .map_err(internal)?
            {
                if c.parts_before > 0 {
                    crate::progress::outln!(
                        "{}: {} parts -> {} ({} rows)",
                        c.folder,
                        c.parts_before,
                        c.parts_after,
                        c.rows
                    );
                }
            }
            Ok(())
        }
    }
}

/// The root of the last `run` in this process: a library caller (the Python package's
/// `evalflow.run`) learns where a run without `--out` went, as the CLI user reads it on stderr.
static LAST_ROOT: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

fn remember_root(root: &str) {
    if let Ok(mut r) = LAST_ROOT.lock() {
        *r = Some(root.to_string());
    }
}

/// Whether the CLI runs inside another program (the Python package): then a command never
/// ends the process itself, it returns its error.
static EMBEDDED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Marks the CLI as embedded in a host process (see [`embedded`]).
pub fn set_embedded() {
    EMBEDDED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`set_embedded`] was called.
pub fn embedded() -> bool {
    EMBEDDED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Clean-ups a command asks for once its runtime has shut down (every task of a dropped plan
/// ended): in an embedded CLI they stand in for the process exit that a stopped command
/// otherwise ends with, so nothing written late by such a task survives.
static DEFERRED: std::sync::Mutex<Vec<Box<dyn FnOnce() + Send>>> =
    std::sync::Mutex::new(Vec::new());

/// Registers a clean-up for [`run_deferred`].
pub fn defer(f: impl FnOnce() + Send + 'static) {
    if let Ok(mut d) = DEFERRED.lock() {
        d.push(Box::new(f));
    }
}

/// Runs (and forgets) the clean-ups registered with [`defer`]; the host calls it after the
/// command's runtime has shut down.
pub fn run_deferred() {
    let fs = DEFERRED
        .lock()
        .map(|mut d| std::mem::take(&mut *d))
        .unwrap_or_default();
    for f in fs {
        f();
    }
}

/// A Ctrl-C that a host process (the Python package) caught itself: commands that clean up
/// on SIGINT (import) also watch this, and [`request_interrupt`] tells the host whether one
/// is watching (then it waits for the command to end; otherwise it drops the command).
static INTERRUPT: std::sync::LazyLock<tokio::sync::watch::Sender<u64>> =
    std::sync::LazyLock::new(|| tokio::sync::watch::channel(0).0);
static WATCHERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Asks the running command to stop as on SIGINT; true when a command is watching.
pub fn request_interrupt() -> bool {
    INTERRUPT.send_modify(|n| *n += 1);
    WATCHERS.load(std::sync::atomic::Ordering::SeqCst) > 0
}

/// Resolves at the next [`request_interrupt`]; counts as a watcher while it is alive.
pub fn interrupt_requested() -> impl std::future::Future<Output = ()> + Send {
    struct Watching;
    impl Drop for Watching {
        fn drop(&mut self) {
            WATCHERS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    WATCHERS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let guard = Watching;
    let mut rx = INTERRUPT.subscribe();
    rx.mark_unchanged();
    async move {
        let _guard = guard;
        let _ = rx.changed().await;
    }
}

/// What a batch-mode call that did not wait left open, and the command that collects it
/// (with `--out`: a `run` without it would otherwise make a new root).
fn print_open_batches(s: &crate::stages::call::CallStats, root: &str, again: &str) {
    crate::progress::outln!(
        "calls: {} rows in {root}/calls; {} batches open (`{again}` collects them):",
        s.rows_total,
        s.open_batches.len()
    );
    for b in &s.open_batches {
        crate::progress::outln!(
            "  {} (chunk {}): {} requests, {}",
            b.batch_id.as_deref().unwrap_or("-"),
            b.chunk,
            b.requests,
            b.status.as_deref().unwrap_or("not created")
        );
    }
}

/// Takes the root recorded by the last `run` of this process, if any.
pub fn take_last_root() -> Option<String> {
    LAST_ROOT.lock().ok().and_then(|mut r| r.take())
}

async fn open_stage(a: &StageArgs) -> Result<Runner, CliError> {
    if a.languages.is_some() {
        // Not ignored: only validate (and run) decide verdicts; validate takes it first.
        return Err(CliError::BadInput(
            "--languages is an option of validate and run only".into(),
        ));
    }
    if a.retry_errors {
        return Err(CliError::BadInput(
            "--retry-errors is an option of call, score and run only".into(),
        ));
    }
    if a.batch || a.no_wait {
        return Err(CliError::BadInput(
            "--batch and --no-wait are options of call and run only".into(),
        ));
    }
    if a.icc.is_some() {
        return Err(CliError::BadInput(
            "--icc is an option of aggregate and run only".into(),
        ));
    }
    if a.out.is_none() {
        return Err(CliError::BadInput(
            "a single stage needs --out <root> naming the run it reads and writes".into(),
        ));
    }
    Ok(Runner::open(&a.pipeline, a.out.as_deref()).await?)
}

/// `evalflow verify`: exit 1 naming every problem; with `--repair`, 0 once repaired.
async fn verify(a: VerifyArgs) -> Result<(), CliError> {
    let store =
        crate::storage::RunStore::open(&a.run).map_err(|e| CliError::BadInput(e.to_string()))?;
    let err = |e: crate::verify::VerifyError| match e {
        crate::verify::VerifyError::NotARun(_) => CliError::BadInput(e.to_string()),
        e => internal(e),
    };
    // Repair reads under the lease: another writer may be changing what it would move.
    let _lease = if a.repair {
        Some(lease(&store).await?)
    } else {
        None
    };
    let v = crate::verify::verify(&store).await.map_err(err)?;
    crate::progress::outln!("{}", crate::verify::render(&store, &v).trim_end());
    if v.problems.is_empty() {
        return Ok(());
    }
    if !a.repair {
        return Err(CliError::Gate(format!(
            "{}: {} problem(s); `evalflow verify {} --repair` moves damaged parts aside",
            store.display(),
            v.problems.len(),
            a.run
        )));
    }
    let r = crate::verify::repair(&store, &v).await.map_err(err)?;
    for (from, to) in &r.moved {
        crate::progress::outln!("moved {from} -> {to}");
    }
    if r.kept_rows > 0 {
        crate::progress::outln!(
            "wrote back {} rows of the parts moved for orphans",
            r.kept_rows
        );
    }
    if !r.reopened.is_empty() {
        crate::progress::outln!(
            "reopened: {} (the next `evalflow run PIPELINE --out {}` re-does their missing work)",
            r.reopened.join(", "),
            a.run
        );
    }
    Ok(())
}
