//! The configuration types the stages read and `pipeline.rs` parses: the model (`[model]`,
//! `[judge]`), the judge's checklist (`[score.judge]`) and user scorer definitions
//! ([`scorer`]). A leaf module: the stages that take them and the pipeline parser that fills
//! them do not import each other through it.

pub mod scorer;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Provider names accepted in `[model] provider`.
pub const KNOWN_PROVIDERS: &[&str] = &["builtin:vader", "openai", "anthropic"];

/// `[model]` (and `[judge]`): the model under test. See DESIGN.md, "Pipeline file".
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// `openai` (any OpenAI-compatible server), `anthropic`, or `builtin:vader`.
    pub provider: String,
    pub base_url: Option<String>,
    /// The model name sent to the server.
    pub name: String,
    /// The NAME of the environment variable holding the key; the key itself never appears.
    pub api_key_env: Option<String>,
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// K samples per case.
    #[serde(default = "default_samples")]
    pub samples: u32,
    pub max_tokens: Option<u32>,
    /// Omitted means the server's default; never changed silently.
    pub temperature: Option<f64>,
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u32>,
    /// Per-request timeout in seconds.
    #[serde(default = "default_timeout")]
    pub timeout_secs: f64,
    #[serde(default = "default_retries")]
    pub max_retries: u32,
    /// A request that has waited this many times the 95th percentile latency of this
    /// model's completed requests of its size is abandoned and retried as a timeout (at
    /// least `hang_floor_secs`, at most `timeout_secs`), so hung requests cannot hold the
    /// concurrency; 0 turns the adaptive deadline off (stages/call/deadline.rs).
    #[serde(default = "default_hang_factor")]
    pub hang_factor: f64,
    /// The shortest adaptive deadline, in seconds.
    #[serde(default = "default_hang_floor")]
    pub hang_floor_secs: f64,
    /// Retry once at double max_tokens when the answer is empty with finish_reason `length`.
    #[serde(default)]
    pub retry_empty_length: bool,
    /// Extra HTTP headers (values must not be secrets; use `api_key_env`).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Extra JSON body parameters merged into each request.
    #[serde(default)]
    pub params: BTreeMap<String, serde_json::Value>,
    pub system_prompt: Option<String>,
    /// How a case's input becomes the user message; `{input}` is replaced.
    pub prompt_template: Option<String>,
    /// Send this model's requests through the provider's batch interface (OpenAI's Batch
    /// API, Anthropic's Message Batches): half the price, results within 24 hours
    /// (stages/call/batch/). `--batch` sets it for one command.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub batch: bool,
    /// Batch mode: most requests in one batch (default and ceiling 50,000, OpenAI's limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_max_requests: Option<u64>,
    /// Dollars per million tokens, for the cost in the manifest (batch rows at half).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price: Option<Price>,
    /// `--no-wait`, never read from a file: a batch-mode call submits its batches and
    /// returns; the next command on the root collects them.
    #[serde(skip)]
    pub batch_no_wait: bool,
    /// `--retry-errors`, never read from a file: the calls of this model whose rows are
    /// provider errors are sent again, in place (stages/call/retry.rs). A judge's model
    /// carries it into the judge's nested run.
    #[serde(skip)]
    pub retry_errors: bool,
}

impl ModelConfig {
    /// Whether this provider sends requests over HTTP (and a key, when `api_key_env` names one).
    pub fn is_http(&self) -> bool {
        self.provider != "builtin:vader"
    }

