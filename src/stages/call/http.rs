//! The HTTP providers: one client, two wire formats (OpenAI-compatible and Anthropic),
//! with the limits, timeouts and retries of a payments client.
//!
//! # Behavior
//! - Every failure becomes a [`CallResult`] with `error` set: HTTP errors keep their
//!   status, transport errors have none (`timeout after 30s`, `connection reset: ...`),
//!   an unparseable 2xx is `malformed JSON: ...` with its status.
//! - Retried: 408, 409, 429, 5xx, transport errors and malformed 2xx bodies, with full
//!   jitter exponential backoff that never waits less than `Retry-After`. Other 4xx
//!   (400, 401, 403 out of credit, 404) are final at the first attempt.
//! - An empty answer with `finish_reason = length` is retried once at double `max_tokens`
//!   when `retry_empty_length` is set; the row says so (`retried_for_budget`).
//! - The API key is read once, from the variable named by `api_key_env`, is sent as a
//!   sensitive header, and is scrubbed from any error text before it can reach a row.

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};

use super::deadline::{self, Deadlines};
use super::limits::{Limits, backoff, parse_retry_after};
use super::{CallError, CallRequest, CallResult, Provider, anthropic, openai};
use crate::config::ModelConfig;

/// Header carrying the request hash, so servers (and the mock) can log it.
pub const REQUEST_HASH_HEADER: &str = "x-evalflow-request-hash";
/// Header carrying the sample index.
pub const SAMPLE_IDX_HEADER: &str = "x-evalflow-sample-idx";
/// Header carrying the call id (one per case x model x sample).
pub const CALL_ID_HEADER: &str = "x-evalflow-call-id";

pub use super::Parsed;

/// Which wire format a provider speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    OpenAi,
    Anthropic,
}

/// An HTTP model provider.
pub struct HttpProvider {
    wire: Wire,
    client: reqwest::Client,
    /// Parsed once: parsing a URL per request (IDNA included) showed in the call profile.
    url: reqwest::Url,
    model: ModelConfig,
    limits: Limits,
    /// `timeout_secs`, shortened for requests far slower than the healthy ones.
    deadlines: Deadlines,
    /// The key, kept only to scrub it from error text.
    secret: Option<String>,
}

impl std::fmt::Debug for HttpProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpProvider")
            .field("wire", &self.wire)
            .field("url", &self.url.as_str())
            .finish_non_exhaustive()
    }
}

/// One attempt's outcome.
enum Attempt {
    Ok(u16, Parsed),
    /// A failure: status, message, whether to retry, Retry-After.
    Failed(Option<u16>, String, bool, Option<Duration>),
}

