//! A write-back error on a real filesystem: ext4 on a loop device whose backing file lies on a
//! small tmpfs filled to 100%. Linux reports the error to the first fdatasync/msync of the file
//! and then marks the pages clean, so a second sync "succeeds" over data that never reached the
//! disk. The namespace must fail instead: every later durability request, from any host and by
//! any method, is refused, the daemon logs it once with the errno, and `status` shows it.
//! It stays failed across reloads and restarts (SIGKILL included: the state file remembers it),
//! each reopening drops the file's page cache so that hosts read what the media holds (checked
//! against the media after an unmount and a mount), and only an operator's `rpma-target
//! clear-failure` makes it durable again, saying what may have been lost.
//!
//! Needs root, loop devices and mkfs.ext4; without them it says why and skips.

use rpma_common::proto::nqn::Nqn;
use rpma_initiator::{Connection, HostIdentity};
use rpma_tests::fragile_fs::FragileFs;
use rpma_tests::{conn_args, initiator, text, Target};

use rpma_common::pmem::{Mapping, OpenOptions, Persist};
use rpma_common::proto::FlushStatus;
use rpma_target::flusher::{FlushTarget, Flusher};

const SUB: &str = "nqn.2026-11.io.rpma:failed-ns";
const HOST: &str = "nqn.2026-11.io.rpma:failed-ns-host";
const HOST2: &str = "nqn.2026-11.io.rpma:failed-ns-other";

fn cli(t: &Target, host: &str, line: &str) -> (Option<i32>, String) {
    let conn = conn_args(&t.url(), SUB, host, None);
    let mut a: Vec<&str> = conn.iter().map(String::as_str).collect();
    a.extend(["--reconnect-timeout", "5"]);
    a.extend(line.split_whitespace());
    let o = initiator(&a);
    (o.status.code(), text(&o))
}

fn ns_status(t: &Target, nsid: u64) -> serde_json::Value {
    t.namespace_status(nsid)
}

fn failed_of(t: &Target, nsid: u64) -> serde_json::Value {
    ns_status(t, nsid)["failed"].clone()
}

/// `rpma-target clear-failure SUB NSID` through the target's control socket.
fn clear_failure(t: &Target, nsid: u32) -> (Option<i32>, String) {
    t.clear_failure(SUB, nsid)
}

/// Where `served` and `media` differ, for a failure message.
fn first_difference(served: &[u8], media: &[u8]) -> String {
    let n = served.iter().zip(media).filter(|(a, b)| a != b).count();
    match served.iter().zip(media).position(|(a, b)| a != b) {
        None if served.len() == media.len() => "none".into(),
        None => format!("lengths {} and {}", served.len(), media.len()),
        Some(i) => format!(
            "{n} bytes differ, the first at {i}: served {:#04x}, media {:#04x}",
            served[i], media[i]
        ),
    }
}

