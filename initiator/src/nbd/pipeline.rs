//! A client's READ and WRITE requests on the queue as started requests: each goes out as soon
//! as it is read (in pieces of at most the queue's chunk) and is answered as soon as its last
//! piece completed, in whatever order they complete, so that the queue stays as full as the
//! client keeps it (fio's nbd engine at depth 16 has 16 requests in flight, not a batch of
//! whatever had arrived, then none while the batch is answered).
//!
//! Order: the pieces are posted on one queue pair in the order the requests came, so a READ
//! sees every WRITE that came before it and overlapping WRITEs land in order, as before.
//!
//! A lost connection the queue recovered from voids the READ pieces that had not completed:
//! they are started again (once); WRITE pieces are re-issued by the queue and complete as
//! usual. A queue that gave up fails every request in flight.

use std::os::fd::BorrowedFd;

use super::proto::{simple_reply_header, EINVAL, EIO, ENOSPC, EPERM, SIMPLE_REPLY_LEN};
use crate::idmap::IdMap;
use crate::writebuf::{Data, WriteBuf};
use crate::{Completed, Error, Namespace, Ticket};

/// READs of at least this many bytes are read straight into their reply's buffer (a
/// [`WriteBuf`] the queue reads into), not into the queue's slots and copied from there: the
/// copy was 20.7% of the export's samples on 1 MiB reads at depth 16 (docs/benchmarks.md,
/// "Large READs read in place").
const READ_IN_PLACE_MIN: usize = 256 << 10;
/// Reply buffers of large READs kept for reuse take at most this many bytes.
const SPARE_BUF_BYTES: usize = 64 << 20;
/// Copied replies ([`Reply::Vec`]) kept for reuse take at most this many bytes (at most 64 of
/// them, each at most 4 MiB) ...
const SPARE_VEC_BYTES: usize = 64 << 20;
/// ... and when they take more than this, they are given back after the client's quiet spell
/// as the large READs' buffers are (a few small ones are kept for good: watching for the quiet
/// spell costs each request's read two system calls).
const SPARE_VEC_KEPT: usize = 1 << 20;

/// The NBD error for a library error.
pub(crate) fn errno(e: &Error, write: bool) -> u32 {
    match e {
        Error::OutOfRange { .. } if write => ENOSPC,
        Error::OutOfRange { .. } | Error::Misaligned { .. } | Error::InvalidArgument(_) => EINVAL,
        Error::ReadOnly { .. } => EPERM,
        _ => EIO,
    }
}

/// A READ or WRITE in flight.
#[derive(Debug)]
struct Request {
    handle: u64,
    /// Pieces not completed yet.
    left: usize,
    /// The first error among its pieces (0: none).
    err: u32,
    /// A READ's reply (header and data), filled as its pieces complete; None for a WRITE.
    reply: Option<Reply>,
}

/// A READ's reply: its header, then its data.
#[derive(Debug)]
pub(crate) enum Reply {
    /// Copied out of the queue's slots as the pieces complete.
    Vec(Vec<u8>),
    /// The first `len` bytes of a buffer the pieces were read into ([`READ_IN_PLACE_MIN`]).
    Buf { buf: WriteBuf, len: usize },
}

impl AsRef<[u8]> for Reply {
    fn as_ref(&self) -> &[u8] {
        match self {
            Reply::Vec(v) => v,
            // An answer's buffer is held by no queue (`piece_done` copies it out otherwise),
            // and none starts anything on it once it left its request.
            Reply::Buf { buf, len } => buf.bytes().map_or(&[][..], |b| &b[..*len]),
        }
    }
}

/// A started piece of a request.
#[derive(Debug, Clone, Copy)]
struct Piece {
    request: u64,
    /// Namespace offset.
    offset: u64,
    /// Offset in the request's data.
    at: usize,
    len: usize,
    read: bool,
    /// Started again after a lost connection voided it.
    again: bool,
}

