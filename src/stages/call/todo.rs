//! The requests still to send: every case unnested into its K samples, anti-joined with
//! the calls committed under `calls/`, streamed in passes over call-id ranges so the
//! committed ids held at once stay within the memory limit.

use std::sync::Arc;

use datafusion::arrow::array::{Array, StringArray};
use datafusion::physical_plan::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::{StreamExt, TryStreamExt};

use super::{CallError, call_id, prompt_of, request_hash};
use crate::config::ModelConfig;
use crate::storage::RunStore;

/// What one committed id costs in an anti join's build side (the id's 64 hex digits, its
/// offset, its hash-table slot, slack for the table's growth), measured to within 2x.
const BYTES_PER_COMMITTED_ID: u64 = 128;

/// The share of `--memory-limit` one pass's committed ids may take: the rest is for the
/// scan of the cases, the join's output and the call stage's other queries.
const SHARE_OF_LIMIT: u64 = 8;

/// How many call-id ranges to pass over so that one pass holds at most its share of
/// `memory_limit` in committed ids: 1 on a fresh run (nothing committed), else a power of
/// two (so a later session's ranges nest in an earlier one's), at most 256.
pub(super) fn passes_for(committed: u64, memory_limit: usize) -> usize {
    let budget = (memory_limit as u64 / SHARE_OF_LIMIT / BYTES_PER_COMMITTED_ID).max(1);
    let needed = committed.div_ceil(budget).max(1);
    (needed.next_power_of_two()).min(256) as usize
}

/// `todo_call_id(case_id, input, k)`: the call id of a case's k-th sample under `model`,
/// the same [`call_id`] of the same [`request_hash`] the request will carry.
fn todo_call_id_udf(model: &ModelConfig) -> datafusion::logical_expr::ScalarUDF {
    use datafusion::arrow::array::AsArray;
    use datafusion::arrow::datatypes::{DataType, Int32Type};
    use datafusion::logical_expr::{ColumnarValue, Volatility, create_udf};
    let model = model.clone();
    create_udf(
        "todo_call_id",
        vec![DataType::Utf8, DataType::Utf8, DataType::Int32],
        DataType::Utf8,
        Volatility::Immutable,
        Arc::new(move |args: &[ColumnarValue]| {
            let args = ColumnarValue::values_to_arrays(args)?;
            let (ids, inputs) = (args[0].as_string::<i32>(), args[1].as_string::<i32>());
            let ks = args[2].as_primitive::<Int32Type>();
            let out: StringArray = (0..ids.len())
                .map(|i| {
                    let prompt = prompt_of(&model, inputs.value(i));
                    let rh = request_hash(&model, model.system_prompt.as_deref(), &prompt);
                    Some(call_id(ids.value(i), &model.name, ks.value(i), &rh))
                })
                .collect();
            Ok(ColumnarValue::Array(Arc::new(out)))
        }),
    )
}

/// The requests still to send, as a stream: a plan expands every case to its K samples
/// and anti-joins their call ids with those committed under `calls/`. The join's hash
/// table holds the committed ids; the cases stream past it, so a 10M-case suite costs
/// memory for what is in flight, not the suite. A resumed run with more committed ids than
/// an eighth of `--memory-limit` holds ([`passes_for`]) runs the plan once per call-id
/// range ([`crate::query::id_slices`]), each pass holding only its range's ids and
/// sending only its range's requests; a fresh run makes one pass and builds no table.
///
/// Each pass runs in one partition, so requests come in range order, then case order,
/// then sample order, the same in every session with the same ranges: a restarted session
/// sends the calls its predecessor lost in flight early, and a second kill never adds to
/// them.
///
/// With `retry_errors`, only answered rows count as committed: the error rows' calls are
/// sent again, each with `prior_attempts`, the attempts its error row spent (the retry
/// join emits a batch's retried calls before its new ones, the same in every session).
pub(super) async fn todo_stream(
    store: &RunStore,
    model: &ModelConfig,
    retry_errors: bool,
) -> Result<SendableRecordBatchStream, CallError> {
    let committed = store.table_rows("calls").await?;
    let passes = passes_for(committed, crate::query::resources().memory_limit);
    tracing::debug!(
        committed,
        passes,
        "call: requests still to send listed in passes"
    );
    todo_in_passes(store, model, retry_errors, passes).await
}

