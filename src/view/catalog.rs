//! The runs under the viewer's root: found by their manifests (the root itself, or folders
//! one or two levels below it), summarised from manifests and Parquet footers only, and
//! opened for queries on demand (one DataFusion context per run, rebuilt when its manifest
//! changes; its listing tables list parts at every query, so a run being written grows).

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::prelude::SessionContext;
use object_store::path::Path;
use serde_json::{Value, json};
use tokio::sync::Mutex;

use super::ViewError;
use super::rows::lit;
use crate::config::ScorerId;
use crate::storage::{Manifest, RunStore, StageStatus};

/// One run, open for queries.
pub struct RunView {
    pub run_id: String,
    /// The run's folder relative to the viewer's root (`""` when the root is the run).
    pub path: String,
    pub store: RunStore,
    pub manifest: Manifest,
    pub ctx: SessionContext,
    /// Point lookups by key (kept across the run's views).
    pub keys: Arc<super::keys::Keys>,
    /// A one-partition session over the same tables, for pages: its plans keep a part's
    /// row order, so a page's cursor is a count of rows.
    page: tokio::sync::OnceCell<SessionContext>,
    /// The run page's filter values and token totals ([`RunView::facets`]).
    facets: tokio::sync::OnceCell<Value>,
    /// The last searches' input matches ([`RunView::input_matches`]).
    searches: Mutex<std::collections::VecDeque<(String, Option<String>)>>,
    /// Results computed once per manifest (the scorer diffs), by a key their view names.
    pub memo: Mutex<HashMap<String, Arc<dyn std::any::Any + Send + Sync>>>,
    /// The manifest's bytes this view was built from.
    stamp: Vec<u8>,
}

impl RunView {
    /// The values each filter can take and the token totals: a scan of the tables, made
    /// once per manifest (a run being written gets a new view when its manifest changes).
    pub async fn facets(&self) -> Result<&Value, ViewError> {
        self.facets
            .get_or_try_init(|| async {
                let mut v = json!({});
                let distinct = |col: &str, table: &str| {
                    format!(
                        "SELECT DISTINCT {col} AS v FROM {table} WHERE {col} IS NOT NULL \
                         ORDER BY v LIMIT 1000"
                    )
                };
                for (key, col, table) in [
                    ("tests", "test", "cases"),
                    ("capabilities", "capability", "cases"),
                    ("test_types", "test_type", "cases"),
                    ("validities", "validity", "validity"),
                    ("finish_reasons", "finish_reason", "calls"),
                ] {
                    let rows = crate::query::text_rows(&self.ctx, &distinct(col, table)).await?;
                    v[key] = json!(
                        rows.into_iter()
                            .filter_map(|mut x| x.remove(0))
                            .collect::<Vec<_>>()
                    );
                }
                let tokens = crate::query::text_rows(
                    &self.ctx,
                    "SELECT sum(prompt_tokens), sum(completion_tokens), sum(reasoning_tokens), \
                     avg(latency_ms) FROM calls",
                )
                .await?;
                let t = tokens.into_iter().next().unwrap_or_default();
                let num = |i: usize| {
                    t.get(i)
                        .cloned()
                        .flatten()
                        .and_then(|s| s.parse::<f64>().ok())
                };
                v["tokens"] = json!({"prompt": num(0), "completion": num(1), "reasoning": num(2)});
                v["mean_latency_ms"] = json!(num(3));
                Ok::<_, ViewError>(v)
            })
            .await
    }

    /// The one-partition session of pages (made on first use).
    pub async fn page_ctx(&self) -> Result<&SessionContext, ViewError> {
        self.page
            .get_or_try_init(|| async {
                let ctx = crate::query::with_pushdown(crate::query::ordered_context());
                crate::query::register_run_read_only(&ctx, &self.store).await?;
                Ok::<_, ViewError>(ctx)
            })
            .await
    }

