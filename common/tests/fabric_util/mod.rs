//! Shared harness of the fabric tests: a connected initiator/target pair over 127.0.0.1.
#![allow(dead_code)]

pub mod tshark;

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::Read;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpma_common::fabric::soft::wire::{self, mpa, CapFlags, Caps, Header, Opcode};
use rpma_common::fabric::*;

pub struct Pair {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub icq: CompletionQueue,
    pub tcq: CompletionQueue,
    pub qp: QueuePair,
    pub tqp: QueuePair,
    stash: RefCell<(VecDeque<Completion>, VecDeque<Completion>)>,
}

pub fn params(crc: bool) -> ConnParams {
    ConnParams {
        crc,
        ..ConnParams::default()
    }
}

impl Pair {
    pub fn new(crc: bool) -> Pair {
        Pair::with(params(crc), params(crc), |_| {})
    }

    /// A pair whose target QP got `prep` (e.g. receives) before accepting.
    pub fn with(
        ip: ConnParams,
        tp: ConnParams,
        prep: impl FnOnce(&PreparedQueuePair) + Send + 'static,
    ) -> Pair {
        let ctx = Context::soft();
        let listener = Listener::bind(&ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
        Pair::on(ctx, listener, ip, tp, prep)
    }

    /// A pair connected through `listener` (bound on `ctx`).
    pub fn on(
        ctx: Context,
        listener: Listener,
        ip: ConnParams,
        tp: ConnParams,
        prep: impl FnOnce(&PreparedQueuePair) + Send + 'static,
    ) -> Pair {
        let pd = ctx.alloc_pd().unwrap();
        let icq = ctx.create_cq(256).unwrap();
        let tcq = ctx.create_cq(256).unwrap();
        let url = listener.url().unwrap();
        let (pd2, tcq2) = (pd.clone(), tcq.clone());
        let t = std::thread::spawn(move || {
            let req = listener.accept(&tp).unwrap();
            let qp = pd2.create_qp(&tcq2, &tcq2, QpCaps::default()).unwrap();
            prep(&qp);
            req.accept(qp, &tp, b"target").unwrap()
        });
        let qp = pd
            .create_qp(&icq, &icq, QpCaps::default())
            .unwrap()
            .connect(&url, &ip, b"init")
            .unwrap();
        let tqp = t.join().unwrap();
        assert_eq!(qp.info().peer_private_data, b"target");
        assert_eq!(tqp.info().peer_private_data, b"init");
        Pair {
            ctx,
            pd,
            icq,
            tcq,
            qp,
            tqp,
            stash: RefCell::default(),
        }
    }

    pub fn target_buf(&self, len: usize, access: Access) -> (Arc<AlignedBuf>, Arc<MemoryRegion>) {
        let m = AlignedBuf::new(len).unwrap();
        let mr = self.pd.register(Arc::clone(&m), access).unwrap();
        (m, mr)
    }

    pub fn init_buf(&self, len: usize, access: Access) -> (Arc<AlignedBuf>, Arc<MemoryRegion>) {
        self.target_buf(len, access)
    }

    /// Polls both sides once, stashing their completions.
    pub fn pump(&self) {
        let mut wc = [Completion::EMPTY; 16];
        let mut s = self.stash.borrow_mut();
        let n = self.icq.poll(&mut wc).unwrap();
        s.0.extend(wc[..n].iter().copied());
        let n = self.tcq.poll(&mut wc).unwrap();
        s.1.extend(wc[..n].iter().copied());
    }

    fn next(&self, init: bool) -> Option<Completion> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            self.pump();
            let mut s = self.stash.borrow_mut();
            let q = if init { &mut s.0 } else { &mut s.1 };
            if let Some(c) = q.pop_front() {
                return Some(c);
            }
        }
        None
    }

    pub fn next_init(&self) -> Completion {
        self.next(true)
            .expect("an initiator completion within 10 s")
    }

    pub fn next_target(&self) -> Completion {
        self.next(false).expect("a target completion within 10 s")
    }

    /// Polls both sides for `d`; returns every completion (initiator, target) seen.
    pub fn settle(&self, d: Duration) -> (Vec<Completion>, Vec<Completion>) {
        let end = Instant::now() + d;
        while Instant::now() < end {
            self.pump();
        }
        let mut s = self.stash.borrow_mut();
        (s.0.drain(..).collect(), s.1.drain(..).collect())
    }
}

