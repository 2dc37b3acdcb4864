//! Plain data of the verbs API: access and send flags, queue pair states, completions, queue
//! sizes. The bottom of the fabric: it imports nothing (work requests, which name memory,
//! are in `wr.rs`).
//!
//! Named after libibverbs (`ibv_access_flags`, `ibv_send_flags`, `ibv_wc`, `ibv_wc_status`,
//! `ibv_qp_state`) so that the `rdma` transport maps them one to one.

use std::fmt;
use std::ops::{BitAnd, BitOr, BitOrAssign};

macro_rules! flags {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $flag:ident = $v:expr,)* }) => {
        $(#[$m])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub struct $name(u32);

        impl $name {
            $($(#[$fm])* pub const $flag: $name = $name($v);)*
            /// No flag set.
            pub const fn empty() -> Self {
                $name(0)
            }
            /// The raw bits.
            pub const fn bits(self) -> u32 {
                self.0
            }
            /// Whether every flag of `other` is set in `self`.
            pub const fn contains(self, other: Self) -> bool {
                self.0 & other.0 == other.0
            }
            /// Whether no flag is set.
            pub const fn is_empty(self) -> bool {
                self.0 == 0
            }
        }

        impl BitOr for $name {
            type Output = Self;
            fn bitor(self, rhs: Self) -> Self {
                $name(self.0 | rhs.0)
            }
        }

        impl BitOrAssign for $name {
            fn bitor_assign(&mut self, rhs: Self) {
                self.0 |= rhs.0;
            }
        }

        impl BitAnd for $name {
            type Output = Self;
            fn bitand(self, rhs: Self) -> Self {
                $name(self.0 & rhs.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let mut first = true;
                write!(f, "{}(", stringify!($name))?;
                $(if self.contains($name::$flag) && $v != 0 {
                    if !first { f.write_str(" | ")?; }
                    first = false;
                    f.write_str(stringify!($flag))?;
                })*
                let _ = first;
                f.write_str(")")
            }
        }
    };
}

flags! {
    /// What a memory region or window allows (`ibv_access_flags`).
    Access {
        /// The local side may write into it (Read sinks, Recv buffers, atomic results).
        LOCAL_WRITE = 1,
        /// Peers may RDMA Write into it.
        REMOTE_WRITE = 1 << 1,
        /// Peers may RDMA Read from it.
        REMOTE_READ = 1 << 2,
        /// Peers may run atomics (CompareSwap, FetchAdd) on it.
        REMOTE_ATOMIC = 1 << 3,
        /// Memory windows may be bound to it.
        MW_BIND = 1 << 4,
        /// Peers may Flush it to global visibility.
        FLUSH_VISIBILITY = 1 << 5,
        /// Peers may Flush it to persistence.
        FLUSH_PERSISTENT = 1 << 6,
    }
}

impl Access {
    /// Every remote right.
    pub const ALL_REMOTE: Access = Access(0b110_1110);
}

flags! {
    /// Per-work-request flags (`ibv_send_flags`).
    SendFlags {
        /// Generate a completion on success (errors always complete).
        SIGNALED = 1,
        /// Wait for every earlier Read, Atomic and Flush to complete before starting this one.
        FENCE = 1 << 1,
        /// Solicited Event (Send, Send with Invalidate and WriteWithImm only): the peer's
        /// receive completion has `solicited` set.
        SOLICITED = 1 << 2,
    }
}

/// Queue pair states, as `ibv_qp_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QpState {
    /// Just created, nothing allowed.
    Reset,
    /// Initialised: receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send: every verb allowed.
    Rts,
    /// A fatal error happened; every outstanding work request has been or is being flushed.
    Error,
}

/// Completion statuses, named after `ibv_wc_status` (each of its values has one here; the
/// soft transport produces the first twelve).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcStatus {
    /// Done.
    Success,
    /// A message did not fit the local buffer (an incoming Send larger than the posted Recv).
    LocalLength,
    /// An internal consistency error of the local queue pair.
    LocalQpOperation,
    /// A local buffer was not usable (bad range or rights).
    LocalProtection,
    /// The request was not executed: the queue pair went to Error first.
    WrFlush,
    /// A memory window bind failed.
    MwBind,
    /// The peer sent an unexpected or malformed response.
    BadResponse,
    /// The peer refused access: bad rkey, out of bounds, or a missing right.
    RemoteAccess,
    /// The peer found the request invalid (no Recv posted, message too long, unsupported op).
    RemoteInvalidRequest,
    /// The peer failed to execute the request.
    RemoteOperation,
    /// The transport gave up: the connection broke (reset, closed) before the request finished.
    RetryExceeded,
    /// Anything else.
    General,
    /// An internal consistency error of the local end-to-end context (RD only;
    /// `IBV_WC_LOC_EEC_OP_ERR`).
    LocalEecOperation,
    /// A local access violation while the NIC read or wrote a local buffer
    /// (`IBV_WC_LOC_ACCESS_ERR`).
    LocalAccess,
    /// The peer kept answering "receiver not ready" (no Recv posted) past the retry count
    /// (`IBV_WC_RNR_RETRY_EXC_ERR`).
    RnrRetryExceeded,
    /// A reliable-datagram domain violation (RD only; `IBV_WC_LOC_RDD_VIOL_ERR`).
    LocalRddViolation,
    /// The peer refused an RDMA Read as invalid (`IBV_WC_REM_INV_RD_REQ_ERR`).
    RemoteInvalidReadRequest,
    /// The peer aborted the operation (`IBV_WC_REM_ABORT_ERR`).
    RemoteAbort,
    /// An invalid end-to-end context number (RD only; `IBV_WC_INV_EECN_ERR`).
    InvalidEecNumber,
    /// An invalid end-to-end context state (RD only; `IBV_WC_INV_EEC_STATE_ERR`).
    InvalidEecState,
    /// The device failed as a whole (`IBV_WC_FATAL_ERR`).
    Fatal,
    /// The response did not come in time (`IBV_WC_RESP_TIMEOUT_ERR`).
    ResponseTimeout,
    /// A tag-matching error (`IBV_WC_TM_ERR`).
    TagMatching,
    /// A tag-matching rendezvous did not complete (`IBV_WC_TM_RNDV_INCOMPLETE`).
    TagMatchingRendezvousIncomplete,
}

/// What a completion completes, as `ibv_wc_opcode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    /// Send, Send with Invalidate.
    Send,
    /// RDMA Write (also with immediate).
    RdmaWrite,
    /// RDMA Read.
    RdmaRead,
    /// Compare and swap.
    CompSwap,
    /// Fetch and add.
    FetchAdd,
    /// Atomic Write.
    AtomicWrite,
    /// Flush.
    Flush,
    /// A received Send.
    Recv,
    /// Received immediate data of a Write with immediate.
    RecvRdmaWithImm,
}

