//! The answers behind a number: pages of answers, one answer, two scorer versions side by
//! side, two runs paired.
//!
//! A page is a positional scan, not a sort: the cursor names a part of the listed table (the
//! chosen scorer version's `scores` parts, or `calls` when the run has no scores) and how many
//! of its matching rows were shown, so the next page reads on from there, one part at a time,
//! in a one-partition plan that keeps the file's order. The filters are pushed into the
//! Parquet scan (row groups pruned by their statistics, rows filtered while decoding) and the
//! plan stops at the page's last row: a page never sorts or skips over the whole table. The
//! page's texts come from point lookups by `call_id` and `case_id` (parts' bloom filters).

use serde_json::{Value, json};

use super::ViewError;
use super::catalog::RunView;
use super::rows::{json_rows, lit};
use crate::config::ScorerId;

/// Characters of an input or a response shown in a page's row.
const SNIPPET: usize = 200;
/// Rows of a page by default, and at most.
pub(super) const DEFAULT_LIMIT: usize = 50;
pub(super) const MAX_LIMIT: usize = 500;

/// The filters of `GET /api/runs/{run}/answers`.
#[derive(Debug, Default)]
pub struct Filter {
    eq: Vec<(&'static str, String)>,
    passed: Option<Option<bool>>,
    score_min: Option<f64>,
    score_max: Option<f64>,
    q: Option<String>,
    scorer: Option<String>,
    limit: usize,
    after: Option<(String, usize)>,
}

impl Filter {
    /// Parses the query string; an unknown parameter or a malformed value is refused.
    pub fn parse(q: &[(String, String)]) -> Result<Filter, ViewError> {
        let mut f = Filter {
            limit: DEFAULT_LIMIT,
            ..Filter::default()
        };
        for (k, v) in q {
            if v.is_empty() {
                continue;
            }
            let bad = |what: &str| ViewError::BadRequest(format!("{k}={v}: {what}"));
            match k.as_str() {
                "test" => f.eq.push(("test", v.clone())),
                "capability" => f.eq.push(("capability", v.clone())),
                "test_type" => f.eq.push(("test_type", v.clone())),
                "model" => f.eq.push(("model", v.clone())),
                "validity" => f.eq.push(("validity", v.clone())),
                "role" => f.eq.push(("role", v.clone())),
                "finish_reason" => f.eq.push(("finish_reason", v.clone())),
                "scorer" => f.scorer = Some(v.clone()),
                "q" => f.q = Some(v.clone()),
                "passed" => {
                    f.passed = Some(match v.as_str() {
                        "true" => Some(true),
                        "false" => Some(false),
                        "null" => None,
                        _ => return Err(bad("give true, false or null")),
                    })
                }
                "score_min" => f.score_min = Some(v.parse().map_err(|_| bad("not a number"))?),
                "score_max" => f.score_max = Some(v.parse().map_err(|_| bad("not a number"))?),
                "limit" => {
                    let n: usize = v.parse().map_err(|_| bad("not a whole number"))?;
                    if n == 0 || n > MAX_LIMIT {
                        return Err(bad(&format!("from 1 to {MAX_LIMIT}")));
                    }
                    f.limit = n;
                }
                "after" => f.after = Some(parse_cursor(v).ok_or_else(|| bad("not a cursor"))?),
                "token" => {}
                _ => {
                    return Err(ViewError::BadRequest(format!(
                        "unknown filter `{k}` (test, capability, test_type, model, validity, \
                         role, finish_reason, scorer, passed, score_min, score_max, q, limit, \
                         after)"
                    )));
                }
            }
        }
        Ok(f)
    }
}

/// `PART_NAME~SHOWN`: the part the last page ended in and how many of its matching rows were
/// shown.
fn parse_cursor(s: &str) -> Option<(String, usize)> {
    let (part, n) = s.rsplit_once('~')?;
    if part.is_empty() || part.contains('/') {
        return None;
    }
    Some((part.to_string(), n.parse().ok()?))
}

/// The columns a page row has, and where each comes from.
const SCORE_COLS: &str = "call_id, case_id, model, sample_idx, validity, score, passed, label, \
                          test, capability, test_type, role";
const CALL_COLS: &str = "call_id, case_id, model, sample_idx, finish_reason";
/// The filters a walk answers in its own scan; the others are checked on the rows' lookups.
const SCORE_NATIVE: &[&str] = &[
    "model",
    "validity",
    "test",
    "capability",
    "test_type",
    "role",
];
const CALL_NATIVE: &[&str] = &["model", "finish_reason"];
/// Parts whose page queries run at once (a full-scan search uses both cores).
const LOOKAHEAD: usize = 2;

/// What a page walks: one scorer version's `scores` parts, or `calls` (a run without
/// scores, or a text search: the responses are in `calls`, so a search reads each part
/// once, with the `ILIKE` in the part's own scan).
struct Walk<'a> {
    scorer: Option<&'a ScorerId>,
    on_calls: bool,
}

