//! Failed calls speak (issue 61, item 11): a run whose every call failed exits non-zero
//! naming each error kind with its first message and `--retry-errors`; a run of
//! out-of-credit answers stops the sending; a run with some failures exits 0 and prints
//! their counts. Against the in-process mock server, the CLI in a child process.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use evalflow::mock::{Fault, MockConfig, MockServer};

#[path = "common/child.rs"]
mod child;

/// Runs the CLI when started by [`child::command`]; a no-op test otherwise.
#[test]
fn child_evalflow() {
    child::run_if_child();
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A pipeline with `n_items * 5` unique prompts against `base_url`.
fn pipeline(dir: &Path, base_url: &str, n_items: usize, model_extra: &str) -> PathBuf {
    let items: Vec<String> = (0..n_items).map(|i| format!("\"{i}\"")).collect();
    let text = format!(
        r#"[model]
provider = "openai"
base_url = "{base_url}"
name = "mock-model"
max_tokens = 16
max_retries = 0
timeout_secs = 5
{model_extra}

[suite]
name = "failsuite"
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
    let p = dir.join("pipeline.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// `evalflow ARGS` to its end: exit code, stdout, stderr.
fn evalflow(args: &[&str]) -> (Option<i32>, String, String) {
    let o = child::child(args, &[("EVALFLOW_CACHE_DIR", "off")]);
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn manifest(root: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(root.join("manifest.json")).unwrap()).unwrap()
}

fn requests(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .count()
}

/// Connection refused (a port nobody listens on) and out of credit on every call: exit 3
/// (a failure, not bad input), the kind, its count and first message, and the hint.
#[test]
fn a_run_whose_every_call_failed_exits_non_zero_naming_each_kind() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // A port that was free a moment ago and nobody listens on now.
    let closed = std::net::TcpListener::bind(loopback()).unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let p = pipeline(
        dir.path(),
        &format!("http://127.0.0.1:{port}/v1"),
        2,
        "concurrency = 2",
    );
    let root = dir.path().join("refused");
    let (code, _, err) = evalflow(&["run", p.to_str().unwrap(), "--out", root.to_str().unwrap()]);
    assert_eq!(code, Some(3), "{err}");
    assert!(
        err.contains("call: no call succeeded: all 10 calls ended in an error, by kind:"),
        "{err}"
    );
    assert!(
        err.contains("  connection failed: 10 (first: connection failed: "),
        "{err}"
    );
    assert!(
        err.contains("with --retry-errors to send them again"),
        "{err}"
    );
    // The calls are recorded (call complete); nothing was validated or scored.
    let m = manifest(&root);
    assert_eq!(m["stages"]["call"]["status"], "complete", "{m}");
    assert!(m["stages"].get("validate").is_none(), "{m}");
    // `call` on the same root says the same (no call answered, none sent again).
    let (code, out, err) =
        evalflow(&["call", p.to_str().unwrap(), "--out", root.to_str().unwrap()]);
    assert_eq!(code, Some(3), "{err}");
    assert!(out.contains("calls: 10 rows"), "{out}");
    assert!(err.contains("  connection failed: 10 (first: "), "{err}");

    // Out of credit: 10 calls, fewer than the stop's 20 in a row.
    let server = rt
        .block_on(MockServer::start(
            loopback(),
            MockConfig {
                faults: vec![(Fault::OutOfCredit, 1.0)],
                ..MockConfig::default()
            },
        ))
        .unwrap();
    let d2 = tempfile::tempdir().unwrap();
    let p = pipeline(d2.path(), &server.base_url(), 2, "concurrency = 2");
    let root = d2.path().join("credit");
    let (code, _, err) = evalflow(&["run", p.to_str().unwrap(), "--out", root.to_str().unwrap()]);
    assert_eq!(code, Some(3), "{err}");
    assert!(
        err.contains("  HTTP 403 (out of credit or forbidden): 10 (first: HTTP 403: ")
            && err.contains("You exceeded your current quota: out of credit (mock)"),
        "{err}"
    );
    assert!(err.contains("--retry-errors"), "{err}");
}

/// A run of 403 answers stops the sending: 200 calls, 4 at a time, every answer a 403: the
/// server sees the 20 that stopped it and at most those in flight, and the stage is left
/// unfinished for a later command.
#[test]
fn a_run_of_out_of_credit_answers_stops_sending() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let server = rt
        .block_on(MockServer::start(
            loopback(),
            MockConfig {
                faults: vec![(Fault::OutOfCredit, 1.0)],
                latency: Duration::from_millis(5),
                request_log: Some(log.clone()),
                ..MockConfig::default()
            },
        ))
        .unwrap();
    let concurrency = 4;
    let p = pipeline(
        dir.path(),
        &server.base_url(),
        40,
        &format!("concurrency = {concurrency}"),
    );
    let root = dir.path().join("run");
    let (code, _, err) = evalflow(&["run", p.to_str().unwrap(), "--out", root.to_str().unwrap()]);
    assert_eq!(code, Some(3), "{err}");
    let sent = requests(&log);
    assert!(
        (20..=20 + concurrency).contains(&sent),
        "{sent} requests of 200: {err}"
    );
    assert!(
        err.contains(&format!(
            "call: stopped sending after 20 HTTP 403 answers in a row (out of credit or forbidden: every further request would be \
             refused too); {sent} of 200 calls are recorded, the rest were not sent."
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "  HTTP 403 (out of credit or forbidden): {sent} (first: HTTP 403: "
        )),
        "{err}"
    );
    let m = manifest(&root);
    assert_eq!(m["stages"]["call"]["status"], "running", "{m}");
}

/// Some calls fail: exit 0, and stderr counts the failures by kind (the counts equal the
/// error rows of the calls table) with the hint.
#[test]
fn a_run_with_some_failed_calls_exits_0_and_prints_their_counts() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let server = rt
        .block_on(MockServer::start(
            loopback(),
            MockConfig {
                faults: vec![(Fault::ServerError, 0.3)],
                ..MockConfig::default()
            },
        ))
        .unwrap();
    let p = pipeline(dir.path(), &server.base_url(), 10, "concurrency = 4");
    let root = dir.path().join("run");
    let (code, _, err) = evalflow(&["run", p.to_str().unwrap(), "--out", root.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    let (code, json, e2) = evalflow(&[
        "sql",
        "SELECT http_status, count(*) AS n FROM calls WHERE error IS NOT NULL GROUP BY http_status ORDER BY http_status",
        "--run",
        root.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert_eq!(code, Some(0), "{e2}");
    // The child's stdout starts with the test harness's own line.
    let json = &json[json.find('[').unwrap()..];
    let by_status: Vec<(i64, i64)> = serde_json::from_str::<serde_json::Value>(json)
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["http_status"].as_i64().unwrap(), r["n"].as_i64().unwrap()))
        .collect();
    let failed: i64 = by_status.iter().map(|(_, n)| n).sum();
    assert!((5..=25).contains(&failed), "{by_status:?}");
    assert!(
        err.contains(&format!(
            "calls: {failed} of 50 ended in an error, by kind:"
        )),
        "{err}"
    );
    for (status, n) in &by_status {
        assert!(
            err.contains(&format!("  HTTP {status}: {n} (first: HTTP {status}: ")),
            "{status}: {err}"
        );
    }
    assert!(
        err.contains("run the same command with --retry-errors to send the failed calls again"),
        "{err}"
    );
    assert_eq!(manifest(&root)["stages"]["aggregate"]["status"], "complete");
}
