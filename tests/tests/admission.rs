//! Admission under attack, end to end: the real `rpma-target` process; raw TCP/MPA peers from
//! other loopback addresses (127.0.0.2, ...) as attackers, each address a "source"; the
//! rpma-initiator library in-process as the allowed host (from 127.0.0.1). Every wait has a
//! deadline.

use std::io::Write;
use std::net::{Ipv4Addr, TcpStream};
use std::time::{Duration, Instant};

use rpma_common::fabric::soft::wire::mpa::{self, Answer, MpaConfig, Negotiated};
use rpma_common::fabric::soft::wire::tx::encode_fpdu;
use rpma_common::fabric::soft::wire::{Header, Opcode};
use rpma_common::proto::auth::Psk;
use rpma_common::proto::nqn::DISCOVERY_NQN;
use rpma_common::proto::{
    Connect, DiscoveryRequest, DiscoveryResponse, FlushStatus, HostId, KeepAlive, Message,
};
use rpma_initiator::{connect, discover, Error, HostIdentity};
use rpma_tests::sessions::{start, KEY, KEYED, OPEN, PLAIN, SUB, WAIT};
use rpma_tests::{counted_in_summaries, host, nqn, opts, scratch, summary_lines, tcp_from, Target};

/// The daemon's resident memory (VmRSS), in KiB.
fn rss_kib(t: &Target) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{}/status", t.pid())).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

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

/// 127.0.0.`n`: another source address on the loopback.
fn source(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, n)
}

/// A raw attacker: TCP from `src` to the target, then the MPA exchange; nothing more.
struct Raw {
    s: TcpStream,
    n: Negotiated,
    msn: u32,
}

/// TCP from `src` to 127.0.0.1:`port`, then an MPA Request: the target's answer.
fn raw_mpa(port: u16, src: Ipv4Addr) -> (TcpStream, Answer) {
    let mut s = tcp_from(port, src, WAIT);
    let cfg = MpaConfig {
        crc: false,
        ..MpaConfig::default()
    };
    let a = mpa::connect_exchange(&mut s, &cfg).unwrap();
    (s, a)
}

impl Raw {
    /// A connection from `src` that completed MPA (panics if the target rejected it).
    fn open(port: u16, src: Ipv4Addr) -> Raw {
        match raw_mpa(port, src) {
            (s, Answer::Accepted(n)) => Raw { s, n, msn: 1 },
            (_, other) => panic!("MPA from {src}: {other:?}"),
        }
    }

    /// Sends `m` as one RDMAP Send.
    fn send(&mut self, m: &[u8]) {
        let mut out = Vec::new();
        let h = Header::untagged(Opcode::Send, self.msn, true);
        encode_fpdu(&h, m, self.n.crc, &mut out).unwrap();
        self.msn += 1;
        self.s.write_all(&out).unwrap();
    }

    /// A discovery Connect asking for a one-hour keep-alive.
    fn discovery_connect(&mut self) {
        let c = Message::Connect(Connect {
            host_nqn: nqn("nqn.2026-11.io.rpma:attacker"),
            subsystem_nqn: nqn(DISCOVERY_NQN),
            host_id: HostId([9; 16]),
            queue_id: 0,
            keep_alive_ms: 3_600_000,
        });
        self.send(&c.encode().unwrap());
    }

    /// Waits for the target's first bytes (its answer to the Connect); panics after WAIT.
    fn answered(&mut self) {
        use std::io::Read;
        self.s.set_read_timeout(Some(WAIT)).unwrap();
        let mut b = [0u8; 64];
        let n = self.s.read(&mut b).unwrap();
        assert!(n > 0, "closed without an answer");
    }

