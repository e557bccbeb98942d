//! `evalflow check RUN`: the six pre-flight checks of six-checks-before-you-trust as one
//! report, and the invalid-rate gate.
//!
//! 1. error rows vs all rows;
//! 2. finish reasons and token accounting (length with high reasoning tokens is a starved
//!    answer);
//! 3. answer-length histogram (spike at zero, clusters of very short answers);
//! 4. language distribution;
//! 5. 20 random scored rows exported as CSV for hand-reading;
//! 6. the scoring versions present.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{CliError, internal};
use crate::query::{open_run, text_rows};
use crate::stages::aggregate::render_table;

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The run root.
    pub run: String,
    /// Compare the invalid fraction with this baseline; exit 1 on a drift over 5 points.
    #[arg(long)]
    pub baseline: Option<PathBuf>,
    /// Record this run's invalid fraction as a baseline file.
    #[arg(long)]
    pub write_baseline: Option<PathBuf>,
    /// Where to write the 20 rows for hand-reading (default <run>/check/sample.csv).
    #[arg(long)]
    pub sample_out: Option<PathBuf>,
    /// Seed of the row sample.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Largest drift of the invalid fraction, in percentage points, before the gate fails.
    #[arg(long, default_value_t = 5.0)]
    pub max_drift_pp: f64,
}

/// What a baseline file records.
#[derive(Debug, Serialize, Deserialize)]
pub struct Baseline {
    pub run_id: String,
    pub rows: u64,
    pub invalid_fraction: f64,
    pub validity: std::collections::BTreeMap<String, u64>,
}

fn cell(v: &Option<String>) -> String {
    v.clone().unwrap_or_else(|| "NULL".into())
}

fn num(v: &Option<String>) -> f64 {
    v.as_deref().and_then(|s| s.parse().ok()).unwrap_or(0.0)
}

/// Reads a baseline file written by `--write-baseline`.
///
/// # Errors
/// Exit 2 naming the file, and the line and column (or field) of the problem.
fn read_baseline(p: &std::path::Path) -> Result<Baseline, CliError> {
    let text = std::fs::read(p).map_err(|e| CliError::BadInput(format!("{}: {e}", p.display())))?;
    let b: Baseline = serde_json::from_slice(&text).map_err(|e| {
        CliError::BadInput(format!(
            "{}:{}:{}: not a baseline file: {e}",
            p.display(),
            e.line(),
            e.column()
        ))
    })?;
    if !(0.0..=1.0).contains(&b.invalid_fraction) {
        return Err(CliError::BadInput(format!(
            "{}: field `invalid_fraction`: {} is not a fraction in [0, 1]",
            p.display(),
            b.invalid_fraction
        )));
    }
    Ok(b)
}

