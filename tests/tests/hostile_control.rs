//! Hostile peers on the control plane and floods, against the real `rpma-target`: a replayed
//! and a reflected authentication response, messages out of place, floods of zero-length
//! FPDUs. As in hostile_wire.rs: each gets its specific refusal, its connection closes (or,
//! for what the protocol allows, costs nothing and places nothing), SUB's namespaces are
//! unchanged and the legitimate host is served throughout. Every wait has a deadline.

mod hostile;

use std::io::{ErrorKind, Write};
use std::time::{Duration, Instant};

use hostile::{FromTarget, Suite};
use rpma_common::fabric::soft::wire::mpa::RtrTypes;
use rpma_common::fabric::soft::wire::{Header, Opcode, TermCause};
use rpma_common::proto::auth::{AuthContext, HostAuth, Psk};
use rpma_common::proto::nqn::DISCOVERY_NQN;
use rpma_common::proto::{
    AuthResponse, Connect, FlushRequest, FlushStatus, HostId, KeepAlive, Message, RefusalReason,
};
use rpma_tests::nqn;
use rpma_tests::sessions::{KEY, KEYED, OPEN_HOST, PLAIN, SUB, WAIT};

/// Connect as KEYED to SUB: the target's challenge.
fn keyed_connect(p: &mut hostile::Peer, id: HostId) -> rpma_common::proto::AuthChallenge {
    p.message(&Message::Connect(Connect {
        host_nqn: nqn(KEYED),
        subsystem_nqn: nqn(SUB),
        host_id: id,
        queue_id: 0,
        // Long enough that the session outlives the attacks beside it without keep-alives.
        keep_alive_ms: 60_000,
    }));
    match p.next_message() {
        Message::AuthChallenge(c) => c,
        other => panic!("expected a challenge, got {other:?}"),
    }
}

/// The next message is a Refusal for `reason`, and the target closes the connection.
fn refused(p: &mut hostile::Peer, reason: RefusalReason, case: &str) {
    match p.next_message() {
        Message::Refusal(r) => assert_eq!(r.reason, reason, "{case}: {r:?}"),
        other => panic!("{case}: expected a Refusal, got {other:?}"),
    }
    assert!(p.closed(), "{case}: the connection stayed open");
}

#[test]
fn recorded_or_reflected_auth_responses_are_refused() {
    let mut s = Suite::start("");
    let id = HostId([0x5A; 16]);
    let psk = || Psk::from_hex(&KEY.repeat(32)).unwrap();
    let ctx = AuthContext {
        host_nqn: nqn(KEYED),
        subsystem_nqn: nqn(SUB),
        host_id: id,
    };
    // The real host authenticates; an eavesdropper records its response.
    let mut host = s.peer();
    let ch = keyed_connect(&mut host, id);
    let (awaiting, recorded) = HostAuth::new(psk(), ctx.clone()).on_challenge(&ch).unwrap();
    host.message(&Message::AuthResponse(recorded.clone()));
    match host.next_message() {
        Message::AuthConfirm(c) => awaiting.on_confirm(&c).unwrap(),
        other => panic!("expected AuthConfirm, got {other:?}"),
    }
    assert!(matches!(host.next_message(), Message::ConnectResponse(_)));

    // The replay, on a connection of its own: a fresh challenge, so the proof fails.
    let mut p = s.peer();
    let ch2 = keyed_connect(&mut p, id);
    assert_ne!(ch2.target_nonce, ch.target_nonce);
    p.message(&Message::AuthResponse(recorded));
    refused(&mut p, RefusalReason::AuthFailed, "replayed auth response");
    s.unchanged("replayed auth response");

    // The target's own nonce sent back as the host's.
    let mut p = s.peer();
    let ch3 = keyed_connect(&mut p, id);
    p.message(&Message::AuthResponse(AuthResponse {
        host_nonce: ch3.target_nonce,
        host_mac: [0; 32],
    }));
    refused(&mut p, RefusalReason::AuthFailed, "reflected auth nonce");
    s.unchanged("reflected auth nonce");

    // The authenticated session was not disturbed by either.
    host.message(&Message::FlushRequest(FlushRequest {
        nsid: 1,
        offset: 0,
        length: 4096,
        token: 5,
    }));
    match host.next_message() {
        Message::FlushResponse(r) => assert_eq!((r.token, r.status), (5, FlushStatus::Durable)),
        other => panic!("{other:?}"),
    }
    s.finish();
}