    /// Whether the target closed the connection (EOF or reset) within `within`; what it sent
    /// meanwhile is read and dropped.
    fn closed_within(&mut self, within: Duration) -> bool {
        use std::io::Read;
        let deadline = Instant::now() + within;
        let mut buf = [0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            self.s.set_read_timeout(Some(left)).unwrap();
            match self.s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

/// Point 6: attackers from several addresses fill the unadmitted pool (MPA done, no Connect)
/// and the discovery pool (discovery Connects asking a one-hour keep-alive, keep-alives sent);
/// the allowed host still discovers and connects at once. Default pool sizes and per-source
/// caps; the deadlines are long (the attackers' connections stay for the whole test, even on a
/// slow machine); two poll loops, so that a pool also evicts from the other loop.
#[test]
fn an_allowed_host_gets_in_while_attackers_fill_the_other_pools() {
    let d = scratch();
    let t = start(
        d.path(),
        "handshake_timeout_ms = 60000\ndiscovery_max_keep_alive_ms = 60000\npoll_loops = 2",
    );
    // Discovery sessions: 5 addresses x 4 (the per-source cap) = 20 > 16 (the pool). Each
    // waits for the target's answer, so that all are in before the host comes.
    let mut disc = Vec::new();
    for a in 20..25 {
        for _ in 0..4 {
            let mut r = Raw::open(t.port(), source(a));
            r.discovery_connect();
            r.answered();
            disc.push(r);
        }
    }
    for r in &mut disc[4..] {
        r.send(&KeepAlive { seq: 1 }.encode());
    }
    // Half-open connections: 9 addresses x 8 (the per-source cap) = 72 > 64 (the pool).
    let mut half = Vec::new();
    for a in 2..11 {
        for _ in 0..8 {
            half.push(Raw::open(t.port(), source(a)));
        }
    }
    // The 8 oldest made room and are closed at once (not at their deadline, a minute away).
    assert!(
        half[7].closed_within(Duration::from_secs(2)),
        "the last evicted connection is still open"
    );

    // The allowed host: discovery, then a session that works.
    let started = Instant::now();
    let entries = discover(&t.url(), &host(PLAIN), &opts()).unwrap();
    let names: Vec<String> = entries
        .iter()
        .map(|e| e.subsystem_nqn.to_string())
        .collect();
    assert_eq!(names, [OPEN, SUB]);
    let mut s = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap();
    assert_eq!(s.flush(1, 0, 4096, WAIT).unwrap(), FlushStatus::Durable);
    // At once, not after the attackers' handshake deadline (60 s): 20 s leaves a loaded
    // machine its slowness.
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the host took {:?}",
        started.elapsed()
    );

    // The attackers filled the pools: the newest took the oldest's places (the host's first
    // connection took one more; its second found the place the first left), and the host's
    // discovery session has ended.
    wait_admission(
        &t,
        "the pools as the attackers and the host left them",
        |a| {
            a["unadmitted"]["held"] == 63
                && a["unadmitted"]["evicted"] == 9
                && a["discovery"]["held"] == 15
                && a["discovery"]["evicted"] == 5
                && a["sessions"]["held"] == 1
        },
    );
    assert!(half[0].closed_within(WAIT), "the oldest was not evicted");
    assert!(
        half[8].closed_within(WAIT),
        "the host's connection evicted the next oldest"
    );
    assert!(!half[71].closed_within(Duration::from_millis(100)));
    // The attackers' keep-alive (one hour asked) was cut to the discovery maximum.
    let st = t.status();
    let longest = st["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["kind"] == "discovery")
        .map(|x| x["keep_alive_ms"].as_u64().unwrap())
        .max();
    assert_eq!(longest, Some(60_000), "{}", st["sessions"]);
    // Past its cap, an address's newcomer takes the place of that address's own oldest, not
    // another's: a 5th discovery session of 127.0.0.24 (whose four are among the newest)...
    let mut over = Raw::open(t.port(), source(24));
    over.discovery_connect();
    over.answered();
    assert!(
        disc[16].closed_within(WAIT),
        "127.0.0.24's oldest discovery session"
    );
    assert!(!disc[17].closed_within(Duration::from_millis(100)));
    assert!(
        !disc[12].closed_within(Duration::from_millis(100)),
        "127.0.0.23's"
    );
    // ...and a 9th half-open connection of 127.0.0.10, accepted at MPA.
    let (_s, answer) = raw_mpa(t.port(), source(10));
    assert!(
        matches!(answer, Answer::Accepted(_)),
        "a 9th half-open connection of 127.0.0.10: {answer:?}"
    );
    assert!(half[64].closed_within(WAIT), "127.0.0.10's oldest");
    assert!(!half[65].closed_within(Duration::from_millis(100)));
    // The session was not disturbed.
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
}

/// Point 7: a half-open connection holds only what its control exchange needs, and the
/// unadmitted pool bounds what all of them hold together. Default budgets (64, 8 per address).
#[test]
fn half_open_connections_hold_little_memory_and_the_pool_bounds_it() {
    const POOL: usize = 64;
    let d = scratch();
    let t = start(d.path(), "");
    // Warm up the paths a connection takes once, so that the baseline holds the code and the
    // allocator's first arenas.
    drop(
        (0..8)
            .map(|_| Raw::open(t.port(), source(2)))
            .collect::<Vec<_>>(),
    );
    // Their loop frees them when it sees them close.
    wait_admission(&t, "the warm-up connections freed", |a| {
        a["unadmitted"]["held"].as_u64() == Some(0)
    });
    let base = rss_kib(&t);
    let mut held = Vec::new();
    for a in 2..10 {
        for _ in 0..8 {
            held.push(Raw::open(t.port(), source(a)));
        }
    }
    let full = rss_kib(&t);
    let each = full.saturating_sub(base) / POOL as u64;
    eprintln!("{POOL} half-open connections: {base} KiB -> {full} KiB, {each} KiB each");
    // Before this was bounded a connection held ~1.2 MiB (a session's 132 receive slots of
    // 8 KiB and 16 send slots) from its MPA exchange on.
    assert!(
        each <= 160,
        "{each} KiB per half-open connection ({base} -> {full} KiB)"
    );
    // Four times the pool: the newest take the oldest's places; memory stays bounded.
    for a in 10..34 {
        for _ in 0..8 {
            held.push(Raw::open(t.port(), source(a)));
        }
    }
    wait_admission(&t, "the pool evicted", |a| {
        a["unadmitted"]["held"].as_u64() <= Some(POOL as u64)
            && a["unadmitted"]["evicted"].as_u64() > Some(0)
    });
    // Evicted connections (or, on a slow machine, timed-out ones) are closed and freed by
    // their loop.
    assert!(held[3 * POOL - 1].closed_within(WAIT));
    let after = rss_kib(&t);
    eprintln!("{} connections made: {after} KiB", 4 * POOL);
    assert!(
        after.saturating_sub(base) <= POOL as u64 * 160 + 8 * 1024,
        "{base} -> {after} KiB after {} half-open connections",
        4 * POOL
    );
    // An allowed host gets in meanwhile.
    let mut s = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap();
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
}

/// New connections queued for a poll loop that is busy (here, stalled by a test hook) whose
/// places newer ones of their source took meanwhile are rejected when the loop comes to them:
/// nothing is made for them. (A flood of requests got a queue pair, its buffers and an MPA
/// Reply each, all closed again at the loop's next tick; the loop took every queued request in
/// one pass, its sessions and watchdog heartbeat waiting.)
#[test]
fn requests_whose_place_was_taken_while_they_waited_are_not_accepted() {
    let d = scratch();
    let t = rpma_tests::sessions::start_with_env(
        d.path(),
        "poll_loops = 1\nmax_unadmitted_per_source = 2\nhandshake_timeout_ms = 60000",
        &[("RPMA_TARGET_TEST_STALL_ON_RELOAD_MS", "8000")],
    );
    t.signal(nix::sys::signal::Signal::SIGHUP);
    t.expect("STATUS=test hook: stalling", WAIT);
    // Ten MPA Requests from one source while the loop stalls, each waiting for its answer.
    let port = t.port();
    let tries: Vec<_> = (0..10)
        .map(|_| std::thread::spawn(move || raw_mpa(port, source(9)).1))
        .collect();
    // The acceptor took a place for each in turn, evicting the source's older ones.
    wait_admission(&t, "eight places taken back", |a| {
        a["unadmitted"]["evicted"].as_u64() >= Some(8)
    });
    t.expect("STATUS=test hook: stall over", WAIT);
    let accepted = tries
        .into_iter()
        .map(|h| h.join().unwrap())
        .filter(|a| matches!(a, Answer::Accepted(_)))
        .count();
    assert_eq!(accepted, 2, "the source's cap is 2");
}

/// Point 8: one peer's flood of refused Connects makes one WARN line per period, and a line
/// per period counts the ones suppressed.
#[test]
fn refusals_of_one_peer_are_logged_rate_limited_with_a_count() {
    let d = scratch();
    // A refused connection keeps its unadmitted place until the peer has closed: a generous
    // per-source cap, so that a slow target is not also refusing at MPA.
    let t = start(
        d.path(),
        "refusal_log_period_ms = 2000\nmax_unadmitted_per_source = 64",
    );
    let unknown = nqn("nqn.2026-11.io.rpma:nope");
    let n = 300;
    let flood = Instant::now();
    for _ in 0..n {
        match connect(&t.url(), &unknown, &host(PLAIN), &opts()) {
            Err(Error::UnknownSubsystem { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    let flood = flood.elapsed();
    // One WARN line per started period of the flood, not one per refusal.
    let log = t.log();
    let warns: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("refused host"))
        .collect();
    let periods = flood.as_millis() as usize / 2000 + 1;
    assert!(
        !warns.is_empty() && warns.len() <= periods,
        "{} WARN lines in {flood:?}",
        warns.len()
    );
    // The count of the suppressed ones comes within a period after the first of them.
    let deadline = Instant::now() + WAIT;
    let summary = loop {
        let log = t.log();
        if let Some(l) = summary_lines(&log).next() {
            break l.to_owned();
        }
        assert!(Instant::now() < deadline, "no summary line:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        summary.contains("WARN") && summary.contains("most from 127.0.0.1"),
        "{summary}"
    );
    // Every refusal is either a WARN line or counted in a summary line (the last period's
    // comes a period after its first suppressed one).
    let counted = |log: &str| counted_in_summaries(log) as usize;
    let deadline = Instant::now() + WAIT;
    while warns.len() + counted(&t.log()) < n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(warns.len() + counted(&t.log()), n, "{}", t.log());
}

/// Point 9: a host with a key proves it before discovery lists the subsystems that need it.
#[test]
fn discovery_shows_a_keyed_subsystem_only_to_the_holder_of_the_key() {
    let d = scratch();
    let t = start(d.path(), "");
    let names = |h: &HostIdentity| -> Result<Vec<String>, Error> {
        discover(&t.url(), h, &opts()).map(|e| {
            e.iter()
                .map(|e| e.subsystem_nqn.to_string())
                .collect::<Vec<_>>()
        })
    };
    // Claiming the keyed host's NQN without its key shows nothing.
    let e = names(&host(KEYED));
    assert!(matches!(e, Err(Error::KeyRequired)), "{e:?}");
    let wrong = host(KEYED).with_psk(Psk::from_hex(&"5b".repeat(32)).unwrap());
    let e = names(&wrong);
    assert!(matches!(e, Err(Error::AuthFailed { .. })), "{e:?}");
    // With the key (the target proves it too): the subsystem that needs it.
    let right = host(KEYED).with_psk(Psk::from_hex(&KEY.repeat(32)).unwrap());
    assert_eq!(names(&right).unwrap(), [OPEN, SUB]);
    // Hosts without a key are not asked for one.
    assert_eq!(names(&host(PLAIN)).unwrap(), [OPEN, SUB]);
    assert_eq!(
        names(&host("nqn.2026-11.io.rpma:stranger")).unwrap(),
        [OPEN]
    );
}

rpma_tests::rdma_runs!(
    discovery_shows_a_keyed_subsystem_only_to_the_holder_of_the_key,
    a_discovery_listing_longer_than_one_message_comes_in_pages,
);

/// `n` subsystems any host may connect to, s0 to s(n-1), each with a namespace; discovery
/// sessions that may last an hour.
fn subsystems(n: usize) -> String {
    let mut config = rpma_tests::Config::new()
        .set("discovery_max_keep_alive_ms = 3600000")
        .set("discovery_timeout_ms = 3600000");
    for i in 0..n {
        config = config.subsystem(
            rpma_tests::Subsystem::new(&format!("nqn.2026-11.io.rpma:s{i}"))
                .any_host()
                .namespace(rpma_tests::Namespace::new(1, &format!("s{i}"), "64KiB")),
        );
    }
    config.to_string()
}

/// Page `start` of a discovery session's listing.
fn discovery_page(s: &mut rpma_initiator::Session, start: u32) -> DiscoveryResponse {
    s.send_message(&Message::DiscoveryRequest(DiscoveryRequest { start }))
        .unwrap();
    match s.wait_message(WAIT, "DiscoveryResponse").unwrap() {
        Message::DiscoveryResponse(r) => r,
        other => panic!("{other:?}"),
    }
}

/// A discovery listing longer than one message (a host that may connect to 250 subsystems)
/// comes in pages: the host gets all of it, in order, and `check-config` has nothing to warn
/// of. A reload between two pages changes the listing's generation, which tells a host that
/// reads them to start again. (Before protocol version 7 such a host was refused with a
/// Disconnect, "would list 250 subsystems", and check-config warned of it.)
#[test]
fn a_discovery_listing_longer_than_one_message_comes_in_pages() {
    let d = scratch();
    let mut t = Target::start(d.path(), &subsystems(250));
    let names: Vec<String> = discover(&t.url(), &host(PLAIN), &opts())
        .unwrap()
        .iter()
        .map(|e| e.subsystem_nqn.to_string())
        .collect();
    let all: Vec<String> = (0..250)
        .map(|i| format!("nqn.2026-11.io.rpma:s{i}"))
        .collect();
    assert_eq!(names, all);
    let out = rpma_tests::check_config(&d.path().join("target.toml"));
    let text = rpma_tests::text(&out);
    assert!(out.status.success(), "{text}");
    // (Nothing of the listing; 250 namespaces are more than the state file lists failed at
    // once, which it says: check_config's `check_config_warns_when_the_state_file_cannot_list_every_failure`.)
    let warned: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("warning") && !l.contains("the state file lists"))
        .collect();
    assert!(warned.is_empty(), "{text}");

    // Page by page on one discovery session, with a reload between two pages (its keep-alive
    // and time limit outlast the test).
    let patient = rpma_initiator::ConnectOptions {
        keep_alive: Duration::from_secs(3600),
        ..opts()
    };
    let mut s = connect(&t.url(), &nqn(DISCOVERY_NQN), &host(PLAIN), &patient).unwrap();
    let first = discovery_page(&mut s, 0);
    let n = first.entries.len();
    assert_eq!(first.total, 250);
    assert!(n > 0 && n < 250, "{n}");
    let second = discovery_page(&mut s, n as u32);
    assert_eq!((second.total, second.generation), (250, first.generation));
    assert_eq!(second.entries[0].subsystem_nqn.as_str(), all[n]);
    std::fs::write(d.path().join("target.toml"), subsystems(249)).unwrap();
    t.reload();
    let third = discovery_page(&mut s, n as u32);
    assert_eq!(third.total, 249);
    assert_ne!(third.generation, first.generation);
}
