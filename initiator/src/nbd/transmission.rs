//! One client's transmission phase: read what the socket has, split it into requests, start
//! the READs and WRITEs on the client's queue as they come and answer each as soon as it
//! completed (`pipeline`), keeping the queue as full as the client keeps it.
//!
//! Order: the pieces of READs and WRITEs go out on one queue pair in the order the requests
//! came, so overlapping writes land in request order and a read sees every write that came
//! before it; a request held back for another connection's unplaced writes of its bytes
//! ([`park`]) holds back the later requests on its bytes too. A FLUSH, a FUA write and
//! WRITE_ZEROES wait until everything started (or held back) before them was answered (a
//! FLUSH covers every write answered before it arrived, on any connection).

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use log::Level;
use rpma_common::proto::PersistenceDomain;

use super::pipeline::{errno, Answer, Pipeline, Reply};
use super::proto::{self, simple_reply, Errno, EIO};
use super::shared::{Cell, Held, Shared};
use super::slots::{Slot, Source, STALL};
use super::stream::{write_vectored_from, NoWait, Stream, WRITE_TIMEOUT};
use super::ConnError;
use crate::writebuf::WriteBuf;
use crate::Error;
use held::{Data, Fill, Parked};
use inbuf::{InBuf, READ_CHUNK};
use parse::{classify, split, Action, Item, Limits, Split};

/// Bytes read from the socket ahead of the requests being executed, at most.
const READ_AHEAD: usize = 64 << 20;
/// How long a client may be quiet before the large receive buffer a burst of large WRITEs
/// left it is given back.
const KEEP_IDLE: Duration = Duration::from_millis(100);
/// The largest WRITE made durable before it is answered when the client flushes after each
/// ([`Client::write_before_flush`]). A larger one is answered as soon as the transport took it,
/// its transfer and placement overlapping the client's turn-around to its FLUSH: made
/// durable first, fio's QD1 durable writes took 1.02x as long at 16 KiB, 1.19x at 32 KiB and
/// 1.25x at 64 KiB, against 0.85x at 4 KiB (docs/benchmarks.md, "A WRITE made durable before
/// its FLUSH").
const EARLY_MAX: usize = 8 << 10;
/// While its client's socket is full, a thread looks this often whether another thread
/// wants its queue ([`Client::send`]).
const WANTED_EVERY: Duration = Duration::from_millis(10);

/// What a client did, for its log line.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Stats {
    /// Requests answered.
    pub(crate) requests: u64,
    /// The most requests in flight at once.
    pub(crate) max_batch: usize,
    /// FLUSH/FUA requests refused because the namespace is volatile.
    pub(crate) visible_only: u64,
    /// READs and WRITEs held back for another connection's writes of their bytes ([`park`]).
    pub(crate) held_back: u64,
    /// Requests that waited in line for another connection's writes (this connection's
    /// started requests completed first).
    pub(crate) waited: u64,
    /// WRITEs made durable before they were answered, the client being one that sends a FLUSH
    /// after each ([`Client::write_before_flush`]).
    pub(crate) early: u64,
    /// WRITEs whose payload was received straight into a payload buffer ([`direct`]).
    pub(crate) direct: u64,
}

/// One client in the transmission phase.
pub(crate) struct Client<'a> {
    shared: &'a Shared,
    /// The client's queue (see [`Cell`]).
    cell: &'a Cell,
    /// Its lock, while requests are in flight (or between them, until someone wants it).
    held: Option<Held<'a>>,
    /// Busy while requests execute, idle while it waits: the accept loop may evict it then.
    slot: &'a Slot,
    busy: bool,
    /// For the log limits.
    source: Source,
    stream: Stream,
    limits: Limits,
    buf: InBuf,
    eof: bool,
    /// Reply headers to send (and the error replies of READs).
    out: Vec<u8>,
    /// READ replies (header and data), each in the buffer it was read into, with the length
    /// `out` had when it was answered: sent in that order with `out`'s bytes by one vectored
    /// write, not copied into `out` first.
    replies: Vec<(usize, Reply)>,
    zeroes: Vec<u8>,
    pipe: Pipeline,
    stats: Stats,
    /// [`Shared::losses`] as of this client's last FLUSH, or [`Shared::losses_reported`] as of
    /// the connection's start of transmission.
    losses_seen: u64,
    /// [`Shared::losses`] as of the connection's start of transmission: the losses before it
    /// are owed to its FLUSH only while no client has been told of them (it had no write on
    /// the queues they took).
    losses_at_entry: u64,
    /// READs and WRITEs held back until another connection's writes of their bytes are
    /// placed, in the order they came ([`park`]).
    parked: Vec<Parked>,
    /// The last request executed was a (non-FUA) WRITE.
    after_write: bool,
    /// The last request after a WRITE was a FLUSH: the client flushes after each write
    /// ([`write_before_flush`](Self::write_before_flush)).
    flushes_writes: bool,
    /// Payload buffers: large WRITEs' payloads are received into them ([`direct`]).
    bufs: Vec<WriteBuf>,
    /// The WRITE whose payload is being received into one.
    fill: Option<Fill>,
    /// The next read takes a request header alone (after a payload received in place).
    header_next: bool,
}

