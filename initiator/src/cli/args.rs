//! The command line: the clap types ([`Cli`], the [`Global`] options every subcommand takes,
//! [`Command`], [`Source`], `bench`'s [`JobArgs`]), the value parsers, and what the global
//! options build (the connection, its options and reconnect policy).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use rpma_common::proto::auth::Psk;
use rpma_common::proto::nqn::Nqn;
use rpma_initiator::{
    ConnectOptions, Connection, HostIdentity, PersistMethod, QueueOptions, ReconnectPolicy,
};

use super::failure::{usage, Failure, EXIT_CODES};

/// rpma-initiator reads, writes and flushes the remote persistent memory of an rpma target.
#[derive(Debug, Parser)]
#[command(name = "rpma-initiator", version, about, long_about = None, after_help = EXIT_CODES)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub(crate) global: Global,
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// Options every subcommand takes, before or after its name.
#[derive(Debug, Args)]
pub(crate) struct Global {
    /// The target, e.g. tcp://192.0.2.7:7420 (the port is required; every command but
    /// completions and umount needs this).
    #[arg(long, global = true, value_name = "URL")]
    pub(crate) target: Option<String>,
    /// The subsystem NQN (every command but discover, completions and umount).
    #[arg(long, global = true, value_name = "NQN")]
    pub(crate) nqn: Option<String>,
    /// This host's NQN [default: /etc/nvme/hostnqn, else derived from /etc/machine-id, else
    /// one made up once and kept in /etc/nvme/hostnqn or $XDG_STATE_HOME/rpma/hostnqn].
    #[arg(long, global = true, value_name = "NQN")]
    pub(crate) hostnqn: Option<String>,
    /// This host's pre-shared key (hex, 32-64 bytes; mode 0600), when the target requires one.
    #[arg(long, global = true, value_name = "FILE")]
    pub(crate) psk_file: Option<PathBuf>,
    /// The namespace.
    #[arg(long, global = true, value_name = "N", default_value_t = 1)]
    pub(crate) nsid: u32,
    /// Force a durability method instead of the best one the target offers.
    #[arg(long, global = true, value_name = "METHOD", value_parser = ["apm", "gpspm", "flush"])]
    pub(crate) persist: Option<String>,
    /// Deadline for connecting and for each answer, in seconds.
    #[arg(long, global = true, value_name = "SECONDS", default_value_t = 10.0)]
    pub(crate) timeout: f64,
    /// How long to keep trying to connect, in seconds: a first connection refused or failed
    /// (the target not up yet, no room for this host at the moment) is retried with backoff
    /// for this long, and a lost connection is reconnected for this long (0: one attempt, no
    /// reconnect). A refusal of the host, subsystem or key is not retried.
    #[arg(long, global = true, value_name = "SECONDS", default_value_t = 60.0)]
    pub(crate) reconnect_timeout: f64,
    /// Ask for MPA CRC32c on tcp:// (on by default; rdma:// ignores it). CRC is used when
    /// either side asks: off takes effect only against a target configured with
    /// `crc = false`. CRC catches what TCP's 16-bit checksum misses (a NIC, switch or middlebox
    /// that corrupts a segment and fixes its checksum): turn it off only on a link you trust
    /// end to end. It saves a pass over every byte on both sides (docs/benchmarks.md).
    #[arg(long, global = true, value_name = "on|off", default_value = "on",
          value_parser = ["on", "off"])]
    pub(crate) crc: String,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub(crate) json: bool,
    /// Accept "visible only" for durable requests on a volatile namespace (write --durable,
    /// flush, bench): without it they print the outcome and exit 7, NOT durable.
    #[arg(long, global = true)]
    pub(crate) visible_ok: bool,
}

