//! Shared harness of the fabric tests: a connected initiator/target pair over 127.0.0.1.
#![allow(dead_code)]

pub mod tshark;

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
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

/// Local write, remote write and remote read: the rights of a plain target region.
pub fn rw() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ
}

pub fn params(crc: bool) -> ConnParams {
    ConnParams {
        tcp: TcpParams {
            crc,
            ..TcpParams::default()
        },
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

    /// Posts `n` Reads of `len` bytes with one doorbell (one writev: they reach the target
    /// together): Read `i` (wr_id `i`) brings `remote`'s bytes at `i * len` to `local`'s.
    pub fn post_reads(
        &self,
        local: &Arc<MemoryRegion>,
        remote: &Arc<MemoryRegion>,
        n: usize,
        len: usize,
    ) {
        self.qp
            .post_send_list((0..n).map(|i| {
                SendWr::new(
                    i as u64,
                    SendOp::Read {
                        local: Sge::new(local, i * len, len),
                        remote: remote.remote((i * len) as u64),
                    },
                )
            }))
            .unwrap();
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

    /// Initiator completions until the one of `wr_id`: (those before it, it).
    pub fn until_init(&self, wr_id: u64) -> (Vec<Completion>, Completion) {
        let mut before = Vec::new();
        loop {
            let c = self.next_init();
            if c.wr_id == wr_id {
                return (before, c);
            }
            before.push(c);
        }
    }

    /// Asserts that the next initiator completion is `wr_id` with `status`; returns it.
    pub fn expect_init(&self, wr_id: u64, status: WcStatus) -> Completion {
        let c = self.next_init();
        assert_eq!((c.wr_id, c.status), (wr_id, status));
        c
    }

    /// Polls until both `a` and `b` are in Error, or 5 s; asserts they are.
    pub fn until_error(&self, a: &QueuePair, b: &QueuePair) {
        let end = Instant::now() + Duration::from_secs(5);
        while (a.state() != QpState::Error || b.state() != QpState::Error) && Instant::now() < end {
            self.pump();
        }
        assert_eq!((a.state(), b.state()), (QpState::Error, QpState::Error));
    }

    /// [`Pair::until_error`] of this pair's own queue pairs.
    pub fn assert_both_error(&self) {
        self.until_error(&self.qp, &self.tqp);
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

/// Posts a Read (signalled) of `remote` into `local` as `wr_id` on `qp`.
pub fn post_read(qp: &QueuePair, wr_id: u64, local: Sge, remote: RemoteAddr) {
    qp.post_send(SendWr::new(wr_id, SendOp::Read { local, remote }))
        .unwrap();
}

/// Posts a Write of `local` to `remote` as `wr_id` with `flags` on `qp`.
pub fn post_write(qp: &QueuePair, wr_id: u64, local: Sge, remote: RemoteAddr, flags: SendFlags) {
    qp.post_send(SendWr::new(wr_id, SendOp::Write { local, remote }).with_flags(flags))
        .unwrap();
}

/// Posts a Write of `write` (wr 1, with `write_flags`) then a Read into `read` (wr 2), both
/// at `remote`, on `qp`: the Read completes only after the Write was placed (or refused).
pub fn post_write_read(
    qp: &QueuePair,
    write: Sge,
    read: Sge,
    remote: RemoteAddr,
    write_flags: SendFlags,
) {
    post_write(qp, 1, write, remote, write_flags);
    post_read(qp, 2, read, remote);
}

/// Asserts that every byte of `mem` is still zero.
pub fn assert_untouched(mem: &AlignedBuf) {
    assert!(
        mem.to_vec().iter().all(|&b| b == 0),
        "no byte of target memory changed"
    );
}

/// An initiator connected (with `params`) to a bare TCP peer that runs the MPA accept
/// handshake with `caps` and then `then` on its stream.
pub struct RawTarget<T> {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    pub qp: QueuePair,
    pub peer: JoinHandle<T>,
}

pub fn raw_target<T: Send + 'static>(
    caps: Caps,
    params: &ConnParams,
    then: impl FnOnce(TcpStream) -> T + Send + 'static,
) -> RawTarget<T> {
    let ctx = Context::soft();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let tl = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = tl.local_addr().unwrap().port();
    let peer = std::thread::spawn(move || {
        let (mut s, _) = tl.accept().unwrap();
        let cfg = mpa::MpaConfig {
            crc: false,
            ird: 4,
            ord: 4,
            caps,
            peer_to_peer: None,
        };
        mpa::accept_handshake(&mut s, &cfg).unwrap();
        then(s)
    });
    let url: Url = format!("tcp://127.0.0.1:{port}").parse().unwrap();
    let qp = pd
        .create_qp(&cq, &cq, QpCaps::default())
        .unwrap()
        .connect(&url, params, b"")
        .unwrap();
    RawTarget {
        ctx,
        pd,
        cq,
        qp,
        peer,
    }
}
