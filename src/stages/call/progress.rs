//! Progress of the call stage: a bar on a terminal, plain log lines otherwise.
//!
//! Shows calls done out of the total, the rate, errors so far and the ETA. When stderr is
//! not a terminal (CI, a log file) it is silent, unless `EVALFLOW_PROGRESS=lines` asks for
//! one line every few seconds ([`crate::progress::log_lines`]).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

const LOG_EVERY: Duration = Duration::from_secs(5);

/// The call stage's progress reporter.
pub struct Progress {
    bar: Option<ProgressBar>,
    total: u64,
    done: u64,
    started: Instant,
    last_log: Instant,
}

impl Progress {
    /// Starts reporting on `total` calls (silent when there are none).
    pub fn new(total: u64) -> Self {
        let bar = (total > 0 && std::io::stderr().is_terminal()).then(|| {
            let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            b.set_style(
                ProgressStyle::with_template(
                    "call {bar:30} {pos}/{len} {per_sec:>10} errors {msg} eta {eta}",
                )
                .expect("valid template"),
            );
            b.set_message("0");
            b
        });
        let now = Instant::now();
        Self {
            bar,
            total,
            done: 0,
            started: now,
            last_log: now,
        }
    }

    /// Records `n` more finished calls, `errors` so far.
    pub fn advance(&mut self, n: u64, errors: u64) {
        self.done += n;
        if let Some(b) = &self.bar {
            b.inc(n);
            b.set_message(errors.to_string());
        } else if self.total > 0
            && self.last_log.elapsed() >= LOG_EVERY
            && crate::progress::log_lines()
        {
            self.last_log = Instant::now();
            crate::progress::errln!("{}", self.line(errors));
        }
    }

    fn line(&self, errors: u64) -> String {
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        let rate = self.done as f64 / secs;
        let eta = if rate > 0.0 {
            format!(
                "{:.0}s",
                (self.total - self.done.min(self.total)) as f64 / rate
            )
        } else {
            "?".into()
        };
        format!(
            "call: {}/{} done, {rate:.1} calls/s, {errors} errors, eta {eta}",
            self.done, self.total
        )
    }

    /// Clears the bar (or prints a last line).
    pub fn finish(self, errors: u64) {
        if let Some(b) = self.bar {
            b.finish_and_clear();
        } else if self.total > 0
            && self.started.elapsed() >= LOG_EVERY
            && crate::progress::log_lines()
        {
            crate::progress::errln!("{}", self.line(errors));
        }
    }
}
