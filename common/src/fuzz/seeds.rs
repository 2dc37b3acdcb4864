//! Real inputs for the fuzz targets, built with the crate's own encoders: what the engine and
//! the daemon exchange in normal use, and the malformed frames the hostile tests send. The
//! corpus in `fuzz/corpus/` starts from these (`cargo run -p rpma-tests --example
//! fuzz_seeds`), and the replay test runs them too.

use crate::fabric::soft::wire::ddp::{Header, Opcode};
use crate::fabric::soft::wire::mpa::{reject_reply, IrdOrd, MpaConfig, MpaFrame, MpaKind};
use crate::fabric::soft::wire::rdmap::{
    AtomicRequest, AtomicResponse, AtomicWriteRequest, FlushPlacement, FlushRequest,
    FlushSelectivity, PrivateResponse, ReadRequest,
};
use crate::fabric::soft::wire::tx::{encode_fpdu, segment, TxConfig};
use crate::fabric::soft::wire::{crc32c, CapFlags, Caps, TermCause, Terminate};
use crate::proto::nqn::Nqn;
use crate::proto::{
    AuthChallenge, AuthConfirm, AuthResponse, Connect, ConnectResponse, Disconnect, DiscoveryEntry,
    DiscoveryRequest, DiscoveryResponse, DurabilityMethods, FlushRequest as Gpspm, FlushResponse,
    FlushStatus, HostId, KeepAlive, Message, NamespaceDescriptor, NamespacesRequest,
    NamespacesResponse, PersistenceDomain, Refusal, RefusalReason,
};

use super::rx::WRITE_STAG;

/// The seeds of target `name`, each with a file name for the corpus.
pub fn for_target(name: &str) -> Vec<(String, Vec<u8>)> {
    let named = |prefix: &str, v: Vec<Vec<u8>>| {
        v.into_iter()
            .enumerate()
            .map(|(i, b)| (format!("seed-{prefix}-{i:02}"), b))
            .collect()
    };
    match name {
        "fpdu_rx" => named("fpdu", fpdu_rx()),
        "mpa_handshake" => named("mpa", mpa_handshake()),
        "control_message" => named("msg", control_message()),
        _ => Vec::new(),
    }
}

/// One of each FPDU the engine receives, in one stream.
fn session_stream(crc: bool) -> Vec<u8> {
    let mut s = Vec::new();
    let mut fpdu = |h: Header, body: &[u8]| {
        encode_fpdu(&h, body, crc, &mut s).expect("a small FPDU");
    };
    fpdu(
        Header::tagged(Opcode::Write, WRITE_STAG, 0, true),
        &[0x11; 100],
    );
    fpdu(Header::tagged(Opcode::Write, WRITE_STAG, 0, true), &[]);
    fpdu(
        Header::untagged(Opcode::Send, 1, true),
        b"a control message",
    );
    fpdu(Header::untagged(Opcode::Send, 2, true), b"placed directly");
    let rr = ReadRequest {
        sink_stag: 0x200,
        sink_to: 0,
        size: 64,
        src_stag: WRITE_STAG,
        src_to: 8,
    };
    fpdu(Header::untagged(Opcode::ReadRequest, 1, true), &rr.encode());
    fpdu(
        Header::tagged(Opcode::ReadResponse, 0x200, 0, true),
        &[0x22; 64],
    );
    let ar = AtomicRequest::fetch_add(1, WRITE_STAG, 16, 5);
    fpdu(
        Header::untagged(Opcode::AtomicRequest, 2, true),
        &ar.encode(),
    );
    let cs = AtomicRequest::compare_swap(2, WRITE_STAG, 24, 0, 9);
    fpdu(
        Header::untagged(Opcode::AtomicRequest, 3, true),
        &cs.encode(),
    );
    let resp = AtomicResponse {
        req_id: 1,
        original: 7,
    };
    fpdu(
        Header::untagged(Opcode::AtomicResponse, 1, true),
        &resp.encode(),
    );
    let fr = FlushRequest {
        req_id: 3,
        placement: FlushPlacement::Persistent,
        selectivity: FlushSelectivity::Range {
            stag: WRITE_STAG,
            to: 0,
            len: 100,
        },
    };
    fpdu(
        Header::untagged(Opcode::FlushRequest, 4, true),
        &fr.encode(),
    );
    let aw = AtomicWriteRequest {
        req_id: 4,
        stag: WRITE_STAG,
        to: 32,
        data: [3; 8],
    };
    fpdu(
        Header::untagged(Opcode::AtomicWriteRequest, 5, true),
        &aw.encode(),
    );
    let pr = PrivateResponse {
        req_id: 3,
        request: Opcode::FlushRequest,
    };
    fpdu(
        Header::untagged(Opcode::PrivateResponse, 2, true),
        &pr.encode(),
    );
    fpdu(Header::untagged(Opcode::ImmediateData, 3, true), &[1; 8]);
    let t = Terminate::new(TermCause::DDP_TAGGED_BASE_BOUNDS).with_ddp(
        114,
        Header::tagged(Opcode::Write, 9, 4000, true)
            .encode()
            .as_slice(),
    );
    fpdu(Header::untagged(Opcode::Terminate, 1, true), &t.encode());
    // A Write and a Send cut into segments of the classic MSS.
    let tx = TxConfig::new(crc, 1454).expect("valid");
    let big = vec![0x33u8; 1800];
    let sg = [&big[..]];
    for f in segment(
        Header::tagged(Opcode::Write, WRITE_STAG, 200, false),
        &sg,
        &tx,
    ) {
        f.append_to(&mut s);
    }
    for f in segment(Header::untagged(Opcode::Send, 4, false), &sg, &tx) {
        f.append_to(&mut s);
    }
    s
}

