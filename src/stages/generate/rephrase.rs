//! The `rephrase` perturbation: asks a model, through the call stage's [`Provider`], for
//! paraphrases of a base case. An INV test over rephrasings checks that the model under
//! test answers the same question the same way however it is worded.
//!
//! Reproducibility is the rephrase model's: with `temperature = 0` (or a server that
//! honours a seed in `params`) the same suite gives the same cases.

use crate::pipeline::ModelConfig;
use crate::stages::call::{CallRequest, Provider, call_id, request_hash};

/// The default instruction; `{text}` is replaced by the base case.
pub const DEFAULT_PROMPT: &str = "Rewrite the following text so that it says exactly the same thing \
with different words. Keep its meaning, tone, names and numbers. Reply with the rewritten text only.\n\n{text}";

/// Cleans a model's paraphrase: trims, drops a leading label and surrounding quotes.
pub fn clean(answer: &str) -> String {
    let mut s = answer.trim();
    for prefix in ["Rewritten text:", "Rephrased:", "Paraphrase:"] {
        if let Some(r) = s.strip_prefix(prefix) {
            s = r.trim();
        }
    }
    let quoted = s.len() >= 2
        && ((s.starts_with('"') && s.ends_with('"')) || (s.starts_with('\'') && s.ends_with('\'')));
    if quoted {
        s = &s[1..s.len() - 1];
    }
    s.trim().to_string()
}

/// Asks `provider` for `n` paraphrases of `text` (samples 0..n of one request), and keeps
/// the distinct ones that differ from `text`.
///
/// # Errors
/// The provider's error message when every sample failed.
pub async fn rephrase(
    provider: &dyn Provider,
    model: &ModelConfig,
    prompt: &str,
    text: &str,
    n: usize,
) -> Result<Vec<String>, String> {
    let prompt = prompt.replace("{text}", text);
    let rh = request_hash(model, model.system_prompt.as_deref(), &prompt);
    let reqs: Vec<CallRequest> = (0..n as i32)
        .map(|k| CallRequest {
            call_id: call_id(text, &model.name, k, &rh),
            case_id: String::new(),
            input: text.to_string(),
            prompt: prompt.clone(),
            system: model.system_prompt.clone(),
            sample_idx: k,
            max_tokens: model.max_tokens,
            temperature: model.temperature,
            request_hash: rh.clone(),
            prior_attempts: 0,
        })
        .collect();
    let results = futures::future::join_all(reqs.iter().map(|r| provider.complete(r))).await;
    let mut out: Vec<String> = Vec::new();
    let mut errors = Vec::new();
    for r in results {
        match (r.error, r.response) {
            (Some(e), _) => errors.push(e),
            (None, Some(resp)) => {
                let v = clean(&resp);
                if !v.is_empty() && v != text && !out.contains(&v) {
                    out.push(v);
                }
            }
            (None, None) => errors.push("empty answer".into()),
        }
    }
    if out.is_empty() && !errors.is_empty() {
        return Err(errors.join("; "));
    }
    Ok(out)
}
