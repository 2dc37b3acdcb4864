//! Fabrics commands: Connect (admission of admin and I/O queues, discovery controllers),
//! Property Get/Set (CAP, VS, CC, CSTS: enable, disable, shutdown) and Disconnect.
//!
//! # Admission
//!
//! A Connect on the admin queue is decided by the native rules ([`crate::subsystem::admit`]):
//! an unknown subsystem is Connect Invalid Parameters on the subsystem NQN, a host not on the
//! allow-list is Connect Invalid Host, a host listed with a key is Authentication Required
//! (NVMe in-band authentication, DH-HMAC-CHAP, is not implemented on `nvme-tcp://` listeners:
//! such a host uses `tcp://` and rpma's initiator). Every refusal is logged rate-limited per
//! peer address, counted, answered and the connection closed. An admitted I/O controller
//! takes a place among the admitted sessions (`max_connections`, its controller id from the
//! same space as the native sessions'); a discovery controller one in the discovery pool. An
//! I/O queue's Connect must name a live controller of the same host, subsystem and host id,
//! and a queue id it was granted.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::{self, HostId, RefusalReason};

use super::command::{fctype, Sqe, Status};
use super::controller::{prop, CcChange, Controller};
use super::identify::CtrlKind;
use super::queue::{Env, Queue, IN_CAPSULE_DATA};
use super::reply::Reply;
use super::state::{AdminQueue, DiscoveryQueue, Input, IoQueue, Phase, Registration, Then};
use crate::namespace::OpenNamespace;
use crate::serve::budget::{Pool, Standing};
use crate::serve::session_info::SessionInfo;
use crate::serve::{LogClass, MIN_KEEP_ALIVE};
use crate::subsystem::{admit, lists_host, Admission};

/// Bytes of Connect data.
const CONNECT_DATA_LEN: usize = 1024;
/// Byte offsets in the Connect data (for IPO).
const OFF_CNTLID: u32 = 16;
const OFF_SUBNQN: u32 = 256;
const OFF_HOSTNQN: u32 = 512;
/// Byte offsets in the Connect command.
const OFF_QID: u32 = 42;
const OFF_SQSIZE: u32 = 44;
/// The longest keep-alive timeout accepted (as the native sessions).
const MAX_KATO: Duration = Duration::from_secs(3600);
/// Connect ATTR bit: the host disables SQ flow control.
const CATTR_DISABLE_SQFLOW: u8 = 1 << 2;

/// The keep-alive timeout of an I/O controller that asked for `kato`: clamped to 100 ms..1 h,
/// and 0 (none) means the target's `keep_alive_ms`, as on the native listeners: a controller
/// holds a place among the admitted sessions, so it must show it is alive (a host that asks for
/// none, `--keep-alive-tmo=0`, is closed after that period and reconnects).
pub(crate) fn io_kato(kato: Duration, cfg: &crate::config::Config) -> Duration {
    if kato.is_zero() {
        Duration::from_millis(u64::from(cfg.keep_alive_ms))
    } else {
        kato.clamp(MIN_KEEP_ALIVE, MAX_KATO)
    }
}

/// Why a Connect is refused.
struct Refusal {
    status: Status,
    /// IATTR (1: the field is in the Connect data) and IPO, the field's byte offset.
    iattr: u8,
    ipo: u32,
    /// How it is counted.
    reason: RefusalReason,
    /// For the log.
    why: String,
}

fn invalid(iattr: u8, ipo: u32, reason: RefusalReason, why: String) -> Refusal {
    Refusal {
        status: Status::CONNECT_INVALID_PARAM,
        iattr,
        ipo,
        reason,
        why,
    }
}

/// An NQN field of the Connect data: UTF-8 up to the first NUL, which must come within it.
fn nqn_field(data: &[u8], at: usize) -> Option<Nqn> {
    let field = &data[at..at + 256];
    let end = field.iter().position(|&b| b == 0)?;
    let s = std::str::from_utf8(&field[..end]).ok()?;
    Nqn::new(s).ok()
}

