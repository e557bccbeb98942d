//! The HTTP client both batch interfaces share: the model's base URL, key and headers, and
//! a send that retries what a retry can fix.
//!
//! # Behavior
//! - Each API call is retried on transport errors, 408, 409, 429 and 5xx (a poll that
//!   answers 500 is only a late poll), with the synchronous client's backoff, up to 8 times
//!   ([`Api::send`]); [`Api::send_once`] does not retry (a create, which a retry could
//!   make twice).
//! - The key is sent as a sensitive header and scrubbed from every error text.

use std::path::Path;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use tokio::io::AsyncWriteExt;

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

/// A request body streamed from the first `len` bytes of the file at `path`, between
/// `prefix` and `suffix`, each newline turned into `newline` when one is given (a JSONL file
/// as the elements of a JSON array); with its length, for `Content-Length`.
///
/// A batch's input is up to 200 MB (OpenAI) or 256 MB (Anthropic): streamed from the
/// journal's file, it is never held whole in memory. The file is opened when the body is
/// first polled, so a retry sends it again from its start.
pub fn file_body(
    prefix: Vec<u8>,
    path: &Path,
    len: u64,
    newline: Option<u8>,
    suffix: Vec<u8>,
) -> (reqwest::Body, u64) {
    let (s, total) = file_stream(prefix, path, len, newline, suffix);
    (reqwest::Body::wrap_stream(s), total)
}

/// The stream of [`file_body`].
pub fn file_stream(
    prefix: Vec<u8>,
    path: &Path,
    len: u64,
    newline: Option<u8>,
    suffix: Vec<u8>,
) -> (
    impl futures::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static,
    u64,
) {
    use futures::StreamExt;
    use tokio::io::AsyncReadExt;
    enum State {
        Closed(std::path::PathBuf),
        Open(tokio::io::Take<tokio::fs::File>),
        Done,
    }
    let total = prefix.len() as u64 + len + suffix.len() as u64;
    let file = futures::stream::unfold(State::Closed(path.to_path_buf()), move |st| async move {
        let mut r = match st {
            State::Closed(p) => match tokio::fs::File::open(&p).await {
                Ok(f) => f.take(len),
                Err(e) => return Some((Err(e), State::Done)),
            },
            State::Open(r) => r,
            State::Done => return None,
        };
        let mut buf = vec![0u8; 256 << 10];
        match r.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                if let Some(c) = newline {
                    buf.iter_mut().filter(|b| **b == b'\n').for_each(|b| *b = c);
                }
                Some((Ok(bytes::Bytes::from(buf)), State::Open(r)))
            }
            Err(e) => Some((Err(e), State::Done)),
        }
    });
    let edge = |b: Vec<u8>| futures::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from(b))]);
    (edge(prefix).chain(file).chain(edge(suffix)), total)
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
            Ok(r) if r.status().is_success() => {
                let status = r.status().as_u16();
                r.bytes()
                    .await
                    .map_err(|e| (true, None, Some(status), format!("reading the body: {e}")))
            }
            Ok(r) => Err(self.attempt_failed(r).await),
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

    /// Streams a 2xx body into `path` (replaced), retrying as [`Self::send`] does; a body cut
    /// short by the transport is downloaded again from its start. The body's length.
    ///
    /// A result file holds up to 100,000 answers: written to disk as it arrives, it is never
    /// held whole in memory.
    pub async fn download(
        &self,
        what: &str,
        make: impl Fn() -> reqwest::RequestBuilder,
        path: &Path,
    ) -> Result<u64, BatchError> {
        let mut retries = 0u32;
        loop {
            let (retry, retry_after, status, msg) = match make().send().await {
                Ok(r) if r.status().is_success() => match self.stream_to(r, path).await? {
                    Ok(n) => return Ok(n),
                    Err(f) => f,
                },
                Ok(r) => self.attempt_failed(r).await,
                Err(e) => (true, None, None, format!("transport error: {e}")),
            };
            if !retry || retries >= 8 {
                return Err(self.error(what, status, msg));
            }
            retries += 1;
            tokio::time::sleep(backoff(retries, retry_after).min(Duration::from_secs(30))).await;
        }
    }

    /// Writes a 2xx answer's body to `path`; the outer error is the file's, the inner one a
    /// body cut short.
    async fn stream_to(
        &self,
        mut r: reqwest::Response,
        path: &Path,
    ) -> Result<Result<u64, Failure>, BatchError> {
        let io = |source: std::io::Error| BatchError::Journal {
            path: path.display().to_string(),
            source,
        };
        let status = r.status().as_u16();
        let mut f = tokio::io::BufWriter::with_capacity(
            1 << 20,
            tokio::fs::File::create(path).await.map_err(io)?,
        );
        let mut n = 0u64;
        loop {
            match r.chunk().await {
                Ok(Some(c)) => {
                    f.write_all(&c).await.map_err(io)?;
                    n += c.len() as u64;
                }
                Ok(None) => break,
                Err(e) => {
                    return Ok(Err((
                        true,
                        None,
                        Some(status),
                        format!("reading the body: {e}"),
                    )));
                }
            }
        }
        f.flush().await.map_err(io)?;
        Ok(Ok(n))
    }

    /// The failure of a non-2xx answer.
    async fn attempt_failed(&self, r: reqwest::Response) -> Failure {
        let status = r.status().as_u16();
        let ra = r
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_retry_after);
        let text: String = match r.bytes().await {
            Ok(b) => String::from_utf8_lossy(&b).chars().take(300).collect(),
            Err(e) => format!("reading the body: {e}"),
        };
        let retry = matches!(status, 408 | 409 | 429) || status >= 500;
        (
            retry,
            ra,
            Some(status),
            format!("HTTP {status}: {}", text.trim()),
        )
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
