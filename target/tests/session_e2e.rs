//! Sessions on the fabric, end to end: the real `rpma-target` process, started from a config in a
//! temp dir with a NOTIFY_SOCKET of the test's own, and the rpma-initiator library in-process.
//! Every wait has a deadline.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rpma_common::fabric::{
    Access, AlignedBuf, Completion, ConnParams, Context, QpCaps, RecvWr, RemoteAddr, SendOp,
    SendWr, Sge, Url, WcStatus,
};
use rpma_common::proto::auth::Psk;
use rpma_common::proto::nqn::{Nqn, DISCOVERY_NQN};
use rpma_common::proto::{
    Connect, FlushRequest, FlushStatus, HostId, Message, PersistenceDomain, RefusalReason,
    MAX_MESSAGE_SIZE, PROTO_VERSION,
};
use rpma_initiator::{
    connect, identify, ConnectOptions, Error, HostIdentity, Session, CONTROL_BIT,
};
use support::{free_port, status, status_json, write_psk, Daemon, BIN};

const SUB: &str = "nqn.2026-11.io.rpma:demo";
const OPEN: &str = "nqn.2026-11.io.rpma:open";
const PLAIN: &str = "nqn.2026-11.io.rpma:plain-host";
const KEYED: &str = "nqn.2026-11.io.rpma:keyed-host";
const OPEN_HOST: &str = "nqn.2026-11.io.rpma:any-host";
const KEY: &str = "5a";
const WAIT: Duration = Duration::from_secs(20);

