//! `evalflow import`: turns recorded runs into `cases` + `calls` (and the tool's own
//! scores), so archived runs flow into validate and score with no model calls.
//!
//! # Behavior
//! - Each FILE_OR_DIR is read by its format's reader in `crate::import` (evalflow pairs,
//!   Parquet, OpenAI Batch API output, Inspect AI logs, lm-eval samples, promptfoo
//!   results), detected from the content unless `--format` names one; a folder is walked
//!   for every file of a known format (others are listed as skipped). OpenAI batch input
//!   files, given with `--batch-input`, as arguments or found in a folder, are joined with
//!   the batch output by `custom_id`.
//! - One case per distinct (test, source case id) where the source has case ids (Inspect
//!   sample id, lm-eval doc id), else per distinct (test, whole request): every message
//!   (two conversations that end in the same user turn are two cases), the system prompt
//!   and the parameters that change the answer (`crate::import::request_case_key`); the
//!   test is `--test`, else the record's own `test`, else the source's (Inspect task,
//!   lm-eval task, promptfoo description), else `imported`; a record's `capability`
//!   field wins over `--capability`. Two records of one case with different `expected`
//!   are refused (exit 2, naming both) unless `--on-conflicting-expected first|last`
//!   says which wins. The case's cluster (`template_id`) is the `--cluster` field (every
//!   reader reads it; no record having it is exit 2), else the case itself. A sample
//!   index the source does not record is the order of repeats of the same (case, model),
//!   after the highest index recorded for it.
//! - Copies are imported once, with their count printed: the same file named twice is
//!   read once; a record identical to one of an earlier file but for where it came from
//!   (a copy of the file) is dropped (`--keep-duplicates` keeps it as a sample), and so is
//!   an exact copy of a sample (same index). Two different records of one sample are
//!   refused. A batch output line that repeats a `custom_id` of its file is a copy too
//!   (the id is unique in batch output): dropped, its count said on stderr. `--model`
//!   renames the one model of the sources; over several it is refused (exit 2) rather
//!   than pooling their samples.
//! - Every bad record is reported (the first 20 named, all counted; an error body is a
//!   provider-error call, not a bad record); `--skip-bad-lines FILE` imports the others
//!   and writes each bad one to FILE as a JSON line (file, row, field, error, the line).
//! - SIGINT or SIGTERM stops the import, removes `_import/`, every table it wrote and the
//!   root when it created it, and exits 130.
//! - Calls carry what the source recorded and NULL for the rest, plus the provenance
//!   columns `source_format`, `source_file`, `source_id` (see `import::calls_schema`).
//! - The tool's own verdicts become scores versions `<tool>-<scorer>@imported` under
//!   `scores/`, one row per imported call of that tool (NULL score for a call the tool did
//!   not score or that failed), so SQL compares them with evalflow's scorers.
//! - Writes `<root>/import.toml`, a pipeline naming the imported models (all of them,
//!   comma-separated, in its one `[model]`), and a manifest
//!   with `generate` and `call` complete: `evalflow validate <root>/import.toml --out <root>`
//!   and `evalflow score ...` then run as on any run.
//! - The core streams (`crate::import::sink`): a record that names its sample goes straight
//!   into an encoded `calls` part; the others, one case per key, the missing sample
//!   indices and the duplicate check come from DataFusion plans over scratch tables. A bad
//!   row or a duplicate leaves no table behind (and no root, when the import created it).
//!
//! # Errors
//! A bad row is exit 2, naming `file:line` (the row number for Parquet, the zip entry for
//! an `.eval` log) and the field.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Value, json};

use super::CliError;
use crate::import::sink::{CaseDefaults, ImportError as SinkError, ImportSink, OnConflict, Policy};

/// Records handed to the sink at once (its hashing runs on every core per chunk).
const IMPORT_CHUNK: usize = 2048;

/// Bad records named in the error message; the rest are counted.
const BAD_SHOWN: usize = 20;
use crate::import::{self, Detected, Format, ImportError, Options};
use crate::pipeline::Pipeline;
use crate::storage::{Manifest, RunStore, manifest_now};

