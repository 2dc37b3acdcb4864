//! Liveness: an idle daemon sleeps, silent peers delay no one and are closed at their deadline,
//! the watchdog stops when a poll loop is stuck.
//! The real `rpma-target` process and the rpma-initiator library in-process (the fixture of
//! [`rpma_tests::sessions`]); every wait has a deadline.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rpma_common::fabric::WcStatus;
use rpma_common::proto::nqn::DISCOVERY_NQN;
use rpma_common::proto::FlushStatus;
use rpma_initiator::{connect, identify, ConnectOptions};
use rpma_tests::sessions::*;
use rpma_tests::{host, nqn, opts, scratch};

/// utime + stime of a process, in clock ticks (/proc/PID/stat fields 14 and 15).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14, stime field 15.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Voluntary context switches of every thread of a process: how often its threads went to
/// sleep, i.e. woke up.
fn wakeups(pid: u32) -> u64 {
    let mut n = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let Ok(st) = std::fs::read_to_string(task.unwrap().path().join("status")) else {
            continue; // a thread that just ended
        };
        n += st
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .map_or(0, |v| v.trim().parse::<u64>().unwrap());
    }
    n
}

#[test]
fn idle_daemon_with_a_session_uses_no_cpu() {
    let d = scratch();
    // Two poll loops, a keep-alive longer than the measurement: nothing needs to happen.
    let t = start(d.path(), "poll_loops = 2\nkeep_alive_ms = 30000");
    let mut s = session(&t);
    assert_eq!(s.flush(1, 0, 4096, WAIT).unwrap(), FlushStatus::Durable);
    // A discovery connection held open too.
    let _disc = connect(&t.url(), &nqn(DISCOVERY_NQN), &host(PLAIN), &opts()).unwrap();
    // Let the busy-poll spells and the start-up settle.
    std::thread::sleep(Duration::from_millis(200));
    let pid = t.pid();
    let before = cpu_ticks(pid);
    let woke_before = wakeups(pid);
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    let woke = wakeups(pid) - woke_before;
    let used = cpu_ticks(pid) - before;
    let elapsed = start.elapsed();
    eprintln!("idle target: {used} tick(s) of CPU, {woke} wake-up(s) in {elapsed:?}");
    // A loop with a bounded wait (say 20 ms) wakes 50 times a second; a sleeping target not
    // at all (the status thread is not asked, keep-alives are 30 s apart).
    assert!(woke <= 5, "an idle target woke {woke} times in {elapsed:?}");
    // A loop that woke every few milliseconds would show here; a sleeping one shows 0 (1 for a
    // tick that happened to be charged to it). Generous: this is not a speed test.
    assert!(
        used <= 2,
        "an idle target used {used} clock ticks in {elapsed:?}"
    );
    // And the session still works after the idle spell.
    assert_eq!(s.flush(1, 0, 4096, WAIT).unwrap(), FlushStatus::Durable);
}

#[test]
fn silent_peers_delay_no_one_and_are_closed_after_their_deadline() {
    use std::io::Read;
    let d = scratch();
    let t = start(d.path(), "");
    let mut silent: Vec<std::net::TcpStream> = (0..20)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", t.port())).unwrap())
        .collect();
    let opened = Instant::now();
    // A real host gets through at once, for identify and for a session.
    let id = identify(&t.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap();
    let ns: Vec<u32> = id.namespaces.iter().map(|n| n.nsid).collect();
    assert_eq!(ns, [1, 3]);
    // This session idles while the test waits out the silent peers' deadline (MPA_TIMEOUT):
    // a keep-alive period longer than that wait keeps it alive without ticks.
    let idle = ConnectOptions {
        keep_alive: rpma_target::serve::MPA_TIMEOUT * 4,
        ..opts()
    };
    let mut s = connect(&t.url(), &nqn(SUB), &host(PLAIN), &idle).unwrap();
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    // Not behind them: in before their deadline (a host that waited for their places would
    // get in only after it).
    let got_in = opened.elapsed();
    assert!(
        got_in < rpma_target::serve::MPA_TIMEOUT,
        "the host waited {got_in:?} behind silent peers"
    );
    // The silent ones are still open before their deadline (judged when the machine left time
    // to: a loaded one may be past it already)...
    let mut byte = [0u8; 1];
    if got_in + Duration::from_millis(1200) < rpma_target::serve::MPA_TIMEOUT {
        silent[0]
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let early = silent[0].read(&mut byte);
        assert!(
            early.as_ref().is_err_and(|e| matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            )),
            "closed before its deadline: {early:?}"
        );
    }
    // ...and closed (EOF, nothing sent) once it passed.
    let deadline = opened + rpma_target::serve::MPA_TIMEOUT + Duration::from_secs(5);
    for c in &mut silent {
        c.set_read_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        ))
        .unwrap();
        match c.read(&mut byte) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("a silent peer was not closed by its deadline: {other:?}"),
        }
    }
    assert!(
        opened.elapsed() >= rpma_target::serve::MPA_TIMEOUT - Duration::from_millis(500),
        "closed early: {:?}",
        opened.elapsed()
    );
    // The session was not disturbed.
    s.tick().unwrap();
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
}

