//! lm-evaluation-harness sample logs (`samples_<task>_<time>.jsonl` from `--log_samples`),
//! read line by line.
//!
//! # Behavior
//! - One case per doc: the input is the request context (`arguments`: the first argument
//!   of the first request; a chat context, JSON list of messages, gives its last user
//!   message and system message), `expected` the `target`, `source_id` the `doc_id`. The
//!   task (from the file name) is the test.
//! - One call per generation in `resps[0]` (`sample_idx` 0, 1, ... when the task repeats);
//!   the answer is that raw generation. Requests that are not generations (loglikelihood,
//!   multiple choice) have no answer text: the call's `response` is the JSON of
//!   `filtered_resps`.
//! - The doc's metrics (the names in `metrics`, values on the line) are imported scores
//!   `lm-eval-<metric>@imported` on the first call of the doc; `filtered_resps` (the
//!   extracted answer) goes to `detail`.
//! - The model comes from `--model`, else from the `results_*.json` lm-eval wrote in the
//!   same folder (`model_name`, provider its `config.model`), else is an error. `max_tokens`
//!   is the request's `max_gen_toks`, `temperature` its `temperature` when given. lm-eval
//!   records no tokens, statuses, errors, latencies or times: they stay NULL.
//! - `--cluster FIELD` takes each case's cluster from the `doc` field.
//!
//! # Errors
//! A line that is not JSON or lacks `doc_id` / `arguments` names `file:line` and the field.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Value, json};

use super::{
    ImportError, ImportedScore, Options, Provenance, Record, RecordIter, Request, as_text, bad,
    bad_file,
};

/// The task of `samples_<task>_<YYYY-MM-DDTHH-MM-SS.ffffff>.jsonl`.
fn task_of(path: &Path) -> Option<String> {
    let stem = path.file_stem()?.to_str()?;
    let rest = stem.strip_prefix("samples_")?;
    Some(match rest.rsplit_once('_') {
        Some((task, time))
            if time.starts_with(|c: char| c.is_ascii_digit()) && time.contains('T') =>
        {
            task.to_string()
        }
        _ => rest.to_string(),
    })
}

/// `model_name` and `config.model` of a `results_*.json` beside the samples file.
fn results_model(path: &Path) -> Option<(String, Option<String>)> {
    let dir = path.parent()?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("results_") && n.ends_with(".json"))
        })
        .collect();
    files.sort();
    let v: Value = serde_json::from_slice(&std::fs::read(files.last()?).ok()?).ok()?;
    let name = v.get("model_name").and_then(Value::as_str)?.to_string();
    let provider = v
        .pointer("/config/model")
        .and_then(Value::as_str)
        .map(String::from);
    Some((name, provider))
}

/// Opens a samples file.
///
/// # Errors
/// The file cannot be opened, or no model is known (no `--model`, no results file).
pub fn open(path: &Path, opts: &Options) -> Result<RecordIter, ImportError> {
    let f = std::fs::File::open(path).map_err(|e| bad_file(path, e))?;
    let results = results_model(path);
    let source_model: Option<Arc<str>> = results.as_ref().map(|r| r.0.as_str().into());
    let (model, provider) = match (&opts.model, results) {
        (Some(m), r) => (m.clone(), r.and_then(|r| r.1)),
        (None, Some((m, p))) => (m, p),
        (None, None) => {
            return Err(bad_file(
                path,
                "no model: lm-eval samples do not name it; pass --model or keep the results_*.json lm-eval wrote beside it",
            ));
        }
    };
    // The model as the tables name it and as the source named it, for every line's request.
    let named = Request {
        model: model.into(),
        source_model,
        ..Request::default()
    };
    let file = path.to_path_buf();
    let task = task_of(path);
    let cluster = opts.cluster.clone();
    let lines = std::io::BufReader::new(f).lines().enumerate();
    let mut pending: std::collections::VecDeque<Result<Record, ImportError>> = Default::default();
    let mut lines = lines;
    Ok(Box::new(std::iter::from_fn(move || {
        loop {
            if let Some(r) = pending.pop_front() {
                return Some(r);
            }
            let (i, line) = lines.next()?;
            let n = i + 1;
            match line {
                Err(e) => return Some(Err(bad(&file, n, "(line)", e))),
                Ok(l) if l.trim().is_empty() => continue,
                Ok(l) => match records(&file, n, &l, &named, &provider, &task, &cluster) {
                    Ok(rs) => pending.extend(rs.into_iter().map(Ok)),
                    Err(e) => return Some(Err(e.with_raw(&l))),
                },
            }
        }
    })))
}

