//! OpenAI's Batch API: files, batches, and the result lines as call results.
//!
//! # Behavior
//! - Each API call but the create is retried as [`Api::send`] says; a create is sent once
//!   (the caller looks for its batch before sending it again).
//! - A result line becomes exactly the [`CallResult`] the synchronous call would give: a 200
//!   body is parsed by the chat completions parser; another status is `HTTP {status}: ...`,
//!   retryable as the synchronous one is; `batch_expired` / `batch_cancelled` lines are
//!   retryable, other line errors are final.

use reqwest::header::HeaderValue;
use serde::Deserialize;
use serde_json::{Value, json};

use super::BatchError;
use super::api::{Api, file_body};
use crate::config::ModelConfig;
use crate::stages::call::{CallRequest, CallResult, openai};

/// The endpoint every line goes to.
pub const ENDPOINT: &str = "/v1/chat/completions";

/// What the API says of a batch.
#[derive(Debug, Clone, Deserialize)]
pub struct Batch {
    pub id: String,
    pub status: String,
    #[serde(default)]
    pub output_file_id: Option<String>,
    #[serde(default)]
    pub error_file_id: Option<String>,
    #[serde(default)]
    pub errors: Option<Value>,
    #[serde(default)]
    pub request_counts: Option<Counts>,
    #[serde(default)]
    pub metadata: Option<Value>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct Counts {
    #[serde(default)]
    pub total: u64,
    #[serde(default)]
    pub completed: u64,
    #[serde(default)]
    pub failed: u64,
}

impl Batch {
    /// Whether the batch will not change any more.
    pub fn is_final(&self) -> bool {
        matches!(
            self.status.as_str(),
            "completed" | "failed" | "expired" | "cancelled"
        )
    }

    /// The validation errors of a failed batch, as text.
    pub fn error_text(&self) -> String {
        let data = self
            .errors
            .as_ref()
            .and_then(|e| e.get("data"))
            .and_then(Value::as_array);
        match data {
            Some(d) if !d.is_empty() => d
                .iter()
                .take(3)
                .map(|e| {
                    let code = e.get("code").and_then(Value::as_str).unwrap_or("error");
                    let msg = e.get("message").and_then(Value::as_str).unwrap_or("");
                    match e.get("line").and_then(Value::as_u64) {
                        Some(l) => format!("{code} (line {l}): {msg}"),
                        None => format!("{code}: {msg}"),
                    }
                })
                .collect::<Vec<_>>()
                .join("; "),
            _ => "no reason given".into(),
        }
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

/// A client of the Batch API at the model's `base_url`.
pub struct Client {
    api: Api,
}

impl Client {
    /// # Errors
    /// [`BatchError::Config`] for a missing base URL or key variable, a bad header.
    pub fn build(model: &ModelConfig) -> Result<Self, BatchError> {
        let api = Api::build(model, |key, headers| {
            let mut v = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                BatchError::Config("model.api_key_env: the key is not a valid header value".into())
            })?;
            v.set_sensitive(true);
            headers.insert(reqwest::header::AUTHORIZATION, v);
            Ok(())
        })?;
        Ok(Self { api })
    }

    /// Uploads a batch input file (purpose `batch`) of `len` bytes, streamed from `path`;
    /// its file id.
    pub async fn upload(
        &self,
        filename: &str,
        path: &std::path::Path,
        len: u64,
    ) -> Result<String, BatchError> {
        let boundary = format!("evalflow-{}", uuid::Uuid::new_v4().simple());
        let head = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
             --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n\
             Content-Type: application/jsonl\r\n\r\n"
        );
        let tail = format!("\r\n--{boundary}--\r\n");
        let url = format!("{}/files", self.api.base);
        let b = self
            .api
            .send("POST /files", || {
                let (body, total) = file_body(
                    head.clone().into_bytes(),
                    path,
                    len,
                    None,
                    tail.clone().into_bytes(),
                );
                self.api
                    .http
                    .post(&url)
                    .header(
                        reqwest::header::CONTENT_TYPE,
                        format!("multipart/form-data; boundary={boundary}"),
                    )
                    .header(reqwest::header::CONTENT_LENGTH, total)
                    .body(body)
            })
            .await?;
        let v: Value = Api::json("POST /files", &b)?;
        v.get("id")
            .and_then(Value::as_str)
            .map(String::from)
            .ok_or_else(|| BatchError::Api {
                what: "POST /files".into(),
                status: None,
                msg: "the answer has no file id".into(),
            })
    }

    /// Creates a batch over an uploaded file, once; a failure says whether a retry could
    /// fix it.
    pub async fn create(
        &self,
        file_id: &str,
        metadata: &Value,
    ) -> Result<Batch, (BatchError, bool)> {
        let url = format!("{}/batches", self.api.base);
        let body = json!({"input_file_id": file_id, "endpoint": ENDPOINT,
                          "completion_window": "24h", "metadata": metadata});
        let b = self
            .api
            .send_once("POST /batches", self.api.http.post(&url).json(&body))
            .await?;
        Api::json("POST /batches", &b).map_err(|e| (e, false))
    }

    pub async fn retrieve(&self, id: &str) -> Result<Batch, BatchError> {
        let url = format!("{}/batches/{id}", self.api.base);
        let what = format!("GET /batches/{id}");
        let b = self.api.send(&what, || self.api.http.get(&url)).await?;
        Api::json(&what, &b)
    }

