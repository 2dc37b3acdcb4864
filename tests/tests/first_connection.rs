//! An initiator's first connection: refused or failed, it is retried within
//! `--reconnect-timeout` with backoff, as a lost one is (a target that starts after the
//! initiator, a target with no room for this host at the moment); what would fail the same way
//! again (a refusal of the host or subsystem) is not. Real processes: `rpma-initiator`
//! identify, write and nbd started before `rpma-target`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rpma_tests::nbd::Raw;
use rpma_tests::{
    built, cli_read_with, conn_args, free_port, host, initiator, nqn, opts, scratch, text, Config,
    Namespace, Subsystem, Target, Transport,
};

const SUB: &str = "nqn.2026-11.io.rpma:first";
const HOST: &str = "nqn.2026-11.io.rpma:first-host";
const WAIT: Duration = Duration::from_secs(60);

fn config(extra: &str) -> String {
    let c = Config::new().subsystem(
        Subsystem::new(SUB)
            .host(HOST)
            .namespace(Namespace::new(1, "ns1", "4MiB")),
    );
    format!("{extra}\n{c}")
}

/// `rpma-initiator ARGS` in the background, stderr to `dir/NAME.err`, stdout piped.
fn spawn(dir: &Path, name: &str, args: &[String]) -> (Child, PathBuf) {
    let err = dir.join(format!("{name}.err"));
    let child = Command::new(built("rpma-initiator"))
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    (child, err)
}

