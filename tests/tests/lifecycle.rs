//! The daemon as a real process: readiness over a NOTIFY_SOCKET of the test's own, status over
//! the control socket, SIGHUP reloads, SIGTERM exit, watchdog pings, start-up failures.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rpma_tests::{
    free_port, run_with_deadline, status, status_json, target_bin, Config, Daemon, Namespace,
    Subsystem, Transport,
};

/// The daemon on `config`, notifying `dir/notify.sock`, its stderr the test's.
fn start(config: &Path, dir: &Path, extra_env: &[(&str, &str)]) -> Daemon {
    Daemon::start(config, dir, extra_env, Stdio::inherit())
}

/// Sends `sig`: the daemon must say STOPPING=1 and exit 0 within 20 s.
fn stop_cleanly(daemon: &mut Daemon, sig: Signal) {
    daemon.signal(sig);
    daemon.expect("STOPPING=1");
    assert!(daemon.wait_exit(Duration::from_secs(20)).success());
}

fn nsids(v: &serde_json::Value) -> Vec<u64> {
    v["subsystems"][0]["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["nsid"].as_u64().unwrap())
        .collect()
}

/// Namespace 2 of 1 MiB in 512-byte blocks, added by a reload.
fn ns2() -> Namespace {
    Namespace::new(2, "ns2", "1MiB").block_size(512)
}

fn write_config(dir: &Path, extra: Option<Namespace>) -> PathBuf {
    let p = dir.join("rpma-target.toml");
    // A rewrite (before a reload) keeps the listener, so that the reload touches only namespaces.
    let port = std::fs::read_to_string(&p)
        .ok()
        .and_then(|old| {
            let url = old.lines().next()?.split('"').nth(1)?;
            url.rsplit(':').next()?.parse().ok()
        })
        .unwrap_or_else(free_port);
    let mut ns = vec![Namespace::new(1, "ns1", "4MiB")];
    ns.extend(extra);
    let config = Config::new()
        .set(&Transport::current().listen_line(port))
        .set("control_socket = \"run/control.sock\"")
        .subsystem(
            Subsystem::new("nqn.2026-11.io.rpma:demo")
                .any_host()
                .namespaces(ns),
        );
    std::fs::write(&p, config.to_string()).unwrap();
    p
}

#[test]
fn ready_status_reload_and_clean_stop() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_config(d.path(), None);
    let socket = d.path().join("run/control.sock");
    let mut daemon = start(&cfg, d.path(), &[]);

    let ready = daemon.expect("READY=1");
    assert!(
        ready.contains("STATUS=1 namespace(s) in 1 subsystem(s) mapped"),
        "{ready}"
    );
    assert!(
        ready.contains("1 of 1 listener(s) bound"),
        "readiness names the bound listener: {ready}"
    );
    // READY=1 came only after the namespace was mapped and the control socket accepted.
    assert_eq!(
        std::fs::metadata(d.path().join("ns1")).unwrap().len(),
        4 << 20
    );
    let v = status_json(&socket);
    assert_eq!(nsids(&v), [1]);
    let listen = std::fs::read_to_string(&cfg).unwrap();
    let url = v["listeners"][0]["url"].as_str().unwrap();
    assert!(listen.contains(url), "{url} is the configured listener");
    assert_eq!(v["listeners"][0]["bound"], true);
    assert!(v["sessions"].as_array().unwrap().is_empty());
    let domain = v["subsystems"][0]["namespaces"][0]["domain"]
        .as_str()
        .unwrap()
        .to_owned();
    let files = rpma_tests::Transport::current().file_domain().to_string();
    assert!(
        ["page-cache", "volatile", "dax", files.as_str()].contains(&domain.as_str()),
        "{domain}"
    );

    // The human table, found through the config file.
    let out = status(&["--config", cfg.to_str().unwrap()]);
    assert!(out.status.success());
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains("nqn.2026-11.io.rpma:demo") && table.contains("SESSIONS"),
        "{table}"
    );

    // SIGHUP after adding a namespace.
    write_config(d.path(), Some(ns2()));
    daemon.signal(Signal::SIGHUP);
    assert!(daemon.expect("RELOADING=1").contains("MONOTONIC_USEC="));
    assert!(daemon.expect("READY=1").contains("2 namespace(s)"));
    let v = status_json(&socket);
    assert_eq!(nsids(&v), [1, 2]);
    assert_eq!(v["reloads"], 1);
    assert_eq!(v["last_reload"], "1 namespaces added");
    assert_eq!(v["subsystems"][0]["namespaces"][1]["block_size"], 512);

    // A bad reload keeps the running configuration.
    std::fs::write(&cfg, "listen = 5").unwrap();
    daemon.signal(Signal::SIGHUP);
    daemon.expect("RELOADING=1");
    daemon.expect("READY=1");
    let v = status_json(&socket);
    assert_eq!(nsids(&v), [1, 2]);
    assert!(
        v["last_reload"].as_str().unwrap().starts_with("failed:"),
        "{}",
        v["last_reload"]
    );

    daemon.signal(Signal::SIGTERM);
    assert_eq!(daemon.expect("STOPPING=1"), "STOPPING=1");
    let st = daemon.wait_exit(Duration::from_secs(20));
    assert!(st.success(), "SIGTERM must exit 0: {st:?}");
    assert!(!socket.exists(), "control socket removed at exit");
}

