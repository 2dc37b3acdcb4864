//! The receive state machine under arbitrary bytes, with a placer that checks STag and bounds as
//! the responder does, over memory fenced by guard bytes.

use std::io::{self, Read};

use crate::fabric::soft::wire::body::Body;
use crate::fabric::soft::wire::ddp::{Header, HeaderKind, Opcode};
use crate::fabric::soft::wire::rx::{
    Delivered, DirectTarget, FpduReceiver, Placement, Placer, Received, RxConfig,
};
use crate::fabric::soft::wire::{CapFlags, TermCause, Terminate, WireError, MAX_ULPDU_LIMIT};
use crate::fabric::soft::{placer::write_payload, wire};
use crate::volatile::{ReadVolatile, VolatileSlice};

/// The STag the placer knows: remote write into the first half of the window.
pub(crate) const WRITE_STAG: u32 = 0x0000_0101;
/// Bytes of the window: Writes land in `[0, HALF)`, Sends in `[HALF, WINDOW)`.
const WINDOW: usize = 4096;
const HALF: usize = WINDOW / 2;
/// Guard bytes on either side of the window: never written.
const GUARD: usize = 64;
const GUARD_BYTE: u8 = 0xA5;

/// The receive limits a settings byte chooses from: the smallest allowed, the classic MSS, a
/// jumbo frame, and the daemon's own (it accepts what the 16-bit length can say).
const MAX_ULPDUS: [usize; 4] = [128, 1454, 9000, MAX_ULPDU_LIMIT];

/// Feeds `data[2..]` to an [`FpduReceiver`] until it fails (the stream ends in EOF, so every
/// run ends in an error) and checks, after each step:
/// - no byte outside the window is ever written, and a reported placement changed bytes only
///   in its own checked range;
/// - a refused or malformed FPDU places nothing (with CRC on, nothing even of a torn payload);
/// - a delivered FPDU is self-consistent (lengths, buffer model, opcode allowed, data opcodes
///   placed and control bodies decoded), and its header and body encode back to what was
///   decoded;
/// - the error names a Terminate cause whose Terminate, quoting the offending segment, encodes
///   and decodes back to itself; after it, the receiver stays failed;
/// - the receiver finishes or fails within a bounded number of polls (no spin).
///
/// `data[0]`: bit 0 CRC, bits 1-3 the optional opcodes allowed ([`CapFlags`]), bits 4-5 the
/// maximum ULPDU, bit 6 placement with cache write-back, bit 7 a WouldBlock before every read.
/// `data[1]`: the most bytes one read returns (0: no limit).
pub fn fpdu_rx(data: &[u8]) {
    let Some((&[settings, chunk], stream)) = data.split_first_chunk::<2>() else {
        return;
    };
    let crc = settings & 1 != 0;
    let allowed = CapFlags(u16::from((settings >> 1) & 0x7));
    let max_ulpdu = MAX_ULPDUS[usize::from((settings >> 4) & 0x3)];
    let cfg = RxConfig::new(crc, max_ulpdu, allowed).expect("every choice is in range");
    let mut mem = vec![GUARD_BYTE; GUARD + WINDOW + GUARD];
    for (i, b) in mem[GUARD..GUARD + WINDOW].iter_mut().enumerate() {
        *b = i as u8;
    }
    let mut placer = FuzzPlacer {
        base: mem[GUARD..].as_mut_ptr(),
        writeback: settings & 0x40 != 0,
        decided: None,
    };
    let mut src = Source {
        data: stream,
        pos: 0,
        chunk: if chunk == 0 { usize::MAX } else { chunk.into() },
        block: settings & 0x80 != 0,
        blocked: false,
    };
    let mut rx = FpduReceiver::new(cfg);
    let mut before = mem.clone();
    // Each poll consumes a byte or comes right after a WouldBlock, which never comes twice in a
    // row: twice the stream's length bounds the polls of a receiver that makes progress.
    for _ in 0..2 * stream.len() + 16 {
        match rx.poll(&mut src, &mut placer) {
            Ok(None) => {}
            Ok(Some(r)) => {
                let expect = Expect {
                    max_ulpdu,
                    allowed,
                    writeback: placer.writeback,
                };
                check_received(&r, &expect);
                let placed = matches!(r.data, Delivered::Placed);
                drop(r);
                let range = placer.decided.take().filter(|_| placed);
                check_memory(&before, &mem, range, "a delivered FPDU");
                before.copy_from_slice(&mem);
            }
            Err(e) => {
                // With CRC off, an I/O error or EOF in the middle of a payload streamed into
                // place can leave a prefix of it written (as on any RDMA NIC), in its range.
                let torn = !crc && matches!(e, WireError::Closed { .. } | WireError::Io { .. });
                let range = placer.decided.take().filter(|_| torn);
                check_memory(&before, &mem, range, "a failed FPDU");
                check_error(&e, &rx);
                let again = rx.poll(&mut src, &mut placer);
                assert!(
                    matches!(again, Err(WireError::Closed { .. })),
                    "a failed receiver polled again: {again:?}"
                );
                return;
            }
        }
    }
    panic!(
        "the receiver neither finished nor failed on {} bytes",
        stream.len()
    );
}

