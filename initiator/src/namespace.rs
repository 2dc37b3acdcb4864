//! [`Namespace`]: reads, writes, persists and atomics on one namespace through a [`Queue`].
//!
//! Every call checks its arguments against the namespace descriptor before anything is posted
//! (bounds, alignment, read-only) and returns only when its requests completed: a write when
//! its bytes were handed to the transport (sent: the target does not acknowledge a Write, and
//! nothing is durable yet), a durable call when the target acknowledged durability. Inside one
//! call up to the queue depth of requests are in flight; the batch calls put many independent
//! transfers in flight at once.

use std::ops::Range;

use smallvec::SmallVec;

use rpma_common::fabric::{RemoteAddr, SendOp};
use rpma_common::proto::NamespaceDescriptor;

pub use crate::checks::{check_aligned, check_atomic, check_healthy, check_range, check_writable};
use crate::durability::{Choice, Durability, PersistMethod};
use crate::error::{Error, Result};
use crate::queue::{OnLoss, Queue};
use crate::writebuf::{Data, WriteBuf};

/// A batch call's items as the queue takes them: inline for a few (a QD1 call allocates
/// nothing).
type Items<'a> = SmallVec<[(u64, Data<'a>); 4]>;

/// The items of a batch call, to be copied into bounce slots.
fn copied<'a>(items: &[(u64, &'a [u8])]) -> Items<'a> {
    items.iter().map(|&(o, b)| (o, Data::Bytes(b))).collect()
}

/// The items of a batch call from write buffers, checked.
fn bufs<'a>(items: &[(u64, &'a WriteBuf, Range<usize>)]) -> Result<Items<'a>> {
    items
        .iter()
        .map(|(o, b, r)| Ok((*o, from_buf(b, r.clone())?)))
        .collect()
}

/// `range` of `buf`, checked: in it, and no Read into the buffer in flight.
fn from_buf(buf: &WriteBuf, range: Range<usize>) -> Result<Data<'_>> {
    let len = range.end.saturating_sub(range.start);
    buf.check(range.start, len)?;
    if buf.reads_held() != 0 {
        return Err(Error::InvalidArgument(
            "a Read into this buffer is not finished: finish it before writing from the buffer"
                .into(),
        ));
    }
    Ok(Data::Buf {
        buf,
        at: range.start,
        len,
    })
}

/// One namespace, borrowed from its queue.
#[derive(Debug)]
pub struct Namespace<'q> {
    q: &'q mut Queue,
    idx: usize,
}

impl Queue {
    /// A handle on namespace `nsid` for reads, writes, persists and atomics. The queue uses
    /// the namespace from then on: a reconnect that finds it changed (another file, size or
    /// mode) or gone gives the queue up ([`Error::NamespaceChanged`]); a change of a namespace
    /// the queue never took a handle on does not, and a handle taken after it sees the new
    /// descriptor.
    ///
    /// # Errors
    /// [`Error::NoSuchNamespace`] (one a reload removed too, once a reconnect found it gone),
    /// [`Error::NamespaceUnavailable`] (the target lists it but cannot serve it on this
    /// transport).
    pub fn namespace(&mut self, nsid: u32) -> Result<Namespace<'_>> {
        let idx = self.open_namespace(nsid)?;
        Ok(Namespace { q: self, idx })
    }
}

impl<'q> Namespace<'q> {
    /// The descriptor (it changes across a reconnect: new rkey and address).
    pub fn descriptor(&self) -> &NamespaceDescriptor {
        self.q.descriptor(self.idx)
    }

    fn desc(&self) -> NamespaceDescriptor {
        self.descriptor().clone()
    }

    /// The counters of the queue this handle borrows ([`Queue::stats`]).
    pub fn queue_stats(&self) -> crate::QueueStats {
        self.q.stats()
    }

    /// How durable calls are carried out here.
    ///
    /// # Errors
    /// [`Error::MethodNotValid`] when a forced method cannot make this namespace durable.
    pub fn method(&self) -> Result<Choice> {
        self.q.choice(self.idx)
    }

