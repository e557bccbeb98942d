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

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use datafusion::arrow::array::{Array, ArrayRef, BooleanArray, Float64Array, StringArray};
use datafusion::arrow::compute::{can_cast_types, cast};
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::DFSchema;
use datafusion::physical_expr::PhysicalExpr;
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use toml::Spanned;

use super::checklist::normalise_label;
use super::judge::JudgeScorer;
use super::{BaseAnswer, MetricKind, Outcome, ScoreInput, Scorer, ScorerError, ScorerId};
use crate::config::{JudgeChecklist, JudgeQuestion, ModelConfig};
use crate::storage::RunStore;

/// The version of the engine that runs user scorers, hashed into every user scorer's
/// version: a change of how definitions are evaluated bumps it (the version lock in
/// `versions.lock` fails otherwise), so old scores are never mistaken for new ones.
pub const ENGINE_VERSION: &str = "1";

/// Names user scorers may not take: the built-in scorers keep their meaning.
pub const RESERVED: &[&str] = &["checklist", "cue", "judge"];

/// What a user scorer does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// SQL expressions over the joined row (`score`, `label`, `passed`).
    Sql,
    /// The answer against the case's `expected` (`a|b` alternatives, numbers with a tolerance).
    Match,
    /// Regular expressions (`patterns`), all or any must match.
    Regex,
    /// Substrings (`patterns`), all or any must occur.
    Contains,
    /// Substrings (`patterns`) that must not occur (all absent, or any absent).
    NotContains,
    /// The answer parses as JSON and matches `schema`; `label_field` is extracted.
    Json,
    /// The YES/NO checklist judge with the questions of the definition.
    Judge,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Sql => "sql",
            Kind::Match => "match",
            Kind::Regex => "regex",
            Kind::Contains => "contains",
            Kind::NotContains => "not_contains",
            Kind::Json => "json",
            Kind::Judge => "judge",
        }
    }

    /// The fields this kind reads (besides `name`, `kind`, `metric`, `description`).
    fn fields(self) -> &'static [&'static str] {
        match self {
            Kind::Sql => &["score", "label", "passed"],
            Kind::Match => &["mode", "tolerance"],
            Kind::Regex | Kind::Contains | Kind::NotContains => {
                &["patterns", "require", "ignore_case"]
            }
            Kind::Json => &["schema", "label_field"],
            Kind::Judge => &["questions", "instructions", "model"],
        }
    }
}

/// The metric a user scorer declares; aggregation follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    PassFail,
    Label,
    Numeric,
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

/// One `[[scorer]]` table, as written.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScorerDef {
    /// The scorer's name (letters, digits, `_`, `-`, `.`); its scores go to
    /// `scores/<name>@<version>/`.
    pub name: String,
    pub kind: Kind,
    pub metric: Metric,
    /// Free text for people (hashed like everything else).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// `sql`: the score, a number (omitted: 1.0 / 0.0 from `passed`, or 1.0 for a labelled
    /// row).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<String>,
    /// `sql`: the label (any type, read as text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// `sql`: the pass/fail verdict, a boolean.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passed: Option<String>,
    /// `match`: `exact` (whitespace-trimmed), `case_insensitive` or `normalised` (default:
    /// lower case, trailing punctuation and repeated spaces removed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// `match`: when answer and expected both read as numbers, they match within this
    /// (default 0: equal as numbers, so `5.0` matches `5`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerance: Option<f64>,
    /// `regex` / `contains` / `not_contains`: the patterns, tested on the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patterns: Option<Vec<String>>,
    /// `all` (default) or `any` of the patterns must be satisfied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub require: Option<String>,
    /// Case-insensitive patterns (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_case: Option<bool>,
    /// `json`: a JSON Schema, as a TOML table or as JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<serde_json::Value>,
    /// `json`: the field whose value becomes the label, as a JSON pointer (`/decision`) or
    /// a dotted path (`decision.kind`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_field: Option<String>,
    /// `judge`: the YES/NO questions, in order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub questions: Option<Vec<JudgeQuestion>>,
    /// `judge`: extra instructions placed before the questions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// `judge`: the judge model (default: the run's `[judge]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelConfig>,
    /// Where the definition was read (not part of the definition).
    #[serde(skip)]
    pub origin: Origin,
}

