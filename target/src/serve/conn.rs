//! One connection, owned by one poll loop: the control exchange over Send/Recv, the session it
//! becomes, and its end.
//!
//! ```text
//! Handshake --Admitted--> Registering --registered--> Session --Disconnect / keep-alive lapse /
//!                                                                reload / stop------> Closing
//!           --Discovery-> Discovery --Disconnect / keep-alive lapse / time limit-----> Closing
//!           --Refuse----------------------------------------------------------------> Closing
//! ```
//!
//! # Budgets
//!
//! A connection in its handshake holds a place in the unadmitted pool, a discovery connection
//! one in the discovery pool ([`super::budget`]); an evicted one is dropped at once. An
//! admitted session leaves the pools and counts against `max_connections`. Until admission a
//! connection has the few message slots its handshake needs; a session gets the rest (its queue
//! depth) at admission, posted before its ConnectResponse is sent.
//!
//! Every line a peer can cause (refusals, protocol errors, abandoned handshakes, and the session
//! lines: start, end, keep-alive lapse, lost connection) is logged rate-limited per peer address
//! and in all ([`super::peer_log`]), its peer-supplied strings escaped.
//!
//! Admission itself (a session's namespaces registered and its slots grown, or the move to the
//! discovery pool) is in [`admit`]; the registrations are made off the loop, by its
//! [`super::registrar`], while the connection waits in [`Phase::Registering`]. An admitted
//! session, the namespaces granted to it (its rkeys) and what a reload does to them are in
//! [`super::session`], with a discovery connection's entry in `status`. A discovery
//! connection's messages (its listing, a page at a time) are in [`discovery`]. A connection's
//! end (the goodbye, and the session's registrations handed to the registrar to drop) is in
//! [`close`].

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpma_common::fabric::{ProtectionDomain, QpState, QueuePair};
use rpma_common::proto::auth::Psk;
use rpma_common::proto::msgbuf::MsgBufs;
use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::{
    DiscoveryEntry, FlushRequest, FlushResponse, FlushStatus, Message, NamespacesResponse, Refusal,
    RefusalReason,
};
use rpma_common::stats::Stopwatch;

use super::budget::{Pool, Ticket};
use super::peer_log::{peer_text, Class};
use super::registrar::Request;
use super::session::{Grant, Listed, Session};
use super::{LoopTx, SessionInfo, Shared, LINGER};
use crate::config::Config;
use crate::handshake::{Step, TargetHandshake};
use crate::metrics::{EndReason, HandshakeFailure, LoopStats};
use crate::namespace::OpenNamespace;

mod admit;
mod close;
mod discovery;

/// Receive slots beyond the queue depth: room for keep-alives and a Disconnect.
pub(crate) const RECV_SLACK: usize = 4;
/// Send slots per admitted session (more messages wait in its backlog).
pub(crate) const SEND_SLOTS: usize = 16;
/// Receive slots a connection has until its host is admitted to a subsystem (and for good on
/// a discovery connection): its Connect, an AuthResponse, a Disconnect and one spare. The rest
/// of a session's slots (its queue depth, [`RECV_SLACK`]) are posted at admission, before the
/// ConnectResponse goes out.
pub(crate) const CONTROL_RECV_SLOTS: usize = 4;
/// Send slots until admission (a challenge and a confirmation, or a refusal; more wait in the
/// backlog).
pub(crate) const CONTROL_SEND_SLOTS: usize = 2;

pub(crate) enum Phase {
    Handshake {
        hs: TargetHandshake,
        deadline: Instant,
    },
    Discovery {
        host: Nqn,
        /// The key the host proved, if it has one (it sees the subsystems that need it).
        key: Option<Psk>,
        keep_alive: Duration,
        /// The session's time limit (`discovery_timeout_ms`).
        deadline: Instant,
        listed: Listed,
        /// Its listing, made at its first DiscoveryRequest and again only after a reload: each
        /// page is cut from it.
        listing: Option<Box<DiscoveryListing>>,
    },
    /// Admitted; its namespaces are being registered by the loop's registrar
    /// ([`Conn::take_registration`], [`Conn::registered`]).
    Registering(Box<Registering>),
    Session(Box<Session>),
    /// The last message is out (or going): drop the connection when the peer closes or at
    /// `deadline`.
    Closing {
        deadline: Instant,
    },
}

