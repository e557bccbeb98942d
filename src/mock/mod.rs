//! A fault-injecting mock of the OpenAI chat completions and Anthropic Messages APIs, for
//! tests, benchmarks and dry runs of a pipeline without a key or a network.
//!
//! # Behavior
//! - `POST /v1/chat/completions` and `POST /v1/messages` (also without the `/v1` prefix)
//!   answer after `latency`, with the label VADER gives the last user message
//!   (`answer = vader`) or that message echoed (`answer = echo`).
//! - Faults are drawn per request from the configured rates by a deterministic function of
//!   (seed, request hash, sample index, attempt number for that hash and sample), so a run
//!   is reproducible and a retried request can succeed where its first attempt failed.
//!   The request hash is the client's `x-evalflow-request-hash` header, or a hash of the
//!   body when absent (any other client).
//! - The request log gets one JSON line per request received, written before the answer
//!   is sent: `{"seq","t","path","request_hash","sample_idx","call_id","attempt","fault",
//!   "model","usage"}` (`t`: seconds since the Unix epoch when the request was received;
//!   `call_id` from the `x-evalflow-call-id` header, null for other clients; `usage`: the
//!   `prompt_tokens` / `completion_tokens` / `reasoning_tokens` the answer reports, null
//!   for a fault answered without usage, `reasoning_tokens` null on the Anthropic API), so
//!   a test can check a client's pacing and token totals against what the server saw.
//! - `reset` answers by resetting the TCP connection (SO_LINGER 0), `hang` never answers.

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::serve::{IncomingStream, Listener};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

mod batch;
mod message_batches;
pub use batch::{BatchConfig, BatchFault, parse_batch_fault};

use crate::stages::call::http::{CALL_ID_HEADER, REQUEST_HASH_HEADER, SAMPLE_IDX_HEADER};
use crate::stages::call::vader;

/// An injectable fault (DESIGN.md, "Mock server").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    RateLimit,
    ServerError,
    OutOfCredit,
    Reset,
    Hang,
    MalformedJson,
    EmptyLength,
    Truncated,
}

impl Fault {
    pub const ALL: [Fault; 8] = [
        Fault::RateLimit,
        Fault::ServerError,
        Fault::OutOfCredit,
        Fault::Reset,
        Fault::Hang,
        Fault::MalformedJson,
        Fault::EmptyLength,
        Fault::Truncated,
    ];

    /// The name used on the command line and in the request log.
    pub fn name(self) -> &'static str {
        match self {
            Fault::RateLimit => "rate_limit",
            Fault::ServerError => "server_error",
            Fault::OutOfCredit => "out_of_credit",
            Fault::Reset => "reset",
            Fault::Hang => "hang",
            Fault::MalformedJson => "malformed_json",
            Fault::EmptyLength => "empty_length",
            Fault::Truncated => "truncated",
        }
    }

    pub fn parse(s: &str) -> Option<Fault> {
        Fault::ALL.into_iter().find(|f| f.name() == s)
    }
}

/// Parses `KIND=RATE` (rate in [0, 1]).
///
/// # Errors
/// A message naming the bad part.
pub fn parse_fault_spec(s: &str) -> Result<(Fault, f64), String> {
    let (k, r) = s
        .split_once('=')
        .ok_or_else(|| format!("--fault `{s}`: expected KIND=RATE, e.g. rate_limit=0.1"))?;
    let fault = Fault::parse(k.trim()).ok_or_else(|| {
        format!(
            "--fault `{s}`: unknown kind `{k}` (known: {})",
            Fault::ALL.map(Fault::name).join(", ")
        )
    })?;
    let rate: f64 = r
        .trim()
        .parse()
        .map_err(|_| format!("--fault `{s}`: rate `{r}` is not a number"))?;
    if !(0.0..=1.0).contains(&rate) {
        return Err(format!("--fault `{s}`: rate must be in [0, 1]"));
    }
    Ok((fault, rate))
}

/// How the mock answers a request that draws no fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AnswerMode {
    /// The VADER label of the last user message (`positive` / `negative` / `neutral`).
    Vader,
    /// The last user message, plus a seeded per-sample nonce unless temperature is 0.
    #[default]
    Echo,
    /// A checklist judge: one seeded `Qk: YES|NO` line for every `Qk:` question line of
    /// the last user message (the format the judge scorer asks for).
    Checklist,
}

