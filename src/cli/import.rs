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
//!   sample id, lm-eval doc id), else per distinct (test, system, input); the test is
//!   `--test`, else the source's
//!   (Inspect task, lm-eval task, promptfoo description), else `imported`. The case's
//!   cluster (`template_id`) is the `--cluster` field where the source has it, else the
//!   case itself. A sample index the source does not record is the order of repeats of
//!   the same (case, model).
//! - Calls carry what the source recorded and NULL for the rest, plus the provenance
//!   columns `source_format`, `source_file`, `source_id` (see `import::calls_schema`).
//! - The tool's own verdicts become scores versions `<tool>-<scorer>@imported` under
//!   `scores/`, one row per imported call of that tool (NULL score for a call the tool did
//!   not score or that failed), so SQL compares them with evalflow's scorers.
//! - Writes `<root>/import.toml`, a pipeline naming the imported model, and a manifest
//!   with `generate` and `call` complete: `evalflow validate <root>/import.toml --out <root>`
//!   and `evalflow score ...` then run as on any run.
//! - This core still collects the records before writing (every file is read before the
//!   root is created, so a bad row leaves nothing behind); the readers themselves stream.
//!
//! # Errors
//! A bad row is exit 2, naming `file:line` (the row number for Parquet, the zip entry for
//! an `.eval` log) and the field.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use datafusion::arrow::array::{
    ArrayRef, BooleanArray, Float64Array, Int32Array, RecordBatch, StringArray, new_null_array,
};
use serde_json::{Value, json};

use super::CliError;
use crate::import::{self, Detected, Format, ImportError, Options, Record};
use crate::pipeline::{ModelConfig, Pipeline};
use crate::schema::Table;
use crate::stages::call::{self, CallRequest, CallResult, CallRow};
use crate::stages::generate::{self, Case};
use crate::storage::{Manifest, RunStore, manifest_now};

#[derive(Debug, clap::Args)]
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
    /// The field holding each case's cluster (template): an Inspect sample metadata field,
    /// an lm-eval doc field or a promptfoo var. Without it each case is its own cluster.
    #[arg(long, value_name = "FIELD")]
    pub cluster: Option<String>,
    /// The model name for every row (default: what each source names).
    #[arg(long)]
    pub model: Option<String>,
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
                        "{}: not a format import reads (evalflow pairs, Parquet, OpenAI batch output, Inspect log, lm-eval samples, promptfoo results); name one with --format",
                        p.display()
                    )));
                }
            }
        }
    }
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

/// One imported call, with the facts the call stage would otherwise fill itself.
struct Imported {
    row: CallRow,
    provider: Option<String>,
    attempts: Option<i32>,
    latency_ms: Option<f64>,
    started_at_us: Option<i64>,
    source: import::Provenance,
    case: usize,
}

/// One imported score row before it becomes a batch.
struct ScoreRow {
    call: usize,
    score: Option<f64>,
    label: Option<String>,
    passed: Option<bool>,
    detail: Option<String>,
}

/// Everything read from the sources.
#[derive(Default)]
struct Corpus {
    cases: Vec<Case>,
    case_of: HashMap<(String, Option<String>, String), usize>,
    calls: Vec<Imported>,
    /// Model name -> indices of its calls.
    by_model: BTreeMap<String, Vec<usize>>,
    repeats: HashMap<(String, String), i32>,
    seen: HashSet<String>,
    /// (tool, scorer) -> rows; the scores version is `<tool>-<scorer>@imported`.
    scores: BTreeMap<(String, String), Vec<ScoreRow>>,
    /// The tool of each call (for filling unscored rows).
    tool_of_call: Vec<String>,
    clustered: usize,
}

