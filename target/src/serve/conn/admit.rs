//! Admission: a connection whose host the handshake let in becomes a session (its namespaces
//! registered for it, its message slots grown, its ConnectResponse sent) or a discovery
//! session (moved to the discovery pool); or it is refused.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpma_common::fabric;
use rpma_common::proto::auth::Psk;
use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::{Connect, ConnectResponse, Message, RefusalReason};

use super::super::budget::{Pool, Standing};
use super::super::peer_log::Class;
use super::super::registrar::{Outcome, Registrar, Request};
use super::super::session::{unavailable, Grant, Listed, Session};
use super::super::{SessionInfo, MIN_KEEP_ALIVE};
use super::{
    Conn, Phase, Registering, CONTROL_RECV_SLOTS, CONTROL_SEND_SLOTS, RECV_SLACK,
    REGISTRATION_LIMIT, SEND_SLOTS,
};
use crate::config::{Config, Transport};
use crate::namespace::OpenNamespace;

/// Longest keep-alive period a host may ask for (the configuration's own limit).
const MAX_KEEP_ALIVE: Duration = Duration::from_secs(3600);

fn keep_alive_of(c: &Connect, cfg: &Config, max: Duration) -> Duration {
    match c.keep_alive_ms {
        0 => Duration::from_millis(u64::from(cfg.keep_alive_ms)).min(max),
        ms => Duration::from_millis(u64::from(ms)).clamp(MIN_KEEP_ALIVE, max),
    }
}

impl Conn {
    pub(super) fn admit_discovery(&mut self, cfg: &Config, c: Connect, key: Option<Psk>) {
        let shared = Arc::clone(&self.shared);
        if shared.stopping.load(Ordering::SeqCst) {
            let m = "the target is shutting down".to_owned();
            return self.refuse(RefusalReason::ShuttingDown, m, Some(&c.host_nqn));
        }
        // From the unadmitted pool to the discovery pool.
        let limits = shared.limits(Pool::Discovery);
        // A source at its cap, or a full pool, makes room by evicting its oldest session.
        self.ticket = Some(shared.budgets.take(
            Pool::Discovery,
            self.peer.ip(),
            limits,
            self.owner.clone(),
        ));
        let a = &cfg.admission;
        let max = Duration::from_millis(u64::from(a.discovery_max_keep_alive_ms));
        let keep_alive = keep_alive_of(&c, cfg, max);
        let deadline = Instant::now() + Duration::from_millis(u64::from(a.discovery_timeout_ms));
        self.send(&Message::ConnectResponse(ConnectResponse {
            controller_id: 0,
            keep_alive_ms: keep_alive.as_millis() as u32,
            namespaces: Vec::new(),
            queue_depth: 0,
            namespace_count: 0,
        }));
        log::debug!("{}: discovery connection of host {}", self.peer, c.host_nqn);
        shared.events.admitted(true);
        let info = Arc::new(SessionInfo::new("discovery", 0, &c, self.peer, keep_alive));
        let listed = shared.register_discovery(Arc::clone(&info));
        self.phase = Phase::Discovery {
            host: c.host_nqn,
            key,
            keep_alive,
            deadline,
            listed: Listed {
                shared: Arc::clone(&shared),
                key: listed,
                info,
            },
            listing: None,
        };
    }