/// An answered request: its reply, to send.
#[derive(Debug)]
pub(crate) enum Answer {
    /// A reply header alone (a WRITE, or a failed READ).
    Header([u8; SIMPLE_REPLY_LEN]),
    /// A READ's reply with its data (give the buffer back with [`Pipeline::recycle`]).
    Data(Reply),
}

/// The started requests of one client.
#[derive(Debug, Default)]
pub(crate) struct Pipeline {
    requests: IdMap<u64, Request>,
    pieces: IdMap<Ticket, Piece>,
    next: u64,
    /// Reply buffers to reuse ...
    spare: Vec<Vec<u8>>,
    /// ... and their capacities' sum.
    spare_bytes: usize,
    /// Buffers of large READs' replies to reuse.
    spare_bufs: Vec<WriteBuf>,
    done: Vec<Completed>,
    /// READ pieces started again after a lost connection, by their first ticket: if that one
    /// still completes (it had, unreported, when the connection went), its bytes are taken
    /// and dropped, to free its slot.
    stale: IdMap<Ticket, usize>,
    scratch: Vec<u8>,
    /// Answered requests not sent yet.
    pub(crate) answers: Vec<Answer>,
    /// WRITEs answered since the last look ([`Pipeline::take_written`]).
    written: usize,
    /// WRITEs answered with an error since the last look ([`Pipeline::take_write_errors`]).
    write_errors: usize,
    /// Large READs are read into buffers of their own ([`READ_IN_PLACE_MIN`];
    /// `Shared::in_place`).
    in_place: bool,
}

impl Pipeline {
    /// The pipeline of a client; `in_place`: large READs are read into buffers of their own.
    pub(crate) fn new(in_place: bool) -> Pipeline {
        Pipeline {
            in_place,
            ..Pipeline::default()
        }
    }

