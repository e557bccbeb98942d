//! Clustered statistics on run-shaped data, against DuckDB on the same files in the same run.
//!
//! Data: 20 models x T templates (T = rows / 1000, 20,000 for the default 20 M rows; every
//! template is shared by every model), `model` and `template_id` as Utf8 strings
//! (`template_id` like evalflow's `suite/test/tN`, longer than 12 bytes), a nullable `score`
//! and a `baseline` score, written as evalflow writes a table: parts of
//! [`evalflow::storage::PART_ROWS`] rows with [`evalflow::storage::parquet_props`]. Two
//! layouts of the same shape:
//! - `interleaved`: rows in completion order, every batch holds every model and template
//!   (how the call stage writes a run);
//! - `sorted`: rows ordered by model, templates in random order within a model.
//!
//! A third layout, `interleaved-dict` (only when named in `EVALFLOW_BENCH_LAYOUT`), is
//! `interleaved` with `template_id` declared `Dictionary(Int32, Utf8)` in the files' Arrow
//! schema, so the Parquet reader hands the accumulator dictionary arrays: it measures what
//! reading cluster keys as dictionaries would gain.
//!
//! evalflow runs in the context `evalflow sql` gives users ([`evalflow::query::new_context`],
//! table registered like `--table`); DuckDB (the Python package, 2 threads) runs
//! `scripts/bench_duckdb.py` on the same files. Every query runs 3 times; the best
//! in-process time counts. Prints each time, the peak RSS of each evalflow query (VmHWM of a
//! fresh process running that query once, as `evalflow sql` would), and the ratios the
//! targets are stated in.
//!
//! ```text
//! cargo bench --bench clustered                          # 20 M rows, both layouts
//! EVALFLOW_BENCH_ROWS=2000000 cargo bench --bench clustered
//! EVALFLOW_BENCH_LAYOUT=interleaved cargo bench --bench clustered
//! EVALFLOW_BENCH_ONLY='model: clustered_se' ...           # profiling aid: one query, 20 times
//! EVALFLOW_BENCH_DATA=/tmp/x ...                          # where data is written (kept, reused)
//! ```
//! Without `python3 -c 'import duckdb'` working, DuckDB columns print `-`.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::arrow::array::{ArrayRef, DictionaryArray, Float64Array, RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Int32Type, Schema};
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::prelude::SessionContext;

/// The allocator the `evalflow` binary runs with (src/main.rs), so the times are those of
/// `evalflow sql`.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const MODELS: usize = 20;
const ROWS_PER_TEMPLATE: usize = 1000; // 50 per (model, template)
const TESTS: usize = 400;

/// SplitMix64: deterministic, no dependency.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn unit(r: u64) -> f64 {
    (r >> 11) as f64 / (1u64 << 53) as f64
}

/// Writes `rows` rows as parts of `PART_ROWS` rows; `sorted` orders them by model, `dict`
/// declares `template_id` a dictionary.
fn write_layout(dir: &Path, rows: usize, sorted: bool, dict: bool) {
    std::fs::create_dir_all(dir).unwrap();
    let templates = (rows / ROWS_PER_TEMPLATE).max(1);
    let schema = Arc::new(Schema::new(vec![
        Field::new("model", DataType::Utf8, false),
        Field::new(
            "template_id",
            if dict {
                DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8))
            } else {
                DataType::Utf8
            },
            false,
        ),
        Field::new("score", DataType::Float64, true),
        Field::new("baseline", DataType::Float64, true),
    ]));
    let part = evalflow::storage::PART_ROWS;
    let per_model = rows.div_ceil(MODELS);
    for (n, start) in (0..rows).step_by(part).enumerate() {
        let len = part.min(rows - start);
        let tmp = dir.join(format!("part-{n:05}.parquet.tmp"));
        let mut w = ArrowWriter::try_new(
            File::create(&tmp).unwrap(),
            schema.clone(),
            Some(evalflow::storage::parquet_props(&schema)),
        )
        .unwrap();
        let (mut models, mut tpls, mut scores, mut bases) = (
            Vec::with_capacity(len),
            Vec::with_capacity(len),
            Vec::with_capacity(len),
            Vec::with_capacity(len),
        );
        for i in start..start + len {
            let r = mix(i as u64);
            let m = if sorted {
                i / per_model
            } else {
                (r % MODELS as u64) as usize
            };
            let t = ((r >> 16) % templates as u64) as usize;
            let p = 0.5 + 0.4 * ((t as f64) * 0.37 + m as f64).sin();
            let q = 0.5 + 0.4 * ((t as f64) * 0.37).sin();
            models.push(format!("model-{m:02}"));
            tpls.push(format!("bench/test-{:03}/t{}", t % TESTS, t / TESTS));
            scores.push((!r.is_multiple_of(97)).then(|| f64::from(unit(mix(r)) < p)));
            bases.push(Some(f64::from(unit(mix(r ^ 1)) < q)));
        }
        let cols: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from(models)),
            if dict {
                Arc::new(
                    tpls.iter()
                        .map(String::as_str)
                        .collect::<DictionaryArray<Int32Type>>(),
                )
            } else {
                Arc::new(StringArray::from(tpls))
            },
            Arc::new(Float64Array::from(scores)),
            Arc::new(Float64Array::from(bases)),
        ];
        w.write(&RecordBatch::try_new(schema.clone(), cols).unwrap())
            .unwrap();
        w.close().unwrap();
        std::fs::rename(&tmp, dir.join(format!("part-{n:05}.parquet"))).unwrap();
    }
}

