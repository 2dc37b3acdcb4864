//! Pages of a mapped namespace that the kernel cannot give back: a media error under a
//! `page-cache` file, poisoned pmem under `dax`, or the file truncated by another process. A
//! load or store of such a page is delivered as SIGBUS, whose default action would take the
//! daemon and every namespace down at the first Read of that block, and again after each
//! restart.
//!
//! The pmem layer watches each file mapping it makes ([`Watch`]). A SIGBUS at an address inside
//! a watched mapping maps anonymous memory over the page (`MAP_FIXED`; a larger aligned unit
//! where the mapping cannot be split at a page, as devdax), counts the fault in the mapping's
//! slot and returns: the instruction is retried on the new page and the copy goes on, with
//! zeros. The caller finds out before any of those bytes leave: [`Watch::first_fault`] (the
//! pmem layer fails the namespace with it, and a transport revokes every access to a region
//! over such a mapping: a Read Response framed from it is never sent). A SIGBUS anywhere else
//! goes to the handler that was there before (Rust's own, for stack overflows, or the default
//! action).
//!
//! The handler records the fault before it maps the page, so that a thread that reads the
//! zeros (another poll loop's copy of the same page) finds the fault recorded when it checks
//! after its copy. It touches nothing but this module's atomics and calls `mmap` (a plain
//! system call): no lock, no allocation; it keeps `errno` as it found it. It takes only the
//! faults of an access (BUS_ADRERR, BUS_OBJERR, BUS_MCEERR_AR: the faulting thread holds the
//! mapping, so it cannot be unwatched meanwhile); a memory error reported ahead of any access
//! (BUS_MCEERR_AO, with early kill) is left for the access to meet, and a SIGBUS another
//! process sent (`kill -BUS`) or an alignment fault goes to the previous handler.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// How many mappings can be watched at once; a mapping made while all are taken is not
/// watched (a SIGBUS in it is fatal, as without this module; the pmem layer logs it). A
/// daemon holds one per opening of a namespace file (two for a moment across a reload that
/// reopens it), so this covers some 2,000 namespaces; 160 KiB of zeroed static memory
/// (`.bss`: no room in the binary, a page only once touched), and the scans stop at the
/// highest slot ever used.
pub(crate) const SLOTS: usize = 4096;

// A slot's state, in the low two bits of its state word; the bits above count its claims, so
// that a reader that loaded the range between a drop and the next claim sees the word change.
const FREE: usize = 0;
const CLAIMED: usize = 1;
const LIVE: usize = 2;
const KIND: usize = 3;
const CLAIM: usize = 4;

/// No fault recorded yet (a recorded one is its offset + 1: a table of zeros is one that
/// takes no room in the binary, `.bss`).
const NONE: usize = 0;

struct Slot {
    state: AtomicUsize,
    start: AtomicUsize,
    len: AtomicUsize,
    /// Pages (or larger units) replaced so far.
    faults: AtomicUsize,
    /// The offset of the first fault from `start`, plus one; or [`NONE`].
    first: AtomicUsize,
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            state: AtomicUsize::new(FREE),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            faults: AtomicUsize::new(0),
            first: AtomicUsize::new(NONE),
        }
    }

    /// The slot's range and its first fault, when it is live (read consistently: the state
    /// word is the same before and after).
    fn live(&self) -> Option<(usize, usize, usize)> {
        let word = self.state.load(Ordering::Acquire);
        if word & KIND != LIVE {
            return None;
        }
        let got = (
            self.start.load(Ordering::Acquire),
            self.len.load(Ordering::Acquire),
            self.first.load(Ordering::Acquire),
        );
        (self.state.load(Ordering::Acquire) == word).then_some(got)
    }

    /// The slot's range when it is live and holds `addr`.
    fn holding(&self, addr: usize) -> Option<(usize, usize)> {
        let (start, len, _) = self.live()?;
        (addr >= start && addr - start < len).then_some((start, len))
    }
}

static TABLE: [Slot; SLOTS] = [const { Slot::new() }; SLOTS];

