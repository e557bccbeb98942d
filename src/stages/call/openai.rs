//! The OpenAI-compatible chat completions wire format (OpenAI, vLLM, llama.cpp server,
//! Ollama, DeepSeek and the like): request body and response parsing.

use serde_json::{Map, Value, json};

use super::{CallRequest, Parsed};
use crate::config::ModelConfig;

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
    if let Some(p) = parse_typed(bytes) {
        return Ok(p);
    }
    let v: Value = serde_json::from_slice(bytes).map_err(|e| format!("malformed JSON: {e}"))?;
    parse_value(&v)
}

/// A struct read only from a JSON object: a derived struct would also take an array of its
/// fields in order, which the `Value` path rejects. (A flattened `IgnoredAny` field did the
/// same, but made serde buffer every key the struct does not read, such as the response's
/// `id` and `model`: a third of an import's response parse.)
pub(crate) struct MapOnly<T>(pub(crate) T);

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for MapOnly<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for V<T> {
            type Value = MapOnly<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<Self::Value, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(MapOnly)
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// What [`parse_value`] reads of a response, as types: deserialised straight from the text,
/// the keys it does not read skipped, with no `Value` tree built; each struct is read only
/// from an object ([`MapOnly`]).
#[derive(serde::Deserialize)]
pub(crate) struct TypedResponse {
    choices: Vec<MapOnly<TypedChoice>>,
    #[serde(default)]
    usage: Option<MapOnly<TypedUsage>>,
}

#[derive(serde::Deserialize)]
struct TypedChoice {
    message: MapOnly<TypedMessage>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(serde::Deserialize)]
struct TypedMessage {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    reasoning: Option<String>,
}

#[derive(serde::Deserialize)]
struct TypedUsage {
    #[serde(default)]
    prompt_tokens: Option<i64>,
    #[serde(default)]
    completion_tokens: Option<i64>,
    #[serde(default)]
    completion_tokens_details: Option<MapOnly<TypedDetails>>,
}

#[derive(serde::Deserialize)]
struct TypedDetails {
    #[serde(default)]
    reasoning_tokens: Option<i64>,
}

/// [`parse`] of a well-formed body, in a fraction of the time: `None` whenever the body
/// strays from the expected types in any way (a non-string content, a fractional token
/// count, a duplicate key, no choice...), and the caller then takes the `Value` path, which
/// gives the same result or the precise error. Where both succeed they agree field by field.
pub fn parse_typed(bytes: &[u8]) -> Option<Parsed> {
    parsed_of(serde_json::from_slice(bytes).ok()?)
}

/// A response body read as types ([`parse_typed`]'s first step), for a reader that reads it
/// within a larger document (an imported line); `None` where [`parse_typed`] declines after
/// reading it (no choice).
pub(crate) fn parsed_of(MapOnly(r): MapOnly<TypedResponse>) -> Option<Parsed> {
    let MapOnly(choice) = r.choices.into_iter().next()?;
    let MapOnly(m) = choice.message;
    let usage = r.usage.map(|MapOnly(u)| u);
    Some(Parsed {
        content: m.content.unwrap_or_default(),
        finish_reason: choice.finish_reason,
        prompt_tokens: usage.as_ref().and_then(|u| u.prompt_tokens),
        completion_tokens: usage.as_ref().and_then(|u| u.completion_tokens),
        reasoning_tokens: usage
            .as_ref()
            .and_then(|u| u.completion_tokens_details.as_ref())
            .and_then(|MapOnly(d)| d.reasoning_tokens),
        reasoning_chars: m
            .reasoning_content
            .or(m.reasoning)
            .map(|r| r.chars().count() as i64),
    })
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

    /// The typed path gives what the `Value` path gives, or steps aside.
    #[test]
    fn typed_parse_agrees_with_the_value_path_or_declines() {
        let value = |b: &str| parse_value(&serde_json::from_str(b).unwrap());
        let agree = [
            r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",
                "content":"Positive.\nThe \"room\" \u00e9"},"finish_reason":"stop","logprobs":null}],"usage":{"prompt_tokens":65,
                "completion_tokens":46,"total_tokens":111}}"#,
            r#"{"choices":[{"message":{"content":null,"reasoning":"abc"},"finish_reason":null}]}"#,
            r#"{"choices":[{"message":{"content":"","reasoning_content":null,"reasoning":"\u4f60\u597d"}},{"message":{}}],"usage":null}"#,
            r#"{"choices":[{"message":{"content":"a"}}],"usage":{"completion_tokens_details":{"reasoning_tokens":-3}}}"#,
        ];
        for b in agree {
            let typed = parse_typed(b.as_bytes()).unwrap_or_else(|| panic!("typed declined {b}"));
            assert_eq!(Ok(typed), value(b), "{b}");
            assert_eq!(parse(b.as_bytes()), value(b), "{b}");
        }
        // Each strays from the types somewhere: the typed path declines, and `parse` gives
        // the `Value` path's answer (a value or the error).
        let decline = [
            r#"{"choices":[{"message":{"content":5}}]}"#,
            r#"{"choices":[{"message":{"content":"a"},"finish_reason":7}]}"#,
            r#"{"choices":[{"message":{"content":"a"}}],"usage":{"prompt_tokens":5.0}}"#,
            r#"{"choices":[{"message":{"content":"a"}}],"usage":[5,7]}"#,
            r#"{"choices":[[{"content":"a"},"stop"]]}"#,
            r#"{"choices":[{"message":["a"]}]}"#,
            r#"{"choices":[{"message":{"content":"a","content":"b"}}]}"#,
            r#"{"choices":[]}"#,
            r#"[[{"message":{"content":"a"}}]]"#,
        ];
        for b in decline {
            assert_eq!(parse_typed(b.as_bytes()), None, "{b}");
            assert_eq!(parse(b.as_bytes()), value(b), "{b}");
        }
    }
}
