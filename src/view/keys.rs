//! A run's point-lookup indexes ([`crate::storage::point::KeyIndex`]), one per table folder
//! and key column, made on first use and kept across the run's views: its parts outlive a
//! manifest change, so a run being written only has its new parts learnt.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::Value;

use super::ViewError;
use super::rows::batches_json;
use crate::storage::RunStore;
use crate::storage::point::KeyIndex;

/// The indexes of one run.
pub struct Keys {
    store: RunStore,
    by: Mutex<HashMap<(String, String), Arc<KeyIndex>>>,
}

impl Keys {
    pub fn new(store: RunStore) -> Self {
        Keys {
            store,
            by: Mutex::new(HashMap::new()),
        }
    }

    /// The index of folder `dir` on `column`.
    pub fn on(&self, dir: &str, column: &str) -> Arc<KeyIndex> {
        self.by
            .lock()
            .expect("keys lock")
            .entry((dir.to_string(), column.to_string()))
            .or_insert_with(|| Arc::new(KeyIndex::new(self.store.clone(), dir, column)))
            .clone()
    }

    /// The rows of folder `dir` whose `column` is one of `values`, as JSON objects with
    /// `columns` (all when `None`).
    pub async fn rows(
        &self,
        dir: &str,
        column: &str,
        values: &[String],
        columns: Option<&[&str]>,
    ) -> Result<Vec<Value>, ViewError> {
        let mut out = Vec::new();
        for b in self.on(dir, column).get(values, columns).await? {
            if let Value::Array(rows) = batches_json(std::slice::from_ref(&b))? {
                out.extend(rows);
            }
        }
        Ok(out)
    }

    /// Bytes held by every index's filters.
    pub fn filter_bytes(&self) -> usize {
        let by = self.by.lock().expect("keys lock");
        by.values().map(|i| i.filter_bytes()).sum()
    }
}
