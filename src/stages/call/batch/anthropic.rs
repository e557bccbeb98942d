//! Anthropic's Message Batches: create, retrieve, list, results, and the result lines as
//! call results.
//!
//! # Behavior
//! - Headers as the synchronous Anthropic client sends them: `x-api-key` (sensitive),
//!   `anthropic-version` (unless `[model.headers]` names another), then the model's headers.
//! - A create (`POST {base_url}/messages/batches`, `{"requests": [{"custom_id", "params"}]}`)
//!   is sent once; retrieve, list and results are retried as [`Api::send`] says.
//! - A result line becomes exactly the [`CallResult`] the synchronous call would give: a
//!   `succeeded` message is parsed by the Messages parser (stop reasons mapped as the
//!   synchronous client maps them) with status 200; an `errored` one is
//!   `HTTP {status}: {error}` with the status its error type has on the synchronous API
//!   (retryable as the synchronous one is: 429, 5xx, 529); `canceled` and `expired` are
//!   retryable errors.

use reqwest::header::{HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::{Value, json};

use super::BatchError;
use super::api::{Api, file_body};
use crate::config::ModelConfig;
use crate::stages::call::{CallRequest, CallResult, anthropic};

/// Most requests in one batch.
pub const MAX_REQUESTS: u64 = 100_000;
/// Most bytes in one create's body.
pub const MAX_BYTES: u64 = 256 * 1024 * 1024;

/// What the API says of a batch.
#[derive(Debug, Clone, Deserialize)]
pub struct Batch {
    pub id: String,
    pub processing_status: String,
    #[serde(default)]
    pub request_counts: Counts,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub results_url: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct Counts {
    #[serde(default)]
    pub processing: u64,
    #[serde(default)]
    pub succeeded: u64,
    #[serde(default)]
    pub errored: u64,
    #[serde(default)]
    pub canceled: u64,
    #[serde(default)]
    pub expired: u64,
}

impl Batch {
    /// Whether processing has ended (every request succeeded, errored, was canceled or
    /// expired).
    pub fn is_final(&self) -> bool {
        self.processing_status == "ended"
    }

    /// Requests that ended.
    pub fn done(&self) -> u64 {
        let c = self.request_counts;
        c.succeeded + c.errored + c.canceled + c.expired
    }

    /// Every request of the batch.
    pub fn total(&self) -> u64 {
        self.done() + self.request_counts.processing
    }

    /// `created_at` in microseconds since the epoch.
    pub fn created_at_us(&self) -> Option<i64> {
        let t = chrono::DateTime::parse_from_rfc3339(self.created_at.as_deref()?).ok()?;
        Some(t.timestamp_micros())
    }
}

#[derive(Deserialize)]
struct Page {
    data: Vec<Batch>,
    #[serde(default)]
    has_more: bool,
    #[serde(default)]
    last_id: Option<String>,
}

/// A client of the Message Batches API at the model's `base_url`.
pub struct Client {
    api: Api,
}

impl Client {
    /// # Errors
    /// [`BatchError::Config`] for a missing base URL, key variable or `max_tokens`, a bad
    /// header.
    pub fn build(model: &ModelConfig) -> Result<Self, BatchError> {
        if model.max_tokens.is_none() {
            return Err(BatchError::Config(
                "model.max_tokens: the Anthropic Messages API requires max_tokens".into(),
            ));
        }
        let api = Api::build(model, |key, headers| {
            let mut v = HeaderValue::from_str(key).map_err(|_| {
                BatchError::Config("model.api_key_env: the key is not a valid header value".into())
            })?;
            v.set_sensitive(true);
            headers.insert(HeaderName::from_static("x-api-key"), v);
            Ok(())
        })?;
        Ok(Self { api })
    }

    /// The version header unless the model's headers name one (they are defaults, which a
    /// header set on the request would override).
    fn versioned(
        &self,
        r: reqwest::RequestBuilder,
        model: &ModelConfig,
    ) -> reqwest::RequestBuilder {
        if model
            .headers
            .keys()
            .any(|k| k.eq_ignore_ascii_case("anthropic-version"))
        {
            r
        } else {
            r.header("anthropic-version", anthropic::VERSION)
        }
    }

    /// Creates a batch from a chunk's request lines (`len` bytes of the JSONL file at
    /// `path`, streamed as the `requests` array of the body), once; a failure says whether a
    /// retry could fix it.
    pub async fn create(
        &self,
        model: &ModelConfig,
        path: &std::path::Path,
        len: u64,
    ) -> Result<Batch, (BatchError, bool)> {
        let url = format!("{}/messages/batches", self.api.base);
        let what = "POST /messages/batches";
        let (body, total) = create_body(path, len);
        let req = self
            .versioned(self.api.http.post(&url), model)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(reqwest::header::CONTENT_LENGTH, total)
            .body(body);
        let b = self.api.send_once(what, req).await?;
        Api::json(what, &b).map_err(|e| (e, false))
    }

    pub async fn retrieve(&self, model: &ModelConfig, id: &str) -> Result<Batch, BatchError> {
        let url = format!("{}/messages/batches/{id}", self.api.base);
        let what = format!("GET /messages/batches/{id}");
        let b = self
            .api
            .send(&what, || self.versioned(self.api.http.get(&url), model))
            .await?;
        Api::json(&what, &b)
    }

    /// The batches, newest first, while `more` says to go on (it sees each batch).
    pub async fn list(
        &self,
        model: &ModelConfig,
        mut more: impl FnMut(&Batch) -> bool,
    ) -> Result<(), BatchError> {
        let mut after: Option<String> = None;
        loop {
            let mut url = format!("{}/messages/batches?limit=100", self.api.base);
            if let Some(a) = &after {
                url.push_str(&format!("&after_id={a}"));
            }
            let what = "GET /messages/batches";
            let b = self
                .api
                .send(what, || self.versioned(self.api.http.get(&url), model))
                .await?;
            let page: Page = Api::json(what, &b)?;
            for b in &page.data {
                if !more(b) {
                    return Ok(());
                }
            }
            match page.last_id {
                Some(l) if page.has_more => after = Some(l),
                _ => return Ok(()),
            }
        }
    }

    /// Downloads the results JSONL of an ended batch (from its `results_url`) into `path`;
    /// its length.
    pub async fn results(
        &self,
        model: &ModelConfig,
        b: &Batch,
        path: &std::path::Path,
    ) -> Result<u64, BatchError> {
        let url = b
            .results_url
            .clone()
            .unwrap_or_else(|| format!("{}/messages/batches/{}/results", self.api.base, b.id));
        let what = format!("GET /messages/batches/{}/results", b.id);
        self.api
            .download(
                &what,
                || self.versioned(self.api.http.get(&url), model),
                path,
            )
            .await
    }
}

/// The batch request of a call: `custom_id` = the call id, `params` exactly the synchronous
/// request's body.
pub fn line(model: &ModelConfig, req: &CallRequest) -> Vec<u8> {
    let v = json!({"custom_id": req.call_id,
                   "params": anthropic::body(model, req, req.max_tokens)});
    serde_json::to_vec(&v).expect("a request serialises")
}

/// The create's body from a chunk's request lines: `len` bytes of JSONL, one request a line,
/// each line ended by a newline, streamed as `{"requests":[line,line,...]}` (the newlines
/// become the commas and the last one is left out); with its length.
pub fn create_body(path: &std::path::Path, len: u64) -> (reqwest::Body, u64) {
    let prefix = b"{\"requests\":[".to_vec();
    file_body(
        prefix,
        path,
        len.saturating_sub(1),
        Some(b','),
        b"]}".to_vec(),
    )
}

#[cfg(test)]
async fn create_body_bytes(path: &std::path::Path, len: u64) -> (Vec<u8>, u64) {
    use futures::TryStreamExt;
    let prefix = b"{\"requests\":[".to_vec();
    let (s, total) = super::api::file_stream(
        prefix,
        path,
        len.saturating_sub(1),
        Some(b','),
        b"]}".to_vec(),
    );
    let parts: Vec<bytes::Bytes> = s.try_collect().await.expect("the file reads");
    (parts.concat(), total)
}

/// The synchronous API's status for an error type.
pub fn status_of(kind: &str) -> Option<u16> {
    Some(match kind {
        "invalid_request_error" => 400,
        "authentication_error" => 401,
        "billing_error" => 402,
        "permission_error" => 403,
        "not_found_error" => 404,
        "request_too_large" => 413,
        "rate_limit_error" => 429,
        "api_error" => 500,
        "timeout_error" => 504,
        "overloaded_error" => 529,
        _ => return None,
    })
}

/// One result line: the call id, its result (attempts 1) and whether a later batch may
/// send it again.
pub fn parse_line(batch_id: &str, line: &[u8]) -> Option<(String, CallResult, bool)> {
    let v: Value = serde_json::from_slice(line).ok()?;
    let id = v.get("custom_id")?.as_str()?.to_string();
    let result = v.get("result")?;
    let failed = super::openai::failed;
    Some(match result.get("type").and_then(Value::as_str)? {
        "succeeded" => {
            let msg = result.get("message").cloned().unwrap_or(Value::Null);
            match anthropic::parse_value(&msg) {
                Ok(p) => (
                    id,
                    CallResult {
                        response: Some(p.content),
                        finish_reason: p.finish_reason,
                        prompt_tokens: p.prompt_tokens,
                        completion_tokens: p.completion_tokens,
                        reasoning_tokens: p.reasoning_tokens,
                        reasoning_chars: p.reasoning_chars,
                        http_status: Some(200),
                        attempts: 1,
                        ..CallResult::default()
                    },
                    false,
                ),
                Err(m) => (id, failed(Some(200), m), true),
            }
        }
        "errored" => {
            let err = result.get("error").cloned().unwrap_or(Value::Null);
            let kind = err
                .pointer("/error/type")
                .or_else(|| err.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("error");
            let text: String = err.to_string().chars().take(300).collect();
            match status_of(kind) {
                Some(s) => {
                    let retry = s == 429 || s >= 500;
                    (id, failed(Some(s), format!("HTTP {s}: {text}")), retry)
                }
                None => (
                    id,
                    failed(None, format!("batch {batch_id}: errored: {text}")),
                    false,
                ),
            }
        }
        other => (id, failed(None, format!("batch {batch_id}: {other}")), true),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_chunks_lines_stream_as_the_create_body_with_its_length() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("input.jsonl");
        let lines = b"{\"a\":1}\n{\"b\":2}\n";
        std::fs::write(&p, lines).unwrap();
        let (body, total) = create_body_bytes(&p, lines.len() as u64).await;
        assert_eq!(body, b"{\"requests\":[{\"a\":1},{\"b\":2}]}".to_vec());
        assert_eq!(total, body.len() as u64);
        let missing = dir.path().join("gone.jsonl");
        let (s, _) = super::super::api::file_stream(vec![], &missing, 4, None, vec![]);
        let r: Result<Vec<bytes::Bytes>, _> = futures::TryStreamExt::try_collect(s).await;
        assert!(
            r.is_err(),
            "a missing file is an error of the body, not an empty body"
        );
    }

    #[test]
    fn result_lines_become_the_synchronous_results() {
        let ok = br#"{"custom_id":"c1","result":{"type":"succeeded","message":{"content":[{"type":"text","text":"hi"}],
            "stop_reason":"max_tokens","usage":{"input_tokens":3,"output_tokens":1}}}}"#;
        let (id, r, retry) = parse_line("b", ok).unwrap();
        assert_eq!((id.as_str(), retry), ("c1", false));
        assert_eq!(r.response.as_deref(), Some("hi"));
        assert_eq!(r.finish_reason.as_deref(), Some("length"));
        assert_eq!((r.prompt_tokens, r.completion_tokens), (Some(3), Some(1)));
        assert_eq!(r.http_status, Some(200));
        let limited = br#"{"custom_id":"c2","result":{"type":"errored","error":{"type":"error","error":{"type":"rate_limit_error",
            "message":"slow"}}}}"#;
        let (_, r, retry) = parse_line("b", limited).unwrap();
        assert!(retry);
        assert_eq!(r.http_status, Some(429));
        assert_eq!(
            r.error.as_deref(),
            Some(
                r#"HTTP 429: {"error":{"message":"slow","type":"rate_limit_error"},"type":"error"}"#
            )
        );
        let invalid = br#"{"custom_id":"c3","result":{"type":"errored","error":{"type":"error","error":{"type":"invalid_request_error",
            "message":"no"}}}}"#;
        let (_, r, retry) = parse_line("b", invalid).unwrap();
        assert_eq!((r.http_status, retry), (Some(400), false));
        let expired = br#"{"custom_id":"c4","result":{"type":"expired"}}"#;
        let (_, r, retry) = parse_line("b9", expired).unwrap();
        assert!(retry);
        assert_eq!(r.error.as_deref(), Some("batch b9: expired"));
        assert!(parse_line("b", b"{\"custom_id\":\"c5\",\"resu").is_none());
    }
}