fn fpdu_rx() -> Vec<Vec<u8>> {
    // Settings: bit 0 CRC, bits 1-3 capabilities, bits 4-5 max ULPDU, 6 write-back, 7 blocking.
    let all = (CapFlags::ALL.0 as u8) << 1;
    let with = |settings: u8, chunk: u8, stream: Vec<u8>| {
        let mut v = vec![settings, chunk];
        v.extend(stream);
        v
    };
    let mut bad_crc = session_stream(true);
    bad_crc[40] ^= 0x01;
    let mut bad_stag = Vec::new();
    encode_fpdu(
        &Header::tagged(Opcode::Write, 0xBAD, 0, true),
        &[1; 8],
        true,
        &mut bad_stag,
    )
    .expect("small");
    let mut bounds = Vec::new();
    encode_fpdu(
        &Header::tagged(Opcode::Write, WRITE_STAG, 2040, true),
        &[1; 16],
        true,
        &mut bounds,
    )
    .expect("small");
    // A ULPDU length past the bytes that follow, the CRC recomputed over what is there.
    let mut long = Vec::new();
    encode_fpdu(
        &Header::tagged(Opcode::Write, WRITE_STAG, 0, true),
        &[1; 32],
        true,
        &mut long,
    )
    .expect("small");
    long[..2].copy_from_slice(&1000u16.to_be_bytes());
    let n = long.len() - 4;
    let c = crc32c(&long[..n]).to_le_bytes();
    long[n..].copy_from_slice(&c);
    vec![
        with(0x01 | all | 0x10, 0, session_stream(true)),
        with(all | 0x10, 0, session_stream(false)),
        with(0x01 | all | 0x30 | 0x40, 7, session_stream(true)),
        with(all | 0x30 | 0x80, 100, session_stream(false)),
        // Nothing optional negotiated: the first atomic is refused.
        with(0x01 | 0x10, 0, session_stream(true)),
        with(0x01 | all | 0x10, 0, bad_crc),
        with(0x01 | all | 0x10, 0, bad_stag),
        with(0x01 | all | 0x10, 3, bounds),
        with(0x01 | all | 0x10, 0, long),
    ]
}

fn mpa_handshake() -> Vec<Vec<u8>> {
    let with = |role: u8, frame: Vec<u8>| {
        let mut v = vec![role];
        v.extend(frame);
        v
    };
    let enc = |f: &MpaFrame| f.encode().expect("a valid frame");
    let ours = MpaConfig::default();
    let request = ours.request();
    let mut markers = request.clone();
    markers.markers = true;
    let mut rev1 = request.clone();
    rev1.revision = 1;
    rev1.ird_ord = None;
    let mut p2p = request.clone();
    if let Some(io) = p2p.ird_ord.as_mut() {
        io.peer_to_peer = true;
        io.zero_len_write_rtr = true;
    }
    // A foreign peer (Linux siw): no capability block, CRC off.
    let siw = MpaFrame {
        kind: MpaKind::Request,
        markers: false,
        crc: false,
        reject: false,
        revision: 2,
        enhanced: true,
        ird_ord: Some(IrdOrd {
            ird: 128,
            ord: 128,
            ..IrdOrd::default()
        }),
        private_data: b"siw".to_vec(),
    };
    let mut long = enc(&request);
    long[18..20].copy_from_slice(&600u16.to_be_bytes());
    long.resize(20 + 600, 0);
    let mut caps = Vec::new();
    Caps::new(CapFlags::FLUSH, Some(100), b"app".to_vec()).encode_into(&mut caps);
    let mut bad_caps = request.clone();
    bad_caps.private_data = caps;
    let reply = ours.reply(&crate::fabric::soft::wire::mpa::negotiate(&ours, &request).unwrap());
    let mut bad_key = enc(&request);
    bad_key[..16].copy_from_slice(b"MPA ID Bad Frame");
    vec![
        with(0, enc(&request)),
        with(2, enc(&siw)),
        with(0, enc(&markers)),
        with(0, enc(&rev1)),
        with(0, enc(&p2p)),
        with(0, long),
        with(0, enc(&bad_caps)),
        with(0, bad_key),
        with(0, enc(&reply)),
        with(1, enc(&reply)),
        with(3, enc(&reject_reply(2))),
        with(5, enc(&request)),
    ]
}

