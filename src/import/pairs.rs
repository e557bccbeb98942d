//! evalflow's own JSONL request/response pairs, read line by line.
//!
//! # Behavior
//! One `{"request": {...}, "response": {...}}` pair per line in the OpenAI chat format;
//! optional `sample_idx`, `expected`, `http_status`, `error` (text, or an object such as
//! `{"code", "message"}`), `latency_ms`, `provider`, `attempts`, `started_at` (RFC 3339
//! text or Unix seconds), `test` and `capability`; the `--cluster` field is a top-level
//! field or one of `metadata`. The input is the last user message, the system the last
//! system (or developer) message; the case is the whole request (every message and the
//! parameters, see [`super::request_case_key`]). A response that is an error body
//! (`{"error": {...}}`, with the line's `http_status`) is a provider error. `source_id` is
//! the line number (the pairs format has no id of its own).
//!
//! # Errors
//! A bad line names `file:line` and the field; a mistyped optional field is an error,
//! never a silent NULL or a value wrapped through `as u32`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde_json::Value;
use serde_json::value::RawValue;

use super::{ImportError, Options, Provenance, Record, RecordIter, bad, bad_file};
use crate::stages::call::openai;

/// Bytes the reader thread takes from the file at a time (whole lines; a longer line makes
/// a longer block): big enough that a parse of a block keeps every core busy, small enough
/// that memory holds a few blocks, never the file.
const BLOCK_BYTES: usize = 4 << 20;

/// Whole lines of the file, with the number of the first.
struct Block {
    first_line: usize,
    data: Bytes,
    /// The block's lines are `data[..len]` (a mapped window ends inside the next line).
    len: usize,
    /// How many lines it holds.
    lines: usize,
}

impl Block {
    fn lines(&self) -> &[u8] {
        &self.data[..self.len]
    }
}

/// A block's bytes: a window of the file mapped into memory, so the parse reads the page
/// cache where it is rather than a copy that `read` made of it; or, where the file cannot
/// be mapped (a pipe, a special file), bytes read into a buffer.
enum Bytes {
    Mapped(memmap2::Mmap),
    Read(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Read(v) => v,
        }
    }
}

/// Opens a pairs file: one record per non-empty line, in file order.
///
/// One thread cuts the file into blocks of whole lines (windows mapped into memory,
/// [`map_blocks`], or for a pipe buffers read, [`read_blocks`]) and counts their lines;
/// another hands each block to rayon's pool (sized by `--threads`), which splits it into
/// lines and parses them, and queues the block's result in file order. Two blocks are
/// parsed at once, so the pool never waits for the end of a block (or for the consumer)
/// before it starts the next. Counting the next block's lines (which faults its pages
/// in) overlaps the parse, so a file that is not in the page cache costs its disk time
/// beside the parsing rather than before it; bounded channels keep at most a few blocks
/// and parsed blocks in memory. Lines are split and checked for UTF-8 in the parse, on
/// every core, not one line at a time on the reader.
///
/// # Errors
/// The file cannot be opened.
pub fn open(path: &Path, opts: &Options) -> Result<RecordIter, ImportError> {
    type Parsed = Vec<Vec<Result<Record, ImportError>>>;
    let f = std::fs::File::open(path).map_err(|e| bad_file(path, e))?;
    let file = std::sync::Arc::new(path.to_path_buf());
    let model = std::sync::Arc::new(opts.model.clone());
    let cluster = std::sync::Arc::new(opts.cluster.clone());
    let cache = std::sync::Arc::new(RequestCache::default());
    let (btx, brx) = std::sync::mpsc::sync_channel::<std::io::Result<Block>>(2);
    std::thread::spawn(move || match f.metadata() {
        Ok(m) if m.is_file() => map_blocks(&f, m.len(), &btx),
        _ => read_blocks(f, &btx),
    });
    // Each block's parse, in file order: the consumer waits on the first.
    let (tx, rx) = std::sync::mpsc::sync_channel::<std::sync::mpsc::Receiver<Parsed>>(1);
    std::thread::spawn(move || {
        let mut next_line = 1;
        for block in brx {
            let block = match block {
                Ok(b) => b,
                Err(e) => {
                    let (etx, erx) = std::sync::mpsc::sync_channel(1);
                    let _ = etx.send(vec![vec![Err(bad(&file, next_line, "(line)", e).fatal())]]);
                    let _ = tx.send(erx);
                    return;
                }
            };
            next_line = block.first_line + block.lines;
            let (ptx, prx) = std::sync::mpsc::sync_channel(1);
            // The consumer was dropped (it stops at the first error): read no further.
            if tx.send(prx).is_err() {
                return;
            }
            let (file, model, cluster) = (file.clone(), model.clone(), cluster.clone());
            let cache = cache.clone();
            rayon::spawn(move || {
                let _ = ptx.send(parse_block(&file, &model, &cluster, &cache, &block));
            });
        }
    });
    // A parse job cannot drop its sender without sending: a panic in a `rayon::spawn` job
    // aborts the process (rayon's default), so no block is skipped silently here.
    let parsed = rx.into_iter().map_while(|p| p.recv().ok());
    // Every line, bad ones as errors: the caller reports them all (or skips them) and
    // stops reading when it wants.
    Ok(Box::new(parsed.flatten().flatten()))
}

