//! Inspect AI logs: `.eval` (a zip of JSON entries) and the older `.json` log.
//!
//! # Behavior
//! - One case per sample id, one call per sample and epoch: `sample_idx` is the epoch - 1,
//!   `source_id` the sample id. The model, its provider (the part of Inspect's `provider/model` name before the
//!   first `/`), the task (as the test) and the generation config (`max_tokens`,
//!   `temperature`) come from the log header (`eval`).
//! - The input is the sample's `input` (or the last user message of an input message
//!   list), the system the sample's system message; the target is `expected` (a list of
//!   one target is that target, a longer list its JSON).
//! - The answer is `output.completion`; the stop reason maps to a finish reason (`stop`,
//!   `max_tokens` and `model_length` to `length`, `tool_calls`, `content_filter`; `unknown`
//!   is NULL); tokens are the sample's `model_usage` summed over models (input, output,
//!   reasoning); latency is `output.time`; `started_at` the sample's start; an errored
//!   sample keeps its `error.message` and no answer. Inspect does not record HTTP statuses
//!   or attempts: they stay NULL.
//! - Each scorer's value is an imported score `inspect-<scorer>@imported`: `C` is 1
//!   (passed), `I` 0 (failed), `P` 0.5, `N` 0 (failed), numbers and booleans as they are,
//!   a dict one score per key (`<scorer>.<key>`); `answer` and `explanation` go to
//!   `detail`. Inspect's epoch reduction is not a row: it is a GROUP BY `case_id` in SQL.
//! - `--cluster FIELD` takes each case's cluster from the sample `metadata` field; its
//!   `test` and `capability` metadata fields, when present, land in the case.
//! - A `.eval` log is read entry by entry (`header.json` first, or `_journal/start.json`
//!   for a log still being written, then each `samples/*.json`), decompressing only that
//!   entry (zstd, as Inspect writes today, deflate or stored). A `.json` log is parsed as
//!   a stream on a reader thread that hands over one sample at a time, so neither holds
//!   more than one sample. A `.json` log must have `eval` before `samples` (Inspect writes
//!   it so). Both need a local file (a zip is read from its end).
//!
//! # Errors
//! A sample that lacks its id, epoch or input names the file, the zip entry (or the
//! sample's position) and the field; a header that lacks `eval.model` names it.

use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Value, json};

use super::{
    ImportError, ImportedScore, Options, Provenance, Record, RecordIter, Request, as_text, bad,
    bad_file,
};

/// What the log header says about every sample.
#[derive(Debug, Clone, Default)]
struct Header {
    model: String,
    task: Option<String>,
    config: Value,
}

fn header(
    file: &Path,
    at: &str,
    eval: &Value,
    plan_config: Option<&Value>,
) -> Result<Header, ImportError> {
    let model = eval
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(file, at, "eval.model", "missing or not a string"))?
        .to_string();
    let config = eval
        .get("model_generate_config")
        .filter(|c| c.is_object())
        .or(plan_config)
        .cloned()
        .unwrap_or(Value::Null);
    Ok(Header {
        model,
        task: eval.get("task").and_then(Value::as_str).map(String::from),
        config,
    })
}

/// Opens an Inspect log: a zip (`.eval`) or a JSON document (`.json`).
///
/// # Errors
/// The file cannot be opened, or a `.eval` has no header.
pub fn open(path: &Path, opts: &Options) -> Result<RecordIter, ImportError> {
    let mut f = std::fs::File::open(path).map_err(|e| bad_file(path, e))?;
    let mut magic = [0u8; 4];
    let n = f.read(&mut magic).map_err(|e| bad_file(path, e))?;
    if n == 4 && &magic == b"PK\x03\x04" {
        open_eval(path, opts)
    } else {
        Ok(open_json(path, opts))
    }
}

// ------------------------------------------------------------------------------ .eval

struct EvalSamples {
    file: PathBuf,
    zip: super::zip::Archive,
    entries: Vec<(usize, String)>,
    pos: usize,
    header: Header,
    opts: Options,
    /// Records decoded ahead, in entry order (reversed: the next is last).
    ready: Vec<Result<Record, ImportError>>,
}

/// Samples decoded at once, on every core: enough to keep the cores busy, few enough that
/// their records are a few MB.
const EVAL_CHUNK: usize = 256;

/// The fields of a sample evalflow keeps. Its `events`, `attachments` and model call
/// payloads, most of a sample's bytes, are skipped by the parser without being built.
#[derive(serde::Deserialize)]
struct KeptSample {
    id: Option<Value>,
    epoch: Option<Value>,
    input: Option<Value>,
    target: Option<Value>,
    messages: Option<Value>,
    error: Option<Value>,
    output: Option<Value>,
    model_usage: Option<Value>,
    scores: Option<Value>,
    metadata: Option<Value>,
    started_at: Option<Value>,
}