    /// The first value a real API would refuse, as `(field, message)`: checked when the
    /// pipeline is read, so nothing is generated or paid for before it fails. The key's
    /// variable is checked apart ([`ModelConfig::key_problem`]): it depends on the shell.
    pub fn problem(&self) -> Option<(&'static str, String)> {
        if self.name.trim().is_empty() {
            return Some((
                "name",
                "must not be empty (the model name sent to the server)".into(),
            ));
        }
        if !(self.timeout_secs.is_finite() && self.timeout_secs > 0.0) {
            return Some((
                "timeout_secs",
                format!("must be more than 0 seconds, not {}", self.timeout_secs),
            ));
        }
        if self.max_tokens == Some(0) {
            return Some(("max_tokens", "must be at least 1".into()));
        }
        if !self.is_http() {
            return None;
        }
        if let Some(url) = &self.base_url {
            match url::Url::parse(url) {
                Ok(u) if matches!(u.scheme(), "http" | "https") => {}
                Ok(u) => {
                    let msg = format!("`{url}` is not an http(s) URL (scheme `{}`)", u.scheme());
                    return Some(("base_url", msg));
                }
                Err(e) => return Some(("base_url", format!("`{url}` is not a URL: {e}"))),
            }
        }
        if self.provider == "anthropic" && self.max_tokens.is_none() {
            return Some((
                "max_tokens",
                "the Anthropic Messages API requires max_tokens".into(),
            ));
        }
        let top = if self.provider == "anthropic" {
            1.0
        } else {
            2.0
        };
        if let Some(t) = self.temperature
            && !(0.0..=top).contains(&t)
        {
            let msg = format!(
                "{t} is outside 0..={top}, the range the {} API accepts",
                self.provider
            );
            return Some(("temperature", msg));
        }
        None
    }

    /// The key's variable, when this provider sends a key and the variable is unset or empty:
    /// the message names the variable, never a value. An omitted `api_key_env` sends no key.
    pub fn key_problem(&self) -> Option<String> {
        let var = self.api_key_env.as_deref().filter(|_| self.is_http())?;
        match std::env::var(var) {
            Ok(v) if !v.is_empty() => None,
            _ => Some(format!(
                "environment variable {var} is not set (it holds the API key)"
            )),
        }
    }
}

/// `[model] price = { input_per_mtok = 0.15, output_per_mtok = 0.60 }`.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Price {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
}

fn default_concurrency() -> usize {
    16
}
fn default_samples() -> u32 {
    1
}
fn default_timeout() -> f64 {
    60.0
}
fn default_hang_factor() -> f64 {
    5.0
}
fn default_hang_floor() -> f64 {
    0.25
}
fn default_retries() -> u32 {
    5
}

/// `[score.judge]`: a checklist of atomic YES/NO questions for the judge scorer.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JudgeChecklist {
    /// Question ids and texts, in order; the answers vector follows this order.
    pub questions: Vec<JudgeQuestion>,
    /// Extra instructions placed before the questions.
    pub instructions: Option<String>,
    /// A label of the user's that makes a new judge version (and so a new scores folder):
    /// for a change the version cannot see, such as another endpoint serving the same model.
    /// Unset, the version is what it was before this key existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// One checklist question.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JudgeQuestion {
    pub id: String,
    pub text: String,
}

/// `file:line`, or `file` when the line is not known (0): never "nope.toml:0".
pub fn at(file: &str, line: usize) -> String {
    if line == 0 {
        file.to_string()
    } else {
        format!("{file}:{line}")
    }
}

/// A scorer's identity: its name and a version that changes whenever its logic or cue
/// lists change.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ScorerId {
    pub name: String,
    pub version: String,
}

impl ScorerId {
    /// `<name>@<version>`.
    pub fn tag(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }

    /// The folder under the run root: `scores/<name>@<version>`.
    pub fn dir(&self) -> String {
        format!("scores/{}", self.tag())
    }

    /// Parses `name@version`.
    pub fn parse(tag: &str) -> Option<ScorerId> {
        let (n, v) = tag.split_once('@')?;
        Some(ScorerId {
            name: n.to_string(),
            version: v.to_string(),
        })
    }
}

/// A whole number from the environment variable `name` (the `EVALFLOW_*` tuning and test
/// knobs), `None` when it is unset or not a number.
pub fn env_number(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// [`env_number`], when it is above 0 (a count of rows, seconds or labels).
pub fn env_count(name: &str) -> Option<u64> {
    env_number(name).filter(|n| *n > 0)
}
