//! Admin commands of I/O and discovery controllers: Identify, Get Log Page, Set and Get
//! Features, Keep Alive, Asynchronous Event Request and Abort; and the dispatch of every
//! command by the queue it came on.
//!
//! - Identify: controller, namespace, active namespace list, namespace identification
//!   descriptors, and the NVM command set's own controller structure (the limits of Write
//!   Zeroes and Dataset Management) and namespace structure (all zero). A discovery controller
//!   answers Identify Controller only.
//! - Get Log Page: error information (no entries), SMART / health (what this controller served;
//!   critical warning "reliability degraded" while one of its namespaces has failed, or failed
//!   under it and was cleared since), firmware slot, changed namespace list (read with RAE 0
//!   re-arms its notice); on a discovery controller only the discovery log. The length asked
//!   for must be what the SGL describes, at most 128 KiB (a discovery log larger than that may
//!   be read whole: its size rounded up to 4 KiB); offsets (LPO) are dword aligned and within
//!   the page; bytes past the end of the page read as zeros.
//! - Features: number of queues (granted up to [`MAX_IO_QUEUES`]), keep-alive timer,
//!   asynchronous event configuration, volatile write cache (only where one is reported).
//!   Nothing is saveable.
//! - Asynchronous Event Requests are held (at most 4) and completed when a reload changes the
//!   namespaces (a namespace attribute notice) or the discovery log.
//! - Abort aborts nothing (every command completes promptly) and says so.

use std::sync::Arc;
use std::time::Duration;

use rpma_common::proto::nqn::Nqn;

use super::command::{self, admin, Sqe, Status, NSID_ALL};
use super::controller::{aen, Controller, MAX_IO_QUEUES};
use super::discovery;
use super::identify::{self, cns, lid, CtrlFacts, CtrlKind, Health, NsFacts};
use super::queue::{Env, Queue, IN_CAPSULE_DATA, MDTS};
use super::reply::Reply;
use super::state::{Input, Phase, Then};
use crate::namespace::OpenNamespace;
use crate::serve::budget::Pool;

/// Feature identifiers answered.
mod fid {
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0b;
    pub const KEEP_ALIVE_TIMER: u8 = 0x0f;
}

/// Asynchronous Event Requests held at most (AERL + 1).
const MAX_AERS: usize = 4;
/// Asynchronous Event Request Limit Exceeded.
const AER_LIMIT: Status = Status {
    sct: 1,
    sc: 0x05,
    dnr: true,
};
/// The most a discovery controller's Get Log Page may ask for, its log being `log_len` bytes:
/// the log rounded up to 4 KiB pages, and at least an I/O controller's largest transfer. Its
/// MDTS is 0 (no limit), so a host may read past the end (zeros), but a read is answered from
/// a buffer of its size, held until the host takes it: any host may open a discovery
/// controller, and a length of up to 16 MiB, held for the session's time limit by a peer that
/// never reads, is not a cost to let it choose. `nvme discover` reads the header, then the
/// whole log (at most the log's size).
fn discovery_read_limit(log_len: usize) -> u64 {
    (log_len as u64)
        .next_multiple_of(4096)
        .max(u64::from(super::queue::MAX_TRANSFER))
}
/// Bytes of the error information log (one entry).
const ERROR_LOG_LEN: usize = 64;

impl Queue {
    /// Runs a command on whatever queue it came on.
    pub(crate) fn execute(&mut self, sqe: &Sqe, input: &Input<'_>, env: &mut Env<'_>) -> Reply {
        if sqe.opcode() == command::FABRICS {
            return self.fabrics(sqe, input, env);
        }
        match &self.phase {
            Phase::AwaitIcReq | Phase::AwaitConnect => Reply::status(Status::SEQUENCE_ERROR),
            Phase::Io(q) if q.ctrl.is_dead() => Reply::status(Status::SEQUENCE_ERROR),
            Phase::Io(q) if !q.ctrl.ready() => Reply::status(Status::SEQUENCE_ERROR),
            Phase::Io(_) => self.io_command(sqe, input, env),
            Phase::Admin(a) if !a.ctrl.ready() => Reply::status(Status::SEQUENCE_ERROR),
            Phase::Admin(a) => {
                let ctrl = Arc::clone(&a.ctrl);
                self.admin_command(&ctrl, sqe, input, env)
            }
            Phase::Discovery(d) if !d.ctrl.ready() => Reply::status(Status::SEQUENCE_ERROR),
            Phase::Discovery(d) => {
                let ctrl = Arc::clone(&d.ctrl);
                self.admin_command(&ctrl, sqe, input, env)
            }
        }
    }

