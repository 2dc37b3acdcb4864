//! An admitted host's session: the namespaces granted to it, each a memory region in its
//! connection's own protection domain (the rkeys), and what a reload does to them; and a
//! discovery connection's entry in `status` ([`Listed`]). conn.rs admits a connection to either
//! and keeps it in its phase; this file names no connection.
//!
//! # Rkeys
//!
//! Every connection has a protection domain of its own, and at admission each namespace the host
//! may reach is registered in it as a memory region over the namespace's mapping, with the
//! rights the namespace allows (no remote write on a read-only one). Its rkey is therefore
//! usable by this connection's queue pair only; deregistering it (dropping the [`Grant`]) is the
//! revocation, after which a Write with the old rkey is answered with RemoteAccess. What the host
//! asked for before (Read Responses still queued for a host that stopped reading) still goes
//! out, unless the namespace was removed or changed by a reload: then its region is revoked
//! first ([`MemoryRegion::revoke`]), and nothing more of the file leaves (it may be another
//! subsystem's now). A session's end (a goodbye, before its Disconnect) only deregisters: the
//! host's last Reads are answered, not failed with RemoteAccess.
//!
//! Why not one region per namespace in a shared domain plus a memory window per connection: on
//! this fabric a window may only carry remote rights its region has, so the shared region would
//! hold remote write itself, and its rkey (STags are a slot index and an 8-bit key, easy to
//! guess) would be usable by every queue pair of the domain — including a connection that has
//! not sent its Connect yet. A per-connection domain closes that hole; the fabric change that
//! would allow register-once is described in docs/architecture.md.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rpma_common::fabric::{self, MemoryRegion, ProtectionDomain};
use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::{DurabilityMethods, NamespaceDescriptor};

use super::{SessionInfo, Shared};
use crate::config::Transport;
use crate::metrics::EndReason;
use crate::namespace::{access_for, wire_domain, NsKey, OpenNamespace};
use crate::reload::ConfigDiff;

/// The largest write the placement engine executes as one indivisible store (Atomic Write).
const ATOMIC_WRITE_UNIT: u32 = 8;

/// A namespace this connection may reach: the region that carries its rkey.
pub(crate) struct Grant {
    pub(crate) ns: Arc<OpenNamespace>,
    /// The namespace's region in the connection's domain: its rkey is the host's.
    pub(super) mr: Arc<MemoryRegion>,
}

