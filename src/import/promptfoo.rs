//! promptfoo result files (`promptfoo eval -o results.json`).
//!
//! # Behavior
//! - One call per result (`results.results[]`, one per test x prompt x provider x repeat):
//!   the rendered prompt (`prompt.raw`; a chat prompt, the JSON of its messages, gives the
//!   last user message and the system message), the provider (`openai:chat:gpt-4o` is
//!   provider `openai`, model `gpt-4o`), the answer (`response.output`, JSON text when it
//!   is not a string), `response.tokenUsage` (prompt, completion), `latencyMs`,
//!   `response.finishReason` when recorded, and `error`. `max_tokens` and `temperature`
//!   come from the provider's `config` in the file's `config.providers`. `expected` is the
//!   value of the test's first assertion when it is a string; the test is the config's
//!   `description`; `sample_idx` the `repeatIndex` when recorded. Only a result whose
//!   `failureReason` is 2 (an error) is a failed call: promptfoo also writes the reason a
//!   failed assertion failed into `error`, and that goes to the score's `detail`.
//! - promptfoo's verdict is an imported score `promptfoo-assert@imported` (`score`,
//!   `passed` = `success`, the grading reason in `detail`), and each of its `namedScores`
//!   one `promptfoo-<name>@imported`.
//! - `--cluster FIELD` takes each case's cluster from the test `vars`; `test` and
//!   `capability` from the test's `metadata` (or `vars`). A chat prompt is a case by its
//!   whole conversation, not its last user turn; the provider's config is the model's
//!   (part of the request hash), not the case's.
//! - `source_id` is the result's `id`, else `test<testIdx>/prompt<promptIdx>`.
//!
//! # Memory
//! `results.json` is one JSON document whose results array sits beside the config and
//! stats, with no line boundary to stream on, so it is parsed whole (serde_json) and its
//! results are then handed over one at a time. promptfoo itself keeps the same document
//! in memory when it writes it, so a file promptfoo could write is one evalflow can read.
//!
//! # Errors
//! A file that is not JSON or has no `results.results` array names the file; a result
//! without a prompt names its position and the field.

use std::path::Path;

use serde_json::{Value, json};

use super::{
    ImportError, ImportedScore, Options, Provenance, Record, RecordIter, Request, as_text, bad,
    bad_file,
};

/// Opens a results file (parsed whole; see the module doc).
///
/// # Errors
/// The file is unreadable, not JSON, or has no results.
pub fn open(path: &Path, opts: &Options) -> Result<RecordIter, ImportError> {
    let bytes = std::fs::read(path).map_err(|e| bad_file(path, e))?;
    let mut doc: Value =
        serde_json::from_slice(&bytes).map_err(|e| bad_file(path, format!("not JSON: {e}")))?;
    drop(bytes);
    let results = match doc.pointer_mut("/results/results") {
        Some(Value::Array(a)) => std::mem::take(a),
        _ => {
            return Err(bad_file(
                path,
                "no results.results array: not a promptfoo results file",
            ));
        }
    };
    let providers = doc
        .pointer("/config/providers")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let test = doc
        .pointer("/config/description")
        .and_then(Value::as_str)
        .map(String::from);
    let file = path.to_path_buf();
    let opts = opts.clone();
    Ok(Box::new(results.into_iter().enumerate().map(
        move |(k, r)| record(&file, k, &r, &providers, &test, &opts),
    )))
}

/// `openai:chat:gpt-4o` is (`openai`, `gpt-4o`); `echo` is (`echo`, `echo`).
fn split_provider(id: &str) -> (String, String) {
    let mut parts: Vec<&str> = id.split(':').collect();
    if parts.len() == 1 {
        return (id.to_string(), id.to_string());
    }
    let provider = parts.remove(0).to_string();
    if parts.len() > 1
        && ["chat", "completion", "messages", "responses", "assistant"].contains(&parts[0])
    {
        parts.remove(0);
    }
    (provider, parts.join(":"))
}

