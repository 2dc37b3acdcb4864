//! One client's transmission phase: read what the socket has, split it into requests, issue
//! the reads and writes of a run of requests as one library batch (up to the queue depth in
//! flight), answer them, repeat.
//!
//! Order: requests are executed in the order they came, in runs of one kind (reads, writes,
//! a flush); a run finishes before the next starts, and within a run the queue pair keeps the
//! order of the Writes. So overlapping writes land in request order, a read sees every write
//! that came before it, and a FLUSH covers every write answered before it arrived.

use std::io::{ErrorKind, Read, Write};
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::Instant;

use log::Level;

use super::proto::{
    self, simple_reply, simple_reply_header, Errno, Request, CMD_DISC, CMD_FLAG_FUA,
    CMD_FLAG_NO_HOLE, CMD_FLUSH, CMD_READ, CMD_WRITE, CMD_WRITE_ZEROES, EINVAL, EIO, ENOSPC, EPERM,
    REQUEST_LEN, SIMPLE_REPLY_LEN,
};
use super::shared::Shared;
use super::slots::{Slot, Source};
use super::stream::Stream;
use super::{ConnError, MAX_PAYLOAD};
use crate::Error;

/// Bytes read from the socket ahead of the requests being executed, at most.
const READ_AHEAD: usize = 64 << 20;
/// Payload bytes (reads and writes) of one batch, at most (one request may exceed it).
const BATCH_BYTES: u64 = 64 << 20;
/// Bytes asked of each socket read.
const READ_CHUNK: usize = 256 << 10;
/// Bytes of zeroes written per piece of a WRITE_ZEROES.
const ZERO_PIECE: usize = 1 << 20;

/// What a client did, for its log line.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Stats {
    /// Requests answered.
    pub(crate) requests: u64,
    /// The most requests issued together.
    pub(crate) max_batch: usize,
    /// FLUSH/FUA requests refused because the namespace is volatile.
    pub(crate) visible_only: u64,
}

/// What to do with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Read,
    Write {
        fua: bool,
    },
    Zeroes {
        fua: bool,
    },
    Flush,
    Disc,
    /// Answer with this error.
    Fail(u32),
}

/// The export's facts a request is checked against.
#[derive(Debug, Clone, Copy)]
struct Limits {
    size: u64,
    read_only: bool,
    /// 1, or the minimum block size when the client was told it.
    align: u64,
}

fn classify(r: &Request, l: Limits) -> Action {
    if r.flags & !(CMD_FLAG_FUA | CMD_FLAG_NO_HOLE) != 0
        || (r.flags & CMD_FLAG_NO_HOLE != 0 && r.kind != CMD_WRITE_ZEROES)
    {
        return Action::Fail(EINVAL);
    }
    let len = u64::from(r.len);
    let inside = r.offset.checked_add(len).is_some_and(|end| end <= l.size);
    let aligned = r.offset.is_multiple_of(l.align) && len.is_multiple_of(l.align);
    let fua = r.flags & CMD_FLAG_FUA != 0;
    let write = |a: Action, limit: u64| {
        if l.read_only {
            Action::Fail(EPERM)
        } else if len == 0 || len > limit || !aligned {
            Action::Fail(EINVAL)
        } else if !inside {
            Action::Fail(ENOSPC)
        } else {
            a
        }
    };
    match r.kind {
        CMD_READ if len == 0 || len > u64::from(MAX_PAYLOAD) || !inside || !aligned => {
            Action::Fail(EINVAL)
        }
        CMD_READ => Action::Read,
        CMD_WRITE => write(Action::Write { fua }, u64::from(MAX_PAYLOAD)),
        CMD_WRITE_ZEROES => write(Action::Zeroes { fua }, u64::MAX),
        CMD_FLUSH => Action::Flush,
        CMD_DISC => Action::Disc,
        // TRIM is not advertised (remote memory has nothing to deallocate), nor CACHE or
        // BLOCK_STATUS (no structured replies).
        _ => Action::Fail(EINVAL),
    }
}

/// A request and where its payload lies in the buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Item {
    req: Request,
    payload: Range<usize>,
}

/// The complete requests at the front of a buffer.
#[derive(Debug, Default)]
struct Split {
    items: Vec<Item>,
    /// Bytes they take.
    consumed: usize,
    /// Bytes (from `consumed`) the next request needs to be complete.
    want: usize,
    /// Input after which nothing can be parsed: the connection ends once the items before
    /// it are answered.
    fatal: Option<ConnError>,
}

