//! The LLM-judge checklist scorer (CheckEval): the `[judge]` model answers d atomic
//! YES/NO questions about each valid answer, and the answers become `answers`
//! (list<bool>) with the fraction of YES as the score.
//!
//! The judge's requests go through the call stage itself: they form a nested run under
//! `<root>/judge/<version>/` (its `cases` are the judge prompts, keyed by the judged call),
//! so judging is resumable, cached and exactly-once like any call. An answer that does not
//! give exactly one YES or NO per question makes the row invalid (`judge_unparseable`),
//! never NO; a judge call that failed makes it `judge_error`.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use datafusion::arrow::array::{Array, BooleanArray, RecordBatch, StringArray};
use futures::StreamExt;
use sha2::{Digest, Sha256};

use super::{
    BaseAnswer, CaseParts, Outcome, ScoreInput, Scorer, ScorerId, part_stream, source_logic,
};
use crate::config::{JudgeChecklist, ModelConfig};
use crate::query::{QueryError, new_context};
use crate::schema::Table;
use crate::schema::{Case, cases_batch};
use crate::stages::call::{self, CallError};
use crate::storage::RunStore;

/// The judge's reply to one judged call.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Text(String),
    Failed(String),
}

/// The judge scorer, with the judge's replies fetched.
#[derive(Debug, Clone)]
pub struct JudgeScorer {
    checklist: JudgeChecklist,
    version: String,
    replies: Replies,
}

/// Where a judge scorer's replies are.
#[derive(Debug, Clone)]
enum Replies {
    /// In hand: one part's (see [`JudgeScorer::part_scorer`]), or a test's.
    InHand(HashMap<String, Reply>),
    /// In the nested run's `calls`, read part by part as the judged rows are scored: of
    /// each judged part, only the nested parts the index says may hold its replies.
    Nested(Arc<ReplyIndex>),
}

/// Which parts of the nested run's `calls` may hold the replies to each judged calls part
/// ([`reply_index`]).
#[derive(Debug, Default)]
struct ReplyIndex {
    /// By judged calls part (its file name): the nested calls parts' locations, in order.
    by_part: HashMap<String, Vec<String>>,
    /// The nested calls parts in all.
    nested: usize,
}

/// Nested cases parts' filters held at once while the index is built (at most 512 KiB
/// each: a part of 100k prompts at a false-positive rate of 1e-6).
const FILTERS_AT_ONCE: usize = 32;

/// The version: the scorer's logic version plus a hash of the questions and the judge model,
/// since either changes what the numbers mean.
pub fn version(checklist: &JudgeChecklist, judge: &ModelConfig) -> String {
    let mut h = Sha256::new();
    h.update(serde_json::to_string(checklist).unwrap_or_default());
    h.update([0]);
    h.update(format!(
        "{}|{}|{:?}",
        judge.provider, judge.name, judge.temperature
    ));
    format!("1+{}", &hex::encode(h.finalize())[..8])
}

/// The prompt sent to the judge for one answer.
pub fn prompt(checklist: &JudgeChecklist, input: &str, response: &str) -> String {
    let mut p = String::from(
        "You are evaluating a response against a checklist. Answer every question with YES or NO only, \
         one per line, in the form `Q1: YES`.\n",
    );
    if let Some(i) = &checklist.instructions {
        p.push_str(i);
        p.push('\n');
    }
    p.push_str(&format!(
        "\nInput:\n{input}\n\nResponse:\n{response}\n\nQuestions:\n"
    ));
    for (k, q) in checklist.questions.iter().enumerate() {
        p.push_str(&format!("Q{}: {}\n", k + 1, q.text));
    }
    p
}

