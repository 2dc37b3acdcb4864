//! Large WRITEs received in place: the payload goes from the client's socket straight into a
//! payload buffer (a [`WriteBuf`]) that the queue writes from, instead of into the receive
//! buffer and from there into the queue's slots.
//!
//! Why: the copy into the slots was 15% of the export's samples on 1 MiB writes at depth 16;
//! received in place, 1 MiB writes went 1.08x-1.12x faster at depth 1, 4 and 16
//! (docs/benchmarks.md, "Large WRITEs received in place").
//!
//! How: when the request at the front of the receive buffer is a plain (non-FUA) WRITE of at
//! least [`DIRECT_MIN`] bytes that passed its checks and whose payload has not all come, the
//! part that came is copied into a free payload buffer and the rest is read into it from the
//! socket; once all of it is there the WRITE is executed as any other, its data taken from the
//! buffer. The queue holds the buffer until the write is durable (a reconnect re-issues it from
//! there), so a buffer is taken again only once no queue holds it. After such a WRITE the next
//! read takes the next request's header alone, so that a run of large WRITEs passes no payload
//! through the receive buffer; and reading ahead stops at the header of such a WRITE of 1 MiB
//! or more ([`Client::stops_for_fill`]), so that a client sending faster than the export
//! executes does not have the payload read into the receive buffer first. When no buffer is
//! free and no more may be made ([`DIRECT_BYTES`]), the WRITE goes the copying way.

use std::io;

use super::super::proto::{Request, CMD_WRITE, REQUEST_LEN};
use super::super::ConnError;
use super::held::Fill;
use super::parse::{classify, incomplete, Action, Item};
use super::Client;
use crate::writebuf::WriteBuf;

/// WRITEs of at least this many bytes are received in place (one receive chunk: smaller ones
/// come many to a read, which the receive buffer does with one system call).
pub(super) const DIRECT_MIN: usize = 256 << 10;
/// Reading ahead stops at a WRITE received in place only from this many bytes
/// ([`Client::stops_for_fill`]): stopping at every one, 256 KiB WRITEs at depth 16 went 0.94x
/// as fast as read ahead in batches and copied, 1 MiB ones 1.04x-1.08x (docs/benchmarks.md,
/// "Reading ahead up to a large WRITE").
pub(super) const STOP_MIN: usize = 1 << 20;
/// The payload buffers of one connection take at most this many bytes (as much as a queue's
/// default replay memory, which bounds the writes it holds).
pub(super) const DIRECT_BYTES: usize = 64 << 20;

/// The rest of the room of `fill`'s payload in its buffer.
fn fill_room<'b>(
    fill: Option<&Fill>,
    bufs: &'b mut [WriteBuf],
) -> io::Result<Option<&'b mut [u8]>> {
    let Some(f) = fill else {
        return Ok(None);
    };
    match bufs[f.idx].bytes_mut() {
        Some(b) => Ok(Some(&mut b[f.got..f.len()])),
        // Nothing starts a write from a buffer before its payload is all there.
        None => Err(io::Error::other("a payload buffer being filled is held")),
    }
}

