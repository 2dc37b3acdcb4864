//! What the target refuses and how it says so: every refusal reason of the Connect exchange, the
//! connection limit, an rdma:// listener at start-up.
//! The real `rpma-target` process and the rpma-initiator library in-process (the fixture of
//! [`rpma_tests::sessions`]); every wait has a deadline.

use std::process::Command;

use rpma_common::proto::auth::Psk;
use rpma_common::proto::{FlushStatus, Message, RefusalReason, PROTO_VERSION};
use rpma_initiator::{connect, identify, Error};
use rpma_tests::sessions::*;
use rpma_tests::{host, nqn, opts, scratch, target_bin};

#[test]
fn each_refusal() {
    let d = scratch();
    // Refusals are rate-limited per peer address (one WARN a period, the rest at DEBUG): every
    // peer here is 127.0.0.1, so the test reads the DEBUG lines too.
    let t = start_with_env(d.path(), "", &[("RUST_LOG", "debug")]);
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
        let lines = t.log_lines(parts, WAIT);
        assert_eq!(lines.len(), 1, "{parts:?}: {lines:#?}\n{}", t.log());
        let from = format!("from {}:", rpma_tests::Transport::current().host());
        assert!(lines[0].contains(&from), "{}", lines[0]);
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
    assert_eq!(
        t.log_lines(&["VersionUnsupported"], WAIT).len(),
        2,
        "{}",
        t.log()
    );
    once(&["refused host (unknown)", "ProtocolError"]);
}

/// `e` is the refusal of a full target.
fn assert_too_many<T: std::fmt::Debug>(e: &rpma_initiator::Result<T>) {
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
fn connection_limit_refuses_the_next() {
    let d = scratch();
    let t = start(d.path(), "max_connections = 1");
    let _a = session(&t);
    let e = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts());
    assert_too_many(&e);
}

/// A host that proved its key gets in when the target is full of sessions whose hosts proved
/// nothing: in the place of the oldest session of a host its subsystem does not list (a
/// subsystem open to any host) first, although a listed host's is older, then of the oldest of
/// a host listed without a key; each is closed and told why. A newcomer that proves nothing is
/// still refused. (Peers that proved nothing, from any address, held every place and locked
/// keyed hosts out; until the unlisted pool, the listed host's older session went first.)
#[test]
fn a_keyed_host_takes_the_place_of_an_unproven_session_in_a_full_target() {
    let d = scratch();
    let t = start(d.path(), "max_connections = 2");
    let mut oldest = session(&t);
    let mut open = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &opts()).unwrap();
    let e = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &opts());
    assert_too_many(&e);
    let keyed = host(KEYED).with_psk(Psk::from_hex(&KEY.repeat(32)).unwrap());
    let mut k = connect(&t.url(), &nqn(SUB), &keyed, &opts()).expect("the keyed host gets in");
    let end = open.wait_message(WAIT, "the goodbye");
    assert!(
        matches!(end, Err(Error::Disconnected { ref reason }) if reason.contains("proved its key")),
        "{end:?}"
    );
    // The keyed session works; the listed host's unproven one is untouched.
    assert_eq!(k.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    assert_eq!(oldest.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    // No unlisted session left: the next keyed host takes the listed host's place.
    let mut k2 = connect(&t.url(), &nqn(SUB), &keyed, &opts()).expect("a second keyed session");
    let end = oldest.wait_message(WAIT, "the goodbye");
    assert!(
        matches!(end, Err(Error::Disconnected { ref reason }) if reason.contains("proved its key")),
        "{end:?}"
    );
    assert_eq!(k2.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    let st = t.status();
    assert_eq!(st["admission"]["sessions"]["evicted"], 2, "{st}");
    assert_eq!(st["admission"]["unlisted"]["evicted"], 1, "{st}");
    assert_eq!(st["metrics"]["sessions_ended"]["evicted"], 2, "{st}");
    // Full again (two keyed sessions): nothing that proves no key gets in.
    let e = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts());
    assert_too_many(&e);
    let e = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &opts());
    assert_too_many(&e);
    assert_eq!(k.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
}

/// Connections that never Connect hold only what the Connect exchange needs until they are
/// admitted, however deep the sessions the target grants: at a queue depth where eight queue
/// pairs at full depth would need more completion queue entries than a Soft-RoCE device's
/// completion queue holds (max_cqe 32,767; one poll loop, so one completion queue), seven
/// half-open connections from the host's own address leave the host room for its session.
/// (Each reserved the session's depth at accept: the eighth queue pair, the host's, could not
/// be made, and no host got in while they were held.)
#[test]
fn half_open_connections_hold_no_session_depth() {
    let d = scratch();
    let t = start(d.path(), "max_queue_depth = 4400\npoll_loops = 1");
    let held: Vec<HalfOpen> = (0..7).map(|_| half_open(&t.url())).collect();
    let deadline = std::time::Instant::now() + WAIT;
    while t.status()["admission"]["unadmitted"]["held"] != 7 {
        assert!(
            std::time::Instant::now() < deadline,
            "the seven are not held: {}",
            t.status()["admission"]
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let mut s = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts())
        .expect("the host's session beside seven half-open connections");
    assert_eq!(s.queue_depth(), 4400);
    assert_eq!(s.flush(1, 0, 4096, WAIT).unwrap(), FlushStatus::Durable);
    assert_eq!(t.status()["admission"]["unadmitted"]["held"], 7);
    drop(held);
}

#[test]
fn rdma_listener_is_refused_at_start() {
    let d = scratch();
    std::fs::write(
        d.path().join("c.toml"),
        "listen = [\"rdma://127.0.0.1:7\"]\ncontrol_socket = \"ctl.sock\"\n",
    )
    .unwrap();
    let out = Command::new(target_bin())
        .arg("--config")
        .arg(d.path().join("c.toml"))
        .env_remove("NOTIFY_SOCKET")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // Built with the rdma transport, a machine without an RDMA device says so (tests/tests/
    // transport_rdma.rs has the rest); built without it, the build says it has none.
    let want = if cfg!(feature = "rdma") {
        "no RDMA device found; use tcp://"
    } else {
        "rdma transport is not served"
    };
    if cfg!(feature = "rdma") && std::path::Path::new("/sys/class/infiniband").exists() {
        eprintln!("skipped the message check: this machine has RDMA devices");
        return;
    }
    assert!(err.contains(want), "{err}");
}

rpma_tests::rdma_runs!(
    each_refusal,
    connection_limit_refuses_the_next,
    half_open_connections_hold_no_session_depth,
);