impl<'a> Client<'a> {
    /// `strict`: the client was told the block sizes, so misaligned requests fail. `slot` is
    /// the client's place in the export, idle (its handshake is over); `cell` its queue.
    /// `losses`: [`Shared::losses_reported`] and [`Shared::losses`] when the connection entered
    /// transmission (not at its first request: a loss meanwhile, that another client was told
    /// of, is one this connection's writes may have shared in, as `CAN_MULTI_CONN` has it).
    pub(crate) fn new(
        shared: &'a Shared,
        cell: &'a Cell,
        stream: Stream,
        strict: bool,
        (slot, source): (&'a Slot, Source),
        (losses_seen, losses_at_entry): (u64, u64),
    ) -> Client<'a> {
        Client {
            slot,
            busy: false,
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
            cell,
            held: None,
            stream,
            buf: InBuf::default(),
            eof: false,
            out: Vec::new(),
            replies: Vec::new(),
            zeroes: Vec::new(),
            pipe: Pipeline::new(shared.in_place),
            stats: Stats::default(),
            losses_seen,
            losses_at_entry,
            parked: Vec::new(),
            after_write: false,
            flushes_writes: false,
            bufs: Vec::new(),
            fill: None,
            header_next: false,
        }
    }

    pub(crate) fn stats(&self) -> Stats {
        self.stats
    }

    /// Serves requests until DISC, end of file (after answering every complete request), or
    /// an error; what was started is answered before it returns.
    ///
    /// # Errors
    /// [`ConnError`]: the socket failed, a bad magic, an oversized WRITE, a client that went
    /// away in the middle of a request, no request within the idle time-out
    /// ([`ConnError::Idle`]), an eviction ([`ConnError::Evicted`]: nothing read after it is
    /// executed).
    pub(crate) fn run(&mut self) -> Result<(), ConnError> {
        let r = self.serve();
        if !self.pipe.is_empty() || !self.parked.is_empty() {
            let _ = self.settle();
            let _ = self.send();
        }
        self.held = None;
        if self.busy {
            self.slot.end();
        }
        r
    }

