//! Malformed input, walked through every user-facing file: the pipeline, a lexicon, source
//! datasets (CSV, JSONL, Parquet), import corpora (JSONL, Parquet), holdout labels, the two
//! baseline files, the manifest and the run's own parts. Each is truncated, mistyped, made
//! invalid UTF-8 and stripped of a field. Every time: no panic, exit code 2, a message
//! naming the file and a position (line, row or the part of the file), and the run root
//! byte-identical afterwards.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "common/moto.rs"]
mod moto;

use sha2::{Digest, Sha256};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_evalflow"))
}

fn run_in(dir: &Path, args: &[&str]) -> Output {
    bin()
        .args(args)
        .current_dir(dir)
        .env("EVALFLOW_CACHE_DIR", "off")
        .output()
        .expect("evalflow runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn write(dir: &Path, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
    let p = dir.join(name);
    if let Some(d) = p.parent() {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Runs a pyarrow script with `sys.argv[1:] = args` (pyarrow is a test requirement).
fn py(script: &str, args: &[&str]) {
    let o = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 runs (python3 -m pip install pyarrow)");
    assert!(o.status.success(), "python failed: {}", stderr(&o));
}

/// SHA-256 of every file under `root`, by relative path.
fn tree(root: &Path) -> BTreeMap<String, String> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                let rel = p.strip_prefix(base).unwrap().display().to_string();
                out.insert(rel, hex::encode(Sha256::digest(std::fs::read(&p).unwrap())));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// The 1-based line of the first occurrence of `needle` in `text`.
fn line_of(text: &str, needle: &str) -> usize {
    let i = text
        .find(needle)
        .unwrap_or_else(|| panic!("`{needle}` not in text"));
    text[..i].matches('\n').count() + 1
}

/// Asserts exit code 2, no panic, the file named and `position` in the message.
fn assert_bad(o: &Output, what: &str, file: &str, position: &str) -> String {
    let e = stderr(o);
    assert!(
        !e.contains("panicked"),
        "{what}: panicked instead of failing clearly:\n{e}"
    );
    assert_eq!(o.status.code(), Some(2), "{what}: exit code; stderr:\n{e}");
    assert!(
        e.contains(file),
        "{what}: the message must name `{file}`:\n{e}"
    );
    assert!(
        e.contains(position),
        "{what}: the message must give the position `{position}`:\n{e}"
    );
    e
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

/// A completed run of [`MINIMAL`] at `<dir>/root`, its pipeline at `<dir>/good.toml`.
fn good_run(dir: &Path) -> (PathBuf, PathBuf) {
    let good = write(dir, "good.toml", MINIMAL);
    let root = dir.join("root");
    let o = run_in(
        dir,
        &[
            "run",
            good.to_str().unwrap(),
            "--out",
            root.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "good run: {}", stderr(&o));
    (good, root)
}

#[test]
fn pipeline_toml() {
    let d = tempfile::tempdir().unwrap();
    let (_, root) = good_run(d.path());
    let r = root.to_str().unwrap();
    let before = tree(&root);
    let cut = MINIMAL.find("{adj}").unwrap();
    let judge = "\n[score]\nscorers = [\"judge\"]\n\n[score.judge]\nquestions = []\n\n[judge]\nprovider = \"openai\"\nname = \"j\"\n";
    let mut invalid_utf8 = MINIMAL.as_bytes().to_vec();
    let at = MINIMAL.find("mini").unwrap();
    invalid_utf8.splice(at..at, [0xff, 0xfe]);
    let cases: Vec<(&str, Vec<u8>, usize)> = vec![
        (
            "truncated",
            MINIMAL.as_bytes()[..cut].to_vec(),
            line_of(MINIMAL, "{adj}"),
        ),
        (
            "wrong type",
            MINIMAL
                .replace("name = \"vader\"", "name = \"vader\"\nsamples = \"two\"")
                .into_bytes(),
            5,
        ),
        ("invalid UTF-8", invalid_utf8, line_of(MINIMAL, "mini")),
        (
            "missing field",
            MINIMAL.replace("name = \"vader\"\n", "").into_bytes(),
            line_of(MINIMAL, "[model]"),
        ),
        (
            "empty scorers",
            format!("{MINIMAL}\n[score]\nscorers = []\n").into_bytes(),
            line_of(MINIMAL, "expected = ") + 3,
        ),
        (
            "empty judge questions",
            format!("{MINIMAL}{judge}").into_bytes(),
            line_of(&format!("{MINIMAL}{judge}"), "questions"),
        ),
        (
            "unknown judge provider",
            format!("{MINIMAL}\n[judge]\nprovider = \"opnai\"\nname = \"j\"\n").into_bytes(),
            line_of(MINIMAL, "expected = ") + 3,
        ),
        (
            "rephrase with no samples",
            format!("{MINIMAL}\n[rephrase]\nprovider = \"openai\"\nname = \"r\"\nsamples = 0\n")
                .into_bytes(),
            line_of(MINIMAL, "expected = ") + 5,
        ),
    ];
    for (what, bytes, line) in cases {
        let p = write(d.path(), "bad.toml", &bytes);
        let o = run_in(d.path(), &["run", p.to_str().unwrap(), "--out", r]);
        assert_bad(&o, what, "bad.toml", &format!("bad.toml:{line}:"));
        assert_eq!(tree(&root), before, "{what}: the run root changed");
    }
    // The messages name the field.
    let p = write(
        d.path(),
        "bad.toml",
        format!("{MINIMAL}\n[score]\nscorers = []\n"),
    );
    let o = run_in(d.path(), &["run", p.to_str().unwrap(), "--out", r]);
    assert!(
        stderr(&o).contains("field `score.scorers`"),
        "{}",
        stderr(&o)
    );
    let p = write(d.path(), "bad.toml", format!("{MINIMAL}{judge}"));
    let o = run_in(d.path(), &["score", p.to_str().unwrap(), "--out", r]);
    assert!(
        stderr(&o).contains("field `score.judge.questions`"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn lexicon_files() {
    let d = tempfile::tempdir().unwrap();
    let (_, root) = good_run(d.path());
    let r = root.to_str().unwrap();
    let before = tree(&root);
    let pipeline = MINIMAL.replace(
        "name = \"mini\"",
        "name = \"mini\"\ninclude = [\"lex.toml\"]",
    );
    let pipeline = pipeline.replace("adj = [\"good\", \"bad\"]", "");
    let p = write(d.path(), "lexpipe.toml", &pipeline);
    let good_lex = "[lexicons]\nbad_adj = [\"awful\"]\nadj = [\"good\", \"bad\"]\n";
    let mut invalid = good_lex.as_bytes().to_vec();
    let at = good_lex.find("awful").unwrap();
    invalid.splice(at..at, [0xc3, 0x28]);
    let cases: Vec<(&str, Vec<u8>, usize)> = vec![
        ("truncated", good_lex[..good_lex.len() - 8].into(), 3),
        (
            "wrong type",
            good_lex
                .replace("[\"good\", \"bad\"]", "\"good\"")
                .into_bytes(),
            3,
        ),
        ("invalid UTF-8", invalid, 2),
        // An empty lexicon whose name ends another's (`bad_adj =` contains `adj =`): the
        // error must point at its own line, found by the parser, not by a text search.
        (
            "empty lexicon",
            good_lex.replace("[\"good\", \"bad\"]", "[]").into_bytes(),
            3,
        ),
    ];
    for (what, bytes, line) in cases {
        write(d.path(), "lex.toml", &bytes);
        let o = run_in(d.path(), &["run", p.to_str().unwrap(), "--out", r]);
        assert_bad(&o, what, "lex.toml", &format!("lex.toml:{line}:"));
        assert_eq!(tree(&root), before, "{what}: the run root changed");
    }
    // The same in the pipeline's own [lexicons].
    let own = MINIMAL.replace(
        "adj = [\"good\", \"bad\"]",
        "bad_adj = [\"awful\"]\nadj = []",
    );
    let p = write(d.path(), "own.toml", &own);
    let o = run_in(d.path(), &["run", p.to_str().unwrap(), "--out", r]);
    let e = assert_bad(
        &o,
        "empty own lexicon",
        "own.toml",
        &format!("own.toml:{}:", line_of(&own, "adj = []")),
    );
    assert!(e.contains("field `lexicons.adj`"), "{e}");
}

const SOURCE_TEST: &str = r#"
[[test]]
name = "from data"
capability = "Robustness"
type = "INV"
source = { file = "SOURCE", column = "text" }
perturb = "typos"
"#;

/// The pipeline of the source walk: one INV test over `file`.
fn source_pipeline(dir: &Path, file: &str) -> PathBuf {
    let text = format!("{MINIMAL}{}", SOURCE_TEST.replace("SOURCE", file));
    write(dir, &format!("src-{}.toml", file.replace('.', "-")), text)
}

const WRITE_TEXT_PARQUET: &str = r#"
import sys, pyarrow as pa, pyarrow.parquet as pq
kind, out = sys.argv[1], sys.argv[2]
if kind == "good":
    t = pa.table({"id": [1, 2, 3], "text": ["Great crew", "Lost my bag", "Fine"]})
elif kind == "int":
    t = pa.table({"id": [1, 2], "text": [3, 4]})
elif kind == "binary":
    t = pa.table({"text": pa.array([b"ok", b"bad \xff\xfe"], pa.binary())})
elif kind == "missing":
    t = pa.table({"body": ["x"]})
pq.write_table(t, out)
"#;

#[test]
fn source_datasets() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    // CSV: a three-line record before the bad one, so line numbers are real lines.
    let csv_head = "id,text\n1,\"a long\nreview over\nthree lines\"\n";
    let csv_cases: Vec<(&str, Vec<u8>, usize)> = vec![
        ("truncated", format!("{csv_head}2").into_bytes(), 5),
        (
            "wrong type (too many fields)",
            format!("{csv_head}2,ok\n3,x,y\n").into_bytes(),
            6,
        ),
        (
            "invalid UTF-8",
            [csv_head.as_bytes(), b"2,\"multi\nline\"\n3,caf\xe9\n"].concat(),
            7,
        ),
        ("missing field", b"id,body\n1,x\n".to_vec(), 1),
    ];
    let jsonl_cases: Vec<(&str, Vec<u8>, usize)> = vec![
        (
            "truncated",
            b"{\"text\": \"ok\"}\n{\"text\": \"cut".to_vec(),
            2,
        ),
        (
            "wrong type",
            b"{\"text\": \"ok\"}\n\n{\"text\": 3}\n".to_vec(),
            3,
        ),
        (
            "invalid UTF-8",
            b"{\"text\": \"ok\"}\n{\"text\": \"caf\xe9\"}\n".to_vec(),
            2,
        ),
        (
            "missing field",
            b"{\"text\": \"ok\"}\n{\"body\": \"x\"}\n".to_vec(),
            2,
        ),
    ];
    let mut seen = std::collections::HashSet::new();
    let mut check = |what: String, pipeline: &Path, file: &str, position: String| {
        // One root per pipeline (the pipeline's hash is the run's identity).
        let root = dir.join(format!("root-{file}"));
        let r = root.to_str().unwrap();
        let before = tree(&root);
        let o = run_in(dir, &["run", pipeline.to_str().unwrap(), "--out", r]);
        assert_bad(&o, &what, file, &position);
        // The first failure creates the root (with its manifest, nothing started); from
        // then on a failure must leave it as it was.
        if !seen.insert(file.to_string()) {
            assert_eq!(tree(&root), before, "{what}: the run root changed");
        }
    };
    let p = source_pipeline(dir, "data.csv");
    for (what, bytes, line) in csv_cases {
        write(dir, "data.csv", &bytes);
        check(
            format!("csv {what}"),
            &p,
            "data.csv",
            format!("data.csv:{line}: field `text`"),
        );
    }
    let p = source_pipeline(dir, "data.jsonl");
    for (what, bytes, line) in jsonl_cases {
        write(dir, "data.jsonl", &bytes);
        check(
            format!("jsonl {what}"),
            &p,
            "data.jsonl",
            format!("data.jsonl:{line}: field `text`"),
        );
    }
    let p = source_pipeline(dir, "data.parquet");
    let pq = dir.join("data.parquet");
    py(WRITE_TEXT_PARQUET, &["good", pq.to_str().unwrap()]);
    let bytes = std::fs::read(&pq).unwrap();
    std::fs::write(&pq, &bytes[..bytes.len() / 2]).unwrap();
    check(
        "parquet truncated".into(),
        &p,
        "data.parquet",
        "footer".into(),
    );
    for (kind, what) in [
        ("int", "wrong type"),
        ("binary", "invalid UTF-8 (a binary column)"),
        ("missing", "missing field"),
    ] {
        py(WRITE_TEXT_PARQUET, &[kind, pq.to_str().unwrap()]);
        check(
            format!("parquet {what}"),
            &p,
            "data.parquet",
            "data.parquet:1: field `text`".into(),
        );
    }
}

#[test]
fn csv_source_rows_are_named_by_their_real_line() {
    // Rows after a multi-line record keep their line numbers, in errors and in clusters.
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    write(
        dir,
        "data.csv",
        "id,text\n1,\"first\nreview\"\n2,second review\n",
    );
    let p = source_pipeline(dir, "data.csv");
    let root = dir.join("root");
    let o = run_in(
        dir,
        &["run", p.to_str().unwrap(), "--out", root.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run_in(
        dir,
        &[
            "sql",
            "SELECT DISTINCT template_id FROM cases WHERE test = 'from data' ORDER BY 1",
            "--run",
            root.to_str().unwrap(),
            "--format",
            "csv",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        out.contains("mini/from data/row2") && out.contains("mini/from data/row4"),
        "{out}"
    );
}

const WRITE_IMPORT_PARQUET: &str = r#"
import sys, pyarrow as pa, pyarrow.parquet as pq
kind, out = sys.argv[1], sys.argv[2]
n = 5
cols = {
    "input": [f"question {i}" for i in range(n)],
    "response": [f"answer {i}" for i in range(n)],
    "model": ["m"] * n,
    "prompt_tokens": [10] * n,
    "max_tokens": [64] * n,
}
if kind == "mistyped number":
    cols["prompt_tokens"] = ["10", "11", "12x", "13", "14"]
elif kind == "negative max_tokens":
    cols["max_tokens"] = [64, -1, 64, 64, 64]
elif kind == "fraction":
    cols["prompt_tokens"] = [10.0, 11.0, 12.0, 13.5, 14.0]
elif kind == "binary":
    cols["input"] = pa.array([b"q0", b"q1", b"q\xff", b"q3", b"q4"], pa.binary())
elif kind == "missing":
    del cols["input"]
pq.write_table(pa.table(cols), out, row_group_size=2)
"#;

#[test]
fn import_corpora() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let (_, root) = good_run(dir);
    let r = root.to_str().unwrap();
    let before = tree(&root);
    let line = |i: usize, extra: &str, req_extra: &str| {
        format!(
            r#"{{"request": {{"model": "m", "messages": [{{"role": "user", "content": "q{i}"}}]{req_extra}}}, "response": {{"choices": [{{"message": {{"content": "a{i}"}}, "finish_reason": "stop"}}]}}{extra}}}"#
        )
    };
    let good = format!("{}\n{}\n", line(1, "", ""), line(2, "", ""));
    let jsonl_cases: Vec<(&str, Vec<u8>, String)> = vec![
        (
            "truncated",
            good.as_bytes()[..good.len() - 20].to_vec(),
            "corpus.jsonl:2: field `(line)`".into(),
        ),
        (
            "wrong type (negative max_tokens)",
            format!("{good}{}\n", line(3, "", r#", "max_tokens": -5"#)).into_bytes(),
            "corpus.jsonl:3: field `request.max_tokens`".into(),
        ),
        (
            "wrong type (string http_status)",
            format!("{good}{}\n", line(3, r#", "http_status": "200""#, "")).into_bytes(),
            "corpus.jsonl:3: field `http_status`".into(),
        ),
        (
            "invalid UTF-8",
            [good.as_bytes(), b"{\"request\": \"\xff\"}\n"].concat(),
            "corpus.jsonl:3:".into(),
        ),
        (
            "missing field",
            format!("{good}{{\"request\": {{\"model\": \"m\"}}, \"response\": {{}}}}\n")
                .into_bytes(),
            "corpus.jsonl:3: field `request.messages`".into(),
        ),
    ];
    // Into an existing run: refused before the file is read, and the run is untouched.
    let f = write(dir, "corpus.jsonl", good.as_bytes());
    let o = run_in(dir, &["import", f.to_str().unwrap(), "--out", r]);
    assert_bad(&o, "existing run", r, "already a run");
    assert_eq!(tree(&root), before, "import into a run changed it");
    for (what, bytes, position) in jsonl_cases {
        let f = write(dir, "corpus.jsonl", &bytes);
        // The import streams: the bad line is found after earlier lines were staged, and
        // nothing of them stays.
        let fresh = dir.join("fresh-jsonl");
        let o = run_in(
            dir,
            &[
                "import",
                f.to_str().unwrap(),
                "--out",
                fresh.to_str().unwrap(),
            ],
        );
        assert_bad(&o, what, "corpus.jsonl", &position);
        assert!(!fresh.exists(), "jsonl {what}: a root was created");
    }
    let pq = dir.join("corpus.parquet");
    let p = pq.to_str().unwrap();
    py(WRITE_IMPORT_PARQUET, &["good", p]);
    let bytes = std::fs::read(&pq).unwrap();
    std::fs::write(&pq, &bytes[..bytes.len() - 30]).unwrap();
    let parquet_cases = [
        ("truncated", "corpus.parquet: footer"),
        // Row 3 is in the second row group (rows 3-4): the row itself is named.
        ("mistyped number", "corpus.parquet:3: field `prompt_tokens`"),
        (
            "negative max_tokens",
            "corpus.parquet:2: field `max_tokens`",
        ),
        ("fraction", "corpus.parquet:4: field `prompt_tokens`"),
        ("binary", "corpus.parquet:1: field `input`"),
        ("missing", "corpus.parquet:1: field `input`"),
    ];
    for (kind, position) in parquet_cases {
        if kind != "truncated" {
            py(WRITE_IMPORT_PARQUET, &[kind, p]);
        }
        // Into a fresh root: the row is named, and nothing is created.
        let fresh = dir.join("fresh");
        let o = run_in(dir, &["import", p, "--out", fresh.to_str().unwrap()]);
        assert_bad(&o, &format!("parquet {kind}"), "corpus.parquet", position);
        assert!(!fresh.exists(), "parquet {kind}: a root was created");
        assert_eq!(tree(&root), before, "parquet {kind}: the run root changed");
    }
}

#[test]
fn holdout_labels_csv() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let (_, root) = good_run(dir);
    let r = root.to_str().unwrap();
    let before = tree(&root);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "truncated",
            b"call_id,label\nc1,yes\nc2".to_vec(),
            "labels.csv:3:",
        ),
        (
            "wrong type (empty label)",
            b"call_id,label\nc1,\"multi\nline\"\nc2,\n".to_vec(),
            "labels.csv:4: field `label`",
        ),
        (
            "invalid UTF-8",
            b"call_id,label\nc1,yes\nc2,n\xf6\n".to_vec(),
            "labels.csv:3:",
        ),
        (
            "missing field",
            b"call_id,lbl\nc1,yes\n".to_vec(),
            "labels.csv:1:",
        ),
        (
            "duplicate call_id",
            b"call_id,label\nc1,yes\n\"c2\",\"no, never\"\n\"c1\",no\n".to_vec(),
            "labels.csv:4: field `call_id`: `c1` is labelled twice (lines 2 and 4)",
        ),
    ];
    for (what, bytes, position) in cases {
        let l = write(dir, "labels.csv", &bytes);
        for verb in ["check", "accept"] {
            let o = run_in(
                dir,
                &[
                    "holdout",
                    verb,
                    r,
                    "--labels",
                    l.to_str().unwrap(),
                    "--baseline",
                    dir.join("hb.json").to_str().unwrap(),
                ],
            );
            assert_bad(&o, what, "labels.csv", position);
            assert_eq!(tree(&root), before, "{what}: the run root changed");
        }
    }
}

#[test]
fn baseline_files() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let (_, root) = good_run(dir);
    let r = root.to_str().unwrap();
    let before = tree(&root);
    let good = "{\n  \"run_id\": \"x\",\n  \"rows\": 2,\n  \"invalid_fraction\": 0.0,\n  \"validity\": {}\n}\n";
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "truncated",
            good.as_bytes()[..30].to_vec(),
            "baseline.json:3:",
        ),
        (
            "wrong type",
            good.replace("0.0", "\"none\"").into_bytes(),
            "baseline.json:4:",
        ),
        (
            "invalid UTF-8",
            good.replace("\"x\"", "\"x\u{0}\"")
                .into_bytes()
                .into_iter()
                .map(|b| if b == 0 { 0xff } else { b })
                .collect(),
            "baseline.json:2:",
        ),
        (
            "missing field",
            good.replace("  \"rows\": 2,\n", "").into_bytes(),
            "baseline.json:5:",
        ),
    ];
    for (what, bytes, position) in cases {
        let b = write(dir, "baseline.json", &bytes);
        let o = run_in(dir, &["check", r, "--baseline", b.to_str().unwrap()]);
        assert_bad(&o, &format!("check {what}"), "baseline.json", position);
        assert_eq!(tree(&root), before, "check {what}: the run root changed");
    }
    // The holdout baseline is read before anything is scored.
    let labels = write(dir, "labels.csv", "call_id,label\nc1,positive\n");
    let good = "{\"scorer\": \"cue@1\", \"labels\": 1, \"ids_hash\": \"h\", \"classes\": {}}";
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("truncated", good.as_bytes()[..20].to_vec(), "hb.json:1:"),
        (
            "wrong type",
            good.replace("1,", "\"one\",").into_bytes(),
            "hb.json:1:",
        ),
        (
            "invalid UTF-8",
            good.replace("cue", "cu\u{0}")
                .into_bytes()
                .into_iter()
                .map(|b| if b == 0 { 0xfe } else { b })
                .collect(),
            "hb.json:1:",
        ),
        (
            "missing field",
            good.replace("\"ids_hash\": \"h\", ", "").into_bytes(),
            "hb.json:1:",
        ),
    ];
    for (what, bytes, position) in cases {
        let b = write(dir, "hb.json", &bytes);
        let o = run_in(
            dir,
            &[
                "holdout",
                "check",
                r,
                "--labels",
                labels.to_str().unwrap(),
                "--baseline",
                b.to_str().unwrap(),
            ],
        );
        assert_bad(&o, &format!("holdout {what}"), "hb.json", position);
        assert_eq!(tree(&root), before, "holdout {what}: the run root changed");
    }
}

#[test]
fn manifest() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let (good, root) = good_run(dir);
    let r = root.to_str().unwrap();
    let m = root.join("manifest.json");
    let text = std::fs::read_to_string(&m).unwrap();
    let mut invalid = text.clone().into_bytes();
    let at = text.find("\"run_id\": \"").unwrap() + 11;
    invalid.insert(at, 0xff);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", text.as_bytes()[..text.len() / 2].to_vec()),
        (
            "wrong type",
            text.replacen("\"stages\": {", "\"stages\": 5, \"x\": {", 1)
                .into_bytes(),
        ),
        ("invalid UTF-8", invalid),
        (
            "missing field",
            text.replacen("\"run_id\"", "\"run\"", 1).into_bytes(),
        ),
    ];
    for (what, bytes) in cases {
        std::fs::write(&m, &bytes).unwrap();
        let before = tree(&root);
        for args in [
            vec!["run", good.to_str().unwrap(), "--out", r],
            vec!["score", good.to_str().unwrap(), "--out", r],
            vec!["sql", "SELECT 1", "--run", r],
            vec!["check", r],
            vec!["report", r],
            vec!["rescore", r, "--scorer", "checklist"],
        ] {
            let o = run_in(dir, &args);
            assert_bad(
                &o,
                &format!("{what} ({})", args[0]),
                "manifest.json",
                "line ",
            );
            assert_eq!(
                tree(&root),
                before,
                "{what} ({}): the run root changed",
                args[0]
            );
        }
    }
}

const REWRITE_PART: &str = r#"
import sys, pyarrow as pa, pyarrow.parquet as pq
kind, path = sys.argv[1], sys.argv[2]
t = pq.read_table(path)
if kind == "int role":
    i = t.schema.get_field_index("role")
    t = t.set_column(i, "role", pa.array([7] * t.num_rows, pa.int32()))
elif kind == "binary response":
    i = t.schema.get_field_index("response")
    t = t.set_column(i, "response", pa.array([b"\xff\xfe"] * t.num_rows, pa.binary()))
elif kind == "no model":
    t = t.drop(["model"])
pq.write_table(t, path)
"#;

#[test]
fn run_parts() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let (good, root) = good_run(dir);
    let r = root.to_str().unwrap();
    let g = good.to_str().unwrap();
    let part = |table: &str| {
        std::fs::read_dir(root.join(table))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|e| e == "parquet"))
            .unwrap()
    };
    let (cases_part, calls_part) = (part("cases"), part("calls"));
    let originals = [
        (cases_part.clone(), std::fs::read(&cases_part).unwrap()),
        (calls_part.clone(), std::fs::read(&calls_part).unwrap()),
    ];
    let restore = || {
        for (p, b) in &originals {
            std::fs::write(p, b).unwrap();
        }
    };
    // (what, the part it changes, how, the column or position named)
    let cases: Vec<(&str, &PathBuf, &str, &str)> = vec![
        ("truncated", &calls_part, "truncate", "footer"),
        // The cases table was never checked: score panicked on this one.
        ("wrong type", &cases_part, "int role", "column `role`"),
        (
            "invalid UTF-8 (a binary column)",
            &calls_part,
            "binary response",
            "column `response`",
        ),
        ("missing field", &calls_part, "no model", "column `model`"),
    ];
    for (what, p, how, position) in cases {
        restore();
        if how == "truncate" {
            let b = std::fs::read(p).unwrap();
            std::fs::write(p, &b[..b.len() / 2]).unwrap();
        } else {
            py(REWRITE_PART, &[how, p.to_str().unwrap()]);
        }
        let file = p.file_name().unwrap().to_str().unwrap();
        let before = tree(&root);
        for args in [
            vec!["score", g, "--out", r],
            vec!["aggregate", g, "--out", r],
            vec!["validate", g, "--out", r],
            vec!["sql", "SELECT count(*) FROM cases", "--run", r],
            vec!["check", r],
            vec!["report", r],
            vec!["rescore", r, "--scorer", "checklist"],
        ] {
            let o = run_in(dir, &args);
            let e = assert_bad(&o, &format!("{what} ({})", args[0]), file, position);
            assert!(
                e.contains(p.parent().unwrap().file_name().unwrap().to_str().unwrap()),
                "{what}: the table folder is named: {e}"
            );
            assert_eq!(
                tree(&root),
                before,
                "{what} ({}): the run root changed",
                args[0]
            );
        }
    }
}

/// A local HTTP server answering every request with 403 and an S3 error body: a store
/// that refuses the credentials it was given.
fn refusing_s3() -> String {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let mut buf = [0u8; 8192];
            let mut got = Vec::new();
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>InvalidAccessKeyId</Code><Message>The AWS Access Key Id you provided does not exist in our records.</Message></Error>";
            let _ = write!(
                s,
                "HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    format!("http://{addr}")
}

/// `bin()` with every AWS variable removed, then `vars` set.
fn without_aws(vars: &[(&str, &str)]) -> Command {
    let mut c = bin();
    for (k, _) in std::env::vars() {
        if k.starts_with("AWS_") {
            c.env_remove(k);
        }
    }
    c.env("EVALFLOW_CACHE_DIR", "off");
    for (k, v) in vars {
        c.env(k, v);
    }
    c
}

#[test]
fn object_store_credentials_fail_fast_and_clearly() {
    let d = tempfile::tempdir().unwrap();
    let good = write(d.path(), "good.toml", MINIMAL);
    let g = good.to_str().unwrap();
    let t0 = std::time::Instant::now();
    // No credentials: refused up front, not a stall probing the instance-metadata address.
    let o = without_aws(&[])
        .args(["run", g, "--out", "s3://bucket/runs/r1"])
        .output()
        .unwrap();
    let e = assert_bad(
        &o,
        "no credentials",
        "s3://bucket/runs/r1",
        "AWS_ACCESS_KEY_ID",
    );
    assert!(e.contains("no S3 credentials"), "{e}");
    let o = without_aws(&[])
        .args(["sql", "SELECT 1", "--table", "t=s3://bucket/t.parquet"])
        .output()
        .unwrap();
    assert_bad(
        &o,
        "no credentials (--table)",
        "s3://bucket/t.parquet",
        "AWS_ACCESS_KEY_ID",
    );
    // Credentials the store refuses: exit 2 naming the object, not a retry loop.
    let endpoint = refusing_s3();
    let o = without_aws(&[
        ("AWS_ACCESS_KEY_ID", "AKIAWRONG"),
        ("AWS_SECRET_ACCESS_KEY", "wrong"),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ENDPOINT", &endpoint),
        ("AWS_ALLOW_HTTP", "true"),
    ])
    .args(["run", g, "--out", "s3://bucket/runs/r1"])
    .output()
    .unwrap();
    // The first object a writer touches is the root's lease.
    let e = assert_bad(
        &o,
        "refused credentials",
        "runs/r1/_lease.json",
        "access denied",
    );
    assert!(e.contains("InvalidAccessKeyId") || e.contains("403"), "{e}");
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(60),
        "credential errors must not hang"
    );
}

#[test]
fn gs_and_az_roots_name_the_cargo_feature_they_need() {
    let d = tempfile::tempdir().unwrap();
    let good = write(d.path(), "good.toml", MINIMAL);
    let g = good.to_str().unwrap();
    let cases = [
        (
            vec!["run", g, "--out", "gs://bucket/runs/r1"],
            "gs://bucket/runs/r1",
            "gcp",
            cfg!(feature = "gcp"),
        ),
        (
            vec!["sql", "SELECT 1", "--run", "az://container/runs/r1"],
            "az://container/runs/r1",
            "azure",
            cfg!(feature = "azure"),
        ),
        (
            vec!["sql", "SELECT 1", "--table", "t=gs://bucket/t.parquet"],
            "gs://bucket/t.parquet",
            "gcp",
            cfg!(feature = "gcp"),
        ),
    ];
    for (args, url, feature, built_in) in cases {
        if built_in {
            continue;
        }
        let o = run_in(d.path(), &args);
        let e = assert_bad(&o, url, url, &format!("`{feature}` cargo feature"));
        assert!(e.contains(&format!("--features {feature}")), "{e}");
    }
}

#[test]
fn sql_table_on_s3_registers_its_object_store() {
    let moto = moto::Moto::start("tables");
    let endpoint = moto.endpoint.clone();
    let s3 = |args: &[&str]| {
        without_aws(&[
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
            ("AWS_REGION", "us-east-1"),
            ("AWS_ENDPOINT", &endpoint),
            ("AWS_ALLOW_HTTP", "true"),
        ])
        .args(args)
        .output()
        .unwrap()
    };
    let d = tempfile::tempdir().unwrap();
    let good = write(d.path(), "good.toml", MINIMAL);
    let o = s3(&["run", good.to_str().unwrap(), "--out", "s3://tables/r1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = s3(&[
        "sql",
        "SELECT count(*) AS n FROM t",
        "--table",
        "t=s3://tables/r1/calls/",
        "--format",
        "csv",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "n\n2");
}

/// Rewrites a part uncompressed and without dictionaries, then replaces a text value's
/// bytes with invalid UTF-8 of the same length: a part whose footer is fine but whose
/// text column does not decode.
const CORRUPT_TEXT: &str = r#"
import sys, pyarrow.parquet as pq
path = sys.argv[1]
pq.write_table(pq.read_table(path), path, compression="none", use_dictionary=False, write_statistics=False)
b = open(path, "rb").read()
assert b"Vocabulary" in b
open(path, "wb").write(b.replace(b"Vocabulary", b"Vocabul\xff\xfe\xfd"))
"#;

#[test]
fn invalid_utf8_inside_a_part_names_the_part() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let (good, root) = good_run(dir);
    let r = root.to_str().unwrap();
    let part = std::fs::read_dir(root.join("cases"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "parquet"))
        .unwrap();
    py(CORRUPT_TEXT, &[part.to_str().unwrap()]);
    let file = part.file_name().unwrap().to_str().unwrap();
    let before = tree(&root);
    let o = run_in(dir, &["sql", "SELECT capability FROM cases", "--run", r]);
    let e = assert_bad(&o, "sql", file, "rows from 1");
    assert!(e.contains("UTF-8") && e.contains("cases"), "{e}");
    assert_eq!(tree(&root), before, "sql: the run root changed");
    // A stage names the part too (it has recorded its start in the manifest by then).
    let o = run_in(dir, &["score", good.to_str().unwrap(), "--out", r]);
    assert_bad(&o, "score", file, "rows from 1");
}

/// `text` (a pipeline written as `bad.toml`) is refused by `run` when it is read: exit 2,
/// `bad.toml:<line of needle>: field `<field>``, a completed root byte-identical and a
/// new root (given or default) never created. Returns the message.
fn refused_at_load(text: &str, needle: &str, field: &str) -> String {
    let d = tempfile::tempdir().unwrap();
    let (_, root) = good_run(d.path());
    let before = tree(&root);
    let p = write(d.path(), "bad.toml", text);
    let want = format!("bad.toml:{}: field `{field}`", line_of(text, needle));
    let fresh = d.path().join("fresh");
    let mut e = String::new();
    for r in [&root, &fresh] {
        let o = run_in(
            d.path(),
            &["run", p.to_str().unwrap(), "--out", r.to_str().unwrap()],
        );
        e = assert_bad(&o, field, "bad.toml", &want);
    }
    let o = run_in(d.path(), &["run", p.to_str().unwrap()]);
    assert_bad(&o, field, "bad.toml", &want);
    assert_eq!(tree(&root), before, "{field}: the run root changed");
    assert!(!fresh.exists(), "{field}: a new root was created");
    assert!(
        !d.path().join("runs").exists(),
        "{field}: a default root was created"
    );
    e
}

/// [`MINIMAL`] with an HTTP `[model]` (lines `extra` added to it) in place of vader.
fn http_model(extra: &str) -> String {
    MINIMAL.replace(
        "provider = \"builtin:vader\"\nname = \"vader\"\n",
        &format!(
            "provider = \"openai\"\nname = \"gpt\"\nbase_url = \"http://127.0.0.1:9/v1\"\n{extra}"
        ),
    )
}

/// A judge scorer written as data, whose own `model` table holds `model`.
fn judge_scorer(model: &str) -> String {
    format!(
        "{MINIMAL}\n[[scorer]]\nname = \"polite\"\nkind = \"judge\"\nmetric = \"numeric\"\nquestions = [{{ id = \"p\", text = \"Polite?\" }}]\n\
         model = {{ provider = \"openai\", name = \"j\", {model} }}\n"
    )
}

/// Issue 61, item 13: a `base_url` that is not an http(s) URL was found by the call stage,
/// after generate had written the run; now at load, in `[model]`, `[judge]`, `[rephrase]`
/// and a judge scorer's model.
#[test]
fn a_base_url_that_is_not_a_url_is_refused_when_the_pipeline_is_read() {
    let text = http_model("").replace("http://127.0.0.1:9/v1", "localhost:8089/v1");
    let e = refused_at_load(&text, "base_url", "model.base_url");
    assert!(e.contains("localhost:8089/v1"), "{e}");
    let text = http_model("").replace("http://127.0.0.1:9/v1", "not a url");
    refused_at_load(&text, "base_url", "model.base_url");
    let text = format!(
        "{MINIMAL}\n[judge]\nprovider = \"openai\"\nname = \"j\"\nbase_url = \"127.0.0.1\"\n"
    );
    refused_at_load(&text, "base_url", "judge.base_url");
    let text =
        format!("{MINIMAL}\n[rephrase]\nprovider = \"openai\"\nname = \"r\"\nbase_url = \"::\"\n");
    refused_at_load(&text, "base_url", "rephrase.base_url");
    let e = refused_at_load(
        &judge_scorer("base_url = \"nope\""),
        "model = {",
        "scorer.model.base_url",
    );
    assert!(e.contains("scorer `polite`"), "{e}");
}

/// Issue 61, item 13: an Anthropic model without `max_tokens` was refused by the call stage
/// after generate; now at load, at the table's `provider` line (the field is not written).
#[test]
fn an_anthropic_model_without_max_tokens_is_refused_when_the_pipeline_is_read() {
    let text = http_model("").replace("\"openai\"", "\"anthropic\"");
    let e = refused_at_load(&text, "\"anthropic\"", "model.max_tokens");
    assert!(e.contains("requires max_tokens"), "{e}");
    let text = format!("{MINIMAL}\n[judge]\nprovider = \"anthropic\"\nname = \"j\"\n");
    refused_at_load(&text, "\"anthropic\"", "judge.max_tokens");
    let text =
        judge_scorer("").replace("\"openai\", name = \"j\", ", "\"anthropic\", name = \"j\"");
    refused_at_load(&text, "model = {", "scorer.model.max_tokens");
}

/// Issue 61, item 13: an unset `api_key_env` variable was found by the call stage after
/// generate wrote the run; now before the root is opened, naming the variable (never a
/// value). `builtin:vader` sends no key, and an omitted `api_key_env` sends none.
#[test]
fn an_unset_api_key_variable_is_refused_before_the_run_is_written() {
    const VAR: &str = "EVALFLOW_TEST_ITEM13_UNSET_KEY";
    let e = refused_at_load(
        &http_model(&format!("api_key_env = \"{VAR}\"\n")),
        VAR,
        "model.api_key_env",
    );
    assert!(
        e.contains(&format!("environment variable {VAR} is not set")),
        "{e}"
    );
    let judge = format!(
        "{MINIMAL}\n[score]\nscorers = [\"judge\"]\n\n[score.judge]\nquestions = [{{ id = \"q\", text = \"Q?\" }}]\n\n\
         [judge]\nprovider = \"openai\"\nname = \"j\"\napi_key_env = \"{VAR}\"\n"
    );
    refused_at_load(&judge, VAR, "judge.api_key_env");
    refused_at_load(
        &judge_scorer(&format!("api_key_env = \"{VAR}\"")),
        "model = {",
        "scorer.model.api_key_env",
    );
    // An empty value is no key either; the message names the variable only.
    let d = tempfile::tempdir().unwrap();
    let p = write(
        d.path(),
        "bad.toml",
        http_model(&format!("api_key_env = \"{VAR}\"\n")),
    );
    let o = bin()
        .args([
            "run",
            p.to_str().unwrap(),
            "--out",
            d.path().join("r").to_str().unwrap(),
        ])
        .env(VAR, "")
        .output()
        .unwrap();
    assert_bad(&o, "empty key", "bad.toml", "field `model.api_key_env`");
    assert!(!d.path().join("r").exists());
    // A provider that sends no key runs with the variable unset.
    let vader = MINIMAL.replace(
        "name = \"vader\"\n",
        &format!("name = \"vader\"\napi_key_env = \"{VAR}\"\n"),
    );
    let p = write(d.path(), "vader.toml", vader);
    let o = run_in(
        d.path(),
        &[
            "run",
            p.to_str().unwrap(),
            "--out",
            d.path().join("v").to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "vader needs no key: {}", stderr(&o));
}

/// Issue 61, item 14: `temperature = -3` was accepted and sent; OpenAI takes 0..=2,
/// Anthropic 0..=1.
#[test]
fn a_temperature_the_api_refuses_is_refused_when_the_pipeline_is_read() {
    let e = refused_at_load(
        &http_model("temperature = -3\n"),
        "temperature",
        "model.temperature",
    );
    assert!(e.contains("0..=2"), "{e}");
    let text =
        http_model("temperature = 1.5\nmax_tokens = 8\n").replace("\"openai\"", "\"anthropic\"");
    let e = refused_at_load(&text, "temperature", "model.temperature");
    assert!(e.contains("0..=1"), "{e}");
    let text =
        format!("{MINIMAL}\n[rephrase]\nprovider = \"openai\"\nname = \"r\"\ntemperature = nan\n");
    refused_at_load(&text, "temperature", "rephrase.temperature");
}

/// Issue 61, item 14: `timeout_secs = 0` was accepted (every request a timeout).
#[test]
fn a_zero_timeout_is_refused_when_the_pipeline_is_read() {
    refused_at_load(
        &http_model("timeout_secs = 0\n"),
        "timeout_secs",
        "model.timeout_secs",
    );
    let text =
        format!("{MINIMAL}\n[judge]\nprovider = \"openai\"\nname = \"j\"\ntimeout_secs = -1.0\n");
    refused_at_load(&text, "timeout_secs", "judge.timeout_secs");
}

/// Issue 61, item 14: `name = ""` was accepted and sent as the model name.
#[test]
fn an_empty_model_name_is_refused_when_the_pipeline_is_read() {
    let text = http_model("").replace("name = \"gpt\"", "name = \"\"");
    refused_at_load(&text, "name = \"\"", "model.name");
    let text = format!("{MINIMAL}\n[rephrase]\nprovider = \"openai\"\nname = \" \"\n");
    refused_at_load(&text, "name = \" \"", "rephrase.name");
}

/// Issue 61, item 14: `max_tokens = 0` was accepted (no answer can be written).
#[test]
fn zero_max_tokens_is_refused_when_the_pipeline_is_read() {
    refused_at_load(
        &http_model("max_tokens = 0\n"),
        "max_tokens",
        "model.max_tokens",
    );
    refused_at_load(
        &judge_scorer("max_tokens = 0"),
        "model = {",
        "scorer.model.max_tokens",
    );
}

/// Issue 61, item 14: `concurrency = 0` and `samples = 0` are refused at their own line.
#[test]
fn zero_concurrency_or_samples_is_refused_when_the_pipeline_is_read() {
    refused_at_load(
        &http_model("concurrency = 0\n"),
        "concurrency",
        "model.concurrency",
    );
    refused_at_load(&http_model("samples = 0\n"), "samples", "model.samples");
}

/// Issue 61, item 14: a mistyped token count of a pairs record (`"prompt_tokens": "ten"`)
/// was imported as a silent NULL; now the file, its line and the field, and no root.
#[test]
fn a_mistyped_token_count_of_a_pairs_record_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let line = |i: usize, usage: &str| {
        format!(
            r#"{{"request": {{"model": "m", "messages": [{{"role": "user", "content": "q{i}"}}]}}, "response": {{"choices": [{{"message": {{"content": "a"}}}}]{usage}}}}}"#
        )
    };
    let cases = [
        (
            r#", "usage": {"prompt_tokens": "ten", "completion_tokens": 2}"#,
            "response.usage.prompt_tokens",
        ),
        (
            r#", "usage": {"prompt_tokens": 1, "completion_tokens": 2.5}"#,
            "response.usage.completion_tokens",
        ),
        (
            r#", "usage": {"completion_tokens_details": {"reasoning_tokens": true}}"#,
            "response.usage.completion_tokens_details.reasoning_tokens",
        ),
        (r#", "usage": "lots""#, "response.usage"),
    ];
    for (usage, field) in cases {
        let text = format!("{}\n{}\n{}\n", line(1, ""), line(2, ""), line(3, usage));
        let f = write(d.path(), "corpus.jsonl", text);
        let fresh = d.path().join("fresh");
        let o = run_in(
            d.path(),
            &[
                "import",
                f.to_str().unwrap(),
                "--out",
                fresh.to_str().unwrap(),
            ],
        );
        assert_bad(
            &o,
            field,
            "corpus.jsonl",
            &format!("corpus.jsonl:3: field `{field}`"),
        );
        assert!(!fresh.exists(), "{field}: a root was created");
    }
}

/// Issue 61 item 17: a run root that is a file is named as such (exit 2), for every verb that
/// opens a root, and the file is left as it was.
#[test]
fn a_root_that_is_a_file_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "notes.txt", "mine");
    let pipeline =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/sentiment.toml");
    for args in [
        vec![
            "run",
            pipeline.to_str().unwrap(),
            "--out",
            file.to_str().unwrap(),
        ],
        vec!["sql", "SELECT 1", "--run", file.to_str().unwrap()],
        vec!["verify", file.to_str().unwrap()],
    ] {
        let o = run_in(dir.path(), &args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("is a file, not a folder"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");
}
