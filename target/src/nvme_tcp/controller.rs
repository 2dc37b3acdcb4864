//! A controller: what its admin queue and its I/O queues (each a TCP connection of its own,
//! maybe served by different poll loops) share. The admin queue owns it: it is created by the
//! admin Connect and dies with the admin queue's connection or its keep-alive, taking its I/O
//! queues with it (they look at [`Controller::is_dead`] on every turn).
//!
//! # What it holds
//!
//! - the controller registers a host reads and writes with Property Get/Set (CAP, VS, CC,
//!   CSTS): enable, disable, shutdown;
//! - the features (number of queues, keep-alive timer, asynchronous event configuration,
//!   volatile write cache enable) and the asynchronous events waiting for a request;
//! - the namespaces of its subsystem, as a map the I/O queues read under a generation counter
//!   (a reload swaps it; an I/O queue takes the new one at its next command);
//! - what it served, per namespace ([`Counts`]), for `status` and the metrics.
//!
//! # A namespace that failed under it
//!
//! A page-cache namespace whose write-back fails while the controller is attached may take
//! with it writes the controller completed without FUA: they were only in the page cache, and
//! an NVMe host keeps no copy to write again (the native protocol's hosts hold their writes and
//! re-issue them). An operator's clear-failure makes the namespace healthy for everyone else,
//! but to this controller it stays failed ([`NsEntry::lost`]) for the rest of its life: a
//! Flush that succeeded now would vouch for the lost writes. A controller connected while the
//! namespace was failed completed no write to it, and one connected after the clear gets the
//! healthy opening.
//!
//! # Durability
//!
//! [`Controller::vwc`] is decided when it is created, from its namespaces' domains: a volatile
//! write cache exists unless every namespace is `dax` (where each Write is made durable before
//! its completion). It never changes for the life of the controller: a reload that would need
//! it to (a page-cache namespace added to an all-dax subsystem) closes the controller, and the
//! host reconnects to one that reports it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use rpma_common::pmem::Domain;
use rpma_common::proto::nqn::Nqn;

use super::identify::{namespace_ids, CtrlKind, NVME_VERSION};
use crate::metrics::{DataCounters, Outcomes};
use crate::namespace::OpenNamespace;
use crate::serve::session_info::SessionCounts;

/// The most I/O queues a controller grants (the Linux host asks for one per CPU).
pub const MAX_IO_QUEUES: u16 = 16;

/// CC fields.
mod cc {
    pub const EN: u32 = 1;
    pub fn css(cc: u32) -> u32 {
        (cc >> 4) & 0x7
    }
    pub fn mps(cc: u32) -> u32 {
        (cc >> 7) & 0xf
    }
    pub fn ams(cc: u32) -> u32 {
        (cc >> 11) & 0x7
    }
    pub fn shn(cc: u32) -> u32 {
        (cc >> 14) & 0x3
    }
    pub fn iosqes(cc: u32) -> u32 {
        (cc >> 16) & 0xf
    }
    pub fn iocqes(cc: u32) -> u32 {
        (cc >> 20) & 0xf
    }
}

/// CSTS fields.
pub mod csts {
    /// Ready.
    pub const RDY: u32 = 1;
    /// Controller fatal status.
    pub const CFS: u32 = 1 << 1;
    /// Shutdown processing occurring.
    pub const SHST_OCCURRING: u32 = 1 << 2;
    /// Shutdown processing complete.
    pub const SHST_COMPLETE: u32 = 2 << 2;
    /// The SHST field.
    pub const SHST_MASK: u32 = 3 << 2;
}

/// Property offsets.
pub mod prop {
    /// Controller Capabilities (8 bytes).
    pub const CAP: u32 = 0x00;
    /// Version.
    pub const VS: u32 = 0x08;
    /// Controller Configuration.
    pub const CC: u32 = 0x14;
    /// Controller Status.
    pub const CSTS: u32 = 0x1c;
}

/// Asynchronous event results (completion dword 0).
pub mod aen {
    /// Notice: namespace attribute changed; read the Changed Namespace List (04h).
    pub const NS_CHANGED: u32 = 0x0004_0002;
    /// Notice: discovery log page changed (70h).
    pub const DISCOVERY_CHANGED: u32 = 0x0070_f002;
    /// AEC bit enabling namespace attribute notices.
    pub const AEC_NS_ATTR: u32 = 1 << 8;
    /// AEC bit enabling discovery log change notices.
    pub const AEC_DISCOVERY: u32 = 1 << 31;
}