/// A block's records, parsed slice by slice on rayon's pool (each slice's records written
/// in place, not gathered into one vector).
fn parse_block(
    file: &Path,
    model: &Option<String>,
    cluster: &Option<String>,
    cache: &RequestCache,
    block: &Block,
) -> Vec<Vec<Result<Record, ImportError>>> {
    use rayon::prelude::*;
    // Each record's `source_file`, written out once per block.
    let file_text = file.display().to_string();
    // Slices in order, each remembering its last request: the samples and models of a
    // case usually sit together and send the same request text.
    split_lines(block)
        .par_chunks(SLICE_LINES)
        .map(|slice| {
            let mut seen = Seen { cache, last: None };
            slice
                .iter()
                .filter_map(|&(n, line)| match std::str::from_utf8(line) {
                    Err(e) => Some(Err(bad(file, n, "(line)", format!("invalid UTF-8: {e}")))),
                    Ok(l) if l.trim().is_empty() => None,
                    Ok(l) => Some(
                        record(file, &file_text, n, l, model, cluster, &mut seen)
                            .map_err(|e| e.with_raw(l)),
                    ),
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A block's lines with their numbers, as `BufRead::lines` gives them (without `\n` or
/// `\r\n`; a last line without newline is a line).
fn split_lines(block: &Block) -> Vec<(usize, &[u8])> {
    let data = block.lines();
    let mut out = Vec::with_capacity(data.len() / 256);
    let mut start = 0;
    let mut push = |start: usize, end: usize| {
        let l = &data[start..end];
        out.push((
            block.first_line + out.len(),
            l.strip_suffix(b"\r").unwrap_or(l),
        ));
    };
    for end in memchr::memchr_iter(b'\n', data) {
        push(start, end);
        start = end + 1;
    }
    if start < data.len() {
        push(start, data.len());
    }
    out
}

/// Sends a regular file as [`Block`]s of about [`BLOCK_BYTES`] of whole lines, each a
/// window of the file mapped into memory and unmapped once its lines are parsed, so the
/// resident memory is the blocks in flight, never the file. A window with no newline (a line
/// longer than a block) is mapped again twice as large.
///
/// A file truncated while it is mapped kills the process (SIGBUS) instead of yielding half a
/// line: import writes under `_import/` until it finishes, so no table is left half-written.
fn map_blocks(
    f: &std::fs::File,
    size: u64,
    tx: &std::sync::mpsc::SyncSender<std::io::Result<Block>>,
) {
    let (mut start, mut first_line, mut window) = (0u64, 1, BLOCK_BYTES as u64);
    while start < size {
        let len = window.min(size - start);
        // SAFETY: the map is read only; the file is one evalflow opened to import and does
        // not write (see above for a file that another process truncates).
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(start)
                .len(len as usize)
                .map(f)
        };
        let map = match map {
            Ok(m) => m,
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        // A file not in the page cache: read the whole window ahead, not page by page as the
        // line count below touches it. Only a hint; a refusal changes nothing.
        let _ = map.advise(memmap2::Advice::WillNeed);
        let end = if start + len == size {
            len as usize
        } else {
            // Cut after the last newline; the partial line starts the next block.
            match memchr::memrchr(b'\n', &map) {
                Some(e) => e + 1,
                None => {
                    window *= 2;
                    continue;
                }
            }
        };
        let lines = memchr::memchr_iter(b'\n', &map[..end]).count();
        let block = Block {
            first_line,
            data: Bytes::Mapped(map),
            len: end,
            lines,
        };
        if tx.send(Ok(block)).is_err() {
            return;
        }
        (start, first_line, window) = (start + end as u64, first_line + lines, BLOCK_BYTES as u64);
    }
}

/// Sends the file as [`Block`]s of about [`BLOCK_BYTES`] of whole lines read into buffers
/// (the last line may lack its newline), until the end, a read error, or a receiver that
/// hung up: for a file that cannot be mapped.
fn read_blocks(mut f: std::fs::File, tx: &std::sync::mpsc::SyncSender<std::io::Result<Block>>) {
    use std::io::Read;
    let mut carry: Vec<u8> = Vec::new();
    let mut first_line = 1;
    loop {
        // Bounded: at most BLOCK_BYTES more than the partial line carried over. Only a line
        // longer than a block grows the buffer past that, until its newline, as
        // `BufRead::lines` would also hold it whole: a record is one line.
        let mut data = std::mem::take(&mut carry);
        data.reserve(BLOCK_BYTES);
        let read = (&mut f).take(BLOCK_BYTES as u64).read_to_end(&mut data);
        match read {
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
            Ok(0) => {
                if !data.is_empty() {
                    // The last line, without its newline.
                    let len = data.len();
                    let data = Bytes::Read(data);
                    let _ = tx.send(Ok(Block {
                        first_line,
                        data,
                        len,
                        lines: 1,
                    }));
                }
                return;
            }
            Ok(_) => {}
        }
        // Cut after the last newline; the partial line starts the next block.
        let Some(end) = memchr::memrchr(b'\n', &data) else {
            carry = data;
            continue;
        };
        carry = data[end + 1..].to_vec();
        data.truncate(end + 1);
        let lines = memchr::memchr_iter(b'\n', &data).count();
        let len = data.len();
        let data = Bytes::Read(data);
        if tx
            .send(Ok(Block {
                first_line,
                data,
                len,
                lines,
            }))
            .is_err()
        {
            return;
        }
        first_line += lines;
    }
}

/// Lines a parse task takes in order (and so the reach of the last-request reuse).
const SLICE_LINES: usize = 256;

/// Distinct request texts a [`RequestCache`] holds at most (about 40 MB of requests and
/// what they gave at the bench's sizes): more than the requests of a shuffled block of a
/// log that repeats each request (5,000 cases x 5 models in the bench's repeated corpus).
const CACHED_REQUESTS: usize = 32_768;

/// Shards of a [`RequestCache`], so the parse threads rarely wait on one lock.
const CACHE_SHARDS: usize = 16;

/// What the requests read lately gave, by their text byte for byte, shared by every parse
/// thread of a file: a log that sends each request many times (samples, models, retries),
/// in any order, parses each distinct request (and writes its keys) about once, not once
/// per line. [`request`] is a function of the text alone, so a cached request is the one
/// a parse would give. A shard that fills is emptied: memory stays bounded whatever the
/// corpus, at the cost of parsing its requests again.
#[derive(Default)]
struct RequestCache {
    shards: [Shard; CACHE_SHARDS],
}

/// A [`RequestCache`] shard: request text to what it gave.
type Shard = Mutex<HashMap<Box<str>, Arc<Request>, FastHash>>;

/// The requests a parse slice has read: the last line's, and the file's cache.
struct Seen<'a> {
    cache: &'a RequestCache,
    last: Option<(String, Arc<Request>)>,
}

impl RequestCache {
    fn shard(&self, text: &str) -> &Shard {
        use std::hash::BuildHasher;
        &self.shards[(FastHash.hash_one(text) >> 60) as usize % CACHE_SHARDS]
    }

    fn get(&self, text: &str) -> Option<Arc<Request>> {
        let shard = self.shard(text).lock().unwrap_or_else(|e| e.into_inner());
        shard.get(text).cloned()
    }

    fn put(&self, text: &str, rq: Arc<Request>) {
        let mut shard = self.shard(text).lock().unwrap_or_else(|e| e.into_inner());
        if shard.len() >= CACHED_REQUESTS / CACHE_SHARDS {
            shard.clear();
        }
        shard.insert(text.into(), rq);
    }
}

/// A hash of request texts eight bytes at a time: a table's keys are compared in full, so
/// it only needs to spread them, and SipHash over every request of a corpus costs about as
/// much as the SHA-256 of it.
#[derive(Default, Clone, Copy)]
struct FastHash;

impl std::hash::BuildHasher for FastHash {
    type Hasher = FastHasher;
    fn build_hasher(&self) -> FastHasher {
        FastHasher(0x243f_6a88_85a3_08d3)
    }
}

struct FastHasher(u64);

impl std::hash::Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(K);
        }
        let mut tail = [0u8; 8];
        tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
        self.0 =
            (self.0.rotate_left(5) ^ u64::from_le_bytes(tail) ^ bytes.len() as u64).wrapping_mul(K);
    }

    fn finish(&self) -> u64 {
        // Mix the high bits down: the table uses the low ones, the shard the top four.
        let x = self.0 ^ (self.0 >> 29);
        x.wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ (x >> 32)
    }
}

/// What a line's `request` gives its record.
#[derive(Clone)]
struct Request {
    system: Option<String>,
    input: String,
    model: Option<String>,
    /// The request as `Value::to_string()` writes it (keys sorted): hashed into
    /// `request_hash`, so it must not change with how the file spaced or ordered it.
    key: String,
    max_tokens: Option<u32>,
    temperature: Option<f64>,
    /// The whole conversation and its parameters when they say more than (system,
    /// input): see [`super::request_case_key`].
    case_key: Option<String>,
}

/// Reads a line's `request` object.
fn request(file: &Path, n: usize, req: &Value) -> Result<Request, ImportError> {
    check_request_fields(file, n, req)?;
    let msgs = req
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| bad(file, n, "request.messages", "missing or not an array"))?;
    if let Some(i) = msgs
        .iter()
        .position(|m| m.get("role").and_then(Value::as_str).is_none())
    {
        return Err(bad(
            file,
            n,
            &format!("request.messages[{i}].role"),
            "missing",
        ));
    }
    let (system, input) = super::chat_prompt(msgs);
    let input = input.ok_or_else(|| {
        bad(
            file,
            n,
            "request.messages",
            "no user message with text content",
        )
    })?;
    Ok(Request {
        system,
        input,
        model: req.get("model").and_then(Value::as_str).map(String::from),
        // The text `Value::to_string()` writes, through a `Vec` rather than `fmt`'s
        // adapter: about half the time.
        key: serde_json::to_string(req).expect("a Value serializes"),
        max_tokens: req
            .get("max_tokens")
            .and_then(Value::as_u64)
            .map(|m| m as u32),
        temperature: req.get("temperature").and_then(Value::as_f64),
        case_key: super::request_case_key(req),
    })
}

