//! `rpma-target check-config FILE`: validate a configuration, say for every namespace what the
//! daemon would do with its backing store (create, grow, open as it is, or refuse) and its domain,
//! and the durability methods each transport would offer. It changes nothing: the pmem layer's
//! [`OpenOptions::plan`](rpma_common::pmem::OpenOptions::plan) only looks.

use std::io::Write;
use std::path::Path;

use rpma_common::fabric::{Context, MemoryBacking};
use rpma_common::pmem::{self, Domain, Plan, PlanAction, Resize};
use rpma_common::units::format_size;

use crate::config::{Config, ListenUrl, Transport};
use crate::memlock;
use crate::namespace::{access_for, offered_methods, OpenNamespace};

use rpma_common::error_chain as chain;

fn methods_line(cfg: &Config, domain: Domain, simulated: bool) -> String {
    let mut seen = Vec::new();
    for l in &cfg.listeners {
        let key = (l.url.transport, l.direct_write_to_pmem);
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
    }
    seen.iter()
        .map(|&(t, dwp)| {
            let name = match (t, dwp) {
                (Transport::Tcp, _) => "tcp",
                (Transport::Rdma, false) => "rdma",
                (Transport::Rdma, true) => "rdma(direct_write_to_pmem)",
                (Transport::NvmeTcp, _) => "nvme-tcp",
            };
            let m = offered_methods(domain, t, dwp, simulated);
            if m.is_empty() {
                format!("{name}: none durable (visible only)")
            } else {
                format!("{name}: {}", m.names().join(" "))
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The RDMA device a listener would use, or why there is none.
#[cfg(feature = "rdma")]
fn rdma_device(url: &ListenUrl) -> Result<Context, String> {
    use rpma_common::fabric::Url;
    let u = Url::parse(&url.to_string()).map_err(|e| chain(&e))?;
    Context::for_url(&u).map_err(|e| chain(&e))
}

/// Without the feature there is no rdma transport to open.
#[cfg(not(feature = "rdma"))]
fn rdma_device(_: &ListenUrl) -> Result<Context, String> {
    Err("this build has no rdma transport (feature `rdma`)".into())
}

/// What a NIC registration of the planned namespace would be up against.
fn backing_of(plan: &Plan) -> MemoryBacking {
    match plan.probed {
        _ if matches!(plan.action, PlanAction::DevDax) => MemoryBacking::DevDax,
        Domain::Dax | Domain::DaxForced => MemoryBacking::FsDax,
        Domain::PageCache => MemoryBacking::PageCache,
        _ => MemoryBacking::Ram,
    }
}

/// What opening the namespace would do, in words ("would create 64 MiB").
fn planned(plan: &Plan) -> String {
    let size = format_size(plan.size);
    match plan.action {
        PlanAction::Create => format!("would create {size}"),
        PlanAction::Grow { from: 0 } => {
            format!("would grow from 0 B to {size} (the file is empty)")
        }
        PlanAction::Grow { from } => {
            format!(
                "would grow from {} to {size} (grow = true)",
                format_size(from)
            )
        }
        PlanAction::Shrink { from } => format!("would shrink from {} to {size}", format_size(from)),
        PlanAction::AsIs => format!("exists, {size}"),
        PlanAction::DevDax => format!("devdax, {size}"),
        _ => format!("would open, {size}"),
    }
}

/// Why opening the namespace would fail, with the configuration key that changes it.
fn refusal(e: &pmem::Error) -> String {
    let hint = match e.resize_needed() {
        Some(Resize::Grow) => "; set `grow = true` on the namespace to grow it",
        Some(_) => "; rpma-target never shrinks a namespace file: configure the size it has",
        None => "",
    };
    format!("{}{hint}", chain(e))
}

/// Runs the check, writing a report to `out`; returns whether everything is usable.
pub fn check_config(path: &Path, out: &mut dyn Write) -> std::io::Result<bool> {
    writeln!(out, "checking {}", path.display())?;
    let cfg = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            writeln!(out, "problem: {}", chain(&e))?;
            writeln!(out, "FAILED: the configuration is invalid")?;
            return Ok(false);
        }
    };
    let mut problems = 0usize;
    // As the daemon refuses at its start (the unit runs this first, as its guard).
    if let Err(e) = crate::serve::one_transport(&cfg) {
        writeln!(out, "problem: {e}")?;
        problems += 1;
    }
    // The rdma listeners' devices: each namespace is checked against each.
    let mut devices: Vec<(String, Context)> = Vec::new();
    for l in &cfg.listeners {
        let extra = match l.url.transport {
            Transport::Tcp => format!("crc {}", if cfg.crc { "on" } else { "off" }),
            Transport::Rdma => format!("direct_write_to_pmem {}", l.direct_write_to_pmem),
            Transport::NvmeTcp => "NVMe/TCP: digests as each host asks".to_owned(),
        };
        writeln!(out, "listener {} ({extra})", l.url)?;
        if l.url.transport == Transport::Rdma {
            match rdma_device(&l.url) {
                Ok(ctx) => {
                    writeln!(out, "  rdma device {}", ctx.device_name())?;
                    devices.push((l.url.to_string(), ctx));
                }
                Err(why) => {
                    writeln!(out, "problem: listener {}: {why}", l.url)?;
                    problems += 1;
                }
            }
        }
    }
    let rdma = cfg
        .listeners
        .iter()
        .any(|l| l.url.transport == Transport::Rdma);
    let mut pinned_per_subsystem = Vec::new();
    writeln!(out, "control socket {}", cfg.control_socket.display())?;
    if let Some(addr) = cfg.metrics_listen {
        writeln!(out, "metrics http://{addr}/metrics")?;
    }
    writeln!(
        out,
        "keep_alive_ms {}, poll_loops {}, max_connections {}, max_queue_depth {}, discovery {}",
        cfg.keep_alive_ms,
        cfg.poll_loops,
        cfg.max_connections,
        cfg.max_queue_depth,
        if cfg.discovery { "on" } else { "off" }
    )?;
    writeln!(
        out,
        "admission: unadmitted {} ({} per source, {} ms to Connect), discovery {} ({} per source, \
         keep-alive at most {} ms, closed after {} ms), refusals logged once per peer per {} ms",
        cfg.admission.max_unadmitted,
        cfg.admission.max_unadmitted_per_source,
        cfg.admission.handshake_timeout_ms,
        cfg.admission.max_discovery,
        cfg.admission.max_discovery_per_source,
        cfg.admission.discovery_max_keep_alive_ms,
        cfg.admission.discovery_timeout_ms,
        cfg.admission.refusal_log_period_ms
    )?;
    let remembered = match crate::failures::peek(&cfg.state_file) {
        Ok(f) => {
            // A bare file name's parent is "" (a configuration named without a directory):
            // the current one.
            let dir = cfg
                .state_file
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            let writable = match &f {
                Some(_) => nix::unistd::access(&cfg.state_file, nix::unistd::AccessFlags::W_OK),
                None => nix::unistd::access(dir, nix::unistd::AccessFlags::W_OK),
            };
            let what = match &f {
                Some(v) => format!("{} failed namespace(s) remembered", v.len()),
                None => "would create it".into(),
            };
            match writable {
                Ok(()) => writeln!(out, "state file {}: {what}", cfg.state_file.display())?,
                Err(e) => {
                    writeln!(
                        out,
                        "problem: state_file {}: not writable ({e}): the daemon would not start; \
                         set `state_file` to a path it can write",
                        cfg.state_file.display()
                    )?;
                    problems += 1;
                }
            }
            f.unwrap_or_default()
        }
        Err(e) => {
            writeln!(out, "problem: {}", chain(&e))?;
            problems += 1;
            Vec::new()
        }
    };
    let mut count = 0usize;
    for s in &cfg.subsystems {
        let mut pinned = 0u64;
        let keyed = s.hosts.iter().filter(|h| h.psk.is_some()).count();
        writeln!(
            out,
            "subsystem {}: {} host(s), {keyed} with a key, allow_any_host {}",
            s.nqn,
            s.hosts.len(),
            s.allow_any_host
        )?;
        if keyed > 0 && cfg.listeners.iter().any(|l| !l.url.transport.is_fabric()) {
            writeln!(
                out,
                "  note: its {keyed} host(s) with a key are refused on nvme-tcp:// listeners \
                 (Authentication Required: no DH-HMAC-CHAP there); they connect over tcp:// or \
                 rdma:// with rpma-initiator"
            )?;
        }
        for ns in &s.namespaces {
            count += 1;
            let rw = if ns.read_only {
                "read-only"
            } else {
                "read-write"
            };
            let head = format!("  nsid {}: {}", ns.nsid, ns.path.display());
            // Its failure, if remembered: by its path, or as the same file under another (moved
            // and the configuration edited), as the daemon finds it.
            let (key, file_id) = (
                crate::failures::key_of(&ns.path),
                crate::failures::file_id_of(&ns.path),
            );
            // Plan only: checking creates, grows, allocates and maps nothing.
            match OpenNamespace::options(ns).plan() {
                Ok(plan) => {
                    // What an rdma registration pins (devdax, RAM); fsdax and page-cache use ODP.
                    if matches!(plan.action, PlanAction::DevDax) || plan.domain == Domain::Volatile
                    {
                        pinned += plan.size;
                    }
                    writeln!(
                        out,
                        "{head}: {}, block {}, {rw}: domain {}; {}",
                        planned(&plan),
                        ns.block_size,
                        match ns.power_loss_simulation {
                            Some(s) => format!("{}, {}", plan.domain, s.label()),
                            None => plan.domain.to_string(),
                        },
                        methods_line(&cfg, plan.domain, ns.power_loss_simulation.is_some())
                    )?;
                    // Whether each rdma device can register it, and how.
                    let access = access_for(ns.read_only, plan.domain);
                    for (url, ctx) in &devices {
                        let dev = ctx.device_name();
                        match ctx.registration(backing_of(&plan), access) {
                            Ok(r) => writeln!(out, "    {url} ({dev}): registered {r}")?,
                            Err(why) => {
                                writeln!(
                                    out,
                                    "    problem: {url} ({dev}) cannot register nsid {}: {why}; \
                                     hosts would see it unavailable",
                                    ns.nsid
                                )?;
                                problems += 1;
                            }
                        }
                    }
                }
                // A file cut short under the daemon, whose failure is known: the daemon opens
                // it failed, as it is, and serves the others (not a problem of the
                // configuration; ExecStartPre must not keep the daemon from starting). Not under
                // the power-loss simulation: the daemon refuses it there.
                Err(rpma_common::pmem::Error::WouldGrow {
                    existing,
                    requested,
                    ..
                }) if ns.power_loss_simulation.is_none()
                    && (remembered.iter().any(|f| f.is_of(&key, file_id))
                        || crate::namespace::marked_failed(&ns.path)) =>
                {
                    writeln!(
                        out,
                        "{head}: opens FAILED as it is: the file is {existing} bytes, shorter \
                         than its size {requested}, and its failure is known; nothing of it is \
                         served until the file has its size back and the failure is cleared"
                    )?;
                }
                Err(e) => {
                    writeln!(out, "{head}: problem: would refuse: {}", refusal(&e))?;
                    problems += 1;
                }
            }
            if let Some(f) = remembered.iter().find(|f| f.is_of(&key, file_id)) {
                // Not a problem of the configuration: the daemon starts and serves it failed.
                writeln!(
                    out,
                    "    FAILED since {}: {}: no durability until `rpma-target clear-failure {} {}`",
                    f.since(),
                    f.failure,
                    s.nqn,
                    ns.nsid
                )?;
            }
        }
        pinned_per_subsystem.push(pinned);
    }
    if rdma {
        let slots = crate::serve::slots(&cfg);
        let per_session = pinned_per_subsystem.into_iter().max().unwrap_or(0) + slots.session;
        let limit = memlock::current_limit();
        match memlock::judge(limit, per_session, cfg.max_connections, slots.pools) {
            memlock::Verdict::Fine => writeln!(
                out,
                "memlock: {limit}: enough for max_connections {} rdma sessions of {} each",
                cfg.max_connections,
                format_size(per_session)
            )?,
            memlock::Verdict::Short(m) => writeln!(out, "warning: {m}")?,
            memlock::Verdict::TooLow(m) => {
                writeln!(out, "problem: {m}")?;
                problems += 1;
            }
        }
    }
    let max = rpma_common::proto::MAX_LISTING as usize;
    let max_bytes = rpma_common::proto::MAX_LISTING_BYTES;
    for w in crate::subsystem::listing_warnings(&cfg, max, max_bytes) {
        writeln!(out, "warning: {w}")?;
    }
    if let Some(w) = crate::failures::capacity::capacity_warning(&cfg) {
        writeln!(out, "warning: {w}")?;
    }
    if cfg.subsystems.is_empty() {
        // Valid (a reload can add subsystems), but seldom what was meant: an empty file, or the
        // wrong one.
        writeln!(
            out,
            "warning: no subsystem: the daemon would serve no namespace until a reload adds one"
        )?;
    }
    if problems == 0 {
        writeln!(
            out,
            "OK: {count} namespace(s) in {} subsystem(s)",
            cfg.subsystems.len()
        )?;
    } else {
        writeln!(out, "FAILED: {problems} problem(s)")?;
    }
    Ok(problems == 0)
}
