//! User scorers written as data (issue 18): each kind on a small run of recorded answers
//! with hand-computed scores; a SQL scorer and the same rule as a regex scorer agree row for
//! row; versions are stable under formatting and key order and change with any content;
//! aggregation follows the declared metric; `rescore --scorer-file` diffs against the
//! previous version and refuses an unchanged one; `evalflow scorers` lists every version; a
//! bad definition fails before any row is scored, naming file, line and field.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use evalflow::mock::{AnswerMode, MockConfig, MockServer};
use evalflow::pipeline::Pipeline;
use evalflow::query::{new_context, register_run, text_rows};
use evalflow::stages::call::{CallRequest, CallResult, CallRow};
use evalflow::stages::generate::Case;
use evalflow::stages::score::{self, ScorerId, user};
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

const PIPELINE: &str = r#"
[model]
provider = "builtin:vader"
name = "recorded"
[suite]
name = "refunds"
[validate]
languages = ["en", "und"]
"#;

/// (test, template, expected, answer); `None` answers are the failure shapes below.
const ROWS: &[(&str, &str, &str, Option<&str>)] = &[
    ("refunds", "t0", "refund", Some("Yes, we will refund you.")),
    ("refunds", "t1", "refund|credit", Some("CREDIT.")),
    (
        "refunds",
        "t0",
        "deny",
        Some("No refund is possible, sorry."),
    ),
    ("refunds", "t1", "deny", Some("deny")),
    (
        "json",
        "t2",
        "refund",
        Some(r#"{"decision": "refund", "amount": 12.5}"#),
    ),
    (
        "json",
        "t3",
        "deny",
        Some("```json\n{\"decision\": \"deny\"}\n```"),
    ),
    ("json", "t2", "refund", Some(r#"{"decision": 3}"#)),
    ("json", "t3", "refund", Some("Refund: yes")),
    ("money", "t4", "4.99", Some("$4.990")),
    ("money", "t5", "0", Some("0.5")),
    // 10: the provider failed; 11: the budget went to reasoning (empty, length).
    ("refunds", "t0", "refund", None),
    ("refunds", "t1", "refund", None),
];

fn call_id(i: usize) -> String {
    format!("call{i:02}")
}

/// Writes the run of [`ROWS`] (validated) under `root` with the pipeline `pipeline`.
async fn recorded_run(root: &Path, pipeline: &str) -> RunStore {
    let store = RunStore::open(root.to_str().unwrap()).unwrap();
    std::fs::create_dir_all(root).unwrap();
    let pfile = root.with_extension("toml");
    std::fs::write(&pfile, pipeline).unwrap();
    let p = Pipeline::load(&pfile).unwrap();
    let mut cases = Vec::new();
    let mut calls = Vec::new();
    for (i, (test, template, expected, answer)) in ROWS.iter().enumerate() {
        cases.push(Case {
            case_id: format!("case{i:02}"),
            suite: "refunds".into(),
            test: test.to_string(),
            capability: "Refunds".into(),
            test_type: "MFT".into(),
            template_id: template.to_string(),
            group_id: format!("case{i:02}"),
            role: "single".into(),
            input: format!("question {i}"),
            expected: Some(expected.to_string()),
            expectation: None,
            tolerance: None,
            perturbation: None,
        });
        let res = match (answer, i) {
            (Some(a), _) => CallResult {
                response: Some(a.to_string()),
                finish_reason: Some("stop".into()),
                http_status: Some(200),
                completion_tokens: Some(10),
                attempts: 1,
                ..Default::default()
            },
            (None, 10) => CallResult {
                http_status: Some(500),
                error: Some("server error".into()),
                attempts: 3,
                ..Default::default()
            },
            (None, _) => CallResult {
                response: Some(String::new()),
                finish_reason: Some("length".into()),
                http_status: Some(200),
                reasoning_tokens: Some(64),
                completion_tokens: Some(64),
                attempts: 1,
                ..Default::default()
            },
        };
        calls.push(CallRow {
            req: CallRequest {
                call_id: call_id(i),
                case_id: format!("case{i:02}"),
                input: String::new(),
                prompt: String::new(),
                system: None,
                sample_idx: 0,
                max_tokens: Some(64),
                temperature: None,
                request_hash: format!("req{i:02}"),
                prior_attempts: 0,
            },
            res,
            latency_ms: 10.0,
            started_at_us: 1_700_000_000_000_000,
        });
    }
    common::write_validated_run(
        &store,
        &p,
        "refunds",
        &cases,
        &calls,
        &p.validate.languages.clone().unwrap(),
    )
    .await;
    store
}

/// One scored row: (validity, score, passed, label).
type Scored = (String, Option<f64>, Option<bool>, Option<String>);

async fn scores_of(store: &RunStore, id: &ScorerId) -> BTreeMap<String, Scored> {
    let ctx = new_context();
    register_run(&ctx, store, "").await.unwrap();
    let rows = text_rows(
        &ctx,
        &format!(
            "SELECT call_id, validity, score, passed, label FROM scores \
             WHERE scorer = '{}' AND scoring_version = '{}' ORDER BY call_id",
            id.name, id.version
        ),
    )
    .await
    .unwrap();
    rows.into_iter()
        .map(|r| {
            (
                r[0].clone().unwrap(),
                (
                    r[1].clone().unwrap(),
                    r[2].as_deref().map(|s| s.parse().unwrap()),
                    r[3].as_deref().map(|s| s == "true"),
                    r[4].clone(),
                ),
            )
        })
        .collect()
}

async fn score_with(
    store: &RunStore,
    def: &user::ScorerDef,
) -> (ScorerId, BTreeMap<String, Scored>) {
    let s = user::prepare(def, store, None).await.unwrap();
    let n = score::run(store, s.as_ref()).await.unwrap();
    assert_eq!(n, ROWS.len() as u64);
    let id = s.id();
    let got = scores_of(store, &id).await;
    (id, got)
}

fn defs(text: &str) -> Vec<user::ScorerDef> {
    user::parse_text(text, "scorers.toml").unwrap()
}

/// Checks the pass/fail verdicts of a boolean scorer: `passes` lists the passing rows;
/// rows 10 and 11 are invalid and stay unscored with their validity.
fn assert_verdicts(got: &BTreeMap<String, Scored>, passes: &[usize], what: &str) {
    for i in 0..10 {
        let (validity, score, passed, _) = &got[&call_id(i)];
        assert_eq!(validity, "valid_answer", "{what} row {i}");
        let p = passes.contains(&i);
        assert_eq!(*passed, Some(p), "{what} row {i}");
        assert_eq!(*score, Some(if p { 1.0 } else { 0.0 }), "{what} row {i}");
    }
    assert_unscored(got, what);
}

fn assert_unscored(got: &BTreeMap<String, Scored>, what: &str) {
    let v = |i: usize| got[&call_id(i)].clone();
    assert_eq!(v(10), ("provider_error".into(), None, None, None), "{what}");
    assert_eq!(
        v(11),
        ("empty_due_to_budget".into(), None, None, None),
        "{what}"
    );
}

const KINDS: &str = r#"
[[scorer]]
name = "refund_word"
kind = "regex"
metric = "pass_fail"
patterns = ['(?i)\brefund\b']

[[scorer]]
name = "refund_word_sql"
kind = "sql"
metric = "pass_fail"
score = '''CASE WHEN regexp_like(response, '(?i)\brefund\b') THEN 1.0 ELSE 0.0 END'''
passed = '''regexp_like(response, '(?i)\brefund\b')'''
label = '''CASE WHEN regexp_like(response, '(?i)\brefund\b') THEN 'pass' ELSE 'fail' END'''

[[scorer]]
name = "mentions_money_back"
kind = "contains"
metric = "pass_fail"
patterns = ["refund", "credit"]
require = "any"
ignore_case = true

[[scorer]]
name = "no_apology_no_fence"
kind = "not_contains"
metric = "pass_fail"
patterns = ["sorry", "```"]

[[scorer]]
name = "exact"
kind = "match"
metric = "pass_fail"
tolerance = 0.01

[[scorer]]
name = "decision"
kind = "json"
metric = "label"
label_field = "decision"
schema = { type = "object", required = ["decision"], properties = { decision = { type = "string", enum = ["refund", "deny"] } } }

[[scorer]]
name = "expects_refund"
kind = "sql"
metric = "numeric"
score = "CASE WHEN expected = 'refund' THEN 1.0 ELSE 0.0 END + CAST(sample_idx AS DOUBLE)"
label = "upper(test)"
"#;

/// Every kind but the judge, on the recorded run, against hand-computed verdicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_kind_scores_as_computed_by_hand() {
    let dir = tempfile::tempdir().unwrap();
    let store = recorded_run(&dir.path().join("run"), PIPELINE).await;
    let d = defs(KINDS);
    let by = |n: &str| d.iter().find(|x| x.name == n).unwrap().clone();

    // regex \brefund\b, case-insensitive: rows 0, 2, 4 (inside the JSON) and 7.
    let (_, regex) = score_with(&store, &by("refund_word")).await;
    assert_verdicts(&regex, &[0, 2, 4, 7], "regex");
    assert_eq!(regex[&call_id(0)].3.as_deref(), Some("pass"));

    // The same rule as SQL: identical scores, verdicts and labels on every row.
    let (_, sql) = score_with(&store, &by("refund_word_sql")).await;
    assert_eq!(sql, regex, "sql and regex scorers disagree");

    // contains any of refund / credit, ignoring case: rows 0, 1, 2, 4, 7.
    let (_, contains) = score_with(&store, &by("mentions_money_back")).await;
    assert_verdicts(&contains, &[0, 1, 2, 4, 7], "contains");

    // contains neither "sorry" nor a code fence: all but rows 2 and 5.
    let (_, not_contains) = score_with(&store, &by("no_apology_no_fence")).await;
    assert_verdicts(&not_contains, &[0, 1, 3, 4, 6, 7, 8, 9], "not_contains");

    // match (normalised) against expected: "CREDIT." is one of refund|credit, "deny" is
    // deny, "$4.990" is 4.99 as a number; "0.5" is 0.5 away from 0 (tolerance 0.01).
    let (_, m) = score_with(&store, &by("exact")).await;
    assert_verdicts(&m, &[1, 3, 8], "match");
    assert_eq!(m[&call_id(1)].3.as_deref(), Some("credit"));

    // json with a schema, the decision as label; a fenced answer is read inside its fence.
    let (id, json) = score_with(&store, &by("decision")).await;
    assert_verdicts(&json, &[4, 5], "json");
    let labels: Vec<&str> = (0..10)
        .map(|i| json[&call_id(i)].3.as_deref().unwrap())
        .collect();
    assert_eq!(
        labels,
        [
            "invalid_json",
            "invalid_json",
            "invalid_json",
            "invalid_json",
            "refund",
            "deny",
            "schema_mismatch",
            "invalid_json",
            "invalid_json",
            "schema_mismatch" // 0.5 is JSON, but not an object
        ]
    );
    // ... aggregated by its declared metric: the rate of each label.
    let rows = evalflow::stages::aggregate::compute(&store, &id, None)
        .await
        .unwrap();
    let cap: Vec<_> = rows.iter().filter(|r| r.level == "capability").collect();
    assert!(cap.iter().all(|r| r.metric == "label_rate"), "{cap:?}");
    let invalid = cap
        .iter()
        .find(|r| r.label.as_deref() == Some("invalid_json"))
        .unwrap();
    assert_eq!((invalid.n, invalid.hits), (10, Some(6)));

    // sql numeric: 1.0 where expected is exactly `refund` (rows 0, 4, 6, 7).
    let (id, num) = score_with(&store, &by("expects_refund")).await;
    for i in 0..10 {
        let want = if [0, 4, 6, 7].contains(&i) { 1.0 } else { 0.0 };
        assert_eq!(num[&call_id(i)].1, Some(want), "row {i}");
        assert_eq!(num[&call_id(i)].2, None, "no passed expression");
        assert_eq!(
            num[&call_id(i)].3.as_deref(),
            Some(ROWS[i].0.to_uppercase().as_str())
        );
    }
    assert_unscored(&num, "sql numeric");
    let rows = evalflow::stages::aggregate::compute(&store, &id, None)
        .await
        .unwrap();
    let cap = rows.iter().find(|r| r.level == "capability").unwrap();
    assert_eq!(cap.metric, "mean_score");
    assert!((cap.value.unwrap() - 0.4).abs() < 1e-12, "{cap:?}");

    // A pass/fail user scorer aggregates to the failure rate: 6 of 10 fail the regex.
    let regex_id = ScorerId {
        name: "refund_word".into(),
        version: by("refund_word").version(),
    };
    let rows = evalflow::stages::aggregate::compute(&store, &regex_id, None)
        .await
        .unwrap();
    let cap = rows.iter().find(|r| r.level == "capability").unwrap();
    assert_eq!(
        (cap.metric.as_str(), cap.n, cap.hits),
        ("failure_rate", 10, Some(6))
    );
}

/// A SQL expression that is NULL for a row leaves it unscored (validity kept); the rows
/// it scores follow the expression.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_null_leaves_a_row_unscored() {
    let dir = tempfile::tempdir().unwrap();
    let store = recorded_run(&dir.path().join("run"), PIPELINE).await;
    let d = defs(
        r#"
[[scorer]]
name = "money_only"
kind = "sql"
metric = "pass_fail"
passed = "CASE WHEN test = 'money' THEN TRY_CAST(trim(response, '$') AS DOUBLE) < 1 END"
"#,
    );
    let (_, got) = score_with(&store, &d[0]).await;
    for i in 0..8 {
        assert_eq!(
            got[&call_id(i)],
            ("valid_answer".into(), None, None, None),
            "row {i}"
        );
    }
    assert_eq!(got[&call_id(8)].2, Some(false));
    assert_eq!(got[&call_id(8)].1, Some(0.0));
    assert_eq!(got[&call_id(9)].2, Some(true));
    assert_eq!(got[&call_id(9)].1, Some(1.0));
    assert_unscored(&got, "money_only");
    // An expression that reads no column scores every valid row.
    let d =
        defs("[[scorer]]\nname = \"one\"\nkind = \"sql\"\nmetric = \"numeric\"\nscore = \"1\"\n");
    let (_, got) = score_with(&store, &d[0]).await;
    for i in 0..10 {
        assert_eq!(got[&call_id(i)].1, Some(1.0), "row {i}");
    }
    assert_unscored(&got, "constant");
}

/// The judge kind asks the judge the definition's questions: the score is the fraction of
/// YES, passed is all YES, the label k/d, and invalid answers are never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn judge_kind_scores_the_fraction_of_yes() {
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
    let store = recorded_run(&dir.path().join("run"), PIPELINE).await;
    let d = defs(&format!(
        r#"
[[scorer]]
name = "polite"
kind = "judge"
metric = "numeric"
questions = [
  {{ id = "polite", text = "Is the answer polite?" }},
  {{ id = "short", text = "Is the answer one sentence?" }},
]
model = {{ provider = "openai", base_url = "{}", name = "judge-model", temperature = 0.0 }}
"#,
        judge.base_url()
    ));
    let s = user::prepare(&d[0], &store, None).await.unwrap();
    score::run(&store, s.as_ref()).await.unwrap();
    let ctx = new_context();
    register_run(&ctx, &store, "").await.unwrap();
    let rows = text_rows(
        &ctx,
        "SELECT call_id, score, passed, label, answers FROM scores WHERE scorer = 'polite' ORDER BY call_id",
    )
    .await
    .unwrap();
    assert_eq!(rows.len(), 12);
    for r in &rows[..10] {
        let answers: Vec<bool> = r[4]
            .as_deref()
            .unwrap()
            .trim_matches(['[', ']'])
            .split(", ")
            .map(|a| a == "true")
            .collect();
        assert_eq!(answers.len(), 2, "{r:?}");
        let yes = answers.iter().filter(|a| **a).count();
        let score: f64 = r[1].as_deref().unwrap().parse().unwrap();
        assert_eq!(score, yes as f64 / 2.0, "{r:?}");
        assert_eq!(r[2].as_deref() == Some("true"), yes == 2, "{r:?}");
        assert_eq!(r[3].as_deref(), Some(format!("{yes}/2").as_str()));
    }
    for r in &rows[10..] {
        assert_eq!((&r[1], &r[2]), (&None, &None), "{r:?}");
    }
}

