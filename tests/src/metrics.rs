//! What the metrics tests share: raw HTTP to the target's metrics listener, reading samples
//! out of the exposition, `promtool check metrics`, and a real Prometheus server scraping the
//! target (Debian's `prometheus` package provides both tools).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// Sends `request` (as it is: any bytes) to `addr`, then closes its sending side, and returns
/// everything the server answers before it closes (within 15 s). A server that stops reading
/// is not an error: its answer is still read, and the half-close lets it see at once that
/// nothing more comes.
pub fn http(addr: &str, request: &[u8]) -> String {
    exchange(addr, request, true)
}

fn exchange(addr: &str, request: &[u8], half_close: bool) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(15))).unwrap();
    let _ = s.write_all(request);
    if half_close {
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// `GET /metrics`, which must answer 200: the body.
pub fn scrape(addr: &str) -> String {
    let r = http(
        addr,
        b"GET /metrics HTTP/1.1\r\nHost: test\r\nAccept: text/plain\r\n\r\n",
    );
    assert!(
        r.starts_with("HTTP/1.1 200 OK\r\n"),
        "scrape of {addr}: {r}"
    );
    let (_, body) = r.split_once("\r\n\r\n").expect("a head and a body");
    body.to_owned()
}

/// The value of the sample written exactly `series` (name and labels as rendered, e.g.
/// `rpma_target_writes_total{subsystem="s",nsid="1",host="h"}`).
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.parse().expect("a number"))
}

/// `promtool check metrics` on `text`: None when promtool is not installed, else whether it
/// passed and what it said.
pub fn promtool_check(text: &str) -> Option<(bool, String)> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success(), said))
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            b => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus server scraping one target every second, killed on drop.
#[derive(Debug)]
pub struct Prometheus {
    child: Child,
    addr: String,
}

impl Prometheus {
    /// Starts `prometheus` in `dir` scraping `target` (host:port) as job `rpma` every second;
    /// returns once it is ready. None when the binary is not installed.
    pub fn start(dir: &Path, target: &str) -> Option<Prometheus> {
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: rpma\n    static_configs:\n      - targets: [\"{target}\"]\n"
            ),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{}", free_port());
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .ok()?;
        let p = Prometheus { child, addr };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if TcpStream::connect(&p.addr).is_ok()
                && exchange(&p.addr, b"GET /-/ready HTTP/1.0\r\n\r\n", false)
                    .starts_with("HTTP/1.0 200")
            {
                return Some(p);
            }
            assert!(
                Instant::now() < deadline,
                "prometheus not ready within 30 s: {}",
                std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The instant query `expr` through the HTTP API (`/api/v1/query`): the value of each
    /// series of the result, in the order given.
    pub fn query(&self, expr: &str) -> Vec<f64> {
        let req = format!(
            "GET /api/v1/query?query={} HTTP/1.0\r\nHost: test\r\n\r\n",
            encode(expr)
        );
        // Not half-closed: Go's HTTP server takes that for a client gone and cancels the query.
        let r = exchange(&self.addr, req.as_bytes(), false);
        let (_, body) = r.split_once("\r\n\r\n").expect("an HTTP answer");
        let v: serde_json::Value = serde_json::from_str(body).expect("JSON from the query API");
        assert_eq!(v["status"], "success", "{expr}: {v}");
        v["data"]["result"]
            .as_array()
            .expect("a vector result")
            .iter()
            .map(|s| {
                s["value"][1]
                    .as_str()
                    .expect("[time, value]")
                    .parse()
                    .expect("a number")
            })
            .collect()
    }

    /// Polls `expr` until its result is exactly `[want]` (within `within`); panics with the
    /// last result otherwise.
    pub fn wait_for(&self, expr: &str, want: f64, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let got = self.query(expr);
            if got == [want] {
                return;
            }
            assert!(Instant::now() < deadline, "{expr}: {got:?}, want [{want}]");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_found_by_their_exact_series() {
        let text = "# HELP a_total x\na_total{k=\"v\"} 3\na_total{k=\"vv\"} 4\nb 0.5\n";
        assert_eq!(sample(text, "a_total{k=\"v\"}"), Some(3.0));
        assert_eq!(sample(text, "a_total{k=\"vv\"}"), Some(4.0));
        assert_eq!(sample(text, "b"), Some(0.5));
        assert_eq!(sample(text, "a_total"), None);
        assert_eq!(encode("a{b=\"c d\"}[1m]"), "a%7Bb%3D%22c%20d%22%7D%5B1m%5D");
    }
}
