//! What [`OpenOptions::open`] would do with a backing store, found without doing it: nothing is
//! created, opened for writing, resized, allocated or mapped. For `check-config` and any other
//! look before the leap.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use nix::unistd::AccessFlags;

use super::devdax;
use super::domain::Domain;
use super::error::{Error, Result};
use super::open::{ram_backed, OpenOptions, Store};

/// What [`OpenOptions::open`] would do to the backing store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlanAction {
    /// Create the file and allocate the whole size.
    Create,
    /// Grow the existing file from `from` bytes and allocate it. `from == 0`: an empty file,
    /// which is grown without a [`Resize`](crate::pmem::Resize) choice.
    Grow {
        /// The file's size now.
        from: u64,
    },
    /// Shrink the existing file from `from` bytes
    /// ([`Resize::GrowOrShrink`](crate::pmem::Resize::GrowOrShrink) only).
    Shrink {
        /// The file's size now.
        from: u64,
    },
    /// Open the existing file at the size it has (allocating any holes in it).
    AsIs,
    /// Map a devdax device (all of it, or the size asked for).
    DevDax,
}

/// The outcome [`OpenOptions::plan`] foresees for a backing store.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Plan {
    /// What open would do.
    pub action: PlanAction,
    /// The size of the mapping open would make.
    pub size: u64,
    /// Bytes open would have to allocate (0 for a fully allocated file and for devdax).
    pub allocate: u64,
    /// The domain open's probe would find (see [`OpenOptions::plan`] for how it is found).
    pub probed: Domain,
    /// The domain open would report ([`Domain::DaxForced`] when forced).
    pub domain: Domain,
}

impl OpenOptions {
    /// Says what [`OpenOptions::open`] would do with these options, and the error it would
    /// return, without changing anything: the path is only stat'ed (and its directory, for a
    /// file to create), checked with access(2) for read-write, and its filesystem asked for its
    /// type and free space. Nothing is created, opened for writing, resized, allocated or mapped.
    ///
    /// The domain is found without mapping: `dax` for a devdax device or a file with the DAX
    /// attribute (statx), or, for a file not yet created, on a filesystem mounted `dax` or
    /// `dax=always`; `volatile` on tmpfs, ramfs and hugetlbfs (and an overlay over one); `page-cache` otherwise. Open can
    /// find another domain in two cases: a dax file on a device that refuses MAP_SYNC
    /// (virtio-pmem) is mapped as `page-cache`, and a file created under a `dax=inode` directory
    /// flagged for DAX is `dax`.
    ///
    /// Errors: as [`OpenOptions::open`] for the same store, but never [`Error::Map`] or
    /// [`Error::NoSpace`]; [`Error::NotEnoughSpace`] instead when the filesystem has fewer free
    /// bytes than open would allocate.
    pub fn plan(&self) -> Result<Plan> {
        let plan = match self.locate()? {
            Store::File(meta) => self.plan_file(&meta),
            Store::CharDevice(meta) => self.plan_devdax(&meta),
            Store::Create { size } => self.plan_create(size),
        }?;
        self.check_simulation(plan.action == PlanAction::DevDax, plan.domain)?;
        Ok(plan)
    }

    fn plan_file(&self, meta: &fs::Metadata) -> Result<Plan> {
        // open() opens before it looks at sizes, so a refused open is its first error.
        self.check_access(&self.path, AccessFlags::R_OK | AccessFlags::W_OK)?;
        let existing = meta.len();
        let size = self.settle_size(existing)?;
        let action = if size == existing {
            PlanAction::AsIs
        } else if size > existing {
            PlanAction::Grow { from: existing }
        } else {
            PlanAction::Shrink { from: existing }
        };
        let allocated = meta.blocks().saturating_mul(512);
        let allocate = size.saturating_sub(allocated);
        self.check_room(&self.path, allocate)?;
        let probed = if self.on_ram_fs(&self.path)? {
            Domain::Volatile
        } else if has_dax_attribute(&self.path).map_err(|e| self.io("statx", e))? {
            Domain::Dax
        } else {
            Domain::PageCache
        };
        Ok(self.plan_of(action, size, allocate, probed))
    }

