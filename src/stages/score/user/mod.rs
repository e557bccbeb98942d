//! User scorers: scorers written as data (`[[scorer]]` tables in a pipeline or in a scorer
//! file), so a new scorer version needs no new build.
//!
//! A definition names its `kind` (`sql`, `match`, `regex`, `contains`, `not_contains`,
//! `json`, `judge`) and the `metric` it is aggregated by (`pass_fail`, `label`, `numeric`).
//! Its version is a hash of its canonical form (the parsed definition with defaults filled
//! in, keys sorted, and [`ENGINE_VERSION`]): formatting, comments and key order do not
//! change it, any change of content does. Every definition is checked in full when it is
//! read (SQL parsed and planned against the joined row schema, regexes and JSON Schemas
//! compiled), so a bad one fails before any row is scored, naming its file, line and field.
//!
//! A `sql` scorer's expressions are compiled once into DataFusion physical expressions and
//! evaluated over each joined batch of valid answers as vectors, never row by row.

mod compile;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use datafusion::arrow::array::{Array, ArrayRef, BooleanArray, Float64Array, StringArray};
use datafusion::arrow::compute::{can_cast_types, cast};
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::DFSchema;
use datafusion::physical_expr::PhysicalExpr;
use serde::Deserialize;

use super::checklist::normalise_label;
use super::judge::JudgeScorer;
use super::{BaseAnswer, MetricKind, Outcome, ScoreInput, Scorer, ScorerError, ScorerId};
use crate::config::{JudgeChecklist, ModelConfig};
use crate::storage::RunStore;

pub use crate::config::scorer::*;
use compile::*;

/// The engine's source as the version lock hashes it (tests excluded): the definition as data
/// (its canonical form and version), its checks and compilation, and the rules' evaluation.
pub fn engine_logic() -> String {
    [
        include_str!("../../../config/scorer.rs"),
        include_str!("compile.rs"),
        include_str!("mod.rs"),
    ]
    .map(super::source_logic)
    .concat()
}

impl Metric {
    pub fn kind(self) -> MetricKind {
        match self {
            Metric::PassFail => MetricKind::PassFail,
            Metric::Label => MetricKind::Label,
            Metric::Numeric => MetricKind::Numeric,
        }
    }
}

/// A scorer file: `[[scorer]]` tables only.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScorerFile {
    #[serde(default)]
    scorer: Vec<ScorerDef>,
}

///
/// # Errors
/// [`DefError`] naming `file`, the line and the field of the first problem.
pub fn parse_text(text: &str, file: &str) -> Result<Vec<ScorerDef>, DefError> {
    let f: ScorerFile = toml::from_str(text).map_err(|e| DefError {
        file: file.to_string(),
        line: e.span().map(|s| line_of_offset(text, s.start)).unwrap_or(0),
        scorer: "?".into(),
        field: "?".into(),
        msg: e.message().to_string(),
    })?;
    let mut defs = f.scorer;
    if defs.is_empty() {
        return Err(DefError {
            file: file.to_string(),
            line: 1,
            scorer: "?".into(),
            field: "scorer".into(),
            msg: "the file defines no [[scorer]]".into(),
        });
    }
    attach_origins(&mut defs, text, file);
    check_all(&defs)?;
    Ok(defs)
}

/// Reads and checks a scorer file.
///
/// # Errors
/// [`DefError`] naming the file, line and field.
pub fn parse_file(path: &Path) -> Result<Vec<ScorerDef>, DefError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| DefError {
        file: file.clone(),
        line: 0,
        scorer: "?".into(),
        field: "?".into(),
        msg: format!("cannot read: {e}"),
    })?;
    parse_text(&text, &file)
}

/// Checks every definition and that no two share a name.
///
/// # Errors
/// The first [`DefError`].
pub fn check_all(defs: &[ScorerDef]) -> Result<(), DefError> {
    let mut seen: BTreeMap<&str, &ScorerDef> = BTreeMap::new();
    for d in defs {
        if let Some(prev) = seen.insert(d.name.as_str(), d) {
            return Err(d.err(
                "name",
                format!(
                    "a scorer named `{}` is already defined at {}:{}",
                    d.name, prev.origin.file, prev.origin.line
                ),
            ));
        }
        d.compile()?;
    }
    Ok(())
}

/// A user scorer ready to score.
pub struct UserScorer {
    def: ScorerDef,
    version: String,
    canonical: serde_json::Value,
    rule: Rule,
}

