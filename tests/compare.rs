//! `evalflow compare` on runs whose true paired difference is known: B better, B worse, and
//! B within the minimum detectable effect of A. The runs are built directly (cases and calls
//! written through the library's table builders, then validated and scored by the checklist
//! scorer), so every case's score in each run is chosen by the test, and the expected
//! difference, clustered (CR2) interval and verdict are computed here by hand.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};

use evalflow::stages::call::{CallRequest, CallResult, CallRow};
use evalflow::stages::generate::Case;
use evalflow::storage::RunStore;

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
name = "paired"
"#;

/// Cases in the suite, and the templates they are spread over (case i has template i % 8).
const N: usize = 40;
const TEMPLATES: usize = 8;

/// Writes a run root of `N` MFT cases expecting `positive`; case i's answer passes when
/// `pass[i]`, so its checklist score is 1 or 0.
async fn build_run(root: &Path, pass: &[bool]) {
    assert_eq!(pass.len(), N);
    let outcomes: Vec<Option<bool>> = pass.iter().map(|&p| Some(p)).collect();
    let templates: Vec<String> = (0..N).map(|i| format!("t{}", i % TEMPLATES)).collect();
    build_run_with(root, &outcomes, &templates, "recorded").await;
}

/// Writes a run root of one MFT case per outcome, case i in template `templates[i]`, all
/// answered by `model`: `Some(pass)` is an answer that passes or fails the checklist scorer,
/// `None` a provider error (HTTP 500, no answer), which is never scored.
async fn build_run_with(root: &Path, outcomes: &[Option<bool>], templates: &[String], model: &str) {
    let store = RunStore::open(root.to_str().unwrap()).unwrap();
    let p = evalflow::pipeline::Pipeline::parse(
        &PIPELINE.replace("name = \"recorded\"", &format!("name = \"{model}\"")),
        Path::new("paired.toml"),
    )
    .unwrap();
    let mut cases = Vec::new();
    let mut rows = Vec::new();
    for (i, &outcome) in outcomes.iter().enumerate() {
        cases.push(Case {
            case_id: format!("case{i:02}"),
            suite: "paired".into(),
            test: "label".into(),
            capability: "Vocabulary".into(),
            test_type: "MFT".into(),
            template_id: templates[i].clone(),
            group_id: format!("case{i:02}"),
            role: "single".into(),
            input: format!("Sentence number {i} is good."),
            expected: Some("positive".into()),
            expectation: None,
            tolerance: None,
            perturbation: None,
        });
        let res = match outcome {
            Some(ok) => CallResult {
                response: Some(if ok { "positive" } else { "negative" }.into()),
                finish_reason: Some("stop".into()),
                attempts: 1,
                ..Default::default()
            },
            None => CallResult {
                http_status: Some(500),
                error: Some("server error".into()),
                attempts: 3,
                ..Default::default()
            },
        };
        rows.push(CallRow {
            req: CallRequest {
                call_id: format!("call{i:02}"),
                case_id: format!("case{i:02}"),
                input: String::new(),
                prompt: String::new(),
                system: None,
                sample_idx: 0,
                max_tokens: None,
                temperature: None,
                request_hash: format!("req{i:02}"),
                prior_attempts: 0,
            },
            res,
            latency_ms: 1.0,
            started_at_us: 1_700_000_000_000_000,
        });
    }
    let run_id = root.file_name().unwrap().to_string_lossy().to_string();
    let mut m =
        common::write_validated_run(&store, &p, &run_id, &cases, &rows, &["en".into()]).await;
    let scorer = evalflow::stages::score::build("checklist", None).unwrap();
    evalflow::stages::score::run(&store, scorer.as_ref())
        .await
        .unwrap();
    m.scorer_versions.push("checklist@1".into());
    m.save(&store).await.unwrap();
}

