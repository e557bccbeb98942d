//! Validate: decides, before any scoring, exactly one validity verdict per call.
//!
//! Missing output is a fact about the request, never evidence about the answer: an empty,
//! truncated or failed call gets a verdict other than `valid_answer` and a human-readable
//! reason, and the score stage will not score it.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, Int32Array, Int64Array, RecordBatch, StringArray};
use futures::StreamExt;

use crate::schema::Table;
use crate::storage::{RunStore, StorageError};

/// Stamped on every validity row; bump when the rules below change.
pub const VALIDATOR_VERSION: &str = "validate@1";

/// The validity verdicts, in DESIGN.md order.
pub const VERDICTS: [&str; 6] = [
    "valid_answer",
    "empty_due_to_budget",
    "empty_unexplained",
    "truncated",
    "provider_error",
    "unscorable_language",
];

/// The script-level language of an answer: `zh`, `en`, `mixed`, another ISO 639-1 code
/// when a detector is confident on a long enough Latin-script text, or `und` with no letters.
///
/// Uses the Han-vs-Latin ratio rule from six-checks-before-you-trust: r = han / (han +
/// latin); r > 0.35 is zh, r < 0.05 is Latin script, otherwise mixed.
pub fn language(text: &str) -> String {
    let han = text
        .chars()
        .filter(|c| ('\u{4e00}'..='\u{9fff}').contains(c))
        .count();
    let latin = text.chars().filter(|c| c.is_ascii_alphabetic()).count();
    if han + latin == 0 {
        // Other scripts (Cyrillic, Arabic, ...) or no letters at all.
        return match whatlang::detect(text) {
            Some(info) if info.is_reliable() => iso639_1(info.lang()).to_string(),
            _ if text.chars().any(char::is_alphabetic) => "other".into(),
            _ => "und".into(),
        };
    }
    let r = han as f64 / (han + latin) as f64;
    if r > 0.35 {
        "zh".into()
    } else if r >= 0.05 {
        "mixed".into()
    } else if latin >= 40 {
        // Long Latin-script answers may be another language; short ones (labels) stay en.
        match whatlang::detect(text) {
            Some(info) if info.is_reliable() && info.lang() != whatlang::Lang::Eng => {
                iso639_1(info.lang()).to_string()
            }
            _ => "en".into(),
        }
    } else {
        "en".into()
    }
}

fn iso639_1(l: whatlang::Lang) -> &'static str {
    use whatlang::Lang::*;
    match l {
        Eng => "en",
        Cmn => "zh",
        Spa => "es",
        Fra => "fr",
        Deu => "de",
        Ita => "it",
        Por => "pt",
        Rus => "ru",
        Jpn => "ja",
        Kor => "ko",
        Ara => "ar",
        Hin => "hi",
        Nld => "nl",
        Tur => "tr",
        Pol => "pl",
        Swe => "sv",
        Ukr => "uk",
        Vie => "vi",
        _ => l.code(),
    }
}

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
    let covered = languages.contains(&lang)
        || (lang == "mixed"
            && languages.iter().any(|l| l == "en")
            && languages.iter().any(|l| l == "zh"));
    if !covered {
        return v(
            "unscorable_language",
            format!(
                "answer language `{lang}` is not covered by the scorers ({})",
                languages.join(", ")
            ),
        );
    }
    v(
        "valid_answer",
        format!("answer of {answer_chars} characters in `{lang}`"),
    )
}

fn opt_str<'a>(b: &'a RecordBatch, name: &str, i: usize) -> Option<&'a str> {
    let a = b
        .column_by_name(name)?
        .as_any()
        .downcast_ref::<StringArray>()?;
    a.is_valid(i).then(|| a.value(i))
}

fn opt_i64(b: &RecordBatch, name: &str, i: usize) -> Option<i64> {
    let a = b
        .column_by_name(name)?
        .as_any()
        .downcast_ref::<Int64Array>()?;
    a.is_valid(i).then(|| a.value(i))
}