impl KeptSample {
    /// The sample as the object [`sample_record`] reads (a JSON null as absent, which it
    /// reads the same way).
    fn into_value(self) -> Value {
        let fields = [
            ("id", self.id),
            ("epoch", self.epoch),
            ("input", self.input),
            ("target", self.target),
            ("messages", self.messages),
            ("error", self.error),
            ("output", self.output),
            ("model_usage", self.model_usage),
            ("scores", self.scores),
            ("metadata", self.metadata),
            ("started_at", self.started_at),
        ];
        Value::Object(
            fields
                .into_iter()
                .filter_map(|(k, v)| Some((k.to_string(), v?)))
                .collect(),
        )
    }
}

thread_local! {
    /// Each import thread's zstd decompressor, reused from entry to entry.
    static ZSTD: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// Reads, inflates and parses one sample entry into its record.
fn eval_sample(
    file: &Path,
    zip: &super::zip::Archive,
    i: usize,
    name: &str,
    h: &Header,
    opts: &Options,
) -> Result<Record, ImportError> {
    let bytes = ZSTD
        .with(|z| zip.entry_bytes(i, &mut z.borrow_mut()))
        .map_err(|e| bad(file, name, "(entry)", e))?;
    let kept: KeptSample = serde_json::from_slice(&bytes)
        .map_err(|e| bad(file, name, "(entry)", format!("not JSON: {e}")))?;
    sample_record(file, name, h, &kept.into_value(), opts)
}

/// Reads zip entry `i` (one sample or the header) and parses it.
fn entry_json(
    file: &Path,
    zip: &mut super::zip::Archive,
    i: usize,
    name: &str,
) -> Result<Value, ImportError> {
    let r = zip
        .open_entry(i)
        .map_err(|e| bad(file, name, "(entry)", e))?;
    serde_json::from_reader(BufReader::new(r))
        .map_err(|e| bad(file, name, "(entry)", format!("not JSON: {e}")))
}

fn open_eval(path: &Path, opts: &Options) -> Result<RecordIter, ImportError> {
    let f = std::fs::File::open(path).map_err(|e| bad_file(path, e))?;
    let mut zip = super::zip::Archive::open(f)
        .map_err(|e| bad_file(path, format!("not a readable .eval (zip) log: {e}")))?;
    let mut entries = Vec::new();
    let (mut head, mut start) = (None, None);
    for (i, e) in zip.entries.iter().enumerate() {
        let name = e.name.clone();
        if name.starts_with("samples/") && name.ends_with(".json") {
            entries.push((i, name));
        } else if name == "header.json" {
            head = Some(i);
        } else if name == "_journal/start.json" {
            start = Some(i);
        }
    }
    let (i, name) = match (head, start) {
        (Some(i), _) => (i, "header.json"),
        (None, Some(i)) => (i, "_journal/start.json"),
        _ => {
            return Err(bad_file(
                path,
                "no header.json or _journal/start.json: not an Inspect .eval log",
            ));
        }
    };
    let h = entry_json(path, &mut zip, i, name)?;
    let eval = h
        .get("eval")
        .ok_or_else(|| bad(path, name, "eval", "missing"))?;
    let header = header(path, name, eval, h.pointer("/plan/config"))?;
    // Samples in the order Inspect wrote them are by completion; sort by id and epoch so
    // an import is the same whatever the concurrency of the run was.
    entries.sort_by_key(|a| natural_key(&a.1));
    Ok(Box::new(EvalSamples {
        file: path.to_path_buf(),
        zip,
        entries,
        pos: 0,
        header,
        opts: opts.clone(),
        ready: Vec::new(),
    }))
}

/// `samples/<id>_epoch_<n>.json` sorts by id, then epoch as a number.
fn natural_key(name: &str) -> (String, u64) {
    let stem = name
        .trim_start_matches("samples/")
        .trim_end_matches(".json");
    match stem.rsplit_once("_epoch_") {
        Some((id, e)) => (id.to_string(), e.parse().unwrap_or(0)),
        None => (stem.to_string(), 0),
    }
}

impl Iterator for EvalSamples {
    type Item = Result<Record, ImportError>;

    fn next(&mut self) -> Option<Self::Item> {
        use rayon::prelude::*;
        if self.ready.is_empty() {
            let end = (self.pos + EVAL_CHUNK).min(self.entries.len());
            let chunk = &self.entries[self.pos..end];
            self.pos = end;
            let (file, zip, h, opts) = (&self.file, &self.zip, &self.header, &self.opts);
            self.ready = chunk
                .par_iter()
                .map(|(i, name)| eval_sample(file, zip, *i, name, h, opts))
                .collect();
            self.ready.reverse();
        }
        self.ready.pop()
    }
}

// ------------------------------------------------------------------------------ .json

fn open_json(path: &Path, opts: &Options) -> RecordIter {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Result<Record, ImportError>>(64);
    let file = path.to_path_buf();
    let opts = opts.clone();
    std::thread::spawn(move || {
        let f = match std::fs::File::open(&file) {
            Ok(f) => f,
            Err(e) => {
                let _ = tx.send(Err(bad_file(&file, e)));
                return;
            }
        };
        let mut de = serde_json::Deserializer::from_reader(BufReader::new(f));
        let seed = LogSeed {
            file: &file,
            opts: &opts,
            tx: &tx,
        };
        if let Err(e) = seed.deserialize(&mut de) {
            // `stopped` means a sample's error was already sent, or the reader hung up.
            if !e.to_string().starts_with("stopped") {
                let _ = tx.send(Err(bad_file(
                    &file,
                    format!("not an Inspect JSON log: {e}"),
                )));
            }
        }
    });
    Box::new(rx.into_iter())
}

type Tx = std::sync::mpsc::SyncSender<Result<Record, ImportError>>;

struct LogSeed<'a> {
    file: &'a Path,
    opts: &'a Options,
    tx: &'a Tx,
}

