//! The score stage's driver: each calls part joined with its validity part and the cases parts
//! its bloom filters point to, scored on rayon, and written as the scores part of the same name.

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, BooleanBuilder, Float64Array, Int32Array, ListBuilder,
    RecordBatch, StringArray,
};
use futures::{StreamExt, TryStreamExt};

use crate::query::{QueryError, new_context, register_run};
use crate::schema::Table;
use crate::storage::{PipelinedEncoder, RunStore, StorageError};
use checklist::{Answer, normalise_label};

use super::*;

/// The columns of the joined row every scorer sees (and a SQL scorer's expressions name):
/// `(table alias, column)`, the alias `k` for calls, `v` for validity, `c` for cases.
pub(super) const JOINED: &[(&str, &str)] = &[
    ("k", "call_id"),
    ("k", "case_id"),
    ("k", "model"),
    ("k", "sample_idx"),
    ("k", "response"),
    ("k", "response_score"),
    ("k", "response_hash"),
    ("k", "finish_reason"),
    ("k", "prompt_tokens"),
    ("k", "completion_tokens"),
    ("k", "reasoning_tokens"),
    ("k", "latency_ms"),
    ("v", "validity"),
    ("v", "language"),
    ("v", "answer_chars"),
    ("c", "suite"),
    ("c", "input"),
    ("c", "test"),
    ("c", "capability"),
    ("c", "test_type"),
    ("c", "role"),
    ("c", "template_id"),
    ("c", "group_id"),
    ("c", "expected"),
    ("c", "expectation"),
    ("c", "tolerance"),
];

pub(super) fn join_sql() -> String {
    let cols: Vec<String> = JOINED.iter().map(|(t, c)| format!("{t}.{c}")).collect();
    format!(
        "SELECT {} FROM calls k JOIN validity v ON k.call_id = v.call_id JOIN cases c ON k.case_id = c.case_id",
        cols.join(", ")
    )
}

/// The schema of the joined rows (strings as plain Utf8, every column nullable), from the
/// declared table schemas: what a SQL scorer is compiled against before any row is read.
pub fn joined_schema() -> datafusion::arrow::datatypes::SchemaRef {
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    let fields: Vec<Field> = JOINED
        .iter()
        .map(|(t, c)| {
            let table = match *t {
                "k" => Table::Calls,
                "v" => Table::Validity,
                _ => Table::Cases,
            };
            let schema = table.schema();
            let dt = schema
                .field_with_name(c)
                .map(|f| f.data_type().clone())
                .unwrap_or_else(|_| panic!("schemas/{}.json declares `{c}`", table.name()));
            let dt = match dt {
                DataType::Utf8View | DataType::LargeUtf8 => DataType::Utf8,
                other => other,
            };
            Field::new(*c, dt, true)
        })
        .collect();
    Arc::new(Schema::new(fields))
}

/// A scorer's result on one joined row: its outcome, and the validity the row ends with
/// when the scorer found a valid answer unscorable after all (`None`: the call's own).
#[derive(Debug, Clone, Default)]
pub(super) struct Scored {
    pub(super) invalid: Option<&'static str>,
    pub(super) out: Outcome,
}

/// Typed access to a joined batch (string columns already cast to plain Utf8).
pub(super) struct Cols<'a> {
    pub(super) b: &'a RecordBatch,
}

impl<'a> Cols<'a> {
    fn col<T: 'static>(&self, name: &str) -> &'a T {
        self.b
            .column_by_name(name)
            .and_then(|c| c.as_any().downcast_ref::<T>())
            .unwrap_or_else(|| panic!("joined column `{name}` has its declared type"))
    }
    fn s(&self, name: &str, i: usize) -> Option<&'a str> {
        let a = self.col::<StringArray>(name);
        a.is_valid(i).then(|| a.value(i))
    }
    fn f(&self, name: &str, i: usize) -> Option<f64> {
        let a = self.col::<Float64Array>(name);
        a.is_valid(i).then(|| a.value(i))
    }
    fn i(&self, name: &str, i: usize) -> Option<i32> {
        let a = self.col::<Int32Array>(name);
        a.is_valid(i).then(|| a.value(i))
    }
}

