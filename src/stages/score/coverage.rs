//! Whether the checklist's exact label match could have matched at all.
//!
//! The checklist compares an MFT answer, normalised, with the case's expected label. On an
//! imported corpus whose answers are free text ("The answer is B, because ...") and whose
//! `expected` is a label ("B"), that match never succeeds: the run reports a 100.0% failure
//! rate with a zero-width interval, which reads as a finding about the model when it is a
//! mismatch of scorer and data. After scoring, the valid MFT answers are counted by whether
//! they contain none of their expected labels, contain one inside longer text, or are one;
//! a near-total failure gets a warning with those shares and the scorer to use instead.

use futures::StreamExt;

use super::ScorerId;
use super::checklist::normalise_label;
use crate::query::{QueryError, register_run};
use crate::storage::RunStore;

/// The failure rate over valid MFT answers from which [`LabelCoverage::warning`] speaks:
/// below it, failures are the model's to explain.
pub const WARN_FAILURE_RATE: f64 = 0.95;

/// The valid MFT answers a pass/fail scorer version judged, by how they relate to their
/// expected labels (`a|b`: any alternative).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LabelCoverage {
    /// Valid answers with an expected label that the version judged.
    pub judged: u64,
    /// Of those, the failed ones.
    pub failed: u64,
    /// Answers that contain none of their expected labels (case-insensitive).
    pub none: u64,
    /// Answers that contain an expected label inside longer text (but are not one).
    pub inside: u64,
    /// Valid answers the version left unscored: their case has no expected answer.
    pub no_expected: u64,
}

impl LabelCoverage {
    /// Counts one answer against its expected labels.
    pub fn add(&mut self, response: &str, expected: &str, passed: bool) {
        self.judged += 1;
        self.failed += u64::from(!passed);
        let answer = normalise_label(response);
        let labels: Vec<String> = expected
            .split('|')
            .map(normalise_label)
            .filter(|l| !l.is_empty())
            .collect();
        if labels.contains(&answer) {
            return;
        }
        let words = tokens(&answer);
        let inside = labels.iter().any(|l| {
            let l = tokens(l);
            !l.is_empty() && words.windows(l.len()).any(|w| w == l.as_slice())
        });
        if inside {
            self.inside += 1;
        } else {
            self.none += 1;
        }
    }

    /// The warnings for a version: answers left unscored for want of an expected answer,
    /// and a version that failed (nearly) every judged answer; `None` when neither.
    pub fn warning(&self, id: &ScorerId) -> Option<String> {
        let lines: Vec<String> = [self.unscored_warning(id), self.failure_warning(id)]
            .into_iter()
            .flatten()
            .collect();
        (!lines.is_empty()).then(|| lines.join("\n"))
    }

    fn unscored_warning(&self, id: &ScorerId) -> Option<String> {
        if self.no_expected == 0 {
            return None;
        }
        Some(format!(
            "warning: {} left {} of {} valid answers unscored: their cases have no expected \
             answer (an import without gold labels). Give the gold labels (`evalflow import \
             --expected-field FIELD` reads them from an OpenAI Batch input's field or its \
             `metadata`), or score with a scorer that needs none (the cue scorer, a judge).",
            id.tag(),
            self.no_expected,
            self.no_expected + self.judged,
        ))
    }

    fn failure_warning(&self, id: &ScorerId) -> Option<String> {
        if self.judged == 0 || (self.failed as f64) < WARN_FAILURE_RATE * self.judged as f64 {
            return None;
        }
        let pct = |k: u64| 100.0 * k as f64 / self.judged as f64;
        Some(format!(
            "warning: {} failed {} of {} valid answers ({:.1}%): {:.1}% of them contain none of \
             their expected labels and {:.1}% contain one inside longer text, so the exact \
             label match may be unable to succeed on these answers (free text scored against \
             labels). Score them with the cue scorer or a user-written scorer (a `[[scorer]]` of \
             kind `contains`, `regex` or `sql`; see docs/scorers.md), e.g. \
             `evalflow rescore RUN --scorer-file scorers.toml`.",
            id.tag(),
            self.failed,
            self.judged,
            pct(self.failed),
            pct(self.none),
            pct(self.inside),
        ))
    }
}