#[test]
fn a_writeback_error_fails_the_namespace_for_every_host_until_an_operator_clears_it() {
    let d = rpma_tests::scratch();
    let Some(fs) = FragileFs::or_skip(d.path()) else {
        return;
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
    // nsid 1 fails through GPSPM (the flush service's fdatasync through io_uring), nsid 2
    // through FLUSH (the placement engine's msync): both report the error, neither says
    // durable. A second connection on the target's one poll loop and a range over 256 KiB keep
    // nsid 1's flush on io_uring: a loop syncs a lone connection's flush, or a short one beside
    // quiet connections, itself, by msync, as nsid 2's (target/src/serve/poll_loop.rs;
    // tests/tests/power_loss.rs tests that path).
    let idle = Connection::new(
        &t.url(),
        Nqn::new(SUB).unwrap(),
        HostIdentity::new(Nqn::new(HOST2).unwrap()),
    )
    .open_queue(0)
    .unwrap();
    let (c, all) = cli(
        &t,
        HOST,
        "write --offset 0 --pattern 0x5a --length 1M --durable",
    );
    drop(idle);
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

    // The operator frees space and reloads: the namespaces are reopened (logged), and stay
    // failed until the operator clears them, which says what may have been lost.
    fs.free();
    t.reload();
    let log = t.log();
    assert_eq!(
        log.matches("reload: reopening subsystem").count(),
        2,
        "{log}"
    );
    assert!(
        failed_of(&t, 1).is_string(),
        "still failed after the reload"
    );
    let (c, all) = cli(&t, HOST2, "flush --offset 0 --length 1M");
    assert_eq!(c, Some(1), "{all}");
    for nsid in [1, 2] {
        let (c, said) = clear_failure(&t, nsid);
        assert_eq!(c, Some(0), "{said}");
        assert!(
            said.contains("may be lost") && said.contains("No space left"),
            "{said}"
        );
    }
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

/// The issue 22 scenario: a durable write, then writes whose write-back fails (GPSPM on nsid 1,
/// FLUSH on nsid 2), space freed, then a reload or a SIGKILL and restart.
fn stays_failed_and_serves_only_the_media(restart: bool) {
    let d = rpma_tests::scratch();
    let Some(fs) = FragileFs::or_skip(d.path()) else {
        return;
    };
    let m = fs.mnt.display();
    let t_dir = d.path().join("target");
    std::fs::create_dir(&t_dir).unwrap();
    let mut t = Target::start(
        &t_dir,
        &format!(
            "[[subsystem]]\nnqn = \"{SUB}\"\nhosts = [{{ nqn = \"{HOST}\" }}]\n\
             [[subsystem.namespace]]\nnsid = 1\npath = \"{m}/ns1\"\nsize = \"8MiB\"\n\
             [[subsystem.namespace]]\nnsid = 2\npath = \"{m}/ns2\"\nsize = \"8MiB\"\n"
        ),
    );
    // Acknowledged as durable before anything failed: must be there whatever follows.
    for (nsid, how) in [(1, "--persist gpspm"), (2, "--persist flush")] {
        let (c, all) = cli(
            &t,
            HOST,
            &format!("--nsid {nsid} {how} write --offset 0 --pattern 0x11 --length 1M --durable"),
        );
        assert_eq!(c, Some(0), "{all}");
    }
    fs.fill();
    for (nsid, how) in [(1, "--persist gpspm"), (2, "--persist flush")] {
        let (c, all) = cli(
            &t,
            HOST,
            &format!("--nsid {nsid} {how} write --offset 2M --pattern 0x22 --length 1M --durable"),
        );
        assert_eq!(c, Some(1), "the write-back fails: {all}");
    }
    fs.free();
    if restart {
        t.restart();
    } else {
        t.reload();
    }

    // Still failed, whatever the method; the status says since when and what to run.
    let mut served = Vec::new();
    for nsid in [1u32, 2] {
        let st = ns_status(&t, u64::from(nsid));
        assert!(
            st["failed"]
                .as_str()
                .is_some_and(|f| f.contains("No space left")),
            "nsid {nsid} after the {}: {st}",
            if restart { "restart" } else { "reload" }
        );
        assert!(st["failed_since"].is_string(), "{st}");
        for how in ["--persist gpspm", "--persist flush"] {
            let (c, all) = cli(
                &t,
                HOST,
                &format!("--nsid {nsid} {how} flush --offset 2M --length 1M"),
            );
            assert_eq!(c, Some(1), "nsid {nsid} {how}: {all}");
            assert!(!all.contains("durable ("), "nsid {nsid} {how}: {all}");
        }
        let out = t_dir.join(format!("served{nsid}"));
        let (c, all) = cli(
            &t,
            HOST,
            &format!(
                "--nsid {nsid} read --offset 0 --length 4M --out {}",
                out.display()
            ),
        );
        assert_eq!(c, Some(0), "{all}");
        let bytes = std::fs::read(&out).unwrap();
        assert!(
            bytes[..1 << 20].iter().all(|&b| b == 0x11),
            "nsid {nsid}: the acknowledged write"
        );
        served.push(bytes);
    }
    let table = text(&rpma_tests::status(&[
        "--socket",
        t_dir.join("ctl.sock").to_str().unwrap(),
    ]));
    assert!(
        table.contains("FAILED since ") && table.contains(&format!("clear-failure {SUB} 1")),
        "{table}"
    );

    // What hosts were served is what the media holds: no byte of the failed writes.
    t.stop_service();
    fs.remount();
    for nsid in [1u32, 2] {
        let media = std::fs::read(fs.mnt.join(format!("ns{nsid}"))).unwrap();
        let media = &media[..4 << 20];
        assert!(
            served[nsid as usize - 1] == media,
            "nsid {nsid}: served after the {} is not what the media holds: {}",
            if restart { "restart" } else { "reload" },
            first_difference(&served[nsid as usize - 1], media)
        );
        assert!(
            !media[2 << 20..3 << 20].contains(&0x22),
            "the failed write reached the media after all: the test proves nothing"
        );
    }

    // Still failed after another restart (check-config says so too); the operator clears
    // nsid 1 only.
    t.restart();
    assert!(failed_of(&t, 1).is_string() && failed_of(&t, 2).is_string());
    let checked = text(&rpma_tests::check_config(&t_dir.join("target.toml")));
    assert!(
        checked.contains("2 failed namespace(s) remembered")
            && checked.contains(&format!(
                "no durability until `rpma-target clear-failure {SUB} 1`"
            )),
        "{checked}"
    );
    let (c, said) = clear_failure(&t, 1);
    assert_eq!(c, Some(0), "{said}");
    // nsid 1's GPSPM flush failed in the flush service: by the worker's fdatasync, or by the
    // loop's own msync when the CLI's connection was the loop's only one (target/src/flusher.rs).
    assert!(
        said.contains("may be lost")
            && (said.contains("fdatasync failed: No space left")
                || said.contains("msync failed: No space left")),
        "{said}"
    );
    let lines = t.log_lines(
        &[
            "WARN",
            "clear-failure (operator",
            "namespace 1",
            "may be lost",
        ],
        std::time::Duration::from_secs(5),
    );
    assert_eq!(lines.len(), 1, "{}", t.log());
    let (c, said) = clear_failure(&t, 1);
    assert_eq!(c, Some(1), "twice: {said}");
    assert!(said.contains("has not failed"), "{said}");
    assert!(failed_of(&t, 1).is_null());
    let (c, all) = cli(
        &t,
        HOST,
        "--nsid 1 write --offset 2M --pattern 0x33 --length 1M --durable",
    );
    assert_eq!(c, Some(0), "durable again: {all}");
    let (c, all) = cli(&t, HOST, "--nsid 2 flush --offset 2M --length 1M");
    assert_eq!(c, Some(1), "nsid 2 was not cleared: {all}");

    // The cleared one stays cleared across a restart; the other stays failed.
    t.stop_service();
    fs.remount();
    let media = std::fs::read(fs.mnt.join("ns1")).unwrap();
    assert!(media[2 << 20..3 << 20].iter().all(|&b| b == 0x33));
    t.restart();
    assert!(failed_of(&t, 1).is_null());
    assert!(failed_of(&t, 2).is_string());
    drop(t);
}

#[test]
fn a_failed_namespace_stays_failed_across_a_reload_and_serves_only_the_media() {
    stays_failed_and_serves_only_the_media(false);
}

#[test]
fn a_failed_namespace_stays_failed_across_a_sigkill_and_restart_and_serves_only_the_media() {
    stays_failed_and_serves_only_the_media(true);
}

// No rdma:: twins: a write-back error needs a page-cache namespace, which the VM lab's
// Soft-RoCE cannot register (docs/rdma.md, "Soft-RoCE and ODP"); the failure handling is the
// target's, the same on both transports.

/// A page-cache mapping of a new 4 MiB file on a [`FragileFs`], its blocks allocated (not
/// written) and the filesystem's metadata on the media: once the tmpfs below is full, a
/// write-back error is then the data's alone, and the filesystem stays as it was (a failed
/// journal would fail every later sync of every file, and prove nothing). None, said why,
/// where the filesystem cannot be built.
fn fragile_mapping(dir: &std::path::Path) -> Option<(FragileFs, std::sync::Arc<Mapping>)> {
    let fs = FragileFs::or_skip(dir)?;
    let m = OpenOptions::new(fs.mnt.join("ns"))
        .size(4 << 20)
        .create(true)
        .open()
        .unwrap();
    assert_eq!(m.domain(), rpma_common::pmem::Domain::PageCache);
    let f = std::fs::File::open(fs.mnt.join("ns")).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // SAFETY: syncfs only reads the descriptor.
    let rc = unsafe { libc::syncfs(fd) };
    assert_eq!(rc, 0);
    Some((fs, std::sync::Arc::new(m)))
}

/// Waits until a sync of `fl` completed (its completion waits to be reaped: the poll loop's
/// turn).
fn until_completed(fl: &Flusher) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        use nix::poll::{poll, PollFd, PollFlags};
        let mut fds = [PollFd::new(fl.wait_fd(), PollFlags::POLLIN)];
        if poll(&mut fds, 10u8).unwrap() > 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a sync never completed"
        );
    }
}