impl Corpus {
    fn add(&mut self, a: &ImportArgs, r: Record) -> Result<(), CliError> {
        let test = a
            .test
            .clone()
            .or_else(|| r.test.clone())
            .unwrap_or_else(|| "imported".into());
        let key = match &r.case_key {
            Some(k) => (test.clone(), Some(format!("\u{0}{k}")), String::new()),
            None => (test.clone(), r.system.clone(), r.input.clone()),
        };
        let idx = match self.case_of.get(&key) {
            Some(i) => *i,
            None => {
                let id =
                    call::sha_hex(&["imported", &test, key.1.as_deref().unwrap_or(""), &key.2])
                        [..24]
                        .to_string();
                if r.cluster.is_some() {
                    self.clustered += 1;
                }
                self.cases.push(Case {
                    case_id: id.clone(),
                    suite: "imported".into(),
                    test: test.clone(),
                    capability: r.capability.clone().unwrap_or_else(|| a.capability.clone()),
                    test_type: a.test_type.clone(),
                    template_id: r.cluster.clone().unwrap_or_else(|| id.clone()),
                    group_id: id,
                    role: a.role.clone(),
                    input: r.input.clone(),
                    expected: r.expected.clone(),
                    expectation: None,
                    tolerance: None,
                    perturbation: None,
                });
                self.case_of.insert(key, self.cases.len() - 1);
                self.cases.len() - 1
            }
        };
        let case_id = self.cases[idx].case_id.clone();
        let next = self
            .repeats
            .entry((case_id.clone(), r.model.clone()))
            .or_insert(0);
        let sample_idx = r.sample_idx.unwrap_or(*next);
        *next = (*next).max(sample_idx + 1);
        let request_hash = call::sha_hex(&[&r.request_key])[..32].to_string();
        let call_id = call::call_id(&case_id, &r.model, sample_idx, &request_hash);
        if !self.seen.insert(call_id.clone()) {
            return Err(CliError::BadInput(format!(
                "{}: two records for case `{}` model `{}` sample {}: give distinct sample_idx",
                r.source.file, r.input, r.model, sample_idx
            )));
        }
        let failed = r.error.is_some() || r.http_status.is_some_and(|s| !(200..300).contains(&s));
        let n = self.calls.len();
        let tool = import::tool_of(r.source.format).to_string();
        for s in &r.scores {
            self.scores
                .entry((tool.clone(), s.scorer.clone()))
                .or_default()
                .push(ScoreRow {
                    call: n,
                    // DESIGN: score is NULL whenever the call is not a valid answer.
                    score: if failed { None } else { s.score },
                    label: s.label.clone(),
                    passed: if failed { None } else { s.passed },
                    detail: s.detail.clone(),
                });
        }
        self.tool_of_call.push(tool);
        self.by_model.entry(r.model.clone()).or_default().push(n);
        self.calls.push(Imported {
            row: CallRow {
                req: CallRequest {
                    call_id,
                    case_id,
                    input: r.input.clone(),
                    prompt: r.input,
                    system: r.system,
                    sample_idx,
                    max_tokens: r.max_tokens,
                    temperature: r.temperature,
                    request_hash,
                },
                res: CallResult {
                    response: r.response,
                    finish_reason: r.finish_reason,
                    prompt_tokens: r.prompt_tokens,
                    completion_tokens: r.completion_tokens,
                    reasoning_tokens: r.reasoning_tokens,
                    reasoning_chars: r.reasoning_chars,
                    http_status: r.http_status,
                    error: r.error,
                    ..CallResult::default()
                },
                latency_ms: 0.0,
                started_at_us: 0,
            },
            provider: r.provider,
            attempts: r.attempts,
            latency_ms: r.latency_ms,
            started_at_us: r.started_at_us,
            source: r.source,
            case: idx,
        });
        Ok(())
    }

    /// Adds a NULL-score row for every call of a tool that its scorer did not score, so
    /// each imported scores version has one row per call of that tool.
    fn fill_unscored(&mut self) {
        for ((tool, _), rows) in self.scores.iter_mut() {
            let have: HashSet<usize> = rows.iter().map(|r| r.call).collect();
            for (i, t) in self.tool_of_call.iter().enumerate() {
                if t != tool || have.contains(&i) {
                    continue;
                }
                rows.push(ScoreRow {
                    call: i,
                    score: None,
                    label: None,
                    passed: None,
                    detail: None,
                });
            }
            rows.sort_by_key(|r| r.call);
        }
    }
}

