//! The numbers of the outside review (issue "every number right for every scorer"): each
//! test fails on the code before the fix.
//!
//! - a cue run aggregates to label rates, a judge run to mean scores, not 100% failure;
//! - judge verdicts are counted in the validity distribution;
//! - cue rows with no expected entity are not "base case invalid";
//! - one template: the interval says it is unclustered; compare and plan refuse a
//!   clustered verdict they cannot compute;
//! - compare and plan take `--scorer` and work for any numeric score;
//! - the judge scorer is rebuilt by name in rescore and report;
//! - `sql --format json` keeps NULL columns;
//! - import records what the file recorded and nothing else, and takes `--languages`.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use evalflow::mock::{AnswerMode, MockConfig, MockServer};
use evalflow::stages::call::{CallRequest, CallResult, CallRow};
use evalflow::stages::generate::Case;
use evalflow::storage::RunStore;

fn bin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_evalflow"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("EVALFLOW_CACHE_DIR", "off")
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

fn ok(args: &[&str]) -> String {
    let o = bin(args);
    assert!(o.status.success(), "{args:?}: {}", text(&o));
    text(&o)
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

/// Runs a report query of `sql/` over one run.
fn sql_file(root: &Path, file: &str) -> serde_json::Value {
    let o = bin(&[
        "sql",
        "--file",
        file,
        "--run",
        root.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn f(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// (template, entity, answer): recommended 5, rejected 3, neutral 2, absent 2 among the
/// twelve that name an entity; two more name none (unscored, not "base case invalid").
const BRANDS: &[(&str, &str, &str)] = &[
    ("t0", "Asana", "I would recommend Asana for a small team."),
    ("t0", "Asana", "Asana is the best choice here."),
    ("t0", "Jira", "Jira is over budget."),
    ("t1", "Trello", "Trello is not recommended for large teams."),
    ("t1", "Notion", "Notion is a tool that exists."),
    ("t1", "Notion", "建议使用 Notion。"),
    (
        "t2",
        "Linear",
        "Linear is a good fit for engineering teams.",
    ),
    ("t2", "Linear", "Avoid Linear if you need time tracking."),
    ("t2", "ClickUp", "ClickUp is an option people mention."),
    ("t3", "Monday", "I would recommend Monday for marketing."),
    ("t3", "Asana", "Use a spreadsheet."),
    ("t3", "Jira", "Nothing fits."),
    ("t3", "", "Any tool is fine."),
    ("t0", "", "Pick what you like."),
];

/// Writes a run of recorded answers (cases + calls + manifest) with `pipeline`, then
/// validates it.
async fn recorded_run(root: &Path, pipeline: &str, rows: &[(&str, &str, &str)]) {
    let store = RunStore::open(root.to_str().unwrap()).unwrap();
    let p = evalflow::pipeline::Pipeline::parse(pipeline, Path::new("recorded.toml")).unwrap();
    let mut cases = Vec::new();
    let mut calls = Vec::new();
    for (i, (template, entity, answer)) in rows.iter().enumerate() {
        cases.push(Case {
            case_id: format!("case{i:02}"),
            suite: "brands".into(),
            test: "recommendation".into(),
            capability: "Attribution".into(),
            test_type: "MFT".into(),
            template_id: template.to_string(),
            group_id: format!("case{i:02}"),
            role: "single".into(),
            input: format!("Which tool should a small team use? ({entity})"),
            expected: (!entity.is_empty()).then(|| entity.to_string()),
            expectation: None,
            tolerance: None,
            perturbation: None,
        });
        calls.push(CallRow {
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
            res: CallResult {
                response: Some(answer.to_string()),
                finish_reason: Some("stop".into()),
                http_status: Some(200),
                attempts: 1,
                ..Default::default()
            },
            latency_ms: 12.0,
            started_at_us: 1_700_000_000_000_000,
        });
    }
    common::write_validated_run(&store, &p, "recorded", &cases, &calls, &p.languages()).await;
}

const CUE_PIPELINE: &str = r#"
[model]
provider = "builtin:vader"
name = "recorded"
[suite]
name = "brands"
[score]
scorers = ["cue"]
"#;

/// Label scorers give the rate of each label, never a failure rate; entity-less cases are
/// "not scored", not "base case invalid"; languages default to the scorers' (en + zh).
#[tokio::test(flavor = "multi_thread")]
async fn cue_run_reports_label_rates() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("cue");
    recorded_run(&root, CUE_PIPELINE, BRANDS).await;
    let r = root.to_str().unwrap();
    ok(&["rescore", r, "--scorer", "cue"]);
    let out = ok(&["report", r, "--scorer", "cue"]);
    assert!(out.contains("rate of each label"), "{out}");
    assert!(!out.contains("fail rate"), "{out}");
    assert!(!out.contains("base case invalid"), "{out}");
    assert!(
        out.contains(
            "Valid answers not scored (nothing to score against, e.g. no expected entity): 2"
        ),
        "{out}"
    );
    // The Chinese answer is read by the cue scorer, so it is valid by default.
    assert!(!out.contains("unscorable_language"), "{out}");

    // The results table: one row per label, hand-counted.
    let store = RunStore::open(r).unwrap();
    let id = evalflow::stages::score::ScorerId::parse("cue@1").unwrap();
    evalflow::stages::aggregate::run(&store, &id, None)
        .await
        .unwrap();
    let v = sql(
        &root,
        "SELECT label, n, hits, value, failures, failure_rate, ci_lo, ci_hi, clustered, n_templates, unscored, not_comparable, metric \
         FROM results WHERE level = 'capability' ORDER BY label",
    );
    let rows = v.as_array().unwrap();
    let want = [
        ("absent", 2),
        ("neutral", 2),
        ("recommended", 5),
        ("rejected", 3),
    ];
    assert_eq!(rows.len(), want.len(), "{v}");
    for (row, (label, hits)) in rows.iter().zip(want) {
        assert_eq!(row["label"], label, "{row}");
        assert_eq!(row["metric"], "label_rate");
        assert_eq!(row["n"], 12);
        assert_eq!(row["hits"], hits);
        assert!(
            (f(&row["value"]) - hits as f64 / 12.0).abs() < 1e-12,
            "{row}"
        );
        assert!(
            row["failures"].is_null() && row["failure_rate"].is_null(),
            "{row}"
        );
        assert!(f(&row["ci_lo"]) <= f(&row["value"]) && f(&row["value"]) <= f(&row["ci_hi"]));
        assert_eq!(row["clustered"], true);
        assert_eq!(row["n_templates"], 4);
        assert_eq!(row["unscored"], 2);
        assert_eq!(row["not_comparable"], 0);
    }
    // The interval is clustered_mean_ci's default for a 0/1 indicator: the
    // clustered score interval (`cr2_score`), as the SQL function computes it.
    let ci = sql(
        &root,
        "SELECT clustered_mean_ci(CASE WHEN label = 'recommended' THEN 1.0 ELSE 0.0 END, template_id) AS ci \
         FROM scores WHERE scorer = 'cue' AND score IS NOT NULL",
    );
    let rec = &rows[2];
    assert_eq!(ci[0]["ci"]["method"], "cr2_score");
    for k in ["lo", "hi"] {
        let col = format!("ci_{k}");
        assert!(
            (f(&rec[col.as_str()]) - f(&ci[0]["ci"][k])).abs() < 1e-12,
            "{rec} {ci}"
        );
    }
    let m = sql(&root, "SELECT DISTINCT ci_method FROM results");
    assert_eq!(m, serde_json::json!([{"ci_method": "cr2_score"}]));

    // The ready report query gives the same rates.
    let q = sql_file(&root, "sql/label_rates_by_capability.sql");
    let all: Vec<&serde_json::Value> = q
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["capability"] == "(all)")
        .collect();
    assert_eq!(all.len(), 4, "{q}");
    for (row, (label, hits)) in all.iter().zip(want) {
        assert_eq!(row["label"], label);
        assert_eq!(row["n_label"], hits);
        assert_eq!(row["n_scored"], 12);
        assert!((f(&row["rate"]) - hits as f64 / 12.0).abs() < 1e-12);
    }
}

/// One template: the stored row and the printed table say the interval is unclustered.
#[tokio::test(flavor = "multi_thread")]
async fn one_template_interval_is_marked() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("one");
    let rows: Vec<(&str, &str, &str)> = BRANDS.iter().map(|(_, e, a)| ("t0", *e, *a)).collect();
    recorded_run(&root, CUE_PIPELINE, &rows).await;
    let r = root.to_str().unwrap();
    ok(&["rescore", r, "--scorer", "cue"]);
    let out = ok(&["report", r]);
    assert!(
        out.contains("* 1 template: interval assumes independent cases"),
        "{out}"
    );
    let store = RunStore::open(r).unwrap();
    let id = evalflow::stages::score::ScorerId::parse("cue@1").unwrap();
    evalflow::stages::aggregate::run(&store, &id, None)
        .await
        .unwrap();
    let v = sql(
        &root,
        "SELECT DISTINCT clustered, interval_note, ci_method FROM results",
    );
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v[0]["clustered"], false);
    assert_eq!(
        v[0]["interval_note"],
        "1 template: interval assumes independent cases"
    );
    assert_eq!(v[0]["ci_method"], "wilson");

    // compare and plan refuse a clustered verdict with one template.
    let other = dir.path().join("other");
    let rows2: Vec<(&str, &str, &str)> = BRANDS
        .iter()
        .map(|(_, e, _)| {
            (
                "t0",
                *e,
                "I would recommend it: Asana Jira Trello Notion Linear ClickUp Monday.",
            )
        })
        .collect();
    recorded_run(&other, CUE_PIPELINE, &rows2).await;
    let o = other.to_str().unwrap();
    ok(&["rescore", o, "--scorer", "cue"]);
    let c = bin(&["compare", r, o, "--require-improvement"]);
    assert_eq!(c.status.code(), Some(1), "{}", text(&c));
    assert!(
        text(&c).contains("overall: cannot tell: 1 template"),
        "{}",
        text(&c)
    );
    let p = ok(&["plan", "--delta", "0.1", "--pilot", r, o]);
    assert!(p.contains("no clustered plan"), "{p}");
}

/// compare and plan follow `--scorer` (and default to the runs' own scorer): B recommends
/// more often than A, by a difference computed here by hand.
#[tokio::test(flavor = "multi_thread")]
async fn compare_any_scorer() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    recorded_run(&a, CUE_PIPELINE, BRANDS).await;
    // B recommends every entity of templates t1 and t3 (8 cases), keeps A's answer elsewhere.
    let better: Vec<(&str, &str, &str)> = BRANDS
        .iter()
        .map(|(t, e, ans)| match *t {
            "t1" | "t3" => (
                *t,
                *e,
                "I would recommend Asana Jira Trello Notion Linear ClickUp Monday.",
            ),
            _ => (*t, *e, *ans),
        })
        .collect();
    recorded_run(&b, CUE_PIPELINE, &better).await;
    let (ra, rb) = (a.to_str().unwrap(), b.to_str().unwrap());
    ok(&["rescore", ra, "--scorer", "cue"]);
    ok(&["rescore", rb, "--scorer", "cue"]);
    // Scored cases: 12 with an entity. A recommends cases 0, 1, 5, 6, 9; B adds cases
    // 3, 4, 10, 11 (t1 and t3 not already recommended): d = 4/12.
    for args in [
        vec!["compare", ra, rb],
        vec!["compare", ra, rb, "--scorer", "cue@1"],
    ] {
        let out = ok(&args);
        assert!(out.contains("scorer: cue"), "{out}");
        let overall = out.lines().find(|l| l.contains("| overall")).unwrap();
        assert!(overall.contains("0.3333333333333333"), "{overall}");
    }
    let o = bin(&["compare", ra, rb, "--scorer", "checklist"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("no scores of `checklist`"),
        "{}",
        text(&o)
    );
    let p = ok(&[
        "plan", "--delta", "0.1", "--pilot", ra, rb, "--scorer", "cue",
    ]);
    assert!(p.contains("clustered by template"), "{p}");
    // Issue 61 item 7: the pilot's MDE is the clustered one `compare` reports (it was the
    // naive mde(n, var_d)).
    let cmp: serde_json::Value = serde_json::from_str(&ok(&[
        "compare", ra, rb, "--scorer", "cue", "--format", "json",
    ]))
    .unwrap();
    let overall = cmp
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["level"] == "overall")
        .unwrap();
    let want = f(&overall["mde"]);
    let lines: Vec<&str> = p.lines().filter(|l| l.starts_with('|')).collect();
    let cells = |l: &str| -> Vec<String> { l.split('|').map(|c| c.trim().to_string()).collect() };
    let col = cells(lines[0])
        .iter()
        .position(|c| c == "pilot_mde")
        .unwrap();
    for row in &lines[1..] {
        let got: f64 = cells(row)[col].parse().unwrap();
        assert!(
            (got - want).abs() < 1e-9,
            "pilot_mde {got} vs compare's mde {want}"
        );
    }
}

