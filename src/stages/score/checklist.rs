//! The CheckList scorer: MFT label match, INV invariance and DIR direction against the
//! base case of each group, with a tolerance on the continuous score (CheckList's 0.1).
//!
//! Version 2: an MFT (or single) case without an expected answer is left unscored ("no
//! expected answer"); version 1 matched the answer against "" and failed it, so an import
//! without gold labels (an OpenAI Batch output) scored 100% failures.

use super::{BaseAnswer, Outcome, ScoreInput, Scorer, ScorerId, source_logic};

/// The CheckList scorer: MFT label match, INV and DIR against the group's base case.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChecklistScorer;

impl Scorer for ChecklistScorer {
    fn id(&self) -> ScorerId {
        ScorerId {
            name: "checklist".into(),
            version: "2".into(),
        }
    }

    fn logic(&self) -> Vec<String> {
        vec![source_logic(include_str!("checklist.rs"))]
    }

    fn compares_to_base(&self) -> bool {
        true
    }

    fn score(&self, row: &ScoreInput, base: Option<&BaseAnswer>) -> Outcome {
        let answer = Answer {
            label: normalise_label(row.response),
            score: row.response_score,
        };
        let mut out = Outcome {
            label: Some(answer.label.clone()),
            prob: answer.score,
            ..Outcome::default()
        };
        let verdict = match (row.test_type, row.role) {
            (_, "base") => {
                out.detail = serde_json::json!({ "role": "base" });
                return out;
            }
            ("MFT", _) | (_, "single") => match row.expected.filter(|e| !e.trim().is_empty()) {
                Some(expected) => Some(mft(&answer, expected)),
                None => {
                    out.detail = serde_json::json!({ "unscored": NO_EXPECTED });
                    return out;
                }
            },
            (tt, _) => match base {
                Some(Ok(b)) if tt == "INV" => Some(inv(&answer, b, row.tolerance.unwrap_or(0.1))),
                Some(Ok(b)) => dir(
                    &answer,
                    b,
                    row.expectation.unwrap_or_default(),
                    row.tolerance.unwrap_or(0.1),
                ),
                Some(Err(v)) => {
                    out.detail =
                        serde_json::json!({ "not_comparable": format!("base case answer is {v}") });
                    return out;
                }
                None => {
                    out.detail = serde_json::json!({ "not_comparable": "base case has no call" });
                    return out;
                }
            },
        };
        match verdict {
            Some(v) => {
                out.passed = Some(v.passed);
                out.score = Some(if v.passed { 1.0 } else { 0.0 });
                out.detail = v.detail;
            }
            None => out.detail = serde_json::json!({ "not_comparable": "no score to compare" }),
        }
        out
    }
}

/// Why an MFT answer without an expected answer is unscored (its `detail`).
pub const NO_EXPECTED: &str = "no expected answer";

/// A model answer reduced to what the CheckList comparisons need.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The normalised label (`positive`, `negative`, ...).
    pub label: String,
    /// The continuous output (a classifier's score) when the provider gives one.
    pub score: Option<f64>,
}

/// Normalises a free-text label: trimmed, lower-case, without trailing punctuation.
pub fn normalise_label(s: &str) -> String {
    s.trim()
        .trim_end_matches(['.', '!', '?', ';', ':'])
        .trim()
        .to_lowercase()
}

/// An ordinal position for sentiment labels, used when no continuous score exists.
fn ordinal(label: &str) -> Option<f64> {
    match label {
        "negative" => Some(-1.0),
        "neutral" => Some(0.0),
        "positive" => Some(1.0),
        _ => None,
    }
}

/// The number DIR and INV compare: the continuous score, else the label's ordinal.
fn level(a: &Answer) -> Option<f64> {
    a.score.or_else(|| ordinal(&a.label))
}

/// A pass/fail verdict with the facts behind it (written to `detail`).
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub passed: bool,
    pub detail: serde_json::Value,
}

/// MFT: passes when the label is one of `expected`'s `|`-separated alternatives.
pub fn mft(answer: &Answer, expected: &str) -> Verdict {
    let ok: Vec<String> = expected.split('|').map(normalise_label).collect();
    Verdict {
        passed: ok.contains(&answer.label),
        detail: serde_json::json!({ "expected": expected, "got": answer.label }),
    }
}