impl Drop for Grant {
    fn drop(&mut self) {
        test_hold(TEST_DEREGISTER_HOLD_ENV, "deregistration");
        self.ns.counters.sessions.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An admitted host.
pub(crate) struct Session {
    /// Where it is registered (given back on drop).
    pub(super) shared: Arc<Shared>,
    pub(crate) info: Arc<SessionInfo>,
    pub(crate) subsystem: Nqn,
    pub(crate) host: Nqn,
    /// The keep-alive period agreed at admission.
    pub(super) keep_alive: Duration,
    pub(crate) grants: BTreeMap<u32, Grant>,
    /// Its namespaces as its ConnectResponse described them, when they did not all fit in it:
    /// the host asks for the rest with NamespacesRequests (`ConnectResponse::paged`).
    pub(crate) listing: Option<Box<[NamespaceDescriptor]>>,
}

impl Drop for Session {
    fn drop(&mut self) {
        // Grants (and with them the rkeys) go with the session.
        self.grants.clear();
        self.shared.unregister_session(self.info.controller_id);
    }
}

impl Session {
    /// A reload: if the diff touches the session or changes one of its namespaces, the reason to
    /// close it, for its Disconnect (which names the namespace, so that the host reconnects and
    /// sees the new descriptor instead of a RemoteAccess later); else None, once the rkeys of its
    /// namespaces that were removed are revoked. `peer` is the host's address, for the log.
    /// With the reason, what the session's end is counted as: a reload, or a namespace that
    /// failed (a page that could not be read back: no reload of the operator's).
    pub(super) fn reloaded(
        &mut self,
        diff: &ConfigDiff,
        peer: SocketAddr,
    ) -> Option<(EndReason, String)> {
        let in_diff = |list: &[NsKey], nsid: u32| {
            list.iter()
                .any(|(sub, n)| *n == nsid && *sub == self.subsystem)
        };
        // Whether the session stays or goes: what is queued from a namespace whose file may
        // serve someone else now (removed, or another file in its place) sends no further
        // byte. One changed in place (its size, say) still answers what was asked before the
        // session's Disconnect: a revoked Read fails the host's request for good (RemoteAccess),
        // where one answered and then closed is retried.
        let now = self.shared.namespaces();
        for (&nsid, g) in &self.grants {
            let another_file = in_diff(&diff.namespaces_changed, nsid)
                && now
                    .get(&(self.subsystem.clone(), nsid))
                    .is_none_or(|n| n.file_id().is_none() || n.file_id() != g.ns.file_id());
            if in_diff(&diff.namespaces_removed, nsid) || another_file {
                g.mr.revoke();
            }
        }
        if diff.touches_session(&self.subsystem, &self.host) {
            log::info!(
                "session ctrl {} (host {} from {}): its subsystem or host entry changed: closing",
                self.info.controller_id,
                self.host,
                peer
            );
            return Some((
                EndReason::Reload,
                "the target's configuration for this host changed".to_owned(),
            ));
        }
        // The session's namespaces in one of the diff's lists.
        let held = |list: &[NsKey]| -> Vec<String> {
            self.grants
                .keys()
                .filter(|&&nsid| in_diff(list, nsid))
                .map(u32::to_string)
                .collect()
        };
        let cleared = held(&diff.namespaces_cleared);
        if !cleared.is_empty() {
            let ids = cleared.join(", ");
            log::info!(
                "session ctrl {} (host {} from {}): the failure of namespace(s) {ids} was \
                 cleared: closing",
                self.info.controller_id,
                self.host,
                peer
            );
            return Some((
                EndReason::Reload,
                format!("namespace(s) {ids} reopened: an operator cleared the failure"),
            ));
        }
        let unreadable = held(&diff.namespaces_unreadable);
        if !unreadable.is_empty() {
            let ids = unreadable.join(", ");
            log::info!(
                "session ctrl {} (host {} from {}): a page of namespace(s) {ids} could not be \
                 read back: closing",
                self.info.controller_id,
                self.host,
                peer
            );
            return Some((
                EndReason::NamespaceFailed,
                format!("namespace(s) {ids} failed: a page could not be read back"),
            ));
        }
        let changed = held(&diff.namespaces_changed);
        if !changed.is_empty() {
            let (what, ids) = match changed.len() {
                1 => ("namespace", changed[0].clone()),
                _ => ("namespaces", changed.join(", ")),
            };
            log::info!(
                "session ctrl {} (host {} from {}): {what} {ids} changed by reload: closing",
                self.info.controller_id,
                self.host,
                peer
            );
            return Some((EndReason::Reload, format!("{what} {ids} changed by reload")));
        }
        let gone: Vec<u32> = self
            .grants
            .keys()
            .copied()
            .filter(|&nsid| in_diff(&diff.namespaces_removed, nsid))
            .collect();
        for nsid in gone {
            self.grants.remove(&nsid);
            log::info!(
                "session ctrl {}: namespace {nsid} removed by reload: its rkey is revoked",
                self.info.controller_id
            );
        }
        None
    }
}

/// Test hook (never set in production): a path; each registration waits until a file is
/// there, having logged that it waits (a registration that takes long, as pinning a big
/// namespace does, without a big namespace).
pub const TEST_REGISTER_HOLD_ENV: &str = "RPMA_TARGET_TEST_REGISTER_HOLD";

/// Test hook (never set in production): as [`TEST_REGISTER_HOLD_ENV`], for the drop of each
/// registration (a deregistration that takes long, as unpinning a big namespace does).
pub const TEST_DEREGISTER_HOLD_ENV: &str = "RPMA_TARGET_TEST_DEREGISTER_HOLD";

/// What the test hook `env` asks: wait, having said so, while its path is not there.
fn test_hold(env: &str, what: &str) {
    let Some(path) = std::env::var_os(env) else {
        return;
    };
    let path = std::path::PathBuf::from(path);
    if !path.exists() {
        log::info!("test hook: a {what} waits until {} exists", path.display());
        while !path.exists() {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Registers `ns` in a connection's domain `pd` with the rights it allows; the durability
/// methods offered are those of the transport the connection `served_by` (and its listener's
/// `direct_write_to_pmem`), without RDMA Flush unless the peer can send it (`peer_flush`).
pub(super) fn grant(
    pd: &ProtectionDomain,
    ns: &Arc<OpenNamespace>,
    served_by: (Transport, bool),
    peer_flush: bool,
) -> fabric::Result<(Grant, NamespaceDescriptor)> {
    test_hold(TEST_REGISTER_HOLD_ENV, "registration");
    let access = access_for(ns.config.read_only, ns.domain());
    let mr = pd.register(Arc::clone(&ns.mapping), access)?;
    let (transport, direct_write_to_pmem) = served_by;
    let mut methods = ns.methods(transport, direct_write_to_pmem);
    if !peer_flush {
        methods = DurabilityMethods(methods.0 & !DurabilityMethods::FLUSH.0);
    }
    let d = NamespaceDescriptor {
        nsid: ns.config.nsid,
        size: ns.size(),
        block_size: ns.config.block_size,
        remote_addr: mr.addr(),
        rkey: mr.rkey(),
        domain: wire_domain(ns.domain()),
        durability: methods,
        atomic_write_unit: ATOMIC_WRITE_UNIT,
        read_only: ns.config.read_only,
        failure: ns.failure().map(|f| f.to_string()),
        simulation: ns.mapping.simulation().map(|s| s.label()),
        unavailable: None,
        identity: ns.identity(),
    };
    ns.counters.sessions.fetch_add(1, Ordering::Relaxed);
    Ok((
        Grant {
            ns: Arc::clone(ns),
            mr,
        },
        d,
    ))
}

/// The descriptor of a namespace a connection cannot be given: listed with the reason (what
/// the host is told), no rkey, nothing durable.
pub(super) fn unavailable(ns: &OpenNamespace, reason: String) -> NamespaceDescriptor {
    NamespaceDescriptor {
        nsid: ns.config.nsid,
        size: ns.size(),
        block_size: ns.config.block_size,
        remote_addr: 0,
        rkey: 0,
        domain: wire_domain(ns.domain()),
        durability: DurabilityMethods::NONE,
        atomic_write_unit: 0,
        read_only: ns.config.read_only,
        failure: ns.failure().map(|f| f.to_string()),
        simulation: ns.mapping.simulation().map(|s| s.label()),
        unavailable: Some(reason),
        identity: ns.identity(),
    }
}

/// A discovery connection's entry in `status`, removed with it.
pub(crate) struct Listed {
    /// Where it is listed.
    pub(super) shared: Arc<Shared>,
    /// Its key there.
    pub(super) key: u64,
    /// What `status` shows of it.
    pub(super) info: Arc<SessionInfo>,
}

impl Drop for Listed {
    fn drop(&mut self) {
        self.shared.unregister_discovery(self.key);
    }
}
