//! Started requests: Writes and Reads the caller starts one by one and learns the completion
//! of later, so that a queue can stay full (a new request as soon as one completes) instead of
//! waiting for a whole batch.
//!
//! A started request takes a bounce slot like any other. It is not posted at once: started
//! requests collect and go out together, behind one doorbell, when the caller waits
//! ([`Queue::wait_started`](crate::Queue::wait_started)) or anything else is posted. Started
//! Reads beyond [`QueueOptions::read_bytes_in_flight`](crate::QueueOptions::read_bytes_in_flight),
//! and what was started after them, wait for completions to make room (the engine's
//! `deferred_that_fit`): a start never waits for the bound. A started Write's slot is held
//! until a durability acknowledgement covers it, as every write's; a started Read's slot is
//! free again once its bytes are taken ([`Queue::take_read`](crate::Queue::take_read)).
//!
//! Here the engine makes them and hands back their completions; what a caller knows them by
//! ([`Ticket`], [`Completed`]) is plain data in completion.rs, and the
//! [`Queue`](crate::Queue) runs them under its reconnect policy.

use std::os::fd::BorrowedFd;

use rpma_common::fabric::SendFlags;

use super::{Engine, MakeRoom};
use crate::error::{Error, Result};
use crate::pool::{Kind, Slot, WriteRec};
use crate::queue::completion::{Completed, Ticket};
use crate::writebuf::{Data, WriteBuf};

impl Engine {
    /// A free slot for a started request: waits for completions, and makes held writes durable
    /// (`room`) when every slot holds one.
    fn slot_for_start(&mut self, room: &(impl MakeRoom + ?Sized)) -> Result<usize> {
        // Not a batch: free_slot does not stop for a batch's completed Reads, so it returns a
        // slot or an error.
        loop {
            if let Some(s) = self.free_slot(room, false)? {
                return Ok(s);
            }
        }
    }

    /// Starts a Write of `data` (at most one chunk: [`check_one_chunk`](Self::check_one_chunk))
    /// at `offset` of namespace `idx`; the caller checked the range. `fence`: the Write starts
    /// only after every Read before it completed. It goes out with the next post or wait.
    pub(in crate::queue) fn start_write(
        &mut self,
        room: &(impl MakeRoom + ?Sized),
        idx: usize,
        offset: u64,
        data: Data<'_>,
        fence: bool,
    ) -> Result<Ticket> {
        let slot = self.slot_for_start(room)?;
        self.load(slot, data, false)?;
        let seq = self.pool.next_seq();
        let rec = WriteRec {
            ns: idx,
            offset,
            len: data.len(),
            seq,
            notify: true,
        };
        let mut wr = self.write_wr_superseding(slot, rec);
        if fence {
            wr = wr.with_flags(SendFlags::SIGNALED | SendFlags::FENCE);
        }
        self.deferred.push(wr);
        Ok(Ticket(seq))
    }

    /// Starts a Read of `len` bytes (at most one chunk) at `offset` of namespace `idx`; the
    /// caller checked the range. It goes out with the next post or wait.
    pub(in crate::queue) fn start_read(
        &mut self,
        room: &(impl MakeRoom + ?Sized),
        idx: usize,
        offset: u64,
        len: usize,
    ) -> Result<Ticket> {
        let slot = self.slot_for_start(room)?;
        Ok(self.defer_read(slot, idx, offset, len))
    }