/// The paired difference of B - A by hand: (mean, CR2 clustered SE, lo, hi, MDE), as the
/// default method of `paired_diff_clustered` defines them for pass/fail pairs (`cr2_score`,
/// docs/functions.md).
///
/// The templates here are of equal size (N / TEMPLATES cases each), where CR2 (and the
/// random-intercept floor, equal to it here) reduces to se^2 = G / (G - 1) * sum over
/// templates of (sum of d_i - mean in the template)^2 / n^2 and its Satterthwaite degrees of
/// freedom to G - 1. The interval is Tango's score interval for paired proportions with that
/// design effect: the d0 with (mean - d0)^2 <= t_{0.975, G-1}^2 * deff * V(d0), V(d0) the
/// variance of d under d0 at the restricted MLE of the share of d = -1 pairs, deff = se^2 /
/// V(mean); found here by bisection on a sign change. MDE = (z_0.975 + z_0.8) times the SE
/// the interval implies, (hi - lo) / (2 z_0.975).
fn by_hand(a: &[bool], b: &[bool]) -> (f64, f64, f64, f64, f64) {
    let d: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(&a, &b)| f64::from(u8::from(b)) - f64::from(u8::from(a)))
        .collect();
    let n = d.len() as f64;
    let mean = d.iter().sum::<f64>() / n;
    let g = TEMPLATES as f64;
    let scores: f64 = (0..TEMPLATES)
        .map(|t| {
            (0..N)
                .filter(|i| i % TEMPLATES == t)
                .map(|i| d[i] - mean)
                .sum::<f64>()
                .powi(2)
        })
        .sum();
    let se = (g / (g - 1.0) * scores).sqrt() / n;
    // t quantile at 0.975 with G - 1 = 7 degrees of freedom (R: qt(0.975, 7)).
    assert_eq!(TEMPLATES, 8);
    let t7 = 2.364_624_251_592_785;
    let (z, z_power) = (1.959963984540054, 0.8416212335729143);
    let pos = d.iter().filter(|&&x| x > 0.0).count() as f64;
    let neg = d.iter().filter(|&&x| x < 0.0).count() as f64;
    // Tango (1998), eq. for the restricted MLE of the share of d = -1 pairs under d0.
    let v = |d0: f64| {
        let w = -pos - neg + (2.0 * n - pos + neg) * d0;
        let q = ((w * w + 8.0 * n * neg * d0 * (1.0 - d0)).sqrt() - w) / (4.0 * n);
        (2.0 * q + d0 * (1.0 - d0)) / n
    };
    let deff = se * se / v(mean);
    let gap = |d0: f64| (mean - d0).powi(2) - t7 * t7 * deff * v(d0);
    // The outermost root between the mean and the edge: scan from the edge, then bisect.
    let bound = |edge: f64| {
        if gap(edge) <= 0.0 {
            return edge;
        }
        let steps = 100_000;
        let (mut out, mut inn) = (edge, mean);
        for k in 1..=steps {
            let x = edge + (mean - edge) * k as f64 / steps as f64;
            if gap(x) <= 0.0 {
                inn = x;
                break;
            }
            out = x;
        }
        for _ in 0..100 {
            let mid = 0.5 * (out + inn);
            if gap(mid) <= 0.0 {
                inn = mid;
            } else {
                out = mid;
            }
        }
        inn
    };
    let (lo, hi) = (bound(-1.0), bound(1.0));
    (mean, se, lo, hi, (z + z_power) * (hi - lo) / (2.0 * z))
}

/// The `overall` row of `compare`'s output, column name -> cell, and its verdict line.
/// Every reading of compare's text output is here, so a change of layout is one edit.
fn overall(out: &str) -> (HashMap<String, String>, String) {
    let cells = |l: &str| -> Vec<String> {
        l.trim()
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_string())
            .collect()
    };
    let header = out
        .lines()
        .find(|l| l.contains("| level"))
        .unwrap_or_else(|| panic!("no table header in:\n{out}"));
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with("| overall"))
        .unwrap_or_else(|| panic!("no overall row in:\n{out}"));
    let map = cells(header).into_iter().zip(cells(row)).collect();
    let verdict = out
        .lines()
        .find_map(|l| l.strip_prefix("overall: "))
        .unwrap_or_else(|| panic!("no verdict line in:\n{out}"))
        .to_string();
    (map, verdict)
}