    /// Admits the host of `c` as a session; `proven`: it proved its key. Whether its subsystem
    /// lists it decides the rest of its standing (see
    /// [`register_session`](super::super::Shared::register_session)).
    pub(super) fn admit(&mut self, cfg: &Config, c: Connect, proven: bool) {
        let standing = Standing::of(proven, crate::subsystem::lists_host(cfg, &c));
        let shared = Arc::clone(&self.shared);
        if shared.stopping.load(Ordering::SeqCst) {
            let m = "the target is shutting down".to_owned();
            return self.refuse(RefusalReason::ShuttingDown, m, Some(&c.host_nqn));
        }
        let keep_alive = keep_alive_of(&c, cfg, MAX_KEEP_ALIVE);
        // Its session's place now, before its namespaces are registered (on rdma://, pinned:
        // a while, by the loop's registrar; `registered` goes on from there): a full target
        // refuses a host that could take nobody's place then, not after pinning for nothing,
        // and makes room for one of a higher standing.
        let place = shared.reserve_session(standing, |controller_id| {
            SessionInfo::new("registering", controller_id, &c, self.peer, keep_alive)
        });
        let Some(place) = place else {
            let m = format!(
                "the target serves at most {} sessions",
                cfg.max_connections.min(0xFFFE)
            );
            return self.refuse(RefusalReason::TooManyConnections, m, Some(&c.host_nqn));
        };
        // Out of the unadmitted pool (newer unadmitted connections from its address must not
        // take its place while its registrations take their time); listed among the sessions
        // a host of a higher standing may take the place of, if it proved no key.
        self.ticket = standing
            .pool()
            .map(|p| shared.budgets.enlist(p, self.peer.ip(), self.owner.clone()));
        let namespaces = self.namespaces_of(&c.subsystem_nqn);
        self.to_register = Some(self.request(namespaces, place.cancel()));
        self.phase = Phase::Registering(Box::new(Registering {
            connect: c,
            keep_alive,
            deadline: Instant::now() + REGISTRATION_LIMIT,
            place,
        }));
    }

    /// The namespaces of `subsystem` now, in nsid order.
    fn namespaces_of(&self, subsystem: &Nqn) -> Vec<Arc<OpenNamespace>> {
        self.shared
            .namespaces()
            .range((subsystem.clone(), 0)..=(subsystem.clone(), u32::MAX))
            .map(|(_, ns)| Arc::clone(ns))
            .collect()
    }

    /// What the registrar is to register for this connection: `namespaces`, until `cancel`.
    fn request(&self, namespaces: Vec<Arc<OpenNamespace>>, cancel: Arc<AtomicBool>) -> Request {
        Request {
            pd: self.pd.clone(),
            namespaces,
            served_by: self.served_by(),
            peer_flush: self.peer_flush,
            cancel,
            replaced: Vec::new(),
        }
    }

