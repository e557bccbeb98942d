//! The streaming core of `evalflow import`: records of any source format in, `cases` and
//! `calls` out, in memory bounded by a batch and the query memory pool.
//!
//! # How
//! 1. [`ImportSink::push_many`] takes records in file order, computes each one's case id,
//!    request and response hashes and, when the record names its sample, its call id (on
//!    rayon's pool), then routes it:
//!    - **direct**: a record with its sample index and no imported scores is already a
//!      `calls` row. Its batch goes to one of `--threads` writer tasks that encode the
//!      final, compressed parts under `_import/calls/`. Its (`seq`, `call_id`, `fp`) is
//!      held in memory while they fit ([`seen_ids::SeenIds`]; checked at the end, and
//!      written to a small scratch table for the duplicate check only when two are
//!      equal), else written to that table. A corpus of such
//!      records (the common case) is parsed and encoded once, with no staging of its
//!      answers.
//!    - **counted**: a record without a sample index, while every record before it also
//!      lacked one and none was staged ([`staging::SampleCounts`], one file or
//!      `--keep-duplicates`): its index is counted in memory and it is a direct record,
//!      distinct from every other by its number (no duplicate check of its id). Once the
//!      counts hold their bound of (case, model) pairs, a new pair's records are staged
//!      and numbered among themselves at the end, bucket by bucket.
//!    - **staged**: a record without a sample index (its index depends on the repeats of
//!      its case and model across the whole corpus) or with imported scores (which must
//!      find their call) is appended to a scratch staging table under
//!      `_import/staging/`, for the plans of step 2.
//!
//!    Every record whose case differs from the record before it also appends its case's
//!    fields to `_import/cases/` (records of one case usually sit together, so this holds
//!    about one row per case, not per record).
//! 2. [`ImportSink::finish`] runs DataFusion plans over the scratch tables, so what needs
//!    the whole corpus is a hash aggregation, join or window that spills under
//!    `--memory-limit`, never a map:
//!    - staged `calls`: sample indices from the file, else the order of repeats of the same
//!      (case, model) after the highest given index (`row_number()` over the records that
//!      lack one), and the call id as a SQL function of (case, model, sample, request hash);
//!    - a record of a later file identical to one of an earlier file ([`Keys::fp`], the
//!      k-th copy within a file matching the k-th of another) is dropped before samples are
//!      numbered (the same file twice, a copy of it);
//!    - a duplicate call id (two records of the same case, model and sample; not checked
//!      when every direct id was distinct in memory and nothing was staged) is refused
//!      (exit 2) when the records differ, and kept once when they are copies, before
//!      anything reaches `calls/`; a refusal leaves the run root no table;
//!    - two `expected` of one case are refused (or one wins: `--on-conflicting-expected`);
//!    - `cases`: each case's first record (lowest `seq`), in corpus order, with its
//!      `expected` (the first non-NULL, or the last); when each case's fields were staged
//!      once ([`distinct_cases::DistinctCases`]), the staged rows themselves.
//! 3. The calls parts are renamed (direct) or written (staged, without `seq`) into `calls/`,
//!    and `_import/` is deleted.

mod direct;
mod distinct_cases;
mod keys;
mod plan;
mod seen_ids;
mod staging;

use std::collections::BTreeSet;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, BooleanBuilder, Float64Builder, Int32Builder, Int64Builder,
    RecordBatch, StringArray, StringBuilder, TimestampMicrosecondBuilder, UInt64Builder,
    new_null_array,
};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Field, Int32Type, Schema, SchemaRef, TimeUnit};
use datafusion::logical_expr::{ColumnarValue, ScalarUDF, Volatility, create_udf};
use datafusion::prelude::SessionContext;
use futures::StreamExt;

use super::{Record, numbering};
use crate::query::{QueryError, id_slices, new_context};
use crate::schema::Table;
use crate::stages::call;
use crate::storage::{PartWriter, RunStore, StorageError};
use direct::*;
use distinct_cases::*;
use keys::*;
use seen_ids::*;
use staging::*;

/// Chunks pushed whose keys are still being computed before a push waits for the oldest:
/// enough that the pool, busy parsing a block of the source, gets to them before the
/// sink needs them.
const KEYED_AHEAD: usize = 4;

