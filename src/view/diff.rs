//! Two scorer versions of one run side by side: the disagreement matrix and the answers the
//! versions disagree on.
//!
//! The matrix is a full join of the two versions on `call_id`, slice by slice of the ids (a
//! hash join holds one side and does not spill). It is computed once per manifest and pair
//! (a run's parts change only with its manifest), together with the disagreeing ids in
//! order while there are at most [`KEPT_IDS`]; a page is then a slice of that list and
//! point lookups of its rows. Past that many, each page joins the slices from its cursor.

use std::collections::BTreeMap;
use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Int64Type};
use serde_json::{Value, json};

use super::ViewError;
use super::answers::{DEFAULT_LIMIT, MAX_LIMIT, class_expr, ids, snip};
use super::catalog::RunView;
use super::rows::{json_rows, lit};
use crate::config::ScorerId;
use crate::query::QueryError;
use crate::stages::score::MetricKind;

/// Disagreeing answers whose ids a diff keeps (about 60 bytes each);
/// `EVALFLOW_VIEW_DIFF_IDS` sets another bound.
const KEPT_IDS: usize = 500_000;

fn kept_ids() -> usize {
    crate::config::env_number("EVALFLOW_VIEW_DIFF_IDS").map_or(KEPT_IDS, |n| n as usize)
}

/// The matrix of two versions, and the answers they disagree on.
pub struct Diff {
    /// `(class in a, class in b) -> answers`, `absent` for an answer one version lacks.
    cells: BTreeMap<(String, String), i64>,
    /// The disagreeing call ids in order, each with its cell (an index into `names`);
    /// `None` when there are more than [`KEPT_IDS`].
    ids: Option<Vec<(String, u32)>>,
    names: Vec<(String, String)>,
}

/// The two versions and how each classes a row.
struct Pair {
    a: ScorerId,
    b: ScorerId,
    kind_a: MetricKind,
    kind_b: MetricKind,
    slices: Vec<String>,
}

impl Pair {
    /// The full join of the two versions' classes over one slice of the call ids.
    fn joined(&self, slice: &str) -> String {
        let side = |id: &ScorerId, kind| {
            format!(
                "(SELECT call_id, {} AS k, score, passed, label FROM scores WHERE scorer = {} \
                 AND scoring_version = {} AND {slice})",
                class_expr(kind),
                lit(&id.name),
                lit(&id.version)
            )
        };
        format!(
            "{} x FULL JOIN {} y ON x.call_id = y.call_id",
            side(&self.a, self.kind_a),
            side(&self.b, self.kind_b)
        )
    }
}

/// `GET /api/runs/{run}/scorer-diff?a=&b=`: the disagreement matrix of two scorer versions
/// and a page of the answers they disagree on (keyset on `call_id`).
pub async fn scorer_diff(r: &RunView, q: &[(String, String)]) -> Result<Value, ViewError> {
    let get = |k: &str| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let mut versions = Vec::new();
    for k in ["a", "b"] {
        let spec = get(k).ok_or_else(|| {
            ViewError::BadRequest("scorer-diff needs ?a=NAME@VERSION&b=NAME@VERSION".into())
        })?;
        let id = r.scorer(Some(spec)).await?;
        versions.push(id.ok_or_else(|| ViewError::BadRequest("the run has no scores".into()))?);
    }
    let (b, a) = (versions.pop().expect("two"), versions.pop().expect("two"));
    let limit: usize = match get("limit") {
        Some(v) => v
            .parse()
            .ok()
            .filter(|n| (1..=MAX_LIMIT).contains(n))
            .ok_or_else(|| ViewError::BadRequest(format!("limit={v}: from 1 to {MAX_LIMIT}")))?,
        None => DEFAULT_LIMIT,
    };
    let (pair, diff) = diff_of(r, a, b).await?;
    let (kind_a, kind_b) = (pair.kind_a, pair.kind_b);
    let (mut total, mut disagree) = (0i64, 0i64);
    let matrix: Vec<Value> = diff
        .cells
        .iter()
        .map(|((ca, cb), n)| {
            total += n;
            if ca != cb {
                disagree += n;
            }
            json!({"a": ca, "b": cb, "n": n})
        })
        .collect();
    let after = get("after").filter(|s| !s.is_empty());
    // The page, and its answers' texts (at once when the page's ids are known first).
    let (mut rows, next, calls) = match &diff.ids {
        Some(list) => {
            let (start, end) = window(list, after, limit);
            let want: Vec<String> = list[start..end].iter().map(|(id, _)| id.clone()).collect();
            let (rows, calls) = futures::try_join!(
                page_of_kept(r, &pair, &diff, &list[start..end]),
                texts(r, &want)
            )?;
            let next = (end < list.len()).then(|| list[end - 1].0.clone());
            (rows, next, calls)
        }
        None => {
            let (rows, next) = page_by_join(r, &pair, after, limit).await?;
            let calls = texts(r, &ids(&rows, "call_id")).await?;
            (rows, next, calls)
        }
    };
    for row in rows.iter_mut() {
        if let Some(hit) = calls.iter().find(|c| c["call_id"] == row["call_id"]) {
            for k in ["case_id", "model", "response"] {
                row[k] = hit[k].clone();
            }
        }
    }
    let mut cases = r
        .keys
        .rows(
            "cases",
            "case_id",
            &ids(&rows, "case_id"),
            Some(&["case_id", "test", "input"]),
        )
        .await?;
    snip(&mut cases, "input");
    for row in rows.iter_mut() {
        if let Some(hit) = cases.iter().find(|c| c["case_id"] == row["case_id"]) {
            row["test"] = hit["test"].clone();
            row["input"] = hit["input"].clone();
        }
    }
    Ok(json!({
        "a": pair.a.tag(), "b": pair.b.tag(), "kind_a": format!("{kind_a:?}"),
        "kind_b": format!("{kind_b:?}"), "matrix": matrix, "disagree": disagree,
        "total": total, "rows": rows, "next": next,
    }))
}