/// Parses `Q<k>: YES|NO` lines into exactly `d` answers; any missing, extra or
/// contradictory answer is an error (the row becomes invalid, never NO).
pub fn parse(text: &str, d: usize) -> Result<Vec<bool>, String> {
    let mut got: Vec<Option<bool>> = vec![None; d];
    for line in text.lines() {
        let l = line.trim().trim_start_matches(['-', '*', ' ']).trim();
        let Some(rest) = l.strip_prefix('Q').or_else(|| l.strip_prefix('q')) else {
            continue;
        };
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let Ok(k) = digits.parse::<usize>() else {
            continue;
        };
        let tail = rest[digits.len()..]
            .trim_start_matches([':', '.', ')', ' ', '-', '*'])
            .trim();
        let word: String = tail
            .chars()
            .take_while(char::is_ascii_alphabetic)
            .collect::<String>()
            .to_uppercase();
        let v = match word.as_str() {
            "YES" => true,
            "NO" => false,
            _ => return Err(format!("Q{k}: `{tail}` is neither YES nor NO")),
        };
        if k == 0 || k > d {
            return Err(format!("Q{k} is not one of the {d} questions"));
        }
        match got[k - 1] {
            Some(prev) if prev != v => return Err(format!("Q{k} answered both YES and NO")),
            _ => got[k - 1] = Some(v),
        }
    }
    let missing: Vec<String> = got
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_none())
        .map(|(k, _)| format!("Q{}", k + 1))
        .collect();
    if !missing.is_empty() {
        return Err(format!("no answer for {}", missing.join(", ")));
    }
    Ok(got.into_iter().map(Option::unwrap).collect())
}

impl JudgeScorer {
    /// Judges every valid answer of the run (resuming a partial judge run) and returns the
    /// scorer, which reads the judge's replies part by part ([`Scorer::for_part`]).
    ///
    /// # Behavior
    /// The judge prompts become the nested run's cases (rebuilt each time: cheap, and
    /// deterministic, so resumed judge calls keep their ids). They are built per calls
    /// part, the way score joins a part ([`super::part_stream`]): the part, its validity
    /// part and only the parts of `cases` that may hold its cases, each written as one
    /// nested `cases` part named after the calls part. No query joins the whole tables and
    /// nothing sorts the corpus, so memory grows with a part (times `--threads`), never
    /// with the corpus.
    ///
    /// # Errors
    /// A query failure (a memory refusal is `QueryError::Memory`, named "judge prompts"),
    /// a storage failure, or the nested call stage's own errors.
    pub async fn prepare(
        store: &RunStore,
        checklist: &JudgeChecklist,
        judge: &ModelConfig,
        provider: std::sync::Arc<dyn call::Provider>,
    ) -> Result<Self, CallError> {
        let version = version(checklist, judge);
        let sub = store.child(&format!("judge/{version}"));
        sub.delete_dir("cases").await?;
        write_prompts(store, &sub, checklist)
            .await
            .map_err(|e| query_err(in_prompts(e)))?;
        call::run(&sub, judge, provider).await?;
        let index = reply_index(&sub).await.map_err(query_err)?;
        Ok(Self {
            checklist: checklist.clone(),
            version,
            replies: Replies::Nested(Arc::new(index)),
        })
    }

    /// A scorer over replies already in hand (for tests and re-parsing).
    pub fn with_replies(
        checklist: JudgeChecklist,
        version: String,
        replies: HashMap<String, Reply>,
    ) -> Self {
        Self {
            checklist,
            version,
            replies: Replies::InHand(replies),
        }
    }

    /// The scorer of one calls part of `run`: the judge's replies to that part's calls
    /// only, read from the nested run's `calls`; `None` when the replies are in hand
    /// already ([`JudgeScorer::with_replies`]).
    ///
    /// # Behavior
    /// The nested `calls` parts stream past a set of the part's call ids (a filter pushed
    /// into the Parquet scan, so a reply's text is decoded only when it is the part's), in
    /// part and row order: a judged call with two replies (K samples) keeps the last one,
    /// as the whole-table map did. Memory holds one part's ids and replies.
    pub async fn part_scorer(
        &self,
        run: &RunStore,
        part: &object_store::ObjectMeta,
    ) -> Result<Option<JudgeScorer>, QueryError> {
        let Replies::Nested(index) = &self.replies else {
            return Ok(None);
        };
        let replies = part_replies(run, index, part).await?;
        Ok(Some(Self {
            checklist: self.checklist.clone(),
            version: self.version.clone(),
            replies: Replies::InHand(replies),
        }))
    }
}

