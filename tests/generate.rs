//! Generate-stage tests: VADER parity with the reference implementation, the suite
//! format's checks, perturbations and streaming expansion.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use evalflow::pipeline::Pipeline;
use evalflow::stages::call::{CallRequest, CallResult, Provider};
use evalflow::stages::generate::{self, Case, CaseStream, GenerateError};
use evalflow::storage::RunStore;

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

const HEAD: &str = r#"
[model]
provider = "builtin:vader"
name = "vader"

[suite]
name = "s"
seed = 7
"#;

/// Writes `body` after a standard head into a temp dir and loads it.
fn load(dir: &Path, body: &str) -> Result<Pipeline, evalflow::pipeline::PipelineError> {
    let path = write(dir, "p.toml", &format!("{HEAD}{body}"));
    Pipeline::load(&path)
}

fn expand_err(dir: &Path, body: &str) -> String {
    expand_err_head(dir, HEAD, body)
}

fn expand_err_head(dir: &Path, head: &str, body: &str) -> String {
    let path = write(dir, "p.toml", &format!("{head}{body}"));
    match Pipeline::load(&path) {
        Err(e) => e.to_string(),
        Ok(p) => match generate::expand(&p) {
            Err(e) => e.to_string(),
            Ok(c) => panic!("expected an error, got {} cases", c.len()),
        },
    }
}

fn line_of(dir: &Path, file: &str, needle: &str) -> usize {
    let text = std::fs::read_to_string(dir.join(file)).unwrap();
    text[..text.find(needle).unwrap()].matches('\n').count() + 1
}

#[test]
fn unknown_placeholder_names_file_line_and_field() {
    let d = tempfile::tempdir().unwrap();
    let e = expand_err(
        d.path(),
        r#"
[lexicons]
adj = ["good"]

[[test]]
name = "t"
capability = "Vocabulary"
type = "MFT"
templates = ["The {thing} is {adj}."]
expected = "positive"
"#,
    );
    let line = line_of(d.path(), "p.toml", "The {thing}");
    assert!(e.contains(&format!("p.toml:{line}:")), "{e}");
    assert!(e.contains("unknown placeholder `{thing}`"), "{e}");
    assert!(e.contains("templates"), "{e}");
}

#[test]
fn empty_lexicon_duplicate_test_and_blowup_are_errors_with_lines() {
    let d = tempfile::tempdir().unwrap();
    let e = expand_err(
        d.path(),
        r#"
[lexicons]
adj = []

[[test]]
name = "t"
capability = "Vocabulary"
type = "MFT"
templates = ["The food is {adj}."]
expected = "positive"
"#,
    );
    let line = line_of(d.path(), "p.toml", "adj = []");
    assert!(
        e.contains(&format!(
            "p.toml:{line}: field `lexicons.adj`: lexicon is empty"
        )),
        "{e}"
    );

    let test = r#"
[[test]]
name = "same"
capability = "Vocabulary"
type = "MFT"
templates = ["Fine."]
expected = "positive"
"#;
    let e = expand_err(d.path(), &format!("{test}{test}"));
    assert!(e.contains("duplicate test name `same`"), "{e}");
    assert!(e.contains("p.toml:"), "{e}");

    let e = expand_err_head(
        d.path(),
        &HEAD.replace("seed = 7", "seed = 7\nmax_expansion = 5000"),
        r#"
[lexicons]
w = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]

[[test]]
name = "big"
capability = "Vocabulary"
type = "MFT"
templates = ["{w} {w2} {w3} {w4}"]
expected = "neutral"
"#,
    );
    assert!(e.contains("expands to 10000 cases"), "{e}");
}

#[test]
fn blowup_limit_is_configurable() {
    let d = tempfile::tempdir().unwrap();
    let body = r#"
[lexicons]
w = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]

