//! The kernel's own block-device clients on `rpma-initiator nbd`, in the VM lab (the host
//! kernel has no nbd or md; `make test` runs these in the guest, over `tcp` and, in the
//! `rdma::` twins, over Soft-RoCE):
//!
//! - nbd-client: ext4 made, mounted and written through /dev/nbdN, `sync` (NBD FLUSH), then a
//!   SIGKILL of the target and a restart: the export reconnects by itself, the file reads back
//!   the same once the guest's page cache is dropped, and e2fsck finds the file system clean.
//!   Once with one connection, once with four (`-C 4`: the export advertises CAN_MULTI_CONN).
//! - md RAID1 across two targets (two namespaces on two target processes, each through its
//!   own export and nbd device): one target is killed mid-write, the array runs degraded with
//!   nothing lost, the target restarts, `mdadm --re-add` resyncs through the write-intent
//!   bitmap, and the two legs' data areas are then identical. docs/mount.md says what this
//!   does and does not guarantee.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rpma_tests::{
    built, conn_args, free_port, noise, run_with_deadline, scratch, text, Config, Namespace,
    Subsystem, Target,
};

const SUB: &str = "nqn.2026-11.io.rpma:kernel";
const HOST: &str = "nqn.2026-11.io.rpma:kernel-host";
const WAIT: Duration = Duration::from_secs(120);

/// The nbd devices and md arrays are the guest's: one test at a time uses them.
static DEVICES: Mutex<()> = Mutex::new(());

/// Runs a command within the deadline; panics with its output unless it succeeds.
fn sh(cmd: &mut Command) -> String {
    let o = run_with_deadline(cmd, WAIT);
    assert!(o.status.success(), "{cmd:?}: {}", text(&o));
    text(&o)
}

fn cmd(program: &str, args: &[&str]) -> String {
    sh(Command::new(program).args(args))
}

/// Fails clearly outside the VM lab (the test is ignored there anyway), then holds the
/// kernel's block devices for the calling test alone: the tests pick /dev/nbdN by looking for
/// a free one, sync whole file systems and kill exports under mounted devices, so two of them
/// at once could take the same device or wait on each other's dead export (seen as both
/// `rdma::` twins stuck until the lab's time-out).
fn require_lab() -> std::sync::MutexGuard<'static, ()> {
    static LAB: std::sync::Mutex<()> = std::sync::Mutex::new(());
    assert!(
        Path::new("/sys/module/nbd").exists(),
        "no nbd module: this test runs in the VM lab (make vm-test; docs/testing.md)"
    );
    LAB.lock().unwrap_or_else(|e| e.into_inner())
}

/// A target serving SUB with one 64 MiB page-cache namespace, in its own directory.
fn target(dir: &Path) -> Target {
    let config = Config::new().subsystem(
        Subsystem::new(SUB)
            .host(HOST)
            .namespace(Namespace::new(1, "ns1", "64MiB")),
    );
    Target::start(dir, &config.to_string())
}

/// `rpma-initiator nbd --listen 127.0.0.1:PORT` of the target's namespace 1; killed on drop.
struct Export {
    child: std::process::Child,
    port: u16,
    log: PathBuf,
}

impl Export {
    fn start(t: &Target, args: &[&str]) -> Export {
        let port = free_port();
        let log = t.dir().join(format!("nbd-{port}.log"));
        let conn = conn_args(&t.url(), SUB, HOST, Some(1));
        let listen = format!("127.0.0.1:{port}");
        let child = Command::new(built("rpma-initiator"))
            .args(&conn)
            .args(["nbd", "--listen", &listen])
            .args(args)
            // RPMA_TEST_EXPORT_LOG: the export's RUST_LOG when a failure needs more.
            .env(
                "RUST_LOG",
                std::env::var("RPMA_TEST_EXPORT_LOG").unwrap_or_else(|_| "info".to_owned()),
            )
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + WAIT;
        while std::net::TcpStream::connect(&listen).is_err() {
            assert!(Instant::now() < deadline, "the export never listened");
            std::thread::sleep(Duration::from_millis(50));
        }
        Export { child, port, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "--- the export's log ---\n{}\n--- the kernel's last lines ---\n{}",
                self.log(),
                dmesg_tail()
            );
        }
    }
}

