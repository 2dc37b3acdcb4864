//! Device DAX (`/dev/daxX.Y`): a character device that maps persistent memory directly, with no
//! filesystem in between. Its size and alignment come from sysfs, since `stat` says 0.

use std::fs;
use std::path::{Path, PathBuf};

use super::error::{Error, Result};

/// What sysfs says about a devdax device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DevDaxInfo {
    /// Capacity in bytes.
    pub size: u64,
    /// Mapping alignment (offsets and lengths must be multiples of it), when sysfs tells.
    pub align: Option<u64>,
}

/// Reads the devdax facts of the character device `path` with device number `rdev`.
///
/// Errors: [`Error::NotDevDax`] when the device is not in the `dax` subsystem (e.g. /dev/null),
/// [`Error::Io`] when its sysfs `size` cannot be read.
pub(crate) fn probe(path: &Path, rdev: u64) -> Result<DevDaxInfo> {
    probe_in(Path::new("/sys"), path, rdev)
}

/// How many bytes of the device to map: all of it, or the `requested` prefix, which must fit and
/// be a multiple of the device's alignment (the kernel refuses other lengths).
///
/// Errors: [`Error::DevDaxTooSmall`], [`Error::DevDaxAlignment`].
pub(crate) fn mapping_len(path: &Path, info: DevDaxInfo, requested: Option<u64>) -> Result<u64> {
    let Some(requested) = requested else {
        return Ok(info.size);
    };
    if requested > info.size {
        return Err(Error::DevDaxTooSmall {
            path: path.to_owned(),
            available: info.size,
            requested,
        });
    }
    match info.align {
        Some(align) if align > 0 && requested % align != 0 => Err(Error::DevDaxAlignment {
            path: path.to_owned(),
            size: requested,
            align,
        }),
        _ => Ok(requested),
    }
}

fn probe_in(sysfs: &Path, path: &Path, rdev: u64) -> Result<DevDaxInfo> {
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    let dir: PathBuf = sysfs.join(format!("dev/char/{major}:{minor}"));
    let not_dax = |reason: String| Error::NotDevDax {
        path: path.to_owned(),
        reason,
    };
    let subsystem = fs::read_link(dir.join("subsystem")).map_err(|e| {
        not_dax(format!(
            "no sysfs subsystem for char device {major}:{minor} ({e})"
        ))
    })?;
    let subsystem = subsystem
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    if subsystem != "dax" {
        return Err(not_dax(format!(
            "char device {major}:{minor} belongs to the `{subsystem}` subsystem, not `dax`"
        )));
    }
    let size_path = dir.join("size");
    let size = read_u64(&size_path).map_err(|source| Error::Io {
        path: size_path.clone(),
        op: "read the devdax size from",
        source,
    })?;
    // Newer kernels put `align` on the dax device, older ones on its region (`device/align`).
    let align = read_u64(&dir.join("align"))
        .or_else(|_| read_u64(&dir.join("device/align")))
        .ok();
    Ok(DevDaxInfo { size, align })
}

fn read_u64(p: &Path) -> std::io::Result<u64> {
    let s = fs::read_to_string(p)?;
    let s = s.trim();
    let parsed = match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("`{s}` is not a number: {e}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn fake_sysfs(subsystem: &str, size: Option<&str>, align: Option<&str>) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let dev = root.path().join("dev/char/252:3");
        fs::create_dir_all(&dev).unwrap();
        let class = root.path().join("class").join(subsystem);
        fs::create_dir_all(&class).unwrap();
        symlink(&class, dev.join("subsystem")).unwrap();
        if let Some(size) = size {
            fs::write(dev.join("size"), size).unwrap();
        }
        if let Some(align) = align {
            fs::write(dev.join("align"), align).unwrap();
        }
        root
    }

    fn rdev(major: u32, minor: u32) -> u64 {
        libc::makedev(major, minor)
    }

    #[test]
    fn reads_size_and_align_of_a_dax_device() {
        let sys = fake_sysfs("dax", Some("1073741824\n"), Some("2097152\n"));
        let info = probe_in(sys.path(), Path::new("/dev/dax0.0"), rdev(252, 3)).unwrap();
        assert_eq!(
            info,
            DevDaxInfo {
                size: 1 << 30,
                align: Some(2 << 20)
            }
        );
    }

    #[test]
    fn align_is_optional() {
        let sys = fake_sysfs("dax", Some("4194304"), None);
        let info = probe_in(sys.path(), Path::new("/dev/dax0.0"), rdev(252, 3)).unwrap();
        assert_eq!(info.size, 4 << 20);
        assert_eq!(info.align, None);
    }

    #[test]
    fn other_subsystem_is_not_devdax() {
        let sys = fake_sysfs("mem", Some("0"), None);
        let err = probe_in(sys.path(), Path::new("/dev/null"), rdev(252, 3)).unwrap_err();
        assert!(matches!(err, Error::NotDevDax { .. }), "{err:?}");
        assert!(err.to_string().contains("`mem`"), "{err}");
    }

    #[test]
    fn missing_sysfs_entry_is_not_devdax() {
        let sys = fake_sysfs("dax", Some("0"), None);
        let err = probe_in(sys.path(), Path::new("/dev/x"), rdev(1, 99)).unwrap_err();
        assert!(matches!(err, Error::NotDevDax { .. }), "{err:?}");
    }

    #[test]
    fn unreadable_size_is_an_io_error() {
        let sys = fake_sysfs("dax", Some("lots"), None);
        let err = probe_in(sys.path(), Path::new("/dev/dax0.0"), rdev(252, 3)).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err:?}");
        let sys = fake_sysfs("dax", None, None);
        let err = probe_in(sys.path(), Path::new("/dev/dax0.0"), rdev(252, 3)).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err:?}");
    }

    #[test]
    fn mapping_len_is_the_device_or_an_aligned_prefix() {
        let info = DevDaxInfo {
            size: 8 << 20,
            align: Some(2 << 20),
        };
        let p = Path::new("/dev/dax0.0");
        assert_eq!(mapping_len(p, info, None).unwrap(), 8 << 20);
        assert_eq!(mapping_len(p, info, Some(4 << 20)).unwrap(), 4 << 20);
        assert_eq!(mapping_len(p, info, Some(8 << 20)).unwrap(), 8 << 20);
        let err = mapping_len(p, info, Some(16 << 20)).unwrap_err();
        assert!(
            matches!(err, Error::DevDaxTooSmall { available, .. } if available == 8 << 20),
            "{err:?}"
        );
        let err = mapping_len(p, info, Some(4096)).unwrap_err();
        assert!(
            matches!(err, Error::DevDaxAlignment { align, .. } if align == 2 << 20),
            "{err:?}"
        );
        let unknown = DevDaxInfo {
            align: None,
            ..info
        };
        assert_eq!(mapping_len(p, unknown, Some(4096)).unwrap(), 4096);
    }

    #[test]
    fn real_dev_null_is_refused() {
        let err = probe(Path::new("/dev/null"), rdev(1, 3)).unwrap_err();
        assert!(matches!(err, Error::NotDevDax { .. }), "{err:?}");
    }
}
