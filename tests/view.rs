//! `evalflow view` end to end (docs/view.md): real runs made by the CLI, one viewer child
//! serving them, every API number checked against `evalflow sql` / `evalflow compare` on the
//! same run, the pages rendered by headless Chromium and checked against the same numbers,
//! and a scripted browser session (tests/view_browser/drive.js) that clicks through the page
//! and records every request it makes.
//!
//! The runs are built once per test binary ([`fixture`]): under ROOT, `a` and `b` are the
//! sentiment suite on the embedded VADER model (`a` rescored twice by a user `label_match`
//! scorer, normalised and exact), and `small` is a smaller sentiment suite answered over HTTP
//! by `evalflow mock-server --answer vader` with a latency, so its call stage commits a part
//! every 2 s and its tables have several parts (the call stage commits its rows by time, not
//! by `EVALFLOW_PART_ROWS`, which here only keeps the parts from being merged afterwards):
//! pages of answers must cross parts.
//!
//! The CLI runs as this test binary re-run as its `child_evalflow` test
//! (tests/common/child.rs). Chromium and node are needed by the page tests; without them
//! those tests print why and return (under `CI`, which installs both, they fail instead).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::{OnceLock, mpsc};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

#[path = "common/child.rs"]
mod child;

/// Runs the CLI when started by [`child::command`]; a no-op test otherwise.
#[test]
fn child_evalflow() {
    child::run_if_child();
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

// ------------------------------------------------------------------ the CLI as a child

/// `evalflow ARGS` as a child process from the repository root, with no request cache and
/// none of the variables that would change what it does unless given in `envs`.
fn evalflow(args: &[&str], envs: &[(&str, &str)]) -> Command {
    let mut c = child::command(args);
    c.current_dir(repo())
        .env("EVALFLOW_CACHE_DIR", "off")
        .env_remove("EVALFLOW_CRASH_AT")
        .env_remove("EVALFLOW_PART_ROWS")
        .env_remove("EVALFLOW_VIEW_TOKEN");
    for (k, v) in envs {
        c.env(k, v);
    }
    c
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs `evalflow ARGS`, which must succeed; returns its stdout.
fn ok(args: &[&str], envs: &[(&str, &str)]) -> String {
    let o = evalflow(args, envs).output().unwrap();
    assert!(o.status.success(), "evalflow {args:?}: {}", text(&o));
    String::from_utf8(o.stdout).unwrap()
}

/// The JSON a verb printed: its stdout from the first line that opens an array or object
/// (the child's test harness prints `running 1 test` before it).
fn printed_json(stdout: &str) -> Value {
    let mut off = 0;
    for line in stdout.split_inclusive('\n') {
        let t = line.trim_start();
        if t.starts_with('[') || t.starts_with('{') {
            return serde_json::from_str(&stdout[off..])
                .unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
        }
        off += line.len();
    }
    panic!("no JSON printed: {stdout}");
}

/// `evalflow sql Q --run RUN --format json`: the rows as JSON objects.
fn sql(run: &Path, q: &str) -> Vec<Value> {
    let out = ok(
        &["sql", q, "--run", run.to_str().unwrap(), "--format", "json"],
        &[],
    );
    printed_json(&out).as_array().cloned().unwrap_or_default()
}

/// The one number a query returns.
fn sql_i64(run: &Path, q: &str) -> i64 {
    let rows = sql(run, q);
    let row = rows[0].as_object().unwrap();
    row.values().next().unwrap().as_i64().unwrap()
}

/// SQL's text literal.
fn lit(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// A string field of a JSON row ("" for null).
fn s(v: &Value, k: &str) -> String {
    match &v[k] {
        Value::Null => String::new(),
        Value::String(x) => x.clone(),
        other => other.to_string(),
    }
}

/// Two numbers equal to rounding (the same SQL aggregated in another order).
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// Two JSON values equal, numbers to rounding.
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => close(x.as_f64().unwrap(), y.as_f64().unwrap()),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same_value(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => a == b,
    }
}

/// Asserts `got` (nullable number) equals `want`, naming `what`.
fn assert_num(got: &Value, want: &Value, what: &str) {
    match (got.as_f64(), want.as_f64()) {
        (Some(g), Some(w)) => assert!(close(g, w), "{what}: API {g}, SQL {w}"),
        _ => assert_eq!(got, want, "{what}"),
    }
}

// ------------------------------------------------------------------ served children

/// A child that serves until dropped (the viewer, the mock model): it runs under
/// `sh`, which kills it when its stdin closes, so it also ends with this test process (a
/// static fixture is never dropped, but the process's end closes the pipe).
struct Served {
    child: Child,
    stdin: Option<ChildStdin>,
    /// `http://127.0.0.1:PORT` from its first `listening on` line.
    base: String,
}

impl Served {
    /// Starts `evalflow ARGS` and waits (at most 120 s) for its address.
    fn start(args: &[&str], log: &Path) -> Served {
        Served::start_with(args, &[], log)
    }

    /// [`Served::start`] with environment variables.
    fn start_with(args: &[&str], envs: &[(&str, &str)], log: &Path) -> Served {
        let inner = evalflow(args, envs);
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg("\"$0\" \"$@\" & pid=$!; cat >/dev/null; kill $pid 2>/dev/null; wait $pid")
            .arg(inner.get_program())
            .args(inner.get_args())
            .current_dir(repo());
        for (k, v) in inner.get_envs() {
            match v {
                Some(v) => c.env(k, v),
                None => c.env_remove(k),
            };
        }
        c.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log).unwrap());
        let mut child = c.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            // Reads to the end, so the pipe never fills.
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if !sent && let Some(at) = line.find("listening on http://") {
                    let _ = tx.send(line[at + "listening on ".len()..].trim().to_string());
                    sent = true;
                }
            }
        });
        let stdin = child.stdin.take();
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(base) => Served { child, stdin, base },
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "evalflow {args:?} printed no address: {}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
            }
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `c` to its end, at most `secs` (then kills it and panics), reading its output
/// meanwhile (a large output would otherwise fill the pipe and stall it).
fn output_within(mut c: Command, secs: u64) -> Output {
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "still running after {secs} s: {}{}",
                String::from_utf8_lossy(&out.join().unwrap()),
                String::from_utf8_lossy(&err.join().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

// ------------------------------------------------------------------ HTTP/1.1, std only

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "HTTP {} is not JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as a JSON error `{"error": "..."}`: its message.
    fn error(&self) -> String {
        let v = self.json();
        v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("HTTP {}: no `error` in {v}", self.status))
            .to_string()
    }
}

/// One request on its own connection (`Connection: close`).
fn request(
    base: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Resp {
    let host = base.strip_prefix("http://").unwrap();
    let mut stream = TcpStream::connect(host).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body.unwrap_or_default());
    stream.write_all(&bytes).unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head: {}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line: {head}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    if chunked {
        let (mut out, mut rest) = (Vec::new(), &body[..]);
        loop {
            let eol = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let size = usize::from_str_radix(
                String::from_utf8_lossy(&rest[..eol])
                    .split(';')
                    .next()
                    .unwrap()
                    .trim(),
                16,
            )
            .unwrap();
            if size == 0 {
                break;
            }
            out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
            rest = &rest[eol + 2 + size + 2..];
        }
        body = out;
    }
    Resp {
        status,
        headers,
        body,
    }
}

fn get(base: &str, path: &str) -> Resp {
    request(base, "GET", path, &[], None)
}

/// A GET that must answer 200 with JSON.
fn get_json(base: &str, path: &str) -> Value {
    let r = get(base, path);
    assert_eq!(
        r.status,
        200,
        "GET {path}: {}",
        String::from_utf8_lossy(&r.body)
    );
    r.json()
}

fn post_raw(base: &str, path: &str, body: &[u8]) -> Resp {
    request(
        base,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        Some(body),
    )
}

fn post_json(base: &str, path: &str, body: &Value) -> Resp {
    post_raw(base, path, body.to_string().as_bytes())
}

/// `path?k=v&...`, URL-encoded.
fn with_query(path: &str, pairs: &[(&str, &str)]) -> String {
    if pairs.is_empty() {
        return path.to_string();
    }
    let q = url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish();
    format!("{path}?{q}")
}

// ------------------------------------------------------------------ the fixture

struct Fixture {
    /// The folder of everything this test binary made.
    dir: PathBuf,
    /// ROOT: runs `a`, `b` and `small`.
    root: PathBuf,
    /// `label_match@V` of the normalised and of the exact scorer file.
    label_norm: String,
    label_exact: String,
    /// The viewer over ROOT.
    viewer: Served,
}

impl Fixture {
    fn base(&self) -> &str {
        &self.viewer.base
    }
    fn run(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }
}

static FIXTURE: OnceLock<Fixture> = OnceLock::new();

/// The runs and their viewer, built by the first test that asks.
fn fixture() -> &'static Fixture {
    FIXTURE.get_or_init(build_fixture)
}

