//! Status mapping: the Terminate cause a refused access calls for, and the completion status
//! a received Terminate gives the request it ends.

use super::device::{AccessFault, InvalidateFault};
use super::wire::{Layer, TermCause};
use crate::fabric::counters::TerminateCause;
use crate::fabric::types::WcStatus;

/// The Terminate cause for a refused tagged access (a Write or a Read Response's target).
pub(crate) fn tagged_cause(f: AccessFault) -> TermCause {
    match f {
        AccessFault::InvalidStag => TermCause::DDP_TAGGED_INVALID_STAG,
        AccessFault::NotAssociated => TermCause::DDP_TAGGED_STAG_NOT_ASSOCIATED,
        AccessFault::BaseBounds => TermCause::DDP_TAGGED_BASE_BOUNDS,
        AccessFault::Rights => TermCause::RDMAP_ACCESS_RIGHTS,
    }
}

/// The Terminate cause for a refused access named in a control message (Read source, atomic,
/// Flush, Atomic Write): RDMAP remote protection errors.
pub(crate) fn rdmap_cause(f: AccessFault) -> TermCause {
    match f {
        AccessFault::InvalidStag => TermCause::RDMAP_INVALID_STAG,
        AccessFault::NotAssociated => TermCause::RDMAP_STAG_NOT_ASSOCIATED,
        AccessFault::BaseBounds => TermCause::RDMAP_BASE_BOUNDS,
        AccessFault::Rights => TermCause::RDMAP_ACCESS_RIGHTS,
    }
}

/// The Terminate cause for a refused Send with Invalidate (RFC 5040 §7.2 has "STag cannot be
/// invalidated" under both error types): an STag of another protection domain, or a window
/// bound to another queue pair, is a Remote Protection Error; an unknown STag, or a region's
/// (only windows can be invalidated remotely), a Remote Operation Error.
pub(crate) fn invalidate_cause(f: InvalidateFault) -> TermCause {
    match f {
        InvalidateFault::NotAssociated => TermCause::RDMAP_PROTECTION_CANNOT_INVALIDATE,
        InvalidateFault::InvalidStag | InvalidateFault::NotAWindow => {
            TermCause::RDMAP_CANNOT_INVALIDATE
        }
    }
}

/// The status a requester reports for the request a received Terminate ended.
pub(crate) fn status_for(cause: TermCause) -> WcStatus {
    match (cause.layer, cause.etype) {
        (Layer::Rdmap, 1) | (Layer::Ddp, 1) => WcStatus::RemoteAccess,
        (Layer::Ddp, 2) => WcStatus::RemoteInvalidRequest,
        (Layer::Rdmap, 2) if cause == TermCause::RDMAP_UNEXPECTED_OPCODE => {
            WcStatus::RemoteInvalidRequest
        }
        _ => WcStatus::RemoteOperation,
    }
}

/// The class a sent Terminate is counted under; `persist`: it reports a failed persist.
pub(crate) fn terminate_cause(cause: TermCause, persist: bool) -> TerminateCause {
    if persist {
        return TerminateCause::Persist;
    }
    if cause == TermCause::MPA_CRC {
        return TerminateCause::Crc;
    }
    match status_for(cause) {
        WcStatus::RemoteAccess => TerminateCause::Access,
        WcStatus::RemoteInvalidRequest => TerminateCause::InvalidRequest,
        _ => TerminateCause::Operation,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminates_are_counted_by_the_class_the_requester_sees() {
        let c = |cause| terminate_cause(cause, false);
        assert_eq!(
            c(TermCause::DDP_TAGGED_INVALID_STAG),
            TerminateCause::Access
        );
        assert_eq!(c(TermCause::RDMAP_BASE_BOUNDS), TerminateCause::Access);
        assert_eq!(
            c(TermCause::DDP_UNTAGGED_NO_BUFFER),
            TerminateCause::InvalidRequest
        );
        assert_eq!(
            c(TermCause::RDMAP_UNEXPECTED_OPCODE),
            TerminateCause::InvalidRequest
        );
        assert_eq!(
            c(TermCause::RDMAP_CATASTROPHIC_STREAM),
            TerminateCause::Operation
        );
        assert_eq!(c(TermCause::MPA_LENGTH_MISMATCH), TerminateCause::Operation);
        assert_eq!(c(TermCause::MPA_CRC), TerminateCause::Crc);
        assert_eq!(
            terminate_cause(TermCause::RDMAP_CATASTROPHIC_STREAM, true),
            TerminateCause::Persist
        );
    }

    #[test]
    fn terminate_causes_map_to_statuses() {
        assert_eq!(
            status_for(tagged_cause(AccessFault::InvalidStag)),
            WcStatus::RemoteAccess
        );
        assert_eq!(
            status_for(tagged_cause(AccessFault::BaseBounds)),
            WcStatus::RemoteAccess
        );
        assert_eq!(
            status_for(rdmap_cause(AccessFault::Rights)),
            WcStatus::RemoteAccess
        );
        assert_eq!(
            status_for(TermCause::DDP_UNTAGGED_NO_BUFFER),
            WcStatus::RemoteInvalidRequest
        );
        assert_eq!(
            status_for(TermCause::DDP_UNTAGGED_MSN_RANGE),
            WcStatus::RemoteInvalidRequest
        );
        assert_eq!(
            status_for(TermCause::RDMAP_UNEXPECTED_OPCODE),
            WcStatus::RemoteInvalidRequest
        );
        assert_eq!(
            status_for(TermCause::RDMAP_CATASTROPHIC_STREAM),
            WcStatus::RemoteOperation
        );
        assert_eq!(status_for(TermCause::MPA_CRC), WcStatus::RemoteOperation);
        assert_eq!(
            status_for(invalidate_cause(InvalidateFault::NotAssociated)),
            WcStatus::RemoteAccess
        );
        assert_eq!(
            status_for(invalidate_cause(InvalidateFault::InvalidStag)),
            WcStatus::RemoteOperation
        );
        assert_eq!(
            status_for(invalidate_cause(InvalidateFault::NotAWindow)),
            WcStatus::RemoteOperation
        );
    }
}
