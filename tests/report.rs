//! The HTML report, checked in a real browser: headless Chromium loads the page of the
//! sentiment run (and a `--compare` page of two runs), and the test reads what it rendered
//! (`--dump-dom`) and what it drew (`--screenshot`). Chromium is required: CI installs
//! Debian's `chromium` (`.ci/run`), and a machine without it fails here with a message
//! saying so rather than skipping.
//!
//! The page's numbers are also checked against the `results` table itself: every results
//! row is on the page, with the same values in its `data-*` attributes.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

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
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The Chromium binary; panics (fails the test) when there is none.
fn chromium() -> PathBuf {
    for name in ["chromium", "chromium-browser"] {
        if let Ok(o) = Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
            && o.status.success()
        {
            return PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
        }
    }
    panic!(
        "chromium is not installed: the report tests render the page in headless Chromium. \
         Install it with `apt-get install -y chromium` (.ci/run does this)."
    );
}

/// Runs headless Chromium on `page` with `extra` arguments, offline and with a throwaway
/// profile.
fn headless(page: &Path, extra: &[&str]) -> Output {
    let profile = tempfile::tempdir().unwrap();
    let url = format!("file://{}", page.canonicalize().unwrap().display());
    let o = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(&url)
        .output()
        .unwrap();
    assert!(o.status.success(), "chromium: {}", text(&o));
    o
}

/// The DOM Chromium builds from `page`.
fn dump_dom(page: &Path) -> String {
    String::from_utf8(headless(page, &["--dump-dom"]).stdout).unwrap()
}

/// Text as Chromium serialises it in element content.
fn dom_text(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Text as Chromium serialises it in an attribute value.
fn dom_attr(s: &str) -> String {
    s.replace('&', "&amp;").replace('"', "&quot;")
}

/// The `<tr ...>...</tr>` of the results row with these attributes.
fn row<'a>(dom: &'a str, test: &str, level: &str, test_type: &str) -> &'a str {
    let key = format!(
        "data-test=\"{}\" data-level=\"{level}\" data-capability=",
        dom_attr(test)
    );
    for (at, _) in dom.match_indices(&key) {
        let end = at + dom[at..].find("</tr>").unwrap();
        let tr = &dom[at..end];
        if tr.contains(&format!("data-test-type=\"{test_type}\"")) {
            return tr;
        }
    }
    panic!("no {level} row for {test} ({test_type}) in the page");
}

/// `(name, type, rate, interval)` of each row of a text table of `evalflow run`, from the
/// line after `title` to the next blank line; the columns are found by their headers.
fn text_rows(out: &str, title: &str) -> Vec<(String, String, String, String)> {
    let cells = |l: &str| -> Vec<String> {
        l.split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(String::from)
            .collect()
    };
    let mut lines = out.lines().skip_while(|l| !l.starts_with(title)).skip(1);
    let header = cells(lines.next().unwrap_or_default());
    let col = |name: &str| {
        header
            .iter()
            .position(|h| h == name)
            .unwrap_or_else(|| panic!("no `{name}` column in {header:?}"))
    };
    let (ty, rate, ci) = (col("type"), col("fail rate"), col("95% CI"));
    let mut rows = Vec::new();
    for l in lines.skip(1) {
        if l.trim().is_empty() {
            break;
        }
        let c = cells(l);
        rows.push((c[0].clone(), c[ty].clone(), c[rate].clone(), c[ci].clone()));
    }
    rows
}

/// The page loads nothing: no `src`/`href` attribute, no CSS `url(` or `@import`, and no
/// `http://` or `https://` except the SVG namespace.
fn assert_offline(html: &str) {
    for bad in [" src=", " href=", "url(", "@import"] {
        assert!(!html.contains(bad), "the page references `{bad}`");
    }
    let rest = html.replace("xmlns=\"http://www.w3.org/2000/svg\"", "");
    assert!(
        !rest.contains("http://") && !rest.contains("https://"),
        "the page names a URL: {}",
        &rest[rest.find("http").unwrap()..][..80]
    );
}