/// Formatting, comments and key order keep the version; any change of content changes it.
#[test]
fn versions_follow_content_not_formatting() {
    let base = defs(
        r#"[[scorer]]
name = "decision"
kind = "json"
metric = "label"
label_field = "decision"
schema = { type = "object", required = ["decision"] }
"#,
    );
    let v = base[0].version();
    assert_eq!(v.len(), 12);
    // Reordered keys, comments, another quoting, the schema as JSON text with other key
    // order, the label field as a JSON pointer, and a default written out.
    let same = defs(
        r#"# the decision field
[[scorer]]
schema = '{"required": ["decision"], "type": "object"}'
label_field = "/decision"   # a JSON pointer
metric = 'label'
kind = 'json'
name = 'decision'
"#,
    );
    assert_eq!(same[0].version(), v);
    let regex = |body: &str| {
        defs(&format!(
            "[[scorer]]\nname = \"r\"\nkind = \"regex\"\nmetric = \"pass_fail\"\n{body}\n"
        ))[0]
            .version()
    };
    let r = regex("patterns = ['refund']");
    assert_eq!(
        regex("patterns = [\n  \"refund\",\n]\nrequire = \"all\"\nignore_case = false"),
        r
    );
    for changed in [
        "patterns = ['refunds']",
        "patterns = ['Refund']",
        "patterns = ['refund', 'credit']",
        "patterns = ['refund']\nrequire = \"any\"",
        "patterns = ['refund']\nignore_case = true",
        "patterns = ['refund']\ndescription = \"x\"",
    ] {
        assert_ne!(regex(changed), r, "{changed}");
    }
    // One character of a SQL expression.
    let sql = |e: &str| {
        defs(&format!(
            "[[scorer]]\nname = \"s\"\nkind = \"sql\"\nmetric = \"numeric\"\nscore = \"{e}\"\n"
        ))[0]
            .version()
    };
    assert_ne!(sql("length(response)"), sql("length(response)+0"));
    assert_ne!(sql("1.0"), sql("2.0"));
    // The kind and the metric are content too.
    assert_ne!(
        regex("patterns = ['refund']"),
        defs("[[scorer]]\nname = \"r\"\nkind = \"contains\"\nmetric = \"pass_fail\"\npatterns = ['refund']\n")[0].version()
    );
}