fn split(buf: &[u8], max_items: usize) -> Split {
    let mut s = Split::default();
    let mut bytes = 0u64;
    while s.items.len() < max_items && bytes < BATCH_BYTES {
        let rest = &buf[s.consumed..];
        if rest.len() < REQUEST_LEN {
            s.want = REQUEST_LEN;
            break;
        }
        let req = match Request::parse(&rest[..REQUEST_LEN]) {
            Ok(r) => r,
            Err(e) => {
                s.fatal = Some(e.into());
                break;
            }
        };
        let at = s.consumed + REQUEST_LEN;
        if req.has_payload() && req.len > MAX_PAYLOAD {
            // Its payload cannot be skipped cheaply: answer EINVAL, then close.
            s.items.push(Item {
                req,
                payload: at..at,
            });
            s.consumed = at;
            s.fatal = Some(ConnError::Protocol(format!(
                "a WRITE of {} bytes (at most {MAX_PAYLOAD})",
                req.len
            )));
            break;
        }
        let plen = if req.has_payload() {
            req.len as usize
        } else {
            0
        };
        if rest.len() < REQUEST_LEN + plen {
            s.want = REQUEST_LEN + plen;
            break;
        }
        if matches!(req.kind, CMD_READ | CMD_WRITE) {
            bytes += u64::from(req.len);
        }
        s.items.push(Item {
            req,
            payload: at..at + plen,
        });
        s.consumed = at + plen;
    }
    s
}

/// The NBD error for a library error.
fn errno(e: &Error, write: bool) -> u32 {
    match e {
        Error::OutOfRange { .. } if write => ENOSPC,
        Error::OutOfRange { .. } | Error::Misaligned { .. } | Error::InvalidArgument(_) => EINVAL,
        Error::ReadOnly { .. } => EPERM,
        _ => EIO,
    }
}

/// Bytes received and not yet consumed: `data[start..end]`.
#[derive(Debug, Default)]
struct InBuf {
    data: Vec<u8>,
    start: usize,
    end: usize,
}

impl InBuf {
    fn bytes(&self) -> &[u8] {
        &self.data[self.start..self.end]
    }

    fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start >= self.end {
            self.start = 0;
            self.end = 0;
            if self.data.len() > 4 * READ_CHUNK {
                // A burst of large writes is over: give the memory back.
                self.data = Vec::new();
            }
        }
    }

    /// Free space for at least `n` more bytes.
    fn room(&mut self, n: usize) -> &mut [u8] {
        if self.data.len() - self.end < n {
            self.data.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if self.data.len() - self.end < n {
                self.data.resize(self.end + n, 0);
            }
        }
        &mut self.data[self.end..]
    }

    fn filled(&mut self, n: usize) {
        self.end += n;
    }
}

/// One client in the transmission phase.
pub(crate) struct Client<'a> {
    shared: &'a Shared,
    /// Busy while requests execute, idle while it waits: the accept loop may evict it then.
    slot: &'a Slot,
    /// For the log limits.
    source: Source,
    stream: Stream,
    limits: Limits,
    buf: InBuf,
    eof: bool,
    out: Vec<u8>,
    zeroes: Vec<u8>,
    stats: Stats,
    /// [`Shared::losses`] as of this client's start or last FLUSH.
    losses_seen: u64,
}