/// Decodes a PNG (with `scripts/png_spread.py`, standard-library Python) and returns the
/// standard deviation of its luminance and the share of pixels that are not white.
fn pixel_spread(png_path: &Path) -> (f64, f64) {
    let o = Command::new("python3")
        .arg("scripts/png_spread.py")
        .arg(png_path)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("python3 runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let f: Vec<f64> = out.split_whitespace().map(|x| x.parse().unwrap()).collect();
    assert_eq!((f[0], f[1]), (1280.0, 2000.0), "screenshot size");
    (f[2], f[3])
}

fn sentiment_run(root: &Path) -> String {
    ok(&[
        "run",
        "pipelines/sentiment.toml",
        "--out",
        root.to_str().unwrap(),
    ])
}

/// The page written by `evalflow run` holds every test and the headline numbers the run
/// printed, renders in Chromium, draws something, and loads nothing from the network.
#[test]
fn sentiment_page_in_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("a");
    let out = sentiment_run(&root);
    let page = root.join("report.html");
    assert!(
        out.contains(&format!("report: {}", page.display())),
        "{out}"
    );
    let html = std::fs::read_to_string(&page).unwrap();
    assert_offline(&html);
    assert!(html.len() < 2_000_000, "page of {} bytes", html.len());

    let dom = dump_dom(&page);
    assert!(dom.contains("evalflow report: run a"), "header");
    assert!(
        dom.contains("id=\"validity\"") && dom.contains("<svg"),
        "plots"
    );
    assert!(
        !dom.contains("id=\"incomplete\""),
        "a complete run has no banner"
    );

    let caps = text_rows(&out, "Capability x test type");
    let tests = text_rows(&out, "Per test");
    assert!(caps.len() >= 10 && tests.len() >= 30, "{out}");
    for (name, ty, rate, ci) in &caps {
        let tr = row(&dom, name, "capability", ty);
        assert!(
            tr.contains(&format!(">{rate}<")),
            "{name} {ty}: {rate} not in {tr}"
        );
        assert!(
            tr.contains(&format!(">{ci}<")),
            "{name} {ty}: {ci} not in {tr}"
        );
    }
    for (name, ty, rate, ci) in &tests {
        assert!(dom.contains(&dom_text(name)), "test {name} missing");
        let tr = row(&dom, name, "test", ty);
        assert!(
            tr.contains(&format!(">{rate}<")),
            "{name}: {rate} not in {tr}"
        );
        assert!(tr.contains(&format!(">{ci}<")), "{name}: {ci} not in {tr}");
    }
    // Failure examples, with the base and perturbed pair of an INV test.
    assert!(dom.contains("failures in Neither nor"), "MFT examples");
    assert!(dom.contains("<b>base:</b>") && dom.contains("<b>perturbed:</b>"));

    let png = dir.path().join("shot.png");
    headless(
        &page,
        &[
            &format!("--screenshot={}", png.display()),
            "--window-size=1280,2000",
            "--hide-scrollbars",
        ],
    );
    let (sd, ink) = pixel_spread(&png);
    assert!(
        sd > 20.0 && ink > 0.03,
        "blank screenshot: sd {sd}, ink {ink}"
    );
}

/// `report RUN --compare RUN_B --html FILE`: the comparison section with every capability,
/// the MDE band and the verdict `evalflow compare` prints.
#[test]
fn compare_page_in_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    sentiment_run(&a);
    sentiment_run(&b);
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let page = dir.path().join("cmp.html");
    let out = ok(&[
        "report",
        a,
        "--compare",
        b,
        "--html",
        page.to_str().unwrap(),
    ]);
    assert!(
        out.contains(&format!("report: {}", page.display())),
        "{out}"
    );
    let html = std::fs::read_to_string(&page).unwrap();
    assert_offline(&html);
    let cmp = ok(&["compare", a, b]);
    let verdict = cmp
        .lines()
        .find_map(|l| l.strip_prefix("overall: "))
        .unwrap();
    let dom = dump_dom(&page);
    assert!(dom.contains("id=\"compare\""), "no comparison section");
    assert!(
        dom.contains(&format!("<b>{}</b>", dom_text(verdict))),
        "verdict {verdict}"
    );
    for cap in [
        "Vocabulary",
        "Negation",
        "NER",
        "Robustness",
        "Temporal",
        "Fairness",
        "Coreference",
        "SRL",
        "Logic",
    ] {
        assert!(
            dom.contains(&format!(
                "data-scope=\"capability\" data-capability=\"{cap}\""
            )),
            "{cap}"
        );
    }
    for (name, ..) in text_rows(&ok(&["report", a]), "Per test") {
        assert!(dom.contains(&dom_text(&name)), "{name}");
    }
    let png = dir.path().join("cmp.png");
    headless(
        &page,
        &[
            &format!("--screenshot={}", png.display()),
            "--window-size=1280,2000",
        ],
    );
    let (sd, ink) = pixel_spread(&png);
    assert!(
        sd > 20.0 && ink > 0.03,
        "blank screenshot: sd {sd}, ink {ink}"
    );
}