/// A line's fields, as raw text borrowed from the line but for the response, which is
/// `R`: types read in the same pass ([`TypedBody`]) or raw text too. A JSON `null` is
/// `None` as an absent field is; fields of other names are ignored.
#[derive(serde::Deserialize)]
struct Line<'a, R> {
    #[serde(borrow)]
    request: Option<&'a RawValue>,
    response: Option<R>,
    #[serde(borrow)]
    sample_idx: Option<&'a RawValue>,
    #[serde(borrow)]
    expected: Option<&'a RawValue>,
    #[serde(borrow)]
    http_status: Option<&'a RawValue>,
    #[serde(borrow)]
    error: Option<&'a RawValue>,
    #[serde(borrow)]
    latency_ms: Option<&'a RawValue>,
    #[serde(borrow)]
    provider: Option<&'a RawValue>,
    #[serde(borrow)]
    attempts: Option<&'a RawValue>,
    #[serde(borrow)]
    started_at: Option<&'a RawValue>,
    #[serde(borrow)]
    test: Option<&'a RawValue>,
    #[serde(borrow)]
    capability: Option<&'a RawValue>,
}

/// A response read as types while its line is split.
type TypedBody = openai::MapOnly<openai::TypedResponse>;

/// A line's response: read with the line, or raw text for [`openai::parse`].
enum Response<'a> {
    Parsed(crate::stages::call::http::Parsed),
    Raw(&'a RawValue),
}

