//! The house rules of docs/architecture.md, checked on every test run: no import circles
//! among the library's files and no module that uses a higher layer
//! (`scripts/check_layers.py`), no source file over 1,000 lines and no line over 150
//! characters.

use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn layers_point_down_with_no_import_circles() {
    let o = Command::new("python3")
        .arg("scripts/check_layers.py")
        .arg("src")
        .current_dir(repo())
        .output()
        .expect("python3 runs");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("0 import circles, 0 upward edges"), "{out}");
}

/// Every `.rs` file under `dir`, recursively, sorted.
fn rust_files(dir: &std::path::Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("source directory reads")
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// One purpose per room: a source file over 1,000 lines has more than one, and a line over
/// 150 characters is read by scrolling. Lists every offender, not just the first.
#[test]
fn source_files_stay_short_and_narrow() {
    let mut files = Vec::new();
    rust_files(&repo().join("src"), &mut files);
    assert!(files.len() > 50, "found only {} source files", files.len());
    let mut bad = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("source reads");
        let name = f.strip_prefix(repo()).unwrap_or(f).display().to_string();
        let lines = text.lines().count();
        if lines > 1000 {
            bad.push(format!("{name}: {lines} lines (at most 1,000)"));
        }
        for (i, l) in text.lines().enumerate() {
            let chars = l.chars().count();
            if chars > 150 {
                bad.push(format!(
                    "{name}:{}: {chars} characters (at most 150)",
                    i + 1
                ));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
