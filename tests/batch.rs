//! Batch mode over real HTTP (loopback only) against the mock's Batch API: the same calls,
//! validity and scores as synchronous calls; SIGKILL-style aborts at every step of a batch's
//! life, then resume, with no request in two batches; expiry, per-line errors and failed
//! batches as rows, within the retry budget; `--no-wait`.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::prelude::{ParquetReadOptions, SessionContext};
use evalflow::mock::{AnswerMode, BatchConfig, BatchFault, Fault, MockConfig, MockServer};
use evalflow::runner::Runner;
use serde_json::Value;

#[path = "common/child.rs"]
mod child;
use child::child;

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A pipeline with `n_items * 5` unique prompts, K samples, against `base_url`.
fn pipeline(dir: &Path, name: &str, base_url: &str, n_items: usize, model_extra: &str) -> PathBuf {
    pipeline_for("openai", dir, name, base_url, n_items, model_extra)
}

/// [`pipeline`] for a provider (`openai` or `anthropic`).
fn pipeline_for(
    provider: &str,
    dir: &Path,
    name: &str,
    base_url: &str,
    n_items: usize,
    model_extra: &str,
) -> PathBuf {
    let items: Vec<String> = (0..n_items).map(|i| format!("\"{i}\"")).collect();
    let text = format!(
        r#"[model]
provider = "{provider}"
base_url = "{base_url}"
name = "mock-model"
max_tokens = 16
temperature = 0.0
samples = 2
batch_max_requests = 7
{model_extra}

[suite]
name = "batchsuite"
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

fn mock_cfg(faults: Vec<(Fault, f64)>, log: Option<PathBuf>) -> MockConfig {
    MockConfig {
        latency: Duration::ZERO,
        faults,
        seed: 7,
        request_log: log,
        answer: AnswerMode::Vader,
        retry_after_secs: 0,
    }
}

fn batch_cfg(secs: f64, faults: Vec<(BatchFault, f64)>) -> BatchConfig {
    BatchConfig {
        complete_after: Duration::from_secs_f64(secs),
        faults,
    }
}

/// The rows of a query over every Parquet file under `root/dir`, as text.
async fn table(root: &Path, dir: &str, query: &str) -> String {
    let ctx = SessionContext::new();
    let path = root.join(dir);
    ctx.register_parquet("t", path.to_str().unwrap(), ParquetReadOptions::default())
        .await
        .unwrap();
    let b = ctx.sql(query).await.unwrap().collect().await.unwrap();
    pretty_format_batches(&b).unwrap().to_string()
}

/// (call_id, error, attempts, batch_id) of every calls row.
async fn call_rows(root: &Path) -> Vec<(String, Option<String>, i32, Option<String>)> {
    let has_parts = std::fs::read_dir(root.join("calls")).is_ok_and(|d| {
        d.filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().ends_with(".parquet"))
    });
    if !has_parts {
        return vec![];
    }
    let ctx = SessionContext::new();
    ctx.register_parquet(
        "t",
        root.join("calls").to_str().unwrap(),
        ParquetReadOptions::default(),
    )
    .await
    .unwrap();
    let b = ctx
        .sql("SELECT call_id, error, attempts, batch_id FROM t ORDER BY call_id")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    use datafusion::arrow::array::{Array, AsArray};
    use datafusion::arrow::compute::cast;
    use datafusion::arrow::datatypes::{DataType, Int32Type};
    let mut out = Vec::new();
    for b in b {
        let s = |i: usize| cast(b.column(i), &DataType::Utf8).unwrap();
        let (ids, errs, bids) = (s(0), s(1), s(3));
        let (ids, errs, bids) = (
            ids.as_string::<i32>(),
            errs.as_string::<i32>(),
            bids.as_string::<i32>(),
        );
        let att = b.column(2).as_primitive::<Int32Type>();
        for i in 0..b.num_rows() {
            out.push((
                ids.value(i).to_string(),
                errs.is_valid(i).then(|| errs.value(i).to_string()),
                att.value(i),
                bids.is_valid(i).then(|| bids.value(i).to_string()),
            ));
        }
    }
    out
}

/// The mock's log: custom id -> the batches it went into, and custom id -> lines answered.
fn batch_log(log: &Path) -> (HashMap<String, Vec<String>>, HashMap<String, u32>) {
    let mut batches: HashMap<String, Vec<String>> = HashMap::new();
    let mut answered: HashMap<String, u32> = HashMap::new();
    for line in std::fs::read_to_string(log).unwrap_or_default().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        match v["path"].as_str() {
            Some("/v1/batches" | "/v1/messages/batches") => {
                for id in v["custom_ids"].as_array().unwrap() {
                    batches
                        .entry(id.as_str().unwrap().to_string())
                        .or_default()
                        .push(v["batch_id"].as_str().unwrap().to_string());
                }
            }
            Some("batch:/v1/chat/completions" | "batch:/v1/messages") => {
                *answered
                    .entry(v["call_id"].as_str().unwrap().to_string())
                    .or_default() += 1;
            }
            _ => {}
        }
    }
    (batches, answered)
}

