use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use rpma_common::proto::auth::Psk;
use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::NamespaceDescriptor;
use rpma_initiator::{ConnectOptions, Error, HostIdentity};
use serde::Serialize;

const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  any other error
  2  bad command line
  3  the target could not be reached, did not answer in time, or the connection broke
  4  the target refused: unknown subsystem, host not allowed, unsupported version, other refusals
  5  authentication failed (wrong or missing key, or the target failed to prove the key)";

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
    /// This host's NQN [default: /etc/nvme/hostnqn, else derived from /etc/machine-id].
    #[arg(long, global = true, value_name = "NQN")]
    hostnqn: Option<String>,
    /// This host's pre-shared key (hex, 32-64 bytes; mode 0600), when the target requires one.
    #[arg(long, global = true, value_name = "FILE")]
    psk_file: Option<PathBuf>,
    /// Deadline for connecting and for each answer, in seconds.
    #[arg(long, global = true, value_name = "SECONDS", default_value_t = 10.0)]
    timeout: f64,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the subsystems the target lets this host see, with their listen URLs.
    Discover,
    /// Connect to a subsystem and print its namespaces (size, block size, persistence domain,
    /// durability methods), then disconnect.
    Identify {
        /// The subsystem NQN.
        #[arg(long, value_name = "NQN")]
        nqn: String,
    },
}

/// A failure with its exit code.
struct Failure {
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
            _ => 1,
        };
        Failure {
            code,
            err: e.into(),
        }
    }
}

fn usage(msg: String) -> Failure {
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

fn identify(g: &Global, nqn: &str) -> Result<(), Failure> {
    let target = g.target()?;
    let subsystem = Nqn::new(nqn).map_err(|e| usage(format!("--nqn {nqn:?}: {e}")))?;
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
    let result = match &cli.command {
        Command::Discover => discover(&cli.global),
        Command::Identify { nqn } => identify(&cli.global, nqn),
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
                "identify",
                "--nqn",
                "n",
            ][..],
            &[
                "rpma-initiator",
                "identify",
                "--nqn",
                "n",
                "--target",
                "tcp://h:1",
                "--json",
            ],
        ] {
            let c = Cli::try_parse_from(args).unwrap();
            assert!(c.global.json);
            assert_eq!(c.global.target.as_deref(), Some("tcp://h:1"));
            assert!(matches!(c.command, Command::Identify { ref nqn } if nqn == "n"));
        }
        assert!(Cli::try_parse_from(["rpma-initiator", "identify"]).is_err());
    }

    #[test]
    fn bad_options_are_usage_errors() {
        let g = Global {
            target: None,
            hostnqn: Some("not an nqn".into()),
            psk_file: None,
            timeout: 0.0,
            json: false,
        };
        assert_eq!(g.target().err().map(|f| f.code), Some(2));
        assert_eq!(g.host().err().map(|f| f.code), Some(2));
        assert_eq!(g.options().err().map(|f| f.code), Some(2));
    }
}