    fn serve(&mut self) -> Result<(), ConnError> {
        loop {
            if self.fill.is_some() {
                self.fill_ahead()?;
            } else if !self.eof {
                self.read_ahead()?;
            }
            // At most max_batch requests in flight (or held back).
            let room = self.shared.opts.max_batch.max(1);
            let room = room.saturating_sub(self.pipe.len() + self.parked.len());
            let s = if let Some(it) = self.filled() {
                Split {
                    items: vec![it],
                    ..Split::default()
                }
            } else if room > 0 && self.fill.is_none() {
                split(self.buf.bytes(), room)
            } else {
                Split::default()
            };
            if s.items.is_empty() {
                if room > 0 && s.fatal.is_none() && !self.eof && self.begin_fill() {
                    continue;
                }
                if !self.pipe.is_empty() {
                    // Woken by the client's next bytes: the loop takes them in.
                    self.complete_or_input()?;
                    self.retry_parked()?;
                    self.send()?;
                    continue;
                }
                if !self.parked.is_empty() {
                    // Nothing in flight to wake this loop.
                    self.wait_parked()?;
                    self.send()?;
                    continue;
                }
                // Nothing in flight and no complete request: let the queue go and wait.
                self.held = None;
                if self.busy {
                    self.busy = false;
                    self.slot.end();
                }
                if let Some(f) = s.fatal {
                    return Err(f);
                }
                if self.eof {
                    return match self.buf.bytes().len() + self.fill_came() {
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
            if !self.busy {
                if !self.slot.begin() {
                    return Err(ConnError::Evicted);
                }
                self.busy = true;
            }
            let disc = self.execute(&s.items)?;
            self.buf.consume(s.consumed);
            if disc || s.fatal.is_some() {
                self.settle()?;
                self.send()?;
                return match s.fatal {
                    Some(f) if !disc => Err(f),
                    _ => Ok(()),
                };
            }
            if self.cell.wanted() {
                // Another thread waits for this queue: finish what was started and let go,
                // the replies settled sent first (letting go waits until a waiter has the
                // queue, up to 5 ms; send lets the queue go itself if the client reads
                // nothing).
                self.settle()?;
                self.send()?;
                self.let_go();
            } else if !self.pipe.is_empty() {
                self.complete_or_input()?;
                self.retry_parked()?;
            }
            self.send()?;
        }
    }

    /// Starts or executes the items in order: READs and WRITEs are started (answered as they
    /// complete); FLUSH, FUA writes and WRITE_ZEROES first wait for everything started before
    /// them. True at DISC (the items after it are not executed).
    fn execute(&mut self, items: &[Item]) -> Result<bool, ConnError> {
        for it in items {
            let a = classify(&it.req, self.limits);
            let first_write = !self.after_write;
            if self.after_write {
                self.flushes_writes = a == Action::Flush;
            }
            self.after_write = a == Action::Write { fua: false };
            match a {
                Action::Disc => return Ok(true),
                Action::Fail(e) => {
                    simple_reply(&mut self.out, e, it.req.handle);
                    self.answered(1);
                }
                Action::Write { fua: false }
                    if first_write
                        && it.req.len as usize <= EARLY_MAX
                        && self.flushes_writes
                        && self.shared.desc.domain != PersistenceDomain::Volatile
                        && self.pipe.is_empty()
                        && self.parked.is_empty()
                        && !self.cell.is_dirty() =>
                {
                    self.write_before_flush(it)?;
                }
                Action::Read | Action::Write { fua: false } => self.read_or_write(it, a)?,
                Action::Flush => {
                    self.settle()?;
                    // flush_all takes every queue in turn: hold none meanwhile.
                    self.held = None;
                    let e = self.flush();
                    simple_reply(&mut self.out, e, it.req.handle);
                    self.answered(1);
                }
                Action::Write { .. } => {
                    self.settle()?;
                    self.after_other_connections(&it.req, false)?;
                    self.writes(std::slice::from_ref(it), &[a]);
                }
                Action::Zeroes { fua } => {
                    self.settle()?;
                    self.after_other_connections(&it.req, false)?;
                    self.write_zeroes(it, fua);
                }
            }
        }
        self.stats.max_batch = self.stats.max_batch.max(self.pipe.len());
        Ok(false)
    }

    /// Starts a READ or a (non-FUA) WRITE.
    fn start(&mut self, req: &proto::Request, a: Action, data: &Data) {
        let (shared, cell) = (self.shared, self.cell);
        let (off, len, handle) = (req.offset, req.len as usize, req.handle);
        let g = self.held.get_or_insert_with(|| shared.lock(cell));
        let (pipe, buf, bufs) = (&mut self.pipe, &self.buf, &self.bufs);
        // Whether the pipeline took the request (then it answers it, error or not). A queue
        // that cannot be had (the one that gave up not replaced yet: the target is still
        // gone) fails before: the request is answered here, or the client would wait for it
        // forever (the kernel's nbd, md above it, a sync).
        let mut taken = false;
        if a != Action::Read {
            // Before it is started: the pipeline may answer it (success) in the same call in
            // which the queue gives up, and the give-up counts a loss only for a dirty cell.
            cell.mark_dirty();
        }
        let r = shared.with_ns(cell, g, |ns| {
            taken = true;
            let chunk = ns.chunk();
            match a {
                Action::Read => pipe.start_read(ns, chunk, handle, off, len),
                _ => pipe.start_write(ns, chunk, handle, off, data.payload(buf, bufs)),
            }
        });
        if let Err(e) = r {
            self.queue_error(&e, if a == Action::Read { "READ" } else { "WRITE" });
            if !taken {
                if a != Action::Read {
                    shared.told();
                }
                simple_reply(&mut self.out, errno(&e, a != Action::Read), handle);
                self.answered(1);
            }
        }
    }

    /// Waits for at least one started request to complete; answers what completed.
    fn complete(&mut self) -> Result<(), ConnError> {
        self.wait(false).map(|_| ())
    }

    /// [`complete`](Self::complete), or returns (true) as soon as the client sent more, when
    /// there is room to start more: the client's next request goes out while the earlier
    /// ones are in flight. A client at depth 4 waited otherwise: its fifth request lay
    /// unread in the socket until one of the four completed.
    ///
    /// Only while the client has fewer requests in flight than it once had: a client that
    /// never sent a second request before the first was answered (fio at depth 1, a `dd`) will
    /// not send one now, and watching its socket cost each wait two `epoll_ctl` calls and the
    /// busy-poll an `epoll_wait` per turn (a QD1 READ's p50 went up by 1 us).
    fn complete_or_input(&mut self) -> Result<bool, ConnError> {
        let n = self.pipe.len();
        // Not at end of file (the socket stays readable: every wait would return at once),
        // nor with the read-ahead or the batch full (nothing more would be taken in).
        let room = n < self.shared.opts.max_batch.max(1);
        let watch =
            !self.eof && room && n < self.stats.max_batch && self.buf.bytes().len() < READ_AHEAD;
        self.wait(watch)
    }

    fn wait(&mut self, watch_input: bool) -> Result<bool, ConnError> {
        let (shared, cell) = (self.shared, self.cell);
        let g = self.held.get_or_insert_with(|| shared.lock(cell));
        let pipe = &mut self.pipe;
        let input = watch_input.then(|| self.stream.as_fd());
        let r = shared.with_ns(cell, g, |ns| pipe.complete_or(ns, input));
        let woken = match r {
            Ok(w) => w,
            Err(e) => {
                self.queue_error(&e, "READ/WRITE");
                false
            }
        };
        self.collect();
        Ok(woken)
    }

    /// Answers everything started (waits until it completed).
    fn drain(&mut self) -> Result<(), ConnError> {
        while !self.pipe.is_empty() {
            self.complete()?;
        }
        Ok(())
    }

    /// After an error of the client's queue: logged; a queue that gave up fails what is in
    /// flight (the pipeline dealt with everything else).
    fn queue_error(&mut self, e: &Error, what: &str) {
        self.shared.problems.log(
            Level::Warn,
            self.source,
            format_args!(
                "nbd: {what} on the queue failed: {}",
                rpma_common::error_chain(e)
            ),
        );
        if self.held.as_ref().is_some_and(|g| g.is_none()) {
            self.pipe.fail_all(EIO);
        }
    }

    /// Moves the answers of completed requests to the output.
    fn collect(&mut self) {
        let n = self.pipe.answers.len();
        if n == 0 {
            return;
        }
        if self.pipe.take_written() > 0 {
            self.cell.mark_dirty();
        }
        if self.pipe.take_write_errors() > 0 {
            self.shared.told();
        }
        for a in std::mem::take(&mut self.pipe.answers) {
            match a {
                Answer::Header(h) => self.out.extend_from_slice(&h),
                Answer::Data(b) => self.replies.push((self.out.len(), b)),
            }
        }
        self.answered(n);
    }

    /// Sends the answers in the order they were made, with one vectored write (the READ
    /// replies are not copied into one buffer first: for a 1 MiB READ that copy was a pass
    /// over every byte).
    ///
    /// The socket is written without waiting; when the client's socket is full, this thread
    /// waits for room, but does not keep the queue meanwhile from a thread that wants it (a
    /// FLUSH, a shutdown, a connection sharing the queue): it finishes what it started and lets
    /// the queue go, as between requests. (Holding it, one client that read its replies
    /// slowly or not at all held every FLUSH of the export up, for up to 30 s a write while
    /// it read nothing, and as long as it liked while it trickled.) A client must take its
    /// replies within [`WRITE_TIMEOUT`] plus a second per MiB, or its connection is closed.
    ///
    /// Replies left unread for [`STALL`] stall the client: its slot may be taken for a
    /// newcomer until they were taken ([`Slot::stall`]; before, connections that sent large
    /// READs and read nothing held their slots as busy, so that every newcomer of their source
    /// was refused). Evicted meanwhile, it executes nothing more ([`ConnError::Evicted`]).
    /// Its queue goes then too, wanted or not: the keep-alive ticks only a queue no thread
    /// holds (held while the client read nothing, the target's keep-alive lapsed, and the
    /// queue had to reconnect and re-issue its writes).
    fn send(&mut self) -> Result<(), ConnError> {
        let mut stalled = false;
        let r = self.send_inner(&mut stalled);
        if stalled && !self.slot.unstall() {
            return Err(ConnError::Evicted);
        }
        r
    }

    fn send_inner(&mut self, stalled: &mut bool) -> Result<(), ConnError> {
        self.collect();
        if self.out.is_empty() && self.replies.is_empty() {
            return Ok(());
        }
        let mut done = 0;
        // Since when the socket has been full, and until when the client may take to read.
        let mut blocked = None;
        let r = loop {
            match write_vectored_from(&mut NoWait(&self.stream), &self.out, &self.replies, done) {
                Ok(n) => done = n,
                Err(e) => break Err(ConnError::from(e)),
            }
            let all = self.out.len()
                + self
                    .replies
                    .iter()
                    .map(|(_, b)| b.as_ref().len())
                    .sum::<usize>();
            if done == all {
                break Ok(());
            }
            let now = Instant::now();
            let (since, until) = *blocked.get_or_insert_with(|| {
                (
                    now,
                    now + WRITE_TIMEOUT + Duration::from_secs((all >> 20) as u64),
                )
            });
            if now >= until {
                break Err(ConnError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the client took {done} of {all} bytes of replies in {} s",
                        (now - since).as_secs()
                    ),
                )));
            }
            if !*stalled && now - since >= STALL {
                self.slot.stall();
                *stalled = true;
            }
            if self.held.is_some() && (*stalled || self.cell.wanted()) {
                if let Err(e) = self.settle() {
                    break Err(e);
                }
                self.held = None;
                // What settling answered goes after the rest.
                self.collect();
            }
            if let Err(e) = self.stream.wait_writable((until - now).min(WANTED_EVERY)) {
                break Err(e.into());
            }
        };
        self.out.clear();
        if self.out.capacity() > 4 * READ_CHUNK {
            self.out = Vec::new();
        }
        for (_, b) in self.replies.drain(..) {
            self.pipe.recycle(b);
        }
        r
    }

