//! Opening a backing store: [`OpenOptions`] (validation, the size and [`Resize`] rules,
//! creating and allocating a file up front with posix_fallocate, devdax devices), mapping it
//! shared (MAP_SYNC when accepted) and probing its persistence domain. [`OpenOptions::plan`]
//! (plan.rs) shares the first steps, [`OpenOptions::locate`] and [`OpenOptions::settle_size`],
//! so that the plan refuses what `open` refuses, with the same errors.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use super::devdax;
use super::domain::Domain;
use super::error::{Error, Result};
use super::map::Mapping;
use super::media::Media;
use super::sim::{self, Sim, Simulated, Simulation};

/// statfs magic numbers of filesystems that live in RAM.
const TMPFS_MAGIC: u32 = 0x0102_1994;
const RAMFS_MAGIC: u32 = 0x8584_58f6;
const HUGETLBFS_MAGIC: u32 = 0x9584_58f6;
const OVERLAYFS_MAGIC: u32 = 0x794c_7630;

/// What to do when an existing file's size differs from the size asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Resize {
    /// Refuse with [`Error::WouldGrow`] or [`Error::WouldShrink`] (the default).
    #[default]
    Refuse,
    /// Grow a smaller file (the new part is allocated up front like the rest); refuse to shrink.
    Grow,
    /// Grow or shrink to the size asked for. Shrinking discards the bytes past the new end.
    GrowOrShrink,
}

/// What the path of an [`OpenOptions`] names, found by [`OpenOptions::locate`].
#[derive(Debug)]
pub(super) enum Store {
    /// An existing regular file.
    File(fs::Metadata),
    /// A character device: a devdax device, or refused as not one.
    CharDevice(fs::Metadata),
    /// Nothing: a file of `size` bytes to create.
    Create { size: u64 },
}

/// Opens a namespace's backing store: a regular file (created and allocated if asked) or a devdax
/// character device, and maps it. See [`OpenOptions::open`].
#[derive(Debug, Clone)]
pub struct OpenOptions {
    pub(super) path: PathBuf,
    pub(super) size: Option<u64>,
    pub(super) block_size: u64,
    pub(super) force_dax: bool,
    pub(super) resize: Resize,
    pub(super) create: bool,
    pub(super) simulation: Option<Simulation>,
    pub(super) short_ok: bool,
}

impl OpenOptions {
    /// Options for `path`: no size (use the existing size), block size 4096, no force_dax,
    /// [`Resize::Refuse`], no create.
    pub fn new(path: impl Into<PathBuf>) -> OpenOptions {
        OpenOptions {
            path: path.into(),
            size: None,
            block_size: 4096,
            force_dax: false,
            resize: Resize::Refuse,
            create: false,
            simulation: None,
            short_ok: false,
        }
    }

    /// Namespace size in bytes: needed to create a file; for an existing one it must match unless
    /// [`OpenOptions::resize`] allows the change; for devdax it maps that much of the device.
    pub fn size(mut self, size: u64) -> OpenOptions {
        self.size = Some(size);
        self
    }

    /// Block size, 512 or 4096 (default). The size must be a multiple of it.
    pub fn block_size(mut self, block_size: u64) -> OpenOptions {
        self.block_size = block_size;
        self
    }

    /// Treat the mapping as dax whatever the probe finds (testing and benchmarking on DRAM, like
    /// PMDK's PMEM_IS_PMEM_FORCE): persists use cache write-back + sfence and the domain reads
    /// `dax (forced)`. It promises nothing about the media.
    pub fn force_dax(mut self, force: bool) -> OpenOptions {
        self.force_dax = force;
        self
    }

    /// Whether an existing file may be grown or shrunk to the size asked for.
    pub fn resize(mut self, resize: Resize) -> OpenOptions {
        self.resize = resize;
        self
    }

    /// Open an existing file shorter than [`size`](Self::size), which the resize choice does
    /// not grow, as it is instead of refusing it ([`Error::WouldGrow`]): mapped at `size`,
    /// nothing grown or allocated past its end, and failed at once as for a page the kernel
    /// cannot give back, at the file's end ([`Mapping::unreadable_at`]): its bytes are read
    /// and written no more. For a store known failed already (a file cut short under a
    /// running daemon), so that it is served failed rather than stop everything else.
    /// Not with the power-loss simulation.
    pub fn short_ok(mut self, short_ok: bool) -> OpenOptions {
        self.short_ok = short_ok;
        self
    }