    /// The registrations asked for by [`admit`](Self::admit) are back: finishes the admission
    /// (or refuses). Returns the registrations it did not keep, for the registrar to drop (a
    /// deregistration of a pinned namespace takes long too).
    pub(crate) fn registered(
        &mut self,
        outcomes: Vec<(Arc<OpenNamespace>, Outcome)>,
    ) -> Vec<Grant> {
        let unused = Registrar::granted;
        let Phase::Registering(r) = &self.phase else {
            // The connection ended meanwhile (its host disconnected, it was refused).
            return unused(outcomes);
        };
        if self.ticket.as_ref().is_some_and(|t| t.evicted()) {
            // A host of a higher standing took its place: its tick refuses it.
            return unused(outcomes);
        }
        // A reload that added one of its subsystem's namespaces meanwhile (one that removed
        // or replaced one closed the connection: `reloaded`): registered again, as the
        // namespaces are now.
        let now = self.namespaces_of(&r.connect.subsystem_nqn);
        let same = now.len() == outcomes.len()
            && now
                .iter()
                .zip(&outcomes)
                .all(|(n, (o, out))| Arc::ptr_eq(n, o) && !matches!(out, Outcome::Cancelled));
        if !same {
            let cancel = r.place.cancel();
            self.to_register = Some(self.request(now, cancel));
            return unused(outcomes);
        }
        let shared = Arc::clone(&self.shared);
        let Phase::Registering(r) = std::mem::replace(
            &mut self.phase,
            Phase::Closing {
                deadline: Instant::now() + super::LINGER,
            },
        ) else {
            unreachable!("matched above")
        };
        let Registering {
            connect: c,
            keep_alive,
            place,
            ..
        } = *r;
        if shared.stopping.load(Ordering::SeqCst) {
            drop(place);
            let m = "the target is shutting down".to_owned();
            self.refuse(RefusalReason::ShuttingDown, m, Some(&c.host_nqn));
            return unused(outcomes);
        }
        let mut grants = BTreeMap::new();
        let mut descriptors = Vec::new();
        // Registrations not kept (to drop in the registrar).
        let mut left = Vec::new();
        let mut outcomes = outcomes.into_iter();
        while let Some((ns, outcome)) = outcomes.next() {
            let nsid = ns.config.nsid;
            match outcome {
                // A page of it could not be read back (docs/persistence.md): its mapping
                // serves nothing more, so it is listed unavailable instead of registered, and
                // the host does not send Reads that would each end its connection.
                Outcome::Unreadable(at) => descriptors.push(unavailable(
                    &ns,
                    format!(
                        "the target could not read back the page at offset {at} (a media \
                         error, or its file truncated by another process) until it is reopened"
                    ),
                )),
                // A page of it that could not be read back since it was registered: as above.
                Outcome::Registered(Ok((g, _))) if ns.mapping.unreadable_at().is_some() => {
                    let at = ns.mapping.unreadable_at().unwrap_or_default();
                    left.push(g);
                    descriptors.push(unavailable(
                        &ns,
                        format!(
                            "the target could not read back the page at offset {at} (a media \
                             error, or its file truncated by another process) until it is \
                             reopened"
                        ),
                    ));
                }
                Outcome::Registered(Ok((g, d))) => {
                    grants.insert(nsid, g);
                    descriptors.push(d);
                }
                Outcome::Cancelled => unreachable!("checked above"),
                // Out of keys or room: the target is full, the host may try again later.
                Outcome::Registered(Err(e @ fabric::Error::Exhausted { .. })) => {
                    shared.peer_log.log(
                        self.peer.ip(),
                        Class::Session,
                        log::Level::Error,
                        format_args!(
                            "cannot register namespace {nsid} of {} for {}: {e}",
                            c.subsystem_nqn, self.peer
                        ),
                    );
                    let m = format!("the target cannot register namespace {nsid}: {e}");
                    // (The place is given back before the host hears of it.)
                    drop(place);
                    self.refuse(RefusalReason::TooManyConnections, m, Some(&c.host_nqn));
                    left.extend(grants.into_values());
                    left.extend(unused(outcomes.collect()));
                    return left;
                }
                // This namespace cannot be registered on this transport (no ODP for page
                // cache, ...): it is listed with the reason and the others are served.
                Outcome::Registered(Err(e)) => {
                    let why = rpma_common::error_chain(&e);
                    ns.note_unregistrable(&why);
                    let m = format!("the target cannot register it on this transport: {why}");
                    descriptors.push(unavailable(&ns, m));
                }
            }
        }
        let responder = self.qp.responder_counters();
        let rkeys: Vec<(u32, u32)> = grants.iter().map(|(n, g)| (*n, g.mr.rkey())).collect();
        // The session's message slots, posted before the host may use them.
        let more_recv = (self.queue_depth as usize + RECV_SLACK).saturating_sub(CONTROL_RECV_SLOTS);
        let more_send = SEND_SLOTS.saturating_sub(CONTROL_SEND_SLOTS);
        if let Err(e) = self.bufs.grow(&self.pd, &self.qp, more_recv, more_send) {
            drop(place);
            let m = format!("the target cannot allocate the session's buffers: {e}");
            // Out of room the other sessions hold (completion queue entries, locked memory):
            // full for now, as for a namespace's registration above.
            let reason = match e {
                fabric::Error::Exhausted { .. } => RefusalReason::TooManyConnections,
                _ => RefusalReason::Other(1000),
            };
            self.refuse(reason, m, Some(&c.host_nqn));
            left.extend(grants.into_values());
            return left;
        }
        // Its entry in the place it took at admission, with what it was granted; the session
        // gives the place back when it ends.
        let info = Arc::new(
            SessionInfo::new("io", place.controller_id, &c, self.peer, keep_alive)
                .with_data(responder, rkeys),
        );
        shared.replace_session(Arc::clone(&info));
        place.keep();
        let mut resp = ConnectResponse {
            controller_id: info.controller_id,
            keep_alive_ms: info.keep_alive_ms,
            namespaces: descriptors,
            queue_depth: self.queue_depth,
            namespace_count: 0,
        };
        // As many namespaces as fit, the rest a page at a time; long failure texts are cut.
        let listing = resp.paged().map(Vec::into_boxed_slice);
        let resp = Message::ConnectResponse(resp);
        let mut session = Session {
            shared: Arc::clone(&shared),
            info,
            subsystem: c.subsystem_nqn,
            host: c.host_nqn,
            keep_alive,
            grants,
            listing,
        };
        match resp.encode() {
            Ok(bytes) => {
                shared.peer_log.log(
                    self.peer.ip(),
                    Class::Session,
                    log::Level::Info,
                    format_args!(
                        "session ctrl {}: host {} on {} from {} (queue {}, {} namespace(s), \
                         keep-alive {} ms)",
                        session.info.controller_id,
                        session.host,
                        session.subsystem,
                        self.peer,
                        c.queue_id,
                        session.grants.len(),
                        session.info.keep_alive_ms
                    ),
                );
                self.phase = Phase::Session(Box::new(session));
                // Its keep-alive period runs from now, not from its Connect: its registrations
                // may have taken longer than the period.
                self.last_seen = Instant::now();
                shared.events.admitted(false);
                self.send_raw(&bytes);
            }
            Err(e) => {
                let host = session.host.clone();
                // Its registrations are dropped by the registrar too.
                left.extend(std::mem::take(&mut session.grants).into_values());
                drop(session);
                self.refuse(RefusalReason::Other(1000), format!("{e}"), Some(&host));
            }
        }
        left
    }