/// The flush service's fdatasync and the placement engine's msync of one file each hear of a
/// write-back error themselves: the kernel reports one to each open file once, and the flush
/// service's descriptor is an open file of its own. (It was a dup of the mapping's, one open
/// file: its fdatasync took the report, and an msync in the moment before the poll loop reaped
/// that fdatasync's failure returned 0, and the FLUSH it served said durable.)
#[test]
fn the_flush_service_and_the_mapping_each_hear_of_a_writeback_error() {
    let d = rpma_tests::scratch();
    let Some((fs, m)) = fragile_mapping(d.path()) else {
        return;
    };
    let t = FlushTarget::for_mapping(&m, 1).unwrap();
    let mut fl = Flusher::new(4, 0).unwrap();
    fs.fill();
    m.write_at(0, &vec![0x5a; 1 << 20]).unwrap();
    fl.submit(1, &t, 0, 0).unwrap();
    until_completed(&fl);
    let r = m.persist(0, 4096);
    assert!(
        r.is_err(),
        "a FLUSH's msync said {r:?} after the write-back error"
    );
    let mut out = Vec::new();
    fl.drain(&mut out);
    assert_eq!(out.len(), 1);
    assert_ne!(out[0].status, FlushStatus::Durable, "{out:?}");
}

/// Every flush service of a daemon with poll_loops 3 and both kinds of listener (six: three
/// native loops, three nvme-tcp loops) syncs one namespace at the moment of a write-back error:
/// each hears of it, whichever reaps its sync first. (Two loops shared one open file of it,
/// from the fifth loop on: the first's fdatasync took the report, and the other loop answered
/// its own 0 durable before the first had reaped and recorded the failure.)
#[test]
fn every_flush_service_hears_of_a_writeback_error() {
    let d = rpma_tests::scratch();
    let Some((fs, m)) = fragile_mapping(d.path()) else {
        return;
    };
    const SERVICES: usize = 6;
    let t = FlushTarget::for_mapping(&m, SERVICES).unwrap();
    assert_eq!(t.open_files(), SERVICES);
    let mut loops: Vec<Flusher> = (0..SERVICES).map(|i| Flusher::new(4, i).unwrap()).collect();
    fs.fill();
    m.write_at(0, &vec![0x5a; 1 << 20]).unwrap();
    for (i, fl) in loops.iter_mut().enumerate() {
        fl.submit(i as u64, &t, 0, 0).unwrap();
        until_completed(fl);
    }
    // The later loops reap first.
    let mut out = Vec::new();
    for fl in loops.iter_mut().rev() {
        fl.drain(&mut out);
    }
    assert_eq!(out.len(), SERVICES);
    assert!(
        out.iter().all(|c| c.status != FlushStatus::Durable),
        "a sync said durable after the write-back error: {out:?}"
    );
}

