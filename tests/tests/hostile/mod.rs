//! What the hostile-peer suites share (tests/tests/hostile_*.rs): a raw peer that speaks MPA,
//! DDP and RDMAP itself with the soft wire's encoders (feature `wire-testing`) from its own
//! loopback address, a legitimate initiator that keeps writing and verifying on another
//! subsystem throughout, and the checksums that show an attack changed nothing.
//!
//! The target is the sessions fixture ([`rpma_tests::sessions`]): SUB (hosts PLAIN, KEYED with a
//! key; nsid 1 read-write, nsid 3 read-only) is what the attackers aim at, its files filled
//! with noise before the target starts; OPEN (any host) is where the legitimate initiator
//! works.

#![allow(dead_code)] // each suite uses its part

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rpma_common::fabric::soft::wire::ddp::HeaderKind;
use rpma_common::fabric::soft::wire::mpa::{self, Answer, MpaConfig, MpaFrame, Negotiated};
use rpma_common::fabric::soft::wire::tx::encode_fpdu;
use rpma_common::fabric::soft::wire::{crc32c, fpdu_len, Header, Opcode, TermCause, Terminate};
use rpma_common::proto::{Connect, ConnectResponse, HostId, Message, NamespaceDescriptor};
use rpma_initiator::{Connection, HostIdentity};
use rpma_tests::sessions::{start_with_extra, OPEN, PLAIN, SUB, WAIT};
use rpma_tests::{noise, nqn, opts, scratch, tcp_from, Target};

/// What one read from a peer that sends nothing more may wait.
const QUIET: Duration = Duration::from_millis(200);

/// Sends `request` (an MPA Request, well-formed or not) from `src` and returns the target's
/// answer: the decoded Reply, and whether the connection was closed after it.
pub fn mpa_answer(port: u16, src: Ipv4Addr, request: &[u8]) -> (Option<MpaFrame>, bool) {
    let mut s = tcp_from(port, src, WAIT);
    s.write_all(request).unwrap();
    let raw = mpa::read_raw_frame(&mut s, "the target's MPA Reply").ok();
    let reply = raw.and_then(|r| MpaFrame::decode(&r.bytes).ok().flatten().map(|(f, _)| f));
    (reply, closed_within(&mut s, WAIT))
}

/// Whether the target closed `s` (EOF or reset) within `within`; what it sent meanwhile is
/// read and dropped.
pub fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 64 << 10];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// What the target sent, FPDU by FPDU.
#[derive(Debug)]
pub enum FromTarget {
    /// A whole Send: a control message (or bytes that are none).
    Message(Result<Message, Vec<u8>>),
    /// A Terminate.
    Terminate(Terminate),
    /// Anything else (Read Responses, atomic responses).
    Other(Opcode),
    /// The connection closed.
    Closed,
}

/// A raw peer past MPA: it frames what it sends itself.
pub struct Peer {
    pub s: TcpStream,
    pub n: Negotiated,
    /// The next MSN on the Send queue.
    pub msn: u32,
    /// The next MSN on the Read Request queue (Reads, atomics, the private requests).
    pub rmsn: u32,
    buf: Vec<u8>,
    send: Vec<u8>,
}

impl Peer {
    /// MPA from `src` with `cfg`; panics unless the target accepts.
    pub fn open_with(port: u16, src: Ipv4Addr, cfg: &MpaConfig) -> Peer {
        let mut s = tcp_from(port, src, WAIT);
        match mpa::connect_exchange(&mut s, cfg).unwrap() {
            Answer::Accepted(n) => Peer {
                s,
                n,
                msn: 1,
                rmsn: 1,
                buf: Vec::new(),
                send: Vec::new(),
            },
            other => panic!("MPA from {src}: {other:?}"),
        }
    }

    /// MPA from `src` with this project's defaults (CRC, every capability).
    pub fn open(port: u16, src: Ipv4Addr) -> Peer {
        Peer::open_with(port, src, &MpaConfig::default())
    }

    /// The bytes of one FPDU with `h` around `body`, framed as negotiated.
    pub fn fpdu(&self, h: Header, body: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        encode_fpdu(&h, body, self.n.crc, &mut v).unwrap();
        v
    }