fn opt_i32(b: &RecordBatch, name: &str, i: usize) -> Option<i32> {
    let a = b
        .column_by_name(name)?
        .as_any()
        .downcast_ref::<Int32Array>()?;
    a.is_valid(i).then(|| a.value(i))
}

/// Validates one batch of calls into a batch of validity rows.
pub fn validate_batch(calls: &RecordBatch, languages: &[String]) -> RecordBatch {
    let n = calls.num_rows();
    let mut call_ids = Vec::with_capacity(n);
    let mut verdicts = Vec::with_capacity(n);
    for i in 0..n {
        let view = CallView {
            response: opt_str(calls, "response", i),
            finish_reason: opt_str(calls, "finish_reason", i),
            http_status: opt_i32(calls, "http_status", i),
            error: opt_str(calls, "error", i),
            reasoning_tokens: opt_i64(calls, "reasoning_tokens", i),
            reasoning_chars: opt_i64(calls, "reasoning_chars", i),
            completion_tokens: opt_i64(calls, "completion_tokens", i),
            max_tokens: opt_i32(calls, "max_tokens", i),
        };
        verdicts.push(decide(&view, languages));
        call_ids.push(opt_str(calls, "call_id", i).unwrap_or_default().to_string());
    }
    let cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from_iter_values(call_ids)),
        Arc::new(StringArray::from_iter_values(
            verdicts.iter().map(|v| v.validity),
        )),
        Arc::new(StringArray::from_iter_values(
            verdicts.iter().map(|v| v.reason.as_str()),
        )),
        Arc::new(StringArray::from_iter_values(
            verdicts.iter().map(|v| v.language.as_str()),
        )),
        Arc::new(Int64Array::from_iter_values(
            verdicts.iter().map(|v| v.answer_chars),
        )),
        Arc::new(StringArray::from_iter_values(std::iter::repeat_n(
            VALIDATOR_VERSION,
            n,
        ))),
    ];
    RecordBatch::try_new(Table::Validity.schema(), cols)
        .expect("validity batch matches schemas/validity.json")
}

/// Runs validate: each `calls` part gets a `validity` part of the same name, so a
/// restarted stage skips parts already validated and never writes a row twice.
pub async fn run(store: &RunStore, languages: &[String]) -> Result<u64, StorageError> {
    let mut rows = 0u64;
    for part in store.list_parts("calls").await? {
        let name = part
            .location
            .filename()
            .unwrap_or("part.parquet")
            .to_string();
        let target = format!("validity/{name}");
        if let Some(done) = store.head(&target).await? {
            let mut s = store.read_part(&done, Table::Validity).await?;
            while let Some(b) = s.next().await {
                rows += b?.num_rows() as u64;
            }
            continue;
        }
        let mut batches = Vec::new();
        let mut s = store.read_part(&part, Table::Calls).await?;
        while let Some(b) = s.next().await {
            let v = validate_batch(&crate::schema::plain_strings(b?), languages);
            rows += v.num_rows() as u64;
            batches.push(v);
        }
        let bytes = crate::storage::encode_parquet(&Table::Validity.schema(), &batches).map_err(
            |source| StorageError::Parquet {
                location: target.clone(),
                source,
            },
        )?;
        store.put(&target, bytes).await?;
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn en() -> Vec<String> {
        vec!["en".into()]
    }

    #[test]
    fn language_rule_from_the_seed() {
        assert_eq!(language("The food was great."), "en");
        assert_eq!(
            language("之前推荐的一些品牌基本都超了，不建议强行上付费版"),
            "zh"
        );
        assert_eq!(language("Asana 和 Monday.com 的付费版都超了预算"), "zh");
        assert_eq!(
            language("Premium tiers of Asana and Monday are over budget 不建议"),
            "mixed"
        );
        assert_eq!(language("12345"), "und");
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
        let ok = CallView {
            response: Some("positive"),
            finish_reason: Some("stop"),
            ..Default::default()
        };
        assert_eq!(decide(&ok, &en()).validity, "valid_answer");
    }
}
