//! The same plans on a Ballista cluster: one scheduler and two executors started from the
//! built binary on loopback (free ports, killed at the end), with moto's S3 server as the
//! object store. Every statistics function gives the same numbers on the cluster as locally
//! (GROUP BY over several files, so partial states cross a real shuffle between executors);
//! `rescore` and `aggregate` of a run on s3:// through the cluster write the same tables as
//! a local run; an executor killed mid-query either lets the query complete on the other one
//! or fails it with a clear error.
#![cfg(feature = "ballista")]

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_evalflow"))
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A child process killed when the test ends, however it ends.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_port(port: u16, what: &str, child: &mut Child) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        if let Ok(Some(status)) = child.try_wait() {
            let mut err = String::new();
            if let Some(e) = child.stderr.as_mut() {
                let _ = e.read_to_string(&mut err);
            }
            panic!("{what} exited with {status} before listening on {port}: {err}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what} did not listen on 127.0.0.1:{port} within 60 s");
}

/// moto's S3 server, a scheduler and two executors, all on loopback.
struct Cluster {
    url: String,
    endpoint: String,
    executors: Vec<KillOnDrop>,
    _scheduler: KillOnDrop,
    _moto: KillOnDrop,
    _work: tempfile::TempDir,
}

const BUCKET: &str = "evalflow-cluster";

