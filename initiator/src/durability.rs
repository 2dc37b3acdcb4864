//! Durability methods and the choice of one per namespace.
//!
//! The target lists in each namespace descriptor the methods that can make that namespace
//! durable on this connection (`docs/control-plane.md`, "Durability methods offered"). The
//! initiator takes the best of them, in the order [`preference`] gives for the namespace's
//! domain, unless the caller forces one; a forced method the descriptor does not list is an error
//! ([`Error::MethodNotValid`]), never a silent downgrade. A namespace that lists none
//! (volatile) gets [`Choice::VisibleOnly`]: durable calls succeed and say so in their
//! [`Durability`] outcome.

use std::fmt;
use std::str::FromStr;

use rpma_common::proto::{DurabilityMethods, NamespaceDescriptor, PersistenceDomain};

use crate::error::{Error, Result};
pub use crate::method::PersistMethod;

/// The order in which the initiator picks a method the target offers on a `dax` (or
/// `dax (forced)`) namespace: FLUSH names the range and the persistence type explicitly and
/// costs one round trip in the transport; APM is also one round trip in the transport but
/// persists everything placed on the queue pair, and is valid only where the target says writes
/// reach persistence before a Read answer; GPSPM takes a Send/Receive pair through the target's
/// control path and a receive slot of the queue depth. On dax the persist behind FLUSH and APM
/// is a cache write-back (well under a microsecond per 4 KiB), cheap enough to run inline.
pub const PREFERENCE_DAX: [PersistMethod; 3] = [
    PersistMethod::Flush,
    PersistMethod::Apm,
    PersistMethod::Gpspm,
];

/// The order on a `page-cache` namespace: GPSPM first. The target answers a FlushRequest from
/// its flush service, which submits the msync/fdatasync through io_uring and never blocks its
/// poll loop; FLUSH and APM make the target's placement engine msync inline, in the poll loop,
/// before it answers (about 150 us per 4 KiB, milliseconds per MiB), stalling every other
/// connection of that loop meanwhile (docs/fabric.md, "The persist runs in the poll loop").
pub const PREFERENCE_PAGE_CACHE: [PersistMethod; 3] = [
    PersistMethod::Gpspm,
    PersistMethod::Flush,
    PersistMethod::Apm,
];

/// The order in which methods are tried on a namespace of `domain` (docs/initiator.md,
/// "Durability"): [`PREFERENCE_PAGE_CACHE`] on `page-cache`, [`PREFERENCE_DAX`] otherwise (a
/// volatile namespace gets no method whatever the order).
pub fn preference(domain: PersistenceDomain) -> [PersistMethod; 3] {
    match domain {
        PersistenceDomain::PageCache => PREFERENCE_PAGE_CACHE,
        _ => PREFERENCE_DAX,
    }
}

impl FromStr for PersistMethod {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "apm" => Ok(PersistMethod::Apm),
            "gpspm" => Ok(PersistMethod::Gpspm),
            "flush" => Ok(PersistMethod::Flush),
            _ => Err(Error::InvalidArgument(format!(
                "{s:?} is not a durability method (apm, gpspm, flush)"
            ))),
        }
    }
}

/// What a durable call achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Durability {
    /// The bytes are durable: the target acknowledged them with this method.
    Durable(PersistMethod),
    /// The namespace is volatile: the bytes are visible to readers of the target, and nothing
    /// survives a target restart.
    VisibleOnly,
}

impl Durability {
    /// Whether the bytes are durable.
    pub fn is_durable(self) -> bool {
        matches!(self, Durability::Durable(_))
    }
}

impl fmt::Display for Durability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Durability::Durable(m) => write!(f, "durable ({m})"),
            Durability::VisibleOnly => f.write_str("visible only (volatile namespace)"),
        }
    }
}

/// How durable calls on one namespace are carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Choice {
    /// With this method.
    Method(PersistMethod),
    /// The namespace cannot be made durable: an 8-byte Read orders earlier Writes (they are
    /// placed, so visible), and the outcome says "visible only".
    VisibleOnly,
}

/// What the target offers for `d`, as text ("APM GPSPM", "nothing (visible only)").
pub fn offered(d: &NamespaceDescriptor) -> String {
    let names = d.durability.names();
    if names.is_empty() {
        "nothing (visible only)".to_owned()
    } else {
        names.join(" ")
    }
}

/// Chooses the method for namespace `d`: `forced` if given (and valid), else the first of
/// [`preference`]`(d.domain)` the descriptor lists; FLUSH also needs the peer to have advertised
/// the Flush opcode (`peer_flush`).
///
/// # Errors
/// [`Error::MethodNotValid`] when `forced` is not offered for `d` (including any forced method
/// on a volatile namespace: nothing makes it durable).
pub fn choose(
    d: &NamespaceDescriptor,
    peer_flush: bool,
    forced: Option<PersistMethod>,
) -> Result<Choice> {
    choose_method(d, peer_flush, forced).map_err(Error::from)
}

/// A forced method the target does not offer for a namespace: what [`choose`] refuses with,
/// as a value a queue keeps per namespace and turns into [`Error::MethodNotValid`] on each
/// durable call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MethodNotValid {
    nsid: u32,
    method: PersistMethod,
    domain: PersistenceDomain,
    offered: String,
}