/// INV: fails when the label changes and the score moves by more than `tol` (CheckList).
/// Without continuous scores a label change alone fails.
pub fn inv(answer: &Answer, base: &Answer, tol: f64) -> Verdict {
    let changed = answer.label != base.label;
    let delta = match (answer.score, base.score) {
        (Some(a), Some(b)) => Some(a - b),
        _ => None,
    };
    let moved = delta.is_none_or(|d| d.abs() > tol);
    Verdict {
        passed: !(changed && moved),
        detail: serde_json::json!({
            "base_label": base.label, "base_score": base.score, "delta": delta, "tolerance": tol
        }),
    }
}

/// DIR: `not_more_positive` fails when the score rises by more than `tol`;
/// `not_less_positive` when it falls by more than `tol`; `more_positive` /
/// `less_positive` fail unless it moves strictly that way.
pub fn dir(answer: &Answer, base: &Answer, expectation: &str, tol: f64) -> Option<Verdict> {
    let (a, b) = (level(answer)?, level(base)?);
    let d = a - b;
    let passed = match expectation {
        "not_more_positive" => d <= tol,
        "not_less_positive" => d >= -tol,
        "more_positive" => d > 0.0,
        "less_positive" => d < 0.0,
        _ => return None,
    };
    Some(Verdict {
        passed,
        detail: serde_json::json!({
            "base_label": base.label, "base_score": b, "score": a, "delta": d,
            "expectation": expectation, "tolerance": tol
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ans(label: &str, score: f64) -> Answer {
        Answer {
            label: label.into(),
            score: Some(score),
        }
    }

    /// An MFT or single case without an expected answer (or a blank one) is unscored, with
    /// its reason; one with an expected answer is judged.
    #[test]
    fn mft_without_an_expected_answer_is_unscored() {
        let row = |expected: Option<&'static str>, test_type: &'static str, role: &'static str| {
            ScoreInput {
                call_id: "c",
                input: "i",
                response: "positive",
                response_score: None,
                language: "en",
                test_type,
                role,
                expected,
                expectation: None,
                tolerance: None,
            }
        };
        for (test_type, role) in [("MFT", "single"), ("MFT", "perturbed"), ("INV", "single")] {
            for expected in [None, Some(""), Some("  ")] {
                let out = ChecklistScorer.score(&row(expected, test_type, role), None);
                assert_eq!(out.passed, None, "{expected:?}");
                assert_eq!(out.score, None);
                assert_eq!(out.detail["unscored"], NO_EXPECTED);
                assert_eq!(out.label.as_deref(), Some("positive"));
            }
            let out = ChecklistScorer.score(&row(Some("positive"), test_type, role), None);
            assert_eq!(out.passed, Some(true));
            let out = ChecklistScorer.score(&row(Some("negative"), test_type, role), None);
            assert_eq!(out.passed, Some(false));
        }
    }

    #[test]
    fn mft_accepts_alternatives() {
        assert!(mft(&ans("neutral", 0.0), "positive|neutral").passed);
        assert!(!mft(&ans("negative", -0.4), "positive|neutral").passed);
        assert_eq!(normalise_label(" Positive.\n"), "positive");
    }

    #[test]
    fn inv_needs_label_change_and_movement() {
        // label changes but score barely moves: CheckList counts it as a pass
        assert!(inv(&ans("neutral", 0.04), &ans("positive", 0.06), 0.1).passed);
        assert!(!inv(&ans("negative", -0.3), &ans("positive", 0.3), 0.1).passed);
        // big move, same label: pass
        assert!(inv(&ans("positive", 0.9), &ans("positive", 0.3), 0.1).passed);
    }

    #[test]
    fn dir_not_more_positive() {
        let base = ans("negative", -0.5);
        assert!(
            dir(&ans("negative", -0.7), &base, "not_more_positive", 0.1)
                .unwrap()
                .passed
        );
        assert!(
            dir(&ans("negative", -0.45), &base, "not_more_positive", 0.1)
                .unwrap()
                .passed
        );
        assert!(
            !dir(&ans("neutral", -0.2), &base, "not_more_positive", 0.1)
                .unwrap()
                .passed
        );
        let d = dir(&ans("neutral", -0.2), &base, "not_more_positive", 0.1).unwrap();
        assert!((d.detail["delta"].as_f64().unwrap() - 0.3).abs() < 1e-12);
    }
}