impl Queue {
    /// A Fabrics command on a connected queue (or the Connect of one that is not).
    pub(crate) fn fabrics(&mut self, sqe: &Sqe, input: &Input<'_>, env: &mut Env<'_>) -> Reply {
        let connected = self.connected();
        match sqe.fctype() {
            fctype::CONNECT if !connected => self.connect(sqe, input.data(), env),
            fctype::CONNECT => Reply::status(Status::SEQUENCE_ERROR),
            fctype::PROPERTY_GET | fctype::PROPERTY_SET if matches!(self.phase, Phase::Io(_)) => {
                Reply::status(Status::INVALID_OPCODE)
            }
            fctype::PROPERTY_GET => self.property_get(sqe),
            fctype::PROPERTY_SET => self.property_set(sqe, env),
            fctype::DISCONNECT => {
                if let Phase::Admin(_) = self.phase {
                    self.end(crate::metrics::EndReason::Host, env);
                }
                // Complete first; the connection closes once the completion is out.
                Reply::Refuse {
                    dw0: 0,
                    status: Status::SUCCESS,
                }
            }
            // No in-band authentication here: nothing to send or receive.
            fctype::AUTH_SEND | fctype::AUTH_RECV => Reply::status(Status::INVALID_OPCODE),
            _ => Reply::status(Status::INVALID_OPCODE),
        }
    }

    fn controller(&self) -> Option<&Arc<Controller>> {
        match &self.phase {
            Phase::Admin(a) => Some(&a.ctrl),
            Phase::Discovery(d) => Some(&d.ctrl),
            Phase::Io(q) => Some(&q.ctrl),
            _ => None,
        }
    }

    fn property_get(&self, sqe: &Sqe) -> Reply {
        let Some(c) = self.controller() else {
            return Reply::status(Status::SEQUENCE_ERROR);
        };
        let eight = sqe.u8_at(40) & 0x7 == 1;
        let value: u64 = match (sqe.u32_at(44), eight) {
            (prop::CAP, true) => c.cap(),
            (prop::VS, false) => u64::from(c.vs()),
            (prop::CC, false) => u64::from(c.cc()),
            (prop::CSTS, false) => u64::from(c.csts()),
            _ => return Reply::status(Status::INVALID_FIELD),
        };
        // The value is dwords 0 and 1 of the completion.
        Reply::Value(value)
    }

    fn property_set(&mut self, sqe: &Sqe, env: &mut Env<'_>) -> Reply {
        let Some(c) = self.controller().cloned() else {
            return Reply::status(Status::SEQUENCE_ERROR);
        };
        if sqe.u8_at(40) & 0x7 != 0 || sqe.u32_at(44) != prop::CC {
            return Reply::status(Status::INVALID_FIELD);
        }
        match c.set_cc(sqe.u32_at(48)) {
            CcChange::Shutdown => {
                // Shutdown processing: everything written so far made durable, then SHST
                // complete (the host polls CSTS meanwhile).
                let (targets, namespaces) = self.flush_everything();
                if targets.is_empty() {
                    c.shutdown_done(!c.any_failed());
                } else {
                    let _ = self.wait_for(Then::ShutdownDone, targets, Vec::new(), namespaces, env);
                }
            }
            CcChange::Disabled => {
                // A reset: held event requests are dropped with it.
                match &mut self.phase {
                    Phase::Admin(a) => a.aers.clear(),
                    Phase::Discovery(d) => d.aers.clear(),
                    _ => {}
                }
            }
            CcChange::Enabled | CcChange::None => {}
        }
        Reply::ok()
    }