    /// The cases whose input matches `pat` (an `ILIKE` pattern, as a SQL literal): a table
    /// of their `case_id`s registered in the page session, `None` when there are none. One
    /// scan of `cases` per search, kept for the last few (a search's next pages ask again).
    pub async fn input_matches(&self, pat: &str) -> Result<Option<String>, ViewError> {
        const KEPT: usize = 8;
        let mut kept = self.searches.lock().await;
        if let Some((_, t)) = kept.iter().find(|(p, _)| p == pat) {
            return Ok(t.clone());
        }
        let sql = format!("SELECT DISTINCT case_id FROM cases WHERE input ILIKE {pat}");
        let batches = super::rows::collect(&self.ctx, &sql).await?;
        let df = || crate::query::QueryError::df(sql.clone());
        let table = match batches.first() {
            Some(b) if batches.iter().any(|b| b.num_rows() > 0) => {
                let name = format!("input_hits_{}", uuid::Uuid::new_v4().simple());
                let mem = datafusion::datasource::MemTable::try_new(b.schema(), vec![batches])
                    .map_err(df())?;
                self.page_ctx()
                    .await?
                    .register_table(&name, Arc::new(mem))
                    .map_err(df())?;
                Some(name)
            }
            _ => None,
        };
        kept.push_back((pat.to_string(), table.clone()));
        if kept.len() > KEPT
            && let Some((_, Some(old))) = kept.pop_front()
        {
            let _ = self.page_ctx().await?.deregister_table(&old);
        }
        Ok(table)
    }

    /// Scorer versions with a folder under `scores/`, in the manifest's order, then any
    /// others found (one listing, no footer).
    pub async fn scorer_tags(&self) -> Result<Vec<ScorerId>, ViewError> {
        let mut tags: Vec<String> = folders(&self.store, "scores")
            .await?
            .into_iter()
            .filter(|t| t.contains('@'))
            .collect();
        let order = |t: &str| {
            self.manifest
                .scorer_versions
                .iter()
                .position(|m| m == t)
                .unwrap_or(usize::MAX)
        };
        tags.sort_by_key(|t| order(t));
        Ok(tags.iter().filter_map(|t| ScorerId::parse(t)).collect())
    }

    /// [`Self::scorer_tags`] with each version's rows (from its parts' footers).
    pub async fn scorer_ids(&self) -> Result<Vec<(ScorerId, u64)>, ViewError> {
        let mut out = Vec::new();
        for id in self.scorer_tags().await? {
            let mut rows = 0;
            for p in self.store.list_parts(&id.dir()).await? {
                rows += self.store.part_rows(&p).await?;
            }
            if rows > 0 {
                out.push((id, rows));
            }
        }
        Ok(out)
    }

    /// The scorer version `spec` names (`NAME@VERSION`, or `NAME`: its newest), or the
    /// run's primary one (the first with parts).
    pub async fn scorer(&self, spec: Option<&str>) -> Result<Option<ScorerId>, ViewError> {
        let ids: Vec<(ScorerId, ())> = self
            .scorer_tags()
            .await?
            .into_iter()
            .map(|id| (id, ()))
            .collect();
        let Some(spec) = spec.filter(|s| !s.is_empty()) else {
            return Ok(ids.into_iter().next().map(|(id, _)| id));
        };
        let hit = ids
            .iter()
            .rev()
            .find(|(id, _)| id.tag() == spec || id.name == spec)
            .map(|(id, _)| id.clone());
        match hit {
            Some(id) => Ok(Some(id)),
            None => Err(ViewError::BadRequest(format!(
                "scorer `{spec}`: the run has {}",
                if ids.is_empty() {
                    "no scores".to_string()
                } else {
                    ids.iter()
                        .map(|(id, _)| id.tag())
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ))),
        }
    }

    /// `GET /api/runs/{run}/scorers`.
    pub async fn scorers_json(&self) -> Result<Value, ViewError> {
        Ok(Value::Array(
            self.scorer_ids()
                .await?
                .into_iter()
                .map(|(id, rows)| {
                    json!({"scorer": id.name, "scoring_version": id.version,
                           "tag": id.tag(), "rows": rows})
                })
                .collect(),
        ))
    }

    /// `GET /api/runs/{run}/results`: the results table (a few rows per test).
    pub async fn results_json(&self) -> Result<Value, ViewError> {
        super::rows::json_rows(
            &self.ctx,
            "SELECT * FROM results ORDER BY scorer, scoring_version, model, level DESC, \
             capability, test_type, test, label",
        )
        .await
    }
}

/// A run's overall headline and the manifest it was computed from; `None` while computed.
type Headline = (Vec<u8>, Option<Value>);

/// The runs under the root, and the views opened so far.
pub struct Catalog {
    root: RunStore,
    views: Mutex<HashMap<String, Arc<RunView>>>,
    /// Each run's point-lookup indexes, by path.
    keys: Mutex<HashMap<String, Arc<super::keys::Keys>>>,
    /// Rows of each committed part seen (by location and size): a footer is read once.
    part_rows: Mutex<HashMap<(String, u64), u64>>,
    /// Each run's overall headline, by path, with the manifest it was computed from; `None`
    /// while a task computes it.
    headlines: Arc<Mutex<HashMap<String, Headline>>>,
    /// Work done ahead of requests (headlines, indexes, scorer diffs) runs one task at a
    /// time: their peaks of memory do not add up, and requests keep a core.
    pub background: Arc<tokio::sync::Semaphore>,
}

impl Catalog {
    /// Opens the root (it must exist: the viewer creates nothing).
    ///
    /// # Errors
    /// [`crate::storage::StorageError::BadRoot`] for a missing local folder or a bad URL.
    pub async fn open(root: &str) -> Result<Catalog, ViewError> {
        let local = !root.contains("://") || root.starts_with("file://");
        if local {
            let p = root.strip_prefix("file://").unwrap_or(root);
            if !std::path::Path::new(p).is_dir() {
                return Err(crate::storage::StorageError::BadRoot {
                    root: root.to_string(),
                    msg: "no such folder".into(),
                }
                .into());
            }
        }
        Ok(Catalog {
            root: RunStore::open(root)?,
            views: Mutex::new(HashMap::new()),
            keys: Mutex::new(HashMap::new()),
            part_rows: Mutex::new(HashMap::new()),
            headlines: Arc::default(),
            background: Arc::new(tokio::sync::Semaphore::new(1)),
        })
    }

