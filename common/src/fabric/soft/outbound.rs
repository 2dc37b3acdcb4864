//! The transmit side of a connection: a FIFO of outbound RDMAP messages, cut into FPDUs and
//! written with `writev` straight from registered memory (no copy of the payload).
//!
//! The cutting and framing are the wire layer's ([`Cuts`], [`Framing`]); what this adds is
//! ownership across partial writes: a queued FPDU keeps an `Arc` of the region its payload
//! lives in, so memory in flight is never freed.
//!
//! A payload in registered memory is seen only as a [`VolatileSlice`]: other queue pairs may
//! place into the same bytes while they wait here (a Read of a range another session writes),
//! so the CRC is computed over copies of them and `writev` gets raw iovecs, never a `&[u8]`.
//!
//! Messages go out whole and in order: requests as posted, responses in the order their
//! requests came in, which is what RC ordering asks of a single TCP stream.
//!
//! Revocation: a Read Response is read from the memory when the socket takes it, which may be
//! long after the Read Request was checked (a peer that stops reading holds its answers
//! here). Once the region it reads from is deregistered, no byte of it leaves: before each
//! `writev` the FPDUs it would carry are checked, and [`Tx::revoked`] tells the engine to
//! terminate the stream instead. What the kernel's socket buffer already holds was read
//! before the deregistration. A deregistration on another thread than the one that drives
//! progress can still race one `writev` already past its check.
//!
//! Fair share: one [`Tx::flush`] writes at most the budget its caller gives, so a queue pair
//! with a gigabyte of Read Responses queued and a peer that reads as fast as the loopback goes
//! takes its share and lets the other queue pairs of its completion queue have theirs:
//! round-robin service of the send capacity. A completion queue's pass over its queue pairs
//! has [`TURN_BYTES`] to give, split between those that had output waiting after the previous
//! pass ([`quantum`]), so that a small answer waiting among them waits for about
//! [`TURN_BYTES`] of the others' output, however many they are (down to [`MIN_QUANTUM`] each),
//! and a lone sender still writes [`TURN_BYTES`] per call.

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use crate::fabric::mr::Region;
use crate::fabric::soft::wire::tx::{Cuts, Framing, TxConfig, MIN_MAX_ULPDU};
use crate::fabric::soft::wire::{Header, MAX_ULPDU_LIMIT};
use crate::volatile::VolatileSlice;

/// Where a message's payload comes from.
pub(crate) enum Src {
    /// `len` bytes of registered memory at `offset` (kept alive by the Arc). `revocable`: a Read
    /// Response, which a peer may have only while the region stays registered (a local Write's
    /// or Send's source stays the poster's to send, whatever becomes of its registration).
    Mem {
        region: Arc<Region>,
        offset: usize,
        revocable: bool,
    },
    /// A control body (one segment).
    Inline(InlineBody),
}

/// A control message's body (a Read or Flush Request, a Flush's answer, a Terminate): inline
/// up to 32 bytes, so that a request's own messages allocate nothing.
pub(crate) type InlineBody = smallvec::SmallVec<[u8; 32]>;

/// What to do when a message has been fully written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnSent {
    Nothing,
    /// Send-queue entry `seq` is complete (Write, Send).
    Complete(u64),
    /// A response left: one IRD slot is free again.
    ResponseDone,
}

pub(crate) struct TxMsg {
    /// The first segment's header; `last` is set per segment.
    pub(crate) hdr: Header,
    pub(crate) src: Src,
    pub(crate) len: usize,
    pub(crate) on_sent: OnSent,
}

impl TxMsg {
    /// Whether it is a Read Response from a region deregistered since it was queued.
    fn revoked(&self) -> bool {
        matches!(&self.src, Src::Mem { region, revocable: true, .. } if region.revoked())
    }
}