    /// Create the file if it does not exist (a size is then required).
    pub fn create(mut self, create: bool) -> OpenOptions {
        self.create = create;
        self
    }

    /// Tests and debugging only: the power-loss simulation (sim.rs, docs/persistence.md). The
    /// mapping hands out a working copy in memory; the file (the media) receives a unit only
    /// when a persist covers it, or when it is evicted at random; the death of the process is
    /// a power loss, and the next open starts from the media. A regular file in a durable
    /// domain only (refused: [`Error::SimulationUnsupported`]).
    pub fn power_loss_simulation(mut self, simulation: Option<Simulation>) -> OpenOptions {
        self.simulation = simulation;
        self
    }

    /// The refusal of a power-loss simulation on this store, if any: devdax (no pwrite), a
    /// volatile domain (nothing is durable there to simulate).
    pub(super) fn check_simulation(&self, devdax: bool, domain: Domain) -> Result<()> {
        let reason = match self.simulation {
            None => return Ok(()),
            Some(_) if devdax => "a devdax device cannot be its media (a regular file can)",
            Some(_) if !domain.is_durable() => {
                "the domain is volatile: nothing survives a power loss there to simulate                  (force_dax treats a RAM file as dax)"
            }
            Some(_) => return Ok(()),
        };
        Err(Error::SimulationUnsupported {
            path: self.path.clone(),
            reason,
        })
    }

    /// Validates the options, opens (creating and allocating the whole size up front, so that a
    /// full filesystem fails here and never as SIGBUS later), maps the store shared (trying
    /// MAP_SHARED_VALIDATE | MAP_SYNC first) and probes the persistence domain.
    ///
    /// An existing empty file is treated like a new one: it is grown to the size without a
    /// [`Resize`] choice, since there is nothing in it to lose.
    ///
    /// Errors: [`Error::BadBlockSize`], [`Error::ZeroSize`], [`Error::SizeNotMultiple`],
    /// [`Error::SizeTooLarge`], [`Error::SizeRequired`], [`Error::NotFound`],
    /// [`Error::IsDirectory`], [`Error::UnsupportedFileType`], [`Error::PermissionDenied`],
    /// [`Error::WouldGrow`], [`Error::WouldShrink`], [`Error::NoSpace`], [`Error::NotDevDax`],
    /// [`Error::DevDaxTooSmall`], [`Error::DevDaxAlignment`], [`Error::Map`], [`Error::Io`],
    /// [`Error::SimulationUnsupported`].
    pub fn open(&self) -> Result<Mapping> {
        match self.locate()? {
            Store::File(_) => self.open_file(false),
            Store::CharDevice(meta) => self.open_devdax(&meta),
            Store::Create { .. } => self.open_file(true),
        }
    }