/// Rows per staging batch (and so the memory of the streaming phase).
pub const STAGE_ROWS: usize = 8192;

/// Errors of the import core.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error(transparent)]
    Query(#[from] QueryError),
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// Numbering the samples of records that name none.
    #[error(transparent)]
    Numbering(#[from] numbering::NumberingError),
    /// A record the sources reader could not read.
    #[error(transparent)]
    Source(#[from] super::ImportError),
    /// Two records of the same case, model and sample: the input is ambiguous.
    #[error(
        "{source_name}: two different records for case `{input}` model `{model}` sample {sample_idx} (records {first} and {second} of the \
         import): give distinct sample_idx"
    )]
    Duplicate {
        source_name: String,
        input: String,
        model: String,
        sample_idx: i32,
        first: u64,
        second: u64,
    },
    /// Two records of one case (the same test and request) with different `expected`.
    #[error(
        "{first_at} and {second_at}: one case (the same test and request, input `{input}`) with two expected answers, `{first}` and \
         `{second}`: pass --on-conflicting-expected first|last to say which wins"
    )]
    ConflictingExpected {
        first_at: String,
        second_at: String,
        input: String,
        first: String,
        second: String,
    },
    /// `--cluster FIELD` named a field no record has.
    #[error(
        "--cluster `{field}`: no record has this field (a pairs line's top-level or `metadata` field, a batch line's or its request's \
         `metadata`, a Parquet column, an Inspect sample's metadata, an lm-eval doc field, a promptfoo var)"
    )]
    NoCluster { field: String },
    /// A record gave its sample index after records numbered in memory
    /// ([`staging::SampleCounts`]): the import must start again without counting.
    #[error(
        "import: a record names its sample index after records numbered in memory; import again without counting"
    )]
    Renumber,
    /// A direct calls writer task panicked or was cancelled.
    #[error("import: a calls writer stopped: {0}")]
    Writer(String),
    /// The temporary file of the call ids held for the duplicate check ([`SeenIds`]).
    #[error("import: the call ids kept for the duplicate check (a temporary file): {0}")]
    IdsFile(#[source] std::io::Error),
}

impl ImportError {
    /// Whether the error is the user's input (exit 2).
    pub fn is_bad_input(&self) -> bool {
        match self {
            ImportError::Query(e) => e.is_bad_input(),
            ImportError::Storage(e) => e.is_bad_input(),
            ImportError::Source(_)
            | ImportError::Duplicate { .. }
            | ImportError::ConflictingExpected { .. }
            | ImportError::NoCluster { .. } => true,
            ImportError::Writer(_)
            | ImportError::Numbering(_)
            | ImportError::Renumber
            | ImportError::IdsFile(_) => false,
        }
    }
}

/// What every imported case shares unless its record says otherwise.
#[derive(Debug, Clone)]
pub struct CaseDefaults {
    /// `--test`: over the record's own test when given.
    pub test: Option<String>,
    pub capability: String,
    pub test_type: String,
    pub role: String,
}

/// Which of two `expected` answers of one case wins (`--on-conflicting-expected`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OnConflict {
    /// Refuse the import (exit 2) naming both records.
    #[default]
    Refuse,
    /// The first record's (in import order).
    First,
    /// The last record's.
    Last,
}

/// How the sink treats duplicates, conflicts and the cluster field.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    pub on_conflicting_expected: OnConflict,
    /// Keep records identical to one of an earlier file as more samples
    /// (`--keep-duplicates`) instead of dropping them.
    pub keep_duplicates: bool,
    /// `--cluster FIELD`: an import where no record has it is refused.
    pub cluster: Option<String>,
}

/// What an import wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportSummary {
    pub cases: u64,
    /// Cases whose record named a cluster (`--cluster`).
    pub clustered: u64,
    pub calls: u64,
    pub models: Vec<String>,
    /// Records dropped as exact copies of another (the same file twice, two copies of it).
    pub duplicates: u64,
    /// Imported scores versions: (`<tool>-<scorer>@imported`, folder, rows).
    pub scores: Vec<(String, String, u64)>,
}

