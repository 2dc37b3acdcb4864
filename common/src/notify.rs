//! sd_notify(3) without libsystemd: READY=1 / STATUS= / WATCHDOG=1 / STOPPING=1 / RELOADING=1
//! datagrams to `$NOTIFY_SOCKET` (a path, or an abstract address written `@name`). When the
//! variable is unset every call is a no-op, so the daemon runs the same outside systemd.

use std::ffi::OsStr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// Errors of the notifier.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NotifyError {
    /// `$NOTIFY_SOCKET` is neither an absolute path nor `@abstract`.
    #[error("NOTIFY_SOCKET={0:?} is neither an absolute path nor an @abstract address")]
    BadAddress(String),
    /// `$WATCHDOG_USEC` is not a positive integer.
    #[error("WATCHDOG_USEC={0:?} is not a positive number of microseconds")]
    BadWatchdog(String),
    /// The socket could not be created or the address is invalid.
    #[error("cannot set up the notification socket {addr:?}")]
    Socket {
        /// The address.
        addr: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The message could not be sent.
    #[error("cannot send {what} to the service manager")]
    Send {
        /// The first line of the message.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// Result of notifications.
pub type Result<T> = std::result::Result<T, NotifyError>;

/// A connection to the service manager, or nothing when not run under one.
#[derive(Debug)]
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr, String)>,
    watchdog: Option<Duration>,
}

impl Notifier {
    /// From `$NOTIFY_SOCKET`, `$WATCHDOG_USEC` and `$WATCHDOG_PID`.
    ///
    /// # Errors
    /// As [`Notifier::from_vars`].
    pub fn from_env() -> Result<Self> {
        let sock = std::env::var_os("NOTIFY_SOCKET");
        let usec = std::env::var("WATCHDOG_USEC").ok();
        let pid = std::env::var("WATCHDOG_PID").ok();
        Self::from_vars(
            sock.as_deref(),
            usec.as_deref(),
            pid.as_deref(),
            std::process::id(),
        )
    }

    /// From explicit values. The watchdog is on when `watchdog_usec` is set and `watchdog_pid` is
    /// unset or equal to `my_pid` (systemd sets it to the main PID; a child must not ping).
    ///
    /// # Errors
    /// [`NotifyError::BadAddress`], [`NotifyError::BadWatchdog`], [`NotifyError::Socket`].
    pub fn from_vars(
        notify_socket: Option<&OsStr>,
        watchdog_usec: Option<&str>,
        watchdog_pid: Option<&str>,
        my_pid: u32,
    ) -> Result<Self> {
        let target = match notify_socket.filter(|s| !s.is_empty()) {
            None => None,
            Some(s) => {
                let shown = s.to_string_lossy().into_owned();
                let sock_err = |source| NotifyError::Socket {
                    addr: shown.clone(),
                    source,
                };
                let bytes = s.as_bytes();
                let addr = if let Some(name) = bytes.strip_prefix(b"@") {
                    SocketAddr::from_abstract_name(name).map_err(sock_err)?
                } else if bytes.starts_with(b"/") {
                    SocketAddr::from_pathname(s).map_err(sock_err)?
                } else {
                    return Err(NotifyError::BadAddress(shown));
                };
                let sock = UnixDatagram::unbound().map_err(sock_err)?;
                Some((sock, addr, shown))
            }
        };
        let watchdog = match watchdog_usec {
            None => None,
            Some(u) => {
                let usec: u64 = u
                    .trim()
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| NotifyError::BadWatchdog(u.to_owned()))?;
                let ours = watchdog_pid_is_ours(watchdog_pid, my_pid);
                ours.then(|| Duration::from_micros(usec / 2))
            }
        };
        Ok(Notifier { target, watchdog })
    }

    /// A notifier that does nothing.
    pub fn disabled() -> Self {
        Notifier {
            target: None,
            watchdog: None,
        }
    }

    /// Whether there is a service manager to notify.
    pub fn is_enabled(&self) -> bool {
        self.target.is_some()
    }

    /// How often to send WATCHDOG=1 (half of `$WATCHDOG_USEC`, as sd_watchdog_enabled advises),
    /// if the service manager asked for it.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog
    }

    /// Sends raw `KEY=value` lines.
    ///
    /// # Errors
    /// [`NotifyError::Send`].
    pub fn send(&self, msg: &str) -> Result<()> {
        let Some((sock, addr, _)) = &self.target else {
            return Ok(());
        };
        sock.send_to_addr(msg.as_bytes(), addr)
            .map(|_| ())
            .map_err(|source| NotifyError::Send {
                what: msg.lines().next().unwrap_or_default().to_owned(),
                source,
            })
    }

    /// READY=1 with a STATUS= line.
    ///
    /// # Errors
    /// [`NotifyError::Send`].
    pub fn ready(&self, status: &str) -> Result<()> {
        self.send(&format!("READY=1\nSTATUS={}", one_line(status)))
    }

    /// STATUS= only.
    ///
    /// # Errors
    /// [`NotifyError::Send`].
    pub fn status(&self, status: &str) -> Result<()> {
        self.send(&format!("STATUS={}", one_line(status)))
    }

    /// RELOADING=1 with the CLOCK_MONOTONIC timestamp that Type=notify-reload requires.
    ///
    /// # Errors
    /// [`NotifyError::Send`].
    pub fn reloading(&self) -> Result<()> {
        let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
            .map(|t| t.tv_sec() as u64 * 1_000_000 + t.tv_nsec() as u64 / 1000)
            .unwrap_or(0);
        self.send(&format!("RELOADING=1\nMONOTONIC_USEC={now}"))
    }

    /// STOPPING=1.
    ///
    /// # Errors
    /// [`NotifyError::Send`].
    pub fn stopping(&self) -> Result<()> {
        self.send("STOPPING=1")
    }

    /// WATCHDOG=1.
    ///
    /// # Errors
    /// [`NotifyError::Send`].
    pub fn watchdog(&self) -> Result<()> {
        self.send("WATCHDOG=1")
    }

    /// Hands `fd` to the service manager's file descriptor store under `name` (FDSTORE=1,
    /// FDNAME=, and FDPOLL=0: a regular file is never polled): it is given back to the
    /// service's next start ([`listen_fds`]), while the unit allows it
    /// (`FileDescriptorStoreMax=`). Nothing without a service manager.
    ///
    /// # Errors
    /// [`NotifyError::Socket`], [`NotifyError::Send`].
    pub fn store_fd(&self, name: &str, fd: BorrowedFd<'_>) -> Result<()> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        let Some((_, addr, shown)) = &self.target else {
            return Ok(());
        };
        let sock_err = |source| NotifyError::Socket {
            addr: shown.clone(),
            source,
        };
        // Connected, so that the message needs no address of nix's own kind.
        let sock = UnixDatagram::unbound().map_err(sock_err)?;
        sock.connect_addr(addr).map_err(sock_err)?;
        let msg = format!("FDSTORE=1\nFDNAME={name}\nFDPOLL=0");
        let iov = [std::io::IoSlice::new(msg.as_bytes())];
        let fds = [fd.as_raw_fd()];
        sendmsg::<()>(
            sock.as_raw_fd(),
            &iov,
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .map(|_| ())
        .map_err(|e| NotifyError::Send {
            what: "FDSTORE=1".into(),
            source: e.into(),
        })
    }

    /// Takes the descriptors stored under `name` out of the service manager's store
    /// (FDSTOREREMOVE=1).
    ///
    /// # Errors
    /// [`NotifyError::Send`].
    pub fn remove_fds(&self, name: &str) -> Result<()> {
        self.send(&format!("FDSTOREREMOVE=1\nFDNAME={name}"))
    }
}

