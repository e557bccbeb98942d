//! The CLI in a child process, for the tests that kill it (crash tests): the test binary
//! re-runs itself as its `child_evalflow` test, which each test file declares as
//! `#[test] fn child_evalflow() { child::run_if_child() }`, so a crash point's
//! `std::process::abort` ends the child and not the test.
#![allow(dead_code)]

use std::process::{Command, Output};

/// The variable that carries the child's arguments (JSON).
pub const ARGS_ENV: &str = "EVALFLOW_CHILD_ARGS";

/// `evalflow ARGS` as this test binary re-run as its `child_evalflow` test.
pub fn command<S: AsRef<str>>(args: &[S]) -> Command {
    let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        "--exact",
        "child_evalflow",
        "--nocapture",
        "--test-threads=1",
        "-q",
    ])
    .env(ARGS_ENV, serde_json::to_string(&args).unwrap());
    c
}

/// Runs `evalflow ARGS` in a child process with `envs` (and no inherited crash point) to
/// its end.
pub fn child(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut c = command(args);
    c.env_remove("EVALFLOW_CRASH_AT");
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// Runs the CLI and exits with its code when started by [`command`]; returns at once
/// otherwise (the `child_evalflow` test is then a no-op).
pub fn run_if_child() {
    use clap::Parser;
    let Ok(args) = std::env::var(ARGS_ENV) else {
        return;
    };
    let args: Vec<String> = serde_json::from_str(&args).unwrap();
    let cli =
        evalflow::cli::Cli::try_parse_from(std::iter::once("evalflow".to_string()).chain(args))
            .unwrap_or_else(|e| {
                eprintln!("{e}");
                std::process::exit(2)
            });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let code = match rt.block_on(evalflow::cli::run(cli)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code() as i32
        }
    };
    std::process::exit(code);
}