    fn answered(&mut self, n: usize) {
        self.stats.requests += n as u64;
        self.shared.requests.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Lets the queue go to the threads that want it ([`Cell::hand_over`]).
    fn let_go(&mut self) {
        if let Some(g) = self.held.take() {
            self.cell.hand_over(g);
        }
    }

    /// A FUA write (nothing else in flight): written, made durable, answered.
    fn writes(&mut self, run: &[Item], actions: &[Action]) {
        let data = self.buf.bytes();
        let mut v: Vec<(u64, &[u8])> = Vec::with_capacity(run.len());
        let mut fua = false;
        for (it, a) in run.iter().zip(actions) {
            v.push((it.req.offset, &data[it.payload.clone()]));
            fua |= *a == Action::Write { fua: true };
        }
        let (shared, cell) = (self.shared, self.cell);
        let g = self.held.get_or_insert_with(|| shared.lock(cell));
        // With a FUA write in the run, the Writes and the requests that make them durable go
        // out together (one doorbell with APM and FLUSH); otherwise the Writes alone.
        let r = if fua {
            shared
                .with_ns(cell, g, |ns| ns.write_batch_durable(&v))
                .map(|d| Some(d.is_durable()))
        } else {
            shared
                .with_ns(cell, g, |ns| ns.write_batch(&v))
                .map(|()| None)
        };
        if r.is_ok() {
            cell.mark_dirty();
        }
        drop(v);
        let (ok, fua_err) = match r {
            Err(e) => {
                self.shared.told();
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
                    .filter(|a| **a == Action::Write { fua: true })
                    .count();
                (0, self.durable(Ok(durable), n, "FUA write"))
            }
        };
        for (it, a) in run.iter().zip(actions) {
            let e = match a {
                Action::Write { fua: true } => fua_err,
                _ => ok,
            };
            simple_reply(&mut self.out, e, it.req.handle);
        }
        self.answered(run.len());
    }
}

#[cfg(feature = "fuzzing")]
pub(crate) mod fuzz;

mod direct;
mod durable;
mod held;
mod inbuf;
mod input;
mod park;
mod parse;
#[cfg(test)]
mod tests;
mod zeroes;