/// What an I/O queue of this controller served on a namespace (single atomics: several queues,
/// on several loops, add to them).
#[derive(Debug, Default)]
pub struct NsCounts {
    writes: AtomicU64,
    write_bytes: AtomicU64,
    reads: AtomicU64,
    read_bytes: AtomicU64,
    flush_ok: AtomicU64,
    flush_failed: AtomicU64,
}

impl NsCounts {
    /// A Write (or Write Zeroes, or a deallocation) of `bytes`.
    pub fn wrote(&self, bytes: u64) {
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.write_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A Read of `bytes`.
    pub fn read(&self, bytes: u64) {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.read_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A durability request (Flush, or a Write with FUA) answered.
    pub fn durability(&self, ok: bool) {
        let c = if ok {
            &self.flush_ok
        } else {
            &self.flush_failed
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn data(&self) -> DataCounters {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut d = DataCounters {
            writes: get(&self.writes),
            write_bytes: get(&self.write_bytes),
            reads: get(&self.reads),
            read_bytes: get(&self.read_bytes),
            ..DataCounters::default()
        };
        d.durability.flush = Outcomes {
            ok: get(&self.flush_ok),
            failed: get(&self.flush_failed),
        };
        d
    }
}

/// A controller's counts per namespace, kept for every namespace it ever served.
#[derive(Debug, Default)]
pub struct Counts(Mutex<BTreeMap<u32, Arc<NsCounts>>>);

impl Counts {
    fn of(&self, nsid: u32) -> Arc<NsCounts> {
        Arc::clone(
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(nsid)
                .or_default(),
        )
    }

    /// Everything counted, summed over the namespaces (for the SMART log).
    pub fn total(&self) -> DataCounters {
        let mut t = DataCounters::default();
        for c in self.0.lock().unwrap_or_else(|p| p.into_inner()).values() {
            t.add(&c.data());
        }
        t
    }
}

impl SessionCounts for Counts {
    fn per_namespace(&self) -> Vec<(u32, DataCounters)> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(n, c)| (*n, c.data()))
            .collect()
    }
}

/// A namespace as a controller serves it.
#[derive(Debug, Clone)]
pub struct NsEntry {
    /// The open namespace.
    pub ns: Arc<OpenNamespace>,
    /// Its counts on this controller.
    pub counts: Arc<NsCounts>,
    /// Its NGUID (from the namespace's identity: [`namespace_ids`]).
    pub nguid: [u8; 16],
    /// Its UUID (likewise).
    pub uuid: [u8; 16],
    /// This controller was served this file while it was healthy (it may have completed writes
    /// that only the page cache held); kept across reopenings of the same file.
    pub served_healthy: bool,
    /// It failed while this controller was attached and had been served it healthy: writes the
    /// controller completed may be lost, so to this controller it answers as failed for good,
    /// whatever opening it is now served (see the module docs).
    pub lost: bool,
}

impl NsEntry {
    /// Whether it answers as failed to this controller: its opening failed, or it is
    /// [`NsEntry::lost`].
    pub fn failed(&self) -> bool {
        self.lost || self.ns.failure().is_some()
    }

    /// As [`NsEntry::failed`], logging a failure of the opening the first time it is seen
    /// ([`OpenNamespace::note_failure`]): for the durability requests it refuses.
    pub fn note_failed(&self) -> bool {
        self.lost || self.ns.note_failure()
    }
}

/// Namespaces by nsid.
pub type NsMap = BTreeMap<u32, NsEntry>;

/// Whether a namespace in `domain` needs a volatile write cache to be reported: every domain
/// but dax, where each Write is persisted before its completion.
pub fn needs_vwc(domain: Domain) -> bool {
    !domain.is_dax()
}

/// The shared, mutable part.
#[derive(Debug)]
struct State {
    cc: u32,
    csts: u32,
    /// I/O queues granted (Set Features Number of Queues), not 0's based.
    io_queues: u16,
    /// I/O queue ids connected.
    connected: BTreeSet<u16>,
    aec: u32,
    /// Volatile write cache enabled (Set Features 06h); only meaningful with [`Controller::vwc`].
    wce: bool,
    kato: Duration,
    last_keep_alive: Instant,
    /// Namespaces changed since the Changed Namespace List was last read.
    changed: BTreeSet<u32>,
    /// Page-cache namespaces whose file a reload replaced (or removed) under this controller:
    /// writes it answered without FUA may be in the old file's page cache only, which no sync
    /// of the new file covers. Their next Flush answers Write Fault, once; a shutdown while
    /// any is listed sets CFS.
    replaced: BTreeSet<u32>,
    /// Namespaces that failed while this controller was attached and had been served them
    /// healthy ([`NsEntry::lost`]); kept when a reload removes one, should it come back.
    lost: BTreeSet<u32>,
    /// Events waiting for an Asynchronous Event Request.
    events: VecDeque<u32>,
    /// Event types reported and not yet cleared by reading their log page.
    masked: BTreeSet<u32>,
}

/// A controller (see the module docs).
#[derive(Debug)]
pub struct Controller {
    /// Its id.
    pub cntlid: u16,
    /// I/O or discovery.
    pub kind: CtrlKind,
    /// Its subsystem.
    pub subsystem: Nqn,
    /// The host.
    pub host: Nqn,
    /// The host's identifier.
    pub host_id: [u8; 16],
    /// A volatile write cache is reported (see the module docs).
    pub vwc: bool,
    /// The largest queue a host may create (MQES + 1).
    pub queue_entries: u16,
    state: Mutex<State>,
    namespaces: RwLock<Arc<NsMap>>,
    ns_generation: AtomicU64,
    dead: AtomicBool,
    /// What it served.
    pub counts: Arc<Counts>,
}

/// What a write to CC did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CcChange {
    /// Nothing that needs the queue's attention.
    None,
    /// Enabled: CSTS.RDY is set.
    Enabled,
    /// Disabled (reset): outstanding asynchronous event requests are aborted.
    Disabled,
    /// Shutdown notification: make everything durable, then [`Controller::shutdown_done`].
    Shutdown,
}

impl Controller {
    /// A controller of `subsystem` for `host` serving `namespaces` (its subsystem's), with
    /// `kato` as the keep-alive timeout (zero: none), queues of at most `queue_entries`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cntlid: u16,
        kind: CtrlKind,
        subsystem: Nqn,
        host: Nqn,
        host_id: [u8; 16],
        namespaces: Vec<Arc<OpenNamespace>>,
        kato: Duration,
        queue_entries: u16,
        now: Instant,
    ) -> Controller {
        let counts = Arc::new(Counts::default());
        let vwc = kind == CtrlKind::Io && namespaces.iter().any(|n| needs_vwc(n.domain()));
        let map = Self::map_of(
            &subsystem,
            namespaces,
            &counts,
            &NsMap::new(),
            &BTreeSet::new(),
        );
        Controller {
            cntlid,
            kind,
            subsystem,
            host,
            host_id,
            vwc,
            queue_entries: queue_entries.max(2),
            state: Mutex::new(State {
                cc: 0,
                csts: 0,
                io_queues: MAX_IO_QUEUES,
                connected: BTreeSet::new(),
                aec: 0,
                wce: true,
                kato,
                last_keep_alive: now,
                changed: BTreeSet::new(),
                replaced: BTreeSet::new(),
                lost: BTreeSet::new(),
                events: VecDeque::new(),
                masked: BTreeSet::new(),
            }),
            namespaces: RwLock::new(Arc::new(map)),
            ns_generation: AtomicU64::new(0),
            dead: AtomicBool::new(false),
            counts,
        }
    }