/// A discovery connection's listing ([`Phase::Discovery`]), with the configuration it was made
/// from: a reload puts another one in place, and the next request makes it again.
pub(crate) struct DiscoveryListing {
    config: Arc<Config>,
    entries: Vec<DiscoveryEntry>,
    generation: u64,
}

/// An admitted host whose namespaces are being registered: what finishing its admission needs.
pub(crate) struct Registering {
    pub(super) connect: rpma_common::proto::Connect,
    pub(super) keep_alive: Duration,
    /// Refused if its registrations are not back by then ([`REGISTRATION_LIMIT`]).
    pub(super) deadline: Instant,
    /// Its session's place, taken at admission (it counts against `max_connections`, and a
    /// host of a higher standing may take it: its ticket); given back, and what is not
    /// registered yet called off, when it drops.
    pub(super) place: super::shared::Reserved,
}

/// How long an admitted host's registrations may take (pinning a big namespace on `rdma://`
/// takes a while; its host's own connect timeout is usually shorter).
pub(crate) const REGISTRATION_LIMIT: Duration = Duration::from_secs(600);

/// Counts a message from the host in a connection's status.
fn seen(info: &SessionInfo, now: Instant) {
    info.messages.fetch_add(1, Ordering::Relaxed);
    info.last_seen_ms.store(
        now.duration_since(info.started).as_millis() as u64,
        Ordering::Relaxed,
    );
}

/// A flush the connection asks the loop's flusher for.
pub(crate) struct FlushJob {
    pub(crate) ns: Arc<OpenNamespace>,
    pub(crate) req: FlushRequest,
    /// When the request was taken in (for the arrival-to-answer histogram).
    pub(crate) arrived: Stopwatch,
}

/// A connection.
pub(crate) struct Conn {
    shared: Arc<Shared>,
    pub(crate) qp: QueuePair,
    pd: ProtectionDomain,
    pub(crate) bufs: MsgBufs,
    pub(crate) peer: SocketAddr,
    peer_flush: bool,
    pub(crate) phase: Phase,
    last_seen: Instant,
    /// The transport's count of messages taken from the peer when the loop last looked, and
    /// when the loop first saw it at that value ([`Conn::last_heard`]).
    rx_seen: u64,
    rx_changed: Instant,
    /// Its place in the unadmitted or the discovery pool; None once admitted.
    ticket: Option<Ticket>,
    /// Its poll loop (woken when a pool evicts it).
    owner: LoopTx,
    /// FlushRequests the host may have outstanding (receives posted beyond it: slack).
    queue_depth: u32,
    /// FlushRequests handed to the loop's flusher and not answered yet: one more than
    /// `queue_depth` is a protocol error (the host sends before it has its answers).
    flushes_out: u32,
    /// More answers wait to be sent than the connection has message slots at the target: the
    /// peer does not take them (its socket is not read). The loop drops the connection at its
    /// next tick; nothing more is sent or taken in.
    overrun: bool,
    /// Which of the loop's connections this is (a queue pair number may be reused once a
    /// connection is gone; a flush of the old one must not be answered on the new one).
    pub(crate) serial: u64,
    /// Its poll loop's counts (the Terminates it sent are added when it is dropped).
    stats: Arc<LoopStats>,
    /// Registrations for its loop's registrar to make ([`Conn::take_registration`]).
    to_register: Option<Request>,
    /// Its ended session's registrations, for its loop's registrar to drop
    /// ([`Conn::take_release`]).
    to_release: Vec<Grant>,
    /// The Disconnect to send once they are dropped ([`Conn::released`]).
    disconnect_after_release: Option<String>,
    /// Its registrations are with the registrar, not dropped yet.
    releasing: bool,
    /// The subsystem and host of its session, once ended (what a reload may touch).
    ended: Option<(Nqn, Nqn)>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(r) = self.qp.responder_counters() {
            self.stats.add_terminates(&r.terminates());
        }
    }
}