/// The mock's configuration.
#[derive(Debug, Clone, Default)]
pub struct MockConfig {
    pub latency: Duration,
    /// Faults and their rates; the rates must sum to at most 1.
    pub faults: Vec<(Fault, f64)>,
    pub seed: u64,
    pub request_log: Option<PathBuf>,
    pub answer: AnswerMode,
    /// The `Retry-After` seconds sent with a 429.
    pub retry_after_secs: u64,
}

struct MockState {
    cfg: MockConfig,
    batch_cfg: batch::BatchConfig,
    batches: Mutex<batch::Store>,
    msg_batches: Mutex<message_batches::Store>,
    attempts: Mutex<HashMap<(String, i64), u32>>,
    log: Option<Mutex<std::io::BufWriter<std::fs::File>>>,
    seq: AtomicU64,
}

/// A running mock server.
pub struct MockServer {
    pub addr: SocketAddr,
    state: Arc<MockState>,
    task: tokio::task::JoinHandle<()>,
}

impl MockServer {
    /// Binds `addr` (port 0 picks a free one) and serves in a background task.
    ///
    /// # Errors
    /// The bind error, or a request log that cannot be created, or fault rates summing
    /// to more than 1.
    pub async fn start(addr: SocketAddr, cfg: MockConfig) -> std::io::Result<MockServer> {
        Self::start_with(addr, cfg, BatchConfig::default()).await
    }

    /// [`Self::start`] with the batch interfaces' time scale and faults.
    ///
    /// # Errors
    /// As [`Self::start`], and batch fault rates outside [0, 1].
    pub async fn start_with(
        addr: SocketAddr,
        cfg: MockConfig,
        batch_cfg: BatchConfig,
    ) -> std::io::Result<MockServer> {
        batch_cfg.check()?;
        let total: f64 = cfg.faults.iter().map(|f| f.1).sum();
        if total > 1.0 + 1e-9 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("fault rates sum to {total}, more than 1"),
            ));
        }
        let log = match &cfg.request_log {
            Some(p) => Some(Mutex::new(std::io::BufWriter::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", p.display())))?,
            ))),
            None => None,
        };
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(MockState {
            cfg,
            batch_cfg,
            batches: Mutex::new(batch::Store::default()),
            msg_batches: Mutex::new(message_batches::Store::default()),
            attempts: Mutex::new(HashMap::new()),
            log,
            seq: AtomicU64::new(0),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(openai))
            .route("/chat/completions", post(openai))
            .route("/v1/messages", post(anthropic))
            .route("/messages", post(anthropic))
            .merge(batch::routes())
            .merge(message_batches::routes())
            .with_state(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(
                MockListener(listener),
                app.into_make_service_with_connect_info::<Conn>(),
            )
            .await;
        });
        Ok(MockServer { addr, state, task })
    }

    /// The base URL clients use (`http://ADDR/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Requests received so far.
    pub fn requests(&self) -> u64 {
        self.state.seq.load(Ordering::Relaxed)
    }

    /// Waits until the server stops (never, unless the task fails).
    pub async fn wait(&mut self) {
        let _ = (&mut self.task).await;
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Accepts TCP connections wrapped so a handler can reset its own connection.
struct MockListener(TcpListener);

/// Per-connection info handed to handlers: the switch that resets the connection.
#[derive(Clone, Debug)]
struct Conn {
    reset: Arc<AtomicBool>,
}

struct ResettableIo {
    inner: TcpStream,
    reset: Arc<AtomicBool>,
}

impl ResettableIo {
    fn check(&self) -> std::io::Result<()> {
        if self.reset.load(Ordering::Relaxed) {
            // Zero linger: close sends RST instead of FIN, which is what a reset is.
            let _ = self.inner.set_zero_linger();
            return Err(std::io::ErrorKind::ConnectionReset.into());
        }
        Ok(())
    }
}

impl AsyncRead for ResettableIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if let Err(e) = self.check() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for ResettableIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if let Err(e) = self.check() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if let Err(e) = self.check() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Listener for MockListener {
    type Io = ResettableIo;
    type Addr = Conn;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.0.accept().await {
                Ok((s, _)) => {
                    let _ = s.set_nodelay(true);
                    let reset = Arc::new(AtomicBool::new(false));
                    return (
                        ResettableIo {
                            inner: s,
                            reset: reset.clone(),
                        },
                        Conn { reset },
                    );
                }
                // Out of file descriptors and the like: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(Conn {
            reset: Arc::new(AtomicBool::new(false)),
        })
    }
}

