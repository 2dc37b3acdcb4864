//! Hostile peers against availability (issue 22): attackers that share the allowed host's own
//! source address, and peers that try to fill the log, the metrics or the target's send
//! capacity. The real `rpma-target` on the sessions fixture, raw peers that frame everything
//! themselves (tests/tests/hostile/mod.rs), the rpma-initiator library as the allowed host.
//! Every wait has a deadline and waits for a condition, never for a time to pass.

mod hostile;

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hostile::{Peer, Suite};
use rpma_common::proto::nqn::DISCOVERY_NQN;
use rpma_common::proto::{FlushStatus, KeepAlive, Message, RefusalReason};
use rpma_initiator::{connect, discover};
use rpma_tests::sessions::{OPEN, PLAIN, SUB, WAIT};
use rpma_tests::{counted_in_summaries, host, nqn, opts, summary_lines, Target};

/// The allowed host's own address: the initiator library connects to 127.0.0.1 from it.
const HOST_ADDR: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// Waits until `pred` holds on the status' `admission` object.
fn wait_admission(t: &Target, what: &str, pred: impl Fn(&serde_json::Value) -> bool) {
    let deadline = Instant::now() + WAIT;
    loop {
        let st = t.status();
        if pred(&st["admission"]) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {}", st["admission"]);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An attacker on `port` that opens a new connection from `src` every `every` (each waiting
/// for its MPA Reply, then doing `then` with it) until stopped, keeping every one open.
struct Reopener {
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicUsize>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Reopener {
    fn start(port: u16, src: Ipv4Addr, every: Duration, then: fn(&mut Peer)) -> Reopener {
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicUsize::new(0));
        let (st, n) = (Arc::clone(&stop), Arc::clone(&opened));
        let handle = std::thread::spawn(move || {
            let mut held = Vec::new();
            while !st.load(Ordering::SeqCst) {
                let mut p = Peer::open(port, src);
                then(&mut p);
                held.push(p);
                n.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(every);
            }
        });
        Reopener {
            stop,
            opened,
            handle: Some(handle),
        }
    }

    /// Stops it: how many connections it opened (it panics if the target refused one).
    fn finish(mut self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        self.handle.take().unwrap().join().expect("the attacker");
        self.opened.load(Ordering::SeqCst)
    }
}

impl Drop for Reopener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// A discovery session asking a long keep-alive (the configuration allows a minute).
fn discovery_session(p: &mut Peer) {
    p.connect("nqn.2026-11.io.rpma:attacker", DISCOVERY_NQN);
    match p.next_message() {
        Message::ConnectResponse(r) => assert_eq!(r.controller_id, 0),
        other => panic!("discovery Connect: {other:?}"),
    }
}

/// F1: connections that finish MPA and never Connect, from the allowed host's own address, at
/// that address's cap (8), and an attacker that keeps opening more (5 a second, three times the
/// rate that kept the host out for good): the host's connection always gets in, taking the
/// place of that address's oldest unadmitted connection.
#[test]
fn half_open_connections_from_the_hosts_own_address_cannot_keep_it_out() {
    let mut s = Suite::start("handshake_timeout_ms = 60000");
    let mut held: Vec<Peer> = (0..8).map(|_| Peer::open(s.port(), HOST_ADDR)).collect();
    wait_admission(&s.t, "the attackers hold the address's cap", |a| {
        a["unadmitted"]["held"] == 8 && a["unadmitted"]["sources"] == 1
    });
    let mut sess = connect(&s.t.url(), &nqn(SUB), &host(PLAIN), &opts())
        .expect("the host's Connect from its own address, at the address's cap");
    assert_eq!(sess.flush(1, 0, 4096, WAIT).unwrap(), FlushStatus::Durable);
    assert!(
        held[0].closed(),
        "the oldest attacker's place was not taken"
    );
    assert!(held[1].still_open(), "only the oldest was evicted");

    let attacker = Reopener::start(s.port(), HOST_ADDR, Duration::from_millis(200), |_| {});
    for i in 0..10 {
        let mut q = connect(&s.t.url(), &nqn(SUB), &host(PLAIN), &opts())
            .unwrap_or_else(|e| panic!("identify {i} while the attacker reopens: {e}"));
        assert_eq!(q.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
        let _ = q.disconnect(Duration::from_secs(1));
    }
    let opened = attacker.finish();
    eprintln!("the attacker opened {opened} more connections meanwhile");
    assert_eq!(sess.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    s.unchanged("half-open connections from the host's own address");
    s.finish();
}

/// F2: discovery sessions kept alive from the allowed host's own address, at that address's
/// cap (4), and an attacker that keeps opening more: the host's discovery always gets in,
/// taking the place of that address's oldest discovery session.
#[test]
fn discovery_sessions_from_the_hosts_own_address_cannot_keep_it_out() {
    let mut s = Suite::start("discovery_max_keep_alive_ms = 60000");
    let mut held: Vec<Peer> = (0..4)
        .map(|_| {
            let mut p = Peer::open(s.port(), HOST_ADDR);
            discovery_session(&mut p);
            p
        })
        .collect();
    for p in &mut held {
        p.message(&Message::KeepAlive(KeepAlive { seq: 1 }));
    }
    wait_admission(&s.t, "the attackers hold the address's cap", |a| {
        a["discovery"]["held"] == 4
    });
    let names = |v: Vec<rpma_common::proto::DiscoveryEntry>| -> Vec<String> {
        v.iter().map(|e| e.subsystem_nqn.to_string()).collect()
    };
    let found = discover(&s.t.url(), &host(PLAIN), &opts())
        .expect("the host's discovery from its own address, at the address's cap");
    assert_eq!(names(found), [OPEN, SUB]);
    assert!(
        held[0].closed(),
        "the oldest attacker's session was not taken"
    );
    assert!(held[1].still_open(), "only the oldest was evicted");

    let attacker = Reopener::start(
        s.port(),
        HOST_ADDR,
        Duration::from_millis(200),
        discovery_session,
    );
    for i in 0..10 {
        let found = discover(&s.t.url(), &host(PLAIN), &opts())
            .unwrap_or_else(|e| panic!("discovery {i} while the attacker reopens: {e}"));
        assert_eq!(names(found), [OPEN, SUB]);
    }
    let opened = attacker.finish();
    eprintln!("the attacker opened {opened} more discovery sessions meanwhile");
    s.unchanged("discovery sessions from the host's own address");
    s.finish();
}

/// A scraper that never finishes its request: connects from `src` to the metrics port, sends
/// a request line, then a byte every 100 ms; when the target closes it (evicted, or cut off at
/// the request deadline) it connects again at once, until stopped.
fn trickler(port: u16, src: Ipv4Addr, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    use std::io::Write;
    std::thread::spawn(move || {
        let mut opened = 0;
        while !stop.load(Ordering::SeqCst) {
            let mut s = rpma_tests::tcp_from(port, src, WAIT);
            opened += 1;
            if s.write_all(b"GET /metrics HTTP/1.1\r\n").is_err() {
                continue;
            }
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(100));
                if s.write_all(b"X").is_err() {
                    break;
                }
            }
        }
        opened
    })
}

/// F3: trickling connections to the metrics endpoint, reopened as soon as they are closed,
/// from the scraper's own address (its cap, 4) and from others (the rest of the places and
/// more): every scrape is answered 200, because a newcomer takes the place of the oldest
/// unfinished request (before: 20 of 20 scrapes answered 503).
#[test]
fn trickling_scrapers_cannot_blind_the_monitoring() {
    let mport = rpma_tests::free_port();
    let mut s = Suite::start(&format!("metrics_listen = \"127.0.0.1:{mport}\""));
    let stop = Arc::new(AtomicBool::new(false));
    let mut attackers = Vec::new();
    for _ in 0..4 {
        attackers.push(trickler(mport, HOST_ADDR, Arc::clone(&stop)));
    }
    for _ in 0..3 {
        let src = s.src();
        for _ in 0..2 {
            attackers.push(trickler(mport, src, Arc::clone(&stop)));
        }
    }
    // Every place is held by a trickler before the first scrape.
    let deadline = Instant::now() + WAIT;
    while s.t.status()["metrics_listener"]["serving"] != 8 {
        assert!(
            Instant::now() < deadline,
            "the tricklers are not all served"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let addr = format!("127.0.0.1:{mport}");
    for i in 0..20 {
        let page = rpma_tests::metrics::scrape(&addr);
        assert!(page.contains("rpma_target_build_info"), "scrape {i}");
    }
    stop.store(true, Ordering::SeqCst);
    let opened: usize = attackers.into_iter().map(|h| h.join().unwrap()).sum();
    eprintln!("the tricklers opened {opened} connections; 20 of 20 scrapes answered");
    s.unchanged("trickling scrapers from the scraper's address and others");
    s.finish();
}

/// Scrapers that ask for the page and never read it, from `src`: each connection with a tiny
/// receive buffer and segment size (set before the connect, so that the window it offers stays
/// tiny and the target's send queue for it small), a whole
/// `GET /metrics`, then nothing. The thread keeps one such connection being answered, and
/// reopens it all the time: every 300 ms it opens another, and once that one is answered (its
/// status line came) drops the older; turned away (503) or closed unanswered, it tries again
/// at once. Until stopped; returns how many it opened.
fn non_reader(port: u16, src: Ipv4Addr, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    use nix::sys::socket::{
        bind, connect, setsockopt, socket,
        sockopt::{RcvBuf, TcpMaxSeg},
        AddressFamily, SockFlag, SockType, SockaddrIn,
    };
    use std::io::Write;
    use std::net::{SocketAddrV4, TcpStream};
    use std::os::fd::AsRawFd;
    std::thread::spawn(move || {
        let mut opened = 0;
        let mut _held = None;
        while !stop.load(Ordering::SeqCst) {
            let fd = socket(
                AddressFamily::Inet,
                SockType::Stream,
                SockFlag::SOCK_CLOEXEC,
                None,
            )
            .unwrap();
            setsockopt(&fd, RcvBuf, &1024).unwrap();
            // A small segment size too: the target's send queue for the connection is sized by
            // it (on loopback's 64 KiB segments it would take the whole page).
            setsockopt(&fd, TcpMaxSeg, &536).unwrap();
            bind(fd.as_raw_fd(), &SockaddrIn::from(SocketAddrV4::new(src, 0))).unwrap();
            let to = SockaddrIn::from(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
            connect(fd.as_raw_fd(), &to).unwrap();
            let mut s = TcpStream::from(fd);
            s.set_read_timeout(Some(WAIT)).unwrap();
            opened += 1;
            if s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                .is_err()
            {
                continue;
            }
            // A look at the status line, without taking it off the socket.
            let mut head = [0u8; 12];
            if !matches!(s.peek(&mut head), Ok(12)) || &head != b"HTTP/1.1 200" {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            // The older one goes (a reset: its answer is unread).
            _held = Some(s);
            let until = Instant::now() + Duration::from_millis(300);
            while !stop.load(Ordering::SeqCst) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        opened
    })
}

/// Scrapers from the scraper's own address that ask for the page and never read it, as many
/// as its cap (4), reopened all the time: their answers cannot leave, but every scrape is
/// answered 200, because an answer being written gives its place up to a newcomer, first of
/// all one whose write makes no progress (before: they stayed being answered until the 5 s
/// write deadline, so the scraper found its address's places all taken: 503).
#[test]
fn scrapers_that_never_read_cannot_blind_the_monitoring() {
    let mport = rpma_tests::free_port();
    // The page of a target with 160 more namespaces (~170 KB): more than the target's send
    // queue takes for a connection offering a tiny window, so that an answer not read stays
    // stuck (the fixture's own 23 KB page would go into the queue at once).
    let many: String = (0..4)
        .map(|k| {
            let sub =
                rpma_tests::Subsystem::new(&format!("nqn.2026-11.io.rpma:many-{k}")).any_host();
            (1..=40)
                .fold(sub, |sub, n| {
                    sub.namespace(rpma_tests::Namespace::new(n, &format!("m{k}-{n}"), "64KiB"))
                })
                .to_string()
        })
        .collect();
    let mut s = Suite::start_with(
        &format!("metrics_listen = \"127.0.0.1:{mport}\""),
        &many.to_string(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let attackers: Vec<_> = (0..4)
        .map(|_| non_reader(mport, HOST_ADDR, Arc::clone(&stop)))
        .collect();
    // Every place of the scraper's address is held by a non-reader before the first scrape.
    let deadline = Instant::now() + WAIT;
    while s.t.status()["metrics_listener"]["serving"] != 4 {
        assert!(
            Instant::now() < deadline,
            "the non-readers are not all served"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let addr = format!("127.0.0.1:{mport}");
    for i in 0..20 {
        let page = rpma_tests::metrics::scrape(&addr);
        assert!(page.contains("rpma_target_build_info"), "scrape {i}");
        // Spread over the attackers' reopening.
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::SeqCst);
    let opened: usize = attackers.into_iter().map(|h| h.join().unwrap()).sum();
    eprintln!("the non-readers opened {opened} connections; 20 of 20 scrapes answered");
    s.unchanged("scrapers that never read, from the scraper's address");
    s.finish();
}

/// One session on OPEN (allow_any_host) as `host`, from `src`: admitted, one GPSPM flush (so
/// that it has something to count), a Disconnect.
fn made_up_host_session(port: u16, src: Ipv4Addr, host: &str) {
    let mut p = Peer::open(port, src);
    p.connect(host, OPEN);
    match p.next_message() {
        Message::ConnectResponse(_) => {}
        other => panic!("{host}: {other:?}"),
    }
    p.message(&Message::FlushRequest(rpma_common::proto::FlushRequest {
        nsid: 1,
        offset: 0,
        length: 8,
        token: 1,
    }));
    match p.next_message() {
        Message::FlushResponse(f) => assert_eq!(f.status, FlushStatus::Durable),
        other => panic!("{host}: {other:?}"),
    }
    // The target lingers until the host closes: this one closes at once.
    p.message(&Message::Disconnect(rpma_common::proto::Disconnect {
        reason: "done".into(),
    }));
}

/// F7: sessions with made-up host NQNs (no credential) on an `allow_any_host` subsystem, each
/// doing a little I/O: the per-host series and the status' per-host table gain nothing from
/// them (they are counted under one `(allow_any_host)` label), and a configured host's
/// accounting is untouched (before: 5,000 such hosts took /metrics from 94 KB to 13.9 MB and
/// pushed a host configured later into `(other)`).
#[test]
fn made_up_host_nqns_add_no_series_and_push_out_no_configured_host() {
    let mport = rpma_tests::free_port();
    let mut s = Suite::start(&format!("metrics_listen = \"127.0.0.1:{mport}\""));
    let addr = format!("127.0.0.1:{mport}");
    // A configured host's accounting before the attack.
    let mut sess = connect(&s.t.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap();
    assert_eq!(sess.flush(1, 0, 4096, WAIT).unwrap(), FlushStatus::Durable);
    let _ = sess.disconnect(Duration::from_secs(1));
    // One made-up host first, so that the shared label's series exist in the baseline.
    let src = s.src();
    made_up_host_session(s.port(), src, "nqn.2026-11.io.evil:h0");
    let wait_ended = |s: &Suite, n: u64| {
        let deadline = Instant::now() + WAIT;
        loop {
            let v = s.t.status();
            let ended = v["metrics"]["sessions_ended"]["host"].as_u64().unwrap_or(0);
            if ended >= n {
                return v;
            }
            assert!(Instant::now() < deadline, "{ended} of {n} sessions ended");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let v = wait_ended(&s, 2);
    let page0 = rpma_tests::metrics::scrape(&addr).len();
    let status0 = v["metrics"]["hosts"].to_string().len();

    let n = 1000;
    for i in 1..=n {
        made_up_host_session(s.port(), src, &format!("nqn.2026-11.io.evil:h{i}"));
    }
    let v = wait_ended(&s, 2 + n);
    let page = rpma_tests::metrics::scrape(&addr);
    let status = v["metrics"]["hosts"].to_string().len();
    eprintln!(
        "{n} made-up hosts: /metrics {page0} -> {} bytes, status hosts table {status0} -> {status} bytes",
        page.len()
    );
    // The numbers inside grow by a few digits; no series or entry is added.
    assert!(
        page.len() < page0 + 256,
        "/metrics grew from {page0} to {} bytes",
        page.len()
    );
    assert!(
        status < status0 + 256,
        "the status' per-host table grew from {status0} to {status} bytes"
    );
    assert!(!page.contains("evil"), "a made-up host NQN is a label");
    let any = format!(
        "rpma_target_durability_requests_total{{subsystem=\"{OPEN}\",nsid=\"1\",host=\"(allow_any_host)\",method=\"gpspm\",outcome=\"ok\"}}"
    );
    let ok = rpma_tests::metrics::sample(&page, &any).expect("the shared label's series");
    assert!(ok >= (n + 1) as f64, "{ok}");
    let plain = format!(
        "rpma_target_durability_requests_total{{subsystem=\"{SUB}\",nsid=\"1\",host=\"{PLAIN}\",method=\"gpspm\",outcome=\"ok\"}}"
    );
    assert_eq!(rpma_tests::metrics::sample(&page, &plain), Some(1.0));
    s.unchanged("sessions with made-up host NQNs");
    s.finish();
}

/// Lines of `log` that contain `what`.
fn lines_with(log: &str, what: &str) -> usize {
    log.lines().filter(|l| l.contains(what)).count()
}

/// F6: one address cycling sessions as fast as it can on an `allow_any_host` subsystem, each
/// ending with a Disconnect whose reason carries a line break and a forged log line: the session
/// lines are logged up to their budget per period and counted past it, the forged line never
/// starts a line of the log, and the log grows by a bounded number of bytes (before: 71,182
/// lines in 5 s, 401 MB a minute, and the reason logged as sent).
#[test]
fn cycling_sessions_cannot_fill_the_log_or_forge_a_line() {
    let period = Duration::from_secs(2);
    let mut s = Suite::start(&format!("refusal_log_period_ms = {}", period.as_millis()));
    let forged = "[2026-12-01T00:00:00Z ERROR rpma_target] FORGED by a peer";
    let host_nqn = "nqn.2026-11.io.evil:cycler";
    let src = s.src();
    // Sessions ended for any reason: the peer's close right behind its Disconnect can reach
    // the target first on a loaded machine (then the session is "connection_lost", and its
    // end line is logged or counted all the same).
    let all_ended = |v: &serde_json::Value| -> u64 {
        v["metrics"]["sessions_ended"]
            .as_object()
            .unwrap()
            .values()
            .map(|n| n.as_u64().unwrap())
            .sum()
    };
    let ended0 = all_ended(&s.t.status());
    let log0 = s.t.log().len();
    let n: u64 = 2000;
    let started = Instant::now();
    for _ in 0..n {
        let mut p = Peer::open(s.port(), src);
        p.connect(host_nqn, OPEN);
        match p.next_message() {
            Message::ConnectResponse(_) => {}
            other => panic!("{other:?}"),
        }
        p.message(&Message::Disconnect(rpma_common::proto::Disconnect {
            reason: format!("bye\n{forged}\r\n\x1b[2J\" accepted \"\u{202e}"),
        }));
    }
    // Every session has ended, and every line about it is either in the log or counted in a
    // summary line (which comes a period after the first line it counts).
    let deadline = Instant::now() + WAIT + period;
    let log = loop {
        let v = s.t.status();
        let ended = all_ended(&v) - ended0;
        let log = s.t.log();
        let logged = lines_with(&log[log0..], host_nqn) as u64;
        if ended == n && logged + counted_in_summaries(&log[log0..]) == 2 * n {
            break log;
        }
        assert!(
            Instant::now() < deadline,
            "ended {ended} of {n}; logged {logged} + counted {} of {}",
            counted_in_summaries(&log[log0..]),
            2 * n
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = started.elapsed();
    let new = &log[log0..];
    let periods = (took.as_millis() / period.as_millis()) as usize + 1;
    let logged = lines_with(new, host_nqn);
    eprintln!(
        "{n} sessions in {took:?}: {logged} lines logged, {} counted, {} bytes of log",
        counted_in_summaries(new),
        new.len()
    );
    assert!(
        logged <= periods * 20 && logged >= 2,
        "{logged} session lines in {periods} period(s)"
    );
    // Session lines alone are counted at their own level: no warning for sessions.
    let summaries: Vec<&str> = summary_lines(new).collect();
    assert!(
        !summaries.is_empty() && summaries.iter().all(|l| l.contains(" INFO ")),
        "{summaries:?}"
    );
    // At most the budgets' lines (each well under 512 bytes) and a summary per period.
    assert!(
        new.len() <= (logged + 2 * periods) * 512,
        "{} bytes of log for {n} sessions",
        new.len()
    );
    assert!(
        log.lines()
            .all(|l| !l.contains("FORGED") || l.contains("bye\\n[2026")),
        "a forged line or an unescaped reason"
    );
    assert!(!log.contains('\x1b'), "a terminal escape reached the log");
    assert!(
        !log.contains('\u{202e}'),
        "a bidirectional override reached the log"
    );
    assert!(
        log.contains("[2J\\\" accepted \\\"\\u{202e}\""),
        "the reason's own quotes and its override are escaped, and it ends in our quote"
    );
    assert!(
        log.contains("closed by the host: \"bye\\n[2026-12-01T00:00:00Z ERROR rpma_target] FORGED"),
        "the reason is logged escaped"
    );
    s.unchanged("sessions cycled as fast as one address can");
    s.finish();
}

/// F6: refused Connects from 600 addresses (one each): the refusal lines are capped for all
/// addresses together, not only per address (before: one line per address, 2.35 MB per minute
/// from 4,096 addresses).
#[test]
fn refusals_from_many_addresses_add_a_bounded_volume() {
    let period = Duration::from_secs(60);
    let mut s = Suite::start(&format!("refusal_log_period_ms = {}", period.as_millis()));
    let log0 = s.t.log().len();
    let started = Instant::now();
    let mut n = 0;
    for a in 1..=3u8 {
        for b in 1..=200u8 {
            let mut p = Peer::open(s.port(), Ipv4Addr::new(127, 0, a, b));
            p.connect("nqn.2026-11.io.evil:refused", SUB);
            match p.next_message() {
                Message::Refusal(_) => {}
                other => panic!("{other:?}"),
            }
            n += 1;
        }
    }
    let deadline = Instant::now() + WAIT;
    while s.t.status()["metrics"]["refusals"]["host_not_allowed"].as_u64() < Some(n) {
        assert!(Instant::now() < deadline, "not every refusal counted");
        std::thread::sleep(Duration::from_millis(20));
    }
    let periods = (started.elapsed().as_millis() / period.as_millis()) as usize + 1;
    let log = s.t.log();
    let new = &log[log0..];
    let lines = lines_with(new, "nqn.2026-11.io.evil:refused");
    eprintln!(
        "{n} refusals from {n} addresses: {lines} lines, {} bytes",
        new.len()
    );
    assert!(
        lines <= 256 * periods,
        "{lines} refusal lines in {periods} period(s)"
    );
    assert!(new.len() <= (lines + periods) * 512, "{} bytes", new.len());
    s.unchanged("refusals from many addresses");
    s.finish();
}

/// TCP port probes and health checks (connect, close without a byte), many of them from one
/// address: counted as abandoned handshakes, never a warning (before: "bad MPA Request:
/// connection closed during MPA Request" at WARN once a minute per checker, an alarm for a
/// load balancer's check); a peer that sends part of a Request and closes is still one.
#[test]
fn port_probes_are_counted_not_warned_about() {
    let mut s = Suite::start("");
    let src = Ipv4Addr::new(127, 0, 4, 1);
    let abandoned = |s: &Suite| {
        s.t.status()["metrics"]["handshakes_failed"]["abandoned"]
            .as_u64()
            .unwrap()
    };
    let before = abandoned(&s);
    let log0 = s.t.log().len();
    let n = 50;
    // One at a time, each counted before the next: many at once from one address would evict
    // one another from the unadmitted pool, which counts them apart.
    for i in 0..n {
        drop(rpma_tests::tcp_from(s.port(), src, WAIT));
        let deadline = Instant::now() + WAIT;
        while abandoned(&s) < before + i + 1 {
            assert!(Instant::now() < deadline, "probe {i} not counted");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let log = s.t.log();
    let warned: Vec<&str> = log[log0..]
        .lines()
        .filter(|l| l.contains("127.0.4.1") && !l.contains(" DEBUG "))
        .collect();
    assert!(warned.is_empty(), "{warned:?}");
    // A peer that starts a Request and breaks off is not a probe: one warning for it.
    let bad = Ipv4Addr::new(127, 0, 4, 2);
    {
        use std::io::Write;
        let mut t = rpma_tests::tcp_from(s.port(), bad, WAIT);
        t.write_all(b"MPA ID Req").unwrap();
    }
    let deadline = Instant::now() + WAIT;
    while !s.t.log()[log0..]
        .lines()
        .any(|l| l.contains("127.0.4.2") && l.contains(" WARN "))
    {
        assert!(Instant::now() < deadline, "no warning for a broken Request");
        std::thread::sleep(Duration::from_millis(20));
    }
    s.unchanged("port probes");
    s.finish();
}

/// A session on OPEN (allow_any_host) as a made-up `host` from `src`: Some(the admitted peer),
/// None if the target refused it as full (anything else fails the test).
fn unlisted_session(port: u16, src: Ipv4Addr, host: &str) -> Option<Peer> {
    let mut p = Peer::open(port, src);
    p.connect(host, OPEN);
    match p.next_message() {
        Message::ConnectResponse(_) => Some(p),
        Message::Refusal(r) if r.reason == RefusalReason::TooManyConnections => None,
        other => panic!("{host}: {other:?}"),
    }
}

/// `p`, an unlisted session, is told that a listed host took its place.
fn displaced_by_a_listed_host(p: &mut Peer, which: &str) {
    match p.next_message() {
        Message::Disconnect(d) => {
            assert!(d.reason.contains("its subsystem lists"), "{which}: {d:?}")
        }
        other => panic!("{which}: {other:?}"),
    }
}

/// Sessions of made-up host NQNs on an `allow_any_host` subsystem, from one address, holding
/// every place (`max_connections`): a host that SUB lists (without a key) still gets in, each
/// time in the place of the oldest of them, which is told why and closed; the last unlisted
/// one goes for the last listed one. Full of listed hosts, the target refuses an unlisted
/// newcomer, and a listed one too (a listed host never takes another's place). (Before, the
/// listed host was refused TooManyConnections: only a host that proved its key got in.)
#[test]
fn unlisted_sessions_from_one_address_cannot_keep_a_listed_host_out() {
    const MAX: usize = 4;
    let d = rpma_tests::scratch();
    let t = rpma_tests::sessions::start(d.path(), &format!("max_connections = {MAX}"));
    let src = Ipv4Addr::new(127, 0, 0, 2);
    let evil = |i: usize| format!("nqn.2026-11.io.evil:h{i}");
    let mut held: Vec<Peer> = (0..MAX)
        .map(|i| unlisted_session(t.port(), src, &evil(i)).expect("a place for an unlisted host"))
        .collect();
    wait_admission(&t, "the unlisted sessions hold every place", |a| {
        a["sessions"]["held"] == MAX
    });
    assert!(
        unlisted_session(t.port(), src, &evil(MAX)).is_none(),
        "an unlisted host takes nobody's place"
    );

    // Keep-alives the test need not send while it waits for the others.
    let opts = rpma_initiator::ConnectOptions {
        keep_alive: Duration::from_secs(60),
        ..opts()
    };
    let mut listed = Vec::new();
    for i in 0..MAX {
        let mut sess = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts)
            .unwrap_or_else(|e| panic!("listed host {i} in a target full of unlisted ones: {e}"));
        assert_eq!(sess.flush(1, 0, 4096, WAIT).unwrap(), FlushStatus::Durable);
        listed.push(sess);
        displaced_by_a_listed_host(&mut held[i], &format!("unlisted session {i}"));
        if i == 0 {
            assert!(
                held[0].closed(),
                "the displaced session's connection stayed open"
            );
            wait_admission(&t, "the unlisted pool shows the others", |a| {
                a["unlisted"]["held"] == MAX - 1 && a["unlisted"]["sources"] == 1
            });
        }
        if let Some(next) = held.get_mut(i + 1) {
            assert!(next.still_open(), "only the oldest unlisted session went");
        }
    }
    wait_admission(&t, "the listed hosts hold every place", |a| {
        a["sessions"]["held"] == MAX && a["unlisted"]["held"] == 0
    });
    let st = t.status();
    assert_eq!(st["admission"]["unlisted"]["evicted"], MAX, "{st}");
    assert_eq!(st["admission"]["sessions"]["evicted"], MAX, "{st}");
    assert_eq!(st["metrics"]["sessions_ended"]["evicted"], MAX, "{st}");

    // Full of listed hosts: an unlisted newcomer is refused, and so is a listed one.
    assert!(
        unlisted_session(t.port(), src, &evil(MAX + 1)).is_none(),
        "an unlisted host took a listed host's place"
    );
    let e = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts);
    assert!(
        matches!(
            e,
            Err(rpma_initiator::Error::Refused {
                reason: RefusalReason::TooManyConnections,
                ..
            })
        ),
        "a listed host took another's place: {e:?}"
    );
    for (i, sess) in listed.iter_mut().enumerate() {
        assert_eq!(
            sess.flush(1, 0, 8, WAIT).unwrap(),
            FlushStatus::Durable,
            "listed session {i}"
        );
    }
    assert_eq!(t.status()["admission"]["sessions"]["evicted"], MAX);
}

/// A session let in by `allow_any_host` whose host a reload then lists (without a key) is a
/// listed host's session from then on: in a full target, another listed newcomer is refused
/// rather than given its place. (Before, it stayed in the lowest class and the newcomer took
/// its place, as if the operator had never listed it.)
#[test]
fn a_session_whose_host_a_reload_lists_is_no_longer_unlisted() {
    use rpma_tests::sessions::demo_config;
    const LATE: &str = "nqn.2026-11.io.rpma:listed-later";
    let d = rpma_tests::scratch();
    let mut t = rpma_tests::sessions::start(d.path(), "max_connections = 1");
    let src = Ipv4Addr::new(127, 0, 0, 3);
    let mut late = unlisted_session(t.port(), src, LATE).expect("a place for the unlisted host");
    wait_admission(&t, "the unlisted session holds the place", |a| {
        a["sessions"]["held"] == 1 && a["unlisted"]["held"] == 1
    });
    // OPEN lists LATE now, without a key (it still lets any host in).
    let config = demo_config("max_connections = 1", "").replacen(
        "allow_any_host = true",
        &format!("allow_any_host = true\nhosts = [{{ nqn = \"{LATE}\" }}]"),
        1,
    );
    assert!(config.contains(LATE), "{config}");
    t.rewrite(&config);
    t.reload();
    wait_admission(&t, "the session left the unlisted class", |a| {
        a["sessions"]["held"] == 1 && a["unlisted"]["held"] == 0
    });
    // A listed newcomer finds the target full, and takes nobody's place.
    let e = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts());
    assert!(
        matches!(
            e,
            Err(rpma_initiator::Error::Refused {
                reason: RefusalReason::TooManyConnections,
                ..
            })
        ),
        "a listed host took the place of a host listed by the reload: {e:?}"
    );
    assert!(
        late.still_open(),
        "the session of the host listed later was closed"
    );
    assert_eq!(t.status()["admission"]["sessions"]["evicted"], 0);
}
