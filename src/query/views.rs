//! Utf8View columns of `evalflow sql`'s results cast back to Utf8 ([`super::sql_context`]
//! reads the strings of plain Parquet as views).

use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::error::DataFusionError;
use datafusion::prelude::DataFrame;

/// `t` with every Utf8View (also inside lists, structs and maps) as Utf8, and whether
/// anything changed.
fn plain_strings(t: &DataType) -> (DataType, bool) {
    use datafusion::arrow::datatypes::Field;
    let field = |f: &Field| {
        let (t, changed) = plain_strings(f.data_type());
        (Arc::new(f.clone().with_data_type(t)), changed)
    };
    match t {
        DataType::Utf8View => (DataType::Utf8, true),
        DataType::List(f) => {
            let (f, c) = field(f);
            (DataType::List(f), c)
        }
        DataType::LargeList(f) => {
            let (f, c) = field(f);
            (DataType::LargeList(f), c)
        }
        DataType::FixedSizeList(f, n) => {
            let (f, c) = field(f);
            (DataType::FixedSizeList(f, *n), c)
        }
        DataType::Struct(fs) => {
            let (fs, cs): (Vec<_>, Vec<bool>) = fs.iter().map(|f| field(f)).unzip();
            (DataType::Struct(fs.into()), cs.contains(&true))
        }
        DataType::Map(f, sorted) => {
            let (f, c) = field(f);
            (DataType::Map(f, *sorted), c)
        }
        other => (other.clone(), false),
    }
}

/// `df` with its Utf8View columns (read by [`super::sql_context`]) cast to Utf8: what `evalflow
/// sql` writes has the string types it always had, whatever the session read.
pub fn without_views(df: DataFrame) -> Result<DataFrame, DataFusionError> {
    use datafusion::common::Column;
    use datafusion::logical_expr::{Expr, cast};
    let mut changed = false;
    let exprs: Vec<Expr> = df
        .schema()
        .iter()
        .map(|(q, f)| {
            let col = Expr::Column(Column::new(q.cloned(), f.name()));
            let (t, c) = plain_strings(f.data_type());
            changed |= c;
            if c { cast(col, t).alias(f.name()) } else { col }
        })
        .collect();
    if changed { df.select(exprs) } else { Ok(df) }
}