/// A fresh folder for this process; folders of earlier test processes that have ended
/// (the fixture is a static, never dropped) are removed.
fn fresh_dir() -> PathBuf {
    const PREFIX: &str = "evalflow-view-test-";
    let tmp = std::env::temp_dir();
    if Path::new("/proc/self").exists() {
        for e in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(pid) = name.strip_prefix(PREFIX)
                && pid.parse::<u32>().is_ok()
                && !Path::new(&format!("/proc/{pid}")).exists()
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let dir = tmp.join(format!("{PREFIX}{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const SCORER_NORMALISED: &str = r#"[[scorer]]
name = "label_match"
description = "The answer is the expected label (lower case, no trailing punctuation)."
kind = "match"
metric = "pass_fail"
mode = "normalised"
"#;

const SCORER_EXACT: &str = r#"[[scorer]]
name = "label_match"
description = "The answer is the expected label, exactly (trimmed)."
kind = "match"
metric = "pass_fail"
mode = "exact"
"#;

/// The version `rescore` printed (`rescored N rows with label_match@V into ...`).
fn rescored_version(out: &str) -> String {
    let at = out
        .find("with label_match@")
        .unwrap_or_else(|| panic!("rescore printed no version: {out}"));
    let tag = out[at + "with ".len()..].split_whitespace().next().unwrap();
    tag.to_string()
}

fn build_fixture() -> Fixture {
    let dir = fresh_dir();
    let root = dir.join("root");
    std::fs::create_dir_all(&root).unwrap();
    // `small` waits on its mock model's latency: made meanwhile.
    let small = {
        let (dir, root) = (dir.clone(), root.clone());
        std::thread::spawn(move || make_small(&dir, &root.join("small")))
    };
    for id in ["a", "b"] {
        let out = root.join(id);
        ok(
            &[
                "run",
                "pipelines/sentiment.toml",
                "--out",
                out.to_str().unwrap(),
            ],
            &[],
        );
    }
    let mut tags = Vec::new();
    for (name, def) in [("normalised", SCORER_NORMALISED), ("exact", SCORER_EXACT)] {
        let file = dir.join(format!("label_match-{name}.toml"));
        std::fs::write(&file, def).unwrap();
        let out = ok(
            &[
                "rescore",
                root.join("a").to_str().unwrap(),
                "--scorer-file",
                file.to_str().unwrap(),
            ],
            &[],
        );
        tags.push(rescored_version(&out));
    }
    if let Err(e) = small.join() {
        std::panic::resume_unwind(e);
    }
    assert_ne!(tags[0], tags[1], "the two scorer files are two versions");
    // Scorer diffs join the two versions in slices of about 1,500 rows here (1M by default),
    // so the matrix and the pages cross slices.
    let viewer = Served::start_with(
        &["view", root.to_str().unwrap(), "--addr", "127.0.0.1:0"],
        &[("EVALFLOW_VIEW_DIFF_ROWS", "1500")],
        &dir.join("viewer.log"),
    );
    Fixture {
        dir,
        root,
        label_norm: tags[0].clone(),
        label_exact: tags[1].clone(),
        viewer,
    }
}

/// The sentiment suite (at most 10 cases a test, about 550 calls) answered by `mock-server
/// --answer vader` with 50 ms of latency, 4 at a time: at least 6.9 s of calls, so at least
/// three parts committed 2 s apart (about 140 rows each), which `EVALFLOW_PART_ROWS=100` keeps
/// from being merged when the call stage ends.
fn make_small(dir: &Path, out: &Path) {
    let mock = Served::start(
        &[
            "mock-server",
            "--answer",
            "vader",
            "--latency-ms",
            "50",
            "--addr",
            "127.0.0.1:0",
        ],
        &dir.join("mock.log"),
    );
    let p = dir.join("pipeline");
    for sub in ["lexicons", "data"] {
        std::fs::create_dir_all(p.join(sub)).unwrap();
    }
    std::fs::copy(
        repo().join("pipelines/lexicons/sentiment.toml"),
        p.join("lexicons/sentiment.toml"),
    )
    .unwrap();
    std::fs::copy(
        repo().join("pipelines/data/airline_tweets.csv"),
        p.join("data/airline_tweets.csv"),
    )
    .unwrap();
    let original = std::fs::read_to_string(repo().join("pipelines/sentiment.toml")).unwrap();
    let mut text = String::new();
    let mut in_model = false;
    for line in original.lines() {
        if line.starts_with('[') {
            in_model = line == "[model]";
            if in_model {
                text.push_str(&format!(
                    "[model]\nprovider = \"openai\"\nbase_url = \"{}/v1\"\nname = \"vader\"\n\
                     temperature = 0.0\nmax_tokens = 16\ntimeout_secs = 30\nconcurrency = 4\n\
                     samples = 1\n\n",
                    mock.base
                ));
                continue;
            }
        }
        if in_model {
            continue;
        }
        if line.starts_with("max_cases_per_test") {
            text.push_str("max_cases_per_test = 10\n");
        } else if line.starts_with("max_cases =") {
            text.push_str("max_cases = 10\n");
        } else {
            text.push_str(line);
            text.push('\n');
        }
    }
    let pipeline = p.join("sentiment.toml");
    std::fs::write(&pipeline, text).unwrap();
    ok(
        &[
            "run",
            pipeline.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        &[("EVALFLOW_PART_ROWS", "100")],
    );
    drop(mock);
    let parts = std::fs::read_dir(out.join("scores/checklist@2"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".parquet")
        })
        .count();
    assert!(
        parts >= 3,
        "run `small` needs several parts for the paging tests, it has {parts}"
    );
}

/// Every run of `/api/runs` by id, after their headlines were computed (at most 60 s).
fn runs_settled(base: &str) -> BTreeMap<String, Value> {
    let start = Instant::now();
    loop {
        let runs = get_json(base, "/api/runs");
        let list = runs.as_array().unwrap();
        if list.iter().all(|r| r["headline_pending"] == json!(false)) {
            return list.iter().map(|r| (s(r, "run_id"), r.clone())).collect();
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "headlines still pending after 60 s: {runs}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

// ------------------------------------------------------------------ runs, headline, results

/// A run not yet aggregated (an import, validated) has no `results`: the runs index shows
/// its validity table's verdicts, counted in the background with the headline (the bar was
/// empty until `aggregate`).
#[test]
fn a_run_not_aggregated_shows_its_verdicts() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("runs");
    let run = root.join("imported");
    let fixtures = repo().join("tests/fixtures/import/openai-batch");
    ok(
        &[
            "import",
            fixtures.to_str().unwrap(),
            "--out",
            run.to_str().unwrap(),
        ],
        &[],
    );
    let toml = run.join("import.toml");
    ok(
        &[
            "validate",
            toml.to_str().unwrap(),
            "--out",
            run.to_str().unwrap(),
        ],
        &[],
    );
    let want: BTreeMap<String, i64> = sql(
        &run,
        "SELECT validity, count(*) AS n FROM validity GROUP BY validity",
    )
    .iter()
    .map(|r| (s(r, "validity"), r["n"].as_i64().unwrap()))
    .collect();
    assert!(want.len() >= 2, "{want:?}");
    let viewer = Served::start(
        &["view", root.to_str().unwrap(), "--addr", "127.0.0.1:0"],
        &dir.path().join("viewer.log"),
    );
    let runs = runs_settled(&viewer.base);
    let got: BTreeMap<String, i64> = runs["imported"]["validity"]
        .as_object()
        .unwrap_or_else(|| panic!("{:?}", runs["imported"]))
        .iter()
        .map(|(k, v)| (k.clone(), v.as_i64().unwrap()))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn api_runs_answers_equal_the_sql_count_of_calls() {
    let f = fixture();
    let runs = get_json(f.base(), "/api/runs");
    let ids: BTreeSet<String> = runs
        .as_array()
        .unwrap()
        .iter()
        .map(|r| s(r, "run_id"))
        .collect();
    assert_eq!(ids, ["a", "b", "small"].map(String::from).into(), "{runs}");
    for r in runs.as_array().unwrap() {
        let id = s(r, "run_id");
        let calls = sql_i64(&f.run(&id), "SELECT count(*) FROM calls");
        assert!(calls > 300, "{id}: {calls} calls");
        assert_eq!(r["answers"], json!(calls), "{id}: answers");
        assert_eq!(r["status"], "complete", "{id}");
        assert_eq!(r["error"], Value::Null, "{id}");
        assert_eq!(r["path"], json!(id), "{id}");
        assert_eq!(r["models"], json!(["vader"]), "{id}");
        let valid = sql_i64(
            &f.run(&id),
            "SELECT count(*) FROM validity WHERE validity = 'valid_answer'",
        );
        assert_eq!(
            r["validity"]["valid_answer"],
            json!(valid),
            "{id}: validity"
        );
    }
    let a = runs
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["run_id"] == "a")
        .unwrap();
    assert_eq!(
        a["scorers"],
        json!(["checklist@2", f.label_norm, f.label_exact]),
        "run a's scorer versions, in the order they were written"
    );
    // The run object adds the filters' values, from the run's tables.
    let detail = get_json(f.base(), "/api/runs/a");
    let tests: Vec<String> = sql(&f.run("a"), "SELECT DISTINCT test FROM cases ORDER BY test")
        .iter()
        .map(|r| s(r, "test"))
        .collect();
    assert_eq!(detail["tests"], json!(tests));
    assert_eq!(detail["answers"], a["answers"]);
    assert_eq!(detail["stages"]["call"]["status"], "complete");
}

#[test]
fn api_headline_is_the_clustered_failure_rate_of_the_checklist() {
    let f = fixture();
    let runs = runs_settled(f.base());
    for id in ["a", "b", "small"] {
        let h = &runs[id]["headline"];
        assert_eq!(h["metric"], "failure_rate", "{id}: {h}");
        assert_eq!(h["scorer"], "checklist", "{id}: {h}");
        assert_eq!(h["scoring_version"], "2", "{id}: {h}");
        let rows = sql(
            &f.run(id),
            "SELECT clustered_mean_ci(CASE WHEN passed THEN 0.0 ELSE 1.0 END, template_id) AS ci \
             FROM scores WHERE scorer = 'checklist' AND passed IS NOT NULL AND role <> 'base'",
        );
        let ci = &rows[0]["ci"];
        assert_num(&h["value"], &ci["mean"], &format!("{id}: value"));
        assert_num(&h["ci_lo"], &ci["lo"], &format!("{id}: ci_lo"));
        assert_num(&h["ci_hi"], &ci["hi"], &format!("{id}: ci_hi"));
        assert_eq!(h["n"], ci["n"], "{id}: n");
        let v = h["value"].as_f64().unwrap();
        assert!(
            h["ci_lo"].as_f64().unwrap() <= v && v <= h["ci_hi"].as_f64().unwrap(),
            "{id}: {h}"
        );
    }
}

#[test]
fn api_results_rows_equal_the_results_table() {
    let f = fixture();
    for id in ["a", "b", "small"] {
        let api = get_json(f.base(), &format!("/api/runs/{id}/results"));
        let want = sql(&f.run(id), "SELECT * FROM results");
        let key = |r: &Value| {
            [
                "scorer",
                "scoring_version",
                "model",
                "level",
                "capability",
                "test_type",
                "test",
                "label",
                "metric",
            ]
            .map(|k| s(r, k))
        };
        let got: BTreeMap<_, _> = api
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (key(r), r))
            .collect();
        assert_eq!(
            got.len(),
            api.as_array().unwrap().len(),
            "{id}: keys repeat"
        );
        assert_eq!(got.len(), want.len(), "{id}: rows");
        assert!(want.len() > 20, "{id}: {} results rows", want.len());
        for w in &want {
            let k = key(w);
            let g = got
                .get(&k)
                .unwrap_or_else(|| panic!("{id}: no API row for {k:?}"));
            for col in ["value", "ci_lo", "ci_hi", "n"] {
                assert_num(&g[col], &w[col], &format!("{id} {k:?} {col}"));
            }
        }
    }
}

// ------------------------------------------------------------------ pages of answers

/// Every page of `/api/runs/{run}/answers` with `filters`, `limit` a page: the call ids in
/// the order shown, and the cursors followed.
fn walk(
    base: &str,
    run: &str,
    filters: &[(&str, &str)],
    limit: usize,
) -> (Vec<String>, Vec<String>) {
    let (mut ids, mut cursors): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
    let limit_s = limit.to_string();
    loop {
        let mut q: Vec<(&str, &str)> = filters.to_vec();
        q.push(("limit", &limit_s));
        if let Some(c) = cursors.last() {
            q.push(("after", c.as_str()));
        }
        let page = get_json(base, &with_query(&format!("/api/runs/{run}/answers"), &q));
        let rows = page["rows"].as_array().unwrap();
        assert!(rows.len() <= limit, "{filters:?}: {} rows", rows.len());
        ids.extend(rows.iter().map(|r| s(r, "call_id")));
        match &page["next"] {
            Value::Null => return (ids, cursors),
            Value::String(c) => {
                assert_eq!(rows.len(), limit, "{filters:?}: a page with a next is full");
                cursors.push(c.clone());
            }
            other => panic!("next: {other}"),
        }
        assert!(cursors.len() < 10_000, "{filters:?}: the walk does not end");
    }
}

/// Asserts the walk with `filters` shows each of `want` exactly once, and nothing else.
fn assert_walk(base: &str, run: &str, filters: &[(&str, &str)], want: &BTreeSet<String>) {
    let (ids, _) = walk(base, run, filters, 50);
    let got: BTreeSet<String> = ids.iter().cloned().collect();
    assert_eq!(ids.len(), got.len(), "{filters:?}: a call id shown twice");
    let missing: Vec<_> = want.difference(&got).take(5).collect();
    let extra: Vec<_> = got.difference(want).take(5).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{filters:?}: {} shown, {} in SQL; missing {missing:?}, extra {extra:?}",
        got.len(),
        want.len()
    );
}

/// Call ids per label from one query of `label, call_id` rows (`UNION ALL` of conditions).
fn sql_sets(run: &Path, q: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for r in sql(run, q) {
        out.entry(s(&r, "f")).or_default().insert(s(&r, "call_id"));
    }
    out
}

#[test]
fn answer_pages_walk_every_checklist_answer_once_across_parts() {
    let f = fixture();
    let run = f.run("small");
    let want: BTreeSet<String> = sql(
        &run,
        "SELECT call_id FROM scores WHERE scorer = 'checklist' AND scoring_version = '2'",
    )
    .iter()
    .map(|r| s(r, "call_id"))
    .collect();
    let n = sql_i64(
        &run,
        "SELECT count(*) FROM scores WHERE scorer = 'checklist' AND scoring_version = '2'",
    );
    assert_eq!(want.len() as i64, n, "one checklist score per call");
    assert!(n > 400, "{n}");
    let (ids, cursors) = walk(f.base(), "small", &[], 50);
    assert_eq!(ids.len() as i64, n, "every answer once");
    assert_eq!(ids.iter().cloned().collect::<BTreeSet<_>>(), want);
    // The cursors name the parts the pages ended in: the walk went through several.
    let parts: BTreeSet<&str> = cursors
        .iter()
        .map(|c| c.rsplit_once('~').unwrap().0)
        .collect();
    assert!(parts.len() >= 3, "cursors {cursors:?}");
    // Another page size shows the same answers in the same order, and its cursor goes on
    // where its page ended.
    let page = get_json(f.base(), "/api/runs/small/answers?limit=200");
    let first: Vec<String> = page["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| s(r, "call_id"))
        .collect();
    assert_eq!(first, ids[..200]);
    let next = with_query(
        "/api/runs/small/answers",
        &[("limit", "200"), ("after", page["next"].as_str().unwrap())],
    );
    let second: Vec<String> = get_json(f.base(), &next)["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| s(r, "call_id"))
        .collect();
    assert_eq!(second, ids[200..400]);
}

#[test]
fn answer_page_filters_walk_exactly_the_sql_sets() {
    let f = fixture();
    let run = f.run("small");
    // The test with the most failures among those that also have passes (so that test and
    // passed=false both narrow).
    let test = s(
        &sql(
            &run,
            "SELECT test FROM scores WHERE scorer = 'checklist' GROUP BY test HAVING \
             sum(CASE WHEN passed THEN 1 ELSE 0 END) > 0 AND sum(CASE WHEN NOT passed THEN 1 \
             ELSE 0 END) > 0 ORDER BY sum(CASE WHEN NOT passed THEN 1 ELSE 0 END) DESC, test \
             LIMIT 1",
        )[0],
        "test",
    );
    let word = "flight";
    let checklist = "FROM scores s WHERE s.scorer = 'checklist' AND s.scoring_version = '2'";
    let q_cond = |w: &str| {
        format!(
            "(s.call_id IN (SELECT call_id FROM calls WHERE strpos(lower(response), {w}) > 0) \
             OR s.case_id IN (SELECT case_id FROM cases WHERE strpos(lower(input), {w}) > 0))",
            w = lit(&w.to_lowercase())
        )
    };
    let conds: Vec<(&str, String)> = vec![
        ("all", "TRUE".into()),
        ("passed=false", "s.passed = false".into()),
        ("passed=null", "s.passed IS NULL".into()),
        ("test", format!("s.test = {}", lit(&test))),
        (
            "test+passed=false",
            format!("s.test = {} AND s.passed = false", lit(&test)),
        ),
        (
            "validity",
            "s.call_id IN (SELECT call_id FROM validity WHERE validity = 'valid_answer')".into(),
        ),
        (
            "capability+type",
            "s.case_id IN (SELECT case_id FROM cases WHERE capability = 'Negation' AND \
             test_type = 'MFT')"
                .into(),
        ),
        ("q", q_cond(word)),
        ("q'", q_cond("'")),
        ("q_", q_cond("_")),
        ("score_max", "s.score <= 0.5".into()),
    ];
    let union: Vec<String> = conds
        .iter()
        .map(|(label, cond)| {
            format!(
                "SELECT {} AS f, s.call_id {checklist} AND {cond}",
                lit(label)
            )
        })
        .collect();
    let sets = sql_sets(&run, &union.join(" UNION ALL "));
    let set = |label: &str| sets.get(label).cloned().unwrap_or_default();
    // The conditions are not trivial on this run.
    let all = set("all");
    assert!(
        set("passed=false").len() > 10,
        "failures: {}",
        set("passed=false").len()
    );
    assert!(set("test+passed=false").len() < set("test").len());
    assert!(set("test").len() < all.len());
    assert!(!set("q").is_empty() && set("q").len() < all.len());
    assert!(!set("q'").is_empty(), "inputs with an apostrophe");
    assert!(set("passed=null").len() > 10, "base rows are unscored");

    let b = f.base();
    assert_walk(b, "small", &[("passed", "false")], &set("passed=false"));
    assert_walk(b, "small", &[("passed", "null")], &set("passed=null"));
    assert_walk(b, "small", &[("test", &test)], &set("test"));
    assert_walk(
        b,
        "small",
        &[("test", &test), ("passed", "false")],
        &set("test+passed=false"),
    );
    assert_walk(
        b,
        "small",
        &[("validity", "valid_answer")],
        &set("validity"),
    );
    assert_walk(
        b,
        "small",
        &[("validity", "provider_error")],
        &BTreeSet::new(),
    );
    assert_walk(
        b,
        "small",
        &[("capability", "Negation"), ("test_type", "MFT")],
        &set("capability+type"),
    );
    assert_walk(b, "small", &[("q", word)], &set("q"));
    // q is case-insensitive, and a quote or a LIKE wildcard in it is a plain character.
    assert_walk(b, "small", &[("q", &word.to_uppercase())], &set("q"));
    assert_walk(b, "small", &[("q", "'")], &set("q'"));
    // A search walks `calls`, so filters on the scores are checked on each row's lookups.
    let both =
        |x: &str, y: &str| -> BTreeSet<String> { set(x).intersection(&set(y)).cloned().collect() };
    assert!(!both("q", "passed=false").is_empty());
    assert!(both("q", "passed=false").len() < set("q").len());
    assert_walk(
        b,
        "small",
        &[("q", word), ("passed", "false")],
        &both("q", "passed=false"),
    );
    assert_walk(
        b,
        "small",
        &[("q", word), ("test", &test), ("score_max", "0.5")],
        &set("q")
            .intersection(&both("test", "score_max"))
            .cloned()
            .collect(),
    );
    assert_walk(b, "small", &[("q", "_")], &set("q_"));
    assert_walk(b, "small", &[("model", "vader")], &all);
    assert_walk(b, "small", &[("model", "no-such-model")], &BTreeSet::new());
    assert_walk(b, "small", &[("score_max", "0.5")], &set("score_max"));
    assert!(!set("score_max").is_empty() && set("score_max").len() < all.len());
    // Filters that keep every answer show the unfiltered pages (each walked in full above
    // and in answer_pages_walk_every_checklist_answer_once_across_parts).
    let unfiltered = get_json(b, "/api/runs/small/answers");
    for q in [
        "finish_reason=stop",
        "scorer=checklist",
        "scorer=checklist%402",
        "token=ignored",
    ] {
        let page = get_json(b, &format!("/api/runs/small/answers?{q}"));
        assert_eq!(page["rows"], unfiltered["rows"], "{q}");
        assert_eq!(page["next"], unfiltered["next"], "{q}");
    }
    let stops = sql_i64(
        &run,
        "SELECT count(*) FROM calls WHERE finish_reason = 'stop'",
    );
    assert_eq!(stops as usize, all.len(), "every call ended with stop");
    // Every row of a filtered page carries what it was filtered on.
    let page = get_json(
        b,
        &with_query(
            "/api/runs/small/answers",
            &[("test", &test), ("passed", "false"), ("limit", "500")],
        ),
    );
    for r in page["rows"].as_array().unwrap() {
        assert_eq!(r["test"], json!(test), "{r}");
        assert_eq!(r["passed"], json!(false), "{r}");
        assert_eq!(r["scorer"], "checklist", "{r}");
        assert_eq!(r["model"], "vader", "{r}");
    }
    assert_eq!(page["scorer"], "checklist@2");
}

#[test]
fn answer_page_limits_cursors_and_filters_are_checked() {
    let f = fixture();
    let b = f.base();
    // The largest page, of run a (more than 500 answers), and the page after it.
    let n = sql_i64(
        &f.run("a"),
        "SELECT count(*) FROM scores WHERE scorer = 'checklist'",
    );
    assert!(n > 1000, "{n}");
    let page = get_json(b, "/api/runs/a/answers?limit=500");
    let rows = page["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 500);
    let after = page["next"].as_str().expect("more than a page");
    let next = get_json(
        b,
        &with_query("/api/runs/a/answers", &[("limit", "500"), ("after", after)]),
    );
    assert_eq!(next["rows"].as_array().unwrap().len(), 500);
    let ids: BTreeSet<String> = rows
        .iter()
        .chain(next["rows"].as_array().unwrap())
        .map(|r| s(r, "call_id"))
        .collect();
    assert_eq!(ids.len(), 1000, "two pages of 500 share no answer");
    let first = get_json(b, "/api/runs/small/answers");
    assert_eq!(
        first["rows"].as_array().unwrap().len(),
        50,
        "the default page"
    );

    for (q, needle) in [
        ("limit=501", "limit"),
        ("limit=0", "limit"),
        ("limit=ten", "limit"),
        ("after=zzz", "after"),
        ("after=part-1.parquet~x", "after"),
        ("after=..%2Fcalls~1", "after"),
        ("after=~3", "after"),
        ("passed=maybe", "passed"),
        ("score_min=high", "score_min"),
        ("bogus=1", "bogus"),
        ("scorer=nope%409", "nope"),
    ] {
        let r = get(b, &format!("/api/runs/small/answers?{q}"));
        assert_eq!(r.status, 400, "{q}: {}", String::from_utf8_lossy(&r.body));
        assert!(r.error().contains(needle), "{q}: {}", r.error());
    }
    let r = get(b, "/api/runs/no-such-run/answers");
    assert_eq!(r.status, 404);
    assert!(r.error().contains("no-such-run"), "{}", r.error());
    let r = get(b, "/api/no-such-endpoint");
    assert_eq!(r.status, 404);
    r.error();
    // The server still answers, with the same first page.
    assert_eq!(get(b, "/api/runs").status, 200);
    assert_eq!(get_json(b, "/api/runs/small/answers"), first);
}

// ------------------------------------------------------------------ one answer

/// One row of SQL (panics when there is none).
fn sql_row(run: &Path, q: &str) -> Value {
    sql(run, q)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no row: {q}"))
}

/// Asserts the answer's call, case, verdict and scores are the run's rows for `call_id`.
fn assert_answer_is_sql(f: &Fixture, call_id: &str) -> Value {
    let run = f.run("a");
    let d = get_json(f.base(), &format!("/api/runs/a/answers/{call_id}"));
    let want = sql_row(
        &run,
        &format!(
            "SELECT k.response, k.model, k.sample_idx, k.case_id, c.input, c.expected, c.test, \
             c.role, v.validity FROM calls k JOIN cases c ON c.case_id = k.case_id JOIN \
             validity v ON v.call_id = k.call_id WHERE k.call_id = {}",
            lit(call_id)
        ),
    );
    assert_eq!(d["call"]["call_id"], json!(call_id));
    assert_eq!(d["call"]["response"], want["response"], "response");
    assert_eq!(d["call"]["model"], want["model"]);
    assert_eq!(d["call"]["sample_idx"], want["sample_idx"]);
    assert_eq!(d["case"]["case_id"], want["case_id"]);
    assert_eq!(d["case"]["input"], want["input"], "input");
    assert_eq!(d["case"]["expected"], want["expected"], "expected");
    assert_eq!(d["case"]["test"], want["test"]);
    assert_eq!(d["case"]["role"], want["role"]);
    assert_eq!(d["validity"]["validity"], want["validity"], "verdict");
    let scores = sql(
        &run,
        &format!(
            "SELECT scorer, scoring_version, score, passed, label FROM scores WHERE call_id = \
             {} ORDER BY scorer, scoring_version",
            lit(call_id)
        ),
    );
    let got = d["scores"].as_array().unwrap();
    assert_eq!(got.len(), 3, "one entry per scorer version: {got:?}");
    assert_eq!(got.len(), scores.len());
    for (g, w) in got.iter().zip(&scores) {
        for k in ["scorer", "scoring_version", "passed", "label"] {
            assert_eq!(g[k], w[k], "{k} of {w}");
        }
        assert_num(&g["score"], &w["score"], "score");
    }
    let tags: BTreeSet<String> = got
        .iter()
        .map(|g| format!("{}@{}", s(g, "scorer"), s(g, "scoring_version")))
        .collect();
    assert_eq!(
        tags,
        [
            "checklist@2".to_string(),
            f.label_norm.clone(),
            f.label_exact.clone()
        ]
        .into()
    );
    d
}

#[test]
fn one_answer_has_the_call_case_verdict_and_every_scorer_version() {
    let f = fixture();
    let id = s(
        &sql_row(
            &f.run("a"),
            "SELECT call_id FROM scores WHERE scorer = 'checklist' AND test_type = 'MFT' AND \
             NOT passed ORDER BY call_id LIMIT 1",
        ),
        "call_id",
    );
    let d = assert_answer_is_sql(f, &id);
    assert!(d["case"]["expected"].is_string(), "an MFT case has a label");
    assert_eq!(d["base"], Value::Null, "not a perturbed case");
    let checklist = d["scores"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["scorer"] == "checklist")
        .unwrap();
    assert_eq!(checklist["passed"], json!(false));
}

#[test]
fn perturbed_answers_show_their_base_case() {
    let f = fixture();
    let run = f.run("a");
    for ty in ["INV", "DIR"] {
        let row = sql_row(
            &run,
            &format!(
                "SELECT k.call_id, c.group_id FROM calls k JOIN cases c ON c.case_id = \
                 k.case_id WHERE c.role = 'perturbed' AND c.test_type = '{ty}' ORDER BY \
                 k.call_id LIMIT 1"
            ),
        );
        let id = s(&row, "call_id");
        let d = assert_answer_is_sql(f, &id);
        let base = sql_row(
            &run,
            &format!(
                "SELECT case_id, input FROM cases WHERE group_id = {} AND role = 'base'",
                lit(&s(&row, "group_id"))
            ),
        );
        assert_eq!(
            d["base"]["case"]["input"], base["input"],
            "{ty}: base input"
        );
        assert_eq!(d["base"]["case"]["case_id"], base["case_id"], "{ty}");
        assert_ne!(d["base"]["case"]["input"], d["case"]["input"], "{ty}");
        let base_calls: Vec<String> = sql(
            &run,
            &format!(
                "SELECT call_id FROM calls WHERE case_id = {} AND model = 'vader' ORDER BY \
                 sample_idx",
                lit(&s(&base, "case_id"))
            ),
        )
        .iter()
        .map(|r| s(r, "call_id"))
        .collect();
        let got: Vec<String> = d["base"]["answers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| s(a, "call_id"))
            .collect();
        assert_eq!(got, base_calls, "{ty}: the base case's answers");
    }
}

#[test]
fn one_answer_samples_are_every_sample_of_its_case_with_verdict_and_score() {
    let f = fixture();
    let run = f.run("a");
    // A failing answer, so the sample's `passed` is not the default.
    let row = sql_row(
        &run,
        "SELECT call_id, case_id FROM scores WHERE scorer = 'checklist' AND NOT passed ORDER \
         BY call_id LIMIT 1",
    );
    let id = s(&row, "call_id");
    let want = sql(
        &run,
        &format!(
            "SELECT k.call_id, k.sample_idx, k.response, v.validity, s.score, s.passed FROM \
             calls k JOIN validity v ON v.call_id = k.call_id LEFT JOIN (SELECT call_id, score, \
             passed FROM scores WHERE scorer = 'checklist' AND scoring_version = '2') s ON \
             s.call_id = k.call_id WHERE k.case_id = {} AND k.model = 'vader' ORDER BY \
             k.sample_idx",
            lit(&s(&row, "case_id"))
        ),
    );
    assert_eq!(want.len(), 1, "the sentiment suite asks one sample (K = 1)");
    let d = get_json(f.base(), &format!("/api/runs/a/answers/{id}"));
    let got = d["samples"].as_array().unwrap();
    assert_eq!(
        got.len(),
        want.len(),
        "every sample, this one included: {got:?}"
    );
    for (g, w) in got.iter().zip(&want) {
        for k in ["call_id", "sample_idx", "response", "validity", "passed"] {
            assert_eq!(g[k], w[k], "{k} of sample {w}");
        }
        assert_num(&g["score"], &w["score"], "score");
    }
    assert_eq!(got[0]["call_id"], json!(id));
    assert_eq!(got[0]["passed"], json!(false));
}

#[test]
fn unknown_answer_is_a_404_json_error() {
    let f = fixture();
    let r = get(f.base(), "/api/runs/a/answers/000000000000000000000000");
    assert_eq!(r.status, 404);
    assert!(
        r.error().contains("000000000000000000000000"),
        "{}",
        r.error()
    );
    assert_eq!(
        r.header("content-type"),
        Some("application/json"),
        "an error is JSON"
    );
    let r = get(f.base(), "/api/runs/a/answers/it's%20not%20an%20id");
    assert_eq!(r.status, 404, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(get(f.base(), "/api/runs").status, 200);
}

// ------------------------------------------------------------------ scorer diff

/// Cells of a disagreement matrix: (class in A, class in B) -> answers.
type Matrix = BTreeMap<(String, String), i64>;
/// Disagreeing answers: call id -> (passed_a, passed_b).
type Disagreements = BTreeMap<String, (Value, Value)>;

/// The matrix of two pass/fail scorer versions of run `a` by SQL, and the disagreeing rows.
fn diff_by_sql(run: &Path, a: &str, b: &str) -> (Matrix, Disagreements) {
    let side = |tag: &str| {
        let (name, v) = tag.split_once('@').unwrap();
        format!(
            "(SELECT call_id, passed, CASE WHEN passed IS NULL THEN 'unscored' WHEN passed THEN \
             'pass' ELSE 'fail' END AS k FROM scores WHERE scorer = {} AND scoring_version = {})",
            lit(name),
            lit(v)
        )
    };
    let join = format!(
        "{} x FULL JOIN {} y ON x.call_id = y.call_id",
        side(a),
        side(b)
    );
    let matrix = sql(
        run,
        &format!(
            "SELECT coalesce(x.k, 'absent') AS a, coalesce(y.k, 'absent') AS b, count(*) AS n \
             FROM {join} GROUP BY 1, 2"
        ),
    )
    .iter()
    .map(|r| ((s(r, "a"), s(r, "b")), r["n"].as_i64().unwrap()))
    .collect();
    let rows = sql(
        run,
        &format!(
            "SELECT coalesce(x.call_id, y.call_id) AS call_id, x.passed AS passed_a, y.passed AS \
             passed_b FROM {join} WHERE x.k IS DISTINCT FROM y.k"
        ),
    )
    .iter()
    .map(|r| {
        (
            s(r, "call_id"),
            (r["passed_a"].clone(), r["passed_b"].clone()),
        )
    })
    .collect();
    (matrix, rows)
}

/// `/api/runs/a/scorer-diff?a=A&b=B&limit=200[&after=C]`.
fn diff_path(a: &str, b: &str, after: Option<&str>) -> String {
    let mut q = vec![("a", a), ("b", b), ("limit", "200")];
    if let Some(c) = after {
        q.push(("after", c));
    }
    with_query("/api/runs/a/scorer-diff", &q)
}

/// The matrix cells of a scorer-diff answer.
fn diff_cells(d: &Value) -> Matrix {
    d["matrix"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| ((s(c, "a"), s(c, "b")), c["n"].as_i64().unwrap()))
        .collect()
}

#[test]
fn scorer_diff_matrix_is_the_sql_full_join_of_the_two_versions() {
    let f = fixture();
    let run = f.run("a");
    let (a, b) = ("checklist@2", f.label_norm.as_str());
    let (want, disagreeing) = diff_by_sql(&run, a, b);
    let d = get_json(f.base(), &diff_path(a, b, None));
    assert_eq!(d["a"], a);
    assert_eq!(d["b"], json!(b));
    assert_eq!(diff_cells(&d), want, "matrix");
    let off: i64 = want
        .iter()
        .filter(|((x, y), _)| x != y)
        .map(|(_, n)| n)
        .sum();
    let all: i64 = want.values().sum();
    assert!(
        off > 0,
        "checklist and label_match disagree on INV/DIR cases"
    );
    assert_eq!(off, disagreeing.len() as i64);
    assert_eq!(d["disagree"], json!(off), "the off-diagonal cells");
    assert_eq!(d["total"], json!(all));
    assert_eq!(
        all,
        sql_i64(&run, "SELECT count(*) FROM calls"),
        "every answer in one cell"
    );
    // The first page: the first disagreements by call id, with both verdicts.
    let first: Vec<String> = disagreeing.keys().take(200).cloned().collect();
    let rows = d["rows"].as_array().unwrap();
    assert_eq!(
        rows.iter().map(|r| s(r, "call_id")).collect::<Vec<_>>(),
        first
    );
    for r in rows {
        let (pa, pb) = &disagreeing[&s(r, "call_id")];
        assert_eq!((&r["passed_a"], &r["passed_b"]), (pa, pb), "{r}");
        assert!(r["input"].is_string() && r["test"].is_string(), "{r}");
    }
    assert!(
        d["next"].is_string(),
        "{off} disagreements: more than a page"
    );

    // The normalised and the exact versions agree on VADER's one-word labels.
    let (want2, rows2) = diff_by_sql(&run, &f.label_norm, &f.label_exact);
    let d2 = get_json(
        f.base(),
        &with_query(
            "/api/runs/a/scorer-diff",
            &[("a", &f.label_norm), ("b", &f.label_exact)],
        ),
    );
    assert_eq!(diff_cells(&d2), want2);
    assert_eq!(d2["disagree"], json!(rows2.len()));
    assert_eq!(d2["rows"].as_array().unwrap().len(), rows2.len().min(50));

    for q in [
        "a=checklist@2",
        "a=nope@1&b=checklist@2",
        "a=checklist@2&b=checklist@2&limit=0",
    ] {
        let r = get(f.base(), &format!("/api/runs/a/scorer-diff?{q}"));
        assert_eq!(r.status, 400, "{q}");
        r.error();
    }
}

#[test]
fn scorer_diff_pages_walk_exactly_the_disagreeing_answers() {
    let f = fixture();
    let (a, b) = ("checklist@2", f.label_norm.as_str());
    let (_, disagreeing) = diff_by_sql(&f.run("a"), a, b);
    let walk = |base: &str| {
        let (mut rows, mut after, mut pages) = (Vec::new(), None::<String>, 0);
        loop {
            let path = diff_path(a, b, after.as_deref());
            let r = get(base, &path);
            // Every page after the first was a 500 when the keyset was appended to `x.k IS
            // DISTINCT FROM y.k` without parentheses (it parsed as `y.k AND ...`).
            assert_eq!(
                r.status,
                200,
                "GET {path}: {}",
                String::from_utf8_lossy(&r.body)
            );
            let page = r.json();
            rows.extend(page["rows"].as_array().unwrap().iter().cloned());
            pages += 1;
            match page["next"].as_str() {
                Some(c) => after = Some(c.to_string()),
                None => break,
            }
            assert!(pages < 1000, "the walk does not end");
        }
        assert!(pages > 1, "{} disagreements on pages of 200", rows.len());
        rows
    };
    // Pages from the disagreeing ids kept with the matrix, and (a viewer that keeps none)
    // by joining the slices from the cursor on: the same rows.
    let kept = walk(f.base());
    let joining = Served::start_with(
        &["view", f.root.to_str().unwrap(), "--addr", "127.0.0.1:0"],
        &[
            ("EVALFLOW_VIEW_DIFF_ROWS", "1500"),
            ("EVALFLOW_VIEW_DIFF_IDS", "0"),
        ],
        &f.dir.join("viewer-joining.log"),
    );
    let joined = walk(&joining.base);
    assert_eq!(kept, joined);
    let mut seen = Vec::new();
    for row in &kept {
        let id = s(row, "call_id");
        let (pa, pb) = disagreeing
            .get(&id)
            .unwrap_or_else(|| panic!("{id} is not a disagreement"));
        assert_eq!((&row["passed_a"], &row["passed_b"]), (pa, pb), "{id}");
        seen.push(id);
    }
    let set: BTreeSet<String> = seen.iter().cloned().collect();
    assert_eq!(set.len(), seen.len(), "a disagreement shown twice");
    assert_eq!(set, disagreeing.keys().cloned().collect::<BTreeSet<_>>());
}

// ------------------------------------------------------------------ compare

#[test]
fn compare_rows_equal_evalflow_compare_json() {
    let f = fixture();
    for (a, b) in [("a", "b"), ("a", "small")] {
        let cli = printed_json(&ok(
            &[
                "compare",
                f.run(a).to_str().unwrap(),
                f.run(b).to_str().unwrap(),
                "--format",
                "json",
            ],
            &[],
        ));
        let d = get_json(f.base(), &format!("/api/compare?a={a}&b={b}"));
        assert_eq!(d["a"], a);
        assert_eq!(d["b"], b);
        let key = |r: &Value| (s(r, "level"), s(r, "capability"), s(r, "test"));
        let want: BTreeMap<_, _> = cli
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (key(r), r))
            .collect();
        let got: BTreeMap<_, _> = d["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (key(r), r))
            .collect();
        assert_eq!(want.len(), cli.as_array().unwrap().len());
        assert!(want.len() > 20, "{a} vs {b}: {} rows", want.len());
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{a} vs {b}: rows"
        );
        for (k, w) in &want {
            let g = got[k];
            assert!(same_value(g, w), "{a} vs {b} {k:?}:\n API {g}\n CLI {w}");
        }
        let verdicts: BTreeSet<String> = want.values().map(|r| s(r, "verdict")).collect();
        assert!(!verdicts.is_empty());
        // The same cases answered alike by the same model: no answer flipped.
        assert_eq!(d["flipped"], json!([]), "{a} vs {b}");
    }
    let r = get(f.base(), "/api/compare?a=a");
    assert_eq!(r.status, 400);
    assert!(r.error().contains('b'), "{}", r.error());
}

// ------------------------------------------------------------------ the SQL box

#[test]
fn sql_box_answers_queries_and_refuses_every_write() {
    let f = fixture();
    let b = f.base();
    let calls = sql_i64(&f.run("a"), "SELECT count(*) FROM calls");
    let r = post_json(
        b,
        "/api/runs/a/sql",
        &json!({"sql": "SELECT count(*) AS n FROM calls"}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert_eq!(v["columns"], json!(["n"]));
    assert_eq!(v["rows"], json!([[calls]]));
    assert_eq!(v["truncated"], json!(false));
    // Every evalflow function is there.
    let v = post_json(
        b,
        "/api/runs/a/sql",
        &json!({"sql": "SELECT clustered_mean_ci(CASE WHEN passed THEN 0.0 ELSE 1.0 END, \
                 template_id)['n'] AS n FROM scores WHERE scorer = 'checklist' AND passed IS \
                 NOT NULL AND role <> 'base'"}),
    )
    .json();
    let n = sql_i64(
        &f.run("a"),
        "SELECT count(*) FROM scores WHERE scorer = 'checklist' AND passed IS NOT NULL AND role \
         <> 'base'",
    );
    assert_eq!(v["rows"], json!([[n]]), "{v}");

    // The Parquet download holds the rows the JSON answer has, in their types.
    use datafusion::arrow::array::AsArray;
    let q = "SELECT test, count(*) AS n, avg(score) AS mean FROM scores WHERE scorer = \
             'checklist' GROUP BY test ORDER BY test";
    let want = post_json(b, "/api/runs/a/sql", &json!({ "sql": q })).json();
    let r = post_json(b, "/api/runs/a/sql.parquet", &json!({ "sql": q }));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.header("content-type"),
        Some("application/vnd.apache.parquet")
    );
    assert_eq!(r.header("x-evalflow-truncated"), Some("false"));
    let reader = datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReader::try_new(
        bytes::Bytes::from(r.body.clone()),
        1024,
    )
    .unwrap();
    let mut got = Vec::new();
    for batch in reader {
        let batch = batch.unwrap();
        let test = batch.column(0).as_string::<i32>();
        let n = batch
            .column(1)
            .as_primitive::<datafusion::arrow::datatypes::Int64Type>();
        let mean = batch
            .column(2)
            .as_primitive::<datafusion::arrow::datatypes::Float64Type>();
        for i in 0..batch.num_rows() {
            got.push(json!([test.value(i), n.value(i), mean.value(i)]));
        }
    }
    assert!(got.len() > 3, "{got:?}");
    assert_eq!(Value::Array(got), want["rows"]);
    let refused = post_json(
        b,
        "/api/runs/a/sql.parquet",
        &json!({"sql": "DROP TABLE calls"}),
    );
    assert_eq!(refused.status, 400);

    let copy_to = f.dir.join("copied.csv");
    let external = f.dir.join("external.csv");
    std::fs::write(&external, "x\n1\n").unwrap();
    for q in [
        "DROP TABLE calls".to_string(),
        "INSERT INTO calls SELECT * FROM calls".to_string(),
        format!("COPY (SELECT 1) TO '{}'", copy_to.display()),
        "COPY (SELECT 1) TO '/tmp/x'".to_string(),
        "CREATE TABLE t AS SELECT 1".to_string(),
        "CREATE VIEW w AS SELECT 1".to_string(),
        format!(
            "CREATE EXTERNAL TABLE e STORED AS CSV LOCATION '{}'",
            external.display()
        ),
        "SET datafusion.execution.batch_size = 1".to_string(),
        "SELECT * FROM no_such_table".to_string(),
    ] {
        let r = post_json(b, "/api/runs/a/sql", &json!({ "sql": q }));
        assert_eq!(r.status, 400, "{q}: {}", String::from_utf8_lossy(&r.body));
        assert!(!r.error().is_empty(), "{q}");
    }
    assert!(!copy_to.exists(), "COPY wrote {}", copy_to.display());
    for q in ["SELECT * FROM t", "SELECT * FROM w", "SELECT * FROM e"] {
        let r = post_json(b, "/api/runs/a/sql", &json!({ "sql": q }));
        assert_eq!(r.status, 400, "{q}: a refused statement created nothing");
    }
    // The run is unchanged.
    assert_eq!(sql_i64(&f.run("a"), "SELECT count(*) FROM calls"), calls);

    let bodies: [&[u8]; 5] = [
        b"{\"sql\": ",
        b"not json",
        b"",
        b"{\"query\": \"SELECT 1\"}",
        b"{\"sql\": 1}",
    ];
    for body in bodies {
        let r = post_raw(b, "/api/runs/a/sql", body);
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(body));
        assert!(r.error().contains("sql"), "{}", r.error());
    }
    let r = post_json(b, "/api/runs/nope/sql", &json!({"sql": "SELECT 1"}));
    assert_eq!(r.status, 404);
    assert_eq!(get(b, "/api/runs").status, 200, "still serving");
}

#[test]
fn sql_box_stops_at_1000_rows() {
    let f = fixture();
    let b = f.base();
    let scores = sql_i64(&f.run("a"), "SELECT count(*) FROM scores");
    assert!(scores > 1000);
    let v = post_json(
        b,
        "/api/runs/a/sql",
        &json!({"sql": "SELECT call_id, scorer FROM scores"}),
    )
    .json();
    assert_eq!(v["rows"].as_array().unwrap().len(), 1000);
    assert_eq!(v["truncated"], json!(true));
    assert_eq!(v["columns"], json!(["call_id", "scorer"]));
    let v = post_json(
        b,
        "/api/runs/a/sql",
        &json!({"sql": "SELECT call_id FROM calls ORDER BY call_id LIMIT 1000"}),
    )
    .json();
    assert_eq!(v["rows"].as_array().unwrap().len(), 1000);
    assert_eq!(
        v["truncated"],
        json!(false),
        "exactly 1000 rows are all the rows"
    );
    let first = s(
        &sql_row(&f.run("a"), "SELECT min(call_id) AS c FROM calls"),
        "c",
    );
    assert_eq!(v["rows"][0][0], json!(first));
    let v = post_json(
        b,
        "/api/runs/a/sql",
        &json!({"sql": "SELECT call_id FROM calls LIMIT 1001"}),
    )
    .json();
    assert_eq!(v["rows"].as_array().unwrap().len(), 1000);
    assert_eq!(v["truncated"], json!(true));
}

// ------------------------------------------------------------------ safety

#[test]
fn another_interface_than_loopback_needs_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let o = output_within(
        evalflow(
            &["view", dir.path().to_str().unwrap(), "--addr", "0.0.0.0:0"],
            &[],
        ),
        60,
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--token"),
        "{}",
        text(&o)
    );
    assert!(!text(&o).contains("listening on"), "{}", text(&o));
}

#[test]
fn token_is_needed_by_header_query_or_cookie() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let v = Served::start(
        &[
            "view",
            f.root.to_str().unwrap(),
            "--addr",
            "127.0.0.1:0",
            "--token",
            "secret",
        ],
        &dir.path().join("viewer.log"),
    );
    let b = v.base.as_str();
    for path in ["/api/runs", "/", "/runs/a", "/assets/app.js"] {
        let r = get(b, path);
        assert_eq!(r.status, 401, "{path}");
        assert!(r.error().contains("token"), "{path}: {}", r.error());
    }
    let bearer = request(
        b,
        "GET",
        "/api/runs",
        &[("Authorization", "Bearer secret")],
        None,
    );
    assert_eq!(bearer.status, 200);
    assert_eq!(bearer.json().as_array().unwrap().len(), 3);
    let wrong = request(
        b,
        "GET",
        "/api/runs",
        &[("Authorization", "Bearer nope")],
        None,
    );
    assert_eq!(wrong.status, 401);
    let q = get(b, "/api/runs?token=secret");
    assert_eq!(q.status, 200);
    let cookie = q.header("set-cookie").unwrap_or_default();
    assert!(cookie.starts_with("evalflow_token=secret"), "{cookie}");
    assert!(cookie.contains("HttpOnly"), "{cookie}");
    let page = get(b, "/?token=secret");
    assert_eq!(page.status, 200);
    assert!(page.header("set-cookie").is_some());
    let with_cookie = request(
        b,
        "GET",
        "/api/runs",
        &[("Cookie", "evalflow_token=secret")],
        None,
    );
    assert_eq!(with_cookie.status, 200);
    let sql = request(
        b,
        "POST",
        "/api/runs/a/sql",
        &[("Content-Type", "application/json")],
        Some(br#"{"sql": "SELECT 1"}"#),
    );
    assert_eq!(sql.status, 401, "a query needs the token too");
    drop(v);
}

#[test]
fn run_ids_with_dot_dot_are_refused() {
    let f = fixture();
    for path in [
        "/api/runs/..%2Fa",
        "/api/runs/%2E%2E",
        "/api/runs/..",
        "/api/runs/a%2F..%2F..%2Fetc/results",
        "/api/runs/..%2F..%2Fetc/answers",
        "/api/compare?a=..%2Fa&b=b",
    ] {
        let r = get(f.base(), path);
        assert!(
            (400..500).contains(&r.status),
            "{path}: HTTP {} {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
        r.error();
    }
    let r = post_json(
        f.base(),
        "/api/runs/..%2Fa/sql",
        &json!({"sql": "SELECT 1"}),
    );
    assert!((400..500).contains(&r.status), "{}", r.status);
    assert_eq!(get(f.base(), "/api/runs").status, 200);
}

/// Copies a folder recursively.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).unwrap();
        }
    }
}

#[test]
fn malformed_runs_are_listed_with_their_error_and_the_others_still_work() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    copy_dir(&f.run("b"), &root.join("good"));
    copy_dir(&f.run("b"), &root.join("badpart"));
    std::fs::write(
        root.join("badpart/calls/part-zzzz.parquet"),
        b"this is not a Parquet file",
    )
    .unwrap();
    std::fs::create_dir_all(root.join("badjson")).unwrap();
    std::fs::write(root.join("badjson/manifest.json"), b"{ not json").unwrap();
    let v = Served::start(
        &["view", root.to_str().unwrap(), "--addr", "127.0.0.1:0"],
        &dir.path().join("viewer.log"),
    );
    let runs = get_json(&v.base, "/api/runs");
    let by_path: BTreeMap<String, &Value> = runs
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (s(r, "path"), r))
        .collect();
    assert_eq!(
        by_path.keys().cloned().collect::<Vec<_>>(),
        ["badjson", "badpart", "good"].map(String::from)
    );
    let bad_json = by_path["badjson"];
    assert_eq!(bad_json["status"], "error", "{bad_json}");
    assert!(s(bad_json, "error").contains("manifest.json"), "{bad_json}");
    let bad_part = by_path["badpart"];
    assert_eq!(bad_part["status"], "error", "{bad_part}");
    assert!(
        s(bad_part, "error").contains("part-zzzz.parquet"),
        "{bad_part}"
    );
    assert!(s(bad_part, "error").contains("Parquet"), "{bad_part}");
    let good = by_path["good"];
    assert_eq!(good["status"], "complete");
    let calls = sql_i64(&f.run("b"), "SELECT count(*) FROM calls");
    assert_eq!(good["answers"], json!(calls));
    // The good run is served in full; the bad ones answer a JSON error, and the server stays.
    let id = s(good, "run_id");
    let page = get_json(&v.base, &format!("/api/runs/{id}/answers?limit=10"));
    assert_eq!(page["rows"].as_array().unwrap().len(), 10);
    let results = get_json(&v.base, &format!("/api/runs/{id}/results"));
    assert!(!results.as_array().unwrap().is_empty());
    for path in [
        "/api/runs/badpart/answers",
        "/api/runs/badjson",
        "/api/runs/badpart/results",
    ] {
        let r = get(&v.base, path);
        assert!((400..600).contains(&r.status), "{path}: {}", r.status);
        assert!(!r.error().is_empty(), "{path}");
    }
    // Listed again alike (the headline aside: it is computed in the background).
    let summary = |v: &Value| -> Vec<[String; 4]> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| ["path", "status", "error", "answers"].map(|k| s(r, k)))
            .collect()
    };
    assert_eq!(summary(&get_json(&v.base, "/api/runs")), summary(&runs));
    drop(v);
}

// ------------------------------------------------------------------ live

#[test]
fn a_run_written_while_the_viewer_is_open_appears() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    let v = Served::start(
        &["view", root.to_str().unwrap(), "--addr", "127.0.0.1:0"],
        &dir.path().join("viewer.log"),
    );
    assert_eq!(get_json(&v.base, "/api/runs"), json!([]));
    let x = root.join("x");
    ok(
        &[
            "run",
            "pipelines/sentiment.toml",
            "--out",
            x.to_str().unwrap(),
        ],
        &[],
    );
    let calls = sql_i64(&x, "SELECT count(*) FROM calls");
    let start = Instant::now();
    let run = loop {
        let runs = get_json(&v.base, "/api/runs");
        if let Some(r) = runs
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["run_id"] == "x" && r["answers"] == json!(calls))
        {
            break r.clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "run x ({calls} calls) not listed after 20 s: {runs}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(run["status"], "complete", "{run}");
    let page = get_json(&v.base, "/api/runs/x/answers?limit=5");
    assert_eq!(page["rows"].as_array().unwrap().len(), 5);
    drop(v);
}

// ------------------------------------------------------------------ pages in Chromium

/// Whether a tool the page tests need is missing: under `CI` (which installs it) that fails
/// the test, elsewhere the test says why it checks nothing and returns.
fn missing(tool: &str, test: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if found {
        return false;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{test}: {tool} is not installed (CI installs it)"
    );
    eprintln!("SKIPPED {test}: {tool} is not installed (apt-get install {tool}); nothing checked");
    true
}

fn chromium_name() -> Option<&'static str> {
    ["chromium", "chromium-browser"].into_iter().find(|n| {
        Command::new("sh")
            .args(["-c", &format!("command -v {n}")])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// The DOM headless Chromium builds from `url` of the fixture's viewer, or `None` (after
/// saying why) when Chromium is not installed.
fn dump_dom(test: &str, path: &str) -> Option<String> {
    let Some(chromium) = chromium_name() else {
        missing("chromium", test);
        return None;
    };
    let f = fixture();
    let profile = tempfile::tempdir().unwrap();
    let url = format!("{}{path}", f.base());
    let mut c = Command::new(chromium);
    c.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-quic",
        "--dump-dom",
        "--virtual-time-budget=5000",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .arg(&url);
    let o = output_within(c, 120);
    assert!(o.status.success(), "chromium {url}: {}", text(&o));
    let dom = String::from_utf8(o.stdout).unwrap();
    let body = elements(&dom, |n, _| n == "body");
    assert_eq!(
        body.first()
            .and_then(|b| b.attrs.get("data-ready"))
            .map(String::as_str),
        Some("1"),
        "{url}: the page never finished: {}",
        &dom[..dom.len().min(2000)]
    );
    let banner = elements(&dom, |_, a| {
        a.get("id").is_some_and(|i| i == "error-banner")
    });
    assert!(
        banner.iter().all(|b| b.attrs.contains_key("hidden")),
        "{url}: error banner shown: {}",
        banner.first().map(|b| b.text()).unwrap_or_default()
    );
    Some(dom)
}

/// An element of a serialised DOM: its tag, attributes and inner HTML.
struct El {
    attrs: BTreeMap<String, String>,
    inner: String,
}

impl El {
    fn attr(&self, k: &str) -> &str {
        self.attrs
            .get(k)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("no {k} in {:?}", self.attrs))
    }
    /// The element's text (tags dropped, entities decoded).
    fn text(&self) -> String {
        let mut out = String::new();
        let mut in_tag = false;
        for ch in self.inner.chars() {
            match ch {
                '<' => in_tag = true,
                '>' if in_tag => in_tag = false,
                c if !in_tag => out.push(c),
                _ => {}
            }
        }
        decode(&out)
    }
}

fn decode(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&")
}

const VOID: &[&str] = &[
    "input", "br", "img", "meta", "link", "hr", "col", "source", "wbr",
];

/// The elements of `html` whose tag and attributes satisfy `pred`, in document order
/// (Chromium's serialisation: lower-case tags, double-quoted attributes).
fn elements(html: &str, pred: impl Fn(&str, &BTreeMap<String, String>) -> bool) -> Vec<El> {
    let b = html.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(off) = html[i..].find('<') {
        let start = i + off;
        i = start + 1;
        if !b.get(i).is_some_and(u8::is_ascii_alphabetic) {
            continue;
        }
        let mut j = i;
        while j < b.len() && !b[j].is_ascii_whitespace() && b[j] != b'>' && b[j] != b'/' {
            j += 1;
        }
        let name = html[i..j].to_ascii_lowercase();
        let mut attrs = BTreeMap::new();
        loop {
            while j < b.len() && (b[j].is_ascii_whitespace() || b[j] == b'/') {
                j += 1;
            }
            if j >= b.len() || b[j] == b'>' {
                break;
            }
            let k0 = j;
            while j < b.len() && !b[j].is_ascii_whitespace() && b[j] != b'=' && b[j] != b'>' {
                j += 1;
            }
            let key = html[k0..j].to_string();
            let mut value = String::new();
            if j < b.len() && b[j] == b'=' {
                j += 1;
                if b[j] == b'"' || b[j] == b'\'' {
                    let q = b[j];
                    let v0 = j + 1;
                    j = v0;
                    while j < b.len() && b[j] != q {
                        j += 1;
                    }
                    value = decode(&html[v0..j]);
                    j += 1;
                } else {
                    let v0 = j;
                    while j < b.len() && !b[j].is_ascii_whitespace() && b[j] != b'>' {
                        j += 1;
                    }
                    value = decode(&html[v0..j]);
                }
            }
            attrs.insert(key, value);
        }
        let open_end = (j + 1).min(b.len());
        if pred(&name, &attrs) {
            let inner = if VOID.contains(&name.as_str()) {
                String::new()
            } else {
                inner_html(html, open_end, &name)
            };
            out.push(El { attrs, inner });
        }
        i = open_end;
    }
    out
}

/// The HTML from `from` to the close tag of `name` that matches its open tag.
fn inner_html(html: &str, from: usize, name: &str) -> String {
    let (open, close) = (format!("<{name}"), format!("</{name}>"));
    let mut depth = 1;
    let mut k = from;
    while k < html.len() {
        let next_open = html[k..].find(&open).map(|o| k + o);
        let next_close = html[k..].find(&close).map(|o| k + o);
        match (next_open, next_close) {
            (Some(o), Some(c)) if o < c => {
                let after = html.as_bytes().get(o + open.len()).copied().unwrap_or(b'>');
                if after == b'>' || after.is_ascii_whitespace() {
                    depth += 1;
                }
                k = o + open.len();
            }
            (_, Some(c)) => {
                depth -= 1;
                if depth == 0 {
                    return html[from..c].to_string();
                }
                k = c + close.len();
            }
            _ => break,
        }
    }
    html[from..].to_string()
}

fn by_id<'a>(els: &'a [El], what: &str) -> &'a El {
    els.first()
        .unwrap_or_else(|| panic!("no {what} in the page"))
}

