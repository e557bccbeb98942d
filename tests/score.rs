//! Validate, score, rescore, check and holdout on a synthetic run of recorded answers
//! (brand recommendations in English and Chinese, plus the failure shapes of
//! six-checks-before-you-trust), written through the library's own table builders.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use evalflow::stages::call::{self, CallRequest, CallResult, CallRow};
use evalflow::stages::generate::{self, Case};
use evalflow::storage::{Manifest, RunStore};

fn bin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_evalflow"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

const PIPELINE: &str = r#"
[model]
provider = "builtin:vader"
name = "recorded"
[suite]
name = "brands"
[validate]
languages = ["en", "zh"]
[score]
scorers = ["cue"]
"#;

/// (entity, answer, hand label); empty answers and errors are handled below.
const ANSWERS: &[(&str, &str, &str)] = &[
    (
        "Asana",
        "I would recommend Asana for a small team.",
        "recommended",
    ),
    (
        "Asana",
        "Asana is the best choice here. Jira is over budget.",
        "recommended",
    ),
    (
        "Jira",
        "Asana is the best choice here. Jira is over budget.",
        "rejected",
    ),
    (
        "Trello",
        "Trello is not recommended for large teams.",
        "rejected",
    ),
    ("Trello", "I don't recommend Trello for this.", "rejected"),
    ("Notion", "Notion is a tool that exists.", "neutral"),
    ("Notion", "建议使用 Notion。", "recommended"),
    (
        "Asana",
        "之前推荐的一些\"顶配\"品牌（如 Asana、Monday.com 的付费版）基本都超了，不建议强行上付费版",
        "rejected",
    ),
    ("Monday", "Monday 不适合预算有限的团队。", "rejected"),
    (
        "Linear",
        "Linear is a good fit for engineering teams.",
        "recommended",
    ),
    (
        "Linear",
        "Avoid Linear if you need time tracking.",
        "rejected",
    ),
    ("ClickUp", "ClickUp is an option people mention.", "neutral"),
];