async fn run_all(p: &Path, root: &Path, batch: bool) {
    let mut r = Runner::open(p, Some(root.to_str().unwrap())).await.unwrap();
    r.batch = batch;
    r.run_all().await.unwrap();
}

/// The same suite synchronously and in batch mode: the same calls (ids, responses, tokens,
/// finish reasons, statuses, attempts), validity and scores; batch rows name their batch and
/// every request went into exactly one batch.
async fn same_as_synchronous(provider: &str) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let server = MockServer::start_with(
        loopback(),
        mock_cfg(vec![], Some(log.clone())),
        batch_cfg(0.3, vec![]),
    )
    .await
    .unwrap();
    let price = "price = { input_per_mtok = 1.5, output_per_mtok = 6.0 }";
    let p = pipeline_for(provider, dir.path(), "p", &server.base_url(), 4, price);
    let sync_root = dir.path().join("sync").join("run");
    let batch_root = dir.path().join("batch").join("run");
    run_all(&p, &sync_root, false).await;
    run_all(&p, &batch_root, true).await;
    let calls_q = "SELECT call_id, case_id, model, provider, sample_idx, request_hash, response, \
                   response_hash, finish_reason, prompt_tokens, completion_tokens, http_status, \
                   error, attempts, max_tokens, temperature FROM t ORDER BY call_id";
    let sync_calls = table(&sync_root, "calls", calls_q).await;
    assert_eq!(sync_calls.lines().count(), 4 + 40, "40 rows and the frame");
    assert_eq!(sync_calls, table(&batch_root, "calls", calls_q).await);
    let v_q =
        "SELECT call_id, validity, validity_reason, language, answer_chars FROM t ORDER BY call_id";
    assert_eq!(
        table(&sync_root, "validity", v_q).await,
        table(&batch_root, "validity", v_q).await
    );
    let s_q = "SELECT call_id, scorer, scoring_version, validity, score, passed FROM t ORDER BY call_id, scorer";
    // One folder per scorer version.
    let versions: Vec<String> = std::fs::read_dir(sync_root.join("scores"))
        .unwrap()
        .map(|e| format!("scores/{}", e.unwrap().file_name().to_string_lossy()))
        .collect();
    assert!(!versions.is_empty());
    for v in &versions {
        let scores = table(&sync_root, v, s_q).await;
        assert!(scores.contains("valid_answer"), "{scores}");
        assert_eq!(scores, table(&batch_root, v, s_q).await, "{v}");
    }

    let rows = call_rows(&batch_root).await;
    assert_eq!(rows.len(), 40);
    let (batches, answered) = batch_log(&log);
    for (id, err, attempts, bid) in &rows {
        assert_eq!(err, &None);
        assert_eq!(*attempts, 1);
        let b = &batches[id];
        assert_eq!(b.len(), 1, "{id} went into one batch");
        assert_eq!(bid.as_deref(), Some(b[0].as_str()), "{id} names its batch");
        assert_eq!(answered[id], 1);
    }
    // The manifest prices the tokens: the batch run at half the synchronous run's cost.
    let cost = |root: &Path| {
        let m: Value =
            serde_json::from_slice(&std::fs::read(root.join("manifest.json")).unwrap()).unwrap();
        let d = &m["stages"]["call"]["details"];
        let (p, c) = (
            d["prompt_tokens"].as_i64().unwrap(),
            d["completion_tokens"].as_i64().unwrap(),
        );
        (
            d["cost_usd"].as_f64().unwrap(),
            d["cost_usd_without_batch_discount"].as_f64().unwrap(),
            (p as f64 * 1.5 + c as f64 * 6.0) / 1e6,
        )
    };
    let (sync_cost, sync_full, expected) = cost(&sync_root);
    assert!(expected > 0.0);
    assert_eq!((sync_cost, sync_full), (expected, expected));
    let (batch_cost, batch_full, batch_expected) = cost(&batch_root);
    assert_eq!(batch_expected, expected, "the same tokens");
    assert_eq!(batch_full, expected);
    assert!(
        (batch_cost - expected / 2.0).abs() < 1e-12,
        "{batch_cost} vs {expected}"
    );
    // `check` prices the tokens per model the same way, from the rows' batch_id.
    for (root, paid) in [(&sync_root, expected), (&batch_root, batch_cost)] {
        let o = child(&["check", root.to_str().unwrap()], &[]);
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let batch_calls = if paid < expected { "40" } else { "0" };
        let line = text
            .lines()
            .find(|l| l.contains("mock-model") && l.contains('$'))
            .unwrap_or_else(|| panic!("{text}"));
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cells[1..3], ["40", batch_calls], "{line}");
        assert_eq!(
            cells[5..7],
            [format!("${paid:.6}"), format!("${expected:.6}")],
            "{line}"
        );
    }
    // The report says the same.
    let html = dir.path().join("report.html");
    let o = child(
        &[
            "report",
            batch_root.to_str().unwrap(),
            "--html",
            html.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(
        page.contains(&format!(
            "cost ${batch_cost:.6} (${expected:.6} without the batch discount)"
        )),
        "{}",
        page.lines()
            .find(|l| l.contains("tokens and cost"))
            .unwrap_or("no tokens row")
    );
    // 40 requests in batches of at most 7.
    let mut distinct: Vec<&String> = batches.values().flatten().collect();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_and_synchronous_runs_give_the_same_calls_validity_and_scores() {
    same_as_synchronous("openai").await;
}

/// The same for Anthropic's Message Batches against the synchronous Messages API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_batch_and_synchronous_runs_give_the_same_calls_validity_and_scores() {
    same_as_synchronous("anthropic").await;
}

/// Expiry with half of each batch answered, within a budget of 2 retries: every call has
/// one row; each row's attempts is the number of batches it went into; the calls that never
/// got an answer are `batch_expired` errors after exactly 3 batches; validity marks them.
async fn expiry(provider: &str) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let server = MockServer::start_with(
        loopback(),
        mock_cfg(vec![], Some(log.clone())),
        batch_cfg(0.2, vec![(BatchFault::Expire, 1.0)]),
    )
    .await
    .unwrap();
    let p = pipeline_for(
        provider,
        dir.path(),
        "p",
        &server.base_url(),
        4,
        "max_retries = 2",
    );
    let root = dir.path().join("run");
    run_all(&p, &root, true).await;
    let rows = call_rows(&root).await;
    assert_eq!(rows.len(), 40, "one row per call");
    let (batches, answered) = batch_log(&log);
    let mut errors = 0;
    for (id, err, attempts, _) in &rows {
        let n = batches[id].len() as i32;
        assert_eq!(*attempts, n, "{id}: attempts = batches it went into");
        assert!(n <= 3, "{id}: within the budget");
        match err {
            Some(e) => {
                errors += 1;
                assert_eq!(n, 3, "{id}: an error only once the budget is spent");
                assert!(e.contains("expired"), "{e}");
                assert!(!answered.contains_key(id), "{id} was never answered");
            }
            None => assert_eq!(answered[id], 1, "{id} answered once"),
        }
    }
    // Half of each batch expires, three times over: some calls are left unanswered.
    assert!(errors > 0 && errors < 40, "{errors}");
    let v = table(
        &root,
        "validity",
        "SELECT count(*) AS n FROM t WHERE validity = 'provider_error'",
    )
    .await;
    assert_eq!(
        v.lines()
            .nth(3)
            .unwrap()
            .trim_matches(|c| c == '|' || c == ' '),
        errors.to_string(),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_batches_are_sent_again_within_the_retry_budget() {
    expiry("openai").await;
}

/// The same for Anthropic: the second half of each batch `expired`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_expired_requests_are_sent_again_within_the_retry_budget() {
    expiry("anthropic").await;
}

/// Per-line errors: a 403 (out of credit) is a final error row at its first batch; a 429 is
/// sent again in a later batch, up to 3 retries; answered calls are answered once.
async fn per_line_errors(provider: &str) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let server = MockServer::start_with(
        loopback(),
        mock_cfg(
            vec![(Fault::RateLimit, 0.4), (Fault::OutOfCredit, 0.15)],
            Some(log.clone()),
        ),
        batch_cfg(0.1, vec![]),
    )
    .await
    .unwrap();
    let p = pipeline_for(
        provider,
        dir.path(),
        "p",
        &server.base_url(),
        6,
        "max_retries = 3",
    );
    let root = dir.path().join("run");
    run_all(&p, &root, true).await;
    let rows = call_rows(&root).await;
    assert_eq!(rows.len(), 60);
    let (batches, answered) = batch_log(&log);
    let (mut quota, mut limited, mut ok) = (0, 0, 0);
    for (id, err, attempts, _) in &rows {
        let n = batches[id].len() as i32;
        assert_eq!(*attempts, n, "{id}");
        assert_eq!(
            answered[id] as i32, n,
            "{id}: each batch answered its line once"
        );
        match err.as_deref() {
            Some(e) if e.starts_with("HTTP 403") => quota += 1,
            Some(e) if e.starts_with("HTTP 429") => {
                assert_eq!(n, 4, "{id}: a rate limit is final after 1 + 3 batches");
                limited += 1;
            }
            Some(e) => panic!("{id}: unexpected error {e}"),
            None => ok += 1,
        }
    }
    assert!(
        quota > 0 && ok > 0,
        "quota {quota} limited {limited} ok {ok}"
    );
    assert!(
        rows.iter().any(|r| r.1.is_none() && r.2 > 1),
        "some rate-limited call was answered by a later batch"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_line_errors_end_as_the_synchronous_rows() {
    per_line_errors("openai").await;
}

/// The same for Anthropic's `errored` results (`permission_error`, `rate_limit_error`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_errored_results_end_as_the_synchronous_rows() {
    per_line_errors("anthropic").await;
}

/// A batch that fails validation: every request is a final error row naming it, sent once,
/// and the run fails saying no call succeeded.
async fn failed_batch(provider: &str) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let server = MockServer::start_with(
        loopback(),
        mock_cfg(vec![], Some(log.clone())),
        batch_cfg(0.1, vec![(BatchFault::Invalid, 1.0)]),
    )
    .await
    .unwrap();
    let p = pipeline_for(provider, dir.path(), "p", &server.base_url(), 2, "");
    let root = dir.path().join("run");
    // No call succeeded: the run ends after the call stage, saying so (issue 61, item 11).
    let mut r = Runner::open(&p, Some(root.to_str().unwrap()))
        .await
        .unwrap();
    r.batch = true;
    let e = r.run_all().await.unwrap_err().to_string();
    assert!(
        e.contains("call: no call succeeded: all 20 calls ended in an error, by kind:")
            && e.contains(": 20 (first: ")
            && e.contains("--retry-errors"),
        "{e}"
    );
    let rows = call_rows(&root).await;
    assert_eq!(rows.len(), 20);
    let (batches, answered) = batch_log(&log);
    assert!(answered.is_empty(), "no line of a failed batch runs");
    for (id, err, attempts, bid) in &rows {
        let e = err.as_deref().unwrap();
        assert!(
            e.contains("failed validation") && e.contains("invalid_request"),
            "{e}"
        );
        assert_eq!(*attempts, 1);
        assert_eq!(batches[id], vec![bid.clone().unwrap()]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_batch_ends_as_error_rows() {
    failed_batch("openai").await;
}

/// The same for Anthropic, whose requests each error with `invalid_request_error` (400).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_requests_that_fail_validation_end_as_error_rows() {
    failed_batch("anthropic").await;
}

/// Polls that answer 500 and result files cut short mid-line: every call is answered
/// exactly once all the same.
async fn poll_errors_and_cut_results(provider: &str) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let server = MockServer::start_with(
        loopback(),
        mock_cfg(vec![], Some(log.clone())),
        batch_cfg(
            0.2,
            vec![(BatchFault::PollError, 0.5), (BatchFault::CutResults, 1.0)],
        ),
    )
    .await
    .unwrap();
    let p = pipeline_for(provider, dir.path(), "p", &server.base_url(), 3, "");
    let root = dir.path().join("run");
    run_all(&p, &root, true).await;
    let rows = call_rows(&root).await;
    assert_eq!(rows.len(), 30);
    let (batches, answered) = batch_log(&log);
    for (id, err, attempts, _) in &rows {
        assert_eq!((err.as_deref(), *attempts), (None, 1), "{id}");
        assert_eq!(batches[id].len(), 1);
        assert_eq!(answered[id], 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_errors_and_cut_results_lose_nothing() {
    poll_errors_and_cut_results("openai").await;
}

/// The same for Anthropic's retrieve and results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_poll_errors_and_cut_results_lose_nothing() {
    poll_errors_and_cut_results("anthropic").await;
}

/// Runs the CLI when started by [`child`]; a no-op test otherwise.
#[test]
fn child_evalflow() {
    child::run_if_child();
}

/// The crash matrix: the process dies (abort, no clean-up) before an upload, after it,
/// after a create whose id was not recorded, while polling, and during the commit of a
/// batch's results; a second process resumes. The mock's log shows no request in two
/// batches and no line answered twice, and every call has its answer exactly once.
fn crash_matrix(provider: &str, points: &[&str]) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for &point in points {
        let log = dir.path().join(format!("{point}.jsonl"));
        let server = rt
            .block_on(MockServer::start_with(
                loopback(),
                mock_cfg(vec![], Some(log.clone())),
                batch_cfg(0.2, vec![]),
            ))
            .unwrap();
        let p = pipeline_for(provider, dir.path(), point, &server.base_url(), 3, "");
        let root = dir.path().join(point).join("run");
        let (p, root_s) = (p.to_str().unwrap(), root.to_str().unwrap());
        let generated = child(&["generate", p, "--out", root_s], &[]);
        assert!(
            generated.status.success(),
            "{}",
            String::from_utf8_lossy(&generated.stderr)
        );
        let crashed = child(
            &["call", p, "--out", root_s, "--batch"],
            &[("EVALFLOW_CRASH_AT", point)],
        );
        assert!(!crashed.status.success(), "{point}: the process died");
        let stderr = String::from_utf8_lossy(&crashed.stderr);
        assert!(
            stderr.contains(&format!("EVALFLOW_CRASH_AT={point}")),
            "{point}: {stderr}"
        );
        let resumed = child(&["call", p, "--out", root_s, "--batch"], &[]);
        let stderr = String::from_utf8_lossy(&resumed.stderr);
        assert!(resumed.status.success(), "{point}: {stderr}");
        if point == "after_create" {
            let how = if provider == "openai" {
                "found by its metadata"
            } else {
                "found by its creation time and size"
            };
            assert!(stderr.contains(how), "{stderr}");
        }
        let rows = rt.block_on(call_rows(&root));
        let (batches, answered) = batch_log(&log);
        let mut per_id: BTreeMap<&str, usize> = BTreeMap::new();
        for (id, err, attempts, bid) in &rows {
            *per_id.entry(id).or_default() += 1;
            assert_eq!((err.as_deref(), *attempts), (None, 1), "{point}: {id}");
            assert_eq!(
                batches[id],
                vec![bid.clone().unwrap()],
                "{point}: {id} in one batch"
            );
            assert_eq!(answered[id], 1, "{point}: {id} answered once");
        }
        assert_eq!(per_id.len(), 30, "{point}: every call");
        assert!(per_id.values().all(|n| *n == 1), "{point}: one row each");
        assert_eq!(batches.len(), 30, "{point}: no other request was sent");
        assert!(
            std::fs::read_dir(root.join("_journal").join("batches"))
                .unwrap()
                .filter_map(|e| e.ok())
                .all(|e| e.file_name() == "attempts.json" || e.file_name() == "known-batches.txt"),
            "{point}: no chunk left in the journal"
        );
    }
}

#[test]
fn a_crash_at_any_step_of_a_batch_never_sends_a_request_twice() {
    crash_matrix(
        "openai",
        &[
            "before_upload",
            "after_upload",
            "after_create",
            "polling",
            "during_commit",
        ],
    );
}

/// The same for Anthropic, whose batches carry no metadata: a batch created but not
/// recorded is found by its creation time and size.
#[test]
fn anthropic_a_crash_at_any_step_of_a_batch_never_sends_a_request_twice() {
    crash_matrix(
        "anthropic",
        &["before_create", "after_create", "polling", "during_commit"],
    );
}

/// Anthropic: killed after the create was marked but before it was sent, and meanwhile
/// someone else created a batch of the same size on the same key. The resumed run adopts it
/// by time and size, finds other calls in its results, marks it known and creates its own:
/// every call is answered exactly once, and the other batch's rows are not committed.
#[test]
fn anthropic_a_batch_of_other_calls_is_not_taken_for_ours() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let server = rt
        .block_on(MockServer::start_with(
            loopback(),
            mock_cfg(vec![], Some(log.clone())),
            batch_cfg(0.2, vec![]),
        ))
        .unwrap();
    let p = pipeline_for("anthropic", dir.path(), "p", &server.base_url(), 3, "");
    let root = dir.path().join("run");
    let (p, root_s) = (p.to_str().unwrap(), root.to_str().unwrap());
    assert!(
        child(&["generate", p, "--out", root_s], &[])
            .status
            .success()
    );
    let crashed = child(
        &["call", p, "--out", root_s, "--batch"],
        &[("EVALFLOW_CRASH_AT", "before_create")],
    );
    assert!(!crashed.status.success());
    // Another client's batch: 7 requests, like the first chunk.
    let requests: Vec<Value> = (0..7)
        .map(|i| {
            serde_json::json!({"custom_id": format!("other-{i}"), "params": {
                "model": "mock-model", "max_tokens": 16,
                "messages": [{"role": "user", "content": format!("other {i}")}]}})
        })
        .collect();
    let created: Value = rt.block_on(async {
        reqwest::Client::new()
            .post(format!("{}/messages/batches", server.base_url()))
            .header("anthropic-version", "2023-06-01")
            .json(&serde_json::json!({ "requests": requests }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    });
    let other = created["id"].as_str().unwrap().to_string();
    let resumed = child(&["call", p, "--out", root_s, "--batch"], &[]);
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert!(resumed.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "batch {other}: found by its creation time and size"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("batch {other}: holds calls of no chunk")),
        "{stderr}"
    );
    let rows = rt.block_on(call_rows(&root));
    assert_eq!(rows.len(), 30);
    let (batches, answered) = batch_log(&log);
    for (id, err, attempts, bid) in &rows {
        assert_eq!((err.as_deref(), *attempts), (None, 1), "{id}");
        assert_ne!(bid.as_deref(), Some(other.as_str()));
        assert_eq!(batches[id], vec![bid.clone().unwrap()], "{id} in one batch");
        assert_eq!(answered[id], 1, "{id} answered once");
    }
    let known = std::fs::read_to_string(root.join("_journal/batches/known-batches.txt")).unwrap();
    assert!(known.lines().any(|l| l == other), "{known}");
}

/// `--no-wait` submits and exits with the batches open in the manifest; the next `call`
/// collects them.
#[test]
fn no_wait_submits_and_the_next_call_collects() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let server = rt
        .block_on(MockServer::start_with(
            loopback(),
            mock_cfg(vec![], Some(log.clone())),
            batch_cfg(1.5, vec![]),
        ))
        .unwrap();
    let p = pipeline(dir.path(), "p", &server.base_url(), 2, "batch = true");
    let root = dir.path().join("run");
    let (p, root_s) = (p.to_str().unwrap(), root.to_str().unwrap());
    assert!(
        child(&["generate", p, "--out", root_s], &[])
            .status
            .success()
    );
    let sub = child(&["call", p, "--out", root_s, "--no-wait"], &[]);
    let out = String::from_utf8_lossy(&sub.stdout);
    assert!(
        sub.status.success(),
        "{}",
        String::from_utf8_lossy(&sub.stderr)
    );
    assert!(out.contains("3 batches open"), "{out}");
    let m: Value =
        serde_json::from_slice(&std::fs::read(root.join("manifest.json")).unwrap()).unwrap();
    let call = &m["stages"]["call"];
    assert_eq!(call["status"], "running");
    let open = call["details"]["open_batches"].as_array().unwrap();
    assert_eq!(open.len(), 3);
    assert!(
        open.iter()
            .all(|b| b["batch_id"].as_str().unwrap().starts_with("batch_"))
    );
    assert_eq!(rt.block_on(call_rows(&root)).len(), 0);
    // Issue 61, item 12: the next stage says the batches are open and how to collect them;
    // `status` lists them from the journal even when the manifest does not (a killed call
    // records none there).
    let v = child(&["validate", p, "--out", root_s], &[]);
    let e = String::from_utf8_lossy(&v.stderr).to_string();
    assert_eq!(v.status.code(), Some(2), "{e}");
    assert!(
        e.contains("has 3 batch(es) open (submitted, not collected)")
            && e.contains(&format!("`evalflow call {p} --out {root_s}` collects them")),
        "{e}"
    );
    let mut m2 = m.clone();
    m2["stages"]["call"]["details"]
        .as_object_mut()
        .unwrap()
        .remove("open_batches");
    std::fs::write(root.join("manifest.json"), m2.to_string()).unwrap();
    let st = child(&["status", root_s], &[]);
    let st = String::from_utf8_lossy(&st.stdout).to_string();
    assert!(st.contains("open batches (3;"), "{st}");
    for b in open {
        assert!(st.contains(b["batch_id"].as_str().unwrap()), "{st}");
    }
    let col = child(&["call", p, "--out", root_s], &[]);
    assert!(
        col.status.success(),
        "{}",
        String::from_utf8_lossy(&col.stderr)
    );
    let rows = rt.block_on(call_rows(&root));
    assert_eq!(rows.len(), 20);
    let (batches, _) = batch_log(&log);
    assert!(
        rows.iter()
            .all(|r| r.1.is_none() && batches[&r.0].len() == 1)
    );
    let m: Value =
        serde_json::from_slice(&std::fs::read(root.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["stages"]["call"]["status"], "complete");
}

/// Issue 61, item 8: `run --no-wait` without `--out` prints the command that collects its
/// batches with the root it made, and the same command without `--out` finds that root (its
/// batches are open) instead of making a new one and submitting a second batch.
#[test]
fn a_run_without_out_collects_its_open_batches_instead_of_paying_twice() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let server = rt
        .block_on(MockServer::start_with(
            loopback(),
            mock_cfg(vec![], Some(log.clone())),
            batch_cfg(1.5, vec![]),
        ))
        .unwrap();
    let p = pipeline(dir.path(), "p", &server.base_url(), 2, "batch = true");
    let p = p.to_str().unwrap();
    let run = |args: &[&str]| {
        let mut c = child::command(args);
        c.env_remove("EVALFLOW_CRASH_AT").current_dir(dir.path());
        c.output().unwrap()
    };
    let sub = run(&["run", p, "--batch", "--no-wait"]);
    let out = String::from_utf8_lossy(&sub.stdout).to_string();
    assert!(
        sub.status.success(),
        "{}",
        String::from_utf8_lossy(&sub.stderr)
    );
    let root = out
        .split(" --out ")
        .nth(1)
        .and_then(|r| r.split('`').next())
        .unwrap_or_else(|| panic!("no --out in: {out}"))
        .to_string();
    assert!(
        out.contains(&format!(
            "(`evalflow run {p} --batch --out {root}` collects them)"
        )),
        "{out}"
    );
    let creates = |log: &Path| {
        log_paths(log)
            .iter()
            .filter(|(k, _)| k.as_str() == "/v1/batches")
            .map(|(_, n)| *n)
            .sum::<usize>()
    };
    let sent = creates(&log);
    assert!(sent > 0, "{:?}", log_paths(&log));
    let col = run(&["run", p, "--batch"]);
    let err = String::from_utf8_lossy(&col.stderr).to_string();
    assert!(
        col.status.success(),
        "{err}{}",
        String::from_utf8_lossy(&col.stdout)
    );
    let name = Path::new(&root)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    assert!(
        err.contains(&format!(
            "runs/{name}: this pipeline's run with batches still open"
        )),
        "{err}"
    );
    assert_eq!(
        creates(&log),
        sent,
        "no batch submitted twice: {:?}",
        log_paths(&log)
    );
    let runs: Vec<_> = std::fs::read_dir(dir.path().join("runs"))
        .unwrap()
        .collect();
    assert_eq!(runs.len(), 1, "one root");
    let rows = rt.block_on(call_rows(&dir.path().join("runs").join(&name)));
    assert_eq!(rows.len(), 20);
    let (batches, answered) = batch_log(&log);
    for r in &rows {
        assert_eq!(batches[&r.0].len(), 1, "{} in one batch", r.0);
        assert_eq!(answered[&r.0], 1, "{} answered once", r.0);
    }
}

/// Lines of the mock's log by path, counted.
fn log_paths(log: &Path) -> HashMap<String, usize> {
    let mut n = HashMap::new();
    for line in std::fs::read_to_string(log).unwrap_or_default().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        *n.entry(v["path"].as_str().unwrap_or("").to_string())
            .or_default() += 1;
    }
    n
}

