use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// rpma-target serves namespaces to remote initiators as directly writable block storage,
/// durable where the backing store is: a file on a DAX filesystem or a devdax device (dax), or a
/// regular file on any other filesystem (page-cache: durable through msync/fdatasync). tmpfs
/// files are served as volatile (no durability) and are for testing.
///
/// Run the daemon in the foreground with `rpma-target --config FILE`.
#[derive(Debug, Parser)]
#[command(name = "rpma-target", version, about, long_about = None, args_conflicts_with_subcommands = true)]
struct Cli {
    /// Run the daemon (in the foreground) with this configuration file.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Open (creating and fully allocating if needed) a namespace backing store, map it and print
    /// its probed persistence domain and what makes a byte durable there.
    Probe {
        /// Backing store: a regular file (created if missing) or a devdax character device.
        path: PathBuf,
        /// Size for a new file, e.g. 64MiB, 1G, 4096. Not needed for an existing file or devdax.
        #[arg(long)]
        size: Option<String>,
        /// Block size the size must be a multiple of (512 or 4096).
        #[arg(long, default_value_t = 4096)]
        block_size: u64,
        /// Treat the mapping as DAX (cache write-back makes bytes durable) even though it is not:
        /// for testing and benchmarking on DRAM. The domain then reads `dax (forced)`.
        #[arg(long)]
        force_dax: bool,
        /// Allow growing an existing file to --size (refused for a file a running rpma-target
        /// serves: grow that through its configuration).
        #[arg(long)]
        grow: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Validate a configuration file and print, per namespace, what the daemon would do with it
    /// (create, grow, open or refuse), its persistence domain and the durability methods it would
    /// offer, changing nothing; exit non-zero on any problem.
    CheckConfig {
        /// The configuration file.
        file: PathBuf,
    },
    /// Show a running daemon's listeners, subsystems, namespaces and sessions.
    Status(StatusArgs),
    /// Make a FAILED namespace (a write-back of its file failed, or a page of it could not be
    /// read back: a media error, its file truncated) durable again, once you have
    /// fixed the cause: the daemon reopens it, closes its sessions, forgets the failure in its
    /// state file and logs what may have been lost. Until then reloads and restarts keep it
    /// failed.
    ClearFailure(ClearArgs),
    /// Reload a running daemon's configuration (as SIGHUP does) and wait until the reload is
    /// done: exit 0 with what changed, or 1 with why it failed (the running configuration is
    /// kept), or 1 when it is applied but poll loops busy with a long sync had not applied it
    /// after 5 s (their sessions still reach the files it removed or replaced: do not reuse
    /// them until `status` no longer says so). The unit's ExecReload, so that `systemctl reload` reports the outcome. Root
    /// or the daemon's user.
    Reload(ReloadArgs),
}

#[derive(Debug, Args)]
struct ReloadArgs {
    #[command(flatten)]
    socket: SocketArgs,
    /// Print the outcome as JSON ({"reloaded": bool, "message": ..., "loops_not_applied": N}).
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct ClearArgs {
    /// The failed namespace's subsystem NQN.
    subsystem: String,
    /// Its namespace id.
    nsid: u32,
    #[command(flatten)]
    socket: SocketArgs,
}

#[derive(Debug, Args)]
struct StatusArgs {
    #[command(flatten)]
    socket: SocketArgs,
    /// Print the daemon's JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Where a running daemon's control socket is (status, reload, clear-failure).
#[derive(Debug, Args)]
struct SocketArgs {
    /// The daemon's control socket [default: /run/rpma-target/control.sock; with --config,
    /// the one the configuration names].
    #[arg(long, value_name = "PATH", conflicts_with = "config")]
    socket: Option<PathBuf>,
    /// Take the control socket from this configuration file.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

impl SocketArgs {
    fn path(self) -> anyhow::Result<PathBuf> {
        Ok(match (self.socket, self.config) {
            (Some(s), _) => s,
            (None, Some(c)) => rpma_target::config::control_socket_of(&c)?,
            (None, None) => PathBuf::from(rpma_target::config::DEFAULT_CONTROL_SOCKET),
        })
    }
}

fn clear_failure(args: ClearArgs) -> anyhow::Result<()> {
    let socket = args.socket.path()?;
    let said = rpma_target::control::clear_failure(&socket, &args.subsystem, args.nsid)?;
    println!("cleared: {said}");
    Ok(())
}

fn reload(args: ReloadArgs) -> anyhow::Result<()> {
    let socket = args.socket.path()?;
    let (ok, said, lagging) = rpma_target::control::reload(&socket)?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "reloaded": ok, "message": said, "loops_not_applied": lagging })
        );
    } else if ok {
        println!("reloaded: {said}");
    }
    anyhow::ensure!(
        ok,
        "the reload failed, the running configuration is kept: {said}"
    );
    // Not done yet: a script that reuses a removed file once this succeeds must not go on.
    anyhow::ensure!(
        lagging == 0,
        "the reload is applied, but {lagging} poll loop(s) had not applied it when the daemon \
         stopped waiting: their sessions still reach the namespace files it removed or replaced \
         until they do (`rpma-target status` says so until then)"
    );
    Ok(())
}

fn status(args: StatusArgs) -> anyhow::Result<()> {
    let socket = args.socket.path()?;
    let (st, raw) = rpma_target::control::query_status(&socket)?;
    if args.json {
        println!("{}", raw.trim_end());
    } else {
        print!("{}", rpma_target::control::render(&st));
    }
    Ok(())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = Cli::parse();
    let result = match (cli.config, cli.command) {
        (Some(config), None) => {
            rpma_target::daemon::run(&config, Box::new(rpma_target::serve::FabricServe::new()))
                .map_err(anyhow::Error::from)
        }
        (None, Some(Command::CheckConfig { file })) => {
            let mut out = std::io::stdout().lock();
            return match rpma_target::check::check_config(&file, &mut out) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::FAILURE,
                Err(e) => {
                    eprintln!("rpma-target: error: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        (None, Some(Command::Status(args))) => status(args),
        (None, Some(Command::Reload(args))) => reload(args),
        (None, Some(Command::ClearFailure(args))) => clear_failure(args),
        (
            None,
            Some(Command::Probe {
                path,
                size,
                block_size,
                force_dax,
                grow,
                json,
            }),
        ) => rpma_target::probe::run(&rpma_target::probe::ProbeArgs {
            path,
            size,
            block_size,
            force_dax,
            grow,
            json,
        }),
        (_, _) => {
            eprintln!(
                "rpma-target: give --config FILE to run the daemon, or a subcommand (see --help)"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rpma-target: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
