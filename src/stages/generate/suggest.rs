//! Masked-slot suggestions: CheckList asks a masked language model to fill "I really
//! {mask} the flight." and the user sorts the answers into lexicons. Here a generative
//! model does it through the call stage's [`Provider`].

use crate::pipeline::ModelConfig;
use crate::stages::call::{CallRequest, Provider, call_id, request_hash};

/// The mask placeholder in a suggestion sentence.
pub const MASK: &str = "{mask}";

/// The instruction sent to the model.
pub fn prompt(sentence: &str, n: usize) -> String {
    format!(
        "In the sentence below, {MASK} marks a missing word or short phrase. List {n} different \
         candidates that fit it naturally, from most to least likely, one per line, with no \
         numbering and no explanation.\n\nSentence: {sentence}"
    )
}

/// Parses a model's list: one candidate a line, numbering / bullets / quotes removed,
/// duplicates dropped (case-insensitive), at most `n`.
pub fn parse(answer: &str, n: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in answer.lines().flat_map(|l| l.split(',')) {
        let s = line
            .trim()
            .trim_start_matches(|c: char| c.is_ascii_digit() || "-*•.)".contains(c))
            .trim()
            .trim_matches(|c| c == '"' || c == '\'' || c == '`')
            .trim();
        if s.is_empty() || s.len() > 60 || s.ends_with(':') {
            continue;
        }
        if !out.iter().any(|o| o.eq_ignore_ascii_case(s)) {
            out.push(s.to_string());
        }
        if out.len() == n {
            break;
        }
    }
    out
}

/// Asks `provider` for up to `n` fill-ins of the `{mask}` in `sentence`.
///
/// # Errors
/// A message when the sentence has no `{mask}`, or the provider failed.
pub async fn suggest(
    provider: &dyn Provider,
    model: &ModelConfig,
    sentence: &str,
    n: usize,
) -> Result<Vec<String>, String> {
    if !sentence.contains(MASK) {
        return Err(format!(
            "the sentence has no {MASK} to fill: \"{sentence}\""
        ));
    }
    let prompt = prompt(sentence, n);
    let rh = request_hash(model, model.system_prompt.as_deref(), &prompt);
    let req = CallRequest {
        call_id: call_id(sentence, &model.name, 0, &rh),
        case_id: String::new(),
        input: sentence.to_string(),
        prompt,
        system: model.system_prompt.clone(),
        sample_idx: 0,
        max_tokens: model.max_tokens,
        temperature: model.temperature,
        request_hash: rh,
        prior_attempts: 0,
    };
    let r = provider.complete(&req).await;
    if let Some(e) = r.error {
        return Err(e);
    }
    Ok(parse(r.response.as_deref().unwrap_or(""), n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_numbered_and_bulleted_lists() {
        let a = "Here are candidates:\n1. enjoyed\n2) liked\n- loved\n* \"regret\"\nliked";
        assert_eq!(parse(a, 10), vec!["enjoyed", "liked", "loved", "regret"]);
        assert_eq!(parse("a, b, c", 2), vec!["a", "b"]);
    }
}
