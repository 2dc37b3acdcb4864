//! The filesystem the kernel sees: a root directory holding one regular file, the namespace.
//! Its size is the namespace's and never changes (a truncate or a resize is EPERM, a write at
//! or past the end ENOSPC, one across the end is short, as on a block device). Every open gets
//! FOPEN_DIRECT_IO: no page cache between the caller and the remote, so an acknowledged write
//! has reached the I/O thread, and a loop device can do direct I/O on the file.
//!
//! Data requests are forwarded with their reply objects to the I/O thread ([`super::io`]);
//! the rest is answered here from memory (mode, owner and times live only as long as the mount).

use std::ffi::OsStr;
use std::sync::mpsc::Sender;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use fuser::{
    AccessFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use super::io::Job;

/// The file's inode number (the root is 1).
const FILE_INO: INodeNo = INodeNo(2);
/// How long the kernel may cache attributes and names (the size never changes).
const TTL: Duration = Duration::from_secs(1);
/// The largest request the kernel may send (its own cap is 1 MiB by default).
const MAX_WRITE: u32 = 1 << 20;

/// What the filesystem shows.
#[derive(Debug, Clone)]
pub(crate) struct Shape {
    /// The file's name in the root directory.
    pub(crate) name: String,
    /// The namespace's size in bytes.
    pub(crate) size: u64,
    /// The namespace's block size.
    pub(crate) block_size: u32,
    /// A read-only namespace (mounted read-only, mode 0400).
    pub(crate) read_only: bool,
}

/// The attributes an operator may change while mounted.
#[derive(Debug, Clone, Copy)]
struct Meta {
    mode: u16,
    uid: u32,
    gid: u32,
    atime: SystemTime,
    mtime: SystemTime,
    ctime: SystemTime,
}

/// The FUSE filesystem: answers metadata, forwards data to the I/O thread.
#[derive(Debug)]
pub(crate) struct RpmaFs {
    shape: Shape,
    meta: Mutex<Meta>,
    /// None once the session ended ([`Filesystem::destroy`]): the I/O thread then finishes.
    io: Mutex<Option<Sender<Job>>>,
}

impl RpmaFs {
    pub(crate) fn new(shape: Shape, io: Sender<Job>) -> RpmaFs {
        let now = SystemTime::now();
        RpmaFs {
            meta: Mutex::new(Meta {
                mode: if shape.read_only { 0o400 } else { 0o600 },
                uid: 0,
                gid: 0,
                atime: now,
                mtime: now,
                ctime: now,
            }),
            shape,
            io: Mutex::new(Some(io)),
        }
    }

    fn meta(&self) -> std::sync::MutexGuard<'_, Meta> {
        self.meta.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn attr(&self, ino: INodeNo) -> Option<FileAttr> {
        let m = *self.meta();
        let (kind, perm, size, nlink) = match ino {
            INodeNo::ROOT => (
                FileType::Directory,
                if self.shape.read_only { 0o555 } else { 0o755 },
                0,
                2,
            ),
            FILE_INO => (FileType::RegularFile, m.mode, self.shape.size, 1),
            _ => return None,
        };
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: m.atime,
            mtime: m.mtime,
            ctime: m.ctime,
            crtime: m.ctime,
            kind,
            perm,
            nlink,
            uid: m.uid,
            gid: m.gid,
            rdev: 0,
            blksize: self.shape.block_size.max(512),
            flags: 0,
        })
    }

    /// Hands `job` to the I/O thread; if it is gone, `fail` answers EIO.
    fn send(&self, job: Job) {
        let io = self.io.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = io.as_ref() {
            if let Err(std::sync::mpsc::SendError(job)) = tx.send(job) {
                fail(job);
            }
        } else {
            fail(job);
        }
    }
}

/// Answers a job the I/O thread cannot take.
fn fail(job: Job) {
    match job {
        Job::Read { reply, .. } => reply.error(Errno::EIO),
        Job::Write { reply, .. } => reply.error(Errno::EIO),
        Job::Zero { reply, .. } | Job::Fsync { reply } | Job::Flush { reply } => {
            reply.error(Errno::EIO)
        }
    }
}

/// The part of `[offset, offset + len)` inside a file of `size` bytes: its length.
pub(crate) fn clamp(offset: u64, len: u64, size: u64) -> u64 {
    len.min(size.saturating_sub(offset))
}

