//! Clustered aggregates in one phase, over every partition's rows.
//!
//! DataFusion aggregates on several partitions in two phases: a partial aggregate per input
//! partition, then a final one merging their states. That suits sums and counts, whose state is
//! a few numbers per group. A clustered aggregate's state is a group's clusters (sums per
//! template, [`super::clustered_acc`]), and the templates of a group are spread over every
//! partition: each partial accumulator then holds nearly all of them, and the final phase
//! builds them once more from its inputs' lists. On 10M imported calls (one template per
//! case) `evalflow sql` grouping `clustered_mean_ci` by model took 5.3 s and 794 MB on two
//! partitions against 2.2 s and 551 MB on one.
//!
//! This physical optimizer rule gives such an aggregate one phase: where a final aggregate
//! reads, through a repartition or a coalesce, a partial one that has a clustered function,
//! both become a single aggregate over the partial's input coalesced into one stream. The scan,
//! filters and projections below still run on every partition, in parallel; only the
//! accumulation is one stream, so the states are held once. When the final aggregate's output
//! was hash-partitioned (for a join or a window above), the single aggregate's few rows are
//! hash-partitioned the same way again, so every parent sees the partitioning it was planned
//! for.
//!
//! Written here because DataFusion chooses between one and two phases by the input's
//! partitioning only, with no notion of an accumulator whose state grows with the data.

use std::sync::Arc;

use datafusion::common::Result;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use super::dictionary_keys::cluster_arg;

/// The physical optimizer rule; see the module doc.
#[derive(Debug, Default)]
pub struct SinglePhaseClustered;

impl SinglePhaseClustered {
    /// The one-phase replacement of `node`, if it is the final half of a clustered aggregate.
    fn rewrite(node: &Arc<dyn ExecutionPlan>) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        let Some(last) = node.downcast_ref::<AggregateExec>() else {
            return Ok(None);
        };
        if !matches!(
            last.mode(),
            AggregateMode::Final | AggregateMode::FinalPartitioned
        ) {
            return Ok(None);
        }
        // Down to the partial aggregate through the exchange DataFusion put between them.
        let mut below = Arc::clone(last.input());
        while below.is::<RepartitionExec>() || below.is::<CoalescePartitionsExec>() {
            let [child] = below.children()[..] else {
                return Ok(None);
            };
            below = Arc::clone(child);
        }
        let Some(first) = below.downcast_ref::<AggregateExec>() else {
            return Ok(None);
        };
        let clustered = first
            .aggr_expr()
            .iter()
            .any(|a| cluster_arg(a.fun().name()).is_some());
        if *first.mode() != AggregateMode::Partial
            || !clustered
            || first.limit_options().is_some()
            || first.group_expr().has_grouping_set()
        {
            return Ok(None);
        }
        let input = Arc::clone(first.input());
        let input: Arc<dyn ExecutionPlan> = if input.output_partitioning().partition_count() > 1 {
            Arc::new(CoalescePartitionsExec::new(input))
        } else {
            input
        };
        let single = AggregateExec::try_new(
            AggregateMode::Single,
            first.group_expr().clone(),
            first.aggr_expr().to_vec(),
            first.filter_expr().to_vec(),
            input,
            first.input_schema(),
        )?;
        if single.schema() != last.schema() {
            tracing::debug!("a clustered aggregate keeps two phases: its one-phase schema differs");
            return Ok(None);
        }
        let single: Arc<dyn ExecutionPlan> = Arc::new(single);
        let partitioning = node.output_partitioning();
        if partitioning.partition_count() > 1 {
            return Ok(Some(Arc::new(RepartitionExec::try_new(
                single,
                partitioning.clone(),
            )?)));
        }
        Ok(Some(single))
    }
}

