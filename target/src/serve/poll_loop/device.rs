//! A poll loop's RDMA device: the completion queue it waits on is made on the server's device;
//! when that device is lost the loop lets go of it (a soft placeholder queue waits on the
//! loop's own fds meanwhile), and when a device is back the loop makes its queue on it
//! (docs/rdma.md, "When the device goes away").

use rpma_common::fabric::{CompletionQueue, Context, QpState};

use super::{PollLoop, WAKE_CMD, WAKE_FLUSH};
use crate::flusher::Flusher;
use crate::serve::Heartbeat;

/// The size a loop's completion queue starts at (it grows with the queue pairs bound to it).
const CQ_DEPTH: usize = 1024;

impl PollLoop {
    /// A loop's completion queue on `ctx`, watching the loop's command eventfd and its flusher's
    /// (both live as long as the loop: they are fields beside the queue).
    pub(super) fn loop_cq(
        ctx: &Context,
        beat: &Heartbeat,
        flusher: &Flusher,
    ) -> Result<CompletionQueue, rpma_common::fabric::Error> {
        let cq = ctx.create_cq(CQ_DEPTH)?;
        cq.watch_fd(beat.wake_fd(), WAKE_CMD)?;
        cq.watch_fd(flusher.wait_fd(), WAKE_FLUSH)?;
        Ok(cq)
    }

    /// The device the loop's completion queue is on, if it is the server's now: a device that
    /// is back (and that no command told this loop of yet, or whose queue could not be made
    /// then) gets its queue now.
    pub(super) fn device(&mut self) -> Option<Context> {
        if self.cq_ctx.is_lost() {
            self.device_lost();
        }
        let ctx = self.shared.ctx().filter(|c| !c.is_lost())?;
        if !ctx.same(&self.cq_ctx) {
            self.new_device(&ctx);
        }
        ctx.same(&self.cq_ctx).then_some(ctx)
    }

    /// The RDMA device under the loop's completion queue is lost: its connections are over
    /// (every queue pair on it is in Error: this turn's tick drops them, and the queue goes
    /// with the last of them), the loop waits on a soft placeholder queue (its own fds and
    /// timers only), and the server lets the device go, so that the kernel can finish
    /// removing it.
    pub(super) fn device_lost(&mut self) {
        if !self.cq_ctx.is_lost() {
            return;
        }
        log::error!(
            "loop {}: the RDMA device {} failed or was removed: its sessions are over; the \
             listeners listen again once the device is back",
            self.index,
            self.cq_ctx.device_name()
        );
        self.failed = true;
        let soft = Context::soft();
        match Self::loop_cq(&soft, &self.beat, &self.flusher) {
            Ok(cq) => self.cq = cq,
            // The lost device's queue is kept: it waits quietly now (fabric::Error::DeviceLost
            // is said once), and the loop counts it lost all the same (said once here).
            Err(e) => log::error!(
                "loop {}: cannot make a placeholder completion queue: {e}",
                self.index
            ),
        }
        self.cq_ctx = soft;
        self.shared.release_lost_device();
    }

    /// The RDMA device failed or was removed and is back as `ctx`: the loop's completion
    /// queue is made anew on it. The connections on the lost device are over (their queue
    /// pairs are in Error, or moved there now): the next tick drops them, and the old queue
    /// goes with the last of them.
    pub(super) fn new_device(&mut self, ctx: &Context) {
        match Self::loop_cq(ctx, &self.beat, &self.flusher) {
            Ok(cq) => {
                for c in self.conns.values() {
                    if c.qp.state() != QpState::Error {
                        c.qp.to_error();
                    }
                }
                self.failed = true;
                self.cq = cq;
                self.cq_ctx = ctx.clone();
                log::info!(
                    "loop {}: serving on the RDMA device {} again",
                    self.index,
                    ctx.device_name()
                );
            }
            // Tried again at the next connection request: said once per device.
            Err(e) => {
                let level = if self.cq_failed_on.as_ref().is_some_and(|c| c.same(ctx)) {
                    log::Level::Debug
                } else {
                    log::Level::Error
                };
                self.cq_failed_on = Some(ctx.clone());
                log::log!(
                    level,
                    "loop {}: cannot make a completion queue on the RDMA device {} that is \
                     back: {e}",
                    self.index,
                    ctx.device_name()
                );
            }
        }
    }
}