/// Every `results` row is on the page with the same numbers (the page and the text output
/// are made from the same rows; this reads the table back through SQL).
#[test]
fn page_numbers_are_the_results_rows() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("a");
    sentiment_run(&root);
    let html = std::fs::read_to_string(root.join("report.html")).unwrap();
    let o = bin(&[
        "sql",
        "SELECT level, capability, test_type, coalesce(test, capability) AS name, model, n, hits, value, se, \
         ci_lo, ci_hi, ci_method, n_templates FROM results",
        "--run",
        root.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
    let page_rows: Vec<BTreeMap<String, String>> = html
        .split("<tr class=\"r")
        .skip(1)
        .filter(|t| t.contains("data-level="))
        .map(|t| {
            let head = &t[..t.find('>').unwrap()];
            head.split("\" ")
                .filter_map(|kv| {
                    let (k, v) = kv.split_once("=\"")?;
                    Some((
                        k.trim().trim_start_matches("data-").to_string(),
                        v.trim_end_matches('"')
                            .replace("&#39;", "'")
                            .replace("&quot;", "\"")
                            .replace("&lt;", "<")
                            .replace("&gt;", ">")
                            .replace("&amp;", "&"),
                    ))
                })
                .collect()
        })
        .collect();
    assert_eq!(page_rows.len(), rows.len(), "one page row per results row");
    let f = |v: &serde_json::Value| v.as_f64();
    for r in &rows {
        let s = |k: &str| r[k].as_str().unwrap_or_default().to_string();
        let p = page_rows
            .iter()
            .find(|p| {
                p["level"] == s("level")
                    && p["capability"] == s("capability")
                    && p["test-type"] == s("test_type")
                    && p["test"] == s("name")
                    && p["model"] == s("model")
            })
            .unwrap_or_else(|| panic!("results row {r} is not on the page"));
        assert_eq!(p["n"], r["n"].to_string(), "{r}");
        assert_eq!(p["hits"], r["hits"].to_string(), "{r}");
        assert_eq!(p["n-templates"], r["n_templates"].to_string(), "{r}");
        assert_eq!(p["ci-method"], s("ci_method"), "{r}");
        for (k, c) in [
            ("value", "value"),
            ("se", "se"),
            ("ci-lo", "ci_lo"),
            ("ci-hi", "ci_hi"),
        ] {
            let page: Option<f64> = p[k].parse().ok();
            match (page, f(&r[c])) {
                (Some(a), Some(b)) => {
                    assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "{k}: {a} vs {b}")
                }
                (None, None) => {}
                (a, b) => panic!("{k}: page {a:?} vs results {b:?} in {r}"),
            }
        }
    }
}

const RECORDED: &str = r#"
[model]
provider = "builtin:vader"
name = "recorded"
[suite]
name = "synthetic"
"#;

/// Writes a run of `n_tests` MFT tests (two templates, `per_test` cases each) straight into
/// the tables, validates and scores it; every third answer fails. Test names and inputs
/// carry markup so that escaping is exercised.
async fn synthetic_run(root: &Path, n_tests: usize, per_test: usize) {
    let store = RunStore::open(root.to_str().unwrap()).unwrap();
    let p = evalflow::pipeline::Pipeline::parse(RECORDED, Path::new("recorded.toml")).unwrap();
    let mut cases = Vec::new();
    let mut calls = Vec::new();
    for t in 0..n_tests {
        for j in 0..per_test {
            let i = cases.len();
            cases.push(Case {
                case_id: format!("case{i:07}"),
                suite: "synthetic".into(),
                test: format!("test {t:05} <b>&amp;</b>"),
                capability: format!("Capability {}", t % 12),
                test_type: "MFT".into(),
                template_id: format!("t{t}-{}", j % 2),
                group_id: format!("case{i:07}"),
                role: "single".into(),
                input: format!("<script>alert({i})</script> case {i}"),
                expected: Some("positive".into()),
                expectation: None,
                tolerance: None,
                perturbation: None,
            });
            let answer = if (i + t) % 3 == 0 {
                "negative"
            } else {
                "positive"
            };
            calls.push(CallRow {
                req: CallRequest {
                    call_id: format!("call{i:07}"),
                    case_id: format!("case{i:07}"),
                    input: String::new(),
                    prompt: String::new(),
                    system: None,
                    sample_idx: 0,
                    max_tokens: Some(600),
                    temperature: None,
                    request_hash: format!("req{i:07}"),
                    prior_attempts: 0,
                },
                res: CallResult {
                    response: Some(answer.into()),
                    finish_reason: Some("stop".into()),
                    http_status: Some(200),
                    attempts: 1,
                    ..Default::default()
                },
                latency_ms: 5.0 + (i % 200) as f64,
                started_at_us: 1_700_000_000_000_000,
            });
        }
    }
    common::write_validated_run(&store, &p, "synthetic", &cases, &calls, &p.languages()).await;
    ok(&["rescore", root.to_str().unwrap(), "--scorer", "checklist"]);
}

