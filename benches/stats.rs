//! Benchmark of the statistics UDAFs against DataFusion built-ins, measured in the same run.
//!
//! Data: Parquet shaped like eval runs: 20 models x T templates x ~50 rows per (model,
//! template), T = 20,000 for the default 20 M rows; rows are in random template order within
//! each model (no help from sorted input). Every query runs 3 times; the best time counts.
//! Prints ratios (absolute times drift on shared machines) and each query's peak RSS (VmHWM,
//! reset before each query through /proc/self/clear_refs).
//!
//! "scan floor" reads the same columns and does next to nothing with them: no aggregate that
//! reads `template_id` and `score` can beat it, so two-level SQL / scan floor bounds the
//! speed-up any `clustered_se` implementation can show here. The bench prints that bound
//! beside the measured speed-up.
//!
//!     cargo bench --bench stats                     # 20 M rows
//!     EVALFLOW_BENCH_ROWS=2000000 cargo bench --bench stats
//!     cargo bench --profile dev --bench stats      # quicker build, deps at opt-level 2
//!     EVALFLOW_BENCH_TEMPLATES=2000 ...             # fix the clusters to see memory vs rows
//!     EVALFLOW_BENCH_CONTEXT=evalflow ...           # the `evalflow sql` context (Utf8, no views)

use std::fs::File;
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::arrow::array::{ArrayRef, Float64Array, RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};

const MODELS: usize = 20;
const ROWS_PER_CELL: usize = 50;
const TESTS: usize = 400; // 20 models x 400 tests = 8,000 groups

fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// SplitMix64: deterministic, no dependency.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn write_data(dir: &std::path::Path, rows: usize) -> usize {
    let templates = std::env::var("EVALFLOW_BENCH_TEMPLATES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(rows / (MODELS * ROWS_PER_CELL))
        .max(1);
    let per_model = rows / MODELS;
    let schema = Arc::new(Schema::new(vec![
        Field::new("model", DataType::Utf8, false),
        Field::new("test", DataType::Utf8, false),
        Field::new("template_id", DataType::Utf8, false),
        Field::new("score", DataType::Float64, true),
    ]));
    let batch = 1 << 16;
    let mut written = 0;
    // One file per 5 models so the scan has several files to split.
    for file_idx in 0..4 {
        let f = File::create(dir.join(format!("part-{file_idx}.parquet"))).unwrap();
        let mut w = ArrowWriter::try_new(f, schema.clone(), None).unwrap();
        for m in file_idx * 5..(file_idx + 1) * 5 {
            let model = format!("model-{m:02}");
            let mut start = 0;
            while start < per_model {
                let len = batch.min(per_model - start);
                let (mut tests, mut tpls, mut scores) = (
                    Vec::with_capacity(len),
                    Vec::with_capacity(len),
                    Vec::with_capacity(len),
                );
                for i in start..start + len {
                    let r = mix((m * per_model + i) as u64);
                    let t = (r % templates as u64) as usize;
                    let p = 0.5 + 0.4 * ((t as f64) * 0.37 + m as f64).sin();
                    let u = (mix(r) >> 11) as f64 / (1u64 << 53) as f64;
                    tests.push(format!("test-{:03}", t % TESTS));
                    tpls.push(format!("tpl-{t:06}"));
                    scores.push(if r.is_multiple_of(97) {
                        None
                    } else {
                        Some(if u < p { 1.0 } else { 0.0 })
                    });
                }
                let cols: Vec<ArrayRef> = vec![
                    Arc::new(StringArray::from(vec![model.as_str(); len])),
                    Arc::new(StringArray::from(tests)),
                    Arc::new(StringArray::from(tpls)),
                    Arc::new(Float64Array::from(scores)),
                ];
                w.write(&RecordBatch::try_new(schema.clone(), cols).unwrap())
                    .unwrap();
                start += len;
                written += len;
            }
        }
        w.close().unwrap();
    }
    written
}

/// Resets the peak RSS counter (Linux: writing 5 to clear_refs resets VmHWM).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