impl HttpProvider {
    /// Builds the provider, reading the key from the environment.
    ///
    /// # Errors
    /// [`CallError::Provider`] when `base_url` is missing, the key variable is unset, a
    /// header is invalid, or (Anthropic) `max_tokens` is not configured. Messages name the
    /// variable, never its value.
    pub fn build(wire: Wire, model: &ModelConfig) -> Result<Self, CallError> {
        let perr = |msg: String| CallError::Provider(model.provider.clone(), msg);
        let base = model
            .base_url
            .as_deref()
            .ok_or_else(|| perr("model.base_url is required for HTTP providers".into()))?;
        let secret = match &model.api_key_env {
            Some(var) => match std::env::var(var) {
                Ok(v) if !v.is_empty() => Some(v),
                _ => {
                    return Err(perr(format!(
                        "model.api_key_env: environment variable {var} is not set"
                    )));
                }
            },
            None => None,
        };
        if wire == Wire::Anthropic && model.max_tokens.is_none() {
            return Err(perr(
                "model.max_tokens: the Anthropic Messages API requires max_tokens".into(),
            ));
        }
        let mut headers = HeaderMap::new();
        headers.insert(
            reqwest::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if wire == Wire::Anthropic {
            headers.insert(
                "anthropic-version",
                HeaderValue::from_static(anthropic::VERSION),
            );
        }
        if let Some(key) = &secret {
            let (name, value) = match wire {
                Wire::OpenAi => ("authorization", format!("Bearer {key}")),
                Wire::Anthropic => ("x-api-key", key.clone()),
            };
            let mut v = HeaderValue::from_str(&value).map_err(|_| {
                perr(format!(
                    "model.api_key_env: the value of {} is not a valid header value",
                    model.api_key_env.as_deref().unwrap_or("")
                ))
            })?;
            v.set_sensitive(true);
            headers.insert(HeaderName::from_static(name), v);
        }
        for (k, v) in &model.headers {
            let name = HeaderName::from_bytes(k.as_bytes())
                .map_err(|e| perr(format!("model.headers.{k}: {e}")))?;
            let value =
                HeaderValue::from_str(v).map_err(|e| perr(format!("model.headers.{k}: {e}")))?;
            headers.insert(name, value);
        }
        let client = reqwest::Client::builder()
            .default_headers(headers)
            .pool_max_idle_per_host(model.concurrency.max(1))
            .pool_idle_timeout(Duration::from_secs(60))
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs_f64(
                model.timeout_secs.clamp(0.001, 30.0),
            ))
            .build()
            .map_err(|e| perr(format!("cannot build the HTTP client: {e}")))?;
        let path = match wire {
            Wire::OpenAi => openai::PATH,
            Wire::Anthropic => anthropic::PATH,
        };
        let url = format!("{}{}", base.trim_end_matches('/'), path);
        let url = reqwest::Url::parse(&url).map_err(|e| perr(format!("model.base_url: {e}")))?;
        Ok(Self {
            wire,
            client,
            url,
            model: model.clone(),
            limits: Limits::new(model.requests_per_minute, model.tokens_per_minute),
            deadlines: Deadlines::new(
                model.hang_factor,
                Duration::from_secs_f64(model.hang_floor_secs.max(0.0)),
                Duration::from_secs_f64(model.timeout_secs.max(0.001)),
            ),
            secret,
        })
    }

    fn scrub(&self, s: String) -> String {
        match &self.secret {
            Some(k) if s.contains(k.as_str()) => s.replace(k.as_str(), "[redacted]"),
            _ => s,
        }
    }

    async fn attempt(&self, req: &CallRequest, max_tokens: Option<u32>) -> Attempt {
        let body = match self.wire {
            Wire::OpenAi => openai::body(&self.model, req, max_tokens),
            Wire::Anthropic => anthropic::body(&self.model, req, max_tokens),
        };
        let send = async {
            let resp = self
                .client
                .post(self.url.clone())
                .header(REQUEST_HASH_HEADER, &req.request_hash)
                .header(SAMPLE_IDX_HEADER, req.sample_idx)
                .header(CALL_ID_HEADER, &req.call_id)
                .body(serde_json::to_vec(&body).expect("JSON body serialises"))
                .send()
                .await?;
            let status = resp.status().as_u16();
            let retry_after = resp
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(parse_retry_after);
            let bytes = resp.bytes().await?;
            Ok::<_, reqwest::Error>((status, retry_after, bytes))
        };
        let size = deadline::bucket(max_tokens);
        let started = std::time::Instant::now();
        tokio::pin!(send);
        // The deadline is re-read every 100 ms: the first requests of a run wait on
        // `timeout_secs` only until enough of them have completed to know the healthy latency.
        let sent = loop {
            let (limit, p95) = self.deadlines.limit(size);
            let waited = started.elapsed();
            if waited >= limit {
                break Err((limit, p95));
            }
            let wait = (limit - waited).min(Duration::from_millis(100));
            if let Ok(r) = tokio::time::timeout(wait, &mut send).await {
                break Ok(r);
            }
        };
        let (status, retry_after, bytes) = match sent {
            Err((limit, p95)) => {
                let msg = match p95 {
                    Some(p) => format!(
                        "timeout after {:.2}s (adaptive deadline: {} x the 95th percentile \
                         {:.3}s of completed requests, at least hang_floor_secs = {}; \
                         timeout_secs = {})",
                        limit.as_secs_f64(),
                        self.model.hang_factor,
                        p,
                        self.model.hang_floor_secs,
                        self.model.timeout_secs
                    ),
                    None => format!("timeout after {}s", self.model.timeout_secs),
                };
                return Attempt::Failed(None, msg, true, None);
            }
            Ok(Err(e)) => return Attempt::Failed(None, transport_error(&e), true, None),
            Ok(Ok(x)) => x,
        };
        if !(200..300).contains(&status) {
            let snippet: String = String::from_utf8_lossy(&bytes).chars().take(300).collect();
            let retry = matches!(status, 408 | 409 | 429) || status >= 500;
            return Attempt::Failed(
                Some(status),
                format!("HTTP {status}: {}", snippet.trim()),
                retry,
                retry_after,
            );
        }
        let parsed = match self.wire {
            Wire::OpenAi => openai::parse(&bytes),
            Wire::Anthropic => anthropic::parse(&bytes),
        };
        match parsed {
            Ok(p) => {
                self.deadlines.record(size, started.elapsed());
                Attempt::Ok(status, p)
            }
            Err(msg) => Attempt::Failed(Some(status), msg, true, None),
        }
    }