    /// Requests in flight.
    pub(crate) fn len(&self) -> usize {
        self.requests.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// How many WRITEs were answered (successfully) since the last call.
    pub(crate) fn take_written(&mut self) -> usize {
        std::mem::take(&mut self.written)
    }

    /// How many WRITEs were answered with an error since the last call.
    pub(crate) fn take_write_errors(&mut self) -> usize {
        std::mem::take(&mut self.write_errors)
    }

    /// A reply buffer back for reuse.
    pub(crate) fn recycle(&mut self, reply: Reply) {
        match reply {
            Reply::Vec(buf) => {
                let c = buf.capacity();
                if self.spare.len() < 64 && c <= 4 << 20 && self.spare_bytes + c <= SPARE_VEC_BYTES
                {
                    self.spare_bytes += c;
                    self.spare.push(buf);
                }
            }
            Reply::Buf { buf, .. } => {
                let kept: usize = self.spare_bufs.iter().map(WriteBuf::len).sum();
                if kept + buf.len() <= SPARE_BUF_BYTES {
                    self.spare_bufs.push(buf);
                }
            }
        }
    }

    /// Whether buffers of large READs' replies are kept for reuse.
    pub(crate) fn keeps_bufs(&self) -> bool {
        !self.spare_bufs.is_empty() || self.spare_bytes > SPARE_VEC_KEPT
    }

    /// Gives the kept buffers of large READs' replies back (a quiet client).
    pub(crate) fn release_bufs(&mut self) {
        self.spare_bufs = Vec::new();
        if self.spare_bytes > SPARE_VEC_KEPT {
            self.spare = Vec::new();
            self.spare_bytes = 0;
        }
    }

    /// A copied reply's buffer to reuse, or a new one.
    fn spare_vec(&mut self) -> Vec<u8> {
        let v = self.spare.pop().unwrap_or_default();
        self.spare_bytes -= v.capacity();
        v
    }

    /// A reply for a READ of `len` bytes answered with `handle`, its header in place.
    fn reply(&mut self, handle: u64, len: usize) -> Reply {
        let header = simple_reply_header(0, handle);
        let need = SIMPLE_REPLY_LEN + len;
        if self.in_place && len >= READ_IN_PLACE_MIN {
            let spare = self
                .spare_bufs
                .iter()
                .position(|b| b.holds() == 0 && b.len() >= need);
            let buf = match spare {
                Some(i) => Some(self.spare_bufs.swap_remove(i)),
                None => WriteBuf::new(need.next_power_of_two()).ok(),
            };
            if let Some(mut buf) = buf {
                if let Some(b) = buf.bytes_mut() {
                    b[..SIMPLE_REPLY_LEN].copy_from_slice(&header);
                    return Reply::Buf { buf, len: need };
                }
            }
        }
        // A reused buffer is not zeroed first (a pass over every byte of a 1 MiB READ): the
        // pieces overwrite all of its data, and a failed READ sends the header alone.
        let mut reply = self.spare_vec();
        reply.resize(need, 0);
        reply[..SIMPLE_REPLY_LEN].copy_from_slice(&header);
        Reply::Vec(reply)
    }

    /// Starts a READ of `len` bytes at `offset` (checked by the caller), answered with
    /// `handle`. Errors fail the request or, after a lost connection, restart what it voided:
    /// the error is returned for the caller to log and to see whether the queue gave up.
    pub(crate) fn start_read(
        &mut self,
        ns: &mut Namespace<'_>,
        chunk: usize,
        handle: u64,
        offset: u64,
        len: usize,
    ) -> Result<(), Error> {
        let reply = self.reply(handle, len);
        self.start(ns, chunk, handle, offset, len, Some(reply), None)
    }

    /// Starts a WRITE of `data` at `offset` (checked by the caller), answered with `handle`.
    /// Copied bytes are in the queue's slots when this returns; a write buffer's are held by
    /// the queue until they are durable. Errors as for [`start_read`](Self::start_read).
    pub(crate) fn start_write(
        &mut self,
        ns: &mut Namespace<'_>,
        chunk: usize,
        handle: u64,
        offset: u64,
        data: Data<'_>,
    ) -> Result<(), Error> {
        self.start(ns, chunk, handle, offset, data.len(), None, Some(data))
    }

    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        ns: &mut Namespace<'_>,
        chunk: usize,
        handle: u64,
        offset: u64,
        len: usize,
        reply: Option<Reply>,
        data: Option<Data<'_>>,
    ) -> Result<(), Error> {
        let id = self.next;
        self.next += 1;
        let read = reply.is_some();
        let pieces = len.div_ceil(chunk).max(1);
        self.requests.insert(
            id,
            Request {
                handle,
                left: pieces,
                err: 0,
                reply,
            },
        );
        let mut first_err = None;
        let depth = ns.depth();
        for i in 0..pieces {
            // No more pieces in flight than the queue has slots for: a READ's completed pieces
            // keep their slots until taken, which only `complete` does.
            while self.pieces.len() >= depth {
                if let Err(e) = self.complete(ns) {
                    first_err.get_or_insert(e);
                }
            }
            let at = i * chunk;
            let n = chunk.min(len - at);
            let p = Piece {
                request: id,
                offset: offset + at as u64,
                at,
                len: n,
                read,
                again: false,
            };
            // A READ in flight over these bytes must not see them: the WRITE waits for it
            // (the target reads a READ's bytes when it answers).
            let fence = data.is_some()
                && self.pieces.values().any(|q| {
                    q.read && q.offset < p.offset + n as u64 && p.offset < q.offset + q.len as u64
                });
            let start = |me: &mut Self, ns: &mut Namespace<'_>| match data {
                Some(d) => ns.start_write_data(p.offset, d.slice(at, n), fence),
                None => me.start_read_piece(ns, &p),
            };
            // A lost connection (the queue reconnected): what it voided is started again,
            // and so is this piece, once.
            let r = match start(self, ns) {
                Err(e) if e.is_connection_loss() => {
                    self.on_error(ns, &e);
                    first_err.get_or_insert(e);
                    start(self, ns)
                }
                r => r,
            };
            match r {
                Ok(t) => {
                    self.pieces.insert(t, p);
                }
                Err(e) => {
                    self.piece_done(p, errno(&e, !read));
                    self.on_error(ns, &e);
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Waits for at least one started piece to complete and answers the requests it
    /// finished. An error is returned after it was dealt with (see the module docs), for the
    /// caller to log and to see whether the queue gave up.
    pub(crate) fn complete(&mut self, ns: &mut Namespace<'_>) -> Result<(), Error> {
        self.complete_or(ns, None).map(|_| ())
    }

    /// [`complete`](Self::complete), but it also returns, true and having answered nothing,
    /// as soon as `input` (the client's socket) is readable: the client's next request is
    /// taken in while its earlier ones are in flight.
    pub(crate) fn complete_or(
        &mut self,
        ns: &mut Namespace<'_>,
        input: Option<BorrowedFd<'_>>,
    ) -> Result<bool, Error> {
        let mut done = std::mem::take(&mut self.done);
        let r = match input {
            Some(fd) => ns.wait_started_or(&mut done, fd),
            None => ns.wait_started(&mut done).map(|()| false),
        };
        if matches!(r, Ok(true)) {
            self.done = done;
            return Ok(true);
        }
        if r.is_ok() && done.is_empty() && !self.pieces.is_empty() {
            // The queue has nothing outstanding that these wait for (a reconnect dropped them
            // without a report): they will not complete.
            self.fail_all(super::proto::EIO);
        }
        for c in done.drain(..) {
            match c {
                Completed::Write(t) => {
                    if let Some(p) = self.pieces.remove(&t) {
                        self.piece_done(p, 0);
                    }
                }
                Completed::Read(t) => self.read_done(ns, t),
            }
        }
        self.done = done;
        if let Err(e) = &r {
            self.on_error(ns, e);
        }
        r.map(|_| false)
    }

    /// Starts READ piece `p`: into its reply's buffer, or into a slot of the queue.
    fn start_read_piece(&mut self, ns: &mut Namespace<'_>, p: &Piece) -> Result<Ticket, Error> {
        let reply = self
            .requests
            .get_mut(&p.request)
            .and_then(|r| r.reply.as_mut());
        match reply {
            Some(Reply::Buf { buf, .. }) => {
                let at = SIMPLE_REPLY_LEN + p.at;
                ns.start_read_into(p.offset, buf, at..at + p.len)
            }
            _ => ns.start_read(p.offset, p.len),
        }
    }

    fn read_done(&mut self, ns: &mut Namespace<'_>, t: Ticket) {
        let Some(p) = self.pieces.remove(&t) else {
            if let Some(len) = self.stale.remove(&t) {
                self.scratch.resize(len, 0);
                let _ = ns.take_read(t, &mut self.scratch);
            }
            return;
        };
        let err = match self
            .requests
            .get_mut(&p.request)
            .and_then(|r| r.reply.as_mut())
        {
            Some(Reply::Vec(reply)) => {
                let at = SIMPLE_REPLY_LEN + p.at;
                match ns.take_read(t, &mut reply[at..at + p.len]) {
                    Ok(()) => 0,
                    Err(e) => errno(&e, false),
                }
            }
            Some(Reply::Buf { .. }) => match ns.finish_read(t) {
                Ok(()) => 0,
                Err(e) => errno(&e, false),
            },
            None => 0,
        };
        self.piece_done(p, err);
    }

    fn piece_done(&mut self, p: Piece, err: u32) {
        let Some(r) = self.requests.get_mut(&p.request) else {
            return;
        };
        if r.err == 0 {
            r.err = err;
        }
        r.left -= 1;
        if r.left > 0 {
            return;
        }
        let Some(r) = self.requests.remove(&p.request) else {
            return;
        };
        match r.reply {
            Some(Reply::Buf { buf, len }) if r.err == 0 && buf.holds() != 0 => {
                // A piece voided by a lost connection still holds the buffer (its slot is
                // freed when its completion comes): the bytes are copied out.
                let mut v = self.spare_vec();
                v.resize(len, 0);
                let e = match buf.copy_out(0, &mut v) {
                    Ok(()) => None,
                    Err(_) => Some(EIO),
                };
                self.recycle(Reply::Buf { buf, len });
                match e {
                    None => self.answers.push(Answer::Data(Reply::Vec(v))),
                    Some(e) => {
                        self.recycle(Reply::Vec(v));
                        self.answers
                            .push(Answer::Header(simple_reply_header(e, r.handle)));
                    }
                }
            }
            Some(reply) if r.err == 0 => self.answers.push(Answer::Data(reply)),
            reply => {
                if let Some(b) = reply {
                    self.recycle(b);
                } else if r.err == 0 {
                    self.written += 1;
                } else {
                    self.write_errors += 1;
                }
                self.answers
                    .push(Answer::Header(simple_reply_header(r.err, r.handle)));
            }
        }
    }

    /// After an error of the queue: a queue that gave up fails everything in flight; a lost
    /// connection it recovered from voided the READ pieces that had not completed, which are
    /// started again (once; a second loss fails them). Other errors concern one piece only.
    fn on_error(&mut self, ns: &mut Namespace<'_>, e: &Error) {
        if matches!(e, Error::Broken | Error::ReconnectFailed { .. }) {
            self.fail_all(errno(e, true));
            return;
        }
        if !e.is_connection_loss() {
            return;
        }
        let void: Vec<(Ticket, Piece)> = self
            .pieces
            .iter()
            .filter(|(_, p)| p.read)
            .map(|(t, p)| (*t, *p))
            .collect();
        for (t, p) in void {
            self.pieces.remove(&t);
            self.stale.insert(t, p.len);
            if p.again {
                self.piece_done(p, errno(e, false));
                continue;
            }
            match self.start_read_piece(ns, &p) {
                Ok(t2) => {
                    self.pieces.insert(t2, Piece { again: true, ..p });
                }
                Err(e2) => self.piece_done(p, errno(&e2, false)),
            }
        }
    }

    /// Fails every request in flight with `err` (the queue is gone: nothing will complete).
    pub(crate) fn fail_all(&mut self, err: u32) {
        self.stale.clear();
        for (_, p) in std::mem::take(&mut self.pieces) {
            self.piece_done(p, err);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(p: &Pipeline) -> usize {
        p.spare.iter().map(Vec::capacity).sum::<usize>()
            + p.spare_bufs.iter().map(WriteBuf::len).sum::<usize>()
    }

    /// Copied replies of up to 4 MiB (every READ on `rdma://`) are kept within a byte budget,
    /// and given back after a quiet spell. (64 of 4 MiB stayed with an idle client for good:
    /// 256 MiB, where the docs promise it holds no more than a fresh one.)
    #[test]
    fn copied_replies_kept_for_reuse_are_bounded_and_given_back() {
        let mut p = Pipeline::new(false);
        for _ in 0..64 {
            p.recycle(Reply::Vec(Vec::with_capacity(4 << 20)));
        }
        assert!(kept(&p) <= SPARE_VEC_BYTES, "{} bytes kept", kept(&p));
        assert!(p.keeps_bufs());
        p.release_bufs();
        assert_eq!(kept(&p), 0);
        assert!(!p.keeps_bufs());
        // A few small ones stay (no quiet spell watched for them), and reuse keeps the count.
        for _ in 0..8 {
            p.recycle(Reply::Vec(Vec::with_capacity(4096)));
        }
        assert!(!p.keeps_bufs());
        let Reply::Vec(v) = p.reply(1, 100) else {
            panic!("a copied reply");
        };
        assert_eq!(p.spare_bytes, 7 * 4096);
        p.recycle(Reply::Vec(v));
        assert_eq!(p.spare_bytes, kept(&p));
        p.release_bufs();
        assert_eq!(kept(&p), 8 * 4096);
    }
}
