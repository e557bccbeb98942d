//! The mock's Anthropic Message Batches API.
//!
//! # Behavior
//! - `POST /v1/messages/batches` (`{"requests": [{"custom_id", "params"}]}`, at most 100,000
//!   requests and 256 MB; each `custom_id` 1 to 64 of `[A-Za-z0-9_-]`, unique; each `params`
//!   an object with `model`, `max_tokens` and `messages`, else the create answers 400),
//!   `GET /v1/messages/batches/{id}`, `GET /v1/messages/batches` (newest first, `after_id`,
//!   `before_id`, `limit`; `has_more`, `first_id`, `last_id`),
//!   `POST /v1/messages/batches/{id}/cancel` and `GET /v1/messages/batches/{id}/results`
//!   (JSONL, once the batch has ended). Every route wants an `anthropic-version` header.
//! - A batch is `in_progress` until `--batch-secs` after its creation (`canceling` once a
//!   cancel was asked), then `ended`; times are RFC 3339. Its requests are answered when it
//!   ends, each as the synchronous `/v1/messages` would answer it (same answer mode, same
//!   `--fault` draws), and logged as requests (`path` = `batch:/v1/messages`, `call_id` = the
//!   `custom_id`). The create is logged as `{"path": "/v1/messages/batches", "batch_id",
//!   "custom_ids"}`, the end as `{"path": "batch_final", ...}` as for OpenAI.
//! - Result lines: `{"custom_id", "result": {"type": "succeeded", "message"}}`, or
//!   `errored` with `{"type": "error", "error": {"type", "message"}}` (`rate_limit_error`
//!   for a 429 draw, `api_error` / `overloaded_error` for a 5xx or transport draw,
//!   `permission_error` for out of credit), `canceled`, `expired`.
//! - `--batch-fault`: `invalid` (every request errors with `invalid_request_error`, none
//!   runs), `expire` (the second half of the requests expire), `poll_error` (a retrieve
//!   answers 500), `cut_results` (the first download of the results stops mid-line).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::batch::{BatchFault, log_line};
use super::{Fault, MockState, anthropic_json, uniform};

/// Most requests in one batch.
pub const MAX_REQUESTS: usize = 100_000;
/// Most bytes in one create's body.
pub const MAX_BYTES: usize = 256 * 1024 * 1024;

/// The message batches.
#[derive(Default)]
pub(super) struct Store {
    /// In creation order.
    batches: Vec<MsgBatch>,
    polls: HashMap<String, u64>,
    /// Batches whose next results download is cut short.
    cut_pending: HashSet<String>,
}

struct MsgBatch {
    id: String,
    created: DateTime<Utc>,
    t0: Instant,
    requests: Arc<Vec<Value>>,
    invalid: bool,
    expire: bool,
    cancel_at: Option<DateTime<Utc>>,
    fin: Option<Ended>,
}

struct Ended {
    at: DateTime<Utc>,
    /// succeeded, errored, canceled, expired.
    counts: [usize; 4],
    results: Arc<Vec<u8>>,
}