impl PhysicalOptimizerRule for SinglePhaseClustered {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| match Self::rewrite(&node)? {
            Some(new) => Ok(Transformed::yes(new)),
            None => Ok(Transformed::no(node)),
        })
        .data()
    }

    fn name(&self) -> &str {
        "evalflow_single_phase_clustered"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Float64Array, RecordBatch, StringArray};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::arrow::util::display::array_value_to_string;
    use datafusion::datasource::MemTable;
    use datafusion::execution::SessionStateBuilder;
    use datafusion::prelude::{SessionConfig, SessionContext};

    /// Three partitions of small batches: 4 models, 60 templates spread over all of them.
    fn table() -> MemTable {
        let schema = Arc::new(Schema::new(vec![
            Field::new("model", DataType::Utf8, false),
            Field::new("template_id", DataType::Utf8, true),
            Field::new("score", DataType::Float64, true),
        ]));
        let mut parts = vec![vec![]; 3];
        let mut r: u64 = 11;
        for b in 0..12 {
            let (mut m, mut t, mut s) = (vec![], vec![], vec![]);
            for _ in 0..50 {
                r = r
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let x = r >> 33;
                let tpl = x % 60;
                m.push(format!("m{}", (x >> 8) % 4));
                t.push((!x.is_multiple_of(37)).then(|| format!("t{tpl:02}")));
                s.push(Some(f64::from(u8::from((x >> 16) % 10 < tpl % 10))));
            }
            let batch = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(StringArray::from(m)),
                    Arc::new(StringArray::from(t)),
                    Arc::new(Float64Array::from(s)),
                ],
            )
            .unwrap();
            parts[b % 3].push(batch);
        }
        MemTable::try_new(schema, parts).unwrap()
    }

    /// A three-partition session, with the rule or as DataFusion plans by itself.
    fn session(rule: bool) -> SessionContext {
        let mut b = SessionStateBuilder::new()
            .with_config(
                SessionConfig::new()
                    .with_target_partitions(3)
                    // Joins hash-partitioned on both sides, however small the tables.
                    .set_usize(
                        "datafusion.optimizer.hash_join_single_partition_threshold",
                        0,
                    )
                    .set_usize(
                        "datafusion.optimizer.hash_join_single_partition_threshold_rows",
                        0,
                    ),
            )
            .with_default_features();
        if rule {
            b = b.with_physical_optimizer_rule(Arc::new(SinglePhaseClustered));
        }
        let ctx = SessionContext::new_with_state(b.build());
        super::super::register_all(&ctx);
        ctx.register_table("t", Arc::new(table())).unwrap();
        ctx
    }

    /// The modes of the plan's aggregates, top down.
    fn modes(plan: &Arc<dyn ExecutionPlan>) -> Vec<AggregateMode> {
        let mut out = vec![];
        if let Some(a) = plan.downcast_ref::<AggregateExec>() {
            out.push(*a.mode());
        }
        for c in plan.children() {
            out.extend(modes(c));
        }
        out
    }

    async fn run(ctx: &SessionContext, sql: &str) -> (Vec<AggregateMode>, Vec<String>) {
        let df = ctx.sql(sql).await.unwrap();
        let plan = df.clone().create_physical_plan().await.unwrap();
        let batches = df.collect().await.unwrap();
        let mut rows = vec![];
        for b in &batches {
            for i in 0..b.num_rows() {
                let cells: Vec<String> = b
                    .columns()
                    .iter()
                    .map(|c| array_value_to_string(c, i).unwrap())
                    .collect();
                rows.push(cells.join(" | "));
            }
        }
        rows.sort();
        (modes(&plan), rows)
    }

    /// Numbers equal to a relative 1e-12 (the rows arrive in another order, so sums do).
    fn same(a: &[String], b: &[String]) -> bool {
        let tokens = |s: &str| -> Vec<String> {
            s.split([',', ' ', '}', '{', ':', '|'])
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
                            (Ok(p), Ok(q)) => (p - q).abs() <= 1e-12 * p.abs().max(q.abs()),
                            _ => u == v,
                        })
            })
    }

    #[tokio::test]
    async fn clustered_aggregates_run_in_one_phase_with_the_two_phase_results() {
        let (ctx, plain) = (session(true), session(false));
        let single = vec![AggregateMode::Single];
        for (sql, want) in [
            (
                "SELECT model, clustered_mean_ci(score, template_id), count(*) \
                 FROM t GROUP BY model",
                single.clone(),
            ),
            (
                "SELECT clustered_se(score, template_id), sum(score) FROM t",
                single.clone(),
            ),
            (
                "SELECT model, paired_diff_clustered(score, 1.0 - score, template_id) \
                 FROM t WHERE model <> 'm2' GROUP BY model",
                single.clone(),
            ),
            // No clustered function: DataFusion's two phases stay.
            (
                "SELECT model, sum(score), count(template_id) FROM t GROUP BY model",
                vec![AggregateMode::FinalPartitioned, AggregateMode::Partial],
            ),
        ] {
            let (got_modes, got) = run(&ctx, sql).await;
            let (plain_modes, expected) = run(&plain, sql).await;
            assert_eq!(got_modes, want, "{sql}");
            assert_ne!(
                plain_modes, single,
                "{sql}: DataFusion alone plans two phases"
            );
            assert_eq!(
                got.len(),
                if sql.contains("GROUP BY") {
                    4 - usize::from(sql.contains("m2"))
                } else {
                    1
                }
            );
            assert!(same(&got, &expected), "{sql}\n{got:?}\n{expected:?}");
        }
        // A join above the aggregate, planned for its hash-partitioned output: the one-phase
        // rows are partitioned again the same way, so every model still finds its match.
        let sql = "WITH a AS (SELECT model, clustered_se(score, template_id) AS se FROM t \
                   GROUP BY model), b AS (SELECT model, count(*) AS n FROM t GROUP BY model) \
                   SELECT a.model, se, n FROM a JOIN b ON a.model = b.model";
        let (got_modes, got) = run(&ctx, sql).await;
        let (_, expected) = run(&plain, sql).await;
        assert!(got_modes.contains(&AggregateMode::Single), "{got_modes:?}");
        assert_eq!(got.len(), 4, "{got:?}");
        assert!(same(&got, &expected), "{got:?}\n{expected:?}");
        // Not vacuous: the SEs are positive numbers.
        assert!(
            got.iter()
                .all(|r| r.split(" | ").nth(1).unwrap().parse::<f64>().unwrap() > 0.0)
        );
    }
}
