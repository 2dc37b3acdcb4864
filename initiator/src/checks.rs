//! Argument checks against a namespace descriptor, made before anything is posted (bounds,
//! alignment, read-only, failed): shared by [`Namespace`](crate::Namespace), the queue and the
//! CLI (re-exported from [`namespace`](crate::namespace)).

use rpma_common::proto::NamespaceDescriptor;

use crate::error::{Error, Result};

/// `len` bytes at `offset` lie inside the namespace.
///
/// # Errors
/// [`Error::OutOfRange`].
pub fn check_range(d: &NamespaceDescriptor, offset: u64, len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= d.size => Ok(()),
        _ => Err(Error::OutOfRange {
            nsid: d.nsid,
            offset,
            len,
            size: d.size,
        }),
    }
}

/// The namespace takes writes (and durability requests).
///
/// # Errors
/// [`Error::ReadOnly`], [`Error::NamespaceFailed`].
pub fn check_writable(d: &NamespaceDescriptor) -> Result<()> {
    if d.read_only {
        return Err(Error::ReadOnly { nsid: d.nsid });
    }
    check_healthy(d)
}

/// The target has not failed the namespace.
///
/// # Errors
/// [`Error::NamespaceFailed`].
pub fn check_healthy(d: &NamespaceDescriptor) -> Result<()> {
    match &d.failure {
        Some(reason) => Err(Error::NamespaceFailed {
            nsid: d.nsid,
            reason: reason.clone(),
        }),
        None => Ok(()),
    }
}

/// The target serves the namespace on this connection (it has an rkey for it).
///
/// # Errors
/// [`Error::NamespaceUnavailable`].
pub fn check_reachable(d: &NamespaceDescriptor) -> Result<()> {
    match &d.unavailable {
        Some(reason) => Err(Error::NamespaceUnavailable {
            nsid: d.nsid,
            reason: reason.clone(),
        }),
        None => Ok(()),
    }
}

/// `value` (an offset or a length) is a multiple of `align`.
///
/// # Errors
/// [`Error::Misaligned`].
pub fn check_aligned(
    d: &NamespaceDescriptor,
    what: &'static str,
    value: u64,
    align: u64,
) -> Result<()> {
    if !value.is_multiple_of(align) {
        return Err(Error::Misaligned {
            nsid: d.nsid,
            what,
            value,
            align,
        });
    }
    Ok(())
}

/// An 8-byte atomic at `offset`: aligned, inside, writable.
///
/// # Errors
/// [`Error::Misaligned`], [`Error::OutOfRange`], [`Error::ReadOnly`].
pub fn check_atomic(d: &NamespaceDescriptor, offset: u64) -> Result<()> {
    check_aligned(d, "offset", offset, 8)?;
    check_range(d, offset, 8)?;
    check_writable(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpma_common::proto::{DurabilityMethods, PersistenceDomain};

    fn desc(read_only: bool) -> NamespaceDescriptor {
        NamespaceDescriptor {
            nsid: 2,
            size: 1 << 20,
            block_size: 512,
            remote_addr: 0x10000,
            rkey: 1,
            domain: PersistenceDomain::PageCache,
            durability: DurabilityMethods::GPSPM,
            atomic_write_unit: 8,
            read_only,
            failure: None,
            simulation: None,
            unavailable: None,
            identity: 1,
        }
    }

    #[test]
    fn an_unavailable_namespace_is_refused_with_the_targets_reason() {
        let mut d = desc(false);
        assert!(check_reachable(&d).is_ok());
        d.unavailable = Some("the target cannot register it on this transport: no ODP".into());
        let e = check_reachable(&d).unwrap_err();
        assert!(
            matches!(e, Error::NamespaceUnavailable { nsid: 2, .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("no ODP"), "{e}");
    }

    #[test]
    fn a_failed_namespace_takes_no_writes_and_says_why() {
        let mut d = desc(false);
        assert!(check_writable(&d).is_ok());
        d.failure = Some("fdatasync failed: Input/output error (os error 5)".into());
        let e = check_writable(&d).unwrap_err();
        assert!(matches!(e, Error::NamespaceFailed { nsid: 2, .. }), "{e:?}");
        let t = e.to_string();
        assert!(
            t.contains("FAILED") && t.contains("Input/output error"),
            "{t}"
        );
        assert!(
            check_range(&d, 0, 8).is_ok(),
            "reads are still checked as usual"
        );
    }

    #[test]
    fn ranges_are_checked_without_overflow() {
        let d = desc(false);
        assert!(check_range(&d, 0, 1 << 20).is_ok());
        assert!(check_range(&d, (1 << 20) - 1, 1).is_ok());
        assert!(check_range(&d, 1 << 20, 0).is_ok());
        let e = check_range(&d, 1 << 20, 1).unwrap_err();
        assert!(
            matches!(
                e,
                Error::OutOfRange {
                    nsid: 2,
                    offset: 1048576,
                    len: 1,
                    size: 1048576
                }
            ),
            "{e}"
        );
        assert!(check_range(&d, u64::MAX, 2).is_err());
        assert!(check_range(&d, 0, u64::MAX).is_err());
    }

    #[test]
    fn atomics_need_alignment_room_and_write_access() {
        let d = desc(false);
        assert!(check_atomic(&d, 8).is_ok());
        assert!(matches!(
            check_atomic(&d, 4),
            Err(Error::Misaligned {
                align: 8,
                value: 4,
                ..
            })
        ));
        assert!(matches!(
            check_atomic(&d, 1 << 20),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            check_atomic(&desc(true), 0),
            Err(Error::ReadOnly { nsid: 2 })
        ));
        assert!(check_writable(&desc(true))
            .unwrap_err()
            .to_string()
            .contains("read-only"));
    }

    #[test]
    fn block_alignment_names_the_field() {
        let d = desc(false);
        assert!(check_aligned(&d, "length", 1024, 512).is_ok());
        let e = check_aligned(&d, "length", 1000, 512).unwrap_err();
        assert_eq!(
            e.to_string(),
            "length 1000 is not a multiple of 512 on namespace 2"
        );
    }
}
