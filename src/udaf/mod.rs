//! Statistics as DataFusion functions (see DESIGN.md, "SQL surface").
//!
//! Evals need error bars: a pass rate without a standard error cannot say whether a change is
//! real. Every function of the contract lives in its own file, named after it; the shared math
//! is in [`common`], and the accumulators shared by several functions in [`moments_acc`],
//! [`clustered_acc`] and [`values_acc`]. `register_all` is the single registry used by
//! `evalflow sql` and by library users; [`reference_markdown`] renders `docs/functions.md` from
//! the functions' own documentation.
//!
//! # Behavior shared by every function
//! NULL inputs are ignored, NaN inputs are treated exactly like NULL, too few rows give NULL
//! (never an error, never NaN or an infinity posing as a number; the one documented infinity is
//! `conformal_quantile`'s +inf when k > n). Partial aggregation is exact up to floating-point
//! rounding: results agree across partitionings to ~1e-12 relative.

pub mod cluster_interval;
pub mod cluster_keys;
pub mod cluster_summary;
pub mod clustered_acc;
pub mod common;
pub mod dictionary_keys;
pub mod moments_acc;
pub mod single_group;
pub mod single_phase;
pub mod spec;
pub mod values_acc;

pub mod clustered_mean_ci;
pub mod clustered_se;
pub mod clustered_se_cr1;
pub mod clustered_se_cr2;
pub mod conformal_quantile;
pub mod confusion;
pub mod logit_normal_icc;
pub mod mde;
pub mod mean_ci;
pub mod mean_se;
pub mod paired_diff;
pub mod paired_diff_clustered;
pub mod rogan_gladen;
pub mod rogan_gladen_ci;
pub mod sample_size;
pub mod self_consistency;
pub mod validity_verdict;
pub mod variance_components;

use std::fmt::Write;

use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::common::Result;
use datafusion::logical_expr::{AggregateUDF, ScalarUDF};
use datafusion::prelude::SessionContext;

pub use common::FunctionDoc;
use spec::{AggSpec, ScalarSpec};

/// Every aggregate function, in DESIGN.md order.
pub fn aggregates() -> Vec<AggregateUDF> {
    vec![
        mean_se::udaf(),
        clustered_se::udaf(),
        clustered_se_cr1::udaf(),
        clustered_se_cr2::udaf(),
        mean_ci::udaf(),
        clustered_mean_ci::udaf(),
        paired_diff::udaf(),
        paired_diff_clustered::udaf(),
        variance_components::udaf(),
        logit_normal_icc::udaf(),
        confusion::udaf(),
        conformal_quantile::udaf(),
        self_consistency::udaf(),
    ]
}

/// Every scalar function.
pub fn scalars() -> Vec<ScalarUDF> {
    vec![
        sample_size::udf(),
        mde::udf(),
        rogan_gladen::udf(),
        rogan_gladen_ci::udf(),
        validity_verdict::validity_udf(),
    ]
}

/// The documentation of every function, in DESIGN.md order.
pub fn docs() -> Vec<FunctionDoc> {
    vec![
        mean_se::MeanSe::DOC,
        clustered_se::ClusteredSe::DOC,
        clustered_se_cr1::ClusteredSeCr1::DOC,
        clustered_se_cr2::ClusteredSeCr2::DOC,
        mean_ci::MeanCi::DOC,
        clustered_mean_ci::ClusteredMeanCi::DOC,
        paired_diff::PairedDiff::DOC,
        paired_diff_clustered::PairedDiffClustered::DOC,
        sample_size::SampleSize::DOC,
        mde::Mde::DOC,
        variance_components::VarianceComponents::DOC,
        logit_normal_icc::LogitNormalIcc::DOC,
        confusion::Confusion::DOC,
        rogan_gladen::RoganGladen::DOC,
        rogan_gladen_ci::RoganGladenCi::DOC,
        conformal_quantile::ConformalQuantile::DOC,
        self_consistency::SelfConsistency::DOC,
        validity_verdict::ValidityVerdict::DOC,
    ]
}

/// The SQL names of every function.
pub fn function_names() -> Vec<&'static str> {
    docs().iter().map(|d| d.name).collect()
}