impl From<MethodNotValid> for Error {
    fn from(m: MethodNotValid) -> Error {
        Error::MethodNotValid {
            nsid: m.nsid,
            method: m.method,
            domain: m.domain,
            offered: m.offered,
        }
    }
}

/// [`choose`], with its one refusal typed.
pub(crate) fn choose_method(
    d: &NamespaceDescriptor,
    peer_flush: bool,
    forced: Option<PersistMethod>,
) -> std::result::Result<Choice, MethodNotValid> {
    let usable = |m: PersistMethod| {
        d.durability.contains(m.bit())
            && (m != PersistMethod::Flush || peer_flush)
            && d.domain != PersistenceDomain::Volatile
    };
    if let Some(m) = forced {
        if usable(m) {
            return Ok(Choice::Method(m));
        }
        return Err(MethodNotValid {
            nsid: d.nsid,
            method: m,
            domain: d.domain,
            offered: offered(d),
        });
    }
    Ok(preference(d.domain)
        .into_iter()
        .find(|&m| usable(m))
        .map_or(Choice::VisibleOnly, Choice::Method))
}

/// Chooses the method that makes a named range of `d` durable whoever wrote it (docs/initiator.md,
/// "Which writes a method covers"): as [`choose`], but never APM, whose Read makes durable only
/// the Writes of its own queue pair. Where the automatic choice was APM the next method offered
/// is taken.
///
/// # Errors
/// [`Error::ApmNotForRanges`] when APM is forced, or is the only method offered;
/// [`Error::MethodNotValid`] as [`choose`].
pub fn choose_for_range(
    d: &NamespaceDescriptor,
    peer_flush: bool,
    forced: Option<PersistMethod>,
) -> Result<Choice> {
    let apm_refused = || Error::ApmNotForRanges {
        nsid: d.nsid,
        offered: offered(d),
    };
    if forced == Some(PersistMethod::Apm) {
        // Checked after the method's validity, so that an APM the target does not offer says so.
        choose(d, peer_flush, forced)?;
        return Err(apm_refused());
    }
    let mut without_apm = d.clone();
    without_apm.durability = DurabilityMethods(d.durability.0 & !DurabilityMethods::APM.0);
    match choose(&without_apm, peer_flush, forced)? {
        Choice::VisibleOnly if d.domain != PersistenceDomain::Volatile => Err(apm_refused()),
        c => Ok(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(domain: PersistenceDomain, methods: DurabilityMethods) -> NamespaceDescriptor {
        NamespaceDescriptor {
            nsid: 1,
            size: 1 << 20,
            block_size: 4096,
            remote_addr: 0x1000,
            rkey: 7,
            domain,
            durability: methods,
            atomic_write_unit: 8,
            read_only: false,
            failure: None,
            simulation: None,
            unavailable: None,
            identity: 1,
        }
    }

    const ALL: DurabilityMethods = DurabilityMethods(7);

    #[test]
    fn a_refused_forced_method_is_kept_typed_with_its_context() {
        let d = desc(PersistenceDomain::Dax, DurabilityMethods::GPSPM);
        // What a queue keeps per namespace: the refusal itself, not its text.
        let kept = choose_method(&d, true, Some(PersistMethod::Apm)).unwrap_err();
        assert_eq!(
            kept,
            MethodNotValid {
                nsid: 1,
                method: PersistMethod::Apm,
                domain: PersistenceDomain::Dax,
                offered: offered(&d),
            }
        );
        // Each durable call gets the same error as choose gives.
        for e in [Error::from(kept.clone()), Error::from(kept)] {
            assert!(
                matches!(
                    &e,
                    Error::MethodNotValid {
                        nsid: 1,
                        method: PersistMethod::Apm,
                        domain: PersistenceDomain::Dax,
                        offered,
                    } if *offered == self::offered(&d)
                ),
                "{e:?}"
            );
        }
        let direct = choose(&d, true, Some(PersistMethod::Apm)).unwrap_err();
        assert!(matches!(direct, Error::MethodNotValid { .. }), "{direct:?}");
    }

    #[test]
    fn best_offered_method_wins() {
        for domain in [PersistenceDomain::Dax, PersistenceDomain::DaxForced] {
            let d = desc(domain, ALL);
            assert_eq!(
                choose(&d, true, None).unwrap(),
                Choice::Method(PersistMethod::Flush)
            );
            // A peer without the Flush opcode: APM next.
            assert_eq!(
                choose(&d, false, None).unwrap(),
                Choice::Method(PersistMethod::Apm)
            );
            // Only GPSPM offered (rdma without direct_write_to_pmem).
            let d = desc(domain, DurabilityMethods::GPSPM);
            assert_eq!(
                choose(&d, true, None).unwrap(),
                Choice::Method(PersistMethod::Gpspm)
            );
        }
    }

    #[test]
    fn page_cache_prefers_gpspm_which_keeps_msync_off_the_poll_loop() {
        let d = desc(PersistenceDomain::PageCache, ALL);
        assert_eq!(
            choose(&d, true, None).unwrap(),
            Choice::Method(PersistMethod::Gpspm)
        );
        // Without GPSPM on offer: FLUSH, then APM.
        let no_gpspm = DurabilityMethods(ALL.0 & !DurabilityMethods::GPSPM.0);
        let d = desc(PersistenceDomain::PageCache, no_gpspm);
        assert_eq!(
            choose(&d, true, None).unwrap(),
            Choice::Method(PersistMethod::Flush)
        );
        assert_eq!(
            choose(&d, false, None).unwrap(),
            Choice::Method(PersistMethod::Apm)
        );
        // A forced method still wins over the order.
        let d = desc(PersistenceDomain::PageCache, ALL);
        assert_eq!(
            choose(&d, true, Some(PersistMethod::Apm)).unwrap(),
            Choice::Method(PersistMethod::Apm)
        );
        assert_eq!(
            preference(PersistenceDomain::PageCache)[0],
            PersistMethod::Gpspm
        );
        assert_eq!(preference(PersistenceDomain::Dax)[0], PersistMethod::Flush);
        assert_eq!(preference(PersistenceDomain::DaxForced), PREFERENCE_DAX);
    }

    #[test]
    fn volatile_is_visible_only_and_refuses_every_forced_method() {
        let d = desc(PersistenceDomain::Volatile, DurabilityMethods::NONE);
        assert_eq!(choose(&d, true, None).unwrap(), Choice::VisibleOnly);
        for m in PREFERENCE_DAX {
            let e = choose(&d, true, Some(m)).unwrap_err();
            assert!(
                matches!(e, Error::MethodNotValid { method, .. } if method == m),
                "{e}"
            );
            assert!(e.to_string().contains("visible only"), "{e}");
        }
        // Even a descriptor that (wrongly) lists methods on a volatile namespace.
        let d = desc(PersistenceDomain::Volatile, ALL);
        assert_eq!(choose(&d, true, None).unwrap(), Choice::VisibleOnly);
    }

    #[test]
    fn forced_method_is_used_or_refused_never_downgraded() {
        let d = desc(PersistenceDomain::DaxForced, DurabilityMethods::GPSPM);
        assert_eq!(
            choose(&d, true, Some(PersistMethod::Gpspm)).unwrap(),
            Choice::Method(PersistMethod::Gpspm)
        );
        let e = choose(&d, true, Some(PersistMethod::Apm)).unwrap_err();
        assert!(matches!(e, Error::MethodNotValid { .. }), "{e}");
        let d = desc(PersistenceDomain::Dax, ALL);
        assert!(choose(&d, false, Some(PersistMethod::Flush)).is_err());
        assert_eq!(
            choose(&d, true, Some(PersistMethod::Apm)).unwrap(),
            Choice::Method(PersistMethod::Apm)
        );
    }

    #[test]
    fn a_range_is_never_vouched_for_by_apm() {
        // Automatic: APM's place goes to the next method offered.
        let d = desc(PersistenceDomain::Dax, ALL);
        assert_eq!(
            choose(&d, false, None).unwrap(),
            Choice::Method(PersistMethod::Apm),
            "for its own writes APM is fine"
        );
        assert_eq!(
            choose_for_range(&d, false, None).unwrap(),
            Choice::Method(PersistMethod::Gpspm)
        );
        assert_eq!(
            choose_for_range(&d, true, None).unwrap(),
            Choice::Method(PersistMethod::Flush)
        );
        // Forced APM, or APM the only method: refused, saying what to use instead.
        for (methods, forced) in [
            (ALL, Some(PersistMethod::Apm)),
            (DurabilityMethods::APM, None),
        ] {
            let d = desc(PersistenceDomain::PageCache, methods);
            let e = choose_for_range(&d, true, forced).unwrap_err();
            assert!(matches!(e, Error::ApmNotForRanges { nsid: 1, .. }), "{e:?}");
            assert!(e.to_string().contains("--persist gpspm or flush"), "{e}");
        }
        // A forced APM that is not offered at all: that error first.
        let d = desc(PersistenceDomain::PageCache, DurabilityMethods::GPSPM);
        let e = choose_for_range(&d, true, Some(PersistMethod::Apm)).unwrap_err();
        assert!(matches!(e, Error::MethodNotValid { .. }), "{e:?}");
        // Volatile: visible only, as for any durable call.
        let d = desc(PersistenceDomain::Volatile, DurabilityMethods::NONE);
        assert_eq!(
            choose_for_range(&d, true, None).unwrap(),
            Choice::VisibleOnly
        );
    }

    #[test]
    fn names_parse_both_ways() {
        for m in PREFERENCE_DAX {
            assert_eq!(m.name().parse::<PersistMethod>().unwrap(), m);
            assert_eq!(m.to_string().parse::<PersistMethod>().unwrap(), m);
        }
        assert!("fsync".parse::<PersistMethod>().is_err());
        assert_eq!(
            Durability::Durable(PersistMethod::Apm).to_string(),
            "durable (APM)"
        );
        assert!(!Durability::VisibleOnly.is_durable());
    }
}
