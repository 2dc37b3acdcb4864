//! I/O commands (NVM command set) and what makes them durable.
//!
//! | command | what it does |
//! |---|---|
//! | Read | copies the range out of the namespace's mapping into one C2HData PDU |
//! | Write | copies the data (in the capsule, or each H2CData PDU as it passes its digest) into the mapping |
//! | Write Zeroes | zeroes the range (see "Zeroing") |
//! | Dataset Management | with the deallocate attribute, zeroes each range (deallocated blocks read as zeros); other attributes are hints, ignored |
//! | Flush | makes everything written to the namespace (or to every namespace, NSID FFFFFFFFh) durable |
//!
//! # Durability, per persistence domain
//!
//! - `dax` (and `dax (forced)`): every Write, Write Zeroes and deallocation is persisted (cache
//!   write-back + sfence of its range) before its completion; a namespace needs no volatile
//!   write cache, and a controller whose namespaces are all dax reports none (VWC 0). Flush and
//!   FUA then have nothing left to do and complete at once.
//! - `page-cache`: a completion means the bytes are in the page cache. The controller reports
//!   a volatile write cache (VWC 1); a Flush is an fdatasync of the namespace's file (through
//!   the loop's flusher, io_uring: the loop never waits for the disk), a Write with FUA a ranged
//!   fdatasync of its range before its completion. With the write cache disabled (Set Features
//!   06h), every Write is treated as FUA.
//! - `volatile`: nothing can make a byte durable. The controller reports a volatile write
//!   cache, and Flush and FUA complete successfully meaning "visible to every reader", as the
//!   native FlushResponse VisibleOnly does (docs/nvme-tcp.md says so).
//! - A namespace that failed (a write-back error, on any path) answers every Write, Write
//!   Zeroes, deallocation, FUA and Flush with Write Fault (DNR): nothing written to it can be
//!   made durable until an operator reopens it. Reads still work. To a controller that was
//!   attached when it failed it stays so after the operator's clear ([`NsEntry::lost`]): writes
//!   it completed may be lost, and a Flush must not vouch for them.
//!
//! # Zeroing
//!
//! On a page-cache file (not under the power-loss simulation) a range is zeroed with
//! `fallocate(FALLOC_FL_ZERO_RANGE)`: the blocks become unwritten extents that read as zeros,
//! and stay allocated. A hole punch is not used, on purpose: a namespace file is fully
//! allocated so that a store into its mapping can never meet a full filesystem (SIGBUS), and a
//! hole would undo that. Where the filesystem cannot, and on dax, volatile and simulated
//! namespaces, zeros are written through the mapping.
//!
//! The work is bounded: a Write Zeroes covers at most 1 MiB ([`WZSL`]), a deallocation at most
//! [`DM_MAX_BLOCKS`] blocks in all (both reported in the NVM command set's Identify Controller,
//! so that hosts split their requests; more is refused), and a queue zeroes at most
//! [`ZERO_BUDGET`](super::queue::ZERO_BUDGET) bytes per turn of its loop: the rest of what it
//! received waits for the next turn, after the other connections' (a burst of permitted
//! commands held the loop, every host on it and its watchdog heartbeat up for as long as it
//! took).

use std::os::fd::AsRawFd;
use std::sync::Arc;

use rpma_common::pmem::{Domain, Persist};
use rpma_common::stats::Stopwatch;

use super::command::{io, Sqe, Status, NSID_ALL};
use super::controller::{Controller, NsCounts, NsEntry};
use super::queue::{Env, Queue, MAX_TRANSFER};
use super::reply::{Flushes, Reply};
use super::state::{Input, Phase, Sink, Then};
use crate::namespace::OpenNamespace;

/// Zeros written through a mapping at a time.
static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

/// Write Zeroes Size Limit (WZSL, in the NVM command set's Identify Controller): 2^8 pages of
/// 4 KiB, 1 MiB per command. Larger is refused (Invalid Field).
pub const WZSL: u8 = 8;
/// The largest Write Zeroes in bytes.
pub const MAX_WRITE_ZEROES: u64 = 4096 << WZSL;
/// The most logical blocks a deallocation covers, in one range (DMRSL) and in all its ranges
/// (DMSL): 8 MiB at 4 KiB blocks, 1 MiB at 512. More is refused (Invalid Field); the Linux host
/// splits its discards to DMRSL.
pub const DM_MAX_BLOCKS: u32 = 2048;

/// A command's LBA range as bytes: (offset, length).
fn lba_range(ns: &OpenNamespace, slba: u64, blocks: u64) -> Result<(u64, u64), Status> {
    let bs = u64::from(ns.config.block_size);
    let nsze = ns.size() / bs;
    match slba.checked_add(blocks) {
        Some(end) if end <= nsze => Ok((slba * bs, blocks * bs)),
        _ => Err(Status::LBA_OUT_OF_RANGE),
    }
}

