//! Single requests the caller waits for, outside the bounce slots: APM Reads, atomics, Atomic
//! Writes and Flushes (a fresh wr_id each, their completions kept in `waited_done` by the
//! poll), and GPSPM FlushRequests (the last one's answer kept in `flush_answer`), with the 8-byte
//! sink that APM Reads and atomic results land in.

use rpma_common::fabric::{SendOp, SendWr, Sge, WcStatus};
use rpma_common::proto::msgbuf::CONTROL_BIT;
use rpma_common::proto::FlushStatus;

use super::Engine;
use crate::error::{Error, Result};
use crate::queue::completion::{KIND_MASK, KIND_WAITED};

impl Engine {
    /// Posts a request outside the bounce slots (APM Read, atomic, Atomic Write, Flush) and
    /// waits for its completion.
    pub(in crate::queue) fn post_and_wait(
        &mut self,
        ns: usize,
        what: &'static str,
        op: SendOp,
    ) -> Result<()> {
        let wr = self.waited_wr(op);
        let wr_id = wr.wr_id;
        self.post_one(wr)?;
        self.wait_for_request(ns, what, wr_id)
    }

    /// A request outside the bounce slots with a fresh wr_id (post it, then
    /// [`wait_for_request`](Self::wait_for_request)).
    pub(in crate::queue) fn waited_wr(&mut self, op: SendOp) -> SendWr {
        self.next_waited += 1;
        let wr_id = KIND_WAITED | (self.next_waited & !KIND_MASK & !CONTROL_BIT);
        SendWr::new(wr_id, op)
    }

    /// Waits for the request `wr_id` of [`waited_wr`](Self::waited_wr) to complete. Several may
    /// be in flight: wait for them in the order they were made (the completions of earlier ones,
    /// waited for or abandoned, are dropped once a later one is found).
    pub(in crate::queue) fn wait_for_request(
        &mut self,
        ns: usize,
        what: &'static str,
        wr_id: u64,
    ) -> Result<()> {
        let deadline = crate::deadline::after(self.timeout);
        loop {
            if let Some(&(_, status)) = self.waited_done.iter().find(|d| d.0 == wr_id) {
                // wr_ids of waited requests grow (within the kind's bits): older entries
                // belong to requests nobody waits for any longer.
                self.waited_done.retain(|d| d.0 > wr_id);
                if status == WcStatus::Success {
                    return Ok(());
                }
                return Err(self.completion_error(ns, what, status));
            }
            self.poll_or_time_out(deadline, what)?;
        }
    }

    /// Sends a GPSPM FlushRequest for `[offset, offset + len)` of namespace `ns` (0, 0: the
    /// whole namespace) and waits for its answer.
    pub(in crate::queue) fn flush_request(
        &mut self,
        ns: usize,
        offset: u64,
        len: u64,
    ) -> Result<FlushStatus> {
        let nsid = self.descs[ns].nsid;
        self.doorbells += 1;
        let token = self
            .session
            .as_mut()
            .ok_or(Error::Broken)?
            .send_flush_request(nsid, offset, len)?;
        let deadline = crate::deadline::after(self.timeout);
        loop {
            if let Some((_, status)) = self.flush_answer.take_if(|a| a.0 == token) {
                return Ok(status);
            }
            self.poll_or_time_out(deadline, "flush response")?;
        }
    }

    /// The value the last atomic left in the sink.
    pub(in crate::queue) fn sink_value(&self) -> Result<u64> {
        self.pool.sink_value().map_err(|source| Error::Fabric {
            op: "reading an atomic result",
            source,
        })
    }

    /// The 8-byte sink for APM Reads and atomic results.
    pub(in crate::queue) fn sink(&self) -> Sge {
        self.pool.sink_sge()
    }
}
