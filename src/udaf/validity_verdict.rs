//! `validity_verdict`: the validity rule ([`crate::validity::decide`]) as a SQL function, so
//! validate is a plan and a user can re-decide verdicts ad hoc in `evalflow sql`.

use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, Int64Builder, StringArray, StringBuilder, StructArray,
};
use datafusion::arrow::datatypes::{DataType, Field, Fields, Int32Type, Int64Type};
use datafusion::common::Result as DfResult;
use datafusion::logical_expr::ScalarUDF;

use super::FunctionDoc;
use super::spec::{ScalarSpec, StatUdf};
use crate::validity::{CallView, decide};

/// `validity_verdict(...)`: the validity rule as a SQL function, so validate is a plan and a
/// user can re-decide verdicts ad hoc in `evalflow sql`.
#[derive(Debug, PartialEq, Eq, Hash, Default)]
pub struct ValidityVerdict;

/// The struct fields `validity_verdict` returns, named as the validity table's columns.
fn verdict_fields() -> Fields {
    Fields::from(vec![
        Field::new("validity", DataType::Utf8, false),
        Field::new("validity_reason", DataType::Utf8, false),
        Field::new("language", DataType::Utf8, false),
        Field::new("answer_chars", DataType::Int64, false),
    ])
}

const ARG_TYPES: [DataType; 8] = [
    DataType::Utf8,
    DataType::Utf8,
    DataType::Int32,
    DataType::Utf8,
    DataType::Int64,
    DataType::Int64,
    DataType::Int64,
    DataType::Utf8,
];

impl ScalarSpec for ValidityVerdict {
    const DOC: FunctionDoc = FunctionDoc {
        name: "validity_verdict",
        syntax: "validity_verdict(response, finish_reason, http_status, error, reasoning_tokens, reasoning_chars, max_tokens, languages)",
        returns: "Struct{validity, validity_reason, language, answer_chars}",
        summary: "The validate stage's rule (`validate@4`), decided before any scoring: exactly one of \
                  `valid_answer`, `empty_due_to_budget`, `empty_unexplained`, `truncated`, \
                  `provider_error`, `unscorable_language`, with a human-readable reason, the answer's \
                  language (CJK-vs-Latin ratio, kana making it `ja`; for Latin-script text that does \
                  not read as English and shows a sign of another language, a detector when long \
                  and a vote of function words when short, `und` when they point to several \
                  languages) and its length in characters. `evalflow validate` runs `SELECT call_id, validity_verdict(...) \
                  FROM calls`; the same call re-decides verdicts ad hoc, for instance under another \
                  set of accepted languages.",
        behavior: "Any argument may be NULL: a NULL response is an empty answer, a NULL error or \
                   http_status is no error. An error (or a non-2xx status) wins over every other \
                   verdict; an answer the provider filtered (finish_reason `content_filter` or \
                   `refusal`) is `provider_error` with a reason naming it, never scored; an \
                   empty answer with finish_reason `length` is `empty_due_to_budget`.",
        arguments: &[
            ("response", "The answer text (calls.response)."),
            (
                "finish_reason",
                "calls.finish_reason (`stop`, `length`, ...).",
            ),
            ("http_status", "calls.http_status."),
            ("error", "calls.error: the provider's error message."),
            ("reasoning_tokens", "calls.reasoning_tokens."),
            ("reasoning_chars", "calls.reasoning_chars."),
            ("max_tokens", "calls.max_tokens (the request's budget)."),
            (
                "languages",
                "The answer languages the scorers read, comma-separated ISO 639-1 codes such as 'en,zh'.",
            ),
        ],
        example: "SELECT v['validity'] AS validity, v['language'] AS language, v['validity_reason'] AS reason FROM (SELECT \
            validity_verdict(r, f, 200, NULL, NULL, NULL, 512, 'en') AS v FROM (VALUES ('The food was great.', 'stop'), ('', 'length'), \
            ('不建议强行上付费版', 'stop')) AS t(r, f))",
    };

    fn coerce(&self, t: &[DataType]) -> DfResult<Vec<DataType>> {
        if t.len() != ARG_TYPES.len() {
            return datafusion::common::plan_err!(
                "validity_verdict takes {} arguments, got {}",
                ARG_TYPES.len(),
                t.len()
            );
        }
        Ok(ARG_TYPES.to_vec())
    }

    fn return_type(&self) -> DataType {
        DataType::Struct(verdict_fields())
    }

    fn invoke(&self, args: &[ArrayRef], n_rows: usize) -> DfResult<ArrayRef> {
        fn opt(a: &StringArray, i: usize) -> Option<&str> {
            a.is_valid(i).then(|| a.value(i))
        }
        let s = |i: usize| args[i].as_string::<i32>();
        let (response, finish, error, langs) = (s(0), s(1), s(3), s(7));
        let http = args[2].as_primitive::<Int32Type>();
        let i64s = |i: usize| args[i].as_primitive::<Int64Type>();
        let (rtok, rchars, maxt) = (i64s(4), i64s(5), i64s(6));
        let mut lang_cache: (Option<String>, Vec<String>) = (None, Vec::new());
        let mut validity = StringBuilder::with_capacity(n_rows, n_rows * 12);
        let mut reason = StringBuilder::with_capacity(n_rows, n_rows * 32);
        let mut language = StringBuilder::with_capacity(n_rows, n_rows * 2);
        let mut chars = Int64Builder::with_capacity(n_rows);
        for i in 0..n_rows {
            let l = opt(langs, i).unwrap_or("");
            if lang_cache.0.as_deref() != Some(l) {
                lang_cache = (
                    Some(l.to_string()),
                    l.split(',')
                        .map(|x| x.trim().to_string())
                        .filter(|x| !x.is_empty())
                        .collect(),
                );
            }
            let view = CallView {
                response: opt(response, i),
                finish_reason: opt(finish, i),
                http_status: http.is_valid(i).then(|| http.value(i)),
                error: opt(error, i),
                reasoning_tokens: rtok.is_valid(i).then(|| rtok.value(i)),
                reasoning_chars: rchars.is_valid(i).then(|| rchars.value(i)),
                completion_tokens: None,
                max_tokens: maxt
                    .is_valid(i)
                    .then(|| i32::try_from(maxt.value(i)).unwrap_or(i32::MAX)),
            };
            let v = decide(&view, &lang_cache.1);
            validity.append_value(v.validity);
            reason.append_value(&v.reason);
            language.append_value(&v.language);
            chars.append_value(v.answer_chars);
        }
        let cols: Vec<ArrayRef> = vec![
            Arc::new(validity.finish()),
            Arc::new(reason.finish()),
            Arc::new(language.finish()),
            Arc::new(chars.finish()),
        ];
        Ok(Arc::new(StructArray::try_new(
            verdict_fields(),
            cols,
            None,
        )?))
    }
}

/// The registered `validity_verdict` function.
pub fn validity_udf() -> ScalarUDF {
    StatUdf::udf(ValidityVerdict)
}