#[allow(clippy::too_many_arguments)]
fn records(
    file: &Path,
    n: usize,
    line: &str,
    named: &Request,
    provider: &Option<String>,
    task: &Option<String>,
    cluster: &Option<String>,
) -> Result<Vec<Record>, ImportError> {
    let v: Value =
        serde_json::from_str(line).map_err(|e| bad(file, n, "(line)", format!("not JSON: {e}")))?;
    let doc_id = v
        .get("doc_id")
        .and_then(as_text)
        .ok_or_else(|| bad(file, n, "doc_id", "missing"))?;
    // `arguments` is a list of [context, kwargs] (older) or {"gen_args_0": {"arg_0": context,
    // "arg_1": kwargs}} (newer).
    let (context, kwargs) = match v.get("arguments") {
        Some(Value::Array(a)) => {
            let first = a.first().and_then(Value::as_array);
            (
                first.and_then(|f| f.first()).cloned(),
                first.and_then(|f| f.get(1)).cloned(),
            )
        }
        Some(Value::Object(m)) => {
            let first = m.values().next();
            (
                first.and_then(|f| f.get("arg_0")).cloned(),
                first.and_then(|f| f.get("arg_1")).cloned(),
            )
        }
        _ => (None, None),
    };
    // lm-eval writes a chat context as a list holding one string (the messages' JSON).
    let context = match context {
        Some(Value::Array(a)) if a.len() == 1 => Some(a[0].clone()),
        c => c,
    };
    let context = context
        .and_then(|c| as_text(&c))
        .ok_or_else(|| bad(file, n, "arguments", "missing or without a context"))?;
    // A chat context is the JSON of the messages the model was sent.
    let (system, input) = match serde_json::from_str::<Value>(&context) {
        Ok(Value::Array(msgs)) if msgs.iter().all(|m| m.get("role").is_some()) => {
            let (s, i) = super::chat_prompt(&msgs);
            (
                s.map(Arc::<str>::from),
                Arc::<str>::from(i.unwrap_or(context.clone())),
            )
        }
        _ => (None, Arc::<str>::from(context.clone())),
    };
    let kwargs = kwargs.unwrap_or(Value::Null);
    let max_tokens = kwargs
        .get("max_gen_toks")
        .and_then(Value::as_u64)
        .and_then(|m| u32::try_from(m).ok());
    let temperature = kwargs.get("temperature").and_then(Value::as_f64);
    let filtered = v.get("filtered_resps").cloned().unwrap_or(Value::Null);
    let gens: Vec<Option<String>> = match v.pointer("/resps/0") {
        Some(Value::Array(g)) if !g.is_empty() && g.iter().all(Value::is_string) => {
            g.iter().map(|x| x.as_str().map(String::from)).collect()
        }
        _ => vec![Some(filtered.to_string())],
    };
    let detail = json!({"filtered_resps": filtered, "filter": v.get("filter")}).to_string();
    let scores: Vec<ImportedScore> = v
        .get("metrics")
        .and_then(Value::as_array)
        .map(|ms| {
            ms.iter()
                .filter_map(Value::as_str)
                .map(|m| {
                    let val = v.get(m).cloned().unwrap_or(Value::Null);
                    let (score, passed) = match &val {
                        Value::Bool(b) => (Some(if *b { 1.0 } else { 0.0 }), Some(*b)),
                        Value::Number(x) => (x.as_f64(), None),
                        _ => (None, None),
                    };
                    ImportedScore {
                        scorer: m.to_string(),
                        score,
                        label: (!val.is_number() && !val.is_boolean() && !val.is_null())
                            .then(|| val.to_string()),
                        passed,
                        detail: Some(detail.clone()),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    let doc = v.get("doc");
    let cluster = cluster
        .as_ref()
        .and_then(|f| doc.and_then(|d| d.get(f)).and_then(as_text));
    let expected = v.get("target").and_then(as_text);
    let model = &named.model;
    let request_key = json!({"model": model, "context": context, "kwargs": kwargs}).to_string();
    // The generations of a line are samples of one request.
    let request = Arc::new(Request {
        system,
        input,
        request_key,
        max_tokens,
        temperature,
        // The doc is the case: two docs with the same prompt are two cases.
        case_key: Some(format!("doc:{doc_id}").into()),
        ..named.clone()
    });
    Ok(gens
        .into_iter()
        .enumerate()
        .map(|(k, response)| Record {
            request: request.clone(),
            provider: provider.clone(),
            expected: expected.clone(),
            test: task.clone(),
            cluster: cluster.clone(),
            sample_idx: Some(k as i32),
            response,
            source: Provenance {
                format: "lm-eval",
                file: file.display().to_string().into(),
                id: Some(doc_id.clone()),
            },
            scores: if k == 0 { scores.clone() } else { vec![] },
            ..Record::default()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_comes_from_the_file_name() {
        let t = |n: &str| task_of(Path::new(n));
        assert_eq!(
            t("samples_sentiment_chat_2026-11-30T20-50-01.123456.jsonl").as_deref(),
            Some("sentiment_chat")
        );
        assert_eq!(t("samples_gsm8k.jsonl").as_deref(), Some("gsm8k"));
        assert_eq!(t("other.jsonl"), None);
    }
}
