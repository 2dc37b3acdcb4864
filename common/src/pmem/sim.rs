//! The power-loss simulation (test and debug only): a store in which the bytes that survive a
//! "power loss" are exactly those that reached the persistence domain.
//!
//! A simulated [`Mapping`](super::Mapping) hands the fabric and every reader a *working* copy
//! of the namespace in anonymous memory (the CPU caches and DRAM of the model). The namespace's
//! backing file is the *media*: it receives a unit (a 64-byte cache line on dax, a page on
//! page-cache, what the real write-back covers) only when
//!
//! - a persist covers it (cache write-back + fence for dax, msync for page-cache), a drain
//!   follows a flush of it, or the target's flush service is about to fdatasync it (GPSPM), or
//! - it is *evicted*: at every persist, flush or drain, the units of a random 64 KiB window
//!   that differ from the media are each written to it with probability
//!   [`Simulation::eviction_percent`] (seeded, so a run is reproducible for the same sequence
//!   of calls), as a cache evicts dirty lines or the kernel writes dirty pages back on its own;
//!   with [`Simulation::eviction_interval_ms`], also that often from a thread of its own, so
//!   that a write still being placed when the process dies may have reached the media in part
//!   (what the windows hit then depends on timing: the seed fixes only which windows).
//!
//! The process dying is the power loss: after a SIGKILL the working copy is gone, and the next
//! open reads the media back into a new one. The media is written with pwrite, so it survives
//! the death of the process in the page cache; the real persist of the backing file still runs
//! after the copy, so costs and write-back errors are those of the real domain.
//!
//! Ordering: a unit is copied as a snapshot of its working content taken under the
//! simulation's lock, and every copy to the media (persist and eviction alike) takes that lock.
//! Stores to the working copy only move forward in time, so a copy made after a completed
//! persist carries content at least as new as what that persist wrote: the media never goes
//! back to content older than a completed persist gave it. An evicted unit may be written
//! while a Write into it is being placed (a torn unit): that is what an unacknowledged write
//! may look like after a power loss.
//!
//! A clean close (the last mapping dropped) is not a power loss: the whole working copy is
//! written to the media, as the kernel would write back the page cache. Every opening of one
//! file in a process shares one simulation, so a reload that reopens a namespace while older
//! sessions still hold it sees one cache, as with a real page cache.
//!
//! [`Simulation::broken_persist`] is fault injection for the crash tests: persist, flush, drain
//! and the flush service's sync copy nothing and still answer durable. Only eviction and a
//! clean close reach the media then, so a crash test that cannot tell must fail.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::domain::{Domain, Durability, SyncFailure};
use super::error::Result;
use super::media::Media;
use super::persist::Persist;

/// What every interface appends to the domain of a simulated namespace.
pub const SIMULATION_LABEL: &str = "power-loss simulation (test only)";

/// Bytes of the window examined for eviction at each persist, flush or drain.
const EVICTION_WINDOW: usize = 64 << 10;

/// The largest copy made in one go (a persist of more is made in pieces of this).
const CHUNK: usize = 1 << 20;

/// Settings of the power-loss simulation of one namespace (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Simulation {
    /// Seeds the choice of evicted units.
    pub seed: u64,
    /// The chance, in percent (0-100), that an unpersisted unit in the window examined at a
    /// persist, flush or drain is written to the media; 0 turns eviction off.
    pub eviction_percent: u8,
    /// Also examine a window this often (ms) from a thread of the simulation's own; 0: only at
    /// persists, flushes and drains.
    pub eviction_interval_ms: u32,
    /// Fault injection: persists copy nothing to the media and still answer durable.
    pub broken_persist: bool,
}

impl Default for Simulation {
    /// Seed 1, eviction 50 % at persists, flushes and drains (no timer), persists working.
    fn default() -> Simulation {
        Simulation {
            seed: 1,
            eviction_percent: 50,
            eviction_interval_ms: 0,
            broken_persist: false,
        }
    }
}

impl Simulation {
    /// "power-loss simulation (test only)", with "persist BROKEN" when it is.
    pub fn label(&self) -> String {
        if self.broken_persist {
            format!("{SIMULATION_LABEL}, persist BROKEN")
        } else {
            SIMULATION_LABEL.to_owned()
        }
    }
}