#[test]
fn messages_out_of_place_end_their_connection() {
    let mut s = Suite::start("");
    // Before Connect: anything else is a protocol error.
    let mut p = s.peer();
    p.message(&Message::FlushRequest(FlushRequest {
        nsid: 1,
        offset: 0,
        length: 8,
        token: 1,
    }));
    refused(
        &mut p,
        RefusalReason::ProtocolError,
        "FlushRequest before Connect",
    );
    s.unchanged("FlushRequest before Connect");

    // A second Connect in a session: the session ends with a Disconnect naming why.
    let mut p = s.peer();
    p.admit();
    p.connect(PLAIN, SUB);
    match p.next_message() {
        Message::Disconnect(d) => assert!(d.reason.contains("protocol error"), "{d:?}"),
        other => panic!("expected a Disconnect, got {other:?}"),
    }
    assert!(p.closed(), "a second Connect: the connection stayed open");
    s.unchanged("a second Connect in a session");

    // A discovery session asked to flush.
    let mut p = s.peer();
    p.connect(OPEN_HOST, DISCOVERY_NQN);
    assert!(matches!(p.next_message(), Message::ConnectResponse(_)));
    p.message(&Message::FlushRequest(FlushRequest {
        nsid: 1,
        offset: 0,
        length: 8,
        token: 2,
    }));
    match p.next_message() {
        Message::Disconnect(d) => assert!(d.reason.contains("discovery"), "{d:?}"),
        other => panic!("expected a Disconnect, got {other:?}"),
    }
    assert!(
        p.closed(),
        "a flush on a discovery session: the connection stayed open"
    );
    s.unchanged("FlushRequest on a discovery session");

    // A Send that is no message at all (zero bytes) before Connect.
    let mut p = s.peer();
    p.send(&[]);
    refused(&mut p, RefusalReason::ProtocolError, "an empty Send");
    s.unchanged("an empty Send");

    // Immediate Data (RFC 7306; an RDMA Write with immediate on rdma) takes a receive and
    // writes no message into it, before and in a session: the receive's slot held an earlier
    // message, which the target decoded again (over rdma, where the completion's length is
    // the Write's: a replay of the peer's own earlier Flush Request or Connect).
    let mut p = s.peer();
    p.admit();
    let h = Header::untagged(Opcode::ImmediateData, p.msn, true);
    let f = p.fpdu(h, &[0x5a; 8]);
    p.raw(&f);
    match p.next_message() {
        Message::Disconnect(d) => assert!(d.reason.contains("RecvRdmaWithImm"), "{d:?}"),
        other => panic!("expected a Disconnect, got {other:?}"),
    }
    assert!(p.closed(), "Immediate Data: the connection stayed open");
    s.unchanged("Immediate Data in a session");
    let mut p = s.peer();
    let h = Header::untagged(Opcode::ImmediateData, p.msn, true);
    let f = p.fpdu(h, &[0x5a; 8]);
    p.raw(&f);
    refused(&mut p, RefusalReason::ProtocolError, "Immediate Data");
    s.unchanged("Immediate Data before Connect");
    s.finish();
}

/// Writes `fpdu` back to back, `count` times or for `for_how_long` or until the target closes,
/// ending on an FPDU boundary: the FPDUs sent, and whether the target closed the connection.
fn flood(p: &mut hostile::Peer, fpdu: &[u8], count: u64, for_how_long: Duration) -> (u64, bool) {
    let batch: Vec<u8> = fpdu.repeat((64 << 10) / fpdu.len());
    let until = Instant::now() + for_how_long;
    let max_bytes = count.saturating_mul(fpdu.len() as u64);
    let (mut bytes, mut at) = (0u64, 0usize);
    p.s.set_write_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let cut = loop {
        if at == batch.len() {
            if Instant::now() >= until || bytes >= max_bytes {
                break false;
            }
            at = 0;
        }
        match p.s.write(&batch[at..]) {
            Ok(n) => {
                at += n;
                bytes += n as u64;
            }
            // The target is behind and its socket buffer full.
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if Instant::now() >= until + WAIT {
                    panic!("the target stopped reading a flood");
                }
            }
            Err(_) => break true,
        }
    };
    p.s.set_write_timeout(Some(WAIT)).unwrap();
    (bytes / fpdu.len() as u64, cut)
}