impl Client<'_> {
    /// Starts receiving the front request's payload in place, if it is a WRITE that goes that
    /// way (the module doc) and a payload buffer can be had. The caller found no complete
    /// request at the front of the receive buffer.
    pub(super) fn begin_fill(&mut self) -> bool {
        let b = self.buf.bytes();
        if b.len() < REQUEST_LEN {
            return false;
        }
        let Ok(req) = Request::parse(&b[..REQUEST_LEN]) else {
            return false;
        };
        if !self.fills(&req) {
            return false;
        }
        let len = req.len as usize;
        let Some(idx) = self.payload_buf(len) else {
            return false;
        };
        let Some(room) = self.bufs[idx].bytes_mut() else {
            return false;
        };
        let came = &self.buf.bytes()[REQUEST_LEN..];
        let got = came.len().min(len);
        room[..got].copy_from_slice(&came[..got]);
        self.buf.consume(REQUEST_LEN + got);
        self.fill = Some(Fill { req, idx, got });
        true
    }

    /// Whether `req` would be received in place at the front of the receive buffer with its
    /// payload not all come: a large plain WRITE that passes its checks, nothing being
    /// received in place now, and a payload buffer to be had.
    fn fills(&self, req: &Request) -> bool {
        let len = req.len as usize;
        self.shared.in_place
            && self.fill.is_none()
            && req.kind == CMD_WRITE
            && len >= DIRECT_MIN
            && classify(req, self.limits) == (Action::Write { fua: false })
            && (self.free_buf(len).is_some() || self.may_grow(len))
    }

    /// Whether the receive buffer ends in a WRITE of at least [`STOP_MIN`] bytes that
    /// [`Self::begin_fill`] will take once the requests before it are executed: its header in,
    /// its payload not all ([`Self::fills`]). Reading ahead stops there, so that the rest of
    /// the payload goes straight to its buffer rather than through the receive buffer (a
    /// client that sends fast would otherwise have every large WRITE copied). `scan` is where
    /// the walk over the buffer's request headers resumes ([`incomplete`]); the caller starts
    /// it at 0 and keeps it while the buffer only grows.
    pub(super) fn stops_for_fill(&self, scan: &mut usize) -> bool {
        // No walk where nothing is received in place (rdma://).
        self.shared.in_place
            && incomplete(self.buf.bytes(), scan)
                .is_some_and(|req| req.len as usize >= STOP_MIN && self.fills(&req))
    }

    /// A payload buffer of at least `len` bytes that no queue holds: a free one, or a new one
    /// while the connection's buffers stay within [`DIRECT_BYTES`].
    fn payload_buf(&mut self, len: usize) -> Option<usize> {
        if let Some(i) = self.free_buf(len) {
            return Some(i);
        }
        if !self.may_grow(len) {
            return None;
        }
        self.bufs.push(WriteBuf::new(len.next_power_of_two()).ok()?);
        Some(self.bufs.len() - 1)
    }

    /// A payload buffer of at least `len` bytes that no queue holds.
    fn free_buf(&self, len: usize) -> Option<usize> {
        self.bufs
            .iter()
            .position(|b| b.holds() == 0 && b.len() >= len)
    }

    /// Whether a new payload buffer for `len` bytes keeps the connection's within
    /// [`DIRECT_BYTES`].
    fn may_grow(&self, len: usize) -> bool {
        let total: usize = self.bufs.iter().map(WriteBuf::len).sum();
        total + len.next_power_of_two() <= DIRECT_BYTES
    }

    /// Takes in what the socket has of the payload being received (without waiting).
    pub(super) fn fill_ahead(&mut self) -> Result<(), ConnError> {
        while !self.filled_all() {
            let Some(room) = fill_room(self.fill.as_ref(), &mut self.bufs)? else {
                break;
            };
            match self.stream.read_available(room)? {
                Some(0) => {
                    self.eof = true;
                    break;
                }
                Some(n) => self.fill_got(n),
                None => break,
            }
        }
        Ok(())
    }

    /// Waits for more of the payload being received (the socket's time-out applies).
    pub(super) fn fill_read(&mut self) -> io::Result<usize> {
        match fill_room(self.fill.as_ref(), &mut self.bufs)? {
            Some(room) => io::Read::read(&mut self.stream, room),
            None => Ok(0),
        }
    }

    pub(super) fn fill_got(&mut self, n: usize) {
        if let Some(f) = &mut self.fill {
            f.got += n;
        }
    }

    fn filled_all(&self) -> bool {
        self.fill.as_ref().is_none_or(|f| f.got == f.len())
    }

    /// The WRITE whose payload was received in place, once all of it came: executed as any
    /// other, its data taken from its buffer. The next read takes a header alone.
    pub(super) fn filled(&mut self) -> Option<Item> {
        if self.fill.is_none() || !self.filled_all() {
            return None;
        }
        let f = self.fill.take()?;
        self.header_next = true;
        self.stats.direct += 1;
        Some(Item {
            req: f.req,
            payload: 0..0,
            from: Some(f.idx),
        })
    }

    /// Bytes of the request being received in place that came (0: none is).
    pub(super) fn fill_came(&self) -> usize {
        self.fill.as_ref().map_or(0, |f| REQUEST_LEN + f.got)
    }

    /// Gives the payload buffers back (a quiet client; not while one is being filled). The
    /// queue keeps the memory of those it holds until it is done with them.
    pub(super) fn release_payload_bufs(&mut self) {
        if self.fill.is_none() {
            self.bufs.clear();
        }
    }
}
