//! Wire check: capture a loopback session produced by the wire layer's own tx code with tshark,
//! and assert that tshark's iWARP dissectors decode every FPDU (MPA with "Good CRC32", DDP,
//! RDMAP) and report nothing malformed.
//!
//! Needs tshark and permission to capture on `lo` (root, or dumpcap capabilities); without them
//! the test fails, unless `RPMA_SKIP_TSHARK=1` (then it prints why and skips the check); `make
//! test` installs tshark (scripts/install-deps.sh) and runs as root.

mod fabric_util;

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

use fabric_util::tshark::{start_capture, stop_capture, tshark_fields};

use rpma_common::fabric::soft::placer::write_payload;
use rpma_common::fabric::soft::wire::body::Body;
use rpma_common::fabric::soft::wire::ddp::{Header, HeaderKind, Opcode};
use rpma_common::fabric::soft::wire::mpa::{accept_handshake, connect_handshake, MpaConfig};
use rpma_common::fabric::soft::wire::rdmap::{
    AtomicRequest, AtomicResponse, AtomicWriteRequest, FlushPlacement, FlushRequest,
    FlushSelectivity, PrivateResponse, ReadRequest,
};
use rpma_common::fabric::soft::wire::rx::{
    Delivered, DirectTarget, FpduReceiver, Placement, Placer, RxConfig,
};
use rpma_common::fabric::soft::wire::terminate::{TermCause, Terminate};
use rpma_common::fabric::soft::wire::tx::{encode_fpdu, segment, TxConfig};
use rpma_common::fabric::soft::wire::WireError;

/// Places tagged data into a local buffer; buffers untagged data.
struct Mem(Vec<u8>);

impl Placer for Mem {
    fn place(&mut self, h: &Header, len: usize) -> Result<Placement, TermCause> {
        match h.kind {
            HeaderKind::Tagged { to, .. } if to as usize + len <= self.0.len() => {
                // SAFETY: in bounds of our vector, which nothing else touches while placing.
                Ok(Placement::Direct(unsafe {
                    DirectTarget::new(self.0.as_mut_ptr().add(to as usize), len)
                }))
            }
            HeaderKind::Tagged { .. } => Err(TermCause::DDP_TAGGED_BASE_BOUNDS),
            HeaderKind::Untagged { .. } => Ok(Placement::Buffer),
        }
    }

    fn write(&mut self, target: DirectTarget, payload: &[u8]) -> Result<bool, WireError> {
        write_payload(target, payload)
    }
}

/// The active side's traffic: (bytes, number of FPDUs, opcodes sent).
fn active_traffic(crc: bool) -> (Vec<u8>, Vec<Opcode>) {
    let tx = TxConfig::new(crc, 1454).unwrap();
    let mut out = Vec::new();
    let mut ops = Vec::new();
    let data: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
    let sg = [&data[..]];
    for f in segment(Header::tagged(Opcode::Write, 0x100, 0, false), &sg, &tx) {
        f.append_to(&mut out);
        ops.push(Opcode::Write);
    }
    let rr = ReadRequest {
        sink_stag: 0x200,
        sink_to: 0,
        size: 8,
        src_stag: 0x100,
        src_to: 0,
    };
    encode_fpdu(
        &Header::untagged(Opcode::ReadRequest, 1, true),
        &rr.encode(),
        crc,
        &mut out,
    )
    .unwrap();
    ops.push(Opcode::ReadRequest);
    let msg = b"a control-plane message";
    let sg = [&msg[..]];
    for f in segment(Header::untagged(Opcode::Send, 1, false), &sg, &tx) {
        f.append_to(&mut out);
        ops.push(Opcode::Send);
    }
    let mut inv = Header::untagged(Opcode::SendInvalidate, 2, true);
    if let HeaderKind::Untagged { inv_stag, .. } = &mut inv.kind {
        *inv_stag = 0x300;
    }
    encode_fpdu(&inv, b"bye", crc, &mut out).unwrap();
    ops.push(Opcode::SendInvalidate);
    let a = AtomicRequest::fetch_add(7, 0x100, 8, 1);
    encode_fpdu(
        &Header::untagged(Opcode::AtomicRequest, 2, true),
        &a.encode(),
        crc,
        &mut out,
    )
    .unwrap();
    ops.push(Opcode::AtomicRequest);
    let fl = FlushRequest {
        req_id: 8,
        placement: FlushPlacement::Persistent,
        selectivity: FlushSelectivity::Range {
            stag: 0x100,
            to: 0,
            len: 3000,
        },
    };
    encode_fpdu(
        &Header::untagged(Opcode::FlushRequest, 3, true),
        &fl.encode(),
        crc,
        &mut out,
    )
    .unwrap();
    ops.push(Opcode::FlushRequest);
    let aw = AtomicWriteRequest {
        req_id: 9,
        stag: 0x100,
        to: 16,
        data: *b"8 bytes!",
    };
    encode_fpdu(
        &Header::untagged(Opcode::AtomicWriteRequest, 4, true),
        &aw.encode(),
        crc,
        &mut out,
    )
    .unwrap();
    ops.push(Opcode::AtomicWriteRequest);
    (out, ops)
}

