//! The NBD export (`rpma-initiator nbd`) against clients that attack it: connections that hold
//! its slots without using them (from the well-behaved client's own user or address, and from
//! others), that never finish their handshake, that stay idle, and floods of failing or
//! churning clients against its log. A well-behaved third-party client (qemu-io) must get in
//! and work throughout, and the log must stay small and say what it held back.
//!
//! A test whose client is not installed says SKIPPED (scripts/install-deps.sh installs them).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpma_tests::nbd::*;

/// NBD_OPT_EXPORT_NAME.
const OPT_EXPORT_NAME: u32 = 1;

/// A connection that finishes the handshake (NBD_OPT_GO) and then sends nothing.
fn idle_client<S: Read + Write>(mut s: S) -> std::io::Result<S> {
    let mut g = [0u8; 18];
    s.read_exact(&mut g)?;
    s.write_all(&3u32.to_be_bytes())?;
    let mut o = IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&OPT_GO.to_be_bytes());
    o.extend_from_slice(&6u32.to_be_bytes());
    o.extend_from_slice(&[0; 6]); // the default export, no information requests
    s.write_all(&o)?;
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h)?;
        let n = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        std::io::copy(&mut (&mut s).take(n as u64), &mut std::io::sink())?;
        match u32::from_be_bytes(h[12..16].try_into().unwrap()) {
            1 => return Ok(s), // NBD_REP_ACK: in transmission
            3 => {}            // NBD_REP_INFO
            t => return Err(std::io::Error::other(format!("option reply {t:#x}"))),
        }
    }
}

/// Whether the export closed `s` (end of file or an error), without waiting.
fn gone(fd: &impl AsRawFd) -> bool {
    use nix::sys::socket::{recv, MsgFlags};
    let mut b = [0u8; 64];
    loop {
        match recv(fd.as_raw_fd(), &mut b, MsgFlags::MSG_DONTWAIT) {
            Ok(0) => return true,
            Ok(_) => {} // a greeting the holder never read
            Err(nix::errno::Errno::EAGAIN) => return false,
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return true,
        }
    }
}

/// A TCP connection from `src` to 127.0.0.1:`port`, or why not.
fn tcp_from(port: u16, src: Ipv4Addr) -> std::io::Result<TcpStream> {
    use nix::sys::socket::{bind, connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn};
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    bind(fd.as_raw_fd(), &SockaddrIn::from(SocketAddrV4::new(src, 0)))?;
    let to = SockaddrIn::from(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
    connect(fd.as_raw_fd(), &to)?;
    let s = TcpStream::from(fd);
    s.set_read_timeout(Some(WAIT))?;
    Ok(s)
}

/// Attackers holding `per_source` connections from each source `open` makes, alternately
/// idle after their handshake and silent before it, until `stop`: all opened at once, then
/// each one the export closes opened again, one per source every 100 ms (ten a second, six
/// times the attacker of issue 22's F1, who reopened 1.6 a second). `opened` counts the
/// connections made.
///
/// A source that opens connections faster than a client of its own finishes its handshake
/// pushes that client out (each newcomer evicts the oldest of the source's connections that
/// sent no request yet): with the cap of 16, the client has fifteen reopens' time, 1.5 s
/// here, for the handshake qemu-io does in milliseconds. That is the limit docs/mount.md
/// states; the pace is chosen so that a loaded machine stays well inside it.
struct Squatters {
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicUsize>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Squatters {
    fn start<S, F>(sources: usize, per_source: usize, open: F) -> Squatters
    where
        S: Read + Write + AsRawFd + Send + 'static,
        F: Fn(usize) -> std::io::Result<S> + Send + Sync + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicUsize::new(0));
        let open = Arc::new(open);
        let threads = (0..sources)
            .map(|src| {
                let (stop, opened, open) = (stop.clone(), opened.clone(), open.clone());
                std::thread::spawn(move || {
                    let mut held: Vec<S> = Vec::new();
                    let mut n = 0usize;
                    while !stop.load(Ordering::SeqCst) {
                        held.retain(|s| !gone(s));
                        let burst = if n == 0 { per_source } else { 1 };
                        let want = per_source.min(held.len() + burst);
                        while held.len() < want && !stop.load(Ordering::SeqCst) {
                            n += 1;
                            let s = match open(src) {
                                Ok(s) if n.is_multiple_of(2) => idle_client(s),
                                r => r,
                            };
                            match s {
                                Ok(s) => {
                                    held.push(s);
                                    opened.fetch_add(1, Ordering::SeqCst);
                                }
                                Err(_) => break,
                            }
                        }
                        // Pacing only: how often the holder looks for its closed connections.
                        std::thread::sleep(Duration::from_millis(100));
                    }
                })
            })
            .collect();
        Squatters {
            stop,
            opened,
            threads,
        }
    }

    /// Waits until `n` connections were made.
    fn wait_opened(&self, n: usize) {
        let deadline = Instant::now() + WAIT;
        while self.opened.load(Ordering::SeqCst) < n {
            assert!(Instant::now() < deadline, "the attackers could not connect");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            t.join().unwrap();
        }
    }
}

