//! `tcp`: a userspace RDMA engine over TCP that speaks iWARP (MPA, DDP, RDMAP).
//!
//! - [`wire`]: the formats (headers, bodies, MPA frames, CRC), no I/O.
//! - `device`: the STag table; `conn`: TCP + MPA set-up; `qp`: the requester and responder
//!   engine; `tx`: FPDU transmission (reception is the wire layer's `FpduReceiver`); `placement`: the durability contract's
//!   dirty ranges and the atomics; `poll`: the epoll idle wait.

pub(crate) mod conn;
pub(crate) mod device;
mod engine;
pub(crate) mod placement;
pub(crate) mod poll;
pub(crate) mod qp;
mod requester;
mod responder;
pub(crate) mod tx;
pub mod wire;

pub use conn::{DEFAULT_MAX_ULPDU, MAX_PRIVATE_DATA};
