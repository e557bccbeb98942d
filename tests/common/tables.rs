//! A run root's tables as JSON, for tests that compare a run that met faults with one that
//! did not: each table sorted by its id, without the columns that record when and how fast a
//! call ran, results' intervals to 12 decimals (templates fold in another order).
#![allow(dead_code)]

use std::process::{Command, Output};

/// `evalflow` from the repository root with `env` added.
pub fn bin(env: &[(&'static str, String)]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_evalflow"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"))
        .envs(env.iter().cloned());
    c
}

/// Asserts that `o` succeeded; returns its stderr.
pub fn ok(o: &Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        o.status.success(),
        "{what}: {}\n{err}",
        String::from_utf8_lossy(&o.stdout)
    );
    err
}

/// The five tables of the run at `root` (a path or URL), read through `env`.
pub fn tables(root: &str, env: &[(&'static str, String)]) -> Vec<String> {
    [
        "SELECT * FROM cases ORDER BY case_id",
        "SELECT * EXCLUDE (latency_ms, started_at) FROM calls ORDER BY call_id",
        "SELECT * FROM validity ORDER BY call_id",
        "SELECT * FROM scores ORDER BY call_id",
        "SELECT * EXCLUDE (se, ci_lo, ci_hi), round(ci_lo, 12), round(ci_hi, 12) FROM results \
         ORDER BY level, capability, test_type, test",
    ]
    .iter()
    .map(|q| {
        let o = bin(env)
            .args(["sql", "--format", "json", "--run", root, q])
            .output()
            .unwrap();
        ok(&o, q);
        String::from_utf8(o.stdout).unwrap()
    })
    .collect()
}
