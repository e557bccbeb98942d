//! `manifest.json`: what a run is, and how far each stage got.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{RunStore, StorageError};

/// The status of one stage in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageStatus {
    Running,
    Complete,
    Failed,
}

/// What one stage did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StageRecord {
    pub status: StageStatus,
    pub rows: u64,
    pub started_at: String,
    pub finished_at: Option<String>,
    /// Stage-specific facts (token totals, versions, error counts).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub details: BTreeMap<String, serde_json::Value>,
}

/// The run's manifest. Keys never appear here: the pipeline names only the variable.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub run_id: String,
    pub evalflow_version: String,
    pub pipeline_path: String,
    pub pipeline_hash: String,
    /// The pipeline file as parsed (TOML converted to JSON).
    pub pipeline: serde_json::Value,
    pub created_at: String,
    pub finished_at: Option<String>,
    #[serde(default)]
    pub stages: BTreeMap<String, StageRecord>,
    #[serde(default)]
    pub row_counts: BTreeMap<String, u64>,
    #[serde(default)]
    pub scorer_versions: Vec<String>,
    #[serde(default)]
    pub validator_version: Option<String>,
}

pub(crate) const MANIFEST: &str = "manifest.json";

/// The current time as RFC 3339 (UTC).
pub fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

impl Manifest {
    /// Reads the manifest of a run, if it has one.
    pub async fn load(store: &RunStore) -> Result<Option<Manifest>, StorageError> {
        let Some(bytes) = store.get(MANIFEST).await? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| StorageError::Manifest {
                location: store.location(&store.path(MANIFEST)),
                msg: format!("not a valid evalflow manifest: {e}"),
            })
    }

    /// Writes the manifest atomically.
    pub async fn save(&self, store: &RunStore) -> Result<(), StorageError> {
        let bytes = serde_json::to_vec_pretty(self).expect("manifest serialises");
        store.put(MANIFEST, bytes).await
    }

    /// Whether `stage` finished in this run.
    pub fn is_complete(&self, stage: &str) -> bool {
        self.stages
            .get(stage)
            .is_some_and(|s| s.status == StageStatus::Complete)
    }

    /// Records that `stage` started (keeps an earlier start time when resuming).
    pub fn start(&mut self, stage: &str) {
        let started_at = self
            .stages
            .get(stage)
            .map(|s| s.started_at.clone())
            .unwrap_or_else(now);
        self.stages.insert(
            stage.to_string(),
            StageRecord {
                status: StageStatus::Running,
                rows: 0,
                started_at,
                finished_at: None,
                details: BTreeMap::new(),
            },
        );
        self.finished_at = None;
    }

    /// Records that `stage` finished with `rows` rows in `table`.
    pub fn complete(
        &mut self,
        stage: &str,
        table: &str,
        rows: u64,
        details: BTreeMap<String, serde_json::Value>,
    ) {
        let rec = self.stages.entry(stage.to_string()).or_insert(StageRecord {
            status: StageStatus::Running,
            rows: 0,
            started_at: now(),
            finished_at: None,
            details: BTreeMap::new(),
        });
        rec.status = StageStatus::Complete;
        rec.rows = rows;
        rec.finished_at = Some(now());
        rec.details = details;
        self.row_counts.insert(table.to_string(), rows);
    }
}