/// A line's optional scalar fields, each read on its own from its raw text (`null` kept
/// as `Value::Null`, an absent field `None`): no map of them is built per line.
struct Scalars {
    sample_idx: Option<Value>,
    expected: Option<Value>,
    http_status: Option<Value>,
    error: Option<Value>,
    latency_ms: Option<Value>,
    provider: Option<Value>,
    attempts: Option<Value>,
    started_at: Option<Value>,
    test: Option<Value>,
    capability: Option<Value>,
}

impl Scalars {
    fn of<R>(line: &Line<R>) -> Self {
        let read = |raw: Option<&RawValue>| {
            raw.map(|r| serde_json::from_str::<Value>(r.get()).expect("raw JSON re-parses"))
        };
        Scalars {
            sample_idx: read(line.sample_idx),
            expected: read(line.expected),
            http_status: read(line.http_status),
            error: read(line.error),
            latency_ms: read(line.latency_ms),
            provider: read(line.provider),
            attempts: read(line.attempts),
            started_at: read(line.started_at),
            test: read(line.test),
            capability: read(line.capability),
        }
    }
}

/// One line as a record (`file_text` is `file` as `source_file` names it). `last` is the
/// previous line's request text and what it gave, reused when this line's request text is
/// the same byte for byte, as is what `cache` holds for it (both in `seen`).
///
/// The line is split into its fields with `request` left as raw text, parsed only when it
/// differs from the last one, and the response read as types in the same pass (else as raw
/// text, by [`openai::parse`]), so no `Value` tree is built for a well-formed line but its
/// small top-level fields.
fn record(
    file: &Path,
    file_text: &str,
    n: usize,
    line: &str,
    model: &Option<String>,
    cluster: &Option<String>,
    seen: &mut Seen,
) -> Result<Record, ImportError> {
    // One pass for a well-formed line: its response read as types while the line is split.
    // A line that pass refuses (any stray shape or type, a field named twice) or whose
    // response has no choice is split again with the response as raw text, which gives
    // the same record or the error naming the field.
    let typed = serde_json::from_str::<Line<TypedBody>>(line)
        .ok()
        .and_then(|mut f| {
            let resp = match f.response.take() {
                None => None,
                Some(body) => Some(Response::Parsed(openai::parsed_of(body)?)),
            };
            Some((f.request, Scalars::of(&f), resp))
        });
    let (req, v, resp) = match typed {
        Some(parts) => parts,
        None => {
            let f: Line<&RawValue> = match serde_json::from_str(line) {
                Ok(f) => f,
                Err(e) => {
                    // Not JSON (the parser's own message), JSON that is not an object, or
                    // an object that names a field twice.
                    let v = serde_json::from_str::<Value>(line)
                        .map_err(|e| bad(file, n, "(line)", format!("not JSON: {e}")))?;
                    if v.is_object() {
                        return Err(bad(file, n, "(line)", e));
                    }
                    return Err(bad(file, n, "request", "missing or not an object"));
                }
            };
            (f.request, Scalars::of(&f), f.response.map(Response::Raw))
        }
    };
    let req = req
        .filter(|r| r.get().starts_with('{'))
        .ok_or_else(|| bad(file, n, "request", "missing or not an object"))?;
    let rq = match seen.last.as_ref() {
        Some((text, rq)) if text == req.get() => Request::clone(rq),
        _ => {
            let rq = match seen.cache.get(req.get()) {
                Some(rq) => rq,
                None => {
                    let parsed: Value =
                        serde_json::from_str(req.get()).expect("raw JSON re-parses");
                    let rq = Arc::new(request(file, n, &parsed)?);
                    seen.cache.put(req.get(), rq.clone());
                    rq
                }
            };
            let out = Request::clone(&rq);
            seen.last = Some((req.get().to_string(), rq));
            out
        }
    };
    check_optional_fields(file, n, &v)?;
    let source_model = rq.model;
    let model = model
        .clone()
        .or(source_model.clone())
        .ok_or_else(|| bad(file, n, "request.model", "missing (or pass --model)"))?;
    let status = v
        .http_status
        .as_ref()
        .and_then(Value::as_i64)
        .map(|s| s as i32);
    let mut error = v.error.as_ref().and_then(super::error_text);
    let text = |x: &Option<Value>, field: &str| -> Result<Option<String>, ImportError> {
        match x {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(x) => Err(bad(file, n, field, format!("`{x}` is not a string"))),
        }
    };
    let (test, capability) = (text(&v.test, "test")?, text(&v.capability, "capability")?);
    let cluster = match cluster {
        Some(f) => cluster_of(line, f),
        None => None,
    };
    let mut r = Record {
        model,
        source_model,
        test,
        capability,
        cluster,
        case_key: rq.case_key,
        system: rq.system,
        input: rq.input,
        expected: v
            .expected
            .as_ref()
            .and_then(Value::as_str)
            .map(String::from),
        request_key: rq.key,
        max_tokens: rq.max_tokens,
        temperature: rq.temperature,
        http_status: status,
        source: Provenance {
            format: "pairs",
            file: file_text.to_string(),
            id: Some(n.to_string()),
        },
        ..Record::default()
    };
    // An error body in place of a completion (`"response": {"error": {...}}`, as a server
    // answers a 4xx or 5xx) is a provider error, not a bad line.
    let error_body = match &resp {
        Some(Response::Raw(raw)) if raw.get().starts_with('{') => {
            match serde_json::from_str::<Value>(raw.get()) {
                Ok(Value::Object(m)) if m.contains_key("error") && !m.contains_key("choices") => {
                    m.get("error").and_then(super::error_text)
                }
                _ => None,
            }
        }
        _ => None,
    };
    let is_error_body = error_body.is_some();
    if let Some(e) = error_body {
        error.get_or_insert(e);
    }
    let parsed = match resp {
        Some(Response::Parsed(p)) => Some(p),
        _ if is_error_body => None,
        None if error.is_some() => None,
        Some(Response::Raw(raw)) if raw.get() == "null" && error.is_some() => None,
        Some(Response::Raw(raw)) if raw.get().starts_with('{') => {
            Some(openai::parse(raw.get().as_bytes()).map_err(|e| bad(file, n, "response", e))?)
        }
        _ => return Err(bad(file, n, "response", "missing or not an object")),
    };
    if let Some(p) = parsed {
        r.set_response(p);
        r.http_status = status.or(Some(200));
    }
    r.error = error;
    r.sample_idx = match &v.sample_idx {
        None | Some(Value::Null) => None,
        Some(s) => Some(
            s.as_i64()
                .filter(|k| (0..=i32::MAX as i64).contains(k))
                .ok_or_else(|| bad(file, n, "sample_idx", "not a non-negative integer"))?
                as i32,
        ),
    };
    facts(file, n, &v, &mut r)?;
    Ok(r)
}