/// The descriptors the service manager passed to this process (`$LISTEN_FDS` from fd 3, for
/// this process only: `$LISTEN_PID`), with their names (`$LISTEN_FDNAMES`), as
/// sd_listen_fds_with_names(3) reads them: taken once (the variables are removed, the
/// descriptors made close-on-exec). None passed: empty.
pub fn listen_fds() -> Vec<(String, OwnedFd)> {
    let ours = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.trim().parse::<u32>().ok())
        == Some(std::process::id());
    let n = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.trim().parse::<i32>().ok())
        .unwrap_or(0);
    let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
    for v in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        // Read once at start-up, before the daemon starts its threads (the environment is not
        // safe to change beside them).
        std::env::remove_var(v);
    }
    if !ours || !(1..=4096).contains(&n) {
        return Vec::new();
    }
    let mut names = names.split(':');
    (0..n)
        .filter_map(|i| {
            let raw = 3 + i;
            let name = names.next().unwrap_or("unknown").to_owned();
            // Only a descriptor that is open (the manager passed it).
            let flags = nix::fcntl::fcntl(raw, nix::fcntl::FcntlArg::F_GETFD).ok()?;
            let flags =
                nix::fcntl::FdFlag::from_bits_truncate(flags) | nix::fcntl::FdFlag::FD_CLOEXEC;
            let _ = nix::fcntl::fcntl(raw, nix::fcntl::FcntlArg::F_SETFD(flags));
            // SAFETY: the service manager passed fd `raw` to this process alone ($LISTEN_PID),
            // it is open (F_GETFD succeeded), and nothing else in the process owns it: it is
            // taken once, here.
            Some((name, unsafe { OwnedFd::from_raw_fd(raw) }))
        })
        .collect()
}

fn one_line(s: &str) -> String {
    s.replace('\n', " ")
}