    /// [`start_read`](Self::start_read) into `len` bytes from `at` of `buf` (registered in
    /// this queue's domain the first time) instead of a slot: the queue holds the buffer until
    /// [`finish_read`](Self::finish_read) (or [`take_read`](Self::take_read)) frees the slot.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::queue) fn start_read_into(
        &mut self,
        room: &(impl MakeRoom + ?Sized),
        idx: usize,
        offset: u64,
        buf: &WriteBuf,
        at: usize,
        len: usize,
    ) -> Result<Ticket> {
        let slot = self.slot_for_start(room)?;
        self.load(slot, Data::Buf { buf, at, len }, true)?;
        Ok(self.defer_read(slot, idx, offset, len))
    }

    /// Loads `data` into the taken `slot` (a copy, or the caller's buffer registered); gives
    /// the slot back if that fails.
    fn load(&mut self, slot: usize, data: Data<'_>, read: bool) -> Result<()> {
        self.pool.load(slot, data, read).map_err(|source| {
            self.pool.untake(slot);
            Error::Fabric {
                op: data.load_op(),
                source,
            }
        })
    }

    /// The started Read of `len` bytes at `offset` of namespace `idx` into the taken `slot`:
    /// marked, and deferred to the next post or wait.
    fn defer_read(&mut self, slot: usize, idx: usize, offset: u64, len: usize) -> Ticket {
        let ticket = self.pool.next_seq();
        let wr = self.read_wr(slot, idx, offset, len);
        self.pool.set(
            slot,
            Slot::Started {
                ns: idx,
                ticket,
                len,
            },
        );
        self.deferred.push(wr);
        Ticket(ticket)
    }

    /// The slot and length of the completed started Read `ticket`.
    fn done_read(&self, ticket: Ticket) -> Result<(usize, usize)> {
        self.pool.done_read(ticket.0).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "ticket {} is not a completed read of this queue",
                ticket.0
            ))
        })
    }

    /// Frees the slot of the completed started Read `ticket` without copying its bytes (a
    /// Read into the caller's buffer: they are there). A Read into a slot of the queue is
    /// refused: its bytes would be lost (`take_read` them).
    pub(in crate::queue) fn finish_read(&mut self, ticket: Ticket) -> Result<()> {
        let (slot, _) = self.done_read(ticket)?;
        if !self.pool.is_ext(slot) {
            return Err(Error::InvalidArgument(format!(
                "ticket {} read into a slot of the queue, not a buffer: take its bytes with \
                 take_read",
                ticket.0
            )));
        }
        self.pool.set(slot, Slot::Free);
        Ok(())
    }

    /// Refuses a started request of `len` bytes unless it fits one slot.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`].
    pub(in crate::queue) fn check_one_chunk(&self, len: usize) -> Result<()> {
        if len == 0 || len > self.pool.chunk() {
            return Err(Error::InvalidArgument(format!(
                "a started request moves 1 to {} bytes (the queue's chunk), not {len}",
                self.pool.chunk()
            )));
        }
        Ok(())
    }

    /// Posts the started requests not posted yet, waits until at least one started request
    /// completed and moves the completed ones into `out`; returns at once when none is
    /// outstanding ([`Queue::wait_started`](super::Queue::wait_started)).
    pub(in crate::queue) fn wait_started(&mut self, out: &mut Vec<Completed>) -> Result<()> {
        self.wait_started_or(out, None).map(|_| ())
    }

    /// [`wait_started`](Self::wait_started) that also returns, true and adding nothing, as
    /// soon as `input` is readable ([`Queue::wait_started_or`](super::Queue::wait_started_or)).
    pub(in crate::queue) fn wait_started_or(
        &mut self,
        out: &mut Vec<Completed>,
        input: Option<BorrowedFd<'_>>,
    ) -> Result<bool> {
        let deadline = crate::deadline::after(self.timeout);
        loop {
            if !self.started_done.is_empty() {
                out.append(&mut self.started_done);
                self.post_list(super::SendList::new())?;
                return Ok(false);
            }
            if self.pool.number(Kind::StartedOutstanding) == 0 {
                return Ok(false);
            }
            if self.poll_or_input(deadline, "started requests", input)?
                && self.started_done.is_empty()
            {
                return Ok(true);
            }
        }
    }

    /// Copies the bytes of the completed started Read `ticket` into `buf` and frees its slot
    /// ([`Queue::take_read`](super::Queue::take_read)).
    pub(in crate::queue) fn take_read(&mut self, ticket: Ticket, buf: &mut [u8]) -> Result<()> {
        let (slot, len) = self.done_read(ticket)?;
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
