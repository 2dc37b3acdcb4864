//! The idle wait of a completion queue, for every transport: one epoll set over what can wake
//! it (the soft transport's sockets, the rdma transport's completion channel and event fds)
//! and the file descriptors its user asked it to watch.
//!
//! While traffic flows, [`CompletionQueue::wait`](crate::fabric::CompletionQueue::wait)
//! busy-polls; after an idle spell it blocks here, so an idle process uses no CPU.

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::Mutex;
use std::time::Duration;

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

use super::error::{Error, Result};

/// Set in the epoll data of a watched (user) fd; the transport's tokens (queue pair numbers)
/// are 32 bits.
const USER: u64 = 1 << 63;

pub(crate) struct Poller {
    epoll: Epoll,
    /// The user's watched fds and their tokens.
    watched: Mutex<Vec<(RawFd, u64)>>,
}

/// What one blocking wait saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ready {
    /// Something (a transport's fd or a watched fd) is ready.
    pub(crate) any: bool,
    /// The token of a readable watched fd, if one is.
    pub(crate) user: Option<u64>,
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
            watched: Mutex::new(Vec::new()),
        })
    }

    fn flags(write: bool) -> EpollFlags {
        let mut f = EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP;
        if write {
            f |= EpollFlags::EPOLLOUT;
        }
        f
    }

    /// Watches the transport's `fd` (readable; writable too if `write`), tagged `token`
    /// (< 2^32).
    pub(crate) fn add(&self, fd: BorrowedFd<'_>, token: u64, write: bool) -> Result<()> {
        debug_assert!(token < USER);
        self.epoll
            .add(fd, EpollEvent::new(Self::flags(write), token))
            .map_err(io)
    }

    /// Stops watching the transport's `fd`.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn unwatch_transport(&self, fd: BorrowedFd<'_>) -> Result<()> {
        self.epoll.delete(fd).map_err(io)
    }

    /// Changes whether the transport's `fd` is watched for writability.
    pub(crate) fn set_write(&self, fd: BorrowedFd<'_>, token: u64, write: bool) -> Result<()> {
        let mut ev = EpollEvent::new(Self::flags(write), token);
        self.epoll.modify(fd, &mut ev).map_err(io)
    }

    fn watched(&self) -> std::sync::MutexGuard<'_, Vec<(RawFd, u64)>> {
        self.watched.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Watches a user's `fd` for readability (level-triggered), reported as `token`.
    pub(crate) fn watch(&self, fd: BorrowedFd<'_>, token: u64) -> Result<()> {
        let raw = fd.as_raw_fd();
        let ev = EpollEvent::new(EpollFlags::EPOLLIN, USER | raw as u64);
        self.epoll.add(fd, ev).map_err(|e| Error::Watch {
            op: "watch",
            fd: raw,
            source: e.into(),
        })?;
        let mut w = self.watched();
        // A closed fd leaves epoll by itself; forget a stale entry its number left behind.
        w.retain(|(f, _)| *f != raw);
        w.push((raw, token));
        Ok(())
    }

    /// Stops watching a user's `fd`.
    pub(crate) fn unwatch(&self, fd: BorrowedFd<'_>) -> Result<()> {
        let raw = fd.as_raw_fd();
        self.watched().retain(|(f, _)| *f != raw);
        self.epoll.delete(fd).map_err(|e| Error::Watch {
            op: "unwatch",
            fd: raw,
            source: e.into(),
        })
    }

    /// Blocks until a transport's fd or a watched fd is ready or `timeout` passes (None:
    /// forever).
    pub(crate) fn wait(&self, timeout: Option<Duration>) -> Result<Ready> {
        let t = match timeout {
            None => EpollTimeout::NONE,
            // Round up so a sub-millisecond remainder still sleeps instead of spinning.
            Some(d) => {
                EpollTimeout::try_from(d + Duration::from_micros(999)).unwrap_or(EpollTimeout::MAX)
            }
        };
        self.wait_for(t)
    }

    /// The token of a watched fd that is readable now, without blocking; `None` at once (no
    /// system call) while nothing is watched. For the busy-poll spell: a watched fd (a
    /// flusher's completion) is seen as it comes, not only when the spell is over.
    pub(crate) fn watched_ready(&self) -> Result<Option<u64>> {
        if self.watched().is_empty() {
            return Ok(None);
        }
        Ok(self.wait_for(EpollTimeout::ZERO)?.user)
    }

    fn wait_for(&self, t: EpollTimeout) -> Result<Ready> {
        let mut evs = [EpollEvent::empty(); 16];
        let n = match self.epoll.wait(&mut evs, t) {
            Ok(n) => n,
            Err(nix::Error::EINTR) => 0,
            Err(e) => return Err(io(e)),
        };
        let user = evs[..n]
            .iter()
            .filter(|ev| ev.data() & USER != 0)
            .find_map(|ev| {
                let raw = (ev.data() & !USER) as RawFd;
                self.watched()
                    .iter()
                    .find(|(f, _)| *f == raw)
                    .map(|(_, t)| *t)
            });
        Ok(Ready { any: n > 0, user })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn wakes_on_readable_and_times_out_when_idle() {
        let p = Poller::new().unwrap();
        let (mut a, b) = UnixStream::pair().unwrap();
        p.add(b.as_fd(), 1, false).unwrap();
        assert!(!p.wait(Some(Duration::from_millis(5))).unwrap().any);
        a.write_all(b"x").unwrap();
        let r = p.wait(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(
            r,
            Ready {
                any: true,
                user: None
            }
        );
        p.set_write(b.as_fd(), 1, true).unwrap();
    }

    #[test]
    fn watched_fd_reports_its_token_until_drained() {
        let p = Poller::new().unwrap();
        let (mut a, mut b) = UnixStream::pair().unwrap();
        p.watch(b.as_fd(), 77).unwrap();
        assert_eq!(p.wait(Some(Duration::from_millis(5))).unwrap().user, None);
        a.write_all(b"x").unwrap();
        assert_eq!(p.wait(Some(Duration::from_secs(5))).unwrap().user, Some(77));
        // Level-triggered: still ready until read.
        assert_eq!(p.wait(Some(Duration::from_secs(5))).unwrap().user, Some(77));
        b.read_exact(&mut [0u8; 1]).unwrap();
        assert_eq!(p.wait(Some(Duration::from_millis(5))).unwrap().user, None);
    }

    #[test]
    fn watching_twice_or_unwatching_an_unknown_fd_fails() {
        let p = Poller::new().unwrap();
        let (_a, b) = UnixStream::pair().unwrap();
        p.watch(b.as_fd(), 1).unwrap();
        assert!(matches!(
            p.watch(b.as_fd(), 2),
            Err(Error::Watch { op: "watch", .. })
        ));
        p.unwatch(b.as_fd()).unwrap();
        assert!(matches!(
            p.unwatch(b.as_fd()),
            Err(Error::Watch { op: "unwatch", .. })
        ));
    }
}
