//! `evalflow runs ROOT`: the runs under a folder (every folder holding a `manifest.json`),
//! with their id, age, stages and scorer versions, so a user finds a run without opening
//! manifests by hand.

use std::path::{Path, PathBuf};

use super::{CliError, internal};
use crate::stages::aggregate::render_table;
use crate::storage::{Manifest, RunStore, StageStatus};

#[derive(Debug, clap::Args)]
pub struct RunsArgs {
    /// The folder to search (local; runs are found at any depth, a run's own folders such as
    /// its nested judge runs are not listed).
    #[arg(default_value = "runs")]
    pub root: PathBuf,
    /// Print one JSON array (path, run_id, created_at, finished_at, stages, scorer_versions,
    /// row_counts).
    #[arg(long)]
    pub json: bool,
}

/// The folders under `dir` (itself included) that hold a `manifest.json`, not descending
/// into a run.
fn find_runs(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    if dir.join("manifest.json").is_file() {
        out.push(dir.to_path_buf());
        return Ok(());
    }
    let mut subs: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    subs.sort();
    for s in subs {
        // An unreadable folder is skipped, not fatal: the others are still listed.
        let _ = find_runs(&s, out);
    }
    Ok(())
}

pub async fn run(a: RunsArgs) -> Result<(), CliError> {
    let root = &a.root;
    if root.to_string_lossy().contains("://") {
        return Err(CliError::BadInput(format!(
            "runs {}: lists local folders only (open a remote run with its URL)",
            root.display()
        )));
    }
    if !root.is_dir() {
        return Err(CliError::BadInput(format!(
            "runs {}: no such folder",
            root.display()
        )));
    }
    let mut dirs = Vec::new();
    find_runs(root, &mut dirs)
        .map_err(|e| CliError::BadInput(format!("{}: {e}", root.display())))?;
    let mut runs = Vec::new();
    for d in dirs {
        let shown = d.display().to_string();
        let store = RunStore::open(&shown).map_err(internal)?;
        match Manifest::load(&store).await {
            Ok(Some(m)) => runs.push((shown, Ok(m))),
            Ok(None) => {}
            Err(e) => runs.push((shown, Err(e.to_string()))),
        }
    }
    runs.sort_by(|(pa, a), (pb, b)| {
        let created = |m: &Result<Manifest, String>| {
            m.as_ref().map(|m| m.created_at.clone()).unwrap_or_default()
        };
        (created(a), pa).cmp(&(created(b), pb))
    });
    if a.json {
        let arr: Vec<serde_json::Value> = runs
            .iter()
            .map(|(path, m)| match m {
                Ok(m) => serde_json::json!({
                    "path": path, "run_id": m.run_id, "created_at": m.created_at,
                    "finished_at": m.finished_at,
                    "stages": m.stages.iter().map(|(k, r)| (k.clone(), serde_json::json!(r.status)))
                        .collect::<serde_json::Map<_, _>>(),
                    "scorer_versions": m.scorer_versions, "row_counts": m.row_counts,
                }),
                Err(e) => serde_json::json!({"path": path, "error": e}),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&arr).map_err(internal)?);
        return Ok(());
    }
    if runs.is_empty() {
        println!(
            "no runs under {} (no folder holds a manifest.json)",
            root.display()
        );
        return Ok(());
    }
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|(path, m)| match m {
            Ok(m) => {
                let stages: Vec<String> = ["generate", "call", "validate", "score", "aggregate"]
                    .iter()
                    .filter_map(|s| {
                        let r = m.stages.get(*s)?;
                        Some(match r.status {
                            StageStatus::Complete => s.to_string(),
                            StageStatus::Running => format!("{s} (running)"),
                            StageStatus::Failed => format!("{s} (failed)"),
                        })
                    })
                    .collect();
                let count = |t: &str| m.row_counts.get(t).map(u64::to_string).unwrap_or_default();
                vec![
                    m.run_id.clone(),
                    path.clone(),
                    m.created_at.clone(),
                    stages.join(", "),
                    m.scorer_versions.join(", "),
                    count("cases"),
                    count("calls"),
                ]
            }
            Err(e) => vec![
                "?".into(),
                path.clone(),
                String::new(),
                format!("unreadable manifest: {e}"),
                String::new(),
                String::new(),
                String::new(),
            ],
        })
        .collect();
    println!(
        "{} run{} under {}\n{}",
        runs.len(),
        if runs.len() == 1 { "" } else { "s" },
        root.display(),
        render_table(
            &[
                "run", "path", "created", "stages", "scorers", "cases", "calls"
            ],
            &rows
        )
    );
    Ok(())
}

