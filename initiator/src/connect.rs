//! Connection set-up: [`connect`] (transport, Connect, mutual authentication, ConnectResponse),
//! [`discover`] and [`identify`].

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rpma_common::fabric::{ConnParams, Context, QpCaps, TcpParams, Url};
use rpma_common::proto::auth::{AuthContext, HostAuth, Psk};
use rpma_common::proto::nqn::{self, Nqn, DISCOVERY_NQN, UUID_PREFIX};
use rpma_common::proto::{
    Connect, DiscoveryEntry, DiscoveryRequest, HostId, ListingEntry, Message, NamespaceDescriptor,
    NamespacesRequest, Refusal, MAX_LISTING, MAX_LISTING_BYTES,
};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::session::{target_text, Session};
use rpma_common::proto::msgbuf::MsgBufs;

/// Receive slots a session keeps posted: the most control messages (flush responses and the
/// like) the target may have in flight to this host. The host must keep at most this many
/// requests outstanding (the target's own limit is its `max_queue_depth`, 128 by default).
pub const RECV_DEPTH: usize = 64;
const SEND_SLOTS: usize = 16;

/// Who this host is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostIdentity {
    /// The host NQN.
    pub nqn: Nqn,
    /// The host id (the UUID of a UUID-form NQN, else derived stably from the NQN).
    pub host_id: HostId,
    /// The pre-shared key, when the target lists this host with one.
    pub psk: Option<Psk>,
}

impl HostIdentity {
    /// A host named `nqn`, without a key.
    pub fn new(nqn: Nqn) -> HostIdentity {
        HostIdentity {
            host_id: host_id_of(&nqn),
            nqn,
            psk: None,
        }
    }

    /// This machine: the NQN of `/etc/nvme/hostnqn`, else one derived from the machine id
    /// ([`nqn::default_host_nqn`]).
    ///
    /// # Errors
    /// [`Error::HostNqn`].
    pub fn default_host() -> Result<HostIdentity> {
        Ok(HostIdentity::new(
            nqn::default_host_nqn().map_err(Error::HostNqn)?,
        ))
    }

    /// The same host, authenticating with `psk`.
    pub fn with_psk(mut self, psk: Psk) -> HostIdentity {
        self.psk = Some(psk);
        self
    }
}

/// The host id of an NQN: its UUID for the UUID form, else the first 16 bytes of
/// SHA-256("rpma host id v1" || NQN) with the version-4/variant-1 bits set.
pub fn host_id_of(nqn: &Nqn) -> HostId {
    if let Some(u) = nqn
        .as_str()
        .strip_prefix(UUID_PREFIX)
        .and_then(nqn::parse_uuid)
    {
        return HostId(u);
    }
    let h = Sha256::new()
        .chain_update(b"rpma host id v1")
        .chain_update(nqn.as_str().as_bytes())
        .finalize();
    let mut id = [0u8; 16];
    id.copy_from_slice(&h[..16]);
    id[6] = (id[6] & 0x0F) | 0x40;
    id[8] = (id[8] & 0x3F) | 0x80;
    HostId(id)
}

/// How to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Deadline for the transport connection and for each answer of the exchange.
    pub timeout: Duration,
    /// The keep-alive period to ask for; zero takes the target's default.
    pub keep_alive: Duration,
    /// 0 for the admin queue, 1.. for I/O queues.
    pub queue_id: u16,
    /// The `tcp` transport's options (MPA CRC32c, FPDU size); other transports ignore them.
    pub tcp: TcpParams,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            timeout: Duration::from_secs(10),
            keep_alive: Duration::ZERO,
            queue_id: 0,
            tcp: TcpParams::default(),
        }
    }
}

fn parse_url(url: &str) -> Result<Url> {
    Url::parse(url).map_err(|source| Error::Url {
        url: url.to_owned(),
        source,
    })
}

