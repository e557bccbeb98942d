//! The `rephrase` perturbation: a model writes paraphrases of a test's base cases. An INV
//! test over rephrasings checks that the model under test answers the same question the
//! same way however it is worded.
//!
//! The requests go through the call stage itself, as the judge's do: they form a nested
//! run under `<root>/rephrase/<key>/` (one per model, prompt and sample count), whose
//! `cases` are the prompts, one per distinct base text of a test, each asked `n_perturb`
//! times (the nested model's `samples`). So rephrasing is resumable and exactly-once like
//! any call, and goes through the provider's batch interface when the model says `batch`.
//!
//! Reproducibility is the rephrase model's: with `temperature = 0` (or a server that
//! honours a seed in `params`) the same suite gives the same cases.

use std::collections::HashMap;
use std::sync::Arc;

use super::content_hash;
use crate::pipeline::{ModelConfig, PerturbSpec};
use crate::query::{QueryError, new_context};
use crate::schema::{Case, Table};
use crate::stages::call::{self, CallError, Provider, request_hash};
use crate::storage::RunStore;

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

/// The instruction of a `rephrase` spec: its `prompt`, else [`DEFAULT_PROMPT`].
pub fn prompt_of(spec: &PerturbSpec) -> &str {
    match spec {
        PerturbSpec::Table {
            prompt: Some(p), ..
        } => p.as_str(),
        _ => DEFAULT_PROMPT,
    }
}

/// One sample's reply as its calls row has it: `(error, response)`.
pub type Reply = (Option<String>, Option<String>);

