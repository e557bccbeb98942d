//! A request of the usual shape read as types, with no `Value` tree: the model, plain text
//! messages, `max_tokens` and `temperature`. Parsing a request into a `Value`, then writing
//! its keys from the tree, was a sixth of an import's CPU on a log of distinct requests.
//!
//! Anything else (another parameter, a message with parts or a name, a `null`, a key named
//! twice, a value out of range) declines, and the caller reads the request as a `Value`,
//! which gives the same [`ParsedRequest`] for the shapes read here (a test checks it) and the
//! precise error for the rest.

use std::borrow::Cow;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::Number;

use super::ParsedRequest;
use crate::import::Request;
use crate::stages::call::openai::MapOnly;

/// The request's fields; each present one must be of its type (`null` included: it is
/// not absent, and the `Value` path keeps it in the request's key).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Plain<'a> {
    #[serde(borrow)]
    messages: Vec<MapOnly<Message<'a>>>,
    #[serde(default, borrow, deserialize_with = "present")]
    model: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "present")]
    max_tokens: Option<Number>,
    #[serde(default, deserialize_with = "present")]
    temperature: Option<Number>,
}

/// A message of text: its role and its content, nothing else.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow)]
    content: Cow<'a, str>,
}

/// A field that is present must hold its type: `null` is refused, not read as absent.
fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

/// The [`ParsedRequest`] of `text` read as types, its case id computed for `test`; `None` for a
/// request of another shape (see the module documentation).
///
/// `last` is the request of the line before: a log sends a case to each model in turn, in
/// requests that differ only by their model, so when the case (system, input and case key)
/// is `last`'s, its texts and case id are taken from there, not copied and hashed again.
pub(super) fn request(text: &str, test: &str, last: Option<&Request>) -> Option<ParsedRequest> {
    let MapOnly(p) = serde_json::from_str::<MapOnly<Plain>>(text).ok()?;
    let max_tokens = match &p.max_tokens {
        None => None,
        Some(m) => Some(m.as_u64().filter(|&m| m <= i32::MAX as u64)? as u32),
    };
    let msgs: Vec<&Message> = p.messages.iter().map(|MapOnly(m)| m).collect();
    // The last system (or developer) message, the last user message.
    let (mut system, mut input) = (None, None);
    for m in &msgs {
        match &*m.role {
            "user" => input = Some(&*m.content),
            "system" | "developer" => system = Some(&*m.content),
            _ => {}
        }
    }
    let input = input?;
    let (key, case_key) = keys(&p, &msgs);
    let same_case = last.and_then(|l| match &l.case_id {
        Some((t, id))
            if **t == *test
                && *l.input == *input
                && l.system.as_deref() == system
                && l.case_key.as_deref() == case_key.as_deref() =>
        {
            Some((l, id))
        }
        _ => None,
    });
    let (system, input, case_key, case_id) = match same_case {
        Some((l, id)) => (
            l.system.clone(),
            l.input.clone(),
            l.case_key.clone(),
            id.clone(),
        ),
        None => {
            let case_id = crate::import::case_id(test, case_key.as_deref(), system, input);
            (
                system.map(Arc::from),
                Arc::from(input),
                case_key.map(Arc::from),
                case_id.into(),
            )
        }
    };
    Some(ParsedRequest {
        system,
        input,
        model: p.model.as_deref().map(Arc::from),
        hash: crate::stages::call::sha_prefix(&[&key], 32).into(),
        max_tokens,
        temperature: p.temperature.as_ref().and_then(Number::as_f64),
        case_key,
        case_id,
    })
}

/// The request's key and case key as [`crate::import::request_keys`] writes them from its
/// `Value`: keys sorted (`max_tokens`, `messages`, `model`, `temperature`; `content`,
/// `role`), no spaces, strings and numbers as serde_json writes them.
fn keys(p: &Plain, msgs: &[&Message]) -> (String, Option<String>) {
    // A string borrowed from the request had no escape there, so it holds no quote,
    // backslash or control character: serde_json would write it as it is, between quotes.
    let put_text = |out: &mut Vec<u8>, s: &Cow<str>| match s {
        Cow::Borrowed(b) => {
            out.push(b'"');
            out.extend_from_slice(b.as_bytes());
            out.push(b'"');
        }
        Cow::Owned(o) => serde_json::to_writer(out, o.as_str()).expect("a str serializes"),
    };
    let put = |out: &mut Vec<u8>, s: &str| serde_json::to_writer(out, s).expect("a str serializes");
    let num =
        |out: &mut Vec<u8>, n: &Number| serde_json::to_writer(out, n).expect("a number serializes");
    let mut messages = Vec::with_capacity(256);
    messages.push(b'[');
    for (i, m) in msgs.iter().enumerate() {
        if i > 0 {
            messages.push(b',');
        }
        messages.extend_from_slice(b"{\"content\":");
        put_text(&mut messages, &m.content);
        messages.extend_from_slice(b",\"role\":");
        put_text(&mut messages, &m.role);
        messages.push(b'}');
    }
    messages.push(b']');
    // The case's parameters (the model is the call's, not the case's).
    let mut params = Vec::new();
    for (name, v) in [
        ("max_tokens", &p.max_tokens),
        ("temperature", &p.temperature),
    ] {
        if let Some(v) = v {
            if !params.is_empty() {
                params.push(b',');
            }
            put(&mut params, name);
            params.push(b':');
            num(&mut params, v);
        }
    }
    let mut key = Vec::with_capacity(messages.len() + params.len() + 64);
    key.push(b'{');
    if let Some(m) = &p.max_tokens {
        key.extend_from_slice(b"\"max_tokens\":");
        num(&mut key, m);
        key.push(b',');
    }
    key.extend_from_slice(b"\"messages\":");
    key.extend_from_slice(&messages);
    if let Some(m) = &p.model {
        key.extend_from_slice(b",\"model\":");
        put_text(&mut key, m);
    }
    if let Some(t) = &p.temperature {
        key.extend_from_slice(b",\"temperature\":");
        num(&mut key, t);
    }
    key.push(b'}');
    let key = String::from_utf8(key).expect("serde_json writes UTF-8");
    let plain = params.is_empty()
        && match msgs {
            [u] => u.role == "user",
            [s, u] => matches!(&*s.role, "system" | "developer") && u.role == "user",
            _ => false,
        };
    if plain {
        return (key, None);
    }
    let mut case = Vec::with_capacity(messages.len() + params.len() + 32);
    case.extend_from_slice(b"request:{\"messages\":");
    case.extend_from_slice(&messages);
    case.extend_from_slice(b",\"params\":{");
    case.extend_from_slice(&params);
    case.extend_from_slice(b"}}");
    (
        key,
        Some(String::from_utf8(case).expect("serde_json writes UTF-8")),
    )
}