/// A judge run aggregates to a mean score; the judge is rebuilt by name in rescore and
/// report; its unparseable rows are counted, not dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn judge_by_name_mean_scores_and_verdicts() {
    let dir = tempfile::tempdir().unwrap();
    let judge = MockServer::start(
        "127.0.0.1:0".parse().unwrap(),
        MockConfig {
            answer: AnswerMode::Checklist,
            retry_after_secs: 0,
            ..MockConfig::default()
        },
    )
    .await
    .unwrap();
    let echo = MockServer::start(
        "127.0.0.1:0".parse().unwrap(),
        MockConfig {
            retry_after_secs: 0,
            ..MockConfig::default()
        },
    )
    .await
    .unwrap();
    for (name, url, parseable) in [
        ("ok", judge.base_url(), true),
        ("echo", echo.base_url(), false),
    ] {
        let pipeline = format!(
            "{CUE_PIPELINE}\n[judge]\nprovider = \"openai\"\nbase_url = \"{url}\"\nname = \"judge-model\"\ntemperature = 0.0\n\n\
             [[score.judge.questions]]\nid = \"named\"\ntext = \"Does the answer name a tool?\"\n\n\
             [[score.judge.questions]]\nid = \"short\"\ntext = \"Is the answer one sentence?\"\n"
        );
        let root = dir.path().join(name);
        recorded_run(&root, &pipeline, BRANDS).await;
        let r = root.to_str().unwrap().to_string();
        let out = tokio::task::spawn_blocking(move || {
            let rescore = ok(&["rescore", &r, "--scorer", "judge"]);
            let report = ok(&["report", &r, "--scorer", "judge"]);
            (rescore, report)
        })
        .await
        .unwrap();
        let (rescore, report) = (out.0, out.1);
        // Issue 61 item 11: a judge none of whose replies could be read says so.
        assert_eq!(
            rescore.contains("could not read 13 of 13 judge replies"),
            !parseable,
            "{rescore}"
        );
        if parseable {
            assert!(report.contains("mean score"), "{report}");
            let v = sql(
                &root,
                "SELECT avg(score) AS m, clustered_mean_ci(score, template_id) AS ci FROM scores WHERE scorer = 'judge' AND score IS NOT NULL",
            );
            let store = RunStore::open(root.to_str().unwrap()).unwrap();
            let tag = sql(
                &root,
                "SELECT DISTINCT scoring_version FROM scores WHERE scorer = 'judge'",
            );
            let id = evalflow::stages::score::ScorerId {
                name: "judge".into(),
                version: tag[0]["scoring_version"].as_str().unwrap().into(),
            };
            let rows = evalflow::stages::aggregate::run(&store, &id, None)
                .await
                .unwrap();
            let cap = rows.iter().find(|r| r.level == "capability").unwrap();
            assert_eq!(cap.metric, "mean_score");
            // 14 valid answers; the judge reads English only, so the Chinese one is
            // `unscorable_language` for it (issue 40 item 3), not a score.
            assert_eq!(cap.n, 13);
            assert!((cap.value.unwrap() - f(&v[0]["m"])).abs() < 1e-12);
            assert!((cap.ci_lo.unwrap() - f(&v[0]["ci"]["lo"])).abs() < 1e-12);
            assert!((cap.ci_hi.unwrap() - f(&v[0]["ci"]["hi"])).abs() < 1e-12);
            assert!(cap.failure_rate().is_none());
            let q = sql_file(&root, "sql/mean_score_by_capability.sql");
            let all = q.as_array().unwrap().last().unwrap();
            assert_eq!(all["capability"], "(all)");
            assert!((f(&all["mean_score"]) - f(&v[0]["m"])).abs() < 1e-12);
        } else {
            // Every judge answer is unparseable: 13 rows counted under their verdict, and the
            // Chinese answer, which the judge does not read, under its own.
            assert!(
                report.contains("unscorable_language 1/14 (7.1%), judge_unparseable 13/14 (92.9%)"),
                "{report}"
            );
            assert!(!report.contains("no rows"), "{report}");
            let q = sql_file(&root, "sql/mean_score_by_capability.sql");
            let all = q.as_array().unwrap().last().unwrap();
            assert_eq!(all["judge_unparseable"], 13, "{q}");
            assert!(all["mean_score"].is_null());
        }
    }
}

