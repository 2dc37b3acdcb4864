//! Registered buffers for one connection's control messages: a ring of receive slots kept
//! posted (iWARP has no RNR retry: a Send that finds no receive breaks the connection) and a
//! pool of send slots, with a backlog for when every send slot is still in flight.
//!
//! Work request ids: a receive's wr_id is its slot; a send's is its slot with [`SEND_BIT`] set.

use std::collections::VecDeque;
use std::sync::Arc;

use rpma_common::fabric::{
    self, Access, AlignedBuf, Completion, MemoryRegion, ProtectionDomain, QueuePair, RecvWr,
    SendOp, SendWr, Sge,
};
use rpma_common::proto::MAX_MESSAGE_SIZE;

/// Marks a send's wr_id.
pub(crate) const SEND_BIT: u64 = 1 << 63;

/// Bytes per slot: every control message fits.
const SLOT: usize = MAX_MESSAGE_SIZE;

/// The buffers of one connection.
pub(crate) struct MsgBufs {
    recv_mem: Arc<AlignedBuf>,
    recv_mr: Arc<MemoryRegion>,
    recv_slots: usize,
    send_mem: Arc<AlignedBuf>,
    send_mr: Arc<MemoryRegion>,
    free: Vec<usize>,
    send_slots: usize,
    backlog: VecDeque<Vec<u8>>,
}

impl std::fmt::Debug for MsgBufs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MsgBufs")
            .field("recv_slots", &self.recv_slots)
            .field("sends_in_flight", &(self.send_slots - self.free.len()))
            .field("backlog", &self.backlog.len())
            .finish()
    }
}

impl MsgBufs {
    /// Allocates and registers `recv_slots` receive and `send_slots` send slots in `pd`. Neither
    /// region has a remote right: the peer cannot reach them with an rkey.
    pub(crate) fn new(
        pd: &ProtectionDomain,
        recv_slots: usize,
        send_slots: usize,
    ) -> fabric::Result<MsgBufs> {
        let recv_mem = AlignedBuf::new(recv_slots * SLOT)?;
        let recv_mr = pd.register(Arc::clone(&recv_mem), Access::LOCAL_WRITE)?;
        let send_mem = AlignedBuf::new(send_slots * SLOT)?;
        let send_mr = pd.register(Arc::clone(&send_mem), Access::empty())?;
        Ok(MsgBufs {
            recv_mem,
            recv_mr,
            recv_slots,
            send_mem,
            send_mr,
            free: (0..send_slots).rev().collect(),
            send_slots,
            backlog: VecDeque::new(),
        })
    }

    /// The receive request for `slot`.
    pub(crate) fn recv_wr(&self, slot: usize) -> RecvWr {
        RecvWr {
            wr_id: slot as u64,
            local: Some(Sge::new(&self.recv_mr, slot * SLOT, SLOT)),
        }
    }

    /// How many receive slots there are (all of them are posted at the start).
    pub(crate) fn recv_slots(&self) -> usize {
        self.recv_slots
    }

    /// Copies the message a successful receive completion delivered into `out`; returns its
    /// slot, to post again. None if the completion names no receive slot of ours.
    pub(crate) fn take(&self, c: &Completion, out: &mut Vec<u8>) -> Option<usize> {
        let slot = usize::try_from(c.wr_id)
            .ok()
            .filter(|&s| s < self.recv_slots)?;
        let len = (c.byte_len as usize).min(SLOT);
        out.clear();
        out.resize(len, 0);
        self.recv_mem.read_at(slot * SLOT, out).ok()?;
        Some(slot)
    }

    /// Sends `msg` (at most [`MAX_MESSAGE_SIZE`] bytes) now, or when a send slot frees up.
    ///
    /// # Errors
    /// What posting the Send fails with (the queue pair is in Error).
    pub(crate) fn send(&mut self, qp: &QueuePair, msg: &[u8]) -> fabric::Result<()> {
        if msg.len() > SLOT {
            return Err(fabric::Error::InvalidWorkRequest {
                reason: "control message larger than MAX_MESSAGE_SIZE",
            });
        }
        match self.free.pop() {
            Some(slot) if self.backlog.is_empty() => self.post(qp, slot, msg),
            Some(slot) => {
                self.free.push(slot);
                self.backlog.push_back(msg.to_vec());
                Ok(())
            }
            None => {
                self.backlog.push_back(msg.to_vec());
                Ok(())
            }
        }
    }

    fn post(&mut self, qp: &QueuePair, slot: usize, msg: &[u8]) -> fabric::Result<()> {
        // Cannot fail: the slot lies inside the buffer and msg fits a slot (checked by send).
        self.send_mem.write_at(slot * SLOT, msg)?;
        let wr = SendWr::new(
            SEND_BIT | slot as u64,
            SendOp::Send {
                local: Sge::new(&self.send_mr, slot * SLOT, msg.len()),
            },
        );
        if let Err(e) = qp.post_send(wr) {
            self.free.push(slot);
            return Err(e);
        }
        Ok(())
    }

    /// A send completed (successfully or not): its slot is free again, and the oldest message
    /// of the backlog goes out in it.
    ///
    /// # Errors
    /// What posting the backlog's next Send fails with.
    pub(crate) fn on_send_done(&mut self, qp: &QueuePair, wr_id: u64) -> fabric::Result<()> {
        let slot = (wr_id & !SEND_BIT) as usize;
        if slot < self.send_slots && !self.free.contains(&slot) {
            self.free.push(slot);
        }
        while let Some(slot) = self.free.pop() {
            let Some(msg) = self.backlog.pop_front() else {
                self.free.push(slot);
                break;
            };
            self.post(qp, slot, &msg)?;
        }
        Ok(())
    }
}
