//! The pipeline file: a TOML document naming the suite, the model under test and the
//! options of each stage.
//!
//! Parsing is strict (`deny_unknown_fields`): a misspelt key is an error naming the file,
//! line and key, never a silently ignored option.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use toml::Spanned;

pub use crate::config::{JudgeChecklist, JudgeQuestion, KNOWN_PROVIDERS, ModelConfig};

/// Errors in a pipeline file. Every variant names the file and, where known, the line.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {msg}", at(.file, *.line))]
    Parse {
        file: String,
        line: usize,
        msg: String,
    },
    #[error("{}: field `{field}`: {msg}", at(.file, *.line))]
    Invalid {
        file: String,
        line: usize,
        field: String,
        msg: String,
    },
}

pub(crate) use crate::config::at;
pub use crate::stages::score::def_message;

/// A parsed pipeline file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Pipeline {
    #[serde(default)]
    pub run: RunConfig,
    pub model: ModelConfig,
    /// A judge model, for judge scorers (same keys as `[model]`).
    pub judge: Option<ModelConfig>,
    /// The model that rewrites base cases for the `rephrase` perturbation and answers
    /// `evalflow suggest` (same keys as `[model]`; default: `[judge]`, then `[model]`).
    pub rephrase: Option<ModelConfig>,
    pub suite: SuiteConfig,
    /// Named word lists shared by every test of the suite.
    #[serde(default)]
    pub lexicons: BTreeMap<String, Vec<String>>,
    #[serde(default, rename = "test")]
    pub tests: Vec<TestConfig>,
    #[serde(default)]
    pub validate: ValidateConfig,
    #[serde(default)]
    pub score: ScoreConfig,
    #[serde(default, skip_serializing_if = "AggregateConfig::is_default")]
    pub aggregate: AggregateConfig,
    /// User scorers written as data (`[[scorer]]`), followed by those of
    /// `[score] scorer_files`: each is run by `evalflow run` and `evalflow score` after the
    /// `[score] scorers` that do not name it (data: `config::scorer`; run by `stages::score::user`).
    #[serde(default, rename = "scorer", skip_serializing_if = "Vec::is_empty")]
    pub user_scorers: Vec<crate::config::scorer::ScorerDef>,
    /// Where the file was read from (not part of the TOML).
    #[serde(skip)]
    pub path: PathBuf,
    /// The file's text, for hashing and for locating lines in error messages.
    #[serde(skip)]
    pub source: String,
    /// Where each lexicon (own or included) was defined.
    #[serde(skip)]
    pub lexicon_origins: BTreeMap<String, LexiconOrigin>,
    /// The text of every included file, for the pipeline hash.
    #[serde(skip)]
    pub included_sources: Vec<String>,
    /// The line of each checked field (`model.provider`, `score.scorers`, `lexicons.NAME`),
    /// from the TOML parser's spans: an error points at the key itself, not at the first
    /// text that looks like it.
    #[serde(skip)]
    field_lines: BTreeMap<String, usize>,
}

/// Where the checked fields sit in the file: a second, lenient parse that keeps spans.
#[derive(Debug, Default, Deserialize)]
struct Spans {
    #[serde(default)]
    lexicons: BTreeMap<String, Spanned<IgnoredAny>>,
    model: Option<ModelSpans>,
    judge: Option<ModelSpans>,
    rephrase: Option<ModelSpans>,
    score: Option<ScoreSpans>,
}

#[derive(Debug, Default, Deserialize)]
struct ModelSpans {
    provider: Option<Spanned<IgnoredAny>>,
    base_url: Option<Spanned<IgnoredAny>>,
    name: Option<Spanned<IgnoredAny>>,
    api_key_env: Option<Spanned<IgnoredAny>>,
    max_tokens: Option<Spanned<IgnoredAny>>,
    temperature: Option<Spanned<IgnoredAny>>,
    timeout_secs: Option<Spanned<IgnoredAny>>,
    samples: Option<Spanned<IgnoredAny>>,
    concurrency: Option<Spanned<IgnoredAny>>,
    batch: Option<Spanned<IgnoredAny>>,
}