/// Opens the transport connection with the receive slots posted before the first byte.
fn open(url: &str, opts: &ConnectOptions) -> Result<Session> {
    let parsed = parse_url(url)?;
    let fab = |op| move |source| Error::Fabric { op, source };
    let ctx = Context::for_url(&parsed).map_err(|source| Error::Connect {
        url: url.to_owned(),
        source,
    })?;
    let pd = ctx
        .alloc_pd()
        .map_err(fab("allocating a protection domain"))?;
    let cq = ctx
        .create_cq(4 * RECV_DEPTH)
        .map_err(fab("creating a completion queue"))?;
    let caps = QpCaps::default();
    let prepared = pd
        .create_qp(&cq, &cq, caps)
        .map_err(fab("creating a queue pair"))?;
    let bufs = MsgBufs::new(&pd, RECV_DEPTH, SEND_SLOTS).map_err(fab("registering buffers"))?;
    for slot in 0..bufs.recv_slots() {
        prepared
            .post_recv(bufs.recv_wr(slot))
            .map_err(fab("posting a receive"))?;
    }
    let params = ConnParams {
        tcp: opts.tcp.clone(),
        timeout: opts.timeout,
        ..ConnParams::default()
    };
    let qp = prepared
        .connect(&parsed, &params, &[])
        .map_err(|source| Error::Connect {
            url: url.to_owned(),
            source,
        })?;
    let now = Instant::now();
    Ok(Session {
        ctx,
        pd,
        cq,
        qp,
        bufs,
        url: parsed.to_string(),
        controller_id: 0,
        keep_alive: Duration::from_secs(5),
        queue_depth: 0,
        namespaces: Vec::new(),
        inbox: VecDeque::new(),
        other: VecDeque::new(),
        last_sent: now,
        last_heard: now,
        seq: 0,
        echoed: 0,
        next_token: 0,
        closed: None,
        rx: Vec::new(),
        admitted: false,
        violated: None,
    })
}

fn refused(r: Refusal) -> Error {
    Error::from_refusal(r.reason, target_text(&r.message))
}

fn unexpected(expected: &'static str, m: &Message) -> Error {
    Error::Unexpected {
        expected,
        got: m.message_type(),
    }
}

/// Connects to subsystem `subsystem` at `url` (`tcp://host:port`) as `host`: the transport,
/// then Connect, mutual challenge-response when `host` has a key (the target must prove the key
/// too), then the ConnectResponse with the namespace descriptors.
///
/// # Errors
/// [`Error::Url`], [`Error::Connect`], [`Error::Timeout`]; a refusal as
/// [`Error::UnknownSubsystem`], [`Error::HostNotAllowed`], [`Error::AuthFailed`],
/// [`Error::VersionUnsupported`] or [`Error::Refused`]; [`Error::KeyRequired`] if the target
/// asks for a key this host does not have; [`Error::TargetNotAuthenticated`];
/// [`Error::Unexpected`], [`Error::Decode`], [`Error::ConnectionLost`].
pub fn connect(
    url: &str,
    subsystem: &Nqn,
    host: &HostIdentity,
    opts: &ConnectOptions,
) -> Result<Session> {
    let mut s = open(url, opts)?;
    let connect = Connect {
        host_nqn: host.nqn.clone(),
        subsystem_nqn: subsystem.clone(),
        host_id: host.host_id,
        queue_id: opts.queue_id,
        keep_alive_ms: u32::try_from(opts.keep_alive.as_millis()).unwrap_or(u32::MAX),
    };
    s.send_message(&Message::Connect(connect))?;
    let mut auth = host.psk.clone().map(|psk| {
        HostAuth::new(
            psk,
            AuthContext {
                host_nqn: host.nqn.clone(),
                subsystem_nqn: subsystem.clone(),
                host_id: host.host_id,
            },
        )
    });
    let mut awaiting_confirm = None;
    let mut authenticated = false;
    loop {
        let m = s.wait_message(opts.timeout, "answer to Connect")?;
        match m {
            Message::Refusal(r) => return Err(refused(r)),
            Message::AuthChallenge(ch) => {
                let Some(a) = auth.take() else {
                    let _ = s.disconnect(Duration::from_millis(100));
                    return Err(Error::KeyRequired);
                };
                let (next, resp) = a.on_challenge(&ch).map_err(Error::Auth)?;
                awaiting_confirm = Some(next);
                s.send_message(&Message::AuthResponse(resp))?;
            }
            Message::AuthConfirm(c) => {
                let Some(a) = awaiting_confirm.take() else {
                    return Err(unexpected(
                        "AuthChallenge or ConnectResponse",
                        &Message::AuthConfirm(c),
                    ));
                };
                a.on_confirm(&c)
                    .map_err(|e| Error::TargetNotAuthenticated { source: Some(e) })?;
                authenticated = true;
            }
            Message::ConnectResponse(r) => {
                // Admitted: from here on, dropping the session says goodbye.
                s.admitted = true;
                if host.psk.is_some() && !authenticated && !subsystem.is_discovery() {
                    // The target let us in without proving the key: not the target we trust.
                    return Err(Error::TargetNotAuthenticated { source: None });
                }
                s.controller_id = r.controller_id;
                if r.keep_alive_ms > 0 {
                    s.keep_alive = Duration::from_millis(u64::from(r.keep_alive_ms));
                }
                s.queue_depth = r.queue_depth;
                let mut first = Some(Page {
                    items: r.namespaces,
                    total: r.namespace_count,
                    generation: 0,
                });
                // Those its ConnectResponse had no room for, a page at a time.
                s.namespaces = whole_listing("namespace", |start| {
                    if let (0, Some(first)) = (start, first.take()) {
                        return Ok(first);
                    }
                    s.send_message(&Message::NamespacesRequest(NamespacesRequest { start }))?;
                    match s.wait_message(opts.timeout, "NamespacesResponse")? {
                        Message::NamespacesResponse(r) => Ok(Page {
                            items: r.namespaces,
                            total: r.total,
                            generation: 0,
                        }),
                        other => Err(unexpected("NamespacesResponse", &other)),
                    }
                })?;
                s.namespaces.sort_by_key(|n| n.nsid);
                for d in &mut s.namespaces {
                    d.failure = d.failure.as_deref().map(target_text);
                    d.unavailable = d.unavailable.as_deref().map(target_text);
                }
                // A namespace described past the end of the address space cannot be
                // addressed (its offsets would overflow): unavailable, said why, rather than a
                // request to a wrapped address (or a panic in a debug build).
                for d in &mut s.namespaces {
                    if d.unavailable.is_none() && d.remote_addr.checked_add(d.size).is_none() {
                        d.unavailable = Some(format!(
                            "the target described it at address {:#x} with {} bytes, past the \
                             end of the address space",
                            d.remote_addr, d.size
                        ));
                    }
                }
                return Ok(s);
            }
            other => return Err(unexpected("ConnectResponse", &other)),
        }
    }
}

