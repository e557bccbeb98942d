//! `evalflow mock-server`: the fault-injecting OpenAI / Anthropic mock on loopback.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::CliError;
use crate::mock::{
    AnswerMode, BatchConfig, BatchFault, Fault, MockConfig, MockServer, parse_batch_fault,
    parse_fault_spec,
};

#[derive(Debug, clap::Args)]
pub struct MockServerArgs {
    /// Address to listen on (port 0 picks a free port; the first line printed names it).
    #[arg(long, default_value = "127.0.0.1:8089")]
    pub addr: SocketAddr,
    /// Delay before every answer, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Inject a fault at a rate, e.g. `rate_limit=0.1` (repeatable; rates sum to at most 1).
    /// Kinds: rate_limit, server_error, out_of_credit, reset, hang, malformed_json,
    /// empty_length, truncated.
    #[arg(long = "fault", value_name = "KIND=RATE", value_parser = parse_fault)]
    pub faults: Vec<(Fault, f64)>,
    /// Seed of the fault draws: the same seed and requests give the same faults.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Append one JSON line per request received to this file: its request hash, arrival
    /// time (`t`, Unix seconds), fault and the token `usage` its answer reports.
    #[arg(long)]
    pub request_log: Option<PathBuf>,
    /// How to answer: `echo` the last user message, its `vader` sentiment label, or as a
    /// `checklist` judge (a seeded YES/NO for every `Qk:` line).
    #[arg(long, default_value = "echo", value_parser = ["echo", "vader", "checklist"])]
    pub answer: String,
    /// Seconds sent in `Retry-After` with a 429.
    #[arg(long, default_value_t = 1)]
    pub retry_after: u64,
    /// Batch API time scale: seconds from a batch's creation until it is final (the real
    /// APIs take up to 24 hours). OpenAI's files and batches (`/v1/files`, `/v1/batches`)
    /// and Anthropic's Message Batches (`/v1/messages/batches`) answer each request as the
    /// synchronous endpoint would, with the same `--fault` draws.
    #[arg(long, default_value_t = 1.0)]
    pub batch_secs: f64,
    /// Inject a batch fault at a rate, e.g. `expire=0.5` (repeatable). Kinds: invalid (the
    /// batch fails validation; Anthropic: every request errors with invalid_request_error),
    /// expire (it expires with half of its lines answered),
    /// poll_error (a retrieve answers 500), cut_results (the first download of a result
    /// file stops mid-line).
    #[arg(long = "batch-fault", value_name = "KIND=RATE", value_parser = parse_batch_fault)]
    pub batch_faults: Vec<(BatchFault, f64)>,
}

fn parse_fault(s: &str) -> Result<(Fault, f64), String> {
    parse_fault_spec(s)
}

/// Serves until interrupted.
pub async fn run(a: MockServerArgs) -> Result<(), CliError> {
    let cfg = MockConfig {
        latency: Duration::from_millis(a.latency_ms),
        faults: a.faults,
        seed: a.seed,
        request_log: a.request_log,
        answer: match a.answer.as_str() {
            "vader" => AnswerMode::Vader,
            "checklist" => AnswerMode::Checklist,
            _ => AnswerMode::Echo,
        },
        retry_after_secs: a.retry_after,
    };
    if !(a.batch_secs >= 0.0 && a.batch_secs.is_finite()) {
        return Err(CliError::BadInput(format!(
            "--batch-secs {}: must be a number of seconds >= 0",
            a.batch_secs
        )));
    }
    let batch = BatchConfig {
        complete_after: Duration::from_secs_f64(a.batch_secs),
        faults: a.batch_faults,
    };
    let mut server = MockServer::start_with(a.addr, cfg, batch)
        .await
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidInput {
                CliError::BadInput(format!("--fault: {e}"))
            } else {
                CliError::Internal(format!("mock-server: {}: {e}", a.addr))
            }
        })?;
    let mut out = std::io::stdout();
    let _ = writeln!(out, "listening on http://{}", server.addr);
    let _ = out.flush();
    tokio::select! {
        _ = server.wait() => Err(CliError::Internal("mock-server stopped".into())),
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn parses_faults() {
        let cli = crate::cli::Cli::try_parse_from([
            "evalflow",
            "mock-server",
            "--fault",
            "hang=0.1",
            "--fault",
            "reset=0.2",
        ])
        .unwrap();
        let crate::cli::Command::MockServer(a) = cli.command else {
            panic!("mock-server")
        };
        assert_eq!(a.faults, vec![(Fault::Hang, 0.1), (Fault::Reset, 0.2)]);
        assert!(
            crate::cli::Cli::try_parse_from(["evalflow", "mock-server", "--fault", "x=1"]).is_err()
        );
    }
}