fn record(
    file: &Path,
    k: usize,
    r: &Value,
    providers: &[Value],
    test: &Option<String>,
    opts: &Options,
) -> Result<Record, ImportError> {
    let at = format!("results[{k}]");
    let pid = r
        .pointer("/provider/id")
        .or_else(|| r.get("provider"))
        .and_then(Value::as_str)
        .ok_or_else(|| bad(file, &at, "provider.id", "missing"))?;
    let (provider, model) = split_provider(pid);
    let raw = r
        .pointer("/prompt/raw")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(file, &at, "prompt.raw", "missing"))?;
    // A chat prompt is a case by its whole conversation, not its last user turn.
    let (system, input, case_key) = match serde_json::from_str::<Value>(raw) {
        Ok(Value::Array(msgs)) if msgs.iter().all(|m| m.get("role").is_some()) => {
            let (s, i) = super::chat_prompt(&msgs);
            let key = super::conversation_key(&msgs, Default::default());
            (s, i.unwrap_or_else(|| raw.to_string()), key)
        }
        _ => (None, raw.to_string(), None),
    };
    let cfg = providers
        .iter()
        .find(|p| p.get("id").and_then(Value::as_str) == Some(pid) || p.as_str() == Some(pid))
        .and_then(|p| p.get("config"))
        .cloned()
        .unwrap_or(Value::Null);
    let resp = r.get("response").filter(|x| x.is_object());
    let usage = resp.and_then(|x| x.get("tokenUsage"));
    // promptfoo's `error` also holds the reason an assertion failed (`failureReason` 1);
    // only `failureReason` 2 (ERROR) is a failed call.
    let error = r
        .get("error")
        .filter(|e| !e.is_null() && r.get("failureReason").and_then(Value::as_i64) == Some(2))
        .map(|e| as_text(e).unwrap_or_default());
    let response = resp.and_then(|x| x.get("output")).and_then(as_text);
    let vars = r.get("vars").or_else(|| r.pointer("/testCase/vars"));
    let expected = r
        .pointer("/testCase/assert/0/value")
        .and_then(Value::as_str)
        .map(String::from);
    let grading = r.get("gradingResult").filter(|g| g.is_object());
    let mut scores = vec![ImportedScore {
        scorer: "assert".into(),
        score: r.get("score").and_then(Value::as_f64),
        label: None,
        passed: r.get("success").and_then(Value::as_bool),
        detail: grading
            .and_then(|g| g.get("reason"))
            .or_else(|| r.get("error"))
            .filter(|x| !x.is_null())
            .map(|x| json!({"reason": x}).to_string()),
    }];
    if let Some(Value::Object(named)) = r.get("namedScores") {
        for (name, v) in named {
            scores.push(ImportedScore {
                scorer: name.clone(),
                score: v.as_f64(),
                ..ImportedScore::default()
            });
        }
    }
    let source_model = Some(model.clone());
    let model = opts.model.clone().unwrap_or(model);
    let meta = |f: &str| {
        r.pointer("/testCase/metadata")
            .and_then(|m| m.get(f))
            .or_else(|| vars.and_then(|v| v.get(f)))
            .and_then(as_text)
    };
    let source_id = r.get("id").and_then(as_text).or_else(|| {
        Some(format!(
            "test{}/prompt{}",
            r.get("testIdx").map(|x| x.to_string()).unwrap_or_default(),
            r.get("promptIdx")
                .map(|x| x.to_string())
                .unwrap_or_default()
        ))
    });
    let request = Request {
        request_key: json!({"provider": pid, "prompt": raw, "config": cfg}).to_string(),
        model: model.into(),
        source_model: source_model.map(Into::into),
        case_key: case_key.map(Into::into),
        system: system.map(Into::into),
        input: input.into(),
        max_tokens: cfg
            .get("max_tokens")
            .and_then(Value::as_u64)
            .and_then(|m| u32::try_from(m).ok()),
        temperature: cfg.get("temperature").and_then(Value::as_f64),
        ..Request::default()
    };
    Ok(Record {
        request: request.into(),
        capability: meta("capability"),
        provider: Some(provider),
        expected,
        test: meta("test").or_else(|| test.clone()),
        cluster: opts
            .cluster
            .as_ref()
            .and_then(|f| vars.and_then(|v| v.get(f)).and_then(as_text)),
        sample_idx: r
            .get("repeatIndex")
            .and_then(Value::as_i64)
            .and_then(|i| i32::try_from(i).ok()),
        response,
        finish_reason: resp
            .and_then(|x| x.get("finishReason"))
            .and_then(Value::as_str)
            .map(String::from),
        prompt_tokens: usage.and_then(|u| u.get("prompt")).and_then(Value::as_i64),
        completion_tokens: usage
            .and_then(|u| u.get("completion"))
            .and_then(Value::as_i64),
        error,
        latency_ms: r.get("latencyMs").and_then(Value::as_f64),
        source: Provenance {
            format: "promptfoo",
            file: file.display().to_string().into(),
            id: source_id,
        },
        scores,
        ..Record::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_ids_split_into_provider_and_model() {
        assert_eq!(
            split_provider("openai:chat:gpt-4o"),
            ("openai".into(), "gpt-4o".into())
        );
        assert_eq!(
            split_provider("openai:gpt-4o"),
            ("openai".into(), "gpt-4o".into())
        );
        assert_eq!(
            split_provider("ollama:chat:llama3:8b"),
            ("ollama".into(), "llama3:8b".into())
        );
        assert_eq!(split_provider("echo"), ("echo".into(), "echo".into()));
    }
}