/// `sql --format json` keeps every column, NULL as null.
#[test]
fn sql_json_keeps_null_columns() {
    let o = bin(&["sql", "SELECT 1 AS a, NULL AS b", "--format", "json"]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v, serde_json::json!([{"a": 1, "b": null}]));
}

/// import keeps what the file recorded (provider, attempts, start time) and invents
/// nothing; a bilingual corpus is valid in both languages and reported as label rates.
#[test]
fn import_records_facts_and_reads_chinese() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("corpus.jsonl");
    let line = |prompt: &str, entity: &str, answer: &str, extra: &str| {
        format!(
            "{{\"request\": {{\"model\": \"m\", \"messages\": [{{\"role\": \"user\", \"content\": \"{prompt}\"}}]}}, \
             \"response\": {{\"choices\": [{{\"message\": {{\"role\": \"assistant\", \"content\": \"{answer}\"}}, \"finish_reason\": \"stop\"}}]}}, \
             \"expected\": \"{entity}\"{extra}}}\n"
        )
    };
    let mut body = String::new();
    let answers = [
        ("Asana", "I would recommend Asana."),
        ("Asana", "建议使用 Asana。"),
        ("Jira", "不建议使用 Jira。"),
        ("Jira", "Jira is over budget."),
        ("Notion", "Notion is a tool that exists."),
    ];
    for (i, (e, a)) in answers.iter().enumerate() {
        let extra = if i == 0 {
            ", \"provider\": \"azure\", \"attempts\": 3, \"started_at\": \"2025-01-02T03:04:05Z\", \"latency_ms\": 250.5"
        } else {
            ""
        };
        body.push_str(&line(&format!("Which tool? {i}"), e, a, extra));
    }
    std::fs::write(&file, body).unwrap();
    let root = dir.path().join("imported");
    let r = root.to_str().unwrap();
    ok(&["import", file.to_str().unwrap(), "--out", r]);
    let v = sql(
        &root,
        "SELECT provider, attempts, CAST(started_at AS VARCHAR) AS t, latency_ms FROM calls ORDER BY provider NULLS LAST, case_id",
    );
    assert_eq!(v[0]["provider"], "azure");
    assert_eq!(v[0]["attempts"], 3);
    assert!(
        v[0]["t"]
            .as_str()
            .unwrap()
            .starts_with("2025-01-02T03:04:05"),
        "{v}"
    );
    assert_eq!(v[0]["latency_ms"], 250.5);
    for row in &v.as_array().unwrap()[1..] {
        for k in ["provider", "attempts", "t", "latency_ms"] {
            assert!(row[k].is_null(), "{k} invented: {row}");
        }
    }
    let toml = root.join("import.toml");
    ok(&["validate", toml.to_str().unwrap(), "--out", r]);
    let v = sql(
        &root,
        "SELECT count(*) AS n FROM validity WHERE validity = 'valid_answer'",
    );
    assert_eq!(v[0]["n"], 5, "Chinese answers are valid by default");
    ok(&["rescore", r, "--scorer", "cue"]);
    let out = ok(&["report", r, "--scorer", "cue"]);
    for want in ["recommended", "2", "40.0%", "rejected", "neutral", "20.0%"] {
        assert!(out.contains(want), "{want}: {out}");
    }
    assert!(!out.contains("fail rate"), "{out}");

    // --languages narrows what validate accepts.
    let root2 = dir.path().join("english-only");
    let r2 = root2.to_str().unwrap();
    ok(&[
        "import",
        file.to_str().unwrap(),
        "--out",
        r2,
        "--languages",
        "en",
    ]);
    ok(&[
        "validate",
        root2.join("import.toml").to_str().unwrap(),
        "--out",
        r2,
    ]);
    let v = sql(
        &root2,
        "SELECT count(*) AS n FROM validity WHERE validity = 'unscorable_language'",
    );
    assert_eq!(v[0]["n"], 2);
}

