//! Corpus scale (issue "every stage a DataFusion plan, on every core, in bounded memory"):
//! a recorded corpus of many parts through the stages under memory limits, kills and
//! partitionings, checked against an undisturbed run of the same corpus.
//!
//! - a memory limit far below the data makes a sort spill, and its output is unchanged;
//! - a limit too small to run fails with exit 2 naming the limit, leaving no broken part;
//! - SIGKILL during validate and during score, then a rerun: no row lost or duplicated;
//! - one thread and four threads give the same validity, scores and results.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Rows per part in these tests, so a small corpus has many parts.
const PART_ROWS: &str = "2000";

fn cmd(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_evalflow"));
    c.args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("EVALFLOW_CACHE_DIR", "off")
        .env("EVALFLOW_PART_ROWS", PART_ROWS)
        // Import's duplicate check and first-record search in many slices (the search
        // even where each case was staged once, which skips it).
        .env("EVALFLOW_IMPORT_PASS_ROWS", "700")
        .env("EVALFLOW_IMPORT_CASES_BY_PLAN", "1");
    c
}

fn bin(args: &[&str]) -> Output {
    cmd(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn ok(args: &[&str]) -> String {
    let o = bin(args);
    assert!(o.status.success(), "{args:?}: {}", text(&o));
    text(&o)
}

/// `evalflow sql` as JSON rows.
fn sql(root: &Path, q: &str, extra: &[&str]) -> Vec<serde_json::Value> {
    let mut args = vec![
        "sql",
        q,
        "--run",
        root.to_str().unwrap(),
        "--format",
        "json",
    ];
    args.extend_from_slice(extra);
    let o = bin(&args);
    assert!(o.status.success(), "{q}: {}", text(&o));
    serde_json::from_slice::<serde_json::Value>(&o.stdout)
        .unwrap()
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// A recorded corpus of `n` calls in evalflow's JSONL pairs: two models, two samples per
/// case, answers of every validity (English labels with explanations, Chinese, Spanish,
/// empty with finish_reason length, truncated, provider errors).
fn write_corpus(path: &Path, n: usize) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let labels = ["positive", "negative", "neutral"];
    for i in 0..n {
        let case = i / 4;
        let model = if i % 4 < 2 { "model-a" } else { "model-b" };
        let sample = i % 2;
        let label = labels[case % 3];
        let prompt = format!("Classify the sentiment of review {case}: the room was clean");
        let (content, finish) = match (i * 7919) % 100 {
            0 => ("".to_string(), "length"),
            1 => (format!("{label} because the review is"), "length"),
            2 => ("之前推荐的一些品牌基本都超了，不建议强行上付费版".to_string(), "stop"),
            3 => (
                "la comida estaba muy buena pero el servicio fue lento y caro, no lo recomiendo para nada"
                    .to_string(),
                "stop",
            ),
            k if k < 50 => (labels[(case + i) % 3].to_string(), "stop"),
            _ => (
                format!(
                    "{label}. The reviewer says that the room was clean and that the staff were friendly, answer {i}."
                ),
                "stop",
            ),
        };
        let line = if (i * 7919) % 100 == 4 {
            serde_json::json!({
                "request": {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 64},
                "sample_idx": sample, "expected": label, "response": null,
                "http_status": 503, "error": "upstream overloaded"
            })
        } else {
            serde_json::json!({
                "request": {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 64},
                "sample_idx": sample, "expected": label,
                "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}],
                             "usage": {"prompt_tokens": 12, "completion_tokens": 9,
                                       "completion_tokens_details": {"reasoning_tokens": if finish == "length" && content.is_empty() { 64 } else { 0 }}}}
            })
        };
        writeln!(f, "{line}").unwrap();
    }
}

/// Imports a corpus of `n` calls into `<dir>/<name>` and returns the root.
fn imported(dir: &Path, name: &str, n: usize) -> PathBuf {
    let corpus = dir.join(format!("{name}.jsonl"));
    write_corpus(&corpus, n);
    import_file(&corpus, &dir.join(name))
}

/// `evalflow import FILE --out ROOT`, which must succeed; returns ROOT.
fn import_file(file: &Path, root: &Path) -> PathBuf {
    ok(&[
        "import",
        file.to_str().unwrap(),
        "--out",
        root.to_str().unwrap(),
    ]);
    root.to_path_buf()
}

fn stage(verb: &str, root: &Path, extra: &[&str]) -> String {
    let pipe = root.join("import.toml");
    let mut args = vec![
        verb,
        pipe.to_str().unwrap(),
        "--out",
        root.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    ok(&args)
}

fn parts(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().ends_with(".parquet"))
                .count()
        })
        .unwrap_or(0)
}

