//! Generate-stage tests: VADER parity with the reference implementation, the suite
//! format's checks, perturbations and streaming expansion.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use evalflow::pipeline::Pipeline;
use evalflow::stages::generate;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn vader_fixture() -> Vec<(String, f64)> {
    let path = repo().join("tests/fixtures/vader/sentiment_compound.jsonl");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .enumerate()
        .map(|(i, l)| {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("line {}: {e}", i + 1));
            (
                v["text"].as_str().unwrap().to_string(),
                v["compound"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// `builtin:vader` gives exactly vaderSentiment 3.3.2's compound score on every sentence
/// of the fixture (made by scripts/vader_reference.py).
#[test]
fn vader_compound_equals_python_reference_exactly() {
    let fixture = vader_fixture();
    assert!(fixture.len() > 100);
    let mut bad = Vec::new();
    for (text, want) in &fixture {
        let got = evalflow::stages::call::vader::compound(text);
        if got != *want {
            bad.push(format!("{text:?}: rust {got} python {want}"));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} sentences differ:\n{}",
        bad.len(),
        fixture.len(),
        bad.join("\n")
    );
}

/// The fixture covers every input of the current sentiment suite, so changing the suite
/// without re-running scripts/vader_reference.py fails here.
#[test]
fn vader_fixture_covers_the_sentiment_suite() {
    let known: HashSet<String> = vader_fixture().into_iter().map(|(t, _)| t).collect();
    let p = Pipeline::load(&repo().join("pipelines/sentiment.toml")).unwrap();
    let cases = generate::expand(&p).unwrap();
    let missing: Vec<&str> = cases
        .iter()
        .map(|c| c.input.as_str())
        .filter(|t| !known.contains(*t))
        .collect();
    assert!(
        missing.is_empty(),
        "{} suite inputs are not in tests/fixtures/vader/sentiment_compound.jsonl; \
         run `python3 scripts/vader_reference.py`. First: {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
}

#[allow(dead_code)]
fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::write(&p, text).unwrap();
    p
}

/// Extra parity check over any JSONL of `{"text", "compound"}` made with vaderSentiment
/// 3.3.2 (e.g. random sentences): `EVALFLOW_VADER_FUZZ=file cargo test -- --ignored`.
#[test]
#[ignore]
fn vader_parity_on_external_file() {
    let Ok(path) = std::env::var("EVALFLOW_VADER_FUZZ") else {
        return;
    };
    let text = std::fs::read_to_string(&path).unwrap();
    let mut n = 0;
    let mut bad = Vec::new();
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        let t = v["text"].as_str().unwrap();
        let want = v["compound"].as_f64().unwrap();
        let got = evalflow::stages::call::vader::compound(t);
        n += 1;
        if got != want {
            bad.push(format!("{t:?}: rust {got} python {want}"));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {n} differ:\n{}",
        bad.len(),
        bad[..bad.len().min(20)].join("\n")
    );
}