/// Asserts that a connect was refused as the target being full (`what` and the namespaces'
/// count of a session that got in say otherwise).
fn assert_refused_as_full(r: &Result<rpma_initiator::Session, rpma_initiator::Error>, what: &str) {
    assert!(
        matches!(
            r,
            Err(rpma_initiator::Error::Refused {
                reason: rpma_common::proto::RefusalReason::TooManyConnections,
                ..
            })
        ),
        "{what}: {:?}",
        r.as_ref().map(|s| s.namespaces().len())
    );
}

/// The top of [`start_held`]'s configuration: one poll loop, and unadmitted connections kept
/// for a minute (a test's own connections wait in the pool for no deadline of the machine's).
const HELD_TOP: &str = "poll_loops = 1\nhandshake_timeout_ms = 60000";

/// A target with [`HELD_TOP`] whose registrations wait while `go` is not there (the test
/// hook), started with `go` there; SUB has `extra` namespaces after its own.
fn start_held(dir: &std::path::Path, extra: &str, go: &std::path::Path) -> rpma_tests::Target {
    std::fs::write(go, b"").unwrap();
    let hook = rpma_target::serve::TEST_REGISTER_HOLD_ENV;
    start_with_extra(dir, HELD_TOP, extra, &[(hook, go.to_str().unwrap())])
}

/// Connects `host_nqn` to `sub` in a thread of its own, with a deadline far beyond the test's.
fn patient_connect(
    t: &rpma_tests::Target,
    sub: &'static str,
    host_nqn: &'static str,
) -> std::thread::JoinHandle<Result<rpma_initiator::Session, rpma_initiator::Error>> {
    let url = t.url();
    std::thread::spawn(move || {
        let patient = ConnectOptions {
            timeout: Duration::from_secs(600),
            ..opts()
        };
        connect(&url, &nqn(sub), &host(host_nqn), &patient)
    })
}