/// What staging computes of a record before appending it. What the records of one case
/// or request share is counted, not copied: a record whose case or request is the one
/// before it takes its neighbour's.
struct Keys {
    test: Arc<str>,
    case_id: Arc<str>,
    /// The case id's hex digits as a number ([`case_num`]), for the sink's per-case tables.
    case_num: Option<u128>,
    request_hash: Arc<str>,
    response_hash: Option<String>,
    /// The call id of a direct record (see the module documentation), `None` for a staged
    /// one.
    call_id: Option<String>,
    /// A digest of everything the record says but where it came from: two records with
    /// the same are copies of one (the same file imported twice). `None` until needed
    /// ([`Keys::fp`]).
    fp: Option<String>,
}

/// Receives imported records in file order; see the module documentation.
pub struct ImportSink {
    store: RunStore,
    defaults: CaseDefaults,
    policy: Policy,
    /// The source files seen, in order (a record's `file_idx` is its position).
    files: Vec<String>,
    /// The `expected` of the last record pushed: a change within a case is staged too,
    /// for the conflict check.
    last_expected: Option<String>,
    /// Direct records of the batch being built, and their call ids.
    direct: Builders,
    direct_ids: StringBuilder,
    staged: Builders,
    cases: CaseBuilders,
    /// The case of the last record pushed.
    last_case: Option<Arc<str>>,
    sb: ScoreBuilders,
    writers: Vec<DirectWriter>,
    next_writer: usize,
    /// The ids scratch table's writers, one per [`ID_BUCKETS`] bucket.
    ids: Vec<PartWriter>,
    /// The direct records' ids while they fit in memory ([`SeenIds`]); `None` once they
    /// are written to the ids table.
    seen_ids: Option<SeenIds>,
    /// Rows written to the ids table: none when every direct id was distinct in memory
    /// (or distinct by how it was numbered), and the plans check no direct id.
    ids_rows: u64,
    staging: Option<PartWriter>,
    case_staging: Option<PartWriter>,
    score_staging: Option<PartWriter>,
    /// The last chunks pushed, oldest first, whose keys rayon computes while the chunks
    /// before them are staged: a push stages the oldest once [`KEYED_AHEAD`] wait,
    /// [`Self::finish`] stages them all.
    pending: std::collections::VecDeque<Keyed>,
    /// Records pushed (staged or pending).
    pushed: u64,
    /// Records staged, so the next one's `seq`.
    next_seq: u64,
    /// Rows of the staged case fields.
    case_rows: u64,
    direct_rows: u64,
    staged_rows: u64,
    missing_samples: u64,
    /// Staged records' narrow keys, by bucket ([`numbering`]).
    narrow: Option<numbering::NarrowWriter>,
    /// Whether every file's records came after the previous file's (files read one after
    /// another), so a copy of an earlier file's record is one of a lower `seq`.
    files_in_order: bool,
    /// Records of a later file dropped as copies while numbering.
    copies_dropped: u64,
    /// Sample indices counted in memory ([`SampleCounts`]), while records lack them.
    counts: Option<SampleCounts>,
    /// Records numbered by `counts` (direct calls).
    counted: u64,
    /// Records staged because their (case, model) was new once `counts` was full.
    overflowed: u64,
    /// The cases whose fields were staged lately ([`RecentCases`]).
    recent_cases: RecentCases,
    /// The cases staged, while each is staged once ([`DistinctCases`]); `None` once one
    /// repeats, and the plans find each case's first record.
    distinct_cases: Option<DistinctCases>,
    /// Each model named, numbered ([`Models`]).
    models: Models,
    /// The last record's file and its index in `files`: a file's records share its name.
    last_file: Option<(Arc<str>, u32)>,
    /// (tool, `<tool>-<scorer>`) of every imported score seen.
    tool_scorers: BTreeSet<(String, String)>,
}

const STAGING: &str = "_import/staging";
const CASE_STAGING: &str = "_import/cases";
const IDS: &str = "_import/ids";
const SCORE_STAGING: &str = "_import/scores";
/// Direct calls parts, renamed into `calls/` at the end.
const STAGED_CALLS: &str = "_import/calls";
/// Calls of staged records, with their `seq`.
const PLANNED_CALLS: &str = "_import/planned_calls";
/// Each case's first `seq` ([`firsts_schema`]).
const FIRSTS: &str = "_import/firsts";
/// Direct calls without their exact copies, when there were copies.
const DEDUP_CALLS: &str = "_import/dedup_calls";
/// Staged calls without their exact copies, when there were copies.
const DEDUP_PLANNED: &str = "_import/dedup_planned";

