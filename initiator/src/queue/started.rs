//! Started requests: Writes and Reads the caller starts one by one and learns the completion
//! of later, so that a queue can stay full (a new request as soon as one completes) instead of
//! waiting for a whole batch.
//!
//! A started request takes a bounce slot like any other. It is not posted at once: started
//! requests collect and go out together, behind one doorbell, when the caller waits
//! ([`Queue::wait_started`]) or anything else is posted. A started Write's slot is held until a
//! durability acknowledgement covers it, as every write's; a started Read's slot is free again
//! once its bytes are taken ([`Queue::take_read`]).

use std::time::Instant;

use rpma_common::fabric::SendFlags;

use super::{OnLoss, Queue};
use crate::error::{Error, Result};
use crate::pool::{Kind, Slot, WriteRec};

/// What a started request is known by: unique within its queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub(crate) u64);

/// A started request that completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Completed {
    /// The Write was handed to the transport: sent, as after `write_at` (not durable; the
    /// queue keeps its bytes until a durability call covers them).
    Write(Ticket),
    /// The Read's bytes are in the queue: take them with [`Queue::take_read`].
    Read(Ticket),
}

impl Queue {
    /// A free slot for a started request: waits for completions, and makes held writes durable
    /// when every slot holds one.
    fn slot_for_start(&mut self) -> Result<usize> {
        let deadline = Instant::now() + self.conn.options.timeout;
        loop {
            if let Some(s) = self.pool.take_free() {
                return Ok(s);
            }
            if self.pool.in_flight() == 0 {
                if self.pool.number(Kind::Held) == 0 {
                    return Err(Error::InvalidArgument(
                        "every bounce slot holds a completed read: take_read them first".into(),
                    ));
                }
                self.persist_held()?;
                continue;
            }
            self.poll_or_time_out(deadline, "a free request slot")?;
        }
    }

    /// Starts a Write of `data` (at most one chunk) at `offset` of namespace `idx`; the
    /// caller checked the range. `fence`: the Write starts only after every Read before it
    /// completed.
    pub(crate) fn start_write(
        &mut self,
        idx: usize,
        offset: u64,
        data: &[u8],
        fence: bool,
    ) -> Result<Ticket> {
        self.check_one_chunk(data.len())?;
        self.run(OnLoss::ReconnectAndFail, |q| {
            let slot = q.slot_for_start()?;
            if let Err(source) = q.pool.fill(slot, data) {
                q.pool.untake(slot);
                return Err(Error::Fabric {
                    op: "filling a bounce buffer",
                    source,
                });
            }
            let seq = q.pool.next_seq();
            let rec = WriteRec {
                ns: idx,
                offset,
                len: data.len(),
                seq,
                notify: true,
            };
            q.pool.supersede(&rec);
            let mut wr = q.write_wr(slot, rec);
            if fence {
                wr = wr.with_flags(SendFlags::SIGNALED | SendFlags::FENCE);
            }
            q.deferred.push(wr);
            Ok(Ticket(seq))
        })
    }

    /// Starts a Read of `len` bytes (at most one chunk) at `offset` of namespace `idx`; the
    /// caller checked the range.
    pub(crate) fn start_read(&mut self, idx: usize, offset: u64, len: usize) -> Result<Ticket> {
        self.check_one_chunk(len)?;
        self.run(OnLoss::ReconnectAndFail, |q| {
            let slot = q.slot_for_start()?;
            let ticket = q.pool.next_seq();
            let wr = q.read_wr(slot, idx, offset, len);
            q.pool.set(
                slot,
                Slot::Started {
                    ns: idx,
                    ticket,
                    len,
                },
            );
            q.reads_posted += 1;
            q.deferred.push(wr);
            Ok(Ticket(ticket))
        })
    }

    fn check_one_chunk(&self, len: usize) -> Result<()> {
        if len == 0 || len > self.pool.chunk() {
            return Err(Error::InvalidArgument(format!(
                "a started request moves 1 to {} bytes (the queue's chunk), not {len}",
                self.pool.chunk()
            )));
        }
        Ok(())
    }

    /// Posts the started requests not posted yet, waits until at least one started request
    /// completed and moves the completed ones into `out`. Returns at once, adding nothing, when
    /// no started request is outstanding.
    ///
    /// # Errors
    /// A time-out, or what the data calls return. After a lost connection (reported as an
    /// error; the queue reconnects) the started Reads that had not completed are void: start
    /// them again. Started Writes are re-issued by the reconnect and still complete (each
    /// reported once); completions already collected, and completed Reads' bytes, stay.
    pub fn wait_started(&mut self, out: &mut Vec<Completed>) -> Result<()> {
        self.run(OnLoss::ReconnectAndFail, |q| {
            let deadline = Instant::now() + q.conn.options.timeout;
            loop {
                if !q.started_done.is_empty() {
                    out.append(&mut q.started_done);
                    q.post_list(Vec::new())?;
                    return Ok(());
                }
                if q.pool.number(Kind::StartedOutstanding) == 0 {
                    return Ok(());
                }
                q.poll_or_time_out(deadline, "started requests")?;
            }
        })
    }

    /// Copies the bytes of the completed started Read `ticket` into `buf` (its length) and
    /// frees its slot.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `ticket` is not a completed Read of this queue (a Write,
    /// not completed yet, taken already, or void after a reconnect) or `buf` is not its length.
    pub fn take_read(&mut self, ticket: Ticket, buf: &mut [u8]) -> Result<()> {
        let Some((slot, len)) = self.pool.done_read(ticket.0) else {
            return Err(Error::InvalidArgument(format!(
                "ticket {} is not a completed read of this queue",
                ticket.0
            )));
        };
        if buf.len() != len {
            return Err(Error::InvalidArgument(format!(
                "ticket {} read {len} bytes, not {}",
                ticket.0,
                buf.len()
            )));
        }
        let r = self
            .pool
            .copy_out(slot, buf)
            .map_err(|source| Error::Fabric {
                op: "copying a read out",
                source,
            });
        self.pool.set(slot, Slot::Free);
        r
    }
}
