//! Access decisions for a Connect: which subsystem, whether the host is allowed, whether it must
//! authenticate; and the discovery listing. Pure functions over the configuration, so that the
//! session code (wired onto the fabric by the lead) only moves messages.

use rpma_common::proto::auth::{AuthContext, Psk};
use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::{
    Connect, DiscoveryEntry, DiscoveryResponse, ListingEntry, Message, Refusal, RefusalReason,
    MAX_MESSAGE_SIZE,
};

use std::net::{IpAddr, SocketAddr};

use crate::config::{Config, ListenUrl, Subsystem};

/// What to do with a Connect.
#[derive(Debug)]
#[non_exhaustive]
pub enum Admission<'a> {
    /// Refuse with this message (log it once with the host NQN and the peer).
    Refuse(Refusal),
    /// A discovery connection: answer DiscoveryRequests.
    Discovery,
    /// The host must prove the key first (start a [`rpma_common::proto::auth::TargetAuth`]).
    Authenticate {
        /// The subsystem.
        subsystem: &'a Subsystem,
        /// The host's key.
        psk: Psk,
        /// What the proofs are bound to.
        ctx: AuthContext,
    },
    /// A discovery connection of a host that has a key: it must prove it first (start a
    /// [`rpma_common::proto::auth::TargetAuth`]); the listing then shows the subsystems that
    /// need that key ([`discovery`]).
    DiscoveryAuthenticate {
        /// The host's key: the first one the configuration lists for it.
        psk: Psk,
        /// What the proofs are bound to (the discovery NQN).
        ctx: AuthContext,
    },
    /// Admit without authentication.
    Accept {
        /// The subsystem.
        subsystem: &'a Subsystem,
    },
}

fn refuse(reason: RefusalReason, message: String) -> Admission<'static> {
    Admission::Refuse(Refusal { reason, message })
}

/// Decides on a Connect.
///
/// A host listed with a key must authenticate even when `allow_any_host` is set; a host that is
/// not listed gets in only with `allow_any_host`.
pub fn admit<'a>(cfg: &'a Config, c: &Connect) -> Admission<'a> {
    if c.subsystem_nqn.is_discovery() {
        return if cfg.discovery {
            match host_key(cfg, &c.host_nqn) {
                Some(psk) => Admission::DiscoveryAuthenticate {
                    psk: psk.clone(),
                    ctx: AuthContext {
                        host_nqn: c.host_nqn.clone(),
                        subsystem_nqn: c.subsystem_nqn.clone(),
                        host_id: c.host_id,
                    },
                },
                None => Admission::Discovery,
            }
        } else {
            refuse(
                RefusalReason::UnknownSubsystem,
                "discovery is disabled on this target".into(),
            )
        };
    }
    let Some(subsystem) = cfg.subsystems.iter().find(|s| s.nqn == c.subsystem_nqn) else {
        return refuse(
            RefusalReason::UnknownSubsystem,
            format!("no subsystem {} here", c.subsystem_nqn),
        );
    };
    match subsystem.hosts.iter().find(|h| h.nqn == c.host_nqn) {
        Some(h) => match &h.psk {
            Some(psk) => Admission::Authenticate {
                subsystem,
                psk: psk.clone(),
                ctx: AuthContext {
                    host_nqn: c.host_nqn.clone(),
                    subsystem_nqn: c.subsystem_nqn.clone(),
                    host_id: c.host_id,
                },
            },
            None => Admission::Accept { subsystem },
        },
        None if subsystem.allow_any_host => Admission::Accept { subsystem },
        None => refuse(
            RefusalReason::HostNotAllowed,
            format!("host {} is not allowed on {}", c.host_nqn, c.subsystem_nqn),
        ),
    }
}

/// Whether the subsystem `c` asks for lists its host, with a key or without. A host admitted
/// to a subsystem that does not list it got in only because the subsystem allows any host
/// (under any NQN it made up): in a full target such a session is the first a listed host's
/// takes the place of.
pub fn lists_host(cfg: &Config, c: &Connect) -> bool {
    cfg.subsystems
        .iter()
        .find(|s| s.nqn == c.subsystem_nqn)
        .is_some_and(|s| s.hosts.iter().any(|h| h.nqn == c.host_nqn))
}