[[test]]
name = "big"
capability = "Vocabulary"
type = "MFT"
templates = ["{w} {w2} {w3} {w4}"]
expected = "neutral"
max_cases = 50
"#;
    let path = write(
        d.path(),
        "p.toml",
        &format!(
            "{}{body}",
            HEAD.replace("seed = 7", "seed = 7\nmax_expansion = 5000")
        ),
    );
    let e = generate::expand(&Pipeline::load(&path).unwrap())
        .unwrap_err()
        .to_string();
    let line = line_of(d.path(), "p.toml", "{w} {w2}");
    assert!(e.contains(&format!("p.toml:{line}:")), "{e}");
    assert!(e.contains("above suite.max_expansion = 5000"), "{e}");
    // Raised limit: sampled to the test's budget.
    let path = write(d.path(), "p.toml", &format!("{HEAD}{body}"));
    let cases = generate::expand(&Pipeline::load(&path).unwrap()).unwrap();
    assert_eq!(cases.len(), 50);
}

#[test]
fn unknown_perturbation_and_missing_phrases() {
    let d = tempfile::tempdir().unwrap();
    let e = expand_err(
        d.path(),
        r#"
[[test]]
name = "t"
capability = "Robustness"
type = "INV"
templates = ["I am here."]
perturb = "shuffle_words"
"#,
    );
    assert!(e.contains("unknown perturbation `shuffle_words`"), "{e}");
    let line = line_of(d.path(), "p.toml", "\"shuffle_words\"");
    assert!(e.contains(&format!("p.toml:{line}:")), "{e}");
    let e = expand_err(
        d.path(),
        r#"
[[test]]
name = "t"
capability = "Robustness"
type = "DIR"
templates = ["I am here."]
perturb = "add_suffix"
expectation = "not_more_positive"
"#,
    );
    assert!(e.contains("needs `phrases"), "{e}");
}

#[test]
fn included_lexicons_are_shared_and_their_errors_name_the_included_file() {
    let d = tempfile::tempdir().unwrap();
    write(
        d.path(),
        "lex/common.toml",
        "# shared\n[lexicons]\nfruit = [\"apple\", \"pear\", \"orange\"]\nnone = []\n",
    );
    let e = expand_err_head(
        d.path(),
        &HEAD.replace("seed = 7", "seed = 7\ninclude = [\"lex/common.toml\"]"),
        r#"
[[test]]
name = "t"
capability = "Vocabulary"
type = "MFT"
templates = ["{A:fruit} is {a:fruit2}."]
expected = "neutral"
"#,
    );
    assert!(
        e.contains("common.toml:4: field `lexicons.none`: lexicon is empty"),
        "{e}"
    );

    write(
        d.path(),
        "lex/common.toml",
        "[lexicons]\nfruit = [\"apple\", \"pear\", \"orange\"]\n",
    );
    let body = r#"
[[test]]
name = "t"
capability = "Vocabulary"
type = "MFT"
templates = ["{A:fruit} is {a:fruit2}.", "I ate {a:fruit} and {a:fruit}."]
expected = "neutral"
"#;
    let path = write(
        d.path(),
        "p.toml",
        &format!(
            "{}{body}",
            HEAD.replace("seed = 7", "seed = 7\ninclude = [\"lex/common.toml\"]")
        ),
    );
    let p = Pipeline::load(&path).unwrap();
    let cases = generate::expand(&p).unwrap();
    let inputs: Vec<&str> = cases.iter().map(|c| c.input.as_str()).collect();
    // Full cartesian product: 3 x 3 for two independent slots, 3 for a repeated slot.
    assert_eq!(cases.len(), 12, "{inputs:?}");
    assert!(inputs.contains(&"An apple is a pear."), "{inputs:?}");
    assert!(inputs.contains(&"A pear is an orange."), "{inputs:?}");
    assert!(
        inputs.contains(&"I ate an orange and an orange."),
        "{inputs:?}"
    );
    assert!(
        !inputs.contains(&"I ate an orange and a pear."),
        "{inputs:?}"
    );
    // Two templates, two clusters.
    let clusters: HashSet<&str> = cases.iter().map(|c| c.template_id.as_str()).collect();
    assert_eq!(clusters.len(), 2);

    // Redefining an included lexicon is an error naming both places.
    let path = write(
        d.path(),
        "p.toml",
        &format!(
            "{}\n[lexicons]\nfruit = [\"kiwi\"]\n{body}",
            HEAD.replace("seed = 7", "seed = 7\ninclude = [\"lex/common.toml\"]")
        ),
    );
    let e = Pipeline::load(&path).unwrap_err().to_string();
    assert!(
        e.contains("common.toml:2: field `lexicons.fruit`: lexicon `fruit` is already defined at"),
        "{e}"
    );
}

