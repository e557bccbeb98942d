//! End-to-end tests of the `evalflow` binary on the embedded default model.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "common/moto.rs"]
mod moto;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_evalflow"))
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn run(args: &[&str]) -> Output {
    bin()
        .args(args)
        .current_dir(repo())
        .output()
        .expect("evalflow runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn sql_json(root: &Path, q: &str) -> serde_json::Value {
    let o = run(&[
        "sql",
        q,
        "--run",
        root.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "sql failed: {}", stderr(&o));
    serde_json::from_str(stdout(&o).trim()).expect("json output")
}

fn scalar(root: &Path, q: &str) -> i64 {
    let v = sql_json(root, q);
    let row = v.as_array().unwrap()[0].as_object().unwrap();
    row.values().next().unwrap().as_i64().unwrap()
}

#[test]
fn sentiment_run_end_to_end_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run1");
    let o = run(&[
        "run",
        "pipelines/sentiment.toml",
        "--out",
        root.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "run failed: {}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "Negation",
        "NER",
        "Robustness",
        "MFT",
        "INV",
        "DIR",
        "95% CI",
        "valid_answer",
    ] {
        assert!(out.contains(needle), "missing {needle} in:\n{out}");
    }
    let cases = scalar(&root, "SELECT count(*) AS n FROM cases");
    assert!(cases >= 300, "several hundred cases, got {cases}");
    assert_eq!(scalar(&root, "SELECT count(*) FROM calls"), cases);
    assert_eq!(
        scalar(&root, "SELECT count(DISTINCT call_id) FROM calls"),
        cases
    );
    assert_eq!(scalar(&root, "SELECT count(*) FROM validity"), cases);
    assert_eq!(scalar(&root, "SELECT count(*) FROM scores"), cases);
    // Every perturbed case points at a base case of the same test and template.
    assert_eq!(
        scalar(
            &root,
            "SELECT count(*) FROM cases p LEFT JOIN cases b ON p.group_id = b.case_id AND b.role = 'base' \
             WHERE p.role = 'perturbed' AND (b.case_id IS NULL OR b.template_id <> p.template_id)"
        ),
        0
    );
    // The seed's two negation cases: VADER's negation rule handles "not poor" (compound
    // +0.372, checked against vaderSentiment 3.3.2) but not negation at the end of a sentence.
    let v = sql_json(
        &root,
        "SELECT c.input, k.response, k.response_score, s.passed FROM cases c JOIN calls k USING (case_id) \
         JOIN scores s USING (call_id) \
         WHERE c.input IN ('The food is not poor.', 'I thought the plane would be awful, but it wasn''t.') \
         ORDER BY c.input",
    );
    assert_eq!(v.as_array().unwrap().len(), 2, "{v}");
    assert_eq!(
        v[0]["input"],
        "I thought the plane would be awful, but it wasn't."
    );
    assert_eq!(v[0]["passed"], false);
    assert_eq!(v[1]["response"], "positive");
    assert!(
        (v[1]["response_score"].as_f64().unwrap() - 0.3724).abs() < 1e-4,
        "{v}"
    );
    assert_eq!(v[1]["passed"], true);
    // Results hold the failure rate of every test, consistent with the scores.
    let r = sql_json(
        &root,
        "SELECT r.failures AS f, r.n AS n, (SELECT count(*) FROM scores s WHERE s.test = r.test AND s.passed = false) AS f2 \
         FROM results r WHERE r.level = 'test' AND r.test = 'Negation of negative at the end'",
    );
    assert_eq!(r[0]["f"], r[0]["f2"]);
    assert!(
        r[0]["f"].as_i64().unwrap() > 0,
        "VADER fails some negation cases"
    );

    // The results table's clustered SE is that of `clustered_mean_ci`'s default method.
    let v = sql_json(
        &root,
        "SELECT r.test, r.se, f.se AS se_sql FROM results r JOIN \
         (SELECT test, clustered_mean_ci(1 - score, template_id)['se'] AS se FROM scores \
          WHERE scorer = 'checklist' AND role <> 'base' GROUP BY test) f ON r.test = f.test \
         WHERE r.level = 'test' AND f.se IS NOT NULL",
    );
    let rows = v.as_array().unwrap();
    assert!(rows.len() > 20, "{v}");
    for r in rows {
        let (a, b) = (r["se"].as_f64().unwrap(), r["se_sql"].as_f64().unwrap());
        assert!((a - b).abs() < 1e-12, "{r}");
    }

    // pyarrow and DuckDB read every table with the declared column types.
    let py = Command::new("python3")
        .args(["scripts/check_tables.py", root.to_str().unwrap()])
        .current_dir(repo())
        .output()
        .expect("python3 runs (install pyarrow and duckdb: see README)");
    assert!(py.status.success(), "{}{}", stdout(&py), stderr(&py));
    assert!(stdout(&py).contains("scores: "), "{}", stdout(&py));

    // A half-written part (the local store's staging name while a put is in flight) is
    // invisible to readers and stages.
    std::fs::write(root.join("calls/part-zzzz.parquet#7"), b"PAR1 half a part").unwrap();
    assert_eq!(scalar(&root, "SELECT count(*) FROM calls"), cases);

    // Re-running on the same root resumes: nothing is called again, nothing duplicated.
    let o2 = run(&[
        "run",
        "pipelines/sentiment.toml",
        "--out",
        root.to_str().unwrap(),
    ]);
    assert!(o2.status.success(), "{}", stderr(&o2));
    assert_eq!(scalar(&root, "SELECT count(*) FROM calls"), cases);
    assert_eq!(scalar(&root, "SELECT count(*) FROM validity"), cases);
    assert_eq!(scalar(&root, "SELECT count(*) FROM scores"), cases);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(
        manifest["stages"]["call"]["details"]["sent_this_session"],
        0
    );
    assert_eq!(manifest["stages"]["call"]["status"], "complete");
    assert_eq!(manifest["row_counts"]["calls"], cases);
}

#[test]
fn stages_run_one_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("r");
    let r = root.to_str().unwrap();
    // call before generate is a usage error naming the missing stage
    let o = run(&["call", "pipelines/sentiment.toml", "--out", r]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("evalflow generate"), "{}", stderr(&o));
    for stage in ["generate", "call", "validate", "score", "aggregate"] {
        let o = run(&[stage, "pipelines/sentiment.toml", "--out", r]);
        assert!(o.status.success(), "{stage}: {}", stderr(&o));
    }
    assert!(root.join("scores/checklist@2").is_dir());
    // Twelve capability x test type cells in the sentiment suite (the CheckList paper's
    // sentiment capabilities: vocabulary, negation, NER, robustness, temporal, fairness,
    // coreference, SRL, logic).
    assert_eq!(
        scalar(
            &root,
            "SELECT count(*) FROM results WHERE level = 'capability'"
        ),
        12
    );
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

const MINIMAL: &str = r#"
[model]
provider = "builtin:vader"
name = "vader"

[suite]
name = "mini"

[lexicons]
adj = ["good", "bad"]

[[test]]
name = "t1"
capability = "Vocabulary"
type = "MFT"
templates = ["It is {adj}."]
expected = "positive"
"#;

#[test]
fn bad_input_exits_2_naming_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("r");
    let r = root.to_str().unwrap();
    let good = write(dir.path(), "good.toml", MINIMAL);
    assert!(
        run(&["run", good.to_str().unwrap(), "--out", r])
            .status
            .success()
    );
    let before = std::fs::read(root.join("manifest.json")).unwrap();

    // malformed TOML
    let p = write(
        dir.path(),
        "bad1.toml",
        &MINIMAL.replace("name = \"mini\"", "name = \"mini"),
    );
    let o = run(&["run", p.to_str().unwrap(), "--out", r]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("bad1.toml:7"), "{}", stderr(&o));

    // unknown placeholder
    let p = write(
        dir.path(),
        "bad2.toml",
        &MINIMAL.replace("It is {adj}.", "It is {colour}."),
    );
    let o = run(&[
        "generate",
        p.to_str().unwrap(),
        "--out",
        dir.path().join("r2").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(e.contains("bad2.toml:16") && e.contains("{colour}"), "{e}");

    // unknown provider
    let p = write(
        dir.path(),
        "bad3.toml",
        &MINIMAL.replace("builtin:vader", "builtin:nope"),
    );
    let o = run(&["run", p.to_str().unwrap(), "--out", r]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("bad3.toml:3: field `model.provider`"),
        "{}",
        stderr(&o)
    );

    // unknown key
    let p = write(
        dir.path(),
        "bad4.toml",
        &MINIMAL.replace("name = \"vader\"", "name = \"vader\"\ntemprature = 0.5"),
    );
    let o = run(&["run", p.to_str().unwrap(), "--out", r]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("temprature"), "{}", stderr(&o));

    // a different pipeline on an existing root is refused, and the root is untouched
    let p = write(
        dir.path(),
        "other.toml",
        &MINIMAL.replace("\"positive\"", "\"negative\""),
    );
    let o = run(&["run", p.to_str().unwrap(), "--out", r]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(std::fs::read(root.join("manifest.json")).unwrap(), before);
}

/// A run that fails in generate writes nothing, so the fixed pipeline runs on the same
/// `--out`; a root left by an older build (a manifest whose generate never committed) is
/// taken over by the fixed pipeline rather than refused as another pipeline's.
#[test]
fn failed_generate_leaves_no_manifest_and_the_fixed_pipeline_runs_on_the_same_root() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("r");
    let r = root.to_str().unwrap();
    let typo = write(
        dir.path(),
        "p.toml",
        &MINIMAL.replace("It is {adj}.", "It is {adjj}."),
    );
    let o = run(&["run", typo.to_str().unwrap(), "--out", r]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("{adjj}"), "{}", stderr(&o));
    assert!(!root.join("manifest.json").exists());
    assert!(!root.join("cases").exists());
    let missing = write(
        dir.path(),
        "p.toml",
        &MINIMAL
            .replace(
                "templates = [\"It is {adj}.\"]\nexpected = \"positive\"",
                "source = { file = \"nope.csv\", column = \"text\" }\nperturb = \"typos\"",
            )
            .replace("type = \"MFT\"", "type = \"INV\""),
    );
    let o = run(&["run", missing.to_str().unwrap(), "--out", r]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("nope.csv"), "{}", stderr(&o));
    assert!(!root.join("manifest.json").exists());

    let fixed = write(dir.path(), "p.toml", MINIMAL);
    let o = run(&["run", fixed.to_str().unwrap(), "--out", r]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(scalar(&root, "SELECT count(*) FROM scores"), 2);

    // An older build's leftover: generate started under another pipeline, never committed.
    let old = dir.path().join("old");
    std::fs::create_dir_all(&old).unwrap();
    std::fs::write(
        old.join("manifest.json"),
        r#"{"run_id":"old","evalflow_version":"0","pipeline_path":"p.toml","pipeline_hash":"0000000000000000","pipeline":null,"created_at":"2026-12-01T00:00:00Z","finished_at":null,"stages":{"generate":{"status":"running","rows":0,"started_at":"2026-12-01T00:00:00Z","finished_at":null}}}"#,
    )
    .unwrap();
    let o = run(&[
        "run",
        fixed.to_str().unwrap(),
        "--out",
        old.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(old.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["stages"]["generate"]["status"], "complete");
    assert_ne!(m["pipeline_hash"], "0000000000000000");
}

#[test]
fn input_table_with_wrong_schema_is_rejected_with_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("r");
    let r = root.to_str().unwrap();
    let good = write(dir.path(), "good.toml", MINIMAL);
    for stage in ["generate", "call"] {
        assert!(
            run(&[stage, good.to_str().unwrap(), "--out", r])
                .status
                .success()
        );
    }
    // Replace the calls part with a table whose sample_idx is a string.
    let part = std::fs::read_dir(root.join("calls"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let o = run(&[
        "sql",
        "SELECT call_id, case_id, model, provider, CAST(sample_idx AS VARCHAR) AS sample_idx FROM calls",
        "--run",
        r,
        "--format",
        "parquet",
        "--output",
        dir.path().join("bad.parquet").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::copy(dir.path().join("bad.parquet"), &part).unwrap();
    let o = run(&["validate", good.to_str().unwrap(), "--out", r]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains(part.file_name().unwrap().to_str().unwrap()) && e.contains("sample_idx"),
        "{e}"
    );
    assert!(
        !root.join("validity").exists()
            || std::fs::read_dir(root.join("validity")).unwrap().count() == 0
    );
}

#[test]
fn sql_formats_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("r");
    let good = write(dir.path(), "good.toml", MINIMAL);
    assert!(
        run(&[
            "run",
            good.to_str().unwrap(),
            "--out",
            root.to_str().unwrap()
        ])
        .status
        .success()
    );
    let o = run(&[
        "sql",
        "SELECT input, expected FROM cases ORDER BY input",
        "--run",
        root.to_str().unwrap(),
        "--format",
        "csv",
    ]);
    assert_eq!(
        stdout(&o),
        "input,expected\nIt is bad.,positive\nIt is good.,positive\n"
    );
    let o = run(&[
        "sql",
        "SELECT nope FROM cases",
        "--run",
        root.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("nope"), "{}", stderr(&o));
    // --table registers a Parquet folder by name
    let o = run(&[
        "sql",
        "SELECT count(*) AS n FROM c",
        "--table",
        &format!("c={}", root.join("cases").display()),
        "--format",
        "json",
    ]);
    assert_eq!(stdout(&o).trim(), r#"[{"n":2}]"#);
}

/// Rogan-Gladen by hand (DESIGN.md, `rogan_gladen_ci`): the corrected rate of a class with
/// `pos` scorer positives among `n` rows, given the holdout's confusion counts, and its
/// delta-method 95% interval clipped to [0, 1].
fn rogan_gladen_by_hand(pos: f64, n: f64, tp: f64, fn_: f64, tn: f64, fp: f64) -> [f64; 3] {
    let (se, sp) = (tp / (tp + fn_), tn / (tn + fp));
    let (p, j) = (pos / n, se + sp - 1.0);
    let e = ((p + sp - 1.0) / j).clamp(0.0, 1.0);
    let var = (p * (1.0 - p) / n
        + e * e * se * (1.0 - se) / (tp + fn_)
        + (1.0 - e).powi(2) * sp * (1.0 - sp) / (tn + fp))
        / (j * j);
    let z = 1.959963984540054;
    [
        e,
        (e - z * var.sqrt()).max(0.0),
        (e + z * var.sqrt()).min(1.0),
    ]
}

/// The cells of one class's row in the printed Rogan-Gladen table (the only place that
/// reads that table's layout).
fn prevalence_cells(out: &str, class: &str) -> Vec<String> {
    let header = out
        .find("(Rogan-Gladen)")
        .unwrap_or_else(|| panic!("no Rogan-Gladen table in:\n{out}"));
    let line = out[header..]
        .lines()
        .find(|l| l.split_whitespace().next() == Some(class))
        .unwrap_or_else(|| panic!("no {class} row in:\n{out}"));
    line.split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(String::from)
        .collect()
}

#[test]
fn run_prints_rogan_gladen_corrected_rates_given_a_holdout() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("r");
    let good = write(
        dir.path(),
        "good.toml",
        &MINIMAL.replace(
            "adj = [\"good\", \"bad\"]",
            "adj = [\"good\", \"great\", \"nice\", \"fine\", \"bad\", \"awful\", \"terrible\", \"horrible\"]",
        ),
    );
    assert!(
        run(&[
            "run",
            good.to_str().unwrap(),
            "--out",
            root.to_str().unwrap()
        ])
        .status
        .success()
    );
    // VADER reads the first four as positive ("fine": compound 0.2023) and the last four as
    // negative.
    let v = sql_json(
        &root,
        "SELECT k.call_id, c.input, k.response FROM calls k JOIN cases c USING (case_id) ORDER BY c.input",
    );
    let v = v.as_array().unwrap();
    assert_eq!(v.len(), 8);
    for r in v {
        let input = r["input"].as_str().unwrap();
        let positive = ["good", "great", "nice", "fine"]
            .iter()
            .any(|w| input == format!("It is {w}."));
        assert_eq!(
            r["response"],
            if positive { "positive" } else { "negative" },
            "{r}"
        );
    }
    // Hand labels that disagree with the model once: the reader finds "It is fine."
    // lukewarm, a negative. For `positive`: tp 3, fn 0, tn 4, fp 1 (sens 1, spec 0.8);
    // for `negative`: tp 4, fn 1, tn 3, fp 0 (sens 0.8, spec 1). The model's raw rate is
    // 4 / 8 for both; corrected, 37.5% [0.0%, 88.7%] and 62.5% [11.3%, 100.0%].
    let truth = |input: &str| match input {
        "It is good." | "It is great." | "It is nice." => "positive",
        _ => "negative",
    };
    let mut csv = "call_id,label\n".to_string();
    for r in v {
        csv.push_str(&format!(
            "{},{}\n",
            r["call_id"].as_str().unwrap(),
            truth(r["input"].as_str().unwrap())
        ));
    }
    write(dir.path(), "labels.csv", &csv);
    let with = write(
        dir.path(),
        "with.toml",
        &std::fs::read_to_string(&good)
            .unwrap()
            .replace("[suite]", "[score]\nholdout = \"labels.csv\"\n\n[suite]"),
    );
    let o = run(&[
        "run",
        with.to_str().unwrap(),
        "--out",
        dir.path().join("r2").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let pct = |x: f64| format!("{:.1}%", x * 100.0);
    for (class, (tp, fn_, tn, fp), sens_spec) in [
        ("positive", (3.0, 0.0, 4.0, 1.0), "100% / 80%"),
        ("negative", (4.0, 1.0, 3.0, 0.0), "80% / 100%"),
    ] {
        let [e, lo, hi] = rogan_gladen_by_hand(4.0, 8.0, tp, fn_, tn, fp);
        assert_ne!(pct(e), "50.0%", "the correction moves the rate");
        assert_eq!(
            prevalence_cells(&out, class),
            [
                class.to_string(),
                "4 / 8".into(),
                "50.0%".into(),
                pct(e),
                format!("[{}, {}]", pct(lo), pct(hi)),
                sens_spec.into(),
            ],
            "{out}"
        );
    }
    // The hand computation, spelled out for `positive`: e = (0.5 + 0.8 - 1) / 0.8 = 0.375,
    // var = (0.25 / 8 + 0.625^2 * 0.8 * 0.2 / 5) / 0.8^2 = 0.068359375.
    let [e, lo, hi] = rogan_gladen_by_hand(4.0, 8.0, 3.0, 0.0, 4.0, 1.0);
    assert!((e - 0.375).abs() < 1e-12);
    assert!((hi - (0.375 + 1.959963984540054 * 0.068359375f64.sqrt())).abs() < 1e-12);
    assert_eq!(lo, 0.0);
}

/// A run on real S3-compatible object storage (moto's server on loopback, started here;
/// `.ci/run` installs it): every stage writes through object_store, SQL reads it back,
/// and a re-run resumes without re-calling.
#[test]
fn run_on_s3_object_storage_and_resume() {
    let moto = moto::Moto::start("evalflow-test");
    let s3 = |args: &[&str]| {
        bin()
            .args(args)
            .current_dir(repo())
            .envs(moto.env())
            .output()
            .unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let good = write(dir.path(), "good.toml", MINIMAL);
    let root = "s3://evalflow-test/runs/r1";
    let o = s3(&["run", good.to_str().unwrap(), "--out", root]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("valid_answer 2/2"), "{}", stdout(&o));
    let count = |table: &str| {
        let o = s3(&[
            "sql",
            &format!("SELECT count(*) AS n FROM {table}"),
            "--run",
            root,
            "--format",
            "json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o).trim().to_string()
    };
    for t in ["cases", "calls", "validity", "scores"] {
        assert_eq!(count(t), r#"[{"n":2}]"#, "{t}");
    }
    let o = s3(&["run", good.to_str().unwrap(), "--out", root]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(count("calls"), r#"[{"n":2}]"#);
    let o = s3(&["sql", "SELECT 1", "--run", "s3://evalflow-test/runs/none"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "a run root with no manifest is refused: {}",
        stderr(&o)
    );
}

/// `sql --format csv` flattens struct columns into `col.field` columns (nested structs too,
/// a NULL struct's fields NULL), refuses a list column with exit 2 before printing anything,
/// and `--output` writes every format to the file, never to stdout.
#[test]
fn sql_csv_flattens_structs_and_output_takes_every_format() {
    let dir = tempfile::tempdir().unwrap();
    let o = run(&[
        "sql",
        "SELECT k, CASE WHEN k = 'a' THEN named_struct('n', 3, 'ci', named_struct('lo', 0.5, 'hi', 1.5)) END AS s \
         FROM (VALUES ('a'), ('b')) AS t(k) ORDER BY k",
        "--format",
        "csv",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o), "k,s.n,s.ci.lo,s.ci.hi\na,3,0.5,1.5\nb,,,\n");
    // A statistics function's struct: mean_ci over 1 and 3 is n 2, mean 2, se 1.
    let o = run(&[
        "sql",
        "SELECT mean_ci(x) AS ci FROM (VALUES (1.0), (3.0)) AS t(x)",
        "--format",
        "csv",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    let mut lines = out.lines();
    assert_eq!(
        lines.next(),
        Some("ci.n,ci.mean,ci.se,ci.lo,ci.hi"),
        "{out}"
    );
    let cells: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(&cells[..3], ["2", "2.0", "1.0"], "{out}");

    // A list has no flat form: refused, naming the column, nothing printed or written.
    let file = dir.path().join("out.csv");
    let o = run(&[
        "sql",
        "SELECT 1 AS a, make_array(1, 2) AS l",
        "--format",
        "csv",
        "--output",
        file.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(o.stdout.is_empty(), "{}", stdout(&o));
    assert!(stderr(&o).contains("`l`"), "{}", stderr(&o));
    assert!(!file.exists() && !dir.path().join("out.csv.tmp").exists());
    let o = run(&["sql", "SELECT make_array(1, 2) AS l", "--format", "csv"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(o.stdout.is_empty(), "{}", stdout(&o));

    // --output for csv, json and table.
    for (format, want) in [
        ("csv", "x,s.n\n1,2\n"),
        ("json", "[{\"x\":1,\"s\":{\"n\":2}}]\n"),
    ] {
        let file = dir.path().join(format!("out.{format}"));
        let o = run(&[
            "sql",
            "SELECT 1 AS x, named_struct('n', 2) AS s",
            "--format",
            format,
            "--output",
            file.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        assert!(o.stdout.is_empty(), "{format}: {}", stdout(&o));
        assert_eq!(std::fs::read_to_string(&file).unwrap(), want, "{format}");
    }
    let file = dir.path().join("out.txt");
    let o = run(&[
        "sql",
        "SELECT 41 + 1 AS answer",
        "--output",
        file.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(o.stdout.is_empty(), "{}", stdout(&o));
    let t = std::fs::read_to_string(&file).unwrap();
    assert!(t.contains("| answer |") && t.contains("| 42     |"), "{t}");
}

/// `aggregate --scorer` and `report --scorer` show a user scorer's results (one the
/// pipeline's `[score]` does not name, added by `rescore`); a scorer the run does not have
/// is refused with exit 2 naming what it has, and `results` is left as it was.
#[test]
fn aggregate_and_report_pick_any_scorer_of_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("r");
    let r = root.to_str().unwrap();
    let good = write(dir.path(), "good.toml", MINIMAL);
    let p = good.to_str().unwrap();
    assert!(run(&["run", p, "--out", r]).status.success());
    // Passes only the answer to "It is bad." (the checklist fails exactly that one).
    let scorers = write(
        dir.path(),
        "mine.toml",
        "[[scorer]]\nname = \"mine\"\nkind = \"sql\"\nmetric = \"pass_fail\"\npassed = \"input LIKE '%bad%'\"\n",
    );
    let o = run(&[
        "rescore",
        r,
        "--scorer-file",
        scorers.to_str().unwrap(),
        "--scorer",
        "mine",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let results = |root: &Path| {
        sql_json(
            root,
            "SELECT scorer, failures, n FROM results WHERE level = 'test'",
        )
    };
    let o = run(&["aggregate", p, "--out", r, "--scorer", "mine"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        results(&root),
        serde_json::json!([{"scorer": "mine", "failures": 1, "n": 2}])
    );
    // The failing case is "It is good." for `mine`; the checklist fails the other one, so
    // the per-test failure rates are 50% either way: the scorer column tells them apart.
    assert!(stdout(&o).contains("50.0%"), "{}", stdout(&o));
    let version = sql_json(
        &root,
        "SELECT DISTINCT scoring_version FROM scores WHERE scorer = 'mine'",
    )[0]["scoring_version"]
        .as_str()
        .unwrap()
        .to_string();
    let o = run(&["report", r, "--scorer", &format!("mine@{version}")]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains(&format!("scorer mine@{version}")),
        "{}",
        stdout(&o)
    );
    for args in [
        vec!["aggregate", p, "--out", r, "--scorer", "nope"],
        vec!["report", r, "--scorer", "mine@0"],
    ] {
        let o = run(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("checklist@2") && stderr(&o).contains("mine@"),
            "{args:?}: {}",
            stderr(&o)
        );
        assert_eq!(results(&root)[0]["scorer"], "mine", "results untouched");
    }
}

/// `scorers RUN --delete NAME@VERSION` removes the scores, the nested judge run and the
/// manifest entries of one version (and `results` aggregated from it), keeps the others,
/// and refuses a version the run does not have with exit 2, changing nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scorers_delete_removes_one_version_and_its_judge_run() {
    use evalflow::mock::{AnswerMode, MockConfig, MockServer};
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
    let dir = tempfile::tempdir().unwrap();
    let pipeline = format!(
        "{MINIMAL}\n[judge]\nprovider = \"openai\"\nbase_url = \"{}\"\nname = \"judge-model\"\ntemperature = 0.0\n\n\
         [[score.judge.questions]]\nid = \"short\"\ntext = \"Is the answer one word?\"\n",
        judge.base_url()
    );
    let good = write(dir.path(), "judged.toml", &pipeline);
    let mine = write(
        dir.path(),
        "mine.toml",
        "[[scorer]]\nname = \"mine\"\nkind = \"sql\"\nmetric = \"pass_fail\"\npassed = \"input LIKE '%bad%'\"\n",
    );
    let root = dir.path().join("r");
    let (p, r) = (
        good.to_str().unwrap().to_string(),
        root.to_str().unwrap().to_string(),
    );
    let m = mine.to_str().unwrap().to_string();
    let r2 = r.clone();
    tokio::task::spawn_blocking(move || {
        assert!(run(&["run", &p, "--out", &r2]).status.success());
        for args in [
            vec!["rescore", &r2, "--scorer", "judge"],
            vec!["rescore", &r2, "--scorer-file", &m, "--scorer", "mine"],
            vec!["aggregate", &p, "--out", &r2, "--scorer", "mine"],
        ] {
            let o = run(&args);
            assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        }
    })
    .await
    .unwrap();
    let manifest = || -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(root.join("manifest.json")).unwrap()).unwrap()
    };
    let versions = || -> Vec<String> {
        manifest()["scorer_versions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    };
    let judge_tag = versions()
        .into_iter()
        .find(|t| t.starts_with("judge@"))
        .expect("judge scored");
    let judge_version = judge_tag.trim_start_matches("judge@").to_string();
    let mine_tag = versions()
        .into_iter()
        .find(|t| t.starts_with("mine@"))
        .unwrap();
    assert!(root.join("judge").join(&judge_version).exists());
    let scores = |q: &str| scalar(&root, &format!("SELECT count(*) FROM scores WHERE {q}"));
    assert_eq!(scores("scorer = 'checklist'"), 2);

    // An unknown version: exit 2, nothing printed or changed.
    let before = std::fs::read(root.join("manifest.json")).unwrap();
    let o = run(&["scorers", &r, "--delete", "judge@0"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(o.stdout.is_empty());
    assert!(stderr(&o).contains(&judge_tag), "{}", stderr(&o));
    assert_eq!(std::fs::read(root.join("manifest.json")).unwrap(), before);

    let o = run(&["scorers", &r, "--delete", &judge_tag]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!root.join("scores").join(&judge_tag).exists());
    assert!(!root.join("judge").join(&judge_version).exists());
    assert_eq!(
        versions(),
        vec!["checklist@2".to_string(), mine_tag.clone()]
    );
    assert!(
        manifest()["stages"]
            .get(format!("score:{judge_tag}"))
            .is_none()
    );
    assert_eq!(scores("scorer = 'judge'"), 0);
    assert_eq!(scores("scorer = 'checklist'"), 2);
    assert_eq!(scores("scorer = 'mine'"), 2);
    // `results` were aggregated from `mine`: they go with it.
    assert!(scalar(&root, "SELECT count(*) FROM results WHERE scorer = 'mine'") > 0);
    let o = run(&["scorers", &r, "--delete", &mine_tag]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(versions(), vec!["checklist@2".to_string()]);
    assert_eq!(scalar(&root, "SELECT count(*) FROM results"), 0);
    assert!(manifest()["stages"].get("aggregate").is_none());
    let listed = run(&["scorers", &r, "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["tag"], "checklist@2");
}

/// `evalflow runs ROOT` lists every run under a folder, at any depth, and not the folders
/// inside a run; a missing folder is exit 2.
#[test]
fn runs_lists_the_runs_under_a_folder() {
    let dir = tempfile::tempdir().unwrap();
    let good = write(dir.path(), "good.toml", MINIMAL);
    let base = dir.path().join("runs");
    for sub in ["a", "team/b"] {
        let out = base.join(sub);
        let o = run(&[
            "run",
            good.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    std::fs::create_dir_all(base.join("empty")).unwrap();
    let o = run(&["runs", base.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut paths: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["path"].as_str().unwrap().to_string())
        .collect();
    paths.sort();
    assert_eq!(
        paths,
        [
            base.join("a").display().to_string(),
            base.join("team/b").display().to_string()
        ]
    );
    for r in v.as_array().unwrap() {
        assert_eq!(r["row_counts"]["cases"], 2, "{r}");
        assert_eq!(
            r["scorer_versions"],
            serde_json::json!(["checklist@2"]),
            "{r}"
        );
        assert_eq!(r["stages"]["aggregate"], "complete", "{r}");
    }
    let o = run(&["runs", base.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("2 runs under"), "{}", stdout(&o));
    let o = run(&["runs", dir.path().join("nope").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

/// docs/functions.md (generated from the functions' docs) labels the `clustered_se_cr2`
/// example's column `se_cr2`, beside CR1 (equal with equal cluster sizes, as it says).
#[test]
fn functions_reference_labels_the_cr2_example() {
    let md = std::fs::read_to_string(repo().join("docs/functions.md")).unwrap();
    let section = md
        .split("\n## clustered_se_cr2\n")
        .nth(1)
        .unwrap()
        .split("\n## ")
        .next()
        .unwrap();
    assert!(
        section
            .contains("SELECT clustered_se_cr2(x, c) AS se_cr2, clustered_se_cr1(x, c) AS se_cr1"),
        "{section}"
    );
    let header = section
        .lines()
        .find(|l| l.starts_with("| se_"))
        .unwrap_or_else(|| panic!("no result table in {section}"));
    let cols: Vec<&str> = header
        .split('|')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(cols, ["se_cr2", "se_cr1"], "{header}");
    let row = section
        .lines()
        .skip_while(|l| !l.starts_with("| se_"))
        .nth(2)
        .unwrap();
    let vals: Vec<&str> = row
        .split('|')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(vals[0], vals[1], "equal cluster sizes: CR2 = CR1 ({row})");
}

/// docs/scorers.md documents a judge scorer's own `model = {...}` table, and the example parses
/// into that model.
#[test]
fn scorer_docs_document_the_judge_scorer_model_table() {
    let doc = std::fs::read_to_string(repo().join("docs/scorers.md")).unwrap();
    let block = doc
        .split("```toml\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .unwrap();
    let defs = evalflow::stages::score::user::parse_text(block, "docs/scorers.md").unwrap();
    let judge = defs.iter().find(|d| d.kind.as_str() == "judge").unwrap();
    let model = judge
        .model
        .as_ref()
        .expect("the judge example has a model table");
    assert_eq!(
        (model.provider.as_str(), model.name.as_str()),
        ("openai", "gpt-4o-mini")
    );
    assert_eq!(model.api_key_env.as_deref(), Some("OPENAI_API_KEY"));
}

/// Error messages name what is known and nothing else: a missing scorer file is
/// "nope.toml: cannot read", never "nope.toml:0: scorer `?`: field `?`"; a syntax error
/// keeps its line.
#[test]
fn messages_leave_out_unknown_lines_and_names() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("r");
    let r = root.to_str().unwrap();
    let good = write(dir.path(), "good.toml", MINIMAL);
    assert!(
        run(&["run", good.to_str().unwrap(), "--out", r])
            .status
            .success()
    );
    let nope = dir.path().join("nope.toml");
    let o = run(&["rescore", r, "--scorer-file", nope.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains(&format!("{}: cannot read", nope.display())),
        "{e}"
    );
    assert!(!e.contains("nope.toml:0") && !e.contains("`?`"), "{e}");
    let bad = write(
        dir.path(),
        "bad.toml",
        "[[scorer]]\nname = \"x\"\nkind = = \"sql\"\n",
    );
    let o = run(&["rescore", r, "--scorer-file", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains(&format!("{}:3: ", bad.display())), "{e}");
    assert!(!e.contains("`?`"), "{e}");
}

/// Two `evalflow run`s of one pipeline started at the same moment without `--out` get
/// two folders and two run ids (the second used to resume the first's folder).
#[test]
fn runs_started_together_get_their_own_folders() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "good.toml", MINIMAL);
    let start = || {
        bin()
            .args(["run", "good.toml"])
            .current_dir(dir.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (start(), start());
    for c in [a, b] {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let mut ids = Vec::new();
    for e in std::fs::read_dir(dir.path().join("runs")).unwrap() {
        let m: serde_json::Value = serde_json::from_slice(
            &std::fs::read(e.unwrap().path().join("manifest.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(m["row_counts"]["cases"], 2, "{m}");
        ids.push(m["run_id"].as_str().unwrap().to_string());
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 2, "{ids:?}");
}

/// Off a terminal the call stage prints no progress lines (stderr is for errors), unless
/// `EVALFLOW_PROGRESS=lines` asks for them. The calls take over the 5 s between lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_progress_lines_off_a_terminal() {
    use evalflow::mock::{MockConfig, MockServer};
    let mock = MockServer::start(
        "127.0.0.1:0".parse().unwrap(),
        MockConfig {
            latency: std::time::Duration::from_millis(5_300),
            retry_after_secs: 0,
            ..MockConfig::default()
        },
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    // One model name per run, so neither run's calls are answered from the other's.
    let pipeline = |model: &str| {
        MINIMAL.replace(
            "provider = \"builtin:vader\"\nname = \"vader\"",
            &format!(
                "provider = \"openai\"\nbase_url = \"{}\"\nname = \"{model}\"\ntimeout_secs = 30.0",
                mock.base_url()
            ),
        )
    };
    for (root, env, want) in [("quiet", None, false), ("lines", Some("lines"), true)] {
        let p = write(dir.path(), &format!("{root}.toml"), &pipeline(root));
        assert!(std::fs::read_to_string(&p).unwrap().contains("openai"));
        let out = dir.path().join(root);
        let o = tokio::task::spawn_blocking(move || {
            let mut c = bin();
            c.args(["run", p.to_str().unwrap(), "--out", out.to_str().unwrap()])
                .current_dir(repo());
            if let Some(v) = env {
                c.env("EVALFLOW_PROGRESS", v);
            }
            c.output().unwrap()
        })
        .await
        .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(
            stderr(&o).contains("call: "),
            want,
            "EVALFLOW_PROGRESS={env:?}: {}",
            stderr(&o)
        );
    }
}

/// Issue 61, item 9: `run` whose stdout or stderr is a pipe closed early (`run ... | head -1`,
/// a CI log collector gone) finishes every stage and writes its report, then exits 0: its
/// output on the closed pipe is dropped, not a reason to stop (nor an exit 0 half way).
#[test]
fn a_run_whose_output_pipe_closes_early_finishes_and_exits_0() {
    use std::io::BufRead;
    use std::process::Stdio;
    // (what is closed, whether the first stderr line is read before closing)
    for (case, read_first) in [("stdout and stderr", true), ("stderr", false)] {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("run");
        let mut c = bin();
        c.args([
            "run",
            "pipelines/sentiment.toml",
            "--out",
            root.to_str().unwrap(),
        ])
        .current_dir(repo())
        .stderr(Stdio::piped())
        .stdout(if read_first {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        let mut child = c.spawn().unwrap();
        let err = child.stderr.take().unwrap();
        let out = child.stdout.take();
        if read_first {
            // The first line comes before any stage; the table and the report's path come
            // on stdout after every stage, long after both pipes are closed.
            let mut line = String::new();
            std::io::BufReader::new(err).read_line(&mut line).unwrap();
            assert!(line.starts_with("run root: "), "{case}: {line}");
        } else {
            drop(err);
        }
        drop(out);
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(0), "{case}");
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(root.join("manifest.json")).unwrap()).unwrap();
        let stages: Vec<(String, String)> = m["stages"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v["status"].as_str().unwrap().to_string()))
            .collect();
        for stage in ["generate", "call", "validate", "score", "aggregate"] {
            assert!(
                stages.contains(&(stage.to_string(), "complete".to_string())),
                "{case}: {stages:?}"
            );
        }
        assert!(
            stages.iter().all(|(_, s)| s == "complete"),
            "{case}: {stages:?}"
        );
        assert!(m["finished_at"].is_string(), "{case}: {m}");
        assert!(root.join("report.html").is_file(), "{case}: no report");
    }
}