impl ImportSink {
    /// Starts an import into `store` (which must hold no run yet).
    pub async fn new(
        store: &RunStore,
        defaults: CaseDefaults,
        policy: Policy,
    ) -> Result<Self, ImportError> {
        // A crashed earlier attempt left staging behind: start clean.
        store.delete_dir("_import").await?;
        let scratch =
            |dir: &str, schema: SchemaRef| Some(store.part_writer(dir, schema, "stage").scratch());
        Ok(ImportSink {
            store: store.clone(),
            defaults,
            policy,
            files: Vec::new(),
            last_expected: None,
            direct: Builders::default(),
            direct_ids: StringBuilder::new(),
            staged: Builders::default(),
            cases: CaseBuilders::default(),
            last_case: None,
            sb: ScoreBuilders::default(),
            writers: (0..rayon::current_num_threads().max(1))
                .map(|k| DirectWriter::spawn(store, k))
                .collect(),
            next_writer: 0,
            ids: (0..ID_BUCKETS)
                .map(|b| {
                    store
                        .part_writer(IDS, ids_schema(), &format!("stage-b{b:x}"))
                        .scratch()
                        .with_part_rows(ID_BUCKET_PART_ROWS)
                })
                .collect(),
            seen_ids: Some(SeenIds::new(crate::query::resources().memory_limit)),
            ids_rows: 0,
            staging: scratch(STAGING, staging_schema()),
            case_staging: scratch(CASE_STAGING, case_staging_schema()),
            score_staging: scratch(SCORE_STAGING, scores_staging_schema()),
            pending: Default::default(),
            pushed: 0,
            next_seq: 0,
            case_rows: 0,
            direct_rows: 0,
            staged_rows: 0,
            missing_samples: 0,
            narrow: Some(numbering::NarrowWriter::new(store)),
            files_in_order: true,
            copies_dropped: 0,
            counts: None,
            counted: 0,
            overflowed: 0,
            recent_cases: RecentCases::default(),
            distinct_cases: DistinctCases::new(crate::query::resources().memory_limit),
            models: Models::default(),
            last_file: None,
            tool_scorers: BTreeSet::new(),
        })
    }

    /// Numbers the samples of records that name none as they arrive
    /// ([`SampleCounts`]): for an import whose records are numbered in the order they
    /// come (one file, or `--keep-duplicates`), before the first push.
    pub fn count_samples(&mut self) {
        if self.pushed == 0 {
            self.counts = Some(SampleCounts::new(crate::query::resources().memory_limit));
        }
    }

    /// Rows pushed so far.
    pub fn rows(&self) -> u64 {
        self.pushed
    }

    /// Adds records in their order. Their hashes (case id, request and response hash, call
    /// id: the costly part of staging) are computed on rayon's pool while the chunk pushed
    /// before them is staged, so the caller never waits for the pool: a caller that waited
    /// held back the parse feeding it, and both cores idled about a fifth of an import.
    pub async fn push_many(&mut self, records: Vec<Record>) -> Result<(), ImportError> {
        self.pushed += records.len() as u64;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let test = self.defaults.test.clone();
        let counting = self.counts.is_some();
        rayon::spawn(move || {
            let keys = chunk_keys(&test, &records, counting);
            let _ = tx.send((records, keys));
        });
        self.pending.push_back(rx);
        if self.pending.len() > KEYED_AHEAD {
            let oldest = self.pending.pop_front().expect("more than one pending");
            self.stage_pending(oldest).await?;
        }
        Ok(())
    }

    /// Stops the writer tasks without committing what they hold: the import failed and
    /// `_import/` is about to be deleted.
    pub async fn abort(self) {
        for w in self.writers {
            let _ = w.join().await;
        }
    }