/// What a simulation did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Persists, flushes, drains and syncs seen.
    pub events: u64,
    /// Units copied to the media because a persist, drain or sync covered them.
    pub persisted_units: u64,
    /// Unpersisted units copied to the media by eviction.
    pub evicted_units: u64,
}

struct State {
    rng: u64,
    /// Flushed ranges (unit-aligned) waiting for a drain.
    pending: Vec<(usize, usize)>,
    stats: SimStats,
}

/// One file's simulation: the working copy, what the media holds, and the media file.
pub(super) struct Sim {
    opts: Simulation,
    /// 64 on dax, the page size on page-cache.
    unit: usize,
    len: usize,
    /// What the process reads and writes (registered with the fabric).
    working: Media,
    /// A copy of what the media holds: the simulation is its only writer.
    shadow: Media,
    media: File,
    key: (u64, u64),
    /// Set by a simulated power loss (and until the working copy is read in): nothing is
    /// written back at the close.
    lost: AtomicBool,
    /// In the registry (so its Drop must take the registry's lock to leave it).
    registered: AtomicBool,
    state: Mutex<State>,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("opts", &self.opts)
            .field("unit", &self.unit)
            .field("len", &self.len)
            .finish()
    }
}

type Registry = Mutex<HashMap<(u64, u64), Weak<Sim>>>;

/// The live simulations of this process, by (device, inode) of the media file.
fn registry() -> &'static Registry {
    static REG: OnceLock<Registry> = OnceLock::new();
    REG.get_or_init(Default::default)
}

