//! What an opening says once about its failures: a page it could not read back, a failed
//! write-back, a transport that cannot register it (each logged once per opening, the
//! failures recorded so that reloads and restarts remember them).

use std::sync::atomic::Ordering;

use super::OpenNamespace;

impl OpenNamespace {
    /// Whether a page of the namespace could not be read or written since it was opened (a
    /// media error, poisoned pmem, or its file truncated by another process: the SIGBUS the
    /// pmem layer takes instead of the daemon, docs/persistence.md). Such a namespace has
    /// failed: this records it as for a failed write-back (across reloads and restarts) and
    /// logs it, once; the transports serve nothing more of this opening.
    pub fn note_unreadable(&self) -> bool {
        let Some(at) = self.mapping.fail_if_unreadable() else {
            return false;
        };
        if !self.unreadable_logged.swap(true, Ordering::Relaxed) {
            self.failure_logged.store(true, Ordering::Relaxed);
            log::error!(
                "subsystem {} namespace {} ({}) has FAILED: the page at offset {at} could not be \
                 read or written (a media error, poisoned pmem, or the file truncated by another \
                 process); its sessions are closed and no host reads or writes it until it is \
                 reopened (a reload, a restart: then it serves what the file holds), and every \
                 durability request on it is refused, across reloads and restarts, until an \
                 operator repairs the file and clears it with `rpma-target clear-failure {} {}`",
                self.subsystem,
                self.config.nsid,
                self.config.path.display(),
                self.subsystem,
                self.config.nsid
            );
        }
        true
    }

    /// [`note_unreadable`](Self::note_unreadable), and whether this is the first call that
    /// found it so (its sessions are to be closed then).
    pub fn newly_unreadable(&self) -> bool {
        self.note_unreadable() && !self.unreadable_closed.swap(true, Ordering::Relaxed)
    }

    /// Logs the namespace's failure at error level the first time it is seen; call it wherever
    /// a durability request on it failed. Returns whether it has failed.
    pub fn note_failure(&self) -> bool {
        // A page that could not be read back is logged as such (once, whichever path saw it).
        if self.note_unreadable() {
            return true;
        }
        let Some(f) = self.failure() else {
            return false;
        };
        if !self.failure_logged.swap(true, Ordering::Relaxed) {
            log::error!(
                "subsystem {} namespace {} ({}) has FAILED: {f} (errno {}); every durability \
                 request on it is refused, across reloads and restarts, until an operator \
                 clears it with `rpma-target clear-failure {} {}`",
                self.subsystem,
                self.config.nsid,
                self.config.path.display(),
                f.errno,
                self.subsystem,
                self.config.nsid
            );
        }
        true
    }

    /// A connection could not register the namespace (`why`): it is served to that connection
    /// as unavailable. Logged at error once per opening (every host of the subsystem would
    /// hit the same wall), at debug after.
    pub fn note_unregistrable(&self, why: &str) {
        if !self.unregistrable_logged.swap(true, Ordering::Relaxed) {
            log::error!(
                "subsystem {} namespace {} ({}) cannot be registered on this transport: {why}; \
                 it is listed to hosts as unavailable, the subsystem's other namespaces are \
                 served",
                self.subsystem,
                self.config.nsid,
                self.config.path.display()
            );
        } else {
            log::debug!(
                "subsystem {} namespace {}: unavailable to another connection: {why}",
                self.subsystem,
                self.config.nsid
            );
        }
    }
}
