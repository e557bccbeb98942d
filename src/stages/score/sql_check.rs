//! Load-time checks of `sql` scorer expressions that planning does not make, and the error a
//! SQL scorer's failure on the run's rows becomes.
//!
//! Planning resolves columns, functions and types, but a regular expression given as a
//! constant (`regexp_like(response, '(refund')`) is compiled only when the first batch is
//! evaluated: after validate ran, with a scores folder started. Compiling each constant
//! pattern when the definition is read fails the run before any stage starts, naming the
//! file, line and field. What only rows can reveal (a division by zero, a failed CAST, a
//! pattern read from a column) fails the stage as bad input naming the same place.

use datafusion::common::ScalarValue;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::common::{DFSchema, DataFusionError};
use datafusion::logical_expr::{Expr, Operator};

use super::ScorerId;
use super::user::{DefError, Kind, ScorerDef};
use crate::query::QueryError;

/// The SQL fields of a `sql` scorer, in the order the engine evaluates them.
const FIELDS: [&str; 3] = ["score", "label", "passed"];

/// Regex functions: (name, index of the pattern, index of the flags).
const REGEX_FUNCTIONS: &[(&str, usize, usize)] = &[
    ("regexp_like", 1, 2),
    ("regexp_match", 1, 2),
    ("regexp_count", 1, 3),
    ("regexp_replace", 1, 3),
    ("regexp_instr", 1, 4),
];

fn def_error(def: &ScorerDef, field: &str, msg: String) -> DefError {
    DefError {
        file: def.origin.file.clone(),
        line: def
            .origin
            .fields
            .get(field)
            .copied()
            .unwrap_or(def.origin.line),
        scorer: def.name.clone(),
        field: field.to_string(),
        msg,
    }
}

fn text(e: &Expr) -> Option<&str> {
    match e {
        Expr::Literal(
            ScalarValue::Utf8(Some(s))
            | ScalarValue::LargeUtf8(Some(s))
            | ScalarValue::Utf8View(Some(s)),
            _,
        ) => Some(s),
        _ => None,
    }
}

/// Compiles `pattern` (with `flags` as DataFusion applies them: `(?flags)pattern`, the
/// global flag `g` being `regexp_replace`'s own) as the engine will.
fn compile(pattern: &str, flags: Option<&str>) -> Result<(), String> {
    let flags: String = flags.unwrap_or("").chars().filter(|c| *c != 'g').collect();
    let full = match flags.is_empty() {
        true => pattern.to_string(),
        false => format!("(?{flags}){pattern}"),
    };
    regex::Regex::new(&full)
        .map(|_| ())
        .map_err(|e| format!("invalid regular expression '{pattern}': {e}"))
}

/// Every constant regular expression of `expr`, compiled; the first failure.
fn check_regexes(expr: &Expr) -> Result<(), String> {
    let mut bad = None;
    let _ = expr.apply(|e| {
        let found = match e {
            Expr::ScalarFunction(f) => REGEX_FUNCTIONS
                .iter()
                .find(|(name, _, _)| f.name() == *name)
                .and_then(|(_, p, fl)| {
                    let pattern = f.args.get(*p).and_then(text)?;
                    Some(compile(pattern, f.args.get(*fl).and_then(text)))
                }),
            Expr::BinaryExpr(b)
                if matches!(
                    b.op,
                    Operator::RegexMatch
                        | Operator::RegexIMatch
                        | Operator::RegexNotMatch
                        | Operator::RegexNotIMatch
                ) =>
            {
                text(&b.right).map(|p| compile(p, None))
            }
            _ => None,
        };
        match found {
            Some(Err(msg)) => {
                bad = Some(msg);
                Ok(TreeNodeRecursion::Stop)
            }
            _ => Ok(TreeNodeRecursion::Continue),
        }
    });
    bad.map_or(Ok(()), Err)
}

