//! moto's S3 server on loopback for the tests that need real object storage (`.ci/run`
//! installs `moto[server]`), with one bucket created.

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};

/// The server, stopped when dropped.
pub struct Moto {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub endpoint: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Moto {
    /// Starts the server on a free port and creates `bucket`.
    pub fn start(bucket: &str) -> Moto {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // `python3 -m moto.server` works wherever pip put moto, even without its script on PATH.
        let child = Command::new("python3")
            .args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "python3 runs moto's server (python3 -m pip install 'moto[server]'; .ci/run does)",
            );
        let addr = format!("127.0.0.1:{port}");
        let moto = Moto {
            child,
            endpoint: format!("http://{addr}"),
        };
        for _ in 0..100 {
            if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
                write!(s, "PUT /{bucket} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").unwrap();
                let mut resp = String::new();
                let _ = s.read_to_string(&mut resp);
                if resp.starts_with("HTTP/1.1 200") {
                    return moto;
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("moto's server did not start on {addr}: python3 -m pip install 'moto[server]'");
    }

    /// The `AWS_*` environment that points object_store at this server.
    #[allow(dead_code)] // each test binary compiles this module; not every one needs it
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ENDPOINT", self.endpoint.clone()),
            ("AWS_ALLOW_HTTP", "true".into()),
        ]
    }
}

/// `tests/fault_proxy.py` in front of a [`Moto`]: each request meets an injected fault
/// (503 SlowDown, 500, a reset, a slow answer, an answer lost after the store committed)
/// with probability `rate`. Stopped when dropped.
#[allow(dead_code)]
pub struct FaultProxy {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub endpoint: String,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[allow(dead_code)]
impl FaultProxy {
    /// Starts the proxy on a free port, forwarding to `upstream`.
    pub fn start(upstream: &str, rate: f64, seed: u64) -> FaultProxy {
        Self::start_with(upstream, rate, seed, &[])
    }

    /// [`FaultProxy::start`] with more of `tests/fault_proxy.py`'s options (`--kinds`,
    /// `--only`).
    pub fn start_with(upstream: &str, rate: f64, seed: u64, extra: &[&str]) -> FaultProxy {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fault_proxy.py");
        let child = Command::new("python3")
            .arg(script)
            .args(["--upstream", upstream, "--port", &port.to_string()])
            .args(["--rate", &rate.to_string(), "--seed", &seed.to_string()])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 runs tests/fault_proxy.py");
        let proxy = FaultProxy {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
        };
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return proxy;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!("the fault proxy did not start on port {port}");
    }

    /// The injected faults so far: `{"requests": N, "503": n, "500": n, ...}`.
    pub fn faults(&self) -> serde_json::Value {
        let addr = self.endpoint.trim_start_matches("http://");
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "GET /__faults HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        let body = resp.split("\r\n\r\n").nth(1).unwrap_or("{}");
        serde_json::from_str(body).unwrap()
    }

    /// The `AWS_*` environment of `moto` with the endpoint pointed at this proxy.
    pub fn env(&self, moto: &Moto) -> Vec<(&'static str, String)> {
        let mut env = moto.env();
        for (k, v) in env.iter_mut() {
            if *k == "AWS_ENDPOINT" {
                *v = self.endpoint.clone();
            }
        }
        env
    }
}