fn num(row: &HashMap<String, String>, col: &str) -> f64 {
    row.get(col)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("column {col} is not a number: {row:?}"))
}

/// Runs `compare A B` with and without `--require-improvement`, checks the overall
/// difference, interval and MDE against `by_hand`, and returns the verdict and the gate's
/// exit code.
fn compare(a: &Path, b: &Path, pa: &[bool], pb: &[bool]) -> (String, Option<i32>) {
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let o = bin(&["compare", a, b]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let (row, verdict) = overall(&String::from_utf8_lossy(&o.stdout));
    let (mean, se, lo, hi, mde) = by_hand(pa, pb);
    let close = |col: &str, want: f64| {
        let got = num(&row, col);
        assert!(
            (got - want).abs() < 1e-9,
            "{col}: compare says {got}, by hand {want}; {row:?}"
        );
    };
    assert_eq!(num(&row, "n_pairs"), N as f64, "{row:?}");
    assert_eq!(num(&row, "n_unpaired"), 0.0, "{row:?}");
    close("diff", mean);
    close("se", se);
    close("lo", lo);
    close("hi", hi);
    close("mde", mde);
    let gate = bin(&["compare", a, b, "--require-improvement"]);
    (verdict, gate.status.code())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_verdicts_and_gate_on_known_differences() {
    let dir = tempfile::tempdir().unwrap();
    // A passes every fourth case (10 of 40).
    let pa: Vec<bool> = (0..N).map(|i| i % 4 == 0).collect();
    // B passes all but every tenth-from-nine case: d = +1 on 26 cases, 0 elsewhere.
    let pb: Vec<bool> = (0..N).map(|i| i % 10 != 9).collect();
    // C differs from A on three cases in three templates: +1, +1, -1 (mean d = 1/40).
    let pc: Vec<bool> = (0..N)
        .map(|i| match i {
            1 | 6 => true,
            8 => false,
            _ => pa[i],
        })
        .collect();
    let (a, b, c) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    build_run(&a, &pa).await;
    build_run(&b, &pb).await;
    build_run(&c, &pc).await;

    let (mean, _, lo, _, _) = by_hand(&pa, &pb);
    assert!(
        (mean - 0.65).abs() < 1e-12 && lo > 0.0,
        "the design: {mean} {lo}"
    );
    let (verdict, gate) = compare(&a, &b, &pa, &pb);
    assert_eq!(verdict, "B better");
    assert_eq!(gate, Some(0), "a significant improvement ships");

    let (verdict, gate) = compare(&b, &a, &pb, &pa);
    assert_eq!(verdict, "A better");
    assert_eq!(gate, Some(1), "a regression must not ship");

    let (mean, _, lo, hi, mde) = by_hand(&pa, &pc);
    assert!(
        (mean - 0.025).abs() < 1e-12 && lo < 0.0 && hi > 0.0 && mean < mde,
        "the design: {mean} [{lo}, {hi}] mde {mde}"
    );
    let (verdict, gate) = compare(&a, &c, &pa, &pc);
    assert!(
        verdict.starts_with("could not tell") && verdict.contains("MDE"),
        "{verdict}"
    );
    assert_eq!(
        gate,
        Some(1),
        "a difference below the MDE is not an improvement"
    );
}

/// Runs `compare` with `args` and `--format json`, and returns its rows.
fn json_rows(args: &[&str]) -> Vec<serde_json::Value> {
    let mut all = vec!["compare"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--format", "json"]);
    let o = bin(&all);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", text(&o)));
    v.as_array().expect("one JSON array").clone()
}

fn level<'a>(rows: &'a [serde_json::Value], level: &str) -> &'a serde_json::Value {
    rows.iter()
        .find(|r| r["level"] == level)
        .unwrap_or_else(|| panic!("no {level} row in {rows:?}"))
}

/// Provider errors in one run or the other: the means, counts and templates come from the
/// cases scored in both runs, like the difference, and the others are counted as unpaired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_means_cover_the_scored_pairs_only() {
    let dir = tempfile::tempdir().unwrap();
    // None = provider error. Template t4 holds only cases that are unpaired.
    let (p, f) = (Some(true), Some(false));
    let a_out = [p, None, f, p, f, p, None, f];
    let b_out = [p, p, p, None, p, f, p, p];
    let templates: Vec<String> = ["t0", "t4", "t1", "t4", "t2", "t2", "t4", "t3"]
        .iter()
        .map(|t| t.to_string())
        .collect();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    build_run_with(&a, &a_out, &templates, "recorded").await;
    build_run_with(&b, &b_out, &templates, "recorded").await;
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    // Scored in both: cases 0, 2, 4, 5, 7. A scores 1, 0, 0, 1, 0 on them (mean 2/5), B
    // scores 1, 1, 1, 0, 1 (mean 4/5). Cases 1 and 6 (A errors) and 3 (B error) are
    // unpaired. Over every scored case A's mean would be 3/6 and B's 6/7.
    let (mean_a, mean_b) = (2.0 / 5.0, 4.0 / 5.0);
    let rows = json_rows(&[a, b]);
    assert_eq!(rows.len(), 3, "test, capability, overall: {rows:?}");
    for r in &rows {
        assert_eq!(r["n_pairs"], 5, "{r}");
        assert_eq!(r["n_unpaired"], 3, "{r}");
        assert_eq!(r["templates"], 4, "t4 has no pair: {r}");
        let (ma, mb, diff) = (
            r["mean_a"].as_f64().unwrap(),
            r["mean_b"].as_f64().unwrap(),
            r["diff"].as_f64().unwrap(),
        );
        assert!((ma - mean_a).abs() < 1e-12, "mean_a {ma}: {r}");
        assert!((mb - mean_b).abs() < 1e-12, "mean_b {mb}: {r}");
        assert_eq!(mb - ma, diff, "diff is mean_b - mean_a exactly: {r}");
        let (lo, hi, mde) = (
            r["lo"].as_f64().unwrap(),
            r["hi"].as_f64().unwrap(),
            r["mde"].as_f64().unwrap(),
        );
        assert!(lo <= diff && diff <= hi, "{r}");
        let z = 1.959963984540054;
        let want = (z + 0.8416212335729143) * (hi - lo) / (2.0 * z);
        assert!((mde - want).abs() < 1e-12, "mde {mde}, want {want}: {r}");
    }
    assert_eq!(level(&rows, "test")["test"], "label");
    assert_eq!(level(&rows, "capability")["capability"], "Vocabulary");
    // The table shows the same counts, and says what was left out.
    let o = bin(&["compare", a, b]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let (row, _) = overall(&out);
    assert_eq!(num(&row, "n_pairs"), 5.0, "{row:?}");
    assert_eq!(num(&row, "n_unpaired"), 3.0, "{row:?}");
    assert!((num(&row, "mean_a") - mean_a).abs() < 1e-12, "{row:?}");
    assert!(
        out.contains("unpaired: 3 cases scored in one run only"),
        "{out}"
    );
    // Issue 61, item 7: four templates make the interval wide, and the table says so.
    assert!(
        out.contains("few templates: a row over fewer than 5 templates")
            && out.contains("evalflow plan"),
        "{out}"
    );
}

/// Identical runs: no template variance (se 0), but the score interval has a width, and the
/// MDE follows the interval instead of printing 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_mde_follows_the_interval_when_se_is_zero() {
    let dir = tempfile::tempdir().unwrap();
    let pa: Vec<bool> = (0..N).map(|i| i % 3 == 0).collect();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    build_run(&a, &pa).await;
    build_run(&b, &pa).await;
    let rows = json_rows(&[a.to_str().unwrap(), b.to_str().unwrap()]);
    let r = level(&rows, "overall");
    assert_eq!(r["se"].as_f64(), Some(0.0), "{r}");
    assert_eq!(r["diff"].as_f64(), Some(0.0), "{r}");
    let (lo, hi, mde) = (
        r["lo"].as_f64().unwrap(),
        r["hi"].as_f64().unwrap(),
        r["mde"].as_f64().unwrap(),
    );
    assert!(hi - lo > 0.01, "{r}");
    assert!(
        mde > (hi - lo) / 2.0,
        "the MDE {mde} is wider than the interval: {r}"
    );
    assert!(
        r["verdict"].as_str().unwrap().starts_with("no difference"),
        "{r}"
    );
}