    /// A Connect: admits the queue or refuses it.
    fn connect(&mut self, sqe: &Sqe, data: &[u8], env: &mut Env<'_>) -> Reply {
        match self.try_connect(sqe, data, env) {
            Ok(cntlid) => Reply::dw0(u32::from(cntlid)),
            Err(r) => {
                env.ctx.serve.events.refused(r.reason);
                env.ctx.serve.peer_log.warn(
                    self.peer.ip(),
                    format_args!(
                        "{}: nvme-tcp Connect refused ({}): {}",
                        self.peer, r.status, r.why
                    ),
                );
                Reply::Refuse {
                    dw0: (u32::from(r.iattr) << 16) | r.ipo,
                    status: r.status,
                }
            }
        }
    }

    fn try_connect(&mut self, sqe: &Sqe, data: &[u8], env: &mut Env<'_>) -> Result<u16, Refusal> {
        let proto_err = RefusalReason::ProtocolError;
        if sqe.u16_at(40) != 0 {
            return Err(Refusal {
                status: Status::CONNECT_FORMAT,
                iattr: 0,
                ipo: 40,
                reason: RefusalReason::VersionUnsupported,
                why: format!("record format {}", sqe.u16_at(40)),
            });
        }
        if data.len() != CONNECT_DATA_LEN {
            return Err(Refusal {
                status: Status::SGL_LENGTH_INVALID,
                iattr: 0,
                ipo: 0,
                reason: proto_err,
                why: format!("{} bytes of Connect data (1024 expected)", data.len()),
            });
        }
        let mut host_id = [0u8; 16];
        host_id.copy_from_slice(&data[..16]);
        let cntlid = u16::from_le_bytes([data[16], data[17]]);
        let sub = nqn_field(data, OFF_SUBNQN as usize)
            .ok_or_else(|| invalid(1, OFF_SUBNQN, proto_err, "an invalid subsystem NQN".into()))?;
        let host = nqn_field(data, OFF_HOSTNQN as usize)
            .ok_or_else(|| invalid(1, OFF_HOSTNQN, proto_err, "an invalid host NQN".into()))?;
        let qid = sqe.u16_at(OFF_QID as usize);
        let sqsize = sqe.u16_at(OFF_SQSIZE as usize);
        let cfg = env.ctx.serve.config();
        let entries = env.ctx.queue_entries();
        if sqsize == 0 || u32::from(sqsize) + 1 > u32::from(entries) {
            return Err(invalid(
                0,
                OFF_SQSIZE,
                proto_err,
                format!("SQSIZE {sqsize} (at most {} entries)", entries),
            ));
        }
        if env.ctx.serve.stopping.load(Ordering::SeqCst) {
            return Err(Refusal {
                status: Status::CONNECT_BUSY,
                iattr: 0,
                ipo: 0,
                reason: RefusalReason::ShuttingDown,
                why: "the target is shutting down".into(),
            });
        }
        let kato = Duration::from_millis(u64::from(sqe.u32_at(48)));
        let who = format!("host {host} for {sub}");
        let connect = proto::Connect {
            host_nqn: host.clone(),
            subsystem_nqn: sub.clone(),
            host_id: HostId(host_id),
            queue_id: qid,
            keep_alive_ms: kato.as_millis() as u32,
        };
        let id = if qid != 0 {
            self.connect_io(qid, cntlid, &connect, &who, env)?
        } else {
            if cntlid != 0xffff {
                return Err(invalid(
                    1,
                    OFF_CNTLID,
                    proto_err,
                    format!("{who}: controller id {cntlid} asked for (dynamic controllers: FFFFh)"),
                ));
            }
            match admit(&cfg, &connect) {
                Admission::Refuse(r) => {
                    let (status, ipo) = match r.reason {
                        RefusalReason::HostNotAllowed => {
                            (Status::CONNECT_INVALID_HOST, OFF_HOSTNQN)
                        }
                        _ => (Status::CONNECT_INVALID_PARAM, OFF_SUBNQN),
                    };
                    return Err(Refusal {
                        status,
                        iattr: 1,
                        ipo,
                        reason: r.reason,
                        why: format!("{who}: {}", r.message),
                    });
                }
                Admission::Authenticate { .. } | Admission::DiscoveryAuthenticate { .. } => {
                    return Err(Refusal {
                        status: Status::AUTH_REQUIRED,
                        iattr: 0,
                        ipo: 0,
                        reason: RefusalReason::AuthFailed,
                        why: format!(
                            "{who}: the host is listed with a key, and nvme-tcp listeners do not \
                             implement DH-HMAC-CHAP; it must use a tcp:// listener (rpma's \
                             initiator) or be listed without a key"
                        ),
                    });
                }
                Admission::Discovery => self.connect_discovery(&connect, kato, env)?,
                Admission::Accept { subsystem } => {
                    let namespaces: Vec<Arc<OpenNamespace>> = env
                        .ctx
                        .serve
                        .namespaces()
                        .iter()
                        .filter(|((s, _), _)| *s == subsystem.nqn)
                        .map(|(_, ns)| Arc::clone(ns))
                        .collect();
                    // No key is proven on nvme-tcp:// (no in-band authentication).
                    let standing = Standing::of(false, lists_host(&cfg, &connect));
                    self.connect_admin(&connect, kato, namespaces, standing, env)?
                }
            }
        };
        if sqe.u8_at(46) & CATTR_DISABLE_SQFLOW != 0 {
            self.sqflow_off = true;
        }
        self.sq_entries = sqsize + 1;
        self.limits.max_capsule_data = IN_CAPSULE_DATA;
        Ok(id)
    }