impl Connected<IncomingStream<'_, MockListener>> for Conn {
    fn connect_info(stream: IncomingStream<'_, MockListener>) -> Self {
        stream.remote_addr().clone()
    }
}

/// A uniform number in [0, 1) from the hash of `parts`.
fn uniform(parts: &[&[u8]]) -> f64 {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
        h.update([0u8]);
    }
    let d = h.finalize();
    (u64::from_be_bytes(d[..8].try_into().unwrap()) >> 11) as f64 / (1u64 << 53) as f64
}

/// What one request is, after reading its headers and body.
struct Incoming {
    hash: String,
    sample: i64,
    attempt: u32,
    fault: Option<Fault>,
    /// A second uniform draw, for choices inside a fault (500 vs 503).
    u2: f64,
    body: Value,
    /// The answer text when no fault replaces it.
    answer: String,
    max_tokens: i64,
    prompt_tokens: i64,
}

impl Incoming {
    /// `(prompt, completion, reasoning)` tokens the answer reports; `None` for a fault
    /// answered without usage.
    fn usage(&self) -> Option<(i64, i64, i64)> {
        match self.fault {
            None => Some((self.prompt_tokens, approx_tokens(&self.answer), 0)),
            Some(Fault::EmptyLength) => {
                Some((self.prompt_tokens, self.max_tokens, self.max_tokens))
            }
            Some(Fault::Truncated) => Some((self.prompt_tokens, self.max_tokens, 0)),
            Some(_) => None,
        }
    }
}