    fn admin_command(
        &mut self,
        ctrl: &Arc<Controller>,
        sqe: &Sqe,
        input: &Input<'_>,
        env: &mut Env<'_>,
    ) -> Reply {
        match sqe.opcode() {
            admin::IDENTIFY => self.identify(ctrl, sqe, input.room(), env),
            admin::GET_LOG_PAGE => self.get_log_page(ctrl, sqe, input.room(), env),
            admin::SET_FEATURES => {
                let cached = ctrl.wce();
                let r = set_features(ctrl, sqe, env);
                // The write cache turned off: what it holds is made durable before the
                // completion, as every write's will be from now on (the writes completed
                // before were in the page cache only, and the host now takes every completed
                // write as durable).
                if cached && !ctrl.wce() {
                    // As a Flush of every namespace would answer: a Write Fault where a reload
                    // replaced a file under the controller, or a namespace failed (or is lost
                    // to it), after the healthy ones are synced: with the cache off the host
                    // sends no Flush that could say so later.
                    let fault = ctrl.take_replaced(None) | ctrl.any_failed();
                    let (targets, namespaces) = self.flush_everything();
                    if targets.is_empty() {
                        return match fault {
                            true => Reply::status(Status::WRITE_FAULT),
                            false => r,
                        };
                    }
                    let reply = self.wait_for(
                        Then::Complete(sqe.cid()),
                        targets,
                        Vec::new(),
                        namespaces,
                        env,
                    );
                    if fault {
                        if let Some(w) = self.waits.get_mut(&self.next_wait) {
                            w.status = Status::WRITE_FAULT;
                        }
                    }
                    return reply;
                }
                r
            }
            admin::GET_FEATURES => get_features(ctrl, sqe),
            admin::KEEP_ALIVE => {
                ctrl.keep_alive(env.now);
                self.keep_alive_seen(env);
                Reply::ok()
            }
            admin::ASYNC_EVENT => {
                let aers = match &mut self.phase {
                    Phase::Admin(a) => &mut a.aers,
                    Phase::Discovery(d) => &mut d.aers,
                    _ => return Reply::status(Status::INVALID_OPCODE),
                };
                if aers.len() >= MAX_AERS {
                    return Reply::status(AER_LIMIT);
                }
                aers.push(sqe.cid());
                Reply::Later
            }
            // Bit 0 of dword 0: the command was not aborted.
            admin::ABORT => Reply::dw0(1),
            _ => Reply::status(Status::INVALID_OPCODE),
        }
    }

    fn keep_alive_seen(&self, env: &Env<'_>) {
        use std::sync::atomic::Ordering::Relaxed;
        let info = match &self.phase {
            Phase::Admin(a) => &a.reg.info,
            Phase::Discovery(d) => &d.info,
            _ => return,
        };
        info.messages.fetch_add(1, Relaxed);
        let ms = env.now.saturating_duration_since(info.started).as_millis() as u64;
        info.last_seen_ms.store(ms, Relaxed);
    }

    /// Identify Controller's facts for `ctrl`.
    fn facts(&self, ctrl: &Controller, env: &Env<'_>) -> CtrlFacts {
        let io = ctrl.kind == CtrlKind::Io;
        CtrlFacts {
            kind: ctrl.kind,
            cntlid: ctrl.cntlid,
            subnqn: ctrl.subsystem.to_string(),
            serial: identify::serial_of(ctrl.subsystem.as_str()),
            firmware: env!("CARGO_PKG_VERSION").into(),
            mdts: if io { MDTS } else { 0 },
            maxcmd: env.ctx.queue_entries(),
            vwc: ctrl.vwc,
            ioccsz: (64 + IN_CAPSULE_DATA) / 16,
            kas: 10,
        }
    }