/// qemu-io writes a block with FUA and reads it back through the export; must succeed.
fn qemu_io_works(e: &Export, byte: u8) {
    let o = rpma_tests::run_with_deadline(
        Command::new("qemu-io").args([
            "-f",
            "raw",
            &e.uri(),
            "-c",
            &format!("write -f -P {byte:#x} 65536 4096"),
            "-c",
            &format!("read -P {byte:#x} 65536 4096"),
        ]),
        WAIT,
    );
    let out = rpma_tests::text(&o);
    assert!(
        o.status.success() && !out.contains("verification failed"),
        "qemu-io: {out}\nthe export's log:\n{}",
        e.log()
    );
}

#[test]
fn attackers_of_the_clients_own_user_holding_every_slot_do_not_keep_qemu_io_out() {
    if !have("qemu-io") {
        return;
    }
    let (_d, _shm, t) = start("nbd-squat-unix");
    let e = Export::start(&t, 1, "squat", &[]);
    // 64 connections (the export's whole capacity, four times a source's cap) from this
    // test's user, qemu-io's too: one source.
    let sock = e.sock.clone();
    let sq = Squatters::start(1, 64, move |_| {
        let s = UnixStream::connect(&sock)?;
        s.set_read_timeout(Some(WAIT))?;
        Ok(s)
    });
    sq.wait_opened(64);
    for i in 0..3 {
        qemu_io_works(&e, 0x40 + i);
    }
    sq.stop();
    e.log_line("evicted for a new connection from unix (uid");
    assert_eq!(cli_read(&t, 1, 65536, 4096), vec![0x42; 4096]);
}

#[test]
fn attackers_from_the_clients_own_address_and_from_others_do_not_keep_qemu_io_out() {
    if !have("qemu-io") {
        return;
    }
    let (_d, _shm, t) = start("nbd-squat-tcp");
    let addr = format!("127.0.0.1:{}", rpma_tests::free_port());
    let e = Export::start(&t, 1, "squat", &["--listen", &addr]);
    let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    // 16 connections (its cap) from qemu-io's own address and from each of four others: 80
    // for 64 places.
    let sq = Squatters::start(5, 16, move |src| {
        tcp_from(port, Ipv4Addr::new(127, 0, 0, 1 + src as u8))
    });
    sq.wait_opened(80);
    for i in 0..3 {
        qemu_io_works(&e, 0x50 + i);
    }
    sq.stop();
    e.log_line("evicted for a new connection from 127.0.0.1:");
    assert_eq!(cli_read(&t, 1, 65536, 4096), vec![0x52; 4096]);
}

#[test]
fn unfinished_and_idle_clients_are_closed_at_their_deadlines_and_busy_ones_are_not() {
    let (_d, _shm, t) = start("nbd-deadlines");
    let e = Export::start(
        &t,
        1,
        "deadlines",
        &["--handshake-timeout", "1", "--idle-timeout", "3"],
    );
    // Never starts its handshake.
    let silent = UnixStream::connect(&e.sock).unwrap();
    silent.set_read_timeout(Some(WAIT)).unwrap();
    // Finishes it, then sends nothing.
    let idle = Raw::connect(&e.sock);
    // Works without pause until the idle one is closed.
    let mut busy = Raw::connect(&e.sock);
    let closed = std::thread::spawn(move || {
        let mut idle = idle;
        idle.closed()
    });
    while !closed.is_finished() {
        assert_eq!(busy.read(0, 4096).map(|b| b.len()), Ok(4096));
    }
    assert!(closed.join().unwrap(), "the idle client was closed");
    assert!(Raw(silent).closed(), "the silent client was closed");
    assert_eq!(
        busy.read(4096, 4096).map(|b| b.len()),
        Ok(4096),
        "busy: still served"
    );
    e.log_line("the handshake did not finish within 1s");
    e.log_line("closed: no request for 3 s (--idle-timeout)");
}

/// The numbers in the export's summary lines for `what` ("warning(s)", "session line(s)").
fn summarized(log: &str, what: &str) -> u64 {
    let key = format!(" {what} about ");
    log.lines()
        .filter_map(|l| {
            let at = l.find(&key)?;
            l[..at].rsplit(' ').next()?.parse::<u64>().ok()
        })
        .sum()
}