    /// Sends raw bytes.
    pub fn raw(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).unwrap();
    }

    /// The bytes of one Send FPDU carrying `body`, with the next MSN (for a burst written at
    /// once).
    pub fn send_fpdu(&mut self, body: &[u8]) -> Vec<u8> {
        let h = Header::untagged(Opcode::Send, self.msn, true);
        self.msn += 1;
        self.fpdu(h, body)
    }

    /// One Send FPDU carrying `body` (the next MSN), sent.
    pub fn send(&mut self, body: &[u8]) {
        let f = self.send_fpdu(body);
        self.raw(&f);
    }

    /// `m` as one Send.
    pub fn message(&mut self, m: &Message) {
        self.send(&m.encode().unwrap());
    }

    /// The FPDU of an RDMA Write of `data` at (`stag`, `to`).
    pub fn write_fpdu(&self, stag: u32, to: u64, data: &[u8]) -> Vec<u8> {
        self.fpdu(Header::tagged(Opcode::Write, stag, to, true), data)
    }

    /// The FPDU of a request on the Read Request queue (the next MSN there).
    pub fn request_fpdu(&mut self, opcode: Opcode, body: &[u8]) -> Vec<u8> {
        let h = Header::untagged(opcode, self.rmsn, true);
        self.rmsn += 1;
        self.fpdu(h, body)
    }

    /// Connect as `host` to `sub` (the discovery NQN for discovery), no key, asking a keep-alive
    /// period long enough that the test never needs to send one.
    pub fn connect(&mut self, host: &str, sub: &str) {
        self.message(&Message::Connect(Connect {
            host_nqn: nqn(host),
            subsystem_nqn: nqn(sub),
            host_id: HostId([0x77; 16]),
            queue_id: 0,
            keep_alive_ms: 60_000,
        }));
    }

    /// Connect as PLAIN to SUB: the namespace descriptors (panics if refused).
    pub fn admit(&mut self) -> ConnectResponse {
        self.connect(PLAIN, SUB);
        match self.next_message() {
            Message::ConnectResponse(r) => r,
            other => panic!("Connect refused: {other:?}"),
        }
    }

    /// The next control message; panics on anything else.
    pub fn next_message(&mut self) -> Message {
        loop {
            match self.next(WAIT) {
                Some(FromTarget::Message(Ok(m))) => return m,
                Some(FromTarget::Other(_)) => {}
                other => panic!("expected a control message, got {other:?}"),
            }
        }
    }

    /// The next FPDU from the target (Sends reassembled), None if nothing came within `within`.
    pub fn next(&mut self, within: Duration) -> Option<FromTarget> {
        let deadline = Instant::now() + within;
        loop {
            if self.buf.len() >= 2 {
                let len = usize::from(u16::from_be_bytes([self.buf[0], self.buf[1]]));
                let total = fpdu_len(len);
                if self.buf.len() >= total {
                    let fpdu: Vec<u8> = self.buf.drain(..total).collect();
                    if self.n.crc {
                        let c = crc32c(&fpdu[..total - 4]).to_le_bytes();
                        assert_eq!(c, fpdu[total - 4..], "the target sent a bad CRC");
                    }
                    let ulpdu = &fpdu[2..2 + len];
                    let (h, hl) = Header::decode(ulpdu).expect("the target's header decodes");
                    let payload = &ulpdu[hl..];
                    match (h.opcode, h.kind) {
                        (Opcode::Terminate, _) => {
                            return Some(FromTarget::Terminate(
                                Terminate::decode(payload).expect("a Terminate decodes"),
                            ))
                        }
                        (Opcode::Send, HeaderKind::Untagged { .. }) => {
                            self.send.extend_from_slice(payload);
                            if h.last {
                                let b = std::mem::take(&mut self.send);
                                return Some(FromTarget::Message(
                                    Message::decode(&b).map_err(|_| b.clone()),
                                ));
                            }
                            continue;
                        }
                        (op, _) => return Some(FromTarget::Other(op)),
                    }
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            self.s.set_read_timeout(Some(left)).unwrap();
            let mut b = [0u8; 64 << 10];
            match self.s.read(&mut b) {
                Ok(0) => return Some(FromTarget::Closed),
                Ok(n) => self.buf.extend_from_slice(&b[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                    return Some(FromTarget::Closed)
                }
                Err(_) => return None,
            }
        }
    }

    /// Reads until the target's Terminate (skipping what comes before it), asserts its cause,
    /// then that the target closes the connection. Returns the Terminate.
    pub fn expect_terminate(&mut self, cause: TermCause, what: &str) -> Terminate {
        self.expect_terminate_any(&[cause], what)
    }

    /// As [`Peer::expect_terminate`], for a cause among `causes`.
    pub fn expect_terminate_any(&mut self, causes: &[TermCause], what: &str) -> Terminate {
        loop {
            match self.next(WAIT) {
                Some(FromTarget::Terminate(t)) => {
                    assert!(
                        causes.contains(&t.cause),
                        "{what}: the Terminate's cause: {t:?}"
                    );
                    assert!(self.closed(), "{what}: the connection stayed open");
                    return t;
                }
                Some(FromTarget::Message(_)) | Some(FromTarget::Other(_)) => {}
                other => panic!("{what}: no Terminate ({causes:?}), got {other:?}"),
            }
        }
    }

    /// Whether the target closes the connection within [`WAIT`].
    pub fn closed(&mut self) -> bool {
        closed_within(&mut self.s, WAIT)
    }

    /// Whether the connection is still open after a short quiet spell.
    pub fn still_open(&mut self) -> bool {
        !closed_within(&mut self.s, QUIET)
    }
}

/// The descriptor of namespace `nsid` in a ConnectResponse.
pub fn ns(r: &ConnectResponse, nsid: u32) -> &NamespaceDescriptor {
    r.namespaces.iter().find(|d| d.nsid == nsid).unwrap()
}

/// A legitimate host on OPEN, writing durably and reading back 4 KiB blocks on its own thread
/// until it is stopped; every write is verified. Its connection must never be lost.
pub struct Legit {
    stop: Arc<AtomicBool>,
    ops: Arc<AtomicU64>,
    handle: Option<JoinHandle<Result<u64, String>>>,
    /// Its namespace's descriptor (the rkey an attacker would most like to steal).
    pub desc: NamespaceDescriptor,
}

impl Legit {
    pub fn start(url: &str) -> Legit {
        let host = HostIdentity::new(nqn("nqn.2026-11.io.rpma:legitimate-host"));
        let conn = Connection::new(url, nqn(OPEN), host).with_connect_options(opts());
        let mut q = conn.open_queue(0).unwrap();
        let desc = q.namespace(1).unwrap().descriptor().clone();
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let (st, n) = (Arc::clone(&stop), Arc::clone(&ops));
        let handle = std::thread::spawn(move || {
            let mut i = 0u64;
            let mut back = vec![0u8; 4096];
            while !st.load(Ordering::SeqCst) {
                let off = (i % 256) * 4096;
                let data = noise(0xC0DE + i, 4096);
                let mut ns = q.namespace(1).map_err(|e| e.to_string())?;
                ns.write_durable(off, &data)
                    .map_err(|e| format!("write {i}: {e}"))?;
                ns.read_at(off, &mut back)
                    .map_err(|e| format!("read {i}: {e}"))?;
                if back != data {
                    return Err(format!("block {i} at {off} read back wrong"));
                }
                i += 1;
                n.store(i, Ordering::SeqCst);
            }
            match q.reconnects() {
                0 => Ok(i),
                r => Err(format!("the legitimate host reconnected {r} time(s)")),
            }
        });
        Legit {
            stop,
            ops,
            handle: Some(handle),
            desc,
        }
    }

    /// Blocks written and verified so far.
    pub fn ops(&self) -> u64 {
        self.ops.load(Ordering::SeqCst)
    }

    /// Waits until it has verified two more blocks: the daemon still serves it.
    pub fn progressed(&self, after: &str) {
        let from = self.ops.load(Ordering::SeqCst);
        let deadline = Instant::now() + WAIT;
        while self.ops.load(Ordering::SeqCst) < from + 2 {
            let done = self.handle.as_ref().is_none_or(JoinHandle::is_finished);
            assert!(
                !done && Instant::now() < deadline,
                "the legitimate host stopped after {after}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops it: the blocks it wrote and verified (all of them, or the test fails).
    pub fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        let h = self.handle.take().unwrap();
        h.join().unwrap().unwrap()
    }
}

impl Drop for Legit {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The CRC32c of a file.
fn sum(p: &Path) -> u32 {
    crc32c(&std::fs::read(p).unwrap())
}

/// A target on the sessions fixture (SUB's files filled with noise first), the legitimate host
/// at work, and a fresh source address for each attacker connection.
pub struct Suite {
    pub t: Target,
    pub legit: Legit,
    /// What [`Suite::peer`]'s peers offer in MPA.
    pub mpa: MpaConfig,
    dir: tempfile::TempDir,
    sums: [u32; 2],
    next_src: u8,
    cases: usize,
}

impl Suite {
    /// `top`: settings before the subsystems (as [`rpma_tests::sessions::start`]'s).
    pub fn start(top: &str) -> Suite {
        Suite::start_with(top, "")
    }

    /// As [`Suite::start`], with `extra` after SUB's namespaces (as [`start_with_extra`]'s).
    pub fn start_with(top: &str, extra: &str) -> Suite {
        let dir = scratch();
        std::fs::write(dir.path().join("ns1"), noise(1, 2 << 20)).unwrap();
        std::fs::write(dir.path().join("ns3"), noise(3, 1 << 20)).unwrap();
        let t = start_with_extra(dir.path(), top, extra, &[]);
        let legit = Legit::start(&t.url());
        let mut s = Suite {
            t,
            legit,
            mpa: MpaConfig::default(),
            dir,
            sums: [0; 2],
            next_src: 2,
            cases: 0,
        };
        s.sums = s.now();
        s
    }

    fn now(&self) -> [u32; 2] {
        [
            sum(&self.dir.path().join("ns1")),
            sum(&self.dir.path().join("ns3")),
        ]
    }

    pub fn port(&self) -> u16 {
        self.t.port()
    }

    /// A source address no attacker of this suite used yet.
    pub fn src(&mut self) -> Ipv4Addr {
        let n = self.next_src;
        self.next_src = self.next_src.checked_add(1).expect("at most 253 attackers");
        Ipv4Addr::new(127, 0, 0, n)
    }

    /// A raw peer past MPA from a fresh address, offering [`Suite::mpa`].
    pub fn peer(&mut self) -> Peer {
        let src = self.src();
        Peer::open_with(self.port(), src, &self.mpa.clone())
    }

    /// A raw peer admitted to SUB as PLAIN, with SUB's namespaces 1 and 3 (read-only).
    pub fn admitted(&mut self) -> (Peer, NamespaceDescriptor, NamespaceDescriptor) {
        let mut p = self.peer();
        let r = p.admit();
        let (n1, n3) = (ns(&r, 1).clone(), ns(&r, 3).clone());
        assert!(n3.read_only && !n1.read_only);
        (p, n1, n3)
    }

    /// One attack: `p` sends `bytes`; the target must answer with a Terminate of `cause` and
    /// close the connection, changing nothing, while the legitimate host is served.
    pub fn terminated(&mut self, mut p: Peer, bytes: &[u8], cause: TermCause, case: &str) {
        p.raw(bytes);
        p.expect_terminate(cause, case);
        self.unchanged(case);
    }

    /// After an attack: SUB's namespaces are as they were, and the legitimate host still works.
    pub fn unchanged(&mut self, case: &str) {
        assert_eq!(self.now(), self.sums, "{case}: a namespace of SUB changed");
        self.legit.progressed(case);
        self.cases += 1;
        eprintln!("hostile: {case}: refused, closed, namespaces unchanged, the host served");
    }

    /// Ends the suite: the legitimate host's blocks (all verified), the cases run.
    pub fn finish(self) -> (u64, usize) {
        let cases = self.cases;
        let blocks = self.legit.finish();
        assert_eq!(
            [
                sum(&self.dir.path().join("ns1")),
                sum(&self.dir.path().join("ns3"))
            ],
            self.sums
        );
        eprintln!("hostile: {cases} case(s); the legitimate host verified {blocks} block(s)");
        (blocks, cases)
    }
}