    /// The first step of [`open`](Self::open) and [`plan`](Self::plan): checks the options
    /// (block size, size) and says what the path names, refusing a directory, a special file,
    /// or a missing path that may not be created or has no size to be created with.
    pub(super) fn locate(&self) -> Result<Store> {
        if self.block_size != 512 && self.block_size != 4096 {
            return Err(Error::BadBlockSize {
                block_size: self.block_size,
            });
        }
        if let Some(size) = self.size {
            self.check_size(size)?;
        }
        match fs::metadata(&self.path) {
            Ok(meta) => {
                let ft = meta.file_type();
                if ft.is_dir() {
                    Err(Error::IsDirectory {
                        path: self.path.clone(),
                    })
                } else if ft.is_char_device() {
                    Ok(Store::CharDevice(meta))
                } else if ft.is_file() {
                    Ok(Store::File(meta))
                } else {
                    Err(Error::UnsupportedFileType {
                        path: self.path.clone(),
                        kind: unsupported_kind(ft),
                    })
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound && self.create => match self.size {
                Some(size) => Ok(Store::Create { size }),
                None => Err(Error::SizeRequired {
                    path: self.path.clone(),
                }),
            },
            Err(e) => Err(self.open_error("stat", e)),
        }
    }

    /// The size an existing file of `existing` bytes ends up with, by the [`Resize`] rules: the
    /// size asked for (or the existing one when none was); an empty file grows without a
    /// [`Resize`] choice, since there is nothing in it to lose.
    ///
    /// # Errors
    /// [`Error::WouldGrow`], [`Error::WouldShrink`], and those of a bad existing size when no
    /// size was asked for.
    pub(super) fn settle_size(&self, existing: u64) -> Result<u64> {
        let size = match self.size {
            None => {
                self.check_size(existing)?;
                return Ok(existing);
            }
            Some(size) => size,
        };
        if existing == 0 || size == existing {
            return Ok(size);
        }
        match self.resize {
            Resize::Refuse | Resize::Grow if size < existing => Err(Error::WouldShrink {
                path: self.path.clone(),
                existing,
                requested: size,
            }),
            Resize::Refuse => Err(Error::WouldGrow {
                path: self.path.clone(),
                existing,
                requested: size,
            }),
            _ => Ok(size),
        }
    }

    pub(super) fn check_size(&self, size: u64) -> Result<()> {
        if size == 0 {
            return Err(Error::ZeroSize {
                path: self.path.clone(),
            });
        }
        if !size.is_multiple_of(self.block_size) {
            return Err(Error::SizeNotMultiple {
                path: self.path.clone(),
                size,
                block_size: self.block_size,
            });
        }
        if usize::try_from(size).is_err() || size > isize::MAX as u64 {
            return Err(Error::SizeTooLarge {
                path: self.path.clone(),
                size,
            });
        }
        Ok(())
    }

    pub(super) fn open_error(&self, op: &'static str, source: io::Error) -> Error {
        let path = self.path.clone();
        match source.raw_os_error() {
            Some(libc::ENOENT) => Error::NotFound { path, source },
            Some(libc::EACCES) | Some(libc::EPERM) => Error::PermissionDenied { path, source },
            Some(libc::EISDIR) => Error::IsDirectory { path },
            _ => Error::Io { path, op, source },
        }
    }

    fn open_file(&self, create: bool) -> Result<Mapping> {
        let mut opts = fs::OpenOptions::new();
        opts.read(true).write(true);
        if create {
            opts.create_new(true).mode(0o600);
        }
        let (file, created) = match opts.open(&self.path) {
            Ok(f) => (f, create),
            // Someone created it between our stat and open: open what is there.
            Err(e) if create && e.kind() == io::ErrorKind::AlreadyExists => {
                return self.open_file(false);
            }
            Err(e) => return Err(self.open_error("open", e)),
        };
        let result = self.size_and_map_file(&file, created);
        if result.is_err() && created {
            // Leave nothing behind for a namespace that could not be opened.
            let _ = fs::remove_file(&self.path);
        }
        let (len, probed, map_sync, ptr) = result?;
        let mapping = self.finish(file, len, probed, map_sync, ptr);
        if mapping.is_err() && created {
            let _ = fs::remove_file(&self.path);
        }
        if let (true, Ok(m)) = (self.short_ok, &mapping) {
            // Opened short: failed at the file's end now, before any access meets it.
            m.check_size();
        }
        if created && mapping.is_ok() {
            // The new name is durable only once its directory is synced (fsync(2)): most
            // journalling filesystems commit it with the file's first sync, but not all
            // (ext2). Best effort, as for the state file: a directory that cannot be opened
            // or synced leaves what the filesystem does by itself.
            let dir = match self.path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        mapping
    }

    /// Settles the file's size, allocates it, maps it and probes the domain.
    fn size_and_map_file(
        &self,
        file: &File,
        created: bool,
    ) -> Result<(usize, Domain, bool, NonNull<u8>)> {
        let io_err = |op, source| Error::Io {
            path: self.path.clone(),
            op,
            source,
        };
        let existing = file.metadata().map_err(|e| io_err("stat", e))?.len();
        // Opened short (`short_ok`): mapped at its size, nothing grown or allocated past the
        // file's end.
        let short = self.short_ok
            && self.simulation.is_none()
            && self.resize == Resize::Refuse
            && existing > 0
            && self.size.is_some_and(|s| s > existing);
        let size = match self.size {
            Some(size) if short => size,
            _ => self.settle_size(existing)?,
        };
        if let Some(sim) = self.simulation {
            // Before anything is resized: a live simulation of this file keeps its own size.
            Sim::check_live(file, size as usize, sim).map_err(|e| self.sim_error(e))?;
        }
        if size < existing {
            file.set_len(size).map_err(|e| io_err("shrink", e))?;
        }
        // Allocate every block now, holes included, so that no store into the mapping ever needs
        // the filesystem to find space (which would be SIGBUS on a full filesystem); of a file
        // opened short, only what it holds.
        let allocate = if short { existing } else { size };
        // SAFETY: posix_fallocate only reads the descriptor and the integer arguments.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, allocate as libc::off_t) };
        if rc != 0 {
            let source = io::Error::from_raw_os_error(rc);
            if size > existing && !created {
                // Undo a partial grow; the original bytes are untouched.
                let _ = file.set_len(existing);
            }
            return Err(match rc {
                libc::ENOSPC | libc::EDQUOT | libc::EFBIG => Error::NoSpace {
                    path: self.path.clone(),
                    size,
                    source,
                },
                _ => io_err("allocate (posix_fallocate)", source),
            });
        }
        let len = size as usize; // fits: check_size
        let (ptr, map_sync) = self.map_shared(file, len)?;
        let probed = if map_sync {
            Domain::Dax
        } else if is_ram_fs(file, &self.path).map_err(|e| io_err("statfs", e))? {
            Domain::Volatile
        } else {
            Domain::PageCache
        };
        Ok((len, probed, map_sync, ptr))
    }

    fn open_devdax(&self, meta: &fs::Metadata) -> Result<Mapping> {
        use std::os::unix::fs::MetadataExt;
        let info = devdax::probe(&self.path, meta.rdev())?;
        let size = devdax::mapping_len(&self.path, info, self.size)?;
        self.check_size(size)?;
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
            .map_err(|e| self.open_error("open", e))?;
        self.check_simulation(true, Domain::Dax)?;
        let len = size as usize; // fits: check_size
        let (ptr, map_sync) = self.map_shared(&file, len)?;
        self.finish(file, len, Domain::Dax, map_sync, ptr)
    }

    /// Maps the whole file shared, with MAP_SYNC when the kernel and filesystem accept it.
    fn map_shared(&self, file: &File, len: usize) -> Result<(NonNull<u8>, bool)> {
        let map = |flags| {
            // SAFETY: a new shared mapping of our own descriptor at an address the kernel picks
            // aliases no Rust-owned memory; the file is at least `len` bytes (allocated above).
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    flags,
                    file.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                Err(io::Error::last_os_error())
            } else {
                Ok(p)
            }
        };
        let map_err = |source| Error::Map {
            path: Some(self.path.clone()),
            len,
            source,
        };
        let (p, map_sync) = match map(libc::MAP_SHARED_VALIDATE | libc::MAP_SYNC) {
            Ok(p) => (p, true),
            // EOPNOTSUPP: no DAX here; EINVAL: a kernel that predates MAP_SHARED_VALIDATE.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)) => {
                (map(libc::MAP_SHARED).map_err(map_err)?, false)
            }
            Err(e) => return Err(map_err(e)),
        };
        let ptr = NonNull::new(p.cast()).ok_or_else(|| map_err(io::Error::other("mmap gave 0")))?;
        Ok((ptr, map_sync))
    }

    /// The mapping of the opened file: it owns `ptr` from here on, also when the power-loss
    /// simulation is refused (dropping it unmaps).
    fn finish(
        &self,
        file: File,
        len: usize,
        probed: Domain,
        map_sync: bool,
        ptr: NonNull<u8>,
    ) -> Result<Mapping> {
        let domain = self.reported(probed);
        // From here the mapping is owned (and unmapped on every error path) by `media`.
        let media = Media::of_file(file, self.path.clone(), ptr, len, domain, probed, map_sync);
        let Some(opts) = self.simulation else {
            return Ok(Mapping::real(media));
        };
        self.check_simulation(false, domain)?;
        // A cache line where a write-back instruction makes it durable, a page where msync does.
        let unit = if domain.is_dax() && cfg!(target_arch = "x86_64") {
            super::flush::cache_line_size()
        } else {
            nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
                .ok()
                .flatten()
                .map_or(4096, |p| p as usize)
        };
        let file = media.file().expect("a file's media has its file");
        match Sim::open(file, len, unit, opts) {
            Ok(s) => Ok(Mapping::simulated(Simulated::new(media, s))),
            Err(e) => Err(self.sim_error(e)),
        }
    }

    fn sim_error(&self, e: sim::OpenError) -> Error {
        match e {
            sim::OpenError::Io(source) => Error::Io {
                path: self.path.clone(),
                op: "read the media of the power-loss simulation",
                source,
            },
            sim::OpenError::Mismatch(reason) => Error::SimulationUnsupported {
                path: self.path.clone(),
                reason,
            },
        }
    }
}

// The error names no option of opening (it is below this file); opening says which of its
// options a refused resize calls for.
impl Error {
    /// The [`Resize`] choice that would let the open go through, for a refused resize
    /// ([`Error::WouldGrow`]: `Grow`; [`Error::WouldShrink`]: `GrowOrShrink`), so that a
    /// front-end can name its own option for it (a CLI flag, a config key).
    pub fn resize_needed(&self) -> Option<Resize> {
        match self {
            Error::WouldGrow { .. } => Some(Resize::Grow),
            Error::WouldShrink { .. } => Some(Resize::GrowOrShrink),
            _ => None,
        }
    }
}

/// What to call a file that is neither a regular file, a directory nor a character device.
pub(super) fn unsupported_kind(ft: fs::FileType) -> &'static str {
    if ft.is_block_device() {
        "block device"
    } else if ft.is_fifo() {
        "FIFO"
    } else if ft.is_socket() {
        "socket"
    } else {
        "special file"
    }
}