/// Replaces the columns the call stage fills from its own run (provider, attempts,
/// latency, start time) with what the source recorded, NULL where it recorded nothing,
/// and appends the provenance columns.
fn calls_batch(cfg: &ModelConfig, calls: &[&Imported]) -> Result<RecordBatch, CliError> {
    let rows: Vec<CallRow> = calls.iter().map(|c| c.row.clone()).collect();
    let b = call::to_batch(cfg, &rows);
    let schema = import::calls_schema();
    let mut cols = b.columns().to_vec();
    let base = b.schema();
    let set = |cols: &mut Vec<ArrayRef>, name: &str, a: ArrayRef| -> Result<(), CliError> {
        let i = base.index_of(name).map_err(super::internal)?;
        cols[i] = a;
        Ok(())
    };
    set(
        &mut cols,
        "provider",
        Arc::new(
            calls
                .iter()
                .map(|c| c.provider.as_deref())
                .collect::<StringArray>(),
        ),
    )?;
    set(
        &mut cols,
        "attempts",
        Arc::new(calls.iter().map(|c| c.attempts).collect::<Int32Array>()),
    )?;
    set(
        &mut cols,
        "latency_ms",
        Arc::new(calls.iter().map(|c| c.latency_ms).collect::<Float64Array>()),
    )?;
    set(
        &mut cols,
        "started_at",
        Arc::new(
            calls
                .iter()
                .map(|c| c.started_at_us)
                .collect::<datafusion::arrow::array::TimestampMicrosecondArray>()
                .with_timezone("UTC"),
        ),
    )?;
    cols.push(Arc::new(StringArray::from_iter_values(
        calls.iter().map(|c| c.source.format),
    )));
    cols.push(Arc::new(StringArray::from_iter_values(
        calls.iter().map(|c| c.source.file.as_str()),
    )));
    cols.push(Arc::new(
        calls
            .iter()
            .map(|c| c.source.id.as_deref())
            .collect::<StringArray>(),
    ));
    RecordBatch::try_new(schema, cols).map_err(super::internal)
}

/// The rows of one imported scores version as a `scores` batch.
fn scores_batch(
    c: &Corpus,
    scorer: &str,
    rows: &[ScoreRow],
    models: &HashMap<usize, &str>,
) -> Result<RecordBatch, CliError> {
    let call = |r: &ScoreRow| &c.calls[r.call];
    let case = |r: &ScoreRow| &c.cases[call(r).case];
    let s = |f: &dyn Fn(&ScoreRow) -> String| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
    };
    let failed = |r: &ScoreRow| {
        let res = &call(r).row.res;
        res.error.is_some() || res.http_status.is_some_and(|h| !(200..300).contains(&h))
    };
    let schema = Table::Scores.schema();
    let answers_t = schema
        .field_with_name("answers")
        .map_err(super::internal)?
        .data_type()
        .clone();
    let cols: Vec<ArrayRef> = vec![
        s(&|r| call(r).row.req.call_id.clone()),
        s(&|r| call(r).row.req.case_id.clone()),
        s(&|r| models[&r.call].to_string()),
        Arc::new(Int32Array::from_iter_values(
            rows.iter().map(|r| call(r).row.req.sample_idx),
        )),
        s(&|_| scorer.to_string()),
        s(&|_| "imported".to_string()),
        Arc::new(
            rows.iter()
                .map(|r| call::response_hash(call(r).row.res.response.as_deref()))
                .collect::<StringArray>(),
        ),
        s(&|r| {
            if failed(r) {
                "provider_error".into()
            } else {
                "valid_answer".into()
            }
        }),
        Arc::new(rows.iter().map(|r| r.score).collect::<Float64Array>()),
        Arc::new(
            rows.iter()
                .map(|r| r.label.as_deref())
                .collect::<StringArray>(),
        ),
        new_null_array(&datafusion::arrow::datatypes::DataType::Float64, rows.len()),
        Arc::new(rows.iter().map(|r| r.passed).collect::<BooleanArray>()),
        Arc::new(
            rows.iter()
                .map(|r| r.detail.as_deref())
                .collect::<StringArray>(),
        ),
        new_null_array(&answers_t, rows.len()),
        s(&|r| case(r).test.clone()),
        s(&|r| case(r).capability.clone()),
        s(&|r| case(r).test_type.clone()),
        s(&|r| case(r).role.clone()),
        s(&|r| case(r).template_id.clone()),
    ];
    RecordBatch::try_new(schema, cols).map_err(super::internal)
}