/// The page's answers: their model, case and the start of the response.
async fn texts(r: &RunView, ids: &[String]) -> Result<Vec<Value>, ViewError> {
    let mut calls = r
        .keys
        .rows(
            "calls",
            "call_id",
            ids,
            Some(&["call_id", "case_id", "model", "response"]),
        )
        .await?;
    snip(&mut calls, "response");
    Ok(calls)
}

/// Computes ahead the diff of each scorer's two newest versions (the diff a user opens
/// after a rescore); a failure is left for the request to report.
pub async fn warm(r: &RunView) {
    let Ok(tags) = r.scorer_tags().await else {
        return;
    };
    let mut names: Vec<&str> = tags.iter().map(|t| t.name.as_str()).collect();
    names.dedup();
    for name in names {
        let of: Vec<&ScorerId> = tags.iter().filter(|t| t.name == name).collect();
        if let [.., a, b] = of[..] {
            let _ = diff_of(r, a.clone(), b.clone()).await;
        }
    }
}

/// The pair of versions and its diff: kept for this manifest, or computed now.
async fn diff_of(r: &RunView, a: ScorerId, b: ScorerId) -> Result<(Pair, Arc<Diff>), ViewError> {
    let kind_a = crate::stages::score::metric_kind(&r.store, &a).await?;
    let kind_b = crate::stages::score::metric_kind(&r.store, &b).await?;
    // About 1M rows a slice (`EVALFLOW_VIEW_DIFF_ROWS`; 2M held 610 MiB at 10M answers),
    // counted from the parts listed (each at most PART_ROWS rows).
    let parts =
        r.store.list_parts(&a.dir()).await?.len() + r.store.list_parts(&b.dir()).await?.len();
    let per_pass =
        crate::config::env_count("EVALFLOW_VIEW_DIFF_ROWS").map_or(1_000_000, |n| n as usize);
    let passes = (parts * crate::storage::PART_ROWS)
        .div_ceil(2 * per_pass)
        .max(1);
    let pair = Pair {
        slices: crate::query::id_slices("call_id", passes),
        a,
        b,
        kind_a,
        kind_b,
    };
    let diff = {
        let key = format!("scorer-diff {} {}", pair.a.tag(), pair.b.tag());
        let mut memo = r.memo.lock().await;
        match memo
            .get(&key)
            .cloned()
            .and_then(|d| d.downcast::<Diff>().ok())
        {
            Some(d) => d,
            None => {
                let d = Arc::new(matrix(r, &pair).await?);
                memo.insert(key, d.clone());
                d
            }
        }
    };
    Ok((pair, diff))
}

