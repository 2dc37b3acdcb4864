//! The serde-encoded (postcard) messages: connection set-up, auth, discovery, disconnect.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::nqn::{format_uuid, Nqn};

/// A host's identifier (a UUID, as NVMe-oF's Host Identifier).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HostId(pub [u8; 16]);

impl fmt::Display for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_uuid(&self.0))
    }
}

impl fmt::Debug for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostId({self})")
    }
}

/// Host -> target, first message on a new connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Connect {
    /// The host's NQN.
    pub host_nqn: Nqn,
    /// The subsystem asked for (the discovery NQN for a discovery connection).
    pub subsystem_nqn: Nqn,
    /// The host's identifier.
    pub host_id: HostId,
    /// 0 for the admin queue, 1.. for I/O queues.
    pub queue_id: u16,
    /// The host's keep-alive period in milliseconds; 0 asks for the target's default.
    pub keep_alive_ms: u32,
}

/// Target -> host: the target's fresh nonce, sent when the host has a pre-shared key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthChallenge {
    /// 32 random bytes, new for every challenge.
    pub target_nonce: [u8; 32],
}

/// Host -> target: the host's fresh nonce and its proof of the key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthResponse {
    /// 32 random bytes, new for every response.
    pub host_nonce: [u8; 32],
    /// HMAC-SHA256 of the host's transcript (see [`super::auth`]).
    pub host_mac: [u8; 32],
}

/// Target -> host: the target's proof of the key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthConfirm {
    /// HMAC-SHA256 of the target's transcript (see [`super::auth`]).
    pub target_mac: [u8; 32],
}

/// A namespace's persistence domain as told to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum PersistenceDomain {
    /// Real DAX: cache write-back makes a byte durable.
    Dax,
    /// Treated as DAX by the operator's choice (`force_dax`) though it is not: testing only.
    DaxForced,
    /// A file in the page cache: msync/fdatasync makes a byte durable.
    PageCache,
    /// Nothing makes a byte durable: acknowledgements mean "visible".
    Volatile,
}

impl fmt::Display for PersistenceDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PersistenceDomain::Dax => "dax",
            PersistenceDomain::DaxForced => "dax (forced)",
            PersistenceDomain::PageCache => "page-cache",
            PersistenceDomain::Volatile => "volatile",
        })
    }
}

/// The durability methods valid on a namespace, as a bitset.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DurabilityMethods(pub u8);

impl DurabilityMethods {
    /// None: the namespace is volatile.
    pub const NONE: Self = Self(0);
    /// Appliance persistency: Write(s) then an 8-byte Read on the same QP.
    pub const APM: Self = Self(1);
    /// General-purpose server persistency: Write(s) then a [`super::FlushRequest`].
    pub const GPSPM: Self = Self(2);
    /// The native Flush work request.
    pub const FLUSH: Self = Self(4);

    /// Whether every method of `other` is in `self`.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether no method is valid.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The method names, e.g. `["APM", "GPSPM"]`.
    pub fn names(self) -> Vec<&'static str> {
        [
            (Self::APM, "APM"),
            (Self::GPSPM, "GPSPM"),
            (Self::FLUSH, "FLUSH"),
        ]
        .into_iter()
        .filter(|(m, _)| self.contains(*m))
        .map(|(_, n)| n)
        .collect()
    }
}

impl std::ops::BitOr for DurabilityMethods {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl fmt::Debug for DurabilityMethods {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DurabilityMethods({})", self.names().join("|"))
    }
}

/// One namespace as the host sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceDescriptor {
    /// Namespace id, 1..
    pub nsid: u32,
    /// Size in bytes.
    pub size: u64,
    /// Block size: 512 or 4096.
    pub block_size: u32,
    /// Remote address of byte 0 (what RDMA Writes address).
    pub remote_addr: u64,
    /// The rkey of this connection for this namespace.
    pub rkey: u32,
    /// Persistence domain.
    pub domain: PersistenceDomain,
    /// Durability methods valid on it.
    pub durability: DurabilityMethods,
    /// The largest write the target places atomically (bytes).
    pub atomic_write_unit: u32,
    /// Whether remote writes are refused.
    pub read_only: bool,
    /// Set when the namespace has failed: a write-back of it failed (the text names the call
    /// and its errno), so the target makes nothing on it durable until an operator clears it
    /// (`rpma-target clear-failure`; reloads and restarts keep it). Reads and plain writes still work. Since protocol version 3.
    pub failure: Option<String>,
    /// Set when the target runs the namespace under its power-loss simulation (tests and
    /// debugging only: docs/reliability.md): the label every interface shows beside the
    /// domain, [`SIMULATION_LABEL`](crate::pmem::SIMULATION_LABEL) and whether persist is
    /// broken on purpose. Since protocol version 4.
    pub simulation: Option<String>,
    /// Set when the target cannot give this connection the namespace (the text says why: the
    /// transport cannot register its memory, e.g. page-cache pages on an RDMA device without
    /// on-demand paging). The namespace is listed so that the host can say so, but has no
    /// rkey (`remote_addr` and `rkey` are 0): nothing may be posted to it. The subsystem's
    /// other namespaces are served as usual. Since protocol version 5.
    pub unavailable: Option<String>,
    /// Which file the target maps as this namespace: a hash of the subsystem, the nsid and
    /// the file (its device and inode; a devdax device's device number), the same across
    /// reloads that reopen that file and across restarts, another one once the path names
    /// another file (a restored file moved into place, a retargeted symlink). A host that
    /// reconnects compares it: writes it holds for a re-issue belong to the old file, and a
    /// durability answer from the new one cannot vouch for what the old one was given.
    /// Since protocol version 6.
    pub identity: u64,
}

