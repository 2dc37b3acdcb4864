//! Helpers shared by rpma's end-to-end tests: locating the built binaries, a real `rpma-target`
//! started from a config of the test's own (READY on the test's NOTIFY_SOCKET, killed on drop),
//! running `rpma-initiator`, and a TCP relay that can cut its links.
//!
//! Every wait has a deadline; ports are ephemeral; everything listens on 127.0.0.1 only.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a target may take to say READY.
pub const READY_WITHIN: Duration = Duration::from_secs(30);

/// The directory cargo puts this workspace's binaries in (`target/debug` or `target/release`).
pub fn bin_dir() -> PathBuf {
    let mut exe = std::env::current_exe().expect("current_exe");
    exe.pop(); // the test binary's name
    if exe.ends_with("deps") {
        exe.pop();
    }
    exe
}

/// Path of a workspace binary, e.g. `bin("rpma-target")`.
pub fn bin(name: &str) -> PathBuf {
    bin_dir().join(name)
}

/// Path of a workspace binary that must exist (built by `cargo build --workspace`).
pub fn built(name: &str) -> PathBuf {
    let p = bin(name);
    assert!(
        p.exists(),
        "{} is not built: run `cargo build --workspace` first (make test does)",
        p.display()
    );
    p
}

/// An unused TCP port on 127.0.0.1 (bound, then released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind 127.0.0.1:0")
        .local_addr()
        .expect("local_addr")
        .port()
}

/// Writes a pre-shared key file at `path`: the hex byte `byte` 32 times, mode 0600 (the target
/// refuses a key that others can read).
pub fn write_psk(path: &Path, byte: &str) {
    std::fs::write(path, byte.repeat(32)).expect("write psk file");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod psk file");
}

/// A namespace file under /dev/shm (tmpfs: the volatile domain), `/dev/shm/rpma-test-PID-TAG`,
/// removed on drop. The tag keeps the tests of one binary apart.
#[derive(Debug)]
pub struct Shm(String);

impl Shm {
    /// The path for `tag` (nothing is created: the target makes the file).
    pub fn new(tag: &str) -> Shm {
        Shm(format!("/dev/shm/rpma-test-{}-{tag}", std::process::id()))
    }

    /// The file's path.
    pub fn path(&self) -> &str {
        &self.0
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The `[[subsystem.namespace]]` tables of the four-namespace subsystem the initiator tests use:
/// nsid 1 page-cache 8 MiB (`ns1`); 2 read-only 1 MiB of `ns2_block_size` blocks (`ns2`);
/// 3 volatile 1 MiB on `shm`; 4 dax (forced) 2 MiB on a file (`ns4`).
pub fn four_namespaces(shm: &Shm, ns2_block_size: u32) -> String {
    format!(
        r#"[[subsystem.namespace]]
nsid = 1
path = "ns1"
size = "8MiB"
[[subsystem.namespace]]
nsid = 2
path = "ns2"
size = "1MiB"
block_size = {ns2_block_size}
read_only = true
[[subsystem.namespace]]
nsid = 3
path = "{}"
size = "1MiB"
[[subsystem.namespace]]
nsid = 4
path = "ns4"
size = "2MiB"
force_dax = true
"#,
        shm.path()
    )
}

/// A running `rpma-target` on a config written into `dir`. Killed (SIGKILL) on drop.
#[derive(Debug)]
pub struct Target {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
    notify: UnixDatagram,
}

impl Target {
    /// Writes `dir/target.toml` (a listener on an ephemeral port, a control socket, then
    /// `subsystems`: the `[[subsystem]]` tables) and starts the target; returns once it said
    /// READY=1.
    pub fn start(dir: &Path, subsystems: &str) -> Target {
        let port = free_port();
        std::fs::write(
            dir.join("target.toml"),
            format!(
                "listen = [\"tcp://127.0.0.1:{port}\"]\ncontrol_socket = \"ctl.sock\"\n{subsystems}"
            ),
        )
        .expect("write target.toml");
        let sock = dir.join("notify.sock");
        let _ = std::fs::remove_file(&sock);
        let notify = UnixDatagram::bind(&sock).expect("bind notify socket");
        let mut t = Target {
            dir: dir.to_owned(),
            port,
            child: None,
            notify,
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
        let child = Command::new(built("rpma-target"))
            .arg("--config")
            .arg(self.dir.join("target.toml"))
            .env("NOTIFY_SOCKET", self.dir.join("notify.sock"))
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn rpma-target");
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + READY_WITHIN;
        let mut buf = [0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                panic!(
                    "rpma-target: no READY=1 within {READY_WITHIN:?}; log:\n{}",
                    self.log()
                );
            }
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    panic!(
                        "rpma-target exited ({st}) before READY; log:\n{}",
                        self.log()
                    );
                }
            }
            self.notify
                .set_read_timeout(Some(left.min(Duration::from_millis(200))))
                .expect("set_read_timeout");
            if let Ok(n) = self.notify.recv(&mut buf) {
                if buf[..n].starts_with(b"READY=1") {
                    return;
                }
            }
        }
    }