pub(super) fn routes() -> Router<Arc<MockState>> {
    Router::new()
        .route("/v1/messages/batches", post(create).get(list))
        .route("/v1/messages/batches/{id}", get(retrieve))
        .route("/v1/messages/batches/{id}/cancel", post(cancel))
        .route("/v1/messages/batches/{id}/results", get(results))
        .layer(DefaultBodyLimit::max(MAX_BYTES + 1024))
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

fn bad(msg: &str) -> Response {
    anthropic_error(StatusCode::BAD_REQUEST, "invalid_request_error", msg)
}

/// An error body as the Anthropic API sends it.
fn anthropic_error(status: StatusCode, kind: &str, msg: &str) -> Response {
    (
        status,
        axum::Json(json!({"type": "error", "error": {"type": kind, "message": msg}})),
    )
        .into_response()
}

fn not_found() -> Response {
    anthropic_error(
        StatusCode::NOT_FOUND,
        "not_found_error",
        "No such message batch",
    )
}

/// The refusal of a request without the version header every route wants.
fn unversioned(headers: &HeaderMap) -> Option<Response> {
    (!headers.contains_key("anthropic-version"))
        .then(|| bad("anthropic-version: header is required"))
}

fn valid_custom_id(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Checks a create's requests; the first problem, as the API words it.
fn validate(requests: &[Value]) -> Result<(), String> {
    if requests.is_empty() {
        return Err("requests: at least one request is required".into());
    }
    if requests.len() > MAX_REQUESTS {
        return Err(format!(
            "requests: at most {MAX_REQUESTS} requests per batch, got {}",
            requests.len()
        ));
    }
    let mut seen = HashSet::new();
    for (i, r) in requests.iter().enumerate() {
        let id = r.get("custom_id").and_then(Value::as_str);
        match id {
            Some(c) if !valid_custom_id(c) => {
                return Err(format!(
                    "requests.{i}.custom_id: must match ^[a-zA-Z0-9_-]{{1,64}}$"
                ));
            }
            Some(c) if !seen.insert(c) => {
                return Err(format!(
                    "requests.{i}.custom_id: `{c}` is used by another request"
                ));
            }
            Some(_) => {}
            None => return Err(format!("requests.{i}.custom_id: Field required")),
        }
        let p = r.get("params");
        if !p.is_some_and(Value::is_object) {
            return Err(format!("requests.{i}.params: Field required"));
        }
        for (k, ok) in [
            (
                "model",
                p.and_then(|p| p.get("model")).is_some_and(Value::is_string),
            ),
            (
                "max_tokens",
                p.and_then(|p| p.get("max_tokens"))
                    .is_some_and(Value::is_u64),
            ),
            (
                "messages",
                p.and_then(|p| p.get("messages"))
                    .is_some_and(Value::is_array),
            ),
        ] {
            if !ok {
                return Err(format!("requests.{i}.params.{k}: Field required"));
            }
        }
    }
    Ok(())
}

async fn create(State(st): State<Arc<MockState>>, headers: HeaderMap, raw: Bytes) -> Response {
    if let Some(r) = unversioned(&headers) {
        return r;
    }
    let req: Value = match serde_json::from_slice(&raw) {
        Ok(v) => v,
        Err(e) => return bad(&format!("request body is not JSON: {e}")),
    };
    let Some(requests) = req.get("requests").and_then(Value::as_array) else {
        return bad("requests: Field required");
    };
    if let Err(e) = validate(requests) {
        return bad(&e);
    }
    let mut s = st.msg_batches.lock().unwrap();
    let id = format!("msgbatch_mock{:08}", s.batches.len() + 1);
    let seed = st.cfg.seed.to_be_bytes();
    let draw = |f: BatchFault| uniform(&[&seed, id.as_bytes(), f.name().as_bytes()]);
    let cfg = &st.batch_cfg;
    let b = MsgBatch {
        id: id.clone(),
        created: Utc::now(),
        t0: Instant::now(),
        requests: Arc::new(requests.clone()),
        invalid: draw(BatchFault::Invalid) < cfg.rate(BatchFault::Invalid),
        expire: draw(BatchFault::Expire) < cfg.rate(BatchFault::Expire),
        cancel_at: None,
        fin: None,
    };
    if draw(BatchFault::CutResults) < cfg.rate(BatchFault::CutResults) {
        s.cut_pending.insert(id.clone());
    }
    let custom_ids: Vec<&str> = requests
        .iter()
        .filter_map(|r| r.get("custom_id").and_then(Value::as_str))
        .collect();
    log_line(
        &st,
        json!({"seq": st.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
               "t": Utc::now().timestamp(), "path": "/v1/messages/batches",
               "batch_id": id, "custom_ids": custom_ids}),
    );
    let out = batch_json(&headers, &b);
    s.batches.push(b);
    axum::Json(out).into_response()
}

fn batch_json(headers: &HeaderMap, b: &MsgBatch) -> Value {
    let total = b.requests.len();
    let (status, counts) = match &b.fin {
        Some(f) => ("ended", (0, f.counts)),
        None if b.cancel_at.is_some() => ("canceling", (total, [0; 4])),
        None => ("in_progress", (total, [0; 4])),
    };
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    json!({
        "id": b.id,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": {"processing": counts.0, "succeeded": counts.1[0],
                           "errored": counts.1[1], "canceled": counts.1[2],
                           "expired": counts.1[3]},
        "ended_at": b.fin.as_ref().map(|f| rfc3339(f.at)),
        "created_at": rfc3339(b.created),
        "expires_at": rfc3339(b.created + chrono::Duration::hours(24)),
        "archived_at": null,
        "cancel_initiated_at": b.cancel_at.map(rfc3339),
        "results_url": b.fin.as_ref().map(|_| format!("http://{host}/v1/messages/batches/{}/results", b.id)),
    })
}

/// A request's result as the synchronous endpoint would answer it.
fn answer(st: &MockState, custom_id: &str, params: &Value) -> Value {
    let hash = hex::encode(Sha256::digest(params.to_string().as_bytes()))[..32].to_string();
    let inc = st.receive_parsed(
        "batch:/v1/messages",
        hash,
        0,
        Some(custom_id),
        params.clone(),
    );
    let errored = |kind: &str, msg: &str| json!({"type": "errored", "error": {"type": "error", "error": {"type": kind, "message": msg}}});
    match inc.fault {
        None | Some(Fault::EmptyLength) | Some(Fault::Truncated) => {
            json!({"type": "succeeded", "message": anthropic_json(&inc)})
        }
        Some(Fault::RateLimit) => errored("rate_limit_error", "Rate limit reached (mock)"),
        Some(Fault::ServerError) if inc.u2 >= 0.5 => {
            errored("overloaded_error", "service unavailable (mock)")
        }
        Some(Fault::OutOfCredit) => errored(
            "permission_error",
            "Your credit balance is too low: out of credit (mock)",
        ),
        Some(_) => errored("api_error", "internal error (mock)"),
    }
}

/// Answers a batch's requests (all of them; the first half when it expires; those whose
/// time had come when it was cancelled; none when it is invalid) and ends it.
fn finish(st: &MockState, b: &mut MsgBatch) {
    let n = b.requests.len();
    let answered = if b.invalid {
        0
    } else if b.cancel_at.is_some() {
        let f = b.t0.elapsed().as_secs_f64() / st.batch_cfg.complete_after.as_secs_f64().max(1e-9);
        ((n as f64 * f.min(1.0)) as usize).min(n)
    } else if b.expire {
        n.div_ceil(2)
    } else {
        n
    };
    let mut out = Vec::new();
    let mut counts = [0usize; 4];
    for (k, r) in b.requests.iter().enumerate() {
        let custom_id = r.get("custom_id").and_then(Value::as_str).unwrap_or("");
        let result = if b.invalid {
            json!({"type": "errored", "error": {"type": "error", "error": {
                "type": "invalid_request_error",
                "message": "the request failed validation (mock fault)"
            }}})
        } else if k >= answered {
            json!({"type": if b.cancel_at.is_some() { "canceled" } else { "expired" }})
        } else {
            answer(st, custom_id, r.get("params").unwrap_or(&Value::Null))
        };
        counts[match result["type"].as_str() {
            Some("succeeded") => 0,
            Some("errored") => 1,
            Some("canceled") => 2,
            _ => 3,
        }] += 1;
        serde_json::to_writer(&mut out, &json!({"custom_id": custom_id, "result": result}))
            .expect("a result serialises");
        out.push(b'\n');
    }
    let status = if b.invalid {
        "failed"
    } else if b.cancel_at.is_some() {
        "canceled"
    } else if b.expire {
        "expired"
    } else {
        "ended"
    };
    let now = Utc::now();
    log_line(
        st,
        json!({"path": "batch_final", "batch_id": b.id, "status": status,
               "created": b.created.timestamp_micros() as f64 / 1e6,
               "final": now.timestamp_micros() as f64 / 1e6, "lines": n}),
    );
    b.fin = Some(Ended {
        at: now,
        counts,
        results: Arc::new(out),
    });
}

/// Ends a batch when its time has come.
fn advance(st: &MockState, b: &mut MsgBatch) {
    if b.fin.is_some() {
        return;
    }
    let after = st.batch_cfg.complete_after;
    let due = if b.invalid { after / 10 } else { after };
    if b.cancel_at.is_some() || b.t0.elapsed() >= due {
        finish(st, b);
    }
}

async fn retrieve(
    State(st): State<Arc<MockState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(r) = unversioned(&headers) {
        return r;
    }
    let mut guard = st.msg_batches.lock().unwrap();
    let s = &mut *guard;
    let Some(b) = s.batches.iter_mut().find(|b| b.id == id) else {
        return not_found();
    };
    let n = {
        let c = s.polls.entry(id.clone()).or_insert(0);
        *c += 1;
        *c
    };
    let seed = st.cfg.seed.to_be_bytes();
    let u = uniform(&[&seed, id.as_bytes(), b"poll", &n.to_be_bytes()]);
    if u < st.batch_cfg.rate(BatchFault::PollError) {
        return anthropic_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            "internal error on retrieve (mock)",
        );
    }
    advance(&st, b);
    axum::Json(batch_json(&headers, b)).into_response()
}