/// The words of a text, lower-cased: a label is found inside an answer as whole words
/// (`B` in "the answer is B", not in "because").
fn tokens(s: &str) -> Vec<String> {
    s.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// Counts the valid MFT answers of the scores of `id` (streamed: memory is one batch).
///
/// # Errors
/// [`QueryError`] when the run's tables cannot be read.
pub async fn label_coverage(store: &RunStore, id: &ScorerId) -> Result<LabelCoverage, QueryError> {
    // On this machine even with `--cluster`: a warning's count is not worth a cluster job,
    // and a Ballista job streaming every answer back to the client did not end.
    let ctx = crate::query::local_context();
    register_run(&ctx, store, "").await?;
    let lit = |s: &str| format!("'{}'", s.replace('\'', "''"));
    let sql = format!(
        "SELECT CAST(k.response AS VARCHAR) AS response, CAST(c.expected AS VARCHAR) AS expected, s.passed \
         FROM scores s JOIN calls k ON s.call_id = k.call_id JOIN cases c ON k.case_id = c.case_id \
         WHERE s.scorer = {} AND s.scoring_version = {} AND s.validity = 'valid_answer' \
         AND s.passed IS NOT NULL AND c.test_type = 'MFT' AND c.expected IS NOT NULL",
        lit(&id.name),
        lit(&id.version)
    );
    let what = "score: counting answers against their expected labels";
    let mut rows = ctx
        .sql(&sql)
        .await
        .map_err(QueryError::df(what))?
        .execute_stream()
        .await
        .map_err(QueryError::df(what))?;
    let no_expected = format!(
        "SELECT count(*) FROM scores s WHERE s.scorer = {} AND s.scoring_version = {} AND \
         s.validity = 'valid_answer' AND s.passed IS NULL AND s.detail LIKE {}",
        lit(&id.name),
        lit(&id.version),
        lit(&format!("%{}%", super::checklist::NO_EXPECTED))
    );
    let n = crate::query::text_rows(&ctx, &no_expected).await?;
    let mut out = LabelCoverage {
        no_expected: n
            .first()
            .and_then(|r| r[0].as_deref())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        ..LabelCoverage::default()
    };
    while let Some(b) = rows.next().await {
        let b = crate::schema::plain_strings(b.map_err(QueryError::df(what))?);
        use datafusion::arrow::array::{Array, AsArray};
        let (response, expected, passed) = (
            b.column(0).as_string::<i32>(),
            b.column(1).as_string::<i32>(),
            b.column(2).as_boolean(),
        );
        for i in 0..b.num_rows() {
            let r = if response.is_valid(i) {
                response.value(i)
            } else {
                ""
            };
            out.add(r, expected.value(i), passed.value(i));
        }
    }
    Ok(out)
}

/// The warning of a judge scorer version whose replies could not be read: at least
/// [`WARN_FAILURE_RATE`] of the answers it was given ended `judge_unparseable` (the judge does
/// not answer in `Q1: YES` lines), as the checklist warns of a label match that never matched.
/// `None` for any other scorer (none has that verdict) or a judge whose replies mostly parse.
pub async fn judge_replies(store: &RunStore, id: &ScorerId) -> Result<Option<String>, QueryError> {
    let ctx = crate::query::local_context();
    crate::query::register_scores_of(&ctx, store, &[id]).await?;
    let lit = |s: &str| format!("'{}'", s.replace('\'', "''"));
    let sql = format!(
        "SELECT CAST(count(*) FILTER (WHERE validity = 'judge_unparseable') AS BIGINT), \
         CAST(count(*) FILTER (WHERE validity IN ('valid_answer', 'judge_unparseable')) AS BIGINT) \
         FROM scores WHERE scorer = {} AND scoring_version = {}",
        lit(&id.name),
        lit(&id.version)
    );
    let rows = crate::query::text_rows(&ctx, &sql).await?;
    let n = |i: usize| -> u64 {
        rows.first()
            .and_then(|r| r.get(i).cloned().flatten())
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    };
    let (bad, judged) = (n(0), n(1));
    if bad == 0 || (bad as f64) < WARN_FAILURE_RATE * judged as f64 {
        return Ok(None);
    }
    Ok(Some(format!(
        "warning: {} could not read {bad} of {judged} judge replies (judge_unparseable): the \
         judge model does not answer one `Qk: YES` or `Qk: NO` line per question. Its replies \
         are in `scores.detail`; a model that follows instructions, a larger max_tokens or \
         clearer `instructions` under [score.judge] fix it, and its mean score here covers \
         only the replies it could read.",
        id.tag()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_text_against_labels_is_warned_with_its_shares() {
        let mut c = LabelCoverage::default();
        c.add("The answer is B, because the text says so.", "B", false);
        c.add("I am not sure.", "A", false);
        c.add("Probably neither.", "C|D", false);
        c.add("Option D", "C|D", false);
        assert_eq!(
            c,
            LabelCoverage {
                judged: 4,
                failed: 4,
                none: 2,
                inside: 2,
                no_expected: 0,
            }
        );
        let id = ScorerId {
            name: "checklist".into(),
            version: "1".into(),
        };
        let w = c.warning(&id).unwrap();
        assert!(
            w.starts_with(
                "warning: checklist@1 failed 4 of 4 valid answers (100.0%): 50.0% of them contain none of their expected labels and 50.0% \
                 contain one inside longer text"
            ),
            "{w}"
        );
        // A model that answers with labels and gets some right is the model's result.
        let mut ok = LabelCoverage::default();
        ok.add("positive", "positive", true);
        ok.add("negative", "positive", false);
        assert_eq!(ok.warning(&id), None);
    }

    /// Answers left unscored for want of an expected answer are warned of, with the way to
    /// give the gold labels, beside the failure-rate warning when both apply.
    #[test]
    fn answers_without_an_expected_answer_are_warned_of() {
        let id = ScorerId {
            name: "checklist".into(),
            version: "2".into(),
        };
        let mut c = LabelCoverage {
            no_expected: 187,
            ..LabelCoverage::default()
        };
        let w = c.warning(&id).unwrap();
        assert!(
            w.starts_with(
                "warning: checklist@2 left 187 of 187 valid answers unscored: their cases have \
                 no expected answer"
            ) && w.contains("--expected-field"),
            "{w}"
        );
        assert_eq!(w.lines().count(), 1);
        c.add("x", "y", false);
        c.add("z", "y", false);
        let w = c.warning(&id).unwrap();
        assert!(w.contains("left 187 of 189 valid answers unscored"), "{w}");
        assert!(
            w.lines()
                .nth(1)
                .unwrap()
                .contains("failed 2 of 2 valid answers"),
            "{w}"
        );
    }
}