/// Lists the subsystems the target at `url` lets `host` see, with their listen URLs, through
/// its discovery subsystem. A listing longer than one message comes in pages, read in turn;
/// one that changes between them (a reload) is read again from the start.
///
/// # Errors
/// As [`connect`] (a target with discovery disabled refuses with
/// [`Error::UnknownSubsystem`]), [`Error::Unexpected`] for an answer that is not a
/// DiscoveryResponse, and [`Error::Listing`] for pages that do not add up.
pub fn discover(
    url: &str,
    host: &HostIdentity,
    opts: &ConnectOptions,
) -> Result<Vec<DiscoveryEntry>> {
    let disc = Nqn::new(DISCOVERY_NQN).map_err(Error::HostNqn)?;
    let mut s = connect(url, &disc, host, opts)?;
    let listing = whole_listing("discovery", |start| {
        s.send_message(&Message::DiscoveryRequest(DiscoveryRequest { start }))?;
        match s.wait_message(opts.timeout, "DiscoveryResponse")? {
            Message::DiscoveryResponse(r) => Ok(Page {
                items: r.entries,
                total: r.total,
                generation: r.generation,
            }),
            other => Err(unexpected("DiscoveryResponse", &other)),
        }
    });
    let _ = s.disconnect(Duration::from_secs(1));
    listing
}

/// How many times a listing that changed while it was read is read again.
const LISTING_READS: usize = 4;

/// One page of a listing the target sends a page at a time: its entries, how many the whole
/// listing has, and which listing it is of (a session's namespaces: always the same).
struct Page<T> {
    items: Vec<T>,
    total: u32,
    generation: u64,
}

/// The whole `what` listing, from the pages `page(start)` brings: in turn from 0, each
/// starting where the entries so far end, until the listing's total; from the start again
/// when a page is of another generation or total (the listing changed between two reads).
fn whole_listing<T: ListingEntry>(
    what: &'static str,
    mut page: impl FnMut(u32) -> Result<Page<T>>,
) -> Result<Vec<T>> {
    let bad = |why: String| Error::Listing { what, why };
    'read: for _ in 0..LISTING_READS {
        let first = page(0)?;
        let (total, generation) = (first.total, first.generation);
        if total > MAX_LISTING {
            return Err(bad(format!(
                "it has {total} entries, more than the {MAX_LISTING} a host reads"
            )));
        }
        let mut entries = first.items;
        let mut cost: usize = entries.iter().map(T::cost).sum();
        loop {
            if cost > MAX_LISTING_BYTES {
                return Err(bad(format!(
                    "its entries take more than the {} MiB a host gives a listing",
                    MAX_LISTING_BYTES >> 20
                )));
            }
            let have = entries.len();
            if have > total as usize {
                return Err(bad(format!(
                    "its pages brought {have} entries, more than its total of {total}"
                )));
            }
            if have == total as usize {
                return Ok(entries);
            }
            let next = page(have as u32)?;
            if next.generation != generation || next.total != total {
                continue 'read;
            }
            if next.items.is_empty() {
                return Err(bad(format!(
                    "the page from entry {have} of {total} brought none"
                )));
            }
            cost += next.items.iter().map(T::cost).sum::<usize>();
            entries.extend(next.items);
        }
    }
    Err(bad(format!(
        "it changed while it was read, {LISTING_READS} times in a row"
    )))
}