impl std::fmt::Debug for UserScorer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserScorer")
            .field("name", &self.def.name)
            .field("version", &self.version)
            .finish()
    }
}

impl UserScorer {
    /// The definition this scorer was built from.
    pub fn def(&self) -> &ScorerDef {
        &self.def
    }

    fn score_row(&self, row: &ScoreInput) -> Outcome {
        match &self.rule {
            Rule::Sql(_) => Outcome {
                detail: serde_json::json!({ "unscored": "sql scorers score whole batches" }),
                ..Outcome::default()
            },
            Rule::Match { mode, tolerance } => {
                let Some(expected) = row.expected else {
                    return Outcome {
                        detail: serde_json::json!({ "not_comparable": "the case has no `expected`" }),
                        ..Outcome::default()
                    };
                };
                let got = match_form(row.response, *mode);
                let got_n = number(&got);
                let passed = expected.split('|').any(|alt| {
                    let alt = match_form(alt, *mode);
                    match (got_n, number(&alt)) {
                        (Some(a), Some(b)) => (a - b).abs() <= *tolerance,
                        _ => alt == got,
                    }
                });
                verdict(
                    passed,
                    got.clone(),
                    serde_json::json!({ "expected": expected, "got": got }),
                )
            }
            Rule::Patterns {
                kind,
                regexes,
                needles,
                all,
                ignore_case,
            } => {
                let lowered;
                let text = if *ignore_case && *kind != Kind::Regex {
                    lowered = row.response.to_lowercase();
                    lowered.as_str()
                } else {
                    row.response
                };
                let hits: Vec<bool> = if *kind == Kind::Regex {
                    regexes.iter().map(|r| r.is_match(text)).collect()
                } else {
                    needles.iter().map(|n| text.contains(n.as_str())).collect()
                };
                let sat = |h: &bool| if *kind == Kind::NotContains { !*h } else { *h };
                let passed = if *all {
                    hits.iter().all(sat)
                } else {
                    hits.iter().any(sat)
                };
                let pats = self.def.patterns.as_deref().unwrap_or_default();
                let matched: Vec<&str> = pats
                    .iter()
                    .zip(&hits)
                    .filter(|(_, h)| **h)
                    .map(|(p, _)| p.as_str())
                    .collect();
                verdict(
                    passed,
                    if passed { "pass" } else { "fail" }.into(),
                    serde_json::json!({ "matched": matched }),
                )
            }
            Rule::Json {
                schemas,
                index,
                pointer,
            } => {
                let v: serde_json::Value = match serde_json::from_str(json_text(row.response)) {
                    Ok(v) => v,
                    Err(e) => {
                        return verdict(
                            false,
                            "invalid_json".into(),
                            serde_json::json!({ "error": e.to_string() }),
                        );
                    }
                };
                if let Err(e) = schemas.validate(&v, *index) {
                    let msg: String = e.to_string().chars().take(500).collect();
                    return verdict(
                        false,
                        "schema_mismatch".into(),
                        serde_json::json!({ "error": msg }),
                    );
                }
                let label = match pointer {
                    None => "valid".to_string(),
                    Some(p) => match v.pointer(p) {
                        Some(serde_json::Value::String(s)) => s.clone(),
                        Some(serde_json::Value::Null) | None => "no_field".into(),
                        Some(other) => other.to_string(),
                    },
                };
                verdict(true, label, serde_json::Value::Null)
            }
            Rule::Judge(j) => match j {
                None => Outcome {
                    invalid: Some("judge_error"),
                    detail: serde_json::json!({ "judge": "the judge scorer was not prepared for this run" }),
                    ..Outcome::default()
                },
                Some(j) => {
                    let mut out = j.score(row, None);
                    if out.invalid.is_none() {
                        out.passed = out.answers.as_ref().map(|a| a.iter().all(|x| *x));
                    }
                    out
                }
            },
        }
    }

    /// Fills the omitted `sql` score: 1.0 / 0.0 from `passed`, else 1.0 for a labelled
    /// row; and leaves the row unscored when its metric's value is NULL.
    fn finish_sql(&self, mut o: Outcome) -> Outcome {
        let own = match self.def.metric {
            Metric::PassFail => o.passed.is_some(),
            Metric::Label => o.label.is_some(),
            Metric::Numeric => o.score.is_some(),
        };
        if !own {
            let field = match self.def.metric {
                Metric::PassFail => "passed",
                Metric::Label => "label",
                Metric::Numeric => "score",
            };
            return Outcome {
                detail: serde_json::json!({ "unscored": format!("`{field}` is NULL") }),
                ..Outcome::default()
            };
        }
        if self.def.score.is_none() {
            o.score = match (o.passed, &o.label) {
                (Some(p), _) => Some(if p { 1.0 } else { 0.0 }),
                (None, Some(_)) => Some(1.0),
                _ => None,
            };
        }
        o
    }
}

