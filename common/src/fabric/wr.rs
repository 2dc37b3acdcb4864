//! Work requests (`ibv_send_wr`, `ibv_recv_wr`, `ibv_sge`): what a queue pair is asked to
//! do, and the local and remote memory it names. A local buffer names its region through
//! [`LocalRegion`], the face the public `MemoryRegion` shows to the transports, so that
//! nothing below the façade names the façade.

use std::sync::Arc;

use super::error::{Error, Result};
use super::memory::{LocalRegion, Region};
use super::types::{Access, DomainId, SendFlags, WcOpcode};

/// A local buffer: a range of a registered memory region (`ibv_sge`), made with
/// [`Sge::new`] or [`Sge::whole`] from an `Arc<MemoryRegion>`.
///
/// Holding the region is what keeps the memory registered and alive while the fabric uses it.
#[derive(Debug, Clone)]
pub struct Sge {
    /// The region, as every transport reads it (the façade's `MemoryRegion`).
    pub(crate) mr: Arc<dyn LocalRegion>,
    /// Byte offset into the region.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

impl Sge {
    /// The registered memory.
    pub(crate) fn region(&self) -> &Arc<Region> {
        self.mr.memory()
    }

    /// The region's local key.
    pub(crate) fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// The protection domain the region is registered in.
    pub(crate) fn domain(&self) -> DomainId {
        self.mr.domain()
    }

    /// The address of the buffer's first byte (the region's address plus the offset).
    pub(crate) fn addr(&self) -> u64 {
        self.region().addr() as u64 + self.offset as u64
    }

    /// Checks the range against the region's bounds and the region's rights against `needed`.
    ///
    /// # Errors
    /// [`Error::LocalBounds`], [`Error::LocalAccess`].
    pub(crate) fn check_local(&self, needed: Access) -> Result<()> {
        let region_len = self.region().len();
        match self.offset.checked_add(self.len) {
            Some(end) if end <= region_len => {}
            _ => {
                return Err(Error::LocalBounds {
                    offset: self.offset,
                    len: self.len,
                    region_len,
                })
            }
        }
        let has = self.mr.access();
        if !has.contains(needed) {
            return Err(Error::LocalAccess { needed, has });
        }
        Ok(())
    }
}

/// A peer's memory: a virtual address inside a region or window and its rkey.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteAddr {
    /// Address in the peer's region (its `MemoryRegion::addr()` plus an offset).
    pub addr: u64,
    /// The region's or window's rkey.
    pub rkey: u32,
}

/// What a Flush makes of the earlier placed data (IBTA placement type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlushType {
    /// Globally visible to every reader of the memory.
    Visibility,
    /// Persistent: in the memory's durable domain.
    Persistent,
}

/// The range a Flush covers (IBTA selectivity).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlushTarget {
    /// `len` bytes at `remote`.
    Range {
        /// Start.
        remote: RemoteAddr,
        /// Length in bytes.
        len: u64,
    },
    /// The whole region or window of `rkey`.
    Region {
        /// Its rkey.
        rkey: u32,
    },
}

