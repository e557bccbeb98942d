//! A flaky object store (issue 60, item 3): moto behind `tests/fault_proxy.py`, which answers
//! 503 SlowDown, 500, resets, slow answers and answers lost after the store committed. A run
//! of the default pipeline on that root completes with the tables of a run on a local disk,
//! says how many faults it retried, and the lease survives its own lost create.

#[path = "common/moto.rs"]
mod moto;
#[path = "common/tables.rs"]
mod tables;

use moto::{FaultProxy, Moto};
use tables::{bin, ok, tables};

#[test]
fn a_run_on_a_flaky_store_completes_with_the_tables_of_a_steady_one() {
    let tmp = tempfile::tempdir().unwrap();
    let local = tmp.path().join("local");
    let local = local.to_str().unwrap();
    let o = bin(&[])
        .args(["run", "pipelines/sentiment.toml", "--out", local])
        .output()
        .unwrap();
    ok(&o, "local run");
    let want = tables(local, &[]);

    let moto = Moto::start("flaky");
    let proxy = FaultProxy::start(&moto.endpoint, 0.1, 7);
    // Short backoff bounds keep the test quick; the faults are what is tested.
    let mut env = proxy.env(&moto);
    env.push(("EVALFLOW_STORE_RETRIES", "10".into()));
    let root = "s3://flaky/runs/r1";
    let o = bin(&env)
        .args(["run", "pipelines/sentiment.toml", "--out", root])
        .output()
        .unwrap();
    let err = ok(&o, "flaky run");
    let faults = proxy.faults();
    let injected: u64 = ["503", "500", "reset", "slow", "lost"]
        .iter()
        .map(|k| faults[k].as_u64().unwrap())
        .sum();
    eprintln!("injected: {faults}");
    assert!(injected >= 5, "too few faults to mean anything: {faults}");
    assert!(
        err.contains("transient fault(s)") && err.contains("met and retried"),
        "{err}"
    );
    // Read back through the same faults, and checked whole.
    let o = bin(&env).args(["verify", root]).output().unwrap();
    ok(&o, "verify");
    let got = tables(root, &env);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g == w,
            "table {i} differs between the flaky and the steady root"
        );
    }
}

/// The soak's finding: object_store sends S3 deletes as a multi-object `POST ?delete` that it
/// does not retry after a dropped connection, so a reset (or an answer lost after the delete
/// went through) ended the command. Each delete here meets one half of the time (a handful
/// of deletes in a run: the lease's release, the results' replacement); the run completes,
/// twice over.
#[test]
fn deletes_survive_dropped_connections() {
    let moto = Moto::start("bulkrm");
    let proxy = FaultProxy::start_with(
        &moto.endpoint,
        0.5,
        11,
        &["--kinds", "reset,lost", "--only", "?delete"],
    );
    let env = proxy.env(&moto);
    for _ in 0..2 {
        let o = bin(&env)
            .args([
                "run",
                "pipelines/sentiment.toml",
                "--out",
                "s3://bulkrm/runs/r1",
            ])
            .output()
            .unwrap();
        ok(&o, "run with faulty deletes");
    }
    let faults = proxy.faults();
    let hit = faults["reset"].as_u64().unwrap() + faults["lost"].as_u64().unwrap();
    assert!(hit >= 1, "no delete met a fault: {faults}");
    let o = bin(&env)
        .args(["verify", "s3://bulkrm/runs/r1"])
        .output()
        .unwrap();
    ok(&o, "verify");
}