/// A bad definition fails before anything is scored, naming file, line and field.
#[test]
fn bad_definitions_are_refused_with_file_line_and_field() {
    let cases: &[(&str, usize, &str, &str)] = &[
        (
            "[[scorer]]\nname = \"s\"\nkind = \"sql\"\nmetric = \"pass_fail\"\npassed = \"regexp_like(answer, 'x')\"\n",
            5,
            "passed",
            "answer",
        ),
        (
            "[[scorer]]\nname = \"s\"\nkind = \"sql\"\nmetric = \"numeric\"\n\n\nscore = \"CASE WHEN response THEN\"\n",
            7,
            "score",
            "CASE WHEN",
        ),
        (
            "[[scorer]]\nname = \"s\"\nkind = \"sql\"\nmetric = \"label\"\nscore = \"1.0\"\n",
            2,
            "label",
            "needs a `label` expression",
        ),
        (
            "[[scorer]]\nname = \"s\"\nkind = \"sql\"\nmetric = \"numeric\"\nscore = \"avg(response_score)\"\n",
            5,
            "score",
            "avg",
        ),
        (
            "[[scorer]]\nname = \"r\"\nkind = \"regex\"\nmetric = \"pass_fail\"\npatterns = ['ok', '(unclosed']\n",
            5,
            "patterns",
            "invalid regex `(unclosed`",
        ),
        (
            "[[scorer]]\nname = \"j\"\nkind = \"json\"\nmetric = \"pass_fail\"\nschema = '{\"type\": \"object\", \"minProperties\": -1}'\n",
            5,
            "schema",
            "invalid JSON Schema",
        ),
        (
            "[[scorer]]\nname = \"j\"\nkind = \"json\"\nmetric = \"pass_fail\"\nschema = '{\"type\": '\n",
            5,
            "schema",
            "not JSON",
        ),
        (
            "[[scorer]]\nname = \"checklist\"\nkind = \"regex\"\nmetric = \"pass_fail\"\npatterns = ['x']\n",
            2,
            "name",
            "built-in",
        ),
        (
            "[[scorer]]\nname = \"r\"\nkind = \"regex\"\nmetric = \"rate\"\npatterns = ['x']\n",
            4,
            "?",
            "unknown variant",
        ),
        (
            "[[scorer]]\nname = \"r\"\nkind = \"regex\"\nmetric = \"pass_fail\"\npattern = ['x']\n",
            5,
            "?",
            "unknown field",
        ),
    ];
    for (body, line, field, msg) in cases {
        let e = user::parse_text(body, "bad.toml").unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (*line, *field), "{e}");
        assert!(e.msg.contains(msg), "{e}");
        assert!(
            e.to_string().starts_with(&format!("bad.toml:{line}: ")),
            "{e}"
        );
    }
}