impl MockState {
    fn receive(
        &self,
        path: &str,
        headers: &HeaderMap,
        raw: &[u8],
    ) -> Result<Incoming, Box<Response>> {
        let body: Value = match serde_json::from_slice(raw) {
            Ok(v) => v,
            Err(e) => {
                self.seq.fetch_add(1, Ordering::Relaxed);
                return Err(Box::new(error(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    &format!("request body is not JSON: {e}"),
                )));
            }
        };
        let hash = headers
            .get(REQUEST_HASH_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
            .unwrap_or_else(|| hex::encode(Sha256::digest(raw))[..32].to_string());
        let sample: i64 = headers
            .get(SAMPLE_IDX_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let call_id = headers.get(CALL_ID_HEADER).and_then(|v| v.to_str().ok());
        Ok(self.receive_parsed(path, hash, sample, call_id, body))
    }

    /// [`Self::receive`] of a request already read: its hash, sample index, call id and
    /// body (a batch line's, which has no headers). Draws the fault and logs the request.
    fn receive_parsed(
        &self,
        path: &str,
        hash: String,
        sample: i64,
        call_id: Option<&str>,
        body: Value,
    ) -> Incoming {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let attempt = {
            let mut m = self.attempts.lock().unwrap();
            let n = m.entry((hash.clone(), sample)).or_insert(0);
            *n += 1;
            *n - 1
        };
        let seed = self.cfg.seed.to_be_bytes();
        let s_bytes = sample.to_be_bytes();
        let a_bytes = attempt.to_be_bytes();
        let u = uniform(&[&seed, hash.as_bytes(), &s_bytes, &a_bytes]);
        let u2 = uniform(&[&seed, hash.as_bytes(), &s_bytes, &a_bytes, b"2"]);
        let mut acc = 0.0;
        let mut fault = None;
        for (f, r) in &self.cfg.faults {
            acc += r;
            if u < acc {
                fault = Some(*f);
                break;
            }
        }
        let (last_user, all) = prompt_of(&body);
        let max_tokens = body
            .get("max_tokens")
            .or_else(|| body.get("max_completion_tokens"))
            .and_then(Value::as_i64)
            .unwrap_or(512);
        let mut inc = Incoming {
            hash,
            sample,
            attempt,
            fault,
            u2,
            body,
            answer: String::new(),
            max_tokens,
            prompt_tokens: approx_tokens(&all),
        };
        inc.answer = self.answer(&inc, &last_user);
        if let Some(log) = &self.log {
            let line = json!({
                "seq": seq,
                "t": t,
                "path": path,
                "request_hash": inc.hash,
                "sample_idx": inc.sample,
                "call_id": call_id,
                "attempt": inc.attempt,
                "fault": inc.fault.map(Fault::name),
                "model": inc.body.get("model"),
                "usage": inc.usage().map(|(p, c, r)| json!({
                    "prompt_tokens": p,
                    "completion_tokens": c,
                    "reasoning_tokens": (!path.ends_with("/v1/messages")).then_some(r),
                })),
            });
            let mut w = log.lock().unwrap();
            let _ = writeln!(w, "{line}");
            let _ = w.flush();
        }
        inc
    }

    /// The answer text for a request, and the last user message it came from.
    fn answer(&self, inc: &Incoming, last_user: &str) -> String {
        match self.cfg.answer {
            AnswerMode::Vader => vader::label(vader::compound(last_user)).to_string(),
            AnswerMode::Checklist => {
                let seed = self.cfg.seed.to_be_bytes();
                let model = inc
                    .body
                    .get("model")
                    .map(Value::to_string)
                    .unwrap_or_default();
                last_user
                    .lines()
                    .filter_map(|l| {
                        let rest = l.trim().strip_prefix('Q')?;
                        let k: String = rest.chars().take_while(char::is_ascii_digit).collect();
                        rest[k.len()..].starts_with(':').then(|| {
                            // Keyed by what was asked (not the request hash, which a batch
                            // line lacks): a batch judge answers as a synchronous one.
                            let yes = uniform(&[
                                &seed,
                                model.as_bytes(),
                                last_user.as_bytes(),
                                l.as_bytes(),
                            ]) < 0.5;
                            format!("Q{k}: {}", if yes { "YES" } else { "NO" })
                        })
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            }
            AnswerMode::Echo => {
                let t = inc.body.get("temperature").and_then(Value::as_f64);
                if t == Some(0.0) {
                    last_user.to_string()
                } else {
                    let seed = self.cfg.seed.to_be_bytes();
                    let n = uniform(&[&seed, inc.hash.as_bytes(), &inc.sample.to_be_bytes()]);
                    format!("{last_user} ~{:04x}", (n * 65536.0) as u32)
                }
            }
        }
    }
}

fn error(status: StatusCode, kind: &str, msg: &str) -> Response {
    (
        status,
        axum::Json(json!({"error": {"message": msg, "type": kind}})),
    )
        .into_response()
}

fn approx_tokens(s: &str) -> i64 {
    (s.chars().count() as i64 + 3) / 4
}

/// Text of a message's `content`: a string, or the text parts of a list.
fn content_text(c: Option<&Value>) -> String {
    match c {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// The last user message and the total prompt text.
fn prompt_of(body: &Value) -> (String, String) {
    let mut all = String::new();
    let mut last = String::new();
    if let Some(s) = body.get("system") {
        all.push_str(&content_text(Some(s)));
    }
    for m in body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let t = content_text(m.get("content"));
        all.push_str(&t);
        if m.get("role").and_then(Value::as_str) == Some("user") {
            last = t;
        }
    }
    (last, all)
}

/// Applies the fault common to both APIs; `None` means answer normally (possibly with an
/// `empty_length` / `truncated` shape, handled by the caller).
async fn common_fault(st: &MockState, inc: &Incoming, conn: &Conn) -> Option<Response> {
    match inc.fault? {
        Fault::RateLimit => {
            let mut r = error(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "Rate limit reached (mock)",
            );
            r.headers_mut().insert(
                header::RETRY_AFTER,
                st.cfg.retry_after_secs.to_string().parse().unwrap(),
            );
            Some(r)
        }
        Fault::ServerError => Some(if inc.u2 < 0.5 {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "internal error (mock)",
            )
        } else {
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded_error",
                "service unavailable (mock)",
            )
        }),
        Fault::OutOfCredit => Some(error(
            StatusCode::FORBIDDEN,
            "insufficient_quota",
            "You exceeded your current quota: out of credit (mock)",
        )),
        Fault::Reset => {
            conn.reset.store(true, Ordering::Relaxed);
            Some(StatusCode::OK.into_response())
        }
        Fault::Hang => {
            tokio::time::sleep(Duration::from_secs(24 * 3600)).await;
            Some(StatusCode::GATEWAY_TIMEOUT.into_response())
        }
        Fault::MalformedJson => Some(
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json")],
                "{\"id\":\"mock\",\"choices\":[{\"message\":{\"content\":\"posi",
            )
                .into_response(),
        ),
        Fault::EmptyLength | Fault::Truncated => None,
    }
}

async fn openai(
    State(st): State<Arc<MockState>>,
    ConnectInfo(conn): ConnectInfo<Conn>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let inc = match st.receive("/v1/chat/completions", &headers, &raw) {
        Ok(i) => i,
        Err(r) => return *r,
    };
    tokio::time::sleep(st.cfg.latency).await;
    if let Some(r) = common_fault(&st, &inc, &conn).await {
        return r;
    }
    axum::Json(openai_json(&st, &inc)).into_response()
}

/// The chat completion a request that drew no transport fault gets (an `empty_length` or
/// `truncated` one included), as the synchronous endpoint and a batch line give it.
fn openai_json(st: &MockState, inc: &Incoming) -> Value {
    let (prompt_tokens, completion, reasoning) = inc.usage().unwrap_or_default();
    let answer = &inc.answer;
    let (content, finish, reasoning_text) = match inc.fault {
        Some(Fault::EmptyLength) => (
            String::new(),
            "length",
            Some("thinking ".repeat((inc.max_tokens as usize).min(4096) / 9 + 1)),
        ),
        Some(Fault::Truncated) => {
            let half: String = answer
                .chars()
                .take(answer.chars().count().div_ceil(2))
                .collect();
            (half, "length", None)
        }
        _ => (answer.clone(), "stop", None),
    };
    let mut message = json!({"role": "assistant", "content": content});
    if let Some(r) = reasoning_text {
        message["reasoning_content"] = json!(r);
    }
    json!({
        "id": format!("chatcmpl-mock-{}-{}-{}", &inc.hash[..inc.hash.len().min(12)], inc.sample, inc.attempt),
        "object": "chat.completion",
        "created": 0,
        "model": inc.body.get("model").cloned().unwrap_or(json!("mock")),
        "system_fingerprint": format!("mock-seed-{}", st.cfg.seed),
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": null}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "completion_tokens_details": {"reasoning_tokens": reasoning}
        }
    })
}

async fn anthropic(
    State(st): State<Arc<MockState>>,
    ConnectInfo(conn): ConnectInfo<Conn>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let inc = match st.receive("/v1/messages", &headers, &raw) {
        Ok(i) => i,
        Err(r) => return *r,
    };
    tokio::time::sleep(st.cfg.latency).await;
    if let Some(r) = common_fault(&st, &inc, &conn).await {
        return r;
    }
    axum::Json(anthropic_json(&inc)).into_response()
}

/// The message a request that drew no transport fault gets, as the synchronous endpoint
/// and a message batch's `succeeded` result give it.
fn anthropic_json(inc: &Incoming) -> Value {
    let (input, output, _) = inc.usage().unwrap_or_default();
    let answer = &inc.answer;
    let (content, stop) = match inc.fault {
        Some(Fault::EmptyLength) => (
            json!([{"type": "thinking", "thinking": "thinking ".repeat((inc.max_tokens as usize).min(4096) / 9 + 1)}]),
            "max_tokens",
        ),
        Some(Fault::Truncated) => {
            let half: String = answer
                .chars()
                .take(answer.chars().count().div_ceil(2))
                .collect();
            (json!([{"type": "text", "text": half}]), "max_tokens")
        }
        _ => (json!([{"type": "text", "text": answer}]), "end_turn"),
    };
    json!({
        "id": format!("msg_mock_{}_{}_{}", &inc.hash[..inc.hash.len().min(12)], inc.sample, inc.attempt),
        "type": "message",
        "role": "assistant",
        "model": inc.body.get("model").cloned().unwrap_or(json!("mock")),
        "content": content,
        "stop_reason": stop,
        "stop_sequence": null,
        "usage": {"input_tokens": input, "output_tokens": output}
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_specs() {
        assert_eq!(
            parse_fault_spec("rate_limit=0.25").unwrap(),
            (Fault::RateLimit, 0.25)
        );
        assert!(parse_fault_spec("nope=0.1").unwrap_err().contains("known:"));
        assert!(parse_fault_spec("hang=2").is_err());
        assert!(parse_fault_spec("hang").is_err());
    }

    #[test]
    fn uniform_is_in_range_and_deterministic() {
        let a = uniform(&[b"x", b"y"]);
        assert_eq!(a, uniform(&[b"x", b"y"]));
        assert!((0.0..1.0).contains(&a));
        assert_ne!(a, uniform(&[b"xy"]));
    }
}