/// What one pass of a completion queue over its queue pairs writes at most, all of them
/// together (unless more than `TURN_BYTES / MIN_QUANTUM` are busy): docs/benchmarks.md, "Fair
/// share".
pub(crate) const TURN_BYTES: usize = 1024 * 1024;

/// The least share of a busy queue pair per pass: one writev of a few FPDUs.
pub(crate) const MIN_QUANTUM: usize = 64 * 1024;

/// What a post (the doorbell) writes at once at most; the rest goes in progress calls.
pub(crate) const TX_QUANTUM: usize = 1024 * 1024;

/// The share of each queue pair in a pass when `busy` of them had output waiting after the
/// previous one: [`TURN_BYTES`] split between them, at least [`MIN_QUANTUM`].
pub(crate) fn quantum(busy: usize) -> usize {
    (TURN_BYTES / busy.max(1)).max(MIN_QUANTUM)
}

/// FPDUs gathered into one writev (three iovecs each, within IOV_MAX).
const BATCH: usize = 64;

/// How many bytes of FPDUs are framed ahead of the socket (the batch stops at the FPDU that
/// reaches it). Framing computes the CRC over the payload, which brings it into the cache; the
/// `writev` that follows copies it again, and that copy should still find it there. A loopback
/// socket takes about 1 MiB per `writev`; with 64 FPDUs of 32 KiB (2 MiB) framed at once, the
/// payloads had left the core's 2 MiB L2 by the time the socket took them (docs/benchmarks.md).
const READY_BYTES: usize = 1024 * 1024;

/// A queued FPDU's payload.
enum Payload {
    /// Registered memory, kept alive by the Arc while the FPDU waits.
    Mem {
        /// Only ever handed out borrowed from the payload ([`Payload::iovec`] and the framing),
        /// so it never outlives `keep`.
        slice: VolatileSlice<'static>,
        keep: Arc<Region>,
        /// As [`Src::Mem`]'s.
        revocable: bool,
    },
    Inline(InlineBody),
}

/// One FPDU ready to go: framing, and its payload from memory or inline.
struct Fpdu {
    framing: Framing,
    payload: Payload,
    /// Set on a message's last FPDU.
    on_sent: OnSent,
}

// SAFETY: `Payload::Mem::slice` points into memory kept alive by `keep`, valid from any
// thread; it is only copied from and handed to `writev`, by whichever thread owns the
// connection at the time.
unsafe impl Send for Fpdu {}

impl Payload {
    fn len(&self) -> usize {
        match self {
            Payload::Mem { slice, .. } => slice.len(),
            Payload::Inline(b) => b.len(),
        }
    }

    /// The bytes from `skip` on, for `writev` (which only reads them).
    fn iovec(&self, skip: usize) -> libc::iovec {
        match self {
            Payload::Mem { slice, .. } => libc::iovec {
                iov_base: slice.as_ptr().wrapping_add(skip).cast(),
                iov_len: slice.len() - skip,
            },
            Payload::Inline(b) => iovec(&b[skip..]),
        }
    }
}

/// An iovec over bytes we own (framing, inline bodies): `writev` only reads through it.
fn iovec(b: &[u8]) -> libc::iovec {
    libc::iovec {
        iov_base: b.as_ptr().cast_mut().cast(),
        iov_len: b.len(),
    }
}

impl Fpdu {
    fn total(&self) -> usize {
        self.framing.overhead() + self.payload.len()
    }

    /// Whether its payload is a Read Response's from a region deregistered since.
    fn revoked(&self) -> bool {
        matches!(&self.payload, Payload::Mem { keep, revocable: true, .. } if keep.revoked())
    }
}

