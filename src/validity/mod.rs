//! The validity rule: exactly one verdict per call, decided before any scoring.
//!
//! Missing output is a fact about the request, never evidence about the answer: an empty,
//! truncated or failed call gets a verdict other than `valid_answer` and a human-readable
//! reason, and the score stage will not score it. The rule is plain Rust below the stages:
//! the SQL function `validity_verdict` (`udaf/validity_verdict.rs`) runs it, the validate
//! stage (`stages/validate.rs`) runs that function over each calls part, and the cue scorer
//! reads [`language`].

mod language;

pub use language::language;

/// Stamped on every validity row; bump when the rules below change. `@2`: the language
/// detector is skipped for Latin-script text that reads as English by its function words,
/// and an answer with no letters (a number) is scorable whatever languages are accepted.
/// `@3`: the detector runs only on Latin-script text that shows a sign of another language
/// (a non-ASCII letter or a function word of another language); without one the text is
/// English. On a bench corpus every text this changed was English word lists the detector
/// had called French or Afrikaans, and it cut the detector's calls twentyfold.
/// `@4`: an answer the provider filtered (`finish_reason` `content_filter` or `refusal`)
/// is `provider_error`, never scored; kana makes an answer Japanese (`ja`, it was `zh`),
/// Hangul Korean; a short Latin-script answer is tagged by a vote of its function words
/// (short Spanish was `en`), `und` when they point to several languages at once, and such
/// an `und` (with letters) is read only where `und` is accepted.
pub const VALIDATOR_VERSION: &str = "validate@4";

/// The validity verdicts, in DESIGN.md order.
pub const VERDICTS: [&str; 6] = [
    "valid_answer",
    "empty_due_to_budget",
    "empty_unexplained",
    "truncated",
    "provider_error",
    "unscorable_language",
];

/// Finish reasons that mean the provider withheld or cut the answer by policy: OpenAI's
/// `content_filter` and Anthropic's `refusal` (mapped through unchanged).
pub const FILTERED: [&str; 2] = ["content_filter", "refusal"];

/// One call's fields that decide its validity.
#[derive(Debug, Clone, Default)]
pub struct CallView<'a> {
    pub response: Option<&'a str>,
    pub finish_reason: Option<&'a str>,
    pub http_status: Option<i32>,
    pub error: Option<&'a str>,
    pub reasoning_tokens: Option<i64>,
    pub reasoning_chars: Option<i64>,
    pub completion_tokens: Option<i64>,
    pub max_tokens: Option<i32>,
}

/// A verdict with its reason and the facts it was decided from.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub validity: &'static str,
    pub reason: String,
    pub language: String,
    pub answer_chars: i64,
}