/// `--format json|csv` and `--output`: one array of row objects with the documented fields
/// in every row; csv has the same columns; `--output` writes the file and prints nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_formats_and_output_file() {
    let dir = tempfile::tempdir().unwrap();
    let pa: Vec<bool> = (0..N).map(|i| i % 4 == 0).collect();
    let pb: Vec<bool> = (0..N).map(|i| i % 10 != 9).collect();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    build_run(&a, &pa).await;
    build_run(&b, &pb).await;
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let fields = [
        "level",
        "capability",
        "test",
        "n_pairs",
        "n_unpaired",
        "mean_a",
        "mean_b",
        "diff",
        "se",
        "lo",
        "hi",
        "templates",
        "mde",
        "method",
        "verdict",
    ];
    let rows = json_rows(&[a, b]);
    let levels: Vec<&str> = rows.iter().map(|r| r["level"].as_str().unwrap()).collect();
    assert_eq!(levels, ["capability", "test", "overall"]);
    for r in &rows {
        for f in fields {
            assert!(r.get(f).is_some(), "field {f} missing: {r}");
        }
    }
    let o = level(&rows, "overall");
    assert_eq!(o["n_pairs"], 40);
    assert_eq!(o["templates"], 8);
    assert_eq!(o["mean_a"].as_f64(), Some(0.25));
    assert_eq!(o["mean_b"].as_f64(), Some(0.9));
    assert!((o["diff"].as_f64().unwrap() - 0.65).abs() < 1e-12, "{o}");
    assert_eq!(o["method"], "cr2_score");
    assert_eq!(o["verdict"], "B better");
    assert_eq!(o["capability"], "(all)");

    let csv = bin(&["compare", a, b, "--format", "csv"]);
    assert_eq!(csv.status.code(), Some(0), "{}", text(&csv));
    let csv = String::from_utf8(csv.stdout).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(&header[..fields.len()], &fields[..], "{csv}");
    assert_eq!(lines.count(), 3, "{csv}");

    let file = dir.path().join("cmp.json");
    let o = bin(&[
        "compare",
        a,
        b,
        "--format",
        "json",
        "--output",
        file.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(o.stdout.is_empty(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 3);
    assert!(!dir.path().join("cmp.json.tmp").exists());
    // The gate still applies with a file: B better, A as the candidate is not.
    let o = bin(&[
        "compare",
        b,
        a,
        "--require-improvement",
        "--output",
        file.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let t = std::fs::read_to_string(&file).unwrap();
    assert!(t.contains("overall: A better"), "{t}");
}

/// `compare RUN --model-a A --model-b B`: two models of one run, paired on the cases both
/// answered; the cases only model A answered are unpaired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_two_models_of_one_run() {
    use evalflow::schema::Table;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("two");
    let store = RunStore::open(root.to_str().unwrap()).unwrap();
    let pipeline = |model: &str| {
        evalflow::pipeline::Pipeline::parse(
            &PIPELINE.replace("name = \"recorded\"", &format!("name = \"{model}\"")),
            Path::new("paired.toml"),
        )
        .unwrap()
    };
    let (p1, p2) = (pipeline("m1"), pipeline("m2"));
    // m1 answers all 8 cases, m2 the first 6; case i in template i % 3.
    let m1 = [true, false, true, false, true, false, true, false];
    let m2 = [true, true, true, true, false, false];
    let case = |i: usize| Case {
        case_id: format!("case{i:02}"),
        suite: "paired".into(),
        test: "label".into(),
        capability: "Vocabulary".into(),
        test_type: "MFT".into(),
        template_id: format!("t{}", i % 3),
        group_id: format!("case{i:02}"),
        role: "single".into(),
        input: format!("Sentence number {i} is good."),
        expected: Some("positive".into()),
        expectation: None,
        tolerance: None,
        perturbation: None,
    };
    let call = |model: &str, i: usize, ok: bool| CallRow {
        req: CallRequest {
            call_id: format!("{model}-call{i:02}"),
            case_id: format!("case{i:02}"),
            input: String::new(),
            prompt: String::new(),
            system: None,
            sample_idx: 0,
            max_tokens: None,
            temperature: None,
            request_hash: format!("{model}-req{i:02}"),
            prior_attempts: 0,
        },
        res: CallResult {
            response: Some(if ok { "positive" } else { "negative" }.into()),
            finish_reason: Some("stop".into()),
            attempts: 1,
            ..Default::default()
        },
        latency_ms: 1.0,
        started_at_us: 1_700_000_000_000_000,
    };
    let cases: Vec<Case> = (0..m1.len()).map(case).collect();
    let calls1: Vec<CallRow> = m1
        .iter()
        .enumerate()
        .map(|(i, &ok)| call("m1", i, ok))
        .collect();
    let calls2: Vec<CallRow> = m2
        .iter()
        .enumerate()
        .map(|(i, &ok)| call("m2", i, ok))
        .collect();
    let mut w = store.part_writer("cases", Table::Cases.schema(), "part");
    w.write(evalflow::stages::generate::to_batch(&cases))
        .await
        .unwrap();
    w.finish().await.unwrap();
    let mut w = store.part_writer("calls", Table::Calls.schema(), "part");
    w.write(evalflow::stages::call::to_batch(&p1.model, &calls1))
        .await
        .unwrap();
    w.write(evalflow::stages::call::to_batch(&p2.model, &calls2))
        .await
        .unwrap();
    w.finish().await.unwrap();
    let mut m = evalflow::storage::Manifest {
        run_id: "two".into(),
        evalflow_version: "test".into(),
        pipeline_path: p1.path.display().to_string(),
        pipeline_hash: p1.hash(),
        pipeline: serde_json::to_value(&p1).unwrap(),
        created_at: "2026-11-30T00:00:00Z".into(),
        finished_at: None,
        stages: Default::default(),
        row_counts: Default::default(),
        scorer_versions: vec![],
        validator_version: None,
    };
    m.complete("generate", "cases", 8, Default::default());
    m.complete("call", "calls", 14, Default::default());
    m.save(&store).await.unwrap();
    evalflow::stages::validate::run(&store, &["en".into()])
        .await
        .unwrap();
    m.complete("validate", "validity", 14, Default::default());
    let scorer = evalflow::stages::score::build("checklist", None).unwrap();
    evalflow::stages::score::run(&store, scorer.as_ref())
        .await
        .unwrap();
    m.scorer_versions.push("checklist@1".into());
    m.save(&store).await.unwrap();

    let r = root.to_str().unwrap();
    // Shared cases 0..5: m1 passes 0, 2, 4 (mean 1/2), m2 passes 0..3 (mean 2/3).
    let rows = json_rows(&[r, "--model-a", "m1", "--model-b", "m2"]);
    let o = level(&rows, "overall");
    assert_eq!(o["n_pairs"], 6, "{o}");
    assert_eq!(o["n_unpaired"], 2, "{o}");
    assert_eq!(o["templates"], 3, "{o}");
    let (ma, mb) = (o["mean_a"].as_f64().unwrap(), o["mean_b"].as_f64().unwrap());
    assert!(
        (ma - 0.5).abs() < 1e-12 && (mb - 2.0 / 3.0).abs() < 1e-12,
        "{o}"
    );
    assert_eq!(o["diff"].as_f64().unwrap(), mb - ma, "{o}");
    let t = bin(&["compare", r, "--model-a", "m1", "--model-b", "m2"]);
    let out = String::from_utf8_lossy(&t.stdout);
    assert!(out.contains(&format!("A = {r} (model m1)")), "{out}");
    // Bad usage: an unknown model names the run's models; no RUN_B and no models.
    let o = bin(&["compare", r, "--model-a", "m1", "--model-b", "m3"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("m1, m2"), "{}", text(&o));
    assert!(o.stdout.is_empty(), "{}", text(&o));
    let o = bin(&["compare", r]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}