pub(crate) struct Tx {
    queue: VecDeque<TxMsg>,
    /// The segments of the queue's front message not yet cut (None: not started).
    front: Option<Cuts>,
    ready: VecDeque<Fpdu>,
    /// Bytes in `ready` (whole FPDUs, including what of the front one was written).
    ready_bytes: usize,
    /// Bytes of `ready`'s front FPDU already written.
    written: usize,
    /// The last flush stopped because the socket took no more (its peer is not reading as
    /// fast): output waits, but it does not compete for the pass's budget.
    blocked: bool,
    /// A message waiting here reads from a region deregistered since it was queued: nothing
    /// more is written until the engine terminates the stream ([`Tx::revoked`]).
    revoked: bool,
    cfg: TxConfig,
}

impl Tx {
    /// `max_ulpdu` is brought within the wire layer's limits (the handshake already refuses
    /// values outside them).
    pub(crate) fn new(crc: bool, max_ulpdu: usize) -> Tx {
        let max = max_ulpdu.clamp(MIN_MAX_ULPDU, MAX_ULPDU_LIMIT);
        Tx {
            queue: VecDeque::new(),
            front: None,
            ready: VecDeque::new(),
            ready_bytes: 0,
            written: 0,
            blocked: false,
            revoked: false,
            cfg: TxConfig::new(crc, max).expect("max ULPDU clamped to the wire's limits"),
        }
    }

    pub(crate) fn push(&mut self, m: TxMsg) {
        self.queue.push_back(m);
    }

    /// Queues a control message (`body` in one FPDU).
    pub(crate) fn push_inline(&mut self, hdr: Header, body: &[u8], on_sent: OnSent) {
        let len = body.len();
        self.push(TxMsg {
            hdr,
            src: Src::Inline(InlineBody::from_slice(body)),
            len,
            on_sent,
        });
    }

    /// Messages queued and not yet framed whole (a receive pass counts its answers by it).
    pub(crate) fn queued_messages(&self) -> usize {
        self.queue.len()
    }

    /// Whether the last [`flush`](Self::flush) stopped on a socket that took no more.
    pub(crate) fn blocked(&self) -> bool {
        self.blocked
    }

    /// Whether the last [`flush`](Self::flush) stopped because a Read Response it was to write
    /// reads from a region deregistered since: the stream must be terminated
    /// ([`abort_queued`](Self::abort_queued) drops it), or, once it is, the revoked bytes
    /// dropped ([`drop_revoked`](Self::drop_revoked)).
    pub(crate) fn revoked(&self) -> bool {
        self.revoked
    }

    /// Whether anything waits to be written.
    pub(crate) fn pending(&self) -> bool {
        !self.ready.is_empty() || !self.queue.is_empty()
    }

    /// Drops every message not started, keeping a partly written FPDU so that the stream stays
    /// framed (used before a Terminate); if that FPDU's region was revoked, the rest of it
    /// goes out as zeros.
    pub(crate) fn abort_queued(&mut self) {
        if self.written > 0 {
            self.ready.truncate(1);
        } else {
            self.ready.clear();
        }
        if let Some(f) = self.ready.front_mut() {
            f.on_sent = OnSent::Nothing;
        }
        self.queue.clear();
        self.front = None;
        self.drop_revoked();
    }

    /// After the stream was terminated: drops what reads from a revoked region (see
    /// [`Tx::revoked`]), but for a partly written FPDU, the rest of which goes out as zeros so
    /// that the stream stays framed up to the Terminate (with CRC, the FPDU's CRC no longer
    /// matches; the peer fails the stream either way, and has not a byte of the region from
    /// after its deregistration).
    pub(crate) fn drop_revoked(&mut self) {
        let partial = self.written > 0;
        let mut i = 0;
        self.ready.retain_mut(|f| {
            let first = i == 0;
            i += 1;
            if !f.revoked() {
                return true;
            }
            if first && partial {
                f.payload = Payload::Inline(InlineBody::from_elem(0, f.payload.len()));
                return true;
            }
            false
        });
        self.ready_bytes = self.ready.iter().map(Fpdu::total).sum();
        let front_revoked = self.queue.front().is_some_and(TxMsg::revoked);
        if front_revoked {
            self.front = None;
        }
        self.queue.retain(|m| !m.revoked());
        self.revoked = false;
    }

