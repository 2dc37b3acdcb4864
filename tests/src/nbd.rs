//! What the NBD tests share (tests/tests/nbd_*.rs): a target serving [`SUB`], a running
//! `rpma-initiator nbd` ([`Export`]), the CLI as a second opinion ([`cli_read`], [`cli_write`])
//! and a hand-driven NBD client ([`Raw`]) that can misbehave on purpose.
//!
//! A test whose client is not installed says SKIPPED (scripts/install-deps.sh installs them).

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::{
    built, conn_args, four_namespace_target, run_with_deadline, text, Shm, Subsystem, Target,
};

pub const SUB: &str = "nqn.2026-11.io.rpma:nbd";
pub const HOST: &str = "nqn.2026-11.io.rpma:nbd-host";
/// nsid 1 of [`four_namespaces`](crate::four_namespaces): page-cache, 8 MiB of 4096-byte blocks.
pub const NS1: u64 = 8 << 20;
pub const WAIT: Duration = Duration::from_secs(30);

/// A target in a scratch dir of its own serving SUB to any host: [`four_namespaces`](crate::four_namespaces) (nsid 1
/// page-cache 8 MiB, 2 read-only 1 MiB of 512-byte blocks, 3 volatile, 4 forced dax 2 MiB).
pub fn start(tag: &str) -> (tempfile::TempDir, Shm, Target) {
    four_namespace_target(tag, Subsystem::new(SUB).any_host(), 512)
}

/// Whether `tool` runs; else says why the test is skipped.
pub fn have(tool: &str) -> bool {
    let ok = Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !ok {
        eprintln!("SKIPPED: {tool} is not installed (scripts/install-deps.sh installs it)");
    }
    ok
}

/// A running `rpma-initiator nbd` on a Unix socket in the target's directory; SIGKILLed on drop.
#[derive(Debug)]
pub struct Export {
    pub child: Option<Child>,
    pub sock: PathBuf,
    pub log: PathBuf,
    /// HOST:PORT when it listens on TCP (`--listen` in its arguments).
    pub tcp: Option<String>,
}

impl Export {
    /// Starts an export of `nsid` (extra `args` after `nbd`) and waits for its READY=1.
    pub fn start(t: &Target, nsid: u32, tag: &str, args: &[&str]) -> Export {
        Export::start_via(t, &t.url(), nsid, tag, args)
    }

    /// [`start`](Self::start) with the target at `url` (a relay's, say).
    pub fn start_via(t: &Target, url: &str, nsid: u32, tag: &str, args: &[&str]) -> Export {
        Export::start_logging(t, url, nsid, tag, args, "info")
    }

    /// [`start_via`](Self::start_via) logging at `level` (`RUST_LOG`).
    pub fn start_logging(
        t: &Target,
        url: &str,
        nsid: u32,
        tag: &str,
        args: &[&str],
        level: &str,
    ) -> Export {
        let dir = t.dir();
        let sock = dir.join(format!("{tag}.sock"));
        let log = dir.join(format!("{tag}.log"));
        let notify_path = dir.join(format!("{tag}.notify"));
        let _ = std::fs::remove_file(&notify_path);
        let notify = UnixDatagram::bind(&notify_path).unwrap();
        let conn = conn_args(url, SUB, HOST, Some(nsid));
        let mut a: Vec<&str> = conn.iter().map(String::as_str).collect();
        a.push("nbd");
        let s = sock.to_str().unwrap().to_owned();
        let tcp = args
            .iter()
            .position(|a| *a == "--listen")
            .map(|i| args[i + 1].to_owned());
        if tcp.is_none() {
            a.extend(["--socket", &s]);
        }
        a.extend_from_slice(args);
        let child = Command::new(built("rpma-initiator"))
            .args(&a)
            .env("NOTIFY_SOCKET", &notify_path)
            .env("RUST_LOG", level)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut e = Export {
            child: Some(child),
            sock,
            log,
            tcp,
        };
        let deadline = Instant::now() + WAIT;
        let mut buf = [0u8; 512];
        loop {
            assert!(
                Instant::now() < deadline,
                "no READY=1 within {WAIT:?}: {}",
                e.log()
            );
            if let Ok(Some(st)) = e.child.as_mut().unwrap().try_wait() {
                panic!("rpma-initiator nbd exited ({st}) before READY: {}", e.log());
            }
            notify
                .set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            if let Ok(n) = notify.recv(&mut buf) {
                if buf[..n].starts_with(b"READY=1") {
                    // READY=1 means the socket accepts.
                    match &e.tcp {
                        Some(a) => assert!(std::net::TcpStream::connect(a).is_ok()),
                        None => assert!(UnixStream::connect(&e.sock).is_ok(), "{}", e.log()),
                    }
                    return e;
                }
            }
        }
    }