fn sample_suite(seed: u64) -> String {
    format!(
        r#"
[model]
provider = "builtin:vader"
name = "vader"

[suite]
name = "s"
seed = {seed}

[lexicons]
a = ["1", "2", "3", "4", "5", "6", "7", "8", "9", "10"]

[[test]]
name = "literal and big"
capability = "Vocabulary"
type = "MFT"
templates = ["{{a}} {{a2}} {{a3}}", "The food is not poor.", "{{a}} {{a2}}"]
expected = "neutral"
max_cases = 200

[[test]]
name = "inv"
capability = "Robustness"
type = "INV"
templates = ["The flight {{a}} was {{a2}} minutes late."]
perturb = {{ op = "change_number", count = 1 }}
n_perturb = 3
max_cases = 30
"#
    )
}

#[test]
fn seeded_sampling_is_reproducible_and_respects_the_budget() {
    let d = tempfile::tempdir().unwrap();
    let run = |seed: u64| -> Vec<Case> {
        let path = write(d.path(), "p.toml", &sample_suite(seed));
        generate::expand(&Pipeline::load(&path).unwrap()).unwrap()
    };
    let a = run(1);
    let b = run(1);
    let c = run(2);
    assert_eq!(a, b);
    assert_ne!(a, c);
    let mft: Vec<&Case> = a.iter().filter(|c| c.test == "literal and big").collect();
    assert_eq!(mft.len(), 200);
    // The budget is split evenly (water-filling): the one-sentence template is always
    // kept, the others share the rest.
    assert!(mft.iter().any(|c| c.input == "The food is not poor."));
    let per = |t: &str| mft.iter().filter(|c| c.template_id.ends_with(t)).count();
    assert_eq!((per("/t0"), per("/t1"), per("/t2")), (100, 1, 99));
    // Sampled without replacement: no duplicate ids or texts.
    let ids: HashSet<&str> = a.iter().map(|c| c.case_id.as_str()).collect();
    assert_eq!(ids.len(), a.len());
    let texts: HashSet<&str> = mft.iter().map(|c| c.input.as_str()).collect();
    assert_eq!(texts.len(), mft.len());
    // INV: every perturbed case is tied to its base by group_id and keeps the template.
    let inv: Vec<&Case> = a.iter().filter(|c| c.test == "inv").collect();
    let bases: Vec<&&Case> = inv.iter().filter(|c| c.role == "base").collect();
    assert_eq!(bases.len(), 30);
    for c in inv.iter().filter(|c| c.role == "perturbed") {
        let b = bases
            .iter()
            .find(|b| b.case_id == c.group_id)
            .expect("base");
        assert_eq!(b.template_id, c.template_id);
        assert_ne!(b.input, c.input);
        assert_eq!(c.perturbation.as_deref(), Some("change_number"));
        assert_eq!(c.tolerance, Some(0.1));
    }
}

#[test]
fn cross_template_duplicates_are_dropped() {
    let d = tempfile::tempdir().unwrap();
    let p = load(
        d.path(),
        r#"
[lexicons]
thing = ["food", "seat"]
adj = ["poor", "bad"]

[[test]]
name = "t"
capability = "Negation"
type = "MFT"
templates = ["The food is not poor.", "The {thing} is not {adj}."]
expected = "positive|neutral"
"#,
    )
    .unwrap();
    let cases = generate::expand(&p).unwrap();
    assert_eq!(cases.len(), 4);
    assert_eq!(
        cases
            .iter()
            .filter(|c| c.input == "The food is not poor.")
            .count(),
        1
    );
}

#[test]
fn labelled_templates_set_expected_per_template() {
    let d = tempfile::tempdir().unwrap();
    let p = load(
        d.path(),
        r#"
[[test]]
name = "qa"
capability = "SRL"
type = "MFT"
templates = [
  { text = "Was it good? Yes.", expected = "positive" },
  { text = "Was it good? No.", expected = "negative" },
]
"#,
    )
    .unwrap();
    let cases = generate::expand(&p).unwrap();
    let got: Vec<(&str, Option<&str>)> = cases
        .iter()
        .map(|c| (c.input.as_str(), c.expected.as_deref()))
        .collect();
    assert_eq!(
        got,
        vec![
            ("Was it good? Yes.", Some("positive")),
            ("Was it good? No.", Some("negative"))
        ]
    );
}

