//! Table schemas, declared once in `schemas/*.json` and embedded at compile time.
//!
//! Every stage builds its output from these schemas and checks its inputs against them,
//! so a table's columns are never spelled twice.

use std::sync::{Arc, OnceLock};

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use serde::Deserialize;

/// An error raised when a schema file or an input table does not fit the contract.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    /// A file under `schemas/` could not be parsed (a build-time bug).
    #[error("schemas/{table}.json: {msg}")]
    Declaration { table: String, msg: String },
    /// An input table lacks a required column or has it with another type.
    #[error("{file}: column `{field}`: {msg}")]
    Mismatch {
        file: String,
        field: String,
        msg: String,
    },
}

/// The tables of a run, in dataflow order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Table {
    Cases,
    Calls,
    Validity,
    Scores,
    Results,
}

impl Table {
    pub const ALL: [Table; 5] = [
        Table::Cases,
        Table::Calls,
        Table::Validity,
        Table::Scores,
        Table::Results,
    ];

    /// The table's name, as used in the run layout and in SQL.
    pub fn name(self) -> &'static str {
        match self {
            Table::Cases => "cases",
            Table::Calls => "calls",
            Table::Validity => "validity",
            Table::Scores => "scores",
            Table::Results => "results",
        }
    }

    fn source(self) -> &'static str {
        match self {
            Table::Cases => include_str!("../schemas/cases.json"),
            Table::Calls => include_str!("../schemas/calls.json"),
            Table::Validity => include_str!("../schemas/validity.json"),
            Table::Scores => include_str!("../schemas/scores.json"),
            Table::Results => include_str!("../schemas/results.json"),
        }
    }

    /// The Arrow schema declared in `schemas/<name>.json`.
    pub fn schema(self) -> SchemaRef {
        static CACHE: OnceLock<Vec<SchemaRef>> = OnceLock::new();
        let all = CACHE.get_or_init(|| {
            Table::ALL
                .iter()
                .map(|t| Arc::new(parse_schema(t.name(), t.source()).expect("valid schema file")))
                .collect()
        });
        all[Table::ALL.iter().position(|t| *t == self).unwrap()].clone()
    }
}

#[derive(Deserialize)]
struct SchemaFile {
    fields: Vec<FieldDecl>,
}

#[derive(Deserialize)]
struct FieldDecl {
    name: String,
    #[serde(rename = "type")]
    ty: String,
    nullable: bool,
    /// Declared after parts were written without it: a part may lack it (it reads as
    /// NULL). Only a nullable column can be optional.
    #[serde(default)]
    optional: bool,
}

/// Maps the type names used in `schemas/*.json` to Arrow types.
pub fn parse_type(ty: &str) -> Option<DataType> {
    Some(match ty {
        "utf8" => DataType::Utf8,
        "float64" => DataType::Float64,
        "int32" => DataType::Int32,
        "int64" => DataType::Int64,
        "bool" => DataType::Boolean,
        "timestamp_us_utc" => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
        "list<bool>" => DataType::List(Arc::new(Field::new_list_field(DataType::Boolean, true))),
        _ => return None,
    })
}

fn parse_schema(table: &str, src: &str) -> Result<Schema, SchemaError> {
    let decl = |msg: String| SchemaError::Declaration {
        table: table.to_string(),
        msg,
    };
    let file: SchemaFile = serde_json::from_str(src).map_err(|e| decl(e.to_string()))?;
    let fields = file
        .fields
        .into_iter()
        .map(|f| {
            if f.optional && !f.nullable {
                return Err(decl(format!(
                    "`{}`: an optional column must be nullable",
                    f.name
                )));
            }
            let dt = parse_type(&f.ty).ok_or_else(|| decl(format!("unknown type `{}`", f.ty)))?;
            Ok(Field::new(f.name, dt, f.nullable))
        })
        .collect::<Result<Vec<_>, SchemaError>>()?;
    Ok(Schema::new(fields))
}

/// The columns of `schemas/<table>.json` marked `optional`: declared after parts were
/// written without them, so a part may lack them.
fn optional_columns(table: Table) -> &'static [String] {
    static CACHE: OnceLock<Vec<Vec<String>>> = OnceLock::new();
    let all = CACHE.get_or_init(|| {
        Table::ALL
            .iter()
            .map(|t| {
                serde_json::from_str::<SchemaFile>(t.source())
                    .map(|f| {
                        f.fields
                            .into_iter()
                            .filter(|f| f.optional)
                            .map(|f| f.name)
                            .collect()
                    })
                    .unwrap_or_default()
            })
            .collect()
    });
    &all[Table::ALL.iter().position(|t| *t == table).unwrap()]
}