impl Pair {
    /// Another connected pair of queue pairs on the same device, domain and CQs.
    pub fn another(&self) -> (QueuePair, QueuePair) {
        let listener = Listener::bind(&self.ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
        let url = listener.url().unwrap();
        let (pd, tcq) = (self.pd.clone(), self.tcq.clone());
        let t = std::thread::spawn(move || {
            let req = listener.accept(&ConnParams::default()).unwrap();
            let qp = pd.create_qp(&tcq, &tcq, QpCaps::default()).unwrap();
            req.accept(qp, &ConnParams::default(), b"").unwrap()
        });
        let qp = self
            .pd
            .create_qp(&self.icq, &self.icq, QpCaps::default())
            .unwrap()
            .connect(&url, &ConnParams::default(), b"")
            .unwrap();
        (qp, t.join().unwrap())
    }
}

/// A raw iWARP peer: TCP + MPA through the wire layer, with chosen capabilities.
pub fn raw_peer(url: &Url, caps: CapFlags, ord: u16) -> (TcpStream, mpa::Negotiated) {
    let mut s = TcpStream::connect((url.host.as_str(), url.port)).unwrap();
    let cfg = mpa::MpaConfig {
        crc: false,
        ird: 4,
        ord,
        caps: Caps::new(caps, None, b"raw".to_vec()),
        peer_to_peer: None,
    };
    let n = mpa::connect_handshake(&mut s, &cfg).unwrap();
    (s, n)
}

pub fn fpdu(hdr: Header, body: &[u8]) -> Vec<u8> {
    let h = hdr.encode();
    let ulpdu = h.as_slice().len() + body.len();
    let mut v = (ulpdu as u16).to_be_bytes().to_vec();
    v.extend_from_slice(h.as_slice());
    v.extend_from_slice(body);
    v.resize(v.len() + wire::pad_len(ulpdu) + 4, 0);
    v
}

/// The FPDUs in `got` (MPA-framed, CRC field not checked): (header, ULPDU payload) of each.
pub fn fpdus(got: &[u8]) -> Vec<(Header, Vec<u8>)> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + 2 <= got.len() {
        let len = u16::from_be_bytes([got[off], got[off + 1]]) as usize;
        if off + 2 + len > got.len() {
            break;
        }
        let (hdr, hl) = Header::decode(&got[off + 2..off + 2 + len]).unwrap();
        out.push((hdr, got[off + 2 + hl..off + 2 + len].to_vec()));
        off += 2 + len + wire::pad_len(len) + 4;
    }
    out
}

/// The Terminate among the FPDUs in `got`, if any.
pub fn terminate_in(got: &[u8]) -> Option<wire::Terminate> {
    fpdus(got)
        .into_iter()
        .find(|(h, _)| h.opcode == Opcode::Terminate)
        .map(|(_, body)| wire::Terminate::decode(&body).unwrap())
}

/// Reads what `s` sends while `poll` runs, until `done` or 10 s; returns the bytes.
pub fn read_while(s: &mut TcpStream, mut poll: impl FnMut() -> bool) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
    let mut got = Vec::new();
    let end = Instant::now() + Duration::from_secs(10);
    let mut b = [0u8; 4096];
    while Instant::now() < end {
        let done = poll();
        match s.read(&mut b) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(_) if done => break,
            Err(_) => {}
        }
    }
    got
}