/// Issue 61, item 16: a label scorer whose labels are free text gets a rate for each of its
/// most frequent labels and one `(other)` for the rest (`EVALFLOW_MAX_LABELS`, 20 by
/// default), not a row per distinct text in every group; the rates of a group still add up
/// to its scored rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn free_text_labels_are_the_most_frequent_and_other() {
    let dir = tempfile::tempdir().unwrap();
    let pipeline = format!(
        "{PIPELINE}\n[score]\nscorers = [\"said\"]\n\n\
         [[scorer]]\nname = \"said\"\nkind = \"sql\"\nmetric = \"label\"\nlabel = \"lower(response)\"\n"
    );
    let root = dir.path().join("run");
    recorded_run(&root, &pipeline).await;
    let p = root.with_extension("toml");
    let (r, pf) = (
        root.to_str().unwrap().to_string(),
        p.to_str().unwrap().to_string(),
    );
    let run = |args: Vec<String>| {
        Command::new(env!("CARGO_BIN_EXE_evalflow"))
            .args(args)
            .env("EVALFLOW_CACHE_DIR", "off")
            .env("EVALFLOW_MAX_LABELS", "3")
            .output()
            .unwrap()
    };
    let (scored, agg) = tokio::task::spawn_blocking(move || {
        (
            run(vec!["score".into(), pf.clone(), "--out".into(), r.clone()]),
            run(vec!["aggregate".into(), pf, "--out".into(), r]),
        )
    })
    .await
    .unwrap();
    assert!(scored.status.success(), "{}", text(&scored));
    assert!(agg.status.success(), "{}", text(&agg));
    let store = RunStore::open(root.to_str().unwrap()).unwrap();
    let ctx = new_context();
    register_run(&ctx, &store, "").await.unwrap();
    let q = |sql: &str| {
        let ctx = ctx.clone();
        let sql = sql.to_string();
        async move { text_rows(&ctx, &sql).await.unwrap() }
    };
    let labels = q(
        "SELECT label FROM results WHERE scorer = 'said' AND level = 'capability' ORDER BY label",
    )
    .await;
    let distinct =
        q("SELECT count(DISTINCT label) FROM scores WHERE scorer = 'said' AND score IS NOT NULL")
            .await;
    let distinct: usize = distinct[0][0].as_deref().unwrap().parse().unwrap();
    assert!(distinct > 4, "{distinct} distinct answers");
    let labels: Vec<String> = labels.into_iter().filter_map(|r| r[0].clone()).collect();
    assert_eq!(labels.len(), 4, "{labels:?}");
    assert!(labels.contains(&"(other)".to_string()), "{labels:?}");
    // The three with a rate of their own are the most frequent ones.
    let top = q(
        "SELECT label FROM scores WHERE scorer = 'said' AND score IS NOT NULL GROUP BY label \
         ORDER BY count(*) DESC, label LIMIT 3",
    )
    .await;
    for t in top {
        assert!(labels.contains(t[0].as_ref().unwrap()), "{labels:?}");
    }
    let sums =
        q("SELECT sum(hits), max(n) FROM results WHERE scorer = 'said' AND level = 'capability'")
            .await;
    assert_eq!(
        sums[0][0], sums[0][1],
        "the rates add up to the scored rows: {sums:?}"
    );
}

