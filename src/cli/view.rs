//! `evalflow view ROOT`: serves the viewer (crate::view) until interrupted.

use std::net::SocketAddr;

use super::CliError;
use crate::view::{ViewConfig, ViewError};

#[derive(Debug, clap::Args)]
pub struct ViewArgs {
    /// A folder of runs, one run, or an object-store prefix (s3://bucket/prefix).
    pub root: String,
    /// Address to listen on (port 0 picks a free port; the first line printed names it).
    /// Another interface than loopback needs --token.
    #[arg(long, default_value = "127.0.0.1:7878")]
    pub addr: SocketAddr,
    /// A token every request must carry (Authorization: Bearer T, ?token=T or the cookie
    /// the page sets); required off loopback. Default: the EVALFLOW_VIEW_TOKEN variable
    /// (which keeps it out of the process list).
    #[arg(long)]
    pub token: Option<String>,
}

/// Serves until SIGINT or SIGTERM.
pub async fn run(a: ViewArgs) -> Result<(), CliError> {
    let server = crate::view::start(ViewConfig {
        root: a.root.clone(),
        addr: a.addr,
        token: a
            .token
            .clone()
            .or_else(|| std::env::var("EVALFLOW_VIEW_TOKEN").ok()),
    })
    .await
    .map_err(|e| match e {
        ViewError::Start(_) | ViewError::BadRequest(_) | ViewError::NotFound(_) => {
            CliError::BadInput(e.to_string())
        }
        ViewError::Storage(s) if s.is_bad_input() => CliError::BadInput(s.to_string()),
        e => CliError::Internal(e.to_string()),
    })?;
    {
        use std::io::Write;
        let mut out = std::io::stdout();
        let _ = writeln!(out, "listening on http://{}", server.addr);
        let _ = out.flush();
    }
    eprintln!("serving {} (read only); Ctrl-C stops", a.root);
    tokio::select! {
        _ = server.task => Ok(()),
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}
