//! `evalflow verify RUN [--repair]`: whether a run root still holds what its manifest says.
//!
//! Damage from outside (an interrupted `aws s3 sync`, a hand edit, a disk fault) must not be
//! read as data. Verify decodes every part of every table in full (footer, schema, pages),
//! compares each folder's rows with the count the manifest recorded when its stage finished
//! (a deleted part), and then, over the sound parts, looks for duplicated ids, rows whose call
//! is gone (orphans) and calls a finished stage left without a verdict or a score. The joins
//! run as sort-merge joins, which spill, so memory does not grow with the run.
//!
//! `--repair` takes the root's lease, moves each damaged part under `_damaged/` (never
//! deletes it), moves aside the validity and scores parts that hold orphans and writes their
//! other rows back, and marks the stages whose tables lost rows (and every later one) as not
//! finished: the next `evalflow run` (or the stage verbs) re-does exactly the missing work,
//! re-paying only the calls whose part was damaged.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use datafusion::prelude::SessionContext;
use futures::TryStreamExt;
use object_store::ObjectMeta;

use crate::query::{QueryError, text_rows};
use crate::schema::Table;
use crate::storage::{Manifest, RunStore, StageStatus, StorageError};

/// Where damaged parts and the originals of rewritten parts are moved.
pub const DAMAGED: &str = "_damaged";

/// Errors of verify itself (not the problems it finds).
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error(transparent)]
    Query(#[from] QueryError),
    /// The root has no manifest: it is not a run.
    #[error("{0}: not an evalflow run (no manifest.json)")]
    NotARun(String),
}

/// One problem found.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// The folder (`calls`, `scores/checklist@2`) or the part (`calls/part-1.parquet`).
    pub at: String,
    /// What is wrong.
    pub what: String,
}

/// What [`verify`] found.
#[derive(Debug, Default)]
pub struct Verified {
    /// Parts decoded.
    pub parts: usize,
    /// Rows per folder, over the sound parts.
    pub rows: BTreeMap<String, u64>,
    /// Parts that do not decode or do not fit their table's schema (relative paths).
    pub damaged: Vec<String>,
    /// Every problem, damaged parts first.
    pub problems: Vec<Problem>,
    /// Whether the relational checks ran (they need every part sound).
    pub relational: bool,
}

/// The stage that writes a folder, as the manifest names it.
fn stage_of(dir: &str) -> String {
    match dir {
        "cases" => "generate".into(),
        "calls" => "call".into(),
        "validity" => "validate".into(),
        "results" => "aggregate".into(),
        d => d
            .strip_prefix("scores/")
            .map_or_else(|| d.to_string(), |tag| format!("score:{tag}")),
    }
}

/// The folder of a part (`scores/x@1` for `scores/x@1/part-0.parquet`).
fn dir_of(rel: &str) -> &str {
    rel.rsplit_once('/').map_or("", |(d, _)| d)
}

/// Checks the run at `store`; writes nothing.
///
/// # Errors
/// [`VerifyError::NotARun`] without a manifest; storage errors listing the root.
pub async fn verify(store: &RunStore) -> Result<Verified, VerifyError> {
    let manifest = Manifest::load(store)
        .await?
        .ok_or_else(|| VerifyError::NotARun(store.display().to_string()))?;
    let mut v = Verified::default();
    for t in Table::ALL {
        for meta in store.list_parts(t.name()).await? {
            v.parts += 1;
            let rel = crate::storage::compact::rel(store, &meta);
            match decode(store, &meta, t).await {
                Ok(n) => *v.rows.entry(dir_of(&rel).to_string()).or_default() += n,
                Err(e) => {
                    v.problems.push(Problem {
                        at: rel.clone(),
                        what: format!("damaged: {e}"),
                    });
                    v.damaged.push(rel);
                }
            }
        }
    }
    for (dir, want) in &manifest.row_counts {
        let done = manifest.is_complete(&stage_of(dir));
        let have = v.rows.get(dir).copied().unwrap_or(0);
        if done && have != *want && !v.damaged.iter().any(|d| dir_of(d) == dir) {
            v.problems.push(Problem {
                at: dir.clone(),
                what: format!(
                    "the manifest records {want} rows, its parts hold {have}: a part was \
                     deleted, replaced or added from outside"
                ),
            });
        }
    }
    if v.damaged.is_empty() {
        v.relational = true;
        let ctx = verify_context(store).await?;
        relational(&ctx, &manifest, &mut v.problems).await?;
    }
    Ok(v)
}

