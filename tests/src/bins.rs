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

/// An unused TCP port on 127.0.0.1 (bound, then released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind 127.0.0.1:0")
        .local_addr()
        .expect("local_addr")
        .port()
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
    /// The path for `tag` (nothing is created: the target makes the file).
    pub fn new(tag: &str) -> Shm {
        Shm(format!("/dev/shm/rpma-test-{}-{tag}", std::process::id()))
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
