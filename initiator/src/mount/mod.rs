//! `rpma-initiator mount DIR [--loop]` and `rpma-initiator umount DIR`: the namespace as one
//! regular file in a FUSE filesystem ([`fs`]), served by one I/O thread that owns the queue
//! ([`io`]), optionally with a loop device over it ([`loopdev`]). docs/mount.md ("FUSE file
//! and loop device") has the operator's side.
//!
//! Threads: the FUSE session (reads /dev/fuse, answers metadata, forwards data), the I/O thread,
//! a signal thread (SIGTERM and SIGINT are blocked everywhere else and waited for there), and
//! the main thread, which waits for a signal or the end of the session. Stopping: a signal
//! detaches our loop device and unmounts; `umount` from another process does the same from
//! outside. Either way the session ends, the I/O thread persists what is dirty and disconnects,
//! and the process exits 0 (1 if that last persist failed; 7 on a volatile namespace it wrote
//! to, without `--visible-ok`).

mod fs;
mod io;
mod kmount;
mod loopdev;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use nix::sys::signal::{SigSet, Signal};
use rpma_initiator::namespace::check_healthy;
use rpma_initiator::Choice;
use serde::Serialize;

use crate::cli::{io_failure, print_json, usage, Failure, Global};

/// Requests the I/O thread keeps in flight inside one call.
const DEPTH: usize = 32;

/// What `mount` was asked for.
#[derive(Debug)]
pub(crate) struct MountArgs<'a> {
    /// The mount point (an existing directory).
    pub(crate) dir: &'a Path,
    /// Attach a loop device too.
    pub(crate) loop_dev: bool,
    /// The file's name (default `nsN`).
    pub(crate) file_name: Option<&'a str>,
}

fn failure(code: u8, err: anyhow::Error) -> Failure {
    Failure { code, err }
}

/// Whether an rpma FUSE mount is at `dir` (an absolute path).
fn is_rpma_mount(dir: &Path) -> Result<bool, Failure> {
    let mounts = kmount::mounts().map_err(|e| io_failure("reading /proc/mounts".into(), e))?;
    Ok(mounts
        .iter()
        .any(|m| m.dir == dir && m.fstype == kmount::FSTYPE))
}

/// The file's name: one path component.
fn file_name(nsid: u32, given: Option<&str>) -> Result<String, Failure> {
    let n = given.map_or_else(|| format!("ns{nsid}"), str::to_owned);
    if n.is_empty() || n == "." || n == ".." || n.contains(['/', '\0']) || n.len() > 255 {
        return Err(usage(format!(
            "--file-name {n:?}: give one file name (no '/', not . or ..)"
        )));
    }
    Ok(n)
}

enum Event {
    Signal(Signal),
    SessionEnded(std::io::Result<()>),
}

