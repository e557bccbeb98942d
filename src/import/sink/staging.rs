//! Staging: the scratch tables a record is appended to (its calls-side columns, its case's
//! fields, its imported scores, its ids) and the numbering of staged records.

use super::*;
use crate::import::fast_hash::FastHash;

/// The calls-side columns of a record, known at parse time, and its order (`seq`): the
/// staging table's schema, and the batch a direct record's `calls` row is cut from.
pub(super) fn staging_schema() -> SchemaRef {
    let s = |n: &str, null: bool| Field::new(n, DataType::Utf8, null);
    let i64f = |n: &str| Field::new(n, DataType::Int64, true);
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::UInt64, false),
        s("case_id", false),
        s("model", false),
        s("provider", true),
        Field::new("given_sample_idx", DataType::Int32, true),
        s("request_hash", false),
        s("response", true),
        s("response_hash", true),
        s("finish_reason", true),
        i64f("prompt_tokens"),
        i64f("completion_tokens"),
        i64f("reasoning_tokens"),
        i64f("reasoning_chars"),
        Field::new("http_status", DataType::Int32, true),
        s("error", true),
        Field::new("attempts", DataType::Int32, true),
        Field::new("latency_ms", DataType::Float64, true),
        Field::new("max_tokens", DataType::Int32, true),
        Field::new("temperature", DataType::Float64, true),
        Field::new(
            "started_at",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            true,
        ),
        s("source_format", false),
        s("source_file", false),
        s("source_id", true),
        s("fp", false),
        Field::new("file_idx", DataType::UInt32, false),
    ]))
}

/// The staged case fields: one row for each record whose case differs from the record
/// before it.
pub(super) fn case_staging_schema() -> SchemaRef {
    let s = |n: &str, null: bool| Field::new(n, DataType::Utf8, null);
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::UInt64, false),
        s("case_id", false),
        s("test", false),
        s("capability", false),
        s("cluster", true),
        s("input", false),
        s("expected", true),
        s("source_file", false),
        s("source_id", true),
    ]))
}

/// The (`seq`, `call_id`) of each direct record, for the duplicate check.
pub(super) fn ids_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::UInt64, false),
        Field::new("call_id", DataType::Utf8, false),
        Field::new("fp", DataType::Utf8, false),
    ]))
}

/// The staged imported scores: one row per (record, tool scorer).
pub(super) fn scores_staging_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::UInt64, false),
        Field::new("scorer", DataType::Utf8, false),
        Field::new("score", DataType::Float64, true),
        Field::new("label", DataType::Utf8, true),
        Field::new("passed", DataType::Boolean, true),
        Field::new("detail", DataType::Utf8, true),
    ]))
}

/// Buffers one batch of calls-side columns ([`staging_schema`]).
#[derive(Default)]
pub(super) struct Builders {
    pub(super) seq: UInt64Builder,
    pub(super) case_id: StringBuilder,
    pub(super) model: StringBuilder,
    pub(super) provider: StringBuilder,
    pub(super) sample_idx: Int32Builder,
    pub(super) request_hash: StringBuilder,
    pub(super) response: StringBuilder,
    pub(super) response_hash: StringBuilder,
    pub(super) finish_reason: StringBuilder,
    pub(super) prompt_tokens: Int64Builder,
    pub(super) completion_tokens: Int64Builder,
    pub(super) reasoning_tokens: Int64Builder,
    pub(super) reasoning_chars: Int64Builder,
    pub(super) http_status: Int32Builder,
    pub(super) error: StringBuilder,
    pub(super) attempts: Int32Builder,
    pub(super) latency_ms: Float64Builder,
    pub(super) max_tokens: Int32Builder,
    pub(super) temperature: Float64Builder,
    pub(super) started_at: TimestampMicrosecondBuilder,
    pub(super) source_format: StringBuilder,
    pub(super) source_file: StringBuilder,
    pub(super) source_id: StringBuilder,
    pub(super) fp: StringBuilder,
    pub(super) file_idx: datafusion::arrow::array::UInt32Builder,
    pub(super) rows: usize,
}

