//! What one protocol message can carry, checked against a configuration: a subsystem's
//! ConnectResponse lists every namespace of the subsystem, in one message of at most
//! [`MAX_MESSAGE_SIZE`] bytes. A subsystem with more namespaces than that holds would be
//! accepted and then refuse every host ("message of N bytes exceeds the maximum").

use rpma_common::proto::{
    ConnectResponse, DurabilityMethods, NamespaceDescriptor, PersistenceDomain, MAX_MESSAGE_SIZE,
};

use super::error::{invalid, Result};

/// Refuses (at `key`) a subsystem whose namespaces, given as (nsid, block size, the label of
/// the power-loss simulation it runs under), one ConnectResponse could not list: every field a
/// connection sets at its widest, each namespace failed and unavailable with its texts cut to
/// nothing (as [`ConnectResponse::fit`] cuts them at worst).
pub(super) fn connect_response_fits(
    key: &str,
    namespaces: impl Iterator<Item = (u32, u32, Option<String>)>,
) -> Result<()> {
    let widest = |namespaces| ConnectResponse {
        controller_id: u16::MAX,
        keep_alive_ms: u32::MAX,
        namespaces,
        queue_depth: u32::MAX,
    };
    let listed: Vec<NamespaceDescriptor> = namespaces
        .map(|(nsid, block_size, simulation)| NamespaceDescriptor {
            nsid,
            size: u64::MAX,
            block_size,
            remote_addr: u64::MAX,
            rkey: u32::MAX,
            domain: PersistenceDomain::Volatile,
            durability: DurabilityMethods(u8::MAX),
            atomic_write_unit: u32::MAX,
            read_only: true,
            failure: Some(String::new()),
            simulation,
            unavailable: Some(String::new()),
            identity: u64::MAX,
        })
        .collect();
    let n = listed.len();
    let len_of = |k: usize| widest(listed[..k].to_vec()).encoded_len();
    let len = len_of(n);
    if len <= MAX_MESSAGE_SIZE {
        return Ok(());
    }
    // The most of them (in nsid order) that fit: the length grows with each one.
    let (mut fit, mut over) = (0, n);
    while over - fit > 1 {
        let mid = (fit + over) / 2;
        if len_of(mid) <= MAX_MESSAGE_SIZE {
            fit = mid;
        } else {
            over = mid;
        }
    }
    let most = fit;
    Err(invalid(
        key,
        format!(
            "{n} namespaces: the message that lists them to a host (its ConnectResponse) may \
             take {len} bytes, and a message holds {MAX_MESSAGE_SIZE}: no host could connect; \
             the first {most} of them would fit (split them between subsystems)"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(n: u32) -> impl Iterator<Item = (u32, u32, Option<String>)> {
        (1..=n).map(|nsid| (nsid, 4096, None))
    }

    #[test]
    fn a_subsystem_whose_namespaces_fit_is_taken() {
        connect_response_fits("k", plain(100)).unwrap();
    }

    #[test]
    fn a_subsystem_with_more_namespaces_than_a_message_holds_is_refused() {
        let e = connect_response_fits("subsystem[0].namespace", plain(1500))
            .unwrap_err()
            .to_string();
        assert!(e.contains("subsystem[0].namespace"), "{e}");
        assert!(e.contains("1500 namespaces"), "{e}");
        assert!(e.contains("split them between subsystems"), "{e}");
        // The count it names fits; one namespace more does not.
        let most: u32 = e
            .split("the first ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{e}"));
        connect_response_fits("k", plain(most)).unwrap();
        assert!(connect_response_fits("k", plain(most + 1)).is_err());
        // (159 with nsids 1.., docs/operations.md.)
        assert!((100..400).contains(&most), "{most}");
    }
}
