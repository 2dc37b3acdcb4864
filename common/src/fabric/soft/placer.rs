//! The transport's [`Placer::write`](wire::rx::Placer::write): a checked payload the receiver
//! gathered, written into the [`DirectTarget`] its placer chose with the placement module's
//! copies. The wire layer only yields the payload bytes; which copy places them (a `pwrite`
//! into a page-cache file, non-temporal stores where the cache write-back was asked for, a
//! plain copy) is decided here, above both. Every placer calls it: the engine's, and those of
//! the fuzz targets and the receiver's tests.

use super::placement::{place_copy, place_copy_writeback, place_pwrite};
use super::wire;
use super::wire::rx::DirectTarget;
use super::wire::WireError;

/// Writes `payload` into `target`; returns whether the bytes also left the CPU cache.
///
/// # Errors
/// [`WireError::PlacementFailed`] when the `pwrite` into a page-cache file fails,
/// [`WireError::PlacementTooShort`] when `target` is shorter than `payload` (nothing is copied).
pub fn write_payload(target: DirectTarget, payload: &[u8]) -> wire::Result<bool> {
    let too_short = || WireError::PlacementTooShort {
        need: payload.len(),
        given: target.len(),
    };
    match target.file {
        Some((fd, at)) => {
            place_pwrite(fd, at, payload).map_err(|source| WireError::PlacementFailed {
                len: payload.len(),
                source,
            })?;
            Ok(false)
        }
        None if target.writeback => {
            place_copy_writeback(target.dst, payload).map_err(|_| too_short())
        }
        None => {
            place_copy(target.dst, payload).map_err(|_| too_short())?;
            Ok(false)
        }
    }
}
