//! Observations (one per unit x judge x trial, with its checklist answers), human labels, and
//! loaders: the `scores` table of a run or any Parquet file of that shape, a labels CSV, and
//! SummEval-style annotation files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use datafusion::arrow::array::{Array, AsArray, BooleanArray, ListArray};
use datafusion::arrow::datatypes::{DataType, Int32Type};

use super::JudgeError;
use crate::query::{self, QueryError};

/// One judge's checklist answers for one unit in one trial.
#[derive(Debug, Clone, PartialEq)]
pub struct Obs {
    /// The measurement unit (a summary in SummEval): the `unit` column, else `case_id`.
    pub unit: String,
    /// The judge: the `model` column.
    pub judge: String,
    /// The trial: the `sample_idx` column.
    pub trial: i32,
    /// The YES/NO answers, one per checklist question.
    pub answers: Vec<bool>,
}

impl Obs {
    /// The answers as 0/1 features.
    pub fn features(&self) -> Vec<f64> {
        self.answers
            .iter()
            .map(|&b| f64::from(u8::from(b)))
            .collect()
    }

    /// The fraction of YES answers (CheckEval's score).
    pub fn fraction_yes(&self) -> f64 {
        if self.answers.is_empty() {
            return 0.0;
        }
        self.answers.iter().filter(|&&b| b).count() as f64 / self.answers.len() as f64
    }
}

/// Every observation of one checklist, with its question ids and version.
#[derive(Debug, Clone, Default)]
pub struct Dataset {
    pub obs: Vec<Obs>,
    /// Question ids, in answer order (from `detail.questions`, else `q1..qd`).
    pub questions: Vec<String>,
    /// `scorer@scoring_version` of the judge scorer the answers came from.
    pub checklist: String,
}

impl Dataset {
    /// The judges, sorted.
    pub fn judges(&self) -> Vec<String> {
        let s: BTreeSet<&str> = self.obs.iter().map(|o| o.judge.as_str()).collect();
        s.into_iter().map(str::to_string).collect()
    }

    /// The units, sorted.
    pub fn units(&self) -> Vec<String> {
        let s: BTreeSet<&str> = self.obs.iter().map(|o| o.unit.as_str()).collect();
        s.into_iter().map(str::to_string).collect()
    }
}

/// What kind of label the model learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LabelKind {
    /// A numeric score (ordinal or continuous): a GBDT regressor on squared loss.
    Regression,
    /// A boolean label (true/false, yes/no, pass/fail): a GBDT classifier on log loss; the
    /// prediction is the probability of `true`.
    Binary,
}

/// Human labels by unit.
#[derive(Debug, Clone)]
pub struct Labels {
    pub kind: LabelKind,
    pub values: BTreeMap<String, f64>,
}

impl Labels {
    /// The observed label range (min, max); (0, 1) for binary labels.
    pub fn range(&self) -> (f64, f64) {
        if self.kind == LabelKind::Binary {
            return (0.0, 1.0);
        }
        let lo = self.values.values().copied().fold(f64::INFINITY, f64::min);
        let hi = self
            .values
            .values()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        (lo, hi)
    }
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "pass" => Some(true),
        "false" | "no" | "fail" => Some(false),
        _ => None,
    }
}

/// Splits one CSV line, honouring double quotes (`""` inside quotes is a quote).
pub fn split_csv_line(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    out.push(cur);
    out
}

/// Reads a labels CSV with a header naming `unit` and `label` columns (others are ignored).
///
/// # Behavior
/// Labels that all parse as numbers give [`LabelKind::Regression`]; labels that are all
/// true/false, yes/no or pass/fail give [`LabelKind::Binary`]. Empty labels are skipped.
///
/// # Errors
/// A missing column, a duplicate unit, a mix of kinds, or a label that is neither, naming the
/// file and line.
pub fn read_labels(path: &Path) -> Result<Labels, JudgeError> {
    let text = std::fs::read_to_string(path).map_err(JudgeError::io(path))?;
    parse_labels(&text, &path.display().to_string())
}

