//! Unit tests of the pipeline file's reading and checks.
use super::*;

const BASE: &str = "[model]\nprovider = \"builtin:vader\"\nname = \"v\"\n\n[suite]\nname = \"s\"\n";

fn err(text: &str) -> String {
    Pipeline::parse(text, Path::new("p.toml"))
        .unwrap_err()
        .to_string()
}

#[test]
fn lexicon_errors_point_at_the_lexicon_not_a_lookalike() {
    // `bad_adj =` contains `adj =`: a text search would name line 8.
    let e = err(&format!(
        "{BASE}\n[lexicons]\nbad_adj = [\"x\"]\nadj = []\n"
    ));
    assert_eq!(e, "p.toml:10: field `lexicons.adj`: lexicon is empty");
}

#[test]
fn empty_scorers_and_questions_and_other_models_are_checked_at_load() {
    let e = err(&format!("{BASE}\n[score]\nscorers = []\n"));
    assert!(e.starts_with("p.toml:9: field `score.scorers`"), "{e}");
    let e = err(&format!(
        "{BASE}\n[judge]\nprovider = \"openai\"\nname = \"j\"\n\n[score.judge]\nquestions = []\n"
    ));
    assert!(
        e.starts_with("p.toml:13: field `score.judge.questions`"),
        "{e}"
    );
    let e = err(&format!("{BASE}\n[score]\nscorers = [\"judge\"]\n"));
    assert!(
        e.contains("field `score.scorers`") && e.contains("[score.judge]"),
        "{e}"
    );
    let e = err(&format!(
        "{BASE}\n[rephrase]\nprovider = \"nope\"\nname = \"r\"\n"
    ));
    assert!(e.starts_with("p.toml:9: field `rephrase.provider`"), "{e}");
    let e = err(&format!(
        "{BASE}\n[judge]\nprovider = \"openai\"\nname = \"j\"\nconcurrency = 0\n"
    ));
    assert!(e.starts_with("p.toml:11: field `judge.concurrency`"), "{e}");
}

/// `[rephrase] batch = true` is read like the same key on `[model]` and `[judge]`: the
/// rephrase calls go through the call stage, batch mode included (docs/batch.md).
#[test]
fn a_rephrase_model_in_batch_mode_is_read() {
    let text = format!("{BASE}\n[rephrase]\nprovider = \"openai\"\nname = \"r\"\nbatch = true\n");
    let p = Pipeline::parse(&text, Path::new("p.toml")).unwrap();
    assert!(p.rephrase.as_ref().is_some_and(|m| m.batch));
    assert!(!p.model.batch);
}

/// A scorer name is resolved when the file is read, before any stage runs.
#[test]
fn unknown_scorer_names_the_field_at_load() {
    let e = err(&format!(
        "{BASE}\n[score]\nscorers = [\"checklist\", \"chekclist\"]\n"
    ));
    assert_eq!(
        e,
        "p.toml:9: field `score.scorers`: unknown scorer `chekclist` (known: checklist, cue, judge)"
    );
    let e = err(&format!("{BASE}\n[score]\nscorers = [\"checklist@0\"]\n"));
    assert!(
        e.starts_with("p.toml:9: field `score.scorers`: scorer `checklist@0`"),
        "{e}"
    );
}

#[test]
fn invalid_utf8_names_line_and_column() {
    let e = utf8_text(b"a = 1\nb = \"x\xff\"\n".to_vec(), "p.toml")
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "p.toml:2: column 7: invalid UTF-8 (the file must be UTF-8 text)"
    );
}