impl<'de> DeserializeSeed<'de> for LogSeed<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for LogSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an Inspect log object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        use serde::de::Error;
        let mut eval: Option<Value> = None;
        let mut plan_config: Option<Value> = None;
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "eval" => eval = Some(map.next_value()?),
                "plan" => {
                    let plan: Value = map.next_value()?;
                    plan_config = plan.get("config").cloned();
                }
                "samples" => {
                    let eval = eval
                        .as_ref()
                        .ok_or_else(|| A::Error::custom("`samples` before `eval`"))?;
                    let h = header(self.file, "eval", eval, plan_config.as_ref()).map_err(|e| {
                        let _ = self.tx.send(Err(e));
                        A::Error::custom("stopped")
                    })?;
                    map.next_value_seed(SamplesSeed {
                        file: self.file,
                        opts: self.opts,
                        tx: self.tx,
                        header: &h,
                    })?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

struct SamplesSeed<'a> {
    file: &'a Path,
    opts: &'a Options,
    tx: &'a Tx,
    header: &'a Header,
}

impl<'de> DeserializeSeed<'de> for SamplesSeed<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for SamplesSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of samples")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        use serde::de::Error;
        let mut k = 0usize;
        while let Some(s) = seq.next_element::<Value>()? {
            let at = format!("samples[{k}]");
            k += 1;
            // A bad sample is sent as an error and the next ones are read: the caller
            // reports every bad sample (or skips them).
            let r = sample_record(self.file, &at, self.header, &s, self.opts)
                .map_err(|e| e.with_raw(&s.to_string()));
            if self.tx.send(r).is_err() {
                return Err(A::Error::custom("stopped"));
            }
        }
        Ok(())
    }
}

// ------------------------------------------------------------------------------ samples

fn finish_reason(stop: &str) -> Option<String> {
    match stop {
        "unknown" | "" => None,
        "max_tokens" | "model_length" => Some("length".into()),
        s => Some(s.to_string()),
    }
}

/// Maps one Inspect score value to imported scores (several for a dict value).
fn scores_of(name: &str, sc: &Value) -> Vec<ImportedScore> {
    let detail = {
        let d: serde_json::Map<String, Value> = ["answer", "explanation"]
            .iter()
            .filter_map(|k| {
                sc.get(*k)
                    .filter(|v| !v.is_null())
                    .map(|v| (k.to_string(), v.clone()))
            })
            .collect();
        (!d.is_empty()).then(|| Value::Object(d).to_string())
    };
    let one = |scorer: String, v: &Value| -> ImportedScore {
        let (score, label, passed) = match v {
            Value::String(s) => match s.as_str() {
                "C" => (Some(1.0), Some(s.clone()), Some(true)),
                "I" => (Some(0.0), Some(s.clone()), Some(false)),
                "P" => (Some(0.5), Some(s.clone()), None),
                "N" => (Some(0.0), Some(s.clone()), Some(false)),
                _ => (s.parse::<f64>().ok(), Some(s.clone()), None),
            },
            Value::Bool(b) => (Some(if *b { 1.0 } else { 0.0 }), None, Some(*b)),
            Value::Number(n) => (n.as_f64(), None, None),
            Value::Null => (None, None, None),
            other => (None, Some(other.to_string()), None),
        };
        ImportedScore {
            scorer,
            score,
            label,
            passed,
            detail: detail.clone(),
        }
    };
    match sc.get("value") {
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| one(format!("{name}.{k}"), v))
            .collect(),
        Some(v) => vec![one(name.to_string(), v)],
        None => vec![],
    }
}

