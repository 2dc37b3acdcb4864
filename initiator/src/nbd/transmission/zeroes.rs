//! WRITE_ZEROES, written a step at a time: between steps the queue goes to another thread
//! that wants it (a FLUSH of another connection, a connection sharing the queue), as between
//! batches. A request may zero up to 4 GiB - 1: written as one batch under the queue's lock,
//! one such request held every FLUSH of the export for the seconds to minutes it took.

use log::Level;

use super::super::pipeline::errno;
use super::super::proto::{simple_reply, Errno};
use super::parse::Item;
use super::Client;

/// Bytes of zeroes written per step (as many as a batch of READs and WRITEs moves at most,
/// [`BATCH_BYTES`](super::parse::BATCH_BYTES)).
pub(super) const ZERO_STEP: u64 = 64 << 20;
/// Bytes of zeroes per piece: one buffer of zeroes, written again and again.
const ZERO_PIECE: usize = 1 << 20;

impl Client<'_> {
    /// A WRITE_ZEROES (nothing else in flight): written a [`ZERO_STEP`] at a time, each step
    /// made durable with its writes if FUA; answered once every step was written, with the
    /// first failure if one failed (the steps after it are not written).
    pub(super) fn write_zeroes(&mut self, it: &Item, fua: bool) {
        if self.zeroes.is_empty() {
            self.zeroes = vec![0u8; ZERO_PIECE];
        }
        let (shared, cell) = (self.shared, self.cell);
        let (off, len) = (it.req.offset, u64::from(it.req.len));
        let mut at = 0;
        let mut r = Ok(true);
        while at < len {
            if at > 0 && cell.wanted() {
                self.let_go();
            }
            let step = (len - at).min(ZERO_STEP);
            let v: Vec<(u64, &[u8])> = (0..step)
                .step_by(ZERO_PIECE)
                .map(|p| {
                    let n = (step - p).min(ZERO_PIECE as u64) as usize;
                    (off + at + p, &self.zeroes[..n])
                })
                .collect();
            let g = self.held.get_or_insert_with(|| shared.lock(cell));
            let done = if fua {
                shared
                    .with_ns(cell, g, |ns| ns.write_batch_durable(&v))
                    .map(|d| d.is_durable())
            } else {
                shared
                    .with_ns(cell, g, |ns| ns.write_batch(&v))
                    .map(|()| true)
            };
            match done {
                Ok(durable) => {
                    // Before the queue goes to another thread: a FLUSH that takes it between
                    // steps finds the steps written.
                    cell.mark_dirty();
                    r = r.map(|d| d && durable);
                }
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
            at += step;
        }
        let e = match r {
            Err(e) => {
                self.shared.told();
                self.shared.problems.log(
                    Level::Warn,
                    self.source,
                    format_args!(
                        "nbd: WRITE_ZEROES failed, answered {}: {}",
                        Errno(errno(&e, true)),
                        rpma_common::error_chain(&e)
                    ),
                );
                errno(&e, true)
            }
            Ok(_) if !fua => 0,
            Ok(durable) => self.durable(Ok(durable), 1, "FUA write"),
        };
        simple_reply(&mut self.out, e, it.req.handle);
        self.answered(1);
    }
}