pub(crate) fn mount(g: &Global, a: &MountArgs<'_>) -> Result<(), Failure> {
    let name = file_name(g.nsid, a.file_name)?;
    match std::fs::metadata(a.dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(usage(format!("{}: not a directory", a.dir.display()))),
        Err(e) => return Err(usage(format!("{}: {e}", a.dir.display()))),
    }
    let dir = std::fs::canonicalize(a.dir)
        .map_err(|e| io_failure(format!("resolving {}", a.dir.display()), e))?;
    if is_rpma_mount(&dir)? {
        return Err(usage(format!(
            "{}: an rpma mount is already there (rpma-initiator umount {0})",
            dir.display()
        )));
    }
    // Every thread started from here on inherits the mask: only the signal thread sees them.
    // SIGHUP too: a mount started as a shell's background job gets it when the terminal or
    // the SSH session closes, and its default action killed the process, leaving the mount
    // answering ENOTCONN and the writes not yet fsynced unpersisted.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGTERM);
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGHUP);
    signals
        .thread_block()
        .map_err(|e| io_failure("blocking SIGTERM".into(), e.into()))?;

    // Connect first: a bad target fails before anything is mounted.
    let mut q = g.connection(DEPTH)?.open_queue(0)?;
    let (desc, choice) = {
        let ns = q.namespace(g.nsid)?;
        let d = ns.descriptor().clone();
        check_healthy(&d)?;
        let c = if d.read_only {
            None
        } else {
            Some(ns.method()?)
        };
        (d, c)
    };
    if choice == Some(Choice::VisibleOnly) {
        let fsync = if g.visible_ok {
            "fsync returns 0 for bytes that are only visible (--visible-ok)"
        } else {
            "fsync fails with EIO (--visible-ok accepts visible-only)"
        };
        eprintln!(
            "rpma-initiator: warning: namespace {} is volatile: nothing written is durable; \
             {fsync}",
            g.nsid
        );
    }
    let shape = fs::Shape {
        name: name.clone(),
        size: desc.size,
        block_size: desc.block_size,
        read_only: desc.read_only,
    };
    let (jobs, worker) = io::spawn(q, g.nsid, desc.read_only, g.visible_ok)
        .map_err(|e| io_failure("starting the I/O thread".into(), e))?;
    let fs = fs::RpmaFs::new(shape, jobs);

    let source = format!("rpma:{}:{}", g.nqn.as_deref().unwrap_or("?"), g.nsid);
    let fd = kmount::mount(&dir, &source, desc.read_only).map_err(|e| {
        let hint = if e.raw_os_error() == Some(libc::EPERM) {
            " (mounting needs root: CAP_SYS_ADMIN)"
        } else {
            ""
        };
        io_failure(format!("mounting FUSE on {}{hint}", dir.display()), e)
    })?;
    let session =
        match fuser::Session::from_fd(fs, fd, fuser::SessionACL::Owner, fuser::Config::default()) {
            Ok(s) => s,
            Err(e) => {
                let _ = kmount::unmount(&dir, true);
                return Err(io_failure("the FUSE handshake".into(), e));
            }
        };

    let (tx, events) = mpsc::channel();
    let session_tx = tx.clone();
    let session = std::thread::Builder::new()
        .name("rpma-fuse".into())
        .spawn(move || {
            let r = session.run();
            let _ = session_tx.send(Event::SessionEnded(r));
        })
        .map_err(|e| io_failure("starting the FUSE session".into(), e))?;
    std::thread::Builder::new()
        .name("rpma-signals".into())
        .spawn(move || {
            while let Ok(sig) = signals.wait() {
                if tx.send(Event::Signal(sig)).is_err() {
                    break;
                }
            }
        })
        .map_err(|e| io_failure("starting the signal thread".into(), e))?;

    let file = dir.join(&name);
    let mut lo = None;
    if a.loop_dev {
        match loopdev::attach(&file, desc.block_size, desc.read_only) {
            Ok(l) => lo = Some(l),
            Err(e) => {
                // Nothing else holds the file yet: the unmount ends the session.
                let _ = kmount::unmount(&dir, false).or_else(|_| kmount::unmount(&dir, true));
                let _ = session.join();
                let _ = worker.join();
                return Err(io_failure(
                    format!("attaching a loop device to {}", file.display()),
                    e,
                ));
            }
        }
    }
    ready(g, &file, lo.as_ref())?;

    let ended = loop {
        match events.recv() {
            Ok(Event::Signal(sig)) => {
                log::info!("{sig}: detaching and unmounting {}", dir.display());
                stop(&dir);
            }
            Ok(Event::SessionEnded(r)) => break r,
            Err(_) => break Ok(()),
        }
    };
    let _ = session.join();
    let summary = worker
        .join()
        .map_err(|_| failure(1, anyhow::anyhow!("the I/O thread panicked")))?;
    if let Err(e) = ended {
        log::warn!("the FUSE session ended with: {e}");
    }
    match summary.final_persist {
        Ok(d) => {
            log::info!(
                "{} unmounted after {} writes; disconnected",
                dir.display(),
                summary.writes
            );
            // Writes on a volatile namespace, synced or not: visible, not durable (exit 7, as
            // the other commands, unless --visible-ok; it exited 0).
            let d = match d {
                Some(d) => d,
                None if choice == Some(Choice::VisibleOnly) && summary.written => {
                    rpma_initiator::Durability::VisibleOnly
                }
                None => return Ok(()),
            };
            crate::cli::require_durable(g, d)
        }
        Err(e) => Err(failure(
            1,
            anyhow::Error::new(e).context("the last writes could not be made durable"),
        )),
    }
}

/// Prints the file (and loop device) once they can be used: the paths on stdout, one a line
/// (or one JSON object), for a script or a unit to read.
fn ready(g: &Global, file: &Path, lo: Option<&loopdev::LoopDev>) -> Result<(), Failure> {
    if g.json {
        #[derive(Serialize)]
        struct Out {
            file: PathBuf,
            #[serde(rename = "loop")]
            loop_dev: Option<PathBuf>,
            direct_io: Option<bool>,
        }
        print_json(&Out {
            file: file.to_owned(),
            loop_dev: lo.map(|l| l.path.clone()),
            direct_io: lo.map(|l| l.direct_io),
        })?;
    } else {
        println!("{}", file.display());
        if let Some(l) = lo {
            println!("{}", l.path.display());
            if !l.direct_io {
                eprintln!(
                    "rpma-initiator: warning: {} does buffered I/O on the file (the kernel \
                     refused direct I/O)",
                    l.path.display()
                );
            }
        }
    }
    let _ = std::io::stdout().flush();
    Ok(())
}

