//! `evalflow scorers RUN`: every scorer version scored in a run, with its kind, metric and
//! rows, and the definition of each user scorer (recorded beside its scores), so any
//! number in the run can be traced to the exact rules that made it.

use super::{CliError, internal};
use crate::query::{open_run, text_rows};
use crate::stages::aggregate::render_table;
use crate::stages::score::{self, ScorerId, user::ScorerDef};

#[derive(Debug, clap::Args)]
pub struct ScorersArgs {
    /// The run root.
    pub run: String,
    /// Print one JSON array (tag, scorer, version, kind, metric, rows, definition).
    #[arg(long)]
    pub json: bool,
}

pub async fn run(a: ScorersArgs) -> Result<(), CliError> {
    let (ctx, store, manifest) = open_run(&a.run)
        .await
        .map_err(|e| CliError::BadInput(e.to_string()))?;
    // Every folder under scores/ that holds parts, in the order the run scored them.
    let mut tags: Vec<String> = Vec::new();
    for p in store.list_parts("scores").await.map_err(internal)? {
        let full = p.location.as_ref();
        if let Some(dir) = full
            .rsplit_once('/')
            .and_then(|(d, _)| d.rsplit_once('/'))
            .map(|(_, t)| t.to_string())
            && !tags.contains(&dir)
        {
            tags.push(dir);
        }
    }
    let order = |t: &String| {
        manifest
            .scorer_versions
            .iter()
            .position(|v| v == t)
            .unwrap_or(usize::MAX)
    };
    tags.sort_by_key(|t| (order(t), t.clone()));
    let counts = text_rows(
        &ctx,
        "SELECT scorer || '@' || scoring_version, count(*), sum(CASE WHEN score IS NOT NULL THEN 1 ELSE 0 END) \
         FROM scores GROUP BY 1",
    )
    .await
    .map_err(internal)?;
    let mut out = Vec::new();
    for tag in &tags {
        let Some(id) = ScorerId::parse(tag) else {
            continue;
        };
        let def = score::recorded_definition(&store, &id)
            .await
            .map_err(internal)?;
        let kind = score::metric_kind(&store, &id).await.map_err(internal)?;
        let (rows, scored) = counts
            .iter()
            .find(|r| r[0].as_deref() == Some(tag.as_str()))
            .map(|r| (r[1].clone(), r[2].clone()))
            .unwrap_or_default();
        let logic = manifest
            .stages
            .get(&format!("score:{tag}"))
            .and_then(|s| s.details.get("logic_hash"))
            .and_then(|v| v.as_str())
            .map(String::from);
        out.push((id, def, kind, rows, scored, logic));
    }
    if a.json {
        let arr: Vec<serde_json::Value> = out
            .iter()
            .map(|(id, def, kind, rows, scored, logic)| {
                serde_json::json!({
                    "tag": id.tag(), "scorer": id.name, "version": id.version,
                    "kind": def.as_ref().and_then(|d| d.get("kind")).cloned()
                        .unwrap_or_else(|| "built-in".into()),
                    "metric": kind.metric(),
                    "rows": rows.as_deref().and_then(|r| r.parse::<i64>().ok()),
                    "scored": scored.as_deref().and_then(|r| r.parse::<i64>().ok()),
                    "logic_hash": logic,
                    "definition": def.as_ref().and_then(|d| d.get("definition")).cloned(),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&arr).map_err(internal)?);
        return Ok(());
    }
    println!("scorer versions in {}\n", store.display());
    if out.is_empty() {
        println!("(none: the run has not been scored)");
        return Ok(());
    }
    let table: Vec<Vec<String>> = out
        .iter()
        .map(|(id, def, kind, rows, scored, _)| {
            vec![
                id.name.clone(),
                id.version.clone(),
                def.as_ref()
                    .and_then(|d| d.get("kind"))
                    .and_then(|k| k.as_str())
                    .unwrap_or("built-in")
                    .to_string(),
                kind.metric().to_string(),
                rows.clone().unwrap_or_else(|| "0".into()),
                scored.clone().unwrap_or_else(|| "0".into()),
            ]
        })
        .collect();
    println!(
        "{}",
        render_table(
            &["scorer", "version", "kind", "metric", "rows", "scored"],
            &table
        )
    );
    for (id, def, _, _, _, logic) in &out {
        println!("\n{}", id.tag());
        match def.as_ref().and_then(|d| d.get("definition")) {
            Some(d) => {
                let text = serde_json::from_value::<ScorerDef>(d.clone())
                    .ok()
                    .and_then(|d| d.to_toml())
                    .unwrap_or_else(|| serde_json::to_string_pretty(d).unwrap_or_default());
                for l in text.lines() {
                    println!("  {l}");
                }
            }
            None => println!(
                "  built-in scorer (logic hash {})",
                logic.as_deref().unwrap_or("not recorded")
            ),
        }
    }
    Ok(())
}
