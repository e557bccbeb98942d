//! The OpenAI-compatible chat completions wire format (OpenAI, vLLM, llama.cpp server,
//! Ollama, DeepSeek and the like): request body and response parsing.

use serde_json::{Map, Value, json};

use super::CallRequest;
use super::http::Parsed;
use crate::pipeline::ModelConfig;

/// The path under `base_url`.
pub const PATH: &str = "/chat/completions";

/// The request body: `params` first, then the keys evalflow owns, so a stray `params.model`
/// can never change what the row says was asked. `temperature` is sent only when configured.
pub fn body(model: &ModelConfig, req: &CallRequest, max_tokens: Option<u32>) -> Value {
    let mut m: Map<String, Value> = model
        .params
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut messages = Vec::with_capacity(2);
    if let Some(s) = &req.system {
        messages.push(json!({"role": "system", "content": s}));
    }
    messages.push(json!({"role": "user", "content": req.prompt}));
    m.insert("model".into(), json!(model.name));
    m.insert("messages".into(), Value::Array(messages));
    if let Some(mt) = max_tokens {
        m.insert("max_tokens".into(), json!(mt));
    }
    if let Some(t) = req.temperature {
        m.insert("temperature".into(), json!(t));
    }
    Value::Object(m)
}

/// Parses a 2xx body.
///
/// # Errors
/// `malformed JSON: ...` when the body is not JSON or has no `choices[0].message`.
pub fn parse(bytes: &[u8]) -> Result<Parsed, String> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| format!("malformed JSON: {e}"))?;
    parse_value(&v)
}

/// [`parse`] of a body already parsed as JSON (an imported record's `response`).
///
/// # Errors
/// As [`parse`], for a body with no `choices[0].message`.
pub fn parse_value(v: &Value) -> Result<Parsed, String> {
    let choice = v
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| "malformed JSON: no choices[0] in the response".to_string())?;
    let msg = choice
        .get("message")
        .filter(|m| m.is_object())
        .ok_or_else(|| "malformed JSON: no choices[0].message in the response".to_string())?;
    let content = match msg.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(other) => return Err(format!("malformed JSON: message.content is {other}")),
    };
    // DeepSeek and SiliconFlow call it reasoning_content; vLLM and OpenRouter `reasoning`.
    let reasoning_chars = ["reasoning_content", "reasoning"]
        .iter()
        .find_map(|k| msg.get(*k).and_then(Value::as_str))
        .map(|r| r.chars().count() as i64);
    let usage = v.get("usage");
    let int = |path: &[&str]| -> Option<i64> {
        let mut cur = usage?;
        for p in path {
            cur = cur.get(*p)?;
        }
        cur.as_i64()
    };
    Ok(Parsed {
        content,
        finish_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(String::from),
        prompt_tokens: int(&["prompt_tokens"]),
        completion_tokens: int(&["completion_tokens"]),
        reasoning_tokens: int(&["completion_tokens_details", "reasoning_tokens"]),
        reasoning_chars,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_reasoning_and_usage() {
        let p = parse(br#"{"choices":[{"message":{"content":"","reasoning_content":"abc"},"finish_reason":"length"}],
            "usage":{"prompt_tokens":5,"completion_tokens":600,"completion_tokens_details":{"reasoning_tokens":600}}}"#).unwrap();
        assert_eq!(p.content, "");
        assert_eq!(p.finish_reason.as_deref(), Some("length"));
        assert_eq!(p.reasoning_tokens, Some(600));
        assert_eq!(p.reasoning_chars, Some(3));
        assert_eq!(p.prompt_tokens, Some(5));
        assert!(
            parse(b"{\"choices\":[")
                .unwrap_err()
                .starts_with("malformed JSON")
        );
        assert!(parse(b"{}").unwrap_err().starts_with("malformed JSON"));
    }
}
