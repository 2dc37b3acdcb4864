//! The discovery log page (NVMe over Fabrics 1.1, Get Log Page 70h on a discovery controller):
//! one entry per subsystem a host may connect to and `nvme-tcp://` listener, and one per
//! listener for the discovery subsystem itself (as Linux's nvmet lists it, so that
//! `nvme discover` shows where discovery is served).
//!
//! Who sees what is the native discovery's rule ([`crate::subsystem::visible_to`]): a subsystem
//! that lists the host (without a key) or allows any host. Hosts listed with a key are refused
//! at their Connect on `nvme-tcp://` listeners (no DH-HMAC-CHAP here), so no subsystem is shown
//! to them by key. A listener on a wildcard address is listed with the local address the
//! discovery connection arrived on, as in the native discovery.

use std::net::{IpAddr, SocketAddr};

use rpma_common::proto::nqn::{Nqn, DISCOVERY_NQN};

use super::identify::put_str;
use crate::config::{Config, ListenUrl};
use crate::subsystem::{advertised, visible_to};

/// Bytes of the log page header and of each entry.
pub const RECORD_LEN: usize = 1024;
/// TRTYPE of TCP.
const TRTYPE_TCP: u8 = 3;
/// SUBTYPE: the current discovery subsystem.
pub const SUBTYPE_DISCOVERY: u8 = 3;
/// SUBTYPE: an NVM subsystem.
pub const SUBTYPE_NVME: u8 = 2;
/// TREQ: secure channel not specified; SQ flow control may be disabled (as nvmet says).
const TREQ: u8 = 1 << 2;
/// ASQSZ: the largest admin submission queue (the Linux host uses 32).
const ASQSZ: u16 = 32;

/// One entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// [`SUBTYPE_NVME`] or [`SUBTYPE_DISCOVERY`].
    pub subtype: u8,
    /// The listener's port id (its place among the `nvme-tcp://` listeners, from 1).
    pub portid: u16,
    /// The address hosts connect to.
    pub traddr: String,
    /// The TCP port, as text.
    pub trsvcid: String,
    /// The subsystem.
    pub subnqn: String,
}

fn adrfam(traddr: &str) -> u8 {
    match traddr.parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => 2,
        _ => 1,
    }
}

/// The entries `host` sees, for the `nvme-tcp://` listeners of `cfg`, the discovery connection
/// having arrived on `local`.
pub fn entries(cfg: &Config, host: &Nqn, local: Option<SocketAddr>) -> Vec<Entry> {
    let ports: Vec<(u16, ListenUrl)> = cfg
        .listeners
        .iter()
        .filter(|l| !l.url.transport.is_fabric())
        .enumerate()
        .map(|(i, l)| (i as u16 + 1, advertised(&l.url, local)))
        .collect();
    let mut out = Vec::new();
    let mut add = |subtype, subnqn: &str| {
        for (portid, url) in &ports {
            out.push(Entry {
                subtype,
                portid: *portid,
                traddr: url.host.clone(),
                trsvcid: url.port.to_string(),
                subnqn: subnqn.to_owned(),
            });
        }
    };
    if cfg.discovery {
        add(SUBTYPE_DISCOVERY, DISCOVERY_NQN);
    }
    for s in cfg.subsystems.iter().filter(|s| visible_to(s, host, None)) {
        add(SUBTYPE_NVME, s.nqn.as_str());
    }
    out
}