impl Builders {
    /// Builders sized for `rows` rows and `response_bytes` of answers, so a batch fills
    /// without regrowing (each regrowth copies the column and touches fresh pages).
    pub(super) fn with_capacity(rows: usize, response_bytes: usize) -> Self {
        let text = || StringBuilder::with_capacity(rows, rows * 32);
        Builders {
            seq: UInt64Builder::with_capacity(rows),
            case_id: text(),
            model: text(),
            provider: text(),
            sample_idx: Int32Builder::with_capacity(rows),
            request_hash: text(),
            response: StringBuilder::with_capacity(rows, response_bytes),
            response_hash: text(),
            finish_reason: text(),
            prompt_tokens: Int64Builder::with_capacity(rows),
            completion_tokens: Int64Builder::with_capacity(rows),
            reasoning_tokens: Int64Builder::with_capacity(rows),
            reasoning_chars: Int64Builder::with_capacity(rows),
            http_status: Int32Builder::with_capacity(rows),
            error: text(),
            attempts: Int32Builder::with_capacity(rows),
            latency_ms: Float64Builder::with_capacity(rows),
            max_tokens: Int32Builder::with_capacity(rows),
            temperature: Float64Builder::with_capacity(rows),
            started_at: TimestampMicrosecondBuilder::with_capacity(rows),
            source_format: text(),
            source_file: text(),
            source_id: text(),
            fp: text(),
            file_idx: datafusion::arrow::array::UInt32Builder::with_capacity(rows),
            rows: 0,
        }
    }

    /// Appends `r` as sample `sample` (its own `sample_idx`, or the one counted for it).
    pub(super) fn append(
        &mut self,
        seq: u64,
        r: &Record,
        k: &Keys,
        fp: &str,
        file_idx: u32,
        sample: Option<i32>,
    ) {
        self.seq.append_value(seq);
        self.case_id.append_value(&k.case_id);
        self.model.append_value(&r.request.model);
        self.provider.append_option(r.provider.as_deref());
        self.sample_idx.append_option(sample);
        self.request_hash.append_value(&k.request_hash);
        self.response_hash.append_option(k.response_hash.as_deref());
        self.response.append_option(r.response.as_deref());
        self.finish_reason.append_option(r.finish_reason.as_deref());
        self.prompt_tokens.append_option(r.prompt_tokens);
        self.completion_tokens.append_option(r.completion_tokens);
        self.reasoning_tokens.append_option(r.reasoning_tokens);
        self.reasoning_chars.append_option(r.reasoning_chars);
        self.http_status.append_option(r.http_status);
        self.error.append_option(r.error.as_deref());
        self.attempts.append_option(r.attempts);
        self.latency_ms.append_option(r.latency_ms);
        self.max_tokens.append_option(
            r.request
                .max_tokens
                .map(|m| i32::try_from(m).unwrap_or(i32::MAX)),
        );
        self.temperature.append_option(r.request.temperature);
        self.started_at.append_option(r.started_at_us);
        self.source_format.append_value(r.source.format);
        self.source_file.append_value(&r.source.file);
        self.source_id.append_option(r.source.id.as_deref());
        self.fp.append_value(fp);
        self.file_idx.append_value(file_idx);
        self.rows += 1;
    }

