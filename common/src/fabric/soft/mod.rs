//! `tcp`: a userspace RDMA engine over TCP that speaks iWARP (MPA, DDP, RDMAP).
//!
//! From the bottom up:
//! - [`wire`]: the formats (headers, bodies, MPA frames, CRC), segmentation and the receive
//!   state machine; no sockets, no registered memory beyond the copies it is handed.
//! - `placement`: how received bytes land in registered memory (`copy`: the copies into it),
//!   the dirty ranges of the durability contract (`dirty`), the RFC 7306 atomics (`atomics`).
//! - [`placer`]: the placer's write that the receiver hands checked payloads to: placement's
//!   copies into the receiver's `DirectTarget`, so that the wire layer names no placement code.
//! - `status`: Terminate causes for refused accesses, completion statuses for received
//!   Terminates.
//! - `device`: the STag table (regions and windows, rights checks).
//! - `conn`: TCP connect/accept and the MPA exchange.
//! - `outbound`: a connection's FIFO of outbound messages, written with `writev` (the framing
//!   is the wire layer's `tx`).
//! - `qp`: the soft queue pair (the engine behind the public `QueuePair`), split in `engine`
//!   (state requester and responder share: in-order completions, the move to Error, Terminates,
//!   driving the socket), `requester` and `responder`.

pub(crate) mod conn;
pub(crate) mod cq;
pub(crate) mod device;
mod engine;
mod outbound;
pub(crate) mod placement;
pub mod placer;
pub(crate) mod qp;
mod requester;
mod responder;
mod status;
// The wire formats are whole codecs (every RFC cause, the blocking handshakes, the segmenter):
// some parts serve only tests, which reach them through the `wire-testing` feature.
#[cfg_attr(not(feature = "wire-testing"), allow(dead_code, unused_imports))]
pub mod wire;