    /// Runs the plans and commits `cases`, `calls` and the imported scores; see the
    /// module documentation.
    pub async fn finish(mut self) -> Result<ImportSummary, ImportError> {
        let t = std::time::Instant::now();
        let committed = self.commit_scratch().await;
        tracing::debug!(
            secs = t.elapsed().as_secs_f64(),
            "import: scratch committed"
        );
        let result = match committed {
            Ok(()) => self.plan().await,
            Err(e) => Err(e),
        };
        // Staging is scratch either way; a failed import leaves no table behind.
        let cleanup = self.store.delete_scratch("_import").await;
        if result.is_err() {
            self.store.delete_dir("cases").await?;
            self.store.delete_dir("calls").await?;
            self.store.delete_dir("scores").await?;
        }
        let summary = result?;
        cleanup?;
        Ok(summary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::import::Request;
    use datafusion::arrow::array::UInt64Array;

    /// A model is numbered once whether it comes as a shared `Arc` or as a copy of its
    /// text, past the pointers held too; the names come back sorted.
    #[test]
    fn models_are_numbered_by_name_not_by_pointer() {
        let mut m = Models::default();
        let names: Vec<Arc<str>> = (0..12)
            .map(|k| Arc::from(format!("m{k:02}").as_str()))
            .collect();
        for (k, n) in names.iter().enumerate() {
            assert_eq!(m.index(n), k as u32);
        }
        for (k, n) in names.iter().enumerate().rev() {
            assert_eq!(m.index(n), k as u32);
            assert_eq!(m.index(&Arc::from(n.to_string().as_str())), k as u32);
        }
        assert_eq!(m.index(&Arc::from("a")), 12);
        let want: Vec<String> = std::iter::once("a".to_string())
            .chain(names.iter().map(|n| n.to_string()))
            .collect();
        assert_eq!(m.names(), want);
    }

    /// The fingerprint written field by field is the `Debug` text's digest, byte for byte:
    /// empty, full, negative and extreme numbers, text with quotes, escapes, control
    /// characters, unicode (printable, combining, bidi, non-printable), imported scores.
    #[test]
    fn fingerprints_are_the_reference_fingerprints() {
        use crate::import::ImportedScore;
        let texts = [
            "",
            "stop",
            "plain text, with: punctuation! ~ {} [] <>",
            "say \"hi\"",
            "back\\slash",
            "line\nbreak\ttab\r",
            "nul \u{0} bell \u{7} del \u{7f}",
            "中文回答",
            "e\u{301} combining",
            "\u{301}starts combining",
            "bidi \u{202e} zero width \u{200b} bom \u{feff}",
            "emoji 😀 and é",
            "'single'",
        ];
        let mut records = vec![Record::default()];
        for (i, t) in texts.iter().enumerate() {
            let some = |k: usize| (!(i + k).is_multiple_of(3)).then(|| t.to_string());
            let num =
                |k: i64| ((i as i64 + k) % 4 != 0).then_some((k - 2) * 10i64.pow(i as u32 % 19));
            records.push(Record {
                request: Arc::new(Request {
                    model: format!("model-{t}").into(),
                    ..Request::default()
                }),
                sample_idx: (i % 2 == 0).then_some(i as i32 * 1000),
                finish_reason: some(0),
                prompt_tokens: num(1),
                completion_tokens: num(2),
                reasoning_tokens: num(3).map(|x| -x),
                reasoning_chars: Some(i64::MIN + i as i64),
                http_status: Some(if i % 2 == 0 { 200 } else { -1 }),
                error: some(1),
                attempts: (i % 3 == 0).then_some(i32::MAX),
                latency_ms: [
                    None,
                    Some(0.0),
                    Some(12.5),
                    Some(1e21),
                    Some(1e-7),
                    Some(-0.0),
                ]
                .get(i % 6)
                .copied()
                .flatten(),
                started_at_us: Some(1_700_000_000_000_000 + i as i64),
                expected: some(2),
                provider: some(0),
                scores: if i % 4 == 1 {
                    vec![ImportedScore {
                        scorer: t.to_string(),
                        score: Some(0.5),
                        label: some(1),
                        passed: Some(true),
                        detail: some(2),
                    }]
                } else {
                    vec![]
                },
                ..Record::default()
            });
        }
        for (i, r) in records.iter().enumerate() {
            for rh in [None, Some("0123456789abcdef01234567")] {
                assert_eq!(
                    fingerprint(r, "case", "req", rh),
                    fingerprint_reference(r, "case", "req", rh),
                    "record {i}"
                );
            }
        }
    }

    /// A chunk's keys, reused from the record before where its case or request is the same
    /// (one shared `Arc<Request>`, or equal requests in two), are the keys each record
    /// gives alone: case id, request hash (from the request key when the reader computed
    /// none), call id and case number.
    #[test]
    fn keys_reused_from_a_neighbour_are_a_records_own() {
        let asked = |input: &str, model: &str, key: &str| {
            Arc::new(Request {
                input: input.into(),
                model: model.into(),
                request_key: key.into(),
                ..Request::default()
            })
        };
        let shared = asked("q1", "m", "k1");
        let rec = |request: &Arc<Request>, k: i32| Record {
            request: request.clone(),
            sample_idx: Some(k),
            ..Record::default()
        };
        let records = vec![
            rec(&shared, 0),
            rec(&shared, 1),
            rec(&asked("q1", "m", "k1"), 2),
            rec(&asked("q1", "n", "k2"), 0),
            rec(&asked("q2", "n", "k2"), 0),
            rec(&shared, 3),
        ];
        let chunked = keys::chunk_keys(&None, &records, false);
        let chunked: Vec<&Keys> = chunked.iter().flatten().collect();
        assert_eq!(chunked.len(), records.len());
        let mut hashes = std::collections::BTreeSet::new();
        for (i, (r, k)) in records.iter().zip(chunked).enumerate() {
            let alone = keys(&None, r);
            assert_eq!(k.case_id, alone.case_id, "record {i}");
            assert_eq!(k.request_hash, alone.request_hash, "record {i}");
            assert_eq!(k.call_id, alone.call_id, "record {i}");
            assert_eq!(k.case_num, alone.case_num, "record {i}");
            hashes.insert(k.request_hash.to_string());
        }
        // Two request keys, two hashes: a neighbour's was not taken where the key differs.
        assert_eq!(hashes.len(), 2);
    }

    /// A case id a reader computed is used only for the test it was computed for: a record
    /// whose test resolves to another (`--test`, or its own) gets its case id computed again,
    /// as `sha256("imported\0" test "\0" system "\0" input "\0")` (hashlib by hand).
    #[test]
    fn a_precomputed_case_id_is_used_only_for_its_test() {
        let r = Record {
            request: Arc::new(Request {
                input: "hi".into(),
                model: "m".into(),
                case_id: Some(("t".into(), "precomputed".into())),
                ..Request::default()
            }),
            ..Record::default()
        };
        assert_eq!(&*keys(&Some("t".into()), &r).case_id, "precomputed");
        assert_eq!(&*keys(&None, &r).case_id, "99fa1e10904bacb7a835daf0");
        let own = Record {
            test: Some("own".into()),
            ..r.clone()
        };
        assert_eq!(&*keys(&None, &own).case_id, "e857fedff26837b6217f17f4");
        assert_eq!(
            crate::import::case_id("imported", None, None, "hi"),
            "99fa1e10904bacb7a835daf0"
        );
    }

    #[test]
    fn id_buckets_split_a_batch_by_first_hex_digit_keeping_every_row_in_order() {
        let ids = ["a1", "03", "ff", "a0", "0b", "5c", "a2"];
        let batch = RecordBatch::try_new(
            ids_schema(),
            vec![
                Arc::new(UInt64Array::from_iter_values(0..ids.len() as u64)),
                Arc::new(StringArray::from_iter_values(ids)),
                Arc::new(StringArray::from_iter_values(
                    ids.iter().map(|i| format!("fp{i}")),
                )),
            ],
        )
        .unwrap();
        let got: Vec<(usize, Vec<u64>, Vec<String>)> = id_buckets(&batch)
            .into_iter()
            .map(|(b, rows)| {
                let seq = rows
                    .column(0)
                    .as_primitive::<datafusion::arrow::datatypes::UInt64Type>();
                let id = rows.column(1).as_string::<i32>();
                (
                    b,
                    seq.values().to_vec(),
                    id.iter().map(|s| s.unwrap().to_string()).collect(),
                )
            })
            .collect();
        let want = vec![
            (0, vec![1, 4], vec!["03".to_string(), "0b".into()]),
            (5, vec![5], vec!["5c".into()]),
            (
                10,
                vec![0, 3, 6],
                vec!["a1".into(), "a0".into(), "a2".into()],
            ),
            (15, vec![2], vec!["ff".into()]),
        ];
        assert_eq!(got, want);
    }
}