#[derive(Debug, Default, Deserialize)]
struct ScoreSpans {
    scorers: Option<Spanned<IgnoredAny>>,
    judge: Option<JudgeSpans>,
}

#[derive(Debug, Default, Deserialize)]
struct JudgeSpans {
    questions: Option<Spanned<IgnoredAny>>,
}

impl Spans {
    /// `field -> line` for every span found in `source`.
    fn lines(self, source: &str) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        let mut put = |field: String, s: &Option<Spanned<IgnoredAny>>| {
            if let Some(s) = s {
                out.insert(field, line_of_offset(source, s.span().start));
            }
        };
        for (name, s) in &self.lexicons {
            put(format!("lexicons.{name}"), &Some(s.clone()));
        }
        for (key, m) in [
            ("model", &self.model),
            ("judge", &self.judge),
            ("rephrase", &self.rephrase),
        ] {
            if let Some(m) = m {
                put(format!("{key}.provider"), &m.provider);
                put(format!("{key}.base_url"), &m.base_url);
                put(format!("{key}.name"), &m.name);
                put(format!("{key}.api_key_env"), &m.api_key_env);
                put(format!("{key}.max_tokens"), &m.max_tokens);
                put(format!("{key}.temperature"), &m.temperature);
                put(format!("{key}.timeout_secs"), &m.timeout_secs);
                put(format!("{key}.samples"), &m.samples);
                put(format!("{key}.concurrency"), &m.concurrency);
                put(format!("{key}.batch"), &m.batch);
            }
        }
        if let Some(sc) = &self.score {
            put("score.scorers".into(), &sc.scorers);
            if let Some(j) = &sc.judge {
                put("score.judge.questions".into(), &j.questions);
            }
        }
        out
    }
}

/// `[run]`: naming of runs.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Prefix of generated run ids (default: the suite name).
    pub name: Option<String>,
    /// Memory every query may use before spilling (`1GiB`, `512MB`); `--memory-limit` wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit: Option<String>,
}

impl RunConfig {
    /// `memory_limit` in bytes, if set.
    pub fn memory_limit_bytes(&self) -> Result<Option<usize>, String> {
        self.memory_limit
            .as_deref()
            .map(crate::query::parse_bytes)
            .transpose()
    }
}

/// `[suite]`: the CheckList suite's global options.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SuiteConfig {
    pub name: String,
    /// Seed for sampling and perturbations; the same seed gives the same cases.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Cap on base cases per test after expansion (seeded sample when exceeded).
    #[serde(default = "default_max_cases")]
    pub max_cases_per_test: usize,
    /// A template whose cartesian expansion exceeds this is an error, not a slow run.
    #[serde(default = "default_blowup")]
    pub max_expansion: u64,
    /// Lexicon files (TOML with a `[lexicons]` table), relative to this file, shared
    /// across suites: `include = ["lexicons/common.toml"]`.
    #[serde(default)]
    pub include: Vec<String>,
}

fn default_seed() -> u64 {
    42
}
fn default_max_cases() -> usize {
    500
}
fn default_blowup() -> u64 {
    1_000_000
}

/// A perturbation, written either as a name (`"typos"`) or as a table with options.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum PerturbSpec {
    Name(String),
    Table {
        op: String,
        /// `add_prefix` / `add_suffix` / `remove_phrase`: the phrases (one picked per
        /// variant, seeded).
        #[serde(default)]
        phrases: Vec<String>,
        /// How many typos, swaps, etc. to apply per perturbed case.
        #[serde(default)]
        count: Option<usize>,
        /// DIR: the label the perturbed case should get (e.g. a support bot's decision
        /// after a detail is added); written to `cases.expected` of perturbed rows.
        #[serde(default)]
        expected: Option<String>,
        /// `rephrase`: which model rewrites the text: `rephrase` (the `[rephrase]` table,
        /// the default when present), `judge` or `model`.
        #[serde(default)]
        model: Option<String>,
        /// `rephrase`: the instruction; `{text}` is replaced by the base case.
        #[serde(default)]
        prompt: Option<String>,
    },
}

