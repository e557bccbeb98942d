//! Generate throughput and memory: expands a suite into N cases written to Parquet
//! (`cases/part-*.parquet` through the run store's `PartWriter`), and reports cases per
//! second and peak RSS (VmHWM from /proc/self/status).
//!
//! Each size runs in its own child process, so each peak RSS is that run's own. Memory
//! must not grow with case count: the 10M run's peak should equal the 1M run's.
//!
//! ```text
//! cargo bench --profile dev --bench generate                # 1M and 10M
//! cargo bench --profile dev --bench generate -- 200000 2000000
//! ```

use std::process::Command;
use std::time::Instant;

use evalflow::runner::Runner;

/// A suite of `n` cases: half MFT sampled from a 10^8-combination template, half INV
/// (one base and two typo variants each).
fn suite(n: u64) -> String {
    let words: Vec<String> = (0..100).map(|i| format!("\"w{i:02}\"")).collect();
    let words = words.join(", ");
    let mft = n / 2;
    let inv_bases = (n - mft) / 3;
    format!(
        r#"
[model]
provider = "builtin:vader"
name = "vader"

[suite]
name = "bench"
seed = 1
max_expansion = 10000000000

[lexicons]
w = [{words}]
adj = ["good", "bad", "fine", "great", "awful", "poor", "nice", "lovely", "terrible", "okay"]

[[test]]
name = "mft"
capability = "Vocabulary"
type = "MFT"
templates = ["The {{w}} and the {{w2}} near {{w3}} were {{adj}} for {{w4}}."]
expected = "positive"
max_cases = {mft}

[[test]]
name = "inv"
capability = "Robustness"
type = "INV"
templates = ["I think the {{w}} of the {{w2}} at {{w3}} was {{adj}} and {{adj2}}."]
perturb = {{ op = "typos", count = 1 }}
n_perturb = 2
max_cases = {inv_bases}
"#
    )
}

fn vm_hwm_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Child: generate `n` cases and print `rows seconds hwm_kb`.
fn child(n: u64) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("bench.toml");
    std::fs::write(&path, suite(n)).expect("write suite");
    let out = dir.path().join("run");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let t0 = Instant::now();
    let rows = rt.block_on(async {
        let mut r = Runner::open(&path, Some(out.to_str().unwrap()))
            .await
            .expect("open");
        r.generate().await.expect("generate")
    });
    let secs = t0.elapsed().as_secs_f64();
    println!("{rows} {secs} {}", vm_hwm_kb());
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if args.first().map(String::as_str) == Some("--child") {
        child(args[1].parse().expect("case count"));
        return;
    }
    let sizes: Vec<u64> = if args.is_empty() {
        vec![1_000_000, 10_000_000]
    } else {
        args.iter()
            .map(|a| a.parse().expect("case count"))
            .collect()
    };
    let exe = std::env::current_exe().expect("own path");
    println!(
        "generate: suite -> cases/*.parquet (profile: {})",
        if cfg!(debug_assertions) {
            "dev (deps opt-level 2)"
        } else {
            "release"
        }
    );
    println!(
        "{:>12} {:>10} {:>14} {:>14}",
        "cases", "seconds", "cases/s", "peak RSS MiB"
    );
    let mut results = Vec::new();
    for n in sizes {
        let o = Command::new(&exe)
            .args(["--child", &n.to_string()])
            .output()
            .expect("child");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let line = String::from_utf8_lossy(&o.stdout);
        let f: Vec<f64> = line
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        let (rows, secs, kb) = (f[0], f[1], f[2]);
        println!(
            "{:>12} {:>10.1} {:>14.0} {:>14.1}",
            rows,
            secs,
            rows / secs,
            kb / 1024.0
        );
        results.push((rows, secs, kb));
    }
    if results.len() >= 2 {
        let (a, b) = (results[0], results[results.len() - 1]);
        println!(
            "ratio last/first: cases x{:.1}, throughput x{:.2}, peak RSS x{:.2}",
            b.0 / a.0,
            (b.0 / b.1) / (a.0 / a.1),
            b.2 / a.2
        );
    }
}