/// Why a simulation could not be set up for a file that is otherwise fine.
#[derive(Debug)]
pub(super) enum OpenError {
    Io(io::Error),
    /// Open already, with other settings or another size.
    Mismatch(&'static str),
}

/// The registry's key of a file: (device, inode).
fn key_of(media: &File) -> std::result::Result<(u64, u64), OpenError> {
    let meta = media.metadata().map_err(OpenError::Io)?;
    Ok((meta.dev(), meta.ino()))
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl State {
    /// xorshift64*: small, seeded, good enough to pick windows and coin flips.
    fn next(&mut self) -> u64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

impl Sim {
    /// The simulation of `media` (`len` bytes, in units of `unit`): the live one of this
    /// process if the file is open already with the same settings, else a new one whose
    /// working copy is read from the media.
    pub(super) fn open(
        media: &File,
        len: usize,
        unit: usize,
        opts: Simulation,
    ) -> std::result::Result<Arc<Sim>, OpenError> {
        let key = key_of(media)?;
        let mut reg = loop {
            let reg = crate::sync::lock(registry());
            // An entry nobody holds any more is a simulation whose Drop is about to take the
            // lock and write its working copy back: reading the media before that would
            // lose what the clean close writes.
            if reg.get(&key).is_some_and(|w| w.strong_count() == 0) {
                drop(reg);
                std::thread::sleep(std::time::Duration::from_millis(1));
                continue;
            }
            break reg;
        };
        if let Some(live) = reg.get(&key).and_then(Weak::upgrade) {
            let fits = live.matches(len, Some(unit), opts);
            // Unlocked before `live` may be dropped: if it is the last reference, its Drop
            // takes the registry's lock.
            drop(reg);
            return fits.map(|()| live);
        }
        // Until registered, an error drops this Sim without touching the registry (held
        // here) or the media (`lost`: a half-read working copy is never written back).
        let anon = |len| Media::anonymous(len).map_err(|e| OpenError::Io(io::Error::other(e)));
        let sim = Sim {
            opts,
            unit,
            len,
            working: anon(len)?,
            shadow: anon(len)?,
            media: media.try_clone().map_err(OpenError::Io)?,
            key,
            lost: AtomicBool::new(true),
            registered: AtomicBool::new(false),
            state: Mutex::new(State {
                rng: splitmix(opts.seed) | 1,
                pending: Vec::new(),
                stats: SimStats::default(),
            }),
        };
        // Power on: the working copy starts as what the media holds.
        let mut buf = vec![0u8; CHUNK.min(len)];
        let mut at = 0;
        while at < len {
            let n = buf.len().min(len - at);
            sim.media
                .read_exact_at(&mut buf[..n], at as u64)
                .map_err(OpenError::Io)?;
            let copy = |m: &Media| write_at(m, at, &buf[..n]);
            copy(&sim.working).map_err(OpenError::Io)?;
            copy(&sim.shadow).map_err(OpenError::Io)?;
            at += n;
        }
        sim.lost.store(false, Ordering::SeqCst);
        let sim = Arc::new(sim);
        if opts.eviction_percent > 0 && opts.eviction_interval_ms > 0 {
            if let Err(e) = Sim::start_evictor(&sim) {
                sim.lost.store(true, Ordering::SeqCst);
                return Err(OpenError::Io(e));
            }
        }
        sim.registered.store(true, Ordering::SeqCst);
        reg.insert(key, Arc::downgrade(&sim));
        Ok(sim)
    }

    /// The eviction timer: a thread that holds the simulation only while it evicts, and ends
    /// when the simulation is gone or has lost its power.
    fn start_evictor(sim: &Arc<Sim>) -> io::Result<()> {
        let weak = Arc::downgrade(sim);
        let every = std::time::Duration::from_millis(u64::from(sim.opts.eviction_interval_ms));
        std::thread::Builder::new()
            .name("rpma-sim-evict".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                let Some(s) = weak.upgrade() else { return };
                // Under the state lock, which `lose_power` takes to set `lost`: a power loss
                // while this waited for the lock stops it here, not after a copy to the media.
                let mut st = s.lock();
                if s.powered().is_err() {
                    return;
                }
                st.stats.events += 1;
                // A failed pwrite here is reported by the next persist, which meets it too.
                let _ = s.evict(&mut st);
            })
            .map(|_| ())
    }

    /// Refuses, before anything about the file changes, an opening of `media` at `len` bytes
    /// that the live simulation of the same file in this process (if any) could not serve.
    pub(super) fn check_live(
        media: &File,
        len: usize,
        opts: Simulation,
    ) -> std::result::Result<(), OpenError> {
        let key = key_of(media)?;
        let reg = crate::sync::lock(registry());
        let live = reg.get(&key).and_then(Weak::upgrade);
        // Unlocked before `live` may be dropped (its Drop may take the lock).
        drop(reg);
        match live {
            Some(live) => live.matches(len, None, opts),
            None => Ok(()),
        }
    }

    fn matches(
        &self,
        len: usize,
        unit: Option<usize>,
        opts: Simulation,
    ) -> std::result::Result<(), OpenError> {
        if self.opts != opts {
            return Err(OpenError::Mismatch(
                "it is still open in this process with other power-loss simulation settings \
                 (restart the target to change them)",
            ));
        }
        if self.len != len || unit.is_some_and(|u| u != self.unit) {
            return Err(OpenError::Mismatch(
                "it is still open in this process with another size or domain (restart the \
                 target to change them)",
            ));
        }
        Ok(())
    }

    /// The working copy's first byte.
    pub(super) fn working_ptr(&self) -> *mut u8 {
        self.working.ptr()
    }

    pub(super) fn options(&self) -> Simulation {
        self.opts
    }

    pub(super) fn stats(&self) -> SimStats {
        self.lock().stats
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }

    /// `[offset, offset+len)` rounded out to whole units, clipped to the mapping.
    fn units(&self, offset: usize, len: usize) -> (usize, usize) {
        let start = offset / self.unit * self.unit;
        let end = (offset + len).div_ceil(self.unit) * self.unit;
        (start, end.min(self.len))
    }

    /// A persist (or the sync of the flush service) of a range: its units reach the media.
    pub(super) fn persist(&self, offset: usize, len: usize) -> io::Result<()> {
        let mut st = self.lock();
        self.powered()?;
        st.stats.events += 1;
        self.evict(&mut st)?;
        if len == 0 || self.opts.broken_persist {
            return Ok(());
        }
        let (start, end) = self.units(offset, len);
        st.stats.persisted_units += self.copy(start, end, None)?;
        Ok(())
    }

    /// A flush: its units reach the media at the next drain.
    pub(super) fn flush(&self, offset: usize, len: usize) -> io::Result<()> {
        let mut st = self.lock();
        self.powered()?;
        st.stats.events += 1;
        self.evict(&mut st)?;
        if len == 0 || self.opts.broken_persist {
            return Ok(());
        }
        let (start, end) = self.units(offset, len);
        match st.pending.iter_mut().find(|r| start <= r.1 && r.0 <= end) {
            Some(r) => *r = (r.0.min(start), r.1.max(end)),
            None => st.pending.push((start, end)),
        }
        if st.pending.len() > 256 {
            // Bounded: writing them now is early durability, which is always allowed.
            self.drain_pending(&mut st)?;
        }
        Ok(())
    }

    /// After [`lose_power`](Self::lose_power) nothing reaches the media any more: every other
    /// handle of the simulation lost its cache too, so its persists fail rather than answer
    /// durable. Checked under the state lock, which `lose_power` takes.
    fn powered(&self) -> io::Result<()> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(io::Error::other("the simulated power is off"));
        }
        Ok(())
    }