    /// Forces a durability method on this namespace (None: the best one offered).
    ///
    /// # Errors
    /// [`Error::MethodNotValid`] when `m` cannot make this namespace durable; the namespace
    /// keeps that setting, and its durable calls fail the same way, never downgraded.
    pub fn set_method(&mut self, m: Option<PersistMethod>) -> Result<Choice> {
        self.q.set_forced(self.idx, m);
        self.method()
    }

    /// Reads `buf.len()` bytes at `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfRange`]; a lost connection is reconnected and the read re-run; then
    /// [`Error::ReconnectFailed`], [`Error::Remote`], [`Error::Timeout`].
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.read_batch(&mut [(offset, buf)])
    }

    /// Reads many ranges with their requests in flight together.
    ///
    /// # Errors
    /// As [`read_at`](Self::read_at), checked for every range before any is posted.
    pub fn read_batch(&mut self, items: &mut [(u64, &mut [u8])]) -> Result<()> {
        let d = self.desc();
        for (off, b) in items.iter() {
            check_range(&d, *off, b.len() as u64)?;
        }
        let idx = self.idx;
        self.q.run(OnLoss::Rerun, |q| q.read_into(idx, items))
    }

    /// Writes `data` at `offset`. When this returns the Writes were handed to the transport
    /// (on `tcp` a Write completes when TCP took it, as in iWARP: the target does not
    /// acknowledge it); they are placed before the target answers any later Read, atomic,
    /// Flush or persist of this queue, and not durable until [`persist`](Self::persist). The
    /// queue keeps the bytes until they are durable, to re-issue them after a reconnect.
    ///
    /// # Errors
    /// [`Error::OutOfRange`], [`Error::ReadOnly`]; after a loss, as [`read_at`](Self::read_at).
    pub fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        self.write_batch(&[(offset, data)])
    }

    /// Writes many ranges with their requests in flight together (sent, not yet durable: as
    /// [`write_at`](Self::write_at)).
    ///
    /// # Errors
    /// As [`write_at`](Self::write_at), checked for every range before any is posted.
    pub fn write_batch(&mut self, items: &[(u64, &[u8])]) -> Result<()> {
        self.write_items(&copied(items))
    }

    /// [`write_at`](Self::write_at) from `range` of a [`WriteBuf`], without copying it: the
    /// queue holds the buffer ([`WriteBuf::holds`]) instead of a copy until a durability call
    /// covers the write.
    ///
    /// # Errors
    /// As [`write_at`](Self::write_at); [`Error::InvalidArgument`] for a range outside the buffer
    /// or empty, or a buffer a Read goes into ([`start_read_into`](Self::start_read_into), not
    /// freed yet).
    pub fn write_from(&mut self, offset: u64, buf: &WriteBuf, range: Range<usize>) -> Result<()> {
        let data = from_buf(buf, range)?;
        self.write_items(&[(offset, data)])
    }

    /// [`write_batch`](Self::write_batch) from ranges of [`WriteBuf`]s, without copying them (as
    /// [`write_from`](Self::write_from)).
    ///
    /// # Errors
    /// As [`write_from`](Self::write_from), checked for every range before any is posted.
    pub fn write_batch_from(&mut self, items: &[(u64, &WriteBuf, Range<usize>)]) -> Result<()> {
        self.write_items(&bufs(items)?)
    }

    fn write_items(&mut self, items: &[(u64, Data<'_>)]) -> Result<()> {
        let d = self.desc();
        check_writable(&d)?;
        for (off, b) in items {
            check_range(&d, *off, b.len() as u64)?;
        }
        let idx = self.idx;
        self.q.run(OnLoss::Rerun, |q| {
            q.post_writes(idx, items, [])?;
            q.drain()
        })
    }

    /// Starts a Write of `data` (1 byte to one chunk) at `offset` and returns without waiting:
    /// started requests go out together when the caller waits for them
    /// ([`wait_started`](Self::wait_started)) or posts anything else, so that a caller can keep
    /// the queue full, a new request as each one completes. Its completion
    /// ([`Completed::Write`](crate::Completed)) means sent, as [`write_at`](Self::write_at)'s
    /// return; the queue keeps the bytes until a durability call covers them. Blocks only when
    /// every slot is busy (as the batch calls do).
    ///
    /// # Errors
    /// [`Error::OutOfRange`], [`Error::ReadOnly`], [`Error::InvalidArgument`] (empty or larger
    /// than a chunk); a lost connection is reported (the queue reconnects; see
    /// [`wait_started`](Self::wait_started)).
    ///
    /// A Write started behind a Read of the same bytes that has not completed may land before
    /// the target reads them (a responder reads a Read's bytes when it answers, as an RDMA
    /// NIC does): the Read may return the new bytes. Where that matters, use
    /// [`start_write_fenced`](Self::start_write_fenced).
    pub fn start_write(&mut self, offset: u64, data: &[u8]) -> Result<crate::Ticket> {
        self.start(offset, Data::Bytes(data), false)
    }

    /// [`start_write`](Self::start_write) from `range` of a [`WriteBuf`] (1 byte to one chunk),
    /// without copying it: the queue holds the buffer until a durability call covers the write.
    ///
    /// # Errors
    /// As [`start_write`](Self::start_write); [`Error::InvalidArgument`] also for a range outside
    /// the buffer, or a buffer a Read goes into ([`start_read_into`](Self::start_read_into),
    /// not freed yet).
    pub fn start_write_from(
        &mut self,
        offset: u64,
        buf: &WriteBuf,
        range: Range<usize>,
    ) -> Result<crate::Ticket> {
        let data = from_buf(buf, range)?;
        self.start(offset, data, false)
    }

    /// [`start_write`](Self::start_write) of `data` (copied, or from a write buffer), fenced
    /// as [`start_write_fenced`](Self::start_write_fenced) when `fence`: the NBD export's
    /// WRITEs, whose large payloads it receives straight into write buffers.
    ///
    /// # Errors
    /// As [`start_write_from`](Self::start_write_from).
    pub(crate) fn start_write_data(
        &mut self,
        offset: u64,
        data: Data<'_>,
        fence: bool,
    ) -> Result<crate::Ticket> {
        if let Data::Buf { buf, at, len } = data {
            from_buf(buf, at..at + len)?;
        }
        self.start(offset, data, fence)
    }

    fn start(&mut self, offset: u64, data: Data<'_>, fence: bool) -> Result<crate::Ticket> {
        let d = self.descriptor();
        check_writable(d)?;
        check_range(d, offset, data.len() as u64)?;
        self.q.start_write(self.idx, offset, data, fence)
    }

    /// [`start_write`](Self::start_write), but the Write starts only once every Read started
    /// before it completed (the verbs fence): those Reads never see its bytes.
    ///
    /// # Errors
    /// As [`start_write`](Self::start_write).
    pub fn start_write_fenced(&mut self, offset: u64, data: &[u8]) -> Result<crate::Ticket> {
        self.start(offset, Data::Bytes(data), true)
    }

    /// The most bytes one started request moves: the queue's chunk
    /// ([`QueueOptions::chunk`](crate::QueueOptions::chunk)).
    pub fn chunk(&self) -> usize {
        self.q.options().chunk
    }

    /// The most requests the queue has in flight at once
    /// ([`QueueOptions::depth`](crate::QueueOptions::depth)).
    pub fn depth(&self) -> usize {
        self.q.options().depth
    }

    /// Starts a Read of `len` bytes (1 to one chunk) at `offset`, as
    /// [`start_write`](Self::start_write); take its bytes with [`take_read`](Self::take_read)
    /// once it completed.
    ///
    /// # Errors
    /// [`Error::OutOfRange`], [`Error::InvalidArgument`]; a lost connection as for
    /// [`start_write`](Self::start_write).
    pub fn start_read(&mut self, offset: u64, len: usize) -> Result<crate::Ticket> {
        check_range(self.descriptor(), offset, len as u64)?;
        self.q.start_read(self.idx, offset, len)
    }

    /// [`Queue::wait_started`]: posts what was started, waits for at least one completion.
    ///
    /// # Errors
    /// As [`Queue::wait_started`].
    pub fn wait_started(&mut self, out: &mut Vec<crate::Completed>) -> Result<()> {
        self.q.wait_started(out)
    }

    /// [`Queue::wait_started_or`]: [`wait_started`](Self::wait_started) that also returns,
    /// true, as soon as `input` is readable.
    ///
    /// # Errors
    /// As [`Queue::wait_started`].
    pub fn wait_started_or(
        &mut self,
        out: &mut Vec<crate::Completed>,
        input: std::os::fd::BorrowedFd<'_>,
    ) -> Result<bool> {
        self.q.wait_started_or(out, input)
    }

    /// [`start_read`](Self::start_read) into `range` of `buf` instead of a slot of the queue:
    /// the Read places its bytes in the buffer, and nothing copies them when it completes
    /// (the NBD export's large READs, and `bench --job`'s reads, go this way). The queue holds
    /// the buffer until [`finish_read`](Self::finish_read) (or [`take_read`](Self::take_read),
    /// which copies them out as well) frees the Read; [`WriteBuf::bytes_mut`] then has them.
    /// Several Reads may go into one buffer at once, each into its own range.
    ///
    /// Not into a buffer a write from it is held for (not durable yet: a reconnect re-issues
    /// those bytes), and no write from a buffer while a Read into it is not finished.
    ///
    /// # Errors
    /// As [`start_read`](Self::start_read); [`Error::InvalidArgument`] also for a range outside
    /// the buffer, an empty one, or a buffer a write from it is held for.
    pub fn start_read_into(
        &mut self,
        offset: u64,
        buf: &mut WriteBuf,
        range: Range<usize>,
    ) -> Result<crate::Ticket> {
        let len = range.end.saturating_sub(range.start);
        check_range(self.descriptor(), offset, len as u64)?;
        self.q
            .start_read_into(self.idx, offset, buf, range.start, len)
    }

    /// Frees a completed [`start_read_into`](Self::start_read_into): its bytes are in the
    /// buffer.
    ///
    /// # Errors
    /// As [`take_read`](Self::take_read); [`Error::InvalidArgument`] also for a
    /// [`start_read`](Self::start_read) (its bytes are in a slot of the queue: `take_read`
    /// them).
    pub fn finish_read(&mut self, ticket: crate::Ticket) -> Result<()> {
        self.q.finish_read(ticket)
    }

    /// [`Queue::take_read`]: the bytes of a completed started Read.
    ///
    /// # Errors
    /// As [`Queue::take_read`].
    pub fn take_read(&mut self, ticket: crate::Ticket, buf: &mut [u8]) -> Result<()> {
        self.q.take_read(ticket, buf)
    }

    /// Makes `len` bytes at `offset` durable, whoever wrote them (this queue, another queue or
    /// another host), after every Write posted before on this queue. It uses this namespace's
    /// method unless that is APM, whose Read covers only the Writes of its own queue pair:
    /// then the next method the target offers (docs/initiator.md, "Which writes a method
    /// covers").
    ///
    /// # Errors
    /// [`Error::OutOfRange`], [`Error::ReadOnly`], [`Error::MethodNotValid`] (a forced method
    /// that cannot make this namespace durable), [`Error::ApmNotForRanges`] (APM forced, or the
    /// only method offered), [`Error::NamespaceFailed`], [`Error::NotDurable`] (the target
    /// could not), [`Error::Unsupported`]; after a loss, as [`read_at`](Self::read_at).
    pub fn persist(&mut self, offset: u64, len: u64) -> Result<Durability> {
        self.persist_with(offset, len, Queue::range_choice)
    }

    /// Makes durable the Writes this queue posted to `[offset, offset + len)` (and, with APM,
    /// every other Write this queue posted before), with this namespace's method, APM
    /// included: for a caller that wrote the range itself through this queue and wants the
    /// cheapest acknowledgement. Bytes other queues or hosts wrote there are not promised
    /// (with APM they are not covered); use [`persist`](Self::persist) for that.
    ///
    /// # Errors
    /// As [`persist`](Self::persist), but never [`Error::ApmNotForRanges`].
    pub fn persist_written(&mut self, offset: u64, len: u64) -> Result<Durability> {
        self.persist_with(offset, len, Queue::choice)
    }

    /// Makes durable every write this queue posted to this namespace that is not durable yet,
    /// wherever they landed, without naming a range: the queue knows them (it holds each until
    /// it is durable, for a replay). With this namespace's method, or, where the target offers
    /// APM on a dax namespace and no method was forced, with one APM Read (the target then writes
    /// back only the lines those writes placed; a FLUSH would take one request per scattered
    /// range). Writes of other queues or hosts are not covered: use [`persist`](Self::persist).
    /// A write of this queue that a reconnect let go because newer writes of other queues of
    /// the [`Connection`](crate::Connection) took its bytes is covered through those bytes:
    /// they are made durable here (with a FLUSH or GPSPM of them, never APM) once the newer
    /// writes are known placed since the reconnect (docs/initiator.md, "Which writes a method
    /// covers").
    ///
    /// # Errors
    /// As [`persist_written`](Self::persist_written); [`Error::RewritesNotPlaced`] while such
    /// newer writes are not known placed (call again once their queues polled),
    /// [`Error::RewritesLost`] (once) when they were let go unpersisted, and
    /// [`Error::ApmNotForRanges`] when such bytes are owed and APM is forced (or the only
    /// method offered).
    pub fn persist_own_writes(&mut self) -> Result<Durability> {
        check_writable(&self.desc())?;
        self.q.held_choice(self.idx)?;
        let idx = self.idx;
        self.q.run(OnLoss::Rerun, |q| q.persist_own(idx))
    }

    /// The queues of this queue's [`Connection`](crate::Connection) (by
    /// [`Queue::order_id`], this one included) that sent Writes of some of the `len` bytes at
    /// `offset` which may not be placed on the target yet, and queues that may hold such
    /// writes without saying which bytes (a queue alone on its connection until now). A Write
    /// completes when the transport took it (on `tcp`, as in iWARP): within one queue the
    /// target executes requests in order, but a newer write of these bytes through another
    /// queue could land before this one's, and a Read there could miss it. Where the order
    /// matters, send the request through the one queue named (its own order keeps it after
    /// them), or have the others [`place_writes`](Self::place_writes) first (the NBD export
    /// does both, for its connections). Empty when this queue is alone on its connection;
    /// cheap (one lock of the map the queues share).
    pub fn unplaced_writers(&mut self, offset: u64, len: usize) -> Vec<u64> {
        self.q.unplaced_writers(self.idx, offset, len)
    }

    /// Asks the queues `ids` (by [`Queue::order_id`], as [`unplaced_writers`](Self::unplaced_writers)
    /// names them) to learn soon whether their Writes are placed: each sends a probe (a
    /// KeepAlive, whose echo follows its earlier Writes) the next time its owner posts or
    /// waits for completions, instead of after its next 16 requests. For a caller that waits
    /// for another queue's writes while that queue is busy with its own owner's requests (the
    /// NBD export holds such a request back meanwhile); an idle queue sends nothing until its
    /// owner uses it: have it [`place_writes`](Self::place_writes) then. Cheap; no error.
    pub fn want_placed(&mut self, ids: &[u64]) {
        self.q.want_placed(ids);
    }

    /// Has every Write this queue sent (to any namespace) placed on the target: one Read of 8
    /// bytes, which the target answers only after executing every earlier request of this
    /// queue pair. Places, it does not persist: nothing becomes durable. Afterwards no queue
    /// finds these writes in [`unplaced_writers`](Self::unplaced_writers) (until this queue
    /// reconnects: its re-issued writes are on their way again).
    ///
    /// # Errors
    /// As [`read_at`](Self::read_at).
    pub fn place_writes(&mut self) -> Result<()> {
        self.q.place_writes(self.idx)
    }

    /// [`persist`](Self::persist) or [`persist_written`](Self::persist_written): checks, then
    /// the method from `choose` (again after a reconnect, which may change the descriptor).
    fn persist_with(
        &mut self,
        offset: u64,
        len: u64,
        choose: fn(&Queue, usize) -> Result<Choice>,
    ) -> Result<Durability> {
        let d = self.desc();
        check_writable(&d)?;
        check_range(&d, offset, len)?;
        choose(self.q, self.idx)?;
        let idx = self.idx;
        self.q.run(OnLoss::Rerun, |q| {
            let choice = choose(q, idx)?;
            q.persist_range(idx, offset, len, choice)
        })
    }

    /// Writes `data` at `offset` and makes it durable before returning. On a volatile
    /// namespace the outcome is [`Durability::VisibleOnly`]. With APM and FLUSH the last
    /// Writes and the Read or Flush that makes them durable are posted together (one
    /// doorbell, one `writev` on `tcp`).
    ///
    /// # Errors
    /// As [`write_at`](Self::write_at) and [`persist`](Self::persist); the method is checked
    /// before anything is written.
    pub fn write_durable(&mut self, offset: u64, data: &[u8]) -> Result<Durability> {
        self.write_batch_durable(&[(offset, data)])
    }

    /// Writes many ranges and makes them durable before returning, with their requests in
    /// flight together: with APM one Read, with FLUSH one Flush per range (touching ranges
    /// merged), posted behind the last Writes with the same doorbell; with GPSPM the Writes,
    /// then the FlushRequest(s). Only these ranges are made durable (and, with APM, every
    /// earlier Write of this queue).
    ///
    /// # Errors
    /// As [`write_durable`](Self::write_durable), checked for every range before any is posted.
    pub fn write_batch_durable(&mut self, items: &[(u64, &[u8])]) -> Result<Durability> {
        self.write_items_durable(&copied(items))
    }

    /// [`write_durable`](Self::write_durable) from `range` of a [`WriteBuf`], without copying
    /// it. When this returns the queue holds the buffer no longer, unless an older write of
    /// this queue that overlaps it is still held (a replay re-issues the two in order; a
    /// [`persist_own_writes`](Self::persist_own_writes) lets both go).
    ///
    /// # Errors
    /// As [`write_durable`](Self::write_durable); [`Error::InvalidArgument`] for a range outside
    /// the buffer or empty, or a buffer a Read goes into (not freed yet).
    pub fn write_durable_from(
        &mut self,
        offset: u64,
        buf: &WriteBuf,
        range: Range<usize>,
    ) -> Result<Durability> {
        let data = from_buf(buf, range)?;
        self.write_items_durable(&[(offset, data)])
    }

    /// [`write_batch_durable`](Self::write_batch_durable) from ranges of [`WriteBuf`]s, without
    /// copying them (as [`write_durable_from`](Self::write_durable_from)).
    ///
    /// # Errors
    /// As [`write_durable_from`](Self::write_durable_from), checked for every range before any
    /// is posted.
    pub fn write_batch_durable_from(
        &mut self,
        items: &[(u64, &WriteBuf, Range<usize>)],
    ) -> Result<Durability> {
        self.write_items_durable(&bufs(items)?)
    }

    fn write_items_durable(&mut self, items: &[(u64, Data<'_>)]) -> Result<Durability> {
        let d = self.desc();
        check_writable(&d)?;
        for (off, b) in items {
            check_range(&d, *off, b.len() as u64)?;
        }
        self.q.choice(self.idx)?;
        let ranges = crate::pool::merge_ranges(
            items
                .iter()
                .map(|(off, b)| (*off, off + b.len() as u64))
                .collect::<crate::pool::Ranges>(),
        );
        let idx = self.idx;
        self.q.run(OnLoss::Rerun, |q| {
            let choice = q.choice(idx)?;
            q.write_and_persist(idx, items, &ranges, choice)
        })
    }

    fn check_blocks(&self, lba: u64, len: usize) -> Result<u64> {
        let d = self.descriptor();
        let bs = u64::from(d.block_size);
        check_aligned(d, "length", len as u64, bs)?;
        lba.checked_mul(bs).ok_or(Error::OutOfRange {
            nsid: d.nsid,
            offset: u64::MAX,
            len: len as u64,
            size: d.size,
        })
    }

    /// Reads whole blocks starting at block `lba`.
    ///
    /// # Errors
    /// [`Error::Misaligned`] unless `buf.len()` is a multiple of the block size; as
    /// [`read_at`](Self::read_at).
    pub fn read_blocks(&mut self, lba: u64, buf: &mut [u8]) -> Result<()> {
        let off = self.check_blocks(lba, buf.len())?;
        self.read_at(off, buf)
    }

    /// Writes whole blocks starting at block `lba`, durably.
    ///
    /// # Errors
    /// [`Error::Misaligned`] unless `data.len()` is a multiple of the block size; as
    /// [`write_durable`](Self::write_durable).
    pub fn write_blocks(&mut self, lba: u64, data: &[u8]) -> Result<Durability> {
        let off = self.check_blocks(lba, data.len())?;
        self.write_durable(off, data)
    }

    fn remote(&self, offset: u64) -> RemoteAddr {
        let d = self.descriptor();
        RemoteAddr {
            addr: d.remote_addr + offset,
            rkey: d.rkey,
        }
    }

    fn atomic(
        &mut self,
        what: &'static str,
        offset: u64,
        op: impl Fn(&Self) -> SendOp,
    ) -> Result<u64> {
        check_atomic(self.descriptor(), offset)?;
        if !self.q.peer_has(|i| i.peer_atomics) {
            return Err(Error::Unsupported {
                op: "RFC 7306 atomics",
            });
        }
        let send = op(self);
        let idx = self.idx;
        // Not re-run after a loss: it may have executed.
        self.q.run(OnLoss::ReconnectAndFail, |q| {
            q.post_and_wait(idx, what, send.clone())?;
            q.sink_value()
        })
    }

    /// Compare and swap of the native-endian u64 at `offset` (8-byte aligned): stores `new`
    /// if it equals `expected`. Returns the value before.
    ///
    /// # Errors
    /// [`Error::Misaligned`], [`Error::OutOfRange`], [`Error::ReadOnly`],
    /// [`Error::Unsupported`]; a lost connection is reconnected but the call fails with the
    /// loss (the swap may or may not have happened).
    pub fn compare_and_swap(&mut self, offset: u64, expected: u64, new: u64) -> Result<u64> {
        self.atomic("compare and swap", offset, |me| SendOp::CompareSwap {
            local: me.q.sink(),
            remote: me.remote(offset),
            compare: expected,
            swap: new,
        })
    }

    /// Fetch and add on the native-endian u64 at `offset` (8-byte aligned, wrapping). Returns
    /// the value before.
    ///
    /// # Errors
    /// As [`compare_and_swap`](Self::compare_and_swap).
    pub fn fetch_add(&mut self, offset: u64, add: u64) -> Result<u64> {
        self.atomic("fetch and add", offset, |me| SendOp::FetchAdd {
            local: me.q.sink(),
            remote: me.remote(offset),
            add,
        })
    }

    /// Stores `value` (native endian) at `offset` (8-byte aligned) in one piece, after every
    /// earlier request (IBTA Atomic Write). Placed, not yet durable.
    ///
    /// # Errors
    /// As [`compare_and_swap`](Self::compare_and_swap); [`Error::Unsupported`] if the target
    /// did not advertise Atomic Write.
    pub fn atomic_write(&mut self, offset: u64, value: u64) -> Result<()> {
        check_atomic(self.descriptor(), offset)?;
        if !self.q.peer_has(|i| i.peer_atomic_write) {
            return Err(Error::Unsupported { op: "Atomic Write" });
        }
        let send = SendOp::AtomicWrite {
            remote: self.remote(offset),
            value,
        };
        let idx = self.idx;
        self.q.run(OnLoss::ReconnectAndFail, |q| {
            q.post_and_wait(idx, "atomic write", send.clone())
        })
    }
}
