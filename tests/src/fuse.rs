//! What the FUSE mount tests (tests/tests/fuse_mount.rs) share: why a machine cannot run them,
//! a target serving [`SUB`], a running `rpma-initiator mount` ([`Mounted`]) with a watchdog, a
//! filesystem mounted from its loop device ([`FsMount`]), and cleanup guards for both.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::{built, four_namespaces, run_with_deadline, text, Config, Shm, Subsystem, Target};

pub const SUB: &str = "nqn.2026-11.io.rpma:fuse";
pub const HOST: &str = "nqn.2026-11.io.rpma:fuse-host";
/// How long a mount may take to print its paths.
pub const WITHIN: Duration = Duration::from_secs(20);
/// How long a mount may take to exit once stopped: its last persist and disconnect. Longer
/// than [`WITHIN`]: in the VM lab (rxe under TCG) a mount stopped after mkfs and a 1 MiB file
/// took over 20 s to end its session, and only a hang should fail a test here.
pub const EXIT_WITHIN: Duration = Duration::from_secs(60);
/// A mount process still running after this is SIGKILLed, so that a hung server fails the
/// test (its file then answers ENOTCONN) instead of blocking it.
pub const WATCHDOG: Duration = Duration::from_secs(90);

/// Why this machine cannot run these tests, if it cannot.
pub fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (mount(2), loop devices)".into());
    }
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
    {
        return Some(format!("/dev/fuse: {e}"));
    }
    if !Path::new("/dev/loop-control").exists() {
        return Some("no /dev/loop-control (loop module)".into());
    }
    for tool in ["mkfs.ext4", "e2fsck", "mount", "umount", "losetup"] {
        let found = Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Some(format!("{tool} is not installed (e2fsprogs, util-linux)"));
        }
    }
    None
}

pub fn target(dir: &Path, shm: &Shm) -> Target {
    Target::start(
        dir,
        &Config::new()
            .subsystem(
                Subsystem::new(SUB)
                    .host(HOST)
                    .namespaces(four_namespaces(shm, 4096)),
            )
            .to_string(),
    )
}

pub fn conn_args(url: &str, nsid: u32) -> Vec<String> {
    crate::conn_args(url, SUB, HOST, Some(nsid))
}

/// The mount points of this mount namespace.
pub fn mounted(dir: &Path) -> bool {
    let m = std::fs::read_to_string("/proc/mounts").unwrap();
    let d = dir.to_string_lossy();
    m.lines().any(|l| l.split(' ').nth(1) == Some(&*d))
}

/// Loop devices whose backing file is in `dir`.
pub fn loops_under(dir: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            if Path::new(b.trim_end()).parent() == Some(dir) {
                v.push(PathBuf::from("/dev").join(name));
            }
        }
    }
    v
}

/// `losetup -j FILE`: the loop devices util-linux sees over the file.
pub fn losetup_j(file: &Path) -> String {
    let o = run_with_deadline(
        Command::new("losetup").arg("-j").arg(file),
        Duration::from_secs(10),
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn sh(cmd: &mut Command) -> std::process::Output {
    run_with_deadline(cmd, Duration::from_secs(60))
}

pub fn sh_ok(cmd: &mut Command) -> String {
    let o = sh(cmd);
    assert!(o.status.success(), "{cmd:?}: {}", text(&o));
    text(&o)
}

/// A running `rpma-initiator mount`. Drop: detaches its loop devices, SIGTERMs it, and lazily
/// unmounts whatever is left.
#[derive(Debug)]
pub struct Mounted {
    pub child: Option<Child>,
    pub dir: PathBuf,
    pub file: PathBuf,
    pub lo: Option<PathBuf>,
    pub log: PathBuf,
    /// Dropping it disarms the watchdog.
    pub watchdog: Option<mpsc::Sender<()>>,
}

/// SIGKILLs `pid` after [`WATCHDOG`] unless `disarm` is dropped first.
pub fn watchdog(pid: u32) -> mpsc::Sender<()> {
    let (disarm, armed) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = armed.recv_timeout(WATCHDOG) {
            eprintln!("watchdog: the mount process {pid} outlived {WATCHDOG:?}: SIGKILL");
            // SAFETY: kill has no memory-safety preconditions; the pid is a child that has
            // not been reaped (reaping disarms first).
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
    });
    disarm
}

impl Mounted {
    /// Starts `rpma-initiator ARGS mount DIR EXTRA` and waits for its paths on stdout.
    pub fn start(args: &[String], dir: &Path, extra: &[&str]) -> Mounted {
        let log = dir.with_extension("log");
        let child = Command::new(built("rpma-initiator"))
            .args(args)
            .arg("mount")
            .arg(dir)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn rpma-initiator mount");
        let mut m = Mounted {
            watchdog: Some(watchdog(child.id())),
            child: Some(child),
            dir: dir.to_owned(),
            file: PathBuf::new(),
            lo: None,
            log,
        };
        let want = if extra.contains(&"--loop") { 2 } else { 1 };
        let out = m.child.as_mut().unwrap().stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + WITHIN;
        let mut lines = Vec::new();
        while lines.len() < want {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left.min(Duration::from_millis(200))) {
                Ok(l) => lines.push(l),
                Err(_) => {
                    if let Ok(Some(st)) = m.child.as_mut().unwrap().try_wait() {
                        panic!("mount exited ({st}) before it was ready:\n{}", m.log());
                    }
                    assert!(
                        !left.is_zero(),
                        "mount not ready within {WITHIN:?}:\n{}",
                        m.log()
                    );
                }
            }
        }
        m.file = PathBuf::from(&lines[0]);
        m.lo = lines.get(1).map(PathBuf::from);
        assert!(mounted(dir), "{} is not in /proc/mounts", dir.display());
        m
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for the mount process to exit.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let c = self.child.as_mut().expect("running");
        let deadline = Instant::now() + EXIT_WITHIN;
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                self.watchdog = None;
                self.child = None;
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "the mount process did not exit within {EXIT_WITHIN:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn sigterm(&mut self) -> ExitStatus {
        let pid = self.child.as_ref().expect("running").id();
        // SAFETY: kill has no memory-safety preconditions; the pid is our live child's.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) }, 0);
        self.wait_exit()
    }

    /// Asserts that neither the mount nor a loop device over the file is left.
    pub fn assert_gone(&self) {
        assert!(!mounted(&self.dir), "{} still mounted", self.dir.display());
        assert!(
            loops_under(&self.dir).is_empty(),
            "{:?}",
            loops_under(&self.dir)
        );
        assert_eq!(losetup_j(&self.file), "");
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let mut los = loops_under(&self.dir);
        // After a lazy unmount the kernel names the backing file from the detached mount's
        // root ("/ns1"): our own device is found by its number.
        if let Some(lo) = &self.lo {
            let name = lo.file_name().unwrap().to_string_lossy().into_owned();
            let backing = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"));
            // The full path, or "/ns1" once lazily unmounted (never another test's "/x/ns1").
            let detached = Path::new("/").join(self.file.file_name().unwrap());
            if backing.is_ok_and(|b| {
                let b = Path::new(b.trim_end());
                b == self.file || b == detached
            }) {
                los.push(lo.clone());
            }
        }
        for lo in los {
            let _ = sh(Command::new("losetup").arg("-d").arg(lo));
        }
        if let Some(mut c) = self.child.take() {
            self.watchdog = None;
            // SAFETY: as in sigterm.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        if mounted(&self.dir) {
            let _ = sh(Command::new("umount").arg("-l").arg(&self.dir));
        }
    }
}

