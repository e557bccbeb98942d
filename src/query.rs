//! A DataFusion session with a run's tables and every evalflow function registered.
//!
//! Used by `evalflow sql` and by stages that join tables (score, aggregate), so a user's
//! ad-hoc SQL sees exactly what the stages see.

use std::sync::Arc;

use datafusion::arrow::array::Array;
use datafusion::datasource::MemTable;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::error::DataFusionError;
use datafusion::execution::disk_manager::DiskManagerBuilder;
use datafusion::execution::memory_pool::FairSpillPool;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};

use crate::schema::Table;
use crate::storage::{RunStore, StorageError};
use crate::udaf::dictionary_keys::DictionaryClusterKeys;
use crate::udaf::single_phase::SinglePhaseClustered;

#[cfg(feature = "ballista")]
pub use crate::cluster::NOT_ON_CLUSTER;

mod views;
pub use views::without_views;

/// Errors while registering or running queries.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The plan needed more memory than `--memory-limit` even after spilling: a setting the
    /// user chooses (exit 2), never a half-written part.
    #[error(
        "{context}: the memory limit of {} is too small for this query even with spilling to disk (raise --memory-limit or [run] \
         memory_limit): {msg}",
        format_bytes(*limit)
    )]
    Memory {
        context: String,
        limit: usize,
        msg: String,
    },
    #[error("{context}: {source}")]
    DataFusion {
        context: String,
        #[source]
        source: DataFusionError,
    },
}

impl QueryError {
    /// Wraps a DataFusion error with what was being done; a memory-pool refusal becomes
    /// [`QueryError::Memory`] naming the limit.
    pub fn df(context: impl Into<String>) -> impl FnOnce(DataFusionError) -> QueryError {
        let context = context.into();
        move |source| match source.find_root() {
            DataFusionError::ResourcesExhausted(msg) => QueryError::Memory {
                context,
                limit: resources().memory_limit,
                msg: msg.clone(),
            },
            _ => QueryError::DataFusion { context, source },
        }
    }

    /// Whether the error is the user's input or setting (exit 2) rather than a failure.
    pub fn is_bad_input(&self) -> bool {
        match self {
            QueryError::Storage(e) => e.is_bad_input(),
            QueryError::Memory { .. } => true,
            // A plan the cluster cannot run (a table or function it lacks) is the user's.
            #[cfg(feature = "ballista")]
            QueryError::DataFusion { source, .. } => source.to_string().contains(NOT_ON_CLUSTER),
            #[cfg(not(feature = "ballista"))]
            QueryError::DataFusion { .. } => false,
        }
    }
}

/// How much memory and how many cores every query may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resources {
    /// Bytes of the memory pool shared by every operator of a query; operators that can
    /// spill (sort, hash aggregate, ...) go to disk beyond it.
    pub memory_limit: usize,
    /// Partitions of a plan (and stages' parts processed at once).
    pub threads: usize,
}

/// The default memory limit: 1 GiB (DESIGN.md).
pub const DEFAULT_MEMORY_LIMIT: usize = 1 << 30;