/// [`read_labels`] over text; `what` names the source in errors.
pub fn parse_labels(text: &str, what: &str) -> Result<Labels, JudgeError> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let (_, header) = lines
        .next()
        .ok_or_else(|| JudgeError::BadInput(format!("{what}: empty labels file")))?;
    let header: Vec<String> = split_csv_line(header)
        .into_iter()
        .map(|h| h.trim().to_string())
        .collect();
    let col = |name: &str| {
        header.iter().position(|h| h == name).ok_or_else(|| {
            JudgeError::BadInput(format!(
                "{what}: the header has no `{name}` column (found: {})",
                header.join(", ")
            ))
        })
    };
    let (ui, li) = (col("unit")?, col("label")?);
    let mut raw: Vec<(usize, String, String)> = Vec::new();
    for (n, line) in lines {
        let f = split_csv_line(line);
        let (Some(u), Some(l)) = (f.get(ui), f.get(li)) else {
            return Err(JudgeError::BadInput(format!(
                "{what}:{}: expected at least {} fields",
                n + 1,
                ui.max(li) + 1
            )));
        };
        if l.trim().is_empty() {
            continue;
        }
        raw.push((n + 1, u.trim().to_string(), l.trim().to_string()));
    }
    let numeric = raw.iter().all(|(_, _, l)| l.parse::<f64>().is_ok());
    let kind = if numeric {
        LabelKind::Regression
    } else {
        LabelKind::Binary
    };
    let mut values = BTreeMap::new();
    for (line, unit, l) in raw {
        let v = match kind {
            LabelKind::Regression => l.parse::<f64>().ok().filter(|v| v.is_finite()),
            LabelKind::Binary => parse_bool(&l).map(|b| f64::from(u8::from(b))),
        }
        .ok_or_else(|| {
            JudgeError::BadInput(format!(
                "{what}:{line}: field `label`: `{l}` is neither a number nor a boolean \
                 (true/false, yes/no, pass/fail), or the column mixes the two"
            ))
        })?;
        if values.insert(unit.clone(), v).is_some() {
            return Err(JudgeError::BadInput(format!(
                "{what}:{line}: unit `{unit}` is labelled twice"
            )));
        }
    }
    if values.is_empty() {
        return Err(JudgeError::BadInput(format!("{what}: no labels")));
    }
    Ok(Labels { kind, values })
}

/// Writes labels as `unit,label` CSV.
pub fn write_labels(path: &Path, labels: &BTreeMap<String, f64>) -> Result<(), JudgeError> {
    let mut s = String::from("unit,label\n");
    for (u, v) in labels {
        let u = if u.contains([',', '"']) {
            format!("\"{}\"", u.replace('"', "\"\""))
        } else {
            u.clone()
        };
        s.push_str(&format!("{u},{v}\n"));
    }
    std::fs::write(path, s).map_err(JudgeError::io(path))
}

