//! Cluster keys read as Arrow dictionaries, straight from Parquet's dictionary pages.
//!
//! Parquet stores a string column such as `template_id` dictionary-encoded. Read as Utf8,
//! each row's string is copied out of the page's dictionary, and the clustered accumulator
//! then hashes it again to find its cluster. Read as an Arrow dictionary, the accumulator
//! looks each dictionary value up once per column chunk ([`super::cluster_keys`]) and each
//! row is an array index: on 20M interleaved rows this took about 40% of the CPU of a grouped
//! `clustered_se` away.
//!
//! The table schema cannot say dictionary: DataFusion's own `GROUP BY` on a dictionary column
//! is row-based (about 3x slower), and pyarrow and polars read a dictionary Arrow schema as
//! categorical. So this physical optimizer rule changes the type inside one plan only: where a
//! clustered aggregate's cluster argument is a string column read straight from Parquet (through
//! filters, projections and repartitions that do not touch it) and used by nothing else in the
//! aggregate, the scan reads that column as `Dictionary(Int32, Utf8)`. Each file gets its own
//! Arrow schema hint (`PartitionedFile::arrow_schema`), derived from its footer in DataFusion's
//! metadata cache (filled while the table is listed and its statistics are collected); when a
//! footer is not cached, the plan is left as it was. The accumulators take dictionary keys and
//! keep Utf8 keys in their state, so the aggregate's output does not change.
//!
//! Written here because DataFusion has no option to read one column of a Parquet scan as a
//! dictionary for one consumer.

use std::collections::HashSet;
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::Result;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode, TreeNodeRecursion};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::metadata::CachedParquetMetaData;
use datafusion::datasource::physical_plan::{
    FileGroup, FileScanConfig, FileScanConfigBuilder, FileSource, ParquetSource,
};
use datafusion::datasource::source::DataSourceExec;
use datafusion::datasource::table_schema::TableSchema;
use datafusion::execution::cache::cache_manager::FileMetadataCache;
use datafusion::parquet::arrow::parquet_to_arrow_schema;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::Partitioning;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;

/// The position of the cluster argument of each function whose accumulator reads cluster keys
/// through [`super::cluster_keys::ClusterTable`] (which takes dictionaries).
pub fn cluster_arg(function: &str) -> Option<usize> {
    match function {
        "clustered_se"
        | "clustered_se_cr1"
        | "clustered_se_cr2"
        | "clustered_mean_ci"
        | "logit_normal_icc"
        | "variance_components" => Some(1),
        "paired_diff_clustered" => Some(2),
        _ => None,
    }
}

/// A rebuilt node's properties follow its new child.
const RECOMPUTE: ReplaceChildrenOptions =
    ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);

/// The physical optimizer rule; see the module doc.
#[derive(Debug)]
pub struct DictionaryClusterKeys {
    footers: Arc<FileMetadataCache>,
}

impl DictionaryClusterKeys {
    /// A rule reading footers from `footers`, the session runtime's file metadata cache.
    pub fn new(footers: Arc<FileMetadataCache>) -> Self {
        Self { footers }
    }

    /// The aggregate reading its cluster column as a dictionary, if it can.
    fn rewrite_aggregate(
        &self,
        node: &Arc<dyn ExecutionPlan>,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        let Some(agg) = node.downcast_ref::<AggregateExec>() else {
            return Ok(None);
        };
        // Only the modes that read raw rows; a final aggregate merges Utf8 states.
        if !matches!(
            agg.mode(),
            AggregateMode::Partial | AggregateMode::Single | AggregateMode::SinglePartitioned
        ) {
            return Ok(None);
        }
        let Some(col) = sole_cluster_column(agg) else {
            return Ok(None);
        };
        if !is_string(agg.input().schema().field(col).data_type()) {
            return Ok(None);
        }
        match self.rewrite_input(agg.input(), col)? {
            Some(input) => Ok(Some(
                Arc::clone(node).replace_children(vec![input], RECOMPUTE)?,
            )),
            None => Ok(None),
        }
    }