    fn identify(&mut self, ctrl: &Controller, sqe: &Sqe, room: u32, env: &mut Env<'_>) -> Reply {
        if room != identify::IDENTIFY_LEN as u32 {
            return Reply::status(Status::SGL_LENGTH_INVALID);
        }
        let cdw10 = sqe.cdw(10);
        let which = cdw10 as u8;
        let nsid = sqe.nsid();
        if ctrl.kind == CtrlKind::Discovery {
            return match which {
                cns::CONTROLLER => Reply::Data(identify::controller(&self.facts(ctrl, env))),
                _ => Reply::status(Status::INVALID_FIELD),
            };
        }
        let (_, map) = ctrl.namespaces();
        let csi = (sqe.cdw(11) >> 24) as u8;
        match which {
            cns::CONTROLLER => Reply::Data(identify::controller(&self.facts(ctrl, env))),
            cns::NAMESPACE => match map.get(&nsid) {
                Some(e) => Reply::Data(identify::namespace(&NsFacts {
                    size: e.ns.size(),
                    block_size: e.ns.config.block_size,
                    read_only: e.ns.config.read_only,
                    nguid: e.nguid,
                })),
                // An inactive but valid id: a zeroed structure, as the spec says.
                None if nsid != 0 && nsid != NSID_ALL => {
                    Reply::Data(vec![0; identify::IDENTIFY_LEN])
                }
                None => Reply::status(Status::INVALID_NS),
            },
            cns::ACTIVE_NS_LIST if nsid >= 0xffff_fffe => Reply::status(Status::INVALID_NS),
            cns::ACTIVE_NS_LIST => Reply::Data(identify::active_ns_list(map.keys().copied(), nsid)),
            cns::NS_DESCRIPTORS => match map.get(&nsid) {
                Some(e) => Reply::Data(identify::ns_descriptors(&e.nguid, &e.uuid)),
                None => Reply::status(Status::INVALID_NS),
            },
            cns::CS_CONTROLLER if csi == 0 => Reply::Data(identify::nvm_controller(
                super::io::WZSL,
                super::io::DM_MAX_BLOCKS,
            )),
            cns::CS_NAMESPACE if csi == 0 && map.contains_key(&nsid) => {
                Reply::Data(vec![0; identify::IDENTIFY_LEN])
            }
            cns::CS_NAMESPACE if csi == 0 => Reply::status(Status::INVALID_NS),
            _ => Reply::status(Status::INVALID_FIELD),
        }
    }

    fn get_log_page(&mut self, ctrl: &Controller, sqe: &Sqe, room: u32, env: &Env<'_>) -> Reply {
        let (cdw10, cdw11) = (sqe.cdw(10), sqe.cdw(11));
        let page = cdw10 as u8;
        let rae = cdw10 & (1 << 15) != 0;
        let numd = u64::from(cdw10 >> 16) | (u64::from(cdw11 & 0xffff) << 16);
        let len = (numd + 1) * 4;
        let offset = u64::from(sqe.cdw(12)) | (u64::from(sqe.cdw(13)) << 32);
        if len != u64::from(room) {
            return Reply::status(Status::SGL_LENGTH_INVALID);
        }
        let io_max = u64::from(super::queue::MAX_TRANSFER);
        if (ctrl.kind == CtrlKind::Io && len > io_max) || offset % 4 != 0 {
            return Reply::status(Status::INVALID_FIELD);
        }
        let log = match (ctrl.kind, page) {
            (CtrlKind::Discovery, lid::DISCOVERY) => {
                let cfg = env.ctx.serve.config();
                let entries = discovery::entries(&cfg, &ctrl.host, Some(self.local));
                let log = discovery::log_page(env.ctx.discovery_generation(), &entries);
                if len > discovery_read_limit(log.len()) {
                    return Reply::status(Status::INVALID_FIELD);
                }
                if !rae {
                    ctrl.discovery_log_read();
                }
                log
            }
            (CtrlKind::Io, lid::ERROR) => vec![0; ERROR_LOG_LEN],
            (CtrlKind::Io, lid::SMART) => identify::smart(&health(ctrl)),
            (CtrlKind::Io, lid::FIRMWARE) => identify::firmware_slots(env!("CARGO_PKG_VERSION")),
            (CtrlKind::Io, lid::CHANGED_NS) => {
                identify::changed_ns_list(&ctrl.changed_namespaces(!rae))
            }
            _ => return Reply::status(Status::INVALID_LOG_PAGE),
        };
        if offset > log.len() as u64 {
            return Reply::status(Status::INVALID_FIELD);
        }
        // Bytes past the end of the page read as zeros.
        let mut out = vec![0u8; len as usize];
        let from = &log[offset as usize..];
        let n = from.len().min(out.len());
        out[..n].copy_from_slice(&from[..n]);
        Reply::Data(out)
    }
}