/// The operation of a send-queue work request.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum SendOp {
    /// RDMA Write of `local` to `remote`.
    Write {
        /// Source.
        local: Sge,
        /// Destination.
        remote: RemoteAddr,
    },
    /// RDMA Write, then 32 bits of immediate data that consume a Recv at the peer.
    WriteWithImm {
        /// Source.
        local: Sge,
        /// Destination.
        remote: RemoteAddr,
        /// Immediate data, reported in the peer's receive completion.
        imm: u32,
    },
    /// RDMA Read of `local.len` bytes from `remote` into `local`.
    Read {
        /// Sink (needs [`Access::LOCAL_WRITE`]).
        local: Sge,
        /// Source.
        remote: RemoteAddr,
    },
    /// Send: consumes a Recv posted at the peer.
    Send {
        /// Message.
        local: Sge,
    },
    /// Send that also invalidates `invalidate_rkey` at the peer.
    SendWithInvalidate {
        /// Message.
        local: Sge,
        /// The peer's rkey to invalidate.
        invalidate_rkey: u32,
    },
    /// 64-bit compare and swap; the original value lands in `local` (8 bytes, native endian).
    CompareSwap {
        /// Result buffer (8 bytes, needs [`Access::LOCAL_WRITE`]).
        local: Sge,
        /// Target (8-byte aligned).
        remote: RemoteAddr,
        /// Expected value.
        compare: u64,
        /// New value, stored if the target equals `compare`.
        swap: u64,
    },
    /// 64-bit fetch and add; the original value lands in `local` (8 bytes, native endian).
    FetchAdd {
        /// Result buffer (8 bytes, needs [`Access::LOCAL_WRITE`]).
        local: Sge,
        /// Target (8-byte aligned).
        remote: RemoteAddr,
        /// Addend.
        add: u64,
    },
    /// IBTA Atomic Write: 8 bytes stored at once, after every earlier operation.
    AtomicWrite {
        /// Target (8-byte aligned).
        remote: RemoteAddr,
        /// The value.
        value: u64,
    },
    /// IBTA Flush: makes earlier placed data visible or persistent.
    Flush {
        /// What it covers.
        target: FlushTarget,
        /// Visibility or persistence.
        kind: FlushType,
    },
}

impl SendOp {
    /// What a completion of this request reports (every transport keeps it with the posted
    /// request: a failed completion's own opcode is undefined).
    pub(crate) fn wc_opcode(&self) -> WcOpcode {
        match self {
            SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
            SendOp::Send { .. } | SendOp::SendWithInvalidate { .. } => WcOpcode::Send,
            SendOp::CompareSwap { .. } => WcOpcode::CompSwap,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
            SendOp::AtomicWrite { .. } => WcOpcode::AtomicWrite,
            SendOp::Flush { .. } => WcOpcode::Flush,
        }
    }
}

/// The shape every transport demands of a CompareSwap or FetchAdd: an 8-byte result buffer
/// and an 8-byte aligned target.
pub(crate) fn check_atomic_args(local: &Sge, remote: RemoteAddr) -> Result<()> {
    if local.len != 8 {
        return Err(Error::InvalidWorkRequest {
            reason: "atomic result buffer must be 8 bytes",
        });
    }
    if !remote.addr.is_multiple_of(8) {
        return Err(Error::InvalidWorkRequest {
            reason: "atomic target must be 8-byte aligned",
        });
    }
    Ok(())
}

/// A send-queue work request (`ibv_send_wr`).
#[derive(Debug, Clone)]
pub struct SendWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// Signaled, fence, solicited.
    pub flags: SendFlags,
}

impl SendWr {
    /// A signaled request.
    pub fn new(wr_id: u64, op: SendOp) -> SendWr {
        SendWr {
            wr_id,
            op,
            flags: SendFlags::SIGNALED,
        }
    }

    /// The same request with `flags` instead.
    pub fn with_flags(mut self, flags: SendFlags) -> SendWr {
        self.flags = flags;
        self
    }

    /// The flag rule every transport enforces: a solicited event only on a Send or a
    /// WriteWithImm.
    pub(crate) fn check_solicited(&self) -> Result<()> {
        if self.flags.contains(SendFlags::SOLICITED)
            && !matches!(
                self.op,
                SendOp::Send { .. }
                    | SendOp::SendWithInvalidate { .. }
                    | SendOp::WriteWithImm { .. }
            )
        {
            return Err(Error::InvalidWorkRequest {
                reason: "solicited event only on Send and WriteWithImm",
            });
        }
        Ok(())
    }
}

/// A receive-queue work request (`ibv_recv_wr`).
#[derive(Debug, Clone)]
pub struct RecvWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where an incoming Send lands (needs [`Access::LOCAL_WRITE`]); may be empty for
    /// immediate-data-only receives.
    pub local: Option<Sge>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_wr_defaults_to_signaled() {
        let wr = SendWr::new(
            7,
            SendOp::AtomicWrite {
                remote: RemoteAddr { addr: 8, rkey: 1 },
                value: 3,
            },
        );
        assert!(wr.flags.contains(SendFlags::SIGNALED));
        let wr = wr.with_flags(SendFlags::FENCE);
        assert!(!wr.flags.contains(SendFlags::SIGNALED));
    }
}