    /// `plan` with its output column `col` a dictionary, if every node down to the Parquet
    /// scan passes the column through untouched.
    fn rewrite_input(
        &self,
        plan: &Arc<dyn ExecutionPlan>,
        col: usize,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        if let Some(scan) = plan.downcast_ref::<DataSourceExec>() {
            return self.rewrite_scan(scan, col);
        }
        let child_col = if let Some(f) = plan.downcast_ref::<FilterExec>() {
            let c = match f.projection() {
                Some(p) => p[col],
                None => col,
            };
            if references(f.predicate(), c) {
                return Ok(None);
            }
            c
        } else if let Some(r) = plan.downcast_ref::<RepartitionExec>() {
            match r.partitioning() {
                Partitioning::RoundRobinBatch(_) | Partitioning::UnknownPartitioning(_) => col,
                Partitioning::Hash(exprs, _) if !exprs.iter().any(|e| references(e, col)) => col,
                _ => return Ok(None),
            }
        } else if plan.is::<CoalescePartitionsExec>() {
            col
        } else if let Some(p) = plan.downcast_ref::<ProjectionExec>() {
            let exprs = p.expr();
            let Some(c) = exprs
                .get(col)
                .and_then(|e| e.expr.downcast_ref::<Column>())
                .map(Column::index)
            else {
                return Ok(None);
            };
            let elsewhere = exprs
                .iter()
                .enumerate()
                .any(|(i, e)| i != col && references(&e.expr, c));
            if elsewhere {
                return Ok(None);
            }
            c
        } else {
            return Ok(None);
        };
        let [child] = plan.children()[..] else {
            return Ok(None);
        };
        let Some(child) = self.rewrite_input(child, child_col)? else {
            return Ok(None);
        };
        // A projection keeps the output schema it was built with, even when its children
        // are replaced: build it again.
        if let Some(p) = plan.downcast_ref::<ProjectionExec>() {
            return Ok(Some(Arc::new(ProjectionExec::try_new(
                p.expr().to_vec(),
                child,
            )?)));
        }
        Ok(Some(
            Arc::clone(plan).replace_children(vec![child], RECOMPUTE)?,
        ))
    }

    /// The Parquet scan with its output column `col` read as a dictionary.
    fn rewrite_scan(
        &self,
        scan: &DataSourceExec,
        col: usize,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        let Some(config) = scan.data_source().downcast_ref::<FileScanConfig>() else {
            return Ok(None);
        };
        let Some(source) = config.file_source().downcast_ref::<ParquetSource>() else {
            return Ok(None);
        };
        let table = source.table_schema();
        let Some(projection) = FileSource::projection(source) else {
            return Ok(None);
        };
        let exprs: Vec<_> = projection.iter().map(|p| Arc::clone(&p.expr)).collect();
        let Some(t) = exprs
            .get(col)
            .and_then(|e| e.downcast_ref::<Column>())
            .map(Column::index)
        else {
            return Ok(None);
        };
        let files = table.file_schema();
        // Not a partition or virtual column, a string, and read by nothing else in the scan.
        if !table.virtual_columns().is_empty()
            || t >= files.fields().len()
            || !is_string(files.field(t).data_type())
            || exprs
                .iter()
                .enumerate()
                .any(|(i, e)| i != col && references(e, t))
            || FileSource::filter(source).is_some_and(|p| references(&p, t))
        {
            return Ok(None);
        }
        let name = files.field(t).name().clone();
        let mut groups = Vec::with_capacity(config.file_groups.len());
        for group in &config.file_groups {
            let mut hinted = Vec::with_capacity(group.len());
            for file in group.iter() {
                let Some(schema) = self.file_hint(file, &name, files) else {
                    tracing::debug!(
                        file = %file.object_meta.location,
                        "no cached footer: `{name}` stays a string column"
                    );
                    return Ok(None);
                };
                let mut file = file.clone();
                file.arrow_schema = Some(schema);
                hinted.push(file);
            }
            let mut g = FileGroup::new(hinted);
            if let Some(s) = group.file_statistics(None) {
                g = g.with_statistics(Arc::new(s.clone()));
            }
            groups.push(g);
        }
        let table = TableSchema::builder(with_dictionary(files, &name))
            .with_table_partition_cols(table.table_partition_cols().clone())
            .build();
        let options = source.table_parquet_options().clone();
        let hint = options.global.metadata_size_hint;
        let mut rebuilt = ParquetSource::new(table).with_table_parquet_options(options);
        if let Some(h) = hint {
            rebuilt = rebuilt.with_metadata_size_hint(h);
        }
        if let Some(p) = FileSource::filter(source) {
            rebuilt = rebuilt.with_predicate(p);
        }
        if let Some(f) = source.parquet_file_reader_factory() {
            rebuilt = rebuilt.with_parquet_file_reader_factory(Arc::clone(f));
        }
        let Some(rebuilt) = rebuilt.try_pushdown_projection(projection)? else {
            return Ok(None);
        };
        let config = FileScanConfigBuilder::from(config.clone())
            .with_source(rebuilt)
            .with_file_groups(groups)
            .build();
        tracing::debug!("`{name}` read as a dictionary for a clustered aggregate");
        Ok(Some(DataSourceExec::from_data_source(config)))
    }