/// Decodes every row of a part; returns its row count.
async fn decode(store: &RunStore, meta: &ObjectMeta, t: Table) -> Result<u64, StorageError> {
    let footer_rows = store.footer(meta).await?.num_rows();
    let mut n = 0u64;
    let mut s = store.read_part(meta, t).await?;
    while let Some(b) = s.try_next().await? {
        n += b.num_rows() as u64;
    }
    if n != footer_rows {
        return Err(StorageError::Manifest {
            location: store.location(&meta.location),
            msg: format!("its footer says {footer_rows} rows, its pages hold {n}"),
        });
    }
    Ok(n)
}

/// A read-only session over the run whose joins spill (sort-merge, not hash).
async fn verify_context(store: &RunStore) -> Result<SessionContext, QueryError> {
    let ctx = crate::query::new_context();
    crate::query::register_run_read_only(&ctx, store).await?;
    ctx.sql("SET datafusion.optimizer.prefer_hash_join = false")
        .await
        .map_err(QueryError::df("verify"))?;
    Ok(ctx)
}

/// One count and an example id.
async fn count_and_example(ctx: &SessionContext, sql: &str) -> Result<(u64, String), QueryError> {
    let rows = text_rows(ctx, &format!("SELECT count(*), min(k) FROM ({sql}) AS q")).await?;
    let row = rows.into_iter().next().unwrap_or_default();
    let n = row
        .first()
        .cloned()
        .flatten()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let example = row.get(1).cloned().flatten().unwrap_or_default();
    Ok((n, example))
}

/// Duplicated ids, orphans and missing rows, over sound parts.
async fn relational(
    ctx: &SessionContext,
    manifest: &Manifest,
    out: &mut Vec<Problem>,
) -> Result<(), QueryError> {
    let versions: Vec<(String, String)> = text_rows(
        ctx,
        "SELECT DISTINCT scorer, scoring_version FROM scores ORDER BY 1, 2",
    )
    .await?
    .into_iter()
    .filter_map(|r| Some((r.first()?.clone()?, r.get(1)?.clone()?)))
    .collect();
    let mut checks: Vec<(String, String, String)> = vec![
        (
            "cases".into(),
            "case ids that occur more than once".into(),
            "SELECT case_id AS k FROM cases GROUP BY case_id HAVING count(*) > 1".into(),
        ),
        (
            "calls".into(),
            "call ids that occur more than once".into(),
            "SELECT call_id AS k FROM calls GROUP BY call_id HAVING count(*) > 1".into(),
        ),
        (
            "validity".into(),
            "call ids with more than one verdict".into(),
            "SELECT call_id AS k FROM validity GROUP BY call_id HAVING count(*) > 1".into(),
        ),
        (
            "calls".into(),
            "calls whose case is not in cases".into(),
            "SELECT c.case_id AS k FROM calls c LEFT ANTI JOIN cases x ON c.case_id = x.case_id"
                .into(),
        ),
        (
            "validity".into(),
            "verdicts whose call is not in calls".into(),
            "SELECT v.call_id AS k FROM validity v LEFT ANTI JOIN calls c ON v.call_id = c.call_id"
                .into(),
        ),
    ];
    if manifest.is_complete("validate") {
        checks.push((
            "validity".into(),
            "calls without a verdict (the validate stage finished)".into(),
            "SELECT c.call_id AS k FROM calls c LEFT ANTI JOIN validity v ON c.call_id = v.call_id"
                .into(),
        ));
    }
    for (name, version) in &versions {
        let dir = format!("scores/{name}@{version}");
        let this = format!(
            "(SELECT call_id FROM scores WHERE scorer = '{}' AND scoring_version = '{}')",
            name.replace('\'', "''"),
            version.replace('\'', "''")
        );
        checks.push((
            dir.clone(),
            "call ids scored more than once".into(),
            format!("SELECT call_id AS k FROM {this} s GROUP BY call_id HAVING count(*) > 1"),
        ));
        checks.push((
            dir.clone(),
            "scores whose call is not in calls".into(),
            format!("SELECT s.call_id AS k FROM {this} s LEFT ANTI JOIN calls c ON s.call_id = c.call_id"),
        ));
        if manifest.is_complete(&stage_of(&dir)) {
            checks.push((
                dir.clone(),
                "calls without a score (the version's scoring finished)".into(),
                format!(
                    "SELECT c.call_id AS k FROM calls c LEFT ANTI JOIN {this} s ON c.call_id = s.call_id"
                ),
            ));
        }
    }
    for (at, what, sql) in checks {
        let (n, example) = count_and_example(ctx, &sql).await?;
        if n > 0 {
            out.push(Problem {
                at,
                what: format!("{n} {what} (e.g. {example})"),
            });
        }
    }
    Ok(())
}

/// What [`repair`] did.
#[derive(Debug, Default)]
pub struct Repaired {
    /// Parts moved under `_damaged/`, as (from, to).
    pub moved: Vec<(String, String)>,
    /// Rows written back from parts that held orphans.
    pub kept_rows: u64,
    /// Stages marked as not finished.
    pub reopened: Vec<String>,
}

