//! Placement: how received bytes land in registered memory and what the responder does there.
//!
//! - `copy`: the copies of received payloads into registered memory (the transport's placer,
//!   soft/placer.rs, calls them; the wire layer names none of this module).
//! - `dirty`: the ranges placed since the last response, for the durability contract.
//! - `atomics`: RFC 7306 fetch-and-add and compare-and-swap on registered memory.
//! - `counting`: the engine's writer side of its queue pair's responder counters.

mod atomics;
mod copy;
mod counting;
mod dirty;

pub(crate) use atomics::{compare_swap, fetch_add};
pub use copy::{place_copy, place_copy_writeback, place_pwrite};
pub(crate) use counting::Counting;
pub(crate) use dirty::Dirty;