/// Writes the run at `root`; `split` writes `cases` in parts of five cases and `calls` in
/// two parts that each name cases of every `cases` part.
async fn build_run(root: &Path, split: bool) -> Vec<(String, String)> {
    let store = RunStore::open(root.to_str().unwrap()).unwrap();
    let p = evalflow::pipeline::Pipeline::parse(PIPELINE, Path::new("brands.toml")).unwrap();
    let mut cases = Vec::new();
    let mut rows = Vec::new();
    let mut labels = Vec::new();
    let mk_case = |i: usize, entity: &str| Case {
        case_id: format!("case{i:02}"),
        suite: "brands".into(),
        test: "recommendation".into(),
        capability: "Attribution".into(),
        test_type: "MFT".into(),
        template_id: format!("t{}", i % 4),
        group_id: format!("case{i:02}"),
        role: "single".into(),
        input: format!("Which tool should a small team use? ({entity})"),
        expected: Some(entity.into()),
        expectation: None,
        tolerance: None,
        perturbation: None,
    };
    let mk_row = |i: usize, res: CallResult| CallRow {
        req: CallRequest {
            call_id: format!("call{i:02}"),
            case_id: format!("case{i:02}"),
            input: String::new(),
            prompt: String::new(),
            system: None,
            sample_idx: 0,
            max_tokens: Some(600),
            temperature: None,
            request_hash: format!("req{i:02}"),
            prior_attempts: 0,
        },
        res,
        latency_ms: 12.0,
        started_at_us: 1_700_000_000_000_000,
    };
    for (i, (entity, answer, label)) in ANSWERS.iter().enumerate() {
        cases.push(mk_case(i, entity));
        rows.push(mk_row(
            i,
            CallResult {
                response: Some(answer.to_string()),
                finish_reason: Some("stop".into()),
                http_status: Some(200),
                prompt_tokens: Some(20),
                completion_tokens: Some(30),
                attempts: 1,
                ..Default::default()
            },
        ));
        labels.push((format!("call{i:02}"), label.to_string()));
    }
    // The failure shapes: a starved answer, an out-of-credit 403, a Spanish answer.
    let n = ANSWERS.len();
    cases.push(mk_case(n, "Asana"));
    rows.push(mk_row(
        n,
        CallResult {
            response: Some(String::new()),
            finish_reason: Some("length".into()),
            http_status: Some(200),
            reasoning_tokens: Some(600),
            completion_tokens: Some(600),
            attempts: 1,
            ..Default::default()
        },
    ));
    cases.push(mk_case(n + 1, "Asana"));
    rows.push(mk_row(
        n + 1,
        CallResult {
            http_status: Some(403),
            error: Some("out of credit".into()),
            attempts: 1,
            ..Default::default()
        },
    ));
    cases.push(mk_case(n + 2, "Asana"));
    rows.push(mk_row(
        n + 2,
        CallResult {
            response: Some("Recomiendo Asana para equipos pequeños porque es fácil de usar y tiene un buen precio.".into()),
            finish_reason: Some("stop".into()),
            http_status: Some(200),
            attempts: 1,
            ..Default::default()
        },
    ));
    let mut w = store.part_writer("cases", evalflow::schema::Table::Cases.schema(), "part");
    for chunk in cases.chunks(if split { 5 } else { cases.len() }) {
        w.write(generate::to_batch(chunk)).await.unwrap();
        w.flush().await.unwrap();
    }
    w.finish().await.unwrap();
    let mut w = store.part_writer("calls", evalflow::schema::Table::Calls.schema(), "part");
    if split {
        for odd in [0, 1] {
            let half: Vec<CallRow> = rows.iter().skip(odd).step_by(2).cloned().collect();
            w.write(call::to_batch(&p.model, &half)).await.unwrap();
            w.flush().await.unwrap();
        }
    } else {
        w.write(call::to_batch(&p.model, &rows)).await.unwrap();
    }
    w.finish().await.unwrap();
    let mut m = Manifest {
        run_id: "brands".into(),
        evalflow_version: "test".into(),
        pipeline_path: "brands.toml".into(),
        pipeline_hash: p.hash(),
        pipeline: serde_json::to_value(&p).unwrap(),
        created_at: "2026-11-30T00:00:00Z".into(),
        finished_at: None,
        stages: BTreeMap::new(),
        row_counts: BTreeMap::new(),
        scorer_versions: vec![],
        validator_version: None,
    };
    m.complete("generate", "cases", cases.len() as u64, BTreeMap::new());
    m.complete("call", "calls", rows.len() as u64, BTreeMap::new());
    m.save(&store).await.unwrap();
    evalflow::stages::validate::run(&store, &["en".into(), "zh".into()])
        .await
        .unwrap();
    let scorer = evalflow::stages::score::build("cue", None).unwrap();
    evalflow::stages::score::run(&store, scorer.as_ref())
        .await
        .unwrap();
    m.scorer_versions.push("cue@1".into());
    m.save(&store).await.unwrap();
    labels
}

