//! A root on a disk that fills up mid-run (issue 60, item 2): a small tmpfs in a private mount
//! namespace (`unshare -m`, or `-rm` without root), filled but for a few hundred KB so that
//! each run stops at another write (cases, the call journal, calls, validity, scores, results,
//! the report, the manifest). The run exits naming the path and "No space left"; once space is
//! freed the same command completes, `verify` finds nothing, and the tables equal a run's on
//! an ample disk.

use std::path::Path;
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

/// The `unshare` arguments that give a private mount namespace here, if any.
fn namespace() -> Option<Vec<&'static str>> {
    [vec!["-m"], vec!["-rm"]].into_iter().find(|args| {
        Command::new("unshare")
            .args(args)
            .args([
                "sh",
                "-c",
                "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d && umount $d",
            ])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

#[test]
fn a_full_disk_stops_a_run_naming_the_path_and_the_run_completes_once_space_is_freed() {
    let Some(ns) = namespace() else {
        eprintln!(
            "SKIPPED: no private mount namespace here (unshare -m / -rm cannot mount a tmpfs); \
             the full-disk test needs one"
        );
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference");
    let o = bin()
        .args(["run", "pipelines/sentiment.toml", "--out"])
        .arg(&reference)
        .output()
        .unwrap();
    ok(&o, "reference run");
    let want = tables(&reference);
    // Stage by stage: before each, the disk is filled but for a few KB; the stage fails
    // naming the file it was writing; with the filler gone the same verb completes.
    let script = tmp.path().join("full.sh");
    std::fs::write(
        &script,
        r#"set -u
BIN=$1; OUT=$2
D=$(mktemp -d)
mount -t tmpfs -o size=8m tmpfs "$D" || exit 90
for step in generate:64 call:64 validate:16 score:16 aggregate:0; do
  verb=${step%%:*}; free=${step##*:}
  avail=$(df --output=avail -k "$D" | tail -1)
  fallocate -l $(( (avail - free) * 1024 )) "$D/filler" || exit 91
  "$BIN" $verb pipelines/sentiment.toml --out "$D/run" > "$OUT/$verb.first.out" 2>&1
  echo $? > "$OUT/$verb.first.rc"
  rm "$D/filler"
  "$BIN" $verb pipelines/sentiment.toml --out "$D/run" > "$OUT/$verb.second.out" 2>&1
  echo $? > "$OUT/$verb.second.rc"
done
cp -a "$D/run" "$OUT/run"
umount "$D"
"#,
    )
    .unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let o = Command::new("unshare")
        .args(&ns)
        .arg("sh")
        .arg(&script)
        .arg(env!("CARGO_BIN_EXE_evalflow"))
        .arg(&out)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(o.status.success(), "the script failed: {o:?}");
    let read = |f: &str| std::fs::read_to_string(out.join(f)).unwrap();
    let mut stopped_at = Vec::new();
    for verb in ["generate", "call", "validate", "score", "aggregate"] {
        let first = read(&format!("{verb}.first.out"));
        // Stopped: an I/O failure (exit 3) naming the file and the full disk.
        assert_eq!(
            read(&format!("{verb}.first.rc")).trim(),
            "3",
            "{verb}: {first}"
        );
        let line = first
            .lines()
            .find(|l| l.starts_with("error:"))
            .unwrap_or_else(|| panic!("{verb}: no error line: {first}"));
        assert!(
            line.contains("No space left on device") && line.contains("/run/"),
            "{verb}: {line}"
        );
        stopped_at.push(format!("{verb}: {line}"));
        let second = read(&format!("{verb}.second.out"));
        assert_eq!(
            read(&format!("{verb}.second.rc")).trim(),
            "0",
            "{verb}: {second}"
        );
    }
    eprintln!("stopped at:\n{}", stopped_at.join("\n"));
    let run = out.join("run");
    let v = bin().arg("verify").arg(&run).output().unwrap();
    ok(&v, "verify");
    let got = tables(&run);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g == w,
            "table {i} differs after the disk filled at every stage"
        );
    }
}
