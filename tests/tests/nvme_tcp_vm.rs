//! The kernel's own NVMe/TCP host and nvme-cli against `rpma-target`'s `nvme-tcp://` listener.
//! The host kernel of the build machines has no nvme-tcp: these run in the VM lab's guest,
//! which runs every ignored test of the workspace with `--ignored` (docs/nvme-tcp.md, "Testing";
//! scripts/vm/nvme-tcp-tests.sh runs this file's tests in the guest on its own). Inside the
//! guest they skip nothing: a missing kernel module or tool fails the test with what is missing.
//!
//! Each test starts its own target, on a namespace file on ext4 (a loop device: the guest's
//! /tmp is tmpfs, where a namespace would be volatile), connects with `nvme connect`, finds its
//! block device by its subsystem NQN in sysfs, and disconnects at the end. They take a lock so
//! that two never touch the kernel's host at once.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use rpma_tests::{run_with_deadline, text, Config, Namespace, Subsystem, Target};

const HOST: &str = "nqn.2026-11.io.rpma:vm-host";

/// One test at a time against the kernel's host.
fn serial() -> MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    M.lock().unwrap_or_else(|p| p.into_inner())
}

fn run(cmd: &str, args: &[&str]) -> Output {
    run_with_deadline(Command::new(cmd).args(args), Duration::from_secs(300))
}