/// The root of a new `evalflow run` without `--out`: `runs/<name>-<UTC second>-<pid>`, with
/// `-2`, `-3`, ... when that folder exists. The process id keeps two runs started in the
/// same second (two terminals, a CI matrix) from sharing one folder and one run id, where
/// the second would resume the first.
///
/// # Errors
/// The pipeline's own error when it cannot be loaded.
/// The run under `runs/` of this pipeline (the same content hash) whose batch-mode call left
/// batches open (chunk states in `_journal/batches/`): a `run --batch` without `--out` that
/// was killed, or stopped with `--no-wait`, is collected by the same command instead of
/// submitting a second batch to a new root. The newest such run, if any.
pub(crate) fn unfinished_batch_root(pipeline: &Path) -> Option<String> {
    let hash = crate::pipeline::Pipeline::load(pipeline).ok()?.hash();
    let mut found: Vec<(String, String)> = Vec::new();
    for e in std::fs::read_dir("runs").ok()?.flatten() {
        let dir = e.path();
        let open = std::fs::read_dir(dir.join("_journal").join("batches"))
            .map(|d| {
                d.flatten()
                    .any(|f| f.file_name().to_string_lossy().ends_with(".state.json"))
            })
            .unwrap_or(false);
        if !open {
            continue;
        }
        // A manifest is a few KB (stages and pipeline), read whole like every reader of it.
        let Ok(bytes) = std::fs::read(dir.join("manifest.json")) else {
            continue;
        };
        let Ok(m) = serde_json::from_slice::<Manifest>(&bytes) else {
            continue;
        };
        if m.pipeline_hash == hash {
            found.push((
                m.created_at,
                format!("runs/{}", e.file_name().to_string_lossy()),
            ));
        }
    }
    found.sort();
    found.pop().map(|(_, root)| root)
}

pub(crate) fn fresh_root(pipeline: &Path) -> Result<String, CliError> {
    let p = crate::pipeline::Pipeline::load(pipeline).map_err(|e| CliError::Run(e.into()))?;
    let base = format!(
        "{}-{:05}",
        crate::runner::default_run_id(&p),
        std::process::id() % 100_000
    );
    let mut root = format!("runs/{base}");
    let mut k = 2;
    while Path::new(&root).exists() {
        root = format!("runs/{base}-{k}");
        k += 1;
    }
    Ok(root)
}
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// The run root (a local path, memory://NAME or s3://bucket/prefix).
    pub run: String,
}

/// `evalflow status RUN`: each stage's state and rows, and the batches a batch-mode call
/// left open (`--no-wait`): their ids, chunks, states and requests.
pub async fn status(a: StatusArgs) -> Result<(), CliError> {
    let store = RunStore::open(&a.run).map_err(|e| CliError::BadInput(e.to_string()))?;
    let m = Manifest::load(&store)
        .await
        .map_err(internal)?
        .ok_or_else(|| {
            CliError::BadInput(format!("{}: no manifest.json: not a run root", a.run))
        })?;
    println!("run {} ({})", m.run_id, store.display());
    for (name, r) in &m.stages {
        let state = match r.status {
            StageStatus::Running => "running",
            StageStatus::Complete => "complete",
            StageStatus::Failed => "failed",
        };
        println!("  {name:<10} {state:<9} {} rows", r.rows);
    }
    // The journal's chunk states (what a killed call left, and the latest state a call
    // recorded), else what a `--no-wait` call wrote into the manifest.
    let journal: Vec<serde_json::Value> = crate::stages::call::batch::open_chunks(&store)
        .iter()
        .map(|c| {
            serde_json::json!({"batch_id": c.batch_id, "chunk": c.key, "requests": c.requests,
                               "status": c.status.as_deref().unwrap_or("not created")})
        })
        .collect();
    let open = if journal.is_empty() {
        m.stages
            .get("call")
            .and_then(|r| r.details.get("open_batches"))
            .and_then(serde_json::Value::as_array)
            .cloned()
            .unwrap_or_default()
    } else {
        journal
    };
    if !open.is_empty() {
        println!(
            "open batches ({}; `call` or `run` on this root collects them):",
            open.len()
        );
        for b in &open {
            let s = |k: &str| {
                b.get(k)
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or("-")
                    .to_string()
            };
            println!(
                "  {} (chunk {}): {} requests, {}",
                s("batch_id"),
                s("chunk"),
                b.get("requests")
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0),
                s("status")
            );
        }
    }
    Ok(())
}
