//! `evalflow verify` (issue 60, item 4): damage done to a run root from outside is named part
//! by part, `--repair` moves it aside without deleting anything, and the same `evalflow run`
//! then restores the tables of the undamaged run.

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "common/tables.rs"]
mod tables;

use tables::ok;

fn bin() -> Command {
    tables::bin(&[])
}

/// The run's tables ([`tables::tables`]).
fn tables(root: &Path) -> Vec<String> {
    tables::tables(root.to_str().unwrap(), &[])
}

fn run(root: &Path) {
    let o = bin()
        .args(["run", "pipelines/sentiment.toml", "--out"])
        .arg(root)
        .output()
        .unwrap();
    ok(&o, "run");
}

fn verify(root: &Path, repair: bool) -> (i32, String) {
    let mut c = bin();
    c.arg("verify").arg(root);
    if repair {
        c.arg("--repair");
    }
    let o = c.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.code().unwrap(), text)
}

/// The only part of a table folder.
fn part(root: &Path, dir: &str) -> PathBuf {
    let parts: Vec<PathBuf> = std::fs::read_dir(root.join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    assert_eq!(parts.len(), 1, "{dir}: {parts:?}");
    parts[0].clone()
}

/// The rows of `sql` over the run, as JSON.
fn rows(root: &Path, sql: &str) -> String {
    let o = bin()
        .args(["sql", "--format", "json", "--run"])
        .arg(root)
        .arg(sql)
        .output()
        .unwrap();
    ok(&o, sql);
    String::from_utf8(o.stdout).unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let t = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &t);
        } else {
            std::fs::copy(e.path(), t).unwrap();
        }
    }
}

#[test]
fn every_damage_is_named_and_repair_then_run_restores_the_tables() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    run(&good);
    let (code, text) = verify(&good, false);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("ok: no problem found"), "{text}");
    let want = tables(&good);

    let bad = tmp.path().join("bad");
    copy_dir(&good, &bad);
    // Four kinds of damage: a truncated part, a deleted one, one replaced by another
    // table's part, and bytes overwritten inside a part's pages.
    let calls = part(&bad, "calls");
    let len = std::fs::metadata(&calls).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&calls)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    std::fs::remove_file(part(&bad, "scores/checklist@2")).unwrap();
    std::fs::copy(part(&bad, "results"), part(&bad, "validity")).unwrap();
    let cases = part(&bad, "cases");
    let mut bytes = std::fs::read(&cases).unwrap();
    let mid = bytes.len() / 3;
    bytes[mid..mid + 64].iter_mut().for_each(|b| *b ^= 0x5a);
    std::fs::write(&cases, bytes).unwrap();

    let (code, text) = verify(&bad, false);
    assert_eq!(code, 1, "{text}");
    let name = |p: &Path| p.file_name().unwrap().to_string_lossy().to_string();
    for (what, needle) in [
        (
            "truncated calls part",
            format!("calls/{}: damaged", name(&calls)),
        ),
        ("replaced validity part", "validity/".to_string()),
        (
            "overwritten cases part",
            format!("cases/{}: damaged", name(&cases)),
        ),
        (
            "deleted scores part",
            "scores/checklist@2: the manifest records".to_string(),
        ),
    ] {
        assert!(text.contains(&needle), "{what} not named:\n{text}");
    }
    assert_eq!(text.matches("problem: ").count(), 4, "{text}");
    // Reading verbs refuse a damaged part, naming it, rather than reading fewer rows.
    let o = bin()
        .args(["sql", "--run"])
        .arg(&bad)
        .arg("SELECT count(*) FROM calls")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("calls/"));

    let (code, text) = verify(&bad, true);
    assert_eq!(code, 0, "{text}");
    // Moved, never deleted: the damaged bytes are still there to look at.
    assert!(
        bad.join("_damaged/calls").join(name(&calls)).exists(),
        "{text}"
    );
    assert!(
        bad.join("_damaged/cases").join(name(&cases)).exists(),
        "{text}"
    );
    assert!(text.contains("reopened:"), "{text}");

    run(&bad);
    let (code, text) = verify(&bad, false);
    assert_eq!(code, 0, "{text}");
    let got = tables(&bad);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(g == w, "table {i} differs after repair and run");
    }
}

/// A run that lost validity verdicts for calls that are still there: the missing verdicts are
/// named (validate finished), and duplicated ids are counted.
#[test]
fn missing_verdicts_and_duplicated_calls_are_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("r");
    run(&root);
    let calls = part(&root, "calls");
    let copy = calls.with_file_name("part-copy.parquet");
    std::fs::copy(&calls, &copy).unwrap();
    let (code, text) = verify(&root, false);
    assert_eq!(code, 1, "{text}");
    let n: serde_json::Value = serde_json::from_str(&rows(
        &root,
        "SELECT count(DISTINCT call_id) AS n FROM calls",
    ))
    .unwrap();
    let n = n[0]["n"].to_string();
    assert!(
        text.contains(&format!("{n} call ids that occur more than once")),
        "{text}"
    );
    assert!(text.contains("calls: the manifest records"), "{text}");
    std::fs::remove_file(&copy).unwrap();
    std::fs::remove_file(part(&root, "validity")).unwrap();
    let (code, text) = verify(&root, false);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains(&format!(
            "validity: {n} calls without a verdict (the validate stage finished)"
        )),
        "{text}"
    );
}