/// Moves damaged parts aside, drops orphans, and reopens the stages that must re-do work.
/// The caller holds the root's lease.
///
/// # Errors
/// Storage and query errors, naming the part.
pub async fn repair(store: &RunStore, v: &Verified) -> Result<Repaired, VerifyError> {
    let mut manifest = Manifest::load(store)
        .await?
        .ok_or_else(|| VerifyError::NotARun(store.display().to_string()))?;
    let mut r = Repaired::default();
    let mut lost: Vec<String> = Vec::new();
    for rel in &v.damaged {
        r.moved.push((rel.clone(), move_aside(store, rel).await?));
        lost.push(dir_of(rel).to_string());
    }
    // A folder whose rows differ from the manifest's count lost (or gained) parts.
    lost.extend(
        v.problems
            .iter()
            .filter(|p| p.what.starts_with("the manifest records"))
            .map(|p| p.at.clone()),
    );
    // Verdicts and scores whose call is gone judged an answer that no longer exists: the
    // call is made again and judged anew.
    let ctx = verify_context(store).await?;
    for t in [Table::Validity, Table::Scores] {
        for meta in store.list_parts(t.name()).await? {
            let rel = crate::storage::compact::rel(store, &meta);
            let url = store.table_url(&rel);
            let url = url.trim_end_matches('/').to_string();
            let name = "verify_part";
            let _ = ctx.deregister_table(name);
            crate::query::register_parquet_paths(&ctx, name, &[url]).await?;
            let (orphans, _) = count_and_example(
                &ctx,
                &format!(
                    "SELECT p.call_id AS k FROM {name} p LEFT ANTI JOIN calls c ON p.call_id = c.call_id"
                ),
            )
            .await?;
            if orphans == 0 {
                continue;
            }
            let kept = ctx
                .sql(&format!(
                    "SELECT p.* FROM {name} p LEFT SEMI JOIN calls c ON p.call_id = c.call_id"
                ))
                .await
                .map_err(QueryError::df("verify"))?
                .collect()
                .await
                .map_err(QueryError::df("verify"))?;
            let dir = dir_of(&rel).to_string();
            let mut w = store.part_writer(&dir, t.schema(), "repaired");
            for b in kept {
                r.kept_rows += b.num_rows() as u64;
                w.write(b).await?;
            }
            w.finish().await?;
            r.moved.push((rel.clone(), move_aside(store, &rel).await?));
            lost.push(dir);
        }
    }
    // The stages that wrote a folder that lost rows, and every stage after them, re-run.
    const ORDER: [&str; 4] = ["generate", "call", "validate", "score"];
    let first = lost
        .iter()
        .map(|d| stage_of(d))
        .filter_map(|s| {
            ORDER
                .iter()
                .position(|o| s == *o || (s.starts_with("score:") && *o == "score"))
        })
        .min();
    if let Some(first) = first {
        for (name, rec) in manifest.stages.iter_mut() {
            let pos = ORDER
                .iter()
                .position(|o| name == o || (name.starts_with("score:") && *o == "score"))
                .unwrap_or(ORDER.len());
            if pos >= first && rec.status == StageStatus::Complete {
                rec.status = StageStatus::Running;
                rec.finished_at = None;
                r.reopened.push(name.clone());
            }
        }
        for d in &lost {
            manifest.row_counts.remove(d);
        }
        manifest.row_counts.remove("results");
        manifest.finished_at = None;
        manifest.save(store).await?;
    }
    Ok(r)
}

/// Moves the object `rel` to `_damaged/<rel>` (a copy then a delete where the store has no
/// rename); returns the new path.
async fn move_aside(store: &RunStore, rel: &str) -> Result<String, StorageError> {
    let to = format!("{DAMAGED}/{rel}");
    let (from_p, to_p) = (store.path(rel), store.path(&to));
    crate::storage::retry::rename(store.object_store().as_ref(), &from_p, &to_p)
        .await
        .map_err(|source| store.store_err(&from_p, source))?;
    Ok(to)
}

/// The text `evalflow verify` prints.
pub fn render(store: &RunStore, v: &Verified) -> String {
    let mut out = String::new();
    let rows: u64 = v.rows.values().sum();
    let _ = writeln!(
        out,
        "{}: {} parts, {rows} rows decoded",
        store.display(),
        v.parts
    );
    if !v.relational {
        let _ = writeln!(
            out,
            "duplicates, orphans and missing rows not checked: {} damaged part(s) first",
            v.damaged.len()
        );
    }
    if v.problems.is_empty() {
        let _ = writeln!(out, "ok: no problem found");
    }
    for p in &v.problems {
        let _ = writeln!(out, "problem: {}: {}", p.at, p.what);
    }
    out
}
