//! Score: turns valid answers into verdicts, one row per call per scorer version.
//!
//! An invalid row is never scored: its score is NULL and it keeps its validity, so a
//! class of failed calls can never pad a label. Every row carries the scorer, its version
//! and the response hash, so any number can be traced to the rules that made it.
//! Re-scoring writes `scores/<scorer>@<version>/` beside older versions, never over them.

pub mod checklist;

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, Float64Array, Int32Array, ListArray, RecordBatch, StringArray,
};
use datafusion::arrow::datatypes::{DataType, Field};
use futures::StreamExt;

use crate::query::{QueryError, new_context, register_run};
use crate::schema::Table;
use crate::storage::RunStore;
use checklist::{Answer, normalise_label};

/// A scorer's identity. The version changes whenever its logic or cue lists change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScorerId {
    pub name: &'static str,
    pub version: &'static str,
}

impl ScorerId {
    /// The folder under `scores/`: `<name>@<version>`.
    pub fn dir(&self) -> String {
        format!("scores/{}@{}", self.name, self.version)
    }
}

/// The CheckList scorer (MFT / INV / DIR).
pub const CHECKLIST: ScorerId = ScorerId {
    name: "checklist",
    version: "1",
};

/// Every registered scorer.
pub const REGISTRY: &[ScorerId] = &[CHECKLIST];

/// Finds a scorer by `name` or `name@version`.
pub fn find(spec: &str) -> Option<ScorerId> {
    let (name, version) = spec
        .split_once('@')
        .map_or((spec, None), |(n, v)| (n, Some(v)));
    REGISTRY
        .iter()
        .copied()
        .find(|s| s.name == name && version.is_none_or(|v| v == s.version))
}

const JOIN_SQL: &str = "SELECT k.call_id, k.case_id, k.model, k.sample_idx, k.response, k.response_score, \
     k.response_hash, v.validity, c.test, c.capability, c.test_type, c.role, c.template_id, \
     c.group_id, c.expected, c.expectation, c.tolerance \
     FROM calls k JOIN validity v ON k.call_id = v.call_id JOIN cases c ON k.case_id = c.case_id";

/// One scored row before it becomes Arrow.
#[derive(Debug, Clone, Default)]
struct Row {
    call_id: String,
    case_id: String,
    model: String,
    sample_idx: i32,
    response_hash: Option<String>,
    validity: String,
    score: Option<f64>,
    label: Option<String>,
    prob: Option<f64>,
    passed: Option<bool>,
    detail: Option<String>,
    test: String,
    capability: String,
    test_type: String,
    role: String,
    template_id: String,
}

/// Typed access to a joined batch. Columns are cast to plain Utf8 first, so a view-typed
/// string column can never read as empty strings.
struct Cols<'a> {
    b: &'a RecordBatch,
}

impl<'a> Cols<'a> {
    fn col<T: 'static>(&self, name: &str) -> &'a T {
        self.b
            .column_by_name(name)
            .and_then(|c| c.as_any().downcast_ref::<T>())
            .unwrap_or_else(|| panic!("joined column `{name}` has its declared type"))
    }
    fn s(&self, name: &str, i: usize) -> Option<&'a str> {
        let a = self.col::<StringArray>(name);
        a.is_valid(i).then(|| a.value(i))
    }
    fn f(&self, name: &str, i: usize) -> Option<f64> {
        let a = self.col::<Float64Array>(name);
        a.is_valid(i).then(|| a.value(i))
    }
    fn i(&self, name: &str, i: usize) -> Option<i32> {
        let a = self.col::<Int32Array>(name);
        a.is_valid(i).then(|| a.value(i))
    }
}

type BaseKey = (String, String, i32);

/// Runs the CheckList scorer over the run's calls, writing `scores/checklist@1/`.
/// Returns the number of rows written.
pub async fn run(store: &RunStore, scorer: ScorerId) -> Result<u64, QueryError> {
    let ctx = new_context();
    register_run(&ctx, store, "").await?;
    // Base answers first: memory grows with groups, not rows.
    let mut bases: HashMap<BaseKey, Result<Answer, String>> = HashMap::new();
    let base_sql = format!("{JOIN_SQL} WHERE c.role = 'base'");
    let mut s = ctx
        .sql(&base_sql)
        .await
        .map_err(QueryError::df("score: joining base cases"))?
        .execute_stream()
        .await
        .map_err(QueryError::df("score: joining base cases"))?;
    while let Some(b) = s.next().await {
        let b =
            crate::schema::plain_strings(b.map_err(QueryError::df("score: reading base cases"))?);
        let c = Cols { b: &b };
        for i in 0..b.num_rows() {
            let key = (
                c.s("group_id", i).unwrap_or_default().to_string(),
                c.s("model", i).unwrap_or_default().to_string(),
                c.i("sample_idx", i).unwrap_or(0),
            );
            let validity = c.s("validity", i).unwrap_or_default();
            let v = if validity == "valid_answer" {
                Ok(Answer {
                    label: normalise_label(c.s("response", i).unwrap_or_default()),
                    score: c.f("response_score", i),
                })
            } else {
                Err(validity.to_string())
            };
            bases.insert(key, v);
        }
    }
    store.delete_dir(&scorer.dir()).await?;
    let mut writer = store.part_writer(&scorer.dir(), Table::Scores.schema(), "part");
    let mut s = ctx
        .sql(JOIN_SQL)
        .await
        .map_err(QueryError::df("score: joining calls, validity and cases"))?
        .execute_stream()
        .await
        .map_err(QueryError::df("score: joining calls, validity and cases"))?;
    let mut rows_written = 0u64;
    while let Some(b) = s.next().await {
        let b =
            crate::schema::plain_strings(b.map_err(QueryError::df("score: reading joined rows"))?);
        let rows = score_batch(&b, &bases);
        rows_written += rows.len() as u64;
        writer.write(to_batch(scorer, &rows)).await?;
    }
    writer.finish().await?;
    Ok(rows_written)
}