#[derive(Debug, Clone, clap::Args)]
pub struct ImportArgs {
    /// Recorded runs: files or folders (walked for every file of a known format).
    #[arg(required = true, value_name = "FILE_OR_DIR")]
    pub files: Vec<PathBuf>,
    /// The run root to create.
    #[arg(long)]
    pub out: String,
    /// The source format (default: detected from each file's content).
    #[arg(long, value_enum, default_value = "auto")]
    pub format: Format,
    /// OpenAI Batch API input JSONL, joined with batch output by `custom_id` (repeatable).
    #[arg(long = "batch-input", value_name = "FILE")]
    pub batch_input: Vec<PathBuf>,
    /// The field holding each case's cluster (template): a pairs line's top-level or
    /// `metadata` field, a batch line's (or its input line's, or its request's `metadata`)
    /// field, a Parquet column, an Inspect sample metadata field, an lm-eval doc field or
    /// a promptfoo var. Without it each case is its own cluster; an import where no record
    /// has it is refused (exit 2).
    #[arg(long, value_name = "FIELD")]
    pub cluster: Option<String>,
    /// The field holding each case's expected answer (gold label) in an OpenAI Batch import:
    /// the output line's, its input line's, or its request's `metadata` field. Batch output
    /// carries none, and a case without one is left unscored by the checklist; the other
    /// formats carry their own (refused for them, exit 2).
    #[arg(long = "expected-field", value_name = "FIELD")]
    pub expected_field: Option<String>,
    /// The model name for every row (default: what each source names). It renames one
    /// model; sources that name several are refused (exit 2) rather than merged.
    #[arg(long)]
    pub model: Option<String>,
    /// Two records of one case (the same test and the whole request: every message, the
    /// system prompt, the parameters) with different `expected` are refused (exit 2,
    /// naming both) unless this says which wins: `first` or `last` in import order.
    #[arg(long, value_enum, value_name = "first|last")]
    pub on_conflicting_expected: Option<ConflictChoice>,
    /// Import the good records and write each bad one (file, row, field, error and the
    /// line itself) as a JSON line to FILE, instead of refusing the import.
    #[arg(long, value_name = "FILE")]
    pub skip_bad_lines: Option<PathBuf>,
    /// Keep records identical to one of an earlier file as more samples. By default they
    /// are copies (the same file given twice, two copies of a file) and are dropped, with
    /// their count printed; records repeated within one file are always kept as samples,
    /// and exact copies of one sample (the same sample index) are always dropped.
    #[arg(long)]
    pub keep_duplicates: bool,
    /// Test name of the imported cases (default: the source's task, else `imported`).
    #[arg(long)]
    pub test: Option<String>,
    /// Capability of the imported cases.
    #[arg(long, default_value = "imported")]
    pub capability: String,
    /// Test type of the imported cases (MFT, INV, DIR).
    #[arg(long, default_value = "MFT")]
    pub test_type: String,
    /// Role of the imported cases.
    #[arg(long, default_value = "single")]
    pub role: String,
    /// Answer languages validate accepts, comma-separated (default: every language a
    /// built-in scorer reads, `en,zh`, since an imported run's scorers are chosen later).
    #[arg(long, value_delimiter = ',')]
    pub languages: Option<Vec<String>>,
}

/// The winner of two `expected` answers of one case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ConflictChoice {
    First,
    Last,
}

fn bad(e: ImportError) -> CliError {
    CliError::BadInput(e.to_string())
}

/// What the paths given hold.
struct Sources {
    /// Files to import, with their format.
    files: Vec<(PathBuf, Format)>,
    /// OpenAI batch input files to join.
    inputs: Vec<PathBuf>,
    /// Files in folders of no format import reads.
    skipped: Vec<PathBuf>,
}