impl PerturbSpec {
    pub fn op(&self) -> &str {
        match self {
            PerturbSpec::Name(n) => n,
            PerturbSpec::Table { op, .. } => op,
        }
    }

    /// The label written to `expected` on perturbed cases, if the spec names one.
    pub fn expected(&self) -> Option<&str> {
        match self {
            PerturbSpec::Table { expected, .. } => expected.as_deref(),
            PerturbSpec::Name(_) => None,
        }
    }
}

/// A template: a string, or a table giving the template its own expected label
/// (`{ text = "Where is my order {n}?", expected = "tracking" }`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum TemplateSpec {
    Text(String),
    Labelled {
        text: String,
        expected: Option<String>,
    },
}

impl TemplateSpec {
    pub fn text(&self) -> &str {
        match self {
            TemplateSpec::Text(t) | TemplateSpec::Labelled { text: t, .. } => t,
        }
    }

    pub fn expected(&self) -> Option<&str> {
        match self {
            TemplateSpec::Labelled { expected, .. } => expected.as_deref(),
            TemplateSpec::Text(_) => None,
        }
    }
}

/// Base cases read from an unlabelled dataset instead of templates:
/// `source = { file = "data/tweets.csv", column = "text" }`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SourceSpec {
    /// CSV (with a header row), JSONL or Parquet, by extension; relative to the pipeline file.
    pub file: String,
    /// The text column (CSV header, JSON key or Parquet column).
    pub column: String,
    /// Overrides the format guessed from the extension: `csv`, `jsonl` or `parquet`.
    pub format: Option<String>,
}

/// One `[[test]]`: a capability, a test type and templates (or a source dataset).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TestConfig {
    pub name: String,
    pub capability: String,
    #[serde(rename = "type")]
    pub test_type: String,
    #[serde(default)]
    pub templates: Vec<TemplateSpec>,
    /// INV/DIR: base cases from an unlabelled dataset (needs no labels).
    pub source: Option<SourceSpec>,
    /// MFT: the expected label; `a|b` accepts either. A labelled template overrides it.
    pub expected: Option<String>,
    /// DIR: `not_more_positive`, `not_less_positive`, `more_positive`, `less_positive`.
    pub expectation: Option<String>,
    /// INV/DIR: how far the score may move before the case fails (default `[score] tolerance`).
    pub tolerance: Option<f64>,
    /// INV/DIR: the perturbation applied to each base case.
    pub perturb: Option<PerturbSpec>,
    /// INV/DIR: perturbed variants per base case.
    #[serde(default = "default_n_perturb")]
    pub n_perturb: usize,
    /// Base cases for this test (default `suite.max_cases_per_test`); templates are
    /// expanded in full when they fit, else sampled with the suite seed.
    pub max_cases: Option<usize>,
    pub description: Option<String>,
}

fn default_n_perturb() -> usize {
    2
}

/// A lexicon included from another file (`[suite] include`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct LexiconFile {
    #[serde(default)]
    lexicons: BTreeMap<String, Vec<String>>,
}

/// Where a lexicon was defined, for error messages.
#[derive(Debug, Clone, Serialize, Default)]
pub struct LexiconOrigin {
    pub file: String,
    pub line: usize,
}

/// `[validate]`: which answer languages the scorers cover.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ValidateConfig {
    /// Accepted answer languages; default: every language the pipeline's scorers read
    /// (see [`Pipeline::languages`]).
    #[serde(default)]
    pub languages: Option<Vec<String>>,
}

/// `[aggregate]`: how the results' intervals are made.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AggregateConfig {
    /// A stated latent (logit-scale) ICC of the templates, in [0, 1): each failure rate's
    /// interval also covers the exact interval under a logit-normal template model at this ICC
    /// (`clustered_mean_ci(x, t, 0.95, 'auto; icc=R')`, docs/intervals.md). Default: none.
    pub icc: Option<f64>,
}