    /// The file's own Arrow schema with `name` a dictionary, from its cached footer; its other
    /// string columns are read as views where the table's are (`evalflow sql`), as
    /// DataFusion's own reading of the file would.
    fn file_hint(&self, file: &PartitionedFile, name: &str, table: &Schema) -> Option<SchemaRef> {
        let cached = self.footers.get(&file.object_meta.location)?;
        if !cached.is_valid_for(&file.object_meta) {
            return None;
        }
        let parquet = cached
            .file_metadata
            .as_any()
            .downcast_ref::<CachedParquetMetaData>()?
            .parquet_metadata();
        let meta = parquet.file_metadata();
        let schema =
            parquet_to_arrow_schema(meta.schema_descr(), meta.key_value_metadata()).ok()?;
        let field = schema.field_with_name(name).ok()?;
        if !is_string(field.data_type()) {
            return None;
        }
        let fields: Vec<Field> = schema
            .fields()
            .iter()
            .map(|f| {
                let view = table
                    .field_with_name(f.name())
                    .is_ok_and(|t| t.data_type() == &DataType::Utf8View);
                if view && matches!(f.data_type(), DataType::Utf8 | DataType::LargeUtf8) {
                    f.as_ref().clone().with_data_type(DataType::Utf8View)
                } else {
                    f.as_ref().clone()
                }
            })
            .collect();
        let schema = Schema::new_with_metadata(fields, schema.metadata().clone());
        Some(with_dictionary(&schema, name))
    }
}

