//! Registered buffers for one connection's control messages: a ring of receive slots kept
//! posted (iWARP has no RNR retry: a Send that finds no receive breaks the connection) and a
//! pool of send slots, with a backlog for when every send slot is still in flight.
//!
//! Both ends use it: the target for each connection it serves, the initiator for its session.
//!
//! Work request ids: the control messages' requests carry [`CONTROL_BIT`] (a data path sharing
//! the queue pair must not use wr_ids with that bit); a receive's is that bit and its slot, a
//! send's also has [`SEND_BIT`].
//!
//! Memory: every region stays registered (and their buffers alive) as long as the `MsgBufs`;
//! the owner keeps it until its queue pair is dropped, so no posted request outlives them.

use std::collections::VecDeque;
use std::sync::Arc;

use super::MAX_MESSAGE_SIZE;
use crate::fabric::{
    self, Access, AlignedBuf, Completion, MemoryRegion, ProtectionDomain, QueuePair, RecvWr,
    SendOp, SendWr, Sge,
};

/// Marks the control messages' work requests.
pub const CONTROL_BIT: u64 = 1 << 63;
/// Marks a control send's wr_id (with [`CONTROL_BIT`]).
pub const SEND_BIT: u64 = 1 << 62;

/// Bytes per slot: every control message fits.
pub const SLOT: usize = MAX_MESSAGE_SIZE;

/// A run of slots in one registered buffer.
struct Region {
    mem: Arc<AlignedBuf>,
    mr: Arc<MemoryRegion>,
    /// The first slot number in this region.
    first: usize,
    slots: usize,
}

impl Region {
    fn new(
        pd: &ProtectionDomain,
        first: usize,
        slots: usize,
        access: Access,
    ) -> fabric::Result<Region> {
        let mem = AlignedBuf::new(slots * SLOT)?;
        let mr = pd.register(Arc::clone(&mem), access)?;
        Ok(Region {
            mem,
            mr,
            first,
            slots,
        })
    }
}

/// The region holding `slot`, and the slot's byte offset in it.
fn locate(regions: &[Region], slot: usize) -> Option<(&Region, usize)> {
    regions
        .iter()
        .find(|r| (r.first..r.first + r.slots).contains(&slot))
        .map(|r| (r, (slot - r.first) * SLOT))
}

/// The buffers of one connection.
///
/// They may start small and [`grow`](MsgBufs::grow) later: the target gives a connection only
/// the few slots its control exchange needs until the host is admitted.
pub struct MsgBufs {
    recv: Vec<Region>,
    recv_slots: usize,
    send: Vec<Region>,
    free: Vec<usize>,
    send_slots: usize,
    backlog: VecDeque<Vec<u8>>,
}

impl std::fmt::Debug for MsgBufs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MsgBufs")
            .field("recv_slots", &self.recv_slots)
            .field("send_slots", &self.send_slots)
            .field("sends_in_flight", &(self.send_slots - self.free.len()))
            .field("backlog", &self.backlog.len())
            .finish()
    }
}

impl MsgBufs {
    /// Allocates and registers `recv_slots` receive and `send_slots` send slots in `pd`. Neither
    /// region has a remote right: the peer cannot reach them with an rkey.
    ///
    /// # Errors
    /// What allocating or registering the buffers fails with.
    pub fn new(
        pd: &ProtectionDomain,
        recv_slots: usize,
        send_slots: usize,
    ) -> fabric::Result<MsgBufs> {
        let recv = Region::new(pd, 0, recv_slots, Access::LOCAL_WRITE)?;
        let send = Region::new(pd, 0, send_slots, Access::empty())?;
        Ok(MsgBufs {
            recv: vec![recv],
            recv_slots,
            send: vec![send],
            free: (0..send_slots).rev().collect(),
            send_slots,
            backlog: VecDeque::new(),
        })
    }

    /// Adds `recv` receive slots (posted on `qp` at once, after the ones posted already) and
    /// `send` send slots, in new regions of `pd`.
    ///
    /// # Errors
    /// What allocating, registering or posting fails with; the slots that were added stay.
    pub fn grow(
        &mut self,
        pd: &ProtectionDomain,
        qp: &QueuePair,
        recv: usize,
        send: usize,
    ) -> fabric::Result<()> {
        if send > 0 {
            self.send
                .push(Region::new(pd, self.send_slots, send, Access::empty())?);
            self.free.extend(self.send_slots..self.send_slots + send);
            self.send_slots += send;
        }
        if recv > 0 {
            let first = self.recv_slots;
            self.recv
                .push(Region::new(pd, first, recv, Access::LOCAL_WRITE)?);
            self.recv_slots += recv;
            for slot in first..first + recv {
                qp.post_recv(self.recv_wr(slot))?;
            }
        }
        Ok(())
    }