    fn connect_admin(
        &mut self,
        c: &proto::Connect,
        kato: Duration,
        namespaces: Vec<Arc<OpenNamespace>>,
        standing: Standing,
        env: &mut Env<'_>,
    ) -> Result<u16, Refusal> {
        let kato = io_kato(kato, &env.ctx.serve.config());
        let ctx = Arc::clone(env.ctx);
        let now = env.now;
        let entries = ctx.queue_entries();
        let mut made = None;
        let peer = self.peer;
        let info = ctx.serve.register_session(standing, |id| {
            let ctrl = Arc::new(Controller::new(
                id,
                CtrlKind::Io,
                c.subsystem_nqn.clone(),
                c.host_nqn.clone(),
                c.host_id.0,
                namespaces.clone(),
                kato,
                entries,
                now,
            ));
            let counts: Arc<dyn crate::serve::SessionCounts> = ctrl.counts.clone();
            made = Some(ctrl);
            SessionInfo::new("nvme-tcp", id, c, peer, kato).with_counts(counts)
        });
        let (Some(info), Some(ctrl)) = (info, made) else {
            return Err(Refusal {
                status: Status::CONNECT_BUSY,
                iattr: 0,
                ipo: 0,
                reason: RefusalReason::TooManyConnections,
                why: format!(
                    "host {} for {}: {} sessions admitted already (max_connections)",
                    c.host_nqn,
                    c.subsystem_nqn,
                    ctx.serve.config().max_connections
                ),
            });
        };
        ctx.add_controller(Arc::clone(&ctrl));
        let mut reg = Registration {
            ctx: Arc::clone(&ctx),
            ctrl: Arc::clone(&ctrl),
            info,
            held: Vec::new(),
        };
        reg.hold(namespaces);
        ctx.serve.events.admitted(false);
        env.ctx.serve.peer_log.log(
            self.peer.ip(),
            LogClass::Session,
            log::Level::Info,
            format_args!(
                "nvme-tcp controller {} admitted: host {} from {} on {}, keep-alive {} ms, {} \
                 namespace(s), volatile write cache {}",
                ctrl.cntlid,
                c.host_nqn,
                self.peer,
                c.subsystem_nqn,
                kato.as_millis(),
                reg.held.len(),
                if ctrl.vwc { "reported" } else { "none" }
            ),
        );
        // Out of the unadmitted pool: it counts against max_connections now, and when the
        // target is full a host that proves its key on another listener may take its place,
        // or (if its subsystem does not list it) a listed host.
        self.ticket = standing.pool().map(|p| {
            env.ctx
                .serve
                .budgets
                .enlist(p, self.peer.ip(), env.owner.clone())
        });
        let id = ctrl.cntlid;
        self.phase = Phase::Admin(Box::new(AdminQueue {
            ctrl,
            reg,
            aers: Vec::new(),
        }));
        Ok(id)
    }

