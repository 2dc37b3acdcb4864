//! A non-blocking eventfd: the wake-up signal between threads of the daemon (a flusher's
//! completions, commands for a poll loop), readable until [`EventFd::clear`]ed.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// An eventfd (`EFD_NONBLOCK | EFD_CLOEXEC`). Share it with an `Arc` to signal from another
/// thread.
#[derive(Debug)]
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    /// A new eventfd, not readable.
    ///
    /// # Errors
    /// The OS error of `eventfd(2)` (EMFILE and the like).
    pub(crate) fn new() -> std::io::Result<EventFd> {
        // SAFETY: eventfd has no memory-safety preconditions; the result is checked below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Makes it readable.
    pub(crate) fn signal(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local array to an eventfd we own. A full counter
        // (EAGAIN) still leaves the eventfd readable, which is all a waiter needs.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Makes it not readable (until the next [`signal`](Self::signal)).
    pub(crate) fn clear(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local array; the fd is non-blocking, so an
        // eventfd that is not readable returns EAGAIN at once.
        unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
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

    fn readable(e: &EventFd) -> bool {
        let mut pfd = libc::pollfd {
            fd: e.as_fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd, no timeout.
        unsafe { libc::poll(&mut pfd, 1, 0) == 1 }
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