/// Whether `$WATCHDOG_PID` (if set) names this process.
fn watchdog_pid_is_ours(watchdog_pid: Option<&str>, pid: u32) -> bool {
    match watchdog_pid {
        None => true,
        Some(p) => p.trim().parse::<u32>() == Ok(pid),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv(sock: &UnixDatagram) -> String {
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 512];
        let n = sock.recv(&mut buf).unwrap();
        String::from_utf8(buf[..n].to_vec()).unwrap()
    }

    #[test]
    fn path_socket_gets_every_message() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("notify");
        let server = UnixDatagram::bind(&p).unwrap();
        let n = Notifier::from_vars(Some(p.as_os_str()), None, None, 1).unwrap();
        assert!(n.is_enabled());
        n.ready("serving 2 namespaces\nsecond line").unwrap();
        assert_eq!(
            recv(&server),
            "READY=1\nSTATUS=serving 2 namespaces second line"
        );
        n.status("busy").unwrap();
        assert_eq!(recv(&server), "STATUS=busy");
        n.reloading().unwrap();
        let r = recv(&server);
        assert!(
            r.starts_with("RELOADING=1\nMONOTONIC_USEC=") && !r.ends_with("=0"),
            "{r}"
        );
        n.stopping().unwrap();
        assert_eq!(recv(&server), "STOPPING=1");
        n.watchdog().unwrap();
        assert_eq!(recv(&server), "WATCHDOG=1");
    }

    #[test]
    fn abstract_socket() {
        let name = format!("rpma-notify-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let server = UnixDatagram::bind_addr(&addr).unwrap();
        let var = format!("@{name}");
        let n = Notifier::from_vars(Some(OsStr::new(&var)), None, None, 1).unwrap();
        n.ready("ok").unwrap();
        assert_eq!(recv(&server), "READY=1\nSTATUS=ok");
    }

    #[test]
    fn unset_is_a_no_op() {
        let n = Notifier::from_vars(None, None, None, 1).unwrap();
        assert!(!n.is_enabled());
        n.ready("x").unwrap();
        n.stopping().unwrap();
        assert_eq!(n.watchdog_interval(), None);
        assert!(!Notifier::disabled().is_enabled());
    }

    #[test]
    fn watchdog_interval_is_half_and_honours_the_pid() {
        let n = Notifier::from_vars(None, Some("3000000"), None, 42).unwrap();
        assert_eq!(n.watchdog_interval(), Some(Duration::from_millis(1500)));
        let n = Notifier::from_vars(None, Some("3000000"), Some("42"), 42).unwrap();
        assert_eq!(n.watchdog_interval(), Some(Duration::from_millis(1500)));
        let n = Notifier::from_vars(None, Some("3000000"), Some("43"), 42).unwrap();
        assert_eq!(n.watchdog_interval(), None);
    }

    #[test]
    fn bad_values_are_errors() {
        assert!(matches!(
            Notifier::from_vars(Some(OsStr::new("relative/sock")), None, None, 1),
            Err(NotifyError::BadAddress(_))
        ));
        assert!(matches!(
            Notifier::from_vars(None, Some("soon"), None, 1),
            Err(NotifyError::BadWatchdog(_))
        ));
        assert!(matches!(
            Notifier::from_vars(None, Some("0"), None, 1),
            Err(NotifyError::BadWatchdog(_))
        ));
    }

    #[test]
    fn a_stored_descriptor_reaches_the_manager_with_its_name() {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        use std::os::fd::AsFd;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("notify");
        let server = UnixDatagram::bind(&p).unwrap();
        let n = Notifier::from_vars(Some(p.as_os_str()), None, None, 1).unwrap();
        let file = tempfile::tempfile().unwrap();
        n.store_fd("rpma-ns-1-2", file.as_fd()).unwrap();
        let mut buf = [0u8; 256];
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
        let m = recvmsg::<()>(
            server.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::empty(),
        )
        .unwrap();
        let fds: Vec<_> = m
            .cmsgs()
            .unwrap()
            .filter_map(|c| match c {
                ControlMessageOwned::ScmRights(f) => Some(f),
                _ => None,
            })
            .flatten()
            .collect();
        let len = m.bytes;
        assert_eq!(fds.len(), 1);
        // The same file: another descriptor of it.
        let st = |fd| nix::sys::stat::fstat(fd).unwrap();
        assert_eq!(st(fds[0]).st_ino, st(file.as_raw_fd()).st_ino);
        let _ = nix::unistd::close(fds[0]);
        assert_eq!(
            std::str::from_utf8(&buf[..len]).unwrap(),
            "FDSTORE=1\nFDNAME=rpma-ns-1-2\nFDPOLL=0"
        );
        n.remove_fds("rpma-ns-1-2").unwrap();
        assert_eq!(recv(&server), "FDSTOREREMOVE=1\nFDNAME=rpma-ns-1-2");
        // Without a manager: nothing.
        let none = Notifier::from_vars(None, None, None, 1).unwrap();
        none.store_fd("x", file.as_fd()).unwrap();
    }

    #[test]
    fn send_to_a_missing_socket_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("absent");
        let n = Notifier::from_vars(Some(p.as_os_str()), None, None, 1).unwrap();
        assert!(matches!(n.ready("x"), Err(NotifyError::Send { .. })));
    }
}