    fn plan_create(&self, size: u64) -> Result<Plan> {
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        // open(O_CREAT) fails like this on a missing or closed directory: the error is the file's.
        let dir_meta = fs::metadata(dir).map_err(|e| self.open_error("open", e))?;
        self.check_access(dir, AccessFlags::W_OK | AccessFlags::X_OK)?;
        self.check_room(dir, size)?;
        let probed = if self.on_ram_fs(dir)? {
            Domain::Volatile
        } else if fs::read_to_string("/proc/self/mountinfo")
            .is_ok_and(|text| mounted_dax(&text, dir_meta.dev()))
        {
            Domain::Dax
        } else {
            Domain::PageCache
        };
        Ok(self.plan_of(PlanAction::Create, size, size, probed))
    }

    fn plan_devdax(&self, meta: &fs::Metadata) -> Result<Plan> {
        let info = devdax::probe(&self.path, meta.rdev())?;
        let size = devdax::mapping_len(&self.path, info, self.size)?;
        self.check_size(size)?;
        self.check_access(&self.path, AccessFlags::R_OK | AccessFlags::W_OK)?;
        Ok(self.plan_of(PlanAction::DevDax, size, 0, Domain::Dax))
    }

    fn plan_of(&self, action: PlanAction, size: u64, allocate: u64, probed: Domain) -> Plan {
        Plan {
            action,
            size,
            allocate,
            probed,
            domain: self.reported(probed),
        }
    }

    /// Whether this process may open `path` with `mode`: the check open(2) would make, with the
    /// errors open() would return for the namespace.
    fn check_access(&self, path: &Path, mode: AccessFlags) -> Result<()> {
        nix::unistd::access(path, mode).map_err(|errno| self.open_error("open", errno.into()))
    }

    /// Whether the filesystem holding `path` has `needed` bytes free for this user.
    fn check_room(&self, path: &Path, needed: u64) -> Result<()> {
        if needed == 0 {
            return Ok(());
        }
        let st = nix::sys::statvfs::statvfs(path).map_err(|e| self.io("statvfs", e.into()))?;
        let available = (st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64);
        if available < needed {
            return Err(Error::NotEnoughSpace {
                path: self.path.clone(),
                needed,
                available,
            });
        }
        Ok(())
    }

    fn on_ram_fs(&self, path: &Path) -> Result<bool> {
        let st = nix::sys::statfs::statfs(path).map_err(|e| self.io("statfs", e.into()))?;
        Ok(ram_backed(path, st.filesystem_type().0 as u32))
    }

    fn io(&self, op: &'static str, source: io::Error) -> Error {
        Error::Io {
            path: self.path.clone(),
            op,
            source,
        }
    }
}

/// Whether statx says the file is accessed through DAX (STATX_ATTR_DAX, Linux 5.8+; an older
/// kernel that does not know the attribute says no).
fn has_dax_attribute(path: &Path) -> io::Result<bool> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut stx = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: `c` is a NUL-terminated path alive for the call, and `stx` is a buffer of the size
    // statx writes, owned by this frame.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            0,
            libc::STATX_TYPE,
            stx.as_mut_ptr(),
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOSYS) => Ok(false),
            _ => Err(e),
        };
    }
    // SAFETY: statx succeeded, so it filled the struct (which was zeroed before, too).
    let stx = unsafe { stx.assume_init() };
    let dax = libc::STATX_ATTR_DAX as u64;
    Ok(stx.stx_attributes_mask & dax != 0 && stx.stx_attributes & dax != 0)
}

/// Whether /proc/self/mountinfo `text` mounts the filesystem of device `dev` with `dax` or
/// `dax=always` (every new file on it is then DAX).
fn mounted_dax(text: &str, dev: u64) -> bool {
    let want = format!("{}:{}", libc::major(dev), libc::minor(dev));
    text.lines()
        .filter(|line| line.split(' ').nth(2) == Some(want.as_str()))
        .any(|line| {
            // "id parent maj:min root mountpoint OPTIONS [optional...] - fstype source SUPER"
            let (mount, rest) = line.split_once(" - ").unwrap_or((line, ""));
            let options = mount.split(' ').nth(5).into_iter();
            let super_options = rest.split(' ').nth(2).into_iter();
            options
                .chain(super_options)
                .flat_map(|o| o.split(','))
                .any(|o| o == "dax" || o == "dax=always")
        })
}

#[cfg(test)]
mod tests {
    use std::mem::discriminant;

    use super::*;
    use crate::pmem::Resize;

    const MIB: u64 = 1 << 20;

