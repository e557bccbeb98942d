//! User scorer definitions as data: a `[[scorer]]` table as written, where it was read, its
//! canonical form and the version hashed from it. The code that checks and runs a definition
//! lives in `stages::score::user`; this is what the configuration and every stage can read.

use std::collections::BTreeMap;

use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use toml::Spanned;

use super::{JudgeQuestion, ModelConfig};

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
    pub(crate) fn fields(self) -> &'static [&'static str] {
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
    /// A label that makes a new version (hashed like everything else): for a change the
    /// definition does not show, such as a judge model served at another endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
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

/// The spans of every `[[scorer]]` key (a lenient parse: other top-level keys ignored).
#[derive(Debug, Default, Deserialize)]
struct SpanFile {
    #[serde(default)]
    scorer: Vec<BTreeMap<String, Spanned<IgnoredAny>>>,
}

pub(crate) fn line_of_offset(s: &str, offset: usize) -> usize {
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

impl ScorerDef {
    pub(crate) fn line(&self, field: &str) -> usize {
        self.origin
            .fields
            .get(field)
            .copied()
            .unwrap_or(self.origin.line)
    }

    pub(crate) fn err(&self, field: &str, msg: impl Into<String>) -> DefError {
        DefError {
            file: self.origin.file.clone(),
            line: self.line(field),
            scorer: self.name.clone(),
            field: field.to_string(),
            msg: msg.into(),
        }
    }

    /// The fields set in this definition.
    pub(crate) fn present(&self) -> Vec<&'static str> {
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
pub(crate) fn pointer(p: &str) -> String {
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