/// What [`check_received`] judges a delivery against.
struct Expect {
    max_ulpdu: usize,
    allowed: CapFlags,
    writeback: bool,
}

fn check_received(r: &Received<'_>, x: &Expect) {
    let h = &r.header;
    assert!(r.ulpdu_len <= x.max_ulpdu, "{r:?} over {}", x.max_ulpdu);
    assert_eq!(r.payload_len + h.len(), r.ulpdu_len, "{r:?}");
    assert_eq!(
        Header::decode(h.encode().as_slice()).unwrap(),
        (*h, h.len()),
        "the header does not encode back"
    );
    assert_eq!(
        matches!(h.kind, HeaderKind::Tagged { .. }),
        h.opcode.is_tagged()
    );
    let optional = match h.opcode {
        Opcode::ImmediateData
        | Opcode::ImmediateDataSe
        | Opcode::AtomicRequest
        | Opcode::AtomicResponse => Some(x.allowed.contains(CapFlags::RFC7306_ATOMICS)),
        Opcode::FlushRequest => Some(x.allowed.contains(CapFlags::FLUSH)),
        Opcode::AtomicWriteRequest => Some(x.allowed.contains(CapFlags::ATOMIC_WRITE)),
        Opcode::PrivateResponse => {
            Some(x.allowed.contains(CapFlags::FLUSH) || x.allowed.contains(CapFlags::ATOMIC_WRITE))
        }
        _ => None,
    };
    assert_ne!(optional, Some(false), "{:?} was not negotiated", h.opcode);
    if let HeaderKind::Untagged { qn, mo, .. } = h.kind {
        assert_eq!(Some(qn), h.opcode.queue(), "{h:?} on the wrong queue");
        if h.opcode.is_single_segment() {
            assert!(mo == 0 && h.last, "a control message in pieces: {h:?}");
        }
    }
    match &r.data {
        Delivered::Control(body) => {
            assert!(
                !h.opcode.carries_data(),
                "{:?} decoded as control",
                h.opcode
            );
            let bytes = encode_body(body);
            // Fixed bodies are exact; a Terminate's optional parts follow its flags, and bytes
            // after them are ignored (RFC 5040 §4.8 defines none).
            if matches!(body, Body::Terminate(_)) {
                assert!(bytes.len() <= r.payload_len, "{body:?}");
            } else {
                assert_eq!(bytes.len(), r.payload_len, "{body:?}");
            }
            assert_eq!(
                Body::decode(h.opcode, &bytes).unwrap().as_ref(),
                Some(body),
                "the body does not encode back"
            );
        }
        Delivered::Placed => {
            assert!(h.opcode.carries_data());
            assert!(!r.written_back || x.writeback, "written back unasked");
        }
        Delivered::Buffered(b) => {
            assert!(h.opcode.carries_data());
            assert_eq!(b.len(), r.payload_len);
        }
        Delivered::Discarded => assert!(h.opcode.carries_data()),
    }
}

fn encode_body(body: &Body) -> Vec<u8> {
    match body {
        Body::ReadRequest(b) => b.encode().to_vec(),
        Body::Terminate(t) => t.encode(),
        Body::ImmediateData(b) => b.to_vec(),
        Body::AtomicRequest(b) => b.encode().to_vec(),
        Body::AtomicResponse(b) => b.encode().to_vec(),
        Body::FlushRequest(b) => b.encode().to_vec(),
        Body::AtomicWriteRequest(b) => b.encode().to_vec(),
        Body::PrivateResponse(b) => b.encode().to_vec(),
    }
}

/// The guards are intact, and nothing changed since `before` outside `allowed` (a range of the
/// window).
fn check_memory(before: &[u8], now: &[u8], allowed: Option<(usize, usize)>, what: &str) {
    let guards = now[..GUARD].iter().chain(&now[GUARD + WINDOW..]);
    assert!(
        guards.into_iter().all(|&b| b == GUARD_BYTE),
        "{what} wrote outside the registered window"
    );
    let (start, len) = allowed.unwrap_or((0, 0));
    let (a, b) = (GUARD + start, GUARD + start + len);
    if before[..a] != now[..a] || before[b..] != now[b..] {
        let i = (0..before.len())
            .find(|&i| before[i] != now[i] && !(a..b).contains(&i))
            .expect("a differing byte");
        panic!(
            "{what} changed byte {} of the window outside its placement {allowed:?}",
            i - GUARD
        );
    }
}

