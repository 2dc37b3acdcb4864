//! The workspace's binaries, ports, key files and /dev/shm namespace files.

use std::net::TcpListener;
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
