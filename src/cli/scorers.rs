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
    /// Delete one scorer version: its `scores/NAME@VERSION/`, its nested judge run (unless
    /// another scorer version of the run uses the same one), its manifest entries, and
    /// `results` when they were aggregated from it. The manifest is rewritten first, in one
    /// atomic write, so the run never lists a scorer whose scores are half gone; a delete
    /// stopped midway is finished by running it again.
    #[arg(long, value_name = "NAME@VERSION")]
    pub delete: Option<String>,
}

/// The nested judge run (`judge/<judge version>`) that the scores of `id` were judged in,
/// if `id` is a judge: the built-in `judge@V` or a user scorer of kind `judge`.
async fn nested_judge_dir(
    store: &crate::storage::RunStore,
    pipeline: &serde_json::Value,
    id: &ScorerId,
) -> Result<Option<String>, CliError> {
    if id.name == "judge" {
        return Ok(Some(format!("judge/{}", id.version)));
    }
    let def = score::recorded_definition(store, id)
        .await
        .map_err(internal)?
        .and_then(|d| d.get("definition").cloned())
        .and_then(|d| serde_json::from_value::<ScorerDef>(d).ok());
    let Some(def) = def.filter(|d| d.kind == score::user::Kind::Judge) else {
        return Ok(None);
    };
    let model = def.model.clone().or_else(|| {
        pipeline
            .get("judge")
            .and_then(|j| serde_json::from_value(j.clone()).ok())
    });
    let Some(model) = model else {
        return Ok(None);
    };
    let checklist = crate::config::JudgeChecklist {
        questions: def.questions.clone().unwrap_or_default(),
        instructions: def.instructions.clone(),
        version: None,
    };
    Ok(Some(format!(
        "judge/{}",
        score::judge::version(&checklist, &model)
    )))
}

/// `scorers RUN --delete NAME@VERSION`.
async fn delete(run: &str, tag: &str) -> Result<(), CliError> {
    let (_, store, _) = open_run(run)
        .await
        .map_err(|e| CliError::BadInput(e.to_string()))?;
    let _lease = super::lease(&store).await?;
    // Read again under the lease: the writer it waited for may have changed it.
    let (ctx, store, mut manifest) = open_run(run)
        .await
        .map_err(|e| CliError::BadInput(e.to_string()))?;
    let id = ScorerId::parse(tag).ok_or_else(|| {
        CliError::BadInput(format!(
            "--delete {tag}: give NAME@VERSION (the run has: {})",
            manifest.scorer_versions.join(", ")
        ))
    })?;
    let listed = manifest.scorer_versions.contains(&id.tag());
    let parts = store.list_parts(&id.dir()).await.map_err(internal)?;
    let folder = store
        .exists(&format!("{}/{}", id.dir(), score::DEFINITION_FILE))
        .await
        .map_err(internal)?
        || !parts.is_empty();
    if !listed && !folder {
        return Err(CliError::BadInput(format!(
            "--delete {tag}: {} has no scores of it (it has: {})",
            store.display(),
            if manifest.scorer_versions.is_empty() {
                "none".to_string()
            } else {
                manifest.scorer_versions.join(", ")
            }
        )));
    }
    if let Some((stage, _)) = manifest
        .stages
        .iter()
        .find(|(_, r)| r.status == crate::storage::StageStatus::Running)
    {
        return Err(CliError::BadInput(format!(
            "--delete {tag}: stage `{stage}` of {} is marked running: delete only while no stage writes the run",
            store.display()
        )));
    }
    // What goes, decided before anything changes.
    let nested = nested_judge_dir(&store, &manifest.pipeline, &id).await?;
    let mut shared = false;
    if let Some(dir) = &nested {
        for other in manifest.scorer_versions.iter().filter(|t| **t != id.tag()) {
            if let Some(o) = ScorerId::parse(other)
                && nested_judge_dir(&store, &manifest.pipeline, &o)
                    .await?
                    .as_ref()
                    == Some(dir)
            {
                shared = true;
            }
        }
    }
    let results_of_it = !text_rows(
        &ctx,
        &format!(
            "SELECT 1 FROM results WHERE scorer = '{}' AND scoring_version = '{}' LIMIT 1",
            id.name.replace('\'', "''"),
            id.version.replace('\'', "''")
        ),
    )
    .await
    .map_err(internal)?
    .is_empty();
    // One atomic manifest write first: from here on the run no longer has the scorer.
    let stage = format!("score:{}", id.tag());
    manifest.scorer_versions.retain(|t| *t != id.tag());
    let removed = manifest.stages.remove(&stage);
    if let (Some(r), Some(last)) = (&removed, manifest.stages.get("score"))
        && last.started_at == r.started_at
        && last.rows == r.rows
    {
        manifest.stages.remove("score");
    }
    manifest.row_counts.remove(&id.dir());
    if results_of_it {
        manifest.stages.remove("aggregate");
        manifest.row_counts.remove("results");
    }
    manifest.save(&store).await.map_err(internal)?;
    store.delete_scratch(&id.dir()).await.map_err(internal)?;
    let mut gone = vec![format!("{} ({} parts)", id.dir(), parts.len())];
    if let Some(dir) = &nested
        && !shared
    {
        let n = store.list_parts(dir).await.map_err(internal)?.len();
        store.delete_scratch(dir).await.map_err(internal)?;
        if n > 0 {
            gone.push(format!("{dir} (the nested judge run, {n} parts)"));
        }
    }
    if results_of_it {
        store.delete_scratch("results").await.map_err(internal)?;
        gone.push("results (aggregated from it)".into());
    }
    println!(
        "deleted {} from {}: {}",
        id.tag(),
        store.display(),
        gone.join(", ")
    );
    if let (Some(dir), true) = (&nested, shared) {
        println!("kept {dir}: another scorer version of the run was judged in it");
    }
    Ok(())
}

pub async fn run(a: ScorersArgs) -> Result<(), CliError> {
    if let Some(tag) = &a.delete {
        return delete(&a.run, tag).await;
    }
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