async fn time(ctx: &SessionContext, sql: &str) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let out = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        std::hint::black_box(out);
        best = best.min(t.elapsed());
    }
    best
}

#[tokio::main]
async fn main() {
    let rows: usize = std::env::var("EVALFLOW_BENCH_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000_000);
    let dir = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let written = write_data(dir.path(), rows);
    println!(
        "wrote {written} rows of Parquet in {:.1}s",
        t.elapsed().as_secs_f64()
    );

    // EVALFLOW_BENCH_CONTEXT=evalflow runs in the context `evalflow sql` gives users (plain
    // Utf8 strings, no view types); the default is DataFusion's own defaults.
    let ctx = if std::env::var("EVALFLOW_BENCH_CONTEXT").as_deref() == Ok("evalflow") {
        evalflow::query::new_context()
    } else {
        let ctx = SessionContext::new_with_config(SessionConfig::new());
        evalflow::udaf::register_all(&ctx);
        ctx
    };
    ctx.register_parquet(
        "t",
        dir.path().to_str().unwrap(),
        ParquetReadOptions::default(),
    )
    .await
    .unwrap();
    println!(
        "target_partitions = {}",
        ctx.copied_config().target_partitions()
    );

    let two_level = |group: &str, on: &str| {
        format!(
            "WITH c AS (SELECT {group} template_id, sum(score) AS s, count(score) AS k FROM t \
                        WHERE score IS NOT NULL GROUP BY {group} template_id), \
                  g AS (SELECT {group} avg(score) AS m, count(score) AS n, var_samp(score) AS v FROM t {gb}) \
             SELECT {sel} sqrt(sum((c.s - c.k * g.m) * (c.s - c.k * g.m)) / (max(g.n) * max(g.n)) + max(g.v) / (max(g.n) * max(g.n))) \
             FROM c {join} g {on} {gb2}",
            gb = if group.is_empty() {
                String::new()
            } else {
                format!("GROUP BY {}", group.trim_end_matches(", "))
            },
            sel = if group.is_empty() {
                String::new()
            } else {
                "c.model,".into()
            },
            join = if group.is_empty() {
                "CROSS JOIN"
            } else {
                "JOIN"
            },
            gb2 = if group.is_empty() {
                String::new()
            } else {
                "GROUP BY c.model".into()
            },
        )
    };
    let only = std::env::var("EVALFLOW_BENCH_ONLY").ok();
    let q = [
        (
            "scan floor",
            "SELECT max(length(template_id)), sum(score) FROM t".to_string(),
        ),
        (
            "avg+stddev",
            "SELECT avg(score), stddev(score) FROM t".to_string(),
        ),
        ("stddev", "SELECT stddev(score) FROM t".to_string()),
        ("mean_se", "SELECT mean_se(score) FROM t".to_string()),
        ("mean_ci", "SELECT mean_ci(score) FROM t".to_string()),
        (
            "clustered_se",
            "SELECT clustered_se(score, template_id) FROM t".to_string(),
        ),
        ("two-level SQL", two_level("", "")),
        (
            "model: scan floor",
            "SELECT model, max(length(template_id)), sum(score) FROM t GROUP BY model".to_string(),
        ),
        (
            "model: avg+stddev",
            "SELECT model, avg(score), stddev(score) FROM t GROUP BY model".to_string(),
        ),
        (
            "model: stddev",
            "SELECT model, stddev(score) FROM t GROUP BY model".to_string(),
        ),
        (
            "model: mean_se",
            "SELECT model, mean_se(score) FROM t GROUP BY model".to_string(),
        ),
        (
            "model: clustered_se",
            "SELECT model, clustered_se(score, template_id) FROM t GROUP BY model".to_string(),
        ),
        (
            "model: two-level SQL",
            two_level("model, ", "ON c.model = g.model"),
        ),
        (
            "8k: avg+stddev",
            "SELECT model, test, avg(score), stddev(score) FROM t GROUP BY model, test".to_string(),
        ),
        (
            "8k: stddev",
            "SELECT model, test, stddev(score) FROM t GROUP BY model, test".to_string(),
        ),
        (
            "8k: mean_se",
            "SELECT model, test, mean_se(score) FROM t GROUP BY model, test".to_string(),
        ),
        (
            "8k: mean_ci",
            "SELECT model, test, mean_ci(score) FROM t GROUP BY model, test".to_string(),
        ),
        (
            "8k: clustered_se",
            "SELECT model, test, clustered_se(score, template_id) FROM t GROUP BY model, test"
                .to_string(),
        ),
    ];
    // Sanity: the UDAF and the two-level SQL agree.
    let a = ctx
        .sql("SELECT clustered_se(score, template_id) FROM t")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let b = ctx
        .sql(&two_level("", ""))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    println!(
        "clustered_se UDAF {} vs two-level SQL {}",
        datafusion::arrow::util::pretty::pretty_format_columns("udaf", a[0].columns())
            .unwrap()
            .to_string()
            .lines()
            .nth(3)
            .unwrap_or(""),
        datafusion::arrow::util::pretty::pretty_format_columns("sql", b[0].columns())
            .unwrap()
            .to_string()
            .lines()
            .nth(3)
            .unwrap_or("")
    );
    let mut secs = std::collections::HashMap::new();
    for (name, sql) in &q {
        if let Some(only) = &only {
            // Profiling aid: run one query many times.
            if name == only {
                for _ in 0..20 {
                    time(&ctx, sql).await;
                }
                return;
            }
            continue;
        }
        reset_peak_rss();
        let d = time(&ctx, sql).await.as_secs_f64();
        println!("{name:>24}: {d:8.3}s   peak RSS {:6.0} MB", peak_rss_mb());
        secs.insert(*name, d);
    }
    let r = |a: &str, b: &str| secs[a] / secs[b];
    println!("\nratios (lower is better for the UDAF; target in brackets)");
    println!(
        "  mean_se / (avg+stddev)                 {:6.2}x  [<= 1.5]",
        r("mean_se", "avg+stddev")
    );
    println!(
        "  mean_ci / (avg+stddev)                 {:6.2}x  [<= 1.5]",
        r("mean_ci", "avg+stddev")
    );
    println!(
        "  two-level SQL / clustered_se           {:6.2}x  [>= 3, speed-up]",
        r("two-level SQL", "clustered_se")
    );
    println!(
        "    bound: two-level SQL / scan floor    {:6.2}x  (the most any aggregate reading these columns can reach)",
        r("two-level SQL", "scan floor")
    );
    println!(
        "  clustered_se / stddev                  {:6.2}x  [<= 4]",
        r("clustered_se", "stddev")
    );
    println!(
        "  GROUP BY model: mean_se / (avg+stddev) {:6.2}x  [<= 1.5]",
        r("model: mean_se", "model: avg+stddev")
    );
    println!(
        "  GROUP BY model: two-level / clustered  {:6.2}x  [>= 3, speed-up]",
        r("model: two-level SQL", "model: clustered_se")
    );
    println!(
        "    bound: two-level / scan floor        {:6.2}x  (scan + GROUP BY model alone)",
        r("model: two-level SQL", "model: scan floor")
    );
    println!(
        "  GROUP BY model: clustered_se / stddev  {:6.2}x  [<= 4]",
        r("model: clustered_se", "model: stddev")
    );
    println!(
        "  8k groups: mean_se / (avg+stddev)      {:6.2}x  [<= 1.5]",
        r("8k: mean_se", "8k: avg+stddev")
    );
    println!(
        "  8k groups: mean_ci / (avg+stddev)      {:6.2}x  [<= 1.5]",
        r("8k: mean_ci", "8k: avg+stddev")
    );
    println!(
        "  8k groups: clustered_se / stddev       {:6.2}x  [<= 4]",
        r("8k: clustered_se", "8k: stddev")
    );
    println!(
        "\npeak RSS (VmHWM) of the last query: {:.0} MB for {written} rows (per-query peaks above)",
        peak_rss_mb()
    );
}