    /// The root as the user named it.
    pub fn root_display(&self) -> &str {
        self.root.display()
    }

    /// The folders (relative to the root) that hold a run: the root itself, or folders one
    /// or two levels below it.
    async fn run_paths(&self) -> Result<Vec<String>, ViewError> {
        if self.root.exists("manifest.json").await? {
            return Ok(vec![String::new()]);
        }
        let mut out = Vec::new();
        let mut frontier = vec![String::new()];
        for _depth in 0..2 {
            let mut next = Vec::new();
            for rel in frontier {
                for child in self.children(&rel).await? {
                    if child.starts_with('_') || child.starts_with('.') {
                        continue;
                    }
                    let path = if rel.is_empty() {
                        child
                    } else {
                        format!("{rel}/{child}")
                    };
                    if self.root.exists(&format!("{path}/manifest.json")).await? {
                        out.push(path);
                    } else {
                        next.push(path);
                    }
                }
            }
            frontier = next;
        }
        out.sort();
        Ok(out)
    }

    async fn children(&self, rel: &str) -> Result<Vec<String>, ViewError> {
        folders(&self.root, rel).await
    }

    /// `GET /api/runs`: every run with its summary; a run that cannot be read is listed
    /// with its error.
    pub async fn list(&self) -> Vec<Value> {
        let paths = match self.run_paths().await {
            Ok(p) => p,
            Err(e) => {
                return vec![json!({"run_id": null, "path": "", "status": "error",
                                         "error": e.to_string()})];
            }
        };
        let mut out = Vec::with_capacity(paths.len());
        let mut seen: HashMap<String, usize> = HashMap::new();
        for path in paths {
            let mut v = match self.open_path(&path).await {
                Ok(r) => self.summary(&r).await,
                Err(e) => json!({"run_id": path.rsplit('/').next().unwrap_or(&path),
                                 "path": path, "status": "error", "error": e.to_string()}),
            };
            // Two folders with one run id (a copied run): the second is named by its path.
            if let Some(id) = v["run_id"].as_str().map(str::to_string) {
                let n = seen.entry(id.clone()).or_default();
                *n += 1;
                if *n > 1 {
                    v["run_id"] = json!(path);
                }
            }
            out.push(v);
        }
        out
    }