/// `GET /api/runs/{run}/answers`.
pub async fn page(r: &RunView, f: &Filter) -> Result<Value, ViewError> {
    let scorer = r.scorer(f.scorer.as_deref()).await?;
    let has_score_filter = f.passed.is_some() || f.score_min.is_some() || f.score_max.is_some();
    if scorer.is_none() && has_score_filter {
        return Err(ViewError::BadRequest(
            "passed, score_min, score_max: the run has no scores to filter on".into(),
        ));
    }
    let walk = Walk {
        scorer: scorer.as_ref(),
        on_calls: scorer.is_none() || f.q.is_some(),
    };
    let (dir, cols, native) = match (walk.on_calls, walk.scorer) {
        (false, Some(s)) => (s.dir(), SCORE_COLS.to_string(), SCORE_NATIVE),
        _ => (
            "calls".to_string(),
            format!("{CALL_COLS}, substr(response, 1, {SNIPPET}) AS response"),
            CALL_NATIVE,
        ),
    };
    let mut conds: Vec<String> = Vec::new();
    let mut after: Vec<(&'static str, String)> = Vec::new();
    for (col, v) in &f.eq {
        if native.contains(col) {
            conds.push(format!("{col} = {}", lit(v)));
        } else {
            after.push((col, v.clone()));
        }
    }
    if !walk.on_calls {
        if let Some(p) = f.passed {
            conds.push(match p {
                Some(true) => "passed".into(),
                Some(false) => "NOT passed".into(),
                None => "passed IS NULL".into(),
            });
        }
        for (v, op) in [(f.score_min, ">="), (f.score_max, "<=")] {
            if let Some(v) = v {
                conds.push(format!("score {op} {v}"));
            }
        }
    }
    if let Some(q) = &f.q {
        let pat = lit(&format!(
            "%{}%",
            q.replace('\\', "\\\\")
                .replace('%', "\\%")
                .replace('_', "\\_")
        ));
        conds.push(match r.input_matches(&pat).await? {
            Some(t) => format!("(response ILIKE {pat} OR case_id IN (SELECT case_id FROM {t}))"),
            None => format!("response ILIKE {pat}"),
        });
    }
    // Rows checked after their lookups: a chunk of candidates at a time.
    let checked = !after.is_empty() || (walk.on_calls && walk.scorer.is_some());
    let keep = |row: &Value| -> bool {
        if walk.on_calls && walk.scorer.is_some() {
            // Only answers the scorer version scored, as on its own walk.
            if !row["scorer"].is_string() {
                return false;
            }
            let passed_ok = match f.passed {
                None => true,
                Some(p) => row["passed"].as_bool() == p,
            };
            let score = row["score"].as_f64();
            let in_range = |b: Option<f64>, above: bool| {
                b.is_none_or(|b| score.is_some_and(|s| if above { s >= b } else { s <= b }))
            };
            if !passed_ok || !in_range(f.score_min, true) || !in_range(f.score_max, false) {
                return false;
            }
        }
        after.iter().all(|(col, v)| row[*col].as_str() == Some(v))
    };
    let chunk = if checked {
        (f.limit * 4).max(200)
    } else {
        f.limit + 1
    };
    let cond = if conds.is_empty() {
        "TRUE".to_string()
    } else {
        conds.join(" AND ")
    };
    let parts = r.store.list_parts(&dir).await?;
    let names: Vec<String> = parts
        .iter()
        .map(|p| p.location.filename().unwrap_or_default().to_string())
        .collect();
    let (mut i, mut skip) = match &f.after {
        None => (0, 0),
        Some((name, shown)) => match names.iter().position(|n| n == name) {
            Some(i) => (i, *shown),
            // The part was compacted away: go on from the parts after its name.
            None => (names.iter().take_while(|n| *n <= name).count(), 0),
        },
    };
    let ctx = r.page_ctx().await?;
    let query = |i: usize, skip: usize| {
        let (cols, cond) = (&cols, &cond);
        let url = r.store.table_url(&format!("{dir}/{}", names[i]));
        async move {
            let url = url.trim_end_matches('/');
            let table = format!("part_{}", uuid::Uuid::new_v4().simple());
            ctx.register_parquet(&table, url, Default::default())
                .await
                .map_err(crate::query::QueryError::df(url.to_string()))?;
            let sql =
                format!("SELECT {cols} FROM {table} WHERE {cond} LIMIT {chunk} OFFSET {skip}");
            let got = json_rows(ctx, &sql).await;
            let _ = ctx.deregister_table(&table);
            Ok::<_, ViewError>(match got? {
                Value::Array(a) => a,
                _ => Vec::new(),
            })
        }
    };
    let mut rows: Vec<Value> = Vec::new();
    let mut next = None;
    'walk: while i < parts.len() {
        // This part from the cursor, and the next parts from their start, at once.
        let ahead = if skip == 0 { LOOKAHEAD } else { 1 };
        let batch: Vec<(usize, usize)> = (i..parts.len().min(i + ahead))
            .map(|j| (j, if j == i { skip } else { 0 }))
            .collect();
        let results =
            futures::future::try_join_all(batch.iter().map(|&(j, skip)| query(j, skip))).await?;
        for ((j, from), mut got) in batch.into_iter().zip(results) {
            let n = got.len();
            if checked {
                fill_page(r, &mut got, &walk).await?;
            }
            for (k, row) in got.into_iter().enumerate() {
                if checked && !keep(&row) {
                    continue;
                }
                if rows.len() == f.limit {
                    next = Some(format!("{}~{}", names[j], from + k));
                    break 'walk;
                }
                rows.push(row);
            }
            if n == chunk {
                // The part has more: read on from here.
                (i, skip) = (j, from + n);
                continue 'walk;
            }
            (i, skip) = (j + 1, 0);
        }
    }
    if !checked {
        fill_page(r, &mut rows, &walk).await?;
    }
    if let Some(s) = &scorer {
        for row in &mut rows {
            row["scorer"] = json!(s.name);
            row["scoring_version"] = json!(s.version);
        }
    }
    Ok(json!({
        "rows": rows,
        "next": next,
        "scorer": scorer.map(|s| s.tag()),
    }))
}

