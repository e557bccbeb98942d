//! `evalflow holdout check|accept`: a hand-labelled holdout (call_id -> true label) is
//! re-scored with today's scorer and its per-class precision and recall are compared with
//! a recorded baseline.
//!
//! A regression gate nobody has watched fail is one you don't know works: the tests gut a
//! cue list and watch this exit 1. Labels keyed to rows that are no longer scorable (the
//! enumeration drifted) make every metric fiction, so that exits 2 with its own message.
//! The baseline moves only with `accept`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::CliError;
use crate::query::open_run;
use crate::stages::aggregate::render_table;
use crate::stages::score;

#[derive(Debug, clap::Subcommand)]
pub enum HoldoutCmd {
    /// Re-score the holdout and compare with the baseline (exit 1 on a regression).
    Check(HoldoutArgs),
    /// Re-score the holdout and record the result as the new baseline.
    Accept(HoldoutArgs),
}

#[derive(Debug, clap::Args)]
pub struct HoldoutArgs {
    /// The run holding the labelled calls.
    pub run: String,
    /// CSV with a header and columns `call_id,label`.
    #[arg(long)]
    pub labels: PathBuf,
    /// The scorer under test (NAME or NAME@VERSION).
    #[arg(long, default_value = "cue")]
    pub scorer: String,
    /// Replacement cue lists for the cue scorer.
    #[arg(long)]
    pub cues: Option<PathBuf>,
    /// The baseline file (JSON).
    #[arg(long)]
    pub baseline: PathBuf,
    /// Largest drop of a class's precision or recall, in percentage points.
    #[arg(long, default_value_t = 5.0)]
    pub max_drop_pp: f64,
}

/// One class's metrics.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct ClassMetrics {
    pub support: u64,
    pub predicted: u64,
    pub precision: Option<f64>,
    pub recall: Option<f64>,
}

/// The recorded baseline.
#[derive(Debug, Serialize, Deserialize)]
pub struct HoldoutBaseline {
    pub scorer: String,
    pub labels: u64,
    /// Hash of the sorted labelled call ids: the enumeration the metrics belong to.
    pub ids_hash: String,
    pub classes: BTreeMap<String, ClassMetrics>,
}

/// Reads `call_id,label` rows (header required; RFC 4180 quoting, so a label may hold a
/// comma). Each call may be labelled once.
///
/// # Errors
/// Exit 2 naming the file, the line and the field: a missing column or value, a malformed
/// record, or a `call_id` labelled twice (naming both lines).
pub fn read_labels(path: &std::path::Path) -> Result<Vec<(String, String)>, CliError> {
    use datafusion::arrow::array::{Array, AsArray};
    let file = path.display().to_string();
    let bad = |line: u64, msg: String| CliError::BadInput(format!("{file}:{line}: {msg}"));
    let mut records =
        crate::stages::generate::source::CsvRecords::open(path, &["call_id", "label"])
            .map_err(|e| bad(e.line, e.msg))?;
    let mut out = Vec::new();
    let mut first_line: HashMap<String, u64> = HashMap::new();
    while let Some((line, b)) = records.next_record().map_err(|e| bad(e.line, e.msg))? {
        let get = |i: usize, name: &str| {
            let c = b.column(i).as_string::<i32>();
            let v = if c.is_null(0) { "" } else { c.value(0).trim() };
            if v.is_empty() {
                Err(bad(line, format!("field `{name}` is missing")))
            } else {
                Ok(v.to_string())
            }
        };
        let (id, label) = (get(0, "call_id")?, get(1, "label")?);
        if let Some(prev) = first_line.insert(id.clone(), line) {
            return Err(bad(
                line,
                format!("field `call_id`: `{id}` is labelled twice (lines {prev} and {line})"),
            ));
        }
        out.push((id, label));
    }
    if out.is_empty() {
        return Err(bad(
            1,
            "no labelled rows after the header `call_id,label`".into(),
        ));
    }
    Ok(out)
}

/// Per-class support, precision and recall of `pred` against `truth`.
pub fn metrics(pairs: &[(String, String)]) -> BTreeMap<String, ClassMetrics> {
    let classes: BTreeSet<&str> = pairs
        .iter()
        .flat_map(|(t, p)| [t.as_str(), p.as_str()])
        .collect();
    classes
        .into_iter()
        .map(|c| {
            let support = pairs.iter().filter(|(t, _)| t == c).count() as u64;
            let predicted = pairs.iter().filter(|(_, p)| p == c).count() as u64;
            let tp = pairs.iter().filter(|(t, p)| t == c && p == c).count() as f64;
            let m = ClassMetrics {
                support,
                predicted,
                precision: (predicted > 0).then(|| tp / predicted as f64),
                recall: (support > 0).then(|| tp / support as f64),
            };
            (c.to_string(), m)
        })
        .collect()
}

