//! `evalflow rescore RUN --scorer NAME[@VERSION]`: re-scores archived calls + validity with
//! no model call, writes a new `scores/<name>@<version>/` beside the old ones (never over
//! them), and prints what changed.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::json;

use super::{CliError, internal};
use crate::query::{new_context, open_run, register_run, text_rows};
use crate::stages::aggregate::render_table;
use crate::stages::score::{self, ScorerId};

#[derive(Debug, clap::Args)]
pub struct RescoreArgs {
    /// The run root.
    pub run: String,
    /// The scorer, as NAME or NAME@VERSION (the version must be this build's).
    #[arg(long)]
    pub scorer: String,
    /// Replacement cue lists for the cue scorer (changes its version).
    #[arg(long)]
    pub cues: Option<PathBuf>,
    /// The version to diff against (default: the newest other version in the run).
    #[arg(long)]
    pub against: Option<String>,
}

pub async fn run(a: RescoreArgs) -> Result<(), CliError> {
    let (_, store, mut manifest) = open_run(&a.run)
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
    let id = scorer.id();
    if !store
        .list_parts(&id.dir())
        .await
        .map_err(internal)?
        .is_empty()
    {
        return Err(CliError::BadInput(format!(
            "{}/{} exists: rescoring never overwrites a scores version (bump the scorer's version or use other cues)",
            store.display(),
            id.dir()
        )));
    }
    let against =
        match &a.against {
            Some(t) => Some(ScorerId::parse(t).ok_or_else(|| {
                CliError::BadInput(format!("--against {t}: expected NAME@VERSION"))
            })?),
            None => manifest
                .scorer_versions
                .iter()
                .rev()
                .filter_map(|t| ScorerId::parse(t))
                .find(|s| s.name == id.name)
                .or_else(|| {
                    manifest
                        .scorer_versions
                        .last()
                        .and_then(|t| ScorerId::parse(t))
                }),
        };
    let rows = score::run(&store, scorer.as_ref())
        .await
        .map_err(internal)?;
    manifest.scorer_versions.push(id.tag());
    let stage = format!("score:{}", id.tag());
    manifest.complete(
        &stage,
        &id.dir(),
        rows,
        BTreeMap::from([
            (
                "logic_hash".into(),
                json!(score::logic_hash(scorer.as_ref())),
            ),
            ("rescored".into(), json!(true)),
        ]),
    );
    manifest.save(&store).await.map_err(internal)?;
    println!(
        "rescored {rows} rows with {} into {}/{}",
        id.tag(),
        store.display(),
        id.dir()
    );

    let Some(old) = against else {
        println!("no earlier scores version to compare with");
        return Ok(());
    };
    let ctx = new_context();
    register_run(&ctx, &store, "").await.map_err(internal)?;
    let pair = format!(
        "FROM scores o JOIN scores n ON o.call_id = n.call_id \
         WHERE o.scorer = '{}' AND o.scoring_version = '{}' AND n.scorer = '{}' AND n.scoring_version = '{}'",
        old.name, old.version, id.name, id.version
    );
    let totals = text_rows(
        &ctx,
        &format!(
            "SELECT count(*), sum(CASE WHEN o.label IS DISTINCT FROM n.label THEN 1 ELSE 0 END), \
             sum(CASE WHEN o.passed IS DISTINCT FROM n.passed THEN 1 ELSE 0 END) {pair}"
        ),
    )
    .await
    .map_err(internal)?;
    let t = &totals[0];
    let c = |v: &Option<String>| v.clone().unwrap_or_else(|| "0".into());
    println!(
        "\ndiff {} -> {}: {} rows paired, {} changed label, {} changed pass/fail",
        old.tag(),
        id.tag(),
        c(&t[0]),
        c(&t[1]),
        c(&t[2])
    );
    let by_class = text_rows(
        &ctx,
        &format!(
            "SELECT coalesce(o.label, 'NULL'), coalesce(n.label, 'NULL'), count(*) {pair} \
             AND o.label IS DISTINCT FROM n.label GROUP BY 1, 2 ORDER BY 3 DESC"
        ),
    )
    .await
    .map_err(internal)?;
    if !by_class.is_empty() {
        println!("\nlabel changes by class");
        let rows: Vec<Vec<String>> = by_class.iter().map(|r| r.iter().map(c).collect()).collect();
        println!(
            "{}",
            render_table(&["old label", "new label", "rows"], &rows)
        );
    }
    let by_test = text_rows(
        &ctx,
        &format!(
            "SELECT n.test, sum(CASE WHEN o.passed AND NOT n.passed THEN 1 ELSE 0 END), \
             sum(CASE WHEN NOT o.passed AND n.passed THEN 1 ELSE 0 END), \
             sum(CASE WHEN o.passed IS DISTINCT FROM n.passed AND (o.passed IS NULL OR n.passed IS NULL) THEN 1 ELSE 0 END) \
             {pair} AND o.passed IS DISTINCT FROM n.passed GROUP BY 1 ORDER BY 1"
        ),
    )
    .await
    .map_err(internal)?;
    if !by_test.is_empty() {
        println!("\npass/fail changes by test");
        let rows: Vec<Vec<String>> = by_test.iter().map(|r| r.iter().map(c).collect()).collect();
        println!(
            "{}",
            render_table(
                &["test", "pass -> fail", "fail -> pass", "to/from unscored"],
                &rows
            )
        );
    }
    Ok(())
}