/// Whether a statfs magic number is a RAM filesystem's (tmpfs, ramfs, hugetlbfs).
fn is_ram_magic(magic: u32) -> bool {
    matches!(magic, TMPFS_MAGIC | RAMFS_MAGIC | HUGETLBFS_MAGIC)
}

/// Whether what is stored at `path`, on a filesystem of statfs type `magic`, is held in RAM
/// only: a RAM filesystem (tmpfs, ramfs, hugetlbfs), or an overlay whose upper layer (where
/// its writes go) is one. An overlay's syncs are its upper layer's: over tmpfs they return 0
/// and keep nothing (a live system's root, a container's layer in memory), so the store was
/// probed `page-cache` and every acknowledgement said durable. An overlay mounted `volatile`
/// (its syncs skipped), or whose upper layer this process cannot find or reach (another mount
/// namespace's path, an overlay whose upper directory lies under itself), counts as RAM too:
/// `volatile` claims nothing it could not keep.
pub(super) fn ram_backed(path: &Path, magic: u32) -> bool {
    ram_backed_within(path, magic, 8)
}

/// [`ram_backed`], following at most `depth` overlays down (an overlay whose upper directory
/// resolves into itself would never end).
fn ram_backed_within(path: &Path, magic: u32, depth: u32) -> bool {
    if is_ram_magic(magic) {
        return true;
    }
    if magic != OVERLAYFS_MAGIC {
        return false;
    }
    if depth == 0 {
        return true;
    }
    let upper = std::fs::canonicalize(path).ok().and_then(|p| {
        let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        overlay_upper(&text, &p)
    });
    match upper {
        Some(upper) if upper.is_absolute() => match nix::sys::statfs::statfs(&upper) {
            Ok(st) => ram_backed_within(&upper, st.filesystem_type().0 as u32, depth - 1),
            Err(_) => true,
        },
        _ => true,
    }
}