pub(super) type BaseKey = (String, String, i32);

pub(super) async fn stream(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
) -> Result<datafusion::physical_plan::SendableRecordBatchStream, QueryError> {
    ctx.sql(sql)
        .await
        .map_err(QueryError::df("score: joining calls, validity and cases"))?
        .execute_stream()
        .await
        .map_err(QueryError::df("score: joining calls, validity and cases"))
}

/// Scores every call of the run with `scorer`, replacing `scores/<name>@<version>/`
/// (score pays for no model call, so an interrupted attempt is simply redone). Returns
/// rows written.
pub async fn run(store: &RunStore, scorer: &dyn Scorer) -> Result<u64, QueryError> {
    // Each part's join probes the parts of `cases` that may hold its cases (`CaseParts`),
    // and the join's dynamic filter is evaluated while Parquet is decoded, so a case the
    // part does not name costs its `case_id` only, not its input text.
    let ctx = crate::query::with_pushdown(new_context());
    // Calls and validity are read part by part (each checked as it is read): of the run's
    // tables only `cases` is queried whole.
    crate::query::register_tables(&ctx, store, "", &[Table::Cases]).await?;
    let bases = if scorer.compares_to_base() {
        load_bases(&ctx, store, scorer).await?
    } else {
        HashMap::new()
    };
    let id = scorer.id();
    store.delete_dir(&id.dir()).await?;
    let written = write_scores(store, scorer, &ctx, &bases, &id).await;
    if written.is_err() {
        // Half a version is no version: the folder goes (a scorer's failure, a full disk),
        // and the next attempt starts from nothing, as it would anyway.
        let _ = store.delete_scratch(&id.dir()).await;
    }
    written
}

/// Writes `scores/<id>/` part by part; see [`run`].
pub(super) async fn write_scores(
    store: &RunStore,
    scorer: &dyn Scorer,
    ctx: &datafusion::prelude::SessionContext,
    bases: &HashMap<BaseKey, BaseAnswer>,
    id: &ScorerId,
) -> Result<u64, QueryError> {
    if let Some(def) = scorer.definition() {
        // Written before the parts: scores are never found without their definition.
        let text = serde_json::to_vec_pretty(&def).unwrap_or_default();
        store
            .put(&format!("{}/{DEFINITION_FILE}", id.dir()), text)
            .await?;
    }
    let case_parts = CaseParts::load(store).await?;
    let parts = store.list_parts("calls").await?;
    let progress =
        crate::progress::Progress::new(&format!("score {}", id.tag()), parts.len() as u64, "parts");
    // Each calls part is joined, scored and encoded as it streams, into the scores part of
    // the same name (as validate writes validity): memory is `--threads` parts' joins and
    // their encoders, with no part's rows waiting for an earlier part to be written. The
    // table is the same whatever the thread count.
    let (progress, case_parts) = (&progress, &case_parts);
    let mut scored = futures::stream::iter(parts.into_iter().enumerate())
        .map(|(k, part)| async move {
            let name = part
                .location
                .filename()
                .unwrap_or("part.parquet")
                .to_string();
            // DESIGN.md names every part `part-*.parquet`, whatever a calls part is called.
            let target = match name.starts_with("part-") {
                true => format!("{}/{name}", id.dir()),
                false => format!("{}/part-{name}", id.dir()),
            };
            let encode_err = |source| StorageError::Parquet {
                location: target.clone(),
                source,
            };
            let mut part_out =
                PipelinedEncoder::new(&Table::Scores.schema(), store.part_file(&target)?)
                    .map_err(encode_err)?;
            // A judge's replies to this part's calls, read for this part only.
            let own = scorer.for_part(store, &part).await?;
            let scorer = own.as_deref().unwrap_or(scorer);
            let mut s = part_stream(ctx, store, case_parts, &part, "", k).await?;
            while let Some(b) = s.next().await {
                let b = crate::schema::plain_strings(
                    b.map_err(QueryError::df("score: reading joined rows"))?,
                );
                // Scoring is CPU work on rayon: let tokio move its other tasks away.
                let out = cpu_work(|| score_parallel(&b, scorer, bases, id))?;
                part_out.write(out).await.map_err(encode_err)?;
            }
            let (rows, part) = part_out.finish().await.map_err(encode_err)?;
            let rows = rows as u64;
            // A part with no rows is not committed (and leaves no file).
            if rows > 0 {
                part.commit().await?;
            }
            progress.inc(1, rows);
            Ok::<_, QueryError>(rows)
        })
        .buffer_unordered(if crate::query::on_cluster() {
            // One job at a time on a cluster: its executors split the part already.
            1
        } else {
            crate::query::resources().threads.max(1)
        });
    let mut rows = 0u64;
    while let Some(r) = scored.next().await {
        // An error stops the stage: parts already put are whole, and the next attempt
        // replaces the folder.
        rows += r?;
    }
    progress.finish();
    Ok(rows)
}

