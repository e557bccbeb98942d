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

#[path = "common/child.rs"]
mod child;
#[path = "common/moto.rs"]
mod moto;

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
        // Each case gets its own folder, so its own `.evalflow-cache`: the servers listen on
        // ports the OS may hand out again, and a cache shared across cases would then serve
        // one fault's answer (say EmptyLength's "") to another's identical request.
        let root = dir.path().join(format!("case-{i}")).join("run");
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
        let mut c = child::command(&self.args);
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
    child::run_if_child();
}

/// Call ids a SIGKILLed session left durable: committed parts plus complete journal lines
/// (in `jdir`).
fn durable_call_ids(rt: &tokio::runtime::Runtime, root: &Path, jdir: &Path) -> HashSet<String> {
    let mut ids: HashSet<String> = rt
        .block_on(calls(root))
        .into_iter()
        .map(|r| r.call_id)
        .collect();
    for e in std::fs::read_dir(jdir).into_iter().flatten() {
        let text = std::fs::read_to_string(e.unwrap().path()).unwrap_or_default();
        // A torn last line (killed mid-write) was never fsynced as a whole: not durable.
        for line in text.lines() {
            match serde_json::from_str::<serde_json::Value>(line) {
                Ok(v) => {
                    ids.insert(v["req"]["call_id"].as_str().unwrap().to_string());
                }
                Err(_) => break,
            }
        }
    }
    ids
}

/// SIGKILLs `evalflow call` six times, then lets it finish, and checks from the mock's own
/// request log that no call is paid twice: a call durable (committed or journaled) at a
/// kill is never requested again, each kill re-sends at most the `concurrency` calls in
/// flight, every (request hash, sample) is requested at most once per session, and the
/// token totals equal what the server reported for the answers that were kept.
///
/// `cache`: with the response cache on, a broken journal recovery would be masked (the
/// re-run would be served from the cache instead of re-sending), so the cache-off run is
/// the one that proves the journal.
fn sigkill_resume(cache: bool, on_s3: bool) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let cfg = MockConfig {
        latency: Duration::from_millis(30),
        request_log: Some(log.clone()),
        // Starved answers, so reasoning tokens are part of the totals too.
        ..mock_cfg(vec![(Fault::EmptyLength, 0.1)])
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
    // On S3 the run lives in moto's bucket; `root` is then a local mirror of it, read after
    // each session, and the journal lives in this machine's state folder.
    let moto = on_s3.then(|| moto::Moto::start("kill"));
    let state = dir.path().join("state");
    let root = dir.path().join("run");
    let url = if on_s3 {
        "s3://kill/runs/r".to_string()
    } else {
        root.to_str().unwrap().to_string()
    };
    let cache_dir = if on_s3 {
        // The default cache of an object-store root: `responses` in the state folder.
        state.join("responses")
    } else {
        dir.path().join("cache")
    };
    let cache_env = if cache {
        cache_dir.to_str().unwrap().to_string()
    } else {
        "off".to_string()
    };
    let env_of = |mut e: Evalflow| {
        e = e.env("EVALFLOW_STATE_DIR", state.to_str().unwrap());
        if on_s3 && cache {
            e = e.env_remove("EVALFLOW_CACHE_DIR");
        } else {
            e = e.env("EVALFLOW_CACHE_DIR", &cache_env);
        }
        for (k, v) in moto.iter().flat_map(|m| m.env()) {
            e = e.env(k, &v);
        }
        e
    };
    let sync = || {
        if let Some(m) = &moto {
            rt.block_on(mirror(&m.endpoint, "kill", "runs/r", &root));
        }
    };
    let jdir = if on_s3 {
        state.join("journals")
    } else {
        root.join("_journal")
    };
    let (p, root_s) = (p.to_str().unwrap(), url.as_str());
    let o = env_of(bin().args(["generate", p, "--out", root_s])).output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // Kill at several points: early (startup), mid-flight, around a commit (every 2 s).
    let mut marks = vec![0usize];
    let mut durable = vec![HashSet::new()];
    for ms in [150u64, 450, 900, 2100, 250, 700] {
        let mut child = env_of(bin().args(["call", p, "--out", root_s]))
            .command()
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(ms));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // Requests the killed process wrote just before dying reach the log a moment later.
        std::thread::sleep(Duration::from_millis(200));
        marks.push(read_log(&log).len());
        sync();
        durable.push(durable_call_ids(&rt, &root, &journal_calls(&jdir)));
    }
    assert!(
        *marks.last().unwrap() < 1200,
        "every kill interrupted unfinished work: {marks:?}"
    );
    assert!(
        durable.last().unwrap().len() > 100,
        "the killed sessions recorded work: {marks:?}"
    );
    let o = env_of(bin().args(["call", p, "--out", root_s])).output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    sync();
    let reqs = read_log(&log);
    marks.push(reqs.len());
    assert_eq!(cache, cache_dir.exists(), "the cache setting took effect");

    // Session by session: nothing durable at the start of a session is requested in it,
    // no call is requested twice in it, and at most `concurrency` calls are re-sent.
    let key = |r: &serde_json::Value| {
        (
            r["request_hash"].as_str().unwrap().to_string(),
            r["sample_idx"].as_i64().unwrap(),
        )
    };
    let mut seen = HashSet::new();
    let mut resent_total = 0;
    for (s, w) in marks.windows(2).enumerate() {
        let seg = &reqs[w[0]..w[1]];
        let mut in_session = HashSet::new();
        let mut resent = 0;
        for r in seg {
            let id = r["call_id"].as_str().unwrap();
            assert!(
                !durable[s].contains(id),
                "session {s} re-sent call {id}, durable before it started (marks {marks:?})"
            );
            assert!(
                in_session.insert(key(r)),
                "session {s} sent {:?} twice",
                key(r)
            );
            resent += usize::from(seen.contains(&key(r)));
        }
        assert!(
            resent <= concurrency,
            "{resent} calls re-sent after one kill (concurrency {concurrency}); marks {marks:?}"
        );
        resent_total += resent;
        seen.extend(in_session);
    }
    eprintln!(
        "cache {cache}, s3 {on_s3}: requests {} for 1200 calls, re-sent {resent_total}, marks {marks:?}",
        reqs.len()
    );

    // Exactly one row per (case, model, sample_idx), and one per (request hash, sample)
    // the server saw: nothing committed that was not paid for, nothing paid and lost.
    let rows = rt.block_on(calls(&root));
    assert_eq!(rows.len(), 1200);
    let keys: HashSet<_> = rows
        .iter()
        .map(|r| (r.case_id.clone(), r.model.clone(), r.sample_idx))
        .collect();
    assert_eq!(keys.len(), 1200, "no duplicate rows");
    let committed: HashSet<String> = rows.iter().map(|r| r.call_id.clone()).collect();
    let requested: HashSet<String> = reqs
        .iter()
        .map(|r| r["call_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(committed, requested, "every committed call was paid for");
    assert_eq!(seen.len(), 1200);

    // Token totals against the server: the kept answer of a call is its last request's.
    let mut last: HashMap<(String, i64), &serde_json::Value> = HashMap::new();
    for r in &reqs {
        last.insert(key(r), &r["usage"]);
    }
    let server_sum = |f: &str| {
        last.values()
            .map(|u| u[f].as_i64().expect("every answer reported usage"))
            .sum::<i64>()
    };
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("manifest.json")).unwrap()).unwrap();
    let d = &manifest["stages"]["call"]["details"];
    for f in ["prompt_tokens", "completion_tokens", "reasoning_tokens"] {
        assert_eq!(d[f].as_i64().unwrap(), server_sum(f), "{f}");
    }
    assert!(
        server_sum("reasoning_tokens") > 0,
        "some answers were starved"
    );
    assert_eq!(manifest["stages"]["call"]["rows"].as_u64().unwrap(), 1200);
    drop(server);
}