#[test]
fn sigint_also_stops_cleanly() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_config(d.path(), None);
    let mut daemon = start(&cfg, d.path(), &[]);
    daemon.expect("READY=1");
    stop_cleanly(&mut daemon, Signal::SIGINT);
}

#[test]
fn watchdog_pings_at_half_the_period() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_config(d.path(), None);
    let mut daemon = start(&cfg, d.path(), &[("WATCHDOG_USEC", "400000")]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut pings = 0;
    let mut ready = false;
    while pings < 3 && Instant::now() < deadline {
        match daemon.next(Duration::from_secs(30)).as_deref() {
            Some("WATCHDOG=1") => pings += 1,
            Some(m) if m.starts_with("READY=1") => ready = true,
            Some(m) => panic!("unexpected {m:?}"),
            None => break,
        }
    }
    assert!(ready && pings >= 3, "ready {ready}, {pings} pings");
    stop_cleanly(&mut daemon, Signal::SIGTERM);
}

#[test]
fn startup_failure_exits_nonzero_without_ready() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("ns1")).unwrap();
    let cfg = write_config(d.path(), None);
    let mut daemon = start(&cfg, d.path(), &[]);
    let got = daemon.next(Duration::from_secs(2));
    let status = daemon.wait_exit(Duration::from_secs(20));
    assert!(!status.success());
    assert_eq!(got, None, "no READY=1 when a namespace cannot be mapped");
}

/// Starts a second daemon beside `first` (running on `cfg`), on a copy of its configuration
/// that `edit` changed: it must not start. What it wrote on stderr.
fn second_daemon_refused(cfg: &Path, edit: impl FnOnce(String) -> String) -> String {
    let other = cfg.with_file_name("other.toml");
    std::fs::write(&other, edit(std::fs::read_to_string(cfg).unwrap())).unwrap();
    let out = run_with_deadline(
        Command::new(target_bin()).arg("--config").arg(&other),
        Duration::from_secs(20),
    );
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A copy of configuration `text` with a listener port and a control socket of its own.
fn own_port_and_socket(text: String) -> String {
    let url = text.lines().next().unwrap().split('"').nth(1).unwrap();
    let port = url.rsplit(':').next().unwrap().to_owned();
    text.replacen(&format!(":{port}\""), &format!(":{}\"", free_port()), 1)
        .replace("run/control.sock", "run/other.sock")
}

#[test]
fn second_daemon_on_the_same_socket_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_config(d.path(), None);
    let mut first = start(&cfg, d.path(), &[]);
    first.expect("READY=1");
    // A state file and a namespace file of its own, so that the control socket is what stops
    // it.
    let err = second_daemon_refused(&cfg, |text| {
        let text = text.replace("path = \"ns1\"", "path = \"other-ns1\"");
        format!("state_file = \"other.state\"\n{text}")
    });
    assert!(err.contains("in use by a running daemon"), "{err}");
    assert!(err.contains("control.sock"), "{err}");
    stop_cleanly(&mut first, Signal::SIGTERM);
}