/// The optional `provider`, `attempts`, `latency_ms` and `started_at` (RFC 3339 text or
/// Unix seconds) of a line.
fn facts(file: &Path, n: usize, v: &Scalars, r: &mut Record) -> Result<(), ImportError> {
    fn field(x: &Option<Value>) -> Option<&Value> {
        x.as_ref().filter(|x| !x.is_null())
    }
    if let Some(p) = field(&v.provider) {
        r.provider = Some(
            p.as_str()
                .ok_or_else(|| bad(file, n, "provider", "not a string"))?
                .to_string(),
        );
    }
    if let Some(a) = field(&v.attempts) {
        r.attempts = Some(
            a.as_i64()
                .filter(|k| (0..=i32::MAX as i64).contains(k))
                .ok_or_else(|| bad(file, n, "attempts", "not a non-negative integer"))?
                as i32,
        );
    }
    if let Some(l) = field(&v.latency_ms) {
        r.latency_ms = Some(
            l.as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| bad(file, n, "latency_ms", "not a non-negative number"))?,
        );
    }
    r.started_at_us = match field(&v.started_at) {
        None => None,
        Some(Value::String(t)) => Some(
            chrono::DateTime::parse_from_rfc3339(t)
                .map_err(|e| bad(file, n, "started_at", format!("not an RFC 3339 time: {e}")))?
                .timestamp_micros(),
        ),
        Some(x) => Some(
            x.as_f64()
                .filter(|s| s.is_finite())
                .map(|s| (s * 1e6).round() as i64)
                .ok_or_else(|| {
                    bad(
                        file,
                        n,
                        "started_at",
                        "not an RFC 3339 time or Unix seconds",
                    )
                })?,
        ),
    };
    Ok(())
}