impl Scorer for UserScorer {
    fn id(&self) -> ScorerId {
        ScorerId {
            name: self.def.name.clone(),
            version: self.version.clone(),
        }
    }

    fn logic(&self) -> Vec<String> {
        vec![engine_logic(), self.canonical.to_string()]
    }

    fn score(&self, row: &ScoreInput, _base: Option<&BaseAnswer>) -> Outcome {
        self.score_row(row)
    }

    fn score_valid(
        &self,
        batch: &RecordBatch,
        valid: &BooleanArray,
    ) -> Option<Result<Vec<Outcome>, String>> {
        let Rule::Sql(sql) = &self.rule else {
            return None;
        };
        Some(
            sql.score(batch, valid)
                .map(|v| v.into_iter().map(|o| self.finish_sql(o)).collect()),
        )
    }

    fn scores_batches(&self) -> bool {
        matches!(self.rule, Rule::Sql(_))
    }

    fn metric_kind(&self) -> MetricKind {
        self.def.metric.kind()
    }

    fn definition(&self) -> Option<serde_json::Value> {
        Some(self.record())
    }

    /// A judge scorer scores a part with the judge's replies to that part's calls.
    fn for_part<'a>(
        &'a self,
        run: &'a RunStore,
        part: &'a object_store::ObjectMeta,
    ) -> super::PartScorer<'a> {
        Box::pin(async move {
            let Rule::Judge(Some(j)) = &self.rule else {
                return Ok(None);
            };
            Ok(j.part_scorer(run, part).await?.map(|j| {
                Box::new(UserScorer {
                    def: self.def.clone(),
                    version: self.version.clone(),
                    canonical: self.canonical.clone(),
                    rule: Rule::Judge(Some(Box::new(j))),
                }) as Box<dyn Scorer>
            }))
        })
    }
}

impl UserScorer {
    /// What `scores/<name>@<version>/scorer.json` holds: the definition and its metric.
    pub fn record(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.def.name,
            "version": self.version,
            "kind": self.def.kind.as_str(),
            "metric": self.def.metric.kind().metric(),
            "engine_version": ENGINE_VERSION,
            "definition": self.canonical,
            "origin": self.def.origin.file,
        })
    }
}

/// Builds a user scorer for a run; a judge scorer's judge answers every valid answer of
/// the run first (through the call stage: resumable and cached), with the definition's
/// `model` or else the run's `[judge]` model.
///
/// # Errors
/// [`ScorerError::Definition`] for a bad definition or a missing judge model,
/// [`ScorerError::JudgeCalls`] when the judge's calls fail.
pub async fn prepare(
    def: &ScorerDef,
    store: &RunStore,
    run_judge: Option<&ModelConfig>,
) -> Result<Box<dyn Scorer>, ScorerError> {
    let mut s = def.build().map_err(ScorerError::from)?;
    if def.kind == Kind::Judge {
        let model = def.model.as_ref().or(run_judge).ok_or_else(|| {
            ScorerError::from(def.err(
                "model",
                "a judge scorer needs a `model` table or a [judge] model in the pipeline",
            ))
        })?;
        let checklist = JudgeChecklist {
            questions: def.questions.clone().unwrap_or_default(),
            instructions: def.instructions.clone(),
            version: None,
        };
        let provider = crate::stages::call::build_provider(model)
            .map_err(|e| ScorerError::from(def.err("model", e.to_string())))?;
        let j = JudgeScorer::prepare(store, &checklist, model, provider)
            .await
            .map_err(|e| ScorerError::judge_calls(&def.name, &e))?;
        s.rule = Rule::Judge(Some(Box::new(j)));
    }
    Ok(Box::new(s))
}

