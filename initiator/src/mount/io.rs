//! The I/O thread: the one owner of the library [`Queue`] (a queue is one-per-thread and
//! synchronous). The FUSE session thread hands it jobs with their reply objects and goes back
//! to reading /dev/fuse; jobs run in arrival order, so a write acknowledged to the kernel comes
//! before any later fsync. When idle the thread runs the queue's keep-alives. When the session
//! ends (its sender dropped) the thread persists what is still dirty and disconnects.
//!
//! Durability: every write acknowledged to the kernel was handed to the transport
//! (`write_at`) and marks the file dirty; fsync and a flush on close make every such write
//! durable with `persist_own_writes` (the writes this queue still holds: one APM Read on dax, a
//! Flush per written range, or GPSPM; never the span between scattered writes) before they are
//! answered. On a volatile namespace nothing can be durable: fsync answers EIO unless
//! `--visible-ok`.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use fuser::{Errno, ReplyData, ReplyEmpty, ReplyWrite};
use rpma_initiator::{Durability, Error, Queue};

/// How often an idle thread runs the keep-alives (well under half the 5 s keep-alive).
const IDLE_TICK: Duration = Duration::from_millis(500);

/// Work for the I/O thread. The fs layer checked every range against the namespace.
#[derive(Debug)]
pub(crate) enum Job {
    /// Read `size` bytes at `offset`.
    Read {
        offset: u64,
        size: usize,
        reply: ReplyData,
    },
    /// Write `data` at `offset` (sent; dirty until the next persist), or, with `sync` (an
    /// O_DSYNC or O_SYNC write), made durable before the reply.
    Write {
        offset: u64,
        data: Vec<u8>,
        sync: bool,
        reply: ReplyWrite,
    },
    /// Zeroes `len` bytes at `offset` (fallocate ZERO_RANGE).
    Zero {
        offset: u64,
        len: u64,
        reply: ReplyEmpty,
    },
    /// fsync: make every acknowledged write durable.
    Fsync { reply: ReplyEmpty },
    /// flush (a close): the same, but nothing to do, and no error, when nothing is dirty.
    Flush { reply: ReplyEmpty },
}

/// What the I/O thread did by the end.
#[derive(Debug)]
pub(crate) struct Summary {
    /// The final persist of what was still dirty, when something was: its error.
    pub(crate) final_persist: Result<Option<Durability>, Error>,
    /// Writes served.
    pub(crate) writes: u64,
    /// Anything was written ([`Worker::wrote`]).
    pub(crate) written: bool,
}

/// The errno a failed library call maps to.
pub(crate) fn errno_of(e: &Error) -> Errno {
    match e {
        Error::ReadOnly { .. } => Errno::EROFS,
        Error::OutOfRange { .. } => Errno::from_i32(libc::ENOSPC),
        _ => Errno::EIO,
    }
}

struct Worker {
    q: Queue,
    nsid: u32,
    read_only: bool,
    visible_ok: bool,
    /// A write was acknowledged and not yet made durable (the queue holds it until then).
    dirty: bool,
    /// Something was written (a write, a zeroing, an O_DSYNC write answered EIO): on a
    /// volatile namespace, bytes that are visible and not durable.
    written: bool,
    writes: u64,
    /// The last error logged (logged once until an operation succeeds again).
    logged: Option<String>,
}

/// Starts the I/O thread on `q`.
pub(crate) fn spawn(
    q: Queue,
    nsid: u32,
    read_only: bool,
    visible_ok: bool,
) -> std::io::Result<(Sender<Job>, JoinHandle<Summary>)> {
    let (tx, rx) = std::sync::mpsc::channel();
    let w = Worker {
        q,
        nsid,
        read_only,
        visible_ok,
        dirty: false,
        written: false,
        writes: 0,
        logged: None,
    };
    let h = std::thread::Builder::new()
        .name("rpma-io".into())
        .spawn(move || w.run(rx))?;
    Ok((tx, h))
}