/// The files to read (with their format) and the batch inputs to join, from the paths
/// given: folders are walked in name order, hidden entries skipped.
fn plan_sources(a: &ImportArgs) -> Result<Sources, CliError> {
    let mut files = Vec::new();
    let mut inputs = a.batch_input.clone();
    let mut skipped = Vec::new();
    for p in &a.files {
        let meta = std::fs::metadata(p)
            .map_err(|e| CliError::BadInput(format!("{}: {e}", p.display())))?;
        if meta.is_dir() {
            let mut found = Vec::new();
            walk(p, &mut found).map_err(|e| CliError::BadInput(format!("{}: {e}", p.display())))?;
            found.sort();
            for f in found {
                if inputs.contains(&f) {
                    continue;
                }
                match import::detect_kind(&f).map_err(bad)? {
                    Detected::Format(k) if a.format == Format::Auto || a.format == k => {
                        files.push((f, k))
                    }
                    Detected::BatchInput => inputs.push(f),
                    _ => skipped.push(f),
                }
            }
        } else if a.format != Format::Auto {
            files.push((p.clone(), a.format));
        } else {
            match import::detect_kind(p).map_err(bad)? {
                Detected::Format(k) => files.push((p.clone(), k)),
                Detected::BatchInput => inputs.push(p.clone()),
                Detected::Unknown => {
                    return Err(CliError::BadInput(format!(
                        "{}: not a format import reads (evalflow pairs, Parquet, OpenAI batch output, Inspect log, lm-eval samples, \
                         promptfoo results); name one with --format",
                        p.display()
                    )));
                }
            }
        }
    }
    // The same file named twice (as an argument and inside a folder given too) is read
    // once; a copy under another name is caught record by record (see `keep_duplicates`).
    let mut seen = std::collections::BTreeSet::new();
    files.retain(|(f, _)| seen.insert(std::fs::canonicalize(f).unwrap_or_else(|_| f.clone())));
    Ok(Sources {
        files,
        inputs,
        skipped,
    })
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let p = e.path();
        if e.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        if e.file_type()?.is_dir() {
            walk(&p, out)?;
        } else {
            out.push(p);
        }
    }
    Ok(())
}

/// Runs the import.
pub async fn run(a: ImportArgs) -> Result<(), CliError> {
    if !crate::pipeline::TEST_TYPES.contains(&a.test_type.as_str()) {
        return Err(CliError::BadInput(format!(
            "--test-type `{}`: not one of MFT, INV, DIR",
            a.test_type
        )));
    }
    // A local root this import creates is removed again if the import fails.
    let created_dir =
        (!a.out.contains("://") && !Path::new(&a.out).exists()).then(|| PathBuf::from(&a.out));
    // SIGINT or SIGTERM: stop reading, and clean up as after an error (no `_import/`, no
    // table, no root the import created), then exit 130.
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    // A host's own Ctrl-C (the Python package) stops the import the same way.
    let hosted = super::interrupt_requested();
    let signals = tokio::spawn(async move {
        let hosted = hosted;
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let (Ok(mut int), Ok(mut term)) = (
                signal(SignalKind::interrupt()),
                signal(SignalKind::terminate()),
            ) else {
                return;
            };
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
                _ = hosted => {}
            }
        }
        #[cfg(not(unix))]
        tokio::select! {
            r = tokio::signal::ctrl_c() => if r.is_err() { return },
            _ = hosted => {}
        }
        let _ = stop_tx.send(true);
    });
    let out = a.out.clone();
    let skip_file = a.skip_bad_lines.clone();
    // A host that drops this command before it returns (a Ctrl-C it caught before the
    // import watched for one: it cancels instead of waiting) gets the same clean-up as an
    // interrupted import, once its runtime is down; dropped tasks no longer write then.
    let on_drop =
        super::embedded().then(|| CleanUpIfDropped(Some(LateCleanUp::of(&out, &created_dir))));
    // Samples are counted as records arrive; a source that gives an index after records
    // counted without one is imported again, numbered by the plans.
    let mut result = import_into(a.clone(), stop.clone(), true).await;
    if matches!(result, Ok(Attempt::Renumber)) {
        tracing::info!(
            "import: a record names its sample after records numbered without one: importing again, numbered by the plans"
        );
        result = import_into(a, stop, false).await;
    }
    let result = match result {
        Ok(Attempt::Renumber) => Err(CliError::Internal(
            "import: records renumbered twice".into(),
        )),
        r => r.map(|_| ()),
    };
    if let Some(g) = on_drop {
        g.disarm();
    }
    signals.abort();
    if matches!(result, Err(CliError::Interrupted(_))) {
        // Stopped in the middle of a plan: its tasks may still be writing; remove what
        // the import wrote, whichever stage it was in.
        if let Ok(store) = RunStore::open(&out) {
            let _ = store.delete_scratch("_import").await;
            if created_dir.is_none() {
                for t in ["cases", "calls", "scores"] {
                    let _ = store.delete_scratch(t).await;
                }
                let _ = std::fs::remove_file(Path::new(store.display()).join("import.toml"));
            }
        }
    }
    if result.is_err() {
        if let Some(d) = &created_dir {
            let _ = std::fs::remove_dir_all(d);
        }
        if let Some(f) = &skip_file {
            let _ = std::fs::remove_file(f);
        }
    }
    if matches!(result, Err(CliError::Interrupted(_))) && super::embedded() {
        // A host process is not ended: once the runtime is down (no task of the dropped
        // plan left), what such a task wrote late goes too.
        LateCleanUp::of(&out, &created_dir).defer();
    }
    if let Err(CliError::Interrupted(msg)) = &result
        && !super::embedded()
    {
        // A task of a plan that was dropped may land a part after the cleanup: end the
        // process now, before any can (a host process is not ended: it gets the error).
        crate::progress::errln!("{msg}");
        std::process::exit(130);
    }
    result
}