    /// Size, mtime and allocated blocks: what a plan must leave alone.
    fn footprint(p: &Path) -> (u64, i64, i64, u64) {
        let m = fs::metadata(p).unwrap();
        (m.len(), m.mtime(), m.mtime_nsec(), m.blocks())
    }

    fn sparse(p: &Path, len: u64) {
        fs::File::create(p).unwrap().set_len(len).unwrap();
    }

    #[test]
    fn plans_each_action_and_changes_nothing() {
        let d = tempfile::tempdir_in("/dev/shm").unwrap();
        let p = |n: &str| d.path().join(n);
        sparse(&p("empty"), 0);
        sparse(&p("small"), MIB);
        sparse(&p("big"), 4 * MIB);
        let cases = [
            (
                OpenOptions::new(p("new")).size(2 * MIB).create(true),
                PlanAction::Create,
                2 * MIB,
            ),
            (
                OpenOptions::new(p("empty")).size(2 * MIB),
                PlanAction::Grow { from: 0 },
                2 * MIB,
            ),
            (
                OpenOptions::new(p("small"))
                    .size(2 * MIB)
                    .resize(Resize::Grow),
                PlanAction::Grow { from: MIB },
                2 * MIB,
            ),
            (
                OpenOptions::new(p("big"))
                    .size(2 * MIB)
                    .resize(Resize::GrowOrShrink),
                PlanAction::Shrink { from: 4 * MIB },
                2 * MIB,
            ),
            (OpenOptions::new(p("small")), PlanAction::AsIs, MIB),
            (
                OpenOptions::new(p("small")).size(MIB),
                PlanAction::AsIs,
                MIB,
            ),
        ];
        let before: Vec<_> = ["empty", "small", "big"].map(|n| footprint(&p(n))).into();
        for (opts, action, size) in cases {
            let plan = opts.plan().unwrap();
            assert_eq!((plan.action, plan.size), (action, size), "{opts:?}");
            assert_eq!(plan.probed, Domain::Volatile);
            assert_eq!(plan.domain, Domain::Volatile);
        }
        let after: Vec<_> = ["empty", "small", "big"].map(|n| footprint(&p(n))).into();
        assert_eq!(before, after);
        assert!(!p("new").exists());
        let forced = OpenOptions::new(p("small")).force_dax(true).plan().unwrap();
        assert_eq!(
            (forced.probed, forced.domain),
            (Domain::Volatile, Domain::DaxForced)
        );
        // A sparse file is allocated by open: the plan counts what is missing.
        assert_eq!(OpenOptions::new(p("small")).plan().unwrap().allocate, MIB);
    }

    /// Whether an error is the one a case expects.
    type IsExpected = fn(&Error) -> bool;

