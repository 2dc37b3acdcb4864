//! What a client's requests that ask for durability are answered: its FLUSH (every write
//! answered so far, on any connection), a WRITE sent just before a FLUSH, and the error for a
//! durability call's result.

use std::sync::atomic::Ordering;

use log::Level;

use super::super::pipeline::errno;
use super::super::proto::{self, simple_reply, Errno, EIO};
use super::super::ConnError;
use super::parse::Item;
use super::Client;

impl Client<'_> {
    /// A small WRITE ([`EARLY_MAX`]) of a client that sends a FLUSH after each WRITE (fio's
    /// `fsync=1`, a journal's commit), with nothing in flight and every earlier write of the
    /// queue durable, on a namespace that can be made durable: written and made durable
    /// before it is answered, the Write and the request that makes it durable going out
    /// together (as a FUA write's). The FLUSH that follows then finds nothing to do on this
    /// queue: the pair costs one round trip to the target, not two (a WRITE is otherwise
    /// answered when the transport took it, and its FLUSH waits for a second). A failure is
    /// the WRITE's answer (as for a FUA write) and leaves the queue dirty for the FLUSH. A
    /// client that sends two WRITEs in a row is no longer taken for one that flushes after
    /// each (at most one such WRITE per FLUSH).
    pub(super) fn write_before_flush(&mut self, it: &Item) -> Result<(), ConnError> {
        self.after_other_connections(&it.req, false)?;
        let (shared, cell) = (self.shared, self.cell);
        let g = self.held.get_or_insert_with(|| shared.lock(cell));
        let data = &self.buf.bytes()[it.payload.clone()];
        let r = shared.with_ns(cell, g, |ns| ns.write_durable(it.req.offset, data));
        let e = match r {
            Ok(d) if d.is_durable() => {
                self.stats.early += 1;
                0
            }
            Ok(_) => {
                cell.mark_dirty();
                0
            }
            Err(e) => {
                cell.mark_dirty();
                self.shared.told();
                self.shared.problems.log(
                    Level::Warn,
                    self.source,
                    format_args!(
                        "nbd: WRITE failed, answered {}: {}",
                        Errno(errno(&e, true)),
                        rpma_common::error_chain(&e)
                    ),
                );
                errno(&e, true)
            }
        };
        simple_reply(&mut self.out, e, it.req.handle);
        self.answered(1);
        Ok(())
    }

    /// A FLUSH: every write answered so far, on any connection, made durable. The caller
    /// holds no queue.
    pub(super) fn flush(&mut self) -> u32 {
        if self.limits.read_only {
            return 0;
        }
        let e = self.durable(self.shared.flush_all(self.source), 1, "FLUSH");
        // A queue given up since this client's last FLUSH (or, for its first, since it entered
        // transmission, or before that while no client was told of it) may have lost writes
        // answered on some connection: this FLUSH cannot vouch for them. (Several connections
        // of one client entering after an untold loss: the first FLUSH reports it, once.)
        let losses = self.shared.losses.load(Ordering::SeqCst);
        let told = self.shared.losses_reported.load(Ordering::SeqCst);
        let seen = self.losses_seen.max(self.losses_at_entry.min(told));
        if losses != seen {
            self.losses_seen = losses;
            self.shared
                .losses_reported
                .fetch_max(losses, Ordering::SeqCst);
            if e == 0 {
                return EIO;
            }
        }
        e
    }

    /// The error for `n` requests whose durability call returned `r`.
    pub(super) fn durable(&mut self, r: crate::Result<bool>, n: usize, what: &str) -> u32 {
        match r {
            Ok(true) => 0,
            Ok(false) if self.shared.opts.visible_ok => 0,
            Ok(false) => {
                self.stats.visible_only += n as u64;
                proto::EIO
            }
            Err(e) => {
                self.shared.problems.log(
                    Level::Warn,
                    self.source,
                    format_args!(
                        "nbd: {what} failed, answered {}: {}",
                        Errno(errno(&e, true)),
                        rpma_common::error_chain(&e)
                    ),
                );
                errno(&e, true)
            }
        }
    }
}