    /// A drain: every flushed range reaches the media.
    pub(super) fn drain(&self) -> io::Result<()> {
        let mut st = self.lock();
        self.powered()?;
        st.stats.events += 1;
        self.evict(&mut st)?;
        self.drain_pending(&mut st)
    }

    fn drain_pending(&self, st: &mut State) -> io::Result<()> {
        while let Some((start, end)) = st.pending.pop() {
            st.stats.persisted_units += self.copy(start, end, None)?;
        }
        Ok(())
    }

    /// Writes the units of a random window that differ from the media, each with the eviction
    /// chance.
    fn evict(&self, st: &mut State) -> io::Result<()> {
        if self.opts.eviction_percent == 0 {
            return Ok(());
        }
        let window = EVICTION_WINDOW.max(self.unit).min(self.len);
        let start = (st.next() as usize % (self.len - window + 1)) / self.unit * self.unit;
        let end = (start + window).min(self.len);
        let evicted = self.copy(start, end, Some(st))?;
        st.stats.evicted_units += evicted;
        Ok(())
    }

    /// Copies the units of `[start, end)` (unit-aligned) that differ from the media to it:
    /// all of them, or with `coin`, each with the eviction chance. Returns how many.
    fn copy(&self, start: usize, end: usize, mut coin: Option<&mut State>) -> io::Result<u64> {
        let mut now = vec![0u8; CHUNK.min(end - start)];
        let mut was = vec![0u8; now.len()];
        let mut copied = 0;
        let mut at = start;
        while at < end {
            let n = now.len().min(end - at);
            // A snapshot: the media and the shadow get the same bytes even if a Write is
            // being placed into the working copy meanwhile.
            read_at(&self.working, at, &mut now[..n])?;
            read_at(&self.shadow, at, &mut was[..n])?;
            let mut u = 0;
            while u < n {
                let w = self.unit.min(n - u);
                let dirty = now[u..u + w] != was[u..u + w];
                let take = dirty
                    && match coin.as_deref_mut() {
                        None => true,
                        Some(st) => st.next() % 100 < u64::from(self.opts.eviction_percent),
                    };
                if take {
                    self.media.write_all_at(&now[u..u + w], (at + u) as u64)?;
                    write_at(&self.shadow, at + u, &now[u..u + w])?;
                    copied += 1;
                }
                u += w;
            }
            at += n;
        }
        Ok(copied)
    }

    /// The simulated power loss of this process's cache: nothing more reaches the media from
    /// this simulation, and the next open reads the media again.
    pub(super) fn lose_power(&self) {
        // Under the state lock: no copy to the media is under way when this returns, and
        // none starts after it.
        let st = self.lock();
        self.lost.store(true, Ordering::SeqCst);
        drop(st);
        let mut reg = crate::sync::lock(registry());
        if reg
            .get(&self.key)
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), self))
        {
            reg.remove(&self.key);
        }
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        // Under the registry's lock, so that an open of the same file waits for the write-back
        // instead of reading a half-written media.
        let mut reg = self
            .registered
            .load(Ordering::SeqCst)
            .then(|| crate::sync::lock(registry()));
        if let Some(reg) = reg.as_mut() {
            if reg
                .get(&self.key)
                .is_some_and(|w| std::ptr::eq(w.as_ptr(), self))
            {
                reg.remove(&self.key);
            }
        }
        if !self.lost.load(Ordering::SeqCst) {
            // A clean close is not a power loss. Nowhere to report an error: the media keeps
            // what it had, as after a power loss.
            let _ = self.copy(0, self.len, None);
        }
        drop(reg);
    }
}