/// What the SMART log reports for `ctrl`.
fn health(ctrl: &Controller) -> Health {
    let t = ctrl.counts.total();
    Health {
        degraded: ctrl.any_failed(),
        read_bytes: t.read_bytes,
        write_bytes: t.write_bytes,
        reads: t.reads,
        writes: t.writes,
    }
}

fn set_features(ctrl: &Controller, sqe: &Sqe, env: &Env<'_>) -> Reply {
    let (cdw10, cdw11) = (sqe.cdw(10), sqe.cdw(11));
    if cdw10 & (1 << 31) != 0 {
        return Reply::status(Status::FEATURE_NOT_SAVEABLE);
    }
    let io = ctrl.kind == CtrlKind::Io;
    match cdw10 as u8 {
        fid::NUMBER_OF_QUEUES if io => {
            let (nsqr, ncqr) = (cdw11 & 0xffff, cdw11 >> 16);
            if nsqr == 0xffff || ncqr == 0xffff {
                return Reply::status(Status::INVALID_FIELD);
            }
            let asked = (nsqr.max(ncqr) + 1).min(u32::from(MAX_IO_QUEUES)) as u16;
            let n = u32::from(ctrl.set_io_queues(asked)) - 1;
            Reply::dw0(n | (n << 16))
        }
        fid::KEEP_ALIVE_TIMER => {
            let asked = Duration::from_millis(u64::from(cdw11));
            let kato = if io {
                super::fabrics::io_kato(asked, &env.ctx.serve.config())
            } else {
                asked.min(Duration::from_millis(u64::from(
                    env.ctx.serve.config().admission.discovery_max_keep_alive_ms,
                )))
            };
            ctrl.set_kato(kato, env.now);
            Reply::ok()
        }
        fid::ASYNC_EVENT_CONFIG => {
            let supported = if io {
                aen::AEC_NS_ATTR
            } else {
                aen::AEC_DISCOVERY
            };
            ctrl.set_aec(cdw11 & supported);
            Reply::ok()
        }
        fid::VOLATILE_WRITE_CACHE if io => {
            if ctrl.set_wce(cdw11 & 1 != 0) {
                Reply::ok()
            } else {
                Reply::status(Status::INVALID_FIELD)
            }
        }
        _ => Reply::status(Status::INVALID_FIELD),
    }
}

fn get_features(ctrl: &Controller, sqe: &Sqe) -> Reply {
    let cdw10 = sqe.cdw(10);
    let sel = (cdw10 >> 8) & 0x7;
    let io = ctrl.kind == CtrlKind::Io;
    let known = matches!(
        (cdw10 as u8, io),
        (fid::NUMBER_OF_QUEUES, true)
            | (fid::VOLATILE_WRITE_CACHE, true)
            | (fid::KEEP_ALIVE_TIMER, _)
            | (fid::ASYNC_EVENT_CONFIG, _)
    );
    if !known || sel > 3 {
        return Reply::status(Status::INVALID_FIELD);
    }
    if sel == 3 {
        // Capabilities: changeable, neither saveable nor namespace specific.
        return Reply::dw0(1 << 2);
    }
    let value = match cdw10 as u8 {
        fid::NUMBER_OF_QUEUES => {
            let n = u32::from(ctrl.io_queues()) - 1;
            n | (n << 16)
        }
        fid::VOLATILE_WRITE_CACHE => u32::from(ctrl.wce()),
        fid::KEEP_ALIVE_TIMER => ctrl.kato().as_millis() as u32,
        _ => ctrl.aec(),
    };
    Reply::dw0(value)
}