fn has(attr: &'static str) -> impl Fn(&str, &BTreeMap<String, String>) -> bool {
    move |_, a| a.contains_key(attr)
}

fn id_is(id: &'static str) -> impl Fn(&str, &BTreeMap<String, String>) -> bool {
    move |_, a| a.get("id").is_some_and(|i| i == id)
}

/// A number of a `data-*` attribute ("" for null).
fn attr_num(v: &str) -> Value {
    if v.is_empty() {
        Value::Null
    } else {
        json!(
            v.parse::<f64>()
                .unwrap_or_else(|_| panic!("not a number: {v}"))
        )
    }
}

#[test]
fn page_index_lists_every_run_with_its_answers() {
    let Some(dom) = dump_dom("page_index_lists_every_run_with_its_answers", "/") else {
        return;
    };
    let f = fixture();
    let want: BTreeMap<String, (String, String)> = get_json(f.base(), "/api/runs")
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (s(r, "run_id"), (s(r, "status"), s(r, "answers"))))
        .collect();
    let got: BTreeMap<String, (String, String)> =
        elements(&dom, |n, a| n == "tr" && a.contains_key("data-run-id"))
            .iter()
            .map(|e| {
                (
                    e.attr("data-run-id").to_string(),
                    (
                        e.attr("data-status").to_string(),
                        e.attr("data-answers").to_string(),
                    ),
                )
            })
            .collect();
    assert_eq!(got, want);
    assert_eq!(got.len(), 3);
}

