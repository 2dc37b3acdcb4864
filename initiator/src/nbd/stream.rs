//! The listening socket and client streams, Unix or TCP.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{getsockopt, setsockopt, sockopt};

use super::slots::Source;
use super::{NbdError, Result};

/// TCP keep-alive on client connections: a peer that vanished (its host down, the link cut)
/// is found out after about two minutes, even by a client thread waiting without an idle
/// time-out. NBD itself has no keep-alive; a live but quiet client is not affected.
const KEEPALIVE_IDLE_S: u32 = 60;
const KEEPALIVE_INTERVAL_S: u32 = 10;
const KEEPALIVE_PROBES: u32 = 6;

/// Who is at the other end of an accepted connection.
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    /// For the per-source cap and the log limits.
    pub(crate) source: Source,
    /// For log lines: `127.0.0.1:41234`, `unix (uid 0, pid 4242)`.
    pub(crate) name: String,
}

/// Where the export listens.
#[derive(Debug)]
pub enum Listener {
    /// A Unix socket; the file is removed on drop.
    Unix(UnixListener, PathBuf),
    /// A TCP address.
    Tcp(TcpListener),
}

impl Listener {
    /// Binds a Unix socket at `path`. A socket file left by a server that is gone is
    /// replaced; one that a live server answers on is not.
    ///
    /// # Errors
    /// [`NbdError::InUse`], [`NbdError::Listen`].
    pub fn unix(path: &Path) -> Result<Listener> {
        let addr = path.display().to_string();
        if let Ok(m) = std::fs::symlink_metadata(path) {
            if m.file_type().is_socket() && UnixStream::connect(path).is_err() {
                let _ = std::fs::remove_file(path);
            } else if m.file_type().is_socket() {
                return Err(NbdError::InUse { addr });
            }
        }
        let l = UnixListener::bind(path).map_err(|source| NbdError::Listen {
            addr: addr.clone(),
            source,
        })?;
        l.set_nonblocking(true)
            .map_err(|source| NbdError::Listen { addr, source })?;
        Ok(Listener::Unix(l, path.to_owned()))
    }

    /// Binds `addr` (HOST:PORT).
    ///
    /// # Errors
    /// [`NbdError::Listen`].
    pub fn tcp(addr: &str) -> Result<Listener> {
        let err = |source| NbdError::Listen {
            addr: addr.to_owned(),
            source,
        };
        let l = TcpListener::bind(addr).map_err(err)?;
        l.set_nonblocking(true).map_err(err)?;
        Ok(Listener::Tcp(l))
    }

    /// The URL a client uses for export `name`: `nbd+unix:///NAME?socket=PATH` or
    /// `nbd://HOST:PORT/NAME`.
    pub fn url(&self, name: &str) -> String {
        match self {
            Listener::Unix(_, p) => format!("nbd+unix:///{name}?socket={}", p.display()),
            Listener::Tcp(l) => match l.local_addr() {
                Ok(a) => format!("nbd://{a}/{name}"),
                Err(_) => format!("nbd://?/{name}"),
            },
        }
    }

