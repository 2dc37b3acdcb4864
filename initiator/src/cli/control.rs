//! The control-side subcommands: discover (a target's subsystems) and identify (a
//! subsystem's namespaces).

use rpma_initiator::ConnectOptions;
use serde::Serialize;

use super::args::Global;
use super::failure::Failure;
use super::json::{print_json, NamespaceJson};

pub(crate) fn discover(g: &Global) -> Result<(), Failure> {
    let target = g.target()?;
    let (host, opts) = (g.host()?, g.options()?);
    let entries = g
        .reconnect_policy()?
        .first_connection(target, opts.timeout, |timeout| {
            rpma_initiator::discover(
                target,
                &host,
                &ConnectOptions {
                    timeout,
                    ..opts.clone()
                },
            )
        })?;
    if g.json {
        #[derive(Serialize)]
        struct Entry<'a> {
            nqn: &'a str,
            listen: &'a [String],
        }
        #[derive(Serialize)]
        struct Out<'a> {
            target: &'a str,
            subsystems: Vec<Entry<'a>>,
        }
        return print_json(&Out {
            target,
            subsystems: entries
                .iter()
                .map(|e| Entry {
                    nqn: e.subsystem_nqn.as_str(),
                    listen: &e.listen,
                })
                .collect(),
        });
    }
    if entries.is_empty() {
        println!("{target}: no subsystem is visible to this host");
    }
    for e in &entries {
        println!("{}  {}", e.subsystem_nqn, e.listen.join(" "));
    }
    Ok(())
}

pub(crate) fn identify(g: &Global) -> Result<(), Failure> {
    let target = g.target()?;
    let subsystem = g.subsystem()?;
    let (host, opts) = (g.host()?, g.options()?);
    let id = g
        .reconnect_policy()?
        .first_connection(target, opts.timeout, |timeout| {
            let o = ConnectOptions {
                timeout,
                ..opts.clone()
            };
            rpma_initiator::identify(target, &subsystem, &host, &o)
        })?;
    if g.json {
        #[derive(Serialize)]
        struct Out<'a> {
            target: &'a str,
            subsystem: &'a str,
            controller_id: u16,
            keep_alive_ms: u128,
            namespaces: Vec<NamespaceJson>,
        }
        return print_json(&Out {
            target: &id.url,
            subsystem: id.subsystem.as_str(),
            controller_id: id.controller_id,
            keep_alive_ms: id.keep_alive.as_millis(),
            namespaces: id.namespaces.iter().map(NamespaceJson::from).collect(),
        });
    }
    println!(
        "{} on {}: controller {}, keep-alive {} ms, {} namespace(s)",
        id.subsystem,
        id.url,
        id.controller_id,
        id.keep_alive.as_millis(),
        id.namespaces.len()
    );
    for n in &id.namespaces {
        let methods = n.durability.names();
        let methods = if methods.is_empty() {
            "none (visible only)".to_owned()
        } else {
            methods.join(" ")
        };
        if let Some(why) = &n.unavailable {
            println!(
                "  nsid {}: {} bytes, block {}, domain {}, UNAVAILABLE: {why}",
                n.nsid,
                n.size,
                n.block_size,
                n.domain_label()
            );
            continue;
        }
        println!(
            "  nsid {}: {} bytes, block {}, domain {}, durability {}, {}",
            n.nsid,
            n.size,
            n.block_size,
            n.domain_label(),
            methods,
            if n.read_only {
                "read-only"
            } else {
                "read-write"
            }
        );
    }
    Ok(())
}