/// Writes the judge prompts of every valid answer of `store` as `sub`'s cases, one part
/// per calls part, `--threads` parts at once.
async fn write_prompts(
    store: &RunStore,
    sub: &RunStore,
    checklist: &JudgeChecklist,
) -> Result<(), QueryError> {
    let ctx = new_context();
    // As score: the join's dynamic filter is evaluated while `cases` is decoded.
    ctx.state_ref()
        .write()
        .config_mut()
        .options_mut()
        .execution
        .parquet
        .pushdown_filters = true;
    crate::query::register_tables(&ctx, store, "", &[Table::Cases]).await?;
    let case_parts = CaseParts::load(store).await?;
    let parts = store.list_parts("calls").await?;
    let (ctx, case_parts) = (&ctx, &case_parts);
    let mut written = futures::stream::iter(parts.into_iter().enumerate())
        .map(|(k, part)| async move {
            let name = part.location.filename().unwrap_or("part.parquet");
            let stem = name.strip_suffix(".parquet").unwrap_or(name).to_string();
            let mut s = part_stream(
                ctx,
                store,
                case_parts,
                &part,
                "WHERE v.validity = 'valid_answer'",
                k,
            )
            .await?;
            let mut w = sub.part_writer("cases", Table::Cases.schema(), &stem);
            while let Some(b) = s.next().await {
                let b = crate::schema::plain_strings(b.map_err(QueryError::df("judge prompts"))?);
                w.write(cases_batch(&prompt_cases(checklist, &b))).await?;
            }
            w.finish().await?;
            Ok::<_, QueryError>(())
        })
        .buffer_unordered(if crate::query::on_cluster() {
            1
        } else {
            crate::query::resources().threads.max(1)
        });
    while let Some(r) = written.next().await {
        r?;
    }
    Ok(())
}

/// The nested run's cases of one joined batch: a case per judged call, keyed by its
/// call id, whose input is the judge prompt.
fn prompt_cases(checklist: &JudgeChecklist, b: &RecordBatch) -> Vec<Case> {
    let col = |n: &str| {
        b.column_by_name(n)
            .and_then(|c| c.as_any().downcast_ref::<StringArray>())
            .unwrap_or_else(|| panic!("joined column `{n}` is Utf8"))
    };
    let (ids, inputs, responses) = (col("call_id"), col("input"), col("response"));
    (0..b.num_rows())
        .map(|i| Case {
            case_id: ids.value(i).to_string(),
            suite: "judge".into(),
            test: "judge".into(),
            capability: "judge".into(),
            test_type: "MFT".into(),
            template_id: "judge".into(),
            group_id: ids.value(i).to_string(),
            role: "single".into(),
            input: prompt(checklist, inputs.value(i), responses.value(i)),
            expected: None,
            expectation: None,
            tolerance: None,
            perturbation: None,
        })
        .collect()
}