/// A numeric scorer's diff by test is its mean score's difference, labelled so and shown as
/// a score (`+0.600`), not as a failure rate in points (it was "failure rate new - old" with
/// `+60.0 pts`: the opposite sign of the failure rate it named).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_numeric_scorers_diff_by_test_is_its_mean_score() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    recorded_run(&root, PIPELINE).await;
    let file = |v: &str, score: &str, passed: &str| {
        let p = dir.path().join(format!("{v}.toml"));
        std::fs::write(
            &p,
            format!(
                "[[scorer]]\nname = \"graded\"\nkind = \"sql\"\nmetric = \"numeric\"\n\
                 score = \"{score}\"\npassed = \"{passed}\"\n"
            ),
        )
        .unwrap();
        p.to_str().unwrap().to_string()
    };
    let v1 = file(
        "v1",
        "CASE WHEN test = 'refunds' THEN 0.2 ELSE 0.5 END",
        "TRUE",
    );
    let v2 = file(
        "v2",
        "CASE WHEN test = 'refunds' THEN 0.8 ELSE 0.5 END",
        "test <> 'refunds'",
    );
    let r = root.to_str().unwrap().to_string();
    let (first, second) = tokio::task::spawn_blocking(move || {
        (
            bin(&["rescore", &r, "--scorer-file", &v1]),
            bin(&["rescore", &r, "--scorer-file", &v2]),
        )
    })
    .await
    .unwrap();
    assert!(first.status.success(), "{}", text(&first));
    assert!(second.status.success(), "{}", text(&second));
    let t = text(&second);
    assert!(t.contains("mean score new - old [95% CI]"), "{t}");
    assert!(!t.contains("failure rate new - old"), "{t}");
    let row = t
        .lines()
        .find(|l| l.trim_start().starts_with("refunds"))
        .unwrap_or_else(|| panic!("no refunds row: {t}"));
    assert!(row.contains("+0.600 ["), "{row}");
    assert!(!row.contains("pts"), "{row}");
}

