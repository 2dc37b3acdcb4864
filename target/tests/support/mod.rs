//! What the daemon's integration tests share: the binary, ports, key files, the status command,
//! and the daemon as a child process with a NOTIFY_SOCKET of the test's own (killed on drop).
//! Every wait has a deadline.

// Each test file uses its own part of this module.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// The `rpma-target` binary cargo built for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_rpma-target");

/// A port that was free a moment ago: tests run in parallel, so none may use the default port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Writes a pre-shared key file at `path`: the hex byte `byte` 32 times, mode 0600.
pub fn write_psk(path: &Path, byte: &str) {
    std::fs::write(path, byte.repeat(32)).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// `rpma-target status ARGS`.
pub fn status(args: &[&str]) -> Output {
    Command::new(BIN).arg("status").args(args).output().unwrap()
}

/// `rpma-target status --socket SOCKET --json`, which must succeed, parsed.
pub fn status_json(socket: &Path) -> serde_json::Value {
    let out = status(&["--socket", socket.to_str().unwrap(), "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A running `rpma-target --config CONFIG` that tells `DIR/notify.sock` what it does.
/// Killed (SIGKILL) on drop.
#[derive(Debug)]
pub struct Daemon {
    child: Child,
    notify: UnixDatagram,
}

impl Daemon {
    /// Starts the daemon on `config` with NOTIFY_SOCKET at `dir/notify.sock`, no watchdog
    /// unless `env` (added to its environment) asks for one, and its stderr to `stderr`.
    pub fn start(config: &Path, dir: &Path, env: &[(&str, &str)], stderr: Stdio) -> Daemon {
        let sock = dir.join("notify.sock");
        let notify = UnixDatagram::bind(&sock).unwrap();
        let mut cmd = Command::new(BIN);
        cmd.arg("--config")
            .arg(config)
            .env("NOTIFY_SOCKET", &sock)
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Daemon {
            child: cmd.spawn().unwrap(),
            notify,
        }
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next notification, or None after `within`.
    pub fn next(&self, within: Duration) -> Option<String> {
        self.notify
            .set_read_timeout(Some(within.max(Duration::from_millis(1))))
            .unwrap();
        let mut buf = [0u8; 4096];
        match self.notify.recv(&mut buf) {
            Ok(n) => Some(String::from_utf8_lossy(&buf[..n]).into_owned()),
            Err(_) => None,
        }
    }

    /// The next notification but watchdog pings, which must start with `prefix`; panics if
    /// nothing else comes within 30 s.
    pub fn expect(&self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(m) = self.next(Duration::from_secs(30)) {
                if m == "WATCHDOG=1" {
                    continue;
                }
                assert!(m.starts_with(prefix), "expected {prefix:?}, got {m:?}");
                return m;
            }
        }
        panic!("no {prefix:?} notification");
    }

    /// The next notification starting with `prefix`, skipping any others, within `within`.
    pub fn wait_for(&self, prefix: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(m) = self.next(deadline.saturating_duration_since(Instant::now())) {
                if m.starts_with(prefix) {
                    return m;
                }
            }
        }
        panic!("no {prefix:?} notification within {within:?}");
    }

    /// Sends `sig` to the daemon.
    pub fn signal(&self, sig: Signal) {
        kill(Pid::from_raw(self.pid() as i32), sig).unwrap();
    }

    /// SIGKILL, and wait for the process to be gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Its exit status; kills it and panics if it is still running after `within`.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("daemon did not exit within {within:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}