/// The NBD export's limits on its clients (docs/mount.md, "Limits").
#[derive(Debug, Args, Clone, Copy, PartialEq)]
pub(crate) struct NbdLimits {
    /// Client connections served at once (1-4096). A newcomer past it takes the place of one
    /// that sent no request yet (the oldest), else of one whose replies have waited unread for
    /// a second, else of an idle one (the newest of either), of the source holding the most
    /// such; refused only if all are executing requests and taking their replies.
    #[arg(long, value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(crate) max_clients: u32,
    /// Client connections from one source at once (1-4096; a TCP client's IPv4 address or IPv6
    /// /64, a Unix-socket client's user id); a newcomer past it takes the place of one of its
    /// own source's.
    #[arg(long, value_name = "N", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(crate) max_clients_per_source: u32,
    /// Seconds a client may take over its whole handshake.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0, value_parser = parse_secs)]
    pub(crate) handshake_timeout: f64,
    /// Seconds a client may send no request before it is closed (0: never). NBD has no
    /// keep-alive: a quiet kernel client is closed too (nbd-client -persist reconnects).
    #[arg(long, value_name = "SECONDS", default_value_t = 600.0, value_parser = parse_secs_or_0)]
    pub(crate) idle_timeout: f64,
    /// Queues to the target the export opens at most (1-4096; each a session on the target with
    /// its --replay-bytes of memory). A client connection takes one at its first request (none
    /// while it sends nothing); connections past it share the queues.
    #[arg(long, value_name = "N", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(crate) max_queues: u32,
    /// Seconds per period of the log limits: per period at most 5 lines about one client
    /// source and 50 in all (each for warnings and for clients coming and going), then one
    /// line counting what was held back.
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0, value_parser = parse_secs)]
    pub(crate) log_period: f64,
}

fn parse_secs(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86400.0 => Ok(v),
        _ => Err(format!(
            "{s:?}: give seconds, more than 0 and at most 86400"
        )),
    }
}

fn parse_secs_or_0(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v == 0.0 => Ok(v),
        _ => parse_secs(s).map_err(|_| format!("{s:?}: give seconds, 0 (never) to 86400")),
    }
}

impl NbdLimits {
    /// The library's limits.
    pub(crate) fn client_limits(&self) -> rpma_initiator::nbd::ClientLimits {
        rpma_initiator::nbd::ClientLimits {
            max_clients: self.max_clients as usize,
            max_per_source: self.max_clients_per_source as usize,
            handshake_timeout: Duration::from_secs_f64(self.handshake_timeout),
            idle_timeout: (self.idle_timeout > 0.0)
                .then(|| Duration::from_secs_f64(self.idle_timeout)),
            max_queues: self.max_queues as usize,
            log_period: Duration::from_secs_f64(self.log_period),
        }
    }
}