async fn cancel(
    State(st): State<Arc<MockState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(r) = unversioned(&headers) {
        return r;
    }
    let mut s = st.msg_batches.lock().unwrap();
    let Some(b) = s.batches.iter_mut().find(|b| b.id == id) else {
        return not_found();
    };
    advance(&st, b);
    if b.fin.is_none() && b.cancel_at.is_none() {
        b.cancel_at = Some(Utc::now());
    }
    axum::Json(batch_json(&headers, b)).into_response()
}

async fn results(
    State(st): State<Arc<MockState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(r) = unversioned(&headers) {
        return r;
    }
    let (bytes, cut) = {
        let mut s = st.msg_batches.lock().unwrap();
        let Some(b) = s.batches.iter_mut().find(|b| b.id == id) else {
            return not_found();
        };
        advance(&st, b);
        let Some(f) = &b.fin else {
            return bad(&format!(
                "Message Batch {id} has not yet ended: its results are not available"
            ));
        };
        let bytes = f.results.clone();
        (bytes, s.cut_pending.remove(&id))
    };
    let body: Vec<u8> = if cut {
        bytes[..(bytes.len() * 3 / 5).max(1).min(bytes.len())].to_vec()
    } else {
        bytes.to_vec()
    };
    ([(header::CONTENT_TYPE, "application/binary")], body).into_response()
}