/// The log page: its header (generation counter `genctr`, number of records) and `entries`.
pub fn log_page(genctr: u64, entries: &[Entry]) -> Vec<u8> {
    let mut b = vec![0u8; RECORD_LEN * (1 + entries.len())];
    b[0..8].copy_from_slice(&genctr.to_le_bytes());
    b[8..16].copy_from_slice(&(entries.len() as u64).to_le_bytes());
    // RECFMT 0.
    for (i, e) in entries.iter().enumerate() {
        let r = &mut b[RECORD_LEN * (i + 1)..RECORD_LEN * (i + 2)];
        r[0] = TRTYPE_TCP;
        r[1] = adrfam(&e.traddr);
        r[2] = e.subtype;
        r[3] = TREQ;
        r[4..6].copy_from_slice(&e.portid.to_le_bytes());
        r[6..8].copy_from_slice(&0xffffu16.to_le_bytes()); // dynamic controllers
        r[8..10].copy_from_slice(&ASQSZ.to_le_bytes());
        put_str(r, 32, 32, &e.trsvcid);
        put_str(r, 256, 256, &e.subnqn);
        put_str(r, 512, 256, &e.traddr);
        // TSAS: SECTYPE 0, no security.
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(text: &str) -> Config {
        let d = tempfile::tempdir().unwrap();
        Config::from_toml(text, d.path()).unwrap()
    }

    const TEXT: &str = r#"
listen = ["tcp://127.0.0.1:7420", "nvme-tcp://0.0.0.0:4420", "nvme-tcp://[::1]:8009"]
[[subsystem]]
nqn = "nqn.2026-11.io.rpma:open"
allow_any_host = true
[[subsystem]]
nqn = "nqn.2026-11.io.rpma:closed"
hosts = [{ nqn = "nqn.2026-11.io.rpma:h1" }]
"#;

    #[test]
    fn a_host_sees_the_discovery_subsystem_and_what_it_may_reach_on_each_port() {
        let c = cfg(TEXT);
        let local: SocketAddr = "192.0.2.5:4420".parse().unwrap();
        let stranger = Nqn::new("nqn.2026-11.io.rpma:h9").unwrap();
        let e = entries(&c, &stranger, Some(local));
        let got: Vec<(u8, u16, &str, &str, &str)> = e
            .iter()
            .map(|e| {
                (
                    e.subtype,
                    e.portid,
                    e.traddr.as_str(),
                    e.trsvcid.as_str(),
                    e.subnqn.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (3, 1, "192.0.2.5", "4420", DISCOVERY_NQN),
                (3, 2, "::1", "8009", DISCOVERY_NQN),
                (2, 1, "192.0.2.5", "4420", "nqn.2026-11.io.rpma:open"),
                (2, 2, "::1", "8009", "nqn.2026-11.io.rpma:open"),
            ],
            "the wildcard listener shows the address the host reached; tcp:// is not listed"
        );
        let listed = Nqn::new("nqn.2026-11.io.rpma:h1").unwrap();
        assert_eq!(
            entries(&c, &listed, None).len(),
            6,
            "it sees the closed one too"
        );
        let off = cfg(&TEXT.replace("listen =", "discovery = false\nlisten ="));
        assert!(entries(&off, &listed, None)
            .iter()
            .all(|e| e.subtype == SUBTYPE_NVME));
    }

    #[test]
    fn the_log_page_has_its_records_where_nvme_cli_reads_them() {
        let e = [Entry {
            subtype: SUBTYPE_NVME,
            portid: 2,
            traddr: "::1".into(),
            trsvcid: "4420".into(),
            subnqn: "nqn.2026-11.io.rpma:open".into(),
        }];
        let b = log_page(7, &e);
        assert_eq!(b.len(), 2048);
        assert_eq!(u64::from_le_bytes(b[0..8].try_into().unwrap()), 7);
        assert_eq!(u64::from_le_bytes(b[8..16].try_into().unwrap()), 1);
        let r = &b[1024..];
        assert_eq!((r[0], r[1], r[2], r[3]), (3, 2, 2, TREQ));
        assert_eq!(u16::from_le_bytes([r[4], r[5]]), 2);
        assert_eq!(u16::from_le_bytes([r[6], r[7]]), 0xffff);
        assert_eq!(&r[32..37], b"4420\0");
        assert_eq!(&r[256..280], b"nqn.2026-11.io.rpma:open");
        assert_eq!(&r[512..516], b"::1\0");
        assert_eq!(r[768], 0, "no security");
        assert_eq!(log_page(1, &[]).len(), 1024);
    }
}