#[test]
fn page_run_forest_rows_are_the_results_rows() {
    let Some(dom) = dump_dom("page_run_forest_rows_are_the_results_rows", "/runs/a") else {
        return;
    };
    let f = fixture();
    assert_eq!(elements(&dom, id_is("forest")).len(), 1);
    // The page shows the headline's scorer version: checklist@2.
    let want = sql(
        &f.run("a"),
        "SELECT * FROM results WHERE scorer = 'checklist' AND scoring_version = '2'",
    );
    let key = |level: &str, cap: &str, ty: &str, test: &str, label: &str| {
        [level, cap, ty, test, label].map(String::from)
    };
    let want: BTreeMap<_, _> = want
        .iter()
        .map(|r| {
            (
                key(
                    &s(r, "level"),
                    &s(r, "capability"),
                    &s(r, "test_type"),
                    &s(r, "test"),
                    &s(r, "label"),
                ),
                r,
            )
        })
        .collect();
    let rows = elements(&dom, has("data-result-row"));
    assert_eq!(rows.len(), want.len(), "one forest row per results row");
    for e in &rows {
        let k = key(
            e.attr("data-level"),
            e.attr("data-capability"),
            e.attr("data-test-type"),
            e.attr("data-test"),
            e.attr("data-label"),
        );
        let w = want
            .get(&k)
            .unwrap_or_else(|| panic!("forest row {k:?} is no results row"));
        assert_eq!(e.attr("data-model"), "vader");
        assert_num(
            &attr_num(e.attr("data-value")),
            &w["value"],
            &format!("{k:?} value"),
        );
        assert_num(
            &attr_num(e.attr("data-lo")),
            &w["ci_lo"],
            &format!("{k:?} lo"),
        );
        assert_num(
            &attr_num(e.attr("data-hi")),
            &w["ci_hi"],
            &format!("{k:?} hi"),
        );
        assert_num(&attr_num(e.attr("data-n")), &w["n"], &format!("{k:?} n"));
        assert_eq!(e.attr("data-clustered"), s(w, "clustered"), "{k:?}");
    }
}

