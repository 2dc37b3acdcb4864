//! Opening backing stores: the domain probe, sizing and allocation, and every bad input the
//! pmem layer promises a clear error for.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use rpma_common::pmem::{Domain, Durability, Error, Mapping, OpenOptions, Persist, Resize};

/// A temp dir under the repo's scratch/ (a disk filesystem: the page-cache domain).
fn scratch() -> tempfile::TempDir {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scratch");
    fs::create_dir_all(&dir).unwrap();
    tempfile::Builder::new()
        .prefix("pmem-open-")
        .tempdir_in(dir)
        .unwrap()
}

/// A temp dir under /dev/shm (tmpfs: the volatile domain).
fn shm() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("rpma-pmem-open-")
        .tempdir_in("/dev/shm")
        .unwrap()
}

/// Options that create the file at `path` with `size` bytes (or open it if it exists).
fn create(path: impl Into<PathBuf>, size: u64) -> OpenOptions {
    OpenOptions::new(path).size(size).create(true)
}

fn on_tmpfs(p: &Path) -> bool {
    nix::sys::statfs::statfs(p)
        .map(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
        .unwrap_or(false)
}

#[test]
fn file_under_the_repo_is_page_cache_and_fully_allocated() {
    let dir = scratch();
    if on_tmpfs(dir.path()) {
        eprintln!("skipped: the repo is on tmpfs here, so no page-cache file can be made");
        return;
    }
    let path = dir.path().join("ns.pmem");
    let m = create(&path, 1 << 20).open().unwrap();
    assert_eq!(m.domain(), Domain::PageCache);
    assert_eq!(m.probed_domain(), Domain::PageCache);
    assert_eq!(m.domain().to_string(), "page-cache");
    assert!(
        !m.map_sync(),
        "a disk filesystem without DAX accepted MAP_SYNC"
    );
    assert_eq!(m.len(), 1 << 20);
    assert!(!m.is_empty());
    assert_eq!(m.path(), Some(path.as_path()));
    assert!(m.backing_fd().is_some());
    let meta = fs::metadata(&path).unwrap();
    assert_eq!(meta.len(), 1 << 20);
    assert!(
        meta.blocks() * 512 >= 1 << 20,
        "only {} bytes allocated: the file is sparse",
        meta.blocks() * 512
    );
    assert_eq!(meta.mode() & 0o777, 0o600);
    assert_eq!(Persist::domain(&m), Domain::PageCache);
    assert_eq!(m.persist(0, 4096).unwrap(), Durability::Durable);
}

#[test]
fn file_under_dev_shm_is_volatile_and_says_visible_only() {
    let dir = shm();
    let m = create(dir.path().join("ns.pmem"), 64 << 10).open().unwrap();
    assert_eq!(m.domain(), Domain::Volatile);
    assert!(!m.domain().is_durable());
    m.write_at(10, b"abc").unwrap();
    assert_eq!(m.persist(10, 3).unwrap(), Durability::VisibleOnly);
    m.flush(0, 100).unwrap();
    assert_eq!(m.drain().unwrap(), Durability::VisibleOnly);
    let meta = fs::metadata(dir.path().join("ns.pmem")).unwrap();
    assert!(meta.blocks() * 512 >= 64 << 10, "tmpfs file left sparse");
}

#[test]
fn force_dax_reads_dax_forced_never_dax() {
    let dir = shm();
    let path = dir.path().join("ns.pmem");
    let m = create(&path, 64 << 10).force_dax(true).open().unwrap();
    assert_eq!(m.domain(), Domain::DaxForced);
    assert_eq!(m.domain().to_string(), "dax (forced)");
    assert_eq!(m.probed_domain(), Domain::Volatile);
    assert_eq!(m.persist(3, 100).unwrap(), Durability::Durable);
    drop(m);

    let dir = scratch();
    let m = create(dir.path().join("ns.pmem"), 64 << 10)
        .force_dax(true)
        .open()
        .unwrap();
    assert_eq!(m.domain(), Domain::DaxForced);
    assert_ne!(m.domain(), Domain::Dax);
}

#[test]
fn anonymous_memory_is_volatile() {
    let m = Mapping::anonymous(8192).unwrap();
    assert_eq!(m.domain(), Domain::Volatile);
    assert_eq!(m.len(), 8192);
    assert!(m.path().is_none());
    assert!(m.backing_fd().is_none());
    assert_eq!(m.persist(1, 8191).unwrap(), Durability::VisibleOnly);
    assert!(format!("{m:?}").contains("Volatile"));
    let err = Mapping::anonymous(0).unwrap_err();
    assert!(matches!(err, Error::Map { len: 0, .. }), "{err:?}");
}

#[test]
fn reopen_without_size_uses_the_existing_size_and_keeps_bytes() {
    let dir = scratch();
    let path = dir.path().join("ns.pmem");
    let m = create(&path, 8192).open().unwrap();
    m.write_at(5000, b"kept").unwrap();
    m.persist(5000, 4).unwrap();
    drop(m);
    let m = OpenOptions::new(&path).create(true).open().unwrap();
    assert_eq!(m.len(), 8192);
    let mut buf = [0u8; 4];
    m.read_at(5000, &mut buf).unwrap();
    assert_eq!(&buf, b"kept");
    // The same size again is not a resize.
    let m = OpenOptions::new(&path).size(8192).open().unwrap();
    assert_eq!(m.len(), 8192);
}

#[test]
fn missing_path_without_create_is_not_found() {
    let dir = scratch();
    let path = dir.path().join("absent.pmem");
    let err = OpenOptions::new(&path).size(4096).open().unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err:?}");
    assert!(err.to_string().contains("absent.pmem"), "{err}");
    assert!(!path.exists());
    // A missing parent directory, even with create.
    let err = create(dir.path().join("no/such/dir/ns"), 4096)
        .open()
        .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err:?}");
}