fn scratch() -> tempfile::TempDir {
    // On the build directory's filesystem: a disk, so namespaces are page-cache (durable).
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

struct Target {
    dir: PathBuf,
    port: u16,
    daemon: Daemon,
}

/// The configuration: subsystem SUB (hosts PLAIN, KEYED with a key; nsid 1 rw, nsid 3
/// read-only) and OPEN (any host; nsid 1), plus `extra` at the end of SUB's namespaces.
fn config_text(port: u16, top: &str, extra: &str) -> String {
    format!(
        r#"listen = ["tcp://127.0.0.1:{port}"]
control_socket = "ctl.sock"
{top}
[[subsystem]]
nqn = "{OPEN}"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
path = "open1"
size = "1MiB"

[[subsystem]]
nqn = "{SUB}"
hosts = [{{ nqn = "{PLAIN}" }}, {{ nqn = "{KEYED}", psk_file = "keyed.psk" }}]
[[subsystem.namespace]]
nsid = 1
path = "ns1"
size = "2MiB"
[[subsystem.namespace]]
nsid = 3
path = "ns3"
size = "1MiB"
read_only = true
{extra}"#
    )
}

impl Target {
    fn start(dir: &Path, top: &str) -> Target {
        Target::start_with_env(dir, top, &[])
    }

    /// As [`Target::start`], with extra environment variables for the daemon.
    fn start_with_env(dir: &Path, top: &str, env_extra: &[(&str, &str)]) -> Target {
        let port = free_port();
        write_psk(&dir.join("keyed.psk"), KEY);
        std::fs::write(dir.join("c.toml"), config_text(port, top, "")).unwrap();
        let mut env = vec![("RUST_LOG", "info")];
        env.extend_from_slice(env_extra);
        let log = std::fs::File::create(dir.join("target.log")).unwrap();
        let t = Target {
            dir: dir.to_owned(),
            port,
            daemon: Daemon::start(&dir.join("c.toml"), dir, &env, Stdio::from(log)),
        };
        let ready = t.expect("READY=1");
        assert!(ready.contains("1 of 1 listener(s) bound"), "{ready}");
        t
    }

    fn url(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    /// A session of PLAIN with SUB, with the default [`opts`].
    fn session(&self) -> Session {
        connect(&self.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap()
    }

    /// The daemon's log so far (its stderr; printed by the test if it fails).
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("target.log")).unwrap_or_default()
    }

    /// The log lines that contain every one of `parts`, waiting up to WAIT for at least one.
    fn log_lines(&self, parts: &[&str]) -> Vec<String> {
        let deadline = Instant::now() + WAIT;
        loop {
            let lines: Vec<String> = self
                .log()
                .lines()
                .filter(|l| parts.iter().all(|p| l.contains(p)))
                .map(str::to_owned)
                .collect();
            if !lines.is_empty() || Instant::now() >= deadline {
                return lines;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The next notification starting with `prefix`, skipping others, within WAIT.
    fn expect(&self, prefix: &str) -> String {
        self.daemon.wait_for(prefix, WAIT)
    }

    fn signal(&self, sig: Signal) {
        self.daemon.signal(sig);
    }

    fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        self.daemon.wait_exit(within)
    }

    fn status(&self) -> serde_json::Value {
        status_json(&self.dir.join("ctl.sock"))
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.daemon.kill();
        if std::thread::panicking() {
            eprintln!("--- rpma-target's log ---\n{}", self.log());
        }
    }
}

fn host(nqn: &str) -> HostIdentity {
    HostIdentity::new(Nqn::new(nqn).unwrap())
}

fn nqn(s: &str) -> Nqn {
    Nqn::new(s).unwrap()
}

fn opts() -> ConnectOptions {
    ConnectOptions {
        timeout: Duration::from_secs(10),
        ..ConnectOptions::default()
    }
}

/// Writes `data` to `remote`, then Reads 8 bytes back (APM): returns the status of every
/// completion of those two requests (the Read's last). Control completions go to the session.
fn write_then_read(s: &mut Session, remote: RemoteAddr, data: &[u8]) -> Vec<WcStatus> {
    let mem = AlignedBuf::new(4096).unwrap();
    mem.write_at(0, data).unwrap();
    let mr = s
        .pd()
        .register(Arc::clone(&mem), Access::LOCAL_WRITE)
        .unwrap();
    let posted = s.qp().post_send(SendWr::new(
        1,
        SendOp::Write {
            local: Sge::new(&mr, 0, data.len()),
            remote,
        },
    ));
    if posted.is_err() {
        return vec![WcStatus::WrFlush];
    }
    s.qp()
        .post_send(SendWr::new(
            2,
            SendOp::Read {
                local: Sge::new(&mr, 2048, 8),
                remote,
            },
        ))
        .unwrap();
    await_own(s, 2)
}

/// Polls the session's queue until the test's request `last` completes: the statuses of the
/// test's own completions, in order (control completions go to the session).
fn await_own(s: &mut Session, last: u64) -> Vec<WcStatus> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    let mut wcs = [Completion::EMPTY; 8];
    while Instant::now() < deadline {
        let n = s
            .cq()
            .wait(&mut wcs, Some(Duration::from_millis(50)))
            .unwrap();
        for c in &wcs[..n] {
            if c.wr_id & CONTROL_BIT != 0 {
                let _ = s.handle(c);
            } else {
                out.push(c.status);
                if c.wr_id == last {
                    return out;
                }
            }
        }
    }
    panic!("request {last} did not complete within {WAIT:?}: {out:?}");
}

/// Sends FlushRequests with tokens 1..=n for `length` bytes at offset 0 of nsid 1, without
/// waiting for their answers.
fn send_flushes(s: &mut Session, n: u64, length: u64) {
    for token in 1..=n {
        let req = FlushRequest {
            nsid: 1,
            offset: 0,
            length,
            token,
        };
        s.send_message(&Message::FlushRequest(req)).unwrap();
    }
}

/// A Write to `remote` is refused with RemoteAccess and `file` stays all zeros.
fn assert_write_refused(s: &mut Session, remote: RemoteAddr, file: &Path) {
    let st = write_then_read(s, remote, b"nope");
    assert_eq!(st.last(), Some(&WcStatus::RemoteAccess), "{st:?}");
    assert!(std::fs::read(file).unwrap().iter().all(|&b| b == 0));
}

#[test]
fn ready_means_accepting_identify_and_gpspm() {
    let d = scratch();
    let t = Target::start(d.path(), "");
    // Right after READY=1: the listener accepts.
    let id = identify(&t.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap();
    assert!(id.controller_id >= 1);
    let ns: Vec<u32> = id.namespaces.iter().map(|n| n.nsid).collect();
    assert_eq!(ns, [1, 3]);
    let n1 = &id.namespaces[0];
    assert_eq!(
        (n1.size, n1.block_size, n1.read_only),
        (2 << 20, 4096, false)
    );
    assert_eq!(n1.domain, PersistenceDomain::PageCache);
    assert_eq!(n1.durability.names(), ["APM", "GPSPM", "FLUSH"]);
    assert!(id.namespaces[1].read_only);

    let mut s = t.session();
    let n1 = s.namespace(1).unwrap().clone();
    let remote = RemoteAddr {
        addr: n1.remote_addr + 4096,
        rkey: n1.rkey,
    };
    let st = write_then_read(&mut s, remote, b"durable bytes over the wire");
    assert_eq!(st, [WcStatus::Success, WcStatus::Success]);
    let file = std::fs::read(d.path().join("ns1")).unwrap();
    assert_eq!(&file[4096..4096 + 27], b"durable bytes over the wire");

    // GPSPM flushes and their errors.
    assert_eq!(s.flush(1, 4096, 27, WAIT).unwrap(), FlushStatus::Durable);
    assert_eq!(s.flush(1, 0, 0, WAIT).unwrap(), FlushStatus::Durable);
    assert_eq!(
        s.flush(1, 2 << 20, 1, WAIT).unwrap(),
        FlushStatus::OutOfRange
    );
    assert_eq!(
        s.flush(9, 0, 1, WAIT).unwrap(),
        FlushStatus::InvalidNamespace
    );

    // Status: the session with its host and what is counted, a discovery connection beside
    // it, counters per namespace.
    let disc = connect(&t.url(), &nqn(DISCOVERY_NQN), &host(OPEN_HOST), &opts()).unwrap();
    let v = t.status();
    let sessions = v["sessions"].as_array().unwrap();
    assert_eq!(sessions.len(), 2, "{v}");
    assert_eq!(sessions[0]["kind"], "io");
    assert_eq!(sessions[0]["host_nqn"], PLAIN);
    assert_eq!(sessions[0]["controller_id"], u64::from(s.controller_id()));
    assert!(sessions[0]["messages"].as_u64().unwrap() >= 4, "{v}");
    assert_eq!(sessions[0]["flushes"], 4, "{v}");
    assert!(sessions[0]["counted"]
        .as_str()
        .unwrap()
        .contains("not counted"));
    assert_eq!(sessions[1]["kind"], "discovery", "{v}");
    assert_eq!(sessions[1]["host_nqn"], OPEN_HOST);
    assert_eq!(sessions[1]["controller_id"], 0);
    assert_eq!(sessions[1]["subsystem_nqn"], DISCOVERY_NQN);
    let out = status(&["--socket", d.path().join("ctl.sock").to_str().unwrap()]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("SESSIONS (counted: control messages"),
        "{table}"
    );
    assert!(table.contains("flushes 4"), "{table}");
    assert!(
        table.contains(&format!("discovery ctrl 0     {OPEN_HOST}")),
        "{table}"
    );
    // A discovery connection leaves the list when it ends.
    drop(disc);
    let deadline = Instant::now() + WAIT;
    while t.status()["sessions"].as_array().unwrap().len() != 1 {
        assert!(
            Instant::now() < deadline,
            "the discovery connection stayed listed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let ns1 = &v["subsystems"][1]["namespaces"][0];
    assert_eq!(ns1["counters"]["flushes"], 3, "{v}");
    assert_eq!(ns1["counters"]["flush_errors"], 1, "{v}");
    assert_eq!(ns1["counters"]["sessions"], 1, "{v}");

    // Read-only: the rkey carries no remote write right.
    let n3 = s.namespace(3).unwrap().clone();
    let ro = RemoteAddr {
        addr: n3.remote_addr,
        rkey: n3.rkey,
    };
    assert_write_refused(&mut s, ro, &d.path().join("ns3"));
}

#[test]
fn rkeys_are_per_connection() {
    let d = scratch();
    let t = Target::start(d.path(), "");
    let a = t.session();
    let mut b = t.session();
    let (na, nb) = (
        a.namespace(1).unwrap().clone(),
        b.namespace(1).unwrap().clone(),
    );
    assert_ne!(na.rkey, nb.rkey);
    // A's rkey on B's connection is refused.
    let stolen = RemoteAddr {
        addr: na.remote_addr,
        rkey: na.rkey,
    };
    assert_write_refused(&mut b, stolen, &d.path().join("ns1"));
    // B's connection broke on the RemoteAccess, A disconnects: both sessions' regions are
    // deregistered (the namespace's holder count drops to 0) and they leave the list.
    a.disconnect(WAIT).unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        let v = t.status();
        let holders = &v["subsystems"][1]["namespaces"][0]["counters"]["sessions"];
        if holders == 0 && v["sessions"].as_array().unwrap().is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "rkeys not released: {v}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn each_refusal() {
    let d = scratch();
    // Refusals are rate-limited per peer address (one WARN a period, the rest at DEBUG): every
    // peer here is 127.0.0.1, so the test reads the DEBUG lines too.
    let t = Target::start_with_env(d.path(), "", &[("RUST_LOG", "debug")]);
    let e = connect(
        &t.url(),
        &nqn("nqn.2026-11.io.rpma:nope"),
        &host(PLAIN),
        &opts(),
    );
    assert!(matches!(e, Err(Error::UnknownSubsystem { .. })), "{e:?}");
    let e = connect(
        &t.url(),
        &nqn(SUB),
        &host("nqn.2026-11.io.rpma:stranger"),
        &opts(),
    );
    assert!(matches!(e, Err(Error::HostNotAllowed { .. })), "{e:?}");
    // Wrong key.
    let wrong = host(KEYED).with_psk(Psk::from_hex(&"5b".repeat(32)).unwrap());
    let e = connect(&t.url(), &nqn(SUB), &wrong, &opts());
    assert!(matches!(e, Err(Error::AuthFailed { .. })), "{e:?}");
    // No key at all.
    let e = connect(&t.url(), &nqn(SUB), &host(KEYED), &opts());
    assert!(matches!(e, Err(Error::KeyRequired)), "{e:?}");
    // The right key: mutual authentication succeeds.
    let right = host(KEYED).with_psk(Psk::from_hex(&KEY.repeat(32)).unwrap());
    let s = connect(&t.url(), &nqn(SUB), &right, &opts()).unwrap();
    assert_eq!(s.namespaces().len(), 2);
    // A host holding a key refuses a target that lets it in without proving the key.
    let keyed_on_open = host(PLAIN).with_psk(Psk::from_hex(&KEY.repeat(32)).unwrap());
    let e = connect(&t.url(), &nqn(OPEN), &keyed_on_open, &opts());
    assert!(
        matches!(e, Err(Error::TargetNotAuthenticated { .. })),
        "{e:?}"
    );

    // Unsupported versions: crafted Connects over a raw queue pair, from a newer host and from
    // a host of version 1 (before the ConnectResponse carried the queue depth).
    for v in [PROTO_VERSION + 1, 1] {
        let refusal = raw_exchange(&t.url(), |mut bytes| {
            bytes[0] = v;
            bytes
        });
        match refusal {
            Message::Refusal(r) => assert_eq!(r.reason, RefusalReason::VersionUnsupported),
            other => panic!("version {v}: {other:?}"),
        }
    }
    // Garbage is a protocol error, and the daemon keeps serving.
    match raw_exchange(&t.url(), |_| vec![PROTO_VERSION, 0x01, 0, 0, 0xFF, 0xFF]) {
        Message::Refusal(r) => assert_eq!(r.reason, RefusalReason::ProtocolError),
        other => panic!("{other:?}"),
    }
    identify(&t.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap();

    // Each refusal is logged once, with the host NQN (when the Connect could be read) and peer.
    let once = |parts: &[&str]| {
        let lines = t.log_lines(parts);
        assert_eq!(lines.len(), 1, "{parts:?}: {lines:#?}\n{}", t.log());
        assert!(lines[0].contains("from 127.0.0.1:"), "{}", lines[0]);
    };
    once(&[
        "refused host nqn.2026-11.io.rpma:plain-host",
        "UnknownSubsystem",
    ]);
    once(&[
        "refused host nqn.2026-11.io.rpma:stranger",
        "HostNotAllowed",
    ]);
    once(&["refused host nqn.2026-11.io.rpma:keyed-host", "AuthFailed"]);
    // The host without a key: not a protocol error, but what it is.
    once(&[
        "host nqn.2026-11.io.rpma:keyed-host",
        "authentication required: the host has no key for nqn.2026-11.io.rpma:demo",
    ]);
    assert!(!t.log().contains("expected AuthResponse"), "{}", t.log());
    assert_eq!(t.log_lines(&["VersionUnsupported"]).len(), 2, "{}", t.log());
    once(&["refused host (unknown)", "ProtocolError"]);
}

#[test]
fn connect_response_grants_the_configured_queue_depth() {
    let d = scratch();
    let t = Target::start(d.path(), "max_queue_depth = 16");
    match raw_exchange(&t.url(), |b| b) {
        Message::ConnectResponse(r) => {
            assert_eq!(r.queue_depth, 16);
            assert_eq!(r.namespaces.len(), 2);
        }
        other => panic!("{other:?}"),
    }
    // 16 FlushRequests outstanding at once are within the grant: all answered.
    let mut s = t.session();
    send_flushes(&mut s, 16, 4096);
    let mut answered = Vec::new();
    while answered.len() < 16 {
        match s.wait_message(WAIT, "flush responses").unwrap() {
            Message::FlushResponse(r) => {
                assert_eq!(r.status, FlushStatus::Durable);
                answered.push(r.token);
            }
            other => panic!("{other:?}"),
        }
    }
    answered.sort_unstable();
    assert_eq!(answered, (1..=16).collect::<Vec<u64>>());
}

/// Connects a bare queue pair, sends `craft(encoded Connect)`, returns the target's answer.
fn raw_exchange(url: &str, craft: impl FnOnce(Vec<u8>) -> Vec<u8>) -> Message {
    let ctx = Context::soft();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let rmem = AlignedBuf::new(MAX_MESSAGE_SIZE).unwrap();
    let rmr = pd.register(Arc::clone(&rmem), Access::LOCAL_WRITE).unwrap();
    let prepared = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    prepared
        .post_recv(RecvWr {
            wr_id: 7,
            local: Some(Sge::whole(&rmr)),
        })
        .unwrap();
    let qp = prepared
        .connect(&Url::parse(url).unwrap(), &ConnParams::default(), &[])
        .unwrap();
    let connect = Message::Connect(Connect {
        host_nqn: nqn(PLAIN),
        subsystem_nqn: nqn(SUB),
        host_id: HostId([3; 16]),
        queue_id: 0,
        keep_alive_ms: 0,
    });
    let bytes = craft(connect.encode().unwrap());
    let smem = AlignedBuf::new(bytes.len()).unwrap();
    smem.write_at(0, &bytes).unwrap();
    let smr = pd.register(Arc::clone(&smem), Access::empty()).unwrap();
    qp.post_send(SendWr::new(
        1,
        SendOp::Send {
            local: Sge::whole(&smr),
        },
    ))
    .unwrap();
    let deadline = Instant::now() + WAIT;
    let mut wcs = [Completion::EMPTY; 4];
    while Instant::now() < deadline {
        let n = cq.wait(&mut wcs, Some(Duration::from_millis(50))).unwrap();
        for c in &wcs[..n] {
            if c.wr_id == 7 {
                assert_eq!(c.status, WcStatus::Success);
                let mut b = vec![0; c.byte_len as usize];
                rmem.read_at(0, &mut b).unwrap();
                return Message::decode(&b).unwrap();
            }
        }
    }
    panic!("no answer within {WAIT:?}");
}

#[test]
fn keep_alive_lapse_revokes_rkeys() {
    let d = scratch();
    let t = Target::start(d.path(), "");
    let o = ConnectOptions {
        keep_alive: Duration::from_millis(300),
        ..opts()
    };
    let mut s = connect(&t.url(), &nqn(SUB), &host(PLAIN), &o).unwrap();
    assert_eq!(s.keep_alive(), Duration::from_millis(300));
    let n1 = s.namespace(1).unwrap().clone();
    let remote = RemoteAddr {
        addr: n1.remote_addr,
        rkey: n1.rkey,
    };
    // Ticking keeps the session alive well past its period.
    let until = Instant::now() + Duration::from_millis(1000);
    while Instant::now() < until {
        s.tick().unwrap();
        let _ = s.wait_message(Duration::from_millis(20), "nothing");
    }
    assert_eq!(
        write_then_read(&mut s, remote, b"alive"),
        [WcStatus::Success, WcStatus::Success]
    );
    // Stop ticking: the target revokes the rkeys and says why.
    match s.wait_message(Duration::from_secs(5), "Disconnect") {
        Err(Error::Disconnected { reason }) => assert!(reason.contains("keep-alive"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let st = write_then_read(&mut s, remote, b"stale rkey");
    assert_eq!(st.last(), Some(&WcStatus::RemoteAccess), "{st:?}");
    let file = std::fs::read(d.path().join("ns1")).unwrap();
    assert_eq!(&file[..5], b"alive", "the stale Write placed nothing");
    assert!(file[5..10].iter().all(|&b| b == 0));
}

#[test]
fn connection_limit_refuses_the_next() {
    let d = scratch();
    let t = Target::start(d.path(), "max_connections = 1");
    let _a = t.session();
    let e = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts());
    assert!(
        matches!(
            e,
            Err(Error::Refused {
                reason: RefusalReason::TooManyConnections,
                ..
            })
        ),
        "{e:?}"
    );
}

#[test]
fn sighup_adds_a_namespace_while_a_session_stays_up() {
    let d = scratch();
    let t = Target::start(d.path(), "keep_alive_ms = 1000");
    let mut s = t.session();
    let n1 = s.namespace(1).unwrap().clone();
    let remote = RemoteAddr {
        addr: n1.remote_addr + 8192,
        rkey: n1.rkey,
    };
    let extra = "[[subsystem.namespace]]\nnsid = 4\npath = \"ns4\"\nsize = \"1MiB\"\n";
    std::fs::write(
        d.path().join("c.toml"),
        config_text(t.port, "keep_alive_ms = 1000", extra),
    )
    .unwrap();
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1");
    t.expect("READY=1");
    // The session was not touched: same rkeys, still working, still alive.
    for _ in 0..5 {
        s.tick().unwrap();
        let _ = s.wait_message(Duration::from_millis(100), "nothing");
    }
    assert_eq!(
        write_then_read(&mut s, remote, b"after reload"),
        [WcStatus::Success, WcStatus::Success]
    );
    assert_eq!(s.flush(1, 8192, 12, WAIT).unwrap(), FlushStatus::Durable);
    assert_eq!(s.namespaces().len(), 2);
    // A new identify sees the new namespace.
    let id = identify(&t.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap();
    let ns: Vec<u32> = id.namespaces.iter().map(|n| n.nsid).collect();
    assert_eq!(ns, [1, 3, 4]);
    // identify's Disconnect may still be on its way: the count settles at 1 (ours) shortly.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut v = t.status();
    while v["sessions"].as_array().unwrap().len() != 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        v = t.status();
    }
    assert_eq!(v["sessions"].as_array().unwrap().len(), 1, "{v}");
}

/// Reads 8 bytes at `remote`: the Read's completion status.
fn read8(s: &mut Session, remote: RemoteAddr) -> WcStatus {
    let mem = AlignedBuf::new(64).unwrap();
    let mr = s
        .pd()
        .register(Arc::clone(&mem), Access::LOCAL_WRITE)
        .unwrap();
    if s.qp()
        .post_send(SendWr::new(
            5,
            SendOp::Read {
                local: Sge::new(&mr, 0, 8),
                remote,
            },
        ))
        .is_err()
    {
        return WcStatus::WrFlush;
    }
    *await_own(s, 5).last().unwrap()
}

#[test]
fn sighup_removing_a_namespace_revokes_it_only() {
    let d = scratch();
    let top = "keep_alive_ms = 10000";
    let t = Target::start(d.path(), top);
    // A session on OPEN (its nsid 1 only) and one on SUB (nsid 1 and the read-only nsid 3).
    let mut other = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &opts()).unwrap();
    let mut s = t.session();
    let at = |s: &Session, nsid: u32, off: u64| {
        let n = s.namespace(nsid).unwrap();
        RemoteAddr {
            addr: n.remote_addr + off,
            rkey: n.rkey,
        }
    };
    let (o1, n1, n3) = (at(&other, 1, 0), at(&s, 1, 4096), at(&s, 3, 0));
    assert_eq!(read8(&mut s, n3), WcStatus::Success);

    // Remove SUB's nsid 3 and reload.
    let without_3 = config_text(t.port, top, "").replace(
        "[[subsystem.namespace]]\nnsid = 3\npath = \"ns3\"\nsize = \"1MiB\"\nread_only = true\n",
        "",
    );
    assert!(!without_3.contains("nsid = 3"), "{without_3}");
    std::fs::write(d.path().join("c.toml"), without_3).unwrap();
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1");
    t.expect("READY=1");

    // The session that never used nsid 3 is untouched: Writes, Reads and flushes.
    assert_eq!(
        write_then_read(&mut other, o1, b"other session"),
        [WcStatus::Success, WcStatus::Success]
    );
    assert_eq!(other.flush(1, 0, 13, WAIT).unwrap(), FlushStatus::Durable);
    // The session that had it keeps nsid 1...
    assert_eq!(
        write_then_read(&mut s, n1, b"still mine"),
        [WcStatus::Success, WcStatus::Success]
    );
    assert_eq!(s.flush(1, 4096, 10, WAIT).unwrap(), FlushStatus::Durable);
    // ...and lost nsid 3: no flush, and its rkey is revoked.
    assert_eq!(
        s.flush(3, 0, 8, WAIT).unwrap(),
        FlushStatus::InvalidNamespace
    );
    assert_eq!(read8(&mut s, n3), WcStatus::RemoteAccess);
    // New connections no longer see it; the other session is still listed and alive.
    let id = identify(&t.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap();
    let ns: Vec<u32> = id.namespaces.iter().map(|n| n.nsid).collect();
    assert_eq!(ns, [1]);
    assert_eq!(other.flush(1, 0, 0, WAIT).unwrap(), FlushStatus::Durable);
    let v = t.status();
    assert!(v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["host_nqn"] == OPEN_HOST));
}

/// Removing a host from a subsystem closes that host's session with a reason and refuses it
/// from then on; a session of another subsystem is not disturbed.
#[test]
fn sighup_removing_a_host_closes_its_session_only() {
    let d = scratch();
    let top = "keep_alive_ms = 10000";
    let t = Target::start(d.path(), top);
    let mut other = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &opts()).unwrap();
    let mut s = t.session();
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);

    let without_plain =
        config_text(t.port, top, "").replace(&format!("{{ nqn = \"{PLAIN}\" }}, "), "");
    assert!(!without_plain.contains(PLAIN), "{without_plain}");
    std::fs::write(d.path().join("c.toml"), without_plain).unwrap();
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1");
    t.expect("READY=1");

    // The removed host's session is closed, with the reason.
    let end = s.wait_message(WAIT, "the goodbye");
    assert!(
        matches!(end, Err(Error::Disconnected { ref reason }) if reason.contains("configuration")),
        "{end:?}"
    );
    // It is refused from now on.
    let again = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts());
    assert!(
        matches!(again, Err(Error::HostNotAllowed { .. })),
        "{again:?}"
    );
    // The other subsystem's session never noticed.
    let o1 = {
        let n = other.namespace(1).unwrap();
        RemoteAddr {
            addr: n.remote_addr,
            rkey: n.rkey,
        }
    };
    assert_eq!(
        write_then_read(&mut other, o1, b"undisturbed"),
        [WcStatus::Success, WcStatus::Success]
    );
    assert_eq!(other.flush(1, 0, 11, WAIT).unwrap(), FlushStatus::Durable);
}

#[test]
fn sigterm_during_flush_load_exits_zero() {
    let d = scratch();
    let (mut t, mut s) = sigterm_with_flushes_in_flight(d.path());
    let sent = FLUSHES_IN_FLIGHT;
    // Every completion the host's queue holds is read, as verbs would: the responses the target
    // sent before its Disconnect are valid even once the connection is closed behind them.
    // (`sigterm_answers_reach_wait_message` checks the same through Session::wait_message.)
    let mut answered = Vec::new();
    let mut disconnect = None;
    let deadline = Instant::now() + WAIT;
    let mut wcs = [Completion::EMPTY; 16];
    loop {
        assert!(
            Instant::now() < deadline,
            "no Disconnect within {WAIT:?}: answered {answered:?}"
        );
        let n = s
            .cq()
            .wait(&mut wcs, Some(Duration::from_millis(50)))
            .unwrap();
        for c in &wcs[..n] {
            assert_ne!(c.wr_id & CONTROL_BIT, 0, "{c:?}");
            match s.handle(c) {
                Ok(Some(Message::FlushResponse(r))) => {
                    assert!(
                        disconnect.is_none(),
                        "a response after the Disconnect: {r:?}"
                    );
                    assert!(
                        matches!(r.status, FlushStatus::Durable | FlushStatus::Unavailable),
                        "{r:?}"
                    );
                    answered.push(r.token);
                }
                Ok(None) => {}
                Ok(Some(other)) => panic!("{other:?}"),
                Err(Error::Disconnected { reason }) if disconnect.is_none() => {
                    disconnect = Some(reason)
                }
                // Receives flushed after the end: not messages.
                Err(Error::Disconnected { .. }) => {}
                Err(e) => panic!("{e:?}: answered {answered:?}"),
            }
        }
        if n == 0 && disconnect.is_some() {
            break;
        }
    }
    let reason = disconnect.unwrap();
    assert!(reason.contains("shutting down"), "{reason}");
    eprintln!(
        "{} of {sent} flushes answered before the target went away",
        answered.len()
    );
    assert_answered_a_prefix(answered);
    let st = t.wait_exit(WAIT);
    assert!(st.success(), "{st:?}");
}

const FLUSHES_IN_FLIGHT: u64 = 48;

/// Starts a target, keeps many GPSPM flushes in flight on a session, then stops the daemon.
fn sigterm_with_flushes_in_flight(dir: &Path) -> (Target, Session) {
    let t = Target::start(dir, "");
    let mut s = t.session();
    send_flushes(&mut s, FLUSHES_IN_FLIGHT, 0);
    t.signal(Signal::SIGTERM);
    (t, s)
}

/// Flushes complete in any order (io_uring), and receives in arrival order: what the target had
/// received before it stopped is a prefix of what was sent, each token answered once (Durable,
/// or Unavailable after the goodbye).
fn assert_answered_a_prefix(mut answered: Vec<u64>) {
    answered.sort_unstable();
    let n = answered.len();
    answered.dedup();
    assert_eq!(answered.len(), n, "a flush was answered twice");
    assert!(answered.iter().all(|t| (1..=FLUSHES_IN_FLIGHT).contains(t)));
    assert_eq!(answered, (1..=answered.len() as u64).collect::<Vec<_>>());
}

/// The library's own wait returns every response the target sent before its goodbye, and only
/// then the Disconnect: nothing received is dropped because the connection closed behind it.
#[test]
fn sigterm_answers_reach_wait_message() {
    let d = scratch();
    let (mut t, mut s) = sigterm_with_flushes_in_flight(d.path());
    let mut answered = Vec::new();
    let end = loop {
        match s.wait_message(WAIT, "flush responses") {
            Ok(Message::FlushResponse(r)) => answered.push(r.token),
            Ok(other) => panic!("{other:?}"),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(end, Error::Disconnected { ref reason } if reason.contains("shutting down")),
        "{end:?}: answered {answered:?}"
    );
    assert!(!answered.is_empty());
    assert_answered_a_prefix(answered);
    assert!(t.wait_exit(WAIT).success());
}

#[test]
fn rdma_listener_is_refused_at_start() {
    let d = scratch();
    std::fs::write(
        d.path().join("c.toml"),
        "listen = [\"rdma://127.0.0.1:7\"]\ncontrol_socket = \"ctl.sock\"\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .arg("--config")
        .arg(d.path().join("c.toml"))
        .env_remove("NOTIFY_SOCKET")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rdma transport is not served"), "{err}");
}

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
    let t = Target::start(d.path(), "poll_loops = 2\nkeep_alive_ms = 30000");
    let mut s = t.session();
    assert_eq!(s.flush(1, 0, 4096, WAIT).unwrap(), FlushStatus::Durable);
    // A discovery connection held open too.
    let _disc = connect(&t.url(), &nqn(DISCOVERY_NQN), &host(PLAIN), &opts()).unwrap();
    // Let the busy-poll spells and the start-up settle.
    std::thread::sleep(Duration::from_millis(200));
    let pid = t.daemon.pid();
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
    let t = Target::start(d.path(), "");
    let mut silent: Vec<std::net::TcpStream> = (0..20)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", t.port)).unwrap())
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
    assert!(
        opened.elapsed() < Duration::from_secs(3),
        "the host waited {:?} behind silent peers",
        opened.elapsed()
    );
    // The silent ones are still open before their deadline...
    let mut byte = [0u8; 1];
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

#[test]
fn watchdog_pings_stop_while_a_poll_loop_is_stuck() {
    let d = scratch();
    // WATCHDOG_USEC 400 ms: a check every 200 ms. The test hook stalls the loop for 3 s when
    // it takes the reload command.
    let t = Target::start_with_env(
        d.path(),
        "",
        &[
            ("WATCHDOG_USEC", "400000"),
            ("RPMA_TARGET_TEST_STALL_ON_RELOAD_MS", "3000"),
        ],
    );
    // Pings flow while every thread makes progress (an idle loop is woken by the check).
    for _ in 0..3 {
        t.expect("WATCHDOG=1");
    }
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1");
    t.expect("READY=1");
    let reloaded = Instant::now();
    // At most one check can still see the loop's last turn; give it 600 ms, then none for 1.5 s.
    let mut pings = Vec::new();
    while reloaded.elapsed() < Duration::from_millis(2100) {
        let left = Duration::from_millis(2100).saturating_sub(reloaded.elapsed());
        if let Some(m) = t.daemon.next(left) {
            if m.starts_with("WATCHDOG=1") {
                pings.push(reloaded.elapsed());
            }
        }
    }
    assert!(
        pings.iter().all(|&at| at < Duration::from_millis(600)),
        "watchdog pinged while the loop was stuck: {pings:?}"
    );
    assert!(
        !t.log_lines(&["rpma-loop-0", "made no progress"]).is_empty(),
        "{}",
        t.log()
    );
    // The loop comes back: so do the pings.
    t.expect("WATCHDOG=1");
    assert!(
        reloaded.elapsed() >= Duration::from_millis(2500),
        "{:?}",
        reloaded.elapsed()
    );
}

#[test]
fn a_reload_that_changes_a_namespace_disconnects_its_sessions_with_the_reason() {
    let d = scratch();
    let top = "keep_alive_ms = 10000";
    let t = Target::start(d.path(), top);
    let mut other = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &opts()).unwrap();
    let mut s = t.session();
    assert_eq!(s.namespace(1).unwrap().size, 2 << 20);
    // Grow SUB's nsid 1 (which needs `grow = true`).
    let grown = config_text(t.port, top, "").replacen(
        "path = \"ns1\"\nsize = \"2MiB\"",
        "path = \"ns1\"\nsize = \"4MiB\"\ngrow = true",
        1,
    );
    assert!(grown.contains("4MiB"));
    std::fs::write(d.path().join("c.toml"), grown).unwrap();
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1");
    t.expect("READY=1");
    match s.wait_message(WAIT, "a Disconnect") {
        Err(Error::Disconnected { reason }) => {
            assert_eq!(reason, "namespace 1 changed by reload")
        }
        other => panic!("expected a Disconnect, got {other:?}"),
    }
    // The host reconnects and sees the new size; the other subsystem's session is untouched.
    let s = t.session();
    assert_eq!(s.namespace(1).unwrap().size, 4 << 20);
    assert_eq!(other.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    let v = t.status();
    assert!(
        v["last_reload"]
            .as_str()
            .unwrap()
            .contains("1 namespaces changed"),
        "{v}"
    );
}

#[test]
fn a_reload_that_would_grow_without_grow_changes_nothing() {
    let d = scratch();
    let top = "keep_alive_ms = 10000";
    let t = Target::start(d.path(), top);
    let mut s = t.session();
    let bigger = config_text(t.port, top, "").replacen(
        "path = \"ns1\"\nsize = \"2MiB\"",
        "path = \"ns1\"\nsize = \"4MiB\"",
        1,
    );
    std::fs::write(d.path().join("c.toml"), bigger).unwrap();
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1");
    t.expect("READY=1");
    let v = t.status();
    let last = v["last_reload"].as_str().unwrap();
    assert!(last.starts_with("failed") && last.contains("grow"), "{v}");
    assert_eq!(
        std::fs::metadata(d.path().join("ns1")).unwrap().len(),
        2 << 20
    );
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
}
