//! Failed calls, told apart: the error kinds of a run's `calls` rows with the first message
//! of each, and the watch that stops sending once the provider refuses everything.
//!
//! A failed call is a row, never an error of the stage, so a run whose every call was
//! refused (connection refused, out of credit) used to end as if it had worked. These are
//! the facts the stage reports instead: counts by kind at its end, and a stop after a run of
//! out-of-credit answers (every further request would be refused too, and each one costs a
//! request slot and the provider's patience).
//!
//! # Behavior
//! - [`kind_of`] names a row's kind from its `http_status` and `error` text: `HTTP 403 (out
//!   of credit or forbidden)`, `HTTP 429 (rate limited)`, `HTTP 503`, ...; without a status
//!   the text before the first `:` as the HTTP client writes it (`connection failed`,
//!   `connection reset`, `timeout`, `malformed JSON`), or a batch line's code after its
//!   batch id (`batch: batch_expired`).
//! - [`Failures`] counts rows by kind and keeps the first message of each (in table order).
//! - [`Refusals`] counts consecutive 403 answers in the order they come back; any other
//!   answer resets it; [`STOP_AFTER`] in a row stops the stage from sending more.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use super::CallResult;

/// Consecutive out-of-credit (HTTP 403) answers after which no further request is sent.
pub const STOP_AFTER: u32 = 20;

/// Characters of a first message kept for the summary.
const MESSAGE_CHARS: usize = 200;

/// The kind of a failed call, from its status and error text.
///
/// # Example
/// ```
/// use evalflow::stages::call::failures::kind_of;
/// assert_eq!(kind_of(Some(403), "HTTP 403: quota"), "HTTP 403 (out of credit or forbidden)");
/// assert_eq!(kind_of(None, "connection failed: error sending request"), "connection failed");
/// assert_eq!(kind_of(None, "timeout after 30s"), "timeout");
/// assert_eq!(kind_of(None, "batch b_1: batch_expired: not run in time"), "batch: batch_expired");
/// ```
pub fn kind_of(status: Option<i32>, error: &str) -> String {
    match status {
        Some(s) if !(200..300).contains(&s) => {
            let what = match s {
                401 => " (unauthorized: the API key)",
                403 => " (out of credit or forbidden)",
                404 => " (not found: the base_url or model name)",
                429 => " (rate limited)",
                _ => "",
            };
            format!("HTTP {s}{what}")
        }
        _ => {
            // A batch line's error names its batch first (`batch ID: CODE: message`): the
            // kind is the code, not one kind per batch.
            if let Some(rest) = error.strip_prefix("batch ")
                && let Some((_, rest)) = rest.split_once(": ")
            {
                return format!("batch: {}", kind_of(None, rest));
            }
            let head = error.split(':').next().unwrap_or("").trim();
            if head.starts_with("timeout") {
                "timeout".into()
            } else if head.is_empty() || head.len() > 40 {
                "other".into()
            } else {
                head.to_string()
            }
        }
    }
}

/// Failed calls by kind: how many, and the first message of each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Failures {
    kinds: BTreeMap<String, (u64, String)>,
}

impl Failures {
    /// Counts one failed row.
    pub fn add(&mut self, status: Option<i32>, error: &str) {
        let e = self
            .kinds
            .entry(kind_of(status, error))
            .or_insert_with(|| (0, error.chars().take(MESSAGE_CHARS).collect()));
        e.0 += 1;
    }

    /// Failed rows counted.
    pub fn total(&self) -> u64 {
        self.kinds.values().map(|(n, _)| n).sum()
    }

    /// Each kind with its count and first message, most frequent first.
    pub fn kinds(&self) -> Vec<(&str, u64, &str)> {
        let mut v: Vec<_> = self
            .kinds
            .iter()
            .map(|(k, (n, m))| (k.as_str(), *n, m.as_str()))
            .collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        v
    }

    /// Whether every failure says the request itself is wrong (HTTP 400, 401, 404: the
    /// pipeline's model name, key or URL), which the user fixes in the input.
    pub fn all_bad_requests(&self) -> bool {
        !self.kinds.is_empty()
            && self.kinds.keys().all(|k| {
                ["HTTP 400", "HTTP 401", "HTTP 404"]
                    .iter()
                    .any(|p| k.starts_with(p))
            })
    }

    /// One line per kind: `  KIND: N (first: MESSAGE)`.
    pub fn render(&self) -> String {
        self.kinds()
            .iter()
            .map(|(k, n, m)| format!("  {k}: {n} (first: {m})"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The summary printed at the end of a call stage with `errors` of `rows` rows failed.
    pub fn summary(&self, rows: u64) -> String {
        format!(
            "calls: {} of {rows} ended in an error, by kind:\n{}\nrun the same command with --retry-errors to send the failed calls again",
            self.total(),
            self.render()
        )
    }
}

/// Consecutive out-of-credit answers, shared by the tasks of a call stage.
#[derive(Debug, Default)]
pub struct Refusals {
    in_a_row: AtomicU32,
    stopped: AtomicBool,
}

impl Refusals {
    /// Records an answer from the provider (not a cache hit).
    pub fn observe(&self, res: &CallResult) {
        if res.http_status == Some(403) {
            if self.in_a_row.fetch_add(1, Ordering::Relaxed) + 1 >= STOP_AFTER {
                self.stopped.store(true, Ordering::Relaxed);
            }
        } else {
            self.in_a_row.store(0, Ordering::Relaxed);
        }
    }

    /// Whether [`STOP_AFTER`] 403 answers came in a row: send nothing more.
    pub fn stopped(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(status: Option<i32>) -> CallResult {
        CallResult {
            http_status: status,
            ..CallResult::default()
        }
    }

    #[test]
    fn kinds_are_counted_with_their_first_message_most_frequent_first() {
        let mut f = Failures::default();
        f.add(None, "connection failed: refused (a)");
        f.add(Some(403), "HTTP 403: out of credit (1)");
        f.add(Some(403), "HTTP 403: out of credit (2)");
        f.add(Some(200), "malformed JSON: EOF");
        assert_eq!(f.total(), 4);
        assert_eq!(
            f.kinds(),
            vec![
                (
                    "HTTP 403 (out of credit or forbidden)",
                    2,
                    "HTTP 403: out of credit (1)"
                ),
                ("connection failed", 1, "connection failed: refused (a)"),
                ("malformed JSON", 1, "malformed JSON: EOF"),
            ]
        );
        assert!(!f.all_bad_requests());
        let mut g = Failures::default();
        g.add(Some(404), "HTTP 404: no such model");
        g.add(Some(401), "HTTP 401: bad key");
        assert!(g.all_bad_requests());
        assert!(!Failures::default().all_bad_requests());
    }

    #[test]
    fn refusals_stop_after_a_run_of_403_and_any_other_answer_resets_it() {
        let r = Refusals::default();
        for _ in 0..STOP_AFTER - 1 {
            r.observe(&res(Some(403)));
        }
        r.observe(&res(Some(200)));
        for _ in 0..STOP_AFTER - 1 {
            r.observe(&res(Some(403)));
        }
        assert!(!r.stopped(), "19 in a row, twice, is not 20");
        r.observe(&res(Some(403)));
        assert!(r.stopped());
    }
}
