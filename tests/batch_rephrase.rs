//! `[rephrase] batch = true` over real HTTP (loopback only) against the mock's Batch API:
//! the rephrase requests are a nested run of the call stage, so they go through a batch
//! and give the same cases as synchronous rephrasing, and a generate killed after (or
//! while) they were answered pays nothing again when it is run again.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::prelude::{ParquetReadOptions, SessionContext};
use evalflow::mock::{AnswerMode, BatchConfig, MockConfig, MockServer};
use evalflow::runner::Runner;
use serde_json::Value;

#[path = "common/child.rs"]
mod child;
use child::child;

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Echoes the prompt (temperature 0: the same answer synchronously and in a batch).
fn mock_cfg(log: &Path) -> MockConfig {
    MockConfig {
        latency: Duration::ZERO,
        faults: vec![],
        seed: 7,
        request_log: Some(log.to_path_buf()),
        answer: AnswerMode::Echo,
        retry_after_secs: 0,
    }
}

fn batch_cfg(secs: f64) -> BatchConfig {
    BatchConfig {
        complete_after: Duration::from_secs_f64(secs),
        faults: vec![],
    }
}

/// A suite whose INV test rephrases 5 bases, 2 samples each, with a `[rephrase]` model
/// whose `batch` is `batch`.
fn pipeline(dir: &Path, name: &str, base_url: &str, batch: bool) -> PathBuf {
    let text = format!(
        r#"[model]
provider = "openai"
base_url = "{base_url}"
name = "mock-model"
temperature = 0.0

[rephrase]
provider = "openai"
base_url = "{base_url}"
name = "paraphraser"
max_tokens = 64
temperature = 0.0
batch = {batch}

[suite]
name = "rephrasesuite"
seed = 1

[lexicons]
n = ["1", "2", "3", "4", "5"]

[[test]]
name = "rephrasings"
capability = "Robustness"
type = "INV"
templates = ["Where is order {{n}}?"]
perturb = {{ op = "rephrase", prompt = "Say it otherwise: {{text}}" }}
n_perturb = 2
"#
    );
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

/// The rows of a query over every Parquet file under `dir`, as text.
async fn table(dir: &Path, query: &str) -> String {
    let ctx = SessionContext::new();
    ctx.register_parquet("t", dir.to_str().unwrap(), ParquetReadOptions::default())
        .await
        .unwrap();
    let b = ctx.sql(query).await.unwrap().collect().await.unwrap();
    pretty_format_batches(&b).unwrap().to_string()
}

const CASES: &str = "SELECT case_id, role, group_id, input FROM t ORDER BY case_id";

/// The one nested rephrase run under `root`.
fn nested(root: &Path) -> PathBuf {
    let runs: Vec<PathBuf> = std::fs::read_dir(root.join("rephrase"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.join("cases").is_dir())
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    runs[0].clone()
}

/// The mock's log: lines by path, and the custom ids of every batch created.
fn log_of(log: &Path) -> (HashMap<String, usize>, Vec<String>) {
    let mut paths: HashMap<String, usize> = HashMap::new();
    let mut custom_ids = Vec::new();
    for line in std::fs::read_to_string(log).unwrap_or_default().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let path = v["path"].as_str().unwrap_or("").to_string();
        if path == "/v1/batches" {
            for id in v["custom_ids"].as_array().unwrap() {
                custom_ids.push(id.as_str().unwrap().to_string());
            }
        }
        *paths.entry(path).or_default() += 1;
    }
    (paths, custom_ids)
}

async fn generate(p: &Path, root: &Path, batch: bool) {
    let mut r = Runner::open(p, Some(root.to_str().unwrap())).await.unwrap();
    r.batch = batch;
    assert_eq!(r.generate().await.unwrap(), 10);
}

/// The same suite with `[rephrase] batch = false`, `batch = true`, and `batch = false` with
/// `--batch` (`Runner::batch`): the same cases (ids, roles, groups, inputs); the batch runs'
/// rephrase requests went through one batch create each, with the nested calls' ids as
/// custom ids, and none through the synchronous endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rephrase_model_in_batch_mode_makes_the_same_cases_through_a_batch() {
    let dir = tempfile::tempdir().unwrap();
    let mut runs = Vec::new();
    for (name, batch, flag) in [
        ("sync", false, false),
        ("batch", true, false),
        ("flag", false, true),
    ] {
        let log = dir.path().join(format!("{name}.jsonl"));
        let server = MockServer::start_with(loopback(), mock_cfg(&log), batch_cfg(0.2))
            .await
            .unwrap();
        let p = pipeline(dir.path(), name, &server.base_url(), batch);
        let root = dir.path().join(name);
        generate(&p, &root, flag).await;
        runs.push((name, log, root));
    }
    let (_, sync_log, sync_root) = &runs[0];
    let sync_cases = table(&sync_root.join("cases"), CASES).await;
    let perturbed = table(
        &sync_root.join("cases"),
        "SELECT input FROM t WHERE role = 'perturbed' AND perturbation = 'rephrase' ORDER BY input",
    )
    .await;
    for n in 1..=5 {
        assert!(
            perturbed.contains(&format!("| Say it otherwise: Where is order {n}? |")),
            "{perturbed}"
        );
    }
    let (paths, custom_ids) = log_of(sync_log);
    assert_eq!(paths.get("/v1/chat/completions"), Some(&10), "{paths:?}");
    assert!(custom_ids.is_empty() && !paths.contains_key("batch:/v1/chat/completions"));

    for (name, log, root) in &runs[1..] {
        assert_eq!(
            table(&root.join("cases"), CASES).await,
            sync_cases,
            "{name}"
        );
        let (paths, mut custom_ids) = log_of(log);
        assert_eq!(paths.get("/v1/chat/completions"), None, "{name}: {paths:?}");
        assert_eq!(paths.get("/v1/batches"), Some(&1), "{name}: one batch");
        assert_eq!(
            paths.get("batch:/v1/chat/completions"),
            Some(&10),
            "{name}: {paths:?}"
        );
        let calls = nested(root).join("calls");
        let ids = table(
            &calls,
            "SELECT call_id FROM t WHERE batch_id IS NOT NULL ORDER BY call_id",
        )
        .await;
        custom_ids.sort();
        assert_eq!(custom_ids.len(), 10);
        for id in &custom_ids {
            assert!(ids.contains(&format!("| {id} |")), "{name}: {id} in {ids}");
        }
        let nulls = table(
            &calls,
            "SELECT count(*) AS n FROM t WHERE batch_id IS NULL OR error IS NOT NULL",
        )
        .await;
        assert!(nulls.contains("| 0 |"), "{name}: {nulls}");
    }
    // The nested runs' calls are the same requests whichever way they went.
    let sync_ids = table(
        &nested(sync_root).join("calls"),
        "SELECT call_id, sample_idx FROM t ORDER BY call_id",
    )
    .await;
    let batch_ids = table(
        &nested(&runs[1].2).join("calls"),
        "SELECT call_id, sample_idx FROM t ORDER BY call_id",
    )
    .await;
    assert_eq!(sync_ids, batch_ids);
}