impl PhysicalOptimizerRule for DictionaryClusterKeys {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_down(|node| match self.rewrite_aggregate(&node)? {
            Some(new) => Ok(Transformed::new(new, true, TreeNodeRecursion::Jump)),
            None => Ok(Transformed::no(node)),
        })
        .data()
    }

    fn name(&self) -> &str {
        "evalflow_dictionary_cluster_keys"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The one column index every clustered aggregate of `agg` takes as its cluster argument,
/// when no other expression of the aggregate (groups, other arguments, filters, orderings)
/// reads it.
fn sole_cluster_column(agg: &AggregateExec) -> Option<usize> {
    let mut cluster = None;
    let mut others = HashSet::new();
    let note = |e: &Arc<dyn PhysicalExpr>, others: &mut HashSet<usize>| {
        others.extend(collect_columns(e).iter().map(Column::index));
    };
    for a in agg.aggr_expr() {
        let at = cluster_arg(a.fun().name());
        for (i, e) in a.expressions().iter().enumerate() {
            match e.downcast_ref::<Column>() {
                Some(c) if Some(i) == at => {
                    if cluster.is_some_and(|x| x != c.index()) {
                        return None;
                    }
                    cluster = Some(c.index());
                }
                _ => note(e, &mut others),
            }
        }
        for o in a.order_bys() {
            note(&o.expr, &mut others);
        }
    }
    for (e, _) in agg.group_expr().expr() {
        note(e, &mut others);
    }
    for f in agg.filter_expr().iter().flatten() {
        note(f, &mut others);
    }
    cluster.filter(|c| !others.contains(c))
}

fn references(e: &Arc<dyn PhysicalExpr>, col: usize) -> bool {
    collect_columns(e).iter().any(|c| c.index() == col)
}

fn is_string(t: &DataType) -> bool {
    matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
}

/// `schema` with the string field `name` as `Dictionary(Int32, <its type>)` (Utf8 for a
/// Utf8View column, as its file's own schema hint says: views of a dictionary's values
/// would only point back into it).
fn with_dictionary(schema: &Schema, name: &str) -> SchemaRef {
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|f| {
            if f.name() == name {
                let values = match f.data_type() {
                    DataType::Utf8View => DataType::Utf8,
                    t => t.clone(),
                };
                f.as_ref().clone().with_data_type(DataType::Dictionary(
                    Box::new(DataType::Int32),
                    Box::new(values),
                ))
            } else {
                f.as_ref().clone()
            }
        })
        .collect();
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Float64Array, RecordBatch, StringArray};
    use datafusion::arrow::util::display::array_value_to_string;
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::file::properties::WriterProperties;
    use datafusion::prelude::SessionContext;

    /// Two files of interleaved rows: 4 models, 150 templates, row groups of 300 rows (each
    /// with its own dictionary), some NULL templates and scores.
    fn write_table(dir: &std::path::Path) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("model", DataType::Utf8, false),
            Field::new("template_id", DataType::Utf8, true),
            Field::new("score", DataType::Float64, true),
            Field::new("baseline", DataType::Float64, true),
        ]));
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(300))
            .build();
        let mut r: u64 = 7;
        let mut next = move || {
            r = r
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            r >> 33
        };
        for f in 0..2 {
            let n = 1000;
            let (mut m, mut t, mut s, mut b) = (vec![], vec![], vec![], vec![]);
            for _ in 0..n {
                let tpl = next() % 150;
                m.push(format!("m{}", next() % 4));
                t.push((next() % 50 != 0).then(|| format!("template-{tpl:04}")));
                let p = (tpl % 10) as f64 / 10.0;
                s.push(
                    (next() % 40 != 0)
                        .then(|| f64::from(u8::from((next() % 100) as f64 / 100.0 < p))),
                );
                b.push(Some(f64::from(u8::from(
                    (next() % 100) as f64 / 100.0 < 0.5,
                ))));
            }
            let batch = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(StringArray::from(m)),
                    Arc::new(StringArray::from(t)),
                    Arc::new(Float64Array::from(s)),
                    Arc::new(Float64Array::from(b)),
                ],
            )
            .unwrap();
            let file = std::fs::File::create(dir.join(format!("part-{f}.parquet"))).unwrap();
            let mut w =
                ArrowWriter::try_new(file, Arc::clone(&schema), Some(props.clone())).unwrap();
            w.write(&batch).unwrap();
            w.close().unwrap();
        }
    }

    async fn plan(ctx: &SessionContext, sql: &str) -> Arc<dyn ExecutionPlan> {
        ctx.sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap()
    }

    /// The type the plan's Parquet scan gives `template_id` (or its alias `tpl`).
    fn scanned_type(plan: &Arc<dyn ExecutionPlan>) -> Option<DataType> {
        if plan.is::<DataSourceExec>() {
            return plan
                .schema()
                .fields()
                .iter()
                .find(|f| ["template_id", "tpl"].contains(&f.name().as_str()))
                .map(|f| f.data_type().clone());
        }
        plan.children().into_iter().find_map(scanned_type)
    }

    /// Every result cell as text, rows sorted (by their first cell, a group key).
    async fn rows(ctx: &SessionContext, sql: &str) -> Vec<String> {
        let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        let mut out = vec![];
        for b in &batches {
            for i in 0..b.num_rows() {
                let cells: Vec<String> = b
                    .columns()
                    .iter()
                    .map(|c| array_value_to_string(c, i).unwrap())
                    .collect();
                out.push(cells.join(" | "));
            }
        }
        out.sort();
        out
    }

    /// Whether two result rows are equal, numbers to a relative 1e-10 (summation order
    /// differs between dictionary and string keys; rounding both to a fixed number of digits
    /// would still split values that straddle a rounding boundary).
    fn same_rows(a: &[String], b: &[String]) -> bool {
        let tokens = |s: &str| -> Vec<String> {
            s.split([',', ' ', '}', '{', ':'])
                .filter(|t| !t.is_empty())
                .map(str::to_string)
                .collect()
        };
        a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| {
                let (tx, ty) = (tokens(x), tokens(y));
                tx.len() == ty.len()
                    && tx
                        .iter()
                        .zip(&ty)
                        .all(|(u, v)| match (u.parse::<f64>(), v.parse::<f64>()) {
                            (Ok(p), Ok(q)) => {
                                (p - q).abs() <= 1e-10 * p.abs().max(q.abs()).max(1e-300)
                            }
                            _ => u == v,
                        })
            })
    }

    #[tokio::test]
    async fn clustered_aggregates_read_dictionary_keys_with_the_same_results() {
        let dir = tempfile::tempdir().unwrap();
        write_table(dir.path());
        let url = dir.path().to_str().unwrap();
        // Stages' sessions read strings as Utf8, `evalflow sql`'s as Utf8View: the cluster
        // column becomes a dictionary in both, and the results do not change.
        let sessions = [
            (crate::query::new_context(), DataType::Utf8),
            (crate::query::sql_context(), DataType::Utf8View),
        ];
        for (ctx, _) in &sessions {
            crate::query::register_parquet(ctx, "t", url).await.unwrap();
        }
        // The reference: a plain session, template ids read as strings.
        let plain =
            SessionContext::new_with_config(datafusion::prelude::SessionConfig::new().set_bool(
                "datafusion.execution.parquet.schema_force_view_types",
                false,
            ));
        super::super::register_all(&plain);
        crate::query::register_parquet(&plain, "t", url)
            .await
            .unwrap();
        let dict = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
        let rewritten = [
            "SELECT model, clustered_se(score, template_id) FROM t GROUP BY model",
            "SELECT clustered_se(score, template_id), clustered_se_cr2(score, template_id) FROM t",
            "SELECT model, clustered_mean_ci(score, template_id), \
             clustered_mean_ci(score, template_id, 0.9, 'cr1_t') FROM t GROUP BY model",
            "SELECT model, paired_diff_clustered(score, baseline, template_id), \
             variance_components(score, template_id), clustered_se_cr1(score, template_id) \
             FROM t WHERE model <> 'm3' GROUP BY model",
            "SELECT model, clustered_se(s, tpl) FROM \
             (SELECT model, score * 2 AS s, template_id AS tpl FROM t) GROUP BY model",
            // A filter on another column, then a projection that computes the score.
            "WITH s AS (SELECT model, template_id, \
             CASE WHEN score > 0 THEN 1.0 ELSE 0.0 END AS v FROM t WHERE baseline > 0) \
             SELECT model, clustered_mean_ci(v, template_id)['hi'] FROM s GROUP BY model",
        ];
        let kept = [
            // The cluster column is also a group key, a filter's column or another argument.
            "SELECT template_id, clustered_se(score, template_id) FROM t GROUP BY template_id",
            "SELECT model, clustered_se(score, template_id) FROM t \
             WHERE template_id <> 'template-0003' GROUP BY model",
            "SELECT model, clustered_se(score, template_id), count(DISTINCT template_id) \
             FROM t GROUP BY model",
        ];
        for (ctx, strings) in &sessions {
            for sql in rewritten.iter().chain(&kept) {
                let want = if rewritten.contains(sql) {
                    dict.clone()
                } else {
                    strings.clone()
                };
                assert_eq!(scanned_type(&plan(ctx, sql).await), Some(want), "{sql}");
                assert_eq!(scanned_type(&plan(&plain, sql).await), Some(DataType::Utf8));
                let (got, expected) = (rows(ctx, sql).await, rows(&plain, sql).await);
                assert!(!got.is_empty());
                assert!(same_rows(&got, &expected), "{sql}\n{got:?}\n{expected:?}");
            }
        }
        // Not a vacuous comparison: the ungrouped SE is a positive number.
        let one = rows(
            &sessions[1].0,
            "SELECT clustered_se(score, template_id) FROM t",
        )
        .await;
        assert!(one[0].parse::<f64>().unwrap() > 0.0, "{one:?}");
    }
}
