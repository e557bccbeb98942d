//! The LLM-judge checklist scorer (CheckEval): the `[judge]` model answers d atomic
//! YES/NO questions about each valid answer, and the answers become `answers`
//! (list<bool>) with the fraction of YES as the score.
//!
//! The judge's requests go through the call stage itself: they form a nested run under
//! `<root>/judge/<version>/` (its `cases` are the judge prompts, keyed by the judged call),
//! so judging is resumable, cached and exactly-once like any call. An answer that does not
//! give exactly one YES or NO per question makes the row invalid (`judge_unparseable`),
//! never NO; a judge call that failed makes it `judge_error`.

use std::collections::HashMap;

use futures::StreamExt;
use sha2::{Digest, Sha256};

use super::{BaseAnswer, Outcome, ScoreInput, Scorer, ScorerId, source_logic};
use crate::pipeline::{JudgeChecklist, ModelConfig};
use crate::query::{QueryError, new_context, register_run};
use crate::schema::Table;
use crate::stages::call::{self, CallError};
use crate::stages::generate::{self, Case};
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
    replies: HashMap<String, Reply>,
}

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
    /// scorer holding the replies.
    pub async fn prepare(
        store: &RunStore,
        checklist: &JudgeChecklist,
        judge: &ModelConfig,
        provider: std::sync::Arc<dyn call::Provider>,
    ) -> Result<Self, CallError> {
        let version = version(checklist, judge);
        let sub = store.child(&format!("judge/{version}"));
        // The judge prompts become the nested run's cases (rebuilt each time: cheap, and
        // deterministic, so resumed judge calls keep their ids). No ORDER BY: a case's id is
        // its judged call's id whatever the order, and a global sort of the corpus was the
        // largest allocation of the judge (1.3 GiB at 2M answers).
        let ctx = new_context();
        register_run(&ctx, store, "").await.map_err(query_err)?;
        let df = ctx
            .sql(
                "SELECT k.call_id, c.input, k.response FROM calls k JOIN validity v ON k.call_id = v.call_id \
                 JOIN cases c ON k.case_id = c.case_id WHERE v.validity = 'valid_answer'",
            )
            .await
            .map_err(|e| query_err(QueryError::df("judge prompts")(e)))?;
        let mut s = df
            .execute_stream()
            .await
            .map_err(|e| query_err(QueryError::df("judge prompts")(e)))?;
        sub.delete_dir("cases").await?;
        let mut w = sub.part_writer("cases", Table::Cases.schema(), "part");
        while let Some(b) = s.next().await {
            let b = crate::schema::plain_strings(
                b.map_err(|e| query_err(QueryError::df("judge prompts")(e)))?,
            );
            let col = |n: &str| {
                b.column_by_name(n)
                    .unwrap()
                    .as_any()
                    .downcast_ref::<datafusion::arrow::array::StringArray>()
                    .unwrap()
                    .clone()
            };
            let (ids, inputs, responses) = (col("call_id"), col("input"), col("response"));
            let cases: Vec<Case> = (0..b.num_rows())
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
                .collect();
            w.write(generate::to_batch(&cases)).await?;
        }
        w.finish().await?;
        call::run(&sub, judge, provider).await?;
        // Read the judge's answers back: one per judged call (sample 0).
        let mut replies = HashMap::new();
        let mut calls = sub.read_table("calls", Table::Calls).await?;
        while let Some(b) = calls.next().await {
            let b = crate::schema::plain_strings(b?);
            let s = |n: &str| {
                b.column_by_name(n)
                    .unwrap()
                    .as_any()
                    .downcast_ref::<datafusion::arrow::array::StringArray>()
                    .unwrap()
                    .clone()
            };
            let (ids, resp, err) = (s("case_id"), s("response"), s("error"));
            use datafusion::arrow::array::Array;
            for i in 0..b.num_rows() {
                let r = if err.is_valid(i) {
                    Reply::Failed(err.value(i).to_string())
                } else if resp.is_valid(i) {
                    Reply::Text(resp.value(i).to_string())
                } else {
                    Reply::Failed("empty judge answer".into())
                };
                replies.insert(ids.value(i).to_string(), r);
            }
        }
        Ok(Self {
            checklist: checklist.clone(),
            version,
            replies,
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
            replies,
        }
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

    fn score(&self, row: &ScoreInput, _base: Option<&BaseAnswer>) -> Outcome {
        let ids: Vec<&str> = self
            .checklist
            .questions
            .iter()
            .map(|q| q.id.as_str())
            .collect();
        match self.replies.get(row.call_id) {
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
                crate::pipeline::JudgeQuestion {
                    id: "a".into(),
                    text: "A?".into(),
                },
                crate::pipeline::JudgeQuestion {
                    id: "b".into(),
                    text: "B?".into(),
                },
            ],
            instructions: None,
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