/// A filesystem mounted from a loop device; unmounted on drop (lazily as a last resort).
#[derive(Debug)]
pub struct FsMount(pub PathBuf);

impl FsMount {
    pub fn new(dev: &Path, dir: &Path, ro: bool) -> FsMount {
        std::fs::create_dir_all(dir).unwrap();
        let mut c = Command::new("mount");
        if ro {
            c.arg("-o").arg("ro");
        }
        sh_ok(c.arg(dev).arg(dir));
        FsMount(dir.to_owned())
    }

    pub fn unmount(self) {
        sh_ok(Command::new("umount").arg(&self.0));
        std::mem::forget(self);
    }
}

impl Drop for FsMount {
    fn drop(&mut self) {
        if sh(Command::new("umount").arg(&self.0)).status.success() {
            return;
        }
        let _ = sh(Command::new("umount").arg("-l").arg(&self.0));
    }
}

/// A canonical scratch directory with a `mnt` mount point.
pub fn scratch() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir_in(crate::scratch_root()).unwrap();
    let root = std::fs::canonicalize(d.path()).unwrap();
    std::fs::create_dir(root.join("mnt")).unwrap();
    (d, root)
}

/// A scratch directory ([`scratch`]), a /dev/shm file tagged `tag` and a [`target`] serving
/// them. Bind the four in this order, so that the target stops before its files go.
pub fn start(tag: &str) -> (tempfile::TempDir, PathBuf, Shm, Target) {
    let (d, root) = scratch();
    let shm = Shm::new(tag);
    let t = target(&root, &shm);
    (d, root, shm, t)
}

/// `rpma-initiator mount --loop` of `t`'s namespace 1 at `root/mnt`, an ext4 filesystem made
/// on its loop device ([`mkfs_ext4`]) and mounted at `root/ext`: the mount, its loop device and
/// the filesystem. Bind them in this order, so that the filesystem is unmounted before the
/// mount stops.
pub fn ext4_on_loop(t: &Target, root: &Path) -> (Mounted, PathBuf, FsMount) {
    let m = Mounted::start(&conn_args(&t.url(), 1), &root.join("mnt"), &["--loop"]);
    let lo = m.lo.clone().expect("a loop device");
    mkfs_ext4(&lo);
    let fs = FsMount::new(&lo, &root.join("ext"), false);
    (m, lo, fs)
}

/// The arguments of `rpma-initiator umount MNT` for `t`'s namespace 1.
pub fn umount_args(t: &Target, mnt: &Path) -> Vec<String> {
    let mut a = conn_args(&t.url(), 1);
    a.extend(["umount".to_owned(), mnt.to_string_lossy().into_owned()]);
    a
}

/// An ext4 filesystem on `dev` (quiet, forced, no discard: a loop device over the FUSE file).
pub fn mkfs_ext4(dev: &Path) {
    sh_ok(
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-E", "nodiscard"])
            .arg(dev),
    );
}