/// The file and the lines of a definition's fields, for error messages.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Origin {
    pub file: String,
    /// The line of the table (its first key).
    pub line: usize,
    pub fields: BTreeMap<String, usize>,
}

/// A bad definition: the file, line and field, and what is wrong.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
#[error("{file}:{line}: scorer `{scorer}`: field `{field}`: {msg}")]
pub struct DefError {
    pub file: String,
    pub line: usize,
    pub scorer: String,
    pub field: String,
    pub msg: String,
}

/// A scorer file: `[[scorer]]` tables only.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScorerFile {
    #[serde(default)]
    scorer: Vec<ScorerDef>,
}

/// The spans of every `[[scorer]]` key (a lenient parse: other top-level keys ignored).
#[derive(Debug, Default, Deserialize)]
struct SpanFile {
    #[serde(default)]
    scorer: Vec<BTreeMap<String, Spanned<IgnoredAny>>>,
}

fn line_of_offset(s: &str, offset: usize) -> usize {
    s[..offset.min(s.len())].matches('\n').count() + 1
}

/// Records in each definition where it was read: `defs` are the `[[scorer]]` tables of
/// `text`, in order.
pub fn attach_origins(defs: &mut [ScorerDef], text: &str, file: &str) {
    let spans = toml::from_str::<SpanFile>(text).unwrap_or_default();
    for (i, d) in defs.iter_mut().enumerate() {
        let mut o = Origin {
            file: file.to_string(),
            ..Origin::default()
        };
        if let Some(keys) = spans.scorer.get(i) {
            for (k, s) in keys {
                o.fields
                    .insert(k.clone(), line_of_offset(text, s.span().start));
            }
            o.line = o.fields.values().copied().min().unwrap_or(0);
        }
        d.origin = o;
    }
}

/// Parses the `[[scorer]]` tables of a scorer file's text and checks each one.
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

