//! Hostile peers on the wire, against the real `rpma-target`: raw MPA/DDP/RDMAP from other
//! loopback addresses, each breaking one rule, while a legitimate host keeps writing and
//! verifying on another subsystem. Each attack gets its specific refusal (an MPA reject Reply,
//! or a Terminate with the RFC cause), its connection is closed, SUB's namespaces are
//! unchanged (checksums), and the legitimate host is served throughout
//! (tests/tests/hostile/mod.rs has the raw peer and the checks). Every wait has a deadline.

mod hostile;

use hostile::{mpa_answer, ns, FromTarget, Peer, Suite};
use rpma_common::fabric::soft::wire::mpa::{MpaConfig, MpaFrame};
use rpma_common::fabric::soft::wire::rdmap::{
    AtomicRequest, FlushPlacement, FlushRequest, FlushSelectivity, ReadRequest,
};
use rpma_common::fabric::soft::wire::{crc32c, Caps, Header, Opcode, TermCause, Terminate};
use rpma_common::proto::{Disconnect, KeepAlive, Message};
use rpma_tests::sessions::WAIT;

/// `f` with its CRC recomputed (after a deliberate change to its header).
fn recrc(mut f: Vec<u8>) -> Vec<u8> {
    let n = f.len() - 4;
    let c = crc32c(&f[..n]).to_le_bytes();
    f[n..].copy_from_slice(&c);
    f
}

fn request_bytes(f: impl FnOnce(&mut MpaFrame)) -> Vec<u8> {
    let mut r = MpaConfig::default().request();
    f(&mut r);
    r.encode().unwrap()
}

#[test]
fn mpa_requests_that_break_the_rules_are_rejected() {
    let mut s = Suite::start("");
    let mut bad_key = request_bytes(|_| {});
    bad_key[..16].copy_from_slice(b"MPA ID Bad Frame");
    // 600 bytes of private data: more than RFC 5044's 512 (read and dropped, then rejected).
    let mut long = request_bytes(|_| {});
    long[18..20].copy_from_slice(&600u16.to_be_bytes());
    long.resize(20 + 600, 0x41);
    let cases = [
        ("bad MPA key", bad_key),
        ("private data too long", long),
        ("markers requested", request_bytes(|r| r.markers = true)),
        (
            "MPA revision 1",
            request_bytes(|r| {
                r.revision = 1;
                r.enhanced = false;
                r.ird_ord = None;
            }),
        ),
        (
            "no IRD/ORD prefix",
            request_bytes(|r| {
                r.enhanced = false;
                r.ird_ord = None;
            }),
        ),
    ];
    for (case, bytes) in cases {
        let src = s.src();
        let (reply, closed) = mpa_answer(s.port(), src, &bytes);
        let reply = reply.unwrap_or_else(|| panic!("{case}: no MPA Reply"));
        assert!(reply.reject, "{case}: the Reply accepted: {reply:?}");
        assert!(closed, "{case}: the connection stayed open");
        s.unchanged(case);
    }
    s.finish();
}

