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
//! here). Once the region it reads from is revoked (`MemoryRegion::revoke`; a deregistration
//! alone lets it finish), no byte of it leaves: before each `writev` the FPDUs it would carry
//! are checked, and [`Tx::revoked`] tells the engine to terminate the stream instead, or, if
//! the FPDU partly written is one of them, to end the connection there ([`Tx::cut_short`]).
//! What the kernel's socket buffer already holds was read before the revocation. A region
//! over a file mapping a page of which the kernel could not give back counts as revoked
//! (`crate::sigbus`), found by the CRC's read of it or, with CRC off, after the `writev`'s
//! EFAULT. A deregistration on another thread than the one that drives
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

use crate::fabric::memory::Region;
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

    /// After a `writev` failed with EFAULT: whether its payload is a Read Response's from a
    /// page of a file mapping that the kernel cannot give back ([`Region::probe`]).
    fn unreadable(&self) -> bool {
        match &self.payload {
            Payload::Mem {
                slice,
                keep,
                revocable: true,
            } => keep.probe(slice.as_ptr() as usize - keep.addr() as usize, slice.len()),
            _ => false,
        }
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
    /// A message waiting here reads from a region revoked since it was queued: nothing
    /// more is written until the engine terminates the stream ([`Tx::revoked`]).
    revoked: bool,
    /// The FPDU partly written read from a revoked region: everything was dropped, nothing is
    /// written or queued any more ([`Tx::cut_short`]).
    cut_short: bool,
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
            cut_short: false,
            cfg: TxConfig::new(crc, max).expect("max ULPDU clamped to the wire's limits"),
        }
    }

    pub(crate) fn push(&mut self, m: TxMsg) {
        if self.cut_short {
            // Not a byte more: the stream ends in the middle of an FPDU.
            return;
        }
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
    /// reads from a region revoked since: the stream must be terminated
    /// ([`abort_queued`](Self::abort_queued) drops it), or, once it is, the revoked bytes
    /// dropped ([`drop_revoked`](Self::drop_revoked)). If the FPDU partly written is one of
    /// them ([`partial_revoked`](Self::partial_revoked)), either ends the stream there
    /// ([`cut_short`](Self::cut_short)).
    pub(crate) fn revoked(&self) -> bool {
        self.revoked
    }

    /// Whether the FPDU partly written reads from a revoked region: its rest can be neither
    /// sent nor replaced, so no Terminate can follow it.
    pub(crate) fn partial_revoked(&self) -> bool {
        self.written > 0 && self.ready.front().is_some_and(Fpdu::revoked)
    }

    /// Whether an FPDU was cut short by a revocation: everything was dropped, and the
    /// connection must be closed without another byte (the peer sees its stream end in the
    /// middle of that FPDU, a connection loss). Zeros for the rest would keep the stream
    /// framed, but with CRC off nothing tells the peer they are not the data: an FPDU with the
    /// L bit would complete its Read as a success with a zero tail.
    pub(crate) fn cut_short(&self) -> bool {
        self.cut_short
    }

    /// Whether anything waits to be written.
    pub(crate) fn pending(&self) -> bool {
        !self.ready.is_empty() || !self.queue.is_empty()
    }

    /// Drops every message not started, keeping a partly written FPDU so that the stream stays
    /// framed (used before a Terminate); if that FPDU's region was revoked, everything goes
    /// ([`Tx::cut_short`]).
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
    /// [`Tx::revoked`]); if the FPDU partly written is one of them, drops everything and
    /// writes nothing more ([`Tx::cut_short`]).
    pub(crate) fn drop_revoked(&mut self) {
        if self.partial_revoked() {
            self.ready.clear();
            self.queue.clear();
            self.front = None;
            self.written = 0;
            self.ready_bytes = 0;
            self.revoked = false;
            self.cut_short = true;
            return;
        }
        self.ready.retain(|f| !f.revoked());
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
                    // The kernel met a page of a Read Response's region that it cannot give
                    // back (a media error, a truncated file): revoked, as the CRC's own read
                    // of it would have found (crate::sigbus), instead of a connection lost
                    // that the peer's next Read of the block would meet again.
                    e if e.raw_os_error() == Some(libc::EFAULT)
                        && self.ready.iter().any(Fpdu::unreadable) =>
                    {
                        self.revoked = true;
                        return Ok(false);
                    }
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
mod tests;