    fn cut(&mut self) {
        while self.ready.len() < BATCH && self.ready_bytes < READY_BYTES {
            let Some(m) = self.queue.front_mut() else {
                return;
            };
            if m.revoked() {
                // Not even its CRC is computed: that would be read from the revoked bytes.
                self.revoked = true;
                return;
            }
            let cuts = self
                .front
                .get_or_insert_with(|| Cuts::new(m.hdr, m.len, &self.cfg));
            let Some((hdr, at, n)) = cuts.next() else {
                // Not reached: a message leaves the queue with its last segment.
                self.queue.pop_front();
                self.front = None;
                continue;
            };
            let crc = self.cfg.crc();
            let (payload, framing) = match &mut m.src {
                Src::Inline(b) => {
                    let b = std::mem::take(b);
                    let framing = Framing::new(&hdr, n, [&b[..]], crc);
                    (Payload::Inline(b), framing)
                }
                Src::Mem {
                    region,
                    offset,
                    revocable,
                } => {
                    let s = region
                        .slice(*offset + at, n)
                        .expect("checked against the region when the request was accepted");
                    if cfg!(rpma_tsan) {
                        // Under ThreadSanitizer the kernel's read of registered memory (writev)
                        // would be a plain access: the payload is copied out atomically here
                        // instead (rpma_common::volatile, "Under ThreadSanitizer").
                        let mut b = InlineBody::from_elem(0, s.len());
                        s.read_at(0, &mut b).expect("inside the slice");
                        let framing = Framing::new(&hdr, n, [&b[..]], crc);
                        (Payload::Inline(b), framing)
                    } else {
                        let framing = if region.stable && crc {
                            // SAFETY: registered with register_stable: nothing writes these
                            // bytes while this work request, which reads them, is in flight
                            // (until this FPDU is sent at least); `s` is inside the live
                            // region; the reference ends with the CRC.
                            let b = unsafe { std::slice::from_raw_parts(s.as_ptr(), s.len()) };
                            Framing::new(&hdr, n, [b], crc)
                        } else {
                            Framing::for_volatile(&hdr, s, crc)
                        };
                        // SAFETY: the bytes stay valid as long as `keep`, which the payload
                        // holds beside the slice and drops with it; the slice is only used
                        // borrowed from the payload; registered memory is never covered by a
                        // reference.
                        let slice = unsafe { VolatileSlice::new(s.as_ptr(), s.len()) };
                        let keep = Arc::clone(region);
                        let revocable = *revocable;
                        (
                            Payload::Mem {
                                slice,
                                keep,
                                revocable,
                            },
                            framing,
                        )
                    }
                }
            };
            let on_sent = if hdr.last { m.on_sent } else { OnSent::Nothing };
            let f = Fpdu {
                framing,
                payload,
                on_sent,
            };
            self.ready_bytes += f.total();
            self.ready.push_back(f);
            if hdr.last {
                self.queue.pop_front();
                self.front = None;
            }
        }
    }