    pub(super) fn finish(&mut self) -> RecordBatch {
        let cols: Vec<ArrayRef> = vec![
            Arc::new(self.seq.finish()),
            Arc::new(self.case_id.finish()),
            Arc::new(self.model.finish()),
            Arc::new(self.provider.finish()),
            Arc::new(self.sample_idx.finish()),
            Arc::new(self.request_hash.finish()),
            Arc::new(self.response.finish()),
            Arc::new(self.response_hash.finish()),
            Arc::new(self.finish_reason.finish()),
            Arc::new(self.prompt_tokens.finish()),
            Arc::new(self.completion_tokens.finish()),
            Arc::new(self.reasoning_tokens.finish()),
            Arc::new(self.reasoning_chars.finish()),
            Arc::new(self.http_status.finish()),
            Arc::new(self.error.finish()),
            Arc::new(self.attempts.finish()),
            Arc::new(self.latency_ms.finish()),
            Arc::new(self.max_tokens.finish()),
            Arc::new(self.temperature.finish()),
            Arc::new(self.started_at.finish().with_timezone("UTC")),
            Arc::new(self.source_format.finish()),
            Arc::new(self.source_file.finish()),
            Arc::new(self.source_id.finish()),
            Arc::new(self.fp.finish()),
            Arc::new(self.file_idx.finish()),
        ];
        // The next batch is sized like this one (with room to spare for its answers).
        let response_bytes = cols[6].as_string::<i32>().value_data().len();
        *self = Builders::with_capacity(STAGE_ROWS, response_bytes + response_bytes / 4);
        RecordBatch::try_new(staging_schema(), cols).expect("staging batch matches its schema")
    }
}

/// Buffers staged case fields ([`case_staging_schema`]).
#[derive(Default)]
pub(super) struct CaseBuilders {
    pub(super) seq: UInt64Builder,
    pub(super) case_id: StringBuilder,
    pub(super) test: StringBuilder,
    pub(super) capability: StringBuilder,
    pub(super) cluster: StringBuilder,
    pub(super) input: StringBuilder,
    pub(super) expected: StringBuilder,
    pub(super) source_file: StringBuilder,
    pub(super) source_id: StringBuilder,
    pub(super) rows: usize,
}

impl CaseBuilders {
    pub(super) fn finish(&mut self) -> RecordBatch {
        let cols: Vec<ArrayRef> = vec![
            Arc::new(self.seq.finish()),
            Arc::new(self.case_id.finish()),
            Arc::new(self.test.finish()),
            Arc::new(self.capability.finish()),
            Arc::new(self.cluster.finish()),
            Arc::new(self.input.finish()),
            Arc::new(self.expected.finish()),
            Arc::new(self.source_file.finish()),
            Arc::new(self.source_id.finish()),
        ];
        self.rows = 0;
        RecordBatch::try_new(case_staging_schema(), cols).expect("case batch matches its schema")
    }
}

/// Buffers staged imported scores.
#[derive(Default)]
pub(super) struct ScoreBuilders {
    pub(super) seq: UInt64Builder,
    pub(super) scorer: StringBuilder,
    pub(super) score: Float64Builder,
    pub(super) label: StringBuilder,
    pub(super) passed: BooleanBuilder,
    pub(super) detail: StringBuilder,
    pub(super) rows: usize,
}

impl ScoreBuilders {
    pub(super) fn finish(&mut self) -> RecordBatch {
        let cols: Vec<ArrayRef> = vec![
            Arc::new(self.seq.finish()),
            Arc::new(self.scorer.finish()),
            Arc::new(self.score.finish()),
            Arc::new(self.label.finish()),
            Arc::new(self.passed.finish()),
            Arc::new(self.detail.finish()),
        ];
        self.rows = 0;
        RecordBatch::try_new(scores_staging_schema(), cols).expect("scores staging batch")
    }
}

/// What [`SampleCounts`] says of a record without its sample index.
pub(super) enum Count {
    /// Its index, counted: a direct call.
    Sample(i32),
    /// Its (case, model) is not held and the counts are full: staged, as every later record
    /// of the pair will be, while the pairs held are still counted.
    Full,
    /// Not counted, and counting has stopped.
    Off,
}

