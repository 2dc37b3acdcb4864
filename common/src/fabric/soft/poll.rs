//! The idle wait of a completion queue: one epoll set over the sockets of its queue pairs.
//!
//! While traffic flows, [`CompletionQueue::wait`](crate::fabric::CompletionQueue::wait)
//! busy-polls; after an idle spell it blocks here, so an idle process uses no CPU.

use std::os::fd::BorrowedFd;
use std::time::Duration;

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

use crate::fabric::error::{Error, Result};

pub(crate) struct Poller {
    epoll: Epoll,
}

fn io(e: nix::Error) -> Error {
    Error::Wait {
        source: std::io::Error::from(e),
    }
}

impl Poller {
    pub(crate) fn new() -> Result<Poller> {
        Ok(Poller {
            epoll: Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(io)?,
        })
    }

    fn flags(write: bool) -> EpollFlags {
        let mut f = EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP;
        if write {
            f |= EpollFlags::EPOLLOUT;
        }
        f
    }

    /// Watches `fd` (readable; writable too if `write`), tagged `token`.
    pub(crate) fn add(&self, fd: BorrowedFd<'_>, token: u64, write: bool) -> Result<()> {
        self.epoll
            .add(fd, EpollEvent::new(Self::flags(write), token))
            .map_err(io)
    }

    /// Changes whether `fd` is watched for writability.
    pub(crate) fn set_write(&self, fd: BorrowedFd<'_>, token: u64, write: bool) -> Result<()> {
        let mut ev = EpollEvent::new(Self::flags(write), token);
        self.epoll.modify(fd, &mut ev).map_err(io)
    }

    /// Blocks until a watched socket is ready or `timeout` passes (None: forever). Returns
    /// whether anything is ready.
    pub(crate) fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        let t = match timeout {
            None => EpollTimeout::NONE,
            // Round up so a sub-millisecond remainder still sleeps instead of spinning.
            Some(d) => {
                EpollTimeout::try_from(d + Duration::from_micros(999)).unwrap_or(EpollTimeout::MAX)
            }
        };
        let mut evs = [EpollEvent::empty(); 16];
        match self.epoll.wait(&mut evs, t) {
            Ok(n) => Ok(n > 0),
            Err(nix::Error::EINTR) => Ok(false),
            Err(e) => Err(io(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn wakes_on_readable_and_times_out_when_idle() {
        let p = Poller::new().unwrap();
        let (mut a, b) = UnixStream::pair().unwrap();
        p.add(b.as_fd(), 1, false).unwrap();
        assert!(!p.wait(Some(Duration::from_millis(5))).unwrap());
        a.write_all(b"x").unwrap();
        assert!(p.wait(Some(Duration::from_secs(5))).unwrap());
        p.set_write(b.as_fd(), 1, true).unwrap();
    }
}
