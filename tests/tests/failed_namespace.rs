//! A write-back error on a real filesystem: ext4 on a loop device whose backing file lies on a
//! small tmpfs filled to 100%. Linux reports the error to the first fdatasync/msync of the file
//! and then marks the pages clean, so a second sync "succeeds" over data that never reached the
//! disk. The namespace must fail instead: every later durability request, from any host and by
//! any method, is refused, the daemon logs it once with the errno, `status` shows it, and only
//! a reload (or restart) that reopens the file clears it.
//!
//! Needs root, loop devices and mkfs.ext4; without them it says why and skips.

use std::path::{Path, PathBuf};
use std::process::Command;

use rpma_tests::{conn_args, initiator, text, Target};

const SUB: &str = "nqn.2026-11.io.rpma:failed-ns";
const HOST: &str = "nqn.2026-11.io.rpma:failed-ns-host";
const HOST2: &str = "nqn.2026-11.io.rpma:failed-ns-other";

fn sh(cmd: &str, args: &[&str]) -> Result<String, String> {
    let o = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if !o.status.success() {
        return Err(format!(
            "{cmd} {args:?}: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

/// A 48 MiB tmpfs holding a sparse 256 MiB image, formatted ext4, on a loop device, mounted.
/// Unmounted and detached on drop.
struct FragileFs {
    tmpfs: PathBuf,
    mnt: PathBuf,
    loopdev: String,
}

impl FragileFs {
    fn new(dir: &Path) -> Result<FragileFs, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("needs root (mount, losetup)".into());
        }
        let tmpfs = dir.join("t");
        let mnt = dir.join("m");
        std::fs::create_dir_all(&tmpfs).map_err(|e| e.to_string())?;
        std::fs::create_dir_all(&mnt).map_err(|e| e.to_string())?;
        let t = tmpfs.to_str().unwrap();
        sh("mount", &["-t", "tmpfs", "-o", "size=48M", "tmpfs", t])?;
        let mut fs = FragileFs {
            tmpfs: tmpfs.clone(),
            mnt: mnt.clone(),
            loopdev: String::new(),
        };
        let img = tmpfs.join("img");
        let img = img.to_str().unwrap();
        sh("truncate", &["-s", "256M", img])?;
        sh("mkfs.ext4", &["-q", "-F", img])?;
        fs.loopdev = sh("losetup", &["--find", "--show", img])?;
        // noinit_itable: no background zeroing that would fill the tmpfs on its own.
        sh(
            "mount",
            &["-o", "noinit_itable", &fs.loopdev, mnt.to_str().unwrap()],
        )?;
        Ok(fs)
    }

    /// Fills the tmpfs under the image: the next write-back to the loop device fails.
    fn fill(&self) {
        let _ = std::fs::write(self.tmpfs.join("fill"), vec![0u8; 64 << 20]);
        let st = nix_statvfs(&self.tmpfs);
        assert_eq!(st, 0, "the tmpfs is full");
    }

    fn free(&self) {
        std::fs::remove_file(self.tmpfs.join("fill")).unwrap();
    }
}

/// Free blocks of the filesystem at `p`.
fn nix_statvfs(p: &Path) -> u64 {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: a valid C string and a buffer of the right type, written by statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    assert_eq!(rc, 0);
    // SAFETY: statvfs succeeded, so it filled the buffer.
    unsafe { st.assume_init() }.f_bavail
}

impl Drop for FragileFs {
    fn drop(&mut self) {
        let _ = sh("umount", &["-l", self.mnt.to_str().unwrap()]);
        if !self.loopdev.is_empty() {
            let _ = sh("losetup", &["-d", &self.loopdev]);
        }
        let _ = sh("umount", &["-l", self.tmpfs.to_str().unwrap()]);
    }
}

fn cli(t: &Target, host: &str, line: &str) -> (Option<i32>, String) {
    let conn = conn_args(&t.url(), SUB, host, None);
    let mut a: Vec<&str> = conn.iter().map(String::as_str).collect();
    a.extend(["--reconnect-timeout", "5"]);
    a.extend(line.split_whitespace());
    let o = initiator(&a);
    (o.status.code(), text(&o))
}

fn failed_of(t: &Target, nsid: u64) -> serde_json::Value {
    let v = t.status();
    let ns = v["subsystems"][0]["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["nsid"] == nsid)
        .cloned()
        .unwrap();
    ns["failed"].clone()
}

#[test]
fn a_writeback_error_fails_the_namespace_for_every_host_until_a_reload_reopens_it() {
    let d = rpma_tests::scratch();
    let fs = match FragileFs::new(d.path()) {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("SKIPPED: cannot build the failing filesystem here: {why}");
            return;
        }
    };
    let m = fs.mnt.display();
    let t_dir = d.path().join("target");
    std::fs::create_dir(&t_dir).unwrap();
    let mut t = Target::start(
        &t_dir,
        &format!(
            "[[subsystem]]\nnqn = \"{SUB}\"\nhosts = [{{ nqn = \"{HOST}\" }}, {{ nqn = \"{HOST2}\" }}]\n\
             [[subsystem.namespace]]\nnsid = 1\npath = \"{m}/ns1\"\nsize = \"8MiB\"\n\
             [[subsystem.namespace]]\nnsid = 2\npath = \"{m}/ns2\"\nsize = \"8MiB\"\n"
        ),
    );
    let (c, all) = cli(&t, HOST, "list --json");
    assert_eq!(c, Some(0), "{all}");
    assert!(all.contains("page-cache"), "{all}");

    fs.fill();
    // nsid 1 fails through GPSPM (the flush service's fdatasync), nsid 2 through FLUSH (the
    // placement engine's msync): both report the error, neither says durable.
    let (c, all) = cli(
        &t,
        HOST,
        "write --offset 0 --pattern 0x5a --length 1M --durable",
    );
    assert_eq!(c, Some(1), "{all}");
    assert!(all.contains("IoError"), "{all}");
    let (c, all) = cli(
        &t,
        HOST,
        "--nsid 2 --persist flush write --offset 0 --pattern 0x5a --length 1M --durable",
    );
    assert_eq!(c, Some(1), "{all}");
    assert!(all.contains("FAILED"), "{all}");

    // Linux now reports success for the same pages: the namespace must not.
    for (nsid, host, how) in [
        (1, HOST, ""),
        (1, HOST2, "--persist flush"),
        (1, HOST2, "--persist gpspm"),
        (2, HOST, "--persist gpspm"),
        (2, HOST2, ""),
    ] {
        let (c, all) = cli(
            &t,
            host,
            &format!("--nsid {nsid} {how} flush --offset 0 --length 1M"),
        );
        assert_eq!(c, Some(1), "nsid {nsid} {host} {how}: {all}");
        assert!(
            all.contains("FAILED") && all.contains("No space left"),
            "nsid {nsid} {how}: {all}"
        );
        assert!(!all.contains("durable ("), "{all}");
    }
    // Writes are refused too (nothing could make them durable); reads still work.
    let (c, all) = cli(&t, HOST2, "write --offset 0 --pattern 1 --length 4k");
    assert_eq!(c, Some(1), "{all}");
    assert!(all.contains("writes are refused"), "{all}");
    let (c, all) = cli(&t, HOST, "read --offset 0 --length 16 --json");
    assert_eq!(c, Some(0), "{all}");

    // The placement engine's failed msync (FLUSH, nsid 2) ended that connection, and the
    // queue pair's error, logged by the target, keeps the typed error down to the errno.
    let log = t.log();
    assert!(
        log.lines()
            .any(|l| l.contains("making earlier Writes durable failed")
                && l.contains("msync")
                && l.contains("No space left on device")),
        "{log}"
    );

    // status shows it; the log says it once per namespace, at error level, with the errno.
    for nsid in [1, 2] {
        let f = failed_of(&t, nsid);
        assert!(
            f.as_str().is_some_and(|s| s.contains("No space left")),
            "nsid {nsid}: {f}"
        );
    }
    let log = t.log();
    for nsid in [1, 2] {
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(&format!("namespace {nsid} (")) && l.contains("has FAILED"))
            .collect();
        assert_eq!(lines.len(), 1, "nsid {nsid}: {log}");
        assert!(
            lines[0].contains("ERROR") && lines[0].contains("errno 28"),
            "{}",
            lines[0]
        );
    }

    // The operator frees space and reloads: the namespaces are reopened (logged) and durable.
    fs.free();
    t.reload();
    let log = t.log();
    assert_eq!(
        log.matches("reload: reopening subsystem").count(),
        2,
        "{log}"
    );
    assert!(failed_of(&t, 1).is_null());
    for nsid in [1, 2] {
        let (c, all) = cli(
            &t,
            HOST,
            &format!("--nsid {nsid} write --offset 0 --pattern 0x77 --length 1M --durable"),
        );
        assert_eq!(c, Some(0), "{all}");
        let (c, all) = cli(
            &t,
            HOST2,
            &format!("--nsid {nsid} flush --offset 0 --length 1M"),
        );
        assert_eq!(c, Some(0), "{all}");
    }
    drop(t);
}

// No rdma:: twin: a write-back error needs a page-cache namespace, which the VM lab's
// Soft-RoCE cannot register (docs/rdma.md, "Soft-RoCE and ODP"); the failure handling is the
// target's, the same on both transports.
