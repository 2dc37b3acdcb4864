//! What one protocol message can carry, checked against a configuration: a subsystem's
//! ConnectResponse lists every namespace of the subsystem, in one message of at most
//! [`MAX_MESSAGE_SIZE`] bytes. How long it is depends on values a connection sets (addresses,
//! rkeys, identities, failure texts), so a configuration is refused only when no host could
//! ever be admitted (the response over the limit with every such value at its narrowest), and
//! warned of when one may not be (at their widest; `rpma-target check-config`, the daemon's
//! log).

use rpma_common::proto::{
    ConnectResponse, DurabilityMethods, NamespaceDescriptor, PersistenceDomain, MAX_MESSAGE_SIZE,
};

use super::error::{invalid, Result};

/// A namespace as the check needs it: its nsid, its configured size (None: an existing file's),
/// its block size and the label of the power-loss simulation it runs under, if any.
pub(super) type Listed = (u32, Option<u64>, u32, Option<String>);

/// The largest write the target places atomically, as every descriptor says (serve::session).
const ATOMIC_WRITE_UNIT: u32 = 8;

/// Its descriptor with what a connection sets at its narrowest (`wide` false: nothing failed,
/// no rkey, address or identity bits) or at its widest (both texts present, cut to nothing as
/// [`ConnectResponse::fit`] cuts them at worst).
fn descriptor(ns: &Listed, wide: bool) -> NamespaceDescriptor {
    let (nsid, size, block_size, simulation) = ns.clone();
    let (big, text) = if wide {
        (u64::MAX, Some(String::new()))
    } else {
        (0, None)
    };
    NamespaceDescriptor {
        nsid,
        size: size.unwrap_or(big),
        block_size,
        remote_addr: big,
        rkey: big as u32,
        domain: PersistenceDomain::Volatile,
        durability: DurabilityMethods(big as u8),
        atomic_write_unit: ATOMIC_WRITE_UNIT,
        read_only: true,
        failure: text.clone(),
        simulation,
        unavailable: text,
        identity: big,
    }
}

/// The response's length listing the first `k` of `namespaces`.
fn len_of(namespaces: &[Listed], k: usize, wide: bool) -> usize {
    let big = if wide { u32::MAX } else { 0 };
    ConnectResponse {
        controller_id: big as u16,
        keep_alive_ms: big,
        namespaces: namespaces[..k]
            .iter()
            .map(|n| descriptor(n, wide))
            .collect(),
        queue_depth: big,
    }
    .encoded_len()
}

/// How many of `namespaces` (in order) fit: the length grows with each one.
fn most_that_fit(namespaces: &[Listed], wide: bool) -> usize {
    let (mut fit, mut over) = (0, namespaces.len() + 1);
    while over - fit > 1 {
        let mid = (fit + over) / 2;
        if len_of(namespaces, mid, wide) <= MAX_MESSAGE_SIZE {
            fit = mid;
        } else {
            over = mid;
        }
    }
    fit
}

/// Refuses (at `key`) a subsystem whose namespaces no ConnectResponse could list, whatever a
/// connection sets: no host could ever be admitted to it.
pub(super) fn refuse_if_never_fits(key: &str, namespaces: &[Listed]) -> Result<()> {
    let n = namespaces.len();
    let len = len_of(namespaces, n, false);
    if len <= MAX_MESSAGE_SIZE {
        return Ok(());
    }
    let most = most_that_fit(namespaces, false);
    Err(invalid(
        key,
        format!(
            "{n} namespaces: the message that lists them to a host (its ConnectResponse) takes \
             at least {len} bytes, and a message holds {MAX_MESSAGE_SIZE}: no host could \
             connect; the first {most} of them fit at best (split them between subsystems)"
        ),
    ))
}

/// A warning when the ConnectResponse of `nqn`'s namespaces may not fit with what a connection
/// sets at its widest (rkeys, addresses, identities, failures): a host may then be refused.
pub(super) fn warning_if_may_not_fit(nqn: &str, namespaces: &[Listed]) -> Option<String> {
    let n = namespaces.len();
    let len = len_of(namespaces, n, true);
    (len > MAX_MESSAGE_SIZE).then(|| {
        let most = most_that_fit(namespaces, true);
        format!(
            "subsystem {nqn}: the message that lists its {n} namespaces to a host (its \
             ConnectResponse) may take up to {len} bytes, and a message holds \
             {MAX_MESSAGE_SIZE}: a host may be refused (\"message of N bytes exceeds the \
             maximum\"); the first {most} of them always fit (split them between subsystems)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(n: u32) -> Vec<Listed> {
        (1..=n)
            .map(|nsid| (nsid, Some(1 << 30), 4096, None))
            .collect()
    }

    /// The count a message names after `after`.
    fn named(text: &str, after: &str) -> usize {
        text.split(after)
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{text}"))
    }

    #[test]
    fn a_subsystem_whose_namespaces_always_fit_is_taken_without_a_word() {
        refuse_if_never_fits("k", &plain(100)).unwrap();
        assert_eq!(warning_if_may_not_fit("s", &plain(100)), None);
    }

    #[test]
    fn a_subsystem_no_host_could_be_admitted_to_is_refused() {
        let e = refuse_if_never_fits("subsystem[0].namespace", &plain(1500))
            .unwrap_err()
            .to_string();
        assert!(e.contains("subsystem[0].namespace"), "{e}");
        assert!(e.contains("1500 namespaces"), "{e}");
        assert!(e.contains("split them between subsystems"), "{e}");
        // The count it names fits; one namespace more does not.
        let most = named(&e, "the first ") as u32;
        refuse_if_never_fits("k", &plain(most)).unwrap();
        assert!(refuse_if_never_fits("k", &plain(most + 1)).is_err());
    }

    /// Between the two: taken (hosts were admitted to such subsystems before the check, with
    /// what their connections set), and warned of.
    #[test]
    fn a_subsystem_a_host_may_be_refused_from_is_taken_with_a_warning() {
        refuse_if_never_fits("k", &plain(250)).unwrap();
        let w = warning_if_may_not_fit("s", &plain(250)).expect("a warning");
        assert!(
            w.contains("subsystem s") && w.contains("250 namespaces"),
            "{w}"
        );
        let most = named(&w, "the first ") as u32;
        assert!((100..250).contains(&most), "{w}");
        assert_eq!(warning_if_may_not_fit("s", &plain(most)), None);
        assert!(warning_if_may_not_fit("s", &plain(most + 1)).is_some());
    }
}