impl Cluster {
    fn start() -> Cluster {
        let moto_port = free_port();
        let moto = Command::new("python3")
            .args(["-m", "moto.server", "-H", "127.0.0.1", "-p"])
            .arg(moto_port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "python3 runs moto's server (python3 -m pip install 'moto[server]'; .ci/run does)",
            );
        let moto = KillOnDrop(moto);
        let addr = format!("127.0.0.1:{moto_port}");
        let mut created = false;
        for _ in 0..150 {
            if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
                write!(s, "PUT /{BUCKET} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").unwrap();
                let mut resp = String::new();
                let _ = s.read_to_string(&mut resp);
                if resp.starts_with("HTTP/1.1 200") {
                    created = true;
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(created, "moto's server did not start on {addr}");
        let endpoint = format!("http://{addr}");
        let work = tempfile::tempdir().unwrap();

        let sched_port = free_port();
        let mut scheduler = Self::cmd(&endpoint)
            .args(["scheduler", "--bind"])
            .arg(format!("127.0.0.1:{sched_port}"))
            .args(["--executor-timeout", "6"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_port(sched_port, "scheduler", &mut scheduler);
        let scheduler = KillOnDrop(scheduler);
        let url = format!("df://127.0.0.1:{sched_port}");
        let mut executors = Vec::new();
        for i in 0..2 {
            let (flight, grpc) = (free_port(), free_port());
            let mut e = Self::cmd(&endpoint)
                .args(["executor", "--scheduler", &url, "--bind"])
                .arg(format!("127.0.0.1:{flight}"))
                .arg("--grpc-bind")
                .arg(format!("127.0.0.1:{grpc}"))
                .args(["--slots", "2", "--heartbeat", "1", "--work-dir"])
                .arg(work.path().join(format!("executor-{i}")))
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            wait_port(flight, "executor", &mut e);
            wait_port(grpc, "executor", &mut e);
            executors.push(KillOnDrop(e));
        }
        Cluster {
            url,
            endpoint,
            executors,
            _scheduler: scheduler,
            _moto: moto,
            _work: work,
        }
    }

    /// How many objects moto holds under `prefix` of the bucket (one page of a listing).
    fn keys(&self, prefix: &str) -> usize {
        let addr = self.endpoint.trim_start_matches("http://");
        let Ok(mut s) = std::net::TcpStream::connect(addr) else {
            return 0;
        };
        let _ = write!(
            s,
            "GET /{BUCKET}?list-type=2&prefix={prefix} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        );
        let mut resp = String::new();
        let _ = s.read_to_string(&mut resp);
        resp.matches("<Key>").count()
    }

    /// The binary with the S3 credentials of moto in its environment (and nowhere else).
    fn cmd(endpoint: &str) -> Command {
        let mut c = bin();
        c.current_dir(repo())
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ENDPOINT", endpoint)
            .env("AWS_ALLOW_HTTP", "true")
            .env("RUST_LOG", "error");
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        Self::cmd(&self.endpoint).args(args).output().unwrap()
    }

    /// `args` with `--cluster` (the scheduler of this cluster).
    fn on_cluster(&self, args: &[&str]) -> Output {
        let mut a: Vec<&str> = args.to_vec();
        a.extend(["--cluster", &self.url]);
        self.run(&a)
    }
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn json(o: &Output) -> Value {
    assert!(o.status.success(), "{}", text(o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(o)))
}

/// Equal up to 1e-12 relative for numbers, exactly for everything else.
fn assert_close(a: &Value, b: &Value, at: &str) {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            let tol = 1e-12 * x.abs().max(y.abs()).max(1e-300);
            assert!(
                (x - y).abs() <= tol,
                "{at}: local {x} vs cluster {y} (rel {:e})",
                (x - y).abs() / x.abs().max(y.abs())
            );
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{at}: row counts");
            for (i, (x, y)) in x.iter().zip(y).enumerate() {
                assert_close(x, y, &format!("{at}[{i}]"));
            }
        }
        (Value::Object(x), Value::Object(y)) => {
            let kx: Vec<_> = x.keys().collect();
            let ky: Vec<_> = y.keys().collect();
            assert_eq!(kx, ky, "{at}: columns");
            for (k, v) in x {
                assert_close(v, &y[k], &format!("{at}.{k}"));
            }
        }
        _ => assert_eq!(a, b, "{at}"),
    }
}

/// How many numbers a result holds (so a comparison of two empty or all-NULL results
/// cannot pass unseen).
fn count_numbers(v: &Value) -> usize {
    match v {
        Value::Number(_) => 1,
        Value::Array(a) => a.iter().map(count_numbers).sum(),
        Value::Object(o) => o.values().map(count_numbers).sum(),
        _ => 0,
    }
}

/// Rows of `obs` in several Parquet files: 40 groups, clusters of uneven size, a paired
/// column, booleans for `confusion`, K = 3 samples per case, some NULLs.
fn obs_sql(lo: i64, hi: i64) -> String {
    format!(
        "SELECT i % 40 AS g, CAST(i % 40 AS VARCHAR) || '-' || CAST((i * 7) % 13 AS VARCHAR) AS cl, \
         CASE WHEN i % 17 = 0 THEN NULL ELSE ((i * 2654435761) % 1000) / 1000.0 END AS x, \
         ((i * 40503) % 997) / 997.0 AS y, (i * 31) % 5 < 2 AS pred, (i * 17) % 7 < 3 AS truth, \
         CAST(i / 3 AS VARCHAR) AS case_id, CAST((i * 13) % 9 AS BIGINT) AS cl_int \
         FROM unnest(range({lo}, {hi})) AS t(i)"
    )
}

/// Every function of docs/functions.md, under GROUP BY where it aggregates.
const STAT_QUERIES: &[(&str, &str)] = &[
    (
        "mean_se",
        "SELECT g, mean_se(x) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "clustered_se",
        "SELECT g, clustered_se(x, cl) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "clustered_se int cluster",
        "SELECT g, clustered_se(x, cl_int) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "clustered_se_cr1",
        "SELECT g, clustered_se_cr1(x, cl) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "clustered_se_cr2",
        "SELECT g, clustered_se_cr2(x, cl) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "mean_ci",
        "SELECT g, mean_ci(x, 0.9) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "clustered_mean_ci",
        "SELECT g, clustered_mean_ci(x, cl) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "clustered_mean_ci miller",
        "SELECT g, clustered_mean_ci(x, cl, 0.95, 'miller') AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "clustered_mean_ci cr1_t",
        "SELECT g, clustered_mean_ci(x, cl, 0.95, 'cr1_t') AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "clustered_mean_ci wild_bootstrap",
        "SELECT g, clustered_mean_ci(x, cl, 0.95, 'wild_bootstrap') AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "paired_diff",
        "SELECT g, paired_diff(x, y) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "paired_diff_clustered",
        "SELECT g, paired_diff_clustered(x, y, cl) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "logit_normal_icc",
        "SELECT g, logit_normal_icc(CASE WHEN x > 0.5 THEN 1.0 ELSE 0.0 END, cl) AS v FROM obs \
         GROUP BY g ORDER BY g",
    ),
    (
        "clustered_mean_ci stated icc",
        "SELECT g, clustered_mean_ci(CASE WHEN x > 0.5 THEN 1.0 ELSE 0.0 END, cl, 0.95, \
         'auto; icc=0.3') AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "variance_components",
        "SELECT g, variance_components(x, case_id) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "confusion",
        "SELECT g, confusion(pred, truth) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "conformal_quantile",
        "SELECT g, conformal_quantile(x, 0.1) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "self_consistency",
        "SELECT g, self_consistency(x) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "sample_size",
        "SELECT g, sample_size(0.05 + avg(y) / 10, var_samp(x)) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "mde",
        "SELECT g, mde(count(*), var_samp(x)) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "rogan_gladen",
        "SELECT g, rogan_gladen(avg(x), 0.9, 0.8) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "rogan_gladen_ci",
        "SELECT g, rogan_gladen_ci(sum(CASE WHEN pred THEN 1 ELSE 0 END), count(*), 40, 5, 50, 10) AS v FROM obs GROUP BY g ORDER BY g",
    ),
    (
        "validity_verdict",
        "SELECT g, validity_verdict(CASE WHEN x > 0.5 THEN 'The answer is good and the tone is fine.' ELSE '' END, CASE WHEN x > 0.9 THEN 'length' ELSE 'stop' END, 200, NULL, 0, 0, 64, 'en')['validity'] AS v, count(*) AS n FROM obs GROUP BY 1, 2 ORDER BY 1, 2",
    ),
];

#[test]
fn cluster_matches_local_for_every_function_and_stage() {
    let mut c = Cluster::start();
    // Four files on S3, written by the executors (COPY through the cluster): the scan has
    // several partitions and the aggregates are partial on each executor, merged after the
    // shuffle. The first statement may wait for the executors to register.
    let table = format!("s3://{BUCKET}/obs/");
    let start = Instant::now();
    for k in 0..4 {
        let (lo, hi) = (k * 5000, (k + 1) * 5000);
        let o = c.on_cluster(&[
            "sql",
            &format!(
                "COPY ({}) TO 's3://{BUCKET}/obs/part-{k}.parquet' STORED AS PARQUET",
                obs_sql(lo, hi)
            ),
        ]);
        assert!(o.status.success(), "COPY through the cluster: {}", text(&o));
    }
    let obs = format!("obs={table}");

    // Every function of the reference is covered.
    let reference = std::fs::read_to_string(repo().join("docs/functions.md")).unwrap();
    for line in reference.lines().filter(|l| l.starts_with("## ")) {
        let f = line.trim_start_matches("## ").trim();
        assert!(
            STAT_QUERIES
                .iter()
                .any(|(n, _)| n.split(' ').next() == Some(f)),
            "docs/functions.md has `{f}`, which this test does not run on the cluster"
        );
    }

    let o = c.run(&[
        "sql",
        "SELECT count(*) AS n FROM obs",
        "--table",
        &obs,
        "--format",
        "json",
    ]);
    assert_eq!(json(&o), serde_json::json!([{"n": 20000}]));
    eprintln!("cluster up and obs written in {:?}", start.elapsed());

    for (name, q) in STAT_QUERIES {
        let local = json(&c.run(&["sql", q, "--table", &obs, "--format", "json"]));
        let remote = json(&c.on_cluster(&["sql", q, "--table", &obs, "--format", "json"]));
        assert!(
            count_numbers(&local) >= 40,
            "{name}: too few numbers to compare: {local}"
        );
        assert_close(&local, &remote, name);
    }

    // A plan with something the cluster lacks fails naming it, exit 2, no local fallback.
    let o = c.on_cluster(&[
        "sql",
        "CREATE TABLE here (x DOUBLE); SELECT mean_se(x) FROM here",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("cannot run on the cluster") && err.contains("table `here`"),
        "{}",
        text(&o)
    );

    // Stages: a run on s3:// written locally, and a twin of it that the cluster finishes.
    let pipeline = "pipelines/sentiment.toml";
    let (a, b) = (
        format!("s3://{BUCKET}/runs/local"),
        format!("s3://{BUCKET}/runs/cluster"),
    );
    for root in [&a, &b] {
        for verb in ["generate", "call"] {
            let o = c.run(&[verb, pipeline, "--out", root]);
            assert!(o.status.success(), "{verb}: {}", text(&o));
        }
    }
    for verb in ["validate", "score", "aggregate"] {
        let o = c.run(&[verb, pipeline, "--out", &a]);
        assert!(o.status.success(), "{verb} local: {}", text(&o));
        let o = c.on_cluster(&[verb, pipeline, "--out", &b]);
        assert!(o.status.success(), "{verb} on the cluster: {}", text(&o));
    }
    let o = c.run(&["rescore", &a, "--scorer", "cue"]);
    assert!(o.status.success(), "rescore local: {}", text(&o));
    let o = c.on_cluster(&["rescore", &b, "--scorer", "cue"]);
    assert!(o.status.success(), "rescore on the cluster: {}", text(&o));
    for (table, q, min_rows) in [
        ("validity", "SELECT * FROM validity ORDER BY call_id", 500),
        (
            "scores",
            "SELECT * FROM scores ORDER BY scorer, scoring_version, call_id",
            1000,
        ),
        (
            "results",
            "SELECT * FROM results ORDER BY 1, 2, 3, 4, 5, 6, 7, 8, 9",
            20,
        ),
    ] {
        let la = json(&c.run(&["sql", q, "--run", &a, "--format", "json"]));
        let lb = json(&c.run(&["sql", q, "--run", &b, "--format", "json"]));
        let rows = la.as_array().map_or(0, Vec::len);
        assert!(
            rows >= min_rows,
            "{table}: the local run wrote {rows} rows, too few to compare"
        );
        assert_close(&la, &lb, table);
    }

    // compare and report print the same figures through the cluster.
    for (verb, args) in [
        ("compare", vec!["compare", a.as_str(), b.as_str()]),
        ("report", vec!["report", a.as_str()]),
    ] {
        let local = c.run(&args);
        let remote = c.on_cluster(&args);
        assert!(local.status.success(), "{verb} local: {}", text(&local));
        assert!(
            remote.status.success(),
            "{verb} on the cluster: {}",
            text(&remote)
        );
        let out = String::from_utf8_lossy(&local.stdout);
        assert!(out.lines().count() > 5, "{verb} printed too little: {out}");
        assert_eq!(out, String::from_utf8_lossy(&remote.stdout), "{verb}");
    }

    // An executor killed mid-query: the query completes on the other one (same numbers) or
    // fails with an error; either way the cluster goes on answering.
    // A self-join on the group (250,000 joined rows per group, about 2 s on the cluster):
    // both sides are shuffled by `g` across the executors, then aggregated.
    let big = "SELECT o1.g, count(*) AS n, clustered_se(o1.x - o2.y, o1.cl) AS se FROM obs o1 \
               JOIN obs o2 ON o1.g = o2.g WHERE o1.x IS NOT NULL GROUP BY o1.g ORDER BY o1.g";
    let local = json(&c.run(&["sql", big, "--table", &obs, "--format", "json"]));
    let started = Instant::now();
    let child = Cluster::cmd(&c.endpoint)
        .args([
            "sql",
            big,
            "--table",
            &obs,
            "--format",
            "json",
            "--cluster",
            &c.url,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let mut executors = std::mem::take(&mut c.executors);
    let mut victim = executors.remove(0);
    let _ = victim.0.kill();
    let _ = victim.0.wait();
    let o = wait_with_timeout(child, Duration::from_secs(120));
    assert!(count_numbers(&local) >= 80, "{local}");
    if o.status.success() {
        let remote: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_close(&local, &remote, "after killing an executor");
        eprintln!(
            "killed an executor mid-query: the query completed on the other one in {:?}",
            started.elapsed()
        );
    } else {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.starts_with("error: ") && o.stdout.is_empty(),
            "a failure says so and prints no partial result: {}",
            text(&o)
        );
        eprintln!(
            "killed an executor mid-query: the query failed after {:?} with {err}",
            started.elapsed()
        );
    }
    let o = Cluster::cmd(&c.endpoint)
        .args([
            "sql",
            "SELECT count(*) AS n FROM obs",
            "--table",
            &obs,
            "--format",
            "json",
            "--cluster",
            &c.url,
        ])
        .output()
        .unwrap();
    assert_eq!(
        json(&o),
        serde_json::json!([{"n": 20000}]),
        "the other executor answers"
    );

    // With its last executor gone, `validate --cluster` fails with an error instead of
    // waiting forever or running locally, leaves no validity part behind, and a rerun (here
    // on this machine) writes the same verdicts as the local run.
    let r = format!("s3://{BUCKET}/runs/killed");
    for verb in ["generate", "call"] {
        let o = c.run(&[verb, pipeline, "--out", &r]);
        assert!(o.status.success(), "{verb}: {}", text(&o));
    }
    drop(executors);
    let child = Cluster::cmd(&c.endpoint)
        .args(["validate", pipeline, "--out", &r, "--cluster", &c.url])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let o = wait_with_timeout(child, Duration::from_secs(180));
    assert!(
        !o.status.success(),
        "validate with no executor: {}",
        text(&o)
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("error: validate: ")
            && String::from_utf8_lossy(&o.stderr).contains("executors"),
        "{}",
        text(&o)
    );
    assert_eq!(c.keys("runs/killed/validity/"), 0, "no validity part");
    eprintln!(
        "validate with no executor left: {}",
        String::from_utf8_lossy(&o.stderr)
            .lines()
            .last()
            .unwrap_or_default()
    );
    let o = c.run(&["validate", pipeline, "--out", &r]);
    assert!(o.status.success(), "validate rerun: {}", text(&o));
    let q = "SELECT * FROM validity ORDER BY call_id";
    assert_close(
        &json(&c.run(&["sql", q, "--run", &a, "--format", "json"])),
        &json(&c.run(&["sql", q, "--run", &r, "--format", "json"])),
        "validity after a killed cluster validate and a rerun",
    );
}

fn wait_with_timeout(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!(
                "the query neither completed nor failed within {limit:?}: {}",
                text(&o)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