    #[test]
    fn each_refusal_is_the_error_open_returns() {
        let d = tempfile::tempdir().unwrap();
        let p = |n: &str| d.path().join(n);
        sparse(&p("empty"), 0);
        sparse(&p("small"), MIB);
        sparse(&p("big"), 4 * MIB);
        fs::create_dir(p("dir")).unwrap();
        nix::unistd::mkfifo(&p("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let cases: Vec<(OpenOptions, IsExpected)> = vec![
            (OpenOptions::new(p("small")).block_size(1000), |e| {
                matches!(e, Error::BadBlockSize { block_size: 1000 })
            }),
            (OpenOptions::new(p("small")).size(0), |e| {
                matches!(e, Error::ZeroSize { .. })
            }),
            (OpenOptions::new(p("empty")), |e| {
                matches!(e, Error::ZeroSize { .. })
            }),
            (OpenOptions::new(p("small")).size(MIB + 512), |e| {
                matches!(e, Error::SizeNotMultiple { .. })
            }),
            (OpenOptions::new(p("new")).create(true), |e| {
                matches!(e, Error::SizeRequired { .. })
            }),
            (OpenOptions::new(p("new")).size(MIB), |e| {
                matches!(e, Error::NotFound { .. })
            }),
            (
                OpenOptions::new(p("nodir/new")).size(MIB).create(true),
                |e| matches!(e, Error::NotFound { .. }),
            ),
            (OpenOptions::new(p("dir")).size(MIB), |e| {
                matches!(e, Error::IsDirectory { .. })
            }),
            (OpenOptions::new(p("fifo")).size(MIB), |e| {
                matches!(e, Error::UnsupportedFileType { kind: "FIFO", .. })
            }),
            (OpenOptions::new(p("small")).size(2 * MIB), |e| {
                matches!(
                    e,
                    Error::WouldGrow {
                        existing: MIB,
                        requested: 2097152,
                        ..
                    }
                )
            }),
            (
                OpenOptions::new(p("big"))
                    .size(2 * MIB)
                    .resize(Resize::Grow),
                |e| {
                    matches!(
                        e,
                        Error::WouldShrink {
                            existing: 4194304,
                            requested: 2097152,
                            ..
                        }
                    )
                },
            ),
            (OpenOptions::new("/dev/null").size(MIB), |e| {
                matches!(e, Error::NotDevDax { .. })
            }),
        ];
        for (opts, is_expected) in cases {
            let planned = opts.plan().unwrap_err();
            assert!(is_expected(&planned), "{opts:?}: {planned:?}");
            // open() agrees (the files are left as they were: every case is a refusal).
            let opened = opts.open().unwrap_err();
            assert_eq!(
                discriminant(&planned),
                discriminant(&opened),
                "{opts:?}: {opened:?}"
            );
        }
        assert!(!p("new").exists() && !p("nodir").exists());
    }

    #[test]
    fn no_room_and_no_permission_are_refused() {
        let d = tempfile::tempdir_in("/dev/shm").unwrap();
        let huge = OpenOptions::new(d.path().join("new"))
            .size(1 << 50)
            .create(true);
        let e = huge.plan().unwrap_err();
        assert!(
            matches!(e, Error::NotEnoughSpace { needed, .. } if needed == 1 << 50),
            "{e:?}"
        );
        assert!(!d.path().join("new").exists());
        if nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED the permission part: root may open any file");
            return;
        }
        let ro = d.path().join("ro");
        sparse(&ro, MIB);
        fs::set_permissions(&ro, std::os::unix::fs::PermissionsExt::from_mode(0o400)).unwrap();
        let e = OpenOptions::new(&ro).plan().unwrap_err();
        assert!(matches!(e, Error::PermissionDenied { .. }), "{e:?}");
    }

    #[test]
    fn the_plan_matches_what_open_then_does() {
        for dir in [
            tempfile::tempdir().unwrap(),
            tempfile::tempdir_in("/dev/shm").unwrap(),
        ] {
            let p = |n: &str| dir.path().join(n);
            sparse(&p("empty"), 0);
            sparse(&p("small"), MIB);
            sparse(&p("big"), 4 * MIB);
            for opts in [
                OpenOptions::new(p("new")).size(2 * MIB).create(true),
                OpenOptions::new(p("empty")).size(2 * MIB),
                OpenOptions::new(p("small"))
                    .size(2 * MIB)
                    .resize(Resize::Grow),
                OpenOptions::new(p("big"))
                    .size(2 * MIB)
                    .resize(Resize::GrowOrShrink),
                OpenOptions::new(p("big")).force_dax(true),
            ] {
                let plan = opts.plan().unwrap();
                let m = opts.open().unwrap();
                assert_eq!(plan.size, m.len() as u64, "{opts:?}");
                assert_eq!((plan.probed, plan.domain), (m.probed_domain(), m.domain()));
                let after = fs::metadata(m.path().unwrap()).unwrap();
                assert_eq!(after.len(), plan.size);
                // Open allocated the whole size: nothing is left to allocate.
                assert_eq!(opts.plan().unwrap().allocate, 0, "{opts:?}");
            }
        }
    }

    #[test]
    fn dax_mounts_are_read_from_mountinfo() {
        let text = "\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
40 27 259:1 / /mnt/pmem0 rw,relatime - ext4 /dev/pmem0 rw,dax=always
41 27 259:2 / /mnt/pmem1 rw,relatime - xfs /dev/pmem1 rw,attr2,dax,noquota
42 27 259:3 / /mnt/pmem2 rw,relatime - xfs /dev/pmem2 rw,dax=inode
43 27 259:4 / /mnt/pmem3 rw,relatime shared:1 - ext4 /dev/pmem3 rw,dax=never";
        let dev = |major, minor| libc::makedev(major, minor);
        assert!(!mounted_dax(text, dev(254, 0)));
        assert!(mounted_dax(text, dev(259, 1)));
        assert!(mounted_dax(text, dev(259, 2)));
        assert!(!mounted_dax(text, dev(259, 3)));
        assert!(!mounted_dax(text, dev(259, 4)));
        assert!(!mounted_dax(text, dev(8, 1)));
    }
}