#[test]
fn floods_of_zero_length_fpdus_cost_nothing_and_change_nothing() {
    // A long handshake deadline: only a Terminate can end these connections before the test
    // gives up waiting.
    let mut s = Suite::start("handshake_timeout_ms = 60000");
    // A zero-length Write places nothing, but before Connect nothing is registered for the
    // connection: the first one is answered with a Terminate, whatever STag it names (the
    // legitimate host's own rkey, or a made-up one), instead of a flood of them keeping the
    // target busy until the handshake deadline (issue 22, F9).
    let legit = (s.legit.desc.rkey, s.legit.desc.remote_addr);
    for (stag, to, cause, case) in [
        (
            legit.0,
            legit.1,
            TermCause::DDP_TAGGED_STAG_NOT_ASSOCIATED,
            "zero-length Writes before Connect (the host's rkey)",
        ),
        (
            0xdead_be01,
            0,
            TermCause::DDP_TAGGED_INVALID_STAG,
            "zero-length Writes before Connect (a made-up STag)",
        ),
    ] {
        let mut p = s.peer();
        let z = p.write_fpdu(stag, to, &[]);
        // A burst the socket takes at once: the Terminate is read before anything else.
        p.raw(&z.repeat(1000));
        p.expect_terminate(cause, case);
        s.unchanged(case);
    }
    // A peer that negotiated peer-to-peer mode with a zero-length Write as its RTR may send
    // that one first, whatever its STag; the next is checked like any other.
    s.mpa.peer_to_peer = Some(RtrTypes {
        send: false,
        write: true,
        read: false,
    });
    let mut p = s.peer();
    s.mpa.peer_to_peer = None;
    let z = p.write_fpdu(0, 0, &[]);
    p.raw(&z);
    assert!(p.still_open(), "the peer-to-peer RTR was refused");
    p.raw(&z);
    p.expect_terminate(TermCause::DDP_TAGGED_INVALID_STAG, "a second RTR");
    s.unchanged("a zero-length Write after the peer-to-peer RTR");

    // In a session the same flood is within the protocol: nothing placed, the session still
    // answers, and the target stays responsive to everyone else. (A bounded one: the target
    // drains it in order, and the session's own keep-alive waits behind it.)
    let mut p = s.peer();
    let r = p.admit();
    let n1 = hostile::ns(&r, 1).clone();
    let z = p.write_fpdu(n1.rkey, n1.remote_addr, &[]);
    let (sent, cut) = flood(&mut p, &z, 50_000, Duration::from_secs(2));
    assert!(!cut, "a session flooding zero-length Writes was closed");
    s.legit
        .progressed("a flood of zero-length Writes in a session");
    p.message(&Message::FlushRequest(FlushRequest {
        nsid: 1,
        offset: 0,
        length: 8,
        token: 3,
    }));
    loop {
        match p.next(WAIT) {
            Some(FromTarget::Message(Ok(Message::FlushResponse(f)))) => {
                assert_eq!((f.token, f.status), (3, FlushStatus::Durable));
                break;
            }
            Some(FromTarget::Other(_)) => {}
            other => panic!("after {sent} zero-length Writes: {other:?}"),
        }
    }
    s.unchanged("a flood of zero-length Writes in a session");

    // Zero-length Sends each take a receive slot: the first is no message (a protocol error),
    // and the rest find no posted receive.
    let mut p = s.peer();
    let mut burst = Vec::new();
    for _ in 0..64 {
        burst.extend(p.send_fpdu(&[]));
    }
    p.raw(&burst);
    let mut terminated = false;
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        match p.next(WAIT) {
            Some(FromTarget::Terminate(t)) => {
                assert_eq!(t.cause, TermCause::DDP_UNTAGGED_NO_BUFFER);
                terminated = true;
            }
            Some(FromTarget::Closed) => break,
            Some(_) => {}
            None => panic!("a flood of zero-length Sends: the connection stayed open"),
        }
    }
    assert!(
        terminated,
        "a flood of zero-length Sends was not terminated"
    );
    s.unchanged("a flood of zero-length Sends");
    s.finish();
}