async fn list(State(st): State<Arc<MockState>>, headers: HeaderMap, uri: Uri) -> Response {
    if let Some(r) = unversioned(&headers) {
        return r;
    }
    let (mut after, mut before, mut limit) = (None, None, 20usize);
    for kv in uri.query().unwrap_or("").split('&') {
        match kv.split_once('=') {
            Some(("after_id", v)) => after = Some(v.to_string()),
            Some(("before_id", v)) => before = Some(v.to_string()),
            Some(("limit", v)) => limit = v.parse().unwrap_or(20).clamp(1, 1000),
            _ => {}
        }
    }
    let mut s = st.msg_batches.lock().unwrap();
    for b in s.batches.iter_mut() {
        advance(&st, b);
    }
    // Newest first: `after_id` pages towards older batches, `before_id` towards newer.
    let newest_first: Vec<&MsgBatch> = s.batches.iter().rev().collect();
    let pos = |id: &str| newest_first.iter().position(|b| b.id == id);
    let (start, end) = match (&after, &before) {
        (Some(a), _) => match pos(a) {
            Some(p) => (p + 1, newest_first.len().min(p + 1 + limit)),
            None => return bad(&format!("after_id: no message batch {a}")),
        },
        (None, Some(b)) => match pos(b) {
            Some(p) => (p.saturating_sub(limit), p),
            None => return bad(&format!("before_id: no message batch {b}")),
        },
        (None, None) => (0, newest_first.len().min(limit)),
    };
    let page: Vec<Value> = newest_first[start..end]
        .iter()
        .map(|b| batch_json(&headers, b))
        .collect();
    let has_more = if before.is_some() && after.is_none() {
        start > 0
    } else {
        end < newest_first.len()
    };
    let first = page.first().and_then(|b| b.get("id").cloned());
    let last = page.last().and_then(|b| b.get("id").cloned());
    axum::Json(json!({"data": page, "has_more": has_more, "first_id": first, "last_id": last}))
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_are_validated_as_the_api_does() {
        let ok =
            json!({"custom_id": "a-1", "params": {"model": "m", "max_tokens": 8, "messages": []}});
        assert_eq!(validate(std::slice::from_ref(&ok)), Ok(()));
        assert!(validate(&[]).unwrap_err().contains("at least one"));
        let dup = validate(&[ok.clone(), ok.clone()]).unwrap_err();
        assert!(dup.starts_with("requests.1.custom_id"), "{dup}");
        let mut bad_id = ok.clone();
        bad_id["custom_id"] = json!("a b");
        assert!(validate(&[bad_id]).unwrap_err().contains("^[a-zA-Z0-9_-]"));
        let mut no_max = ok;
        no_max["params"]
            .as_object_mut()
            .unwrap()
            .remove("max_tokens");
        assert_eq!(
            validate(&[no_max]).unwrap_err(),
            "requests.0.params.max_tokens: Field required"
        );
    }
}
