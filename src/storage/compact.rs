//! Compaction: merges a table's small parts into parts of about [`part_rows`] rows.
//!
//! The call stage commits a part every couple of seconds, so a long run leaves thousands
//! of small parts, and every later scan pays per part. Compaction rewrites runs of
//! consecutive small parts (in name order) as one part each, keeping every row exactly
//! once:
//!
//! - `calls` and `validity` move together: validate names each validity part after its
//!   calls part, and that pairing is how a restarted validate knows what is done. A group
//!   is either all validated (both tables are merged under one new name) or all not yet
//!   validated (only calls are merged); the two kinds never mix.
//! - Parts whose schemas differ (an older evalflow wrote them) are not merged together.
//!
//! # Crash safety
//! For each group: the merged part(s) are written under a temporary name that no listing
//! sees (`.parquet.compacting`), then an intent file `_compact.json` lists what to delete
//! and what to rename, then the old parts are deleted, the temporary parts renamed, and
//! the intent removed. [`finish_pending`] completes an intent left by a crash; the stages
//! and `evalflow sql` call it before they read a run, so a crash at any point neither
//! loses nor duplicates a row. Compaction must not run while a stage writes the run.

use futures::TryStreamExt;
use object_store::ObjectMeta;
use serde::{Deserialize, Serialize};

use super::{RunStore, StorageError, encode_parquet, part_rows};
use crate::schema::Table;

/// The intent file of a compaction in progress.
const INTENT: &str = "_compact.json";
const TMP_SUFFIX: &str = ".compacting";

/// What one compaction step does, recorded before it deletes anything.
#[derive(Debug, Serialize, Deserialize)]
struct Intent {
    delete: Vec<String>,
    /// (temporary name, final name), relative to the run root.
    rename: Vec<(String, String)>,
}

/// What [`compact`] did to one table folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compacted {
    pub folder: String,
    pub parts_before: usize,
    pub parts_after: usize,
    pub rows: u64,
}

/// Completes a compaction step that a crash interrupted (a no-op when none is pending).
pub async fn finish_pending(store: &RunStore) -> Result<(), StorageError> {
    let Some(bytes) = store.get(INTENT).await? else {
        return Ok(());
    };
    let intent: Intent = serde_json::from_slice(&bytes).map_err(|e| StorageError::BadRoot {
        root: store.display().to_string(),
        msg: format!("{INTENT}: unreadable compaction intent: {e}"),
    })?;
    apply(store, &intent).await
}

async fn apply(store: &RunStore, intent: &Intent) -> Result<(), StorageError> {
    let os = store.object_store();
    for rel in &intent.delete {
        match super::retry::delete(os.as_ref(), &store.path(rel)).await {
            Ok(()) => {}
            Err(source) => {
                return Err(StorageError::Store {
                    location: rel.clone(),
                    source,
                });
            }
        }
    }
    for (tmp, fin) in &intent.rename {
        if store.head(tmp).await?.is_some() {
            super::retry::rename(os.as_ref(), &store.path(tmp), &store.path(fin))
                .await
                .map_err(|source| StorageError::Store {
                    location: fin.clone(),
                    source,
                })?;
        }
    }
    match super::retry::delete(os.as_ref(), &store.path(INTENT)).await {
        Ok(()) => Ok(()),
        Err(source) => Err(StorageError::Store {
            location: INTENT.into(),
            source,
        }),
    }
}

/// The path of `meta` relative to the run root.
pub(crate) fn rel(store: &RunStore, meta: &ObjectMeta) -> String {
    let root = store.path("");
    meta.location
        .as_ref()
        .strip_prefix(root.as_ref())
        .unwrap_or(meta.location.as_ref())
        .trim_start_matches('/')
        .to_string()
}

/// Compacts every table of the run; returns what changed, folder by folder.
pub async fn compact(store: &RunStore) -> Result<Vec<Compacted>, StorageError> {
    finish_pending(store).await?;
    let mut out = vec![compact_calls(store).await?];
    for t in [Table::Cases, Table::Results] {
        out.push(compact_folder(store, t.name(), t).await?);
    }
    let mut score_dirs: Vec<String> = store
        .list_parts("scores")
        .await?
        .iter()
        .filter_map(|m| {
            let r = rel(store, m);
            r.rsplit_once('/').map(|(d, _)| d.to_string())
        })
        .collect();
    score_dirs.dedup();
    for d in score_dirs {
        out.push(compact_folder(store, &d, Table::Scores).await?);
    }
    Ok(out)
}