/// Runs CPU-bound work from async code: on a multi-threaded runtime tokio first moves this
/// worker's other tasks away (so the plans' own tasks keep running); a current-thread
/// runtime (a unit test) just runs it.
pub(super) fn cpu_work<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Scores one joined batch on every core: slices of the batch go to rayon's pool (sized by
/// `--threads`), each scored and turned into a scores batch, in the batch's row order.
pub(super) fn score_parallel(
    b: &RecordBatch,
    scorer: &dyn Scorer,
    bases: &HashMap<BaseKey, BaseAnswer>,
    id: &ScorerId,
) -> Result<Vec<RecordBatch>, QueryError> {
    use rayon::prelude::*;
    const SLICE: usize = 1024;
    let n = b.num_rows();
    (0..n.div_ceil(SLICE))
        .into_par_iter()
        .map(|k| {
            let part = b.slice(k * SLICE, SLICE.min(n - k * SLICE));
            Ok(to_batch(id, &part, &score_batch(&part, scorer, bases)?))
        })
        .collect()
}

/// The parts of `cases` with their footers, read once per stage.
///
/// A calls part's join reads only the parts of `cases` whose bloom filters on `case_id`
/// (written by `storage::parquet_props`) may hold one of the part's case ids. Import writes
/// `cases` in corpus order and the calls of a case sit together, so an imported calls part
/// of 100k rows finds its 13k cases in one or two parts of `cases` (and joins two to four of
/// the 17 at 10M calls, with the filters' false positives): the run's calls parts together
/// read `cases` about once, rather than each all of it (O(parts x cases)).
pub(super) struct CaseParts(Vec<crate::storage::PartFooter>);

impl CaseParts {
    pub(super) async fn load(store: &RunStore) -> Result<Self, QueryError> {
        let parts = store.list_parts("cases").await?;
        let footers = futures::future::try_join_all(parts.iter().map(|p| store.footer(p)));
        Ok(CaseParts(footers.await?))
    }

    /// The locations of the parts that may hold one of `ids`.
    pub(super) async fn holding(
        &self,
        store: &RunStore,
        ids: &[&str],
    ) -> Result<Vec<String>, QueryError> {
        // Each answer is a small read (a filter per row group): several at once.
        let held: Vec<bool> = futures::stream::iter(&self.0)
            .map(|part| store.may_hold(part, "case_id", ids))
            .buffered(8)
            .try_collect()
            .await?;
        Ok((self.0.iter().zip(held))
            .filter(|(_, held)| *held)
            .map(|(part, _)| store.location(&part.meta().location))
            .collect())
    }
}

