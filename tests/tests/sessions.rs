//! Sessions end to end: readiness means accepting, Identify, GPSPM flushes and their counters,
//! the queue depth the Connect Response grants.
//! The real `rpma-target` process and the rpma-initiator library in-process (the fixture of
//! [`rpma_tests::sessions`]); every wait has a deadline.

use std::time::{Duration, Instant};

use rpma_common::fabric::{RemoteAddr, WcStatus};
use rpma_common::proto::nqn::DISCOVERY_NQN;
use rpma_common::proto::{FlushStatus, Message};
use rpma_initiator::{connect, identify};
use rpma_tests::sessions::*;
use rpma_tests::{host, nqn, opts, scratch, status};

#[test]
fn ready_means_accepting_identify_and_gpspm() {
    let d = scratch();
    let t = start(d.path(), "");
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
    let tr = rpma_tests::Transport::current();
    assert_eq!(n1.domain, tr.file_domain());
    assert_eq!(n1.durability, tr.offered(tr.file_domain()));
    assert!(id.namespaces[1].read_only);

    // A keep-alive longer than the test: it sends none, and under emulation (the VM lab's TCG)
    // its steps take longer than the 5 s default, after which the target ends the session.
    let long = rpma_initiator::ConnectOptions {
        keep_alive: Duration::from_secs(600),
        ..opts()
    };
    let mut s = connect(&t.url(), &nqn(SUB), &host(PLAIN), &long).unwrap();
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
    // The discovery connection asks for the longest keep-alive it may have (clamped to the
    // target's 10 s) for the same reason.
    let disc = connect(&t.url(), &nqn(DISCOVERY_NQN), &host(OPEN_HOST), &long).unwrap();
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
        .contains("RDMA Writes, Reads, Atomics and Flushes"));
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
    // A discovery connection leaves the list when it ends; the I/O session stays.
    drop(disc);
    let deadline = Instant::now() + WAIT;
    loop {
        let now = t.status();
        let kinds: Vec<&str> = now["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["kind"].as_str().unwrap())
            .collect();
        if kinds == ["io"] {
            break;
        }
        assert!(
            kinds.contains(&"discovery") && Instant::now() < deadline,
            "the discovery connection stayed listed, or the I/O session left: {now}"
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
fn connect_response_grants_the_configured_queue_depth() {
    let d = scratch();
    let t = start(d.path(), "max_queue_depth = 16");
    match raw_exchange(&t.url(), |b| b) {
        Message::ConnectResponse(r) => {
            assert_eq!(r.queue_depth, 16);
            assert_eq!(r.namespaces.len(), 2);
        }
        other => panic!("{other:?}"),
    }
    // 16 FlushRequests outstanding at once are within the grant: all answered.
    let mut s = session(&t);
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

rpma_tests::rdma_runs!(
    ready_means_accepting_identify_and_gpspm,
    connect_response_grants_the_configured_queue_depth,
);
