use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

mod cli;
mod mount;
use rpma_common::proto::auth::Psk;
use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::NamespaceDescriptor;
use rpma_initiator::{
    ConnectOptions, Connection, Error, HostIdentity, PersistMethod, QueueOptions, ReconnectPolicy,
};
use serde::Serialize;

const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  any other error (verify: the data differ; a flush the target could not make durable;
     the namespace has failed on the target)
  2  bad command line
  3  the target could not be reached, did not answer in time, or the connection broke
     (and reconnecting failed)
  4  the target refused: unknown subsystem, host not allowed, unsupported version, other refusals
  5  authentication failed (wrong or missing key, or the target failed to prove the key)
  6  the request does not fit the namespace: no such namespace, out of range, misaligned,
     read-only, or a --persist method that cannot make it durable (APM for a flush of a range)
  7  a durable request on a volatile namespace got only \"visible\", NOT durable (--visible-ok
     accepts that)";

/// rpma-initiator connects to an rpma target and reads, writes and flushes remote persistent memory.
#[derive(Debug, Parser)]
#[command(name = "rpma-initiator", version, about, long_about = None, after_help = EXIT_CODES)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

/// Options every subcommand takes, before or after its name.
#[derive(Debug, Args)]
struct Global {
    /// The target, e.g. tcp://192.0.2.7:7420.
    #[arg(long, global = true, value_name = "URL")]
    target: Option<String>,
    /// The subsystem NQN (every command but discover).
    #[arg(long, global = true, value_name = "NQN")]
    nqn: Option<String>,
    /// This host's NQN [default: /etc/nvme/hostnqn, else derived from /etc/machine-id].
    #[arg(long, global = true, value_name = "NQN")]
    hostnqn: Option<String>,
    /// This host's pre-shared key (hex, 32-64 bytes; mode 0600), when the target requires one.
    #[arg(long, global = true, value_name = "FILE")]
    psk_file: Option<PathBuf>,
    /// The namespace.
    #[arg(long, global = true, value_name = "N", default_value_t = 1)]
    nsid: u32,
    /// Force a durability method instead of the best one the target offers.
    #[arg(long, global = true, value_name = "METHOD", value_parser = ["apm", "gpspm", "flush"])]
    persist: Option<String>,
    /// Deadline for connecting and for each answer, in seconds.
    #[arg(long, global = true, value_name = "SECONDS", default_value_t = 10.0)]
    timeout: f64,
    /// How long to keep reconnecting after a lost connection before failing, in seconds
    /// (0: do not reconnect).
    #[arg(long, global = true, value_name = "SECONDS", default_value_t = 60.0)]
    reconnect_timeout: f64,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// Accept "visible only" for durable requests on a volatile namespace (write --durable,
    /// flush, bench): without it they print the outcome and exit 7, NOT durable.
    #[arg(long, global = true)]
    visible_ok: bool,
}

/// Where the bytes of `write` and `verify` come from.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
struct Source {
    /// The bytes of this file (its whole length).
    #[arg(long = "in", value_name = "FILE")]
    input: Option<PathBuf>,
    /// One byte repeated (0x5a, 90); needs --length.
    #[arg(long, value_name = "BYTE", value_parser = parse_byte, requires = "length")]
    pattern: Option<u8>,
}

#[derive(Debug, Subcommand)]
enum Command {
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
        fio: cli::fio::JobArgs,
    },
    /// Serve the namespace as an NBD export (fixed newstyle) until SIGTERM/SIGINT; prints the
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
        /// Requests in flight on the target at once (and requests of a client issued together).
        #[arg(long, value_name = "N", default_value_t = 64,
              value_parser = clap::value_parser!(u16).range(1..=128))]
        queue_depth: u16,
    },
    /// Show the namespace as one regular file (DIR/nsN) in a FUSE filesystem, in the foreground
    /// until SIGTERM or `umount`; prints the file's path (and the loop device's) once ready.
    /// Needs root. fsync makes every acknowledged write durable (docs/mount-fuse.md).
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
    /// persists, disconnects and exits).
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

fn parse_size(s: &str) -> Result<u64, String> {
    rpma_common::units::parse_size(s).map_err(|e| e.to_string())
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

/// A failure with its exit code.
pub(crate) struct Failure {
    code: u8,
    err: anyhow::Error,
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::Url { .. } => 2,
            Error::Connect { .. }
            | Error::Timeout { .. }
            | Error::ConnectionLost { .. }
            | Error::KeepAliveLost { .. }
            | Error::Disconnected { .. } => 3,
            Error::UnknownSubsystem { .. }
            | Error::HostNotAllowed { .. }
            | Error::VersionUnsupported { .. }
            | Error::Refused { .. } => 4,
            Error::AuthFailed { .. }
            | Error::KeyRequired
            | Error::TargetNotAuthenticated { .. } => 5,
            Error::ReconnectFailed { .. } | Error::Broken => 3,
            Error::NoSuchNamespace { .. }
            | Error::OutOfRange { .. }
            | Error::Misaligned { .. }
            | Error::ReadOnly { .. }
            | Error::MethodNotValid { .. }
            | Error::ApmNotForRanges { .. } => 6,
            Error::InvalidArgument(_) => 2,
            _ => 1,
        };
        Failure {
            code,
            err: e.into(),
        }
    }
}

pub(crate) fn usage(msg: String) -> Failure {
    Failure {
        code: 2,
        err: anyhow::anyhow!(msg),
    }
}