#[test]
fn a_flood_of_failing_and_churning_clients_writes_a_bounded_log_and_counts_the_rest() {
    const BAD: usize = 3000;
    const CHURN: usize = 500;
    const PERIOD_S: u64 = 2;
    let (_d, _shm, t) = start("nbd-flood");
    let e = Export::start(&t, 1, "flood", &["--log-period", &PERIOD_S.to_string()]);
    let before = e.log().len();
    let started = Instant::now();
    // An export name made to forge a log line of its own.
    let mut r = Raw::hello(&e.sock);
    r.option(
        OPT_EXPORT_NAME,
        b"x\n[2026-12-01T00:00:00Z WARN  forged] injected\r",
    );
    assert!(r.closed());
    // Bad option magic, BAD times; then clients that come and leave, CHURN times.
    for _ in 0..BAD {
        let mut r = Raw::hello(&e.sock);
        r.send(&[0xee; 16]);
        assert!(r.closed());
    }
    for _ in 0..CHURN {
        let mut r = Raw::connect(&e.sock);
        let disc = r.request(CMD_DISC, 0, 1, 0, 0);
        r.send(&disc);
        assert!(r.closed());
    }
    let flood = started.elapsed();
    // Every line is either in the log or counted by a summary, once the summaries are out.
    // (Export::start's probe that the socket accepts is no failed handshake: it sent nothing.)
    let deadline = Instant::now() + WAIT;
    let log = loop {
        let log = e.log();
        let failed = log.matches("handshake failed").count() as u64;
        let sessions = (log.matches("entered transmission").count()
            + log.matches(") closed after").count()) as u64;
        if failed + summarized(&log, "warning(s)") == BAD as u64 + 1
            && sessions + summarized(&log, "session line(s)") == 2 * CHURN as u64
        {
            break log;
        }
        assert!(Instant::now() < deadline, "the counts do not add up: {log}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let added = log.len() - before;
    // A summary has the level of what it held back: the failed handshakes' WARN, the
    // sessions' INFO (clients coming and going are no warning).
    for (what, level) in [
        (" warning(s) about ", " WARN "),
        (" session line(s) about ", " INFO "),
    ] {
        assert!(
            log.lines()
                .filter(|l| l.contains(what))
                .all(|l| l.contains(level)),
            "{what} not at{level}: {log}"
        );
    }
    // Per period at most 5 lines about one source (for warnings and for sessions each) and
    // a summary of each; one more period for the summaries after the flood.
    let periods = flood.as_secs() / PERIOD_S + 2;
    let lines = log.lines().count();
    assert!(
        added as u64 <= periods * 12 * 300,
        "{added} bytes in {lines} lines over {flood:?} for {BAD} failures and {CHURN} sessions"
    );
    assert!(
        added < 64 << 10,
        "{added} bytes for {BAD} failures and {CHURN} sessions"
    );
    println!(
        "nbd flood: {} connections in {flood:?}, {added} bytes of log in {lines} lines",
        BAD + CHURN + 1
    );
    // The forged line is not one.
    assert!(
        !log.lines()
            .any(|l| l.contains("forged") && !l.contains("no export named")),
        "{log}"
    );
    assert!(
        log.contains(r#"no export named "x\n[2026-12-01T00:00:00Z WARN  forged] injected\r""#),
        "{log}"
    );
    assert!(
        log.contains("client source(s) suppressed in the last"),
        "{log}"
    );
}

#[test]
fn a_flood_from_many_addresses_is_capped_in_all() {
    const ADDRS: u8 = 100;
    const EACH: usize = 10;
    const PERIOD_S: u64 = 2;
    let (_d, _shm, t) = start("nbd-flood-many");
    let addr = format!("127.0.0.1:{}", rpma_tests::free_port());
    let e = Export::start(
        &t,
        1,
        "flood",
        &["--listen", &addr, "--log-period", &PERIOD_S.to_string()],
    );
    let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    let before = e.log().len();
    let started = Instant::now();
    for _ in 0..EACH {
        for a in 0..ADDRS {
            let mut s = tcp_from(port, Ipv4Addr::new(127, 0, 1, a + 1)).unwrap();
            let mut g = [0u8; 18];
            s.read_exact(&mut g).unwrap();
            s.write_all(&[0xee; 20]).unwrap();
            let mut b = [0u8; 64];
            while !matches!(s.read(&mut b), Ok(0) | Err(_)) {}
        }
    }
    let flood = started.elapsed();
    // (Export::start's probe that the socket accepts is no failed handshake.)
    let total = ADDRS as u64 * EACH as u64;
    let deadline = Instant::now() + WAIT;
    let log = loop {
        let log = e.log();
        let failed = log.matches("handshake failed").count() as u64;
        if failed + summarized(&log, "warning(s)") == total {
            break log;
        }
        assert!(Instant::now() < deadline, "the counts do not add up: {log}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let failed = log.matches("handshake failed").count() as u64;
    let periods = flood.as_secs() / PERIOD_S + 1;
    assert!(
        failed <= periods * 50,
        "{failed} warnings over {flood:?} from {ADDRS} addresses"
    );
    assert!(log.contains("client source(s) suppressed"), "{log}");
    println!(
        "nbd flood from {ADDRS} addresses: {total} connections in {flood:?}, {failed} warnings, {} bytes of log",
        log.len() - before
    );
}

/// Port probes and health checks (connect, close before a byte) are no failed handshakes: a
/// line at debug level each, no warning (before: "handshake failed: socket error" at WARN,
/// an alarm a minute for a load balancer's check); a client that closes within its flags is
/// still one.
#[test]
fn port_probes_are_not_failed_handshakes() {
    const PROBES: usize = 40;
    let (_d, _shm, t) = start("nbd-probe");
    let e = Export::start_logging(&t, &t.url(), 1, "probe", &[], "debug");
    let probes = |e: &Export| {
        e.log()
            .matches("closed before its handshake (a port probe)")
            .count()
    };
    // One probe at a time, each seen before the next (starting the export probed its socket
    // too): many at once from one source would evict one another, which is said apart.
    for i in 0..PROBES {
        let before = probes(&e);
        drop(UnixStream::connect(&e.sock).unwrap());
        let deadline = Instant::now() + WAIT;
        while probes(&e) == before {
            assert!(Instant::now() < deadline, "probe {i}: {}", e.log());
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    assert_eq!(
        e.log().matches("handshake failed").count(),
        0,
        "{}",
        e.log()
    );
    let mut s = UnixStream::connect(&e.sock).unwrap();
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    s.write_all(&[0, 0]).unwrap();
    drop(s);
    let deadline = Instant::now() + WAIT;
    while e.log().matches("handshake failed").count() != 1 {
        assert!(Instant::now() < deadline, "{}", e.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A client that does not read its replies (its socket full) holds up no other client's FLUSH:
/// while it waits for room, its thread finishes what it started and lets its queue go to the
/// FLUSH that wants it, and the client is still served when it reads at last. (Its thread
/// held the queue while blocked on the socket: B's FLUSH, which must make A's write durable
/// too, waited until A's reply timed out (30 s) and A was closed.)
#[test]
fn a_client_that_does_not_read_its_replies_holds_up_no_other_clients_flush() {
    let (_d, _shm, t) = start("unread");
    let e = Export::start(&t, 1, "unread", &[]);
    let mut a = Raw::connect(&e.sock);
    // A's queue holds a write no FLUSH made durable yet.
    assert_eq!(a.write(0, 0, &[3; 4096]), 0);
    // 32 MiB of READ replies, far more than A's socket holds; A reads none of them yet.
    let mut reads = Vec::new();
    for h in 0..4u64 {
        reads.extend(a.request(CMD_READ, 0, 100 + h, 0, NS1 as u32));
    }
    a.send(&reads);
    // Wait until the replies fill A's socket (the export is writing them).
    let deadline = Instant::now() + WAIT;
    loop {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int through the pointer, which outlives the call.
        let r = unsafe { libc::ioctl(a.0.as_raw_fd(), libc::FIONREAD, &mut n) };
        assert_eq!(r, 0, "FIONREAD: {}", std::io::Error::last_os_error());
        if n > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "no reply reached A");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut b = Raw::connect(&e.sock);
    assert_eq!(b.flush(), 0);
    // A was not given up on: it reads every reply now.
    for h in 0..4u64 {
        assert_eq!(a.reply(), (0, 100 + h));
        let data = a.take(NS1 as usize);
        assert!(data[..4096].iter().all(|&v| v == 3), "READ {h}");
    }
    assert_eq!(a.flush(), 0);
}

/// A target with room for one session only (the export's first queue): its scratch directory,
/// its /dev/shm namespace (tagged `tag`) and the target.
fn one_session_target(tag: &str) -> (tempfile::TempDir, rpma_tests::Shm, rpma_tests::Target) {
    let d = rpma_tests::scratch();
    let shm = rpma_tests::Shm::new(tag);
    let config = rpma_tests::Config::new()
        .set("max_connections = 1")
        .subsystem(
            rpma_tests::Subsystem::new(SUB)
                .any_host()
                .namespaces(rpma_tests::four_namespaces(&shm, 512)),
        );
    let t = rpma_tests::Target::start(d.path(), &config.to_string());
    (d, shm, t)
}

/// A client that enters transmission while every queue is taken and the target has no room
/// for another connection shares a queue at once: one connection attempt, not the reconnect
/// budget's retries. (It waited up to `--reconnect-timeout`, an hour here, before its first
/// request was read, its thread and sockets held all along; evicted meanwhile by the next
/// newcomer, which did the same, such threads piled up.)
#[test]
fn a_newcomer_the_target_has_no_room_for_shares_a_queue_at_once() {
    let (_d, _shm, t) = one_session_target("noroom");
    let e = Export::start(&t, 1, "noroom", &["--reconnect-timeout", "3600"]);
    let mut a = Raw::connect(&e.sock);
    assert_eq!(a.write(0, 0, &[6; 4096]), 0);
    // A holds the one queue; B's would be a second session.
    let mut b = Raw::connect(&e.sock);
    let got = b.read(0, 4096).expect("B's READ");
    assert!(got.iter().all(|&v| v == 6));
    e.log_line("this client shares one");
    assert_eq!(b.flush(), 0);
    assert!(a.read(0, 4096).is_ok());
}

/// The target's sessions the export holds, once `ok` says their count is right.
fn sessions_until(t: &rpma_tests::Target, what: &str, ok: impl Fn(usize) -> bool) -> usize {
    let deadline = Instant::now() + WAIT;
    loop {
        let n = t.status()["sessions"].as_array().unwrap().len();
        if ok(n) {
            return n;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {n} sessions on the target"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A burst of clients leaves at most two spare queues (target sessions) behind once they are
/// gone: each counts against the target's connection budget and the host's. (The export kept
/// every queue it ever opened: after 64 clients at once, 64 sessions for good.) A queue whose
/// writes wait for a FLUSH stays until one made them durable.
#[test]
fn a_burst_of_clients_leaves_at_most_two_spare_sessions_behind() {
    let (_d, _shm, t) = start("spare");
    let e = Export::start(&t, 1, "spare", &[]);
    let mut clients: Vec<Raw> = (0..6).map(|_| Raw::connect(&e.sock)).collect();
    for (i, c) in clients.iter_mut().enumerate() {
        // In transmission, each on a queue of its own; the last one's writes wait for a FLUSH.
        assert!(c.read(0, 4096).is_ok(), "client {i}");
    }
    assert_eq!(clients[5].write(0, 8192, &[9; 4096]), 0);
    sessions_until(&t, "one per client", |n| n == 6);
    drop(clients);
    sessions_until(&t, "the spare ones closed", |n| n <= 2);
    // The one holding a write no FLUSH covered yet is among those left (the others only
    // read): a FLUSH covers it, on its session.
    let flushed = || {
        t.status()["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["flushes"].as_u64().unwrap())
            .sum::<u64>()
    };
    assert_eq!(flushed(), 0);
    let mut c = Raw::connect(&e.sock);
    assert_eq!(c.flush(), 0);
    assert!(
        flushed() > 0,
        "the FLUSH found no queue with writes to make durable"
    );
    let got = c.read(8192, 4096).expect("READ");
    assert!(got.iter().all(|&v| v == 9));
    assert_eq!(c.write(0, 0, &[4; 4096]), 0);
    assert_eq!(c.flush(), 0);
}

/// Out of file descriptors, the export pauses its accepts instead of spinning on the listener
/// (which stays readable): one warning per log period, and the accepts go on once there are
/// descriptors again. (It retried at once, at full CPU, a warning each time: thousands of lines a second.)
#[test]
fn running_out_of_file_descriptors_pauses_accepts_instead_of_spinning() {
    let (_d, _shm, t) = start("emfile");
    let e = Export::start(&t, 1, "emfile", &[]);
    let pid = e.pid();
    // No descriptor to spare: the next accept fails (a new descriptor takes the lowest free
    // number, and must be below the limit; a limit of 0 would fail the export's poll, which
    // needs one at least as high as its number of fds).
    let lowest_free = || {
        let numbers: std::collections::BTreeSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|f| f.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        (0..).find(|n| !numbers.contains(n)).unwrap()
    };
    let set = |lim: Option<libc::rlimit>| {
        let mut old = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        let new = lim
            .as_ref()
            .map_or(std::ptr::null(), |l| l as *const libc::rlimit);
        // SAFETY: prlimit reads `new` (or nothing, null) and writes the old limit into `old`;
        // both outlive the call.
        let r = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, new, &mut old) };
        assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());
        old
    };
    let was = set(None);
    // A descriptor the export closed after the count (seen on a loaded machine) lets the
    // accept succeed: its greeting then comes, or the connection is closed (the accept took
    // the one descriptor free, and what the export opens next for it failed), and the count
    // is taken again. (Only a greeting was looked for: a closed connection read end of file
    // until the deadline, a flake beside builds.)
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let _holder = 'counted: loop {
        set(Some(libc::rlimit {
            rlim_cur: lowest_free(),
            rlim_max: was.rlim_max,
        }));
        let mut h = UnixStream::connect(&e.sock).unwrap();
        h.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        loop {
            if e.log().contains("accepting a connection failed") {
                break 'counted h;
            }
            assert!(std::time::Instant::now() < deadline, "{}", e.log());
            if std::io::Read::read(&mut h, &mut [0u8; 1]).is_ok() {
                continue 'counted;
            }
        }
    };
    // Ten pauses' worth.
    std::thread::sleep(Duration::from_secs(1));
    let lines = e
        .log()
        .lines()
        .filter(|l| l.contains("accepting a connection failed"))
        .count();
    assert_eq!(lines, 1, "{}", e.log());
    // Descriptors to spare again: the accepts go on.
    set(Some(was));
    let mut c = Raw::connect(&e.sock);
    assert!(c.read(0, 4096).is_ok());
}

/// A client in transmission on the Unix socket `sock`, or why not (a newcomer the export
/// turned away is closed before its greeting).
fn try_connect(sock: &std::path::Path) -> std::io::Result<Raw> {
    let s = UnixStream::connect(sock)?;
    s.set_read_timeout(Some(WAIT))?;
    idle_client(s).map(Raw)
}

/// `len` bytes at `offset` read through `r`, or why not (its connection closed).
fn try_read(r: &mut Raw, offset: u64, len: u32) -> std::io::Result<Vec<u8>> {
    let req = r.request(CMD_READ, 0, 77, offset, len);
    r.0.write_all(&req)?;
    let mut h = [0u8; 16];
    r.0.read_exact(&mut h)?;
    if h[4..8] != [0; 4] {
        return Err(std::io::Error::other(format!(
            "READ answered {:?}",
            &h[4..8]
        )));
    }
    let mut b = vec![0u8; len as usize];
    r.0.read_exact(&mut b)?;
    Ok(b)
}

/// Bytes waiting to be read on `fd`.
fn unread(fd: &impl AsRawFd) -> libc::c_int {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through the pointer, which outlives the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut n) };
    assert_eq!(r, 0, "FIONREAD: {}", std::io::Error::last_os_error());
    n
}

/// Connections of the well-behaved client's own user that each send a request, then large
/// READs whose replies they never read, keep neither that client nor a newcomer out: a
/// connection whose replies wait unread for a second may be evicted (after those that sent no
/// request, before idle ones), and among connections that sent requests the newest go first.
/// (Before: the sixteenth connection evicted the well-behaved client, idle the longest, and
/// every newcomer was refused, "all executing requests", until the replies' time-out, 30 s and
/// more, while the attackers could send the next READs.)
#[test]
fn connections_that_never_read_their_replies_do_not_keep_the_clients_own_user_out() {
    let (_d, _shm, t) = start("nbd-unread-squat");
    let e = Export::start(&t, 1, "unread-squat", &[]);
    let mut legit = Raw::connect(&e.sock);
    assert_eq!(legit.write(0, 0, &[0x5a; 4096]), 0);
    assert_eq!(legit.flush(), 0);
    // 16 from the same user, each with one request answered: the sixteenth is past the
    // source's cap and evicts one of the others.
    let mut attackers: Vec<Raw> = (0..16)
        .map(|i| {
            let mut a = Raw::connect(&e.sock);
            assert!(try_read(&mut a, 0, 4096).is_ok(), "attacker {i}");
            a
        })
        .collect();
    attackers.retain(|a| !gone(&a.0));
    // Then 2 MiB of READ replies each, far more than its socket holds, never read.
    for a in &mut attackers {
        let r = a.request(CMD_READ, 0, 5, 0, 2 << 20);
        a.0.write_all(&r).unwrap();
    }
    let deadline = Instant::now() + WAIT;
    for a in &attackers {
        while unread(&a.0) == 0 {
            assert!(Instant::now() < deadline, "no reply reached an attacker");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    // Their replies have waited a second (a newcomer before that would find every attacker
    // executing requests, and the idle client the only one to evict: it gets back in below).
    std::thread::sleep(Duration::from_millis(1500));
    // Well within the replies' time-out (30 s and more), which freed the slots before.
    let deadline = Instant::now() + Duration::from_secs(10);
    let get_in = |what: &str| loop {
        match try_connect(&e.sock).and_then(|mut c| try_read(&mut c, 0, 4096).map(|b| (c, b))) {
            Ok(got) => break got,
            Err(err) => assert!(
                Instant::now() < deadline,
                "{what} kept out: {err}\nthe export's log:\n{}",
                e.log()
            ),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (_newcomer, got) = get_in("a newcomer");
    assert!(got.iter().all(|&v| v == 0x5a));
    let stayed = match try_read(&mut legit, 0, 4096) {
        Ok(got) => got,
        Err(_) => get_in("the well-behaved client, reconnecting").1,
    };
    assert!(stayed.iter().all(|&v| v == 0x5a));
    e.log_line("its replies unread");
    drop(attackers);
}

/// A client that leaves its replies unread for longer than the target's keep-alive (5 s here)
/// does not let its queue's session lapse: its thread lets the queue go once the replies have
/// waited a second, and the keep-alive ticks it. (Its thread held the queue, which the
/// keep-alive does not wait for, until the client read: the target revoked the session's keys
/// and dropped it.)
#[test]
fn replies_left_unread_past_the_targets_keep_alive_do_not_lapse_the_session() {
    let (_d, _shm, t) = start("nbd-unread-keepalive");
    let e = Export::start(&t, 1, "unread-keepalive", &[]);
    let mut a = Raw::connect(&e.sock);
    assert_eq!(a.write(0, 0, &[8; 4096]), 0);
    let r = a.request(CMD_READ, 0, 100, 0, 4 << 20);
    a.send(&r);
    let deadline = Instant::now() + WAIT;
    while unread(&a.0) == 0 {
        assert!(Instant::now() < deadline, "no reply reached A");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Past the keep-alive (5 s) and the target's check of it, within the replies' time-out.
    std::thread::sleep(Duration::from_secs(8));
    assert_eq!(a.reply(), (0, 100));
    assert!(a.take(4 << 20)[..4096].iter().all(|&v| v == 8));
    assert_eq!(a.flush(), 0);
    assert!(a.read(0, 4096).is_ok_and(|b| b.iter().all(|&v| v == 8)));
    let log = t.log();
    assert!(!log.contains("lapsed"), "{log}\nthe export's:\n{}", e.log());
    assert!(
        !e.log().contains("queue to the target failed"),
        "{}",
        e.log()
    );
}

/// NBD_CMD_WRITE_ZEROES.
const CMD_WRITE_ZEROES: u16 = 6;

/// The bytes the target placed, all sessions together.
fn placed(t: &rpma_tests::Target) -> u64 {
    t.status()["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["data"]["write_bytes"].as_u64().unwrap_or(0))
        .sum()
}

/// Large WRITE_ZEROES on one connection hold up no other connection's FLUSH (which must make
/// the first connection's write durable too, on its queue): one of a whole 256 MiB namespace is
/// written a 64 MiB step at a time, the queue let go between steps to a FLUSH that wants it,
/// and many smaller ones count toward a batch's 64 MiB as WRITEs do, the queue let go between
/// batches. Checked by order: the FLUSH is answered before the zeroes are. (Each WRITE_ZEROES
/// was one write under the queue's lock whatever its length, up to 4 GiB, and a batch of them
/// counted no bytes: one WRITE and 64 WRITE_ZEROES held every FLUSH of the export for
/// minutes.)
#[test]
fn large_write_zeroes_hold_up_no_other_connections_flush() {
    const BIG: u64 = 256 << 20;
    let d = rpma_tests::scratch();
    let config = rpma_tests::Config::new().subsystem(
        rpma_tests::Subsystem::new(SUB)
            .any_host()
            .namespaces([rpma_tests::Namespace::new(1, "big", "256MiB")]),
    );
    let t = rpma_tests::Target::start(d.path(), &config.to_string());
    let e = Export::start(&t, 1, "zeroes", &[]);
    let mut a = Raw::connect(&e.sock);
    let mut b = Raw::connect(&e.sock);
    for (round, (n, len)) in [(1u64, BIG), (64, BIG / 64)].into_iter().enumerate() {
        // A's queue holds a write no FLUSH made durable yet.
        assert_eq!(a.write(0, 0, &[7; 4096]), 0);
        let before = placed(&t);
        let mut reqs = Vec::new();
        for h in 0..n {
            reqs.extend(a.request(CMD_WRITE_ZEROES, 0, 200 + h, h * len, len as u32));
        }
        a.send(&reqs);
        // The zeroes are being written.
        let deadline = Instant::now() + WAIT;
        while placed(&t) < before + (16 << 20) {
            assert!(Instant::now() < deadline, "round {round}: no zeroes placed");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(b.flush(), 0, "round {round}");
        let replies = unread(&a.0) as u64 / 16;
        assert!(
            replies < n,
            "round {round}: B's FLUSH was answered after all {n} of A's WRITE_ZEROES"
        );
        for h in 0..n {
            assert_eq!(a.reply(), (0, 200 + h), "round {round}");
        }
        println!("round {round}: B's FLUSH answered with {replies} of {n} zeroes answered");
    }
    assert!(a.read(0, 4096).is_ok_and(|b| b.iter().all(|&v| v == 0)));
}

/// The export's resident memory, in bytes.
fn rss(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

/// A request header whose payload never comes costs the export what came, not what the header
/// claims: the receive buffer grows 1 MiB at most ahead of the bytes received. (A FUA WRITE
/// header of 32 MiB, 28 bytes, had the buffer grown and zeroed for the whole payload at once:
/// 32 MiB resident for the idle time-out, 600 s, per connection.)
#[test]
fn a_write_header_whose_payload_never_comes_costs_no_more_than_what_came() {
    const CONNS: usize = 16;
    const LEN: u32 = 32 << 20;
    let (_d, _shm, t) = start("nbd-header-only");
    let e = Export::start(&t, 1, "header-only", &[]);
    // (Past the namespace's end, 8 MiB: answered ENOSPC, but only once its payload came.)
    let mut conns: Vec<Raw> = (0..CONNS).map(|_| Raw::connect(&e.sock)).collect();
    let before = rss(e.pid());
    for c in &mut conns {
        // FUA: received through the receive buffer (a plain one goes to a payload buffer).
        let h = c.request(CMD_WRITE, FUA, 3, 0, LEN);
        c.send_read(&h);
        // The export has read a byte of the payload: its buffer for the rest is there.
        c.send_read(&[1]);
    }
    let grown = rss(e.pid()).saturating_sub(before);
    println!(
        "{CONNS} headers of {} MiB WRITEs: the export grew {} MiB",
        LEN >> 20,
        grown >> 20
    );
    assert!(
        grown < 4 * u64::from(LEN),
        "{} MiB more resident for {CONNS} headers of 32 MiB WRITEs",
        grown >> 20
    );
}

/// The target's sessions now.
fn sessions(t: &rpma_tests::Target) -> usize {
    t.status()["sessions"].as_array().unwrap().len()
}

/// Connections that finish their handshake and send nothing hold no queue (no session on the
/// target, no replay memory), and the export opens at most `--max-queues` queues: the
/// connections past it share them. (Each connection opened a queue of its own as it entered
/// transmission: 64 idle connections took 64 of the target's sessions, its max_connections
/// by default, and up to 64 MiB of replay memory each.)
#[test]
fn idle_connections_hold_no_queue_and_the_queues_are_capped() {
    const CONNS: usize = 12;
    let (_d, _shm, t) = start("nbd-queues");
    let e = Export::start(&t, 1, "queues", &["--max-queues", "4"]);
    // The export's own queue, opened at its start.
    assert_eq!(sessions(&t), 1);
    let mut conns: Vec<Raw> = (0..CONNS).map(|_| Raw::connect(&e.sock)).collect();
    // (Each took its queue within milliseconds of its handshake.)
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(sessions(&t), 1, "idle connections opened queues");
    for (i, c) in conns.iter_mut().enumerate() {
        assert_eq!(c.write(0, i as u64 * 4096, &[i as u8 + 1; 4096]), 0, "{i}");
    }
    let open = sessions(&t);
    assert!(
        open <= 4,
        "{open} sessions for {CONNS} connections, at most 4 queues"
    );
    for (i, c) in conns.iter_mut().enumerate() {
        assert_eq!(c.flush(), 0, "{i}");
        let got = c.read((CONNS - 1 - i) as u64 * 4096, 4096).unwrap();
        assert!(got.iter().all(|&v| v == (CONNS - i) as u8), "{i}");
    }
    let log = e.log();
    assert!(!log.contains("cannot open another queue"), "{log}");
}

/// Connections whose first request finds the target refusing another queue each share one,
/// and say so within the log limits: at most 5 lines a period about their source, the rest
/// counted. (Each said it at WARN, unlimited: a line per connection.)
#[test]
fn newcomers_the_target_has_no_room_for_are_logged_within_the_limits() {
    // A source's cap.
    const CONNS: usize = 16;
    let (_d, _shm, t) = one_session_target("noroom-flood");
    let e = Export::start(&t, 1, "noroom-flood", &["--log-period", "2"]);
    let mut conns: Vec<Raw> = (0..CONNS).map(|_| Raw::connect(&e.sock)).collect();
    for (i, c) in conns.iter_mut().enumerate() {
        assert!(c.read(0, 4096).is_ok(), "{i}");
    }
    let what = "cannot open another queue to the target";
    // All but the first tried to open one; the rest of the lines are counted once the
    // period is over.
    let deadline = Instant::now() + WAIT;
    let log = loop {
        let log = e.log();
        let lines = log
            .lines()
            .filter(|l| l.contains(what) && l.contains(" WARN "))
            .count();
        if lines as u64 + summarized(&log, "warning(s)") >= CONNS as u64 - 1 {
            break log;
        }
        assert!(Instant::now() < deadline, "{log}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let lines = log
        .lines()
        .filter(|l| l.contains(what) && l.contains(" WARN "))
        .count();
    assert!(lines <= 5, "{lines} lines: {log}");
}

/// A peer that connects and closes as fast as it can keeps the listener's backlog from ever
/// emptying: SIGTERM still stops the export (it answers what it took in, flushes, exits 0).
/// Before, the accept loop took connections until none waited and never looked at the stop
/// descriptor meanwhile: the export heard SIGTERM only once the flood stopped, and under
/// systemd the stop timed out into SIGKILL, without the final flush.
#[test]
fn sigterm_stops_the_export_during_a_connection_flood() {
    let (_d, _shm, t) = start("flood-term");
    let mut e = Export::start(&t, 1, "flood-term", &[]);
    let mut c = Raw::connect(&e.sock);
    assert_eq!(c.write(0, 0, &[5; 4096]), 0);
    let stop = Arc::new(AtomicBool::new(false));
    let made = Arc::new(AtomicUsize::new(0));
    let flooders: Vec<_> = (0..2)
        .map(|_| {
            let (sock, stop, made) = (e.sock.clone(), Arc::clone(&stop), Arc::clone(&made));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if UnixStream::connect(&sock).is_ok() {
                        made.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    // The flood is on: a thousand connections went through.
    let deadline = Instant::now() + WAIT;
    while made.load(Ordering::Relaxed) < 1000 {
        assert!(Instant::now() < deadline, "no flood");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(c);
    // SAFETY: kill has no memory-safety preconditions; the pid is the test's live child's.
    assert_eq!(unsafe { libc::kill(e.pid(), libc::SIGTERM) }, 0);
    let deadline = Instant::now() + WAIT;
    while e.running() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let exited = !e.running();
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        f.join().unwrap();
    }
    let made = made.load(Ordering::Relaxed);
    assert!(
        exited,
        "still running {WAIT:?} after SIGTERM, the flood on ({made} connections)"
    );
    assert_eq!(e.wait().code(), Some(0), "{}", e.log());
}