/// A judge in batch mode re-scores an archived run to the same scores as synchronously:
/// `rescore --scorer judge --batch` (the built-in judge and `[judge]`), and a
/// `kind = "judge"` scorer whose `model` has `batch = true`, against the same judge scored
/// synchronously; the judge's calls went through batches, none synchronously.
#[test]
fn a_judge_in_batch_mode_rescores_to_the_same_scores() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("judge.jsonl");
    let model = rt
        .block_on(MockServer::start(loopback(), mock_cfg(vec![], None)))
        .unwrap();
    let judge = rt
        .block_on(MockServer::start_with(
            loopback(),
            MockConfig {
                answer: AnswerMode::Checklist,
                ..mock_cfg(vec![], Some(log.clone()))
            },
            batch_cfg(0.2, vec![]),
        ))
        .unwrap();
    let judged = |name: &str, scorers: &str| {
        let p = pipeline(dir.path(), name, &model.base_url(), 4, "");
        let text = std::fs::read_to_string(&p).unwrap().replace(
            "[suite]",
            &format!(
                "[judge]\nprovider = \"openai\"\nbase_url = \"{}\"\nname = \"judge-model\"\n\
                 temperature = 0.0\nbatch_max_requests = 15\n\n[score]\nscorers = [{scorers}]\n\n\
                 [[score.judge.questions]]\nid = \"label\"\ntext = \"Is the answer a sentiment label?\"\n\n\
                 [[score.judge.questions]]\nid = \"short\"\ntext = \"Is the answer one word?\"\n\n\
                 [[score.judge.questions]]\nid = \"polite\"\ntext = \"Is the answer polite?\"\n\n[suite]",
                judge.base_url()
            ),
        );
        std::fs::write(&p, text).unwrap();
        p
    };
    // The synchronous judge, scored by `run`; and an archived run without it.
    let sync_root = dir.path().join("a").join("run");
    let archived = dir.path().join("c").join("run");
    rt.block_on(run_all(&judged("sync", "\"judge\""), &sync_root, false));
    rt.block_on(run_all(
        &judged("archived", "\"checklist\""),
        &archived,
        false,
    ));
    let before = log_paths(&log);
    assert_eq!(before.get("/v1/chat/completions"), Some(&40), "{before:?}");
    assert_eq!(before.get("/v1/batches"), None);
    let rescore = |root: &Path, extra: &[&str]| {
        let mut args = vec!["rescore", root.to_str().unwrap()];
        args.extend_from_slice(extra);
        let o = child(&args, &[("EVALFLOW_CACHE_DIR", "off")]);
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    rescore(&archived, &["--scorer", "judge", "--batch"]);
    let after = log_paths(&log);
    assert_eq!(
        after.get("/v1/chat/completions"),
        Some(&40),
        "no synchronous judge call"
    );
    assert_eq!(
        after.get("/v1/batches"),
        Some(&3),
        "40 judge calls, 15 a batch"
    );
    assert_eq!(after.get("batch:/v1/chat/completions"), Some(&40));
    let dirs = |root: &Path, prefix: &str| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(root.join("scores"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with(prefix))
            .collect();
        v.sort();
        v
    };
    let q = "SELECT call_id, scorer, scoring_version, validity, score, passed, \
             array_to_string(answers, ',') AS answers FROM t ORDER BY call_id";
    let compare = |prefix: &str| {
        let (a, c) = (dirs(&sync_root, prefix), dirs(&archived, prefix));
        assert_eq!(a.len(), 1, "{a:?}");
        assert_eq!(a, c, "the same version");
        let d = format!("scores/{}", a[0]);
        let (sa, sc) = rt.block_on(async {
            (
                table(&sync_root, &d, q).await,
                table(&archived, &d, q).await,
            )
        });
        assert_eq!(sa.lines().count(), 4 + 40, "{sa}");
        assert!(sa.contains("valid_answer") && sa.contains("true"), "{sa}");
        assert_eq!(sa, sc, "{prefix}");
    };
    compare("judge@");
    // A judge scorer of a file, its model in batch mode (batch does not change its version).
    let file = |name: &str, batch: bool| {
        let p = dir.path().join(name);
        std::fs::write(
            &p,
            format!(
                "[[scorer]]\nname = \"helpful\"\nkind = \"judge\"\nmetric = \"numeric\"\n\
                 model = {{ provider = \"openai\", base_url = \"{}\", name = \"judge-model\", temperature = 0.0, batch = {batch} }}\n\
                 questions = [{{ id = \"label\", text = \"Is the answer a sentiment label?\" }}, {{ id = \"short\", text = \"Is it one word?\" }}]\n",
                judge.base_url()
            ),
        )
        .unwrap();
        p
    };
    let (sync_file, batch_file) = (file("sync.toml", false), file("batch.toml", true));
    rescore(&sync_root, &["--scorer-file", sync_file.to_str().unwrap()]);
    let mid = log_paths(&log);
    rescore(&archived, &["--scorer-file", batch_file.to_str().unwrap()]);
    let end = log_paths(&log);
    assert_eq!(
        end.get("/v1/chat/completions"),
        mid.get("/v1/chat/completions")
    );
    assert_eq!(end.get("/v1/batches"), Some(&4), "one batch of 40");
    compare("helpful@");
}

