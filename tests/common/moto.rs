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