/// Takes `go` away and connects `host` to `sub` in a thread of its own (a deadline far beyond
/// the test's), once the target said that its registration waits.
fn held_newcomer(
    t: &rpma_tests::Target,
    go: &std::path::Path,
    sub: &'static str,
    host_nqn: &'static str,
) -> std::thread::JoinHandle<Result<rpma_initiator::Session, rpma_initiator::Error>> {
    std::fs::remove_file(go).unwrap();
    let before = waits(t);
    let newcomer = patient_connect(t, sub, host_nqn);
    let deadline = Instant::now() + WAIT;
    while waits(t) == before {
        assert!(
            Instant::now() < deadline,
            "no registration of the newcomer waits"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    newcomer
}

/// How many times the target said a registration waits (the test hook).
fn waits(t: &rpma_tests::Target) -> usize {
    said(t, "test hook: a registration waits")
}

/// How many lines of the target's log say `what`.
fn said(t: &rpma_tests::Target, what: &str) -> usize {
    t.log().lines().filter(|l| l.contains(what)).count()
}

/// A target with [`HELD_TOP`] whose deregistrations (a session's end) wait while `go` is not
/// there (the test hook), started with `go` there.
fn start_held_release(dir: &std::path::Path, go: &std::path::Path) -> rpma_tests::Target {
    std::fs::write(go, b"").unwrap();
    let hook = rpma_target::serve::TEST_DEREGISTER_HOLD_ENV;
    start_with_extra(dir, HELD_TOP, "", &[(hook, go.to_str().unwrap())])
}

/// Waits until the target said that a deregistration waits (the test hook).
fn wait_for_held_release(t: &rpma_tests::Target) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while said(t, "test hook: a deregistration waits") == 0 {
        assert!(Instant::now() < deadline, "no deregistration waits");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A session of PLAIN with SUB whose keep-alive outlasts the test (it sends nothing while the
/// test waits for the target's log).
fn patient_session(t: &rpma_tests::Target) -> rpma_initiator::Session {
    let o = ConnectOptions {
        keep_alive: Duration::from_secs(600),
        ..opts()
    };
    connect(&t.url(), &nqn(SUB), &host(PLAIN), &o).unwrap()
}

/// OPEN's namespace 1 in `s`, as a remote address.
fn open_ns1(s: &rpma_initiator::Session) -> rpma_common::fabric::RemoteAddr {
    let n = s.namespace(1).unwrap();
    rpma_common::fabric::RemoteAddr {
        addr: n.remote_addr,
        rkey: n.rkey,
    }
}

/// Waits until OPEN's namespace is held by no session's registration (status).
fn wait_for_open_released(t: &rpma_tests::Target) {
    let deadline = Instant::now() + WAIT;
    loop {
        let v = t.status();
        let holders = &v["subsystems"][0]["namespaces"][0]["counters"]["sessions"];
        if holders == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "not deregistered: {v}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A reload that removes a namespace of its subsystem while a newcomer's registrations are
/// under way closes the newcomer's connection at once (its queue pair in Error: nothing
/// registered for it, a region over the removed file included, is reachable after the reload
/// is done), and it connects again to the namespaces as they are; one that adds a namespace
/// has the registrations made again, and the newcomer is admitted with it. (Before: admitted
/// with the namespaces as they were, the removed one included.)
#[test]
fn a_host_admitted_across_a_reload_gets_the_namespaces_as_they_are_after_it() {
    let ns2 = "[[subsystem.namespace]]\nnsid = 2\npath = \"ns2\"\nsize = \"1MiB\"\n";
    let d = scratch();
    let go = d.path().join("registrations-go");
    let mut t = start_held(d.path(), ns2, &go);
    let newcomer = held_newcomer(&t, &go, SUB, PLAIN);
    // nsid 2 removed; the reload is done (READY) while the registrations wait.
    t.rewrite(&demo_config(HELD_TOP, ""));
    t.reload();
    let closed = t.log_lines(&["closed while its namespaces were being registered"], WAIT);
    assert!(!closed.is_empty(), "the reload left the newcomer alone");
    std::fs::write(&go, b"").unwrap();
    let e = newcomer
        .join()
        .unwrap()
        .map(|s| s.namespaces().len())
        .expect_err("not admitted");
    let again = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap();
    let nsids: Vec<u32> = again.namespaces().iter().map(|d| d.nsid).collect();
    assert_eq!(nsids, [1, 3], "the namespaces after the reload ({e})");
    // nsid 2 added back while another newcomer waits: admitted with it.
    let newcomer = held_newcomer(&t, &go, SUB, PLAIN);
    t.rewrite(&demo_config(HELD_TOP, ns2));
    t.reload();
    std::fs::write(&go, b"").unwrap();
    let n = newcomer.join().unwrap().expect("admitted once registered");
    let nsids: Vec<u32> = n.namespaces().iter().map(|d| d.nsid).collect();
    assert_eq!(nsids, [1, 2, 3]);
}

/// A reload that takes the host off its subsystem while its registrations are under way: it is
/// not admitted (a helper's review: it was, after READY).
#[test]
fn a_host_a_reload_removed_while_its_namespaces_were_registered_is_not_admitted() {
    let d = scratch();
    let go = d.path().join("registrations-go");
    let mut t = start_held(d.path(), "", &go);
    let newcomer = held_newcomer(&t, &go, SUB, PLAIN);
    let text = demo_config(HELD_TOP, "").replace(
        &format!("\"{PLAIN}\""),
        "\"nqn.2026-11.io.rpma:someone-else\"",
    );
    assert!(!text.contains(PLAIN), "{text}");
    t.rewrite(&text);
    t.reload();
    let closed = t.log_lines(&["closed while its namespaces were being registered"], WAIT);
    assert!(!closed.is_empty(), "the reload left the newcomer alone");
    std::fs::write(&go, b"").unwrap();
    let r = newcomer.join().unwrap();
    assert!(
        r.is_err(),
        "admitted after the reload that removed it: {:?}",
        r.map(|s| s.namespaces().len())
    );
}

/// A host whose registrations are under way has left the unadmitted pool: unadmitted
/// connections from its own address, up to the pool's cap for it, take nothing from it (a
/// helper's review: the oldest of that source's places was its own, and it was evicted).
#[test]
fn unadmitted_connections_from_its_address_do_not_evict_a_host_being_registered() {
    let d = scratch();
    let go = d.path().join("registrations-go");
    let t = start_held(d.path(), "", &go);
    let newcomer = held_newcomer(&t, &go, SUB, PLAIN);
    let cap = t.status()["admission"]["unadmitted"]["per_source_limit"]
        .as_u64()
        .unwrap() as usize;
    let _flood: Vec<_> = (0..cap).map(|_| half_open(&t.url())).collect();
    let deadline = Instant::now() + WAIT;
    let pool = loop {
        let p = t.status()["admission"]["unadmitted"].clone();
        if p["held"].as_u64() == Some(cap as u64) {
            break p;
        }
        assert!(Instant::now() < deadline, "the flood never got in: {p}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(pool["evicted"], 0, "a place taken back: {pool}");
    std::fs::write(&go, b"").unwrap();
    let n = newcomer.join().unwrap().expect("admitted once registered");
    assert!(!n.namespaces().is_empty());
}

/// Hosts whose registrations are under way hold a session's place, as sessions do: with one
/// place, held by an unlisted newcomer whose registrations wait, a second unlisted host is
/// refused at once as the target is full (a helper's review: any number of hosts could wait
/// for registrations, each pinning its namespaces), and a listed host takes the newcomer's
/// place.
#[test]
fn hosts_being_registered_count_against_max_connections() {
    let d = scratch();
    let go = d.path().join("registrations-go");
    std::fs::write(&go, b"").unwrap();
    let hook = rpma_target::serve::TEST_REGISTER_HOLD_ENV;
    let t = start_with_env(
        d.path(),
        "poll_loops = 1\nmax_connections = 1",
        &[(hook, go.to_str().unwrap())],
    );
    let newcomer = held_newcomer(&t, &go, OPEN, OPEN_HOST);
    let second = connect(
        &t.url(),
        &nqn(OPEN),
        &host("nqn.2026-11.io.rpma:another-any-host"),
        &opts(),
    );
    assert_refused_as_full(&second, "a second unlisted host");
    // A host its subsystem lists takes the unlisted newcomer's place, as it would a
    // session's (a helper's review: it was refused while the newcomer's registrations were
    // under way, so that unlisted hosts kept the listed ones out by registering in turn).
    let listed = patient_connect(&t, SUB, PLAIN);
    let deadline = Instant::now() + WAIT;
    while !newcomer.is_finished() && !listed.is_finished() {
        assert!(Instant::now() < deadline, "neither host was told anything");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!listed.is_finished(), "the listed host was not let in");
    // Refused as the full target it is now (it lost its connection without a word before).
    let lost = newcomer.join().unwrap();
    assert_refused_as_full(&lost, "the unlisted newcomer");
    std::fs::write(&go, b"").unwrap();
    let s = listed.join().unwrap().expect("admitted once registered");
    assert_eq!(s.namespaces().len(), 2);
}

/// A reload that lists a host (without a key) while its registrations are under way, on a
/// subsystem that let it in by `allow_any_host`: it is a listed host from then on, as a
/// session would be, so a listed newcomer to the full target does not take its place (a
/// helper's review: it stayed in the lowest class and was evicted).
#[test]
fn a_host_a_reload_lists_while_its_namespaces_are_registered_is_a_listed_host() {
    let d = scratch();
    let go = d.path().join("registrations-go");
    std::fs::write(&go, b"").unwrap();
    let hook = rpma_target::serve::TEST_REGISTER_HOLD_ENV;
    let top = format!("{HELD_TOP}\nmax_connections = 1");
    let mut t = start_with_env(d.path(), &top, &[(hook, go.to_str().unwrap())]);
    let newcomer = held_newcomer(&t, &go, OPEN, OPEN_HOST);
    let any = "allow_any_host = true\n";
    let text = demo_config(&top, "").replacen(
        any,
        &format!("{any}hosts = [{{ nqn = \"{OPEN_HOST}\" }}]\n"),
        1,
    );
    assert!(text.contains(&format!("nqn = \"{OPEN_HOST}\"")), "{text}");
    t.rewrite(&text);
    t.reload();
    let listed = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts());
    assert_refused_as_full(
        &listed,
        "a listed host took the place of a host listed by the reload",
    );
    std::fs::write(&go, b"").unwrap();
    newcomer.join().unwrap().expect("admitted once registered");
}

/// A host refused while its namespaces are being registered (here: a message out of place)
/// gives its session's place back whole: its place among the sessions a host of a higher
/// standing may take goes with it at once, not at the end of its linger (a helper's review: it
/// stayed there, so a listed newcomer's room-making took that stale place, freed nothing, and
/// was let in past max_connections).
#[test]
fn a_host_refused_while_being_registered_leaves_no_place_behind() {
    use rpma_common::proto::{Connect, HostId, KeepAlive, Message};
    let d = scratch();
    let go = d.path().join("registrations-go");
    let t = start_held(d.path(), "", &go);
    std::fs::remove_file(&go).unwrap();
    let mut raw = RawHost::connect(&t.url());
    raw.send(&Message::Connect(Connect {
        host_nqn: nqn(OPEN_HOST),
        subsystem_nqn: nqn(OPEN),
        host_id: HostId([3; 16]),
        queue_id: 0,
        keep_alive_ms: 0,
    }));
    assert!(
        !t.log_lines(&["test hook: a registration waits"], WAIT)
            .is_empty(),
        "no registration waits"
    );
    let pools = t.status()["admission"].clone();
    assert_eq!(pools["unlisted"]["held"], 1, "its place: {pools}");
    raw.send(&Message::KeepAlive(KeepAlive { seq: 1 }));
    let m = raw.recv();
    assert!(matches!(m, Message::Refusal(_)), "{m:?}");
    // Refused (and lingering, its queue pair open): nothing of it is held any more.
    let pools = t.status()["admission"].clone();
    assert_eq!(pools["unlisted"]["held"], 0, "a place left behind: {pools}");
    assert_eq!(pools["sessions"]["held"], 0, "a place left behind: {pools}");
    std::fs::write(&go, b"").unwrap();
}

/// A host whose registrations take longer than its keep-alive period gets a session that
/// works: the period runs from its admission, not from its Connect (a helper's review: the
/// session was closed at once for a lapsed keep-alive, and the host, reconnecting, met the
/// same). The hold lasts longer than the period, a lower bound only.
#[test]
fn a_host_whose_registrations_outlast_its_keep_alive_gets_a_working_session() {
    let d = scratch();
    let go = d.path().join("registrations-go");
    let t = start_held(d.path(), "", &go);
    std::fs::remove_file(&go).unwrap();
    let before = waits(&t);
    let url = t.url();
    let keep_alive = Duration::from_secs(1);
    let newcomer = std::thread::spawn(move || {
        let o = ConnectOptions {
            timeout: Duration::from_secs(600),
            keep_alive,
            ..opts()
        };
        connect(&url, &nqn(SUB), &host(PLAIN), &o)
    });
    let deadline = Instant::now() + WAIT;
    while waits(&t) == before {
        assert!(Instant::now() < deadline, "no registration waits");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(keep_alive + keep_alive / 2);
    std::fs::write(&go, b"").unwrap();
    let mut s = newcomer.join().unwrap().expect("admitted once registered");
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    assert!(
        t.log_lines(&["keep-alive of"], Duration::ZERO).is_empty(),
        "{}",
        t.log()
    );
}

/// A host whose namespaces take long to register (pinning a big namespace on `rdma://`; held
/// here by the target's test hook until the test lets it go) delays no session of the poll
/// loop it lands on: a session's durability requests are answered while the newcomer waits,
/// and the newcomer gets in once its registrations are done. (Before: the loop registered
/// them itself, and every session of the loop waited as long: the request below timed out.)
#[test]
fn a_host_whose_namespaces_take_long_to_register_delays_no_other_session() {
    let d = scratch();
    let go = d.path().join("registrations-go");
    let t = start_held(d.path(), "", &go);
    let mut s = session(&t);
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    let newcomer = held_newcomer(&t, &go, OPEN, OPEN_HOST);
    // The session on the same (only) loop is served meanwhile.
    for _ in 0..3 {
        assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    }
    s.tick().unwrap();
    assert!(!newcomer.is_finished(), "the newcomer got in while held");
    // Let go: the newcomer is admitted, with its namespaces.
    std::fs::write(&go, b"").unwrap();
    let n = newcomer.join().unwrap().expect("admitted once registered");
    assert!(!n.namespaces().is_empty());
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
}

/// A session whose namespaces take long to deregister as it ends (unpinning a big namespace on
/// `rdma://`; held here by the target's test hook until the test lets it go) delays no session
/// of its poll loop: the loop's registrar drops them. (Before: the loop dropped them itself,
/// and every session of the loop waited as long: the request below timed out.)
#[test]
fn a_session_whose_namespaces_take_long_to_deregister_delays_no_other_session() {
    let d = scratch();
    let go = d.path().join("deregistrations-go");
    let t = start_held_release(d.path(), &go);
    let mut s = patient_session(&t);
    let leaving = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &opts()).unwrap();
    std::fs::remove_file(&go).unwrap();
    // Its host closes it; its deregistration waits.
    let _ = leaving.disconnect(WAIT);
    wait_for_held_release(&t);
    // The session on the same (only) loop is served meanwhile.
    for _ in 0..3 {
        assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    }
    s.tick().unwrap();
    std::fs::write(&go, b"").unwrap();
    wait_for_open_released(&t);
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
}

/// A host that connects while a closed session's deregistration takes long (unpinning a big
/// namespace on `rdma://`; held here by the target's test hook) is registered and admitted
/// meanwhile: a poll loop's deregistrations have a thread of their own. (Before: one registrar
/// thread took both in turn, and the newcomer's registration waited behind the release: its
/// connect timed out.)
#[test]
fn a_long_deregistration_delays_no_registration() {
    let d = scratch();
    let go = d.path().join("deregistrations-go");
    let t = start_held_release(d.path(), &go);
    let leaving = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &opts()).unwrap();
    std::fs::remove_file(&go).unwrap();
    let _ = leaving.disconnect(WAIT);
    wait_for_held_release(&t);
    // Admitted, and served, while the release still waits (`go` is written only after).
    let mut s = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap();
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    assert_eq!(said(&t, "test hook: a deregistration waits"), 1);
    std::fs::write(&go, b"").unwrap();
    wait_for_open_released(&t);
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
}

/// A session the target ends (here: its keep-alive lapsed) hears why, its Disconnect, only once
/// its namespaces are deregistered (a Write it sends after the Disconnect is refused:
/// rkeys.rs), and its deregistration, done off the loop, delays no other session. (Before: the
/// loop deregistered them itself: the request below timed out.)
#[test]
fn a_goodbye_waits_for_its_deregistration_and_delays_no_other_session() {
    let d = scratch();
    let go = d.path().join("deregistrations-go");
    let t = start_held_release(d.path(), &go);
    let mut s = patient_session(&t);
    // (Held from before it connects: nothing else drops a registration before the lapse.)
    let mut lapsing = lapsed_and_held(&t, &go);
    for _ in 0..3 {
        assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    }
    s.tick().unwrap();
    // No Disconnect while its regions are registered (a wait that can only miss a wrong one).
    match lapsing.wait_message(Duration::from_millis(300), "nothing") {
        Err(rpma_initiator::Error::Timeout { .. }) => {}
        other => panic!("{other:?}"),
    }
    std::fs::write(&go, b"").unwrap();
    assert_disconnected(&mut lapsing, "keep-alive");
    wait_for_open_released(&t);
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
}

/// A keep-alive that lapses within the test, when the host stops ticking.
fn short() -> ConnectOptions {
    ConnectOptions {
        keep_alive: Duration::from_millis(500),
        ..opts()
    }
}

/// A host of OPEN with a [`short`] keep-alive, connected once `t`'s deregistrations are held
/// (`go` taken away): it does not tick, and it is returned once its keep-alive lapsed and its
/// deregistration waits.
fn lapsed_and_held(t: &rpma_tests::Target, go: &std::path::Path) -> rpma_initiator::Session {
    std::fs::remove_file(go).unwrap();
    let lapsing = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &short()).unwrap();
    wait_for_held_release(t);
    lapsing
}

/// Waits for `s`'s Disconnect and asserts that its reason says `says`.
fn assert_disconnected(s: &mut rpma_initiator::Session, says: &str) {
    match s.wait_message(WAIT, "Disconnect") {
        Err(rpma_initiator::Error::Disconnected { reason }) => {
            assert!(reason.contains(says), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

/// A reload while a closed session's deregistration waits (its Disconnect with it) closes its
/// connection at once: the reload takes its host away, and once the reload is done a Write
/// with its rkey places nothing. (Before: the connection lingered with its regions registered
/// until the registrar dropped them, and the Write landed in the namespace.)
#[test]
fn a_reload_closes_a_connection_whose_deregistration_waits() {
    let d = scratch();
    let go = d.path().join("deregistrations-go");
    let mut t = start_held_release(d.path(), &go);
    let mut lapsing = lapsed_and_held(&t, &go);
    let remote = open_ns1(&lapsing);
    // OPEN lets only PLAIN in now; the reload is done (READY) while the deregistration still
    // waits.
    let config = demo_config(HELD_TOP, "");
    let closed = config.replacen(
        "allow_any_host = true\n",
        &format!("hosts = [{{ nqn = \"{PLAIN}\" }}]\n"),
        1,
    );
    assert_ne!(config, closed);
    t.rewrite(&closed);
    t.reload();
    let st = write_then_read(&mut lapsing, remote, b"after the reload");
    // (A Write completes at the host once sent; its Read after it says whether it arrived.)
    assert_ne!(st.last(), Some(&WcStatus::Success), "{st:?}");
    std::fs::write(&go, b"").unwrap();
    wait_for_open_released(&t);
    let file = std::fs::read(d.path().join("open1")).unwrap();
    assert!(file[..16].iter().all(|&b| b == 0), "the Write landed");
}

/// The stop says goodbye to a session whose deregistration takes long (held past the stop's
/// grace of a second): its Disconnect goes out once the regions are dropped, and the target
/// exits. (Before: the goodbye waited for the registrar, the grace ran out, and the host saw
/// its connection lost without a word.)
#[test]
fn the_stop_says_goodbye_to_a_session_whose_deregistration_takes_long() {
    let d = scratch();
    let go = d.path().join("deregistrations-go");
    let mut t = start_held_release(d.path(), &go);
    let mut s = patient_session(&t);
    std::fs::remove_file(&go).unwrap();
    t.signal(Signal::SIGTERM);
    wait_for_held_release(&t);
    // Past the stop's grace (a wait that can only miss the bug, never fail a correct target).
    std::thread::sleep(Duration::from_millis(1500));
    std::fs::write(&go, b"").unwrap();
    assert_disconnected(&mut s, "shutting down");
    assert!(t.wait_exit(WAIT).success());
}

/// A goodbye that waits for its session's deregistration when the stop comes still goes out
/// once the deregistration is done (within the stop's grace). (Before: the stop's wait did not
/// look at the registrar; the host saw its connection lost.)
#[test]
fn a_goodbye_that_waits_for_its_deregistration_at_the_stop_goes_out() {
    let d = scratch();
    let go = d.path().join("deregistrations-go");
    let mut t = start_held_release(d.path(), &go);
    let mut lapsing = lapsed_and_held(&t, &go);
    t.signal(Signal::SIGTERM);
    // The stop began (a deregistration let go before it would be answered before it: that can
    // only miss the bug).
    t.log_lines(&["SIGTERM: stopping"], WAIT);
    std::fs::write(&go, b"").unwrap();
    assert_disconnected(&mut lapsing, "keep-alive");
    assert!(t.wait_exit(WAIT).success());
}

/// A reload that does not touch a closed session whose deregistration waits (another
/// subsystem gains a namespace) leaves it alone: its Disconnect goes out once the
/// deregistration is done. (Before: any reload closed it without a word.)
#[test]
fn a_reload_elsewhere_leaves_a_goodbye_that_waits_for_its_deregistration() {
    let d = scratch();
    let go = d.path().join("deregistrations-go");
    let mut t = start_held_release(d.path(), &go);
    let mut lapsing = lapsed_and_held(&t, &go);
    let ns2 = "[[subsystem.namespace]]\nnsid = 2\npath = \"ns2\"\nsize = \"1MiB\"\n";
    t.rewrite(&demo_config(HELD_TOP, ns2));
    t.reload();
    std::fs::write(&go, b"").unwrap();
    assert_disconnected(&mut lapsing, "keep-alive");
}

#[test]
fn watchdog_pings_stop_while_a_poll_loop_is_stuck() {
    let d = scratch();
    // WATCHDOG_USEC 400 ms: a check every 200 ms. The test hook stalls the loop for 3 s when
    // it takes the reload command.
    let t = start_with_env(
        d.path(),
        "",
        &[
            ("WATCHDOG_USEC", "400000"),
            ("RPMA_TARGET_TEST_STALL_ON_RELOAD_MS", "3000"),
        ],
    );
    // Pings flow while every thread makes progress (an idle loop is woken by the check).
    for _ in 0..3 {
        t.expect("WATCHDOG=1", WAIT);
    }
    t.signal(Signal::SIGHUP);
    // Every notification from here, in order, until the hook says the stall is over (it says
    // when it starts and ends: no wall-clock guess at when the loop took the reload).
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|m: &String| m == "STATUS=test hook: stall over")
    {
        let m = t.next(WAIT);
        seen.push(m.unwrap_or_else(|| panic!("no notification in {WAIT:?}: {seen:?}")));
    }
    assert!(
        seen.iter().any(|m| m.starts_with("RELOADING=1")),
        "{seen:?}"
    );
    assert!(seen.iter().any(|m| m.starts_with("READY=1")), "{seen:?}");
    // While it stalled, at most one ping: a check under way as the stall began can still see
    // the loop's last turn; a watchdog that ignored the stuck loop pinged every 200 ms.
    let from = seen
        .iter()
        .position(|m| m == "STATUS=test hook: stalling")
        .unwrap_or_else(|| panic!("{seen:?}"));
    let pings = seen[from..].iter().filter(|m| *m == "WATCHDOG=1").count();
    assert!(
        pings <= 1,
        "watchdog pinged {pings} times while the loop was stuck: {seen:?}"
    );
    assert!(
        !t.log_lines(&["rpma-loop-0", "made no progress"], WAIT)
            .is_empty(),
        "{}",
        t.log()
    );
    // The loop comes back: so do the pings.
    t.expect("WATCHDOG=1", WAIT);
}

/// A reload that holds the daemon's state (and its main thread) for long, as one that maps a big
/// namespace ahead of use does, does not stop the watchdog's pings while every serving thread
/// turns. (The main thread ran the reload and sent no ping until it was done: with the unit's
/// WatchdogSec=30s, the service manager killed a daemon that reloaded an 8 GiB namespace.)
#[test]
fn watchdog_pings_go_on_through_a_long_reload() {
    let d = scratch();
    // WATCHDOG_USEC 400 ms: a check every 200 ms; the reload holds the state for 3 s.
    let t = start_with_env(
        d.path(),
        "",
        &[
            ("WATCHDOG_USEC", "400000"),
            ("RPMA_TARGET_TEST_HOLD_STATE_MS", "3000"),
        ],
    );
    for _ in 0..3 {
        t.expect("WATCHDOG=1", WAIT);
    }
    t.signal(Signal::SIGHUP);
    // Every notification from RELOADING=1 to READY=1, in order.
    let mut seen: Vec<String> = Vec::new();
    while !seen.iter().any(|m| m.starts_with("READY=1")) {
        let m = t.next(WAIT);
        seen.push(m.unwrap_or_else(|| panic!("no notification in {WAIT:?}: {seen:?}")));
    }
    let from = seen
        .iter()
        .position(|m| m.starts_with("RELOADING=1"))
        .unwrap_or_else(|| panic!("{seen:?}"));
    let pings = seen[from..].iter().filter(|m| *m == "WATCHDOG=1").count();
    // About 15 in 3 s; none before.
    assert!(pings >= 2, "{pings} pings during the reload: {seen:?}");
    t.expect("WATCHDOG=1", WAIT);
}

/// A clear-failure that holds the daemon's state for long (it reopens the file and maps it
/// ahead of use) does not stop the watchdog's pings, and its client waits for the answer. (The
/// main thread waited for the state every turn and sent no ping; the client gave up after 10 s
/// and said the clear failed, while the daemon went on to clear it.)
#[test]
fn a_long_clear_failure_keeps_the_watchdog_pinged_and_its_client_waiting() {
    let d = scratch();
    // nsid 1's file, failed by an earlier run: it carries the mark.
    let ns1 = d.path().join("ns1");
    std::fs::File::create(&ns1)
        .unwrap()
        .set_len(2 << 20)
        .unwrap();
    let path = std::ffi::CString::new(ns1.as_os_str().as_encoded_bytes()).unwrap();
    let mark = b"fdatasync 5";
    // SAFETY: both strings are NUL-terminated and live; the value's pointer and length
    // describe its bytes.
    let r = unsafe {
        libc::setxattr(
            path.as_ptr(),
            c"user.rpma.failed".as_ptr(),
            mark.as_ptr().cast(),
            mark.len(),
            0,
        )
    };
    assert_eq!(r, 0, "setxattr: {}", std::io::Error::last_os_error());
    // A clear that takes 11 s: longer than the client waited.
    let t = start_with_env(
        d.path(),
        "",
        &[
            ("WATCHDOG_USEC", "400000"),
            ("RPMA_TARGET_TEST_HOLD_STATE_MS", "11000"),
        ],
    );
    // SUB's nsid 1 in `status`: its `failed`.
    let failed = |t: &rpma_tests::Target| {
        let v = t.status();
        v["subsystems"]
            .as_array()
            .and_then(|a| a.iter().find(|s| s["nqn"] == SUB))
            .and_then(|s| s["namespaces"].as_array())
            .and_then(|a| a.iter().find(|n| n["nsid"] == 1))
            .unwrap_or_else(|| panic!("no {SUB} nsid 1 in {v}"))["failed"]
            .clone()
    };
    assert!(failed(&t).is_string(), "{}", failed(&t));
    for _ in 0..3 {
        t.expect("WATCHDOG=1", WAIT);
    }
    let (done_tx, done) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            let _ = done_tx.send(t.clear_failure(SUB, 1));
        });
        let mut pings = 0;
        let (code, out) = loop {
            if let Ok(r) = done.try_recv() {
                break r;
            }
            if t.next(Duration::from_millis(100)).as_deref() == Some("WATCHDOG=1") {
                pings += 1;
            }
        };
        assert_eq!(code, Some(0), "{out}");
        // About 55 in 11 s; at most one before (a check under way as the clear began).
        assert!(pings >= 5, "{pings} pings during the clear-failure");
    });
    assert!(failed(&t).is_null(), "{}", failed(&t));
    t.expect("WATCHDOG=1", WAIT);
}

rpma_tests::rdma_runs!(
    idle_daemon_with_a_session_uses_no_cpu,
    watchdog_pings_stop_while_a_poll_loop_is_stuck,
    a_host_whose_namespaces_take_long_to_register_delays_no_other_session,
    a_host_admitted_across_a_reload_gets_the_namespaces_as_they_are_after_it,
    a_host_a_reload_removed_while_its_namespaces_were_registered_is_not_admitted,
    unadmitted_connections_from_its_address_do_not_evict_a_host_being_registered,
    hosts_being_registered_count_against_max_connections,
    a_host_a_reload_lists_while_its_namespaces_are_registered_is_a_listed_host,
    a_host_refused_while_being_registered_leaves_no_place_behind,
    a_host_whose_registrations_outlast_its_keep_alive_gets_a_working_session,
    a_session_whose_namespaces_take_long_to_deregister_delays_no_other_session,
    a_long_deregistration_delays_no_registration,
    a_goodbye_waits_for_its_deregistration_and_delays_no_other_session,
    a_reload_closes_a_connection_whose_deregistration_waits,
    the_stop_says_goodbye_to_a_session_whose_deregistration_takes_long,
    a_goodbye_that_waits_for_its_deregistration_at_the_stop_goes_out,
    a_reload_elsewhere_leaves_a_goodbye_that_waits_for_its_deregistration,
);