/// A second daemon on the same state file (a copied configuration, with its own control
/// socket) is refused before it maps anything: the two would each write their list of failed
/// namespaces over the other's, and one's failures would be forgotten at the next start.
#[test]
fn second_daemon_on_the_same_state_file_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_config(d.path(), None);
    let mut first = start(&cfg, d.path(), &[]);
    first.expect("READY=1");
    // Its own control socket and listener port: only the state file is shared.
    let err = second_daemon_refused(&cfg, own_port_and_socket);
    assert!(
        err.lines()
            .any(|l| l.contains("error") && l.contains("state file") && l.contains("in use")),
        "{err}"
    );
    stop_cleanly(&mut first, Signal::SIGTERM);
}

/// A second daemon on the same namespace file (its own state file, control socket and port:
/// only the file is shared) is refused: each would miss the write-back failures the other's
/// syncs took the report of, and call lost data durable.
#[test]
fn second_daemon_on_the_same_namespace_file_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_config(d.path(), None);
    let mut first = start(&cfg, d.path(), &[]);
    first.expect("READY=1");
    let err = second_daemon_refused(&cfg, |text| {
        format!(
            "state_file = \"other.state\"\n{}",
            own_port_and_socket(text)
        )
    });
    assert!(
        err.lines().any(|l| l.contains("error")
            && l.contains("namespace 1")
            && l.contains("in use by another process")),
        "{err}"
    );
    // The first still serves it.
    assert!(first.exited().is_none(), "the first daemon still runs");
    stop_cleanly(&mut first, Signal::SIGTERM);
}

#[test]
fn status_errors() {
    let out = status(&["--socket", "/nonexistent/rpma.sock"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot talk to the daemon"));
    let out = status(&["--config", "/nonexistent/rpma.toml"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
    let out = Command::new(target_bin()).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

rpma_tests::rdma_runs!(
    ready_status_reload_and_clean_stop,
    sigint_also_stops_cleanly,
    watchdog_pings_at_half_the_period,
    second_daemon_on_the_same_socket_is_refused,
);

/// A member of the control socket's group (here uid 65534 with the socket's group, root's, as
/// a supplementary group; run through setpriv) reads `status`, but may not clear a failure:
/// only root and the daemon's own user may change its state. Before, anyone who could connect
/// could (the daemon answered that the namespace had not failed, and would have cleared it).
#[test]
fn a_status_reader_may_not_clear_a_failure() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root, to run the client as another user");
        return;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("skipped: needs setpriv (util-linux), to run the client as another user");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let cfg = write_config(d.path(), None);
    let socket = d.path().join("run/control.sock");
    let mut daemon = start(&cfg, d.path(), &[]);
    daemon.expect("READY=1");
    for dir in [d.path(), &d.path().join("run")] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).unwrap();
    }
    let sock = socket.to_str().unwrap();
    let as_reader = |args: &[&str]| {
        run_with_deadline(
            Command::new("setpriv")
                .args(["--reuid=65534", "--regid=65534", "--groups=0", "--"])
                .arg(target_bin())
                .args(args),
            Duration::from_secs(30),
        )
    };
    let out = as_reader(&["status", "--socket", sock, "--json"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the group reads status: {said}");
    let clear = [
        "clear-failure",
        "--socket",
        sock,
        "nqn.2026-11.io.rpma:demo",
        "1",
    ];
    let out = as_reader(&clear);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains(
            "clear-failure changes the daemon's state: only root or the daemon's user (uid 0) \
             may ask for it, not uid 65534"
        ),
        "{said}"
    );
    // Root passes that check (and is told there is nothing to clear).
    let out = run_with_deadline(
        Command::new(target_bin()).args(clear),
        Duration::from_secs(30),
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("has not failed"), "{said}");
    stop_cleanly(&mut daemon, Signal::SIGTERM);
}