/// `rescore --scorer-file`: a new version beside the old with a diff against it; an
/// unchanged definition is refused (exit 2); `evalflow scorers` lists every version with its
/// definition; a bad file changes nothing and exits 2 naming file, line and field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rescore_from_a_scorer_file_and_list_versions() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    recorded_run(&root, PIPELINE).await;
    let v1 = dir.path().join("v1.toml");
    let v2 = dir.path().join("v2.toml");
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &v1,
        "[[scorer]]\nname = \"refund_word\"\nkind = \"regex\"\nmetric = \"pass_fail\"\npatterns = ['(?i)\\brefund\\b']\n",
    )
    .unwrap();
    std::fs::write(
        &v2,
        "# v2 also accepts credit\n[[scorer]]\nname = \"refund_word\"\nkind = \"regex\"\nmetric = \"pass_fail\"\npatterns = ['(?i)\\b(refund|credit)\\b']\n",
    )
    .unwrap();
    std::fs::write(
        &bad,
        "[[scorer]]\nname = \"refund_word\"\nkind = \"sql\"\nmetric = \"pass_fail\"\npassed = \"regexp_like(respnse, 'refund')\"\n",
    )
    .unwrap();
    let r = root.to_str().unwrap().to_string();
    let (v1s, v2s, bads) = (
        v1.to_str().unwrap().to_string(),
        v2.to_str().unwrap().to_string(),
        bad.to_str().unwrap().to_string(),
    );
    let (first, again, second, listed, json, badout, tree_before, tree_after) =
        tokio::task::spawn_blocking(move || {
            let first = bin(&["rescore", &r, "--scorer-file", &v1s]);
            let again = bin(&["rescore", &r, "--scorer-file", &v1s]);
            let second = bin(&["rescore", &r, "--scorer-file", &v2s]);
            let listed = bin(&["scorers", &r]);
            let json = bin(&["scorers", &r, "--json"]);
            let before = tree(Path::new(&r));
            let badout = bin(&["rescore", &r, "--scorer-file", &bads]);
            let after = tree(Path::new(&r));
            (first, again, second, listed, json, badout, before, after)
        })
        .await
        .unwrap();
    assert!(first.status.success(), "{}", text(&first));
    assert!(text(&first).contains("rescored 12 rows with refund_word@"));
    assert_eq!(again.status.code(), Some(2), "{}", text(&again));
    assert!(text(&again).contains("already scored"), "{}", text(&again));
    assert!(second.status.success(), "{}", text(&second));
    let t = text(&second);
    let (old, new) = (
        defs(&std::fs::read_to_string(&v1).unwrap())[0].version(),
        defs(&std::fs::read_to_string(&v2).unwrap())[0].version(),
    );
    assert!(
        t.contains(&format!(
            "diff refund_word@{old} -> refund_word@{new}: 12 rows paired, 1 changed label, 1 changed pass/fail"
        )),
        "{t}"
    );
    // Row 1 (CREDIT.) now passes: the failure rate falls by 1 in 10 rows.
    assert!(t.contains("failure rate, new - old: -10.0 pts ["), "{t}");
    assert!(t.contains("pass/fail changes by test"), "{t}");
    assert!(
        t.lines()
            .any(|l| l.split_whitespace().take(4).eq(["refunds", "0", "1", "0"])),
        "{t}"
    );
    assert!(listed.status.success(), "{}", text(&listed));
    let l = text(&listed);
    assert!(
        l.lines().any(|x| x.split_whitespace().eq([
            "refund_word",
            old.as_str(),
            "regex",
            "failure_rate",
            "12",
            "10"
        ])),
        "{l}"
    );
    assert!(l.contains(&format!("refund_word@{new}")), "{l}");
    assert!(
        l.contains("patterns = [\"(?i)\\\\b(refund|credit)\\\\b\"]")
            || l.contains("(?i)\\b(refund|credit)\\b"),
        "{l}"
    );
    let j: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(j.as_array().unwrap().len(), 2, "{j}");
    assert_eq!(j[1]["definition"]["require"], "all", "{j}");
    assert_eq!(badout.status.code(), Some(2), "{}", text(&badout));
    let e = text(&badout);
    assert!(
        e.contains(&format!(
            "{}:5: scorer `refund_word`: field `passed`",
            bad.display()
        )),
        "{e}"
    );
    assert!(e.contains("respnse"), "{e}");
    assert_eq!(tree_before, tree_after, "a bad definition changed the run");

    // A label scorer's diff: label changes by class and the rate of each label, new - old.
    let j1 = dir.path().join("j1.toml");
    let j2 = dir.path().join("j2.toml");
    std::fs::write(
        &j1,
        "[[scorer]]\nname = \"decision\"\nkind = \"json\"\nmetric = \"label\"\nlabel_field = \"decision\"\nschema = { type = \"object\" }\n",
    )
    .unwrap();
    std::fs::write(
        &j2,
        "[[scorer]]\nname = \"decision\"\nkind = \"json\"\nmetric = \"label\"\nlabel_field = \"decision\"\nschema = { type = \"object\", properties = { decision = { enum = [\"refund\"] } } }\n",
    )
    .unwrap();
    let (r, j1s, j2s) = (
        root.to_str().unwrap().to_string(),
        j1.to_str().unwrap().to_string(),
        j2.to_str().unwrap().to_string(),
    );
    let out = tokio::task::spawn_blocking(move || {
        let a = bin(&["rescore", &r, "--scorer-file", &j1s]);
        assert!(a.status.success(), "{}", text(&a));
        // This diff pairs the two versions 2 rows a slice (6 slices of the call ids; the
        // refund scorer's above paired in one) and reads the pairs' templates 3 rows a
        // slice: the counts and rates below are exact.
        Command::new(env!("CARGO_BIN_EXE_evalflow"))
            .args(["rescore", &r, "--scorer-file", &j2s])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("EVALFLOW_CACHE_DIR", "off")
            .env("EVALFLOW_RESCORE_SLICE_ROWS", "2")
            .env("EVALFLOW_TEMPLATE_SLICE_ROWS", "3")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(!root.join("_rescore").exists(), "the pairs are scratch");
    let t = text(&out);
    // Row 5 (deny) and row 6 (3) no longer match the schema.
    for (old, new) in [("deny", "schema_mismatch"), ("3", "schema_mismatch")] {
        assert!(
            t.lines().any(|l| l.split_whitespace().eq([old, new, "1"])),
            "{t}"
        );
    }
    assert!(
        t.lines().any(|l| l.split_whitespace().take(6).eq([
            "schema_mismatch",
            "10",
            "10.0%",
            "30.0%",
            "+20.0",
            "pts"
        ])),
        "{t}"
    );
}

/// Every file under `root` with its size.
fn tree(root: &Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                out.push((e.path().display().to_string(), e.metadata().unwrap().len()));
            }
        }
    }
    out.sort();
    out
}