    /// The first batch, newest first, whose metadata has `key` = `value`, looking at the
    /// newest `max` batches at most.
    pub async fn find(
        &self,
        key: &str,
        wanted: &std::collections::HashSet<String>,
        max: usize,
    ) -> Result<Vec<(String, Batch)>, BatchError> {
        let mut found = Vec::new();
        let mut after: Option<String> = None;
        let mut seen = 0;
        loop {
            let mut url = format!("{}/batches?limit=100", self.api.base);
            if let Some(a) = &after {
                url.push_str(&format!("&after={a}"));
            }
            let b = self
                .api
                .send("GET /batches", || self.api.http.get(&url))
                .await?;
            let page: Page = Api::json("GET /batches", &b)?;
            seen += page.data.len();
            for batch in page.data {
                let v = batch
                    .metadata
                    .as_ref()
                    .and_then(|m| m.get(key))
                    .and_then(Value::as_str)
                    .map(String::from);
                if let Some(v) = v.filter(|v| wanted.contains(v)) {
                    found.push((v, batch));
                }
            }
            if !page.has_more || seen >= max || found.len() == wanted.len() {
                return Ok(found);
            }
            after = page.last_id;
            if after.is_none() {
                return Ok(found);
            }
        }
    }

    /// Downloads a file's content into `path`; its length.
    pub async fn content(&self, file_id: &str, path: &std::path::Path) -> Result<u64, BatchError> {
        let url = format!("{}/files/{file_id}/content", self.api.base);
        self.api
            .download(
                &format!("GET /files/{file_id}/content"),
                || self.api.http.get(&url),
                path,
            )
            .await
    }
}

/// The batch input line of a request: `custom_id` = the call id, the body exactly the
/// synchronous request's.
pub fn line(model: &ModelConfig, req: &CallRequest) -> Vec<u8> {
    let v = json!({"custom_id": req.call_id, "method": "POST", "url": ENDPOINT,
                   "body": openai::body(model, req, req.max_tokens)});
    serde_json::to_vec(&v).expect("a request serialises")
}

/// One result line: the call id, its result (attempts 1) and whether a later batch may
/// send it again.
pub fn parse_line(batch_id: &str, line: &[u8]) -> Option<(String, CallResult, bool)> {
    let v: Value = serde_json::from_slice(line).ok()?;
    let id = v.get("custom_id")?.as_str()?.to_string();
    let resp = v.get("response").filter(|r| !r.is_null());
    if let Some(r) = resp {
        let status = r.get("status_code").and_then(Value::as_u64).unwrap_or(0) as u16;
        let body = r.get("body").cloned().unwrap_or(Value::Null);
        if (200..300).contains(&status) {
            return Some(match openai::parse_value(&body) {
                Ok(p) => (
                    id,
                    CallResult {
                        response: Some(p.content),
                        finish_reason: p.finish_reason,
                        prompt_tokens: p.prompt_tokens,
                        completion_tokens: p.completion_tokens,
                        reasoning_tokens: p.reasoning_tokens,
                        reasoning_chars: p.reasoning_chars,
                        http_status: Some(i32::from(status)),
                        attempts: 1,
                        ..CallResult::default()
                    },
                    false,
                ),
                Err(msg) => (id, failed(Some(status), msg), true),
            });
        }
        let text: String = body.to_string().chars().take(300).collect();
        let retry = matches!(status, 408 | 409 | 429) || status >= 500;
        return Some((
            id,
            failed(Some(status), format!("HTTP {status}: {text}")),
            retry,
        ));
    }
    let err = v.get("error");
    let code = err
        .and_then(|e| e.get("code"))
        .and_then(Value::as_str)
        .unwrap_or("error");
    let msg = err
        .and_then(|e| e.get("message"))
        .and_then(Value::as_str)
        .unwrap_or("");
    let retry = matches!(code, "batch_expired" | "batch_cancelled");
    Some((
        id,
        failed(None, format!("batch {batch_id}: {code}: {msg}")),
        retry,
    ))
}

/// A failed result.
pub fn failed(status: Option<u16>, msg: String) -> CallResult {
    CallResult {
        http_status: status.map(i32::from),
        error: Some(msg),
        attempts: 1,
        ..CallResult::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_lines_become_the_synchronous_results() {
        let ok = br#"{"id":"r","custom_id":"c1","response":{"status_code":200,"body":{"choices":[{"message":{"content":"hi"},
            "finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}},"error":null}"#;
        let (id, r, retry) = parse_line("b", ok).unwrap();
        assert_eq!((id.as_str(), retry), ("c1", false));
        assert_eq!(r.response.as_deref(), Some("hi"));
        assert_eq!((r.prompt_tokens, r.completion_tokens), (Some(3), Some(1)));
        assert_eq!(r.http_status, Some(200));
        let limited = br#"{"custom_id":"c2","response":{"status_code":429,"body":{"error":{"message":"slow"}}}}"#;
        let (_, r, retry) = parse_line("b", limited).unwrap();
        assert!(retry);
        assert_eq!(r.http_status, Some(429));
        assert!(r.error.unwrap().starts_with("HTTP 429: "));
        let quota = br#"{"custom_id":"c3","response":{"status_code":403,"body":{}}}"#;
        assert!(!parse_line("b", quota).unwrap().2);
        let expired = br#"{"custom_id":"c4","response":null,"error":{"code":"batch_expired","message":"late"}}"#;
        let (_, r, retry) = parse_line("b9", expired).unwrap();
        assert!(retry);
        assert_eq!(r.error.as_deref(), Some("batch b9: batch_expired: late"));
        assert!(parse_line("b", b"{\"custom_id\":\"c5\",\"resp").is_none());
    }
}