/// Sample indices counted in memory for records that name none, while every record so far
/// lacks one: a record's index is the number of earlier records of its (case, model), as
/// the plans would number it ([`numbering`] over the whole corpus), so it is a direct call
/// as it arrives and its answer is never staged and read back.
///
/// Bounded: at most `cap` (case, model) pairs, each 16 bytes of key and a count. Past it, a
/// record of a pair not held is staged ([`Count::Full`]), and so is every later record of
/// that pair (it never enters the full table), while the pairs held go on being counted:
/// a pair's records are then all counted or all staged, and the staged ones are numbered
/// from 0 among themselves, bucket by bucket ([`ImportSink::numbers_staged`]). Once a
/// record is staged for another reason (imported scores), counting stops, and the later
/// records are staged and numbered by the plans after the counted ones (the highest index
/// given, plus one), which is the same number. A record that gives its own index after
/// counted ones makes the counted numbers wrong: the sink refuses it with
/// [`ImportError::Renumber`] and the import starts again without counting.
///
/// (Counting used to stop at the bound: the plans then numbered the rest after a join with
/// every counted pair's highest index, whose hash table outgrew a 1 GiB limit on a 10M-record
/// log of 1-3 samples per pair, 5M pairs, and the import failed.)
pub(super) struct SampleCounts {
    counts: std::collections::HashMap<Pair, u32, FastHash>,
    cap: usize,
}

impl SampleCounts {
    /// Counts within a quarter of the memory limit ([`pairs_within`]).
    ///
    /// `EVALFLOW_IMPORT_COUNT_PAIRS` sets another bound (tests use a small one).
    pub(super) fn new(memory_limit: usize) -> Self {
        let cap = crate::config::env_number("EVALFLOW_IMPORT_COUNT_PAIRS")
            .map_or_else(|| pairs_within(memory_limit / 4), |n| n as usize);
        SampleCounts {
            counts: Default::default(),
            cap,
        }
    }
}

/// The pairs a count table holds within `bytes`, growth included: a slot is a 20-byte entry
/// ([`Pair`] and its count) and a control byte; the table has a power of two of slots, fills
/// 7/8 of them, and doubles when full, the old table alive while it moves. At 1 GiB, 7.3M
/// pairs (a `u128` key's 16-byte alignment made an entry 32 bytes: 3.3M pairs, fewer than a
/// 10M-record log of 1-3 samples per pair has).
fn pairs_within(bytes: usize) -> usize {
    const SLOT: usize = std::mem::size_of::<(Pair, u32)>() + 1;
    // The peak: a full table of `slots` beside the half-size one it grew from.
    let most_slots = (bytes * 2 / (3 * SLOT)).max(1);
    let slots = 1usize << most_slots.ilog2();
    (slots / 8 * 7).max(1024)
}

/// A (case, model) pair as the counts key it: the case id's 96 bits and the model's number,
/// as four `u32`s (4-byte aligned, so an entry with its count is 20 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pair([u32; 4]);

impl Pair {
    /// `None` for a case number past 96 bits (not one of [`super::keys::case_num`]'s).
    fn new(case_num: u128, model: u32) -> Option<Pair> {
        (case_num >> 96 == 0).then(|| {
            let k = (case_num << 32) | u128::from(model);
            Pair([
                k as u32,
                (k >> 32) as u32,
                (k >> 64) as u32,
                (k >> 96) as u32,
            ])
        })
    }
}

impl std::hash::Hash for Pair {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let [a, b, c, d] = self.0.map(u128::from);
        state.write_u128(a | (b << 32) | (c << 64) | (d << 96));
    }
}

/// The models an import names, each numbered in the order first seen: a record's model is
/// found with one hash of its name (a sorted set compared the name some three times a record,
/// and the sample counts hashed it once more).
///
/// A reader that shares one `Arc` per model among its records (the JSONL pairs reader)
/// lets the lookup end at a pointer compare, without reading the name.
#[derive(Default)]
pub(super) struct Models {
    numbers: std::collections::HashMap<Arc<str>, u32, FastHash>,
    /// The first [`MODELS_BY_POINTER`] `Arc`s looked up, and their numbers; held, so no
    /// other text can take their address.
    by_pointer: Vec<(Arc<str>, u32)>,
}

/// Model `Arc`s a [`Models`] knows by their pointer.
const MODELS_BY_POINTER: usize = 8;

