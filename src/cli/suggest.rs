//! `evalflow suggest "<sentence with {mask}>" --pipeline P [--n N] [--model WHICH]`.

use std::path::PathBuf;

use super::CliError;
use crate::pipeline::Pipeline;
use crate::runner::RunError;
use crate::stages::call;
use crate::stages::generate::suggest;

#[derive(Debug, clap::Args)]
pub struct SuggestArgs {
    /// A sentence with one `{mask}` slot, e.g. "I really {mask} the flight."
    pub sentence: String,
    /// The pipeline whose model answers.
    #[arg(long)]
    pub pipeline: PathBuf,
    /// How many candidates to ask for.
    #[arg(long, default_value_t = 10)]
    pub n: usize,
    /// Which model: `rephrase`, `judge` or `model` (default: the first of those defined
    /// that is a generative model).
    #[arg(long)]
    pub model: Option<String>,
}

/// Prints one candidate a line, then the filled sentences on stderr for a quick look.
pub async fn run(a: SuggestArgs) -> Result<(), CliError> {
    let p = Pipeline::load(&a.pipeline).map_err(RunError::from)?;
    let model = match a.model.as_deref() {
        Some("rephrase") => p.rephrase.as_ref(),
        Some("judge") => p.judge.as_ref(),
        Some("model") => Some(&p.model),
        Some(other) => {
            return Err(CliError::BadInput(format!(
                "--model: `{other}` is not one of rephrase, judge, model"
            )));
        }
        None => [p.rephrase.as_ref(), p.judge.as_ref(), Some(&p.model)]
            .into_iter()
            .flatten()
            .find(|m| !m.provider.starts_with("builtin:")),
    };
    let Some(model) = model.filter(|m| !m.provider.starts_with("builtin:")) else {
        return Err(CliError::BadInput(format!(
            "{}: no generative model to ask (builtin classifiers cannot suggest words): add a \
             [rephrase] or [judge] table, or use --model",
            a.pipeline.display()
        )));
    };
    let provider = call::build_provider(model).map_err(RunError::from)?;
    let words = suggest::suggest(provider.as_ref(), model, &a.sentence, a.n)
        .await
        .map_err(|e| {
            if a.sentence.contains(suggest::MASK) {
                CliError::Internal(format!("{}: {e}", model.name))
            } else {
                CliError::BadInput(e)
            }
        })?;
    for w in &words {
        println!("{w}");
    }
    for w in &words {
        eprintln!("  {}", a.sentence.replacen(suggest::MASK, w, 1));
    }
    Ok(())
}