/// The folder of `layout` with `rows` rows, written unless a finished copy exists.
fn data(rows: usize, layout: &str) -> PathBuf {
    let root = std::env::var_os("EVALFLOW_BENCH_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("evalflow-bench-clustered"));
    let dir = root.join(format!("{layout}-{rows}"));
    let done = root.join(format!("{layout}-{rows}.done"));
    if !done.exists() {
        let _ = std::fs::remove_dir_all(&dir);
        let t = Instant::now();
        write_layout(&dir, rows, layout == "sorted", layout.ends_with("-dict"));
        std::fs::write(&done, "").unwrap();
        println!(
            "wrote {rows} rows ({layout}) in {:.1}s to {}",
            t.elapsed().as_secs_f64(),
            dir.display()
        );
    }
    dir
}

fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Names the query a child process of this bench runs alone (see [`child_peak_rss`]).
const RSS_CHILD: &str = "EVALFLOW_BENCH_RSS_CHILD";

/// The peak RSS, in MB, of a fresh process that opens the table and runs query `name` once,
/// as `evalflow sql` would. Measured in a child because an earlier query's freed memory,
/// still held by the allocator, would count in this process (resetting VmHWM through
/// `/proc/self/clear_refs` only lowers it to the RSS at that moment).
fn child_peak_rss(rows: usize, layout: &str, name: &str) -> f64 {
    let out = Command::new(std::env::current_exe().expect("the bench's own path"))
        .env(RSS_CHILD, name)
        .env("EVALFLOW_BENCH_ROWS", rows.to_string())
        .env("EVALFLOW_BENCH_LAYOUT", layout)
        .env_remove("EVALFLOW_BENCH_ONLY")
        .output()
        .expect("the bench runs itself");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or(f64::NAN)
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

fn two_level(grouped: bool) -> String {
    let (g, gb, sel, join) = if grouped {
        ("model, ", "GROUP BY model", "c.model, ", "JOIN")
    } else {
        ("", "", "", "CROSS JOIN")
    };
    format!(
        "WITH c AS (SELECT {g}template_id, sum(score) AS s, count(score) AS k FROM t \
                    WHERE score IS NOT NULL GROUP BY {g}template_id), \
              g AS (SELECT {g}avg(score) AS m, count(score) AS n, var_samp(score) AS v FROM t {gb}) \
         SELECT {sel}sqrt(sum((c.s - c.k * g.m) * (c.s - c.k * g.m)) / (max(g.n) * max(g.n)) \
                + max(g.v) / (max(g.n) * max(g.n))) \
         FROM c {join} g {on} {gb2}",
        on = if grouped { "ON c.model = g.model" } else { "" },
        gb2 = if grouped { "GROUP BY c.model" } else { "" },
    )
}

/// DuckDB's best times (and its per-model clustered SE) on `dir`, if DuckDB runs here.
fn duckdb(dir: &Path) -> Option<serde_json::Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/bench_duckdb.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(dir)
        .arg("2")
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "DuckDB skipped: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

async fn run_layout(rows: usize, layout: &str, only: Option<&str>) {
    let dir = data(rows, layout);
    let ctx = evalflow::query::new_context();
    evalflow::query::register_parquet(&ctx, "t", dir.to_str().unwrap())
        .await
        .unwrap();
    let q: Vec<(&str, String)> = vec![
        (
            "model: scan floor",
            "SELECT model, max(length(template_id)), sum(score) FROM t GROUP BY model".into(),
        ),
        (
            "model: avg+stddev",
            "SELECT model, avg(score), stddev(score) FROM t GROUP BY model".into(),
        ),
        (
            "model: clustered_se",
            "SELECT model, clustered_se(score, template_id) FROM t GROUP BY model".into(),
        ),
        ("model: two-level SQL", two_level(true)),
        (
            "clustered_se",
            "SELECT clustered_se(score, template_id) FROM t".into(),
        ),
        ("two-level SQL", two_level(false)),
        (
            "model: clustered_mean_ci",
            "SELECT model, clustered_mean_ci(score, template_id) FROM t GROUP BY model".into(),
        ),
        (
            "model: paired_diff_clustered",
            "SELECT model, paired_diff_clustered(score, baseline, template_id) FROM t \
             GROUP BY model"
                .into(),
        ),
        (
            "model: variance_components",
            "SELECT model, variance_components(score, template_id) FROM t GROUP BY model".into(),
        ),
    ];
    if let Ok(name) = std::env::var(RSS_CHILD) {
        // The child of `child_peak_rss`: the one query, once, then this process's peak.
        let (_, sql) = q.iter().find(|(n, _)| *n == name).expect("a query name");
        ctx.sql(sql).await.unwrap().collect().await.unwrap();
        println!("{}", peak_rss_mb());
        return;
    }
    if let Some(only) = only {
        if let Some((_, sql)) = q.iter().find(|(n, _)| *n == only) {
            for _ in 0..20 {
                time(&ctx, sql).await;
            }
        }
        return;
    }
    let duck = duckdb(&dir);
    // Both engines agree on the clustered SE of every model.
    if let Some(check) = duck.as_ref().and_then(|d| d.get("clustered_se check")) {
        let got = ctx
            .sql("SELECT model, clustered_se(score, template_id) FROM t GROUP BY model")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let mut worst: f64 = 0.0;
        for b in &got {
            let m = datafusion::arrow::compute::cast(b.column(0), &DataType::Utf8).unwrap();
            let m = m.as_any().downcast_ref::<StringArray>().unwrap();
            let se = b.column(1).as_any().downcast_ref::<Float64Array>().unwrap();
            for i in 0..b.num_rows() {
                let want = check[m.value(i)].as_f64().unwrap();
                worst = worst.max((se.value(i) - want).abs() / want);
            }
        }
        println!("clustered_se vs DuckDB two-level SQL: largest relative difference {worst:.1e}");
    }
    let duck_secs = |name: &str| duck.as_ref().and_then(|d| d[name].as_f64());
    let mut secs = HashMap::new();
    println!("\n{layout} layout, {rows} rows");
    println!(
        "{:>30} {:>9} {:>9} {:>11} {:>9}",
        "query", "evalflow", "peak RSS", "DuckDB", "ratio"
    );
    for (name, sql) in &q {
        let d = time(&ctx, sql).await.as_secs_f64();
        let rss = child_peak_rss(rows, layout, name);
        secs.insert(*name, d);
        let (duck_col, ratio) = match duck_secs(name) {
            Some(s) => (format!("{s:9.3}s"), format!("{:8.2}x", d / s)),
            None => ("-".into(), "-".into()),
        };
        println!("{name:>30} {d:8.3}s {rss:6.0} MB {duck_col:>11} {ratio:>9}");
    }
    let floor = secs["model: scan floor"];
    let se = secs["model: clustered_se"];
    println!("ratios ({layout}; target in brackets)");
    if let Some(d2) = duck_secs("model: two-level SQL") {
        println!(
            "  GROUP BY model: clustered_se / DuckDB two-level SQL      {:6.2}x  [<= 0.5]",
            se / d2
        );
    }
    println!(
        "  GROUP BY model: clustered_se / evalflow scan floor      {:6.2}x  [<= 2]",
        se / floor
    );
    println!(
        "  GROUP BY model: DataFusion two-level SQL / clustered_se {:6.2}x",
        secs["model: two-level SQL"] / se
    );
    if let Some(d2) = duck_secs("two-level SQL") {
        println!(
            "  no GROUP BY: clustered_se / DuckDB two-level SQL        {:6.2}x",
            secs["clustered_se"] / d2
        );
    }
    if let Some(f) = duck_secs("model: scan floor") {
        println!(
            "  scan floor: evalflow / DuckDB                           {:6.2}x",
            floor / f
        );
    }
}

#[tokio::main]
async fn main() {
    let rows: usize = std::env::var("EVALFLOW_BENCH_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000_000);
    let only = std::env::var("EVALFLOW_BENCH_ONLY").ok();
    let layouts = match std::env::var("EVALFLOW_BENCH_LAYOUT") {
        Ok(l) => vec![l],
        Err(_) => vec!["interleaved".to_string(), "sorted".to_string()],
    };
    for layout in &layouts {
        run_layout(rows, layout, only.as_deref()).await;
    }
}
