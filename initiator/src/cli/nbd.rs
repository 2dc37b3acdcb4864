//! `rpma-initiator nbd`: serve the namespace as an NBD export until SIGTERM/SIGINT (the
//! server itself is the library's `nbd` module). Prints the export's URL on stdout once
//! clients can connect, and tells systemd READY=1 at the same moment.

use std::os::fd::AsFd;
use std::path::PathBuf;

use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use rpma_common::proto::PersistenceDomain;
use rpma_initiator::nbd::{ClientLimits, ExportOptions, Listener, NbdError, Server};
use rpma_initiator::QueueOptions;

use super::args::Global;
use super::failure::{usage, Failure};
use super::EXIT_NOT_DURABLE;
use rpma_common::notify::Notifier;

/// Where and what to serve.
#[derive(Debug)]
pub(crate) struct Params {
    pub(crate) socket: Option<PathBuf>,
    pub(crate) listen: Option<String>,
    pub(crate) export: String,
    pub(crate) queue_depth: usize,
    /// The queues' replay memory ([`QueueOptions::replay_bytes`]).
    pub(crate) replay_bytes: usize,
    pub(crate) limits: ClientLimits,
}

fn failure(e: NbdError) -> Failure {
    match e {
        NbdError::Library(e) => e.into(),
        e => Failure {
            code: 1,
            err: e.into(),
        },
    }
}

fn os_failure(what: &str, e: impl std::error::Error + Send + Sync + 'static) -> Failure {
    Failure {
        code: 1,
        err: anyhow::Error::new(e).context(what.to_owned()),
    }
}