    /// The run whose id (or path below the root) is `id`.
    pub async fn run(&self, id: &str) -> Result<Arc<RunView>, ViewError> {
        if id.split('/').any(|s| s == ".." || s == ".") {
            return Err(ViewError::BadRequest(format!(
                "run `{id}`: paths outside the root are refused"
            )));
        }
        // A run opened before: one manifest read, not a walk of the root.
        let known = self
            .views
            .lock()
            .await
            .values()
            .find(|v| v.path == id || v.run_id == id)
            .map(|v| v.path.clone());
        if let Some(path) = known
            && let Ok(v) = self.open_path(&path).await
            && (v.path == id || v.run_id == id)
        {
            return Ok(v);
        }
        let paths = self.run_paths().await?;
        if paths.iter().any(|p| p == id) {
            return self.open_path(id).await;
        }
        for p in &paths {
            if let Ok(r) = self.open_path(p).await
                && r.run_id == id
            {
                return Ok(r);
            }
        }
        Err(ViewError::NotFound(format!(
            "run `{id}`: no such run under {}",
            self.root.display()
        )))
    }

    /// Opens (or reuses, while its manifest is unchanged) the run at `path`.
    async fn open_path(&self, path: &str) -> Result<Arc<RunView>, ViewError> {
        let store = if path.is_empty() {
            self.root.clone()
        } else {
            self.root.child(path)
        };
        let stamp = store
            .get("manifest.json")
            .await?
            .ok_or_else(|| ViewError::NotFound(format!("{}: no manifest.json", store.display())))?;
        if let Some(v) = self.views.lock().await.get(path)
            && v.stamp == stamp
        {
            return Ok(v.clone());
        }
        let manifest: Manifest =
            serde_json::from_slice(&stamp).map_err(|e| crate::storage::StorageError::Manifest {
                location: format!("{}/manifest.json", store.display()),
                msg: e.to_string(),
            })?;
        let ctx = crate::query::sql_context();
        crate::query::register_run_read_only(&ctx, &store).await?;
        let keys = {
            let mut all = self.keys.lock().await;
            match all.get(path) {
                Some(k) => k.clone(),
                None => {
                    let k = Arc::new(super::keys::Keys::new(store.clone()));
                    all.insert(path.to_string(), k.clone());
                    // The first page and answer then find the indexes they need learnt.
                    let (warm, primary) = (k.clone(), manifest.scorer_versions.first().cloned());
                    let turn = self.background.clone();
                    tokio::spawn(async move {
                        let _turn = turn.acquire_owned().await;
                        let mut on = vec![
                            ("calls".to_string(), "call_id"),
                            ("cases".to_string(), "case_id"),
                            ("validity".to_string(), "call_id"),
                            ("calls".to_string(), "case_id"),
                        ];
                        if let Some(s) = primary.as_deref().and_then(ScorerId::parse) {
                            on.push((s.dir(), "call_id"));
                        }
                        for (dir, col) in on {
                            let _ = warm.on(&dir, col).warm().await;
                        }
                    });
                    k
                }
            }
        };
        let view = Arc::new(RunView {
            run_id: manifest.run_id.clone(),
            path: path.to_string(),
            store,
            manifest,
            ctx,
            keys,
            page: tokio::sync::OnceCell::new(),
            facets: tokio::sync::OnceCell::new(),
            searches: Mutex::default(),
            memo: Mutex::default(),
            stamp,
        });
        self.views
            .lock()
            .await
            .insert(path.to_string(), view.clone());
        Ok(view)
    }

    /// Rows of a table from its parts' footers (each footer read once).
    async fn rows(&self, store: &RunStore, table: &str) -> Result<u64, ViewError> {
        let mut n = 0;
        for p in store.list_parts(table).await? {
            let key = (p.location.to_string(), p.size);
            let cached = self.part_rows.lock().await.get(&key).copied();
            n += match cached {
                Some(r) => r,
                None => {
                    let r = store.part_rows(&p).await?;
                    self.part_rows.lock().await.insert(key, r);
                    r
                }
            };
        }
        Ok(n)
    }

    /// The run's overall headline if computed for its current manifest; else starts a task
    /// computing it (a scan of one scorer version: seconds at 10M answers) and says
    /// `pending`.
    async fn overall(&self, r: &Arc<RunView>) -> (Value, bool) {
        let mut h = self.headlines.lock().await;
        if let Some((stamp, v)) = h.get(&r.path)
            && *stamp == r.stamp
        {
            return match v {
                Some(v) => (v.clone(), false),
                None => (Value::Null, true),
            };
        }
        h.insert(r.path.clone(), (r.stamp.clone(), None));
        let (all, r, turn) = (self.headlines.clone(), r.clone(), self.background.clone());
        tokio::spawn(async move {
            let _turn = turn.acquire_owned().await;
            let v = json!({
                "headline": overall_headline(&r).await,
                "validity": verdict_counts(&r).await,
            });
            all.lock()
                .await
                .insert(r.path.clone(), (r.stamp.clone(), Some(v)));
        });
        (Value::Null, true)
    }