impl Worker {
    fn run(mut self, rx: Receiver<Job>) -> Summary {
        loop {
            match rx.recv_timeout(IDLE_TICK) {
                Ok(job) => self.serve(job),
                Err(RecvTimeoutError::Timeout) => {
                    let r = self.q.tick();
                    let _ = self.note("keep-alive", r);
                }
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let final_persist = if self.dirty {
            self.persist().map(Some)
        } else {
            Ok(None)
        };
        if let Err(e) = &final_persist {
            log::error!(
                "the last writes to namespace {} could not be made durable: {e:#}",
                self.nsid
            );
        }
        let _ = self.q.close();
        Summary {
            final_persist,
            writes: self.writes,
            written: self.written,
        }
    }

    /// Logs a failure once (until something succeeds again).
    fn note<T>(&mut self, what: &str, r: Result<T, Error>) -> Result<T, Errno> {
        match r {
            Ok(v) => {
                self.logged = None;
                Ok(v)
            }
            Err(e) => {
                let errno = errno_of(&e);
                let msg = format!(
                    "{what} on namespace {}: {:#}",
                    self.nsid,
                    anyhow::Error::new(e)
                );
                if self.logged.as_deref() != Some(msg.as_str()) {
                    log::error!("{msg}");
                    self.logged = Some(msg);
                }
                Err(errno)
            }
        }
    }

    fn serve(&mut self, job: Job) {
        match job {
            Job::Read {
                offset,
                size,
                reply,
            } => {
                let mut buf = vec![0u8; size];
                let r = self
                    .q
                    .namespace(self.nsid)
                    .and_then(|mut ns| ns.read_at(offset, &mut buf));
                match self.note("read", r) {
                    Ok(()) => reply.data(&buf),
                    Err(e) => reply.error(e),
                }
            }
            Job::Write {
                offset,
                data,
                sync,
                reply,
            } => {
                let r = if sync {
                    self.write_durable(offset, &data)
                } else {
                    let r = self
                        .q
                        .namespace(self.nsid)
                        .and_then(|mut ns| ns.write_at(offset, &data));
                    self.note("write", r).map(|()| self.wrote())
                };
                match r {
                    Ok(()) => {
                        self.writes += 1;
                        reply.written(data.len() as u32);
                    }
                    Err(e) => reply.error(e),
                }
            }
            Job::Zero { offset, len, reply } => match self.zero(offset, len) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(e),
            },
            Job::Fsync { reply } => match self.sync() {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(e),
            },
            Job::Flush { reply } => {
                let r = if self.dirty { self.sync() } else { Ok(()) };
                match r {
                    Ok(()) => reply.ok(),
                    Err(e) => reply.error(e),
                }
            }
        }
    }

    /// Something was written: dirty until the next persist.
    fn wrote(&mut self) {
        self.dirty = true;
        self.written = true;
    }

    fn zero(&mut self, offset: u64, len: u64) -> Result<(), Errno> {
        const PIECE: u64 = 1 << 20;
        let zeros = vec![0u8; PIECE.min(len) as usize];
        let mut at = 0;
        while at < len {
            let n = (len - at).min(PIECE);
            let r = self
                .q
                .namespace(self.nsid)
                .and_then(|mut ns| ns.write_at(offset + at, &zeros[..n as usize]));
            self.note("zeroing", r)?;
            self.wrote();
            at += n;
        }
        Ok(())
    }

    /// Makes the pending writes durable; Durable or, with `--visible-ok`, VisibleOnly is
    /// success.
    fn persist(&mut self) -> Result<Durability, Error> {
        // Through the queue even when nothing is dirty (with nothing held it sends nothing): a
        // queue that gave up answers Broken, EIO, as a dead disk would; the method chosen at
        // the start said durable for ever.
        let d = self
            .q
            .namespace(self.nsid)
            .and_then(|mut ns| ns.persist_own_writes())?;
        // Visible is all a volatile namespace can give: nothing is left to retry.
        self.dirty = false;
        Ok(d)
    }

    /// An O_DSYNC write: durable when this returns, or EIO as an fsync would be (a volatile
    /// namespace without `--visible-ok` included: the bytes are written, visible only).
    fn write_durable(&mut self, offset: u64, data: &[u8]) -> Result<(), Errno> {
        let r = self
            .q
            .namespace(self.nsid)
            .and_then(|mut ns| ns.write_durable(offset, data));
        let d = match self.note("write", r) {
            Ok(d) => d,
            Err(e) => {
                // It may have been sent, and is held until durable: the next fsync tries again.
                self.wrote();
                return Err(e);
            }
        };
        match d {
            Durability::Durable(_) => Ok(()),
            Durability::VisibleOnly if self.visible_ok => Ok(()),
            Durability::VisibleOnly => {
                // Written and visible, like any write: the next fsync answers the same.
                self.wrote();
                Err(Errno::EIO)
            }
        }
    }

    /// fsync: durable, or EIO (a volatile namespace without `--visible-ok` included).
    fn sync(&mut self) -> Result<(), Errno> {
        if self.read_only {
            // Nothing was written through this mount: nothing to make durable.
            return Ok(());
        }
        let r = self.persist();
        match self.note("fsync", r)? {
            Durability::Durable(_) => Ok(()),
            Durability::VisibleOnly if self.visible_ok => Ok(()),
            Durability::VisibleOnly => {
                let msg = format!(
                    "fsync on namespace {}: volatile, the bytes are visible but NOT durable \
                     (EIO; --visible-ok accepts that)",
                    self.nsid
                );
                if self.logged.as_deref() != Some(msg.as_str()) {
                    log::warn!("{msg}");
                    self.logged = Some(msg);
                }
                Err(Errno::EIO)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_errnos() {
        assert_eq!(errno_of(&Error::ReadOnly { nsid: 1 }), Errno::EROFS);
        assert_eq!(
            errno_of(&Error::OutOfRange {
                nsid: 1,
                offset: 0,
                len: 1,
                size: 0
            }),
            Errno::from_i32(libc::ENOSPC)
        );
        assert_eq!(errno_of(&Error::Broken), Errno::EIO);
    }
}