/// An integer field in `lo..=hi`, when present and not null.
fn check_int(
    file: &Path,
    n: usize,
    x: Option<&Value>,
    field: &str,
    lo: i64,
    hi: i64,
) -> Result<(), ImportError> {
    match x {
        None | Some(Value::Null) => Ok(()),
        Some(x) => match x.as_i64() {
            Some(k) if (lo..=hi).contains(&k) => Ok(()),
            _ => Err(bad(
                file,
                n,
                field,
                format!("`{x}` is not an integer in {lo}..={hi}"),
            )),
        },
    }
}

/// A field of the type `ok` checks, when present and not null.
fn check_typed(
    file: &Path,
    n: usize,
    x: Option<&Value>,
    field: &str,
    ok: fn(&Value) -> bool,
    what: &str,
) -> Result<(), ImportError> {
    match x {
        Some(x) if !x.is_null() && !ok(x) => {
            Err(bad(file, n, field, format!("`{x}` is not {what}")))
        }
        _ => Ok(()),
    }
}

/// The request's optional fields must have their type when present.
fn check_request_fields(file: &Path, n: usize, req: &Value) -> Result<(), ImportError> {
    check_int(
        file,
        n,
        req.get("max_tokens"),
        "request.max_tokens",
        0,
        i32::MAX as i64,
    )?;
    check_typed(
        file,
        n,
        req.get("temperature"),
        "request.temperature",
        Value::is_number,
        "a number",
    )
}

/// The line's optional fields must have their type when present.
fn check_optional_fields(file: &Path, n: usize, v: &Scalars) -> Result<(), ImportError> {
    check_int(file, n, v.http_status.as_ref(), "http_status", 100, 599)?;
    check_typed(
        file,
        n,
        v.latency_ms.as_ref(),
        "latency_ms",
        Value::is_number,
        "a number",
    )?;
    check_typed(
        file,
        n,
        v.expected.as_ref(),
        "expected",
        Value::is_string,
        "a string",
    )?;
    check_typed(
        file,
        n,
        v.error.as_ref(),
        "error",
        |x| x.is_string() || x.is_object(),
        "a string or an object",
    )
}

