use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// rpma-target serves persistent memory (a pmem/DAX file, a devdax device, or for testing a regular or
/// tmpfs file) to remote initiators as directly writable, durable block storage.
#[derive(Debug, Parser)]
#[command(name = "rpma-target", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
        /// Allow growing an existing file to --size.
        #[arg(long)]
        grow: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Probe {
            path,
            size,
            block_size,
            force_dax,
            grow,
            json,
        } => rpma_target::probe::run(&rpma_target::probe::ProbeArgs {
            path,
            size,
            block_size,
            force_dax,
            grow,
            json,
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rpma-target: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