/// Starts `verb` with one thread, waits until it has committed at least one part under
/// `watch`, and kills it with SIGKILL while it still runs.
fn kill_during(verb: &str, root: &Path, watch: &Path) {
    let pipe = root.join("import.toml");
    let mut child = cmd(&[
        verb,
        pipe.to_str().unwrap(),
        "--out",
        root.to_str().unwrap(),
        "--threads",
        "1",
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let start = Instant::now();
    while parts(watch) == 0 {
        assert!(
            child.try_wait().unwrap().is_none(),
            "{verb} finished before it could be killed: make the corpus larger"
        );
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "{verb} wrote no part"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "{verb} was killed mid-stage, so it cannot have exited 0"
    );
}

const VALIDITY: &str = "SELECT validity, count(*) AS n, count(DISTINCT call_id) AS ids FROM validity GROUP BY validity ORDER BY validity";

/// The run's one scorer version (checklist, the imported pipeline's default).
const SCORES: &str = "SELECT count(*) AS n, count(DISTINCT call_id) AS ids, count(score) AS scored, \
     sum(CASE WHEN passed THEN 1 ELSE 0 END) AS passed, sum(score) AS total FROM scores";

/// The checklist scores folder of a run that has been scored.
fn checklist_dir(root: &Path) -> PathBuf {
    let dir = root.join("scores");
    let name = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().to_string())
        .find(|n| n.starts_with("checklist@"))
        .expect("a checklist scores folder");
    dir.join(name)
}

#[test]
fn sigkill_during_validate_and_score_then_rerun_loses_and_repeats_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let n = 60_000;
    let reference = imported(dir.path(), "reference", n);
    stage("validate", &reference, &[]);
    stage("score", &reference, &[]);
    let killed = imported(dir.path(), "killed", n);
    assert!(
        parts(&killed.join("calls")) >= 6,
        "the corpus has many parts"
    );

    kill_during("validate", &killed, &killed.join("validity"));
    let done = parts(&killed.join("validity"));
    assert!(done < parts(&killed.join("calls")), "killed before the end");
    stage("validate", &killed, &[]);
    let want = sql(&reference, VALIDITY, &[]);
    assert_eq!(sql(&killed, VALIDITY, &[]), want);
    let total: u64 = want.iter().map(|r| r["n"].as_u64().unwrap()).sum();
    assert_eq!(total, n as u64);
    for r in &want {
        assert_eq!(r["n"], r["ids"], "no call validated twice: {r}");
    }

    let tag_dir = killed.join(checklist_dir(&reference).strip_prefix(&reference).unwrap());
    kill_during("score", &killed, &tag_dir);
    stage("score", &killed, &[]);
    let want = sql(&reference, SCORES, &[]);
    assert_eq!(sql(&killed, SCORES, &[]), want);
    assert_eq!(want[0]["n"].as_u64(), Some(n as u64));
    assert_eq!(want[0]["ids"].as_u64(), Some(n as u64));
}

#[test]
fn one_thread_and_four_threads_give_the_same_tables() {
    let dir = tempfile::tempdir().unwrap();
    let n = 12_000;
    let mut outputs = Vec::new();
    for threads in ["1", "4"] {
        let root = imported(dir.path(), &format!("t{threads}"), n);
        for verb in ["validate", "score", "aggregate"] {
            stage(verb, &root, &["--threads", threads]);
        }
        let validity = sql(
            &root,
            "SELECT call_id, validity, validity_reason, language, answer_chars FROM validity ORDER BY call_id",
            &[],
        );
        let scores = sql(
            &root,
            "SELECT call_id, validity, score, label, passed FROM scores ORDER BY call_id",
            &[],
        );
        let results = sql(
            &root,
            "SELECT level, capability, test_type, test, model, scorer, metric, label, n, failures, \
             round(failure_rate, 12) AS rate, round(se, 12) AS se, round(ci_lo, 12) AS lo, \
             round(ci_hi, 12) AS hi, n_templates FROM results \
             ORDER BY level, capability, test_type, test, model, label",
            &[],
        );
        assert_eq!(validity.len(), n);
        assert_eq!(scores.len(), n);
        assert!(!results.is_empty());
        outputs.push((validity, scores, results));
    }
    assert!(outputs[0] == outputs[1], "threads change no number");
}