#[test]
fn sigkill_resume_without_the_cache_pays_no_durable_call_twice() {
    sigkill_resume(false, false);
}

#[test]
fn sigkill_resume_with_the_cache_pays_no_durable_call_twice() {
    sigkill_resume(true, false);
}

/// The same kill matrix on an `s3://` root (moto's server): the journal in this machine's
/// state folder keeps every answered call, so each kill re-pays at most the calls in flight.
#[test]
fn sigkill_resume_on_s3_without_the_cache_pays_no_durable_call_twice() {
    sigkill_resume(false, true);
}

/// On S3 with the default cache (`responses` in the state folder, not beside the root).
#[test]
fn sigkill_resume_on_s3_with_the_default_cache_pays_no_durable_call_twice() {
    sigkill_resume(true, true);
}

/// A resumed run whose committed ids outgrow its memory limit anti-joins them in passes
/// over call-id ranges: under `--memory-limit 1MiB` (1,024 ids a pass, so 4 passes over
/// ~2,500 committed calls) it sends exactly the calls a run without a limit sends, once
/// each, and ends with the same rows.
#[test]
fn a_resumed_run_over_its_memory_limit_sends_the_same_calls_in_passes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let cfg = MockConfig {
        latency: Duration::from_millis(2),
        request_log: Some(log.clone()),
        ..mock_cfg(vec![])
    };
    let server = rt.block_on(MockServer::start(loopback(), cfg)).unwrap();
    let p = pipeline(
        dir.path(),
        "passes",
        &server.base_url(),
        400,
        "samples = 2\nconcurrency = 16",
    );
    let (p, root) = (p.to_str().unwrap(), dir.path().join("run"));
    let call = |root: &Path, extra: &[&str]| {
        bin()
            .args(extra.iter().copied())
            .args(["call", p, "--out", root.to_str().unwrap()])
            .env("EVALFLOW_CACHE_DIR", "off")
    };
    let o = bin()
        .args(["generate", p, "--out", root.to_str().unwrap()])
        .output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Killed once more than 2,500 of the 4,000 calls were sent.
    let mut child = call(&root, &[])
        .command()
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    while read_log(&log).len() < 2500 {
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let copy = dir.path().join("limited");
    let o = Command::new("cp")
        .args(["-a", root.to_str().unwrap(), copy.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success());
    let sent_by = |root: &Path, extra: &[&str], passes: &str| -> Vec<String> {
        let before = read_log(&log).len();
        let o = call(root, extra)
            .env("RUST_LOG", "evalflow::stages::call::todo=debug")
            .env("NO_COLOR", "1")
            .output();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{err}");
        assert!(
            err.contains(&format!("passes={passes}")),
            "{passes} passes: {err}"
        );
        std::thread::sleep(Duration::from_millis(100));
        let mut ids: Vec<String> = read_log(&log)[before..]
            .iter()
            .map(|r| r["call_id"].as_str().unwrap().to_string())
            .collect();
        ids.sort();
        ids
    };
    let free = sent_by(&root, &[], "1");
    let limited = sent_by(&copy, &["--memory-limit", "1MiB"], "4");
    let committed_before = 4000 - free.len();
    assert!(
        committed_before > 2048,
        "{committed_before} calls committed before the resume"
    );
    assert!(!free.is_empty(), "the kill left calls to send");
    assert_eq!(limited, free, "the same calls sent, each once, in passes");
    assert_eq!(
        limited.iter().collect::<HashSet<_>>().len(),
        limited.len(),
        "no call sent twice"
    );
    let rows = |root: &Path| {
        let mut r: Vec<(String, Option<String>)> = rt
            .block_on(calls(root))
            .into_iter()
            .map(|r| (r.call_id, r.response))
            .collect();
        r.sort();
        r
    };
    let (a, b) = (rows(&root), rows(&copy));
    assert_eq!(a.len(), 4000);
    assert_eq!(a.iter().map(|r| &r.0).collect::<HashSet<_>>().len(), 4000);
    assert_eq!(a, b, "the same rows with and without the limit");
    drop(server);
}

/// The `calls` journal folder under `dir`: `dir/calls` for a local root's `_journal`, the
/// one root's `journals/<key>/calls` in a state folder.
fn journal_calls(dir: &Path) -> PathBuf {
    if dir.join("calls").exists() || dir.ends_with("_journal") {
        return dir.join("calls");
    }
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .map(|e| e.unwrap().path().join("calls"))
        .find(|p| p.exists())
        .unwrap_or_else(|| dir.join("none"))
}

/// Copies every object under `prefix` of moto's `bucket` into `local` (replacing it), so
/// the local readers of these tests read an S3 run as it stands.
async fn mirror(endpoint: &str, bucket: &str, prefix: &str, local: &Path) {
    use object_store::{ObjectStore, ObjectStoreExt};
    let s3 = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(endpoint)
        .with_allow_http(true)
        .with_bucket_name(bucket)
        .with_region("us-east-1")
        .with_access_key_id("test")
        .with_secret_access_key("test")
        .build()
        .unwrap();
    let _ = std::fs::remove_dir_all(local);
    let listed: Vec<_> = s3
        .list(Some(&object_store::path::Path::from(prefix)))
        .collect::<Vec<_>>()
        .await;
    for m in listed {
        let m = m.unwrap();
        let rel = m
            .location
            .as_ref()
            .strip_prefix(prefix)
            .unwrap()
            .trim_start_matches('/');
        let to = local.join(rel);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        let bytes = s3.get(&m.location).await.unwrap().bytes().await.unwrap();
        std::fs::write(to, bytes).unwrap();
    }
}

/// `evalflow mock-server ARGS` on a free loopback port: the child and its base URL.
fn mock_server_cli(args: &[&str]) -> (KillOnDrop, String) {
    use std::io::BufRead;
    let mut child = bin()
        .args(["mock-server", "--addr", "127.0.0.1:0"])
        .args(args)
        .command()
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The test harness of the child may print its own lines first.
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let addr = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "mock-server exited before naming its address"
        );
        if let Some(a) = line.trim().strip_prefix("listening on ") {
            break a.to_string();
        }
    };
    (KillOnDrop(child), format!("{addr}/v1"))
}

