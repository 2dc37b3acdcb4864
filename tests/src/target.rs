//! The real `rpma-target`: [`Daemon`], the process with a NOTIFY_SOCKET of the test's own, and
//! [`Target`], a daemon serving a config written into a test directory. Both are killed
//! (SIGKILL) on drop; every wait has a deadline.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::transport::Transport;
use crate::{built, free_port, run_with_deadline, text};

/// How long a target may take to say READY.
pub const READY_WITHIN: Duration = Duration::from_secs(30);

/// The `rpma-target` binary (built by `cargo build --workspace`).
pub fn target_bin() -> PathBuf {
    built("rpma-target")
}

/// `rpma-target status ARGS`, within 60 s: a deadline against a hang, not a speed check (in
/// the VM lab's emulated guest, on a busy host, a status call once took over 10 s).
pub fn status(args: &[&str]) -> Output {
    run_with_deadline(
        Command::new(target_bin()).arg("status").args(args),
        Duration::from_secs(60),
    )
}

/// `rpma-target check-config CFG`, within a deadline.
pub fn check_config(cfg: &Path) -> Output {
    run_with_deadline(
        Command::new(target_bin()).arg("check-config").arg(cfg),
        Duration::from_secs(30),
    )
}

/// `rpma-target status --socket SOCKET --json`, which must succeed, parsed.
pub fn status_json(socket: &Path) -> serde_json::Value {
    let out = status(&["--socket", socket.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "status: {}", text(&out));
    serde_json::from_slice(&out.stdout).expect("status --json")
}

/// A running `rpma-target --config CONFIG` that tells `DIR/notify.sock` what it does.
/// Killed (SIGKILL) on drop. The descriptors it stores with its service manager
/// (`FDSTORE=1`) are kept in its [`FdStore`], not returned as notifications.
#[derive(Debug)]
pub struct Daemon {
    child: Child,
    notify: UnixDatagram,
    store: FdStore,
}

/// A service manager's file descriptor store, as systemd keeps one across restarts of a
/// service: what a daemon stored (`FDSTORE=1`, `FDNAME=`; `FDSTOREREMOVE=1` takes a name's
/// out), passed to the next daemon started with it (`$LISTEN_FDS` from fd 3, `$LISTEN_PID`,
/// `$LISTEN_FDNAMES`).
#[derive(Debug, Clone, Default)]
pub struct FdStore(std::sync::Arc<std::sync::Mutex<Vec<(String, std::os::fd::OwnedFd)>>>);

impl FdStore {
    /// Closes what it holds.
    pub fn clear(&self) {
        self.0.lock().unwrap().clear();
    }

    /// The names stored, in order.
    pub fn names(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Takes in a notification: whether it was one for the store (kept, not a message).
    fn take(&self, msg: &str, fds: Vec<std::os::fd::OwnedFd>) -> bool {
        let name = msg
            .lines()
            .find_map(|l| l.strip_prefix("FDNAME="))
            .unwrap_or("stored")
            .to_owned();
        let mut held = self.0.lock().unwrap();
        if msg.lines().any(|l| l == "FDSTORE=1") {
            held.extend(fds.into_iter().map(|fd| (name.clone(), fd)));
            true
        } else if msg.lines().any(|l| l == "FDSTOREREMOVE=1") {
            held.retain(|(n, _)| *n != name);
            true
        } else {
            false
        }
    }

    /// Passes the stored descriptors to `cmd` (whose program is then run through `sh`, for
    /// `$LISTEN_PID` to name the daemon's process).
    fn pass_to(&self, cmd: Command) -> Command {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let held = self.0.lock().unwrap();
        if held.is_empty() {
            return cmd;
        }
        let raw: Vec<i32> = held.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
        let names: Vec<&str> = held.iter().map(|(n, _)| n.as_str()).collect();
        let mut sh = Command::new("sh");
        sh.arg("-c")
            .arg("LISTEN_PID=$$ exec \"$0\" \"$@\"")
            .arg(cmd.get_program())
            .args(cmd.get_args());
        for (k, v) in cmd.get_envs() {
            match v {
                Some(v) => sh.env(k, v),
                None => sh.env_remove(k),
            };
        }
        sh.env("LISTEN_FDS", raw.len().to_string())
            .env("LISTEN_FDNAMES", names.join(":"));
        // SAFETY: only dup/fcntl calls (async-signal-safe) on the child's own descriptors.
        unsafe {
            sh.pre_exec(move || {
                // Out of the way first: a descriptor may sit where another is to go.
                let mut high = Vec::with_capacity(raw.len());
                for &fd in &raw {
                    let h = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 1000);
                    if h < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    high.push(h);
                }
                for (i, &h) in high.iter().enumerate() {
                    // dup2 leaves the new descriptor without close-on-exec.
                    if libc::dup2(h, 3 + i as i32) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        sh
    }
}

/// In a daemon's `env`: start it without CAP_IPC_LOCK (dropped from the bounding set before
/// the exec, so a root daemon's pins count against its RLIMIT_MEMLOCK as an unprivileged
/// one's do).
pub const WITHOUT_IPC_LOCK: (&str, &str) = ("RPMA_TEST_WITHOUT_CAP_IPC_LOCK", "1");

/// Linux's CAP_IPC_LOCK (linux/capability.h).
pub const CAP_IPC_LOCK: u32 = 14;

impl Daemon {
    /// Starts the daemon on `config` with NOTIFY_SOCKET at `dir/notify.sock`, no watchdog
    /// unless `env` (added to its environment) asks for one, and its stderr to `stderr`.
    pub fn start(config: &Path, dir: &Path, env: &[(&str, &str)], stderr: Stdio) -> Daemon {
        Daemon::start_with(config, dir, env, stderr, FdStore::default())
    }

    /// As [`Daemon::start`], passing what `store` holds and keeping what the daemon stores
    /// there (a restart under systemd).
    pub fn start_with(
        config: &Path,
        dir: &Path,
        env: &[(&str, &str)],
        stderr: Stdio,
        store: FdStore,
    ) -> Daemon {
        let sock = dir.join("notify.sock");
        let _ = std::fs::remove_file(&sock);
        let notify = UnixDatagram::bind(&sock).expect("bind notify socket");
        let mut cmd = Command::new(target_bin());
        cmd.arg("--config")
            .arg(config)
            .env("NOTIFY_SOCKET", &sock)
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID");
        for (k, v) in env {
            cmd.env(k, v);
        }
        // Program, arguments and environment only: what the store's wrapping carries over.
        let mut cmd = store.pass_to(cmd);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        if env.contains(&WITHOUT_IPC_LOCK) {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe and touches only the child's own state.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(
                        libc::PR_CAPBSET_DROP,
                        CAP_IPC_LOCK as libc::c_ulong,
                        0,
                        0,
                        0,
                    ) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        Daemon {
            child: cmd.spawn().expect("spawn rpma-target"),
            notify,
            store,
        }
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next notification, or None after `within`. Descriptors stored with it go to its
    /// [`FdStore`].
    pub fn next(&self, within: Duration) -> Option<String> {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            self.notify
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .unwrap();
            let mut buf = [0u8; 4096];
            let mut iov = [std::io::IoSliceMut::new(&mut buf)];
            let mut space = nix::cmsg_space!([std::os::fd::RawFd; 16]);
            let (n, fds) = match recvmsg::<()>(
                self.notify.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(m) => {
                    let fds: Vec<OwnedFd> = m
                        .cmsgs()
                        .into_iter()
                        .flatten()
                        .filter_map(|c| match c {
                            ControlMessageOwned::ScmRights(f) => Some(f),
                            _ => None,
                        })
                        .flatten()
                        // SAFETY: received with this message: this process owns them now.
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
                        .collect();
                    (m.bytes, fds)
                }
                Err(_) => return None,
            };
            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
            if !self.store.take(&msg, fds) {
                return Some(msg);
            }
        }
    }

    /// What it stored with its service manager (and what it was given).
    pub fn store(&self) -> &FdStore {
        &self.store
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

    /// Whether it has exited (reaped if so).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
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

/// A running `rpma-target` on a config written into `dir` (`target.toml`: a listener on an
/// ephemeral port, the control socket `ctl.sock`, then the test's own text), logging at info
/// to `dir/target.log`. Killed (SIGKILL) on drop; its log is printed if the test panics.
#[derive(Debug)]
pub struct Target {
    dir: PathBuf,
    /// The listener's scheme and host (`tcp://127.0.0.1`, `rdma://192.0.2.1`).
    listen: String,
    /// Its `listen = [...]` line.
    listen_line: String,
    port: u16,
    env: Vec<(String, String)>,
    daemon: Option<Daemon>,
    ready: String,
    /// Its service manager's descriptor store, kept across [`restart`](Self::restart)s.
    store: FdStore,
}

impl Target {
    /// Writes `dir/target.toml` (a listener of the test's [`Transport`] on an ephemeral port, a
    /// control socket, then
    /// `config`: top-level settings and the `[[subsystem]]` tables, e.g. a
    /// [`Config`](crate::Config)'s text) and starts the target; returns once it said READY=1.
    pub fn start(dir: &Path, config: &str) -> Target {
        Target::start_with_env(dir, config, &[])
    }

    /// As [`Target::start`], with extra environment variables for the daemon.
    pub fn start_with_env(dir: &Path, config: &str, env: &[(&str, &str)]) -> Target {
        let t = Transport::current();
        let port = free_port();
        Target::launch(dir, t.listen(), port, t.listen_line(port), config, env)
    }

    /// As [`Target::start_with_env`], listening on `listen` (a scheme and host:
    /// `tcp://127.0.0.1`, `rdma://192.0.2.1`, whatever the test's transport) and an ephemeral
    /// port, with no `direct_write_to_pmem` declaration.
    pub fn start_on(dir: &Path, listen: &str, config: &str, env: &[(&str, &str)]) -> Target {
        let port = free_port();
        let line = format!("listen = [\"{listen}:{port}\"]");
        Target::launch(dir, listen.to_owned(), port, line, config, env)
    }

    fn launch(
        dir: &Path,
        listen: String,
        port: u16,
        listen_line: String,
        config: &str,
        env: &[(&str, &str)],
    ) -> Target {
        write_config(dir, &listen_line, config);
        let mut t = Target {
            dir: dir.to_owned(),
            listen,
            listen_line,
            port,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            daemon: None,
            ready: String::new(),
            store: FdStore::default(),
        };
        t.spawn();
        t
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("target.log"))
            .expect("open target.log");
        // RPMA_TEST_TARGET_LOG: the targets' RUST_LOG when a failure needs more than `info`.
        let level = std::env::var("RPMA_TEST_TARGET_LOG").unwrap_or_else(|_| "info".to_owned());
        let mut env = vec![("RUST_LOG", level.as_str())];
        env.extend(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        self.daemon = Some(Daemon::start_with(
            &self.dir.join("target.toml"),
            &self.dir,
            &env,
            Stdio::from(log),
            self.store.clone(),
        ));
        self.wait_ready();
    }

    fn daemon(&self) -> &Daemon {
        self.daemon.as_ref().expect("the target is running")
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                panic!("rpma-target: no READY=1 within {READY_WITHIN:?}");
            }
            let d = self.daemon.as_mut().expect("the target is running");
            if let Some(st) = d.exited() {
                panic!("rpma-target exited ({st}) before READY");
            }
            if let Some(m) = d.next(left.min(Duration::from_millis(200))) {
                if m.starts_with("READY=1") {
                    self.ready = m;
                    return;
                }
            }
        }
    }

    /// The last READY=1 notification (with its STATUS= line).
    pub fn ready(&self) -> &str {
        &self.ready
    }

    /// `tcp://127.0.0.1:PORT`, `rdma://ADDR:PORT` (the test's transport, or the listener
    /// [`Target::start_on`] was given).
    pub fn url(&self) -> String {
        format!("{}:{}", self.listen, self.port)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory of its config, namespaces and log.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.daemon().pid()
    }

    /// What the target logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("target.log")).unwrap_or_default()
    }

    /// The log lines that contain every one of `parts`, waiting up to `within` for at least one.
    pub fn log_lines(&self, parts: &[&str], within: Duration) -> Vec<String> {
        let deadline = Instant::now() + within;
        loop {
            let lines: Vec<String> = self
                .log()
                .lines()
                .filter(|l| parts.iter().all(|p| l.contains(p)))
                .map(str::to_owned)
                .collect();
            if !lines.is_empty() || Instant::now() >= deadline {
                return lines;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The next notification, or None after `within`.
    pub fn next(&self, within: Duration) -> Option<String> {
        self.daemon().next(within)
    }

    /// Rewrites `target.toml` with the same listener and control socket and `config` after
    /// them (for a reload).
    pub fn rewrite(&self, config: &str) {
        write_config(&self.dir, &self.listen_line, config);
    }

    /// The next notification starting with `prefix`, skipping others, within `within`.
    pub fn expect(&self, prefix: &str, within: Duration) -> String {
        self.daemon().wait_for(prefix, within)
    }

    /// Sends `sig` to the daemon.
    pub fn signal(&self, sig: Signal) {
        self.daemon().signal(sig);
    }

    /// Stops the daemon (SIGSTOP) and returns once it is stopped (state `T` in
    /// /proc/PID/stat): a signal is delivered later than `kill` returns, and until then the
    /// daemon may still answer what reaches it. [`Target::signal`] with SIGCONT resumes it.
    pub fn stop(&self) {
        self.signal(Signal::SIGSTOP);
        let stat = format!("/proc/{}/stat", self.pid());
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            let s = std::fs::read_to_string(&stat).expect("the target's /proc stat");
            // The state follows the command name, which is in parentheses.
            if s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('T'))
            {
                return;
            }
            assert!(Instant::now() < deadline, "rpma-target did not stop: {s}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Its exit status; kills it and panics if it is still running after `within`.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        self.daemon
            .as_mut()
            .expect("the target is running")
            .wait_exit(within)
    }

    /// SIGKILL, and wait for the process to be gone: no goodbye, no flush.
    pub fn kill9(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            d.kill();
        }
    }

    /// SIGHUP (reload the config), then waits for the READY=1 that ends the reload.
    pub fn reload(&mut self) {
        self.signal(Signal::SIGHUP);
        self.wait_ready();
    }

    /// `rpma-target status --json` through its control socket, parsed.
    pub fn status(&self) -> serde_json::Value {
        status_json(&self.dir.join("ctl.sock"))
    }

    /// Namespace `nsid` of its first subsystem in [`status`](Self::status)'s JSON (`failed`,
    /// `failed_since`, counts).
    pub fn namespace_status(&self, nsid: u64) -> serde_json::Value {
        let v = self.status();
        v["subsystems"][0]["namespaces"]
            .as_array()
            .expect("status lists the first subsystem's namespaces")
            .iter()
            .find(|n| n["nsid"] == nsid)
            .cloned()
            .unwrap_or_else(|| panic!("no namespace {nsid} in {v}"))
    }

    /// `rpma-target clear-failure SUBSYSTEM NSID` through its control socket: the exit code
    /// and what it printed.
    pub fn clear_failure(&self, subsystem: &str, nsid: u32) -> (Option<i32>, String) {
        let sock = self.dir.join("ctl.sock");
        let o = run_with_deadline(
            Command::new(crate::target_bin())
                .args(["clear-failure", "--socket"])
                .arg(&sock)
                .arg(subsystem)
                .arg(nsid.to_string()),
            Duration::from_secs(30),
        );
        (o.status.code(), text(&o))
    }

    /// The GPSPM syncs the target counted so far: (the flush service's fdatasyncs, the poll
    /// loops' own msyncs), from `status --json`.
    pub fn gpspm_syncs(&self) -> (u64, u64) {
        let v = self.status();
        let count = |kind: &str| -> u64 {
            let l = v["metrics"]["latency"]
                .as_array()
                .and_then(|a| a.iter().find(|l| l["kind"] == kind && l["path"] == "gpspm"))
                .unwrap_or_else(|| panic!("no {kind} gpspm latency: {v:#}"));
            l["histogram"]["counts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c.as_u64().unwrap())
                .sum()
        };
        (count("fdatasync"), count("msync"))
    }

    /// Starts the target again on the same config and port (after [`kill9`](Self::kill9)),
    /// with the descriptors it stored with its service manager, as systemd restarts it.
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// Starts it again after [`kill9`](Self::kill9) (a restart done in two steps, for what
    /// happens while it is down).
    pub fn start_again(&mut self) {
        assert!(self.daemon.is_none(), "the target is running");
        self.spawn();
    }

    /// Its service manager's descriptor store.
    pub fn fd_store(&self) -> &FdStore {
        &self.store
    }

    /// [`kill9`](Self::kill9), and its service manager's descriptor store released, as
    /// `systemctl stop` releases it: the files it held may be unmounted.
    pub fn stop_service(&mut self) {
        self.kill9();
        self.store.clear();
    }
}

/// Writes `dir/target.toml`: the `listen_line`, the control socket `ctl.sock`, `config`.
fn write_config(dir: &Path, listen_line: &str, config: &str) {
    std::fs::write(
        dir.join("target.toml"),
        format!("{listen_line}\ncontrol_socket = \"ctl.sock\"\n{config}"),
    )
    .expect("write target.toml");
}

impl Drop for Target {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!("--- rpma-target's log ---\n{}", self.log());
        }
    }
}