/// Copies `data` into anonymous memory at `at` (a copy through a `VolatileSlice`: the fabric
/// places into the working copy meanwhile).
fn write_at(m: &Media, at: usize, data: &[u8]) -> io::Result<()> {
    volatile(m).write_at(at, data).map_err(io::Error::other)
}

fn read_at(m: &Media, at: usize, out: &mut [u8]) -> io::Result<()> {
    volatile(m).read_at(at, out).map_err(io::Error::other)
}

fn volatile(m: &Media) -> crate::volatile::VolatileSlice<'_> {
    // SAFETY: the media's mapping is valid for reads and writes of its length until it is
    // dropped, which the borrow outlasts; registered memory is reached only through copies.
    unsafe { crate::volatile::VolatileSlice::new(m.ptr(), m.len()) }
}

/// A namespace under the power-loss simulation: the mapping of its file (the media, whose own
/// persist still runs after the copy, so that costs and write-back errors are those of the
/// real domain), and the simulation, whose working copy is the memory handed out.
#[derive(Debug)]
pub(super) struct Simulated {
    media: Media,
    sim: Arc<Sim>,
}

impl Simulated {
    pub(super) fn new(media: Media, sim: Arc<Sim>) -> Simulated {
        Simulated { media, sim }
    }

    pub(super) fn media(&self) -> &Media {
        &self.media
    }

    pub(super) fn working_ptr(&self) -> *mut u8 {
        self.sim.working_ptr()
    }

    pub(super) fn settings(&self) -> Simulation {
        self.sim.options()
    }

    pub(super) fn stats(&self) -> SimStats {
        self.sim.stats()
    }

    pub(super) fn lose_power(&self) {
        self.sim.lose_power();
    }

    /// The simulation's part of a persist, flush, drain or sync (`what` says which): its copy
    /// to the media, whose failure is a failed write-back like any other.
    fn copy(
        &self,
        offset: usize,
        len: usize,
        what: impl FnOnce(&Sim) -> io::Result<()>,
    ) -> Result<()> {
        what(&self.sim).map_err(|e| {
            self.media.record_failure(SyncFailure::new("pwrite", &e));
            self.media.sync_error(
                "pwrite to the power-loss simulation's media",
                offset,
                len,
                e,
            )
        })
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        self.media.check_range(offset, len)?;
        self.media.check_healthy()
    }
}

impl Persist for Simulated {
    fn domain(&self) -> Domain {
        self.media.domain()
    }

    fn persist(&self, offset: usize, len: usize) -> Result<Durability> {
        self.check(offset, len)?;
        self.copy(offset, len, |s| s.persist(offset, len))?;
        self.media.persist(offset, len)
    }

    fn flush(&self, offset: usize, len: usize) -> Result<()> {
        self.check(offset, len)?;
        self.copy(offset, len, |s| s.flush(offset, len))?;
        self.media.flush(offset, len)
    }

    fn drain(&self) -> Result<Durability> {
        self.media.check_healthy()?;
        self.copy(0, 0, Sim::drain)?;
        self.media.drain()
    }

    fn failure(&self) -> Option<SyncFailure> {
        self.media.failure()
    }

    fn record_failure(&self, failure: SyncFailure) -> bool {
        self.media.record_failure(failure)
    }

    fn before_sync(&self, offset: usize, len: usize) -> Result<()> {
        self.check(offset, len)
    }

    fn after_sync(&self, offset: usize, len: usize) -> Result<()> {
        self.check(offset, len)?;
        self.copy(offset, len, |s| s.persist(offset, len))
    }

    /// The media is reached only by a persist: streaming stores into the working copy make
    /// nothing durable.
    fn durable_by_writeback(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests;