/// Kills a child process (by its own handle) when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The request log's lines for one pipeline's requests (by model name), in arrival order:
/// (seconds, tokens the answer reported, the 429 it got, (request hash, sample)).
type Arrival = (f64, i64, bool, (String, i64));

fn arrivals(log: &Path, model: &str) -> Vec<Arrival> {
    let mut v: Vec<Arrival> = read_log(log)
        .iter()
        .filter(|r| r["model"] == model)
        .map(|r| {
            let u = &r["usage"];
            let tokens = u["prompt_tokens"].as_i64().unwrap_or(0)
                + u["completion_tokens"].as_i64().unwrap_or(0);
            (
                r["t"].as_f64().unwrap(),
                tokens,
                r["fault"] == "rate_limit",
                (
                    r["request_hash"].as_str().unwrap().to_string(),
                    r["sample_idx"].as_i64().unwrap(),
                ),
            )
        })
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// Checks that no window of the arrivals holds more than a per-minute limit allows: at
/// most `limit` units in any 60 s window and, for shorter windows, at most the limiter's
/// burst plus its refill over the window (`burst + (limit - burst) * w / 60`, which is
/// `limit` at w = 60 s). `units` gives each arrival's weight (1 for requests, reported
/// tokens for tokens). Windows are measured at the server, so `slack` seconds absorb the
/// jitter between the client's send and the server's receive.
fn assert_windows(what: &str, a: &[Arrival], units: fn(&Arrival) -> f64, limit: f64, burst: f64) {
    let slack = 0.25;
    for (i, first) in a.iter().enumerate() {
        let mut sum = 0.0;
        for (j, x) in a.iter().enumerate().skip(i) {
            sum += units(x);
            let w = x.0 - first.0;
            if w < 60.0 {
                assert!(
                    sum <= limit,
                    "{what}: {sum} in {w:.3} s, over {limit} a minute"
                );
            }
            let allowed = burst + (limit - burst) / 60.0 * (w + slack);
            assert!(
                sum <= allowed + 1e-9,
                "{what}: {sum} in {w:.3} s (arrivals {i}..={j}), allowed {allowed:.2}: {a:?}"
            );
        }
    }
}

/// Every retry after a 429 came at least `retry_after` seconds after it, as the server
/// measured.
fn assert_retries_waited(a: &[Arrival], retry_after: f64) -> usize {
    let mut last: HashMap<&(String, i64), (f64, bool)> = HashMap::new();
    let mut retries = 0;
    for (t, _, limited, key) in a {
        if let Some((t0, true)) = last.get(key) {
            retries += 1;
            assert!(
                t - t0 >= retry_after - 1e-3,
                "{key:?} retried {:.3} s after a 429 with Retry-After {retry_after}",
                t - t0
            );
        }
        last.insert(key, (*t, *limited));
    }
    retries
}

/// Rate limits and Retry-After end to end, against the mock server started by the CLI with
/// `--fault rate_limit=0.25 --retry-after 2`: one run paced by `requests_per_minute`, one
/// by `tokens_per_minute`, both checked from the timestamps and token counts of the
/// server's request log.
#[test]
fn rate_limits_and_retry_after_hold_at_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let (_server, url) = mock_server_cli(&[
        "--fault",
        "rate_limit=0.25",
        "--retry-after",
        "2",
        "--request-log",
        log.to_str().unwrap(),
    ]);
    // (name, rpm, tpm); the burst of each limiter is one second's worth, at least 1.
    let runs = [("rpm", 120u32, 1_000_000u32), ("tpm", 100_000, 1_800)];
    let mut handles = Vec::new();
    for (name, rpm, tpm) in runs {
        let p = pipeline(
            dir.path(),
            name,
            &url,
            2,
            &format!(
                "requests_per_minute = {rpm}\ntokens_per_minute = {tpm}\nconcurrency = 1\nmax_retries = 8"
            ),
        );
        let text = std::fs::read_to_string(&p)
            .unwrap()
            .replace("name = \"mock-model\"", &format!("name = \"{name}\""));
        std::fs::write(&p, text).unwrap();
        let root = dir.path().join(name);
        handles.push(std::thread::spawn(move || {
            let (p, r) = (p.to_str().unwrap(), root.to_str().unwrap());
            let started = std::time::Instant::now();
            for stage in ["generate", "call"] {
                let o = bin()
                    .args([stage, p, "--out", r])
                    .env("EVALFLOW_CACHE_DIR", "off")
                    .output();
                assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            }
            started.elapsed()
        }));
    }
    for h in handles {
        eprintln!("run took {:?}", h.join().unwrap());
    }
    let burst = |limit: u32| (f64::from(limit) / 60.0).max(1.0);
    let a = arrivals(&log, "rpm");
    assert!(a.len() > 10, "10 calls and their retries: {a:?}");
    assert_windows("requests", &a, |_| 1.0, 120.0, burst(120));
    let b = arrivals(&log, "tpm");
    assert!(b.len() > 10, "{b:?}");
    assert_windows("tokens", &b, |x| x.1 as f64, 1800.0, burst(1800));
    let retries = assert_retries_waited(&a, 2.0) + assert_retries_waited(&b, 2.0);
    assert!(retries >= 2, "the 429s were retried: {a:?} {b:?}");
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

/// Hung requests are abandoned at the adaptive deadline, not at `timeout_secs`: with 5% of
/// attempts hanging, every call is answered, each hung attempt's retry reaches the server
/// within a few healthy latencies' multiple (the mock's log), long before the 30 s
/// timeout, and the row counts the abandoned attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_requests_are_retried_within_the_adaptive_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let cfg = MockConfig {
        latency: Duration::from_millis(20),
        request_log: Some(log.clone()),
        ..mock_cfg(vec![(Fault::Hang, 0.05)])
    };
    let server = MockServer::start(loopback(), cfg).await.unwrap();
    let p = pipeline(
        dir.path(),
        "hang",
        &server.base_url(),
        80,
        "concurrency = 16\ntimeout_secs = 30\nhang_factor = 8\nhang_floor_secs = 0.5",
    );
    let rows = generate_and_call(&p, &dir.path().join("run")).await;
    assert_eq!(rows.len(), 400);
    let failed: Vec<_> = rows.iter().filter(|r| r.error.is_some()).collect();
    assert!(
        failed.is_empty(),
        "every call answered: {:?}",
        failed.first()
    );
    let reqs = read_log(&log);
    let mut by_call: HashMap<String, Vec<&serde_json::Value>> = HashMap::new();
    for r in &reqs {
        by_call
            .entry(r["call_id"].as_str().unwrap().to_string())
            .or_default()
            .push(r);
    }
    let mut hung = 0;
    let mut worst = 0.0f64;
    for (id, attempts) in &by_call {
        for w in attempts.windows(2) {
            if w[0]["fault"] == "hang" {
                hung += 1;
                let gap = w[1]["t"].as_f64().unwrap() - w[0]["t"].as_f64().unwrap();
                worst = worst.max(gap);
            }
        }
        let row = rows.iter().find(|r| &r.call_id == id).unwrap();
        assert_eq!(
            row.attempts as usize,
            attempts.len(),
            "{id}: attempts counted"
        );
    }
    assert!(hung >= 5, "the mock hung some attempts ({hung})");
    // 0.5 s floor (8 x p95 of 20 ms is less), plus the retry's backoff: far below 30 s. Hangs
    // sent before 32 requests completed wait a little longer, until the deadline adapts.
    assert!(
        worst < 5.0,
        "a hung attempt's retry came {worst:.2} s after it"
    );
    let abandoned = rows.iter().filter(|r| r.attempts > 1).count();
    assert!(abandoned >= hung.min(1));
    drop(server);
}

