//! rpma-initiator, the command line: parses the arguments ([`cli::Cli`]), runs the subcommand
//! and exits with the code its failure maps to ([`cli::Failure`]).

use std::process::ExitCode;

use clap::Parser;

mod cli;
mod mount;

use cli::{Cli, Command};

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let g = &cli.global;
    let result = match &cli.command {
        Command::Discover => cli::control::discover(g),
        Command::Identify => cli::control::identify(g),
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
        Command::Bench { fio, .. }
            if fio.job.is_none()
                && (fio.copy_writes || fio.copy_reads || fio.output_format.is_some()) =>
        {
            Err(cli::usage(
                "--copy-writes, --copy-reads and --output-format go with --job FILE".into(),
            ))
        }
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
            replay_bytes,
            limits,
        } => cli::nbd::run(
            g,
            &cli::nbd::Params {
                socket: socket.clone(),
                listen: listen.clone(),
                export: export.clone(),
                queue_depth: usize::from(*queue_depth),
                replay_bytes: *replay_bytes as usize,
                limits: limits.client_limits(),
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