/// Where the bytes of `write` and `verify` come from.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub(crate) struct Source {
    /// The bytes of this file (its whole length).
    #[arg(long = "in", value_name = "FILE")]
    pub(crate) input: Option<PathBuf>,
    /// One byte repeated (0x5a, 90); needs --length.
    #[arg(long, value_name = "BYTE", value_parser = parse_byte, requires = "length")]
    pub(crate) pattern: Option<u8>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// List the subsystems the target lets this host see, with their listen URLs.
    Discover,
    /// Connect to a subsystem and print its namespaces (size, block size, persistence domain,
    /// durability methods), then disconnect.
    Identify,
    /// List the namespaces with the durability method this host would use on each.
    List,
    /// Read bytes: to --out FILE, else as a hex dump (raw bytes when stdout is not a terminal).
    Read {
        /// Byte offset in the namespace (4k, 1MiB...).
        #[arg(long, value_parser = parse_size)]
        offset: u64,
        /// Bytes to read.
        #[arg(long, value_parser = parse_size)]
        length: u64,
        /// Write the bytes to this file.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Write bytes (placed; with --durable, durable before the command succeeds).
    Write {
        /// Byte offset in the namespace.
        #[arg(long, value_parser = parse_size)]
        offset: u64,
        #[command(flatten)]
        source: Source,
        /// Bytes of --pattern to write.
        #[arg(long, value_parser = parse_size)]
        length: Option<u64>,
        /// Make the bytes durable before returning.
        #[arg(long)]
        durable: bool,
    },
    /// Compare the namespace with a file or a pattern: exit 1 and the first differing offset
    /// on a mismatch.
    Verify {
        /// Byte offset in the namespace.
        #[arg(long, value_parser = parse_size)]
        offset: u64,
        #[command(flatten)]
        source: Source,
        /// Bytes of --pattern to compare.
        #[arg(long, value_parser = parse_size)]
        length: Option<u64>,
    },
    /// Make a range durable (every earlier write to it).
    Flush {
        /// Byte offset in the namespace.
        #[arg(long, value_parser = parse_size)]
        offset: u64,
        /// Bytes.
        #[arg(long, value_parser = parse_size)]
        length: u64,
    },
    /// Compare and swap the u64 (native endian) at an 8-byte aligned offset; prints the old value.
    Cas {
        /// Byte offset (a multiple of 8).
        #[arg(long, value_parser = parse_size)]
        offset: u64,
        /// The value expected.
        #[arg(long, value_parser = parse_u64)]
        expected: u64,
        /// The value to store if it matches.
        #[arg(long, value_parser = parse_u64)]
        new: u64,
    },
    /// Fetch and add on the u64 (native endian) at an 8-byte aligned offset; prints the old value.
    Faa {
        /// Byte offset (a multiple of 8).
        #[arg(long, value_parser = parse_size)]
        offset: u64,
        /// The addend.
        #[arg(long, value_parser = parse_u64)]
        add: u64,
    },
    /// A short QD1 latency run (durable writes, reads) and a bandwidth run. Overwrites the range
    /// it uses: give --offset (where that range starts), or --yes to use offset 0.
    Bench {
        /// Byte offset of the range used (overwritten: up to --total bytes from here).
        #[arg(long, value_parser = parse_size)]
        offset: Option<u64>,
        /// Overwrite from offset 0 without an explicit --offset.
        #[arg(long)]
        yes: bool,
        /// Size of each latency operation.
        #[arg(long, value_parser = parse_size, default_value = "4k")]
        io_size: u64,
        /// Latency operations per kind.
        #[arg(long, default_value_t = 1000)]
        count: u32,
        /// Bytes moved by each bandwidth run (capped at the namespace).
        #[arg(long, value_parser = parse_size, default_value = "64MiB")]
        total: u64,
        /// Requests in flight in the bandwidth run.
        #[arg(long, default_value_t = 32)]
        depth: usize,
        #[command(flatten)]
        fio: JobArgs,
    },
    /// Serve the namespace as an NBD export (fixed newstyle) until SIGTERM, SIGINT or SIGHUP
    /// (each answers what clients sent, flushes and exits); prints the
    /// export's URL once clients can connect (READY=1 to systemd).
    Nbd {
        /// Listen on this Unix socket (clients: nbd+unix:///NAME?socket=PATH).
        #[arg(
            long,
            value_name = "PATH",
            conflicts_with = "listen",
            required_unless_present = "listen"
        )]
        socket: Option<PathBuf>,
        /// Listen on this TCP address (clients: nbd://HOST:PORT/NAME).
        #[arg(long, value_name = "HOST:PORT")]
        listen: Option<String>,
        /// The export's name (the empty name, the default export, selects it too).
        #[arg(long, value_name = "NAME", default_value = "rpma")]
        export: String,
        /// Requests in flight on the target at once, 1-128 (and requests of a client issued
        /// together).
        #[arg(long, value_name = "N", default_value_t = 64,
              value_parser = clap::value_parser!(u16).range(1..=128))]
        queue_depth: u16,
        /// Memory per target queue for written chunks kept until a durability acknowledgement
        /// covers them (what a reconnect re-issues; a FLUSH frees them), as a disk's write
        /// cache: when it is full, the export stops taking requests until the target made
        /// them durable. 0: one 256 KiB chunk per request in flight. At most 1GiB. On tcp://
        /// its pages are touched only as they are used (a 4 KiB write takes one page of its
        /// chunk); rdma:// registers (pins) all of it, against RLIMIT_MEMLOCK.
        #[arg(long, value_name = "SIZE", default_value = "64MiB", value_parser = parse_replay_bytes)]
        replay_bytes: u64,
        #[command(flatten)]
        limits: NbdLimits,
    },
    /// Show the namespace as one regular file (DIR/nsN) in a FUSE filesystem, in the foreground
    /// until SIGTERM, SIGINT, SIGHUP or `umount`; prints the file's path (and the loop
    /// device's) once ready. Needs root. fsync makes every acknowledged write durable (docs/mount.md, "FUSE file and
    /// loop device").
    Mount {
        /// The mount point (an existing directory).
        dir: PathBuf,
        /// Also attach a loop device to the file (direct I/O) and print its path.
        #[arg(long = "loop")]
        loop_dev: bool,
        /// The file's name [default: nsN].
        #[arg(long, value_name = "NAME")]
        file_name: Option<String>,
    },
    /// Undo `mount`: detach the loop devices over its file, unmount DIR (the mount process then
    /// persists, disconnects and exits). Refuses (exit 1) while a filesystem on one of those
    /// loop devices is mounted: unmount it first (one unmounted just before is waited for, 2 s
    /// at most); fails (exit 1) while the file is open elsewhere (after a detach, its release
    /// is waited for, 10 s at most).
    Umount {
        /// The mount point.
        dir: PathBuf,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// The options of `bench` that run a job file (flattened into the `bench` subcommand).
#[derive(Debug, Args)]
pub(crate) struct JobArgs {
    /// Run this fio job file instead of the quick bench (the options fio's matrix uses:
    /// rw, bs, iodepth, numjobs, size, offset, runtime, time_based, ramp_time, rwmixread,
    /// fsync/sync, verify). It overwrites the region its jobs name.
    #[arg(long, value_name = "FILE",
          conflicts_with_all = ["offset", "yes", "io_size", "count", "total", "depth"])]
    pub(crate) job: Option<PathBuf>,
    /// How --job reports: fio's text summary, or fio's JSON (also with --json) [default: normal].
    #[arg(long, value_name = "FORMAT", value_parser = ["normal", "json"], requires = "job")]
    pub(crate) output_format: Option<String>,
    /// With --job: copy each write into the queue's bounce buffers, as `write_at` does, instead
    /// of writing from a registered buffer without a copy (the default where verify is off).
    #[arg(long, requires = "job")]
    pub(crate) copy_writes: bool,
    /// With --job: copy each read's bytes out of the queue's bounce buffers, as `read_at` does,
    /// instead of reading into registered buffers without a copy (the default for requests
    /// of at most one chunk).
    #[arg(long, requires = "job")]
    pub(crate) copy_reads: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    rpma_common::units::parse_size(s).map_err(|e| e.to_string())
}