    /// The entries of `namespaces`, carrying over from `old` (the map they replace) whether
    /// the same file was served healthy, and marking those in `lost`.
    fn map_of(
        subsystem: &Nqn,
        namespaces: Vec<Arc<OpenNamespace>>,
        counts: &Counts,
        old: &NsMap,
        lost: &BTreeSet<u32>,
    ) -> NsMap {
        namespaces
            .into_iter()
            .map(|ns| {
                let nsid = ns.config.nsid;
                let (nguid, uuid) = namespace_ids(subsystem, nsid, ns.identity());
                let served_before = old.get(&nsid).is_some_and(|p| {
                    p.served_healthy && p.ns.file_id().is_some() && p.ns.file_id() == ns.file_id()
                });
                let e = NsEntry {
                    counts: counts.of(nsid),
                    served_healthy: served_before || ns.failure().is_none(),
                    lost: lost.contains(&nsid),
                    ns,
                    nguid,
                    uuid,
                };
                (nsid, e)
            })
            .collect()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The namespaces now, and their generation (it changes when a reload swaps them).
    pub fn namespaces(&self) -> (u64, Arc<NsMap>) {
        let g = self.ns_generation.load(Ordering::Acquire);
        let m = Arc::clone(&self.namespaces.read().unwrap_or_else(|p| p.into_inner()));
        (g, m)
    }

    /// The generation of the namespace map (cheap: one load).
    pub fn ns_generation(&self) -> u64 {
        self.ns_generation.load(Ordering::Acquire)
    }

    /// Swaps in the namespaces of a reload (or of a cleared failure); `changed` (added,
    /// removed or replaced nsids) are reported to the host as a namespace attribute notice, if
    /// it asked for those. Returns the nsids that became [`NsEntry::lost`] to this controller:
    /// their opening failed while it was attached and had been served them healthy.
    pub fn set_namespaces(&self, namespaces: Vec<Arc<OpenNamespace>>, changed: &[u32]) -> Vec<u32> {
        let mut st = self.state();
        let mut newly_lost = Vec::new();
        let old = self.namespaces().1;
        for (nsid, e) in old.iter() {
            // The old opening stays failed (a clear makes a new one), so this is seen here
            // whether the failure was cleared or not.
            if e.served_healthy && e.ns.failure().is_some() && st.lost.insert(*nsid) {
                newly_lost.push(*nsid);
            }
        }
        let map = Self::map_of(&self.subsystem, namespaces, &self.counts, &old, &st.lost);
        let map = Arc::new(map);
        *self.namespaces.write().unwrap_or_else(|p| p.into_inner()) = Arc::clone(&map);
        self.ns_generation.fetch_add(1, Ordering::AcqRel);
        if changed.is_empty() {
            return newly_lost;
        }
        for (nsid, e) in old.iter() {
            let same_file = map
                .get(nsid)
                .is_some_and(|n| n.ns.file_id().is_some() && n.ns.file_id() == e.ns.file_id());
            if e.ns.domain() == Domain::PageCache && !same_file {
                st.replaced.insert(*nsid);
            }
        }
        st.changed.extend(changed.iter().copied());
        Self::raise(&mut st, aen::NS_CHANGED, aen::AEC_NS_ATTR);
        newly_lost
    }

    /// Whether a Flush of `nsid` (None: every namespace) must answer Write Fault, because a
    /// reload replaced a page-cache namespace's file under this controller since its last
    /// Flush of it (see `State::replaced`). Said once per replacement.
    pub fn take_replaced(&self, nsid: Option<u32>) -> bool {
        let mut st = self.state();
        match nsid {
            Some(n) => st.replaced.remove(&n),
            None => !std::mem::take(&mut st.replaced).is_empty(),
        }
    }

    /// Reports a discovery log page change (discovery controllers), if the host asked for it.
    pub fn discovery_changed(&self) {
        let mut st = self.state();
        Self::raise(&mut st, aen::DISCOVERY_CHANGED, aen::AEC_DISCOVERY);
    }

    fn raise(st: &mut State, event: u32, enabled_by: u32) {
        if st.aec & enabled_by == 0 || st.masked.contains(&event) || st.events.contains(&event) {
            return;
        }
        st.events.push_back(event);
    }

    /// The next event for an outstanding Asynchronous Event Request (masked until its log page
    /// is read).
    pub fn take_event(&self) -> Option<u32> {
        let mut st = self.state();
        let e = st.events.pop_front()?;
        st.masked.insert(e);
        Some(e)
    }

    /// The Changed Namespace List; with `clear` (RAE 0) it is emptied and the notice unmasked.
    pub fn changed_namespaces(&self, clear: bool) -> Vec<u32> {
        let mut st = self.state();
        let list = st.changed.iter().copied().collect();
        if clear {
            st.changed.clear();
            st.masked.remove(&aen::NS_CHANGED);
        }
        list
    }

    /// The discovery log page was read (RAE 0): its notice is unmasked.
    pub fn discovery_log_read(&self) {
        self.state().masked.remove(&aen::DISCOVERY_CHANGED);
    }

    /// CAP: MQES, a 7.5 s ready timeout, the NVM command set, 4 KiB pages only.
    pub fn cap(&self) -> u64 {
        u64::from(self.queue_entries - 1) | (15u64 << 24) | (1u64 << 37)
    }

    /// VS.
    pub fn vs(&self) -> u32 {
        NVME_VERSION
    }

    /// CC.
    pub fn cc(&self) -> u32 {
        self.state().cc
    }

    /// CSTS.
    pub fn csts(&self) -> u32 {
        self.state().csts
    }

    /// Whether CSTS.RDY is set (commands other than Fabrics ones are served only then).
    pub fn ready(&self) -> bool {
        self.csts() & csts::RDY != 0
    }

    /// A host writes CC.
    pub fn set_cc(&self, new: u32) -> CcChange {
        let mut st = self.state();
        let old = st.cc;
        st.cc = new;
        let mut change = CcChange::None;
        if new & cc::EN != 0 && old & cc::EN == 0 {
            let valid = cc::css(new) == 0
                && cc::mps(new) == 0
                && cc::ams(new) == 0
                && cc::iosqes(new) == 6
                && cc::iocqes(new) == 4;
            if valid {
                st.csts = csts::RDY;
                change = CcChange::Enabled;
            } else {
                st.csts = csts::CFS;
            }
        } else if new & cc::EN == 0 && old & cc::EN != 0 {
            st.csts = 0;
            change = CcChange::Disabled;
        }
        if cc::shn(new) != 0 && cc::shn(old) == 0 {
            st.csts = (st.csts & !csts::SHST_MASK) | csts::SHST_OCCURRING;
            change = CcChange::Shutdown;
        } else if cc::shn(new) == 0 {
            st.csts &= !csts::SHST_MASK;
        }
        change
    }

    /// Shutdown processing is complete: everything written before the notification is
    /// durable when `durable` and no reload replaced a namespace's file since the host last
    /// heard so from a Flush (`State::replaced`: writes it answered may be in the old file
    /// only, which the shutdown's syncs do not cover); otherwise (a flush failed, a namespace
    /// of the controller had failed, or a file was replaced) Controller Fatal Status is set
    /// with it, so that a host does not take the completed shutdown for its data being safe.
    pub fn shutdown_done(&self, durable: bool) {
        let mut st = self.state();
        if st.csts & csts::SHST_MASK == csts::SHST_OCCURRING {
            st.csts = (st.csts & !csts::SHST_MASK) | csts::SHST_COMPLETE;
            if !durable || !st.replaced.is_empty() {
                st.csts |= csts::CFS;
            }
        }
    }

    /// Whether a namespace of this controller has failed (a write-back error), or is
    /// [`NsEntry::lost`] to it, served or not: one a reload removed since still lost writes
    /// this controller completed (SMART's "reliability degraded", CSTS.CFS at a shutdown).
    pub fn any_failed(&self) -> bool {
        let lost = !self.state().lost.is_empty();
        lost || self.namespaces().1.values().any(NsEntry::failed)
    }

    /// Whether the host shut the controller down (CC.SHN written) before it went away.
    pub fn was_shut_down(&self) -> bool {
        self.csts() & csts::SHST_MASK != 0
    }

    /// Set Features Number of Queues: grants up to [`MAX_IO_QUEUES`]; returns the grant (not
    /// 0's based).
    pub fn set_io_queues(&self, asked: u16) -> u16 {
        let mut st = self.state();
        st.io_queues = asked.clamp(1, MAX_IO_QUEUES);
        st.io_queues
    }

    /// I/O queues granted.
    pub fn io_queues(&self) -> u16 {
        self.state().io_queues
    }

    /// Connects I/O queue `qid`: false if it is not granted or already connected.
    pub fn attach_io_queue(&self, qid: u16) -> bool {
        let mut st = self.state();
        qid >= 1 && qid <= st.io_queues && st.connected.insert(qid)
    }

    /// I/O queue `qid` went away.
    pub fn detach_io_queue(&self, qid: u16) {
        self.state().connected.remove(&qid);
    }

    /// Asynchronous Event Configuration.
    pub fn aec(&self) -> u32 {
        self.state().aec
    }

    /// Sets the Asynchronous Event Configuration.
    pub fn set_aec(&self, aec: u32) {
        self.state().aec = aec;
    }

    /// Volatile write cache enabled (always false without one).
    pub fn wce(&self) -> bool {
        self.vwc && self.state().wce
    }

    /// Enables or disables the volatile write cache; false if there is none to enable.
    pub fn set_wce(&self, on: bool) -> bool {
        if !self.vwc {
            return false;
        }
        self.state().wce = on;
        true
    }

    /// The keep-alive timeout (zero: none).
    pub fn kato(&self) -> Duration {
        self.state().kato
    }

    /// Sets the keep-alive timeout.
    pub fn set_kato(&self, kato: Duration, now: Instant) {
        let mut st = self.state();
        st.kato = kato;
        st.last_keep_alive = now;
    }

    /// A Keep Alive command came.
    pub fn keep_alive(&self, now: Instant) {
        self.state().last_keep_alive = now;
    }

    /// When the keep-alive lapses, if there is one.
    pub fn keep_alive_deadline(&self) -> Option<Instant> {
        let st = self.state();
        (!st.kato.is_zero()).then(|| st.last_keep_alive + st.kato)
    }

    /// The controller is gone: its I/O queues close.
    pub fn kill(&self) {
        self.dead.store(true, Ordering::Release);
    }

    /// Whether it is gone.
    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests;