/// Reads judge observations from a run root (a folder with `manifest.json`: its `scores`
/// table), or from a Parquet file or folder shaped like `scores`.
///
/// # Behavior
/// Rows with a NULL `answers` list are skipped (non-judge scorers, invalid answers). The unit is
/// the `unit` column when present, else `case_id`; the judge is `model`; the trial is
/// `sample_idx`. Question ids come from the `questions` array of the first row's `detail` JSON,
/// else `q1..qd`. `scorer` restricts to one scorer name (or `name@version`).
///
/// `columns` overrides the unit and judge with SQL expressions over `scores`. In an evalflow
/// run the `judge` scorer's `model` is the model under test and each judge model gets its own
/// `scoring_version`, so there the paper's layout is `unit = concat(case_id, '/', model)` and
/// `judge = scoring_version` (answers from several versions are then accepted, as long as the
/// question count agrees).
///
/// # Errors
/// No judge rows, several checklist versions without `scorer`, or answer vectors of different
/// lengths (naming the row's unit, judge and trial).
pub async fn read_scores(
    src: &str,
    scorer: Option<&str>,
    columns: &Columns,
) -> Result<Dataset, JudgeError> {
    let is_run = Path::new(src).join("manifest.json").exists();
    let ctx = if is_run {
        query::open_run(src).await?.0
    } else {
        let ctx = query::new_context();
        let url = match std::fs::canonicalize(src) {
            Ok(p) if p.is_dir() => format!("{}/", p.display()),
            Ok(p) => p.display().to_string(),
            Err(_) => src.to_string(),
        };
        query::register_parquet(&ctx, "scores", &url).await?;
        ctx
    };
    let df = ctx
        .table("scores")
        .await
        .map_err(QueryError::df(format!("{src}: table scores")))?;
    let schema = df.schema().clone();
    for need in ["model", "sample_idx", "answers"] {
        if schema.field_with_unqualified_name(need).is_err() {
            return Err(JudgeError::BadInput(format!(
                "{src}: the scores table has no `{need}` column"
            )));
        }
    }
    let has = |c: &str| schema.field_with_unqualified_name(c).is_ok();
    let unit = match &columns.unit {
        Some(u) => u.as_str(),
        None if has("unit") => "unit",
        None => "case_id",
    };
    let judge = columns.judge.as_deref().unwrap_or("model");
    let version = if has("scorer") && has("scoring_version") {
        "concat(scorer, '@', scoring_version)"
    } else {
        "'unversioned'"
    };
    let detail = if has("detail") { "detail" } else { "NULL" };
    let mut sql = format!(
        "SELECT CAST({unit} AS VARCHAR) AS unit, CAST({judge} AS VARCHAR) AS judge, \
         CAST(sample_idx AS INT) AS trial, answers, {version} AS checklist, \
         CAST({detail} AS VARCHAR) AS detail FROM scores WHERE answers IS NOT NULL"
    );
    if let Some(s) = scorer {
        let s = s.replace('\'', "''");
        if s.contains('@') {
            sql.push_str(&format!(" AND {version} = '{s}'"));
        } else if has("scorer") {
            sql.push_str(&format!(" AND scorer = '{s}'"));
        }
    }
    sql.push_str(" ORDER BY unit, judge, trial");
    let batches = ctx
        .sql(&sql)
        .await
        .map_err(QueryError::df(format!("{src}: {sql}")))?
        .collect()
        .await
        .map_err(QueryError::df(format!("{src}: {sql}")))?;
    let mut ds = Dataset::default();
    let mut versions = BTreeSet::new();
    let mut first_detail: Option<String> = None;
    for b in &batches {
        let s = |i: usize| b.column(i).as_string::<i32>();
        let (units, judges, checklist, details) = (s(0), s(1), s(4), s(5));
        let trials = b.column(2).as_primitive::<Int32Type>();
        let answers: &ListArray = b.column(3).as_list::<i32>();
        if !matches!(answers.value_type(), DataType::Boolean) {
            return Err(JudgeError::BadInput(format!(
                "{src}: column `answers` must be list<bool>, found list<{}>",
                answers.value_type()
            )));
        }
        for i in 0..b.num_rows() {
            let a = answers.value(i);
            let a: &BooleanArray = a.as_boolean();
            if a.null_count() > 0 {
                return Err(JudgeError::BadInput(format!(
                    "{src}: unit `{}`, judge `{}`, trial {}: `answers` has a NULL answer",
                    units.value(i),
                    judges.value(i),
                    trials.value(i)
                )));
            }
            versions.insert(checklist.value(i).to_string());
            if first_detail.is_none() && !details.is_null(i) {
                first_detail = Some(details.value(i).to_string());
            }
            ds.obs.push(Obs {
                unit: units.value(i).to_string(),
                judge: judges.value(i).to_string(),
                trial: trials.value(i),
                answers: a.iter().map(|x| x.unwrap_or(false)).collect(),
            });
        }
    }
    if ds.obs.is_empty() {
        return Err(JudgeError::BadInput(format!(
            "{src}: no scores rows with an `answers` list (is a judge scorer's output here?)"
        )));
    }
    if versions.len() > 1 && !judge.contains("scoring_version") {
        return Err(JudgeError::BadInput(format!(
            "{src}: answers from several checklists ({}); choose one with --scorer",
            versions.into_iter().collect::<Vec<_>>().join(", ")
        )));
    }
    ds.checklist = versions.into_iter().collect::<Vec<_>>().join(",");
    let d = ds.obs[0].answers.len();
    if let Some(o) = ds.obs.iter().find(|o| o.answers.len() != d) {
        return Err(JudgeError::BadInput(format!(
            "{src}: unit `{}`, judge `{}`, trial {}: {} answers, but the first row has {d}",
            o.unit,
            o.judge,
            o.trial,
            o.answers.len()
        )));
    }
    ds.questions = first_detail
        .and_then(|d| serde_json::from_str::<serde_json::Value>(&d).ok())
        .and_then(|v| {
            v.get("questions")?
                .as_array()?
                .iter()
                .map(|q| q.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
        })
        .filter(|q| q.len() == d)
        .unwrap_or_else(|| (1..=d).map(|i| format!("q{i}")).collect());
    Ok(ds)
}

/// SQL expressions for the unit and judge of each `scores` row (`None`: the defaults).
#[derive(Debug, Clone, Default)]
pub struct Columns {
    pub unit: Option<String>,
    pub judge: Option<String>,
}

/// The SummEval quality axes.
pub const SUMMEVAL_AXES: [&str; 4] = ["coherence", "consistency", "fluency", "relevance"];

/// Loads unit labels for one axis from a SummEval-style annotation file.
///
/// SummEval (Fabbri et al. 2021) ships `model_annotations.aligned.jsonl`: one JSON object per
/// summary with `id` (the document), `model_id` (the summariser), `decoded` (the summary) and
/// `expert_annotations`, a list of objects with a 1-5 score per axis (`coherence`,
/// `consistency`, `fluency`, `relevance`). As in the paper, the unit is one summary
/// (`<id>/<model_id>`) and its label is the mean of the expert scores on the axis.
/// Objects that carry `document` and `summary` texts but no ids get the unit
/// `<hash of document and summary>`, so any file with the same fields loads too. The judge's
/// `scores` rows must use the same unit ids (in a `unit` column or as `case_id`).
///
/// # Errors
/// An unknown axis, a line that is not JSON, or a summary with no expert score on the axis,
/// naming the line.
pub fn load_summeval(path: &Path, axis: &str) -> Result<BTreeMap<String, f64>, JudgeError> {
    let text = std::fs::read_to_string(path).map_err(JudgeError::io(path))?;
    parse_summeval(&text, axis, &path.display().to_string())
}

/// [`load_summeval`] over text; `what` names the source in errors.
pub fn parse_summeval(
    text: &str,
    axis: &str,
    what: &str,
) -> Result<BTreeMap<String, f64>, JudgeError> {
    if !SUMMEVAL_AXES.contains(&axis) {
        return Err(JudgeError::BadInput(format!(
            "unknown SummEval axis `{axis}` (one of {})",
            SUMMEVAL_AXES.join(", ")
        )));
    }
    let mut out = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| JudgeError::BadInput(format!("{what}:{}: not JSON: {e}", n + 1)))?;
        let unit = summeval_unit(&v);
        let scores: Vec<f64> = v
            .get("expert_annotations")
            .and_then(|a| a.as_array())
            .map(|a| a.iter().filter_map(|x| x.get(axis)?.as_f64()).collect())
            .unwrap_or_default();
        if scores.is_empty() {
            return Err(JudgeError::BadInput(format!(
                "{what}:{}: field `expert_annotations[].{axis}`: no expert score",
                n + 1
            )));
        }
        out.insert(unit, scores.iter().sum::<f64>() / scores.len() as f64);
    }
    Ok(out)
}

fn summeval_unit(v: &serde_json::Value) -> String {
    let s = |k: &str| v.get(k).and_then(|x| x.as_str());
    match (s("id"), s("model_id")) {
        (Some(id), Some(m)) => format!("{id}/{m}"),
        (Some(id), None) => id.to_string(),
        _ => {
            use sha2::{Digest, Sha256};
            let mut h = Sha256::new();
            h.update(s("document").unwrap_or_default());
            h.update([0u8]);
            h.update(s("summary").or(s("decoded")).unwrap_or_default());
            hex::encode(&h.finalize()[..8])
        }
    }
}
