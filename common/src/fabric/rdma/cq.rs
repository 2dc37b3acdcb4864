//! The rdma transport's completion queue: an `ibv_cq` with its completion channel, polled
//! into the fabric's completion list, and the idle wait.
//!
//! Polling (`progress`) reaps up to a few batches of work completions and hands each to its
//! queue pair, which translates it (its own record says what the request was) and releases
//! what the request held. Every few polls it also reads, without blocking, the rdma_cm events
//! of the queue pairs bound to it (a peer's disconnect) and the device's async events (a
//! queue pair's fatal error), so that a queue that is always busy still notices them.
//!
//! The idle wait blocks in one epoll set: the completion channel's fd (armed with
//! `ibv_req_notify_cq` first, on every wait: with several threads waiting on one queue, the
//! one that takes the channel's event is not always the one that armed it, so nobody may skip
//! the arming; then polled once more, so that a completion that came just before the arming
//! is not slept through), an epoll set of the bound queue pairs' rdma_cm
//! channels and the device's async fd, and the fds the user watches.
//!
//! Verbs completion queues overflow fatally, so each queue pair reserves its send or receive
//! depth here when it is made, and the queue is resized (`ibv_resize_cq`) before a reservation
//! would pass its size.

use std::os::fd::{AsFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use rdma_sys::{ibv_comp_channel, ibv_cq, ibv_wc};

use super::device::Device;
use super::sys;
use crate::fabric::completions::Completions;
use crate::fabric::error::{Error, QpFailure, Result};
use crate::fabric::types::Completion;
use crate::fabric::wait::{Poller, Ready};

/// Work completions reaped per `ibv_poll_cq`.
const BATCH: usize = 32;
/// Most batches per poll: a flood of completions still lets the caller handle some.
const ROUNDS: usize = 8;
/// Every this many polls, rdma_cm and async events are looked at too.
const EVENT_CHECK_EVERY: u32 = 64;
/// Tokens in the idle wait: the completion channel, the event set.
const COMP_TOKEN: u64 = 1;
const EVENTS_TOKEN: u64 = 2;
/// The event set's token for the device's async fd (queue pair numbers are 24 bits).
const ASYNC_TOKEN: u64 = u64::MAX >> 1;

struct Size {
    /// Entries the device queue has.
    cqe: u32,
    /// Entries the bound queue pairs may need at once.
    reserved: u32,
}

pub(crate) struct Cq {
    dev: Device,
    /// The completion queue's list: what is reaped goes there.
    list: Arc<Completions>,
    // Destroyed before the channel (Drop).
    cq: NonNull<ibv_cq>,
    channel: NonNull<ibv_comp_channel>,
    size: Mutex<Size>,
    poller: Poller,
    events: Epoll,
    turns: AtomicU32,
    /// The device is lost and the queue no longer polled, armed or waited on
    /// ([`Cq::device_lost`]).
    quiet: AtomicBool,
}

// SAFETY: libibverbs completion queues and channels may be used from any thread (polling takes
// the provider's lock); the pointers are freed only in Drop; the rest is atomics and locks.
unsafe impl Send for Cq {}
// SAFETY: as for Send.
unsafe impl Sync for Cq {}

fn epoll_err(e: nix::Error) -> Error {
    Error::Wait {
        source: std::io::Error::from(e),
    }
}

impl Cq {
    pub(crate) fn new(dev: &Device, depth: usize, list: Arc<Completions>) -> Result<Cq> {
        let max = dev.caps().max_cqe;
        let cqe = (depth.max(1).min(u32::MAX as usize) as u32).min(max);
        // SAFETY: the context is open; the channel is destroyed in Drop (after the CQ).
        let channel = unsafe { rdma_sys::ibv_create_comp_channel(dev.ctx()) };
        let channel = NonNull::new(channel).ok_or_else(|| sys::errno("ibv_create_comp_channel"))?;
        let destroy_channel = |ch: NonNull<ibv_comp_channel>| {
            // SAFETY: the channel was just made and nothing uses it.
            unsafe { rdma_sys::ibv_destroy_comp_channel(ch.as_ptr()) };
        };
        // SAFETY: the channel is live; the fd stays open until the channel is destroyed.
        let chfd = unsafe { sys::borrow_fd((*channel.as_ptr()).fd) };
        if let Err(e) = sys::set_nonblocking(chfd, true, "fcntl(completion channel)") {
            destroy_channel(channel);
            return Err(e);
        }
        // SAFETY: the context and channel are live; no cq_context; vector 0.
        let cq = unsafe {
            rdma_sys::ibv_create_cq(
                dev.ctx(),
                cqe as i32,
                std::ptr::null_mut(),
                channel.as_ptr(),
                0,
            )
        };
        let Some(cq) = NonNull::new(cq) else {
            let e = sys::errno("ibv_create_cq");
            destroy_channel(channel);
            return Err(e);
        };
        // SAFETY: the CQ is live; `cqe` is the size the device gave it (at least the asked).
        let given = unsafe { (*cq.as_ptr()).cqe }.max(1) as u32;
        // From here on Drop cleans up.
        let made = |poller: Poller, events: Epoll| Cq {
            dev: dev.clone(),
            list,
            cq,
            channel,
            size: Mutex::new(Size {
                cqe: given,
                reserved: 0,
            }),
            poller,
            events,
            turns: AtomicU32::new(0),
            quiet: AtomicBool::new(false),
        };
        let poller = match Poller::new() {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: both were just made and nothing else holds them.
                unsafe {
                    rdma_sys::ibv_destroy_cq(cq.as_ptr());
                }
                destroy_channel(channel);
                return Err(e);
            }
        };
        let events = match Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC) {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: as above.
                unsafe {
                    rdma_sys::ibv_destroy_cq(cq.as_ptr());
                }
                destroy_channel(channel);
                return Err(epoll_err(e));
            }
        };
        let q = made(poller, events);
        q.poller.add(chfd, COMP_TOKEN, false)?;
        q.poller.add(q.events.0.as_fd(), EVENTS_TOKEN, false)?;
        // SAFETY: the async fd is the context's, open while `dev` (held by q) is.
        let afd = unsafe { sys::borrow_fd(dev.async_fd()) };
        q.events
            .add(afd, EpollEvent::new(EpollFlags::EPOLLIN, ASYNC_TOKEN))
            .map_err(epoll_err)?;
        Ok(q)
    }

    pub(crate) fn raw(&self) -> *mut ibv_cq {
        self.cq.as_ptr()
    }

    pub(crate) fn poller(&self) -> &Poller {
        &self.poller
    }

    /// Makes room for `n` more outstanding requests, resizing the device queue if needed.
    pub(crate) fn reserve(&self, n: u32) -> Result<()> {
        let mut s = self.size.lock().unwrap_or_else(|p| p.into_inner());
        let want = s.reserved.checked_add(n).ok_or(Error::Exhausted {
            what: "completion queue entries",
        })?;
        if want > s.cqe {
            let max = self.dev.caps().max_cqe;
            if want > max {
                return Err(Error::Exhausted {
                    what: "completion queue entries (the device's max_cqe)",
                });
            }
            let new = want.max(s.cqe.saturating_mul(2)).min(max);
            // SAFETY: the CQ is live; resizing keeps its completions.
            let r = unsafe { rdma_sys::ibv_resize_cq(self.raw(), new as i32) };
            if r != 0 {
                return Err(sys::returned("ibv_resize_cq", r));
            }
            // SAFETY: as above; `cqe` now holds the size the device gave.
            s.cqe = unsafe { (*self.raw()).cqe }.max(want as i32) as u32;
        }
        s.reserved = want;
        Ok(())
    }

    /// Gives back a reservation (the queue pair is gone).
    pub(crate) fn release(&self, n: u32) {
        let mut s = self.size.lock().unwrap_or_else(|p| p.into_inner());
        s.reserved = s.reserved.saturating_sub(n);
    }

    /// Adds a bound queue pair's rdma_cm channel to the events looked at.
    pub(crate) fn watch_events(&self, fd: BorrowedFd<'_>, qp_num: u32) {
        let ev = EpollEvent::new(EpollFlags::EPOLLIN, u64::from(qp_num));
        // Already there (the queue is both the send and the receive queue): fine.
        let _ = self.events.add(fd, ev);
    }

    pub(crate) fn unwatch_events(&self, fd: BorrowedFd<'_>) {
        let _ = self.events.delete(fd);
    }

    /// Adds a completion of the transport's own (a queue pair's flushed leftovers).
    pub(crate) fn push(&self, c: Completion) {
        self.list.push(c);
    }

    /// Reaps what the device completed into the list, and now and then the events.
    pub(crate) fn progress(&self) -> Result<()> {
        self.reap()?;
        if self
            .turns
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(EVENT_CHECK_EVERY)
        {
            self.check_events()?;
        }
        Ok(())
    }

    fn reap(&self) -> Result<()> {
        if self.dev.is_lost() {
            return self.device_lost();
        }
        // SAFETY: ibv_wc is plain C data; ibv_poll_cq overwrites the entries it reports.
        let mut wcs: [ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
        for _ in 0..ROUNDS {
            // SAFETY: the CQ is live; `wcs` has room for BATCH completions.
            let n = unsafe { rdma_sys::ibv_poll_cq(self.raw(), BATCH as i32, wcs.as_mut_ptr()) };
            if n < 0 {
                let source = std::io::Error::from_raw_os_error(if -n > 1 { -n } else { libc::EIO });
                // A device that no longer answers is gone: nothing completes here again. One
                // that answers reports this poll's error, as before.
                if !self.dev.answers() {
                    log::debug!("{}: ibv_poll_cq failed: {source}", self.dev.inner.name);
                    return self.device_lost();
                }
                return Err(Error::Verbs {
                    op: "ibv_poll_cq",
                    source,
                });
            }
            for wc in &wcs[..n as usize] {
                // A completion of a queue pair that is gone (its number is no longer in the
                // registry) has nobody to report to: dropped.
                if let Some(qp) = self.dev.qp(wc.qp_num) {
                    qp.complete(wc, &self.list);
                }
            }
            if (n as usize) < BATCH {
                break;
            }
        }
        Ok(())
    }

    /// Reads the rdma_cm events of the bound queue pairs and the device's async events that
    /// are ready, without blocking.
    fn check_events(&self) -> Result<()> {
        let mut evs = [EpollEvent::empty(); 16];
        let n = match self.events.wait(&mut evs, EpollTimeout::ZERO) {
            Ok(n) => n,
            Err(nix::Error::EINTR) => 0,
            Err(e) => return Err(epoll_err(e)),
        };
        for e in &evs[..n] {
            match e.data() {
                ASYNC_TOKEN => self.dev.handle_async_events(),
                num => {
                    if let Some(qp) = self.dev.qp(num as u32) {
                        qp.handle_cm_events();
                    }
                }
            }
        }
        Ok(())
    }

    /// The device is lost (it failed, was removed, or its queue stopped answering): marks it
    /// so, and stops polling, arming and waiting on this queue. Its completion channel and the
    /// device's async fd leave the waits: on a disassociated device both stay readable for
    /// ever, and a wait on them would spin. What is left to wait on are the rdma_cm events of
    /// the bound queue pairs and the user's fds. [`Error::DeviceLost`] the first time, Ok after.
    fn device_lost(&self) -> Result<()> {
        self.dev.lose(QpFailure::DeviceRemoved);
        if self.quiet.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // SAFETY: the channel lives as long as self; the async fd as long as the context,
        // which `dev` keeps open.
        let (chfd, afd) = unsafe {
            (
                sys::borrow_fd((*self.channel.as_ptr()).fd),
                sys::borrow_fd(self.dev.async_fd()),
            )
        };
        let _ = self.poller.unwatch_transport(chfd);
        let _ = self.events.delete(afd);
        Err(Error::DeviceLost {
            device: self.dev.inner.name.clone(),
        })
    }

    /// Arms the completion channel and reaps once more (see the module docs).
    pub(crate) fn arm(&self) -> Result<()> {
        if self.dev.is_lost() {
            self.device_lost()?;
            // Nothing to arm: the rdma_cm events are still looked at.
            return self.check_events();
        }
        // SAFETY: the CQ is live; the next completion of any kind raises one event. Arming an
        // armed queue is allowed and changes nothing.
        let r = unsafe { rdma_sys::ibv_req_notify_cq(self.raw(), 0) };
        if r != 0 {
            let e = sys::returned("ibv_req_notify_cq", r);
            if !self.dev.answers() {
                log::debug!("{}: {e}", self.dev.inner.name);
                return self.device_lost();
            }
            return Err(e);
        }
        self.reap()?;
        self.check_events()
    }

    /// Blocks until a completion event, an rdma_cm or async event, or a watched fd, or
    /// `timeout`.
    pub(crate) fn block(&self, timeout: Option<Duration>) -> Result<Ready> {
        let ready = self.poller.wait(timeout)?;
        self.take_channel_events();
        self.check_events()?;
        Ok(ready)
    }

    /// Takes (and acknowledges) the completion channel's events; the queue must be armed
    /// again for the next.
    fn take_channel_events(&self) {
        let mut n = 0u32;
        loop {
            let mut cq = std::ptr::null_mut();
            let mut ctx = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking: -1 at once when nothing is queued.
            if unsafe { rdma_sys::ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut ctx) } != 0
            {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: `n` events of this CQ (its channel serves only it) were taken above.
            unsafe { rdma_sys::ibv_ack_cq_events(self.raw(), n) };
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every queue pair bound to this CQ holds an Arc of it, so none is left;
        // every channel event was acknowledged (take_channel_events). The CQ goes before its
        // channel, each once.
        unsafe {
            rdma_sys::ibv_destroy_cq(self.cq.as_ptr());
            rdma_sys::ibv_destroy_comp_channel(self.channel.as_ptr());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_never_collide_with_queue_pair_numbers() {
        // Queue pair numbers are 24 bits in IB; the async token is far above them.
        assert!(ASYNC_TOKEN > u64::from(u32::MAX));
        assert_ne!(COMP_TOKEN, EVENTS_TOKEN);
        assert_eq!(BATCH * ROUNDS, 256);
    }
}
