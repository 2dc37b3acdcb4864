//! A non-blocking eventfd: the wake-up signal between threads of the daemon (a flusher's
//! completions, commands for a poll loop), readable until [`EventFd::clear`]ed.

use std::os::fd::{AsFd, BorrowedFd};

use nix::sys::eventfd::{self, EfdFlags};

/// An eventfd (`EFD_NONBLOCK | EFD_CLOEXEC`). Share it with an `Arc` to signal from another
/// thread.
#[derive(Debug)]
pub(crate) struct EventFd(eventfd::EventFd);

impl EventFd {
    /// A new eventfd, not readable.
    ///
    /// # Errors
    /// The OS error of `eventfd(2)` (EMFILE and the like).
    pub(crate) fn new() -> std::io::Result<EventFd> {
        let fd = eventfd::EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?;
        Ok(EventFd(fd))
    }

    /// Makes it readable.
    pub(crate) fn signal(&self) {
        // A full counter (EAGAIN) still leaves the eventfd readable, which is all a waiter needs.
        let _ = self.0.write(1);
    }

    /// Makes it not readable (until the next [`signal`](Self::signal)).
    pub(crate) fn clear(&self) {
        // Non-blocking: an eventfd that is not readable returns EAGAIN at once.
        let _ = self.0.read();
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

    fn readable(e: &EventFd) -> bool {
        let mut fds = [PollFd::new(e.as_fd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).unwrap() == 1
    }

    #[test]
    fn readable_from_signal_to_clear() {
        let e = EventFd::new().unwrap();
        assert!(!readable(&e));
        e.signal();
        e.signal();
        assert!(readable(&e));
        e.clear();
        assert!(!readable(&e));
        // Clearing an eventfd that is not readable does not block.
        e.clear();
        assert!(!readable(&e));
    }
}