/// The matrix, slice by slice, with the disagreeing ids of each cell while they fit.
async fn matrix(r: &RunView, pair: &Pair) -> Result<Diff, ViewError> {
    let mut diff = Diff {
        cells: BTreeMap::new(),
        ids: Some(Vec::new()),
        names: Vec::new(),
    };
    for slice in &pair.slices {
        let sql = format!(
            "SELECT coalesce(x.k, 'absent') AS a, coalesce(y.k, 'absent') AS b, count(*) AS n, \
             array_agg(coalesce(x.call_id, y.call_id)) FILTER (WHERE coalesce(x.k, 'absent') \
             <> coalesce(y.k, 'absent')) AS ids FROM {} GROUP BY 1, 2",
            pair.joined(slice)
        );
        let batches = super::rows::collect(&r.ctx, &sql).await?;
        let df = || QueryError::df(sql.clone());
        for b in &batches {
            let text = |i: usize| cast(b.column(i), &DataType::Utf8).map_err(|e| df()(e.into()));
            let (ca, cb) = (text(0)?, text(1)?);
            let n = cast(b.column(2), &DataType::Int64).map_err(|e| df()(e.into()))?;
            let ids_col = b.column(3).as_list::<i32>();
            for row in 0..b.num_rows() {
                let key = (
                    ca.as_string::<i32>().value(row).to_string(),
                    cb.as_string::<i32>().value(row).to_string(),
                );
                *diff.cells.entry(key.clone()).or_default() +=
                    n.as_primitive::<Int64Type>().value(row);
                if ids_col.is_null(row) {
                    continue;
                }
                let list =
                    cast(&ids_col.value(row), &DataType::Utf8).map_err(|e| df()(e.into()))?;
                let cell = match diff.names.iter().position(|k| *k == key) {
                    Some(i) => i,
                    None => {
                        diff.names.push(key);
                        diff.names.len() - 1
                    }
                } as u32;
                if let Some(kept) = &mut diff.ids {
                    if kept.len() + list.len() > kept_ids() {
                        diff.ids = None;
                        continue;
                    }
                    kept.extend(
                        list.as_string::<i32>()
                            .iter()
                            .flatten()
                            .map(|id| (id.to_string(), cell)),
                    );
                }
            }
        }
    }
    if let Some(kept) = &mut diff.ids {
        kept.sort_unstable();
    }
    Ok(diff)
}

/// The first and last-plus-one positions of a page of `limit` kept ids after the cursor.
fn window(list: &[(String, u32)], after: Option<&str>, limit: usize) -> (usize, usize) {
    let start = after.map_or(0, |c| list.partition_point(|(id, _)| id.as_str() <= c));
    (start, (start + limit).min(list.len()))
}

/// The rows of a page of kept ids: both versions' scores looked up.
async fn page_of_kept(
    r: &RunView,
    pair: &Pair,
    diff: &Diff,
    page: &[(String, u32)],
) -> Result<Vec<Value>, ViewError> {
    let want: Vec<String> = page.iter().map(|(id, _)| id.clone()).collect();
    let cols: &[&str] = &["call_id", "score", "passed", "label"];
    let (dir_a, dir_b) = (pair.a.dir(), pair.b.dir());
    let (xs, ys) = futures::try_join!(
        r.keys.rows(&dir_a, "call_id", &want, Some(cols)),
        r.keys.rows(&dir_b, "call_id", &want, Some(cols)),
    )?;
    let class = |c: &str| {
        if c == "absent" { Value::Null } else { json!(c) }
    };
    Ok(page
        .iter()
        .map(|(id, cell)| {
            let x = xs.iter().find(|v| v["call_id"] == id.as_str());
            let y = ys.iter().find(|v| v["call_id"] == id.as_str());
            let of = |v: Option<&Value>, k: &str| v.map_or(Value::Null, |v| v[k].clone());
            let (ca, cb) = &diff.names[*cell as usize];
            json!({
                "call_id": id, "score_a": of(x, "score"), "score_b": of(y, "score"),
                "passed_a": of(x, "passed"), "passed_b": of(y, "passed"),
                "label_a": of(x, "label"), "label_b": of(y, "label"),
                "class_a": class(ca), "class_b": class(cb),
            })
        })
        .collect())
}

/// A page by joining the slices from the cursor's on (when the ids were too many to keep).
async fn page_by_join(
    r: &RunView,
    pair: &Pair,
    after: Option<&str>,
    limit: usize,
) -> Result<(Vec<Value>, Option<String>), ViewError> {
    let keyset = after
        .map(|c| format!(" AND coalesce(x.call_id, y.call_id) > {}", lit(c)))
        .unwrap_or_default();
    // The slices are in id order: start at the cursor's, read on until the page is full.
    let n = pair.slices.len();
    let first = after
        .and_then(|c| u8::from_str_radix(c.get(..2)?, 16).ok())
        .map_or(0, |v| {
            (0..n)
                .find(|p| (v as usize) < (p + 1) * 256 / n)
                .unwrap_or(0)
        });
    let mut rows: Vec<Value> = Vec::new();
    for slice in &pair.slices[first..] {
        let got = json_rows(
            &r.ctx,
            &format!(
                "SELECT coalesce(x.call_id, y.call_id) AS call_id, x.score AS score_a, y.score AS \
                 score_b, x.passed AS passed_a, y.passed AS passed_b, x.label AS label_a, \
                 y.label AS label_b, x.k AS class_a, y.k AS class_b FROM {} WHERE (x.k IS \
                 DISTINCT FROM y.k){keyset} ORDER BY 1 LIMIT {}",
                pair.joined(slice),
                limit + 1 - rows.len()
            ),
        )
        .await?;
        rows.extend(got.as_array().cloned().unwrap_or_default());
        if rows.len() > limit {
            break;
        }
    }
    let next = if rows.len() > limit {
        rows.truncate(limit);
        rows.last()
            .and_then(|r| r["call_id"].as_str().map(str::to_string))
    } else {
        None
    };
    Ok((rows, next))
}
