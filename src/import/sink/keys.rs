//! A record's keys: its case id, request and response hashes, call id and the fingerprint
//! that finds copies of it, computed on rayon's pool a slice of records at a time.

use super::*;

/// The keys of a chunk's records, in order, by slices of 256 records (each slice's keys
/// written in place, not gathered into one vector). Records of one case (its samples, its
/// models) usually sit together: each slice reuses the previous record's hashes when its
/// case or request is the same.
///
/// While the sink counts samples (`counting`), a record without its sample index or
/// imported scores will most likely be counted, and a counted call needs no fingerprint
/// (its id is distinct by its number): it is left to [`Keys::fp`], should the record be
/// staged after all.
pub(super) fn chunk_keys(
    test: &Option<String>,
    records: &[Record],
    counting: bool,
) -> Vec<Vec<Keys>> {
    use rayon::prelude::*;
    records
        .par_chunks(256)
        .map(|chunk| {
            let mut out: Vec<Keys> = Vec::with_capacity(chunk.len());
            for (i, r) in chunk.iter().enumerate() {
                let mut k = match i.checked_sub(1) {
                    Some(p) => keys_after(test, r, &chunk[p], &out[p]),
                    None => keys(test, r),
                };
                if !(counting && r.sample_idx.is_none() && r.scores.is_empty()) {
                    k.fp = Some(k.fp(r).into_owned());
                }
                out.push(k);
            }
            out
        })
        .collect()
}

impl Keys {
    /// The record's fingerprint: the one computed with its keys, else computed now.
    pub(super) fn fp(&self, r: &Record) -> std::borrow::Cow<'_, str> {
        match &self.fp {
            Some(f) => std::borrow::Cow::Borrowed(f),
            None => std::borrow::Cow::Owned(fingerprint(
                r,
                &self.case_id,
                &self.request_hash,
                self.response_hash.as_deref(),
            )),
        }
    }
}

/// [`keys`] of `r`, reusing those of the record before it (`p`, whose keys are `pk`) where
/// the inputs are the same.
pub(super) fn keys_after(test: &Option<String>, r: &Record, p: &Record, pk: &Keys) -> Keys {
    let (rq, pq) = (&*r.request, &*p.request);
    // The same request (one `Arc`, as a reader shares it) is the same case: no text read.
    let same_request = Arc::ptr_eq(&r.request, &p.request);
    let same_case = r.test == p.test
        && (same_request
            || match (&rq.case_id, &pq.case_id) {
                (Some(a), Some(b)) => a == b,
                _ => rq.case_key == pq.case_key && rq.system == pq.system && rq.input == pq.input,
            });
    if !same_case {
        return keys(test, r);
    }
    let request_hash = match &rq.request_hash {
        _ if same_request => pk.request_hash.clone(),
        Some(h) => h.clone(),
        None if pq.request_hash.is_none() && rq.request_key == pq.request_key => {
            pk.request_hash.clone()
        }
        None => call::sha_prefix(&[&rq.request_key], 32).into(),
    };
    let response_hash = call::response_hash(r.response.as_deref());
    Keys {
        test: pk.test.clone(),
        call_id: direct_call_id(r, &pk.case_id, &request_hash),
        fp: None,
        case_id: pk.case_id.clone(),
        case_num: pk.case_num,
        request_hash,
        response_hash,
    }
}