/// Decides one call's validity. `languages` are those the scorers cover.
pub fn decide(c: &CallView, languages: &[String]) -> Verdict {
    let text = c.response.unwrap_or("");
    let answer_chars = text.chars().count() as i64;
    let lang = if text.trim().is_empty() {
        "und".to_string()
    } else {
        language(text)
    };
    let v = |validity: &'static str, reason: String| Verdict {
        validity,
        reason,
        language: lang.clone(),
        answer_chars,
    };
    if let Some(e) = c.error {
        let status = c
            .http_status
            .map(|s| format!("HTTP {s}: "))
            .unwrap_or_default();
        return v("provider_error", format!("{status}{e}"));
    }
    if let Some(s) = c.http_status.filter(|s| !(200..300).contains(s)) {
        return v("provider_error", format!("HTTP {s} with no answer"));
    }
    if let Some(f) = c.finish_reason.filter(|f| FILTERED.contains(f)) {
        // What is left of a filtered answer is the provider's choice, not the model's
        // answer: scoring it would count the filter as the model failing (or passing).
        return v(
            "provider_error",
            format!(
                "finish_reason={f}: the provider filtered the answer ({answer_chars} characters returned); never scored"
            ),
        );
    }
    let length = c.finish_reason == Some("length");
    if text.trim().is_empty() {
        if length {
            let reasoning = c.reasoning_tokens.unwrap_or(0);
            return v(
                "empty_due_to_budget",
                format!(
                    "empty answer with finish_reason=length: reasoning_tokens={} reasoning_chars={} of max_tokens={}",
                    reasoning,
                    c.reasoning_chars.unwrap_or(0),
                    c.max_tokens
                        .map(|m| m.to_string())
                        .unwrap_or_else(|| "server default".into())
                ),
            );
        }
        return v(
            "empty_unexplained",
            format!(
                "empty answer with finish_reason={}",
                c.finish_reason.unwrap_or("none")
            ),
        );
    }
    if length {
        return v(
            "truncated",
            format!("finish_reason=length after {answer_chars} characters: the answer was cut off"),
        );
    }
    // An answer with no letters ("30", "4.99") is in no language: every scorer reads it.
    // One whose letters do not tell their language (`und` with letters) is read only
    // where `und` is accepted: calling it English would score it on no evidence.
    let letters = lang == "und" && text.chars().any(char::is_alphabetic);
    let covered = languages.contains(&lang)
        || (lang == "und" && !letters)
        || (lang == "mixed"
            && languages.iter().any(|l| l == "en")
            && languages.iter().any(|l| l == "zh"));
    if !covered {
        let accepted = languages.join(", ");
        let reason = if letters {
            format!(
                "answer language `und`: its words point to several languages, none of them clearly \
                 (accepted: {accepted}; accept `und` to score such answers)"
            )
        } else {
            format!("answer language `{lang}` is not covered by the scorers ({accepted})")
        };
        return v("unscorable_language", reason);
    }
    v(
        "valid_answer",
        format!("answer of {answer_chars} characters in `{lang}`"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn en() -> Vec<String> {
        vec!["en".into()]
    }

    #[test]
    fn verdicts_for_each_failure_shape() {
        let err = CallView {
            error: Some("out of credit"),
            http_status: Some(403),
            ..Default::default()
        };
        assert_eq!(decide(&err, &en()).validity, "provider_error");
        assert_eq!(decide(&err, &en()).reason, "HTTP 403: out of credit");
        let starved = CallView {
            response: Some(""),
            finish_reason: Some("length"),
            reasoning_tokens: Some(600),
            max_tokens: Some(600),
            http_status: Some(200),
            ..Default::default()
        };
        assert_eq!(decide(&starved, &en()).validity, "empty_due_to_budget");
        let empty = CallView {
            response: Some("  "),
            finish_reason: Some("stop"),
            ..Default::default()
        };
        assert_eq!(decide(&empty, &en()).validity, "empty_unexplained");
        let cut = CallView {
            response: Some("The answer is"),
            finish_reason: Some("length"),
            ..Default::default()
        };
        assert_eq!(decide(&cut, &en()).validity, "truncated");
        let zh = CallView {
            response: Some("不建议强行上付费版"),
            finish_reason: Some("stop"),
            ..Default::default()
        };
        assert_eq!(decide(&zh, &en()).validity, "unscorable_language");
        let number = CallView {
            response: Some("4.99"),
            finish_reason: Some("stop"),
            ..Default::default()
        };
        assert_eq!(decide(&number, &en()).validity, "valid_answer");
        assert_eq!(decide(&number, &en()).language, "und");
        // A filtered answer is never scored, whatever text came with it.
        let filtered = CallView {
            response: Some("I can't help with"),
            finish_reason: Some("content_filter"),
            http_status: Some(200),
            ..Default::default()
        };
        let f = decide(&filtered, &en());
        assert_eq!(f.validity, "provider_error");
        assert!(
            f.reason.starts_with("finish_reason=content_filter"),
            "{}",
            f.reason
        );
        let refused = CallView {
            response: Some(""),
            finish_reason: Some("refusal"),
            ..Default::default()
        };
        assert_eq!(decide(&refused, &en()).validity, "provider_error");
        let ok = CallView {
            response: Some("positive"),
            finish_reason: Some("stop"),
            ..Default::default()
        };
        assert_eq!(decide(&ok, &en()).validity, "valid_answer");
    }
}