impl AggregateConfig {
    fn is_default(&self) -> bool {
        self == &AggregateConfig::default()
    }
}

/// `[score]`: scorer options.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ScoreConfig {
    /// INV/DIR tolerance when a test names none (0.1, as in CheckList).
    #[serde(default = "default_tolerance")]
    pub tolerance: f64,
    /// Scorers run by `evalflow run` and `evalflow score`; the first one is aggregated.
    #[serde(default = "default_scorers")]
    pub scorers: Vec<String>,
    /// A TOML file replacing the cue scorer's cue lists (relative to the pipeline file).
    pub cues: Option<PathBuf>,
    /// A hand-labelled holdout (CSV `call_id,label`, relative to the pipeline file): when
    /// set, `evalflow run` prints Rogan-Gladen corrected class rates of the first scorer.
    pub holdout: Option<PathBuf>,
    /// The judge checklist (CheckEval): YES/NO questions the `[judge]` model answers.
    pub judge: Option<JudgeChecklist>,
    /// Scorer files (TOML of `[[scorer]]` tables, relative to the pipeline file) whose
    /// scorers join the pipeline's own. Their text is not part of the pipeline hash: a
    /// changed scorer file scores the same run again under a new version.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scorer_files: Vec<PathBuf>,
}

impl Default for ScoreConfig {
    fn default() -> Self {
        Self {
            tolerance: default_tolerance(),
            scorers: default_scorers(),
            cues: None,
            holdout: None,
            judge: None,
            scorer_files: Vec::new(),
        }
    }
}

fn default_scorers() -> Vec<String> {
    vec!["checklist".into()]
}

fn default_tolerance() -> f64 {
    0.1
}

pub const TEST_TYPES: [&str; 3] = ["MFT", "INV", "DIR"];
pub const DIR_EXPECTATIONS: [&str; 4] = [
    "not_more_positive",
    "not_less_positive",
    "more_positive",
    "less_positive",
];