enum Rule {
    Sql(Box<SqlRule>),
    Match {
        mode: MatchMode,
        tolerance: f64,
    },
    Patterns {
        kind: Kind,
        regexes: Vec<regex::Regex>,
        needles: Vec<String>,
        all: bool,
        ignore_case: bool,
    },
    Json {
        schemas: Box<boon::Schemas>,
        index: boon::SchemaIndex,
        pointer: Option<String>,
    },
    /// The judge's replies come from a run ([`prepare`]); `None` until then.
    Judge(Option<Box<JudgeScorer>>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MatchMode {
    Exact,
    CaseInsensitive,
    Normalised,
}

/// A SQL scorer's compiled expressions, for the schema they were compiled against; a
/// batch of another schema (a run written by another evalflow) compiles them again once.
struct SqlRule {
    sources: [Option<String>; 3],
    compiled: Mutex<Compiled>,
}

#[derive(Clone)]
struct Compiled {
    /// The joined schema the expressions were compiled for.
    schema: SchemaRef,
    /// The columns they read (indices into `schema`): only these are gathered per batch.
    columns: Vec<usize>,
    /// Compiled against `schema` projected to `columns`.
    exprs: [Option<Arc<dyn PhysicalExpr>>; 3],
}

const SQL_FIELDS: [&str; 3] = ["score", "label", "passed"];

impl ScorerDef {
    fn line(&self, field: &str) -> usize {
        self.origin
            .fields
            .get(field)
            .copied()
            .unwrap_or(self.origin.line)
    }

    fn err(&self, field: &str, msg: impl Into<String>) -> DefError {
        DefError {
            file: self.origin.file.clone(),
            line: self.line(field),
            scorer: self.name.clone(),
            field: field.to_string(),
            msg: msg.into(),
        }
    }

    /// The fields set in this definition.
    fn present(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        let set = [
            ("score", self.score.is_some()),
            ("label", self.label.is_some()),
            ("passed", self.passed.is_some()),
            ("mode", self.mode.is_some()),
            ("tolerance", self.tolerance.is_some()),
            ("patterns", self.patterns.is_some()),
            ("require", self.require.is_some()),
            ("ignore_case", self.ignore_case.is_some()),
            ("schema", self.schema.is_some()),
            ("label_field", self.label_field.is_some()),
            ("questions", self.questions.is_some()),
            ("instructions", self.instructions.is_some()),
            ("model", self.model.is_some()),
        ];
        for (k, on) in set {
            if on {
                out.push(k);
            }
        }
        out
    }

    /// The canonical form: the definition with its defaults filled in, keys sorted, the
    /// judge model reduced to what changes its answers. Two definitions that mean the same
    /// have the same canonical form.
    pub fn canonical(&self) -> serde_json::Value {
        let mut d = self.clone();
        match d.kind {
            Kind::Match => {
                d.mode.get_or_insert_with(|| "normalised".into());
                d.tolerance.get_or_insert(0.0);
            }
            Kind::Regex | Kind::Contains | Kind::NotContains => {
                d.require.get_or_insert_with(|| "all".into());
                d.ignore_case.get_or_insert(false);
            }
            Kind::Json => {
                if let Some(serde_json::Value::String(s)) = &d.schema
                    && let Ok(v) = serde_json::from_str::<serde_json::Value>(s)
                {
                    d.schema = Some(v);
                }
                if let Some(p) = &d.label_field {
                    d.label_field = Some(pointer(p));
                }
            }
            _ => {}
        }
        let model = d.model.take();
        let mut v = serde_json::to_value(&d).unwrap_or_default();
        if let (Some(m), Some(obj)) = (model, v.as_object_mut()) {
            let mut reduced = serde_json::json!({
                "provider": m.provider, "name": m.name, "temperature": m.temperature,
                "max_tokens": m.max_tokens, "system_prompt": m.system_prompt,
                "prompt_template": m.prompt_template, "params": m.params,
            });
            if let Some(r) = reduced.as_object_mut() {
                r.retain(|_, v| !v.is_null());
            }
            obj.insert("model".into(), reduced);
        }
        sort_keys(v)
    }

    /// `sha256(ENGINE_VERSION, canonical JSON)`, 12 hex digits.
    pub fn version(&self) -> String {
        let mut h = Sha256::new();
        h.update(ENGINE_VERSION.as_bytes());
        h.update([0u8]);
        h.update(self.canonical().to_string().as_bytes());
        hex::encode(h.finalize())[..12].to_string()
    }

    /// Checks the definition in full and builds its runtime rule.
    ///
    /// # Errors
    /// [`DefError`] naming the field at fault.
    fn compile(&self) -> Result<Rule, DefError> {
        let ok_name = !self.name.is_empty()
            && self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if !ok_name {
            return Err(self.err(
                "name",
                "a scorer name is letters, digits, `_`, `-` and `.` only",
            ));
        }
        if RESERVED.contains(&self.name.as_str()) {
            return Err(self.err(
                "name",
                format!("`{}` is a built-in scorer: choose another name", self.name),
            ));
        }
        for f in self.present() {
            if !self.kind.fields().contains(&f) {
                return Err(self.err(
                    f,
                    format!(
                        "a `{}` scorer does not read `{f}` (it reads {})",
                        self.kind.as_str(),
                        self.kind.fields().join(", ")
                    ),
                ));
            }
        }
        match self.kind {
            Kind::Sql => self.compile_sql(),
            Kind::Match => {
                let mode = match self.mode.as_deref().unwrap_or("normalised") {
                    "exact" => MatchMode::Exact,
                    "case_insensitive" => MatchMode::CaseInsensitive,
                    "normalised" => MatchMode::Normalised,
                    m => {
                        return Err(self.err(
                            "mode",
                            format!("`{m}` is not one of exact, case_insensitive, normalised"),
                        ));
                    }
                };
                let tolerance = self.tolerance.unwrap_or(0.0);
                if !(tolerance >= 0.0 && tolerance.is_finite()) {
                    return Err(self.err("tolerance", "must be a finite number >= 0"));
                }
                Ok(Rule::Match { mode, tolerance })
            }
            Kind::Regex | Kind::Contains | Kind::NotContains => self.compile_patterns(),
            Kind::Json => self.compile_json(),
            Kind::Judge => {
                let qs = self
                    .questions
                    .as_ref()
                    .filter(|q| !q.is_empty())
                    .ok_or_else(|| self.err("questions", "a judge scorer needs questions"))?;
                let mut ids = std::collections::HashSet::new();
                for q in qs {
                    if q.id.trim().is_empty() || !ids.insert(q.id.as_str()) {
                        return Err(self.err(
                            "questions",
                            format!("question id `{}` is empty or repeated", q.id),
                        ));
                    }
                }
                if let Some(m) = &self.model
                    && !crate::stages::call::KNOWN_PROVIDERS.contains(&m.provider.as_str())
                {
                    return Err(self.err("model", format!("unknown provider `{}`", m.provider)));
                }
                Ok(Rule::Judge(None))
            }
        }
    }

    fn compile_sql(&self) -> Result<Rule, DefError> {
        let sources = [self.score.clone(), self.label.clone(), self.passed.clone()];
        let needed = match self.metric {
            Metric::Numeric => 0,
            Metric::Label => 1,
            Metric::PassFail => 2,
        };
        if sources[needed].is_none() {
            return Err(self.err(
                SQL_FIELDS[needed],
                format!(
                    "a sql scorer with metric `{}` needs a `{}` expression",
                    match self.metric {
                        Metric::Numeric => "numeric",
                        Metric::Label => "label",
                        Metric::PassFail => "pass_fail",
                    },
                    SQL_FIELDS[needed]
                ),
            ));
        }
        let compiled = compile_exprs(&sources, &super::joined_schema())
            .map_err(|(i, msg)| self.err(SQL_FIELDS[i], msg))?;
        Ok(Rule::Sql(Box::new(SqlRule {
            sources,
            compiled: Mutex::new(compiled),
        })))
    }

    fn compile_patterns(&self) -> Result<Rule, DefError> {
        let patterns = self
            .patterns
            .as_ref()
            .filter(|p| !p.is_empty())
            .ok_or_else(|| {
                self.err(
                    "patterns",
                    format!("a `{}` scorer needs patterns", self.kind.as_str()),
                )
            })?;
        let all = match self.require.as_deref().unwrap_or("all") {
            "all" => true,
            "any" => false,
            r => return Err(self.err("require", format!("`{r}` is not `all` or `any`"))),
        };
        let ignore_case = self.ignore_case.unwrap_or(false);
        let mut regexes = Vec::new();
        let mut needles = Vec::new();
        for p in patterns {
            if self.kind == Kind::Regex {
                let r = regex::RegexBuilder::new(p)
                    .case_insensitive(ignore_case)
                    .build()
                    .map_err(|e| self.err("patterns", format!("invalid regex `{p}`: {e}")))?;
                regexes.push(r);
            } else {
                if p.is_empty() {
                    return Err(self.err("patterns", "an empty pattern is always contained"));
                }
                needles.push(if ignore_case {
                    p.to_lowercase()
                } else {
                    p.clone()
                });
            }
        }
        Ok(Rule::Patterns {
            kind: self.kind,
            regexes,
            needles,
            all,
            ignore_case,
        })
    }

    fn compile_json(&self) -> Result<Rule, DefError> {
        let raw = self
            .schema
            .as_ref()
            .ok_or_else(|| self.err("schema", "a json scorer needs a schema"))?;
        let schema = match raw {
            serde_json::Value::String(s) => {
                serde_json::from_str(s).map_err(|e| self.err("schema", format!("not JSON: {e}")))?
            }
            v => v.clone(),
        };
        if !(schema.is_object() || schema.is_boolean()) {
            return Err(self.err("schema", "a JSON Schema is an object (or true / false)"));
        }
        let loc = "http://evalflow.invalid/scorer.schema.json";
        let mut compiler = boon::Compiler::new();
        // A schema is self-contained: no file or network is read to resolve `$ref`.
        compiler.use_loader(Box::new(NoLoader));
        compiler
            .add_resource(loc, schema)
            .map_err(|e| self.err("schema", format!("{e:#}")))?;
        let mut schemas = boon::Schemas::new();
        let index = compiler
            .compile(loc, &mut schemas)
            .map_err(|e| self.err("schema", format!("invalid JSON Schema: {e:#}")))?;
        let pointer = self.label_field.as_deref().map(pointer);
        Ok(Rule::Json {
            schemas: Box::new(schemas),
            index,
            pointer,
        })
    }

    /// Builds the scorer (a judge scorer still needs [`prepare`] to fetch its answers).
    ///
    /// # Errors
    /// [`DefError`] when the definition is bad.
    pub fn build(&self) -> Result<UserScorer, DefError> {
        Ok(UserScorer {
            rule: self.compile()?,
            version: self.version(),
            canonical: self.canonical(),
            def: self.clone(),
        })
    }

    /// The definition as a TOML `[[scorer]]` table, as `evalflow scorers` prints it.
    /// `None` when TOML cannot hold it (a JSON `null` in a schema).
    pub fn to_toml(&self) -> Option<String> {
        #[derive(Serialize)]
        struct One<'a> {
            scorer: [&'a ScorerDef; 1],
        }
        toml::to_string(&One { scorer: [self] }).ok()
    }
}

/// `decision.kind` -> `/decision/kind`; a JSON pointer is kept.
fn pointer(p: &str) -> String {
    if p.starts_with('/') || p.is_empty() {
        p.to_string()
    } else {
        p.split('.')
            .map(|s| format!("/{}", s.replace('~', "~0").replace('/', "~1")))
            .collect()
    }
}

/// A JSON value with every object's keys in sorted order (whatever serde_json's map is).
fn sort_keys(v: serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            let sorted: BTreeMap<String, serde_json::Value> =
                m.into_iter().map(|(k, v)| (k, sort_keys(v))).collect();
            let mut out = serde_json::Map::new();
            for (k, v) in sorted {
                out.insert(k, v);
            }
            serde_json::Value::Object(out)
        }
        serde_json::Value::Array(a) => {
            serde_json::Value::Array(a.into_iter().map(sort_keys).collect())
        }
        other => other,
    }
}