/// Compacts only `calls` (with `validity` where validated): the call stage's small commits.
pub async fn compact_calls(store: &RunStore) -> Result<Compacted, StorageError> {
    finish_pending(store).await?;
    let calls = store.list_parts("calls").await?;
    let validity = store.list_parts("validity").await?;
    let validated: std::collections::HashSet<String> = validity
        .iter()
        .filter_map(|m| m.location.filename().map(String::from))
        .collect();
    let keyed: Vec<(ObjectMeta, bool)> = calls
        .into_iter()
        .map(|m| {
            let v = m.location.filename().is_some_and(|f| validated.contains(f));
            (m, v)
        })
        .collect();
    let before = keyed.len();
    let mut after = 0;
    let mut rows = 0u64;
    for (group, is_validated) in groups(store, keyed).await? {
        rows += group.rows;
        if group.parts.len() < 2 {
            after += group.parts.len();
            continue;
        }
        let name = merged_name(&group.parts[0]);
        let mut intent = Intent {
            delete: Vec::new(),
            rename: Vec::new(),
        };
        let mut tables = vec![("calls", Table::Calls)];
        if is_validated {
            tables.push(("validity", Table::Validity));
        }
        for (folder, table) in tables {
            let metas: Vec<ObjectMeta> = if folder == "calls" {
                group.parts.clone()
            } else {
                let mut v = Vec::new();
                for p in &group.parts {
                    let f = p.location.filename().unwrap_or_default();
                    v.push(store.head(&format!("validity/{f}")).await?.ok_or_else(|| {
                        StorageError::BadRoot {
                            root: store.display().to_string(),
                            msg: format!("validity/{f} vanished during compaction"),
                        }
                    })?);
                }
                v
            };
            let fin = format!("{folder}/{name}");
            write_merged(store, &metas, table, &format!("{fin}{TMP_SUFFIX}")).await?;
            intent.delete.extend(metas.iter().map(|m| rel(store, m)));
            intent.rename.push((format!("{fin}{TMP_SUFFIX}"), fin));
        }
        commit(store, &intent).await?;
        after += 1;
    }
    Ok(Compacted {
        folder: "calls".into(),
        parts_before: before,
        parts_after: after,
        rows,
    })
}

/// Compacts one folder of a table whose parts are independent (no pairing).
async fn compact_folder(
    store: &RunStore,
    folder: &str,
    table: Table,
) -> Result<Compacted, StorageError> {
    let parts: Vec<(ObjectMeta, bool)> = store
        .list_parts(folder)
        .await?
        .into_iter()
        // `scores` lists every version: keep this folder's parts only.
        .filter(|m| rel(store, m).rsplit_once('/').map(|(d, _)| d) == Some(folder))
        .map(|m| (m, false))
        .collect();
    let before = parts.len();
    let mut after = 0;
    let mut rows = 0u64;
    for (group, _) in groups(store, parts).await? {
        rows += group.rows;
        if group.parts.len() < 2 {
            after += group.parts.len();
            continue;
        }
        let fin = format!("{folder}/{}", merged_name(&group.parts[0]));
        let tmp = format!("{fin}{TMP_SUFFIX}");
        write_merged(store, &group.parts, table, &tmp).await?;
        let intent = Intent {
            delete: group.parts.iter().map(|m| rel(store, m)).collect(),
            rename: vec![(tmp, fin)],
        };
        commit(store, &intent).await?;
        after += 1;
    }
    Ok(Compacted {
        folder: folder.into(),
        parts_before: before,
        parts_after: after,
        rows,
    })
}

/// Replaces parts (paths relative to the run root) by new contents through one intent, so
/// a crash leaves either every old part or every new one (after [`finish_pending`]). A part
/// whose new contents have no rows is deleted. The call stage's `--retry-errors` drops the
/// error rows a retry replaced this way, with their verdicts from the paired validity part.
pub async fn replace(
    store: &RunStore,
    parts: Vec<(String, Vec<datafusion::arrow::array::RecordBatch>)>,
) -> Result<(), StorageError> {
    finish_pending(store).await?;
    let mut intent = Intent {
        delete: Vec::new(),
        rename: Vec::new(),
    };
    for (rel, batches) in parts {
        let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
        if rows > 0 {
            let schema = batches[0].schema();
            let tmp = format!("{rel}{TMP_SUFFIX}");
            let bytes =
                encode_parquet(&schema, &batches).map_err(|source| StorageError::Parquet {
                    location: tmp.clone(),
                    source,
                })?;
            store.put(&tmp, bytes).await?;
            intent.rename.push((tmp, rel.clone()));
        }
        intent.delete.push(rel);
    }
    commit(store, &intent).await
}

/// Records the intent, then applies it.
async fn commit(store: &RunStore, intent: &Intent) -> Result<(), StorageError> {
    let bytes = serde_json::to_vec(intent).expect("an intent serializes");
    store.put(INTENT, bytes).await?;
    apply(store, intent).await
}

/// The merged part's name: the first part's stem with `-c` (sorts right after it, so the
/// name order of the folder stays the order rows were written in).
fn merged_name(first: &ObjectMeta) -> String {
    let f = first.location.filename().unwrap_or("part.parquet");
    let stem = f.strip_suffix(".parquet").unwrap_or(f);
    format!("{stem}-c.parquet")
}

struct Group {
    parts: Vec<ObjectMeta>,
    rows: u64,
}