/// User text cannot inject markup, and a run whose stages did not all finish gets the red
/// banner.
#[tokio::test(flavor = "multi_thread")]
async fn user_text_is_escaped_and_an_incomplete_run_is_flagged() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("syn");
    synthetic_run(&root, 30, 4).await;
    let r = root.to_str().unwrap();
    ok(&["report", r]);
    let page = root.join("report.html");
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(!html.contains("<script>alert"), "unescaped input");
    assert!(html.contains("&lt;script&gt;alert("), "escaped input shown");
    assert!(!html.contains("<b>&amp;</b>"), "unescaped test name");
    assert_eq!(
        html.matches("<script>").count(),
        1,
        "only the page's own script"
    );
    assert_offline(&html);
    let dom = dump_dom(&page);
    assert!(
        dom.contains("id=\"incomplete\""),
        "no banner for an incomplete run"
    );
    assert!(dom.contains("stage `aggregate` never ran"));
    assert!(dom.contains(&dom_text("test 00029 <b>&amp;</b>")));
}

/// Size and render time of the page of a 10,000-test run (run by hand:
/// `cargo test --test report -- --ignored --nocapture`).
#[tokio::test(flavor = "multi_thread")]
#[ignore]
async fn ten_thousand_tests() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("big");
    synthetic_run(&root, 10_000, 4).await;
    let r = root.to_str().unwrap();
    let t = Instant::now();
    ok(&["report", r]);
    let build = t.elapsed();
    let page = root.join("report.html");
    let bytes = std::fs::metadata(&page).unwrap().len();
    // Chromium's own start-up, measured on an empty page, is subtracted.
    let empty = dir.path().join("empty.html");
    std::fs::write(&empty, "<!DOCTYPE html><html><body></body></html>").unwrap();
    let time = |p: &Path| {
        let t = Instant::now();
        let dom = dump_dom(p);
        (t.elapsed().as_secs_f64(), dom)
    };
    let (e, _) = time(&empty);
    let (full, dom) = time(&page);
    // The page records when its load event fired (parse, style, scripts), in ms.
    let load_ms = dom
        .split("data-load-ms=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap_or("?")
        .to_string();
    let shot = dir.path().join("big.png");
    let t = Instant::now();
    headless(
        &page,
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1280,2000",
        ],
    );
    let paint = t.elapsed().as_secs_f64();
    println!(
        "10,000 tests: page {:.1} MB, built in {:.1} s (evalflow report, debug build); load event at {load_ms} ms; \
         Chromium screenshot {paint:.2} s and load + DOM dump {full:.2} s, vs {e:.2} s for an empty page's DOM dump",
        bytes as f64 / 1e6,
        build.as_secs_f64(),
    );
    if let Ok(keep) = std::env::var("REPORT_10K_COPY") {
        std::fs::copy(&page, keep).unwrap();
    }
    assert!(bytes < 50_000_000);
}