/// A free /dev/nbdN (no process behind it), not one of `taken`.
fn free_nbd(taken: &[String]) -> Option<String> {
    (0..8).map(|i| format!("nbd{i}")).find(|n| {
        !taken.contains(n)
            && !Path::new(&format!("/sys/block/{n}/pid")).exists()
            && std::fs::read_to_string(format!("/sys/block/{n}/size"))
                .is_ok_and(|s| s.trim() == "0")
    })
}

/// /dev/nbdN connected to an export by the kernel's nbd-client; disconnected on drop.
struct NbdDev(String);

impl NbdDev {
    /// Connects a free /dev/nbdN (not one of `taken`). A device disconnected just before may
    /// look free (no pid, size 0) while the kernel is still tearing it down: nbd-client then
    /// fails ("Failed to setup device"; dmesg: "nbdN already in use"), and another device is
    /// tried, until the deadline.
    fn connect(e: &Export, connections: u32, taken: &[String]) -> NbdDev {
        let deadline = Instant::now() + WAIT;
        let mut skip = taken.to_vec();
        loop {
            let Some(name) = free_nbd(&skip) else {
                // Every free-looking device tried: wait for the kernel, then try them again.
                assert!(Instant::now() < deadline, "no free nbd device");
                skip = taken.to_vec();
                std::thread::sleep(Duration::from_millis(200));
                continue;
            };
            let dev = format!("/dev/{name}");
            let port = e.port.to_string();
            let c = connections.to_string();
            let o = run_with_deadline(
                Command::new("nbd-client").args([
                    "127.0.0.1",
                    &port,
                    &dev,
                    "-N",
                    "rpma",
                    "-b",
                    "4096",
                    "-C",
                    &c,
                ]),
                WAIT,
            );
            if !o.status.success()
                && text(&o).contains("Failed to setup device")
                && Instant::now() < deadline
            {
                skip.push(name);
                continue;
            }
            assert!(o.status.success(), "nbd-client: {}\n{}", text(&o), e.log());
            let size = std::fs::read_to_string(format!("/sys/block/{name}/size")).unwrap();
            assert_eq!(size.trim(), (64u64 << 20 >> 9).to_string(), "{dev}'s size");
            return NbdDev(dev);
        }
    }
}

impl Drop for NbdDev {
    fn drop(&mut self) {
        let _ = run_with_deadline(Command::new("nbd-client").args(["-d", &self.0]), WAIT);
    }
}

/// A mount of `dev` at `dir`; unmounted (lazily, if need be) on drop.
struct Mounted(PathBuf);

impl Mounted {
    fn new(dev: &str, dir: &Path) -> Mounted {
        std::fs::create_dir_all(dir).unwrap();
        cmd("mount", &[dev, dir.to_str().unwrap()]);
        Mounted(dir.to_owned())
    }