/// Checks that `actual` (read from `file`) has every column of `table` with the declared
/// type, but for `optional` columns it may lack (a part written before they were declared).
/// Extra columns are allowed: DESIGN.md lets tables grow.
///
/// # Errors
/// [`SchemaError::Mismatch`] naming the file and the first column that does not fit.
pub fn check_compatible(table: Table, actual: &Schema, file: &str) -> Result<(), SchemaError> {
    for want in table.schema().fields() {
        let mismatch = |msg: String| SchemaError::Mismatch {
            file: file.to_string(),
            field: want.name().clone(),
            msg,
        };
        let Ok(got) = actual.field_with_name(want.name()) else {
            if optional_columns(table).contains(want.name()) {
                continue;
            }
            return Err(mismatch(format!(
                "missing (the {} table requires it)",
                table.name()
            )));
        };
        if !types_compatible(want.data_type(), got.data_type()) {
            return Err(mismatch(format!(
                "has type {}, expected {}",
                got.data_type(),
                want.data_type()
            )));
        }
    }
    Ok(())
}

fn types_compatible(want: &DataType, got: &DataType) -> bool {
    match (want, got) {
        (DataType::Utf8, DataType::LargeUtf8 | DataType::Utf8View) => true,
        (DataType::Timestamp(u1, _), DataType::Timestamp(u2, _)) => u1 == u2,
        (DataType::List(a), DataType::List(b) | DataType::LargeList(b)) => {
            a.data_type() == b.data_type()
        }
        _ => want == got,
    }
}

/// Casts view and large string columns to plain Utf8, so readers that downcast to
/// `StringArray` never mistake another string encoding for a missing value.
pub fn plain_strings(b: RecordBatch) -> RecordBatch {
    use datafusion::arrow::compute::cast;
    let schema = b.schema();
    let mut fields = Vec::new();
    let mut cols = Vec::new();
    for (f, c) in schema.fields().iter().zip(b.columns()) {
        if matches!(f.data_type(), DataType::Utf8View | DataType::LargeUtf8) {
            cols.push(cast(c, &DataType::Utf8).expect("string columns cast to Utf8"));
            fields.push(Field::new(f.name(), DataType::Utf8, true));
        } else {
            cols.push(c.clone());
            fields.push(f.as_ref().clone());
        }
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), cols).expect("same columns")
}

/// Column names, typed once so stages never misspell them.
pub mod col {
    pub const CASE_ID: &str = "case_id";
    pub const CALL_ID: &str = "call_id";
}

/// One generated case (a row of `cases`).
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    pub case_id: String,
    pub suite: String,
    pub test: String,
    pub capability: String,
    pub test_type: String,
    pub template_id: String,
    pub group_id: String,
    pub role: String,
    pub input: String,
    pub expected: Option<String>,
    pub expectation: Option<String>,
    pub tolerance: Option<f64>,
    pub perturbation: Option<String>,
}

/// Builds a `cases` record batch.
pub fn cases_batch(cases: &[Case]) -> RecordBatch {
    let s = |f: fn(&Case) -> &str| -> datafusion::arrow::array::ArrayRef {
        Arc::new(datafusion::arrow::array::StringArray::from_iter_values(
            cases.iter().map(f),
        ))
    };
    let o = |f: fn(&Case) -> Option<&str>| -> datafusion::arrow::array::ArrayRef {
        Arc::new(
            cases
                .iter()
                .map(f)
                .collect::<datafusion::arrow::array::StringArray>(),
        )
    };
    let cols: Vec<datafusion::arrow::array::ArrayRef> = vec![
        s(|c| &c.case_id),
        s(|c| &c.suite),
        s(|c| &c.test),
        s(|c| &c.capability),
        s(|c| &c.test_type),
        s(|c| &c.template_id),
        s(|c| &c.group_id),
        s(|c| &c.role),
        s(|c| &c.input),
        o(|c| c.expected.as_deref()),
        o(|c| c.expectation.as_deref()),
        Arc::new(
            cases
                .iter()
                .map(|c| c.tolerance)
                .collect::<datafusion::arrow::array::Float64Array>(),
        ),
        o(|c| c.perturbation.as_deref()),
    ];
    RecordBatch::try_new(Table::Cases.schema(), cols)
        .expect("cases batch matches schemas/cases.json")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_schema_file_parses_and_has_its_key() {
        for t in Table::ALL {
            let s = t.schema();
            assert!(s.fields().len() >= 5, "{}", t.name());
        }
        assert!(Table::Calls.schema().field_with_name("call_id").is_ok());
        assert_eq!(
            Table::Scores
                .schema()
                .field_with_name("score")
                .unwrap()
                .data_type(),
            &DataType::Float64
        );
    }

    #[test]
    fn mismatch_names_file_and_field() {
        let bad = Schema::new(vec![Field::new("case_id", DataType::Int64, false)]);
        let err = check_compatible(Table::Cases, &bad, "x.parquet").unwrap_err();
        assert_eq!(
            err.to_string(),
            "x.parquet: column `case_id`: has type Int64, expected Utf8"
        );
    }
}
