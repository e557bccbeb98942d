//! Call-stage throughput against the mock server: 50 ms latency, concurrency 256.
//!
//! Little's law bounds the rate at 256 / 0.05 s = 5,120 calls/s; the bench prints the
//! sustained rate (completions per second between the 10th and 90th percentile of
//! completion times, read back from the calls table) as a fraction of that bound (target
//! at least 0.9), the whole stage's rate (start-up and tail included) beside it, and the
//! client's CPU time per call (user + system time of this process, from /proc/self/stat,
//! i.e. getrusage's numbers without a libc dependency). The mock runs in a child process
//! (this binary re-run with `EVALFLOW_BENCH_MOCK=1`) so its CPU is not counted.
//! Run: `cargo bench --bench call`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LATENCY_MS: u64 = 50;
const CONCURRENCY: usize = 256;
const ITEMS: usize = 1000; // x 5 adjectives = 5,000 cases
const SAMPLES: usize = 5; // = 25,000 calls

/// CPU seconds (user + system) of this process so far.
fn cpu_secs() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = s.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5); `after` starts at field 3.
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0 // USER_HZ is 100 on Linux
}

/// Calls per second between the 10th and the 90th percentile of completion times
/// (`started_at + latency_ms` of every row): the steady state Little's law speaks of.
async fn steady_rate(root: &std::path::Path) -> f64 {
    use datafusion::arrow::array::{Array, AsArray};
    use datafusion::arrow::datatypes::{Float64Type, TimestampMicrosecondType};
    let ctx = datafusion::prelude::SessionContext::new();
    ctx.register_parquet(
        "calls",
        root.join("calls").to_str().unwrap(),
        Default::default(),
    )
    .await
    .unwrap();
    let batches = ctx
        .sql("SELECT started_at, latency_ms FROM calls")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let mut done: Vec<f64> = Vec::new();
    for b in &batches {
        let s = b.column(0).as_primitive::<TimestampMicrosecondType>();
        let l = b.column(1).as_primitive::<Float64Type>();
        for i in 0..b.num_rows() {
            if s.is_valid(i) && l.is_valid(i) {
                done.push(s.value(i) as f64 / 1e6 + l.value(i) / 1e3);
            }
        }
    }
    done.sort_by(f64::total_cmp);
    let (a, b) = (done.len() / 10, done.len() * 9 / 10);
    (b - a) as f64 / (done[b] - done[a])
}

fn main() {
    if std::env::var("EVALFLOW_BENCH_MOCK").is_ok() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let cfg = evalflow::mock::MockConfig {
                latency: Duration::from_millis(LATENCY_MS),
                ..Default::default()
            };
            let mut s = evalflow::mock::MockServer::start("127.0.0.1:0".parse().unwrap(), cfg)
                .await
                .unwrap();
            println!("listening on http://{}", s.addr);
            std::io::stdout().flush().unwrap();
            s.wait().await;
        });
        return;
    }
    let mut mock = Command::new(std::env::current_exe().unwrap())
        .env("EVALFLOW_BENCH_MOCK", "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(mock.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap()
        .to_string();

    let dir = tempfile::tempdir().unwrap();
    let items: Vec<String> = (0..ITEMS).map(|i| format!("\"{i}\"")).collect();
    let pipeline = format!(
        r#"[model]
provider = "openai"
base_url = "{addr}/v1"
name = "bench"
max_tokens = 16
concurrency = {CONCURRENCY}
samples = {SAMPLES}

[suite]
name = "bench"
max_cases_per_test = 1000000

[lexicons]
n = [{}]
adj = ["good", "bad", "fine", "awful", "great"]

[[test]]
name = "items"
capability = "Bench"
type = "MFT"
templates = ["Item {{n}} is {{adj}}."]
expected = "positive"
"#,
        items.join(", ")
    );
    let p = dir.path().join("bench.toml");
    std::fs::write(&p, pipeline).unwrap();
    let root = dir.path().join("run");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (calls, wall, cpu) = rt.block_on(async {
        let mut r = evalflow::runner::Runner::open(&p, Some(root.to_str().unwrap()))
            .await
            .unwrap();
        r.generate().await.unwrap();
        let (c0, t0) = (cpu_secs(), Instant::now());
        let stats = r.call().await.unwrap();
        (stats.sent, t0.elapsed().as_secs_f64(), cpu_secs() - c0)
    });
    let _ = mock.kill();
    let _ = mock.wait();
    let steady = rt.block_on(steady_rate(&root));
    let bound = CONCURRENCY as f64 / (LATENCY_MS as f64 / 1000.0);
    let rate = calls as f64 / wall;
    println!(
        "calls: {calls} in {wall:.2} s (concurrency {CONCURRENCY}, mock latency {LATENCY_MS} ms, journal + cache on, run root {})",
        dir.path().display()
    );
    println!("whole-stage rate: {rate:.0} calls/s; Little's-law bound {bound:.0} calls/s");
    println!(
        "whole stage (reading cases, hashing requests, ramp-up, tail, final commit): {:.3} of the bound",
        rate / bound
    );
    println!("sustained rate (10th to 90th percentile of completions): {steady:.0} calls/s");
    println!(
        "ratio sustained rate / bound: {:.3} (target >= 0.9)",
        steady / bound
    );
    println!(
        "client CPU per call: {:.1} us ({cpu:.2} s user+system)",
        cpu / calls as f64 * 1e6
    );
}