/// A failed namespace's file moved to another path, and the configuration edited to name it
/// there, is still the failed namespace: after the reload and after a restart (the state file
/// knows the file by its device and inode too). (It opened healthy under its new path: hosts
/// read the lost bytes still in its page cache, and a flush answered Durable.)
/// A configuration serving nsid 1 at `name` on `fs` to HOST, after the top-level lines `top`.
fn fragile_config(fs: &FragileFs, top: &str, name: &str) -> String {
    let m = fs.mnt.display();
    format!(
        "{top}[[subsystem]]\nnqn = \"{SUB}\"\nhosts = [{{ nqn = \"{HOST}\" }}]\n\
         [[subsystem.namespace]]\nnsid = 1\npath = \"{m}/{name}\"\nsize = \"8MiB\"\n"
    )
}

/// A target on `config` in `d/target` whose nsid 1 has failed: `fs` filled, a durable write
/// refused by the failed write-back (the filesystem stays full).
fn failed_target(d: &std::path::Path, fs: &FragileFs, config: &str) -> Target {
    let t_dir = d.join("target");
    std::fs::create_dir(&t_dir).unwrap();
    let t = Target::start(&t_dir, config);
    fs.fill();
    let (c, all) = cli(
        &t,
        HOST,
        "--nsid 1 --persist gpspm write --offset 2M --pattern 0x22 --length 1M --durable",
    );
    assert_eq!(c, Some(1), "the write-back fails: {all}");
    t
}