/// What an embedded import stopped part way removes once the host's runtime is down: the
/// root it created, else its `_import/` (local roots only).
struct LateCleanUp {
    created: Option<PathBuf>,
    local: Option<PathBuf>,
}

impl LateCleanUp {
    fn of(out: &str, created: &Option<PathBuf>) -> Self {
        LateCleanUp {
            created: created.clone(),
            local: (!out.contains("://")).then(|| PathBuf::from(out)),
        }
    }

    fn defer(self) {
        super::defer(move || {
            // Parsing and hashing jobs run on rayon, which the runtime's shutdown does not
            // wait for: let every rayon thread finish the job it holds first.
            rayon::broadcast(|_| ());
            std::thread::sleep(std::time::Duration::from_millis(100));
            if let Some(d) = self.created {
                let _ = std::fs::remove_dir_all(d);
            } else if let Some(root) = self.local {
                let _ = std::fs::remove_dir_all(root.join("_import"));
            }
        });
    }
}

/// Defers its clean-up if dropped still holding it: the import's future was dropped.
struct CleanUpIfDropped(Option<LateCleanUp>);

impl CleanUpIfDropped {
    /// The import returned: its own paths clean up.
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CleanUpIfDropped {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.defer();
        }
    }
}

fn interrupted() -> CliError {
    CliError::Interrupted(
        "import: interrupted; nothing was imported (no table, no _import/ left)".into(),
    )
}

/// How an import attempt ended.
enum Attempt {
    Done,
    /// Samples counted in memory met a record that names its own: start again without
    /// counting (nothing of the attempt is left).
    Renumber,
}

