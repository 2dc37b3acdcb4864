//! Helpers shared by rpma's end-to-end tests: locating the built binaries and scratch space.

use std::path::PathBuf;

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