fn ids_hash(labels: &[(String, String)]) -> String {
    let ids: BTreeSet<&str> = labels.iter().map(|(i, _)| i.as_str()).collect();
    let mut h = Sha256::new();
    for id in ids {
        h.update(id.as_bytes());
        h.update([b'\n']);
    }
    hex::encode(h.finalize())[..16].to_string()
}

fn pct(x: Option<f64>) -> String {
    x.map(|v| format!("{:.0}%", v * 100.0))
        .unwrap_or_else(|| "-".into())
}

fn delta(now: Option<f64>, then: Option<f64>) -> String {
    match (now, then) {
        (Some(a), Some(b)) => format!(" ({:+.0}pp)", (a - b) * 100.0),
        _ => String::new(),
    }
}

pub async fn run(cmd: HoldoutCmd) -> Result<(), CliError> {
    let (accept, a) = match cmd {
        HoldoutCmd::Check(a) => (false, a),
        HoldoutCmd::Accept(a) => (true, a),
    };
    let labels = read_labels(&a.labels)?;
    // Read the baseline before any scoring, so a bad file fails first and clearly.
    let baseline: Option<HoldoutBaseline> = match std::fs::read(&a.baseline) {
        Ok(b) => Some(serde_json::from_slice(&b).map_err(|e| {
            CliError::BadInput(format!(
                "{}:{}:{}: not a holdout baseline: {e}",
                a.baseline.display(),
                e.line(),
                e.column()
            ))
        })?),
        Err(_) if accept => None,
        Err(e) => {
            return Err(CliError::BadInput(format!(
                "{}: {e} (record one with `holdout accept`)",
                a.baseline.display()
            )));
        }
    };
    let (_, store, manifest) = open_run(&a.run)
        .await
        .map_err(|e| CliError::BadInput(e.to_string()))?;
    let scorer = score::build_for_run(&a.scorer, a.cues.as_deref(), &store, &manifest.pipeline)
        .await
        .map_err(|e| {
            if e.is_bad_input() {
                CliError::BadInput(format!("--scorer: {e}"))
            } else {
                CliError::Internal(e.to_string())
            }
        })?;
    let ids: Vec<String> = labels.iter().map(|(i, _)| i.clone()).collect();
    let scored = score::score_calls(&store, scorer.as_ref(), &ids)
        .await
        .map_err(|e| CliError::Internal(e.to_string()))?;
    // Enumeration drift: every label must point at a row that is scorable today.
    let unscorable: Vec<String> = labels
        .iter()
        .filter_map(|(id, _)| match scored.get(id) {
            None => Some(format!("{id} (not in the run)")),
            Some((v, o)) if v != "valid_answer" || o.label.is_none() => Some(format!("{id} ({v})")),
            _ => None,
        })
        .collect();
    let drift = |msg: String| {
        Err(CliError::BadInput(format!(
            "enumeration drift: {msg}; the labels no longer line up with the scorable rows, so no metric is computed"
        )))
    };
    if !unscorable.is_empty() {
        return drift(format!(
            "{} of {} labelled calls are not scorable now: {}",
            unscorable.len(),
            labels.len(),
            unscorable
                .iter()
                .take(5)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let by_id: HashMap<&str, &str> = scored
        .iter()
        .map(|(k, (_, o))| (k.as_str(), o.label.as_deref().unwrap_or("")))
        .collect();
    let pairs: Vec<(String, String)> = labels
        .iter()
        .map(|(id, truth)| (truth.clone(), by_id[id.as_str()].to_string()))
        .collect();
    let now = metrics(&pairs);
    let current = HoldoutBaseline {
        scorer: scorer.id().tag(),
        labels: labels.len() as u64,
        ids_hash: ids_hash(&labels),
        classes: now.clone(),
    };
    if let Some(b) = &baseline
        && !accept
        && (b.labels != current.labels || b.ids_hash != current.ids_hash)
    {
        return drift(format!(
            "the baseline was recorded on {} labelled calls (ids {}), these labels are {} (ids {})",
            b.labels, b.ids_hash, current.labels, current.ids_hash
        ));
    }
    let mut rows = Vec::new();
    let mut regressions = Vec::new();
    for (class, m) in &now {
        let old = baseline
            .as_ref()
            .and_then(|b| b.classes.get(class))
            .copied();
        let (op, or) = (old.and_then(|o| o.precision), old.and_then(|o| o.recall));
        rows.push(vec![
            class.clone(),
            m.support.to_string(),
            format!("{}{}", pct(m.precision), delta(m.precision, op)),
            format!("{}{}", pct(m.recall), delta(m.recall, or)),
        ]);
        for (what, a_now, then) in [("precision", m.precision, op), ("recall", m.recall, or)] {
            if let (Some(x), Some(y)) = (a_now, then)
                && (y - x) * 100.0 > a.max_drop_pp
            {
                regressions.push(format!("{class} {what} dropped {:.0}pp", (y - x) * 100.0));
            }
        }
    }
    println!(
        "holdout: {} labelled calls, scorer {}{}\n",
        labels.len(),
        current.scorer,
        baseline
            .as_ref()
            .map(|b| format!(", baseline scorer {}", b.scorer))
            .unwrap_or_default()
    );
    println!(
        "{}",
        render_table(&["class", "support", "precision", "recall"], &rows)
    );
    if accept {
        let tmp = a.baseline.with_extension("json.tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(&current).expect("serialises"),
        )
        .map_err(|e| CliError::Internal(e.to_string()))?;
        std::fs::rename(&tmp, &a.baseline).map_err(|e| CliError::Internal(e.to_string()))?;
        println!("\nbaseline recorded in {}", a.baseline.display());
        return Ok(());
    }
    if !regressions.is_empty() {
        return Err(CliError::Gate(format!(
            "holdout regression: {}",
            regressions.join("; ")
        )));
    }
    println!("\nno class dropped more than {:.0}pp", a.max_drop_pp);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_class_metrics_by_hand() {
        let p = |t: &str, q: &str| (t.to_string(), q.to_string());
        let pairs = vec![
            p("rej", "rej"),
            p("rej", "neu"),
            p("rej", "rej"),
            p("rec", "rec"),
            p("neu", "rej"),
        ];
        let m = metrics(&pairs);
        assert_eq!(m["rej"].support, 3);
        assert_eq!(m["rej"].precision, Some(2.0 / 3.0));
        assert_eq!(m["rej"].recall, Some(2.0 / 3.0));
        assert_eq!(m["rec"].precision, Some(1.0));
        assert_eq!(m["neu"].recall, Some(0.0));
    }

    fn labels(text: &[u8]) -> Result<Vec<(String, String)>, String> {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("labels.csv");
        std::fs::write(&p, text).unwrap();
        read_labels(&p).map_err(|e| e.to_string().replace(&p.display().to_string(), "L"))
    }

    #[test]
    fn labels_csv_is_parsed_with_quoting() {
        let got =
            labels(b"label,call_id\n\"rejected, firmly\",c1\n\n\"multi\nline\",\"c,2\"\nok,c3\n")
                .unwrap();
        let p = |a: &str, b: &str| (a.to_string(), b.to_string());
        assert_eq!(
            got,
            vec![
                p("c1", "rejected, firmly"),
                p("c,2", "multi\nline"),
                p("c3", "ok")
            ]
        );
    }

    #[test]
    fn labels_errors_name_line_and_field() {
        let e = labels(b"call_id,label\nc1,a\nc2,b\nc1,c\n").unwrap_err();
        assert_eq!(
            e,
            "L:4: field `call_id`: `c1` is labelled twice (lines 2 and 4)"
        );
        let e = labels(b"call_id,label\n\"c1\",\"x\ny\"\nc2,\n").unwrap_err();
        assert_eq!(e, "L:4: field `label` is missing");
        let e = labels(b"id,label\nc1,a\n").unwrap_err();
        assert!(e.starts_with("L:1: no column `call_id`"), "{e}");
        let e = labels(b"call_id,label\nc1,a\nc2\n").unwrap_err();
        assert!(
            e.starts_with("L:3: ") && e.contains("number of fields"),
            "{e}"
        );
        let e = labels(b"call_id,label\nc1,\xff\n").unwrap_err();
        assert!(e.starts_with("L:2: ") && e.contains("UTF-8"), "{e}");
    }
}