async fn import_into(
    a: ImportArgs,
    stop: tokio::sync::watch::Receiver<bool>,
    count_samples: bool,
) -> Result<Attempt, CliError> {
    let Sources {
        files,
        inputs,
        skipped,
    } = plan_sources(&a)?;
    if files.is_empty() {
        return Err(CliError::BadInput(format!(
            "{}: no file of a format import reads",
            a.files
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let languages: Vec<String> = a.languages.clone().unwrap_or_else(|| {
        crate::stages::score::ALL_LANGUAGES
            .iter()
            .map(|l| l.to_string())
            .collect()
    });
    if let Some(l) = languages.iter().find(|l| l.trim().is_empty()) {
        return Err(CliError::BadInput(format!(
            "--languages: empty language `{l}`"
        )));
    }
    if a.expected_field.is_some()
        && let Some((f, format)) = files.iter().find(|(_, f)| *f != Format::OpenaiBatch)
    {
        return Err(CliError::BadInput(format!(
            "--expected-field: {} is a {format:?} file, which carries its own expected answer; \
             --expected-field reads the gold labels of OpenAI Batch imports",
            f.display()
        )));
    }
    let opts = Options {
        model: a.model.clone(),
        cluster: a.cluster.clone(),
        expected_field: a.expected_field.clone(),
        batch_inputs: inputs.clone(),
        test: a.test.clone(),
    };
    let requests = if files.iter().any(|(_, f)| *f == Format::OpenaiBatch) {
        Arc::new(import::openai_batch::read_inputs(&inputs).map_err(bad)?)
    } else {
        Arc::default()
    };
    let store = RunStore::open(&a.out).map_err(|e| CliError::BadInput(e.to_string()))?;
    let _lease = super::lease(&store).await?;
    if Manifest::load(&store)
        .await
        .map_err(|e| CliError::Internal(e.to_string()))?
        .is_some()
    {
        return Err(CliError::BadInput(format!(
            "{}: already a run; import into a new --out",
            store.display()
        )));
    }
    let sources: Vec<String> = files.iter().map(|(f, _)| f.display().to_string()).collect();
    let sink_err = |e: SinkError| {
        if e.is_bad_input() {
            CliError::BadInput(e.to_string())
        } else {
            CliError::Internal(e.to_string())
        }
    };
    let mut sink = ImportSink::new(
        &store,
        CaseDefaults {
            test: a.test.clone(),
            capability: a.capability.clone(),
            test_type: a.test_type.clone(),
            role: a.role.clone(),
        },
        Policy {
            on_conflicting_expected: match a.on_conflicting_expected {
                None => OnConflict::Refuse,
                Some(ConflictChoice::First) => OnConflict::First,
                Some(ConflictChoice::Last) => OnConflict::Last,
            },
            keep_duplicates: a.keep_duplicates,
            cluster: a.cluster.clone(),
        },
    )
    .await
    .map_err(sink_err)?;
    // Numbered in the order they come: one file, or copies of files kept.
    if count_samples && (files.len() == 1 || a.keep_duplicates) {
        sink.count_samples();
    }
    let renumber = std::cell::Cell::new(false);
    let push_err = |e: SinkError| {
        if matches!(e, SinkError::Renumber) {
            renumber.set(true);
        }
        sink_err(e)
    };
    let mut skip_out = match &a.skip_bad_lines {
        Some(p) => Some(std::io::BufWriter::new(std::fs::File::create(p).map_err(
            |e| CliError::BadInput(format!("--skip-bad-lines {}: {e}", p.display())),
        )?)),
        None => None,
    };
    // Bad records: the first BAD_SHOWN named, all counted.
    let mut bad_shown: Vec<String> = Vec::new();
    let mut bad_total = 0u64;
    // With --model: each model the sources name, and where it was first named.
    let mut named: BTreeMap<Arc<str>, String> = BTreeMap::new();
    // Record by record: memory holds one staging batch, not the sources.
    let mut per_format: BTreeMap<&'static str, u64> = BTreeMap::new();
    // Batch output lines that repeat a custom_id of their file: copies, dropped.
    let repeats = import::openai_batch::Repeats::default();
    let pushed: Result<(), CliError> = async {
        for (path, format) in &files {
            let records = match format {
                Format::OpenaiBatch => {
                    import::openai_batch::open_joined(path, &opts, requests.clone(), repeats.clone())
                        .map_err(bad)?
                }
                f => import::open(path, *f, &opts).map_err(bad)?,
            };
            // In chunks, so the sink hashes a chunk's records on every core.
            let mut chunk = Vec::with_capacity(IMPORT_CHUNK);
            for r in records {
                if *stop.borrow() {
                    return Err(interrupted());
                }
                let r = match r {
                    Ok(r) => r,
                    Err(e) if e.is_row() => {
                        bad_total += 1;
                        if bad_shown.len() < BAD_SHOWN {
                            bad_shown.push(e.to_string());
                        }
                        if let Some(w) = skip_out.as_mut() {
                            use std::io::Write;
                            writeln!(w, "{}", e.to_json()).map_err(|e| {
                                CliError::Internal(format!("--skip-bad-lines: {e}"))
                            })?;
                        }
                        continue;
                    }
                    Err(e) => return Err(bad(e)),
                };
                if let (Some(m), Some(src)) = (&a.model, &r.request.source_model)
                    && !named.contains_key(src)
                {
                    let here = format!(
                        "{}:{}",
                        r.source.file,
                        r.source.id.as_deref().unwrap_or("?")
                    );
                    if let Some((other, at)) = named.iter().next() {
                        return Err(CliError::BadInput(format!(
                            "--model {m} would merge distinct models into one: `{other}` ({at}) and `{src}` ({here}); import each model on \
                             its own, or drop --model"
                        )));
                    }
                    named.insert(src.clone(), here);
                }
                // After a bad record the import fails (without --skip-bad-lines): the rest
                // is only read for its bad records.
                if bad_total > 0 && skip_out.is_none() {
                    continue;
                }
                *per_format.entry(r.source.format).or_default() += 1;
                chunk.push(r);
                if chunk.len() == IMPORT_CHUNK {
                    let full = std::mem::replace(&mut chunk, Vec::with_capacity(IMPORT_CHUNK));
                    sink.push_many(full).await.map_err(push_err)?;
                }
            }
            sink.push_many(chunk).await.map_err(push_err)?;
        }
        if bad_total > 0 && skip_out.is_none() {
            let more = bad_total - bad_shown.len() as u64;
            return Err(CliError::BadInput(format!(
                "{bad_total} bad record(s); nothing was imported (--skip-bad-lines FILE imports the others):\n  {}{}",
                bad_shown.join("\n  "),
                if more > 0 {
                    format!("\n  ... and {more} more")
                } else {
                    String::new()
                }
            )));
        }
        if let Some(w) = skip_out.take() {
            w.into_inner()
                .map_err(|e| CliError::Internal(format!("--skip-bad-lines: {e}")))?;
        }
        Ok(())
    }
    .await;
    if let Err(e) = pushed {
        // A bad row: nothing of the import stays.
        sink.abort().await;
        let _ = store.delete_scratch("_import").await;
        if renumber.get() {
            return Ok(Attempt::Renumber);
        }
        return Err(e);
    }
    if sink.rows() == 0 {
        sink.abort().await;
        let _ = store.delete_scratch("_import").await;
        return Err(CliError::BadInput(format!(
            "{}: no records",
            sources.join(", ")
        )));
    }
    // The plans: a signal drops them where they are (the caller then removes what they
    // wrote and exits before their tasks can write more).
    let mut stopped = stop.clone();
    let summary = tokio::select! {
        s = sink.finish() => match s {
            // `finish` deleted what the attempt wrote.
            Err(SinkError::Renumber) => return Ok(Attempt::Renumber),
            s => s.map_err(sink_err)?,
        },
        _ = stopped.wait_for(|s| *s) => return Err(interrupted()),
    };
    if *stop.borrow() {
        return Err(interrupted());
    }
    let models = summary.models.clone();
    // A pipeline has one `[model]`: with several models it names them all, and the calls
    // table says which model answered each call.
    let model_note = if models.len() > 1 {
        format!(
            "# The calls table holds {} models: {}. The [model] name lists them all (one\n# pipeline has one [model]); filter calls on \
             `model` for one of them.\n",
            models.len(),
            models.join(", ")
        )
    } else {
        String::new()
    };
    let pipeline_text = format!(
        "# Written by `evalflow import {}`: the pipeline of an imported run (no model is called;\n# the provider below only satisfies the \
         pipeline format: the calls table records NULL\n# where the file named no provider).\n{}\n[model]\nprovider = \"openai\"\nname = \
         {}\n\n[suite]\nname = \"imported\"\n\n[validate]\nlanguages = {}\n",
        sources.join(" "),
        model_note,
        // `name = ""` is refused when a pipeline is read: records whose model is empty text.
        json!(
            Some(models.join(", "))
                .filter(|n| !n.trim().is_empty())
                .unwrap_or_else(|| "unnamed".into())
        ),
        json!(languages)
    );
    let ppath = Path::new(store.display()).join("import.toml");
    let pipeline =
        Pipeline::parse(&pipeline_text, &ppath).map_err(|e| CliError::Internal(e.to_string()))?;
    let io = |e: crate::storage::StorageError| CliError::Internal(e.to_string());
    if store.table_url("x").starts_with("file:") {
        std::fs::write(&ppath, &pipeline_text)
            .map_err(|e| CliError::Internal(format!("{}: {e}", ppath.display())))?;
    }
    let mut manifest = Manifest {
        run_id: a
            .out
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or("import")
            .to_string(),
        evalflow_version: env!("CARGO_PKG_VERSION").to_string(),
        pipeline_path: ppath.display().to_string(),
        pipeline_hash: pipeline.hash(),
        pipeline: serde_json::to_value(&pipeline).unwrap_or(Value::Null),
        created_at: manifest_now(),
        finished_at: None,
        stages: BTreeMap::new(),
        row_counts: BTreeMap::new(),
        scorer_versions: vec![],
        validator_version: None,
    };
    let clusters = if summary.clustered == 0 {
        json!("none: each case is its own cluster")
    } else {
        json!(a.cluster)
    };
    manifest.complete(
        "generate",
        "cases",
        summary.cases,
        BTreeMap::from([
            ("imported_from".into(), json!(sources)),
            ("clusters".into(), clusters),
        ]),
    );
    manifest.complete(
        "call",
        "calls",
        summary.calls,
        BTreeMap::from([
            ("imported_from".into(), json!(sources)),
            ("models".into(), json!(models)),
            ("formats".into(), json!(per_format)),
        ]),
    );
    for (tag, dir, n) in &summary.scores {
        manifest.scorer_versions.push(tag.clone());
        manifest.complete(
            &format!("score:{tag}"),
            dir,
            *n,
            BTreeMap::from([("imported".into(), json!(true))]),
        );
    }
    manifest.save(&store).await.map_err(io)?;
    let formats: Vec<String> = per_format.iter().map(|(f, n)| format!("{n} {f}")).collect();
    crate::progress::outln!(
        "imported {} calls ({}) over {} cases into {} (next: evalflow validate {} --out {})",
        summary.calls,
        formats.join(", "),
        summary.cases,
        store.display(),
        ppath.display(),
        store.display()
    );
    if summary.clustered == 0 {
        crate::progress::outln!(
            "clusters: none recorded (no --cluster field): each case is its own cluster"
        );
    } else if summary.clustered < summary.cases {
        crate::progress::outln!(
            "clusters: {} of {} cases have the --cluster field; the others are their own cluster",
            summary.clustered,
            summary.cases
        );
    }
    for (tag, _, n) in &summary.scores {
        crate::progress::outln!("imported scores {tag}: {n} rows");
    }
    if repeats.count() > 0 {
        crate::progress::errln!(
            "openai-batch: {} output line(s) repeated the custom_id of an earlier line of their file and were dropped as copies (a custom_id \
             is unique in batch output; each request is imported once)",
            repeats.count()
        );
    }
    if summary.duplicates > 0 {
        crate::progress::outln!(
            "duplicates: {} record(s) were exact copies of others (the same file twice, or a copy of it) and were imported once{}",
            summary.duplicates,
            if a.keep_duplicates {
                ""
            } else {
                "; --keep-duplicates keeps the copies in other files of records without a sample index, as more samples"
            }
        );
    }
    if bad_total > 0
        && let Some(p) = &a.skip_bad_lines
    {
        crate::progress::outln!(
            "skipped {bad_total} bad record(s), written to {}:\n  {}{}",
            p.display(),
            bad_shown.join("\n  "),
            if bad_total > bad_shown.len() as u64 {
                format!("\n  ... and {} more", bad_total - bad_shown.len() as u64)
            } else {
                String::new()
            }
        );
    }
    if !skipped.is_empty() {
        crate::progress::errln!(
            "skipped {} file(s) of no format import reads: {}",
            skipped.len(),
            skipped
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(Attempt::Done)
}