/// A Read's or Write's range: SLBA (dwords 10-11), NLB (dword 12, 0's based).
fn rw_range(ns: &OpenNamespace, sqe: &Sqe) -> Result<(u64, u64), Status> {
    let cdw12 = sqe.cdw(12);
    if (cdw12 >> 26) & 0xf != 0 {
        // Protection information: this namespace has none.
        return Err(Status::INVALID_FIELD);
    }
    let slba = u64::from(sqe.cdw(10)) | (u64::from(sqe.cdw(11)) << 32);
    lba_range(ns, slba, u64::from(cdw12 & 0xffff) + 1)
}

/// Checks a write to `e`: not read-only, not failed (to this controller), not taken out of
/// service by a reload that this controller's map has not heard of yet (the admin queue's loop
/// applies it in its own turn: [`OpenNamespace::retire`](crate::namespace::OpenNamespace::retire)
/// is set before any loop hears of the reload, and the reload is reported done only once every
/// loop has, so a write that passes this check lands before then).
fn writable(e: &NsEntry) -> Result<(), Status> {
    if e.ns.config.read_only {
        return Err(Status::WRITE_PROTECTED);
    }
    if e.note_failed() || e.ns.is_retired() {
        return Err(Status::WRITE_FAULT);
    }
    Ok(())
}

/// Zeroes `[offset, offset + len)` of `ns` (see "Zeroing" in the module docs).
fn zero_range(ns: &OpenNamespace, offset: u64, len: u64) -> Result<(), Status> {
    let m = &ns.mapping;
    if m.domain() == Domain::PageCache && m.simulation().is_none() {
        if let Some(fd) = m.backing_fd() {
            // SAFETY: fallocate on a descriptor the mapping keeps open for its whole life; it
            // is given no memory, and the range lies inside the file (checked by the caller).
            let r = unsafe {
                libc::fallocate(
                    fd.as_raw_fd(),
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                    offset as libc::off_t,
                    len as libc::off_t,
                )
            };
            if r == 0 {
                return Ok(());
            }
        }
    }
    let mut at = offset;
    let end = offset + len;
    while at < end {
        let n = (end - at).min(ZEROS.len() as u64) as usize;
        m.write_at(at as usize, &ZEROS[..n]).map_err(write_status)?;
        at += n as u64;
    }
    Ok(())
}

/// A write-type command's status for the pmem layer's refusal to place its bytes: Write Fault
/// for a namespace with a page the kernel could not give back (the bytes went to a page that
/// is not the file's), LBA Out of Range otherwise (the command's range was checked before).
pub(crate) fn write_status(e: rpma_common::pmem::Error) -> Status {
    match e {
        rpma_common::pmem::Error::Unreadable { .. } => Status::WRITE_FAULT,
        _ => Status::LBA_OUT_OF_RANGE,
    }
}

impl Queue {
    /// The namespace `nsid` of this I/O queue's controller (its map refreshed after a reload).
    fn io_namespace(&mut self, nsid: u32) -> Result<(Arc<Controller>, NsEntry), Status> {
        let Phase::Io(q) = &mut self.phase else {
            return Err(Status::INVALID_OPCODE);
        };
        if q.ctrl.ns_generation() != q.ns_generation {
            let (g, m) = q.ctrl.namespaces();
            q.ns_generation = g;
            q.ns = m;
        }
        let e = q.ns.get(&nsid).cloned().ok_or(Status::INVALID_NS)?;
        Ok((Arc::clone(&q.ctrl), e))
    }

    /// An I/O command.
    pub(crate) fn io_command(&mut self, sqe: &Sqe, input: &Input<'_>, env: &mut Env<'_>) -> Reply {
        let r = match sqe.opcode() {
            io::READ => self.read(sqe, input.room()),
            io::WRITE => self.write_in_capsule(sqe, input.data(), env),
            io::FLUSH => self.flush(sqe, env),
            io::WRITE_ZEROES => self.write_zeroes(sqe, env),
            io::DSM => self.deallocate(sqe, input.data(), env),
            _ => Err(Status::INVALID_OPCODE),
        };
        r.unwrap_or_else(Reply::status)
    }

    fn read(&mut self, sqe: &Sqe, room: u32) -> Result<Reply, Status> {
        let (_, e) = self.io_namespace(sqe.nsid())?;
        let (offset, len) = rw_range(&e.ns, sqe)?;
        if len > u64::from(MAX_TRANSFER) {
            return Err(Status::INVALID_FIELD);
        }
        if len != u64::from(room) {
            return Err(Status::SGL_LENGTH_INVALID);
        }
        Ok(Reply::Read {
            ns: e.ns,
            counts: e.counts,
            offset,
            len: len as u32,
        })
    }