#[test]
fn bad_frames_before_connect_get_the_rfc_terminate() {
    let mut s = Suite::start("");

    let p = s.peer();
    assert!(p.n.crc, "the target asks for CRC");
    let ka = KeepAlive { seq: 1 }.encode();
    let mut f = p.fpdu(Header::untagged(Opcode::Send, 1, true), &ka);
    f[22] ^= 0x01;
    s.terminated(p, &f, TermCause::MPA_CRC, "CRC mismatch");

    // A Write whose ULPDU length runs 1000 bytes past its 32 bytes of payload, into the
    // FPDUs after it: the CRC cannot match (RFC 5044 §8: the stream is lost).
    let p = s.peer();
    let mut f = p.write_fpdu(0x100, 0, &[0xEE; 32]);
    f[..2].copy_from_slice(&(14u16 + 32 + 1000).to_be_bytes());
    let mut f = recrc(f);
    for msn in 1..=40 {
        f.extend(p.fpdu(Header::untagged(Opcode::Send, msn, true), &ka));
    }
    s.terminated(p, &f, TermCause::MPA_CRC, "ULPDU length past the data");

    // A ULPDU length of 10: shorter than the tagged header it starts.
    let p = s.peer();
    let f = recrc(vec![0, 10, 0xC1, 0x40, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    let case = "ULPDU shorter than its header";
    s.terminated(p, &f, TermCause::MPA_LENGTH_MISMATCH, case);

    let p = s.peer();
    let mut f = p.fpdu(Header::untagged(Opcode::Send, 1, true), &[0; 8]);
    f[3] = 0x40 | 0x0F;
    let f = recrc(f);
    s.terminated(
        p,
        &f,
        TermCause::RDMAP_UNEXPECTED_OPCODE,
        "unknown opcode 0xF",
    );

    // A peer that advertised no capabilities may not use the private opcodes, nor RFC 7306.
    let foreign = MpaConfig {
        caps: Caps::foreign(Vec::new()),
        ..MpaConfig::default()
    };
    let flush = FlushRequest {
        req_id: 1,
        placement: FlushPlacement::Persistent,
        selectivity: FlushSelectivity::Region { stag: 0x101 },
    };
    let atomic = AtomicRequest::fetch_add(1, 0x101, 0, 1);
    for (case, op, body) in [
        (
            "private opcode not negotiated",
            Opcode::FlushRequest,
            flush.encode().to_vec(),
        ),
        (
            "RFC 7306 atomic not negotiated",
            Opcode::AtomicRequest,
            atomic.encode().to_vec(),
        ),
    ] {
        let src = s.src();
        let mut p = Peer::open_with(s.port(), src, &foreign);
        assert_eq!(p.n.shared.0, 0, "nothing optional is shared");
        let f = p.request_fpdu(op, &body);
        s.terminated(p, &f, TermCause::RDMAP_UNEXPECTED_OPCODE, case);
    }

    // Until admission a connection has only its handshake's few receive slots: eight Sends
    // in one segment overrun them.
    let p = s.peer();
    let mut burst = Vec::new();
    for seq in 0..8u32 {
        let h = Header::untagged(Opcode::Send, seq + 1, true);
        burst.extend(p.fpdu(h, &KeepAlive { seq: seq.into() }.encode()));
    }
    let case = "Send with no posted Recv";
    s.terminated(p, &burst, TermCause::DDP_UNTAGGED_NO_BUFFER, case);

    let p = s.peer();
    let f = p.write_fpdu(0x00DE_AD01, 0, &[0xEE; 64]);
    s.terminated(p, &f, TermCause::DDP_TAGGED_INVALID_STAG, "unknown STag");

    // The peer's own Terminate ends its connection only: the target closes it, sends nothing.
    let mut p = s.peer();
    let t = Terminate::new(TermCause::RDMAP_OPERATION_UNSPECIFIED);
    let f = p.fpdu(Header::untagged(Opcode::Terminate, 1, true), &t.encode());
    p.raw(&f);
    match p.next(WAIT) {
        Some(FromTarget::Closed) => {}
        other => panic!("after the peer's Terminate: {other:?}"),
    }
    s.unchanged("the peer's Terminate");

    // Writes before Connect: the legitimate host's own rkey and address (the best guess there
    // is) belong to its connection only; guessed STags name nothing this connection may write
    // (no region, another connection's, or one without remote rights).
    let (rkey, addr) = (s.legit.desc.rkey, s.legit.desc.remote_addr);
    let refused = [
        TermCause::DDP_TAGGED_INVALID_STAG,
        TermCause::DDP_TAGGED_STAG_NOT_ASSOCIATED,
        TermCause::RDMAP_ACCESS_RIGHTS,
    ];
    for stag in [rkey, rkey.wrapping_add(0x100), rkey ^ 0x01, 0x101, 0x201] {
        let mut p = s.peer();
        let f = p.write_fpdu(stag, addr, &[0xEE; 64]);
        p.raw(&f);
        let case = "a Write before Connect with a guessed STag";
        let t = p.expect_terminate_any(&refused, case);
        if stag == rkey {
            assert_eq!(t.cause, TermCause::DDP_TAGGED_STAG_NOT_ASSOCIATED);
        }
        s.unchanged(case);
    }
    s.finish();
}

#[test]
fn an_admitted_peer_reaches_only_what_it_was_granted() {
    let mut s = Suite::start("");
    admitted_peer_cases(&mut s);
    s.finish();
}

/// Without CRC the target judges a Write's header as soon as it is in and reads a large payload
/// straight into place: the same refusals, before a byte lands.
#[test]
fn without_crc_the_same_refusals_come_before_any_byte_lands() {
    let mut s = Suite::start("crc = false");
    s.mpa.crc = false;
    let (p, n1, _) = s.admitted();
    assert!(!p.n.crc);
    // 60 KiB: more than the receiver reads ahead, so it would be streamed into place.
    let big = vec![0xEE; 60 << 10];
    let f = p.write_fpdu(n1.rkey, n1.remote_addr + n1.size - 4096, &big);
    let case = "a large Write past the end, CRC off";
    s.terminated(p, &f, TermCause::DDP_TAGGED_BASE_BOUNDS, case);
    admitted_peer_cases(&mut s);
    s.finish();
}

fn admitted_peer_cases(s: &mut Suite) {
    let bytes = [0xEE; 64];
    let (p, n1, _) = s.admitted();
    let f = p.write_fpdu(n1.rkey, n1.remote_addr + n1.size - 8, &bytes);
    s.terminated(p, &f, TermCause::DDP_TAGGED_BASE_BOUNDS, "TO past the end");

    let (p, n1, _) = s.admitted();
    let f = p.write_fpdu(n1.rkey, n1.remote_addr.wrapping_sub(64), &bytes);
    s.terminated(
        p,
        &f,
        TermCause::DDP_TAGGED_BASE_BOUNDS,
        "TO before the start",
    );

    let (p, _, n3) = s.admitted();
    let f = p.write_fpdu(n3.rkey, n3.remote_addr, &bytes);
    let case = "write to a read-only namespace";
    s.terminated(p, &f, TermCause::RDMAP_ACCESS_RIGHTS, case);

    let (mut p, n1, _) = s.admitted();
    let fetch_add = AtomicRequest::fetch_add(1, n1.rkey, n1.remote_addr + 4, 1);
    let f = p.request_fpdu(Opcode::AtomicRequest, &fetch_add.encode());
    s.terminated(p, &f, TermCause::RDMAP_BASE_BOUNDS, "unaligned atomic");

    let (p, n1, _) = s.admitted();
    let f = p.write_fpdu(n1.rkey ^ 0x00FF_0000, n1.remote_addr, &bytes);
    let case = "unknown STag in a session";
    s.terminated(p, &f, TermCause::DDP_TAGGED_INVALID_STAG, case);

    // ORD 1 asks the target for IRD 1: four 1 MiB Reads in one segment overrun it (RFC 5040
    // §6.4; as Linux siw, a Remote Operation Error catastrophic to the stream).
    let src = s.src();
    let one = MpaConfig {
        ord: 1,
        ..s.mpa.clone()
    };
    let mut p = Peer::open_with(s.port(), src, &one);
    assert_eq!(p.n.ord, 1);
    let r = p.admit();
    let n1 = ns(&r, 1).clone();
    let mut reads = Vec::new();
    for _ in 0..4 {
        let rr = ReadRequest {
            sink_stag: 0x4242,
            sink_to: 0,
            size: 1 << 20,
            src_stag: n1.rkey,
            src_to: n1.remote_addr,
        };
        reads.extend(p.request_fpdu(Opcode::ReadRequest, &rr.encode()));
    }
    s.terminated(
        p,
        &reads,
        TermCause::RDMAP_CATASTROPHIC_STREAM,
        "Reads beyond IRD",
    );

    // A session's rkey dies with it: after its Disconnect, another session's Write with it
    // names no region.
    let (mut a, old, _) = s.admitted();
    a.message(&Message::Disconnect(Disconnect {
        reason: "done".into(),
    }));
    drop(a);
    let deadline = std::time::Instant::now() + WAIT;
    while s.t.status()["sessions"].as_array().unwrap().len() > 1 {
        assert!(std::time::Instant::now() < deadline, "the session stayed");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (b, n1, _) = s.admitted();
    assert_ne!(
        n1.rkey, old.rkey,
        "a closed session's rkey was handed out again"
    );
    let f = b.write_fpdu(old.rkey, old.remote_addr, &bytes);
    let case = "rkey of a closed session";
    s.terminated(b, &f, TermCause::DDP_TAGGED_INVALID_STAG, case);

    // A well-behaved admitted raw peer still gets its answers.
    let mut ok = s.peer();
    ok.admit();
    ok.message(&Message::KeepAlive(KeepAlive { seq: 9 }));
    assert_eq!(ok.next_message(), Message::KeepAlive(KeepAlive { seq: 9 }));
    assert!(ok.still_open());
}