/// `sql --format parquet` streams into a temporary file renamed on success: a query that
/// fails while running leaves an existing `--output` as it was and no temporary file; empty
/// results still print `[]` and a CSV header.
#[test]
fn sql_outputs_stream_and_parquet_is_atomic() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o.parquet");
    let o = out.to_str().unwrap();
    let q = "SELECT value AS v FROM generate_series(1, 100000)";
    let r = bin(&["sql", q, "--format", "parquet", "--output", o]);
    assert!(r.status.success(), "{}", text(&r));
    let before = std::fs::read(&out).unwrap();
    let n = bin(&[
        "sql",
        "SELECT count(*) AS n, sum(v) AS s FROM t",
        "--table",
        &format!("t={o}"),
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&n.stdout).unwrap();
    assert_eq!(v, serde_json::json!([{"n": 100000, "s": 5000050000i64}]));
    let bad = bin(&[
        "sql",
        "SELECT CAST(v AS INT) AS i FROM (VALUES ('1'), ('2'), ('x')) AS t(v)",
        "--format",
        "parquet",
        "--output",
        o,
    ]);
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad));
    assert_eq!(
        std::fs::read(&out).unwrap(),
        before,
        "--output left as it was"
    );
    assert!(!dir.path().join("o.parquet.tmp").exists());
    // Strings of a file evalflow did not write are read as views and written as Utf8
    // (what pyarrow, polars and DuckDB read as `string`), grouped or not.
    let strings = dir.path().join("s.parquet");
    let r = bin(&[
        "sql",
        "SELECT 'model-' || CAST(value % 3 AS VARCHAR) AS model, CAST(value % 2 AS DOUBLE) AS score \
         FROM generate_series(1, 1000)",
        "--format",
        "parquet",
        "--output",
        strings.to_str().unwrap(),
    ]);
    assert!(r.status.success(), "{}", text(&r));
    let g = dir.path().join("g.parquet");
    let r = bin(&[
        "sql",
        "SELECT model, sum(score) AS s FROM t GROUP BY model ORDER BY model",
        "--table",
        &format!("t={}", strings.display()),
        "--format",
        "parquet",
        "--output",
        g.to_str().unwrap(),
    ]);
    assert!(r.status.success(), "{}", text(&r));
    let f = std::fs::File::open(&g).unwrap();
    let reader =
        datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(f)
            .unwrap();
    assert_eq!(
        reader.schema().field(0).data_type(),
        &datafusion::arrow::datatypes::DataType::Utf8
    );
    let n = bin(&[
        "sql",
        "SELECT model, s FROM g ORDER BY model",
        "--table",
        &format!("g={}", g.display()),
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&n.stdout).unwrap();
    assert_eq!(
        v,
        serde_json::json!([{"model": "model-0", "s": 167.0}, {"model": "model-1", "s": 167.0},
                           {"model": "model-2", "s": 166.0}])
    );
    let e = bin(&["sql", "SELECT 1 AS a WHERE false", "--format", "json"]);
    assert_eq!(String::from_utf8_lossy(&e.stdout).trim(), "[]");
    let e = bin(&["sql", "SELECT 1 AS a WHERE false", "--format", "csv"]);
    assert_eq!(String::from_utf8_lossy(&e.stdout).trim(), "a");
}