/// Which nested `calls` parts may hold the replies to each judged calls part: the judge's
/// cases part `<judged part>-NNNNN` holds that part's prompts, keyed by the judged call ids,
/// with a bloom filter on `case_id`; a nested calls part may hold a judged part's replies
/// when one of its `case_id`s is in that filter. Each nested `case_id` is hashed once and
/// asked of every filter ([`crate::storage::Bloom::check_hash`]): reading the index costs
/// one decoding of the nested `case_id` column per [`FILTERS_AT_ONCE`] judged parts, where
/// reading every nested part for each judged part decoded it once per judged part.
///
/// The nested call stage sends the prompts in cases order and commits every few seconds,
/// so a nested part holds the replies of one or two judged parts (and the retries of a
/// later session, of a few).
async fn reply_index(sub: &RunStore) -> Result<ReplyIndex, QueryError> {
    use datafusion::arrow::array::AsArray;
    use datafusion::arrow::datatypes::DataType;
    let calls = sub.list_parts("calls").await?;
    let mut index = ReplyIndex {
        by_part: HashMap::new(),
        nested: calls.len(),
    };
    if calls.is_empty() {
        return Ok(index);
    }
    let cases = sub.list_parts("cases").await?;
    let threads = crate::query::resources().threads.max(1);
    for chunk in cases.chunks(FILTERS_AT_ONCE) {
        let mut filters = Vec::with_capacity(chunk.len());
        for m in chunk {
            let f = sub.footer(m).await?;
            filters.push((judged_part(m), sub.bloom_filters(&f, "case_id").await?));
        }
        let filters = Arc::new(filters);
        let mut hits = futures::stream::iter(calls.iter().cloned())
            .map(|m| {
                let (sub, filters) = (sub.clone(), filters.clone());
                tokio::spawn(async move {
                    let cols = sub.string_column(&m, "case_id").await?;
                    // Filters without a bloom filter (an older nested run) may hold anything.
                    let mut hit: Vec<bool> = filters.iter().map(|(_, f)| f.is_none()).collect();
                    let mut open = hit.iter().filter(|h| !**h).count();
                    for c in &cols {
                        let c = datafusion::arrow::compute::cast(c, &DataType::Utf8)
                            .map_err(|e| QueryError::df("judge reply index")(e.into()))?;
                        for v in c.as_string::<i32>().iter().flatten() {
                            if open == 0 {
                                break;
                            }
                            let h = crate::storage::bloom_hash(v.as_bytes());
                            for (k, (_, f)) in filters.iter().enumerate() {
                                if !hit[k]
                                    && f.as_ref()
                                        .is_some_and(|rgs| rgs.iter().any(|b| b.check_hash(h)))
                                {
                                    hit[k] = true;
                                    open -= 1;
                                }
                            }
                        }
                    }
                    Ok::<_, QueryError>((sub.location(&m.location), hit))
                })
            })
            .buffered(threads);
        while let Some(r) = hits.next().await {
            let (url, hit) = r.map_err(|e| {
                QueryError::df("judge reply index")(datafusion::error::DataFusionError::External(
                    Box::new(e),
                ))
            })??;
            for (k, (part, _)) in filters.iter().enumerate() {
                if hit[k] {
                    index
                        .by_part
                        .entry(part.clone())
                        .or_default()
                        .push(url.clone());
                }
            }
        }
    }
    for urls in index.by_part.values_mut() {
        // A judged part with several cases parts gathered its list chunk by chunk.
        urls.sort();
        urls.dedup();
    }
    Ok(index)
}

/// The judged calls part (file name) whose prompts a nested cases part holds: the writer
/// of [`write_prompts`] names them `<judged part stem>-NNNNN.parquet`.
fn judged_part(m: &object_store::ObjectMeta) -> String {
    let name = m.location.filename().unwrap_or_default();
    let stem = name.strip_suffix(".parquet").unwrap_or(name);
    match stem.rsplit_once('-') {
        Some((judged, seq)) if !seq.is_empty() && seq.bytes().all(|b| b.is_ascii_digit()) => {
            format!("{judged}.parquet")
        }
        _ => name.to_string(),
    }
}