/// The namespaces of `subsystem` in the table now.
pub(crate) fn namespaces_of(env: &Env<'_>, subsystem: &Nqn) -> Vec<Arc<OpenNamespace>> {
    env.ctx
        .serve
        .namespaces()
        .iter()
        .filter(|((s, _), _)| s == subsystem)
        .map(|(_, ns)| Arc::clone(ns))
        .collect()
}

impl Queue {
    /// A reload was applied. An I/O controller whose host or subsystem entry changed ends (the
    /// host reconnects and is admitted or refused anew); one whose namespaces changed gets the
    /// new ones and a namespace attribute notice, unless a new namespace needs a volatile write
    /// cache it did not report (then it ends too, and the host reconnects to one that does). A
    /// discovery controller gets a discovery log change notice.
    pub(crate) fn reloaded(&mut self, diff: &crate::reload::ConfigDiff, env: &mut Env<'_>) {
        let ctrl = match &self.phase {
            Phase::Admin(a) => Arc::clone(&a.ctrl),
            Phase::Discovery(d) => {
                if diff.changes_configuration() {
                    d.ctrl.discovery_changed();
                    self.deliver_events();
                }
                return;
            }
            _ => return,
        };
        if diff.touches_session(&ctrl.subsystem, &ctrl.host) {
            log::info!(
                "nvme-tcp controller {} (host {}): its subsystem or host entry changed by \
                 reload: closing",
                ctrl.cntlid,
                ctrl.host
            );
            self.end(crate::metrics::EndReason::Reload, env);
            return self.close(env);
        }
        // A host the reload lists now (without a key) leaves the lowest class, as the native
        // sessions do (serve::conn::Conn::reloaded).
        let listed_now = diff.lists_now(&ctrl.subsystem, &ctrl.host);
        let promoted = match self.ticket.as_mut() {
            Some(t) if listed_now && t.pool() == Pool::Unlisted => {
                env.ctx.serve.budgets.promote(t, Pool::Unproven)
            }
            _ => false,
        };
        if promoted {
            log::info!(
                "nvme-tcp controller {} (host {}): its subsystem lists the host now",
                ctrl.cntlid,
                ctrl.host
            );
        }
        // A namespace whose failure an operator cleared is a new opening too (to a controller
        // it failed under, it stays failed: `Controller::set_namespaces`).
        let mut changed: Vec<u32> = diff
            .namespaces_added
            .iter()
            .chain(&diff.namespaces_removed)
            .chain(&diff.namespaces_changed)
            .chain(&diff.namespaces_cleared)
            .filter(|(s, _)| *s == ctrl.subsystem)
            .map(|(_, n)| *n)
            .collect();
        if changed.is_empty() {
            return;
        }
        changed.sort_unstable();
        changed.dedup();
        let now = namespaces_of(env, &ctrl.subsystem);
        if !ctrl.vwc
            && now
                .iter()
                .any(|ns| super::controller::needs_vwc(ns.domain()))
        {
            log::info!(
                "nvme-tcp controller {} (host {}): a namespace that needs a volatile write cache \
                 was added by reload, and the controller reported none: closing (the host \
                 reconnects)",
                ctrl.cntlid,
                ctrl.host
            );
            self.end(crate::metrics::EndReason::Reload, env);
            return self.close(env);
        }
        log::info!(
            "nvme-tcp controller {} (host {}): namespace(s) {changed:?} changed by reload",
            ctrl.cntlid,
            ctrl.host
        );
        for nsid in ctrl.set_namespaces(now.clone(), &changed) {
            log::warn!(
                "nvme-tcp controller {} (host {}): namespace {nsid} failed while it was \
                 connected: writes it completed before may be lost (the host keeps no copy), so \
                 to this controller the namespace stays failed (Write Fault to writes, FUA and \
                 Flush) even once cleared; its host must reconnect to use it again",
                ctrl.cntlid,
                ctrl.host
            );
        }
        if let Phase::Admin(a) = &mut self.phase {
            a.reg.hold(now);
        }
        self.deliver_events();
    }
}
