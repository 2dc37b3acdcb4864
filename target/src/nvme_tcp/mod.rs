//! NVMe over TCP for the stock Linux host: the wire and the data structures a host reads.
//!
//! - [`pdu`]: the wire (PDUs, digests, framing); [`command`]: submission and completion entries,
//!   status codes; [`identify`] and [`discovery`]: the data structures a host reads.

pub mod command;
pub mod discovery;
pub mod identify;
pub mod pdu;
