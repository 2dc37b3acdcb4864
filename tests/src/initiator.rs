//! Running `rpma-initiator` (and any command) with a deadline.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::built;

/// Runs `rpma-initiator` with `args` (no RUST_LOG, stdin closed) within `timeout`.
pub fn initiator(args: &[&str]) -> Output {
    run_with_deadline(
        Command::new(built("rpma-initiator"))
            .args(args)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null()),
        Duration::from_secs(60),
    )
}

/// The initiator's connection arguments: `--target URL --nqn SUB --hostnqn HOST`, then
/// `--nsid N` when given.
pub fn conn_args(url: &str, sub: &str, host: &str, nsid: Option<u32>) -> Vec<String> {
    let mut a: Vec<String> = ["--target", url, "--nqn", sub, "--hostnqn", host]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if let Some(n) = nsid {
        a.extend(["--nsid".to_owned(), n.to_string()]);
    }
    a
}

/// `rpma-initiator` with the connection arguments `conn` ([`conn_args`]), then `args`; panics
/// with its output unless it succeeds.
pub fn cli_with(conn: &[String], args: &[&str]) -> Output {
    let mut a: Vec<&str> = conn.iter().map(String::as_str).collect();
    a.extend_from_slice(args);
    let o = initiator(&a);
    assert!(o.status.success(), "{a:?}: {}", text(&o));
    o
}

/// The bytes `[offset, offset + len)` of the namespace `conn` names, read by
/// `rpma-initiator read` through a file in `scratch`.
pub fn cli_read_with(conn: &[String], scratch: &Path, offset: u64, len: u64) -> Vec<u8> {
    let out = scratch.join(format!("read-{offset}-{len}"));
    let (o, l) = (offset.to_string(), len.to_string());
    let args = ["read", "--offset", &o, "--length", &l, "--out"];
    cli_with(conn, &[&args[..], &[out.to_str().unwrap()]].concat());
    let b = std::fs::read(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    b
}

/// Writes `data` at `offset` of the namespace `conn` names with `rpma-initiator write
/// --durable`, through a file in `scratch`.
pub fn cli_write_with(conn: &[String], scratch: &Path, offset: u64, data: &[u8]) {
    let f = scratch.join(format!("write-{offset}"));
    std::fs::write(&f, data).unwrap();
    let o = offset.to_string();
    let args = ["write", "--offset", &o, "--durable", "--in"];
    cli_with(conn, &[&args[..], &[f.to_str().unwrap()]].concat());
    let _ = std::fs::remove_file(&f);
}

/// Runs a system tool to its end (no deadline: for quick tools like mount, losetup, mkfs);
/// its trimmed stdout, or Err with its stderr if it is missing or fails.
pub fn run_tool(tool: &str, args: &[&str]) -> Result<String, String> {
    let o = Command::new(tool)
        .args(args)
        .output()
        .map_err(|e| format!("{tool}: {e}"))?;
    if !o.status.success() {
        return Err(format!(
            "{tool} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

/// Runs a command, killing it if it outlives `timeout` (the test then fails on its output).
pub fn run_with_deadline(cmd: &mut Command, timeout: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let o = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let e = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("{cmd:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: o.join().unwrap_or_default(),
        stderr: e.join().unwrap_or_default(),
    }
}

/// stdout and stderr of `o`, for assertion messages.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