/// The user scorer definitions recorded in a run's pipeline (its manifest).
pub fn defs_of_pipeline(pipeline: &serde_json::Value) -> Vec<ScorerDef> {
    pipeline
        .get("scorer")
        .and_then(|v| serde_json::from_value::<Vec<ScorerDef>>(v.clone()).ok())
        .unwrap_or_default()
        .into_iter()
        .map(|mut d| {
            d.origin.file = "the run's pipeline".into();
            d
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(text: &str) -> Result<ScorerDef, DefError> {
        parse_text(text, "s.toml").map(|mut v| v.remove(0))
    }

    /// A definition's version is pinned: moving or rewriting the engine's code must not
    /// change the version of a definition (old scores would look like another scorer's).
    /// The values were reproduced outside evalflow: Python's `sha256(b"1\0" + json.dumps(
    /// canonical, separators=(",", ":"), sort_keys=True))[:12]`, the canonical forms written
    /// by hand (defaults filled in, `decision.kind` as `/decision/kind`, the judge model
    /// reduced to provider, name, temperature and its empty `params`).
    #[test]
    fn versions_of_fixed_definitions_are_pinned() {
        let regex = one(
            "[[scorer]]\nname = \"r\"\nkind = \"regex\"\nmetric = \"pass_fail\"\npatterns = ['(?i)\\brefund\\b']\n",
        )
        .unwrap();
        let json = one(
            "[[scorer]]\nname = \"j\"\nkind = \"json\"\nmetric = \"label\"\nschema = { type = \"object\" }\n\
             label_field = \"decision.kind\"\n",
        )
        .unwrap();
        let judge = one(
            "[[scorer]]\nname = \"q\"\nkind = \"judge\"\nmetric = \"numeric\"\n\
             questions = [{ id = \"a\", text = \"Is it polite?\" }]\n\
             model = { provider = \"openai\", name = \"m\", temperature = 0.0, concurrency = 3 }\n",
        )
        .unwrap();
        assert_eq!(
            [regex.version(), json.version(), judge.version()],
            ["c0b91a959b40", "8892ae1d3988", "e3ff86ed876f"]
        );
    }

    #[test]
    fn key_order_and_formatting_keep_the_version() {
        let a = one(
            "[[scorer]]\nname = \"r\"\nkind = \"regex\"\nmetric = \"pass_fail\"\npatterns = ['(?i)\\brefund\\b']\n",
        )
        .unwrap();
        let b = one(
            "# a comment\n[[scorer]]\nmetric='pass_fail'   \npatterns = [\n  \"(?i)\\\\brefund\\\\b\",\n]\nkind = 'regex'\nname='r'\nrequire \
             = \"all\"\n",
        )
        .unwrap();
        assert_eq!(a.version(), b.version());
        let c = one(
            "[[scorer]]\nname = \"r\"\nkind = \"regex\"\nmetric = \"pass_fail\"\npatterns = ['(?i)\\brefunds\\b']\n",
        )
        .unwrap();
        assert_ne!(a.version(), c.version());
    }

    #[test]
    fn bad_definitions_name_line_and_field() {
        let e = one("[[scorer]]\nname = \"r\"\nkind = \"regex\"\nmetric = \"pass_fail\"\npatterns = ['(']\n")
            .unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (5, "patterns"), "{e}");
        let e = one(
            "[[scorer]]\nname = \"s\"\nkind = \"sql\"\nmetric = \"numeric\"\n\nscore = \"length(respons)\"\n",
        )
        .unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (6, "score"), "{e}");
        assert!(e.msg.contains("respons"), "{e}");
        let e = one("[[scorer]]\nname = \"s\"\nkind = \"sql\"\nmetric = \"numeric\"\nscore = \"CASE WHEN\"\n")
            .unwrap_err();
        assert_eq!(e.field, "score", "{e}");
        let e = one("[[scorer]]\nname = \"s\"\nkind = \"sql\"\nmetric = \"numeric\"\nscore = \"response\"\n")
            .unwrap_err();
        assert!(e.msg.contains("not a number"), "{e}");
        let e = one("[[scorer]]\nname = \"j\"\nkind = \"json\"\nmetric = \"pass_fail\"\nschema = { type = \"objekt\" }\n")
            .unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (5, "schema"), "{e}");
        let e = one("[[scorer]]\nname = \"j\"\nkind = \"json\"\nmetric = \"pass_fail\"\npatterns = [\"x\"]\n")
            .unwrap_err();
        assert_eq!(e.field, "patterns", "{e}");
        let e =
            one("[[scorer]]\nname = \"j\"\nkind = \"jsn\"\nmetric = \"pass_fail\"\n").unwrap_err();
        assert_eq!(e.line, 3, "{e}");
    }
}
