//! The transmit side of a connection: a FIFO of outbound RDMAP messages, cut into FPDUs and
//! written with `writev` straight from registered memory (no copy of the payload).
//!
//! Messages go out whole and in order: requests as posted, responses in the order their
//! requests came in, which is what RC ordering asks of a single TCP stream.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Write};
use std::net::TcpStream;
use std::sync::Arc;

use crate::fabric::mr::Region;
use crate::fabric::soft::wire::{self, Header};

/// Where a message's payload comes from.
pub(crate) enum Src {
    /// `len` bytes of registered memory at `offset` (kept alive by the Arc).
    Mem { region: Arc<Region>, offset: usize },
    /// A control body, at most [`INLINE_MAX`] bytes.
    Inline(Vec<u8>),
}

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

const INLINE_MAX: usize = 64;
/// Length + longest header + longest inline body.
const HEAD_MAX: usize = 2 + wire::ddp::UNTAGGED_HDR_LEN + INLINE_MAX;
/// FPDUs gathered into one writev.
const BATCH: usize = 32;

/// One FPDU ready to go: head (MPA length, DDP/RDMAP header, inline body), payload from
/// memory, trailer (pad + CRC).
struct Fpdu {
    head: [u8; HEAD_MAX],
    head_len: u8,
    payload: *const u8,
    payload_len: usize,
    trailer: [u8; 7],
    trailer_len: u8,
    /// Keeps the payload's memory alive while the FPDU waits.
    _keep: Option<Arc<Region>>,
    /// Set on a message's last FPDU.
    on_sent: OnSent,
}

// SAFETY: `payload` points into memory kept alive by `_keep` (or is dangling with length 0);
// it is only read, and only by the thread that owns the connection at the time.
unsafe impl Send for Fpdu {}

impl Fpdu {
    fn total(&self) -> usize {
        self.head_len as usize + self.payload_len + self.trailer_len as usize
    }
}

pub(crate) struct Tx {
    queue: VecDeque<TxMsg>,
    /// Payload bytes of the queue's front message already cut into FPDUs.
    front_cut: usize,
    ready: VecDeque<Fpdu>,
    /// Bytes of `ready`'s front FPDU already written.
    written: usize,
    crc: bool,
    max_ulpdu: usize,
}

impl Tx {
    pub(crate) fn new(crc: bool, max_ulpdu: usize) -> Tx {
        Tx {
            queue: VecDeque::new(),
            front_cut: 0,
            ready: VecDeque::new(),
            written: 0,
            crc,
            max_ulpdu,
        }
    }

    pub(crate) fn push(&mut self, m: TxMsg) {
        self.queue.push_back(m);
    }

    /// Whether anything waits to be written.
    pub(crate) fn pending(&self) -> bool {
        !self.ready.is_empty() || !self.queue.is_empty()
    }

    /// Drops every message not started, keeping a partly written FPDU so that the stream stays
    /// framed (used before a Terminate).
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
        self.front_cut = 0;
    }

    fn cut(&mut self) {
        while self.ready.len() < BATCH {
            let Some(m) = self.queue.front() else { return };
            let hlen = m.hdr.len();
            let room = self.max_ulpdu.saturating_sub(hlen).max(1);
            let chunk = match m.src {
                Src::Inline(_) => m.len,
                _ => (m.len - self.front_cut).min(room),
            };
            let last = self.front_cut + chunk == m.len;
            let mut hdr = m.hdr.advanced(self.front_cut);
            hdr.last = last;
            let mut head = [0u8; HEAD_MAX];
            let ulpdu_len = hlen + chunk;
            head[..2].copy_from_slice(&(ulpdu_len as u16).to_be_bytes());
            let mut head_len = 2 + hdr.encode_into(&mut head[2..]);
            let (payload, payload_len, keep) = match &m.src {
                Src::Inline(b) => {
                    head[head_len..head_len + b.len()].copy_from_slice(b);
                    head_len += b.len();
                    (std::ptr::null(), 0, None)
                }
                Src::Mem { region, offset } => {
                    let p = region.addr().wrapping_add(offset + self.front_cut);
                    (p as *const u8, chunk, Some(Arc::clone(region)))
                }
            };
            let pad = wire::pad_len(ulpdu_len);
            let mut trailer = [0u8; 7];
            if self.crc {
                let mut c = wire::crc32c(&head[..head_len]);
                if payload_len > 0 {
                    // SAFETY: payload is `payload_len` bytes of registered memory kept alive
                    // by `keep`; reading it while a peer may write it yields some bytes, which
                    // is the RDMA contract for memory in flight.
                    let s = unsafe { std::slice::from_raw_parts(payload, payload_len) };
                    c = wire::crc32c_append(c, s);
                }
                c = wire::crc32c_append(c, &[0u8; 3][..pad]);
                trailer[pad..pad + 4].copy_from_slice(&c.to_le_bytes());
            }
            let on_sent = if last { m.on_sent } else { OnSent::Nothing };
            self.ready.push_back(Fpdu {
                head,
                head_len: head_len as u8,
                payload,
                payload_len,
                trailer,
                trailer_len: (pad + 4) as u8,
                _keep: keep,
                on_sent,
            });
            if last {
                self.queue.pop_front();
                self.front_cut = 0;
            } else {
                self.front_cut += chunk;
            }
        }
    }

    /// Writes as much as the socket takes. Calls `sent` for each message fully written.
    /// Returns Ok(true) if everything was written, Ok(false) if the socket is full.
    pub(crate) fn flush(
        &mut self,
        sock: &mut TcpStream,
        mut sent: impl FnMut(OnSent),
    ) -> io::Result<bool> {
        loop {
            self.cut();
            if self.ready.is_empty() {
                return Ok(true);
            }
            let mut iov = [IoSlice::new(&[]); BATCH * 3];
            let mut iovcnt = 0;
            let mut skip = self.written;
            for f in &self.ready {
                // SAFETY: as in `cut`: the payload memory is kept alive by the FPDU.
                let payload = unsafe {
                    if f.payload_len == 0 {
                        &[][..]
                    } else {
                        std::slice::from_raw_parts(f.payload, f.payload_len)
                    }
                };
                for part in [
                    &f.head[..f.head_len as usize],
                    payload,
                    &f.trailer[..f.trailer_len as usize],
                ] {
                    if skip >= part.len() {
                        skip -= part.len();
                        continue;
                    }
                    iov[iovcnt] = IoSlice::new(&part[skip..]);
                    iovcnt += 1;
                    skip = 0;
                }
            }
            let n = match sock.write_vectored(&iov[..iovcnt]) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
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
                if on != OnSent::Nothing {
                    sent(on);
                }
            }
        }
    }
}