    /// Checks a Write whose `len` bytes of data are still to come, and says where they go.
    pub(crate) fn prepare_write(&mut self, sqe: &Sqe, len: u32) -> Result<Sink, Status> {
        let (_, e) = self.io_namespace(sqe.nsid())?;
        let (offset, bytes) = rw_range(&e.ns, sqe)?;
        if bytes > u64::from(MAX_TRANSFER) {
            return Err(Status::INVALID_FIELD);
        }
        if bytes != u64::from(len) {
            return Err(Status::SGL_LENGTH_INVALID);
        }
        writable(&e)?;
        Ok(Sink::Namespace {
            ns: e.ns,
            counts: e.counts,
            offset,
            fua: sqe.cdw(12) & (1 << 30) != 0,
        })
    }

    /// Checks, once a Write's data fetched by R2T is all in, that `ns` (where its data landed,
    /// PDU by PDU) is still namespace `nsid` of this controller and has not failed meanwhile: a
    /// reload may have put another file in its place while the data came (the bytes are then
    /// in a file the host no longer reads, and the Flush that faulted for the replacement may
    /// have come and gone: answered success, the write would look durable and be lost).
    pub(crate) fn still_the_namespace(
        &mut self,
        nsid: u32,
        ns: &Arc<OpenNamespace>,
    ) -> Result<(), Status> {
        let now = self.io_namespace(nsid).map_err(|_| Status::WRITE_FAULT)?.1;
        let same = Arc::ptr_eq(&now.ns, ns)
            || (ns.file_id().is_some() && now.ns.file_id() == ns.file_id());
        if !same || ns.note_failure() || now.note_failed() {
            return Err(Status::WRITE_FAULT);
        }
        Ok(())
    }

    fn write_in_capsule(
        &mut self,
        sqe: &Sqe,
        data: &[u8],
        env: &mut Env<'_>,
    ) -> Result<Reply, Status> {
        let Sink::Namespace {
            ns,
            counts,
            offset,
            fua,
        } = self.prepare_write(sqe, data.len() as u32)?
        else {
            return Err(Status::INTERNAL);
        };
        ns.mapping
            .write_at(offset as usize, data)
            .map_err(write_status)?;
        counts.wrote(data.len() as u64);
        let len = data.len() as u64;
        Ok(self.after_write(sqe, ns, counts, offset, len, fua, env))
    }