/// `[[scorer]]` in a pipeline and `[score] scorer_files`: `evalflow score` runs them after
/// the named scorers, and `aggregate` follows the first one's declared metric.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_scorers_are_scored_and_aggregated_by_their_metric() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("extra.toml"),
        "[[scorer]]\nname = \"fenced\"\nkind = \"contains\"\nmetric = \"pass_fail\"\npatterns = [\"```\"]\n",
    )
    .unwrap();
    let pipeline = format!(
        "{PIPELINE}\n[score]\nscorers = [\"decision\"]\nscorer_files = [\"extra.toml\"]\n\n\
         [[scorer]]\nname = \"decision\"\nkind = \"json\"\nmetric = \"label\"\nlabel_field = \"decision\"\n\
         schema = {{ type = \"object\" }}\n"
    );
    let root = dir.path().join("run");
    recorded_run(&root, &pipeline).await;
    let p = root.with_extension("toml");
    let (r, pf) = (
        root.to_str().unwrap().to_string(),
        p.to_str().unwrap().to_string(),
    );
    let (scored, agg, again) = tokio::task::spawn_blocking(move || {
        (
            bin(&["score", &pf, "--out", &r]),
            bin(&["aggregate", &pf, "--out", &r]),
            // The pipeline's scorer rebuilt by name from the run: unchanged, so refused.
            bin(&["rescore", &r, "--scorer", "decision"]),
        )
    })
    .await
    .unwrap();
    assert_eq!(again.status.code(), Some(2), "{}", text(&again));
    assert!(text(&again).contains("already scored"), "{}", text(&again));
    assert!(scored.status.success(), "{}", text(&scored));
    let t = text(&scored);
    assert!(t.contains("scores/decision@"), "{t}");
    assert!(t.contains("scores/fenced@"), "{t}");
    assert!(agg.status.success(), "{}", text(&agg));
    let a = text(&agg);
    assert!(a.contains("rate of each label"), "{a}");
    assert!(
        a.lines()
            .any(|l| l.contains("invalid_json") && l.contains("6")),
        "{a}"
    );
    // A bad scorer in a scorer file fails the pipeline at load, naming that file.
    std::fs::write(
        dir.path().join("extra.toml"),
        "[[scorer]]\nname = \"fenced\"\nkind = \"regex\"\nmetric = \"pass_fail\"\npatterns = [\"(\"]\n",
    )
    .unwrap();
    let e = Pipeline::load(&p).unwrap_err().to_string();
    assert!(
        e.contains("extra.toml:5: field `scorer.patterns`: scorer `fenced`"),
        "{e}"
    );
    // ... and a bad inline one names the pipeline file and its line.
    let inline = format!(
        "{PIPELINE}\n[[scorer]]\nname = \"s\"\nkind = \"sql\"\nmetric = \"numeric\"\nscore = \"nope(response)\"\n"
    );
    let e = Pipeline::parse(&inline, Path::new("p.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("p.toml:14: field `scorer.score`: scorer `s`:") && e.contains("nope"),
        "{e}"
    );
}

/// The support-bot suite's scorer file loads, and each of its scorers compiles.
#[test]
fn support_bot_scorer_file_loads() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let p = Pipeline::load(&repo.join("pipelines/support-bot.toml")).unwrap();
    assert!(p.user_scorers.len() >= 3, "{:?}", p.user_scorers);
    let kinds: std::collections::BTreeSet<&str> =
        p.user_scorers.iter().map(|d| d.kind.as_str()).collect();
    assert!(
        kinds.contains("sql") && kinds.contains("match"),
        "{kinds:?}"
    );
    for d in &p.user_scorers {
        d.build().unwrap();
    }
}