/// The judge's replies to the calls of one part of `run`, from the parts of the nested
/// run's `calls` that `index` says may hold them.
async fn part_replies(
    run: &RunStore,
    index: &ReplyIndex,
    part: &object_store::ObjectMeta,
) -> Result<HashMap<String, Reply>, QueryError> {
    let err = || QueryError::df("judge replies");
    let mut replies = HashMap::new();
    let name = part.location.filename().unwrap_or_default();
    let urls = index.by_part.get(name).map(Vec::as_slice).unwrap_or(&[]);
    tracing::debug!(
        "judge: {} of {} reply parts read for {name}",
        urls.len(),
        index.nested
    );
    if urls.is_empty() {
        return Ok(replies);
    }
    // One partition: the nested parts are read in name order, rows in order.
    let ctx = crate::query::ordered_context();
    ctx.state_ref()
        .write()
        .config_mut()
        .options_mut()
        .execution
        .parquet
        .pushdown_filters = true;
    run.register_with(&ctx);
    crate::query::register_parquet(&ctx, "part", &run.location(&part.location)).await?;
    let ids: HashSet<String> = crate::query::text_rows(&ctx, "SELECT call_id FROM part")
        .await?
        .into_iter()
        .filter_map(|r| r.into_iter().next().flatten())
        .collect();
    if ids.is_empty() {
        return Ok(replies);
    }
    crate::query::register_parquet_paths(&ctx, "replies", urls).await?;
    ctx.register_udf(in_part_udf(Arc::new(ids)));
    let mut s = ctx
        .sql("SELECT case_id, response, error FROM replies WHERE judged_in_part(case_id)")
        .await
        .map_err(err())?
        .execute_stream()
        .await
        .map_err(err())?;
    while let Some(b) = s.next().await {
        let b = crate::schema::plain_strings(b.map_err(err())?);
        let col = |n: &str| {
            b.column_by_name(n)
                .and_then(|c| c.as_any().downcast_ref::<StringArray>())
                .unwrap_or_else(|| panic!("judge calls column `{n}` is Utf8"))
        };
        let (ids, resp, error) = (col("case_id"), col("response"), col("error"));
        for i in 0..b.num_rows() {
            let r = if error.is_valid(i) {
                Reply::Failed(error.value(i).to_string())
            } else if resp.is_valid(i) {
                Reply::Text(resp.value(i).to_string())
            } else {
                Reply::Failed("empty judge answer".into())
            };
            replies.insert(ids.value(i).to_string(), r);
        }
    }
    Ok(replies)
}

/// `judged_in_part(case_id)`: whether a judge call judged one of the part's calls.
fn in_part_udf(ids: Arc<HashSet<String>>) -> datafusion::logical_expr::ScalarUDF {
    use datafusion::arrow::array::AsArray;
    use datafusion::arrow::datatypes::DataType;
    use datafusion::logical_expr::{ColumnarValue, Volatility, create_udf};
    create_udf(
        "judged_in_part",
        vec![DataType::Utf8],
        DataType::Boolean,
        Volatility::Immutable,
        Arc::new(move |args: &[ColumnarValue]| {
            let args = ColumnarValue::values_to_arrays(args)?;
            let out: BooleanArray = args[0]
                .as_string::<i32>()
                .iter()
                .map(|v| Some(v.is_some_and(|v| ids.contains(v))))
                .collect();
            Ok(ColumnarValue::Array(Arc::new(out)))
        }),
    )
}

/// A failure while building the prompts names them (the first query of the judge, and
/// the one a memory limit refuses first).
fn in_prompts(e: QueryError) -> QueryError {
    match e {
        QueryError::Memory {
            context,
            limit,
            msg,
        } if !context.starts_with("judge prompts") => QueryError::Memory {
            context: format!("judge prompts: {context}"),
            limit,
            msg,
        },
        QueryError::DataFusion { context, source } if !context.starts_with("judge prompts") => {
            QueryError::DataFusion {
                context: format!("judge prompts: {context}"),
                source,
            }
        }
        other => other,
    }
}

/// A query failure stays a query failure (a memory refusal is `QueryError::Memory`, exit 2
/// naming the limit), never a provider that "cannot be built".
fn query_err(e: QueryError) -> CallError {
    match e {
        QueryError::Storage(s) => CallError::Storage(s),
        other => CallError::Query(other),
    }
}

impl Scorer for JudgeScorer {
    fn id(&self) -> ScorerId {
        ScorerId {
            name: "judge".into(),
            version: self.version.clone(),
        }
    }

    fn logic(&self) -> Vec<String> {
        vec![source_logic(include_str!("judge.rs"))]
    }

