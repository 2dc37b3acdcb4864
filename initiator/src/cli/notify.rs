//! sd_notify(3) without libsystemd, for `nbd` under systemd (Type=notify): READY=1, STATUS=
//! and STOPPING=1 datagrams to `$NOTIFY_SOCKET` (a path, or `@abstract`). Unset: no-ops.
//! (The target has a fuller one with the watchdog; this one needs none.)

use std::ffi::OsStr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The service manager's socket, or nothing.
#[derive(Debug)]
pub(crate) struct Notifier(Option<(UnixDatagram, SocketAddr)>);

impl Notifier {
    /// From `$NOTIFY_SOCKET`.
    pub(crate) fn from_env() -> std::io::Result<Notifier> {
        Self::to(std::env::var_os("NOTIFY_SOCKET").as_deref())
    }

    fn to(var: Option<&OsStr>) -> std::io::Result<Notifier> {
        let Some(s) = var.filter(|s| !s.is_empty()) else {
            return Ok(Notifier(None));
        };
        let b = s.as_bytes();
        let addr = match b.strip_prefix(b"@") {
            Some(name) => SocketAddr::from_abstract_name(name)?,
            None if b.starts_with(b"/") => SocketAddr::from_pathname(s)?,
            None => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("NOTIFY_SOCKET={s:?} is neither an absolute path nor @abstract"),
                ))
            }
        };
        Ok(Notifier(Some((UnixDatagram::unbound()?, addr))))
    }

    fn send(&self, msg: &str) -> std::io::Result<()> {
        match &self.0 {
            Some((sock, addr)) => sock.send_to_addr(msg.as_bytes(), addr).map(|_| ()),
            None => Ok(()),
        }
    }

    /// READY=1 with a status line.
    pub(crate) fn ready(&self, status: &str) -> std::io::Result<()> {
        self.send(&format!("READY=1\nSTATUS={}", status.replace('\n', " ")))
    }

    /// STOPPING=1.
    pub(crate) fn stopping(&self) -> std::io::Result<()> {
        self.send("STOPPING=1")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_and_stopping_reach_the_socket() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("notify");
        let server = UnixDatagram::bind(&p).unwrap();
        server
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let n = Notifier::to(Some(p.as_os_str())).unwrap();
        n.ready("serving\nx").unwrap();
        let mut b = [0u8; 256];
        let k = server.recv(&mut b).unwrap();
        assert_eq!(&b[..k], b"READY=1\nSTATUS=serving x");
        n.stopping().unwrap();
        let k = server.recv(&mut b).unwrap();
        assert_eq!(&b[..k], b"STOPPING=1");
        assert!(Notifier::to(None).unwrap().ready("x").is_ok());
        assert!(Notifier::to(Some(OsStr::new("relative"))).is_err());
    }
}