/// A work completion (`ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// What it was.
    pub opcode: WcOpcode,
    /// Bytes transferred: received (Recv), read (Read), or sent.
    pub byte_len: u32,
    /// Immediate data of a received Write with immediate.
    pub imm: Option<u32>,
    /// The local rkey a received Send with Invalidate invalidated.
    pub invalidated_rkey: Option<u32>,
    /// The received Send asked for a solicited event.
    pub solicited: bool,
    /// The queue pair it belongs to.
    pub qp_num: u32,
}

impl Completion {
    /// A placeholder to fill arrays for [`CompletionQueue::poll`](super::CompletionQueue::poll).
    pub const EMPTY: Completion = Completion {
        wr_id: 0,
        status: WcStatus::General,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm: None,
        invalidated_rkey: None,
        solicited: false,
        qp_num: 0,
    };

    /// Whether it succeeded.
    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success
    }
}

/// Which protection domain of which device an object belongs to: what every transport checks
/// before a queue pair uses a region (a verbs device refuses an lkey of another domain).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct DomainId {
    /// The device (`Context`) it was made on: ids are unique in the process.
    pub(crate) ctx: u32,
    /// The domain, unique on its device.
    pub(crate) pd: u32,
}

/// Queue sizes of a queue pair (`ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Most send requests outstanding (posted, not yet completed).
    pub max_send_wr: usize,
    /// Most receive requests outstanding.
    pub max_recv_wr: usize,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 256,
            max_recv_wr: 256,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags_combine_and_show() {
        let a = Access::LOCAL_WRITE | Access::REMOTE_READ;
        assert!(a.contains(Access::REMOTE_READ));
        assert!(!a.contains(Access::REMOTE_WRITE));
        assert!(!a.contains(Access::REMOTE_READ | Access::REMOTE_WRITE));
        assert_eq!(format!("{a:?}"), "Access(LOCAL_WRITE | REMOTE_READ)");
        assert!(Access::ALL_REMOTE.contains(Access::FLUSH_PERSISTENT | Access::REMOTE_ATOMIC));
        assert!(!Access::ALL_REMOTE.contains(Access::LOCAL_WRITE));
        assert!(Access::empty().is_empty());
    }
}
