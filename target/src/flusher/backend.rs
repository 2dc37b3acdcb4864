//! Where a flusher's page-cache syncs run: io_uring (a ranged `IORING_OP_FSYNC` with
//! `IORING_FSYNC_DATASYNC`, run by the kernel's workers) or, where io_uring is unavailable, one
//! worker thread of whole-file `fdatasync` calls. Either signals the flusher's eventfd when a
//! sync completes; [`Backend::reap`] returns the finished ones by the slot they were pushed
//! with.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{mpsc, Arc};

use io_uring::{opcode, types, IoUring};

use super::error::{FlusherError, Result};
use crate::eventfd::EventFd;

/// A sync for the worker thread.
pub(super) struct Job {
    pub(super) slot: usize,
    pub(super) fd: Arc<OwnedFd>,
}

/// The syncs' runner.
pub(super) enum Backend {
    Uring(Box<IoUring>),
    Thread {
        jobs: Option<mpsc::Sender<Job>>,
        done: mpsc::Receiver<(usize, i32)>,
        worker: Option<std::thread::JoinHandle<()>>,
    },
}

impl Backend {
    /// An io_uring of `depth` entries (rounded up to a power of two) that signals `eventfd`.
    ///
    /// # Errors
    /// The kernel's refusal (no io_uring, `kernel.io_uring_disabled`, a seccomp filter).
    pub(super) fn uring(depth: u32, eventfd: &EventFd) -> std::io::Result<Backend> {
        let ring = IoUring::new(depth.next_power_of_two())?;
        ring.submitter()
            .register_eventfd(eventfd.as_fd().as_raw_fd())?;
        Ok(Backend::Uring(Box::new(ring)))
    }

    /// The worker thread, which signals `eventfd` after each sync.
    ///
    /// # Errors
    /// [`FlusherError::Thread`].
    pub(super) fn thread(eventfd: Arc<EventFd>) -> Result<Backend> {
        let (jobs, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name("rpma-flusher".into())
            .spawn(move || {
                for job in job_rx {
                    // SAFETY: fdatasync on a descriptor kept open by `job.fd`.
                    let rc = unsafe { libc::fdatasync(job.fd.as_raw_fd()) };
                    let res = if rc == 0 {
                        0
                    } else {
                        -std::io::Error::last_os_error()
                            .raw_os_error()
                            .unwrap_or(libc::EIO)
                    };
                    if done_tx.send((job.slot, res)).is_err() {
                        break;
                    }
                    eventfd.signal();
                }
            })
            .map_err(FlusherError::Thread)?;
        Ok(Backend::Thread {
            jobs: Some(jobs),
            done,
            worker: Some(worker),
        })
    }

    /// "io_uring" or "thread".
    pub(super) fn name(&self) -> &'static str {
        match self {
            Backend::Uring(_) => "io_uring",
            Backend::Thread { .. } => "thread",
        }
    }

    /// Hands over a sync of `[offset, offset + length)` of `fd` as `slot` (the caller keeps
    /// `fd` open until the slot is reaped). Ok(true): taken; Ok(false): in the ring, but
    /// `io_uring_enter` did not take it now (-EAGAIN, -EBUSY; `fail`: a test's, as if): it
    /// is in flight all the same, and [`reap`](Self::reap) submits it again.
    ///
    /// # Errors
    /// [`FlusherError::Full`] (`depth`) if the ring has no room; [`FlusherError::Submit`] if
    /// the worker thread is gone.
    pub(super) fn push(
        &mut self,
        slot: usize,
        fd: &Arc<OwnedFd>,
        (offset, length): (u64, u64),
        depth: usize,
        fail: bool,
    ) -> Result<bool> {
        match self {
            Backend::Uring(ring) => {
                // A range longer than u32 syncs the whole file (offset 0, length 0), a superset.
                let (off, len) = match u32::try_from(length) {
                    Ok(len) => (offset, len),
                    Err(_) => (0, 0),
                };
                let sqe = opcode::Fsync::new(types::Fd(fd.as_raw_fd()))
                    .offset(off)
                    .len(len)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build()
                    .user_data(slot as u64);
                // SAFETY: the SQE refers to no memory, only to `fd`, which the caller keeps
                // open until this entry's completion is reaped.
                if unsafe { ring.submission().push(&sqe) }.is_err() {
                    // Cannot happen while in-flight <= ring size; report it rather than panic.
                    return Err(FlusherError::Full(depth));
                }
                let r = match fail {
                    true => Err(std::io::Error::from_raw_os_error(libc::EAGAIN)),
                    false => ring.submit().map(|_| ()),
                };
                // Pushed, the sync is in the ring whether or not the kernel took it now: it
                // stays in flight (its file kept open, its slot not handed out again) and the
                // next reap submits it. Freed, the slot was given to the next flush, which
                // then got this sync's completion: a Durable for a range nothing synced, or a
                // write-back error recorded on another namespace.
                if let Err(e) = &r {
                    log::warn!(
                        "flusher: io_uring did not take a sync now ({e}); submitted again at \
                         the next poll"
                    );
                }
                Ok(r.is_ok())
            }
            Backend::Thread { jobs, .. } => {
                let job = Job {
                    slot,
                    fd: Arc::clone(fd),
                };
                match jobs.as_ref().map(|j| j.send(job)) {
                    Some(Ok(())) => Ok(true),
                    _ => Err(FlusherError::Submit(std::io::Error::other(
                        "flusher worker is gone",
                    ))),
                }
            }
        }
    }

    /// Submits again what [`push`](Self::push) left in the ring (`unsubmitted`), then appends
    /// every finished sync to `out` as (slot, 0 or -errno). Returns whether the ring holds
    /// syncs not yet submitted still.
    pub(super) fn reap(&mut self, unsubmitted: bool, out: &mut Vec<(usize, i32)>) -> bool {
        match self {
            Backend::Uring(ring) => {
                let still = unsubmitted && ring.submit().is_err();
                for cqe in ring.completion() {
                    out.push((cqe.user_data() as usize, cqe.result()));
                }
                still
            }
            Backend::Thread { done, .. } => {
                out.extend(done.try_iter());
                false
            }
        }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Backend::Thread { jobs, worker, .. } = self {
            // Closing the channel ends the worker after its current fdatasync.
            jobs.take();
            if let Some(w) = worker.take() {
                let _ = w.join();
            }
        }
        // io_uring: fsync entries hold no user memory and the kernel holds its own file
        // references, so dropping the ring with entries in flight is safe.
    }
}