    fn connect_discovery(
        &mut self,
        c: &proto::Connect,
        kato: Duration,
        env: &mut Env<'_>,
    ) -> Result<u16, Refusal> {
        let cfg = env.ctx.serve.config();
        let limits = env.ctx.serve.limits(Pool::Discovery);
        let ticket =
            env.ctx
                .serve
                .budgets
                .take(Pool::Discovery, self.peer.ip(), limits, env.owner.clone());
        let max = Duration::from_millis(u64::from(cfg.admission.discovery_max_keep_alive_ms));
        let kato = if kato.is_zero() {
            kato
        } else {
            kato.clamp(MIN_KEEP_ALIVE, max)
        };
        let id = env.ctx.next_discovery_id();
        let ctrl = Arc::new(Controller::new(
            id,
            CtrlKind::Discovery,
            c.subsystem_nqn.clone(),
            c.host_nqn.clone(),
            c.host_id.0,
            Vec::new(),
            kato,
            env.ctx.queue_entries(),
            env.now,
        ));
        let info = Arc::new(SessionInfo::new("nvme-discovery", id, c, self.peer, kato));
        let listed = env.ctx.serve.register_discovery(Arc::clone(&info));
        env.ctx.serve.events.admitted(true);
        log::debug!(
            "{}: nvme-tcp discovery controller {id} for host {}",
            self.peer,
            c.host_nqn
        );
        self.ticket = Some(ticket);
        let limit = Duration::from_millis(u64::from(cfg.admission.discovery_timeout_ms));
        self.phase = Phase::Discovery(Box::new(DiscoveryQueue {
            ctrl,
            info,
            listed,
            ctx: Arc::clone(env.ctx),
            aers: Vec::new(),
            deadline: env.now + limit,
        }));
        Ok(id)
    }

    fn connect_io(
        &mut self,
        qid: u16,
        cntlid: u16,
        c: &proto::Connect,
        who: &str,
        env: &mut Env<'_>,
    ) -> Result<u16, Refusal> {
        let proto_err = RefusalReason::ProtocolError;
        let ctrl = env
            .ctx
            .controller(cntlid)
            .filter(|ctrl| !ctrl.is_dead() && ctrl.kind == CtrlKind::Io)
            .ok_or_else(|| {
                invalid(
                    1,
                    OFF_CNTLID,
                    proto_err,
                    format!("{who}: I/O queue {qid} for controller {cntlid}, which does not exist"),
                )
            })?;
        if ctrl.subsystem != c.subsystem_nqn
            || ctrl.host != c.host_nqn
            || ctrl.host_id != c.host_id.0
        {
            return Err(invalid(
                1,
                OFF_CNTLID,
                proto_err,
                format!("{who}: controller {cntlid} belongs to another host or subsystem"),
            ));
        }
        if !ctrl.attach_io_queue(qid) {
            return Err(invalid(
                0,
                OFF_QID,
                proto_err,
                format!(
                    "{who}: queue {qid} of controller {cntlid} is connected already or not \
                     granted ({} I/O queues)",
                    ctrl.io_queues()
                ),
            ));
        }
        let (g, ns) = ctrl.namespaces();
        self.ticket = None;
        log::debug!(
            "{}: I/O queue {qid} of nvme-tcp controller {cntlid} connected",
            self.peer
        );
        self.phase = Phase::Io(Box::new(IoQueue {
            ctrl: Arc::clone(&ctrl),
            qid,
            ns_generation: g,
            ns,
        }));
        Ok(cntlid)
    }
}
