//! The workspace's binaries, ports, key files and /dev/shm namespace files.

use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The directory cargo puts this workspace's binaries in (`target/debug` or `target/release`).
pub fn bin_dir() -> PathBuf {
    let mut exe = std::env::current_exe().expect("current_exe");
    exe.pop(); // the test binary's name
    if exe.ends_with("deps") {
        exe.pop();
    }
    exe
}

/// Path of a workspace binary, e.g. `bin("rpma-target")`.
pub fn bin(name: &str) -> PathBuf {
    bin_dir().join(name)
}

/// Path of a workspace binary that must exist (built by `cargo build --workspace`).
pub fn built(name: &str) -> PathBuf {
    let p = bin(name);
    assert!(
        p.exists(),
        "{} is not built: run `cargo build --workspace` first (make test does)",
        p.display()
    );
    p
}

/// An unused TCP port on 127.0.0.1, never the same twice in one process.
///
/// Taken from below the kernel's ephemeral range (`ip_local_port_range`), where neither a
/// `bind` to port 0 nor an outgoing `connect` ever lands: a port asked for with port 0 and
/// released could be handed to the next caller too (two of one target's listeners got the
/// same port that way), or to a client's connection before the daemon binds it. Each port is
/// checked free by binding it; the range's start depends on the process id, so test binaries
/// run one after another do not walk the same ports. Falls back to port 0 (deduplicated) if
/// the ephemeral range leaves no room below it.
pub fn free_port() -> u16 {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static GIVEN: Mutex<Option<(u32, HashSet<u16>)>> = Mutex::new(None);
    const FLOOR: u32 = 10_000;
    let ceiling = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let (next, seen) =
        given.get_or_insert_with(|| (std::process::id().wrapping_mul(7919), HashSet::new()));
    if ceiling > FLOOR + 1000 {
        let span = ceiling - FLOOR;
        for _ in 0..span {
            let port = (FLOOR + *next % span) as u16;
            *next = next.wrapping_add(1);
            if !seen.contains(&port) && TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
                seen.insert(port);
                return port;
            }
        }
    }
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .expect("bind 127.0.0.1:0")
            .local_addr()
            .expect("local_addr")
            .port();
        if seen.insert(port) {
            return port;
        }
    }
}

/// A TCP connection from `src` (another loopback address, 127.0.0.N: a peer of its own to the
/// target's per-address budgets and logs) to 127.0.0.1:`port`, reads timing out after
/// `read_timeout`.
pub fn tcp_from(port: u16, src: Ipv4Addr, read_timeout: std::time::Duration) -> TcpStream {
    use nix::sys::socket::{bind, connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn};
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("a TCP socket");
    bind(fd.as_raw_fd(), &SockaddrIn::from(SocketAddrV4::new(src, 0))).expect("bind 127.0.0.N");
    let to = SockaddrIn::from(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
    connect(fd.as_raw_fd(), &to).expect("connect to the target");
    let s = TcpStream::from(fd);
    s.set_read_timeout(Some(read_timeout)).unwrap();
    s
}

/// Writes a pre-shared key file at `path`: the hex byte `byte` 32 times, mode 0600 (the target
/// refuses a key that others can read).
pub fn write_psk(path: &Path, byte: &str) {
    std::fs::write(path, byte.repeat(32)).expect("write psk file");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod psk file");
}

/// A namespace file under /dev/shm (tmpfs: the volatile domain), `/dev/shm/rpma-test-PID-TAG`,
/// removed on drop. The tag keeps the tests of one binary apart.
#[derive(Debug)]
pub struct Shm(String);

impl Shm {
    /// A path of its own for `tag` (nothing is created: the target makes the file). Tests of
    /// one binary run at once and often share a tag: each gets a file of its own (two targets
    /// on one file are refused, and would have shared the namespace's bytes).
    pub fn new(tag: &str) -> Shm {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Shm(format!(
            "/dev/shm/rpma-test-{}-{n}-{tag}",
            std::process::id()
        ))
    }

    /// The file's path.
    pub fn path(&self) -> &str {
        &self.0
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A file of the repository, by its path from the repository's root.
pub fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_free_and_below_the_ephemeral_range() {
        let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let distinct: std::collections::HashSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len(), "a port handed out twice");
        for p in &ports {
            assert!(*p < low, "port {p} is in the ephemeral range (from {low})");
        }
        // Each is free: a listener can bind it.
        let _l = TcpListener::bind((Ipv4Addr::LOCALHOST, ports[0])).expect("the port is free");
    }
}