/// Waits until `err` says the first connection is being retried; panics if `child` exited
/// first (today's initiator gives up at once).
fn wait_retrying(child: &mut Child, err: &Path) {
    let deadline = Instant::now() + WAIT;
    loop {
        let log = std::fs::read_to_string(err).unwrap_or_default();
        if log.contains("retrying with backoff") {
            return;
        }
        if let Some(st) = child.try_wait().unwrap() {
            panic!("exited ({st}) instead of retrying: {log}");
        }
        assert!(Instant::now() < deadline, "no retry: {log}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The exit code of `child` (within the deadline) and what it printed.
fn finish(mut child: Child, err: &Path) -> (Option<i32>, String) {
    let deadline = Instant::now() + WAIT;
    let st = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "did not finish");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out);
    (
        st.code(),
        out + &std::fs::read_to_string(err).unwrap_or_default(),
    )
}

#[test]
fn commands_started_before_their_target_wait_for_it() {
    let d = scratch();
    let mut t = Target::start(d.path(), &config(""));
    t.kill9();
    let conn = |extra: &[&str]| {
        let mut a = conn_args(&t.url(), SUB, HOST, Some(1));
        a.extend(["--timeout", "2", "--reconnect-timeout", "120"].map(String::from));
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let (mut id, id_err) = spawn(d.path(), "identify", &conn(&["identify"]));
    let write = conn(&[
        "write",
        "--offset",
        "8192",
        "--pattern",
        "0x5a",
        "--length",
        "4096",
    ]);
    let (mut wr, wr_err) = spawn(
        d.path(),
        "write",
        &[write, vec!["--durable".into()]].concat(),
    );
    let sock = d.path().join("nbd.sock");
    let (mut nbd, nbd_err) = spawn(
        d.path(),
        "nbd",
        &conn(&["nbd", "--socket", sock.to_str().unwrap()]),
    );
    for (c, e) in [(&mut id, &id_err), (&mut wr, &wr_err), (&mut nbd, &nbd_err)] {
        wait_retrying(c, e);
    }
    t.restart();
    let (code, out) = finish(id, &id_err);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("nsid 1: 4194304 bytes"), "{out}");
    let (code, out) = finish(wr, &wr_err);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("durable"), "{out}");
    // The export prints its URL once clients can connect.
    let mut line = String::new();
    BufReader::new(nbd.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("nbd+unix://"), "{line}");
    let mut c = Raw::connect(&sock);
    assert_eq!(c.read(8192, 4096), Ok(vec![0x5a; 4096]));
    drop(c);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(nbd.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let (code, out) = finish(nbd, &nbd_err);
    assert_eq!(code, Some(0), "{out}");
    let conn = conn_args(&t.url(), SUB, HOST, Some(1));
    assert_eq!(cli_read_with(&conn, d.path(), 8192, 4096), vec![0x5a; 4096]);
}

#[test]
fn a_first_connection_refused_for_lack_of_room_is_retried() {
    let d = scratch();
    let t = Target::start(d.path(), &config("max_connections = 1"));
    let held = rpma_initiator::connect(&t.url(), &nqn(SUB), &host(HOST), &opts()).unwrap();
    let mut a = conn_args(&t.url(), SUB, HOST, None);
    a.extend(["--reconnect-timeout", "120", "identify"].map(String::from));
    let (mut id, err) = spawn(d.path(), "identify", &a);
    wait_retrying(&mut id, &err);
    let log = std::fs::read_to_string(&err).unwrap();
    assert!(log.contains("TooManyConnections"), "{log}");
    drop(held);
    let (code, out) = finish(id, &err);
    assert_eq!(code, Some(0), "{out}");
}

#[test]
fn what_cannot_pass_fails_at_once_and_help_says_what_is_retried() {
    let o = initiator(&["--help"]);
    let help = text(&o);
    assert!(
        help.contains("a first connection refused or failed")
            && help.contains("is retried with backoff"),
        "{help}"
    );
    let d = scratch();
    let t = Target::start(d.path(), &config(""));
    // Refusals of the subsystem or the host fail at once, whatever the budget.
    for (sub, host) in [
        ("nqn.2026-11.io.rpma:nope", HOST),
        (SUB, "nqn.2026-11.io.rpma:x"),
    ] {
        let started = Instant::now();
        let mut a = conn_args(&t.url(), sub, host, None);
        a.extend(["--reconnect-timeout", "3600", "identify"].map(String::from));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let o = initiator(&a);
        assert_eq!(o.status.code(), Some(4), "{}", text(&o));
        assert!(!text(&o).contains("retrying"), "{}", text(&o));
        assert!(started.elapsed() < WAIT, "not retried for an hour");
    }
    // Nobody listens: one attempt with --reconnect-timeout 0; retried, then exit 3 with a
    // budget.
    let url = Transport::current().url(free_port());
    for (budget, retried) in [("0", false), ("1", true)] {
        let o = initiator(&[
            "discover",
            "--target",
            &url,
            "--timeout",
            "2",
            "--reconnect-timeout",
            budget,
        ]);
        assert_eq!(o.status.code(), Some(3), "{}", text(&o));
        assert!(text(&o).contains("cannot connect"), "{}", text(&o));
        assert_eq!(
            text(&o).contains("retrying with backoff"),
            retried,
            "{}",
            text(&o)
        );
        // Said once (the warning repeated the error's own "cannot connect to URL").
        if let Some(warn) = text(&o)
            .lines()
            .find(|l| l.contains("retrying with backoff"))
        {
            assert_eq!(warn.matches("cannot connect to").count(), 1, "{warn}");
        }
    }
}

#[test]
fn a_reload_that_removes_the_host_ends_a_running_command_as_refused_not_unreachable() {
    let d = scratch();
    let mut t = Target::start(d.path(), &config(""));
    // A durable-write loop far longer than the test: it ends only by the failure.
    let mut a = conn_args(&t.url(), SUB, HOST, Some(1));
    a.extend(
        [
            "--reconnect-timeout",
            "3",
            "bench",
            "--yes",
            "--count",
            "10000000",
        ]
        .map(String::from),
    );
    let (mut bench, err) = spawn(d.path(), "bench", &a);
    let deadline = Instant::now() + WAIT;
    while t.status()["sessions"].as_array().unwrap().is_empty() {
        if let Some(st) = bench.try_wait().unwrap() {
            panic!("exited ({st}): {}", std::fs::read_to_string(&err).unwrap());
        }
        assert!(Instant::now() < deadline, "the bench never connected");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The operator takes the host off the subsystem.
    let without = config("").replace(&format!("\"{HOST}\""), "\"nqn.2026-11.io.rpma:other\"");
    assert!(!without.contains(HOST), "{without}");
    t.rewrite(&without);
    t.reload();
    let (code, out) = finish(bench, &err);
    // Exit 4 (refused: act on the target's configuration), not 3 (unreachable: wait).
    assert_eq!(code, Some(4), "{out}");
    assert!(out.contains("reconnect attempt"), "{out}");
    assert!(out.contains("not allowed"), "{out}");
}