fn source_suite(dir: &Path, file: &str) -> Pipeline {
    load(
        dir,
        &format!(
            r#"
[[test]]
name = "typos over traffic"
capability = "Robustness"
type = "INV"
source = {{ file = "{file}", column = "text" }}
perturb = "typos"
n_perturb = 2
max_cases = 3
"#
        ),
    )
    .unwrap()
}

#[test]
fn inv_over_unlabelled_csv_jsonl_and_parquet() {
    use datafusion::arrow::array::{RecordBatch, StringArray};
    let d = tempfile::tempdir().unwrap();
    write(
        d.path(),
        "data/t.csv",
        "id,text\n1,\"Great crew, thanks\"\n2,\n3,The seat was broken\n4,Lost my bag\n5,Never again\n",
    );
    write(
        d.path(),
        "data/t.jsonl",
        "{\"text\": \"Great crew, thanks\"}\n{\"text\": null}\n{\"text\": \"The seat was broken\"}\n\n{\"text\": \"Lost my bag\", \"x\": 1}\n",
    );
    let batch = RecordBatch::try_from_iter([(
        "text",
        Arc::new(StringArray::from(vec![
            Some("Great crew, thanks"),
            None,
            Some("The seat was broken"),
            Some("Lost my bag"),
        ])) as _,
    )])
    .unwrap();
    let f = std::fs::File::create(d.path().join("data/t.parquet")).unwrap();
    let mut w = datafusion::parquet::arrow::ArrowWriter::try_new(f, batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();

    let mut outputs = Vec::new();
    for file in ["data/t.csv", "data/t.jsonl", "data/t.parquet"] {
        let p = source_suite(d.path(), file);
        let cases = generate::expand(&p).unwrap();
        let bases: Vec<&str> = cases
            .iter()
            .filter(|c| c.role == "base")
            .map(|c| c.input.as_str())
            .collect();
        assert_eq!(
            bases,
            vec!["Great crew, thanks", "The seat was broken", "Lost my bag"],
            "{file}"
        );
        assert!(
            cases.iter().all(|c| c.expected.is_none()),
            "no labels needed"
        );
        assert_eq!(
            cases.iter().filter(|c| c.role == "perturbed").count(),
            6,
            "{file}"
        );
        outputs.push(cases.iter().map(|c| c.input.clone()).collect::<Vec<_>>());
    }
    // Seed-reproducible.
    let again = generate::expand(&source_suite(d.path(), "data/t.parquet")).unwrap();
    assert_eq!(
        outputs[2],
        again.iter().map(|c| c.input.clone()).collect::<Vec<_>>()
    );
    // Row numbers make the clusters: CSV line numbers (header = line 1).
    let p = source_suite(d.path(), "data/t.csv");
    let cases = generate::expand(&p).unwrap();
    assert!(
        cases[0].template_id.ends_with("/row2"),
        "{}",
        cases[0].template_id
    );
}

#[test]
fn source_errors_name_the_file_and_column() {
    let d = tempfile::tempdir().unwrap();
    write(d.path(), "data/t.csv", "id,body\n1,hello\n");
    let p = source_suite(d.path(), "data/t.csv");
    let e = generate::expand(&p).unwrap_err().to_string();
    assert!(e.contains("t.csv:1: field `text`: no column `text`"), "{e}");
    write(
        d.path(),
        "data/t.jsonl",
        "{\"text\": \"ok\"}\n{\"text\": 3}\n",
    );
    let p = source_suite(d.path(), "data/t.jsonl");
    let e = generate::expand(&p).unwrap_err().to_string();
    assert!(
        e.contains("t.jsonl:2: field `text`: expected a string"),
        "{e}"
    );
    let e = expand_err(
        d.path(),
        r#"
[[test]]
name = "t"
capability = "Robustness"
type = "INV"
source = { file = "data/missing.csv", column = "text" }
perturb = "typos"
"#,
    );
    assert!(
        e.contains("field `test.source.file`") && e.contains("missing.csv"),
        "{e}"
    );
    let e = expand_err(
        d.path(),
        r#"
[[test]]
name = "t"
capability = "Robustness"
type = "MFT"
source = { file = "data/t.csv", column = "text" }
expected = "positive"
"#,
    );
    assert!(e.contains("has no labels"), "{e}");
}

/// A rephrasing model for tests: answers "Paraphrase k of: <text>" for sample k, or an
/// error for every request while `fail` is set.
#[derive(Default)]
struct FakeRephraser {
    calls: AtomicUsize,
    fail: AtomicBool,
}

#[async_trait::async_trait]
impl Provider for FakeRephraser {
    async fn complete(&self, req: &CallRequest) -> CallResult {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.fail.load(Ordering::SeqCst) {
            return CallResult {
                error: Some("HTTP 503: down".into()),
                http_status: Some(503),
                attempts: 1,
                ..CallResult::default()
            };
        }
        let text = req.prompt.rsplit("\n\n").next().unwrap_or("");
        CallResult {
            response: Some(format!("\"Paraphrase {} of: {text}\"", req.sample_idx)),
            attempts: 1,
            ..CallResult::default()
        }
    }
}

fn rephrase_suite(dir: &Path) -> Pipeline {
    load(
        dir,
        r#"
[rephrase]
provider = "openai"
base_url = "http://127.0.0.1:9/v1"
name = "paraphraser"
temperature = 0.0
concurrency = 4

[[test]]
name = "rephrasings"
capability = "Robustness"
type = "INV"
templates = ["Where is order {n}?"]
perturb = "rephrase"
n_perturb = 2

[lexicons]
n = ["1", "2", "3", "4", "5"]
"#,
    )
    .unwrap()
}

/// Every case of `p`, rephrased by `provider` with its calls recorded under `root`.
fn rephrased(p: &Pipeline, provider: Arc<FakeRephraser>, root: &Path) -> Vec<Case> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let root = RunStore::open(root.to_str().unwrap()).unwrap();
    let mut s = CaseStream::new(p).unwrap().with_rephraser(provider, &root);
    let mut cases = Vec::new();
    while let Some(b) = rt.block_on(s.next_batch(1000)).unwrap() {
        cases.extend(b);
    }
    cases
}