/// The upper directory of the overlay mounted where `path` (canonical) lies, from the text
/// of /proc/self/mountinfo: the mount whose mount point is the longest prefix of `path`, if
/// it is an overlay with an `upperdir` and not mounted `volatile` (None for another
/// filesystem, a read-only overlay, or a volatile one: its syncs are skipped).
fn overlay_upper(mountinfo: &str, path: &Path) -> Option<PathBuf> {
    let (fstype, options) = crate::mountinfo::mount_over(mountinfo, path)?;
    if fstype != "overlay"
        || options
            .split(',')
            .any(|o| o == "volatile" || o == "fsync=volatile")
    {
        return None;
    }
    options
        .split(',')
        .find_map(|o| o.strip_prefix("upperdir="))
        .map(|u| PathBuf::from(crate::mountinfo::unescape(u)))
}

impl OpenOptions {
    /// The domain every interface reports for a store probed as `probed`: `dax (forced)` when
    /// asked to force it.
    pub(super) fn reported(&self, probed: Domain) -> Domain {
        if self.force_dax {
            Domain::DaxForced
        } else {
            probed
        }
    }
}

/// Whether the file (at `path`) is held in RAM only ([`ram_backed`]).
fn is_ram_fs(file: &File, path: &Path) -> io::Result<bool> {
    let st = nix::sys::statfs::fstatfs(file)?;
    Ok(ram_backed(path, st.filesystem_type().0 as u32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pmem::Persist;

    #[test]
    fn an_overlays_upper_directory_is_found_from_the_mount_over_the_path() {
        let text = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
            30 22 0:40 / /run rw shared:5 - tmpfs tmpfs rw,size=100k\n\
            40 22 0:50 / /srv/live\\040root rw - overlay overlay \
            rw,lowerdir=/ro,upperdir=/run/up\\040per,workdir=/run/work\n\
            41 40 8:1 /data /srv/live\\040root/data rw - ext4 /dev/sda1 rw\n\
            50 22 0:60 / /srv/ro rw - overlay overlay ro,lowerdir=/a:/b\n";
        let up = |p: &str| overlay_upper(text, Path::new(p));
        assert_eq!(up("/srv/live root/ns1"), Some(PathBuf::from("/run/up per")));
        // A mount over the overlay, another filesystem, a read-only overlay.
        assert_eq!(up("/srv/live root/data/ns1"), None);
        assert_eq!(up("/srv/other/ns1"), None);
        assert_eq!(up("/run/ns1"), None);
        assert_eq!(up("/srv/ro/ns1"), None);
        let volatile = "40 22 0:50 / /srv/v rw - overlay overlay rw,lowerdir=/l,upperdir=/u,\
            workdir=/w,volatile\n\
            41 22 0:51 / /srv/f rw - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w,\
            fsync=volatile\n";
        assert_eq!(overlay_upper(volatile, Path::new("/srv/v/ns1")), None);
        assert_eq!(overlay_upper(volatile, Path::new("/srv/f/ns1")), None);
        // Path components, not string prefixes.
        assert_eq!(up("/srv/live rootless/ns1"), None);
    }

    /// A file shorter than its size opens only with `short_ok`: as it is (not grown, nothing
    /// allocated past its end), mapped at its size, failed at its end; without it, and under
    /// the simulation, the refusal as before.
    #[test]
    fn a_short_file_opens_failed_only_when_asked() {
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = d.path().join("ns");
        std::fs::write(&path, vec![7u8; 8192]).unwrap();
        let opts = || OpenOptions::new(&path).size(1 << 20).create(true);
        assert!(matches!(opts().open(), Err(Error::WouldGrow { .. })));
        let sim = Some(Simulation::default());
        assert!(matches!(
            opts().short_ok(true).power_loss_simulation(sim).open(),
            Err(Error::WouldGrow { .. })
        ));
        let m = opts().short_ok(true).open().unwrap();
        assert_eq!(m.len(), 1 << 20);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 8192, "not grown");
        assert_eq!(m.unreadable_at(), Some(8192));
        assert!(m.failure().is_some());
        let mut b = [0u8; 8];
        assert!(matches!(
            m.read_at(0, &mut b),
            Err(Error::Unreadable { .. })
        ));
        drop(m);
        // A file of its size opens healthy with it too.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let m = opts().short_ok(true).open().unwrap();
        assert_eq!(m.unreadable_at(), None);
        assert!(m.failure().is_none());
        m.read_at(0, &mut b).unwrap();
        assert_eq!(b, [7; 8]);
    }

    #[test]
    fn ram_filesystems_are_recognised() {
        let shm = tempfile::tempfile_in("/dev/shm").unwrap();
        assert!(is_ram_fs(&shm, Path::new("/dev/shm")).unwrap());
        let disk = tempfile::tempfile_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let disk_is_ram = is_ram_fs(&disk, Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap();
        let df = nix::sys::statfs::fstatfs(&disk).unwrap();
        assert_eq!(
            disk_is_ram,
            df.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC
        );
    }
}
