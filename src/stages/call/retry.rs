//! `call --retry-errors`: the calls that ended as provider errors are sent again, in place.
//!
//! A retried request keeps its call id (same case, model, sample and request), so its new row
//! replaces the error row. The todo plan counts only answered rows as committed, the new rows
//! are journaled and committed as any call's, and [`supersede`] then rewrites the parts that
//! hold replaced error rows without them (and without their verdicts in the paired validity
//! part) through the compaction intent, so a crash at any point neither loses a row nor leaves
//! two. An answered call is never sent again.
//!
//! A marker, `_retry.json`, is written before the first request and removed after the
//! rewrite: a session that finds it (a retry that was killed) finishes the rewrite before it
//! reads or sends anything. Memory holds the error rows' ids, not the table.

use std::collections::{HashMap, HashSet};

use datafusion::arrow::array::{Array, BooleanArray, RecordBatch, TimestampMicrosecondArray};
use datafusion::arrow::compute::filter_record_batch;
use futures::TryStreamExt;

use super::str_col;
use crate::schema::Table;
use crate::storage::{RunStore, StorageError, compact};

/// The marker of a retry whose replaced rows may not all be dropped yet.
pub const MARKER: &str = "_retry.json";

/// Records that a retry starts: its rows may replace committed error rows.
pub async fn begin(store: &RunStore, session: &str) -> Result<(), StorageError> {
    let body = serde_json::json!({ "session": session }).to_string();
    store.put(MARKER, body.into_bytes()).await
}

/// Finishes a retry left by a crash (a no-op without the marker); the rows it dropped.
pub async fn finish_pending(store: &RunStore) -> Result<u64, StorageError> {
    if store.get(MARKER).await?.is_none() {
        return Ok(0);
    }
    let dropped = supersede(store).await?;
    store.delete(MARKER).await?;
    Ok(dropped)
}

/// A row's rank among the rows of its call id: an answer beats an error, then the later
/// attempt wins. Only error rows below the best rank of their id are dropped.
type Rank = (bool, i64);

fn ranks(b: &RecordBatch) -> impl Iterator<Item = (usize, Rank)> + '_ {
    let errors = b.column_by_name("error").expect("calls have `error`");
    let started = b
        .column_by_name("started_at")
        .and_then(|c| c.as_any().downcast_ref::<TimestampMicrosecondArray>());
    (0..b.num_rows()).map(move |i| {
        let at = started
            .filter(|s| s.is_valid(i))
            .map_or(i64::MIN, |s| s.value(i));
        (i, (errors.is_null(i), at))
    })
}

/// Drops every error row that a later row of the same call id replaced; returns how many.
/// Three scans of `calls` (error ids, their best ranks, the rewrite of the parts that hold
/// replaced rows); answered rows are never dropped.
pub async fn supersede(store: &RunStore) -> Result<u64, StorageError> {
    let parts = store.list_parts("calls").await?;
    // 1. The ids with an error row.
    let mut best: HashMap<String, Rank> = HashMap::new();
    for p in &parts {
        let mut s = store.read_part(p, Table::Calls).await?;
        while let Some(b) = s.try_next().await? {
            let b = crate::schema::plain_strings(b);
            let ids = str_col(&b, "call_id");
            for (i, (answered, _)) in ranks(&b) {
                if !answered {
                    best.entry(ids.value(i).to_string())
                        .or_insert((false, i64::MIN));
                }
            }
        }
    }
    if best.is_empty() {
        return Ok(0);
    }
    // 2. The best rank of each of those ids, over every row.
    for p in &parts {
        let mut s = store.read_part(p, Table::Calls).await?;
        while let Some(b) = s.try_next().await? {
            let b = crate::schema::plain_strings(b);
            let ids = str_col(&b, "call_id");
            for (i, rank) in ranks(&b) {
                if let Some(r) = best.get_mut(ids.value(i))
                    && rank > *r
                {
                    *r = rank;
                }
            }
        }
    }
    // 3. Each part holding an error row below its id's best is rewritten without it.
    let mut dropped = 0u64;
    for p in &parts {
        let batches: Vec<RecordBatch> = store
            .read_part(p, Table::Calls)
            .await?
            .try_collect()
            .await?;
        let mut gone: HashSet<String> = HashSet::new();
        let mut kept = Vec::with_capacity(batches.len());
        for b in batches {
            let plain = crate::schema::plain_strings(b.clone());
            let ids = str_col(&plain, "call_id");
            let keep: BooleanArray = ranks(&plain)
                .map(|(i, rank)| {
                    let replaced = !rank.0 && best.get(ids.value(i)).is_some_and(|r| *r > rank);
                    if replaced {
                        gone.insert(ids.value(i).to_string());
                    }
                    Some(!replaced)
                })
                .collect();
            kept.push(
                filter_record_batch(&b, &keep).map_err(|e| StorageError::BadRoot {
                    root: store.display().to_string(),
                    msg: format!("retry: filtering a calls part: {e}"),
                })?,
            );
        }
        if gone.is_empty() {
            continue;
        }
        dropped += gone.len() as u64;
        let rel = compact::rel(store, p);
        let mut replace = vec![(rel.clone(), kept)];
        let name = p.location.filename().unwrap_or_default();
        let vrel = format!("validity/{name}");
        if let Some(vmeta) = store.head(&vrel).await? {
            let mut vkept = Vec::new();
            let mut s = store.read_part(&vmeta, Table::Validity).await?;
            while let Some(b) = s.try_next().await? {
                let plain = crate::schema::plain_strings(b.clone());
                let ids = str_col(&plain, "call_id");
                let keep: BooleanArray = (0..plain.num_rows())
                    .map(|i| Some(!gone.contains(ids.value(i))))
                    .collect();
                vkept.push(
                    filter_record_batch(&b, &keep).map_err(|e| StorageError::BadRoot {
                        root: store.display().to_string(),
                        msg: format!("retry: filtering a validity part: {e}"),
                    })?,
                );
            }
            replace.push((vrel, vkept));
        }
        compact::replace(store, replace).await?;
    }
    Ok(dropped)
}
