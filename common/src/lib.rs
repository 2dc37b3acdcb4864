//! rpma-common: the layers that the target and the initiator share.
//!
//! - [`pmem`]: maps a namespace's backing store and makes ranges of it durable, reporting honestly
//!   which persistence domain the storage is in.
//! - [`fabric`]: the verbs-shaped API and its transports (`tcp`: userspace iWARP; `rdma`: rdma-sys).
//! - [`proto`]: the control-plane wire format spoken over the fabric's Send/Recv.
//!
//! Features: `rdma` builds the libibverbs/librdmacm transport through rdma-sys.

pub mod fabric;
pub mod pmem;
pub mod proto;
pub mod units;