#[test]
fn create_without_size_is_refused() {
    let dir = scratch();
    let path = dir.path().join("new.pmem");
    let err = OpenOptions::new(&path).create(true).open().unwrap_err();
    assert!(matches!(err, Error::SizeRequired { .. }), "{err:?}");
    assert!(!path.exists());
}

#[test]
fn directory_is_refused() {
    let dir = scratch();
    let err = create(dir.path(), 4096).open().unwrap_err();
    assert!(matches!(err, Error::IsDirectory { .. }), "{err:?}");
    assert!(err.to_string().contains("is a directory"), "{err}");
}

#[test]
fn zero_size_is_refused() {
    let dir = scratch();
    let path = dir.path().join("ns.pmem");
    let err = create(&path, 0).open().unwrap_err();
    assert!(matches!(err, Error::ZeroSize { .. }), "{err:?}");
    assert!(!path.exists());
    // An existing empty file opened without a size has no size either.
    fs::write(&path, b"").unwrap();
    let err = OpenOptions::new(&path).open().unwrap_err();
    assert!(matches!(err, Error::ZeroSize { .. }), "{err:?}");
}

#[test]
fn size_not_a_multiple_of_the_block_size_is_refused() {
    let dir = scratch();
    let path = dir.path().join("ns.pmem");
    let err = create(&path, 6000).open().unwrap_err();
    assert!(
        matches!(
            err,
            Error::SizeNotMultiple {
                size: 6000,
                block_size: 4096,
                ..
            }
        ),
        "{err:?}"
    );
    // 1536 is three 512-byte blocks but not a whole 4096-byte one.
    let err = create(&path, 1536).open().unwrap_err();
    assert!(matches!(err, Error::SizeNotMultiple { .. }), "{err:?}");
    let m = create(&path, 1536).block_size(512).open().unwrap();
    assert_eq!(m.len(), 1536);
    drop(m);
    // An existing file whose size is not whole blocks, opened without a size.
    fs::write(dir.path().join("odd"), [0u8; 1000]).unwrap();
    let err = OpenOptions::new(dir.path().join("odd"))
        .block_size(512)
        .open()
        .unwrap_err();
    assert!(
        matches!(err, Error::SizeNotMultiple { size: 1000, .. }),
        "{err:?}"
    );
}

#[test]
fn unsupported_block_size_is_refused() {
    let dir = scratch();
    for bs in [0, 1024, 8192, 4095] {
        let err = create(dir.path().join("ns.pmem"), 8192)
            .block_size(bs)
            .open()
            .unwrap_err();
        assert!(
            matches!(err, Error::BadBlockSize { block_size } if block_size == bs),
            "{err:?}"
        );
    }
}

#[test]
fn size_beyond_the_filesystem_is_refused_at_open() {
    let dir = scratch();
    let path = dir.path().join("huge.pmem");
    // 1 PiB: more than any test machine's filesystem holds (and past ext4's file size limit).
    let err = create(&path, 1 << 50).open().unwrap_err();
    assert!(matches!(err, Error::NoSpace { .. }), "{err:?}");
    assert!(err.to_string().contains("no room"), "{err}");
    assert!(!path.exists(), "a failed create left its file behind");
}