fn control_message() -> Vec<Vec<u8>> {
    let nqn = |s: &str| Nqn::new(s).expect("a valid NQN");
    let connect = Connect {
        host_nqn: nqn("nqn.2026-11.io.rpma:plain-host"),
        subsystem_nqn: nqn("nqn.2026-11.io.rpma:demo"),
        host_id: HostId([3; 16]),
        queue_id: 0,
        keep_alive_ms: 5000,
    };
    let ns = NamespaceDescriptor {
        nsid: 1,
        size: 2 << 20,
        block_size: 4096,
        remote_addr: 0x7f00_0000_0000,
        rkey: 0x101,
        domain: PersistenceDomain::PageCache,
        durability: DurabilityMethods::GPSPM | DurabilityMethods::APM,
        atomic_write_unit: 8,
        read_only: false,
        failure: Some("EIO from msync".into()),
        simulation: Some("power-loss simulation (test only)".into()),
        unavailable: Some("cannot register: no ODP".into()),
        identity: 0x0123_4567_89ab_cdef,
    };
    let msgs = vec![
        Message::Connect(connect),
        Message::AuthChallenge(AuthChallenge {
            target_nonce: [1; 32],
        }),
        Message::AuthResponse(AuthResponse {
            host_nonce: [2; 32],
            host_mac: [3; 32],
        }),
        Message::AuthConfirm(AuthConfirm {
            target_mac: [4; 32],
        }),
        Message::ConnectResponse(ConnectResponse {
            controller_id: 1,
            keep_alive_ms: 5000,
            namespaces: vec![ns.clone()],
            queue_depth: 32,
            namespace_count: 3,
        }),
        Message::NamespacesRequest(NamespacesRequest { start: 1 }),
        Message::NamespacesResponse(NamespacesResponse {
            namespaces: vec![ns],
            total: 3,
        }),
        Message::Refusal(Refusal {
            reason: RefusalReason::HostNotAllowed,
            message: "not on the list".into(),
        }),
        Message::DiscoveryRequest(DiscoveryRequest { start: 0 }),
        Message::DiscoveryRequest(DiscoveryRequest { start: 2 }),
        Message::DiscoveryResponse(DiscoveryResponse {
            entries: vec![DiscoveryEntry {
                subsystem_nqn: nqn("nqn.2026-11.io.rpma:demo"),
                listen: vec!["tcp://127.0.0.1:7420".into()],
            }],
            total: 3,
            generation: 0x0123_4567_89ab_cdef,
        }),
        Message::Disconnect(Disconnect {
            reason: "bye".into(),
        }),
        Message::FlushRequest(Gpspm {
            nsid: 1,
            offset: 4096,
            length: 8192,
            token: 7,
        }),
        Message::FlushResponse(FlushResponse {
            token: 7,
            status: FlushStatus::Durable,
        }),
        Message::KeepAlive(KeepAlive { seq: 3 }),
    ];
    let encoded: Vec<Vec<u8>> = msgs
        .iter()
        .map(|m| m.encode().expect("a valid message"))
        .collect();
    // A conversation: Connect, AuthResponse, AuthChallenge, AuthConfirm, length-prefixed.
    let mut talk = Vec::new();
    for i in [0usize, 2, 1, 3] {
        talk.extend_from_slice(&(encoded[i].len() as u16).to_le_bytes());
        talk.extend_from_slice(&encoded[i]);
    }
    let mut out = encoded;
    out.push(talk);
    out
}