fn check_error(e: &WireError, rx: &FpduReceiver) {
    let _ = e.to_string();
    let mut t = Terminate::new(e.terminate_cause());
    if let Some((seg_len, hdr)) = rx.offending_segment() {
        assert!(
            hdr.len() <= 18,
            "an offending header of {} bytes",
            hdr.len()
        );
        t = t.with_ddp(seg_len, hdr);
    }
    let bytes = t.encode();
    assert_eq!(bytes.len(), t.len());
    assert_eq!(
        Terminate::decode(&bytes).unwrap(),
        t,
        "the Terminate does not decode back"
    );
}

/// Checks STag, bounds and queue as the responder does; records the range it hands out.
struct FuzzPlacer {
    /// The window's first byte.
    base: *mut u8,
    writeback: bool,
    /// (window offset, length) of the last direct placement handed out.
    decided: Option<(usize, usize)>,
}

impl FuzzPlacer {
    fn direct(&mut self, at: usize, len: usize) -> Placement {
        self.decided = Some((at, len));
        // SAFETY: `at + len <= WINDOW` was checked by the caller, so the range lies inside the
        // window of `mem`, which outlives the receiver in `fpdu_rx`; nothing holds a reference
        // to those bytes while the receiver may write them (the checks read `mem` only between
        // polls).
        let t = unsafe { DirectTarget::new(self.base.add(at), len) };
        Placement::Direct(if self.writeback {
            t.with_cache_writeback()
        } else {
            t
        })
    }
}

impl Placer for FuzzPlacer {
    fn place(&mut self, h: &Header, len: usize) -> Result<Placement, TermCause> {
        self.decided = None;
        match (h.opcode, h.kind) {
            (Opcode::Write, HeaderKind::Tagged { stag, to }) => {
                if stag != WRITE_STAG {
                    return Err(TermCause::DDP_TAGGED_INVALID_STAG);
                }
                let end = to.checked_add(len as u64);
                if end.is_none_or(|e| e > HALF as u64) {
                    return Err(TermCause::DDP_TAGGED_BASE_BOUNDS);
                }
                Ok(if len == 0 {
                    Placement::Discard
                } else {
                    self.direct(to as usize, len)
                })
            }
            (Opcode::ReadResponse, HeaderKind::Tagged { .. }) => Ok(Placement::Buffer),
            (_, HeaderKind::Untagged { msn, mo, .. }) => {
                let mo = mo as usize;
                if mo + len > HALF {
                    return Err(TermCause::DDP_UNTAGGED_TOO_LONG);
                }
                // Odd messages are copied by the "engine" itself; even ones placed directly.
                Ok(if msn % 2 == 1 || len == 0 {
                    Placement::Buffer
                } else {
                    self.direct(HALF + mo, len)
                })
            }
            _ => Err(TermCause::RDMAP_UNEXPECTED_OPCODE),
        }
    }

    fn write(&mut self, target: DirectTarget, payload: &[u8]) -> wire::Result<bool> {
        write_payload(target, payload)
    }
}

/// The stream: at most `chunk` bytes a read, a WouldBlock before each read when `block`, EOF
/// at the end.
struct Source<'a> {
    data: &'a [u8],
    pos: usize,
    chunk: usize,
    block: bool,
    blocked: bool,
}

impl Source<'_> {
    /// Bytes the next read may return, or the WouldBlock that comes first.
    fn next_len(&mut self, room: usize) -> io::Result<usize> {
        if self.pos < self.data.len() && self.block && !self.blocked {
            self.blocked = true;
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.blocked = false;
        Ok(room.min(self.chunk).min(self.data.len() - self.pos))
    }
}

impl Read for Source<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.next_len(buf.len())?;
        buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

impl ReadVolatile for Source<'_> {
    /// Like `readv`: fills the buffers in order, at most one chunk in all.
    fn read_volatile(&mut self, bufs: &[VolatileSlice<'_>]) -> io::Result<usize> {
        let room = bufs.iter().map(VolatileSlice::len).sum();
        let mut left = self.next_len(room)?;
        let mut done = 0;
        for b in bufs {
            let n = left.min(b.len());
            if n == 0 {
                continue;
            }
            b.write_at(0, &self.data[self.pos..self.pos + n])
                .expect("n <= the buffer's length");
            self.pos += n;
            done += n;
            left -= n;
        }
        Ok(done)
    }
}