/// The passive side's answers.
fn passive_traffic(crc: bool) -> (Vec<u8>, Vec<Opcode>) {
    let mut out = Vec::new();
    let mut ops = Vec::new();
    encode_fpdu(
        &Header::tagged(Opcode::ReadResponse, 0x200, 0, true),
        &[1; 8],
        crc,
        &mut out,
    )
    .unwrap();
    ops.push(Opcode::ReadResponse);
    let ar = AtomicResponse {
        req_id: 7,
        original: 0x0706_0504_0302_0100,
    };
    encode_fpdu(
        &Header::untagged(Opcode::AtomicResponse, 1, true),
        &ar.encode(),
        crc,
        &mut out,
    )
    .unwrap();
    ops.push(Opcode::AtomicResponse);
    for (msn, (id, op)) in [(8, Opcode::FlushRequest), (9, Opcode::AtomicWriteRequest)]
        .into_iter()
        .enumerate()
    {
        let p = PrivateResponse {
            req_id: id,
            request: op,
        };
        let h = Header::untagged(Opcode::PrivateResponse, msn as u32 + 2, true);
        encode_fpdu(&h, &p.encode(), crc, &mut out).unwrap();
        ops.push(Opcode::PrivateResponse);
    }
    let mut t = Terminate::new(TermCause::RDMAP_ACCESS_RIGHTS);
    let quoted = Header::tagged(Opcode::Write, 0x100, 0, true).encode();
    t = t.with_ddp(14 + 8, quoted.as_slice());
    encode_fpdu(
        &Header::untagged(Opcode::Terminate, 1, true),
        &t.encode(),
        crc,
        &mut out,
    )
    .unwrap();
    ops.push(Opcode::Terminate);
    (out, ops)
}

fn run_session(port_listener: TcpListener, crc: bool) -> (usize, usize) {
    let addr = port_listener.local_addr().unwrap();
    let passive = thread::spawn(move || {
        let (mut s, _) = port_listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let cfg = MpaConfig {
            crc,
            ..Default::default()
        };
        let n = accept_handshake(&mut s, &cfg).unwrap();
        assert_eq!(n.crc, crc);
        let mut rx = FpduReceiver::new(RxConfig::from_negotiated(&n, 1454).unwrap());
        let mut mem = Mem(vec![0; 4096]);
        let (_, want) = active_traffic(crc);
        let mut got = Vec::new();
        while got.len() < want.len() {
            if let Some(r) = rx.poll(&mut s, &mut mem).unwrap() {
                if let Delivered::Control(Body::FlushRequest(f)) = &r.data {
                    assert_eq!(f.req_id, 8);
                }
                got.push(r.header.opcode);
            }
        }
        assert_eq!(got, want);
        assert_eq!(
            &mem.0[..3000],
            &(0..3000u32).map(|i| i as u8).collect::<Vec<_>>()[..]
        );
        let (bytes, ops) = passive_traffic(crc);
        s.write_all(&bytes).unwrap();
        // Wait for the peer to close.
        let _ = std::io::copy(&mut s, &mut std::io::sink());
        ops.len()
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let cfg = MpaConfig {
        crc,
        ..Default::default()
    };
    let n = connect_handshake(&mut s, &cfg).unwrap();
    let (bytes, ops) = active_traffic(crc);
    s.write_all(&bytes).unwrap();
    let mut rx = FpduReceiver::new(RxConfig::from_negotiated(&n, 1454).unwrap());
    let mut mem = Mem(vec![0; 64]);
    let (_, want) = passive_traffic(crc);
    let mut got = Vec::new();
    while got.len() < want.len() {
        if let Some(r) = rx.poll(&mut s, &mut mem).unwrap() {
            got.push(r.header.opcode);
        }
    }
    assert_eq!(got, want);
    drop(s);
    let passive_count = passive.join().unwrap();
    (ops.len(), passive_count)
}

#[test]
fn tshark_decodes_every_fpdu_with_good_crc() {
    // RPMA_WIRE_PCAP_DIR keeps the capture and tshark's decode for a look.
    let dir = tempfile::tempdir().unwrap();
    let keep = std::env::var_os("RPMA_WIRE_PCAP_DIR").map(std::path::PathBuf::from);
    let out_dir = keep.unwrap_or_else(|| dir.path().to_path_buf());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let pcap = out_dir.join("wire.pcap");
    let Some(capture) = start_capture(port, &pcap, "wire_tshark") else {
        return;
    };
    let (sent_active, sent_passive) = run_session(listener, true);
    stop_capture(capture);

    let verbose = tshark_fields(&pcap, &["-V"]);
    std::fs::write(out_dir.join("wire.txt"), &verbose).unwrap();
    assert!(
        !verbose.contains("Malformed"),
        "tshark reports a malformed frame:\n{verbose}"
    );
    assert!(verbose.contains("MPA ID Req Frame") || verbose.contains("Request frame"));
    let good = verbose.matches("Good CRC32").count();
    let bad = verbose.matches("Bad CRC32").count();
    let total = sent_active + sent_passive;
    assert_eq!(bad, 0, "{verbose}");
    assert_eq!(
        good, total,
        "every FPDU should carry a good CRC:\n{verbose}"
    );

    let fields = tshark_fields(&pcap, &["-T", "fields", "-e", "iwarp_rdma.opcode"]);
    let opcodes: Vec<u32> = fields
        .split(['\n', ','])
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let s = s.trim();
            u32::from_str_radix(
                s.trim_start_matches("0x"),
                if s.starts_with("0x") { 16 } else { 10 },
            )
            .unwrap()
        })
        .collect();
    assert_eq!(opcodes.len(), total, "one RDMAP opcode per FPDU: {fields}");
    for op in [0x0, 0x1, 0x2, 0x3, 0x4, 0x7, 0xA, 0xB, 0xC, 0xD, 0xE] {
        assert!(
            opcodes.contains(&op),
            "opcode {op:#x} not decoded: {opcodes:?}"
        );
    }
}
