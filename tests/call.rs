//! The call stage over real HTTP (loopback only) against the in-process mock server:
//! fault matrix, SIGKILL exactly-once, K samples and the cache, and the planted-key grep.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use datafusion::arrow::array::{Array, BooleanArray, Int32Array, Int64Array, StringArray};
use evalflow::mock::{AnswerMode, Fault, MockConfig, MockServer};
use evalflow::runner::Runner;
use evalflow::schema::Table;
use futures::StreamExt;

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A pipeline with `n_items * 5` unique prompts against `base_url`.
fn pipeline(dir: &Path, name: &str, base_url: &str, n_items: usize, model_extra: &str) -> PathBuf {
    let items: Vec<String> = (0..n_items).map(|i| format!("\"{i}\"")).collect();
    let text = format!(
        r#"[model]
provider = "openai"
base_url = "{base_url}"
name = "mock-model"
max_tokens = 16
{model_extra}

[suite]
name = "callsuite"
seed = 1
max_cases_per_test = 100000

[lexicons]
n = [{items}]
adj = ["good", "bad", "fine", "awful", "great"]

[[test]]
name = "items"
capability = "Vocabulary"
type = "MFT"
templates = ["Item {{n}} is {{adj}}."]
expected = "positive|negative|neutral"
"#,
        items = items.join(", ")
    );
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

/// One calls row, as the tests need it.
#[derive(Debug, Clone)]
#[allow(dead_code)]
struct Row {
    call_id: String,
    case_id: String,
    model: String,
    sample_idx: i32,
    response: Option<String>,
    finish_reason: Option<String>,
    prompt_tokens: Option<i64>,
    completion_tokens: Option<i64>,
    reasoning_tokens: Option<i64>,
    reasoning_chars: Option<i64>,
    http_status: Option<i32>,
    error: Option<String>,
    attempts: i32,
    max_tokens: Option<i32>,
    retried_for_budget: Option<bool>,
}

async fn calls(root: &Path) -> Vec<Row> {
    let store = evalflow::storage::RunStore::open(root.to_str().unwrap()).unwrap();
    let mut s = store.read_table("calls", Table::Calls).await.unwrap();
    let mut out = Vec::new();
    while let Some(b) = s.next().await {
        let b = evalflow::schema::plain_strings(b.unwrap());
        let st = |n: &str| {
            b.column_by_name(n)
                .unwrap()
                .as_any()
                .downcast_ref::<StringArray>()
                .unwrap()
                .clone()
        };
        let i64c = |n: &str| {
            b.column_by_name(n)
                .unwrap()
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .clone()
        };
        let i32c = |n: &str| {
            b.column_by_name(n)
                .unwrap()
                .as_any()
                .downcast_ref::<Int32Array>()
                .unwrap()
                .clone()
        };
        let (cid, case, model, resp, fin, err) = (
            st("call_id"),
            st("case_id"),
            st("model"),
            st("response"),
            st("finish_reason"),
            st("error"),
        );
        let (pt, ct, rt, rc) = (
            i64c("prompt_tokens"),
            i64c("completion_tokens"),
            i64c("reasoning_tokens"),
            i64c("reasoning_chars"),
        );
        let (si, hs, at, mt) = (
            i32c("sample_idx"),
            i32c("http_status"),
            i32c("attempts"),
            i32c("max_tokens"),
        );
        let rb = b
            .column_by_name("retried_for_budget")
            .unwrap()
            .as_any()
            .downcast_ref::<BooleanArray>()
            .unwrap()
            .clone();
        let os = |a: &StringArray, i: usize| a.is_valid(i).then(|| a.value(i).to_string());
        let oi = |a: &Int64Array, i: usize| a.is_valid(i).then(|| a.value(i));
        for i in 0..b.num_rows() {
            out.push(Row {
                call_id: cid.value(i).into(),
                case_id: case.value(i).into(),
                model: model.value(i).into(),
                sample_idx: si.value(i),
                response: os(&resp, i),
                finish_reason: os(&fin, i),
                prompt_tokens: oi(&pt, i),
                completion_tokens: oi(&ct, i),
                reasoning_tokens: oi(&rt, i),
                reasoning_chars: oi(&rc, i),
                http_status: hs.is_valid(i).then(|| hs.value(i)),
                error: os(&err, i),
                attempts: at.value(i),
                max_tokens: mt.is_valid(i).then(|| mt.value(i)),
                retried_for_budget: rb.is_valid(i).then(|| rb.value(i)),
            });
        }
    }
    out
}

async fn validity(root: &Path) -> HashMap<String, String> {
    let store = evalflow::storage::RunStore::open(root.to_str().unwrap()).unwrap();
    let mut s = store.read_table("validity", Table::Validity).await.unwrap();
    let mut out = HashMap::new();
    while let Some(b) = s.next().await {
        let b = evalflow::schema::plain_strings(b.unwrap());
        let st = |n: &str| {
            b.column_by_name(n)
                .unwrap()
                .as_any()
                .downcast_ref::<StringArray>()
                .unwrap()
                .clone()
        };
        let (c, v) = (st("call_id"), st("validity"));
        for i in 0..b.num_rows() {
            out.insert(c.value(i).to_string(), v.value(i).to_string());
        }
    }
    out
}

async fn generate_and_call(pipeline: &Path, root: &Path) -> Vec<Row> {
    let mut r = Runner::open(pipeline, Some(root.to_str().unwrap()))
        .await
        .unwrap();
    r.generate().await.unwrap();
    r.call()
        .await
        .expect("the call stage never fails on provider faults");
    r.validate().await.unwrap();
    calls(root).await
}

fn mock_cfg(faults: Vec<(Fault, f64)>) -> MockConfig {
    MockConfig {
        faults,
        retry_after_secs: 0,
        ..MockConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_matrix() {
    let dir = tempfile::tempdir().unwrap();
    // (fault, retry_empty_length, check)
    type Check = fn(&Row, &str);
    let cases: Vec<(Fault, bool, Check)> = vec![
        (Fault::RateLimit, false, |r, v| {
            assert_eq!(r.http_status, Some(429));
            assert!(r.error.as_deref().unwrap().starts_with("HTTP 429"), "{r:?}");
            assert_eq!(r.attempts, 3, "429 is retried");
            assert_eq!(v, "provider_error");
        }),
        (Fault::ServerError, false, |r, v| {
            assert!(matches!(r.http_status, Some(500 | 503)), "{r:?}");
            assert_eq!(r.attempts, 3, "5xx is retried");
            assert_eq!(v, "provider_error");
        }),
        (Fault::OutOfCredit, false, |r, v| {
            assert_eq!(r.http_status, Some(403));
            assert!(
                r.error.as_deref().unwrap().contains("out of credit"),
                "{r:?}"
            );
            assert_eq!(r.attempts, 1, "403 is not retried");
            assert_eq!(r.response, None);
            assert_eq!(v, "provider_error");
        }),
        (Fault::Reset, false, |r, v| {
            assert_eq!(r.http_status, None);
            assert!(
                r.error.as_deref().unwrap().starts_with("connection reset"),
                "{r:?}"
            );
            assert_eq!(r.attempts, 3);
            assert_eq!(v, "provider_error");
        }),
        (Fault::Hang, false, |r, v| {
            assert_eq!(r.http_status, None);
            assert_eq!(r.error.as_deref(), Some("timeout after 0.3s"), "{r:?}");
            assert_eq!(r.attempts, 3);
            assert_eq!(v, "provider_error");
        }),
        (Fault::MalformedJson, false, |r, v| {
            assert_eq!(r.http_status, Some(200));
            assert!(
                r.error.as_deref().unwrap().starts_with("malformed JSON: "),
                "{r:?}"
            );
            assert_eq!(v, "provider_error");
        }),
        (Fault::EmptyLength, false, |r, v| {
            assert_eq!(r.http_status, Some(200));
            assert_eq!(r.error, None);
            assert_eq!(r.response.as_deref(), Some(""));
            assert_eq!(r.finish_reason.as_deref(), Some("length"));
            assert_eq!(
                r.reasoning_tokens,
                Some(16),
                "reasoning tokens = max_tokens"
            );
            assert!(r.reasoning_chars.unwrap() > 0);
            assert_eq!(
                (r.attempts, r.max_tokens, r.retried_for_budget),
                (1, Some(16), None)
            );
            assert_eq!(v, "empty_due_to_budget");
        }),
        (Fault::EmptyLength, true, |r, v| {
            assert_eq!(r.finish_reason.as_deref(), Some("length"));
            assert_eq!(r.attempts, 2, "one retry at double budget");
            assert_eq!(r.max_tokens, Some(32));
            assert_eq!(r.retried_for_budget, Some(true));
            assert_eq!(r.reasoning_tokens, Some(32));
            assert_eq!(v, "empty_due_to_budget");
        }),
        (Fault::Truncated, false, |r, v| {
            assert_eq!(r.http_status, Some(200));
            assert_eq!(r.error, None);
            assert_eq!(r.finish_reason.as_deref(), Some("length"));
            assert!(!r.response.as_deref().unwrap().is_empty());
            assert_eq!(r.attempts, 1);
            assert_eq!(v, "truncated");
        }),
    ];
    for (i, (fault, retry_empty, check)) in cases.into_iter().enumerate() {
        let server = MockServer::start(loopback(), mock_cfg(vec![(fault, 1.0)]))
            .await
            .unwrap();
        let extra = format!(
            "max_retries = 2\ntimeout_secs = 0.3\nconcurrency = 4\nretry_empty_length = {retry_empty}"
        );
        let p = pipeline(dir.path(), &format!("f{i}"), &server.base_url(), 2, &extra);
        let root = dir.path().join(format!("run-{i}"));
        let rows = generate_and_call(&p, &root).await;
        let v = validity(&root).await;
        assert_eq!(rows.len(), 10, "{fault:?}: one row per case");
        for r in &rows {
            check(r, &v[&r.call_id]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_recover_and_anthropic_maps_stop_reasons() {
    let dir = tempfile::tempdir().unwrap();
    // Four faults at 5% each: seeded draws per attempt, so retries get through.
    let faults = [
        Fault::RateLimit,
        Fault::ServerError,
        Fault::Reset,
        Fault::MalformedJson,
    ]
    .map(|f| (f, 0.1))
    .to_vec();
    let server = MockServer::start(loopback(), mock_cfg(faults))
        .await
        .unwrap();
    let p = pipeline(
        dir.path(),
        "mixed",
        &server.base_url(),
        20,
        "max_retries = 8\nconcurrency = 16",
    );
    let rows = generate_and_call(&p, &dir.path().join("mixed")).await;
    assert_eq!(rows.len(), 100);
    assert!(
        rows.iter().all(|r| r.error.is_none()),
        "retries recover transient faults"
    );
    assert!(
        rows.iter().any(|r| r.attempts > 1),
        "some calls needed a retry"
    );

    let server = MockServer::start(loopback(), mock_cfg(vec![(Fault::EmptyLength, 0.5)]))
        .await
        .unwrap();
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("provider = \"openai\"", "provider = \"anthropic\"")
        .lines()
        .map(|l| match l.starts_with("base_url") {
            true => format!("base_url = \"{}\"", server.base_url()),
            false => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    let pa = dir.path().join("anthropic.toml");
    std::fs::write(&pa, text).unwrap();
    let rows = generate_and_call(&pa, &dir.path().join("anthropic")).await;
    assert_eq!(rows.len(), 100);
    let reasons: HashSet<_> = rows
        .iter()
        .map(|r| r.finish_reason.clone().unwrap())
        .collect();
    assert_eq!(
        reasons,
        HashSet::from(["stop".to_string(), "length".to_string()])
    );
    for r in &rows {
        assert_eq!(r.error, None);
        assert!(r.prompt_tokens.unwrap() > 0 && r.completion_tokens.unwrap() > 0);
        if r.finish_reason.as_deref() == Some("length") {
            assert_eq!(r.response.as_deref(), Some(""));
            assert!(
                r.reasoning_chars.unwrap() > 0,
                "thinking blocks count as reasoning"
            );
        }
    }
}

fn read_log(p: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k_samples_are_distinct_rows_and_the_cache_keeps_them_apart() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let cfg = MockConfig {
        request_log: Some(log.clone()),
        answer: AnswerMode::Echo,
        ..mock_cfg(vec![])
    };
    let server = MockServer::start(loopback(), cfg).await.unwrap();
    let p = pipeline(
        dir.path(),
        "k",
        &server.base_url(),
        4,
        "samples = 3\ntemperature = 1.0",
    );
    let a = generate_and_call(&p, &dir.path().join("a")).await;
    assert_eq!(a.len(), 60, "20 cases x 3 samples");
    let keys: HashSet<_> = a
        .iter()
        .map(|r| (r.case_id.clone(), r.sample_idx))
        .collect();
    assert_eq!(keys.len(), 60);
    let per_case: HashMap<_, HashSet<_>> = a.iter().fold(HashMap::new(), |mut m, r| {
        m.entry(r.case_id.clone())
            .or_insert_with(HashSet::new)
            .insert(r.response.clone());
        m
    });
    assert!(
        per_case.values().all(|s| s.len() == 3),
        "three distinct answers per case"
    );
    assert_eq!(read_log(&log).len(), 60, "every sample was sent");

    // A new run root beside the first shares the cache: no request, same rows.
    let b = generate_and_call(&p, &dir.path().join("b")).await;
    assert_eq!(
        read_log(&log).len(),
        60,
        "the re-run is served from the cache"
    );
    let by_id: HashMap<_, _> = a
        .iter()
        .map(|r| (r.call_id.clone(), r.response.clone()))
        .collect();
    assert_eq!(b.len(), 60);
    for r in &b {
        assert_eq!(
            by_id[&r.call_id], r.response,
            "sample {} keeps its own answer",
            r.sample_idx
        );
    }
}

/// `evalflow ARGS` in a child process: this test binary re-run as [`child_evalflow`].
///
/// Not `CARGO_BIN_EXE_evalflow`: engineers share one target directory, so that binary can
/// be rebuilt from another branch while these tests run.
struct Evalflow {
    args: Vec<String>,
    envs: Vec<(String, String)>,
    remove: Vec<String>,
}

fn bin() -> Evalflow {
    Evalflow {
        args: vec![],
        envs: vec![],
        remove: vec![],
    }
}

impl Evalflow {
    fn args<S: AsRef<str>>(mut self, a: impl IntoIterator<Item = S>) -> Self {
        self.args
            .extend(a.into_iter().map(|s| s.as_ref().to_string()));
        self
    }
    fn env(mut self, k: &str, v: &str) -> Self {
        self.envs.push((k.into(), v.into()));
        self
    }
    fn env_remove(mut self, k: &str) -> Self {
        self.remove.push(k.into());
        self
    }
    fn command(&self) -> Command {
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.args([
            "--exact",
            "child_evalflow",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env(
            "EVALFLOW_CHILD_ARGS",
            serde_json::to_string(&self.args).unwrap(),
        );
        for (k, v) in &self.envs {
            c.env(k, v);
        }
        for k in &self.remove {
            c.env_remove(k);
        }
        c
    }
    fn output(&self) -> std::process::Output {
        self.command().output().unwrap()
    }
}

/// Runs the CLI when started by [`bin`]; a no-op test otherwise.
#[test]
fn child_evalflow() {
    use clap::Parser;
    let Ok(args) = std::env::var("EVALFLOW_CHILD_ARGS") else {
        return;
    };
    let args: Vec<String> = serde_json::from_str(&args).unwrap();
    let cli =
        evalflow::cli::Cli::try_parse_from(std::iter::once("evalflow".to_string()).chain(args))
            .unwrap_or_else(|e| {
                eprintln!("{e}");
                std::process::exit(2)
            });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let code = match rt.block_on(evalflow::cli::run(cli)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code() as i32
        }
    };
    std::process::exit(code);
}

#[test]
fn sigkill_at_any_moment_resends_at_most_the_calls_in_flight() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let cfg = MockConfig {
        latency: Duration::from_millis(30),
        request_log: Some(log.clone()),
        ..mock_cfg(vec![])
    };
    let server = rt.block_on(MockServer::start(loopback(), cfg)).unwrap();
    let concurrency = 8;
    let p = pipeline(
        dir.path(),
        "kill",
        &server.base_url(),
        80,
        &format!("samples = 3\nconcurrency = {concurrency}"),
    );
    let root = dir.path().join("run");
    let (p, root_s) = (p.to_str().unwrap(), root.to_str().unwrap());
    let o = bin().args(["generate", p, "--out", root_s]).output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // Kill at several points: early (startup), mid-flight, around a commit (every 2 s).
    let mut marks = vec![0usize];
    for ms in [150u64, 450, 900, 2100, 250, 700] {
        let mut child = bin()
            .args(["call", p, "--out", root_s])
            .command()
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(ms));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        marks.push(read_log(&log).len());
    }
    assert!(
        *marks.last().unwrap() < 1200,
        "every kill interrupted unfinished work: {marks:?}"
    );
    let o = bin().args(["call", p, "--out", root_s]).output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let reqs = read_log(&log);
    marks.push(reqs.len());

    // Every call answered; re-sent calls after each kill <= concurrency.
    let ids: Vec<String> = reqs
        .iter()
        .map(|r| r["call_id"].as_str().unwrap().to_string())
        .collect();
    let distinct: HashSet<_> = ids.iter().cloned().collect();
    assert_eq!(distinct.len(), 1200, "400 cases x 3 samples all answered");
    let mut seen = HashSet::new();
    let mut resent_total = 0;
    for w in marks.windows(2) {
        let seg = &ids[w[0]..w[1]];
        let resent = seg.iter().filter(|id| seen.contains(*id)).count();
        assert!(
            resent <= concurrency,
            "{resent} calls re-sent after one kill (concurrency {concurrency}); marks {marks:?}"
        );
        resent_total += resent;
        seen.extend(seg.iter().cloned());
    }
    eprintln!(
        "requests {} for 1200 calls, re-sent {resent_total}, marks {marks:?}",
        ids.len()
    );

    // Exactly one row per (case, model, sample_idx), and exact token totals.
    let rows = rt.block_on(calls(&root));
    assert_eq!(rows.len(), 1200);
    let keys: HashSet<_> = rows
        .iter()
        .map(|r| (r.case_id.clone(), r.model.clone(), r.sample_idx))
        .collect();
    assert_eq!(keys.len(), 1200, "no duplicate rows");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("manifest.json")).unwrap()).unwrap();
    let d = &manifest["stages"]["call"]["details"];
    let sum = |f: fn(&Row) -> Option<i64>| rows.iter().filter_map(f).sum::<i64>();
    assert_eq!(
        d["prompt_tokens"].as_i64().unwrap(),
        sum(|r| r.prompt_tokens)
    );
    assert_eq!(
        d["completion_tokens"].as_i64().unwrap(),
        sum(|r| r.completion_tokens)
    );
    assert_eq!(
        d["reasoning_tokens"].as_i64().unwrap(),
        sum(|r| r.reasoning_tokens)
    );
    assert_eq!(manifest["stages"]["call"]["rows"].as_u64().unwrap(), 1200);
    drop(server);
}

fn grep_tree(dir: &Path, needle: &str) -> Vec<PathBuf> {
    let mut hits = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            hits.extend(grep_tree(&p, needle));
        } else if std::fs::read(&p)
            .unwrap()
            .windows(needle.len())
            .any(|w| w == needle.as_bytes())
        {
            hits.push(p);
        }
    }
    hits
}

#[test]
fn a_planted_key_reaches_no_output() {
    const KEY: &str = "sk-test-PLANTED-123";
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = MockConfig {
        request_log: Some(dir.path().join("requests.jsonl")),
        answer: AnswerMode::Vader,
        ..mock_cfg(vec![
            (Fault::OutOfCredit, 0.3),
            (Fault::ServerError, 0.2),
            (Fault::MalformedJson, 0.1),
        ])
    };
    let server = rt.block_on(MockServer::start(loopback(), cfg)).unwrap();
    let p = pipeline(
        dir.path(),
        "key",
        &server.base_url(),
        6,
        "api_key_env = \"EVALFLOW_TEST_PLANTED\"\nmax_retries = 1",
    );
    let root = dir.path().join("run");
    let mut outputs = String::new();
    for args in [
        vec!["run", p.to_str().unwrap(), "--out", root.to_str().unwrap()],
        vec![
            "sql",
            "SELECT * FROM calls",
            "--run",
            root.to_str().unwrap(),
            "--format",
            "json",
        ],
    ] {
        let o = bin()
            .args(&args)
            .env("EVALFLOW_TEST_PLANTED", KEY)
            .env("RUST_LOG", "trace")
            .output();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        outputs.push_str(&String::from_utf8_lossy(&o.stdout));
        outputs.push_str(&String::from_utf8_lossy(&o.stderr));
    }
    // Without the variable: a usage error naming the variable.
    let o = bin()
        .args([
            "run",
            p.to_str().unwrap(),
            "--out",
            dir.path().join("r2").to_str().unwrap(),
        ])
        .env_remove("EVALFLOW_TEST_PLANTED")
        .output();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(err.contains("EVALFLOW_TEST_PLANTED"), "{err}");
    assert!(outputs.contains("provider_error"), "faults were recorded");
    assert!(!outputs.contains(KEY), "the key leaked to stdout/stderr");
    let hits = grep_tree(dir.path(), KEY);
    assert!(hits.is_empty(), "the key leaked into {hits:?}");
    drop(server);
}

#[test]
fn import_replays_a_recorded_corpus_into_validate_and_score() {
    let dir = tempfile::tempdir().unwrap();
    let ok = |c: &str, fin: &str| {
        serde_json::json!({"choices": [{"message": {"role": "assistant", "content": c}, "finish_reason": fin}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "completion_tokens_details": {"reasoning_tokens": 3}}})
    };
    let req = |t: &str| serde_json::json!({"model": "gpt-x", "messages": [{"role": "system", "content": "Label it."}, {"role": "user", "content": t}], "max_tokens": 16});
    let lines = [
        serde_json::json!({"request": req("I love it"), "response": ok("positive", "stop"), "expected": "positive"}),
        serde_json::json!({"request": req("I love it"), "response": ok("negative", "stop"), "expected": "positive"}),
        serde_json::json!({"request": req("I hate it"), "response": ok("", "length"), "expected": "negative"}),
    ];
    let file = dir.path().join("corpus.jsonl");
    std::fs::write(
        &file,
        lines
            .iter()
            .map(|l| l.to_string() + "\n")
            .collect::<String>(),
    )
    .unwrap();
    let root = dir.path().join("imp");
    let o = bin()
        .args([
            "import",
            file.to_str().unwrap(),
            "--out",
            root.to_str().unwrap(),
        ])
        .output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let pipeline = root.join("import.toml");
    for stage in ["validate", "score"] {
        let o = bin()
            .args([
                stage,
                pipeline.to_str().unwrap(),
                "--out",
                root.to_str().unwrap(),
            ])
            .output();
        assert!(
            o.status.success(),
            "{stage}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let rows = rt.block_on(calls(&root));
    assert_eq!(rows.len(), 3);
    let samples: HashSet<_> = rows
        .iter()
        .map(|r| (r.case_id.clone(), r.sample_idx))
        .collect();
    assert_eq!(
        samples.len(),
        3,
        "repeats of a prompt become samples 0 and 1"
    );
    let v = rt.block_on(validity(&root));
    let mut verdicts: Vec<_> = v.values().cloned().collect();
    verdicts.sort();
    assert_eq!(
        verdicts,
        ["empty_due_to_budget", "valid_answer", "valid_answer"]
    );

    // A bad row names file:line and field; exit 2.
    std::fs::write(
        &file,
        format!(
            "{}\n{{\"request\": {{\"model\": \"m\"}}, \"response\": {{}}}}\n",
            lines[0]
        ),
    )
    .unwrap();
    let o = bin()
        .args([
            "import",
            file.to_str().unwrap(),
            "--out",
            dir.path().join("bad").to_str().unwrap(),
        ])
        .output();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("corpus.jsonl:2: field `request.messages`"),
        "{err}"
    );
}

/// The judge scorer over real HTTP: the judge's calls go through the call stage as a nested
/// run; parsed YES/NO answers land in `answers`; an echoing judge (no YES/NO) makes every
/// row `judge_unparseable` with a NULL score, never a NO.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn judge_checklist_scorer_over_http() {
    let dir = tempfile::tempdir().unwrap();
    let model = MockServer::start(
        loopback(),
        MockConfig {
            answer: AnswerMode::Vader,
            ..mock_cfg(vec![])
        },
    )
    .await
    .unwrap();
    let judge = MockServer::start(
        loopback(),
        MockConfig {
            answer: AnswerMode::Checklist,
            ..mock_cfg(vec![])
        },
    )
    .await
    .unwrap();
    let echo = MockServer::start(loopback(), mock_cfg(vec![]))
        .await
        .unwrap();
    let judged = |name: &str, judge_url: &str| {
        let p = pipeline(dir.path(), name, &model.base_url(), 4, "");
        let text = std::fs::read_to_string(&p).unwrap();
        let text = text.replace(
            "[suite]",
            &format!(
                "[judge]\nprovider = \"openai\"\nbase_url = \"{judge_url}\"\nname = \"judge-model\"\ntemperature = 0.0\n\n\
                 [score]\nscorers = [\"judge\", \"checklist\"]\n\n\
                 [[score.judge.questions]]\nid = \"label\"\ntext = \"Is the answer a sentiment label?\"\n\n\
                 [[score.judge.questions]]\nid = \"short\"\ntext = \"Is the answer one word?\"\n\n\
                 [[score.judge.questions]]\nid = \"polite\"\ntext = \"Is the answer polite?\"\n\n[suite]"
            ),
        );
        std::fs::write(&p, text).unwrap();
        p
    };
    for (name, url, parseable) in [
        ("ok", judge.base_url(), true),
        ("echo", echo.base_url(), false),
    ] {
        let p = judged(name, &url);
        let root = dir.path().join(name);
        let mut r = Runner::open(&p, Some(root.to_str().unwrap()))
            .await
            .unwrap();
        r.run_all().await.unwrap();
        let ctx = evalflow::query::new_context();
        evalflow::query::register_run(&ctx, &r.store, "")
            .await
            .unwrap();
        let rows = evalflow::query::text_rows(
            &ctx,
            "SELECT validity, count(*), count(score), count(answers), \
             sum(CASE WHEN score IS NOT NULL AND abs(score * 3 - round(score * 3)) > 1e-9 THEN 1 ELSE 0 END) \
             FROM scores WHERE scorer = 'judge' GROUP BY validity",
        )
        .await
        .unwrap();
        assert_eq!(rows.len(), 1, "{name}: {rows:?}");
        let r0 = &rows[0];
        let n = r0[1].clone().unwrap();
        assert_eq!(n, "20", "{rows:?}");
        if parseable {
            assert_eq!(r0[0].as_deref(), Some("valid_answer"));
            assert_eq!(r0[2].as_deref(), Some("20"), "every row scored");
            assert_eq!(
                r0[3].as_deref(),
                Some("20"),
                "every row has its answers vector"
            );
            assert_eq!(r0[4].as_deref(), Some("0"), "scores are k/3");
        } else {
            assert_eq!(r0[0].as_deref(), Some("judge_unparseable"));
            assert_eq!(
                r0[2].as_deref(),
                Some("0"),
                "an unparseable judge answer is never a score"
            );
        }
        // The judge's own calls are a nested run with one call per judged answer.
        let versions: Vec<String> = std::fs::read_dir(root.join("judge"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with("1+"))
            .collect();
        assert_eq!(versions.len(), 1, "{versions:?}");
        let sub = root.join("judge").join(&versions[0]);
        let judge_rows = calls(&sub).await;
        assert_eq!(judge_rows.len(), 20, "one judge call per valid answer");
    }
}
