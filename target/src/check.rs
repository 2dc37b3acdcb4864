//! `rpma-target check-config FILE`: validate a configuration, probe every namespace through the
//! pmem layer, and print its domain and the durability methods each transport would offer.

use std::io::Write;
use std::path::Path;

use rpma_common::pmem::{Domain, OpenOptions};
use rpma_common::units::format_size;

use crate::config::{Config, Transport};
use crate::namespace::{durability_methods, OpenNamespace};

/// An error with its chain of causes on one line.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn methods_line(cfg: &Config, domain: Domain) -> String {
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
            };
            let m = durability_methods(domain, t, dwp);
            if m.is_empty() {
                format!("{name}: none durable (visible only)")
            } else {
                format!("{name}: {}", m.names().join(" "))
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Probes the domain a namespace file not yet created would have, with a one-block scratch file
/// beside it (removed again), and checks there is room for it.
fn probe_new(path: &Path, size: u64, block_size: u32, force_dax: bool) -> Result<Domain, String> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let st = nix::sys::statvfs::statvfs(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let avail = (st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64);
    if avail < size {
        return Err(format!(
            "{} has {} free, the namespace needs {}",
            dir.display(),
            format_size(avail),
            format_size(size)
        ));
    }
    let scratch = dir.join(format!(".rpma-check-{}", std::process::id()));
    let r = OpenOptions::new(&scratch)
        .size(u64::from(block_size))
        .block_size(u64::from(block_size))
        .force_dax(force_dax)
        .create(true)
        .open()
        .map(|m| m.domain())
        .map_err(|e| chain(&e));
    let _ = std::fs::remove_file(&scratch);
    r
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
    for l in &cfg.listeners {
        let extra = match l.url.transport {
            Transport::Tcp => format!("crc {}", if cfg.crc { "on" } else { "off" }),
            Transport::Rdma => format!("direct_write_to_pmem {}", l.direct_write_to_pmem),
        };
        writeln!(out, "listener {} ({extra})", l.url)?;
        if l.url.transport == Transport::Rdma && !cfg!(feature = "rdma") {
            writeln!(
                out,
                "problem: listener {}: this build has no rdma transport (feature `rdma`)",
                l.url
            )?;
            problems += 1;
        }
    }
    writeln!(out, "control socket {}", cfg.control_socket.display())?;
    writeln!(
        out,
        "keep_alive_ms {}, poll_loops {}, max_connections {}, max_queue_depth {}, discovery {}",
        cfg.keep_alive_ms,
        cfg.poll_loops,
        cfg.max_connections,
        cfg.max_queue_depth,
        if cfg.discovery { "on" } else { "off" }
    )?;
    let mut count = 0usize;
    for s in &cfg.subsystems {
        let keyed = s.hosts.iter().filter(|h| h.psk.is_some()).count();
        writeln!(
            out,
            "subsystem {}: {} host(s), {keyed} with a key, allow_any_host {}",
            s.nqn,
            s.hosts.len(),
            s.allow_any_host
        )?;
        for ns in &s.namespaces {
            count += 1;
            let rw = if ns.read_only {
                "read-only"
            } else {
                "read-write"
            };
            let head = format!("  nsid {}: {}", ns.nsid, ns.path.display());
            // A file that `grow = true` would grow is probed as it is: checking changes nothing.
            let smaller = std::fs::metadata(&ns.path)
                .ok()
                .filter(|m| m.is_file())
                .zip(ns.size)
                .is_some_and(|(m, size)| m.len() < size);
            let probed = if ns.grow && smaller {
                let as_is = crate::config::Namespace {
                    size: None,
                    grow: false,
                    ..ns.clone()
                };
                OpenNamespace::open(&s.nqn, &as_is)
                    .map(|o| (o.domain(), ns.size.unwrap_or(0), " (will be grown)"))
                    .map_err(|e| chain(&e))
            } else if ns.path.exists() || ns.size.is_none() {
                OpenNamespace::open(&s.nqn, ns)
                    .map(|o| (o.domain(), o.size(), ""))
                    .map_err(|e| chain(&e))
            } else {
                let size = ns.size.unwrap_or(0);
                probe_new(&ns.path, size, ns.block_size, ns.force_dax)
                    .map(|d| (d, size, " (will be created)"))
            };
            match probed {
                Ok((domain, size, note)) => writeln!(
                    out,
                    "{head}{note}, {}, block {}, {rw}: domain {domain}; {}",
                    format_size(size),
                    ns.block_size,
                    methods_line(&cfg, domain)
                )?,
                Err(e) => {
                    writeln!(out, "{head}: problem: {e}")?;
                    problems += 1;
                }
            }
        }
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