    /// Writes as much as the socket takes, but at most `budget` bytes. Calls `sent` for each
    /// message fully written. Returns Ok(true) if everything was written, Ok(false) if the
    /// socket is full or the budget spent.
    pub(crate) fn flush(
        &mut self,
        sock: &mut TcpStream,
        budget: usize,
        mut sent: impl FnMut(OnSent),
    ) -> io::Result<bool> {
        let mut spent = 0usize;
        self.blocked = false;
        loop {
            if spent >= budget {
                return Ok(!self.pending());
            }
            self.cut();
            // Checked before every writev: a region deregistered since the last one sends
            // nothing more (the writev reads the memory itself, not a copy).
            if self.revoked || self.ready.iter().any(Fpdu::revoked) {
                self.revoked = true;
                return Ok(false);
            }
            if self.ready.is_empty() {
                return Ok(true);
            }
            let empty = libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            };
            let mut iov = [empty; BATCH * 3];
            let mut iovcnt = 0;
            let mut skip = self.written;
            // What this writev may carry: the rest of the budget (an FPDU may be cut, the next
            // call goes on from there).
            let mut room = budget - spent;
            'gather: for f in &self.ready {
                let (head, trailer) = (f.framing.head(), f.framing.trailer());
                for (i, len) in [head.len(), f.payload.len(), trailer.len()]
                    .into_iter()
                    .enumerate()
                {
                    if skip >= len {
                        skip -= len;
                        continue;
                    }
                    if room == 0 {
                        break 'gather;
                    }
                    let mut v = match i {
                        0 => iovec(&head[skip..]),
                        1 => f.payload.iovec(skip),
                        _ => iovec(&trailer[skip..]),
                    };
                    v.iov_len = v.iov_len.min(room);
                    room -= v.iov_len;
                    iov[iovcnt] = v;
                    iovcnt += 1;
                    skip = 0;
                }
            }
            crate::steps::sending();
            // SAFETY: every iovec describes bytes valid for reads for the whole call: framing
            // and inline bodies owned by `self.ready` (borrowed here), registered memory kept
            // alive by the `Arc` of each FPDU in it; `writev` only reads them, and no Rust
            // reference is formed over the registered memory. iovcnt <= BATCH * 3 < IOV_MAX.
            let r = unsafe { libc::writev(sock.as_raw_fd(), iov.as_ptr(), iovcnt as libc::c_int) };
            let n = match r {
                0 => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                n if n > 0 => n as usize,
                _ => match io::Error::last_os_error() {
                    e if e.kind() == io::ErrorKind::WouldBlock => {
                        self.blocked = true;
                        return Ok(false);
                    }
                    e if e.kind() == io::ErrorKind::Interrupted => continue,
                    e => return Err(e),
                },
            };
            spent += n;
            let mut n = n + self.written;
            self.written = 0;
            while let Some(f) = self.ready.front() {
                let t = f.total();
                if n < t {
                    self.written = n;
                    break;
                }
                n -= t;
                let on = f.on_sent;
                self.ready.pop_front();
                self.ready_bytes -= t;
                if on != OnSent::Nothing {
                    sent(on);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::soft::wire::tx::segment;
    use crate::fabric::soft::wire::Opcode;
    use crate::fabric::{Access, AlignedBuf, Context};
    use std::io::Read;
    use std::net::TcpListener;

    fn socket_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn queued_messages_go_out_as_the_wire_segmenter_cuts_them() {
        for crc in [true, false] {
            let ctx = Context::soft();
            let pd = ctx.alloc_pd().unwrap();
            let mem = AlignedBuf::new(4096).unwrap();
            let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
            mem.write_at(100, &data).unwrap();
            let mr = pd.register(mem, Access::LOCAL_WRITE).unwrap();

            let mut tx = Tx::new(crc, 128);
            let write = Header::tagged(Opcode::Write, 9, 0x4000, true);
            tx.push(TxMsg {
                hdr: write,
                src: Src::Mem {
                    region: Arc::clone(mr.region()),
                    offset: 100,
                    revocable: false,
                },
                len: 1000,
                on_sent: OnSent::Complete(1),
            });
            let send = Header::untagged(Opcode::Send, 1, true);
            tx.push_inline(send, b"hello", OnSent::Complete(2));
            let (mut a, mut b) = socket_pair();
            let mut done = Vec::new();
            assert!(tx.flush(&mut a, usize::MAX, |o| done.push(o)).unwrap());
            assert_eq!(done, [OnSent::Complete(1), OnSent::Complete(2)]);
            assert!(!tx.pending());
            drop(a);
            let mut got = Vec::new();
            b.read_to_end(&mut got).unwrap();

            let cfg = TxConfig::new(crc, 128).unwrap();
            let mut want = Vec::new();
            let sg = [&data[..]];
            let fpdus: Vec<_> = segment(write, &sg, &cfg).collect();
            assert_eq!(fpdus.len(), 1000usize.div_ceil(128 - 14));
            for f in fpdus {
                f.append_to(&mut want);
            }
            for f in segment(send, &[&b"hello"[..]], &cfg) {
                f.append_to(&mut want);
            }
            assert_eq!(got, want, "crc {crc}");
        }
    }

    #[test]
    fn abort_keeps_a_partly_written_fpdu_and_drops_the_rest() {
        let mut tx = Tx::new(true, 128);
        for i in 0..3 {
            let h = Header::untagged(Opcode::Send, i + 1, true);
            tx.push_inline(h, &[i as u8; 40], OnSent::Complete(i as u64));
        }
        tx.cut();
        assert_eq!(tx.ready.len(), 3);
        tx.written = 5;
        tx.abort_queued();
        assert_eq!(tx.ready.len(), 1);
        assert_eq!(tx.ready[0].on_sent, OnSent::Nothing);
        tx.written = 0;
        tx.abort_queued();
        assert!(!tx.pending());
    }

    #[test]
    fn a_read_response_from_a_revoked_region_is_not_sent_and_a_partial_fpdu_ends_in_zeros() {
        use crate::fabric::soft::wire::fpdu_len;
        let ctx = Context::soft();
        let pd = ctx.alloc_pd().unwrap();
        let region = || {
            let mem = AlignedBuf::new(4096).unwrap();
            mem.write_at(0, &[0xAA; 4096]).unwrap();
            pd.register(mem, Access::LOCAL_WRITE).unwrap()
        };
        let msg = |mr: &Arc<crate::fabric::MemoryRegion>, revocable| TxMsg {
            hdr: Header::tagged(Opcode::ReadResponse, 9, 0, true),
            src: Src::Mem {
                region: Arc::clone(mr.region()),
                offset: 0,
                revocable,
            },
            len: 1000,
            on_sent: OnSent::ResponseDone,
        };
        let sent = |mut tx: Tx| {
            let (mut a, mut b) = socket_pair();
            assert!(tx.flush(&mut a, usize::MAX, |_| {}).unwrap());
            drop(a);
            let mut got = Vec::new();
            b.read_to_end(&mut got).unwrap();
            got
        };
        // A local Write's source goes out whatever became of its registration.
        let mr = region();
        mr.region().revoke();
        let mut tx = Tx::new(false, 128);
        tx.push(msg(&mr, false));
        assert!(sent(tx).contains(&0xAA));
        // A Read Response's does not, not even framed.
        let mut tx = Tx::new(false, 128);
        tx.push(msg(&mr, true));
        let (mut a, _b) = socket_pair();
        assert!(!tx.flush(&mut a, usize::MAX, |_| {}).unwrap());
        assert!(tx.revoked() && tx.ready.is_empty());
        tx.abort_queued();
        assert!(!tx.revoked() && !tx.pending());
        // Revoked after it was framed and part of an FPDU left: the rest of that FPDU goes out
        // as zeros, nothing after it.
        let mr = region();
        let mut tx = Tx::new(false, 128);
        tx.push(msg(&mr, true));
        tx.cut();
        assert!(tx.ready.len() > 1);
        tx.written = 20;
        mr.region().revoke();
        assert!(!tx.flush(&mut a, usize::MAX, |_| {}).unwrap());
        assert!(tx.revoked());
        tx.abort_queued();
        assert_eq!(tx.ready.len(), 1);
        let rest = sent(tx);
        assert_eq!(rest.len(), fpdu_len(128) - 20);
        assert!(!rest.contains(&0xAA));
    }

    #[test]
    fn framing_stops_at_about_ready_bytes_and_counts_what_is_ready() {
        let ctx = Context::soft();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd
            .register(AlignedBuf::new(1 << 20).unwrap(), Access::LOCAL_WRITE)
            .unwrap();
        // Three 1 MiB Writes cut into 32 KiB-ish FPDUs: the framing stops once 1 MiB is ready,
        // well before BATCH FPDUs.
        let mut tx = Tx::new(true, 32_000);
        for i in 0..3 {
            tx.push(TxMsg {
                hdr: Header::tagged(Opcode::Write, 9, 0, true),
                src: Src::Mem {
                    region: Arc::clone(mr.region()),
                    offset: 0,
                    revocable: false,
                },
                len: 1 << 20,
                on_sent: OnSent::Complete(i),
            });
        }
        tx.cut();
        let sum: usize = tx.ready.iter().map(Fpdu::total).sum();
        assert_eq!(tx.ready_bytes, sum);
        assert!(tx.ready.len() < BATCH, "{} FPDUs", tx.ready.len());
        assert!(
            (READY_BYTES..READY_BYTES + 32_100).contains(&sum),
            "{sum} bytes ready"
        );
        // Everything still goes out, in order, and the count returns to zero.
        let (mut a, mut b) = socket_pair();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            b.read_to_end(&mut got).unwrap();
            got.len()
        });
        let mut done = Vec::new();
        a.set_nonblocking(true).unwrap();
        while tx.pending() {
            tx.flush(&mut a, usize::MAX, |o| done.push(o)).unwrap();
        }
        drop(a);
        assert_eq!(
            done,
            [
                OnSent::Complete(0),
                OnSent::Complete(1),
                OnSent::Complete(2)
            ]
        );
        assert_eq!(tx.ready_bytes, 0);
        // Per message: 32 full FPDUs (ULPDU 32000: 14 header + 31986 payload) and the rest.
        use crate::fabric::soft::wire::fpdu_len;
        let rest = (1 << 20) - 32 * 31_986;
        let per_message = 32 * fpdu_len(32_000) + fpdu_len(14 + rest);
        assert_eq!(reader.join().unwrap(), 3 * per_message);
    }