    /// Accepts a pending connection (the listener does not block): None when there is none.
    ///
    /// # Errors
    /// Those of accept(2) other than `WouldBlock`.
    pub(crate) fn accept(&self) -> io::Result<Option<(Stream, Peer)>> {
        let r = match self {
            Listener::Unix(l, _) => l.accept().map(|(s, _)| {
                // The user is the source: every process of one user shares its cap.
                let peer = match getsockopt(&s, sockopt::PeerCredentials) {
                    Ok(c) => Peer {
                        source: Source::Uid(c.uid()),
                        name: format!("unix (uid {}, pid {})", c.uid(), c.pid()),
                    },
                    Err(_) => Peer {
                        source: Source::Unknown,
                        name: "unix (credentials unknown)".into(),
                    },
                };
                (Stream::Unix(s), peer)
            }),
            Listener::Tcp(l) => l.accept().map(|(s, a)| {
                let _ = s.set_nodelay(true);
                let _ = setsockopt(&s, sockopt::KeepAlive, &true)
                    .and_then(|()| setsockopt(&s, sockopt::TcpKeepIdle, &KEEPALIVE_IDLE_S))
                    .and_then(|()| setsockopt(&s, sockopt::TcpKeepInterval, &KEEPALIVE_INTERVAL_S))
                    .and_then(|()| setsockopt(&s, sockopt::TcpKeepCount, &KEEPALIVE_PROBES));
                let peer = Peer {
                    source: Source::of_ip(a.ip()),
                    name: a.to_string(),
                };
                (Stream::Tcp(s), peer)
            }),
        };
        match r {
            Ok((s, peer)) => {
                // Accepted sockets inherit O_NONBLOCK on some systems: clients block.
                s.set_nonblocking(false)?;
                Ok(Some((s, peer)))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Unix(l, _) => l.as_fd(),
            Listener::Tcp(l) => l.as_fd(),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A client connection.
#[derive(Debug)]
pub(crate) enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    pub(crate) fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    pub(crate) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
        }
    }

    fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_nonblocking(on),
            Stream::Tcp(s) => s.set_nonblocking(on),
        }
    }

    pub(crate) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }

    pub(crate) fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(t),
            Stream::Tcp(s) => s.set_write_timeout(t),
        }
    }

    /// Waits until the socket has room to write, or `timeout` passed.
    pub(crate) fn wait_writable(&self, timeout: Duration) -> io::Result<()> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut fds = [PollFd::new(self.as_fd(), PollFlags::POLLOUT)];
        let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
            Err(e) => Err(io::Error::from(e)),
        }
    }

    /// Waits until the client sent a byte (true) or closed its side (false), at most
    /// `timeout` (`None`: without end); a `TimedOut` error past it. The byte stays in the
    /// socket.
    pub(crate) fn wait_first_byte(&self, timeout: Option<Duration>) -> io::Result<bool> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use nix::sys::socket::{recv, MsgFlags};
        let until = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            let wait = match until {
                Some(u) => {
                    let left = u.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return Err(io::ErrorKind::TimedOut.into());
                    }
                    // poll's time-out is at most 65 s here: waited in turns.
                    PollTimeout::from(u16::try_from(left.as_millis() + 1).unwrap_or(u16::MAX))
                }
                None => PollTimeout::NONE,
            };
            let mut fds = [PollFd::new(self.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, wait) {
                Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
                Ok(_) => {}
                Err(e) => return Err(io::Error::from(e)),
            }
            let mut b = [0u8; 1];
            let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
            match recv(self.as_raw_fd(), &mut b, flags) {
                Ok(0) => return Ok(false),
                Ok(_) => return Ok(true),
                Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(io::Error::from(e)),
            }
        }
    }

    /// Reads what is already there without waiting: `Ok(None)` when nothing is.
    pub(crate) fn read_available(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        use nix::sys::socket::{recv, MsgFlags};
        match recv(self.as_raw_fd(), buf, MsgFlags::MSG_DONTWAIT) {
            Ok(n) => Ok(Some(n)),
            Err(nix::errno::Errno::EAGAIN) => Ok(None),
            Err(nix::errno::Errno::EINTR) => Ok(None),
            Err(e) => Err(io::Error::from(e)),
        }
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Unix(s) => s.as_fd(),
            Stream::Tcp(s) => s.as_fd(),
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write_vectored(bufs),
            Stream::Tcp(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// How long a reply may wait for a client that does not read (in the transmission phase, plus
/// a second per MiB of replies).
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// The iovecs of one vectored write, at most (Linux's IOV_MAX is 1024).
const MAX_IOVECS: usize = 512;

/// Writes `out` with each buffer of `bufs` inserted where its position says (the length
/// `out` had when the buffer was queued; positions never decrease), from byte `done` of the
/// whole on (at most its length), with as few `writev` calls as the socket takes, until all of
/// it is written or `w` takes no more for now (`WouldBlock`): the bytes of the whole written
/// by then. Buffers added at the end (to `out`, or to `bufs` at `out`'s length) between two
/// calls go after what was there.
pub(crate) fn write_vectored_from<B: AsRef<[u8]>>(
    w: &mut impl Write,
    out: &[u8],
    bufs: &[(usize, B)],
    done: usize,
) -> io::Result<usize> {
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(2 * bufs.len() + 1);
    let mut at = 0;
    for (pos, b) in bufs {
        slices.push(IoSlice::new(&out[at..*pos]));
        slices.push(IoSlice::new(b.as_ref()));
        at = *pos;
    }
    slices.push(IoSlice::new(&out[at..]));
    slices.retain(|s| !s.is_empty());
    let mut left = &mut slices[..];
    IoSlice::advance_slices(&mut left, done);
    let mut written = done;
    while !left.is_empty() {
        let take = left.len().min(MAX_IOVECS);
        match w.write_vectored(&left[..take]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "the client's socket took no more bytes",
                ))
            }
            Ok(n) => {
                IoSlice::advance_slices(&mut left, n);
                written += n;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    Ok(written)
}

/// A client stream written without waiting: a write the socket has no room for fails with
/// `WouldBlock` ([`Stream::wait_writable`] waits for room).
pub(crate) struct NoWait<'a>(pub(crate) &'a Stream);

impl Write for NoWait<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        use nix::sys::socket::{sendmsg, MsgFlags};
        let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL;
        sendmsg::<()>(self.0.as_raw_fd(), bufs, &[], flags, None).map_err(io::Error::from)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;

    /// A socket that takes at most `per_call` bytes of each write (split anywhere, across
    /// slices), is interrupted every third call, and after `cap` bytes takes none.
    struct Stingy {
        got: Vec<u8>,
        per_call: usize,
        cap: usize,
        calls: usize,
    }

    impl Write for Stingy {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.write_vectored(&[IoSlice::new(buf)])
        }

        fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
            self.calls += 1;
            if self.calls.is_multiple_of(3) {
                return Err(ErrorKind::Interrupted.into());
            }
            let mut room = self.per_call.min(self.cap - self.got.len());
            let mut n = 0;
            for b in bufs {
                let k = b.len().min(room);
                self.got.extend_from_slice(&b[..k]);
                room -= k;
                n += k;
            }
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn replies_are_written_whole_and_in_order_through_partial_writes() {
        // Headers in `out`, READ replies between them where they were answered (also two at one
        // place, and some at either end).
        let out: Vec<u8> = (0..200u8).collect();
        let mut bufs: Vec<(usize, Vec<u8>)> = Vec::new();
        let mut want = Vec::new();
        let mut at = 0;
        for i in 0..700usize {
            let pos = (i * 2 / 7).min(out.len());
            want.extend_from_slice(&out[at..pos]);
            at = pos;
            let b: Vec<u8> = (0..(i % 37) as u8).map(|v| v ^ i as u8).collect();
            want.extend_from_slice(&b);
            bufs.push((pos, b));
        }
        want.extend_from_slice(&out[at..]);
        for per_call in [1, 5, 64, 4096, usize::MAX] {
            let mut w = Stingy {
                got: Vec::new(),
                per_call,
                cap: usize::MAX,
                calls: 0,
            };
            let n = write_vectored_from(&mut w, &out, &bufs, 0).unwrap();
            assert_eq!(
                (n, &w.got),
                (want.len(), &want),
                "{per_call} byte(s) per call"
            );
        }
        // Nothing at all: no write.
        let mut w = Stingy {
            got: Vec::new(),
            per_call: 1,
            cap: 0,
            calls: 0,
        };
        assert_eq!(
            write_vectored_from(&mut w, &[], &[(0, Vec::new())], 0).unwrap(),
            0
        );
        assert_eq!(w.calls, 0);
    }

    /// A socket with `room` bytes of room left, `WouldBlock` once it is used up.
    struct Gated {
        got: Vec<u8>,
        room: usize,
    }

    impl Write for Gated {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.write_vectored(&[IoSlice::new(buf)])
        }

        fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
            if self.room == 0 {
                return Err(ErrorKind::WouldBlock.into());
            }
            let mut n = 0;
            for b in bufs {
                let k = b.len().min(self.room - n);
                self.got.extend_from_slice(&b[..k]);
                n += k;
            }
            self.room -= n;
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_full_socket_ends_the_call_and_the_next_goes_on_where_it_stopped() {
        let mut out = b"0123".to_vec();
        let mut bufs = vec![(2, b"ab".to_vec())];
        let mut w = Gated {
            got: Vec::new(),
            room: 3,
        };
        let done = write_vectored_from(&mut w, &out, &bufs, 0).unwrap();
        assert_eq!((done, &w.got[..]), (3, &b"01a"[..]));
        // Answers added meanwhile go after the rest.
        bufs.push((out.len(), b"cd".to_vec()));
        out.extend_from_slice(b"56");
        w.room = usize::MAX / 2;
        let done = write_vectored_from(&mut w, &out, &bufs, done).unwrap();
        assert_eq!((done, &w.got[..]), (10, &b"01ab23cd56"[..]));
    }

    #[test]
    fn a_socket_that_takes_no_more_bytes_fails_the_write() {
        let mut w = Stingy {
            got: Vec::new(),
            per_call: 3,
            cap: 10,
            calls: 0,
        };
        let e =
            write_vectored_from(&mut w, b"0123456", &[(7, b"789abcdef".to_vec())], 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::WriteZero);
        assert_eq!(w.got, b"0123456789");
    }
}
