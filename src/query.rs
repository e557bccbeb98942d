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
use datafusion::prelude::{SessionConfig, SessionContext};

use crate::schema::Table;
use crate::storage::{RunStore, StorageError};

/// Errors while registering or running queries.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("{context}: {source}")]
    DataFusion {
        context: String,
        #[source]
        source: DataFusionError,
    },
}

impl QueryError {
    pub fn df(context: impl Into<String>) -> impl FnOnce(DataFusionError) -> QueryError {
        let context = context.into();
        move |source| QueryError::DataFusion { context, source }
    }
}

/// A session with evalflow's functions registered and plain Utf8 strings (so stages can
/// read string columns without view types).
pub fn new_context() -> SessionContext {
    let config = SessionConfig::new()
        .set_bool(
            "datafusion.execution.parquet.schema_force_view_types",
            false,
        )
        .set_bool("datafusion.sql_parser.map_string_types_to_utf8view", false);
    let ctx = SessionContext::new_with_config(config);
    crate::udaf::register_all(&ctx);
    ctx
}

/// Registers a Parquet folder or file (any URL DataFusion can list) as `name`.
pub async fn register_parquet(
    ctx: &SessionContext,
    name: &str,
    url: &str,
) -> Result<(), QueryError> {
    register_parquet_paths(ctx, name, &[url.to_string()]).await
}

/// Registers several Parquet folders or files as one table `name`.
pub async fn register_parquet_paths(
    ctx: &SessionContext,
    name: &str,
    urls: &[String],
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
    // Take the session's Parquet options so `schema_force_view_types = false` applies.
    let format = ParquetFormat::default().with_options(ctx.state().table_options().parquet.clone());
    let options = ListingOptions::new(Arc::new(format)).with_file_extension(".parquet");
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
    store.register_with(ctx);
    for t in Table::ALL {
        let name = format!("{prefix}{}", t.name());
        let parts = store.list_parts(t.name()).await?;
        check_parts(store, &parts, t).await?;
        if parts.is_empty() {
            let empty = MemTable::try_new(t.schema(), vec![vec![]])
                .map_err(QueryError::df(name.clone()))?;
            ctx.register_table(&name, Arc::new(empty))
                .map_err(QueryError::df(name.clone()))?;
            continue;
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
        register_parquet_paths(ctx, &name, &urls).await?;
    }
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
    let batches = ctx
        .sql(sql)
        .await
        .map_err(QueryError::df(sql.to_string()))?
        .collect()
        .await
        .map_err(QueryError::df(sql.to_string()))?;
    let mut out = Vec::new();
    for b in batches {
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
    }
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