/// On SIGTERM/SIGINT: detach the loop devices over the file, unmount. A loop device still in use (a
/// filesystem on it is mounted) is set to detach itself when that filesystem is unmounted, and
/// the FUSE unmount is then lazy: the mount leaves the namespace now and the session ends (with
/// its final persist) once the last user of the file is gone.
fn stop(dir: &Path) {
    // Ours and any an operator attached by hand: all of them hold the file open.
    for dev in loopdev::backed_under(dir) {
        match loopdev::detach(&dev) {
            Ok(()) => log::info!("detached {}", dev.display()),
            Err(loopdev::DetachError::Busy(p)) => {
                log::warn!(
                    "{} is in use: it detaches itself once the filesystem on it is \
                     unmounted; serving until then",
                    p.display()
                );
                if let Err(e) = loopdev::detach_deferred(&p) {
                    log::error!("setting {} to detach itself: {e}", p.display());
                }
            }
            Err(e) => log::error!("{e}"),
        }
    }
    match kmount::unmount(dir, false) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            log::warn!(
                "{} is busy: unmounted lazily, serving its open files until they are closed",
                dir.display()
            );
            if let Err(e) = kmount::unmount(dir, true) {
                log::error!("unmounting {}: {e}", dir.display());
            }
        }
        // Already unmounted (umount raced us): the session is ending anyway.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
        Err(e) => log::error!("unmounting {}: {e}", dir.display()),
    }
}

/// How long `umount` waits for a busy loop device to be released before it refuses: a
/// filesystem on it unmounted just before may release it a moment after its own `umount`.
const DETACH_SETTLE: std::time::Duration = std::time::Duration::from_secs(2);

/// How long `umount` waits, once it detached loop devices, for the kernel to let go of the file
/// (a detached device's file is released by a worker, after the detach returned).
const RELEASE_SETTLE: std::time::Duration = std::time::Duration::from_secs(10);

/// Test hook (never set in production): [`RELEASE_SETTLE`] in milliseconds, so that a test
/// that holds the file open until umount says it waits needs no margin against the machine's
/// load.
const TEST_RELEASE_SETTLE_ENV: &str = "RPMA_INITIATOR_TEST_RELEASE_SETTLE_MS";

/// Unmounts `dir`; after loop devices were detached from its file (`detached`), an EBUSY (the
/// file still open) is tried again for up to [`RELEASE_SETTLE`], saying so once.
fn unmount_released(dir: &Path, detached: bool) -> std::io::Result<()> {
    let settle = std::env::var(TEST_RELEASE_SETTLE_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(RELEASE_SETTLE, std::time::Duration::from_millis);
    let until = std::time::Instant::now() + settle;
    let mut said = false;
    loop {
        match kmount::unmount(dir, false) {
            Err(e)
                if detached
                    && e.raw_os_error() == Some(libc::EBUSY)
                    && std::time::Instant::now() < until =>
            {
                if !said {
                    eprintln!(
                        "rpma-initiator: waiting up to {} s for the file under {} to be \
                         released (the kernel lets go of a detached loop device's file a \
                         moment later; or something else has it open)",
                        settle.as_secs(),
                        dir.display()
                    );
                    said = true;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            r => return r,
        }
    }
}

/// `rpma-initiator umount DIR`: detaches the loop devices over the file, then unmounts. The
/// mount process then persists, disconnects and exits 0.
pub(crate) fn umount(g: &Global, dir: &Path) -> Result<(), Failure> {
    let dir = kmount::absolute(dir).map_err(|e| usage(format!("{}: {e}", dir.display())))?;
    if !is_rpma_mount(&dir)? {
        return Err(failure(
            1,
            anyhow::anyhow!("{}: no rpma FUSE mount there", dir.display()),
        ));
    }
    let mut detached = Vec::new();
    for dev in loopdev::backed_under(&dir) {
        loopdev::detach_settled(&dev, DETACH_SETTLE).map_err(|e| failure(1, e.into()))?;
        detached.push(dev);
    }
    unmount_released(&dir, !detached.is_empty()).map_err(|e| {
        let hint = if e.raw_os_error() == Some(libc::EBUSY) {
            " (the file is open: close it, or `umount -l` and the mount process ends when it is closed)"
        } else {
            ""
        };
        io_failure(format!("unmounting {}{hint}", dir.display()), e)
    })?;
    if g.json {
        #[derive(Serialize)]
        struct Out {
            unmounted: PathBuf,
            detached: Vec<PathBuf>,
        }
        return print_json(&Out {
            unmounted: dir,
            detached,
        });
    }
    for d in &detached {
        println!("detached {}", d.display());
    }
    println!("unmounted {}", dir.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_are_one_component() {
        assert_eq!(file_name(3, None).ok(), Some("ns3".to_owned()));
        assert_eq!(file_name(1, Some("disk")).ok(), Some("disk".to_owned()));
        for bad in ["", ".", "..", "a/b", "x\0"] {
            assert_eq!(
                file_name(1, Some(bad)).err().map(|f| f.code),
                Some(2),
                "{bad:?}"
            );
        }
    }
}