#[test]
fn existing_file_is_not_resized_without_a_choice() {
    let dir = scratch();
    let path = dir.path().join("ns.pmem");
    fs::write(&path, vec![7u8; 8192]).unwrap();

    let err = OpenOptions::new(&path).size(4096).open().unwrap_err();
    assert!(
        matches!(
            err,
            Error::WouldShrink {
                existing: 8192,
                requested: 4096,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("refusing to shrink"), "{err}");
    // The text names no Rust API (CLI users read it); the hint names the choice.
    assert!(!err.to_string().contains("Resize::"), "{err}");
    assert_eq!(err.resize_needed(), Some(Resize::GrowOrShrink));
    let err = OpenOptions::new(&path)
        .size(4096)
        .resize(Resize::Grow)
        .open()
        .unwrap_err();
    assert!(matches!(err, Error::WouldShrink { .. }), "{err:?}");
    let err = OpenOptions::new(&path).size(16384).open().unwrap_err();
    assert!(matches!(err, Error::WouldGrow { .. }), "{err:?}");
    assert!(
        err.to_string().contains("unless growing is allowed"),
        "{err}"
    );
    assert!(!err.to_string().contains("Resize::"), "{err}");
    assert_eq!(err.resize_needed(), Some(Resize::Grow));
    assert_eq!(
        fs::read(&path).unwrap(),
        vec![7u8; 8192],
        "a refusal changed the file"
    );

    let m = OpenOptions::new(&path)
        .size(16384)
        .resize(Resize::Grow)
        .open()
        .unwrap();
    assert_eq!(m.len(), 16384);
    let mut buf = [0u8; 2];
    m.read_at(8191, &mut buf).unwrap();
    assert_eq!(
        buf,
        [7, 0],
        "grow lost the old bytes or did not zero the new ones"
    );
    drop(m);
    assert!(fs::metadata(&path).unwrap().blocks() * 512 >= 16384);

    let m = OpenOptions::new(&path)
        .size(4096)
        .resize(Resize::GrowOrShrink)
        .open()
        .unwrap();
    assert_eq!(m.len(), 4096);
    drop(m);
    assert_eq!(fs::metadata(&path).unwrap().len(), 4096);
}

#[test]
fn existing_empty_file_is_grown_without_a_choice() {
    let dir = scratch();
    let path = dir.path().join("empty.pmem");
    fs::write(&path, b"").unwrap();
    let m = OpenOptions::new(&path).size(8192).open().unwrap();
    assert_eq!(m.len(), 8192);
}

#[test]
fn char_device_that_is_not_devdax_is_refused() {
    let err = OpenOptions::new("/dev/null").open().unwrap_err();
    assert!(matches!(err, Error::NotDevDax { .. }), "{err:?}");
    assert!(err.to_string().contains("not a devdax device"), "{err}");
    let err = OpenOptions::new("/dev/zero").size(4096).open().unwrap_err();
    assert!(matches!(err, Error::NotDevDax { .. }), "{err:?}");
}

#[test]
fn fifo_is_refused() {
    let dir = scratch();
    let path = dir.path().join("fifo");
    nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let err = OpenOptions::new(&path).size(4096).open().unwrap_err();
    assert!(
        matches!(err, Error::UnsupportedFileType { kind: "FIFO", .. }),
        "{err:?}"
    );
}

const PERM_CHILD_ENV: &str = "RPMA_PMEM_TEST_PERMISSION_CHILD";

/// Runs as root in CI, where file modes do not stop anyone: the open is then tried in a re-exec
/// of this test binary as uid/gid 65534 (nobody), which reports what it saw on stdout. Both the
/// file and a copy of the binary live in a 0755 temp dir, so that nobody can reach them whatever
/// the modes of the checkout's directories are: the refusal is then the file's own mode.
#[test]
fn permission_denied_is_reported() {
    if let Some(path) = std::env::var_os(PERM_CHILD_ENV) {
        // The child side, running as nobody.
        let err = OpenOptions::new(PathBuf::from(path)).open().unwrap_err();
        assert!(matches!(err, Error::PermissionDenied { .. }), "{err:?}");
        assert!(err.to_string().contains("permission denied"), "{err}");
        println!("child-saw-permission-denied");
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("rpma-pmem-perm-")
        .tempdir()
        .unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.path().join("private.pmem");
    let m = create(&path, 4096).open().unwrap();
    drop(m);
    assert_eq!(fs::metadata(&path).unwrap().mode() & 0o777, 0o600);

    if !nix::unistd::geteuid().is_root() {
        fs::set_permissions(&path, fs::Permissions::from_mode(0o000)).unwrap();
        let err = OpenOptions::new(&path).open().unwrap_err();
        assert!(matches!(err, Error::PermissionDenied { .. }), "{err:?}");
        return;
    }
    let exe = dir.path().join("pmem_open_test");
    fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();
    use std::os::unix::process::CommandExt;
    let out = Command::new(&exe)
        .args([
            "--exact",
            "permission_denied_is_reported",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(PERM_CHILD_ENV, &path)
        .current_dir(dir.path())
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("child-saw-permission-denied"),
        "child as nobody: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn size_beyond_the_address_space_is_refused_before_touching_the_disk() {
    let dir = scratch();
    let path = dir.path().join("ns.pmem");
    let size = u64::MAX / 4096 * 4096;
    let err = create(&path, size).open().unwrap_err();
    assert!(
        matches!(err, Error::SizeTooLarge { size: s, .. } if s == size),
        "{err:?}"
    );
    assert!(!path.exists());
}