fn parse_replay_bytes(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        v if v <= QueueOptions::MAX_REPLAY_BYTES as u64 => Ok(v),
        v => Err(format!("{s:?} is {v} bytes: at most 1GiB")),
    }
}

fn parse_u64(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let r = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => t.parse(),
    };
    r.map_err(|_| format!("{s:?} is not a u64 (decimal or 0x hex)"))
}

fn parse_byte(s: &str) -> Result<u8, String> {
    let v = parse_u64(s)?;
    u8::try_from(v).map_err(|_| format!("{s:?} is not a byte (0..=255)"))
}

impl Global {
    pub(crate) fn target(&self) -> Result<&str, Failure> {
        self.target
            .as_deref()
            .ok_or_else(|| usage("--target URL is required (e.g. tcp://127.0.0.1:7420)".into()))
    }

    pub(crate) fn host(&self) -> Result<HostIdentity, Failure> {
        let host = match &self.hostnqn {
            Some(n) => HostIdentity::new(
                Nqn::new(n.as_str()).map_err(|e| usage(format!("--hostnqn {n:?}: {e}")))?,
            ),
            None => HostIdentity::default_host()?,
        };
        Ok(match &self.psk_file {
            Some(f) => host.with_psk(Psk::from_file(f).map_err(|e| Failure {
                code: 5,
                err: anyhow::Error::new(e).context(format!("--psk-file {}", f.display())),
            })?),
            None => host,
        })
    }