/// What [`identify`] learns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The target URL.
    pub url: String,
    /// The subsystem.
    pub subsystem: Nqn,
    /// The controller id the target assigned.
    pub controller_id: u16,
    /// The keep-alive period the target enforces.
    pub keep_alive: Duration,
    /// The namespaces, by nsid (their rkeys were valid only for that connection).
    pub namespaces: Vec<NamespaceDescriptor>,
}

/// Connects, reads the namespace descriptors, and disconnects.
///
/// # Errors
/// As [`connect`].
pub fn identify(
    url: &str,
    subsystem: &Nqn,
    host: &HostIdentity,
    opts: &ConnectOptions,
) -> Result<Identity> {
    let s = connect(url, subsystem, host, opts)?;
    let id = Identity {
        url: s.url().to_owned(),
        subsystem: subsystem.clone(),
        controller_id: s.controller_id(),
        keep_alive: s.keep_alive(),
        namespaces: s.namespaces().to_vec(),
    };
    let _ = s.disconnect(Duration::from_secs(1));
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` discovery entries.
    fn entries(n: usize) -> Vec<DiscoveryEntry> {
        (0..n)
            .map(|i| DiscoveryEntry {
                subsystem_nqn: Nqn::new(format!("nqn.2026-11.io.rpma:s{i}")).unwrap(),
                listen: vec!["tcp://127.0.0.1:7420".into()],
            })
            .collect()
    }

    /// A target's pages of `all` (`per` entries each, generation `generation(read)` on the
    /// read-th request), recording the starts asked for.
    fn pages<'a>(
        all: &'a [DiscoveryEntry],
        per: usize,
        asked: &'a mut Vec<u32>,
        generation: impl Fn(usize) -> u64 + 'a,
    ) -> impl FnMut(u32) -> Result<Page<DiscoveryEntry>> + 'a {
        move |start| {
            asked.push(start);
            let from = (start as usize).min(all.len());
            Ok(Page {
                items: all[from..(from + per).min(all.len())].to_vec(),
                total: all.len() as u32,
                generation: generation(asked.len()),
            })
        }
    }

    /// [`whole_listing`] of the discovery listing.
    fn whole(page: impl FnMut(u32) -> Result<Page<DiscoveryEntry>>) -> Result<Vec<DiscoveryEntry>> {
        whole_listing("discovery", page)
    }

    #[test]
    fn a_listing_is_read_page_by_page_to_its_total() {
        let all = entries(10);
        let mut asked = Vec::new();
        let got = whole(pages(&all, 4, &mut asked, |_| 9)).unwrap();
        assert_eq!(got, all);
        assert_eq!(asked, [0, 4, 8]);
        // One page, and an empty listing: one read each.
        let mut asked = Vec::new();
        assert_eq!(whole(pages(&all, 10, &mut asked, |_| 9)).unwrap(), all);
        assert_eq!(asked, [0]);
        let mut asked = Vec::new();
        assert!(whole(pages(&[], 4, &mut asked, |_| 9)).unwrap().is_empty());
        assert_eq!(asked, [0]);
    }

    #[test]
    fn a_listing_that_changes_between_pages_is_read_again_from_the_start() {
        let all = entries(10);
        // The generation changes at the second request only: read again, then whole.
        let mut asked = Vec::new();
        let got = whole(pages(&all, 4, &mut asked, |n| u64::from(n == 2))).unwrap();
        assert_eq!(got, all);
        assert_eq!(asked, [0, 4, 0, 4, 8]);
        // Changing at every request: given up after LISTING_READS reads, said why.
        let mut asked = Vec::new();
        let e = whole(pages(&all, 4, &mut asked, |n| n as u64)).unwrap_err();
        assert!(
            matches!(&e, Error::Listing { why, .. } if why.contains("changed while it was read")),
            "{e}"
        );
        assert_eq!(asked.len(), 2 * LISTING_READS);
    }

    #[test]
    fn pages_that_do_not_add_up_are_refused() {
        let all = entries(10);
        let why = |r: Result<Vec<DiscoveryEntry>>| match r {
            Err(Error::Listing { what, why }) => {
                assert_eq!(what, "discovery");
                why
            }
            other => panic!("{other:?}"),
        };
        // A page that brings nothing before the end.
        let mut asked = Vec::new();
        let w = why(whole(pages(&all, 0, &mut asked, |_| 1)));
        assert!(
            w.contains("the page from entry 0 of 10 brought none"),
            "{w}"
        );
        // More entries than its total.
        let over = |_start: u32| {
            Ok(Page {
                items: entries(3),
                total: 2,
                generation: 1,
            })
        };
        let w = why(whole(over));
        assert!(
            w.contains("brought 3 entries, more than its total of 2"),
            "{w}"
        );
        // A total past what a host reads: refused before any further read.
        let mut n = 0;
        let huge = |_start: u32| {
            n += 1;
            Ok(Page {
                items: entries(1),
                total: u32::MAX,
                generation: 1,
            })
        };
        let w = why(whole(huge));
        assert!(w.contains("more than the 65536 a host reads"), "{w}");
        assert_eq!(n, 1);
        // Entries that take more memory than a host gives a listing (each page one entry of
        // 8,000 empty URLs: 8 KiB on the wire, ~190 KiB decoded): refused once over 64 MiB.
        let mut n = 0;
        let heavy = |_start: u32| {
            n += 1;
            let mut e = entries(1);
            e[0].listen = vec![String::new(); 8000];
            Ok(Page {
                items: e,
                total: MAX_LISTING,
                generation: 1,
            })
        };
        let w = why(whole(heavy));
        assert!(
            w.contains("its entries take more than the 64 MiB a host gives a listing"),
            "{w}"
        );
        assert!(n > 300 && n < 400, "{n} pages read");
        // An error from a read is the listing's error.
        let lost = |_start: u32| Err(Error::KeyRequired);
        assert!(matches!(whole(lost), Err(Error::KeyRequired)));
    }

    #[test]
    fn host_id_is_the_uuid_of_a_uuid_nqn_and_stable_otherwise() {
        let u = Nqn::new("nqn.2014-08.org.nvmexpress:uuid:12345678-9abc-4def-8123-456789abcdef")
            .unwrap();
        assert_eq!(
            host_id_of(&u).to_string(),
            "12345678-9abc-4def-8123-456789abcdef"
        );
        let a = Nqn::new("nqn.2026-11.io.rpma:host-a").unwrap();
        let b = Nqn::new("nqn.2026-11.io.rpma:host-b").unwrap();
        assert_eq!(host_id_of(&a), host_id_of(&a));
        assert_ne!(host_id_of(&a), host_id_of(&b));
        assert_eq!(host_id_of(&a).0[6] >> 4, 4, "version 4");
    }

    #[test]
    fn bad_url_and_unreachable_target_are_errors() {
        let h = HostIdentity::new(Nqn::new("nqn.2026-11.io.rpma:h").unwrap());
        let sub = Nqn::new("nqn.2026-11.io.rpma:s").unwrap();
        let opts = ConnectOptions {
            timeout: Duration::from_secs(2),
            ..ConnectOptions::default()
        };
        assert!(matches!(
            connect("http://x:1", &sub, &h, &opts),
            Err(Error::Url { .. })
        ));
        // A port nobody listens on (bound, then closed).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        assert!(matches!(
            connect(&format!("tcp://127.0.0.1:{port}"), &sub, &h, &opts),
            Err(Error::Connect { .. })
        ));
    }

    #[test]
    fn refusals_map_to_their_variants() {
        use rpma_common::proto::RefusalReason as R;
        let e = |r| Error::from_refusal(r, "m".into());
        assert!(matches!(
            e(R::UnknownSubsystem),
            Error::UnknownSubsystem { .. }
        ));
        assert!(matches!(e(R::HostNotAllowed), Error::HostNotAllowed { .. }));
        assert!(matches!(e(R::AuthFailed), Error::AuthFailed { .. }));
        assert!(matches!(
            e(R::VersionUnsupported),
            Error::VersionUnsupported { .. }
        ));
        assert!(matches!(
            e(R::ShuttingDown),
            Error::Refused {
                reason: R::ShuttingDown,
                ..
            }
        ));
    }
}