/// The paraphrases are asked through the call stage (a nested run under the root's
/// `rephrase/`), sample k of a base being the provider's k-th answer; a second generate on
/// the same root asks nothing again and makes the same cases.
#[test]
fn rephrase_asks_the_model_through_the_provider() {
    let d = tempfile::tempdir().unwrap();
    let p = rephrase_suite(d.path());
    let provider = Arc::new(FakeRephraser::default());
    let root = d.path().join("run");
    let cases = rephrased(&p, provider.clone(), &root);
    assert_eq!(provider.calls.load(Ordering::SeqCst), 10);
    assert_eq!(cases.len(), 15);
    let first: Vec<&str> = cases[..3].iter().map(|c| c.input.as_str()).collect();
    assert_eq!(
        first,
        vec![
            "Where is order 1?",
            "Paraphrase 0 of: Where is order 1?",
            "Paraphrase 1 of: Where is order 1?"
        ]
    );
    assert!(
        cases
            .iter()
            .filter(|c| c.role == "perturbed")
            .all(|c| c.perturbation.as_deref() == Some("rephrase"))
    );
    let nested = std::fs::read_dir(root.join("rephrase"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().join("cases").is_dir())
        .count();
    assert_eq!(nested, 1, "one nested run: one model, prompt and n");
    let again = rephrased(&p, provider.clone(), &root);
    assert_eq!(
        provider.calls.load(Ordering::SeqCst),
        10,
        "nothing asked twice"
    );
    assert_eq!(again, cases);
    // Without a rephrase model set up, generation stops with a clear error.
    let e = generate::expand(&p).unwrap_err();
    assert!(matches!(e, GenerateError::Call(_)), "{e}");
    assert!(e.to_string().contains("rephrase"), "{e}");
}

/// A rephrase call that failed for every sample fails generate naming the test and the
/// input, not an empty perturbation; a later generate asks the failed calls again.
#[test]
fn a_failed_rephrase_fails_generate_naming_test_and_input() {
    let d = tempfile::tempdir().unwrap();
    let p = rephrase_suite(d.path());
    let root = d.path().join("run");
    let failing = Arc::new(FakeRephraser::default());
    failing.fail.store(true, Ordering::SeqCst);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = RunStore::open(root.to_str().unwrap()).unwrap();
    let mut s = CaseStream::new(&p)
        .unwrap()
        .with_rephraser(failing.clone(), &store);
    let e = rt.block_on(s.next_batch(1000)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, GenerateError::Rephrase { .. }), "{msg}");
    assert_eq!(
        msg,
        "test `rephrasings`: rephrase of \"Where is order 1?\" failed: HTTP 503: down; HTTP 503: down"
    );
    let provider = Arc::new(FakeRephraser::default());
    let cases = rephrased(&p, provider.clone(), &root);
    assert_eq!(
        provider.calls.load(Ordering::SeqCst),
        10,
        "the failed calls asked again"
    );
    assert_eq!(cases.len(), 15);
}