/// The examples of docs/scorers.md parse and compile, one per kind.
#[test]
fn scorer_docs_examples_compile() {
    let doc = include_str!("../docs/scorers.md");
    let block = doc
        .split("```toml\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .unwrap();
    let d = user::parse_text(block, "docs/scorers.md").unwrap();
    let kinds: std::collections::BTreeSet<&str> = d.iter().map(|x| x.kind.as_str()).collect();
    assert_eq!(
        kinds.into_iter().collect::<Vec<_>>(),
        ["json", "judge", "match", "not_contains", "regex", "sql"]
    );
}

/// The folder under `root` with a name starting `prefix`, if any.
fn dir_starting(root: &Path, prefix: &str) -> Option<String> {
    std::fs::read_dir(root)
        .ok()?
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .find(|n| n.starts_with(prefix))
}

/// A SQL scorer that fails on the run's rows (a division by zero, a failed CAST) exits 2
/// naming its file, line and field, and leaves no `scores/NAME@VERSION/`; an invalid
/// constant regex is refused when the definition is read, before any stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_scorer_failures_name_file_and_field_and_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let pipeline = format!(
        "{PIPELINE}\n[score]\nscorers = [\"ratio\"]\n\n\
         [[scorer]]\nname = \"ratio\"\nkind = \"sql\"\nmetric = \"numeric\"\n\
         score = \"1 / (answer_chars - answer_chars)\"\n"
    );
    let root = dir.path().join("run");
    recorded_run(&root, &pipeline).await;
    let p = root.with_extension("toml");
    let cast = dir.path().join("cast.toml");
    std::fs::write(
        &cast,
        "[[scorer]]\nname = \"amount\"\nkind = \"sql\"\nmetric = \"numeric\"\nscore = \"CAST(response AS INT)\"\n",
    )
    .unwrap();
    let regex = dir.path().join("regex.toml");
    std::fs::write(
        &regex,
        "[[scorer]]\nname = \"refund_re\"\nkind = \"sql\"\nmetric = \"pass_fail\"\n\n\
         passed = \"regexp_like(response, '(refund')\"\n",
    )
    .unwrap();
    let manifest_before = std::fs::read(root.join("manifest.json")).unwrap();
    let (r, pf, cf, rf) = (
        root.to_str().unwrap().to_string(),
        p.to_str().unwrap().to_string(),
        cast.to_str().unwrap().to_string(),
        regex.to_str().unwrap().to_string(),
    );
    let (scored, cast_out, regex_out) = tokio::task::spawn_blocking(move || {
        (
            bin(&["score", &pf, "--out", &r]),
            bin(&["rescore", &r, "--scorer-file", &cf]),
            bin(&["rescore", &r, "--scorer-file", &rf]),
        )
    })
    .await
    .unwrap();
    let t = text(&scored);
    assert_eq!(scored.status.code(), Some(2), "{t}");
    let line = pipeline
        .lines()
        .position(|l| l.starts_with("score = "))
        .unwrap()
        + 1;
    assert!(
        t.contains(&format!(
            "{}:{line}: scorer `ratio`: field `score`: failed on the run's answers",
            p.display()
        )) && t.contains("Divide by zero"),
        "{t}"
    );
    let t = text(&cast_out);
    assert_eq!(cast_out.status.code(), Some(2), "{t}");
    assert!(
        t.contains(&format!(
            "{}:5: scorer `amount`: field `score`: failed on the run's answers",
            cast.display()
        )),
        "{t}"
    );
    let t = text(&regex_out);
    assert_eq!(regex_out.status.code(), Some(2), "{t}");
    assert!(
        t.contains(&format!(
            "{}:6: scorer `refund_re`: field `passed`: `regexp_like(response, '(refund')`: invalid regular expression '(refund'",
            regex.display()
        )),
        "{t}"
    );
    for name in ["ratio@", "amount@", "refund_re@"] {
        assert_eq!(dir_starting(&root.join("scores"), name), None, "{name}");
    }
    assert_eq!(
        std::fs::read(root.join("manifest.json")).unwrap(),
        manifest_before,
        "the manifest claims no scorer stage"
    );
    // The constant regex is refused when a pipeline holding it is read, before any stage.
    let inline = format!(
        "{PIPELINE}\n[[scorer]]\nname = \"s\"\nkind = \"sql\"\nmetric = \"pass_fail\"\npassed = \"response ~ '[a-'\"\n"
    );
    let e = Pipeline::parse(&inline, Path::new("p.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("p.toml:14: field `scorer.passed`: scorer `s`:")
            && e.contains("invalid regular expression '[a-'"),
        "{e}"
    );
}

/// An I/O failure while `rescore` writes (here: a part's path taken by a folder, as a full
/// disk fails a write) leaves no `scores/cue@1/` behind, so the next attempt is not refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rescore_that_fails_writing_leaves_no_scores_folder() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    recorded_run(&root, PIPELINE).await;
    let part = std::fs::read_dir(root.join("calls"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .find(|n| n.ends_with(".parquet"))
        .unwrap();
    let blocked = root.join("scores/cue@1").join(&part);
    std::fs::create_dir_all(&blocked).unwrap();
    let r = root.to_str().unwrap().to_string();
    let o = tokio::task::spawn_blocking(move || bin(&["rescore", &r, "--scorer", "cue"]))
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(!root.join("scores/cue@1").exists(), "{}", text(&o));
    let r = root.to_str().unwrap().to_string();
    let o = tokio::task::spawn_blocking(move || bin(&["rescore", &r, "--scorer", "cue"]))
        .await
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("rescored 12 rows with cue@1"),
        "{}",
        text(&o)
    );
}