    /// A run's line in the index.
    async fn summary(&self, r: &Arc<RunView>) -> Value {
        let m = &r.manifest;
        let status = if m.stages.values().any(|s| s.status == StageStatus::Running) {
            "running"
        } else if m.stages.values().any(|s| s.status == StageStatus::Failed) {
            "failed"
        } else {
            "complete"
        };
        let answers = self.rows(&r.store, "calls").await.ok();
        let scorers: Vec<String> = match r.scorer_tags().await {
            Ok(ids) => ids.iter().map(|id| id.tag()).collect(),
            Err(_) => m.scorer_versions.clone(),
        };
        let models = models_of(r).await;
        let (overall, pending) = self.overall(r).await;
        // From `results` when the run was aggregated; else the verdicts counted with the
        // headline, in the background.
        let validity = match validity_mix(r).await {
            Some(v) if v.as_object().is_some_and(|o| !o.is_empty()) => v,
            _ => overall["validity"].clone(),
        };
        let headline = overall["headline"].clone();
        json!({
            "run_id": r.run_id,
            "path": r.path,
            "created": m.created_at,
            "finished": m.finished_at,
            "pipeline": m.pipeline_path,
            "models": models,
            "scorers": scorers,
            "answers": answers,
            "status": status,
            "error": null,
            "validity": validity,
            "headline": headline,
            "headline_pending": pending,
        })
    }