#[test]
fn rephrase_refuses_a_classifier_model() {
    let d = tempfile::tempdir().unwrap();
    let e = expand_err(
        d.path(),
        r#"
[[test]]
name = "r"
capability = "Robustness"
type = "INV"
templates = ["Hello there."]
perturb = "rephrase"
"#,
    );
    assert!(e.contains("add a [rephrase] table"), "{e}");
}

/// A masked-LM stand-in: answers a numbered list.
struct FakeSuggester;

#[async_trait::async_trait]
impl Provider for FakeSuggester {
    async fn complete(&self, req: &CallRequest) -> CallResult {
        assert!(req.prompt.contains("I really {mask} the flight."));
        CallResult {
            response: Some("1. enjoyed\n2. liked\n3. loved\n4. regret\n5. liked".into()),
            attempts: 1,
            ..CallResult::default()
        }
    }
}

#[test]
fn suggest_returns_candidates_for_the_mask() {
    let d = tempfile::tempdir().unwrap();
    let p = rephrase_suite(d.path());
    let model = p.rephrase.clone().unwrap();
    let got = futures::executor::block_on(generate::suggest::suggest(
        &FakeSuggester,
        &model,
        "I really {mask} the flight.",
        10,
    ))
    .unwrap();
    assert_eq!(got, vec!["enjoyed", "liked", "loved", "regret"]);
    let e = futures::executor::block_on(generate::suggest::suggest(
        &FakeSuggester,
        &model,
        "no mask",
        3,
    ))
    .unwrap_err();
    assert!(e.contains("{mask}"), "{e}");
}

