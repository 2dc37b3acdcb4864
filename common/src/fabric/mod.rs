//! The verbs-shaped fabric API and its transports.
//!
//! The object model is libibverbs': a [`Context`] (device) gives [`ProtectionDomain`]s and
//! [`CompletionQueue`]s; a protection domain registers [`MemoryRegion`]s, allocates
//! [`MemoryWindow`]s and creates queue pairs; a queue pair is connected rdma_cm style by URL
//! (`tcp://host:port`) and then takes work requests ([`SendWr`], [`RecvWr`]) whose ends come back
//! as [`Completion`]s. Every object is RAII and keeps its parent alive. docs/fabric.md has the
//! design: threading, ordering and durability contract, error model.
//!
//! Transports, picked by URL scheme ([`Context::for_url`]): `tcp` ([`Context::soft`]):
//! userspace iWARP over TCP, always built. `rdma` (feature `rdma`): the same API on
//! libibverbs and librdmacm, for RoCEv2 and InfiniBand NICs and Soft-RoCE (docs/rdma.md);
//! without the feature `rdma://` is refused with [`Error::TransportUnavailable`], and with it
//! on a machine without an RDMA device with [`Error::NoDevice`] ("no RDMA device found; use
//! tcp://"). Each public type holds its transport's part through the seam in `transport.rs`
//! (docs/fabric.md, "The transport seam"); options of one transport are in their own types
//! ([`TcpParams`], [`TcpInfo`]).
//!
//! The files are in one-way layers (docs/fabric.md, "Layers"; `make lint` checks them):
//! neutral data and errors (`types`, `wr`, `memory`, `params`, `error`, `url`, `counters`,
//! `completions`, `wait`); each transport (`soft/`, `rdma/`) on those alone; the seam
//! (`transport`); the public façade (`context`, `pd`, `mr`, `cq`, `qp`) on the seam.
//!
//! # Quick start
//!
//! ```
//! use std::sync::Arc;
//! use rpma_common::fabric::*;
//!
//! # fn main() -> Result<()> {
//! let ctx = Context::soft();
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(64)?;
//!
//! // Target: register memory and listen.
//! let target_mem = AlignedBuf::new(4096)?;
//! let rights = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
//! let target_mr = pd.register(Arc::clone(&target_mem), rights)?;
//! let listener = Listener::bind(&ctx, &"tcp://127.0.0.1:0".parse()?)?;
//! let url = listener.url()?;
//! let (pd2, cq2) = (pd.clone(), cq.clone());
//! let target = std::thread::spawn(move || -> Result<QueuePair> {
//!     let req = listener.accept(&ConnParams::default())?;
//!     let qp = pd2.create_qp(&cq2, &cq2, QpCaps::default())?;
//!     req.accept(qp, &ConnParams::default(), b"hello")
//! });
//!
//! // Initiator: connect, Write, then an 8-byte Read (the Read answers only after the Write
//! // was placed, and made durable on persistent memory).
//! let icq = ctx.create_cq(64)?;
//! let qp = pd.create_qp(&icq, &icq, QpCaps::default())?
//!     .connect(&url, &ConnParams::default(), b"")?;
//! let _target_qp = target.join().unwrap()?;
//! assert_eq!(qp.info().peer_private_data, b"hello");
//!
//! let local = AlignedBuf::new(4096)?;
//! local.write_at(0, b"durable bytes")?;
//! let mr = pd.register(Arc::clone(&local), Access::LOCAL_WRITE)?;
//! let remote = target_mr.remote(0);
//! qp.post_send(SendWr::new(1, SendOp::Write { local: Sge::new(&mr, 0, 13), remote })
//!     .with_flags(SendFlags::empty()))?;
//! qp.post_send(SendWr::new(2, SendOp::Read { local: Sge::new(&mr, 64, 8), remote }))?;
//! let mut wc = [Completion::EMPTY; 4];
//! let (mut got, mut n) = (0, 0);
//! while got == 0 {
//!     cq.poll(&mut wc)?; // the target side makes progress when its CQ is polled
//!     n = icq.wait(&mut wc, Some(std::time::Duration::from_millis(10)))?;
//!     got += n;
//! }
//! assert_eq!((wc[0].wr_id, wc[0].status), (2, WcStatus::Success));
//! let mut back = [0u8; 13];
//! target_mem.read_at(0, &mut back)?;
//! assert_eq!(&back, b"durable bytes");
//! # let _ = n;
//! # Ok(())
//! # }
//! ```

// The neutral layer: plain data and errors, which every layer above may name.
mod completions;
mod counters;
mod error;
mod memory;
mod params;
mod types;
mod url;
mod wait;
mod wr;

// The transports, each on the neutral layer alone.
#[cfg(feature = "rdma")]
mod rdma;
// The soft transport is the crate's own; the raw-frame tests reach its wire formats through
// the test-only `wire-testing` feature.
#[cfg(feature = "wire-testing")]
pub mod soft;
#[cfg(not(feature = "wire-testing"))]
mod soft;

// The seam, which dispatches to the transports, and the public façade over it.
mod transport;

mod context;
mod cq;
mod mr;
mod pd;
mod qp;

pub use context::Context;
pub use counters::{
    RegionServed, ResponderCounters, ResponderSnapshot, TerminateCause, OTHER_RKEYS,
};
pub use cq::{CompletionQueue, Woken, DEFAULT_IDLE_SPIN, MAX_IDLE_SPIN};
pub use error::{DeviceEvent, Error, QpFailure, Result, TerminateCode, TerminateLayer};
pub use memory::{AlignedBuf, MemoryBacking, RegisteredMemory, Registration};
pub use mr::{MemoryRegion, MemoryWindow};
pub use params::{ConnInfo, ConnParams, TcpInfo, TcpParams};
pub use pd::ProtectionDomain;
pub use qp::{ConnRequest, Incoming, Listener, PreparedQueuePair, QueuePair, RequestProgress};
pub use types::{Access, Completion, QpCaps, QpState, SendFlags, WcOpcode, WcStatus};
pub use url::{Scheme, Url};
pub use wr::{FlushTarget, FlushType, RecvWr, RemoteAddr, SendOp, SendWr, Sge};

#[cfg(feature = "rdma")]
pub use rdma::{
    devices as rdma_devices, RdmaDevice, RDMA_MAX_ACCEPT_PRIVATE_DATA,
    RDMA_MAX_CONNECT_PRIVATE_DATA, RDMA_MAX_REJECT_PRIVATE_DATA,
};