impl Models {
    /// The number of `model`, numbering it if it is new.
    pub(super) fn index(&mut self, model: &Arc<str>) -> u32 {
        if let Some(&(_, i)) = self.by_pointer.iter().find(|(m, _)| Arc::ptr_eq(m, model)) {
            return i;
        }
        let i = match self.numbers.get(&**model) {
            Some(&i) => i,
            None => {
                let i = self.numbers.len() as u32;
                self.numbers.insert(model.clone(), i);
                i
            }
        };
        if self.by_pointer.len() < MODELS_BY_POINTER {
            self.by_pointer.push((model.clone(), i));
        }
        i
    }

    /// The models' names, sorted.
    pub(super) fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.numbers.keys().map(|m| m.to_string()).collect();
        names.sort();
        names
    }
}

/// Cases staged lately: at most this many, the oldest forgotten first.
pub(super) const RECENT_CASES: usize = 8192;

/// The last [`RECENT_CASES`] cases whose fields were staged, each with the `expected` and
/// cluster of its last staged row: a record of one of them that says the same is not
/// staged again. Bounded, so memory does not grow with the corpus; a case forgotten is
/// only staged once more.
#[derive(Default)]
pub(super) struct RecentCases {
    /// By the case id as a number ([`Keys::case_num`]); a case id that is not a digest is
    /// never remembered.
    pub(super) fields: std::collections::HashMap<u128, (Option<String>, Option<String>), FastHash>,
    pub(super) order: std::collections::VecDeque<u128>,
}

impl RecentCases {
    pub(super) fn seen(
        &self,
        case_num: Option<u128>,
        expected: Option<&str>,
        cluster: Option<&str>,
    ) -> bool {
        case_num
            .and_then(|n| self.fields.get(&n))
            .is_some_and(|(e, c)| e.as_deref() == expected && c.as_deref() == cluster)
    }

    pub(super) fn remember(
        &mut self,
        case_num: Option<u128>,
        expected: Option<&str>,
        cluster: Option<&str>,
    ) {
        let Some(case_num) = case_num else {
            return;
        };
        let fields = (expected.map(str::to_string), cluster.map(str::to_string));
        if self.fields.insert(case_num, fields).is_none() {
            self.order.push_back(case_num);
            if self.order.len() > RECENT_CASES
                && let Some(old) = self.order.pop_front()
            {
                self.fields.remove(&old);
            }
        }
    }
}

impl ImportSink {
    /// Stages a chunk once rayon has its keys.
    pub(super) async fn stage_pending(&mut self, chunk: Keyed) -> Result<(), ImportError> {
        let (records, keys) = chunk.await.map_err(|_| {
            ImportError::Writer("the job hashing a chunk of records stopped".into())
        })?;
        for (r, k) in records.iter().zip(keys.iter().flatten()) {
            self.stage(r, k).await?;
        }
        // Freed on the pool: a chunk's thousands of strings are a twentieth of this serial
        // task's time.
        rayon::spawn(move || drop((records, keys)));
        Ok(())
    }