fn time(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

impl Filesystem for RpmaFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // The kernel caps this at its own max_pages; a refusal keeps fuser's default.
        let _ = config.set_max_write(MAX_WRITE);
        Ok(())
    }

    fn destroy(&mut self) {
        self.io.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent != INodeNo::ROOT || name != OsStr::new(&self.shape.name) {
            return reply.error(Errno::ENOENT);
        }
        match self.attr(FILE_INO) {
            Some(a) => reply.entry(&TTL, &a, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        if ino != FILE_INO {
            return reply.error(Errno::EPERM);
        }
        // The namespace's size is fixed: no truncate (O_TRUNC included), no growth.
        if size.is_some_and(|s| s != self.shape.size) {
            return reply.error(Errno::EPERM);
        }
        {
            let mut m = self.meta();
            if let Some(mode) = mode {
                m.mode = (mode & 0o7777) as u16;
            }
            if let Some(u) = uid {
                m.uid = u;
            }
            if let Some(g) = gid {
                m.gid = g;
            }
            if let Some(t) = atime {
                m.atime = time(t);
            }
            if let Some(t) = mtime {
                m.mtime = time(t);
            }
            m.ctime = SystemTime::now();
        }
        match self.attr(ino) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino != FILE_INO {
            return reply.error(Errno::EISDIR);
        }
        let acc = flags.0 & libc::O_ACCMODE;
        if self.shape.read_only && acc != libc::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO);
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let n = clamp(offset, u64::from(size), self.shape.size);
        if n == 0 {
            return reply.data(&[]);
        }
        self.send(Job::Read {
            offset,
            size: n as usize,
            reply,
        });
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if self.shape.read_only {
            return reply.error(Errno::EROFS);
        }
        let n = clamp(offset, data.len() as u64, self.shape.size);
        if n == 0 {
            // At or past the end of a file that cannot grow (a block device says the same).
            return reply.error(Errno::from_i32(libc::ENOSPC));
        }
        {
            let mut m = self.meta();
            m.mtime = SystemTime::now();
            m.ctime = m.mtime;
        }
        // O_DSYNC or O_SYNC (the open's, or a pwritev2 RWF_DSYNC's): the file's direct I/O
        // passes the flag to us with each write, and the write must be durable when it
        // returns (the kernel syncs nothing after a direct write).
        let sync = flags.0 & libc::O_DSYNC != 0;
        self.send(Job::Write {
            offset,
            data: data[..n as usize].to_vec(),
            sync,
            reply,
        });
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        self.send(Job::Flush { reply });
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.send(Job::Fsync { reply });
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if self.shape.read_only {
            return reply.error(Errno::EROFS);
        }
        let inside = offset
            .checked_add(length)
            .is_some_and(|end| end <= self.shape.size);
        let keep = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        match mode & !libc::FALLOC_FL_KEEP_SIZE {
            // Every byte is already there; growing is not possible.
            0 if inside => reply.ok(),
            0 if keep => reply.ok(),
            0 => reply.error(Errno::from_i32(libc::ENOSPC)),
            libc::FALLOC_FL_ZERO_RANGE if inside || keep => {
                let len = clamp(offset, length, self.shape.size);
                if len == 0 {
                    return reply.ok();
                }
                self.send(Job::Zero { offset, len, reply })
            }
            libc::FALLOC_FL_ZERO_RANGE => reply.error(Errno::from_i32(libc::ENOSPC)),
            // Punching holes (discard) would have to write zeros over the network.
            _ => reply.error(Errno::from_i32(libc::EOPNOTSUPP)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (INodeNo::ROOT, FileType::Directory, "."),
            (INodeNo::ROOT, FileType::Directory, ".."),
            (FILE_INO, FileType::RegularFile, self.shape.name.as_str()),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(*ino, i as u64 + 1, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let bs = u64::from(self.shape.block_size.max(512));
        reply.statfs(self.shape.size / bs, 0, 0, 2, 0, bs as u32, 255, bs as u32);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        // default_permissions: the kernel checked the mode bits already.
        reply.ok();
    }

    // Quiet refusals of what one file cannot do (fuser's defaults log each one).

    fn getxattr(&self, _req: &Request, _ino: INodeNo, _n: &OsStr, _s: u32, reply: ReplyXattr) {
        reply.error(Errno::ENOSYS);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: ReplyXattr) {
        reply.error(Errno::ENOSYS);
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EPERM);
    }

    fn mkdir(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EPERM);
    }

    fn unlink(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EPERM);
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: fuser::ReplyCreate,
    ) {
        reply.error(Errno::EPERM);
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EPERM);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_clamped_to_the_file() {
        assert_eq!(clamp(0, 4096, 8192), 4096);
        assert_eq!(clamp(6144, 4096, 8192), 2048);
        assert_eq!(clamp(8192, 4096, 8192), 0);
        assert_eq!(clamp(u64::MAX, 1, 8192), 0);
    }

    #[test]
    fn one_file_with_a_fixed_size_and_read_only_modes() {
        let (tx, _rx) = std::sync::mpsc::channel();
        let fs = RpmaFs::new(
            Shape {
                name: "ns1".into(),
                size: 1 << 20,
                block_size: 4096,
                read_only: true,
            },
            tx,
        );
        let f = fs.attr(FILE_INO).unwrap();
        assert_eq!(
            (f.size, f.perm, f.kind),
            (1 << 20, 0o400, FileType::RegularFile)
        );
        assert_eq!(f.blocks, 2048);
        let d = fs.attr(INodeNo::ROOT).unwrap();
        assert_eq!((d.kind, d.perm), (FileType::Directory, 0o555));
        assert!(fs.attr(INodeNo(3)).is_none());
    }
}