/// [`Keys::fp`]: the case, model, request and answer of a record and every fact recorded
/// about its call, but not its provenance (file, line).
///
/// 24 hex digits of the XXH3-128 of the parts and the facts' `Debug` text
/// ([`fingerprint_reference`]), that text written straight into a buffer kept per thread:
/// the same bytes, no `String` formatted per record. A fingerprint only tells, within one
/// import, whether two records with the same call id are copies (it is written to no
/// table), so a fast non-cryptographic hash is enough: 96 bits, compared only between
/// records whose ids already match. SHA-256 here was a twentieth of an import's CPU.
pub(super) fn fingerprint(
    r: &Record,
    case_id: &str,
    request_hash: &str,
    response_hash: Option<&str>,
) -> String {
    thread_local! {
        static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with_borrow_mut(|buf| {
        buf.clear();
        for p in [
            case_id,
            &r.request.model,
            request_hash,
            response_hash.unwrap_or(""),
        ] {
            buf.extend_from_slice(p.as_bytes());
            buf.push(0);
        }
        let mut w = DebugInto(buf);
        w.raw("(");
        w.int(r.sample_idx.map(i64::from));
        w.raw(", ");
        w.text(r.finish_reason.as_deref());
        for x in [
            r.prompt_tokens,
            r.completion_tokens,
            r.reasoning_tokens,
            r.reasoning_chars,
            r.http_status.map(i64::from),
        ] {
            w.raw(", ");
            w.int(x);
        }
        w.raw(", ");
        w.text(r.error.as_deref());
        w.raw(")|(");
        w.int(r.attempts.map(i64::from));
        w.raw(", ");
        w.debug(&r.latency_ms);
        w.raw(", ");
        w.int(r.started_at_us);
        w.raw(", ");
        w.text(r.expected.as_deref());
        w.raw(", ");
        w.text(r.provider.as_deref());
        w.raw(", ");
        if r.scores.is_empty() {
            w.raw("[]");
        } else {
            w.debug(&r.scores);
        }
        w.raw(if response_hash.is_some() {
            ", true)"
        } else {
            ", false)"
        });
        buf.push(0);
        fp_digest(buf)
    })
}

/// 24 hex digits of the XXH3-128 of `bytes` (see [`fingerprint`]).
fn fp_digest(bytes: &[u8]) -> String {
    let digest = twox_hash::XxHash3_128::oneshot(bytes).to_be_bytes();
    let mut out = [0u8; 24];
    hex::encode_to_slice(&digest[..12], &mut out).expect("24 hex digits fit");
    String::from_utf8(out.to_vec()).expect("hex digits are ASCII")
}

/// Writes `Debug` text of the fingerprint's facts into a buffer: integers and plain text
/// by hand, anything else through `fmt`.
pub(super) struct DebugInto<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for DebugInto<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

impl DebugInto<'_> {
    pub(super) fn raw(&mut self, s: &str) {
        self.0.extend_from_slice(s.as_bytes());
    }

    pub(super) fn debug<T: std::fmt::Debug>(&mut self, x: &T) {
        use std::fmt::Write;
        write!(self, "{x:?}").expect("a buffer takes any text");
    }

    /// `Some(n)` or `None`, as `Option<i32>` and `Option<i64>` print.
    pub(super) fn int(&mut self, x: Option<i64>) {
        match x {
            None => self.raw("None"),
            Some(n) => {
                let mut buf = [0u8; 20];
                let mut i = buf.len();
                let mut m = n.unsigned_abs();
                loop {
                    i -= 1;
                    buf[i] = b'0' + (m % 10) as u8;
                    m /= 10;
                    if m == 0 {
                        break;
                    }
                }
                self.raw("Some(");
                if n < 0 {
                    self.raw("-");
                }
                self.0.extend_from_slice(&buf[i..]);
                self.raw(")");
            }
        }
    }

    /// `Some("...")` or `None`, as `Option<String>` prints: text of printable ASCII with no
    /// quote or backslash as it is, anything else escaped by `fmt`.
    pub(super) fn text(&mut self, x: Option<&str>) {
        match x {
            None => self.raw("None"),
            Some(s)
                if s.bytes()
                    .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\') =>
            {
                self.raw("Some(\"");
                self.raw(s);
                self.raw("\")");
            }
            Some(s) => {
                self.raw("Some(");
                self.debug(&s);
                self.raw(")");
            }
        }
    }
}

/// [`fingerprint`] written plainly (the facts' `Debug` text formatted, then hashed), which
/// it must equal: a record's fingerprint must not depend on the path that computed it.
#[cfg(test)]
pub(super) fn fingerprint_reference(
    r: &Record,
    case_id: &str,
    request_hash: &str,
    response_hash: Option<&str>,
) -> String {
    let facts = format!(
        "{:?}|{:?}",
        (
            r.sample_idx,
            &r.finish_reason,
            r.prompt_tokens,
            r.completion_tokens,
            r.reasoning_tokens,
            r.reasoning_chars,
            r.http_status,
            &r.error,
        ),
        (
            r.attempts,
            r.latency_ms,
            r.started_at_us,
            &r.expected,
            &r.provider,
            &r.scores,
            response_hash.is_some(),
        )
    );
    let mut bytes = Vec::new();
    for p in [
        case_id,
        &r.request.model,
        request_hash,
        response_hash.unwrap_or(""),
        &facts,
    ] {
        bytes.extend_from_slice(p.as_bytes());
        bytes.push(0);
    }
    fp_digest(&bytes)
}

/// A record's test (`test`, the `--test` default, over the record's own), case id, hashes
/// and (direct records) call id.
pub(super) fn keys(test: &Option<String>, r: &Record) -> Keys {
    let test: Arc<str> = test
        .as_deref()
        .or(r.test.as_deref())
        .unwrap_or("imported")
        .into();
    let rq = &*r.request;
    let case_id: Arc<str> = match &rq.case_id {
        Some((t, id)) if *t == test => id.clone(),
        _ => crate::import::case_id(
            &test,
            rq.case_key.as_deref(),
            rq.system.as_deref(),
            &rq.input,
        )
        .into(),
    };
    let request_hash: Arc<str> = match &rq.request_hash {
        Some(h) => h.clone(),
        None => call::sha_prefix(&[&rq.request_key], 32).into(),
    };
    let response_hash = call::response_hash(r.response.as_deref());
    Keys {
        call_id: direct_call_id(r, &case_id, &request_hash),
        fp: None,
        response_hash,
        request_hash,
        test,
        case_num: case_num(&case_id),
        case_id,
    }
}

/// A case id of at most 24 hex digits (a digest prefix, as [`crate::import::case_id`]
/// writes them) as a number: the sink's per-case tables hash and compare 16 bytes held in
/// place, not a text behind a pointer. Computed with the keys, on rayon's pool, not on the
/// task that stages records in order.
pub(super) fn case_num(case_id: &str) -> Option<u128> {
    (case_id.len() <= 24)
        .then(|| u128::from_str_radix(case_id, 16).ok())
        .flatten()
}

/// The call id of a record that can go straight to `calls` (it names its sample and has
/// no imported scores to join), else `None`.
pub(super) fn direct_call_id(r: &Record, case_id: &str, request_hash: &str) -> Option<String> {
    match r.sample_idx {
        Some(s) if r.scores.is_empty() => {
            Some(call::call_id(case_id, &r.request.model, s, request_hash))
        }
        _ => None,
    }
}