    pub(crate) fn subsystem(&self) -> Result<Nqn, Failure> {
        let n = self
            .nqn
            .as_deref()
            .ok_or_else(|| usage("--nqn NQN (the subsystem) is required".into()))?;
        Nqn::new(n).map_err(|e| usage(format!("--nqn {n:?}: {e}")))
    }

    pub(crate) fn persist_method(&self) -> Option<PersistMethod> {
        self.persist.as_deref().and_then(|m| m.parse().ok())
    }

    /// The data path's connection, with queue depth `depth`.
    pub(crate) fn connection(&self, depth: usize) -> Result<Connection, Failure> {
        self.connection_with(depth, QueueOptions::default().chunk, 0)
    }

    /// [`connection`](Self::connection) with queues of `depth` slots of `chunk` bytes.
    pub(crate) fn connection_with(
        &self,
        depth: usize,
        chunk: usize,
        replay_bytes: usize,
    ) -> Result<Connection, Failure> {
        Ok(
            Connection::new(self.target()?, self.subsystem()?, self.host()?)
                .with_connect_options(self.options()?)
                .with_queue_options(QueueOptions {
                    depth,
                    chunk,
                    replay_bytes,
                    persist: self.persist_method(),
                    reconnect: self.reconnect_policy()?,
                    ..QueueOptions::default()
                }),
        )
    }

    pub(crate) fn reconnect_policy(&self) -> Result<ReconnectPolicy, Failure> {
        let t = self.reconnect_timeout;
        if !(t.is_finite() && (0.0..=86400.0).contains(&t)) {
            return Err(usage(format!(
                "--reconnect-timeout {t}: give seconds, from 0 (no reconnect) to 86400"
            )));
        }
        Ok(if t == 0.0 {
            ReconnectPolicy::never()
        } else {
            ReconnectPolicy::within(Duration::from_secs_f64(t))
        })
    }

    pub(crate) fn options(&self) -> Result<ConnectOptions, Failure> {
        if !(self.timeout.is_finite() && self.timeout > 0.0 && self.timeout <= 3600.0) {
            return Err(usage(format!(
                "--timeout {}: give seconds, more than 0 and at most 3600",
                self.timeout
            )));
        }
        let mut o = ConnectOptions {
            timeout: Duration::from_secs_f64(self.timeout),
            ..ConnectOptions::default()
        };
        o.tcp.crc = match self.crc.as_str() {
            "on" => true,
            "off" => false,
            c => return Err(usage(format!("--crc {c}: give on or off"))),
        };
        Ok(o)
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_is_consistent_and_globals_go_anywhere() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        for args in [
            &[
                "rpma-initiator",
                "--json",
                "--target",
                "tcp://h:1",
                "--nqn",
                "n",
                "--nsid",
                "2",
                "read",
                "--offset",
                "4k",
                "--length",
                "1MiB",
            ][..],
            &[
                "rpma-initiator",
                "read",
                "--nqn",
                "n",
                "--offset",
                "4096",
                "--target",
                "tcp://h:1",
                "--length",
                "1m",
                "--json",
                "--nsid",
                "2",
            ],
        ] {
            let c = Cli::try_parse_from(args).unwrap();
            assert!(c.global.json);
            assert_eq!(c.global.target.as_deref(), Some("tcp://h:1"));
            assert_eq!(c.global.nqn.as_deref(), Some("n"));
            assert_eq!(c.global.nsid, 2);
            assert!(matches!(
                c.command,
                Command::Read {
                    offset: 4096,
                    length: 1048576,
                    out: None
                }
            ));
        }
        // write: exactly one of --in and --pattern; --pattern needs --length.
        let w = |extra: &[&str]| {
            let mut a = vec!["rpma-initiator", "write", "--offset", "0"];
            a.extend_from_slice(extra);
            Cli::try_parse_from(a)
        };
        assert!(w(&["--pattern", "0x5a", "--length", "4k"]).is_ok());
        assert!(w(&["--in", "f"]).is_ok());
        assert!(w(&[]).is_err());
        assert!(w(&["--pattern", "0x5a"]).is_err());
        assert!(w(&["--pattern", "256", "--length", "1"]).is_err());
        assert!(w(&["--in", "f", "--pattern", "1", "--length", "1"]).is_err());
        assert!(
            Cli::try_parse_from(["rpma-initiator", "read", "--offset", "4x", "--length", "1"])
                .is_err()
        );
        assert!(Cli::try_parse_from([
            "rpma-initiator",
            "flush",
            "--persist",
            "fsync",
            "--offset",
            "0",
            "--length",
            "1"
        ])
        .is_err());
        assert!(Cli::try_parse_from(["rpma-initiator", "completions", "bash"]).is_ok());
    }

