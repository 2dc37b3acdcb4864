//! MPA connection set-up under arbitrary peer frames, on both sides: the passive side exactly as
//! the acceptor judges and answers a Request (minus the socket), the active side through the
//! blocking handshake over an in-memory stream.

use std::net::{Ipv4Addr, SocketAddr};

use crate::fabric::soft::conn;
use crate::fabric::soft::wire::mpa::{
    self, Answer, MpaConfig, MpaFrame, MpaKind, Rtr, RtrTypes, MAX_PRIVATE_DATA,
};
use crate::fabric::soft::wire::rx::RxConfig;
use crate::fabric::soft::wire::tx::MIN_MAX_ULPDU;
use crate::fabric::soft::wire::{Layer, WireError, MAX_ULPDU_LIMIT};
use crate::fabric::{ConnParams, TcpParams};

use super::pipe::Pipe;

/// `data[0]` bit 0 picks the side: 0 passive (the bytes are a peer's MPA Request, judged as
/// the target's acceptor does, then negotiated and answered as `Pending::accept` does), 1
/// active (the bytes are the passive peer's answer to our Request). Bit 1: we ask for CRC;
/// bit 2 (active): we ask for peer-to-peer mode. Checks:
/// - every refusal is an MPA-layer error (an MPA Terminate cause) and has a reject Reply that
///   encodes;
/// - an accepted Request decodes, encodes back to itself, and negotiates values within both
///   sides' offers (IRD/ORD, CRC, capabilities, RTR), with a Reply that encodes and decodes as
///   an accepting Reply and receive settings that are valid;
/// - the active side sends exactly its Request and accepts only within its own offer.
pub fn mpa_handshake(data: &[u8]) {
    let Some((&role, frame)) = data.split_first() else {
        return;
    };
    let crc = role & 2 != 0;
    if role & 1 == 0 {
        passive(frame, crc);
    } else {
        active(frame, crc, role & 4 != 0);
    }
}

fn assert_mpa_layer(e: &WireError) {
    let _ = e.to_string();
    assert_eq!(
        e.terminate_cause().layer,
        Layer::Mpa,
        "an MPA failure with a non-MPA cause: {e}"
    );
}

fn passive(frame: &[u8], crc: bool) {
    // What the acceptor's `Incoming::poll_request` collects: the header, and the private data
    // unless it is oversize.
    let Ok(raw) = mpa::read_raw_frame(&mut &frame[..], "fuzz") else {
        return;
    };
    assert!(raw.bytes.len() <= mpa::FRAME_HDR_LEN + MAX_PRIVATE_DATA);
    let refusal = mpa::reject_reply(raw.revision);
    let (req, app) = match conn::judge(&raw) {
        Ok(r) => r,
        Err(e) => {
            assert_mpa_layer(&e);
            let b = refusal.encode().expect("a reject Reply encodes");
            assert!(MpaFrame::decode(&b).unwrap().is_some_and(|(f, _)| f.reject));
            return;
        }
    };
    assert_eq!(req.kind, MpaKind::Request);
    assert!(req.private_len() <= MAX_PRIVATE_DATA && app.len() <= req.private_data.len());
    let again = req.encode().expect("an accepted Request encodes");
    assert_eq!(
        MpaFrame::decode(&again).unwrap().map(|(f, _)| f),
        Some(req.clone()),
        "the Request does not encode back"
    );
    // As the target's poll loop accepts (`ConnParams` with its CRC setting).
    let params = ConnParams {
        tcp: TcpParams {
            crc,
            ..TcpParams::default()
        },
        ..ConnParams::default()
    };
    let cfg = conn::config(&params, &[], true).expect("the daemon's settings are valid");
    let n = match mpa::negotiate(&cfg, &req) {
        Ok(n) => n,
        Err(e) => return assert_mpa_layer(&e),
    };
    let io = req.ird_ord.expect("negotiated without the IRD/ORD prefix");
    assert!(n.ird <= cfg.ird && n.ird <= io.ord, "{n:?}");
    assert!(n.ord <= cfg.ord && n.ord <= io.ird, "{n:?}");
    assert_eq!(n.crc, crc || req.crc);
    assert!(cfg.caps.flags.contains(n.shared) && n.caps.flags.contains(n.shared));
    // The acceptor offers only the zero-length Write as RTR.
    assert!(matches!(n.rtr, None | Some(Rtr::Write)), "{:?}", n.rtr);
    let reply = cfg.reply(&n).encode().expect("the Reply encodes");
    let (back, used) = MpaFrame::decode(&reply).unwrap().expect("a whole Reply");
    assert_eq!(used, reply.len());
    assert!(back.kind == MpaKind::Reply && !back.reject && back.ird_ord.is_some());
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 1));
    let neg = conn::finish(n, &params, addr, addr).expect("the negotiation has valid settings");
    assert!((MIN_MAX_ULPDU..=MAX_ULPDU_LIMIT).contains(&neg.peer_max_ulpdu));
}

fn active(frame: &[u8], crc: bool, p2p: bool) {
    let cfg = MpaConfig {
        crc,
        peer_to_peer: p2p.then_some(RtrTypes::ALL),
        ..MpaConfig::default()
    };
    let mut s = Pipe::new(frame);
    let r = mpa::connect_exchange(&mut s, &cfg);
    let sent = cfg.request().encode().expect("our Request encodes");
    assert_eq!(
        s.out, sent,
        "the active side sent something else than its Request"
    );
    match r {
        Ok(Answer::Accepted(n)) => {
            assert!(n.ird <= cfg.ird && n.ord <= cfg.ord, "{n:?}");
            assert!(n.crc || !crc);
            assert!(cfg.caps.flags.contains(n.shared), "{n:?}");
            assert!(n.rtr.is_none() || p2p, "peer-to-peer unasked: {n:?}");
            RxConfig::from_negotiated(&n, MAX_ULPDU_LIMIT).expect("valid receive settings");
            assert!(n.tx_max_ulpdu(MAX_ULPDU_LIMIT) >= MIN_MAX_ULPDU);
        }
        Ok(Answer::Rejected { private_data }) => assert!(private_data.len() <= MAX_PRIVATE_DATA),
        Err(e) => assert_mpa_layer(&e),
    }
}
