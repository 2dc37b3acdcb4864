//! [`Namespace`]: reads, writes, persists and atomics on one namespace through a [`Queue`].
//!
//! Every call checks its arguments against the namespace descriptor before anything is posted
//! (bounds, alignment, read-only) and returns only when its requests completed: a write when
//! its bytes were handed to the transport (sent: the target does not acknowledge a Write, and
//! nothing is durable yet), a durable call when the target acknowledged durability. Inside one call up to the queue depth of requests are in
//! flight; the batch calls put many independent transfers in flight at once.

use rpma_common::fabric::{RemoteAddr, SendOp, SendWr};
use rpma_common::proto::NamespaceDescriptor;

use crate::durability::{Choice, Durability, PersistMethod};
use crate::error::{Error, Result};
use crate::pool::{Slot, WriteRec};
use crate::queue::Queue;

/// One namespace, borrowed from its queue.
#[derive(Debug)]
pub struct Namespace<'q> {
    q: &'q mut Queue,
    idx: usize,
}

/// `len` bytes at `offset` lie inside the namespace.
///
/// # Errors
/// [`Error::OutOfRange`].
pub fn check_range(d: &NamespaceDescriptor, offset: u64, len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= d.size => Ok(()),
        _ => Err(Error::OutOfRange {
            nsid: d.nsid,
            offset,
            len,
            size: d.size,
        }),
    }
}

/// The namespace takes writes (and durability requests).
///
/// # Errors
/// [`Error::ReadOnly`], [`Error::NamespaceFailed`].
pub fn check_writable(d: &NamespaceDescriptor) -> Result<()> {
    if d.read_only {
        return Err(Error::ReadOnly { nsid: d.nsid });
    }
    check_healthy(d)
}

/// The target has not failed the namespace.
///
/// # Errors
/// [`Error::NamespaceFailed`].
pub fn check_healthy(d: &NamespaceDescriptor) -> Result<()> {
    match &d.failure {
        Some(reason) => Err(Error::NamespaceFailed {
            nsid: d.nsid,
            reason: reason.clone(),
        }),
        None => Ok(()),
    }
}

/// `value` (an offset or a length) is a multiple of `align`.
///
/// # Errors
/// [`Error::Misaligned`].
pub fn check_aligned(
    d: &NamespaceDescriptor,
    what: &'static str,
    value: u64,
    align: u64,
) -> Result<()> {
    if !value.is_multiple_of(align) {
        return Err(Error::Misaligned {
            nsid: d.nsid,
            what,
            value,
            align,
        });
    }
    Ok(())
}

/// An 8-byte atomic at `offset`: aligned, inside, writable.
///
/// # Errors
/// [`Error::Misaligned`], [`Error::OutOfRange`], [`Error::ReadOnly`].
pub fn check_atomic(d: &NamespaceDescriptor, offset: u64) -> Result<()> {
    check_aligned(d, "offset", offset, 8)?;
    check_range(d, offset, 8)?;
    check_writable(d)
}