/// `url` with a wildcard host replaced by `local`'s address (see [`discovery`]).
pub(crate) fn advertised(url: &ListenUrl, local: Option<SocketAddr>) -> ListenUrl {
    let (Ok(bound), Some(local)) = (url.host.parse::<IpAddr>(), local) else {
        return url.clone();
    };
    // An IPv4 peer on a dual-stack socket shows as ::ffff:a.b.c.d: advertise a.b.c.d.
    let here = local.ip().to_canonical();
    // A `::` listener accepts IPv4 too (unless bindv6only); `0.0.0.0` only IPv4.
    let fits = match bound {
        IpAddr::V4(b) => b.is_unspecified() && here.is_ipv4(),
        IpAddr::V6(b) => b.is_unspecified(),
    };
    if !fits {
        return url.clone();
    }
    ListenUrl {
        host: here.to_string(),
        ..url.clone()
    }
}

/// The key a discovery connection of `host` must prove: the first the configuration lists for
/// it, in subsystem order. None if it has none.
pub fn host_key<'a>(cfg: &'a Config, host: &Nqn) -> Option<&'a Psk> {
    cfg.subsystems
        .iter()
        .flat_map(|s| &s.hosts)
        .filter(|h| &h.nqn == host)
        .find_map(|h| h.psk.as_ref())
}

/// Whether `host`, having proved `key` (if any), may see `s` in a discovery listing: it must be
/// able to connect, and a subsystem that lists it with a key shows only to the holder of that
/// key.
pub fn visible_to(s: &Subsystem, host: &Nqn, key: Option<&Psk>) -> bool {
    match s.hosts.iter().find(|h| &h.nqn == host) {
        Some(h) => match &h.psk {
            Some(need) => key == Some(need),
            None => true,
        },
        None => s.allow_any_host,
    }
}

/// The discovery listing for `host`, which proved `key` (if it has one): the subsystems it may
/// connect to, with every listen URL of rpma's own transports (`nvme-tcp://` listeners are for
/// NVMe hosts, which discover them through their own discovery log page). A subsystem that
/// lists the host with a key shows only if that is the key it proved ([`visible_to`]). The
/// host is given it a page at a time ([`DiscoveryResponse::page`]).
///
/// A wildcard listener (`0.0.0.0`, `::`) is advertised with `local`'s address, the one the
/// discovery connection arrived on (an address the host can reach), when `local` is of a family
/// the listener accepts; otherwise as configured.
pub fn discovery(
    cfg: &Config,
    host: &Nqn,
    key: Option<&Psk>,
    local: Option<SocketAddr>,
) -> Vec<DiscoveryEntry> {
    let listen = listen_urls(cfg, |url| advertised(url, local).to_string());
    listing(cfg, &listen, |s| visible_to(s, host, key))
}

/// The listen URLs of rpma's own transports, each as `advertise` writes it.
fn listen_urls(cfg: &Config, advertise: impl Fn(&ListenUrl) -> String) -> Vec<String> {
    cfg.listeners
        .iter()
        .filter(|l| l.url.transport.is_fabric())
        .map(|l| advertise(&l.url))
        .collect()
}

/// The discovery listing of the subsystems `sees` takes, each with `listen`.
fn listing(
    cfg: &Config,
    listen: &[String],
    sees: impl Fn(&Subsystem) -> bool,
) -> Vec<DiscoveryEntry> {
    cfg.subsystems
        .iter()
        .filter(|s| sees(s))
        .map(|s| DiscoveryEntry {
            subsystem_nqn: s.nqn.clone(),
            listen: listen.to_vec(),
        })
        .collect()
}

/// A discovery entry too long for one message, if the configuration has one: the subsystem
/// with the longest NQN, with every listen URL at its widest (each wildcard listener
/// advertised with the longest address text of the families it takes). Only a configuration
/// with some hundreds of listeners makes one; a host whose listing reaches it is told so
/// instead of given the rest (`rpma-target check-config` warns of it). Returns its NQN and
/// the length of a page of it alone.
fn discovery_entry_too_long(cfg: &Config) -> Option<(Nqn, usize)> {
    let (longest, entry) = widest_entry(cfg)?;
    match DiscoveryResponse::page(std::slice::from_ref(&entry), 0, 0) {
        Some(_) => None,
        None => {
            let page = DiscoveryResponse {
                entries: vec![entry],
                total: 1,
                generation: u64::MAX,
            };
            let len = Message::DiscoveryResponse(page).encode().map_or_else(
                |e| match e {
                    rpma_common::proto::Error::TooLarge { len, .. } => len,
                    _ => usize::MAX,
                },
                |b| b.len(),
            );
            Some((longest.nqn.clone(), len))
        }
    }
}

