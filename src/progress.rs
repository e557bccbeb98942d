//! Progress of a long stage on a terminal: units done out of the total, rows and rows/s.
//!
//! Quiet when stderr is not a terminal (CI, a log file, a pipe), so logs and captured
//! output stay clean; `EVALFLOW_PROGRESS=lines` asks for a plain line every few seconds
//! there instead ([`log_lines`], the call stage's heartbeat for long CI runs). Cheap to
//! clone: every task of a stage advances the same bar.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Writes one line to stdout, or drops it when stdout is closed.
///
/// # Behavior
/// A command that writes a run reports on work that goes on whether anyone reads the
/// report: `evalflow run ... | head -1` or a CI log collector that went away must not end
/// the run (`println!` panics on a closed pipe, and src/main.rs turns that panic into an
/// exit). Other write errors are dropped too: the line is a message, not the product.
pub fn print_line(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

/// [`print_line`] for stderr: warnings and progress of a command that writes a run.
pub fn eprint_line(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// `println!` that drops its line on a closed stdout ([`print_line`]).
macro_rules! outln {
    () => {
        $crate::progress::print_line(format_args!(""))
    };
    ($($t:tt)*) => {
        $crate::progress::print_line(format_args!($($t)*))
    };
}
pub(crate) use outln;

/// `eprintln!` that drops its line on a closed stderr ([`eprint_line`]).
macro_rules! errln {
    () => {
        $crate::progress::eprint_line(format_args!(""))
    };
    ($($t:tt)*) => {
        $crate::progress::eprint_line(format_args!($($t)*))
    };
}
pub(crate) use errln;

/// Whether progress may be printed as plain lines when stderr is not a terminal: only when
/// `EVALFLOW_PROGRESS=lines` asks for it, since a captured stderr is for errors and warnings.
pub fn log_lines() -> bool {
    std::env::var_os("EVALFLOW_PROGRESS").is_some_and(|v| v == "lines")
}

/// A stage's progress bar (absent off a terminal).
#[derive(Clone)]
pub struct Progress {
    bar: Option<ProgressBar>,
    rows: Arc<AtomicU64>,
    started: Instant,
}

impl Progress {
    /// Starts a bar for `stage` over `total` units named `unit` (parts, batches, ...).
    pub fn new(stage: &str, total: u64, unit: &str) -> Self {
        let bar = (total > 0 && std::io::stderr().is_terminal()).then(|| {
            let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            b.set_style(
                ProgressStyle::with_template(&format!(
                    "{stage} {{bar:30}} {{pos}}/{{len}} {unit} {{msg}} eta {{eta}}"
                ))
                .expect("valid template"),
            );
            b
        });
        Progress {
            bar,
            rows: Arc::new(AtomicU64::new(0)),
            started: Instant::now(),
        }
    }

    /// Records `units` more units done, holding `rows` rows.
    pub fn inc(&self, units: u64, rows: u64) {
        let total = self.rows.fetch_add(rows, Ordering::Relaxed) + rows;
        if let Some(b) = &self.bar {
            let rate = total as f64 / self.started.elapsed().as_secs_f64().max(1e-9);
            b.set_message(format!("{total} rows, {rate:.0} rows/s"));
            b.inc(units);
        }
    }

    /// Clears the bar.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