#[test]
fn a_failed_namespace_moved_to_another_path_stays_failed() {
    let d = rpma_tests::scratch();
    let Some(fs) = FragileFs::or_skip(d.path()) else {
        return;
    };
    let config = |name: &str| fragile_config(&fs, "", name);
    let mut t = failed_target(d.path(), &fs, &config("ns1"));
    fs.free();
    std::fs::rename(fs.mnt.join("ns1"), fs.mnt.join("moved")).unwrap();
    t.rewrite(&config("moved"));
    t.reload();
    assert!(
        failed_of(&t, 1).is_string(),
        "after the reload: {}",
        ns_status(&t, 1)
    );
    let (c, all) = cli(
        &t,
        HOST,
        "--nsid 1 --persist gpspm flush --offset 2M --length 1M",
    );
    assert_eq!(c, Some(1), "a flush after the move: {all}");
    t.restart();
    assert!(
        failed_of(&t, 1).is_string(),
        "after a restart: {}",
        ns_status(&t, 1)
    );
    drop(t);
}

/// The file's own failure mark (`user.rpma.failed`) remembers a failure that the state file in
/// use never saw: restarted with another `state_file` (as the daemon's own message suggests
/// when its state file's filesystem fails), the namespace comes back failed, and clear-failure
/// removes the mark, so that a third state file finds it healthy. (The new state file forgot
/// the failure: the namespace came back healthy, and a flush of the range the failed
/// write-back lost was answered durable.)
#[test]
fn a_failure_survives_a_restart_with_another_state_file() {
    let d = rpma_tests::scratch();
    let Some(fs) = FragileFs::or_skip(d.path()) else {
        return;
    };
    let config = |state: &str| fragile_config(&fs, &format!("state_file = \"{state}\"\n"), "ns1");
    let mut t = failed_target(d.path(), &fs, &config("first.state"));
    fs.free();
    t.rewrite(&config("second.state"));
    t.restart();
    assert!(
        failed_of(&t, 1).is_string(),
        "after a restart with another state file: {}",
        ns_status(&t, 1)
    );
    let (c, all) = cli(
        &t,
        HOST,
        "--nsid 1 --persist gpspm flush --offset 2M --length 1M",
    );
    assert_eq!(c, Some(1), "a flush of the lost range: {all}");
    let (c, all) = clear_failure(&t, 1);
    assert_eq!(c, Some(0), "{all}");
    t.rewrite(&config("third.state"));
    t.restart();
    assert!(
        failed_of(&t, 1).is_null(),
        "cleared, under a third state file: {}",
        ns_status(&t, 1)
    );
    let (c, all) = cli(
        &t,
        HOST,
        "--nsid 1 --persist gpspm flush --offset 2M --length 1M",
    );
    assert_eq!(c, Some(0), "a flush after the clear: {all}");
    drop(t);
}

/// clear-failure while the cause is still there: the old opening's write-back (of what was
/// written to the file since the failure) fails again, and the clear is refused, the namespace
/// still failed, its state file untouched (the first failure and its time stand); once the
/// cause is gone the clear succeeds. (A new opening does not hear of a write-back error from
/// before it was opened, so the clear succeeded and the bytes that write-back lost were then
/// served and synced as if they were on the media. Then the refused clear still took the
/// failure out of the state file before it wrote the new one in, where a state file that could
/// not take the second write forgot the namespace had failed.)
#[test]
fn clear_failure_is_refused_while_the_write_back_still_fails() {
    use std::os::unix::fs::FileExt;
    let d = rpma_tests::scratch();
    let Some(fs) = FragileFs::or_skip(d.path()) else {
        return;
    };
    let t = failed_target(d.path(), &fs, &fragile_config(&fs, "", "ns1"));
    // Written since (another writer of the file), while the filesystem still fails.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(fs.mnt.join("ns1"))
        .unwrap();
    f.write_all_at(&[0x33; 1 << 20], 4 << 20).unwrap();
    let state = t.dir().join("rpma-target.state");
    let remembered = std::fs::read(&state).unwrap();
    assert!(
        String::from_utf8_lossy(&remembered).contains("\"nsid\":1"),
        "the state file lists the failure"
    );
    let (c, all) = clear_failure(&t, 1);
    assert_eq!(c, Some(1), "cleared while the write-back fails: {all}");
    assert!(all.contains("failed again"), "{all}");
    assert!(failed_of(&t, 1).is_string(), "{}", ns_status(&t, 1));
    assert!(
        std::fs::read(&state).unwrap() == remembered,
        "the refused clear rewrote the state file"
    );
    fs.free();
    let (c, all) = clear_failure(&t, 1);
    assert_eq!(c, Some(0), "{all}");
    assert!(failed_of(&t, 1).is_null(), "{}", ns_status(&t, 1));
    drop(t);
}