/// Adds to a page's rows, by point lookups, what their walk did not read: the texts, the
/// case's fields, and the verdict (from `validity`, or the scorer version's row when a
/// page of calls has one).
async fn fill_page(r: &RunView, rows: &mut [Value], walk: &Walk<'_>) -> Result<(), ViewError> {
    let (call_ids, case_ids) = (ids(rows, "call_id"), ids(rows, "case_id"));
    let mut case_cols = vec!["case_id", "input", "expected"];
    let on_own_scores = walk.on_calls && walk.scorer.is_some();
    if walk.on_calls && !on_own_scores {
        case_cols.extend(["test", "capability", "test_type", "role"]);
    }
    let none: &[String] = &[];
    let k = &r.keys;
    let (calls, cases, verdicts, scores) = futures::try_join!(
        k.rows(
            "calls",
            "call_id",
            if walk.on_calls { none } else { &call_ids },
            Some(&["call_id", "response", "finish_reason"])
        ),
        k.rows("cases", "case_id", &case_ids, Some(&case_cols)),
        k.rows(
            "validity",
            "call_id",
            if walk.on_calls && !on_own_scores {
                &call_ids
            } else {
                none
            },
            Some(&["call_id", "validity"])
        ),
        async {
            match (on_own_scores, walk.scorer) {
                (true, Some(s)) => {
                    let cols = [
                        "call_id",
                        "scorer",
                        "validity",
                        "score",
                        "passed",
                        "label",
                        "test",
                        "capability",
                        "test_type",
                        "role",
                    ];
                    k.rows(&s.dir(), "call_id", &call_ids, Some(&cols)).await
                }
                _ => Ok(Vec::new()),
            }
        }
    )?;
    let (mut calls, mut cases) = (calls, cases);
    snip(&mut calls, "response");
    snip(&mut cases, "input");
    for row in rows.iter_mut() {
        for (src, key) in [
            (&calls, "call_id"),
            (&cases, "case_id"),
            (&verdicts, "call_id"),
            (&scores, "call_id"),
        ] {
            if let Some(hit) = src.iter().find(|x| x[key] == row[key])
                && let (Some(dst), Some(from)) = (row.as_object_mut(), hit.as_object())
            {
                for (k, v) in from {
                    dst.entry(k.clone()).or_insert_with(|| v.clone());
                }
            }
        }
    }
    Ok(())
}