struct NoLoader;

impl boon::UrlLoader for NoLoader {
    fn load(&self, url: &str) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
        Err(format!(
            "`{url}`: a scorer's schema must be self-contained ($ref within the schema only)"
        )
        .into())
    }
}

/// Compiles the SQL expressions against `schema`: each parsed, its columns and functions
/// resolved, and its type checked. `Err((field index, message))`.
fn compile_exprs(
    sources: &[Option<String>; 3],
    schema: &SchemaRef,
) -> Result<Compiled, (usize, String)> {
    let ctx = crate::query::new_context();
    let df_schema = DFSchema::try_from(schema.as_ref().clone()).map_err(|e| (0, e.to_string()))?;
    let mut logical = Vec::new();
    let mut used = std::collections::BTreeSet::new();
    for (i, src) in sources.iter().enumerate() {
        let Some(src) = src else { continue };
        let expr = ctx
            .parse_sql_expr(src, &df_schema)
            .map_err(|e| (i, format!("`{src}`: {}", e.strip_backtrace())))?;
        for c in expr.column_refs() {
            if let Ok(k) = schema.index_of(&c.name) {
                used.insert(k);
            }
        }
        logical.push((i, src, expr));
    }
    // A constant expression reads no column; one column still carries the row count.
    let columns: Vec<usize> = if used.is_empty() {
        vec![0]
    } else {
        used.into_iter().collect()
    };
    let projected = Arc::new(schema.project(&columns).map_err(|e| (0, e.to_string()))?);
    let df_projected =
        DFSchema::try_from(projected.as_ref().clone()).map_err(|e| (0, e.to_string()))?;
    let mut exprs: [Option<Arc<dyn PhysicalExpr>>; 3] = [None, None, None];
    for (i, src, expr) in logical {
        let phys = ctx
            .create_physical_expr(expr, &df_projected)
            .map_err(|e| (i, format!("`{src}`: {}", e.strip_backtrace())))?;
        let dt = phys
            .data_type(&projected)
            .map_err(|e| (i, format!("`{src}`: {}", e.strip_backtrace())))?;
        let fits = match i {
            0 => dt.is_numeric() || matches!(dt, DataType::Boolean | DataType::Null),
            1 => can_cast_types(&dt, &DataType::Utf8),
            _ => matches!(dt, DataType::Boolean | DataType::Null),
        };
        if !fits {
            let want = ["a number", "text", "a boolean"][i];
            return Err((i, format!("`{src}` returns {dt}, not {want}")));
        }
        exprs[i] = Some(phys);
    }
    Ok(Compiled {
        schema: schema.clone(),
        columns,
        exprs,
    })
}

