//! Wire check of the whole engine: capture a loopback session of two real queue pairs with
//! tshark and assert that its iWARP dissectors decode every FPDU as MPA/DDP/RDMAP with "Good
//! CRC32", account for every byte of the stream, and report nothing malformed.
//!
//! The session covers Write (segmented), WriteWithImm, Read, Send, Send with Solicited Event,
//! Send with Invalidate, FetchAdd, CompareSwap, the private Flush and Atomic Write, and a
//! Terminate provoked by a bad rkey. Needs tshark and permission to capture on `lo`; without
//! them the test fails, unless `RPMA_SKIP_TSHARK=1` (then it says why and skips the check).
//! `RPMA_WIRE_PCAP_DIR` keeps the capture (fabric.pcap) and tshark's decode (fabric.txt).

mod fabric_util;

use std::collections::BTreeMap;
use std::time::Duration;

use fabric_util::tshark::{start_capture, stop_capture, tshark_fields};
use fabric_util::Pair;
use rpma_common::fabric::*;

/// RDMAP opcodes (RFC 5040, RFC 7306, and this project's private ones).
const WRITE: u32 = 0x0;
const READ_REQUEST: u32 = 0x1;
const READ_RESPONSE: u32 = 0x2;
const SEND: u32 = 0x3;
const SEND_INVALIDATE: u32 = 0x4;
const SEND_SE: u32 = 0x5;
const TERMINATE: u32 = 0x7;
const IMMEDIATE_DATA: u32 = 0x8;
const ATOMIC_REQUEST: u32 = 0xA;
const ATOMIC_RESPONSE: u32 = 0xB;
const FLUSH_REQUEST: u32 = 0xC;
const ATOMIC_WRITE_REQUEST: u32 = 0xD;
const PRIVATE_RESPONSE: u32 = 0xE;

fn all_remote() -> Access {
    Access::LOCAL_WRITE | Access::ALL_REMOTE | Access::MW_BIND
}

/// Runs every operation once over `p`, checking each completes as it should.
fn session(p: &Pair) {
    let (tmem, tmr) = p.target_buf(16384, all_remote());
    let (imem, imr) = p.init_buf(16384, Access::LOCAL_WRITE);
    let data: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
    imem.write_at(0, &data).unwrap();
    for id in 100..104 {
        p.tqp
            .post_recv(RecvWr {
                wr_id: id,
                local: Some(Sge::new(&tmr, 8192 + (id as usize - 100) * 512, 512)),
            })
            .unwrap();
    }
    let mw = p.pd.alloc_mw().unwrap();
    let mw_rkey = p
        .tqp
        .bind_mw(
            &mw,
            &tmr,
            0,
            4096,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        )
        .unwrap();

    let ops: Vec<(SendOp, SendFlags)> = vec![
        (
            SendOp::Write {
                local: Sge::new(&imr, 0, 3000),
                remote: tmr.remote(0),
            },
            SendFlags::SIGNALED,
        ),
        (
            SendOp::WriteWithImm {
                local: Sge::new(&imr, 0, 16),
                remote: tmr.remote(4096),
                imm: 0xFEED_F00D,
            },
            SendFlags::SIGNALED,
        ),
        (
            SendOp::Read {
                local: Sge::new(&imr, 4096, 8),
                remote: tmr.remote(8),
            },
            SendFlags::SIGNALED,
        ),
        (
            SendOp::Send {
                local: Sge::new(&imr, 0, 100),
            },
            SendFlags::SIGNALED,
        ),
        (
            SendOp::Send {
                local: Sge::new(&imr, 0, 10),
            },
            SendFlags::SIGNALED | SendFlags::SOLICITED,
        ),
        (
            SendOp::SendWithInvalidate {
                local: Sge::new(&imr, 0, 4),
                invalidate_rkey: mw_rkey,
            },
            SendFlags::SIGNALED,
        ),
        (
            SendOp::FetchAdd {
                local: Sge::new(&imr, 4104, 8),
                remote: tmr.remote(6144),
                add: 5,
            },
            SendFlags::SIGNALED,
        ),
        (
            SendOp::CompareSwap {
                local: Sge::new(&imr, 4112, 8),
                remote: tmr.remote(6144),
                compare: 5,
                swap: 9,
            },
            SendFlags::SIGNALED,
        ),
        (
            SendOp::AtomicWrite {
                remote: tmr.remote(6152),
                value: 0x0102_0304_0506_0708,
            },
            SendFlags::SIGNALED,
        ),
        (
            SendOp::Flush {
                target: FlushTarget::Range {
                    remote: tmr.remote(0),
                    len: 3000,
                },
                kind: FlushType::Persistent,
            },
            SendFlags::SIGNALED,
        ),
    ];
    for (i, (op, flags)) in ops.into_iter().enumerate() {
        p.qp.post_send(SendWr::new(i as u64, op).with_flags(flags))
            .unwrap();
        let c = p.next_init();
        assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::Success), "{c:?}");
    }
    let recvs: Vec<Completion> = (0..4).map(|_| p.next_target()).collect();
    assert_eq!(recvs[0].imm, Some(0xFEED_F00D));
    assert!(recvs[2].solicited);
    assert_eq!(recvs[3].invalidated_rkey, Some(mw_rkey));
    let mut placed = vec![0u8; 3000];
    tmem.read_at(0, &mut placed).unwrap();
    assert_eq!(placed, data);

    // A Write with a bad rkey, then a Read: the target answers with a Terminate, the Read
    // completes with RemoteAccess.
    let bad = RemoteAddr {
        addr: tmr.addr(),
        rkey: tmr.rkey() ^ 0x5A5A_0000,
    };
    p.qp.post_send(SendWr::new(
        50,
        SendOp::Write {
            local: Sge::new(&imr, 0, 64),
            remote: bad,
        },
    ))
    .unwrap();
    p.qp.post_send(SendWr::new(
        51,
        SendOp::Read {
            local: Sge::new(&imr, 4096, 8),
            remote: tmr.remote(0),
        },
    ))
    .unwrap();
    let failed = loop {
        let c = p.next_init();
        if c.status != WcStatus::Success {
            break c;
        }
    };
    assert_eq!(failed.status, WcStatus::RemoteAccess, "{failed:?}");
    let (_, _) = p.settle(Duration::from_millis(200));
    assert_eq!(p.tqp.state(), QpState::Error);
    assert!(matches!(
        p.tqp.error(),
        Some(QpFailure::TerminateSent { .. })
    ));
}

