//! Re-scoring throughput and memory: N archived answers of about 400 characters (mixed
//! English and Chinese, naming a brand with recommendation or rejection cues) are written as
//! a run, then re-scored with the cue scorer. Prints MB of answer text per second of wall
//! time and per CPU-second (getrusage over the scoring phase), and peak RSS of the scoring
//! phase (VmHWM reset before it).
//!
//! The same run is then re-scored with two user scorers written as data (issue 18): a SQL
//! scorer (its expressions evaluated over whole batches) and the same rule as a regex
//! scorer (row by row), each printed with its time as a ratio of the cue scorer's.
//!
//! Each size runs in its own child process.
//!
//! ```text
//! cargo bench --profile dev --bench rescore                 # 1M and 5M
//! cargo bench --profile dev --bench rescore -- 100000 500000
//! ```

use std::process::Command;
use std::time::Instant;

use evalflow::schema::Table;
use evalflow::stages::call::{self, CallRequest, CallResult, CallRow};
use evalflow::stages::generate::{self, Case};
use evalflow::storage::RunStore;

const EN: &[&str] = &[
    "For a small team on a budget I would recommend Asana because it is simple to start with and the free tier covers most needs.",
    "Asana is not recommended here since the paid tiers are over budget and the features you need sit behind them.",
    "Several tools could work; Asana is one of them, alongside Trello and Notion, each with different trade-offs for planning.",
];
const ZH: &[&str] = &[
    "对于预算有限的小团队，建议使用 Asana，因为它上手简单，免费版已经覆盖了大部分需求，也方便以后扩展。",
    "之前推荐的一些顶配品牌（如 Asana、Monday.com 的付费版）基本都超了，不建议强行上付费版，可以先用免费工具。",
];

fn answer(i: usize) -> String {
    let mut s = String::new();
    let mut k = i;
    while s.chars().count() < 380 {
        let part = if k.is_multiple_of(3) {
            ZH[k % ZH.len()]
        } else {
            EN[k % EN.len()]
        };
        s.push_str(part);
        s.push(' ');
        k = k.wrapping_mul(31).wrapping_add(7);
    }
    s
}

fn cpu_seconds() -> f64 {
    // utime + stime of this process from /proc/self/stat (fields 14 and 15, in clock ticks).
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}

fn vm_hwm_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

async fn child(n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let store = RunStore::open(dir.path().to_str().unwrap()).unwrap();
    let p = evalflow::pipeline::Pipeline::parse(
        "[model]\nprovider = \"builtin:vader\"\nname = \"recorded\"\n[suite]\nname = \"b\"\n",
        std::path::Path::new("b.toml"),
    )
    .unwrap();
    let mut cw = store.part_writer("cases", Table::Cases.schema(), "part");
    let mut kw = store.part_writer("calls", Table::Calls.schema(), "part");
    let mut bytes = 0usize;
    let chunk = 20_000;
    for start in (0..n).step_by(chunk) {
        let end = (start + chunk).min(n);
        let cases: Vec<Case> = (start..end)
            .map(|i| Case {
                case_id: format!("case{i:08}"),
                suite: "b".into(),
                test: "brand".into(),
                capability: "Attribution".into(),
                test_type: "MFT".into(),
                template_id: format!("t{}", i % 1000),
                group_id: format!("case{i:08}"),
                role: "single".into(),
                input: "Which tool should a small team use?".into(),
                expected: Some("Asana".into()),
                expectation: None,
                tolerance: None,
                perturbation: None,
            })
            .collect();
        let rows: Vec<CallRow> = (start..end)
            .map(|i| {
                let a = answer(i);
                bytes += a.len();
                CallRow {
                    req: CallRequest {
                        call_id: format!("call{i:08}"),
                        case_id: format!("case{i:08}"),
                        input: String::new(),
                        prompt: String::new(),
                        system: None,
                        sample_idx: 0,
                        max_tokens: None,
                        temperature: None,
                        request_hash: "r".into(),
                        prior_attempts: 0,
                    },
                    res: CallResult {
                        response: Some(a),
                        finish_reason: Some("stop".into()),
                        http_status: Some(200),
                        attempts: 1,
                        ..Default::default()
                    },
                    latency_ms: 1.0,
                    started_at_us: 0,
                }
            })
            .collect();
        cw.write(generate::to_batch(&cases)).await.unwrap();
        kw.write(call::to_batch(&p.model, &rows)).await.unwrap();
    }
    cw.finish().await.unwrap();
    kw.finish().await.unwrap();
    evalflow::stages::validate::run(&store, &["en".into(), "zh".into()])
        .await
        .unwrap();
    let scorer = evalflow::stages::score::build("cue", None).unwrap();
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let rows = evalflow::stages::score::run(&store, scorer.as_ref())
        .await
        .unwrap();
    let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
    let mb = bytes as f64 / 1e6;
    println!(
        "rows {rows}: {mb:.0} MB of answers re-scored in {wall:.1} s wall, {cpu:.1} CPU-s: {:.1} MB/s wall, {:.1} MB per CPU-second; peak RSS while scoring {:.0} MB",
        mb / wall,
        mb / cpu.max(1e-9),
        vm_hwm_mb()
    );
    let defs = evalflow::stages::score::user::parse_text(USER_SCORERS, "bench.toml").unwrap();
    for def in &defs {
        let s = evalflow::stages::score::user::prepare(def, &store, None)
            .await
            .unwrap();
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let (t0, c0) = (Instant::now(), cpu_seconds());
        let n = evalflow::stages::score::run(&store, s.as_ref())
            .await
            .unwrap();
        let (w, c) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        println!(
            "  {} scorer `{}`, {n} rows: {w:.1} s wall ({:.2}x the cue scorer), {c:.1} CPU-s, {:.1} MB/s wall; peak RSS {:.0} MB",
            def.kind.as_str(),
            def.name,
            w / wall,
            mb / w,
            vm_hwm_mb()
        );
    }
}

/// The same rule twice: SQL over whole batches, and a regex scorer row by row.
const USER_SCORERS: &str = r#"
[[scorer]]
name = "recommends_sql"
kind = "sql"
metric = "pass_fail"
passed = '''regexp_like(response, '(?i)\brecommend')'''
label = '''CASE WHEN regexp_like(response, '(?i)\brecommend') THEN 'pass' ELSE 'fail' END'''

[[scorer]]
name = "recommends_regex"
kind = "regex"
metric = "pass_fail"
patterns = ['(?i)\brecommend']
"#;

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if let Some(n) = std::env::var("EVALFLOW_RESCORE_CHILD")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        tokio::runtime::Runtime::new().unwrap().block_on(child(n));
        return;
    }
    let sizes: Vec<usize> = if args.is_empty() {
        vec![1_000_000, 5_000_000]
    } else {
        args.iter().filter_map(|a| a.parse().ok()).collect()
    };
    for n in sizes {
        let out = Command::new(std::env::current_exe().unwrap())
            .env("EVALFLOW_RESCORE_CHILD", n.to_string())
            .output()
            .unwrap();
        print!("{}", String::from_utf8_lossy(&out.stdout));
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
    }
}
