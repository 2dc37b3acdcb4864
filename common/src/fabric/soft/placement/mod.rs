//! Placement: how received bytes land in registered memory and what the responder does there.
//!
//! - `copy`: the [`DirectTarget`] a receiver is handed and the copies into it.
//! - `dirty`: the ranges placed since the last response, for the durability contract.
//! - `atomics`: RFC 7306 fetch-and-add and compare-and-swap on registered memory.
//! - `counting`: the engine's writer side of its queue pair's responder counters.

mod atomics;
mod copy;
mod counting;
mod dirty;

pub(crate) use atomics::{compare_swap, fetch_add};
pub use copy::{place_copy, place_copy_writeback, place_pwrite, DirectTarget};
pub(crate) use counting::Counting;
pub(crate) use dirty::Dirty;