#[test]
fn page_answers_rows_are_the_api_page() {
    let f = fixture();
    let test = "Add typos";
    let path = with_query("/runs/a/answers", &[("test", test)]);
    let Some(dom) = dump_dom("page_answers_rows_are_the_api_page", &path) else {
        return;
    };
    let api = get_json(
        f.base(),
        &with_query("/api/runs/a/answers", &[("test", test)]),
    );
    let want: Vec<String> = api["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| s(r, "call_id"))
        .collect();
    assert_eq!(want.len(), 50, "a full first page");
    let table = elements(&dom, id_is("answers-table"));
    let got: Vec<String> = elements(&by_id(&table, "#answers-table").inner, |n, a| {
        n == "tr" && a.contains_key("data-call-id")
    })
    .iter()
    .map(|e| e.attr("data-call-id").to_string())
    .collect();
    assert_eq!(got, want);
    let count = elements(&dom, id_is("answers-count"));
    assert_eq!(by_id(&count, "#answers-count").attr("data-rows"), "50");
    assert_eq!(
        elements(&dom, id_is("next-page")).len(),
        1,
        "there is a next page"
    );
    let select = elements(&dom, id_is("f-test"));
    let chosen = elements(&by_id(&select, "#f-test").inner, |n, a| {
        n == "option" && a.contains_key("selected")
    });
    assert_eq!(by_id(&chosen, "the selected test").attr("value"), test);
    assert_eq!(elements(&dom, id_is("answer-filters")).len(), 1);
}

#[test]
fn page_one_answer_shows_the_call_its_case_and_its_base() {
    let f = fixture();
    let run = f.run("a");
    let row = sql_row(
        &run,
        "SELECT k.call_id, k.response, c.input, c.group_id, v.validity FROM calls k JOIN cases c \
         ON c.case_id = k.case_id JOIN validity v ON v.call_id = k.call_id WHERE c.role = \
         'perturbed' AND c.test_type = 'INV' ORDER BY k.call_id LIMIT 1",
    );
    let id = s(&row, "call_id");
    let Some(dom) = dump_dom(
        "page_one_answer_shows_the_call_its_case_and_its_base",
        &format!("/runs/a/answers/{id}"),
    ) else {
        return;
    };
    let detail = elements(&dom, id_is("answer-detail"));
    let detail = by_id(&detail, "#answer-detail");
    assert_eq!(detail.attr("data-call-id"), id);
    let field = |name: &str| -> String {
        let els = elements(&detail.inner, |_, a| {
            a.get("data-field").is_some_and(|v| v == name)
        });
        by_id(&els, name).text()
    };
    assert_eq!(field("response"), s(&row, "response"));
    assert_eq!(field("input"), s(&row, "input"));
    let verdict = elements(&detail.inner, |_, a| {
        a.get("data-field").is_some_and(|v| v == "validity")
    });
    assert_eq!(
        by_id(&verdict, "validity").attr("data-validity"),
        s(&row, "validity")
    );
    let base = sql_row(
        &run,
        &format!(
            "SELECT input FROM cases WHERE group_id = {} AND role = 'base'",
            lit(&s(&row, "group_id"))
        ),
    );
    assert_eq!(field("base-input"), s(&base, "input"));
    let scorers: Vec<String> = elements(&detail.inner, |n, a| {
        n == "tr" && a.contains_key("data-scorer")
    })
    .iter()
    .map(|e| e.attr("data-scorer").to_string())
    .collect();
    let mut want = vec![
        "checklist@2".to_string(),
        f.label_norm.clone(),
        f.label_exact.clone(),
    ];
    want.sort();
    assert_eq!(scorers, want, "#scores-table: every scorer version");
    // An MFT answer shows its expected label.
    let mft = sql_row(
        &run,
        "SELECT k.call_id, c.expected FROM calls k JOIN cases c ON c.case_id = k.case_id WHERE \
         c.test_type = 'MFT' ORDER BY k.call_id LIMIT 1",
    );
    let Some(dom) = dump_dom(
        "page_one_answer_shows_the_call_its_case_and_its_base",
        &format!("/runs/a/answers/{}", s(&mft, "call_id")),
    ) else {
        return;
    };
    let expected = elements(&dom, |_, a| {
        a.get("data-field").is_some_and(|v| v == "expected")
    });
    let pre = elements(&by_id(&expected, "expected").inner, |n, _| n == "pre");
    assert_eq!(by_id(&pre, "expected label").text(), s(&mft, "expected"));

    // One sample per case (K = 1): no samples section (the answer is not shown twice).
    let samples = elements(&detail.inner, has("data-sample-idx"));
    assert_eq!(samples.len(), 0, "K = 1: no samples section");
}

#[test]
fn page_scorer_diff_cells_are_the_matrix() {
    let f = fixture();
    let path = with_query(
        "/runs/a/scorers",
        &[("a", "checklist@2"), ("b", &f.label_norm)],
    );
    let Some(dom) = dump_dom("page_scorer_diff_cells_are_the_matrix", &path) else {
        return;
    };
    let (want, _) = diff_by_sql(&f.run("a"), "checklist@2", &f.label_norm);
    let cells = elements(&dom, |n, a| {
        n == "td" && a.contains_key("data-a") && a.contains_key("data-b")
    });
    assert!(!cells.is_empty());
    let mut shown = BTreeMap::new();
    for c in &cells {
        let k = (c.attr("data-a").to_string(), c.attr("data-b").to_string());
        let n: i64 = c.attr("data-n").parse().unwrap();
        assert_eq!(n, want.get(&k).copied().unwrap_or(0), "cell {k:?}");
        if n > 0 {
            shown.insert(k, n);
        }
    }
    assert_eq!(shown, want, "every cell of the matrix is on the page");
    let api = get_json(
        f.base(),
        &with_query(
            "/api/runs/a/scorer-diff",
            &[("a", "checklist@2"), ("b", &f.label_norm)],
        ),
    );
    let dis = elements(&dom, id_is("diff-disagree"));
    let dis = by_id(&dis, "#diff-disagree");
    assert_eq!(dis.attr("data-disagree"), api["disagree"].to_string());
    assert_eq!(dis.attr("data-total"), api["total"].to_string());
    let rows_el = elements(&dom, id_is("diff-rows"));
    let rows: Vec<String> = elements(&by_id(&rows_el, "#diff-rows").inner, has("data-call-id"))
        .iter()
        .map(|e| e.attr("data-call-id").to_string())
        .collect();
    let want_rows: Vec<String> = api["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| s(r, "call_id"))
        .collect();
    assert_eq!(rows, want_rows);
    for (sel, v) in [("diff-a", "checklist@2"), ("diff-b", f.label_norm.as_str())] {
        let select = elements(&dom, |_, a| a.get("id").is_some_and(|i| i == sel));
        let chosen = elements(&by_id(&select, sel).inner, |n, a| {
            n == "option" && a.contains_key("selected")
        });
        assert_eq!(by_id(&chosen, sel).attr("value"), v, "#{sel}");
    }
}

#[test]
fn page_sql_box_shows_the_query_result() {
    let f = fixture();
    let q = "SELECT count(*) AS n FROM calls";
    let Some(dom) = dump_dom(
        "page_sql_box_shows_the_query_result",
        &with_query("/runs/a/sql", &[("q", q)]),
    ) else {
        return;
    };
    let calls = sql_i64(&f.run("a"), "SELECT count(*) FROM calls");
    let count = elements(&dom, id_is("sql-count"));
    assert_eq!(by_id(&count, "#sql-count").attr("data-rows"), "1");
    let result = elements(&dom, id_is("sql-result"));
    let cells: Vec<String> = elements(&by_id(&result, "#sql-result").inner, |n, _| n == "td")
        .iter()
        .map(El::text)
        .collect();
    assert_eq!(cells, vec![calls.to_string()]);
    assert_eq!(elements(&dom, id_is("sql-input")).len(), 1);
    assert!(elements(&dom, id_is("sql-truncated")).is_empty());
    let err = elements(&dom, id_is("sql-error"));
    assert!(by_id(&err, "#sql-error").attrs.contains_key("hidden"));
}

#[test]
fn page_compare_rows_are_the_compare_rows() {
    let Some(dom) = dump_dom("page_compare_rows_are_the_compare_rows", "/compare?a=a&b=b") else {
        return;
    };
    let f = fixture();
    let cli = printed_json(&ok(
        &[
            "compare",
            f.run("a").to_str().unwrap(),
            f.run("b").to_str().unwrap(),
            "--format",
            "json",
        ],
        &[],
    ));
    let mut want: Vec<(String, String, String)> = cli
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (s(r, "level"), s(r, "test"), s(r, "verdict")))
        .collect();
    let table = elements(&dom, id_is("compare-table"));
    let mut got: Vec<(String, String, String)> =
        elements(&by_id(&table, "#compare-table").inner, |n, a| {
            n == "tr" && a.contains_key("data-level")
        })
        .iter()
        .map(|e| {
            (
                e.attr("data-level").to_string(),
                e.attr("data-test").to_string(),
                e.attr("data-verdict").to_string(),
            )
        })
        .collect();
    want.sort();
    got.sort();
    assert_eq!(got, want);
    assert!(
        elements(&dom, id_is("flipped")).is_empty(),
        "no answer flipped"
    );
}

// ------------------------------------------------------------------ a scripted session

#[test]
fn scripted_browser_session_follows_the_url_and_stays_on_loopback() {
    const TEST: &str = "scripted_browser_session_follows_the_url_and_stays_on_loopback";
    if missing("node", TEST) {
        return;
    }
    let Some(chromium) = chromium_name() else {
        missing("chromium", TEST);
        return;
    };
    let f = fixture();
    let mut c = Command::new("node");
    c.args([
        "--experimental-websocket",
        "tests/view_browser/drive.js",
        f.base(),
        "a",
    ])
    .current_dir(repo())
    .env("CHROMIUM", chromium)
    .env("NODE_NO_WARNINGS", "1");
    let o = output_within(c, 240);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let passes = out.lines().filter(|l| l.starts_with("PASS ")).count();
    let fails: Vec<&str> = out.lines().filter(|l| l.starts_with("FAIL ")).collect();
    assert!(fails.is_empty(), "{}", text(&o));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(passes >= 30, "{passes} checks passed: {}", text(&o));
    for needle in [
        "PASS forest row click opens its answers",
        "PASS changing the passed select changes the URL",
        "PASS search rows are the API page",
        "PASS forward twice returns to the search",
        "PASS answer page shows the response",
        "PASS Ctrl+Enter runs the query and puts it in the URL",
        "PASS no request leaves 127.0.0.1",
    ] {
        assert!(out.contains(needle), "{needle}: {out}");
    }
}