impl NamespaceDescriptor {
    /// The domain as every interface shows it: "page-cache", or
    /// "page-cache, power-loss simulation (test only)" under the target's simulation.
    pub fn domain_label(&self) -> String {
        match &self.simulation {
            Some(s) => format!("{}, {s}", self.domain),
            None => self.domain.to_string(),
        }
    }
}

/// Target -> host: the connection is open.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectResponse {
    /// The controller id the target assigned to this connection.
    pub controller_id: u16,
    /// The keep-alive period the target will enforce (ms), 0 for none.
    pub keep_alive_ms: u32,
    /// The namespaces this host may reach.
    pub namespaces: Vec<NamespaceDescriptor>,
    /// The queue depth the target grants this connection: how many FlushRequests the host may
    /// have outstanding (sent and not answered) at once. The target keeps that many receives
    /// posted, plus a few more for KeepAlive and Disconnect; iWARP has no receiver-not-ready
    /// retry, so a host that sends more breaks its connection. 0 on a discovery connection
    /// (one DiscoveryRequest at a time). Since protocol version 2.
    pub queue_depth: u32,
    /// How many namespaces the host may reach: more than `namespaces` lists when they do not
    /// all fit in one message, and the host asks for the rest with [`NamespacesRequest`]s
    /// ([`ConnectResponse::paged`]). Since protocol version 7.
    pub namespace_count: u32,
}

/// Host -> target on an admitted connection whose ConnectResponse listed fewer namespaces than
/// its `namespace_count`: the session's namespaces from index `start` (in the order of the
/// listing, nsid order) on. One at a time, each after the last one's answer.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NamespacesRequest {
    /// The first namespace wanted (an index into the listing, not an nsid).
    pub start: u32,
}

/// Target -> host: a page of the session's namespaces, as many from the request's `start` as
/// one message holds ([`NamespacesResponse::page`]). They are the ones the session was admitted
/// with (their rkeys are this connection's), fixed for its life.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NamespacesResponse {
    /// The namespaces, from the request's `start` on.
    pub namespaces: Vec<NamespaceDescriptor>,
    /// How many the whole listing has (the ConnectResponse's `namespace_count`).
    pub total: u32,
}

/// Why a connection was refused. Unknown codes decode as [`RefusalReason::Other`], so an older host
/// still reports a newer target's refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "u16", into = "u16")]
#[non_exhaustive]
pub enum RefusalReason {
    /// No subsystem with that NQN here.
    UnknownSubsystem,
    /// The host NQN is not in the subsystem's allowed hosts.
    HostNotAllowed,
    /// Challenge-response failed (wrong key, replay, reflection).
    AuthFailed,
    /// The host spoke a protocol version the target does not.
    VersionUnsupported,
    /// The connection or queue limit is reached.
    TooManyConnections,
    /// The message sequence was wrong (e.g. a FlushRequest before Connect).
    ProtocolError,
    /// The target is shutting down.
    ShuttingDown,
    /// A code this build does not know.
    Other(u16),
}

impl From<u16> for RefusalReason {
    fn from(c: u16) -> Self {
        match c {
            1 => Self::UnknownSubsystem,
            2 => Self::HostNotAllowed,
            3 => Self::AuthFailed,
            4 => Self::VersionUnsupported,
            5 => Self::TooManyConnections,
            6 => Self::ProtocolError,
            7 => Self::ShuttingDown,
            c => Self::Other(c),
        }
    }
}

impl From<RefusalReason> for u16 {
    fn from(r: RefusalReason) -> u16 {
        match r {
            RefusalReason::UnknownSubsystem => 1,
            RefusalReason::HostNotAllowed => 2,
            RefusalReason::AuthFailed => 3,
            RefusalReason::VersionUnsupported => 4,
            RefusalReason::TooManyConnections => 5,
            RefusalReason::ProtocolError => 6,
            RefusalReason::ShuttingDown => 7,
            RefusalReason::Other(c) => c,
        }
    }
}

/// Target -> host: the connection is refused; the target closes it after this.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    /// Why.
    pub reason: RefusalReason,
    /// A human-readable explanation.
    pub message: String,
}

/// Host -> target on a discovery connection: the listing from entry `start` on.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DiscoveryRequest {
    /// The first entry wanted (0 for the start of the listing). Since protocol version 7.
    pub start: u32,
}

/// One subsystem in a discovery response.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DiscoveryEntry {
    /// The subsystem.
    pub subsystem_nqn: Nqn,
    /// URLs it can be reached at, e.g. `tcp://127.0.0.1:7420`.
    pub listen: Vec<String>,
}

/// Target -> host: one page of the subsystems this host may see, as many entries from the
/// request's `start` as one message holds ([`DiscoveryResponse::page`]).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DiscoveryResponse {
    /// The entries, from the request's `start` on.
    pub entries: Vec<DiscoveryEntry>,
    /// How many entries the whole listing has. Since protocol version 7.
    pub total: u32,
    /// Which listing the page is of: the same for every page of one listing, another value
    /// once the listing changed (a reload): a host reading several pages starts again when it
    /// changes between them. Since protocol version 7.
    pub generation: u64,
}

/// Either way: the sender closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Disconnect {
    /// Why, for the logs.
    pub reason: String,
}