/// Runs the import.
pub async fn run(a: ImportArgs) -> Result<(), CliError> {
    if !crate::pipeline::TEST_TYPES.contains(&a.test_type.as_str()) {
        return Err(CliError::BadInput(format!(
            "--test-type `{}`: not one of MFT, INV, DIR",
            a.test_type
        )));
    }
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
    let opts = Options {
        model: a.model.clone(),
        cluster: a.cluster.clone(),
        batch_inputs: inputs.clone(),
    };
    let requests = if files.iter().any(|(_, f)| *f == Format::OpenaiBatch) {
        Arc::new(import::openai_batch::read_inputs(&inputs).map_err(bad)?)
    } else {
        Arc::default()
    };
    let mut corpus = Corpus::default();
    let mut per_format: BTreeMap<&'static str, u64> = BTreeMap::new();
    for (path, format) in &files {
        let records = match format {
            Format::OpenaiBatch => {
                import::openai_batch::open_joined(path, &opts, requests.clone()).map_err(bad)?
            }
            f => import::open(path, *f, &opts).map_err(bad)?,
        };
        for r in records {
            let r = r.map_err(bad)?;
            *per_format.entry(r.source.format).or_default() += 1;
            corpus.add(&a, r)?;
        }
    }
    if corpus.calls.is_empty() {
        return Err(CliError::BadInput(format!(
            "{}: no records",
            files
                .iter()
                .map(|(f, _)| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    corpus.fill_unscored();
    let store = RunStore::open(&a.out).map_err(|e| CliError::BadInput(e.to_string()))?;
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
    let models: Vec<String> = corpus.by_model.keys().cloned().collect();
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
    let sources: Vec<String> = files.iter().map(|(f, _)| f.display().to_string()).collect();
    let pipeline_text = format!(
        "# Written by `evalflow import {}`: the pipeline of an imported run (no model is called;\n# the provider below only satisfies the pipeline format: the calls table records NULL\n# where the file named no provider).\n\n[model]\nprovider = \"openai\"\nname = {}\n\n[suite]\nname = \"imported\"\n\n[validate]\nlanguages = {}\n",
        sources.join(" "),
        json!(models[0]),
        json!(languages)
    );
    let ppath = Path::new(store.display()).join("import.toml");
    let pipeline =
        Pipeline::parse(&pipeline_text, &ppath).map_err(|e| CliError::Internal(e.to_string()))?;
    let io = |e: crate::storage::StorageError| CliError::Internal(e.to_string());
    let mut w = store.part_writer("cases", Table::Cases.schema(), "part");
    for chunk in corpus.cases.chunks(8192) {
        w.write(generate::to_batch(chunk)).await.map_err(io)?;
    }
    w.finish().await.map_err(io)?;
    let mut w = store.part_writer("calls", import::calls_schema(), "part-imported");
    let mut model_of: HashMap<usize, &str> = HashMap::new();
    for (m, idx) in &corpus.by_model {
        let cfg = ModelConfig {
            name: m.clone(),
            ..pipeline.model.clone()
        };
        for chunk in idx.chunks(8192) {
            let calls: Vec<&Imported> = chunk.iter().map(|i| &corpus.calls[*i]).collect();
            w.write(calls_batch(&cfg, &calls)?).await.map_err(io)?;
        }
        for i in idx {
            model_of.insert(*i, m.as_str());
        }
    }
    w.finish().await.map_err(io)?;
    let n_calls = corpus.calls.len() as u64;
    let mut score_counts = Vec::new();
    for ((tool, name), rows) in &corpus.scores {
        let scorer = format!("{tool}-{name}");
        let dir = format!("scores/{scorer}@imported");
        let mut w = store.part_writer(&dir, Table::Scores.schema(), "part");
        for chunk in rows.chunks(8192) {
            w.write(scores_batch(&corpus, &scorer, chunk, &model_of)?)
                .await
                .map_err(io)?;
        }
        w.finish().await.map_err(io)?;
        score_counts.push((format!("{scorer}@imported"), dir, rows.len() as u64));
    }
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
    let clusters = if corpus.clustered == 0 {
        json!("none: each case is its own cluster")
    } else {
        json!(a.cluster)
    };
    manifest.complete(
        "generate",
        "cases",
        corpus.cases.len() as u64,
        BTreeMap::from([
            ("imported_from".into(), json!(sources)),
            ("clusters".into(), clusters),
        ]),
    );
    manifest.complete(
        "call",
        "calls",
        n_calls,
        BTreeMap::from([
            ("imported_from".into(), json!(sources)),
            ("models".into(), json!(models)),
            ("formats".into(), json!(per_format)),
        ]),
    );
    for (tag, dir, n) in &score_counts {
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
    println!(
        "imported {n_calls} calls ({}) over {} cases into {} (next: evalflow validate {} --out {})",
        formats.join(", "),
        corpus.cases.len(),
        store.display(),
        ppath.display(),
        store.display()
    );
    if corpus.clustered == 0 {
        println!("clusters: none recorded (no --cluster field): each case is its own cluster");
    } else if corpus.clustered < corpus.cases.len() {
        println!(
            "clusters: {} of {} cases have the --cluster field; the others are their own cluster",
            corpus.clustered,
            corpus.cases.len()
        );
    }
    for (tag, _, n) in &score_counts {
        println!("imported scores {tag}: {n} rows");
    }
    if !skipped.is_empty() {
        eprintln!(
            "skipped {} file(s) of no format import reads: {}",
            skipped.len(),
            skipped
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}