pub(crate) fn run(g: &Global, p: &Params) -> Result<(), Failure> {
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGTERM);
    mask.add(Signal::SIGINT);
    // SIGHUP too, as the mount does: an export started as a shell's background job gets it
    // when the terminal or the SSH session closes, and its default action killed the process
    // with requests unanswered, no final flush, and the socket file left behind.
    mask.add(Signal::SIGHUP);
    // Blocked before the server starts its threads: only the signalfd sees them.
    mask.thread_block()
        .map_err(|e| os_failure("blocking SIGTERM/SIGINT/SIGHUP", e))?;
    let sfd = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(|e| os_failure("creating a signalfd", e))?;
    let notifier = Notifier::from_env().map_err(|e| os_failure("NOTIFY_SOCKET", e))?;
    let listener = match (&p.socket, &p.listen) {
        (Some(path), None) => Listener::unix(path),
        (None, Some(addr)) => {
            // Not an address at all is a usage error (exit 2); one that cannot be bound (in
            // use, not this machine's) is the environment's (exit 1).
            // (A name that does not resolve is the environment's too: DNS down at boot.)
            match std::net::ToSocketAddrs::to_socket_addrs(addr.as_str()) {
                Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                    return Err(usage(format!("--listen {addr:?}: not HOST:PORT: {e}")));
                }
                _ => {}
            }
            Listener::tcp(addr)
        }
        _ => {
            return Err(usage(
                "give one of --socket PATH or --listen HOST:PORT".into(),
            ))
        }
    }
    .map_err(failure)?;
    let opts = ExportOptions {
        name: p.export.clone(),
        nsid: g.nsid,
        visible_ok: g.visible_ok,
        max_batch: p.queue_depth,
        limits: p.limits,
    };
    // Slots beyond those in flight hold written chunks until they are durable: with one slot
    // per request in flight (16 MiB at depth 64), 4 KiB random writes at depth 64 stopped every
    // 64 writes for the round trip that made them durable, 30% of the export's samples
    // (docs/benchmarks.md, "Two hops: the export beside third-party relays").
    let conn = g.connection_with(p.queue_depth, QueueOptions::default().chunk, p.replay_bytes)?;
    let mut server = Server::new(conn, opts, listener).map_err(failure)?;
    let d = server.descriptor().clone();
    if d.domain == PersistenceDomain::Volatile {
        if g.visible_ok {
            log::warn!(
                "namespace {} is volatile: FLUSH and FUA writes succeed (--visible-ok) but the \
                 bytes are only visible, NOT durable",
                d.nsid
            );
        } else {
            log::warn!(
                "namespace {} is volatile: FLUSH and FUA writes will fail with EIO (nothing can \
                 make them durable; --visible-ok accepts visible only)",
                d.nsid
            );
        }
    }
    let url = server.url();
    println!("{url}");
    log::info!(
        "serving nsid {} ({} bytes, block {}, {}{}) as {url}",
        d.nsid,
        d.size,
        d.block_size,
        d.domain_label(),
        if d.read_only { ", read-only" } else { "" }
    );
    if let Err(e) = notifier.ready(&format!("serving {url}")) {
        log::warn!("cannot tell the service manager READY=1: {e}");
    }
    server.serve(sfd.as_fd()).map_err(failure)?;
    if let Ok(Some(info)) = sfd.read_signal() {
        let name = Signal::try_from(info.ssi_signo as i32).map_or("a signal", |s| s.as_str());
        log::info!("{name}: finishing the requests in flight, flushing, stopping");
    }
    let _ = notifier.stopping();
    let durable = server.shutdown().map_err(failure)?;
    if !durable && !g.visible_ok {
        return Err(Failure {
            code: EXIT_NOT_DURABLE,
            err: anyhow::anyhow!(
                "namespace {} is volatile: the writes are visible, NOT durable (--visible-ok \
                 accepts that)",
                d.nsid
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::cli::args::{Cli, Command};
    use clap::Parser;
    use rpma_initiator::nbd::ClientLimits;

    #[test]
    fn nbd_takes_exactly_one_of_socket_and_listen() {
        let p = |a: &[&str]| Cli::try_parse_from([&["rpma-initiator", "nbd"], a].concat());
        assert!(p(&[]).is_err());
        assert!(p(&["--socket", "s", "--listen", "h:1"]).is_err());
        assert!(p(&["--socket", "s", "--queue-depth", "0"]).is_err());
        assert!(p(&["--socket", "s", "--queue-depth", "129"]).is_err());
        let c = p(&["--listen", "127.0.0.1:10809", "--nsid", "2"]).unwrap();
        assert_eq!(c.global.nsid, 2);
        match c.command {
            Command::Nbd {
                socket: None,
                listen: Some(l),
                export,
                queue_depth: 64,
                replay_bytes,
                limits,
            } => {
                assert_eq!((l.as_str(), export.as_str()), ("127.0.0.1:10809", "rpma"));
                assert_eq!(replay_bytes, 64 << 20);
                assert_eq!(limits.client_limits(), ClientLimits::default());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn nbd_replay_bytes_take_sizes_up_to_1_gib_and_0() {
        let p = |v: &str| {
            let c = Cli::try_parse_from([
                "rpma-initiator",
                "nbd",
                "--socket",
                "s",
                "--replay-bytes",
                v,
            ])?;
            match c.command {
                Command::Nbd { replay_bytes, .. } => Ok::<u64, clap::Error>(replay_bytes),
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(p("0").unwrap(), 0);
        assert_eq!(p("256MiB").unwrap(), 256 << 20);
        assert_eq!(p("1GiB").unwrap(), 1 << 30);
        for bad in ["1GiB1", "2GiB", "1.5x", "lots", ""] {
            let e = p(bad).expect_err(bad).to_string();
            assert!(e.contains("--replay-bytes"), "{bad}: {e}");
        }
        let e = p("2GiB").unwrap_err().to_string();
        assert!(e.contains("at most 1GiB"), "{e}");
    }

    #[test]
    fn nbd_limits_are_checked_and_0_turns_the_idle_timeout_off() {
        let p = |a: &[&str]| {
            Cli::try_parse_from([&["rpma-initiator", "nbd", "--socket", "s"], a].concat())
        };
        for bad in [
            &["--max-clients", "0"][..],
            &["--max-clients-per-source", "0"],
            &["--handshake-timeout", "0"],
            &["--handshake-timeout", "nan"],
            &["--idle-timeout", "-1"],
            &["--log-period", "0"],
        ] {
            assert!(p(bad).is_err(), "{bad:?}");
        }
        let c = p(&[
            "--max-clients",
            "8",
            "--max-clients-per-source",
            "2",
            "--handshake-timeout",
            "1.5",
            "--idle-timeout",
            "0",
            "--log-period",
            "2",
        ])
        .unwrap();
        let Command::Nbd { limits, .. } = c.command else {
            panic!("nbd")
        };
        let l = limits.client_limits();
        assert_eq!((l.max_clients, l.max_per_source), (8, 2));
        assert_eq!(l.handshake_timeout, Duration::from_millis(1500));
        assert_eq!(l.idle_timeout, None);
        assert_eq!(l.log_period, Duration::from_secs(2));
    }
}