/// Rewrites every calls part under `root` as an older evalflow wrote it: without `batch_id`.
fn strip_batch_id(root: &Path) {
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    for e in std::fs::read_dir(root.join("calls")).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_none_or(|x| x != "parquet") {
            continue;
        }
        let r = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(&path).unwrap())
            .unwrap()
            .build()
            .unwrap();
        let batches: Vec<_> = r.map(|b| b.unwrap()).collect();
        let keep: Vec<usize> = (0..batches[0].num_columns())
            .filter(|&i| batches[0].schema().field(i).name() != "batch_id")
            .collect();
        let old: Vec<_> = batches.iter().map(|b| b.project(&keep).unwrap()).collect();
        let mut w =
            ArrowWriter::try_new(std::fs::File::create(&path).unwrap(), old[0].schema(), None)
                .unwrap();
        for b in &old {
            w.write(b).unwrap();
        }
        w.close().unwrap();
    }
}

/// `batch_id` is a declared, optional column of `calls`: a run written before it (no such
/// column) is checked, resumed and scored as before, and SQL over a mix of its parts and
/// batch parts sees NULL for the old rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_written_before_batch_id_stay_readable() {
    let declared = evalflow::schema::Table::Calls.schema();
    let f = declared.field_with_name("batch_id").unwrap();
    assert!(f.is_nullable());
    let dir = tempfile::tempdir().unwrap();
    let server = MockServer::start_with(loopback(), mock_cfg(vec![], None), batch_cfg(0.1, vec![]))
        .await
        .unwrap();
    let p = pipeline(dir.path(), "p", &server.base_url(), 2, "");
    let (old, new) = (dir.path().join("old/run"), dir.path().join("new/run"));
    run_all(&p, &old, false).await;
    run_all(&p, &new, true).await;
    strip_batch_id(&old);
    let part = std::fs::read_dir(old.join("calls"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "parquet"))
        .unwrap();
    let meta = datafusion::parquet::file::reader::FileReader::metadata(
        &datafusion::parquet::file::serialized_reader::SerializedFileReader::new(
            std::fs::File::open(&part).unwrap(),
        )
        .unwrap(),
    )
    .file_metadata()
    .schema_descr()
    .columns()
    .iter()
    .map(|c| c.name().to_string())
    .collect::<Vec<_>>();
    assert!(!meta.contains(&"batch_id".to_string()), "{meta:?}");
    let store = evalflow::storage::RunStore::open(old.to_str().unwrap()).unwrap();
    evalflow::query::check_tables(&store).await.unwrap();
    // The old run resumes (nothing left to send) and scores as before.
    let scores_q = "SELECT call_id, scorer, score FROM t ORDER BY call_id, scorer";
    let scored = |root: PathBuf| async move {
        let d = std::fs::read_dir(root.join("scores"))
            .unwrap()
            .map(|e| format!("scores/{}", e.unwrap().file_name().to_string_lossy()))
            .next()
            .unwrap();
        table(&root, &d, scores_q).await
    };
    let before = scored(old.clone()).await;
    std::fs::remove_dir_all(old.join("scores")).unwrap();
    run_all(&p, &old, false).await;
    assert_eq!(scored(old.clone()).await, before);
    // Old parts beside batch parts: one table, batch_id NULL where it was never written.
    for e in std::fs::read_dir(new.join("calls")).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "parquet") {
            std::fs::copy(&path, old.join("calls").join(path.file_name().unwrap())).unwrap();
        }
    }
    evalflow::query::check_tables(&store).await.unwrap();
    let ctx = evalflow::query::new_context();
    evalflow::query::register_run(&ctx, &store, "")
        .await
        .unwrap();
    let rows = evalflow::query::text_rows(
        &ctx,
        "SELECT count(*), count(batch_id), count(DISTINCT call_id), \
         sum(CASE WHEN batch_id LIKE 'batch_%' THEN 1 ELSE 0 END) FROM calls",
    )
    .await
    .unwrap();
    let got: Vec<Option<String>> = rows[0].clone();
    assert_eq!(
        got,
        ["40", "20", "20", "20"]
            .map(|s| Some(s.to_string()))
            .to_vec()
    );
}