/// With `--judge-model`, the page holds the GBDT's predictions with their conformal intervals,
/// the same numbers as `evalflow judge predict` on the same run, and a unit's SHAP waterfall.
#[test]
fn judge_section_matches_judge_predict() {
    let dir = tempfile::tempdir().unwrap();
    let d = |p: &str| dir.path().join(p).display().to_string();
    let root = dir.path().join("run");
    sentiment_run(&root);
    ok(&["judge", "synth", "--out", &d("synth"), "--units", "80"]);
    // The judge's answers sit in the run's scores beside the checklist's.
    let folder = root.join("scores/judge-synth@1");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(
        dir.path().join("synth/scores/part-00000.parquet"),
        folder.join("part-00000.parquet"),
    )
    .unwrap();
    let r = root.display().to_string();
    ok(&[
        "judge",
        "train",
        "--scores",
        &r,
        "--scorer",
        "judge-synth",
        "--labels",
        &d("synth/labels.csv"),
        "--out",
        &d("model"),
        "--grid",
        "small",
    ]);
    ok(&[
        "judge",
        "predict",
        "--model",
        &d("model"),
        "--scores",
        &r,
        "--scorer",
        "judge-synth",
        "--out",
        &d("pred.parquet"),
    ]);
    let page = dir.path().join("page.html");
    ok(&[
        "report",
        &r,
        "--judge-model",
        &d("model"),
        "--judge-scorer",
        "judge-synth",
        "--judge-unit",
        "u0003",
        "--html",
        page.to_str().unwrap(),
    ]);
    let html = std::fs::read_to_string(&page).unwrap();
    assert_offline(&html);
    assert!(html.contains("<section id=\"judge\">"), "no judge section");
    assert!(html.contains("Why unit u0003 got its prediction"));
    assert!(html.contains("E[f(X)]"), "the waterfall is drawn");
    // Every prediction row on the page is `judge predict`'s row for that observation.
    let o = bin(&[
        "sql",
        "SELECT unit, judge, trial, prediction, lo, hi FROM p ORDER BY unit, judge, trial",
        "--table",
        &format!("p={}", d("pred.parquet")),
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let want: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let want: std::collections::HashSet<String> = want
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            format!(
                "data-unit=\"{}\" data-prediction=\"{}\" data-lo=\"{}\" data-hi=\"{}\"",
                w["unit"].as_str().unwrap(),
                w["prediction"].as_f64().unwrap(),
                w["lo"].as_f64().unwrap(),
                w["hi"].as_f64().unwrap()
            )
        })
        .collect();
    let listed: Vec<&str> = html
        .match_indices("data-unit=\"")
        .map(|(i, _)| {
            let rest = &html[i..];
            &rest[..rest.find('>').unwrap()]
        })
        .filter(|a| a.contains("data-prediction="))
        .collect();
    assert!(listed.len() >= 10, "{} prediction rows", listed.len());
    for a in &listed {
        assert!(want.contains(*a), "not a `judge predict` row: {a}");
    }
    let dom = dump_dom(&page);
    assert!(dom.contains("Judge: learned aggregation of the checklist"));
}

/// The examples row says how many failures it shows of how many, in the right number
/// ("3 of 120 failures", "1 failure"), never "3 failures" of a test that failed 120 times.
#[test]
fn example_summaries_count_shown_of_total() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("a");
    sentiment_run(&root);
    let html = std::fs::read_to_string(root.join("report.html")).unwrap();
    // From the run's table: 120 of 120 failed, and 1 of 120.
    assert!(
        html.contains("<summary>3 of 120 failures in Negation of negative at the end</summary>"),
        "many failures"
    );
    assert!(
        html.contains("<summary>1 failure in Add irrelevant handles and links</summary>"),
        "one failure"
    );
    assert!(!html.contains("1 failures"));
}

/// An imported run's page says its generate and call stages were imported (not run by
/// evalflow), and draws no latency chart for calls that recorded none.
#[test]
fn imported_run_page_says_imported_and_draws_no_empty_latency() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pairs.jsonl");
    let line = |q: &str, a: &str| {
        format!(
            "{{\"request\": {{\"model\": \"m\", \"messages\": [{{\"role\": \"user\", \"content\": \"{q}\"}}]}}, \
             \"response\": {{\"choices\": [{{\"message\": {{\"role\": \"assistant\", \"content\": \"{a}\"}}, \"finish_reason\": \"stop\"}}]}}, \
             \"expected\": \"positive\"}}\n"
        )
    };
    std::fs::write(
        &file,
        line("It is good.", "positive") + &line("It is bad.", "negative"),
    )
    .unwrap();
    let root = dir.path().join("imp");
    let r = root.to_str().unwrap();
    ok(&["import", file.to_str().unwrap(), "--out", r]);
    let p = root.join("import.toml");
    let p = p.to_str().unwrap();
    ok(&["validate", p, "--out", r]);
    ok(&["score", p, "--out", r]);
    ok(&["report", r]);
    let html = std::fs::read_to_string(root.join("report.html")).unwrap();
    assert!(
        html.contains("generate imported, call imported, validate complete"),
        "stages"
    );
    assert!(html.contains("no latency recorded"), "no latency chart");
}