/// Registers every evalflow statistics function on `ctx`.
pub fn register_all(ctx: &SessionContext) {
    for f in aggregates() {
        ctx.register_udaf(f);
    }
    for f in scalars() {
        ctx.register_udf(f);
    }
}

/// Renders the function reference (`docs/functions.md`), running each example for its output.
pub async fn reference_markdown() -> Result<String> {
    let ctx = SessionContext::new();
    register_all(&ctx);
    let mut md = String::from(
        "# evalflow SQL functions\n\n\
         <!-- Generated from the functions' documentation in src/udaf/ by\n     \
         `UPDATE_DOCS=1 cargo test --test stats docs_reference`. Do not edit by hand. -->\n\n\
         Registered by `evalflow sql` and by `evalflow::udaf::register_all(&ctx)`.\n\n\
         Shared behaviour: NULL inputs are ignored and NaN inputs are treated as NULL; too few \
         rows give NULL (never an error, and never NaN or an infinity posing as a number). \
         Struct results are never NULL themselves: their count fields say how many rows were \
         used and the statistics that need more rows are NULL. A `cluster` or `case_id` argument \
         may be any integer or string column. `level` and `alpha` arguments of aggregates must be \
         constants. All aggregates work under GROUP BY and with partial aggregation; results \
         agree across partitionings up to floating-point rounding.\n\n\
         Memory of the clustered aggregates (`clustered_se*`, `clustered_mean_ci`, \
         `paired_diff_clustered`, `variance_components`): each group keeps one set of sums per \
         cluster it saw (32 to about 128 bytes a (group, cluster) pair, plus each key once), and \
         a group's state cannot be split by spilling. In an `evalflow` session they accumulate \
         in one phase: the scan, filters and projections below run on every partition and their \
         rows meet in one accumulator, so each group's clusters are held once. Elsewhere (a plain \
         DataFusion session, a Ballista cluster) DataFusion's two phases give each partition its \
         own copy until they are merged. In an `evalflow` session, a string \
         cluster column read straight from Parquet and used by nothing else in the aggregate is \
         read as a dictionary (each distinct key looked up once per column chunk), with the same \
         results. The aggregate stage and rescore's diff do not hold every cluster: they read \
         the templates in slices (about 500,000 rows each), sum each slice's templates with a \
         plain `GROUP BY`, and fold the finished templates into sums per template size \
         (every method but `wild_bootstrap` needs no more), so their memory is the same at any \
         run size, with the intervals of `clustered_mean_ci` and `paired_diff_clustered`.\n\n",
    );
    for d in docs() {
        let _ = writeln!(md, "- [`{}`](#{})", d.syntax, d.name);
    }
    for d in docs() {
        let batches = ctx.sql(d.example).await?.collect().await?;
        let out = pretty_format_batches(&batches)?;
        let _ = write!(
            md,
            "\n## {name}\n\n`{syntax}` returns `{returns}`\n\n{summary}\n\n**NULL, NaN and empty input.** {behavior}\n\n**Arguments**\n\n",
            name = d.name,
            syntax = d.syntax,
            returns = d.returns,
            summary = d.summary,
            behavior = d.behavior,
        );
        for (a, desc) in d.arguments {
            let _ = writeln!(md, "- `{a}`: {desc}");
        }
        if d.name == clustered_mean_ci::ClusteredMeanCi::DOC.name {
            md.push('\n');
            md.push_str(cluster_interval::METHOD_GUIDE);
        }
        let _ = write!(
            md,
            "\n**Example**\n\n```sql\n{}\n```\n\n```text\n{out}\n```\n",
            d.example
        );
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn names_are_unique_and_documented() {
        let names = function_names();
        let unique: HashSet<_> = names.iter().collect();
        assert_eq!(
            unique.len(),
            names.len(),
            "duplicate function name in {names:?}"
        );
        let mut registered: Vec<String> =
            aggregates().iter().map(|f| f.name().to_string()).collect();
        registered.extend(scalars().iter().map(|f| f.name().to_string()));
        let reg: HashSet<_> = registered.iter().map(String::as_str).collect();
        assert_eq!(reg.len(), registered.len(), "duplicate registered name");
        assert_eq!(reg, names.iter().copied().collect::<HashSet<_>>());
        assert_eq!(names.len(), 18);
    }
}