fn score_batch(b: &RecordBatch, bases: &HashMap<BaseKey, Result<Answer, String>>) -> Vec<Row> {
    let c = Cols { b };
    (0..b.num_rows())
        .map(|i| {
            let s = |n: &str| c.s(n, i).unwrap_or_default().to_string();
            let mut row = Row {
                call_id: s("call_id"),
                case_id: s("case_id"),
                model: s("model"),
                sample_idx: c.i("sample_idx", i).unwrap_or(0),
                response_hash: c.s("response_hash", i).map(String::from),
                validity: s("validity"),
                test: s("test"),
                capability: s("capability"),
                test_type: s("test_type"),
                role: s("role"),
                template_id: s("template_id"),
                ..Default::default()
            };
            if row.validity != "valid_answer" {
                row.detail = Some(serde_json::json!({ "unscored": row.validity }).to_string());
                return row;
            }
            let answer = Answer {
                label: normalise_label(c.s("response", i).unwrap_or_default()),
                score: c.f("response_score", i),
            };
            row.label = Some(answer.label.clone());
            row.prob = answer.score;
            let tol = c.f("tolerance", i).unwrap_or(0.1);
            let verdict = match (row.test_type.as_str(), row.role.as_str()) {
                (_, "base") => {
                    row.detail = Some(serde_json::json!({ "role": "base" }).to_string());
                    return row;
                }
                ("MFT", _) | (_, "single") => Some(checklist::mft(&answer, c.s("expected", i).unwrap_or_default())),
                (tt, _) => {
                    let key = (s("group_id"), row.model.clone(), row.sample_idx);
                    match bases.get(&key) {
                        Some(Ok(base)) if tt == "INV" => Some(checklist::inv(&answer, base, tol)),
                        Some(Ok(base)) => checklist::dir(&answer, base, c.s("expectation", i).unwrap_or_default(), tol),
                        Some(Err(v)) => {
                            row.detail = Some(serde_json::json!({ "not_comparable": format!("base case answer is {v}") }).to_string());
                            return row;
                        }
                        None => {
                            row.detail = Some(serde_json::json!({ "not_comparable": "base case has no call" }).to_string());
                            return row;
                        }
                    }
                }
            };
            match verdict {
                Some(v) => {
                    row.passed = Some(v.passed);
                    row.score = Some(if v.passed { 1.0 } else { 0.0 });
                    row.detail = Some(v.detail.to_string());
                }
                None => {
                    row.detail = Some(serde_json::json!({ "not_comparable": "no score to compare" }).to_string());
                }
            }
            row
        })
        .collect()
}

fn to_batch(scorer: ScorerId, rows: &[Row]) -> RecordBatch {
    let s = |f: &dyn Fn(&Row) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
    };
    let os = |f: &dyn Fn(&Row) -> Option<&str>| -> ArrayRef {
        Arc::new(rows.iter().map(f).collect::<StringArray>())
    };
    let answers = ListArray::new_null(
        Arc::new(Field::new_list_field(DataType::Boolean, true)),
        rows.len(),
    );
    let cols: Vec<ArrayRef> = vec![
        s(&|r| &r.call_id),
        s(&|r| &r.case_id),
        s(&|r| &r.model),
        Arc::new(Int32Array::from_iter_values(
            rows.iter().map(|r| r.sample_idx),
        )),
        s(&|_| scorer.name),
        s(&|_| scorer.version),
        os(&|r| r.response_hash.as_deref()),
        s(&|r| &r.validity),
        Arc::new(rows.iter().map(|r| r.score).collect::<Float64Array>()),
        os(&|r| r.label.as_deref()),
        Arc::new(rows.iter().map(|r| r.prob).collect::<Float64Array>()),
        Arc::new(rows.iter().map(|r| r.passed).collect::<BooleanArray>()),
        os(&|r| r.detail.as_deref()),
        Arc::new(answers),
        s(&|r| &r.test),
        s(&|r| &r.capability),
        s(&|r| &r.test_type),
        s(&|r| &r.role),
        s(&|r| &r.template_id),
    ];
    RecordBatch::try_new(Table::Scores.schema(), cols)
        .expect("scores batch matches schemas/scores.json")
}