/// Parses a tshark `-T fields` column of numbers (several per line, comma-separated).
fn numbers(fields: &str) -> Vec<u64> {
    fields
        .split(['\n', ','])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| match s.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16).unwrap(),
            None => s.parse().unwrap(),
        })
        .collect()
}

#[test]
fn tshark_decodes_every_fpdu_of_an_engine_session() {
    let dir = tempfile::tempdir().unwrap();
    let keep = std::env::var_os("RPMA_WIRE_PCAP_DIR").map(std::path::PathBuf::from);
    let out_dir = keep.unwrap_or_else(|| dir.path().to_path_buf());
    let pcap = out_dir.join("fabric.pcap");
    let ctx = Context::soft();
    let listener = Listener::bind(&ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
    let port = listener.url().unwrap().port;
    let Some(capture) = start_capture(port, &pcap, "fabric_tshark") else {
        return;
    };
    // 1454-byte ULPDUs, so that the 3000-byte Write is segmented.
    let params = ConnParams {
        tcp: TcpParams {
            crc: true,
            max_ulpdu: 1454,
        },
        ..ConnParams::default()
    };
    let p = Pair::on(ctx, listener, params.clone(), params, |_| {});
    session(&p);
    drop(p);
    stop_capture(capture);

    let verbose = tshark_fields(&pcap, &["-V"]);
    std::fs::write(out_dir.join("fabric.txt"), &verbose).unwrap();
    assert!(
        !verbose.contains("Malformed"),
        "malformed frame:\n{verbose}"
    );
    assert!(
        verbose.contains("Request frame"),
        "no MPA Request:\n{verbose}"
    );
    assert!(verbose.contains("Reply frame"), "no MPA Reply:\n{verbose}");
    assert_eq!(verbose.matches("Bad CRC32").count(), 0, "{verbose}");

    let opcodes: Vec<u32> = numbers(&tshark_fields(
        &pcap,
        &["-T", "fields", "-e", "iwarp_rdma.opcode"],
    ))
    .into_iter()
    .map(|o| o as u32)
    .collect();
    let good = verbose.matches("Good CRC32").count();
    assert_eq!(good, opcodes.len(), "one good CRC per decoded FPDU");
    let mut seen: BTreeMap<u32, usize> = BTreeMap::new();
    for &op in &opcodes {
        *seen.entry(op).or_default() += 1;
    }
    for op in [
        WRITE,
        READ_REQUEST,
        READ_RESPONSE,
        SEND,
        SEND_INVALIDATE,
        SEND_SE,
        TERMINATE,
        IMMEDIATE_DATA,
        ATOMIC_REQUEST,
        ATOMIC_RESPONSE,
        FLUSH_REQUEST,
        ATOMIC_WRITE_REQUEST,
        PRIVATE_RESPONSE,
    ] {
        assert!(
            seen.contains_key(&op),
            "opcode {op:#x} not decoded: {seen:?}"
        );
    }
    // The 3000-byte Write took three FPDUs, the 16-byte WriteWithImm's Write one more.
    assert!(seen[&WRITE] >= 4, "{seen:?}");

    // Every byte of the TCP stream is an MPA frame or an FPDU that tshark decoded.
    let tcp_bytes: u64 = numbers(&tshark_fields(&pcap, &["-T", "fields", "-e", "tcp.len"]))
        .iter()
        .sum();
    let ulpdus = numbers(&tshark_fields(
        &pcap,
        &["-T", "fields", "-e", "iwarp_mpa.ulpdulength"],
    ));
    assert_eq!(ulpdus.len(), opcodes.len(), "one ULPDU length per FPDU");
    let fpdu_bytes: u64 = ulpdus.iter().map(|&l| (2 + l).div_ceil(4) * 4 + 4).sum();
    let frames = numbers(&tshark_fields(
        &pcap,
        &["-T", "fields", "-e", "iwarp_mpa.pdlength"],
    ));
    assert_eq!(frames.len(), 2, "one MPA Request and one Reply");
    let frame_bytes: u64 = frames.iter().map(|&pd| 20 + pd).sum();
    assert_eq!(
        fpdu_bytes + frame_bytes,
        tcp_bytes,
        "bytes on the wire that tshark did not decode as MPA"
    );
}