/// [`todo_stream`] with the number of passes given.
pub(super) async fn todo_in_passes(
    store: &RunStore,
    model: &ModelConfig,
    retry_errors: bool,
    passes: usize,
) -> Result<SendableRecordBatchStream, CallError> {
    use crate::query::QueryError;
    let ctx = crate::query::ordered_context();
    crate::query::register_run(&ctx, store, "").await?;
    ctx.register_udf(todo_call_id_udf(model));
    let err = || QueryError::df("call: listing the requests still to send");
    // Every pass's plan is built (and checked) before the first runs; each runs when the
    // previous one has streamed out.
    let mut plans = Vec::new();
    let slices = crate::query::id_slices("call_id", passes);
    for (calls, todo) in slices
        .iter()
        .zip(crate::query::id_slices("todo_id", passes))
    {
        let plan = pass_plan(&ctx, model, retry_errors, calls, &todo).await;
        plans.push(plan.map_err(err())?);
    }
    let schema = Arc::new(plans[0].schema().as_arrow().clone());
    let stream = futures::stream::iter(plans)
        .then(|plan| plan.execute_stream())
        .try_flatten();
    Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
}

/// One pass: the requests whose `todo_id` satisfies `todo_slice`, less the committed
/// calls whose `call_id` satisfies `calls_slice` (the same range).
async fn pass_plan(
    ctx: &datafusion::prelude::SessionContext,
    model: &ModelConfig,
    retry_errors: bool,
    calls_slice: &str,
    todo_slice: &str,
) -> datafusion::error::Result<datafusion::prelude::DataFrame> {
    use datafusion::common::JoinType;
    use datafusion::prelude::col;
    // Each case row unnests into its K samples, in place.
    let todo = ctx
        .sql(&format!(
            "SELECT case_id, input, k, todo_id FROM \
             (SELECT case_id, input, k, todo_call_id(case_id, input, k) AS todo_id FROM \
             (SELECT case_id, input, CAST(k AS INT) AS k FROM \
             (SELECT case_id, input, unnest(range(0, {})) AS k FROM cases))) WHERE {todo_slice}",
            model.samples.max(1)
        ))
        .await?;
    // Committed on the left: a right anti join builds its table from the left side.
    let answered = if retry_errors {
        " AND error IS NULL"
    } else {
        ""
    };
    let committed = ctx
        .sql(&format!(
            "SELECT call_id FROM calls WHERE {calls_slice}{answered}"
        ))
        .await?;
    let plan = committed.join(todo, JoinType::RightAnti, &["call_id"], &["todo_id"], None)?;
    if !retry_errors {
        return plan.select(vec![col("case_id"), col("input"), col("k")]);
    }
    // The error rows on the left (the build side: as many as the range's errors), the
    // requests streaming past them in their order.
    let prior = ctx
        .sql(&format!(
            "SELECT call_id AS prior_id, max(attempts) AS prior_attempts FROM calls \
             WHERE error IS NOT NULL AND {calls_slice} GROUP BY call_id"
        ))
        .await?;
    prior
        .join(plan, JoinType::Right, &["prior_id"], &["todo_id"], None)?
        .select(vec![
            col("case_id"),
            col("input"),
            col("k"),
            col("prior_attempts"),
        ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Table;
    use crate::stages::call::{CallRequest, CallResult, CallRow, to_batch};
    use crate::stages::generate::Case;
    use datafusion::arrow::array::{AsArray, RecordBatch};
    use datafusion::arrow::datatypes::Int32Type;

    #[test]
    fn passes_hold_an_eighth_of_the_limit_in_ids_and_nest() {
        // 1 GiB / 8 / 128 B = 1,048,576 ids per pass.
        assert_eq!(passes_for(0, 1 << 30), 1);
        assert_eq!(passes_for(1 << 20, 1 << 30), 1);
        assert_eq!(passes_for((1 << 20) + 1, 1 << 30), 2);
        assert_eq!(passes_for(10_000_000, 1 << 30), 16);
        // 16 MiB: 16,384 ids per pass; never more than the 256 id prefixes.
        assert_eq!(passes_for(50_000, 16 << 20), 4);
        assert_eq!(passes_for(u64::MAX / 2, 16 << 20), 256);
        assert_eq!(passes_for(5, 0), 8);
    }

    fn case(i: usize) -> Case {
        Case {
            case_id: format!("c{i:03}"),
            suite: "s".into(),
            test: "t".into(),
            capability: "c".into(),
            test_type: "MFT".into(),
            template_id: "t".into(),
            group_id: format!("g{i}"),
            role: "single".into(),
            input: format!("input {i}"),
            expected: None,
            expectation: None,
            tolerance: None,
            perturbation: None,
        }
    }

    fn row(model: &ModelConfig, c: &Case, k: i32, error: bool, attempts: i32) -> CallRow {
        let rh = request_hash(model, None, &c.input);
        CallRow {
            req: CallRequest {
                call_id: call_id(&c.case_id, &model.name, k, &rh),
                case_id: c.case_id.clone(),
                input: c.input.clone(),
                prompt: c.input.clone(),
                system: None,
                sample_idx: k,
                max_tokens: None,
                temperature: None,
                request_hash: rh,
                prior_attempts: 0,
            },
            res: CallResult {
                response: (!error).then(|| "ok".into()),
                error: error.then(|| "http 500".into()),
                attempts,
                ..Default::default()
            },
            latency_ms: 1.0,
            started_at_us: 0,
        }
    }

    /// `(case_id, k, prior_attempts)` of every request the plan lists, in its order.
    async fn listed(
        store: &RunStore,
        m: &ModelConfig,
        retry: bool,
        passes: usize,
    ) -> Vec<(String, i32, i32)> {
        let mut s = todo_in_passes(store, m, retry, passes).await.unwrap();
        let mut out = Vec::new();
        while let Some(b) = s.next().await {
            let b: RecordBatch = crate::schema::plain_strings(b.unwrap());
            let ids = b.column_by_name("case_id").unwrap().as_string::<i32>();
            let ks = b.column_by_name("k").unwrap().as_primitive::<Int32Type>();
            let prior = b
                .column_by_name("prior_attempts")
                .map(|c| c.as_primitive::<Int32Type>().clone());
            for i in 0..b.num_rows() {
                let p = prior
                    .as_ref()
                    .filter(|p| p.is_valid(i))
                    .map_or(0, |p| p.value(i));
                out.push((ids.value(i).to_string(), ks.value(i), p));
            }
        }
        out
    }

    #[tokio::test]
    async fn every_pass_count_lists_the_same_requests_once_each() {
        let store = RunStore::open("memory://todo-test/run").unwrap();
        let m: ModelConfig =
            toml::from_str("provider = \"builtin:echo\"\nname = \"m\"\nsamples = 3").unwrap();
        let cases: Vec<Case> = (0..200).map(case).collect();
        let mut w = store.part_writer("cases", Table::Cases.schema(), "part");
        w.write(crate::stages::generate::to_batch(&cases))
            .await
            .unwrap();
        w.finish().await.unwrap();
        // Committed: sample 0 of every case answered, sample 1 of every third case an error
        // after 4 attempts; the rest was never sent.
        let mut rows = Vec::new();
        for (i, c) in cases.iter().enumerate() {
            rows.push(row(&m, c, 0, false, 1));
            if i % 3 == 0 {
                rows.push(row(&m, c, 1, true, 4));
            }
        }
        let mut w = store.part_writer("calls", Table::Calls.schema(), "part");
        w.write(to_batch(&m, &rows)).await.unwrap();
        w.finish().await.unwrap();

        let mut expected: Vec<(String, i32, i32)> = Vec::new();
        let mut retried = Vec::new();
        for (i, c) in cases.iter().enumerate() {
            for k in 1..3 {
                let err = k == 1 && i % 3 == 0;
                if !err {
                    expected.push((c.case_id.clone(), k, 0));
                }
                retried.push((c.case_id.clone(), k, if err { 4 } else { 0 }));
            }
        }
        assert_eq!(expected.len(), 400 - 67);
        let one = listed(&store, &m, false, 1).await;
        assert_eq!(one, expected, "one pass: case order, then sample order");
        for passes in [2, 4, 16, 256] {
            let mut got = listed(&store, &m, false, passes).await;
            got.sort();
            assert_eq!(got, expected, "{passes} passes");
            let mut got = listed(&store, &m, true, passes).await;
            got.sort();
            assert_eq!(got, retried, "{passes} passes, retrying errors");
        }
        // The retry join puts a batch's retried calls first, deterministically.
        let mut got = listed(&store, &m, true, 1).await;
        got.sort();
        assert_eq!(got, retried);
    }
}