    /// `nbd+unix:///rpma?socket=PATH`, or `nbd://HOST:PORT/rpma`.
    pub fn uri(&self) -> String {
        match &self.tcp {
            Some(a) => format!("nbd://{a}/rpma"),
            None => format!("nbd+unix:///rpma?socket={}", self.sock.display()),
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    pub fn running(&mut self) -> bool {
        matches!(self.child.as_mut().unwrap().try_wait(), Ok(None))
    }

    /// SIGTERM, then its exit status (within the deadline).
    pub fn term(&mut self) -> ExitStatus {
        // SAFETY: kill has no memory-safety preconditions; the pid is our live child's.
        assert_eq!(unsafe { libc::kill(self.pid(), libc::SIGTERM) }, 0);
        self.wait()
    }

    pub fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                return st;
            }
            assert!(Instant::now() < deadline, "did not exit: {}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the log has a line containing `what`; returns that line.
    pub fn log_line(&self, what: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(l) = self.log().lines().find(|l| l.contains(what)) {
                return l.to_owned();
            }
            assert!(
                Instant::now() < deadline,
                "no {what:?} in the log: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs a client tool within the deadline; panics with its output unless it succeeds.
pub fn tool(cmd: &mut Command) -> String {
    let o = run_with_deadline(cmd, WAIT);
    assert!(o.status.success(), "{cmd:?}: {}", text(&o));
    text(&o)
}

/// `rpma-initiator` with the target, subsystem, host and `--nsid nsid`, then `args`.
pub fn cli(t: &Target, nsid: u32, args: &[&str]) -> std::process::Output {
    crate::cli_with(&conn_args(&t.url(), SUB, HOST, Some(nsid)), args)
}

/// The namespace's bytes `[offset, offset + len)`, read by `rpma-initiator read`.
pub fn cli_read(t: &Target, nsid: u32, offset: u64, len: u64) -> Vec<u8> {
    let conn = conn_args(&t.url(), SUB, HOST, Some(nsid));
    crate::cli_read_with(&conn, t.dir(), offset, len)
}

/// Writes `data` at `offset` with `rpma-initiator write --durable`.
pub fn cli_write(t: &Target, nsid: u32, offset: u64, data: &[u8]) {
    let conn = conn_args(&t.url(), SUB, HOST, Some(nsid));
    crate::cli_write_with(&conn, t.dir(), offset, data);
}

// ---- a raw client ----

pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const OPT_GO: u32 = 7;
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const FUA: u16 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;

/// A hand-driven NBD client.
#[derive(Debug)]
pub struct Raw(pub UnixStream);

impl Raw {
    /// Connected, greeting read and checked, client flags (fixed newstyle, no zeroes) sent.
    pub fn hello(sock: &Path) -> Raw {
        let s = UnixStream::connect(sock).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut r = Raw(s);
        let g = r.take(18);
        assert_eq!(&g[..16], b"NBDMAGICIHAVEOPT");
        r.send(&3u32.to_be_bytes());
        r
    }

    pub fn send(&mut self, b: &[u8]) {
        self.0.write_all(b).unwrap();
    }

    /// Sends `b`, then waits until the server has read all of it (`SIOCOUTQ` down to 0): a
    /// request whose header and first bytes were sent this way is found incomplete by the
    /// server, its payload still coming.
    pub fn send_read(&mut self, b: &[u8]) {
        self.send(b);
        let deadline = Instant::now() + WAIT;
        loop {
            let mut n: libc::c_int = 0;
            // SAFETY: SIOCOUTQ writes one int through the pointer, which outlives the call.
            let r = unsafe { libc::ioctl(self.0.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
            assert_eq!(r, 0, "SIOCOUTQ: {}", std::io::Error::last_os_error());
            if n == 0 {
                return;
            }
            assert!(Instant::now() < deadline, "the server stopped reading");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn take(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.0.read_exact(&mut b).unwrap();
        b
    }

    pub fn option(&mut self, opt: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&opt.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b);
    }

    /// (option, reply type, data) of the next option reply.
    pub fn option_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let h = self.take(20);
        assert_eq!(h[..8], 0x0003_e889_0455_65a9u64.to_be_bytes());
        let n = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        (
            u32::from_be_bytes(h[8..12].try_into().unwrap()),
            u32::from_be_bytes(h[12..16].try_into().unwrap()),
            self.take(n),
        )
    }

    /// NBD_OPT_GO for the default export (asking for the block sizes: alignment is enforced).
    pub fn go(&mut self) {
        let mut d = 0u32.to_be_bytes().to_vec();
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&3u16.to_be_bytes());
        self.option(OPT_GO, &d);
        loop {
            let (_, ty, _) = self.option_reply();
            if ty == 1 {
                return;
            }
            assert_eq!(ty, 3, "NBD_REP_INFO or NBD_REP_ACK");
        }
    }

    /// A client in the transmission phase.
    pub fn connect(sock: &Path) -> Raw {
        let mut r = Raw::hello(sock);
        r.go();
        r
    }

    pub fn request(
        &mut self,
        kind: u16,
        flags: u16,
        handle: u64,
        offset: u64,
        len: u32,
    ) -> Vec<u8> {
        let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&handle.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b
    }

    /// (error, handle) of the next simple reply.
    pub fn reply(&mut self) -> (u32, u64) {
        let h = self.take(16);
        assert_eq!(h[..4], 0x6744_6698u32.to_be_bytes());
        (
            u32::from_be_bytes(h[4..8].try_into().unwrap()),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
        )
    }

    pub fn read(&mut self, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
        let r = self.request(CMD_READ, 0, 9, offset, len);
        self.send(&r);
        match self.reply() {
            (0, 9) => Ok(self.take(len as usize)),
            (e, 9) => Err(e),
            (_, h) => panic!("reply to handle {h}"),
        }
    }

    pub fn write(&mut self, flags: u16, offset: u64, data: &[u8]) -> u32 {
        let mut r = self.request(CMD_WRITE, flags, 10, offset, data.len() as u32);
        r.extend_from_slice(data);
        self.send(&r);
        let (e, h) = self.reply();
        assert_eq!(h, 10);
        e
    }

    pub fn flush(&mut self) -> u32 {
        let r = self.request(CMD_FLUSH, 0, 11, 0, 0);
        self.send(&r);
        let (e, h) = self.reply();
        assert_eq!(h, 11);
        e
    }

    /// The server closed the connection (end of file or reset) within the deadline.
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 64];
        loop {
            match self.0.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}