    /// A message from a host whose namespaces are being registered: nothing is due from it
    /// before its ConnectResponse but a Disconnect (it gave up waiting); any other message is
    /// out of place, as in the handshake.
    pub(super) fn registering_message(&mut self, buf: &[u8], now: Instant) {
        let Phase::Registering(r) = &self.phase else {
            return;
        };
        let host = r.connect.host_nqn.clone();
        match Message::decode(buf) {
            Ok(Message::Disconnect(d)) => {
                log::debug!(
                    "{}: host {host} disconnected while its namespaces were being registered: \
                     {}",
                    self.peer,
                    super::super::peer_log::peer_text(&d.reason)
                );
                self.leave_session_pool();
                self.phase = Phase::Closing {
                    deadline: now + super::LINGER,
                };
            }
            Ok(other) => self.refuse(
                RefusalReason::ProtocolError,
                format!("{:?} before the ConnectResponse", other.message_type()),
                Some(&host),
            ),
            Err(e) => self.refuse(RefusalReason::ProtocolError, e.to_string(), Some(&host)),
        }
    }

    /// A host whose namespaces were being registered lost its place in `pool` to a host of a
    /// higher standing: refused as the full target it is now.
    pub(super) fn registering_evicted(&mut self, pool: Pool) {
        let Phase::Registering(r) = &self.phase else {
            return;
        };
        let host = r.connect.host_nqn.clone();
        let (who, this) = pool.evicted_by();
        let max = self.shared.config().max_connections;
        let m = format!(
            "the target is full (max_connections {max}) and {who} took this host's place \
             ({this})"
        );
        self.refuse(RefusalReason::TooManyConnections, m, Some(&host));
    }

    /// Its registrations did not come back within [`REGISTRATION_LIMIT`]: refused.
    pub(super) fn registering_expired(&mut self) {
        let Phase::Registering(r) = &self.phase else {
            return;
        };
        let host = r.connect.host_nqn.clone();
        let m = format!(
            "the target could not register the namespaces within {} s",
            REGISTRATION_LIMIT.as_secs()
        );
        self.refuse(RefusalReason::TooManyConnections, m, Some(&host));
    }

    /// The target stops: a host whose namespaces are being registered is refused so.
    pub(crate) fn refuse_registering_at_stop(&mut self) {
        if let Phase::Registering(r) = &self.phase {
            let host = r.connect.host_nqn.clone();
            let m = "the target is shutting down".to_owned();
            self.refuse(RefusalReason::ShuttingDown, m, Some(&host));
        }
    }