/// Runs the CLI when started by [`child`]; a no-op test otherwise.
#[test]
fn child_evalflow() {
    child::run_if_child();
}

/// A generate killed while its rephrase batch was being polled, and one killed after its
/// rephrase calls were answered (batch and synchronous): run again, each sends no request
/// twice (every custom id in one batch, answered once; no synchronous request again) and
/// makes the 10 cases.
#[test]
fn a_killed_generate_does_not_pay_its_rephrase_calls_again() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (name, batch, point) in [
        ("polling", true, "polling"),
        ("batch_answered", true, "after_rephrase"),
        ("sync_answered", false, "after_rephrase"),
    ] {
        let log = dir.path().join(format!("{name}.jsonl"));
        let server = rt
            .block_on(MockServer::start_with(
                loopback(),
                mock_cfg(&log),
                batch_cfg(0.5),
            ))
            .unwrap();
        let p = pipeline(dir.path(), name, &server.base_url(), batch);
        let root = dir.path().join(name).join("run");
        let (p, root_s) = (p.to_str().unwrap(), root.to_str().unwrap());
        let crashed = child(
            &["generate", p, "--out", root_s],
            &[("EVALFLOW_CRASH_AT", point)],
        );
        let stderr = String::from_utf8_lossy(&crashed.stderr);
        assert!(!crashed.status.success(), "{name}: the process died");
        assert!(
            stderr.contains(&format!("EVALFLOW_CRASH_AT={point}")),
            "{name}: {stderr}"
        );
        assert!(
            !root.join("cases").is_dir()
                || std::fs::read_dir(root.join("cases")).unwrap().count() == 0
        );
        let before = log_of(&log);
        let resumed = child(&["generate", p, "--out", root_s], &[]);
        assert!(
            resumed.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&resumed.stderr)
        );
        assert!(String::from_utf8_lossy(&resumed.stdout).contains("cases: 10 rows"));
        let (paths, mut custom_ids) = log_of(&log);
        if point == "after_rephrase" {
            assert_eq!(
                (&paths, &custom_ids),
                (&before.0, &before.1),
                "{name}: nothing sent again"
            );
        }
        if batch {
            assert_eq!(paths.get("/v1/chat/completions"), None, "{name}: {paths:?}");
            assert_eq!(paths.get("/v1/batches"), Some(&1), "{name}: one batch");
            assert_eq!(
                paths.get("batch:/v1/chat/completions"),
                Some(&10),
                "{name}: answered once"
            );
            custom_ids.sort();
            custom_ids.dedup();
            assert_eq!(custom_ids.len(), 10, "{name}");
        } else {
            assert_eq!(
                paths.get("/v1/chat/completions"),
                Some(&10),
                "{name}: {paths:?}"
            );
        }
        let rows = rt.block_on(table(
            &nested(&root).join("calls"),
            "SELECT count(*) AS n FROM t",
        ));
        assert!(rows.contains("| 10 |"), "{name}: {rows}");
    }
}