/// The widest discovery entry the configuration can make, with its subsystem: the one with
/// the longest NQN, every listen URL at its widest (each wildcard listener advertised with the
/// longest address text of the families it takes). None without subsystems.
fn widest_entry(cfg: &Config) -> Option<(&Subsystem, DiscoveryEntry)> {
    let v4 = SocketAddr::from(([255, 255, 255, 255], u16::MAX));
    let v6 = SocketAddr::from((std::net::Ipv6Addr::from([u16::MAX; 8]), u16::MAX));
    let listen = listen_urls(cfg, |url| {
        let (a, b) = (
            advertised(url, Some(v4)).to_string(),
            advertised(url, Some(v6)).to_string(),
        );
        if a.len() >= b.len() {
            a
        } else {
            b
        }
    });
    let longest = cfg.subsystems.iter().max_by_key(|s| s.nqn.as_str().len())?;
    let entry = listing(cfg, &listen, |s| std::ptr::eq(s, longest)).pop()?;
    Some((longest, entry))
}

/// Warnings for listings longer than an rpma host reads (`max`: [`MAX_LISTING`] entries,
/// `max_bytes`: [`MAX_LISTING_BYTES`] of them once decoded): a subsystem of more namespaces
/// (its hosts are refused by their own library; NVMe/TCP hosts are not limited), and more
/// subsystems, or subsystems whose entries together may take more memory, than a host's
/// discovery listing may list (counting every subsystem at the widest entry's cost), and a
/// discovery entry longer than a message (`discovery_entry_too_long`). Only with a listener
/// of rpma's own transports. (A session's namespaces cannot exceed `max_bytes` below `max` of
/// them: a descriptor with its texts cut takes under a kilobyte.)
///
/// [`MAX_LISTING`]: rpma_common::proto::MAX_LISTING
/// [`MAX_LISTING_BYTES`]: rpma_common::proto::MAX_LISTING_BYTES
pub fn listing_warnings(cfg: &Config, max: usize, max_bytes: usize) -> Vec<String> {
    if !cfg.listeners.iter().any(|l| l.url.transport.is_fabric()) {
        return Vec::new();
    }
    let mut out: Vec<String> = cfg
        .subsystems
        .iter()
        .filter(|s| s.namespaces.len() > max)
        .map(|s| {
            format!(
                "subsystem {}: {} namespaces, more than the {max} an rpma host reads: its rpma \
                 hosts cannot connect (NVMe/TCP hosts can)",
                s.nqn,
                s.namespaces.len()
            )
        })
        .collect();
    if cfg.discovery && cfg.subsystems.len() > max {
        out.push(format!(
            "discovery: {} subsystems, more than the {max} an rpma host reads: a host that may \
             see more than that gets no listing and must connect by NQN",
            cfg.subsystems.len()
        ));
    } else if let Some((_, widest)) = widest_entry(cfg).filter(|_| cfg.discovery) {
        let bytes = cfg.subsystems.len().saturating_mul(widest.cost());
        if bytes > max_bytes {
            out.push(format!(
                "discovery: {} subsystems with {} listen URLs each may take {} MiB in a host's \
                 memory, more than the {} MiB an rpma host gives a listing: a host that may see \
                 most of them gets no listing and must connect by NQN",
                cfg.subsystems.len(),
                widest.listen.len(),
                bytes >> 20,
                max_bytes >> 20
            ));
        }
    }
    // Valid, but a host whose listing reaches it gets no more of its listing.
    if let Some((nqn, len)) = discovery_entry_too_long(cfg).filter(|_| cfg.discovery) {
        out.push(format!(
            "discovery: subsystem {nqn}'s entry, with every listen URL, may take {len} bytes, \
             more than a message holds ({MAX_MESSAGE_SIZE}): a host whose listing reaches it is \
             told so and must connect by NQN"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use rpma_common::proto::nqn::DISCOVERY_NQN;
    use rpma_common::proto::HostId;

    use super::*;

    /// `n` subsystems on a `0.0.0.0` listener, each letting in any host or a host of its own.
    fn many(dir: &std::path::Path, n: usize, any_host: bool) -> Config {
        let mut text = String::from("listen = [\"tcp://0.0.0.0:7420\"]\n");
        for i in 0..n {
            text += &format!("[[subsystem]]\nnqn = \"nqn.2026-11.io.rpma:s{i}\"\n");
            text += &if any_host {
                "allow_any_host = true\n".to_owned()
            } else {
                format!("hosts = [{{ nqn = \"nqn.2026-11.io.rpma:h{i}\" }}]\n")
            };
        }
        Config::from_toml(&text, dir).unwrap()
    }

    #[test]
    fn a_long_listing_comes_in_pages_and_only_an_entry_too_long_for_any_is_reported() {
        let d = tempfile::tempdir().unwrap();
        let host = Nqn::new("nqn.2026-11.io.rpma:x".to_owned()).unwrap();
        // 300 subsystems any host may see: more than one message holds, each page fits.
        let wide = many(d.path(), 300, true);
        assert_eq!(discovery_entry_too_long(&wide), None);
        let all = discovery(&wide, &host, None, None);
        assert_eq!(all.len(), 300);
        let gen = DiscoveryResponse::generation_of(&all);
        let (mut got, mut pages) = (Vec::new(), 0);
        while got.len() < all.len() {
            let page = DiscoveryResponse::page(&all, got.len() as u32, gen).unwrap();
            assert_eq!((page.total, page.generation), (300, gen));
            assert!(!page.entries.is_empty());
            let len = Message::DiscoveryResponse(page.clone())
                .encode()
                .unwrap()
                .len();
            assert!(len <= rpma_common::proto::MAX_MESSAGE_SIZE, "{len}");
            got.extend(page.entries);
            pages += 1;
        }
        assert_eq!(got, all);
        assert!(pages > 1, "{pages}");
        // Past the end: an empty page with the total.
        let end = DiscoveryResponse::page(&all, 300, gen).unwrap();
        assert!(end.entries.is_empty() && end.total == 300);
        // Another listing, another generation.
        assert_ne!(DiscoveryResponse::generation_of(&all[1..]), gen);
        // One entry too long for a message: 500 listeners, each URL in it.
        let mut text = String::from("listen = [");
        for port in 0..500 {
            text += &format!("\"tcp://0.0.0.0:{}\", ", 10000 + port);
        }
        text += "]\n[[subsystem]]\nnqn = \"nqn.2026-11.io.rpma:s\"\nallow_any_host = true\n";
        let long = Config::from_toml(&text, d.path()).unwrap();
        let (nqn, len) = discovery_entry_too_long(&long).expect("too long");
        assert_eq!(nqn.as_str(), "nqn.2026-11.io.rpma:s");
        assert!(len > rpma_common::proto::MAX_MESSAGE_SIZE, "{len}");
        let listing = discovery(&long, &host, None, None);
        assert_eq!(DiscoveryResponse::page(&listing, 0, 0), None);
    }

    #[test]
    fn listings_longer_than_a_host_reads_are_warned_of() {
        let d = tempfile::tempdir().unwrap();
        let c = many(d.path(), 3, true);
        assert!(listing_warnings(&c, 3, 1 << 20).is_empty());
        // Their entries' memory: 3 of about 130 bytes each.
        let w = listing_warnings(&c, 3, 300);
        assert_eq!(w.len(), 1);
        assert!(
            w[0].starts_with("discovery: 3 subsystems with 1 listen URLs each may take 0 MiB"),
            "{w:?}"
        );
        let w = listing_warnings(&c, 2, 1 << 20);
        assert_eq!(w.len(), 1);
        assert!(
            w[0].starts_with("discovery: 3 subsystems, more than the 2"),
            "{w:?}"
        );
        let mut text = String::from("listen = [\"tcp://127.0.0.1:7420\"]\n");
        text += "[[subsystem]]\nnqn = \"nqn.2026-11.io.rpma:big\"\nallow_any_host = true\n";
        for i in 1..=3 {
            text +=
                &format!("[[subsystem.namespace]]\nnsid = {i}\npath = \"n{i}\"\nsize = \"4KiB\"\n");
        }
        let big = Config::from_toml(&text, d.path()).unwrap();
        let w = listing_warnings(&big, 2, 1 << 20);
        assert_eq!(w.len(), 1);
        assert!(
            w[0].starts_with("subsystem nqn.2026-11.io.rpma:big: 3 namespaces, more than the 2"),
            "{w:?}"
        );
        // NVMe/TCP alone: no rpma host, nothing to warn of.
        let nvme = Config::from_toml(
            &text.replace("tcp://127.0.0.1:7420", "nvme-tcp://127.0.0.1:4420"),
            d.path(),
        )
        .unwrap();
        assert!(listing_warnings(&nvme, 2, 0).is_empty());
    }

    fn cfg(dir: &std::path::Path, discovery: bool) -> Config {
        let k = dir.join("k.psk");
        std::fs::write(&k, "11".repeat(32)).unwrap();
        std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o600)).unwrap();
        let text = format!(
            r#"
discovery = {discovery}
listen = ["tcp://127.0.0.1:7420", "nvme-tcp://127.0.0.1:4420", "tcp://[::1]:7420"]
[[subsystem]]
nqn = "nqn.2026-11.io.rpma:closed"
hosts = [{{ nqn = "nqn.2026-11.io.rpma:plain" }}, {{ nqn = "nqn.2026-11.io.rpma:keyed", psk_file = "k.psk" }}]
[[subsystem]]
nqn = "nqn.2026-11.io.rpma:open"
allow_any_host = true
hosts = [{{ nqn = "nqn.2026-11.io.rpma:keyed", psk_file = "k.psk" }}]
"#
        );
        Config::from_toml(&text, dir).unwrap()
    }

    fn connect(host: &str, sub: &str) -> Connect {
        Connect {
            host_nqn: Nqn::new(host).unwrap(),
            subsystem_nqn: Nqn::new(sub).unwrap(),
            host_id: HostId([1; 16]),
            queue_id: 0,
            keep_alive_ms: 0,
        }
    }

    const CLOSED: &str = "nqn.2026-11.io.rpma:closed";
    const OPEN: &str = "nqn.2026-11.io.rpma:open";

    #[test]
    fn decisions() {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path(), true);
        let reason = |a: Admission<'_>| match a {
            Admission::Refuse(r) => Some(r.reason),
            _ => None,
        };
        assert_eq!(
            reason(admit(
                &c,
                &connect("nqn.2026-11.io.rpma:plain", "nqn.2026-11.io.rpma:nope")
            )),
            Some(RefusalReason::UnknownSubsystem)
        );
        assert_eq!(
            reason(admit(&c, &connect("nqn.2026-11.io.rpma:stranger", CLOSED))),
            Some(RefusalReason::HostNotAllowed)
        );
        assert!(matches!(
            admit(&c, &connect("nqn.2026-11.io.rpma:plain", CLOSED)),
            Admission::Accept { subsystem } if subsystem.nqn.as_str() == CLOSED
        ));
        assert!(matches!(
            admit(&c, &connect("nqn.2026-11.io.rpma:keyed", CLOSED)),
            Admission::Authenticate { ctx, .. } if ctx.subsystem_nqn.as_str() == CLOSED
        ));
        // allow_any_host does not waive a listed host's key.
        assert!(matches!(
            admit(&c, &connect("nqn.2026-11.io.rpma:keyed", OPEN)),
            Admission::Authenticate { .. }
        ));
        assert!(matches!(
            admit(&c, &connect("nqn.2026-11.io.rpma:stranger", OPEN)),
            Admission::Accept { .. }
        ));
        assert!(matches!(
            admit(&c, &connect("nqn.2026-11.io.rpma:stranger", DISCOVERY_NQN)),
            Admission::Discovery
        ));
        // Listed or not: by the subsystem asked for, whatever the others list.
        assert!(lists_host(
            &c,
            &connect("nqn.2026-11.io.rpma:plain", CLOSED)
        ));
        assert!(lists_host(&c, &connect("nqn.2026-11.io.rpma:keyed", OPEN)));
        assert!(!lists_host(&c, &connect("nqn.2026-11.io.rpma:plain", OPEN)));
        assert!(!lists_host(
            &c,
            &connect("nqn.2026-11.io.rpma:stranger", OPEN)
        ));
        let off = cfg(d.path(), false);
        assert_eq!(
            reason(admit(
                &off,
                &connect("nqn.2026-11.io.rpma:stranger", DISCOVERY_NQN)
            )),
            Some(RefusalReason::UnknownSubsystem)
        );
    }

    #[test]
    fn discovery_lists_only_what_the_host_may_reach() {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path(), true);
        let stranger = discovery(
            &c,
            &Nqn::new("nqn.2026-11.io.rpma:stranger").unwrap(),
            None,
            Some("127.0.0.1:7420".parse().unwrap()),
        );
        assert_eq!(stranger.len(), 1);
        assert_eq!(stranger[0].subsystem_nqn.as_str(), OPEN);
        assert_eq!(
            stranger[0].listen,
            ["tcp://127.0.0.1:7420", "tcp://[::1]:7420"]
        );
        let plain = discovery(
            &c,
            &Nqn::new("nqn.2026-11.io.rpma:plain").unwrap(),
            None,
            None,
        );
        assert_eq!(plain.len(), 2);
    }

    #[test]
    fn a_host_with_a_key_proves_it_before_discovery_shows_what_needs_it() {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path(), true);
        let keyed = Nqn::new("nqn.2026-11.io.rpma:keyed").unwrap();
        match admit(&c, &connect(keyed.as_str(), DISCOVERY_NQN)) {
            Admission::DiscoveryAuthenticate { psk, ctx } => {
                assert_eq!(psk, Psk::new(&[0x11; 32]).unwrap());
                assert_eq!(ctx.subsystem_nqn.as_str(), DISCOVERY_NQN);
            }
            other => panic!("{other:?}"),
        }
        let names = |key: Option<&Psk>| -> Vec<String> {
            discovery(&c, &keyed, key, None)
                .iter()
                .map(|e| e.subsystem_nqn.to_string())
                .collect()
        };
        // Without the key: not even the open subsystem, which lists the host with its key.
        assert!(names(None).is_empty());
        assert!(names(Some(&Psk::new(&[0x12; 32]).unwrap())).is_empty());
        assert_eq!(names(Some(&Psk::new(&[0x11; 32]).unwrap())), [CLOSED, OPEN]);
    }

    #[test]
    fn wildcard_listeners_advertise_the_address_the_host_reached() {
        let d = tempfile::tempdir().unwrap();
        let text = r#"
listen = ["tcp://0.0.0.0:7420", "tcp://[::]:7421", "tcp://192.0.2.7:7422"]
[[subsystem]]
nqn = "nqn.2026-11.io.rpma:open"
allow_any_host = true
"#;
        let c = Config::from_toml(text, d.path()).unwrap();
        let host = Nqn::new("nqn.2026-11.io.rpma:h").unwrap();
        let listen = |local: Option<&str>| {
            discovery(&c, &host, None, local.map(|l| l.parse().unwrap()))[0]
                .listen
                .clone()
        };
        assert_eq!(
            listen(Some("198.51.100.4:7420")),
            [
                "tcp://198.51.100.4:7420",
                "tcp://198.51.100.4:7421",
                "tcp://192.0.2.7:7422"
            ]
        );
        // An IPv4 host on the dual-stack listener: its mapped address is shown as IPv4.
        assert_eq!(
            listen(Some("[::ffff:198.51.100.4]:7421"))[1],
            "tcp://198.51.100.4:7421"
        );
        // An IPv6 host: the IPv4 wildcard cannot be reached that way, so it stays as it is.
        assert_eq!(
            listen(Some("[2001:db8::5]:7421")),
            [
                "tcp://0.0.0.0:7420",
                "tcp://[2001:db8::5]:7421",
                "tcp://192.0.2.7:7422"
            ]
        );
        assert_eq!(listen(None)[0], "tcp://0.0.0.0:7420");
    }
}