    /// `tcp://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory of its config, namespaces and log.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What the target logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("target.log")).unwrap_or_default()
    }

    /// SIGKILL, and wait for the process to be gone: no goodbye, no flush.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGHUP (reload the config), then waits for the READY=1 that ends the reload.
    pub fn reload(&mut self) {
        let pid = self.child.as_ref().expect("running").id();
        // SAFETY: kill has no memory-safety preconditions; the pid is our live child's.
        let rc = unsafe { libc::kill(pid as libc::pid_t, libc::SIGHUP) };
        assert_eq!(rc, 0, "SIGHUP: {}", std::io::Error::last_os_error());
        self.wait_ready();
    }

    /// `rpma-target status --json` through its control socket.
    pub fn status_json(&self) -> String {
        let o = run_with_deadline(
            Command::new(built("rpma-target"))
                .arg("status")
                .arg("--socket")
                .arg(self.dir.join("ctl.sock"))
                .arg("--json"),
            Duration::from_secs(10),
        );
        assert!(o.status.success(), "status: {}", text(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// Starts the target again on the same config and port (after [`kill9`](Self::kill9)).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.kill9();
    }
}

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

/// A TCP relay on 127.0.0.1: every connection to it is forwarded to `upstream`. [`cut`]
/// drops every live link at once (both sides see a reset or close); new connections are
/// relayed as before. Stops on drop.
///
/// [`cut`]: Relay::cut
#[derive(Debug)]
pub struct Relay {
    port: u16,
    stop: Arc<AtomicBool>,
    links: Arc<Mutex<Vec<TcpStream>>>,
    bytes: Arc<AtomicU64>,
    accepted: Arc<AtomicU64>,
    swallow: Arc<AtomicBool>,
}

impl Relay {
    /// Starts relaying to `upstream` (host:port).
    pub fn start(upstream: &str) -> Relay {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind relay");
        l.set_nonblocking(true).expect("nonblocking");
        let port = l.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let links: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let bytes = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let swallow = Arc::new(AtomicBool::new(false));
        let upstream = upstream.to_owned();
        let (s, lk, b, a, sw) = (
            Arc::clone(&stop),
            Arc::clone(&links),
            Arc::clone(&bytes),
            Arc::clone(&accepted),
            Arc::clone(&swallow),
        );
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((down, _)) => {
                        let Ok(up) = TcpStream::connect(&upstream) else {
                            continue;
                        };
                        a.fetch_add(1, Ordering::Relaxed);
                        let _ = down.set_nonblocking(false);
                        let _ = down.set_nodelay(true);
                        let _ = up.set_nodelay(true);
                        {
                            let mut v = lk.lock().unwrap();
                            v.push(down.try_clone().unwrap());
                            v.push(up.try_clone().unwrap());
                        }
                        pipe(
                            down.try_clone().unwrap(),
                            up.try_clone().unwrap(),
                            &b,
                            Some(&sw),
                        );
                        pipe(up, down, &b, None);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Relay {
            port,
            stop,
            links,
            bytes,
            accepted,
            swallow,
        }
    }

    /// `tcp://127.0.0.1:PORT` of the relay.
    pub fn url(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    /// Bytes relayed so far (both directions).
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Drops every live link (and ends [`swallow`](Self::swallow)).
    pub fn cut(&self) {
        for s in self.links.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        self.swallow.store(false, Ordering::SeqCst);
    }

    /// From now until the next [`cut`](Self::cut), bytes from the client are read and thrown
    /// away instead of forwarded: what the client sent meanwhile never reaches the server
    /// (a link that dies with data in flight).
    pub fn swallow(&self) {
        self.swallow.store(true, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.cut();
    }
}

fn pipe(
    mut from: TcpStream,
    mut to: TcpStream,
    bytes: &Arc<AtomicU64>,
    swallow: Option<&Arc<AtomicBool>>,
) {
    let bytes = Arc::clone(bytes);
    let swallow = swallow.map(Arc::clone);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) if swallow.as_ref().is_some_and(|s| s.load(Ordering::SeqCst)) => {}
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    bytes.fetch_add(n as u64, Ordering::Relaxed);
                }
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}

/// Pages of `[offset, offset + len)` of the file at `path` that are dirty or under write-back in
/// the page cache (cachestat(2), Linux 6.5+): what a power loss would take. None when the
/// kernel has no cachestat (the caller skips, saying why).
pub fn unsynced_pages(path: &Path, offset: u64, len: u64) -> Option<u64> {
    /// struct cachestat_range
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    /// struct cachestat
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    const SYS_CACHESTAT: libc::c_long = 451;
    let f = std::fs::File::open(path).expect("open the file to inspect");
    let range = Range { off: offset, len };
    let mut st = Stat::default();
    // SAFETY: cachestat reads `range` and writes one struct cachestat into `st`, both live locals
    // of the layouts the kernel's uapi defines; the descriptor is open for the call.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            &range as *const Range,
            &mut st as *mut Stat,
            0u32,
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSYS), "cachestat: {e}");
        return None;
    }
    Some(st.nr_dirty + st.nr_writeback)
}