/// Compiles the constant regular expressions of every `sql` scorer in `defs`.
///
/// # Errors
/// [`DefError`] naming the definition's file, the line of the field and the pattern.
pub fn check_defs(defs: &[ScorerDef]) -> Result<(), DefError> {
    let schema = super::joined_schema();
    let df_schema = DFSchema::try_from(schema.as_ref().clone())
        .expect("the joined schema is a valid DataFusion schema");
    let ctx = crate::query::new_context();
    for def in defs.iter().filter(|d| d.kind == Kind::Sql) {
        let sources = [&def.score, &def.label, &def.passed];
        for (field, src) in FIELDS.iter().zip(sources) {
            let Some(src) = src else { continue };
            // A definition that does not parse was refused by its own check already.
            let Ok(expr) = ctx.parse_sql_expr(src, &df_schema) else {
                continue;
            };
            check_regexes(&expr).map_err(|msg| def_error(def, field, format!("`{src}`: {msg}")))?;
        }
    }
    Ok(())
}

/// A scorer's expressions failed on the run's rows: the definition's fault (exit 2), not
/// the engine's. Carried through the stage's `QueryError` as an external DataFusion error.
#[derive(Debug, thiserror::Error)]
#[error("scorer `{}`: {msg}", scorer.tag())]
pub struct ScorerFailed {
    pub scorer: ScorerId,
    /// `score`, `label` or `passed`, when the engine named it.
    pub field: Option<String>,
    pub msg: String,
}

impl ScorerFailed {
    /// From the engine's message (`field \`score\`: Divide by zero error`).
    pub fn new(scorer: ScorerId, msg: String) -> Self {
        let (field, msg) = match msg
            .strip_prefix("field `")
            .and_then(|rest| rest.split_once("`: "))
        {
            Some((f, m)) => (Some(f.to_string()), m.to_string()),
            None => (None, msg),
        };
        ScorerFailed { scorer, field, msg }
    }

    /// The failure inside a stage's error, if that is what stopped it.
    pub fn of(e: &QueryError) -> Option<&ScorerFailed> {
        match e {
            QueryError::DataFusion { source, .. } => match source.find_root() {
                DataFusionError::External(b) => b.downcast_ref::<ScorerFailed>(),
                _ => None,
            },
            _ => None,
        }
    }

    /// The failure as an error naming the definition's file, the field's line and the
    /// field (`def`: the scorer's definition, when its origin is known; `file` otherwise).
    pub fn located(&self, def: Option<&ScorerDef>, file: &str) -> DefError {
        let field = self.field.clone().unwrap_or_else(|| "score".into());
        let msg = format!(
            "failed on the run's answers (nothing was written): {}",
            self.msg
        );
        match def.filter(|d| !d.origin.file.is_empty()) {
            Some(d) => def_error(d, &field, msg),
            None => DefError {
                file: file.to_string(),
                line: 0,
                scorer: self.scorer.name.clone(),
                field,
                msg,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defs(text: &str) -> Vec<ScorerDef> {
        super::super::user::parse_text(text, "s.toml").unwrap()
    }

    #[test]
    fn constant_regexes_are_compiled_at_load() {
        let d = defs(
            "[[scorer]]\nname = \"r\"\nkind = \"sql\"\nmetric = \"pass_fail\"\npassed = \"regexp_like(response, '(refund')\"\n",
        );
        let e = check_defs(&d).unwrap_err();
        assert_eq!(
            (e.file.as_str(), e.line, e.field.as_str()),
            ("s.toml", 5, "passed")
        );
        assert!(
            e.msg.contains("invalid regular expression '(refund'"),
            "{e}"
        );
        let d = defs(
            "[[scorer]]\nname = \"r\"\nkind = \"sql\"\nmetric = \"numeric\"\nscore = \"CASE WHEN response ~ '[a-' THEN 1 ELSE 0 END\"\n",
        );
        assert_eq!(check_defs(&d).unwrap_err().field, "score");
        let ok = defs(
            "[[scorer]]\nname = \"r\"\nkind = \"sql\"\nmetric = \"pass_fail\"\npassed = \"regexp_like(response, 'refund(ed)?', 'i')\"\n",
        );
        check_defs(&ok).unwrap();
    }

    #[test]
    fn the_engine_message_names_the_field() {
        let id = ScorerId {
            name: "x".into(),
            version: "1".into(),
        };
        let f = ScorerFailed::new(id, "field `label`: Cast error".into());
        assert_eq!(f.field.as_deref(), Some("label"));
        assert_eq!(f.msg, "Cast error");
    }
}