    /// The receive request for `slot` (a slot number below [`recv_slots`](Self::recv_slots)).
    pub fn recv_wr(&self, slot: usize) -> RecvWr {
        RecvWr {
            wr_id: CONTROL_BIT | slot as u64,
            local: locate(&self.recv, slot).map(|(r, off)| Sge::new(&r.mr, off, SLOT)),
        }
    }

    /// How many receive slots there are (all of them are posted: at the start, or by
    /// [`grow`](Self::grow)).
    pub fn recv_slots(&self) -> usize {
        self.recv_slots
    }

    /// How many send slots there are (more messages wait in the backlog).
    pub fn send_slots(&self) -> usize {
        self.send_slots
    }

    /// Sends posted and not completed, plus the backlog.
    pub fn unsent(&self) -> usize {
        self.backlog.len() + (self.send_slots - self.free.len())
    }

    /// Copies the message a successful receive completion delivered into `out`; returns its
    /// slot, to post again. None if the completion names no receive slot of ours (a data-path
    /// request's, a send's, a slot number out of range); `out` is then left alone.
    pub fn take(&self, c: &Completion, out: &mut Vec<u8>) -> Option<usize> {
        if c.wr_id & (CONTROL_BIT | SEND_BIT) != CONTROL_BIT {
            return None;
        }
        let slot = usize::try_from(c.wr_id & !CONTROL_BIT).ok()?;
        let (r, off) = locate(&self.recv, slot)?;
        let len = (c.byte_len as usize).min(SLOT);
        out.clear();
        out.resize(len, 0);
        r.mem.read_at(off, out).ok()?;
        Some(slot)
    }