/// The joined rows of one calls part: the part and the validity part of the same name
/// (validate writes them 1:1) are registered as Parquet tables and joined with the parts of
/// `cases` that may hold the part's cases ([`CaseParts`]), so the join builds its hash table
/// on one part and streams those cases past it. Memory grows with a part, never with the
/// corpus. `filter` is appended to the query.
///
/// The parts are read by the plan itself, not first into in-memory tables: the join's build
/// side would hold a second copy of the part (10M calls: 355 MB against 373 MB, in 14.3 s
/// against 16.8 s), and a cluster's executors read them the same way.
pub(super) async fn part_stream(
    ctx: &datafusion::prelude::SessionContext,
    store: &RunStore,
    case_parts: &CaseParts,
    part: &object_store::ObjectMeta,
    filter: &str,
    k: usize,
) -> Result<datafusion::physical_plan::SendableRecordBatchStream, QueryError> {
    let name = part.location.filename().unwrap_or_default().to_string();
    let vrel = format!("validity/{name}");
    let vmeta = store.head(&vrel).await?.ok_or_else(|| {
        QueryError::Storage(crate::storage::StorageError::MissingTable {
            root: store.display().to_string(),
            table: vrel.clone(),
            stage: "validate".into(),
        })
    })?;
    let (calls, validity, cases) = (
        format!("part_calls_{k}"),
        format!("part_validity_{k}"),
        format!("part_cases_{k}"),
    );
    for (table, meta, t) in [
        (calls.as_str(), part, Table::Calls),
        (validity.as_str(), &vmeta, Table::Validity),
    ] {
        store.check_part(meta, t).await?;
        ctx.deregister_table(table)
            .map_err(QueryError::df("score"))?;
        crate::query::register_parquet(ctx, table, &store.location(&meta.location)).await?;
    }
    let ids =
        crate::query::text_rows(ctx, &format!("SELECT DISTINCT case_id FROM {calls}")).await?;
    let ids: Vec<&str> = ids.iter().filter_map(|r| r[0].as_deref()).collect();
    let case_urls = case_parts.holding(store, &ids).await?;
    tracing::debug!(part = %name, cases = ids.len(), parts = case_urls.len(), of = case_parts.0.len(), "score: parts of cases joined");
    ctx.deregister_table(cases.as_str())
        .map_err(QueryError::df("score"))?;
    let cases = if case_urls.is_empty() {
        // No part may hold them (or `cases` has none): the caller's whole `cases`, whose
        // join finds no case either.
        "cases".to_string()
    } else {
        crate::query::register_parquet_paths(ctx, &cases, &case_urls).await?;
        cases
    };
    let sql = join_sql()
        .replace(
            "FROM calls k JOIN validity v",
            &format!("FROM {calls} k JOIN {validity} v"),
        )
        .replace("JOIN cases c", &format!("JOIN {cases} c"));
    let s = stream(ctx, &format!("{sql} {filter}")).await;
    if !crate::query::on_cluster() {
        // The plan holds the part's files; the names are free for the next part. (A
        // cluster job resolves its tables when first polled: they stay registered.)
        for table in [&calls, &validity, &cases] {
            if table == "cases" {
                continue;
            }
            ctx.deregister_table(table.as_str())
                .map_err(QueryError::df("score"))?;
        }
    }
    s
}