/// The `messages` count of the session whose peer address is `peer`, None once it is gone.
fn messages_of(s: &Suite, peer: &str) -> Option<u64> {
    s.t.status()["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["peer"] == peer)
        .map(|x| x["messages"].as_u64().unwrap())
}

#[test]
fn a_session_that_never_reads_its_answers_is_closed_with_bounded_memory() {
    // Receive slots enough for big bursts: each is sent only once the target took in the one
    // before it (status' message count), so that none finds its receives all in use.
    let mut s = Suite::start("max_queue_depth = 1020");
    let (mut p, _, _) = s.admitted();
    let peer = p.s.local_addr().unwrap().to_string();
    // The peer never reads: once the sockets' buffers are full, each echo of the target waits
    // in its memory. A small receive buffer on our side gets there sooner.
    nix::sys::socket::setsockopt(&p.s, nix::sys::socket::sockopt::RcvBuf, &4096).unwrap();
    let before = rpma_tests::stress::memory(s.t.pid());
    const BURST: u64 = 1000;
    // Far more echoes than both socket buffers hold (each is about 40 bytes on the wire).
    const MOST: u64 = 2_000_000;
    let (mut sent, mut seq) = (messages_of(&s, &peer).unwrap(), 0u64);
    let deadline = Instant::now() + WAIT * 6;
    let closed = 'flood: loop {
        let mut burst = Vec::new();
        for _ in 0..BURST {
            seq += 1;
            let body = Message::KeepAlive(KeepAlive { seq }).encode().unwrap();
            burst.extend(p.send_fpdu(&body));
        }
        if p.s.write_all(&burst).is_err() {
            break true;
        }
        sent += BURST;
        loop {
            match messages_of(&s, &peer) {
                None => break 'flood true,
                Some(n) if n >= sent => break,
                Some(_) => {}
            }
            assert!(
                Instant::now() < deadline,
                "the target stopped taking in keep-alives"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        if seq >= MOST || Instant::now() >= deadline {
            break false;
        }
    };
    let after = rpma_tests::stress::memory(s.t.pid());
    let grew = after.anon_kib.saturating_sub(before.anon_kib);
    assert!(
        closed,
        "a session that sent {seq} keep-alives and read none of the echoes was not closed \
         (anonymous memory grew {grew} KiB)"
    );
    // Its slots and its backlog are freed with it; what the target held meanwhile was bounded.
    assert!(
        grew < 16 << 10,
        "the target's anonymous memory grew {grew} KiB"
    );
    eprintln!("closed after {seq} keep-alives read by nobody; anonymous memory grew {grew} KiB");
    s.unchanged("a session that never reads its answers");
    s.finish();
}

#[test]
fn flush_requests_beyond_the_queue_depth_end_the_session() {
    let mut s = Suite::start("max_queue_depth = 2");
    let mut p = s.peer();
    let r = p.admit();
    assert_eq!(r.queue_depth, 2);
    // Four at once (the target has 2 + 4 receives posted): the third is one too many while
    // the first two are not answered yet.
    let mut burst = Vec::new();
    for token in 1..=4 {
        let body = Message::FlushRequest(FlushRequest {
            nsid: 1,
            offset: 0,
            length: 4096,
            token,
        })
        .encode()
        .unwrap();
        burst.extend(p.send_fpdu(&body));
    }
    p.raw(&burst);
    let (mut answers, mut goodbye) = (Vec::new(), None);
    loop {
        match p.next(WAIT) {
            Some(FromTarget::Message(Ok(Message::FlushResponse(f)))) => {
                answers.push((f.token, f.status))
            }
            Some(FromTarget::Message(Ok(Message::Disconnect(d)))) => goodbye = Some(d.reason),
            Some(FromTarget::Closed) => break,
            other => panic!("after {answers:?}, {goodbye:?}: {other:?}"),
        }
    }
    let why = goodbye.expect("no Disconnect");
    assert!(why.contains("beyond the queue depth"), "{why}");
    answers.sort_by_key(|a| a.0);
    // The two within the depth are served, the one after the goodbye is told it was not.
    assert_eq!(
        answers,
        [
            (1, FlushStatus::Durable),
            (2, FlushStatus::Durable),
            (4, FlushStatus::Unavailable)
        ]
    );
    s.unchanged("FlushRequests beyond the queue depth");
    s.finish();
}

/// A host that asks for whole-namespace GPSPM flushes of a dax namespace, as many as its
/// queue depth, is answered durable for each (the write-back taken a step at a time, between
/// the loop's other work), and one that asks and drops its connection leaves nothing behind:
/// the legitimate host on the same (single) loop is served throughout. (The write-back of each
/// was done in one go inside the loop's turn: 0.1 s per GiB, a loop held for seconds by a
/// depth of flushes of a namespace of some GiB; the flusher's
/// a_long_dax_write_back_is_taken_a_step_per_poll shows the steps.)
#[test]
fn whole_namespace_flushes_of_a_dax_namespace_leave_the_loop_to_its_other_hosts() {
    let shm = rpma_tests::Shm::new("whole-flush");
    let big = rpma_tests::Namespace::new(4, shm.path(), "64MiB").force_dax();
    let mut s = Suite::start_with("poll_loops = 1", &big.to_string());
    let flushes = |p: &mut hostile::Peer, depth: u64| {
        let mut burst = Vec::new();
        for token in 1..=depth {
            let body = Message::FlushRequest(FlushRequest {
                nsid: 4,
                offset: 0,
                length: 0,
                token,
            })
            .encode()
            .unwrap();
            burst.extend(p.send_fpdu(&body));
        }
        p.raw(&burst);
    };
    let mut p = s.peer();
    let depth = u64::from(p.admit().queue_depth.min(16));
    flushes(&mut p, depth);
    let mut answered = Vec::new();
    while answered.len() < depth as usize {
        match p.next_message() {
            Message::FlushResponse(f) => answered.push((f.token, f.status)),
            other => panic!("after {answered:?}: {other:?}"),
        }
    }
    answered.sort_by_key(|a| a.0);
    assert!(
        answered
            .iter()
            .enumerate()
            .all(|(i, a)| *a == (i as u64 + 1, FlushStatus::Durable)),
        "{answered:?}"
    );
    s.unchanged("a queue depth of whole-namespace flushes of a dax namespace");
    let mut gone = s.peer();
    let depth = u64::from(gone.admit().queue_depth.min(16));
    flushes(&mut gone, depth);
    drop(gone);
    s.unchanged("whole-namespace flushes of a host that left");
    drop(p);
    s.finish();
}

/// A host that says Disconnect and keeps its connection open (the target lingers on it) gives
/// its session's place in the pools back at once, with the session: a newcomer in a full
/// target must not take the place of a session that no longer is (the target would run over
/// `max_connections`). The sessions and the unlisted pool go down together. (The pool held it
/// until the linger ended.)
#[test]
fn a_session_its_host_disconnected_leaves_the_pools_with_it() {
    let mut s = Suite::start("");
    let held = |s: &Suite| {
        let v = s.t.status();
        let n = |pool: &str| v["admission"][pool]["held"].as_u64().unwrap() as i64;
        (n("sessions"), n("unlisted"))
    };
    let mut p = s.peer();
    p.connect(OPEN_HOST, rpma_tests::sessions::OPEN);
    assert!(matches!(p.next_message(), Message::ConnectResponse(_)));
    let (sessions, unlisted) = held(&s);
    assert!(unlisted >= 1, "the open subsystem's host is unlisted");
    p.message(&Message::Disconnect(rpma_common::proto::Disconnect {
        reason: "done".into(),
    }));
    let deadline = Instant::now() + WAIT;
    loop {
        let (now_sessions, now_unlisted) = held(&s);
        if now_sessions < sessions {
            // Both counts move together whatever else comes and goes (the legitimate host's
            // sessions are unlisted ones too).
            assert_eq!(
                now_sessions - now_unlisted,
                sessions - unlisted,
                "the session is gone and its place is still held"
            );
            break;
        }
        assert!(Instant::now() < deadline, "the Disconnect ended no session");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(p.still_open(), "the target lingers on the connection");
    s.finish();
}