/// One past the highest slot ever claimed: the scans stop there (a daemon uses a slot per
/// opening of a namespace file, a handful).
static USED: AtomicUsize = AtomicUsize::new(0);

/// The slots that may be live.
fn slots() -> &'static [Slot] {
    &TABLE[..USED.load(Ordering::Acquire).min(SLOTS)]
}

/// The page size, for the handler (set before it is installed).
static PAGE: AtomicUsize = AtomicUsize::new(4096);

/// The SIGBUS action before ours, for addresses that are not ours; set once, when ours is
/// installed.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// Serializes the installation (the first [`Watch::new`]).
static INSTALL: Mutex<bool> = Mutex::new(false);

/// A mapping watched for SIGBUS for as long as this lives. Drop it before unmapping.
#[derive(Debug)]
pub(crate) struct Watch {
    slot: usize,
}

impl Watch {
    /// Watches the `len` bytes at `start` (a live mapping that its owner unmaps only after
    /// dropping the watch). None when every slot is taken or the handler could not be
    /// installed: a SIGBUS in that mapping then takes the process down.
    pub(crate) fn new(start: *mut u8, len: usize) -> Option<Watch> {
        if len == 0 || !install() {
            return None;
        }
        for (i, s) in TABLE.iter().enumerate() {
            let word = s.state.load(Ordering::Relaxed);
            if word & KIND != FREE {
                continue;
            }
            let claimed = (word & !KIND).wrapping_add(CLAIM);
            if s.state
                .compare_exchange(word, claimed | CLAIMED, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                s.start.store(start as usize, Ordering::Release);
                s.len.store(len, Ordering::Release);
                s.faults.store(0, Ordering::Release);
                s.first.store(NONE, Ordering::Release);
                USED.fetch_max(i + 1, Ordering::AcqRel);
                s.state.store(claimed | LIVE, Ordering::Release);
                return Some(Watch { slot: i });
            }
        }
        None
    }

    /// Records that the bytes from `offset` on are not the file's any more, found otherwise
    /// than by a fault (the file is shorter than the mapping now): as a fault there would.
    pub(crate) fn mark(&self, offset: usize) {
        let _ = TABLE[self.slot].first.compare_exchange(
            NONE,
            offset + 1,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// The offset (from the start of the mapping) of the first page that faulted, if any did.
    pub(crate) fn first_fault(&self) -> Option<usize> {
        match TABLE[self.slot].first.load(Ordering::Acquire) {
            NONE => None,
            at => Some(at - 1),
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let s = &TABLE[self.slot];
        let claim = s.state.load(Ordering::Relaxed) & !KIND;
        s.state.store(claim | CLAIMED, Ordering::Release);
        s.len.store(0, Ordering::Release);
        s.state.store(claim | FREE, Ordering::Release);
    }
}

/// Reads a byte of every page of `[addr, addr + len)` that lies in a watched mapping, so that
/// a page the kernel could not give to a system call (which then fails with EFAULT instead of
/// a signal) faults here and is counted in its watch.
pub(crate) fn probe(addr: usize, len: usize) {
    let page = PAGE.load(Ordering::Relaxed);
    let end = addr.saturating_add(len);
    let mut at = addr;
    while at < end {
        if slots().iter().any(|s| s.holding(at).is_some()) {
            // SAFETY: `at` lies in a live watched mapping, which its owner keeps mapped while
            // it is watched (and the caller keeps the region alive around this call); a read
            // of it either succeeds or faults into the handler, which maps a page there.
            unsafe { std::ptr::read_volatile(at as *const u8) };
        }
        at = (at & !(page - 1)) + page;
    }
}

/// Installs the handler once; whether it is installed.
fn install() -> bool {
    let mut done = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    if *done {
        return true;
    }
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        PAGE.store(page as usize, Ordering::Relaxed);
    }
    // SAFETY: plain C structs, zero-initialisable; sigaction reads `new` and writes `old`,
    // both live for the call. The handler is async-signal-safe (see the module's notes).
    unsafe {
        let mut new: libc::sigaction = std::mem::zeroed();
        new.sa_sigaction = on_sigbus as *const () as usize;
        new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut new.sa_mask);
        let mut old: libc::sigaction = std::mem::zeroed();
        // PREVIOUS is set before ours can run: a SIGBUS arriving between the two calls would
        // still find the old action in force.
        if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) != 0 {
            return false;
        }
        let _ = PREVIOUS.set(old);
        if libc::sigaction(libc::SIGBUS, &new, std::ptr::null_mut()) != 0 {
            return false;
        }
    }
    *done = true;
    true
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler; errno is this
    // thread's own.
    let (code, addr, errno) = unsafe {
        (
            (*info).si_code,
            (*info).si_addr() as usize,
            *libc::__errno_location(),
        )
    };
    // The faults of an access (the thread that met it holds the mapping: no watch is dropped
    // meanwhile). A signal sent by a process (SI_USER, SI_QUEUE, SI_TKILL) has a code of 0 or
    // less and no address; an alignment fault is no page the kernel could not give.
    let slot = match code {
        libc::BUS_ADRERR | libc::BUS_OBJERR | libc::BUS_MCEERR_AR => {
            slots().iter().find_map(|s| s.holding(addr).map(|r| (s, r)))
        }
        // A memory error found ahead of any access (early kill): the access will meet it.
        libc::BUS_MCEERR_AO if slots().iter().any(|s| s.holding(addr).is_some()) => return,
        _ => None,
    };
    if let Some((s, (start, len))) = slot {
        // Recorded before the page is replaced: whoever reads the zeros after the mmap finds
        // the fault recorded.
        let _ =
            s.first
                .compare_exchange(NONE, addr - start + 1, Ordering::AcqRel, Ordering::Acquire);
        s.faults.fetch_add(1, Ordering::AcqRel);
        if replace(addr, start, len) {
            // SAFETY: as above.
            unsafe { *libc::__errno_location() = errno };
            return;
        }
    }
    previous(sig, info, ctx);
}