/// Scores the joined rows of the given call ids in memory (used by the holdout gate).
pub async fn score_calls(
    store: &RunStore,
    scorer: &dyn Scorer,
    call_ids: &[String],
) -> Result<HashMap<String, (String, Outcome)>, QueryError> {
    let ctx = new_context();
    register_run(&ctx, store, "").await?;
    let bases = if scorer.compares_to_base() {
        load_bases(&ctx, store, scorer).await?
    } else {
        HashMap::new()
    };
    let wanted: std::collections::HashSet<&str> = call_ids.iter().map(String::as_str).collect();
    let mut out = HashMap::new();
    let case_parts = CaseParts::load(store).await?;
    for part in store.list_parts("calls").await? {
        let own = scorer.for_part(store, &part).await?;
        let scorer = own.as_deref().unwrap_or(scorer);
        let mut s = part_stream(&ctx, store, &case_parts, &part, "", 0).await?;
        while let Some(b) = s.next().await {
            let b = crate::schema::plain_strings(
                b.map_err(QueryError::df("score: reading joined rows"))?,
            );
            let c = Cols { b: &b };
            for (i, r) in score_batch(&b, scorer, &bases)?.into_iter().enumerate() {
                let call_id = c.s("call_id", i).unwrap_or_default();
                if wanted.contains(call_id) {
                    let validity = r
                        .invalid
                        .map(String::from)
                        .unwrap_or_else(|| c.s("validity", i).unwrap_or_default().to_string());
                    out.insert(call_id.to_string(), (validity, r.out));
                }
            }
        }
    }
    Ok(out)
}

/// Base answers by (group, model, sample) of the groups that have a perturbed case: memory
/// grows with perturbation groups, never with rows (a run of base cases only, such as an
/// imported corpus, loads nothing).
pub(super) async fn load_bases(
    ctx: &datafusion::prelude::SessionContext,
    store: &RunStore,
    scorer: &dyn Scorer,
) -> Result<HashMap<BaseKey, BaseAnswer>, QueryError> {
    let mut bases = HashMap::new();
    let perturbed = ctx
        .sql("SELECT 1 FROM cases WHERE role = 'perturbed' LIMIT 1")
        .await
        .map_err(QueryError::df("score: looking for perturbed cases"))?
        .count()
        .await
        .map_err(QueryError::df("score: looking for perturbed cases"))?;
    if perturbed == 0 {
        return Ok(bases);
    }
    // Ballista's executors cannot run the subquery (the job never finishes): on a cluster
    // every base row is loaded, as before.
    let only = if crate::query::on_cluster() {
        "WHERE c.role = 'base'"
    } else {
        "WHERE c.role = 'base' AND c.group_id IN \
         (SELECT group_id FROM cases WHERE role = 'perturbed')"
    };
    let case_parts = CaseParts::load(store).await?;
    for part in store.list_parts("calls").await? {
        let mut s = part_stream(ctx, store, &case_parts, &part, only, 0).await?;
        while let Some(b) = s.next().await {
            let b = crate::schema::plain_strings(
                b.map_err(QueryError::df("score: reading base cases"))?,
            );
            let c = Cols { b: &b };
            for i in 0..b.num_rows() {
                let key = (
                    c.s("group_id", i).unwrap_or_default().to_string(),
                    c.s("model", i).unwrap_or_default().to_string(),
                    c.i("sample_idx", i).unwrap_or(0),
                );
                let validity = c.s("validity", i).unwrap_or_default();
                let v = if validity == "valid_answer" && !readable(scorer, c.s("language", i)) {
                    // A base the scorer cannot read is no base to compare with.
                    Err("unscorable_language".to_string())
                } else if validity == "valid_answer" {
                    Ok(Answer {
                        label: normalise_label(c.s("response", i).unwrap_or_default()),
                        score: c.f("response_score", i),
                    })
                } else {
                    Err(validity.to_string())
                };
                bases.insert(key, v);
            }
        }
    }
    Ok(bases)
}