/// A judge scorer re-run under a 16 MiB memory limit gives the same scores as without one;
/// under a limit too small for its prompts' query it exits 2 naming the limit (a query
/// failure, not a provider that "cannot be built"), writing no scores version.
#[test]
fn judge_under_a_memory_limit_scores_the_same_or_exits_2_naming_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let model = rt
        .block_on(MockServer::start(
            loopback(),
            MockConfig {
                answer: AnswerMode::Vader,
                ..mock_cfg(vec![])
            },
        ))
        .unwrap();
    let judge = rt
        .block_on(MockServer::start(
            loopback(),
            MockConfig {
                answer: AnswerMode::Checklist,
                ..mock_cfg(vec![])
            },
        ))
        .unwrap();
    let p = pipeline(
        dir.path(),
        "judged",
        &model.base_url(),
        200,
        "concurrency = 32",
    );
    let root = dir.path().join("run");
    let o = bin()
        .args(["run", p.to_str().unwrap(), "--out", root.to_str().unwrap()])
        .env("EVALFLOW_CACHE_DIR", "off")
        .output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let scorer = dir.path().join("judge.toml");
    std::fs::write(
        &scorer,
        format!(
            "[[scorer]]\nname = \"helpful\"\nkind = \"judge\"\nmetric = \"numeric\"\n\
             model = {{ provider = \"openai\", base_url = \"{}\", name = \"judge-model\", temperature = 0.0, concurrency = 32 }}\n\
             questions = [{{ id = \"label\", text = \"Is the answer a sentiment label?\" }}, {{ id = \"short\", text = \"Is it one word?\" }}]\n",
            judge.base_url()
        ),
    )
    .unwrap();
    let copy = |name: &str| {
        let to = dir.path().join(name);
        let o = Command::new("cp")
            .args(["-a", root.to_str().unwrap(), to.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(o.status.success());
        to
    };
    let (free, limited, tiny) = (copy("free"), copy("limited"), copy("tiny"));
    let rescore = |root: &Path, limit: Option<&str>| {
        let mut args: Vec<String> = limit
            .map(|l| vec!["--memory-limit".to_string(), l.to_string()])
            .unwrap_or_default();
        args.extend(
            [
                "rescore",
                root.to_str().unwrap(),
                "--scorer-file",
                scorer.to_str().unwrap(),
            ]
            .map(String::from),
        );
        bin().args(args).env("EVALFLOW_CACHE_DIR", "off").output()
    };
    let scores = |root: &Path| {
        rt.block_on(async {
            let store = evalflow::storage::RunStore::open(root.to_str().unwrap()).unwrap();
            let ctx = evalflow::query::new_context();
            evalflow::query::register_run(&ctx, &store, "")
                .await
                .unwrap();
            evalflow::query::text_rows(
                &ctx,
                "SELECT call_id, scoring_version, validity, score, passed FROM scores \
                 WHERE scorer = 'helpful' ORDER BY call_id",
            )
            .await
            .unwrap()
        })
    };
    let o = rescore(&free, None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = rescore(&limited, Some("16MiB"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (a, b) = (scores(&free), scores(&limited));
    assert_eq!(a.len(), 1000);
    assert_eq!(a, b, "the same judge scores under a 16 MiB limit");
    let before: Vec<_> = std::fs::read_dir(tiny.join("scores"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let o = rescore(&tiny, Some("2KiB"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("memory limit of 2.0 KiB"), "{err}");
    assert!(!err.contains("cannot be built"), "{err}");
    assert!(
        err.contains("judge prompts"),
        "the judge's own query hit the limit: {err}"
    );
    let after: Vec<_> = std::fs::read_dir(tiny.join("scores"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(before, after, "no scores version left behind");
    drop((model, judge));
}

/// A misspelt scorer in `[score] scorers` is found before any stage runs: exit 2 naming the
/// pipeline file and `score.scorers`, not one request sent to the server, no run root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_scorer_is_refused_before_any_call_is_paid() {
    let dir = tempfile::tempdir().unwrap();
    let server = MockServer::start(loopback(), mock_cfg(vec![]))
        .await
        .unwrap();
    let p = pipeline(dir.path(), "typo", &server.base_url(), 2, "");
    let text = std::fs::read_to_string(&p).unwrap() + "\n[score]\nscorers = [\"chekclist\"]\n";
    std::fs::write(&p, text).unwrap();
    let root = dir.path().join("run");
    let args = [
        "run".to_string(),
        p.display().to_string(),
        "--out".into(),
        root.display().to_string(),
    ];
    let o = tokio::task::spawn_blocking(move || {
        bin().args(args).env("EVALFLOW_CACHE_DIR", "off").output()
    })
    .await
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        server.requests(),
        0,
        "no call before the scorer is known: {err}"
    );
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("{}:", p.display()))
            && err.contains("field `score.scorers`: unknown scorer `chekclist`"),
        "{err}"
    );
    assert!(!root.join("manifest.json").exists());
}

/// `call --retry-errors`: the calls that ended as provider errors (5xx, no retry budget) are
/// sent again as new attempts, in place. After a retry killed mid-flight and one run to the
/// end: one row per call with the same ids, the answered rows of the first session untouched,
/// no call the server answered requested again (beyond the `concurrency` in flight at the
/// kill), each replaced row counting its earlier attempt, and the verdicts and scores made
/// again from the new rows (score refuses to run on the old verdicts).
#[test]
fn retry_errors_resends_only_the_failed_calls_in_place() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let cfg = MockConfig {
        latency: Duration::from_millis(40),
        request_log: Some(log.clone()),
        ..mock_cfg(vec![(Fault::ServerError, 0.4)])
    };
    let server = rt.block_on(MockServer::start(loopback(), cfg)).unwrap();
    let concurrency = 4;
    let p = pipeline(
        dir.path(),
        "retry",
        &server.base_url(),
        40,
        &format!("max_retries = 0\nconcurrency = {concurrency}"),
    );
    let root = dir.path().join("run");
    let (ps, rs) = (p.to_str().unwrap(), root.to_str().unwrap());
    let cli = |args: &[&str]| bin().args(args).env("EVALFLOW_CACHE_DIR", "off");
    let ok = |args: &[&str]| {
        let o = cli(args).output();
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    ok(&["run", ps, "--out", rs]);
    let first = rt.block_on(calls(&root));
    assert_eq!(first.len(), 200);
    let failed: HashSet<String> = first
        .iter()
        .filter(|r| r.error.is_some())
        .map(|r| r.call_id.clone())
        .collect();
    assert!((40..120).contains(&failed.len()), "{} errors", failed.len());
    assert!(first.iter().all(|r| r.attempts == 1));
    let mark0 = read_log(&log).len();
    assert_eq!(mark0, 200, "one request per call");

    // A retry killed after some requests.
    let mut child = cli(&["call", ps, "--out", rs, "--retry-errors"])
        .command()
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while read_log(&log).len() < mark0 + 20 && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mark1 = read_log(&log).len();
    assert!(
        mark1 > mark0 && mark1 < mark0 + failed.len(),
        "the kill came mid-retry"
    );
    let out = ok(&["call", ps, "--out", rs, "--retry-errors"]);
    assert!(out.contains("error rows replaced by new attempts"), "{out}");
    assert!(!root.join("_retry.json").exists(), "the retry finished");

    let reqs = read_log(&log);
    let second = rt.block_on(calls(&root));
    let ids = |rows: &[Row]| -> Vec<String> {
        let mut v: Vec<String> = rows.iter().map(|r| r.call_id.clone()).collect();
        v.sort();
        v
    };
    assert_eq!(
        ids(&second),
        ids(&first),
        "one row per call, the same call ids"
    );
    let before: HashMap<&str, &Row> = first.iter().map(|r| (r.call_id.as_str(), r)).collect();
    let mut requested: HashMap<&str, usize> = HashMap::new();
    for r in &reqs {
        *requested.entry(r["call_id"].as_str().unwrap()).or_default() += 1;
    }
    // Only failed calls reach the server in the retries; a call the killed session got an
    // answer for is sent again only if it was in flight at the kill.
    for r in &reqs[mark0..] {
        let id = r["call_id"].as_str().unwrap();
        assert!(
            failed.contains(id),
            "answered call {id} was requested again"
        );
    }
    let answered_in_killed: HashSet<&str> = reqs[mark0..mark1]
        .iter()
        .filter(|r| r["fault"].is_null())
        .map(|r| r["call_id"].as_str().unwrap())
        .collect();
    let resent = reqs[mark1..]
        .iter()
        .filter(|r| answered_in_killed.contains(r["call_id"].as_str().unwrap()))
        .count();
    assert!(
        resent <= concurrency,
        "{resent} answered calls re-sent after the kill"
    );
    let mut fixed = 0;
    for r in &second {
        let old = before[r.call_id.as_str()];
        if failed.contains(&r.call_id) {
            // Every request the server saw for it, less those lost in flight at the kill.
            let n = requested[r.call_id.as_str()];
            assert!(
                r.attempts >= 2 && r.attempts as usize <= n,
                "{r:?}: {n} requests"
            );
            if !reqs[mark0..mark1]
                .iter()
                .any(|q| q["call_id"] == r.call_id.as_str())
            {
                assert_eq!(r.attempts, 2, "{r:?}: the first attempt and one retry");
            }
            fixed += usize::from(r.error.is_none());
        } else {
            assert_eq!(
                (&r.response, r.attempts, &r.error),
                (&old.response, old.attempts, &old.error),
                "answered rows are kept as they were"
            );
        }
    }
    assert!(
        fixed > failed.len() / 3,
        "{fixed} of {} answered now",
        failed.len()
    );
    let still = second.iter().filter(|r| r.error.is_some()).count();
    assert_eq!(still, failed.len() - fixed);

    // The old verdicts no longer describe the rows: score waits for validate.
    let o = cli(&["score", ps, "--out", rs]).output();
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("validate"));
    ok(&["run", ps, "--out", rs]);
    assert_eq!(read_log(&log).len(), reqs.len(), "run sends nothing more");
    let v = rt.block_on(validity(&root));
    let store = evalflow::storage::RunStore::open(rs).unwrap();
    assert_eq!(rt.block_on(store.table_rows("validity")).unwrap(), 200);
    assert_eq!(v.len(), 200, "one verdict per call");
    eprintln!(
        "retry: {} errors, {fixed} answered now, {resent} re-sent after the kill, requests {}",
        failed.len(),
        reqs.len()
    );
    let provider_errors = v.values().filter(|x| *x == "provider_error").count();
    assert_eq!(provider_errors, still);
    for r in &second {
        assert_eq!(
            v[&r.call_id] == "provider_error",
            r.error.is_some(),
            "{r:?}"
        );
    }
}

/// `score --retry-errors` reaches a judge scorer: the judge calls that failed (5xx, no retry
/// budget) are sent again in the judge's nested run, in place, and only they; the judge
/// scores are made again from the new replies, so fewer rows are `judge_error`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_errors_resends_a_judges_failed_calls() {
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
            ..mock_cfg(vec![(Fault::ServerError, 0.4)])
        },
    )
    .await
    .unwrap();
    let p = pipeline(dir.path(), "jretry", &model.base_url(), 8, "");
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "[suite]",
        &format!(
            "[judge]\nprovider = \"openai\"\nbase_url = \"{}\"\nname = \"judge-model\"\n\
             temperature = 0.0\nmax_retries = 0\n\n[score]\nscorers = [\"judge\"]\n\n\
             [[score.judge.questions]]\nid = \"label\"\ntext = \"Is the answer a label?\"\n\n[suite]",
            judge.base_url()
        ),
    );
    std::fs::write(&p, text).unwrap();
    let root = dir.path().join("run");
    let mut r = Runner::open(&p, Some(root.to_str().unwrap()))
        .await
        .unwrap();
    r.run_all().await.unwrap();
    let judge_errors = |r: &Runner| {
        let store = r.store.clone();
        async move {
            let ctx = evalflow::query::new_context();
            evalflow::query::register_run(&ctx, &store, "")
                .await
                .unwrap();
            let rows = evalflow::query::text_rows(
                &ctx,
                "SELECT count(*), sum(CASE WHEN validity = 'judge_error' THEN 1 ELSE 0 END) \
                 FROM scores WHERE scorer = 'judge'",
            )
            .await
            .unwrap();
            let n = |i: usize| rows[0][i].as_deref().unwrap().parse::<usize>().unwrap();
            (n(0), n(1))
        }
    };
    let (n, failed) = judge_errors(&r).await;
    assert_eq!(n, 40);
    assert!((6..30).contains(&failed), "{failed} judge errors");
    let sub = std::fs::read_dir(root.join("judge"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("1+"))
        .unwrap();
    let before = calls(&sub).await;
    let sent = judge.requests();
    assert_eq!(sent, 40);

    r.retry_errors = true;
    for s in r.prepared_scorers().await.unwrap() {
        r.score(s.as_ref()).await.unwrap();
    }
    assert_eq!(
        judge.requests() - sent,
        failed as u64,
        "only the failed judge calls are sent again"
    );
    let after = calls(&sub).await;
    assert_eq!(after.len(), 40, "one judge call per judged answer");
    let still = after.iter().filter(|c| c.error.is_some()).count();
    assert!(still < failed, "{still} of {failed} still failed");
    let old: HashMap<&str, &Row> = before.iter().map(|c| (c.call_id.as_str(), c)).collect();
    for c in &after {
        let o = old[c.call_id.as_str()];
        if o.error.is_none() {
            assert_eq!((&c.response, c.attempts), (&o.response, o.attempts));
        } else {
            assert_eq!(c.attempts, 2, "{c:?}");
        }
    }
    assert_eq!(judge_errors(&r).await, (40, still));
}

/// The judge at corpus scale, in small: a judged run whose calls are in many parts (one
/// nested `cases` part per calls part, the replies read part by part) gives the same scores
/// table as the same run in one part, with prompts byte-identical to `judge::prompt` of
/// each valid answer; and a judge SIGKILLed mid-run, then resumed, pays no judge call twice
/// beyond the calls in flight at the kill, keeping the same call ids.
#[test]
fn a_judge_over_many_parts_scores_the_same_and_resumes_without_paying_twice() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("judge-requests.jsonl");
    let concurrency = 8;
    let judge = rt
        .block_on(MockServer::start(
            loopback(),
            MockConfig {
                answer: AnswerMode::Checklist,
                latency: Duration::from_millis(20),
                request_log: Some(log.clone()),
                ..mock_cfg(vec![])
            },
        ))
        .unwrap();
    // A recorded corpus of 600 answers (one in ten empty, one in twenty a provider error),
    // imported in one part and in parts of 53 rows.
    let corpus = dir.path().join("corpus.jsonl");
    let labels = ["positive", "negative", "neutral"];
    let lines: Vec<String> = (0..600)
        .map(|i| {
            let prompt = format!("Classify the sentiment of review {}: the room was clean", i / 2);
            let content = match i % 10 {
                0 => String::new(),
                k if k < 5 => labels[i % 3].to_string(),
                _ => format!("{}. The room was clean, answer {i}.", labels[i % 3]),
            };
            let line = if i % 20 == 7 {
                serde_json::json!({
                    "request": {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 64},
                    "sample_idx": i % 2, "response": null, "http_status": 503, "error": "overloaded"
                })
            } else {
                serde_json::json!({
                    "request": {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 64},
                    "sample_idx": i % 2,
                    "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                 "finish_reason": if content.is_empty() { "length" } else { "stop" }}],
                                 "usage": {"prompt_tokens": 12, "completion_tokens": 9}}
                })
            };
            line.to_string()
        })
        .collect();
    std::fs::write(&corpus, lines.join("\n") + "\n").unwrap();
    let bin_ok = |args: &[&str]| {
        let o = bin().args(args).env("EVALFLOW_CACHE_DIR", "off").output();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    // Imported, then (`part_rows`) its calls cut into parts of that many rows, then validated
    // (validity parts 1:1 with calls parts).
    let imported = |root: &Path, part_rows: Option<usize>| {
        let root_s = root.to_str().unwrap();
        bin_ok(&["import", corpus.to_str().unwrap(), "--out", root_s]);
        if let Some(n) = part_rows {
            rt.block_on(async {
                let store = evalflow::storage::RunStore::open(root_s).unwrap();
                let mut s = store.read_table("calls", Table::Calls).await.unwrap();
                let mut batches = vec![];
                while let Some(b) = s.next().await {
                    batches.push(b.unwrap());
                }
                drop(s);
                store.delete_dir("calls").await.unwrap();
                let mut w = store
                    .part_writer("calls", batches[0].schema(), "part-cut")
                    .with_part_rows(n);
                for b in &batches {
                    for k in (0..b.num_rows()).step_by(n) {
                        w.write(b.slice(k, n.min(b.num_rows() - k))).await.unwrap();
                    }
                }
                w.finish().await.unwrap();
            });
        }
        let pipe = root.join("import.toml");
        bin_ok(&["validate", pipe.to_str().unwrap(), "--out", root_s]);
    };
    let (whole, parts) = (dir.path().join("whole"), dir.path().join("parts"));
    imported(&whole, None);
    imported(&parts, Some(53));
    let n_parts = |root: &Path, table: &str| {
        rt.block_on(async {
            let store = evalflow::storage::RunStore::open(root.to_str().unwrap()).unwrap();
            store.list_parts(table).await.unwrap().len()
        })
    };
    assert_eq!(n_parts(&whole, "calls"), 1);
    let calls_parts = n_parts(&parts, "calls");
    assert!(calls_parts >= 10, "{calls_parts} calls parts");
    let killed = dir.path().join("killed");
    let o = Command::new("cp")
        .args(["-a", parts.to_str().unwrap(), killed.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success());

    let questions = [
        ("label", "Is the answer a sentiment label?"),
        ("short", "Is it one word?"),
        ("polite", "Is it polite?"),
    ];
    let scorer = dir.path().join("judge.toml");
    let qs: Vec<String> = questions
        .iter()
        .map(|(id, text)| format!("{{ id = \"{id}\", text = \"{text}\" }}"))
        .collect();
    std::fs::write(
        &scorer,
        format!(
            "[[scorer]]\nname = \"helpful\"\nkind = \"judge\"\nmetric = \"numeric\"\n\
             model = {{ provider = \"openai\", base_url = \"{}\", name = \"judge-model\", temperature = 0.0, concurrency = {concurrency} }}\n\
             questions = [{}]\n",
            judge.base_url(),
            qs.join(", ")
        ),
    )
    .unwrap();
    let rescore = |root: &Path| {
        bin()
            .args([
                "rescore",
                root.to_str().unwrap(),
                "--scorer-file",
                scorer.to_str().unwrap(),
            ])
            .env("EVALFLOW_CACHE_DIR", "off")
    };
    let query = |root: &Path, sql: &str| {
        rt.block_on(async {
            let store = evalflow::storage::RunStore::open(root.to_str().unwrap()).unwrap();
            let ctx = evalflow::query::new_context();
            evalflow::query::register_run(&ctx, &store, "")
                .await
                .unwrap();
            evalflow::query::text_rows(&ctx, sql).await.unwrap()
        })
    };
    let scores = |root: &Path| {
        query(
            root,
            "SELECT call_id, scoring_version, validity, score, passed, label, detail, \
             array_to_string(answers, ',') FROM scores WHERE scorer = 'helpful' ORDER BY call_id",
        )
    };
    let nested = |root: &Path| {
        let v: Vec<_> = std::fs::read_dir(root.join("judge"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(v.len(), 1, "one judge version");
        v[0].clone()
    };
    for root in [&whole, &parts] {
        let o = rescore(root).output();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let (a, b) = (scores(&whole), scores(&parts));
    assert_eq!(a.len(), 600);
    assert_eq!(
        a, b,
        "the same scores table from one part and from {calls_parts}"
    );
    let scored = a.iter().filter(|r| r[3].is_some()).count();
    let valid = rt
        .block_on(validity(&whole))
        .values()
        .filter(|v| v.as_str() == "valid_answer")
        .count();
    assert!(scored > 500, "{scored} judged rows");
    // One nested cases part per calls part holding valid answers, named after it.
    assert_eq!(n_parts(&nested(&whole), "cases"), 1);
    assert_eq!(n_parts(&nested(&parts), "cases"), calls_parts);
    // The prompts, byte for byte: the judged call's id and `judge::prompt` of its answer.
    let checklist = evalflow::pipeline::JudgeChecklist {
        questions: questions
            .iter()
            .map(|(id, text)| evalflow::pipeline::JudgeQuestion {
                id: id.to_string(),
                text: text.to_string(),
            })
            .collect(),
        instructions: None,
        version: None,
    };
    let judged = query(
        &parts,
        "SELECT k.call_id, c.input, k.response FROM calls k JOIN validity v ON k.call_id = v.call_id \
         JOIN cases c ON k.case_id = c.case_id WHERE v.validity = 'valid_answer' ORDER BY k.call_id",
    );
    let prompts = query(
        &nested(&parts),
        "SELECT case_id, input FROM cases ORDER BY case_id",
    );
    assert_eq!(judged.len(), prompts.len());
    assert_eq!(
        judged.len(),
        scored
            + a.iter()
                .filter(|r| r[2].as_deref().is_some_and(|v| v.starts_with("judge_")))
                .count()
    );
    for (j, p) in judged.iter().zip(&prompts) {
        assert_eq!(j[0], p[0]);
        let want = evalflow::stages::score::judge::prompt(
            &checklist,
            j[1].as_deref().unwrap_or_default(),
            j[2].as_deref().unwrap_or_default(),
        );
        assert_eq!(p[1].as_deref(), Some(want.as_str()));
    }

    // SIGKILL the judge of a third copy mid-run, then resume it.
    let mark = read_log(&log).len();
    assert_eq!(
        mark,
        2 * judged.len(),
        "one judge request per valid answer and run"
    );
    let mut child = rescore(&killed)
        .command()
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while read_log(&log).len() < mark + judged.len() / 3 && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let killed_at = read_log(&log).len();
    assert!(
        killed_at > mark && killed_at < mark + judged.len(),
        "the kill interrupted the judge: {} of {} requests",
        killed_at - mark,
        judged.len()
    );
    let o = rescore(&killed).output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let reqs = read_log(&log);
    let mut per_call: HashMap<String, usize> = HashMap::new();
    for r in &reqs[mark..] {
        *per_call
            .entry(r["call_id"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    assert_eq!(per_call.len(), judged.len(), "every judge call was paid");
    let twice = per_call.values().filter(|n| **n > 1).count();
    assert!(per_call.values().all(|n| *n <= 2));
    assert!(
        twice <= concurrency,
        "{twice} judge calls paid twice (concurrency {concurrency})"
    );
    assert_eq!(reqs.len() - mark, judged.len() + twice);
    // The resumed judge kept the call ids of a clean one, and scores the same.
    let ids = |root: &Path| query(&nested(root), "SELECT call_id FROM calls ORDER BY call_id");
    assert_eq!(ids(&killed), ids(&parts));
    assert_eq!(scores(&killed), b, "a resumed judge scores the same");
    assert_eq!(valid, judged.len(), "one judge prompt per valid answer");

    // The judge's calls of `parts` cut into parts of 20 rows in the order of the judged
    // parts (as a long judge's commits come, in cases order): a judged part's replies sit
    // in at most 4 of them, and only those are read for it (debug log), where every judged
    // part read every nested part before; the scores stay the same, with no request.
    let cut = 20;
    rt.block_on(async {
        use datafusion::arrow::compute::{concat_batches, take_record_batch};
        let run = evalflow::storage::RunStore::open(parts.to_str().unwrap()).unwrap();
        let mut part_of: HashMap<String, usize> = HashMap::new();
        for (k, m) in run.list_parts("calls").await.unwrap().iter().enumerate() {
            let mut s = run.read_part(m, Table::Calls).await.unwrap();
            while let Some(b) = s.next().await {
                let b = evalflow::schema::plain_strings(b.unwrap());
                let ids = b.column_by_name("call_id").unwrap();
                let ids = ids.as_any().downcast_ref::<StringArray>().unwrap();
                for id in ids.iter().flatten() {
                    part_of.insert(id.to_string(), k);
                }
            }
        }
        let sub = evalflow::storage::RunStore::open(nested(&parts).to_str().unwrap()).unwrap();
        let mut s = sub.read_table("calls", Table::Calls).await.unwrap();
        let mut batches = vec![];
        while let Some(b) = s.next().await {
            batches.push(evalflow::schema::plain_strings(b.unwrap()));
        }
        drop(s);
        let all = concat_batches(&batches[0].schema(), &batches).unwrap();
        let case_ids = all.column_by_name("case_id").unwrap();
        let case_ids = case_ids.as_any().downcast_ref::<StringArray>().unwrap();
        let mut order: Vec<u32> = (0..all.num_rows() as u32).collect();
        order.sort_by_key(|i| part_of[case_ids.value(*i as usize)]);
        let sorted = take_record_batch(
            &all,
            &Int32Array::from_iter_values(order.iter().map(|i| *i as i32)),
        )
        .unwrap();
        sub.delete_dir("calls").await.unwrap();
        let mut w = sub
            .part_writer("calls", sorted.schema(), "part-cut")
            .with_part_rows(cut);
        for k in (0..sorted.num_rows()).step_by(cut) {
            w.write(sorted.slice(k, cut.min(sorted.num_rows() - k)))
                .await
                .unwrap();
        }
        w.finish().await.unwrap();
    });
    let nested_parts = n_parts(&nested(&parts), "calls");
    assert!(nested_parts >= 20, "{nested_parts} nested calls parts");
    let before = read_log(&log).len();
    // Rescoring never overwrites a scores version: the first one goes.
    for e in std::fs::read_dir(parts.join("scores")).unwrap() {
        let p = e.unwrap().path();
        if p.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("helpful@")
        {
            std::fs::remove_dir_all(p).unwrap();
        }
    }
    let o = rescore(&parts).env("RUST_LOG", "evalflow=debug").output();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{err}");
    assert_eq!(read_log(&log).len(), before, "no judge call paid again");
    let reads: Vec<(usize, usize)> = err
        .lines()
        .filter_map(|l| {
            let t = l.split("judge: ").last()?;
            let w: Vec<&str> = t.split(' ').collect();
            (w.get(3) == Some(&"reply")).then(|| (w[0].parse().unwrap(), w[2].parse().unwrap()))
        })
        .collect();
    assert_eq!(reads.len(), calls_parts, "one read per judged part: {err}");
    for (read, of) in &reads {
        assert_eq!(*of, nested_parts);
        assert!(
            (1..=4).contains(read),
            "{read} of {of} nested parts read for one judged part"
        );
    }
    assert_eq!(scores(&parts), b, "the same scores from the pruned reads");
    drop(judge);
}

/// Two `call` processes on one root (an overlapping cron job): the second is refused, exit 2
/// naming the first, every time; with `--wait-lock` it waits and then finds nothing to send.
/// No request reaches the server twice and `calls` holds each call once. On S3 (moto) the
/// lease is a conditional put. The mock answers in 500 ms, 4 at a time: the first runs
/// about 10 s, time for five refusals on a loaded machine.
fn second_writer(on_s3: bool) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let cfg = MockConfig {
        latency: Duration::from_millis(500),
        request_log: Some(log.clone()),
        ..mock_cfg(vec![])
    };
    let server = rt.block_on(MockServer::start(loopback(), cfg)).unwrap();
    let p = pipeline(dir.path(), "two", &server.base_url(), 16, "concurrency = 4");
    let moto = on_s3.then(|| moto::Moto::start("lease"));
    let root = dir.path().join("run");
    let url = if on_s3 {
        "s3://lease/runs/r".to_string()
    } else {
        root.to_str().unwrap().to_string()
    };
    let (p, root_s) = (p.to_str().unwrap(), url.as_str());
    let state = dir.path().join("state");
    let cache = dir.path().join("cache");
    let with_env = |mut e: Evalflow| {
        e = e
            .env("EVALFLOW_CACHE_DIR", cache.to_str().unwrap())
            .env("EVALFLOW_STATE_DIR", state.to_str().unwrap());
        for (k, v) in moto.iter().flat_map(|m| m.env()) {
            e = e.env(k, &v);
        }
        e
    };
    let o = with_env(bin().args(["generate", p, "--out", root_s])).output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let mut first = KillOnDrop(
        with_env(bin().args(["call", p, "--out", root_s]))
            .command()
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // The first holds the lease once a request reached the server (it takes the lease
    // before it reads the manifest, long before it sends).
    let t0 = std::time::Instant::now();
    while read_log(&log).is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the first call never sent"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // A waiter started while the first runs: it must wait, then find nothing to send.
    let waiter = with_env(bin().args(["call", p, "--out", root_s, "--wait-lock"]))
        .command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let holders = [first.0.id().to_string(), waiter.id().to_string()];
    for _ in 0..5 {
        let o = with_env(bin().args(["call", p, "--out", root_s])).output();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        // The holder is the first, or (on a slow machine) the waiter that took over.
        assert!(
            err.contains("another writer holds this root")
                && err.contains("`evalflow call`")
                && holders.iter().any(|h| err.contains(&format!("pid {h}"))),
            "{err}"
        );
    }
    let o = waiter.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("waiting for `evalflow call`"), "{err}");
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("0 sent now, 80 already committed"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(first.0.wait().unwrap().success());

    if let Some(m) = &moto {
        rt.block_on(mirror(&m.endpoint, "lease", "runs/r", &root));
    }
    let rows = rt.block_on(calls(&root));
    let ids: HashSet<&str> = rows.iter().map(|r| r.call_id.as_str()).collect();
    assert_eq!((rows.len(), ids.len()), (80, 80));
    assert_eq!(read_log(&log).len(), 80, "each call requested once");
    // A reader needs no lease: sql answers while nothing holds it.
    let o =
        with_env(bin().args(["sql", "SELECT count(*) AS n FROM calls", "--run", root_s])).output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn a_second_writer_on_one_root_is_refused_or_waits_and_nothing_is_paid_twice() {
    second_writer(false);
}

#[test]
fn a_second_writer_on_an_s3_root_is_refused_or_waits_and_nothing_is_paid_twice() {
    second_writer(true);
}