/// Runs `cmd`, which must succeed; its stdout.
fn ok(cmd: &str, args: &[&str]) -> String {
    let o = run(cmd, args);
    assert!(o.status.success(), "{cmd} {args:?} failed: {}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The lab: root, the kernel's NVMe/TCP host, loopback up, and an ext4 filesystem for the
/// namespace files (a loop device over a file in /tmp), mounted once per test binary.
fn lab() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(unsafe { libc::geteuid() }, 0, "the VM lab runs as root");
        for m in ["nvme-tcp", "nvme-fabrics", "loop"] {
            let o = run("modprobe", &[m]);
            assert!(
                o.status.success(),
                "modprobe {m} failed (this kernel has no {m}; run in the VM lab): {}",
                text(&o)
            );
        }
        for tool in ["nvme", "fio", "mkfs.ext4", "e2fsck", "blockdev", "losetup"] {
            let o = run("sh", &["-c", &format!("command -v {tool}")]);
            assert!(o.status.success(), "{tool} is not installed in the guest");
        }
        let _ = run("ip", &["link", "set", "lo", "up"]);
        let base = PathBuf::from(format!("/tmp/rpma-nvme-vm-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let img = base.join("ext4.img");
        ok("truncate", &["-s", "1536M", img.to_str().unwrap()]);
        ok("mkfs.ext4", &["-q", "-F", img.to_str().unwrap()]);
        let dev = ok("losetup", &["--find", "--show", img.to_str().unwrap()]);
        let mnt = base.join("fs");
        std::fs::create_dir_all(&mnt).unwrap();
        ok("mount", &[dev.trim(), mnt.to_str().unwrap()]);
        mnt
    })
}

/// A directory of its own on the lab's ext4 for one target.
fn scratch(tag: &str) -> PathBuf {
    let d = lab().join(tag);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Whether `name` is a namespace block device's name (`nvme0n1`, not a controller `nvme0` nor
/// a multipath path `nvme0c0n1`).
fn is_namespace(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("nvme") else {
        return false;
    };
    let mut parts = rest.splitn(2, 'n');
    let (Some(a), Some(b)) = (parts.next(), parts.next()) else {
        return false;
    };
    !a.is_empty() && a.bytes().all(|c| c.is_ascii_digit()) && b.bytes().all(|c| c.is_ascii_digit())
}

/// The block devices (`nvmeXnY`) of `subnqn`, by sysfs: under its subsystem (native multipath)
/// or under its controllers (without).
fn devices_of(subnqn: &str) -> Vec<String> {
    let mut out = Vec::new();
    for class in ["/sys/class/nvme-subsystem", "/sys/class/nvme"] {
        for s in std::fs::read_dir(class).into_iter().flatten().flatten() {
            let nqn = std::fs::read_to_string(s.path().join("subsysnqn")).unwrap_or_default();
            if nqn.trim() != subnqn {
                continue;
            }
            for e in std::fs::read_dir(s.path()).into_iter().flatten().flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if is_namespace(&name) && !out.contains(&format!("/dev/{name}")) {
                    out.push(format!("/dev/{name}"));
                }
            }
        }
    }
    out.sort();
    out
}

/// Waits for `subnqn`'s namespace `nsid` to appear as a block device. Its name does not say
/// its nsid (the kernel numbers them in the order it finds them): sysfs does. The kernel makes
/// the device node and its nsid attribute before it registers the disk's queue, so this also
/// waits for the queue's attributes (a read of `queue/write_cache` right after the node showed
/// up found none once, under the lab's slow emulation).
fn device(subnqn: &str, nsid: u32) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let found = devices_of(subnqn).into_iter().find(|d| {
            let name = d.trim_start_matches("/dev/");
            std::fs::read_to_string(format!("/sys/class/block/{name}/nsid"))
                .is_ok_and(|n| n.trim() == nsid.to_string())
        });
        let registered = |d: &String| {
            let name = d.trim_start_matches("/dev/");
            Path::new(d).exists()
                && Path::new(&format!("/sys/class/block/{name}/queue/write_cache")).exists()
                && Path::new(&format!("/sys/class/block/{name}/queue/fua")).exists()
        };
        if let Some(d) = found.filter(registered) {
            return d;
        }
        assert!(
            Instant::now() < deadline,
            "no block device for {subnqn} namespace {nsid}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `nvme connect` to `subnqn` with `extra` options.
fn connect(port: u16, subnqn: &str, extra: &[&str]) -> Output {
    let p = port.to_string();
    let mut args = vec![
        "connect",
        "-t",
        "tcp",
        "-a",
        "127.0.0.1",
        "-s",
        &p,
        "-n",
        subnqn,
        "-q",
        HOST,
    ];
    args.extend_from_slice(extra);
    run("nvme", &args)
}

/// Disconnects `subnqn` (at the end of a test, also when it failed).
struct Connected(String);

impl Drop for Connected {
    fn drop(&mut self) {
        let _ = run("nvme", &["disconnect", "-n", &self.0]);
    }
}

fn target(dir: &Path, sub: &str, namespaces: Vec<Namespace>) -> Target {
    let cfg = Config::new()
        .subsystem(Subsystem::new(sub).host(HOST).namespaces(namespaces))
        .to_string();
    Target::start_on(dir, "nvme-tcp://127.0.0.1", &cfg, &[])
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("{e}: {s}"))
}

#[test]
#[ignore = "requires the VM lab (make vm-test)"]
fn vm_discover_connect_identify_list_disconnect() {
    let _l = serial();
    let sub = "nqn.2026-11.io.rpma:vm-basic";
    let dir = scratch("basic");
    let t = target(
        &dir,
        sub,
        vec![
            Namespace::new(1, "ns1", "64MiB").block_size(512),
            Namespace::new(2, "ns2", "32MiB"),
        ],
    );
    let port = t.port().to_string();
    let disc = ok(
        "nvme",
        &[
            "discover",
            "-t",
            "tcp",
            "-a",
            "127.0.0.1",
            "-s",
            &port,
            "-q",
            HOST,
        ],
    );
    assert!(disc.contains(sub), "{disc}");
    assert!(
        disc.contains("nqn.2014-08.org.nvmexpress.discovery"),
        "{disc}"
    );
    assert!(disc.contains(&format!("trsvcid: {port}")), "{disc}");
    let o = connect(t.port(), sub, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let _c = Connected(sub.into());
    let d1 = device(sub, 1);
    let d2 = device(sub, 2);
    assert_eq!(
        ok("blockdev", &["--getsize64", &d1]).trim(),
        (64u64 << 20).to_string()
    );
    assert_eq!(ok("blockdev", &["--getss", &d1]).trim(), "512");
    assert_eq!(
        ok("blockdev", &["--getsize64", &d2]).trim(),
        (32u64 << 20).to_string()
    );
    assert_eq!(ok("blockdev", &["--getss", &d2]).trim(), "4096");
    let id = json(&ok("nvme", &["id-ctrl", &d1, "-o", "json"]));
    assert_eq!(id["mn"].as_str().unwrap().trim(), "rpma-target");
    assert_eq!(id["subnqn"].as_str().unwrap(), sub);
    assert_eq!(
        id["vwc"].as_u64().unwrap() & 1,
        1,
        "page-cache: a write cache"
    );
    assert_eq!(id["mdts"], 5);
    let ns = json(&ok("nvme", &["id-ns", &d1, "-o", "json"]));
    assert_eq!(ns["nsze"], (64u64 << 20) / 512);
    let list = ok("nvme", &["list", "-o", "json"]);
    assert!(list.contains(d1.trim_start_matches("/dev/")), "{list}");
    // The kernel's volatile write cache and FUA follow VWC.
    let blk = d1.trim_start_matches("/dev/");
    let wc = std::fs::read_to_string(format!("/sys/block/{blk}/queue/write_cache")).unwrap();
    assert_eq!(wc.trim(), "write back");
    // An all-dax subsystem reports no write cache: the kernel sends neither Flush nor FUA.
    let dax = "nqn.2026-11.io.rpma:vm-basic-dax";
    let td = target(
        &scratch("basic-dax"),
        dax,
        vec![Namespace::new(1, "ns1", "16MiB").force_dax()],
    );
    let o = connect(td.port(), dax, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let _cd = Connected(dax.into());
    let dd = device(dax, 1);
    let blk = dd.trim_start_matches("/dev/");
    let wc = std::fs::read_to_string(format!("/sys/block/{blk}/queue/write_cache")).unwrap();
    assert_eq!(wc.trim(), "write through");
    let fua = std::fs::read_to_string(format!("/sys/block/{blk}/queue/fua")).unwrap();
    assert_eq!(fua.trim(), "0");
    let st = t.status();
    let kinds: Vec<String> = st["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["kind"].as_str().unwrap().to_owned())
        .collect();
    assert!(kinds.contains(&"nvme-tcp".to_owned()), "{kinds:?}");
    let o = run("nvme", &["disconnect", "-n", sub]);
    assert!(o.status.success(), "{}", text(&o));
    let deadline = Instant::now() + Duration::from_secs(30);
    while Path::new(&d1).exists() {
        assert!(
            Instant::now() < deadline,
            "{d1} still there after disconnect"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
#[ignore = "requires the VM lab (make vm-test)"]
fn vm_fio_with_crc32c_verify_at_depth_32_over_several_io_queues() {
    let _l = serial();
    let sub = "nqn.2026-11.io.rpma:vm-fio";
    let dir = scratch("fio");
    let t = target(&dir, sub, vec![Namespace::new(1, "ns1", "256MiB")]);
    ok("dmesg", &["-C"]);
    let o = connect(t.port(), sub, &["-i", "2", "--hdr-digest", "--data-digest"]);
    assert!(o.status.success(), "{}", text(&o));
    let _c = Connected(sub.into());
    let dev = device(sub, 1);
    let dmesg = ok("dmesg", &[]);
    assert!(dmesg.contains("creating 2 I/O queues"), "two I/O queues");
    let filename = format!("--filename={dev}");
    let o = run(
        "fio",
        &[
            "--name=verify",
            &filename,
            "--ioengine=libaio",
            "--direct=1",
            "--rw=randwrite",
            "--bsrange=4k-128k",
            "--iodepth=32",
            "--numjobs=2",
            // One job per CPU, so one per blk-mq hardware queue: both I/O queues carry I/O.
            "--cpus_allowed=0-1",
            "--cpus_allowed_policy=split",
            "--offset_increment=128M",
            "--size=96M",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
            "--group_reporting",
        ],
    );
    let out = text(&o);
    assert!(o.status.success(), "fio failed: {out}");
    assert!(!out.contains("verify: bad"), "{out}");
    let st = t.status();
    let s = &st["sessions"][0];
    assert!(s["data"]["writes"].as_u64().unwrap() > 100, "{s}");
    assert!(s["data"]["reads"].as_u64().unwrap() > 100, "{s}");
}

/// Writes eight files of known content under `mnt` and `sync`s: what `sync` returned for is
/// durable.
fn write_files(mnt: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    for i in 0..8u64 {
        let data = rpma_tests::noise(100 + i, 256 * 1024 + i as usize * 777);
        let p = mnt.join(format!("f{i}"));
        std::fs::write(&p, &data).unwrap();
        files.push((p, data));
    }
    ok("sync", &[]);
    files
}

fn check_files(mnt: &Path, files: &[(PathBuf, Vec<u8>)]) {
    for (p, data) in files {
        let p = mnt.join(p.file_name().unwrap());
        assert_eq!(&std::fs::read(&p).unwrap(), data, "{}", p.display());
    }
}

#[test]
#[ignore = "requires the VM lab (make vm-test)"]
fn vm_ext4_survives_a_sigkill_of_the_target_and_the_host_reconnects() {
    let _l = serial();
    let sub = "nqn.2026-11.io.rpma:vm-crash";
    let dir = scratch("crash");
    let mut t = target(&dir, sub, vec![Namespace::new(1, "ns1", "256MiB")]);
    let o = connect(
        t.port(),
        sub,
        &["--reconnect-delay=1", "--ctrl-loss-tmo=120"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let _c = Connected(sub.into());
    let dev = device(sub, 1);
    ok("mkfs.ext4", &["-q", "-F", &dev]);
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    ok("mount", &[&dev, mnt.to_str().unwrap()]);
    let files = write_files(&mnt);
    // Written and not synced: in flight or in the host's cache when the target dies.
    let late = rpma_tests::noise(7, 3 << 20);
    std::fs::write(mnt.join("late"), &late).unwrap();
    // The target dies without a word, and comes back.
    t.kill9();
    t.restart();
    // The host reconnects by itself (reconnect-delay 1 s) and re-issues what was in flight.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let st = t.status();
        if st["sessions"]
            .as_array()
            .is_some_and(|s| s.iter().any(|s| s["kind"] == "nvme-tcp"))
        {
            break;
        }
        assert!(Instant::now() < deadline, "the host did not reconnect");
        std::thread::sleep(Duration::from_millis(200));
    }
    ok("sync", &[]);
    ok("umount", &[mnt.to_str().unwrap()]);
    ok("blockdev", &["--flushbufs", &dev]);
    let fsck = run("e2fsck", &["-f", "-n", &dev]);
    assert!(fsck.status.success(), "e2fsck: {}", text(&fsck));
    ok("mount", &[&dev, mnt.to_str().unwrap()]);
    check_files(&mnt, &files);
    assert_eq!(
        std::fs::read(mnt.join("late")).unwrap(),
        late,
        "re-issued after the reconnect"
    );
    ok("umount", &[mnt.to_str().unwrap()]);
}

#[test]
#[ignore = "requires the VM lab (make vm-test)"]
fn vm_ext4_image_is_consistent_after_a_simulated_power_loss() {
    let _l = serial();
    let sub = "nqn.2026-11.io.rpma:vm-power";
    let dir = scratch("power");
    // Under the power-loss simulation, only what the target made durable (Flush, FUA) reaches
    // the namespace file: its SIGKILL is a power loss of the target machine.
    let mut t = target(
        &dir,
        sub,
        vec![Namespace::new(1, "ns1", "256MiB").power_loss_simulation("eviction_percent = 0")],
    );
    let o = connect(t.port(), sub, &["--ctrl-loss-tmo=5"]);
    assert!(o.status.success(), "{}", text(&o));
    let c = Connected(sub.into());
    let dev = device(sub, 1);
    ok("mkfs.ext4", &["-q", "-F", &dev]);
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    ok("mount", &[&dev, mnt.to_str().unwrap()]);
    let files = write_files(&mnt);
    t.kill9();
    // What the namespace file holds now is what a power loss leaves: ext4's journal must make
    // it consistent, with every synced file there.
    let img = dir.join("after-power-loss.img");
    std::fs::copy(dir.join("ns1"), &img).unwrap();
    let img = img.to_str().unwrap();
    let replay = run("e2fsck", &["-E", "journal_only", "-y", img]);
    assert!(
        replay.status.code().is_some_and(|c| c <= 1),
        "{}",
        text(&replay)
    );
    let fsck = run("e2fsck", &["-f", "-n", img]);
    assert!(
        fsck.status.success(),
        "e2fsck after journal replay: {}",
        text(&fsck)
    );
    let check = dir.join("check");
    std::fs::create_dir_all(&check).unwrap();
    ok("mount", &["-o", "loop,ro", img, check.to_str().unwrap()]);
    check_files(&check, &files);
    ok("umount", &[check.to_str().unwrap()]);
    // The host's mount of the dead controller goes away with it.
    let _ = run("umount", &["-l", mnt.to_str().unwrap()]);
    drop(c);
}

#[test]
#[ignore = "requires the VM lab (make vm-test)"]
fn vm_a_host_not_on_the_allow_list_is_refused() {
    let _l = serial();
    let sub = "nqn.2026-11.io.rpma:vm-refused";
    let dir = scratch("refused");
    let cfg = Config::new()
        .subsystem(
            Subsystem::new(sub)
                .host("nqn.2026-11.io.rpma:someone-else")
                .namespace(Namespace::new(1, "ns1", "16MiB")),
        )
        .to_string();
    let t = Target::start_on(&dir, "nvme-tcp://127.0.0.1", &cfg, &[]);
    let o = connect(t.port(), sub, &[]);
    let _c = Connected(sub.into());
    assert!(!o.status.success(), "connected: {}", text(&o));
    assert!(devices_of(sub).is_empty());
    let dmesg = ok("dmesg", &[]);
    assert!(
        dmesg.contains("not allowed") || dmesg.contains("Connect Invalid Host"),
        "the kernel says why: {}",
        dmesg.lines().rev().take(10).collect::<Vec<_>>().join("\n")
    );
    let lines = t.log_lines(&["nvme-tcp Connect refused", HOST], Duration::from_secs(10));
    assert!(!lines.is_empty());
    assert_eq!(t.status()["metrics"]["refusals"]["host_not_allowed"], 1);
}

#[test]
fn namespace_device_names() {
    assert!(is_namespace("nvme0n1"));
    assert!(is_namespace("nvme12n3"));
    assert!(!is_namespace("nvme0"));
    assert!(!is_namespace("nvme0c0n1"));
    assert!(!is_namespace("nvme-subsys0"));
    assert!(!is_namespace("ng0n1"));
}