/// Issue 61 item 15: a judge scorer moved to another endpoint (the same model behind another
/// `base_url`) is not "already scored" in silence: the endpoint is recorded beside its
/// scores, `rescore` refuses the move with exit 2 naming both endpoints and the way out, and
/// `version = "..."` in the [[scorer]] table scores a new version at the new endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_judge_moved_to_another_endpoint_needs_a_new_version() {
    let dir = tempfile::tempdir().unwrap();
    let mut mocks = Vec::new();
    for _ in 0..2 {
        mocks.push(
            MockServer::start(
                "127.0.0.1:0".parse().unwrap(),
                MockConfig {
                    answer: AnswerMode::Checklist,
                    retry_after_secs: 0,
                    ..MockConfig::default()
                },
            )
            .await
            .unwrap(),
        );
    }
    let (a, b) = (mocks[0].base_url(), mocks[1].base_url());
    let root = dir.path().join("run");
    recorded_run(&root, CUE_PIPELINE, BRANDS).await;
    let def = |url: &str, version: &str| {
        let p = dir.path().join(format!("judge-{}.toml", version.len()));
        std::fs::write(
            &p,
            format!(
                "[[scorer]]\nname = \"tools\"\nkind = \"judge\"\nmetric = \"numeric\"\n{version}\n\
                 questions = [{{ id = \"named\", text = \"Does the answer name a tool?\" }}]\n\
                 [scorer.model]\nprovider = \"openai\"\nbase_url = \"{url}\"\nname = \"judge-model\"\n"
            ),
        )
        .unwrap();
        p.to_str().unwrap().to_string()
    };
    let (da, db, dv) = (def(&a, ""), def(&b, " "), def(&b, "version = \"b\""));
    let r = root.to_str().unwrap().to_string();
    let (first, moved, renamed) = tokio::task::spawn_blocking(move || {
        let first = bin(&["rescore", &r, "--scorer-file", &da]);
        let moved = bin(&["rescore", &r, "--scorer-file", &db]);
        let renamed = bin(&["rescore", &r, "--scorer-file", &dv]);
        (first, moved, renamed)
    })
    .await
    .unwrap();
    assert!(first.status.success(), "{}", text(&first));
    assert_eq!(moved.status.code(), Some(2), "{}", text(&moved));
    let msg = text(&moved);
    assert!(
        msg.contains(&format!("scored by the judge at {a}"))
            && msg.contains(&format!("points it at {b}"))
            && msg.contains("version = \"...\""),
        "{msg}"
    );
    assert!(renamed.status.success(), "{}", text(&renamed));
    let v = sql(
        &root,
        "SELECT scoring_version, count(*) AS n FROM scores WHERE scorer = 'tools' \
         GROUP BY 1 ORDER BY 1",
    );
    assert_eq!(
        v.as_array().unwrap().len(),
        2,
        "two versions of the judge: {v}"
    );
    assert_eq!(v[0]["n"], v[1]["n"], "{v}");
}