    /// `GET /api/runs/{run}`: the summary with the run's stages, tokens and the values its
    /// filters can take.
    pub async fn detail(&self, id: &str) -> Result<Value, ViewError> {
        let r = self.run(id).await?;
        let mut v = self.summary(&r).await;
        let stages: serde_json::Map<String, Value> = r
            .manifest
            .stages
            .iter()
            .map(|(k, s)| (k.clone(), json!({"status": s.status, "rows": s.rows})))
            .collect();
        v["stages"] = Value::Object(stages);
        let facets = r.facets().await?;
        if let (Some(dst), Some(src)) = (v.as_object_mut(), facets.as_object()) {
            for (k, x) in src {
                dst.insert(k.clone(), x.clone());
            }
        }
        Ok(v)
    }
}

/// The names of the folders directly under `rel` of `store` (one listing, no recursion).
async fn folders(store: &RunStore, rel: &str) -> Result<Vec<String>, ViewError> {
    let prefix: Path = store.path(rel);
    let listed = store
        .object_store()
        .list_with_delimiter(Some(&prefix))
        .await
        .map_err(|source| store.store_err(&prefix, source))?;
    Ok(listed
        .common_prefixes
        .iter()
        .filter_map(|p| p.filename().map(str::to_string))
        .collect())
}

/// The models of a run: from its results (a small table) when aggregated, else its pipeline.
async fn models_of(r: &RunView) -> Vec<String> {
    let rows = crate::query::text_rows(&r.ctx, "SELECT DISTINCT model FROM results ORDER BY model")
        .await
        .unwrap_or_default();
    let mut models: Vec<String> = rows.into_iter().filter_map(|mut x| x.remove(0)).collect();
    if models.is_empty()
        && let Some(name) = r.manifest.pipeline["model"]["name"].as_str()
    {
        models.push(name.to_string());
    }
    models
}

/// The run's validity mix: the primary scorer's test rows of `results`, summed.
async fn validity_mix(r: &RunView) -> Option<Value> {
    let primary = r.scorer(None).await.ok().flatten()?;
    // The call verdicts, then a judge's own.
    let cols: Vec<&str> = crate::validity::VERDICTS
        .iter()
        .copied()
        .chain(["judge_unparseable", "judge_error"])
        .collect();
    let sums: Vec<String> = cols.iter().map(|c| format!("sum({c})")).collect();
    let rows = crate::query::text_rows(
        &r.ctx,
        &format!(
            "SELECT {} FROM (SELECT DISTINCT model, test, {} FROM results WHERE scorer = {} \
             AND scoring_version = {} AND level = 'test')",
            sums.join(", "),
            cols.join(", "),
            lit(&primary.name),
            lit(&primary.version)
        ),
    )
    .await
    .ok()?;
    let counts = rows.into_iter().next()?;
    let mut validity = serde_json::Map::new();
    for (c, v) in cols.iter().zip(counts) {
        if let Some(n) = v.and_then(|s| s.parse::<i64>().ok())
            && n > 0
        {
            validity.insert(c.to_string(), json!(n));
        }
    }
    Some(Value::Object(validity))
}

/// The verdicts of the run's `validity` table, counted (a run not yet aggregated).
async fn verdict_counts(r: &RunView) -> Option<Value> {
    let rows = crate::query::text_rows(
        r.page_ctx().await.ok()?,
        "SELECT validity, count(*) FROM validity GROUP BY validity ORDER BY validity",
    )
    .await
    .ok()?;
    let mut out = serde_json::Map::new();
    for row in rows {
        if let (Some(Some(k)), Some(Some(n))) = (row.first(), row.get(1))
            && let Ok(n) = n.parse::<i64>()
        {
            out.insert(k.clone(), json!(n));
        }
    }
    Some(Value::Object(out))
}

/// The run's headline over every scored answer of its primary scorer, as `aggregate`
/// defines the metric (the failure rate of pass/fail scorers, perturbed rows carrying an
/// INV/DIR comparison and base rows left out; the mean of numeric ones), with its 95%
/// interval clustered by template (`clustered_mean_ci`'s default method). Label scorers
/// have one rate per label: no single headline.
async fn overall_headline(r: &RunView) -> Option<Value> {
    use crate::stages::score::MetricKind;
    let primary = r.scorer(None).await.ok().flatten()?;
    let kind = crate::stages::score::metric_kind(&r.store, &primary)
        .await
        .ok()?;
    let base = if crate::stages::score::compares_to_base(&primary.name) {
        " AND role <> 'base'"
    } else {
        ""
    };
    let (metric, x, cond) = match kind {
        MetricKind::PassFail => (
            "failure_rate",
            "CASE WHEN passed THEN 0.0 ELSE 1.0 END",
            "passed IS NOT NULL",
        ),
        MetricKind::Numeric => ("mean_score", "score", "score IS NOT NULL"),
        MetricKind::Label => return None,
    };
    // Each template's moments, folded into per-size sums as they stream (the interval of
    // `clustered_mean_ci` from a `ClusterSummary`): the grouping holds the templates' sums,
    // in one partition, and may spill; the aggregate function held 1.25M templates' states
    // at 10M answers (550 MB).
    let sql = format!(
        "SELECT count(x), sum(x), var_pop(x) FROM (SELECT template_id, {x} AS x FROM scores \
         WHERE scorer = {} AND scoring_version = {} AND {cond}{base}) GROUP BY template_id",
        lit(&primary.name),
        lit(&primary.version)
    );
    let mut summary = crate::udaf::cluster_summary::ClusterSummary::default();
    let ctx = r.page_ctx().await.ok()?;
    crate::query::for_each_batch(ctx, &sql, |b| {
        use datafusion::arrow::array::AsArray;
        use datafusion::arrow::datatypes::{DataType, Float64Type};
        let col = |i: usize| datafusion::arrow::compute::cast(b.column(i), &DataType::Float64);
        let (n, sum, var) = match (col(0), col(1), col(2)) {
            (Ok(n), Ok(sum), Ok(var)) => (n, sum, var),
            _ => return Ok(()),
        };
        let (n, sum, var) = (
            n.as_primitive::<Float64Type>(),
            sum.as_primitive::<Float64Type>(),
            var.as_primitive::<Float64Type>(),
        );
        for i in 0..b.num_rows() {
            let k = n.value(i);
            if k > 0.0 {
                summary.add(&crate::udaf::common::Moments {
                    n: k as u64,
                    mean: sum.value(i) / k,
                    m2: var.value(i) * k,
                });
            }
        }
        Ok(())
    })
    .await
    .ok()?;
    let ci = crate::udaf::cluster_interval::summary_interval(&summary, &Default::default());
    let v = json!([{
        "n": ci.n, "n_templates": ci.n_clusters, "value": ci.mean, "ci_lo": ci.lo,
        "ci_hi": ci.hi, "ci_method": ci.method.name(),
    }]);
    let mut h = v.as_array()?.first()?.clone();
    h["metric"] = json!(metric);
    h["scorer"] = json!(primary.name);
    h["scoring_version"] = json!(primary.version);
    Some(h)
}