fn sql(root: &Path, q: &str) -> serde_json::Value {
    let o = bin(&[
        "sql",
        q,
        "--run",
        root.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn validity_scores_check_rescore_and_holdout() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let labels = build_run(&root, false).await;
    let r = root.to_str().unwrap();

    // Every failure shape gets its own verdict and no score.
    let v = sql(
        &root,
        "SELECT s.call_id, s.validity, s.score, s.label FROM scores s WHERE s.validity <> 'valid_answer' ORDER BY s.call_id",
    );
    let got: Vec<(String, String)> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["call_id"].as_str().unwrap().to_string(),
                r["validity"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            ("call12".to_string(), "empty_due_to_budget".to_string()),
            ("call13".to_string(), "provider_error".to_string()),
            ("call14".to_string(), "unscorable_language".to_string()),
        ]
    );
    assert!(
        v.as_array()
            .unwrap()
            .iter()
            .all(|r| r.get("score").is_none_or(|s| s.is_null()))
    );
    // The cue scorer agrees with every hand label.
    let s = sql(
        &root,
        "SELECT call_id, label, scoring_version, response_hash FROM scores WHERE validity = 'valid_answer' ORDER BY call_id",
    );
    for (row, (id, label)) in s.as_array().unwrap().iter().zip(&labels) {
        assert_eq!(row["call_id"], id.as_str());
        assert_eq!(row["label"], label.as_str(), "{row}");
        assert_eq!(row["scoring_version"], "1");
        assert!(row["response_hash"].is_string());
    }

    // check: the report names the failure shapes; the gate trips on drift.
    let base = dir.path().join("baseline.json");
    std::fs::write(
        &base,
        r#"{"run_id":"old","rows":15,"invalid_fraction":0.0,"validity":{}}"#,
    )
    .unwrap();
    let o = bin(&["check", r, "--baseline", base.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let t = text(&o);
    assert!(
        t.contains("this is not a lower number, it is a run that did not complete"),
        "{t}"
    );
    assert!(t.contains("1 rows ended with finish_reason=length"), "{t}");
    assert!(t.contains("1. Errors: 1 of 15"), "{t}");
    assert!(t.contains("cue@1"), "{t}");
    let sample = std::fs::read_to_string(root.join("check/sample.csv")).unwrap();
    assert_eq!(
        sample.lines().count(),
        16,
        "header + 15 rows (fewer than 20 exist)"
    );
    assert!(sample.starts_with("call_id,test,answer,label,passed,validity,reason,scoring_version"));
    let o = bin(&["check", r, "--write-baseline", base.to_str().unwrap()]);
    assert!(o.status.success());
    let o = bin(&["check", r, "--baseline", base.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));

    // holdout: accept, check passes, a gutted cue list trips the gate.
    let csv = dir.path().join("labels.csv");
    let mut body = "call_id,label\n".to_string();
    for (id, l) in &labels {
        body.push_str(&format!("{id},{l}\n"));
    }
    std::fs::write(&csv, &body).unwrap();
    let hb = dir.path().join("holdout.json");
    let args = |cmd: &str| {
        vec![
            "holdout".to_string(),
            cmd.into(),
            r.into(),
            "--labels".into(),
            csv.to_str().unwrap().into(),
            "--baseline".into(),
            hb.to_str().unwrap().into(),
        ]
    };
    let run_args = |v: Vec<String>| bin(&v.iter().map(String::as_str).collect::<Vec<_>>());
    let o = run_args(args("accept"));
    assert!(o.status.success(), "{}", text(&o));
    let o = run_args(args("check"));
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    let rejected = t.lines().find(|l| l.starts_with("rejected")).unwrap();
    assert_eq!(
        rejected.split_whitespace().take(2).collect::<Vec<_>>(),
        ["rejected", "6"],
        "{t}"
    );

    let gutted = dir.path().join("gutted.toml");
    let cues = evalflow::stages::score::cue::DEFAULT_CUES;
    let en_reject_start = cues.find("[en]\nreject = [").unwrap() + "[en]\nreject = [".len();
    let en_reject_end = en_reject_start + cues[en_reject_start..].find(']').unwrap();
    std::fs::write(
        &gutted,
        format!("{}{}", &cues[..en_reject_start], &cues[en_reject_end..]),
    )
    .unwrap();
    let mut a = args("check");
    a.extend(["--cues".into(), gutted.to_str().unwrap().into()]);
    let o = run_args(a);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("rejected recall dropped"), "{}", text(&o));

    // Enumeration drift: a label on an unscorable row exits 2 with its own message.
    std::fs::write(&csv, format!("{body}call13,rejected\n")).unwrap();
    let o = run_args(args("check"));
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("enumeration drift"), "{}", text(&o));
    std::fs::write(&csv, &body).unwrap();

    // report: Rogan-Gladen correction from a holdout where the hand label disagrees once
    // (call05 read as a recommendation): recommended has tp 4, fn 1, tn 7, fp 0, so
    // sens 0.8, spec 1; raw 4/12 corrects to (1/3 + 1 - 1) / 0.8 = 41.7%, and the
    // delta-method interval by hand is 0.4167 -+ 1.96 * 0.19395 = [3.7%, 79.7%].
    let disagree = dir.path().join("disagree.csv");
    std::fs::write(
        &disagree,
        body.replace("call05,neutral", "call05,recommended"),
    )
    .unwrap();
    let o = bin(&[
        "report",
        r,
        "--holdout",
        disagree.to_str().unwrap(),
        "--scorer",
        "cue@1",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    let rec = t.lines().find(|l| l.starts_with("recommended")).unwrap();
    let cells: Vec<&str> = rec
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(
        cells,
        [
            "recommended",
            "4 / 12",
            "33.3%",
            "41.7%",
            "[3.7%, 79.7%]",
            "80% / 100%"
        ],
        "{t}"
    );

    // rescore with other cues writes a new version beside the old one and diffs it.
    let o = bin(&[
        "rescore",
        r,
        "--scorer",
        "cue",
        "--cues",
        gutted.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("diff cue@1 -> cue@1+cues-"), "{t}");
    assert!(
        t.lines()
            .any(|l| l.split_whitespace().take(2).eq(["rejected", "neutral"])),
        "{t}"
    );
    let versions = sql(
        &root,
        "SELECT DISTINCT scoring_version FROM scores ORDER BY 1",
    );
    assert_eq!(versions.as_array().unwrap().len(), 2);
    // ... and never overwrites.
    let o = bin(&[
        "rescore",
        r,
        "--scorer",
        "cue",
        "--cues",
        gutted.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

/// Score joins each calls part with only the parts of `cases` whose bloom filters may hold
/// its cases: with `cases` in three parts and each calls part naming cases of all three,
/// every call is scored exactly as with one part of each.
#[tokio::test(flavor = "multi_thread")]
async fn scores_do_not_depend_on_how_cases_and_calls_are_split_in_parts() {
    let dir = tempfile::tempdir().unwrap();
    let q = "SELECT s.call_id, s.case_id, s.validity, s.score, s.label FROM scores s ORDER BY s.call_id";
    let mut got = Vec::new();
    for split in [false, true] {
        let root = dir.path().join(format!("run-{split}"));
        build_run(&root, split).await;
        let parts = |t: &str| std::fs::read_dir(root.join(t)).unwrap().count();
        assert_eq!(
            (parts("cases"), parts("calls")),
            if split { (3, 2) } else { (1, 1) }
        );
        got.push(sql(&root, q));
    }
    assert_eq!(got[0].as_array().unwrap().len(), ANSWERS.len() + 3);
    assert_eq!(got[0], got[1]);
}

/// An imported run (accepting `en,zh` by default): short Spanish is `es`, Japanese `ja`,
/// neither valid; the checklist reads English only, so a Chinese answer is
/// `unscorable_language` in its scores, not a failure; `validate --languages en,es`
/// re-decides every verdict without a new import, and the choice holds on the next
/// validate.
#[test]
fn languages_of_an_imported_run_and_revalidating_it() {
    let dir = tempfile::tempdir().unwrap();
    let answers = [
        "positive",
        "Sí, es correcto.",
        "这个产品很好",
        "東京は日本の首都です。",
    ];
    let lines: Vec<String> = answers
        .iter()
        .enumerate()
        .map(|(i, a)| {
            serde_json::json!({
                "request": {"model": "m", "messages": [{"role": "user", "content": format!("question {i}")}]},
                "response": {"model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": a}, "finish_reason": "stop"}]},
                "expected": "positive",
            })
            .to_string()
        })
        .collect();
    let src = dir.path().join("pairs.jsonl");
    std::fs::write(&src, lines.join("\n") + "\n").unwrap();
    let root = dir.path().join("run");
    let (r, p) = (
        root.to_str().unwrap(),
        root.join("import.toml").to_str().unwrap().to_string(),
    );
    let o = bin(&["import", src.to_str().unwrap(), "--out", r]);
    assert!(o.status.success(), "{}", text(&o));
    let verdicts = |root: &Path| -> Vec<(String, String, String)> {
        sql(
            root,
            "SELECT k.response, v.validity, v.language FROM calls k JOIN validity v USING (call_id) ORDER BY k.response",
        )
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["response"].as_str().unwrap().to_string(),
                x["validity"].as_str().unwrap().to_string(),
                x["language"].as_str().unwrap().to_string(),
            )
        })
        .collect()
    };
    let o = bin(&["validate", &p, "--out", r]);
    assert!(o.status.success(), "{}", text(&o));
    let v = |s: &str, l: &str| (s.to_string(), l.to_string());
    let got: BTreeMap<String, (String, String)> = verdicts(&root)
        .into_iter()
        .map(|(a, s, l)| (a, (s, l)))
        .collect();
    assert_eq!(got["positive"], v("valid_answer", "en"));
    assert_eq!(got["Sí, es correcto."], v("unscorable_language", "es"));
    assert_eq!(got["这个产品很好"], v("valid_answer", "zh"));
    assert_eq!(
        got["東京は日本の首都です。"],
        v("unscorable_language", "ja")
    );
    let o = bin(&["score", &p, "--out", r]);
    assert!(o.status.success(), "{}", text(&o));
    let s = sql(
        &root,
        "SELECT k.response, s.validity, s.passed FROM scores s JOIN calls k USING (call_id) \
         WHERE s.scorer = 'checklist' ORDER BY k.response",
    );
    let scored: BTreeMap<&str, (&str, Option<bool>)> = s
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["response"].as_str().unwrap(),
                (x["validity"].as_str().unwrap(), x["passed"].as_bool()),
            )
        })
        .collect();
    assert_eq!(scored["positive"], ("valid_answer", Some(true)));
    assert_eq!(scored["这个产品很好"], ("unscorable_language", None));

    // Re-validated under other languages, without a new import.
    let o = bin(&["validate", &p, "--out", r, "--languages", "en,es"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("every verdict is decided again"),
        "{}",
        text(&o)
    );
    let got: BTreeMap<String, (String, String)> = verdicts(&root)
        .into_iter()
        .map(|(a, s, l)| (a, (s, l)))
        .collect();
    assert_eq!(got["Sí, es correcto."], v("valid_answer", "es"));
    assert_eq!(got["这个产品很好"], v("unscorable_language", "zh"));
    assert_eq!(got.len(), 4, "one verdict per call");
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(
        m["stages"]["validate"]["details"]["languages"],
        serde_json::json!(["en", "es"])
    );
    assert!(
        m["stages"].get("score").is_none(),
        "scores must be made again: {m}"
    );
    // The next validate keeps the run's languages rather than the import's default.
    let o = bin(&["validate", &p, "--out", r]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("decided again"), "{}", text(&o));
    let got: BTreeMap<String, (String, String)> = verdicts(&root)
        .into_iter()
        .map(|(a, s, l)| (a, (s, l)))
        .collect();
    assert_eq!(got["Sí, es correcto."], v("valid_answer", "es"));
    // Another verb does not ignore the flag.
    let o = bin(&["score", &p, "--out", r, "--languages", "en"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

/// An imported corpus of free-text answers with labels as `expected`: the checklist's exact
/// match fails every answer, and `aggregate` says why beside the 100.0%: the share of
/// answers with none of their labels, those with one inside longer text, and what to use.
#[test]
fn a_label_match_that_cannot_match_free_text_is_warned() {
    let dir = tempfile::tempdir().unwrap();
    let rows = [
        ("The answer is B, because the passage says so.", "B"),
        ("I am not sure about this one.", "A"),
        ("Both could work, I would pick C.", "C"),
        ("It depends on the context.", "D"),
    ];
    let lines: Vec<String> = rows
        .iter()
        .enumerate()
        .map(|(i, (a, e))| {
            serde_json::json!({
                "request": {"model": "m", "messages": [{"role": "user", "content": format!("question {i}")}]},
                "response": {"model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": a}, "finish_reason": "stop"}]},
                "expected": e,
            })
            .to_string()
        })
        .collect();
    let src = dir.path().join("pairs.jsonl");
    std::fs::write(&src, lines.join("\n") + "\n").unwrap();
    let root = dir.path().join("run");
    let r = root.to_str().unwrap();
    let p = root.join("import.toml").to_str().unwrap().to_string();
    let o = bin(&["import", src.to_str().unwrap(), "--out", r]);
    assert!(o.status.success(), "{}", text(&o));
    for verb in ["validate", "score"] {
        let o = bin(&[verb, &p, "--out", r]);
        assert!(o.status.success(), "{verb}: {}", text(&o));
    }
    let o = bin(&["aggregate", &p, "--out", r]);
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(
            "warning: checklist@2 failed 4 of 4 valid answers (100.0%): 50.0% of them contain \
             none of their expected labels and 50.0% contain one inside longer text"
        ) && err.contains("user-written scorer"),
        "{err}"
    );
}