fn same_schema(a: &SchemaRef, b: &SchemaRef) -> bool {
    a.fields().len() == b.fields().len()
        && a.fields()
            .iter()
            .zip(b.fields())
            .all(|(x, y)| x.name() == y.name() && x.data_type() == y.data_type())
}

impl SqlRule {
    /// Evaluates the expressions over the rows of `joined` where `valid` is true (only
    /// the columns they read are gathered): one outcome per valid row.
    fn score(&self, joined: &RecordBatch, valid: &BooleanArray) -> Result<Vec<Outcome>, String> {
        let compiled = {
            let mut c = self.compiled.lock().map_err(|e| e.to_string())?;
            if !same_schema(&c.schema, &joined.schema()) {
                *c = compile_exprs(&self.sources, &joined.schema())
                    .map_err(|(i, m)| format!("field `{}`: {m}", SQL_FIELDS[i]))?;
            }
            c.clone()
        };
        let batch = joined
            .project(&compiled.columns)
            .and_then(|b| datafusion::arrow::compute::filter_record_batch(&b, valid))
            .map_err(|e| e.to_string())?;
        let batch = &batch;
        let n = batch.num_rows();
        let eval = |i: usize, to: &DataType| -> Result<Option<ArrayRef>, String> {
            let Some(e) = &compiled.exprs[i] else {
                return Ok(None);
            };
            let a = e
                .evaluate(batch)
                .and_then(|v| v.into_array(n))
                .map_err(|e| format!("field `{}`: {}", SQL_FIELDS[i], e.strip_backtrace()))?;
            cast(&a, to)
                .map(Some)
                .map_err(|e| format!("field `{}`: {e}", SQL_FIELDS[i]))
        };
        let score = eval(0, &DataType::Float64)?;
        let label = eval(1, &DataType::Utf8)?;
        let passed = eval(2, &DataType::Boolean)?;
        let score = score.as_ref().map(|a| {
            a.as_any()
                .downcast_ref::<Float64Array>()
                .expect("cast to Float64")
        });
        let label = label.as_ref().map(|a| {
            a.as_any()
                .downcast_ref::<StringArray>()
                .expect("cast to Utf8")
        });
        let passed = passed.as_ref().map(|a| {
            a.as_any()
                .downcast_ref::<BooleanArray>()
                .expect("cast to Boolean")
        });
        let out = (0..n)
            .map(|r| {
                let s = score.and_then(|a| a.is_valid(r).then(|| a.value(r)));
                let l = label.and_then(|a| a.is_valid(r).then(|| a.value(r).to_string()));
                let p = passed.and_then(|a| a.is_valid(r).then(|| a.value(r)));
                Outcome {
                    score: s,
                    label: l,
                    passed: p,
                    ..Outcome::default()
                }
            })
            .collect();
        Ok(out)
    }
}

