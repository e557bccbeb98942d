//! The HTTP client both batch interfaces share: the model's base URL, key and headers, and
//! a send that retries what a retry can fix.
//!
//! # Behavior
//! - Each API call is retried on transport errors, 408, 409, 429 and 5xx (a poll that
//!   answers 500 is only a late poll), with the synchronous client's backoff, up to 8 times
//!   ([`Api::send`]); [`Api::send_once`] does not retry (a create, which a retry could
//!   make twice).
//! - The key is sent as a sensitive header and scrubbed from every error text.

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};

use super::BatchError;
use crate::config::ModelConfig;
use crate::stages::call::limits::{backoff, parse_retry_after};

/// The shared client.
pub struct Api {
    pub http: reqwest::Client,
    /// The base URL without a trailing `/`.
    pub base: String,
    secret: Option<String>,
}

/// One failed attempt: whether to retry, Retry-After, status, message.
type Failure = (bool, Option<Duration>, Option<u16>, String);

impl Api {
    /// Builds the client; `auth` adds the key's header.
    ///
    /// # Errors
    /// [`BatchError::Config`] for a missing base URL or key variable, a bad header.
    pub fn build(
        model: &ModelConfig,
        auth: impl Fn(&str, &mut HeaderMap) -> Result<(), BatchError>,
    ) -> Result<Self, BatchError> {
        let cfg = |m: String| BatchError::Config(m);
        let base = model
            .base_url
            .as_deref()
            .ok_or_else(|| cfg("model.base_url is required for batch mode".into()))?
            .trim_end_matches('/')
            .to_string();
        let secret = match &model.api_key_env {
            Some(var) => match std::env::var(var) {
                Ok(v) if !v.is_empty() => Some(v),
                _ => {
                    return Err(cfg(format!(
                        "model.api_key_env: environment variable {var} is not set"
                    )));
                }
            },
            None => None,
        };
        let mut headers = HeaderMap::new();
        if let Some(k) = &secret {
            auth(k, &mut headers)?;
        }
        for (k, v) in &model.headers {
            let name = HeaderName::from_bytes(k.as_bytes())
                .map_err(|e| cfg(format!("model.headers.{k}: {e}")))?;
            let value =
                HeaderValue::from_str(v).map_err(|e| cfg(format!("model.headers.{k}: {e}")))?;
            headers.insert(name, value);
        }
        let http = reqwest::Client::builder()
            .default_headers(headers)
            .connect_timeout(Duration::from_secs(30))
            .timeout(Duration::from_secs(600))
            .build()
            .map_err(|e| cfg(format!("cannot build the HTTP client: {e}")))?;
        Ok(Self { http, base, secret })
    }

    fn scrub(&self, s: String) -> String {
        match &self.secret {
            Some(k) if s.contains(k.as_str()) => s.replace(k.as_str(), "[redacted]"),
            _ => s,
        }
    }

    async fn attempt(&self, req: reqwest::RequestBuilder) -> Result<bytes::Bytes, Failure> {
        match req.send().await {
            Ok(r) => {
                let status = r.status().as_u16();
                let ra = r
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_retry_after);
                match r.bytes().await {
                    Ok(b) if (200..300).contains(&status) => Ok(b),
                    Ok(b) => {
                        let text: String = String::from_utf8_lossy(&b).chars().take(300).collect();
                        let retry = matches!(status, 408 | 409 | 429) || status >= 500;
                        Err((
                            retry,
                            ra,
                            Some(status),
                            format!("HTTP {status}: {}", text.trim()),
                        ))
                    }
                    Err(e) => Err((true, None, Some(status), format!("reading the body: {e}"))),
                }
            }
            Err(e) => Err((true, None, None, format!("transport error: {e}"))),
        }
    }

    fn error(&self, what: &str, status: Option<u16>, msg: String) -> BatchError {
        BatchError::Api {
            what: what.to_string(),
            status,
            msg: self.scrub(msg),
        }
    }

    /// Sends a request built by `make`, retrying what a retry can fix; the 2xx body.
    pub async fn send(
        &self,
        what: &str,
        make: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<bytes::Bytes, BatchError> {
        let mut retries = 0u32;
        loop {
            let (retry, retry_after, status, msg) = match self.attempt(make()).await {
                Ok(b) => return Ok(b),
                Err(f) => f,
            };
            if !retry || retries >= 8 {
                return Err(self.error(what, status, msg));
            }
            retries += 1;
            tokio::time::sleep(backoff(retries, retry_after).min(Duration::from_secs(30))).await;
        }
    }

    /// Sends a request once; the 2xx body, or the failure and whether a retry could fix it.
    pub async fn send_once(
        &self,
        what: &str,
        req: reqwest::RequestBuilder,
    ) -> Result<bytes::Bytes, (BatchError, bool)> {
        self.attempt(req)
            .await
            .map_err(|(retry, _, status, msg)| (self.error(what, status, msg), retry))
    }

    /// Parses a 2xx body.
    pub fn json<T: serde::de::DeserializeOwned>(what: &str, b: &[u8]) -> Result<T, BatchError> {
        serde_json::from_slice(b).map_err(|e| BatchError::Api {
            what: what.to_string(),
            status: None,
            msg: format!("unexpected answer: {e}"),
        })
    }
}