    /// What follows bytes placed in `ns` by write-type command `sqe`: persisted at once on
    /// dax, flushed first when FUA (or with the write cache off) on page-cache, nothing more on
    /// volatile; and, before it completes with success, `ns` checked to be still its
    /// namespace ([`still_the_namespace`](Self::still_the_namespace): a reload may have put
    /// another file in its place since the command looked it up).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn after_write(
        &mut self,
        sqe: &Sqe,
        ns: Arc<OpenNamespace>,
        counts: Arc<NsCounts>,
        offset: u64,
        len: u64,
        fua: bool,
        env: &mut Env<'_>,
    ) -> Reply {
        let (cid, nsid) = (sqe.cid(), sqe.nsid());
        let wce = match &self.phase {
            Phase::Io(q) => q.ctrl.wce(),
            _ => false,
        };
        let ok = match ns.domain() {
            d if d.is_dax() => {
                let sw = Stopwatch::start();
                let done = ns.mapping.persist(offset as usize, len as usize);
                env.stats.gpspm_writeback.record_since(sw);
                if done.is_err() {
                    ns.note_failure();
                }
                done.is_ok()
            }
            Domain::PageCache if fua || !wce => {
                let target = ns.flush_target.clone();
                let counted = if fua { vec![counts] } else { Vec::new() };
                return self.wait_for(
                    Then::Write { cid, nsid },
                    vec![(target, offset, len)],
                    counted,
                    vec![ns],
                    env,
                );
            }
            _ => true,
        };
        let st = match ok {
            true => self.still_the_namespace(nsid, &ns).err(),
            false => Some(Status::WRITE_FAULT),
        };
        if fua {
            counts.durability(st.is_none());
        }
        st.map_or_else(Reply::ok, Reply::status)
    }

    fn flush(&mut self, sqe: &Sqe, env: &mut Env<'_>) -> Result<Reply, Status> {
        let all = sqe.nsid() == NSID_ALL;
        let (ctrl, entries): (_, Vec<NsEntry>) = if all {
            let Phase::Io(q) = &self.phase else {
                return Err(Status::INVALID_OPCODE);
            };
            let c = Arc::clone(&q.ctrl);
            let m = c.namespaces().1.values().cloned().collect();
            (c, m)
        } else {
            let (c, e) = self.io_namespace(sqe.nsid())?;
            (c, vec![e])
        };
        // A file a reload put in place of the one this controller wrote into: no sync now can
        // vouch for the writes answered before (they may be in the old file only).
        if ctrl.take_replaced((!all).then(|| sqe.nsid())) {
            for e in &entries {
                e.counts.durability(false);
            }
            return Err(Status::WRITE_FAULT);
        }
        let mut flushes = Vec::new();
        let mut counted = Vec::new();
        let mut namespaces = Vec::new();
        for e in entries {
            if e.note_failed() {
                e.counts.durability(false);
                return Err(Status::WRITE_FAULT);
            }
            if e.ns.domain() == Domain::PageCache {
                flushes.push((e.ns.flush_target.clone(), 0, 0));
                namespaces.push(Arc::clone(&e.ns));
            }
            counted.push(e.counts);
        }
        Ok(self.wait_for(Then::Complete(sqe.cid()), flushes, counted, namespaces, env))
    }

    fn write_zeroes(&mut self, sqe: &Sqe, env: &mut Env<'_>) -> Result<Reply, Status> {
        let (_, e) = self.io_namespace(sqe.nsid())?;
        let cdw12 = sqe.cdw(12);
        let slba = u64::from(sqe.cdw(10)) | (u64::from(sqe.cdw(11)) << 32);
        let (offset, len) = lba_range(&e.ns, slba, u64::from(cdw12 & 0xffff) + 1)?;
        if len > MAX_WRITE_ZEROES {
            return Err(Status::INVALID_FIELD);
        }
        writable(&e)?;
        self.zeroed += len;
        zero_range(&e.ns, offset, len)?;
        e.counts.wrote(len);
        let fua = cdw12 & (1 << 30) != 0;
        Ok(self.after_write(sqe, e.ns, e.counts, offset, len, fua, env))
    }

    fn deallocate(&mut self, sqe: &Sqe, data: &[u8], env: &mut Env<'_>) -> Result<Reply, Status> {
        let (_, e) = self.io_namespace(sqe.nsid())?;
        let ranges = (sqe.cdw(10) & 0xff) as usize + 1;
        if data.len() < ranges * 16 {
            return Err(Status::SGL_LENGTH_INVALID);
        }
        if sqe.cdw(11) & (1 << 2) == 0 {
            // Only hints (integral read/write): nothing to do.
            return Ok(Reply::ok());
        }
        let mut todo = Vec::with_capacity(ranges);
        let mut total = 0u64;
        for r in data[..ranges * 16].chunks_exact(16) {
            let blocks = u64::from(u32::from_le_bytes([r[4], r[5], r[6], r[7]]));
            let slba = u64::from_le_bytes([r[8], r[9], r[10], r[11], r[12], r[13], r[14], r[15]]);
            total += blocks;
            if blocks > u64::from(DM_MAX_BLOCKS) || total > u64::from(DM_MAX_BLOCKS) {
                return Err(Status::INVALID_FIELD);
            }
            if blocks > 0 {
                todo.push(lba_range(&e.ns, slba, blocks)?);
            }
        }
        writable(&e)?;
        let mut span: Option<(u64, u64)> = None;
        for &(offset, len) in &todo {
            self.zeroed += len;
            zero_range(&e.ns, offset, len)?;
            if e.ns.domain().is_dax()
                && e.ns.mapping.persist(offset as usize, len as usize).is_err()
            {
                e.ns.note_failure();
                return Err(Status::WRITE_FAULT);
            }
            span = Some(span.map_or((offset, offset + len), |(lo, hi)| {
                (lo.min(offset), hi.max(offset + len))
            }));
        }
        // On page-cache with the write cache off, the zeros are durable at the completion, as
        // a write's are (`after_write`: a sync of their span); they were left in the page
        // cache, and the old data came back after a power loss.
        match span {
            Some((lo, hi)) if e.ns.domain() == Domain::PageCache => {
                Ok(self.after_write(sqe, e.ns, e.counts, lo, hi - lo, false, env))
            }
            // Zeroed in the file it looked up: still the namespace's (as `after_write` checks).
            Some(_) => self
                .still_the_namespace(sqe.nsid(), &e.ns)
                .map(|()| Reply::ok()),
            None => Ok(Reply::ok()),
        }
    }

    /// What a shutdown notification (or the write cache turned off) makes durable: every
    /// page-cache namespace of this admin queue's controller (dax ones are durable already,
    /// volatile ones cannot be).
    pub(crate) fn flush_everything(&self) -> (Flushes, Vec<Arc<OpenNamespace>>) {
        let Phase::Admin(a) = &self.phase else {
            return (Vec::new(), Vec::new());
        };
        let (_, map) = a.ctrl.namespaces();
        map.values()
            .filter(|e| e.ns.domain() == Domain::PageCache && !e.failed())
            .map(|e| ((e.ns.flush_target.clone(), 0, 0), Arc::clone(&e.ns)))
            .unzip()
    }
}