impl Default for Resources {
    fn default() -> Self {
        Resources {
            memory_limit: DEFAULT_MEMORY_LIMIT,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

static RESOURCES: std::sync::RwLock<Option<Resources>> = std::sync::RwLock::new(None);

/// The resources set by `--memory-limit` / `--threads` (or the defaults).
pub fn resources() -> Resources {
    RESOURCES.read().ok().and_then(|r| *r).unwrap_or_default()
}

/// Whether the memory limit was given explicitly (`--memory-limit`, or the Python verbs'
/// `memory_limit=`): it then wins over a pipeline's `[run] memory_limit`.
pub static MEMORY_LIMIT_GIVEN: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Sets the resources every later context gets (the CLI does, once, before any query).
pub fn set_resources(r: Resources) {
    if let Ok(mut g) = RESOURCES.write() {
        *g = Some(r);
    }
}

/// Parses a size such as `1GiB`, `512MB`, `2g`, `800M` or a number of bytes. K, M, G and T
/// are binary (1024-based) with or without `i`/`B`, as memory limits usually are.
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}`: not a size (for example 1GiB, 512MB, 2000000)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" | "tib" => 1024.0f64.powi(4),
        u => return Err(format!("`{s}`: unknown unit `{u}` (use K, M, G or T)")),
    };
    let bytes = n * mult;
    if !(bytes >= 1.0 && bytes.is_finite()) {
        return Err(format!("`{s}`: must be at least 1 byte"));
    }
    Ok(bytes as usize)
}

/// A size for messages: `1.0 GiB`, `64.0 MiB`, `900 B`.
pub fn format_bytes(n: usize) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

/// The cluster `--cluster df://HOST:PORT` names, if any: every later [`new_context`]
/// submits its plans there.
#[cfg(feature = "ballista")]
static CLUSTER: std::sync::RwLock<Option<crate::cluster::ClusterUrl>> =
    std::sync::RwLock::new(None);

/// Makes every later [`new_context`] run its plans on the Ballista cluster at `url` (the
/// CLI does, once, for `--cluster`).
#[cfg(feature = "ballista")]
pub fn set_cluster(url: Option<crate::cluster::ClusterUrl>) {
    if let Ok(mut g) = CLUSTER.write() {
        *g = url;
    }
}

/// The cluster plans are submitted to, if any.
#[cfg(feature = "ballista")]
pub fn cluster() -> Option<crate::cluster::ClusterUrl> {
    CLUSTER.read().ok().and_then(|c| c.clone())
}

/// Whether plans run on a cluster (always false without the `ballista` feature).
pub fn on_cluster() -> bool {
    #[cfg(feature = "ballista")]
    {
        cluster().is_some()
    }
    #[cfg(not(feature = "ballista"))]
    {
        false
    }
}

/// A session with evalflow's functions registered, plain Utf8 strings (so stages can
/// read string columns without view types), [`resources`]' partitions, and a fair spill
/// pool of [`Resources::memory_limit`] with a disk manager: sorts and aggregations spill
/// to the OS temp folder instead of growing past the limit.
///
/// With `--cluster` (the `ballista` feature), the same session submits its plans to the
/// cluster ([`crate::cluster::remote_context`]); plans that cannot run there fail naming
/// the table or function, they never fall back to running here.
pub fn new_context() -> SessionContext {
    on_cluster_if_set(local_context())
}

/// [`new_context`] for a user's ad-hoc SQL (`evalflow sql`): string columns of plain
/// Parquet are read as Utf8View, as DataFusion's default does. A `GROUP BY` on a string
/// column (`model`) read as views skips copying every row's string out of the page's
/// dictionary and hashes short keys inline: on a 20M-row file written by pyarrow, `SELECT
/// model, sum(score) ... GROUP BY model` took 0.23 s instead of 0.69 s. Results are cast
/// back to Utf8 before they are written ([`without_views`]), so output types do not change.
pub fn sql_context() -> SessionContext {
    on_cluster_if_set(context_with(resources().threads.max(1), true, true))
}

fn on_cluster_if_set(ctx: SessionContext) -> SessionContext {
    #[cfg(feature = "ballista")]
    if let Some(url) = cluster() {
        // Upgrading a session for Ballista builds a planner and connects nothing: it
        // cannot fail for a URL `ClusterUrl::parse` accepted.
        return crate::cluster::remote_context(&url, ctx)
            .expect("a Ballista session for a parsed df:// URL");
    }
    ctx
}

/// [`new_context`] on this machine, whatever `--cluster` says.
pub fn local_context() -> SessionContext {
    context_with(resources().threads.max(1), true, false)
}

/// Turns on Parquet filter pushdown for `ctx`: a filter (or a join's dynamic filter) is
/// evaluated while a part is decoded, so the other columns are decoded for its rows only.
pub fn with_pushdown(ctx: SessionContext) -> SessionContext {
    ctx.state_ref()
        .write()
        .config_mut()
        .options_mut()
        .execution
        .parquet
        .pushdown_filters = true;
    ctx
}

/// A local context whose plans run in one partition in the order written (no
/// statistics-driven join swaps): for a stream whose order matters, such as the call
/// stage's requests (the call stage never runs on a cluster).
pub fn ordered_context() -> SessionContext {
    context_with(1, false, false)
}

fn context_with(partitions: usize, join_reordering: bool, views: bool) -> SessionContext {
    let r = resources();
    let config = SessionConfig::new()
        .with_target_partitions(partitions)
        .set_bool("datafusion.optimizer.join_reordering", join_reordering)
        .set_bool(
            "datafusion.execution.parquet.schema_force_view_types",
            views,
        )
        .set_bool("datafusion.sql_parser.map_string_types_to_utf8view", false)
        // evalflow's footers are a few KB: reading the last 512 KiB of every part (the
        // default) to find one held 30 MB more at 10M calls (~300 parts, 32 read at once).
        .set_usize("datafusion.execution.parquet.metadata_size_hint", 64 << 10)
        // A sort reserves this much to merge its spill files; DataFusion's 10 MiB default
        // would make a small limit fail instead of spill.
        .set_usize(
            "datafusion.execution.sort_spill_reservation_bytes",
            (r.memory_limit / 16).min(10 << 20),
        );
    let runtime = RuntimeEnvBuilder::new()
        .with_memory_pool(Arc::new(FairSpillPool::new(r.memory_limit)))
        .with_disk_manager_builder(DiskManagerBuilder::default())
        .build_arc()
        .expect("a runtime with the OS temp folder for spills");
    // Clustered aggregates over a Parquet scan read their cluster keys as dictionaries.
    let footers = runtime.cache_manager.get_file_metadata_cache();
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_runtime_env(runtime)
        .with_default_features()
        // Clustered aggregates hold their groups' templates once, over every partition's rows.
        .with_physical_optimizer_rule(Arc::new(SinglePhaseClustered))
        .with_physical_optimizer_rule(Arc::new(DictionaryClusterKeys::new(footers)))
        .build();
    let ctx = SessionContext::new_with_state(state);
    crate::udaf::register_all(&ctx);
    ctx
}

/// `passes` (1 to 256) SQL conditions slicing the hex digest `column` by its first two
/// digits: together they take every id exactly once (the first and last are open-ended, so
/// even an id that is not hex falls in one; a single pass is `TRUE`). A join or `GROUP BY`
/// over ids run slice by slice holds one slice's ids at a time, however large the table;
/// with 256 prefixes, `n` passes hold within 1/256 of `1/n` of the ids each.
pub fn id_slices(column: &str, passes: usize) -> Vec<String> {
    const PREFIXES: usize = 256;
    let passes = passes.clamp(1, PREFIXES);
    (0..passes)
        .map(|p| {
            let (lo, hi) = (p * PREFIXES / passes, (p + 1) * PREFIXES / passes);
            let mut bounds = Vec::new();
            if lo > 0 {
                bounds.push(format!("{column} >= '{lo:02x}'"));
            }
            if hi < PREFIXES {
                bounds.push(format!("{column} < '{hi:02x}'"));
            }
            if bounds.is_empty() {
                "TRUE".into()
            } else {
                bounds.join(" AND ")
            }
        })
        .collect()
}

/// Runs `sql` and hands each result batch to `f`, never holding the whole result.
pub async fn for_each_batch(
    ctx: &SessionContext,
    sql: &str,
    mut f: impl FnMut(&datafusion::arrow::array::RecordBatch) -> Result<(), QueryError>,
) -> Result<(), QueryError> {
    use futures::StreamExt;
    let mut stream = ctx
        .sql(sql)
        .await
        .map_err(QueryError::df(sql.to_string()))?
        .execute_stream()
        .await
        .map_err(QueryError::df(sql.to_string()))?;
    while let Some(b) = stream.next().await {
        f(&b.map_err(QueryError::df(sql.to_string()))?)?;
    }
    Ok(())
}

/// A query run on its own task, its batches read in order by [`Batches::next`]: a caller
/// that folds one query's output on its own thread starts the next query first, so the
/// pool scans and aggregates while the fold runs.
pub struct Batches {
    rx: tokio::sync::mpsc::Receiver<datafusion::arrow::array::RecordBatch>,
    task: Option<tokio::task::JoinHandle<Result<(), QueryError>>>,
    sql: String,
}

impl Batches {
    /// Starts `sql`; at most two batches wait for the reader.
    pub fn spawn(ctx: &SessionContext, sql: String) -> Self {
        use futures::StreamExt;
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let (ctx, query) = (ctx.clone(), sql.clone());
        let task = tokio::spawn(async move {
            let mut stream = ctx
                .sql(&query)
                .await
                .map_err(QueryError::df(query.clone()))?
                .execute_stream()
                .await
                .map_err(QueryError::df(query.clone()))?;
            while let Some(b) = stream.next().await {
                let b = b.map_err(QueryError::df(query.clone()))?;
                // The reader stopped (it failed): so does the query.
                if tx.send(b).await.is_err() {
                    break;
                }
            }
            Ok(())
        });
        Batches {
            rx,
            task: Some(task),
            sql,
        }
    }

    /// The next batch; `None` once the query is done.
    ///
    /// # Errors
    /// The query's error (or its task's panic), after the batches before it.
    pub async fn next(
        &mut self,
    ) -> Result<Option<datafusion::arrow::array::RecordBatch>, QueryError> {
        if let Some(b) = self.rx.recv().await {
            return Ok(Some(b));
        }
        match self.task.take() {
            None => Ok(None),
            Some(task) => match task.await {
                Ok(done) => done.map(|()| None),
                Err(e) => Err(QueryError::df(self.sql.clone())(DataFusionError::External(
                    Box::new(e),
                ))),
            },
        }
    }
}

/// About `passes` SQL conditions slicing `column` (a string column of the rows of `source`, a
/// `FROM ... WHERE ...` clause holding `rows` rows) into ranges of similar row counts: the
/// bounds are quantiles of a sample of every k-th row's value, read in one scan of the
/// column. Together they take every row exactly once (NULL goes with the first range); one
/// pass is `TRUE`; a value holding more than a slice's share of the rows makes fewer slices.
/// A `GROUP BY column` (or a clustered statistic over it) run slice by slice holds one
/// slice's keys at a time, whatever the keys look like ([`id_slices`] needs hex ids).
pub async fn range_slices(
    ctx: &SessionContext,
    column: &str,
    source: &str,
    rows: u64,
    passes: usize,
) -> Result<Vec<String>, QueryError> {
    use datafusion::arrow::compute::cast;
    use datafusion::arrow::datatypes::DataType;
    if passes <= 1 {
        return Ok(vec!["TRUE".into()]);
    }
    // About 256 sampled rows per slice: bounds within a few percent of the quantiles.
    let stride = (rows / (passes as u64 * 256)).max(1);
    let sql = format!("SELECT {column} FROM {source}");
    let what = format!("slicing {column}: {sql}");
    let (mut sample, mut seen) = (Vec::new(), 0u64);
    for_each_batch(ctx, &sql, |b| {
        let col = cast(b.column(0), &DataType::Utf8)
            .map_err(|e| QueryError::df(what.clone())(e.into()))?;
        let col = col
            .as_any()
            .downcast_ref::<datafusion::arrow::array::StringArray>()
            .expect("cast to Utf8 gives a StringArray");
        // The rows of this batch whose running index is a multiple of `stride`.
        let first = (stride - seen % stride) % stride;
        for i in (first as usize..col.len()).step_by(stride as usize) {
            if col.is_valid(i) {
                sample.push(col.value(i).to_string());
            }
        }
        seen += col.len() as u64;
        Ok(())
    })
    .await?;
    sample.sort_unstable();
    let mut bounds: Vec<&str> = (1..passes)
        .filter_map(|j| sample.get(j * sample.len() / passes).map(String::as_str))
        .collect();
    bounds.dedup();
    let lit = |v: &str| format!("'{}'", v.replace('\'', "''"));
    let mut out = Vec::with_capacity(bounds.len() + 1);
    for (j, b) in bounds.iter().enumerate() {
        out.push(match j {
            0 => format!("({column} < {} OR {column} IS NULL)", lit(b)),
            _ => format!(
                "({column} >= {} AND {column} < {})",
                lit(bounds[j - 1]),
                lit(b)
            ),
        });
    }
    out.push(match bounds.last() {
        Some(b) => format!("{column} >= {}", lit(b)),
        None => "TRUE".into(),
    });
    Ok(out)
}

/// Tunes `ctx` for queries grouping by template slice by slice ([`range_slices`]): a
/// template's rows are few, so a partial aggregate per partition would hold nearly every
/// template a second time (rows go straight to the final aggregate instead), and the slice's
/// range filter is applied while decoding, so the other columns are decoded for its rows
/// only. Measured on the 10M corpus bench's aggregate in slices of 1M rows: 272 MB and 4.7 s
/// against 344 MB and 5.2 s.
pub fn for_template_slices(ctx: &SessionContext) {
    let state = ctx.state_ref();
    let mut state = state.write();
    let opts = state.config_mut().options_mut();
    opts.execution
        .skip_partial_aggregation_probe_ratio_threshold = 0.1;
    opts.execution.parquet.pushdown_filters = true;
}

/// Registers a Parquet folder or file (any URL DataFusion can list) as `name`.
pub async fn register_parquet(
    ctx: &SessionContext,
    name: &str,
    url: &str,
) -> Result<(), QueryError> {
    // A user's file is read as the session reads strings (views for `evalflow sql`).
    register_paths(ctx, name, &[url.to_string()], false).await
}

/// Listing options for `.parquet` files with the session's Parquet options; `utf8` reads
/// strings as Utf8 whatever the session says (a run's own tables, whose declared schemas
/// say Utf8: a sort of their answers read as views would account each batch with the whole
/// page it points into, and fail under a small `--memory-limit` instead of spilling).
fn parquet_listing(ctx: &SessionContext, utf8: bool) -> ListingOptions {
    let mut options = ctx.state().table_options().parquet.clone();
    if utf8 {
        options.global.schema_force_view_types = false;
    }
    let format = ParquetFormat::default().with_options(options);
    ListingOptions::new(Arc::new(format)).with_file_extension(".parquet")
}

/// Registers several Parquet folders or files as one table `name`, strings as Utf8.
pub async fn register_parquet_paths(
    ctx: &SessionContext,
    name: &str,
    urls: &[String],
) -> Result<(), QueryError> {
    register_paths(ctx, name, urls, true).await
}

/// [`register_parquet_paths`]; `utf8`: see [`parquet_listing`].
async fn register_paths(
    ctx: &SessionContext,
    name: &str,
    urls: &[String],
    utf8: bool,
) -> Result<(), QueryError> {
    let what = format!("table `{name}` ({})", urls.join(", "));
    // A table on an object store (`s3://`, `memory://`) needs that store registered,
    // exactly as a run root's is.
    for url in urls {
        RunStore::register_url(ctx, url)?;
    }
    let table_urls = urls
        .iter()
        .map(ListingTableUrl::parse)
        .collect::<Result<Vec<_>, _>>()
        .map_err(QueryError::df(what.clone()))?;
    let options = parquet_listing(ctx, utf8);
    let schema = options
        .infer_schema(&ctx.state(), &table_urls[0])
        .await
        .map_err(QueryError::df(format!(
            "{what}: reading the Parquet schema"
        )))?;
    let config = ListingTableConfig::new_with_multi_paths(table_urls)
        .with_listing_options(options)
        .with_schema(schema);
    let table = ListingTable::try_new(config).map_err(QueryError::df(what.clone()))?;
    ctx.register_table(name, Arc::new(table))
        .map_err(QueryError::df(format!("registering {what}")))?;
    Ok(())
}

/// Registers the five tables of a run as `<prefix>cases`, `<prefix>calls`, ...; a table
/// with no parts yet is registered empty with its declared schema.
///
/// # Errors
/// [`StorageError::Schema`] naming the part file and column when a part does not fit its
/// declared schema; [`StorageError::CorruptPart`] when a part is not readable Parquet.
pub async fn register_run(
    ctx: &SessionContext,
    store: &RunStore,
    prefix: &str,
) -> Result<(), QueryError> {
    register_tables(ctx, store, prefix, &Table::ALL).await
}

/// Registers some of a run's tables, as [`register_run`] does all five: a stage that reads
/// one table does not check (and hold) the footers of every part of the others.
pub async fn register_tables(
    ctx: &SessionContext,
    store: &RunStore,
    prefix: &str,
    tables: &[Table],
) -> Result<(), QueryError> {
    crate::storage::compact::finish_pending(store).await?;
    store.register_with(ctx);
    for &t in tables {
        let rel = [t.name().to_string()];
        register_folders(ctx, store, &format!("{prefix}{}", t.name()), t, &rel).await?;
    }
    Ok(())
}

/// Registers the five tables of a run as [`register_run`] does, but writes nothing: a
/// compaction a crash left pending is not finished (the viewer reads roots it must not
/// change). Every part's footer is checked as there.
pub async fn register_run_read_only(
    ctx: &SessionContext,
    store: &RunStore,
) -> Result<(), QueryError> {
    register_run_read_only_as(ctx, store, "").await
}

/// [`register_run_read_only`] with the tables named `<prefix>cases`, ... (`a_`, `b_` for
/// two runs compared).
pub async fn register_run_read_only_as(
    ctx: &SessionContext,
    store: &RunStore,
    prefix: &str,
) -> Result<(), QueryError> {
    store.register_with(ctx);
    for t in Table::ALL {
        let rel = [t.name().to_string()];
        register_folders(ctx, store, &format!("{prefix}{}", t.name()), t, &rel).await?;
    }
    Ok(())
}

/// Registers `scores` as the folders of some scorer versions only
/// (`scores/<name>@<version>/`): a stage about one version (or a diff of two) neither lists
/// nor holds the footers of the other versions' parts.
pub async fn register_scores_of(
    ctx: &SessionContext,
    store: &RunStore,
    scorers: &[&crate::config::ScorerId],
) -> Result<(), QueryError> {
    crate::storage::compact::finish_pending(store).await?;
    store.register_with(ctx);
    let dirs: Vec<String> = scorers.iter().map(|s| s.dir()).collect();
    register_folders(ctx, store, "scores", Table::Scores, &dirs).await
}

/// Registers the parts under the folders `rels` as one table `name` of schema `t`, each
/// part checked; a table with no parts is registered empty with its declared schema.
async fn register_folders(
    ctx: &SessionContext,
    store: &RunStore,
    name: &str,
    t: Table,
    rels: &[String],
) -> Result<(), QueryError> {
    let mut parts = Vec::new();
    for rel in rels {
        parts.extend(store.list_parts(rel).await?);
    }
    check_parts(store, &parts, t).await?;
    if parts.is_empty() && on_cluster() {
        // An in-memory table cannot be shipped: the cluster reads the table's (empty or
        // missing) folder with its declared schema instead.
        let rel = rels.first().map_or(t.name(), |r| r.as_str());
        return register_empty_listing(ctx, name, &store.table_url(rel), t.schema());
    }
    if parts.is_empty() {
        let empty = MemTable::try_new(t.schema(), vec![vec![]])
            .map_err(QueryError::df(name.to_string()))?;
        ctx.register_table(name, Arc::new(empty))
            .map_err(QueryError::df(name.to_string()))?;
        return Ok(());
    }
    // `scores/` holds one folder per scorer version; each folder is one listing path.
    let mut dirs: Vec<String> = parts
        .iter()
        .filter_map(|p| {
            let full = p.location.as_ref();
            let rel = full
                .strip_prefix(store.path("").as_ref())?
                .trim_start_matches('/');
            Some(rel.rsplit_once('/').map_or("", |(d, _)| d).to_string())
        })
        .collect();
    dirs.dedup();
    let urls: Vec<String> = dirs.iter().map(|d| store.table_url(d)).collect();
    register_parquet_paths(ctx, name, &urls).await
}

/// Registers `url` (a folder with no parts yet) as a Parquet table of `schema`.
fn register_empty_listing(
    ctx: &SessionContext,
    name: &str,
    url: &str,
    schema: datafusion::arrow::datatypes::SchemaRef,
) -> Result<(), QueryError> {
    let what = format!("table `{name}` ({url})");
    let table_url = ListingTableUrl::parse(url).map_err(QueryError::df(what.clone()))?;
    let config = ListingTableConfig::new(table_url)
        .with_listing_options(parquet_listing(ctx, true))
        .with_schema(schema);
    let table = ListingTable::try_new(config).map_err(QueryError::df(what.clone()))?;
    ctx.register_table(name, Arc::new(table))
        .map_err(QueryError::df(format!("registering {what}")))?;
    Ok(())
}

/// Checks that every part of every table of a run fits `schemas/<table>.json` (footers
/// only, no rows are read): a hand-edited part fails with its file and column, not as a
/// panic in a stage that downcasts the column. Stages call it before they record that
/// they started, so a bad run is refused with its root untouched.
///
/// # Errors
/// [`StorageError::Schema`] naming the part and column, [`StorageError::CorruptPart`] for a
/// part that is not readable Parquet.
pub async fn check_tables(store: &RunStore) -> Result<(), StorageError> {
    crate::storage::compact::finish_pending(store).await?;
    for t in Table::ALL {
        let parts = store.list_parts(t.name()).await?;
        check_parts(store, &parts, t).await?;
    }
    Ok(())
}

/// Explains a query that failed while decoding a run's Parquet (invalid UTF-8 in a text
/// column of a hand-edited part, a corrupt page): the error is replaced by one naming the
/// part and its rows (see [`locate_unreadable_part`]). Any other error is returned as is.
pub async fn explain_read_error(store: &RunStore, e: QueryError) -> QueryError {
    match &e {
        QueryError::DataFusion { source, .. } if source.to_string().contains("Parquet") => {
            match locate_unreadable_part(store).await {
                Some(s) => QueryError::Storage(s),
                None => e,
            }
        }
        _ => e,
    }
}

/// The first part of the run that does not decode in full, as an error naming the part
/// and the rows that fail. The footers were checked already, so this reads every part:
/// it runs on a failure path only.
pub async fn locate_unreadable_part(store: &RunStore) -> Option<StorageError> {
    use futures::TryStreamExt;
    for t in Table::ALL {
        for p in store.list_parts(t.name()).await.ok()? {
            let res = match store.read_part(&p, t).await {
                Ok(s) => s.try_for_each(|_| futures::future::ready(Ok(()))).await,
                Err(err) => Err(err),
            };
            if let Err(err) = res {
                return Some(err);
            }
        }
    }
    None
}

async fn check_parts(
    store: &RunStore,
    parts: &[object_store::ObjectMeta],
    t: Table,
) -> Result<(), StorageError> {
    for p in parts {
        store.check_part(p, t).await?;
    }
    Ok(())
}

/// Runs `sql` and returns every cell rendered as text (NULL as `None`): for reports,
/// whose queries return a handful of rows.
pub async fn text_rows(
    ctx: &SessionContext,
    sql: &str,
) -> Result<Vec<Vec<Option<String>>>, QueryError> {
    use datafusion::arrow::util::display::array_value_to_string;
    let mut out = Vec::new();
    for_each_batch(ctx, sql, |b| {
        for i in 0..b.num_rows() {
            out.push(
                b.columns()
                    .iter()
                    .map(|c| {
                        (!c.is_null(i)).then(|| array_value_to_string(c, i).unwrap_or_default())
                    })
                    .collect(),
            );
        }
        Ok(())
    })
    .await?;
    Ok(out)
}

/// Opens an existing run root (it must have a manifest) and registers its tables.
pub async fn open_run(
    root: &str,
) -> Result<(SessionContext, RunStore, crate::storage::Manifest), QueryError> {
    let store = RunStore::open(root)?;
    let manifest = crate::storage::Manifest::load(&store)
        .await?
        .ok_or_else(|| StorageError::BadRoot {
            root: root.to_string(),
            msg: "not an evalflow run (no manifest.json)".into(),
        })?;
    let ctx = new_context();
    register_run(&ctx, &store, "").await?;
    Ok((ctx, store, manifest))
}

#[cfg(test)]
mod tests {
    use super::id_slices;

    /// `evalflow sql`'s results have Utf8 where the session read views, also inside structs
    /// and lists, with the same values; other columns are untouched.
    #[tokio::test]
    async fn results_read_as_views_are_written_as_utf8() {
        use datafusion::arrow::datatypes::{DataType, Field};
        use datafusion::arrow::util::pretty::pretty_format_batches;
        let ctx = super::sql_context();
        let df = ctx
            .sql(
                "SELECT arrow_cast('a', 'Utf8View') AS s, \
                 named_struct('x', arrow_cast('b', 'Utf8View'), 'y', 2) AS st, \
                 make_array(arrow_cast('c', 'Utf8View')) AS l, 1 AS n, 'd' AS plain",
            )
            .await
            .unwrap();
        // One literal row: collecting it is bounded.
        let before = pretty_format_batches(&df.clone().collect().await.unwrap())
            .unwrap()
            .to_string();
        let df = super::without_views(df).unwrap();
        let types: Vec<DataType> = df
            .schema()
            .fields()
            .iter()
            .map(|f| f.data_type().clone())
            .collect();
        assert_eq!(types[0], DataType::Utf8);
        let DataType::Struct(fs) = &types[1] else {
            panic!("{:?}", types[1])
        };
        assert_eq!(fs[0].data_type(), &DataType::Utf8);
        assert_eq!(fs[1].data_type(), &DataType::Int64);
        let DataType::List(item) = &types[2] else {
            panic!("{:?}", types[2])
        };
        assert_eq!(item.data_type(), &DataType::Utf8);
        assert_eq!(types[3], DataType::Int64);
        assert_eq!(types[4], DataType::Utf8);
        let names: Vec<&str> = df
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        assert_eq!(names, ["s", "st", "l", "n", "plain"]);
        let batches = df.collect().await.unwrap();
        assert_eq!(
            batches[0].schema().field(0),
            &Field::new("s", DataType::Utf8, false)
        );
        assert_eq!(pretty_format_batches(&batches).unwrap().to_string(), before);
    }

    /// A spawned query's batches arrive whole and in order, then `None`; a query that fails
    /// when planned, or while it runs, gives its error from `next`, naming the query.
    #[tokio::test]
    async fn spawned_batches_come_in_order_and_errors_reach_the_reader() {
        use datafusion::arrow::array::AsArray;
        use datafusion::arrow::datatypes::Int64Type;
        let ctx = super::new_context();
        let mut b = super::Batches::spawn(
            &ctx,
            "SELECT value * 2 AS v FROM generate_series(1, 20000) ORDER BY value".into(),
        );
        let mut got = Vec::new();
        while let Some(batch) = b.next().await.unwrap() {
            got.extend(
                batch
                    .column(0)
                    .as_primitive::<Int64Type>()
                    .values()
                    .iter()
                    .copied(),
            );
        }
        assert_eq!(got, (1..=20000).map(|v| v * 2).collect::<Vec<i64>>());
        assert!(b.next().await.unwrap().is_none());
        let mut missing = super::Batches::spawn(&ctx, "SELECT x FROM no_such_table".into());
        let e = missing.next().await.unwrap_err().to_string();
        assert!(e.contains("no_such_table"), "{e}");
        let mut failing = super::Batches::spawn(
            &ctx,
            "SELECT CAST(CASE WHEN value > 15000 THEN 'x' ELSE '1' END AS INT) FROM generate_series(1, 20000)"
                .into(),
        );
        let mut err = None;
        loop {
            match failing.next().await {
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(e) => {
                    err = Some(e.to_string());
                    break;
                }
            }
        }
        let err = err.expect("the cast fails while the query runs");
        assert!(err.contains("CAST") || err.contains("Cannot cast"), "{err}");
    }

    /// `register_scores_of` registers the named versions' folders and nothing else: a stage
    /// about one version does not read (or list) the others.
    #[tokio::test]
    async fn scores_of_some_versions_only() {
        use crate::schema::Table;
        use crate::stages::score::ScorerId;
        use crate::storage::RunStore;
        use datafusion::arrow::array::{
            ArrayRef, BooleanArray, Float64Array, Int32Array, RecordBatch, StringArray,
            new_null_array,
        };
        use datafusion::arrow::datatypes::DataType;
        use std::sync::Arc;
        let store = RunStore::open("memory://scores-of/run").unwrap();
        let schema = Table::Scores.schema();
        let rows = |n: usize| {
            let cols: Vec<ArrayRef> = schema
                .fields()
                .iter()
                .map(|f| -> ArrayRef {
                    match f.data_type() {
                        _ if f.is_nullable() => new_null_array(f.data_type(), n),
                        DataType::Utf8 => Arc::new(StringArray::from_iter_values(
                            (0..n).map(|i| format!("{i}")),
                        )),
                        DataType::Int32 => Arc::new(Int32Array::from_iter_values(0..n as i32)),
                        DataType::Float64 => {
                            Arc::new(Float64Array::from_iter_values((0..n).map(|i| i as f64)))
                        }
                        DataType::Boolean => Arc::new(BooleanArray::from(vec![true; n])),
                        other => panic!("scores column {} of type {other}", f.name()),
                    }
                })
                .collect();
            RecordBatch::try_new(schema.clone(), cols).unwrap()
        };
        let (v1, v2, v3) = (
            ScorerId::parse("cue@1").unwrap(),
            ScorerId::parse("cue@2").unwrap(),
            ScorerId::parse("cue@3").unwrap(),
        );
        for (id, n) in [(&v1, 3), (&v2, 5)] {
            let mut w = store.part_writer(&id.dir(), schema.clone(), "part");
            w.write(rows(n)).await.unwrap();
            w.finish().await.unwrap();
        }
        for (ids, want) in [
            (vec![&v1], 3i64),
            (vec![&v2], 5),
            (vec![&v1, &v2], 8),
            (vec![&v3], 0),
        ] {
            let ctx = super::new_context();
            super::register_scores_of(&ctx, &store, &ids).await.unwrap();
            let got = super::text_rows(&ctx, "SELECT count(*) FROM scores")
                .await
                .unwrap();
            assert_eq!(got, vec![vec![Some(want.to_string())]], "{ids:?}");
        }
    }

    /// Whether `id` satisfies one `id_slices` condition (`call_id >= 'x'`, `call_id < 'y'`).
    fn takes(cond: &str, id: &str) -> bool {
        cond == "TRUE"
            || cond.split(" AND ").all(|c| {
                let bound = c.rsplit('\'').nth(1).expect("quoted bound");
                if c.contains(">=") {
                    id >= bound
                } else {
                    id < bound
                }
            })
    }

    #[test]
    fn id_slices_take_every_id_once() {
        assert_eq!(id_slices("call_id", 0), vec!["TRUE".to_string()]);
        assert_eq!(id_slices("call_id", 1), vec!["TRUE".to_string()]);
        assert_eq!(
            id_slices("call_id", 4)[1],
            "call_id >= '40' AND call_id < '80'".to_string()
        );
        assert_eq!(
            id_slices("call_id", 10)[3],
            "call_id >= '4c' AND call_id < '66'".to_string()
        );
        for passes in [2, 3, 4, 5, 7, 10, 16, 40, 256, 300] {
            let slices = id_slices("call_id", passes);
            assert_eq!(slices.len(), passes.min(256));
            for id in [
                "0a", "3f", "4", "4b", "4c", "7ff", "8", "b0", "f", "ffff", " not hex", "zz",
            ] {
                let n = slices.iter().filter(|r| takes(r, id)).count();
                assert_eq!(n, 1, "{id} in {n} of {passes} slices: {slices:?}");
            }
        }
    }
}