impl<'a> Client<'a> {
    /// `strict`: the client was told the block sizes, so misaligned requests fail. `slot` is
    /// the client's place in the export, idle (its handshake is over).
    pub(crate) fn new(
        shared: &'a Shared,
        stream: Stream,
        strict: bool,
        slot: &'a Slot,
        source: Source,
    ) -> Client<'a> {
        Client {
            slot,
            source,
            limits: Limits {
                size: shared.desc.size,
                read_only: shared.desc.read_only,
                align: if strict {
                    u64::from(shared.info.sizes.min)
                } else {
                    1
                },
            },
            shared,
            stream,
            buf: InBuf::default(),
            eof: false,
            out: Vec::new(),
            zeroes: Vec::new(),
            stats: Stats::default(),
            losses_seen: shared.losses.load(Ordering::SeqCst),
        }
    }

    pub(crate) fn stats(&self) -> Stats {
        self.stats
    }

    /// Serves requests until DISC, end of file (after answering every complete request), or
    /// an error.
    ///
    /// # Errors
    /// [`ConnError`]: the socket failed, a bad magic, an oversized WRITE, a client that went
    /// away in the middle of a request, no request within the idle time-out
    /// ([`ConnError::Idle`]), an eviction ([`ConnError::Evicted`]: nothing read after it is
    /// executed).
    pub(crate) fn run(&mut self) -> Result<(), ConnError> {
        loop {
            if !self.eof {
                self.read_ahead()?;
            }
            let s = split(self.buf.bytes(), self.shared.opts.max_batch.max(1));
            if s.items.is_empty() {
                if let Some(f) = s.fatal {
                    return Err(f);
                }
                if self.eof {
                    return match self.buf.bytes().len() {
                        0 => Ok(()),
                        n => Err(ConnError::Protocol(format!(
                            "the client went away in the middle of a request ({n} byte(s) of it \
                             came; nothing of it was executed)"
                        ))),
                    };
                }
                self.read_more(s.want)?;
                continue;
            }
            if !self.slot.begin() {
                return Err(ConnError::Evicted);
            }
            let r = self.execute(&s.items);
            self.slot.end();
            let disc = r?;
            self.buf.consume(s.consumed);
            if disc {
                return Ok(());
            }
            if let Some(f) = s.fatal {
                return Err(f);
            }
        }
    }

    /// Takes in whatever the socket already has (without waiting).
    fn read_ahead(&mut self) -> Result<(), ConnError> {
        while self.buf.bytes().len() < READ_AHEAD {
            let room = self.buf.room(READ_CHUNK);
            match self.stream.read_available(room)? {
                Some(0) => {
                    self.eof = true;
                    return Ok(());
                }
                Some(n) => self.buf.filled(n),
                None => return Ok(()),
            }
        }
        Ok(())
    }

    /// Waits for more bytes: the next request needs `want` bytes in all. The client is idle
    /// meanwhile: past the idle time-out (counted from its last answered request, or its
    /// handshake) without a complete request, it is closed.
    fn read_more(&mut self, want: usize) -> Result<(), ConnError> {
        let need = want.saturating_sub(self.buf.bytes().len()).max(READ_CHUNK);
        let idle = self.shared.opts.limits.idle_timeout;
        loop {
            if let Some(d) = idle {
                let left = (self.slot.since() + d).saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(ConnError::Idle(d));
                }
                self.stream.set_read_timeout(Some(left))?;
            }
            let room = self.buf.room(need);
            match self.stream.read(room) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(());
                }
                Ok(n) => {
                    self.buf.filled(n);
                    return Ok(());
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    if idle.is_none() {
                        return Err(e.into());
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Executes the items in order, in runs of one kind, and answers each run. True at DISC.
    fn execute(&mut self, items: &[Item]) -> Result<bool, ConnError> {
        let actions: Vec<Action> = items
            .iter()
            .map(|i| classify(&i.req, self.limits))
            .collect();
        let issued = actions
            .iter()
            .filter(|a| !matches!(a, Action::Fail(_) | Action::Disc))
            .count();
        self.stats.max_batch = self.stats.max_batch.max(issued);
        let mut i = 0;
        while i < items.len() {
            let run_of =
                |f: fn(&Action) -> bool| i + actions[i..].iter().take_while(|a| f(a)).count();
            match actions[i] {
                Action::Disc => {
                    self.send()?;
                    return Ok(true);
                }
                Action::Fail(e) => {
                    simple_reply(&mut self.out, e, items[i].req.handle);
                    i += 1;
                }
                Action::Flush => {
                    let e = if self.limits.read_only {
                        0
                    } else {
                        let e = self.durable(self.shared.flush_all(), 1, "FLUSH");
                        // A queue given up since this client's last FLUSH may have lost writes
                        // it had answered: that FLUSH cannot vouch for them.
                        let losses = self.shared.losses.load(Ordering::SeqCst);
                        if losses != self.losses_seen {
                            self.losses_seen = losses;
                            if e == 0 {
                                EIO
                            } else {
                                e
                            }
                        } else {
                            e
                        }
                    };
                    simple_reply(&mut self.out, e, items[i].req.handle);
                    i += 1;
                }
                Action::Read => {
                    let j = run_of(|a| matches!(a, Action::Read));
                    self.reads(&items[i..j]);
                    i = j;
                }
                Action::Write { .. } | Action::Zeroes { .. } => {
                    let j = run_of(|a| matches!(a, Action::Write { .. } | Action::Zeroes { .. }));
                    self.writes(&items[i..j], &actions[i..j]);
                    i = j;
                }
            }
            self.send()?;
        }
        Ok(false)
    }

    fn send(&mut self) -> Result<(), ConnError> {
        if !self.out.is_empty() {
            self.stream.write_all(&self.out)?;
            self.out.clear();
        }
        Ok(())
    }

    fn answered(&mut self, n: usize) {
        self.stats.requests += n as u64;
        self.shared.requests.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// The reads of a run, in one batch, each answered with its bytes.
    fn reads(&mut self, run: &[Item]) {
        let base = self.out.len();
        let total: usize = run
            .iter()
            .map(|it| SIMPLE_REPLY_LEN + it.req.len as usize)
            .sum();
        self.out.resize(base + total, 0);
        let r = {
            let mut rest = &mut self.out[base..];
            let mut v = Vec::with_capacity(run.len());
            for it in run {
                let (hdr, tail) = rest.split_at_mut(SIMPLE_REPLY_LEN);
                hdr.copy_from_slice(&simple_reply_header(0, it.req.handle));
                let (data, tail) = tail.split_at_mut(it.req.len as usize);
                v.push((it.req.offset, data));
                rest = tail;
            }
            self.shared.with_ns(|ns| ns.read_batch(&mut v))
        };
        if let Err(e) = r {
            self.shared.problems.log(
                Level::Warn,
                self.source,
                format_args!(
                    "nbd: {} READ request(s) failed, answered {}: {}",
                    run.len(),
                    Errno(errno(&e, false)),
                    rpma_common::error_chain(&e)
                ),
            );
            self.out.truncate(base);
            for it in run {
                simple_reply(&mut self.out, errno(&e, false), it.req.handle);
            }
        }
        self.answered(run.len());
    }

    /// The writes (and zeroes) of a run in one batch; with FUA ones among them, made durable
    /// by the same call (a failed durability answers every request of the run with the error).
    fn writes(&mut self, run: &[Item], actions: &[Action]) {
        if self.zeroes.is_empty() && actions.iter().any(|a| matches!(a, Action::Zeroes { .. })) {
            self.zeroes = vec![0u8; ZERO_PIECE];
        }
        let data = self.buf.bytes();
        let mut v: Vec<(u64, &[u8])> = Vec::with_capacity(run.len());
        let mut fua = false;
        for (it, a) in run.iter().zip(actions) {
            let (off, len) = (it.req.offset, u64::from(it.req.len));
            match a {
                Action::Zeroes { .. } => {
                    let mut at = 0;
                    while at < len {
                        let n = (len - at).min(ZERO_PIECE as u64) as usize;
                        v.push((off + at, &self.zeroes[..n]));
                        at += n as u64;
                    }
                }
                _ => v.push((off, &data[it.payload.clone()])),
            }
            if matches!(
                a,
                Action::Write { fua: true } | Action::Zeroes { fua: true }
            ) {
                fua = true;
            }
        }
        // With a FUA write in the run, the Writes and the requests that make them durable go
        // out together (one doorbell with APM and FLUSH); otherwise the Writes alone.
        let r = if fua {
            self.shared
                .with_ns(|ns| ns.write_batch_durable(&v))
                .map(|d| Some(d.is_durable()))
        } else {
            self.shared.with_ns(|ns| ns.write_batch(&v)).map(|()| None)
        };
        if r.is_ok() {
            self.shared.mark_dirty();
        }
        drop(v);
        let (ok, fua_err) = match r {
            Err(e) => {
                self.shared.problems.log(
                    Level::Warn,
                    self.source,
                    format_args!(
                        "nbd: {} WRITE request(s) failed, answered {}: {}",
                        run.len(),
                        Errno(errno(&e, true)),
                        rpma_common::error_chain(&e)
                    ),
                );
                (errno(&e, true), errno(&e, true))
            }
            Ok(None) => (0, 0),
            Ok(Some(durable)) => {
                let n = actions
                    .iter()
                    .filter(|a| {
                        matches!(
                            a,
                            Action::Write { fua: true } | Action::Zeroes { fua: true }
                        )
                    })
                    .count();
                (0, self.durable(Ok(durable), n, "FUA write"))
            }
        };
        for (it, a) in run.iter().zip(actions) {
            let e = match a {
                Action::Write { fua: true } | Action::Zeroes { fua: true } => fua_err,
                _ => ok,
            };
            simple_reply(&mut self.out, e, it.req.handle);
        }
        self.answered(run.len());
    }

    /// The error for `n` requests whose durability call returned `r`.
    fn durable(&mut self, r: crate::Result<bool>, n: usize, what: &str) -> u32 {
        match r {
            Ok(true) => 0,
            Ok(false) if self.shared.opts.visible_ok => 0,
            Ok(false) => {
                self.stats.visible_only += n as u64;
                proto::EIO
            }
            Err(e) => {
                self.shared.problems.log(
                    Level::Warn,
                    self.source,
                    format_args!(
                        "nbd: {what} failed, answered {}: {}",
                        Errno(errno(&e, true)),
                        rpma_common::error_chain(&e)
                    ),
                );
                errno(&e, true)
            }
        }
    }
}

#[cfg(feature = "fuzzing")]
pub(crate) mod fuzz;

#[cfg(test)]
mod tests;