    #[test]
    fn a_flush_stops_after_its_budget_and_the_next_goes_on() {
        let ctx = Context::soft();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd
            .register(AlignedBuf::new(1 << 20).unwrap(), Access::LOCAL_WRITE)
            .unwrap();
        let mut tx = Tx::new(false, 16 * 1024);
        tx.push(TxMsg {
            hdr: Header::tagged(Opcode::Write, 9, 0, true),
            src: Src::Mem {
                region: Arc::clone(mr.region()),
                offset: 0,
                revocable: false,
            },
            len: 1 << 20,
            on_sent: OnSent::Complete(1),
        });
        let (mut a, mut b) = socket_pair();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            b.read_to_end(&mut got).unwrap();
            got.len()
        });
        // Each call writes at most its budget, then returns with the rest still queued.
        let mut done = Vec::new();
        let mut calls = 0;
        a.set_nonblocking(true).unwrap();
        while tx.pending() {
            tx.flush(&mut a, 64 * 1024, |o| done.push(o)).unwrap();
            calls += 1;
        }
        drop(a);
        assert!(calls >= 16, "a 1 MiB message in {calls} calls of 64 KiB");
        assert_eq!(done, [OnSent::Complete(1)]);
        assert!(reader.join().unwrap() > 1 << 20);
    }

    #[test]
    fn a_pass_is_split_between_the_busy() {
        assert_eq!(quantum(0), TURN_BYTES);
        assert_eq!(quantum(1), TURN_BYTES);
        assert_eq!(quantum(4), TURN_BYTES / 4);
        assert_eq!(quantum(8), TURN_BYTES / 8);
        assert_eq!(quantum(48), MIN_QUANTUM.max(TURN_BYTES / 48));
        assert_eq!(quantum(10_000), MIN_QUANTUM);
    }
}