#[test]
fn memory_limit_spills_without_changing_results_and_too_small_fails_with_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let root = imported(dir.path(), "mem", 20_000);
    stage("validate", &root, &[]);
    // Small batches, so that a small limit holds several before it must spill.
    let q = "SET datafusion.execution.batch_size = 512; \
             SELECT call_id, response FROM calls ORDER BY response, call_id";
    let free = sql(&root, q, &[]);
    let tight = sql(&root, q, &["--memory-limit", "1MB", "--threads", "1"]);
    assert_eq!(free, tight, "a spilled sort returns the same rows");
    // The plan's own metrics show that the sort went to disk under the tight limit.
    let o = bin(&[
        "sql",
        &q.replace("SELECT", "EXPLAIN ANALYZE SELECT"),
        "--run",
        root.to_str().unwrap(),
        "--format",
        "csv",
        "--memory-limit",
        "1MB",
        "--threads",
        "1",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let plan = text(&o);
    let spills: u64 = plan
        .split("spill_count=")
        .skip(1)
        .filter_map(|s| {
            s.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    assert!(spills > 0, "the sort spilled under 1MB: {plan}");

    // Score and aggregate under a limit far below the corpus give the same results.
    let free_root = root.clone();
    stage("score", &free_root, &[]);
    stage("aggregate", &free_root, &[]);
    let results = "SELECT level, test, model, n, failures, round(failure_rate, 12) AS r, \
                   round(ci_lo, 12) AS lo, round(ci_hi, 12) AS hi FROM results ORDER BY level, test, model";
    let want = sql(&free_root, results, &[]);
    let tight_root = imported(dir.path(), "mem-tight", 20_000);
    for verb in ["validate", "score", "aggregate"] {
        stage(verb, &tight_root, &["--memory-limit", "16MB"]);
    }
    assert_eq!(sql(&tight_root, results, &[]), want);

    // Far too small: exit 2, the message names the limit, and what was committed stays.
    let before = parts(&root.join("validity"));
    let o = bin(&[
        "sql",
        "SELECT call_id, count(*) FROM calls GROUP BY call_id ORDER BY call_id",
        "--run",
        root.to_str().unwrap(),
        "--memory-limit",
        "1K",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("memory limit of 1.0 KiB"),
        "names the limit: {}",
        text(&o)
    );
    let pipe = root.join("import.toml");
    let o = bin(&[
        "score",
        pipe.to_str().unwrap(),
        "--out",
        root.to_str().unwrap(),
        "--memory-limit",
        "1K",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("memory limit"), "{}", text(&o));
    assert_eq!(parts(&root.join("validity")), before);
    // Every part left under the root still reads in full.
    let o = bin(&[
        "sql",
        "SELECT count(*) AS n FROM validity",
        "--run",
        root.to_str().unwrap(),
        "--format",
        "csv",
    ]);
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn bad_sizes_are_usage_errors() {
    let o = bin(&["sql", "SELECT 1", "--memory-limit", "lots"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("not a size"), "{}", text(&o));
    let o = bin(&["sql", "SELECT 1", "--threads", "0"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn compact_merges_parts_and_keeps_validate_resumable() {
    let dir = tempfile::tempdir().unwrap();
    let n = 40_000;
    let reference = imported(dir.path(), "ref", n);
    for verb in ["validate", "score", "aggregate"] {
        stage(verb, &reference, &[]);
    }
    let root = imported(dir.path(), "compacted", n);
    let before = parts(&root.join("calls"));
    assert!(before >= 4);
    // Half validated (killed), then compacted: validated and unvalidated parts are merged
    // separately, and the rerun validates exactly the rest.
    kill_during("validate", &root, &root.join("validity"));
    let validated = parts(&root.join("validity"));
    let o = cmd(&["compact", root.to_str().unwrap()])
        .env("EVALFLOW_PART_ROWS", "100000")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "a killed stage is still running");
    // Finish the interrupted stage, as the message says, then compact.
    stage("validate", &root, &[]);
    let o = cmd(&["compact", root.to_str().unwrap()])
        .env("EVALFLOW_PART_ROWS", "100000")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("calls: {before} parts -> 1")),
        "{}",
        text(&o)
    );
    assert_eq!(parts(&root.join("calls")), 1);
    assert_eq!(parts(&root.join("validity")), 1);
    assert!(validated >= 1);
    stage("validate", &root, &[]);
    for verb in ["score", "aggregate"] {
        stage(verb, &root, &[]);
    }
    assert_eq!(sql(&root, VALIDITY, &[]), sql(&reference, VALIDITY, &[]));
    assert_eq!(sql(&root, SCORES, &[]), sql(&reference, SCORES, &[]));
    let results = "SELECT level, test, model, n, failures, round(ci_lo, 12) AS lo, \
                   round(ci_hi, 12) AS hi FROM results ORDER BY level, test, model";
    assert_eq!(sql(&root, results, &[]), sql(&reference, results, &[]));
    // Compacting again changes nothing.
    let o = cmd(&["compact", root.to_str().unwrap()])
        .env("EVALFLOW_PART_ROWS", "100000")
        .output()
        .unwrap();
    assert!(text(&o).contains("calls: 1 parts -> 1"), "{}", text(&o));
}

#[test]
fn import_with_a_bad_line_deep_in_the_file_names_it_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("bad.jsonl");
    write_corpus(&corpus, 20_000);
    // Line 15,000 (after staging batches were committed) loses its request.
    let body = std::fs::read_to_string(&corpus).unwrap();
    let mut lines: Vec<&str> = body.lines().collect();
    lines[14_999] = r#"{"response": {"choices": []}}"#;
    std::fs::write(&corpus, lines.join("\n")).unwrap();
    let root = dir.path().join("bad-run");
    let o = bin(&[
        "import",
        corpus.to_str().unwrap(),
        "--out",
        root.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("bad.jsonl:15000: field `request`"),
        "{}",
        text(&o)
    );
    for t in ["cases", "calls", "_import/staging", "_import/calls"] {
        assert_eq!(parts(&root.join(t)), 0, "{t} has no part");
    }
    assert!(!root.join("manifest.json").exists());
}

/// Writes `corpus` to `out` with its first line again at the end, answered differently:
/// two different records of one sample.
fn with_first_line_answered_again(corpus: &Path, out: &Path) {
    let body = std::fs::read_to_string(corpus).unwrap();
    let mut first: serde_json::Value = serde_json::from_str(body.lines().next().unwrap()).unwrap();
    first["response"]["choices"][0]["message"]["content"] = "a different answer".into();
    std::fs::write(out, format!("{body}{first}\n")).unwrap();
}

#[test]
fn import_refuses_two_records_of_one_sample_and_keeps_no_table() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("dup.jsonl");
    write_corpus(&corpus, 3_000);
    // The first line again with another answer: two different records of one sample.
    with_first_line_answered_again(&corpus, &corpus);
    let root = dir.path().join("dup-run");
    let o = bin(&[
        "import",
        corpus.to_str().unwrap(),
        "--out",
        root.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("(records 1 and 3001 of the import): give distinct sample_idx"),
        "{}",
        text(&o)
    );
    for t in ["cases", "calls", "_import/staging", "_import/calls"] {
        assert_eq!(parts(&root.join(t)), 0, "{t} has no part");
    }
}

/// Past the bound of the call ids held in memory (an eighth of `--memory-limit`: about
/// 10,400 ids at 8 MB), the ids go to the scratch table and the plan checks them: a corpus
/// of 12,000 distinct samples gives the calls it gives under the default limit, and the
/// first line given again with another answer after the bound is refused naming both
/// records, as it is before it.
#[test]
fn import_past_the_ids_held_in_memory_checks_them_with_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("c.jsonl");
    write_corpus(&corpus, 12_000);
    let once = import_file(&corpus, &dir.path().join("once"));
    let tight = dir.path().join("tight");
    let out = ok(&[
        "import",
        corpus.to_str().unwrap(),
        "--out",
        tight.to_str().unwrap(),
        "--memory-limit",
        "8MB",
    ]);
    assert!(!out.contains("duplicates"), "{out}");
    let q = "SELECT count(*) AS n, count(DISTINCT call_id) AS ids, sum(length(response)) AS chars, \
             sum(sample_idx) AS samples FROM calls";
    assert_eq!(sql(&tight, q, &[]), sql(&once, q, &[]));
    assert_eq!(sql(&tight, q, &[])[0]["ids"], 12_000);
    let dup = dir.path().join("dup.jsonl");
    with_first_line_answered_again(&corpus, &dup);
    let root = dir.path().join("dup-run");
    let o = bin(&[
        "import",
        dup.to_str().unwrap(),
        "--out",
        root.to_str().unwrap(),
        "--memory-limit",
        "8MB",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("(records 1 and 12001 of the import): give distinct sample_idx"),
        "{}",
        text(&o)
    );
    for t in ["cases", "calls", "_import"] {
        assert_eq!(parts(&root.join(t)), 0, "{t} has no part");
    }
}

/// An exact copy of a record that names its sample (the first line again at the end, one
/// of a corpus imported with a copy of itself) is the same call: imported once, counted,
/// over several duplicate-check passes; the calls are those of the corpus alone.
#[test]
fn import_drops_exact_copies_of_a_sample_and_counts_them() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("c.jsonl");
    write_corpus(&corpus, 3_000);
    let once = import_file(&corpus, &dir.path().join("once"));
    let copy = dir.path().join("copy.jsonl");
    std::fs::copy(&corpus, &copy).unwrap();
    let body = std::fs::read_to_string(&corpus).unwrap();
    let first = body.lines().next().unwrap().to_string();
    std::fs::write(&copy, format!("{body}{first}\n")).unwrap();
    let root = dir.path().join("twice");
    let out = ok(&[
        "import",
        corpus.to_str().unwrap(),
        copy.to_str().unwrap(),
        "--out",
        root.to_str().unwrap(),
    ]);
    assert!(out.contains("duplicates: 3001 record(s)"), "{out}");
    let q = "SELECT count(*) AS n, count(DISTINCT call_id) AS ids, sum(length(response)) AS chars FROM calls";
    assert_eq!(sql(&root, q, &[]), sql(&once, q, &[]));
    assert_eq!(sql(&root, q, &[])[0]["n"], 3000);
    assert_eq!(parts(&root.join("_import")), 0);
    assert!(!root.join("_import").exists());
}

/// SIGINT (Ctrl-C) and SIGTERM in the middle of an import of a large file: the process
/// exits 130 and leaves the run root as it was: no `_import/` scratch, no table, and no
/// root at all when the import created it.
#[cfg(unix)]
#[test]
fn import_interrupted_by_a_signal_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("big.jsonl");
    write_corpus(&corpus, 300_000);
    for (signal, pre_existing) in [("-INT", false), ("-TERM", true)] {
        let root = dir.path().join(format!("run{signal}"));
        if pre_existing {
            std::fs::create_dir(&root).unwrap();
            std::fs::write(root.join("notes.txt"), "mine").unwrap();
        }
        let mut child = cmd(&[
            "import",
            corpus.to_str().unwrap(),
            "--out",
            root.to_str().unwrap(),
            "--threads",
            "1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
        // Wait until the import has written parts under `_import/` (its direct calls parts
        // come first, every 2000 rows).
        let start = Instant::now();
        while ["calls", "ids", "staging"]
            .iter()
            .all(|t| parts(&root.join("_import").join(t)) == 0)
        {
            assert!(
                child.try_wait().unwrap().is_none(),
                "the import finished before the signal: make the corpus larger"
            );
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "no scratch part"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let killed = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(130),
            "{signal}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("interrupted"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        if pre_existing {
            let left: Vec<String> = std::fs::read_dir(&root)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
                .collect();
            assert_eq!(left, ["notes.txt"], "{signal}: the root is as it was");
        } else {
            assert!(
                !root.exists(),
                "{signal}: the root the import created is gone"
            );
        }
    }
}

/// Records that name their sample go straight to `calls`; those that do not are numbered
/// by a plan after the highest index given for their (case, model). Either way a call gets
/// the same id: importing the numbered corpus with every index written out gives the same
/// calls.
#[test]
fn import_numbers_missing_samples_after_given_ones_with_the_same_call_ids() {
    let dir = tempfile::tempdir().unwrap();
    let line = |input: &str, model: &str, sample: Option<i64>, answer: &str| {
        let mut v = serde_json::json!({
            "request": {"model": model, "messages": [{"role": "user", "content": input}]},
            "response": {"choices": [{"message": {"content": answer}, "finish_reason": "stop"}]},
        });
        if let Some(s) = sample {
            v["sample_idx"] = serde_json::json!(s);
        }
        v
    };
    let records = [
        line("case a", "m1", Some(0), "a0"),
        line("case a", "m1", Some(1), "a1"),
        line("case b", "m1", None, "b-first"),
        line("case a", "m1", None, "a-next"),
        line("case a", "m2", Some(5), "a5"),
        line("case b", "m1", None, "b-second"),
        line("case a", "m1", None, "a-last"),
    ];
    // Writes `rows` as `<name>.jsonl` and imports it into the run root `<name>`.
    let import = |name: &str, rows: &[serde_json::Value]| {
        let file = dir.path().join(format!("{name}.jsonl"));
        let body: String = rows.iter().map(|r| format!("{r}\n")).collect();
        std::fs::write(&file, body).unwrap();
        import_file(&file, &dir.path().join(name))
    };
    let root = import("mixed", &records);
    let q = "SELECT c.input, k.model, k.sample_idx, k.response, k.call_id FROM calls k \
             JOIN cases c ON k.case_id = c.case_id ORDER BY c.input, k.model, k.sample_idx";
    let got = sql(&root, q, &[]);
    let key = |r: &serde_json::Value| {
        format!(
            "{} {} {} {}",
            r["input"].as_str().unwrap(),
            r["model"].as_str().unwrap(),
            r["sample_idx"],
            r["response"].as_str().unwrap()
        )
    };
    assert_eq!(
        got.iter().map(key).collect::<Vec<_>>(),
        [
            "case a m1 0 a0",
            "case a m1 1 a1",
            "case a m1 2 a-next",
            "case a m1 3 a-last",
            "case a m2 5 a5",
            "case b m1 0 b-first",
            "case b m1 1 b-second",
        ]
    );
    let cases = sql(&root, "SELECT count(*) AS n FROM cases", &[]);
    assert_eq!(cases[0]["n"], 2);
    // The same records with every sample index written out: all of them direct.
    let numbered: Vec<serde_json::Value> = records
        .iter()
        .map(|r| {
            let answer = r["response"]["choices"][0]["message"]["content"]
                .as_str()
                .unwrap();
            let row = got.iter().find(|g| g["response"] == answer).unwrap();
            let mut r = r.clone();
            r["sample_idx"] = row["sample_idx"].clone();
            r
        })
        .collect();
    let root2 = import("numbered", &numbered);
    assert_eq!(sql(&root2, q, &[]), got, "the same call ids either way");
}

/// Every result row's interval against `clustered_mean_ci` over the whole scores table
/// (the SQL function, which holds every template at once), for the checklist failure rate.
fn assert_results_are_clustered_mean_ci(root: &Path, what: &str) {
    let v = "CASE WHEN role <> 'base' AND score IS NOT NULL THEN \
             CASE WHEN passed THEN 0.0 WHEN NOT passed THEN 1.0 END END";
    let fields = "count(v) AS n, clustered_mean_ci(v, template_id)['n_clusters'] AS g, \
                  clustered_mean_ci(v, template_id)['se'] AS se, \
                  clustered_mean_ci(v, template_id)['lo'] AS lo, \
                  clustered_mean_ci(v, template_id)['hi'] AS hi, \
                  clustered_mean_ci(v, template_id)['method'] AS method";
    let reference = sql(
        root,
        &format!(
            "WITH s AS (SELECT model, capability, test_type, test, template_id, {v} AS v \
             FROM scores WHERE scorer = 'checklist') \
             SELECT 'test' AS level, model, capability, test_type, test, {fields} FROM s \
             GROUP BY model, capability, test_type, test \
             UNION ALL SELECT 'capability' AS level, model, capability, test_type, \
             CAST(NULL AS VARCHAR) AS test, {fields} FROM s GROUP BY model, capability, test_type"
        ),
        &[],
    );
    let results = sql(
        root,
        "SELECT level, model, capability, test_type, test, n, n_templates, se, ci_lo, ci_hi, \
         ci_method FROM results WHERE scorer = 'checklist'",
        &[],
    );
    assert_eq!(results.len(), reference.len(), "{what}: one row per group");
    let mut intervals = 0;
    for want in &reference {
        let key = ["level", "model", "capability", "test_type", "test"];
        let got = results
            .iter()
            .find(|r| key.iter().all(|k| r[*k] == want[*k]))
            .unwrap_or_else(|| panic!("{what}: no result row for {want}"));
        assert_eq!(got["n"], want["n"], "{what}: {want}");
        assert_eq!(got["n_templates"], want["g"], "{what}: {want}");
        if want["lo"].is_null() {
            continue;
        }
        intervals += 1;
        assert_eq!(got["ci_method"], want["method"], "{what}: {want}");
        for (g, w) in [("se", "se"), ("ci_lo", "lo"), ("ci_hi", "hi")] {
            let (a, b) = (got[g].as_f64().unwrap(), want[w].as_f64().unwrap());
            assert!(
                (a - b).abs() <= 1e-12 * b.abs().max(1e-3),
                "{what}: {g} {a} against {b} in {want}"
            );
        }
    }
    assert!(intervals >= 4, "{what}: clustered intervals were compared");
}

/// The aggregate reads a run's templates in slices and keeps per-size sums of the finished
/// ones, so its memory does not grow with the run: in one slice and in dozens (a few hundred
/// rows each), every interval is `clustered_mean_ci`'s over the whole table, at the test and
/// the capability level (the sentiment suite's capability groups hold several tests each,
/// whose templates are merged before they are folded).
#[test]
fn aggregate_in_template_slices_gives_the_intervals_of_clustered_mean_ci() {
    let dir = tempfile::tempdir().unwrap();
    let imp = imported(dir.path(), "imported", 12_000);
    stage("validate", &imp, &[]);
    stage("score", &imp, &[]);
    let sentiment = dir.path().join("sentiment");
    ok(&[
        "run",
        "pipelines/sentiment.toml",
        "--out",
        sentiment.to_str().unwrap(),
    ]);
    let shared = sql(
        &sentiment,
        "SELECT count(*) AS n FROM (SELECT model, capability, test_type FROM scores \
         GROUP BY 1, 2, 3 HAVING count(DISTINCT test) > 1)",
        &[],
    );
    assert!(
        shared[0]["n"].as_u64().unwrap() > 0,
        "a capability group of several tests"
    );
    for (root, pipe, small) in [
        (&imp, imp.join("import.toml"), "500"),
        (&sentiment, PathBuf::from("pipelines/sentiment.toml"), "40"),
    ] {
        for slice_rows in ["1000000000", small] {
            let o = cmd(&[
                "aggregate",
                pipe.to_str().unwrap(),
                "--out",
                root.to_str().unwrap(),
            ])
            .env("EVALFLOW_TEMPLATE_SLICE_ROWS", slice_rows)
            .env("RUST_LOG", "evalflow=debug")
            .output()
            .unwrap();
            assert!(o.status.success(), "{}", text(&o));
            let what = format!("{} in slices of {slice_rows} rows", root.display());
            // "aggregate: N template slices" (debug log).
            let slices: usize = text(&o)
                .split("aggregate: ")
                .nth(1)
                .and_then(|t| t.split(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{what}: no slice count logged: {}", text(&o)));
            if slice_rows == small {
                assert!(slices >= 8, "{what}: {slices} slices");
            } else {
                assert_eq!(slices, 1, "{what}");
            }
            assert_results_are_clustered_mean_ci(root, &what);
        }
    }
}

/// `+1.2 pts [-0.4, +2.8]`, as rescore prints a difference of rates.
fn pts(mean: f64, lo: f64, hi: f64) -> String {
    let f = |x: f64| format!("{:+.1}", x * 100.0);
    format!("{} pts [{}, {}]", f(mean), f(lo), f(hi))
}

/// Rescore's diff reads the pairs once per template slice and keeps per-size sums of the
/// finished templates: in slices of 1,000 pairs (4 x 250), each label's difference is
/// that of `paired_diff_clustered` over a join of the two versions, as printed.
#[test]
fn rescore_diff_in_template_slices_gives_paired_diff_clustered() {
    let dir = tempfile::tempdir().unwrap();
    let root = imported(dir.path(), "imported", 12_000);
    stage("validate", &root, &[]);
    stage("score", &root, &[]);
    let r = root.to_str().unwrap();
    // Two versions of a label scorer: answers longer than 50, then 97 characters, are
    // "long" (the second moves the Spanish answers and some English ones to "short").
    let version = |v: usize, chars: usize| {
        let f = dir.path().join(format!("length-v{v}.toml"));
        std::fs::write(
            &f,
            format!(
                "[[scorer]]\nname = \"length\"\nkind = \"sql\"\nmetric = \"label\"\n\
                 label = \"CASE WHEN length(response) > {chars} THEN 'long' ELSE 'short' END\"\n"
            ),
        )
        .unwrap();
        f.to_str().unwrap().to_string()
    };
    ok(&["rescore", r, "--scorer-file", &version(1, 50)]);
    let o = cmd(&["rescore", r, "--scorer-file", &version(2, 97)])
        .env("EVALFLOW_TEMPLATE_SLICE_ROWS", "250")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    let versions: Vec<String> = std::fs::read_dir(root.join("scores"))
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("length@"))
        .collect();
    assert_eq!(versions.len(), 2, "{versions:?}");
    let new = out
        .lines()
        .find_map(|l| l.strip_prefix("rescored "))
        .and_then(|l| l.split(" with ").nth(1))
        .and_then(|l| l.split(' ').next())
        .expect("the new version's tag")
        .to_string();
    let old = versions.iter().find(|v| **v != new).unwrap().clone();
    let pairs = format!(
        "FROM scores o JOIN scores n ON o.call_id = n.call_id WHERE o.scorer = 'length' AND \
         o.scoring_version = '{}' AND n.scorer = 'length' AND n.scoring_version = '{}' \
         AND n.role <> 'base'",
        old.split_once('@').unwrap().1,
        new.split_once('@').unwrap().1
    );
    let ind = |t: &str, l: &str| {
        format!(
            "CASE WHEN {t}.score IS NULL OR {t}.label IS NULL THEN NULL WHEN {t}.label = '{l}' \
             THEN 1.0 ELSE 0.0 END"
        )
    };
    let labels = sql(
        &root,
        &format!(
            "SELECT DISTINCT l FROM (SELECT n.label AS l {pairs} AND n.score IS NOT NULL \
             UNION ALL SELECT o.label AS l {pairs} AND o.score IS NOT NULL) WHERE l IS NOT NULL"
        ),
        &[],
    );
    let mut compared = 0;
    for l in labels.iter().map(|r| r["l"].as_str().unwrap().to_string()) {
        let want = sql(
            &root,
            &format!(
                "SELECT p['n'] AS n, p['mean_diff'] AS d, p['lo'] AS lo, p['hi'] AS hi FROM \
                 (SELECT paired_diff_clustered({}, {}, n.template_id) AS p {pairs})",
                ind("n", &l),
                ind("o", &l)
            ),
            &[],
        );
        let w = &want[0];
        let line = out
            .lines()
            .find(|x| x.split_whitespace().next() == Some(l.as_str()) && x.contains(" pts ["))
            .unwrap_or_else(|| panic!("no diff line for label {l}: {out}"));
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cells[1], w["n"].to_string(), "{l}: {line}");
        let (Some(d), Some(lo), Some(hi)) = (w["d"].as_f64(), w["lo"].as_f64(), w["hi"].as_f64())
        else {
            continue;
        };
        assert_eq!(cells[4..].join(" "), pts(d, lo, hi), "{l}: {line}");
        if d != 0.0 {
            compared += 1;
        }
    }
    assert!(
        compared >= 2,
        "labels whose rate changed were compared: {out}"
    );
}