impl Conn {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        shared: &Arc<Shared>,
        qp: QueuePair,
        pd: ProtectionDomain,
        bufs: MsgBufs,
        ticket: Ticket,
        owner: LoopTx,
        queue_depth: u32,
        serial: u64,
        deadline: Instant,
        stats: Arc<LoopStats>,
    ) -> Conn {
        let info = qp.info();
        let now = Instant::now();
        Conn {
            shared: Arc::clone(shared),
            peer: info.peer_addr,
            peer_flush: info.peer_flush,
            qp,
            pd,
            bufs,
            phase: Phase::Handshake {
                hs: TargetHandshake::new(),
                deadline,
            },
            last_seen: now,
            rx_seen: 0,
            rx_changed: now,
            ticket: Some(ticket),
            owner,
            queue_depth,
            flushes_out: 0,
            overrun: false,
            serial,
            stats,
            to_register: None,
            to_release: Vec::new(),
            disconnect_after_release: None,
            releasing: false,
            ended: None,
        }
    }

    /// What the connection asks its loop's registrar to register, if anything (once).
    pub(crate) fn take_registration(&mut self) -> Option<Request> {
        self.to_register.take()
    }

    /// When the peer was last heard from, as far as the loop can tell at `now`: its last control
    /// message, or the first look at which the transport had taken more messages (one-sided
    /// Writes and Reads included) than at the look before, where the transport takes them in
    /// this thread (`tcp`; an RNIC serves them without the loop). Never earlier than the truth:
    /// a count that moved between two looks is dated at the second.
    pub(crate) fn last_heard(&mut self, now: Instant) -> Instant {
        if let Some(n) = self.qp.messages_received() {
            if n != self.rx_seen {
                self.rx_seen = n;
                self.rx_changed = now;
            }
        }
        self.rx_changed.max(self.last_seen)
    }

    /// Counts the end of the session, if this connection is one.
    pub(crate) fn session_ended(&self, why: EndReason) {
        if let Phase::Session(_) = self.phase {
            self.shared.events.ended(why);
        }
    }

    fn send(&mut self, m: &Message) {
        match m.encode() {
            Ok(bytes) => self.send_raw(&bytes),
            Err(e) => log::error!("{}: cannot encode {:?}: {e}", self.peer, m.message_type()),
        }
    }

    /// Sends an already encoded message (or drops it, once the peer has stopped taking them).
    pub(crate) fn send_raw(&mut self, bytes: &[u8]) {
        if self.overrun {
            return;
        }
        if let Err(e) = self.bufs.send(&self.qp, bytes) {
            // The queue pair is in Error: the loop drops the connection on its next tick.
            log::debug!("{}: cannot send: {e}", self.peer);
        }
        // A host that keeps its FlushRequests within its queue depth and sends a KeepAlive
        // every half period never has more answers waiting than it has slots here; one that
        // sends without reading would have the backlog grow without end.
        let slots = self.bufs.recv_slots() + self.bufs.send_slots();
        let waiting = self.bufs.unsent();
        if waiting > slots {
            self.overrun = true;
            self.shared.peer_log.warn(
                self.peer.ip(),
                format_args!(
                    "{}: closed: it does not take the target's answers ({waiting} waiting to \
                     be sent)",
                    self.peer
                ),
            );
        }
    }

    /// Whether the connection is to be dropped now: its peer does not take its answers.
    pub(crate) fn overrun(&self) -> bool {
        self.overrun
    }

    /// Answers a FlushRequest the loop's flusher completed.
    pub(crate) fn flush_answered(&mut self, resp: &FlushResponse) {
        self.flushes_out = self.flushes_out.saturating_sub(1);
        self.send_raw(&resp.encode());
    }

    fn refuse(&mut self, reason: RefusalReason, message: String, host: Option<&Nqn>) {
        self.shared.events.refused(reason);
        self.shared.peer_log.warn(
            self.peer.ip(),
            format_args!(
                "refused host {} from {}: {reason:?}: {message}",
                host.map_or_else(|| "(unknown)".to_owned(), |h| h.to_string()),
                self.peer
            ),
        );
        // Its places (a pool's, a session's reserved for it) are given back before the host
        // hears of the refusal.
        self.leave_session_pool();
        self.phase = Phase::Closing {
            deadline: Instant::now() + LINGER,
        };
        self.send(&Message::Refusal(Refusal { reason, message }));
    }

    /// A receive that brought no message (a Write with immediate data): a protocol error.
    pub(crate) fn unexpected_receive(&mut self, opcode: rpma_common::fabric::WcOpcode) {
        let what = format!(
            "a receive completed as {opcode:?}: only Send messages are part of the protocol"
        );
        match self.phase {
            Phase::Closing { .. } => {}
            // Before a session, as any message out of place there: refused.
            Phase::Handshake { .. } | Phase::Registering(_) => {
                self.refuse(RefusalReason::ProtocolError, what, None)
            }
            _ => self.protocol_error(what),
        }
    }

    /// Handles one received message; flush requests for the loop's flusher go to `jobs`.
    pub(crate) fn on_message(&mut self, buf: &[u8], jobs: &mut Vec<FlushJob>) {
        if self.overrun {
            return;
        }
        let shared = Arc::clone(&self.shared);
        let now = Instant::now();
        match &mut self.phase {
            Phase::Handshake { hs, .. } => {
                let cfg = shared.config();
                let steps = hs.on_message(&cfg, buf);
                for step in steps {
                    match step {
                        Step::Send(m) => self.send(&m),
                        Step::Refuse { refusal, host_nqn } => {
                            self.refuse(refusal.reason, refusal.message, host_nqn.as_ref());
                        }
                        Step::Abandoned { why, host_nqn } => {
                            self.shared
                                .events
                                .handshake_failed(HandshakeFailure::Abandoned);
                            self.shared.peer_log.warn(
                                self.peer.ip(),
                                format_args!(
                                    "host {} from {}: {why}",
                                    host_nqn
                                        .map_or_else(|| "(unknown)".to_owned(), |h| h.to_string()),
                                    self.peer
                                ),
                            );
                            self.phase = Phase::Closing {
                                deadline: now + LINGER,
                            };
                        }
                        Step::Admitted { connect, proven } => self.admit(&cfg, connect, proven),
                        Step::Discovery { connect, key } => {
                            self.admit_discovery(&cfg, connect, key)
                        }
                    }
                }
                self.last_seen = now;
            }
            Phase::Registering(_) => self.registering_message(buf, now),
            Phase::Closing { .. } => match Message::decode(buf) {
                // Flush requests that crossed our goodbye are answered, never silently dropped.
                Ok(Message::FlushRequest(r)) => {
                    let resp = FlushResponse {
                        token: r.token,
                        status: FlushStatus::Unavailable,
                    };
                    self.send_raw(&resp.encode());
                }
                Ok(Message::KeepAlive(k)) if self.owes_disconnect() => self.send_raw(&k.encode()),
                _ => {}
            },
            Phase::Discovery { .. } => self.discovery_message(buf, now),
            Phase::Session(s) => {
                self.last_seen = now;
                seen(&s.info, now);
                match Message::decode(buf) {
                    Ok(Message::FlushRequest(_)) if self.flushes_out >= self.queue_depth => {
                        let d = self.queue_depth;
                        self.protocol_error(format!(
                            "a FlushRequest beyond the queue depth ({d} unanswered before it)"
                        ));
                    }
                    Ok(Message::FlushRequest(req)) => {
                        // Past reading its namespaces (if they came in pages): their listing goes.
                        s.listing = None;
                        match s.grants.get(&req.nsid) {
                            Some(g) => {
                                self.flushes_out += 1;
                                jobs.push(FlushJob {
                                    ns: Arc::clone(&g.ns),
                                    req,
                                    arrived: Stopwatch::start(),
                                });
                            }
                            None => {
                                s.info.flushes.fetch_add(1, Ordering::Relaxed);
                                let resp = FlushResponse {
                                    token: req.token,
                                    status: FlushStatus::InvalidNamespace,
                                };
                                self.send_raw(&resp.encode());
                            }
                        }
                    }
                    Ok(Message::KeepAlive(k)) => self.send_raw(&k.encode()),
                    // The namespaces its ConnectResponse had no room for, a page at a time.
                    Ok(Message::NamespacesRequest(r)) => match s.listing.as_deref() {
                        Some(all) => {
                            let page = NamespacesResponse::page(all, r.start);
                            // Kept until the host has read it all (or sends a FlushRequest).
                            if r.start as usize + page.namespaces.len() >= all.len() {
                                s.listing = None;
                            }
                            match Message::NamespacesResponse(page).encode() {
                                Ok(bytes) => self.send_raw(&bytes),
                                Err(e) => self.goodbye(&format!(
                                    "the namespaces from index {} cannot be sent: {e}",
                                    r.start
                                )),
                            }
                        }
                        None => self.protocol_error(
                            "a NamespacesRequest with no listing left to page (the \
                             ConnectResponse listed every namespace, or the host read them all \
                             or sent a FlushRequest)"
                                .into(),
                        ),
                    },
                    Ok(Message::Disconnect(d)) => {
                        shared.session_ended(
                            EndReason::Host,
                            self.peer.ip(),
                            log::Level::Info,
                            format_args!(
                                "session ctrl {} (host {} from {}) closed by the host: {}",
                                s.info.controller_id,
                                s.host,
                                self.peer,
                                peer_text(&d.reason)
                            ),
                        );
                        // No session any more: its place goes now, not after the linger (a
                        // newcomer in a full target would take the place of none).
                        self.leave_session_pool();
                        // Its registrations are dropped by the loop's registrar.
                        self.close(now + LINGER);
                    }
                    Ok(other) => {
                        let t = other.message_type();
                        self.protocol_error(format!("unexpected {t:?} in a session"));
                    }
                    Err(e) => self.protocol_error(e.to_string()),
                }
            }
        }
    }

    /// When [`tick`](Self::tick) has something to do at the latest (if nothing arrives before).
    pub(crate) fn next_timer(&self) -> Instant {
        // Just past the lapse: tick's test is "longer than the period".
        let lapse = |ka: Duration| self.last_seen + ka + Duration::from_millis(1);
        match &self.phase {
            Phase::Handshake { deadline, .. } | Phase::Closing { deadline } => *deadline,
            Phase::Registering(r) => r.deadline,
            Phase::Session(s) => lapse(s.keep_alive),
            Phase::Discovery {
                keep_alive,
                deadline,
                ..
            } => lapse(*keep_alive).min(*deadline),
        }
    }

    /// Timers: handshake deadline, keep-alive, linger. Returns false when the connection is to
    /// be dropped.
    pub(crate) fn tick(&mut self, now: Instant) -> bool {
        let lost = self.qp.state() == QpState::Error;
        if lost || self.overrun {
            self.session_ended(if self.overrun {
                EndReason::ProtocolError
            } else {
                EndReason::ConnectionLost
            });
            if let Phase::Session(s) = &self.phase {
                // A persist that failed in the placement engine (APM, FLUSH) ends here.
                for g in s.grants.values() {
                    g.ns.note_failure();
                }
            }
            match &self.phase {
                Phase::Session(s) if !self.overrun => self.shared.peer_log.log(
                    self.peer.ip(),
                    Class::Session,
                    log::Level::Info,
                    format_args!(
                        "session ctrl {} (host {} from {}) lost its connection: {}",
                        s.info.controller_id,
                        s.host,
                        self.peer,
                        self.qp
                            .error()
                            .map(|e| rpma_common::error_chain(&e))
                            .unwrap_or_default()
                    ),
                ),
                _ => {}
            }
            return false;
        }
        if let Some(t) = self.ticket.as_ref().filter(|t| t.evicted()) {
            if let Phase::Session(s) = &self.phase {
                // A host of a higher standing took its place in the full target.
                let (ctrl, host) = (s.info.controller_id, s.host.clone());
                let (who, this) = t.pool().evicted_by();
                self.ticket = None;
                self.session_ended(EndReason::Evicted);
                let max = self.shared.config().max_connections;
                self.shared.peer_log.log(
                    self.peer.ip(),
                    Class::Session,
                    log::Level::Info,
                    format_args!(
                        "session ctrl {ctrl} (host {host} from {}) closed: {who} took its \
                         place (max_connections {max}, and {this})",
                        self.peer
                    ),
                );
                self.goodbye(&format!(
                    "the target is full (max_connections {max}) and {who} took this \
                     session's place"
                ));
                return true;
            }
            if matches!(self.phase, Phase::Registering(_)) {
                let pool = t.pool();
                self.registering_evicted(pool);
                return true;
            }
            log::debug!(
                "{}: closed: a newer connection took its place in the full {} pool",
                self.peer,
                t.pool().name()
            );
            return false;
        }
        let lapsed = |ka: Duration| now.saturating_duration_since(self.last_seen) > ka;
        match &self.phase {
            Phase::Handshake { deadline, .. } if now >= *deadline => {
                self.shared
                    .events
                    .handshake_failed(HandshakeFailure::Timeout);
                // Unauthenticated, and as frequent as a peer likes: not worth a line each.
                log::debug!("{}: no complete Connect in time: closed", self.peer);
                false
            }
            Phase::Session(s) if lapsed(s.keep_alive) => {
                s.info.expired.store(true, Ordering::Relaxed);
                self.shared.session_ended(
                    EndReason::KeepAlive,
                    self.peer.ip(),
                    log::Level::Warn,
                    format_args!(
                        "session ctrl {} (host {} from {}): keep-alive of {} ms lapsed; its \
                         rkeys are revoked before its Disconnect",
                        s.info.controller_id,
                        s.host,
                        self.peer,
                        s.keep_alive.as_millis()
                    ),
                );
                let why = format!("keep-alive expired ({} ms)", s.keep_alive.as_millis());
                self.goodbye(&why);
                true
            }
            Phase::Discovery { keep_alive, .. } if lapsed(*keep_alive) => {
                self.goodbye("keep-alive expired");
                true
            }
            Phase::Discovery { deadline, .. } if now >= *deadline => {
                self.goodbye("the discovery session's time limit passed");
                true
            }
            Phase::Registering(r) if now >= r.deadline => {
                self.registering_expired();
                true
            }
            Phase::Closing { deadline } if now >= *deadline => {
                self.say_release_expired();
                false
            }
            _ => true,
        }
    }

    /// A reload: close the session if the diff touches it or changes one of its namespaces
    /// (with a Disconnect naming the namespace, so that the host reconnects and sees the new
    /// descriptor instead of a RemoteAccess later), else revoke the rkeys of its namespaces that
    /// were removed.
    pub(crate) fn reloaded(&mut self, diff: &crate::reload::ConfigDiff) {
        // A connection whose session already ended, lingering, may still have Reads of a
        // namespace queued (a host that stopped reading), and no grant left to revoke: if the
        // reload removed or changed a namespace (whose file may serve someone else now), it
        // closes now rather than send them from that file (its host sees a lost connection).
        if self.close_if_releasing(diff) {
            return;
        }
        if let Phase::Closing { deadline } = &mut self.phase {
            if !diff.namespaces_removed.is_empty() || !diff.namespaces_changed.is_empty() {
                *deadline = Instant::now();
                log::info!(
                    "connection from {}: closed now, not at the end of its linger: the reload \
                     removed or changed a namespace",
                    self.peer
                );
            }
            return;
        }
        if matches!(self.phase, Phase::Registering(_)) {
            return self.registering_reloaded(diff);
        }
        let Phase::Session(s) = &mut self.phase else {
            return;
        };
        if let Some((reason, why)) = s.reloaded(diff, self.peer) {
            self.session_ended(reason);
            // Unreachable once the reload is done: dropped here, not by the registrar.
            self.goodbye_here(&why);
            return;
        }
        // A host the reload lists now (without a key: one with a key must prove it, and its
        // session was closed above) is a listed host from now on: its session leaves the
        // lowest class, where a listed newcomer to a full target would take its place.
        let (ctrl, host) = (s.info.controller_id, s.host.clone());
        let listed_now = diff.lists_now(&s.subsystem, &s.host);
        if self.promote_if(listed_now) {
            log::info!(
                "session ctrl {ctrl} (host {host} from {}): its subsystem lists the host now",
                self.peer
            );
        }
    }

    /// A host the reload lists now (`listed_now`) leaves the lowest class: from the unlisted
    /// pool to the unproven one. Whether it moved.
    fn promote_if(&mut self, listed_now: bool) -> bool {
        match self.ticket.as_mut() {
            Some(t) if listed_now && t.pool() == Pool::Unlisted => {
                self.shared.budgets.promote(t, Pool::Unproven)
            }
            _ => false,
        }
    }
}