/// Consecutive parts of the same kind (`bool`) and schema, up to [`part_rows`] rows each.
async fn groups(
    store: &RunStore,
    parts: Vec<(ObjectMeta, bool)>,
) -> Result<Vec<(Group, bool)>, StorageError> {
    let target = part_rows() as u64;
    let mut out: Vec<(Group, bool)> = Vec::new();
    let mut last_schema: Option<String> = None;
    for (meta, kind) in parts {
        let (rows, schema) = store.part_rows_and_schema(&meta).await?;
        let fits = out.last().is_some_and(|(g, k)| {
            *k == kind && g.rows + rows <= target && last_schema.as_deref() == Some(&schema)
        });
        if fits {
            let (g, _) = out.last_mut().expect("checked");
            g.rows += rows;
            g.parts.push(meta);
        } else {
            out.push((
                Group {
                    parts: vec![meta],
                    rows,
                },
                kind,
            ));
        }
        last_schema = Some(schema);
    }
    Ok(out)
}

/// Reads `metas` in order and writes them as one part at `to` (bounded by [`part_rows`]),
/// each batch encoded as it is read: memory holds the part's encoded pages, not its rows
/// (the merge of 100,000 calls was the call stage's peak).
async fn write_merged(
    store: &RunStore,
    metas: &[ObjectMeta],
    table: Table,
    to: &str,
) -> Result<(), StorageError> {
    let perr = |source| StorageError::Parquet {
        location: to.to_string(),
        source,
    };
    let mut enc: Option<super::parts::PartEncoder> = None;
    for m in metas {
        let mut s = store.read_part(m, table).await?;
        while let Some(b) = s.try_next().await? {
            let e = match &mut enc {
                Some(e) => e,
                None => enc.insert(
                    super::parts::PartEncoder::new(&b.schema(), store.part_file(to)?)
                        .map_err(perr)?,
                ),
            };
            e.write(&b).map_err(perr)?;
        }
    }
    let Some(e) = enc else {
        return Ok(());
    };
    e.finish().map_err(perr)?.commit().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::RecordBatch;
    use object_store::ObjectStoreExt;

    fn cases(ids: &[&str]) -> RecordBatch {
        let cases: Vec<crate::stages::generate::Case> = ids
            .iter()
            .map(|id| crate::stages::generate::Case {
                case_id: id.to_string(),
                suite: "s".into(),
                test: "t".into(),
                capability: "c".into(),
                test_type: "MFT".into(),
                template_id: id.to_string(),
                group_id: id.to_string(),
                role: "single".into(),
                input: format!("input {id}"),
                expected: None,
                expectation: None,
                tolerance: None,
                perturbation: None,
            })
            .collect();
        crate::stages::generate::to_batch(&cases)
    }

    async fn ids(store: &RunStore) -> Vec<String> {
        use datafusion::arrow::array::AsArray;
        let mut out = Vec::new();
        let mut s = store.read_table("cases", Table::Cases).await.unwrap();
        while let Some(b) = s.try_next().await.unwrap() {
            let c = b.column_by_name("case_id").unwrap().as_string::<i32>();
            out.extend(c.iter().map(|v| v.unwrap().to_string()));
        }
        out.sort();
        out
    }

    #[tokio::test]
    async fn merges_small_parts_and_a_crash_mid_step_is_finished_later() {
        let store = RunStore::open("memory://compact-test/run").unwrap();
        for (k, chunk) in [["a", "b"], ["c", "d"], ["e", "f"]].iter().enumerate() {
            let mut w = store
                .part_writer("cases", Table::Cases.schema(), "part")
                .with_start_seq(k);
            w.write(cases(chunk)).await.unwrap();
            w.finish().await.unwrap();
        }
        assert_eq!(store.list_parts("cases").await.unwrap().len(), 3);
        let done = compact(&store).await.unwrap();
        let c = done.iter().find(|c| c.folder == "cases").unwrap();
        assert_eq!((c.parts_before, c.parts_after, c.rows), (3, 1, 6));
        assert_eq!(ids(&store).await, ["a", "b", "c", "d", "e", "f"]);

        // A crash after the intent was written and one old part deleted, before the merged
        // part was renamed: the rows of the deleted part live on only in the temporary part.
        let mut w = store
            .part_writer("cases", Table::Cases.schema(), "late")
            .with_start_seq(0);
        w.write(cases(&["g"])).await.unwrap();
        w.finish().await.unwrap();
        let parts = store.list_parts("cases").await.unwrap();
        let tmp = "cases/merged-c.parquet.compacting".to_string();
        write_merged(&store, &parts, Table::Cases, &tmp)
            .await
            .unwrap();
        let intent = Intent {
            delete: parts.iter().map(|m| rel(&store, m)).collect(),
            rename: vec![(tmp, "cases/merged-c.parquet".into())],
        };
        store
            .put(INTENT, serde_json::to_vec(&intent).unwrap())
            .await
            .unwrap();
        store
            .object_store()
            .delete(&parts[0].location)
            .await
            .unwrap();
        // Mid-crash, a listing misses rows; finishing the intent restores every row once.
        finish_pending(&store).await.unwrap();
        assert_eq!(ids(&store).await, ["a", "b", "c", "d", "e", "f", "g"]);
        assert_eq!(store.list_parts("cases").await.unwrap().len(), 1);
        assert!(store.get(INTENT).await.unwrap().is_none());
    }
}
