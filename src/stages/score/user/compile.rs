//! Checking a user scorer definition in full and compiling it into its rule: SQL planned into
//! physical expressions over the joined row, regexes and JSON Schemas compiled; and the
//! helpers that evaluate a rule on an answer.

use super::*;

pub(super) enum Rule {
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
pub(super) enum MatchMode {
    Exact,
    CaseInsensitive,
    Normalised,
}

/// A SQL scorer's compiled expressions, for the schema they were compiled against; a
/// batch of another schema (a run written by another evalflow) compiles them again once.
pub(super) struct SqlRule {
    pub(super) sources: [Option<String>; 3],
    pub(super) compiled: Mutex<Compiled>,
}

#[derive(Clone)]
pub(super) struct Compiled {
    /// The joined schema the expressions were compiled for.
    pub(super) schema: SchemaRef,
    /// The columns they read (indices into `schema`): only these are gathered per batch.
    pub(super) columns: Vec<usize>,
    /// Compiled against `schema` projected to `columns`.
    pub(super) exprs: [Option<Arc<dyn PhysicalExpr>>; 3],
}

pub(super) const SQL_FIELDS: [&str; 3] = ["score", "label", "passed"];

impl ScorerDef {
    /// Checks the definition in full and builds its runtime rule.
    ///
    /// # Errors
    /// [`DefError`] naming the field at fault.
    pub(super) fn compile(&self) -> Result<Rule, DefError> {
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

    pub(super) fn compile_sql(&self) -> Result<Rule, DefError> {
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
        let compiled = compile_exprs(&sources, &crate::stages::score::joined_schema())
            .map_err(|(i, msg)| self.err(SQL_FIELDS[i], msg))?;
        Ok(Rule::Sql(Box::new(SqlRule {
            sources,
            compiled: Mutex::new(compiled),
        })))
    }

    pub(super) fn compile_patterns(&self) -> Result<Rule, DefError> {
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

    pub(super) fn compile_json(&self) -> Result<Rule, DefError> {
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
}

pub(super) struct NoLoader;

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
pub(super) fn compile_exprs(
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

pub(super) fn same_schema(a: &SchemaRef, b: &SchemaRef) -> bool {
    a.fields().len() == b.fields().len()
        && a.fields()
            .iter()
            .zip(b.fields())
            .all(|(x, y)| x.name() == y.name() && x.data_type() == y.data_type())
}

impl SqlRule {
    /// Evaluates the expressions over the rows of `joined` where `valid` is true (only
    /// the columns they read are gathered): one outcome per valid row.
    pub(super) fn score(
        &self,
        joined: &RecordBatch,
        valid: &BooleanArray,
    ) -> Result<Vec<Outcome>, String> {
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
pub(super) fn number(s: &str) -> Option<f64> {
    let t = s
        .trim()
        .trim_start_matches(['$', '€', '£'])
        .trim_end_matches('%')
        .trim();
    t.parse::<f64>().ok().filter(|v| v.is_finite())
}

pub(super) fn match_form(s: &str, mode: MatchMode) -> String {
    match mode {
        MatchMode::Exact => s.trim().to_string(),
        MatchMode::CaseInsensitive => s.trim().to_lowercase(),
        MatchMode::Normalised => {
            normalise_label(&s.split_whitespace().collect::<Vec<_>>().join(" "))
        }
    }
}

/// The text of a JSON answer: trimmed, without a surrounding Markdown code fence.
pub(super) fn json_text(s: &str) -> &str {
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
pub(super) fn verdict(passed: bool, label: String, detail: serde_json::Value) -> Outcome {
    Outcome {
        score: Some(if passed { 1.0 } else { 0.0 }),
        passed: Some(passed),
        label: Some(label),
        detail,
        ..Outcome::default()
    }
}