/// The outcomes of a scorer that scores whole batches ([`Scorer::score_valid`]), for the
/// valid rows of `b` in order; `None` for a row-by-row scorer.
pub(super) fn batch_outcomes(
    b: &RecordBatch,
    scorer: &dyn Scorer,
) -> Result<Option<std::vec::IntoIter<Outcome>>, QueryError> {
    if !scorer.scores_batches() {
        return Ok(None);
    }
    let validity = b
        .column_by_name("validity")
        .and_then(|c| c.as_any().downcast_ref::<StringArray>())
        .expect("joined column `validity` is Utf8");
    let language = b
        .column_by_name("language")
        .and_then(|c| c.as_any().downcast_ref::<StringArray>())
        .expect("joined column `language` is Utf8");
    let valid: BooleanArray = validity
        .iter()
        .zip(language.iter())
        .map(|(v, l)| Some(v == Some("valid_answer") && readable(scorer, l)))
        .collect();
    match scorer.score_valid(b, &valid) {
        None => Ok(None),
        Some(Ok(v)) => Ok(Some(v.into_iter())),
        Some(Err(msg)) => Err(QueryError::DataFusion {
            context: format!("scorer {}", scorer.id().tag()),
            source: datafusion::error::DataFusionError::External(Box::new(
                sql_check::ScorerFailed::new(scorer.id(), msg),
            )),
        }),
    }
}

pub(super) fn score_batch(
    b: &RecordBatch,
    scorer: &dyn Scorer,
    bases: &HashMap<BaseKey, BaseAnswer>,
) -> Result<Vec<Scored>, QueryError> {
    let c = Cols { b };
    let mut batch = batch_outcomes(b, scorer)?;
    // Columns are looked up once per batch: by name per row, the lookups were a fifth of
    // the stage's CPU.
    let text = |name| c.col::<StringArray>(name);
    let (validity, test_type, role, call_id, input, response, language) = (
        text("validity"),
        text("test_type"),
        text("role"),
        text("call_id"),
        text("input"),
        text("response"),
        text("language"),
    );
    let (expected, expectation, group_id, model) = (
        text("expected"),
        text("expectation"),
        text("group_id"),
        text("model"),
    );
    let (response_score, tolerance) = (
        c.col::<Float64Array>("response_score"),
        c.col::<Float64Array>("tolerance"),
    );
    let sample_idx = c.col::<Int32Array>("sample_idx");
    fn get(a: &StringArray, i: usize) -> Option<&str> {
        a.is_valid(i).then(|| a.value(i))
    }
    fn num(a: &Float64Array, i: usize) -> Option<f64> {
        a.is_valid(i).then(|| a.value(i))
    }
    Ok((0..b.num_rows())
        .map(|i| {
            if get(validity, i) != Some("valid_answer") {
                // Never scored: the validity and its reason are the whole story (the
                // detail says so, written by `to_batch`).
                return Scored::default();
            }
            if !readable(scorer, get(language, i)) {
                return unreadable(scorer, get(language, i));
            }
            let test_type = get(test_type, i).unwrap_or_default();
            let role = get(role, i).unwrap_or_default();
            let input = ScoreInput {
                call_id: get(call_id, i).unwrap_or_default(),
                input: get(input, i).unwrap_or_default(),
                response: get(response, i).unwrap_or_default(),
                response_score: num(response_score, i),
                language: get(language, i).unwrap_or_default(),
                test_type,
                role,
                expected: get(expected, i),
                expectation: get(expectation, i),
                tolerance: num(tolerance, i),
            };
            let base = (scorer.compares_to_base() && role == "perturbed").then(|| {
                let key = (
                    get(group_id, i).unwrap_or_default().to_string(),
                    get(model, i).unwrap_or_default().to_string(),
                    if sample_idx.is_valid(i) {
                        sample_idx.value(i)
                    } else {
                        0
                    },
                );
                bases
                    .get(&key)
                    .cloned()
                    .unwrap_or_else(|| Err("missing (the base case has no call)".into()))
            });
            let mut out = match batch.as_mut().and_then(Iterator::next) {
                Some(o) => o,
                None => scorer.score(&input, base.as_ref()),
            };
            if out.invalid.is_some() {
                out.score = None;
                out.passed = None;
            }
            Scored {
                invalid: out.invalid,
                out,
            }
        })
        .collect())
}