/// Reads a number the way answers write one: `4.99`, `$4.99`, `12%`, ` 5 `.
fn number(s: &str) -> Option<f64> {
    let t = s
        .trim()
        .trim_start_matches(['$', '€', '£'])
        .trim_end_matches('%')
        .trim();
    t.parse::<f64>().ok().filter(|v| v.is_finite())
}

fn match_form(s: &str, mode: MatchMode) -> String {
    match mode {
        MatchMode::Exact => s.trim().to_string(),
        MatchMode::CaseInsensitive => s.trim().to_lowercase(),
        MatchMode::Normalised => {
            normalise_label(&s.split_whitespace().collect::<Vec<_>>().join(" "))
        }
    }
}

/// The text of a JSON answer: trimmed, without a surrounding Markdown code fence.
fn json_text(s: &str) -> &str {
    let t = s.trim();
    if let Some(rest) = t.strip_prefix("```")
        && let Some(body) = rest.strip_suffix("```")
    {
        // Drop the fence's info string (`json`) on its first line.
        return body.split_once('\n').map_or(body, |(_, b)| b).trim();
    }
    t
}

/// Sets the verdict of a boolean rule: `passed`, score 1.0 / 0.0.
fn verdict(passed: bool, label: String, detail: serde_json::Value) -> Outcome {
    Outcome {
        score: Some(if passed { 1.0 } else { 0.0 }),
        passed: Some(passed),
        label: Some(label),
        detail,
        ..Outcome::default()
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
        vec![
            super::source_logic(include_str!("user.rs")),
            self.canonical.to_string(),
        ]
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