fn sample_record(
    file: &Path,
    at: &str,
    h: &Header,
    s: &Value,
    opts: &Options,
) -> Result<Record, ImportError> {
    let id = s
        .get("id")
        .and_then(as_text)
        .ok_or_else(|| bad(file, at, "id", "missing"))?;
    let epoch = s
        .get("epoch")
        .and_then(Value::as_i64)
        .filter(|e| (1..=i32::MAX as i64).contains(e))
        .ok_or_else(|| bad(file, at, "epoch", "missing or not a positive integer"))?;
    let msgs = s.get("messages").and_then(Value::as_array);
    let (system, last_user) = msgs.map(|m| super::chat_prompt(m)).unwrap_or((None, None));
    let input = match s.get("input") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(m)) => super::chat_prompt(m)
            .1
            .ok_or_else(|| bad(file, at, "input", "no user message with text content"))?,
        _ => last_user.ok_or_else(|| bad(file, at, "input", "missing"))?,
    };
    let expected = match s.get("target") {
        Some(Value::String(t)) => Some(t.clone()),
        Some(Value::Array(a)) if a.len() == 1 => as_text(&a[0]),
        Some(Value::Array(a)) if a.is_empty() => None,
        Some(v) => as_text(v),
        None => None,
    };
    let error = s.get("error").filter(|e| !e.is_null()).map(|e| {
        e.get("message")
            .and_then(as_text)
            .unwrap_or_else(|| e.to_string())
    });
    let output = s.get("output");
    let choice = output.and_then(|o| o.pointer("/choices/0"));
    let response = match (choice, output.and_then(|o| o.get("completion"))) {
        (Some(_), Some(Value::String(c))) => Some(c.clone()),
        (None, Some(Value::String(c))) if !c.is_empty() => Some(c.clone()),
        _ => None,
    };
    let usage = s.get("model_usage").and_then(Value::as_object);
    let sum = |k: &str| -> Option<i64> {
        let u = usage.filter(|u| !u.is_empty())?;
        Some(
            u.values()
                .filter_map(|x| x.get(k).and_then(Value::as_i64))
                .sum(),
        )
    };
    let cfg = &h.config;
    let max_tokens = cfg
        .get("max_tokens")
        .and_then(Value::as_u64)
        .and_then(|m| u32::try_from(m).ok());
    let temperature = cfg.get("temperature").and_then(Value::as_f64);
    let model = opts.model.clone().unwrap_or_else(|| h.model.clone());
    let mut scores = Vec::new();
    if let Some(Value::Object(m)) = s.get("scores") {
        for (name, sc) in m {
            scores.extend(scores_of(name, sc));
        }
    }
    let meta = |f: &str| s.get("metadata").and_then(|m| m.get(f)).and_then(as_text);
    let request = Request {
        source_model: Some(h.model.as_str().into()),
        request_key: json!({"model": model, "system": system, "input": input, "config": cfg})
            .to_string(),
        model: model.into(),
        system: system.map(Into::into),
        input: input.into(),
        max_tokens,
        temperature,
        // The sample id is the case: two samples with the same input are two cases.
        case_key: Some(format!("sample:{id}").into()),
        ..Request::default()
    };
    Ok(Record {
        request: request.into(),
        capability: meta("capability"),
        provider: h.model.split_once('/').map(|(p, _)| p.to_string()),
        expected,
        test: meta("test").or_else(|| h.task.clone()),
        cluster: opts
            .cluster
            .as_ref()
            .and_then(|f| s.get("metadata").and_then(|m| m.get(f)).and_then(as_text)),
        sample_idx: Some((epoch - 1) as i32),
        response,
        finish_reason: choice
            .and_then(|c| c.get("stop_reason"))
            .and_then(Value::as_str)
            .and_then(finish_reason),
        prompt_tokens: sum("input_tokens"),
        completion_tokens: sum("output_tokens"),
        reasoning_tokens: usage
            .filter(|u| {
                u.values()
                    .any(|x| x.get("reasoning_tokens").is_some_and(|r| !r.is_null()))
            })
            .and_then(|_| sum("reasoning_tokens")),
        error,
        latency_ms: output
            .and_then(|o| o.get("time"))
            .and_then(Value::as_f64)
            .map(|t| t * 1000.0),
        started_at_us: s
            .get("started_at")
            .and_then(Value::as_str)
            .and_then(super::rfc3339_us),
        source: Provenance {
            format: "inspect",
            file: file.display().to_string().into(),
            id: Some(id),
        },
        scores,
        ..Record::default()
    })
}