/// The distinct paraphrases of `text` that differ from it, in sample order.
///
/// # Errors
/// The samples' error messages when every sample failed.
pub fn variants(text: &str, replies: &[Reply]) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    let mut errors = Vec::new();
    for r in replies {
        match r {
            (Some(e), _) => errors.push(e.clone()),
            (None, Some(resp)) => {
                let v = clean(resp);
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

/// The nested run of one model, prompt and number of samples.
#[derive(Debug, Clone)]
pub struct Group {
    /// `<root>/rephrase/<key>`: the key hashes the request (model, system prompt, prompt,
    /// max_tokens, temperature, params) and the sample count, so another prompt or model
    /// never reuses these replies, and batch or not does.
    pub store: RunStore,
    /// The rephrase model as the nested call stage runs it.
    pub model: ModelConfig,
    prompt: String,
}

impl Group {
    /// The nested run of `model` asking `prompt` `n` times a text under `root`; `batch`
    /// (`--batch`) sends it through the batch interface even when the model does not say so.
    pub fn new(root: &RunStore, model: &ModelConfig, prompt: &str, n: usize, batch: bool) -> Self {
        let rh = request_hash(model, model.system_prompt.as_deref(), prompt);
        let key = content_hash(&[&rh, &n.to_string()]);
        let model = ModelConfig {
            samples: u32::try_from(n).unwrap_or(u32::MAX),
            // The case input is the whole prompt, as the paraphrase was always asked.
            prompt_template: None,
            // A failed paraphrase cost nothing: a later generate asks it again.
            retry_errors: true,
            batch: model.batch || batch,
            batch_no_wait: false,
            ..model.clone()
        };
        Self {
            store: root.child(&format!("rephrase/{key}")),
            model,
            prompt: prompt.to_string(),
        }
    }

    /// The nested case id of a base text in a test: a text asked twice in a test is asked
    /// once, and never shares its replies with another test.
    pub fn case_id(test: &str, text: &str) -> String {
        content_hash(&["rephrase", test, text])
    }

    /// The nested case that asks for the paraphrases of `text` in `test`.
    pub fn case(&self, test: &str, text: &str) -> Case {
        let id = Self::case_id(test, text);
        Case {
            case_id: id.clone(),
            suite: "rephrase".into(),
            test: test.to_string(),
            capability: "rephrase".into(),
            test_type: "MFT".into(),
            template_id: "rephrase".into(),
            group_id: id,
            role: "single".into(),
            input: self.prompt.replace("{text}", text),
            expected: None,
            expectation: None,
            tolerance: None,
            perturbation: None,
        }
    }

    /// Sends the requests not yet answered through the call stage (synchronously, or in
    /// batches, waiting for them).
    ///
    /// # Errors
    /// The nested call stage's errors (storage, journal, batch); a failed call is a row.
    pub async fn ask(&self, provider: Arc<dyn Provider>) -> Result<(), CallError> {
        call::run(&self.store, &self.model, provider).await?;
        Ok(())
    }

    /// One test's replies, by nested case id, in sample order (a sample without a row is
    /// an error). Memory holds the test's replies only.
    ///
    /// # Errors
    /// A failed read of the nested run.
    pub async fn replies(&self, test: &str) -> Result<HashMap<String, Vec<Reply>>, CallError> {
        let ctx = new_context();
        crate::query::register_tables(&ctx, &self.store, "", &[Table::Cases, Table::Calls])
            .await
            .map_err(query_err)?;
        let sql = format!(
            "SELECT case_id, sample_idx, error, response FROM calls \
             WHERE case_id IN (SELECT case_id FROM cases WHERE test = '{}')",
            test.replace('\'', "''")
        );
        let rows = crate::query::text_rows(&ctx, &sql)
            .await
            .map_err(query_err)?;
        let n = self.model.samples as usize;
        let mut out: HashMap<String, Vec<Reply>> = HashMap::new();
        for mut r in rows {
            let response = r.pop().flatten();
            let error = r.pop().flatten();
            let k: Option<usize> = r.pop().flatten().and_then(|k| k.parse().ok());
            let (Some(id), Some(k)) = (r.pop().flatten(), k) else {
                continue;
            };
            let slots = out
                .entry(id)
                .or_insert_with(|| vec![(Some("no answer recorded".into()), None); n]);
            if let Some(slot) = slots.get_mut(k) {
                *slot = (error, response);
            }
        }
        Ok(out)
    }
}

/// A query failure stays a query failure (a memory refusal exits 2 naming the limit).
fn query_err(e: QueryError) -> CallError {
    match e {
        QueryError::Storage(s) => CallError::Storage(s),
        other => CallError::Query(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_keep_distinct_paraphrases_in_sample_order() {
        let ok = |s: &str| (None, Some(s.to_string()));
        let got = variants(
            "Hi.",
            &[
                ok("\"Hello.\""),
                ok("Hi."),
                ok("Paraphrase: Hello."),
                ok("Hey."),
            ],
        );
        assert_eq!(got, Ok(vec!["Hello.".to_string(), "Hey.".to_string()]));
        let failed = (Some("HTTP 500: boom".to_string()), None);
        assert_eq!(
            variants("Hi.", &[failed.clone(), (None, None)]),
            Err("HTTP 500: boom; empty answer".to_string())
        );
        assert_eq!(
            variants("Hi.", &[failed, ok("Hey.")]),
            Ok(vec!["Hey.".into()])
        );
        // Only answers equal to the text: no variant, and no error.
        assert_eq!(variants("Hi.", &[ok(" Hi. ")]), Ok(vec![]));
    }

    #[test]
    fn a_group_is_keyed_by_request_and_samples_not_by_batch() {
        let root = RunStore::open("memory://rephrase-group-key/run").unwrap();
        let m: ModelConfig = toml::from_str("provider = \"openai\"\nname = \"r\"").unwrap();
        let a = Group::new(&root, &m, DEFAULT_PROMPT, 2, false);
        let b = Group::new(&root, &m, DEFAULT_PROMPT, 2, true);
        assert_eq!(a.store.display(), b.store.display());
        assert!(b.model.batch && !a.model.batch);
        assert_eq!(
            (a.model.samples, a.model.prompt_template.as_deref()),
            (2, None)
        );
        let c = Group::new(&root, &m, DEFAULT_PROMPT, 3, false);
        let d = Group::new(&root, &m, "Say it again: {text}", 2, false);
        assert_ne!(a.store.display(), c.store.display());
        assert_ne!(a.store.display(), d.store.display());
        assert_eq!(d.case("t", "Hi.").input, "Say it again: Hi.");
        assert_ne!(Group::case_id("t", "Hi."), Group::case_id("u", "Hi."));
    }
}