/// Writes 1 MiB to nsid 1 (on `fs`) through `t`, placed and not durable (dirty pages only the
/// page cache holds), fills `fs` and SIGKILLs `t`; another process's sync then takes the
/// write-back's failure, as the killed daemon's would have; then frees `fs` again (syncs succeed
/// from now on, and the filesystem stays writable).
fn killed_with_the_write_back_of_ns1_failing(fs: &FragileFs, t: &mut Target) {
    {
        let mut q = Connection::new(
            &t.url(),
            Nqn::new(SUB).unwrap(),
            HostIdentity::new(Nqn::new(HOST).unwrap()),
        )
        .open_queue(0)
        .unwrap();
        let mut ns = q.namespace(1).unwrap();
        ns.write_at(0, &[0x5a; 1 << 20]).unwrap();
        ns.place_writes().unwrap();
    }
    fs.fill();
    t.kill9();
    let synced = std::fs::File::open(fs.mnt.join("ns1")).unwrap().sync_data();
    assert!(synced.is_err(), "the write-back fails: {synced:?}");
    fs.free();
}

/// A write-back error whose one report a sync the daemon did not live to record took (it was
/// killed while its sync ran: the kernel finishes the sync, and the process is gone; here
/// another process's sync after the SIGKILL plays that part): the next start hears of it
/// through the description of the file the daemon kept in its service manager's descriptor
/// store, and nsid 1 comes back failed; nsid 2, on another filesystem, healthy. After an operator's clear-failure a restart does not hear it again. (It came back
/// healthy: no description opened by the new run hears of the error, and a retried flush of
/// those pages was answered durable.)
#[test]
fn a_writeback_error_a_killed_daemons_sync_took_is_heard_at_the_next_start() {
    let d = rpma_tests::scratch();
    let Some(fs) = FragileFs::or_skip(d.path()) else {
        return;
    };
    let m = fs.mnt.display();
    let t_dir = d.path().join("target");
    std::fs::create_dir(&t_dir).unwrap();
    let mut t = Target::start(
        &t_dir,
        &format!(
            "[[subsystem]]\nnqn = \"{SUB}\"\nhosts = [{{ nqn = \"{HOST}\" }}]\n\
             [[subsystem.namespace]]\nnsid = 1\npath = \"{m}/ns1\"\nsize = \"8MiB\"\n\
             [[subsystem.namespace]]\nnsid = 2\npath = \"{}/ns2\"\nsize = \"8MiB\"\n",
            t_dir.display()
        ),
    );
    let names = t.fd_store().names();
    assert_eq!(
        names.len(),
        2,
        "one description per page-cache file: {names:?}"
    );
    killed_with_the_write_back_of_ns1_failing(&fs, &mut t);
    t.start_again();
    let failed = failed_of(&t, 1);
    assert!(
        failed.as_str().is_some_and(|f| f.contains("fdatasync")),
        "{}",
        ns_status(&t, 1)
    );
    assert!(failed_of(&t, 2).is_null(), "{}", ns_status(&t, 2));
    // What the media holds is served, not the pages the failed write-back left clean in the
    // page cache.
    let (c, all) = cli(&t, HOST, "read --offset 0 --length 16 --json");
    assert_eq!(c, Some(0), "{all}");
    assert!(
        !all.contains("5a5a5a5a"),
        "the lost bytes are served: {all}"
    );
    let lines = t.log_lines(
        &["namespace 1", "previous run ended before it recorded it"],
        std::time::Duration::from_secs(10),
    );
    assert_eq!(lines.len(), 1, "{}", t.log());
    let (c, all) = cli(
        &t,
        HOST,
        "--nsid 1 --persist gpspm flush --offset 0 --length 1M",
    );
    assert_eq!(c, Some(1), "{all}");
    assert!(all.contains("FAILED"), "{all}");
    // Cleared: a restart does not hear the old report.
    let (c, all) = clear_failure(&t, 1);
    assert_eq!(c, Some(0), "{all}");
    t.restart();
    assert!(failed_of(&t, 1).is_null(), "{}", ns_status(&t, 1));
    let (c, all) = cli(
        &t,
        HOST,
        "--nsid 1 --persist gpspm flush --offset 0 --length 1M",
    );
    assert_eq!(c, Some(0), "{all}");
}

