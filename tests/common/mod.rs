//! Shared by the integration tests that build run roots from recorded rows.

use std::collections::BTreeMap;

use evalflow::pipeline::Pipeline;
use evalflow::schema::Table;
use evalflow::stages::call::{self, CallRow};
use evalflow::stages::generate::{self, Case};
use evalflow::storage::{Manifest, RunStore};

/// Writes `cases` and `calls` as a run of `p` into `store` (a manifest with generate and call
/// complete, as `evalflow import` leaves it), validates it with `languages` and returns the
/// manifest, ready for scoring.
pub async fn write_validated_run(
    store: &RunStore,
    p: &Pipeline,
    run_id: &str,
    cases: &[Case],
    calls: &[CallRow],
    languages: &[String],
) -> Manifest {
    let mut w = store.part_writer("cases", Table::Cases.schema(), "part");
    w.write(generate::to_batch(cases)).await.unwrap();
    w.finish().await.unwrap();
    let mut w = store.part_writer("calls", Table::Calls.schema(), "part");
    w.write(call::to_batch(&p.model, calls)).await.unwrap();
    w.finish().await.unwrap();
    let mut m = Manifest {
        run_id: run_id.into(),
        evalflow_version: "test".into(),
        pipeline_path: p.path.display().to_string(),
        pipeline_hash: p.hash(),
        pipeline: serde_json::to_value(p).unwrap(),
        created_at: "2026-11-30T00:00:00Z".into(),
        finished_at: None,
        stages: BTreeMap::new(),
        row_counts: BTreeMap::new(),
        scorer_versions: vec![],
        validator_version: None,
    };
    m.complete("generate", "cases", cases.len() as u64, BTreeMap::new());
    m.complete("call", "calls", calls.len() as u64, BTreeMap::new());
    m.save(store).await.unwrap();
    evalflow::stages::validate::run(store, languages)
        .await
        .unwrap();
    m.complete("validate", "validity", calls.len() as u64, BTreeMap::new());
    m.save(store).await.unwrap();
    m
}