    fn unmount(self) {
        cmd("umount", &[self.0.to_str().unwrap()]);
        std::mem::forget(self);
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn drop_caches() {
    cmd("sync", &[]);
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
}

/// Writes `data` to `path` and syncs the whole file system (the kernel sends NBD FLUSH).
fn write_and_sync(path: &Path, data: &[u8]) {
    std::fs::write(path, data).unwrap();
    cmd("sync", &["-f", path.to_str().unwrap()]);
}

/// The kernel's nbd-client with `connections` connections: ext4 on /dev/nbdN, a file written
/// and synced, the target SIGKILLed and restarted, the file read back after dropping the
/// page cache, e2fsck clean.
fn ext4_survives_a_target_sigkill(connections: u32) {
    let _lab = require_lab();
    let _one = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    let d = scratch();
    let mut t = target(d.path());
    let e = Export::start(&t, &["--reconnect-timeout", "60"]);
    let dev = NbdDev::connect(&e, connections, &[]);
    cmd("mkfs.ext4", &["-q", "-F", "-b", "4096", &dev.0]);
    let mnt = Mounted::new(&dev.0, &d.path().join("mnt"));
    let data = noise(connections as u64, 3 << 20);
    let file = mnt.0.join("data");
    write_and_sync(&file, &data);
    // Everything above was FLUSHed: durable on the target. Power-cut the target.
    t.kill9();
    t.restart();
    drop_caches();
    let back = std::fs::read(&file).expect("read back after the restart");
    assert!(
        back == data,
        "the synced file differs after the target's SIGKILL"
    );
    // And more writes go through the reconnected export.
    write_and_sync(&mnt.0.join("after"), &noise(9, 1 << 20));
    mnt.unmount();
    let fsck = run_with_deadline(Command::new("e2fsck").args(["-f", "-n", &dev.0]), WAIT);
    assert!(fsck.status.success(), "e2fsck: {}", text(&fsck));
    assert!(
        e.log().contains("reconnected") || e.log().contains("reconnect"),
        "the export reconnected: {}",
        e.log()
    );
}

#[test]
#[ignore = "requires the VM lab: the kernel's nbd (make vm-test)"]
fn nbd_client_ext4_survives_a_target_sigkill_after_flush() {
    ext4_survives_a_target_sigkill(1);
}

#[test]
#[ignore = "requires the VM lab: the kernel's nbd (make vm-test)"]
fn nbd_client_with_four_connections_ext4_survives_a_target_sigkill() {
    ext4_survives_a_target_sigkill(4);
}

/// md's view of an array: `/proc/mdstat`'s lines for it (up to the blank line after them:
/// members, state, bitmap, recovery progress).
fn mdstat(md: &str) -> String {
    let s = std::fs::read_to_string("/proc/mdstat").unwrap();
    let name = md.trim_start_matches("/dev/");
    s.lines()
        .skip_while(|l| !l.starts_with(name))
        .take_while(|l| !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Waits until `/proc/mdstat` says `what` about the array.
fn wait_md(md: &str, what: &str) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let s = mdstat(md);
        if s.contains(what) {
            return s;
        }
        assert!(Instant::now() < deadline, "{md} never showed {what:?}: {s}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The kernel's last 30 log lines.
fn dmesg_tail() -> String {
    let dmesg = Command::new("dmesg")
        .output()
        .map(|o| text(&o))
        .unwrap_or_default();
    let tail: Vec<&str> = dmesg.lines().rev().take(30).collect();
    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// The data offset of an md member, in bytes (`mdadm --examine`).
fn data_offset(dev: &str) -> u64 {
    let out = cmd("mdadm", &["--examine", dev]);
    let sectors: u64 = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("Data Offset :"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no data offset: {out}"));
    sectors * 512
}

/// The bytes of `dev` from `from` on.
fn read_from(dev: &str, from: u64) -> Vec<u8> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(dev).unwrap();
    f.seek(SeekFrom::Start(from)).unwrap();
    let mut b = Vec::new();
    f.read_to_end(&mut b).unwrap();
    b
}

#[test]
#[ignore = "requires the VM lab: the kernel's nbd and md (make vm-test)"]
fn md_raid1_across_two_targets_survives_one_and_resyncs() {
    let _lab = require_lab();
    let _one = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    let (da, db) = (scratch(), scratch());
    let ta = target(da.path());
    let mut tb = target(db.path());
    // A short reconnect budget on the leg that will lose its target: its export answers EIO
    // soon, and md fails the leg instead of waiting (long enough for one reconnect over rdma
    // in an emulated guest).
    let ea = Export::start(&ta, &[]);
    let eb = Export::start(&tb, &["--reconnect-timeout", "8"]);
    let a = NbdDev::connect(&ea, 1, &[]);
    let b = NbdDev::connect(&eb, 1, &[a.0.trim_start_matches("/dev/").to_owned()]);
    // A device node mdadm makes itself (no udev in the guest to make /dev/md/NAME links).
    let md = "/dev/md0";
    cmd(
        "mdadm",
        &[
            "--create",
            md,
            "--run",
            "--level=1",
            "--raid-devices=2",
            "--metadata=1.2",
            "--bitmap=internal",
            "--assume-clean",
            &a.0,
            &b.0,
        ],
    );
    struct Stop(&'static str);
    impl Drop for Stop {
        fn drop(&mut self) {
            let _ = Command::new("mdadm").args(["--stop", self.0]).status();
        }
    }
    let _stop = Stop(md);
    cmd("mkfs.ext4", &["-q", "-F", "-b", "4096", md]);
    let mnt = Mounted::new(md, &da.path().join("mnt"));
    let before = noise(1, 4 << 20);
    write_and_sync(&mnt.0.join("before"), &before);

    // Kill target B while a writer keeps writing and syncing.
    let during = noise(2, 8 << 20);
    let path = mnt.0.join("during");
    let (done, writer) = std::sync::mpsc::channel();
    {
        let (path, during) = (path.clone(), during.clone());
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(|| {
                use std::io::Write;
                let mut f = std::fs::File::create(&path).unwrap();
                for chunk in during.chunks(256 << 10) {
                    f.write_all(chunk).unwrap();
                    f.sync_data().unwrap();
                }
            });
            let _ = done.send(r.is_ok());
        });
    }
    tb.kill9();
    // A deadline, so that a request the export leaves unanswered fails this test with what
    // the kernel and the export saw, not the whole lab by its time-out.
    match writer.recv_timeout(WAIT) {
        Ok(ok) => assert!(ok, "writes and fsyncs succeed on the degraded array"),
        Err(_) => panic!(
            "the writer is stuck on the degraded array: {}\n--- leg B's export ---\n{}\n--- dmesg ---\n{}",
            mdstat(md),
            eb.log(),
            dmesg_tail()
        ),
    }
    let s = wait_md(md, "[U_]");
    assert!(s.contains("(F)"), "leg B is marked faulty: {s}");
    drop_caches();
    assert!(
        std::fs::read(mnt.0.join("before")).unwrap() == before,
        "degraded"
    );
    assert!(std::fs::read(&path).unwrap() == during, "degraded");

    // B comes back. Its leg is removed from the array and its nbd device connected anew: the
    // export answers EIO to the first flush after writes it gave up on (it cannot say what
    // became of them: docs/mount.md), so md's superblock write over the old connection would
    // fail the leg again. Whether that flush is the old connection's or the new one's depends
    // on timing: when no request of the old connection failed after the give-up (md sends none
    // to a faulty leg), the loss is reported to the next flush of any connection, here the new
    // one's. So one flush (fsync of the device) is sent first, its result ignored: md's
    // superblock write at --re-add must not be the one that hears of the old loss. Then
    // re-added through the bitmap, resynced.
    tb.restart();
    cmd("mdadm", &[md, "--remove", &b.0]);
    let a_name = a.0.trim_start_matches("/dev/").to_owned();
    drop(b);
    let b = NbdDev::connect(&eb, 1, &[a_name]);
    let _ = std::fs::OpenOptions::new()
        .write(true)
        .open(&b.0)
        .and_then(|f| f.sync_all());
    let readd = run_with_deadline(Command::new("mdadm").args([md, "--re-add", &b.0]), WAIT);
    assert!(
        readd.status.success(),
        "--re-add: {}\n{}",
        text(&readd),
        eb.log()
    );
    // Both legs up and the recovery over (`mdadm --wait` exits 1 when there is nothing left
    // to wait for, so /proc/mdstat is watched instead).
    let deadline = Instant::now() + WAIT;
    loop {
        let s = mdstat(md);
        if s.contains("[UU]") && !s.contains("recovery") && !s.contains("resync") {
            break;
        }
        if Instant::now() >= deadline {
            panic!(
                "{md} never resynced: {s}\n--- leg B's export ---\n{}\n--- dmesg ---\n{}",
                eb.log(),
                dmesg_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    drop_caches();
    assert!(std::fs::read(mnt.0.join("before")).unwrap() == before);
    assert!(std::fs::read(&path).unwrap() == during);
    mnt.unmount();
    let fsck = run_with_deadline(Command::new("e2fsck").args(["-f", "-n", md]), WAIT);
    assert!(fsck.status.success(), "e2fsck: {}", text(&fsck));
    // Both legs hold the same data now.
    let (oa, ob) = (data_offset(&a.0), data_offset(&b.0));
    assert!(
        read_from(&a.0, oa) == read_from(&b.0, ob),
        "the legs differ after the resync"
    );
}

rpma_tests::rdma_runs!(
    nbd_client_ext4_survives_a_target_sigkill_after_flush,
    nbd_client_with_four_connections_ext4_survives_a_target_sigkill,
    md_raid1_across_two_targets_survives_one_and_resyncs,
);