/// Maps anonymous memory over the page (or the smallest aligned unit the kernel lets it
/// replace) holding `addr`, inside the watched `[start, start + len)`.
fn replace(addr: usize, start: usize, len: usize) -> bool {
    let page = PAGE.load(Ordering::Relaxed);
    for unit in [page, 2 << 20, 1 << 30] {
        let at = addr & !(unit - 1);
        if at < start || at + unit > start + len {
            continue;
        }
        // SAFETY: the range lies inside a live watched mapping (checked), which belongs to
        // the pmem layer's Media: it only ever reaches those bytes through raw pointers, and
        // unmaps the whole range (these pages included) when it is dropped.
        let p = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                unit,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            return true;
        }
    }
    false
}

/// Hands a SIGBUS that is not ours to the action that was there before ours.
fn previous(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let old = PREVIOUS.get();
    match old {
        Some(old) if old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN => {
            if old.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: an SA_SIGINFO action's handler has this signature.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(old.sa_sigaction) };
                f(sig, info, ctx);
            } else {
                // SAFETY: a plain action's handler has this signature.
                let f: extern "C" fn(libc::c_int) =
                    unsafe { std::mem::transmute(old.sa_sigaction) };
                f(sig);
            }
        }
        _ => {
            // The default action: put it back and return; the access faults again and the
            // process ends as it would have without this module.
            // SAFETY: plain C struct, zero-initialisable; sigaction only reads it.
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigemptyset(&mut dfl.sa_mask);
                libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A daemon with hundreds of namespaces watches every mapping: 300 at once (256 was the
    /// table's size, and the 257th mapping went unwatched, a SIGBUS in it fatal). Not filled
    /// up: the other tests of this process need slots of their own meanwhile.
    #[test]
    fn hundreds_of_mappings_are_watched_at_once() {
        let buf = vec![0u8; 300 * 64];
        let watches: Vec<Option<Watch>> = (0..300)
            .map(|i| Watch::new(buf.as_ptr().wrapping_add(i * 64).cast_mut(), 64))
            .collect();
        assert!(watches.iter().all(Option::is_some), "some went unwatched");
    }

    /// A file of `pages` pages mapped shared, and the file.
    fn mapped(pages: usize) -> (tempfile::TempDir, std::fs::File, *mut u8, usize) {
        let d = tempfile::tempdir().unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(d.path().join("f"))
            .unwrap();
        let len = pages * PAGE_FOR_TEST;
        f.set_len(len as u64).unwrap();
        // SAFETY: a fresh shared mapping of our own file, unmapped by the test.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&f),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        (d, f, p.cast(), len)
    }

    const PAGE_FOR_TEST: usize = 4096;

    #[test]
    fn a_truncated_page_reads_as_a_fault_of_its_mapping_not_a_signal() {
        let (_d, f, p, len) = mapped(4);
        // SAFETY: inside the live mapping.
        unsafe { p.write_bytes(0x5a, len) };
        let w = Watch::new(p, len).expect("a free slot");
        assert_eq!(w.first_fault(), None);
        f.set_len(2 * PAGE_FOR_TEST as u64).unwrap();
        // The first two pages are still the file's.
        // SAFETY: inside the live mapping and the file.
        assert_eq!(unsafe { std::ptr::read_volatile(p.add(100)) }, 0x5a);
        assert_eq!(w.first_fault(), None);
        // The third is beyond the end of the file now: SIGBUS without the watch.
        // SAFETY: inside the live mapping; the handler maps a page over it.
        let b = unsafe { std::ptr::read_volatile(p.add(2 * PAGE_FOR_TEST + 10)) };
        assert_eq!(b, 0, "the page put in its place reads as zeros");
        assert_eq!(w.first_fault(), Some(2 * PAGE_FOR_TEST + 10));
        // A store into the last page faults too, and the first fault stays the first.
        // SAFETY: as above.
        unsafe { std::ptr::write_volatile(p.add(3 * PAGE_FOR_TEST), 1) };
        assert_eq!(w.first_fault(), Some(2 * PAGE_FOR_TEST + 10));
        assert_eq!(TABLE[w.slot].faults.load(Ordering::Relaxed), 2);
        // A claim (of this slot again, most likely) starts with no fault.
        drop(w);
        let w = Watch::new(p, len).expect("a free slot");
        assert_eq!(w.first_fault(), None);
        w.mark(len - 1);
        assert_eq!(w.first_fault(), Some(len - 1), "marked as a fault would");
        drop(w);
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p.cast(), len) };
    }

    #[test]
    fn probe_faults_the_pages_a_system_call_could_not_read() {
        let (_d, f, p, len) = mapped(3);
        let w = Watch::new(p, len).expect("a free slot");
        f.set_len(PAGE_FOR_TEST as u64).unwrap();
        // The kernel's own copy of a page beyond the end fails with EFAULT, no signal.
        let mut pipe = [0; 2];
        // SAFETY: pipe writes two descriptors into the array.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: as above; write copies from the mapping into the pipe.
        let r = unsafe { libc::write(pipe[1], p.add(PAGE_FOR_TEST).cast(), 100) };
        assert_eq!(r, -1);
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EFAULT)
        );
        assert_eq!(w.first_fault(), None, "no signal came");
        probe(p as usize, PAGE_FOR_TEST);
        assert_eq!(w.first_fault(), None, "the first page is fine");
        probe(p as usize + PAGE_FOR_TEST, 2 * PAGE_FOR_TEST);
        assert_eq!(w.first_fault(), Some(PAGE_FOR_TEST));
        // SAFETY: the pipe's own descriptors and the mapping made above.
        unsafe {
            libc::close(pipe[0]);
            libc::close(pipe[1]);
        }
        drop(w);
        // SAFETY: as above.
        unsafe { libc::munmap(p.cast(), len) };
    }

    #[test]
    fn probe_leaves_memory_that_is_not_watched_alone() {
        // An address in no watched mapping is not read (an unmapped one would be SIGSEGV: the
        // test process would end here).
        probe(8, 4096);
    }
}