#[test]
fn suggest_without_a_generative_model_exits_2() {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_evalflow"))
        .current_dir(repo())
        .args([
            "suggest",
            "I really {mask} the flight.",
            "--pipeline",
            "pipelines/sentiment.toml",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no generative model"));
}

/// Streaming: batches stay bounded and the stream yields every case once.
#[test]
fn case_stream_batches_are_bounded() {
    let d = tempfile::tempdir().unwrap();
    let path = write(d.path(), "p.toml", &sample_suite(3));
    let p = Pipeline::load(&path).unwrap();
    let mut s = CaseStream::new(&p).unwrap();
    let mut n = 0;
    while let Some(b) = futures::executor::block_on(s.next_batch(16)).unwrap() {
        assert!(b.len() <= 16 + 3, "a base and its variants are never split");
        n += b.len();
    }
    assert_eq!(n, generate::expand(&p).unwrap().len());
}

/// The LLM-application suite expands (rephrasings from a stand-in model) into every
/// capability x test type cell it promises.
#[test]
fn support_bot_suite_expands() {
    let p = Pipeline::load(&repo().join("pipelines/support-bot.toml")).unwrap();
    assert_eq!(p.model.provider, "openai");
    assert_eq!(
        p.model.base_url.as_deref(),
        Some("http://127.0.0.1:8089/v1")
    );
    let provider = Arc::new(FakeRephraser::default());
    let d = tempfile::tempdir().unwrap();
    let cases = rephrased(&p, provider.clone(), &d.path().join("run"));
    assert!(provider.calls.load(Ordering::SeqCst) > 0);
    let cells: HashSet<(String, String)> = cases
        .iter()
        .map(|c| (c.capability.clone(), c.test_type.clone()))
        .collect();
    for cell in [
        ("Scope", "MFT"),
        ("Scope", "INV"),
        ("Policy", "MFT"),
        ("Policy", "INV"),
        ("Refunds", "MFT"),
        ("Refunds", "DIR"),
    ] {
        assert!(cells.contains(&(cell.0.into(), cell.1.into())), "{cell:?}");
    }
    assert!(cases.len() > 300 && cases.len() < 3000, "{}", cases.len());
    // Known answers on MFT rows; DIR perturbed rows carry the label they should move to.
    assert!(
        cases
            .iter()
            .filter(|c| c.test_type == "MFT")
            .all(|c| c.expected.is_some())
    );
    assert!(
        cases
            .iter()
            .filter(|c| c.test_type == "DIR" && c.role == "perturbed")
            .all(|c| c.expected.is_some() && c.expectation.is_some())
    );
    let ids: HashSet<&str> = cases.iter().map(|c| c.case_id.as_str()).collect();
    assert_eq!(ids.len(), cases.len());
}

/// Answers rephrase requests with its tag, so a case shows which provider made it.
struct TaggedRephraser {
    tag: &'static str,
    calls: AtomicUsize,
}

#[async_trait::async_trait]
impl Provider for TaggedRephraser {
    async fn complete(&self, req: &CallRequest) -> CallResult {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let text = req.prompt.rsplit("\n\n").next().unwrap_or("");
        CallResult {
            response: Some(format!("{} {}: {text}", self.tag, req.sample_idx)),
            attempts: 1,
            ..CallResult::default()
        }
    }
}

/// Two rephrase tests naming two models (`[rephrase]` and `[judge]`): each test's
/// paraphrases come from its own model's provider, never from the first test's.
#[test]
fn rephrase_tests_naming_different_models_ask_each_its_own() {
    let d = tempfile::tempdir().unwrap();
    let p = load(
        d.path(),
        r#"
[rephrase]
provider = "openai"
base_url = "http://127.0.0.1:9/v1"
name = "paraphraser"
temperature = 0.0

[judge]
provider = "openai"
base_url = "http://127.0.0.1:10/v1"
name = "judge"
temperature = 0.0

[[test]]
name = "by_rephrase"
capability = "Robustness"
type = "INV"
templates = ["Where is order {n}?"]
perturb = { op = "rephrase", model = "rephrase" }
n_perturb = 2

[[test]]
name = "by_judge"
capability = "Robustness"
type = "INV"
templates = ["When does order {n} ship?"]
perturb = { op = "rephrase", model = "judge" }
n_perturb = 1

[lexicons]
n = ["1", "2", "3"]
"#,
    )
    .unwrap();
    let models: Vec<&str> = generate::rephrase_models(&p)
        .iter()
        .map(|(t, m)| {
            assert_eq!(
                m.name,
                if *t == "rephrase" {
                    "paraphraser"
                } else {
                    "judge"
                }
            );
            *t
        })
        .collect();
    assert_eq!(models, ["rephrase", "judge"]);
    let (a, b) = (
        Arc::new(TaggedRephraser {
            tag: "A",
            calls: AtomicUsize::new(0),
        }),
        Arc::new(TaggedRephraser {
            tag: "B",
            calls: AtomicUsize::new(0),
        }),
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let root = RunStore::open(d.path().join("run").to_str().unwrap()).unwrap();
    let mut s = CaseStream::new(&p)
        .unwrap()
        .with_rephraser(a.clone(), &root)
        .with_rephraser_for("judge", b.clone());
    let mut cases = Vec::new();
    while let Some(batch) = rt.block_on(s.next_batch(1000)).unwrap() {
        cases.extend(batch);
    }
    assert_eq!(
        (
            a.calls.load(Ordering::SeqCst),
            b.calls.load(Ordering::SeqCst)
        ),
        (6, 3)
    );
    let perturbed = |test: &str| -> Vec<String> {
        cases
            .iter()
            .filter(|c| c.test == test && c.role == "perturbed")
            .map(|c| c.input.clone())
            .collect()
    };
    let (ra, rb) = (perturbed("by_rephrase"), perturbed("by_judge"));
    assert_eq!(ra.len(), 6);
    assert!(ra.iter().all(|t| t.starts_with("A ")), "{ra:?}");
    assert_eq!(
        rb,
        [
            "B 0: When does order 1 ship?",
            "B 0: When does order 2 ship?",
            "B 0: When does order 3 ship?"
        ]
    );
}