impl<'q> Namespace<'q> {
    pub(crate) fn new(q: &'q mut Queue, idx: usize) -> Namespace<'q> {
        Namespace { q, idx }
    }

    /// The descriptor (it changes across a reconnect: new rkey and address).
    pub fn descriptor(&self) -> &NamespaceDescriptor {
        &self.q.ns[self.idx].desc
    }

    fn desc(&self) -> NamespaceDescriptor {
        self.q.ns[self.idx].desc.clone()
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
        self.q.run(true, |q| read_items(q, idx, items))
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
        let d = self.desc();
        check_writable(&d)?;
        for (off, b) in items {
            check_range(&d, *off, b.len() as u64)?;
        }
        let idx = self.idx;
        self.q.run(true, |q| {
            write_items(q, idx, items, None)?;
            q.drain()
        })
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
        self.q.run(true, |q| {
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
        let d = self.desc();
        check_writable(&d)?;
        check_range(&d, offset, data.len() as u64)?;
        self.q.choice(self.idx)?;
        let idx = self.idx;
        let len = data.len() as u64;
        self.q.run(true, |q| {
            let choice = q.choice(idx)?;
            match q.persist_request(idx, offset, len, choice) {
                Some((what, op)) => {
                    let tail = q.small_wr(op);
                    let id = tail.wr_id;
                    write_items(q, idx, &[(offset, data)], Some(tail))?;
                    q.wait_small(idx, what, id)?;
                    Ok(q.persisted(idx, offset, len, choice))
                }
                None => {
                    write_items(q, idx, &[(offset, data)], None)?;
                    q.persist_range(idx, offset, len, choice)
                }
            }
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
        self.q.run(false, |q| {
            q.small_op(idx, what, send.clone())?;
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
        self.q
            .run(false, |q| q.small_op(idx, "atomic write", send.clone()))
    }
}

/// Posts the Writes of `items` through the bounce slots, as many per doorbell as there are
/// free slots, and `tail` (a request that must follow them) with the last of them. Returns
/// once everything is posted; the completions are the caller's to wait for.
fn write_items(
    q: &mut Queue,
    idx: usize,
    items: &[(u64, &[u8])],
    tail: Option<SendWr>,
) -> Result<()> {
    let chunk = q.pool.chunk();
    let mut pending = Vec::new();
    for (off, data) in items {
        for (i, piece) in data.chunks(chunk).enumerate() {
            let slot = match q.pool.take_free() {
                Some(s) => s,
                None => {
                    // Out of slots: what is pending goes out before waiting for completions.
                    q.post_list(std::mem::take(&mut pending))?;
                    loop {
                        if let Some(s) = q.free_slot()? {
                            break s;
                        }
                    }
                }
            };
            if let Err(source) = q.pool.fill(slot, piece) {
                q.pool.untake(slot);
                return Err(Error::Fabric {
                    op: "filling a bounce buffer",
                    source,
                });
            }
            let rec = WriteRec {
                ns: idx,
                offset: off + (i * chunk) as u64,
                len: piece.len(),
                seq: q.pool.next_seq(),
            };
            pending.push(q.write_wr(slot, rec));
        }
    }
    pending.extend(tail);
    q.post_list(pending)
}

fn collect_reads(q: &mut Queue, items: &mut [(u64, &mut [u8])]) -> Result<()> {
    while let Some(slot) = q.reads_done.pop() {
        if let Some(Slot::ReadDone { item, at, len }) = q.pool.get(slot) {
            let out = &mut items[item].1[at..at + len];
            q.pool.copy_out(slot, out).map_err(|source| Error::Fabric {
                op: "copying a read out",
                source,
            })?;
            q.pool.set(slot, Slot::Free);
        }
    }
    Ok(())
}

fn read_items(q: &mut Queue, idx: usize, items: &mut [(u64, &mut [u8])]) -> Result<()> {
    let chunk = q.pool.chunk();
    for item in 0..items.len() {
        let (off, total) = (items[item].0, items[item].1.len());
        let mut at = 0;
        while at < total {
            let len = chunk.min(total - at);
            let slot = loop {
                collect_reads(q, items)?;
                if let Some(s) = q.free_slot()? {
                    break s;
                }
            };
            q.post_read_slot(slot, idx, off + at as u64, len, item, at)?;
            at += len;
        }
    }
    let deadline = std::time::Instant::now() + q.options_timeout();
    loop {
        collect_reads(q, items)?;
        if q.pool.count(|s| matches!(s, Slot::Reading { .. })) == 0 {
            return Ok(());
        }
        q.pump_until(deadline, "read completions")?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpma_common::proto::{DurabilityMethods, PersistenceDomain};

    fn desc(read_only: bool) -> NamespaceDescriptor {
        NamespaceDescriptor {
            nsid: 2,
            size: 1 << 20,
            block_size: 512,
            remote_addr: 0x10000,
            rkey: 1,
            domain: PersistenceDomain::PageCache,
            durability: DurabilityMethods::GPSPM,
            atomic_write_unit: 8,
            read_only,
            failure: None,
        }
    }

    #[test]
    fn a_failed_namespace_takes_no_writes_and_says_why() {
        let mut d = desc(false);
        assert!(check_writable(&d).is_ok());
        d.failure = Some("fdatasync failed: Input/output error (os error 5)".into());
        let e = check_writable(&d).unwrap_err();
        assert!(matches!(e, Error::NamespaceFailed { nsid: 2, .. }), "{e:?}");
        let t = e.to_string();
        assert!(
            t.contains("FAILED") && t.contains("Input/output error"),
            "{t}"
        );
        assert!(
            check_range(&d, 0, 8).is_ok(),
            "reads are still checked as usual"
        );
    }

    #[test]
    fn ranges_are_checked_without_overflow() {
        let d = desc(false);
        assert!(check_range(&d, 0, 1 << 20).is_ok());
        assert!(check_range(&d, (1 << 20) - 1, 1).is_ok());
        assert!(check_range(&d, 1 << 20, 0).is_ok());
        let e = check_range(&d, 1 << 20, 1).unwrap_err();
        assert!(
            matches!(
                e,
                Error::OutOfRange {
                    nsid: 2,
                    offset: 1048576,
                    len: 1,
                    size: 1048576
                }
            ),
            "{e}"
        );
        assert!(check_range(&d, u64::MAX, 2).is_err());
        assert!(check_range(&d, 0, u64::MAX).is_err());
    }

    #[test]
    fn atomics_need_alignment_room_and_write_access() {
        let d = desc(false);
        assert!(check_atomic(&d, 8).is_ok());
        assert!(matches!(
            check_atomic(&d, 4),
            Err(Error::Misaligned {
                align: 8,
                value: 4,
                ..
            })
        ));
        assert!(matches!(
            check_atomic(&d, 1 << 20),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            check_atomic(&desc(true), 0),
            Err(Error::ReadOnly { nsid: 2 })
        ));
        assert!(check_writable(&desc(true))
            .unwrap_err()
            .to_string()
            .contains("read-only"));
    }

    #[test]
    fn block_alignment_names_the_field() {
        let d = desc(false);
        assert!(check_aligned(&d, "length", 1024, 512).is_ok());
        let e = check_aligned(&d, "length", 1000, 512).unwrap_err();
        assert_eq!(
            e.to_string(),
            "length 1000 is not a multiple of 512 on namespace 2"
        );
    }
}