/// The distinct values of `key` in `rows`.
pub(super) fn ids(rows: &[Value], key: &str) -> Vec<String> {
    let mut v: Vec<String> = rows
        .iter()
        .filter_map(|r| r[key].as_str().map(str::to_string))
        .collect();
    v.sort();
    v.dedup();
    v
}

/// Cuts each row's `key` text to [`SNIPPET`] characters.
pub(super) fn snip(rows: &mut [Value], key: &str) {
    for row in rows {
        if let Some(s) = row[key].as_str()
            && let Some((at, _)) = s.char_indices().nth(SNIPPET)
        {
            row[key] = json!(s[..at]);
        }
    }
}

/// `GET /api/runs/{run}/answers/{call_id}`.
pub async fn one(r: &RunView, call_id: &str) -> Result<Value, ViewError> {
    let id = [call_id.to_string()];
    let k = &r.keys;
    let call = k
        .rows("calls", "call_id", &id, None)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| ViewError::NotFound(format!("answer `{call_id}`: no such call_id")))?;
    let case_id = call["case_id"].as_str().unwrap_or_default().to_string();
    let model = call["model"].as_str().unwrap_or_default().to_string();
    let tags = r.scorer_tags().await?;
    let score_cols: &[&str] = &[
        "scorer",
        "scoring_version",
        "score",
        "passed",
        "label",
        "prob",
        "validity",
        "detail",
        "answers",
    ];
    let each_version = tags.iter().map(|t| {
        let id = &id;
        async move { k.rows(&t.dir(), "call_id", id, Some(score_cols)).await }
    });
    let (case, validity, scores) = futures::try_join!(
        k.rows("cases", "case_id", std::slice::from_ref(&case_id), None),
        k.rows("validity", "call_id", &id, None),
        futures::future::try_join_all(each_version),
    )?;
    let case = case.into_iter().next().unwrap_or(Value::Null);
    let validity = validity.into_iter().next().unwrap_or(Value::Null);
    let mut scores: Vec<Value> = scores.into_iter().flatten().collect();
    scores.sort_by(|a, b| {
        let key = |v: &Value| (v["scorer"].to_string(), v["scoring_version"].to_string());
        key(a).cmp(&key(b))
    });
    let primary = tags.into_iter().next();
    let samples = answers_of(r, &case_id, &model, primary.as_ref()).await?;
    let base = match (case["role"].as_str(), case["group_id"].as_str()) {
        (Some("perturbed"), Some(group)) => {
            let base_case = k
                .rows("cases", "group_id", &[group.to_string()], None)
                .await?
                .into_iter()
                .filter(|c| c["role"] == "base")
                .min_by(|a, b| a["case_id"].as_str().cmp(&b["case_id"].as_str()));
            match base_case {
                Some(bc) => {
                    let id = bc["case_id"].as_str().unwrap_or_default().to_string();
                    let answers = answers_of(r, &id, &model, primary.as_ref()).await?;
                    json!({"case": bc, "answers": answers})
                }
                None => Value::Null,
            }
        }
        _ => Value::Null,
    };
    Ok(json!({
        "call": call, "case": case, "validity": validity, "scores": scores,
        "samples": samples, "base": base,
    }))
}

