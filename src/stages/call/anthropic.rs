//! The Anthropic Messages wire format: request body and response parsing.
//!
//! `stop_reason` is mapped onto the OpenAI vocabulary the validator reads:
//! `max_tokens` -> `length`, `end_turn` / `stop_sequence` -> `stop`, `tool_use` ->
//! `tool_calls`; anything else is kept as sent.

use serde_json::{Map, Value, json};

use super::{CallRequest, Parsed};
use crate::config::ModelConfig;

/// The path under `base_url`.
pub const PATH: &str = "/messages";
/// Sent unless `[model.headers]` names another.
pub const VERSION: &str = "2023-06-01";

/// The request body (`max_tokens` is required by the API; the provider refuses to build
/// without it rather than invent one).
pub fn body(model: &ModelConfig, req: &CallRequest, max_tokens: Option<u32>) -> Value {
    let mut m: Map<String, Value> = model
        .params
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    m.insert("model".into(), json!(model.name));
    m.insert(
        "messages".into(),
        json!([{"role": "user", "content": req.prompt}]),
    );
    if let Some(s) = &req.system {
        m.insert("system".into(), json!(s));
    }
    if let Some(mt) = max_tokens {
        m.insert("max_tokens".into(), json!(mt));
    }
    if let Some(t) = req.temperature {
        m.insert("temperature".into(), json!(t));
    }
    Value::Object(m)
}

/// Maps Anthropic's `stop_reason` to the OpenAI `finish_reason` vocabulary.
pub fn finish_reason(stop_reason: &str) -> String {
    match stop_reason {
        "max_tokens" => "length",
        "end_turn" | "stop_sequence" => "stop",
        "tool_use" => "tool_calls",
        other => other,
    }
    .to_string()
}

/// Parses a 2xx body: text blocks are the answer, thinking blocks count as reasoning.
///
/// # Errors
/// `malformed JSON: ...` when the body is not JSON or has no `content` array.
pub fn parse(bytes: &[u8]) -> Result<Parsed, String> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| format!("malformed JSON: {e}"))?;
    parse_value(&v)
}

/// [`parse`] of a message already read (a message batch's `succeeded` result).
///
/// # Errors
/// As [`parse`].
pub fn parse_value(v: &Value) -> Result<Parsed, String> {
    let blocks = v
        .get("content")
        .and_then(Value::as_array)
        .ok_or_else(|| "malformed JSON: no content array in the response".to_string())?;
    let mut content = String::new();
    let mut thinking: Option<i64> = None;
    for b in blocks {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => content.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
            Some("thinking") => {
                let n = b
                    .get("thinking")
                    .and_then(Value::as_str)
                    .map(|t| t.chars().count() as i64)
                    .unwrap_or(0);
                *thinking.get_or_insert(0) += n;
            }
            _ => {}
        }
    }
    let usage = v.get("usage");
    let int = |k: &str| usage.and_then(|u| u.get(k)).and_then(Value::as_i64);
    Ok(Parsed {
        content,
        finish_reason: v
            .get("stop_reason")
            .and_then(Value::as_str)
            .map(finish_reason),
        prompt_tokens: int("input_tokens"),
        completion_tokens: int("output_tokens"),
        reasoning_tokens: None,
        reasoning_chars: thinking,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_stop_reason_and_blocks() {
        let p = parse(
            br#"{"content":[{"type":"thinking","thinking":"hmm"},{"type":"text","text":"hi"}],
            "stop_reason":"max_tokens","usage":{"input_tokens":3,"output_tokens":9}}"#,
        )
        .unwrap();
        assert_eq!(p.content, "hi");
        assert_eq!(p.finish_reason.as_deref(), Some("length"));
        assert_eq!(p.reasoning_chars, Some(3));
        assert_eq!(p.completion_tokens, Some(9));
        assert_eq!(finish_reason("end_turn"), "stop");
    }
}