    /// Sends `msg` (at most [`MAX_MESSAGE_SIZE`] bytes) now, or when a send slot frees up.
    ///
    /// # Errors
    /// What posting the Send fails with (the queue pair is in Error).
    pub fn send(&mut self, qp: &QueuePair, msg: &[u8]) -> fabric::Result<()> {
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
        let Some((r, off)) = locate(&self.send, slot) else {
            return Err(fabric::Error::InvalidWorkRequest {
                reason: "no such send slot",
            });
        };
        // Cannot fail: the slot lies inside the buffer and msg fits a slot (checked by send).
        r.mem.write_at(off, msg)?;
        let wr = SendWr::new(
            CONTROL_BIT | SEND_BIT | slot as u64,
            SendOp::Send {
                local: Sge::new(&r.mr, off, msg.len()),
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
    pub fn on_send_done(&mut self, qp: &QueuePair, wr_id: u64) -> fabric::Result<()> {
        let slot = (wr_id & !(CONTROL_BIT | SEND_BIT)) as usize;
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::fabric::{CompletionQueue, ConnParams, Context, Listener, QpCaps, WcStatus};

    struct End {
        pd: ProtectionDomain,
        qp: QueuePair,
        cq: CompletionQueue,
        bufs: MsgBufs,
    }

    /// Two connected ends over 127.0.0.1, each with `recv` receive and `send` send slots posted.
    fn pair(recv: usize, send: usize) -> (End, End) {
        let ctx = Context::soft();
        let listener = Listener::bind(&ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
        let url = listener.url().unwrap();
        let make = move |ctx: &Context| {
            let pd = ctx.alloc_pd().unwrap();
            let cq = ctx.create_cq(64).unwrap();
            // Room for the slots a test grows.
            let caps = QpCaps {
                max_send_wr: send.max(16),
                max_recv_wr: recv.max(16),
            };
            let qp = pd.create_qp(&cq, &cq, caps).unwrap();
            let bufs = MsgBufs::new(&pd, recv, send).unwrap();
            for slot in 0..bufs.recv_slots() {
                qp.post_recv(bufs.recv_wr(slot)).unwrap();
            }
            (pd, qp, cq, bufs)
        };
        let tctx = ctx.clone();
        let t = std::thread::spawn(move || {
            let req = listener.accept(&ConnParams::default()).unwrap();
            let (pd, qp, cq, bufs) = make(&tctx);
            let qp = req.accept(qp, &ConnParams::default(), &[]).unwrap();
            End { pd, qp, cq, bufs }
        });
        let (pd, qp, cq, bufs) = make(&ctx);
        let qp = qp.connect(&url, &ConnParams::default(), &[]).unwrap();
        (End { pd, qp, cq, bufs }, t.join().unwrap())
    }

    /// Drives both ends until `to` received `n` messages; returns them in arrival order.
    fn exchange(from: &mut End, to: &mut End, n: usize) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut wcs = [Completion::EMPTY; 16];
        while got.len() < n {
            assert!(
                Instant::now() < deadline,
                "only {} of {n} arrived",
                got.len()
            );
            let k = from.cq.poll(&mut wcs).unwrap();
            for c in &wcs[..k] {
                assert_eq!(c.status, WcStatus::Success);
                assert_eq!(c.wr_id & (CONTROL_BIT | SEND_BIT), CONTROL_BIT | SEND_BIT);
                from.bufs.on_send_done(&from.qp, c.wr_id).unwrap();
            }
            let k = to
                .cq
                .wait(&mut wcs, Some(Duration::from_millis(5)))
                .unwrap();
            for c in &wcs[..k] {
                assert_eq!(c.status, WcStatus::Success);
                let mut m = Vec::new();
                let slot = to.bufs.take(c, &mut m).expect("a receive slot of ours");
                to.qp.post_recv(to.bufs.recv_wr(slot)).unwrap();
                got.push(m);
            }
        }
        got
    }

    #[test]
    fn messages_beyond_the_send_slots_wait_in_order() {
        let (mut a, mut b) = pair(16, 2);
        let msgs: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i; 1 + i as usize * 100]).collect();
        for m in &msgs {
            a.bufs.send(&a.qp, m).unwrap();
        }
        // Two in flight, eight in the backlog.
        assert_eq!(a.bufs.unsent(), 10);
        assert_eq!(exchange(&mut a, &mut b, 10), msgs);
        // The last completions free the last slots.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut wcs = [Completion::EMPTY; 4];
        while a.bufs.unsent() > 0 {
            assert!(Instant::now() < deadline);
            let k = a.cq.wait(&mut wcs, Some(Duration::from_millis(5))).unwrap();
            for c in &wcs[..k] {
                a.bufs.on_send_done(&a.qp, c.wr_id).unwrap();
            }
        }
        // And the other way.
        b.bufs.send(&b.qp, b"back").unwrap();
        assert_eq!(exchange(&mut b, &mut a, 1), [b"back".to_vec()]);
    }

    #[test]
    fn an_oversize_message_is_refused() {
        let (a, _b) = pair(2, 2);
        let mut bufs = a.bufs;
        let e = bufs.send(&a.qp, &vec![0; SLOT + 1]).unwrap_err();
        assert!(matches!(e, fabric::Error::InvalidWorkRequest { .. }), "{e}");
        assert_eq!(bufs.unsent(), 0);
        // A message of exactly one slot is fine.
        bufs.send(&a.qp, &vec![7; SLOT]).unwrap();
        assert_eq!(bufs.unsent(), 1);
    }

    #[test]
    fn completions_of_other_requests_are_not_taken() {
        let (a, _b) = pair(4, 2);
        let mut out = vec![1, 2, 3];
        let mut c = Completion::EMPTY;
        // A data-path wr_id (no CONTROL_BIT) with the number of a valid slot.
        c.wr_id = 1;
        assert_eq!(a.bufs.take(&c, &mut out), None);
        // A control wr_id past the receive slots, and a send's.
        c.wr_id = CONTROL_BIT | 4;
        assert_eq!(a.bufs.take(&c, &mut out), None);
        c.wr_id = CONTROL_BIT | SEND_BIT;
        assert_eq!(a.bufs.take(&c, &mut out), None);
        assert_eq!(out, [1, 2, 3]);
    }

    #[test]
    fn grown_slots_carry_messages_after_the_first_ones() {
        let (mut a, mut b) = pair(2, 1);
        b.bufs.grow(&b.pd, &b.qp, 6, 0).unwrap();
        a.bufs.grow(&a.pd, &a.qp, 0, 3).unwrap();
        assert_eq!((b.bufs.recv_slots(), a.bufs.send_slots), (8, 4));
        // Eight messages at once: only the grown receive slots make room for them.
        let msgs: Vec<Vec<u8>> = (0..8u8).map(|i| vec![i; 10 + i as usize * 1000]).collect();
        for m in &msgs {
            a.bufs.send(&a.qp, m).unwrap();
        }
        assert_eq!(exchange(&mut a, &mut b, 8), msgs);
        let mut c = Completion::EMPTY;
        c.wr_id = CONTROL_BIT | 8;
        assert_eq!(b.bufs.take(&c, &mut Vec::new()), None, "past the last slot");
    }
}