    fn for_part<'a>(
        &'a self,
        run: &'a RunStore,
        part: &'a object_store::ObjectMeta,
    ) -> super::PartScorer<'a> {
        Box::pin(async move {
            Ok(self
                .part_scorer(run, part)
                .await?
                .map(|s| Box::new(s) as Box<dyn Scorer>))
        })
    }

    fn score(&self, row: &ScoreInput, _base: Option<&BaseAnswer>) -> Outcome {
        let ids: Vec<&str> = self
            .checklist
            .questions
            .iter()
            .map(|q| q.id.as_str())
            .collect();
        let replies = match &self.replies {
            Replies::InHand(r) => r,
            Replies::Nested(_) => {
                // The driver scores a part with its part scorer (`Scorer::for_part`).
                return Outcome {
                    invalid: Some("judge_error"),
                    detail: serde_json::json!({ "judge": "the judge's replies were not read for this part" }),
                    ..Outcome::default()
                };
            }
        };
        match replies.get(row.call_id) {
            None => Outcome {
                invalid: Some("judge_error"),
                detail: serde_json::json!({ "judge": "no judge call for this row" }),
                ..Outcome::default()
            },
            Some(Reply::Failed(e)) => Outcome {
                invalid: Some("judge_error"),
                detail: serde_json::json!({ "judge": e }),
                ..Outcome::default()
            },
            Some(Reply::Text(t)) => match parse(t, ids.len()) {
                Ok(answers) => {
                    let yes = answers.iter().filter(|a| **a).count();
                    Outcome {
                        score: Some(yes as f64 / answers.len().max(1) as f64),
                        label: Some(format!("{yes}/{}", answers.len())),
                        detail: serde_json::json!({ "questions": ids }),
                        answers: Some(answers),
                        ..Outcome::default()
                    }
                }
                Err(e) => Outcome {
                    invalid: Some("judge_unparseable"),
                    detail: serde_json::json!({ "judge_unparseable": e, "questions": ids }),
                    ..Outcome::default()
                },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_exactly_one_answer_per_question() {
        assert_eq!(
            parse("Q1: YES\nQ2: no\n- Q3) Yes.", 3).unwrap(),
            vec![true, false, true]
        );
        assert!(parse("Q1: YES\nQ2: NO", 3).unwrap_err().contains("Q3"));
        assert!(
            parse("Q1: YES\nQ1: NO\nQ2: NO", 2)
                .unwrap_err()
                .contains("both")
        );
        assert!(
            parse("Q1: maybe\nQ2: NO", 2)
                .unwrap_err()
                .contains("neither")
        );
        assert!(parse("Sure! Everything looks great.", 2).is_err());
        assert!(
            parse("Q1: YES\nQ2: NO\nQ5: YES", 2)
                .unwrap_err()
                .contains("Q5")
        );
    }

    #[test]
    fn unparseable_is_invalid_never_no() {
        let cl = JudgeChecklist {
            questions: vec![
                crate::config::JudgeQuestion {
                    id: "a".into(),
                    text: "A?".into(),
                },
                crate::config::JudgeQuestion {
                    id: "b".into(),
                    text: "B?".into(),
                },
            ],
            instructions: None,
            version: None,
        };
        let replies = HashMap::from([
            ("ok".to_string(), Reply::Text("Q1: YES\nQ2: NO".into())),
            ("bad".to_string(), Reply::Text("I think so".into())),
            ("err".to_string(), Reply::Failed("HTTP 500".into())),
        ]);
        let s = JudgeScorer::with_replies(cl, "1+test".into(), replies);
        let row = |id| ScoreInput {
            call_id: id,
            input: "",
            response: "",
            response_score: None,
            language: "en",
            test_type: "MFT",
            role: "single",
            expected: None,
            expectation: None,
            tolerance: None,
        };
        let ok = s.score(&row("ok"), None);
        assert_eq!(ok.score, Some(0.5));
        assert_eq!(ok.answers, Some(vec![true, false]));
        let bad = s.score(&row("bad"), None);
        assert_eq!(bad.invalid, Some("judge_unparseable"));
        assert_eq!(bad.score, None);
        assert_eq!(s.score(&row("err"), None).invalid, Some("judge_error"));
    }
}