    #[test]
    fn bad_options_are_usage_errors() {
        let g = Global {
            target: None,
            nqn: None,
            hostnqn: Some("not an nqn".into()),
            psk_file: None,
            nsid: 1,
            persist: None,
            timeout: 0.0,
            reconnect_timeout: -1.0,
            crc: "on".into(),
            json: false,
            visible_ok: false,
        };
        assert_eq!(g.target().err().map(|f| f.code), Some(2));
        assert_eq!(g.subsystem().err().map(|f| f.code), Some(2));
        assert_eq!(parse_u64("0x10"), Ok(16));
        assert_eq!(parse_byte("90"), Ok(90));
        assert!(parse_u64("-1").is_err());
        assert_eq!(g.host().err().map(|f| f.code), Some(2));
        assert_eq!(g.options().err().map(|f| f.code), Some(2));
        assert_eq!(g.reconnect_policy().err().map(|f| f.code), Some(2));
        let g = Global {
            reconnect_timeout: 0.0,
            ..g
        };
        assert_eq!(g.reconnect_policy().ok(), Some(ReconnectPolicy::never()));
        let g = Global {
            reconnect_timeout: 90.0,
            ..g
        };
        let p = g.reconnect_policy().ok().unwrap();
        assert_eq!(p.timeout, Duration::from_secs(90));
        assert!(p.max_attempts > 0);
        // --crc: on asks for CRC (the default), off does not; anything else is refused, by
        // the parser and by options() (a Global built otherwise).
        let g = Global { timeout: 5.0, ..g };
        assert!(g.options().ok().unwrap().tcp.crc);
        let g = Global {
            crc: "off".into(),
            ..g
        };
        assert!(!g.options().ok().unwrap().tcp.crc);
        let g = Global {
            crc: "maybe".into(),
            ..g
        };
        assert_eq!(g.options().err().map(|f| f.code), Some(2));
        let parsed = |a: &[&str]| Cli::try_parse_from(a).map(|c| c.global.crc);
        assert_eq!(parsed(&["rpma-initiator", "list"]).unwrap(), "on");
        assert_eq!(
            parsed(&["rpma-initiator", "list", "--crc", "off"]).unwrap(),
            "off"
        );
        assert!(parsed(&["rpma-initiator", "--crc", "no", "list"]).is_err());
    }

    #[test]
    fn bench_offset_is_optional_only_in_the_parser() {
        let c = Cli::try_parse_from(["rpma-initiator", "bench"]).unwrap();
        assert!(matches!(
            c.command,
            Command::Bench {
                offset: None,
                yes: false,
                ..
            }
        ));
        let c = Cli::try_parse_from(["rpma-initiator", "bench", "--offset", "16MiB"]).unwrap();
        assert!(matches!(
            c.command,
            Command::Bench {
                offset: Some(16777216),
                ..
            }
        ));
        let c = Cli::try_parse_from(["rpma-initiator", "bench", "--reconnect-timeout", "5"]);
        assert_eq!(c.unwrap().global.reconnect_timeout, 5.0);
    }
}