/// The same report heard at a start whose configuration no longer serves the file (its
/// namespace taken out meanwhile): the file is marked failed and remembered, and a reload that
/// serves it again opens it failed. (The report was dropped, and the file added back was served
/// healthy: a retried flush of its lost pages would have been answered durable.)
#[test]
fn a_writeback_error_heard_for_a_file_this_start_does_not_serve_fails_it_when_served_again() {
    for deleted in [false, true] {
        heard_for_a_file_this_start_does_not_serve(deleted);
    }
}

/// [`a_writeback_error_heard_for_a_file_this_start_does_not_serve_fails_it_when_served_again`],
/// the file kept, or `deleted` before the start: then nothing is remembered of it (a record by
/// its inode would fail the next file given that inode number).
fn heard_for_a_file_this_start_does_not_serve(deleted: bool) {
    let d = rpma_tests::scratch();
    let Some(fs) = FragileFs::or_skip(d.path()) else {
        return;
    };
    let m = fs.mnt.display();
    let t_dir = d.path().join("target");
    std::fs::create_dir(&t_dir).unwrap();
    let ns1 = format!("[[subsystem.namespace]]\nnsid = 1\npath = \"{m}/ns1\"\nsize = \"8MiB\"\n");
    let config = |with_ns1: bool| {
        format!(
            "[[subsystem]]\nnqn = \"{SUB}\"\nhosts = [{{ nqn = \"{HOST}\" }}]\n{}\
             [[subsystem.namespace]]\nnsid = 2\npath = \"{}/ns2\"\nsize = \"8MiB\"\n",
            if with_ns1 { ns1.as_str() } else { "" },
            t_dir.display()
        )
    };
    let mut t = Target::start(&t_dir, &config(true));
    assert_eq!(t.fd_store().names().len(), 2);
    killed_with_the_write_back_of_ns1_failing(&fs, &mut t);
    if deleted {
        std::fs::remove_file(fs.mnt.join("ns1")).unwrap();
    }
    // Started without nsid 1: its file's description still comes back from the store.
    t.rewrite(&config(false));
    t.start_again();
    let said = if deleted {
        "deleted and not in this configuration, failed a write-back"
    } else {
        "which this configuration does not serve, FAILED"
    };
    let lines = t.log_lines(&["ns1", said], std::time::Duration::from_secs(10));
    assert_eq!(lines.len(), 1, "{}", t.log());
    if deleted {
        // Nothing remembered: the next start finds no failure in the state file.
        t.kill9();
        t.start_again();
        let log = t.log();
        let starts: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("failed namespace(s) remembered"))
            .collect();
        assert!(
            starts.len() == 3 && starts.iter().all(|l| l.contains(": 0 failed")),
            "{log}"
        );
        return;
    }
    // Served again: failed, saying by what.
    t.rewrite(&config(true));
    t.reload();
    let failed = failed_of(&t, 1);
    assert!(
        failed.as_str().is_some_and(|f| f.contains("fdatasync")),
        "{}",
        ns_status(&t, 1)
    );
    let (c, all) = cli(
        &t,
        HOST,
        "--nsid 1 --persist gpspm flush --offset 0 --length 1M",
    );
    assert_eq!(c, Some(1), "{all}");
    assert!(failed_of(&t, 2).is_null(), "{}", ns_status(&t, 2));
}