/// The value of the `--cluster` field of a line: a top-level field, else one of its
/// `metadata` object; `None` when the line has neither.
fn cluster_of(line: &str, field: &str) -> Option<String> {
    let v: serde_json::Map<String, Value> = serde_json::from_str(line).ok()?;
    v.get(field)
        .filter(|x| !x.is_null())
        .or_else(|| v.get("metadata").and_then(|m| m.get(field)))
        .and_then(super::as_text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request key is the request as `Value` writes it, whether the line's request text
    /// is reused from the line before or parsed again, and however the file spaced it.
    #[test]
    fn request_keys_do_not_depend_on_spacing_or_reuse() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.jsonl");
        let resp = r#""response": {"choices": [{"message": {"content": "ok"}}]}"#;
        let a = r#"{"temperature": 0.5, "model": "m", "messages": [{"role": "user", "content": "hi"}]}"#;
        let b = r#"{"messages":[{"content":"hi","role":"user"}],"model":"m","temperature":0.5}"#;
        let lines = [
            format!(r#"{{"request": {a}, {resp}, "sample_idx": 0}}"#),
            format!(r#"{{"request": {a}, {resp}, "sample_idx": 1}}"#),
            format!(r#"{{"sample_idx": 2, {resp}, "request": {b}}}"#),
            format!(r#"{{"request": {a}, "response": null, "error": "boom", "sample_idx": 3}}"#),
        ];
        std::fs::write(&p, lines.join("\n")).unwrap();
        let records: Vec<Record> = open(&p, &Options::default())
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let want = serde_json::from_str::<Value>(a).unwrap().to_string();
        assert_eq!(records.len(), 4);
        for (i, r) in records.iter().enumerate() {
            assert_eq!(r.request_key, want, "line {}", i + 1);
            assert_eq!((r.input.as_str(), r.model.as_str()), ("hi", "m"));
            assert_eq!(r.temperature, Some(0.5));
            assert_eq!(r.sample_idx, Some(i as i32));
        }
        assert_eq!(records[0].response.as_deref(), Some("ok"));
        assert_eq!(records[3].response, None);
        assert_eq!(records[3].error.as_deref(), Some("boom"));
    }

    /// Requests interleaved in any order give each line the record its request gives read
    /// alone: the cache of requests read lately holds them by their exact text, and a
    /// shard that fills is emptied without losing a request's fields.
    #[test]
    fn cached_requests_give_the_records_of_a_fresh_read() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.jsonl");
        let resp = r#""response": {"choices": [{"message": {"content": "ok"}}]}"#;
        let reqs = [
            r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#,
            r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}"#,
            r#"{"model": "n", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "中文"}], "max_tokens": 7}"#,
            concat!(
                r#"{"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "assistant","#,
                r#" "content": "b"}, {"role": "user", "content": "hi"}]}"#,
            ),
        ];
        let alone: Vec<Record> = reqs
            .iter()
            .map(|q| {
                std::fs::write(&p, format!(r#"{{"request": {q}, {resp}}}"#)).unwrap();
                open(&p, &Options::default())
                    .unwrap()
                    .next()
                    .unwrap()
                    .unwrap()
            })
            .collect();
        let order = [0, 1, 2, 3, 1, 0, 3, 2, 2, 0, 1, 3, 0];
        let lines: Vec<String> = order
            .iter()
            .map(|&i| format!(r#"{{"request": {}, {resp}}}"#, reqs[i]))
            .collect();
        std::fs::write(&p, lines.join("\n")).unwrap();
        let got: Vec<Record> = open(&p, &Options::default())
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(got.len(), order.len());
        for (k, (&i, r)) in order.iter().zip(&got).enumerate() {
            let want = Record {
                source: Provenance {
                    id: Some((k + 1).to_string()),
                    ..alone[i].source.clone()
                },
                ..alone[i].clone()
            };
            assert_eq!(r, &want, "line {}", k + 1);
        }
        assert_ne!(got[0].case_key, got[1].case_key);
        let cache = RequestCache::default();
        let parsed = |i: usize| {
            let v: Value = serde_json::from_str(reqs[i % reqs.len()]).unwrap();
            Arc::new(request(&p, 1, &v).unwrap())
        };
        for k in 0..CACHED_REQUESTS * 2 {
            cache.put(&format!("{k}"), parsed(k));
            let back = cache.get(&format!("{k}")).unwrap();
            assert_eq!(back.key, parsed(k).key);
        }
        let held = (0..CACHED_REQUESTS * 2)
            .filter(|k| cache.get(&format!("{k}")).is_some())
            .count();
        assert!(held > 0 && held <= CACHED_REQUESTS, "{held}");
    }

    /// A response the one-pass read refuses is read again as raw text with the same result
    /// the `Value` path gives: a fractional token count (NULL, not an error), a key named
    /// twice (the last wins), no choice (the error naming `response`), a content that is
    /// not text (its error); a well-formed one is read in the first pass.
    #[test]
    fn responses_the_one_pass_read_refuses_are_read_as_raw_text() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.jsonl");
        let req = r#""request": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#;
        let read = |resp: &str| {
            std::fs::write(&p, format!(r#"{{{req}, "response": {resp}}}"#)).unwrap();
            open(&p, &Options::default()).unwrap().next().unwrap()
        };
        let ok = read(
            r#"{"choices": [{"message": {"content": "a"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}"#,
        )
        .unwrap();
        assert_eq!(
            (ok.response.as_deref(), ok.finish_reason.as_deref()),
            (Some("a"), Some("stop"))
        );
        assert_eq!((ok.prompt_tokens, ok.completion_tokens), (Some(3), Some(1)));
        let fractional = read(
            r#"{"choices": [{"message": {"content": "b"}}], "usage": {"prompt_tokens": 3.5, "completion_tokens": 2}}"#,
        )
        .unwrap();
        assert_eq!(fractional.response.as_deref(), Some("b"));
        assert_eq!(
            (fractional.prompt_tokens, fractional.completion_tokens),
            (None, Some(2))
        );
        let twice = read(
            r#"{"choices": [{"message": {"content": "first"}}], "choices": [{"message": {"content": "last"}}]}"#,
        )
        .unwrap();
        assert_eq!(twice.response.as_deref(), Some("last"));
        let none = read(r#"{"choices": []}"#).unwrap_err().to_string();
        assert!(
            none.contains("c.jsonl:1") && none.contains("response") && none.contains("choices[0]"),
            "{none}"
        );
        let number = read(r#"{"choices": [{"message": {"content": 5}}]}"#)
            .unwrap_err()
            .to_string();
        assert!(number.contains("message.content is 5"), "{number}");
    }

    /// Over several read blocks: every line read once, in order, `source_id` its line number
    /// (CRLF, blank lines and a last line without newline as `BufRead::lines` sees them), and
    /// a bad line in the third block named by its own number.
    #[test]
    fn lines_across_blocks_keep_their_numbers() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.jsonl");
        let line = |i: usize| {
            // About 1 kB a line, so the file spans three blocks.
            let pad = "x".repeat(900 + i % 97);
            format!(
                concat!(
                    r#"{{"request": {{"model": "m", "messages": [{{"role": "user", "content": "q{i} {pad}"}}]}},"#,
                    r#" "response": {{"choices": [{{"message": {{"content": "a{i}"}}}}]}}}}"#,
                ),
                i = i,
                pad = pad
            )
        };
        let n = 3 * BLOCK_BYTES / 1000;
        let mut text = String::new();
        for i in 1..=n {
            text.push_str(&line(i));
            // CRLF on every seventh line, a blank line after every 1000th.
            text.push_str(if i % 7 == 0 { "\r\n" } else { "\n" });
            if i % 1000 == 0 && i < n {
                text.push('\n');
            }
        }
        text.pop(); // no newline after the last line
        assert!(text.len() > 2 * BLOCK_BYTES);
        std::fs::write(&p, &text).unwrap();
        let records: Vec<Record> = open(&p, &Options::default())
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(records.len(), n);
        for (k, r) in records.iter().enumerate() {
            let i = k + 1;
            // Line numbers count the blank lines before this record.
            let line_no = i + (i - 1) / 1000;
            assert_eq!(
                r.source.id.as_deref(),
                Some(line_no.to_string().as_str()),
                "record {i}"
            );
            assert!(r.input.starts_with(&format!("q{i} ")), "record {i}");
            assert_eq!(r.response.as_deref(), Some(format!("a{i}").as_str()));
        }
        // A line that is not JSON, deep in the file: its number, found across the blocks.
        let bad_at = 2 * n / 3 + 5;
        let mut lines: Vec<String> = (1..=n).map(line).collect();
        lines[bad_at - 1] = "{not json".into();
        std::fs::write(&p, lines.join("\n")).unwrap();
        let err = open(&p, &Options::default())
            .unwrap()
            .find_map(Result::err)
            .expect("the bad line is an error");
        assert!(
            err.to_string()
                .starts_with(&format!("{}:{bad_at}: field `(line)`", p.display())),
            "{err}"
        );
    }

    /// A file that cannot be mapped (a named pipe) is read into buffers instead: the same
    /// records, with the same line numbers, across blocks.
    #[cfg(unix)]
    #[test]
    fn a_pipe_is_read_as_a_file_is_mapped() {
        let d = tempfile::tempdir().unwrap();
        let (file, pipe) = (d.path().join("c.jsonl"), d.path().join("p.jsonl"));
        let n = 3 * BLOCK_BYTES / 1000;
        let text: String = (1..=n)
            .map(|i| {
                let pad = "y".repeat(900 + i % 89);
                format!(
                    concat!(
                        r#"{{"request": {{"model": "m", "messages": [{{"role": "user", "content": "q{i} {pad}"}}]}},"#,
                        r#" "response": {{"choices": [{{"message": {{"content": "a{i}"}}}}]}}}}"#,
                    ),
                    i = i,
                    pad = pad
                ) + if i % 500 == 0 { "\n\n" } else { "\n" }
            })
            .collect();
        std::fs::write(&file, &text).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(&pipe)
            .status()
            .unwrap();
        assert!(made.success());
        let writer = {
            let (pipe, text) = (pipe.clone(), text.clone());
            std::thread::spawn(move || std::fs::write(pipe, text).unwrap())
        };
        let read = |p: &Path| -> Vec<(Option<String>, String)> {
            open(p, &Options::default())
                .unwrap()
                .map(|r| {
                    let r = r.unwrap();
                    (r.source.id, r.input)
                })
                .collect()
        };
        let (mapped, piped) = (read(&file), read(&pipe));
        writer.join().unwrap();
        assert_eq!(mapped.len(), n);
        assert_eq!(
            mapped[n - 1].0.as_deref(),
            Some((n + (n - 1) / 500).to_string().as_str())
        );
        assert_eq!(mapped, piped);
    }

    /// A bad line is an error in its place and the lines after it are still read, so an
    /// import can name every bad line (or skip them), not only the first.
    #[test]
    fn a_bad_line_in_a_later_block_is_named_and_the_lines_after_it_still_read() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("c.jsonl");
        let n = 3 * BLOCK_BYTES / 1000;
        let bad_at = n - 7;
        let text: String = (1..=n)
            .map(|i| {
                if i == bad_at {
                    return r#"{"request": {"model": "m", "messages": []}, "response": 5}"#
                        .to_string()
                        + "\n";
                }
                let pad = "y".repeat(900 + i % 89);
                format!(
                    concat!(
                        r#"{{"request": {{"model": "m", "messages": [{{"role": "user", "content": "q{i} {pad}"}}]}},"#,
                        r#" "response": {{"choices": [{{"message": {{"content": "a{i}"}}}}]}}}}"#,
                    ),
                    i = i,
                    pad = pad
                ) + "\n"
            })
            .collect();
        std::fs::write(&file, &text).unwrap();
        let got: Vec<_> = open(&file, &Options::default()).unwrap().collect();
        // Every line in order, the bad one an error, the ones after it records.
        assert_eq!(got.len(), n);
        for (i, r) in got.iter().enumerate() {
            if i + 1 == bad_at {
                continue;
            }
            let r = r.as_ref().unwrap();
            assert_eq!(r.source.id.as_deref(), Some((i + 1).to_string().as_str()));
        }
        let e = got[bad_at - 1].as_ref().err().unwrap();
        let err = e.to_string();
        assert!(
            err.contains(&format!("c.jsonl:{bad_at}")) && err.contains("request.messages"),
            "{err}"
        );
        // The error carries the line itself, for --skip-bad-lines.
        assert_eq!(
            e.to_json()["line"],
            r#"{"request": {"model": "m", "messages": []}, "response": 5}"#
        );
    }
}