    fn estimate_tokens(&self, req: &CallRequest, max_tokens: Option<u32>) -> f64 {
        let chars = req.prompt.len() + req.system.as_ref().map_or(0, String::len);
        (chars as f64 / 4.0).ceil() + max_tokens.unwrap_or(256) as f64
    }
}

/// A transport error as row text: what happened, then reqwest's cause chain (which names
/// the URL but never headers).
fn transport_error(e: &reqwest::Error) -> String {
    let mut chain = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        chain.push_str(": ");
        chain.push_str(&s.to_string());
        src = s.source();
    }
    let lower = chain.to_lowercase();
    let kind = if e.is_connect() {
        "connection failed"
    } else if lower.contains("reset")
        || lower.contains("closed")
        || lower.contains("incomplete")
        || lower.contains("eof")
    {
        "connection reset"
    } else if e.is_timeout() {
        "timeout"
    } else {
        "transport error"
    };
    format!("{kind}: {chain}")
}

#[async_trait::async_trait]
impl Provider for HttpProvider {
    async fn complete(&self, req: &CallRequest) -> CallResult {
        let mut max_tokens = req.max_tokens;
        let mut attempts = 0i32;
        let mut retries = 0u32;
        let mut budget_retried = false;
        loop {
            attempts += 1;
            let est = self.estimate_tokens(req, max_tokens);
            self.limits.acquire(est).await;
            let outcome = self.attempt(req, max_tokens).await;
            match outcome {
                Attempt::Ok(status, p) => {
                    self.limits
                        .settle(
                            est,
                            match (p.prompt_tokens, p.completion_tokens) {
                                (None, None) => None,
                                (a, b) => Some((a.unwrap_or(0) + b.unwrap_or(0)) as f64),
                            },
                        )
                        .await;
                    let starved =
                        p.content.trim().is_empty() && p.finish_reason.as_deref() == Some("length");
                    if starved
                        && self.model.retry_empty_length
                        && !budget_retried
                        && let Some(mt) = max_tokens
                    {
                        budget_retried = true;
                        max_tokens = Some(mt.saturating_mul(2));
                        continue;
                    }
                    return CallResult {
                        response: Some(p.content),
                        response_score: None,
                        finish_reason: p.finish_reason,
                        prompt_tokens: p.prompt_tokens,
                        completion_tokens: p.completion_tokens,
                        reasoning_tokens: p.reasoning_tokens,
                        reasoning_chars: p.reasoning_chars,
                        http_status: Some(status as i32),
                        error: None,
                        attempts,
                        retried_for_budget: budget_retried.then_some(true),
                        max_tokens_used: max_tokens,
                    };
                }
                Attempt::Failed(status, msg, retry, retry_after) => {
                    self.limits.settle(est, Some(0.0)).await;
                    if retry && retries < self.model.max_retries {
                        retries += 1;
                        tokio::time::sleep(backoff(retries, retry_after)).await;
                        continue;
                    }
                    return CallResult {
                        http_status: status.map(i32::from),
                        error: Some(self.scrub(msg)),
                        attempts,
                        retried_for_budget: budget_retried.then_some(true),
                        max_tokens_used: max_tokens,
                        ..CallResult::default()
                    };
                }
            }
        }
    }
}
