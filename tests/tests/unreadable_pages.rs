//! A page of a namespace that the kernel cannot give back to the daemon: here its file cut
//! short by another process (the same SIGBUS as a media error under page-cache or poisoned
//! pmem). The daemon must not die at the first Read of that block: the Read fails (never zeros
//! as data), the namespace fails (remembered as a failed write-back is, logged once, refused
//! for durability), and the daemon goes on serving its other namespaces.
//!
//! Over the tcp transport, with CRC (the CRC's own read of the page meets it) and without (the
//! socket's copy fails with EFAULT first), and over NVMe/TCP (the daemon's copy of a Read's
//! data).

use std::path::Path;
use std::time::{Duration, Instant};

use rpma_common::proto::nqn::Nqn;
use rpma_initiator::{Connection, HostIdentity};
use rpma_tests::nvme::{sc, Controller};
use rpma_tests::{conn_args, initiator, text, Target};

const SUB: &str = "nqn.2026-12.io.rpma:unreadable";
const HOST: &str = "nqn.2026-12.io.rpma:unreadable-host";

fn config(dir: &Path, top: &str) -> String {
    let d = dir.display();
    format!(
        "{top}[[subsystem]]\nnqn = \"{SUB}\"\nhosts = [{{ nqn = \"{HOST}\" }}]\n\
         [[subsystem.namespace]]\nnsid = 1\npath = \"{d}/ns1\"\nsize = \"4MiB\"\n\
         [[subsystem.namespace]]\nnsid = 2\npath = \"{d}/ns2\"\nsize = \"4MiB\"\n"
    )
}

fn cli(t: &Target, line: &str) -> (Option<i32>, String) {
    let conn = conn_args(&t.url(), SUB, HOST, None);
    let mut a: Vec<&str> = conn.iter().map(String::as_str).collect();
    a.extend(["--reconnect-timeout", "5"]);
    a.extend(line.split_whitespace());
    let o = initiator(&a);
    (o.status.code(), text(&o))
}

/// `status --json`'s `failed` of namespace `nsid`.
fn failed_of(t: &Target, nsid: u64) -> serde_json::Value {
    t.namespace_status(nsid)["failed"].clone()
}

