//! Capturing a loopback session with tshark and reading it back with the iWARP dissectors.
//!
//! Needs tshark and permission to capture on `lo` (root, or dumpcap capabilities). Without them
//! `start_capture` FAILS the test, saying why, unless the environment sets `RPMA_SKIP_TSHARK=1`:
//! then it prints why and the caller skips its check. `make test` installs tshark and runs as
//! root, so a silent skip there would hide a broken wire check.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// The environment variable that allows skipping the wire checks when tshark cannot capture.
pub const SKIP_VAR: &str = "RPMA_SKIP_TSHARK";

/// Whether the environment allows skipping (`RPMA_SKIP_TSHARK=1`).
fn skip_allowed() -> bool {
    std::env::var(SKIP_VAR).is_ok_and(|v| v == "1")
}

/// tshark cannot capture: panics (failing the test) unless skipping is allowed, in which case
/// it says why and returns None.
fn cannot_capture(test: &str, why: &str) -> Option<Child> {
    assert!(
        skip_allowed(),
        "{test}: {why}; install tshark (scripts/install-deps.sh) and run as root, \
         or set {SKIP_VAR}=1 to skip the wire check"
    );
    eprintln!("SKIP {test}: {why} ({SKIP_VAR}=1 is set, so the wire check is skipped)");
    None
}

/// Starts `tshark -i lo` on `port`, writing to `pcap`. If it cannot capture it fails the test,
/// or, with `RPMA_SKIP_TSHARK=1`, returns None after printing why.
pub fn start_capture(port: u16, pcap: &Path, test: &str) -> Option<Child> {
    let mut child = match Command::new("tshark")
        .args(["-i", "lo", "-f", &format!("tcp port {port}"), "-w"])
        .arg(pcap)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => return cannot_capture(test, &format!("cannot run tshark ({e})")),
    };
    // tshark says "Capturing on 'Loopback: lo'" once the capture runs.
    let stderr = child.stderr.take().expect("piped");
    let mut lines = BufReader::new(stderr).lines();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match lines.next() {
            Some(Ok(l)) if l.contains("Capturing on") => break,
            Some(Ok(_)) if Instant::now() < deadline => continue,
            other => {
                let _ = child.kill();
                let _ = child.wait();
                return cannot_capture(
                    test,
                    &format!("tshark could not capture on lo ({other:?})"),
                );
            }
        }
    }
    // Keep draining stderr so tshark never blocks on it.
    thread::spawn(move || for _ in lines {});
    // "Capturing on" comes slightly before dumpcap's capture really runs.
    thread::sleep(Duration::from_millis(1500));
    Some(child)
}

pub fn stop_capture(mut child: Child) {
    // Let the last segments reach the capture, then stop tshark cleanly (SIGINT flushes).
    thread::sleep(Duration::from_millis(500));
    // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped).
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(rc, 0, "kill tshark");
    let status = child.wait().expect("wait for tshark");
    assert!(
        status.success() || status.code().is_none(),
        "tshark exited with {status}"
    );
}

/// Runs `tshark -r pcap` with the iWARP heuristics on and `extra` arguments; its stdout.
pub fn tshark_fields(pcap: &Path, extra: &[&str]) -> String {
    let out = Command::new("tshark")
        .arg("-r")
        .arg(pcap)
        .args([
            "--enable-heuristic",
            "iwarp_mpa_tcp",
            "--disable-heuristic",
            "rpcrdma_iwarp",
            "-o",
            "tcp.try_heuristic_first:TRUE",
        ])
        .args(extra)
        .output()
        .expect("run tshark -r");
    assert!(
        out.status.success(),
        "tshark -r failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}