    /// Appends one record, with its keys, to the direct or staged batch (and its case's
    /// fields when its case is not the last record's); commits full batches.
    pub(super) async fn stage(&mut self, r: &Record, k: &Keys) -> Result<(), ImportError> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let model = self.models.index(&r.request.model);
        let file_idx = match &self.last_file {
            Some((f, i)) if Arc::ptr_eq(f, &r.source.file) => *i,
            _ => {
                let i = match self.files.iter().rposition(|f| **f == *r.source.file) {
                    Some(i) => i as u32,
                    None => {
                        self.files.push(r.source.file.to_string());
                        (self.files.len() - 1) as u32
                    }
                };
                self.last_file = Some((r.source.file.clone(), i));
                i
            }
        };
        if (file_idx as usize) + 1 < self.files.len() {
            self.files_in_order = false;
        }
        let new_case = self.last_case.as_deref() != Some(&*k.case_id);
        // A case staged lately with the same `expected` and cluster adds nothing the
        // plans read (each case's first record, its expected answers, whether it names a
        // cluster): a log whose records of one case are spread over the file (shuffled
        // runs) would otherwise stage a case row, its input text included, per record.
        let seen = new_case
            && self
                .recent_cases
                .seen(k.case_num, r.expected.as_deref(), r.cluster.as_deref());
        if seen {
            self.last_expected.clone_from(&r.expected);
            self.last_case = Some(k.case_id.clone());
        } else if new_case || r.expected != self.last_expected {
            self.last_expected.clone_from(&r.expected);
            self.recent_cases
                .remember(k.case_num, r.expected.as_deref(), r.cluster.as_deref());
            let c = &mut self.cases;
            c.seq.append_value(seq);
            c.case_id.append_value(&k.case_id);
            c.test.append_value(&k.test);
            c.capability
                .append_value(r.capability.as_deref().unwrap_or(&self.defaults.capability));
            c.cluster.append_option(r.cluster.as_deref());
            c.input.append_value(&r.request.input);
            c.expected.append_option(r.expected.as_deref());
            c.source_file.append_value(&r.source.file);
            c.source_id.append_option(r.source.id.as_deref());
            c.rows += 1;
            self.case_rows += 1;
            if let Some(d) = self.distinct_cases.as_mut()
                && !d.add(k.case_num, r.cluster.is_some())
            {
                self.distinct_cases = None;
            }
            self.last_case = Some(k.case_id.clone());
            if c.rows >= STAGE_ROWS {
                let batch = c.finish();
                if let Some(w) = self.case_staging.as_mut() {
                    w.write(batch).await?;
                }
            }
        }
        // A record without its sample index, numbered in memory while the corpus allows
        // ([`SampleCounts`]): a direct call at once, no staging of its answer.
        let mut overflow = false;
        if k.call_id.is_none() && r.sample_idx.is_none() && r.scores.is_empty() {
            match self.count_sample(k.case_num, model) {
                Count::Sample(sample) => {
                    // A counted call's fingerprint is never read (its id needs no check),
                    // and its id is computed by the writer task ([`counted_call_ids`]), off
                    // this serial task.
                    let fp = k.fp.as_deref().unwrap_or("");
                    self.direct.append(seq, r, k, fp, file_idx, Some(sample));
                    self.direct_ids.append_null();
                    self.direct_rows += 1;
                    self.counted += 1;
                    if self.direct.rows >= STAGE_ROWS {
                        self.send_direct().await?;
                    }
                    return Ok(());
                }
                Count::Full => {
                    overflow = true;
                    self.overflowed += 1;
                }
                Count::Off => {}
            }
        }
        if r.sample_idx.is_some() {
            // A given index after counted ones: the counted numbers are not what the
            // plans would give (they count after the highest given index).
            if self.counted > 0 {
                return Err(ImportError::Renumber);
            }
            self.counts = None;
        }
        if k.call_id.is_none() && !overflow {
            // Staged records are numbered after every counted one: count no more.
            self.counts = None;
        }
        if let Some(id) = &k.call_id {
            self.direct
                .append(seq, r, k, &k.fp(r), file_idx, r.sample_idx);
            self.direct_ids.append_value(id);
            self.direct_rows += 1;
            if self.direct.rows >= STAGE_ROWS {
                self.send_direct().await?;
            }
            return Ok(());
        }
        let failed = r.error.is_some() || r.http_status.is_some_and(|s| !(200..300).contains(&s));
        let tool = crate::import::tool_of(r.source.format).to_string();
        for sc in &r.scores {
            let name = format!("{tool}-{}", sc.scorer);
            if !self.tool_scorers.contains(&(tool.clone(), name.clone())) {
                self.tool_scorers.insert((tool.clone(), name.clone()));
            }
            let sb = &mut self.sb;
            sb.seq.append_value(seq);
            sb.scorer.append_value(&name);
            // DESIGN: score is NULL whenever the call is not a valid answer.
            sb.score.append_option(if failed { None } else { sc.score });
            sb.label.append_option(sc.label.as_deref());
            sb.passed
                .append_option(if failed { None } else { sc.passed });
            sb.detail.append_option(sc.detail.as_deref());
            sb.rows += 1;
        }
        self.staged
            .append(seq, r, k, &k.fp(r), file_idx, r.sample_idx);
        self.staged_rows += 1;
        if r.sample_idx.is_none() {
            self.missing_samples += 1;
        }
        if self.staged.rows >= STAGE_ROWS {
            let batch = self.staged.finish();
            self.write_staged(batch).await?;
        }
        if self.sb.rows >= STAGE_ROWS {
            let batch = self.sb.finish();
            if let Some(w) = self.score_staging.as_mut() {
                w.write(batch).await?;
            }
        }
        Ok(())
    }

    /// The next sample index of (`case_id`, `model`) while counting ([`SampleCounts`]):
    /// [`Count::Full`] for a pair not held once the counts are full, and [`Count::Off`]
    /// (counting stops) for a case id that is not a digest, an index past `i32`, or when
    /// counting stopped.
    fn count_sample(&mut self, case_num: Option<u128>, model: u32) -> Count {
        let Some(c) = self.counts.as_mut() else {
            return Count::Off;
        };
        let full = c.counts.len() >= c.cap;
        let sample = match case_num.and_then(|h| Pair::new(h, model)) {
            Some(key) => match c.counts.get_mut(&key) {
                Some(n) => {
                    *n += 1;
                    Some(*n - 1)
                }
                None if !full => {
                    c.counts.insert(key, 1);
                    Some(0)
                }
                None => return Count::Full,
            },
            None => None,
        };
        match sample.and_then(|s| i32::try_from(s).ok()) {
            Some(s) => Count::Sample(s),
            None => {
                self.counts = None;
                Count::Off
            }
        }
    }

    /// Appends a staged batch to the staging table and its keys to the numbering buckets.
    pub(super) async fn write_staged(&mut self, batch: RecordBatch) -> Result<(), ImportError> {
        if let Some(n) = self.narrow.as_mut() {
            n.write(&batch).await?;
        }
        if let Some(w) = self.staging.as_mut() {
            w.write(batch).await?;
        }
        Ok(())
    }

    /// Whether the staged records are numbered by [`numbering`] and become direct calls:
    /// every record lacks its sample index (none is given to count after) and has no
    /// imported score to join, and, when copies of an earlier file are to be dropped, the
    /// files came one after another; and no direct call shares a (case, model) with them:
    /// there is none, or every staged record's pair was new once the counts were full
    /// ([`Count::Full`]), so each is numbered from 0 among the staged.
    pub(super) fn numbers_staged(&self) -> bool {
        self.staged_rows > 0
            && (self.direct_rows == 0 || self.staged_past_counts())
            && self.tool_scorers.is_empty()
            && self.missing_samples == self.staged_rows
            && (self.files.len() <= 1 || self.policy.keep_duplicates || self.files_in_order)
    }

    /// Whether every staged record was staged because its (case, model) was new once the
    /// counts were full: no direct call shares a pair with a staged one.
    pub(super) fn staged_past_counts(&self) -> bool {
        self.overflowed > 0 && self.overflowed == self.staged_rows
    }

    /// Numbers the staged records ([`numbering`]) and sends them, in corpus order, to the
    /// direct writers with their call ids; see [`Self::numbers_staged`].
    pub(super) async fn number_staged(&mut self) -> Result<(), ImportError> {
        use rayon::prelude::*;
        let drop_copies = self.files.len() > 1 && !self.policy.keep_duplicates;
        let t = std::time::Instant::now();
        self.copies_dropped = numbering::number_buckets(&self.store, drop_copies).await?;
        tracing::debug!(secs = t.elapsed().as_secs_f64(), "import: samples numbered");
        let mut merge = numbering::SampleMerge::open(&self.store).await?;
        let mut parts = self.store.list_parts(STAGING).await?;
        parts.sort_by(|x, y| x.location.cmp(&y.location));
        let mut sent = 0u64;
        for part in parts {
            let mut s = self.store.read_scratch(&part).await?;
            while let Some(b) = s.next().await {
                let b = b?;
                let seqs = b
                    .column(0)
                    .as_primitive::<datafusion::arrow::datatypes::UInt64Type>();
                let samples = merge.take(seqs.values()).await?;
                let arrow_err = |e: datafusion::arrow::error::ArrowError| {
                    ImportError::Writer(format!("numbering samples: {e}"))
                };
                let mut cols = b.columns().to_vec();
                cols[4] = Arc::new(samples.clone());
                let b = RecordBatch::try_new(b.schema(), cols).map_err(arrow_err)?;
                // A copy of an earlier file's record has no number: it is not a call.
                let b = if samples.null_count() > 0 {
                    let kept =
                        datafusion::arrow::compute::is_not_null(&samples).map_err(arrow_err)?;
                    datafusion::arrow::compute::filter_record_batch(&b, &kept).map_err(arrow_err)?
                } else {
                    b
                };
                let (case, model, sample, req) = (
                    b.column(1).as_string::<i32>(),
                    b.column(2).as_string::<i32>(),
                    b.column(4).as_primitive::<Int32Type>(),
                    b.column(5).as_string::<i32>(),
                );
                let ids: Vec<String> = (0..b.num_rows())
                    .into_par_iter()
                    .map(|i| {
                        call::call_id(case.value(i), model.value(i), sample.value(i), req.value(i))
                    })
                    .collect();
                let ids: ArrayRef = Arc::new(StringArray::from(ids));
                sent += b.num_rows() as u64;
                self.send_calls(b, ids, true).await?;
            }
        }
        debug_assert_eq!(sent + self.copies_dropped, self.staged_rows);
        // They are direct calls now (beside any counted ones): the plans see no staged
        // record.
        self.direct_rows += sent;
        self.staged_rows = 0;
        self.missing_samples = 0;
        self.store.delete_scratch(numbering::NARROW).await?;
        self.store.delete_scratch(numbering::NUMBERED).await?;
        tracing::debug!(
            secs = t.elapsed().as_secs_f64(),
            calls = sent,
            "import: staged records numbered"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_twenty_bytes_and_a_full_table_fits_its_budget() {
        assert_eq!(std::mem::size_of::<(Pair, u32)>(), 20);
        assert_eq!(pairs_within(256 << 20), 7_340_032);
        // 4 MiB: 131,072 slots of 21 bytes (2.75 MB), and the 65,536 it grew from beside
        // them while moving: 4.1 MB.
        let cap = pairs_within(4 << 20);
        assert_eq!(cap, 114_688);
        let mut t: std::collections::HashMap<Pair, u32, FastHash> = Default::default();
        for i in 0..cap as u128 {
            t.insert(Pair::new(i * 0x1_0000_0001, (i % 7) as u32).unwrap(), 1);
        }
        assert_eq!(t.len(), cap, "distinct pairs stay distinct");
        assert_eq!(
            t.capacity(),
            cap,
            "the table did not grow past the slots counted"
        );
    }

    #[test]
    fn a_pair_keeps_all_96_bits_of_the_case_and_the_model() {
        let case = u128::from_str_radix("ffffffffffffffffffffffff", 16).unwrap();
        let a = Pair::new(case, 3).unwrap();
        assert_ne!(a, Pair::new(case - 1, 3).unwrap());
        assert_ne!(a, Pair::new(case, 4).unwrap());
        assert_ne!(Pair::new(1 << 95, 0), Pair::new(0, 0));
        assert_eq!(a.0, [3, 0xffff_ffff, 0xffff_ffff, 0xffff_ffff]);
        assert!(Pair::new(1 << 96, 0).is_none(), "past 96 bits");
    }
}