    /// A reload while its namespaces are being registered (as they were before it): if the
    /// reload changes its subsystem's namespaces or its own entry, its queue pair goes to
    /// Error now, so that nothing registered for it (a region over a file the reload took
    /// away may be made after this) is ever reachable, and the host connects again; a host
    /// the reload lists now leaves the lowest class, as a session does.
    pub(super) fn registering_reloaded(&mut self, diff: &crate::reload::ConfigDiff) {
        let Phase::Registering(r) = &self.phase else {
            return;
        };
        let (sub, host) = (r.connect.subsystem_nqn.clone(), r.connect.host_nqn.clone());
        let touched = diff.touches_session(&sub, &host)
            || diff
                .namespaces_removed
                .iter()
                .chain(&diff.namespaces_changed)
                .any(|(s, _)| *s == sub);
        if !touched {
            self.promote_if(diff.lists_now(&sub, &host));
            return;
        }
        self.shared.peer_log.log(
            self.peer.ip(),
            Class::Session,
            log::Level::Info,
            format_args!(
                "host {host} from {}: closed while its namespaces were being registered: the \
                 reload changed its subsystem or its entry (it may connect again)",
                self.peer
            ),
        );
        self.qp.to_error();
        self.leave_session_pool();
        self.phase = Phase::Closing {
            deadline: Instant::now(),
        };
    }

    /// The transport this connection came in on, and (rdma) its listener's operator
    /// declaration `direct_write_to_pmem`, which decides whether APM is offered
    /// ([`declares_direct_write`]).
    fn served_by(&self) -> (Transport, bool) {
        let info = self.qp.info();
        if info.tcp.is_some() {
            return (Transport::Tcp, false);
        }
        let cfg = self.shared.config();
        (
            Transport::Rdma,
            declares_direct_write(&cfg.listeners, info.local_addr),
        )
    }
}

/// Whether the rdma listeners that may have taken a connection to `local` declare
/// `direct_write_to_pmem`: those on its port whose host is its address, the wildcard, or a
/// name (not resolved here); all of them must declare it (a declaration that one of two
/// listeners contradicts offers nothing: APM where Writes are not durable would be a lie, its
/// absence only slower). None found declares nothing, which offers GPSPM only. (The first one
/// found decided: a listener named by host name, listed first, declared it for every address.)
fn declares_direct_write(listeners: &[crate::config::Listener], local: SocketAddr) -> bool {
    let mut candidates = listeners
        .iter()
        .filter(|l| l.url.transport == Transport::Rdma && l.url.port == local.port())
        .filter(|l| {
            l.url.host.parse::<std::net::IpAddr>().map_or(true, |ip| {
                ip.is_unspecified() || ip == local.ip().to_canonical()
            })
        })
        .peekable();
    candidates.peek().is_some() && candidates.all(|l| l.direct_write_to_pmem)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ListenUrl, Listener};

    fn rdma(url: &str, dwp: bool) -> Listener {
        Listener {
            url: ListenUrl::parse(url).unwrap(),
            direct_write_to_pmem: dwp,
        }
    }

    #[test]
    fn a_declaration_holds_only_where_no_listener_of_the_address_contradicts_it() {
        let local: SocketAddr = "10.0.1.1:7420".parse().unwrap();
        // One listener of the address: its declaration.
        assert!(declares_direct_write(
            &[rdma("rdma://10.0.1.1:7420", true)],
            local
        ));
        assert!(!declares_direct_write(
            &[rdma("rdma://10.0.1.1:7420", false)],
            local
        ));
        assert!(declares_direct_write(
            &[rdma("rdma://0.0.0.0:7420", true)],
            local
        ));
        // Another address or port, or none: nothing declared.
        assert!(!declares_direct_write(
            &[rdma("rdma://10.0.1.2:7420", true)],
            local
        ));
        assert!(!declares_direct_write(
            &[rdma("rdma://10.0.1.1:7421", true)],
            local
        ));
        assert!(!declares_direct_write(&[], local));
        // A name listed first that declares it, and the address itself that does not.
        let both = [
            rdma("rdma://pmem-a.lan:7420", true),
            rdma("rdma://10.0.1.1:7420", false),
        ];
        assert!(!declares_direct_write(&both, local));
        // Both declare it: it holds.
        let agree = [
            rdma("rdma://pmem-a.lan:7420", true),
            rdma("rdma://10.0.1.1:7420", true),
        ];
        assert!(declares_direct_write(&agree, local));
    }
}