/// The tokens-per-model table of `check` (rows: model, calls, prompt, completion, batch
/// calls, batch prompt, batch completion), priced by the pipeline's `[model] price` for
/// the rows of that model.
fn tokens_and_cost(rows: &[Vec<Option<String>>], pipeline: &serde_json::Value) -> String {
    let price: Option<crate::config::Price> = pipeline
        .pointer("/model/price")
        .filter(|v| !v.is_null())
        .and_then(|v| serde_json::from_value(v.clone()).ok());
    let priced = pipeline.pointer("/model/name").and_then(|v| v.as_str());
    let n = |v: &Option<String>| {
        v.as_deref()
            .and_then(|s| s.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let mut table = Vec::new();
    for r in rows {
        let (p, c, bp, bc) = (n(&r[2]), n(&r[3]), n(&r[5]), n(&r[6]));
        let cost = match (&price, priced == r[0].as_deref()) {
            (Some(pr), true) => {
                let at = |i: f64, o: f64| (i * pr.input_per_mtok + o * pr.output_per_mtok) / 1e6;
                let full = at(p, c);
                let paid = full - at(bp, bc) * crate::stages::call::BATCH_DISCOUNT;
                (format!("${paid:.6}"), format!("${full:.6}"))
            }
            _ => ("-".into(), "-".into()),
        };
        table.push(vec![
            cell(&r[0]),
            cell(&r[1]),
            cell(&r[4]),
            cell(&r[2]),
            cell(&r[3]),
            cost.0,
            cost.1,
        ]);
    }
    let mut out = String::from("\nTokens and cost per model (batch rows at half price)\n");
    out.push_str(&render_table(
        &[
            "model",
            "calls",
            "batch calls",
            "prompt tokens",
            "completion tokens",
            "cost",
            "cost without batch",
        ],
        &table,
    ));
    out.push('\n');
    out
}

pub async fn run(a: CheckArgs) -> Result<(), CliError> {
    // The baseline is read first: a bad file fails before the report writes anything
    // (the hand-reading sample lands in the run root).
    let baseline = match &a.baseline {
        Some(p) => Some(read_baseline(p)?),
        None => None,
    };
    let (ctx, store, manifest) = open_run(&a.run)
        .await
        .map_err(|e| CliError::BadInput(e.to_string()))?;
    let q = |sql: String| {
        let ctx = ctx.clone();
        async move { text_rows(&ctx, &sql).await.map_err(internal) }
    };
    let mut out = format!(
        "evalflow check: run {} ({})\n",
        manifest.run_id,
        store.display()
    );

    // Validity distribution: printed beside every headline number.
    let vrows = q(
        "SELECT validity, count(*) FROM validity GROUP BY validity ORDER BY count(*) DESC".into(),
    )
    .await?;
    let total: f64 = vrows.iter().map(|r| num(&r[1])).sum();
    let valid: f64 = vrows
        .iter()
        .filter(|r| r[0].as_deref() == Some("valid_answer"))
        .map(|r| num(&r[1]))
        .sum();
    let invalid_fraction = if total > 0.0 {
        1.0 - valid / total
    } else {
        0.0
    };
    out.push_str(&format!(
        "\nValidity ({} calls; invalid fraction {:.1}%)\n",
        total,
        invalid_fraction * 100.0
    ));
    let table: Vec<Vec<String>> = vrows
        .iter()
        .map(|r| {
            vec![
                cell(&r[0]),
                cell(&r[1]),
                format!("{:.1}%", num(&r[1]) * 100.0 / total.max(1.0)),
            ]
        })
        .collect();
    out.push_str(&render_table(&["validity", "rows", "share"], &table));

    // 1. Error rows vs all rows.
    let e = q("SELECT count(*), count(error), sum(CASE WHEN http_status >= 400 THEN 1 ELSE 0 END) FROM calls".into()).await?;
    let (rows, errors) = (num(&e[0][0]), num(&e[0][1]));
    out.push_str(&format!(
        "\n\n1. Errors: {} of {} call rows carry an error ({:.1}%)\n",
        errors,
        rows,
        errors * 100.0 / rows.max(1.0)
    ));
    let top = q("SELECT http_status, substr(error, 1, 80) AS error, count(*) AS n FROM calls WHERE error IS NOT NULL \
                 GROUP BY 1, 2 ORDER BY n DESC LIMIT 5"
        .into())
    .await?;
    if !top.is_empty() {
        let t: Vec<Vec<String>> = top.iter().map(|r| r.iter().map(cell).collect()).collect();
        out.push_str(&render_table(&["http_status", "error", "rows"], &t));
        out.push('\n');
    }

    // 2. Finish reasons and token accounting.
    let fr = q(
        "SELECT coalesce(finish_reason, 'NULL'), count(*) FROM calls GROUP BY 1 ORDER BY 2 DESC"
            .into(),
    )
    .await?;
    let tok = q("SELECT sum(prompt_tokens), sum(completion_tokens), sum(reasoning_tokens), \
                 sum(CASE WHEN finish_reason = 'length' AND reasoning_tokens IS NOT NULL AND reasoning_tokens >= 0.5 * coalesce(max_tokens, \
                     completion_tokens) THEN 1 ELSE 0 END) \
                 FROM calls"
        .into())
    .await?;
    out.push_str("\n\n2. Finish reasons and tokens\n");
    let t: Vec<Vec<String>> = fr.iter().map(|r| r.iter().map(cell).collect()).collect();
    out.push_str(&render_table(&["finish_reason", "rows"], &t));
    let starved = num(&tok[0][3]);
    out.push_str(&format!(
        "\ntokens: prompt {}, completion {}, reasoning {}\n",
        cell(&tok[0][0]),
        cell(&tok[0][1]),
        cell(&tok[0][2])
    ));
    if starved > 0.0 {
        out.push_str(&format!(
            "FLAG: {starved} rows ended with finish_reason=length after reasoning used at least half the budget: starved answers, not short ones\n"
        ));
    }
    // Tokens per model, and their cost when `[model]` has a price: rows that came through a
    // batch (`batch_id` set) at the batch discount. A run written before `batch_id` has no
    // such column: none of its rows came through a batch.
    let per_model = "SELECT model, count(*), coalesce(sum(prompt_tokens), 0), \
                     coalesce(sum(completion_tokens), 0), count(*) FILTER (WHERE {b}), \
                     coalesce(sum(prompt_tokens) FILTER (WHERE {b}), 0), \
                     coalesce(sum(completion_tokens) FILTER (WHERE {b}), 0) \
                     FROM calls GROUP BY model ORDER BY model";
    let pm = match q(per_model.replace("{b}", "batch_id IS NOT NULL")).await {
        Ok(r) => r,
        Err(_) => q(per_model.replace("{b}", "false")).await?,
    };
    out.push_str(&tokens_and_cost(&pm, &manifest.pipeline));

    // 3. Answer length histogram.
    let h = q(
        "SELECT CASE WHEN answer_chars = 0 THEN '0' WHEN answer_chars < 10 THEN '1-9' \
               WHEN answer_chars < 50 THEN '10-49' WHEN answer_chars < 200 THEN '50-199' \
               WHEN answer_chars < 1000 THEN '200-999' ELSE '1000+' END AS bucket, count(*) \
               FROM validity GROUP BY 1"
            .into(),
    )
    .await?;
    let order = ["0", "1-9", "10-49", "50-199", "200-999", "1000+"];
    out.push_str("\n\n3. Answer length (characters)\n");
    let maxn = h.iter().map(|r| num(&r[1])).fold(0.0, f64::max).max(1.0);
    let mut hist = Vec::new();
    for b in order {
        let n = h
            .iter()
            .find(|r| r[0].as_deref() == Some(b))
            .map(|r| num(&r[1]))
            .unwrap_or(0.0);
        hist.push(vec![
            b.to_string(),
            n.to_string(),
            "#".repeat((n / maxn * 40.0).round() as usize),
        ]);
    }
    out.push_str(&render_table(&["chars", "rows", ""], &hist));
    let share = |b: &str| {
        hist.iter()
            .find(|r| r[0] == b)
            .map(|r| r[1].parse::<f64>().unwrap_or(0.0))
            .unwrap_or(0.0)
            / total.max(1.0)
    };
    if share("0") > 0.01 {
        out.push_str(&format!(
            "\nFLAG: spike at zero: {:.1}% of answers are empty\n",
            share("0") * 100.0
        ));
    }
    if share("1-9") > 0.2 {
        out.push_str(&format!(
            "\nFLAG: {:.1}% of answers are under 10 characters (truncation, refusals, or a classifier's labels)\n",
            share("1-9") * 100.0
        ));
    }

    // 4. Language distribution.
    let l = q("SELECT language, count(*) FROM validity GROUP BY 1 ORDER BY 2 DESC".into()).await?;
    out.push_str("\n\n4. Answer languages\n");
    let t: Vec<Vec<String>> = l
        .iter()
        .map(|r| {
            vec![
                cell(&r[0]),
                cell(&r[1]),
                format!("{:.1}%", num(&r[1]) * 100.0 / total.max(1.0)),
            ]
        })
        .collect();
    out.push_str(&render_table(&["language", "rows", "share"], &t));

    // 5. Twenty random scored rows for hand-reading. The twenty are drawn from `scores`
    // alone (a top-k: memory for twenty rows), and only they are joined with their answers
    // and reasons: a join of the whole tables would hold one of them in memory (1.2 GB for
    // a 1M-call run). Ties (the versions of one call) go by scorer and version.
    let sample = ctx
        .sql(&format!(
            "WITH s AS (SELECT call_id, test, label, passed, validity, scorer, scoring_version AS version, \
             md5(call_id || '{seed}') AS draw FROM scores ORDER BY draw, scorer, version LIMIT 20) \
             SELECT s.call_id, s.test, k.response AS answer, s.label, s.passed, s.validity, v.validity_reason AS reason, \
             s.scorer || '@' || s.version AS scoring_version \
             FROM s JOIN calls k ON s.call_id = k.call_id JOIN validity v ON s.call_id = v.call_id \
             ORDER BY s.draw, s.scorer, s.version",
            seed = a.seed
        ))
        .await
        .map_err(internal)?
        .collect()
        .await
        .map_err(internal)?;
    let mut csv = Vec::new();
    {
        let mut w = datafusion::arrow::csv::WriterBuilder::new()
            .with_header(true)
            .build(&mut csv);
        for b in &sample {
            w.write(b).map_err(internal)?;
        }
    }
    let sample_at = match &a.sample_out {
        Some(p) => {
            let tmp = p.with_extension("csv.tmp");
            std::fs::write(&tmp, &csv).map_err(internal)?;
            std::fs::rename(&tmp, p).map_err(internal)?;
            p.display().to_string()
        }
        None => {
            store.put("check/sample.csv", csv).await.map_err(internal)?;
            format!("{}/check/sample.csv", store.display())
        }
    };
    let n_sample: usize = sample.iter().map(|b| b.num_rows()).sum();
    out.push_str(&format!(
        "\n\n5. {n_sample} random scored rows for hand-reading: {sample_at}\n"
    ));

    // 6. Scoring versions present.
    let sv = q("SELECT scorer || '@' || scoring_version, count(*), count(score) FROM scores GROUP BY 1 ORDER BY 1".into()).await?;
    out.push_str("\n6. Scoring versions\n");
    let t: Vec<Vec<String>> = sv.iter().map(|r| r.iter().map(cell).collect()).collect();
    out.push_str(&render_table(&["scorer@version", "rows", "scored"], &t));
    println!("{out}");

    let validity: std::collections::BTreeMap<String, u64> = vrows
        .iter()
        .map(|r| (cell(&r[0]), num(&r[1]) as u64))
        .collect();
    if let Some(p) = &a.write_baseline {
        let b = Baseline {
            run_id: manifest.run_id.clone(),
            rows: total as u64,
            invalid_fraction,
            validity,
        };
        let tmp = p.with_extension("json.tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(&b).expect("baseline serialises"),
        )
        .map_err(internal)?;
        std::fs::rename(&tmp, p).map_err(internal)?;
        println!("baseline written to {}", p.display());
    }
    if let Some(b) = &baseline {
        let drift_pp = (invalid_fraction - b.invalid_fraction) * 100.0;
        println!(
            "gate: invalid fraction {:.1}% vs baseline {:.1}% (run {}): drift {:+.1} pp, limit {:.1} pp",
            invalid_fraction * 100.0,
            b.invalid_fraction * 100.0,
            b.run_id,
            drift_pp,
            a.max_drift_pp
        );
        if drift_pp.abs() > a.max_drift_pp {
            return Err(CliError::Gate(
                "this is not a lower number, it is a run that did not complete".into(),
            ));
        }
    }
    Ok(())
}