/// The failure mark on the file itself (`user.rpma.failed`), if any.
fn mark_of(path: &Path) -> Option<String> {
    let p = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut buf = [0u8; 256];
    // SAFETY: both strings are NUL-terminated and live; getxattr writes at most buf.len().
    let n = unsafe {
        libc::getxattr(
            p.as_ptr(),
            c"user.rpma.failed".as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    (n >= 0).then(|| String::from_utf8_lossy(&buf[..n as usize]).into_owned())
}

/// A target (with `top`'s settings) whose two namespaces hold 0x5a throughout, durably.
fn filled(top: &str) -> (tempfile::TempDir, Target) {
    let d = rpma_tests::scratch();
    let t = Target::start(d.path(), &config(d.path(), top));
    for nsid in [1, 2] {
        let (c, all) = cli(
            &t,
            &format!("--nsid {nsid} write --offset 0 --pattern 0x5a --length 4M --durable"),
        );
        assert_eq!(c, Some(0), "{all}");
    }
    (d, t)
}

/// Cuts nsid 1's file to 1 MiB, as another process could.
fn cut_short(dir: &Path) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("ns1"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
}

/// Waits until `cond` holds, or panics with `what` after 30 s.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// After the Read of a cut-off page: the daemon is alive, nsid 1 failed (status, log, the
/// mark on its file) and serves nothing more, nsid 2 serves as before.
fn check_after(t: &Target, dir: &Path) {
    // (`status` answers: the daemon is alive.)
    wait_until("nsid 1 is shown failed", || {
        failed_of(t, 1)
            .as_str()
            .is_some_and(|s| s.contains("load/store"))
    });
    assert!(failed_of(t, 2).is_null(), "{}", failed_of(t, 2));
    let lines = t.log_lines(
        &["namespace 1", "could not be", "truncated"],
        Duration::from_secs(10),
    );
    assert_eq!(lines.len(), 1, "{}", t.log());
    wait_until("the failure is marked on the file", || {
        mark_of(&dir.join("ns1")).is_some_and(|m| m.starts_with("load/store"))
    });
    // Nothing of nsid 1 reads any more, the part still in the file included: a new session
    // lists it unavailable, saying why.
    let (c, all) = cli(t, "read --offset 0 --length 4k --json");
    assert_ne!(c, Some(0), "{all}");
    assert!(
        all.contains("could not read back the page at offset"),
        "{all}"
    );
    let (c, all) = cli(t, "write --offset 0 --pattern 7 --length 4k --durable");
    assert_ne!(c, Some(0), "{all}");
    // nsid 2 reads and writes as before.
    let (c, all) = cli(t, "--nsid 2 read --offset 3M --length 16 --json");
    assert_eq!(c, Some(0), "{all}");
    assert!(all.contains("5a5a5a5a"), "{all}");
    let (c, all) = cli(
        t,
        "--nsid 2 write --offset 0 --pattern 7 --length 64k --durable",
    );
    assert_eq!(c, Some(0), "{all}");
}

fn a_read_of_a_cut_off_page_fails_the_namespace_not_the_daemon(
    top: &str,
) -> (tempfile::TempDir, Target) {
    let (d, t) = filled(top);
    // A session that only holds the namespace: closed once the daemon finds the page (on
    // rdma its NIC could otherwise reach the zeros put in the page's place).
    let idle = Connection::new(
        &t.url(),
        Nqn::new(SUB).unwrap(),
        HostIdentity::new(Nqn::new(HOST).unwrap()),
    )
    .open_queue(0)
    .unwrap();
    cut_short(d.path());
    // A Read across the end of what is left: its first half is in the file, its second not.
    let (c, all) = cli(&t, "read --offset 768k --length 512k --json");
    assert_ne!(c, Some(0), "the Read succeeded: {all}");
    // What it printed of the first half is the data; the zeros put in the place of the pages
    // cut off never leave the daemon.
    assert!(!all.contains("00000000"), "{all}");
    check_after(&t, d.path());
    let closed = t.log_lines(
        &["could not be read back: closing"],
        Duration::from_secs(30),
    );
    assert!(!closed.is_empty(), "{}", t.log());
    // Counted as a failed namespace's, not as a reload's (there was none).
    wait_until("the closed session is counted", || {
        t.status()["metrics"]["sessions_ended"]["namespace_failed"].as_u64() >= Some(1)
    });
    let ended = &t.status()["metrics"]["sessions_ended"];
    assert_eq!(ended["reload"], 0, "{ended}");
    drop(idle);
    (d, t)
}

#[test]
fn a_read_of_a_cut_off_page_fails_the_namespace_not_the_daemon_with_crc() {
    let (_d, t) = a_read_of_a_cut_off_page_fails_the_namespace_not_the_daemon("");
    // The operator gives the file its size back and clears the failure: what was cut off
    // reads as the zeros it is now, the rest as before, and durability is back.
    std::fs::OpenOptions::new()
        .write(true)
        .open(t.dir().join("ns1"))
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    let (c, all) = t.clear_failure(SUB, 1);
    assert_eq!(c, Some(0), "{all}");
    assert!(failed_of(&t, 1).is_null(), "{}", failed_of(&t, 1));
    let (c, all) = cli(&t, "read --offset 1020k --length 8k --json");
    assert_eq!(c, Some(0), "{all}");
    let hex = format!("{}{}", "5a".repeat(4096), "00".repeat(4096));
    assert!(all.contains(&hex), "{all}");
    let (c, all) = cli(&t, "write --offset 2M --pattern 7 --length 64k --durable");
    assert_eq!(c, Some(0), "{all}");
}

#[test]
fn a_read_of_a_cut_off_page_fails_the_namespace_not_the_daemon_without_crc() {
    a_read_of_a_cut_off_page_fails_the_namespace_not_the_daemon("crc = false\n");
}

/// A restart with nsid 1's file still cut short, its failure found under the running daemon
/// and remembered (by the mark on the file; with a state file, there too): the daemon starts,
/// nsid 1 opens failed (shown, logged once, listed unavailable) and nsid 2 serves; a reload
/// goes through. Once the file has its size back, clear-failure serves nsid 1 again. (The
/// start was refused, every namespace down, and so was every reload, until the file had its
/// size back.)
#[test]
fn a_restart_with_a_file_still_cut_short_serves_the_other_namespaces() {
    for top in ["", "state_file = \"state\"\n"] {
        let (_d, mut t) = a_read_of_a_cut_off_page_fails_the_namespace_not_the_daemon(top);
        t.restart();
        assert!(
            failed_of(&t, 1)
                .as_str()
                .is_some_and(|s| s.contains("load/store")),
            "{top:?}: {}",
            failed_of(&t, 1)
        );
        assert!(failed_of(&t, 2).is_null(), "{}", failed_of(&t, 2));
        let lines = t.log_lines(
            &["namespace 1", "opened FAILED", "shorter than its size"],
            Duration::from_secs(10),
        );
        assert_eq!(lines.len(), 1, "{}", t.log());
        // The unit's ExecStartPre (check-config) lets it start too (it refused the file).
        let o = rpma_tests::check_config(&t.dir().join("target.toml"));
        assert!(o.status.success(), "{}", text(&o));
        assert!(text(&o).contains("opens FAILED as it is"), "{}", text(&o));
        let (c, all) = cli(&t, "read --offset 0 --length 4k --json");
        assert_ne!(c, Some(0), "{all}");
        let (c, all) = cli(&t, "--nsid 2 read --offset 3M --length 16 --json");
        assert_eq!(c, Some(0), "{all}");
        assert!(all.contains("5a5a5a5a"), "{all}");
        t.reload();
        assert!(failed_of(&t, 1).is_string());
        let (c, all) = cli(
            &t,
            "--nsid 2 write --offset 0 --pattern 7 --length 64k --durable",
        );
        assert_eq!(c, Some(0), "{all}");
        // Cleared only once the file has its size back.
        let (c, all) = t.clear_failure(SUB, 1);
        assert_ne!(c, Some(0), "{all}");
        std::fs::OpenOptions::new()
            .write(true)
            .open(t.dir().join("ns1"))
            .unwrap()
            .set_len(4 << 20)
            .unwrap();
        let (c, all) = t.clear_failure(SUB, 1);
        assert_eq!(c, Some(0), "{all}");
        let (c, all) = cli(&t, "read --offset 1020k --length 8k --json");
        assert_eq!(c, Some(0), "{all}");
        let hex = format!("{}{}", "5a".repeat(4096), "00".repeat(4096));
        assert!(all.contains(&hex), "{all}");
    }
}

/// The same file moved, the configuration edited to its new path, on a filesystem that keeps no
/// mark on it (here: its mark taken off): the daemon finds its failure in the state file by its
/// device and inode, and the unit's ExecStartPre (check-config) lets it start too. (check-config
/// matched the state file by path only: "would refuse", and the daemon did not start at all.)
#[test]
fn check_config_finds_a_moved_failed_file_by_its_device_and_inode() {
    let (d, mut t) = a_read_of_a_cut_off_page_fails_the_namespace_not_the_daemon("");
    t.kill9();
    let (old, moved) = (d.path().join("ns1"), d.path().join("ns1.moved"));
    std::fs::rename(&old, &moved).unwrap();
    let p = std::ffi::CString::new(moved.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: both strings are NUL-terminated and live.
    let r = unsafe { libc::removexattr(p.as_ptr(), c"user.rpma.failed".as_ptr()) };
    assert_eq!(r, 0, "removexattr: {}", std::io::Error::last_os_error());
    assert!(mark_of(&moved).is_none());
    let edited = std::fs::read_to_string(t.dir().join("target.toml"))
        .unwrap()
        .replace(
            &format!("{}\"", old.display()),
            &format!("{}\"", moved.display()),
        );
    assert!(edited.contains("ns1.moved"), "{edited}");
    std::fs::write(t.dir().join("target.toml"), &edited).unwrap();
    let o = rpma_tests::check_config(&t.dir().join("target.toml"));
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("opens FAILED as it is"), "{}", text(&o));
    assert!(text(&o).contains("FAILED since"), "{}", text(&o));
    t.start_again();
    assert!(
        failed_of(&t, 1)
            .as_str()
            .is_some_and(|s| s.contains("load/store")),
        "{}",
        failed_of(&t, 1)
    );
}

/// A Write placed past the end of a file cut short (page-cache places a range's first Write
/// after a sync with `pwrite`) grows it back, with zeros between, and no page ever faults:
/// that durable write must not be answered durable, and the zeros must not be served. (The
/// daemon's own check every second may fail the namespace before the write arrives; the
/// syncs' own checks are map.rs's a_sync_over_a_file_cut_short_is_not_durable.)
#[test]
fn a_durable_write_past_the_end_of_a_file_cut_short_is_not_durable() {
    // (APM is not offered on page-cache over tcp.)
    for persist in ["gpspm", "flush"] {
        let (d, t) = filled("");
        cut_short(d.path());
        let (c, all) = cli(
            &t,
            &format!("write --offset 3M --pattern 7 --length 4k --durable --persist {persist}"),
        );
        assert_ne!(c, Some(0), "{persist}: answered durable: {all}");
        // Refused by the sync's own check, or, when the daemon's check every second found the
        // file short first, listed unavailable to this new session.
        assert!(
            all.contains("has FAILED") || all.contains("could not read back"),
            "{persist}: {all}"
        );
        check_after(&t, d.path());
    }
}

#[test]
fn an_atomic_on_a_cut_off_page_fails_and_answers_no_zeros() {
    let (d, t) = filled("");
    let mut q = Connection::new(
        &t.url(),
        Nqn::new(SUB).unwrap(),
        HostIdentity::new(Nqn::new(HOST).unwrap()),
    )
    .open_queue(0)
    .unwrap();
    let mut ns = q.namespace(1).unwrap();
    assert_eq!(ns.fetch_add(0, 1).unwrap(), 0x5a5a_5a5a_5a5a_5a5a);
    cut_short(d.path());
    // The atomic is the first touch of the page: its original value would be the zeros put
    // in the page's place.
    let r = ns.fetch_add(2 << 20, 1);
    assert!(r.is_err(), "{r:?}");
    // And none runs on the namespace any more, on the part still in the file either: the
    // queue's new session lists it unavailable.
    let r = q
        .namespace(1)
        .and_then(|mut ns| ns.compare_and_swap(8, 0x5a5a_5a5a_5a5a_5a5a, 1));
    assert!(r.is_err(), "{r:?}");
    check_after(&t, d.path());
}

#[test]
fn an_nvme_read_of_a_cut_off_page_is_an_unrecovered_read_error_not_the_daemons_end() {
    let d = rpma_tests::scratch();
    let t = Target::start_on(d.path(), "nvme-tcp://127.0.0.1", &config(d.path(), ""), &[]);
    let addr = format!("127.0.0.1:{}", t.port());
    let c = Controller::connect(&addr, SUB, HOST, (false, false)).expect("admitted");
    let mut q = c.io_queue(1).expect("an I/O queue");
    let data = rpma_tests::noise(7, 128 << 10);
    for nsid in [1, 2] {
        for slba in (0..1024u64).step_by(32) {
            let w = q.write(nsid, slba, 4096, &data, false).unwrap();
            assert!(w.ok(), "{w:?}");
        }
    }
    cut_short(d.path());
    let r = q.read(1, 0, 4096, 32).unwrap();
    assert!(
        r.ok() && r.data == data,
        "the part still in the file reads: {r:?}"
    );
    // Blocks 256.. (of 4 KiB) are past the end of the file now: 960 KiB to 1088 KiB.
    let r = q.read(1, 240, 4096, 32).unwrap();
    assert_eq!(r.code(), sc::UNRECOVERED_READ, "{r:?}");
    assert!(r.dnr());
    assert!(
        r.data.is_empty(),
        "no data of it was sent: {} bytes",
        r.data.len()
    );
    // From then on the namespace has failed: reads and writes of it are refused, the other
    // namespace serves on the same queue.
    let r = q.read(1, 0, 4096, 1).unwrap();
    assert_eq!(r.code(), sc::UNRECOVERED_READ, "{r:?}");
    // In the command capsule, and by R2T.
    for len in [4096, data.len()] {
        let w = q.write(1, 0, 4096, &data[..len], false).unwrap();
        assert_eq!(w.code(), sc::WRITE_FAULT, "{len}: {w:?}");
    }
    let r = q.read(2, 768, 4096, 32).unwrap();
    assert!(r.ok() && r.data == data, "nsid 2: {r:?}");
    wait_until("nsid 1 is shown failed", || {
        failed_of(&t, 1)
            .as_str()
            .is_some_and(|s| s.contains("load/store"))
    });
    assert!(failed_of(&t, 2).is_null());
    wait_until("the failure is marked on the file", || {
        mark_of(&d.path().join("ns1")).is_some_and(|m| m.starts_with("load/store"))
    });
    assert_eq!(
        t.log_lines(&["namespace 1", "truncated"], Duration::from_secs(10))
            .len(),
        1,
        "{}",
        t.log()
    );
}