impl Global {
    fn target(&self) -> Result<&str, Failure> {
        self.target
            .as_deref()
            .ok_or_else(|| usage("--target URL is required (e.g. tcp://127.0.0.1:7420)".into()))
    }

    fn host(&self) -> Result<HostIdentity, Failure> {
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

    fn subsystem(&self) -> Result<Nqn, Failure> {
        let n = self
            .nqn
            .as_deref()
            .ok_or_else(|| usage("--nqn NQN (the subsystem) is required".into()))?;
        Nqn::new(n).map_err(|e| usage(format!("--nqn {n:?}: {e}")))
    }

    fn persist_method(&self) -> Option<PersistMethod> {
        self.persist.as_deref().and_then(|m| m.parse().ok())
    }

    /// The data path's connection, with queue depth `depth`.
    fn connection(&self, depth: usize) -> Result<Connection, Failure> {
        Ok(
            Connection::new(self.target()?, self.subsystem()?, self.host()?)
                .with_connect_options(self.options()?)
                .with_queue_options(QueueOptions {
                    depth,
                    persist: self.persist_method(),
                    reconnect: self.reconnect_policy()?,
                    ..QueueOptions::default()
                }),
        )
    }

    fn reconnect_policy(&self) -> Result<ReconnectPolicy, Failure> {
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

    fn options(&self) -> Result<ConnectOptions, Failure> {
        if !(self.timeout.is_finite() && self.timeout > 0.0 && self.timeout <= 3600.0) {
            return Err(usage(format!(
                "--timeout {}: give seconds, more than 0 and at most 3600",
                self.timeout
            )));
        }
        Ok(ConnectOptions {
            timeout: Duration::from_secs_f64(self.timeout),
            ..ConnectOptions::default()
        })
    }
}

#[derive(Serialize)]
struct NamespaceJson {
    nsid: u32,
    size: u64,
    block_size: u32,
    domain: String,
    durability: Vec<&'static str>,
    read_only: bool,
    atomic_write_unit: u32,
}

impl From<&NamespaceDescriptor> for NamespaceJson {
    fn from(n: &NamespaceDescriptor) -> Self {
        NamespaceJson {
            nsid: n.nsid,
            size: n.size,
            block_size: n.block_size,
            domain: n.domain.to_string(),
            durability: n.durability.names(),
            read_only: n.read_only,
            atomic_write_unit: n.atomic_write_unit,
        }
    }
}

fn print_json(v: &impl Serialize) -> Result<(), Failure> {
    let s = serde_json::to_string_pretty(v).map_err(|e| Failure {
        code: 1,
        err: e.into(),
    })?;
    println!("{s}");
    Ok(())
}

fn discover(g: &Global) -> Result<(), Failure> {
    let target = g.target()?;
    let entries = rpma_initiator::discover(target, &g.host()?, &g.options()?)?;
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

fn identify(g: &Global) -> Result<(), Failure> {
    let target = g.target()?;
    let subsystem = g.subsystem()?;
    let id = rpma_initiator::identify(target, &subsystem, &g.host()?, &g.options()?)?;
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
        println!(
            "  nsid {}: {} bytes, block {}, domain {}, durability {}, {}",
            n.nsid,
            n.size,
            n.block_size,
            n.domain,
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

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let g = &cli.global;
    let result = match &cli.command {
        Command::Discover => discover(g),
        Command::Identify => identify(g),
        Command::List => cli::list(g),
        Command::Read {
            offset,
            length,
            out,
        } => cli::read(g, *offset, *length, out.as_deref()),
        Command::Write {
            offset,
            source,
            length,
            durable,
        } => cli::write(g, *offset, source, *length, *durable),
        Command::Verify {
            offset,
            source,
            length,
        } => cli::verify(g, *offset, source, *length),
        Command::Flush { offset, length } => cli::flush(g, *offset, *length),
        Command::Cas {
            offset,
            expected,
            new,
        } => cli::cas(g, *offset, *expected, *new),
        Command::Faa { offset, add } => cli::faa(g, *offset, *add),
        Command::Bench {
            offset,
            yes,
            io_size,
            count,
            total,
            depth,
            fio,
        } if fio.job.is_none() => cli::bench::run(
            g,
            &cli::bench::Params {
                offset: *offset,
                yes: *yes,
                io_size: *io_size,
                count: *count,
                total: *total,
                depth: *depth,
            },
        ),
        Command::Bench { fio, .. } => cli::fio::run(g, fio),
        Command::Nbd {
            socket,
            listen,
            export,
            queue_depth,
        } => cli::nbd::run(
            g,
            &cli::nbd::Params {
                socket: socket.clone(),
                listen: listen.clone(),
                export: export.clone(),
                queue_depth: usize::from(*queue_depth),
            },
        ),
        Command::Mount {
            dir,
            loop_dev,
            file_name,
        } => mount::mount(
            g,
            &mount::MountArgs {
                dir,
                loop_dev: *loop_dev,
                file_name: file_name.as_deref(),
            },
        ),
        Command::Umount { dir } => mount::umount(g, dir),
        Command::Completions { shell } => {
            use clap::CommandFactory;
            let mut cmd = Cli::command();
            clap_complete::generate(*shell, &mut cmd, "rpma-initiator", &mut std::io::stdout());
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("rpma-initiator: error: {:#}", f.err);
            ExitCode::from(f.code)
        }
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