impl Pipeline {
    /// Reads and checks a pipeline file.
    ///
    /// # Errors
    /// [`PipelineError`] naming the file, line and field of the first problem.
    pub fn load(path: &Path) -> Result<Self, PipelineError> {
        let file = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| PipelineError::Read {
            file: file.clone(),
            source,
        })?;
        let source = utf8_text(bytes, &file)?;
        Self::parse(&source, path)
    }

    /// Parses pipeline text; `path` is used for messages and relative paths.
    pub fn parse(source: &str, path: &Path) -> Result<Self, PipelineError> {
        let file = path.display().to_string();
        let mut p: Pipeline = toml::from_str(source).map_err(|e| PipelineError::Parse {
            file: file.clone(),
            line: e
                .span()
                .map(|s| line_of_offset(source, s.start))
                .unwrap_or(0),
            msg: e.message().to_string(),
        })?;
        p.path = path.to_path_buf();
        p.source = source.to_string();
        // The strict parse above succeeded, so this lenient one does too.
        p.field_lines = toml::from_str::<Spans>(source)
            .unwrap_or_default()
            .lines(source);
        for name in p.lexicons.keys() {
            p.lexicon_origins.insert(
                name.clone(),
                LexiconOrigin {
                    file: file.clone(),
                    line: p.field_line(&format!("lexicons.{name}")),
                },
            );
        }
        crate::config::scorer::attach_origins(&mut p.user_scorers, source, &file);
        p.load_includes()?;
        p.load_scorer_files()?;
        p.check()?;
        Ok(p)
    }

    /// A stable hash of the pipeline text (and of the files it includes).
    /// The answer languages validate accepts: `[validate] languages`, else the union of the
    /// languages the `[score] scorers` read (an answer in another language is
    /// `unscorable_language`, so the default never rejects what a scorer of the run reads).
    pub fn languages(&self) -> Vec<String> {
        if let Some(l) = &self.validate.languages {
            return l.clone();
        }
        let mut out: Vec<String> = Vec::new();
        for name in &self.score.scorers {
            let name = name.split('@').next().unwrap_or(name);
            for l in crate::stages::score::languages_of(name) {
                if !out.iter().any(|o| o == l) {
                    out.push(l.to_string());
                }
            }
        }
        if out.is_empty() {
            out.push("en".into());
        }
        out
    }

    pub fn hash(&self) -> String {
        let mut h = Sha256::new();
        h.update(self.source.as_bytes());
        for inc in &self.included_sources {
            h.update([0u8]);
            h.update(inc.as_bytes());
        }
        hex::encode(h.finalize())[..16].to_string()
    }

    /// A path named in this file, resolved against the file's folder.
    pub fn resolve(&self, rel: &str) -> PathBuf {
        let p = Path::new(rel);
        if p.is_absolute() {
            return p.to_path_buf();
        }
        self.path
            .parent()
            .map(|d| d.join(p))
            .unwrap_or_else(|| p.to_path_buf())
    }

    /// Checks `[run]`.
    fn check_run(&self) -> Result<(), PipelineError> {
        self.run
            .memory_limit_bytes()
            .map_err(|m| self.invalid("memory_limit", "run.memory_limit", m))?;
        Ok(())
    }

    /// Reads `[suite] include` files into `lexicons`.
    fn load_includes(&mut self) -> Result<(), PipelineError> {
        for inc in self.suite.include.clone() {
            let path = self.resolve(&inc);
            let file = path.display().to_string();
            let text = std::fs::read(&path).map_err(|source| {
                let line = self.line_of(&format!("\"{inc}\""));
                PipelineError::Invalid {
                    file: self.path.display().to_string(),
                    line,
                    field: "suite.include".into(),
                    msg: format!("cannot read `{file}`: {source}"),
                }
            })?;
            let text = utf8_text(text, &file)?;
            let lf: LexiconFile = toml::from_str(&text).map_err(|e| PipelineError::Parse {
                file: file.clone(),
                line: e
                    .span()
                    .map(|s| line_of_offset(&text, s.start))
                    .unwrap_or(0),
                msg: e.message().to_string(),
            })?;
            let lines = toml::from_str::<Spans>(&text)
                .unwrap_or_default()
                .lines(&text);
            for (name, words) in lf.lexicons {
                let line = lines.get(&format!("lexicons.{name}")).copied().unwrap_or(0);
                if let Some(prev) = self.lexicon_origins.get(&name) {
                    return Err(PipelineError::Invalid {
                        file: file.clone(),
                        line,
                        field: format!("lexicons.{name}"),
                        msg: format!(
                            "lexicon `{name}` is already defined at {}:{}",
                            prev.file, prev.line
                        ),
                    });
                }
                self.lexicon_origins.insert(
                    name.clone(),
                    LexiconOrigin {
                        file: file.clone(),
                        line,
                    },
                );
                self.lexicons.insert(name, words);
            }
            self.included_sources.push(text);
        }
        Ok(())
    }

    /// Appends the scorers of `[score] scorer_files` to the pipeline's own.
    fn load_scorer_files(&mut self) -> Result<(), PipelineError> {
        for f in self.score.scorer_files.clone() {
            let path = self.resolve(&f.display().to_string());
            let text = std::fs::read(&path).map_err(|source| PipelineError::Invalid {
                file: self.path.display().to_string(),
                line: self.line_of("scorer_files"),
                field: "score.scorer_files".into(),
                msg: format!("cannot read `{}`: {source}", path.display()),
            })?;
            let file = path.display().to_string();
            let text = utf8_text(text, &file)?;
            let defs = crate::stages::score::user::parse_text(&text, &file).map_err(def_error)?;
            self.user_scorers.extend(defs);
        }
        Ok(())
    }

    /// The user scorer named `name` (`[[scorer]]` or a scorer file).
    pub fn user_scorer(&self, name: &str) -> Option<&crate::config::scorer::ScorerDef> {
        self.user_scorers.iter().find(|d| d.name == name)
    }

    /// The 1-based line where `needle` first appears (0 when it does not).
    pub fn line_of(&self, needle: &str) -> usize {
        self.source
            .find(needle)
            .map(|i| line_of_offset(&self.source, i))
            .unwrap_or(0)
    }

    /// The line of a checked field (`model.provider`, `lexicons.NAME`; 0 when absent).
    fn field_line(&self, field: &str) -> usize {
        self.field_lines.get(field).copied().unwrap_or(0)
    }

    /// An error naming this file, `field` and its line (from the parser's spans).
    fn at(&self, field: &str, msg: impl Into<String>) -> PipelineError {
        PipelineError::Invalid {
            file: self.path.display().to_string(),
            line: self.field_line(field),
            field: field.to_string(),
            msg: msg.into(),
        }
    }

    /// An error naming this file, the line of `needle`, and `field`.
    pub fn invalid(&self, needle: &str, field: &str, msg: impl Into<String>) -> PipelineError {
        PipelineError::Invalid {
            file: self.path.display().to_string(),
            line: self.line_of(needle),
            field: field.to_string(),
            msg: msg.into(),
        }
    }

    /// Checks a `[model]`-shaped table (`[model]`, `[judge]`, `[rephrase]`).
    fn check_model(&self, key: &str, m: &ModelConfig) -> Result<(), PipelineError> {
        if !KNOWN_PROVIDERS.contains(&m.provider.as_str()) {
            return Err(self.at(
                &format!("{key}.provider"),
                format!(
                    "unknown provider `{}` (known: {})",
                    m.provider,
                    KNOWN_PROVIDERS.join(", ")
                ),
            ));
        }
        if m.samples == 0 {
            return Err(self.at(&format!("{key}.samples"), "must be at least 1"));
        }
        if m.concurrency == 0 {
            return Err(self.at(&format!("{key}.concurrency"), "must be at least 1"));
        }
        if let Some((field, msg)) = m.problem() {
            return Err(self.model_at(key, field, msg));
        }
        Ok(())
    }

    /// An error at `key.field`, or at `key.provider` when the field is not written (an
    /// Anthropic model without `max_tokens`).
    fn model_at(&self, key: &str, field: &str, msg: String) -> PipelineError {
        let mut e = self.at(&format!("{key}.{field}"), msg);
        if let PipelineError::Invalid { line: line @ 0, .. } = &mut e {
            *line = self.field_line(&format!("{key}.provider"));
        }
        e
    }

    /// Checks the model table of each judge scorer written as data (`[[scorer]] model`).
    fn check_scorer_models(&self) -> Result<(), PipelineError> {
        for d in self.user_scorers.iter() {
            // An unknown provider is the scorer compiler's error (`scorer.model`).
            let Some(m) = d
                .model
                .as_ref()
                .filter(|m| KNOWN_PROVIDERS.contains(&m.provider.as_str()))
            else {
                continue;
            };
            if let Some((field, msg)) = m.problem() {
                return Err(scorer_model_error(d, field, msg));
            }
        }
        Ok(())
    }

    /// Before a command sends a request: the key variable (`api_key_env`) of each model
    /// table in `tables` (`model`, `judge`, `rephrase`), and of the judge scorers' own models
    /// when `scorers`, is set. Only providers that send a key are checked, and an omitted
    /// `api_key_env` sends none; the message names the variable, never its value.
    ///
    /// # Errors
    /// [`PipelineError::Invalid`] at the table's `api_key_env` line.
    pub fn check_keys(&self, tables: &[&str], scorers: bool) -> Result<(), PipelineError> {
        for &key in tables {
            let m = match key {
                "model" => Some(&self.model),
                "judge" => self.judge.as_ref(),
                "rephrase" => self.rephrase.as_ref(),
                _ => None,
            };
            if let Some(msg) = m.and_then(ModelConfig::key_problem) {
                return Err(self.model_at(key, "api_key_env", msg));
            }
        }
        for d in self.user_scorers.iter().filter(|_| scorers) {
            if let Some(msg) = d.model.as_ref().and_then(ModelConfig::key_problem) {
                return Err(scorer_model_error(d, "api_key_env", msg));
            }
        }
        Ok(())
    }

    /// Checks `[score]`: at least one scorer (the first is aggregated), and what a judge
    /// scorer needs, so nothing fails (or scores every row 0) after the run has started.
    fn check_score(&self) -> Result<(), PipelineError> {
        let sc = &self.score;
        if sc.scorers.is_empty() {
            return Err(self.at(
                "score.scorers",
                "needs at least one scorer (the first one is aggregated), e.g. [\"checklist\"]",
            ));
        }
        if let Some(j) = &sc.judge {
            if j.questions.is_empty() {
                return Err(self.at(
                    "score.judge.questions",
                    "the judge checklist needs at least one question",
                ));
            }
            let mut ids = std::collections::HashSet::new();
            for q in &j.questions {
                if q.id.trim().is_empty() || !ids.insert(q.id.as_str()) {
                    return Err(self.at(
                        "score.judge.questions",
                        format!("question id `{}` is empty or repeated", q.id),
                    ));
                }
            }
        }
        self.check_scorer_names()?;
        if sc
            .scorers
            .iter()
            .any(|n| n == "judge" || n.starts_with("judge@"))
        {
            if sc.judge.is_none() {
                return Err(self.at(
                    "score.scorers",
                    "the judge scorer needs a [score.judge] checklist of questions",
                ));
            }
            if self.judge.is_none() {
                return Err(self.at("score.scorers", "the judge scorer needs a [judge] model"));
            }
        }
        Ok(())
    }

    /// Resolves every name of `[score] scorers` as the runner will (a user scorer, the
    /// judge, or a built-in scorer at this build's version, with its cue lists read), so a
    /// typo fails before generate runs or a single call is paid for.
    fn check_scorer_names(&self) -> Result<(), PipelineError> {
        let cues = self
            .score
            .cues
            .as_ref()
            .map(|c| self.resolve(&c.display().to_string()));
        for name in &self.score.scorers {
            if self.user_scorer(name).is_some() || name == "judge" || name.starts_with("judge@") {
                continue;
            }
            match crate::stages::score::build(name, cues.as_deref()) {
                Ok(_) => {}
                Err(crate::stages::score::ScorerError::Unknown(..)) => {
                    let mut known: Vec<&str> = crate::stages::score::NAMES.to_vec();
                    known.extend(self.user_scorers.iter().map(|d| d.name.as_str()));
                    return Err(self.at(
                        "score.scorers",
                        format!("unknown scorer `{name}` (known: {})", known.join(", ")),
                    ));
                }
                Err(e) => return Err(self.at("score.scorers", e.to_string())),
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), PipelineError> {
        self.check_run()?;
        self.check_model("model", &self.model)?;
        if let Some(m) = &self.judge {
            self.check_model("judge", m)?;
        }
        if let Some(m) = &self.rephrase {
            self.check_model("rephrase", m)?;
        }
        self.check_score()?;
        if let Some(r) = self.aggregate.icc.filter(|r| !(0.0..1.0).contains(r)) {
            return Err(self.invalid(
                "icc",
                "aggregate.icc",
                format!("a latent ICC is in [0, 1), got {r}"),
            ));
        }
        self.check_scorer_models()?;
        crate::stages::score::user::check_all(&self.user_scorers).map_err(def_error)?;
        crate::stages::score::sql_check::check_defs(&self.user_scorers).map_err(def_error)?;
        let mut seen = std::collections::HashSet::new();
        for t in &self.tests {
            let needle = format!("\"{}\"", t.name);
            if !seen.insert(t.name.as_str()) {
                return Err(self.invalid(
                    &needle,
                    "test.name",
                    format!("duplicate test name `{}`", t.name),
                ));
            }
            if !TEST_TYPES.contains(&t.test_type.as_str()) {
                return Err(self.invalid(
                    &needle,
                    "test.type",
                    format!("`{}` is not one of MFT, INV, DIR", t.test_type),
                ));
            }
            match (&t.source, t.templates.is_empty()) {
                (None, true) => {
                    return Err(self.invalid(
                        &needle,
                        "test.templates",
                        "a test needs at least one template (or an INV/DIR `source` dataset)",
                    ));
                }
                (Some(_), false) => {
                    return Err(self.invalid(
                        &needle,
                        "test.source",
                        "a test takes its base cases from `templates` or from `source`, not both",
                    ));
                }
                (Some(_), true) if t.test_type == "MFT" => {
                    return Err(self.invalid(
                        &needle,
                        "test.source",
                        "a `source` dataset has no labels: use it in INV or DIR tests",
                    ));
                }
                _ => {}
            }
            if t.n_perturb == 0 && t.test_type != "MFT" {
                return Err(self.invalid(&needle, "test.n_perturb", "must be at least 1"));
            }
            match t.test_type.as_str() {
                "MFT"
                    if t.expected.is_none()
                        && t.templates.iter().any(|tp| tp.expected().is_none()) =>
                {
                    return Err(self.invalid(
                        &needle,
                        "test.expected",
                        "an MFT test needs an expected label",
                    ));
                }
                "INV" | "DIR" if t.perturb.is_none() => {
                    return Err(self.invalid(
                        &needle,
                        "test.perturb",
                        format!("an {} test needs a perturbation", t.test_type),
                    ));
                }
                "DIR" => {
                    let e = t.expectation.as_deref().unwrap_or("");
                    if !DIR_EXPECTATIONS.contains(&e) {
                        return Err(self.invalid(
                            &needle,
                            "test.expectation",
                            format!(
                                "a DIR test needs an expectation, one of {}",
                                DIR_EXPECTATIONS.join(", ")
                            ),
                        ));
                    }
                }
                _ => {}
            }
        }
        for (name, words) in &self.lexicons {
            if words.is_empty() {
                let o = self.lexicon_origins.get(name).cloned().unwrap_or_default();
                return Err(PipelineError::Invalid {
                    file: o.file,
                    line: o.line,
                    field: format!("lexicons.{name}"),
                    msg: "lexicon is empty".into(),
                });
            }
        }
        Ok(())
    }
}

/// A bad user scorer as a pipeline error: its file, line and `scorer.<field>`.
fn def_error(e: crate::config::scorer::DefError) -> PipelineError {
    if e.field == "?" {
        return PipelineError::Parse {
            file: e.file,
            line: e.line,
            msg: e.msg,
        };
    }
    PipelineError::Invalid {
        file: e.file,
        line: e.line,
        field: format!("scorer.{}", e.field),
        msg: if e.scorer.is_empty() || e.scorer == "?" {
            e.msg
        } else {
            format!("scorer `{}`: {}", e.scorer, e.msg)
        },
    }
}

/// A bad field of a judge scorer's `model` table: the scorer's file, the line of its
/// `model` key, and `scorer.model.<field>`.
fn scorer_model_error(
    d: &crate::config::scorer::ScorerDef,
    field: &str,
    msg: String,
) -> PipelineError {
    PipelineError::Invalid {
        file: d.origin.file.clone(),
        line: d.line("model"),
        field: format!("scorer.model.{field}"),
        msg: format!("scorer `{}`: {msg}", d.name),
    }
}

fn line_of_offset(s: &str, offset: usize) -> usize {
    s[..offset.min(s.len())].matches('\n').count() + 1
}

/// The text of a file that must be UTF-8; otherwise an error naming the line and column of
/// the first invalid byte.
fn utf8_text(bytes: Vec<u8>, file: &str) -> Result<String, PipelineError> {
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let valid = &e.as_bytes()[..at];
        let line = valid.iter().filter(|&&b| b == b'\n').count() + 1;
        let column = at - valid.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) + 1;
        PipelineError::Parse {
            file: file.to_string(),
            line,
            msg: format!("column {column}: invalid UTF-8 (the file must be UTF-8 text)"),
        }
    })
}

#[cfg(test)]
mod tests;