/// A valid answer in a language `scorer` does not read: `unscorable_language` for this
/// scorer, with the languages it reads.
pub(super) fn unreadable(scorer: &dyn Scorer, language: Option<&str>) -> Scored {
    let reads = scorer.languages().unwrap_or_default().join(", ");
    Scored {
        invalid: Some("unscorable_language"),
        out: Outcome {
            detail: serde_json::json!({
                "unscored": "unscorable_language",
                "reason": format!(
                    "{} reads {reads}; the answer is `{}`",
                    scorer.id().name,
                    language.unwrap_or("und")
                ),
            }),
            invalid: Some("unscorable_language"),
            ..Outcome::default()
        },
    }
}

/// The scores rows of a joined batch: the call's identity and its case's fields are the
/// joined columns themselves (no copy per row); only the scorer's outputs are built.
pub(super) fn to_batch(id: &ScorerId, b: &RecordBatch, rows: &[Scored]) -> RecordBatch {
    let c = Cols { b };
    let n = rows.len();
    let pass = |name: &str| -> ArrayRef {
        let a = b
            .column_by_name(name)
            .unwrap_or_else(|| panic!("joined column `{name}`"));
        if a.null_count() == 0 {
            return a.clone();
        }
        // The run tables declare these columns non-null; a hand-made table may not hold to
        // that, and scores keeps its own declaration.
        match a.as_any().downcast_ref::<StringArray>() {
            Some(s) => Arc::new(StringArray::from_iter_values(
                s.iter().map(|v| v.unwrap_or_default()),
            )),
            None => Arc::new(Int32Array::from_iter_values(
                c.col::<Int32Array>(name).iter().map(|v| v.unwrap_or(0)),
            )),
        }
    };
    let given = c.col::<StringArray>("validity");
    let given = |i: usize| given.is_valid(i).then(|| given.value(i));
    let validity: Vec<&str> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| r.invalid.unwrap_or_else(|| given(i).unwrap_or_default()))
        .collect();
    let mut answers = ListBuilder::new(BooleanBuilder::new());
    for r in rows {
        match &r.out.answers {
            Some(a) => {
                for x in a {
                    answers.values().append_value(*x);
                }
                answers.append(true);
            }
            None => answers.append(false),
        }
    }
    let details: StringArray = rows
        .iter()
        .zip(&validity)
        .enumerate()
        .map(|(i, (r, v))| {
            if given(i) != Some("valid_answer") {
                Some(format!("{{\"unscored\":{}}}", serde_json::Value::from(*v)))
            } else {
                (!r.out.detail.is_null()).then(|| r.out.detail.to_string())
            }
        })
        .collect();
    let cols: Vec<ArrayRef> = vec![
        pass("call_id"),
        pass("case_id"),
        pass("model"),
        pass("sample_idx"),
        Arc::new(StringArray::from_iter_values(std::iter::repeat_n(
            id.name.as_str(),
            n,
        ))),
        Arc::new(StringArray::from_iter_values(std::iter::repeat_n(
            id.version.as_str(),
            n,
        ))),
        b.column_by_name("response_hash")
            .expect("joined column `response_hash`")
            .clone(),
        Arc::new(StringArray::from_iter_values(validity.iter().copied())),
        Arc::new(rows.iter().map(|r| r.out.score).collect::<Float64Array>()),
        Arc::new(
            rows.iter()
                .map(|r| r.out.label.as_deref())
                .collect::<StringArray>(),
        ),
        Arc::new(rows.iter().map(|r| r.out.prob).collect::<Float64Array>()),
        Arc::new(rows.iter().map(|r| r.out.passed).collect::<BooleanArray>()),
        Arc::new(details),
        Arc::new(answers.finish()),
        pass("test"),
        pass("capability"),
        pass("test_type"),
        pass("role"),
        pass("template_id"),
    ];
    RecordBatch::try_new(Table::Scores.schema(), cols)
        .expect("scores batch matches schemas/scores.json")
}