/// Every sample of one case for one model, with its verdict and the primary scorer's score
/// (point lookups: the calls by `case_id`, then their verdicts and scores by `call_id`).
async fn answers_of(
    r: &RunView,
    case_id: &str,
    model: &str,
    primary: Option<&ScorerId>,
) -> Result<Value, ViewError> {
    let k = &r.keys;
    let mut calls: Vec<Value> = k
        .rows(
            "calls",
            "case_id",
            &[case_id.to_string()],
            Some(&[
                "call_id",
                "model",
                "sample_idx",
                "response",
                "finish_reason",
            ]),
        )
        .await?
        .into_iter()
        .filter(|c| c["model"] == model)
        .collect();
    calls.sort_by_key(|c| c["sample_idx"].as_i64());
    let ids = ids(&calls, "call_id");
    let (verdicts, scores) = futures::try_join!(
        k.rows("validity", "call_id", &ids, Some(&["call_id", "validity"])),
        async {
            match primary {
                Some(s) => {
                    k.rows(
                        &s.dir(),
                        "call_id",
                        &ids,
                        Some(&["call_id", "score", "passed"]),
                    )
                    .await
                }
                None => Ok(Vec::new()),
            }
        }
    )?;
    for c in calls.iter_mut() {
        if let Some(o) = c.as_object_mut() {
            o.remove("model");
        }
        for k in ["validity", "score", "passed"] {
            c[k] = Value::Null;
        }
        if let Some(v) = verdicts.iter().find(|v| v["call_id"] == c["call_id"]) {
            c["validity"] = v["validity"].clone();
        }
        if let Some(s) = scores.iter().find(|s| s["call_id"] == c["call_id"]) {
            c["score"] = s["score"].clone();
            c["passed"] = s["passed"].clone();
        }
    }
    Ok(Value::Array(calls))
}

/// How a scorer's row is classed in the disagreement matrix: pass/fail, the label, or the
/// score.
pub(super) fn class_expr(kind: crate::stages::score::MetricKind) -> &'static str {
    use crate::stages::score::MetricKind;
    match kind {
        MetricKind::PassFail => {
            "CASE WHEN passed IS NULL THEN 'unscored' WHEN passed THEN 'pass' ELSE 'fail' END"
        }
        MetricKind::Label => "coalesce(label, 'unscored')",
        MetricKind::Numeric => "coalesce(CAST(score AS VARCHAR), 'unscored')",
    }
}

/// `GET /api/compare?a=&b=`: the rows `evalflow compare A B` prints (the same SQL), and the
/// cases whose verdict flipped.
pub async fn compare(a: &RunView, b: &RunView) -> Result<Value, ViewError> {
    let ctx = crate::query::new_context();
    crate::query::register_run_read_only_as(&ctx, &a.store, "a_").await?;
    crate::query::register_run_read_only_as(&ctx, &b.store, "b_").await?;
    let scorer = a
        .scorer(None)
        .await?
        .ok_or_else(|| ViewError::BadRequest(format!("run `{}` has no scores", a.run_id)))?;
    let sql = crate::report::paired_comparison_sql(&scorer.name);
    let rows = json_rows(&ctx, &sql).await?;
    let kind = crate::stages::score::metric_kind(&a.store, &scorer).await?;
    let class = class_expr(kind);
    let side = |p: &str| {
        format!(
            "(SELECT s.call_id, s.case_id, s.model, s.sample_idx, {class} AS k, c.test FROM \
             {p}scores s JOIN {p}cases c ON c.case_id = s.case_id WHERE s.scorer = {} AND \
             s.scoring_version = (SELECT max(scoring_version) FROM {p}scores WHERE scorer = \
             {}))",
            lit(&scorer.name),
            lit(&scorer.name)
        )
    };
    let flipped = json_rows(
        &ctx,
        &format!(
            "SELECT x.case_id, x.test, x.call_id AS call_a, y.call_id AS call_b, x.k AS a, y.k \
             AS b FROM {} x JOIN {} y ON x.case_id = y.case_id AND x.sample_idx = \
             y.sample_idx WHERE x.k <> y.k AND x.k <> 'unscored' AND y.k <> 'unscored' ORDER \
             BY x.test, x.case_id LIMIT 200",
            side("a_"),
            side("b_")
        ),
    )
    .await?;
    Ok(
        json!({"a": a.run_id, "b": b.run_id, "scorer": scorer.name, "rows": rows,
              "flipped": flipped}),
    )
}
